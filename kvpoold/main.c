/* kvpoold — the KV pool daemon (DESIGN.md).
 *
 * Owns every byte of KV memory on the node (one arena per TP rank: FP4 pages of every layer and
 * the BF16 slots) and the record of who holds what. It never computes. One event loop polls the
 * allocation socket (ZeroMQ REP), the attach socket (Unix SOCK_SEQPACKET) and its clients, and
 * the signal fd (bd_daemon.h), with a periodic tick for sd_notify STATUS/WATCHDOG and handshake
 * timeouts.
 *
 * Configuration: [pool] of /etc/bdfp4/bdfp4.conf, every key overridable by a flag of the same
 * name (--max-seq-len=N for max_seq_len). Exit: 0 after SIGTERM/SIGINT, 1 on a fatal error.
 *
 * Restarts: the arena chunks and a memfd with the allocation state (state.c) go to systemd's fd
 * store at start (FDSTORE=1, one FDNAME each: arena-r<rank>-c<chunk>, state), and the state is
 * saved after every allocation call that changed it, before its reply is sent. Started with
 * stored fds (LISTEN_FDS), the daemon adopts them when the state record matches its
 * configuration: the same memory, every page, slot, reference and owner as before. A record that
 * does not match (another geometry, corrupted, truncated, an unknown version) is refused with
 * the reason in the log; the stored fds are then dropped and the daemon starts empty.
 */
#include <errno.h>
#include <grp.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <systemd/sd-daemon.h>
#include <zmq.h>

#include "base/bd_clock.h"
#include "base/bd_config.h"
#include "base/bd_daemon.h"
#include "base/bd_ipc.h"
#include "base/bd_zsec.h"
#include "base/bd_log.h"
#include "quant/bd_kvcfg.h"
#include "pool/bd_pool_client.h"
#include "kvpool.h"
#include "kvpool.pb-c.h"

#define SECTION "pool"
#define REPLAY_CLIENTS 64 /* clients whose last call is kept for repeats (handler.c) */

struct opts {
	const char *socket, *endpoint, *backend, *kv_config;
	gid_t group;
	int tp, layers, kv_heads, heads_per_rank, head_dim, d_rope;
	uint32_t max_seq_len;
	size_t slots, pages, max_requests, max_frame, max_clients;
	uint64_t memory_bytes, chunk_bytes;
	double fraction;
	int status_ms, attach_ms, stats_top;
	mode_t socket_mode;
	struct bd_kvpool_quota quota;
	bool scrub;
	const char *kv_events, *kv_events_replay, *kv_events_topic;
	size_t kv_events_buffer;
};

#define OPT(t, field, lo, hi) BD_CONFIG_FIELD(t, struct opts, field, lo, hi)
#define TEXT(field) BD_CONFIG_TEXT(struct opts, field)
static const struct bd_config_key keys[] = {
	{ "socket", BD_POOL_DEFAULT_SOCKET, "attach socket (Unix, mode 0660)", TEXT(socket) },
	{ "endpoint", BD_POOL_DEFAULT_ENDPOINT, "allocation endpoint (ZeroMQ REP)", TEXT(endpoint) },
	{ "curve_secret_key", "",
	  "kvpoold's CURVE secret key file (bdfp4 keygen; mode 0600): with curve_clients the "
	  "allocation endpoint speaks CURVE" },
	{ "curve_clients", "",
	  "allow-list of the CURVE public keys of the allocation endpoint's clients (the router, "
	  "kvpoolctl)" },
	{ "insecure_tcp", "false",
	  "allow a plain (unauthenticated, unencrypted) TCP endpoint off loopback", true },
	{ "group", "", "group allowed to attach (name or gid; empty: root and our uid)" },
	{ "socket_mode", "0660",
	  "file mode of the attach socket and of an ipc:// allocation endpoint, set after bind "
	  "whatever the umask", OPT(INT, socket_mode, 0, 0777) },
	{ "backend", "cpu", "memory backend: cpu (memfd) or cuda (VMM, one GPU per rank)",
	  TEXT(backend) },
	{ "tp", "2", "tensor-parallel ranks, one arena each", OPT(INT, tp, 1, 64) },
	{ "kv_config", "bitdecoding-nvfp4", "KV configuration (NUMERICS.md 9): page format",
	  TEXT(kv_config) },
	{ "layers", "30", "model layers", OPT(INT, layers, 1, 4096) },
	{ "kv_heads", "3", "model KV heads (all ranks)", OPT(INT, kv_heads, 1, 4096) },
	{ "kv_heads_per_rank", "0", "KV heads in one rank's pages (0: ceil(kv_heads / tp))",
	  OPT(INT, heads_per_rank, 0, 4096) },
	{ "head_dim", "64", "head dim d (latent d_c for MLA)", OPT(INT, head_dim, 32, 1024) },
	{ "d_rope", "0", "MLA positional dim (0: GQA)", OPT(INT, d_rope, 0, 1024) },
	{ "max_seq_len", "8192", "tokens of the longest request; the pool must hold one",
	  OPT(INT, max_seq_len, 1, 1 << 30) },
	{ "slots", "16", "BF16 slots (running requests)", OPT(INT, slots, 1, 1 << 20) },
	{ "memory_bytes", "512M", "arena budget per device (K/M/G suffixes); 0: use the fraction",
	  OPT(BYTES, memory_bytes, 0, UINT64_MAX / 2) },
	{ "gpu_memory_fraction", "0", "budget as a fraction of device memory (cpu: of RAM / tp)",
	  OPT(DOUBLE, fraction, 0, 1) },
	{ "pages", "0", "fixed page count (0: as many as the budget holds)",
	  OPT(INT, pages, 0, INT32_MAX) },
	{ "chunk_bytes", "1G", "largest arena chunk (one fd each)",
	  OPT(BYTES, chunk_bytes, 0, UINT64_MAX / 2) },
	{ "max_requests", "4096", "request records", OPT(INT, max_requests, 1, 1 << 24) },
	{ "max_frame_bytes", "65536",
	  "largest allocation frame (at most 16M); a larger one gets an OVERSIZE error reply, "
	  "but one over 16M (16777216 bytes) gets none: its connection is closed",
	  OPT(INT, max_frame, 64, BD_POOL_FRAME_HARD_MAX) },
	{ "max_clients", "64", "attach connections", OPT(INT, max_clients, 1, 4096) },
	BD_DAEMON_KEY_STATUS_INTERVAL(struct opts, status_ms),
	{ "attach_timeout_ms", "5000", "time a new connection has to send its attach request",
	  OPT(INT, attach_ms, 10, 3600000) },
	{ "stats_top", "8", "largest holders in stats", OPT(INT, stats_top, 0, 64) },
	{ "owner_max_pages", "0",
	  "page references one owner (router) may hold at once; 0: no limit beyond the pool's",
	  OPT(INT, quota.pages, 0, INT32_MAX) },
	{ "owner_max_slots", "0", "BF16 slots one owner may hold at once; 0: no limit",
	  OPT(INT, quota.slots, 0, INT32_MAX) },
	{ "owner_max_requests", "0", "request records one owner may hold at once; 0: no limit",
	  OPT(INT, quota.requests, 0, 1 << 24) },
	{ "scrub", "true",
	  "zero a page's and a slot's bytes when they are freed, before another request gets "
	  "them (cpu backend only: kvpoold does not map the cuda backend's memory)", false,
	  OPT(BOOL, scrub, 0, 1) },
	{ "kv_events", "",
	  "ZeroMQ PUB endpoint of the KV event stream (vLLM's BlockStored/BlockRemoved/"
	  "AllBlocksCleared of the prefix index, for Dynamo or llm-d); empty: none",
	  TEXT(kv_events) },
	{ "kv_events_replay", "",
	  "ZeroMQ ROUTER endpoint where a subscriber asks for the kept batches from a sequence "
	  "number on; empty: none", TEXT(kv_events_replay) },
	{ "kv_events_topic", "", "topic frame of every event message", TEXT(kv_events_topic) },
	{ "kv_events_buffer", "1000", "event batches kept for replay",
	  OPT(INT, kv_events_buffer, 1, 1 << 20) },
	{ NULL, NULL, NULL },
};
#undef OPT
#undef TEXT

