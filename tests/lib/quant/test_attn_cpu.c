/* test_attn_cpu.c — the SIMD decode attention (bd_attn_cpu.h) against the reference decoder.
 *
 * Inputs as tests/gpu/gpu_check.c makes them (keys with a per-channel bias and outlier
 * channels, values with outlier channels, a calibrated-looking μ, peaked queries), written
 * through the real write path into a shuffled block table; the fast path is held to the GPU
 * kernels' tolerance against bd_ref_decode_gqa on the same inputs: relative L2 error ≤ 1e-3 per
 * (request, KV head) and |Δlse| ≤ 1e-3, on every instruction set this CPU has.
 */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <criterion/criterion.h>
#include <criterion/logging.h>

#include "base/bd_tpool.h"
#include "quant/bd_attn_cpu.h"
#include "quant/bd_attn_ref.h"
#include "testgen.h"

#define TOL 1e-3
#define N_LAYERS 2

/* A problem of N_LAYERS layers (testgen.h), its queries [Hkv][G][d] those of one layer. */
static void prob_build_v(struct tg_paged *P, const struct bd_kvcfg *cfg, int d, int Hkv, int G, int n,
			 uint64_t seed, bool unit_v)
{
	cr_assert_eq(tg_paged_build(P, cfg, N_LAYERS, Hkv, G, d, n, 3, Hkv, seed, unit_v), 0);
}

static void prob_build(struct tg_paged *P, const struct bd_kvcfg *cfg, int d, int Hkv, int G, int n,
		       uint64_t seed)
{
	prob_build_v(P, cfg, d, Hkv, G, n, seed, false);
}

/* The fast path over all KV heads in one call against the reference head by head; returns
 * the worst relative error, |Δlse| in *ret_lse. */
static double compare(const struct tg_paged *P, const struct bd_decode_params *dp, int layer,
		      double *ret_lse)
{
	size_t gd = (size_t)P->G * (size_t)P->d;
	float *o = malloc(sizeof(float) * gd * (size_t)P->Hkv);
	float *lse = malloc(sizeof(float) * (size_t)P->G * (size_t)P->Hkv);
	float *ro = malloc(sizeof(float) * gd), *rl = malloc(sizeof(float) * (size_t)P->G);
	struct bd_decode_stats sf = { 0, 0 }, sr = { 0, 0 };
	struct bd_kv_view kv = tg_paged_view(P, layer, 0);
	double worst = 0.0, wl = 0.0;

	cr_assert(o && lse && ro && rl);
	cr_assert_eq(bd_attn_cpu_decode_gqa(P->cfg, dp, &kv, P->Hkv, P->q, P->G, o, lse, &sf, NULL),
		     0);
	for (int h = 0; h < P->Hkv; h++) {
		struct bd_kv_view kh = tg_paged_view(P, layer, h);
		cr_assert_eq(bd_ref_decode_gqa(P->cfg, dp, &kh, P->q + (size_t)h * gd, P->G, ro, rl,
					       &sr),
			     0);
		double n2 = 0.0, d2 = 0.0;
		for (size_t i = 0; i < gd; i++) {
			double e = (double)o[(size_t)h * gd + i] - ro[i];
			n2 += e * e;
			d2 += (double)ro[i] * ro[i];
		}
		double rel = d2 > 0.0 ? sqrt(n2 / d2) : sqrt(n2);
		if (!(rel <= worst))
			worst = rel;
		for (int g = 0; g < P->G; g++) {
			double e = fabs((double)lse[h * P->G + g] - rl[g]);
			if (!(e <= wl))
				wl = e;
		}
	}
	/* the same blocks hold unmasked keys, whatever the rounding */
	cr_expect_eq(sf.p_blocks, sr.p_blocks, "%s: p_blocks %llu vs %llu", P->cfg->name,
		     (unsigned long long)sf.p_blocks, (unsigned long long)sr.p_blocks);
	free(o);
	free(lse);
	free(ro);
	free(rl);
	*ret_lse = wl;
	return worst;
}

static const char *const isas[] = { "avx512", "avx2" };

/* Every configuration with BF16 or FP4 pages, d 64 and 128, G 1, 4, 8, partial pages, tile
 * sizes and splits, on each instruction set. */
