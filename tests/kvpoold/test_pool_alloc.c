/* test_pool_alloc.c — kvpoold's allocator (kvpoold/alloc.c, kvpool.h).
 *
 * Expected ids follow from the documented order (a fresh pool hands out 0, 1, 2, ...; freed
 * pages are reused last-in first-out); expected counts are worked out in the comments. Every
 * failing call is followed by a check that the pool is exactly as before (counts, the pages of
 * every request, the invariant checker).
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "kvpool.h"

static struct bd_kvpool_alloc *A;

static void make(size_t pages, size_t slots, uint32_t ppr, size_t reqs)
{
	cr_assert_eq(bd_kvpool_alloc_new(pages, slots, ppr, reqs, &A), 0);
}

static void fini(void)
{
	bd_kvpool_alloc_free(A);
	A = NULL;
}

TestSuite(pool_alloc, .fini = fini);

static bool same_counts(const struct bd_kvpool_counts *a, const struct bd_kvpool_counts *b)
{
	return a->pages_total == b->pages_total && a->pages_free == b->pages_free &&
	       a->pages_used == b->pages_used && a->pages_reserved == b->pages_reserved &&
	       a->pages_shared == b->pages_shared && a->slots_total == b->slots_total &&
	       a->slots_free == b->slots_free && a->requests == b->requests &&
	       a->requests_holding == b->requests_holding;
}

/* A full picture of the pool, to compare before and after a refused call. */
struct snap {
	struct bd_kvpool_counts c;
	struct bd_pool_holder h[32];
	size_t n;
	int32_t pages[32][64];
	long n_pages[32];
};

static void take(struct snap *s)
{
	struct bd_pool_holder h[32];

	memset(s, 0, sizeof(*s));
	bd_kvpool_alloc_counts(A, &s->c);
	s->n = bd_kvpool_alloc_holders(A, false, h, 32);
	/* field by field, so that struct padding does not take part in the comparison */
	for (size_t i = 0; i < s->n; i++) {
		s->h[i].request_id = h[i].request_id;
		s->h[i].owner = h[i].owner;
		s->h[i].pages = h[i].pages;
		s->h[i].reserved = h[i].reserved;
		s->h[i].slot = h[i].slot;
		s->n_pages[i] = bd_kvpool_alloc_pages_of(A, h[i].request_id, s->pages[i], 64);
	}
}

static void assert_same(const struct snap *before)
{
	struct snap now;

	take(&now);
	cr_assert(same_counts(&now.c, &before->c), "a refused call changed the counts");
	cr_assert_eq(memcmp(now.h, before->h, sizeof(now.h)), 0, "a refused call changed a record");
	cr_assert_eq(memcmp(now.pages, before->pages, sizeof(now.pages)), 0,
		     "a refused call changed the pages of a request");
	cr_assert_eq(memcmp(now.n_pages, before->n_pages, sizeof(now.n_pages)), 0);
	cr_assert_eq(now.n, before->n);
	cr_assert_eq(bd_kvpool_alloc_check(A), 0, "%s", bd_kvpool_alloc_error(A));
}

static void counts(struct bd_kvpool_counts *c)
{
	bd_kvpool_alloc_counts(A, c);
}

Test(pool_alloc, new_rejects_bad_sizes)
{
	struct bd_kvpool_alloc *a = (void *)0x1;

	cr_expect_eq(bd_kvpool_alloc_new(0, 1, 1, 1, &a), -EINVAL);
	cr_expect_eq(bd_kvpool_alloc_new((size_t)INT32_MAX + 1, 1, 1, 1, &a), -EINVAL);
	cr_expect_eq(bd_kvpool_alloc_new(4, 1, 0, 1, &a), -EINVAL);
	cr_expect_eq(bd_kvpool_alloc_new(4, 1, 1, 0, &a), -EINVAL);
	cr_expect_eq(bd_kvpool_alloc_new(4, 1, 1, 1, NULL), -EINVAL);
	cr_expect_eq(a, (void *)0x1, "output written on error");
}

