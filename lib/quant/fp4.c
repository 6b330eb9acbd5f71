/* fp4.c — element formats, NVFP4/MXFP4 block quantizers, the Walsh–Hadamard transform, query
 * and probability quantization (bd_fp4.h; NUMERICS.md §1–2, §3, §5, §6).
 *
 * Every expression is written in the order NUMERICS.md gives and this file is built with
 * -ffp-contract=off: the CUDA quantizers repeat the same FP32 operations (__fmul_rn, __fdiv_rn)
 * and must produce the same bytes, so do not reassociate or "simplify" arithmetic here.
 */
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "quant/bd_fp4.h"

uint32_t bd_f32_bits(float x)
{
	uint32_t u;

	memcpy(&u, &x, sizeof(u));
	return u;
}

float bd_f32_from_bits(uint32_t u)
{
	float x;

	memcpy(&x, &u, sizeof(x));
	return x;
}

/* ---- BF16 ------------------------------------------------------------------------------- */

bd_bf16 bd_f32_to_bf16(float x)
{
	uint32_t u;

	memcpy(&u, &x, sizeof(u));
	/* NaN: truncating could clear every mantissa bit left (0x7f800001 → inf), so force the
	 * quiet bit. */
	if ((u & 0x7fffffffu) > 0x7f800000u)
		return (bd_bf16)((u >> 16) | 0x0040u);
	/* Round to nearest even on the 16 dropped bits; a carry into the exponent is the correct
	 * rounding (up to inf for values above the largest BF16). */
	u += 0x7fffu + ((u >> 16) & 1u);
	return (bd_bf16)(u >> 16);
}

/* ---- element formats (NUMERICS.md §1) ------------------------------------------------------ */

static const float e2m1_values[8] = { 0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f };

uint8_t bd_e2m1_encode(float x)
{
	uint8_t sign, mag;
	float a;

	if (isnan(x))
		return 0;
	/* signbit, not x < 0: −0 and values rounding to zero keep their sign (§1). */
	sign = signbit(x) ? 8 : 0;
	a = fabsf(x);
	/* Midpoints between neighbours; "<=" where the lower neighbour has mantissa bit 0 (ties to
	 * it), "<" where the upper one does. */
	if (a <= 0.25f)
		mag = 0;
	else if (a < 0.75f)
		mag = 1;
	else if (a <= 1.25f)
		mag = 2;
	else if (a < 1.75f)
		mag = 3;
	else if (a <= 2.5f)
		mag = 4;
	else if (a < 3.5f)
		mag = 5;
	else if (a <= 5.0f)
		mag = 6;
	else
		mag = 7;
	return (uint8_t)(sign | mag);
}

float bd_e2m1_decode(uint8_t code)
{
	float v = e2m1_values[code & 7];

	return (code & 8) ? -v : v;
}

uint8_t bd_e4m3_encode(float x)
{
	uint8_t sign;
	float a, f;
	int e, m;

	if (isnan(x))
		return 0x7f;
	sign = signbit(x) ? 0x80 : 0;
	a = fabsf(x);
	if (isinf(a))
		return (uint8_t)(sign | BD_E4M3_MAX_CODE);
	if (a < 0x1p-6f) {
		/* Subnormal range m·2^-9: a·512 is exact, rintf rounds to nearest even. m = 8 is
		 * the smallest normal 2^-6, whose code is 8 as well. */
		m = (int)rintf(a * 512.0f);
		return (uint8_t)(sign | m);
	}
	/* a = f·2^e with f in [0.5, 1): a = (2f)·2^(e−1); (2f − 1)·8 is exact, so rintf is the one
	 * rounding. */
	f = frexpf(a, &e);
	e -= 1;
	m = (int)rintf((f * 2.0f - 1.0f) * 8.0f);
	if (m == 8) {
		m = 0;
		e += 1;
	}
	/* Above 448 (S.1111.110), including the tie 464 that RNE would send to the NaN code. */
	if (e > 8 || (e == 8 && m > 6))
		return (uint8_t)(sign | BD_E4M3_MAX_CODE);
	return (uint8_t)(sign | ((e + 7) << 3) | m);
}

