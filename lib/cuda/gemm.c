/* gemm.c — the GPU model's matrix products through cuBLASLt, algorithms chosen once per shape
 * (bd_gemm.h).
 */
#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "base/bd_err.h"
#include "cuda/bd_cuda_err.h"
#include "cuda/bd_gemm.h"
#include "model/bd_model.h"

#define GEMM_CACHE 128     /* GEMM shapes whose algorithm is kept */
#define GEMM_CANDIDATES 16 /* heuristic results timed for a skinny GEMM */
#define TUNE_REPS 3        /* timed runs of each candidate, after one untimed */
#define TUNE_MAX_ROWS 64   /* skinny: at most this many rows (N) */
#define LT_WS_BYTES ((size_t)32 << 20)

#define fail(ret_err, code, ...) bd_errf((ret_err), BD_MODEL_ERR_MAX, (code), __VA_ARGS__)

struct gemm_entry {
	int M, N, K, ldb;
	cublasLtMatrixLayout_t a, b, c;
	cublasLtMatmulAlgo_t algo;
	bool used, alt; /* alt: the non-pedantic FP32 descriptor (no pedantic algorithm) */
	bool tuned;     /* the algorithm is final (timed, or not to be timed) */
	int n_cand;
	cublasLtMatmulAlgo_t cand[GEMM_CANDIDATES];
};

struct bd_gemm {
	struct bd_gemm_opts o;
	cublasLtHandle_t lt;
	bool lt_ok;
	cublasLtMatmulDesc_t mm[2];      /* the context's compute type; plain FP32 compute (FP32
					  * inputs only: shapes with no pedantic algorithm) */
	cublasLtMatmulPreference_t pref;
	void *ws;                        /* LT_WS_BYTES of device workspace */
	cudaEvent_t tev[2];              /* candidate timing */
	bool tuning;                     /* new skinny shapes are timed */
	bool tune_warm;                  /* BD_GEMM_TUNE_WARM=1: no L2 flush, 8 candidates */
	void *flush;                     /* flush_bytes written between timed runs, or NULL */
	size_t flush_bytes;
	struct gemm_entry gc[GEMM_CACHE];
	int gc_next;
};

static void gemm_entry_free(struct gemm_entry *e)
{
	if (!e->used)
		return;
	cublasLtMatrixLayoutDestroy(e->a);
	cublasLtMatrixLayoutDestroy(e->b);
	cublasLtMatrixLayoutDestroy(e->c);
	e->used = false;
}

/* The layouts and algorithm of Y [N][M] = X [N][K] (row stride ldb) · W [M][K]ᵀ. */
/* Whether algo splits K over several CTAs (CUBLASLT_ALGO_CONFIG_SPLITK_NUM > 1); an algorithm
 * whose attribute cannot be read counts as not splitting. */
static bool algo_splits_k(const cublasLtMatmulAlgo_t *algo)
{
	int32_t splits = 1;
	size_t n = 0;
	if (cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits,
						 sizeof(splits), &n) != CUBLAS_STATUS_SUCCESS)
		return false;
	return splits > 1;
}

