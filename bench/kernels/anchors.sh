#!/bin/bash
# anchors.sh — bdfp4's decode kernels beside the kernels a user would pick instead, in one
# device call: bench_kernels (full recipe, vanilla FP4, MXFP4, our BF16), cuDNN BF16
# (sdpa_ref.py) and FlashInfer BF16 / FP8 paged decode (flashinfer_ref.py), for the Qwen3-4B
# (Hkv 8) and Qwen3-30B-A3B (Hkv 4) attention shapes at B 1, 8, 64 and N 8K, 32K, 128K; then
# one table per shape (anchors_table.py). Logs and tables under $OUT (default ./out).
#
#   BUILD=build-dev bench/kernels/anchors.sh      (bench_kernels already built in $BUILD)
# FlashInfer comes from PyPI as wheels (flashinfer-python and apache-tvm-ffi; its kernels are
# compiled by its JIT with the machine's nvcc on first use): install them on PYTHONPATH first.
set -u
OUT=${OUT:-out}
BUILD=${BUILD:-build-dev}
B=${ANCHOR_B:-1,8,64}
N=${ANCHOR_N:-8192,32768,131072}
here=$(dirname "$0")
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
rc=0
for hkv in ${ANCHOR_HKV:-8 4}; do
	echo "=== hkv $hkv ($(date +%T))"
	timeout 200 "$BUILD/bin/bench_kernels" --hkv "$hkv" --B "$B" --N "$N" \
		--cfg bitdecoding-nvfp4,nvfp4-base,bitdecoding-mxfp4,bf16 >"$OUT/bench_hkv$hkv.log" 2>&1 || rc=1
	timeout 150 python3 "$here/sdpa_ref.py" --hkv "$hkv" --B "$B" --N "$N" \
		>"$OUT/sdpa_hkv$hkv.log" 2>&1 || rc=1
	timeout 300 python3 "$here/flashinfer_ref.py" --hkv "$hkv" --B "$B" --N "$N" \
		>"$OUT/fi_hkv$hkv.log" 2>&1 || rc=1
	head -2 "$OUT/fi_hkv$hkv.log"
	python3 "$here/anchors_table.py" "$OUT" "$hkv" | tee "$OUT/anchors_hkv$hkv.md"
done
exit $rc
