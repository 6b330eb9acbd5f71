/* test_layout.c — page and slot geometry, KV write path, page round trips and promotion
 * (bd_layout.h). Expected sizes are derived by hand from the layout rules in the comments;
 * expected page bytes come from the block quantizers of bd_fp4.h applied here with the test's
 * own indexing, so a misplaced nibble, block or region fails. */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant/bd_fp4.h"
#include "quant/bd_kvcfg.h"
#include "quant/bd_layout.h"
#include "testgen.h"

/* ---- helpers ---------------------------------------------------------------------------- */

/* rows × cols BF16 normal values; channels that are multiples of `outlier_every` (if > 0) are
 * scaled by `gain`, like the outlier channels of real keys. */
static void fill_bf16(bd_bf16 *x, size_t rows, size_t cols, uint64_t seed, size_t outlier_every,
		      float gain)
{
	struct tg_rng s = { seed };

	for (size_t r = 0; r < rows; r++)
		for (size_t c = 0; c < cols; c++) {
			float f = tg_gauss(&s);

			if (outlier_every && c % outlier_every == 3)
				f *= gain;
			x[r * cols + c] = bd_f32_to_bf16(f);
		}
}

static void fill_f32(float *x, size_t n, uint64_t seed, float scale)
{
	struct tg_rng s = { seed };

	tg_fill_gauss(&s, x, n, scale);
}

static void to_f32(const bd_bf16 *x, size_t n, float *ret)
{
	for (size_t i = 0; i < n; i++)
		ret[i] = bd_bf16_to_f32(x[i]);
}

/* Element i of a packed FP4 array, low nibble first (the test's own indexing). */
static uint8_t nib(const uint8_t *p, size_t i)
{
	return (uint8_t)((p[i / 2] >> (4 * (i % 2))) & 0xf);
}

static float page_g(const struct bd_layout *lay, const uint8_t *page, int h, int which)
{
	float g[2];

	memcpy(g, page + lay->gscale_off + (size_t)h * sizeof(g), sizeof(g));
	return g[which];
}

static const struct bd_kvcfg *cfg_named(const char *name)
{
	const struct bd_kvcfg *c = bd_kvcfg_find(name);

	cr_assert_not_null(c, "config %s", name);
	return c;
}

static struct bd_layout layout_ok(enum bd_page_format fmt, int L, int H, int d, int d_rope,
				  size_t n_pages)
{
	struct bd_layout lay;

	cr_assert_eq(bd_layout_init(&lay, fmt, L, H, d, d_rope, n_pages), 0,
		     "init fmt %d L %d H %d d %d d_rope %d", fmt, L, H, d, d_rope);
	return lay;
}

/* How fill_bf16 fills one operand of a round trip. */
struct fill {
	uint64_t seed;
	size_t outlier_every;
	float gain;
};

/* A page round trip: the layout l of its page (layout_ok of fmt, L layers, H KV heads, head dim
 * d, d_rope), one page-head's K [T][d] and V [T][dv] (dv = d_rope, or d without it) as BF16
 * (filled as fk and fv say) and as FP32, room for them read back (rk, rv), and a zeroed page
 * of l. */
struct trip {
	struct bd_layout l;
	bd_bf16 *k, *v;
	float *kf, *vf, *rk, *rv;
	uint8_t *page;
};

static struct trip trip_new(enum bd_page_format fmt, int L, int H, int d, int d_rope,
			    int n_pages, struct fill fk, struct fill fv)
{
	const size_t T = BD_PAGE_TOKENS, dk = (size_t)d, dv = (size_t)(d_rope ? d_rope : d);
	struct trip r = {
		.l = layout_ok(fmt, L, H, d, d_rope, n_pages),
		.k = malloc(T * dk * sizeof(bd_bf16)), .v = malloc(T * dv * sizeof(bd_bf16)),
		.kf = malloc(T * dk * sizeof(float)), .vf = malloc(T * dv * sizeof(float)),
		.rk = malloc(T * dk * sizeof(float)), .rv = malloc(T * dv * sizeof(float)),
	};

	r.page = calloc(1, r.l.page_bytes);
	cr_assert(r.k && r.v && r.kf && r.vf && r.rk && r.rv && r.page);
	fill_bf16(r.k, T, dk, fk.seed, fk.outlier_every, fk.gain);
	fill_bf16(r.v, T, dv, fv.seed, fv.outlier_every, fv.gain);
	to_f32(r.k, T * dk, r.kf);
	to_f32(r.v, T * dv, r.vf);
	return r;
}

static void trip_free(struct trip *r)
{
	free(r->k), free(r->v), free(r->kf), free(r->vf), free(r->rk), free(r->rv), free(r->page);
}

/* The test's own indexing of an FP4 region pair (codes, scales) holding x [T][D]: token-major,
 * region row t holds token t's D channels; channel-major, row c holds channel c's T tokens.
 * Each row runs in blocks of l->block values, its codes at row·len/2 bytes, its scales at
 * row·len/block. */
struct fp4_region {
	const struct bd_layout *l;
	const uint8_t *codes, *scales;
	size_t T, D;
	bool channel_major;
};

/* The K (the latent C of MLA) and V regions of l's page-head at hd: 128 tokens of l->d and
 * l->dv channels, token-major unless channel_major. */
static struct fp4_region k_region(const struct bd_layout *l, const uint8_t *hd, bool channel_major)
{
	return (struct fp4_region){ l, hd + l->k_codes_off, hd + l->k_scales_off, BD_PAGE_TOKENS,
				    (size_t)l->d, channel_major };
}

static struct fp4_region v_region(const struct bd_layout *l, const uint8_t *hd, bool channel_major)
{
	return (struct fp4_region){ l, hd + l->v_codes_off, hd + l->v_scales_off, BD_PAGE_TOKENS,
				    (size_t)l->dv, channel_major };
}

/* Every block of the region equals the block quantizer's output for the same values of x
 * (NVFP4 with decode scale g, or MXFP4) under rule. */
static void expect_blocks(const struct fp4_region *q, const float *x, float g,
			  enum bd_scale_rule rule, const char *what)
{
	const size_t B = (size_t)q->l->block;
	const size_t rows = q->channel_major ? q->D : q->T, len = q->channel_major ? q->T : q->D;

	for (size_t r = 0; r < rows; r++)
		for (size_t b = 0; b < len / B; b++) {
			float blk[BD_MXFP4_BLOCK];
			uint8_t want[BD_MXFP4_BLOCK / 2], s;

			for (size_t i = 0; i < B; i++) {
				size_t e = b * B + i;
				blk[i] = x[q->channel_major ? e * q->D + r : r * q->D + e];
			}
			if (B == BD_MXFP4_BLOCK)
				cr_assert_eq(bd_mxfp4_quantize_block(blk, rule, want, &s), 0);
			else
				cr_assert_eq(bd_nvfp4_quantize_block(blk, g, rule, want, &s), 0);
			cr_assert_eq(memcmp(q->codes + r * (len / 2) + b * (B / 2), want, B / 2), 0,
				     "%s codes row %zu block %zu", what, r, b);
			cr_assert_eq(q->scales[r * (len / B) + b], s, "%s scale row %zu block %zu",
				     what, r, b);
		}
}

/* Values read back, y [T][D] token-major, equal (g·s)·x̂ of the region: x̂ the element's E2M1
 * code, s its block's scale (E4M3 for NVFP4, UE8M0 for MXFP4). */
static void expect_read(const struct fp4_region *q, const float *y, float g, const char *what)
{
	const size_t B = (size_t)q->l->block, len = q->channel_major ? q->T : q->D;

	for (size_t t = 0; t < q->T; t++)
		for (size_t c = 0; c < q->D; c++) {
			size_t r = q->channel_major ? c : t, i = q->channel_major ? t : c;
			uint8_t sc = q->scales[r * (len / B) + i / B];
			float s = B == BD_MXFP4_BLOCK ? bd_ue8m0_decode(sc) : bd_e4m3_decode(sc);
			float x = bd_e2m1_decode(nib(q->codes + r * (len / 2), i));

			cr_assert(y[t * q->D + c] == (g * s) * x, "%s t %zu c %zu", what, t, c);
		}
}

