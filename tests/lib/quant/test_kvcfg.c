/* test_kvcfg.c — the configuration table's names and normalization variants (bd_kvcfg.h), and
 * the eval-time emulated configurations (bd_kvemul.h). */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <criterion/criterion.h>

#include "quant/bd_kvcfg.h"
#include "quant/bd_kvemul.h"
#include "quant/bd_layout.h"
#include "testgen.h"

Test(kvcfg, norm_variants_by_name)
{
	const struct bd_kvcfg *nv = bd_kvcfg_find("bitdecoding-nvfp4");
	const struct bd_kvcfg *q = bd_kvcfg_find("bitdecoding-nvfp4:norm=qmass");

	cr_assert(nv && q && nv != q);
	cr_assert_eq(nv->p_norm, BD_NORM_L);
	cr_assert_eq(q->p_norm, BD_NORM_QMASS);
	cr_assert_str_eq(q->name, "bitdecoding-nvfp4:norm=qmass");
	/* everything else is the table entry's */
	cr_assert(q->page_fmt == nv->page_fmt && q->p_quant == nv->p_quant && q->sink == nv->sink &&
		  q->smoothing == nv->smoothing && q->hadamard == nv->hadamard &&
		  q->key_search == nv->key_search && q->query_terms == nv->query_terms);
	/* the same object by name and by variant; the own norm is the entry itself */
	cr_assert_eq(bd_kvcfg_variant(nv, BD_NORM_QMASS), q);
	cr_assert_eq(bd_kvcfg_variant(q, BD_NORM_L), nv);
	cr_assert_eq(bd_kvcfg_find("bitdecoding-nvfp4:norm=l"), nv);
	/* bdfp4-mxfp4 is the MXFP4 recipe under the quantized mass; its ℓ variant is named */
	const struct bd_kvcfg *b = bd_kvcfg_find("bdfp4-mxfp4");
	const struct bd_kvcfg *mx = bd_kvcfg_find("bitdecoding-mxfp4");
	cr_assert(b && mx && b->p_norm == BD_NORM_QMASS && b->p_quant == mx->p_quant &&
		  b->page_fmt == mx->page_fmt);
	const struct bd_kvcfg *bl = bd_kvcfg_find("bdfp4-mxfp4:norm=l");
	cr_assert(bl && bl->p_norm == BD_NORM_L);
	cr_assert_str_eq(bl->name, "bdfp4-mxfp4:norm=l");
	/* every table entry has both variants, distinct and named after it */
	for (int i = 0; i < BD_KVCFG_COUNT; i++) {
		const struct bd_kvcfg *c = bd_kvcfg_get(i);
		const struct bd_kvcfg *a = bd_kvcfg_variant(c, BD_NORM_L);
		const struct bd_kvcfg *z = bd_kvcfg_variant(c, BD_NORM_QMASS);
		cr_assert(a && z && a != z && (a == c || z == c));
		cr_assert_eq(strncmp(z->name, c->name, strlen(c->name)), 0);
		cr_assert_eq(bd_kvcfg_find(z->name), z);
		cr_assert_eq(bd_kvcfg_find(a->name), a);
	}
}

Test(kvcfg, bad_names)
{
	static const char *const bad[] = { "", "bitdecoding", "bitdecoding-nvfp4:", ":norm=qmass",
					   "bitdecoding-nvfp4:norm=", "bitdecoding-nvfp4:norm=lq",
					   "bitdecoding-nvfp4:qmass", "bitdecoding-nvfp4:norm=qmass:x",
					   "emu-nvfp4" };
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
		cr_assert_null(bd_kvcfg_find(bad[i]), "'%s' must be unknown", bad[i]);
	cr_assert_null(bd_kvcfg_find(NULL));
	struct bd_kvcfg copy = *bd_kvcfg_get(0);
	cr_assert_null(bd_kvcfg_variant(&copy, BD_NORM_QMASS), "only the table's objects");
	cr_assert_null(bd_kvcfg_variant(NULL, BD_NORM_QMASS));
	cr_assert_null(bd_kvcfg_variant(bd_kvcfg_get(0), (enum bd_pnorm)7));
	/* emulated configurations are eval-kl's only */
	cr_assert_null(bd_kvemul_find("bitdecoding-nvfp4"));
	cr_assert_null(bd_kvemul_find(NULL));
}

/* A page-head through the emulation: FP8 K keeps every value within E4M3's half step of the
 * page scale; NVFP4 V equals the real quantizer's dequantized page (both from the same g and
 * block rule); the optimal scale choice never has a larger squared error than the paper's
 * search; bad input changes nothing. */
