/* testgen.c — seeded random inputs for tests and benchmarks (testgen.h). */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/bd_rand.h"
#include "quant/bd_kvcfg.h"
#include "testgen.h"

uint64_t tg_next(struct tg_rng *r)
{
	return bd_splitmix64(&r->s);
}

double tg_unit(struct tg_rng *r)
{
	return ((double)(tg_next(r) >> 11) + 0.5) / 9007199254740992.0;
}

float tg_gauss(struct tg_rng *r)
{
	double u = tg_unit(r), v = tg_unit(r);

	return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}

double tg_uniform(struct tg_rng *r)
{
	return (double)(tg_next(r) >> 11) * 0x1p-53;
}

double tg_normal(struct tg_rng *r)
{
	double u1 = 1.0 - tg_uniform(r), u2 = tg_uniform(r);

	return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

float tg_norm4(struct tg_rng *r)
{
	uint64_t x = tg_next(r);
	float s = 0.0f;

	for (int i = 0; i < 4; i++)
		s += (float)((x >> (16 * i)) & 0xffff) * (1.0f / 65536.0f);
	return (s - 2.0f) * 1.7320508f;
}

void tg_shuffle_i32(struct tg_rng *r, int32_t *a, size_t n)
{
	for (size_t i = n; i-- > 1;) {
		size_t j = (size_t)(tg_next(r) % (uint64_t)(i + 1));
		int32_t t = a[i];

		a[i] = a[j];
		a[j] = t;
	}
}

void tg_fill_gauss(struct tg_rng *r, float *x, size_t n, float scale)
{
	for (size_t i = 0; i < n; i++)
		x[i] = scale * tg_gauss(r);
}

void tg_fill_queries(struct tg_rng *r, float *q, size_t n_heads, int d)
{
	tg_fill_gauss(r, q, n_heads * (size_t)d, 1.5f);
	for (size_t h = 0; h < n_heads; h++)
		q[h * (size_t)d + (size_t)(tg_next(r) % (uint64_t)d)] *= 6.0f;
}

double tg_rel_l2(const float *a, const float *ref, size_t n)
{
	double num = 0.0, den = 0.0;

	for (size_t i = 0; i < n; i++) {
		double e = (double)a[i] - (double)ref[i];

		num += e * e;
		den += (double)ref[i] * (double)ref[i];
	}
	return sqrt(num / den);
}

/* The tokens of a paged problem: keys, values and μ_k as tg_paged_build says. */
static int paged_write(struct tg_paged *P, struct tg_rng *r, int L, bool unit_v)
{
	const struct bd_kvcfg *cfg = P->cfg;
	const int d = P->d, Hkv = P->Hkv, LH = L * Hkv, n = P->n;
	float *bias = malloc(sizeof(float) * (size_t)LH * (size_t)d);
	float *mu = malloc(sizeof(float) * (size_t)LH * (size_t)d);
	int *outl = malloc(sizeof(int) * 6 * (size_t)LH);
	float *k = malloc(sizeof(float) * (size_t)d), *v = malloc(sizeof(float) * (size_t)d);
	float *fp8s = malloc(sizeof(float) * 2 * (size_t)LH);
	int e = 0;

	if (!bias || !mu || !outl || !k || !v || !fp8s) {
		e = -ENOMEM;
		goto out;
	}
	for (int i = 0; i < 2 * LH; i++)
		fp8s[i] = 0.25f; /* E4M3 codes of x / 0.25: |x| up to 112 */
	for (int lh = 0; lh < LH; lh++) {
		for (int c = 0; c < d; c++) {
			bias[lh * d + c] = 2.0f * tg_gauss(r);
			mu[lh * d + c] = bias[lh * d + c] + 0.1f * tg_gauss(r);
		}
		for (int j = 0; j < 6; j++)
			outl[lh * 6 + j] = (int)(tg_next(r) % (uint64_t)d);
	}
	for (int pos = 0; pos < n && e == 0; pos++) {
		for (int lh = 0; lh < LH && e == 0; lh++) {
			for (int c = 0; c < d; c++) {
				k[c] = bias[lh * d + c] + tg_gauss(r);
				v[c] = tg_gauss(r);
			}
			for (int j = 0; j < 3; j++) {
				k[outl[lh * 6 + j]] *= 12.0f;
				v[outl[lh * 6 + j + 3]] *= 8.0f;
			}
			for (int c = 0; c < d && unit_v; c++)
				v[c] = 1.0f;
			e = bd_kv_write_token(&P->lay, cfg, P->slot, lh / Hkv, lh % Hkv, pos, k, v,
					      mu + lh * d);
		}
		if (e == 0 && (pos + 1) % BD_PAGE_TOKENS == 0 && pos + 1 < n)
			e = bd_page_promote(&P->lay, cfg, cfg->page_fmt == BD_PAGE_FP8 ? fp8s : NULL,
					    P->slot, P->arena, P->bt[pos / BD_PAGE_TOKENS]);
	}
out:
	free(bias);
	free(mu);
	free(outl);
	free(k);
	free(v);
	free(fp8s);
	return e < 0 ? e : 0;
}

int tg_paged_build(struct tg_paged *P, const struct bd_kvcfg *cfg, int L, int Hkv, int G, int d,
		   int n, int extra_pages, int n_q, uint64_t seed, bool unit_v)
{
	struct tg_rng r = { seed };
	size_t n_pages = (size_t)((n - 1) / BD_PAGE_TOKENS) + (size_t)extra_pages;
	size_t nq = (size_t)n_q * (size_t)G * (size_t)d;
	int e;

	*P = (struct tg_paged){ .cfg = cfg, .n = n, .d = d, .Hkv = Hkv, .G = G };
	if ((e = bd_layout_init(&P->lay, cfg->page_fmt, L, Hkv, d, 0, n_pages)) < 0)
		return e;
	P->arena = calloc(1, P->lay.arena_bytes);
	P->slot = calloc(1, P->lay.slot_bytes);
	P->bt = malloc(sizeof(int32_t) * n_pages);
	P->q = malloc(sizeof(float) * nq);
	if (!P->arena || !P->slot || !P->bt || !P->q) {
		tg_paged_free(P);
		return -ENOMEM;
	}
	for (size_t i = 0; i < n_pages; i++)
		P->bt[i] = (int32_t)i;
	tg_shuffle_i32(&r, P->bt, n_pages);
	if ((e = paged_write(P, &r, L, unit_v)) < 0) {
		tg_paged_free(P);
		return e;
	}
	tg_fill_queries(&r, P->q, (size_t)n_q * (size_t)G, d);
	for (size_t i = 0; i < nq && unit_v; i++)
		P->q[i] = 0.0f;
	return 0;
}

void tg_paged_free(struct tg_paged *P)
{
	free(P->arena);
	free(P->slot);
	free(P->bt);
	free(P->q);
	memset(P, 0, sizeof(*P));
}

struct bd_kv_view tg_paged_view(const struct tg_paged *P, int layer, int head)
{
	return (struct bd_kv_view){ .lay = &P->lay, .arena = P->arena, .block_table = P->bt,
				    .slot = P->slot, .layer = layer, .kv_head = head,
				    .n_tokens = P->n };
}
