/* bd_eval.h — the accuracy proxy of NUMERICS.md §10 (paper appendix A): teacher-forced KL
 * over the reference's most likely tokens, top-1 mismatch, and the paired t statistic that
 * compares two KV configurations over the same trajectories.
 *
 * A reference run (BF16 KV) gives logits ℓ_t at every step t of a trajectory; a configuration
 * decoding the same prompt teacher-forced along the same tokens gives ℓ̃_t. With
 * p_t = softmax(ℓ_t) and p̃_t = softmax(ℓ̃_t) (temperature 1, computed in FP64),
 *
 *   D_t = Σ_{v ∈ V_t} p_t(v) · (log p_t(v) − log p̃_t(v)),  V_t = the k most likely tokens of p_t
 *
 * (natural log, nats). A trajectory's score is the mean of D_t over its steps; a
 * configuration's score the mean over trajectories. Errors are -errno: -EINVAL a bad argument,
 * -EDOM a non-finite input.
 */
#ifndef BD_EVAL_H
#define BD_EVAL_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define BD_EVAL_TOPK 128 /* |V_t| of NUMERICS.md §10 */

/* D_t of one step: ref_logits, logits [n_vocab] (finite), over the k most likely reference
 * tokens (ties: the lower id first; k = n_vocab is the full KL). Both log-softmaxes are taken
 * in FP64 with the max subtracted. Returns 0 and *ret_kl (nats; it may be slightly negative
 * for k < n_vocab, the sum being partial), -EINVAL (NULL, n_vocab < 1, k outside
 * 1..n_vocab), -EDOM (a non-finite logit), -ENOMEM; *ret_kl is written only on success. */
int bd_eval_kl_topk(const float *ref_logits, const float *logits, int n_vocab, int k,
		    double *ret_kl);

/* Per-trajectory sums: add one step at a time, then read the means. */
struct bd_eval_acc {
	double kl_sum;       /* Σ_t D_t, nats */
	uint64_t steps;      /* steps added */
	uint64_t mismatches; /* steps whose argmax differs from the reference's */
};

/* Add one step to acc: D_t over the top BD_EVAL_TOPK tokens (all of them when n_vocab is
 * smaller) and whether the argmaxes (first index on ties, as bd_argmax) differ.
 * Returns 0, or the errors of bd_eval_kl_topk (acc untouched). */
int bd_eval_add_step(struct bd_eval_acc *acc, const float *ref_logits, const float *logits,
		     int n_vocab);

/* Mean D_t and top-1 mismatch fraction of a trajectory: 0 and the means, or -EINVAL (NULL or
 * no step added). */
int bd_eval_means(const struct bd_eval_acc *acc, double *ret_kl, double *ret_mismatch);

/* Paired t statistic of a[i] against b[i], i < n (the same trajectories under two
 * configurations): with d_i = a_i − b_i, t = mean(d) / (s_d / √n), s_d the sample standard
 * deviation (n − 1 in the denominator), computed in FP64. t > 0 means a is larger.
 * Returns 0 and *ret_t, -EINVAL (NULL, n < 2), -EDOM (a non-finite value, or s_d = 0: t is
 * undefined); *ret_t only on success. */
int bd_eval_paired_t(const double *a, const double *b, int n, double *ret_t);

/* Wilson score interval of a binomial proportion (E. B. Wilson, JASA 22 (1927) 209–212): k
 * successes in n trials, z the normal quantile (1.959964 for 95 %). With p = k/n,
 *   centre = (p + z²/2n) / (1 + z²/n),  half = z/(1 + z²/n) · √(p(1 − p)/n + z²/4n²),
 * computed in FP64, [lo, hi] = [centre − half, centre + half] clamped to [0, 1] (exactly 0 at
 * k = 0 and 1 at k = n); unlike the
 * normal approximation it stays inside [0, 1] and is not empty at k = 0 or k = n (the task
 * accuracy of bdfp4 eval-passkey). Returns 0, -EINVAL (NULL, n < 1, k outside 0..n, z not
 * finite and > 0); *ret_lo and *ret_hi only on success. */
int bd_eval_wilson(int k, int n, double z, double *ret_lo, double *ret_hi);

#ifdef __cplusplus
}
#endif
#endif
