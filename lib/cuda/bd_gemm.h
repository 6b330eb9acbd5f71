/* bd_gemm.h — the GPU model's matrix products through cuBLASLt, with the algorithm of each
 * shape chosen once and kept (bd_gmodel.h's GEMMs).
 *
 * A product is Y [N][M] FP32 = X [N][K] · W [M][K]ᵀ + β·Y: W row-major (a weight matrix of M
 * output rows), X N rows of K values with row stride ldb, in the context's input dtype (BF16, or
 * FP32 for equality checks against the CPU backend); accumulation and Y are FP32. Column-major
 * for cuBLASLt this is D (M × N) = Aᵀ·B, A the weight read transposed. β = 1 adds the product
 * into Y in the epilogue, rounded once as Y + (X·Wᵀ) (the residual add of a layer).
 *
 * Algorithms: cuBLASLt's heuristic answer for (M, N, K, ldb), kept in a cache of 128 shapes
 * (the oldest is replaced). FP32 inputs use the pedantic FP32 compute type (no TF32) and, for a
 * shape with no pedantic algorithm, plain FP32 compute (still FP32 products and sums). In a
 * context made with skinny_tuning (BF16 inputs), skinny shapes (N ≤ 64 rows) get up to 16
 * heuristic candidates, and while bd_gemm_set_tuning is on, the first product of such a shape
 * times each candidate on the stream (outside a graph capture: it synchronizes) and keeps the
 * fastest. Each timed run follows a write of twice the L2's size, so the weights come from HBM
 * as in a decode step (the buffer lives until tuning is switched off); BD_GEMM_TUNE_WARM=1 in
 * the environment times 8 candidates back to back with no flush instead, to measure what the
 * flush changes. The 32 MiB workspace is allocated once, so products can be captured into a
 * graph.
 *
 * Errors are -errno with a one-line message in ret_err (NULL or BD_MODEL_ERR_MAX bytes): -ENOMEM,
 * -EIO (cuBLASLt or CUDA failed, or has no algorithm for a shape). Not thread-safe: one thread
 * per context, which belongs to the caller's device.
 */
#ifndef BD_GEMM_H
#define BD_GEMM_H

#include <stdbool.h>
#include <stddef.h>

#include <cuda_runtime_api.h>

#include "bd_ops.h"

#ifdef __cplusplus
extern "C" {
#endif

struct bd_gemm_opts {
	enum bd_dtype dt;      /* BD_DT_BF16 or BD_DT_F32: the dtype of W and X */
	cudaStream_t stream;   /* every product and timing runs on it (the caller's) */
	bool skinny_tuning;    /* BF16 only: skinny shapes keep candidates to time */
	float *scratch;        /* device FP32 [scratch_floats], the caller's: where a β = 1
				* product is timed (Y itself must be written once) */
	size_t scratch_floats; /* a β = 1 shape larger than this is not timed */
};

struct bd_gemm;

/* A context on the current device: the cuBLASLt handle, the matmul descriptors and preference,
 * the workspace and the timing events. *ret only on success; opts is copied (scratch stays the
 * caller's). Returns 0, -EINVAL (NULL opts or ret, dt neither BF16 nor FP32), -ENOMEM, -EIO. */
int bd_gemm_new(const struct bd_gemm_opts *opts, struct bd_gemm **ret, char *ret_err);

/* Release everything the context made. NULL is a no-op. */
void bd_gemm_free(struct bd_gemm *gm);

/* Whether the next products time their shapes' candidates (see above): on for an eager step
 * outside a capture, off otherwise. */
void bd_gemm_set_tuning(struct bd_gemm *gm, bool on);

/* y [N][M] FP32 = x [N][K] (row stride ldb ≥ K elements, input dtype) · w [M][K]ᵀ + beta·y,
 * enqueued on the stream (beta 0 or 1; device pointers). Returns 0, -ENOMEM (a new shape's
 * layouts), -EIO (no algorithm for the shape, or cublasLtMatmul failed). */
int bd_gemm_run(struct bd_gemm *gm, const void *w, int M, int K, const void *x, int ldb, int N,
		float *y, float beta, char *ret_err);

#ifdef __cplusplus
}
#endif
#endif
