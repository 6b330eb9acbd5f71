/* test_pool_op.c — bd_pool_op_pack (bd_pool_op.h): each kind becomes the PoolRequest
 * member of kvpool.proto with the fields that message has, byte for byte; the length is
 * reported like snprintf's, and nothing is written to a buffer that is too small. Suite
 * "pool_op".
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <string.h>

#include "pool/bd_pool_op.h"
#include "kvpool.pb-c.h"

/* Every kind from the same op (request 3, owner 9, n 5, index 13, pages and tokens 7 and
 * 300, hashes 21 and 300, parent 6, epoch 4, bytes aa bb): the
 * frame holds the kind's oneof member (field number = kind) with exactly the fields its
 * message has, varints as kvpool.proto's wire format fixes them (300 = 0xac 0x02, pages
 * packed). Written out by hand, so a field sent to the wrong member or number shows. */
Test(pool_op, each_kind_is_its_member_with_its_fields)
{
	static const int32_t pages[2] = { 7, 300 };
	static const uint64_t hashes[2] = { 21, 300 };
	static const struct {
		enum bd_pool_op_kind kind;
		uint8_t len, frame[24];
	} want[] = {
		{ BD_POOL_OP_NONE, 0, { 0 } },
		{ BD_POOL_OP_PAGE_ALLOC, 8, { 0x0a, 6, 0x08, 3, 0x10, 9, 0x18, 5 } },
		{ BD_POOL_OP_PAGE_RESERVE, 6, { 0x12, 4, 0x08, 3, 0x10, 9 } },
		{ BD_POOL_OP_PAGE_COMMIT, 6, { 0x1a, 4, 0x08, 3, 0x10, 13 } },
		{ BD_POOL_OP_PAGE_FREE, 9, { 0x22, 7, 0x08, 3, 0x12, 3, 7, 0xac, 0x02 } },
		{ BD_POOL_OP_PAGE_REF, 11, { 0x2a, 9, 0x08, 3, 0x10, 9, 0x1a, 3, 7, 0xac, 0x02 } },
		{ BD_POOL_OP_SLOT_ASSIGN, 6, { 0x32, 4, 0x08, 3, 0x10, 9 } },
		{ BD_POOL_OP_SLOT_RELEASE, 6, { 0x3a, 4, 0x08, 3, 0x10, 13 } },
		{ BD_POOL_OP_REQUEST_RELEASE, 4, { 0x42, 2, 0x08, 3 } },
		{ BD_POOL_OP_OWNER_RECLAIM, 4, { 0x4a, 2, 0x08, 9 } },
		{ BD_POOL_OP_STATS, 4, { 0x52, 2, 0x08, 5 } },
		{ BD_POOL_OP_REQUESTS, 2, { 0x5a, 0 } },
		{ BD_POOL_OP_GROUP_REGISTER, 10, { 0x72, 8, 0x08, 9, 0x10, 4, 0x1a, 2, 0xaa, 0xbb } },
		/* GroupRegister's tokens are bytes, PrefixStore's repeated int32 (packed) */
		{ BD_POOL_OP_PREFIX_STORE, 21, { 0x7a, 19, 0x08, 3, 0x12, 3, 7, 0xac, 0x02, 0x1a, 3,
						 21, 0xac, 0x02, 0x22, 3, 7, 0xac, 0x02, 0x28, 6 } },
		/* fields 16 and 17: two-byte tags (16 << 3 | 2 = 0x82 0x01) */
		{ BD_POOL_OP_PREFIX_MATCH, 12, { 0x82, 0x01, 9, 0x08, 3, 0x10, 9, 0x1a, 3, 21, 0xac,
						 0x02 } },
		{ BD_POOL_OP_PREFIX_CLEAR, 3, { 0x8a, 0x01, 0 } },
	};
	static const uint8_t bytes[2] = { 0xaa, 0xbb };
	struct bd_pool_op op = { .request_id = 3, .owner = 9, .n = 5, .index = 13,
				 .pages = pages, .n_pages = 2, .hashes = hashes, .n_hashes = 2,
				 .tokens = pages, .n_tokens = 2, .parent = 6, .epoch = 4,
				 .bytes = bytes, .n_bytes = 2 };

	/* 12 and 13 are PoolRequest's client and call, not kinds */
	cr_assert_eq(sizeof(want) / sizeof(want[0]), BD_POOL_OP_COUNT - 2, "every kind listed");
	for (int k = 12; k <= 13; k++) {
		uint8_t b[8];

		op.kind = (enum bd_pool_op_kind)k;
		cr_expect_eq(bd_pool_op_pack(&op, b, sizeof(b)), -EINVAL, "kind %d is no member", k);
	}
	for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
		uint8_t buf[32];
		ssize_t n;
		Bdfp4__PoolRequest *req;

		op.kind = want[i].kind;
		n = bd_pool_op_pack(&op, buf, sizeof(buf));
		cr_assert_eq(n, want[i].len, "kind %d: %zd bytes, want %u", op.kind, n,
			     want[i].len);
		cr_expect_eq(memcmp(buf, want[i].frame, want[i].len), 0, "kind %d: other bytes",
			     op.kind);
		/* and protobuf-c reads the member back */
		req = bdfp4__pool_request__unpack(NULL, (size_t)n, buf);
		cr_assert_not_null(req, "kind %d: the frame does not parse", op.kind);
		cr_expect_eq((int)req->op_case, (int)op.kind);
		bdfp4__pool_request__free_unpacked(req, NULL);
	}
}

