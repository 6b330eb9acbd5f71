/* pool_client.c — attach to kvpoold's arenas and allocate from it (bd_pool_client.h).
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <zmq.h>

#include "base/bd_ipc.h"
#include "pool/bd_pool_client.h"
#include "kvpool.pb-c.h"

#define ATTACH_TIMEOUT_MS 5000
#define ATTACH_REPLY_MAX 65536

int bd_pool_errno(int e)
{
	static const int map[BD_POOL_ERR_COUNT] = {
		[BD_POOL_OK] = 0,
		[BD_POOL_ERR_MALFORMED] = -EBADMSG,
		[BD_POOL_ERR_OVERSIZE] = -EMSGSIZE,
		[BD_POOL_ERR_UNKNOWN_TYPE] = -EOPNOTSUPP,
		[BD_POOL_ERR_INVALID] = -EINVAL,
		[BD_POOL_ERR_RANGE] = -ERANGE,
		[BD_POOL_ERR_UNKNOWN_REQUEST] = -ENOENT,
		[BD_POOL_ERR_NOT_HELD] = -EPERM,
		[BD_POOL_ERR_DOUBLE_FREE] = -EALREADY,
		[BD_POOL_ERR_EXHAUSTED] = -ENOSPC,
		[BD_POOL_ERR_OWNER] = -EACCES,
		[BD_POOL_ERR_STATE] = -EBUSY,
		[BD_POOL_ERR_DENIED] = -EACCES,
		[BD_POOL_ERR_NO_DEVICE] = -ENODEV,
		[BD_POOL_ERR_VERSION] = -EPROTO,
	};

	if (e < 0 || e >= BD_POOL_ERR_COUNT)
		return -EPROTO;
	return map[e];
}

/* the public enum mirrors the generated one: keep them in step */
#define SAME(x) _Static_assert((int)BD_POOL_ERR_##x == (int)BDFP4__POOL_ERROR__POOL_ERR_##x, #x)
SAME(MALFORMED);
SAME(OVERSIZE);
SAME(UNKNOWN_TYPE);
SAME(INVALID);
SAME(RANGE);
SAME(UNKNOWN_REQUEST);
SAME(NOT_HELD);
SAME(DOUBLE_FREE);
SAME(EXHAUSTED);
SAME(OWNER);
SAME(STATE);
SAME(DENIED);
SAME(NO_DEVICE);
SAME(VERSION);
#undef SAME

/* ---- attach ---------------------------------------------------------------------------------- */

struct bd_pool_attach {
	int sock;
	int fds[BD_POOL_MAX_CHUNKS];
	size_t n_fds;
	void *base; /* CPU backend: arena_bytes mapped, chunk after chunk */
	struct bd_pool_geometry geo;
};

