/* test_pool_restart.c — kvpoold killed and started again through an emulated systemd fd store
 * (tests/common/fdstore.h): what it stored comes back and is adopted, or is refused when it
 * does not match.
 *
 * Geometry (flags): NVFP4, tp 2, 2 layers, 2 KV heads per rank of d = 64, 16 pages, 3 slots,
 * max_seq_len 1024 (8 pages per request); one chunk per rank. Every test starts kvpoold with
 * the store as its NOTIFY_SOCKET, so the daemon stores arena-r0-c0, arena-r1-c0 and state.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvpool.h"
#include "kvpool.pb-c.h"
#include "pool/bd_pool_client.h"
#include "fdstore.h"
#include "pool_test.h"
#include "spawn.h"

#define TIMEOUT_MS 20000

static struct pt_env E;
static struct fs_store S;

static const char *const GEOM[] = { "--tp", "2", "--layers", "2", "--kv-heads", "4",
				    "--head-dim", "64", "--pages", "16", "--slots", "3",
				    "--max-seq-len", "1024", NULL };

static void init(void)
{
	pt_init(&E, "bdfp4-restart");
	cr_assert_eq(fs_open(&S, E.notify), 0);
}

static void fini(void)
{
	fs_close(&S);
	pt_fini(&E);
}

TestSuite(pool_restart, .init = init, .fini = fini, .timeout = 120);

/* kvpoold with GEOM and extra flags under the store, READY (asserted). */
static void start(const char *const *extra)
{
	const char *argv[64];

	pt_argv(&E, argv, 64, false, GEOM, extra);
	cr_assert_eq(fs_start(&S, argv, E.log, TIMEOUT_MS), 0, "kvpoold did not get ready (log in "
		     "%s)", E.log);
}

/* kill -9 and a start with what it stored, READY (asserted). */
static void restart(void)
{
	cr_assert_eq(fs_restart(&S, SIGKILL, TIMEOUT_MS), 0, "kvpoold did not come back (log in "
		     "%s)", E.log);
}

/* ---- the pool's books before and after ------------------------------------------------------ */

struct books {
	struct bd_pool_stats *st;
	struct bd_pool_holder *h;
	size_t n;
};

static void books(struct bd_pool_conn *c, struct books *b)
{
	b->st = pt_stats(c);
	cr_assert_eq(bd_pool_requests(c, &b->h, &b->n), 0);
}

static void books_free(struct books *b)
{
	bd_pool_stats_free(b->st);
	free(b->h);
}

/* Every count of the stats and every request record (id, owner, pages held, reserved, slot). */
static void expect_same_books(const struct books *x, const struct books *y)
{
	cr_expect_eq(x->st->pages_total, y->st->pages_total);
	cr_expect_eq(x->st->pages_free, y->st->pages_free);
	cr_expect_eq(x->st->pages_used, y->st->pages_used);
	cr_expect_eq(x->st->pages_reserved, y->st->pages_reserved);
	cr_expect_eq(x->st->pages_shared, y->st->pages_shared);
	cr_expect_eq(x->st->slots_free, y->st->slots_free);
	cr_expect_eq(x->st->requests, y->st->requests);
	cr_expect_eq(x->st->requests_holding, y->st->requests_holding);
	cr_expect_eq(memcmp(x->st->arena_id, y->st->arena_id, 16), 0, "another arena id");
	cr_assert_eq(x->n, y->n);
	for (size_t i = 0; i < x->n; i++) {
		cr_expect_eq(x->h[i].request_id, y->h[i].request_id);
		cr_expect_eq(x->h[i].owner, y->h[i].owner);
		cr_expect_eq(x->h[i].pages, y->h[i].pages, "request %llu",
			     (unsigned long long)x->h[i].request_id);
		cr_expect_eq(x->h[i].reserved, y->h[i].reserved);
		cr_expect_eq(x->h[i].slot, y->h[i].slot);
	}
}

