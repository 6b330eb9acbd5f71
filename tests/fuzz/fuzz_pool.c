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

/* One operation from b[0..n): op, request, owner, count/page/slot, page list. */
static void structured(struct bd_kvpool_handler *h, const uint8_t *b, size_t n)
{
	Bdfp4__PoolRequest req = BDFP4__POOL_REQUEST__INIT;
	Bdfp4__PageAlloc pa = BDFP4__PAGE_ALLOC__INIT;
	Bdfp4__PageReserve pr = BDFP4__PAGE_RESERVE__INIT;
	Bdfp4__PageCommit pc = BDFP4__PAGE_COMMIT__INIT;
	Bdfp4__PageFree pf = BDFP4__PAGE_FREE__INIT;
	Bdfp4__PageRef rf = BDFP4__PAGE_REF__INIT;
	Bdfp4__SlotAssign sa = BDFP4__SLOT_ASSIGN__INIT;
	Bdfp4__SlotRelease sr = BDFP4__SLOT_RELEASE__INIT;
	Bdfp4__RequestRelease rr = BDFP4__REQUEST_RELEASE__INIT;
	Bdfp4__OwnerReclaim orc = BDFP4__OWNER_RECLAIM__INIT;
	Bdfp4__StatsQuery sq = BDFP4__STATS_QUERY__INIT;
	Bdfp4__RequestsQuery rq = BDFP4__REQUESTS_QUERY__INIT;
	int32_t pages[16];
	size_t n_pages = 0;
	uint8_t frame[512];
	uint8_t op, id, owner, arg;

	if (n < 4)
		return;
	op = b[0] % 12;
	id = b[1] % (N_REQ + 1); /* 0 is invalid on purpose */
	owner = b[2] % 3;
	arg = b[3];
	for (size_t i = 4; i < n && n_pages < 16; i++)
		pages[n_pages++] = (int32_t)(b[i] % (N_PAGES + 2)) - 1; /* -1 and N_PAGES too */
	switch (op) {
	case 0: pa.request_id = id; pa.owner = owner; pa.n = arg % (PPR + 2);
		req.op_case = BDFP4__POOL_REQUEST__OP_PAGE_ALLOC; req.page_alloc = &pa; break;
	case 1: pr.request_id = id; pr.owner = owner;
		req.op_case = BDFP4__POOL_REQUEST__OP_PAGE_RESERVE; req.page_reserve = &pr; break;
	case 2: pc.request_id = id; pc.page = (int32_t)(arg % (N_PAGES + 2)) - 1;
		req.op_case = BDFP4__POOL_REQUEST__OP_PAGE_COMMIT; req.page_commit = &pc; break;
	case 3: pf.request_id = id; pf.pages = pages; pf.n_pages = n_pages;
		req.op_case = BDFP4__POOL_REQUEST__OP_PAGE_FREE; req.page_free = &pf; break;
	case 4: rf.request_id = id; rf.owner = owner; rf.pages = pages; rf.n_pages = n_pages;
		req.op_case = BDFP4__POOL_REQUEST__OP_PAGE_REF; req.page_ref = &rf; break;
	case 5: sa.request_id = id; sa.owner = owner;
		req.op_case = BDFP4__POOL_REQUEST__OP_SLOT_ASSIGN; req.slot_assign = &sa; break;
	case 6: sr.request_id = id; sr.slot = (int32_t)(arg % (N_SLOTS + 2)) - 1;
		req.op_case = BDFP4__POOL_REQUEST__OP_SLOT_RELEASE; req.slot_release = &sr; break;
	case 7: rr.request_id = id;
		req.op_case = BDFP4__POOL_REQUEST__OP_REQUEST_RELEASE; req.request_release = &rr;
		break;
	case 8: orc.owner = owner;
		req.op_case = BDFP4__POOL_REQUEST__OP_OWNER_RECLAIM; req.owner_reclaim = &orc;
		break;
	case 9: sq.top = arg;
		req.op_case = BDFP4__POOL_REQUEST__OP_STATS; req.stats = &sq; break;
	case 10: req.op_case = BDFP4__POOL_REQUEST__OP_REQUESTS; req.requests = &rq; break;
	default: break; /* nothing set: an unknown type */
	}
	if (bdfp4__pool_request__get_packed_size(&req) > sizeof(frame))
		return;
	handle(h, frame, bdfp4__pool_request__pack(&req, frame));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct bd_kvpool_alloc *a;
	struct bd_kvpool_handler h;
	struct bd_kvpool_counts c;
	size_t i = 0;

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
	for (uint64_t id = 1; id <= N_REQ; id++)
		bd_kvpool_request_release(a, id, NULL);
	bd_kvpool_alloc_counts(a, &c);
	if (c.pages_free != N_PAGES || c.slots_free != N_SLOTS || c.requests != 0)
		abort();
	bd_kvpool_alloc_free(a);
	return 0;
}
