/* bd_layout.h — the memory layout of FP4 pages and BF16 slots (DESIGN.md "Memory layout").
 *
 * The one owner of where every KV byte lives. kvpoold sizes its arenas with it, workers and the
 * reference decoder read and write through it, and the CUDA kernels read what it writes.
 *
 * Arena: layer l of page p starts at arena + l·layer_stride + p·page_bytes. A page is 128
 * tokens of one layer; page ids are shared by all layers and TP ranks (a block table). Inside a
 * page, KV head h's region starts at h·head_bytes and holds, each region aligned to 128 bytes:
 *   K codes  token-major:  [128][d/2] bytes (element c of token t: nibble c%2 of byte t·d/2+c/2)
 *   K scales token-major:  [128][d/B] (E4M3 for NVFP4, UE8M0 for MXFP4; B = 16 or 32)
 *   V codes  channel-major: [d][128/2] (blocks run along tokens: token t of channel c in nibble
 *            t%2 of byte c·64 + t/2)
 *   V scales channel-major: [d][128/B]
 * followed, after all heads, by the page's FP32 decode scales g[n_kv_heads][2] = {g_K, g_V}.
 * Other formats use the same regions: BF16 pages hold K and V token-major [128][d] BF16 (no
 * scales), FP8 pages [128][d] E4M3 codes, the channel-blocked NVFP4 of trtllm-nvfp4 holds V
 * token-major like K. MLA pages (d_rope > 0, one latent head) hold the latent C in the K regions
 * and the BF16 positional part [128][d_rope] in the V-codes region; they have no V.
 *
 * A BF16 slot holds one running request's sink and recent tokens. Per (layer, KV head), at
 * (l·n_kv_heads + h)·slot_head_bytes: sink K' [16][d], sink V [16][dv], recent K' [128][d],
 * recent V [128][dv], BF16 token-major; dv = d (d_rope for MLA). K' = H(k − μ_k) as the
 * configuration says (NUMERICS.md §3); token at position pos sits at recent row pos % 128 and,
 * when pos < 16, also at sink row pos.
 */
#ifndef BD_LAYOUT_H
#define BD_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "quant/bd_fp4.h"
#include "quant/bd_kvcfg.h"