struct client {
	int fd;
	bool attached;
	int rank;
	pid_t pid;
	uid_t uid;
	gid_t gid;
	int64_t deadline_ms; /* for the attach request */
};


struct ctx {
	struct bd_daemon d;
	struct opts o;
	const struct bd_kvcfg *kvcfg;
	const struct bd_kvpool_mem_ops *mem;
	struct bd_kvpool_plan plan;
	struct bd_kvpool_arena *arenas; /* [tp] */
	int n_arenas;

	struct bd_kvpool_alloc *alloc;
	struct bd_kvpool_replay *replay;
	struct bd_kvpool_handler handler;
	struct bd_kvpool_info info;

	/* the state record (state.c) and what it was made for */
	/* the KV event stream (events.c): PUB and replay ROUTER sockets, NULL when off */
	struct bd_kvpool_events *events;
	void *ev_pub, *ev_replay;

	struct bd_kvpool_state *state;
	struct bd_kvpool_state_geo geo;
	uint64_t saved_alloc, saved_replay; /* the change counters the last record holds */
	bool save_failed;                   /* logged once */

	/* the fds systemd passed (LISTEN_FDS): -1 once adopted or closed */
	int n_stored;
	int *stored_fds;
	char **stored_names;
	struct bd_pool_device *devices;
	struct bd_pool_attachment *attachments;
	struct bd_kvpool_scrub *scrub; /* NULL: freed memory is not cleared here */

	void *zctx, *rep;
	struct bd_zsec_zap *zap;        /* the ZAP handler while the endpoint speaks CURVE */
	struct bd_zsec_keypair curve_kp;
	int listen_fd;
	bool socket_bound;
	bool rep_bound; /* the allocation endpoint is ours (unlink its ipc file at exit) */
	struct client *clients;
	size_t n_clients;

	int64_t next_status;
	bool stop;
};

/* ---- configuration ------------------------------------------------------------------------- */

static int resolve_group(const char *s, gid_t *ret)
{
	struct group *g;
	char *end;
	long v;

	if (!*s) {
		*ret = (gid_t)-1;
		return 0;
	}
	v = strtol(s, &end, 10);
	if (!*end && v >= 0 && v < INT_MAX) {
		*ret = (gid_t)v;
		return 0;
	}
	g = getgrnam(s);
	if (!g)
		return -ENOENT;
	*ret = g->gr_gid;
	return 0;
}

static int read_opts(struct ctx *c)
{
	struct opts *o = &c->o;
	const struct bd_daemon *d = &c->d;

	if (bd_daemon_read_opts(d, o) < 0)
		return -EINVAL;
	if (resolve_group(bd_daemon_get_str(d, "group"), &o->group) < 0) {
		bd_log_err("group '%s' does not exist", bd_daemon_get_str(d, "group"));
		return -EINVAL;
	}
	if (o->chunk_bytes == 0) {
		bd_log_err("chunk_bytes must be positive");
		return -EINVAL;
	}
	if (!o->heads_per_rank)
		o->heads_per_rank = (o->kv_heads + o->tp - 1) / o->tp;
	c->kvcfg = bd_kvcfg_find(o->kv_config);
	if (!c->kvcfg) {
		bd_log_err("unknown kv_config '%s'", o->kv_config);
		return -EINVAL;
	}
	c->mem = bd_kvpool_mem_find(o->backend);
	if (!c->mem) {
		bd_log_err("unknown backend '%s' (cpu or cuda)", o->backend);
		return -EINVAL;
	}
	return 0;
}

/* ---- the fd store and the state record ----------------------------------------------------- */

/* The fds a service manager passed us (LISTEN_FDS, LISTEN_PID, LISTEN_FDNAMES): ours to adopt
 * or drop. Returns 0 or -ENOMEM. */
static int take_stored(struct ctx *c)
{
	char **names = NULL;
	int n = sd_listen_fds_with_names(1, &names);

	if (n > 0)
		c->stored_fds = calloc((size_t)n, sizeof(*c->stored_fds));
	if (n <= 0 || !c->stored_fds) {
		if (n < 0)
			bd_log_warn("the passed fds (LISTEN_FDS): %s; starting empty",
				    strerror(-n));
		for (int i = 0; i < n; i++)
			close(SD_LISTEN_FDS_START + i);
		for (size_t i = 0; names && names[i]; i++)
			free(names[i]);
		free(names);
		return n > 0 ? -ENOMEM : 0;
	}
	c->n_stored = n;
	c->stored_names = names;
	for (int i = 0; i < n; i++)
		c->stored_fds[i] = SD_LISTEN_FDS_START + i;
	bd_log_info("%d fd(s) from the service manager's fd store", n);
	return 0;
}

/* The stored fd named name, taken out of the list (the caller owns it), or -1. */
static int take_fd(struct ctx *c, const char *name)
{
	for (int i = 0; i < c->n_stored; i++)
		if (c->stored_fds[i] >= 0 && c->stored_names && c->stored_names[i] &&
		    !strcmp(c->stored_names[i], name)) {
			int fd = c->stored_fds[i];

			c->stored_fds[i] = -1;
			return fd;
		}
	return -1;
}

/* Closes the stored fds not adopted and asks the service manager to forget them too; with all,
 * every stored name (a refused state's arenas must not come back at the next restart). */
static void drop_stored(struct ctx *c, bool all)
{
	for (int i = 0; i < c->n_stored; i++) {
		const char *name = c->stored_names ? c->stored_names[i] : NULL;
		bool left = c->stored_fds[i] >= 0;

		if (left)
			close(c->stored_fds[i]);
		c->stored_fds[i] = -1;
		/* sd_listen_fds_with_names names an fd "unknown" without LISTEN_FDNAMES */
		if ((left || all) && name && *name && strcmp(name, "unknown"))
			sd_notifyf(0, "FDSTOREREMOVE=1\nFDNAME=%s", name);
	}
}

static void free_stored(struct ctx *c)
{
	for (int i = 0; i < c->n_stored; i++) {
		if (c->stored_fds[i] >= 0)
			close(c->stored_fds[i]);
		if (c->stored_names)
			free(c->stored_names[i]);
	}
	free(c->stored_fds);
	free(c->stored_names);
	c->n_stored = 0;
}

static void chunk_name(char *buf, size_t len, int rank, size_t chunk)
{
	snprintf(buf, len, "arena-r%d-c%zu", rank, chunk);
}