static void config_sweep(int d, int G, const int *lens, int nlens)
{
	static const int splits[] = { 1, 3, 7 };
	int ran = 0;

	/* every configuration, then those with FP4 P again under norm=qmass */
	for (int cv = 0; cv < 2 * BD_KVCFG_COUNT; cv++) {
		const int ci = cv % BD_KVCFG_COUNT;
		const struct bd_kvcfg *cfg = bd_kvcfg_get(ci);
		if (cv >= BD_KVCFG_COUNT) {
			if (cfg->p_quant == BD_P_FP32)
				continue;
			cfg = bd_kvcfg_variant(cfg, BD_NORM_QMASS);
		}
		if (cfg->page_fmt == BD_PAGE_FP8)
			continue;
		for (int li = 0; li < nlens; li++) {
			struct tg_paged P;
			uint64_t seed = 1000u + (uint64_t)cv * 31u + (uint64_t)li;
			prob_build(&P, cfg, d, 2, G, lens[li], seed);
			for (int ii = 0; ii < 2; ii++) {
				if (bd_attn_cpu_set_isa(isas[ii]) < 0)
					continue;
				for (int si = 0; si < 3; si++) {
					struct bd_decode_params dp = bd_decode_params_default();
					dp.n_splits = splits[si];
					/* tiles of 64, and of one P block (16; 32 for MXFP4 P) */
					if (si == 2)
						dp.tile_keys = cfg->p_quant == BD_P_MXFP4 ? 32 : 16;
					double el, e = compare(&P, &dp, (li + si) % N_LAYERS, &el);
					cr_expect(e <= TOL && el <= TOL,
						  "%s %s d=%d G=%d n=%d splits=%d tile=%d: rel %.3g "
						  "lse %.3g",
						  isas[ii], cfg->name, d, G, lens[li], dp.n_splits,
						  dp.tile_keys, e, el);
					ran++;
					if (getenv("BD_TEST_VERBOSE"))
						cr_log_info("%s %s d=%d G=%d n=%d sp=%d tile=%d "
							    "rel %.3g lse %.3g",
							    isas[ii], cfg->name, d, G, lens[li],
							    dp.n_splits, dp.tile_keys, e, el);
				}
			}
			tg_paged_free(&P);
		}
	}
	if (bd_attn_cpu_set_isa(isas[0]) < 0)
		(void)bd_attn_cpu_set_isa(isas[1]);
	if (ran == 0)
		cr_skip_test("no AVX2 on this CPU: the reference decoder is the path");
}

Test(attn_cpu, d64_g4_all_configs)
{
	static const int lens[] = { 1, 15, 130, 600 };
	config_sweep(64, 4, lens, 4);
}

Test(attn_cpu, d128_g8_all_configs)
{
	static const int lens[] = { 17, 385 };
	config_sweep(128, 8, lens, 2);
}

Test(attn_cpu, d64_g1_all_configs)
{
	static const int lens[] = { 144, 300 };
	config_sweep(64, 1, lens, 2);
}

/* A long context: many tiles per split, where small per-tile differences would accumulate. */
Test(attn_cpu, long_context_nvfp4_and_bf16)
{
	static const char *const names[] = { "bitdecoding-nvfp4", "bf16", "bitdecoding-mxfp4" };

	for (int i = 0; i < 3; i++) {
		struct tg_paged P;
		prob_build(&P, bd_kvcfg_find(names[i]), 64, 3, 3, 2100, 77u + (uint64_t)i);
		struct bd_decode_params dp = bd_decode_params_default();
		double el, e = compare(&P, &dp, 1, &el);
		cr_expect(e <= TOL && el <= TOL, "%s %s n=2100: rel %.3g lse %.3g",
			  bd_attn_cpu_isa(), names[i], e, el);
		tg_paged_free(&P);
	}
}

/* The instruction set in use is one that this CPU has — with BD_ATTN_ISA unset or "auto", the
 * widest one (the default) — and the FP4 and BF16 configurations have a SIMD path whenever it
 * is not the reference; "ref" opts out. */
Test(attn_cpu, isa_and_support)
{
	const char *isa = bd_attn_cpu_isa(), *env = getenv("BD_ATTN_ISA");
	bool simd = strcmp(isa, "ref") != 0;

	__builtin_cpu_init();
	const char *best = "ref";
	if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
		best = "avx2";
	if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
	    __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
		best = "avx512";
	if (!env || !*env || strcmp(env, "auto") == 0)
		cr_expect_str_eq(isa, best, "the default path");
	cr_expect(strcmp(isa, "avx512") == 0 || strcmp(isa, "avx2") == 0 || !simd);
	cr_expect_eq(bd_attn_cpu_supported(bd_kvcfg_find("bitdecoding-nvfp4")), simd);
	cr_expect_eq(bd_attn_cpu_supported(bd_kvcfg_find("bf16")), simd);
	cr_expect_not(bd_attn_cpu_supported(bd_kvcfg_find("fp8")));
	cr_expect_eq(bd_attn_cpu_set_isa("sse9"), -EINVAL);
	cr_expect_str_eq(bd_attn_cpu_isa(), isa, "a refused name leaves the path alone");
	cr_assert_eq(bd_attn_cpu_set_isa("ref"), 0);
	cr_expect_not(bd_attn_cpu_supported(bd_kvcfg_find("bitdecoding-nvfp4")));
	cr_expect_str_eq(bd_attn_cpu_isa(), "ref");
}

