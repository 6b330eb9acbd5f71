/* bd_fp4.h — element formats, block quantizers and the Walsh–Hadamard transform.
 *
 * The one owner of FP4 numerics in bdfp4: NUMERICS.md sections 1–6 (BitDecoding-FP4,
 * arXiv 2611.09825, sections 3.1–3.3 and appendix E; OCP Microscaling spec; NVIDIA NVFP4).
 * All arithmetic is IEEE FP32 in the order the comments give; this file is compiled with
 * -ffp-contract=off so that the CUDA quantizers (which use __fmul_rn/__fdiv_rn) produce the
 * same bytes from the same inputs.
 *
 * Conventions: codes are unsigned bytes; an E2M1 code is sign<<3 | magnitude index and two
 * codes pack into one byte, element 0 in the low nibble. Errors are -errno: -EINVAL for a bad
 * argument, -EDOM for a non-finite input (NaN or ±inf), which is never encoded.
 */
#ifndef BD_FP4_H
#define BD_FP4_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
	BD_NVFP4_BLOCK = 16, /* elements per NVFP4 block (E4M3 scale) */
	BD_MXFP4_BLOCK = 32, /* elements per MXFP4 block (UE8M0 scale) */
	BD_FWHT_MAX = 1024,  /* largest d the Walsh–Hadamard transform accepts */
};

/* E4M3 code of the largest finite value, 448 (0x7e); 0x7f and 0xff are NaN. */
#define BD_E4M3_MAX_CODE 0x7e
/* NVFP4 decode-scale denominators: g = amax / (6 * BD_NVFP4_KV_SMAX) for keys and values
 * (headroom for the scale-to-4 candidate), amax / (6 * BD_NVFP4_Q_SMAX) for queries. */
#define BD_NVFP4_KV_SMAX 256.0f
#define BD_NVFP4_Q_SMAX 448.0f

/* The IEEE binary32 bit pattern of x, and the float of a bit pattern (the test vectors and the
 * calibration file store floats as bit patterns). */
uint32_t bd_f32_bits(float x);
float bd_f32_from_bits(uint32_t u);

/* max |x_i| over n values (0 for n = 0): the amax of NUMERICS.md §2 (finite inputs). */
float bd_abs_max(const float *x, size_t n);

/* True when all n values of x are finite (x may be NULL when n is 0): the quantizers and the
 * reference decoder refuse NaN and ±inf inputs (-EDOM) rather than encode them. */
bool bd_all_finite(const float *x, size_t n);

/* ---- BF16 ----------------------------------------------------------------------------- */

typedef uint16_t bd_bf16;

/* Exact widening of a BF16 value to FP32. */
static inline float bd_bf16_to_f32(bd_bf16 h)
{
	union {
		uint32_t u;
		float f;
	} v = { .u = (uint32_t)h << 16 };
	return v.f;
}

/* FP32 → BF16, round to nearest even; NaN stays a (quiet) NaN, ±inf stays ±inf. */
bd_bf16 bd_f32_to_bf16(float x);

/* ---- element formats (NUMERICS.md §1) --------------------------------------------------- */

/* E2M1 encode: nearest of ±{0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the code whose mantissa bit is
 * 0, saturating at ±6; a value rounding to zero keeps its sign (−0.25 → code 8). x must be
 * finite (callers check; NaN encodes as +0 here and is rejected by every quantizer). */
uint8_t bd_e2m1_encode(float x);
/* E2M1 decode of the low 4 bits of code: exact. */
float bd_e2m1_decode(uint8_t code);

/* E4M3 (OCP "FN", bias 7) encode: round to nearest even, saturate at ±448 (satfinite),
 * subnormals down to 2^-9; x must be finite. */
uint8_t bd_e4m3_encode(float x);
/* E4M3 decode: exact; codes 0x7f and 0xff give NaN. */
float bd_e4m3_decode(uint8_t code);

/* UE8M0 decode: 2^(e − 127) for e in 0..254, NaN for 255. */
float bd_ue8m0_decode(uint8_t e);

