/* test_prefix.c — prefix caching with real daemons (kvpoold, two workerd, routerd on the CPU
 * backend, bitdecoding-nvfp4 pages). Suite "prefix".
 *
 * Prompts A and B share their first 1024 tokens (8 pages) and differ after. A runs first and
 * its 8 prompt pages are indexed; B then finds them: kvpoold counts 8 hits, and B's prefill
 * starts at position 1024 on those pages (its sink rebuilt from the first 16 tokens). The same
 * B with another cache salt finds nothing (8 hits still) and is prefilled whole in the
 * router's chunks (512, 512, the rest: the chunks A's pages were written in), which is what
 * a run without caching does: its greedy tokens must equal the hit's. Then a long prompt needs
 * more pages than are free: idle cached pages are evicted, least recently released first (the
 * unsalted B's, not the salted B's, which a repeat still finds whole), and at the end every
 * reference is gone: no record, nothing used or shared, every page free capacity.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pool/bd_pool_client.h"
#include "serve/bd_client.h"
#include "serve_common.h"

#define WAIT_MS 240000
#define N_PREFIX 1024
#define N_A (N_PREFIX + 100)
#define N_B (N_PREFIX + 150)
#define N_BIG 1800
#define STEPS 8

static struct sv_env E;

static void init(void)
{
	sv_init(&E);
}

static void fini(void)
{
	sv_fini(&E);
}

TestSuite(prefix, .init = init, .fini = fini, .timeout = 900);

/* Token ids: a fixed walk over the vocabulary, away from the special tokens. */
static void walk(int32_t *t, int n, int salt)
{
	for (int i = 0; i < n; i++)
		t[i] = (int32_t)(300 + (i * 7919 + salt * 104729) % 40000);
}

/* One greedy request of prompt[n] to its end: its STEPS tokens into out. */
static void run(struct bd_client *c, const int32_t *prompt, int n, const char *salt,
		int32_t *out)
{
	struct bd_client_gen g = { .token_ids = prompt, .n_token_ids = (size_t)n,
				   .max_tokens = STEPS, .stream = true, .ignore_eos = true,
				   .cache_salt = salt };
	uint64_t tag;
	int got = 0;

	cr_assert_eq(bd_client_generate_start(c, &g, &tag), 0);
	for (;;) {
		struct bd_client_event ev;

		cr_assert_eq(bd_client_next(c, WAIT_MS, &ev), 0, "no event; router log:\n%s",
			     sv_log_tail(&E.router));
		cr_assert_eq(ev.kind, BD_CLIENT_CHUNK, "%s", ev.message);
		cr_assert_eq(ev.tag, tag);
		cr_assert(ev.finish == BD_FINISH_NONE || ev.finish == BD_FINISH_LENGTH,
			  "finish %s (%s): %s\nworker 0:\n%s", bd_finish_name(ev.finish),
			  bd_serve_error_name(ev.error), ev.message, sv_log_tail(&E.worker[0]));
		for (size_t t = 0; t < ev.n_tokens && got < STEPS; t++)
			out[got++] = ev.tokens[t];
		if (ev.finish != BD_FINISH_NONE)
			break;
	}
	cr_assert_eq(got, STEPS);
}

static struct bd_pool_stats *stats(void)
{
	struct bd_pool_conn *c;
	struct bd_pool_stats *s = NULL;

	cr_assert_eq(bd_pool_conn_new(E.pool_ep, 3000, &c), 0);
	cr_assert_eq(bd_pool_stats(c, 0, &s), 0);
	bd_pool_conn_free(c);
	return s;
}

Test(prefix, a_shared_prefix_is_read_from_cached_pages_and_changes_no_token)
{
	static int32_t a[N_A], b[N_B], big[N_BIG];
	int32_t ta[STEPS], tb_hit[STEPS], tb_salted[STEPS], again[STEPS];
	struct bd_pool_stats *s;
	struct bd_client *c;
	uint64_t hits, evictions;

	walk(a, N_A, 0);
	memcpy(b, a, sizeof(int32_t) * N_PREFIX);
	walk(b + N_PREFIX, N_B - N_PREFIX, 1);
	walk(big, N_BIG, 2);
	sv_start_pool(&E, (const char *const[]){ "--max-seq-len", "2048", "--pages", "24", NULL });
	sv_start_router(&E, NULL);
	sv_start_worker(&E, 0);
	sv_start_worker(&E, 1);
	sv_expect_healthy(&E, WAIT_MS, "the group did not form");
	c = sv_client(&E);

	run(c, a, N_A, NULL, ta);
	s = stats();
	/* A's 1124 prompt tokens fill 8 pages, all indexed; nothing was there to hit */
	cr_expect_eq(s->prefix_stored, 8);
	cr_expect_eq(s->prefix_hits, 0);
	cr_expect_eq(s->pages_cached_idle, 8, "A's pages stay, held by no one");
	cr_expect_eq(s->pages_free, s->pages_total, "idle cached pages are free capacity");
	bd_pool_stats_free(s);

	run(c, b, N_B, NULL, tb_hit);
	s = stats();
	cr_expect_eq(s->prefix_hits, 8, "B read the 8 pages of the shared 1024 tokens");
	/* B asked for (1174 − 1) / 128 = 9 pages after A's 8 */
	cr_expect_eq(s->prefix_queries, 17);
	/* and indexed its own 9th page (positions 1024 .. 1151) */
	cr_expect_eq(s->prefix_stored, 9);
	bd_pool_stats_free(s);

	run(c, b, N_B, "tenant-2", tb_salted);
	s = stats();
	cr_expect_eq(s->prefix_hits, 8, "another salt shares nothing");
	cr_expect_eq(s->prefix_stored, 18);
	bd_pool_stats_free(s);
	for (int i = 0; i < STEPS; i++)
		cr_expect_eq(tb_hit[i], tb_salted[i],
			     "token %d: %d with the cached prefix, %d computed whole", i, tb_hit[i],
			     tb_salted[i]);

	/* 18 idle pages and 6 free: the long prompt's 14 pages evict 8, least recent first */
	run(c, big, N_BIG, NULL, again);
	s = stats();
	evictions = s->prefix_evictions;
	cr_expect_geq(evictions, 8);
	hits = s->prefix_hits;
	bd_pool_stats_free(s);
	/* the salted B was released last: its 9 pages are still all there */
	run(c, b, N_B, "tenant-2", again);
	s = stats();
	cr_expect_eq(s->prefix_hits, hits + 9);
	for (int i = 0; i < STEPS; i++)
		cr_expect_eq(again[i], tb_salted[i], "token %d of the repeat", i);
	bd_pool_stats_free(s);

	cr_assert(sv_pool_idle(&E, 10000), "the pool still holds pages or records");
	s = stats();
	cr_expect_eq(s->requests, 0);
	cr_expect_eq(s->pages_used, 0);
	cr_expect_eq(s->pages_shared, 0);
	cr_expect_eq(s->pages_free, s->pages_total);
	bd_pool_stats_free(s);
	bd_client_free(c);
}
