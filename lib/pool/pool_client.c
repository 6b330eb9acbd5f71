/* pool_client.c — attach to kvpoold's arenas and allocate from it (bd_pool_client.h).
 *
 * The allocation connection keeps its REQ socket only while calls are answered: a call that
 * times out, or whose connection closes first (a monitor on the socket reports it at once),
 * closes the socket and opens a fresh one, so that no lost reply leaves the REQ state machine
 * waiting and no stale message waits in its queue. A retried call carries its first number, so
 * a daemon that applied it before the reply was lost answers the repeat without applying it.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <zmq.h>

#include "base/bd_clock.h"
#include "base/bd_err.h"
#include "base/bd_ipc.h"
#include "base/bd_zsec.h"
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
		[BD_POOL_ERR_ATTACHED] = -EISCONN,
		[BD_POOL_ERR_QUOTA] = -EDQUOT,
		[BD_POOL_ERR_TOKEN] = -EKEYREJECTED,
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
SAME(ATTACHED);
SAME(QUOTA);
SAME(TOKEN);
#undef SAME

/* ---- attach ---------------------------------------------------------------------------------- */

struct bd_pool_attach {
	int sock;
	int fds[BD_POOL_MAX_CHUNKS];
	size_t n_fds;
	void *base; /* CPU backend: arena_bytes mapped, chunk after chunk */
	struct bd_pool_geometry geo;
};

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
			 size_t n_fds, bool geometry_only, char *errbuf, size_t errlen)
{
	uint64_t sum = 0, end;
	int e;

	if (strcmp(r->backend, "cpu") && strcmp(r->backend, "cuda"))
		return bd_errf(errbuf, errlen, -EBADMSG, "unknown backend '%.16s'", r->backend);
	/* a geometry reply has the chunk sizes and no fds */
	if (geometry_only && n_fds == 0)
		n_fds = r->n_chunk_bytes;
	else if (geometry_only)
		n_fds = SIZE_MAX;
	if (r->rank != rank || r->n_chunk_bytes != n_fds || n_fds == 0 ||
	    n_fds > BD_POOL_MAX_CHUNKS || strlen(r->kv_config) >= sizeof(g->kv_config))
		return bd_errf(errbuf, errlen, -EBADMSG,
			       "attach reply: rank %d, %zu chunk sizes for %zu fds", r->rank,
			       r->n_chunk_bytes, geometry_only ? (size_t)0 : n_fds);
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
	if (r->arena_id.len == sizeof(g->arena_id))
		memcpy(g->arena_id, r->arena_id.data, sizeof(g->arena_id));
	for (size_t i = 0; i < n_fds; i++) {
		g->chunk_bytes[i] = r->chunk_bytes[i];
		if (r->chunk_bytes[i] == 0 || __builtin_add_overflow(sum, r->chunk_bytes[i], &sum))
			return -EBADMSG;
	}
	if (r->n_layers > 4096 || r->n_kv_heads > 4096 || r->head_dim > 4096 || r->d_rope > 4096 ||
	    r->page_format >= BD_PAGE_FORMAT_COUNT || r->n_pages == 0 || r->n_pages > INT32_MAX)
		return bd_errf(errbuf, errlen, -EBADMSG, "attach reply: geometry out of range");
	e = bd_layout_init(&g->layout, (enum bd_page_format)r->page_format, (int)r->n_layers,
			   (int)r->n_kv_heads, (int)r->head_dim, (int)r->d_rope, r->n_pages);
	if (e < 0)
		return bd_errf(errbuf, errlen, -EBADMSG,
			       "attach reply: geometry refused by bd_layout_init (%d)", e);
	if (g->layout.page_bytes != r->page_bytes || g->layout.slot_bytes != r->slot_bytes)
		return bd_errf(errbuf, errlen, -EBADMSG,
			       "layout mismatch: daemon page %llu slot %llu bytes, here %zu and %zu",
			       (unsigned long long)r->page_bytes, (unsigned long long)r->slot_bytes,
			       g->layout.page_bytes, g->layout.slot_bytes);
	/* pages, then slots, inside the arena, and the chunks add up to it */
	if (sum != r->arena_bytes ||
	    __builtin_add_overflow(r->pages_offset, (uint64_t)g->layout.arena_bytes, &end) ||
	    end > r->slots_offset ||
	    __builtin_mul_overflow(r->n_slots, (uint64_t)r->slot_bytes, &end) ||
	    __builtin_add_overflow(end, r->slots_offset, &end) || end > r->arena_bytes)
		return bd_errf(errbuf, errlen, -EBADMSG,
			       "attach reply: regions do not fit the arena");
	return 0;
}

