/* test_mma_sm100.c — the sm_100 kernel's operand packing and its CPU emulation
 * (quant/bd_mma_sm100.h): where the bytes go, the block-scaled MMA on hand-worked cases, and
 * page → packing → emulated MMA → softmax → output against the reference decoder.
 *
 * The emulated decoder uses the reference's FP32 operations in the reference's order, and every
 * MMA product is exact, so its outputs and LSEs must equal bd_ref_decode_gqa's bit for bit.
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <criterion/criterion.h>
#include <criterion/logging.h>

#include "quant/bd_attn_ref.h"
#include "quant/bd_mma_sm100.h"
#include "testgen.h"

/* E4M3 codes: 1.0 = 0x38, 2.0 = 0x40, 0.5 = 0x30, 2^-9 = 0x01; E2M1 codes: 0.5 = 1, 1.0 = 2,
 * 1.5 = 3, 6 = 7, −1 = 10; UE8M0: 1.0 = 127 */
enum { E4M3_1 = 0x38, E4M3_2 = 0x40, E4M3_HALF = 0x30, UE8M0_1 = 127 };

/* ---- placement ---------------------------------------------------------------------------- */

Test(mma_sm100, tile_offsets_hand_worked)
{
	/* 64-byte rows (SWIZZLE_64B): chunk c of row r at chunk c ^ ((r >> 1) & 3) */
	cr_assert_eq(bd_umma_off(64, 0, 0), 0);
	cr_assert_eq(bd_umma_off(64, 1, 17), 64 + 16 + 1);
	cr_assert_eq(bd_umma_off(64, 2, 0), 2 * 64 + 16);
	cr_assert_eq(bd_umma_off(64, 5, 40), 5 * 64 + 16 * (2 ^ 2) + 8);
	cr_assert_eq(bd_umma_off(64, 7, 63), 7 * 64 + 15);
	cr_assert_eq(bd_umma_off(64, 9, 16), 9 * 64 + 16);  /* row 9: like row 1 */
	cr_assert_eq(bd_umma_off(64, 127, 0), 127 * 64 + 48);
	/* 32-byte rows (SWIZZLE_32B): chunk c of row r at chunk c ^ ((r >> 2) & 1) */
	cr_assert_eq(bd_umma_off(32, 3, 5), 3 * 32 + 5);
	cr_assert_eq(bd_umma_off(32, 4, 0), 4 * 32 + 16);
	cr_assert_eq(bd_umma_off(32, 4, 16), 4 * 32);
	cr_assert_eq(bd_umma_off(32, 12, 31), 12 * 32 + 15);

	/* every (row, byte) of a 128-row tile lands on its own byte */
	for (uint32_t rb = 32; rb <= 64; rb *= 2) {
		uint8_t *seen = calloc(128 * rb, 1);
		cr_assert(seen);
		for (uint32_t r = 0; r < 128; r++)
			for (uint32_t j = 0; j < rb; j++) {
				uint32_t o = bd_umma_off(rb, r, j);
				cr_assert(o < 128 * rb && !seen[o], "rb %u row %u byte %u", rb, r, j);
				seen[o] = 1;
			}
		free(seen);
	}
}

Test(mma_sm100, scale_offsets_hand_worked)
{
	cr_assert_eq(bd_umma_sf_off(0, 0), 0);
	cr_assert_eq(bd_umma_sf_off(0, 3), 3);
	cr_assert_eq(bd_umma_sf_off(1, 0), 16);
	cr_assert_eq(bd_umma_sf_off(32, 0), 4);
	cr_assert_eq(bd_umma_sf_off(33, 2), 16 + 4 + 2);
	cr_assert_eq(bd_umma_sf_off(96, 1), 12 + 1);
	cr_assert_eq(bd_umma_sf_off(5, 4), 512 + 5 * 16);
	cr_assert_eq(bd_umma_sf_off(127, 7), 512 + 31 * 16 + 3 * 4 + 3);
	cr_assert_eq(bd_umma_sf_bytes(2), 512);
	cr_assert_eq(bd_umma_sf_bytes(8), 1024);
	cr_assert_eq(bd_umma_qrow(3, 0), 3);
	cr_assert_eq(bd_umma_qrow(3, 1), 11);

	uint8_t seen[1024] = { 0 };
	for (uint32_t r = 0; r < 128; r++)
		for (uint32_t s = 0; s < 8; s++) {
			uint32_t o = bd_umma_sf_off(r, s);
			cr_assert(o < 1024 && !seen[o], "row %u scale %u", r, s);
			seen[o] = 1;
		}
}

