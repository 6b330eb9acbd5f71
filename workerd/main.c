/* main.c — workerd: one tensor-parallel rank of the model (DESIGN.md).
 *
 * Loads its shard of the GGUF model, attaches to kvpoold's arena of its rank, registers with
 * the router and executes the step plans of its group (step.c), joined to the other ranks by
 * the shared-memory all-reduce the RegisterReply names. A pool of the cuda backend
 * runs the model on the rank's GPU instead (gpu.c), joined by NCCL. Configuration: the
 * [worker] section of the INI file, every key also a flag. One event loop on the compute thread (router frames from
 * the I/O thread, signals, the pool's attach socket, a 200 ms tick); sd_notify READY/STATUS, the
 * watchdog from the I/O thread. SIGTERM or SIGINT: exit 0. Fatal errors: exit 1; bad flags: 2.
 */
#include <errno.h>
#include <getopt.h>
#include <libgen.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <time.h>
#include <unistd.h>

#include <cblas.h>
#include <systemd/sd-daemon.h>
#include <zmq.h>

#include "base/bd_config.h"
#include "base/bd_ipc.h"
#include "model/bd_model_preset.h"
#include "workerd.h"

#define SECTION "worker"
#define DEFAULT_MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define DEFAULT_ROUTER "ipc:///run/bdfp4/router-workers.sock"
/* No frame from the router this long: it is gone without a Shutdown; register again. Long: a
 * router blocked on kvpoold is slow, not gone, and a restarted router resets workers that
 * heartbeat an epoch it does not know. */
#define ROUTER_SILENCE_MS 30000
#define GONE_RETRY_MS 1000 /* a register no frame followed: send it again */
#define REGISTER_RETRY_MS 200  /* a register dropped (no connection): send it again */

static const struct bd_config_key keys[] = {
	{ "rank", "0", "tensor-parallel rank of this worker (0..tp-1)" },
	{ "tp", "2", "tensor-parallel ranks" },
	{ "model", "", "GGUF model (default: $BD_MODEL, else " DEFAULT_MODEL ")" },
	{ "pool_socket", BD_POOL_DEFAULT_SOCKET, "kvpoold attach socket" },
	{ "router", DEFAULT_ROUTER, "the router's worker endpoint (ZeroMQ)" },
	{ "allreduce_dir", "/dev/shm", "directory of the shared-memory all-reduce files" },
	{ "threads", "1", "OpenBLAS threads" },
	{ "allreduce_timeout_ms", "30000", "longest wait for the other rank in a step" },
	{ "verbose", "0", "log every step" },
	{ "calib", "", "calibration file of the model (mu_k, tau; bdfp4 calibrate); empty: none" },
	/* the cuda backend (chosen by the pool) */
	{ "device", "-1", "cuda: CUDA device of this rank (-1: the pool's device of the rank)" },
	{ "weights", "bf16", "cuda: weight precision, bf16 or f32" },
	{ "random_weights", "",
	  "cuda: no checkpoint, seeded random weights of this shape (qwen3-4b, qwen3-30b-a3b-attn)" },
	{ "seed", "1", "cuda: seed of the random weights" },
	{ "synthetic_prefill", "0",
	  "cuda: fill prompts with synthetic KV and decode only their last token", true },
	{ "max_batch", "64", "cuda: decode rows per model call (at least the router's max_batch)" },
	{ "max_tokens", "0", "cuda: longest sequence, tokens (0: the pool's max_seq_len)" },
	{ "max_prefill", "8192", "cuda: longest prompt one real prefill takes, tokens" },
	{ "cuda_graphs", "1", "cuda: replay decode steps from CUDA graphs", true },
	{ NULL, NULL, NULL, false },
};

static int sig_pipe_w = -1;

/* OpenBLAS starts its threads before main(), with every signal unblocked, so a signalfd
 * would miss SIGTERM taken by one of them: a handler feeding a pipe sees it on any thread. */
static void on_signal(int signo)
{
	int saved = errno;
	unsigned char b = (unsigned char)signo;
	if (write(sig_pipe_w, &b, 1) < 0) {
		/* the pipe is full: a stop is already pending */
	}
	errno = saved;
}

/* STATUS= only when it changes: each datagram queues at the notify socket's reader (systemd,
 * or a test), and a reader that stops reading would block a sender that repeats itself. */