/* FP8 pages have no SIMD path: the call is the reference decoder's, bit for bit. */
Test(attn_cpu, fp8_is_the_reference)
{
	struct tg_paged P;
	struct bd_decode_params dp = bd_decode_params_default();
	prob_build(&P, bd_kvcfg_find("fp8"), 64, 2, 4, 300, 5);
	float o[2 * 4 * 64], ro[4 * 64];
	struct bd_kv_view kv = tg_paged_view(&P, 0, 0);

	cr_assert_eq(bd_attn_cpu_decode_gqa(P.cfg, &dp, &kv, 2, P.q, 4, o, NULL, NULL, NULL), 0);
	for (int h = 0; h < 2; h++) {
		struct bd_kv_view kh = tg_paged_view(&P, 0, h);
		cr_assert_eq(bd_ref_decode_gqa(P.cfg, &dp, &kh, P.q + h * 256, 4, ro, NULL, NULL), 0);
		cr_expect_arr_eq(o + h * 256, ro, sizeof(ro));
	}
	tg_paged_free(&P);
}

/* Bad calls are refused and leave the outputs alone. */
Test(attn_cpu, bad_inputs)
{
	struct tg_paged P;
	struct bd_decode_params dp = bd_decode_params_default();
	prob_build(&P, bd_kvcfg_find("bitdecoding-nvfp4"), 64, 2, 2, 200, 9);
	float o[2 * 2 * 64], lse[4];
	struct bd_kv_view kv = tg_paged_view(&P, 0, 1);

	for (size_t i = 0; i < 256; i++)
		o[i] = 7.0f;
	/* heads 1 and 2 of a layout with 2 */
	cr_expect_eq(bd_attn_cpu_decode_gqa(P.cfg, &dp, &kv, 2, P.q, 2, o, lse, NULL, NULL),
		     -EINVAL);
	kv.kv_head = 0;
	cr_expect_eq(bd_attn_cpu_decode_gqa(P.cfg, &dp, &kv, 0, P.q, 2, o, lse, NULL, NULL),
		     -EINVAL);
	dp.tile_keys = 24;
	cr_expect_eq(bd_attn_cpu_decode_gqa(P.cfg, &dp, &kv, 2, P.q, 2, o, lse, NULL, NULL),
		     -EINVAL);
	dp = bd_decode_params_default();
	P.q[70] = NAN;
	cr_expect_eq(bd_attn_cpu_decode_gqa(P.cfg, &dp, &kv, 2, P.q, 2, o, lse, NULL, NULL),
		     -EDOM);
	P.q[70] = 0.0f;
	P.bt[0] = (int32_t)P.lay.n_pages;
	cr_expect_eq(bd_attn_cpu_decode_gqa(P.cfg, &dp, &kv, 2, P.q, 2, o, lse, NULL, NULL),
		     -EINVAL);
	for (size_t i = 0; i < 256; i++)
		cr_expect_eq(o[i], 7.0f);
	tg_paged_free(&P);
}

/* A call long enough to be shared out over threads gives, group for group, the bytes of calls
 * that decode one group each on the caller's thread. */
Test(attn_cpu, threads_match_one_group_calls)
{
	struct tg_paged P;
	struct bd_decode_params dp = bd_decode_params_default();
	prob_build(&P, bd_kvcfg_find("bitdecoding-nvfp4"), 64, 4, 3, 2000, 21);
	float o[4 * 3 * 64], lse[12], o1[3 * 64], l1[3];
	struct bd_kv_view kv = tg_paged_view(&P, 1, 0);

	struct bd_tpool *pool;
	cr_assert_eq(bd_tpool_new(3, &pool), 0);
	cr_assert_eq(bd_attn_cpu_decode_gqa(P.cfg, &dp, &kv, 4, P.q, 3, o, lse, NULL, pool), 0);
	bd_tpool_free(pool);
	for (int h = 0; h < 4; h++) {
		struct bd_kv_view kh = tg_paged_view(&P, 1, h);
		cr_assert_eq(bd_attn_cpu_decode_gqa(P.cfg, &dp, &kh, 1, P.q + h * 192, 3, o1, l1,
						    NULL, NULL),
			     0);
		cr_expect_arr_eq(o + h * 192, o1, sizeof(o1), "group %d", h);
		cr_expect_arr_eq(lse + h * 3, l1, sizeof(l1), "group %d", h);
	}
	tg_paged_free(&P);
}