/* The decode tables of the three codes: ret_e2m1[16], ret_e4m3[256], ret_ue8m0[256] filled with
 * bd_e2m1_decode, bd_e4m3_decode and bd_ue8m0_decode of every code, so a table lookup gives the
 * decoded value bit for bit (the CPU decoders look codes up instead of decoding them). */
void bd_fp4_decode_tables(float *ret_e2m1, float *ret_e4m3, float *ret_ue8m0);

/* ---- block quantizers (NUMERICS.md §2) ---------------------------------------------------- */

enum bd_scale_rule {
	BD_SCALE_STANDARD = 0, /* NVFP4: κ = 6; MXFP4: e = e_ocp */
	BD_SCALE_SEARCH = 1,   /* NVFP4: best of κ ∈ {6, 4}; MXFP4: best of e_ocp, e_ocp + 1 (keys, §3) */
};

/* NVFP4 decode scale of a set of values: g = amax / (6 · smax) in FP32 (smax is
 * BD_NVFP4_KV_SMAX or BD_NVFP4_Q_SMAX); g = 1 when amax is 0.
 * x: [n] FP32. Returns 0, -EINVAL (n < 0, NULL), -EDOM if any x is non-finite. */
int bd_nvfp4_decode_scale(const float *x, size_t n, float smax, float *ret_g);

/* Quantize one NVFP4 block of 16 values with decode scale g (> 0, finite).
 * For scale maximum κ: s = E4M3(amax_b / κ / g); inv = 1 / (s · g) (0 when s = 0);
 * x̂_i = E2M1(x_i · inv). SEARCH keeps the κ ∈ {6, 4} with the lower Σ (g·s·x̂_i − x_i)²,
 * accumulated in order i = 0..15; ties keep κ = 6.
 * ret_packed: [8] bytes, element 2j in the low nibble of byte j; ret_scale: the E4M3 code.
 * Returns 0, -EINVAL, -EDOM (non-finite x); on error nothing is written. */
int bd_nvfp4_quantize_block(const float x[BD_NVFP4_BLOCK], float g, enum bd_scale_rule rule,
			    uint8_t ret_packed[BD_NVFP4_BLOCK / 2], uint8_t *ret_scale);

/* Dequantize one NVFP4 block: x_i = (g · s) · x̂_i in FP32, in that order. */
void bd_nvfp4_dequantize_block(const uint8_t packed[BD_NVFP4_BLOCK / 2], uint8_t scale, float g,
			       float ret_x[BD_NVFP4_BLOCK]);

/* Quantize a vector of n values (n a multiple of 16) as NVFP4: g from bd_nvfp4_decode_scale
 * with smax, then consecutive blocks of 16. ret_packed: [n/2]; ret_scales: [n/16]; ret_g.
 * Returns 0, -EINVAL, -EDOM; on error nothing is written. */
int bd_nvfp4_quantize(const float *x, size_t n, float smax, enum bd_scale_rule rule,
		      uint8_t *ret_packed, uint8_t *ret_scales, float *ret_g);

/* Quantize one MXFP4 block of 32 values. e_ocp = floor(log2(amax_b)) − 2 (unbiased; amax_b = 0
 * gives scale code 0 and all-zero codes); the scale code is e + 127 clamped to 0..254.
 * x̂_i = E2M1(x_i · 2^-e), saturating. SEARCH also tries e_ocp + 1 and keeps the lower Σ
 * (2^e·x̂_i − x_i)²; ties keep e_ocp (paper appendix E).
 * ret_packed: [16] bytes; ret_scale: the UE8M0 code. Returns 0, -EINVAL, -EDOM. */
int bd_mxfp4_quantize_block(const float x[BD_MXFP4_BLOCK], enum bd_scale_rule rule,
			    uint8_t ret_packed[BD_MXFP4_BLOCK / 2], uint8_t *ret_scale);

/* Dequantize one MXFP4 block: x_i = 2^(scale − 127) · x̂_i. */
void bd_mxfp4_dequantize_block(const uint8_t packed[BD_MXFP4_BLOCK / 2], uint8_t scale,
			       float ret_x[BD_MXFP4_BLOCK]);

