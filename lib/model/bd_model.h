/* bd_model.h — the decoder forward pass on the CPU with the bdfp4 KV cache.
 *
 * A model is a Llama, Qwen2 or Qwen3 decoder whose weights were dequantized to FP32 at load
 * (bd_gguf.h reads them); matrix products go through OpenBLAS. One request is a bd_seq: its
 * KV cache is the bdfp4 cache of one NUMERICS.md §9 configuration — a BF16 slot (16 sink and
 * 128 recent tokens per layer and KV head, K' = H(k − μ_k) as the configuration says) and
 * 128-token pages promoted from the slot as they fill (NUMERICS.md §8), in an arena reached
 * through a small allocator interface (bd_kvmem) that the pool daemon replaces later.
 *
 * Prefill runs BF16-style causal attention over the prompt (FP32 compute over BF16-rounded
 * post-RoPE K and V), then writes the prompt's KV through the same write path decoding uses
 * (bd_kv_write_token, bd_page_promote). Decode attention is bd_ref_decode_gqa() per
 * (layer, KV head) group with the G query heads of that group.
 *
 * Shapes: E = n_embd, F = n_ff, Hq query heads, Hkv KV heads, G = Hq / Hkv, d head dim,
 * V = n_vocab, L = n_layers. Query head j reads KV head j / G. Matrices are row-major
 * [out][in] (a GGUF tensor with ne = {in, out}), so y = W x.
 *
 * Errors are -errno: -EINVAL a bad argument (NULL, a token id outside the vocabulary, an
 * unknown configuration, a sequence in the wrong state), -ENOTSUP a model shape the cache
 * cannot hold, -ENOSPC the sequence or its arena is full, -EDOM a non-finite value met on the
 * way, -ENOMEM, and the loader's codes (bd_gguf.h). A failure after a forward pass began to
 * write the cache leaves the sequence unusable: every later call on it returns -EIO.
 * Functions taking ret_err (NULL or BD_MODEL_ERR_MAX bytes) put a one-line message there on
 * failure.
 */
#ifndef BD_MODEL_H
#define BD_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "quant/bd_attn_ref.h"
#include "formats/bd_gguf.h"
#include "quant/bd_kvcfg.h"
#include "quant/bd_layout.h"