/* ---- a worker's view of the arenas ----------------------------------------------------------- */

/* The bytes a rank's arena is filled with: a stream of seed. */
static void pattern(uint8_t *p, size_t n, uint32_t seed)
{
	for (size_t i = 0; i < n; i++) {
		seed = seed * 1664525u + 1013904223u;
		p[i] = (uint8_t)(seed >> 24);
	}
}

/* 0 when the whole arena of a holds pattern(seed), with page 5 of layer 1 holding
 * pattern(seed2) instead when seed2 is not 0; else the first differing offset + 1. */
static size_t arena_differs(const struct bd_pool_attach *a, uint32_t seed, uint32_t seed2)
{
	const struct bd_pool_geometry *g = bd_pool_attach_geometry(a);
	const uint8_t *base = (const uint8_t *)bd_pool_attach_pages(a) - g->pages_offset;
	uint8_t *want = malloc(g->arena_bytes);
	size_t bad = 0;

	pattern(want, g->arena_bytes, seed);
	if (seed2)
		pattern((uint8_t *)bd_layout_page(&g->layout, want + g->pages_offset, 1, 5),
			g->layout.page_bytes, seed2);
	for (size_t i = 0; i < g->arena_bytes && !bad; i++)
		if (base[i] != want[i])
			bad = i + 1;
	free(want);
	return bad;
}

/* The worker: attaches both ranks and fills them (pattern 100 + rank), tells the parent (up),
 * and waits (down) while kvpoold is killed and started again. Then its mappings must still
 * hold what it wrote; each rank is attached again (the same arenas, the mapping kept); it
 * writes pattern 7 into page 5 of layer 1 of rank 0 through the old mapping, tells the parent,
 * and waits for the end. Exit codes name the failing step. */
static int worker(int up, int down)
{
	uint8_t tokens[2 * BD_POOL_TOKEN_BYTES];
	struct bd_pool_attach *a[2];
	uint64_t epoch;
	char err[256], b;

	if (pt_group(E.endpoint, 2, tokens, &epoch) < 0)
		return 9;
	for (int r = 0; r < 2; r++) {
		const struct bd_pool_geometry *g;

		if (bd_pool_attach(E.sock, r, tokens + r * BD_POOL_TOKEN_BYTES, err, sizeof(err),
				   &a[r]) < 0)
			return 10 + r;
		g = bd_pool_attach_geometry(a[r]);
		pattern((uint8_t *)bd_pool_attach_pages(a[r]) - g->pages_offset, g->arena_bytes,
			100u + (uint32_t)r);
	}
	if (write(up, "r", 1) != 1 || read(down, &b, 1) != 1)
		return 20;
	/* the restarted kvpoold has no group until the router registers its epoch again */
	if (pt_group_register(E.endpoint, epoch, tokens, 2) < 0)
		return 21;
	for (int r = 0; r < 2; r++) {
		void *before = bd_pool_attach_pages(a[r]);

		if (arena_differs(a[r], 100u + (uint32_t)r, 0))
			return 30 + r; /* the mapping lost what was written */
		if (bd_pool_reattach(a[r], E.sock, tokens + r * BD_POOL_TOKEN_BYTES, err,
				     sizeof(err)) != 0) {
			fprintf(stderr, "reattach of rank %d: %s\n", r, err);
			return 40 + r;
		}
		if (bd_pool_attach_pages(a[r]) != before)
			return 50 + r; /* the mapping was replaced */
	}
	{
		const struct bd_pool_geometry *g = bd_pool_attach_geometry(a[0]);

		pattern(bd_layout_page(&g->layout, bd_pool_attach_pages(a[0]), 1, 5),
			g->layout.page_bytes, 7);
	}
	if (write(up, "w", 1) != 1 || read(down, &b, 1) != 1)
		return 60;
	bd_pool_detach(a[0]);
	bd_pool_detach(a[1]);
	return 0;
}

/* ---- a restart that adopts ------------------------------------------------------------------- */

