/* bd_ggml_gemv.h — matrix–vector products straight from ggml's weight blocks (the decode step's
 * weight products on the CPU, without an FP32 copy of the weights).
 *
 * W is a matrix [out][in] whose rows are ggml blocks (bd_ggml_quants.h's formats): row o is
 * in / blck blocks at (const uint8_t *)W + o · row_bytes. The product is
 *     y[r][o] = Σ_c W[o][c] · x[r][c]      (r < n_x, o < out, c < in)
 * with FP32 activations x and each weight block dequantized in registers to exactly the FP32
 * values bd_ggml_dequantize() gives (Q4_1: d·q + m by one FMA, which rounds once as the
 * dequantizer's d·q + m does because d·q is exact; Q4_0: d·(q − 8) and Q8_0: d·q, exact
 * products). So the result is the FP32 product of the dequantized matrix, up to the order of the
 * sums: per row and per activation row, each block's w · x by lane-wise FMA into accumulators
 * kept apart for even and odd blocks (bd_ggml_gemv_simd.h), which are added lane by lane and
 * then across the lanes in a fixed order. The weights' formats are ggml's public blocks; no
 * rounding is added to them (NUMERICS.md covers the KV cache, not the weights).
 *
 * Why FP32 activations and not activations quantized per 32 to int8 (ggml's Q8 dot products):
 * bench/bench_wmat.c measured both on SmolLM2-135M's decode step (bench/RESULTS.md): the int8
 * variant (AVX2 byte dot products) takes 0.5–0.6× the CPU time of this file's AVX-512 path,
 * but its rounding of x is a relative error of 5e-3 in every product, while the FP32-activation
 * products are the FP32 sgemv's to 2e-7 and the model's logits stay within 0.09 of the FP32
 * weights' (BF16 KV). llama.cpp's own Q8-activation run of the file is 1.6 away from its F32
 * run (tests/data/model/golden.json), which the golden check against llama.cpp's F32 logits
 * (within 0.25, the same top-1) would not pass.
 *
 * Each activation row's sums do not depend on n_x or on the other rows (the same operations in
 * the same order), so a batch gives bitwise the rows one-row calls give.
 *
 * The code path is chosen once, at first use, from BD_GEMV_ISA in the environment: unset,
 * empty or "auto", the best the CPU has (AVX-512 F/BW/VL/DQ, else AVX2 with FMA and F16C,
 * else portable C); "avx512", "avx2" or "c", that one where the CPU has it (else the best).
 * All paths give the same sums up to FP32 rounding of their different accumulation orders.
 */
#ifndef BD_GGML_GEMV_H
#define BD_GGML_GEMV_H

#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define BD_GGML_GEMV_MAX_X 4 /* activation rows of one call */

/* True when bd_ggml_gemv() multiplies blocks of type t: Q4_0, Q4_1, Q8_0. */
bool bd_ggml_gemv_supported(int t);

/* y[r·ldy + o] = Σ_c W[o][c] · x[r·ldx + c] for r < n_x, o < out, c < in (see the file comment).
 * W: out rows of in / blck blocks of type t, row o at W + o·row_bytes (row_bytes ≥ the row's
 * in / blck · type_size bytes; any alignment); x: n_x rows of in FP32; y: n_x rows of out FP32
 * (not overlapping x). Returns 0, -EINVAL (NULL, out < 1, in < 1, in not a multiple of the
 * type's block, row_bytes too small, n_x outside 1..BD_GGML_GEMV_MAX_X, ldx < in, ldy < out),
 * -ENOTSUP (a type bd_ggml_gemv_supported() refuses); on error y is not written. */
int bd_ggml_gemv(int t, const void *W, size_t row_bytes, int out, int in, const float *x,
		 size_t ldx, int n_x, float *y, size_t ldy);

/* Dequantize n elements of blocks of type t (n / 32 blocks, packed, any alignment) into
 * ret_x [n] FP32 by the path's vector decoders: bit for bit bd_ggml_dequantize()'s values,
 * faster (the prefill's panels of weight rows, bd_wmat.h). Returns 0, -EINVAL (NULL, n not a
 * multiple of 32), -ENOTSUP (a type bd_ggml_gemv_supported() refuses); on error nothing is
 * written. */
int bd_ggml_gemv_dequantize(int t, const void *src, size_t n, float *ret_x);

/* The path bd_ggml_gemv() takes: "avx512", "avx2" or "c". */
const char *bd_ggml_gemv_isa(void);

/* Force a path: "avx512", "avx2" or "c" (tests and benchmarks compare them on one CPU).
 * Returns 0, -ENOTSUP when this CPU lacks the instructions, -EINVAL for another name (or
 * NULL). Not thread-safe against concurrent products. */
int bd_ggml_gemv_set_isa(const char *name);

#ifdef __cplusplus
}
#endif
#endif
