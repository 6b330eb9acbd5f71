/* test_pool_prefix.c — the allocator's prefix index (kvpoold/alloc.c, kvpool.h "prefix
 * caching"): store, match, idle pages as free capacity, least-recently-used eviction, the
 * refusals (nothing changes), the clear, and the index across a save and load.
 *
 * A fresh pool hands out pages 0, 1, 2, ... and reuses freed ones last-in first-out; the
 * expected ids and counts below follow from that and are worked out in the comments.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "kvpool.h"

static struct bd_kvpool_alloc *A;

static void fini(void)
{
	bd_kvpool_alloc_free(A);
	A = NULL;
}

TestSuite(pool_prefix, .fini = fini);

static struct bd_kvpool_counts counts(void)
{
	struct bd_kvpool_counts c;

	bd_kvpool_alloc_counts(A, &c);
	return c;
}

static struct bd_kvpool_prefix_counts pcounts(void)
{
	struct bd_kvpool_prefix_counts c;

	bd_kvpool_prefix_counts(A, &c);
	return c;
}

/* request 1 (owner 7) holds pages 0, 1, 2, indexed under 11, 12, 13 */
static void three_stored(void)
{
	int32_t p[3];
	const uint64_t h[3] = { 11, 12, 13 };
	uint64_t stored = 0;

	cr_assert_eq(bd_kvpool_alloc_new(8, 4, 8, 8, &A), 0);
	cr_assert_eq(bd_kvpool_page_alloc(A, 1, 7, 3, p), 0);
	cr_assert_eq(p[0], 0);
	cr_assert_eq(p[2], 2);
	cr_assert_eq(bd_kvpool_prefix_store(A, 1, p, h, 3, &stored), 0);
	cr_assert_eq(stored, 3);
}

Test(pool_prefix, match_shares_the_leading_run_and_refcounts_return)
{
	const uint64_t q[3] = { 11, 12, 99 };
	int32_t got[3] = { -1, -1, -1 };
	size_t n = 9;

	three_stored();
	/* 11 and 12 are indexed, 99 is not: the run stops there */
	cr_assert_eq(bd_kvpool_prefix_match(A, 2, 7, q, 3, got, &n), 0);
	cr_assert_eq(n, 2);
	cr_assert_eq(got[0], 0);
	cr_assert_eq(got[1], 1);
	cr_assert_eq(counts().pages_shared, 2);
	cr_assert_eq(pcounts().queries, 3);
	cr_assert_eq(pcounts().hits, 2);
	/* request 1 ends: page 2 (13) has no holder and becomes idle, 0 and 1 stay with 2 */
	cr_assert_eq(bd_kvpool_request_release(A, 1, NULL), 0);
	cr_assert_eq(counts().pages_shared, 0);
	cr_assert_eq(counts().pages_used, 2);
	cr_assert_eq(pcounts().idle, 1);
	/* 5 never used + 1 idle is the free capacity */
	cr_assert_eq(counts().pages_free, 6);
	cr_assert_eq(bd_kvpool_request_release(A, 2, NULL), 0);
	cr_assert_eq(pcounts().idle, 3);
	cr_assert_eq(pcounts().cached, 3);
	cr_assert_eq(counts().pages_free, 8);
	cr_assert_eq(counts().pages_used, 0);
	cr_assert_eq(bd_kvpool_alloc_check(A), 0, "%s", bd_kvpool_alloc_error(A));
	/* an idle page is hit again: used, off the idle list */
	cr_assert_eq(bd_kvpool_prefix_match(A, 3, 7, q, 1, got, &n), 0);
	cr_assert_eq(n, 1);
	cr_assert_eq(got[0], 0);
	cr_assert_eq(pcounts().idle, 2);
	cr_assert_eq(counts().pages_used, 1);
	cr_assert_eq(bd_kvpool_alloc_check(A), 0, "%s", bd_kvpool_alloc_error(A));
}

