/* test_ggml_gemv.c — bd_ggml_gemv.h: the products over ggml blocks against dequantize-then-dot
 * (bd_ggml_dequantize, FP64 sums) for every supported type and every path this CPU runs, odd
 * shapes, strided and misaligned rows, batches bitwise equal to single rows, and the refusals.
 * Suite "gemv".
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <criterion/criterion.h>

#include "testgen.h"

#include "formats/bd_ggml_gemv.h"
#include "formats/bd_ggml_quants.h"

static struct tg_rng rng = { 0x2545f4914f6cdd1dull };

static uint32_t next(void)
{
	return (uint32_t)(tg_next(&rng) >> 32);
}

/* A random F16 of magnitude 2^-6 .. 2^1, either sign, stored little-endian at p. */
static void put_f16(uint8_t *p)
{
	uint16_t h = (uint16_t)((next() & 1) << 15 | (9 + next() % 8) << 10 | (next() & 0x3ff));
	p[0] = (uint8_t)h;
	p[1] = (uint8_t)(h >> 8);
}

/* Rows of random blocks of type t: out rows of in / 32 blocks, row_bytes apart. */
static void fill_blocks(int t, uint8_t *W, int out, int in, size_t row_bytes)
{
	size_t ts;
	bd_ggml_type_info(t, NULL, &ts);
	for (int o = 0; o < out; o++)
		for (int b = 0; b < in / 32; b++) {
			uint8_t *blk = W + (size_t)o * row_bytes + (size_t)b * ts;
			for (size_t i = 0; i < ts; i++)
				blk[i] = (uint8_t)next();
			put_f16(blk);
			if (t == BD_GGML_Q4_1)
				put_f16(blk + 2);
		}
}

static const int types[3] = { BD_GGML_Q4_0, BD_GGML_Q4_1, BD_GGML_Q8_0 };
static const char *isas[3] = { "c", "avx2", "avx512" };

/* One case: out × in of type t with padded, byte-misaligned rows and strided x and y; every
 * output within the FP32 summation bound of the FP64 dot of the dequantized row, and each of
 * the n_x rows bitwise what a one-row call gives. */
static void check_case(int t, int out, int in, int n_x)
{
	size_t ts, ldx = (size_t)in + 3, ldy = (size_t)out + 2;
	bd_ggml_type_info(t, NULL, &ts);
	size_t row_bytes = (size_t)in / 32 * ts + 5;
	uint8_t *buf = malloc(row_bytes * (size_t)out + 1), *W = buf + 1;
	float *x = malloc(sizeof(float) * ldx * (size_t)n_x);
	float *y = malloc(sizeof(float) * ldy * (size_t)n_x), *y1 = malloc(sizeof(float) * ldy);
	float *w = malloc(sizeof(float) * (size_t)in);
	cr_assert(buf && x && y && y1 && w);
	fill_blocks(t, W, out, in, row_bytes);
	for (size_t i = 0; i < ldx * (size_t)n_x; i++)
		x[i] = (float)((int)(next() % 2001) - 1000) / 500.0f;
	for (size_t i = 0; i < ldy * (size_t)n_x; i++)
		y[i] = -7.0f;

	cr_assert_eq(bd_ggml_gemv(t, W, row_bytes, out, in, x, ldx, n_x, y, ldy), 0);
	for (int o = 0; o < out; o++) {
		cr_assert_eq(bd_ggml_dequantize(t, W + (size_t)o * row_bytes, (size_t)in, w), 0);
		for (int r = 0; r < n_x; r++) {
			double ref = 0.0, mag = 0.0;
			for (int c = 0; c < in; c++) {
				ref += (double)w[c] * (double)x[(size_t)r * ldx + (size_t)c];
				mag += fabs((double)w[c] * (double)x[(size_t)r * ldx + (size_t)c]);
			}
			double got = y[(size_t)r * ldy + (size_t)o];
			/* γ_n: n FP32 roundings of the sum of n products, relative to Σ|w x| */
			double tol = (in + 2) * ldexp(1.0, -24) * mag + 1e-30;
			cr_assert_leq(fabs(got - ref), tol, "%s %s %dx%d row %d out %d: %.9g vs %.9g",
				      bd_ggml_type_name(t), bd_ggml_gemv_isa(), out, in, r, o, got,
				      ref);
		}
	}
	for (int r = 0; r < n_x; r++) {
		for (size_t o = (size_t)out; o < ldy; o++)
			cr_assert_eq(y[(size_t)r * ldy + o], -7.0f, "padding of y written");
		cr_assert_eq(bd_ggml_gemv(t, W, row_bytes, out, in, x + (size_t)r * ldx, ldx, 1, y1,
					  ldy), 0);
		cr_assert_eq(memcmp(y1, y + (size_t)r * ldy, sizeof(float) * (size_t)out), 0,
			     "row %d of a batch of %d differs from its one-row product", r, n_x);
	}
	free(buf);
	free(x);
	free(y);
	free(y1);
	free(w);
}

