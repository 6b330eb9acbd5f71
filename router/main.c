/* routerd — the router of the bdfp4 serving system (DESIGN.md).
 *
 * Terminates the client API (serve.proto over a ZeroMQ ROUTER frontend), tokenizes, admits
 * requests against the pool's capacity, batches them continuously and sends each step's plan
 * to every worker rank. One event loop (zmq_poll over the frontend, the worker socket and a
 * signalfd, with a periodic tick for deadlines, heartbeats, keepalives and sd_notify).
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
#include <getopt.h>
#include <libgen.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <systemd/sd-daemon.h>
#include <zmq.h>

#include "base/bd_config.h"
#include "formats/bd_gguf.h"
#include "base/bd_ipc.h"
#include "model/bd_model_preset.h"
#include "quant/bd_kvcfg.h"
#include "router.h"

#define SECTION "router"
#define FRONT_HARD_MAX (16 << 20) /* frames above this drop the peer instead of a reply */

static const struct bd_config_key keys[] = {
	{ "frontend", "tcp://127.0.0.1:5555,ipc:///run/bdfp4/router.sock",
	  "client endpoints (comma-separated, ZeroMQ ROUTER)" },
	{ "workers", "ipc:///run/bdfp4/router-workers.sock", "worker endpoint (ZeroMQ ROUTER)" },
	{ "pool", BD_POOL_DEFAULT_ENDPOINT, "kvpoold's allocation endpoint" },
	{ "model", "/usr/share/bdfp4/models/SmolLM2-135M-Instruct.Q4_1.gguf",
	  "GGUF model (tokenizer, chat template, context, vocabulary)" },
	{ "random_weights", "",
	  "serve a model of seeded random weights of this shape (workerd --random-weights, e.g. "
	  "qwen3-4b) instead of model: no tokenizer, requests send token_ids" },
	{ "kv_config", "", "KV configuration (empty: the pool's)" },
	{ "tp", "2", "tensor-parallel ranks (workers) in the group" },
	{ "max_batch", "16", "rows (running requests) per step" },
	{ "max_queue", "64", "queued requests before resource-exhausted" },
	{ "max_frame_bytes", "1048576", "largest client frame; larger ones get an error reply" },
	{ "max_prefill_tokens", "8192", "prompt tokens prefilled in one step (one prompt at least)" },
	{ "deadline_ms", "300000", "default per-request deadline" },
	{ "heartbeat_ms", "250", "heartbeat period, both ways" },
	{ "heartbeat_timeout_ms", "3000", "a worker silent this long is dead" },
	{ "step_timeout_ms", "120000", "a step not answered in this time fails the group" },
	{ "keepalive_ms", "1000", "keepalive period to quiet clients with live requests" },
	{ "pool_timeout_ms", "2000", "one pool round trip" },
	{ "pool_wait_ms", "30000", "wait this long for kvpoold at start" },
	{ "pool_probe_ms", "1000",
	  "period of the non-blocking kvpoold probe (a dead pool shows in health within this plus "
	  "pool_timeout_ms; it is back at the first answer)" },
	{ "drain_timeout_ms", "30000",
	  "on SIGTERM, step the accepted requests to their end for up to this long (0: fail them "
	  "at once); keep below the unit's TimeoutStopSec" },
	{ "pool_owner", "1", "owner id of this router's requests in the pool" },
	{ "status_interval_ms", "1000", "sd_notify STATUS period" },
	{ NULL, NULL, NULL },
};

/* ---- configuration ------------------------------------------------------------------------- */

static void usage(FILE *f)
{
	bd_config_usage(f, "routerd", NULL, SECTION, keys);
}

static const char *key_def(const char *key)
{
	for (const struct bd_config_key *k = keys; k->name; k++)
		if (!strcmp(k->name, key))
			return k->def;
	return "";
}

static const char *get_str(struct bd_router *rt, const char *key)
{
	return bd_config_str(rt->cfg, SECTION, keys, key);
}

static int get_int(struct bd_router *rt, const char *key, int64_t min, int64_t max, int *ret)
{
	int64_t v;
	int e = bd_config_get_i64(rt->cfg, SECTION, key, strtoll(key_def(key), NULL, 0), min, max,
				  &v);

	if (e < 0) {
		bd_log_err("%s = '%s': %s (allowed %lld..%lld)", key,
			 bd_config_get(rt->cfg, SECTION, key),
			 e == -ERANGE ? "out of range" : "not an integer", (long long)min,
			 (long long)max);
		return e;
	}
	*ret = (int)v;
	return 0;
}

