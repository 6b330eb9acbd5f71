/* test_pool_proto.c — kvpoold's allocation protocol handler (kvpoold/handler.c), driven with
 * protobuf-c frames built here: valid operations, then malformed, truncated, oversize and
 * unknown frames, each of which must get an error reply and leave the pool unchanged.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "kvpool.h"
#include "kvpool.pb-c.h"

static struct bd_kvpool_alloc *A;
static struct bd_kvpool_handler H;

static void init(void)
{
	cr_assert_eq(bd_kvpool_alloc_new(16, 4, 8, 16, &A), 0);
	H = (struct bd_kvpool_handler){ .alloc = A, .max_frame = 1024, .default_top = 4 };
}

static void fini(void)
{
	bd_kvpool_alloc_free(A);
}

TestSuite(pool_proto, .init = init, .fini = fini);

/* Sends raw bytes, returns the decoded reply (caller frees). */
static Bdfp4__PoolReply *raw(const void *frame, size_t len)
{
	uint8_t *out = NULL;
	size_t out_len = 0;
	Bdfp4__PoolReply *rep;

	cr_assert_eq(bd_kvpool_handle(&H, frame, len, &out, &out_len), 0);
	rep = bdfp4__pool_reply__unpack(NULL, out_len, out);
	free(out);
	cr_assert_not_null(rep, "the reply does not parse");
	return rep;
}

/* Packs op (bd_pool_op_pack), hands the frame to the handler, returns the decoded reply;
 * the frame goes to *ret_frame (caller frees) when ret_frame is not NULL. */
static Bdfp4__PoolReply *send_op(struct bd_pool_op op, uint8_t **ret_frame, size_t *ret_len)
{
	ssize_t n = bd_pool_op_pack(&op, NULL, 0);
	uint8_t *b = malloc(n + 1);
	Bdfp4__PoolReply *rep;

	cr_assert_gt(n, 0);
	cr_assert_eq(bd_pool_op_pack(&op, b, (size_t)n), n);
	rep = raw(b, (size_t)n);
	if (ret_frame) {
		*ret_frame = b;
		*ret_len = (size_t)n;
	} else {
		free(b);
	}
	return rep;
}

static Bdfp4__PoolReply *alloc_pages(uint64_t id, uint64_t owner, uint32_t n)
{
	return send_op((struct bd_pool_op){ BD_POOL_OP_PAGE_ALLOC, id, owner, .n = n }, NULL,
		       NULL);
}

static Bdfp4__PoolReply *free_pages(uint64_t id, int32_t *pages, size_t n, uint8_t **frame,
				    size_t *len)
{
	return send_op((struct bd_pool_op){ BD_POOL_OP_PAGE_FREE, id, .pages = pages,
					    .n_pages = n },
		       frame, len);
}

static void expect_error(Bdfp4__PoolReply *rep, int code)
{
	cr_expect_eq(rep->error, code, "error %d, wanted %d (%s)", rep->error, code, rep->message);
	cr_expect_neq(strlen(rep->message), 0, "an error without a text");
	cr_expect_eq(rep->n_pages, 0);
	bdfp4__pool_reply__free_unpacked(rep, NULL);
}

static bool same(struct bd_kvpool_counts a, struct bd_kvpool_counts b)
{
	/* field by field: padding of a struct returned by value is unspecified */
	return a.pages_total == b.pages_total && a.pages_free == b.pages_free &&
	       a.pages_used == b.pages_used && a.pages_reserved == b.pages_reserved &&
	       a.pages_shared == b.pages_shared && a.slots_total == b.slots_total &&
	       a.slots_free == b.slots_free && a.requests == b.requests &&
	       a.requests_holding == b.requests_holding;
}

static struct bd_kvpool_counts counts(void)
{
	struct bd_kvpool_counts c;

	bd_kvpool_alloc_counts(A, &c);
	return c;
}

Test(pool_proto, alloc_free_round_trip)
{
	Bdfp4__PoolReply *rep = alloc_pages(3, 9, 4);
	int32_t p[4];

	cr_assert_eq(rep->error, BDFP4__POOL_ERROR__POOL_OK, "%s", rep->message);
	cr_assert_eq(rep->n_pages, 4);
	for (int i = 0; i < 4; i++)
		cr_expect_eq(rep->pages[i], i); /* fresh pool: 0, 1, 2, 3 */
	memcpy(p, rep->pages, sizeof(p));
	bdfp4__pool_reply__free_unpacked(rep, NULL);
	cr_expect_eq(counts().pages_free, 12);

	rep = free_pages(3, p, 4, NULL, NULL);
	cr_expect_eq(rep->error, BDFP4__POOL_ERROR__POOL_OK);
	cr_expect_eq(rep->pages_freed, 4);
	bdfp4__pool_reply__free_unpacked(rep, NULL);
	cr_expect_eq(counts().pages_free, 16);
	cr_expect_eq(H.served, 2);
	cr_expect_eq(H.errors, 0);
}

