/* routerd — the router of the bdfp4 serving system (DESIGN.md).
 *
 * Terminates the client API (serve.proto over a ZeroMQ ROUTER frontend), tokenizes, admits
 * requests against the pool's capacity, batches them continuously and sends each step's plan
 * to every worker rank. One event loop (zmq_poll over the frontend, the worker socket, the pool
 * probe and the daemon's signal fd, with a periodic tick for deadlines, heartbeats, keepalives
 * and sd_notify). After each event the loop carries out what the scheduler asked for: chunks to
 * the clients (frontend.c), plans to the workers (workers.c).
 *
 * Configuration: [router] of /etc/bdfp4/bdfp4.conf, every key overridable by a flag of the
 * same name (--max-batch=8 for max_batch). Exit: 0 after SIGTERM/SIGINT, 1 on a fatal error.
 *
 * SIGTERM/SIGINT drain: state STOPPING (health, sd_notify STATUS "draining N requests"), new
 * requests get SHUTTING_DOWN, the running and queued ones are stepped to their end for up to
 * drain_timeout_ms (0: no drain) and while a worker group is formed; then what is left fails
 * with SHUTTING_DOWN, the workers get Shutdown, the pool records are released. A second signal
 * ends the drain at once.
 */
#include <errno.h>
#include <libgen.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <zmq.h>

#include "base/bd_config.h"
#include "base/bd_ipc.h"
#include "formats/bd_gguf.h"
#include "model/bd_model_preset.h"
#include "quant/bd_kvcfg.h"
#include "quant/bd_layout.h"
#include "serve/bd_wire.h"
#include "http.h"
#include "metrics.h"
#include "pool/bd_prefix.h"
#include "router.h"

#define SECTION "router"
#define FRONT_HARD_MAX (16 << 20) /* frames above this drop the peer instead of a reply */