Test(pool_op, short_buffers_are_left_alone)
{
	static const int32_t pages[4] = { 1, 2, 3, 4 };
	struct bd_pool_op op = { BD_POOL_OP_PAGE_REF, 77, 5, .pages = pages, .n_pages = 4 };
	ssize_t n = bd_pool_op_pack(&op, NULL, 0);
	uint8_t buf[64];

	cr_assert_gt(n, 4);
	memset(buf, 0xa5, sizeof(buf));
	cr_expect_eq(bd_pool_op_pack(&op, buf, (size_t)n - 1), n, "the length, as snprintf");
	for (size_t i = 0; i < sizeof(buf); i++)
		cr_assert_eq(buf[i], 0xa5, "byte %zu written into a buffer that was too small", i);
	cr_expect_eq(bd_pool_op_pack(&op, buf, (size_t)n), n);
	cr_expect_neq(buf[0], 0xa5);
	cr_expect_eq(buf[n], 0xa5, "nothing past the frame");
}

Test(pool_op, bad_ops_are_refused)
{
	struct bd_pool_op op = { BD_POOL_OP_PAGE_FREE, 1, .n_pages = 2 };
	uint8_t buf[16];

	cr_expect_eq(bd_pool_op_pack(&op, buf, sizeof(buf)), -EINVAL, "two pages, no list");
	op = (struct bd_pool_op){ BD_POOL_OP_COUNT, 1 };
	cr_expect_eq(bd_pool_op_pack(&op, buf, sizeof(buf)), -EINVAL, "an unknown kind");
	op.kind = (enum bd_pool_op_kind)12; /* PoolRequest.client: a field, not an operation */
	cr_expect_eq(bd_pool_op_pack(&op, buf, sizeof(buf)), -EINVAL, "the client field");
	op = (struct bd_pool_op){ BD_POOL_OP_GROUP_REGISTER, .n_bytes = 32 };
	cr_expect_eq(bd_pool_op_pack(&op, buf, sizeof(buf)), -EINVAL, "32 bytes, no list");
	op = (struct bd_pool_op){ BD_POOL_OP_PREFIX_MATCH, 1, .n_hashes = 2 };
	cr_expect_eq(bd_pool_op_pack(&op, buf, sizeof(buf)), -EINVAL, "two hashes, no list");
	op = (struct bd_pool_op){ BD_POOL_OP_PREFIX_STORE, 1, .n_tokens = 128 };
	cr_expect_eq(bd_pool_op_pack(&op, buf, sizeof(buf)), -EINVAL, "128 tokens, no list");
	op.kind = BD_POOL_OP_REQUEST_RELEASE;
	cr_expect_eq(bd_pool_op_pack(&op, NULL, 4), -EINVAL, "no buffer but a capacity");
	cr_expect_eq(bd_pool_op_pack(NULL, buf, sizeof(buf)), -EINVAL);
}
