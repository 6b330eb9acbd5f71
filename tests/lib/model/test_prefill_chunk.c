/* test_prefill_chunk.c — bd_model_prefill_chunk (bd_forward.h) on the embedded SmolLM2: a
 * prompt prefilled in chunks of whole pages against the same prompt prefilled at once, and the
 * refusals that leave the sequence as it was. Suite "prefill_chunk".
 *
 * With BF16 pages and a configuration that neither smooths nor rotates keys ("bf16") a chunk
 * reads exactly what the one-shot prefill computes for the context, so the logits agree up to
 * FP32 summation order. With FP4 pages (bitdecoding-nvfp4) the chunk reads the context as
 * decode does, dequantized, so it loses what the pages lose; the bound and the agreement of the
 * greedy continuation are what decode over the same pages achieves.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <criterion/criterion.h>

#include "model/bd_forward.h"
#include "model/bd_sampler.h"
#include "model_data.h"

#define N_PROMPT 300
#define N_DECODE 8

static struct bd_model *M;

static void setup(void)
{
	char path[TD_PATH_MAX], err[BD_MODEL_ERR_MAX];

	cr_assert_eq(bd_model_load(td_model_path(path), &M, err), 0, "%s", err);
}

static void teardown(void)
{
	bd_model_free(M);
}

TestSuite(prefill_chunk, .init = setup, .fini = teardown, .timeout = 300);

/* Real-looking token ids: a fixed walk over the vocabulary. */
static void prompt(int32_t *t, int n)
{
	for (int i = 0; i < n; i++)
		t[i] = (int32_t)(200 + (i * 7919) % 20000);
}

static struct bd_seq *seq(const char *kv, int cap)
{
	struct bd_seq_opts o = { .max_tokens = cap };
	struct bd_seq *s;
	char err[BD_MODEL_ERR_MAX];

	cr_assert_eq(bd_seq_new(M, bd_kvcfg_find(kv), &o, &s, err), 0, "%s", err);
	return s;
}

/* The last prompt token's logits and then N_DECODE greedy decodes: ret_logits
 * [N_DECODE + 1][V], ret_tokens [N_DECODE + 1]; the prompt goes in chunks of `chunk` tokens
 * (0: at once). */
static void run(const char *kv, int chunk, float *ret_logits, int32_t *ret_tokens)
{
	int V = M->hp.n_vocab;
	int32_t t[N_PROMPT];
	struct bd_seq *s = seq(kv, N_PROMPT + N_DECODE + 1);

	prompt(t, N_PROMPT);
	if (!chunk) {
		cr_assert_eq(bd_model_prefill(M, s, t, N_PROMPT, ret_logits), 0);
	} else {
		for (int p = 0; p < N_PROMPT; p += chunk) {
			int n = N_PROMPT - p < chunk ? N_PROMPT - p : chunk;

			cr_assert_eq(bd_model_prefill_chunk(M, s, t + p, n,
							    p + n == N_PROMPT ? ret_logits : NULL),
				     0, "chunk at %d", p);
			cr_assert_eq(bd_seq_n_tokens(s), p + n);
		}
	}
	for (int i = 0; i <= N_DECODE; i++) {
		ret_tokens[i] = bd_argmax(ret_logits + (size_t)i * V, V);
		if (i < N_DECODE)
			cr_assert_eq(bd_model_decode(M, s, ret_tokens[i],
						     ret_logits + (size_t)(i + 1) * V), 0);
	}
	bd_seq_free(s);
}

static float max_diff(const float *a, const float *b, size_t n)
{
	float w = 0;

	for (size_t i = 0; i < n; i++) {
		float d = fabsf(a[i] - b[i]);

		w = d > w ? d : w;
	}
	return w;
}

Test(prefill_chunk, bf16_pages_give_the_one_shot_logits)
{
	size_t V = (size_t)M->hp.n_vocab, n = V * (N_DECODE + 1);
	float *a = malloc(sizeof(float) * n), *b = malloc(sizeof(float) * n);
	int32_t ta[N_DECODE + 1], tb[N_DECODE + 1];

	cr_assert(a && b);
	run("bf16", 0, a, ta);
	run("bf16", 128, b, tb);
	cr_expect_leq(max_diff(a, b, V), 2e-3f, "last prompt token: %g", max_diff(a, b, V));
	cr_expect_eq(memcmp(ta, tb, sizeof(ta)), 0, "the greedy continuation differs");
	free(a);
	free(b);
}

Test(prefill_chunk, fp4_pages_stay_within_what_decode_loses)
{
	size_t V = (size_t)M->hp.n_vocab, n = V * (N_DECODE + 1);
	float *a = malloc(sizeof(float) * n), *b = malloc(sizeof(float) * n);
	int32_t ta[N_DECODE + 1], tb[N_DECODE + 1];
	int agree = 0;

	cr_assert(a && b);
	run("bitdecoding-nvfp4", 0, a, ta);
	run("bitdecoding-nvfp4", 256, b, tb);
	/* the prompt's own 44 tokens past the pages are BF16 in both; the context of 256 is FP4
	 * in the chunked run only */
	cr_expect_leq(max_diff(a, b, V), 1.0f, "last prompt token: %g", max_diff(a, b, V));
	cr_expect_gt(max_diff(a, b, V), 0.0f, "the chunk must read the FP4 pages");
	for (int i = 0; i <= N_DECODE; i++)
		agree += ta[i] == tb[i];
	cr_expect_geq(agree, N_DECODE, "greedy tokens agree at %d of %d", agree, N_DECODE + 1);
	free(a);
	free(b);
}

Test(prefill_chunk, refusals_leave_the_sequence_as_it_was)
{
	int32_t t[400];
	struct bd_seq *s = seq("bitdecoding-nvfp4", 260);
	float *lg = malloc(sizeof(float) * (size_t)M->hp.n_vocab);

	cr_assert_not_null(lg);
	prompt(t, 400);
	cr_expect_eq(bd_model_prefill_chunk(NULL, s, t, 10, NULL), -EINVAL);
	cr_expect_eq(bd_model_prefill_chunk(M, s, t, 0, NULL), -EINVAL);
	cr_assert_eq(bd_model_prefill_chunk(M, s, t, 100, NULL), 0);
	cr_expect_eq(bd_model_prefill_chunk(M, s, t + 100, 28, NULL), -EINVAL,
		     "100 tokens are not whole pages");
	cr_expect_eq(bd_seq_n_tokens(s), 100);
	bd_seq_free(s);

	s = seq("bitdecoding-nvfp4", 260);
	cr_assert_eq(bd_model_prefill_chunk(M, s, t, 128, NULL), 0);
	cr_expect_eq(bd_model_prefill_chunk(M, s, t + 128, 200, NULL), -ENOSPC,
		     "328 tokens beyond the capacity of 260");
	t[128] = M->hp.n_vocab;
	cr_expect_eq(bd_model_prefill_chunk(M, s, t + 128, 10, NULL), -EINVAL, "a bad token id");
	prompt(t, 400);
	cr_expect_eq(bd_seq_n_tokens(s), 128, "refused chunks change nothing");
	cr_expect_eq(bd_model_prefill_chunk(M, s, t + 128, 132, lg), 0, "the capacity exactly");
	cr_expect_eq(bd_seq_n_tokens(s), 260);
	bd_seq_free(s);
	free(lg);
}
