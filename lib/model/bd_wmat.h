/* bd_wmat.h — one weight matrix of the CPU model, held in FP32 or as ggml blocks in the mapped
 * GGUF file, and its product with activation rows.
 *
 * W is [rows][cols] row-major (y = W x, a GGUF tensor with ne = {cols, rows}). The model keeps
 * a matrix as the file's blocks when bd_ggml_gemv() multiplies their type (Q4_0, Q4_1, Q8_0)
 * and, for a tensor-parallel shard, its columns are cut on block boundaries; every other
 * matrix is dequantized to FP32 at load (bd_model.h).
 */
#ifndef BD_WMAT_H
#define BD_WMAT_H

#include <stdbool.h>
#include <stddef.h>

#include "formats/bd_ggml_quants.h"

struct bd_tpool; /* base/bd_tpool.h */

#ifdef __cplusplus
extern "C" {
#endif

/* A matrix [rows][cols]: f32 non-NULL, FP32 row-major (row r at f32 + r·cols), writable, in
 * the model's allocation; or f32 NULL and the rows are cols / blck blocks of type `type`, row r
 * at (const char *)blocks + r·row_bytes, inside the file the model keeps mapped (read-only). A
 * matrix the model does not hold (no LM head) has both NULL and rows 0. */
struct bd_wmat {
	float *f32;
	const void *blocks;
	size_t row_bytes;       /* blocks: bytes from one row to the next (≥ the row's blocks) */
	enum bd_ggml_type type; /* of the blocks; BD_GGML_F32 when f32 */
	int rows, cols;
};

/* Batches of at most this many rows multiply from the blocks (bd_ggml_gemv, the weights read
 * once per BD_GGML_GEMV_MAX_X rows); larger ones dequantize panels of weight rows into the
 * caller's scratch for OpenBLAS sgemm. */
#define BD_WMAT_GEMV_ROWS 8

/* FP32 elements of the scratch a product of more than BD_WMAT_GEMV_ROWS rows needs: a panel of
 * up to 1 MiB of weight rows, at least one row of cols. */
size_t bd_wmat_scratch_floats(int cols);

/* Dequantize rows r0 .. r0 + n − 1 of W into ret [n][cols] FP32 (the values of
 * bd_ggml_dequantize(), by bd_ggml_gemv_dequantize() for the types it has; FP32 rows copied). Returns 0, -EINVAL (NULL, rows out of range, a
 * matrix not held). */
int bd_wmat_rows_f32(const struct bd_wmat *W, int r0, int n, float *ret);

/* y [n][W.rows] = x [n][W.cols] · Wᵀ, FP32. An FP32 matrix: OpenBLAS sgemv per row (n = 1 or
 * per_row) or one sgemm. Blocks: bd_ggml_gemv() for n ≤ BD_WMAT_GEMV_ROWS or per_row, else
 * panels of bd_wmat_scratch_floats(W.cols) rows dequantized into scratch (that many floats)
 * and sgemm. per_row makes each row's sums independent of n (the batch-invariant decode,
 * bd_model_decode_batch_mode); otherwise a batch's rows may differ from one-row products in
 * FP32 rounding. scratch may be NULL when it is not needed. pool (NULL: this thread only)
 * shares a block product's weight rows, and a panel's dequantization, out over its threads;
 * each output keeps its one-thread arithmetic, so y is the same bits for any pool (the FP32
 * path is OpenBLAS's, threaded by OpenBLAS). Returns 0, -EINVAL (NULL, n < 1, a matrix not
 * held, scratch missing when needed), bd_ggml_gemv()'s errors; on error y is unspecified. */
int bd_wmat_mul(const struct bd_wmat *W, const float *x, int n, bool per_row, float *scratch,
		struct bd_tpool *pool, float *y);

/* The products y[i] = x · W[i]ᵀ of k ≤ 4 matrices of one input (Q, K and V; gate and up):
 * bd_wmat_mul() of each, with the same bits, in one hand-off to the pool (the block products'
 * rows of all k shared out together). All W[i].cols equal. Returns 0, -EINVAL (k outside
 * 1..4, NULL, unequal cols, and bd_wmat_mul()'s), bd_ggml_gemv()'s errors; on error every y[i]
 * is unspecified. */
int bd_wmat_mul_many(int k, const struct bd_wmat *const *W, const float *x, int n,
		     bool per_row, float *scratch, struct bd_tpool *pool, float *const *y);

#ifdef __cplusplus
}
#endif
#endif