/* ---- geometry ---------------------------------------------------------------------------- */

/* The page-head geometry of l: K codes, K scales, V codes and V scales packed in that order
 * from offset 0, of these sizes in bytes, and head_bytes in all. */
static void expect_head(const struct bd_layout *l, size_t k_codes, size_t k_scales,
			size_t v_codes, size_t v_scales, size_t head_bytes)
{
	static const char *const name[4] = { "K codes", "K scales", "V codes", "V scales" };
	const size_t off[4] = { l->k_codes_off, l->k_scales_off, l->v_codes_off, l->v_scales_off };
	const size_t got[4] = { l->k_codes_bytes, l->k_scales_bytes, l->v_codes_bytes,
				l->v_scales_bytes };
	const size_t want[4] = { k_codes, k_scales, v_codes, v_scales };
	size_t at = 0;

	for (int i = 0; i < 4; i++) {
		cr_assert_eq(off[i], at, "%s at %zu, want %zu", name[i], off[i], at);
		cr_assert_eq(got[i], want[i], "%s: %zu bytes, want %zu", name[i], got[i], want[i]);
		at += want[i];
	}
	cr_assert_eq(l->head_bytes, head_bytes);
}

/* The slot geometry of l: the offsets of sink V, recent K and recent V in one (layer, head)
 * of a slot (sink K at 0), that part's bytes, and a whole slot's. */
static void expect_slot(const struct bd_layout *l, size_t sink_v, size_t recent_k,
			size_t recent_v, size_t head_bytes, size_t slot_bytes)
{
	cr_assert_eq(l->slot_sink_k_off, 0);
	cr_assert_eq(l->slot_sink_v_off, sink_v);
	cr_assert_eq(l->slot_recent_k_off, recent_k);
	cr_assert_eq(l->slot_recent_v_off, recent_v);
	cr_assert_eq(l->slot_head_bytes, head_bytes);
	cr_assert_eq(l->slot_bytes, slot_bytes);
}

Test(layout, geometry_qwen3_4b)
{
	/* 36 layers, 8 KV heads, d = 128 */
	struct bd_layout nv = layout_ok(BD_PAGE_NVFP4, 36, 8, 128, 0, 1000);

	/* K codes 128·128/2, K scales 128·128/16, V codes 128·128/2, V scales 128·128/16 */
	expect_head(&nv, 8192, 1024, 8192, 1024, 18432); /* 18 KiB */
	cr_assert_eq(nv.v_scales_off, 17408);
	cr_assert_eq(nv.block, 16);
	cr_assert_eq(nv.dv, 128);
	cr_assert_eq(nv.gscale_off, 8 * 18432);
	/* 147456 + 8·8 bytes of g = 147520 → next multiple of 256 */
	cr_assert_eq(nv.page_bytes, 147712);
	cr_assert_eq(nv.layer_stride, (size_t)1000 * 147712);
	cr_assert_eq(nv.arena_bytes, (size_t)36 * 1000 * 147712);
	/* slot: sink K 16·128·2, sink V 4096, recent K 128·128·2, recent V 32768 */
	expect_slot(&nv, 4096, 8192, 40960, 73728, (size_t)36 * 8 * 73728);

	struct bd_layout bf = layout_ok(BD_PAGE_BF16, 36, 8, 128, 0, 1000);
	expect_head(&bf, 32768, 0, 32768, 0, 65536); /* 2 · 128 · 128 · 2, no scales */
	cr_assert_eq(bf.block, 0);
	cr_assert_eq(bf.page_bytes, 524544); /* 524288 + 64 → 256-aligned */
	/* the FP4 page-head is 3.56× smaller (DESIGN.md) */
	cr_assert_float_eq((double)bf.head_bytes / (double)nv.head_bytes, 3.5556, 1e-4);
	cr_assert_eq(bf.slot_head_bytes, nv.slot_head_bytes); /* slots do not depend on fmt */

	struct bd_layout mx = layout_ok(BD_PAGE_MXFP4, 36, 8, 128, 0, 1000);
	/* 8192 + 128·128/32 + 8192 + 128·128/32 */
	cr_assert_eq(mx.block, 32);
	expect_head(&mx, 8192, 512, 8192, 512, 17408);
	cr_assert_eq(mx.v_scales_off, 16896);
	cr_assert_eq(mx.page_bytes, 139520); /* 139264 + 64 → 256-aligned */

	struct bd_layout f8 = layout_ok(BD_PAGE_FP8, 36, 8, 128, 0, 1000);
	expect_head(&f8, 16384, 0, 16384, 0, 32768); /* 128 · 128 one-byte codes, no scales */
	cr_assert_eq(f8.block, 0);
	cr_assert_eq(f8.page_bytes, 262400); /* 262144 + 64 → 256-aligned */

	struct bd_layout ch = layout_ok(BD_PAGE_NVFP4_CH, 36, 8, 128, 0, 1000);
	/* V token-major: 128·128/2 codes and 128·128/16 scales, the same sizes as K */
	cr_assert_eq(ch.block, 16);
	expect_head(&ch, 8192, 1024, 8192, 1024, 18432);
}

Test(layout, geometry_smollm2)
{
	/* 30 layers, 3 KV heads, d = 64 */
	struct bd_layout l = layout_ok(BD_PAGE_NVFP4, 30, 3, 64, 0, 10);

	/* 128·64/2 = 4096, 128·64/16 = 512, 64·128/2 = 4096, 64·128/16 = 512 */
	expect_head(&l, 4096, 512, 4096, 512, 9216);
	cr_assert_eq(l.v_scales_off, 8704);
	cr_assert_eq(l.gscale_off, 27648);
	cr_assert_eq(l.page_bytes, 27904); /* 27648 + 24 → 109·256 */
	cr_assert_eq(l.layer_stride, 279040);
	cr_assert_eq(l.arena_bytes, (size_t)30 * 279040);
	/* slot: 16·64·2 = 2048, 2048, 128·64·2 = 16384, 16384 */
	expect_slot(&l, 2048, 4096, 20480, 36864, (size_t)30 * 3 * 36864);

	struct bd_layout m = layout_ok(BD_PAGE_MXFP4, 30, 3, 64, 0, 10);
	/* 4096 + 256 + 4096 + 256 */
	cr_assert_eq(m.head_bytes, 8704);
	cr_assert_eq(m.page_bytes, 26368); /* 26112 + 24 → 103·256 */
}

Test(layout, geometry_mla)
{
	/* one latent head, d_c = 512, d_rope = 64 */
	struct bd_layout l = layout_ok(BD_PAGE_NVFP4, 4, 1, 512, 64, 3);

	cr_assert_eq(l.dv, 64);
	cr_assert_eq(l.d_rope, 64);
	/* K 128·512/2 and 128·512/16, V [128][64] BF16 */
	expect_head(&l, 32768, 4096, 16384, 0, 53248);
	cr_assert_eq(l.v_codes_off, 36864);
	cr_assert_eq(l.page_bytes, 53504); /* 53248 + 8 → 209·256 */
	/* slot: 16·512·2 = 16384, 16·64·2 = 2048, 128·512·2 = 131072, 128·64·2 = 16384 */
	expect_slot(&l, 16384, 18432, 149504, 165888, (size_t)4 * 165888);

	struct bd_layout b = layout_ok(BD_PAGE_BF16, 4, 1, 512, 64, 3);
	cr_assert_eq(b.k_codes_bytes, 131072);
	cr_assert_eq(b.v_codes_off, 131072);
	cr_assert_eq(b.v_codes_bytes, 16384);
	cr_assert_eq(b.head_bytes, 147456);

	struct bd_layout m = layout_ok(BD_PAGE_MXFP4, 4, 1, 512, 64, 3);
	cr_assert_eq(m.k_scales_bytes, 2048); /* 128·512/32 */
	cr_assert_eq(m.v_codes_off, 34816);
	cr_assert_eq(m.head_bytes, 51200);
}

