/* test_qerr.c — the logit error split of bd_qerr.h (paper Eq. 2) on caches built through the
 * real KV write path. */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant/bd_layout.h"
#include "quant/bd_qerr.h"
#include "testgen.h"

/* A one-layer, one-KV-head cache of n tokens written token by token, pages promoted as a
 * server would (after the token that fills them, leaving 1..128 recent tokens). */
struct cache {
	struct bd_layout lay;
	void *arena, *slot;
	int32_t *bt;
	struct bd_kv_view kv;
};

static void cache_build(struct cache *c, const struct bd_kvcfg *cfg, int d, int n, const float *k,
			const float *v, const float *mu)
{
	int n_full = (n - 1) / BD_PAGE_TOKENS;
	size_t n_pages = n_full > 0 ? (size_t)n_full : 1;

	memset(c, 0, sizeof(*c));
	cr_assert_eq(bd_layout_init(&c->lay, cfg->page_fmt, 1, 1, d, 0, n_pages), 0);
	c->arena = aligned_alloc(BD_PAGE_ALIGN, c->lay.arena_bytes);
	c->slot = aligned_alloc(BD_PAGE_ALIGN, c->lay.slot_bytes);
	c->bt = calloc(n_pages, sizeof(*c->bt));
	cr_assert(c->arena && c->slot && c->bt);
	memset(c->arena, 0, c->lay.arena_bytes);
	memset(c->slot, 0, c->lay.slot_bytes);
	for (int p = 0; p < n_full; p++)
		c->bt[p] = (int32_t)(n_full - 1 - p); /* a non-identity block table */
	for (int t = 0; t < n; t++) {
		cr_assert_eq(bd_kv_write_token(&c->lay, cfg, c->slot, 0, 0, t, k + (size_t)t * d,
					       v + (size_t)t * d, mu),
			     0);
		if (t % BD_PAGE_TOKENS == BD_PAGE_TOKENS - 1 && t / BD_PAGE_TOKENS < n_full)
			cr_assert_eq(bd_page_promote(&c->lay, cfg, NULL, c->slot, c->arena,
						     c->bt[t / BD_PAGE_TOKENS]),
				     0);
	}
	c->kv = (struct bd_kv_view){ .lay = &c->lay, .arena = c->arena, .block_table = c->bt,
				     .slot = c->slot, .layer = 0, .kv_head = 0, .n_tokens = n };
}

static void cache_free(struct cache *c)
{
	free(c->arena);
	free(c->slot);
	free(c->bt);
}

/* Keys with a per-channel bias and two outlier channels, the structure §3 is about. */
static void random_keys(float *k, int n, int d, uint64_t seed)
{
	struct tg_rng r = { seed };

	for (int t = 0; t < n; t++)
		for (int c = 0; c < d; c++) {
			float bias = c == 3 ? 25.0f : c == 17 ? -18.0f : (float)(c % 5) - 2.0f;

			k[(size_t)t * d + c] = bias + tg_gauss(&r);
		}
}

/* Values v [nv], then queries q [nq], standard normal from one stream seeded with seed. */
static void random_vq(float *v, int nv, float *q, int nq, uint64_t seed)
{
	struct tg_rng r = { seed };

	tg_fill_gauss(&r, v, (size_t)nv, 1.0f);
	tg_fill_gauss(&r, q, (size_t)nq, 1.0f);
}

static void transform_all(const struct bd_kvcfg *cfg, const float *x, int n, int d,
			  const float *mu, float *ret)
{
	for (int t = 0; t < n; t++)
		cr_assert_eq(bd_qerr_transform(cfg, x + (size_t)t * d, mu, d, ret + (size_t)t * d), 0);
}

static void assert_rel(double got, double want, double rel)
{
	cr_assert(fabs(got - want) <= rel * fabs(want), "got %.17g want %.17g", got, want);
}

/* bf16, d = 32, one full page: k'_0 = 1 + 2^-10 (BF16 rounds it to 1), k'_1 = t (exact);
 * head 0 q' = (1 + 2^-9, 0.5, 0, …) (BF16: (1, 0.5, …)), head 1 q' = (1, 0.5, 0, …), σ = 1.
 * By hand, for every one of the 128 page keys:
 *   head 0: key = (1 + 2^-9)·(1 − (1 + 2^-10)) = −(2^-10 + 2^-19)
 *           query = (1 − (1 + 2^-9))·1 + (0.5 − 0.5)·t = −2^-9
 *           S̃ − S = 1 + 0.5t − (1 + 2^-9)(1 + 2^-10) − 0.5t = −(2^-9 + 2^-10 + 2^-19)
 *   head 1: key = −2^-10, query = 0, S̃ − S = −2^-10. */