/* A decode call of SmolLM2 (bitdecoding-nvfp4, layer 15, a TP=2 worker's KV head 1, 9 query
 * heads over 3 KV heads) cut to one full page and one recent token: tests/data/quant/
 * attn_p_tie_nvfp4.bin holds the page-head's {g_K, g_V} (2 floats), its 9216 bytes (K and V
 * codes and scales), the 16 sink K rows, the 16 sink V rows, the recent K row and V row (BF16,
 * d 64) and the 3 query heads (floats), as the decoder read them. Query head 1 has a key whose
 * P / s_P is 5.0000029 with the reference's logits: an E2M1 tie, so logits a few ulps off move
 * that probability from 6·s_P to 4·s_P. The page logits must be the reference's: each FP4
 * query term's inner sum (exact: products of expanded codes) times its g_t, not a sum against
 * the terms folded into one FP32 query (1% relative error on this input with AVX-512). */
Test(attn_cpu, p_tie_of_a_model_call)
{
	enum { D = 64, G = 3, HEAD_BYTES = 9216 };
	char path[512];
	const char *root = getenv("BD_SRCDIR");
	struct bd_layout lay;
	const struct bd_kvcfg *cfg = bd_kvcfg_find("bitdecoding-nvfp4");
	struct bd_decode_params dp = bd_decode_params_default();
	int32_t bt[1] = { 0 };
	float q[G * D], o[G * D], ro[G * D], lse[G], rl[G];

	snprintf(path, sizeof(path), "%s/tests/data/quant/attn_p_tie_nvfp4.bin",
		 root && *root ? root : ".");
	FILE *f = fopen(path, "rb");
	cr_assert_not_null(f, "%s (run the tests from the repository root or set BD_SRCDIR)",
			   path);
	cr_assert_eq(bd_layout_init(&lay, BD_PAGE_NVFP4, 1, 1, D, 0, 1), 0);
	cr_assert_eq(lay.head_bytes, (size_t)HEAD_BYTES);
	uint8_t *arena = calloc(1, lay.arena_bytes), *slot = calloc(1, lay.slot_bytes);
	cr_assert(arena && slot);
	uint8_t *page = bd_layout_page(&lay, arena, 0, 0);
	bool ok = fread(page + lay.gscale_off, sizeof(float), 2, f) == 2 &&
		  fread(page, 1, HEAD_BYTES, f) == HEAD_BYTES &&
		  fread(bd_slot_sink_k(&lay, slot, 0, 0), sizeof(bd_bf16), 16 * D, f) == 16 * D &&
		  fread(bd_slot_sink_v(&lay, slot, 0, 0), sizeof(bd_bf16), 16 * D, f) == 16 * D &&
		  fread(bd_slot_recent_k(&lay, slot, 0, 0), sizeof(bd_bf16), D, f) == D &&
		  fread(bd_slot_recent_v(&lay, slot, 0, 0), sizeof(bd_bf16), D, f) == D &&
		  fread(q, sizeof(float), G * D, f) == G * D && fgetc(f) == EOF;
	fclose(f);
	cr_assert(ok, "%s: not the size this test reads", path);

	struct bd_kv_view kv = { .lay = &lay, .arena = arena, .block_table = bt, .slot = slot,
				 .layer = 0, .kv_head = 0, .n_tokens = BD_PAGE_TOKENS + 1 };
	cr_assert_eq(bd_ref_decode_gqa(cfg, &dp, &kv, q, G, ro, rl, NULL), 0);
	int ran = 0;
	for (int ii = 0; ii < 2; ii++) {
		if (bd_attn_cpu_set_isa(isas[ii]) < 0)
			continue;
		cr_assert_eq(bd_attn_cpu_decode_gqa(cfg, &dp, &kv, 1, q, G, o, lse, NULL, NULL), 0);
		double n2 = 0.0, d2 = 0.0, el = 0.0;
		for (int i = 0; i < G * D; i++) {
			n2 += ((double)o[i] - ro[i]) * ((double)o[i] - ro[i]);
			d2 += (double)ro[i] * ro[i];
		}
		for (int g = 0; g < G; g++)
			el = fmax(el, fabs((double)lse[g] - rl[g]));
		cr_expect(sqrt(n2 / d2) <= TOL && el <= TOL, "%s: rel %.3g lse %.3g", isas[ii],
			  sqrt(n2 / d2), el);
		ran++;
	}
	if (bd_attn_cpu_set_isa(isas[0]) < 0)
		(void)bd_attn_cpu_set_isa(isas[1]);
	free(arena);
	free(slot);
	if (ran == 0)
		cr_skip_test("no AVX2 on this CPU: the reference decoder is the path");
}