#define OPT(t, field, lo, hi) BD_CONFIG_FIELD(t, struct bd_router_opts, field, lo, hi)
#define TEXT(field) BD_CONFIG_TEXT(struct bd_router_opts, field)
static const struct bd_config_key keys[] = {
	{ "frontend", "tcp://127.0.0.1:5555,ipc:///run/bdfp4/router.sock",
	  "client endpoints (comma-separated, ZeroMQ ROUTER)" },
	{ "workers", "ipc:///run/bdfp4/router-workers.sock", "worker endpoint (ZeroMQ ROUTER)",
	  TEXT(workers) },
	{ "http", "127.0.0.1:8000",
	  "HTTP listen address HOST:PORT of the OpenAI API, /health and /metrics (port 0: any "
	  "free one; empty: no HTTP)", TEXT(http) },
	{ "pool", BD_POOL_DEFAULT_ENDPOINT, "kvpoold's allocation endpoint", TEXT(pool) },
	{ "model", "/usr/share/bdfp4/models/SmolLM2-135M-Instruct.Q4_1.gguf",
	  "GGUF model (tokenizer, chat template, context, vocabulary)", TEXT(model) },
	{ "random_weights", "",
	  "serve a model of seeded random weights of this shape (workerd --random-weights, e.g. "
	  "qwen3-4b) instead of model: no tokenizer, requests send token_ids",
	  TEXT(random_weights) },
	{ "kv_config", "", "KV configuration (empty: the pool's)", TEXT(kv_config) },
	{ "tp", "2", "tensor-parallel ranks (workers) in the group",
	  OPT(INT, tp, 1, BD_ROUTER_MAX_TP) },
	{ "max_batch", "16", "rows (running requests) per step",
	  OPT(INT, sched.max_batch, 1, 4096) },
	{ "max_queue", "64", "queued requests before resource-exhausted",
	  OPT(INT, sched.max_queue, 0, 1 << 20) },
	{ "max_frame_bytes", "1048576", "largest client frame; larger ones get an error reply",
	  OPT(BYTES, max_frame, 256, FRONT_HARD_MAX) },
	{ "max_prefill_tokens", "1024",
	  "prompt tokens prefilled in one step, over all its prefill rows (with max_prefill_chunk "
	  "0: one whole prompt a step at least)", OPT(INT, sched.max_prefill_tokens, 1, 1 << 24) },
	{ "max_prefill_chunk", "512",
	  "tokens of one prompt prefilled in one step, a multiple of 128 up to max_prefill_tokens; "
	  "longer prompts go in chunks between decode steps (0: whole prompts)",
	  OPT(INT, sched.max_prefill_chunk, 0, 1 << 24) },
	{ "batch_invariant", "0",
	  "a prompt's chunks do not depend on the other requests (a chunk that the step's budget "
	  "cannot take whole waits for the next step); with workerd's batch_invariant a greedy "
	  "request yields the same tokens alone or in any batch", true,
	  OPT(BOOL, sched.batch_invariant, 0, 0) },
	{ "prefix_cache", "1",
	  "reuse the FP4 pages of a prompt's leading full pages that kvpoold holds from an earlier "
	  "request with the same tokens (and cache salt); not with workers that take whole "
	  "prompts only (--synthetic-prefill)", true,
	  OPT(BOOL, sched.prefix_cache, 0, 0) },
	{ "deadline_ms", "300000", "default per-request deadline",
	  OPT(INT, deadline_ms, 1, INT_MAX) },
	{ "heartbeat_ms", "250", "heartbeat period, both ways", OPT(INT, heartbeat_ms, 10, 600000) },
	{ "heartbeat_timeout_ms", "3000", "a worker silent this long is dead",
	  OPT(INT, heartbeat_timeout_ms, 20, 3600000) },
	{ "step_timeout_ms", "120000", "a step not answered in this time fails the group",
	  OPT(INT, step_timeout_ms, 100, INT_MAX) },
	{ "resume_timeout_ms", "30000",
	  "when the worker group fails, running requests keep their KV in the pool and wait this "
	  "long for it to form again, then continue from their last token (0: they fail at once)",
	  OPT(INT, sched.resume_timeout_ms, 0, 3600000) },
	{ "keepalive_ms", "1000", "keepalive period to quiet clients with live requests",
	  OPT(INT, keepalive_ms, 10, 3600000) },
	{ "pool_timeout_ms", "2000", "one pool round trip", OPT(INT, pool_timeout_ms, 10, 600000) },
	{ "pool_wait_ms", "30000",
	  "wait this long for kvpoold at start, and running requests for a restarting one",
	  OPT(INT, pool_wait_ms, 0, 3600000) },
	{ "pool_probe_ms", "1000",
	  "period of the non-blocking kvpoold probe (a dead pool shows in health within this plus "
	  "pool_timeout_ms; it is back at the first answer)", OPT(INT, pool_probe_ms, 10, 600000) },
	{ "drain_timeout_ms", "30000",
	  "on SIGTERM, step the accepted requests to their end for up to this long (0: fail them "
	  "at once); keep below the unit's TimeoutStopSec", OPT(INT, drain_timeout_ms, 0, 3600000) },
	{ "pool_owner", "1", "owner id of this router's requests in the pool",
	  OPT(INT, owner, 1, INT_MAX) },
	{ "curve_secret_key", "",
	  "the router's CURVE secret key file (bdfp4 keygen; mode 0600): with curve_clients, "
	  "every frontend endpoint asks CURVE; with curve_workers, the worker endpoint",
	  TEXT(curve_secret_key) },
	{ "curve_clients", "", "allow-list of the clients' CURVE public keys (one a line)",
	  TEXT(curve_clients) },
	{ "curve_workers", "", "allow-list of the workers' CURVE public keys", TEXT(curve_workers) },
	{ "pool_server_key", "",
	  "kvpoold's CURVE public key file: the pool connection speaks CURVE with the router's "
	  "curve_secret_key (kvpoold's curve_clients must list the router's public key)",
	  TEXT(pool_server_key) },
	{ "insecure_tcp", "false",
	  "allow plain (unauthenticated, unencrypted) TCP on a non-loopback address", true,
	  OPT(BOOL, insecure_tcp, 0, 0) },
	{ "socket_mode", "0660",
	  "file mode of the ipc:// frontend and worker endpoints, set after bind whatever the "
	  "umask", OPT(INT, socket_mode, 0, 0777) },
	BD_DAEMON_KEY_STATUS_INTERVAL(struct bd_router_opts, status_ms),
	{ NULL, NULL, NULL },
};
#undef OPT
#undef TEXT

/* ---- configuration ------------------------------------------------------------------------- */

/* The CURVE keys and the plain-TCP rule: a list without the key file (or the other way round)
 * is an error, and so is a plain TCP endpoint off loopback unless insecure_tcp. */
