/* test_chunked.c — chunked prefill with real daemons (kvpoold, two workerd, routerd on the CPU
 * backend): a long prompt beside short ones. Suite "chunked".
 *
 * The router prefills the long prompt in chunks of 128 tokens (max_prefill_chunk) within a
 * budget of 256 a step (max_prefill_tokens), so the short prompts are admitted beside its
 * first chunk and decode while it is still prefilling: each short request's first token comes
 * before the long one's (events of one client arrive in the order the router sends them, so
 * this is an order, not a timing). The long request's answer is checked against the
 * single-process model prefilled in the same chunks (bd_model_prefill_chunk): teacher-forced
 * along its greedy trajectory, every served top logit within LOGIT_TOL.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/bd_forward.h"
#include "model/bd_sampler.h"
#include "quant/bd_kvcfg.h"
#include "serve/bd_client.h"
#include "serve_common.h"

#define WAIT_MS 120000
#define CHUNK 128
#define N_LONG 1000
#define N_SHORT 4
#define SHORT_LEN 24
#define STEPS 4
#define TOP 4
/* |served − single-process| of a logit (≈ 25 here): the ranks sum partial products in another
 * order (test_serve.c's 0.25 for prompts prefilled at once), which flips a few FP4 roundings
 * of the context pages; every chunk after the first reads those pages, so over 1000 tokens and
 * 30 layers the flips add up (0.45 seen) */
#define LOGIT_TOL 0.75f

SV_TEST_SUITE(chunked, 600);

/* Token ids of a prompt: a fixed walk over the vocabulary, away from the special tokens. */
static void walk(int32_t *t, int n, int salt)
{
	for (int i = 0; i < n; i++)
		t[i] = (int32_t)(300 + (i * 7919 + salt * 104729) % 40000);
}

/* The single-process greedy trajectory of prompt[n] prefilled in chunks of CHUNK, and the
 * logits along it: traj[STEPS], logits [STEPS][V]. */
static void reference(const struct bd_model *m, const int32_t *prompt, int n, int32_t *traj,
		      float *logits)
{
	struct bd_seq_opts o = { .max_tokens = n + STEPS };
	struct bd_seq *s;
	char err[BD_MODEL_ERR_MAX];
	int V = m->hp.n_vocab;

	cr_assert_eq(bd_seq_new(m, bd_kvcfg_find("bitdecoding-nvfp4"), &o, &s, err), 0, "%s", err);
	for (int p = 0; p < n; p += CHUNK) {
		int k = n - p < CHUNK ? n - p : CHUNK;

		cr_assert_eq(bd_model_prefill_chunk(m, s, prompt + p, k, p + k == n ? logits : NULL),
			     0);
	}
	for (int i = 0; i < STEPS; i++) {
		traj[i] = bd_argmax(logits + (size_t)i * V, V);
		if (i + 1 < STEPS)
			cr_assert_eq(bd_model_decode(m, s, traj[i], logits + (size_t)(i + 1) * V), 0);
	}
	bd_seq_free(s);
}

Test(chunked, short_prompts_get_their_first_token_while_a_long_one_prefills)
{
	static int32_t long_p[N_LONG], short_p[N_SHORT][SHORT_LEN];
	int32_t traj[STEPS];
	struct bd_model *m;
	struct bd_client *c;
	uint64_t tag_long, tag_short[N_SHORT];
	int first_long = -1, first_short[N_SHORT], ended = 0, step = 0, ev_i = 0, agree = 0;
	char err[BD_MODEL_ERR_MAX];
	float *logits;

	walk(long_p, N_LONG, 0);
	cr_assert_eq(bd_model_load(E.model, &m, err), 0, "%s", err);
	logits = malloc(sizeof(float) * (size_t)m->hp.n_vocab * STEPS);
	cr_assert_not_null(logits);
	reference(m, long_p, N_LONG, traj, logits);

	sv_start_system(&E, (const char *const[]){ "--max-prefill-chunk", "128",
						   "--max-prefill-tokens", "256", NULL }, WAIT_MS);
	c = sv_client(&E);

	struct bd_client_gen gl = { .token_ids = long_p, .n_token_ids = N_LONG,
				    .max_tokens = STEPS, .stream = true, .ignore_eos = true,
				    .forced_tokens = traj, .n_forced = STEPS,
				    .logits_top_k = TOP };
	cr_assert_eq(bd_client_generate_start(c, &gl, &tag_long), 0);
	for (int i = 0; i < N_SHORT; i++) {
		struct bd_client_gen gs = { .token_ids = short_p[i], .n_token_ids = SHORT_LEN,
					    .max_tokens = STEPS, .stream = true,
					    .ignore_eos = true };

		walk(short_p[i], SHORT_LEN, i + 1);
		first_short[i] = -1;
		cr_assert_eq(bd_client_generate_start(c, &gs, &tag_short[i]), 0);
	}
	while (ended < N_SHORT + 1) {
		struct bd_client_event ev;
		int e = bd_client_next(c, WAIT_MS, &ev);

		cr_assert_eq(e, 0, "no event; router log:\n%s", sv_log_tail(&E.router));
		cr_assert_eq(ev.kind, BD_CLIENT_CHUNK, "%s", ev.message);
		cr_assert(ev.finish == BD_FINISH_NONE || ev.finish == BD_FINISH_LENGTH,
			  "finish %s (%s): %s", bd_finish_name(ev.finish),
			  bd_serve_error_name(ev.error), ev.message);
		ended += ev.finish != BD_FINISH_NONE;
		ev_i++;
		if (ev.tag != tag_long) {
			for (int i = 0; i < N_SHORT; i++)
				if (ev.tag == tag_short[i] && first_short[i] < 0 && ev.n_tokens)
					first_short[i] = ev_i;
			continue;
		}
		if (first_long < 0 && ev.n_tokens)
			first_long = ev_i;
		for (size_t t = 0; t < ev.n_tokens; t++, step++) {
			const struct bd_client_top *top = ev.top + t * ev.top_k;
			const float *lg = logits + (size_t)step * (size_t)m->hp.n_vocab;

			cr_assert_lt(step, STEPS);
			cr_expect_eq(ev.tokens[t], traj[step]);
			agree += top[0].token == traj[step];
			for (size_t k = 0; k < ev.top_k && top[k].token >= 0; k++)
				cr_expect_leq(fabsf(top[k].logit - lg[top[k].token]), LOGIT_TOL,
					      "step %d token %d: served %.4f, single-process %.4f",
					      step, top[k].token, top[k].logit, lg[top[k].token]);
		}
	}
	cr_expect_eq(step, STEPS);
	/* a near tie may fall the other way, as test_serve.c allows at 1 % of its steps */
	cr_expect_geq(agree, STEPS - 1, "top-1 agrees at %d of %d steps", agree, STEPS);
	cr_assert_gt(first_long, 0);
	for (int i = 0; i < N_SHORT; i++) {
		cr_assert_gt(first_short[i], 0, "short %d got no token", i);
		cr_expect_lt(first_short[i], first_long,
			     "short %d's first token (event %d) came after the long prompt's "
			     "(event %d): it waited for the whole prefill", i, first_short[i],
			     first_long);
	}
	cr_expect(sv_pool_idle(&E, WAIT_MS), "pages or slots left in the pool");
	bd_client_free(c);
	free(logits);
	bd_model_free(m);
}