/* ---- packing round trips -------------------------------------------------------------------- */

static void fill_bytes(uint8_t *p, size_t n, uint64_t seed)
{
	struct tg_rng r = { seed };
	for (size_t i = 0; i < n; i++)
		p[i] = (uint8_t)tg_next(&r);
}

/* every code and scale of the page-head reads back from the tiles; rows a region lacks are 0 */
static void page_round_trip(enum bd_page_format fmt, int d)
{
	struct bd_layout lay;
	struct bd_umma_sizes z;

	cr_assert_eq(bd_layout_init(&lay, fmt, 1, 2, d, 0, 1), 0);
	cr_assert_eq(bd_umma_sizes(&lay, &z), 0);
	cr_assert_eq(z.k_tile, 128 * (size_t)d / 2);
	cr_assert_eq(z.v_tile, 128 * 64);
	cr_assert_eq(z.k_sf, (size_t)bd_umma_sf_bytes((uint32_t)(d / lay.block)));
	uint8_t *page = malloc(lay.page_bytes), *kt = malloc(z.k_tile), *ksf = malloc(z.k_sf);
	uint8_t *vt = malloc(z.v_tile), *vsf = malloc(z.v_sf);
	cr_assert(page && kt && ksf && vt && vsf);
	fill_bytes(page, lay.page_bytes, (uint64_t)d * 31 + (uint64_t)fmt);
	const uint8_t *head = page + lay.head_bytes; /* KV head 1 */
	cr_assert_eq(bd_umma_pack_k(&lay, head, kt, ksf), 0);
	cr_assert_eq(bd_umma_pack_v(&lay, head, vt, vsf), 0);

	const int kb = lay.block, nk = d / kb, nv = 128 / kb;
	for (int t = 0; t < 128; t++) {
		for (int c = 0; c < d; c++)
			cr_assert_eq(bd_umma_code(kt, (uint32_t)d / 2, (uint32_t)t, (uint32_t)c),
				     bd_fp4_get(head + lay.k_codes_off + (size_t)t * (size_t)d / 2, (size_t)c),
				     "K key %d channel %d", t, c);
		for (int s = 0; s < nk; s++)
			cr_assert_eq(ksf[bd_umma_sf_off((uint32_t)t, (uint32_t)s)],
				     head[lay.k_scales_off + (size_t)t * (size_t)nk + (size_t)s]);
	}
	for (int c = 0; c < 128; c++) {
		for (int t = 0; t < 128; t++) {
			uint8_t want = c < d ? bd_fp4_get(head + lay.v_codes_off + (size_t)c * 64, (size_t)t) : 0;
			cr_assert_eq(bd_umma_code(vt, 64, (uint32_t)c, (uint32_t)t), want,
				     "V channel %d key %d", c, t);
		}
		for (int s = 0; s < nv; s++)
			cr_assert_eq(vsf[bd_umma_sf_off((uint32_t)c, (uint32_t)s)],
				     c < d ? head[lay.v_scales_off + (size_t)c * (size_t)nv + (size_t)s] : 0);
	}
	/* the scale bytes an instruction does not read stay zero (MXFP4 d = 64: half a chunk) */
	if (fmt == BD_PAGE_MXFP4 && d == 64)
		for (int t = 0; t < 128; t++)
			cr_assert_eq(ksf[bd_umma_sf_off((uint32_t)t, 2)] | ksf[bd_umma_sf_off((uint32_t)t, 3)], 0);
	free(page);
	free(kt);
	free(ksf);
	free(vt);
	free(vsf);
}

