/* test_fp4.c — bd_fp4.h: element formats, NVFP4/MXFP4 quantizers, FWHT, query and probability
 * quantization (NUMERICS.md §1–3, §5, §6). Suite "fp4".
 *
 * Expected values come from the shared vectors of an independent implementation
 * ($BD_SHARED/vectors/numerics.json) or are worked out by hand in the comments.
 */
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <criterion/criterion.h>
#include <jansson.h>

#include "quant/bd_fp4.h"
#include "testgen.h"

/* ---- helpers ------------------------------------------------------------------------------ */

/* One stream for the random tests, seeded by each (reproducible). */
static struct tg_rng rng;

static json_t *load_vectors(void)
{
	const char *dir = getenv("BD_SHARED");
	char path[4096];
	json_error_t err;
	json_t *root;

	cr_assert_not_null(dir, "BD_SHARED is not set: it must name the shared directory that "
				"holds vectors/numerics.json (e.g. BD_SHARED=/work/shared)");
	snprintf(path, sizeof(path), "%s/vectors/numerics.json", dir);
	root = json_load_file(path, 0, &err);
	cr_assert_not_null(root, "cannot load the shared vectors %s: %s (line %d)", path, err.text,
			   err.line);
	return root;
}

/* Array `key` of section `sec`, which must have n entries. */
static json_t *vec_array(json_t *root, const char *sec, const char *key, size_t n)
{
	json_t *s = json_object_get(root, sec), *a;

	cr_assert(json_is_object(s), "vectors: section %s missing", sec);
	a = json_object_get(s, key);
	cr_assert(json_is_array(a), "vectors: %s.%s missing", sec, key);
	cr_assert_eq(json_array_size(a), n, "vectors: %s.%s has %zu entries, expected %zu", sec,
		     key, json_array_size(a), n);
	return a;
}

static uint32_t vec_bits(json_t *a, size_t i)
{
	const char *s = json_string_value(json_array_get(a, i));

	cr_assert_not_null(s, "vectors: entry %zu is not a hex string", i);
	return (uint32_t)strtoul(s, NULL, 16);
}

static int vec_int(json_t *a, size_t i)
{
	json_t *v = json_array_get(a, i);

	cr_assert(json_is_integer(v), "vectors: entry %zu is not an integer", i);
	return (int)json_integer_value(v);
}

/* Squared error Σ (y_i − x_i)² in FP32, in order, as the library's search accumulates it. */
static float sq_err(const float *x, const float *y, int n)
{
	float err = 0.0f;

	for (int i = 0; i < n; i++) {
		float d = y[i] - x[i];

		err += d * d;
	}
	return err;
}

static double l2_diff(const float *a, const float *b, int n)
{
	double s = 0.0;

	for (int i = 0; i < n; i++)
		s += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
	return sqrt(s);
}

/* v moved k floats up (k > 0) or down (k < 0). */
static float ulp_step(float v, int k)
{
	for (; k > 0; k--)
		v = nextafterf(v, INFINITY);
	for (; k < 0; k++)
		v = nextafterf(v, -INFINITY);
	return v;
}

static void unpack(const uint8_t *packed, int n, uint8_t *codes)
{
	for (int i = 0; i < n; i++)
		codes[i] = bd_fp4_get(packed, (size_t)i);
}

/* ---- shared vectors ------------------------------------------------------------------------- */

/* Every x_bits → code pair of the vectors' section sec (an element encoder's): enc agrees. */
static void check_encode_vectors(const char *sec, const char *name, uint8_t (*enc)(float))
{
	json_t *root = load_vectors();
	json_t *x = json_object_get(json_object_get(root, sec), "x_bits");
	size_t n = json_array_size(x);
	json_t *c = vec_array(root, sec, "code", n);

	cr_assert_gt(n, 0, "vectors: %s.x_bits missing", sec);
	for (size_t i = 0; i < n; i++) {
		float v = bd_f32_from_bits(vec_bits(x, i));

		cr_assert_eq(enc(v), vec_int(c, i), "%s(%a) = %d, vectors say %d", name, v, enc(v),
			     vec_int(c, i));
	}
	json_decref(root);
}

Test(fp4, vectors_e2m1)
{
	check_encode_vectors("e2m1_encode", "E2M1", bd_e2m1_encode);
}

Test(fp4, vectors_e4m3)
{
	check_encode_vectors("e4m3_encode", "E4M3", bd_e4m3_encode);
}

/* 128 values, one decode scale g over all of them (smax 256), 8 blocks of 16. */
static void check_nvfp4_vectors(const char *sec, enum bd_scale_rule rule)
{
	json_t *root = load_vectors();
	json_t *xb = vec_array(root, sec, "x_bits", 128), *gb = vec_array(root, sec, "g_bits", 1);
	json_t *sc = vec_array(root, sec, "scale_code", 8), *cc = vec_array(root, sec, "code", 128);
	json_t *db = vec_array(root, sec, "deq_bits", 128);
	float x[128], g, y[16];
	uint8_t packed[64], scales[8], codes[128];

	for (int i = 0; i < 128; i++)
		x[i] = bd_f32_from_bits(vec_bits(xb, (size_t)i));
	cr_assert_eq(bd_nvfp4_quantize(x, 128, BD_NVFP4_KV_SMAX, rule, packed, scales, &g), 0);
	cr_assert_eq(bd_f32_bits(g), vec_bits(gb, 0), "%s: g = %08x, vectors say %08x", sec,
		     bd_f32_bits(g), vec_bits(gb, 0));
	unpack(packed, 128, codes);
	for (int b = 0; b < 8; b++) {
		cr_assert_eq(scales[b], vec_int(sc, (size_t)b), "%s: block %d scale %d, vectors %d",
			     sec, b, scales[b], vec_int(sc, (size_t)b));
		bd_nvfp4_dequantize_block(packed + 8 * b, scales[b], g, y);
		for (int i = 0; i < 16; i++) {
			int k = 16 * b + i;

			cr_assert_eq(codes[k], vec_int(cc, (size_t)k), "%s: code %d is %d, vectors %d",
				     sec, k, codes[k], vec_int(cc, (size_t)k));
			cr_assert_eq(bd_f32_bits(y[i]), vec_bits(db, (size_t)k),
				     "%s: dequantized %d is %08x, vectors %08x", sec, k,
				     bd_f32_bits(y[i]), vec_bits(db, (size_t)k));
		}
	}
	json_decref(root);
}

Test(fp4, vectors_nvfp4_standard)
{
	check_nvfp4_vectors("nvfp4_standard", BD_SCALE_STANDARD);
}

Test(fp4, vectors_nvfp4_search)
{
	check_nvfp4_vectors("nvfp4_search", BD_SCALE_SEARCH);
}

/* 192 values = 6 MXFP4 blocks of 32; only the dequantized values are given. */
static void check_mxfp4_vectors(const char *sec, enum bd_scale_rule rule)
{
	json_t *root = load_vectors();
	json_t *xb = vec_array(root, sec, "x_bits", 192), *db = vec_array(root, sec, "deq_bits", 192);
	float x[192], y[32];
	uint8_t packed[16], scale;

	for (int i = 0; i < 192; i++)
		x[i] = bd_f32_from_bits(vec_bits(xb, (size_t)i));
	for (int b = 0; b < 6; b++) {
		cr_assert_eq(bd_mxfp4_quantize_block(x + 32 * b, rule, packed, &scale), 0);
		bd_mxfp4_dequantize_block(packed, scale, y);
		for (int i = 0; i < 32; i++) {
			int k = 32 * b + i;

			/* Bit patterns, so a negative zero must match too. */
			cr_assert_eq(bd_f32_bits(y[i]), vec_bits(db, (size_t)k),
				     "%s: dequantized %d (x = %a) is %08x, vectors %08x", sec, k, x[k],
				     bd_f32_bits(y[i]), vec_bits(db, (size_t)k));
		}
	}
	json_decref(root);
}

Test(fp4, vectors_mxfp4_standard)
{
	check_mxfp4_vectors("mxfp4_standard", BD_SCALE_STANDARD);
}

Test(fp4, vectors_mxfp4_search)
{
	check_mxfp4_vectors("mxfp4_search", BD_SCALE_SEARCH);
}

Test(fp4, vectors_fwht16)
{
	json_t *root = load_vectors();
	json_t *xb = vec_array(root, "fwht16", "x_bits", 16), *yb = vec_array(root, "fwht16", "y_bits", 16);
	json_t *tol = json_object_get(json_object_get(root, "fwht16"), "tolerance");
	float x[16];

	cr_assert(json_is_number(tol), "vectors: fwht16.tolerance missing");
	for (int i = 0; i < 16; i++)
		x[i] = bd_f32_from_bits(vec_bits(xb, (size_t)i));
	cr_assert_eq(bd_fwht(x, 16), 0);
	for (int i = 0; i < 16; i++) {
		float want = bd_f32_from_bits(vec_bits(yb, (size_t)i));

		cr_assert_leq(fabs((double)x[i] - want), json_number_value(tol),
			      "FWHT16[%d] = %.9g, vectors %.9g", i, x[i], want);
	}
	json_decref(root);
}