Test(pool_alloc, fresh_pool_hands_out_lowest_ids)
{
	int32_t p[3];
	struct bd_kvpool_counts c;

	make(10, 2, 8, 4);
	cr_assert_eq(bd_kvpool_page_alloc(A, 7, 1, 3, p), 0);
	cr_expect_eq(p[0], 0);
	cr_expect_eq(p[1], 1);
	cr_expect_eq(p[2], 2);
	counts(&c);
	cr_expect_eq(c.pages_total, 10);
	cr_expect_eq(c.pages_free, 7);
	cr_expect_eq(c.pages_used, 3);
	cr_expect_eq(c.requests, 1);
	cr_expect_eq(c.requests_holding, 1);
	cr_expect_eq(bd_kvpool_alloc_check(A), 0);
}

Test(pool_alloc, exhaustion_fails_and_leaves_state)
{
	int32_t p[8] = { 0 };
	struct snap s;

	make(8, 1, 16, 4); /* a request may hold more than the pool: exhaustion comes first */
	cr_assert_eq(bd_kvpool_page_alloc(A, 1, 100, 6, p), 0);
	take(&s);
	/* 2 pages are free: 3 for a new request fail, and no record is left behind */
	cr_expect_eq(bd_kvpool_page_alloc(A, 2, 100, 3, p), -BD_POOL_ERR_EXHAUSTED);
	assert_same(&s);
	cr_expect_eq(s.c.requests, 1);
	/* the same for more pages of the existing request */
	cr_expect_eq(bd_kvpool_page_alloc(A, 1, 100, 2, p), 0);
	take(&s);
	cr_expect_eq(bd_kvpool_page_alloc(A, 1, 100, 1, p), -BD_POOL_ERR_EXHAUSTED);
	cr_expect_eq(bd_kvpool_page_reserve(A, 3, 100, p), -BD_POOL_ERR_EXHAUSTED);
	assert_same(&s);
	cr_expect_eq(s.c.pages_free, 0);
	cr_expect_neq(strlen(bd_kvpool_alloc_error(A)), 0);
}

Test(pool_alloc, counts_out_of_range)
{
	int32_t p[8];
	struct snap s;

	make(16, 1, 4, 4); /* a max-length request holds 4 pages */
	cr_assert_eq(bd_kvpool_page_alloc(A, 1, 1, 3, p), 0);
	take(&s);
	cr_expect_eq(bd_kvpool_page_alloc(A, 2, 1, 0, p), -BD_POOL_ERR_RANGE);
	cr_expect_eq(bd_kvpool_page_alloc(A, 2, 1, 5, p), -BD_POOL_ERR_RANGE);
	/* 3 held + 2 > 4 */
	cr_expect_eq(bd_kvpool_page_alloc(A, 1, 1, 2, p), -BD_POOL_ERR_RANGE);
	cr_expect_eq(bd_kvpool_page_free(A, 1, p, 0, NULL), -BD_POOL_ERR_RANGE);
	cr_expect_eq(bd_kvpool_page_free(A, 1, (int32_t[]){ -1 }, 1, NULL), -BD_POOL_ERR_RANGE);
	cr_expect_eq(bd_kvpool_page_free(A, 1, (int32_t[]){ 16 }, 1, NULL), -BD_POOL_ERR_RANGE);
	cr_expect_eq(bd_kvpool_page_commit(A, 1, 16), -BD_POOL_ERR_RANGE);
	cr_expect_eq(bd_kvpool_slot_release(A, 1, 1), -BD_POOL_ERR_RANGE);
	assert_same(&s);
}

Test(pool_alloc, unknown_and_zero_request_ids)
{
	int32_t p[1] = { 0 }, slot;
	uint64_t f;
	struct snap s;

	make(4, 1, 4, 4);
	take(&s);
	cr_expect_eq(bd_kvpool_page_free(A, 9, p, 1, &f), -BD_POOL_ERR_UNKNOWN_REQUEST);
	cr_expect_eq(bd_kvpool_page_commit(A, 9, 0), -BD_POOL_ERR_UNKNOWN_REQUEST);
	cr_expect_eq(bd_kvpool_slot_release(A, 9, 0), -BD_POOL_ERR_UNKNOWN_REQUEST);
	cr_expect_eq(bd_kvpool_request_release(A, 9, &f), -BD_POOL_ERR_UNKNOWN_REQUEST);
	cr_expect_eq(bd_kvpool_page_alloc(A, 0, 1, 1, p), -BD_POOL_ERR_INVALID);
	cr_expect_eq(bd_kvpool_slot_assign(A, 0, 1, &slot), -BD_POOL_ERR_INVALID);
	assert_same(&s);
}

