/* qerr.c — the logit error split of bd_qerr.h (paper §3.1, Eq. 2). */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "quant/bd_fp4.h"
#include "quant/bd_layout.h"
#include "quant/bd_qerr.h"

static bool is_pow2(int d)
{
	return d > 0 && (d & (d - 1)) == 0;
}

static bool fp4_page(enum bd_page_format f)
{
	return f == BD_PAGE_NVFP4 || f == BD_PAGE_MXFP4;
}

int bd_qerr_transform(const struct bd_kvcfg *cfg, const float *x, const float *mu, int d,
		      float *ret_x)
{
	float t[BD_FWHT_MAX];

	if (!cfg || !x || !ret_x || d < 1 || d > BD_FWHT_MAX || (cfg->hadamard && !is_pow2(d)))
		return -EINVAL;
	if (!bd_all_finite(x, (size_t)d) || (mu && !bd_all_finite(mu, (size_t)d)))
		return -EDOM;
	/* same FP32 operations, in the same order, as the KV write path before its BF16 rounding */
	for (int i = 0; i < d; i++)
		t[i] = cfg->smoothing && mu ? x[i] - mu[i] : x[i];
	if (!bd_all_finite(t, (size_t)d))
		return -EDOM;
	if (cfg->hadamard) {
		int r = bd_fwht(t, d);

		if (r < 0)
			return r;
		if (!bd_all_finite(t, (size_t)d))
			return -EDOM;
	}
	memcpy(ret_x, t, (size_t)d * sizeof(*t));
	return 0;
}

int bd_qerr_query(const struct bd_kvcfg *cfg, const float *q_prime, int d, float *ret_q)
{
	struct bd_qquant qq;
	float t[BD_FWHT_MAX], acc[BD_FWHT_MAX];
	int r;

	if (!cfg || !q_prime || !ret_q || d < 1 || d > BD_FWHT_MAX)
		return -EINVAL;
	if (!fp4_page(cfg->page_fmt)) {
		if (!bd_all_finite(q_prime, (size_t)d))
			return -EDOM;
		for (int i = 0; i < d; i++)
			ret_q[i] = bd_bf16_to_f32(bd_f32_to_bf16(q_prime[i]));
		return 0;
	}
	if (cfg->query_terms != 1 && cfg->query_terms != 2)
		return -EINVAL;
	r = bd_query_quantize(q_prime, d,
			      cfg->page_fmt == BD_PAGE_MXFP4 ? BD_FP4_MXFP4 : BD_FP4_NVFP4,
			      cfg->query_terms, &qq);
	if (r < 0)
		return r;
	bd_query_dequantize(&qq, 0, acc);
	for (int term = 1; term < qq.nterms; term++) {
		bd_query_dequantize(&qq, term, t);
		for (int i = 0; i < d; i++)
			acc[i] += t[i];
	}
	memcpy(ret_q, acc, (size_t)d * sizeof(*acc));
	return 0;
}

void bd_qerr_sums_add(struct bd_qerr_sums *a, const struct bd_qerr_sums *b)
{
	a->n += b->n;
	a->sq_err += b->sq_err;
	a->key_term += b->key_term;
	a->query_term += b->query_term;
	a->cross_term += b->cross_term;
}

/* Per-head constants in FP64: q', q̃', and q̃' − q'. */
struct qhead {
	double *qp, *qt, *dq;
};

/* Four dot products of one key against one head, with four partial sums per product so that
 * the compiler can keep them in vector lanes (the order is fixed, so results do not depend on
 * the build). kt: dequantized key k̃', kr: reference k'. */
static void head_dots(const struct qhead *h, const double *kt, const double *kr, int d,
		      double ret[4])
{
	double s_ref[4] = { 0 }, s_til[4] = { 0 }, s_key[4] = { 0 }, s_qry[4] = { 0 };

	for (int c = 0; c < d; c += 4) {
		for (int l = 0; l < 4; l++) {
			s_ref[l] += h->qp[c + l] * kr[c + l];
			s_til[l] += h->qt[c + l] * kt[c + l];
			s_key[l] += h->qp[c + l] * (kt[c + l] - kr[c + l]);
			s_qry[l] += h->dq[c + l] * kt[c + l];
		}
	}
	ret[0] = (s_ref[0] + s_ref[1]) + (s_ref[2] + s_ref[3]);
	ret[1] = (s_til[0] + s_til[1]) + (s_til[2] + s_til[3]);
	ret[2] = (s_key[0] + s_key[1]) + (s_key[2] + s_key[3]);
	ret[3] = (s_qry[0] + s_qry[1]) + (s_qry[2] + s_qry[3]);
}