/* ---- element formats -------------------------------------------------------------------------- */

Test(fp4, e2m1_roundtrip)
{
	/* Magnitude index k decodes to the k-th of {0, .5, 1, 1.5, 2, 3, 4, 6}; bit 3 is the sign. */
	static const float mag[8] = { 0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f };

	for (int c = 0; c < 16; c++) {
		float v = bd_e2m1_decode((uint8_t)c);

		cr_assert_eq(fabsf(v), mag[c & 7], "E2M1 decode %d = %g", c, v);
		cr_assert_eq(!!signbit(v), c >= 8, "E2M1 decode %d has the wrong sign", c);
		cr_assert_eq(bd_e2m1_encode(v), c, "E2M1 %d → %g → %d", c, v, bd_e2m1_encode(v));
	}
	/* Only the low nibble is a code. */
	cr_assert_eq(bd_e2m1_decode(0xf7), 6.0f);
	cr_assert_eq(bd_e2m1_decode(0x7f), -6.0f);
}

Test(fp4, e2m1_ties)
{
	/* NUMERICS.md §1 lists the tie results as values: 0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2,
	 * 3.5→4, 5→4 (to the neighbour whose mantissa bit is 0). Codes: 0, 2, 2, 4, 4, 6, 6. */
	static const float x[7] = { 0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f };
	static const float val[7] = { 0.0f, 1.0f, 1.0f, 2.0f, 2.0f, 4.0f, 4.0f };
	static const uint8_t code[7] = { 0, 2, 2, 4, 4, 6, 6 };

	for (int i = 0; i < 7; i++) {
		cr_assert_eq(bd_e2m1_encode(x[i]), code[i], "E2M1(%g) = %d", x[i],
			     bd_e2m1_encode(x[i]));
		cr_assert_eq(bd_e2m1_decode(bd_e2m1_encode(x[i])), val[i]);
		cr_assert_eq(bd_e2m1_encode(-x[i]), code[i] | 8, "E2M1(%g) = %d", -x[i],
			     bd_e2m1_encode(-x[i]));
		cr_assert_eq(bd_e2m1_decode(bd_e2m1_encode(-x[i])), -val[i]);
	}
	/* A value rounding to zero keeps its sign: −0.25 and −0.0 → code 8 (negative zero). */
	cr_assert_eq(bd_e2m1_encode(-0.25f), 8);
	cr_assert_eq(bd_e2m1_encode(-0.0f), 8);
	cr_assert_eq(bd_e2m1_encode(0.0f), 0);
	/* Just off the ties the other neighbour wins; saturation above 5. */
	cr_assert_eq(bd_e2m1_encode(nextafterf(0.25f, 1.0f)), 1);
	cr_assert_eq(bd_e2m1_encode(nextafterf(0.75f, 0.0f)), 1);
	cr_assert_eq(bd_e2m1_encode(nextafterf(1.25f, 2.0f)), 3);
	cr_assert_eq(bd_e2m1_encode(nextafterf(5.0f, 6.0f)), 7);
	cr_assert_eq(bd_e2m1_encode(1e30f), 7);
	cr_assert_eq(bd_e2m1_encode(-1e30f), 15);
	cr_assert_eq(bd_e2m1_encode(INFINITY), 7);
	/* The header's contract for NaN (quantizers reject it before encoding). */
	cr_assert_eq(bd_e2m1_encode(NAN), 0);
	cr_assert_eq(bd_e2m1_encode(-NAN), 0);
}

Test(fp4, e4m3_decode_by_hand)
{
	/* s eeee mmm, bias 7: 0x38 = 2^0; 0x7e = 1.75·2^8 = 448; 0x01 = 2^-9; 0x08 = 2^-6;
	 * 0x33 = 1.375·2^-1; 0x07 = 7·2^-9. */
	cr_assert_eq(bd_e4m3_decode(0x38), 1.0f);
	cr_assert_eq(bd_e4m3_decode(0x7e), 448.0f);
	cr_assert_eq(bd_e4m3_decode(0xfe), -448.0f);
	cr_assert_eq(bd_e4m3_decode(0x01), 0x1p-9f);
	cr_assert_eq(bd_e4m3_decode(0x08), 0x1p-6f);
	cr_assert_eq(bd_e4m3_decode(0x33), 0.6875f);
	cr_assert_eq(bd_e4m3_decode(0x07), 7.0f * 0x1p-9f);
	cr_assert_eq(bd_f32_bits(bd_e4m3_decode(0x80)), 0x80000000u, "0x80 is negative zero");
	cr_assert(isnan(bd_e4m3_decode(0x7f)));
	cr_assert(isnan(bd_e4m3_decode(0xff)));
}

Test(fp4, e4m3_roundtrip)
{
	int finite = 0;

	for (int c = 0; c < 256; c++) {
		float v;

		if (c == 0x7f || c == 0xff)
			continue;
		v = bd_e4m3_decode((uint8_t)c);
		cr_assert(isfinite(v), "E4M3 code %#x decodes to %g", c, v);
		cr_assert_eq(bd_e4m3_encode(v), c, "E4M3 %#x → %a → %#x", c, v, bd_e4m3_encode(v));
		/* Codes of one sign are monotone in value. */
		if ((c & 0x7f) > 0)
			cr_assert_gt(fabsf(v), fabsf(bd_e4m3_decode((uint8_t)(c - 1))));
		finite++;
	}
	cr_assert_eq(finite, 254);
}

Test(fp4, e4m3_saturation_and_subnormals)
{
	/* satfinite: 448 and anything above, including the tie 464 between 448 and the would-be
	 * 480 (odd mantissa), saturates to 0x7e. */
	cr_assert_eq(bd_e4m3_encode(448.0f), 0x7e);
	cr_assert_eq(bd_e4m3_encode(460.0f), 0x7e);
	cr_assert_eq(bd_e4m3_encode(464.0f), 0x7e);
	cr_assert_eq(bd_e4m3_encode(1e6f), 0x7e);
	cr_assert_eq(bd_e4m3_encode(FLT_MAX), 0x7e);
	cr_assert_eq(bd_e4m3_encode(-1e6f), 0xfe);
	/* (464, 480) rounds to mantissa 7 at the top exponent, which is the NaN code 0x7f. */
	cr_assert_eq(bd_e4m3_encode(470.0f), 0x7e);
	cr_assert_eq(bd_e4m3_encode(479.0f), 0x7e);
	cr_assert_eq(bd_e4m3_encode(-470.0f), 0xfe);
	cr_assert_eq(bd_e4m3_encode(INFINITY), 0x7e);
	/* 432 = 1.6875·2^8 is the tie between 416 (m = 5) and 448 (m = 6): to 448. */
	cr_assert_eq(bd_e4m3_encode(432.0f), 0x7e);
	/* Subnormals m·2^-9. 2^-10 is the tie between 0 and 2^-9: to 0 (even). */
	cr_assert_eq(bd_e4m3_encode(0x1p-9f), 1);
	cr_assert_eq(bd_e4m3_encode(0x1p-10f), 0);
	cr_assert_eq(bd_e4m3_encode(3.0f * 0x1p-10f), 2);
	cr_assert_eq(bd_e4m3_encode(5.0f * 0x1p-10f), 2);
	cr_assert_eq(bd_e4m3_encode(7.0f * 0x1p-10f), 4);
	cr_assert_eq(bd_e4m3_encode(0x1p-6f), 8);
	/* 15·2^-10 = 7.5·2^-9 ties between subnormal 7 and the minimum normal 8·2^-9: to 8. */
	cr_assert_eq(bd_e4m3_encode(15.0f * 0x1p-10f), 8);
	cr_assert_eq(bd_e4m3_encode(1e-30f), 0);
	cr_assert_eq(bd_e4m3_encode(-0.0f), 0x80);
	/* Normal ties: 1.0625 between 1 (m 0) and 1.125 (m 1) → 0x38; 1.1875 → 1.25 (0x3a);
	 * 1.9375 rounds mantissa 7.5 to 8, which carries into the exponent: 2.0 = 0x40. */
	cr_assert_eq(bd_e4m3_encode(1.0625f), 0x38);
	cr_assert_eq(bd_e4m3_encode(1.1875f), 0x3a);
	cr_assert_eq(bd_e4m3_encode(1.9375f), 0x40);
	cr_assert_eq(bd_e4m3_encode(nextafterf(1.0625f, 2.0f)), 0x39);
}

Test(fp4, ue8m0_decode)
{
	cr_assert_eq(bd_ue8m0_decode(127), 1.0f);
	cr_assert_eq(bd_ue8m0_decode(130), 8.0f);
	cr_assert_eq(bd_ue8m0_decode(0), 0x1p-127f);
	cr_assert_eq(bd_ue8m0_decode(254), 0x1p127f);
	cr_assert(isnan(bd_ue8m0_decode(255)));
}

