/* bd_sampler.h — choosing the next token from logits, and matching stop strings.
 *
 * Sampling order (llama.cpp's and Hugging Face's): top-k on the logits, softmax at temperature
 * T over what is left (in double), top-p (the smallest set of most likely tokens whose mass
 * reaches p), renormalize, draw with a seeded PRNG (xoshiro256**, seeded through splitmix64,
 * so a seed gives the same tokens on every machine). Temperature 0 or top-k 1 is greedy: the
 * argmax, lowest id on ties, and draws nothing.
 */
#ifndef BD_SAMPLER_H
#define BD_SAMPLER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct bd_sampler_params {
	float temperature; /* ≥ 0; 0 is greedy */
	int top_k;         /* ≥ 0; 0 keeps every token */
	float top_p;       /* in (0, 1]; 1 keeps every token */
	uint64_t seed;
};

/* Greedy defaults: temperature 0, top_k 0, top_p 1, seed 0. */
struct bd_sampler_params bd_sampler_params_greedy(void);

struct bd_sampler;

/* A sampler over n_vocab logits. Returns 0, -EINVAL (NULL, n_vocab < 1, temperature negative
 * or non-finite, top_k < 0, top_p outside (0, 1]), -ENOMEM; *ret only on success. */
int bd_sampler_new(const struct bd_sampler_params *p, int n_vocab, struct bd_sampler **ret);

/* Release a sampler. NULL is a no-op. */
void bd_sampler_free(struct bd_sampler *s);

/* The distribution the next draw uses: ret_probs [n_vocab], zero outside the kept set, summing
 * to 1 (greedy: 1 at the argmax). Does not advance the PRNG. logits: [n_vocab].
 * Returns 0, -EINVAL (NULL), -EDOM (a NaN or +inf logit; -inf is a token never chosen, but not
 * every one). */
int bd_sampler_probs(struct bd_sampler *s, const float *logits, float *ret_probs);

/* Choose the next token from logits [n_vocab] (advancing the PRNG unless greedy).
 * Returns 0 and *ret_token, -EINVAL, -EDOM (as bd_sampler_probs). */
int bd_sampler_sample(struct bd_sampler *s, const float *logits, int32_t *ret_token);

/* Advances s as n successful bd_sampler_sample calls would, whatever their logits: a draw that
 * is not greedy takes exactly one 64-bit output of the PRNG, a greedy one none. So a sampler
 * made again with the same parameters and moved past the draws of the one it replaces (a
 * request resumed on a restarted worker) draws what the lost one would have drawn next.
 * O(n); NULL is a no-op. */
void bd_sampler_skip(struct bd_sampler *s, uint64_t n);

/* Sorts ids[n], indices into x, by descending x and then ascending id: a total order for
 * values that are not NaN (−0 and +0 are equal, −inf comes last). The order in which top-k
 * and top-p keep candidates. */
void bd_sampler_order(const float *x, int32_t *ids, size_t n);

/* The k largest of x[n] into ret_ids[k], largest first, ties by the lower id (the order of
 * bd_sampler_order; NaN never chosen while another value is left), in O(n·k): for the small k
 * of reports (top logits, top log-probabilities). Returns how many were written, min(k, n), or
 * -EINVAL (NULL, n < 1, k < 0). */
int bd_sampler_top(const float *x, int n, int k, int32_t *ret_ids);

/* Log-probabilities of the model's distribution at one step: the log-softmax of the raw
 * logits[n_vocab] (temperature 1, before top-k and top-p: what OpenAI's logprobs report, not
 * the distribution a sampler at another temperature draws from), in double:
 *     lp_i = x_i − (m + log Σ_j exp(x_j − m)),  m = max_j x_j,
 * so every lp_i ≤ 0, Σ exp(lp_i) = 1, and a -inf logit has lp -inf. ret_logprob (NULL: not
 * wanted) gets lp of token; ret_ids[top_n] and ret_lp[top_n] the top_n most likely tokens
 * and their lp, most likely first (bd_sampler_top's order). Returns how many of those were
 * written (min(top_n, n_vocab)), -EINVAL (NULL logits, n_vocab < 1, top_n < 0, top_n > 0 with
 * a NULL array, token outside [0, n_vocab) with ret_logprob), -EDOM (a NaN or +inf logit, or
 * all of them -inf). */
int bd_sampler_logprobs(const float *logits, int n_vocab, int32_t token, int top_n,
			float *ret_logprob, int32_t *ret_ids, float *ret_lp);

/* Index of the largest of x[n] (the first one on ties; NaN never wins), or -EINVAL for
 * NULL or n < 1. */
int bd_argmax(const float *x, int n);

/* Stop strings over generated text: text[len] is everything generated so far. Returns how many
 * leading bytes are final — safe to show — and sets *ret_hit. With a hit (a stop string
 * occurs), that is the start of the earliest occurrence, and the text from there on is dropped.
 * Without one, it is len minus the longest tail of text that is a proper prefix of some stop
 * string (held back until later text decides). stops: [n_stops] NUL-terminated, empty ones
 * ignored; NULL with n_stops 0 is fine. */
size_t bd_stop_scan(const char *text, size_t len, const char *const *stops, int n_stops,
		    bool *ret_hit);

/* Generated text as it streams in, for the stop strings: *text holds *len bytes and a NUL in
 * *cap bytes of malloc'ed memory (NULL, 0, 0 to start; the caller frees *text). Appends p[n],
 * growing the buffer to twice what it needs when it is full. Returns 0, or -ENOMEM with the text
 * as it was. */
int bd_stop_text_append(char **text, size_t *len, size_t *cap, const char *p, size_t n);

/* Advances *shown, the count of leading bytes of text[len] that are final (it never moves back),
 * by bd_stop_scan: to the start of a stop string on a hit, else to all but the tail that may
 * begin one — or to len when final (the text is complete, nothing more can match). text may be
 * NULL when len is 0. Returns true on a hit; the text from *shown on is then not output. */
bool bd_stop_text_scan(const char *text, size_t len, const char *const *stops, int n_stops,
		       bool final, size_t *shown);

#ifdef __cplusplus
}
#endif
#endif