/* The state of the test: request 11 (owner 5) with pages 0 1 and a slot (its page 2 freed: the
 * top of the free stack), request 12 (owner 5) sharing pages 0 and 1 with a reserved page,
 * request 13 (owner 6) with pages 4 5 and 6 (6 reserved, then committed) and a slot. */
static void fill_pool(struct bd_pool_conn *c, int32_t *ret_reserved12)
{
	int32_t p[3], q[2], r, slot;
	uint64_t freed = 9;

	cr_assert_eq(bd_pool_page_alloc(c, 11, 5, 3, p), 0);
	cr_assert_eq(p[0], 0);
	cr_assert_eq(p[2], 2);
	cr_assert_eq(bd_pool_slot_assign(c, 11, 5, &slot), 0);
	cr_assert_eq(bd_pool_page_ref(c, 12, 5, p, 2), 0);
	cr_assert_eq(bd_pool_page_reserve(c, 12, 5, ret_reserved12), 0);
	cr_assert_eq(*ret_reserved12, 3);
	cr_assert_eq(bd_pool_page_alloc(c, 13, 6, 2, q), 0);
	cr_assert_eq(bd_pool_page_reserve(c, 13, 6, &r), 0);
	cr_assert_eq(bd_pool_page_commit(c, 13, r), 0);
	cr_assert_eq(bd_pool_slot_assign(c, 13, 6, &slot), 0);
	cr_assert_eq(bd_pool_page_free(c, 11, &p[2], 1, &freed), 0);
	cr_assert_eq(freed, 1);
}

Test(pool_restart, kill_9_keeps_pages_state_and_mappings)
{
	struct bd_pool_conn *c;
	struct bd_pool_attach *a[2];
	struct books before, after;
	int up[2], down[2], st;
	int32_t reserved12, p;
	uint64_t freed = 0;
	pid_t w;
	char b;

	start(NULL);
	cr_expect_eq(S.n, 3, "arena-r0-c0, arena-r1-c0 and state stored, %zu fds kept", S.n);
	cr_expect_geq(fs_find(&S, "arena-r0-c0"), 0);
	cr_expect_geq(fs_find(&S, "arena-r1-c0"), 0);
	cr_expect_geq(fs_find(&S, BD_KVPOOL_STATE_FDNAME), 0);
	c = pt_conn(&E);
	fill_pool(c, &reserved12);
	cr_assert_eq(pipe(up), 0);
	cr_assert_eq(pipe(down), 0);
	w = fork();
	cr_assert_geq(w, 0);
	if (w == 0)
		_exit(worker(up[1], down[0]));
	cr_assert_eq(read(up[0], &b, 1), 1, "the worker failed before filling the arenas");
	books(c, &before);
	cr_expect_eq(before.st->devices[0].attached, 1);

	restart();
	cr_expect(pt_log_has(&E, "adopted the stored arenas and state"), "log in %s", E.log);
	books(c, &after);
	expect_same_books(&before, &after);
	/* the worker's connection went with the old daemon; its mapping did not */
	cr_expect_eq(after.st->devices[0].attached, 0);
	books_free(&after);
	cr_assert_eq(write(down[1], "g", 1), 1);
	cr_assert_eq(read(up[0], &b, 1), 1, "the worker failed after the restart");
	after.st = pt_stats(c);
	cr_expect_eq(after.st->devices[0].attached, 1, "re-attached");
	cr_expect_eq(after.st->devices[1].attached, 1, "re-attached");
	bd_pool_stats_free(after.st);
	cr_assert_eq(write(down[1], "e", 1), 1);
	st = sp_reap(w, TIMEOUT_MS);
	cr_expect_eq(st, 0, "worker exit %d (codes in worker())", st);
	/* a fresh attachment (the worker gone: one live attachment per rank) sees what the worker wrote before and after the restart */
	for (int r = 0; r < 2; r++) {
		cr_assert_eq(pt_attach(E.sock, E.endpoint, r, NULL, 0, &a[r]), 0);
		cr_expect_eq(memcmp(bd_pool_attach_geometry(a[r])->arena_id, before.st->arena_id,
				    16), 0);
		cr_expect_eq(arena_differs(a[r], 100u + (uint32_t)r, r == 0 ? 7 : 0), 0,
			     "rank %d differs at byte %zu - 1", r,
			     arena_differs(a[r], 100u + (uint32_t)r, r == 0 ? 7 : 0));
		bd_pool_detach(a[r]);
	}
	/* and the pool goes on from where it was: the reservation, the slots, the free stack */
	cr_expect_eq(bd_pool_page_commit(c, 12, reserved12), 0);
	cr_expect_eq(bd_pool_slot_assign(c, 11, 5, &p), -EBUSY, "request 11 has its slot");
	cr_expect_eq(bd_pool_page_alloc(c, 14, 5, 1, &p), 0);
	cr_expect_eq(p, 2, "the page freed last is the top of the free stack");
	cr_expect_eq(bd_pool_request_release(c, 13, &freed), 0);
	cr_expect_eq(freed, 3);
	books_free(&before);
	bd_pool_conn_free(c);
}

