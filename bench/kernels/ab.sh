#!/bin/bash
# ab.sh — one device call that compares two builds of the decode kernels side by side: builds
# gpu_check and bench_kernels twice, sm_90a only, "old" with the decode kernels from AB_OLD_SRC
# and AB_OLD as EXTRA_NVCCFLAGS, "new" from AB_NEW_SRC with AB_NEW (default: the product's
# kernels/decode_sm90.cu both times, new with the v9 variants switched on, see
# bench/KERNELS-NOTES.md), runs gpu_check on new (compute-sanitizer memcheck and racecheck
# --small beside it), then bench_kernels for old, new, old, new at one point and prints a table
# of the four times and new/old. bench/kernels/speed.sh does the same for several variants and
# the full grid of shapes.
#
#   bench/kernels/ab.sh            from the repository root; logs under $OUT (or ./out)
# Environment: AB_OLD_SRC, AB_NEW_SRC (the decode kernels' translation unit, make's
# DECODE_SRC), AB_OLD, AB_NEW (compile flags), AB_BUILD (build directory prefix, default
# build-ab: build-ab-old and build-ab-new), AB_BENCH (bench_kernels arguments, default
# --B 1,64 --N 131072 --cfg bitdecoding-nvfp4 --reps 20), AB_SAN=0 skips the sanitizers,
# BD_GPU_CAPTURE (real-KV file for gpu_check, as in run.sh). Exit status: non-zero when a build,
# a check, a sanitizer or a benchmark run failed.
set -u
. "$(dirname "$0")/san.sh"
OUT=${OUT:-out}
mkdir -p "$OUT"
PFX=${AB_BUILD:-build-ab}
OLD_SRC=${AB_OLD_SRC:-kernels/decode_sm90.cu}
NEW_SRC=${AB_NEW_SRC:-kernels/decode_sm90.cu}
OLD_FLAGS=${AB_OLD-}
NEW_FLAGS=${AB_NEW--DBD_V9_LDSM=1 -DBD_V9_MXF8=1}
BENCH=${AB_BENCH:---B 1,64 --N 131072 --cfg bitdecoding-nvfp4 --reps 20}
SAN=${AB_SAN:-1}
JOBS=$(($(nproc) / 2))
[ "$JOBS" -ge 1 ] || JOBS=1
T0=$(date +%s)
rc=0
step() { echo "=== $1 (+$(($(date +%s) - T0)) s)"; }

step "build old [$OLD_SRC $OLD_FLAGS] and new [$NEW_SRC $NEW_FLAGS], sm_90a"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader 2>&1 | head -2
build() { # dir source flags log
	timeout 300 make --no-print-directory BUILD="$1" GENCODE_BW= DECODE_SRC="$2" \
		EXTRA_NVCCFLAGS="$3" -j"$JOBS" "$1/bin/gpu_check" "$1/bin/bench_kernels" \
		>"$4" 2>&1
}
build "$PFX-old" "$OLD_SRC" "$OLD_FLAGS" "$OUT/ab_build_old.log" &
p_old=$!
build "$PFX-new" "$NEW_SRC" "$NEW_FLAGS" "$OUT/ab_build_new.log" &
p_new=$!
wait $p_old
r_old=$?
wait $p_new
r_new=$?
obj_old="$PFX-old/${OLD_SRC%.cu}.o"
obj_new="$PFX-new/${NEW_SRC%.cu}.o"
for s in old new; do
	r=$r_old obj=$obj_old
	[ $s = new ] && r=$r_new obj=$obj_new
	if [ "$r" != 0 ]; then
		echo "BUILD $s FAILED (exit $r)"
		grep -E "error|Error" "$OUT/ab_build_$s.log" | head -20
		tail -10 "$OUT/ab_build_$s.log"
		exit 1
	fi
	# registers and local memory (spills) of the FP4 decode kernels, <D,MODE,NV|MX>
	CO=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
	fp4_regs "$s" "$obj"
done

# static SASS of the page loops, by pipe (bench/kernels/sass_loop.py)
"$CO" --dump-sass "$obj_old" >"$OUT/ab_old.sass" 2>/dev/null
"$CO" --dump-sass "$obj_new" >"$OUT/ab_new.sass" 2>/dev/null
python3 bench/kernels/sass_loop.py "$OUT/ab_old.sass" "$OUT/ab_new.sass" 2>&1 | grep -E "kernel|<128"
gzip -f "$OUT/ab_old.sass" "$OUT/ab_new.sass"

cap=${BD_GPU_CAPTURE:-$PFX-new/gpu-data/smollm2_kv.bin}
[ -f "$cap" ] && export BD_GPU_CAPTURE="$cap"
step "check new${BD_GPU_CAPTURE:+ (real KV: $BD_GPU_CAPTURE)}"
san_pid=
if [ "$SAN" = 1 ]; then
	san_run "$PFX-new/bin/gpu_check" ab_san_ 100 &
	san_pid=$!
fi
timeout 200 "$PFX-new/bin/gpu_check" >"$OUT/ab_check.log" 2>&1
r=$?
grep -E "FAIL|FATAL" "$OUT/ab_check.log" | head -20
tail -3 "$OUT/ab_check.log"
[ "$r" = 0 ] || { echo "gpu_check FAILED (exit $r)"; rc=1; }
if [ -n "$san_pid" ]; then
	wait "$san_pid"
	san_report ab_san_ 2 || rc=1
fi

# old, new, old, new: a drift of the card (clocks, heat) shows as old ≠ old
for run in 1 2 3 4; do
	s=old
	[ $((run % 2)) = 0 ] && s=new
	step "bench $run: $s ($BENCH)"
	# shellcheck disable=SC2086
	timeout 90 "$PFX-$s/bin/bench_kernels" $BENCH >"$OUT/ab_bench_$run.log" 2>&1
	r=$?
	grep -E "^\|" "$OUT/ab_bench_$run.log" | grep -v -- "---" | tail -n +2
	[ "$r" = 0 ] || { echo "bench_kernels $s FAILED (exit $r)"; tail -5 "$OUT/ab_bench_$run.log"; rc=1; }
done

step "table (time per decode step, µs)"
echo "| kernel | B | N | old 1 | new 1 | old 2 | new 2 | new/old (mean) | check rel err (new) |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
awk -F'|' 'FNR == 1 { run++ }
	/^\| / && $2 !~ /kernel|---/ {
		key = $2 "|" $3 "|" $4; gsub(/ /, "", key)
		t[key, run] = $6 + 0; err[key, run] = $10
		if (!(key in seen)) { seen[key] = 1; order[++n] = key }
	}
	END {
		for (i = 1; i <= n; i++) {
			k = order[i]; split(k, f, "|")
			o = (t[k, 1] + t[k, 3]) / 2; w = (t[k, 2] + t[k, 4]) / 2
			printf "| %s | %s | %s | %.1f | %.1f | %.1f | %.1f | %.4f | %s |\n", f[1], f[2], f[3],
				t[k, 1], t[k, 2], t[k, 3], t[k, 4], (o > 0 ? w / o : 0), err[k, 4]
		}
	}' "$OUT/ab_bench_1.log" "$OUT/ab_bench_2.log" "$OUT/ab_bench_3.log" "$OUT/ab_bench_4.log"
step "done rc=$rc"
exit $rc
