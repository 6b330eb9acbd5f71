/* bd_seq.h — one request's state: its bdfp4 KV cache and position.
 *
 * A sequence's KV cache is the cache of one NUMERICS.md §9 configuration: a BF16 slot (16 sink
 * and 128 recent tokens per layer and KV head, K' = H(k − μ_k) as the configuration says) and
 * 128-token pages promoted from the slot as they fill (NUMERICS.md §8), in an arena drawn from
 * a bd_kvmem (bd_kvmem.h). The forward pass (bd_forward.h) fills it; this header makes,
 * inspects and frees it.
 *
 * Errors are -errno as bd_model.h says; functions taking ret_err (NULL or BD_MODEL_ERR_MAX
 * bytes) put a one-line message there on failure.
 */
#ifndef BD_SEQ_H
#define BD_SEQ_H

#include <stdint.h>

#include "quant/bd_attn_ref.h"
#include "quant/bd_kvcfg.h"
#include "model/bd_kvmem.h"
#include "model/bd_model.h"

#ifdef __cplusplus
extern "C" {
#endif

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
 * fp8_scales stay indexed by the global KV head. The slot is drawn from the kvmem now.
 * Returns 0, -EINVAL (NULL, max_tokens out of range, a mem whose layout does not match, a
 * shard of tp > 1 without an all-reduce), -ENOTSUP (a head dim the cache cannot hold),
 * -ENOMEM, or the kvmem's slot error; *ret only on success. */
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

/* Makes s, a new sequence that holds nothing yet, the view of a request whose KV was written
 * into s's kvmem before (by another process: a worker restarted after a failure rebuilds the
 * requests it serves from what kvpoold kept): n_tokens tokens, their full pages pages[n_pages]
 * in token order (n_pages = n_tokens / 128), their sink and recent tokens in the slot s drew at
 * bd_seq_new (an ext kvmem hands the named slot over as it is). The pages stay the caller's,
 * as with bd_seq_give_pages. For FP8 pages whose scales bd_seq_opts did not give, the scales
 * are read back from the first page. The next write continues at position n_tokens.
 * Returns 0, -EINVAL (NULL, s holds tokens or pages or failed, n_tokens outside 0..capacity,
 * n_pages ≠ n_tokens / 128, pages NULL with n_pages > 0), -ERANGE (a page id outside the
 * arena), -ENOMEM: nothing changes on failure. */
int bd_seq_resume(struct bd_seq *s, const int32_t *pages, int n_pages, int n_tokens);

/* The sequence's BF16 slot (NULL for NULL), and its block table: the pages promoted so far in
 * token order, *ret_pages valid until the next call on s. Returns the page count or -EINVAL. */
void *bd_seq_slot(const struct bd_seq *s);
int bd_seq_block_table(const struct bd_seq *s, const int32_t **ret_pages);

#ifdef __cplusplus
}
#endif
#endif