Test(layout, geometry_alignment)
{
	static const int ds[] = { 32, 64, 96, 128, 160, 192, 256, 480, 512, 1024 };
	static const int hs[] = { 1, 2, 3, 5, 8 };

	for (int f = 0; f < BD_PAGE_FORMAT_COUNT; f++)
		for (size_t i = 0; i < sizeof(ds) / sizeof(ds[0]); i++)
			for (size_t j = 0; j < sizeof(hs) / sizeof(hs[0]); j++)
				for (int dr = 0; dr <= 48; dr += 16) {
					struct bd_layout l;
					int H = dr ? 1 : hs[j];
					size_t D = (size_t)ds[i];
					int r = bd_layout_init(&l, (enum bd_page_format)f, 3, H, ds[i], dr, 7);

					if (dr && (f == BD_PAGE_FP8 || f == BD_PAGE_NVFP4_CH)) {
						cr_assert_eq(r, -EINVAL);
						continue;
					}
					cr_assert_eq(r, 0, "fmt %d d %d H %d dr %d", f, ds[i], H, dr);
					const size_t off[4] = { l.k_codes_off, l.k_scales_off,
								l.v_codes_off, l.v_scales_off };
					const size_t len[4] = { l.k_codes_bytes, l.k_scales_bytes,
								l.v_codes_bytes, l.v_scales_bytes };
					cr_assert_eq(off[0], 0);
					for (int k = 0; k < 4; k++) {
						cr_assert_eq(off[k] % BD_REGION_ALIGN, 0);
						if (k < 3)
							cr_assert_leq(off[k] + len[k], off[k + 1]);
					}
					cr_assert_leq(off[3] + len[3], l.head_bytes);
					cr_assert_eq(l.head_bytes % BD_REGION_ALIGN, 0);
					cr_assert_eq(l.gscale_off, (size_t)H * l.head_bytes);
					cr_assert_leq(l.gscale_off + 8 * (size_t)H, l.page_bytes);
					cr_assert_eq(l.page_bytes % BD_PAGE_ALIGN, 0);
					cr_assert_lt(l.page_bytes - (l.gscale_off + 8 * (size_t)H),
						     BD_PAGE_ALIGN);
					cr_assert_eq(l.layer_stride, 7 * l.page_bytes);
					cr_assert_eq(l.arena_bytes, 3 * l.layer_stride);
					/* slot regions: [16][d], [16][dv], [128][d], [128][dv] BF16 */
					size_t dv = dr ? (size_t)dr : D;
					cr_assert_eq(l.dv, (int)dv);
					cr_assert_eq(l.slot_sink_k_off, 0);
					cr_assert_eq(l.slot_sink_v_off % BD_REGION_ALIGN, 0);
					cr_assert_eq(l.slot_recent_k_off % BD_REGION_ALIGN, 0);
					cr_assert_eq(l.slot_recent_v_off % BD_REGION_ALIGN, 0);
					cr_assert_leq(32 * D, l.slot_sink_v_off);
					cr_assert_leq(l.slot_sink_v_off + 32 * dv, l.slot_recent_k_off);
					cr_assert_leq(l.slot_recent_k_off + 256 * D, l.slot_recent_v_off);
					cr_assert_leq(l.slot_recent_v_off + 256 * dv, l.slot_head_bytes);
					cr_assert_eq(l.slot_head_bytes % BD_PAGE_ALIGN, 0);
					cr_assert_eq(l.slot_bytes, 3 * (size_t)H * l.slot_head_bytes);
				}
}

Test(layout, geometry_bad_args)
{
	static const struct {
		int fmt, L, H, d, dr;
		size_t np;
	} bad[] = {
		{ -1, 2, 2, 64, 0, 4 },
		{ BD_PAGE_FORMAT_COUNT, 2, 2, 64, 0, 4 },
		{ BD_PAGE_NVFP4, 0, 2, 64, 0, 4 },
		{ BD_PAGE_NVFP4, 2, 0, 64, 0, 4 },
		{ BD_PAGE_NVFP4, 2, -1, 64, 0, 4 },
		{ BD_PAGE_NVFP4, 2, 2, 0, 0, 4 },
		{ BD_PAGE_NVFP4, 2, 2, 48, 0, 4 },   /* not a multiple of 32 */
		{ BD_PAGE_NVFP4, 2, 2, -32, 0, 4 },
		{ BD_PAGE_NVFP4, 2, 2, 1056, 0, 4 }, /* > 1024 */
		{ BD_PAGE_NVFP4, 2, 2, 64, 0, 0 },   /* no pages */
		{ BD_PAGE_NVFP4, 1, 1, 512, 8, 4 },  /* d_rope not a multiple of 16 */
		{ BD_PAGE_NVFP4, 1, 1, 512, -16, 4 },
		{ BD_PAGE_NVFP4, 1, 2, 512, 64, 4 }, /* MLA has one latent head */
		{ BD_PAGE_FP8, 1, 1, 512, 64, 4 },
		{ BD_PAGE_NVFP4_CH, 1, 1, 512, 64, 4 },
	};
	struct bd_layout l, before;

	memset(&l, 0xa5, sizeof(l));
	before = l;
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		cr_assert_eq(bd_layout_init(&l, (enum bd_page_format)bad[i].fmt, bad[i].L, bad[i].H,
					    bad[i].d, bad[i].dr, bad[i].np),
			     -EINVAL, "case %zu", i);
		cr_assert_eq(memcmp(&l, &before, sizeof(l)), 0, "case %zu wrote ret", i);
	}
	cr_assert_eq(bd_layout_init(NULL, BD_PAGE_NVFP4, 2, 2, 64, 0, 4), -EINVAL);
}

Test(layout, geometry_overflow)
{
	struct bd_layout l, before;

	l = layout_ok(BD_PAGE_NVFP4, 1, 8, 128, 0, 1);
	size_t pb = l.page_bytes;
	memset(&l, 0xa5, sizeof(l));
	before = l;
	/* n_pages · page_bytes overflows */
	cr_assert_eq(bd_layout_init(&l, BD_PAGE_NVFP4, 1, 8, 128, 0, SIZE_MAX / 2), -EOVERFLOW);
	cr_assert_eq(bd_layout_init(&l, BD_PAGE_NVFP4, 1, 8, 128, 0, SIZE_MAX / pb + 1),
		     -EOVERFLOW);
	/* layer_stride fits, n_layers · layer_stride does not */
	cr_assert_eq(bd_layout_init(&l, BD_PAGE_NVFP4, 2, 8, 128, 0, SIZE_MAX / pb), -EOVERFLOW);
	cr_assert_eq(memcmp(&l, &before, sizeof(l)), 0);
	/* the largest arena that fits is accepted */
	cr_assert_eq(bd_layout_init(&l, BD_PAGE_NVFP4, 1, 8, 128, 0, SIZE_MAX / pb), 0);
	cr_assert_eq(l.arena_bytes, SIZE_MAX / pb * pb);
}

Test(layout, slot_pointers)
{
	struct bd_layout l = layout_ok(BD_PAGE_NVFP4, 3, 2, 64, 0, 1);
	uint8_t *slot = calloc(1, l.slot_bytes);

	for (int a = 0; a < 3; a++)
		for (int h = 0; h < 2; h++) {
			uint8_t *base = slot + (size_t)(a * 2 + h) * l.slot_head_bytes;

			cr_assert_eq((uint8_t *)bd_slot_sink_k(&l, slot, a, h), base + l.slot_sink_k_off);
			cr_assert_eq((uint8_t *)bd_slot_sink_v(&l, slot, a, h), base + l.slot_sink_v_off);
			cr_assert_eq((uint8_t *)bd_slot_recent_k(&l, slot, a, h),
				     base + l.slot_recent_k_off);
			cr_assert_eq((uint8_t *)bd_slot_recent_v(&l, slot, a, h),
				     base + l.slot_recent_v_off);
		}
	cr_assert_null(bd_slot_recent_k(&l, slot, 3, 0));
	cr_assert_null(bd_slot_recent_k(&l, slot, 0, 2));
	cr_assert_null(bd_slot_sink_v(&l, slot, -1, 0));
	free(slot);
}

