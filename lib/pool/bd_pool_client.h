/* bd_pool_client.h — the client of kvpoold: attach to the pool's memory, allocate from it.
 *
 * Two connections, two jobs:
 *   - attach (Unix socket, default BD_POOL_DEFAULT_SOCKET): a worker names its TP rank and the
 *     rank's token of the current group epoch (the router registers each epoch's tokens with
 *     bd_pool_group_register and hands each worker its own in the RegisterReply), and gets that
 *     rank's arena as fds (SCM_RIGHTS) with its geometry. A token opens one attachment, and a
 *     rank has one live attachment at a time; bd_pool_query reads the geometry alone, with no
 *     token (what a worker checks before it registers). On the CPU backend the client maps
 *     the chunks back to back with mmap; on the CUDA backend it hands the fds to the caller, who
 *     imports them (cuMemImportFromShareableHandle, cuMemAddressReserve, cuMemMap,
 *     cuMemSetAccess). The daemon drops the attachment when the socket closes.
 *   - allocation (ZeroMQ REQ to the daemon's REP, default BD_POOL_DEFAULT_ENDPOINT): pages, the
 *     reserved next page, slots, shared references, whole-request release and owner reclaim,
 *     stats. Messages are proto/kvpool.proto's; every call is one round trip. A call that gets no
 *     answer leaves no stuck socket behind: the connection's REQ socket is replaced by a fresh
 *     one, and with bd_pool_conn_set_retry() the call is sent again on it (a kvpoold restarting
 *     answers once it is back; one that had applied the call before it died answers the repeat
 *     with the first reply, so nothing is applied twice).
 *
 * Arena of one rank: pages at pages_offset, laid out by bd_layout.h (layer l of page p at
 * pages + l·layer_stride + p·page_bytes, the rank's KV heads only), then n_slots BF16 slots of
 * slot_bytes at slots_offset. Page and slot ids are shared by every rank.
 *
 * Errors: functions return 0 (or a count) on success and -errno on failure. Errors the daemon
 * reports map to: -EBADMSG malformed frame, -EMSGSIZE oversize frame, -EOPNOTSUPP unknown
 * message type, -EINVAL bad argument, -ERANGE count or id out of range, -ENOENT unknown request,
 * -EPERM page or slot held by another request, -EALREADY double free, -ENOSPC pool exhausted,
 * -EACCES owner mismatch or peer denied, -EBUSY wrong state, -ENODEV no such rank, -EPROTO
 * version mismatch, -EISCONN rank attached already, -EDQUOT owner quota, -EKEYREJECTED attach
 * token missing, not the rank's of the current epoch, or used; -ETIMEDOUT when the daemon does not answer in time, -ECONNRESET when its
 * connection closed before the answer (it died). The daemon's code and text of the last error
 * stay readable with bd_pool_conn_error().
 * Handles are not thread-safe: one per thread, or a lock around them.
 */
#ifndef BD_POOL_CLIENT_H
#define BD_POOL_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "quant/bd_layout.h"
#include "pool/bd_pool_op.h"