Test(fp4, bf16_rounding)
{
	cr_assert_eq(bd_f32_to_bf16(1.0f), 0x3f80);
	cr_assert_eq(bd_f32_to_bf16(-2.0f), 0xc000);
	/* Ties to even: 0x3f808000 → 0x3f80 (even), 0x3f818000 → 0x3f82. */
	cr_assert_eq(bd_f32_to_bf16(bd_f32_from_bits(0x3f808000u)), 0x3f80);
	cr_assert_eq(bd_f32_to_bf16(bd_f32_from_bits(0x3f818000u)), 0x3f82);
	cr_assert_eq(bd_f32_to_bf16(bd_f32_from_bits(0x3f808001u)), 0x3f81);
	cr_assert_eq(bd_f32_to_bf16(bd_f32_from_bits(0x3f807fffu)), 0x3f80);
	cr_assert_eq(bd_f32_to_bf16(INFINITY), 0x7f80);
	cr_assert_eq(bd_f32_to_bf16(-INFINITY), 0xff80);
	cr_assert_eq(bd_f32_to_bf16(FLT_MAX), 0x7f80, "FLT_MAX rounds up to inf");
	cr_assert_eq(bd_f32_to_bf16(-0.0f), 0x8000);
	/* A signalling NaN whose payload sits in the dropped bits must stay NaN, not become inf. */
	cr_assert(isnan(bd_bf16_to_f32(bd_f32_to_bf16(bd_f32_from_bits(0x7f800001u)))));
	cr_assert(isnan(bd_bf16_to_f32(bd_f32_to_bf16(NAN))));
	cr_assert_eq(bd_f32_to_bf16(bd_f32_from_bits(0x7f800001u)) & 0x0040, 0x0040,
		     "quiet bit set");
	/* Widening back is exact for every BF16. */
	cr_assert_eq(bd_bf16_to_f32(0x3f81), 1.0078125f);
}

/* ---- NVFP4 ------------------------------------------------------------------------------------ */

Test(fp4, nvfp4_decode_scale)
{
	float x[3] = { 1.0f, -3.0f, 2.0f }, z[4] = { 0 }, g = -1.0f;

	/* g = amax / (6·256) = 3 / 1536 = 2^-9 (KV); 3 / 2688 for queries. */
	cr_assert_eq(bd_nvfp4_decode_scale(x, 3, BD_NVFP4_KV_SMAX, &g), 0);
	cr_assert_eq(g, 0x1p-9f);
	cr_assert_eq(bd_nvfp4_decode_scale(x, 3, BD_NVFP4_Q_SMAX, &g), 0);
	cr_assert_eq(g, 3.0f / 2688.0f);
	/* amax = 2688 → exactly 1 with smax 448. */
	x[1] = -2688.0f;
	cr_assert_eq(bd_nvfp4_decode_scale(x, 3, BD_NVFP4_Q_SMAX, &g), 0);
	cr_assert_eq(g, 1.0f);
	/* All zero (and the empty set) → g = 1. */
	g = -1.0f;
	cr_assert_eq(bd_nvfp4_decode_scale(z, 4, BD_NVFP4_KV_SMAX, &g), 0);
	cr_assert_eq(g, 1.0f);
	g = -1.0f;
	cr_assert_eq(bd_nvfp4_decode_scale(z, 0, BD_NVFP4_KV_SMAX, &g), 0);
	cr_assert_eq(g, 1.0f);
}

/* The order of FP32 operations is part of the contract (the CUDA quantizers repeat it), so
 * these tests build inputs on which the written order and a plausible reordering round
 * differently, and check that the written one is used. */

Test(fp4, order_decode_scale)
{
	/* g = amax / (6·smax): one division by 2688 for queries, not amax / 6 / 448. */
	float a = 1.0f, g;
	int tries = 0;

	while (a / (6.0f * 448.0f) == a / 6.0f / 448.0f && tries++ < 100000)
		a = nextafterf(a, 2.0f);
	cr_assert_neq(a / (6.0f * 448.0f), a / 6.0f / 448.0f, "no distinguishing amax found");
	cr_assert_eq(bd_nvfp4_decode_scale(&a, 1, BD_NVFP4_Q_SMAX, &g), 0);
	cr_assert_eq(bd_f32_bits(g), bd_f32_bits(a / (6.0f * 448.0f)));
}

Test(fp4, order_nvfp4_scale_and_inverse)
{
	int found_s = 0, found_inv = 0;

	rng = (struct tg_rng){ 31 };
	for (int t = 0; t < 200000 && (!found_s || !found_inv); t++) {
		float g = (float)(1e-3 + tg_unit(&rng)), x[16] = { 0 }, amax, sv, inv_a, inv_b;
		uint8_t packed[8], scale, sa, sb;

		/* s = E4M3(amax_b / κ / g), left to right: put amax_b / 6 / g next to the E4M3 tie
		 * 1.0625 and look for a block where amax_b / (6·g) rounds the other way. */
		amax = 1.0625f * 6.0f * g;
		for (int k = -2; k <= 2 && !found_s; k++) {
			float a = ulp_step(amax, k);

			sa = bd_e4m3_encode(a / 6.0f / g);
			sb = bd_e4m3_encode(a / (6.0f * g));
			if (sa == sb)
				continue;
			x[0] = a;
			cr_assert_eq(bd_nvfp4_quantize_block(x, g, BD_SCALE_STANDARD, packed, &scale),
				     0);
			cr_assert_eq(scale, sa, "scale %#x; E4M3(amax/6/g) = %#x, E4M3(amax/(6g)) = %#x",
				     scale, sa, sb);
			found_s = 1;
		}

		/* inv = 1 / (s·g), not 1 / s / g: with x[0] = amax the scale is fixed; put x[1] at an
		 * E2M1 threshold in one rounding of inv and check which side it lands on. */
		x[0] = 5.0f * g;
		sv = bd_e4m3_decode(bd_e4m3_encode(x[0] / 6.0f / g));
		inv_a = 1.0f / (sv * g);
		inv_b = 1.0f / sv / g;
		if (inv_a == inv_b || found_inv)
			continue;
		for (int th = 0; th < 7 && !found_inv; th++) {
			static const float thr[7] = { 0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f };

			for (int k = -3; k <= 3 && !found_inv; k++) {
				float v = ulp_step(thr[th] / inv_a, k);

				if (bd_e2m1_encode(v * inv_a) == bd_e2m1_encode(v * inv_b) ||
				    fabsf(v) > x[0])
					continue;
				x[1] = v;
				cr_assert_eq(bd_nvfp4_quantize_block(x, g, BD_SCALE_STANDARD, packed,
								     &scale), 0);
				cr_assert_eq(bd_fp4_get(packed, 1), bd_e2m1_encode(v * inv_a),
					     "x̂ uses 1/(s·g)");
				found_inv = 1;
			}
		}
		x[1] = 0.0f;
	}
	cr_assert(found_s, "no block distinguishing amax/6/g from amax/(6g) found");
	cr_assert(found_inv, "no block distinguishing 1/(s·g) from 1/s/g found");
}

Test(fp4, order_nvfp4_dequant)
{
	/* x = (g·s)·x̂, with g·s rounded first, not g·(s·x̂). */
	int found = 0;

	rng = (struct tg_rng){ 47 };
	for (int t = 0; t < 100000 && !found; t++) {
		float g = (float)(1e-3 + tg_unit(&rng)), y[16];
		uint8_t s = (uint8_t)(1 + tg_next(&rng) % 0x7e);
		uint8_t c = (uint8_t)(1 + tg_next(&rng) % 7);
		uint8_t packed[8] = { 0 };
		float sv = bd_e4m3_decode(s), xv = bd_e2m1_decode(c);

		if ((g * sv) * xv == g * (sv * xv))
			continue;
		bd_fp4_set(packed, 9, c);
		bd_nvfp4_dequantize_block(packed, s, g, y);
		cr_assert_eq(bd_f32_bits(y[9]), bd_f32_bits((g * sv) * xv));
		found = 1;
	}
	cr_assert(found, "no (g, s, x̂) distinguishing the two orders found");
}

Test(fp4, fwht_scale_is_reciprocal_root)
{
	/* H·(k·e_0) is k at every position before scaling (butterflies k ± 0 are exact), so every
	 * output must be k·(1/sqrtf(d)) exactly; k / sqrtf(d) differs for some k and d. */
	static float x[BD_FWHT_MAX];
	int differs = 0;

	for (int d = 2; d <= BD_FWHT_MAX; d *= 2)
		for (int k = 1; k <= 64; k++) {
			float want = (float)k * (1.0f / sqrtf((float)d));

			memset(x, 0, sizeof(x));
			x[0] = (float)k;
			cr_assert_eq(bd_fwht(x, d), 0);
			for (int i = 0; i < d; i++)
				cr_assert_eq(bd_f32_bits(x[i]), bd_f32_bits(want), "d %d k %d [%d]", d,
					     k, i);
			differs += want != (float)k / sqrtf((float)d);
		}
	cr_assert_gt(differs, 0);
}