/* What this configuration makes: the geometry a stored record must have. */
static void fill_geo(struct ctx *c)
{
	struct bd_kvpool_state_geo *g = &c->geo;

	memset(g, 0, sizeof(*g));
	snprintf(g->backend, sizeof(g->backend), "%s", c->mem->name);
	snprintf(g->kv_config, sizeof(g->kv_config), "%s", c->kvcfg->name);
	g->tp = (uint32_t)c->o.tp;
	g->page_format = c->plan.layout.fmt;
	g->n_layers = (uint32_t)c->plan.layout.n_layers;
	g->n_kv_heads = (uint32_t)c->plan.layout.n_kv_heads;
	g->head_dim = (uint32_t)c->plan.layout.d;
	g->d_rope = (uint32_t)c->plan.layout.d_rope;
	g->max_seq_len = c->o.max_seq_len;
	g->max_pages_per_request = c->plan.max_pages_per_request;
	g->n_pages = c->plan.n_pages;
	g->n_slots = c->plan.n_slots;
	g->max_requests = c->o.max_requests;
	g->page_bytes = c->plan.layout.page_bytes;
	g->slot_bytes = c->plan.layout.slot_bytes;
	g->pages_offset = c->plan.pages_offset;
	g->slots_offset = c->plan.slots_offset;
	g->arena_bytes = c->plan.arena_bytes;
	g->n_chunks = c->plan.n_chunks;
	g->chunk_bytes = c->plan.chunk_bytes;
	g->last_chunk_bytes = c->plan.last_chunk_bytes;
	g->replay_clients = REPLAY_CLIENTS;
	g->replay_reply_max = bd_kvpool_replay_reply_max(c->plan.max_pages_per_request);
}

static void arena_id_text(const uint8_t id[16], char out[33])
{
	for (int i = 0; i < 16; i++)
		snprintf(out + 2 * i, 3, "%02x", id[i]);
}

/* The stored state and arenas, when they are what this configuration makes. Returns true when
 * adopted; false when there was nothing to adopt or it was refused (logged with the reason),
 * with the allocator and the replay table empty and no arena made. */
static bool adopt_stored(struct ctx *c)
{
	char err[400], why[300], id[33];
	int fd, e, fds[BD_POOL_MAX_CHUNKS];
	struct bd_kvpool_counts k;

	if (!c->n_stored)
		return false;
	fd = take_fd(c, BD_KVPOOL_STATE_FDNAME);
	if (fd < 0) {
		bd_log_warn("the stored fds hold no state record ('%s'): starting empty",
			    BD_KVPOOL_STATE_FDNAME);
		return false;
	}
	e = bd_kvpool_state_open(fd, &c->state, err, sizeof(err));
	if (e < 0) {
		close(fd);
		goto refused;
	}
	e = bd_kvpool_state_load(c->state, &c->geo, c->replay, c->alloc, c->geo.arena_id, err,
				 sizeof(err));
	if (e < 0)
		goto refused;
	for (int r = 0; r < c->o.tp; r++) {
		for (size_t i = 0; i < c->plan.n_chunks; i++) {
			char name[48];

			chunk_name(name, sizeof(name), r, i);
			fds[i] = take_fd(c, name);
			if (fds[i] < 0) {
				snprintf(err, sizeof(err), "no stored fd '%s'", name);
				for (size_t j = 0; j < i; j++)
					close(fds[j]);
				e = -ENOENT;
				goto refused;
			}
		}
		e = c->mem->arena_adopt(r, &c->plan, fds, &c->arenas[r], why, sizeof(why));
		if (e < 0) {
			for (size_t j = 0; j < c->plan.n_chunks; j++)
				close(fds[j]);
			snprintf(err, sizeof(err), "the arena of rank %d: %.300s", r, why);
			goto refused;
		}
		c->n_arenas = r + 1;
	}
	c->saved_alloc = bd_kvpool_alloc_changes(c->alloc);
	c->saved_replay = bd_kvpool_replay_changes(c->replay);
	/* fds of other names (none that this configuration stores) */
	drop_stored(c, false);
	bd_kvpool_alloc_counts(c->alloc, &k);
	arena_id_text(c->geo.arena_id, id);
	bd_log_info("adopted the stored arenas and state (arena id %s): %zu of %zu pages held "
		    "(%zu reserved, %zu shared), %zu of %zu slots, %zu request record(s)", id,
		    k.pages_total - k.pages_free, k.pages_total, k.pages_reserved, k.pages_shared,
		    k.slots_total - k.slots_free, k.slots_total, k.requests);
	return true;
refused:
	bd_log_err("the stored state is refused: %s; starting empty (the stored fds are dropped)",
		   err);
	for (int r = 0; r < c->n_arenas; r++)
		c->mem->arena_destroy(&c->arenas[r]);
	c->n_arenas = 0;
	bd_kvpool_state_free(c->state);
	c->state = NULL;
	bd_kvpool_alloc_load(c->alloc, NULL, 0);
	bd_kvpool_replay_load(c->replay, NULL, 0);
	return false;
}

/* Hands fd to the service manager's fd store under name. Returns sd_pid_notify_with_fds'
 * result: > 0 sent, 0 no service manager, < 0 an error. */
static int store_fd(const char *name, int fd)
{
	char msg[128];

	/* FDPOLL=0: memfds and exported VMM fds never signal a hang-up worth dropping them for */
	snprintf(msg, sizeof(msg), "FDSTORE=1\nFDNAME=%s\nFDPOLL=0", name);
	return sd_pid_notify_with_fds(0, 0, msg, &fd, 1);
}

/* The chunks of every arena, then the state memfd, to the fd store (the state last: a state
 * record is stored only beside its arenas). */
static void store_all(struct ctx *c)
{
	const char *limit = getenv("FDSTORE");
	int n = 0, e = 0;

	for (int r = 0; r < c->n_arenas && e >= 0; r++)
		for (size_t i = 0; i < c->arenas[r].n_chunks && e >= 0; i++) {
			char name[48];

			chunk_name(name, sizeof(name), r, i);
			e = store_fd(name, c->arenas[r].chunks[i].fd);
			n++;
		}
	if (e >= 0) {
		e = store_fd(BD_KVPOOL_STATE_FDNAME, bd_kvpool_state_fd(c->state));
		n++;
	}
	if (e < 0)
		bd_log_warn("storing fds with the service manager: %s; a restart starts empty",
			    strerror(-e));
	else if (e == 0)
		bd_log_info("no service manager (NOTIFY_SOCKET unset): the pool's memory and state "
			    "end with this process");
	else if (limit && atoi(limit) < n)
		/* systemd names its FileDescriptorStoreMax= in $FDSTORE */
		bd_log_warn("FileDescriptorStoreMax=%s is below the %d fds the pool stores: a "
			    "restart starts empty", limit, n);
	else
		bd_log_info("%d fd(s) stored with the service manager (arenas and state)", n);
}

/* Fresh arenas, an empty state record (so that a restart before the first allocation finds
 * these arenas), a new arena id; all of them stored. */
static int create_memory(struct ctx *c)
{
	char err[512];
	size_t max = bd_kvpool_state_record_max(&c->geo);
	int e;

	for (int r = 0; r < c->o.tp; r++) {
		e = c->mem->arena_create(r, &c->plan, &c->arenas[r], err, sizeof(err));
		if (e < 0) {
			bd_log_err("arena of rank %d: %s", r, err);
			return e;
		}
		c->n_arenas = r + 1;
	}
	if (getrandom(c->geo.arena_id, sizeof(c->geo.arena_id), 0) !=
	    (ssize_t)sizeof(c->geo.arena_id)) {
		bd_log_err("getrandom: %s", strerror(errno));
		return -EIO;
	}
	if (!max) {
		bd_log_err("the state record of %zu request records of up to %u pages overflows",
			   c->o.max_requests, c->plan.max_pages_per_request);
		return -EOVERFLOW;
	}
	e = bd_kvpool_state_create(max, &c->state, err, sizeof(err));
	if (e == 0)
		e = bd_kvpool_state_save(c->state, &c->geo, c->replay, c->alloc);
	if (e < 0) {
		bd_log_err("state record: %s", e == -ENOSPC ? "too small" : err);
		return e;
	}
	store_all(c);
	return 0;
}

/* A new record after a call that changed the pool or the replay table; before the reply goes
 * out, so that what a client was told survives a kill. */
