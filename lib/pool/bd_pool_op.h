/* bd_pool_op.h — kvpoold's allocation requests as C values and their PoolRequest frames
 * (proto/kvpool.proto), apart from any connection: the pool client sends them, the fuzzer and
 * the handler's tests feed them to kvpoold's handler directly.
 */
#ifndef BD_POOL_OP_H
#define BD_POOL_OP_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The operations of a PoolRequest, numbered as the members of kvpool.proto's oneof `op`. */
enum bd_pool_op_kind {
	BD_POOL_OP_NONE = 0, /* no member set: the daemon answers POOL_ERR_UNKNOWN_TYPE */
	BD_POOL_OP_PAGE_ALLOC = 1,
	BD_POOL_OP_PAGE_RESERVE = 2,
	BD_POOL_OP_PAGE_COMMIT = 3,
	BD_POOL_OP_PAGE_FREE = 4,
	BD_POOL_OP_PAGE_REF = 5,
	BD_POOL_OP_SLOT_ASSIGN = 6,
	BD_POOL_OP_SLOT_RELEASE = 7,
	BD_POOL_OP_REQUEST_RELEASE = 8,
	BD_POOL_OP_OWNER_RECLAIM = 9,
	BD_POOL_OP_STATS = 10,
	BD_POOL_OP_REQUESTS = 11,
	/* 12, 13: PoolRequest's client and call, not operations */
	BD_POOL_OP_GROUP_REGISTER = 14,
	BD_POOL_OP_PREFIX_STORE = 15,
	BD_POOL_OP_PREFIX_MATCH = 16,
	BD_POOL_OP_PREFIX_CLEAR = 17,
	BD_POOL_OP_COUNT
};

/* One allocation request, the C form of a PoolRequest. A kind sends only the fields its
 * message has (kvpool.proto); the others are ignored:
 *   PAGE_ALLOC     request_id, owner, n (pages)     PAGE_RESERVE   request_id, owner
 *   PAGE_COMMIT    request_id, index (the page)     PAGE_FREE      request_id, pages
 *   PAGE_REF       request_id, owner, pages         SLOT_ASSIGN    request_id, owner
 *   SLOT_RELEASE   request_id, index (the slot)     REQUEST_RELEASE request_id
 *   OWNER_RECLAIM  owner                            STATS          n (largest holders, 0: the
 *   REQUESTS, NONE nothing                                         daemon's default)
 *   GROUP_REGISTER owner, epoch, bytes (the tokens: tp · BD_POOL_TOKEN_BYTES)
 *   PREFIX_STORE   request_id, pages, hashes, tokens (token ids), parent
 *   PREFIX_MATCH   request_id, owner, hashes        PREFIX_CLEAR   nothing
 * Any kind carries client and call, the caller's id and the call's number (kvpool.proto).
 * The allocation calls of bd_pool_client.h build one each; tests and tools that speak the
 * protocol themselves (a fuzzer, an asynchronous probe) pack them with bd_pool_op_pack(). */
struct bd_pool_op {
	enum bd_pool_op_kind kind;
	uint64_t request_id, owner;
	uint32_t n;
	int32_t index;
	const int32_t *pages; /* n_pages page ids, borrowed */
	size_t n_pages;
	uint64_t epoch;
	const uint8_t *bytes; /* n_bytes bytes, borrowed */
	size_t n_bytes;
	const uint64_t *hashes; /* n_hashes page hashes (prefix caching), borrowed */
	size_t n_hashes;
	const int32_t *tokens; /* n_tokens token ids, borrowed */
	size_t n_tokens;
	uint64_t parent;
	uint64_t client, call; /* repeat protection (kvpool.proto); 0: none */
};

/* Packs op as one PoolRequest frame into buf (cap bytes; buf may be NULL when cap is 0) when
 * it fits, like snprintf: returns the frame's length in bytes, and a length above cap means
 * nothing was written (call again with a buffer that large). Returns -EINVAL for a NULL op,
 * an unknown kind, n_pages ids (n_bytes, n_hashes, n_tokens) without their list, -EMSGSIZE for
 * a frame beyond SSIZE_MAX. */
ssize_t bd_pool_op_pack(const struct bd_pool_op *op, void *buf, size_t cap);

#ifdef __cplusplus
}
#endif
#endif
