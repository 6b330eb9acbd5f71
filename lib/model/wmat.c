/* wmat.c — a weight matrix's rows and products, FP32 or ggml blocks (bd_wmat.h). */
#include <errno.h>
#include <string.h>

#include <cblas.h>

#include "base/bd_tpool.h"
#include "formats/bd_ggml_gemv.h"
#include "model/bd_wmat.h"

#define PANEL_FLOATS ((size_t)1 << 18) /* 1 MiB of FP32 weight rows */

size_t bd_wmat_scratch_floats(int cols)
{
	return cols > 0 && (size_t)cols > PANEL_FLOATS ? (size_t)cols : PANEL_FLOATS;
}

int bd_wmat_rows_f32(const struct bd_wmat *W, int r0, int n, float *ret)
{
	if (!W || !ret || r0 < 0 || n < 1 || r0 > W->rows - n || (!W->f32 && !W->blocks))
		return -EINVAL;
	size_t c = (size_t)W->cols;
	if (W->f32) {
		memcpy(ret, W->f32 + (size_t)r0 * c, sizeof(float) * c * (size_t)n);
		return 0;
	}
	for (int i = 0; i < n; i++) {
		const char *row = (const char *)W->blocks + (size_t)(r0 + i) * W->row_bytes;
		int r = bd_ggml_gemv_supported(W->type)
				? bd_ggml_gemv_dequantize(W->type, row, c, ret + (size_t)i * c)
				: bd_ggml_dequantize(W->type, row, c, ret + (size_t)i * c);
		if (r < 0)
			return r;
	}
	return 0;
}

/* ---- the products on a pool's threads -------------------------------------------------------
 * Block products are shared out by weight rows: a call's matrices (one, or several of one
 * input, as Q, K and V are) are cut into chunks of `chunk` rows, and a task multiplies one
 * chunk by every activation row, each output by bd_ggml_gemv's per-row arithmetic, so the
 * result is the same bits whatever the chunks and threads. A panel of the sgemm path is
 * dequantized the same way, by rows. Calls smaller than PAR_MIN_MACS multiply-adds stay on the
 * caller's thread (the hand-off would cost more than it saves). */

#define PAR_MIN_MACS ((size_t)1 << 16)
#define CHUNK_ALIGN 16 /* weight rows: a chunk starts on a multiple of this */
#define MAX_MATS 4     /* matrices of one bd_wmat_mul_many call */

struct job {
	const struct bd_wmat *W[MAX_MATS];
	float *y[MAX_MATS];     /* gemv: y[i] [n][W[i].rows]; panel: y[0] the scratch rows */
	int t0[MAX_MATS + 1];   /* gemv: matrix i's chunks are tasks t0[i] .. t0[i + 1] − 1 */
	int k;                  /* matrices */
	const float *x;
	int n, r0, rows, chunk; /* panel: rows r0 .. r0 + rows − 1 of W[0] */
	int rc;                 /* atomic: a task's error */
};

/* Rows o0 .. o0 + no − 1 of y [n][out] from those rows of W, BD_GGML_GEMV_MAX_X activation
 * rows a call. */
static int gemv_rows(const struct bd_wmat *W, const float *x, int n, int o0, int no, float *y)
{
	size_t uin = (size_t)W->cols, uout = (size_t)W->rows;
	const char *w = (const char *)W->blocks + (size_t)o0 * W->row_bytes;
	for (int r = 0; r < n; r += BD_GGML_GEMV_MAX_X) {
		int k = n - r < BD_GGML_GEMV_MAX_X ? n - r : BD_GGML_GEMV_MAX_X;
		int rc = bd_ggml_gemv(W->type, w, W->row_bytes, no, W->cols, x + (size_t)r * uin,
				      uin, k, y + (size_t)r * uout + (size_t)o0, uout);
		if (rc < 0)
			return rc;
	}
	return 0;
}

static void gemv_task(void *arg, int t)
{
	struct job *j = arg;
	int i = 0;
	while (t >= j->t0[i + 1])
		i++;
	const struct bd_wmat *W = j->W[i];
	int o0 = (t - j->t0[i]) * j->chunk, no = W->rows - o0 < j->chunk ? W->rows - o0 : j->chunk;
	int rc = gemv_rows(W, j->x, j->n, o0, no, j->y[i]);
	if (rc < 0)
		__atomic_store_n(&j->rc, rc, __ATOMIC_RELAXED);
}

