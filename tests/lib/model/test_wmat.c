/* test_wmat.c — bd_wmat.h: a matrix of blocks against the same matrix dequantized to FP32,
 * through the one-row and small-batch GEMV, the panel-and-sgemm path of larger batches and the
 * per-row (batch-invariant) path; the same bits on 1, 2 and 3 threads for the embedded model's
 * matrices; the refusals. Suite "wmat".
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <criterion/criterion.h>

#include "model_data.h"
#include "testgen.h"

#include "base/bd_tpool.h"
#include "model/bd_model.h"
#include "model/bd_wmat.h"

#define OUT 37
#define IN 96
#define ROWS 11 /* more than BD_WMAT_GEMV_ROWS: the panel path */

static struct tg_rng rng = { 0x9e3779b97f4a7c15ull };

static uint32_t next(void)
{
	return (uint32_t)(tg_next(&rng) >> 32);
}

struct fixture {
	uint8_t blocks[OUT * (IN / 32) * 20];
	float f32[OUT * IN], x[ROWS * IN];
	struct bd_wmat q, f;
};

/* Q4_1 rows with scales 2^-4 .. 2^-1 and the same matrix in FP32 */
static void make(struct fixture *fx)
{
	for (size_t i = 0; i < sizeof(fx->blocks); i++)
		fx->blocks[i] = (uint8_t)next();
	for (int b = 0; b < OUT * IN / 32; b++) {
		uint16_t d = (uint16_t)((11 + next() % 4) << 10 | (next() & 0x3ff));
		uint16_t m = (uint16_t)(1u << 15 | (11 + next() % 4) << 10);
		uint8_t *p = fx->blocks + (size_t)b * 20;
		p[0] = (uint8_t)d, p[1] = (uint8_t)(d >> 8), p[2] = (uint8_t)m, p[3] = (uint8_t)(m >> 8);
	}
	fx->q = (struct bd_wmat){ .blocks = fx->blocks, .row_bytes = IN / 32 * 20,
				  .type = BD_GGML_Q4_1, .rows = OUT, .cols = IN };
	cr_assert_eq(bd_wmat_rows_f32(&fx->q, 0, OUT, fx->f32), 0);
	fx->f = (struct bd_wmat){ .f32 = fx->f32, .type = BD_GGML_F32, .rows = OUT, .cols = IN };
	for (int i = 0; i < ROWS * IN; i++)
		fx->x[i] = (float)((int)(next() % 401) - 200) / 100.0f;
}

Test(wmat, blocks_match_fp32_on_every_path)
{
	static struct fixture fx;
	float yq[ROWS * OUT], yf[ROWS * OUT], y1[OUT];
	float *scr = malloc(sizeof(float) * bd_wmat_scratch_floats(IN));
	make(&fx);
	const int ns[3] = { 1, 5, ROWS };
	for (int k = 0; k < 3; k++) {
		int n = ns[k];
		cr_assert_eq(bd_wmat_mul(&fx.q, fx.x, n, false, scr, NULL, yq), 0);
		cr_assert_eq(bd_wmat_mul(&fx.f, fx.x, n, false, NULL, NULL, yf), 0);
		for (int i = 0; i < n * OUT; i++)
			cr_assert_float_eq(yq[i], yf[i], 1e-4f * (1.0f + fabsf(yf[i])),
					   "n = %d, element %d: %g vs %g", n, i, yq[i], yf[i]);
	}
	/* the batch-invariant path: each of ROWS rows bitwise its one-row product */
	cr_assert_eq(bd_wmat_mul(&fx.q, fx.x, ROWS, true, NULL, NULL, yq), 0);
	for (int r = 0; r < ROWS; r++) {
		cr_assert_eq(bd_wmat_mul(&fx.q, fx.x + r * IN, 1, false, NULL, NULL, y1), 0);
		cr_assert_eq(memcmp(y1, yq + r * OUT, sizeof(y1)), 0, "row %d", r);
	}
	free(scr);
}

/* The embedded model's Q4_1 and Q8_0 matrices (a layer's q, k, gate and down and the LM head)
 * multiplied on pools of 2 and 3 threads give the bits of the caller's thread alone, on every
 * path: 1, 3 and 8 rows (the GEMV, its weight rows split into chunks), 11 rows per row (the
 * batch-invariant GEMV), 11 rows by panels and sgemm (the panels dequantized by chunks); and
 * the layer's q, k and v in one bd_wmat_mul_many call, the bits of three bd_wmat_mul calls.
 * The outputs start as NaN, so a chunk no thread took shows. */
