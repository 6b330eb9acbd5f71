/* bd_seq_impl.h — the inside of a sequence, for the forward pass (forward.c) and seq.c only:
 * no other file includes it. The public face is bd_seq.h.
 */
#ifndef BD_SEQ_IMPL_H
#define BD_SEQ_IMPL_H

#include <stdbool.h>
#include <stdint.h>

#include "model/bd_seq.h"

struct bd_seq {
	const struct bd_model *m;
	const struct bd_kvcfg *cfg;
	struct bd_kvmem *mem;
	bool own_mem;
	const struct bd_layout *lay; /* &mem->lay */
	void *slot;
	int32_t *block_table; /* [max_pages + 1] (in pages[]) */
	uint8_t *drawn;       /* [max_pages + 1]: the page came from mem (freed with the sequence) */
	int n_full;           /* pages promoted */
	int max_pages;
	int32_t *given;       /* [max_pages + 1] pages handed in by bd_seq_give_pages */
	int n_given, given_next;
	int n_tokens, max_tokens;
	bool failed;          /* a forward pass failed after writing: every call is -EIO */
	float *mu;            /* [L][Hkv'][d] or NULL */
	float *fp8;           /* [L][layout heads][2] or NULL until known */
	struct bd_decode_params dp;
	struct bd_decode_stats stats;
	bd_kv_hook hook;
	void *hook_ctx;
	bd_model_allreduce_fn allreduce; /* NULL: one rank */
	void *allreduce_ctx;
	int32_t pages[];      /* block_table, then given, then drawn's bytes */
};

/* Write one position's K and V of layer l into the slot: k, v [Hkv'][d] post-RoPE FP32
 * (bd_kv_write_token per KV head, with the sequence's μ_k). Returns 0 or its error. */
int bd_seq_write_kv(struct bd_seq *s, int l, int pos, const float *k, const float *v);

/* The token just written completed a page: quantize the recent page into the next given page
 * or one drawn from the kvmem, and append it to the block table. Returns 0, -ENOSPC (the
 * block table is full, or the kvmem has no page), -ENOMEM, or bd_page_promote's error. */
int bd_seq_promote(struct bd_seq *s);

/* The KV of positions p .. p+n−1 of every layer (kall, vall: [L][n][Hkv'][d]) through s's
 * write path, position by position, promoting pages as they fill; s then holds p + n tokens
 * (it held p). A failure fails s (s->failed) and returns its error. */
int bd_seq_write_span(struct bd_seq *s, const float *kall, const float *vall, int p, int n);

/* What the write path would store for n positions of layer l, without touching s's cache:
 * K' = H(k − μ_k) as s's configuration says and V, BF16-rounded, as FP32 into ret_k, ret_v
 * [n][Hkv'][d] (the layout of k and v). scratch: lay.slot_head_bytes bytes, written. Returns 0
 * or bd_kv_write_token's error. */
int bd_seq_cache_rows(const struct bd_seq *s, int l, const float *k, const float *v, int n,
		      void *scratch, float *ret_k, float *ret_v);

/* The K' and V of layer l at positions 0 .. 128·n_full − 1 as s's decoder reads them, FP32
 * into ret_k, ret_v [128·n_full][Hkv'][d]: its promoted pages dequantized ((g·s)·x̂), and with
 * a configuration that keeps a sink, the first 16 positions from the BF16 sink. tk, tv:
 * scratch of 128·d floats each. Returns 0 or bd_page_read_head's error. */
int bd_seq_cache_context(const struct bd_seq *s, int l, float *tk, float *tv, float *ret_k,
			 float *ret_v);

#endif