Test(pool_alloc, double_free_and_foreign_free_rejected)
{
	int32_t a[2], b[2];
	uint64_t freed = 99;
	struct snap s;

	make(8, 1, 8, 4);
	cr_assert_eq(bd_kvpool_page_alloc(A, 1, 10, 2, a), 0); /* pages 0, 1 */
	cr_assert_eq(bd_kvpool_page_alloc(A, 2, 10, 2, b), 0); /* pages 2, 3 */
	cr_assert_eq(bd_kvpool_page_free(A, 1, &a[0], 1, &freed), 0);
	cr_expect_eq(freed, 1);
	take(&s);
	/* page 0 is free now: freeing it again is a double free, from anyone */
	cr_expect_eq(bd_kvpool_page_free(A, 1, &a[0], 1, NULL), -BD_POOL_ERR_DOUBLE_FREE);
	cr_expect_eq(bd_kvpool_page_free(A, 2, &a[0], 1, NULL), -BD_POOL_ERR_DOUBLE_FREE);
	/* page 2 is request 2's */
	cr_expect_eq(bd_kvpool_page_free(A, 1, &b[0], 1, NULL), -BD_POOL_ERR_NOT_HELD);
	/* all or none: request 1's page 1 stays held when the list also names page 2 */
	cr_expect_eq(bd_kvpool_page_free(A, 1, (int32_t[]){ a[1], b[0] }, 2, NULL),
		     -BD_POOL_ERR_NOT_HELD);
	/* a page listed twice */
	cr_expect_eq(bd_kvpool_page_free(A, 2, (int32_t[]){ b[1], b[1] }, 2, NULL),
		     -BD_POOL_ERR_INVALID);
	assert_same(&s);
	/* the freed page is the next one handed out (LIFO) */
	cr_assert_eq(bd_kvpool_page_alloc(A, 3, 10, 1, b), 0);
	cr_expect_eq(b[0], a[0]);
}

Test(pool_alloc, refcounts_of_shared_pages)
{
	int32_t a[2], got[4];
	uint64_t freed = 99;
	struct bd_kvpool_counts c;
	struct snap s;

	make(8, 1, 8, 4);
	cr_assert_eq(bd_kvpool_page_alloc(A, 1, 10, 2, a), 0);
	cr_assert_eq(bd_kvpool_page_ref(A, 2, 11, a, 2), 0); /* request 2 shares both */
	counts(&c);
	cr_expect_eq(c.pages_used, 2);
	cr_expect_eq(c.pages_shared, 2);
	cr_expect_eq(c.pages_free, 6);
	cr_expect_eq(bd_kvpool_alloc_pages_of(A, 2, got, 4), 2);
	cr_expect_eq(got[0], a[0]);
	cr_expect_eq(got[1], a[1]);
	take(&s);
	/* refs that must fail: held already, free page, page listed twice */
	cr_expect_eq(bd_kvpool_page_ref(A, 2, 11, &a[0], 1), -BD_POOL_ERR_INVALID);
	cr_expect_eq(bd_kvpool_page_ref(A, 3, 11, (int32_t[]){ 5 }, 1), -BD_POOL_ERR_STATE);
	cr_expect_eq(bd_kvpool_page_ref(A, 3, 11, (int32_t[]){ a[0], a[0] }, 2),
		     -BD_POOL_ERR_INVALID);
	cr_expect_eq(bd_kvpool_page_ref(A, 2, 99, (int32_t[]){ 5 }, 1), -BD_POOL_ERR_OWNER);
	assert_same(&s);
	/* the first holder lets go: nothing is freed, request 2 still holds both */
	cr_assert_eq(bd_kvpool_page_free(A, 1, a, 2, &freed), 0);
	cr_expect_eq(freed, 0);
	counts(&c);
	cr_expect_eq(c.pages_used, 2);
	cr_expect_eq(c.pages_shared, 0);
	cr_expect_eq(c.pages_free, 6);
	/* the last holder lets go: both return */
	cr_assert_eq(bd_kvpool_request_release(A, 2, &freed), 0);
	cr_expect_eq(freed, 2);
	counts(&c);
	cr_expect_eq(c.pages_free, 8);
	cr_expect_eq(bd_kvpool_alloc_check(A), 0);
}