Test(qerr, bf16_hand_case)
{
	enum { D = 32, N = 129 };
	const struct bd_kvcfg *cfg = bd_kvcfg_find("bf16");
	float *k = calloc((size_t)N * D, sizeof(float)), *v = calloc((size_t)N * D, sizeof(float));
	float q[2][D] = { { 1.0f + 0x1p-9f, 0.5f }, { 1.0f, 0.5f } };
	struct bd_qerr_sums s[2] = { 0 };
	struct cache c;

	for (int t = 0; t < N; t++) {
		k[(size_t)t * D] = 1.0f + 0x1p-10f;
		k[(size_t)t * D + 1] = (float)t;
		v[(size_t)t * D + 2] = 1.0f;
	}
	cache_build(&c, cfg, D, N, k, v, NULL);
	cr_assert_eq(bd_qerr_group(cfg, &c.kv, &q[0][0], 2, k, 1.0f, s), 0);

	double key0 = -(0x1p-10 + 0x1p-19), qry0 = -0x1p-9, e0 = -(0x1p-9 + 0x1p-10 + 0x1p-19);
	cr_assert_eq(s[0].n, 128);
	cr_assert_eq(s[1].n, 128);
	assert_rel(s[0].key_term / 128, key0 * key0, 1e-12);
	assert_rel(s[0].query_term / 128, qry0 * qry0, 1e-12);
	assert_rel(s[0].sq_err / 128, e0 * e0, 1e-12);
	assert_rel(s[0].cross_term / 128, 2 * key0 * qry0, 1e-12);
	assert_rel(s[1].key_term / 128, 0x1p-20, 1e-12);
	cr_assert_eq(s[1].query_term, 0.0);
	assert_rel(s[1].sq_err / 128, 0x1p-20, 1e-12);
	cache_free(&c);
	free(k);
	free(v);
}

/* BF16-exact keys survive the bf16 cache bit for bit, so the key term is exactly zero while a
 * non-BF16 query still has a query term; the default scale is 1/√d. */
Test(qerr, bf16_exact_keys_zero_key_term)
{
	enum { D = 64, N = 300, G = 3 };
	const struct bd_kvcfg *cfg = bd_kvcfg_find("bf16");
	float *k = malloc(sizeof(float) * N * D), *v = malloc(sizeof(float) * N * D);
	float q[G * D];
	struct bd_qerr_sums s1[G] = { 0 }, s0[G] = { 0 };
	struct cache c;

	random_keys(k, N, D, 11);
	for (int i = 0; i < N * D; i++)
		k[i] = bd_bf16_to_f32(bd_f32_to_bf16(k[i]));
	random_vq(v, N * D, q, G * D, 7);
	cache_build(&c, cfg, D, N, k, v, NULL);
	cr_assert_eq(bd_qerr_group(cfg, &c.kv, q, G, k, 1.0f, s1), 0);
	cr_assert_eq(bd_qerr_group(cfg, &c.kv, q, G, k, 0.0f, s0), 0);
	for (int g = 0; g < G; g++) {
		cr_assert_eq(s1[g].n, 256); /* n_full = 299/128 = 2 pages */
		cr_assert_eq(s1[g].key_term, 0.0);
		cr_assert_eq(s1[g].cross_term, 0.0);
		cr_assert_gt(s1[g].query_term, 0.0);
		assert_rel(s1[g].sq_err, s1[g].query_term, 1e-9);
		assert_rel(s0[g].query_term, s1[g].query_term / D, 1e-12);
	}
	cache_free(&c);
	free(k);
	free(v);
}

/* NVFP4 pages with outliers: the split is exact up to FP64 rounding (sq = key + query + cross);
 * the key term depends on the cache and q' only, so nvfp4-base and +dual share it, while the
 * dual-residual query cuts the query term, summed over 16 heads, by more than 10× (§3.1: the
 * second term quantizes the first's residual; a single head can be unlucky, the sum is ~100×). */