Test(mma_sm100, page_packing_round_trip)
{
	page_round_trip(BD_PAGE_NVFP4, 128);
	page_round_trip(BD_PAGE_NVFP4, 64);
	page_round_trip(BD_PAGE_MXFP4, 128);
	page_round_trip(BD_PAGE_MXFP4, 64);
}

Test(mma_sm100, query_and_p_packing)
{
	struct bd_layout lay;
	struct bd_umma_sizes z;
	struct bd_qquant qq[3];
	float q[128];
	uint8_t qt[16 * 64], qsf[1024], pt[16 * 64], psf[1024], codes[128], sc[8];
	struct tg_rng r = { 77 };

	cr_assert_eq(bd_layout_init(&lay, BD_PAGE_NVFP4, 1, 1, 128, 0, 1), 0);
	cr_assert_eq(bd_umma_sizes(&lay, &z), 0);
	for (int h = 0; h < 3; h++) {
		tg_fill_gauss(&r, q, 128, 1.0f);
		cr_assert_eq(bd_query_quantize(q, 128, BD_FP4_NVFP4, h == 1 ? 1 : 2, &qq[h]), 0);
	}
	memset(qt, 0xee, sizeof(qt));
	cr_assert_eq(bd_umma_pack_query(&lay, qq, 3, qt, qsf), 0);
	for (int row = 0; row < 16; row++) {
		const int h = row % 8, t = row / 8;
		const bool used = h < 3 && t < qq[h].nterms;
		for (int c = 0; c < 128; c++)
			cr_assert_eq(bd_umma_code(qt, 64, (uint32_t)row, (uint32_t)c),
				     used ? bd_fp4_get(qq[h].codes[t], (size_t)c) : 0, "row %d channel %d", row, c);
		for (int s = 0; s < 8; s++)
			cr_assert_eq(qsf[bd_umma_sf_off((uint32_t)row, (uint32_t)s)], used ? qq[h].scales[t][s] : 0);
	}
	cr_assert_eq(bd_umma_pack_query(&lay, qq, 9, qt, qsf), -EINVAL);
	qq[2].d = 64;
	cr_assert_eq(bd_umma_pack_query(&lay, qq, 3, qt, qsf), -EINVAL);

	memset(pt, 0, sizeof(pt));
	memset(psf, 0, sizeof(psf));
	for (int k = 0; k < 128; k++)
		codes[k] = (uint8_t)((k * 5 + 1) & 7);
	for (int s = 0; s < 8; s++)
		sc[s] = (uint8_t)(0x30 + s);
	bd_umma_pack_p_row(&lay, 5, codes, sc, pt, psf);
	for (int k = 0; k < 128; k++) {
		cr_assert_eq(bd_umma_code(pt, 64, 5, (uint32_t)k), codes[k]);
		cr_assert_eq(bd_umma_code(pt, 64, 4, (uint32_t)k), 0);
	}
	for (int s = 0; s < 8; s++)
		cr_assert_eq(psf[bd_umma_sf_off(5, (uint32_t)s)], 0x30 + s);
	cr_assert_eq(psf[bd_umma_sf_off(6, 0)], 0);
}

/* ---- the instruction ------------------------------------------------------------------------ */

/* A 128 × 64-byte tile and a 16 × 64-byte tile with their scale tiles, for hand-built cases. */
struct hand {
	uint8_t a[128 * 64], b[16 * 64], sfa[1024], sfb[1024];
	float d[128 * 16];
};

static void set_code(uint8_t *tile, uint32_t r, uint32_t k, uint8_t code)
{
	uint8_t *p = &tile[bd_umma_off(64, r, k / 2)];
	*p = (uint8_t)(k & 1 ? (*p & 0x0f) | code << 4 : (*p & 0xf0) | code);
}

static void run(struct hand *x, enum bd_fp4_format fmt, int kb, int acc)
{
	struct bd_umma_mma op = { fmt, x->a, x->b, 64, 64, x->sfa, x->sfb, kb, 16, acc };
	bd_umma_emulate(&op, x->d);
}