float bd_e4m3_decode(uint8_t code)
{
	int e = (code >> 3) & 0xf, m = code & 7;
	float v;

	if (e == 0xf && m == 7)
		return NAN;
	if (e == 0)
		v = ldexpf((float)m, -9);
	else
		v = ldexpf((float)(8 + m), e - 10); /* (1 + m/8)·2^(e−7) */
	return (code & 0x80) ? -v : v;
}

float bd_ue8m0_decode(uint8_t e)
{
	if (e == 255)
		return NAN;
	return ldexpf(1.0f, (int)e - 127);
}

void bd_fp4_decode_tables(float *ret_e2m1, float *ret_e4m3, float *ret_ue8m0)
{
	for (int i = 0; i < 16; i++)
		ret_e2m1[i] = bd_e2m1_decode((uint8_t)i);
	for (int i = 0; i < 256; i++) {
		ret_e4m3[i] = bd_e4m3_decode((uint8_t)i);
		ret_ue8m0[i] = bd_ue8m0_decode((uint8_t)i);
	}
}

/* ---- block quantizers (NUMERICS.md §2) ------------------------------------------------------ */

bool bd_all_finite(const float *x, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (!isfinite(x[i]))
			return false;
	return true;
}

float bd_abs_max(const float *x, size_t n)
{
	float amax = 0.0f;

	for (size_t i = 0; i < n; i++)
		if (fabsf(x[i]) > amax)
			amax = fabsf(x[i]);
	return amax;
}

static void pack_codes(const uint8_t *codes, size_t n, uint8_t *ret_packed)
{
	for (size_t j = 0; j < n / 2; j++)
		ret_packed[j] = (uint8_t)((codes[2 * j] & 0xf) | ((codes[2 * j + 1] & 0xf) << 4));
}

int bd_nvfp4_decode_scale(const float *x, size_t n, float smax, float *ret_g)
{
	float amax, g;

	if ((!x && n > 0) || !ret_g || !isfinite(smax) || !(smax > 0.0f))
		return -EINVAL;
	if (!bd_all_finite(x, n))
		return -EDOM;
	amax = bd_abs_max(x, n);
	/* The vectors' g matches amax / (6·smax) written this way; for smax = 256 it equals
	 * amax / 1536 and amax / 6 / 256 too (a division by 256 is exact for normal results). */
	g = amax / (6.0f * smax);
	/* amax = 0, or so small that g is not a normal float: every value then quantizes to
	 * (signed) zero, and g = 1 keeps 1 / (s·g) finite. */
	if (!(g >= FLT_MIN))
		g = 1.0f;
	*ret_g = g;
	return 0;
}

/* E2M1 codes [n] of x · inv, unpacked; returns the squared reconstruction error
 * Σ (scale·x̂_i − x_i)², accumulated i = 0..n−1 in FP32 (NUMERICS.md §2: one candidate). */
static float e2m1_candidate(const float *x, int n, float inv, float scale, uint8_t *codes)
{
	float err = 0.0f;

	for (int i = 0; i < n; i++) {
		float d;

		codes[i] = bd_e2m1_encode(x[i] * inv);
		d = scale * bd_e2m1_decode(codes[i]) - x[i];
		err += d * d;
	}
	return err;
}

/* One NVFP4 candidate with scale maximum kappa: codes [16] unpacked, returns the squared
 * reconstruction error Σ ((g·s)·x̂_i − x_i)², accumulated i = 0..15 in FP32. */
static float nvfp4_candidate(const float *x, float amax_b, float g, float kappa, uint8_t *codes,
			     uint8_t *ret_scale)
{
	uint8_t s = bd_e4m3_encode((amax_b / kappa) / g);
	float sv = bd_e4m3_decode(s);
	float inv = sv == 0.0f ? 0.0f : 1.0f / (sv * g);

	*ret_scale = s;
	return e2m1_candidate(x, BD_NVFP4_BLOCK, inv, g * sv, codes);
}