/* Read element i of a packed FP4 array (low nibble first). */
static inline uint8_t bd_fp4_get(const uint8_t *packed, size_t i)
{
	return (uint8_t)((packed[i >> 1] >> ((i & 1) * 4)) & 0xf);
}

/* Write element i of a packed FP4 array (low nibble first); code is the low 4 bits. */
static inline void bd_fp4_set(uint8_t *packed, size_t i, uint8_t code)
{
	unsigned sh = (unsigned)(i & 1) * 4;
	packed[i >> 1] = (uint8_t)((packed[i >> 1] & ~(0xfu << sh)) | ((code & 0xfu) << sh));
}

/* ---- Walsh–Hadamard transform (NUMERICS.md §3) -------------------------------------------- */

/* In-place normalized fast Walsh–Hadamard transform of x[d]: butterflies (a+b, a−b) with
 * stride 1, 2, 4, … then every element times 1/sqrtf(d). H is symmetric and orthonormal, so
 * the transform is its own inverse. d must be a power of two in 1..1024.
 * Returns 0, -EINVAL (bad d or NULL), -EDOM (non-finite input; x unchanged). */
int bd_fwht(float *x, int d);

/* ---- dual-residual query quantization (NUMERICS.md §5, paper §3.1) ------------------------ */

enum bd_fp4_format {
	BD_FP4_NVFP4 = 0,
	BD_FP4_MXFP4 = 1,
};

/* Quantized query head: nterms (1 or 2) FP4 vectors of d channels.
 * NVFP4: term t has its own g[t] = amax/(6·448) and standard rule; MXFP4: UE8M0 scales, g = 1. */
struct bd_qquant {
	int d, nterms;
	enum bd_fp4_format fmt;
	float g[2];
	uint8_t codes[2][BD_FWHT_MAX / 2];        /* packed, [nterms][d/2] */
	uint8_t scales[2][BD_FWHT_MAX / BD_NVFP4_BLOCK]; /* [nterms][d/B] */
};

/* Quantize one (already rotated, q' = Hq) query head q[d]: q⁽¹⁾ = Q(q'), and with nterms = 2
 * q⁽²⁾ = Q(q' − deq(q⁽¹⁾)), the residual computed in FP32. d a multiple of the block (16 or
 * 32) and ≤ 1024. Returns 0, -EINVAL, -EDOM. */
int bd_query_quantize(const float *q, int d, enum bd_fp4_format fmt, int nterms,
		      struct bd_qquant *ret);

/* Dequantize term t of a quantized query into ret_q[d] (g·s·x̂ for NVFP4, 2^e·x̂ for MXFP4). */
void bd_query_dequantize(const struct bd_qquant *qq, int t, float *ret_q);

/* ---- probability block quantization (NUMERICS.md §6, paper §3.2) -------------------------- */

/* Probability scaling parameters: c = 8 and τ = 21/1024 for underflow-aware scaling; c = 1 and
 * underflow_aware = false for the standard max/6 rule. */
struct bd_pscale {
	float c;
	float tau;
	bool underflow_aware;
};

/* Quantize one block of 16 probabilities P_i = exp2(S_i − m + log2 c) whose largest
 * unnormalized probability is p_max = exp2(max S_b − m) (both ≥ 0, finite; masked keys have
 * P_i = 0). κ = 2 if underflow_aware and p_max ≤ τ/c, else 6; s_P = E4M3(c·p_max/κ);
 * P̂_i = E2M1(P_i · (1/s_P)), all zero when s_P = 0.
 * ret_phat: [16] the E2M1 values (not codes); ret_scale: the E4M3 code of s_P. */
void bd_p_quantize_block_nvfp4(const float P[BD_NVFP4_BLOCK], float p_max,
			       const struct bd_pscale *ps, float ret_phat[BD_NVFP4_BLOCK],
			       uint8_t *ret_scale);

#ifdef __cplusplus
}
#endif
#endif