Test(mma_sm100, emulate_nvfp4_hand_worked)
{
	struct hand *x = calloc(1, sizeof(*x));
	cr_assert(x);
	for (uint32_t k = 0; k < 128; k++) {
		set_code(x->a, 0, k, 2);                  /* row 0: 1.0 everywhere */
		set_code(x->a, 1, k, k & 1 ? 10 : 1);     /* row 1: +0.5 even, −1 odd */
		set_code(x->a, 2, k, 7);                  /* row 2: 6 */
		for (uint32_t n = 0; n < 16; n++)
			set_code(x->b, n, k, n == 0 ? 2 : 3); /* B: 1.0 in row 0, 1.5 elsewhere */
	}
	for (uint32_t s = 0; s < 8; s++) {
		x->sfa[bd_umma_sf_off(0, s)] = (uint8_t)(E4M3_1 + 8 * s); /* 2^s per block */
		x->sfa[bd_umma_sf_off(1, s)] = E4M3_1;
		x->sfa[bd_umma_sf_off(2, s)] = 0x01;                       /* 2^-9 */
		for (uint32_t n = 0; n < 16; n++)
			x->sfb[bd_umma_sf_off(n, s)] = n == 3 ? E4M3_2 : E4M3_1;
	}
	run(x, BD_FP4_NVFP4, 0, 0);
	/* row 0 × column 0: 16 · (1 + 2 + 4 + 8) */
	cr_assert_eq(x->d[0 * 16 + 0], 240.0f);
	/* column 3 has B = 1.5 · 2: 240 · 3 */
	cr_assert_eq(x->d[0 * 16 + 3], 720.0f);
	/* row 1: 32 · 0.5 − 32 · 1 against 1.0 */
	cr_assert_eq(x->d[1 * 16 + 0], -16.0f);
	/* row 2: 64 · 6 · 2^-9 · 1.5 */
	cr_assert_eq(x->d[2 * 16 + 5], 64.0f * 6.0f * 0x1p-9f * 1.5f);
	/* rows of zeros give +0 */
	cr_assert_eq(x->d[100 * 16 + 0], 0.0f);
	cr_assert(!signbit(x->d[100 * 16 + 0]));

	/* the second k-block reads elements 64..127 and scales 4..7, and accumulates */
	run(x, BD_FP4_NVFP4, 1, 1);
	cr_assert_eq(x->d[0 * 16 + 0], 240.0f + 16.0f * (16 + 32 + 64 + 128));
	run(x, BD_FP4_NVFP4, 1, 0);
	cr_assert_eq(x->d[0 * 16 + 0], 16.0f * (16 + 32 + 64 + 128));
	free(x);
}

Test(mma_sm100, emulate_sums_in_ascending_k)
{
	struct hand *x = calloc(1, sizeof(*x));
	cr_assert(x);
	/* k = 0 (block 0, scales 448): 6·448 × 6·448 = 7225344, where the FP32 ulp is 0.5; then
	 * the 48 products 0.5 × 0.5 = 0.25 of blocks 1–3, each a tie that rounds back to the large
	 * sum when added to it in turn; summed small-first they would add 12 */
	set_code(x->a, 0, 0, 7);
	set_code(x->b, 0, 0, 7);
	for (uint32_t k = 16; k < 64; k++) {
		set_code(x->a, 0, k, 1);
		set_code(x->b, 0, k, 1);
	}
	x->sfa[bd_umma_sf_off(0, 0)] = x->sfb[bd_umma_sf_off(0, 0)] = 0x7e; /* 448 */
	for (uint32_t s = 1; s < 4; s++)
		x->sfa[bd_umma_sf_off(0, s)] = x->sfb[bd_umma_sf_off(0, s)] = E4M3_1;
	run(x, BD_FP4_NVFP4, 0, 0);
	cr_assert_eq(x->d[0], 7225344.0f, "got %.2f", x->d[0]);
	free(x);
}