static int read_security(struct bd_router *rt)
{
	struct bd_router_opts *o = &rt->o;
	char err[512];
	int e;

	if (*o->pool_server_key && !*o->curve_secret_key) {
		bd_log_err("pool_server_key needs the router's own curve_secret_key");
		return -EINVAL;
	}
	if (!*o->curve_secret_key !=
	    (!*o->curve_clients && !*o->curve_workers && !*o->pool_server_key)) {
		bd_log_err("CURVE needs curve_secret_key and an allow-list (curve_clients, "
			   "curve_workers) or pool_server_key: %s is set without the other",
			   *o->curve_secret_key ? "curve_secret_key" : "an allow-list");
		return -EINVAL;
	}
	if (*o->curve_secret_key && !bd_zsec_available()) {
		bd_log_err("curve_secret_key: this libzmq has no CURVE (built without libsodium)");
		return -ENOTSUP;
	}
	for (int i = 0; i < o->n_frontends; i++)
		if ((e = bd_zsec_endpoint_check(o->frontends[i], "frontend", *o->curve_clients,
						o->insecure_tcp, err, sizeof(err))) < 0) {
			bd_log_err("%s", err);
			return e;
		}
	if ((e = bd_zsec_endpoint_check(o->workers, "workers", *o->curve_workers, o->insecure_tcp,
					err, sizeof(err))) < 0 ||
	    (e = bd_zsec_endpoint_check(o->pool, "pool", *o->pool_server_key, o->insecure_tcp,
					err, sizeof(err))) < 0) {
		bd_log_err("%s", err);
		return e;
	}
	return 0;
}

static int read_opts(struct bd_router *rt)
{
	struct bd_router_opts *o = &rt->o;
	const struct bd_daemon *d = &rt->d;
	char *copy, *save = NULL, *tokn;

	copy = strdup(bd_daemon_get_str(d, "frontend"));
	if (!copy)
		return -ENOMEM;
	for (tokn = strtok_r(copy, ", ", &save); tokn; tokn = strtok_r(NULL, ", ", &save)) {
		if (o->n_frontends == BD_ROUTER_MAX_ENDPOINTS) {
			bd_log_err("frontend: at most %d endpoints", BD_ROUTER_MAX_ENDPOINTS);
			free(copy);
			return -EINVAL;
		}
		o->frontends[o->n_frontends] = strdup(tokn);
		if (!o->frontends[o->n_frontends++]) {
			free(copy);
			return -ENOMEM;
		}
	}
	free(copy);
	if (!o->n_frontends) {
		bd_log_err("frontend: no endpoint");
		return -EINVAL;
	}
	if (bd_daemon_read_opts(d, o) < 0)
		return -EINVAL;
	if (o->heartbeat_timeout_ms <= o->heartbeat_ms) {
		bd_log_err("heartbeat_timeout_ms must exceed heartbeat_ms");
		return -EINVAL;
	}
	if (o->sched.max_prefill_chunk % BD_PAGE_TOKENS ||
	    o->sched.max_prefill_chunk > o->sched.max_prefill_tokens) {
		bd_log_err("max_prefill_chunk (%d) must be a multiple of %d and at most "
			   "max_prefill_tokens (%d)", o->sched.max_prefill_chunk, BD_PAGE_TOKENS,
			   o->sched.max_prefill_tokens);
		return -EINVAL;
	}
	if (*o->kv_config && !bd_kvcfg_find(o->kv_config)) {
		bd_log_err("unknown kv_config '%s'", o->kv_config);
		return -EINVAL;
	}
	return read_security(rt);
}

/* ---- model and pool ------------------------------------------------------------------------ */

/* A random-weights model: the shape of a named preset, no tokenizer (text prompts
 * are refused, chunks carry token ids only), no end-of-generation token, the context the
 * pool's max_seq_len allows. */
static int load_preset(struct bd_router *rt)
{
	struct bd_model_hparams hp;

	if (bd_model_preset(rt->o.random_weights, &hp) < 0) {
		bd_log_err("random_weights = '%s': no such model shape (known: qwen3-4b, "
			 "qwen3-30b-a3b-attn)", rt->o.random_weights);
		return -EINVAL;
	}
	rt->n_vocab = hp.n_vocab;
	rt->n_ctx = INT_MAX; /* the pool caps it */
	rt->n_layers = hp.n_layers;
	snprintf(rt->arch, sizeof(rt->arch), "%s", hp.arch_name);
	snprintf(rt->model_name, sizeof(rt->model_name), "%s", rt->o.random_weights);
	rt->eog = calloc((size_t)rt->n_vocab, sizeof(bool));
	if (!rt->eog)
		return -ENOMEM;
	bd_log_info("model %s: random weights, %s, %d layers, vocabulary %d, no tokenizer "
		  "(requests send token_ids)", rt->model_name, rt->arch, rt->n_layers, rt->n_vocab);
	return 0;
}