static void save_state(struct ctx *c)
{
	uint64_t a = bd_kvpool_alloc_changes(c->alloc), r = bd_kvpool_replay_changes(c->replay);
	int e;

	if (a == c->saved_alloc && r == c->saved_replay)
		return;
	e = bd_kvpool_state_save(c->state, &c->geo, c->replay, c->alloc);
	if (e < 0) {
		if (!c->save_failed)
			bd_log_err("saving the state record: %s; a restart would adopt an older "
				   "state", strerror(-e));
		c->save_failed = true;
		return;
	}
	c->saved_alloc = a;
	c->saved_replay = r;
}

/* ---- memory -------------------------------------------------------------------------------- */

static int setup_memory(struct ctx *c)
{
	struct bd_kvpool_params p = { 0 };
	char err[512];
	uint64_t budget = c->o.memory_bytes;
	int e;

	e = c->mem->supported(c->o.tp, err, sizeof(err));
	if (e < 0) {
		bd_log_err("backend %s: %s", c->mem->name, err);
		return e;
	}
	e = c->mem->granularity(0, &p.granularity, err, sizeof(err));
	if (e < 0) {
		bd_log_err("backend %s: %s", c->mem->name, err);
		return e;
	}
	if (!c->o.pages && !budget) {
		uint64_t total;

		if (c->o.fraction <= 0) {
			bd_log_err("no pool budget: set memory_bytes, gpu_memory_fraction or pages");
			return -EINVAL;
		}
		/* ranks share one budget on the CPU, each has its own device on CUDA */
		e = c->mem->device_memory(0, &total, err, sizeof(err));
		if (e < 0) {
			bd_log_err("backend %s: %s", c->mem->name, err);
			return e;
		}
		budget = (uint64_t)((double)total * c->o.fraction);
		if (c->mem == &bd_kvpool_mem_cpu)
			budget /= (uint64_t)c->o.tp;
	}
	if (budget) {
		/* an absolute budget must fit the device (CUDA) or, shared by the ranks, the RAM */
		uint64_t total, need = budget;
		if (c->mem == &bd_kvpool_mem_cpu)
			need *= (uint64_t)c->o.tp;
		if (c->mem->device_memory(0, &total, err, sizeof(err)) == 0 && need > total) {
			bd_log_err("memory_bytes = %llu per rank: %llu bytes in all, more than the %llu "
				"bytes of %s", (unsigned long long)budget, (unsigned long long)need,
				(unsigned long long)total,
				c->mem == &bd_kvpool_mem_cpu ? "RAM" : "device memory");
			return -EINVAL;
		}
	}
	p.fmt = c->kvcfg->page_fmt;
	p.n_layers = c->o.layers;
	p.n_kv_heads = c->o.heads_per_rank;
	p.d = c->o.head_dim;
	p.d_rope = c->o.d_rope;
	p.max_seq_len = c->o.max_seq_len;
	p.n_slots = c->o.slots;
	p.budget_bytes = budget;
	p.n_pages = c->o.pages;
	p.chunk_bytes = c->o.chunk_bytes;
	e = bd_kvpool_plan(&p, &c->plan, err, sizeof(err));
	if (e < 0) {
		bd_log_err("%s", err);
		return e;
	}
	c->arenas = calloc((size_t)c->o.tp, sizeof(*c->arenas));
	c->devices = calloc((size_t)c->o.tp, sizeof(*c->devices));
	if (!c->arenas || !c->devices)
		return -ENOMEM;
	e = bd_kvpool_alloc_new(c->plan.n_pages, c->plan.n_slots, c->plan.max_pages_per_request,
				c->o.max_requests, &c->alloc);
	if (e == 0)
		e = bd_kvpool_replay_new(REPLAY_CLIENTS,
					 bd_kvpool_replay_reply_max(c->plan.max_pages_per_request),
					 &c->replay);
	if (e < 0) {
		bd_log_err("allocator: %s", strerror(-e));
		return e;
	}
	fill_geo(c);
	if (!adopt_stored(c)) {
		drop_stored(c, true);
		e = create_memory(c);
		if (e < 0)
			return e;
	}
	for (int r = 0; r < c->o.tp; r++)
		c->devices[r] = (struct bd_pool_device){
			.rank = r,
			.device = c->arenas[r].device,
			.arena_bytes = c->arenas[r].bytes,
			.page_region_bytes = c->plan.layout.arena_bytes,
			.slot_region_bytes = c->plan.n_slots * c->plan.layout.slot_bytes,
		};
	bd_log_info("backend %s, %d rank(s): %zu pages of %zu bytes (x%d layers, %s), %zu slots of "
		 "%zu bytes, %zu bytes per rank in %zu chunk(s)",
		 c->mem->name, c->o.tp, c->plan.n_pages, c->plan.layout.page_bytes, c->o.layers,
		 bd_page_format_name(p.fmt), c->plan.n_slots, c->plan.layout.slot_bytes,
		 c->plan.arena_bytes, c->plan.n_chunks);
	return 0;
}

/* ---- scrubbing ----------------------------------------------------------------------------- */

/* the batch of what the last allocation call changed, on the KV event stream (below) */
static void publish_events(struct ctx *c);

/* Hooks scrub.c into the allocator over the CPU backend's arenas (kvpoold does not map the cuda
 * backend's VMM memory, so it is not cleared). Returns 0 or -errno. */
static int setup_scrub(struct ctx *c)
{
	char err[200];
	int e;

	if (!c->o.scrub || strcmp(c->mem->name, "cpu"))
		return 0;
	e = bd_kvpool_scrub_new(&c->plan, c->arenas, c->n_arenas, &c->scrub, err, sizeof(err));
	if (e < 0) {
		bd_log_err("scrubbing: %s", err);
		return e;
	}
	bd_kvpool_alloc_set_scrub(c->alloc, bd_kvpool_scrub_hook, c->scrub);
	return 0;
}

/* ---- attach socket ------------------------------------------------------------------------- */

static void refresh_info(struct ctx *c)
{
	size_t k = 0;

	for (int r = 0; r < c->n_arenas; r++)
		c->devices[r].attached = 0;
	for (size_t i = 0; i < c->n_clients; i++) {
		const struct client *cl = &c->clients[i];

		if (!cl->attached)
			continue;
		c->devices[cl->rank].attached++;
		c->attachments[k++] = (struct bd_pool_attachment){
			.rank = cl->rank, .pid = cl->pid, .uid = cl->uid, .gid = cl->gid
		};
	}
	c->info.n_attachments = k;
}

static void drop_client(struct ctx *c, size_t i, const char *why)
{
	struct client *cl = &c->clients[i];

	if (cl->attached)
		bd_log_info("rank %d detached (pid %d): %s", cl->rank, (int)cl->pid, why);
	else
		bd_log_info("connection of pid %d dropped: %s", (int)cl->pid, why);
	close(cl->fd);
	c->clients[i] = c->clients[--c->n_clients];
	refresh_info(c);
}

/* Answers with an error and drains what the peer sent (unread data would turn our close into
 * a reset that hides the answer); the caller closes. */
static void attach_refuse(int fd, int code, const char *text)
{
	Bdfp4__AttachReply rep = BDFP4__ATTACH_REPLY__INIT;
	uint8_t buf[512];

	rep.error = (Bdfp4__PoolError)code;
	rep.message = (char *)text;
	rep.version = BD_POOL_PROTO_VERSION;
	if (bdfp4__attach_reply__get_packed_size(&rep) <= sizeof(buf))
		bd_ipc_send(fd, buf, bdfp4__attach_reply__pack(&rep, buf), NULL, 0);
	while (recv(fd, buf, sizeof(buf), MSG_DONTWAIT) > 0)
		;
}