Test(qerr, nvfp4_split_identity_and_dual)
{
	enum { D = 128, N = 3 * 128 + 40, G = 16 };
	const struct bd_kvcfg *base = bd_kvcfg_find("nvfp4-base"), *dual = bd_kvcfg_find("+dual");
	double qt_base = 0, qt_dual = 0;
	float *k = malloc(sizeof(float) * N * D), *v = malloc(sizeof(float) * N * D);
	float q[G * D];
	struct bd_qerr_sums sb[G] = { 0 }, sd[G] = { 0 };
	struct cache c;

	random_keys(k, N, D, 5);
	random_vq(v, N * D, q, G * D, 99);
	cache_build(&c, base, D, N, k, v, NULL);
	cr_assert_eq(bd_qerr_group(base, &c.kv, q, G, k, 0.0f, sb), 0);
	cr_assert_eq(bd_qerr_group(dual, &c.kv, q, G, k, 0.0f, sd), 0);
	for (int g = 0; g < G; g++) {
		cr_assert_eq(sb[g].n, 3 * 128);
		cr_assert_gt(sb[g].key_term, 0.0);
		assert_rel(sb[g].sq_err, sb[g].key_term + sb[g].query_term + sb[g].cross_term, 1e-9);
		assert_rel(sd[g].sq_err, sd[g].key_term + sd[g].query_term + sd[g].cross_term, 1e-9);
		cr_assert_eq(sd[g].key_term, sb[g].key_term);
		qt_base += sb[g].query_term;
		qt_dual += sd[g].query_term;
	}
	cr_assert_lt(qt_dual * 10.0, qt_base, "%g %g", qt_dual, qt_base);
	cache_free(&c);
	free(k);
	free(v);
}

/* With cfg->sink the first 16 tokens are decoded in BF16, not from page 0: they are not
 * counted and their reference rows are never read (even NaN there is fine); the same cache
 * without sink (+keyquant) counts them and rejects the NaN. */
Test(qerr, sink_tokens_excluded)
{
	enum { D = 128, N = 2 * 128 + 1, G = 2 };
	const struct bd_kvcfg *bd = bd_kvcfg_find("bitdecoding-nvfp4");
	const struct bd_kvcfg *kq = bd_kvcfg_find("+keyquant");
	float *k = malloc(sizeof(float) * N * D), *v = malloc(sizeof(float) * N * D);
	float *kp = malloc(sizeof(float) * N * D), mu[D] = { 0 }, q[G * D], qp[G * D];
	struct bd_qerr_sums s_ok[G] = { 0 }, s_nan[G] = { 0 }, s_kq[G], s_kq_before[G];
	struct cache c;

	random_keys(k, N, D, 8);
	random_vq(v, N * D, q, G * D, 3);
	for (int t = 0; t < N; t++)
		for (int i = 0; i < D; i++)
			mu[i] += k[(size_t)t * D + i] / N;
	cache_build(&c, bd, D, N, k, v, mu);
	transform_all(bd, k, N, D, mu, kp);
	transform_all(bd, q, G, D, NULL, qp);
	cr_assert_eq(bd_qerr_group(bd, &c.kv, qp, G, kp, 0.0f, s_ok), 0);
	for (int i = 0; i < BD_SINK_TOKENS * D; i++)
		kp[i] = NAN;
	cr_assert_eq(bd_qerr_group(bd, &c.kv, qp, G, kp, 0.0f, s_nan), 0);
	for (int g = 0; g < G; g++) {
		cr_assert_eq(s_ok[g].n, 2 * 128 - BD_SINK_TOKENS);
		cr_assert(memcmp(&s_ok[g], &s_nan[g], sizeof(s_ok[g])) == 0);
		s_kq[g] = (struct bd_qerr_sums){ .n = 5, .key_term = 1.5 };
	}
	memcpy(s_kq_before, s_kq, sizeof(s_kq));
	cr_assert_eq(bd_qerr_group(kq, &c.kv, qp, G, kp, 0.0f, s_kq), -EDOM);
	cr_assert(memcmp(s_kq, s_kq_before, sizeof(s_kq)) == 0);
	transform_all(kq, k, BD_SINK_TOKENS, D, mu, kp);
	cr_assert_eq(bd_qerr_group(kq, &c.kv, qp, G, kp, 0.0f, s_kq), 0);
	for (int g = 0; g < G; g++)
		cr_assert_eq(s_kq[g].n, 5 + 2 * 128);
	cache_free(&c);
	free(k);
	free(v);
	free(kp);
}