Test(pool_proto, allocator_errors_become_error_replies)
{
	Bdfp4__PoolReply *rep = alloc_pages(3, 9, 2);
	int32_t p[2];

	memcpy(p, rep->pages, sizeof(p));
	bdfp4__pool_reply__free_unpacked(rep, NULL);
	/* max 8 pages per request */
	expect_error(alloc_pages(3, 9, 0), BDFP4__POOL_ERROR__POOL_ERR_RANGE);
	expect_error(alloc_pages(3, 9, 1000000), BDFP4__POOL_ERROR__POOL_ERR_RANGE);
	/* 14 free: 8 for request 4 leave 6, then 7 for request 5 cannot be had */
	bdfp4__pool_reply__free_unpacked(alloc_pages(4, 9, 8), NULL);
	expect_error(alloc_pages(5, 9, 7), BDFP4__POOL_ERROR__POOL_ERR_EXHAUSTED);
	cr_expect_eq(counts().pages_free, 6);
	expect_error(alloc_pages(3, 10, 1), BDFP4__POOL_ERROR__POOL_ERR_OWNER);
	expect_error(free_pages(99, p, 2, NULL, NULL), BDFP4__POOL_ERROR__POOL_ERR_UNKNOWN_REQUEST);
	rep = free_pages(3, p, 1, NULL, NULL);
	cr_expect_eq(rep->error, BDFP4__POOL_ERROR__POOL_OK);
	bdfp4__pool_reply__free_unpacked(rep, NULL);
	expect_error(free_pages(3, p, 1, NULL, NULL), BDFP4__POOL_ERROR__POOL_ERR_DOUBLE_FREE);
	expect_error(free_pages(4, &p[1], 1, NULL, NULL), BDFP4__POOL_ERROR__POOL_ERR_NOT_HELD);
	cr_expect_eq(counts().pages_free, 7);
	cr_expect_eq(H.errors, 7);
	cr_expect_eq(H.served, 10);
	cr_expect_eq(bd_kvpool_alloc_check(A), 0);
}

Test(pool_proto, truncated_frames_are_malformed_and_change_nothing)
{
	int32_t pages[4] = { 0, 1, 2, 3 };
	Bdfp4__PoolReply *rep = alloc_pages(3, 9, 4);
	uint8_t *frame;
	size_t len;
	struct bd_kvpool_counts before;

	bdfp4__pool_reply__free_unpacked(rep, NULL);
	/* a valid free of all four pages; applied once, then the pages are taken again, so
	 * the frame would change the pool if any prefix of it were accepted */
	rep = free_pages(3, pages, 4, &frame, &len);
	cr_assert_eq(rep->error, BDFP4__POOL_ERROR__POOL_OK);
	bdfp4__pool_reply__free_unpacked(rep, NULL);
	rep = alloc_pages(3, 9, 4);
	bdfp4__pool_reply__free_unpacked(rep, NULL);
	before = counts();
	/* PoolRequest holds one length-delimited member: any proper prefix of it is cut inside
	 * that member (or its tag) and cannot parse */
	for (size_t n = 1; n < len; n++) {
		rep = raw(frame, n);
		cr_expect_eq(rep->error, BDFP4__POOL_ERROR__POOL_ERR_MALFORMED, "prefix of %zu", n);
		bdfp4__pool_reply__free_unpacked(rep, NULL);
	}
	cr_expect(same(counts(), before), "a refused frame changed the pool");
	cr_expect_eq(bd_kvpool_alloc_check(A), 0);
	free(frame);
}