Test(mma_sm100, emulate_mxfp4_hand_worked)
{
	struct hand *x = calloc(1, sizeof(*x));
	cr_assert(x);
	for (uint32_t k = 0; k < 128; k++) {
		set_code(x->a, 7, k, 3);  /* 1.5 */
		set_code(x->b, 2, k, 4);  /* 2.0 */
	}
	/* UE8M0 per 32 elements: row 7's blocks 2^0, 2^1, 2^-2, 2^5; B's 2^0 */
	const int ea[4] = { 0, 1, -2, 5 };
	for (uint32_t s = 0; s < 4; s++) {
		x->sfa[bd_umma_sf_off(7, s)] = (uint8_t)(UE8M0_1 + ea[s]);
		x->sfb[bd_umma_sf_off(2, s)] = UE8M0_1;
	}
	run(x, BD_FP4_MXFP4, 0, 0); /* k-block 0: scales 0 and 1 (bytes 0–1 of the word) */
	cr_assert_eq(x->d[7 * 16 + 2], 32.0f * 3.0f * (1.0f + 2.0f));
	run(x, BD_FP4_MXFP4, 1, 0); /* k-block 1: scales 2 and 3 (bytes 2–3) */
	cr_assert_eq(x->d[7 * 16 + 2], 32.0f * 3.0f * (0.25f + 32.0f));
	cr_assert_eq(x->d[7 * 16 + 1], 0.0f);
	free(x);
}

/* ---- page → packing → emulated MMA → softmax → output, against the reference ---------------- */

enum { LAYERS = 2, HEADS = 2 };

struct prob {
	const struct bd_kvcfg *cfg;
	struct bd_layout lay;
	int n, d;
	void *arena, *slot;
	int32_t *bt;
	float *mu; /* [LAYERS][HEADS][d] */
};

/* token p of every (layer, head): Gaussian keys with a few ×15 outlier channels and a
 * per-channel offset, values around a per-head offset */
static void write_token(struct prob *P, struct tg_rng *r, int p)
{
	float k[128], v[128];

	for (int l = 0; l < LAYERS; l++) {
		for (int h = 0; h < HEADS; h++) {
			const float *mu = P->mu + ((size_t)l * HEADS + (size_t)h) * (size_t)P->d;
			for (int c = 0; c < P->d; c++) {
				k[c] = mu[c] + tg_gauss(r) * (c % 29 == 3 ? 15.0f : 1.0f);
				v[c] = 0.5f * (float)(h + 1) + tg_gauss(r);
			}
			cr_assert_eq(bd_kv_write_token(&P->lay, P->cfg, P->slot, l, h, p, k, v,
						       P->cfg->smoothing ? mu : NULL),
				     0);
		}
	}
}

static void prob_build(struct prob *P, const char *cfgname, int d, int n, uint64_t seed)
{
	const int pages = n / BD_PAGE_TOKENS + 2;
	struct tg_rng r = { seed };

	memset(P, 0, sizeof(*P));
	P->cfg = bd_kvcfg_find(cfgname);
	cr_assert(P->cfg, "%s", cfgname);
	P->n = n;
	P->d = d;
	cr_assert_eq(bd_layout_init(&P->lay, P->cfg->page_fmt, LAYERS, HEADS, d, 0, (size_t)pages), 0);
	P->arena = calloc(1, P->lay.arena_bytes);
	P->slot = calloc(1, P->lay.slot_bytes);
	P->bt = malloc(sizeof(int32_t) * (size_t)pages);
	P->mu = malloc(sizeof(float) * LAYERS * HEADS * (size_t)d);
	cr_assert(P->arena && P->slot && P->bt && P->mu);
	for (int i = 0; i < pages; i++)
		P->bt[i] = pages - 1 - i; /* pages far from their positions */
	tg_fill_gauss(&r, P->mu, LAYERS * HEADS * (size_t)d, 0.8f);
	for (int p = 0; p < n; p++) {
		write_token(P, &r, p);
		if (p % BD_PAGE_TOKENS == BD_PAGE_TOKENS - 1 && p + 1 < n)
			cr_assert_eq(bd_page_promote(&P->lay, P->cfg, NULL, P->slot, P->arena,
						     P->bt[p / BD_PAGE_TOKENS]),
				     0);
	}
}