Test(pool_alloc, reserve_then_commit)
{
	int32_t r, r2, a[1];
	struct bd_kvpool_counts c;
	struct snap s;

	make(8, 1, 8, 4);
	cr_assert_eq(bd_kvpool_page_alloc(A, 1, 10, 1, a), 0);
	cr_assert_eq(bd_kvpool_page_reserve(A, 1, 10, &r), 0);
	cr_expect_eq(r, 1);
	counts(&c);
	cr_expect_eq(c.pages_reserved, 1);
	cr_expect_eq(c.pages_used, 1);
	take(&s);
	cr_expect_eq(bd_kvpool_page_reserve(A, 1, 10, &r2), -BD_POOL_ERR_STATE);
	/* page a[0] is used, not reserved */
	cr_expect_eq(bd_kvpool_page_commit(A, 1, a[0]), -BD_POOL_ERR_STATE);
	cr_expect_eq(bd_kvpool_page_commit(A, 1, 5), -BD_POOL_ERR_NOT_HELD);
	/* a reserved page is not yet shareable */
	cr_expect_eq(bd_kvpool_page_ref(A, 2, 10, &r, 1), -BD_POOL_ERR_STATE);
	assert_same(&s);
	cr_assert_eq(bd_kvpool_page_commit(A, 1, r), 0);
	counts(&c);
	cr_expect_eq(c.pages_reserved, 0);
	cr_expect_eq(c.pages_used, 2);
	cr_expect_eq(bd_kvpool_page_ref(A, 2, 10, &r, 1), 0);
	/* a reserved page freed before its commit goes back and clears the reservation */
	cr_assert_eq(bd_kvpool_page_reserve(A, 1, 10, &r2), 0);
	cr_assert_eq(bd_kvpool_page_free(A, 1, &r2, 1, NULL), 0);
	cr_expect_eq(bd_kvpool_page_reserve(A, 1, 10, &r2), 0);
	cr_expect_eq(bd_kvpool_alloc_check(A), 0);
}

Test(pool_alloc, slots)
{
	int32_t s1, s2, s3;
	struct snap s;
	struct bd_kvpool_counts c;

	make(4, 2, 4, 4);
	cr_assert_eq(bd_kvpool_slot_assign(A, 1, 10, &s1), 0);
	cr_assert_eq(bd_kvpool_slot_assign(A, 2, 10, &s2), 0);
	cr_expect_eq(s1, 0);
	cr_expect_eq(s2, 1);
	take(&s);
	cr_expect_eq(bd_kvpool_slot_assign(A, 3, 10, &s3), -BD_POOL_ERR_EXHAUSTED);
	cr_expect_eq(bd_kvpool_slot_assign(A, 1, 10, &s3), -BD_POOL_ERR_STATE);
	cr_expect_eq(bd_kvpool_slot_release(A, 1, s2), -BD_POOL_ERR_NOT_HELD);
	assert_same(&s);
	cr_expect_eq(s.c.requests, 2); /* request 3 was not created */
	cr_assert_eq(bd_kvpool_slot_release(A, 1, s1), 0);
	cr_expect_eq(bd_kvpool_slot_release(A, 1, s1), -BD_POOL_ERR_DOUBLE_FREE);
	counts(&c);
	cr_expect_eq(c.slots_free, 1);
	cr_expect_eq(c.requests_holding, 1); /* request 1 holds nothing now */
	cr_expect_eq(bd_kvpool_alloc_check(A), 0);
}

Test(pool_alloc, owner_mismatch)
{
	int32_t p[1], slot;
	struct snap s;

	make(4, 2, 4, 4);
	cr_assert_eq(bd_kvpool_page_alloc(A, 1, 10, 1, p), 0);
	take(&s);
	cr_expect_eq(bd_kvpool_page_alloc(A, 1, 11, 1, p), -BD_POOL_ERR_OWNER);
	cr_expect_eq(bd_kvpool_page_reserve(A, 1, 11, p), -BD_POOL_ERR_OWNER);
	cr_expect_eq(bd_kvpool_slot_assign(A, 1, 11, &slot), -BD_POOL_ERR_OWNER);
	assert_same(&s);
}

