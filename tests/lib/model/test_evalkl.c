/* test_evalkl.c — the accuracy proxy of bd_eval.h (NUMERICS.md §10): top-k KL, top-1 mismatch
 * and the paired t statistic, against values worked out by hand. */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model/bd_eval.h"

/* logits = ln(p) + shift: softmax(logits) = p exactly up to rounding of ln */
static void logits_of(const double *p, int n, double shift, float *ret)
{
	for (int i = 0; i < n; i++)
		ret[i] = (float)(log(p[i]) + shift);
}

Test(eval, kl_by_hand)
{
	/* p = (1/2, 1/4, 1/8, 1/8), q uniform:
	 *   full KL = ½ ln(½ / ¼) + ¼ ln 1 + 2 · ⅛ ln(⅛ / ¼) = ½ ln 2 − ¼ ln 2 = ¼ ln 2
	 *   top-2 (tokens 0, 1) = ½ ln 2; top-1 = ½ ln 2;
	 *   top-3 = tokens 0, 1 and, of the tied 2 and 3, the lower id 2: ½ ln 2 − ⅛ ln 2 = ⅜ ln 2.
	 * The shifts (+3 and −1) must not matter: softmax is shift-invariant. */
	static const double p[4] = { 0.5, 0.25, 0.125, 0.125 }, q[4] = { 0.25, 0.25, 0.25, 0.25 };
	float lp[4], lq[4];
	double kl;

	logits_of(p, 4, 3.0, lp);
	logits_of(q, 4, -1.0, lq);
	cr_assert_eq(bd_eval_kl_topk(lp, lq, 4, 4, &kl), 0);
	cr_assert_float_eq(kl, 0.25 * M_LN2, 1e-6);
	cr_assert_eq(bd_eval_kl_topk(lp, lq, 4, 2, &kl), 0);
	cr_assert_float_eq(kl, 0.5 * M_LN2, 1e-6);
	cr_assert_eq(bd_eval_kl_topk(lp, lq, 4, 1, &kl), 0);
	cr_assert_float_eq(kl, 0.5 * M_LN2, 1e-6);
	cr_assert_eq(bd_eval_kl_topk(lp, lq, 4, 3, &kl), 0);
	cr_assert_float_eq(kl, 0.375 * M_LN2, 1e-6);
}

Test(eval, kl_tie_takes_lower_id)
{
	/* tokens 2 and 3 tie in p; q differs on them, so which one is in the top 3 shows:
	 * q = (.25, .25, .3, .2): with token 2, D = ½ ln 2 + 0 + ⅛ ln(⅛ / .3);
	 * with token 3 it would be ½ ln 2 + ⅛ ln(⅛ / .2). */
	static const double p[4] = { 0.5, 0.25, 0.125, 0.125 }, q[4] = { 0.25, 0.25, 0.3, 0.2 };
	float lp[4], lq[4];
	double kl;

	logits_of(p, 4, 0.0, lp);
	logits_of(q, 4, 0.0, lq);
	lp[3] = lp[2]; /* an exact tie in FP32 */
	cr_assert_eq(bd_eval_kl_topk(lp, lq, 4, 3, &kl), 0);
	double want = 0.5 * M_LN2 + 0.125 * log(0.125 / 0.3);
	cr_assert_float_eq(kl, want, 1e-6, "%.9f vs %.9f", kl, want);
}

Test(eval, kl_top_k_among_many)
{
	/* 1000 tokens, the reference mass on ids 700..703 (others far below); the configuration
	 * moves mass from 701 to 702. With p = (.4, .3, .2, .1) on 700..703 and q = (.4, .2, .3,
	 * .1): top-2 = {700, 701}: D = .4 ln 1 + .3 ln(.3/.2) = .3 ln 1.5 (the far tokens carry
	 * e^-40 of mass each, below the tolerance). */
	enum { V = 1000 };
	float *lp = malloc(sizeof(float) * V), *lq = malloc(sizeof(float) * V);
	double kl;

	cr_assert(lp && lq);
	for (int i = 0; i < V; i++)
		lp[i] = lq[i] = -40.0f;
	static const double p[4] = { 0.4, 0.3, 0.2, 0.1 }, q[4] = { 0.4, 0.2, 0.3, 0.1 };
	logits_of(p, 4, 0.0, lp + 700);
	logits_of(q, 4, 0.0, lq + 700);
	cr_assert_eq(bd_eval_kl_topk(lp, lq, V, 2, &kl), 0);
	cr_assert_float_eq(kl, 0.3 * log(1.5), 1e-6);
	/* identical logits: exactly zero over any k */
	cr_assert_eq(bd_eval_kl_topk(lp, lp, V, 128, &kl), 0);
	cr_assert(kl == 0.0);
	free(lp);
	free(lq);
}

Test(eval, steps_and_top1_mismatch)
{
	struct bd_eval_acc acc = { 0 };
	double kl, mm;
	/* step 1: same argmax (0); step 2: the configuration's argmax moves to 1 */
	static const double p1[3] = { 0.6, 0.3, 0.1 }, q1[3] = { 0.5, 0.4, 0.1 };
	static const double p2[3] = { 0.5, 0.4, 0.1 }, q2[3] = { 0.4, 0.5, 0.1 };
	float a[3], b[3];

	logits_of(p1, 3, 0.0, a);
	logits_of(q1, 3, 0.0, b);
	cr_assert_eq(bd_eval_add_step(&acc, a, b, 3), 0);
	logits_of(p2, 3, 0.0, a);
	logits_of(q2, 3, 0.0, b);
	cr_assert_eq(bd_eval_add_step(&acc, a, b, 3), 0);
	cr_assert_eq(acc.steps, 2);
	cr_assert_eq(acc.mismatches, 1);
	cr_assert_eq(bd_eval_means(&acc, &kl, &mm), 0);
	/* n_vocab 3 < 128: the full KL of each step, by hand */
	double d1 = 0.6 * log(0.6 / 0.5) + 0.3 * log(0.3 / 0.4);
	double d2 = 0.5 * log(0.5 / 0.4) + 0.4 * log(0.4 / 0.5);
	cr_assert_float_eq(kl, (d1 + d2) / 2, 1e-6);
	cr_assert_float_eq(mm, 0.5, 1e-12);
}