static void on_accept(struct ctx *c)
{
	for (;;) {
		int fd = accept4(c->listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
		struct client cl = { .fd = fd, .rank = -1 };
		int ok;

		if (fd < 0) {
			if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED)
				bd_log_warn("accept: %s", strerror(errno));
			return;
		}
		if (bd_ipc_peer_cred(fd, &cl.pid, &cl.uid, &cl.gid) < 0) {
			close(fd);
			continue;
		}
		ok = bd_ipc_peer_allowed(fd, getuid(), c->o.group);
		if (ok <= 0) {
			bd_log_warn("refused pid %d uid %u gid %u: not in the pool's group",
				 (int)cl.pid, (unsigned)cl.uid, (unsigned)cl.gid);
			attach_refuse(fd, BD_POOL_ERR_DENIED, "peer uid/gid not allowed");
			close(fd);
			continue;
		}
		if (c->n_clients >= c->o.max_clients) {
			bd_log_warn("refused pid %d: %zu connections already", (int)cl.pid,
				 c->n_clients);
			attach_refuse(fd, BD_POOL_ERR_EXHAUSTED, "too many connections");
			close(fd);
			continue;
		}
		cl.deadline_ms = bd_now_ms() + c->o.attach_ms;
		c->clients[c->n_clients++] = cl;
	}
}

/* The attach reply: the geometry of the client's rank, with the arena's fds unless
 * geometry_only. */
static void send_attach(struct ctx *c, struct client *cl, bool geometry_only)
{
	Bdfp4__AttachReply rep = BDFP4__ATTACH_REPLY__INIT;
	const struct bd_kvpool_arena *ar = &c->arenas[cl->rank];
	uint64_t sizes[BD_POOL_MAX_CHUNKS];
	int fds[BD_POOL_MAX_CHUNKS];
	uint8_t buf[2048];
	int e;

	for (size_t i = 0; i < ar->n_chunks; i++) {
		sizes[i] = ar->chunks[i].bytes;
		fds[i] = ar->chunks[i].fd;
	}
	rep.version = BD_POOL_PROTO_VERSION;
	rep.backend = (char *)c->mem->name;
	rep.rank = cl->rank;
	rep.device = ar->device;
	rep.tp = (uint32_t)c->o.tp;
	rep.kv_config = (char *)c->kvcfg->name;
	rep.page_format = c->plan.layout.fmt;
	rep.n_layers = (uint32_t)c->plan.layout.n_layers;
	rep.n_kv_heads = (uint32_t)c->plan.layout.n_kv_heads;
	rep.head_dim = (uint32_t)c->plan.layout.d;
	rep.d_rope = (uint32_t)c->plan.layout.d_rope;
	rep.n_pages = c->plan.n_pages;
	rep.n_slots = c->plan.n_slots;
	rep.page_bytes = c->plan.layout.page_bytes;
	rep.slot_bytes = c->plan.layout.slot_bytes;
	rep.pages_offset = c->plan.pages_offset;
	rep.slots_offset = c->plan.slots_offset;
	rep.arena_bytes = ar->bytes;
	rep.n_chunk_bytes = ar->n_chunks;
	rep.chunk_bytes = sizes;
	rep.max_seq_len = c->o.max_seq_len;
	rep.arena_id = (ProtobufCBinaryData){ sizeof(c->geo.arena_id), c->geo.arena_id };
	rep.epoch = geometry_only ? 0 : c->handler.group.epoch;
	e = bd_ipc_send(cl->fd, buf, bdfp4__attach_reply__pack(&rep, buf), fds,
			geometry_only ? 0 : (int)ar->n_chunks);
	if (e < 0) {
		bd_log_warn("attach reply to pid %d: %s", (int)cl->pid, strerror(-e));
		return;
	}
	if (geometry_only)
		return;
	cl->attached = true;
	refresh_info(c);
	bd_log_info("rank %d attached by pid %d (uid %u) with its token of epoch %llu", cl->rank,
		    (int)cl->pid, (unsigned)cl->uid, (unsigned long long)c->handler.group.epoch);
}

/* Whether the peer of fd has hung up (its process died or closed the socket). */
static bool peer_gone(int fd)
{
	struct pollfd p = { .fd = fd, .events = POLLIN | POLLRDHUP };

	return poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLRDHUP | POLLERR));
}

/* 1 + the index of the live attachment of rank other than client `self`, or 0 when there is
 * none. An attachment whose peer has hung up (a worker killed a moment ago, its EOF not read
 * yet) counts as gone: it is marked detached here and dropped when its EOF is read. */
static size_t live_rank(struct ctx *c, size_t self, int rank)
{
	for (size_t j = 0; j < c->n_clients; j++) {
		struct client *o = &c->clients[j];

		if (j == self || !o->attached || o->rank != rank)
			continue;
		if (!peer_gone(o->fd))
			return j + 1;
		bd_log_info("rank %d: pid %d has hung up; its attachment ends", rank, (int)o->pid);
		o->attached = false;
		o->deadline_ms = INT64_MAX; /* not an attach request that is late */
		refresh_info(c);
	}
	return 0;
}

/* Returns false when the client was dropped. */
static bool on_client(struct ctx *c, size_t i)
{
	struct client *cl = &c->clients[i];
	struct bd_kvpool_attach_req req;
	char why[200];
	uint8_t buf[512];
	int code;
	int fds[BD_IPC_MAX_FDS], n_fds = 0;
	size_t live;
	ssize_t n;

	n = bd_ipc_recv(cl->fd, buf, sizeof(buf), fds, BD_IPC_MAX_FDS, &n_fds);
	for (int k = 0; k < n_fds; k++)
		close(fds[k]); /* clients have no business sending fds */
	if (n == -EAGAIN)
		return true;
	if (n <= 0) {
		drop_client(c, i, n == 0 ? "connection closed" : strerror((int)-n));
		return false;
	}
	if (cl->attached) {
		drop_client(c, i, "unexpected message after attach");
		return false;
	}
	code = bd_kvpool_attach_parse(buf, (size_t)n, c->o.tp, &req, why, sizeof(why));
	if (code != BD_POOL_OK) {
		attach_refuse(cl->fd, code, why);
		drop_client(c, i, why);
		return false;
	}
	cl->rank = req.rank;
	if (req.geometry_only) {
		/* the geometry is not a secret: no token, no fds, no attachment */
		send_attach(c, cl, true);
		cl->rank = -1;
		drop_client(c, i, "geometry sent");
		return false;
	}
	live = live_rank(c, i, cl->rank);
	if (live) {
		const struct client *o = &c->clients[live - 1];
		char t[200];

		snprintf(t, sizeof(t), "rank %d is attached (pid %d, uid %u): one live attachment per "
			 "rank", cl->rank, (int)o->pid, (unsigned)o->uid);
		bd_log_warn("attach of rank %d by pid %d (uid %u) refused: %s", cl->rank,
			    (int)cl->pid, (unsigned)cl->uid, t);
		attach_refuse(cl->fd, BD_POOL_ERR_ATTACHED, t);
		cl->rank = -1;
		drop_client(c, i, "rank already attached");
		return false;
	}
	code = bd_kvpool_attach_token(&c->handler.group, &req, (int32_t)cl->pid, why, sizeof(why));
	if (code != BD_POOL_OK) {
		bd_log_warn("attach of rank %d by pid %d (uid %u) refused: %s (%llu refused so "
			    "far)", cl->rank, (int)cl->pid, (unsigned)cl->uid, why,
			    (unsigned long long)c->handler.group.refused);
		attach_refuse(cl->fd, code, why);
		cl->rank = -1;
		drop_client(c, i, "attach token refused");
		return false;
	}
	send_attach(c, cl, false);
	if (!cl->attached) {
		drop_client(c, i, "attach reply failed");
		return false;
	}
	return true;
}