static int parse_args(struct bd_router *rt, int argc, char **argv)
{
	char err[256];
	int e = bd_config_parse_args(rt->cfg, SECTION, keys, BD_CONFIG_DEFAULT_PATH, argc, argv, err,
				     sizeof(err));

	if (e == 1) {
		usage(stdout);
	} else if (e < 0) {
		bd_log_err("%s", err);
		if (e == -EINVAL)
			usage(stderr);
	}
	return e;
}

static int read_opts(struct bd_router *rt)
{
	struct bd_router_opts *o = &rt->o;
	const char *bad, *fe;
	char *copy, *save = NULL, *tokn;
	int owner = 0;

	bad = bd_config_unknown(rt->cfg, SECTION, keys);
	if (bad) {
		bd_log_err("unknown key '%s' in [%s]", bad, SECTION);
		return -EINVAL;
	}
	fe = get_str(rt, "frontend");
	copy = strdup(fe);
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
	o->workers = get_str(rt, "workers");
	o->pool = get_str(rt, "pool");
	o->model = get_str(rt, "model");
	o->random_weights = get_str(rt, "random_weights");
	o->kv_config = get_str(rt, "kv_config");
	if (get_int(rt, "tp", 1, BD_ROUTER_MAX_TP, &o->tp) < 0 ||
	    get_int(rt, "max_batch", 1, 4096, &o->max_batch) < 0 ||
	    get_int(rt, "max_queue", 0, 1 << 20, &o->max_queue) < 0 ||
	    get_int(rt, "max_prefill_tokens", 1, 1 << 24, &o->max_prefill_tokens) < 0 ||
	    get_int(rt, "deadline_ms", 1, INT_MAX, &o->deadline_ms) < 0 ||
	    get_int(rt, "heartbeat_ms", 10, 600000, &o->heartbeat_ms) < 0 ||
	    get_int(rt, "heartbeat_timeout_ms", 20, 3600000, &o->heartbeat_timeout_ms) < 0 ||
	    get_int(rt, "step_timeout_ms", 100, INT_MAX, &o->step_timeout_ms) < 0 ||
	    get_int(rt, "keepalive_ms", 10, 3600000, &o->keepalive_ms) < 0 ||
	    get_int(rt, "pool_timeout_ms", 10, 600000, &o->pool_timeout_ms) < 0 ||
	    get_int(rt, "pool_wait_ms", 0, 3600000, &o->pool_wait_ms) < 0 ||
	    get_int(rt, "pool_probe_ms", 10, 600000, &o->pool_probe_ms) < 0 ||
	    get_int(rt, "drain_timeout_ms", 0, 3600000, &o->drain_timeout_ms) < 0 ||
	    get_int(rt, "pool_owner", 1, INT_MAX, &owner) < 0 ||
	    get_int(rt, "status_interval_ms", 10, 3600000, &o->status_ms) < 0)
		return -EINVAL;
	o->owner = (uint64_t)owner;
	{
		uint64_t mf;

		if (bd_config_get_bytes(rt->cfg, SECTION, "max_frame_bytes", 1 << 20, 256,
					FRONT_HARD_MAX, &mf) < 0) {
			bd_log_err("max_frame_bytes: a byte size in 256..%d", FRONT_HARD_MAX);
			return -EINVAL;
		}
		o->max_frame = (int)mf;
	}
	if (o->heartbeat_timeout_ms <= o->heartbeat_ms) {
		bd_log_err("heartbeat_timeout_ms must exceed heartbeat_ms");
		return -EINVAL;
	}
	if (*o->kv_config && !bd_kvcfg_find(o->kv_config)) {
		bd_log_err("unknown kv_config '%s'", o->kv_config);
		return -EINVAL;
	}
	return 0;
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

/* The directory of an ipc:// endpoint, when systemd has not made it. */
/* An ipc:// endpoint another process listens on (a second router pointed at a live one's
 * paths): ZeroMQ would silently take the path over, so refuse. */
static bool ipc_in_use(const char *ep)
{
	if (strncmp(ep, "ipc://", 6) || bd_ipc_path_in_use(ep + 6) != 1)
		return false;
	bd_log_err("%s: another process listens there (is a router already running?)", ep);
	return true;
}

static void ipc_mkdir(const char *endpoint)
{
	char dir[PATH_MAX], *slash;

	if (strncmp(endpoint, "ipc://", 6))
		return;
	snprintf(dir, sizeof(dir), "%s", endpoint + 6);
	slash = strrchr(dir, '/');
	if (slash && slash != dir) {
		*slash = 0;
		if (mkdir(dir, 0755) < 0 && errno != EEXIST)
			bd_log_warn("%s: %s", dir, strerror(errno));
	}
}

static void *router_socket(struct bd_router *rt, int64_t maxmsg)
{
	void *s = zmq_socket(rt->zctx, ZMQ_ROUTER);
	int zero = 0, one = 1, hwm = 100000;

	if (!s)
		return NULL;
	/* MANDATORY: a send to a gone peer fails (EHOSTUNREACH) instead of vanishing; that is
	 * how a disconnected client or a dead worker shows up */
	if (zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero)) < 0 ||
	    zmq_setsockopt(s, ZMQ_ROUTER_MANDATORY, &one, sizeof(one)) < 0 ||
	    zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg)) < 0 ||
	    zmq_setsockopt(s, ZMQ_SNDHWM, &hwm, sizeof(hwm)) < 0 ||
	    zmq_setsockopt(s, ZMQ_RCVHWM, &hwm, sizeof(hwm)) < 0) {
		zmq_close(s);
		return NULL;
	}
	return s;
}