static int gemm_find(struct bd_gemm *gm, int M, int N, int K, int ldb, struct gemm_entry **ret)
{
	for (int i = 0; i < GEMM_CACHE; i++) {
		struct gemm_entry *e = &gm->gc[i];
		if (e->used && e->M == M && e->N == N && e->K == K && e->ldb == ldb) {
			*ret = e;
			return 0;
		}
	}
	struct gemm_entry *e = &gm->gc[gm->gc_next];
	gm->gc_next = (gm->gc_next + 1) % GEMM_CACHE;
	gemm_entry_free(e);
	cudaDataType_t in = gm->o.dt == BD_DT_BF16 ? CUDA_R_16BF : CUDA_R_32F;
	if (cublasLtMatrixLayoutCreate(&e->a, in, (uint64_t)K, (uint64_t)M, K) !=
	    CUBLAS_STATUS_SUCCESS)
		return -ENOMEM;
	if (cublasLtMatrixLayoutCreate(&e->b, in, (uint64_t)K, (uint64_t)N, ldb) !=
	    CUBLAS_STATUS_SUCCESS) {
		cublasLtMatrixLayoutDestroy(e->a);
		return -ENOMEM;
	}
	if (cublasLtMatrixLayoutCreate(&e->c, CUDA_R_32F, (uint64_t)M, (uint64_t)N, M) !=
	    CUBLAS_STATUS_SUCCESS) {
		cublasLtMatrixLayoutDestroy(e->a);
		cublasLtMatrixLayoutDestroy(e->b);
		return -ENOMEM;
	}
	e->used = true;
	cublasLtMatmulHeuristicResult_t h[GEMM_CANDIDATES];
	int nres = 0;
	/* skinny BF16 products may be timed (gemm_tune): ask for several candidates */
	int want = !gm->o.skinny_tuning || N > TUNE_MAX_ROWS ? 1
		   : gm->tune_warm			   ? GEMM_CANDIDATES / 2
							   : GEMM_CANDIDATES;
	memset(h, 0, sizeof(h));
	cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(gm->lt, gm->mm[0], e->a, e->b, e->c, e->c,
							  gm->pref, want, h, &nres);
	e->alt = false;
	if ((s != CUBLAS_STATUS_SUCCESS || nres < 1) && gm->mm[1]) {
		/* FP32 without the pedantic flag: still FP32 products and sums, never TF32 */
		nres = 0;
		s = cublasLtMatmulAlgoGetHeuristic(gm->lt, gm->mm[1], e->a, e->b, e->c, e->c,
						   gm->pref, 1, h, &nres);
		e->alt = true;
	}
	if (s != CUBLAS_STATUS_SUCCESS || nres < 1 || h[0].state != CUBLAS_STATUS_SUCCESS) {
		gemm_entry_free(e);
		return -ENOTSUP;
	}
	e->algo = h[0].algo;
	e->n_cand = 0;
	/* split-K candidates are left out: in a captured decode step each adds a memset or a
	 * reduction node per GEMM, and on the H200 a step graph with them took 113-134 us to
	 * launch against 45 us without them (bench/RESULTS.md), more than timing one GEMM
	 * alone shows them saving */
	for (int i = 0; i < nres && i < GEMM_CANDIDATES; i++)
		if (h[i].state == CUBLAS_STATUS_SUCCESS && !algo_splits_k(&h[i].algo))
			e->cand[e->n_cand++] = h[i].algo;
	if (e->n_cand > 0)
		e->algo = e->cand[0];
	e->tuned = e->n_cand < 2;
	e->M = M;
	e->N = N;
	e->K = K;
	e->ldb = ldb;
	*ret = e;
	return 0;
}

/* The buffer whose writes evict the weights from L2 between timed runs: twice the device's L2
 * (at least 64 MiB), allocated at the first timing and released when tuning is switched off.
 * Without it (BD_GEMM_TUNE_WARM, or no memory) the runs read the weights from L2 whenever
 * they fit (a layer's 20-50 MB of Qwen3-4B do, in the H200's 50 MB), and the fastest
 * algorithm there is not the fastest from HBM, where a decode step reads them. */
static void *tune_flush(struct bd_gemm *gm)
{
	int dev = 0, l2 = 0;
	if (gm->tune_warm || gm->flush)
		return gm->flush;
	if (cudaGetDevice(&dev) != cudaSuccess ||
	    cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev) != cudaSuccess)
		l2 = 0;
	gm->flush_bytes = (size_t)l2 * 2 > ((size_t)64 << 20) ? (size_t)l2 * 2 : (size_t)64 << 20;
	if (cudaMalloc(&gm->flush, gm->flush_bytes) != cudaSuccess) {
		(void)cudaGetLastError();
		gm->flush = NULL;
	}
	return gm->flush;
}