/* ---- allocation socket --------------------------------------------------------------------- */

/* Whether gid is among the supplementary groups of pid (/proc/PID/status "Groups:"). */
static bool pid_in_group(pid_t pid, gid_t gid)
{
	char path[64], line[4096];
	bool in = false;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
	f = fopen(path, "re");
	if (!f)
		return false;
	while (fgets(line, sizeof(line), f))
		if (!strncmp(line, "Groups:", 7)) {
			char *p = line + 7, *end;

			for (long v = strtol(p, &end, 10); end != p; v = strtol(p, &end, 10)) {
				in |= (gid_t)v == gid;
				p = end;
			}
			break;
		}
	fclose(f);
	return in;
}

/* Who sent m: the uid, gid and pid ZeroMQ read with SO_PEERCRED when the ipc connection was
 * made (its "Peer-Address" property ends with ":uid:gid:pid"). Returns false when the property
 * is missing or does not end so. */
static bool msg_peer(zmq_msg_t *m, uid_t *ret_uid, gid_t *ret_gid, pid_t *ret_pid)
{
	const char *a = zmq_msg_gets(m, "Peer-Address");
	unsigned long v[3];
	const char *p;
	char *end;
	int k = 0;

	if (!a)
		return false;
	/* the last three ':'-separated fields */
	p = a + strlen(a);
	for (int colons = 0; p > a && colons < 3;)
		if (*--p == ':')
			colons++;
	if (*p != ':')
		return false;
	while (k < 3 && *p == ':') {
		v[k++] = strtoul(p + 1, &end, 10);
		if (end == p + 1)
			return false;
		p = end;
	}
	if (k != 3 || *p)
		return false;
	*ret_uid = (uid_t)v[0];
	*ret_gid = (gid_t)v[1];
	*ret_pid = (pid_t)v[2];
	return true;
}

/* Sets the handler's peer for frame m. Returns false (text says why) when that peer may not
 * use the pool: the same rule as the attach socket (root, our uid, the pool's group). */
static bool rep_peer(struct ctx *c, zmq_msg_t *m, char *text, size_t len)
{
	uid_t uid;
	gid_t gid;
	pid_t pid;

	/* only an ipc:// connection has credentials (a tcp:// IPv6 address has colons too) */
	c->handler.peer_known = bd_ipc_endpoint_path(c->o.endpoint) && msg_peer(m, &uid, &gid, &pid);
	if (!c->handler.peer_known)
		return true;
	c->handler.peer_uid = uid;
	c->handler.peer_admin = uid == 0 || uid == getuid();
	if (c->handler.peer_admin ||
	    (c->o.group != (gid_t)-1 && (gid == c->o.group || pid_in_group(pid, c->o.group))))
		return true;
	snprintf(text, len, "uid %u (pid %d) may not use this pool: root, uid %u and the pool's "
		 "group may", (unsigned)uid, (int)pid, (unsigned)getuid());
	return false;
}

static void on_rep(struct ctx *c)
{
	for (;;) {
		zmq_msg_t m;
		char why[200];
		uint8_t *out = NULL;
		size_t out_len = 0;
		int more = 0, multi, e;
		size_t more_len = sizeof(more);
		bool peer_ok;

		zmq_msg_init(&m);
		if (zmq_msg_recv(&m, c->rep, ZMQ_DONTWAIT) < 0) {
			zmq_msg_close(&m);
			return;
		}
		zmq_getsockopt(c->rep, ZMQ_RCVMORE, &more, &more_len);
		refresh_info(c);
		peer_ok = rep_peer(c, &m, why, sizeof(why));
		/* a REP must read the whole request before it may answer */
		multi = more;
		while (more) {
			zmq_msg_close(&m);
			zmq_msg_init(&m);
			if (zmq_msg_recv(&m, c->rep, 0) < 0)
				break;
			zmq_getsockopt(c->rep, ZMQ_RCVMORE, &more, &more_len);
		}
		if (!peer_ok) {
			bd_log_warn("allocation call refused: %s", why);
			e = bd_kvpool_error_reply(&c->handler, BD_POOL_ERR_DENIED, why, &out,
						  &out_len);
		} else if (multi) {
			e = bd_kvpool_error_reply(&c->handler, BD_POOL_ERR_MALFORMED,
						  "multi-part message", &out, &out_len);
		} else {
			e = bd_kvpool_handle(&c->handler, zmq_msg_data(&m), zmq_msg_size(&m), &out,
					     &out_len);
		}
		zmq_msg_close(&m);
		save_state(c);
		publish_events(c);
		if (e < 0) {
			/* no memory for a reply: an empty frame still unblocks the peer */
			zmq_send(c->rep, "", 0, 0);
			continue;
		}
		if (zmq_send(c->rep, out, out_len, 0) < 0)
			bd_log_warn("reply: %s", zmq_strerror(zmq_errno()));
		free(out);
	}
}

/* A peer the ZAP handler refused (its thread): logged with its address and key. */
static void on_refused(void *ctx, const char *domain, const char *address, const char *key)
{
	(void)ctx;
	bd_log_warn("CURVE: refused %s peer %s with key %s (not in curve_clients)", domain,
		    *address ? address : "(local)", key);
}

/* CURVE on the allocation endpoint (curve_secret_key and curve_clients, both or neither), and
 * the plain-TCP rule: a plain TCP endpoint only on loopback, or with insecure_tcp. */
static int setup_curve(struct ctx *c)
{
	const char *key = bd_daemon_get_str(&c->d, "curve_secret_key");
	const char *list = bd_daemon_get_str(&c->d, "curve_clients");
	struct bd_zsec_allow *a = NULL;
	bool insecure = false;
	char err[512];
	int e;

	if (bd_daemon_get_bool(&c->d, "insecure_tcp", &insecure) < 0)
		return -EINVAL;
	if (!*key != !*list) {
		bd_log_err("CURVE needs both curve_secret_key and curve_clients (%s is missing)",
			   *key ? "curve_clients" : "curve_secret_key");
		return -EINVAL;
	}
	if (bd_zsec_endpoint_check(c->o.endpoint, "endpoint", *key, insecure, err,
				   sizeof(err)) < 0) {
		bd_log_err("%s", err);
		return -EPERM;
	}
	if (!*key)
		return 0;
	if (!c->zctx)
		return -ENOMEM;
	if ((e = bd_zsec_load_secret(key, &c->curve_kp, err, sizeof(err))) < 0 ||
	    (e = bd_zsec_allow_load(list, &a, err, sizeof(err))) < 0 ||
	    (e = bd_zsec_zap_start(c->zctx, on_refused, c, &c->zap, err, sizeof(err))) < 0) {
		bd_zsec_allow_free(a);
		bd_log_err("%s", err);
		return e;
	}
	if ((e = bd_zsec_zap_add(c->zap, "pool", a)) < 0) {
		bd_zsec_allow_free(a);
		return e;
	}
	bd_log_info("CURVE on the allocation endpoint: public key %s, allow-list %s",
		    c->curve_kp.pub, list);
	return 0;
}