/* A clean stop (SIGTERM, exit 0: systemctl restart) keeps what is stored, and a second restart
 * adopts again: the record stays current across adoptions. */
Test(pool_restart, sigterm_then_start_adopts_and_so_does_a_second_restart)
{
	struct bd_pool_conn *c;
	struct bd_pool_stats *s;
	int32_t p[4];

	start(NULL);
	c = pt_conn(&E);
	cr_assert_eq(bd_pool_page_alloc(c, 21, 1, 4, p), 0);
	cr_assert_eq(fs_restart(&S, SIGTERM, TIMEOUT_MS), 0);
	cr_assert_eq(bd_pool_page_free(c, 21, p, 1, NULL), 0, "request 21 holds page %d", p[0]);
	restart();
	s = pt_stats(c);
	cr_expect_eq(s->pages_used, 3, "the free after the first restart was saved");
	cr_expect_eq(s->requests, 1);
	bd_pool_stats_free(s);
	bd_pool_conn_free(c);
}

/* A call applied by a daemon that died before its reply went out: the retry (same client and
 * call) gets the first reply from the restarted daemon, and the pool holds the pages once. An
 * older call of the same client is refused without a change. */
Test(pool_restart, a_repeated_call_is_answered_once_across_the_restart)
{
	struct bd_pool_op op = { BD_POOL_OP_PAGE_ALLOC, 31, 3, .n = 2, .client = 0xfeed,
				 .call = 5 };
	uint8_t frame[64];
	ssize_t len = bd_pool_op_pack(&op, frame, sizeof(frame));
	struct bd_pool_conn *c;
	struct bd_pool_stats *s;
	Bdfp4__PoolReply *rep;
	void *r1, *r2, *r3;
	size_t l1, l2, l3;

	cr_assert_gt(len, 0);
	start(NULL);
	c = pt_conn(&E);
	cr_assert_eq(bd_pool_call_raw(c, frame, (size_t)len, &r1, &l1), 0);
	restart();
	cr_assert_eq(bd_pool_call_raw(c, frame, (size_t)len, &r2, &l2), 0);
	cr_assert_eq(l1, l2);
	cr_expect_eq(memcmp(r1, r2, l1), 0, "the repeat gets the first reply, byte for byte");
	s = pt_stats(c);
	cr_expect_eq(s->pages_used, 2, "applied once");
	bd_pool_stats_free(s);
	/* call 4 comes after call 5: not applied */
	op.call = 4;
	len = bd_pool_op_pack(&op, frame, sizeof(frame));
	cr_assert_eq(bd_pool_call_raw(c, frame, (size_t)len, &r3, &l3), 0);
	rep = bdfp4__pool_reply__unpack(NULL, l3, r3);
	cr_assert_not_null(rep);
	cr_expect_eq(rep->error, BD_POOL_ERR_INVALID, "%s", rep->message);
	bdfp4__pool_reply__free_unpacked(rep, NULL);
	s = pt_stats(c);
	cr_expect_eq(s->pages_used, 2);
	bd_pool_stats_free(s);
	free(r1);
	free(r2);
	free(r3);
	bd_pool_conn_free(c);
}