static int load_model(struct bd_router *rt)
{
	struct bd_gguf *g = NULL;
	struct bd_model_hparams hp;
	char gerr[BD_GGUF_ERR_MAX] = "", terr[BD_TOKENIZER_ERR_MAX] = "";
	char *path;
	int e;

	if (*rt->o.random_weights)
		return load_preset(rt);
	e = bd_gguf_open(rt->o.model, &g, gerr);
	if (e < 0) {
		if (*gerr)
			bd_log_err("model: %s", gerr);
		else
			bd_log_err("model %s: %s", rt->o.model, strerror(-e));
		return e;
	}
	e = bd_gguf_model_hparams(g, &hp, gerr);
	if (e < 0) {
		bd_log_err("model %s: %s", rt->o.model, gerr);
		goto out;
	}
	e = bd_tokenizer_new_from_gguf(g, &rt->tok, terr);
	if (e < 0) {
		bd_log_err("model %s: tokenizer: %s", rt->o.model, terr);
		goto out;
	}
	rt->n_vocab = bd_tokenizer_n_vocab(rt->tok);
	rt->n_ctx = hp.n_ctx_train;
	rt->n_layers = hp.n_layers;
	snprintf(rt->arch, sizeof(rt->arch), "%s", hp.arch_name);
	path = strdup(rt->o.model);
	if (!path) {
		e = -ENOMEM;
		goto out;
	}
	snprintf(rt->model_name, sizeof(rt->model_name), "%s", basename(path));
	free(path);
	rt->eog = calloc((size_t)rt->n_vocab, sizeof(bool));
	if (!rt->eog) {
		e = -ENOMEM;
		goto out;
	}
	for (int32_t i = 0; i < rt->n_vocab; i++)
		rt->eog[i] = bd_tokenizer_is_eog(rt->tok, i);
	bd_log_info("model %s: %s, %d layers, vocabulary %d, context %d", rt->model_name, rt->arch,
		  rt->n_layers, rt->n_vocab, rt->n_ctx);
	e = 0;
out:
	bd_gguf_free(g);
	return e;
}

static int connect_pool(struct bd_router *rt)
{
	struct bd_pool_stats *st = NULL;
	int64_t end = bd_now_ms() + rt->o.pool_wait_ms;
	uint64_t n_req = 0, n_pages = 0;
	const struct bd_kvcfg *kc;
	int e;

	e = bd_pool_conn_new(rt->o.pool, rt->o.pool_timeout_ms, &rt->pool);
	if (e < 0) {
		bd_log_err("pool %s: %s", rt->o.pool, strerror(-e));
		return e;
	}
	if (*rt->o.pool_server_key) {
		char err[512] = "";

		e = bd_pool_conn_set_curve(rt->pool, rt->o.pool_server_key, rt->o.curve_secret_key,
					   err, sizeof(err));
		if (e < 0) {
			bd_log_err("pool %s: %s", rt->o.pool, *err ? err : strerror(-e));
			return e;
		}
	}
	for (;;) {
		e = bd_pool_stats(rt->pool, 1, &st);
		if (e != -ETIMEDOUT || bd_now_ms() >= end)
			break;
		bd_log_info("waiting for kvpoold at %s", rt->o.pool);
	}
	if (e < 0) {
		bd_log_err("pool %s: %s", rt->o.pool, strerror(-e));
		return e;
	}
	snprintf(rt->kv_config, sizeof(rt->kv_config), "%s", st->kv_config);
	snprintf(rt->page_format, sizeof(rt->page_format), "%s", st->page_format);
	snprintf(rt->backend, sizeof(rt->backend), "%s", st->backend);
	rt->pages_total = st->pages_total;
	rt->slots_total = st->slots_total;
	if (st->max_seq_len && (int)st->max_seq_len < rt->n_ctx)
		rt->n_ctx = (int)st->max_seq_len;
	e = 0;
	if ((int)st->tp != rt->o.tp) {
		bd_log_err("the pool has %u rank(s), the router is configured for tp = %d", st->tp,
			 rt->o.tp);
		e = -EINVAL;
	}
	bd_pool_stats_free(st);
	if (e < 0)
		return e;
	kc = bd_kvcfg_find(rt->kv_config);
	if (!kc) {
		bd_log_err("the pool holds an unknown KV configuration '%s'", rt->kv_config);
		return -EINVAL;
	}
	if (*rt->o.kv_config && strcmp(rt->o.kv_config, rt->kv_config)) {
		bd_log_err("kv_config %s, but the pool holds %s", rt->o.kv_config, rt->kv_config);
		return -EINVAL;
	}
	/* a router that crashed left its requests in the pool: they are ours, and dead */
	e = bd_pool_owner_reclaim(rt->pool, rt->o.owner, &n_req, &n_pages);
	if (e < 0) {
		bd_log_err("pool: reclaim of owner %llu: %s", (unsigned long long)rt->o.owner,
			 strerror(-e));
		return e;
	}
	if (n_req)
		bd_log_info("reclaimed %llu stale request(s), %llu page(s) from the pool",
			  (unsigned long long)n_req, (unsigned long long)n_pages);
	bd_log_info("pool: %s backend, %s, %llu pages, %llu slots, context %d", rt->backend,
		  rt->kv_config, (unsigned long long)rt->pages_total,
		  (unsigned long long)rt->slots_total, rt->n_ctx);
	return bd_router_pool_refresh(rt);
}

