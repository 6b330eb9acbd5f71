/* test_pool_save.c — the pool and the repeat table as bytes and back (kvpoold/alloc.c,
 * replay.c): what a restarted kvpoold adopts from its state record.
 *
 * A loaded pool must be the saved one in every request record, count and page list, and go on
 * as it would have (the next page handed out is the top of the saved free stack). Bytes that
 * are not a saved pool of this geometry are refused with a reason, and the pool is left empty,
 * never half loaded.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "kvpool.h"

#define PAGES 16
#define SLOTS 3
#define PPR 8
#define REQS 8

static struct bd_kvpool_alloc *A, *B;
static uint8_t *buf;
static size_t cap;

static void init(void)
{
	cr_assert_eq(bd_kvpool_alloc_new(PAGES, SLOTS, PPR, REQS, &A), 0);
	cr_assert_eq(bd_kvpool_alloc_new(PAGES, SLOTS, PPR, REQS, &B), 0);
	cap = bd_kvpool_alloc_save_max(PAGES, SLOTS, PPR, REQS);
	cr_assert_gt(cap, 0);
	buf = malloc(cap);
	cr_assert_not_null(buf);
}

static void fini(void)
{
	bd_kvpool_alloc_free(A);
	bd_kvpool_alloc_free(B);
	free(buf);
}

TestSuite(pool_save, .init = init, .fini = fini);

/* Request 1 (owner 5): pages 0 1, a slot, page 2 freed (the top of the free stack); request 2
 * (owner 5): pages 0 1 shared, page 3 reserved; request 3 (owner 6): pages 4 5, page 6 reserved
 * then committed, a slot. */
static void fill(struct bd_kvpool_alloc *a)
{
	int32_t p[3], r, s;

	cr_assert_eq(bd_kvpool_page_alloc(a, 1, 5, 3, p), 0);
	cr_assert_eq(bd_kvpool_slot_assign(a, 1, 5, &s), 0);
	cr_assert_eq(bd_kvpool_page_ref(a, 2, 5, p, 2), 0);
	cr_assert_eq(bd_kvpool_page_reserve(a, 2, 5, &r), 0);
	cr_assert_eq(r, 3);
	cr_assert_eq(bd_kvpool_page_alloc(a, 3, 6, 2, p), 0);
	cr_assert_eq(bd_kvpool_page_reserve(a, 3, 6, &r), 0);
	cr_assert_eq(bd_kvpool_page_commit(a, 3, r), 0);
	cr_assert_eq(bd_kvpool_slot_assign(a, 3, 6, &s), 0);
	p[0] = 2;
	cr_assert_eq(bd_kvpool_page_free(a, 1, p, 1, NULL), 0);
}

static void expect_empty(struct bd_kvpool_alloc *a)
{
	struct bd_kvpool_counts k;

	bd_kvpool_alloc_counts(a, &k);
	cr_expect_eq(k.pages_free, PAGES);
	cr_expect_eq(k.slots_free, SLOTS);
	cr_expect_eq(k.requests, 0);
	cr_expect_eq(bd_kvpool_alloc_check(a), 0, "%s", bd_kvpool_alloc_error(a));
}

