/* kvpool.h — what kvpoold is made of, behind its main: the allocator (alloc.c), the message
 * handler of the allocation socket (handler.c), the attach request's check (attach.c), the
 * arena sizing (plan.c), the KV event batches (events.c) and the memory
 * backends (mem_cpu.c, mem_cuda.c). None of it does I/O or logs, so the unit tests and the
 * fuzzer drive it directly.
 *
 * Allocator model: pages are FREE, RESERVED (the next page of one request, before
 * promotion), USED, or IDLE (in the prefix index, held by no request: free capacity that an
 * allocation evicts, "prefix caching" below); a USED page may be held by several requests
 * (refcount = holders). A
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
#include <string.h>
#include <sys/types.h>

#include "quant/bd_layout.h"
#include "pool/bd_pool_client.h"

/* ---- bytes of a saved state (alloc.c, replay.c, state.c) ------------------------------------ */

/* A cursor over len bytes: writing at w or reading at r, from off. A put or get past the end
 * clears ok and does nothing, so a sequence of them is checked once at its end. */
struct bd_kvpool_cur {
	uint8_t *w;
	const uint8_t *r;
	size_t len, off;
	bool ok;
};

static inline void bd_kvpool_put(struct bd_kvpool_cur *c, const void *x, size_t n)
{
	if (!c->ok || n > c->len - c->off) {
		c->ok = false;
		return;
	}
	if (!n)
		return; /* x may be NULL (a record without pages) */
	memcpy(c->w + c->off, x, n);
	c->off += n;
}

static inline bool bd_kvpool_get(struct bd_kvpool_cur *c, void *x, size_t n)
{
	if (!c->ok || n > c->len - c->off) {
		c->ok = false;
		return false;
	}
	if (!n)
		return true;
	memcpy(x, c->r + c->off, n);
	c->off += n;
	return true;
}

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

/* What one owner may hold at once, the same for every owner; 0 in a field: no limit (the
 * pool's own size bounds it). A call that would take an owner past a limit fails with
 * POOL_ERR_QUOTA, whatever is free: one owner cannot take what the others need. */
struct bd_kvpool_quota {
	size_t pages;    /* page references (reserved pages included) over its requests */
	size_t slots;
	size_t requests; /* request records */
};

/* Sets the per-owner limits (NULL: none); records already held above them stay. */
void bd_kvpool_alloc_set_quota(struct bd_kvpool_alloc *a, const struct bd_kvpool_quota *q);

/* Called with each page (slot false) and slot (slot true) id at the moment it becomes free
 * (the pool consistent, the id on its free stack), before the operation returns, so the memory can be cleared before another owner gets it
 * (pages and slots change owner only through the free stacks). fn NULL: nobody is told. */
typedef void (*bd_kvpool_scrub_fn)(void *ctx, bool slot, int32_t id);
void bd_kvpool_alloc_set_scrub(struct bd_kvpool_alloc *a, bd_kvpool_scrub_fn fn, void *ctx);

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

/* ---- prefix caching: promoted pages shared by the hash of the tokens they hold ---------------
 *
 * A promoted page (USED, held by the request that filled it) may be indexed under a hash the
 * router computed (non-zero; chained over the page's tokens, the previous page's hash and the
 * KV identity, lib/pool/prefix.c). A later request takes references to the leading indexed pages
 * of its prompt (prefix_match); an indexed page whose last reference goes is IDLE: kept, and
 * counted as free capacity (bd_kvpool_counts.pages_free); an allocation that finds the free
 * stack short evicts the least recently released idle pages (scrubbed, as any freed page).
 * Indexed pages are immutable: nothing writes a USED page. */

enum bd_kvpool_cache_event { BD_KVPOOL_CACHE_STORED = 1, BD_KVPOOL_CACHE_REMOVED, BD_KVPOOL_CACHE_CLEARED };

/* Told of each page indexed (STORED) or evicted (REMOVED) under hash, and of a clear of the
 * whole index (CLEARED, hash 0, page -1), as it happens inside the operation. */
typedef void (*bd_kvpool_cache_fn)(void *ctx, enum bd_kvpool_cache_event ev, uint64_t hash,
				   int32_t page);
void bd_kvpool_alloc_set_cache_hook(struct bd_kvpool_alloc *a, bd_kvpool_cache_fn fn, void *ctx);