/* ---- sockets ------------------------------------------------------------------------------- */

/* Binds sock at an endpoint: an ipc:// one gets its directory when systemd has not made it, is
 * refused when another process listens there (a second router pointed at a live one's
 * paths), which ZeroMQ would silently take over, and gets mode socket_mode once bound. */
static int bind_endpoint(void *sock, const char *ep, const char *what, int socket_mode)
{
	const char *path = bd_ipc_endpoint_path(ep);
	int e;

	if (path && (e = bd_ipc_mkdir_parent(path, 0755)) < 0)
		bd_log_warn("%s %s: its directory: %s", what, ep, strerror(-e));
	if (bd_ipc_endpoint_in_use(ep) == 1) {
		bd_log_err("%s: another process listens there (is a router already running?)", ep);
		return -EADDRINUSE;
	}
	if (zmq_bind(sock, ep) < 0) {
		bd_log_err("%s %s: %s", what, ep, zmq_strerror(zmq_errno()));
		return -EIO;
	}
	e = bd_ipc_endpoint_secure(ep, (mode_t)socket_mode, (gid_t)-1);
	if (e < 0)
		bd_log_err("%s %s: its file mode: %s", what, ep, strerror(-e));
	return e;
}

/* A peer the ZAP handler refused (its thread): logged with its address and key. */
static void on_refused(void *ctx, const char *domain, const char *address, const char *key)
{
	(void)ctx;
	bd_log_warn("CURVE: refused %s peer %s with key %s (not in the allow-list)", domain,
		    *address ? address : "(local)", key);
}

/* The ZAP handler with the allow-lists, and the CURVE server options of the sockets that
 * have one, before anything is bound. */
static int setup_curve(struct bd_router *rt)
{
	const struct { const char *list, *domain; void *sock; } s[2] = {
		{ rt->o.curve_clients, "clients", rt->front },
		{ rt->o.curve_workers, "workers", rt->wsock },
	};
	struct bd_zsec_keypair kp;
	char err[512];
	int e;

	if (!*rt->o.curve_secret_key)
		return 0;
	if ((e = bd_zsec_load_secret(rt->o.curve_secret_key, &kp, err, sizeof(err))) < 0 ||
	    (e = bd_zsec_zap_start(rt->zctx, on_refused, rt, &rt->zap, err, sizeof(err))) < 0) {
		bd_log_err("%s", err);
		return e;
	}
	for (int i = 0; i < 2; i++) {
		struct bd_zsec_allow *a;

		if (!*s[i].list)
			continue;
		if ((e = bd_zsec_allow_load(s[i].list, &a, err, sizeof(err))) < 0) {
			bd_log_err("%s", err);
			break;
		}
		if ((e = bd_zsec_zap_add(rt->zap, s[i].domain, a)) < 0) {
			bd_zsec_allow_free(a);
			break;
		}
		if ((e = bd_zsec_server(s[i].sock, &kp, s[i].domain)) < 0) {
			bd_log_err("CURVE server options: %s", zmq_strerror(zmq_errno()));
			break;
		}
		bd_log_info("CURVE on the %s endpoint(s): public key %s, allow-list %s", s[i].domain,
			    kp.pub, s[i].list);
	}
	memset(&kp, 0, sizeof(kp));
	return e;
}