Test(eval, paired_t_by_hand)
{
	/* d = a − b = (.5, .5, 1, −.5): mean .375; squared deviations .015625, .015625, .390625,
	 * .765625, sum 1.1875; s = sqrt(1.1875 / 3) = .629153; t = .375 / (s / 2) = 1.192079 */
	static const double a[4] = { 1, 2, 3, 4 }, b[4] = { 0.5, 1.5, 2, 4.5 };
	double t;

	cr_assert_eq(bd_eval_paired_t(a, b, 4, &t), 0);
	cr_assert_float_eq(t, 1.192079, 1e-5, "t = %.7f", t);
	cr_assert_eq(bd_eval_paired_t(b, a, 4, &t), 0);
	cr_assert_float_eq(t, -1.192079, 1e-5);
}

Test(eval, bad_inputs_leave_outputs)
{
	float a[2] = { 0.0f, 1.0f }, b[2] = { 1.0f, NAN };
	double kl = 42.0, t = 42.0;
	struct bd_eval_acc acc = { 0 };

	cr_assert_eq(bd_eval_kl_topk(a, b, 2, 2, &kl), -EDOM);
	b[1] = INFINITY;
	cr_assert_eq(bd_eval_kl_topk(a, b, 2, 2, &kl), -EDOM);
	cr_assert_eq(bd_eval_kl_topk(b, a, 2, 2, &kl), -EDOM);
	cr_assert_eq(bd_eval_kl_topk(a, a, 2, 0, &kl), -EINVAL);
	cr_assert_eq(bd_eval_kl_topk(a, a, 2, 3, &kl), -EINVAL);
	cr_assert_eq(bd_eval_kl_topk(NULL, a, 2, 1, &kl), -EINVAL);
	cr_assert_eq(bd_eval_kl_topk(a, a, 0, 1, &kl), -EINVAL);
	cr_assert(kl == 42.0);

	cr_assert_eq(bd_eval_add_step(&acc, a, b, 2), -EDOM);
	cr_assert_eq(acc.steps, 0);
	cr_assert(acc.kl_sum == 0.0 && acc.mismatches == 0);
	double m1, m2;
	cr_assert_eq(bd_eval_means(&acc, &m1, &m2), -EINVAL);

	static const double x[3] = { 1, 2, 3 }, y[3] = { 0, 1, 2 }, z[2] = { 1, NAN };
	cr_assert_eq(bd_eval_paired_t(x, y, 3, &t), -EDOM); /* constant difference: s = 0 */
	cr_assert_eq(bd_eval_paired_t(x, y, 1, &t), -EINVAL);
	cr_assert_eq(bd_eval_paired_t(z, y, 2, &t), -EDOM);
	cr_assert_eq(bd_eval_paired_t(NULL, y, 2, &t), -EINVAL);
	cr_assert(t == 42.0);
}

/* Wilson 95 % intervals as binomial tables give them (7/10: 0.3968–0.8922; 0/10 and 10/10: the
 * one-sided 0.2775 bound), and 50/100: 0.4038–0.5962, symmetric about 1/2. */
Test(eval, wilson_by_table)
{
	double lo, hi;

	cr_assert_eq(bd_eval_wilson(7, 10, 1.959964, &lo, &hi), 0);
	cr_assert_float_eq(lo, 0.3968, 1e-4);
	cr_assert_float_eq(hi, 0.8922, 1e-4);
	cr_assert_eq(bd_eval_wilson(0, 10, 1.959964, &lo, &hi), 0);
	cr_assert_eq(lo, 0.0);
	cr_assert_float_eq(hi, 0.2775, 1e-4);
	cr_assert_eq(bd_eval_wilson(10, 10, 1.959964, &lo, &hi), 0);
	cr_assert_float_eq(lo, 0.7225, 1e-4);
	cr_assert_eq(hi, 1.0);
	cr_assert_eq(bd_eval_wilson(50, 100, 1.959964, &lo, &hi), 0);
	cr_assert_float_eq(lo + hi, 1.0, 1e-12);
	cr_assert_float_eq(hi - lo, 2 * 0.0962, 2e-4);
}

Test(eval, wilson_bad_inputs_leave_outputs)
{
	double lo = 7.0, hi = 8.0;

	cr_assert_eq(bd_eval_wilson(1, 0, 1.96, &lo, &hi), -EINVAL);
	cr_assert_eq(bd_eval_wilson(-1, 10, 1.96, &lo, &hi), -EINVAL);
	cr_assert_eq(bd_eval_wilson(11, 10, 1.96, &lo, &hi), -EINVAL);
	cr_assert_eq(bd_eval_wilson(1, 10, 0.0, &lo, &hi), -EINVAL);
	cr_assert_eq(bd_eval_wilson(1, 10, NAN, &lo, &hi), -EINVAL);
	cr_assert_eq(bd_eval_wilson(1, 10, 1.96, NULL, &hi), -EINVAL);
	cr_assert(lo == 7.0 && hi == 8.0);
}