Test(pool_proto, garbage_unknown_and_oversize)
{
	static const uint8_t junk[] = { 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
					0xff };
	/* field 99, varint 1: a member no PoolRequest of this version knows */
	static const uint8_t unknown_field[] = { 0x98, 0x06, 0x01 };
	/* field 1 (page_alloc, a message) sent as a varint: wrong wire type */
	static const uint8_t wrong_wire[] = { 0x08, 0x05 };
	/* field 1 says 100 bytes follow; 2 do */
	static const uint8_t short_len[] = { 0x0a, 0x64, 0x08, 0x01 };
	struct bd_kvpool_counts before = counts();
	uint8_t *big = calloc(1, H.max_frame + 1);

	expect_error(raw(junk, sizeof(junk)), BDFP4__POOL_ERROR__POOL_ERR_MALFORMED);
	expect_error(raw(wrong_wire, sizeof(wrong_wire)), BDFP4__POOL_ERROR__POOL_ERR_MALFORMED);
	expect_error(raw(short_len, sizeof(short_len)), BDFP4__POOL_ERROR__POOL_ERR_MALFORMED);
	expect_error(raw(unknown_field, sizeof(unknown_field)),
		     BDFP4__POOL_ERROR__POOL_ERR_UNKNOWN_TYPE);
	expect_error(raw(NULL, 0), BDFP4__POOL_ERROR__POOL_ERR_UNKNOWN_TYPE);
	/* one byte over the limit, whatever it holds */
	expect_error(raw(big, H.max_frame + 1), BDFP4__POOL_ERROR__POOL_ERR_OVERSIZE);
	free(big);
	cr_expect(same(counts(), before), "a refused frame changed the pool");
	cr_expect_eq(H.errors, 6);
	cr_expect_eq(H.served, 6);
	/* and it still serves */
	{
		Bdfp4__PoolReply *rep = alloc_pages(1, 1, 1);

		cr_expect_eq(rep->error, BDFP4__POOL_ERROR__POOL_OK);
		bdfp4__pool_reply__free_unpacked(rep, NULL);
	}
}

Test(pool_proto, stats_and_requests)
{
	Bdfp4__PoolReply *rep;
	struct bd_pool_device dev[1] = { { .rank = 0, .device = -1, .attached = 2 } };
	struct bd_kvpool_info info = { .backend = "cpu", .kv_config = "bitdecoding-nvfp4",
				       .page_format = "nvfp4", .tp = 1, .devices = dev,
				       .n_devices = 1 };

	H.info = &info;
	bdfp4__pool_reply__free_unpacked(alloc_pages(10, 1, 2), NULL);
	bdfp4__pool_reply__free_unpacked(alloc_pages(20, 2, 5), NULL);
	rep = send_op((struct bd_pool_op){ BD_POOL_OP_STATS }, NULL, NULL);
	cr_assert_eq(rep->error, BDFP4__POOL_ERROR__POOL_OK);
	cr_assert_not_null(rep->stats);
	cr_expect_eq(rep->stats->pages_total, 16);
	cr_expect_eq(rep->stats->pages_used, 7);
	cr_expect_eq(rep->stats->pages_free, 9);
	cr_expect_eq(rep->stats->requests, 2);
	cr_expect_str_eq(rep->stats->backend, "cpu");
	cr_expect_eq(rep->stats->served, 3); /* two allocations and this query */
	cr_assert_eq(rep->stats->n_largest, 2);
	cr_expect_eq(rep->stats->largest[0]->request_id, 20);
	cr_assert_eq(rep->stats->n_devices, 1);
	cr_expect_eq(rep->stats->devices[0]->attached, 2);
	bdfp4__pool_reply__free_unpacked(rep, NULL);

	rep = send_op((struct bd_pool_op){ BD_POOL_OP_REQUESTS }, NULL, NULL);
	cr_assert_eq(rep->n_requests, 2);
	cr_expect_eq(rep->requests[0]->request_id, 10);
	cr_expect_eq(rep->requests[0]->pages, 2);
	cr_expect_eq(rep->requests[1]->owner, 2);
	bdfp4__pool_reply__free_unpacked(rep, NULL);
}

Test(pool_proto, error_reply_helper)
{
	uint8_t *out;
	size_t len;
	Bdfp4__PoolReply *rep;

	cr_assert_eq(bd_kvpool_error_reply(&H, BD_POOL_ERR_MALFORMED, "multi-part message", &out,
					   &len), 0);
	rep = bdfp4__pool_reply__unpack(NULL, len, out);
	free(out);
	cr_assert_not_null(rep);
	cr_expect_eq(rep->error, BDFP4__POOL_ERROR__POOL_ERR_MALFORMED);
	cr_expect_str_eq(rep->message, "multi-part message");
	bdfp4__pool_reply__free_unpacked(rep, NULL);
	cr_expect_eq(bd_kvpool_handle(NULL, NULL, 0, &out, &len), -EINVAL);
}