Test(fp4, nvfp4_tiny_amax)
{
	/* amax so small that amax/(6·256) is not a normal float: g = 1, as for amax = 0 (so that
	 * 1/(s·g) stays finite); every value then quantizes to zero, keeping its sign. */
	float x[16] = { 0 }, g, y[16];
	uint8_t packed[8], scale;

	x[0] = 1e-40f;
	x[1] = -3e-41f;
	cr_assert_eq(bd_nvfp4_decode_scale(x, 16, BD_NVFP4_KV_SMAX, &g), 0);
	cr_assert_eq(g, 1.0f);
	cr_assert_eq(bd_nvfp4_quantize(x, 16, BD_NVFP4_KV_SMAX, BD_SCALE_SEARCH, packed, &scale,
				       &g), 0);
	cr_assert_eq(scale, 0);
	cr_assert_eq(bd_fp4_get(packed, 0), 0);
	cr_assert_eq(bd_fp4_get(packed, 1), 8);
	bd_nvfp4_dequantize_block(packed, scale, g, y);
	cr_assert_eq(y[0], 0.0f);
	/* The smallest amax with a normal g still uses it. */
	x[0] = 1536.0f * FLT_MIN;
	x[1] = 0.0f;
	cr_assert_eq(bd_nvfp4_decode_scale(x, 16, BD_NVFP4_KV_SMAX, &g), 0);
	cr_assert_eq(g, FLT_MIN);
}

/* Values whose hand-worked quantization follows; amax = 3. */
static const float hand16[16] = { 0.0f,   0.25f,  -0.25f, 0.5f,  0.75f, 1.0f, -1.5f, 3.0f,
				  0.125f, 0.375f, 0.625f, 1.25f, -2.0f, 2.5f, -0.1f, 1.75f };

Test(fp4, nvfp4_hand_block_standard)
{
	/* g = 3/1536 = 2^-9. κ = 6: s = E4M3((3/6)/2^-9) = E4M3(256) = 1.0·2^8 → code (8+7)<<3 = 120.
	 * inv = 1/(256·2^-9) = 2, so x̂ = E2M1(2x):
	 *   2x   = 0  .5 -.5 1 1.5 2 -3 6 .25 .75 1.25 2.5 -4 5 -.2 3.5
	 *   code = 0  1  9   2 3   4 13 7 0   2   2    4   14 6 8   6   (ties to even mantissa)
	 * dequantized (g·s)·x̂ = 0.5·x̂. */
	static const uint8_t want_codes[16] = { 0, 1, 9, 2, 3, 4, 13, 7, 0, 2, 2, 4, 14, 6, 8, 6 };
	static const float want_deq[16] = { 0.0f, 0.25f, -0.25f, 0.5f, 0.75f, 1.0f, -1.5f, 3.0f,
					    0.0f, 0.5f,  0.5f,   1.0f, -2.0f, 2.0f, -0.0f, 2.0f };
	uint8_t packed[8], scale, codes[16];
	float g, y[16];

	cr_assert_eq(bd_nvfp4_quantize(hand16, 16, BD_NVFP4_KV_SMAX, BD_SCALE_STANDARD, packed,
				       &scale, &g), 0);
	cr_assert_eq(g, 0x1p-9f);
	cr_assert_eq(scale, 120);
	unpack(packed, 16, codes);
	/* Element 0 in the low nibble: byte 0 = code1 << 4 | code0. */
	cr_assert_eq(packed[0], 0x10);
	cr_assert_eq(packed[1], 0x29);
	for (int i = 0; i < 16; i++)
		cr_assert_eq(codes[i], want_codes[i], "code %d = %d, want %d", i, codes[i],
			     want_codes[i]);
	bd_nvfp4_dequantize_block(packed, scale, g, y);
	for (int i = 0; i < 16; i++)
		cr_assert_eq(bd_f32_bits(y[i]), bd_f32_bits(want_deq[i]), "deq %d = %g, want %g", i,
			     y[i], want_deq[i]);
}

Test(fp4, nvfp4_hand_block_search)
{
	/* Same block, κ = 4: s = E4M3((3/4)/2^-9) = E4M3(384) = 1.5·2^8 → code 120 | 4 = 124;
	 * g·s = 0.75, inv = 1/0.75. Grid 0.75·{0 .5 1 1.5 2 3 4 6}:
	 *   x      0 .25 -.25 .5 .75 1   -1.5 3  .125 .375 .625 1.25 -2   2.5  -.1 1.75
	 *   x·inv  0 .33 -.33 .67 1  1.33 -2  4  .17  .5   .83  1.67 -2.67 3.33 -.13 2.33
	 *   code   0 1   9    1  2   3   12   6  0    1    2    3    13   5    8   4
	 * Errors κ = 6 (from the standard block): .125, .375, .625 → .015625 each; 1.25 → .0625;
	 *   2.5 → .25; −.1 → .01; 1.75 → .0625: Σ = 0.431875.
	 * κ = 4: .25, −.25, .5, 1, .125, .625, 1.25 → .015625 each; −2, 2.5, 1.75 → .0625 each;
	 *   −.1 → .01: Σ = 0.306875 < 0.431875, so the search keeps κ = 4. */
	static const uint8_t want_codes[16] = { 0, 1, 9, 1, 2, 3, 12, 6, 0, 1, 2, 3, 13, 5, 8, 4 };
	uint8_t packed[8], scale, codes[16];
	float g, y[16];

	cr_assert_eq(bd_nvfp4_quantize(hand16, 16, BD_NVFP4_KV_SMAX, BD_SCALE_SEARCH, packed,
				       &scale, &g), 0);
	cr_assert_eq(scale, 124);
	unpack(packed, 16, codes);
	for (int i = 0; i < 16; i++)
		cr_assert_eq(codes[i], want_codes[i], "code %d = %d, want %d", i, codes[i],
			     want_codes[i]);
	bd_nvfp4_dequantize_block(packed, scale, g, y);
	cr_assert_float_eq(sq_err(hand16, y, 16), 0.306875f, 1e-6f);
}

Test(fp4, nvfp4_hand_block_search_exact)
{
	/* g = 1, amax = 4 with values on the E2M1 grid. κ = 6: s = E4M3(4/6 = 0.667) = 1.375·2^-1
	 * (mantissa 2.67 → 3) = 0.6875, code 0x33, inv = 16/11: 4 → 5.82 → 6 (deq 4.125), so the
	 * error is > 0. κ = 4: s = E4M3(1) = 0x38, inv = 1, every value exact: error 0, so the
	 * search takes κ = 4 and reproduces x exactly. Standard codes: x·16/11 =
	 *   4→5.82:7  −3→−4.36:14  2→2.91:5  −1.5→−2.18:12  1→1.45:3  .5→.73:1  0:0  −4:15
	 *   3→4.36:6  1:3  2:5  −2:13  .5:1  −.5:9  1.5→2.18:4  4:7 */
	static const float x[16] = { 4, -3, 2, -1.5f, 1, 0.5f, 0, -4, 3, 1, 2, -2, 0.5f, -0.5f, 1.5f, 4 };
	static const uint8_t want_std[16] = { 7, 14, 5, 12, 3, 1, 0, 15, 6, 3, 5, 13, 1, 9, 4, 7 };
	uint8_t packed[8], scale, codes[16];
	float y[16];

	cr_assert_eq(bd_nvfp4_quantize_block(x, 1.0f, BD_SCALE_STANDARD, packed, &scale), 0);
	cr_assert_eq(scale, 0x33);
	unpack(packed, 16, codes);
	for (int i = 0; i < 16; i++)
		cr_assert_eq(codes[i], want_std[i], "code %d = %d, want %d", i, codes[i], want_std[i]);
	bd_nvfp4_dequantize_block(packed, scale, 1.0f, y);
	cr_assert_eq(y[0], 4.125f);
	cr_assert_gt(sq_err(x, y, 16), 0.0f);

	cr_assert_eq(bd_nvfp4_quantize_block(x, 1.0f, BD_SCALE_SEARCH, packed, &scale), 0);
	cr_assert_eq(scale, 0x38);
	bd_nvfp4_dequantize_block(packed, scale, 1.0f, y);
	for (int i = 0; i < 16; i++)
		cr_assert_eq(y[i], x[i], "deq %d = %g, want %g", i, y[i], x[i]);
}

Test(fp4, nvfp4_search_tie_keeps_six)
{
	/* A zero block: both candidates have scale 0 and error 0; the tie keeps κ = 6, whose scale
	 * E4M3(0/6) is code 0 as well, and every code is 0. A block of one value 6 (g = 1):
	 * κ = 6 gives s = 1, exact, error 0; κ = 4 gives s = 1.5, 6/1.5 = 4, also exact: a tie,
	 * so κ = 6's scale (0x38) is kept, not κ = 4's (0x3c). */
	float x[16] = { 0 };
	uint8_t packed[8], scale;

	cr_assert_eq(bd_nvfp4_quantize_block(x, 1.0f, BD_SCALE_SEARCH, packed, &scale), 0);
	cr_assert_eq(scale, 0);
	for (int j = 0; j < 8; j++)
		cr_assert_eq(packed[j], 0);
	x[3] = 6.0f;
	cr_assert_eq(bd_nvfp4_quantize_block(x, 1.0f, BD_SCALE_SEARCH, packed, &scale), 0);
	cr_assert_eq(scale, 0x38);
	cr_assert_eq(bd_fp4_get(packed, 3), 7);
}

