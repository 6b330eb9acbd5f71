/* bd_gmodel.h — the decoder forward pass on one CUDA device with the bdfp4 cache.
 *
 * The GPU twin of bd_model.h: a Llama/Qwen2/Qwen3 shard whose weights live on the device (BF16,
 * or FP32 for equality checks against the CPU backend), matrix products through cuBLASLt,
 * elementwise work, prefill attention and sampling in kernels/, decode attention through the
 * FP4 decode kernels (bd_kernels.h) and promotion through bd_promote_run. KV lives in an arena
 * the caller names (kvpoold's VMM arena imported by bd_pool_cuda_map, or one this module
 * allocates for tests): pages laid out by bd_layout.h, BF16 slots back to back.
 *
 * The model keeps no per-request state: each call names, per row, the request's slot, its
 * block table and the pages its tokens complete (the router's step plan, serve.proto PlanRow).
 * What the cache holds and how it is written is bd_model.h's contract exactly: keys
 * K' = H(k − μ_k) per the configuration, 16-token BF16 sink, BF16 recent tokens, each full
 * 128-token page promoted (NUMERICS.md §2–§3, §8) after the last layer; decode attention
 * NUMERICS.md §5–§8 with the kernels' tiling. Prefill attention is BF16-style causal attention
 * (FP32 compute over BF16-rounded post-RoPE K and V), as on the CPU.
 *
 * Tensor parallelism: a shard (bd_model_shard) of tp > 1 sums its attention-output and
 * MLP-down partial products with ncclAllReduce on the model's stream over the communicator the
 * caller made (opts.nccl_comm); waits poll ncclCommGetAsyncError, so a dead peer fails the
 * call (-EPIPE) instead of hanging. Rank 0 (the shard holding the LM head) samples.
 *
 * Errors are -errno: -EINVAL a bad argument (checked before any launch: nothing changes),
 * -ENOTSUP a shape the kernels do not implement, -ENODEV no such device, -ENOMEM, -EDOM
 * non-finite activations, -EPIPE the TP peer failed, -ETIMEDOUT a wait ran past its bound,
 * -EIO any other CUDA, cuBLASLt or NCCL error. After -EPIPE, -ETIMEDOUT or -EIO the model is
 * unusable: every later call returns -EIO (the caller frees it and builds a new one).
 * Functions taking ret_err (NULL or BD_MODEL_ERR_MAX bytes) put a one-line message there.
 * Not thread-safe: one thread per model.
 */
#ifndef BD_GMODEL_H
#define BD_GMODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "quant/bd_attn_ref.h"
#include "quant/bd_kvcfg.h"
#include "quant/bd_layout.h"
#include "model/bd_model.h"
#include "model/bd_sampler.h"