/* A client's call in flight when kvpoold is killed: the connection's retry sends it again, with
 * its number, to the restarted daemon. Whether the killed daemon had applied it (its reply
 * lost) or never read it, the call succeeds once: the pool holds its pages once. Several
 * rounds, so that the kill falls at different points of the calls. */
struct inflight {
	struct bd_pool_conn *c;
	uint64_t id;
	int32_t pages[2];
	int e;
};

static void *alloc_call(void *arg)
{
	struct inflight *f = arg;

	f->e = bd_pool_page_alloc(f->c, f->id, 8, 2, f->pages);
	return NULL;
}

Test(pool_restart, a_call_in_flight_across_kill_9_is_applied_once)
{
	struct bd_pool_conn *c, *q;
	struct bd_pool_stats *s;

	start(NULL);
	cr_assert_eq(bd_pool_conn_new(E.endpoint, 5000, &c), 0);
	cr_assert_eq(bd_pool_conn_set_retry(c, TIMEOUT_MS), 0);
	cr_assert_eq(bd_pool_conn_set_retry(c, -1), -EINVAL);
	q = pt_conn(&E);
	for (uint64_t round = 0; round < 4; round++) {
		struct inflight f = { .c = c, .id = 60 + round };
		pthread_t t;

		cr_assert_eq(pthread_create(&t, NULL, alloc_call, &f), 0);
		restart();
		pthread_join(t, NULL);
		cr_expect_eq(f.e, 0, "round %llu: %s", (unsigned long long)round,
			     bd_pool_conn_error(c, NULL));
		s = pt_stats(q);
		cr_expect_eq(s->pages_used, 2 * (round + 1), "round %llu: applied once",
			     (unsigned long long)round);
		cr_expect_eq(s->requests, round + 1);
		bd_pool_stats_free(s);
	}
	/* the requests hold what their replies said */
	for (uint64_t round = 0; round < 4; round++) {
		uint64_t freed = 0;

		cr_expect_eq(bd_pool_request_release(c, 60 + round, &freed), 0);
		cr_expect_eq(freed, 2);
	}
	bd_pool_conn_free(q);
	bd_pool_conn_free(c);
}

/* ---- restarts that are refused ------------------------------------------------------------- */

/* The pool of a refused restart: empty, other arenas (a new id, the old names removed from the
 * store and new fds stored), the reason in the log (says), and serving. before: the arena id of
 * the first daemon; old_ino: the inode of its rank 0 chunk. */
static void expect_started_empty(struct bd_pool_conn *c, const uint8_t *before, ino_t old_ino,
				 const char *says)
{
	struct bd_pool_stats *s = pt_stats(c);
	struct stat st;
	int32_t p;

	cr_expect(pt_log_has(&E, "the stored state is refused"), "log in %s", E.log);
	cr_expect(pt_log_has(&E, says), "the log says '%s' (log in %s)", says, E.log);
	cr_expect_eq(s->pages_free, s->pages_total, "a refused state must not be adopted");
	cr_expect_eq(s->requests, 0);
	cr_expect_neq(memcmp(s->arena_id, before, 16), 0, "new arenas get a new id");
	bd_pool_stats_free(s);
	cr_expect_gt(S.removed, 0, "the refused fds were dropped from the store");
	cr_expect_eq(S.n, 3, "new arenas and state stored in place of the old");
	cr_assert_eq(fstat(fs_find(&S, "arena-r0-c0"), &st), 0);
	cr_expect_neq(st.st_ino, old_ino, "the stored chunk is a new memfd");
	cr_expect_eq(bd_pool_page_alloc(c, 41, 4, 1, &p), 0, "serving after the refusal");
	cr_expect_eq(p, 0);
}