/* Indexes pages[i] (held by req, promoted: USED) under hashes[i] (≠ 0), i < n ≤ max pages per
 * request. A page already indexed, or a hash another page is indexed under, is left as it is
 * (the first page of a prefix wins; the request's own page stays private). All checked before
 * any change: -POOL_ERR_UNKNOWN_REQUEST, _RANGE (n, a page id), _INVALID (hash 0, a page or
 * hash twice), _NOT_HELD, _STATE (a reserved page). *ret_stored: pages indexed by this call. */
int bd_kvpool_prefix_store(struct bd_kvpool_alloc *a, uint64_t req, const int32_t *pages,
			   const uint64_t *hashes, size_t n, uint64_t *ret_stored);

/* The longest leading run hashes[0..k) that is indexed: req (created under owner when new)
 * takes a reference to each of those pages (an idle one becomes USED again), ret_pages[0..k)
 * in that order, *ret_n = k (0 is not an error: nothing changes). Errors as PageRef's (range,
 * owner, the request's page limit, quota: nothing changes). Counts n queries and k hits. */
int bd_kvpool_prefix_match(struct bd_kvpool_alloc *a, uint64_t req, uint64_t owner,
			   const uint64_t *hashes, size_t n, int32_t *ret_pages, size_t *ret_n);

/* Empties the index: idle pages are freed (scrubbed), held ones stay with their holders and
 * are freed by the last. *ret_dropped: pages that left the index. */
int bd_kvpool_prefix_clear(struct bd_kvpool_alloc *a, uint64_t *ret_dropped);

struct bd_kvpool_prefix_counts {
	size_t cached, idle;          /* indexed pages; of which no request holds */
	uint64_t queries, hits;       /* pages asked for by prefix_match, and found */
	uint64_t stored, evictions;   /* pages indexed, idle pages evicted (since start) */
};
void bd_kvpool_prefix_counts(const struct bd_kvpool_alloc *a,
			     struct bd_kvpool_prefix_counts *ret);

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

/* The owner of request req into *ret_owner. Returns 0, or -(BD_POOL_ERR_UNKNOWN_REQUEST). */
int bd_kvpool_alloc_owner_of(const struct bd_kvpool_alloc *a, uint64_t req, uint64_t *ret_owner);

/* The pages held by request req (sorted) into ret (cap entries). Returns their total number, or
 * -(BD_POOL_ERR_UNKNOWN_REQUEST). */
long bd_kvpool_alloc_pages_of(const struct bd_kvpool_alloc *a, uint64_t req, int32_t *ret,
			      size_t cap);

/* Checks every invariant (refcounts = holders, free list = pages with no holder, states,
 * slots). Returns 0, or -EFAULT with the first violation in bd_kvpool_alloc_error(). */
int bd_kvpool_alloc_check(struct bd_kvpool_alloc *a);

/* The number of operations that changed the pool since it was made (or loaded): the daemon
 * saves its state when this moves. */
uint64_t bd_kvpool_alloc_changes(const struct bd_kvpool_alloc *a);

/* The most bytes bd_kvpool_alloc_save writes for a pool of this geometry (every record holding
 * max_pages_per_request pages); 0 when that overflows size_t. */
size_t bd_kvpool_alloc_save_max(size_t n_pages, size_t n_slots, uint32_t max_pages_per_request,
				size_t max_requests);

/* Writes the whole pool into buf (cap bytes): the free page stack in its order, the free slot
 * stack, and every request record (id, owner, reserved page, slot, page references); page
 * states, refcounts and slot holders follow from those. Native byte order (the record never
 * leaves the machine). Returns the bytes written, or -ENOSPC when cap is short. */
ssize_t bd_kvpool_alloc_save(const struct bd_kvpool_alloc *a, void *buf, size_t cap);

/* Makes a (a pool of the geometry the bytes were saved with, whatever it holds) exactly the pool
 * saved at the start of buf[len]: every id range-checked, every reference and the free stacks
 * checked against each other (bd_kvpool_alloc_check), so bytes that are not a saved pool of
 * this geometry are refused rather than adopted. Returns the bytes read; on -EBADMSG (the
 * reason in bd_kvpool_alloc_error) or -ENOMEM a is left empty (all pages and slots free). */
ssize_t bd_kvpool_alloc_load(struct bd_kvpool_alloc *a, const void *buf, size_t len);

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
	const uint8_t *arena_id; /* 16 bytes, may be NULL */
};