static int setup_sockets(struct bd_router *rt)
{
	sigset_t ss;

	sigemptyset(&ss);
	sigaddset(&ss, SIGTERM);
	sigaddset(&ss, SIGINT);
	sigaddset(&ss, SIGHUP);
	rt->sig_fd = signalfd(-1, &ss, SFD_CLOEXEC | SFD_NONBLOCK);
	if (rt->sig_fd < 0) {
		bd_log_err("signalfd: %s", strerror(errno));
		return -errno;
	}
	rt->zctx = zmq_ctx_new();
	if (!rt->zctx)
		return -ENOMEM;
	rt->front = router_socket(rt, FRONT_HARD_MAX);
	rt->wsock = router_socket(rt, BD_ROUTER_WORKER_MAX_FRAME);
	if (!rt->front || !rt->wsock) {
		bd_log_err("zmq socket: %s", zmq_strerror(zmq_errno()));
		return -EIO;
	}
	for (int i = 0; i < rt->o.n_frontends; i++) {
		ipc_mkdir(rt->o.frontends[i]);
		if (ipc_in_use(rt->o.frontends[i]))
			return -EADDRINUSE;
		if (zmq_bind(rt->front, rt->o.frontends[i]) < 0) {
			bd_log_err("frontend %s: %s", rt->o.frontends[i], zmq_strerror(zmq_errno()));
			return -EIO;
		}
		rt->n_front_bound = i + 1;
	}
	ipc_mkdir(rt->o.workers);
	if (ipc_in_use(rt->o.workers))
		return -EADDRINUSE;
	if (zmq_bind(rt->wsock, rt->o.workers) < 0) {
		bd_log_err("worker endpoint %s: %s", rt->o.workers, zmq_strerror(zmq_errno()));
		return -EIO;
	}
	rt->workers_bound = true;
	return bd_router_pool_open(rt);
}

/* ---- loop ---------------------------------------------------------------------------------- */

static void notify_status(struct bd_router *rt)
{
	static const char *const st[] = { "starting", "serving", "degraded", "stopping" };
	int64_t now = bd_now_ms();

	if (rt->draining) {
		sd_notifyf(0, "STATUS=draining %zu requests (%zu running, %zu queued), %lld ms left",
			   rt->n_reqs, rt->n_running, rt->n_queued,
			   (long long)(rt->drain_end > now ? rt->drain_end - now : 0));
		return;
	}
	sd_notifyf(0, "STATUS=%s%s: %zu running, %zu queued, %llu tokens, pages %llu held "
		   "(peak %llu)",
		   st[rt->state], rt->pool_ok ? "" : " (kvpoold unreachable)", rt->n_running,
		   rt->n_queued, (unsigned long long)rt->tokens_generated,
		   (unsigned long long)rt->pages_held, (unsigned long long)rt->pages_peak);
}