/* ---- NVFP4 page round trip ---------------------------------------------------------------- */

Test(layout, nvfp4_page_bytes_and_round_trip)
{
	enum { D = 128, T = BD_PAGE_TOKENS };
	const struct bd_kvcfg *cfg = cfg_named("bitdecoding-nvfp4"); /* key search on */
	/* outlier channels 3, 35, 67, 99 at 4× */
	struct trip r = trip_new(BD_PAGE_NVFP4, 1, 2, D, 0, 1, (struct fill){ 11, 32, 4.0f },
				 (struct fill){ 12, 32, 4.0f });
	uint8_t *page = r.page, *page2 = malloc(r.l.page_bytes);
	const int h = 1;

	memset(page, 0x5a, r.l.page_bytes);
	cr_assert_eq(bd_page_write_head(&r.l, cfg, r.k, r.v, NULL, page, h), 0);
	const uint8_t *hd = page + (size_t)h * r.l.head_bytes;

	/* head 0 and the padding after the g table are not this head's */
	for (size_t i = 0; i < r.l.head_bytes; i++)
		cr_assert_eq(page[i], 0x5a);
	for (size_t i = r.l.gscale_off + 16; i < r.l.page_bytes; i++)
		cr_assert_eq(page[i], 0x5a);

	/* decode scales: amax / (6·256) over the whole page-head */
	float gk, gv;
	cr_assert_eq(bd_nvfp4_decode_scale(r.kf, T * D, BD_NVFP4_KV_SMAX, &gk), 0);
	cr_assert_eq(bd_nvfp4_decode_scale(r.vf, T * D, BD_NVFP4_KV_SMAX, &gv), 0);
	cr_assert(gk == bd_abs_max(r.kf, T * D) / 1536.0f);
	cr_assert(gv == bd_abs_max(r.vf, T * D) / 1536.0f);
	cr_assert(page_g(&r.l, page, h, 0) == gk);
	cr_assert(page_g(&r.l, page, h, 1) == gv);

	/* (a) K: token t, block b → codes row t bytes 8b..8b+7, scale [t][b]; search rule.
	 * (b) V: channel c, tokens 16b..16b+15 → codes row c bytes 8b.., scale [c][b]; standard */
	const struct fp4_region K = k_region(&r.l, hd, false);
	const struct fp4_region V = v_region(&r.l, hd, true);
	expect_blocks(&K, r.kf, gk, BD_SCALE_SEARCH, "K");
	expect_blocks(&V, r.vf, gv, BD_SCALE_STANDARD, "V");

	/* (c) full dequantization equals (g·s)·x̂ read with the test's own indexing */
	cr_assert_eq(bd_page_read_head(&r.l, page, h, r.rk, r.rv, NULL), 0);
	expect_read(&K, r.rk, gk, "K");
	expect_read(&V, r.rv, gv, "V");
	/* NVFP4 on Gaussian data: relative error ≈ 0.095 with κ = 6 (V), ≈ 0.087 with the
	 * search (K); a misplaced block or scale gives errors of order 1 */
	cr_assert_lt(tg_rel_l2(r.rk, r.kf, T * D), 0.11);
	cr_assert_lt(tg_rel_l2(r.rv, r.vf, T * D), 0.11);

	/* with ret_g: s·x̂ without g, and g returned */
	float g[2] = { 0, 0 };
	cr_assert_eq(bd_page_read_head(&r.l, page, h, r.rk, r.rv, g), 0);
	cr_assert(g[0] == gk && g[1] == gv);
	expect_read(&K, r.rk, 1.0f, "K without g");
	expect_read(&V, r.rv, 1.0f, "V without g");

	/* (d) the same input twice gives the same bytes, whatever the page held before */
	memset(page2, 0x00, r.l.page_bytes);
	memset(page, 0x00, r.l.page_bytes);
	cr_assert_eq(bd_page_write_head(&r.l, cfg, r.k, r.v, NULL, page, h), 0);
	cr_assert_eq(bd_page_write_head(&r.l, cfg, r.k, r.v, NULL, page2, h), 0);
	cr_assert_eq(memcmp(page, page2, r.l.page_bytes), 0);
	memset(page2, 0xff, r.l.page_bytes);
	cr_assert_eq(bd_page_write_head(&r.l, cfg, r.k, r.v, NULL, page2, h), 0);
	cr_assert_eq(memcmp(page + r.l.head_bytes, page2 + r.l.head_bytes, r.l.head_bytes), 0);
	cr_assert_eq(memcmp(page + r.l.gscale_off + 8, page2 + r.l.gscale_off + 8, 8), 0);

	trip_free(&r);
	free(page2);
}

/* K[3][5] = 1.5 and V[3][5] = −1.5 (d = l->d) in otherwise zero k, v, written into page (head 0,
 * poisoned first) with configuration cfg_name: every byte of the head is 0 but the K code byte
 * 0x70 (code 7 in the high nibble) at kc of the K codes region, the K scale `scale` at ks of the
 * K scales, the V code byte 0xf0 (code 0xf: −6) at vc and the V scale `scale` at vs. */
static void lone_value_page(const struct bd_layout *l, const char *cfg_name, bd_bf16 *k,
			    bd_bf16 *v, uint8_t *page, size_t kc, size_t ks, size_t vc, size_t vs,
			    uint8_t scale)
{
	k[3 * l->d + 5] = bd_f32_to_bf16(1.5f);
	v[3 * l->d + 5] = bd_f32_to_bf16(-1.5f);
	memset(page, 0xff, l->page_bytes);
	cr_assert_eq(bd_page_write_head(l, cfg_named(cfg_name), k, v, NULL, page, 0), 0);
	for (size_t i = 0; i < l->head_bytes; i++) {
		uint8_t want = 0;

		if (i == l->k_codes_off + kc)
			want = 0x70;
		else if (i == l->k_scales_off + ks)
			want = scale;
		else if (i == l->v_codes_off + vc)
			want = 0xf0;
		else if (i == l->v_scales_off + vs)
			want = scale;
		cr_assert_eq(page[i], want, "%s byte %zu: %#x, want %#x", cfg_name, i, page[i], want);
	}
}

Test(layout, nvfp4_nibble_placement)
{
	enum { D = 128, T = BD_PAGE_TOKENS };
	struct bd_layout l = layout_ok(BD_PAGE_NVFP4, 1, 1, D, 0, 1);
	bd_bf16 *k = calloc(T * D, sizeof(*k)), *v = calloc(T * D, sizeof(*v));
	uint8_t *page = malloc(l.page_bytes);

	/* K[3][5] = 1.5, V[3][5] = −1.5, everything else 0. By hand: g = 1.5/1536 = 2^-10;
	 * s = E4M3(1.5/6/2^-10) = E4M3(256) = 0x78 (exponent 8+7, mantissa 0); inv = 1/(256·2^-10)
	 * = 4, 1.5·4 = 6 → E2M1 code 7 (−6 → 0xf). All-zero blocks get scale 0 and codes 0.
	 * K: token 3, channel 5 → byte 3·64 + 2, high nibble; scale [3][0] at 3·8.
	 * V: channel 5, token 3 → byte 5·64 + 1, high nibble; scale [5][0] at 5·8. */
	lone_value_page(&l, "nvfp4-base", k, v, page, 3 * 64 + 2, 3 * 8, 5 * 64 + 1, 5 * 8, 0x78);
	cr_assert(page_g(&l, page, 0, 0) == 0x1p-10f);
	cr_assert(page_g(&l, page, 0, 1) == 0x1p-10f);

	float *rk = malloc(T * D * sizeof(float)), *rv = malloc(T * D * sizeof(float));
	cr_assert_eq(bd_page_read_head(&l, page, 0, rk, rv, NULL), 0);
	for (size_t i = 0; i < T * D; i++) {
		cr_assert(rk[i] == (i == 3 * D + 5 ? 1.5f : 0.0f));
		cr_assert(rv[i] == (i == 3 * D + 5 ? -1.5f : 0.0f));
	}
	free(k), free(v), free(page), free(rk), free(rv);
}