/* ---- repeats of a call whose reply was lost (kvpool.proto's client and call) -------------- */

struct bd_kvpool_replay;

/* A table of the last pool-changing call of up to n_clients clients (least recently used ones
 * make room), with replies of up to reply_max bytes. Returns 0 and *ret, -EINVAL, -ENOMEM. */
int bd_kvpool_replay_new(size_t n_clients, size_t reply_max, struct bd_kvpool_replay **ret);
void bd_kvpool_replay_free(struct bd_kvpool_replay *r);

/* The largest reply a pool-changing call of a pool with max_pages_per_request gets (a PageAlloc
 * of that many pages), for bd_kvpool_replay_new's reply_max. */
size_t bd_kvpool_replay_reply_max(uint32_t max_pages_per_request);

/* What (client, call) is to the table: 1, a repeat of the client's last call, whose reply is at
 * *ret_reply (*ret_len bytes, valid until the next change of the table); -ESTALE, older than
 * that call; 0, a new call (or client). */
int bd_kvpool_replay_find(const struct bd_kvpool_replay *r, uint64_t client, uint64_t call,
			  const uint8_t **ret_reply, size_t *ret_len);

/* Records reply[len] as the answer to the client's call (it changed the pool). Returns 0, or
 * -EMSGSIZE for a reply over reply_max (not recorded). */
int bd_kvpool_replay_put(struct bd_kvpool_replay *r, uint64_t client, uint64_t call,
			 const uint8_t *reply, size_t len);

/* Changes of the table since it was made (the daemon saves its state when this moves). */
uint64_t bd_kvpool_replay_changes(const struct bd_kvpool_replay *r);

/* The table as bytes, like bd_kvpool_alloc_save/_load: the most bytes it takes, the bytes
 * written (-ENOSPC), and a load that replaces the table's contents with the saved ones
 * (returns the bytes read, or -EBADMSG for bytes that are not a saved table of this size;
 * the table is then empty). */
size_t bd_kvpool_replay_save_max(size_t n_clients, size_t reply_max);
ssize_t bd_kvpool_replay_save(const struct bd_kvpool_replay *r, void *buf, size_t cap);
ssize_t bd_kvpool_replay_load(struct bd_kvpool_replay *r, const void *buf, size_t len);

#define BD_KVPOOL_MAX_OWNERS 64 /* owners bound to a uid at once (bd_kvpool_handler) */

/* The worker group the router registered last (kvpool.proto GroupRegister): an attach of rank r
 * needs tokens[r], and each token opens one attachment (spent_by: the pid that used it, 0 while
 * unused). epoch 0: none registered, every attach is refused. */
struct bd_kvpool_group {
	uint64_t epoch, owner;
	uint32_t tp;
	uint8_t tokens[BD_POOL_MAX_TP][BD_POOL_TOKEN_BYTES];
	int32_t spent_by[BD_POOL_MAX_TP];
	uint64_t refused; /* attaches refused for their token */
};

struct bd_kvpool_handler {
	struct bd_kvpool_alloc *alloc;
	struct bd_kvpool_replay *replay;   /* NULL: every frame is applied, repeats too */
	const struct bd_kvpool_info *info; /* may be NULL (tests) */
	size_t max_frame;                  /* larger frames get POOL_ERR_OVERSIZE */
	uint32_t default_top;              /* largest holders in stats when the query says 0 */
	uint64_t served, errors;           /* counters, updated by bd_kvpool_handle */

	/* Who sends the frame being handled (the daemon sets these before each call, from the
	 * connection's SO_PEERCRED): with peer_known, an owner belongs to the uid of the first
	 * call that names it, and a call naming it (or a request of it) from another uid gets
	 * POOL_ERR_OWNER, unless peer_admin (root, kvpoold's own uid: the operator, who acts
	 * for any owner and binds the owners it names like anyone). Without
	 * peer_known (tests, a tcp:// endpoint) owners are not bound. */
	bool peer_known, peer_admin;
	uint32_t peer_uid;
	struct { uint64_t owner; uint32_t uid; } owners[BD_KVPOOL_MAX_OWNERS];
	size_t n_owners;

	/* GroupRegister: tp is the pool's (a group of another size is refused; 0: not checked);
	 * with peer_known only peer_admin may register */
	uint32_t tp;
	struct bd_kvpool_group group;