Test(wmat, threads_give_the_same_bits, .timeout = 120)
{
	char path[TD_PATH_MAX], err[BD_MODEL_ERR_MAX];
	struct bd_model *m = NULL;
	struct bd_tpool *pool[3] = { NULL, NULL, NULL };
	cr_assert_eq(bd_model_load(td_model_path(path), &m, err), 0, "%s", err);
	cr_assert_eq(bd_tpool_new(2, &pool[1]), 0);
	cr_assert_eq(bd_tpool_new(3, &pool[2]), 0);
	const struct bd_model_layer *ly = &m->layers[m->hp.n_layers / 2];
	const struct bd_wmat *W[] = { &ly->wq, &ly->wk, &ly->w_gate, &ly->w_down, &m->output };
	int cols = m->hp.n_ff > m->hp.n_embd ? m->hp.n_ff : m->hp.n_embd;
	size_t ny = (size_t)11 * (size_t)m->output.rows;
	float *x = malloc(sizeof(float) * 11 * (size_t)cols);
	float *ys = malloc(sizeof(float) * 3 * ny); /* y[t]: thread count t's outputs */
	float *y[3] = { ys, ys + ny, ys + 2 * ny };
	float *scr = malloc(sizeof(float) * bd_wmat_scratch_floats(cols));
	cr_assert(x && ys && scr);
	for (int i = 0; i < 11 * cols; i++)
		x[i] = (float)((int)(next() % 2001) - 1000) / 1000.0f;
	static const struct {
		int n;
		bool per_row;
	} cases[] = { { 1, false }, { 3, false }, { 8, false }, { 11, true }, { 11, false } };
	for (size_t w = 0; w < sizeof(W) / sizeof(W[0]); w++) {
		cr_assert_null(W[w]->f32, "matrix %zu is not held as blocks", w);
		for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
			size_t n = (size_t)cases[c].n * (size_t)W[w]->rows;
			for (int t = 0; t < 3; t++) {
				for (size_t i = 0; i < n; i++)
					y[t][i] = NAN;
				cr_assert_eq(bd_wmat_mul(W[w], x, cases[c].n, cases[c].per_row, scr,
							 pool[t], y[t]),
					     0);
			}
			for (size_t i = 0; i < n; i++)
				cr_assert(!isnan(y[0][i]), "matrix %zu, %d rows: NaN at %zu", w,
					  cases[c].n, i);
			for (int t = 1; t < 3; t++)
				cr_assert_eq(memcmp(y[0], y[t], sizeof(float) * n), 0,
					     "matrix %zu (%d x %d, type %d), %d rows%s: %d threads "
					     "differ",
					     w, W[w]->rows, W[w]->cols, (int)W[w]->type, cases[c].n,
					     cases[c].per_row ? " per row" : "", t + 1);
		}
	}
	const struct bd_wmat *qkv[3] = { &ly->wq, &ly->wk, &ly->wv };
	for (int n = 1; n <= 11; n += 5) {
		size_t off[3] = { 0, (size_t)n * (size_t)ly->wq.rows, 0 };
		off[2] = off[1] + (size_t)n * (size_t)ly->wk.rows;
		float *yo[3] = { y[1] + off[0], y[1] + off[1], y[1] + off[2] };
		for (size_t i = 0; i < ny; i++)
			y[1][i] = NAN;
		cr_assert_eq(bd_wmat_mul_many(3, qkv, x, n, false, scr, pool[2], yo), 0);
		for (int i = 0; i < 3; i++) {
			cr_assert_eq(bd_wmat_mul(qkv[i], x, n, false, scr, NULL, y[0]), 0);
			cr_assert_eq(memcmp(y[0], yo[i], sizeof(float) * (size_t)n *
							     (size_t)qkv[i]->rows),
				     0, "q, k, v together, %d rows: matrix %d differs", n, i);
		}
	}
	/* refusals: no matrix, more than 4, inputs of different lengths */
	const struct bd_wmat *mixed[2] = { &ly->wq, &ly->w_down };
	float *yo[5] = { y[0], y[1], y[2], y[0], y[1] };
	const struct bd_wmat *five[5] = { &ly->wq, &ly->wq, &ly->wq, &ly->wq, &ly->wq };
	cr_expect_eq(bd_wmat_mul_many(0, qkv, x, 1, false, scr, pool[1], yo), -EINVAL);
	cr_expect_eq(bd_wmat_mul_many(5, five, x, 1, false, scr, pool[1], yo), -EINVAL);
	cr_expect_eq(bd_wmat_mul_many(2, mixed, x, 1, false, scr, pool[1], yo), -EINVAL);
	for (int t = 0; t < 3; t++)
		bd_tpool_free(pool[t]);
	free(ys);
	free(x);
	free(scr);
	bd_model_free(m);
}

Test(wmat, refusals)
{
	static struct fixture fx;
	float y[ROWS * OUT], row[IN];
	make(&fx);
	/* a large batch needs the scratch */
	cr_assert_eq(bd_wmat_mul(&fx.q, fx.x, ROWS, false, NULL, NULL, y), -EINVAL);
	cr_assert_eq(bd_wmat_mul(&fx.q, fx.x, 0, false, NULL, NULL, y), -EINVAL);
	cr_assert_eq(bd_wmat_mul(NULL, fx.x, 1, false, NULL, NULL, y), -EINVAL);
	struct bd_wmat none = { 0 };
	cr_assert_eq(bd_wmat_mul(&none, fx.x, 1, false, NULL, NULL, y), -EINVAL);
	cr_assert_eq(bd_wmat_rows_f32(&none, 0, 1, row), -EINVAL);
	cr_assert_eq(bd_wmat_rows_f32(&fx.q, OUT - 1, 2, row), -EINVAL);
	cr_assert_eq(bd_wmat_rows_f32(&fx.q, -1, 1, row), -EINVAL);
	/* a type the GEMV lacks: its error comes back */
	struct bd_wmat k = fx.q;
	k.type = BD_GGML_Q4_K;
	cr_assert_eq(bd_wmat_mul(&k, fx.x, 1, false, NULL, NULL, y), -ENOTSUP);
	cr_assert_eq(bd_wmat_scratch_floats(IN) / IN >= 1, 1);
	cr_assert_geq(bd_wmat_scratch_floats(1 << 20), (size_t)1 << 20);
}