/* Error of the NVFP4 candidate κ recomputed here from the formats alone. */
static float nvfp4_candidate_err(const float *x, float g, float kappa, uint8_t *ret_s)
{
	float amax = 0.0f, sv, inv, y[16];

	for (int i = 0; i < 16; i++)
		amax = fmaxf(amax, fabsf(x[i]));
	*ret_s = bd_e4m3_encode(amax / kappa / g);
	sv = bd_e4m3_decode(*ret_s);
	inv = sv == 0.0f ? 0.0f : 1.0f / (sv * g);
	for (int i = 0; i < 16; i++)
		y[i] = (g * sv) * bd_e2m1_decode(bd_e2m1_encode(x[i] * inv));
	return sq_err(x, y, 16);
}

Test(fp4, nvfp4_search_never_worse)
{
	int took4 = 0, took6 = 0;

	rng = (struct tg_rng){ 12345 };
	for (int t = 0; t < 2000; t++) {
		float x[16], y[16], g, e6, e4, es;
		uint8_t packed[8], s, s6, s4, s6std;

		for (int i = 0; i < 16; i++)
			x[i] = tg_gauss(&rng) * (t % 3 == 0 ? 0.01f : 1.0f);
		if (t % 4 == 1)
			x[tg_next(&rng) % 16] *= 8.0f; /* an outlier */
		/* g as a page would give it: pretend the page amax is up to 4× this block's. */
		g = 0.0f;
		for (int i = 0; i < 16; i++)
			g = fmaxf(g, fabsf(x[i]));
		g = g * (float)(1.0 + 3.0 * tg_unit(&rng)) / 1536.0f;

		cr_assert_eq(bd_nvfp4_quantize_block(x, g, BD_SCALE_STANDARD, packed, &s6std), 0);
		bd_nvfp4_dequantize_block(packed, s6std, g, y);
		e6 = sq_err(x, y, 16);
		cr_assert_eq(e6, nvfp4_candidate_err(x, g, 6.0f, &s6), "standard = κ 6 candidate");
		cr_assert_eq(s6std, s6);
		e4 = nvfp4_candidate_err(x, g, 4.0f, &s4);

		cr_assert_eq(bd_nvfp4_quantize_block(x, g, BD_SCALE_SEARCH, packed, &s), 0);
		bd_nvfp4_dequantize_block(packed, s, g, y);
		es = sq_err(x, y, 16);
		cr_assert_leq(es, fminf(e6, e4), "trial %d: search %g, κ6 %g, κ4 %g", t, es, e6, e4);
		/* κ = 4 exactly when it is strictly better. */
		cr_assert_eq(s, e4 < e6 ? s4 : s6, "trial %d", t);
		if (e4 < e6 && s4 != s6)
			took4++;
		else
			took6++;
	}
	/* Both branches were exercised. */
	cr_assert_gt(took4, 50);
	cr_assert_gt(took6, 50);
}

/* ---- MXFP4 ------------------------------------------------------------------------------------ */

Test(fp4, mxfp4_hand_block)
{
	/* x = 2·hand16 then its negation: amax = 6, floor(log2 6) = 2, e = 0, scale code 127,
	 * x̂ = E2M1(x) directly:
	 *   x     0 .5 -.5 1 1.5 2 -3 6 .25 .75 1.25 2.5 -4 5 -.2 3.5
	 *   code  0 1  9   2 3   4 13 7 0   2   2    4   14 6 8   6
	 * and the negated half flips bit 3 (0 → −0 is code 8, −.2 → .2 is code 0).
	 * Search: e = 1 (grid 0 1 2 3 4 6 8 12) costs .5, 1.5 → .25 each; .25, .75, 1.25 → .0625;
	 *   2.5 → .25; 5 → 1; −.2 → .04; 3.5 → .25; −.5 → .25: 2.4775 per half, more than e = 0
	 *   (.25, .75, 1.25 → .0625; 2.5, 3.5 → .25; 5 → 1; −.2 → .04: 1.7275), so e_ocp stays. */
	static const uint8_t half_codes[16] = { 0, 1, 9, 2, 3, 4, 13, 7, 0, 2, 2, 4, 14, 6, 8, 6 };
	float x[32], y[32];
	uint8_t packed[16], scale, codes[32];

	for (int i = 0; i < 16; i++) {
		x[i] = 2.0f * hand16[i];
		x[16 + i] = -x[i];
	}
	for (int rule = 0; rule < 2; rule++) {
		cr_assert_eq(bd_mxfp4_quantize_block(x, (enum bd_scale_rule)rule, packed, &scale), 0);
		cr_assert_eq(scale, 127, "rule %d", rule);
		unpack(packed, 32, codes);
		for (int i = 0; i < 16; i++) {
			cr_assert_eq(codes[i], half_codes[i], "code %d = %d", i, codes[i]);
			cr_assert_eq(codes[16 + i], half_codes[i] ^ 8, "code %d = %d", 16 + i,
				     codes[16 + i]);
		}
		bd_mxfp4_dequantize_block(packed, scale, y);
		cr_assert_float_eq(sq_err(x, y, 32), 2.0f * 1.7275f, 1e-5f);
	}
}

Test(fp4, mxfp4_hand_block_search)
{
	/* amax 7.9: floor(log2 7.9) = 2, e_ocp = 0; the other values are 0, ±2, ±4, ±6.
	 * e = 0: 7.9 clips to 6 (code 7), error 1.9² = 3.61, the rest exact.
	 * e = 1: 7.9/2 = 3.95 → 4 (code 6) → 8, error 0.01; 2, 4, 6 → 1, 2, 3 (codes 2, 4, 5), exact.
	 * Standard keeps scale 127; search takes 128. */
	static const float base[8] = { 7.9f, 2, -4, 6, 0, -2, 4, -6 };
	static const struct {
		enum bd_scale_rule rule;
		uint8_t scale, codes[8];
		float y0; /* 7.9 dequantized */
	} want[] = {
		{ BD_SCALE_STANDARD, 127, { 7, 4, 14, 7, 0, 12, 6, 15 }, 6.0f },
		{ BD_SCALE_SEARCH, 128, { 6, 2, 12, 5, 0, 10, 4, 13 }, 8.0f },
	};
	float x[32], y[32];
	uint8_t packed[16], scale;

	for (int i = 0; i < 32; i++)
		x[i] = i == 0 ? base[0] : base[1 + (i - 1) % 7];
	for (size_t w = 0; w < 2; w++) {
		cr_assert_eq(bd_mxfp4_quantize_block(x, want[w].rule, packed, &scale), 0);
		cr_assert_eq(scale, want[w].scale, "rule %d", want[w].rule);
		for (int i = 0; i < 8; i++)
			cr_assert_eq(bd_fp4_get(packed, (size_t)i), want[w].codes[i],
				     "rule %d code %d", want[w].rule, i);
		bd_mxfp4_dequantize_block(packed, scale, y);
		cr_assert_eq(y[0], want[w].y0);
		for (int i = 1; i < 32; i++) /* exact under either rule */
			cr_assert_eq(y[i], x[i], "rule %d value %d", want[w].rule, i);
	}
}

Test(fp4, mxfp4_scale_extremes)
{
	float x[32] = { 0 }, y[32];
	uint8_t packed[16], scale;

	/* amax 0: scale code 0, every code 0 (all inputs +0). */
	memset(packed, 0xa5, sizeof(packed));
	cr_assert_eq(bd_mxfp4_quantize_block(x, BD_SCALE_SEARCH, packed, &scale), 0);
	cr_assert_eq(scale, 0);
	for (int j = 0; j < 16; j++)
		cr_assert_eq(packed[j], 0);
	/* −0 keeps its sign (§1): code 8, dequantized −0. */
	x[5] = -0.0f;
	cr_assert_eq(bd_mxfp4_quantize_block(x, BD_SCALE_STANDARD, packed, &scale), 0);
	cr_assert_eq(scale, 0);
	cr_assert_eq(bd_fp4_get(packed, 5), 8);
	/* 2^100: e = 100 − 2 = 98, code 225; x̂ = 2^100/2^98 = 4 (code 6). */
	x[5] = 0x1p100f;
	cr_assert_eq(bd_mxfp4_quantize_block(x, BD_SCALE_STANDARD, packed, &scale), 0);
	cr_assert_eq(scale, 225);
	cr_assert_eq(bd_fp4_get(packed, 5), 6);
	/* 2^-140 (subnormal): e_ocp = −142 clamps to −127, code 0; 2^-140·2^127 = 2^-13 → 0. */
	x[5] = 0x1p-140f;
	cr_assert_eq(bd_mxfp4_quantize_block(x, BD_SCALE_SEARCH, packed, &scale), 0);
	cr_assert_eq(scale, 0);
	cr_assert_eq(bd_fp4_get(packed, 5), 0);
	/* 3·2^-126: floor(log2) = −125, e_ocp = −127, code 0: 3·2^-126·2^127 = 6 exactly. */
	x[5] = 3.0f * 0x1p-126f;
	cr_assert_eq(bd_mxfp4_quantize_block(x, BD_SCALE_STANDARD, packed, &scale), 0);
	cr_assert_eq(scale, 0);
	cr_assert_eq(bd_fp4_get(packed, 5), 7);
	bd_mxfp4_dequantize_block(packed, scale, y);
	cr_assert_eq(y[5], x[5]);
	/* FLT_MAX: floor(log2) = 127, e = 125, code 252; FLT_MAX/2^125 ≈ 8 clips to 6. The e + 1
	 * candidate would dequantize 4·2^126 = inf, so the search must keep 252. */
	x[5] = FLT_MAX;
	for (int rule = 0; rule < 2; rule++) {
		cr_assert_eq(bd_mxfp4_quantize_block(x, (enum bd_scale_rule)rule, packed, &scale), 0);
		cr_assert_eq(scale, 252);
		cr_assert_eq(bd_fp4_get(packed, 5), 7);
	}
}