Test(kvemul, page_head)
{
	enum { T = BD_PAGE_TOKENS, D = 64 };
	struct tg_rng r = { 77 };
	bd_bf16 *k0 = malloc(sizeof(bd_bf16) * T * D), *v0 = malloc(sizeof(bd_bf16) * T * D);
	bd_bf16 *k = malloc(sizeof(bd_bf16) * T * D), *v = malloc(sizeof(bd_bf16) * T * D);
	float *rk = malloc(sizeof(float) * T * D), *rv = malloc(sizeof(float) * T * D);
	cr_assert(k0 && v0 && k && v && rk && rv);
	for (int i = 0; i < T * D; i++) {
		k0[i] = bd_f32_to_bf16(3.0f * tg_gauss(&r));
		v0[i] = bd_f32_to_bf16(tg_gauss(&r));
	}

	const struct bd_kvcfg *k8 = bd_kvemul_find("emu-k8v4");
	cr_assert(k8 && k8->emul && k8->page_fmt == BD_PAGE_BF16);
	memcpy(k, k0, sizeof(bd_bf16) * T * D);
	memcpy(v, v0, sizeof(bd_bf16) * T * D);
	cr_assert_eq(bd_kvemul_head(k8, k, v, D, D), 0);
	float amax = 0.0f;
	for (int i = 0; i < T * D; i++)
		amax = fmaxf(amax, fabsf(bd_bf16_to_f32(k0[i])));
	for (int i = 0; i < T * D; i++) {
		float x = bd_bf16_to_f32(k0[i]), y = bd_bf16_to_f32(k[i]);
		/* E4M3: 3 mantissa bits (relative half step 1/16), subnormal step 2^-9 of the scale,
		 * then BF16 */
		cr_assert(fabsf(y - x) <= fabsf(x) / 15.0f + amax / 448.0f * 0x1p-9f,
			  "k[%d] %g → %g", i, x, y);
	}

	/* V under emu-nvfp4 against the real NVFP4 page writer's values */
	const struct bd_kvcfg *nv = bd_kvemul_find("emu-nvfp4");
	const struct bd_kvcfg *real = bd_kvcfg_find("nvfp4-base");
	struct bd_layout lay;
	cr_assert_eq(bd_layout_init(&lay, BD_PAGE_NVFP4, 1, 1, D, 0, 1), 0);
	uint8_t *page = calloc(1, lay.page_bytes);
	cr_assert(page);
	cr_assert_eq(bd_page_write_head(&lay, real, k0, v0, NULL, page, 0), 0);
	cr_assert_eq(bd_page_read_head(&lay, page, 0, rk, rv, NULL), 0);
	memcpy(k, k0, sizeof(bd_bf16) * T * D);
	memcpy(v, v0, sizeof(bd_bf16) * T * D);
	cr_assert_eq(bd_kvemul_head(nv, k, v, D, D), 0);
	for (int i = 0; i < T * D; i++)
		cr_assert_eq(bd_bf16_to_f32(v[i]), bd_bf16_to_f32(bd_f32_to_bf16(rv[i])),
			     "v[%d]", i);

	/* the error-minimizing scale choice: per block never worse than κ ∈ {6, 4} */
	const struct bd_kvcfg *opt = bd_kvemul_find("emu-kopt");
	bd_bf16 *ks = malloc(sizeof(bd_bf16) * T * D);
	cr_assert(ks);
	memcpy(ks, k0, sizeof(bd_bf16) * T * D);
	memcpy(k, k0, sizeof(bd_bf16) * T * D);
	cr_assert_eq(bd_kvemul_head(nv, ks, v, D, D), 0);
	cr_assert_eq(bd_kvemul_head(opt, k, v, D, D), 0);
	double e_s = 0.0, e_o = 0.0;
	for (int i = 0; i < T * D; i++) {
		double x = bd_bf16_to_f32(k0[i]);
		e_s += (bd_bf16_to_f32(ks[i]) - x) * (bd_bf16_to_f32(ks[i]) - x);
		e_o += (bd_bf16_to_f32(k[i]) - x) * (bd_bf16_to_f32(k[i]) - x);
	}
	cr_assert(e_o < e_s, "optimal %g, search %g", e_o, e_s);

	/* a non-finite value: -EDOM and nothing changed */
	memcpy(k, k0, sizeof(bd_bf16) * T * D);
	k[5] = bd_f32_to_bf16(NAN);
	memcpy(v, v0, sizeof(bd_bf16) * T * D);
	cr_assert_eq(bd_kvemul_head(nv, k, v, D, D), -EDOM);
	cr_assert_eq(memcmp(v, v0, sizeof(bd_bf16) * T * D), 0);
	cr_assert_eq(memcmp(k + 6, k0 + 6, sizeof(bd_bf16) * (T * D - 6)), 0);
	cr_assert_eq(bd_kvemul_head(bd_kvcfg_find("bf16"), k, v, D, D), -EINVAL);
	cr_assert_eq(bd_kvemul_head(nv, k, v, 48, D), -EINVAL);
	free(k0), free(v0), free(k), free(v), free(rk), free(rv), free(page), free(ks);
}