/* Fewer than 129 tokens: no full page, nothing to count. */
Test(qerr, no_full_page)
{
	enum { D = 32, N = 128 };
	const struct bd_kvcfg *cfg = bd_kvcfg_find("nvfp4-base");
	float *k = calloc((size_t)N * D, sizeof(float)), *v = calloc((size_t)N * D, sizeof(float));
	float q[D] = { 1.0f };
	struct bd_qerr_sums s = { 0 };
	struct cache c;

	cache_build(&c, cfg, D, N, k, v, NULL);
	cr_assert_eq(bd_qerr_group(cfg, &c.kv, q, 1, NULL, 0.0f, &s), 0);
	cr_assert_eq(s.n, 0);
	cr_assert_eq(s.sq_err, 0.0);
	cache_free(&c);
	free(k);
	free(v);
}

/* H(x − μ) by hand for d = 2: H = [[1, 1], [1, −1]]/√2.
 * x = (3, 1), μ = (1, 1): smoothing + Hadamard → (2, 0)·H = (√2, √2);
 * Hadamard only (μ ignored) → (4, 2)/√2 = (2√2, √2); neither → a copy. */
Test(qerr, transform_by_hand)
{
	const float x[2] = { 3.0f, 1.0f }, mu[2] = { 1.0f, 1.0f };
	float y[2];

	cr_assert_eq(bd_qerr_transform(bd_kvcfg_find("+keyquant"), x, mu, 2, y), 0);
	cr_assert_float_eq(y[0], sqrtf(2.0f), 1e-6f);
	cr_assert_float_eq(y[1], sqrtf(2.0f), 1e-6f);
	cr_assert_eq(bd_qerr_transform(bd_kvcfg_find("-smoothing"), x, mu, 2, y), 0);
	cr_assert_float_eq(y[0], 2.0f * sqrtf(2.0f), 1e-6f);
	cr_assert_float_eq(y[1], sqrtf(2.0f), 1e-6f);
	cr_assert_eq(bd_qerr_transform(bd_kvcfg_find("-hadamard"), x, mu, 2, y), 0);
	cr_assert_eq(y[0], 2.0f);
	cr_assert_eq(y[1], 0.0f);
	cr_assert_eq(bd_qerr_transform(bd_kvcfg_find("bf16"), x, mu, 2, y), 0);
	cr_assert_eq(y[0], 3.0f);
	cr_assert_eq(y[1], 1.0f);
}

/* Dequantized queries by hand.
 * bf16: 1 + 2^-9 → 1 (below half an ulp of 2^-7), 1 + 3·2^-9 → 1 + 2^-7.
 * MXFP4 dual residual, d = 32: all 1.5 but element 5 = 1.25. Term 1: amax 1.5, e = −2, so 1.5·4 =
 * 6 → 6 and 1.25·4 = 5 → 4 (tie to even mantissa), i.e. 1.0 at element 5. The residual is 0.25
 * there and 0 elsewhere: e = floor(log2 0.25) − 2 = −4, 0.25·16 = 4 → 4. The sum is exact. */
Test(qerr, query_by_hand)
{
	float q[32], y[32];

	q[0] = 1.0f + 0x1p-9f;
	q[1] = 1.0f + 3 * 0x1p-9f;
	cr_assert_eq(bd_qerr_query(bd_kvcfg_find("bf16"), q, 2, y), 0);
	cr_assert_eq(y[0], 1.0f);
	cr_assert_eq(y[1], 1.0f + 0x1p-7f);

	for (int i = 0; i < 32; i++)
		q[i] = 1.5f;
	q[5] = 1.25f;
	cr_assert_eq(bd_qerr_query(bd_kvcfg_find("bitdecoding-mxfp4"), q, 32, y), 0);
	for (int i = 0; i < 32; i++)
		cr_assert_eq(y[i], q[i], "element %d: %g", i, (double)y[i]);
}