static void prob_free(struct prob *P)
{
	free(P->arena);
	free(P->slot);
	free(P->bt);
	free(P->mu);
}

/* Every (layer, KV head) of the problem with G query heads and n_splits: the emulated decode
 * equals the reference's outputs and LSEs bit for bit. */
static void match_case(struct prob *P, int G, int n_splits, uint64_t seed)
{
	struct bd_decode_params dp = bd_decode_params_default();
	float q[8 * 128], o_ref[8 * 128], o_emu[8 * 128], l_ref[8], l_emu[8];
	struct tg_rng r = { seed };

	dp.tile_keys = BD_PAGE_TOKENS;
	dp.n_splits = n_splits;
	for (int l = 0; l < LAYERS; l++) {
		for (int h = 0; h < HEADS; h++) {
			struct bd_kv_view kv = { &P->lay, P->arena, P->bt, P->slot, l, h, P->n };
			tg_fill_gauss(&r, q, (size_t)G * (size_t)P->d, 1.5f);
			cr_assert_eq(bd_ref_decode_gqa(P->cfg, &dp, &kv, q, G, o_ref, l_ref, NULL), 0);
			memset(o_emu, 0xff, sizeof(o_emu));
			cr_assert_eq(bd_umma_decode_gqa(P->cfg, &dp, &kv, q, G, o_emu, l_emu), 0);
			for (int i = 0; i < G * P->d; i++)
				cr_assert(memcmp(&o_emu[i], &o_ref[i], sizeof(float)) == 0,
					  "%s d=%d G=%d n=%d splits=%d layer %d head %d: o[%d] %.9g vs %.9g",
					  P->cfg->name, P->d, G, P->n, n_splits, l, h, i, o_emu[i], o_ref[i]);
			cr_assert(memcmp(l_emu, l_ref, sizeof(float) * (size_t)G) == 0,
				  "%s d=%d G=%d n=%d: LSE %.9g vs %.9g", P->cfg->name, P->d, G, P->n,
				  l_emu[0], l_ref[0]);
			cr_assert(isfinite(o_emu[0]) && isfinite(l_emu[0]));
		}
	}
}

static void match_config(const char *cfgname)
{
	/* lengths: BF16 only (1, 16, 17: sink and recent), one page and a partial one (129: the
	 * sink's page copy masked with sink on), several pages with a partial last (300, 1025) */
	static const int lens[] = { 1, 16, 17, 129, 300, 1025 };
	static const int Gs[] = { 1, 4, 8 };

	for (int di = 0; di < 2; di++) {
		const int d = di ? 128 : 64;
		for (size_t li = 0; li < sizeof(lens) / sizeof(lens[0]); li++) {
			struct prob P;
			prob_build(&P, cfgname, d, lens[li], 1000 + (uint64_t)li * 7 + (uint64_t)d);
			for (size_t gi = 0; gi < sizeof(Gs) / sizeof(Gs[0]); gi++)
				match_case(&P, Gs[gi], gi == 1 ? 3 : 1, 99 + gi);
			prob_free(&P);
		}
	}
}

Test(mma_sm100, decode_bitdecoding_nvfp4_matches_reference, .timeout = 120)
{
	match_config("bitdecoding-nvfp4");
}

Test(mma_sm100, decode_nvfp4_base_matches_reference, .timeout = 120)
{
	match_config("nvfp4-base");
}

Test(mma_sm100, decode_bitdecoding_mxfp4_matches_reference, .timeout = 120)
{
	match_config("bitdecoding-mxfp4");
}

/* The page partials divided by the quantized mass (the MMA's P̂ codes and scales) */
Test(mma_sm100, decode_qmass_matches_reference, .timeout = 120)
{
	match_config("bitdecoding-nvfp4:norm=qmass");
	match_config("bdfp4-mxfp4");
}

/* The emulation is not the reference by another name: a wrong byte in one packed page changes
 * its result, and restoring it restores the reference's bits. */