/* Starts the pool, allocates, lets tamper change what is stored, restarts and expects it
 * refused with says in the log; a worker attached before the restart gets -ESTALE when it
 * attaches again. */
static void refused_after(void (*tamper)(void), const char *const *extra2, const char *says)
{
	struct bd_pool_conn *c;
	struct bd_pool_stats *s;
	struct bd_pool_attach *a;
	struct stat st;
	uint8_t id[16];
	int32_t p[2];
	char err[256];

	start(NULL);
	c = pt_conn(&E);
	cr_assert_eq(bd_pool_page_alloc(c, 40, 4, 2, p), 0);
	cr_assert_eq(pt_attach(E.sock, E.endpoint, 0, NULL, 0, &a), 0);
	s = pt_stats(c);
	memcpy(id, s->arena_id, 16);
	bd_pool_stats_free(s);
	cr_assert_eq(fstat(fs_find(&S, "arena-r0-c0"), &st), 0);
	if (tamper)
		tamper();
	if (extra2) {
		const char *argv[64];

		kill(S.pid, SIGKILL);
		sp_reap(S.pid, TIMEOUT_MS);
		S.pid = 0;
		pt_argv(&E, argv, 64, false, GEOM, extra2);
		cr_assert_eq(fs_start(&S, argv, E.log, TIMEOUT_MS), 0, "log in %s", E.log);
	} else {
		restart();
	}
	expect_started_empty(c, id, st.st_ino, says);
	{
		uint8_t tokens[2 * BD_POOL_TOKEN_BYTES];

		cr_assert_eq(pt_group(E.endpoint, 2, tokens, NULL), 0);
		cr_expect_eq(bd_pool_reattach(a, E.sock, tokens, err, sizeof(err)), -ESTALE, "%s",
			     err);
	}
	bd_pool_detach(a);
	bd_pool_conn_free(c);
}

/* The latest record in the stored state memfd: a writable mapping (unmapped by the caller:
 * bytes), its area header in *ret_area. */
static uint8_t *map_state(size_t *ret_bytes, struct bd_kvpool_state_area **ret_area)
{
	int fd = fs_find(&S, BD_KVPOOL_STATE_FDNAME);
	struct bd_kvpool_state_head *h;
	struct bd_kvpool_state_area *a0, *a1;
	struct stat st;
	uint8_t *m;

	cr_assert_geq(fd, 0);
	cr_assert_eq(fstat(fd, &st), 0);
	m = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	cr_assert_neq(m, MAP_FAILED);
	h = (struct bd_kvpool_state_head *)m;
	a0 = (struct bd_kvpool_state_area *)(m + h->area_off[0]);
	a1 = (struct bd_kvpool_state_area *)(m + h->area_off[1]);
	*ret_area = a1->generation > a0->generation ? a1 : a0;
	cr_assert_gt((*ret_area)->generation, 0);
	*ret_bytes = (size_t)st.st_size;
	return m;
}

static void flip_a_record_byte(void)
{
	struct bd_kvpool_state_area *a;
	size_t n;
	uint8_t *m = map_state(&n, &a);

	/* a byte of the allocator's part, past the geometry */
	((uint8_t *)(a + 1))[sizeof(struct bd_kvpool_state_geo) + 20] ^= 0x40;
	munmap(m, n);
}

static void unknown_version(void)
{
	struct bd_kvpool_state_area *a;
	size_t n;
	uint8_t *m = map_state(&n, &a);

	((struct bd_kvpool_state_head *)m)->version = 99;
	munmap(m, n);
}