	/* The PrefixStore being applied, for the allocator's cache hook (the KV event stream
	 * publishes each stored page with its tokens): its pages and hashes [store_n], tokens
	 * [store_n_tokens] (128 per page, in page order) and parent; store_n is 0 outside it. */
	const int32_t *store_pages, *store_tokens;
	const uint64_t *store_hashes;
	size_t store_n, store_n_tokens;
	uint64_t store_parent;
};

/* An attach request, decoded (kvpool.proto AttachRequest). token_len is the length sent (the
 * first BD_POOL_TOKEN_BYTES of it in token). */
struct bd_kvpool_attach_req {
	int32_t rank;
	bool geometry_only;
	uint8_t token[BD_POOL_TOKEN_BYTES];
	size_t token_len;
};

/* Decodes and checks one attach request frame buf[n] for a pool of tp ranks (attach.c).
 * Returns BD_POOL_OK with *ret, or the code the refusal carries: BD_POOL_ERR_MALFORMED (not an
 * AttachRequest), BD_POOL_ERR_VERSION (another protocol version), BD_POOL_ERR_NO_DEVICE (a rank
 * outside 0..tp-1), with the reason in err[cap] ("" on success). *ret is written only on
 * success. The token is checked apart (bd_kvpool_attach_token). */
int bd_kvpool_attach_parse(const uint8_t *buf, size_t n, int tp, struct bd_kvpool_attach_req *ret,
			   char *err, size_t cap);

/* Whether req's token opens an attachment of its rank in group g (attach.c): the rank's token
 * of the registered epoch, not used before. Returns BD_POOL_OK, the token now spent by pid; or
 * BD_POOL_ERR_TOKEN (no group registered, no token, another token, one already used), counted
 * in g->refused, with the reason in err[cap]. Compares in time independent of the bytes. */
int bd_kvpool_attach_token(struct bd_kvpool_group *g, const struct bd_kvpool_attach_req *req,
			   int32_t pid, char *err, size_t cap);

/* Registers the group of epoch (≠ 0) under owner in h (kvpool.proto GroupRegister): n_tokens
 * bytes of tokens, BD_POOL_TOKEN_BYTES per rank, for h->tp ranks. The same registration as the
 * current one changes nothing (used tokens stay used); another replaces it. Returns 0, or
 * -BD_POOL_ERR_INVALID / -BD_POOL_ERR_DENIED with the reason in err[cap], h->group unchanged. */
int bd_kvpool_group_register(struct bd_kvpool_handler *h, uint64_t owner, uint64_t epoch,
			     const uint8_t *tokens, size_t n_tokens, char *err, size_t cap);

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

/* The bytes of chunk i (0..n_chunks-1) of the plan: chunk_bytes, the last one last_chunk_bytes. */
size_t bd_kvpool_plan_chunk(const struct bd_kvpool_plan *p, size_t i);

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
	/* the arena of an earlier run from its chunk fds (fds[i] for chunk i of the plan, kept
	 * by the fd store): each checked to be such a chunk (cpu: a memfd of the chunk's size,
	 * sealed against shrinking and growing; cuda: a VMM allocation of this device, imported),
	 * then owned by ret. All or none: on failure the fds stay the caller's, err says why. */
	int (*arena_adopt)(int device, const struct bd_kvpool_plan *plan, const int *fds,
			   struct bd_kvpool_arena *ret, char *err, size_t errlen);
	/* releases the chunks (fds closed); accepts an arena already destroyed */
	void (*arena_destroy)(struct bd_kvpool_arena *a);
};

/* The table of the backend whose operations are named PREFIX_supported, PREFIX_device_memory,
 * ... in its file (mem_cpu.c, mem_cuda.c). */
#define BD_KVPOOL_MEM_OPS(prefix, name_)                                                       \
	{                                                                                       \
		.name = name_, .supported = prefix##_supported,                                 \
		.device_memory = prefix##_device_memory, .granularity = prefix##_granularity,   \
		.arena_create = prefix##_arena_create, .arena_adopt = prefix##_arena_adopt,     \
		.arena_destroy = prefix##_arena_destroy,                                        \
	}

extern const struct bd_kvpool_mem_ops bd_kvpool_mem_cpu;

/* ---- scrubbing (scrub.c): freed pages and slots zeroed in kvpoold --------------------------- */

struct bd_kvpool_scrub;