static int setup_sockets(struct ctx *c)
{
	int zero = 0, e;
	/* above this ZeroMQ closes the connection instead of handing us the frame */
	int64_t maxmsg = BD_POOL_FRAME_HARD_MAX;

	/* the runtime directory, when systemd has not made it */
	e = bd_ipc_mkdir_parent(c->o.socket, 0750);
	if (e < 0) {
		bd_log_err("the directory of %s: %s", c->o.socket, strerror(-e));
		return e;
	}
	c->listen_fd = bd_ipc_listen(c->o.socket, c->o.socket_mode, c->o.group, 64);
	if (c->listen_fd < 0) {
		bd_log_err("attach socket %s: %s", c->o.socket, strerror(-c->listen_fd));
		return c->listen_fd;
	}
	c->socket_bound = true;
	c->zctx = zmq_ctx_new();
	if ((e = setup_curve(c)) < 0)
		return e;
	if (bd_ipc_endpoint_in_use(c->o.endpoint) == 1) {
		bd_log_err("allocation endpoint %s: another process listens there (is kvpoold already "
			"running?)", c->o.endpoint);
		return -EADDRINUSE;
	}
	c->rep = c->zctx ? zmq_socket(c->zctx, ZMQ_REP) : NULL;
	if (!c->rep || zmq_setsockopt(c->rep, ZMQ_LINGER, &zero, sizeof(zero)) < 0 ||
	    zmq_setsockopt(c->rep, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg)) < 0 ||
	    (c->zap && bd_zsec_server(c->rep, &c->curve_kp, "pool") < 0) ||
	    zmq_bind(c->rep, c->o.endpoint) < 0) {
		bd_log_err("allocation endpoint %s: %s", c->o.endpoint, zmq_strerror(zmq_errno()));
		return -EIO;
	}
	c->rep_bound = true;
	e = bd_ipc_endpoint_secure(c->o.endpoint, c->o.socket_mode, c->o.group);
	if (e < 0)
		bd_log_err("allocation endpoint %s: its mode and group: %s", c->o.endpoint,
			   strerror(-e));
	return e;
}

/* ---- the KV event stream -------------------------------------------------------------------- */

static void be64(uint8_t b[8], uint64_t x)
{
	for (int i = 7; i >= 0; i--, x >>= 8)
		b[i] = (uint8_t)x;
}

/* The batch of what the last call changed, on the PUB socket (dropped there when a slow
 * subscriber's queue is full: the replay socket has it). */