static void seterr(char *buf, size_t len, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

static void seterr(char *buf, size_t len, const char *fmt, ...)
{
	va_list ap;

	if (!buf || !len)
		return;
	va_start(ap, fmt);
	vsnprintf(buf, len, fmt, ap);
	va_end(ap);
}

void bd_pool_detach(struct bd_pool_attach *a)
{
	if (!a)
		return;
	if (a->base)
		munmap(a->base, a->geo.arena_bytes);
	for (size_t i = 0; i < a->n_fds; i++)
		close(a->fds[i]);
	if (a->sock >= 0)
		close(a->sock);
	free(a);
}

/* The geometry of the reply, checked: sizes must be what this build's layout computes. */
static int take_geometry(struct bd_pool_geometry *g, const Bdfp4__AttachReply *r, int rank,
			 size_t n_fds, char *errbuf, size_t errlen)
{
	uint64_t sum = 0, end;
	int e;

	if (strcmp(r->backend, "cpu") && strcmp(r->backend, "cuda")) {
		seterr(errbuf, errlen, "unknown backend '%.16s'", r->backend);
		return -EBADMSG;
	}
	if (r->rank != rank || r->n_chunk_bytes != n_fds || n_fds == 0 ||
	    n_fds > BD_POOL_MAX_CHUNKS || strlen(r->kv_config) >= sizeof(g->kv_config)) {
		seterr(errbuf, errlen, "attach reply: rank %d, %zu chunk sizes for %zu fds",
		       r->rank, r->n_chunk_bytes, n_fds);
		return -EBADMSG;
	}
	snprintf(g->backend, sizeof(g->backend), "%s", r->backend);
	snprintf(g->kv_config, sizeof(g->kv_config), "%s", r->kv_config);
	g->rank = r->rank;
	g->device = r->device;
	g->tp = (int)r->tp;
	g->max_seq_len = r->max_seq_len;
	g->n_pages = r->n_pages;
	g->n_slots = r->n_slots;
	g->pages_offset = r->pages_offset;
	g->slots_offset = r->slots_offset;
	g->arena_bytes = r->arena_bytes;
	g->n_chunks = n_fds;
	for (size_t i = 0; i < n_fds; i++) {
		g->chunk_bytes[i] = r->chunk_bytes[i];
		if (r->chunk_bytes[i] == 0 || __builtin_add_overflow(sum, r->chunk_bytes[i], &sum))
			return -EBADMSG;
	}
	if (r->n_layers > 4096 || r->n_kv_heads > 4096 || r->head_dim > 4096 || r->d_rope > 4096 ||
	    r->page_format >= BD_PAGE_FORMAT_COUNT || r->n_pages == 0 || r->n_pages > INT32_MAX) {
		seterr(errbuf, errlen, "attach reply: geometry out of range");
		return -EBADMSG;
	}
	e = bd_layout_init(&g->layout, (enum bd_page_format)r->page_format, (int)r->n_layers,
			   (int)r->n_kv_heads, (int)r->head_dim, (int)r->d_rope, r->n_pages);
	if (e < 0) {
		seterr(errbuf, errlen, "attach reply: geometry refused by bd_layout_init (%d)", e);
		return -EBADMSG;
	}
	if (g->layout.page_bytes != r->page_bytes || g->layout.slot_bytes != r->slot_bytes) {
		seterr(errbuf, errlen,
		       "layout mismatch: daemon page %llu slot %llu bytes, here %zu and %zu",
		       (unsigned long long)r->page_bytes, (unsigned long long)r->slot_bytes,
		       g->layout.page_bytes, g->layout.slot_bytes);
		return -EBADMSG;
	}
	/* pages, then slots, inside the arena, and the chunks add up to it */
	if (sum != r->arena_bytes ||
	    __builtin_add_overflow(r->pages_offset, (uint64_t)g->layout.arena_bytes, &end) ||
	    end > r->slots_offset ||
	    __builtin_mul_overflow(r->n_slots, (uint64_t)r->slot_bytes, &end) ||
	    __builtin_add_overflow(end, r->slots_offset, &end) || end > r->arena_bytes) {
		seterr(errbuf, errlen, "attach reply: regions do not fit the arena");
		return -EBADMSG;
	}
	return 0;
}

static int map_chunks(struct bd_pool_attach *a, char *errbuf, size_t errlen)
{
	size_t off = 0;
	uint8_t *base;

	base = mmap(NULL, a->geo.arena_bytes, PROT_NONE,
		    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (base == MAP_FAILED) {
		seterr(errbuf, errlen, "reserving %zu bytes: %s", a->geo.arena_bytes,
		       strerror(errno));
		return -ENOMEM;
	}
	a->base = base;
	for (size_t i = 0; i < a->n_fds; i++) {
		struct stat st;
		int seals;

		/* a shrinkable file could SIGBUS us later; a short one now */
		seals = fcntl(a->fds[i], F_GET_SEALS);
		if (fstat(a->fds[i], &st) < 0 || seals < 0 || !(seals & F_SEAL_SHRINK) ||
		    (uint64_t)st.st_size != a->geo.chunk_bytes[i]) {
			seterr(errbuf, errlen, "chunk %zu: not a sealed memfd of %llu bytes", i,
			       (unsigned long long)a->geo.chunk_bytes[i]);
			return -EBADMSG;
		}
		if (mmap(base + off, a->geo.chunk_bytes[i], PROT_READ | PROT_WRITE,
			 MAP_SHARED | MAP_FIXED, a->fds[i], 0) == MAP_FAILED) {
			int e = -errno;

			seterr(errbuf, errlen, "mapping chunk %zu: %s", i, strerror(-e));
			return e;
		}
		off += a->geo.chunk_bytes[i];
	}
	return 0;
}

int bd_pool_attach(const char *socket_path, int rank, char *errbuf, size_t errlen,
		   struct bd_pool_attach **ret)
{
	Bdfp4__AttachRequest req = BDFP4__ATTACH_REQUEST__INIT;
	Bdfp4__AttachReply *rep = NULL;
	struct bd_pool_attach *a;
	uint8_t out[64], *in = NULL;
	int fds[BD_POOL_MAX_CHUNKS], n_fds = 0, e;
	struct pollfd pfd;
	ssize_t n;

	if (!ret || rank < 0) {
		seterr(errbuf, errlen, "bad argument");
		return -EINVAL;
	}
	if (!socket_path)
		socket_path = BD_POOL_DEFAULT_SOCKET;
	a = calloc(1, sizeof(*a));
	in = malloc(ATTACH_REPLY_MAX);
	if (!a || !in) {
		free(a);
		free(in);
		return -ENOMEM;
	}
	a->sock = bd_ipc_connect(socket_path);
	if (a->sock < 0) {
		e = a->sock;
		seterr(errbuf, errlen, "connecting to %s: %s", socket_path, strerror(-e));
		goto fail;
	}
	req.version = BD_POOL_PROTO_VERSION;
	req.rank = rank;
	req.pid = (int32_t)getpid();
	e = bd_ipc_send(a->sock, out, bdfp4__attach_request__pack(&req, out), NULL, 0);
	/* a daemon that refuses us may have answered and closed before our request went out:
	 * its answer is still there to read */
	if (e < 0 && e != -EPIPE && e != -ECONNRESET) {
		seterr(errbuf, errlen, "sending the attach request: %s", strerror(-e));
		goto fail;
	}
	pfd = (struct pollfd){ .fd = a->sock, .events = POLLIN };
	e = poll(&pfd, 1, ATTACH_TIMEOUT_MS);
	if (e <= 0) {
		e = e == 0 ? -ETIMEDOUT : -errno;
		seterr(errbuf, errlen, "waiting for the attach reply: %s", strerror(-e));
		goto fail;
	}
	n = bd_ipc_recv(a->sock, in, ATTACH_REPLY_MAX, fds, BD_POOL_MAX_CHUNKS, &n_fds);
	/* a refusal closes the connection with our request unread, which the kernel reports
	 * once as a reset ahead of the refusal itself: read again (the peer is gone, so this
	 * cannot block) */
	if (n == -ECONNRESET)
		n = bd_ipc_recv(a->sock, in, ATTACH_REPLY_MAX, fds, BD_POOL_MAX_CHUNKS, &n_fds);
	if (n <= 0) {
		e = n == 0 ? -ECONNRESET : (int)n;
		seterr(errbuf, errlen, "receiving the attach reply: %s", strerror(-e));
		goto fail;
	}
	memcpy(a->fds, fds, (size_t)n_fds * sizeof(int));
	a->n_fds = (size_t)n_fds;
	rep = bdfp4__attach_reply__unpack(NULL, (size_t)n, in);
	if (!rep) {
		e = -EBADMSG;
		seterr(errbuf, errlen, "the attach reply does not parse");
		goto fail;
	}
	if (rep->error != BDFP4__POOL_ERROR__POOL_OK) {
		e = bd_pool_errno(rep->error);
		seterr(errbuf, errlen, "kvpoold refused: %s", rep->message);
		goto fail;
	}
	if (rep->version != BD_POOL_PROTO_VERSION) {
		e = -EPROTO;
		seterr(errbuf, errlen, "kvpoold speaks version %u, this client %d", rep->version,
		       BD_POOL_PROTO_VERSION);
		goto fail;
	}
	e = take_geometry(&a->geo, rep, rank, a->n_fds, errbuf, errlen);
	if (e < 0)
		goto fail;
	if (!strcmp(a->geo.backend, "cpu")) {
		e = map_chunks(a, errbuf, errlen);
		if (e < 0)
			goto fail;
	}
	bdfp4__attach_reply__free_unpacked(rep, NULL);
	free(in);
	*ret = a;
	return 0;

fail:
	if (rep)
		bdfp4__attach_reply__free_unpacked(rep, NULL);
	free(in);
	bd_pool_detach(a);
	return e;
}

const struct bd_pool_geometry *bd_pool_attach_geometry(const struct bd_pool_attach *a)
{
	return a ? &a->geo : NULL;
}

void *bd_pool_attach_pages(const struct bd_pool_attach *a)
{
	if (!a || !a->base)
		return NULL;
	return (uint8_t *)a->base + a->geo.pages_offset;
}

void *bd_pool_attach_slot(const struct bd_pool_attach *a, int32_t slot)
{
	if (!a || !a->base || slot < 0 || (size_t)slot >= a->geo.n_slots)
		return NULL;
	return (uint8_t *)a->base + a->geo.slots_offset + (size_t)slot * a->geo.layout.slot_bytes;
}

size_t bd_pool_attach_chunks(const struct bd_pool_attach *a, const int **ret_fds)
{
	if (!a)
		return 0;
	if (ret_fds)
		*ret_fds = a->fds;
	return a->n_fds;
}

int bd_pool_attach_fd(const struct bd_pool_attach *a)
{
	return a ? a->sock : -EINVAL;
}

/* ---- allocation ------------------------------------------------------------------------------ */

struct bd_pool_conn {
	void *ctx, *sock;
	int code;
	char err[256];
};

void bd_pool_conn_free(struct bd_pool_conn *c)
{
	if (!c)
		return;
	if (c->sock)
		zmq_close(c->sock);
	if (c->ctx)
		zmq_ctx_term(c->ctx);
	free(c);
}

int bd_pool_conn_new(const char *endpoint, int timeout_ms, struct bd_pool_conn **ret)
{
	struct bd_pool_conn *c;
	int one = 1, zero = 0, e;

	if (!ret)
		return -EINVAL;
	if (!endpoint)
		endpoint = BD_POOL_DEFAULT_ENDPOINT;
	if (timeout_ms <= 0)
		timeout_ms = 5000;
	c = calloc(1, sizeof(*c));
	if (!c)
		return -ENOMEM;
	c->ctx = zmq_ctx_new();
	if (!c->ctx)
		goto fail;
	c->sock = zmq_socket(c->ctx, ZMQ_REQ);
	if (!c->sock)
		goto fail;
	/* RELAXED + CORRELATE: after a timeout the next call may send again and a late reply
	 * to the old request is discarded rather than taken as the answer to the new one */
	if (zmq_setsockopt(c->sock, ZMQ_LINGER, &zero, sizeof(zero)) < 0 ||
	    zmq_setsockopt(c->sock, ZMQ_REQ_RELAXED, &one, sizeof(one)) < 0 ||
	    zmq_setsockopt(c->sock, ZMQ_REQ_CORRELATE, &one, sizeof(one)) < 0 ||
	    zmq_setsockopt(c->sock, ZMQ_RCVTIMEO, &timeout_ms, sizeof(timeout_ms)) < 0 ||
	    zmq_setsockopt(c->sock, ZMQ_SNDTIMEO, &timeout_ms, sizeof(timeout_ms)) < 0 ||
	    zmq_connect(c->sock, endpoint) < 0)
		goto fail;
	*ret = c;
	return 0;
fail:
	e = -(zmq_errno() ? zmq_errno() : ENOMEM);
	bd_pool_conn_free(c);
	return e;
}

const char *bd_pool_conn_error(const struct bd_pool_conn *c, int *ret_code)
{
	if (!c)
		return "";
	if (ret_code)
		*ret_code = c->code;
	return c->err;
}

int bd_pool_call_raw(struct bd_pool_conn *c, const void *frame, size_t len, void **ret_reply,
		     size_t *ret_len)
{
	zmq_msg_t m;
	void *out;
	int e;

	if (!c || (!frame && len) || !ret_reply || !ret_len)
		return -EINVAL;
	if (zmq_send(c->sock, frame, len, 0) < 0) {
		e = zmq_errno() == EAGAIN ? -ETIMEDOUT : -zmq_errno();
		goto fail;
	}
	zmq_msg_init(&m);
	if (zmq_msg_recv(&m, c->sock, 0) < 0) {
		e = zmq_errno() == EAGAIN ? -ETIMEDOUT : -zmq_errno();
		zmq_msg_close(&m);
		goto fail;
	}
	out = malloc(zmq_msg_size(&m) ? zmq_msg_size(&m) : 1);
	if (!out) {
		zmq_msg_close(&m);
		return -ENOMEM;
	}
	memcpy(out, zmq_msg_data(&m), zmq_msg_size(&m));
	*ret_len = zmq_msg_size(&m);
	*ret_reply = out;
	zmq_msg_close(&m);
	return 0;
fail:
	c->code = BD_POOL_OK;
	snprintf(c->err, sizeof(c->err), "kvpoold: %s", strerror(-e));
	return e;
}

/* One round trip of a PoolRequest; *ret is the reply when it says POOL_OK. */
static int call(struct bd_pool_conn *c, const Bdfp4__PoolRequest *req, Bdfp4__PoolReply **ret)
{
	Bdfp4__PoolReply *rep;
	size_t len = bdfp4__pool_request__get_packed_size(req), rlen;
	uint8_t *buf = malloc(len ? len : 1);
	void *rbuf;
	int e;

	if (!buf)
		return -ENOMEM;
	bdfp4__pool_request__pack(req, buf);
	e = bd_pool_call_raw(c, buf, len, &rbuf, &rlen);
	free(buf);
	if (e < 0)
		return e;
	rep = bdfp4__pool_reply__unpack(NULL, rlen, rbuf);
	free(rbuf);
	if (!rep) {
		c->code = BD_POOL_OK;
		snprintf(c->err, sizeof(c->err), "kvpoold: the reply does not parse");
		return -EBADMSG;
	}
	if (rep->error != BDFP4__POOL_ERROR__POOL_OK) {
		c->code = rep->error;
		snprintf(c->err, sizeof(c->err), "%s", rep->message);
		e = bd_pool_errno(rep->error);
		bdfp4__pool_reply__free_unpacked(rep, NULL);
		return e;
	}
	c->code = BD_POOL_OK;
	c->err[0] = 0;
	*ret = rep;
	return 0;
}

int bd_pool_page_alloc(struct bd_pool_conn *c, uint64_t request_id, uint64_t owner, uint32_t n,
		       int32_t *ret_pages)
{
	Bdfp4__PoolRequest req = BDFP4__POOL_REQUEST__INIT;
	Bdfp4__PageAlloc op = BDFP4__PAGE_ALLOC__INIT;
	Bdfp4__PoolReply *rep;
	int e;

	if (!c || !ret_pages || n == 0)
		return -EINVAL;
	op.request_id = request_id;
	op.owner = owner;
	op.n = n;
	req.op_case = BDFP4__POOL_REQUEST__OP_PAGE_ALLOC;
	req.page_alloc = &op;
	e = call(c, &req, &rep);
	if (e < 0)
		return e;
	if (rep->n_pages != n)
		e = -EBADMSG;
	else
		memcpy(ret_pages, rep->pages, n * sizeof(int32_t));
	bdfp4__pool_reply__free_unpacked(rep, NULL);
	return e;
}

int bd_pool_page_reserve(struct bd_pool_conn *c, uint64_t request_id, uint64_t owner,
			 int32_t *ret_page)
{
	Bdfp4__PoolRequest req = BDFP4__POOL_REQUEST__INIT;
	Bdfp4__PageReserve op = BDFP4__PAGE_RESERVE__INIT;
	Bdfp4__PoolReply *rep;
	int e;

	if (!c || !ret_page)
		return -EINVAL;
	op.request_id = request_id;
	op.owner = owner;
	req.op_case = BDFP4__POOL_REQUEST__OP_PAGE_RESERVE;
	req.page_reserve = &op;
	e = call(c, &req, &rep);
	if (e < 0)
		return e;
	if (rep->n_pages != 1)
		e = -EBADMSG;
	else
		*ret_page = rep->pages[0];
	bdfp4__pool_reply__free_unpacked(rep, NULL);
	return e;
}

/* A call whose reply carries nothing but counts. */
static int call_counts(struct bd_pool_conn *c, const Bdfp4__PoolRequest *req,
		       uint64_t *ret_requests, uint64_t *ret_freed)
{
	Bdfp4__PoolReply *rep;
	int e = call(c, req, &rep);

	if (e < 0)
		return e;
	if (ret_requests)
		*ret_requests = rep->requests_released;
	if (ret_freed)
		*ret_freed = rep->pages_freed;
	bdfp4__pool_reply__free_unpacked(rep, NULL);
	return 0;
}

int bd_pool_page_commit(struct bd_pool_conn *c, uint64_t request_id, int32_t page)
{
	Bdfp4__PoolRequest req = BDFP4__POOL_REQUEST__INIT;
	Bdfp4__PageCommit op = BDFP4__PAGE_COMMIT__INIT;

	if (!c)
		return -EINVAL;
	op.request_id = request_id;
	op.page = page;
	req.op_case = BDFP4__POOL_REQUEST__OP_PAGE_COMMIT;
	req.page_commit = &op;
	return call_counts(c, &req, NULL, NULL);
}

int bd_pool_page_free(struct bd_pool_conn *c, uint64_t request_id, const int32_t *pages,
		      size_t n, uint64_t *ret_freed)
{
	Bdfp4__PoolRequest req = BDFP4__POOL_REQUEST__INIT;
	Bdfp4__PageFree op = BDFP4__PAGE_FREE__INIT;

	if (!c || (n && !pages))
		return -EINVAL;
	op.request_id = request_id;
	op.n_pages = n;
	op.pages = (int32_t *)pages;
	req.op_case = BDFP4__POOL_REQUEST__OP_PAGE_FREE;
	req.page_free = &op;
	return call_counts(c, &req, NULL, ret_freed);
}

int bd_pool_page_ref(struct bd_pool_conn *c, uint64_t request_id, uint64_t owner,
		     const int32_t *pages, size_t n)
{
	Bdfp4__PoolRequest req = BDFP4__POOL_REQUEST__INIT;
	Bdfp4__PageRef op = BDFP4__PAGE_REF__INIT;

	if (!c || (n && !pages))
		return -EINVAL;
	op.request_id = request_id;
	op.owner = owner;
	op.n_pages = n;
	op.pages = (int32_t *)pages;
	req.op_case = BDFP4__POOL_REQUEST__OP_PAGE_REF;
	req.page_ref = &op;
	return call_counts(c, &req, NULL, NULL);
}

int bd_pool_slot_assign(struct bd_pool_conn *c, uint64_t request_id, uint64_t owner,
			int32_t *ret_slot)
{
	Bdfp4__PoolRequest req = BDFP4__POOL_REQUEST__INIT;
	Bdfp4__SlotAssign op = BDFP4__SLOT_ASSIGN__INIT;
	Bdfp4__PoolReply *rep;
	int e;

	if (!c || !ret_slot)
		return -EINVAL;
	op.request_id = request_id;
	op.owner = owner;
	req.op_case = BDFP4__POOL_REQUEST__OP_SLOT_ASSIGN;
	req.slot_assign = &op;
	e = call(c, &req, &rep);
	if (e < 0)
		return e;
	*ret_slot = rep->slot;
	bdfp4__pool_reply__free_unpacked(rep, NULL);
	return 0;
}

int bd_pool_slot_release(struct bd_pool_conn *c, uint64_t request_id, int32_t slot)
{
	Bdfp4__PoolRequest req = BDFP4__POOL_REQUEST__INIT;
	Bdfp4__SlotRelease op = BDFP4__SLOT_RELEASE__INIT;

	if (!c)
		return -EINVAL;
	op.request_id = request_id;
	op.slot = slot;
	req.op_case = BDFP4__POOL_REQUEST__OP_SLOT_RELEASE;
	req.slot_release = &op;
	return call_counts(c, &req, NULL, NULL);
}

int bd_pool_request_release(struct bd_pool_conn *c, uint64_t request_id,
			    uint64_t *ret_pages_freed)
{
	Bdfp4__PoolRequest req = BDFP4__POOL_REQUEST__INIT;
	Bdfp4__RequestRelease op = BDFP4__REQUEST_RELEASE__INIT;

	if (!c)
		return -EINVAL;
	op.request_id = request_id;
	req.op_case = BDFP4__POOL_REQUEST__OP_REQUEST_RELEASE;
	req.request_release = &op;
	return call_counts(c, &req, NULL, ret_pages_freed);
}

int bd_pool_owner_reclaim(struct bd_pool_conn *c, uint64_t owner, uint64_t *ret_requests,
			  uint64_t *ret_pages_freed)
{
	Bdfp4__PoolRequest req = BDFP4__POOL_REQUEST__INIT;
	Bdfp4__OwnerReclaim op = BDFP4__OWNER_RECLAIM__INIT;

	if (!c)
		return -EINVAL;
	op.owner = owner;
	req.op_case = BDFP4__POOL_REQUEST__OP_OWNER_RECLAIM;
	req.owner_reclaim = &op;
	return call_counts(c, &req, ret_requests, ret_pages_freed);
}

static void holder_from(struct bd_pool_holder *h, const Bdfp4__Holder *p)
{
	h->request_id = p->request_id;
	h->owner = p->owner;
	h->pages = p->pages;
	h->reserved = p->reserved;
	h->slot = p->slot;
}

void bd_pool_stats_free(struct bd_pool_stats *s)
{
	free(s);
}

int bd_pool_stats(struct bd_pool_conn *c, uint32_t top, struct bd_pool_stats **ret)
{
	Bdfp4__PoolRequest req = BDFP4__POOL_REQUEST__INIT;
	Bdfp4__StatsQuery op = BDFP4__STATS_QUERY__INIT;
	Bdfp4__PoolReply *rep;
	const Bdfp4__PoolStats *p;
	struct bd_pool_stats *s;
	size_t bytes;
	int e;

	if (!c || !ret)
		return -EINVAL;
	op.top = top;
	req.op_case = BDFP4__POOL_REQUEST__OP_STATS;
	req.stats = &op;
	e = call(c, &req, &rep);
	if (e < 0)
		return e;
	p = rep->stats;
	if (!p) {
		bdfp4__pool_reply__free_unpacked(rep, NULL);
		return -EBADMSG;
	}
	/* one block: the struct, then its three arrays */
	bytes = sizeof(*s) + p->n_largest * sizeof(struct bd_pool_holder) +
		p->n_devices * sizeof(struct bd_pool_device) +
		p->n_attachments * sizeof(struct bd_pool_attachment);
	s = calloc(1, bytes);
	if (!s) {
		bdfp4__pool_reply__free_unpacked(rep, NULL);
		return -ENOMEM;
	}
	snprintf(s->backend, sizeof(s->backend), "%s", p->backend);
	snprintf(s->kv_config, sizeof(s->kv_config), "%s", p->kv_config);
	snprintf(s->page_format, sizeof(s->page_format), "%s", p->page_format);
	s->pages_total = p->pages_total;
	s->pages_free = p->pages_free;
	s->pages_used = p->pages_used;
	s->pages_reserved = p->pages_reserved;
	s->pages_shared = p->pages_shared;
	s->slots_total = p->slots_total;
	s->slots_free = p->slots_free;
	s->page_bytes = p->page_bytes;
	s->slot_bytes = p->slot_bytes;
	s->requests = p->requests;
	s->requests_holding = p->requests_holding;
	s->served = p->served;
	s->errors = p->errors;
	s->tp = p->tp;
	s->max_seq_len = p->max_seq_len;
	s->largest = (struct bd_pool_holder *)(s + 1);
	s->devices = (struct bd_pool_device *)(s->largest + p->n_largest);
	s->attachments = (struct bd_pool_attachment *)(s->devices + p->n_devices);
	s->n_largest = p->n_largest;
	s->n_devices = p->n_devices;
	s->n_attachments = p->n_attachments;
	for (size_t i = 0; i < p->n_largest; i++)
		holder_from(&s->largest[i], p->largest[i]);
	for (size_t i = 0; i < p->n_devices; i++) {
		const Bdfp4__DeviceStats *d = p->devices[i];

		s->devices[i] = (struct bd_pool_device){
			.rank = d->rank,
			.device = d->device,
			.attached = d->attached,
			.arena_bytes = d->arena_bytes,
			.page_region_bytes = d->page_region_bytes,
			.slot_region_bytes = d->slot_region_bytes,
		};
	}
	for (size_t i = 0; i < p->n_attachments; i++) {
		const Bdfp4__Attachment *t = p->attachments[i];

		s->attachments[i] = (struct bd_pool_attachment){
			.rank = t->rank, .pid = t->pid, .uid = t->uid, .gid = t->gid
		};
	}
	bdfp4__pool_reply__free_unpacked(rep, NULL);
	*ret = s;
	return 0;
}

int bd_pool_requests(struct bd_pool_conn *c, struct bd_pool_holder **ret, size_t *ret_n)
{
	Bdfp4__PoolRequest req = BDFP4__POOL_REQUEST__INIT;
	Bdfp4__RequestsQuery op = BDFP4__REQUESTS_QUERY__INIT;
	Bdfp4__PoolReply *rep;
	struct bd_pool_holder *h;
	int e;

	if (!c || !ret || !ret_n)
		return -EINVAL;
	req.op_case = BDFP4__POOL_REQUEST__OP_REQUESTS;
	req.requests = &op;
	e = call(c, &req, &rep);
	if (e < 0)
		return e;
	h = calloc(rep->n_requests ? rep->n_requests : 1, sizeof(*h));
	if (!h) {
		bdfp4__pool_reply__free_unpacked(rep, NULL);
		return -ENOMEM;
	}
	for (size_t i = 0; i < rep->n_requests; i++)
		holder_from(&h[i], rep->requests[i]);
	*ret_n = rep->n_requests;
	*ret = h;
	bdfp4__pool_reply__free_unpacked(rep, NULL);
	return 0;
}