static int setup_sockets(struct bd_router *rt)
{
	int e;

	rt->zctx = zmq_ctx_new();
	if (!rt->zctx)
		return -ENOMEM;
	rt->front = bd_router_socket(rt->zctx, FRONT_HARD_MAX);
	rt->wsock = bd_router_socket(rt->zctx, BD_ROUTER_WORKER_MAX_FRAME);
	if (!rt->front || !rt->wsock) {
		bd_log_err("zmq socket: %s", zmq_strerror(zmq_errno()));
		return -EIO;
	}
	if ((e = setup_curve(rt)) < 0)
		return e;
	for (int i = 0; i < rt->o.n_frontends; i++) {
		e = bind_endpoint(rt->front, rt->o.frontends[i], "frontend", rt->o.socket_mode);
		if (e < 0)
			return e;
		rt->n_front_bound = i + 1;
	}
	e = bind_endpoint(rt->wsock, rt->o.workers, "worker endpoint", rt->o.socket_mode);
	if (e < 0)
		return e;
	rt->workers_bound = true;
	return bd_router_pool_open(rt);
}

/* Carries out what the scheduler asked for: chunks to the clients (a client found gone is
 * news to the scheduler, which may queue more), plans to the workers. */
static void carry_out(struct bd_router *rt)
{
	struct bd_sched_act a;

	while (bd_sched_next(&rt->sched, &a)) {
		if (a.kind == BD_SCHED_PLAN) {
			bd_router_send_plan(rt, a.plan, bd_now_ms());
			continue;
		}
		bd_router_metrics_chunk(rt->metrics, a.r, a.finish, a.error, bd_now_ms());
		if (bd_router_send_chunk(rt, a.r, a.finish, a.error, a.msg) == -EHOSTUNREACH)
			bd_sched_client_gone(&rt->sched, a.r->ident, a.r->ident_len);
	}
}

/* ---- loop ---------------------------------------------------------------------------------- */

static void notify_status(struct bd_router *rt)
{
	static const char *const st[] = { "starting", "serving", "degraded", "stopping" };
	const struct bd_sched *s = &rt->sched;
	int64_t now = bd_now_ms();

	if (rt->draining) {
		bd_daemon_status(&rt->d, "draining %zu requests (%zu running, %zu queued), %lld ms "
			   "left", s->n_reqs, s->n_running, s->n_queued,
			   (long long)(rt->drain_end > now ? rt->drain_end - now : 0));
		return;
	}
	bd_daemon_status(&rt->d, "%s%s: %zu running, %zu queued, %llu tokens, pages %llu held "
		   "(peak %llu)",
		   st[rt->state], rt->pool_ok ? "" : " (kvpoold unreachable)", s->n_running,
		   s->n_queued, (unsigned long long)s->tokens_generated,
		   (unsigned long long)s->pages_held, (unsigned long long)s->pages_peak);
}

static void metrics_gauges(struct bd_router *rt)
{
	const struct bd_metrics_gauges g = {
		.running = rt->sched.n_running,
		.waiting = rt->sched.n_queued,
		.pages_total = rt->pages_total,
		.pages_free = rt->pages_free,
		.slots_total = rt->slots_total,
		.slots_free = rt->slots_free,
		.pages_held = rt->sched.pages_held,
		.preemptions = rt->sched.preemptions,
		.prefix_queries = rt->sched.prefix_queries,
		.prefix_hits = rt->sched.prefix_hits,
		.pages_cached = rt->pages_cached,
		.prefix_evictions = rt->prefix_evictions,
		.healthy = rt->state == RS_SERVING && rt->pool_ok,
	};

	bd_router_metrics_gauges(rt->metrics, &g);
}

static void on_tick(struct bd_router *rt, int64_t now)
{
	metrics_gauges(rt);
	if (now >= rt->next_status) {
		notify_status(rt);
		rt->next_status = now + rt->o.status_ms;
	}
	bd_daemon_watchdog(&rt->d, now);
	bd_router_workers_tick(rt, now);
	if (bd_router_pool_tick(rt, now)) {
		char msg[600];

		bd_router_pool_reason(rt, msg, sizeof(msg));
		bd_sched_pool_down(&rt->sched, msg);
	}
	bd_sched_tick(&rt->sched, now);
	bd_router_keepalive(rt, now);
}

/* SIGTERM/SIGINT: the first starts the drain (when there is something to drain and a drain
 * time), a second one, or one with nothing to drain, stops at once. */