int bd_nvfp4_quantize_block(const float x[BD_NVFP4_BLOCK], float g, enum bd_scale_rule rule,
			    uint8_t ret_packed[BD_NVFP4_BLOCK / 2], uint8_t *ret_scale)
{
	uint8_t c6[BD_NVFP4_BLOCK], c4[BD_NVFP4_BLOCK], s6, s4;
	float amax_b, e6, e4;

	if (!x || !ret_packed || !ret_scale || !isfinite(g) || !(g > 0.0f) ||
	    (rule != BD_SCALE_STANDARD && rule != BD_SCALE_SEARCH))
		return -EINVAL;
	if (!bd_all_finite(x, BD_NVFP4_BLOCK))
		return -EDOM;
	amax_b = bd_abs_max(x, BD_NVFP4_BLOCK);
	e6 = nvfp4_candidate(x, amax_b, g, 6.0f, c6, &s6);
	if (rule == BD_SCALE_SEARCH) {
		/* Four Over Six: κ = 4 only on a strict improvement (ties keep κ = 6). */
		e4 = nvfp4_candidate(x, amax_b, g, 4.0f, c4, &s4);
		if (e4 < e6) {
			pack_codes(c4, BD_NVFP4_BLOCK, ret_packed);
			*ret_scale = s4;
			return 0;
		}
	}
	pack_codes(c6, BD_NVFP4_BLOCK, ret_packed);
	*ret_scale = s6;
	return 0;
}

void bd_nvfp4_dequantize_block(const uint8_t packed[BD_NVFP4_BLOCK / 2], uint8_t scale, float g,
			       float ret_x[BD_NVFP4_BLOCK])
{
	float gs;

	if (!packed || !ret_x)
		return;
	gs = g * bd_e4m3_decode(scale);
	for (int i = 0; i < BD_NVFP4_BLOCK; i++)
		ret_x[i] = gs * bd_e2m1_decode(bd_fp4_get(packed, (size_t)i));
}

int bd_nvfp4_quantize(const float *x, size_t n, float smax, enum bd_scale_rule rule,
		      uint8_t *ret_packed, uint8_t *ret_scales, float *ret_g)
{
	float g;
	int r;

	if (!x || n == 0 || n % BD_NVFP4_BLOCK != 0 || !ret_packed || !ret_scales || !ret_g ||
	    (rule != BD_SCALE_STANDARD && rule != BD_SCALE_SEARCH))
		return -EINVAL;
	/* Validates smax and every value before anything is written. */
	r = bd_nvfp4_decode_scale(x, n, smax, &g);
	if (r < 0)
		return r;
	for (size_t b = 0; b < n / BD_NVFP4_BLOCK; b++) {
		r = bd_nvfp4_quantize_block(x + b * BD_NVFP4_BLOCK, g, rule,
					    ret_packed + b * (BD_NVFP4_BLOCK / 2), ret_scales + b);
		if (r < 0)
			return r; /* unreachable: inputs were checked */
	}
	*ret_g = g;
	return 0;
}

/* floor(log2(a)) − 2 for finite a > 0, exactly (frexpf handles subnormals); the OCP exponent
 * for a = 0 is taken as the lowest, −127, so a zero block gets scale code 0. */
static int mxfp4_e_ocp(float amax_b)
{
	int e;

	if (amax_b == 0.0f)
		return -127;
	(void)frexpf(amax_b, &e); /* amax_b = f·2^e, f in [0.5, 1) */
	return (e - 1) - 2;
}

static int clamp_e8(int e)
{
	return e < -127 ? -127 : e > 127 ? 127 : e;
}

/* One MXFP4 candidate with unbiased exponent e (in −127..127): codes [32] unpacked, returns
 * Σ (2^e·x̂_i − x_i)² accumulated in order. */