Test(pool_alloc, request_records_exhausted)
{
	int32_t p[1];
	struct snap s;

	make(8, 1, 4, 2);
	cr_assert_eq(bd_kvpool_page_alloc(A, 1, 1, 1, p), 0);
	cr_assert_eq(bd_kvpool_page_alloc(A, 2, 1, 1, p), 0);
	take(&s);
	cr_expect_eq(bd_kvpool_page_alloc(A, 3, 1, 1, p), -BD_POOL_ERR_EXHAUSTED);
	assert_same(&s);
	/* a released record makes room again */
	cr_assert_eq(bd_kvpool_request_release(A, 1, NULL), 0);
	cr_expect_eq(bd_kvpool_page_alloc(A, 3, 1, 1, p), 0);
}

Test(pool_alloc, release_returns_everything_to_baseline)
{
	struct bd_kvpool_counts base, c;
	int32_t p[6], r, slot;
	uint64_t freed;

	make(32, 4, 8, 8);
	counts(&base);
	cr_assert_eq(bd_kvpool_page_alloc(A, 5, 1, 6, p), 0);
	cr_assert_eq(bd_kvpool_page_reserve(A, 5, 1, &r), 0);
	cr_assert_eq(bd_kvpool_slot_assign(A, 5, 1, &slot), 0);
	cr_assert_eq(bd_kvpool_page_ref(A, 6, 1, p, 3), 0);
	cr_assert_eq(bd_kvpool_slot_assign(A, 6, 1, &slot), 0);
	/* request 5 holds 7 pages, 3 of them shared with 6: 4 return now, 3 with request 6 */
	cr_assert_eq(bd_kvpool_request_release(A, 5, &freed), 0);
	cr_expect_eq(freed, 4);
	cr_assert_eq(bd_kvpool_request_release(A, 6, &freed), 0);
	cr_expect_eq(freed, 3);
	counts(&c);
	cr_expect(same_counts(&c, &base), "counts differ from the fresh pool");
	cr_expect_eq(bd_kvpool_alloc_check(A), 0);
}

Test(pool_alloc, owner_reclaim_takes_only_that_owner)
{
	struct bd_kvpool_counts c;
	uint64_t n = 0, freed = 0;
	int32_t p[4], slot;

	make(64, 8, 8, 64);
	/* owner 7: requests 1..5 with 2 pages each and a slot; owner 8: requests 6..8, 1 page */
	for (uint64_t id = 1; id <= 5; id++) {
		cr_assert_eq(bd_kvpool_page_alloc(A, id, 7, 2, p), 0);
		cr_assert_eq(bd_kvpool_slot_assign(A, id, 7, &slot), 0);
	}
	for (uint64_t id = 6; id <= 8; id++)
		cr_assert_eq(bd_kvpool_page_alloc(A, id, 8, 1, p), 0);
	cr_assert_eq(bd_kvpool_owner_reclaim(A, 7, &n, &freed), 0);
	cr_expect_eq(n, 5);
	cr_expect_eq(freed, 10);
	counts(&c);
	cr_expect_eq(c.requests, 3);
	cr_expect_eq(c.pages_free, 64 - 3);
	cr_expect_eq(c.slots_free, 8);
	/* nobody left under owner 7: not an error, nothing released */
	cr_assert_eq(bd_kvpool_owner_reclaim(A, 7, &n, &freed), 0);
	cr_expect_eq(n, 0);
	cr_expect_eq(freed, 0);
	cr_expect_eq(bd_kvpool_alloc_check(A), 0);
}

Test(pool_alloc, largest_holders_first)
{
	struct bd_pool_holder h[3];
	int32_t p[5];

	make(32, 2, 8, 8);
	cr_assert_eq(bd_kvpool_page_alloc(A, 10, 1, 1, p), 0);
	cr_assert_eq(bd_kvpool_page_alloc(A, 20, 1, 5, p), 0);
	cr_assert_eq(bd_kvpool_page_alloc(A, 30, 1, 3, p), 0);
	cr_assert_eq(bd_kvpool_alloc_holders(A, true, h, 2), 2);
	cr_expect_eq(h[0].request_id, 20);
	cr_expect_eq(h[0].pages, 5);
	cr_expect_eq(h[1].request_id, 30);
	cr_assert_eq(bd_kvpool_alloc_holders(A, false, h, 3), 3);
	cr_expect_eq(h[0].request_id, 10);
	cr_expect_eq(h[2].request_id, 30);
	cr_expect_eq(h[2].slot, -1);
}