static void on_stop_signal(struct bd_router *rt, unsigned signo)
{
	int64_t now = bd_now_ms();

	if (rt->draining) {
		bd_log_warn("signal %u during the drain: stopping now, %zu request(s) fail", signo,
			    rt->sched.n_reqs);
		rt->stop = true;
		return;
	}
	if (!rt->sched.n_reqs || rt->o.drain_timeout_ms == 0 || !rt->group_ready) {
		bd_log_info("signal %u: stopping%s", signo,
			    rt->sched.n_reqs && !rt->group_ready ? " (no worker group to drain with)"
								 : "");
		rt->stop = true;
		return;
	}
	rt->draining = true;
	rt->drain_start = now;
	rt->drain_end = now + rt->o.drain_timeout_ms;
	rt->state = RS_STOPPING;
	bd_log_info("signal %u: draining %zu request(s) (%zu running, %zu queued) for up to %d ms; "
		    "new requests are refused", signo, rt->sched.n_reqs, rt->sched.n_running,
		    rt->sched.n_queued, rt->o.drain_timeout_ms);
	bd_daemon_stopping(&rt->d);
	notify_status(rt);
	rt->next_status = now + rt->o.status_ms;
}

/* The drain is over when every accepted request has ended, or its time is up. */
static void drain_check(struct bd_router *rt, int64_t now)
{
	if (!rt->draining)
		return;
	if (!rt->sched.n_reqs) {
		bd_log_info("drain done in %lld ms: every request finished",
			  (long long)(now - rt->drain_start));
		rt->stop = true;
	} else if (now >= rt->drain_end) {
		bd_log_warn("drain_timeout_ms (%d) passed: %zu request(s) fail", rt->o.drain_timeout_ms,
			    rt->sched.n_reqs);
		rt->stop = true;
	} else if (!rt->group_ready) {
		/* the workers are going too (a stop of the whole target): nothing can progress */
		bd_log_warn("the worker group failed during the drain: %zu request(s) fail",
			    rt->sched.n_reqs);
		rt->stop = true;
	}
}

static int run(struct bd_router *rt)
{
	int64_t last = bd_now_ms();

	while (!rt->stop) {
		zmq_pollitem_t items[5] = {
			{ .socket = rt->front, .events = ZMQ_POLLIN },
			{ .socket = rt->wsock, .events = ZMQ_POLLIN },
			{ .fd = rt->d.signal_fd, .events = ZMQ_POLLIN },
			{ .socket = rt->probe, .events = ZMQ_POLLIN },
			{ .socket = rt->probe_mon, .events = ZMQ_POLLIN },
		};
		int r = zmq_poll(items, 5, 20), signo;

		if (r < 0) {
			if (zmq_errno() == EINTR)
				continue;
			bd_log_err("zmq_poll: %s", zmq_strerror(zmq_errno()));
			return -EIO;
		}
		if (items[2].revents) {
			while ((signo = bd_daemon_signal(&rt->d)) > 0)
				if (signo != SIGUSR1) /* no report to give */
					on_stop_signal(rt, (unsigned)signo);
			if (rt->stop)
				break;
		}
		if (items[1].revents) {
			bd_router_on_workers(rt);
			carry_out(rt);
		}
		if (items[3].revents || items[4].revents)
			bd_router_pool_on_probe(rt, bd_sched_pool_busy(&rt->sched));
		if (items[0].revents) {
			bd_router_on_frontend(rt);
			carry_out(rt);
		}
		on_tick(rt, bd_now_ms());
		carry_out(rt);
		bd_sched_schedule(&rt->sched, bd_now_ms());
		carry_out(rt);
		drain_check(rt, bd_now_ms());
		/* heartbeats ride on this loop: a long stall looks like a dead router to workers */
		if (bd_now_ms() - last > 1000)
			bd_log_warn("event loop stalled for %lld ms",
				    (long long)(bd_now_ms() - last));
		last = bd_now_ms();
	}
	return 0;
}