static float mxfp4_candidate(const float *x, int e, uint8_t *codes)
{
	return e2m1_candidate(x, BD_MXFP4_BLOCK, ldexpf(1.0f, -e), ldexpf(1.0f, e), codes);
}

int bd_mxfp4_quantize_block(const float x[BD_MXFP4_BLOCK], enum bd_scale_rule rule,
			    uint8_t ret_packed[BD_MXFP4_BLOCK / 2], uint8_t *ret_scale)
{
	uint8_t c0[BD_MXFP4_BLOCK], c1[BD_MXFP4_BLOCK];
	int e_ocp, e0, e1;
	float err0, err1;

	if (!x || !ret_packed || !ret_scale ||
	    (rule != BD_SCALE_STANDARD && rule != BD_SCALE_SEARCH))
		return -EINVAL;
	if (!bd_all_finite(x, BD_MXFP4_BLOCK))
		return -EDOM;
	e_ocp = mxfp4_e_ocp(bd_abs_max(x, BD_MXFP4_BLOCK));
	/* Each candidate is clamped on its own, so the scale code stays in 0..254. */
	e0 = clamp_e8(e_ocp);
	err0 = mxfp4_candidate(x, e0, c0);
	if (rule == BD_SCALE_SEARCH) {
		e1 = clamp_e8(e_ocp + 1);
		err1 = mxfp4_candidate(x, e1, c1);
		if (err1 < err0) { /* ties keep e_ocp (paper appendix E) */
			pack_codes(c1, BD_MXFP4_BLOCK, ret_packed);
			*ret_scale = (uint8_t)(e1 + 127);
			return 0;
		}
	}
	pack_codes(c0, BD_MXFP4_BLOCK, ret_packed);
	*ret_scale = (uint8_t)(e0 + 127);
	return 0;
}

void bd_mxfp4_dequantize_block(const uint8_t packed[BD_MXFP4_BLOCK / 2], uint8_t scale,
			       float ret_x[BD_MXFP4_BLOCK])
{
	float s;

	if (!packed || !ret_x)
		return;
	s = bd_ue8m0_decode(scale);
	for (int i = 0; i < BD_MXFP4_BLOCK; i++)
		ret_x[i] = s * bd_e2m1_decode(bd_fp4_get(packed, (size_t)i));
}

/* ---- Walsh–Hadamard transform (NUMERICS.md §3) ---------------------------------------------- */

int bd_fwht(float *x, int d)
{
	float scale;

	if (!x || d < 1 || d > BD_FWHT_MAX || (d & (d - 1)) != 0)
		return -EINVAL;
	if (!bd_all_finite(x, (size_t)d))
		return -EDOM;
	for (int h = 1; h < d; h *= 2)
		for (int i = 0; i < d; i += 2 * h)
			for (int j = i; j < i + h; j++) {
				float a = x[j], b = x[j + h];

				x[j] = a + b;
				x[j + h] = a - b;
			}
	scale = 1.0f / sqrtf((float)d);
	for (int i = 0; i < d; i++)
		x[i] *= scale;
	return 0;
}

/* ---- dual-residual query quantization (NUMERICS.md §5, paper §3.1) ---------------------------- */

/* One FP4 term of d channels into slot t of qq (fmt, d already set). Inputs are finite. */
static int query_term(const float *v, int d, int t, struct bd_qquant *qq)
{
	if (qq->fmt == BD_FP4_NVFP4)
		return bd_nvfp4_quantize(v, (size_t)d, BD_NVFP4_Q_SMAX, BD_SCALE_STANDARD,
					 qq->codes[t], qq->scales[t], &qq->g[t]);
	for (int b = 0; b < d / BD_MXFP4_BLOCK; b++) {
		int r = bd_mxfp4_quantize_block(v + b * BD_MXFP4_BLOCK, BD_SCALE_STANDARD,
						qq->codes[t] + b * (BD_MXFP4_BLOCK / 2),
						&qq->scales[t][b]);
		if (r < 0)
			return r;
	}
	qq->g[t] = 1.0f;
	return 0;
}