Test(qerr, bad_arguments_leave_outputs)
{
	enum { D = 32, N = 129 };
	const struct bd_kvcfg *cfg = bd_kvcfg_find("nvfp4-base");
	const struct bd_kvcfg bad_terms = { .name = "x", .page_fmt = BD_PAGE_NVFP4,
					    .query_terms = 0 };
	float *k = calloc((size_t)N * D, sizeof(float)), *v = calloc((size_t)N * D, sizeof(float));
	float q[D] = { 1.0f }, y[D], y_before[D];
	struct bd_qerr_sums s = { .n = 42, .sq_err = 1.0, .key_term = 2.0, .query_term = 3.0,
				  .cross_term = 4.0 },
			    before = s;
	struct bd_kv_view kv;
	struct cache c;

	cache_build(&c, cfg, D, N, k, v, NULL);
	cr_assert_eq(bd_qerr_group(NULL, &c.kv, q, 1, k, 0.0f, &s), -EINVAL);
	cr_assert_eq(bd_qerr_group(cfg, NULL, q, 1, k, 0.0f, &s), -EINVAL);
	cr_assert_eq(bd_qerr_group(cfg, &c.kv, NULL, 1, k, 0.0f, &s), -EINVAL);
	cr_assert_eq(bd_qerr_group(cfg, &c.kv, q, 0, k, 0.0f, &s), -EINVAL);
	cr_assert_eq(bd_qerr_group(cfg, &c.kv, q, 1, NULL, 0.0f, &s), -EINVAL);
	cr_assert_eq(bd_qerr_group(cfg, &c.kv, q, 1, k, -1.0f, &s), -EINVAL);
	cr_assert_eq(bd_qerr_group(cfg, &c.kv, q, 1, k, NAN, &s), -EINVAL);
	/* a bf16 configuration cannot read NVFP4 pages */
	cr_assert_eq(bd_qerr_group(bd_kvcfg_find("bf16"), &c.kv, q, 1, k, 0.0f, &s), -EINVAL);
	cr_assert_eq(bd_qerr_group(&bad_terms, &c.kv, q, 1, k, 0.0f, &s), -EINVAL);
	kv = c.kv;
	kv.n_tokens = 0;
	cr_assert_eq(bd_qerr_group(cfg, &kv, q, 1, k, 0.0f, &s), -EINVAL);
	kv = c.kv;
	c.bt[0] = 1; /* only page 0 exists */
	cr_assert_eq(bd_qerr_group(cfg, &kv, q, 1, k, 0.0f, &s), -EINVAL);
	c.bt[0] = 0;
	kv.block_table = NULL;
	cr_assert_eq(bd_qerr_group(cfg, &kv, q, 1, k, 0.0f, &s), -EINVAL);
	q[3] = INFINITY;
	cr_assert_eq(bd_qerr_group(cfg, &c.kv, q, 1, k, 0.0f, &s), -EDOM);
	q[3] = 0.0f;
	k[127 * D + 31] = NAN;
	cr_assert_eq(bd_qerr_group(cfg, &c.kv, q, 1, k, 0.0f, &s), -EDOM);
	cr_assert(memcmp(&s, &before, sizeof(s)) == 0);

	for (int i = 0; i < D; i++)
		y[i] = y_before[i] = -7.0f;
	cr_assert_eq(bd_qerr_query(&bad_terms, q, D, y), -EINVAL);
	cr_assert_eq(bd_qerr_query(cfg, q, 0, y), -EINVAL);
	q[0] = NAN;
	cr_assert_eq(bd_qerr_query(cfg, q, D, y), -EDOM);
	cr_assert_eq(bd_qerr_query(bd_kvcfg_find("bf16"), q, D, y), -EDOM);
	cr_assert_eq(bd_qerr_transform(cfg, q, NULL, D, y), -EDOM);
	q[0] = 1.0f;
	cr_assert_eq(bd_qerr_transform(bd_kvcfg_find("+keyquant"), q, NULL, 48, y), -EINVAL);
	cr_assert_eq(bd_qerr_transform(cfg, q, NULL, 0, y), -EINVAL);
	cr_assert_eq(bd_qerr_transform(NULL, q, NULL, D, y), -EINVAL);
	cr_assert(memcmp(y, y_before, sizeof(y)) == 0);
	cache_free(&c);
	free(k);
	free(v);
}