/* Maps every chunk of arenas[0..n_arenas) (the CPU backend's memfds: plain mmap) for
 * bd_kvpool_scrub_hook, which clears plan's spans (bd_pool_scrub_span); arenas must outlive
 * the result. Returns 0 and *ret; -EINVAL; -ENOMEM; the -errno of mmap (err says which chunk). */
int bd_kvpool_scrub_new(const struct bd_kvpool_plan *plan, const struct bd_kvpool_arena *arenas,
			int n_arenas, struct bd_kvpool_scrub **ret, char *err, size_t errlen);
/* Unmaps. NULL is fine. */
void bd_kvpool_scrub_free(struct bd_kvpool_scrub *s);

/* The allocator's bd_kvpool_scrub_fn (ctx: the scrub): zeroes page id of every layer (plan's
 * pages_offset + l·layer_stride + id·page_bytes, page_bytes each) or slot id (slots_offset +
 * id·slot_bytes) in every rank's arena. */
void bd_kvpool_scrub_hook(void *ctx, bool slot, int32_t id);

/* The bytes zeroed so far. */
uint64_t bd_kvpool_scrub_bytes(const struct bd_kvpool_scrub *s);
extern const struct bd_kvpool_mem_ops bd_kvpool_mem_cuda;

/* The backend called name ("cpu", "cuda"), or NULL. */
const struct bd_kvpool_mem_ops *bd_kvpool_mem_find(const char *name);

/* ---- KV events (events.c): the prefix index's changes in vLLM's format --------------------- *
 *
 * kvpoold publishes, on a ZeroMQ PUB socket ([pool] kv_events), the batches vLLM's
 * ZmqEventPublisher sends: frames [topic, sequence number (8 bytes, big-endian, from 0),
 * msgpack payload], the payload as events.c's comment spells out; a ROUTER socket
 * (kv_events_replay) answers a request [""][start (8 bytes, big-endian)] with every kept batch
 * from start on, each as [""][seq][payload], then [""][-1 as 8 bytes][""]. A bdfp4 page is one
 * vLLM block of 128 tokens; the block hash is the router's page hash (lib/pool/bd_prefix.h). */

struct bd_kvpool_events;

/* A publisher's books keeping the last replay_batches batches (≥ 1; 0 is 1); medium names the
 * memory in the events ("GPU", "CPU"; < 16 bytes). Returns 0, -EINVAL, -ENOMEM. */
int bd_kvpool_events_new(size_t replay_batches, const char *medium,
			 struct bd_kvpool_events **ret);
void bd_kvpool_events_free(struct bd_kvpool_events *e);

/* The handler whose PrefixStore context (bd_kvpool_handler.store_*) gives a stored page its
 * tokens and parent. */
void bd_kvpool_events_set_handler(struct bd_kvpool_events *e, const struct bd_kvpool_handler *h);

/* The allocator's bd_kvpool_cache_fn (ctx: the events): the change joins the pending batch. */
void bd_kvpool_events_hook(void *ctx, enum bd_kvpool_cache_event ev, uint64_t hash,
			   int32_t page);

/* The pending changes as the next batch (timestamp ts, seconds since the epoch): returns 1
 * with its sequence number and payload (valid until this batch leaves the replay ring),
 * 0 when nothing is pending, -ENOMEM (the changes are lost; the next batch is an
 * AllBlocksCleared, so consumers do not keep a view the pool no longer has). */
int bd_kvpool_events_batch(struct bd_kvpool_events *e, double ts, uint64_t *ret_seq,
			   const uint8_t **ret_payload, size_t *ret_len);

/* Calls fn for each kept batch with sequence number ≥ start, oldest first; returns how many. */
size_t bd_kvpool_events_replay(const struct bd_kvpool_events *e, uint64_t start,
			       void (*fn)(void *ctx, uint64_t seq, const uint8_t *p, size_t len),
			       void *ctx);

/* ---- the state record (state.c): what a restarted kvpoold adopts ---------------------------- *
 *
 * The allocation state lives in a memfd the daemon keeps in systemd's fd store beside its arena
 * chunks. The memfd has a fixed size, chosen at start for the largest state of the geometry, and
 * is sealed against shrinking and growing; it holds a header and two record areas. Each change is
 * written whole into the area not holding the latest record, and published by a generation
 * number stored last, so a kill at any point leaves the latest complete record readable: the
 * area with the higher generation is the latest, and it must pass its checksum (a corrupted latest
 * record is refused, never replaced by the older one, which the router may already have
 * outgrown).
 *
 * Layout (native byte order): struct bd_kvpool_state_head at 0; at each of its two area
 * offsets a struct bd_kvpool_state_area, then the record: the geometry (struct
 * bd_kvpool_state_geo), the replay table, the allocator. */

