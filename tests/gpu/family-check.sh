#!/bin/bash
# family-check.sh — one device call (under 4 minutes on one H200, 16 cores) that checks the
# decode kernel families on the GPU it finds:
#   1. builds decode_select_check, gpu_check and bench_kernels; GENCODE_BW= (the default here:
#      a machine without PyPI has no CUTLASS) leaves the native Blackwell objects out, so the
#      family table is checked as it links without them;
#   2. decode_select_check: the table on this device (on Hopper: hopper supported, blackwell-tc
#      and blackwell-mma unsupported, with why), the self-check with the portable kernel
#      standing in for a native one (agreement, a forced mismatch, a NaN), the fallback to
#      hopper with its reason, forced native refused, FP8 pages refused at selection;
#   3. gpu_check in full (every family the device supports: hopper on an H200) and
#      compute-sanitizer memcheck on gpu_check --small;
#   4. bench_kernels at B 1 and 64, N 8K and 32K (every supported family, validated first).
#
#   tests/gpu/family-check.sh          from the repository root; logs under $OUT (default ./out)
# Environment: FC_BUILD (build directory, default build-family), FC_GENCODE_BW (default empty:
# on a Blackwell machine with the CUTLASS wheel under .deps, the Makefile's GENCODE_BW value,
# so that the native families are built and checked too), BD_GPU_CAPTURE (the real-KV file for
# gpu_check). Exit status: non-zero when a build, a check, the sanitizer or the benchmark's
# validation failed.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
B=${FC_BUILD:-build-family}
GBW=${FC_GENCODE_BW-}
T0=$(date +%s)
rc=0
step() { echo "=== $1 (+$(($(date +%s) - T0)) s)"; }

step "build (GENCODE_BW='$GBW')"
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader 2>&1 | head -2
timeout 200 make --no-print-directory BUILD="$B" GENCODE_BW="$GBW" -j"$(nproc)" \
	"$B/bin/decode_select_check" "$B/bin/gpu_check" "$B/bin/bench_kernels" \
	>"$OUT/build.log" 2>&1 || {
	echo "BUILD FAILED"
	grep -E "error|Error" "$OUT/build.log" | head -20
	exit 1
}

step "decode_select_check"
timeout 60 "$B/bin/decode_select_check" 2>&1 | tee "$OUT/select.log"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "decode_select_check FAILED"; rc=1; }

step "gpu_check"
timeout 150 "$B/bin/gpu_check" >"$OUT/check.log" 2>&1 || { echo "gpu_check FAILED"; rc=1; }
grep -E "^family|FAIL|checks passed" "$OUT/check.log" | head -30

step "memcheck gpu_check --small"
san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
timeout 90 "$san" --tool memcheck --error-exitcode 1 "$B/bin/gpu_check" --small \
	>"$OUT/memcheck.log" 2>&1 || { echo "memcheck FAILED"; rc=1; }
tail -3 "$OUT/memcheck.log"

step "bench_kernels"
timeout 60 "$B/bin/bench_kernels" --B 1,64 --N 8192,32768 --reps 5 2>&1 | tee "$OUT/bench.log"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "bench_kernels FAILED"; rc=1; }

step "done: exit $rc"
exit $rc
