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
 *
 * The KV event stream: a subscriber (clients/python/kv_events.py, msgpack as a KV-aware router
 * decodes vLLM's events) receives A's pages as BlockStored with the hashes the router's chain
 * gives (computed here independently from the token ids), each event's parent the hash before
 * it, 128 token ids per block; the replay endpoint gives a late subscriber the whole history,
 * AllBlocksCleared first; evictions come as BlockRemoved, and the hashes the stream says are
 * held are as many as the pool's cached pages.
 */
#include <criterion/criterion.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pool/bd_pool_client.h"
#include "serve/bd_client.h"
#include "pool/bd_prefix.h"
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

/* The hashes the router gives the first n pages of toks (pool/bd_prefix.h), unsalted, for the
 * embedded model and the pool's bitdecoding-nvfp4. */
static void expected_hashes(const int32_t *toks, int n, uint64_t *ret)
{
	const char *slash = strrchr(E.model, '/');
	uint64_t seed = bd_prefix_seed(slash ? slash + 1 : E.model, "bitdecoding-nvfp4",
					      "nvfp4", 0);

	seed = bd_prefix_salted(seed, "bitdecoding-nvfp4", strlen("bitdecoding-nvfp4"));
	bd_prefix_hashes(seed, toks, n, ret);
}

/* Runs the consumer with args, its stdout into out. */
static void consumer(const char *args, char *out, size_t cap)
{
	char cmd[2 * PATH_MAX];
	const char *py = access("/usr/bin/python3", X_OK) == 0 ? "/usr/bin/python3" : "python3";
	int rc;

	snprintf(cmd, sizeof(cmd), "%s '%s/clients/python/kv_events.py' %s", py, E.root, args);
	rc = sv_run_output(cmd, out, cap);
	cr_assert_eq(rc, 0, "%s: exit %d\n%s", cmd, rc, out);
}

Test(prefix, kv_events_tell_what_the_pool_holds)
{
	static int32_t a[N_A], big[N_BIG];
	static char out[1 << 20];
	char ev[160], rp[160], args[512], bg[2 * PATH_MAX], want[64];
	int32_t toks[STEPS];
	uint64_t h[8];
	struct bd_pool_stats *s;
	struct bd_client *c;
	const char *p;
	int n_held = 0;

	walk(a, N_A, 0);
	walk(big, N_BIG, 2);
	expected_hashes(a, 8, h);
	snprintf(ev, sizeof(ev), "ipc://%s/kv-events.sock", E.dir);
	snprintf(rp, sizeof(rp), "ipc://%s/kv-replay.sock", E.dir);
	/* 16 pages: after A's 8, the long prompt's 14 evict 6 of them */
	sv_start_pool(&E, (const char *const[]){ "--max-seq-len", "2048", "--pages", "16",
						 "--kv-events", ev, "--kv-events-replay", rp,
						 NULL });
	sv_start_router(&E, NULL);
	sv_start_worker(&E, 0);
	sv_start_worker(&E, 1);
	sv_expect_healthy(&E, WAIT_MS, "the group did not form");
	/* a live subscriber of the next two batches (A's two chunks of 4 pages), in the
	 * background; given a moment to connect */
	snprintf(bg, sizeof(bg), "%s '%s/clients/python/kv_events.py' --sub %s --count 2 "
		 "--timeout-ms 200000 > '%s/sub.out' 2>&1 &",
		 access("/usr/bin/python3", X_OK) == 0 ? "/usr/bin/python3" : "python3", E.root, ev,
		 E.dir);
	cr_assert_eq(system(bg), 0);
	usleep(1500 * 1000);
	c = sv_client(&E);
	run(c, a, N_A, NULL, toks);

	/* the live batches: two BlockStored of 4 blocks, chained */
	{
		char path[160];
		FILE *f;
		size_t n;
		int64_t end = sv_now_ms() + 20000;

		snprintf(path, sizeof(path), "%s/sub.out", E.dir);
		do {
			f = fopen(path, "r");
			n = f ? fread(out, 1, sizeof(out) - 1, f) : 0;
			if (f)
				fclose(f);
			out[n] = 0;
			if (strchr(out, '\n') && strchr(strchr(out, '\n') + 1, '\n'))
				break;
			usleep(100000);
		} while (sv_now_ms() < end);
		snprintf(want, sizeof(want), "\"block_hashes\": [%llu, ", (unsigned long long)h[0]);
		cr_assert_not_null(strstr(out, want), "the first live batch lacks %s:\n%s", want,
				   out);
		snprintf(want, sizeof(want), "\"parent_block_hash\": %llu,",
			 (unsigned long long)h[3]);
		cr_assert_not_null(strstr(out, want), "the second batch's parent is not page 3's "
				   "hash %llu:\n%s", (unsigned long long)h[3], out);
		snprintf(want, sizeof(want), "%llu]", (unsigned long long)h[7]);
		cr_assert_not_null(strstr(out, want), "page 7's hash is not stored:\n%s", out);
		cr_expect_not_null(strstr(out, "\"block_size\": 128"));
	}

	/* a late subscriber replays everything: the clear first, then A's 8 blocks */
	snprintf(args, sizeof(args), "--replay %s", rp);
	consumer(args, out, sizeof(out));
	cr_assert_not_null(strstr(out, "\"AllBlocksCleared\""), "%s", out);
	cr_assert_lt(strstr(out, "\"AllBlocksCleared\""), strstr(out, "\"BlockStored\""));
	/* 128 token ids per block: A's first token opens the first BlockStored's list */
	snprintf(want, sizeof(want), "\"token_ids\": [%d, %d,", a[0], a[1]);
	cr_assert_not_null(strstr(out, want), "%s", out);

	/* the long prompt evicts 6 of A's pages, the tail first (A's release dropped its last
	 * page first): BlockRemoved of h[7] .. h[2], h[0] and h[1] kept */
	run(c, big, N_BIG, NULL, toks);
	consumer(args, out, sizeof(out));
	p = strstr(out, "\"BlockRemoved\"");
	cr_assert_not_null(p, "no BlockRemoved:\n%s", out);
	snprintf(want, sizeof(want), "%llu", (unsigned long long)h[7]);
	cr_expect_not_null(strstr(p, want), "A's last page was not removed:\n%s", p);
	snprintf(want, sizeof(want), "%llu", (unsigned long long)h[0]);
	cr_expect_null(strstr(p, want), "A's first page was removed:\n%s", p);
	snprintf(args, sizeof(args), "--replay %s --held", rp);
	consumer(args, out, sizeof(out));
	for (const char *q = out; (q = strpbrk(q, "0123456789")); n_held++)
		q += strspn(q, "0123456789");
	s = stats();
	cr_expect_eq((uint64_t)n_held, s->pages_cached, "the stream holds %d blocks, the pool %llu",
		     n_held, (unsigned long long)s->pages_cached);
	cr_expect_gt(s->prefix_evictions, 0);
	bd_pool_stats_free(s);
	bd_client_free(c);
}
