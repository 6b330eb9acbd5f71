/* kvpool.h — what kvpoold is made of, behind its main: the allocator (alloc.c), the message
 * handler of the allocation socket (handler.c), the arena sizing (plan.c) and the memory
 * backends (mem_cpu.c, mem_cuda.c). None of it does I/O or logs, so the unit tests and the
 * fuzzer drive it directly.
 *
 * Allocator model: pages are FREE, RESERVED (the next page of one request, before
 * promotion) or USED; a USED page may be held by several requests (refcount = holders). A
 * request record (id ≠ 0, owner = router session id) holds page references, at most one
 * reservation and at most one BF16 slot. Every operation checks everything before it changes
 * anything: on error the pool is exactly as before.
 * Operations return 0 or -(enum bd_pool_error) (bd_pool_client.h), with a one-line reason readable
 * through bd_kvpool_alloc_error().
 */
#ifndef BD_KVPOOL_H
#define BD_KVPOOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "quant/bd_layout.h"
#include "pool/bd_pool_client.h"

/* ---- allocator --------------------------------------------------------------------------- */

struct bd_kvpool_alloc;

/* A pool of n_pages pages (1..INT32_MAX) and n_slots slots (0..INT32_MAX); a request may hold
 * at most max_pages_per_request page references (≥ 1); at most max_requests records (≥ 1).
 * Returns 0 and *ret, -EINVAL, -ENOMEM. */
int bd_kvpool_alloc_new(size_t n_pages, size_t n_slots, uint32_t max_pages_per_request,
			size_t max_requests, struct bd_kvpool_alloc **ret);
void bd_kvpool_alloc_free(struct bd_kvpool_alloc *a);

/* The reason of the last failed operation ("" after a success). */
const char *bd_kvpool_alloc_error(const struct bd_kvpool_alloc *a);

/* n new USED pages for the request (created under owner when unknown): all or none, ids in
 * ret_pages[0..n). */
int bd_kvpool_page_alloc(struct bd_kvpool_alloc *a, uint64_t req, uint64_t owner, uint32_t n,
			 int32_t *ret_pages);
/* One RESERVED page for the request; at most one outstanding. */
int bd_kvpool_page_reserve(struct bd_kvpool_alloc *a, uint64_t req, uint64_t owner,
			   int32_t *ret_page);
/* The request's reserved page becomes USED. */
int bd_kvpool_page_commit(struct bd_kvpool_alloc *a, uint64_t req, int32_t page);
/* Drops the request's reference to each page (all or none); *ret_freed: pages now FREE. */
int bd_kvpool_page_free(struct bd_kvpool_alloc *a, uint64_t req, const int32_t *pages, size_t n,
			uint64_t *ret_freed);
/* Adds a reference from the request to each USED page of another request (all or none). */
int bd_kvpool_page_ref(struct bd_kvpool_alloc *a, uint64_t req, uint64_t owner,
		       const int32_t *pages, size_t n);
int bd_kvpool_slot_assign(struct bd_kvpool_alloc *a, uint64_t req, uint64_t owner,
			  int32_t *ret_slot);
int bd_kvpool_slot_release(struct bd_kvpool_alloc *a, uint64_t req, int32_t slot);
/* Every page reference and the slot of the request, then the record. */
int bd_kvpool_request_release(struct bd_kvpool_alloc *a, uint64_t req, uint64_t *ret_freed);
/* bd_kvpool_request_release of every request of owner (none is not an error). */
int bd_kvpool_owner_reclaim(struct bd_kvpool_alloc *a, uint64_t owner, uint64_t *ret_requests,
			    uint64_t *ret_freed);

struct bd_kvpool_counts {
	size_t pages_total, pages_free, pages_used, pages_reserved, pages_shared;
	size_t slots_total, slots_free;
	size_t requests, requests_holding;
	uint32_t max_pages_per_request;
};

void bd_kvpool_alloc_counts(const struct bd_kvpool_alloc *a, struct bd_kvpool_counts *ret);

/* Up to cap request records into ret: by pages held, largest first (ties by id), when
 * largest_first, else by request id. Returns the number written. */
size_t bd_kvpool_alloc_holders(const struct bd_kvpool_alloc *a, bool largest_first,
			       struct bd_pool_holder *ret, size_t cap);

/* The pages held by request req (sorted) into ret (cap entries). Returns their total number, or
 * -(BD_POOL_ERR_UNKNOWN_REQUEST). */
long bd_kvpool_alloc_pages_of(const struct bd_kvpool_alloc *a, uint64_t req, int32_t *ret,
			      size_t cap);

/* Checks every invariant (refcounts = holders, free list = pages with no holder, states,
 * slots). Returns 0, or -EFAULT with the first violation in bd_kvpool_alloc_error(). */
int bd_kvpool_alloc_check(struct bd_kvpool_alloc *a);

/* ---- allocation protocol ------------------------------------------------------------------- */