static int check_view(const struct bd_kvcfg *cfg, const struct bd_kv_view *kv, int *ret_n_full)
{
	const struct bd_layout *lay = kv->lay;

	if (!lay || lay->fmt != cfg->page_fmt || lay->d_rope != 0 || lay->d < 1 ||
	    lay->d > BD_FWHT_MAX || lay->d % 4 != 0 || lay->dv < 1)
		return -EINVAL;
	if (kv->n_tokens < 1 || kv->layer < 0 || kv->layer >= lay->n_layers || kv->kv_head < 0 ||
	    kv->kv_head >= lay->n_kv_heads)
		return -EINVAL;
	return bd_kv_view_full_pages(kv, ret_n_full);
}

int bd_qerr_group(const struct bd_kvcfg *cfg, const struct bd_kv_view *kv, const float *q_prime,
		  int G, const float *k_prime, float softmax_scale, struct bd_qerr_sums *ret_sums)
{
	struct bd_qerr_sums *sums = NULL;
	struct qhead *heads = NULL;
	float *pk = NULL, *pv = NULL, *qt = NULL;
	double *dbuf = NULL, *kt, *kr;
	int n_full, d, r;
	double sigma;

	if (!cfg || !kv || !q_prime || !ret_sums || G < 1 || !isfinite(softmax_scale) ||
	    softmax_scale < 0.0f)
		return -EINVAL;
	r = check_view(cfg, kv, &n_full);
	if (r < 0)
		return r;
	if (n_full > 0 && !k_prime)
		return -EINVAL;
	d = kv->lay->d;
	if (!bd_all_finite(q_prime, (size_t)G * (size_t)d))
		return -EDOM;
	/* masked sink rows are never read, so they are not checked either */
	for (int p = 0; p < n_full; p++) {
		int t0 = cfg->sink && p == 0 ? BD_SINK_TOKENS : 0;
		size_t row = (size_t)p * BD_PAGE_TOKENS + (size_t)t0;

		if (!bd_all_finite(k_prime + row * (size_t)d, (size_t)(BD_PAGE_TOKENS - t0) * (size_t)d))
			return -EDOM;
	}
	sigma = softmax_scale != 0.0f ? (double)softmax_scale : 1.0 / sqrt((double)d);

	sums = calloc((size_t)G, sizeof(*sums));
	heads = calloc((size_t)G, sizeof(*heads));
	pk = malloc((size_t)BD_PAGE_TOKENS * (size_t)d * sizeof(*pk));
	pv = malloc((size_t)BD_PAGE_TOKENS * (size_t)kv->lay->dv * sizeof(*pv));
	qt = malloc((size_t)d * sizeof(*qt));
	dbuf = malloc(((size_t)G * 3 + 2) * (size_t)d * sizeof(*dbuf));
	if (!sums || !heads || !pk || !pv || !qt || !dbuf) {
		r = -ENOMEM;
		goto out;
	}
	kt = dbuf + (size_t)G * 3 * (size_t)d;
	kr = kt + d;
	for (int g = 0; g < G; g++) {
		const float *qp = q_prime + (size_t)g * (size_t)d;
		struct qhead *h = &heads[g];

		r = bd_qerr_query(cfg, qp, d, qt);
		if (r < 0)
			goto out;
		h->qp = dbuf + (size_t)g * 3 * (size_t)d;
		h->qt = h->qp + d;
		h->dq = h->qt + d;
		for (int c = 0; c < d; c++) {
			h->qp[c] = qp[c];
			h->qt[c] = qt[c];
			h->dq[c] = (double)qt[c] - (double)qp[c]; /* exact: both are floats */
		}
	}

	for (int p = 0; p < n_full; p++) {
		const uint8_t *page = bd_layout_page(kv->lay, (void *)kv->arena, kv->layer,
						     kv->block_table[p]);

		r = bd_page_read_head(kv->lay, page, kv->kv_head, pk, pv, NULL);
		if (r < 0)
			goto out;
		for (int t = cfg->sink && p == 0 ? BD_SINK_TOKENS : 0; t < BD_PAGE_TOKENS; t++) {
			const float *ref = k_prime + ((size_t)p * BD_PAGE_TOKENS + (size_t)t) * (size_t)d;

			for (int c = 0; c < d; c++) {
				kt[c] = pk[(size_t)t * (size_t)d + (size_t)c];
				kr[c] = ref[c];
			}
			for (int g = 0; g < G; g++) {
				double dots[4], e, ek, eq;

				head_dots(&heads[g], kt, kr, d, dots);
				e = (dots[1] - dots[0]) * sigma;
				ek = dots[2] * sigma;
				eq = dots[3] * sigma;
				sums[g].n++;
				sums[g].sq_err += e * e;
				sums[g].key_term += ek * ek;
				sums[g].query_term += eq * eq;
				sums[g].cross_term += 2.0 * ek * eq;
			}
		}
	}
	for (int g = 0; g < G; g++)
		bd_qerr_sums_add(&ret_sums[g], &sums[g]);
	r = 0;
out:
	free(sums);
	free(heads);
	free(pk);
	free(pv);
	free(qt);
	free(dbuf);
	return r;
}
