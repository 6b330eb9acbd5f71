#!/bin/bash
# run.sh — one device session: build, kernel checks, sanitizers, SASS summary, benchmark and
# the torch cuDNN reference, each step under its own time limit, logs under $OUT (or ./out).
#
#   bench/kernels/run.sh [steps]     steps: any of build check san sass bench ncu torch (default all)
# Environment: BENCH_ARGS (bench_kernels arguments), SDPA_ARGS (sdpa_ref.py arguments).
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
BUILD=${BUILD:-build-dev}
STEPS=${*:-build check san sass bench torch}
JOBS=$(nproc)
rc=0
has() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
step() { echo "=== $1 ($(date +%T))"; }

if has build; then
	step build
	{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
	  nvcc --version | tail -1; gcc --version | head -1; } 2>&1 | tee "$OUT/build.log"
	timeout 400 make --no-print-directory BUILD="$BUILD" -j"$JOBS" \
		EXTRA_NVCCFLAGS="-Xptxas -v" "$BUILD/bin/gpu_check" "$BUILD/bin/bench_kernels" \
		>>"$OUT/build.log" 2>&1 || { echo "BUILD FAILED"; tail -40 "$OUT/build.log"; exit 1; }
	grep -E "Compiling entry|registers|spill" "$OUT/build.log" | grep -B2 "spill" |
		grep -A2 "decode_kernel\|promote_kernel\|combine" | grep -v "^--" | sed 's/ptxas info *: //' | head -40
fi
if has check; then
	step check
	timeout 420 "$BUILD/bin/gpu_check" 2>&1 | tee "$OUT/check.log" | grep -E "FAIL|PASS|e4m3|query|promote|FATAL" | head -60
	[ "${PIPESTATUS[0]}" = 0 ] || rc=1
	grep -E "^  decode" "$OUT/check.log" | awk '{print $3, $4, $5, $7, $8, $9, $10, $11}' | sort -k8 -g | tail -8
fi
if has san; then
	step sanitizers
	SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
	for tool in memcheck racecheck; do
		timeout 200 "$SAN" --tool $tool --error-exitcode 1 "$BUILD/bin/gpu_check" --small \
			>"$OUT/san_$tool.log" 2>&1
		r=$?
		echo "compute-sanitizer $tool: exit $r"; tail -4 "$OUT/san_$tool.log"
		[ $r = 0 ] || rc=1
	done
fi
if has sass; then
	step sass
	cuobjdump --dump-sass "$BUILD/kernels/decode_sm90.o" >"$OUT/sass.txt" 2>&1
	awk '/Function : /{f=$3} /^ +\/\*[0-9a-f]+\*\/ /{op=$2; if (op ~ /^@/) op=$3; sub(/\..*/, "", op); sub(/;/, "", op); n[f" "op]++}
	     END{for (k in n) print n[k], k}' "$OUT/sass.txt" | sort -k2,2 -k1,1nr >"$OUT/sass_mix.txt"
	grep "fp4_decode_kernelILi128ELi1" "$OUT/sass_mix.txt" | head -25
	gzip -f "$OUT/sass.txt"
fi
if has bench; then
	step bench
	timeout 300 "$BUILD/bin/bench_kernels" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
	[ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if has ncu; then
	step ncu
	NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
	timeout 240 "$NCU" --clock-control none --kernel-name regex:"${NCU_KERNEL:-fp4_decode}" \
		--launch-skip 2 --launch-count 1 --section SpeedOfLight --section WarpStateStats \
		--section SchedulerStats --section Occupancy --section MemoryWorkloadAnalysis \
		"$BUILD/bin/bench_kernels" ${NCU_ARGS:---B 64 --N 32768 --cfg bitdecoding-nvfp4 --reps 1 --novalidate} \
		>"$OUT/ncu.log" 2>&1
	grep -E "Duration|Throughput|Executed Ipc|Issue Slots|Warp Cycles|Achieved Occ|Stall|No Eligible|Active Warps|Eligible Warps|Registers|Block Limit" "$OUT/ncu.log" | head -40
fi
if has torch; then
	step torch
	PYTHONUNBUFFERED=1 timeout 240 python3 bench/kernels/sdpa_ref.py ${SDPA_ARGS:-} 2>&1 | tee "$OUT/sdpa.log"
fi
step "done rc=$rc"
exit $rc