/* Random operations against a plain model of who holds what; the pool must agree with the
 * model after every step, and return to its fresh state at the end. */
Test(pool_alloc, random_operations_match_a_model)
{
	enum { NP = 24, NR = 6, PPR = 6 };
	static uint8_t held[NR + 1][NP]; /* model: held[req][page] */
	struct bd_kvpool_counts base, c;
	uint64_t s = 12345;

	make(NP, 3, PPR, NR);
	counts(&base);
	memset(held, 0, sizeof(held));
	for (int step = 0; step < 4000; step++) {
		int32_t p[PPR];
		uint64_t req, r;
		int op, e;
		size_t refs, model_free = 0;

		s = s * 6364136223846793005ull + 1442695040888963407ull;
		r = s >> 33;
		req = 1 + r % NR;
		op = (int)((r / NR) % 4);
		if (op == 0) {
			e = bd_kvpool_page_alloc(A, req, 1, 1 + (uint32_t)((r >> 8) % 3), p);
			if (e == 0)
				for (long k = 0; k < bd_kvpool_alloc_pages_of(A, req, p, PPR); k++)
					held[req][p[k]] = 1;
		} else if (op == 1) {
			int32_t page = (int32_t)((r >> 8) % NP);

			e = bd_kvpool_page_free(A, req, &page, 1, NULL);
			cr_assert_eq(e == 0, held[req][page] == 1, "step %d: free of page %d", step,
				     page);
			held[req][page] = 0;
		} else if (op == 2) {
			int32_t page = (int32_t)((r >> 8) % NP);
			bool used = false;

			for (int q = 1; q <= NR; q++)
				used |= held[q][page];
			e = bd_kvpool_page_ref(A, req, 1, &page, 1);
			if (e == 0) {
				cr_assert(used && !held[req][page], "step %d: bad ref taken", step);
				held[req][page] = 1;
			}
		} else {
			e = bd_kvpool_request_release(A, req, NULL);
			memset(held[req], 0, NP);
		}
		cr_assert_eq(bd_kvpool_alloc_check(A), 0, "step %d: %s", step,
			     bd_kvpool_alloc_error(A));
		for (int page = 0; page < NP; page++) {
			refs = 0;
			for (int q = 1; q <= NR; q++)
				refs += held[q][page];
			model_free += refs == 0;
		}
		counts(&c);
		cr_assert_eq(c.pages_free, model_free, "step %d", step);
	}
	for (uint64_t req = 1; req <= NR; req++)
		bd_kvpool_request_release(A, req, NULL);
	counts(&c);
	cr_expect(same_counts(&c, &base));
}

/* ---- per-owner quotas and the scrub hook ---------------------------------------------------- */

Test(pool_alloc, quota_refusals_leave_the_pool_and_other_owners_alone)
{
	const struct bd_kvpool_quota q = { .pages = 3, .slots = 1, .requests = 2 };
	struct snap before;
	int32_t p[8], s;

	make(16, 4, 8, 16);
	bd_kvpool_alloc_set_quota(A, &q);
	cr_assert_eq(bd_kvpool_page_alloc(A, 1, 7, 2, p), 0);
	cr_assert_eq(bd_kvpool_slot_assign(A, 1, 7, &s), 0);
	take(&before);
	/* 2 held + 2 = 4 > 3 */
	cr_expect_eq(bd_kvpool_page_alloc(A, 2, 7, 2, p), -BD_POOL_ERR_QUOTA);
	cr_expect_neq(strstr(bd_kvpool_alloc_error(A), "owner_max_pages"), NULL);
	assert_same(&before);
	cr_assert_eq(bd_kvpool_page_reserve(A, 1, 7, p + 2), 0); /* 3: at the quota */
	take(&before);
	cr_expect_eq(bd_kvpool_page_reserve(A, 2, 7, p + 3), -BD_POOL_ERR_QUOTA);
	cr_expect_eq(bd_kvpool_slot_assign(A, 2, 7, &s), -BD_POOL_ERR_QUOTA);
	cr_expect_neq(strstr(bd_kvpool_alloc_error(A), "owner_max_slots"), NULL);
	cr_expect_eq(bd_kvpool_page_ref(A, 2, 7, &p[0], 1), -BD_POOL_ERR_QUOTA,
		     "a shared reference counts against the quota");
	assert_same(&before);
	/* a second record is within owner_max_requests, a third is not */
	cr_assert_eq(bd_kvpool_page_commit(A, 1, p[2]), 0);
	cr_assert_eq(bd_kvpool_page_free(A, 1, p, 1, NULL), 0);
	cr_assert_eq(bd_kvpool_page_alloc(A, 2, 7, 1, p + 3), 0);
	cr_expect_eq(bd_kvpool_page_alloc(A, 3, 8, 3, p), 0, "another owner has its own quota");
	take(&before);
	cr_expect_eq(bd_kvpool_page_alloc(A, 4, 7, 1, p), -BD_POOL_ERR_QUOTA);
	cr_expect_neq(strstr(bd_kvpool_alloc_error(A), "owner_max_"), NULL);
	assert_same(&before);
	/* no quota: the pool's size is the limit again, and its error is EXHAUSTED */
	bd_kvpool_alloc_set_quota(A, NULL);
	cr_expect_eq(bd_kvpool_page_alloc(A, 4, 7, 8, p), 0);
	cr_expect_eq(bd_kvpool_page_alloc(A, 5, 7, 8, p), -BD_POOL_ERR_EXHAUSTED);
	cr_assert_eq(bd_kvpool_alloc_check(A), 0, "%s", bd_kvpool_alloc_error(A));
}