Test(mma_sm100, decode_reads_the_packed_page)
{
	struct prob P;
	struct bd_decode_params dp = bd_decode_params_default();
	float q[4 * 128], o_ref[4 * 128], o_emu[4 * 128];
	struct tg_rng r = { 5 };

	dp.tile_keys = BD_PAGE_TOKENS;
	prob_build(&P, "bitdecoding-nvfp4", 128, 300, 4242);
	tg_fill_gauss(&r, q, 4 * 128, 1.0f);
	struct bd_kv_view kv = { &P.lay, P.arena, P.bt, P.slot, 1, 1, P.n };
	cr_assert_eq(bd_ref_decode_gqa(P.cfg, &dp, &kv, q, 4, o_ref, NULL, NULL), 0);
	uint8_t *vbyte = bd_layout_page(&P.lay, P.arena, 1, P.bt[1]) + P.lay.head_bytes +
			 P.lay.v_codes_off + 5 * 64 + 20;
	const uint8_t keep = *vbyte;
	*vbyte ^= 0x77;
	cr_assert_eq(bd_umma_decode_gqa(P.cfg, &dp, &kv, q, 4, o_emu, NULL), 0);
	cr_assert(memcmp(o_emu, o_ref, sizeof(o_ref)) != 0);
	*vbyte = keep;
	cr_assert_eq(bd_umma_decode_gqa(P.cfg, &dp, &kv, q, 4, o_emu, NULL), 0);
	cr_assert(memcmp(o_emu, o_ref, sizeof(o_ref)) == 0);
	prob_free(&P);
}

Test(mma_sm100, decode_refusals)
{
	struct prob P;
	struct bd_decode_params dp = bd_decode_params_default();
	float q[9 * 64] = { 0 }, o[9 * 64];

	dp.tile_keys = BD_PAGE_TOKENS;
	prob_build(&P, "bitdecoding-nvfp4", 64, 200, 3);
	struct bd_kv_view kv = { &P.lay, P.arena, P.bt, P.slot, 0, 0, P.n };
	cr_assert_eq(bd_umma_decode_gqa(P.cfg, &dp, &kv, q, 4, o, NULL), 0);
	cr_assert_eq(bd_umma_decode_gqa(P.cfg, &dp, &kv, q, 9, o, NULL), -EOPNOTSUPP);
	cr_assert_eq(bd_umma_decode_gqa(P.cfg, &dp, &kv, q, 0, o, NULL), -EINVAL);
	cr_assert_eq(bd_umma_decode_gqa(P.cfg, &dp, &kv, NULL, 4, o, NULL), -EINVAL);
	cr_assert_eq(bd_umma_decode_gqa(bd_kvcfg_find("+keyquant"), &dp, &kv, q, 4, o, NULL), 0);
	cr_assert_eq(bd_umma_decode_gqa(bd_kvcfg_find("bitdecoding-mxfp4"), &dp, &kv, q, 4, o, NULL),
		     -EINVAL); /* the view's pages are NVFP4 */
	dp.tile_keys = 64;
	cr_assert_eq(bd_umma_decode_gqa(P.cfg, &dp, &kv, q, 4, o, NULL), -EOPNOTSUPP);
	dp.tile_keys = BD_PAGE_TOKENS;
	q[7] = NAN;
	cr_assert_eq(bd_umma_decode_gqa(P.cfg, &dp, &kv, q, 4, o, NULL), -EDOM);
	prob_free(&P);

	struct bd_layout lay;
	struct bd_umma_sizes z;
	cr_assert_eq(bd_layout_init(&lay, BD_PAGE_BF16, 1, 1, 128, 0, 1), 0);
	cr_assert_eq(bd_umma_sizes(&lay, &z), -EOPNOTSUPP);
	cr_assert_eq(bd_layout_init(&lay, BD_PAGE_NVFP4, 1, 1, 256, 0, 1), 0);
	cr_assert_eq(bd_umma_sizes(&lay, &z), -EOPNOTSUPP);
}