Test(pool_prefix, a_miss_changes_nothing)
{
	const uint64_t q[2] = { 42, 11 };
	int32_t got[2];
	size_t n = 5;

	three_stored();
	/* the first hash misses: no record is made for request 2 */
	cr_assert_eq(bd_kvpool_prefix_match(A, 2, 7, q, 2, got, &n), 0);
	cr_assert_eq(n, 0);
	cr_assert_eq(counts().requests, 1);
	cr_assert_eq(pcounts().hits, 0);
}

Test(pool_prefix, eviction_takes_the_least_recently_released_and_never_a_held_page)
{
	int32_t p[8], one = 1, zero = 0;
	const uint64_t q[1] = { 13 };
	size_t n;

	three_stored();
	/* page 1 then page 0 go idle (1 is the least recently released); page 2 stays held */
	cr_assert_eq(bd_kvpool_page_free(A, 1, &one, 1, NULL), 0);
	cr_assert_eq(bd_kvpool_page_free(A, 1, &zero, 1, NULL), 0);
	cr_assert_eq(pcounts().idle, 2);
	/* 5 free pages + 2 idle: 6 pages evict one idle page, the least recent: page 1 */
	cr_assert_eq(bd_kvpool_page_alloc(A, 2, 7, 6, p), 0);
	cr_assert_eq(pcounts().evictions, 1);
	cr_assert_eq(pcounts().idle, 1);
	cr_assert_eq(pcounts().cached, 2);
	/* 12 (page 1) is gone, 11 (page 0) and 13 (held page 2) are still found */
	{
		const uint64_t q2[1] = { 12 }, q1[1] = { 11 };
		int32_t g;

		cr_assert_eq(bd_kvpool_prefix_match(A, 3, 7, q2, 1, &g, &n), 0);
		cr_assert_eq(n, 0);
		cr_assert_eq(bd_kvpool_prefix_match(A, 3, 7, q1, 1, &g, &n), 0);
		cr_assert_eq(n, 1);
		cr_assert_eq(g, 0);
	}
	/* the pool has no free page and no idle one: a held indexed page is never taken */
	cr_assert_eq(counts().pages_free, 0);
	cr_assert_eq(bd_kvpool_page_alloc(A, 4, 7, 1, p), -BD_POOL_ERR_EXHAUSTED);
	cr_assert_eq(bd_kvpool_prefix_match(A, 4, 7, q, 1, p, &n), 0);
	cr_assert_eq(n, 1);
	cr_assert_eq(p[0], 2);
	cr_assert_eq(bd_kvpool_alloc_check(A), 0, "%s", bd_kvpool_alloc_error(A));
}

Test(pool_prefix, refusals_change_nothing)
{
	int32_t p[3] = { 0, 1, 2 }, r, other;
	const uint64_t h0[1] = { 0 }, h[2] = { 21, 21 };
	struct bd_kvpool_counts before;
	struct bd_kvpool_prefix_counts pb;
	size_t n;

	three_stored();
	cr_assert_eq(bd_kvpool_page_alloc(A, 2, 8, 1, &other), 0); /* page 3, owner 8 */
	cr_assert_eq(bd_kvpool_page_reserve(A, 1, 7, &r), 0);      /* page 4 */
	before = counts();
	pb = pcounts();
	cr_assert_eq(bd_kvpool_prefix_store(A, 1, &r, h0, 1, NULL), -BD_POOL_ERR_INVALID);
	cr_assert_eq(bd_kvpool_prefix_store(A, 1, &r, h, 1, NULL), -BD_POOL_ERR_STATE);
	cr_assert_eq(bd_kvpool_prefix_store(A, 1, &other, h, 1, NULL), -BD_POOL_ERR_NOT_HELD);
	cr_assert_eq(bd_kvpool_prefix_store(A, 9, p, h, 1, NULL), -BD_POOL_ERR_UNKNOWN_REQUEST);
	cr_assert_eq(bd_kvpool_prefix_store(A, 1, p, h, 2, NULL), -BD_POOL_ERR_INVALID);
	/* request 2 is owner 8's */
	cr_assert_eq(bd_kvpool_prefix_match(A, 2, 7, h, 1, p, &n), -BD_POOL_ERR_OWNER);
	cr_assert_eq(counts().pages_used, before.pages_used);
	cr_assert_eq(counts().pages_free, before.pages_free);
	cr_assert_eq(pcounts().cached, pb.cached);
	cr_assert_eq(pcounts().stored, pb.stored);
	cr_assert_eq(bd_kvpool_alloc_check(A), 0, "%s", bd_kvpool_alloc_error(A));
	/* a page indexed already, or a hash another page holds, is left as it is */
	{
		const uint64_t again[1] = { 11 };
		uint64_t stored = 9;

		cr_assert_eq(bd_kvpool_prefix_store(A, 2, &other, again, 1, &stored), 0);
		cr_assert_eq(stored, 0);
	}
}

