/* gmodel.c — the decoder forward pass on one CUDA device with the bdfp4 cache
 * (bd_gmodel.h).
 *
 * Weights live in one device allocation: matrices in the GEMM precision (BF16 or FP32), norm
 * weights, biases and μ_k in FP32. Per layer, q/k/v are one fused [Hq'd + 2Hkv'd][E] matrix
 * and gate/up one [2F'][E] matrix (gate rows first, as bd_op_swiglu reads them). Products
 * Y [n][out] = X [n][in] · W[out][in]ᵀ go through bd_gemm.h (cuBLASLt, algorithms chosen once
 * per shape and kept, the workspace preallocated), so a step can be captured.
 *
 * Decode pads its n rows up to a batch-size bucket (1, 2, 4, …, max_batch) whose decode plan,
 * metadata region and CUDA graph are fixed. Padding rows decode token 0 at positions 0..127 of
 * private dummy slots (distinct (slot, position) pairs, no pages), so every kernel sees
 * well-formed rows; their outputs are dropped. A step's metadata (tokens, positions, lengths,
 * slot pointers, sampling parameters, promotion pages) is a small packed header in mapped
 * pinned memory that the step's first kernel (inside the graph) copies to the device, so a
 * step makes no copy call. Block tables stay on the device, one row per slot: the host keeps
 * a mirror per slot and sends only the entries that changed (a router's table grows by
 * appended pages; a reused slot differs from its first changed entry on), which the first
 * kernel patches in before gathering the rows' tables for the decode kernel. Promotion of
 * completed pages, top-k and the log-probabilities of the rows that ask run after the graph
 * (their counts change from step to step; a step that wants none launches nothing more, and
 * the graph of a bucket is one whatever its rows ask). They read what the graph left: the
 * logits and, for log-probabilities, the sampled tokens in the result flags. The rows asking
 * for log-probabilities are listed in mapped pinned memory that their kernel reads.
 *
 * Per layer a decode step is 10 graph nodes plus cuBLASLt's: RMSNorm, the q/k/v product, one
 * fused kernel for bias, q/k norms, RoPE and the KV write (bd_gaux_qkv_decode, bit for bit the
 * separate ops), decode attention, the BF16 cast of its output, W_o with the residual added by
 * the GEMM (β = 1: x = W·a + x, one rounding as x + (W·a)), RMSNorm, gate/up, SwiGLU, W_down
 * with the residual. With TP > 1 the residual stays a separate add after the all-reduce.
 * For BF16 weights without TP, skinny GEMMs (≤ 64 rows) take the fastest of cuBLASLt's
 * heuristic candidates, timed once per shape at its first eager decode step (bd_gemm.h).
 *
 * Prefill runs the whole prompt through the layers keeping every layer's post-RoPE K and V
 * (FP32, [L][n][Hkv'·d]); only once the final activations are known finite is the cache
 * written: page by page (every layer's 128 tokens of page j into the slot's recent ring, then
 * promotion into new_pages[j]), then the tail, which is bd_model_prefill's write order per
 * (layer, position) pair and gives the same bytes. A chunk at p > 0 does the same for its
 * positions; its attention, layer by layer, reads a [p + n][kd] FP32 K'/V buffer: the context
 * dequantized from the block table's pages and the slot's sink (bd_op_kv_context), then the
 * chunk's own rows as the write path will store them (bd_op_kv_rows), with the queries rotated
 * (bd_op_fwht_rows) and an offset causal mask (bd_op_prefill_attn_ctx).
 */
#include <errno.h>
#include <math.h>
#include <sched.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "bd_gaux.h"
#include "base/bd_err.h"
#include "cuda/bd_cuda_err.h"
#include "cuda/bd_gemm.h"
#include "cuda/bd_gmodel.h"
#include "bd_kernels.h"
#include "bd_ops.h"

#define MAX_BUCKETS 12           /* 1, 2, 4, …, 1024 (and max_batch itself) */
#define STAGE_FLOATS ((size_t)16 << 20) /* host→device staging of BF16 uploads, floats */
#define DEV_ALIGN 256
#define MAX_TOP_K 64

/* ---- state ------------------------------------------------------------------------------- */

struct glayer {
	float *attn_norm, *ffn_norm; /* [E] */
	float *q_norm, *k_norm;      /* [d] or NULL */
	float *bqkv;                 /* [Wqkv] or NULL */
	float *mu;                   /* [Hkv'][d] or NULL */
	void *wqkv;                  /* [Wqkv][E] */
	void *wo;                    /* [E][qd'] */
	void *wgu;                   /* [2F'][E] */
	void *wdown;                 /* [E][F'] */
};

/* Offsets of one bucket's packed metadata. The header [0, hdr) is packed on the host and
 * copied by the step's first kernel; on the device it is followed by the rows' gathered block
 * tables (bt), on the host by the block-table patches: spans [B][4] and their values. */
struct md_layout {
	size_t tokens, pos, lens, slots, samp, ppages, pslots, hdr;
	size_t bt, bytes;             /* device */
	size_t spans, vals, host_bytes; /* host */
};

/* The distinct kernels of a captured graph and how often each is launched in it; cluster: the
 * cluster shape it is launched with (1×1×1 without one). Names from cudaFuncGetName (NULL
 * where the runtime does not know the function, e.g. a driver-API kernel). */
enum { GK_MAX = 48 };
struct graph_kernels {
	int n, kernel_nodes, opaque_nodes, other_nodes;
	struct {
		const void *func;
		const char *name;
		int count;
		unsigned cx, cy, cz;
	} k[GK_MAX];
};

struct bucket {
	int B;
	struct bd_decode_plan plan;
	size_t off;                /* of its region in md_dev */
	struct md_layout ml;
	void *ws;                  /* its decode workspace (plans place their counters apart) */
	cudaGraphExec_t exec;
	int nodes;                 /* of the captured graph */
	int runs;                  /* eager runs (the graph is captured after one) */
	struct graph_kernels gk;   /* what the graph launches, for bd_gmodel_graph_kernels */
};

/* Results of a step, device and pinned host: flags, sampled tokens, promotion statuses. */
enum { RES_FINITE = 0, RES_KSTATUS = 1, RES_EMBED = 2, RES_FLAGS = 4 };

struct bd_gmodel {
	struct bd_model_hparams hp;
	struct bd_model_shard sh;
	const struct bd_kvcfg *cfg;
	struct bd_layout lay;
	struct bd_decode_params dp;
	enum bd_dtype dt;
	size_t dts;
	int device, max_batch, max_tokens, max_prefill, use_graphs, timeout_ms;
	int E, d, Hq, Hkv, HqL, F, V, L, qd, kd, qdL, Wqkv, R;
	size_t n_slots;
	int failed;       /* 0, or the error that made the model unusable */
	bool comm_failed; /* that error came from the communicator */
	ncclComm_t comm;

	cudaStream_t st;
	cudaEvent_t ev0, ev1;
	struct bd_gemm *gemm; /* the products (bd_gemm.h) on st */

	void *wmem;
	void *embd, *out_w;
	float *out_norm;
	struct glayer *ly;

	void *pages, *slots;
	bool own_pages, own_slots;
	void *dummy;      /* n_dummy slots for padding rows */
	int n_dummy;

	/* activations, R rows */
	float *x, *qkv, *q, *k, *v, *att, *tmp, *gu, *logits;
	void *xn, *attb, *act;
	float *kall, *vall; /* [L][max_prefill][kd] */
	float *kctx, *vctx; /* [max_tokens][kd]: one layer's K' and V a chunk attends over */
	int32_t *iota;      /* [max(max_tokens, 128)]: 0, 1, 2, … */
	void *sample_ws;
	int32_t *top_ids;
	float *top_vals;
	float *lp_dev;          /* [Bmax] log-probabilities of the asking rows' tokens */
	int32_t *lp_ids;        /* [Bmax][MAX_TOP_K] */
	float *lp_vals;         /* [Bmax][MAX_TOP_K] */
	int32_t *lp_rows;       /* [Bmax] mapped pinned: the call rows that ask, in order */
	int32_t *lp_rows_dev;   /* lp_rows as the device addresses it */
	float *stage;

	struct bucket bk[MAX_BUCKETS];
	int n_buckets;
	void *md_dev, *md_host; /* md_host: mapped pinned memory */
	void *md_hdev;          /* md_host as the device addresses it */
	int bt_stride;
	int32_t *bt_slots;      /* device [n_slots][bt_stride]: each slot's block table */
	int32_t *bt_mirror;     /* host copy of bt_slots */
	int *bt_len;            /* [n_slots]: leading entries of bt_slots known equal to the mirror */
	int *res_dev, *res_host; /* [RES_FLAGS + Bmax tokens + Bmax promotion statuses] */
	int res_n;

	/* prefill / fill region: tokens [max_prefill], slot pointers [128], pages [n_pp],
	 * sampling [1], a chunk's block table [n_pp]; statuses [n_pp] */
	void *pf_dev, *pf_host;
	size_t pf_tokens, pf_slots, pf_pages, pf_samp, pf_bt, pf_bytes;
	int n_pp;
	int *pst_dev, *pst_host;

	uint8_t *seen; /* [n_slots] duplicate check */
	struct bd_gmodel_timing tm;
};

/* ---- errors -------------------------------------------------------------------------------- */

#define fail(ret_err, code, ...) bd_errf((ret_err), BD_MODEL_ERR_MAX, (code), __VA_ARGS__)

static void clear_err(char *ret_err)
{
	if (ret_err)
		ret_err[0] = '\0';
}

/* A CUDA call inside a function with `int r`, `char *ret_err` and a label `out`. */
#define CU(call)                                                                           \
	BD_CUDA_TRY(call, r = fail(ret_err, bd_cuda_errno(bd_cuda_e), "%s: %s", #call,         \
				   cudaGetErrorString(bd_cuda_e));                         \
		    goto out)