/* Pick the fastest of e's candidates by timing each on the stream (outside a capture: this
 * synchronizes), writing into y (beta 0) or the scratch (beta 1: y is the residual stream and
 * must be written once). Each candidate runs once untimed, then TUNE_REPS times, each run
 * alone between two events after the L2 flush (tune_flush), as a decode step meets its
 * weights: the sum of those runs is its time. A candidate that fails is skipped. */
static void gemm_tune(struct bd_gemm *gm, struct gemm_entry *e, const void *w, const void *x,
		      float *y, float beta)
{
	enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
	cudaStream_t st = gm->o.stream;
	e->tuned = true;
	if (cudaStreamIsCapturing(st, &cs) != cudaSuccess || cs != cudaStreamCaptureStatusNone)
		return;
	float *out = y;
	if (beta != 0.0f) {
		if ((size_t)e->M * (size_t)e->N > gm->o.scratch_floats)
			return;
		out = gm->o.scratch;
	}
	void *flush = tune_flush(gm);
	const float alpha = 1.0f, zero = 0.0f;
	float best = 0.0f;
	int pick = -1;
	for (int i = 0; i < e->n_cand; i++) {
		bool ok = true;
		float sum = 0.0f;
		for (int rep = 0; rep <= TUNE_REPS && ok; rep++) {
			if (flush)
				ok = cudaMemsetAsync(flush, rep, gm->flush_bytes, st) == cudaSuccess;
			ok = ok && cudaEventRecord(gm->tev[0], st) == cudaSuccess &&
			     cublasLtMatmul(gm->lt, gm->mm[0], &alpha, w, e->a, x, e->b, &zero, out,
					    e->c, out, e->c, &e->cand[i], gm->ws, LT_WS_BYTES,
					    st) == CUBLAS_STATUS_SUCCESS;
			float ms = 0.0f;
			ok = ok && cudaEventRecord(gm->tev[1], st) == cudaSuccess &&
			     cudaEventSynchronize(gm->tev[1]) == cudaSuccess &&
			     cudaEventElapsedTime(&ms, gm->tev[0], gm->tev[1]) == cudaSuccess;
			if (rep > 0)
				sum += ms;
		}
		if (ok && (pick < 0 || sum < best)) {
			best = sum;
			pick = i;
		}
	}
	(void)cudaGetLastError(); /* a refused candidate leaves no sticky error */
	if (pick >= 0)
		e->algo = e->cand[pick];
}

int bd_gemm_run(struct bd_gemm *gm, const void *w, int M, int K, const void *x, int ldb, int N,
		float *y, float beta, char *ret_err)
{
	struct gemm_entry *e;
	int r = gemm_find(gm, M, N, K, ldb, &e);
	if (r < 0)
		return fail(ret_err, r == -ENOTSUP ? -EIO : r,
			    "cuBLASLt has no algorithm for %d x %d x %d", M, N, K);
	if (!e->tuned && gm->tuning)
		gemm_tune(gm, e, w, x, y, beta);
	const float alpha = 1.0f;
	cublasStatus_t s = cublasLtMatmul(gm->lt, gm->mm[e->alt], &alpha, w, e->a, x,
					  e->b, &beta, y, e->c, y, e->c, &e->algo, gm->ws,
					  LT_WS_BYTES, gm->o.stream);
	if (s != CUBLAS_STATUS_SUCCESS)
		return fail(ret_err, -EIO, "cublasLtMatmul %d x %d x %d: status %d", M, N, K,
			    (int)s);
	return 0;
}

void bd_gemm_set_tuning(struct bd_gemm *gm, bool on)
{
	if (!gm)
		return;
	gm->tuning = on;
	if (!on && gm->flush) {
		/* after the step whose products were timed (cudaFree waits for the device) */
		cudaFree(gm->flush);
		gm->flush = NULL;
	}
}

