/* test_pool_restart_serve.c — kvpoold killed under a running generation, with routerd and two
 * CPU workers (TP=2, the embedded SmolLM2) up, and started again as systemd would: through an
 * emulated fd store (tests/common/fdstore.h).
 *
 * Started on what it stored, kvpoold adopts its arenas and its records: the workers keep their
 * mappings and attach again, the router's running request waits for the pool and then goes on,
 * and its greedy tokens are exactly those of an undisturbed run of the same request. Started
 * with an empty store, the pool is new: the workers are told so (-ESTALE) and exit to be
 * restarted, the running request fails with a clear error, and the system serves again once
 * the workers are back. Gone for longer than the router's pool_wait_ms, the pool costs the
 * running request (UNAVAILABLE) but nothing it held once it is back.
 */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "serve/bd_client.h"
#include "pool/bd_pool_client.h"
#include "fdstore.h"
#include "serve_common.h"
#include "spawn.h"

#define WAIT_MS 60000
/* crosses the 128-token page boundary after the restart: a page promoted by the adopted pool */
#define N_TOKENS 160
#define BEFORE 6 /* tokens streamed before the kill */

static struct sv_env E;
static struct fs_store S;
static char pool_log[160], notify[160];

/* True when the log file at path holds what. */
static bool log_has(const char *path, const char *what)
{
	FILE *f = fopen(path, "r");
	char *buf = NULL;
	size_t cap = 0;
	ssize_t n;
	bool found = false;

	if (!f)
		return false;
	while (!found && (n = getline(&buf, &cap, f)) > 0)
		found = strstr(buf, what) != NULL;
	free(buf);
	fclose(f);
	return found;
}

static void init(void)
{
	sv_init(&E);
	snprintf(notify, sizeof(notify), "%s/notify-store.sock", E.dir);
	snprintf(pool_log, sizeof(pool_log), "%s/kvpoold.log", E.dir);
	cr_assert_eq(fs_open(&S, notify), 0);
}

static void fini(void)
{
	E.pool.pid = 0; /* the store's daemon: fs_close ends it */
	fs_close(&S);
	sv_fini(&E);
}

TestSuite(pool_restart_serve, .init = init, .fini = fini, .timeout = 300);

/* kvpoold as sv_start_pool starts it, under the store. */
static void start_pool(void)
{
	char bin[PATH_MAX + 16];
	const char *argv[] = {
		bin, "--no-config", "--socket", E.pool_sock, "--endpoint", E.pool_ep,
		"--tp", "2", "--layers", "30", "--kv-heads", "3", "--head-dim", "64",
		"--kv-config", "bitdecoding-nvfp4", "--max-seq-len", "1024", "--pages", "64",
		"--slots", "24", "--status-interval-ms", "1000", NULL,
	};

	snprintf(bin, sizeof(bin), "%s/kvpoold", E.bin);
	cr_assert_eq(fs_start(&S, argv, pool_log, WAIT_MS), 0, "kvpoold did not get ready");
	E.pool.pid = S.pid;
	memcpy(E.pool.log, pool_log, sizeof(pool_log));
}

static void up_with(const char *pool_wait_ms)
{
	start_pool();
	sv_start_router(&E, (const char *const[]){ "--heartbeat-timeout-ms", "3000",
						   "--pool-wait-ms", pool_wait_ms, NULL });
	sv_start_workers(&E, WAIT_MS, "the group did not form");
}

/* The system with a patient router; returns a client. */
static struct bd_client *up(void)
{
	up_with("30000");
	return sv_client(&E);
}

static const struct bd_client_gen GEN = {
	.prompt = "Tell me a long story about a lighthouse keeper.", .chat = true,
	.max_tokens = N_TOKENS, .stream = true, .ignore_eos = true,
};

/* Streams c's request tag into toks (cap), from *n on, until its final chunk (into *ev) or, with
 * stop_at > 0, until stop_at tokens came (then ev->finish is BD_FINISH_NONE). */
static void stream(struct bd_client *c, uint64_t tag, int32_t *toks, size_t cap, size_t *n,
		   size_t stop_at, struct bd_client_event *ev)
{
	for (;;) {
		cr_assert_eq(bd_client_next(c, WAIT_MS, ev), 0, "the request hangs; router log:\n%s",
			     sv_log_tail(&E.router));
		if (ev->tag != tag)
			continue;
		if (ev->kind != BD_CLIENT_CHUNK)
			return; /* an error event: the caller looks at it */
		for (size_t i = 0; i < ev->n_tokens && *n < cap; i++)
			toks[(*n)++] = ev->tokens[i];
		if (ev->finish != BD_FINISH_NONE || (stop_at && *n >= stop_at))
			return;
	}
}

/* GEN started on c and streamed for BEFORE tokens into got (*n of them), still running: its
 * tag. ev: the last event. */
static uint64_t start_part_way(struct bd_client *c, int32_t *got, size_t *n,
			       struct bd_client_event *ev)
{
	uint64_t tag;