static void on_tick(struct bd_router *rt, int64_t now)
{
	if (now >= rt->next_status) {
		notify_status(rt);
		rt->next_status = now + rt->o.status_ms;
	}
	if (rt->watchdog_usec && now >= rt->next_watchdog) {
		sd_notify(0, "WATCHDOG=1");
		rt->next_watchdog = now + (int64_t)(rt->watchdog_usec / 2000);
	}
	bd_router_workers_tick(rt, now);
	bd_router_pool_tick(rt, now);
	bd_router_deadlines(rt, now);
	bd_router_keepalive(rt, now);
}

/* SIGTERM/SIGINT: the first starts the drain (when there is something to drain and a drain
 * time), a second one, or one with nothing to drain, stops at once. */
static void on_stop_signal(struct bd_router *rt, unsigned signo)
{
	int64_t now = bd_now_ms();

	if (rt->draining) {
		bd_log_warn("signal %u during the drain: stopping now, %zu request(s) fail", signo,
			  rt->n_reqs);
		rt->stop = true;
		return;
	}
	if (!rt->n_reqs || rt->o.drain_timeout_ms == 0 || !rt->group_ready) {
		bd_log_info("signal %u: stopping%s", signo,
			  rt->n_reqs && !rt->group_ready ? " (no worker group to drain with)" : "");
		rt->stop = true;
		return;
	}
	rt->draining = true;
	rt->drain_start = now;
	rt->drain_end = now + rt->o.drain_timeout_ms;
	rt->state = RS_STOPPING;
	bd_log_info("signal %u: draining %zu request(s) (%zu running, %zu queued) for up to %d ms; "
		  "new requests are refused", signo, rt->n_reqs, rt->n_running, rt->n_queued,
		  rt->o.drain_timeout_ms);
	sd_notify(0, "STOPPING=1");
	notify_status(rt);
	rt->next_status = now + rt->o.status_ms;
}

/* The drain is over when every accepted request has ended, or its time is up. */
static void drain_check(struct bd_router *rt, int64_t now)
{
	if (!rt->draining)
		return;
	if (!rt->n_reqs) {
		bd_log_info("drain done in %lld ms: every request finished",
			  (long long)(now - rt->drain_start));
		rt->stop = true;
	} else if (now >= rt->drain_end) {
		bd_log_warn("drain_timeout_ms (%d) passed: %zu request(s) fail", rt->o.drain_timeout_ms,
			  rt->n_reqs);
		rt->stop = true;
	} else if (!rt->group_ready) {
		/* the workers are going too (a stop of the whole target): nothing can progress */
		bd_log_warn("the worker group failed during the drain: %zu request(s) fail",
			  rt->n_reqs);
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
			{ .fd = rt->sig_fd, .events = ZMQ_POLLIN },
			{ .socket = rt->probe, .events = ZMQ_POLLIN },
			{ .socket = rt->probe_mon, .events = ZMQ_POLLIN },
		};
		int r = zmq_poll(items, 5, 20);

		if (r < 0) {
			if (zmq_errno() == EINTR)
				continue;
			bd_log_err("zmq_poll: %s", zmq_strerror(zmq_errno()));
			return -EIO;
		}
		if (items[2].revents) {
			struct signalfd_siginfo si;

			while (read(rt->sig_fd, &si, sizeof(si)) == sizeof(si)) {
				if (si.ssi_signo == SIGHUP) {
					bd_log_info("SIGHUP ignored: restart to reconfigure");
					continue;
				}
				on_stop_signal(rt, si.ssi_signo);
			}
			if (rt->stop)
				break;
		}
		if (items[1].revents)
			bd_router_on_workers(rt);
		if (items[3].revents || items[4].revents)
			bd_router_pool_on_probe(rt);
		if (items[0].revents)
			bd_router_on_frontend(rt);
		on_tick(rt, bd_now_ms());
		bd_router_schedule(rt);
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
	/* every request ends SHUTTING_DOWN: those in the step in flight are marked, and the
	 * abort of the step applies the mark */
	for (size_t i = rt->n_reqs; i-- > 0;) {
		if (i >= rt->n_reqs)
			continue;
		bd_router_finish(rt, rt->reqs[i], BDFP4__FINISH_REASON__FINISH_ERROR,
				 BDFP4__SERVE_ERROR__SERVE_ERR_SHUTTING_DOWN, msg, true);
	}
	bd_router_abort_step(rt, msg);
	while (rt->n_reqs)
		bd_router_finish(rt, rt->reqs[rt->n_reqs - 1], BDFP4__FINISH_REASON__FINISH_ERROR,
				 BDFP4__SERVE_ERROR__SERVE_ERR_SHUTTING_DOWN, msg, true);
	bd_router_workers_shutdown(rt);
	/* nothing of this router's stays in the pool (a release that failed left a record) */
	if (rt->pool && rt->pool_ok &&
	    POOL_CALL(rt, bd_pool_owner_reclaim(rt->pool, rt->o.owner, &n_req, &n_pages)) == 0 &&
	    n_req)
		bd_log_warn("pool: reclaimed %llu leftover request record(s), %llu page(s)",
			  (unsigned long long)n_req, (unsigned long long)n_pages);
}