/* A matmul descriptor of compute type ct: A transposed, B not, FP32 scale type. */
static bool desc_make(cublasLtMatmulDesc_t *ret, cublasComputeType_t ct)
{
	cublasOperation_t opT = CUBLAS_OP_T, opN = CUBLAS_OP_N;

	return cublasLtMatmulDescCreate(ret, ct, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
	       cublasLtMatmulDescSetAttribute(*ret, CUBLASLT_MATMUL_DESC_TRANSA, &opT,
					      sizeof(opT)) == CUBLAS_STATUS_SUCCESS &&
	       cublasLtMatmulDescSetAttribute(*ret, CUBLASLT_MATMUL_DESC_TRANSB, &opN,
					      sizeof(opN)) == CUBLAS_STATUS_SUCCESS;
}

static int gemm_init(struct bd_gemm *gm, char *ret_err)
{
	bool f32 = gm->o.dt == BD_DT_F32;
	uint64_t ws = LT_WS_BYTES;
	cudaError_t e;

	if (cublasLtCreate(&gm->lt) != CUBLAS_STATUS_SUCCESS)
		return fail(ret_err, -EIO, "cublasLtCreate failed");
	gm->lt_ok = true;
	if (!desc_make(&gm->mm[0], f32 ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F) ||
	    (f32 && !desc_make(&gm->mm[1], CUBLAS_COMPUTE_32F)))
		return fail(ret_err, -EIO, "cuBLASLt matmul descriptor");
	if (cublasLtMatmulPreferenceCreate(&gm->pref) != CUBLAS_STATUS_SUCCESS ||
	    cublasLtMatmulPreferenceSetAttribute(gm->pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
						 &ws, sizeof(ws)) != CUBLAS_STATUS_SUCCESS)
		return fail(ret_err, -EIO, "cuBLASLt preference");
	if ((e = cudaMalloc(&gm->ws, LT_WS_BYTES)) != cudaSuccess) {
		gm->ws = NULL;
		return fail(ret_err, bd_cuda_errno(e), "cudaMalloc of %zu bytes: %s", LT_WS_BYTES,
			    cudaGetErrorString(e));
	}
	if ((e = cudaEventCreate(&gm->tev[0])) != cudaSuccess ||
	    (e = cudaEventCreate(&gm->tev[1])) != cudaSuccess)
		return fail(ret_err, bd_cuda_errno(e), "cudaEventCreate: %s",
			    cudaGetErrorString(e));
	return 0;
}

int bd_gemm_new(const struct bd_gemm_opts *opts, struct bd_gemm **ret, char *ret_err)
{
	if (!opts || !ret || (opts->dt != BD_DT_BF16 && opts->dt != BD_DT_F32))
		return fail(ret_err, -EINVAL, "bd_gemm_new: missing options or result, or a dtype "
					      "other than BF16 and FP32");
	struct bd_gemm *gm = calloc(1, sizeof(*gm));
	if (!gm)
		return fail(ret_err, -ENOMEM, "out of memory");
	gm->o = *opts;
	gm->o.skinny_tuning = opts->skinny_tuning && opts->dt == BD_DT_BF16;
	const char *warm = getenv("BD_GEMM_TUNE_WARM");
	gm->tune_warm = warm && strcmp(warm, "1") == 0;
	int r = gemm_init(gm, ret_err);
	if (r < 0) {
		bd_gemm_free(gm);
		return r;
	}
	*ret = gm;
	return 0;
}

void bd_gemm_free(struct bd_gemm *gm)
{
	if (!gm)
		return;
	for (int i = 0; i < GEMM_CACHE; i++)
		gemm_entry_free(&gm->gc[i]);
	if (gm->pref)
		cublasLtMatmulPreferenceDestroy(gm->pref);
	for (int i = 0; i < 2; i++) {
		if (gm->mm[i])
			cublasLtMatmulDescDestroy(gm->mm[i]);
		if (gm->tev[i])
			cudaEventDestroy(gm->tev[i]);
	}
	if (gm->flush)
		cudaFree(gm->flush);
	if (gm->lt_ok)
		cublasLtDestroy(gm->lt);
	if (gm->ws)
		cudaFree(gm->ws);
	free(gm);
}