#define BD_KVPOOL_STATE_MAGIC "bdfp4kvs"
#define BD_KVPOOL_STATE_VERSION 2 /* 2: the allocator record ends with the prefix index */
#define BD_KVPOOL_STATE_BOM 0x01020304u
#define BD_KVPOOL_STATE_FDNAME "state"

struct bd_kvpool_state_head {
	char magic[8];         /* BD_KVPOOL_STATE_MAGIC, no NUL */
	uint32_t version, bom; /* BD_KVPOOL_STATE_VERSION, BD_KVPOOL_STATE_BOM */
	uint64_t area_cap;     /* record bytes each area holds */
	uint64_t area_off[2];  /* where the areas start in the memfd */
};

struct bd_kvpool_state_area {
	uint64_t generation; /* 0: never written; the higher of the two is the latest record */
	uint64_t len;        /* bytes of the record that follows */
	uint64_t sum;        /* checksum of len and the record */
	uint64_t pad;
};

_Static_assert(sizeof(struct bd_kvpool_state_head) == 40, "part of the record format");
_Static_assert(sizeof(struct bd_kvpool_state_area) == 32, "part of the record format");

/* What the arenas and the record were made for; a record whose geometry differs from the
 * configuration's in any field but arena_id is refused. Fixed-size fields only (it is copied as
 * bytes). */
struct bd_kvpool_state_geo {
	char backend[8], kv_config[32];
	uint32_t tp, page_format, n_layers, n_kv_heads, head_dim, d_rope;
	uint32_t max_seq_len, max_pages_per_request;
	uint64_t n_pages, n_slots, max_requests, page_bytes, slot_bytes;
	uint64_t pages_offset, slots_offset, arena_bytes, n_chunks, chunk_bytes, last_chunk_bytes;
	uint64_t replay_clients, replay_reply_max;
	uint8_t arena_id[16];
};

struct bd_kvpool_state;

/* A new state memfd for records of up to record_max bytes (sized, sealed, mapped; no record
 * yet). Returns 0 and *ret, or -errno with err saying why. */
int bd_kvpool_state_create(size_t record_max, struct bd_kvpool_state **ret, char *err,
			   size_t errlen);

/* The state memfd of an earlier run (fd, which becomes the state's on success): the header
 * checked (magic, version, byte order, areas inside the file, the seals) and mapped. Returns 0;
 * -EPROTONOSUPPORT for a version this build does not know; -EBADMSG for anything else that is
 * not such a memfd (too short, bad header, not sealed); err says why. */
int bd_kvpool_state_open(int fd, struct bd_kvpool_state **ret, char *err, size_t errlen);

/* Unmaps and closes. NULL is fine. */
void bd_kvpool_state_free(struct bd_kvpool_state *s);

/* The memfd (owned by s). */
int bd_kvpool_state_fd(const struct bd_kvpool_state *s);

/* The bytes a record of this geometry takes at most (0 on overflow). */
size_t bd_kvpool_state_record_max(const struct bd_kvpool_state_geo *geo);

/* Writes geo, the replay table and the allocator as the next record and publishes it. Returns
 * 0, or -ENOSPC when it does not fit the areas (the latest record stays). */
int bd_kvpool_state_save(struct bd_kvpool_state *s, const struct bd_kvpool_state_geo *geo,
			 const struct bd_kvpool_replay *replay, const struct bd_kvpool_alloc *a);

/* Reads the latest record into replay and a, both fresh, of the configured geometry *want.
 * Returns 0 and the record's arena id in ret_arena_id; -ENODATA when none was written; -EBADMSG
 * when it is corrupted or truncated (checksum, lengths, the allocator's or the table's own
 * checks); -ESTALE when its geometry is not *want (err names the first field that differs, with
 * both values); -ENOSPC when the areas are too small for *want's records; -ENOMEM. On failure
 * replay and a are left empty and err says why. */
int bd_kvpool_state_load(struct bd_kvpool_state *s, const struct bd_kvpool_state_geo *want,
			 struct bd_kvpool_replay *replay, struct bd_kvpool_alloc *a,
			 uint8_t ret_arena_id[16], char *err, size_t errlen);

#endif
