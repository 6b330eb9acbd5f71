/* test_batch_invariant.c — batch-invariant decoding with real daemons (kvpoold, two workerd,
 * routerd on the CPU backend, bitdecoding-nvfp4 pages). Suite "batch_invariant".
 *
 * With batch_invariant set on the router and the workers, three greedy requests of 130, 200 and
 * 5 tokens (prompts of 300, 200 and 20 tokens) yield, run together, the token streams each
 * yields alone, token for token. The router prefills in chunks of 256 within a budget of 384 a
 * step, so run together the 200-token prompt would be cut after the first chunk of the 300-token
 * one (128 + 72 instead of 200 at once) without the router's option; the workers' decode batches
 * hold 1 to 3 rows, whose matrix–matrix products add in another order than one row's without
 * the workers' option.
 *
 * BD_TEST_BATCH_INVARIANT=0 runs the same test with both options off (it then fails where
 * the streams first differ: the check that the test can fail).
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "serve/bd_client.h"
#include "serve_common.h"

#define WAIT_MS 180000
#define N_REQ 3

SV_TEST_SUITE(batch_invariant, 900);

static const int prompt_len[N_REQ] = { 300, 200, 20 }, gen_len[N_REQ] = { 130, 200, 5 };

/* Token ids of a prompt: a fixed walk over the vocabulary, away from the special tokens. */
static void walk(int32_t *t, int n, int salt)
{
	for (int i = 0; i < n; i++)
		t[i] = (int32_t)(300 + (i * 7919 + salt * 104729) % 40000);
}

/* Requests mask's prompts at once (greedy, streamed), then collects every stream: out[i]
 * [gen_len[i]] the tokens of request i. */
static void run(struct bd_client *c, int32_t prompts[N_REQ][300], unsigned mask,
		int32_t out[N_REQ][200])
{
	uint64_t tag[N_REQ] = { 0 };
	int got[N_REQ] = { 0 }, left = 0;

	for (int i = 0; i < N_REQ; i++) {
		if (!(mask & (1u << i)))
			continue;
		struct bd_client_gen g = { .token_ids = prompts[i],
					   .n_token_ids = (size_t)prompt_len[i],
					   .max_tokens = (uint32_t)gen_len[i], .stream = true,
					   .ignore_eos = true };
		cr_assert_eq(bd_client_generate_start(c, &g, &tag[i]), 0);
		left++;
	}
	while (left > 0) {
		struct bd_client_event ev;
		cr_assert_eq(bd_client_next(c, WAIT_MS, &ev), 0, "no event; router log:\n%s",
			     sv_log_tail(&E.router));
		cr_assert_eq(ev.kind, BD_CLIENT_CHUNK, "%s", ev.message);
		cr_assert(ev.finish == BD_FINISH_NONE || ev.finish == BD_FINISH_LENGTH,
			  "finish %s (%s): %s", bd_finish_name(ev.finish),
			  bd_serve_error_name(ev.error), ev.message);
		int i = 0;
		while (i < N_REQ && !(tag[i] == ev.tag && (mask & (1u << i))))
			i++;
		cr_assert_lt(i, N_REQ, "an event of an unknown request");
		for (size_t t = 0; t < ev.n_tokens; t++) {
			cr_assert_lt(got[i], gen_len[i]);
			out[i][got[i]++] = ev.tokens[t];
		}
		if (ev.finish != BD_FINISH_NONE) {
			cr_assert_eq(got[i], gen_len[i], "request %d ended after %d tokens", i, got[i]);
			left--;
		}
	}
}

Test(batch_invariant, greedy_tokens_alone_equal_tokens_in_a_batch)
{
	static int32_t prompts[N_REQ][300], solo[N_REQ][200], together[N_REQ][200];
	const char *env = getenv("BD_TEST_BATCH_INVARIANT");
	bool on = !env || strcmp(env, "0") != 0;
	const char *flag = on ? "--batch-invariant" : NULL;

	for (int i = 0; i < N_REQ; i++)
		walk(prompts[i], prompt_len[i], i + 1);
	sv_start_pool(&E, NULL);
	sv_start_router(&E, (const char *const[]){ "--max-prefill-chunk", "256",
						   "--max-prefill-tokens", "384", flag, NULL });
	for (int r = 0; r < 2; r++)
		sv_start_worker_args(&E, r, (const char *const[]){ flag, NULL });
	sv_expect_healthy(&E, WAIT_MS, "the group did not form");
	struct bd_client *c = sv_client(&E);

	for (int i = 0; i < N_REQ; i++)
		run(c, prompts, 1u << i, solo);
	run(c, prompts, (1u << N_REQ) - 1, together);
	for (int i = 0; i < N_REQ; i++) {
		int first = -1;
		for (int t = 0; t < gen_len[i] && first < 0; t++)
			if (solo[i][t] != together[i][t])
				first = t;
		cr_expect_eq(first, -1,
			     "batch_invariant %s: request %d (%d tokens) leaves its solo stream at "
			     "token %d (%d alone, %d in the batch)",
			     on ? "on" : "off", i, gen_len[i], first, first >= 0 ? solo[i][first] : 0,
			     first >= 0 ? together[i][first] : 0);
	}
	cr_expect(sv_pool_idle(&E, WAIT_MS), "pages or slots left in the pool");
	bd_client_free(c);
}
