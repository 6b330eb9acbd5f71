/* bd_forward.h — the decoder's forward pass on the CPU over a sequence's bdfp4 KV cache.
 *
 * Prefill runs BF16-style causal attention over the prompt (FP32 compute over BF16-rounded
 * post-RoPE K and V), then writes the prompt's KV through the same write path decoding uses
 * (bd_kv_write_token, bd_page_promote). Decode attention is bd_ref_decode_gqa() per
 * (layer, KV head) group with the G query heads of that group. Matrix products go through
 * OpenBLAS. The model (bd_model.h) is read only; each call changes only its sequences
 * (bd_seq.h), so threads may run different sequences of one model at once.
 *
 * Shapes and errors as bd_model.h says. A failure after a forward pass began to write the cache
 * leaves the sequence unusable: every later call on it returns -EIO.
 */
#ifndef BD_FORWARD_H
#define BD_FORWARD_H

#include <stdint.h>

#include "model/bd_model.h"
#include "model/bd_seq.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- building blocks (exported for tests and the other backends) --------------------------- */

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

/* ---- prefill and decode -------------------------------------------------------------------- */

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

/* Prefill the next chunk of a prompt: tokens [n] at positions p .. p+n−1 of a sequence that
 * holds p = bd_seq_n_tokens(s) tokens, p a multiple of 128 (whole pages: the chunk reads its
 * context from promoted pages and the sink only, never a recent row its own write replaces, so
 * a chunk run again after a failure reads what the first run read). p = 0 is
 * bd_model_prefill. For p > 0, a query at position p+i attends, BF16-style as the prefill
 * does (FP32 scores, softmax and P·V), over
 *   - the context 0 .. p−1 as the cache holds it, which is what decode reads: the keys
 *     K' = H(k − μ_k) of the configuration and the values, from the FP4 pages dequantized
 *     ((g·s)·x̂) and, with a sink, positions 0..15 from the BF16 sink;
 *   - the chunk's own positions p .. p+i, as the write path will store them (K' and V rounded
 *     to BF16),
 * with the query rotated as the decoder rotates it (q' = Hq), so that q'·K' = q·(k − μ_k): the
 * shift by q·μ_k is the same for every key of a query, which softmax removes. So the result
 * equals the unchunked bd_model_prefill of tokens 0 .. p+n−1 at those positions exactly in real
 * arithmetic when the pages are BF16 and keys are neither smoothed nor rotated (configuration
 * "bf16": only FP32 summation order differs), and otherwise differs by what the FP4 (or FP8)
 * pages lose of the context's K' and V, the same loss decode sees (tests/lib/model/
 * test_prefill_chunk.c bounds it on the embedded model). Then the chunk's KV goes through the
 * write path (sink, pages promoted into the given pages as they fill, recent), after the pass
 * as bd_model_prefill does: an all-reduce error or non-finite activations leave s holding p
 * tokens, unchanged. ret_logits, errors and the rest as bd_model_prefill: -EINVAL (NULL, n < 1,
 * a bad token id, another model's sequence, p not a multiple of 128), -ENOSPC (p + n beyond the
 * capacity: nothing changes), -EIO (s failed before). */
int bd_model_prefill_chunk(const struct bd_model *m, struct bd_seq *s, const int32_t *tokens,
			   int n, float *ret_logits);

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

/* How bd_model_decode_batch_mode computes a batch's weight products. */
enum bd_batch_mode {
	/* one matrix–matrix product per weight for all rows (bd_model_decode_batch): the weights
	 * are read once per step, but OpenBLAS blocks the product by the number of rows, so a
	 * row's sums, and its last bits, depend on the batch it is in */
	BD_BATCH_FAST = 0,
	/* batch-invariant: one matrix–vector product per row and weight, in the order of the
	 * one-row product, so every row's logits are bit for bit those of bd_model_decode on the
	 * same sequence, whatever the batch and the row's place in it (every other part of a
	 * decode step is per row already: norms, RoPE, the row's own decode attention and split-KV
	 * plan, which depend on its sequence only, and the all-reduce, which adds the ranks in rank
	 * order per element). Costs reading the weights once per row. */
	BD_BATCH_INVARIANT = 1,
};

/* bd_model_decode_batch with the products computed as mode says; BD_BATCH_FAST is
 * bd_model_decode_batch. Same arguments, results and errors, and -EINVAL for an unknown mode
 * (nothing runs). */
int bd_model_decode_batch_mode(const struct bd_model *m, struct bd_seq *const *seqs,
			       const int32_t *tokens, int n, float *ret_logits, int *ret_status,
			       enum bd_batch_mode mode);

/* ---- generation ---------------------------------------------------------------------------- */

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
	const struct bd_decode_params *dp; /* as bd_seq_opts (a calibrated τ), or NULL */
};

/* Prompt tokens bd_generate() prefills at once: a longer prompt goes in chunks of this many
 * (bd_model_prefill, then bd_model_prefill_chunk; a multiple of 128), which bounds the
 * prefill's scratch, and reads the context of each later chunk from the cache as decode does. */
#define BD_GEN_PREFILL_CHUNK 1024

/* Generate from a prompt (a whole model: -EINVAL for a shard of tp > 1): a sequence of the
 * configuration sized prompt + max_tokens, prefill (in chunks of BD_GEN_PREFILL_CHUNK tokens),
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