static void set_status(struct wd *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void set_status(struct wd *w, const char *fmt, ...)
{
	char buf[sizeof(w->status)];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(buf, sizeof(buf), fmt, ap);
	va_end(ap);
	if (!strcmp(buf, w->status))
		return;
	memcpy(w->status, buf, sizeof(buf));
	sd_notifyf(0, "STATUS=%s", buf);
}

/* ---- configuration ------------------------------------------------------------------------- */

static void usage(FILE *f)
{
	bd_config_usage(f, "workerd", "One tensor-parallel rank: its model shard, kvpoold's arena, the router's plans.", SECTION, keys);
}

static const char *get_str(const struct bd_config *cfg, const char *key)
{
	return bd_config_str(cfg, SECTION, keys, key);
}

static int get_int(const struct bd_config *cfg, const char *key, int64_t min, int64_t max,
		   int *ret)
{
	int64_t v;
	int e = bd_config_get_i64(cfg, SECTION, key, strtoll(get_str(cfg, key), NULL, 10), min,
				  max, &v);
	if (e < 0) {
		bd_log_err("%s = '%s': %s (allowed %lld..%lld)", key, get_str(cfg, key),
		       e == -ERANGE ? "out of range" : "not an integer", (long long)min,
		       (long long)max);
		return e;
	}
	*ret = (int)v;
	return 0;
}

/* Returns 0, 1 (--help), or -EINVAL. */
static int parse_args(struct bd_config *cfg, int argc, char **argv)
{
	char err[256];
	int e = bd_config_parse_args(cfg, SECTION, keys, BD_CONFIG_DEFAULT_PATH, argc, argv, err,
				     sizeof(err));

	if (e == 1) {
		usage(stdout);
	} else if (e < 0) {
		bd_log_err("%s", err);
		if (e == -EINVAL)
			usage(stderr);
	}
	return e < 0 ? -EINVAL : e;
}

static int read_opts(const struct bd_config *cfg, struct wd_opts *o)
{
	int verbose;
	int64_t seed;
	bool b;
	const char *bad = bd_config_unknown(cfg, SECTION, keys);
	if (bad) {
		bd_log_err("unknown key '%s' in [%s]", bad, SECTION);
		return -EINVAL;
	}
	if (get_int(cfg, "tp", 1, BD_ALLREDUCE_MAX_TP, &o->tp) < 0 ||
	    get_int(cfg, "rank", 0, o->tp - 1, &o->rank) < 0 ||
	    get_int(cfg, "threads", 1, 256, &o->threads) < 0 ||
	    get_int(cfg, "allreduce_timeout_ms", 100, 3600000, &o->ar_timeout_ms) < 0 ||
	    get_int(cfg, "verbose", 0, 1, &verbose) < 0)
		return -EINVAL;
	o->verbose = verbose;
	if (get_int(cfg, "device", -1, 1023, &o->device) < 0 ||
	    get_int(cfg, "max_batch", 1, 1024, &o->max_batch) < 0 ||
	    get_int(cfg, "max_tokens", 0, 1 << 24, &o->max_tokens) < 0 ||
	    get_int(cfg, "max_prefill", 1, 1 << 24, &o->max_prefill) < 0)
		return -EINVAL;
	if (bd_config_get_i64(cfg, SECTION, "seed", 1, 0, INT64_MAX, &seed) < 0) {
		bd_log_err("seed = '%s': not an integer in 0..2^63-1", get_str(cfg, "seed"));
		return -EINVAL;
	}
	o->seed = (uint64_t)seed;
	if (bd_config_get_bool(cfg, SECTION, "synthetic_prefill", false, &b) < 0) {
		bd_log_err("synthetic_prefill = '%s': not a boolean", get_str(cfg, "synthetic_prefill"));
		return -EINVAL;
	}
	o->synthetic_prefill = b;
	if (bd_config_get_bool(cfg, SECTION, "cuda_graphs", true, &b) < 0) {
		bd_log_err("cuda_graphs = '%s': not a boolean", get_str(cfg, "cuda_graphs"));
		return -EINVAL;
	}
	o->cuda_graphs = b;
	o->weights = get_str(cfg, "weights");
	if (strcmp(o->weights, "bf16") && strcmp(o->weights, "f32")) {
		bd_log_err("weights = '%s': bf16 or f32", o->weights);
		return -EINVAL;
	}
	o->random_weights = get_str(cfg, "random_weights");
	if (*o->random_weights) {
		struct bd_model_hparams hp;
		if (bd_model_preset(o->random_weights, &hp) < 0) {
			bd_log_err("random_weights = '%s': no such model shape (known: qwen3-4b, "
			       "qwen3-30b-a3b-attn)", o->random_weights);
			return -EINVAL;
		}
	}
	o->calib = get_str(cfg, "calib");
	o->model = get_str(cfg, "model");
	if (!*o->model) {
		const char *env = getenv("BD_MODEL");
		o->model = env && *env ? env : DEFAULT_MODEL;
	}
	o->pool_socket = get_str(cfg, "pool_socket");
	o->router = get_str(cfg, "router");
	o->ar_dir = get_str(cfg, "allreduce_dir");
	if (!*o->router || !*o->pool_socket || !*o->ar_dir) {
		bd_log_err("router, pool_socket and allreduce_dir must not be empty");
		return -EINVAL;
	}
	return 0;
}

/* ---- the group ------------------------------------------------------------------------------ */

static void send_register(struct wd *w)
{
	Bdfp4__WorkerMessage m = BDFP4__WORKER_MESSAGE__INIT;
	Bdfp4__RegisterRequest rq = BDFP4__REGISTER_REQUEST__INIT;
	uint8_t id[128];
	size_t id_len = 0;

	rq.version = WD_PROTO_VERSION;
	rq.rank = w->o.rank;
	rq.tp = (uint32_t)w->o.tp;
	rq.pid = (int32_t)getpid();
	rq.backend = (char *)w->geo->backend;
	rq.device = w->gpu ? w->o.device : -1;
	rq.model = w->model_name;
	rq.n_vocab = (uint32_t)w->hp.n_vocab;
	rq.n_layers = (uint32_t)w->hp.n_layers;
	rq.kv_config = (char *)w->geo->kv_config;
	/* rank 0 makes the NCCL id of the next epoch; the router relays it to every rank */
	if (w->gpu && wd_gpu_register_id(w, id, &id_len) < 0) {
		w->retry_at = bd_now_ms() + 1000;
		return;
	}
	rq.nccl_unique_id.data = id;
	rq.nccl_unique_id.len = id_len;
	m.msg_case = BDFP4__WORKER_MESSAGE__MSG_REGISTER_REQUEST;
	m.register_request = &rq;
	/* stamped before the send: the I/O thread may note the drop before wd_send returns */
	w->registering = true;
	w->last_register = bd_now_ms();
	if (wd_send(w, &m) < 0)
		bd_log_err("register: send failed");
	set_status(w, "rank %d of %d: registering with %s", w->o.rank, w->o.tp, w->o.router);
}

/* Out of the group: every sequence, the all-reduce, the epoch. */
static void leave_group(struct wd *w)
{
	wd_drop_all(w);
	if (w->gpu)
		wd_gpu_leave(w);
	bd_allreduce_close(w->ar);
	w->ar = NULL;
	w->epoch = 0;
	atomic_store(&w->pub_epoch, 0);
}

static bool name_ok(const char *s)
{
	size_t n = strlen(s);
	if (n == 0 || n > 128 || s[0] == '.')
		return false;
	for (size_t i = 0; i < n; i++)
		if (!(s[i] == '-' || s[i] == '_' || s[i] == '.' || (s[i] >= '0' && s[i] <= '9') ||
		      (s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z')))
			return false;
	return true;
}

/* Returns 1 when the reply is fatal (the worker cannot serve this router). */
static int on_register_reply(struct wd *w, const Bdfp4__RegisterReply *rr)
{
	w->registering = false;
	if (rr->error != BDFP4__SERVE_ERROR__SERVE_OK) {
		bool fatal = rr->error == BDFP4__SERVE_ERROR__SERVE_ERR_VERSION ||
			     rr->error == BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT ||
			     rr->error == BDFP4__SERVE_ERROR__SERVE_ERR_UNKNOWN_KV_CONFIG ||
			     rr->error == BDFP4__SERVE_ERROR__SERVE_ERR_OVERSIZE;
		bd_log_err("the router refused the registration: %s (error %d)%s",
		       rr->message ? rr->message : "", rr->error, fatal ? "" : "; retrying");
		if (fatal)
			return 1;
		w->retry_at = bd_now_ms() + 1000;
		return 0;
	}
	leave_group(w);
	if (rr->rank != w->o.rank || rr->tp != (uint32_t)w->o.tp) {
		bd_log_err("the router answered for rank %d of %u; this is rank %d of %d", rr->rank,
		       rr->tp, w->o.rank, w->o.tp);
		return 1;
	}
	if (rr->heartbeat_ms >= 10 && rr->heartbeat_ms <= 60000)
		atomic_store(&w->heartbeat_ms, (int)rr->heartbeat_ms);
	if (w->gpu) {
		int r = wd_gpu_join(w, rr->nccl_unique_id.data, rr->nccl_unique_id.len);
		if (r == -EIO)
			return 1;
		if (r < 0) {
			w->retry_at = bd_now_ms() + 500;
			return 0;
		}
	} else if (w->o.tp > 1) {
		char path[512];
		if (!rr->allreduce_name || !name_ok(rr->allreduce_name)) {
			bd_log_err("RegisterReply: bad all-reduce name '%s'",
			       rr->allreduce_name ? rr->allreduce_name : "");
			w->retry_at = bd_now_ms() + 1000;
			return 0;
		}
		snprintf(path, sizeof(path), "%s/%s", w->o.ar_dir, rr->allreduce_name);
		int r = bd_allreduce_open(path, w->o.rank, w->o.tp, WD_AR_CAP, w->o.ar_timeout_ms,
					  &w->ar);
		if (r == 0)
			r = bd_allreduce_join(w->ar, WD_JOIN_TIMEOUT_MS);
		/* both ranks have it mapped (or gave up): the name can go */
		unlink(path);
		if (r < 0) {
			bd_log_err("all-reduce %s: %s; registering again", path, strerror(-r));
			bd_allreduce_close(w->ar);
			w->ar = NULL;
			w->retry_at = bd_now_ms() + 500;
			return 0;
		}
	}
	w->epoch = rr->epoch;
	w->owner = rr->owner;
	atomic_store(&w->pub_epoch, w->epoch);
	bd_log_info("in the group: epoch %llu, rank %d of %d", (unsigned long long)w->epoch,
		w->o.rank, w->o.tp);
	set_status(w, "rank %d of %d: serving, epoch %llu", w->o.rank, w->o.tp,
		   (unsigned long long)w->epoch);
	return 0;
}

/* One frame from the router. Returns 1 on a fatal condition. */
static int on_router_frame(struct wd *w, const void *buf, size_t len)
{
	Bdfp4__RouterMessage *m = bdfp4__router_message__unpack(NULL, len, buf);
	int fatal = 0;

	if (!m) {
		bd_log_warn("malformed frame from the router (%zu bytes): ignored", len);
		return 0;
	}
	switch (m->msg_case) {
	case BDFP4__ROUTER_MESSAGE__MSG_REGISTER_REPLY:
		fatal = on_register_reply(w, m->register_reply);
		break;
	case BDFP4__ROUTER_MESSAGE__MSG_PLAN:
		wd_run_plan(w, m->plan);
		if (w->gpu && w->epoch && wd_gpu_broken(w) && !wd_gpu_dead(w)) {
			/* NCCL cannot tell a hung peer from a slow one the way the all-reduce
			 * file locks do: registering again makes the router reset the group */
			bd_log_warn("the NCCL communicator of epoch %llu failed: registering again",
				(unsigned long long)w->epoch);
			leave_group(w);
			send_register(w);
		}
		break;
	case BDFP4__ROUTER_MESSAGE__MSG_HEARTBEAT:
		break;
	case BDFP4__ROUTER_MESSAGE__MSG_RESET:
		bd_log_info("reset of epoch %llu: %s", (unsigned long long)m->reset->epoch,
			m->reset->reason ? m->reset->reason : "");
		if (w->epoch && m->reset->epoch != w->epoch)
			break; /* of an epoch already left */
		leave_group(w);
		if (!w->registering)
			send_register(w);
		break;
	case BDFP4__ROUTER_MESSAGE__MSG_SHUTDOWN:
		bd_log_info("the router is stopping (%s): waiting for it to come back",
			m->shutdown->reason ? m->shutdown->reason : "");
		leave_group(w);
		/* the first register goes out GONE_RETRY_MS from now, when this router is gone */
		w->registering = true;
		w->last_register = bd_now_ms();
		set_status(w, "rank %d of %d: the router stopped; waiting for it", w->o.rank,
			   w->o.tp);
		break;
	default:
		bd_log_warn("router frame of no known type: ignored");
		break;
	}
	bdfp4__router_message__free_unpacked(m, NULL);
	return fatal;
}

/* ---- start, loop, stop ------------------------------------------------------------------- */

/* μ_k and τ of the calibration file, checked against the model (its file's checksum when it
 * has one) and this rank's pool shape. */
static int load_calib(struct wd *w)
{
	char err[BD_CALIB_ERR_MAX];
	uint8_t sha[BD_SHA256_BYTES];
	struct bd_calib_expect want = { .n_layers = w->hp.n_layers,
					.n_kv_heads = w->hp.n_kv_heads,
					.head_dim = w->hp.head_dim };
	int r;

	w->dp = bd_decode_params_default();
	if (!*w->o.calib)
		return 0;
	if (!*w->o.random_weights) {
		if ((r = bd_sha256_file(w->o.model, sha)) < 0) {
			bd_log_err("cannot checksum %s: %s", w->o.model, strerror(-r));
			return r;
		}
		want.model_sha256 = sha;
	}
	if ((r = bd_calib_load(w->o.calib, &want, &w->calib, err)) < 0) {
		bd_log_err("calibration %s: %s", w->o.calib, err);
		return r;
	}
	w->dp.tau = w->calib->tau;
	w->dp.c = w->calib->c;
	bd_log_info("calibration %s: context %d, tau %.6g", w->o.calib, w->calib->n_ctx,
		(double)w->calib->tau);
	return 0;
}

static int setup(struct wd *w)
{
	char err[BD_MODEL_ERR_MAX], perr[256];
	int r;

	openblas_set_num_threads(w->o.threads);
	int64_t t0 = bd_now_ms();
	if (*w->o.random_weights) {
		/* the shape only; the weights are made on the device (cuda backend) */
		bd_model_preset(w->o.random_weights, &w->hp);
		snprintf(w->model_name, sizeof(w->model_name), "%s", w->o.random_weights);
	} else {
		r = bd_model_load_shard(w->o.model, w->o.rank, w->o.tp, &w->model, err);
		if (r < 0) {
			bd_log_err("model: %s", err);
			return r;
		}
		w->hp = w->model->hp;
		char tmp[sizeof(w->model_name)];
		snprintf(tmp, sizeof(tmp), "%s", w->o.model);
		snprintf(w->model_name, sizeof(w->model_name), "%s", basename(tmp));
		const struct bd_model_shard *sh = &w->model->shard;
		bd_log_info("shard of %s loaded in %lld ms: KV heads %d..%d, query heads %d..%d, MLP "
			"columns %d..%d%s", w->model_name, (long long)(bd_now_ms() - t0),
			sh->kv_head0, sh->kv_head0 + sh->n_kv_heads - 1, sh->head0,
			sh->head0 + sh->n_heads - 1, sh->ff0, sh->ff0 + sh->n_ff - 1,
			sh->lm_head ? ", LM head" : "");
	}
	if ((r = load_calib(w)) < 0)
		return r;

	r = bd_pool_attach(w->o.pool_socket, w->o.rank, perr, sizeof(perr), &w->pool);
	if (r < 0) {
		bd_log_err("kvpoold at %s: %s", w->o.pool_socket, perr);
		return r;
	}
	w->geo = bd_pool_attach_geometry(w->pool);
	const struct bd_layout *lay = &w->geo->layout;
	struct bd_model_shard sh;
	w->pool_cfg = bd_kvcfg_find(w->geo->kv_config);
	if ((r = bd_model_shard_plan(&w->hp, w->o.rank, w->o.tp, &sh)) < 0) {
		bd_log_err("%s cannot be split over tp = %d", w->model_name, w->o.tp);
		return r;
	}
	if (!w->pool_cfg || w->geo->tp != w->o.tp || lay->n_layers != w->hp.n_layers ||
	    lay->d != w->hp.head_dim || lay->d_rope != 0 || lay->n_kv_heads < sh.n_kv_heads) {
		bd_log_err("the pool (%s, tp %d, %d layers, %d KV heads of %d per rank) cannot hold "
		       "this shard (tp %d, %d layers, %d KV heads of %d)", w->geo->kv_config,
		       w->geo->tp, lay->n_layers, lay->n_kv_heads, lay->d, w->o.tp,
		       w->hp.n_layers, sh.n_kv_heads, w->hp.head_dim);
		return -EINVAL;
	}
	if (!strcmp(w->geo->backend, "cuda")) {
		if ((r = wd_gpu_setup(w)) < 0)
			return r;
	} else if (!strcmp(w->geo->backend, "cpu")) {
		if (*w->o.random_weights || w->o.synthetic_prefill) {
			bd_log_err("%s needs a pool of the cuda backend; this pool's is cpu",
			       *w->o.random_weights ? "random_weights" : "synthetic_prefill");
			return -ENOTSUP;
		}
		if ((r = bd_kvmem_pool_new(w->pool, &w->mem)) < 0) {
			bd_log_err("pool arena: %s", strerror(-r));
			return r;
		}
	} else {
		bd_log_err("the pool's backend is '%s': workerd runs cpu and cuda", w->geo->backend);
		return -ENOTSUP;
	}
	bd_log_info("attached to kvpoold: %s backend, %s, %zu pages, %zu slots", w->geo->backend,
		w->geo->kv_config, w->geo->n_pages, w->geo->n_slots);
	if (w->o.rank == 0 && !w->gpu &&
	    !(w->logits = malloc(sizeof(float) * (size_t)w->hp.n_vocab)))
		return -ENOMEM;

	w->zctx = zmq_ctx_new();
	if (!w->zctx)
		return -ENOMEM;
	w->pair = zmq_socket(w->zctx, ZMQ_PAIR);
	snprintf(w->io_endpoint, sizeof(w->io_endpoint), WD_IO_ENDPOINT_FMT, (void *)w);
	int linger = 0;
	zmq_setsockopt(w->pair, ZMQ_LINGER, &linger, sizeof(linger));
	if (!w->pair || zmq_bind(w->pair, w->io_endpoint) < 0)
		return -EIO;
	atomic_store(&w->heartbeat_ms, WD_DEFAULT_HEARTBEAT_MS);
	atomic_store(&w->last_router_ms, bd_now_ms());
	if ((r = wd_io_start(w)) < 0)
		return r;
	return 0;
}

static void teardown(struct wd *w)
{
	leave_group(w);
	wd_io_stop(w);
	if (w->pair)
		zmq_close(w->pair);
	if (w->zctx)
		zmq_ctx_term(w->zctx);
	wd_gpu_teardown(w);
	bd_kvmem_ext_free(w->mem);
	bd_pool_detach(w->pool);
	bd_model_free(w->model);
	bd_calib_free(w->calib);
	free(w->logits);
	if (w->sig_fd >= 0)
		close(w->sig_fd);
}

/* Returns the exit status. */
static int run(struct wd *w)
{
	send_register(w);
	while (!w->stop) {
		zmq_pollitem_t it[3] = {
			{ w->pair, 0, ZMQ_POLLIN, 0 },
			{ NULL, w->sig_fd, ZMQ_POLLIN, 0 },
			{ NULL, bd_pool_attach_fd(w->pool), ZMQ_POLLIN, 0 },
		};
		if (zmq_poll(it, 3, 200) < 0 && zmq_errno() != EINTR) {
			bd_log_err("poll: %s", zmq_strerror(zmq_errno()));
			return 1;
		}
		if (it[1].revents & ZMQ_POLLIN) {
			unsigned char signo;
			if (read(w->sig_fd, &signo, 1) == 1) {
				if (signo == SIGUSR1) {
					/* the benchmark's cue: timing of the steps since the last */
					wd_gpu_report(w);
					continue;
				}
				bd_log_info("signal %u: stopping", signo);
				return 0;
			}
		}
		if (it[2].revents & ZMQ_POLLIN) {
			bd_log_err("kvpoold closed the attach socket (it stopped): exiting");
			return 1;
		}
		for (int budget = 0; (it[0].revents & ZMQ_POLLIN) && budget < 64; budget++) {
			zmq_msg_t msg;
			zmq_msg_init(&msg);
			if (zmq_msg_recv(&msg, w->pair, ZMQ_DONTWAIT) < 0) {
				zmq_msg_close(&msg);
				break;
			}
			int fatal = on_router_frame(w, zmq_msg_data(&msg), zmq_msg_size(&msg));
			zmq_msg_close(&msg);
			if (fatal)
				return 1;
			if (w->gpu && wd_gpu_dead(w)) {
				bd_log_err("the GPU model failed: exiting (to be restarted)");
				return 1;
			}
			/* a signal waits at most one frame */
			struct pollfd pfd = { .fd = w->sig_fd, .events = POLLIN };
			if (poll(&pfd, 1, 0) > 0)
				break;
		}
		int64_t now = bd_now_ms();
		if (w->retry_at && now >= w->retry_at) {
			w->retry_at = 0;
			send_register(w);
		}
		/* A register dropped for want of a connection (ZMQ_IMMEDIATE) is sent again soon;
		 * one that went out is never repeated while the router is heard, as a repeat
		 * arriving after the group formed would break it. */
		int64_t heard = atomic_load(&w->last_router_ms);
		if (w->registering && atomic_load(&w->last_drop_ms) >= w->last_register &&
		    now - w->last_register >= REGISTER_RETRY_MS) {
			send_register(w);
			continue;
		}
		/* A router that got the register heartbeats this worker every heartbeat_ms; none
		 * for a second means it did not (after a Shutdown it may have gone to the stopping
		 * router): send it again. */
		if (w->registering && heard < w->last_register &&
		    now - w->last_register >= GONE_RETRY_MS) {
			send_register(w);
			continue;
		}
		/* the router went quiet: it restarted or stopped; start over with it */
		int64_t quiet = now - heard;
		if (quiet > ROUTER_SILENCE_MS && now - w->last_register > ROUTER_SILENCE_MS) {
			if (w->epoch)
				bd_log_warn("nothing from the router for %lld ms: leaving epoch %llu",
					(long long)quiet, (unsigned long long)w->epoch);
			leave_group(w);
			send_register(w);
		}
	}
	return 0;
}

int main(int argc, char **argv)
{
	struct wd w = { .sig_fd = -1 };
	struct bd_config *cfg = bd_config_new();
	struct sigaction sa = { .sa_handler = on_signal };
	int e, status = 1, pfd[2];

	bd_log_init("workerd");
	setvbuf(stderr, NULL, _IOLBF, 0);
	signal(SIGPIPE, SIG_IGN);
	/* no controlling terminal to lose: a stray SIGHUP must not stop a rank mid-step */
	signal(SIGHUP, SIG_IGN);
	bd_ipc_raise_nofile();
	if (pipe2(pfd, O_CLOEXEC | O_NONBLOCK) < 0) {
		fprintf(stderr, "workerd: pipe: %s\n", strerror(errno));
		return 1;
	}
	w.sig_fd = pfd[0];
	sig_pipe_w = pfd[1];
	sigemptyset(&sa.sa_mask);
	sa.sa_flags = SA_RESTART;
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
	sigaction(SIGUSR1, &sa, NULL);
	if (!cfg) {
		fprintf(stderr, "workerd: out of memory\n");
		return 1;
	}
	e = parse_args(cfg, argc, argv);
	if (e == 0)
		e = read_opts(cfg, &w.o);
	if (e != 0) {
		bd_config_free(cfg);
		return e > 0 ? 0 : 2;
	}
	{
		char ident[32];

		snprintf(ident, sizeof(ident), "workerd[%d]", w.o.rank);
		bd_log_init(ident);
	}
	if (sd_watchdog_enabled(0, &w.watchdog_usec) <= 0)
		w.watchdog_usec = 0;
	if (setup(&w) < 0)
		goto out;
	snprintf(w.status, sizeof(w.status), "rank %d of %d: registering with %s", w.o.rank,
		 w.o.tp, w.o.router);
	sd_notifyf(0, "READY=1\nSTATUS=%s", w.status);
	bd_log_info("ready: rank %d of %d, router %s", w.o.rank, w.o.tp, w.o.router);
	status = run(&w);
	sd_notify(0, "STOPPING=1");
	wd_gpu_report(&w);
out:
	teardown(&w);
	bd_config_free(cfg);
	return status;
}
