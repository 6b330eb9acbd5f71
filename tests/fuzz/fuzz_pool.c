/* fuzz_pool.c — libFuzzer target for kvpoold's message handler (kvpoold/handler.c) and the
 * allocator behind it.
 *
 * Build and run: `make fuzz-pool` (clang -fsanitize=fuzzer,address,undefined). One input is a
 * session against one small pool: a sequence of records [kind][len][bytes]. Kind even: the
 * bytes go to the handler as a raw frame (malformed, truncated, oversize, anything). Kind odd:
 * the bytes are read as one well-formed operation with small ids, packed, then handled, so
 * that the fuzzer reaches deep allocator states without learning protobuf. After every frame
 * the reply must parse and the allocator's invariants must hold; at the end, releasing every
 * request must give the fresh pool back.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvpool.h"
#include "kvpool.pb-c.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define N_PAGES 24
#define N_SLOTS 3
#define PPR 8
#define N_REQ 6

static void handle(struct bd_kvpool_handler *h, const uint8_t *frame, size_t len)
{
	Bdfp4__PoolReply *rep;
	uint8_t *out = NULL;
	size_t out_len = 0;

	if (bd_kvpool_handle(h, frame, len, &out, &out_len) < 0)
		abort(); /* only -ENOMEM may fail, and a fuzzer run has memory */
	rep = bdfp4__pool_reply__unpack(NULL, out_len, out);
	if (!rep)
		abort();
	/* an error reply carries no pages; a success says nothing about errors */
	if (rep->error != BDFP4__POOL_ERROR__POOL_OK && (rep->n_pages || !rep->message[0]))
		abort();
	bdfp4__pool_reply__free_unpacked(rep, NULL);
	free(out);
	if (bd_kvpool_alloc_check(h->alloc) != 0)
		abort();
}

/* One operation from b[0..n): op, request, owner, count/page/slot, page list; packed by the
 * client's own bd_pool_op_pack (op 11 is BD_POOL_OP_NONE: no member, an unknown type; 12 a
 * GROUP_REGISTER; b[0] from 0xf0 on: PREFIX_STORE, PREFIX_MATCH or PREFIX_CLEAR, with hashes
 * 0..7 (0 is refused) so that stores and matches meet). */
static void structured(struct bd_kvpool_handler *h, const uint8_t *b, size_t n)
{
	static const uint32_t count_mod[BD_POOL_OP_COUNT] = {
		[BD_POOL_OP_PAGE_ALLOC] = PPR + 2, [BD_POOL_OP_STATS] = 256,
	};
	static const int32_t index_mod[BD_POOL_OP_COUNT] = {
		[BD_POOL_OP_PAGE_COMMIT] = N_PAGES + 2, [BD_POOL_OP_SLOT_RELEASE] = N_SLOTS + 2,
	};
	struct bd_pool_op op = { 0 };
	int32_t pages[16];
	uint64_t hashes[16];
	uint8_t frame[512];
	ssize_t len;

	if (n < 4)
		return;
	/* 0 → PAGE_ALLOC, ..., 10 → REQUESTS, 11 → NONE, 12 → GROUP_REGISTER (the rest its
	 * tokens) */
	op.kind = b[0] % 13 == 12 ? BD_POOL_OP_GROUP_REGISTER
				  : (enum bd_pool_op_kind)((b[0] % 13 + 1) % 12);
	op.request_id = b[1] % (N_REQ + 1); /* 0 is invalid on purpose */
	op.owner = b[2] % 3;
	if (count_mod[op.kind])
		op.n = b[3] % count_mod[op.kind];
	if (index_mod[op.kind])
		op.index = (int32_t)(b[3] % index_mod[op.kind]) - 1; /* -1 and one past the end */
	if (b[0] >= 0xf0)
		op.kind = (enum bd_pool_op_kind)(BD_POOL_OP_PREFIX_STORE + b[0] % 3);
	if (op.kind == BD_POOL_OP_PREFIX_STORE || op.kind == BD_POOL_OP_PREFIX_MATCH) {
		for (size_t i = 4; i < n && op.n_hashes < 16; i++) {
			hashes[op.n_hashes++] = b[i] % 8;
			pages[op.n_pages++] = (int32_t)(b[i] / 8 % (N_PAGES + 2)) - 1;
		}
		op.hashes = hashes;
		op.pages = op.kind == BD_POOL_OP_PREFIX_STORE ? pages : NULL;
		if (op.kind != BD_POOL_OP_PREFIX_STORE)
			op.n_pages = 0;
	}
	if (op.kind == BD_POOL_OP_PAGE_FREE || op.kind == BD_POOL_OP_PAGE_REF) {
		for (size_t i = 4; i < n && op.n_pages < 16; i++)
			pages[op.n_pages++] = (int32_t)(b[i] % (N_PAGES + 2)) - 1; /* -1, N_PAGES */
		op.pages = pages;
	}
	if (op.kind == BD_POOL_OP_GROUP_REGISTER) {
		op.epoch = b[3] % 3; /* 0 is invalid on purpose */
		op.bytes = b + 4;
		op.n_bytes = n - 4;
	}
	len = bd_pool_op_pack(&op, frame, sizeof(frame));
	if (len < 0)
		abort();
	if ((size_t)len <= sizeof(frame))
		handle(h, frame, (size_t)len);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct bd_kvpool_alloc *a;
	struct bd_kvpool_handler h;
	struct bd_kvpool_counts c;
	struct bd_pool_holder held[N_REQ];
	size_t i = 0, n_held;

	if (bd_kvpool_alloc_new(N_PAGES, N_SLOTS, PPR, N_REQ, &a) < 0)
		abort();
	h = (struct bd_kvpool_handler){ .alloc = a, .max_frame = 200, .default_top = 4 };
	while (i + 2 <= size) {
		uint8_t kind = data[i], len = data[i + 1];

		i += 2;
		if (len > size - i)
			len = (uint8_t)(size - i);
		if (kind & 1)
			structured(&h, data + i, len);
		else
			handle(&h, data + i, len);
		i += len;
	}
	/* every record, whatever id a raw frame gave it (at most N_REQ of them) */
	n_held = bd_kvpool_alloc_holders(a, false, held, N_REQ);
	for (size_t k = 0; k < n_held; k++)
		bd_kvpool_request_release(a, held[k].request_id, NULL);
	bd_kvpool_alloc_counts(a, &c);
	if (c.pages_free != N_PAGES || c.slots_free != N_SLOTS || c.requests != 0)
		abort();
	bd_kvpool_alloc_free(a);
	return 0;
}