#ifdef __cplusplus
extern "C" {
#endif

#define BD_PAGE_TOKENS 128
#define BD_SINK_TOKENS 16
#define BD_RECENT_TOKENS 128
#define BD_REGION_ALIGN 128 /* every region of a page-head starts on this boundary */
#define BD_PAGE_ALIGN 256   /* page_bytes and slot_head_bytes are multiples of this */

struct bd_layout {
	enum bd_page_format fmt;
	int n_layers, n_kv_heads;
	int d;      /* head dim of K (latent dim d_c for MLA) */
	int d_rope; /* MLA positional dim; 0 for GQA */
	int dv;     /* columns of the slot's V rows: d for GQA, d_rope for MLA */
	int block;  /* FP4 block: 16 (NVFP4), 32 (MXFP4); 0 for BF16 and FP8 */

	/* offsets and sizes inside one page-head, bytes */
	size_t k_codes_off, k_codes_bytes;
	size_t k_scales_off, k_scales_bytes;
	size_t v_codes_off, v_codes_bytes;
	size_t v_scales_off, v_scales_bytes;
	size_t head_bytes;

	size_t gscale_off;   /* offset of float g[n_kv_heads][2] inside a page */
	size_t page_bytes;   /* one layer of one page */
	size_t n_pages;
	size_t layer_stride; /* n_pages · page_bytes */
	size_t arena_bytes;  /* n_layers · layer_stride */

	size_t slot_sink_k_off, slot_sink_v_off, slot_recent_k_off, slot_recent_v_off;
	size_t slot_head_bytes; /* one (layer, KV head) of a slot */
	size_t slot_bytes;      /* one request: n_layers · n_kv_heads · slot_head_bytes */
};

/* Compute the geometry for a model of n_layers, n_kv_heads of dim d (d_rope > 0 for MLA, then
 * n_kv_heads must be 1) and an arena of n_pages pages, in format fmt.
 * d must be a multiple of 32 and ≤ 1024 (a power of two when the configuration rotates keys);
 * d_rope a multiple of 16 or 0. Returns 0, -EINVAL on a bad argument, -EOVERFLOW if the arena
 * size does not fit in size_t. */
int bd_layout_init(struct bd_layout *ret, enum bd_page_format fmt, int n_layers, int n_kv_heads,
		   int d, int d_rope, size_t n_pages);

/* Layer `layer` of page `page` inside an arena laid out by lay (no bounds check beyond
 * asserting the indices in debug builds: callers validate page ids). */
static inline uint8_t *bd_layout_page(const struct bd_layout *lay, void *arena, int layer,
				      int32_t page)
{
	return (uint8_t *)arena + (size_t)layer * lay->layer_stride +
	       (size_t)page * lay->page_bytes;
}

/* Pointers into a request's BF16 slot for (layer, KV head): [16][d], [16][dv], [128][d],
 * [128][dv] BF16 rows. */
bd_bf16 *bd_slot_sink_k(const struct bd_layout *lay, void *slot, int layer, int kv_head);
bd_bf16 *bd_slot_sink_v(const struct bd_layout *lay, void *slot, int layer, int kv_head);
bd_bf16 *bd_slot_recent_k(const struct bd_layout *lay, void *slot, int layer, int kv_head);
bd_bf16 *bd_slot_recent_v(const struct bd_layout *lay, void *slot, int layer, int kv_head);

/* The KV write path for one token of one (layer, KV head): k' = H(k − μ) as cfg says (FP32,
 * NUMERICS.md §3), rounded to BF16, stored at recent row pos % 128 and, when pos < 16, at sink
 * row pos. k: [d] post-RoPE key (latent c for MLA); v: [dv] value (BF16 positional part for
 * MLA, not transformed); mu: [d] or NULL (zero). Returns 0, -EINVAL, -EDOM (non-finite k, v or
 * mu: nothing is written). */
int bd_kv_write_token(const struct bd_layout *lay, const struct bd_kvcfg *cfg, void *slot,
		      int layer, int kv_head, int pos, const float *k, const float *v,
		      const float *mu);

/* Quantize 128 tokens of one KV head into its region of a page (layer base `page`) and its
 * decode scales: K token-wise (scale search if cfg->key_search), V along tokens (standard
 * rule), g_K and g_V = amax/(6·256) over the page-head (NVFP4). k: [128][d] BF16 K'; v:
 * [128][dv] BF16. fp8_scale: {s_K, s_V} for FP8 pages (codes = E4M3(x / s)), else ignored.
 * Returns 0, -EINVAL, -EDOM (non-finite: the page is left untouched). */
int bd_page_write_head(const struct bd_layout *lay, const struct bd_kvcfg *cfg,
		       const bd_bf16 *k, const bd_bf16 *v, const float fp8_scale[2], void *page,
		       int kv_head);

/* Read one KV head of a page back as FP32: ret_k [128][d], ret_v [128][dv] token-major.
 * With ret_g == NULL the values are fully dequantized ((g·s)·x̂); with ret_g they are expanded
 * without the page decode scale (s·x̂, the FP16-exact values a Hopper kernel multiplies) and
 * ret_g[2] = {g_K, g_V} (1 for formats without one). Returns 0 or -EINVAL. */
int bd_page_read_head(const struct bd_layout *lay, const void *page, int kv_head, float *ret_k,
		      float *ret_v, float *ret_g);

/* Promotion (NUMERICS.md §8): quantize the full recent page of a slot, every layer and KV head,
 * into page `page` of the arena. fp8_scales: [n_layers][n_kv_heads][2] for FP8, else NULL.
 * Returns 0, -EINVAL, -EDOM (a non-finite value: the pages already written are not rolled
 * back, the caller frees the page). */
int bd_page_promote(const struct bd_layout *lay, const struct bd_kvcfg *cfg,
		    const float *fp8_scales, void *slot, void *arena, int32_t page);

#ifdef __cplusplus
}
#endif
#endif