Test(pool_prefix, clear_frees_idle_pages_and_unindexes_held_ones)
{
	int32_t two = 2;
	uint64_t dropped = 0;

	three_stored();
	cr_assert_eq(bd_kvpool_page_free(A, 1, &two, 1, NULL), 0); /* page 2 idle */
	cr_assert_eq(bd_kvpool_prefix_clear(A, &dropped), 0);
	cr_assert_eq(dropped, 3);
	cr_assert_eq(pcounts().cached, 0);
	cr_assert_eq(pcounts().idle, 0);
	cr_assert_eq(counts().pages_used, 2);
	/* the held pages are freed by their last holder now */
	cr_assert_eq(bd_kvpool_request_release(A, 1, &dropped), 0);
	cr_assert_eq(dropped, 2);
	cr_assert_eq(counts().pages_free, 8);
	cr_assert_eq(bd_kvpool_alloc_check(A), 0, "%s", bd_kvpool_alloc_error(A));
}

Test(pool_prefix, the_index_survives_save_and_load)
{
	struct bd_kvpool_alloc *b;
	int32_t zero = 0, one = 1, got[2];
	const uint64_t q[2] = { 11, 12 };
	size_t cap = bd_kvpool_alloc_save_max(8, 4, 8, 8), n;
	uint8_t *buf = malloc(cap);
	ssize_t len;

	three_stored();
	/* 1 then 0 idle, 2 held */
	cr_assert_eq(bd_kvpool_page_free(A, 1, &one, 1, NULL), 0);
	cr_assert_eq(bd_kvpool_page_free(A, 1, &zero, 1, NULL), 0);
	len = bd_kvpool_alloc_save(A, buf, cap);
	cr_assert_gt(len, 0);
	cr_assert_eq(bd_kvpool_alloc_new(8, 4, 8, 8, &b), 0);
	cr_assert_eq(bd_kvpool_alloc_load(b, buf, (size_t)len), len, "%s",
		     bd_kvpool_alloc_error(b));
	bd_kvpool_alloc_free(A);
	A = b;
	cr_assert_eq(pcounts().cached, 3);
	cr_assert_eq(pcounts().idle, 2);
	cr_assert_eq(counts().pages_free, 7);
	/* the LRU order came back too: 6 pages evict page 1 (released first), not page 0 */
	{
		int32_t p[6];

		cr_assert_eq(bd_kvpool_page_alloc(A, 5, 7, 6, p), 0);
	}
	cr_assert_eq(bd_kvpool_prefix_match(A, 6, 7, q, 2, got, &n), 0);
	cr_assert_eq(n, 1);
	cr_assert_eq(got[0], 0);
	/* a saved index entry that names a page twice is refused, and the pool is left empty */
	{
		uint8_t *bad = malloc((size_t)len);
		/* the index's last entry (page, hash) is at the end: point it at the first's page */
		memcpy(bad, buf, (size_t)len);
		memcpy(bad + len - 12, bad + len - 24, 4);
		cr_assert_eq(bd_kvpool_alloc_load(A, bad, (size_t)len), -EBADMSG);
		cr_assert_eq(counts().pages_free, 8);
		cr_assert_eq(pcounts().cached, 0);
		free(bad);
	}
	free(buf);
}