#ifdef __cplusplus
extern "C" {
#endif

#define BD_MODEL_ERR_MAX 256

/* ---- weights ------------------------------------------------------------------------------ */

/* One decoder block. Every pointer is FP32; optional ones are NULL when the architecture has
 * none (biases: Qwen2 only; q/k norms: Qwen3 only). */
struct bd_model_layer {
	float *attn_norm;       /* [E] RMSNorm weight before attention */
	float *wq;              /* [Hq·d][E] */
	float *wk;              /* [Hkv·d][E] */
	float *wv;              /* [Hkv·d][E] */
	float *wo;              /* [E][Hq·d] */
	float *bq, *bk, *bv;    /* [Hq·d], [Hkv·d], [Hkv·d] or NULL */
	float *q_norm, *k_norm; /* [d] per-head RMSNorm weights before RoPE, or NULL */
	float *ffn_norm;        /* [E] RMSNorm weight before the MLP */
	float *w_gate;          /* [F][E] */
	float *w_up;            /* [F][E] */
	float *w_down;          /* [E][F] */
};

/* The part of a model one tensor-parallel rank holds (Megatron-style split). KV
 * heads are dealt out as evenly as they go, the first ranks taking one more (SmolLM2's 3 over
 * TP = 2: rank 0 heads {0, 1}, rank 1 head {2}); each rank has the G query heads of its KV
 * heads and a contiguous block of MLP columns, again the first ranks taking one more. Rank 0
 * holds the final norm and the LM head; every rank holds the token embeddings. A whole model
 * is the shard rank 0 of tp 1. */
struct bd_model_shard {
	int rank, tp;
	int kv_head0, n_kv_heads; /* global KV heads kv_head0 .. kv_head0 + n_kv_heads − 1 */
	int head0, n_heads;       /* global query heads: kv_head0·G, n_kv_heads·G of them */
	int ff0, n_ff;            /* global MLP columns ff0 .. ff0 + n_ff − 1 */
	bool lm_head;             /* output_norm and output are held (rank 0) */
};

/* A loaded model, or one rank's shard of it. Immutable after load, so any number of sequences
 * (and threads, one per sequence) may use it at once. hp is always the whole model's; a
 * shard's tensors have its local sizes Hq' = shard.n_heads, Hkv' = shard.n_kv_heads and
 * F' = shard.n_ff in place of Hq, Hkv and F in the shapes of struct bd_model_layer (wq holds
 * the rows of its query heads, wo the columns, w_gate and w_up the rows of its MLP columns,
 * w_down the columns). */
struct bd_model {
	struct bd_model_hparams hp;
	struct bd_model_shard shard;
	float *tok_embd;              /* [V][E] token embeddings */
	float *output_norm;           /* [E] final RMSNorm weight, NULL without the LM head */
	float *output;                /* [V][E] LM head; == tok_embd when hp.tied_embeddings;
				       * NULL without the LM head */
	struct bd_model_layer *layers; /* [L] */
	void *mem;                    /* one allocation holding every tensor above */
	size_t mem_bytes;
};

/* Allocate a model of shape hp with every weight zero (norm weights included) and the
 * optional tensors hp asks for (biases when hp->attn_bias, q/k norms when hp->qk_norm, a
 * separate LM head unless hp->tied_embeddings). Loaders and tests fill the weights in.
 * Requires positive sizes (n_ctx_train included), Hq a multiple of Hkv, head_dim_v ==
 * head_dim, n_rot even in 2..head_dim, finite rope_base > 0 and norm_eps > 0, a known
 * rope_style. Returns 0, -EINVAL, -ENOMEM; *ret only on success. */
int bd_model_alloc(const struct bd_model_hparams *hp, struct bd_model **ret);

/* Build a model from a parsed GGUF file: hyperparameters by bd_gguf_model_hparams(), every
 * tensor (token_embd, output_norm, output unless tied, blk.N.{attn_norm, attn_q, attn_k,
 * attn_v, attn_output, ffn_norm, ffn_gate, ffn_up, ffn_down}, blk.N.attn_{q,k,v}.bias for
 * Qwen2, blk.N.attn_{q,k}_norm for Qwen3) checked for its shape and dequantized to FP32.
 * The model does not keep g. Returns 0, the hparams errors, -EBADMSG (a tensor missing or of
 * the wrong shape), -ENOTSUP (a tensor type the dequantizer lacks, or a value head dim unlike
 * the key head dim), -ENOMEM; *ret only on success. */
int bd_model_from_gguf(const struct bd_gguf *g, struct bd_model **ret, char *ret_err);

/* Open, parse and load a GGUF file (bd_gguf_open + bd_model_from_gguf; the file is unmapped
 * before returning). Returns 0 or the errors of both. */
int bd_model_load(const char *path, struct bd_model **ret, char *ret_err);

/* Release a model. NULL is a no-op. */
void bd_model_free(struct bd_model *m);

/* ---- tensor parallelism ---------------------------------------------------------- */

/* The shard of rank `rank` (0..tp−1) of tp ranks for a model of shape hp (struct
 * bd_model_shard says how heads and columns are dealt). Returns 0, -EINVAL (NULL, hp out of
 * range as bd_model_alloc checks, rank outside 0..tp−1, tp < 1, or tp larger than Hkv or F:
 * every rank needs a KV head and MLP columns). */
int bd_model_shard_plan(const struct bd_model_hparams *hp, int rank, int tp,
			struct bd_model_shard *ret);

/* Rank `rank` of tp of a parsed GGUF file, or of a file (bd_model_from_gguf and
 * bd_model_load for the shard only: the rows and columns of its heads and MLP columns are
 * cut out of each dequantized tensor). Returns 0, the errors of those two and of
 * bd_model_shard_plan. */
int bd_model_from_gguf_shard(const struct bd_gguf *g, int rank, int tp, struct bd_model **ret,
			     char *ret_err);
int bd_model_load_shard(const char *path, int rank, int tp, struct bd_model **ret,
			char *ret_err);

/* Copy rank `rank` of tp out of a whole model in memory (tests build random models this way).
 * Returns 0, -EINVAL (NULL, full is itself a shard, the plan's errors), -ENOMEM. */
int bd_model_shard_of(const struct bd_model *full, int rank, int tp, struct bd_model **ret);

/* The all-reduce a shard's forward pass calls after its attention-output and MLP-down
 * products: buf [n] FP32 partial sums, replaced in place by their sum over the ranks, the
 * same bytes on every rank (bd_allreduce.h's bd_allreduce_model_cb over shared memory on the
 * CPU; NCCL on the GPU). Returns 0 or -errno. Every rank of a step makes the same calls with
 * the same n, in the same order: a rank that meets an error in a layer keeps calling with NaN
 * partial sums, so that its peers fail the same step instead of waiting. */
typedef int (*bd_model_allreduce_fn)(void *ctx, float *buf, size_t n);

/* ---- building blocks (exported for tests and the other backends) ---------------------------- */

/* RMSNorm: y_i = x_i / sqrt(mean(x²) + eps) · w_i, the mean accumulated in double (as
 * llama.cpp does); x and y may alias. Returns 0, -EINVAL (NULL, n < 1, eps not > 0). */
int bd_rmsnorm(const float *x, const float *w, int n, float eps, float *ret_y);

/* RoPE in place on n_heads heads of head_dim channels, x [n_heads][head_dim], position pos.
 * Channel pair i (0 ≤ i < n_rot/2) turns by pos·θ_i, θ_i = base^(−2i/n_rot), computed in
 * double: (a, b) → (a·cos − b·sin, a·sin + b·cos). NORM pairs channels (2i, 2i+1), NEOX
 * pairs (i, i + n_rot/2); channels ≥ n_rot are left alone.
 * Returns 0, -EINVAL (NULL, n_rot odd, > head_dim or < 2, pos < 0, base not > 0). */
int bd_rope(float *x, int n_heads, int head_dim, int n_rot, int pos, float base,
	    enum bd_rope_style style);

/* ---- KV memory: "give me a page id / slot memory" ----------------------------------------- */

struct bd_kvmem;

/* The allocator a sequence draws its pages and slot from. The private arena below implements
 * it in process; the pool client implements it over kvpoold. Pages index the arena laid out
 * by `lay` (bd_layout_page); a slot is lay->slot_bytes. */
struct bd_kvmem_ops {
	int (*page_alloc)(struct bd_kvmem *mem, int32_t *ret_page); /* 0 or -ENOSPC */
	void (*page_free)(struct bd_kvmem *mem, int32_t page);
	int (*slot_alloc)(struct bd_kvmem *mem, void **ret_slot);   /* 0 or -ENOMEM/-ENOSPC */
	void (*slot_free)(struct bd_kvmem *mem, void *slot);
};

struct bd_kvmem {
	const struct bd_kvmem_ops *ops;
	struct bd_layout lay; /* geometry of the arena and of every slot */
	void *arena;          /* lay.arena_bytes */
	void *priv;           /* the implementation's state */
};

/* A private in-process arena of lay->n_pages pages (allocated zeroed, 256-byte aligned) and
 * heap slots. Returns 0, -EINVAL, -ENOMEM. Free with bd_kvmem_private_free() once every
 * sequence using it is freed. */
int bd_kvmem_private_new(const struct bd_layout *lay, struct bd_kvmem **ret);
void bd_kvmem_private_free(struct bd_kvmem *mem);

/* KV memory allocated by someone else (the router allocates pages and slots through
 * kvpoold and names them in each step plan; a worker only reads and writes them). pages: an
 * arena laid out by lay (lay->n_pages pages); slots: n_slots slots of lay->slot_bytes back to
 * back. The memory is not owned and must outlive the kvmem. What a sequence draws is what was
 * queued before the call that draws it (bd_kvmem_ext_provide: the slot bd_seq_new takes, the
 * pages its promotions take, in order); freeing gives nothing back (the allocator's owner
 * releases). Not thread-safe: queue and draw from one thread.
 * Returns 0, -EINVAL (NULL, n_slots < 1, a layout without pages), -ENOMEM. */
int bd_kvmem_ext_new(const struct bd_layout *lay, void *pages, void *slots, size_t n_slots,
		     struct bd_kvmem **ret);

/* The same over the arena of a kvpoold attachment (bd_pool_client.h, CPU backend: its layout, pages
 * and slots). Returns 0, -EINVAL (NULL, nothing mapped: a CUDA arena), -ENOMEM. */
struct bd_pool_attach;
int bd_kvmem_pool_new(const struct bd_pool_attach *a, struct bd_kvmem **ret);

/* Frees an ext kvmem (not the memory it points at). NULL is a no-op. */
void bd_kvmem_ext_free(struct bd_kvmem *mem);

#define BD_KVMEM_EXT_MAX_QUEUE 4096 /* pages one provide call may queue */

/* Queue slot id `slot` (−1: none) for the next slot_alloc and pages[0..n) for the next n
 * page_allocs, replacing what was queued and not drawn. Returns 0, -EINVAL (NULL, not an ext
 * kvmem, n outside 0..BD_KVMEM_EXT_MAX_QUEUE, pages NULL with n > 0), -ERANGE (an id outside
 * the arena: nothing is queued). A draw with nothing queued fails with -ENOSPC. */
int bd_kvmem_ext_provide(struct bd_kvmem *mem, int32_t slot, const int32_t *pages, int n);

/* Queued pages not drawn yet (a plan that named more pages than its promotions used), or
 * -EINVAL. */
int bd_kvmem_ext_pending(const struct bd_kvmem *mem);

/* The id of a slot pointer of this kvmem, or -1 (NULL, not one of its slots). */
int32_t bd_kvmem_ext_slot_id(const struct bd_kvmem *mem, const void *slot);

/* ---- sequences (one request's state) ------------------------------------------------------- */

/* Called once per (layer, position) that a forward pass computes, after RoPE and before the
 * KV write: q [Hq][d], k [Hkv][d] post-RoPE FP32 keys (before k − μ and H), v [Hkv][d] (a
 * shard's own heads: Hq', Hkv'). Calibration (NUMERICS.md §7) averages k and replays softmax
 * on q through it. */
typedef void (*bd_kv_hook)(void *ctx, int layer, int pos, const float *q, const float *k,
			   const float *v);

struct bd_seq_opts {
	int max_tokens;          /* capacity: prompt + generated tokens, 1..hp.n_ctx_train */
	const float *mu_k;       /* [L][Hkv][d] calibrated post-RoPE key means (copied), or NULL:
				  * μ_k = 0 (no calibration yet; NUMERICS.md §3) */
	const float *fp8_scales; /* [L][Hkv][2] {s_K, s_V} for `fp8` pages (copied), or NULL: taken
				  * from the first promoted page, amax / 448 per (layer, KV head) */
	const struct bd_decode_params *dp; /* decode tiling and τ, or NULL: the defaults */
	struct bd_kvmem *mem;    /* pages and slot from here (its layout must match the model and
				  * configuration), or NULL: a private arena sized for max_tokens */
	bd_kv_hook hook;         /* or NULL */
	void *hook_ctx;
	bd_model_allreduce_fn allreduce; /* required by a shard of tp > 1, else ignored */
	void *allreduce_ctx;
};

struct bd_seq;

/* Start a sequence of model m with KV configuration cfg (bd_kvcfg_find). Needs d a multiple
 * of 32 and ≤ 1024 (a power of two when cfg rotates keys) and head_dim_v == head_dim.
 * A shard's sequence holds its own KV heads only, in heads 0..Hkv'−1 of the layout: a mem
 * may then have more heads than Hkv' (kvpoold sizes every rank for ceil(Hkv / tp)); mu_k and
 * fp8_scales stay indexed by the global KV head.
 * Returns 0, -EINVAL (NULL, max_tokens out of range, a mem whose layout does not match, a
 * shard of tp > 1 without an all-reduce), -ENOTSUP (a head dim the cache cannot hold),
 * -ENOMEM; *ret only on success. */
int bd_seq_new(const struct bd_model *m, const struct bd_kvcfg *cfg,
	       const struct bd_seq_opts *opts, struct bd_seq **ret, char *ret_err);

/* Release a sequence, returning its pages and slot to its kvmem. NULL is a no-op. */
void bd_seq_free(struct bd_seq *s);

/* Tokens held by the sequence (prompt and decoded), its capacity, and the decode statistics
 * (probability blocks, zero blocks; bd_attn_ref.h) its decode steps have accumulated. */
int bd_seq_n_tokens(const struct bd_seq *s);
int bd_seq_capacity(const struct bd_seq *s);
struct bd_decode_stats bd_seq_stats(const struct bd_seq *s);

/* Pages the next promotions of s go into, in order, instead of pages drawn from its kvmem
 * (the router allocates them and names them in the step plan). They stay the
 * caller's: bd_seq_free does not give them back to the kvmem. Replaces what was given and not
 * taken. Returns 0, -EINVAL (NULL, n < 0, pages NULL with n > 0, more pages than s can still
 * promote: nothing changes), -ERANGE (an id outside the arena: nothing changes). */
int bd_seq_give_pages(struct bd_seq *s, const int32_t *pages, int n);

/* Given pages not taken yet (a plan that named more pages than were filled), or -EINVAL. */
int bd_seq_given_pages(const struct bd_seq *s);

/* The sequence's BF16 slot (NULL for NULL), and its block table: the pages promoted so far in
 * token order, *ret_pages valid until the next call on s. Returns the page count or -EINVAL. */
void *bd_seq_slot(const struct bd_seq *s);
int bd_seq_block_table(const struct bd_seq *s, const int32_t **ret_pages);

/* Prefill an empty sequence with tokens [n] (ids < V): BF16-style causal attention over the
 * prompt, then the prompt's KV written through the cache's write path (sink, pages promoted
 * as they fill, recent). ret_logits: [V] logits of the last position, or NULL (NULL is
 * required from a shard without the LM head: -EINVAL otherwise, nothing changes). A shard's
 * all-reduce errors are returned as they come (-EPIPE, -ETIMEDOUT: the sequence stays empty).
 * Returns 0, -EINVAL (NULL, n < 1, a bad token id, a non-empty sequence, another model's
 * sequence: nothing changes), -ENOSPC (n > capacity: nothing changes; or a shared kvmem out of
 * pages), -ENOMEM, -EDOM (non-finite activations: if caught before the cache was written the
 * sequence stays empty and usable), -EIO (the sequence failed before). */
int bd_model_prefill(const struct bd_model *m, struct bd_seq *s, const int32_t *tokens, int n,
		     float *ret_logits);

/* Prefill n_seqs empty sequences of m with the same tokens [n] in one forward pass (
 * prefill attention is BF16 for every configuration, so the prompt's activations and logits
 * do not depend on the cache; only what is written afterwards does). The pass is
 * bd_model_prefill's arithmetic; every sequence's hook sees every (layer, position) of it as
 * with its own prefill, in the same order (a layer's positions in turn, the sequences' hooks
 * in seqs order for each position). The prompt's KV then goes through each sequence's own
 * write path (configuration, μ_k, FP8 scales, kvmem), seqs[0] first, so that each sequence
 * ends byte for byte as bd_model_prefill alone would leave it (slot, pages, block table,
 * statistics), and a shared kvmem hands out pages in the order of separate prefills in seqs
 * order. ret_logits: [V] logits of the last position (the same for every sequence), or NULL.
 * Memory: one pass's scratch, the same as bd_model_prefill's, whatever n_seqs is.
 * Validation happens before anything runs: -EINVAL (NULL, n_seqs < 1, n < 1, a NULL
 * sequence, another model's, one given twice, a non-empty one, a bad token id, ret_logits
 * from a shard without the LM head, sequences with different all-reduces), -EIO (a failed
 * sequence), -ENOSPC (n beyond a sequence's capacity): nothing changes. An all-reduce error or
 * -EDOM caught in the pass leaves every sequence empty and usable, -ENOMEM too. A failure in a
 * sequence's write path (-ENOSPC a shared kvmem out of pages, -ENOMEM, -EDOM) fails that
 * sequence (-EIO afterwards); the others are still written and the first error is returned,
 * without logits: a sequence holds the prompt iff bd_seq_n_tokens() is n afterwards.
 * bd_model_prefill(m, s, ...) is bd_model_prefill_multi(m, &s, 1, ...). */
int bd_model_prefill_multi(const struct bd_model *m, struct bd_seq *const *seqs, int n_seqs,
			   const int32_t *tokens, int n, float *ret_logits);

/* Decode one token at position bd_seq_n_tokens(s): its KV goes through the write path, each
 * (layer, KV head) group attends through bd_ref_decode_gqa(), and a page that this token
 * completes is promoted after the last layer. ret_logits: [V] or NULL (required NULL from a
 * shard without the LM head, as for prefill). An all-reduce error fails the sequence.
 * Returns 0, -EINVAL (NULL, bad token id: nothing changes), -ENOSPC (full: nothing changes;
 * or a shared kvmem out of pages), -EDOM, -ENOMEM, -EIO (the sequence failed before). */
int bd_model_decode(const struct bd_model *m, struct bd_seq *s, int32_t token,
		    float *ret_logits);

/* Decode one token for each of n distinct sequences of m at once (continuous batching): every
 * weight product takes the n rows together (one matrix–matrix product per weight, so the
 * weights are read once per step, not once per row), each row attends through its own cache
 * as bd_model_decode does, a shard makes one all-reduce per product for all rows, and pages
 * the rows complete are promoted row by row in order (the order a shared kvmem hands pages
 * out). tokens [n]; ret_logits [n][V] or NULL (NULL required without the LM head); ret_status
 * [n]: what bd_model_decode would have returned for the row. A row refused up front (-EINVAL
 * for a NULL or another model's sequence or a bad token, -EIO, -ENOSPC) is left as it was;
 * the others run, and a row that fails on the way fails alone (its sequence then -EIO); its
 * logits row is not written. Results match bd_model_decode row by row up to FP32 rounding (a
 * matrix–matrix product adds in another order than a matrix–vector one); n = 1 is
 * bd_model_decode exactly. Returns 0 (see ret_status); -EINVAL (NULL, n < 1, a sequence twice,
 * rows with different all-reduces: nothing runs); -ENOMEM; or an all-reduce error, with which
 * every row that ran fails. */
int bd_model_decode_batch(const struct bd_model *m, struct bd_seq *const *seqs,
			  const int32_t *tokens, int n, float *ret_logits, int *ret_status);

/* ---- generation -------------------------------------------------------------------------- */

struct bd_sampler_params; /* bd_sampler.h */

/* Called with each generated token as it is sampled (stream it); a nonzero return stops the
 * generation after that token (stop strings are matched by the caller, who owns the text). */
typedef int (*bd_token_cb)(void *ctx, int32_t token);

struct bd_gen_params {
	const char *kv;            /* KV configuration name (NUMERICS.md §9) */
	int max_tokens;            /* ≥ 1 tokens to generate at most */
	const struct bd_sampler_params *sampling; /* NULL: greedy */
	const int32_t *stop_ids;   /* [n_stop_ids] end-of-generation ids: generation stops after
				    * sampling one (it is returned, not streamed), or NULL */
	int n_stop_ids;
	const float *mu_k;         /* as bd_seq_opts */
	bd_token_cb on_token;      /* or NULL */
	void *cb_ctx;
};

/* Generate from a prompt (a whole model: -EINVAL for a shard of tp > 1): a sequence of the
 * configuration sized prompt + max_tokens, prefill,
 * then sample and decode until max_tokens, a stop id or on_token's stop. ret_tokens:
 * [max_tokens] the generated ids (a final stop id included); *ret_n their count.
 * Returns 0, -EINVAL (unknown configuration, max_tokens < 1, empty prompt, a bad token id,
 * prompt + max_tokens beyond the training context), -ENOTSUP, -ENOMEM, -EDOM; on failure
 * ret_err says why. */
int bd_generate(const struct bd_model *m, const int32_t *prompt, int n_prompt,
		const struct bd_gen_params *p, int32_t *ret_tokens, int *ret_n, char *ret_err);

#ifdef __cplusplus
}
#endif
#endif
