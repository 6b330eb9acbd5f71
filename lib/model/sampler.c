/* sampler.c — token sampling (greedy, temperature, top-k, top-p, seeded) and stop strings. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/bd_rand.h"
#include "model/bd_sampler.h"

struct bd_sampler {
	struct bd_sampler_params p;
	int n;
	struct bd_rng rng;
	int32_t *idx;    /* [n] candidate ids, most likely first once sorted; after prob[] */
	double prob[];   /* [n] unnormalized probabilities of idx[] */
};

struct bd_sampler_params bd_sampler_params_greedy(void)
{
	return (struct bd_sampler_params){ .temperature = 0.0f, .top_k = 0, .top_p = 1.0f };
}

int bd_sampler_new(const struct bd_sampler_params *p, int n_vocab, struct bd_sampler **ret)
{
	if (!p || !ret || n_vocab < 1 || !isfinite(p->temperature) || p->temperature < 0.0f ||
	    p->top_k < 0 || !(p->top_p > 0.0f && p->top_p <= 1.0f))
		return -EINVAL;
	/* the sampler and its two arrays in one allocation */
	struct bd_sampler *s = calloc(1, sizeof(*s) + (size_t)n_vocab * (sizeof(*s->prob) +
									  sizeof(*s->idx)));
	if (!s)
		return -ENOMEM;
	s->idx = (int32_t *)(void *)(s->prob + n_vocab);
	s->p = *p;
	s->n = n_vocab;
	uint64_t x = p->seed;
	for (int i = 0; i < 4; i++)
		s->rng.s[i] = bd_splitmix64(&x);
	*ret = s;
	return 0;
}

void bd_sampler_free(struct bd_sampler *s)
{
	free(s);
}

int bd_argmax(const float *x, int n)
{
	if (!x || n < 1)
		return -EINVAL;
	int best = 0;
	for (int i = 1; i < n; i++)
		if (x[i] > x[best] || (isnan(x[best]) && !isnan(x[i])))
			best = i;
	return best;
}

static bool is_greedy(const struct bd_sampler *s)
{
	return s->p.temperature == 0.0f || s->p.top_k == 1;
}

/* qsort has no context argument; per thread, so samplers on other threads do not mix */
static _Thread_local const float *cmp_logits;

/* Descending logit, then ascending id: a total order, so the kept set is well defined. */
static int cmp_desc(const void *a, const void *b)
{
	int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
	float x = cmp_logits[i], y = cmp_logits[j];
	if (x > y)
		return -1;
	if (x < y)
		return 1;
	return (i > j) - (i < j);
}

void bd_sampler_order(const float *x, int32_t *ids, size_t n)
{
	cmp_logits = x;
	qsort(ids, n, sizeof(*ids), cmp_desc);
	cmp_logits = NULL;
}

/* x ranks before y: larger, or equal and the lower id; NaN after everything. */
static bool ranks_before(float x, int32_t i, float y, int32_t j)
{
	if (isnan(y))
		return !isnan(x) || i < j;
	return x > y || (x == y && i < j);
}

int bd_sampler_top(const float *x, int n, int k, int32_t *ret_ids)
{
	int m = 0;

	if (!x || n < 1 || k < 0 || (k > 0 && !ret_ids))
		return -EINVAL;
	if (k > n)
		k = n;
	for (int v = 0; v < n && k > 0; v++) {
		/* ids arrive in increasing order: on a tie the kept one ranks first */
		if (m == k && !ranks_before(x[v], v, x[ret_ids[m - 1]], ret_ids[m - 1]))
			continue;
		int i = m < k ? m++ : m - 1;
		while (i > 0 && ranks_before(x[v], v, x[ret_ids[i - 1]], ret_ids[i - 1])) {
			ret_ids[i] = ret_ids[i - 1];
			i--;
		}
		ret_ids[i] = v;
	}
	return m;
}

int bd_sampler_logprobs(const float *logits, int n_vocab, int32_t token, int top_n,
			float *ret_logprob, int32_t *ret_ids, float *ret_lp)
{
	double m = -INFINITY, sum = 0.0, lse;
	int k = 0;

	if (!logits || n_vocab < 1 || top_n < 0 || (top_n > 0 && (!ret_ids || !ret_lp)) ||
	    (ret_logprob && (token < 0 || token >= n_vocab)))
		return -EINVAL;
	for (int i = 0; i < n_vocab; i++) {
		if (isnan(logits[i]) || logits[i] == INFINITY)
			return -EDOM;
		if (logits[i] > m)
			m = logits[i];
	}
	if (m == -INFINITY)
		return -EDOM;
	for (int i = 0; i < n_vocab; i++)
		sum += exp((double)logits[i] - m);
	lse = m + log(sum);
	if (ret_logprob)
		*ret_logprob = (float)((double)logits[token] - lse);
	if (top_n > 0) {
		k = bd_sampler_top(logits, n_vocab, top_n, ret_ids);
		for (int i = 0; i < k; i++)
			ret_lp[i] = (float)((double)logits[ret_ids[i]] - lse);
	}
	return k;
}