static int map_chunks(struct bd_pool_attach *a, char *errbuf, size_t errlen)
{
	size_t off = 0;
	uint8_t *base;

	base = mmap(NULL, a->geo.arena_bytes, PROT_NONE,
		    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (base == MAP_FAILED)
		return bd_errf(errbuf, errlen, -ENOMEM, "reserving %zu bytes: %s",
			       a->geo.arena_bytes, strerror(errno));
	a->base = base;
	for (size_t i = 0; i < a->n_fds; i++) {
		struct stat st;
		int seals;

		/* a shrinkable file could SIGBUS us later; a short one now */
		seals = fcntl(a->fds[i], F_GET_SEALS);
		if (fstat(a->fds[i], &st) < 0 || seals < 0 || !(seals & F_SEAL_SHRINK) ||
		    (uint64_t)st.st_size != a->geo.chunk_bytes[i])
			return bd_errf(errbuf, errlen, -EBADMSG,
				       "chunk %zu: not a sealed memfd of %llu bytes", i,
				       (unsigned long long)a->geo.chunk_bytes[i]);
		if (mmap(base + off, a->geo.chunk_bytes[i], PROT_READ | PROT_WRITE,
			 MAP_SHARED | MAP_FIXED, a->fds[i], 0) == MAP_FAILED) {
			int e = -errno;

			return bd_errf(errbuf, errlen, e, "mapping chunk %zu: %s", i, strerror(-e));
		}
		off += a->geo.chunk_bytes[i];
	}
	return 0;
}

/* The attach exchange: connects to socket_path, asks for rank with token (or for the geometry
 * only, token NULL), takes the reply's fds and its checked geometry into a fresh *ret (nothing
 * mapped). Returns 0 or -errno with errbuf. */
static int attach_exchange(const char *socket_path, int rank, bool geometry_only,
			   const uint8_t *token, char *errbuf, size_t errlen,
			   struct bd_pool_attach **ret)
{
	Bdfp4__AttachRequest req = BDFP4__ATTACH_REQUEST__INIT;
	Bdfp4__AttachReply *rep = NULL;
	struct bd_pool_attach *a;
	uint8_t out[128], *in = NULL;
	int fds[BD_POOL_MAX_CHUNKS], n_fds = 0, e;
	struct pollfd pfd;
	ssize_t n;

	if (!ret || rank < 0)
		return bd_errf(errbuf, errlen, -EINVAL, "bad argument");
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
		e = bd_errf(errbuf, errlen, a->sock, "connecting to %s: %s", socket_path,
			    strerror(-a->sock));
		goto fail;
	}
	req.version = BD_POOL_PROTO_VERSION;
	req.rank = rank;
	req.pid = (int32_t)getpid();
	req.geometry_only = geometry_only;
	if (token)
		req.token = (ProtobufCBinaryData){ BD_POOL_TOKEN_BYTES, (uint8_t *)token };
	e = bd_ipc_send(a->sock, out, bdfp4__attach_request__pack(&req, out), NULL, 0);
	/* a daemon that refuses us may have answered and closed before our request went out:
	 * its answer is still there to read */
	if (e < 0 && e != -EPIPE && e != -ECONNRESET) {
		bd_errf(errbuf, errlen, e, "sending the attach request: %s", strerror(-e));
		goto fail;
	}
	pfd = (struct pollfd){ .fd = a->sock, .events = POLLIN };
	e = poll(&pfd, 1, ATTACH_TIMEOUT_MS);
	if (e <= 0) {
		e = e == 0 ? -ETIMEDOUT : -errno;
		bd_errf(errbuf, errlen, e, "waiting for the attach reply: %s", strerror(-e));
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
		bd_errf(errbuf, errlen, e, "receiving the attach reply: %s", strerror(-e));
		goto fail;
	}
	memcpy(a->fds, fds, (size_t)n_fds * sizeof(int));
	a->n_fds = (size_t)n_fds;
	rep = bdfp4__attach_reply__unpack(NULL, (size_t)n, in);
	if (!rep) {
		e = bd_errf(errbuf, errlen, -EBADMSG, "the attach reply does not parse");
		goto fail;
	}
	if (rep->error != BDFP4__POOL_ERROR__POOL_OK) {
		e = bd_errf(errbuf, errlen, bd_pool_errno(rep->error), "kvpoold refused: %s",
			    rep->message);
		goto fail;
	}
	if (rep->version != BD_POOL_PROTO_VERSION) {
		e = bd_errf(errbuf, errlen, -EPROTO, "kvpoold speaks version %u, this client %d",
			    rep->version, BD_POOL_PROTO_VERSION);
		goto fail;
	}
	e = take_geometry(&a->geo, rep, rank, a->n_fds, geometry_only, errbuf, errlen);
	if (e < 0)
		goto fail;
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

int bd_pool_query(const char *socket_path, int rank, char *errbuf, size_t errlen,
		  struct bd_pool_geometry *ret)
{
	struct bd_pool_attach *a;
	int e;

	if (!ret)
		return bd_errf(errbuf, errlen, -EINVAL, "bad argument");
	e = attach_exchange(socket_path, rank, true, NULL, errbuf, errlen, &a);
	if (e < 0)
		return e;
	*ret = a->geo;
	bd_pool_detach(a);
	return 0;
}

int bd_pool_attach(const char *socket_path, int rank, const uint8_t *token, char *errbuf,
		   size_t errlen, struct bd_pool_attach **ret)
{
	struct bd_pool_attach *a;
	int e = attach_exchange(socket_path, rank, false, token, errbuf, errlen, &a);

	if (e < 0)
		return e;
	if (!strcmp(a->geo.backend, "cpu")) {
		e = map_chunks(a, errbuf, errlen);
		if (e < 0) {
			bd_pool_detach(a);
			return e;
		}
	}
	*ret = a;
	return 0;
}

bool bd_pool_geometry_same(const struct bd_pool_geometry *g, const struct bd_pool_geometry *h)
{
	if (!g || !h || memcmp(g->arena_id, h->arena_id, sizeof(g->arena_id)) ||
	    strcmp(g->backend, h->backend) || strcmp(g->kv_config, h->kv_config) ||
	    g->rank != h->rank || g->device != h->device || g->tp != h->tp ||
	    g->max_seq_len != h->max_seq_len || g->n_pages != h->n_pages ||
	    g->n_slots != h->n_slots || g->pages_offset != h->pages_offset ||
	    g->slots_offset != h->slots_offset || g->arena_bytes != h->arena_bytes ||
	    g->n_chunks != h->n_chunks || g->layout.page_bytes != h->layout.page_bytes ||
	    g->layout.slot_bytes != h->layout.slot_bytes)
		return false;
	for (size_t i = 0; i < g->n_chunks; i++)
		if (g->chunk_bytes[i] != h->chunk_bytes[i])
			return false;
	return true;
}

/* a and b attach the same arenas: the id, the geometry, and chunk files that are the same
 * files (fds of one open file, whichever process passed them on). */
static bool same_arenas(const struct bd_pool_attach *a, const struct bd_pool_attach *b)
{
	if (!bd_pool_geometry_same(&a->geo, &b->geo) || a->n_fds != b->n_fds)
		return false;
	for (size_t i = 0; i < a->n_fds; i++) {
		struct stat x, y;

		if (fstat(a->fds[i], &x) < 0 ||
		    fstat(b->fds[i], &y) < 0 || x.st_dev != y.st_dev || x.st_ino != y.st_ino)
			return false;
	}
	return true;
}

int bd_pool_reattach(struct bd_pool_attach *a, const char *socket_path, const uint8_t *token,
		     char *errbuf, size_t errlen)
{
	struct bd_pool_attach *b;
	int e;

	if (!a)
		return bd_errf(errbuf, errlen, -EINVAL, "bad argument");
	e = attach_exchange(socket_path, a->geo.rank, false, token, errbuf, errlen, &b);
	if (e < 0)
		return e;
	if (!same_arenas(a, b)) {
		bd_pool_detach(b);
		return bd_errf(errbuf, errlen, -ESTALE,
			       "kvpoold has other arenas now (it started empty): the pages held "
			       "before are gone");
	}
	/* the new connection is the attachment now; the memory is the one a has */
	close(a->sock);
	a->sock = b->sock;
	b->sock = -1;
	bd_pool_detach(b);
	return 0;
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
	void *ctx, *sock, *mon; /* REQ, and the PAIR end of its monitor */
	char *endpoint;
	int timeout_ms, retry_ms;
	unsigned sockets;       /* made so far: names each monitor's endpoint */
	uint64_t client, call;  /* repeat protection (kvpool.proto) */
	int code;
	char err[256];
	bool curve;             /* CURVE client with these keys (bd_pool_conn_set_curve) */
	char server_pub[BD_ZSEC_Z85 + 1];
	struct bd_zsec_keypair kp;
};

static void close_socket(struct bd_pool_conn *c)
{
	if (c->sock) {
		zmq_socket_monitor(c->sock, NULL, 0);
		zmq_close(c->sock);
	}
	if (c->mon)
		zmq_close(c->mon);
	c->sock = c->mon = NULL;
}

/* A fresh REQ socket connected to the endpoint, with a monitor that reports its connection
 * closing. Returns 0 or a ZeroMQ -errno. */
static int open_socket(struct bd_pool_conn *c)
{
	char mon[64];
	int zero = 0, e;

	snprintf(mon, sizeof(mon), "inproc://bd-pool-conn-%u", c->sockets++);
	c->sock = zmq_socket(c->ctx, ZMQ_REQ);
	c->mon = zmq_socket(c->ctx, ZMQ_PAIR);
	if (!c->sock || !c->mon || zmq_setsockopt(c->sock, ZMQ_LINGER, &zero, sizeof(zero)) < 0 ||
	    zmq_setsockopt(c->mon, ZMQ_LINGER, &zero, sizeof(zero)) < 0 ||
	    (c->curve && bd_zsec_client(c->sock, c->server_pub, &c->kp) < 0) ||
	    zmq_socket_monitor(c->sock, mon, ZMQ_EVENT_DISCONNECTED) < 0 ||
	    zmq_connect(c->mon, mon) < 0 || zmq_connect(c->sock, c->endpoint) < 0) {
		e = -(zmq_errno() ? zmq_errno() : ENOMEM);
		close_socket(c);
		return e;
	}
	return 0;
}

void bd_pool_conn_free(struct bd_pool_conn *c)
{
	if (!c)
		return;
	close_socket(c);
	if (c->ctx)
		zmq_ctx_term(c->ctx);
	free(c->endpoint);
	memset(&c->kp, 0, sizeof(c->kp));
	free(c);
}

int bd_pool_conn_new(const char *endpoint, int timeout_ms, struct bd_pool_conn **ret)
{
	struct bd_pool_conn *c;
	int e;

	if (!ret)
		return -EINVAL;
	if (!endpoint)
		endpoint = BD_POOL_DEFAULT_ENDPOINT;
	/* ZeroMQ retries a refused ipc connect silently: the caller would see a timeout */
	if (bd_ipc_endpoint_check(endpoint, 1000) == -EACCES)
		return -EACCES;
	c = calloc(1, sizeof(*c));
	if (!c)
		return -ENOMEM;
	c->timeout_ms = timeout_ms > 0 ? timeout_ms : 5000;
	c->endpoint = strdup(endpoint);
	c->ctx = zmq_ctx_new();
	if (!c->endpoint || !c->ctx) {
		bd_pool_conn_free(c);
		return -ENOMEM;
	}
	if (getrandom(&c->client, sizeof(c->client), 0) != sizeof(c->client))
		c->client = (uint64_t)getpid() << 32 ^ (uint64_t)bd_now_ms();
	c->client |= 1; /* never 0, which asks for no protection */
	e = open_socket(c);
	if (e < 0) {
		bd_pool_conn_free(c);
		return e;
	}
	*ret = c;
	return 0;
}

int bd_pool_conn_set_curve(struct bd_pool_conn *c, const char *server_key_file,
			   const char *secret_key_file, char *err, size_t cap)
{
	int e;

	if (!c)
		return -EINVAL;
	if ((!server_key_file || !*server_key_file) && (!secret_key_file || !*secret_key_file))
		return 0;
	if (!server_key_file || !*server_key_file || !secret_key_file || !*secret_key_file) {
		snprintf(err, cap, "a CURVE pool client needs kvpoold's public key file and its own "
			 "secret key file");
		return -EINVAL;
	}
	if ((e = bd_zsec_load_public(server_key_file, c->server_pub, err, cap)) < 0 ||
	    (e = bd_zsec_load_secret(secret_key_file, &c->kp, err, cap)) < 0)
		return e;
	c->curve = true;
	/* the options go on a socket before it connects: a fresh one */
	close_socket(c);
	if ((e = open_socket(c)) < 0)
		snprintf(err, cap, "%s: %s", c->endpoint, zmq_strerror(-e));
	return e;
}

int bd_pool_conn_set_retry(struct bd_pool_conn *c, int retry_ms)
{
	if (!c || retry_ms < 0)
		return -EINVAL;
	c->retry_ms = retry_ms;
	return 0;
}

const char *bd_pool_conn_error(const struct bd_pool_conn *c, int *ret_code)
{
	if (!c)
		return "";
	if (ret_code)
		*ret_code = c->code;
	return c->err;
}

/* True when the monitor reports the connection closed (events before now are read too). */
static bool disconnected(struct bd_pool_conn *c)
{
	bool seen = false;

	for (;;) {
		zmq_msg_t ev;
		uint16_t id = 0;
		int more = 0;
		size_t more_len = sizeof(more);

		/* [event id (16 bits) + value (32 bits)] [endpoint] */
		zmq_msg_init(&ev);
		if (zmq_msg_recv(&ev, c->mon, ZMQ_DONTWAIT) < 0) {
			zmq_msg_close(&ev);
			return seen;
		}
		if (zmq_msg_size(&ev) >= 2)
			memcpy(&id, zmq_msg_data(&ev), 2);
		seen |= id == ZMQ_EVENT_DISCONNECTED;
		zmq_getsockopt(c->mon, ZMQ_RCVMORE, &more, &more_len);
		zmq_msg_close(&ev);
		if (more) {
			zmq_msg_init(&ev);
			zmq_msg_recv(&ev, c->mon, ZMQ_DONTWAIT);
			zmq_msg_close(&ev);
		}
	}
}

/* One send and the wait for its answer, until end_ms: 0 and the reply in *m; -ETIMEDOUT;
 * -ECONNRESET when the connection closed first; a ZeroMQ -errno. */
static int attempt(struct bd_pool_conn *c, const void *frame, size_t len, int64_t end_ms,
		   zmq_msg_t *m)
{
	disconnected(c); /* what happened before this call is not its news */
	if (zmq_send(c->sock, frame, len, ZMQ_DONTWAIT) < 0)
		return zmq_errno() == EAGAIN ? -ETIMEDOUT : -zmq_errno();
	for (;;) {
		zmq_pollitem_t it[2] = {
			{ .socket = c->sock, .events = ZMQ_POLLIN },
			{ .socket = c->mon, .events = ZMQ_POLLIN },
		};
		int64_t left = end_ms - bd_now_ms();

		if (left <= 0)
			return -ETIMEDOUT;
		if (zmq_poll(it, 2, (long)left) < 0) {
			if (zmq_errno() == EINTR)
				continue;
			return -zmq_errno();
		}
		if (it[0].revents & ZMQ_POLLIN)
			return zmq_msg_recv(m, c->sock, ZMQ_DONTWAIT) < 0 ? -zmq_errno() : 0;
		if ((it[1].revents & ZMQ_POLLIN) && disconnected(c))
			return -ECONNRESET;
	}
}

/* The round trip of frame: attempts of up to timeout_ms each, a fresh socket after each that
 * failed, more of them until retry_ms since the first when retry is set. 0 and the reply in
 * *ret_reply (*ret_len bytes), or -errno with the text in c->err. */
static int roundtrip(struct bd_pool_conn *c, const void *frame, size_t len, bool retry,
		     void **ret_reply, size_t *ret_len)
{
	int64_t start = bd_now_ms(), end = start + (retry ? c->retry_ms : 0);
	zmq_msg_t m;
	void *out;
	int e;

	if (len > BD_POOL_FRAME_HARD_MAX) {
		c->code = BD_POOL_OK;
		return bd_errf(c->err, sizeof(c->err), -EMSGSIZE,
			       "a frame of %zu bytes is over kvpoold's hard limit of %d", len,
			       BD_POOL_FRAME_HARD_MAX);
	}
	for (int n = 0;; n++) {
		int64_t until = bd_now_ms() + c->timeout_ms;

		/* the first send gets its whole timeout, repeats what is left of retry_ms */
		if (n && until > end)
			until = end;
		e = c->sock ? 0 : open_socket(c);
		zmq_msg_init(&m);
		if (e == 0)
			e = attempt(c, frame, len, until, &m);
		if (e == 0)
			break;
		zmq_msg_close(&m);
		/* the socket may hold the lost request or wait for its reply: never reused */
		close_socket(c);
		if (!retry || bd_now_ms() >= end)
			goto fail;
		if (e == -ECONNRESET)
			usleep(10000); /* the daemon is gone: give its successor a moment to bind */
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
	if (e == -ETIMEDOUT)
		return bd_errf(c->err, sizeof(c->err), e, "kvpoold: no answer in %lld ms",
			       (long long)(bd_now_ms() - start));
	return bd_errf(c->err, sizeof(c->err), e, "kvpoold: %s", strerror(-e));
}

int bd_pool_call_raw(struct bd_pool_conn *c, const void *frame, size_t len, void **ret_reply,
		     size_t *ret_len)
{
	if (!c || (!frame && len) || !ret_reply || !ret_len)
		return -EINVAL;
	return roundtrip(c, frame, len, false, ret_reply, ret_len);
}

/* What a call takes out of a POOL_OK reply; NULL members are not wanted. */
struct take {
	int32_t *pages; /* exactly n_pages page ids, else -EBADMSG */
	uint32_t n_pages;
	int32_t *slot;
	uint64_t *requests, *freed;
	Bdfp4__PoolReply **reply; /* the whole reply, freed by the caller */
};

/* The round trip of every allocation call: op packed and sent, the reply parsed, a refusal
 * turned into its -errno, what t asks for copied out of a success. */
static int call(struct bd_pool_conn *c, const struct bd_pool_op *op_in, struct take t)
{
	struct bd_pool_op op = op_in ? *op_in : (struct bd_pool_op){ 0 };
	Bdfp4__PoolReply *rep;
	ssize_t len;
	void *frame, *rbuf;
	size_t rlen;
	int e;

	if (!c || !op_in)
		return -EINVAL;
	op.client = c->client;
	op.call = ++c->call;
	len = bd_pool_op_pack(&op, NULL, 0);
	if (len < 0)
		return (int)len;
	frame = malloc(len ? (size_t)len : 1);
	if (!frame)
		return -ENOMEM;
	bd_pool_op_pack(&op, frame, (size_t)len);
	e = roundtrip(c, frame, (size_t)len, c->retry_ms > 0, &rbuf, &rlen);
	free(frame);
	if (e < 0)
		return e;
	rep = bdfp4__pool_reply__unpack(NULL, rlen, rbuf);
	free(rbuf);
	if (!rep) {
		c->code = BD_POOL_OK;
		return bd_errf(c->err, sizeof(c->err), -EBADMSG,
			       "kvpoold: the reply does not parse");
	}
	if (rep->error != BDFP4__POOL_ERROR__POOL_OK) {
		c->code = rep->error;
		e = bd_errf(c->err, sizeof(c->err), bd_pool_errno(rep->error), "%s", rep->message);
		bdfp4__pool_reply__free_unpacked(rep, NULL);
		return e;
	}
	c->code = BD_POOL_OK;
	c->err[0] = 0;
	if (t.pages && rep->n_pages != t.n_pages)
		e = -EBADMSG;
	else if (t.pages)
		memcpy(t.pages, rep->pages, t.n_pages * sizeof(int32_t));
	if (t.slot)
		*t.slot = rep->slot;
	if (t.requests)
		*t.requests = rep->requests_released;
	if (t.freed)
		*t.freed = rep->pages_freed;
	if (t.reply && e == 0)
		*t.reply = rep;
	else
		bdfp4__pool_reply__free_unpacked(rep, NULL);
	return e;
}

/* ---- allocation calls ------------------------------------------------------------------------- */

int bd_pool_page_alloc(struct bd_pool_conn *c, uint64_t request_id, uint64_t owner, uint32_t n,
		       int32_t *ret_pages)
{
	struct bd_pool_op op = { BD_POOL_OP_PAGE_ALLOC, request_id, owner, .n = n };

	if (!ret_pages || n == 0)
		return -EINVAL;
	return call(c, &op, (struct take){ .pages = ret_pages, .n_pages = n });
}

int bd_pool_page_reserve(struct bd_pool_conn *c, uint64_t request_id, uint64_t owner,
			 int32_t *ret_page)
{
	struct bd_pool_op op = { BD_POOL_OP_PAGE_RESERVE, request_id, owner };

	if (!ret_page)
		return -EINVAL;
	return call(c, &op, (struct take){ .pages = ret_page, .n_pages = 1 });
}

int bd_pool_page_commit(struct bd_pool_conn *c, uint64_t request_id, int32_t page)
{
	struct bd_pool_op op = { BD_POOL_OP_PAGE_COMMIT, request_id, .index = page };

	return call(c, &op, (struct take){ 0 });
}

int bd_pool_page_free(struct bd_pool_conn *c, uint64_t request_id, const int32_t *pages,
		      size_t n, uint64_t *ret_freed)
{
	struct bd_pool_op op = { BD_POOL_OP_PAGE_FREE, request_id, .pages = pages, .n_pages = n };

	return call(c, &op, (struct take){ .freed = ret_freed });
}

int bd_pool_page_ref(struct bd_pool_conn *c, uint64_t request_id, uint64_t owner,
		     const int32_t *pages, size_t n)
{
	struct bd_pool_op op = { BD_POOL_OP_PAGE_REF, request_id, owner, .pages = pages,
				 .n_pages = n };

	return call(c, &op, (struct take){ 0 });
}

int bd_pool_prefix_store(struct bd_pool_conn *c, uint64_t request_id, const int32_t *pages,
			 const uint64_t *hashes, size_t n, const int32_t *tokens, size_t n_tokens,
			 uint64_t parent, uint64_t *ret_stored)
{
	struct bd_pool_op op = { BD_POOL_OP_PREFIX_STORE, request_id, .pages = pages,
				 .n_pages = n, .hashes = hashes, .n_hashes = n, .tokens = tokens,
				 .n_tokens = n_tokens, .parent = parent };
	Bdfp4__PoolReply *rep = NULL;
	int e = call(c, &op, (struct take){ .reply = &rep });

	if (e == 0 && ret_stored)
		*ret_stored = rep->pages_stored;
	if (rep)
		bdfp4__pool_reply__free_unpacked(rep, NULL);
	return e;
}

int bd_pool_prefix_match(struct bd_pool_conn *c, uint64_t request_id, uint64_t owner,
			 const uint64_t *hashes, size_t n, int32_t *ret_pages, size_t *ret_n)
{
	struct bd_pool_op op = { BD_POOL_OP_PREFIX_MATCH, request_id, owner, .hashes = hashes,
				 .n_hashes = n };
	Bdfp4__PoolReply *rep = NULL;
	int e;

	if (!ret_n || (n && !ret_pages))
		return -EINVAL;
	*ret_n = 0;
	e = call(c, &op, (struct take){ .reply = &rep });
	if (e == 0 && rep->n_pages > n)
		e = -EBADMSG;
	if (e == 0 && rep->n_pages) /* a miss carries no page array (NULL) */
		memcpy(ret_pages, rep->pages, rep->n_pages * sizeof(int32_t));
	if (e == 0)
		*ret_n = rep->n_pages;
	if (rep)
		bdfp4__pool_reply__free_unpacked(rep, NULL);
	return e;
}

int bd_pool_prefix_clear(struct bd_pool_conn *c, uint64_t *ret_dropped)
{
	struct bd_pool_op op = { BD_POOL_OP_PREFIX_CLEAR };

	return call(c, &op, (struct take){ .freed = ret_dropped });
}

int bd_pool_slot_assign(struct bd_pool_conn *c, uint64_t request_id, uint64_t owner,
			int32_t *ret_slot)
{
	struct bd_pool_op op = { BD_POOL_OP_SLOT_ASSIGN, request_id, owner };

	if (!ret_slot)
		return -EINVAL;
	return call(c, &op, (struct take){ .slot = ret_slot });
}

int bd_pool_slot_release(struct bd_pool_conn *c, uint64_t request_id, int32_t slot)
{
	struct bd_pool_op op = { BD_POOL_OP_SLOT_RELEASE, request_id, .index = slot };

	return call(c, &op, (struct take){ 0 });
}

int bd_pool_request_release(struct bd_pool_conn *c, uint64_t request_id,
			    uint64_t *ret_pages_freed)
{
	struct bd_pool_op op = { BD_POOL_OP_REQUEST_RELEASE, request_id };

	return call(c, &op, (struct take){ .freed = ret_pages_freed });
}

int bd_pool_owner_reclaim(struct bd_pool_conn *c, uint64_t owner, uint64_t *ret_requests,
			  uint64_t *ret_pages_freed)
{
	struct bd_pool_op op = { BD_POOL_OP_OWNER_RECLAIM, .owner = owner };

	return call(c, &op, (struct take){ .requests = ret_requests, .freed = ret_pages_freed });
}

int bd_pool_group_register(struct bd_pool_conn *c, uint64_t owner, uint64_t epoch,
			   const uint8_t *tokens, size_t tp)
{
	struct bd_pool_op op = { BD_POOL_OP_GROUP_REGISTER, .owner = owner, .epoch = epoch,
				 .bytes = tokens, .n_bytes = tp * BD_POOL_TOKEN_BYTES };

	if (!tokens || tp == 0 || tp > BD_POOL_MAX_TP || epoch == 0)
		return -EINVAL;
	return call(c, &op, (struct take){ 0 });
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
	struct bd_pool_op op = { BD_POOL_OP_STATS, .n = top };
	Bdfp4__PoolReply *rep;
	const Bdfp4__PoolStats *p;
	struct bd_pool_stats *s;
	size_t bytes;
	int e;

	if (!ret)
		return -EINVAL;
	e = call(c, &op, (struct take){ .reply = &rep });
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
	s->pages_cached = p->pages_cached;
	s->pages_cached_idle = p->pages_cached_idle;
	s->prefix_queries = p->prefix_queries;
	s->prefix_hits = p->prefix_hits;
	s->prefix_stored = p->prefix_stored;
	s->prefix_evictions = p->prefix_evictions;
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
	if (p->arena_id.len == sizeof(s->arena_id))
		memcpy(s->arena_id, p->arena_id.data, sizeof(s->arena_id));
	s->group_epoch = p->group_epoch;
	s->group_owner = p->group_owner;
	s->attach_refused = p->attach_refused;
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
	struct bd_pool_op op = { BD_POOL_OP_REQUESTS };
	Bdfp4__PoolReply *rep;
	struct bd_pool_holder *h;
	int e;

	if (!ret || !ret_n)
		return -EINVAL;
	e = call(c, &op, (struct take){ .reply = &rep });
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