static void panel_task(void *arg, int t)
{
	struct job *j = arg;
	int i0 = t * j->chunk, ni = j->rows - i0 < j->chunk ? j->rows - i0 : j->chunk;
	float *dst = j->y[0] + (size_t)i0 * (size_t)j->W[0]->cols;
	int rc = bd_wmat_rows_f32(j->W[0], j->r0 + i0, ni, dst);
	if (rc < 0)
		__atomic_store_n(&j->rc, rc, __ATOMIC_RELAXED);
}

/* The chunk of a call of `rows` weight rows (all its matrices) of `cols` for n activation rows
 * on pool: a few tasks per thread, so a thread the machine slows down takes fewer; all the
 * rows when the pool has one thread or the call is small. */
static int chunk_rows(struct bd_tpool *pool, int rows, int cols, int n)
{
	int nt = bd_tpool_threads(pool);
	if (nt < 2 || (size_t)rows * (size_t)cols * (size_t)n < PAR_MIN_MACS)
		return rows;
	int tasks = 4 * nt, chunk = (rows + tasks - 1) / tasks;
	return (chunk + CHUNK_ALIGN - 1) / CHUNK_ALIGN * CHUNK_ALIGN;
}

/* W's product by the panel path (n > BD_WMAT_GEMV_ROWS, not per row). */
static int mul_panels(const struct bd_wmat *W, const float *x, int n, float *scratch,
		      struct bd_tpool *pool, float *y)
{
	int in = W->cols, out = W->rows;
	if (!scratch)
		return -EINVAL;
	int panel = (int)(bd_wmat_scratch_floats(in) / (size_t)in);
	struct job j = { .W = { W }, .y = { scratch }, .k = 1, .x = x, .n = n };
	for (int o0 = 0; o0 < out; o0 += panel) {
		int np = out - o0 < panel ? out - o0 : panel;
		j.r0 = o0;
		j.rows = np;
		j.chunk = chunk_rows(pool, np, in, 1);
		bd_tpool_run(pool, panel_task, &j, (np + j.chunk - 1) / j.chunk);
		if (j.rc < 0)
			return j.rc;
		cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, np, in, 1.0f, x, in,
			    scratch, in, 0.0f, y + o0, out);
	}
	return 0;
}

int bd_wmat_mul_many(int k, const struct bd_wmat *const *W, const float *x, int n,
		     bool per_row, float *scratch, struct bd_tpool *pool, float *const *y)
{
	if (k < 1 || k > MAX_MATS || !W || !x || !y || n < 1)
		return -EINVAL;
	for (int i = 0; i < k; i++)
		if (!W[i] || !y[i] || (!W[i]->f32 && !W[i]->blocks) || W[i]->cols != W[0]->cols)
			return -EINVAL;
	int in = W[0]->cols, rows = 0, rc;
	size_t uin = (size_t)in;
	struct job j = { .k = 0, .x = x, .n = n };
	for (int i = 0; i < k; i++) {
		const struct bd_wmat *M = W[i];
		int out = M->rows;
		if (M->f32) {
			if (n == 1 || per_row)
				for (int r = 0; r < n; r++)
					cblas_sgemv(CblasRowMajor, CblasNoTrans, out, in, 1.0f,
						    M->f32, in, x + (size_t)r * uin, 1, 0.0f,
						    y[i] + (size_t)r * (size_t)out, 1);
			else
				cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, out, in,
					    1.0f, x, in, M->f32, in, 0.0f, y[i], out);
		} else if (n > BD_WMAT_GEMV_ROWS && !per_row) {
			if ((rc = mul_panels(M, x, n, scratch, pool, y[i])) < 0)
				return rc;
		} else {
			j.W[j.k] = M;
			j.y[j.k++] = y[i];
			rows += out;
		}
	}
	if (j.k == 0)
		return 0;
	j.chunk = chunk_rows(pool, rows, in, n);
	for (int i = 0; i < j.k; i++)
		j.t0[i + 1] = j.t0[i] + (j.W[i]->rows + j.chunk - 1) / j.chunk;
	if (j.t0[j.k] == j.k) { /* one chunk per matrix: on this thread */
		for (int i = 0; i < j.k; i++)
			if ((rc = gemv_rows(j.W[i], x, n, 0, j.W[i]->rows, j.y[i])) < 0)
				return rc;
		return 0;
	}
	bd_tpool_run(pool, gemv_task, &j, j.t0[j.k]);
	return j.rc;
}

int bd_wmat_mul(const struct bd_wmat *W, const float *x, int n, bool per_row, float *scratch,
		struct bd_tpool *pool, float *y)
{
	return bd_wmat_mul_many(1, &W, x, n, per_row, scratch, pool, &y);
}