/* An int-returning launcher (bd_ops.h, bd_kernels.h) inside the same kind of function. */
#define OP(call)                                                                           \
	do {                                                                               \
		int o_ = (call);                                                           \
		if (o_ < 0) {                                                              \
			r = fail(ret_err, o_ == -EINVAL ? -EIO : o_, "%s failed (%d)", #call, o_); \
			goto out;                                                          \
		}                                                                          \
	} while (0)

static double now_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

/* The model is unusable after a device or communicator failure (bd_gmodel.h). */
static int model_fails(struct bd_gmodel *g, int code)
{
	if (code == -EIO || code == -EPIPE || code == -ETIMEDOUT) {
		if (!g->failed)
			g->failed = code;
	}
	return code;
}

/* ---- small helpers ------------------------------------------------------------------------- */

static size_t align_up(size_t n, size_t a)
{
	return (n + a - 1) / a * a;
}

static int dev_alloc(void **p, size_t bytes, char *ret_err)
{
	cudaError_t e = cudaMalloc(p, bytes ? bytes : DEV_ALIGN);
	if (e != cudaSuccess) {
		*p = NULL;
		return fail(ret_err, bd_cuda_errno(e), "cudaMalloc of %zu bytes: %s", bytes,
			    cudaGetErrorString(e));
	}
	return 0;
}

static void dev_free(void *p)
{
	if (p)
		cudaFree(p);
}

static void drop_graphs(struct bd_gmodel *g)
{
	for (int i = 0; i < g->n_buckets; i++) {
		if (g->bk[i].exec)
			cudaGraphExecDestroy(g->bk[i].exec);
		g->bk[i].exec = NULL;
		g->bk[i].runs = 0;
	}
}

/* Abort the communicator the model holds after its peer failed or a wait on it timed out (the
 * caller then never aborts it again: bd_gmodel_comm is NULL); the graphs that captured its
 * collectives go with it. */
static void abort_comm(struct bd_gmodel *g)
{
	ncclCommAbort(g->comm);
	g->comm = NULL;
	g->comm_failed = true;
	drop_graphs(g);
}

/* Wait for everything enqueued on the model's stream, polling the device and the
 * communicator, at most timeout_ms. */
static int wait_stream(struct bd_gmodel *g, char *ret_err)
{
	cudaError_t e = cudaEventRecord(g->ev1, g->st);
	if (e != cudaSuccess)
		return model_fails(g, fail(ret_err, -EIO, "cudaEventRecord: %s",
					   cudaGetErrorString(e)));
	double deadline = now_us() + (double)g->timeout_ms * 1e3;
	for (long spins = 0;; spins++) {
		e = cudaEventQuery(g->ev1);
		if (e == cudaSuccess)
			return 0;
		if (e != cudaErrorNotReady)
			return model_fails(g, fail(ret_err, -EIO, "device error: %s",
						   cudaGetErrorString(e)));
		if (g->comm) {
			ncclResult_t a = ncclSuccess;
			ncclResult_t q = ncclCommGetAsyncError(g->comm, &a);
			if (q != ncclSuccess || (a != ncclSuccess && a != ncclInProgress)) {
				abort_comm(g);
				return model_fails(g, fail(ret_err, -EPIPE,
							   "the TP all-reduce failed: %s",
							   ncclGetErrorString(q != ncclSuccess ? q
											       : a)));
			}
		}
		if (now_us() > deadline) {
			if (g->comm) /* the stream waits in NCCL: abort so that the device idles */
				abort_comm(g);
			return model_fails(g, fail(ret_err, -ETIMEDOUT,
						   "the device did not finish within %d ms",
						   g->timeout_ms));
		}
		if (spins > 2000) {
			struct timespec ts = { 0, 20000 };
			nanosleep(&ts, NULL);
		} else {
			sched_yield();
		}
	}
}

/* ---- weights -------------------------------------------------------------------------------- */

/* Hand out device memory from the weight block (base NULL: count only). */
static void *carve(uint8_t *base, size_t *cur, size_t bytes)
{
	void *p = base ? base + *cur : NULL;
	*cur += align_up(bytes ? bytes : 1, DEV_ALIGN);
	return p;
}

static size_t lay_weights(struct bd_gmodel *g, uint8_t *base)
{
	size_t cur = 0, E = (size_t)g->E, V = (size_t)g->V, d = (size_t)g->d, dts = g->dts;
	size_t W = (size_t)g->Wqkv, F = (size_t)g->F;
	g->embd = carve(base, &cur, V * E * dts);
	g->out_w = NULL;
	g->out_norm = NULL;
	if (g->sh.lm_head) {
		g->out_norm = carve(base, &cur, E * 4);
		g->out_w = g->hp.tied_embeddings ? g->embd : carve(base, &cur, V * E * dts);
	}
	for (int l = 0; l < g->L; l++) {
		struct glayer y;
		memset(&y, 0, sizeof(y));
		y.attn_norm = carve(base, &cur, E * 4);
		y.ffn_norm = carve(base, &cur, E * 4);
		if (g->hp.qk_norm) {
			y.q_norm = carve(base, &cur, d * 4);
			y.k_norm = carve(base, &cur, d * 4);
		}
		if (g->hp.attn_bias)
			y.bqkv = carve(base, &cur, W * 4);
		y.wqkv = carve(base, &cur, W * E * dts);
		y.wo = carve(base, &cur, E * (size_t)g->qd * dts);
		y.wgu = carve(base, &cur, 2 * F * E * dts);
		y.wdown = carve(base, &cur, E * F * dts);
		if (base) {
			y.mu = g->ly[l].mu; /* allocated apart (optional) */
			g->ly[l] = y;
		}
	}
	return cur;
}

/* Host FP32 src [n] into device dst at element offset off, in the GEMM dtype. */
static int put_mat(struct bd_gmodel *g, void *dst, size_t off, const float *src, size_t n,
		   char *ret_err)
{
	int r = 0;
	/* copies from pageable memory on the model's stream: ordered with the casts, and the
	 * host buffer is consumed before the call returns */
	if (g->dt == BD_DT_F32) {
		CU(cudaMemcpyAsync((float *)dst + off, src, n * 4, cudaMemcpyHostToDevice, g->st));
		return 0;
	}
	for (size_t i = 0; i < n; i += STAGE_FLOATS) {
		size_t c = n - i < STAGE_FLOATS ? n - i : STAGE_FLOATS;
		CU(cudaMemcpyAsync(g->stage, src + i, c * 4, cudaMemcpyHostToDevice, g->st));
		OP(bd_op_cast(g->stage, (uint16_t *)dst + off + i, BD_DT_BF16, c, g->st));
	}
out:
	return r;
}

/* Matrix W of the CPU model into dst at element off: FP32 rows as they are; a matrix held as
 * the file's blocks is dequantized into a temporary buffer first (the CPU model keeps no FP32
 * copy), which the staged copy has consumed when put_mat returns. */
static int put_wmat(struct bd_gmodel *g, void *dst, size_t off, const struct bd_wmat *W,
		    char *ret_err)
{
	size_t n = (size_t)W->rows * (size_t)W->cols;
	if (W->f32)
		return put_mat(g, dst, off, W->f32, n, ret_err);
	float *tmp = malloc(sizeof(float) * n);
	if (!tmp)
		return fail(ret_err, -ENOMEM, "out of host memory for a weight's upload");
	int r = bd_wmat_rows_f32(W, 0, W->rows, tmp);
	if (r < 0)
		r = fail(ret_err, r, "weight dequantization failed (%d)", r);
	else
		r = put_mat(g, dst, off, tmp, n, ret_err);
	free(tmp);
	return r;
}

static int put_vec(struct bd_gmodel *g, float *dst, const float *src, size_t n,
		   char *ret_err)
{
	int r = 0;
	CU(cudaMemcpyAsync(dst, src, n * 4, cudaMemcpyHostToDevice, g->st));
out:
	return r;
}

static int upload(struct bd_gmodel *g, const struct bd_model *m, char *ret_err)
{
	size_t E = (size_t)g->E, d = (size_t)g->d, F = (size_t)g->F;
	size_t qd = (size_t)g->qd, kd = (size_t)g->kd;
	int r;

	if ((r = put_wmat(g, g->embd, 0, &m->tok_embd, ret_err)) < 0)
		return r;
	if (g->sh.lm_head) {
		if ((r = put_vec(g, g->out_norm, m->output_norm, E, ret_err)) < 0)
			return r;
		if (!g->hp.tied_embeddings &&
		    (r = put_wmat(g, g->out_w, 0, &m->output, ret_err)) < 0)
			return r;
	}
	for (int l = 0; l < g->L; l++) {
		const struct bd_model_layer *a = &m->layers[l];
		struct glayer *y = &g->ly[l];
		if ((r = put_vec(g, y->attn_norm, a->attn_norm, E, ret_err)) < 0 ||
		    (r = put_vec(g, y->ffn_norm, a->ffn_norm, E, ret_err)) < 0)
			return r;
		if (g->hp.qk_norm && ((r = put_vec(g, y->q_norm, a->q_norm, d, ret_err)) < 0 ||
				      (r = put_vec(g, y->k_norm, a->k_norm, d, ret_err)) < 0))
			return r;
		if (g->hp.attn_bias && ((r = put_vec(g, y->bqkv, a->bq, qd, ret_err)) < 0 ||
					(r = put_vec(g, y->bqkv + qd, a->bk, kd, ret_err)) < 0 ||
					(r = put_vec(g, y->bqkv + qd + kd, a->bv, kd, ret_err)) < 0))
			return r;
		if ((r = put_wmat(g, y->wqkv, 0, &a->wq, ret_err)) < 0 ||
		    (r = put_wmat(g, y->wqkv, qd * E, &a->wk, ret_err)) < 0 ||
		    (r = put_wmat(g, y->wqkv, (qd + kd) * E, &a->wv, ret_err)) < 0 ||
		    (r = put_wmat(g, y->wo, 0, &a->wo, ret_err)) < 0 ||
		    (r = put_wmat(g, y->wgu, 0, &a->w_gate, ret_err)) < 0 ||
		    (r = put_wmat(g, y->wgu, F * E, &a->w_up, ret_err)) < 0 ||
		    (r = put_wmat(g, y->wdown, 0, &a->w_down, ret_err)) < 0)
			return r;
	}
	return 0;
}

static uint64_t mix_seed(uint64_t seed, uint64_t i)
{
	uint64_t z = seed + 0x9e3779b97f4a7c15ull * (i + 1);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

/* Random weights on the device: matrices N(0, 1/fan-in), norm weights 1, biases 0. */
static int randomize(struct bd_gmodel *g, uint64_t seed, char *ret_err)
{
	size_t E = (size_t)g->E, V = (size_t)g->V, d = (size_t)g->d, F = (size_t)g->F;
	size_t W = (size_t)g->Wqkv, qd = (size_t)g->qd;
	float sE = 1.0f / sqrtf((float)E), sQ = 1.0f / sqrtf((float)qd);
	float sF = 1.0f / sqrtf((float)F);
	size_t nones = E > d ? E : d;
	float *ones = malloc(nones * sizeof(float));
	int r = 0;

	if (!ones)
		return fail(ret_err, -ENOMEM, "out of memory");
	for (size_t i = 0; i < nones; i++)
		ones[i] = 1.0f;
	OP(bd_op_fill_normal(g->embd, g->dt, V * E, mix_seed(seed, 0), 0.0f, sE, g->st));
	if (g->sh.lm_head) {
		if ((r = put_vec(g, g->out_norm, ones, E, ret_err)) < 0)
			goto out;
		if (!g->hp.tied_embeddings)
			OP(bd_op_fill_normal(g->out_w, g->dt, V * E, mix_seed(seed, 1), 0.0f, sE,
					     g->st));
	}
	for (int l = 0; l < g->L; l++) {
		struct glayer *y = &g->ly[l];
		/* per (layer, tensor) seeds: a shard's tensors are not its full model's slices */
		uint64_t s = mix_seed(seed, 1000 + (uint64_t)l);
		if ((r = put_vec(g, y->attn_norm, ones, E, ret_err)) < 0 ||
		    (r = put_vec(g, y->ffn_norm, ones, E, ret_err)) < 0)
			goto out;
		if (g->hp.qk_norm && ((r = put_vec(g, y->q_norm, ones, d, ret_err)) < 0 ||
				      (r = put_vec(g, y->k_norm, ones, d, ret_err)) < 0))
			goto out;
		if (y->bqkv)
			CU(cudaMemset(y->bqkv, 0, W * sizeof(float)));
		OP(bd_op_fill_normal(y->wqkv, g->dt, W * E, mix_seed(s, 1), 0.0f, sE, g->st));
		OP(bd_op_fill_normal(y->wo, g->dt, E * qd, mix_seed(s, 2), 0.0f, sQ, g->st));
		OP(bd_op_fill_normal(y->wgu, g->dt, 2 * F * E, mix_seed(s, 3), 0.0f, sE, g->st));
		OP(bd_op_fill_normal(y->wdown, g->dt, E * F, mix_seed(s, 4), 0.0f, sF, g->st));
	}
	CU(cudaDeviceSynchronize());
out:
	free(ones);
	return r;
}

/* ---- construction --------------------------------------------------------------------------- */

static int shape_ok(const struct bd_model_hparams *hp)
{
	return hp->n_layers >= 1 && hp->n_embd >= 1 && hp->n_ff >= 1 && hp->n_heads >= 1 &&
	       hp->n_kv_heads >= 1 && hp->head_dim >= 1 && hp->n_vocab >= 1 &&
	       hp->n_heads % hp->n_kv_heads == 0 && hp->head_dim_v == hp->head_dim &&
	       hp->n_rot >= 2 && hp->n_rot % 2 == 0 && hp->n_rot <= hp->head_dim &&
	       isfinite(hp->rope_base) && hp->rope_base > 0.0f && isfinite(hp->norm_eps) &&
	       hp->norm_eps > 0.0f &&
	       (hp->rope_style == BD_ROPE_NORM || hp->rope_style == BD_ROPE_NEOX);
}

static struct md_layout md_layout_of(int B, int bt_stride)
{
	struct md_layout m;
	size_t c = 0, b = (size_t)B;
	m.tokens = c;
	c = align_up(c + b * 4, 16);
	m.pos = c;
	c = align_up(c + b * 4, 16);
	m.lens = c;
	c = align_up(c + b * 4, 16);
	m.slots = c;
	c = align_up(c + b * 8, 16);
	m.samp = c;
	c = align_up(c + b * sizeof(struct bd_gsample), 16);
	m.ppages = c;
	c = align_up(c + b * 4, 16);
	m.pslots = c;
	c = align_up(c + b * 8, 16);
	m.hdr = c;
	m.bt = align_up(c, DEV_ALIGN);
	m.bytes = align_up(m.bt + b * (size_t)bt_stride * 4, DEV_ALIGN);
	m.spans = c;
	m.vals = c + b * 16;
	m.host_bytes = align_up(m.vals + b * (size_t)bt_stride * 4, DEV_ALIGN);
	return m;
}

static int check_opts(const struct bd_model_hparams *hp, const struct bd_model_shard *sh,
		      const struct bd_gmodel_opts *o, char *ret_err)
{
	if (!shape_ok(hp))
		return fail(ret_err, -EINVAL, "model hyperparameters out of range");
	if (sh->tp < 1 || sh->rank < 0 || sh->rank >= sh->tp || sh->n_kv_heads < 1 ||
	    sh->n_heads != sh->n_kv_heads * (hp->n_heads / hp->n_kv_heads) || sh->n_ff < 1)
		return fail(ret_err, -EINVAL, "bad shard");
	if (!o->cfg)
		return fail(ret_err, -EINVAL, "no KV configuration");
	if (o->weights != BD_GWEIGHTS_BF16 && o->weights != BD_GWEIGHTS_F32)
		return fail(ret_err, -EINVAL, "unknown weight precision %d", (int)o->weights);
	if (o->max_batch < 1 || o->max_batch > 1024)
		return fail(ret_err, -EINVAL, "max_batch %d outside 1..1024", o->max_batch);
	if (o->max_tokens < 1 || o->max_prefill < 1 || o->max_prefill > o->max_tokens)
		return fail(ret_err, -EINVAL, "max_tokens %d / max_prefill %d out of range",
			    o->max_tokens, o->max_prefill);
	if (o->ar_timeout_ms < 0 || o->n_slots < 1 || o->n_slots > (size_t)INT32_MAX)
		return fail(ret_err, -EINVAL, "ar_timeout_ms or n_slots out of range");
	if (sh->tp > 1 && !o->nccl_comm)
		return fail(ret_err, -EINVAL, "rank %d of %d needs an NCCL communicator", sh->rank,
			    sh->tp);
	const struct bd_layout *l = &o->lay;
	bool heads_ok = sh->tp > 1 ? l->n_kv_heads >= sh->n_kv_heads
				   : l->n_kv_heads == sh->n_kv_heads;
	if (l->fmt != o->cfg->page_fmt || l->n_layers != hp->n_layers || !heads_ok ||
	    l->d != hp->head_dim || l->d_rope != 0 || l->n_pages < 1 || l->slot_bytes == 0)
		return fail(ret_err, -EINVAL, "the layout does not match the model and the %s "
					      "configuration", o->cfg->name);
	if (o->pages && ((uintptr_t)o->pages % DEV_ALIGN) != 0)
		return fail(ret_err, -EINVAL, "the page arena is not 256-byte aligned");
	if (o->slots && ((uintptr_t)o->slots % 16) != 0)
		return fail(ret_err, -EINVAL, "the slots are not 16-byte aligned");
	if (hp->head_dim != 64 && hp->head_dim != 128)
		return fail(ret_err, -ENOTSUP, "head dim %d: the kernels take 64 or 128",
			    hp->head_dim);
	return 0;
}

static int build(struct bd_gmodel *g, const struct bd_gmodel_opts *o, char *ret_err)
{
	int r = 0, ndev = 0;

	cudaError_t e = cudaGetDeviceCount(&ndev);
	if (e != cudaSuccess || ndev < 1)
		return fail(ret_err, -ENODEV, "no CUDA device (%s)",
			    e != cudaSuccess ? cudaGetErrorString(e) : "none found");
	if (o->device < 0 || o->device >= ndev)
		return fail(ret_err, -ENODEV, "CUDA device %d of %d does not exist", o->device,
			    ndev);
	CU(cudaSetDevice(o->device));
	/* non-blocking: the caller's legacy-stream work never joins a step or its capture;
	 * setup orders its own copies with the stream and synchronizes the device at the end */
	CU(cudaStreamCreateWithFlags(&g->st, cudaStreamNonBlocking));
	CU(cudaEventCreate(&g->ev0));
	CU(cudaEventCreate(&g->ev1));

	/* buckets and their decode plans */
	int top = 1;
	while (top < g->max_batch)
		top *= 2;
	for (int b = 1; b <= top && g->n_buckets < MAX_BUCKETS; b *= 2)
		g->bk[g->n_buckets++].B = b < g->max_batch ? b : g->max_batch;
	size_t md = 0;
	int bt_stride = 0, max_pad = 0;
	for (int i = 0; i < g->n_buckets; i++) {
		struct bucket *bk = &g->bk[i];
		int pr = bd_decode_plan_init(&bk->plan, g->cfg, &g->lay, &g->dp, bk->B, g->HqL,
					     g->max_tokens, 0);
		if (pr == -EOPNOTSUPP) {
			r = fail(ret_err, -ENOTSUP,
				 "the decode kernels do not implement %s with G = %d, d = %d",
				 g->cfg->name, g->HqL / g->lay.n_kv_heads, g->d);
			goto out;
		}
		if (pr < 0) {
			r = fail(ret_err, pr == -EINVAL ? -EINVAL : pr, "decode plan for B = %d (%d)",
				 bk->B, pr);
			goto out;
		}
		bt_stride = bk->plan.bt_stride > bt_stride ? bk->plan.bt_stride : bt_stride;
		int prev = i ? g->bk[i - 1].B : 0;
		max_pad = bk->B - prev - 1 > max_pad ? bk->B - prev - 1 : max_pad;
	}
	for (int i = 0; i < g->n_buckets; i++) {
		struct bucket *bk = &g->bk[i];
		bk->plan.bt_stride = bt_stride;
		bk->ml = md_layout_of(bk->B, bt_stride);
		bk->off = md;
		md += bk->ml.bytes;
	}
	int Bmax = g->bk[g->n_buckets - 1].B;
	if ((r = dev_alloc(&g->md_dev, md, ret_err)) < 0)
		goto out;
	for (int i = 0; i < g->n_buckets; i++) {
		struct bucket *bk = &g->bk[i];
		if ((r = dev_alloc(&bk->ws, bk->plan.ws_bytes, ret_err)) < 0)
			goto out;
		CU(cudaMemset(bk->ws, 0, bk->plan.ws_bytes ? bk->plan.ws_bytes : DEV_ALIGN));
		OP(bd_decode_workspace_init(&bk->plan, bk->ws, g->st));
	}
	/* mapped: the step's first kernel reads the packed header and patches from here */
	CU(cudaHostAlloc(&g->md_host, g->bk[g->n_buckets - 1].ml.host_bytes,
			 cudaHostAllocMapped));
	CU(cudaHostGetDevicePointer(&g->md_hdev, g->md_host, 0));
	if (((uintptr_t)g->md_hdev % 16) != 0) {
		r = fail(ret_err, -EIO, "mapped metadata buffer not 16-byte aligned");
		goto out;
	}
	g->bt_stride = bt_stride;
	if ((r = dev_alloc((void **)&g->bt_slots,
			   g->n_slots * (size_t)bt_stride * sizeof(int32_t), ret_err)) < 0)
		goto out;
	g->bt_mirror = calloc(g->n_slots * (size_t)bt_stride, sizeof(int32_t));
	g->bt_len = calloc(g->n_slots, sizeof(int));
	if (!g->bt_mirror || !g->bt_len) {
		r = fail(ret_err, -ENOMEM, "out of memory");
		goto out;
	}
	g->res_n = RES_FLAGS + 2 * Bmax;
	if ((r = dev_alloc((void **)&g->res_dev, sizeof(int) * (size_t)g->res_n, ret_err)) < 0)
		goto out;
	CU(cudaMallocHost((void **)&g->res_host, sizeof(int) * (size_t)g->res_n));

	/* arena: the caller's or our own */
	g->n_dummy = (max_pad + BD_RECENT_TOKENS - 1) / BD_RECENT_TOKENS;
	if (!g->pages) {
		if ((r = dev_alloc(&g->pages, g->lay.arena_bytes, ret_err)) < 0)
			goto out;
		g->own_pages = true;
		CU(cudaMemset(g->pages, 0, g->lay.arena_bytes));
	}
	if (!g->slots) {
		if ((r = dev_alloc(&g->slots, g->lay.slot_bytes * g->n_slots, ret_err)) < 0)
			goto out;
		g->own_slots = true;
		CU(cudaMemset(g->slots, 0, g->lay.slot_bytes * g->n_slots));
	}
	if (g->n_dummy > 0) {
		if ((r = dev_alloc(&g->dummy, g->lay.slot_bytes * (size_t)g->n_dummy, ret_err)) < 0)
			goto out;
		CU(cudaMemset(g->dummy, 0, g->lay.slot_bytes * (size_t)g->n_dummy));
	}

	/* activations */
	int R = Bmax > g->max_prefill ? Bmax : g->max_prefill;
	R = R > BD_PAGE_TOKENS ? R : BD_PAGE_TOKENS;
	g->R = R;
	size_t Rz = (size_t)R, E = (size_t)g->E, dts = g->dts;
	size_t qw = (size_t)(g->qdL > g->qd ? g->qdL : g->qd);
	size_t pl = (size_t)g->L * (size_t)g->max_prefill * (size_t)g->kd * 4;
	size_t cl = (size_t)g->max_tokens * (size_t)g->kd * 4;
	int ni = g->max_tokens > BD_PAGE_TOKENS ? g->max_tokens : BD_PAGE_TOKENS;
	size_t lg = (size_t)(Bmax > 1 ? Bmax : 1) * (size_t)g->V * 4;
	if ((r = dev_alloc((void **)&g->x, Rz * E * 4, ret_err)) < 0 ||
	    (r = dev_alloc(&g->xn, Rz * E * 4, ret_err)) < 0 ||
	    (r = dev_alloc((void **)&g->qkv, Rz * (size_t)g->Wqkv * 4, ret_err)) < 0 ||
	    (r = dev_alloc((void **)&g->q, Rz * qw * 4, ret_err)) < 0 ||
	    (r = dev_alloc((void **)&g->k, Rz * (size_t)g->kd * 4, ret_err)) < 0 ||
	    (r = dev_alloc((void **)&g->v, Rz * (size_t)g->kd * 4, ret_err)) < 0 ||
	    (r = dev_alloc((void **)&g->att, Rz * qw * 4, ret_err)) < 0 ||
	    (r = dev_alloc(&g->attb, Rz * qw * dts, ret_err)) < 0 ||
	    (r = dev_alloc((void **)&g->tmp, Rz * E * 4, ret_err)) < 0 ||
	    (r = dev_alloc((void **)&g->gu, Rz * 2 * (size_t)g->F * 4, ret_err)) < 0 ||
	    (r = dev_alloc(&g->act, Rz * (size_t)g->F * dts, ret_err)) < 0 ||
	    (r = dev_alloc((void **)&g->logits, lg, ret_err)) < 0 ||
	    (r = dev_alloc((void **)&g->kall, pl, ret_err)) < 0 ||
	    (r = dev_alloc((void **)&g->vall, pl, ret_err)) < 0 ||
	    (r = dev_alloc((void **)&g->kctx, cl, ret_err)) < 0 ||
	    (r = dev_alloc((void **)&g->vctx, cl, ret_err)) < 0 ||
	    (r = dev_alloc((void **)&g->iota, (size_t)ni * 4, ret_err)) < 0 ||
	    (r = dev_alloc(&g->sample_ws, bd_op_sample_ws_bytes(Bmax, g->V), ret_err)) < 0 ||
	    (r = dev_alloc((void **)&g->top_ids, (size_t)Bmax * MAX_TOP_K * 4, ret_err)) < 0 ||
	    (r = dev_alloc((void **)&g->top_vals, (size_t)Bmax * MAX_TOP_K * 4, ret_err)) < 0 ||
	    (r = dev_alloc((void **)&g->lp_dev, (size_t)Bmax * 4, ret_err)) < 0 ||
	    (r = dev_alloc((void **)&g->lp_ids, (size_t)Bmax * MAX_TOP_K * 4, ret_err)) < 0 ||
	    (r = dev_alloc((void **)&g->lp_vals, (size_t)Bmax * MAX_TOP_K * 4, ret_err)) < 0)
		goto out;
	CU(cudaHostAlloc((void **)&g->lp_rows, (size_t)Bmax * 4, cudaHostAllocMapped));
	CU(cudaHostGetDevicePointer((void **)&g->lp_rows_dev, g->lp_rows, 0));
	/* padded query heads (a shard in a wider layout) must hold finite values */
	CU(cudaMemset(g->q, 0, Rz * qw * 4));
	/* the products; a timed β = 1 candidate writes g->tmp instead of x. Skinny shapes are
	 * timed without TP only (each rank would pick its own algorithms) */
	struct bd_gemm_opts go = {
		.dt = g->dt,
		.stream = g->st,
		.skinny_tuning = !g->comm,
		.scratch = g->tmp,
		.scratch_floats = Rz * E,
	};
	if ((r = bd_gemm_new(&go, &g->gemm, ret_err)) < 0)
		goto out;
	{
		int32_t *h = malloc((size_t)ni * 4);
		if (!h) {
			r = fail(ret_err, -ENOMEM, "out of memory");
			goto out;
		}
		for (int i = 0; i < ni; i++)
			h[i] = i;
		e = cudaMemcpy(g->iota, h, (size_t)ni * 4, cudaMemcpyHostToDevice);
		free(h);
		CU(e);
	}

	/* prefill / fill region */
	g->n_pp = g->max_tokens / BD_PAGE_TOKENS + 1;
	g->pf_tokens = 0;
	g->pf_slots = align_up((size_t)g->max_prefill * 4, 16);
	g->pf_pages = align_up(g->pf_slots + BD_PAGE_TOKENS * 8, 16);
	g->pf_samp = align_up(g->pf_pages + (size_t)g->n_pp * 4, 16);
	g->pf_bt = align_up(g->pf_samp + sizeof(struct bd_gsample), 16);
	g->pf_bytes = align_up(g->pf_bt + (size_t)g->n_pp * 4, DEV_ALIGN);
	if ((r = dev_alloc(&g->pf_dev, g->pf_bytes, ret_err)) < 0 ||
	    (r = dev_alloc((void **)&g->pst_dev, (size_t)g->n_pp * 4, ret_err)) < 0)
		goto out;
	CU(cudaMallocHost(&g->pf_host, g->pf_bytes));
	CU(cudaMallocHost((void **)&g->pst_host, (size_t)g->n_pp * 4));
	g->seen = calloc(g->n_slots, 1);
	if (!g->seen) {
		r = fail(ret_err, -ENOMEM, "out of memory");
		goto out;
	}

	/* weights */
	size_t wb = lay_weights(g, NULL);
	if ((r = dev_alloc(&g->wmem, wb, ret_err)) < 0)
		goto out;
	lay_weights(g, g->wmem);
	if (g->dt == BD_DT_BF16 &&
	    (r = dev_alloc((void **)&g->stage, STAGE_FLOATS * 4, ret_err)) < 0)
		goto out;
	CU(cudaDeviceSynchronize());
out:
	return r;
}

void bd_gmodel_free(struct bd_gmodel *g)
{
	if (!g)
		return;
	if (g->st) {
		cudaSetDevice(g->device);
		cudaStreamSynchronize(g->st);
	}
	for (int i = 0; i < g->n_buckets; i++) {
		if (g->bk[i].exec)
			cudaGraphExecDestroy(g->bk[i].exec);
		dev_free(g->bk[i].ws);
	}
	bd_gemm_free(g->gemm);
	void *bufs[] = { g->wmem, g->dummy, g->x, g->xn, g->qkv, g->q, g->k, g->v,
			 g->att, g->attb, g->tmp, g->gu, g->act, g->logits, g->kall, g->vall,
			 g->kctx, g->vctx,
			 g->iota, g->sample_ws, g->top_ids, g->top_vals, g->lp_dev, g->lp_ids,
			 g->lp_vals, g->stage, g->md_dev,
			 g->res_dev, g->pf_dev, g->pst_dev, g->bt_slots };
	for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
		dev_free(bufs[i]);
	if (g->ly)
		for (int l = 0; l < g->L; l++)
			dev_free(g->ly[l].mu);
	if (g->own_pages)
		dev_free(g->pages);
	if (g->own_slots)
		dev_free(g->slots);
	void *pinned[] = { g->md_host, g->res_host, g->pf_host, g->pst_host, g->lp_rows };
	for (size_t i = 0; i < sizeof(pinned) / sizeof(pinned[0]); i++)
		if (pinned[i])
			cudaFreeHost(pinned[i]);
	cudaEvent_t evs[] = { g->ev0, g->ev1 };
	for (size_t i = 0; i < sizeof(evs) / sizeof(evs[0]); i++)
		if (evs[i])
			cudaEventDestroy(evs[i]);
	if (g->st)
		cudaStreamDestroy(g->st);
	void *host[] = { g->ly, g->seen, g->bt_mirror, g->bt_len, g };
	for (size_t i = 0; i < sizeof(host) / sizeof(host[0]); i++)
		free(host[i]);
}

/* The common part of both constructors: shapes, opts, device state, the weight block. */
static int gmodel_make(const struct bd_model_hparams *hp, const struct bd_model_shard *sh,
		       const struct bd_gmodel_opts *o, struct bd_gmodel **ret, char *ret_err)
{
	int r;
	if ((r = check_opts(hp, sh, o, ret_err)) < 0)
		return r;
	struct bd_gmodel *g = calloc(1, sizeof(*g));
	if (!g)
		return fail(ret_err, -ENOMEM, "out of memory");
	g->hp = *hp;
	g->sh = *sh;
	g->cfg = o->cfg;
	g->lay = o->lay;
	g->dp = o->dp ? *o->dp : bd_decode_params_default();
	g->dp.tile_keys = BD_KERNEL_TILE_KEYS; /* the kernels' B_k */
	g->dt = o->weights == BD_GWEIGHTS_F32 ? BD_DT_F32 : BD_DT_BF16;
	g->dts = g->dt == BD_DT_F32 ? 4 : 2;
	g->device = o->device;
	g->max_batch = o->max_batch;
	g->max_tokens = o->max_tokens;
	g->max_prefill = o->max_prefill;
	g->use_graphs = o->use_graphs;
	g->timeout_ms = o->ar_timeout_ms > 0 ? o->ar_timeout_ms : 30000;
	g->n_slots = o->n_slots;
	g->pages = o->pages;
	g->slots = o->slots;
	g->comm = sh->tp > 1 ? (ncclComm_t)o->nccl_comm : NULL;
	g->E = hp->n_embd;
	g->d = hp->head_dim;
	g->Hq = sh->n_heads;
	g->Hkv = sh->n_kv_heads;
	g->HqL = (hp->n_heads / hp->n_kv_heads) * o->lay.n_kv_heads;
	g->F = sh->n_ff;
	g->V = hp->n_vocab;
	g->L = hp->n_layers;
	g->qd = g->Hq * g->d;
	g->kd = g->Hkv * g->d;
	g->qdL = g->HqL * g->d;
	g->Wqkv = g->qd + 2 * g->kd;
	g->ly = calloc((size_t)g->L, sizeof(*g->ly));
	if (!g->ly) {
		bd_gmodel_free(g);
		return fail(ret_err, -ENOMEM, "out of memory");
	}
	if ((r = build(g, o, ret_err)) < 0) {
		bd_gmodel_free(g);
		return r;
	}
	/* μ_k of this shard's KV heads, FP32 per layer */
	if (o->mu_k) {
		size_t dd = (size_t)g->d, H = (size_t)g->Hkv, Hg = (size_t)hp->n_kv_heads;
		size_t h0 = (size_t)sh->kv_head0;
		for (int l = 0; l < g->L && r == 0; l++) {
			if ((r = dev_alloc((void **)&g->ly[l].mu, H * dd * 4, ret_err)) == 0)
				r = put_vec(g, g->ly[l].mu, o->mu_k + ((size_t)l * Hg + h0) * dd, H * dd,
					    ret_err);
		}
		if (r < 0) {
			bd_gmodel_free(g);
			return r;
		}
	}
	*ret = g;
	return 0;
}

int bd_gmodel_new(const struct bd_model *m, const struct bd_gmodel_opts *opts,
		  struct bd_gmodel **ret, char *ret_err)
{
	struct bd_gmodel *g;
	int r;

	clear_err(ret_err);
	if (!m || !opts || !ret)
		return fail(ret_err, -EINVAL, "missing model, options or result pointer");
	if (m->shard.lm_head && !m->output.f32 && !m->output.blocks)
		return fail(ret_err, -EINVAL, "the model has no LM head");
	if ((r = gmodel_make(&m->hp, &m->shard, opts, &g, ret_err)) < 0)
		return r;
	if ((r = upload(g, m, ret_err)) < 0 ||
	    (r = fail(ret_err, bd_cuda_errno(cudaDeviceSynchronize()), "upload")) < 0) {
		bd_gmodel_free(g);
		return r;
	}
	clear_err(ret_err);
	*ret = g;
	return 0;
}

int bd_gmodel_new_random(const struct bd_model_hparams *hp, const struct bd_model_shard *sh,
			 uint64_t seed, const struct bd_gmodel_opts *opts, struct bd_gmodel **ret,
			 char *ret_err)
{
	struct bd_model_shard whole;
	struct bd_gmodel *g;
	int r;

	clear_err(ret_err);
	if (!hp || !opts || !ret)
		return fail(ret_err, -EINVAL, "missing shape, options or result pointer");
	if (!sh) {
		if (bd_model_shard_plan(hp, 0, 1, &whole) < 0)
			return fail(ret_err, -EINVAL, "model hyperparameters out of range");
		sh = &whole;
	}
	if ((r = gmodel_make(hp, sh, opts, &g, ret_err)) < 0)
		return r;
	if ((r = randomize(g, seed, ret_err)) < 0) {
		bd_gmodel_free(g);
		return r;
	}
	*ret = g;
	return 0;
}

/* ---- accessors ----------------------------------------------------------------------------- */

const struct bd_model_hparams *bd_gmodel_hparams(const struct bd_gmodel *g)
{
	return g ? &g->hp : NULL;
}

const struct bd_model_shard *bd_gmodel_shard(const struct bd_gmodel *g)
{
	return g ? &g->sh : NULL;
}

void *bd_gmodel_pages(const struct bd_gmodel *g)
{
	return g ? g->pages : NULL;
}

void *bd_gmodel_slots(const struct bd_gmodel *g)
{
	return g ? g->slots : NULL;
}

void bd_gmodel_last_timing(const struct bd_gmodel *g, struct bd_gmodel_timing *ret)
{
	if (!ret)
		return;
	if (!g) {
		memset(ret, 0, sizeof(*ret));
		return;
	}
	*ret = g->tm;
}

void *bd_gmodel_comm(const struct bd_gmodel *g)
{
	return g ? (void *)g->comm : NULL;
}

void *bd_gmodel_stream(const struct bd_gmodel *g)
{
	return g ? (void *)g->st : NULL;
}

int bd_gmodel_set_comm(struct bd_gmodel *g, void *nccl_comm)
{
	if (!g)
		return -EINVAL;
	if (g->sh.tp > 1 && !nccl_comm) {
		/* detach before the caller aborts the communicator: graphs that captured its
		 * collectives hold NCCL resources an abort would wait for */
		if (g->st)
			cudaStreamSynchronize(g->st);
		drop_graphs(g);
		g->comm = NULL;
		if (!g->failed)
			g->failed = -EPIPE;
		g->comm_failed = true;
		return 0;
	}
	if (g->failed) {
		if (!g->comm_failed || cudaStreamQuery(g->st) != cudaSuccess)
			return -EIO;
		g->failed = 0;
		g->comm_failed = false;
	}
	if (g->sh.tp > 1) {
		g->comm = (ncclComm_t)nccl_comm;
		drop_graphs(g); /* they captured the old communicator */
	}
	return 0;
}

/* ---- the forward pass -------------------------------------------------------------------- */

static int all_reduce(struct bd_gmodel *g, float *buf, size_t n, char *ret_err)
{
	if (!g->comm)
		return 0;
	ncclResult_t q = ncclAllReduce(buf, buf, n, ncclFloat, ncclSum, g->comm, g->st);
	/* A non-blocking communicator (workerd joins with config.blocking = 0, so that a rank
	 * that never comes cannot hang the other) may answer ncclInProgress while it enqueues:
	 * the next call on it must wait until its async state leaves ncclInProgress. */
	if (q == ncclInProgress) {
		double deadline = now_us() + (double)g->timeout_ms * 1e3;
		ncclResult_t a = ncclInProgress;
		while (a == ncclInProgress) {
			if ((q = ncclCommGetAsyncError(g->comm, &a)) != ncclSuccess)
				break;
			if (a == ncclInProgress) {
				if (now_us() > deadline) {
					q = ncclInProgress;
					break;
				}
				sched_yield();
			}
		}
		if (q == ncclSuccess)
			q = a;
	}
	if (q != ncclSuccess)
		return fail(ret_err, -EPIPE, "ncclAllReduce: %s", ncclGetErrorString(q));
	return 0;
}

/* x += W a for n rows (a [n][ld], K = in columns): without TP the GEMM adds x in its
 * epilogue (β = 1), else the partial product is all-reduced and added. */
static int residual_gemm(struct bd_gmodel *g, const void *w, int in, const void *a, int ld,
			 int n, char *ret_err)
{
	int r = 0, E = g->E;
	size_t nE = (size_t)n * (size_t)E;
	if (!g->comm)
		return bd_gemm_run(g->gemm, w, E, in, a, ld, n, g->x, 1.0f, ret_err);
	if ((r = bd_gemm_run(g->gemm, w, E, in, a, ld, n, g->tmp, 0.0f, ret_err)) < 0)
		goto out;
	if ((r = all_reduce(g, g->tmp, nE, ret_err)) < 0)
		goto out;
	OP(bd_op_add(g->x, g->tmp, nE, g->st));
out:
	return r;
}

/* x += W_down(silu(W_gate xn) · W_up xn) for n rows (xn of ffn_norm made here). */
static int mlp(struct bd_gmodel *g, const struct glayer *y, int n, char *ret_err)
{
	int r = 0, E = g->E, F = g->F;
	OP(bd_op_rmsnorm(g->x, y->ffn_norm, BD_DT_F32, n, E, g->hp.norm_eps, g->xn, g->dt, g->st));
	if ((r = bd_gemm_run(g->gemm, y->wgu, 2 * F, E, g->xn, E, n, g->gu, 0.0f, ret_err)) <
	    0)
		goto out;
	OP(bd_op_swiglu(g->gu, n, F, g->act, g->dt, g->st));
	r = residual_gemm(g, y->wdown, F, g->act, F, n, ret_err);
out:
	return r;
}

/* Attention output att [n][ld] → x += W_o att (+ all-reduce). */
static int attn_out(struct bd_gmodel *g, const struct glayer *y, int n, int ld, char *ret_err)
{
	int r = 0;
	const void *a = g->att;
	if (g->dt == BD_DT_BF16) {
		OP(bd_op_cast(g->att, g->attb, BD_DT_BF16, (size_t)n * (size_t)ld, g->st));
		a = g->attb;
	}
	r = residual_gemm(g, y->wo, g->qd, a, ld, n, ret_err);
out:
	return r;
}

/* Norm, fused q/k/v product, biases, split into q [n][ldq], k, v [n][kd]. */
static int qkv_proj(struct bd_gmodel *g, const struct glayer *y, int n, float *q, int ldq,
		    float *k, float *v, char *ret_err)
{
	int r = 0, E = g->E;
	size_t W = (size_t)g->Wqkv * 4, qb = (size_t)g->qd * 4, kb = (size_t)g->kd * 4;
	OP(bd_op_rmsnorm(g->x, y->attn_norm, BD_DT_F32, n, E, g->hp.norm_eps, g->xn, g->dt,
			 g->st));
	if ((r = bd_gemm_run(g->gemm, y->wqkv, g->Wqkv, E, g->xn, E, n, g->qkv, 0.0f,
			     ret_err)) < 0)
		goto out;
	if (y->bqkv)
		OP(bd_op_bias_add(g->qkv, y->bqkv, BD_DT_F32, n, g->Wqkv, g->st));
	CU(cudaMemcpy2DAsync(q, (size_t)ldq * 4, g->qkv, W, qb, (size_t)n,
			     cudaMemcpyDeviceToDevice, g->st));
	CU(cudaMemcpy2DAsync(k, kb, (uint8_t *)g->qkv + qb, W, kb, (size_t)n,
			     cudaMemcpyDeviceToDevice, g->st));
	CU(cudaMemcpy2DAsync(v, kb, (uint8_t *)g->qkv + qb + kb, W, kb, (size_t)n,
			     cudaMemcpyDeviceToDevice, g->st));
out:
	return r;
}

/* Qwen3 per-head norms and RoPE of q [n][Hq_][d] and k [n][Hkv'][d] at positions pos. */
static int qk_rope(struct bd_gmodel *g, const struct glayer *y, int n, float *q, int Hq_,
		   float *k, const int32_t *pos, char *ret_err)
{
	int r = 0, d = g->d;
	if (g->hp.qk_norm) {
		OP(bd_op_head_rmsnorm(q, y->q_norm, BD_DT_F32, n, Hq_, d, g->hp.norm_eps, g->st));
		OP(bd_op_head_rmsnorm(k, y->k_norm, BD_DT_F32, n, g->Hkv, d, g->hp.norm_eps,
				      g->st));
	}
	OP(bd_op_rope(q, n, Hq_, d, g->hp.n_rot, pos, g->hp.rope_base,
		      g->hp.rope_style == BD_ROPE_NEOX,
		      g->st));
	OP(bd_op_rope(k, n, g->Hkv, d, g->hp.n_rot, pos, g->hp.rope_base,
		      g->hp.rope_style == BD_ROPE_NEOX,
		      g->st));
out:
	return r;
}

/* Final norm and LM head of n rows starting at row r0 of x: logits [n][V]. */
static int lm_head(struct bd_gmodel *g, int r0, int n, char *ret_err)
{
	int r = 0, E = g->E;
	OP(bd_op_rmsnorm(g->x + (size_t)r0 * (size_t)E, g->out_norm, BD_DT_F32, n, E,
			 g->hp.norm_eps, g->xn, g->dt, g->st));
	r = bd_gemm_run(g->gemm, g->out_w, g->V, E, g->xn, E, n, g->logits, 0.0f, ret_err);
out:
	return r;
}

/* Norm, fused q/k/v product, then one kernel for biases, q/k norms, RoPE (q into g->q with
 * rows of qdL) and the KV write of layer l (the decode-step form of qkv_proj, qk_rope and
 * bd_op_kv_write; padded query heads of a shard keep their old, finite values). */
static int qkv_decode(struct bd_gmodel *g, const struct glayer *y, int l, int n,
		      const int32_t *pos, void *const *slots, char *ret_err)
{
	int r = 0, E = g->E;
	OP(bd_op_rmsnorm(g->x, y->attn_norm, BD_DT_F32, n, E, g->hp.norm_eps, g->xn, g->dt,
			 g->st));
	if ((r = bd_gemm_run(g->gemm, y->wqkv, g->Wqkv, E, g->xn, E, n, g->qkv, 0.0f,
			     ret_err)) < 0)
		goto out;
	struct bd_gaux_qkv a = {
		.qkv = g->qkv,
		.bias = y->bqkv,
		.q_norm = g->hp.qk_norm ? y->q_norm : NULL,
		.k_norm = g->hp.qk_norm ? y->k_norm : NULL,
		.mu = y->mu,
		.pos = pos,
		.q = g->q,
		.slots = slots,
		.n = n,
		.Hq = g->Hq,
		.Hkv = g->Hkv,
		.d = g->d,
		.ld_qkv = g->Wqkv,
		.ld_q = g->qdL,
		.n_rot = g->hp.n_rot,
		.rope_style = (int)g->hp.rope_style,
		.layer = l,
		.rope_base = g->hp.rope_base,
		.eps = g->hp.norm_eps,
	};
	OP(bd_gaux_qkv_decode(&a, &g->lay, g->cfg, g->st));
out:
	return r;
}

/* Everything of one decode step of bucket bk that a graph holds. */
static int enqueue_decode(struct bd_gmodel *g, const struct bucket *bk, char *ret_err)
{
	const struct md_layout *ml = &bk->ml;
	uint8_t *md = (uint8_t *)g->md_dev + bk->off;
	const uint8_t *mh = g->md_hdev;
	const int32_t *tokens = (const int32_t *)(md + ml->tokens);
	const int32_t *pos = (const int32_t *)(md + ml->pos);
	const int32_t *lens = (const int32_t *)(md + ml->lens);
	int32_t *bt = (int32_t *)(md + ml->bt);
	void *const *slots = (void *const *)(md + ml->slots);
	const struct bd_gsample *samp = (const struct bd_gsample *)(md + ml->samp);
	int r = 0, B = bk->B;
	size_t BE = (size_t)B * (size_t)g->E;

	CU(cudaMemsetAsync(g->res_dev, 0, sizeof(int) * (size_t)g->res_n, g->st));
	OP(bd_gaux_step_stage(mh, md, ml->hdr, (const int32_t *)(mh + ml->spans),
			      (const int32_t *)(mh + ml->vals), g->bt_slots, bt, g->bt_stride, B,
			      g->st));
	OP(bd_op_embed(g->embd, g->dt, g->V, g->E, tokens, B, g->x, g->res_dev + RES_EMBED,
		       g->st));
	for (int l = 0; l < g->L; l++) {
		const struct glayer *y = &g->ly[l];
		if ((r = qkv_decode(g, y, l, B, pos, slots, ret_err)) < 0)
			goto out;
		struct bd_decode_args a = {
			.q = g->q,
			.arena = g->pages,
			.layer = l,
			.block_table = bt,
			.bt_stride = bk->plan.bt_stride,
			.seq_lens = lens,
			.slots = slots,
			.out = g->att,
			.lse = NULL,
			.workspace = bk->ws,
			.status = g->res_dev + RES_KSTATUS,
		};
		OP(bd_decode_run(&bk->plan, &a, g->st));
		if ((r = attn_out(g, y, B, g->qdL, ret_err)) < 0 || (r = mlp(g, y, B, ret_err)) < 0)
			goto out;
	}
	OP(bd_op_check_finite(g->x, BE, g->res_dev + RES_FINITE, g->st));
	if (g->sh.lm_head) {
		if ((r = lm_head(g, 0, B, ret_err)) < 0)
			goto out;
		OP(bd_op_sample(g->logits, B, g->V, samp, g->res_dev + RES_FLAGS, g->sample_ws,
				g->st));
	}
out:
	return r;
}

/* ---- validation ------------------------------------------------------------------------------ */

/* The start of every call on a model: ret_err cleared; -EINVAL when g is NULL or args_ok is
 * false ("missing <what>"), -EIO when the model failed before. */
static int call_start(const struct bd_gmodel *g, bool args_ok, const char *what, char *ret_err)
{
	clear_err(ret_err);
	if (!g || !args_ok)
		return fail(ret_err, -EINVAL, "missing %s", what);
	if (g->failed)
		return fail(ret_err, -EIO, "the model failed before (%d)", g->failed);
	return 0;
}

static int check_sampling(const struct bd_sampler_params *p)
{
	return isfinite(p->temperature) && p->temperature >= 0.0f && p->top_k >= 0 &&
	       p->top_p > 0.0f && p->top_p <= 1.0f;
}

static int check_out(const struct bd_gmodel *g, const struct bd_gout *out, char *ret_err)
{
	if (!out)
		return 0;
	if (!g->sh.lm_head)
		return fail(ret_err, -EINVAL, "rank %d holds no LM head: out must be NULL",
			    g->sh.rank);
	if (out->top_k < 0 || out->top_k > MAX_TOP_K)
		return fail(ret_err, -EINVAL, "top_k %d outside 0..%d", out->top_k, MAX_TOP_K);
	if (out->want_lp && (!out->lp || out->lp_k < 0 || out->lp_k > MAX_TOP_K ||
			     out->lp_k > g->V || (out->lp_k > 0 && (!out->lp_ids || !out->lp_vals))))
		return fail(ret_err, -EINVAL, "log-probabilities: lp_k %d outside 0..%d, or a "
					      "missing output array", out->lp_k,
			    g->V < MAX_TOP_K ? g->V : MAX_TOP_K);
	return 0;
}

static int check_pages(const struct bd_gmodel *g, const int32_t *p, int n)
{
	for (int i = 0; i < n; i++)
		if (p[i] < 0 || (size_t)p[i] >= g->lay.n_pages)
			return -1;
	return 0;
}

/* A row that starts a sequence (prefill, synthetic fill) of n tokens. */
static int check_start_row(const struct bd_gmodel *g, const struct bd_grow *row, int n,
			   char *ret_err)
{
	if (row->slot < 0 || (size_t)row->slot >= g->n_slots)
		return fail(ret_err, -EINVAL, "slot %d outside 0..%zu", row->slot, g->n_slots - 1);
	if (row->position != 0 || row->n_pages != 0)
		return fail(ret_err, -EINVAL, "a new sequence starts at position 0 with no pages "
					      "(got %d, %d pages)", row->position, row->n_pages);
	if (n < 1 || n > g->max_tokens)
		return fail(ret_err, -EINVAL, "%d tokens: outside 1..%d", n, g->max_tokens);
	if (row->n_new != n / BD_PAGE_TOKENS || (row->n_new > 0 && !row->new_pages))
		return fail(ret_err, -EINVAL, "%d tokens fill %d pages; %d new pages given", n,
			    n / BD_PAGE_TOKENS, row->n_new);
	if (check_pages(g, row->new_pages, row->n_new) < 0)
		return fail(ret_err, -EINVAL, "a new page outside 0..%zu", g->lay.n_pages - 1);
	return 0;
}

/* A prefill chunk of n tokens at row->position = p > 0 on top of the p tokens the cache holds
 * (whole pages: p/128 of them in the block table). -EINVAL or -ENOSPC, nothing launched. */
static int check_chunk_row(const struct bd_gmodel *g, const struct bd_grow *row, int n,
			   char *ret_err)
{
	int p = row->position;
	if (row->slot < 0 || (size_t)row->slot >= g->n_slots)
		return fail(ret_err, -EINVAL, "slot %d outside 0..%zu", row->slot, g->n_slots - 1);
	if (p % BD_PAGE_TOKENS != 0 || row->n_pages != p / BD_PAGE_TOKENS ||
	    !row->block_table)
		return fail(ret_err, -EINVAL, "a chunk at position %d starts on a page and names "
					      "its %d promoted pages (got %d)", p,
			    p / BD_PAGE_TOKENS, row->n_pages);
	if (n < 1)
		return fail(ret_err, -EINVAL, "a chunk of %d tokens", n);
	if (n > g->max_tokens - p)
		return fail(ret_err, -ENOSPC, "a chunk of %d tokens at position %d: the model "
					      "holds %d tokens (max_tokens)", n, p, g->max_tokens);
	if (row->n_new != n / BD_PAGE_TOKENS || (row->n_new > 0 && !row->new_pages))
		return fail(ret_err, -EINVAL, "%d tokens at %d fill %d pages; %d new pages given", n,
			    p, n / BD_PAGE_TOKENS, row->n_new);
	if (check_pages(g, row->block_table, row->n_pages) < 0 ||
	    check_pages(g, row->new_pages, row->n_new) < 0)
		return fail(ret_err, -EINVAL, "a page outside 0..%zu", g->lay.n_pages - 1);
	return 0;
}

/* ---- prefill and synthetic fill --------------------------------------------------------- */

/* The device sampling parameters of row w: its own when they are valid, else greedy, as for a
 * padding row (w NULL); the callers refuse invalid ones where the sampled token is wanted. */
static struct bd_gsample gsample_of(const struct bd_grow *w)
{
	struct bd_gsample s = { .temperature = 0.0f, .top_k = 0, .top_p = 1.0f };
	if (w && check_sampling(&w->sampling)) {
		s.temperature = w->sampling.temperature;
		s.top_k = w->sampling.top_k;
		s.top_p = w->sampling.top_p;
		s.seed = w->sampling.seed;
		s.step = w->rng_step;
	}
	return s;
}

static void *slot_ptr(const struct bd_gmodel *g, int slot)
{
	return (uint8_t *)g->slots + (size_t)slot * g->lay.slot_bytes;
}

/* Upload the prefill region: tokens, 128 copies of the slot pointer, the new pages, the
 * sampling parameters, the block table (a chunk's). */
static int pf_upload(struct bd_gmodel *g, const struct bd_grow *row, const int32_t *tokens,
		     int n, char *ret_err)
{
	int r = 0;
	uint8_t *h = g->pf_host;
	if (tokens)
		memcpy(h + g->pf_tokens, tokens, (size_t)n * 4);
	void *sp = slot_ptr(g, row->slot);
	for (int i = 0; i < BD_PAGE_TOKENS; i++)
		memcpy(h + g->pf_slots + (size_t)i * 8, &sp, 8);
	if (row->n_new > 0)
		memcpy(h + g->pf_pages, row->new_pages, (size_t)row->n_new * 4);
	struct bd_gsample s = gsample_of(row);
	memcpy(h + g->pf_samp, &s, sizeof(s));
	if (row->n_pages > 0)
		memcpy(h + g->pf_bt, row->block_table, (size_t)row->n_pages * 4);
	CU(cudaMemcpyAsync(g->pf_dev, g->pf_host, g->pf_bytes, cudaMemcpyHostToDevice, g->st));
	CU(cudaMemsetAsync(g->pst_dev, 0, (size_t)g->n_pp * 4, g->st));
out:
	return r;
}

/* Write tokens [p0, p0 + cnt) of every layer into the slot, their K/V from rows r0 .. of
 * kbase/vbase [L][stride rows][kd], or (kbase NULL) synthetic values made here. */
static int write_span(struct bd_gmodel *g, int p0, int cnt, int r0, const float *kbase,
		      const float *vbase, size_t stride, uint64_t seed, char *ret_err)
{
	int r = 0;
	void *const *sl = (void *const *)((uint8_t *)g->pf_dev + g->pf_slots);
	size_t kd = (size_t)g->kd;
	for (int l = 0; l < g->L; l++) {
		const float *k, *v;
		if (kbase) {
			k = kbase + ((size_t)l * stride + (size_t)r0) * kd;
			v = vbase + ((size_t)l * stride + (size_t)r0) * kd;
		} else {
			OP(bd_gaux_synth_kv(g->k, g->v, cnt, g->Hkv, g->d, l, p0, seed, g->st));
			k = g->k;
			v = g->v;
		}
		OP(bd_op_kv_write(&g->lay, g->cfg, l, sl, g->iota + p0, k, v, g->ly[l].mu, cnt,
				  g->Hkv, g->st));
	}
out:
	return r;
}

/* The cache of n tokens at positions p .. p+n−1 (p a multiple of 128; their K/V rows 0..n−1
 * of kbase/vbase) written page by page, each full page promoted into the next new page. */
static int write_cache(struct bd_gmodel *g, int p, int n, const float *kbase,
		       const float *vbase, size_t stride, char *ret_err)
{
	int r = 0;
	void *const *sl = (void *const *)((uint8_t *)g->pf_dev + g->pf_slots);
	const int32_t *pages = (const int32_t *)((uint8_t *)g->pf_dev + g->pf_pages);
	for (int r0 = 0; r0 < n; r0 += BD_PAGE_TOKENS) {
		int cnt = n - r0 < BD_PAGE_TOKENS ? n - r0 : BD_PAGE_TOKENS;
		if ((r = write_span(g, p + r0, cnt, r0, kbase, vbase, stride, 0, ret_err)) < 0)
			goto out;
		if (cnt == BD_PAGE_TOKENS) {
			int j = r0 / BD_PAGE_TOKENS;
			OP(bd_promote_run(&g->lay, g->cfg, g->pages, sl, pages + j, 1, g->pst_dev + j,
					  g->st));
		}
	}
out:
	return r;
}

#define FILL_GROUP 16 /* pages a synthetic fill writes and promotes per round */

/* Pages 0..J−1 of a synthetic fill (new pages from the prefill region): groups of up to
 * FILL_GROUP pages are written, all layers, into scratch slots laid out like slots (one
 * synthesis and one KV write per layer for the whole group), then promoted by one
 * bd_promote_run. Same values, same write and promotion code as the page-by-page path in
 * the request's slot, so the same page bytes; the slot itself is written by the caller. */
static int fill_pages(struct bd_gmodel *g, int J, uint64_t seed, char *ret_err)
{
	int r = 0, P = J < FILL_GROUP ? J : FILL_GROUP;
	size_t sb = g->lay.slot_bytes, kd = (size_t)g->kd, rows_max;
	uint8_t *blk = NULL;
	void **hp = NULL;
	size_t o_k, o_v, o_rs, o_ps, bytes;
	const int32_t *pages = (const int32_t *)((uint8_t *)g->pf_dev + g->pf_pages);

	for (;; P /= 2) {
		rows_max = (size_t)P * BD_PAGE_TOKENS;
		o_k = align_up((size_t)P * sb, DEV_ALIGN);
		o_v = align_up(o_k + rows_max * kd * 4, DEV_ALIGN);
		o_rs = align_up(o_v + rows_max * kd * 4, DEV_ALIGN);
		o_ps = align_up(o_rs + rows_max * 8, DEV_ALIGN);
		bytes = o_ps + (size_t)P * 8;
		if (cudaMalloc((void **)&blk, bytes) == cudaSuccess)
			break;
		(void)cudaGetLastError();
		blk = NULL;
		if (P == 1)
			return fail(ret_err, -ENOMEM, "no device memory for a fill page group");
	}
	void *const *rs = (void *const *)(blk + o_rs), *const *ps = (void *const *)(blk + o_ps);
	hp = malloc((rows_max + (size_t)P) * sizeof(void *));
	if (!hp) {
		r = fail(ret_err, -ENOMEM, "out of memory");
		goto out;
	}
	for (size_t i = 0; i < rows_max; i++)
		hp[i] = blk + (i / BD_PAGE_TOKENS) * sb;
	for (int i = 0; i < P; i++)
		hp[rows_max + (size_t)i] = blk + (size_t)i * sb;
	/* heads past the shard's in a wider layout are promoted too: keep them finite */
	CU(cudaMemsetAsync(blk, 0, (size_t)P * sb, g->st));
	CU(cudaMemcpyAsync(blk + o_rs, hp, rows_max * 8, cudaMemcpyHostToDevice, g->st));
	CU(cudaMemcpyAsync(blk + o_ps, hp + rows_max, (size_t)P * 8, cudaMemcpyHostToDevice,
			   g->st));
	float *kb = (float *)(blk + o_k), *vb = (float *)(blk + o_v);
	for (int j0 = 0; j0 < J; j0 += P) {
		int cnt = J - j0 < P ? J - j0 : P, rows = cnt * BD_PAGE_TOKENS;
		int p0 = j0 * BD_PAGE_TOKENS;
		for (int l = 0; l < g->L; l++) {
			OP(bd_gaux_synth_kv(kb, vb, rows, g->Hkv, g->d, l, p0, seed, g->st));
			OP(bd_op_kv_write(&g->lay, g->cfg, l, rs, g->iota + p0, kb, vb, g->ly[l].mu,
					  rows, g->Hkv, g->st));
		}
		OP(bd_promote_run(&g->lay, g->cfg, g->pages, ps, pages + j0, cnt, g->pst_dev + j0,
				  g->st));
	}
out:
	/* the scratch is in use until the stream drains */
	cudaStreamSynchronize(g->st);
	cudaFree(blk);
	free(hp);
	return r;
}

/* Wait, then read the promotion statuses of n_new pages. */
static int finish_pages(struct bd_gmodel *g, int n_new, char *ret_err)
{
	int r = 0;
	if (n_new > 0)
		CU(cudaMemcpyAsync(g->pst_host, g->pst_dev, (size_t)n_new * 4,
				   cudaMemcpyDeviceToHost, g->st));
	if ((r = wait_stream(g, ret_err)) < 0)
		return r;
	for (int j = 0; j < n_new; j++)
		if (g->pst_host[j] != 0)
			return fail(ret_err, g->pst_host[j] == -EDOM ? -EDOM : -EIO,
				    "promotion of page %d failed (%d)", j, g->pst_host[j]);
out:
	return r;
}

/* The log-probabilities of the rows of out that ask (n rows): the rows listed in g->lp_rows
 * and bd_op_logprobs launched on the step's logits and sampled tokens. Returns how many rows
 * (0: nothing launched) or a negative errno. */
static int launch_logprobs(struct bd_gmodel *g, const struct bd_gout *out, int n, char *ret_err)
{
	int r = 0, m = 0;
	if (!out || !out->want_lp)
		return 0;
	for (int i = 0; i < n; i++)
		if (out->want_lp[i])
			g->lp_rows[m++] = i;
	if (m > 0)
		OP(bd_op_logprobs(g->logits, g->V, g->lp_rows_dev, m,
				  (const int32_t *)(g->res_dev + RES_FLAGS), out->lp_k, g->lp_dev,
				  g->lp_ids, g->lp_vals, g->st));
	return m;
out:
	return r;
}

static int copy_out(struct bd_gmodel *g, const struct bd_gout *out, int n, const int32_t *toks,
		    int n_lp, char *ret_err)
{
	int r = 0;
	if (!out)
		return 0;
	if (n_lp > 0) {
		/* the kernel's compact rows, scattered back to the rows that asked */
		size_t k = (size_t)out->lp_k;
		float *lp = malloc((size_t)n_lp * (4 + 8 * k));
		if (!lp)
			return fail(ret_err, -ENOMEM, "out of memory");
		int32_t *ids = (int32_t *)(void *)(lp + n_lp);
		float *vals = (float *)(void *)(ids + (size_t)n_lp * k);
		cudaError_t e = cudaMemcpy(lp, g->lp_dev, (size_t)n_lp * 4, cudaMemcpyDeviceToHost);
		if (e == cudaSuccess && k)
			e = cudaMemcpy(ids, g->lp_ids, (size_t)n_lp * k * 4, cudaMemcpyDeviceToHost);
		if (e == cudaSuccess && k)
			e = cudaMemcpy(vals, g->lp_vals, (size_t)n_lp * k * 4,
				       cudaMemcpyDeviceToHost);
		for (int j = 0; e == cudaSuccess && j < n_lp; j++) {
			size_t i = (size_t)g->lp_rows[j];
			out->lp[i] = lp[j];
			if (k) {
				memcpy(out->lp_ids + i * k, ids + (size_t)j * k, k * 4);
				memcpy(out->lp_vals + i * k, vals + (size_t)j * k, k * 4);
			}
		}
		free(lp);
		CU(e);
	}
	if (out->tokens)
		memcpy(out->tokens, toks, (size_t)n * 4);
	if (out->logits)
		CU(cudaMemcpy(out->logits, g->logits, (size_t)n * (size_t)g->V * 4,
			      cudaMemcpyDeviceToHost));
	if (out->top_k > 0 && out->top_ids)
		CU(cudaMemcpy(out->top_ids, g->top_ids, (size_t)n * (size_t)out->top_k * 4,
			      cudaMemcpyDeviceToHost));
	if (out->top_k > 0 && out->top_logits)
		CU(cudaMemcpy(out->top_logits, g->top_vals, (size_t)n * (size_t)out->top_k * 4,
			      cudaMemcpyDeviceToHost));
out:
	return r;
}

/* Attention of layer l for a chunk of n query rows at positions p .. p+n−1 (p > 0): the
 * context 0..p−1 from the row's pages and sink, the chunk's own K'/V rows as the write path
 * will store them (kl, vl: their post-RoPE K and V), the queries rotated as decode rotates
 * them (bd_model_prefill_chunk's attention, NUMERICS.md §3 and §8). Output in g->att. */
static int chunk_attn(struct bd_gmodel *g, const struct glayer *y, int l, const struct bd_grow *row,
		      int n, const float *kl, const float *vl, char *ret_err)
{
	int r = 0, p = row->position;
	size_t kd = (size_t)g->kd;
	const int32_t *bt = (const int32_t *)((uint8_t *)g->pf_dev + g->pf_bt);
	float scale = 1.0f / sqrtf((float)g->d);
	OP(bd_op_kv_context(&g->lay, g->cfg, l, g->pages, bt, row->n_pages, slot_ptr(g, row->slot),
			    g->Hkv, g->kctx, g->vctx, g->st));
	OP(bd_op_kv_rows(&g->lay, g->cfg, l, kl, vl, y->mu, n, g->Hkv, g->kctx + (size_t)p * kd,
			 g->vctx + (size_t)p * kd, g->st));
	if (g->cfg->hadamard)
		OP(bd_op_fwht_rows(g->q, n * g->Hq, g->d, g->st));
	OP(bd_op_prefill_attn_ctx(g->q, g->kctx, g->vctx, n, p, g->Hq, g->Hkv, g->d, scale, g->att,
				  g->st));
out:
	return r;
}

int bd_gmodel_prefill(struct bd_gmodel *g, const struct bd_grow *row, const int32_t *tokens,
		      int n, const struct bd_gout *out, char *ret_err)
{
	int r = 0, n_lp = 0;

	if ((r = call_start(g, row && tokens, "model, row or tokens", ret_err)) < 0)
		return r;
	if (n < 1 || n > g->max_prefill)
		return fail(ret_err, -EINVAL, "prompt of %d tokens: outside 1..%d", n,
			    g->max_prefill);
	int p = row->position;
	if ((r = p > 0 ? check_chunk_row(g, row, n, ret_err) : check_start_row(g, row, n, ret_err)) <
		    0 ||
	    (r = check_out(g, out, ret_err)) < 0)
		return r;
	if (out && out->tokens && !check_sampling(&row->sampling))
		return fail(ret_err, -EINVAL, "bad sampling parameters");
	for (int i = 0; i < n; i++)
		if (tokens[i] < 0 || tokens[i] >= g->V)
			return fail(ret_err, -EINVAL, "token %d at %d outside 0..%d", tokens[i], i,
				    g->V - 1);
	CU(cudaSetDevice(g->device));
	if ((r = pf_upload(g, row, tokens, n, ret_err)) < 0)
		goto out;

	size_t N = (size_t)n, E = (size_t)g->E, kd = (size_t)g->kd, mp = (size_t)g->max_prefill;
	const int32_t *dtok = (const int32_t *)((uint8_t *)g->pf_dev + g->pf_tokens);
	float scale = 1.0f / sqrtf((float)g->d);
	CU(cudaMemsetAsync(g->res_dev, 0, sizeof(int) * (size_t)g->res_n, g->st));
	OP(bd_op_embed(g->embd, g->dt, g->V, g->E, dtok, n, g->x, g->res_dev + RES_EMBED, g->st));
	for (int l = 0; l < g->L; l++) {
		const struct glayer *y = &g->ly[l];
		float *kl = g->kall + (size_t)l * mp * kd, *vl = g->vall + (size_t)l * mp * kd;
		if ((r = qkv_proj(g, y, n, g->q, g->qd, kl, vl, ret_err)) < 0 ||
		    (r = qk_rope(g, y, n, g->q, g->Hq, kl, g->iota + p, ret_err)) < 0)
			goto out;
		if (p == 0)
			OP(bd_op_prefill_attn(g->q, kl, vl, n, g->Hq, g->Hkv, g->d, scale, g->att,
					      g->st));
		else if ((r = chunk_attn(g, y, l, row, n, kl, vl, ret_err)) < 0)
			goto out;
		if ((r = attn_out(g, y, n, g->qd, ret_err)) < 0 || (r = mlp(g, y, n, ret_err)) < 0)
			goto out;
	}
	OP(bd_op_check_finite(g->x, N * E, g->res_dev + RES_FINITE, g->st));
	CU(cudaMemcpyAsync(g->res_host, g->res_dev, sizeof(int) * RES_FLAGS, cudaMemcpyDeviceToHost,
			   g->st));
	if ((r = wait_stream(g, ret_err)) < 0)
		goto out;
	if (g->res_host[RES_FINITE]) {
		/* nothing written yet: the slot and pages are as they were */
		r = fail(ret_err, -EDOM, "non-finite activations in the prompt's forward pass");
		goto out;
	}

	if ((r = write_cache(g, p, n, g->kall, g->vall, mp, ret_err)) < 0)
		goto out;
	if (out) {
		if ((r = lm_head(g, n - 1, 1, ret_err)) < 0)
			goto out;
		const struct bd_gsample *s =
			(const struct bd_gsample *)((uint8_t *)g->pf_dev + g->pf_samp);
		OP(bd_op_sample(g->logits, 1, g->V, s, g->res_dev + RES_FLAGS, g->sample_ws,
				g->st));
		if (out->top_k > 0)
			OP(bd_op_topk(g->logits, 1, g->V, out->top_k, g->top_ids, g->top_vals,
				      g->st));
		if ((n_lp = launch_logprobs(g, out, 1, ret_err)) < 0) {
			r = n_lp;
			goto out;
		}
		CU(cudaMemcpyAsync(g->res_host, g->res_dev, sizeof(int) * (RES_FLAGS + 1),
				   cudaMemcpyDeviceToHost, g->st));
	}
	if ((r = finish_pages(g, row->n_new, ret_err)) < 0)
		goto out;
	if (out)
		r = copy_out(g, out, 1, g->res_host + RES_FLAGS, n_lp, ret_err);
out:
	return model_fails(g, r);
}

int bd_gmodel_fill_synthetic(struct bd_gmodel *g, const struct bd_grow *row, int n,
			     uint64_t seed, char *ret_err)
{
	int r = 0;

	if ((r = call_start(g, row != NULL, "model or row", ret_err)) < 0 ||
	    (r = check_start_row(g, row, n, ret_err)) < 0)
		return r;
	CU(cudaSetDevice(g->device));
	if ((r = pf_upload(g, row, NULL, 0, ret_err)) < 0)
		goto out;
	if (n < BD_PAGE_TOKENS) {
		r = write_span(g, 0, n, 0, NULL, NULL, 0, seed, ret_err);
	} else {
		int J = n / BD_PAGE_TOKENS;
		if ((r = fill_pages(g, J, seed, ret_err)) < 0)
			goto out;
		/* the slot as a position-by-position write leaves it: the sink, ring rows of the
		 * last full page, then the tail (every value a function of (layer, position)) */
		if ((r = write_span(g, 0, BD_SINK_TOKENS, 0, NULL, NULL, 0, seed, ret_err)) < 0 ||
		    (r = write_span(g, (J - 1) * BD_PAGE_TOKENS, BD_PAGE_TOKENS, 0, NULL, NULL, 0,
				    seed, ret_err)) < 0)
			goto out;
		if (n > J * BD_PAGE_TOKENS)
			r = write_span(g, J * BD_PAGE_TOKENS, n - J * BD_PAGE_TOKENS, 0, NULL, NULL,
				       0, seed, ret_err);
	}
	if (r < 0)
		goto out;
	r = finish_pages(g, row->n_new, ret_err);
out:
	return model_fails(g, r);
}

/* ---- decode ------------------------------------------------------------------------------ */

static struct bucket *bucket_for(struct bd_gmodel *g, int n)
{
	for (int i = 0; i < g->n_buckets; i++)
		if (g->bk[i].B >= n)
			return &g->bk[i];
	return NULL;
}

static int check_decode_rows(struct bd_gmodel *g, const struct bd_grow *rows,
			     const int32_t *tokens, int n, bool sampled, char *ret_err)
{
	int r = 0;
	memset(g->seen, 0, g->n_slots);
	for (int i = 0; i < n && r == 0; i++) {
		const struct bd_grow *w = &rows[i];
		int pos = w->position;
		if (w->slot < 0 || (size_t)w->slot >= g->n_slots)
			r = fail(ret_err, -EINVAL, "row %d: slot %d outside 0..%zu", i, w->slot,
				 g->n_slots - 1);
		else if (g->seen[w->slot]++)
			r = fail(ret_err, -EINVAL, "row %d: slot %d appears twice", i, w->slot);
		else if (tokens[i] < 0 || tokens[i] >= g->V)
			r = fail(ret_err, -EINVAL, "row %d: token %d outside 0..%d", i, tokens[i],
				 g->V - 1);
		else if (pos < 0 || pos >= g->max_tokens)
			r = fail(ret_err, -EINVAL, "row %d: position %d outside 0..%d", i, pos,
				 g->max_tokens - 1);
		else if (w->n_pages != pos / BD_PAGE_TOKENS || (w->n_pages > 0 && !w->block_table))
			r = fail(ret_err, -EINVAL, "row %d: position %d needs %d pages, %d given", i,
				 pos, pos / BD_PAGE_TOKENS, w->n_pages);
		else if (check_pages(g, w->block_table, w->n_pages) < 0)
			r = fail(ret_err, -EINVAL, "row %d: a block-table page outside 0..%zu", i,
				 g->lay.n_pages - 1);
		else if (w->n_new != ((pos + 1) % BD_PAGE_TOKENS == 0 ? 1 : 0) ||
			 (w->n_new > 0 && !w->new_pages))
			r = fail(ret_err, -EINVAL, "row %d: position %d completes %d pages, %d new "
						   "pages given", i, pos,
				 (pos + 1) % BD_PAGE_TOKENS == 0 ? 1 : 0, w->n_new);
		else if (check_pages(g, w->new_pages, w->n_new) < 0)
			r = fail(ret_err, -EINVAL, "row %d: new page outside 0..%zu", i,
				 g->lay.n_pages - 1);
		else if (sampled && !check_sampling(&w->sampling))
			r = fail(ret_err, -EINVAL, "row %d: bad sampling parameters", i);
	}
	return r;
}

/* Row i's block-table patch: the entries of the slot's table from the first one that differs
 * from the mirror (or that the device does not hold yet) on, appended to vals at *nv. */
static void pack_table(struct bd_gmodel *g, const struct bd_grow *w, int32_t *span,
		       int32_t *vals, size_t *nv)
{
	size_t bts = (size_t)g->bt_stride;
	int32_t *mir = g->bt_mirror + (size_t)w->slot * bts;
	int np = w->n_pages, have = g->bt_len[w->slot] < np ? g->bt_len[w->slot] : np, j0 = 0;
	if (have > 0 && memcmp(mir, w->block_table, (size_t)have * 4) == 0)
		j0 = have; /* the usual case: same table, maybe a page longer */
	else
		while (j0 < have && mir[j0] == w->block_table[j0])
			j0++;
	if (np > j0) {
		memcpy(vals + *nv, w->block_table + j0, (size_t)(np - j0) * 4);
		memcpy(mir + j0, w->block_table + j0, (size_t)(np - j0) * 4);
	}
	/* entries past np were not touched on either side: still equal */
	if (np > g->bt_len[w->slot])
		g->bt_len[w->slot] = np;
	span[0] = w->slot;
	span[1] = np;
	span[2] = j0;
	span[3] = (int32_t)*nv;
	*nv += (size_t)(np - j0);
}

/* The packed metadata of bucket bk for rows (padding rows after n); returns promotions. */
static int pack_metadata(struct bd_gmodel *g, const struct bucket *bk,
			 const struct bd_grow *rows, const int32_t *tokens, int n)
{
	const struct md_layout *ml = &bk->ml;
	uint8_t *h = g->md_host;
	int32_t *tk = (int32_t *)(h + ml->tokens), *pos = (int32_t *)(h + ml->pos);
	int32_t *lens = (int32_t *)(h + ml->lens);
	int32_t *spans = (int32_t *)(h + ml->spans), *vals = (int32_t *)(h + ml->vals);
	void **slots = (void **)(h + ml->slots);
	struct bd_gsample *samp = (struct bd_gsample *)(h + ml->samp);
	int32_t *pp = (int32_t *)(h + ml->ppages);
	void **ps = (void **)(h + ml->pslots);
	size_t nv = 0;
	int n_promo = 0;

	for (int i = 0; i < bk->B; i++) {
		struct bd_gsample s = gsample_of(NULL);
		if (i < n) {
			const struct bd_grow *w = &rows[i];
			tk[i] = tokens[i];
			pos[i] = w->position;
			lens[i] = w->position + 1;
			slots[i] = slot_ptr(g, w->slot);
			pack_table(g, w, spans + 4 * i, vals, &nv);
			s = gsample_of(w);
			if (w->n_new > 0) {
				pp[n_promo] = w->new_pages[0];
				ps[n_promo++] = slots[i];
			}
		} else {
			/* padding: token 0 at distinct positions of the dummy slots, no pages */
			int j = i - n;
			tk[i] = 0;
			pos[i] = j % BD_RECENT_TOKENS;
			lens[i] = pos[i] + 1;
			slots[i] = (uint8_t *)g->dummy +
				   (size_t)(j / BD_RECENT_TOKENS) * g->lay.slot_bytes;
			spans[4 * i] = -1;
			spans[4 * i + 1] = spans[4 * i + 2] = spans[4 * i + 3] = 0;
		}
		samp[i] = s;
	}
	return n_promo;
}

/* The kernels of graph into *gk (a diagnostic: a failed query leaves a kernel unnamed). */
static void graph_kernels_of(cudaGraph_t graph, struct graph_kernels *gk)
{
	size_t n = 0;
	memset(gk, 0, sizeof(*gk));
	if (cudaGraphGetNodes(graph, NULL, &n) != cudaSuccess || n == 0)
		return;
	cudaGraphNode_t *nodes = calloc(n, sizeof(*nodes));
	if (!nodes || cudaGraphGetNodes(graph, nodes, &n) != cudaSuccess) {
		free(nodes);
		return;
	}
	for (size_t i = 0; i < n; i++) {
		enum cudaGraphNodeType t;
		struct cudaKernelNodeParams kp;
		if (cudaGraphNodeGetType(nodes[i], &t) != cudaSuccess || t != cudaGraphNodeTypeKernel) {
			gk->other_nodes++;
			continue;
		}
		gk->kernel_nodes++;
		if (cudaGraphKernelNodeGetParams(nodes[i], &kp) != cudaSuccess) {
			gk->opaque_nodes++; /* a driver-API kernel (cuBLASLt's) */
			continue;
		}
		cudaLaunchAttributeValue v;
		memset(&v, 0, sizeof(v));
		if (cudaGraphKernelNodeGetAttribute(nodes[i], cudaLaunchAttributeClusterDimension,
						    &v) != cudaSuccess)
			memset(&v, 0, sizeof(v));
		unsigned cx = v.clusterDim.x ? v.clusterDim.x : 1, cy = v.clusterDim.y ? v.clusterDim.y : 1,
			 cz = v.clusterDim.z ? v.clusterDim.z : 1;
		int j = 0;
		while (j < gk->n && (gk->k[j].func != kp.func || gk->k[j].cx != cx ||
				     gk->k[j].cy != cy || gk->k[j].cz != cz))
			j++;
		if (j == gk->n) {
			if (gk->n == GK_MAX)
				continue;
			const char *name = NULL;
			if (cudaFuncGetName(&name, kp.func) != cudaSuccess)
				name = NULL;
			gk->k[j].func = kp.func;
			gk->k[j].name = name;
			gk->k[j].cx = cx;
			gk->k[j].cy = cy;
			gk->k[j].cz = cz;
			gk->n++;
		}
		gk->k[j].count++;
	}
	cudaGetLastError(); /* a refused query is not the step's error */
	free(nodes);
}

int bd_gmodel_graph_kernels(const struct bd_gmodel *g, int B, char *buf, size_t len)
{
	if (!g || !buf || len == 0 || B < 1 || B > g->max_batch)
		return -EINVAL;
	const struct bucket *bk = bucket_for((struct bd_gmodel *)g, B); /* it only reads */
	buf[0] = 0;
	if (!bk || !bk->exec)
		return 0;
	const struct graph_kernels *gk = &bk->gk;
	bool done[GK_MAX] = { false };
	size_t at = 0;
	for (int r = 0; r < gk->n; r++) {
		int best = -1;
		for (int j = 0; j < gk->n; j++)
			if (!done[j] && (best < 0 || gk->k[j].count > gk->k[best].count))
				best = j;
		done[best] = true;
		int w = snprintf(buf + at, len - at, "%4d %s%s", gk->k[best].count,
				 gk->k[best].name ? gk->k[best].name : "(unnamed)",
				 gk->k[best].cx * gk->k[best].cy * gk->k[best].cz > 1 ? " cluster" : "");
		if (w < 0 || (size_t)w >= len - at)
			break;
		at += (size_t)w;
		if (gk->k[best].cx * gk->k[best].cy * gk->k[best].cz > 1) {
			w = snprintf(buf + at, len - at, " %ux%ux%u", gk->k[best].cx, gk->k[best].cy,
				     gk->k[best].cz);
			if (w < 0 || (size_t)w >= len - at)
				break;
			at += (size_t)w;
		}
		if (at + 1 >= len)
			break;
		buf[at++] = '\n';
		buf[at] = 0;
	}
	int w = 0;
	if (gk->opaque_nodes > 0)
		w = snprintf(buf + at, len - at, "%4d (driver-API kernels, e.g. cuBLASLt's)\n",
			     gk->opaque_nodes);
	if (w >= 0 && (size_t)w < len - at && gk->other_nodes > 0)
		snprintf(buf + at + (size_t)w, len - at - (size_t)w, "%4d (nodes other than kernels)\n",
			 gk->other_nodes);
	return gk->kernel_nodes;
}

/* Capture the step of bucket bk into a graph. */
static int capture(struct bd_gmodel *g, struct bucket *bk, char *ret_err)
{
	cudaGraph_t graph = NULL;
	int r = 0;
	size_t nodes = 0;
	CU(cudaStreamBeginCapture(g->st, cudaStreamCaptureModeThreadLocal));
	r = enqueue_decode(g, bk, ret_err);
	cudaError_t e = cudaStreamEndCapture(g->st, &graph);
	if (r < 0)
		goto out;
	CU(e);
	CU(cudaGraphGetNodes(graph, NULL, &nodes));
	bk->nodes = (int)nodes;
	graph_kernels_of(graph, &bk->gk);
	CU(cudaGraphInstantiate(&bk->exec, graph, 0));
out:
	if (graph)
		cudaGraphDestroy(graph);
	return r;
}

int bd_gmodel_decode(struct bd_gmodel *g, const struct bd_grow *rows, const int32_t *tokens,
		     int n, const struct bd_gout *out, int *ret_status, char *ret_err)
{
	int r = 0, n_lp = 0;

	if ((r = call_start(g, rows && tokens, "model, rows or tokens", ret_err)) < 0)
		return r;
	if (n < 1 || n > g->max_batch)
		return fail(ret_err, -EINVAL, "%d rows: outside 1..%d", n, g->max_batch);
	if ((r = check_out(g, out, ret_err)) < 0 ||
	    (r = check_decode_rows(g, rows, tokens, n, out && out->tokens, ret_err)) < 0)
		return r;
	struct bucket *bk = bucket_for(g, n);
	CU(cudaSetDevice(g->device));

	double t0 = now_us();
	int n_promo = pack_metadata(g, bk, rows, tokens, n);
	double t1 = now_us();
	bool graph = false;
	CU(cudaEventRecord(g->ev0, g->st));
	if (g->use_graphs && !bk->exec && bk->runs > 0 && (r = capture(g, bk, ret_err)) < 0)
		goto out;
	if (g->use_graphs && bk->exec) {
		CU(cudaGraphLaunch(bk->exec, g->st));
		graph = true;
	} else {
		/* the first eager step of a bucket times its new skinny GEMM shapes */
		bd_gemm_set_tuning(g->gemm, g->dt == BD_DT_BF16 && !g->comm);
		r = enqueue_decode(g, bk, ret_err);
		bd_gemm_set_tuning(g->gemm, false);
		if (r < 0)
			goto out;
		bk->runs++;
	}
	double t1b = now_us();
	if (n_promo > 0) {
		uint8_t *md = (uint8_t *)g->md_dev + bk->off;
		OP(bd_promote_run(&g->lay, g->cfg, g->pages, (void *const *)(md + bk->ml.pslots),
				  (const int32_t *)(md + bk->ml.ppages), n_promo,
				  g->res_dev + RES_FLAGS + bk->B, g->st));
	}
	if (out && out->top_k > 0)
		OP(bd_op_topk(g->logits, n, g->V, out->top_k, g->top_ids, g->top_vals, g->st));
	if ((n_lp = launch_logprobs(g, out, n, ret_err)) < 0) {
		r = n_lp;
		goto out;
	}
	double t2 = now_us();
	CU(cudaMemcpyAsync(g->res_host, g->res_dev, sizeof(int) * (size_t)g->res_n,
			   cudaMemcpyDeviceToHost, g->st));
	if ((r = wait_stream(g, ret_err)) < 0)
		goto out;
	float ms = 0.0f;
	CU(cudaEventElapsedTime(&ms, g->ev0, g->ev1));
	g->tm.upload_us = t1 - t0;
	g->tm.launch_us = t1b - t1;
	g->tm.extra_us = t2 - t1b;
	g->tm.device_us = (double)ms * 1e3;
	g->tm.graph = graph;
	g->tm.graph_nodes = graph ? bk->nodes : 0;

	const int *res = g->res_host;
	int k = 0;
	for (int i = 0; i < n; i++) {
		int st = res[RES_KSTATUS] ? -ERANGE : 0;
		if (rows[i].n_new > 0) {
			int p = res[RES_FLAGS + bk->B + k++];
			if (p != 0 && st == 0)
				st = p == -EDOM ? -EDOM : -ERANGE;
		}
		if (ret_status)
			ret_status[i] = st;
	}
	if (res[RES_FINITE]) {
		r = fail(ret_err, -EDOM, "non-finite activations in the decode step");
		goto out;
	}
	r = copy_out(g, out, n, res + RES_FLAGS, n_lp, ret_err);
out:
	if (r < 0 && r != -EDOM) /* the patches may not have reached the device */
		memset(g->bt_len, 0, g->n_slots * sizeof(int));
	return model_fails(g, r);
}