/* What the stats reply says besides the allocator's counts; the daemon keeps it current. */
struct bd_kvpool_info {
	const char *backend, *kv_config, *page_format;
	uint32_t tp, max_seq_len;
	uint64_t page_bytes, slot_bytes;   /* one rank */
	const struct bd_pool_device *devices;
	size_t n_devices;
	const struct bd_pool_attachment *attachments;
	size_t n_attachments;
};

struct bd_kvpool_handler {
	struct bd_kvpool_alloc *alloc;
	const struct bd_kvpool_info *info; /* may be NULL (tests) */
	size_t max_frame;                  /* larger frames get POOL_ERR_OVERSIZE */
	uint32_t default_top;              /* largest holders in stats when the query says 0 */
	uint64_t served, errors;           /* counters, updated by bd_kvpool_handle */
};

/* Answers one PoolRequest frame: decodes, validates, applies, encodes the PoolReply into
 * *ret_reply (malloc'd, *ret_len bytes). Every frame, however broken, gets a reply. Returns 0,
 * or -ENOMEM (no reply; the pool may have changed only if the reply, not the operation,
 * failed to allocate). */
int bd_kvpool_handle(struct bd_kvpool_handler *h, const uint8_t *frame, size_t len,
		     uint8_t **ret_reply, size_t *ret_len);

/* An error reply with code (enum bd_pool_error) and text, for failures found before the
 * handler (a multi-part message). Counts it as served and as an error. Returns 0 or -ENOMEM. */
int bd_kvpool_error_reply(struct bd_kvpool_handler *h, int code, const char *text,
			  uint8_t **ret_reply, size_t *ret_len);

/* The short name of a page format ("nvfp4", "mxfp4", "nvfp4-ch", "fp8", "bf16"). */
const char *bd_kvpool_format_name(enum bd_page_format fmt);

/* ---- sizing -------------------------------------------------------------------------------- */

struct bd_kvpool_params {
	enum bd_page_format fmt;
	int n_layers, n_kv_heads, d, d_rope; /* n_kv_heads: the heads one rank holds */
	uint32_t max_seq_len;                /* tokens of the longest request */
	size_t n_slots;                      /* ≥ 1 */
	uint64_t budget_bytes;               /* one device; used when n_pages is 0 */
	size_t n_pages;                      /* 0: as many as the budget holds */
	size_t granularity;                  /* chunk sizes are multiples of it (power of two) */
	size_t chunk_bytes;                  /* largest chunk wanted (rounded up to granularity) */
};

struct bd_kvpool_plan {
	struct bd_layout layout;
	size_t n_pages, n_slots;
	size_t pages_offset, slots_offset; /* bytes into the arena */
	size_t used_bytes;                 /* slots_offset + n_slots · slot_bytes */
	size_t arena_bytes;                /* sum of the chunks */
	size_t n_chunks, chunk_bytes, last_chunk_bytes;
	uint32_t max_pages_per_request;    /* ceil(max_seq_len / 128) */
};

/* The arena of one device: page layout, page count (from the budget or fixed), slot region
 * and chunks. Returns 0; -EINVAL (bad parameters, message in err); -ENOSPC when the budget
 * (or the fixed page count) cannot hold one request of max_seq_len tokens and one slot, with
 * the numbers in err; -EOVERFLOW. */
int bd_kvpool_plan(const struct bd_kvpool_params *p, struct bd_kvpool_plan *ret, char *err,
		   size_t errlen);

/* ---- memory backends ----------------------------------------------------------------------- */

struct bd_kvpool_chunk {
	int fd;          /* memfd or exported POSIX fd, owned by the arena */
	size_t bytes;
	uint64_t handle; /* CUmemGenericAllocationHandle (CUDA) */
};

struct bd_kvpool_arena {
	int device; /* CUDA ordinal, -1 for the CPU backend */
	size_t n_chunks, bytes;
	struct bd_kvpool_chunk chunks[BD_POOL_MAX_CHUNKS];
};

/* One table of operations per backend (STYLE.md 2); chosen once at start by name. */
struct bd_kvpool_mem_ops {
	const char *name;
	/* 0 when n_devices arenas can be made here; else -errno and the reason in err */
	int (*supported)(int n_devices, char *err, size_t errlen);
	/* total memory of the device (CPU: physical memory / n_devices is up to the caller) */
	int (*device_memory)(int device, uint64_t *ret_bytes, char *err, size_t errlen);
	/* allocation granularity, a power of two */
	int (*granularity)(int device, size_t *ret_bytes, char *err, size_t errlen);
	/* the chunks of one arena (sizes multiples of the granularity); all or none */
	int (*arena_create)(int device, const struct bd_kvpool_plan *plan,
			    struct bd_kvpool_arena *ret, char *err, size_t errlen);
	/* releases the chunks (fds closed); accepts an arena already destroyed */
	void (*arena_destroy)(struct bd_kvpool_arena *a);
};

extern const struct bd_kvpool_mem_ops bd_kvpool_mem_cpu;
extern const struct bd_kvpool_mem_ops bd_kvpool_mem_cuda;

/* The backend called name ("cpu", "cuda"), or NULL. */
const struct bd_kvpool_mem_ops *bd_kvpool_mem_find(const char *name);

#endif
