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
 * A block product is shared out by its weight rows: task t multiplies rows t·chunk .. of W by
 * every activation row, each output by bd_ggml_gemv's per-row arithmetic, so the result is the
 * same bits whatever the chunks and threads. A panel of the sgemm path is dequantized the same
 * way, by rows. Products smaller than PAR_MIN_MACS multiply-adds stay on the caller's thread
 * (the hand-off would cost more than it saves). */

#define PAR_MIN_MACS ((size_t)1 << 16)
#define CHUNK_ALIGN 16 /* weight rows: a chunk starts on a multiple of this */

struct job {
	const struct bd_wmat *W;
	const float *x;
	float *y; /* gemv: y [n][W.rows]; panel: the scratch rows */
	int n, r0, rows, chunk; /* panel: rows r0 .. r0 + rows − 1 of W */
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
	int o0 = t * j->chunk, no = j->W->rows - o0 < j->chunk ? j->W->rows - o0 : j->chunk;
	int rc = gemv_rows(j->W, j->x, j->n, o0, no, j->y);
	if (rc < 0)
		__atomic_store_n(&j->rc, rc, __ATOMIC_RELAXED);
}

static void panel_task(void *arg, int t)
{
	struct job *j = arg;
	int i0 = t * j->chunk, ni = j->rows - i0 < j->chunk ? j->rows - i0 : j->chunk;
	int rc = bd_wmat_rows_f32(j->W, j->r0 + i0, ni, j->y + (size_t)i0 * (size_t)j->W->cols);
	if (rc < 0)
		__atomic_store_n(&j->rc, rc, __ATOMIC_RELAXED);
}

/* Tasks of `rows` weight rows of `cols` for n activation rows on pool: sets j->chunk, returns
 * the task count (1: the caller's thread alone). */
static int split(struct bd_tpool *pool, struct job *j, int rows, int cols, int n)
{
	int nt = bd_tpool_threads(pool);
	if (nt < 2 || (size_t)rows * (size_t)cols * (size_t)n < PAR_MIN_MACS) {
		j->chunk = rows;
		return 1;
	}
	/* a few tasks per thread, so a thread the machine slows down takes fewer */
	int tasks = 4 * nt, chunk = (rows + tasks - 1) / tasks;
	chunk = (chunk + CHUNK_ALIGN - 1) / CHUNK_ALIGN * CHUNK_ALIGN;
	j->chunk = chunk;
	return (rows + chunk - 1) / chunk;
}

int bd_wmat_mul(const struct bd_wmat *W, const float *x, int n, bool per_row, float *scratch,
		struct bd_tpool *pool, float *y)
{
	if (!W || !x || !y || n < 1 || (!W->f32 && !W->blocks))
		return -EINVAL;
	int in = W->cols, out = W->rows;
	size_t uin = (size_t)in, uout = (size_t)out;

	if (W->f32) {
		if (n == 1 || per_row)
			for (int r = 0; r < n; r++)
				cblas_sgemv(CblasRowMajor, CblasNoTrans, out, in, 1.0f, W->f32, in,
					    x + (size_t)r * uin, 1, 0.0f, y + (size_t)r * uout, 1);
		else
			cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, out, in, 1.0f, x, in,
				    W->f32, in, 0.0f, y, out);
		return 0;
	}
	struct job j = { .W = W, .x = x, .n = n };
	if (n <= BD_WMAT_GEMV_ROWS || per_row) {
		int tasks = split(pool, &j, out, in, n);
		if (tasks == 1)
			return gemv_rows(W, x, n, 0, out, y);
		j.y = y;
		bd_tpool_run(pool, gemv_task, &j, tasks);
		return j.rc;
	}
	if (!scratch)
		return -EINVAL;
	int panel = (int)(bd_wmat_scratch_floats(in) / uin);
	for (int o0 = 0; o0 < out; o0 += panel) {
		int np = out - o0 < panel ? out - o0 : panel;
		j.y = scratch;
		j.r0 = o0;
		j.rows = np;
		bd_tpool_run(pool, panel_task, &j, split(pool, &j, np, in, 1));
		if (j.rc < 0)
			return j.rc;
		cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, np, in, 1.0f, x, in,
			    scratch, in, 0.0f, y + o0, out);
	}
	return 0;
}