struct scrubbed {
	int32_t pages[32], slots[8];
	size_t n_pages, n_slots;
};

static void note_scrub(void *ctx, bool slot, int32_t id)
{
	struct scrubbed *s = ctx;

	if (slot)
		s->slots[s->n_slots++] = id;
	else
		s->pages[s->n_pages++] = id;
	/* told after the page is on the free stack: the pool is consistent then */
	cr_assert_eq(bd_kvpool_alloc_check(A), 0, "%s", bd_kvpool_alloc_error(A));
}

/* The hook hears of each page and slot once, as it becomes free, and of nothing else: not of a
 * page another request still shares, not of a refused call. */
Test(pool_alloc, the_scrub_hook_hears_of_each_freed_page_and_slot_once)
{
	struct scrubbed s = { 0 };
	int32_t p[3], r, slot;
	uint64_t n_req;

	make(8, 2, 8, 8);
	bd_kvpool_alloc_set_scrub(A, note_scrub, &s);
	cr_assert_eq(bd_kvpool_page_alloc(A, 1, 7, 3, p), 0);      /* 0 1 2 */
	cr_assert_eq(bd_kvpool_slot_assign(A, 1, 7, &slot), 0);
	cr_assert_eq(bd_kvpool_page_reserve(A, 1, 7, &r), 0);       /* 3 */
	cr_assert_eq(bd_kvpool_page_ref(A, 2, 7, &p[1], 1), 0);     /* page 1 shared */
	cr_expect_eq(bd_kvpool_page_free(A, 1, (int32_t[]){ 0, 0 }, 2, NULL),
		     -BD_POOL_ERR_INVALID);
	cr_expect_eq(s.n_pages, 0, "a refused free told the hook");
	cr_assert_eq(bd_kvpool_page_free(A, 1, &p[0], 1, NULL), 0);
	cr_assert_eq(s.n_pages, 1);
	cr_expect_eq(s.pages[0], 0);
	cr_assert_eq(bd_kvpool_slot_release(A, 1, slot), 0);
	cr_assert_eq(s.n_slots, 1);
	cr_expect_eq(s.slots[0], slot);
	/* the rest of request 1: pages 2 and the reserved 3, not the shared 1 */
	cr_assert_eq(bd_kvpool_request_release(A, 1, NULL), 0);
	cr_assert_eq(s.n_pages, 3);
	cr_expect((s.pages[1] == 2 && s.pages[2] == 3) || (s.pages[1] == 3 && s.pages[2] == 2),
		  "freed %d and %d", s.pages[1], s.pages[2]);
	cr_assert_eq(bd_kvpool_owner_reclaim(A, 7, &n_req, NULL), 0);
	cr_expect_eq(n_req, 1);
	cr_assert_eq(s.n_pages, 4);
	cr_expect_eq(s.pages[3], 1, "the shared page when its last holder went");
	cr_expect_eq(s.n_slots, 1);
}