Test(fp4, mxfp4_search_never_worse)
{
	int took1 = 0, took0 = 0;

	rng = (struct tg_rng){ 777 };
	for (int t = 0; t < 2000; t++) {
		float x[32], y[32], e0, e1, es, inv, sc;
		uint8_t packed[16], s0, s;

		for (int i = 0; i < 32; i++)
			x[i] = tg_gauss(&rng) * ldexpf(1.0f, (int)(tg_next(&rng) % 9) - 4);
		if (t % 3 == 0)
			x[tg_next(&rng) % 32] *= 10.0f;
		cr_assert_eq(bd_mxfp4_quantize_block(x, BD_SCALE_STANDARD, packed, &s0), 0);
		bd_mxfp4_dequantize_block(packed, s0, y);
		e0 = sq_err(x, y, 32);
		/* The e_ocp + 1 candidate, recomputed here: scale 2^(e+1), x̂ = E2M1(x·2^-(e+1)). */
		inv = ldexpf(1.0f, -((int)s0 - 127 + 1));
		sc = ldexpf(1.0f, (int)s0 - 127 + 1);
		for (int i = 0; i < 32; i++)
			y[i] = sc * bd_e2m1_decode(bd_e2m1_encode(x[i] * inv));
		e1 = sq_err(x, y, 32);

		cr_assert_eq(bd_mxfp4_quantize_block(x, BD_SCALE_SEARCH, packed, &s), 0);
		bd_mxfp4_dequantize_block(packed, s, y);
		es = sq_err(x, y, 32);
		cr_assert_leq(es, fminf(e0, e1), "trial %d: search %g, e_ocp %g, e_ocp+1 %g", t, es,
			      e0, e1);
		cr_assert_eq(s, e1 < e0 ? s0 + 1 : s0, "trial %d", t);
		if (s != s0)
			took1++;
		else
			took0++;
		/* e_ocp = floor(log2 amax) − 2, checked against the double-precision log2. */
		{
			float amax = 0.0f;

			for (int i = 0; i < 32; i++)
				amax = fmaxf(amax, fabsf(x[i]));
			cr_assert_eq((int)s0 - 127, (int)floor(log2((double)amax)) - 2);
		}
	}
	cr_assert_gt(took1, 50);
	cr_assert_gt(took0, 50);
}

/* ---- FWHT ---------------------------------------------------------------------------------------- */

Test(fp4, fwht_by_hand)
{
	/* d = 2: (1, 3) → (4, −2)/√2. d = 4: e_0 → (1, 1, 1, 1)/2; e_1 → (1, −1, 1, −1)/2.
	 * d = 1: the identity. */
	float a[2] = { 1.0f, 3.0f }, b[4] = { 1, 0, 0, 0 }, c[4] = { 0, 1, 0, 0 }, one = -7.5f;

	cr_assert_eq(bd_fwht(a, 2), 0);
	cr_assert_float_eq(a[0], 2.8284271f, 1e-6f);
	cr_assert_float_eq(a[1], -1.4142135f, 1e-6f);
	cr_assert_eq(bd_fwht(b, 4), 0);
	cr_assert_eq(bd_fwht(c, 4), 0);
	for (int i = 0; i < 4; i++) {
		cr_assert_eq(b[i], 0.5f);
		cr_assert_eq(c[i], (i & 1) ? -0.5f : 0.5f);
	}
	cr_assert_eq(bd_fwht(&one, 1), 0);
	cr_assert_eq(one, -7.5f);
}

Test(fp4, fwht_norm_and_involution)
{
	static float x[BD_FWHT_MAX], y[BD_FWHT_MAX];

	rng = (struct tg_rng){ 2024 };
	for (int d = 1; d <= BD_FWHT_MAX; d *= 2) {
		double n0 = 0.0, n1 = 0.0;

		for (int i = 0; i < d; i++)
			x[i] = y[i] = tg_gauss(&rng);
		cr_assert_eq(bd_fwht(y, d), 0);
		for (int i = 0; i < d; i++) {
			n0 += (double)x[i] * x[i];
			n1 += (double)y[i] * y[i];
		}
		cr_assert_leq(fabs(sqrt(n1) - sqrt(n0)), 1e-6 * sqrt(n0), "d = %d: |Hx| %.9g |x| %.9g",
			      d, sqrt(n1), sqrt(n0));
		cr_assert_eq(bd_fwht(y, d), 0);
		cr_assert_leq(l2_diff(x, y, d), 1e-6 * sqrt(n0), "d = %d: HHx differs from x by %g",
			      d, l2_diff(x, y, d));
	}
}

Test(fp4, fwht_bad_args)
{
	static const int bad[] = { 0, 3, 48, 2048, -4, 1023 };

	for (size_t k = 0; k < sizeof(bad) / sizeof(bad[0]); k++) {
		float big[2048];

		for (int i = 0; i < 2048; i++)
			big[i] = (float)i;
		cr_assert_eq(bd_fwht(big, bad[k]), -EINVAL, "d = %d", bad[k]);
		for (int i = 0; i < 2048; i++)
			cr_assert_eq(big[i], (float)i, "d = %d changed x", bad[k]);
	}
	cr_assert_eq(bd_fwht(NULL, 4), -EINVAL);
}

Test(fp4, fwht_nonfinite)
{
	const float bad[3] = { NAN, INFINITY, -INFINITY };

	for (int k = 0; k < 3; k++)
		for (int pos = 0; pos < 16; pos += 15) {
			float x[16];
			uint32_t before[16];

			for (int i = 0; i < 16; i++)
				x[i] = (float)i - 3.5f;
			x[pos] = bad[k];
			for (int i = 0; i < 16; i++)
				before[i] = bd_f32_bits(x[i]);
			cr_assert_eq(bd_fwht(x, 16), -EDOM);
			for (int i = 0; i < 16; i++)
				cr_assert_eq(bd_f32_bits(x[i]), before[i], "x[%d] changed", i);
		}
}

/* ---- non-finite inputs and bad arguments: -EDOM / -EINVAL, outputs untouched ------------------- */

#define SENTINEL 0xa5

static void assert_sentinel(const void *p, size_t n, const char *what)
{
	const uint8_t *b = p;

	for (size_t i = 0; i < n; i++)
		cr_assert_eq(b[i], SENTINEL, "%s byte %zu was written", what, i);
}

