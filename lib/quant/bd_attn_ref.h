/* bd_attn_ref.h — the CPU reference decoder: decode attention over FP4 pages, BF16 sink and recent
 * tokens, for every configuration of NUMERICS.md §9 (GQA, paper Algorithm 1; MLA, Algorithm 2),
 * plus an FP64 exact attention to measure error against.
 *
 * This is the oracle the kernels are tested against, so it follows the kernel's structure
 * exactly: keys in tiles of B_k, online softmax in the exp2 domain (γ = log2(e)·softmax_scale),
 * P quantized in blocks of 16 (32) keys inside a tile, split-KV over contiguous tile ranges, the
 * BF16 tokens as a separate partial, and the LSE combine. Values are expanded to s·x̂ (exact in
 * FP16) and the page decode scales are applied per tile, as a Hopper kernel does.
 *
 * Token positions of a request with n tokens: pages hold tokens [0, 128·n_full) with
 * n_full = (n − 1) / 128, so the recent slot holds the n − 128·n_full ∈ [1, 128] newest tokens
 * (a page is promoted after the step that fills it). With cfg->sink the first 16 tokens are read
 * from the sink in BF16 and masked out of the page path.
 */
#ifndef BD_ATTN_REF_H
#define BD_ATTN_REF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "quant/bd_fp4.h"
#include "quant/bd_kvcfg.h"
#include "quant/bd_layout.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Tiling and numeric parameters of one decode call. */
struct bd_decode_params {
	int tile_keys;       /* B_k: a multiple of the P block (16; 32 for MXFP4) dividing 128 */
	int n_splits;        /* ≥ 1 splits of the page tiles; more splits than tiles leaves some empty */
	float softmax_scale; /* natural-log scale; 0 means 1/sqrt(d) (GQA) */
	float tau;           /* underflow threshold τ, default 21/1024 (§6, calibrated §7) */
	float c;             /* probability scale c, default 8 (used by BD_P_NVFP4_UNDERFLOW) */
};

/* The defaults: B_k = 64, 1 split, 1/sqrt(d), τ = 21/1024, c = 8. */
struct bd_decode_params bd_decode_params_default(void);

/* One request's KV for one (layer, KV head), as a decode step sees it. */
struct bd_kv_view {
	const struct bd_layout *lay;
	const void *arena;          /* the arena the block table indexes */
	const int32_t *block_table; /* [≥ n_full] page ids of the request's full pages */
	const void *slot;           /* the request's BF16 slot */
	int layer, kv_head;
	int n_tokens;               /* context length, ≥ 1, including the token being decoded */
};

/* The full pages of a view, (n_tokens − 1) / 128 (the page of the token being decoded is never
 * full), in *ret_n_full; 0, or -EINVAL when there are full pages and no arena or block table,
 * or a block-table entry is outside 0..kv->lay->n_pages − 1. kv and kv->lay must be set, and
 * n_tokens ≥ 1. */
int bd_kv_view_full_pages(const struct bd_kv_view *kv, int *ret_n_full);

/* Counters a decode call adds to (for quant-report and eval-kl). */
struct bd_decode_stats {
	uint64_t p_blocks;      /* probability blocks with at least one unmasked key */
	uint64_t p_zero_blocks; /* of those, blocks whose scale code underflowed to 0 */
};

/* Decode attention of one GQA group: G query heads q [G][d] (post-RoPE, FP32, unrotated) over
 * the view. Per configuration: q' = Hq if cfg->hadamard; FP4 pages use the dual-residual (or
 * one-term) FP4 query, S = ((⟨ŝq1, ŝk⟩·g_q1 + ⟨ŝq2, ŝk⟩·g_q2)·g_K)·γ in that FP32 order, with
 * ŝ = s·x̂ (kernels apply the scales in the same order); BF16, FP8
 * and channel-blocked pages use q' rounded to BF16; the BF16 tokens use q' rounded to BF16 and
 * FP32 P. P is quantized per cfg->p_quant (§6); each split's page partial is divided by ℓ or,
 * with cfg->p_norm = BD_NORM_QMASS, by the quantized mass Σ s_P·P̂ (NUMERICS.md, page-partial
 * normalization), its LSE from ℓ either way.
 * ret_o: [G][d] (dv = d; in the value space, which is never rotated); ret_lse: [G] log2-domain
 * log-sum-exp of γ·logits, or NULL; stats: added to, or NULL.
 * Returns 0, -EINVAL (bad params, view or shapes), -EDOM (non-finite q). */