#ifdef __cplusplus
extern "C" {
#endif

#define BD_POOL_PROTO_VERSION 1
#define BD_POOL_DEFAULT_SOCKET "/run/bdfp4/kvpool.sock"
#define BD_POOL_DEFAULT_ENDPOINT "ipc:///run/bdfp4/kvpool-alloc.sock"
#define BD_POOL_MAX_CHUNKS 64 /* arena chunks of one rank (fds in one packet) */
#define BD_POOL_TOKEN_BYTES 32 /* one rank's attach token (GroupRegister) */
#define BD_POOL_MAX_TP 64      /* ranks of a pool (kvpoold's tp) */
/* The largest allocation frame kvpoold reads: it answers frames up to its max_frame_bytes, and
 * up to this size those over it with POOL_ERR_OVERSIZE; ZeroMQ closes the connection of a peer
 * that sends a larger one (no reply). The client refuses to send one (-EMSGSIZE). */
#define BD_POOL_FRAME_HARD_MAX (16 << 20)

/* The PoolError codes of kvpool.proto, for C callers that do not include the generated code. */
enum bd_pool_error {
	BD_POOL_OK = 0,
	BD_POOL_ERR_MALFORMED = 1,
	BD_POOL_ERR_OVERSIZE = 2,
	BD_POOL_ERR_UNKNOWN_TYPE = 3,
	BD_POOL_ERR_INVALID = 4,
	BD_POOL_ERR_RANGE = 5,
	BD_POOL_ERR_UNKNOWN_REQUEST = 6,
	BD_POOL_ERR_NOT_HELD = 7,
	BD_POOL_ERR_DOUBLE_FREE = 8,
	BD_POOL_ERR_EXHAUSTED = 9,
	BD_POOL_ERR_OWNER = 10,
	BD_POOL_ERR_STATE = 11,
	BD_POOL_ERR_DENIED = 12,
	BD_POOL_ERR_NO_DEVICE = 13,
	BD_POOL_ERR_VERSION = 14,
	BD_POOL_ERR_ATTACHED = 15,
	BD_POOL_ERR_QUOTA = 16,
	BD_POOL_ERR_TOKEN = 17,
	BD_POOL_ERR_COUNT
};

/* The -errno of a PoolError code (table above); -EPROTO for a code this client does not know. */
int bd_pool_errno(int pool_error);

/* ---- attach --------------------------------------------------------------------------------- */

struct bd_pool_geometry {
	char backend[8];     /* "cpu" or "cuda" */
	char kv_config[32];  /* bd_kvcfg name */
	int rank, device, tp;
	uint32_t max_seq_len;
	size_t n_pages, n_slots;
	size_t pages_offset, slots_offset, arena_bytes; /* bytes */
	size_t n_chunks;
	uint64_t chunk_bytes[BD_POOL_MAX_CHUNKS];
	uint8_t arena_id[16];    /* the same after a kvpoold restart on its stored arenas */
	struct bd_layout layout; /* recomputed here and checked against the daemon's sizes */
};

struct bd_pool_attach;

/* The geometry of rank `rank`'s arena of the pool listening at socket_path (NULL: the default),
 * checked like an attach's, without fds or a token (nothing is mapped, no attachment made).
 * Returns 0 and *ret, or bd_pool_attach's errors. */
int bd_pool_query(const char *socket_path, int rank, char *errbuf, size_t errlen,
		  struct bd_pool_geometry *ret);

/* Attaches to rank `rank` (0..tp-1) of the pool listening at socket_path (NULL: the default)
 * with token (BD_POOL_TOKEN_BYTES bytes: the rank's token of the group epoch the router
 * registered; NULL: none, which the daemon refuses with -EKEYREJECTED). CPU backend: maps the arena read-write (MAP_SHARED) after checking each chunk's size and that
 * it is sealed against shrinking. CUDA backend: keeps the fds for bd_pool_attach_chunks().
 * errbuf (errlen bytes, may be NULL) receives a one-line reason on failure, the daemon's own
 * text when it refused. Returns 0 and *ret, or -errno (table above; -EBADMSG also when the
 * geometry does not match what bd_layout_init computes here). */
int bd_pool_attach(const char *socket_path, int rank, const uint8_t *token, char *errbuf,
		   size_t errlen, struct bd_pool_attach **ret);

/* Unmaps, closes the fds and the socket (the daemon then drops the attachment). NULL is
 * accepted. */
void bd_pool_detach(struct bd_pool_attach *a);

/* The geometry of the attached arena (lives as long as a). */
const struct bd_pool_geometry *bd_pool_attach_geometry(const struct bd_pool_attach *a);

/* CPU backend: the base of the pages region, to pass to bd_layout_page() as `arena`; NULL on
 * the CUDA backend (nothing mapped here). */
void *bd_pool_attach_pages(const struct bd_pool_attach *a);

/* CPU backend: slot `slot` (slot_bytes bytes, bd_layout.h's slot layout), or NULL when slot is
 * out of range or nothing is mapped. */
void *bd_pool_attach_slot(const struct bd_pool_attach *a, int32_t slot);

/* The chunk fds (owned by a, in arena order; sizes in the geometry). Returns their number. */
size_t bd_pool_attach_chunks(const struct bd_pool_attach *a, const int **ret_fds);

/* The attach socket: it becomes readable (EOF) when the daemon exits. */
int bd_pool_attach_fd(const struct bd_pool_attach *a);

/* Attaches a again with token (as bd_pool_attach's: the rank's token of the epoch the router
 * registered last, which it registers again with a restarted kvpoold), to the kvpoold now
 * listening at socket_path (NULL: the default), after the one it was attached to stopped (its attach socket reads EOF): a daemon restarted on its stored
 * arenas hands out the same memory. When the new attachment names the same arenas (arena id,
 * geometry, the same files), a keeps its mapping and its fds and takes the new connection (the
 * daemon counts it attached again); the new fds are closed. Returns 0; -ESTALE when the daemon
 * has other arenas (it started empty: the pages held before are gone; a is unchanged and its
 * mapping still valid, the caller detaches and attaches anew); or bd_pool_attach's errors. */
int bd_pool_reattach(struct bd_pool_attach *a, const char *socket_path, const uint8_t *token,
		     char *errbuf, size_t errlen);

/* Whether a and geometry g describe the same arenas (arena id, backend, configuration, rank,
 * device, sizes): the attachment a worker made after registering is of the pool it queried. */
bool bd_pool_geometry_same(const struct bd_pool_geometry *a, const struct bd_pool_geometry *g);

/* ---- allocation ------------------------------------------------------------------------------ */

struct bd_pool_conn;

/* Connects to the allocation endpoint (NULL: the default); timeout_ms bounds each round trip
 * (≤ 0: 5000). The connection names itself to the daemon by a random client id and numbers its
 * calls (kvpool.proto's repeat protection). An ipc:// socket this process may not connect to
 * is refused at once rather than after a timeout. Returns 0 and *ret, -EINVAL, -ENOMEM,
 * -EACCES (permission denied on the ipc:// socket), or the -errno of ZeroMQ. */
int bd_pool_conn_new(const char *endpoint, int timeout_ms, struct bd_pool_conn **ret);

/* Makes the connection a CURVE client (base/bd_zsec.h) of the kvpoold whose public key file is
 * server_key_file, with the secret key file secret_key_file (both "" or NULL: plain, nothing
 * done); kvpoold's curve_clients must list the matching public key, else every call times out
 * on a connection kvpoold's ZAP handler refuses. Returns 0, -EINVAL (one of the two only), the
 * key loaders' errors (err[cap] says which), or a ZeroMQ -errno. */
int bd_pool_conn_set_curve(struct bd_pool_conn *c, const char *server_key_file,
			   const char *secret_key_file, char *err, size_t cap);

/* From now on a call that gets no answer in timeout_ms, or whose connection closes before the
 * answer (kvpoold died), is sent again with the same call number on a fresh socket, until
 * retry_ms have passed since it was first sent; then it fails as without retries. 0 (the
 * default): no second send. Returns 0 or -EINVAL. */
int bd_pool_conn_set_retry(struct bd_pool_conn *c, int retry_ms);

/* Closes the connection (pending messages are dropped). NULL is accepted. */
void bd_pool_conn_free(struct bd_pool_conn *c);

/* The daemon's PoolError code and text of the last failed call (BD_POOL_OK and "" after a
 * success; a local failure such as a timeout leaves code BD_POOL_OK and a local text). */
const char *bd_pool_conn_error(const struct bd_pool_conn *c, int *ret_code);

/* n (1..) new pages for request_id (non-zero), recorded under owner on first use: all or none.
 * ret_pages: n page ids. */
int bd_pool_page_alloc(struct bd_pool_conn *c, uint64_t request_id, uint64_t owner, uint32_t n,
		       int32_t *ret_pages);

/* Reserves the request's next page before promotion (at most one outstanding per request). */
int bd_pool_page_reserve(struct bd_pool_conn *c, uint64_t request_id, uint64_t owner,
			 int32_t *ret_page);

/* Marks the request's reserved page as holding promoted tokens. */
int bd_pool_page_commit(struct bd_pool_conn *c, uint64_t request_id, int32_t page);

/* Drops the request's reference to each of pages[0..n) (all or none); *ret_freed (may be NULL)
 * counts the pages that went back to the free list. */
int bd_pool_page_free(struct bd_pool_conn *c, uint64_t request_id, const int32_t *pages,
		      size_t n, uint64_t *ret_freed);

/* Adds a reference from request_id to each of pages[0..n), committed pages of other requests
 * (a shared prefix): all or none. */
int bd_pool_page_ref(struct bd_pool_conn *c, uint64_t request_id, uint64_t owner,
		     const int32_t *pages, size_t n);

/* Prefix caching (kvpool.proto PrefixStore/PrefixMatch/PrefixClear, kvpoold/kvpool.h).
 * store: indexes pages[n] of the request (promoted) under hashes[n] (≠ 0); tokens[n_tokens]
 * (128 per page) and parent (the hash before hashes[0], 0: none) go to the KV event stream
 * only; *ret_stored (may be NULL): pages indexed (a page or hash indexed already is kept as
 * it is). match: the request (created under owner) takes a reference to the page of each
 * hash of the longest indexed leading run of hashes[n]: ret_pages[0..*ret_n), which may be
 * none. clear: empties the index (the operator's: root or kvpoold's uid); *ret_dropped: the
 * pages that left it. Errors as the other allocation calls. */
int bd_pool_prefix_store(struct bd_pool_conn *c, uint64_t request_id, const int32_t *pages,
			 const uint64_t *hashes, size_t n, const int32_t *tokens, size_t n_tokens,
			 uint64_t parent, uint64_t *ret_stored);
int bd_pool_prefix_match(struct bd_pool_conn *c, uint64_t request_id, uint64_t owner,
			 const uint64_t *hashes, size_t n, int32_t *ret_pages, size_t *ret_n);
int bd_pool_prefix_clear(struct bd_pool_conn *c, uint64_t *ret_dropped);

/* A BF16 slot for the request (one per request). */
int bd_pool_slot_assign(struct bd_pool_conn *c, uint64_t request_id, uint64_t owner,
			int32_t *ret_slot);

int bd_pool_slot_release(struct bd_pool_conn *c, uint64_t request_id, int32_t slot);

/* Releases every page reference and the slot of the request and forgets it. */
int bd_pool_request_release(struct bd_pool_conn *c, uint64_t request_id,
			    uint64_t *ret_pages_freed);

/* Releases every request recorded under owner; counts may be NULL. */
int bd_pool_owner_reclaim(struct bd_pool_conn *c, uint64_t owner, uint64_t *ret_requests,
			  uint64_t *ret_pages_freed);

/* Registers the worker group of epoch (non-zero) under owner: tokens holds tp (1..
 * BD_POOL_MAX_TP) tokens of BD_POOL_TOKEN_BYTES bytes, rank r's at r · BD_POOL_TOKEN_BYTES;
 * from now on an attach of rank r needs its token, once (kvpool.proto GroupRegister). Returns
 * 0, -EINVAL (the daemon's pool has another tp, or a bad argument), -EACCES (over ipc://, a peer
 * that is neither root nor kvpoold's uid), or the call errors. */
int bd_pool_group_register(struct bd_pool_conn *c, uint64_t owner, uint64_t epoch,
			   const uint8_t *tokens, size_t tp);

struct bd_pool_holder {
	uint64_t request_id, owner;
	uint32_t pages, reserved; /* page references held, of which reserved */
	int32_t slot;             /* -1: none */
};

struct bd_pool_device {
	int rank, device;
	uint32_t attached;
	uint64_t arena_bytes, page_region_bytes, slot_region_bytes;
};

struct bd_pool_attachment {
	int rank, pid;
	uint32_t uid, gid;
};

struct bd_pool_stats {
	char backend[8], kv_config[32], page_format[16];
	uint64_t pages_total, pages_free, pages_used, pages_reserved, pages_shared;
	/* prefix caching: pages_free counts the idle cached pages (an allocation evicts them) */
	uint64_t pages_cached, pages_cached_idle, prefix_queries, prefix_hits, prefix_stored,
		prefix_evictions;
	uint64_t slots_total, slots_free;
	uint64_t page_bytes, slot_bytes; /* one page (all layers) and one slot, on one rank */
	uint64_t requests, requests_holding, served, errors;
	uint32_t tp, max_seq_len;
	size_t n_largest, n_devices, n_attachments;
	struct bd_pool_holder *largest;         /* by pages held, largest first */
	struct bd_pool_device *devices;
	struct bd_pool_attachment *attachments;
	uint8_t arena_id[16];                   /* as in bd_pool_geometry; zeros: not said */
	uint64_t group_epoch, group_owner;      /* the registered group (0: none) */
	uint64_t attach_refused;                /* attaches refused for their token */
};

/* The pool's counters and its `top` largest holders (0: the daemon's default). *ret is one
 * allocation, freed with bd_pool_stats_free(). */
int bd_pool_stats(struct bd_pool_conn *c, uint32_t top, struct bd_pool_stats **ret);
void bd_pool_stats_free(struct bd_pool_stats *s);

/* Every request record, by request id; *ret freed with free(). */
int bd_pool_requests(struct bd_pool_conn *c, struct bd_pool_holder **ret, size_t *ret_n);

/* One raw round trip (tests, tools): sends len bytes as one frame and returns the reply frame
 * in *ret_reply (free() it), its length in *ret_len. Sent once whatever set_retry says (a raw
 * frame carries no call number to make a repeat safe). Returns 0, -EINVAL, -EMSGSIZE (over
 * BD_POOL_FRAME_HARD_MAX: not sent), -ETIMEDOUT, -ECONNRESET, -ENOMEM or a ZeroMQ -errno. */
int bd_pool_call_raw(struct bd_pool_conn *c, const void *frame, size_t len, void **ret_reply,
		     size_t *ret_len);

#ifdef __cplusplus
}
#endif
#endif