/* The page-partial normalization (NUMERICS.md §6 and the quantized-mass section): with q = 0
 * every logit is 0 and with V ≡ 1 (stored exactly in every format) the output of a convex
 * combination is 1. Under norm=qmass every configuration gives 1 within FP32 rounding, on the
 * reference and on each SIMD instruction set; under the paper's ℓ the configurations with
 * NVFP4 P give more than 1 (flat c·p = 8: s_P = E4M3(8/6) = 1.375, P̂ = 6, s_P·P̂ = 8.25 over a
 * mass of 8, diluted by the BF16 tokens), the others 1. */
static void unit_case(const struct bd_kvcfg *cfg, int n, int splits, int tile, float *ret_lo,
		      float *ret_hi)
{
	struct tg_paged P;
	const int G = 4, d = 64;
	size_t gd = (size_t)G * d;
	float *o = malloc(sizeof(float) * gd * 2), lse[8];
	struct bd_decode_params dp = bd_decode_params_default();

	cr_assert(o);
	dp.n_splits = splits;
	dp.tile_keys = tile;
	prob_build_v(&P, cfg, d, 2, G, n, 4242u + (uint64_t)n, true);
	*ret_lo = INFINITY;
	*ret_hi = -INFINITY;
	for (int path = 0; path < 3; path++) {
		if (path == 0) {
			for (int h = 0; h < 2; h++) {
				struct bd_kv_view kv = tg_paged_view(&P, 1, h);
				cr_assert_eq(bd_ref_decode_gqa(cfg, &dp, &kv, P.q + h * gd, G,
							       o + h * gd, lse, NULL),
					     0);
			}
		} else {
			if (!bd_attn_cpu_supported(cfg) || bd_attn_cpu_set_isa(isas[path - 1]) < 0)
				continue;
			struct bd_kv_view kv = tg_paged_view(&P, 1, 0);
			cr_assert_eq(bd_attn_cpu_decode_gqa(cfg, &dp, &kv, 2, P.q, G, o, lse, NULL,
							    NULL),
				     0);
		}
		for (size_t i = 0; i < gd * 2; i++) {
			*ret_lo = fminf(*ret_lo, o[i]);
			*ret_hi = fmaxf(*ret_hi, o[i]);
		}
	}
	if (bd_attn_cpu_set_isa(isas[0]) < 0)
		(void)bd_attn_cpu_set_isa(isas[1]);
	tg_paged_free(&P);
	free(o);
}

Test(attn_cpu, unit_values_give_one_under_qmass)
{
	static const int lens[] = { 17, 129, 300, 1024, 1025 };
	/* FP32 rounding of sums of up to 1024 terms and of the page and BF16 combine */
	const float tol = 8e-6f;

	for (int ci = 0; ci < BD_KVCFG_COUNT; ci++) {
		const struct bd_kvcfg *base = bd_kvcfg_get(ci);
		for (int nv = 0; nv < 2; nv++) {
			const struct bd_kvcfg *cfg = bd_kvcfg_variant(base, (enum bd_pnorm)nv);
			cr_assert(cfg);
			bool biased = cfg->p_norm == BD_NORM_L &&
				      (cfg->p_quant == BD_P_NVFP4_UNDERFLOW ||
				       cfg->p_quant == BD_P_NVFP4_MAX6);
			for (size_t li = 0; li < sizeof(lens) / sizeof(lens[0]); li++) {
				int tile = cfg->p_quant == BD_P_MXFP4 ? 32 : 16;
				for (int sp = 1; sp <= 3; sp += 2) {
					float lo, hi;
					unit_case(cfg, lens[li], sp, sp == 1 ? 64 : tile, &lo, &hi);
					if (biased && lens[li] > BD_PAGE_TOKENS) {
						cr_expect(lo > 1.01f && hi < 1.0313f,
							  "%s n=%d: [%.7f, %.7f], the paper's ℓ "
							  "keeps the P̂ mass bias",
							  cfg->name, lens[li], lo, hi);
					} else {
						cr_expect(fabsf(lo - 1.0f) <= tol &&
								  fabsf(hi - 1.0f) <= tol,
							  "%s n=%d splits=%d: [%.9f, %.9f]",
							  cfg->name, lens[li], sp, lo, hi);
					}
				}
			}
		}
	}
}
