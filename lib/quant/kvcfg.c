/* kvcfg.c — the table of NUMERICS.md §9. */
#include <stddef.h>
#include <string.h>

#include "quant/bd_kvcfg.h"

/* Full NVFP4 recipe: smoothing + Hadamard + search keys, dual residual query, underflow-aware
 * P, 16 BF16 sink tokens. Ablations drop one part of it. */
#define RECIPE(nm, smooth, had, search)                                                          \
	{ .name = nm, .page_fmt = BD_PAGE_NVFP4, .smoothing = smooth, .hadamard = had,          \
	  .key_search = search, .query_terms = 2, .p_quant = BD_P_NVFP4_UNDERFLOW, .sink = true }

static const struct bd_kvcfg configs[BD_KVCFG_COUNT] = {
	[BD_KVCFG_BF16] = { .name = "bf16", .page_fmt = BD_PAGE_BF16, .p_quant = BD_P_FP32 },
	[BD_KVCFG_FP8] = { .name = "fp8", .page_fmt = BD_PAGE_FP8, .p_quant = BD_P_FP32 },
	[BD_KVCFG_TRTLLM_NVFP4] = { .name = "trtllm-nvfp4", .page_fmt = BD_PAGE_NVFP4_CH,
				    .p_quant = BD_P_FP32 },
	[BD_KVCFG_NVFP4_BASE] = { .name = "nvfp4-base", .page_fmt = BD_PAGE_NVFP4,
				  .query_terms = 1, .p_quant = BD_P_NVFP4_MAX6 },
	[BD_KVCFG_DUAL] = { .name = "+dual", .page_fmt = BD_PAGE_NVFP4, .query_terms = 2,
			    .p_quant = BD_P_NVFP4_MAX6 },
	[BD_KVCFG_PSCALE] = { .name = "+pscale", .page_fmt = BD_PAGE_NVFP4, .query_terms = 2,
			      .p_quant = BD_P_NVFP4_UNDERFLOW },
	[BD_KVCFG_KEYQUANT] = { .name = "+keyquant", .page_fmt = BD_PAGE_NVFP4, .smoothing = true,
				.hadamard = true, .key_search = true, .query_terms = 2,
				.p_quant = BD_P_NVFP4_UNDERFLOW },
	[BD_KVCFG_BITDECODING_NVFP4] = RECIPE("bitdecoding-nvfp4", true, true, true),
	[BD_KVCFG_BITDECODING_MXFP4] = { .name = "bitdecoding-mxfp4", .page_fmt = BD_PAGE_MXFP4,
					 .smoothing = true, .hadamard = true, .key_search = true,
					 .query_terms = 2, .p_quant = BD_P_MXFP4, .sink = true },
	[BD_KVCFG_NO_SMOOTHING] = RECIPE("-smoothing", false, true, true),
	[BD_KVCFG_NO_HADAMARD] = RECIPE("-hadamard", true, false, true),
	[BD_KVCFG_NO_SEARCH] = RECIPE("-search", true, true, false),
};

const struct bd_kvcfg *bd_kvcfg_get(int i)
{
	if (i < 0 || i >= BD_KVCFG_COUNT)
		return NULL;
	return &configs[i];
}

const struct bd_kvcfg *bd_kvcfg_find(const char *name)
{
	if (!name)
		return NULL;
	for (int i = 0; i < BD_KVCFG_COUNT; i++)
		if (strcmp(configs[i].name, name) == 0)
			return &configs[i];
	return NULL;
}

bool bd_kvcfg_is_fp4(const struct bd_kvcfg *cfg)
{
	return cfg && (cfg->page_fmt == BD_PAGE_NVFP4 || cfg->page_fmt == BD_PAGE_MXFP4 ||
		       cfg->page_fmt == BD_PAGE_NVFP4_CH);
}
