/* eval.c — teacher-forced KL, top-1 mismatch and the paired t statistic (bd_eval.h,
 * NUMERICS.md §10). */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>

#include "model/bd_eval.h"
#include "model/bd_sampler.h"

/* log Σ exp(x_i) in FP64 with the max taken out; -EDOM for a non-finite x. */
static int log_sum_exp(const float *x, int n, double *ret)
{
	double m = -INFINITY, s = 0.0;

	for (int i = 0; i < n; i++) {
		if (!isfinite(x[i]))
			return -EDOM;
		if (x[i] > m)
			m = x[i];
	}
	for (int i = 0; i < n; i++)
		s += exp((double)x[i] - m);
	*ret = m + log(s);
	return 0;
}

/* Is token a ranked before token b (larger logit, lower id on ties)? */
static bool before(const float *x, int a, int b)
{
	return x[a] > x[b] || (x[a] == x[b] && a < b);
}

/* Sift the root of a heap of n ids down; the root is the id ranked last. */
static void sift_down(int *h, int n, const float *x, int i)
{
	for (;;) {
		int l = 2 * i + 1, r = l + 1, w = i;
		if (l < n && before(x, h[w], h[l]))
			w = l;
		if (r < n && before(x, h[w], h[r]))
			w = r;
		if (w == i)
			return;
		int t = h[i];
		h[i] = h[w];
		h[w] = t;
		i = w;
	}
}

int bd_eval_kl_topk(const float *ref_logits, const float *logits, int n_vocab, int k,
		    double *ret_kl)
{
	double lse_p, lse_q;
	int r;

	if (!ref_logits || !logits || !ret_kl || n_vocab < 1 || k < 1 || k > n_vocab)
		return -EINVAL;
	if ((r = log_sum_exp(ref_logits, n_vocab, &lse_p)) < 0 ||
	    (r = log_sum_exp(logits, n_vocab, &lse_q)) < 0)
		return r;

	/* the k best reference ids: a heap whose root is the worst of those kept so far */
	int *h = malloc(sizeof(int) * (size_t)k);
	if (!h)
		return -ENOMEM;
	for (int i = 0; i < k; i++)
		h[i] = i;
	for (int i = k / 2 - 1; i >= 0; i--)
		sift_down(h, k, ref_logits, i);
	for (int v = k; v < n_vocab; v++) {
		if (before(ref_logits, v, h[0])) {
			h[0] = v;
			sift_down(h, k, ref_logits, 0);
		}
	}

	double kl = 0.0;
	for (int i = 0; i < k; i++) {
		int v = h[i];
		double lp = (double)ref_logits[v] - lse_p, lq = (double)logits[v] - lse_q;
		kl += exp(lp) * (lp - lq);
	}
	free(h);
	*ret_kl = kl;
	return 0;
}

int bd_eval_add_step(struct bd_eval_acc *acc, const float *ref_logits, const float *logits,
		     int n_vocab)
{
	double kl;
	int r;

	if (!acc)
		return -EINVAL;
	r = bd_eval_kl_topk(ref_logits, logits, n_vocab,
			    n_vocab < BD_EVAL_TOPK ? n_vocab : BD_EVAL_TOPK, &kl);
	if (r < 0)
		return r;
	acc->kl_sum += kl;
	acc->steps++;
	acc->mismatches += bd_argmax(ref_logits, n_vocab) != bd_argmax(logits, n_vocab);
	return 0;
}

int bd_eval_means(const struct bd_eval_acc *acc, double *ret_kl, double *ret_mismatch)
{
	if (!acc || !ret_kl || !ret_mismatch || acc->steps == 0)
		return -EINVAL;
	*ret_kl = acc->kl_sum / (double)acc->steps;
	*ret_mismatch = (double)acc->mismatches / (double)acc->steps;
	return 0;
}

int bd_eval_paired_t(const double *a, const double *b, int n, double *ret_t)
{
	double mean = 0.0, ss = 0.0;

	if (!a || !b || !ret_t || n < 2)
		return -EINVAL;
	for (int i = 0; i < n; i++) {
		if (!isfinite(a[i]) || !isfinite(b[i]))
			return -EDOM;
		mean += a[i] - b[i];
	}
	mean /= n;
	for (int i = 0; i < n; i++) {
		double e = (a[i] - b[i]) - mean;
		ss += e * e;
	}
	double sd = sqrt(ss / (n - 1));
	if (!(sd > 0.0))
		return -EDOM;
	*ret_t = mean / (sd / sqrt((double)n));
	return 0;
}

int bd_eval_wilson(int k, int n, double z, double *ret_lo, double *ret_hi)
{
	if (!ret_lo || !ret_hi || n < 1 || k < 0 || k > n || !isfinite(z) || !(z > 0.0))
		return -EINVAL;
	double p = (double)k / n, z2n = z * z / n;
	double centre = (p + z2n / 2.0) / (1.0 + z2n);
	double half = z / (1.0 + z2n) * sqrt(p * (1.0 - p) / n + z2n / (4.0 * n));
	/* at k = 0 (k = n) the bound is 0 (1) exactly; the FP64 sum would miss it by an ulp */
	*ret_lo = k == 0 ? 0.0 : fmax(0.0, centre - half);
	*ret_hi = k == n ? 1.0 : fmin(1.0, centre + half);
	return 0;
}