Test(pool_save, a_loaded_pool_is_the_saved_one_and_goes_on_alike)
{
	struct bd_pool_holder ha[REQS], hb[REQS];
	struct bd_kvpool_counts ka, kb;
	int32_t pa[PPR], pb[PPR], x, y;
	size_t na, nb;
	ssize_t n;

	fill(A);
	n = bd_kvpool_alloc_save(A, buf, cap);
	cr_assert_gt(n, 0);
	cr_expect_eq(bd_kvpool_alloc_save(A, buf, (size_t)n - 1), -ENOSPC);
	cr_assert_eq(bd_kvpool_alloc_load(B, buf, (size_t)n), n, "%s", bd_kvpool_alloc_error(B));
	cr_expect_eq(bd_kvpool_alloc_changes(B), 0);
	bd_kvpool_alloc_counts(A, &ka);
	bd_kvpool_alloc_counts(B, &kb);
	cr_expect_eq(kb.pages_used, 5, "pages 0 1 4 5 6 (3 is reserved)");
	cr_expect_eq(kb.pages_free, PAGES - 6);
	cr_expect_eq(kb.pages_reserved, 1);
	cr_expect_eq(kb.pages_shared, 2);
	cr_expect_eq(kb.slots_free, 1);
	cr_expect_eq(kb.requests, 3);
	cr_expect_eq(ka.pages_free, kb.pages_free);
	cr_expect_eq(ka.pages_used, kb.pages_used);
	cr_expect_eq(ka.requests_holding, kb.requests_holding);
	na = bd_kvpool_alloc_holders(A, false, ha, REQS);
	nb = bd_kvpool_alloc_holders(B, false, hb, REQS);
	cr_assert_eq(na, nb);
	for (size_t i = 0; i < na; i++) {
		cr_expect_eq(ha[i].request_id, hb[i].request_id);
		cr_expect_eq(ha[i].owner, hb[i].owner);
		cr_expect_eq(ha[i].pages, hb[i].pages);
		cr_expect_eq(ha[i].reserved, hb[i].reserved);
		cr_expect_eq(ha[i].slot, hb[i].slot);
		cr_assert_eq(bd_kvpool_alloc_pages_of(A, ha[i].request_id, pa, PPR),
			     bd_kvpool_alloc_pages_of(B, hb[i].request_id, pb, PPR));
		cr_expect_eq(memcmp(pa, pb, (size_t)ha[i].pages * sizeof(int32_t)), 0);
	}
	/* the same next moves: page 2 from the top of the free stack, the reserved page commits,
	 * the last slot goes to request 2 */
	cr_assert_eq(bd_kvpool_page_alloc(B, 4, 7, 1, &x), 0);
	cr_expect_eq(x, 2);
	cr_expect_eq(bd_kvpool_page_commit(B, 2, 3), 0);
	cr_expect_eq(bd_kvpool_slot_assign(B, 2, 5, &x), 0);
	cr_expect_eq(bd_kvpool_slot_assign(A, 2, 5, &y), 0);
	cr_expect_eq(x, y);
	cr_expect_eq(bd_kvpool_alloc_check(B), 0, "%s", bd_kvpool_alloc_error(B));
}

/* A record that holds a slot and no page (its page list is empty) round trips too. */
Test(pool_save, a_request_with_a_slot_and_no_pages_round_trips)
{
	struct bd_pool_holder h;
	int32_t s;
	ssize_t n;

	cr_assert_eq(bd_kvpool_slot_assign(A, 9, 2, &s), 0);
	n = bd_kvpool_alloc_save(A, buf, cap);
	cr_assert_gt(n, 0);
	cr_assert_eq(bd_kvpool_alloc_load(B, buf, (size_t)n), n, "%s", bd_kvpool_alloc_error(B));
	cr_assert_eq(bd_kvpool_alloc_holders(B, false, &h, 1), 1);
	cr_expect_eq(h.request_id, 9);
	cr_expect_eq(h.owner, 2);
	cr_expect_eq(h.pages, 0);
	cr_expect_eq(h.slot, s);
	cr_expect_eq(bd_kvpool_slot_release(B, 9, s), 0);
}

/* Bytes of a saved pool with one field changed at off (a uint32 or int32): refused. */
static void expect_refused_with(size_t off, int32_t value, const char *why)
{
	ssize_t n;

	fill(A);
	n = bd_kvpool_alloc_save(A, buf, cap);
	cr_assert_gt(n, (ssize_t)(off + 4));
	memcpy(buf + off, &value, 4);
	cr_expect_eq(bd_kvpool_alloc_load(B, buf, (size_t)n), -EBADMSG);
	cr_expect_not_null(strstr(bd_kvpool_alloc_error(B), why), "%s",
			   bd_kvpool_alloc_error(B));
	expect_empty(B);
}