	cr_assert_eq(bd_client_generate_start(c, &GEN, &tag), 0);
	stream(c, tag, got, N_TOKENS, n, BEFORE, ev);
	cr_assert_eq(ev->finish, BD_FINISH_NONE, "%s", ev->message);
	return tag;
}

/* kvpoold killed with SIGKILL and reaped: no pool runs. */
static void kill_pool(void)
{
	cr_assert_eq(kill(S.pid, SIGKILL), 0);
	sp_reap(S.pid, WAIT_MS);
	S.pid = E.pool.pid = 0;
}

/* A short chat request on c runs to its end (length or stop). */
static void expect_short_answer(struct bd_client *c)
{
	const struct bd_client_gen g = { .prompt = "Hi!", .chat = true, .max_tokens = 4 };
	struct bd_client_event ev;
	int32_t got[N_TOKENS];
	size_t n = 0;
	uint64_t tag;

	cr_assert_eq(bd_client_generate_start(c, &g, &tag), 0);
	stream(c, tag, got, N_TOKENS, &n, 0, &ev);
	cr_expect_eq(ev.kind, BD_CLIENT_CHUNK, "%s", ev.message);
	cr_expect(ev.finish == BD_FINISH_LENGTH || ev.finish == BD_FINISH_STOP, "finish %s: %s",
		  bd_finish_name(ev.finish), ev.message);
}

/* kvpoold started again (its last instance SIGKILLed if still there) on the arenas and the
 * state of its store, as its log says. */
static void restart_pool_on_store(void)
{
	cr_assert_eq(fs_restart(&S, SIGKILL, WAIT_MS), 0, "kvpoold did not come back; log:\n%s",
		     sv_log_tail(&E.pool));
	E.pool.pid = S.pid;
	cr_expect(log_has(pool_log, "adopted the stored arenas and state"), "log:\n%s",
		  sv_log_tail(&E.pool));
}

/* The greedy tokens of GEN on the undisturbed system. */
static size_t reference(struct bd_client *c, int32_t *toks)
{
	struct bd_client_event ev;
	uint64_t tag;
	size_t n = 0;

	cr_assert_eq(bd_client_generate_start(c, &GEN, &tag), 0);
	stream(c, tag, toks, N_TOKENS, &n, 0, &ev);
	cr_assert_eq(ev.finish, BD_FINISH_LENGTH, "%s", ev.message);
	cr_assert_eq(n, N_TOKENS);
	return n;
}

Test(pool_restart_serve, kill_9_mid_generation_resumes_on_the_stored_arenas)
{
	int32_t want[N_TOKENS], got[N_TOKENS];
	struct bd_client *c;
	struct bd_client_event ev;
	pid_t w0, w1;
	size_t n = 0;
	uint64_t tag;
	struct bd_pool_stats *s, *s2;

	c = up();
	reference(c, want);
	cr_assert(sv_pool_idle(&E, WAIT_MS), "the reference run left pages in the pool");
	w0 = E.worker[0].pid;
	w1 = E.worker[1].pid;

	s = sv_pool_stats(&E);
	cr_assert_not_null(s, "kvpoold does not answer");
	cr_assert_gt(s->group_epoch, 0, "the router registered no group");
	cr_expect_eq(s->n_attachments, 2);
	tag = start_part_way(c, got, &n, &ev);
	cr_assert_lt(n, N_TOKENS, "the generation ended before the kill");
	restart_pool_on_store();
	stream(c, tag, got, N_TOKENS, &n, 0, &ev);
	cr_assert_eq(ev.kind, BD_CLIENT_CHUNK, "error %d: %s", ev.error, ev.message);
	cr_expect_eq(ev.finish, BD_FINISH_LENGTH, "finish %s: %s", bd_finish_name(ev.finish),
		     ev.message);
	cr_expect_eq(ev.usage.completion_tokens, N_TOKENS);
	cr_assert_eq(n, N_TOKENS);
	for (size_t i = 0; i < n; i++)
		cr_expect_eq(got[i], want[i], "token %zu: %d, the undisturbed run has %d", i,
			     got[i], want[i]);
	/* the workers did not restart: they kept their mappings and attached again */
	cr_expect_eq(E.worker[0].pid, w0);
	cr_expect_eq(E.worker[1].pid, w1);
	cr_expect_eq(kill(w0, 0), 0, "rank 0 exited");
	cr_expect_eq(kill(w1, 0), 0, "rank 1 exited");
	cr_expect(log_has(E.worker[0].log, "attached again to kvpoold"), "log:\n%s",
		  sv_log_tail(&E.worker[0]));
	cr_expect(log_has(E.worker[1].log, "attached again to kvpoold"), "log:\n%s",
		  sv_log_tail(&E.worker[1]));
	cr_expect(sv_pool_idle(&E, WAIT_MS), "the request's pages were not released");
	sv_expect_healthy(&E, WAIT_MS, "not healthy after the restart");
	/* the restarted pool has no group of its own: the router registered its epoch again, and
	 * each worker attached with the token it held */
	s2 = sv_pool_stats(&E);
	cr_assert_not_null(s2, "the restarted kvpoold does not answer");
	cr_expect_eq(s2->group_epoch, s->group_epoch, "the router's epoch in the restarted pool");
	cr_expect_eq(s2->n_attachments, 2);
	bd_pool_stats_free(s);
	bd_pool_stats_free(s2);
	cr_expect(log_has(E.router.log, "registering again"), "router log:\n%s",
		  sv_log_tail(&E.router));
	cr_expect(log_has(pool_log, "with its token of epoch"), "log:\n%s",
		  sv_log_tail(&E.pool));
	expect_short_answer(c);
	bd_client_free(c);
}