static void publish_events(struct ctx *c)
{
	const uint8_t *p;
	uint64_t seq;
	size_t len;
	uint8_t sb[8];
	struct timespec ts;
	int r;

	if (!c->events)
		return;
	clock_gettime(CLOCK_REALTIME, &ts);
	r = bd_kvpool_events_batch(c->events, (double)ts.tv_sec + ts.tv_nsec * 1e-9, &seq, &p,
				   &len);
	if (r == -ENOMEM)
		bd_log_warn("kv events: out of memory, a batch is lost (the next clears the index)");
	if (r <= 0)
		return;
	be64(sb, seq);
	if (zmq_send(c->ev_pub, c->o.kv_events_topic, strlen(c->o.kv_events_topic),
		     ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
	    zmq_send(c->ev_pub, sb, sizeof(sb), ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
	    zmq_send(c->ev_pub, p, len, ZMQ_DONTWAIT) < 0)
		bd_log_debug("kv events: batch %llu not sent: %s", (unsigned long long)seq,
			     zmq_strerror(zmq_errno()));
}

struct replay_to {
	void *sock;
	zmq_msg_t *id;
};

static void replay_one(void *ctx, uint64_t seq, const uint8_t *p, size_t len)
{
	struct replay_to *t = ctx;
	uint8_t sb[8];

	be64(sb, seq);
	zmq_send(t->sock, zmq_msg_data(t->id), zmq_msg_size(t->id), ZMQ_SNDMORE | ZMQ_DONTWAIT);
	zmq_send(t->sock, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT);
	zmq_send(t->sock, sb, sizeof(sb), ZMQ_SNDMORE | ZMQ_DONTWAIT);
	zmq_send(t->sock, p, len, ZMQ_DONTWAIT);
}

/* Replay requests [id][""][start, 8 bytes big-endian]: the kept batches from start, then the
 * end marker (sequence -1, empty payload). Anything else is dropped. */
static void on_replay(struct ctx *c)
{
	for (;;) {
		zmq_msg_t part[3];
		int n = 0, more = 1;
		size_t ml = sizeof(more);

		while (more) {
			zmq_msg_t m;

			zmq_msg_init(&m);
			if (zmq_msg_recv(&m, c->ev_replay, ZMQ_DONTWAIT) < 0) {
				zmq_msg_close(&m);
				for (int i = 0; i < n && i < 3; i++)
					zmq_msg_close(&part[i]);
				return;
			}
			zmq_getsockopt(c->ev_replay, ZMQ_RCVMORE, &more, &ml);
			if (n < 3) {
				zmq_msg_init(&part[n]);
				zmq_msg_move(&part[n], &m);
			}
			zmq_msg_close(&m);
			n++;
		}
		if (n == 3 && zmq_msg_size(&part[1]) == 0 && zmq_msg_size(&part[2]) == 8) {
			const uint8_t *b = zmq_msg_data(&part[2]);
			uint64_t start = 0;
			uint8_t end[8];
			struct replay_to t = { c->ev_replay, &part[0] };

			for (int i = 0; i < 8; i++)
				start = start << 8 | b[i];
			bd_kvpool_events_replay(c->events, start, replay_one, &t);
			memset(end, 0xff, sizeof(end));
			zmq_send(c->ev_replay, zmq_msg_data(&part[0]), zmq_msg_size(&part[0]),
				 ZMQ_SNDMORE | ZMQ_DONTWAIT);
			zmq_send(c->ev_replay, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT);
			zmq_send(c->ev_replay, end, sizeof(end), ZMQ_SNDMORE | ZMQ_DONTWAIT);
			zmq_send(c->ev_replay, "", 0, ZMQ_DONTWAIT);
		}
		for (int i = 0; i < n && i < 3; i++)
			zmq_msg_close(&part[i]);
	}
}

/* The PUB (and replay) sockets when kv_events is set, the allocator's cache hook on them, and
 * a first AllBlocksCleared: a consumer's view of an earlier run is void (an index adopted
 * from the fd store is served, but not announced again: its tokens are not kept). */
static int setup_events(struct ctx *c)
{
	int zero = 0, e;

	if (!*c->o.kv_events)
		return 0;
	e = bd_kvpool_events_new(c->o.kv_events_buffer, strcmp(c->mem->name, "cpu") ? "GPU" : "CPU",
				 &c->events);
	if (e < 0) {
		bd_log_err("kv events: %s", strerror(-e));
		return e;
	}
	bd_kvpool_events_set_handler(c->events, &c->handler);
	c->ev_pub = zmq_socket(c->zctx, ZMQ_PUB);
	if (!c->ev_pub || zmq_setsockopt(c->ev_pub, ZMQ_LINGER, &zero, sizeof(zero)) < 0 ||
	    zmq_bind(c->ev_pub, c->o.kv_events) < 0) {
		bd_log_err("kv_events %s: %s", c->o.kv_events, zmq_strerror(zmq_errno()));
		return -EIO;
	}
	if (*c->o.kv_events_replay) {
		c->ev_replay = zmq_socket(c->zctx, ZMQ_ROUTER);
		if (!c->ev_replay ||
		    zmq_setsockopt(c->ev_replay, ZMQ_LINGER, &zero, sizeof(zero)) < 0 ||
		    zmq_bind(c->ev_replay, c->o.kv_events_replay) < 0) {
			bd_log_err("kv_events_replay %s: %s", c->o.kv_events_replay,
				   zmq_strerror(zmq_errno()));
			return -EIO;
		}
	}
	bd_kvpool_alloc_set_cache_hook(c->alloc, bd_kvpool_events_hook, c->events);
	bd_kvpool_events_hook(c->events, BD_KVPOOL_CACHE_CLEARED, 0, -1);
	publish_events(c);
	bd_log_info("kv events on %s%s%s", c->o.kv_events, *c->o.kv_events_replay ? ", replay on " : "",
		    c->o.kv_events_replay);
	return 0;
}

/* ---- loop ---------------------------------------------------------------------------------- */

static void notify_status(struct ctx *c)
{
	struct bd_kvpool_counts k;
	size_t attached = 0;

	bd_kvpool_alloc_counts(c->alloc, &k);
	for (size_t i = 0; i < c->n_clients; i++)
		attached += c->clients[i].attached;
	bd_daemon_status(&c->d, "pages %zu/%zu used (%zu reserved), slots %zu/%zu, %zu requests, "
			 "%zu attached",
		   k.pages_total - k.pages_free, k.pages_total, k.pages_reserved,
		   k.slots_total - k.slots_free, k.slots_total, k.requests, attached);
}

static void on_tick(struct ctx *c, int64_t now)
{
	if (now >= c->next_status) {
		notify_status(c);
		c->next_status = now + c->o.status_ms;
	}
	bd_daemon_watchdog(&c->d, now);
	for (size_t i = 0; i < c->n_clients;)
		if (!c->clients[i].attached && now >= c->clients[i].deadline_ms)
			drop_client(c, i, "no attach request in time");
		else
			i++;
}

static int run(struct ctx *c)
{
	zmq_pollitem_t *items = calloc(4 + c->o.max_clients, sizeof(*items));

	if (!items)
		return -ENOMEM;
	while (!c->stop) {
		int64_t now = bd_now_ms(), wait = c->next_status - now;
		int64_t wd = bd_daemon_watchdog(&c->d, now);
		size_t n_cl = c->n_clients;
		int r, signo;

		if (wd < wait)
			wait = wd;
		for (size_t i = 0; i < n_cl; i++)
			if (!c->clients[i].attached && c->clients[i].deadline_ms - now < wait)
				wait = c->clients[i].deadline_ms - now;
		if (wait < 0)
			wait = 0;
		items[0] = (zmq_pollitem_t){ .socket = c->rep, .events = ZMQ_POLLIN };
		items[1] = (zmq_pollitem_t){ .fd = c->listen_fd, .events = ZMQ_POLLIN };
		items[2] = (zmq_pollitem_t){ .fd = c->d.signal_fd, .events = ZMQ_POLLIN };
		for (size_t i = 0; i < n_cl; i++)
			items[3 + i] = (zmq_pollitem_t){ .fd = c->clients[i].fd,
							 .events = ZMQ_POLLIN };
		/* the replay socket last, so the clients keep their indices */
		items[3 + n_cl] = (zmq_pollitem_t){ .socket = c->ev_replay,
						    .events = c->ev_replay ? ZMQ_POLLIN : 0 };
		r = zmq_poll(items, 3 + (int)n_cl + (c->ev_replay != NULL), (long)wait);
		if (r < 0) {
			if (zmq_errno() == EINTR)
				continue;
			bd_log_err("zmq_poll: %s", zmq_strerror(zmq_errno()));
			free(items);
			return -EIO;
		}
		if (items[2].revents) {
			while ((signo = bd_daemon_signal(&c->d)) > 0) {
				if (signo == SIGUSR1)
					continue;
				bd_log_info("signal %d: stopping", signo);
				c->stop = true;
			}
			if (c->stop)
				break;
		}
		if (items[0].revents)
			on_rep(c);
		/* clients from the back, so a drop (which moves the last one into i) is safe */
		for (size_t i = n_cl; i-- > 0;)
			if (items[3 + i].revents)
				on_client(c, i);
		if (items[1].revents)
			on_accept(c);
		if (c->ev_replay && items[3 + n_cl].revents)
			on_replay(c);
		on_tick(c, bd_now_ms());
	}
	free(items);
	return 0;
}

/* Undoes setup_memory: the ranks' arenas and devices, the allocator and the replay cache. */
static void teardown_memory(struct ctx *c)
{
	for (int r = 0; r < c->n_arenas; r++)
		c->mem->arena_destroy(&c->arenas[r]);
	free(c->arenas);
	free(c->devices);
	bd_kvpool_alloc_free(c->alloc);
	bd_kvpool_replay_free(c->replay);
}

static void cleanup(struct ctx *c)
{
	for (size_t i = 0; i < c->n_clients; i++)
		close(c->clients[i].fd);
	free(c->clients);
	free(c->attachments);
	if (c->listen_fd >= 0)
		close(c->listen_fd);
	if (c->socket_bound)
		unlink(c->o.socket);
	if (c->rep) {
		const char *path = bd_ipc_endpoint_path(c->o.endpoint);

		zmq_close(c->rep);
		/* ZeroMQ leaves an ipc endpoint's socket file behind: remove ours */
		if (c->rep_bound && path)
			unlink(path);
	}
	if (c->ev_pub)
		zmq_close(c->ev_pub);
	if (c->ev_replay)
		zmq_close(c->ev_replay);
	bd_kvpool_events_free(c->events);
	bd_zsec_zap_stop(c->zap);
	memset(&c->curve_kp, 0, sizeof(c->curve_kp));
	if (c->zctx)
		zmq_ctx_term(c->zctx);
	bd_kvpool_scrub_free(c->scrub);
	teardown_memory(c);
	bd_kvpool_state_free(c->state);
	free_stored(c);
	bd_daemon_end(&c->d);
}

int main(int argc, char **argv)
{
	struct ctx c = {
		.d = { .name = "kvpoold", .section = SECTION, .keys = keys,
		       .about = "The KV pool: one arena per TP rank, attached by a worker with its "
				"rank's token of the router's group epoch (a geometry query needs "
				"none), allocated over ZeroMQ by the router." },
		.listen_fd = -1,
	};
	int e = bd_daemon_start(&c.d, argc, argv);

	if (e == 1) {
		bd_daemon_end(&c.d);
		return 0;
	}
	if (e < 0 || read_opts(&c) < 0)
		goto fail;
	c.clients = calloc(c.o.max_clients, sizeof(*c.clients));
	c.attachments = calloc(c.o.max_clients, sizeof(*c.attachments));
	if (!c.clients || !c.attachments || take_stored(&c) < 0)
		goto fail;
	if (setup_memory(&c) < 0)
		goto fail;
	c.info = (struct bd_kvpool_info){
		.backend = c.mem->name,
		.kv_config = c.kvcfg->name,
		.page_format = bd_page_format_name(c.plan.layout.fmt),
		.tp = (uint32_t)c.o.tp,
		.max_seq_len = c.o.max_seq_len,
		.page_bytes = c.plan.layout.page_bytes * (size_t)c.o.layers,
		.slot_bytes = c.plan.layout.slot_bytes,
		.devices = c.devices,
		.n_devices = (size_t)c.n_arenas,
		.attachments = c.attachments,
		.arena_id = c.geo.arena_id,
	};
	c.handler = (struct bd_kvpool_handler){
		.alloc = c.alloc,
		.replay = c.replay,
		.info = &c.info,
		.max_frame = c.o.max_frame,
		.default_top = (uint32_t)c.o.stats_top,
		.tp = (uint32_t)c.o.tp,
	};
	bd_kvpool_alloc_set_quota(c.alloc, &c.o.quota);
	if (setup_scrub(&c) < 0 || setup_sockets(&c) < 0 || setup_events(&c) < 0)
		goto fail;
	c.next_status = bd_now_ms();
	bd_log_info("listening on %s (attach) and %s (allocation)", c.o.socket, c.o.endpoint);
	bd_daemon_ready(&c.d);
	e = run(&c);
	bd_daemon_stopping(&c.d);
	cleanup(&c);
	return e < 0 ? 1 : 0;
fail:
	cleanup(&c);
	return 1;
}