Test(gemv, every_type_and_path_matches_dequantize_then_dot)
{
	static const int outs[3] = { 1, 3, 17 }, ins[3] = { 32, 96, 608 };
	int paths = 0;
	for (int p = 0; p < 3; p++) {
		int rc = bd_ggml_gemv_set_isa(isas[p]);
		if (rc == -ENOTSUP)
			continue;
		cr_assert_eq(rc, 0);
		cr_assert_str_eq(bd_ggml_gemv_isa(), isas[p]);
		paths++;
		for (int t = 0; t < 3; t++)
			for (int i = 0; i < 3; i++)
				for (int o = 0; o < 3; o++)
					check_case(types[t], outs[o], ins[i], 1 + (i + o) % 4);
	}
	cr_assert_geq(paths, 1);
	cr_assert_eq(bd_ggml_gemv_set_isa("avx512") == 0 || bd_ggml_gemv_set_isa("avx2") == 0 ||
		     bd_ggml_gemv_set_isa("c") == 0, 1);
}

/* The paths add in different orders but decode the same weights: on one matrix they agree
 * to the summation bound (a wrong nibble order or scale in one path would not). */
Test(gemv, paths_agree_with_each_other)
{
	const int out = 5, in = 320;
	size_t ts;
	float x[320], y[3][5];
	int have[3] = { 0 };
	for (int i = 0; i < in; i++)
		x[i] = (float)((int)(next() % 201) - 100) / 50.0f;
	for (int t = 0; t < 3; t++) {
		bd_ggml_type_info(types[t], NULL, &ts);
		size_t rb = (size_t)in / 32 * ts;
		uint8_t *W = malloc(rb * out);
		fill_blocks(types[t], W, out, in, rb);
		for (int p = 0; p < 3; p++) {
			have[p] = bd_ggml_gemv_set_isa(isas[p]) == 0;
			if (have[p])
				cr_assert_eq(bd_ggml_gemv(types[t], W, rb, out, in, x, in, 1, y[p], out),
					     0);
		}
		for (int p = 1; p < 3; p++)
			for (int o = 0; have[p] && o < out; o++)
				cr_assert_float_eq(y[p][o], y[0][o], 1e-3f * (1.0f + fabsf(y[0][o])),
						   "%s vs c", isas[p]);
		free(W);
	}
	bd_ggml_gemv_set_isa("avx512");
}

/* The vector decoders give the dequantizer's values bit for bit, on every path. */
Test(gemv, dequantize_is_bd_ggml_dequantize_bitwise)
{
	const int n = 32 * 13;
	float *a = malloc(sizeof(float) * n), *b = malloc(sizeof(float) * n);
	uint8_t *buf = malloc(34 * 13 + 1);
	for (int t = 0; t < 3; t++) {
		size_t ts;
		bd_ggml_type_info(types[t], NULL, &ts);
		fill_blocks(types[t], buf + 1, 1, n, ts * 13);
		cr_assert_eq(bd_ggml_dequantize(types[t], buf + 1, (size_t)n, a), 0);
		for (int p = 0; p < 3; p++) {
			if (bd_ggml_gemv_set_isa(isas[p]) < 0)
				continue;
			memset(b, 0xff, sizeof(float) * n);
			cr_assert_eq(bd_ggml_gemv_dequantize(types[t], buf + 1, (size_t)n, b), 0);
			cr_assert_eq(memcmp(a, b, sizeof(float) * n), 0, "%s on %s",
				     bd_ggml_type_name(types[t]), isas[p]);
		}
	}
	float keep = b[0];
	cr_assert_eq(bd_ggml_gemv_dequantize(BD_GGML_Q4_1, buf, 48, b), -EINVAL);
	cr_assert_eq(bd_ggml_gemv_dequantize(BD_GGML_Q4_1, NULL, 32, b), -EINVAL);
	cr_assert_eq(bd_ggml_gemv_dequantize(BD_GGML_F16, buf, 32, b), -ENOTSUP);
	cr_assert_eq(memcmp(&keep, b, sizeof(float)), 0);
	bd_ggml_gemv_set_isa("avx512");
	free(a);
	free(b);
	free(buf);
}

