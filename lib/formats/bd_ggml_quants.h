/* bd_ggml_quants.h — ggml tensor types and their dequantization to FP32.
 *
 * The weight formats a GGUF file stores (ggml's public block formats: a block of `blck`
 * elements occupies `type_size` bytes, all multi-byte fields little-endian). Model loading
 * turns them into FP32 here; the KV cache never uses these formats (its FP4 is bd_fp4.h's).
 * Arithmetic is FP32 in the order each format's comment gives (built with -ffp-contract=off),
 * which makes the results bit-identical to the reference dequantizers of gguf-py.
 */
#ifndef BD_GGML_QUANTS_H
#define BD_GGML_QUANTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ggml_type ids as stored in a GGUF tensor info (gaps are ids ggml retired). */
enum bd_ggml_type {
	BD_GGML_F32 = 0,
	BD_GGML_F16 = 1,
	BD_GGML_Q4_0 = 2,
	BD_GGML_Q4_1 = 3,
	BD_GGML_Q5_0 = 6,
	BD_GGML_Q5_1 = 7,
	BD_GGML_Q8_0 = 8,
	BD_GGML_Q8_1 = 9,
	BD_GGML_Q2_K = 10,
	BD_GGML_Q3_K = 11,
	BD_GGML_Q4_K = 12,
	BD_GGML_Q5_K = 13,
	BD_GGML_Q6_K = 14,
	BD_GGML_Q8_K = 15,
	BD_GGML_IQ2_XXS = 16,
	BD_GGML_IQ2_XS = 17,
	BD_GGML_IQ3_XXS = 18,
	BD_GGML_IQ1_S = 19,
	BD_GGML_IQ4_NL = 20,
	BD_GGML_IQ3_S = 21,
	BD_GGML_IQ2_S = 22,
	BD_GGML_IQ4_XS = 23,
	BD_GGML_I8 = 24,
	BD_GGML_I16 = 25,
	BD_GGML_I32 = 26,
	BD_GGML_I64 = 27,
	BD_GGML_F64 = 28,
	BD_GGML_IQ1_M = 29,
	BD_GGML_BF16 = 30,
	BD_GGML_TQ1_0 = 34,
	BD_GGML_TQ2_0 = 35,
	BD_GGML_MXFP4 = 39,
	BD_GGML_NVFP4 = 40,
	BD_GGML_Q1_0 = 41,
	BD_GGML_TYPE_LIMIT /* one past the largest id known here */
};

/* Block geometry of type t: elements per block and bytes per block. Every known type has one,
 * including those this file cannot dequantize (so a GGUF parser can bounds-check them).
 * Returns 0, or -EINVAL for an unknown or retired id (nothing written). */
int bd_ggml_type_info(int t, size_t *ret_blck, size_t *ret_type_size);

/* ggml's name of type t ("F32", "Q4_K", …), or NULL for an unknown id. */
const char *bd_ggml_type_name(int t);

/* True when bd_ggml_dequantize() handles t: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
 * Q4_K, Q5_K, Q6_K. */
bool bd_ggml_can_dequantize(int t);

/* Exact IEEE half → FP32 (subnormals, ±inf and NaN payloads kept). */
float bd_f16_to_f32(uint16_t h);

/* Dequantize n elements of type t from src (n / blck blocks, packed, any alignment) into
 * ret_x[n] FP32. Formats (d, m, dmin are F16 fields; q the stored integers):
 *   F32, F16, BF16  plain conversion (BF16: the upper half of an FP32)
 *   Q4_0  32: d, 16 bytes of nibbles; x_j = d · (q_j − 8), q_j low nibbles (j < 16) then high
 *   Q4_1  32: d, m, nibbles as Q4_0; x_j = d · q_j + m
 *   Q5_0  32: d, 32-bit qh, nibbles; the 5th bit of q_j is bit j of qh; x_j = d · (q_j − 16)
 *   Q5_1  32: d, m, qh, nibbles; x_j = d · q_j + m
 *   Q8_0  32: d, 32 int8; x_j = d · q_j
 *   Q4_K  256: d, dmin, 12 bytes of packed 6-bit (scale, min) for 8 sub-blocks of 32, 128
 *         bytes of nibbles (per 64 elements: 32 bytes, low nibbles first);
 *         x = (d · sc) · q − (dmin · mn)
 *   Q5_K  256: as Q4_K plus 32 bytes qh giving each element's 5th bit
 *   Q6_K  256: 128 bytes low nibbles, 64 bytes of 2-bit high parts, 16 int8 scales, d;
 *         x = (d · sc) · (q − 32)
 * NaN and ±inf in F32/F16/BF16 data, or in a block scale, pass through as IEEE arithmetic
 * gives them; callers that need finite weights check.
 * Returns 0, -EINVAL (NULL, n not a multiple of the block), -ENOTSUP (type not handled);
 * on error nothing is written. */
int bd_ggml_dequantize(int t, const void *src, size_t n, float *ret_x);

#ifdef __cplusplus
}
#endif
#endif