Test(layout, mxfp4_nibble_placement)
{
	enum { D = 64, T = BD_PAGE_TOKENS };
	struct bd_layout l = layout_ok(BD_PAGE_MXFP4, 1, 1, D, 0, 1);
	bd_bf16 *k = calloc(T * D, sizeof(*k)), *v = calloc(T * D, sizeof(*v));
	uint8_t *page = malloc(l.page_bytes);

	/* K[3][5] = 1.5 and V[3][5] = −1.5 alone in their blocks: e_ocp = floor(log2 1.5) − 2 = −2,
	 * scale code 125 = 0x7d, 1.5·4 = 6 → code 7 (the search's e = −1 gives 3, also exact: the
	 * tie keeps e_ocp). K codes row 3 is 32 bytes, K scales row 3 is 2 codes; V codes row 5 at
	 * 5·64, V scales row 5 at 5·4. Zero blocks: scale code 0, codes 0. */
	lone_value_page(&l, "bitdecoding-mxfp4", k, v, page, 3 * 32 + 2, 3 * 2, 5 * 64 + 1, 5 * 4,
			0x7d);
	cr_assert(page_g(&l, page, 0, 0) == 1.0f && page_g(&l, page, 0, 1) == 1.0f);
	free(k), free(v), free(page);
}

/* ---- the other formats -------------------------------------------------------------------- */

Test(layout, bf16_round_trip_exact)
{
	enum { D = 64, T = BD_PAGE_TOKENS };
	struct trip r = trip_new(BD_PAGE_BF16, 2, 3, D, 0, 2, (struct fill){ 21, 16, 30.0f },
				 (struct fill){ 22, 0, 1.0f });
	float g[2];

	cr_assert_eq(bd_page_write_head(&r.l, cfg_named("bf16"), r.k, r.v, NULL, r.page, 2), 0);
	const uint8_t *hd = r.page + 2 * r.l.head_bytes;
	cr_assert_eq(memcmp(hd + r.l.k_codes_off, r.k, T * D * 2), 0);
	cr_assert_eq(memcmp(hd + r.l.v_codes_off, r.v, T * D * 2), 0);
	cr_assert_eq(bd_page_read_head(&r.l, r.page, 2, r.rk, r.rv, NULL), 0);
	cr_assert_eq(memcmp(r.rk, r.kf, T * D * sizeof(float)), 0);
	cr_assert_eq(memcmp(r.rv, r.vf, T * D * sizeof(float)), 0);
	cr_assert_eq(bd_page_read_head(&r.l, r.page, 2, r.rk, r.rv, g), 0);
	cr_assert(g[0] == 1.0f && g[1] == 1.0f);
	cr_assert_eq(memcmp(r.rk, r.kf, T * D * sizeof(float)), 0);
	trip_free(&r);
}

Test(layout, fp8_round_trip)
{
	enum { D = 128, T = BD_PAGE_TOKENS };
	struct trip r = trip_new(BD_PAGE_FP8, 1, 2, D, 0, 1, (struct fill){ 31, 32, 8.0f },
				 (struct fill){ 32, 0, 1.0f });
	const float *kf = r.kf, *vf = r.vf, *rk = r.rk, *rv = r.rv;
	float g[2];

	const float s[2] = { bd_abs_max(kf, T * D) / 448.0f, bd_abs_max(vf, T * D) / 448.0f };
	cr_assert_eq(bd_page_write_head(&r.l, cfg_named("fp8"), r.k, r.v, s, r.page, 1), 0);
	const uint8_t *hd = r.page + r.l.head_bytes;
	for (size_t i = 0; i < T * D; i++) {
		cr_assert_eq(hd[r.l.k_codes_off + i], bd_e4m3_encode(kf[i] / s[0]), "K %zu", i);
		cr_assert_eq(hd[r.l.v_codes_off + i], bd_e4m3_encode(vf[i] / s[1]), "V %zu", i);
	}
	cr_assert(page_g(&r.l, r.page, 1, 0) == s[0] && page_g(&r.l, r.page, 1, 1) == s[1]);
	cr_assert_eq(bd_page_read_head(&r.l, r.page, 1, r.rk, r.rv, NULL), 0);
	for (size_t i = 0; i < T * D; i++) {
		cr_assert(rk[i] == bd_e4m3_decode(hd[r.l.k_codes_off + i]) * s[0]);
		/* E4M3: 3 mantissa bits → half-ulp ≤ |x|/16, subnormal step 2^-9 → ≤ s·2^-10 */
		cr_assert_leq(fabsf(rk[i] - kf[i]), fabsf(kf[i]) / 16.0f * 1.0001f + s[0] * 0x1p-10f);
		cr_assert_leq(fabsf(rv[i] - vf[i]), fabsf(vf[i]) / 16.0f * 1.0001f + s[1] * 0x1p-10f);
	}
	cr_assert_eq(bd_page_read_head(&r.l, r.page, 1, r.rk, r.rv, g), 0);
	cr_assert(g[0] == s[0] && g[1] == s[1]);
	for (size_t i = 0; i < T * D; i++) {
		cr_assert(rk[i] == bd_e4m3_decode(hd[r.l.k_codes_off + i]));
		cr_assert(rv[i] == bd_e4m3_decode(hd[r.l.v_codes_off + i]));
	}
	trip_free(&r);
}

Test(layout, mxfp4_round_trip)
{
	enum { D = 128, T = BD_PAGE_TOKENS };
	struct trip r = trip_new(BD_PAGE_MXFP4, 1, 1, D, 0, 1, (struct fill){ 41, 0, 1.0f },
				 (struct fill){ 42, 0, 1.0f });
	float *rk2 = malloc(T * D * sizeof(float));
	float g[2];

	cr_assert_eq(bd_page_write_head(&r.l, cfg_named("bitdecoding-mxfp4"), r.k, r.v, NULL,
					r.page, 0), 0);
	/* K token-major with the search, V channel-major standard, UE8M0 scales of 32 */
	const struct fp4_region K = k_region(&r.l, r.page, false);
	const struct fp4_region V = v_region(&r.l, r.page, true);
	expect_blocks(&K, r.kf, 1.0f, BD_SCALE_SEARCH, "K");
	expect_blocks(&V, r.vf, 1.0f, BD_SCALE_STANDARD, "V");
	cr_assert_eq(bd_page_read_head(&r.l, r.page, 0, r.rk, r.rv, NULL), 0);
	expect_read(&K, r.rk, 1.0f, "K");
	expect_read(&V, r.rv, 1.0f, "V");
	/* power-of-two scales cost accuracy vs NVFP4: about 0.11–0.12 on Gaussian data */
	cr_assert_lt(tg_rel_l2(r.rk, r.kf, T * D), 0.16);
	cr_assert_lt(tg_rel_l2(r.rv, r.vf, T * D), 0.16);
	/* no page decode scale: ret_g = {1, 1} and the same values */
	cr_assert_eq(bd_page_read_head(&r.l, r.page, 0, rk2, r.rv, g), 0);
	cr_assert(g[0] == 1.0f && g[1] == 1.0f);
	cr_assert_eq(memcmp(r.rk, rk2, T * D * sizeof(float)), 0);
	trip_free(&r);
	free(rk2);
}