Test(pool_restart_serve, a_restart_on_an_empty_store_fails_the_request_clearly)
{
	int32_t got[N_TOKENS];
	struct bd_client *c;
	struct bd_client_event ev;
	size_t n = 0;
	uint64_t tag;

	c = up();
	tag = start_part_way(c, got, &n, &ev);
	/* killed, its store emptied, started again: a new pool */
	kill_pool();
	fs_pump(&S, NULL, NULL);
	fs_clear(&S);
	cr_assert_eq(fs_restart(&S, SIGKILL, WAIT_MS), 0, "kvpoold did not start; log:\n%s",
		     sv_log_tail(&E.pool));
	E.pool.pid = S.pid;
	stream(c, tag, got, N_TOKENS, &n, 0, &ev);
	cr_expect_eq(ev.kind, BD_CLIENT_CHUNK);
	cr_expect_eq(ev.finish, BD_FINISH_ERROR, "finish %s", bd_finish_name(ev.finish));
	/* whichever the router hears first: the pool's new arena id, or a worker that left
	 * because of it */
	if (ev.error == BD_SERVE_ERR_UNAVAILABLE)
		cr_expect_not_null(strstr(ev.message, "without its stored arenas"), "%s",
				   ev.message);
	else
		cr_expect_eq(ev.error, BD_SERVE_ERR_WORKER_FAILED, "error %d: %s", ev.error,
			     ev.message);
	{
		int64_t end = sv_now_ms() + WAIT_MS;

		while (!log_has(E.router.log, "kvpoold restarted without its stored arenas") &&
		       sv_now_ms() < end)
			usleep(20000);
		cr_expect(log_has(E.router.log, "kvpoold restarted without its stored arenas"),
			  "the router did not notice the new pool; log:\n%s",
			  sv_log_tail(&E.router));
	}
	/* the workers learn that their pages are gone and exit, to be restarted */
	for (int r = 0; r < 2; r++) {
		cr_expect_eq(sv_stop(&E.worker[r], 0, WAIT_MS), 1, "rank %d", r);
		cr_expect(log_has(E.worker[r].log, "other arenas"), "rank %d log:\n%s", r,
			  sv_log_tail(&E.worker[r]));
	}
	cr_expect_eq(kill(E.router.pid, 0), 0, "routerd must stay up");
	sv_start_workers(&E, WAIT_MS, "no recovery");
	expect_short_answer(c);
	cr_expect(sv_pool_idle(&E, WAIT_MS), "the pool holds pages after the answers");
	bd_client_free(c);
}

/* kvpoold gone for longer than the router's pool_wait_ms: the running request fails with a
 * clear UNAVAILABLE instead of waiting on; the pool, started again on its store later, gets
 * back everything the failed request held, and the workers (still within their wait) attach
 * again and serve. */
Test(pool_restart_serve, a_wait_past_pool_wait_ms_fails_the_request_and_leaks_nothing)
{
	int32_t got[N_TOKENS];
	struct bd_client *c;
	struct bd_client_event ev;
	size_t n = 0;
	uint64_t tag;

	up_with("1500");
	c = sv_client(&E);
	tag = start_part_way(c, got, &n, &ev);
	kill_pool();
	stream(c, tag, got, N_TOKENS, &n, 0, &ev);
	cr_expect_eq(ev.kind, BD_CLIENT_CHUNK);
	cr_expect_eq(ev.finish, BD_FINISH_ERROR, "finish %s", bd_finish_name(ev.finish));
	cr_expect_eq(ev.error, BD_SERVE_ERR_UNAVAILABLE, "error %d: %s", ev.error, ev.message);
	cr_expect_not_null(strstr(ev.message, "kvpoold unreachable"), "%s", ev.message);
	cr_expect_lt(n, N_TOKENS, "the request ran on without its pool");
	cr_expect(log_has(E.router.log, "did not answer for 1500 ms (pool_wait_ms)"),
		  "router log:\n%s", sv_log_tail(&E.router));
	/* back on what it stored: the failed request's pages and slot go back */
	restart_pool_on_store();
	cr_expect(sv_pool_idle(&E, WAIT_MS), "the failed request's pages were not released");
	sv_expect_healthy(&E, WAIT_MS, "no recovery");
	expect_short_answer(c);
	cr_expect_eq(kill(E.worker[0].pid, 0), 0, "rank 0 exited");
	cr_expect_eq(kill(E.worker[1].pid, 0), 0, "rank 1 exited");
	cr_expect(sv_pool_idle(&E, WAIT_MS), "the pool holds pages after the answers");
	bd_client_free(c);
}