Test(fp4, nonfinite_quantizers)
{
	const float bad[3] = { NAN, INFINITY, -INFINITY };

	for (int k = 0; k < 3; k++)
		for (int pos = 0; pos < 2; pos++) {
			float x[64];
			uint8_t packed[32], scales[4], scale;
			float g;
			struct bd_qquant qq;

			for (int i = 0; i < 64; i++)
				x[i] = 0.25f * (float)(i - 30);

			/* 16-element inputs: first or last element bad. */
			x[pos ? 15 : 0] = bad[k];
			memset(&g, SENTINEL, sizeof(g));
			cr_assert_eq(bd_nvfp4_decode_scale(x, 16, BD_NVFP4_KV_SMAX, &g), -EDOM);
			assert_sentinel(&g, sizeof(g), "decode_scale g");
			for (int rule = 0; rule < 2; rule++) {
				memset(packed, SENTINEL, sizeof(packed));
				memset(&scale, SENTINEL, 1);
				cr_assert_eq(bd_nvfp4_quantize_block(x, 1.0f, (enum bd_scale_rule)rule,
								     packed, &scale), -EDOM);
				assert_sentinel(packed, sizeof(packed), "nvfp4 block codes");
				assert_sentinel(&scale, 1, "nvfp4 block scale");
			}
			x[pos ? 15 : 0] = 1.0f;

			/* 64-element inputs: the bad value in the last block, so that a quantizer
			 * that checks block by block would already have written blocks 0–2. */
			x[pos ? 63 : 48] = bad[k];
			memset(packed, SENTINEL, sizeof(packed));
			memset(scales, SENTINEL, sizeof(scales));
			memset(&g, SENTINEL, sizeof(g));
			cr_assert_eq(bd_nvfp4_quantize(x, 64, BD_NVFP4_KV_SMAX, BD_SCALE_SEARCH,
						       packed, scales, &g), -EDOM);
			assert_sentinel(packed, sizeof(packed), "nvfp4 codes");
			assert_sentinel(scales, sizeof(scales), "nvfp4 scales");
			assert_sentinel(&g, sizeof(g), "nvfp4 g");

			for (int rule = 0; rule < 2; rule++) {
				memset(packed, SENTINEL, sizeof(packed));
				memset(&scale, SENTINEL, 1);
				cr_assert_eq(bd_mxfp4_quantize_block(x + 32, (enum bd_scale_rule)rule,
								     packed, &scale), -EDOM);
				assert_sentinel(packed, 16, "mxfp4 codes");
				assert_sentinel(&scale, 1, "mxfp4 scale");
			}

			for (int fmt = 0; fmt < 2; fmt++)
				for (int nt = 1; nt <= 2; nt++) {
					memset(&qq, SENTINEL, sizeof(qq));
					cr_assert_eq(bd_query_quantize(x, 64, (enum bd_fp4_format)fmt,
								       nt, &qq), -EDOM);
					assert_sentinel(&qq, sizeof(qq), "query");
				}
		}
}

Test(fp4, bad_args_untouched)
{
	float x[64], g;
	uint8_t packed[32], scales[4], scale;
	struct bd_qquant qq;

	for (int i = 0; i < 64; i++)
		x[i] = (float)i;
	memset(&g, SENTINEL, sizeof(g));
	cr_assert_eq(bd_nvfp4_decode_scale(NULL, 4, BD_NVFP4_KV_SMAX, &g), -EINVAL);
	cr_assert_eq(bd_nvfp4_decode_scale(x, 4, 0.0f, &g), -EINVAL);
	cr_assert_eq(bd_nvfp4_decode_scale(x, 4, -256.0f, &g), -EINVAL);
	cr_assert_eq(bd_nvfp4_decode_scale(x, 4, NAN, &g), -EINVAL);
	cr_assert_eq(bd_nvfp4_decode_scale(x, 4, BD_NVFP4_KV_SMAX, NULL), -EINVAL);
	assert_sentinel(&g, sizeof(g), "g");

	memset(packed, SENTINEL, sizeof(packed));
	memset(scales, SENTINEL, sizeof(scales));
	memset(&scale, SENTINEL, 1);
	/* g must be finite and > 0; the rule one of the two. */
	cr_assert_eq(bd_nvfp4_quantize_block(x, 0.0f, BD_SCALE_STANDARD, packed, &scale), -EINVAL);
	cr_assert_eq(bd_nvfp4_quantize_block(x, -1.0f, BD_SCALE_STANDARD, packed, &scale), -EINVAL);
	cr_assert_eq(bd_nvfp4_quantize_block(x, INFINITY, BD_SCALE_STANDARD, packed, &scale),
		     -EINVAL);
	cr_assert_eq(bd_nvfp4_quantize_block(x, NAN, BD_SCALE_STANDARD, packed, &scale), -EINVAL);
	cr_assert_eq(bd_nvfp4_quantize_block(x, 1.0f, (enum bd_scale_rule)2, packed, &scale),
		     -EINVAL);
	cr_assert_eq(bd_nvfp4_quantize_block(NULL, 1.0f, BD_SCALE_STANDARD, packed, &scale),
		     -EINVAL);
	cr_assert_eq(bd_nvfp4_quantize_block(x, 1.0f, BD_SCALE_STANDARD, NULL, &scale), -EINVAL);
	cr_assert_eq(bd_nvfp4_quantize_block(x, 1.0f, BD_SCALE_STANDARD, packed, NULL), -EINVAL);
	/* n must be a positive multiple of 16. */
	cr_assert_eq(bd_nvfp4_quantize(x, 24, BD_NVFP4_KV_SMAX, BD_SCALE_STANDARD, packed, scales,
				       &g), -EINVAL);
	cr_assert_eq(bd_nvfp4_quantize(x, 0, BD_NVFP4_KV_SMAX, BD_SCALE_STANDARD, packed, scales,
				       &g), -EINVAL);
	cr_assert_eq(bd_nvfp4_quantize(x, 64, 0.0f, BD_SCALE_STANDARD, packed, scales, &g),
		     -EINVAL);
	cr_assert_eq(bd_nvfp4_quantize(x, 64, BD_NVFP4_KV_SMAX, (enum bd_scale_rule)-1, packed,
				       scales, &g), -EINVAL);
	cr_assert_eq(bd_nvfp4_quantize(x, 64, BD_NVFP4_KV_SMAX, BD_SCALE_STANDARD, packed, NULL,
				       &g), -EINVAL);
	cr_assert_eq(bd_mxfp4_quantize_block(x, (enum bd_scale_rule)5, packed, &scale), -EINVAL);
	cr_assert_eq(bd_mxfp4_quantize_block(NULL, BD_SCALE_STANDARD, packed, &scale), -EINVAL);
	cr_assert_eq(bd_mxfp4_quantize_block(x, BD_SCALE_STANDARD, packed, NULL), -EINVAL);
	assert_sentinel(packed, sizeof(packed), "codes");
	assert_sentinel(scales, sizeof(scales), "scales");
	assert_sentinel(&scale, 1, "scale");
	assert_sentinel(&g, sizeof(g), "g");

	memset(&qq, SENTINEL, sizeof(qq));
	/* d: a multiple of the block (16 NVFP4, 32 MXFP4), 1..1024; nterms 1 or 2. */
	cr_assert_eq(bd_query_quantize(x, 24, BD_FP4_NVFP4, 2, &qq), -EINVAL);
	cr_assert_eq(bd_query_quantize(x, 48, BD_FP4_MXFP4, 2, &qq), -EINVAL);
	cr_assert_eq(bd_query_quantize(x, 0, BD_FP4_NVFP4, 2, &qq), -EINVAL);
	cr_assert_eq(bd_query_quantize(x, 2048, BD_FP4_NVFP4, 2, &qq), -EINVAL);
	cr_assert_eq(bd_query_quantize(x, 64, BD_FP4_NVFP4, 0, &qq), -EINVAL);
	cr_assert_eq(bd_query_quantize(x, 64, BD_FP4_NVFP4, 3, &qq), -EINVAL);
	cr_assert_eq(bd_query_quantize(x, 64, (enum bd_fp4_format)2, 1, &qq), -EINVAL);
	cr_assert_eq(bd_query_quantize(NULL, 64, BD_FP4_NVFP4, 1, &qq), -EINVAL);
	cr_assert_eq(bd_query_quantize(x, 64, BD_FP4_NVFP4, 1, NULL), -EINVAL);
	assert_sentinel(&qq, sizeof(qq), "query");
}

/* ---- dual-residual query (§5) ------------------------------------------------------------------- */

/* Squared reconstruction error of one term, Σ (q − deq q⁽¹⁾)², against two terms,
 * Σ (q − deq q⁽¹⁾ − deq q⁽²⁾)², over 200 random d = 128 vectors with a 20× channel outlier:
 * every trial's ratio must be ≥ min_ratio and the ratio of the summed errors ≥ min_total. */
static void check_dual_residual(enum bd_fp4_format fmt, double min_ratio, double min_total,
				uint64_t seed)
{
	static float q[128], y1[128], y2[128], y12[128];
	struct bd_qquant one, two;
	double s1 = 0.0, s2 = 0.0;

	rng = (struct tg_rng){ seed };
	for (int t = 0; t < 200; t++) {
		double e1, e2;

		for (int i = 0; i < 128; i++)
			q[i] = tg_gauss(&rng);
		q[tg_next(&rng) % 128] *= 20.0f; /* a channel outlier */
		cr_assert_eq(bd_query_quantize(q, 128, fmt, 1, &one), 0);
		cr_assert_eq(bd_query_quantize(q, 128, fmt, 2, &two), 0);
		cr_assert_eq(one.nterms, 1);
		cr_assert_eq(two.nterms, 2);
		cr_assert_eq(two.d, 128);
		bd_query_dequantize(&one, 0, y1);
		bd_query_dequantize(&two, 0, y12);
		bd_query_dequantize(&two, 1, y2);
		/* Term 1 of both is the same quantization of q. */
		for (int i = 0; i < 128; i++)
			cr_assert_eq(bd_f32_bits(y12[i]), bd_f32_bits(y1[i]));
		for (int i = 0; i < 128; i++)
			y12[i] = y1[i] + y2[i];
		e1 = l2_diff(q, y1, 128);
		e1 *= e1;
		e2 = l2_diff(q, y12, 128);
		e2 *= e2;
		cr_assert_geq(e1, min_ratio * e2, "fmt %d trial %d: 1-term error %g, 2-term %g", fmt,
			      t, e1, e2);
		s1 += e1;
		s2 += e2;
	}
	cr_assert_geq(s1, min_total * s2, "fmt %d: summed 1-term error %g, 2-term %g", fmt, s1, s2);
}