Test(layout, nvfp4_ch_round_trip)
{
	enum { D = 64, T = BD_PAGE_TOKENS };
	struct trip r = trip_new(BD_PAGE_NVFP4_CH, 1, 1, D, 0, 1, (struct fill){ 51, 16, 4.0f },
				 (struct fill){ 52, 0, 1.0f });
	float gk, gv, g[2];

	cr_assert_eq(bd_page_write_head(&r.l, cfg_named("trtllm-nvfp4"), r.k, r.v, NULL, r.page, 0),
		     0);
	cr_assert_eq(bd_nvfp4_decode_scale(r.kf, T * D, BD_NVFP4_KV_SMAX, &gk), 0);
	cr_assert_eq(bd_nvfp4_decode_scale(r.vf, T * D, BD_NVFP4_KV_SMAX, &gv), 0);
	cr_assert(page_g(&r.l, r.page, 0, 0) == gk && page_g(&r.l, r.page, 0, 1) == gv);
	/* both K and V token-major, blocks along channels, standard rule */
	const struct fp4_region K = k_region(&r.l, r.page, false);
	const struct fp4_region V = v_region(&r.l, r.page, false);
	expect_blocks(&K, r.kf, gk, BD_SCALE_STANDARD, "K");
	expect_blocks(&V, r.vf, gv, BD_SCALE_STANDARD, "V");
	cr_assert_eq(bd_page_read_head(&r.l, r.page, 0, r.rk, r.rv, NULL), 0);
	expect_read(&K, r.rk, gk, "K");
	expect_read(&V, r.rv, gv, "V");
	/* ≈ 0.095: NVFP4, κ = 6 on Gaussian data */
	cr_assert_lt(tg_rel_l2(r.rk, r.kf, T * D), 0.11);
	cr_assert_lt(tg_rel_l2(r.rv, r.vf, T * D), 0.11);
	cr_assert_eq(bd_page_read_head(&r.l, r.page, 0, r.rk, r.rv, g), 0);
	cr_assert(g[0] == gk && g[1] == gv);
	trip_free(&r);
}

Test(layout, mla_round_trip)
{
	enum { D = 512, R = 64, T = BD_PAGE_TOKENS };
	/* the latent C as K [T][D], the positional part as V [T][R] */
	struct trip r = trip_new(BD_PAGE_NVFP4, 2, 1, D, R, 2, (struct fill){ 61, 64, 4.0f },
				 (struct fill){ 62, 0, 3.0f });
	float gk, g[2];

	cr_assert_eq(bd_page_write_head(&r.l, cfg_named("bitdecoding-nvfp4"), r.k, r.v, NULL,
					r.page, 0), 0);
	/* latent C token-major NVFP4 with the search rule, positional part BF16 in V codes */
	cr_assert_eq(bd_nvfp4_decode_scale(r.kf, T * D, BD_NVFP4_KV_SMAX, &gk), 0);
	cr_assert(page_g(&r.l, r.page, 0, 0) == gk);
	cr_assert(page_g(&r.l, r.page, 0, 1) == 1.0f);
	const struct fp4_region C = k_region(&r.l, r.page, false);
	expect_blocks(&C, r.kf, gk, BD_SCALE_SEARCH, "C");
	cr_assert_eq(memcmp(r.page + r.l.v_codes_off, r.v, T * R * 2), 0);
	cr_assert_eq(bd_page_read_head(&r.l, r.page, 0, r.rk, r.rv, NULL), 0);
	cr_assert_eq(memcmp(r.rv, r.vf, T * R * sizeof(float)), 0);
	cr_assert_lt(tg_rel_l2(r.rk, r.kf, T * D), 0.11);
	cr_assert_eq(bd_page_read_head(&r.l, r.page, 0, r.rk, r.rv, g), 0);
	cr_assert(g[0] == gk && g[1] == 1.0f);
	cr_assert_eq(memcmp(r.rv, r.vf, T * R * sizeof(float)), 0);

	/* BF16 MLA page: both parts exact */
	struct bd_layout lb = layout_ok(BD_PAGE_BF16, 1, 1, D, R, 1);
	uint8_t *pb = calloc(1, lb.page_bytes);
	cr_assert_eq(bd_page_write_head(&lb, cfg_named("bf16"), r.k, r.v, NULL, pb, 0), 0);
	cr_assert_eq(bd_page_read_head(&lb, pb, 0, r.rk, r.rv, NULL), 0);
	cr_assert_eq(memcmp(r.rk, r.kf, T * D * sizeof(float)), 0);
	cr_assert_eq(memcmp(r.rv, r.vf, T * R * sizeof(float)), 0);
	trip_free(&r);
	free(pb);
}

/* ---- page write errors -------------------------------------------------------------------- */

Test(layout, page_write_rejects_nonfinite)
{
	enum { D = 64, T = BD_PAGE_TOKENS };
	struct bd_layout l = layout_ok(BD_PAGE_NVFP4, 1, 2, D, 0, 1);
	const struct bd_kvcfg *cfg = cfg_named("bitdecoding-nvfp4");
	bd_bf16 *k = malloc(T * D * sizeof(*k)), *v = malloc(T * D * sizeof(*v));
	uint8_t *page = malloc(l.page_bytes), *before = malloc(l.page_bytes);
	static const bd_bf16 bad[] = { 0x7f80, 0xff80, 0x7fc0, 0xffc1 }; /* ±inf, NaNs */

	fill_bf16(k, T, D, 71, 0, 1.0f);
	fill_bf16(v, T, D, 72, 0, 1.0f);
	memset(page, 0x3c, l.page_bytes);
	memcpy(before, page, l.page_bytes);
	for (size_t i = 0; i < 4; i++) {
		bd_bf16 sk = k[T * D - 1 - i], sv = v[100 + i];

		k[T * D - 1 - i] = bad[i]; /* the last value: everything before it is fine */
		cr_assert_eq(bd_page_write_head(&l, cfg, k, v, NULL, page, 1), -EDOM);
		cr_assert_eq(memcmp(page, before, l.page_bytes), 0);
		k[T * D - 1 - i] = sk;
		v[100 + i] = bad[i];
		cr_assert_eq(bd_page_write_head(&l, cfg, k, v, NULL, page, 1), -EDOM);
		cr_assert_eq(memcmp(page, before, l.page_bytes), 0);
		v[100 + i] = sv;
	}
	/* bad arguments */
	cr_assert_eq(bd_page_write_head(&l, cfg, k, v, NULL, page, 2), -EINVAL);
	cr_assert_eq(bd_page_write_head(&l, cfg, k, v, NULL, page, -1), -EINVAL);
	cr_assert_eq(bd_page_write_head(&l, NULL, k, v, NULL, page, 0), -EINVAL);
	cr_assert_eq(bd_page_write_head(&l, cfg, NULL, v, NULL, page, 0), -EINVAL);
	cr_assert_eq(bd_page_write_head(&l, cfg, k, NULL, NULL, page, 0), -EINVAL);
	cr_assert_eq(bd_page_write_head(NULL, cfg, k, v, NULL, page, 0), -EINVAL);
	cr_assert_eq(memcmp(page, before, l.page_bytes), 0);

	/* FP8 scales: each > 0 and finite */
	struct bd_layout l8 = layout_ok(BD_PAGE_FP8, 1, 1, D, 0, 1);
	uint8_t *p8 = malloc(l8.page_bytes), *b8 = malloc(l8.page_bytes);
	const float bads[][2] = { { 0.0f, 1.0f }, { 1.0f, -1.0f }, { NAN, 1.0f }, { 1.0f, INFINITY } };
	memset(p8, 0x11, l8.page_bytes);
	memcpy(b8, p8, l8.page_bytes);
	cr_assert_eq(bd_page_write_head(&l8, cfg_named("fp8"), k, v, NULL, p8, 0), -EINVAL);
	for (size_t i = 0; i < 4; i++)
		cr_assert_eq(bd_page_write_head(&l8, cfg_named("fp8"), k, v, bads[i], p8, 0), -EINVAL);
	cr_assert_eq(memcmp(p8, b8, l8.page_bytes), 0);

	float rk[1], rv[1];
	cr_assert_eq(bd_page_read_head(&l, page, 2, rk, rv, NULL), -EINVAL);
	cr_assert_eq(bd_page_read_head(&l, NULL, 0, rk, rv, NULL), -EINVAL);
	cr_assert_eq(bd_page_read_head(&l, page, 0, NULL, rv, NULL), -EINVAL);
	free(k), free(v), free(page), free(before), free(p8), free(b8);
}

/* ---- KV write path ------------------------------------------------------------------------ */

/* k, v of position pos: integers ≤ 201 times powers of two, exact in BF16 */
static void token_kv(int pos, size_t d, float *k, float *v)
{
	for (size_t i = 0; i < d; i++) {
		k[i] = (float)(pos + 1) * ldexpf(1.0f, (int)(i % 5)) * (i & 1 ? -1.0f : 1.0f);
		v[i] = -(float)(pos + 1) * ldexpf(1.0f, -(int)(i % 3));
	}
}