/* Fill s->idx[0..*ret_m) and s->prob with the kept candidates (unnormalized), most likely
 * first when sorting was needed, and *ret_total with their mass; a greedy sampler keeps the
 * argmax alone (mass 1). out: the caller's output pointer, checked with s and logits. Returns
 * 0, -EINVAL (one of them NULL) or -EDOM (a NaN or +inf logit, or all of them -inf). */
static int candidates(struct bd_sampler *s, const float *logits, const void *out, int *ret_m,
		      double *ret_total)
{
	if (!s || !logits || !out)
		return -EINVAL;

	int n = s->n, m = n, amax = 0;
	float lmax = -INFINITY;

	for (int i = 0; i < n; i++) {
		if (isnan(logits[i]) || logits[i] == INFINITY)
			return -EDOM;
		if (logits[i] > lmax) {
			lmax = logits[i];
			amax = i; /* the first of equal maxima, as bd_argmax */
		}
	}
	if (lmax == -INFINITY)
		return -EDOM;
	if (is_greedy(s)) {
		s->idx[0] = amax;
		s->prob[0] = 1.0;
		*ret_m = 1;
		*ret_total = 1.0;
		return 0;
	}
	for (int i = 0; i < n; i++)
		s->idx[i] = i;
	bool sort = (s->p.top_k > 0 && s->p.top_k < n) || s->p.top_p < 1.0f;
	if (sort) {
		bd_sampler_order(logits, s->idx, (size_t)n);
		if (s->p.top_k > 0 && s->p.top_k < n)
			m = s->p.top_k;
	}

	double total = 0.0, T = (double)s->p.temperature;
	for (int i = 0; i < m; i++) {
		s->prob[i] = exp(((double)logits[s->idx[i]] - (double)lmax) / T);
		total += s->prob[i];
	}
	if (s->p.top_p < 1.0f) {
		/* smallest prefix whose share of the mass reaches p */
		double want = (double)s->p.top_p * total, cum = 0.0;
		int k = 0;
		while (k < m) {
			cum += s->prob[k++];
			if (cum >= want)
				break;
		}
		m = k;
		total = cum;
	}
	*ret_m = m;
	*ret_total = total;
	return 0;
}

int bd_sampler_probs(struct bd_sampler *s, const float *logits, float *ret_probs)
{
	int m, r;
	double total;

	if ((r = candidates(s, logits, ret_probs, &m, &total)) < 0)
		return r;
	memset(ret_probs, 0, sizeof(float) * (size_t)s->n);
	for (int i = 0; i < m; i++)
		ret_probs[s->idx[i]] = (float)(s->prob[i] / total);
	return 0;
}

void bd_sampler_skip(struct bd_sampler *s, uint64_t n)
{
	if (!s || is_greedy(s))
		return;
	while (n--)
		(void)bd_rng_u64(&s->rng); /* bd_sampler_sample's one bd_rng_uniform per draw */
}

int bd_sampler_sample(struct bd_sampler *s, const float *logits, int32_t *ret_token)
{
	int m, r;
	double total;

	if ((r = candidates(s, logits, ret_token, &m, &total)) < 0)
		return r;
	if (is_greedy(s)) { /* no draw: a greedy stream leaves the generator alone */
		*ret_token = s->idx[0];
		return 0;
	}
	double u = bd_rng_uniform(&s->rng) * total, cum = 0.0;
	int pick = -1;
	for (int i = 0; i < m; i++) {
		if (s->prob[i] <= 0.0)
			continue;
		pick = i; /* the last token with mass, in case rounding leaves cum < u */
		cum += s->prob[i];
		if (u < cum)
			break;
	}
	*ret_token = s->idx[pick];
	return 0;
}

size_t bd_stop_scan(const char *text, size_t len, const char *const *stops, int n_stops,
		    bool *ret_hit)
{
	size_t first = len, hold = 0;
	bool hit = false;

	for (int k = 0; text && stops && k < n_stops; k++) {
		const char *st = stops[k];
		size_t sl = st ? strlen(st) : 0;
		if (sl == 0)
			continue;
		const char *p = sl <= len ? memmem(text, len, st, sl) : NULL;
		if (p && (size_t)(p - text) < first) {
			first = (size_t)(p - text);
			hit = true;
		}
		/* longest proper prefix of st that ends the text */
		for (size_t l = sl - 1 < len ? sl - 1 : len; l > hold; l--) {
			if (memcmp(text + len - l, st, l) == 0) {
				hold = l;
				break;
			}
		}
	}
	if (ret_hit)
		*ret_hit = hit;
	return hit ? first : len - hold;
}

int bd_stop_text_append(char **text, size_t *len, size_t *cap, const char *p, size_t n)
{
	if (*len + n + 1 > *cap) {
		size_t want = (*len + n + 1) * 2;
		char *t = realloc(*text, want);

		if (!t)
			return -ENOMEM;
		*text = t;
		*cap = want;
	}
	memcpy(*text + *len, p, n);
	*len += n;
	(*text)[*len] = '\0';
	return 0;
}

bool bd_stop_text_scan(const char *text, size_t len, const char *const *stops, int n_stops,
		       bool final, size_t *shown)
{
	bool hit = false;
	size_t upto = bd_stop_scan(text, len, stops, n_stops, &hit);

	if (final && !hit)
		upto = len;
	if (upto > *shown)
		*shown = upto;
	return hit;
}