#ifdef __cplusplus
extern "C" {
#endif

enum bd_gweights {
	BD_GWEIGHTS_BF16 = 0, /* production: BF16 weights and GEMM inputs, FP32 accumulation */
	BD_GWEIGHTS_F32 = 1,  /* FP32 weights and GEMMs (pedantic, no TF32): matches the CPU */
};

struct bd_gmodel_opts {
	int device;                   /* CUDA ordinal; made current on the calling thread */
	enum bd_gweights weights;
	const struct bd_kvcfg *cfg;   /* KV configuration of every sequence (the pool's) */
	struct bd_layout lay;         /* arena geometry of this rank (lay.n_kv_heads ≥ the
				       * shard's KV heads, which use heads 0..Hkv'−1) */
	void *pages;                  /* device: lay's pages (layer l of page p at
				       * pages + l·layer_stride + p·page_bytes), 256-B aligned;
				       * NULL: the model allocates lay.n_pages pages itself */
	void *slots;                  /* device: n_slots slots of lay.slot_bytes back to back;
				       * NULL: the model allocates n_slots slots itself */
	size_t n_slots;
	const float *mu_k;            /* host [L][Hkv][d] (global KV heads), copied; NULL: μ = 0 */
	const struct bd_decode_params *dp; /* τ and flags, or NULL for the defaults */
	int max_batch;                /* decode rows per step, 1..1024 */
	int max_tokens;               /* longest sequence, tokens (block-table width, plans) */
	int max_prefill;              /* longest prompt one prefill call takes, tokens */
	void *nccl_comm;              /* ncclComm_t of the TP group (the shard's tp ranks), or
				       * NULL when the shard's tp is 1 */
	int use_graphs;               /* nonzero: decode steps are captured as CUDA graphs per
				       * batch-size bucket and replayed */
	int ar_timeout_ms;            /* bound on a wait for the device (> 0; 0: 30000) */
};

struct bd_gmodel;

/* Upload a host model or shard (bd_model.h; FP32 weights) to the device in opts->weights'
 * precision and make the activation buffers, cuBLASLt handles and decode plans for
 * opts->max_batch rows. The host model may be freed afterwards.
 * Returns 0, -EINVAL (NULL, opts out of range, lay not matching the model and cfg), -ENOTSUP
 * (cfg or shape the kernels do not implement), -ENODEV, -ENOMEM, -EIO; *ret only on success. */
int bd_gmodel_new(const struct bd_model *m, const struct bd_gmodel_opts *opts,
		  struct bd_gmodel **ret, char *ret_err);

/* A model of shape hp (shard sh of it; NULL: the whole model) with seeded random weights made
 * on the device (N(0, σ²) with σ = 1/sqrt(fan-in) for matrices, 1 for norm weights, a fixed
 * function of seed), for speed work where a checkpoint cannot be had. Errors as bd_gmodel_new. */
int bd_gmodel_new_random(const struct bd_model_hparams *hp, const struct bd_model_shard *sh,
			 uint64_t seed, const struct bd_gmodel_opts *opts, struct bd_gmodel **ret,
			 char *ret_err);

/* Replace the TP communicator (a new epoch of the worker group after a peer restarted):
 * nccl_comm as in bd_gmodel_opts, the old one is not touched (the caller destroys or aborts
 * it). Clears a failure that came from the communicator (-EPIPE, -ETIMEDOUT of an all-reduce
 * wait) once the device is idle again; other failures stay. Every captured graph is dropped
 * (they captured the old communicator's collectives). nccl_comm NULL on a shard of tp > 1
 * detaches: waits for the stream, drops the graphs (which hold NCCL resources that
 * ncclCommAbort would otherwise wait for) and leaves the model failed with -EPIPE until a new
 * communicator is set — call it before aborting the communicator on leaving a group.
 * Returns 0, -EINVAL (NULL g), -EIO (the model failed otherwise, or the device is not idle). */
int bd_gmodel_set_comm(struct bd_gmodel *g, void *nccl_comm);

/* The communicator the model holds: the one last given, or NULL when there is none or when
 * the model aborted it itself (a wait that saw the peer fail or time out ends in
 * ncclCommAbort, so that the stream can finish). A caller leaving the group aborts its
 * communicator only if the model still holds it (after bd_gmodel_set_comm(g, NULL)): never
 * twice. NULL g: NULL. */
void *bd_gmodel_comm(const struct bd_gmodel *g);

/* Release everything the model made (not the caller's arena). NULL is a no-op. */
void bd_gmodel_free(struct bd_gmodel *g);

/* The shape the model runs (whole model's) and its shard. */
const struct bd_model_hparams *bd_gmodel_hparams(const struct bd_gmodel *g);
const struct bd_model_shard *bd_gmodel_shard(const struct bd_gmodel *g);

/* Device pointers of the arena the model uses (the caller's or its own). */
void *bd_gmodel_pages(const struct bd_gmodel *g);
void *bd_gmodel_slots(const struct bd_gmodel *g);

/* One row of a step (one request): serve.proto PlanRow, host memory. */
struct bd_grow {
	int32_t slot;               /* the request's BF16 slot, 0..n_slots−1 */
	int32_t position;           /* tokens the cache held before the step: prefill 0 (a new
				     * sequence) or a multiple of 128 (a chunk); decode: the fed
				     * token's position */
	const int32_t *block_table; /* [n_pages] pages promoted before this step, token order */
	int n_pages;
	const int32_t *new_pages;   /* [n_new] pages this row's tokens complete, in order */
	int n_new;
	struct bd_sampler_params sampling; /* rank 0: how to pick the next token */
	uint64_t rng_step;          /* draws this request made before (the sampler is
				     * counter-based: (seed, rng_step) → the draw, so a row needs
				     * no device state) */
};

/* What a call returns to rank 0 (NULL pointers: not wanted). Rows in call order, host memory.
 * Log-probabilities are those of bd_sampler_logprobs (the cpu backend's; OpenAI's logprobs):
 * the log-softmax of the raw logits (temperature 1, before top-k and top-p, whatever the row
 * samples with), in double, computed on the device by bd_op_logprobs for the rows that ask
 * only, after the step (outside its CUDA graph): a call where no row asks launches nothing
 * more. */
struct bd_gout {
	int32_t *tokens;    /* [n] sampled tokens */
	float *logits;      /* [n][V] FP32 logits of each row's last position */
	int top_k;          /* 0..64: the k largest logits of each row */
	int32_t *top_ids;   /* [n][top_k], largest first, ties by lower id */
	float *top_logits;  /* [n][top_k] */
	const bool *want_lp; /* [n] true: row i wants its log-probabilities; NULL: no row does */
	int lp_k;           /* 0..64 (≤ V): the most likely tokens reported per such row */
	float *lp;          /* [n] the sampled token's log-probability; NaN when the row's logits
			     * are not finite (NaN, +inf, or all −inf: bd_sampler_logprobs's -EDOM) */
	int32_t *lp_ids;    /* [n][lp_k] the lp_k most likely, most likely first, ties by lower
			     * id (bd_sampler_top's order); −1 where lp is NaN for that reason */
	float *lp_vals;     /* [n][lp_k] their log-probabilities */
	/* rows that do not ask keep what lp, lp_ids and lp_vals held */
};

/* Prefill tokens [n] (ids < V, 1 ≤ n ≤ max_prefill) of one request at positions p .. p+n−1,
 * p = row->position:
 *   - p = 0: a new sequence (row->n_pages 0), causal BF16-style attention over the prompt,
 *     as bd_model_prefill;
 *   - p > 0, a multiple of 128: the next chunk of a prompt whose first p tokens the cache holds
 *     in the slot's sink and the p/128 pages of row->block_table (row->n_pages = p/128), as
 *     bd_model_prefill_chunk (lib/model/bd_forward.h, the numeric spec): the chunk's queries,
 *     rotated as the decoder rotates q (q' = Hq when the configuration rotates keys), attend
 *     with FP32 scores, softmax and P·V over the context as the cache holds it (the pages
 *     dequantized as bd_page_read_head reads them, e.g. (g·s)·x̂ for NVFP4 and s·x̂ for
 *     MXFP4, positions 0..15 from the BF16 sink
 *     when the configuration keeps one) and over the chunk's own positions as the write path
 *     will store them (K' = H(k − μ_k) and V rounded to BF16), causally. The recent ring is
 *     never read, so a chunk run again after a failure reads what the first run read.
 * Either way the n tokens' KV is then written as bd_model_prefill writes it (sink, the
 * n/128 row->new_pages promoted in order as they fill, recent), once the pass's activations
 * are known finite. Memory: the context of one layer, [max_tokens][Hkv'·d] FP32 K' and V,
 * made at bd_gmodel_new, so p + n ≤ max_tokens.
 * out: NULL on a shard without the LM head, else what is wanted of the last position.
 * Returns 0, -EINVAL (bad row, token, n, pages, p not a multiple of 128 or a block table of
 * another length than p/128: nothing written), -ENOSPC (p + n > max_tokens: nothing written),
 * -EDOM (non-finite activations: nothing written), -EPIPE, -ETIMEDOUT, -EIO. */
int bd_gmodel_prefill(struct bd_gmodel *g, const struct bd_grow *row, const int32_t *tokens,
		      int n, const struct bd_gout *out, char *ret_err);

/* Fill a request's cache with n synthetic tokens (no forward pass): every layer and KV head
 * gets K ~ N(0, 1)·(1 + outlier channels) and V ~ N(0, 1) rounded to BF16 at positions
 * 0..n−1, written and promoted exactly as real KV would be (row->new_pages: n/128 pages), a
 * fixed function of seed. Decode then continues at position n. For serving benchmarks at
 * contexts a real prefill cannot reach in the time. Returns as bd_gmodel_prefill. */
int bd_gmodel_fill_synthetic(struct bd_gmodel *g, const struct bd_grow *row, int n,
			     uint64_t seed, char *ret_err);

/* Decode one token for each of n ≤ max_batch rows (continuous batching: one GEMM per weight
 * for all rows, one decode-kernel launch per layer for all rows): token i at
 * rows[i].position, its KV written into the slot, attention over block table + slot, pages
 * completed by this token promoted into rows[i].new_pages (0 or 1 of them) after the last
 * layer. Replayed from a CUDA graph when opts.use_graphs. out as for prefill (n rows).
 * ret_status [n]: 0, or why the kernels refused that row (BD_KSTATUS_* mapped to -ERANGE);
 * the row's outputs are then not meaningful. Returns 0, -EINVAL (nothing ran), -EDOM, -EPIPE,
 * -ETIMEDOUT, -EIO. */
int bd_gmodel_decode(struct bd_gmodel *g, const struct bd_grow *rows, const int32_t *tokens,
		     int n, const struct bd_gout *out, int *ret_status, char *ret_err);

/* Timing of the last decode call, microseconds: host time to build the step's metadata
 * (tokens, lengths, slot pointers, the block-table entries that changed since the slot's last
 * step) in pinned memory that the step's first kernel reads, host time to launch (graph launch
 * or the kernels), and device time of the whole step (events). */
struct bd_gmodel_timing {
	double upload_us, launch_us, device_us;
	double extra_us;  /* host time to launch what follows the graph: the promotion of the
			   * pages this step completed, the top-k of the logits and the
			   * log-probabilities of the rows that ask (0 when none) */
	int graph;        /* 1 when the step replayed a graph */
	int graph_nodes;  /* nodes of that graph (cudaGraphGetNodes), 0 without one */
};
void bd_gmodel_last_timing(const struct bd_gmodel *g, struct bd_gmodel_timing *ret);

/* The model's stream (a cudaStream_t): what a caller enqueues there before a prefill or decode
 * call runs before the call's kernels (the pool scrub, bd_pool_cuda_scrub). NULL g: NULL. */
void *bd_gmodel_stream(const struct bd_gmodel *g);

/* What the captured decode graph of the bucket that serves B rows launches (the graph-launch
 * cost depends on it): one line per distinct kernel, "COUNT NAME", most frequent first, with
 * " cluster XxYxZ" for kernels launched with a thread-block cluster, then a line counting the
 * kernels the runtime cannot describe (driver-API kernels: cuBLASLt's GEMMs) and one counting
 * the nodes that are not kernels; into buf (len bytes, NUL-terminated, cut at a line when
 * full). Names from the CUDA runtime ("(unnamed)" where it has none). Returns the graph's
 * kernel nodes (both kinds), 0 (buf empty) when that bucket has no graph yet, -EINVAL
 * for a NULL argument, len 0 or B outside 1..max_batch. */
int bd_gmodel_graph_kernels(const struct bd_gmodel *g, int B, char *buf, size_t len);

#ifdef __cplusplus
}
#endif
#endif