static void put_row(uint8_t *dst, const float *x, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		bd_bf16 h = bd_f32_to_bf16(x[i]);

		memcpy(dst + 2 * i, &h, 2);
	}
}

Test(layout, write_token_rows)
{
	enum { D = 64 };
	struct bd_layout l = layout_ok(BD_PAGE_BF16, 2, 2, D, 0, 1);
	const struct bd_kvcfg *cfg = cfg_named("bf16");
	uint8_t *slot = calloc(1, l.slot_bytes), *want = calloc(1, l.slot_bytes);
	static const int pos[] = { 0, 15, 16, 127, 128, 200 };
	float k[D], v[D];
	/* (layer 1, head 1) is the last head of the slot */
	uint8_t *base = want + 3 * l.slot_head_bytes;

	for (size_t i = 0; i < 6; i++) {
		token_kv(pos[i], D, k, v);
		cr_assert_eq(bd_kv_write_token(&l, cfg, slot, 1, 1, pos[i], k, v, NULL), 0);
	}
	/* recent row pos % 128 (128 overwrites row 0, 200 lands in row 72), sink row pos < 16 */
	for (size_t i = 0; i < 6; i++) {
		size_t row = (size_t)pos[i] % 128;

		token_kv(pos[i], D, k, v);
		put_row(base + l.slot_recent_k_off + row * D * 2, k, D);
		put_row(base + l.slot_recent_v_off + row * D * 2, v, D);
		if (pos[i] < 16) {
			put_row(base + l.slot_sink_k_off + (size_t)pos[i] * D * 2, k, D);
			put_row(base + l.slot_sink_v_off + (size_t)pos[i] * D * 2, v, D);
		}
	}
	cr_assert_eq(memcmp(slot, want, l.slot_bytes), 0);
	/* spot check with plain numbers: recent row 72 holds pos 200, k[0] = 201, v[1] = −100.5 */
	cr_assert(bd_bf16_to_f32(bd_slot_recent_k(&l, slot, 1, 1)[72 * D]) == 201.0f);
	cr_assert(bd_bf16_to_f32(bd_slot_recent_v(&l, slot, 1, 1)[72 * D + 1]) == -100.5f);
	cr_assert(bd_bf16_to_f32(bd_slot_recent_k(&l, slot, 1, 1)[0]) == 129.0f);
	cr_assert(bd_bf16_to_f32(bd_slot_sink_k(&l, slot, 1, 1)[0]) == 1.0f);
	free(slot), free(want);
}

Test(layout, write_token_smoothing_hadamard)
{
	enum { D = 128 };
	struct bd_layout l = layout_ok(BD_PAGE_NVFP4, 1, 2, D, 0, 1);
	uint8_t *slot = calloc(1, l.slot_bytes);
	float k[D], v[D], mu[D], t[D];
	static const struct {
		const char *cfg;
		int smooth, rot;
	} cases[] = {
		{ "bitdecoding-nvfp4", 1, 1 }, /* k' = H(k − μ) */
		{ "-hadamard", 1, 0 },         /* k' = k − μ */
		{ "-smoothing", 0, 1 },        /* k' = H k: μ ignored */
		{ "nvfp4-base", 0, 0 },        /* k' = k */
	};

	fill_f32(k, D, 81, 2.0f);
	fill_f32(v, D, 82, 1.0f);
	fill_f32(mu, D, 83, 0.5f);
	for (size_t c = 0; c < 4; c++) {
		const struct bd_kvcfg *cfg = cfg_named(cases[c].cfg);
		int pos = 5 + (int)c;

		cr_assert_eq(bd_kv_write_token(&l, cfg, slot, 0, 1, pos, k, v, mu), 0);
		for (size_t i = 0; i < D; i++)
			t[i] = cases[c].smooth ? k[i] - mu[i] : k[i];
		if (cases[c].rot)
			cr_assert_eq(bd_fwht(t, D), 0);
		const bd_bf16 *rk = bd_slot_recent_k(&l, slot, 0, 1) + (size_t)pos * D;
		const bd_bf16 *sk = bd_slot_sink_k(&l, slot, 0, 1) + (size_t)pos * D;
		const bd_bf16 *rv = bd_slot_recent_v(&l, slot, 0, 1) + (size_t)pos * D;
		for (size_t i = 0; i < D; i++) {
			cr_assert_eq(rk[i], bd_f32_to_bf16(t[i]), "%s i %zu", cases[c].cfg, i);
			cr_assert_eq(sk[i], rk[i]);
			cr_assert_eq(rv[i], bd_f32_to_bf16(v[i])); /* values never rotated */
		}
	}
	/* μ = NULL is zero: H k */
	cr_assert_eq(bd_kv_write_token(&l, cfg_named("bitdecoding-nvfp4"), slot, 0, 0, 40, k, v,
				       NULL), 0);
	memcpy(t, k, sizeof(t));
	cr_assert_eq(bd_fwht(t, D), 0);
	for (size_t i = 0; i < D; i++)
		cr_assert_eq(bd_slot_recent_k(&l, slot, 0, 0)[40 * D + i], bd_f32_to_bf16(t[i]));
	free(slot);
}

Test(layout, write_token_errors_leave_slot)
{
	enum { D = 64 };
	struct bd_layout l = layout_ok(BD_PAGE_NVFP4, 2, 2, D, 0, 1);
	const struct bd_kvcfg *cfg = cfg_named("bitdecoding-nvfp4");
	uint8_t *slot = malloc(l.slot_bytes), *before = malloc(l.slot_bytes);
	float k[D], v[D], mu[D];
	struct tg_rng s = { 91 };

	for (size_t i = 0; i < l.slot_bytes; i++)
		slot[i] = (uint8_t)tg_next(&s);
	memcpy(before, slot, l.slot_bytes);
	fill_f32(k, D, 92, 1.0f);
	fill_f32(v, D, 93, 1.0f);
	fill_f32(mu, D, 94, 1.0f);

	k[7] = NAN;
	cr_assert_eq(bd_kv_write_token(&l, cfg, slot, 0, 0, 3, k, v, mu), -EDOM);
	k[7] = 1.0f;
	v[D - 1] = INFINITY;
	cr_assert_eq(bd_kv_write_token(&l, cfg, slot, 0, 0, 3, k, v, mu), -EDOM);
	v[D - 1] = 1.0f;
	mu[0] = -INFINITY;
	cr_assert_eq(bd_kv_write_token(&l, cfg, slot, 0, 0, 3, k, v, mu), -EDOM);
	/* μ is checked when given even if the configuration does not smooth */
	cr_assert_eq(bd_kv_write_token(&l, cfg_named("bf16"), slot, 0, 0, 3, k, v, mu), -EDOM);
	/* finite inputs whose k − μ overflows FP32 */
	mu[0] = -3e38f;
	k[0] = 3e38f;
	cr_assert_eq(bd_kv_write_token(&l, cfg, slot, 0, 0, 3, k, v, mu), -EDOM);
	cr_assert_eq(memcmp(slot, before, l.slot_bytes), 0);
	/* finite FP32 that rounds past the BF16 range (max 0x7f7f ≈ 3.3895e38) */
	cr_assert_eq(bd_kv_write_token(&l, cfg_named("bf16"), slot, 0, 0, 3, k, v, NULL), 0);
	memcpy(before, slot, l.slot_bytes);
	v[1] = 3.4e38f;
	cr_assert_eq(bd_kv_write_token(&l, cfg_named("bf16"), slot, 0, 0, 3, k, v, NULL), -EDOM);
	cr_assert_eq(memcmp(slot, before, l.slot_bytes), 0);
	v[1] = 0.5f;
	k[0] = 1.0f;
	mu[0] = 0.0f;

	cr_assert_eq(bd_kv_write_token(&l, cfg, slot, 0, 0, -1, k, v, mu), -EINVAL);
	cr_assert_eq(bd_kv_write_token(&l, cfg, slot, 2, 0, 3, k, v, mu), -EINVAL);
	cr_assert_eq(bd_kv_write_token(&l, cfg, slot, -1, 0, 3, k, v, mu), -EINVAL);
	cr_assert_eq(bd_kv_write_token(&l, cfg, slot, 0, 2, 3, k, v, mu), -EINVAL);
	cr_assert_eq(bd_kv_write_token(&l, cfg, slot, 0, -1, 3, k, v, mu), -EINVAL);
	cr_assert_eq(bd_kv_write_token(&l, cfg, slot, 0, 0, 3, NULL, v, mu), -EINVAL);
	cr_assert_eq(bd_kv_write_token(&l, cfg, slot, 0, 0, 3, k, NULL, mu), -EINVAL);
	cr_assert_eq(bd_kv_write_token(&l, cfg, NULL, 0, 0, 3, k, v, mu), -EINVAL);
	cr_assert_eq(bd_kv_write_token(&l, NULL, slot, 0, 0, 3, k, v, mu), -EINVAL);
	cr_assert_eq(bd_kv_write_token(NULL, cfg, slot, 0, 0, 3, k, v, mu), -EINVAL);
	cr_assert_eq(memcmp(slot, before, l.slot_bytes), 0);

	/* rotation needs a power-of-two d */
	struct bd_layout l96 = layout_ok(BD_PAGE_NVFP4, 1, 1, 96, 0, 1);
	uint8_t *s96 = calloc(1, l96.slot_bytes), *z96 = calloc(1, l96.slot_bytes);
	float k96[96] = { 0 }, v96[96] = { 0 };
	cr_assert_eq(bd_kv_write_token(&l96, cfg, s96, 0, 0, 0, k96, v96, NULL), -EINVAL);
	cr_assert_eq(memcmp(s96, z96, l96.slot_bytes), 0);
	cr_assert_eq(bd_kv_write_token(&l96, cfg_named("-hadamard"), s96, 0, 0, 0, k96, v96, NULL),
		     0);
	free(slot), free(before), free(s96), free(z96);
}