int bd_ref_decode_gqa(const struct bd_kvcfg *cfg, const struct bd_decode_params *dp,
		      const struct bd_kv_view *kv, const float *q, int G, float *ret_o,
		      float *ret_lse, struct bd_decode_stats *stats);

/* Decode attention of MLA (Algorithm 2) for H query heads over one latent view (lay->d_rope > 0):
 * q_c [H][d_c] absorbed latent queries, q_r [H][d_rope] positional queries; logits
 * γ·(⟨q̃_c, c̃⟩ + ⟨q_r, k_r⟩) with the positional part in BF16 and the latent part as in GQA;
 * P·C in FP16 (P rounded to FP16, C̃ dequantized), FP32 accumulation. mu: [d_c] the latent
 * mean the cache was written with (or NULL) — the output is mapped back to the latent space,
 * o = Hᵀ o' + μ. softmax_scale must be set (1/sqrt(d_qk) of the model).
 * ret_o: [H][d_c]. Returns 0, -EINVAL, -EDOM. */
int bd_ref_decode_mla(const struct bd_kvcfg *cfg, const struct bd_decode_params *dp,
		      const struct bd_kv_view *kv, const float *q_c, const float *q_r, int H,
		      const float *mu, float *ret_o, float *ret_lse, struct bd_decode_stats *stats);

/* The checks of a decode call both CPU decoders make (GQA; with mla, MLA): cfg, dp, kv and its
 * layout and slot given; the layout of cfg's page format with 0 < d ≤ BD_FWHT_MAX, GQA
 * (d_rope 0, dv = d) or MLA (d_rope > 0, dv = d_rope, KV head 0); 1 ≤ n_tokens, layer and
 * kv_head inside the layout; n_splits ≥ 1; tile_keys a positive multiple of the P block that
 * divides 128; c finite and > 0, tau finite and ≥ 0, softmax_scale finite (nonzero for MLA);
 * 1 or 2 query terms on FP4 pages. Returns 0 or -EINVAL. */
int bd_decode_check(const struct bd_kvcfg *cfg, const struct bd_decode_params *dp,
		    const struct bd_kv_view *kv, bool mla);

/* The FP4 page tiles of split s (0 ≤ s < n_splits) of a context with n_tiles full tiles:
 * [*ret_begin, *ret_end), ceil(n_tiles / n_splits) tiles per split (at least 1), so the last
 * splits are shorter or empty (NUMERICS.md §6, split-KV). Computed in 64 bits: n_tiles +
 * n_splits and s · chunk may exceed INT_MAX. */
void bd_split_tiles(int n_tiles, int n_splits, int s, int *ret_begin, int *ret_end);

/* The BF16 tokens of kv_head's slot (n tokens in all, n_full of them in full pages) that the
 * decoders attend in BF16, in their order (NUMERICS.md §8): with sink, tokens 0 ..
 * min(n, BD_SINK_TOKENS) − 1 from the sink rows; then tokens max(n_full·128, sink ?
 * BD_SINK_TOKENS : 0) .. n − 1 from the recent ring (row t mod BD_RECENT_TOKENS). K rows hold d
 * elements, V rows dv. Writes each token's K and V row to ret_k[i], ret_v[i] (room for
 * BD_SINK_TOKENS + BD_RECENT_TOKENS each) and returns the count. */
int bd_slot_rows(const struct bd_layout *lay, void *slot, int layer, int kv_head, int n,
		 int n_full, bool sink, int d, int dv, const bd_bf16 **ret_k,
		 const bd_bf16 **ret_v);

/* Log-sum-exp combine of n partial results (split-KV): o_s [n][d] normalized partial outputs,
 * lse_s [n] their log2-domain LSE (−inf for an empty partial). o = Σ w_s o_s / Σ w_s with
 * w_s = exp2(lse_s − max lse). ret_o [d]; ret_lse the combined LSE (−inf and o = 0 if all
 * partials are empty). */
void bd_lse_combine(const float *o_s, const float *lse_s, int n, int d, float *ret_o,
		    float *ret_lse);

/* Exact attention in FP64: o = softmax(scale · K q) V for one query head. q [d], k [n][d],
 * v [n][dv], scale natural-log (0 → 1/sqrt(d)). ret_o: [dv] doubles. Returns 0 or -EINVAL. */
int bd_attn_exact_f64(const float *q, const float *k, const float *v, int n, int d, int dv,
		      double scale, double *ret_o);

#ifdef __cplusplus
}
#endif
#endif
