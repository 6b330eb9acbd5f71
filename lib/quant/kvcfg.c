/* kvcfg.c — the table of NUMERICS.md §9. */
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
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
	/* the paper's MXFP4 recipe with the page partial divided by the quantized mass: its
	 * page partials become convex combinations of the values (bench/RESULTS.md: lower KL) */
	[BD_KVCFG_BDFP4_MXFP4] = { .name = "bdfp4-mxfp4", .page_fmt = BD_PAGE_MXFP4,
				   .smoothing = true, .hadamard = true, .key_search = true,
				   .query_terms = 2, .p_quant = BD_P_MXFP4, .sink = true,
				   .p_norm = BD_NORM_QMASS },
};

const char *bd_page_format_name(enum bd_page_format fmt)
{
	switch (fmt) {
	case BD_PAGE_BF16: return "bf16";
	case BD_PAGE_FP8: return "fp8";
	case BD_PAGE_NVFP4_CH: return "nvfp4-ch";
	case BD_PAGE_NVFP4: return "nvfp4";
	case BD_PAGE_MXFP4: return "mxfp4";
	default: return "?";
	}
}

const struct bd_kvcfg *bd_kvcfg_get(int i)
{
	if (i < 0 || i >= BD_KVCFG_COUNT)
		return NULL;
	return &configs[i];
}

/* Every table configuration under each normalization: variants[n][i] is configs[i] with
 * p_norm n, named configs[i].name, or "NAME:norm=KNOB" when n is not configs[i]'s own. */
#define NORM_COUNT 2
#define VARIANT_NAME_MAX 48
static const char *const norm_knob[NORM_COUNT] = { [BD_NORM_L] = "l", [BD_NORM_QMASS] = "qmass" };
static struct bd_kvcfg variants[NORM_COUNT][BD_KVCFG_COUNT];
static char variant_names[NORM_COUNT][BD_KVCFG_COUNT][VARIANT_NAME_MAX];
static pthread_once_t variants_once = PTHREAD_ONCE_INIT;

static void variants_init(void)
{
	for (int n = 0; n < NORM_COUNT; n++) {
		for (int i = 0; i < BD_KVCFG_COUNT; i++) {
			variants[n][i] = configs[i];
			variants[n][i].p_norm = (enum bd_pnorm)n;
			if (configs[i].p_norm == (enum bd_pnorm)n)
				continue;
			snprintf(variant_names[n][i], VARIANT_NAME_MAX, "%s:norm=%s",
				 configs[i].name, norm_knob[n]);
			variants[n][i].name = variant_names[n][i];
		}
	}
}

/* The table index of cfg, a table entry or one of its variants, or -1. */
static int table_index(const struct bd_kvcfg *cfg)
{
	for (int i = 0; i < BD_KVCFG_COUNT; i++) {
		if (cfg == &configs[i])
			return i;
		for (int n = 0; n < NORM_COUNT; n++)
			if (cfg == &variants[n][i])
				return i;
	}
	return -1;
}

const struct bd_kvcfg *bd_kvcfg_variant(const struct bd_kvcfg *cfg, enum bd_pnorm norm)
{
	int i = cfg ? table_index(cfg) : -1;

	if (i < 0 || (int)norm < 0 || (int)norm >= NORM_COUNT)
		return NULL;
	if (configs[i].p_norm == norm)
		return &configs[i];
	pthread_once(&variants_once, variants_init);
	return &variants[norm][i];
}

const struct bd_kvcfg *bd_kvcfg_find(const char *name)
{
	if (!name)
		return NULL;
	const char *colon = strchr(name, ':');
	size_t len = colon ? (size_t)(colon - name) : strlen(name);
	int n = -1;
	if (colon) {
		for (int k = 0; k < NORM_COUNT; k++)
			if (strncmp(colon + 1, "norm=", 5) == 0 && strcmp(colon + 6, norm_knob[k]) == 0)
				n = k;
		if (n < 0)
			return NULL;
	}
	for (int i = 0; i < BD_KVCFG_COUNT; i++)
		if (strlen(configs[i].name) == len && strncmp(configs[i].name, name, len) == 0)
			return n < 0 ? &configs[i] : bd_kvcfg_variant(&configs[i], (enum bd_pnorm)n);
	return NULL;
}

bool bd_kvcfg_is_fp4(const struct bd_kvcfg *cfg)
{
	return cfg && (cfg->page_fmt == BD_PAGE_NVFP4 || cfg->page_fmt == BD_PAGE_MXFP4 ||
		       cfg->page_fmt == BD_PAGE_NVFP4_CH);
}