/* ---- promotion ---------------------------------------------------------------------------- */

Test(layout, promote_matches_write_head)
{
	enum { L = 2, H = 2, D = 64, NP = 8, PG = 5 };
	struct bd_layout l = layout_ok(BD_PAGE_NVFP4, L, H, D, 0, NP);
	const struct bd_kvcfg *cfg = cfg_named("bitdecoding-nvfp4");
	uint8_t *slot = calloc(1, l.slot_bytes);
	uint8_t *arena = malloc(l.arena_bytes), *scratch = malloc(l.page_bytes);
	float k[D], v[D], mu[D];

	memset(arena, 0xa5, l.arena_bytes);
	fill_f32(mu, D, 100, 0.3f);
	for (int a = 0; a < L; a++)
		for (int h = 0; h < H; h++)
			for (int p = 0; p < 128; p++) {
				uint64_t seed = 1000 + (uint64_t)((a * H + h) * 128 + p);

				fill_f32(k, D, seed, (float)(1 + a + h));
				fill_f32(v, D, seed + 77777, 1.0f);
				k[3] *= 6.0f; /* an outlier channel */
				cr_assert_eq(bd_kv_write_token(&l, cfg, slot, a, h, p, k, v, mu), 0);
			}
	cr_assert_eq(bd_page_promote(&l, cfg, NULL, slot, arena, PG), 0);

	for (int a = 0; a < L; a++) {
		const uint8_t *pg = arena + (size_t)a * l.layer_stride + PG * l.page_bytes;

		cr_assert_eq(bd_layout_page(&l, arena, a, PG), pg);
		memset(scratch, 0xa5, l.page_bytes);
		for (int h = 0; h < H; h++)
			cr_assert_eq(bd_page_write_head(&l, cfg, bd_slot_recent_k(&l, slot, a, h),
							bd_slot_recent_v(&l, slot, a, h), NULL,
							scratch, h), 0);
		/* every head region, the g table and the padding after it */
		cr_assert_eq(memcmp(pg, scratch, l.page_bytes), 0, "layer %d", a);
		for (int h = 0; h < H; h++)
			cr_assert(page_g(&l, pg, h, 0) > 0.0f && page_g(&l, pg, h, 1) > 0.0f);
		for (int p = 0; p < NP; p++) {
			const uint8_t *q = arena + (size_t)a * l.layer_stride + (size_t)p * l.page_bytes;

			if (p == PG)
				continue;
			for (size_t i = 0; i < l.page_bytes; i++)
				cr_assert_eq(q[i], 0xa5, "layer %d page %d byte %zu", a, p, i);
		}
	}

	/* bad page ids and a non-finite slot leave the arena as it was */
	uint8_t *copy = malloc(l.arena_bytes);
	memcpy(copy, arena, l.arena_bytes);
	cr_assert_eq(bd_page_promote(&l, cfg, NULL, slot, arena, -1), -EINVAL);
	cr_assert_eq(bd_page_promote(&l, cfg, NULL, slot, arena, NP), -EINVAL);
	cr_assert_eq(bd_page_promote(&l, NULL, NULL, slot, arena, 1), -EINVAL);
	cr_assert_eq(bd_page_promote(&l, cfg, NULL, NULL, arena, 1), -EINVAL);
	cr_assert_eq(bd_page_promote(&l, cfg, NULL, slot, NULL, 1), -EINVAL);
	bd_slot_recent_v(&l, slot, 1, 1)[77] = 0x7f80; /* +inf in the last head */
	cr_assert_eq(bd_page_promote(&l, cfg, NULL, slot, arena, 1), -EDOM);
	cr_assert_eq(memcmp(copy, arena, l.arena_bytes), 0);
	free(slot), free(arena), free(scratch), free(copy);
}

Test(layout, promote_fp8_scales)
{
	enum { L = 2, H = 3, D = 32, NP = 2 };
	struct bd_layout l = layout_ok(BD_PAGE_FP8, L, H, D, 0, NP);
	const struct bd_kvcfg *cfg = cfg_named("fp8");
	uint8_t *slot = calloc(1, l.slot_bytes), *arena = calloc(1, l.arena_bytes);
	float k[D], v[D], sc[L][H][2];

	for (int a = 0; a < L; a++)
		for (int h = 0; h < H; h++) {
			sc[a][h][0] = 0.01f * (float)(1 + a * H + h);
			sc[a][h][1] = 0.02f * (float)(1 + a * H + h);
			for (int p = 0; p < 128; p++) {
				fill_f32(k, D, (uint64_t)(7 * p + a * 1000 + h * 100), 1.0f);
				fill_f32(v, D, (uint64_t)(9 * p + a * 1000 + h * 100 + 1), 1.0f);
				cr_assert_eq(bd_kv_write_token(&l, cfg, slot, a, h, p, k, v, NULL), 0);
			}
		}
	cr_assert_eq(bd_page_promote(&l, cfg, NULL, slot, arena, 1), -EINVAL);
	sc[1][2][1] = 0.0f;
	cr_assert_eq(bd_page_promote(&l, cfg, &sc[0][0][0], slot, arena, 1), -EINVAL);
	for (size_t i = 0; i < l.arena_bytes; i++)
		cr_assert_eq(arena[i], 0);
	sc[1][2][1] = 0.5f;
	cr_assert_eq(bd_page_promote(&l, cfg, &sc[0][0][0], slot, arena, 1), 0);
	for (int a = 0; a < L; a++)
		for (int h = 0; h < H; h++) {
			const uint8_t *pg = bd_layout_page(&l, arena, a, 1);
			const bd_bf16 *rk = bd_slot_recent_k(&l, slot, a, h);

			cr_assert(page_g(&l, pg, h, 0) == sc[a][h][0]);
			cr_assert(page_g(&l, pg, h, 1) == sc[a][h][1]);
			for (size_t i = 0; i < 128 * D; i++)
				cr_assert_eq(pg[(size_t)h * l.head_bytes + l.k_codes_off + i],
					     bd_e4m3_encode(bd_bf16_to_f32(rk[i]) / sc[a][h][0]));
		}
	free(slot), free(arena);
}