Test(fp4, dual_residual_nvfp4)
{
	/* Paper §3.1: the residual term removes most of the first term's error. Measured over
	 * 2000 such vectors: squared-error ratio ≥ 49 per vector, ~107 summed (the L2 error drops
	 * ~10×, ≥ 7× per vector). Asserted: 10× per vector, 50× summed. */
	check_dual_residual(BD_FP4_NVFP4, 10.0, 50.0, 99);
}

Test(fp4, dual_residual_mxfp4)
{
	/* Power-of-two scales fit the residual less tightly: measured ≥ 14 per vector, ~47
	 * summed. Asserted: 5× per vector, 20× summed. */
	check_dual_residual(BD_FP4_MXFP4, 5.0, 20.0, 100);
}

Test(fp4, query_terms_structure)
{
	float q[64], r[64], deq[64], g;
	uint8_t packed[32], scales[4];
	struct bd_qquant qq;
	float amax = 0.0f;

	rng = (struct tg_rng){ 5 };
	for (int i = 0; i < 64; i++) {
		q[i] = tg_gauss(&rng);
		amax = fmaxf(amax, fabsf(q[i]));
	}
	cr_assert_eq(bd_query_quantize(q, 64, BD_FP4_NVFP4, 2, &qq), 0);
	cr_assert_eq(qq.fmt, BD_FP4_NVFP4);
	/* Query g = amax / (6·448), standard rule (κ = 6). */
	cr_assert_eq(qq.g[0], amax / 2688.0f);
	cr_assert_eq(bd_nvfp4_quantize(q, 64, BD_NVFP4_Q_SMAX, BD_SCALE_STANDARD, packed, scales,
				       &g), 0);
	cr_assert_eq(memcmp(packed, qq.codes[0], 32), 0);
	cr_assert_eq(memcmp(scales, qq.scales[0], 4), 0);
	/* Term 2 is the same quantizer applied to the FP32 residual q − deq(term 1). */
	bd_query_dequantize(&qq, 0, deq);
	for (int i = 0; i < 64; i++)
		r[i] = q[i] - deq[i];
	cr_assert_eq(bd_nvfp4_quantize(r, 64, BD_NVFP4_Q_SMAX, BD_SCALE_STANDARD, packed, scales,
				       &g), 0);
	cr_assert_eq(bd_f32_bits(qq.g[1]), bd_f32_bits(g));
	cr_assert_eq(memcmp(packed, qq.codes[1], 32), 0);
	cr_assert_eq(memcmp(scales, qq.scales[1], 4), 0);

	/* MXFP4: g = 1 for every term, scales per 32-block. */
	cr_assert_eq(bd_query_quantize(q, 64, BD_FP4_MXFP4, 2, &qq), 0);
	cr_assert_eq(qq.g[0], 1.0f);
	cr_assert_eq(qq.g[1], 1.0f);
	for (int b = 0; b < 2; b++) {
		uint8_t p[16], s;

		cr_assert_eq(bd_mxfp4_quantize_block(q + 32 * b, BD_SCALE_STANDARD, p, &s), 0);
		cr_assert_eq(s, qq.scales[0][b]);
		cr_assert_eq(memcmp(p, qq.codes[0] + 16 * b, 16), 0);
	}
}

/* ---- probability quantization (§6) -------------------------------------------------------------- */

static const struct bd_pscale ps_uf = { .c = 8.0f, .tau = 21.0f / 1024.0f, .underflow_aware = true };
static const struct bd_pscale ps_std = { .c = 1.0f, .tau = 21.0f / 1024.0f, .underflow_aware = false };

/* bd_p_quantize_block_nvfp4 of P[16] into ph[16]; returns the block's scale code. */
static uint8_t pquant(const float *P, float p_max, const struct bd_pscale *ps, float *ph)
{
	uint8_t s;

	bd_p_quantize_block_nvfp4(P, p_max, ps, ph, &s);
	return s;
}

Test(fp4, pquant_small_block_uses_kappa2)
{
	/* p_max = 0.002 ≤ τ/c = 21/8192 ≈ 0.00256 → κ = 2: s_P = E4M3(8·0.002/2 = 0.008);
	 * 0.008 < 2^-6 is subnormal, 0.008·512 = 4.096 → 4: code 4 (4·2^-9 = 0.0078125).
	 * The block's largest P = c·p_max = 0.016; 0.016·128 = 2.048 → E2M1 2. */
	float P[16] = { 0 }, ph[16];
	const float p_max = 0.002f;

	for (int i = 0; i < 16; i++)
		P[i] = 8.0f * p_max * (float)(16 - i) / 16.0f;
	uint8_t s = pquant(P, p_max, &ps_uf, ph);
	cr_assert_eq(s, bd_e4m3_encode(8.0f * p_max / 2.0f));
	cr_assert_eq(s, 4);
	cr_assert_eq(ph[0], 2.0f);
	/* P[15] = 0.001·128 = 0.128 → 0. */
	cr_assert_eq(ph[15], 0.0f);
}

Test(fp4, pquant_boundary_and_kappa6)
{
	float P[16] = { 0 }, ph[16];

	/* p_max = τ/c exactly (21/8192) is still κ = 2: 8·(21/8192)/2 = 21/2048, subnormal,
	 * ·512 = 5.25 → code 5 (κ = 6 would give 1.75 → 2). */
	P[0] = 8.0f * (21.0f / 8192.0f);
	cr_assert_eq(pquant(P, 21.0f / 8192.0f, &ps_uf, ph), 5);
	/* Next float above τ/c: κ = 6, s = E4M3(0.0034180…) → 0.00341·512 = 1.75 → 2. */
	cr_assert_eq(pquant(P, nextafterf(21.0f / 8192.0f, 1.0f), &ps_uf, ph), 2);
	/* p_max = 0.5 (> τ/c): κ = 6, s = E4M3(4/6) = 0x33 (0.6875); P = 4 → 4/0.6875 = 5.82 → 6. */
	P[0] = 4.0f;
	cr_assert_eq(pquant(P, 0.5f, &ps_uf, ph), 0x33);
	cr_assert_eq(ph[0], 6.0f);
	/* The tile max itself, standard rule (c = 1, κ = 6): P = p_max = 1, s = E4M3(1/6) =
	 * 1.333·2^-3, mantissa 2.67 → 3, exponent −3 + 7 = 4: code 4<<3 | 3 = 0x23 (0.171875);
	 * 1/0.171875 = 5.82 → 6. */
	P[0] = 1.0f;
	cr_assert_eq(pquant(P, 1.0f, &ps_std, ph), 0x23);
	cr_assert_eq(ph[0], 6.0f);
}

Test(fp4, pquant_underflow)
{
	/* p_max = 2^-11. Standard (c = 1, κ = 6): s_P = E4M3(2^-11/6) = E4M3(8.1e-5), ·512 = 0.04
	 * → 0: the whole block is lost (all P̂ = 0). Underflow-aware (c = 8, τ/c ≈ 0.00256 ≥ p_max,
	 * κ = 2): s_P = E4M3(8·2^-11/2 = 2^-9) = code 1; P_max = 8·2^-11 = 2^-8, ·512 = 2 → 2. */
	float P[16], ph[16];

	for (int i = 0; i < 16; i++)
		P[i] = 0x1p-11f * (i == 0 ? 1.0f : 0.5f);
	cr_assert_eq(pquant(P, 0x1p-11f, &ps_std, ph), 0);
	for (int i = 0; i < 16; i++)
		cr_assert_eq(ph[i], 0.0f);

	for (int i = 0; i < 16; i++)
		P[i] = 8.0f * 0x1p-11f * (i == 0 ? 1.0f : 0.5f);
	cr_assert_eq(pquant(P, 0x1p-11f, &ps_uf, ph), 1);
	cr_assert_eq(ph[0], 2.0f);
	cr_assert_eq(ph[1], 1.0f);
}

Test(fp4, pquant_nonfinite_untouched)
{
	/* No error return: a non-finite P or p_max leaves the outputs as they were. */
	float P[16] = { 0 }, ph[16];
	uint8_t s;

	P[7] = NAN;
	memset(ph, SENTINEL, sizeof(ph));
	memset(&s, SENTINEL, 1);
	bd_p_quantize_block_nvfp4(P, 0.5f, &ps_uf, ph, &s);
	assert_sentinel(ph, sizeof(ph), "phat");
	assert_sentinel(&s, 1, "scale");
	P[7] = 0.0f;
	bd_p_quantize_block_nvfp4(P, INFINITY, &ps_uf, ph, &s);
	assert_sentinel(ph, sizeof(ph), "phat");
	assert_sentinel(&s, 1, "scale");
}