static void shutdown_requests(struct bd_router *rt)
{
	char msg[160];
	uint64_t n_req = 0, n_pages = 0;

	if (rt->draining)
		snprintf(msg, sizeof(msg), "the router stopped before this request finished "
					   "(drain of %lld ms)",
			 (long long)(bd_now_ms() - rt->drain_start));
	else
		snprintf(msg, sizeof(msg), "the router is stopping");
	rt->state = RS_STOPPING;
	/* every request ends SHUTTING_DOWN, those in the step in flight too */
	bd_sched_stop(&rt->sched, BDFP4__SERVE_ERROR__SERVE_ERR_SHUTTING_DOWN, msg);
	carry_out(rt);
	/* what clients sent meanwhile gets its answer (requests: SHUTTING_DOWN), not silence;
	 * after a drain, for a moment more: closed-loop clients send again as they are answered */
	for (int64_t end = bd_now_ms() + (rt->draining ? 500 : 0);;) {
		zmq_pollitem_t it = { .socket = rt->front, .events = ZMQ_POLLIN };
		int64_t left = end - bd_now_ms();

		if (zmq_poll(&it, 1, left > 0 ? (long)left : 0) > 0) {
			bd_router_on_frontend(rt);
			carry_out(rt);
		} else if (left <= 0) {
			break;
		}
	}
	bd_router_workers_shutdown(rt);
	/* nothing of this router's stays in the pool (a release that failed left a record) */
	if (rt->pool && rt->pool_ok &&
	    POOL_CALL(rt, bd_pool_owner_reclaim(rt->pool, rt->o.owner, &n_req, &n_pages)) == 0 &&
	    n_req)
		bd_log_warn("pool: reclaimed %llu leftover request record(s), %llu page(s)",
			    (unsigned long long)n_req, (unsigned long long)n_pages);
}

static void unlink_endpoint(const char *ep)
{
	const char *path = bd_ipc_endpoint_path(ep);

	if (path)
		unlink(path);
}

static void cleanup(struct bd_router *rt)
{
	bd_router_http_stop(rt); /* its threads' sockets go before the context */
	bd_sched_fini(&rt->sched);
	for (int i = 0; i < BD_ROUTER_MAX_TP; i++)
		if (rt->step.res[i])
			bdfp4__step_result__free_unpacked(rt->step.res[i], NULL);
	for (int i = 0; i < rt->o.n_frontends; i++) {
		/* only the files of endpoints this process bound: never a live router's */
		if (i < rt->n_front_bound)
			unlink_endpoint(rt->o.frontends[i]);
		free(rt->o.frontends[i]);
	}
	if (rt->workers_bound)
		unlink_endpoint(rt->o.workers);
	bd_router_pool_close(rt);
	bd_wire_close(&rt->front);
	bd_wire_close(&rt->wsock);
	bd_zsec_zap_stop(rt->zap);
	bd_wire_ctx_term(&rt->zctx);
	bd_pool_conn_free(rt->pool);
	bd_tokenizer_free(rt->tok);
	free(rt->eog);
	bd_daemon_end(&rt->d);
}

static int start_sched(struct bd_router *rt)
{
	struct bd_sched_cfg cfg = rt->o.sched;
	int e;

	cfg.n_vocab = rt->n_vocab;
	cfg.eog = rt->eog;
	cfg.tok = rt->tok;
	e = bd_sched_init(&rt->sched, &cfg, &bd_router_pool_ops, rt);

	if (e < 0) {
		bd_log_err("scheduler: %s", strerror(-e));
		return e;
	}
	bd_sched_set_prefix(&rt->sched, rt->o.sched.prefix_cache,
			    bd_prefix_seed(rt->model_name, rt->kv_config, rt->page_format, 0));
	return e;
}

int main(int argc, char **argv)
{
	static struct bd_router rt = { /* large; zeroed */
		.d = { .name = "routerd", .section = SECTION, .keys = keys },
		.pool_ok = true, /* until a call or the probe says otherwise */
	};
	int e = bd_daemon_start(&rt.d, argc, argv);

	if (e == 1) {
		bd_daemon_end(&rt.d);
		return 0;
	}
	bd_log_set_debug(getenv("BD_ROUTER_DEBUG") != NULL);
	if (e < 0 || read_opts(&rt) < 0 || load_model(&rt) < 0 || connect_pool(&rt) < 0 ||
	    start_sched(&rt) < 0 || setup_sockets(&rt) < 0 || bd_router_http_start(&rt) < 0)
		goto fail;
	rt.t_start = bd_now_ms();
	snprintf(rt.reason, sizeof(rt.reason), "waiting for %d worker rank(s) to register",
		 rt.o.tp);
	bd_log_info("listening on %s (+%d more) for clients, %s for workers", rt.o.frontends[0],
		    rt.o.n_frontends - 1, rt.o.workers);
	bd_daemon_ready(&rt.d);
	e = run(&rt);
	bd_daemon_stopping(&rt.d);
	shutdown_requests(&rt);
	cleanup(&rt);
	return e < 0 ? 1 : 0;
fail:
	cleanup(&rt);
	return 1;
}