static void cleanup(struct bd_router *rt)
{
	while (rt->n_reqs)
		bd_req_free(rt->reqs[--rt->n_reqs]);
	free(rt->reqs);
	free(rt->release);
	free(rt->step.rows);
	for (int i = 0; i < BD_ROUTER_MAX_TP; i++)
		if (rt->step.res[i])
			bdfp4__step_result__free_unpacked(rt->step.res[i], NULL);
	for (int i = 0; i < rt->o.n_frontends; i++) {
		/* only the files of endpoints this process bound: never a live router's */
		if (i < rt->n_front_bound && !strncmp(rt->o.frontends[i], "ipc://", 6))
			unlink(rt->o.frontends[i] + 6);
		free(rt->o.frontends[i]);
	}
	if (rt->workers_bound && rt->o.workers && !strncmp(rt->o.workers, "ipc://", 6))
		unlink(rt->o.workers + 6);
	bd_router_pool_close(rt);
	if (rt->front)
		zmq_close(rt->front);
	if (rt->wsock)
		zmq_close(rt->wsock);
	if (rt->zctx)
		zmq_ctx_term(rt->zctx);
	if (rt->sig_fd >= 0)
		close(rt->sig_fd);
	bd_pool_conn_free(rt->pool);
	bd_tokenizer_free(rt->tok);
	free(rt->eog);
	bd_config_free(rt->cfg);
}

int main(int argc, char **argv)
{
	static struct bd_router rt; /* large; zeroed */
	sigset_t ss;
	int e;

	rt.sig_fd = -1;
	rt.pool_ok = true; /* until a call or the probe says otherwise */
	bd_log_init("routerd");
	bd_log_set_debug(getenv("BD_ROUTER_DEBUG") != NULL);
	sigemptyset(&ss);
	sigaddset(&ss, SIGTERM);
	sigaddset(&ss, SIGINT);
	sigaddset(&ss, SIGHUP);
	sigprocmask(SIG_BLOCK, &ss, NULL);
	signal(SIGPIPE, SIG_IGN);
	if (bd_ipc_raise_nofile() < 0)
		bd_log_warn("cannot raise the open-file limit: %s", strerror(errno));

	rt.cfg = bd_config_new();
	if (!rt.cfg)
		return 1;
	e = parse_args(&rt, argc, argv);
	if (e == 1) {
		bd_config_free(rt.cfg);
		return 0;
	}
	if (e < 0 || read_opts(&rt) < 0 || load_model(&rt) < 0 || connect_pool(&rt) < 0 ||
	    setup_sockets(&rt) < 0)
		goto fail;
	rt.t_start = bd_now_ms();
	rt.next_id = 1;
	rt.next_step = 1;
	snprintf(rt.reason, sizeof(rt.reason), "waiting for %d worker rank(s) to register",
		 rt.o.tp);
	if (sd_watchdog_enabled(0, &rt.watchdog_usec) <= 0)
		rt.watchdog_usec = 0;
	bd_log_info("listening on %s (+%d more) for clients, %s for workers", rt.o.frontends[0],
		  rt.o.n_frontends - 1, rt.o.workers);
	sd_notify(0, "READY=1");
	e = run(&rt);
	sd_notify(0, "STOPPING=1");
	shutdown_requests(&rt);
	cleanup(&rt);
	return e < 0 ? 1 : 0;
fail:
	cleanup(&rt);
	return 1;
}