int bd_query_quantize(const float *q, int d, enum bd_fp4_format fmt, int nterms,
		      struct bd_qquant *ret)
{
	struct bd_qquant qq;
	float deq[BD_FWHT_MAX], res[BD_FWHT_MAX];
	int block, r;

	if (!q || !ret || (fmt != BD_FP4_NVFP4 && fmt != BD_FP4_MXFP4) ||
	    (nterms != 1 && nterms != 2))
		return -EINVAL;
	block = fmt == BD_FP4_NVFP4 ? BD_NVFP4_BLOCK : BD_MXFP4_BLOCK;
	if (d < block || d > BD_FWHT_MAX || d % block != 0)
		return -EINVAL;
	if (!bd_all_finite(q, (size_t)d))
		return -EDOM;

	/* Built in a local copy so that *ret is written only on success. */
	memset(&qq, 0, sizeof(qq));
	qq.d = d;
	qq.nterms = nterms;
	qq.fmt = fmt;
	r = query_term(q, d, 0, &qq);
	if (r < 0)
		return r;
	if (nterms == 2) {
		/* q⁽²⁾ = Q(q' − deq(q⁽¹⁾)), the residual in FP32. */
		bd_query_dequantize(&qq, 0, deq);
		for (int i = 0; i < d; i++)
			res[i] = q[i] - deq[i];
		if (!bd_all_finite(res, (size_t)d))
			return -EDOM; /* only for q near FLT_MAX */
		r = query_term(res, d, 1, &qq);
		if (r < 0)
			return r;
	}
	*ret = qq;
	return 0;
}

void bd_query_dequantize(const struct bd_qquant *qq, int t, float *ret_q)
{
	if (!qq || !ret_q || t < 0 || t >= qq->nterms || t > 1 || qq->d < 0 ||
	    qq->d > BD_FWHT_MAX)
		return;
	if (qq->fmt == BD_FP4_NVFP4) {
		for (int b = 0; b < qq->d / BD_NVFP4_BLOCK; b++)
			bd_nvfp4_dequantize_block(qq->codes[t] + b * (BD_NVFP4_BLOCK / 2),
						  qq->scales[t][b], qq->g[t],
						  ret_q + b * BD_NVFP4_BLOCK);
	} else {
		for (int b = 0; b < qq->d / BD_MXFP4_BLOCK; b++)
			bd_mxfp4_dequantize_block(qq->codes[t] + b * (BD_MXFP4_BLOCK / 2),
						  qq->scales[t][b], ret_q + b * BD_MXFP4_BLOCK);
	}
}

/* ---- probability block quantization (NUMERICS.md §6, paper §3.2) ------------------------------ */

void bd_p_quantize_block_nvfp4(const float P[BD_NVFP4_BLOCK], float p_max,
			       const struct bd_pscale *ps, float ret_phat[BD_NVFP4_BLOCK],
			       uint8_t *ret_scale)
{
	float kappa, sv, inv;
	uint8_t s;

	/* No error return in this interface: on a bad argument or a non-finite input nothing is
	 * written (the decoder checks its logits before it gets here). */
	if (!P || !ps || !ret_phat || !ret_scale || !isfinite(p_max) || !isfinite(ps->c) ||
	    !isfinite(ps->tau) || !bd_all_finite(P, BD_NVFP4_BLOCK))
		return;
	/* Blocks far below the tile max use κ = 2, two more E4M3 binades before s_P underflows. */
	kappa = (ps->underflow_aware && p_max <= ps->tau / ps->c) ? 2.0f : 6.0f;
	s = bd_e4m3_encode((ps->c * p_max) / kappa);
	sv = bd_e4m3_decode(s);
	inv = sv == 0.0f ? 0.0f : 1.0f / sv;
	for (int i = 0; i < BD_NVFP4_BLOCK; i++)
		ret_phat[i] = bd_e2m1_decode(bd_e2m1_encode(P[i] * inv));
	*ret_scale = s;
}
