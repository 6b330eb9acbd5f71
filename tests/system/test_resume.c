/* test_resume.c — a worker rank lost mid-generation, with real daemons (kvpoold, two workerd,
 * routerd on the CPU backend). Suite "resume".
 *
 * kill -9 of either rank while greedy requests stream: the router holds them (their slot,
 * pages and tokens stay in kvpoold), the test restarts the rank as systemd's Restart= would,
 * the group forms again and every request continues from its last token: its tokens are
 * exactly those of the same request run undisturbed on the same system before, none twice, and
 * the pool is back to its baseline after. A rank that does not come back within
 * resume_timeout_ms fails the held requests with a clear error and leaks nothing.
 */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "serve/bd_client.h"
#include "serve_common.h"

#define WAIT_MS 120000
#define N_REQ 2
#define N_PROMPT 200 /* past one page, so promoted FP4 pages are read after the resume */
#define N_GEN 72     /* positions 200 .. 271: a page completes after the resume */
#define KILL_AFTER 8 /* tokens streamed before the kill */

SV_TEST_SUITE(resume, 900);

static void make_prompts(void);

/* The system with resume_timeout_ms resume_ms, the prompts made; returns a client. */
static struct bd_client *up(const char *resume_ms)
{
	make_prompts();
	sv_start_system(&E, (const char *const[]){ "--heartbeat-timeout-ms", "3000",
						   "--resume-timeout-ms", resume_ms, NULL }, WAIT_MS);
	return sv_client(&E);
}

/* The router's health now, asked on a client of its own. */
static struct bd_client_health health_now(void)
{
	struct bd_client *hc = sv_client(&E);
	struct bd_client_health h;

	cr_assert_eq(bd_client_health(hc, WAIT_MS, &h), 0);
	bd_client_free(hc);
	return h;
}

static int32_t prompts[N_REQ][N_PROMPT];

static void make_prompts(void)
{
	for (int i = 0; i < N_REQ; i++)
		for (int t = 0; t < N_PROMPT; t++)
			prompts[i][t] = (int32_t)(300 + (t * 7919 + i * 104729) % 40000);
}

static void start(struct bd_client *c, uint64_t *tag)
{
	for (int i = 0; i < N_REQ; i++) {
		struct bd_client_gen g = { .token_ids = prompts[i], .n_token_ids = N_PROMPT,
					   .max_tokens = N_GEN, .stream = true,
					   .ignore_eos = true };

		cr_assert_eq(bd_client_generate_start(c, &g, &tag[i]), 0);
	}
}

/* Reads c's events into toks[N_REQ][N_GEN] (n[i] so far) until every request has ended or,
 * with stop_at > 0, until request 0 has stop_at tokens. Each request must end LENGTH. */
static void collect(struct bd_client *c, const uint64_t *tag, int32_t (*toks)[N_GEN], int *n,
		    int *ended, int stop_at)
{
	while (*ended < N_REQ && !(stop_at > 0 && n[0] >= stop_at)) {
		struct bd_client_event ev;
		int e = bd_client_next(c, WAIT_MS, &ev), i;

		cr_assert_eq(e, 0, "no event; router log:\n%s", sv_log_tail(&E.router));
		cr_assert_eq(ev.kind, BD_CLIENT_CHUNK, "%s", ev.message);
		for (i = 0; i < N_REQ && tag[i] != ev.tag; i++)
			;
		cr_assert_lt(i, N_REQ, "an event of no request of this client");
		cr_assert(ev.finish == BD_FINISH_NONE || ev.finish == BD_FINISH_LENGTH,
			  "request %d: finish %s (%s): %s; router log:\n%s", i,
			  bd_finish_name(ev.finish), bd_serve_error_name(ev.error), ev.message,
			  sv_log_tail(&E.router));
		for (size_t t = 0; t < ev.n_tokens; t++) {
			cr_assert_lt(n[i], N_GEN, "request %d: more tokens than max_tokens", i);
			toks[i][n[i]++] = ev.tokens[t];
		}
		*ended += ev.finish != BD_FINISH_NONE;
	}
}

/* Requests of N_REQ prompts run undisturbed, then again with rank lost after KILL_AFTER
 * tokens: killed (kill -9) and restarted, or stopped (SIGSTOP) past the heartbeat timeout and
 * continued (SIGCONT). Each must stream the undisturbed tokens, none twice. */
