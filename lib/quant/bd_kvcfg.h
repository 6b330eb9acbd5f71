/* bd_kvcfg.h — the KV-cache configurations of NUMERICS.md section 9, by name.
 *
 * One table owns what each configuration does to keys, values, queries and probabilities; the
 * page writer, the reference decoder, the kernels and the tools all read it from here.
 */
#ifndef BD_KVCFG_H
#define BD_KVCFG_H

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

/* How a page stores the K and V of one KV head (the layout is bd_layout.h's). */
enum bd_page_format {
	BD_PAGE_BF16 = 0,   /* K, V BF16, token-major */
	BD_PAGE_FP8 = 1,    /* K, V E4M3 token-major, one FP32 scale per (layer, KV head) */
	BD_PAGE_NVFP4_CH = 2, /* trtllm-nvfp4: K and V NVFP4 in blocks along channels */
	BD_PAGE_NVFP4 = 3,  /* K token-wise NVFP4, V NVFP4 blocked along tokens (paper §3.3, §4) */
	BD_PAGE_MXFP4 = 4,  /* the same with MXFP4 blocks of 32 and UE8M0 scales */
	BD_PAGE_FORMAT_COUNT
};

/* The short name of a page format ("nvfp4", "mxfp4", "nvfp4-ch", "fp8", "bf16"; "?" for a
 * value outside the enum): what kvpoold's stats report and what the prefix-cache hashes of
 * pool/bd_prefix.h name the page bytes by. */
const char *bd_page_format_name(enum bd_page_format fmt);

/* How decode quantizes the probabilities P before P·V (NUMERICS.md §6). */
enum bd_pquant {
	BD_P_FP32 = 0,          /* unquantized */
	BD_P_NVFP4_MAX6 = 1,    /* NVFP4 blocks of 16 keys, c = 1, κ = 6 ("standard max/6") */
	BD_P_NVFP4_UNDERFLOW = 2, /* NVFP4, underflow-aware: c = 8, κ ∈ {2, 6} by τ */
	BD_P_MXFP4 = 3,         /* MXFP4 blocks of 32 keys, OCP rule, c = 1 */
};

/* What the page path divides its partial output by (NUMERICS.md §6; the page-partial
 * normalization section). The LSE is always log2 ℓ, from the unquantized P. */
enum bd_pnorm {
	BD_NORM_L = 0,     /* o_split = Σ s_P·P̂·Ṽ / ℓ (the paper's Algorithm 1, line 11) */
	BD_NORM_QMASS = 1, /* o_split = Σ s_P·P̂·Ṽ / Σ s_P·P̂: a convex combination of the values */
};

struct bd_emul; /* bd_kvemul.h: eval-time emulated K/V formats (NULL for every served one) */

struct bd_kvcfg {
	const char *name;
	enum bd_page_format page_fmt;
	bool smoothing;   /* keys written as k − μ_k (§3) */
	bool hadamard;    /* keys written as H(·), queries rotated q' = Hq (§3, §5) */
	bool key_search;  /* key blocks use the scale search (§2) */
	int query_terms;  /* 0: query stays BF16; 1: one FP4 term; 2: dual residual (§5) */
	enum bd_pquant p_quant;
	bool sink;        /* the first 16 tokens stay in BF16 and are masked out of the FP4 path */
	enum bd_pnorm p_norm; /* the page partial's normalization ("NAME:norm=qmass") */
	const struct bd_emul *emul; /* bd_kvemul.h; NULL outside eval-kl's research runs */
};

enum {
	BD_KVCFG_BF16 = 0,
	BD_KVCFG_FP8,
	BD_KVCFG_TRTLLM_NVFP4,
	BD_KVCFG_NVFP4_BASE,
	BD_KVCFG_DUAL,
	BD_KVCFG_PSCALE,
	BD_KVCFG_KEYQUANT,
	BD_KVCFG_BITDECODING_NVFP4,
	BD_KVCFG_BITDECODING_MXFP4,
	BD_KVCFG_NO_SMOOTHING, /* "-smoothing": the full NVFP4 recipe without μ_k */
	BD_KVCFG_NO_HADAMARD,  /* "-hadamard" */
	BD_KVCFG_NO_SEARCH,    /* "-search" */
	BD_KVCFG_BDFP4_MXFP4,  /* "bdfp4-mxfp4": bitdecoding-mxfp4 with norm=qmass */
	BD_KVCFG_COUNT
};

/* The configuration with index i in 0..BD_KVCFG_COUNT-1 (the enum above), or NULL. */
const struct bd_kvcfg *bd_kvcfg_get(int i);

/* The configuration named name (exactly as NUMERICS.md §9 writes it: "bf16", "fp8",
 * "trtllm-nvfp4", "nvfp4-base", "+dual", "+pscale", "+keyquant", "bitdecoding-nvfp4",
 * "bitdecoding-mxfp4", "-smoothing", "-hadamard", "-search", "bdfp4-mxfp4"),
 * optionally followed by a normalization knob, ":norm=l" or ":norm=qmass" (the configuration
 * with that p_norm: bd_kvcfg_variant), or NULL when unknown. */
const struct bd_kvcfg *bd_kvcfg_find(const char *name);

/* The configuration cfg (one of the table's, or a variant of one) with the page-partial
 * normalization norm, named "NAME:norm=qmass" (or NAME itself when norm is the table entry's
 * own); NULL when cfg is not a table configuration or norm is unknown. The variants are static
 * objects: pointers compare equal for equal (configuration, norm). */
const struct bd_kvcfg *bd_kvcfg_variant(const struct bd_kvcfg *cfg, enum bd_pnorm norm);

/* True when pages of this configuration hold FP4 codes (NVFP4 or MXFP4, either layout). */
bool bd_kvcfg_is_fp4(const struct bd_kvcfg *cfg);

#ifdef __cplusplus
}
#endif
#endif