Test(gemv, refuses_bad_inputs_and_leaves_y)
{
	uint8_t W[20 * 2 * 2] = { 0 };
	float x[64] = { 0 }, y[4] = { 5, 5, 5, 5 };
	const float keep[4] = { 5, 5, 5, 5 };

	cr_assert(bd_ggml_gemv_supported(BD_GGML_Q4_1) && bd_ggml_gemv_supported(BD_GGML_Q8_0));
	cr_assert(!bd_ggml_gemv_supported(BD_GGML_F16) && !bd_ggml_gemv_supported(BD_GGML_Q4_K));
	cr_assert(!bd_ggml_gemv_supported(-1) && !bd_ggml_gemv_supported(1000));
	cr_assert_eq(bd_ggml_gemv(BD_GGML_F16, W, 128, 2, 64, x, 64, 1, y, 2), -ENOTSUP);
	cr_assert_eq(bd_ggml_gemv(BD_GGML_Q6_K, W, 210, 2, 256, x, 256, 1, y, 2), -ENOTSUP);
	cr_assert_eq(bd_ggml_gemv(4, W, 40, 2, 64, x, 64, 1, y, 2), -ENOTSUP); /* retired id */
	/* a row length that is not a whole number of blocks */
	cr_assert_eq(bd_ggml_gemv(BD_GGML_Q4_1, W, 40, 2, 48, x, 48, 1, y, 2), -EINVAL);
	cr_assert_eq(bd_ggml_gemv(BD_GGML_Q4_1, W, 39, 2, 64, x, 64, 1, y, 2), -EINVAL);
	cr_assert_eq(bd_ggml_gemv(BD_GGML_Q4_1, W, 40, 2, 64, x, 64, 0, y, 2), -EINVAL);
	cr_assert_eq(bd_ggml_gemv(BD_GGML_Q4_1, W, 40, 2, 64, x, 64, BD_GGML_GEMV_MAX_X + 1, y,
				  2), -EINVAL);
	cr_assert_eq(bd_ggml_gemv(BD_GGML_Q4_1, W, 40, 2, 64, x, 63, 1, y, 2), -EINVAL);
	cr_assert_eq(bd_ggml_gemv(BD_GGML_Q4_1, W, 40, 2, 64, x, 64, 1, y, 1), -EINVAL);
	cr_assert_eq(bd_ggml_gemv(BD_GGML_Q4_1, W, 40, 0, 64, x, 64, 1, y, 2), -EINVAL);
	cr_assert_eq(bd_ggml_gemv(BD_GGML_Q4_1, NULL, 40, 2, 64, x, 64, 1, y, 2), -EINVAL);
	cr_assert_eq(bd_ggml_gemv(BD_GGML_Q4_1, W, 40, 2, 64, NULL, 64, 1, y, 2), -EINVAL);
	cr_assert_eq(bd_ggml_gemv(BD_GGML_Q4_1, W, 40, 2, 64, x, 64, 1, NULL, 2), -EINVAL);
	cr_assert_eq(memcmp(y, keep, sizeof(y)), 0, "a refused call wrote y");
	/* all-zero blocks give zeros: the call that is accepted does write */
	cr_assert_eq(bd_ggml_gemv(BD_GGML_Q4_1, W, 40, 2, 64, x, 64, 1, y, 2), 0);
	cr_assert(y[0] == 0.0f && y[1] == 0.0f && y[2] == 5.0f);

	const char *before = bd_ggml_gemv_isa();
	cr_assert_eq(bd_ggml_gemv_set_isa("sse9"), -EINVAL);
	cr_assert_eq(bd_ggml_gemv_set_isa(NULL), -EINVAL);
	cr_assert_str_eq(bd_ggml_gemv_isa(), before, "a refused choice changed the path");
}