/* The layout of alloc_save: [n_free][free pages][n_free_slots][free slots][n_reqs][records] */
Test(pool_save, a_free_page_out_of_range_is_refused)
{
	expect_refused_with(4, PAGES, "free page stack entry 0");
}

Test(pool_save, a_free_page_that_a_request_holds_is_refused)
{
	/* the free stack's top (page 2, last entry) replaced by page 0, which requests hold */
	expect_refused_with(4 + 4 * (PAGES - 6 - 1), 0, "free stack entry 9 (page 0) is wrong");
}

Test(pool_save, too_many_requests_are_refused)
{
	/* 10 free pages, 1 free slot: the request count follows them */
	expect_refused_with(4 + 4 * 10 + 4 + 4, REQS + 1, "request count");
}

Test(pool_save, truncated_bytes_are_refused_and_an_earlier_pool_is_dropped)
{
	ssize_t n;

	fill(A);
	n = bd_kvpool_alloc_save(A, buf, cap);
	cr_assert_gt(n, 0);
	/* B holds something before the failed load: it is dropped, not merged */
	fill(B);
	for (ssize_t cut = 0; cut < n; cut += 7) {
		cr_expect_eq(bd_kvpool_alloc_load(B, buf, (size_t)cut), -EBADMSG, "cut at %zd",
			     cut);
		expect_empty(B);
	}
	cr_expect_eq(bd_kvpool_alloc_load(B, buf, (size_t)n), n);
}

Test(pool_save, the_repeat_table_round_trips_and_refuses_bad_bytes)
{
	struct bd_kvpool_replay *r, *s;
	const uint8_t *rep;
	uint8_t *bytes;
	size_t len, max = bd_kvpool_replay_save_max(4, 32);
	ssize_t n;

	cr_assert_eq(bd_kvpool_replay_new(4, 32, &r), 0);
	cr_assert_eq(bd_kvpool_replay_new(4, 32, &s), 0);
	cr_expect_eq(bd_kvpool_replay_new(0, 32, &s), -EINVAL);
	bytes = malloc(max);
	cr_assert_not_null(bytes);
	cr_assert_eq(bd_kvpool_replay_put(r, 0xa, 3, (const uint8_t *)"three", 5), 0);
	cr_assert_eq(bd_kvpool_replay_put(r, 0xb, 9, (const uint8_t *)"nine", 4), 0);
	cr_expect_eq(bd_kvpool_replay_put(r, 0xa, 4, bytes, 33), -EMSGSIZE);
	n = bd_kvpool_replay_save(r, bytes, max);
	cr_assert_gt(n, 0);
	cr_assert_eq(bd_kvpool_replay_load(s, bytes, (size_t)n), n);
	cr_assert_eq(bd_kvpool_replay_find(s, 0xa, 3, &rep, &len), 1);
	cr_expect_eq(len, 5);
	cr_expect_eq(memcmp(rep, "three", 5), 0);
	cr_expect_eq(bd_kvpool_replay_find(s, 0xa, 2, &rep, &len), -ESTALE);
	cr_expect_eq(bd_kvpool_replay_find(s, 0xa, 4, &rep, &len), 0);
	cr_expect_eq(bd_kvpool_replay_find(s, 0xc, 1, &rep, &len), 0);
	cr_assert_eq(bd_kvpool_replay_find(s, 0xb, 9, &rep, &len), 1);
	cr_expect_eq(memcmp(rep, "nine", 4), 0);
	/* one client twice (the second entry's id made the first's) and a cut: refused, empty */
	memcpy(bytes + 12 + 28 + 5, bytes + 12, 8);
	cr_expect_eq(bd_kvpool_replay_load(s, bytes, (size_t)n), -EBADMSG);
	cr_expect_eq(bd_kvpool_replay_find(s, 0xa, 3, &rep, &len), 0, "a refused table is empty");
	cr_expect_eq(bd_kvpool_replay_load(s, bytes, 10), -EBADMSG);
	free(bytes);
	bd_kvpool_replay_free(r);
	bd_kvpool_replay_free(s);
}
