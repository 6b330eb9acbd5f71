/* bd_qerr.h — the logit error split of the paper's error analysis (BitDecoding-FP4, arXiv
 * 2611.09825, section 3.1, Eq. 2), on a real cache.
 *
 * For a page (FP4-path) key and one query head, with q' and k' the unquantized transformed
 * FP32 query and key (k' = H(k − μ_k), q' = Hq as the configuration says, NUMERICS.md §3, §5)
 * and q̃', k̃' what decode actually multiplies (the dequantized query, summed over its terms,
 * and the dequantized page key), the natural-log logit error splits exactly as
 *
 *   S̃ − S = ⟨q̃', k̃'⟩·σ − ⟨q', k'⟩·σ = ⟨q', k̃' − k'⟩·σ + ⟨q̃' − q', k̃'⟩·σ
 *           (key part)             (query part)
 *
 * with σ the softmax scale (1/√d). Squaring: (S̃ − S)² = key² + query² + 2·key·query, so the
 * mean squared logit error differs from key_term + query_term only by the cross term, which is
 * also returned. `bdfp4 quant-report` uses this on synthetic problems, `bdfp4 eval-kl` on
 * real model KV.
 */
#ifndef BD_QERR_H
#define BD_QERR_H

#include <stdint.h>

#include "quant/bd_attn_ref.h"
#include "quant/bd_kvcfg.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Sums over (query head, page key) pairs; divide by n for means. All terms are squared
 * natural-log logit errors (units: nats²). */
struct bd_qerr_sums {
	uint64_t n;        /* pairs summed */
	double sq_err;     /* Σ (S̃ − S)² */
	double key_term;   /* Σ (⟨q', k̃' − k'⟩·σ)² */
	double query_term; /* Σ (⟨q̃' − q', k̃'⟩·σ)² */
	double cross_term; /* Σ 2·(⟨q', k̃' − k'⟩·σ)·(⟨q̃' − q', k̃'⟩·σ) */
};

/* The transformed FP32 vector the configuration works in: x' = H(x − μ) (NUMERICS.md §3), with
 * the subtraction only when cfg->smoothing and mu != NULL, the normalized Walsh–Hadamard
 * transform (bd_fwht) only when cfg->hadamard; otherwise a copy. This is the FP32 value the KV
 * write path rounds to BF16, so it is the unquantized reference k'. For a query pass mu = NULL
 * (queries are rotated, never smoothed: q' = Hq, §5).
 * x: [d], mu: [d] or NULL, ret_x: [d] (may alias x). d in 1..1024, a power of two when
 * cfg->hadamard. Returns 0, -EINVAL (NULL, bad d), -EDOM (non-finite x or mu; ret_x untouched). */
int bd_qerr_transform(const struct bd_kvcfg *cfg, const float *x, const float *mu, int d,
		      float *ret_x);

/* The query q̃' that multiplies page keys in decode: for FP4 pages (NVFP4, MXFP4) the sum in
 * FP32 of the dequantized terms of bd_query_quantize(q', cfg->query_terms terms) (one term, or
 * the dual residual q⁽¹⁾ + q⁽²⁾, §5); for the other pages (query_terms 0) q' rounded to BF16.
 * q_prime: [d] transformed FP32 query; ret_q: [d]. d a multiple of the FP4 block for FP4 pages,
 * ≤ 1024. Returns 0, -EINVAL (NULL, bad d, FP4 page with query_terms not 1 or 2), -EDOM
 * (non-finite q'; ret_q untouched). */
int bd_qerr_query(const struct bd_kvcfg *cfg, const float *q_prime, int d, float *ret_q);

/* Accumulate the logit error split of G query heads over the page keys of one GQA view: tokens
 * [0, 128·n_full) with n_full = (n_tokens − 1)/128 (bd_attn_ref.h), less the 16 sink tokens when
 * cfg->sink (they are decoded in BF16 and masked out of the page path). The BF16 recent and
 * sink tokens are not counted. Page keys are read fully dequantized (bd_page_read_head); every
 * dot product is in FP64.
 * q_prime: [G][d] transformed FP32 query heads (bd_qerr_transform); k_prime: [128·n_full][d]
 * transformed FP32 reference keys of the page tokens, token-major (rows of masked sink tokens
 * are read by nobody and may hold anything); softmax_scale: natural-log σ, 0 means 1/√d.
 * ret_sums: [G], head g's sums are added to ret_sums[g].
 * Returns 0; -EINVAL (NULL, G < 1, an MLA view, layout format not cfg's, bad view or block
 * table, negative or non-finite scale), -EDOM (non-finite q' or k'), -ENOMEM; on error
 * ret_sums is untouched. */
int bd_qerr_group(const struct bd_kvcfg *cfg, const struct bd_kv_view *kv, const float *q_prime,
		  int G, const float *k_prime, float softmax_scale, struct bd_qerr_sums *ret_sums);

/* a += b, field by field. */
void bd_qerr_sums_add(struct bd_qerr_sums *a, const struct bd_qerr_sums *b);

#ifdef __cplusplus
}
#endif
#endif
