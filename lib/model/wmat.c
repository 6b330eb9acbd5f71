/* wmat.c — a weight matrix's rows and products, FP32 or ggml blocks (bd_wmat.h). */
#include <errno.h>
#include <string.h>

#include <cblas.h>

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

int bd_wmat_mul(const struct bd_wmat *W, const float *x, int n, bool per_row, float *scratch,
		float *y)
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
	if (n <= BD_WMAT_GEMV_ROWS || per_row) {
		for (int r = 0; r < n; r += BD_GGML_GEMV_MAX_X) {
			int k = n - r < BD_GGML_GEMV_MAX_X ? n - r : BD_GGML_GEMV_MAX_X;
			int rc = bd_ggml_gemv(W->type, W->blocks, W->row_bytes, out, in,
					      x + (size_t)r * uin, uin, k, y + (size_t)r * uout, uout);
			if (rc < 0)
				return rc;
		}
		return 0;
	}
	if (!scratch)
		return -EINVAL;
	int panel = (int)(bd_wmat_scratch_floats(in) / uin);
	for (int o0 = 0; o0 < out; o0 += panel) {
		int np = out - o0 < panel ? out - o0 : panel;
		int rc = bd_wmat_rows_f32(W, o0, np, scratch);
		if (rc < 0)
			return rc;
		cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, np, in, 1.0f, x, in,
			    scratch, in, 0.0f, y + o0, out);
	}
	return 0;
}
