#!/bin/bash
# run.sh — one device session: build, kernel checks, sanitizers, SASS summary, benchmark and
# the torch cuDNN reference, each step under its own time limit, logs under $OUT (or ./out).
#
#   bench/kernels/run.sh [steps]     steps: any of build check san sass bench ncu torch (default all)
# Environment: BUILD (build directory; binaries already in $BUILD/bin that load here are used
# as they are, so a session can build them beside the sources and carry them), BENCH_ARGS
# (bench_kernels arguments), SDPA_ARGS (sdpa_ref.py arguments), BD_GPU_CAPTURE (the real-KV
# file of `make gpu-capture`; default $BUILD/gpu-data/smollm2_kv.bin when it exists).
# With both check and san, the sanitizers run beside the check (both only verify).
set -u
. "$(dirname "$0")/san.sh"
OUT=${OUT:-out}
mkdir -p "$OUT"
BUILD=${BUILD:-build-dev}
STEPS=${*:-build check san sass bench torch}
JOBS=$(nproc)
rc=0
has() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
step() { echo "=== $1 ($(date +%T))"; }
cap=${BD_GPU_CAPTURE:-$BUILD/gpu-data/smollm2_kv.bin}
[ -f "$cap" ] && export BD_GPU_CAPTURE="$cap"

if has build; then
	step build
	{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
	  nvcc --version | tail -1; gcc --version | head -1; } 2>&1 | tee "$OUT/build.log"
	"$BUILD/bin/bench_kernels" --usage >/dev/null 2>&1
	if [ $? = 2 ] && [ -x "$BUILD/bin/gpu_check" ]; then
		echo "using the binaries in $BUILD/bin" | tee -a "$OUT/build.log"
	else
		timeout 400 make --no-print-directory BUILD="$BUILD" -j"$JOBS" \
			EXTRA_NVCCFLAGS="-Xptxas -v" "$BUILD/bin/gpu_check" "$BUILD/bin/bench_kernels" \
			>>"$OUT/build.log" 2>&1 || { echo "BUILD FAILED"; tail -40 "$OUT/build.log"; exit 1; }
	fi
fi
if has check; then
	step "check${BD_GPU_CAPTURE:+ (real KV: $BD_GPU_CAPTURE)}"
	san_pid=
	if has san; then
		san_run "$BUILD/bin/gpu_check" san_ 240 & san_pid=$!
	fi
	timeout 420 "$BUILD/bin/gpu_check" 2>&1 | tee "$OUT/check.log" | grep -E "FAIL|PASS|e4m3|query|promote|FATAL" | head -60
	[ "${PIPESTATUS[0]}" = 0 ] || rc=1
	grep -E "^  real KV" "$OUT/check.log" | awk '{print $3, $9, $10, $12, $13}' | sort -k5 -g | tail -4
	grep -E "^  decode" "$OUT/check.log" | awk '{print $3, $4, $5, $7, $8, $9, $10, $11}' | sort -k8 -g | tail -6
	if [ -n "$san_pid" ]; then
		wait "$san_pid"
		step sanitizers
		san_report san_ 3 || rc=1
	fi
elif has san; then
	step sanitizers
	san_run "$BUILD/bin/gpu_check" san_ 240
	san_report san_ 3 || rc=1
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