/* The state memfd cut short: a new sealed memfd holding its first 4 KiB and a bit. */
static void truncate_state(void)
{
	int fd = fs_find(&S, BD_KVPOOL_STATE_FDNAME);
	int t = memfd_create("cut", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	uint8_t buf[4096 + 100];

	cr_assert_geq(t, 0);
	cr_assert_eq(pread(fd, buf, sizeof(buf), 0), (ssize_t)sizeof(buf));
	cr_assert_eq(write(t, buf, sizeof(buf)), (ssize_t)sizeof(buf));
	cr_assert_eq(fcntl(t, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
	cr_assert_eq(fs_replace(&S, BD_KVPOOL_STATE_FDNAME, t), 0);
}

Test(pool_restart, a_corrupted_record_is_refused_and_the_pool_starts_empty)
{
	refused_after(flip_a_record_byte, NULL, "fails its checksum");
}

Test(pool_restart, a_truncated_record_is_refused)
{
	refused_after(truncate_state, NULL, "truncated");
}

Test(pool_restart, an_unknown_record_version_is_refused)
{
	refused_after(unknown_version, NULL, "version 99");
}

Test(pool_restart, another_configuration_is_refused)
{
	static const char *const more_pages[] = { "--pages", "24", NULL };

	refused_after(NULL, more_pages, "n_pages 16 stored, 24 configured");
}

/* The stored chunk of rank 1 is no arena chunk of this geometry (a memfd of another size): the
 * state alone is not enough, the restart is refused. */
static void swap_chunk(void)
{
	int t = memfd_create("other", MFD_CLOEXEC | MFD_ALLOW_SEALING);

	cr_assert_geq(t, 0);
	cr_assert_eq(ftruncate(t, 4096), 0);
	cr_assert_eq(fcntl(t, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
	cr_assert_eq(fs_replace(&S, "arena-r1-c0", t), 0);
}

Test(pool_restart, a_foreign_arena_chunk_is_refused)
{
	refused_after(swap_chunk, NULL, "the arena of rank 1: chunk 0 is not a sealed memfd");
}

/* The prefix index is part of the stored state: pages indexed by a request that has ended
 * (idle, counted free) and by one still running are found again after kill -9, in the same
 * pages, and a hit there takes the idle one back. */
Test(pool_restart, kill_9_keeps_the_prefix_index)
{
	struct bd_pool_conn *c;
	struct bd_pool_stats *s;
	int32_t p[3], q[3], got[3];
	const uint64_t h[3] = { 0x1111, 0x2222, 0x3333 };
	uint64_t stored = 0;
	size_t n = 0;

	start(NULL);
	c = pt_conn(&E);
	cr_assert_eq(bd_pool_page_alloc(c, 31, 1, 3, p), 0);
	cr_assert_eq(bd_pool_prefix_store(c, 31, p, h, 3, NULL, 0, 0, &stored), 0, "%s",
		     bd_pool_conn_error(c, NULL));
	cr_assert_eq(stored, 3);
	/* request 32 shares the first two, then 31 ends: page 2 is idle, 0 and 1 held by 32 */
	cr_assert_eq(bd_pool_prefix_match(c, 32, 1, h, 2, q, &n), 0);
	cr_assert_eq(n, 2);
	cr_assert_eq(bd_pool_request_release(c, 31, NULL), 0);
	restart();
	s = pt_stats(c);
	cr_expect_eq(s->pages_cached, 3);
	cr_expect_eq(s->pages_cached_idle, 1);
	cr_expect_eq(s->pages_used, 2);
	cr_expect_eq(s->pages_free, s->pages_total - 2, "the idle page is free capacity");
	bd_pool_stats_free(s);
	cr_assert_eq(bd_pool_prefix_match(c, 33, 1, h, 3, got, &n), 0);
	cr_assert_eq(n, 3, "all three hashes are found after the restart");
	for (int i = 0; i < 3; i++)
		cr_expect_eq(got[i], p[i], "hash %d: page %d, was %d", i, got[i], p[i]);
	s = pt_stats(c);
	cr_expect_eq(s->pages_cached_idle, 0);
	cr_expect_eq(s->pages_shared, 2);
	bd_pool_stats_free(s);
	bd_pool_conn_free(c);
}