static void lose_rank_and_resume(int rank, bool stop)
{
	static int32_t want[N_REQ][N_GEN], got[N_REQ][N_GEN];
	int n_want[N_REQ] = { 0 }, n_got[N_REQ] = { 0 }, ended = 0;
	uint64_t tag[N_REQ];
	struct bd_client *c;

	c = up("60000");
	/* undisturbed */
	start(c, tag);
	collect(c, tag, want, n_want, &ended, 0);
	for (int i = 0; i < N_REQ; i++)
		cr_assert_eq(n_want[i], N_GEN);
	cr_assert(sv_pool_idle(&E, WAIT_MS));

	/* the same requests, rank killed mid-generation and restarted */
	ended = 0;
	start(c, tag);
	collect(c, tag, got, n_got, &ended, KILL_AFTER);
	cr_assert_eq(ended, 0, "the requests ended before the kill");
	if (stop) {
		cr_assert_eq(kill(E.worker[rank].pid, SIGSTOP), 0);
		cr_expect(sv_wait_health(&E, false, WAIT_MS), "health does not show the lost rank");
		cr_assert_eq(kill(E.worker[rank].pid, SIGCONT), 0);
	} else {
		cr_expect_eq(sv_stop(&E.worker[rank], SIGKILL, WAIT_MS), 128 + SIGKILL);
		cr_expect(sv_wait_health(&E, false, WAIT_MS), "health does not show the lost rank");
		struct bd_client_health h = health_now();
		cr_expect_not_null(strstr(h.reason, "rank"), "reason: %s", h.reason);
		sv_start_worker(&E, rank);
	}
	collect(c, tag, got, n_got, &ended, 0);
	for (int i = 0; i < N_REQ; i++) {
		cr_expect_eq(n_got[i], N_GEN, "request %d: %d tokens", i, n_got[i]);
		for (int t = 0; t < N_GEN && t < n_got[i]; t++)
			cr_expect_eq(got[i][t], want[i][t],
				     "request %d token %d: %d after the resume, %d undisturbed", i,
				     t, got[i][t], want[i][t]);
	}
	/* the baseline: every page and slot free, no record */
	cr_expect(sv_pool_idle(&E, WAIT_MS), "the pool holds pages or slots after the resume");
	cr_expect(sv_wait_health(&E, true, WAIT_MS), "health did not recover");
	struct bd_client_health h = health_now();
	cr_expect(h.healthy);
	cr_expect_str_eq(h.reason, "", "the reason of the failure stays after the recovery");
	bd_client_free(c);
}

Test(resume, kill_9_of_rank_1_mid_generation_loses_nothing)
{
	lose_rank_and_resume(1, false);
}

Test(resume, kill_9_of_rank_0_mid_generation_loses_nothing)
{
	lose_rank_and_resume(0, false);
}

/* The stopped process itself rejoins once continued: nothing restarts it. */
Test(resume, sigstop_then_sigcont_of_rank_1_rejoins_and_loses_nothing)
{
	lose_rank_and_resume(1, true);
	cr_expect_gt(E.worker[1].pid, 0);
	cr_expect_eq(kill(E.worker[1].pid, 0), 0, "the same rank 1 process serves");
}

Test(resume, sigstop_then_sigcont_of_rank_0_rejoins_and_loses_nothing)
{
	lose_rank_and_resume(0, true);
	cr_expect_eq(kill(E.worker[0].pid, 0), 0, "the same rank 0 process serves");
}

Test(resume, a_rank_that_does_not_come_back_fails_the_requests_clearly)
{
	static int32_t got[N_REQ][N_GEN];
	int n_got[N_REQ] = { 0 }, ended = 0;
	uint64_t tag[N_REQ];
	struct bd_client *c;

	c = up("2000");
	start(c, tag);
	collect(c, tag, got, n_got, &ended, 2);
	cr_expect_eq(sv_stop(&E.worker[1], SIGKILL, WAIT_MS), 128 + SIGKILL);
	while (ended < N_REQ) {
		struct bd_client_event ev;

		cr_assert_eq(bd_client_next(c, WAIT_MS, &ev), 0, "the held requests hang");
		if (ev.finish == BD_FINISH_NONE)
			continue;
		ended++;
		cr_expect_eq(ev.finish, BD_FINISH_ERROR);
		cr_expect_eq(ev.error, BD_SERVE_ERR_WORKER_FAILED, "%s", ev.message);
		cr_expect_not_null(strstr(ev.message, "did not form again within "
						      "resume_timeout_ms (2000 ms)"),
				   "%s", ev.message);
		cr_expect_not_null(strstr(ev.message, "rank 1"), "%s", ev.message);
	}
	cr_expect(sv_pool_idle(&E, WAIT_MS), "the failed requests left pages or slots");
	sv_start_worker(&E, 1);
	sv_expect_healthy(&E, WAIT_MS, "no recovery");
	bd_client_free(c);
}
