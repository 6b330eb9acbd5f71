/* main.c — workerd: one tensor-parallel rank of the model (DESIGN.md).
 *
 * Loads its shard of the GGUF model, attaches to kvpoold's arena of its rank, chooses the
 * backend of the pool (cpu.c: the shard on the host, the ranks joined by the shared-memory
 * all-reduce; gpu.c: the shard on the rank's GPU, joined by NCCL), registers with the router
 * and executes the step plans of its group (step.c). Configuration: the [worker] section of
 * the INI file, every key also a flag (bd_daemon.h). One event loop on the compute thread
 * (router frames from the I/O thread, signals, the pool's attach socket, a 200 ms tick);
 * sd_notify READY/STATUS, the watchdog from the I/O thread. SIGTERM or SIGINT: exit 0;
 * SIGUSR1: the backend's timing report. Fatal errors: exit 1; bad flags: 2.
 */
#include <errno.h>
#include <libgen.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cblas.h>
#include <zmq.h>

#include "base/bd_config.h"
#include "base/bd_tpool.h"
#include "base/bd_zsec.h"
#include "model/bd_model_preset.h"
#include "serve/bd_allreduce.h"
#include "serve/bd_wire.h"
#include "workerd.h"

#define SECTION "worker"
/* how long a worker waits for a stopped kvpoold to come back, and its retry period */
#define POOL_REATTACH_MS 30000
#define POOL_REATTACH_RETRY_MS 50
#define ABOUT "One tensor-parallel rank: its model shard, kvpoold's arena, the router's plans."
#define DEFAULT_MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define DEFAULT_ROUTER "ipc:///run/bdfp4/router-workers.sock"
/* No frame from the router this long: it is gone without a Shutdown; register again. Long: a
 * router blocked on kvpoold is slow, not gone, and a restarted router resets workers that
 * heartbeat an epoch it does not know. */
#define ROUTER_SILENCE_MS 30000
#define GONE_RETRY_MS 1000 /* a register no frame followed: send it again */
#define REGISTER_RETRY_MS 200  /* a register dropped (no connection): send it again */

#define OPT(t, field, lo, hi) BD_CONFIG_FIELD(t, struct wd_opts, field, lo, hi)
#define TEXT(field) BD_CONFIG_TEXT(struct wd_opts, field)
static const struct bd_config_key keys[] = {
	{ "rank", "0", "tensor-parallel rank of this worker (0..tp-1)" },
	{ "tp", "2", "tensor-parallel ranks", OPT(INT, tp, 1, BD_ALLREDUCE_MAX_TP) },
	{ "model", "", "GGUF model (default: $BD_MODEL, else " DEFAULT_MODEL ")", TEXT(model) },
	{ "pool_socket", BD_POOL_DEFAULT_SOCKET, "kvpoold attach socket", TEXT(pool_socket) },
	{ "router", DEFAULT_ROUTER, "the router's worker endpoint (ZeroMQ)", TEXT(router) },
	{ "router_server_key", "",
	  "the router's CURVE public key file: with curve_secret_key, the router connection "
	  "speaks CURVE (the router's curve_workers must list this worker's public key)",
	  TEXT(router_server_key) },
	{ "curve_secret_key", "", "this worker's CURVE secret key file (bdfp4 keygen; mode 0600)",
	  TEXT(curve_secret_key) },
	{ "insecure_tcp", "false",
	  "allow a plain (unauthenticated, unencrypted) TCP router endpoint off loopback", true,
	  OPT(BOOL, insecure_tcp, 0, 1) },
	{ "allreduce_dir", "",
	  "private directory of the shared-memory all-reduce files (not world-writable; made 0700 "
	  "when missing); empty: $RUNTIME_DIRECTORY (the unit's RuntimeDirectory=), else "
	  "$XDG_RUNTIME_DIR/bdfp4, else /run/bdfp4 for root or /tmp/bdfp4-<uid>", TEXT(ar_dir) },
	{ "threads", "1",
	  "CPU threads of the model: OpenBLAS's and those of the block products and attention",
	  OPT(INT, threads, 1, BD_TPOOL_MAX_THREADS) },
	{ "allreduce_timeout_ms", "30000", "longest wait for the other rank in a step",
	  OPT(INT, ar_timeout_ms, 100, 3600000) },
	{ "verbose", "0", "log every step", OPT(INT, verbose, 0, 1) },
	{ "batch_invariant", "0",
	  "decode each row in an order that does not depend on the batch, so a greedy request "
	  "yields the same tokens alone or in any batch (cpu backend; costs throughput)", true,
	  OPT(BOOL, batch_invariant, 0, 1) },
	{ "calib", "", "calibration file of the model (mu_k, tau; bdfp4 calibrate); empty: none",
	  TEXT(calib) },
	/* the cuda backend (chosen by the pool) */
	{ "device", "-1", "cuda: CUDA device of this rank (-1: the pool's device of the rank)",
	  OPT(INT, device, -1, 1023) },
	{ "weights", "bf16", "cuda: weight precision, bf16 or f32", TEXT(weights) },
	{ "random_weights", "",
	  "cuda: no checkpoint, seeded random weights of this shape (qwen3-4b, qwen3-30b-a3b-attn)",
	  TEXT(random_weights) },
	{ "seed", "1", "cuda: seed of the random weights", OPT(INT, seed, 0, INT64_MAX) },
	{ "synthetic_prefill", "0",
	  "cuda: fill prompts with synthetic KV and decode only their last token", true,
	  OPT(BOOL, synthetic_prefill, 0, 1) },
	{ "max_batch", "64", "cuda: decode rows per model call (at least the router's max_batch)",
	  OPT(INT, max_batch, 1, 1024) },
	{ "max_tokens", "0", "cuda: longest sequence, tokens (0: the pool's max_seq_len)",
	  OPT(INT, max_tokens, 0, 1 << 24) },
	{ "max_prefill", "8192", "cuda: longest prompt one real prefill takes, tokens",
	  OPT(INT, max_prefill, 1, 1 << 24) },
	{ "cuda_graphs", "1", "cuda: replay decode steps from CUDA graphs", true,
	  OPT(BOOL, cuda_graphs, 0, 1) },
	{ "decode_kernel", "auto",
	  "cuda: decode kernels: auto (the GPU's native FP4 family once its start-up self-check "
	  "against the portable one passes, else portable), native, portable" },
	{ NULL, NULL, NULL, false },
};
#undef OPT
#undef TEXT

/* ---- configuration ------------------------------------------------------------------------- */

/* The all-reduce directory: the configured one, or the first of the environment's (the unit's
 * RuntimeDirectory, the user's runtime directory, /run/bdfp4 or /tmp/bdfp4-<uid>); made 0700
 * when missing, and refused when anyone may write in it (bd_allreduce_dir_check). */
static int ar_dir_choose(struct wd_opts *o)
{
	const char *env = getenv("RUNTIME_DIRECTORY"), *xdg = getenv("XDG_RUNTIME_DIR");
	char probe[sizeof(o->ar_dir_buf) + 8];
	int n, r;

	if (*o->ar_dir)
		n = snprintf(o->ar_dir_buf, sizeof(o->ar_dir_buf), "%s", o->ar_dir);
	else if (env && *env) /* systemd lists several directories with ':' */
		n = snprintf(o->ar_dir_buf, sizeof(o->ar_dir_buf), "%.*s",
			     (int)strcspn(env, ":"), env);
	else if (xdg && *xdg)
		n = snprintf(o->ar_dir_buf, sizeof(o->ar_dir_buf), "%s/bdfp4", xdg);
	else if (geteuid() == 0)
		n = snprintf(o->ar_dir_buf, sizeof(o->ar_dir_buf), "/run/bdfp4");
	else
		n = snprintf(o->ar_dir_buf, sizeof(o->ar_dir_buf), "/tmp/bdfp4-%u",
			     (unsigned)geteuid());
	if (n < 0 || (size_t)n >= sizeof(o->ar_dir_buf)) {
		bd_log_err("allreduce_dir: the path is too long");
		return -EINVAL;
	}
	o->ar_dir = o->ar_dir_buf;
	if (mkdir(o->ar_dir, 0700) < 0 && errno != EEXIST) {
		bd_log_err("allreduce_dir %s: %s", o->ar_dir, strerror(errno));
		return -errno;
	}
	snprintf(probe, sizeof(probe), "%s/x", o->ar_dir);
	r = bd_allreduce_dir_check(probe);
	if (r < 0) {
		bd_log_err("allreduce_dir %s: %s", o->ar_dir,
			   r == -EPERM ? "world-writable or another user's: the all-reduce file "
					 "needs a private directory (set allreduce_dir)"
				       : strerror(-r));
		return r == -EPERM ? -EINVAL : r;
	}
	return 0;
}

static int read_opts(struct wd *w)
{
	const struct bd_daemon *d = &w->d;
	struct wd_opts *o = &w->o;

	if (bd_daemon_read_opts(d, o) < 0 ||
	    bd_daemon_get_int(d, "rank", 0, o->tp - 1, &o->rank) < 0)
		return -EINVAL;
	if (strcmp(o->weights, "bf16") && strcmp(o->weights, "f32")) {
		bd_log_err("weights = '%s': bf16 or f32", o->weights);
		return -EINVAL;
	}
	if (*o->random_weights) {
		struct bd_model_hparams hp;
		if (bd_model_preset(o->random_weights, &hp) < 0) {
			bd_log_err("random_weights = '%s': no such model shape (known: qwen3-4b, "
			       "qwen3-30b-a3b-attn)", o->random_weights);
			return -EINVAL;
		}
	}
	if (bd_kfamily_mode_parse(bd_daemon_get_str(d, "decode_kernel"), &o->decode_kernel) < 0) {
		bd_log_err("decode_kernel = '%s': auto, native or portable",
			   bd_daemon_get_str(d, "decode_kernel"));
		return -EINVAL;
	}
	if (!*o->model) {
		const char *env = getenv("BD_MODEL");
		o->model = env && *env ? env : DEFAULT_MODEL;
	}
	if (!*o->router || !*o->pool_socket) {
		bd_log_err("router and pool_socket must not be empty");
		return -EINVAL;
	}
	{
		char err[512];

		if (bd_zsec_endpoint_check(o->router, "router", *o->router_server_key &&
					   *o->curve_secret_key, o->insecure_tcp, err, sizeof(err)) < 0) {
			bd_log_err("%s", err);
			return -EPERM;
		}
	}
	return ar_dir_choose(o);
}

/* ---- the group ------------------------------------------------------------------------------ */

static void send_register(struct wd *w)
{
	Bdfp4__WorkerMessage m = BDFP4__WORKER_MESSAGE__INIT;
	Bdfp4__RegisterRequest rq = BDFP4__REGISTER_REQUEST__INIT;
	uint8_t id[WD_NCCL_ID_MAX];

	rq.version = WD_PROTO_VERSION;
	rq.rank = w->o.rank;
	rq.tp = (uint32_t)w->o.tp;
	rq.pid = (int32_t)getpid();
	rq.backend = (char *)w->geo->backend;
	rq.model = w->model_name;
	rq.n_vocab = (uint32_t)w->hp.n_vocab;
	rq.n_layers = (uint32_t)w->hp.n_layers;
	rq.kv_config = (char *)w->geo->kv_config;
	if (w->calib)
		rq.calib_sha256 = (ProtobufCBinaryData){ sizeof(w->calib_sha), w->calib_sha };
	/* the device; rank 0 of the cuda backend makes the NCCL id of the next epoch, which the
	 * router relays to every rank */
	if (w->be->register_fill(w, &rq, id) < 0) {
		w->retry_at = bd_now_ms() + 1000;
		return;
	}
	m.msg_case = BDFP4__WORKER_MESSAGE__MSG_REGISTER_REQUEST;
	m.register_request = &rq;
	/* stamped before the send: the I/O thread may note the drop before wd_send returns */
	w->registering = true;
	w->last_register = bd_now_ms();
	if (wd_send(w, &m) < 0)
		bd_log_err("register: send failed");
	bd_daemon_status(&w->d, "rank %d of %d: registering with %s", w->o.rank, w->o.tp,
			 w->o.router);
}

/* Out of the group: every request, the collective, the epoch. */
static void leave_group(struct wd *w)
{
	w->be->leave(w);
	w->epoch = 0;
	atomic_store(&w->pub_epoch, 0);
}

/* The first attach, with the token of the first RegisterReply, and the backend's memory over
 * it. Returns 0; -1 when the attach was refused or failed (logged: the worker registers again
 * in a second, which gives the group a new epoch and new tokens); 1 when it is fatal (another
 * pool than the one queried, or the memory cannot be mapped). */
static int pool_attach(struct wd *w)
{
	char perr[256];
	int r = bd_pool_attach(w->o.pool_socket, w->o.rank, w->attach_token, perr, sizeof(perr),
			       &w->pool);

	if (r < 0) {
		bd_log_err("attaching to kvpoold at %s: %s; registering again", w->o.pool_socket,
			   perr);
		w->pool = NULL;
		w->retry_at = bd_now_ms() + 1000;
		return -1;
	}
	if (!bd_pool_geometry_same(bd_pool_attach_geometry(w->pool), &w->pool_geo)) {
		bd_log_err("kvpoold at %s has other arenas than it had at start: exiting (to be "
			   "restarted on them)", w->o.pool_socket);
		return 1;
	}
	if (w->be->map(w) < 0)
		return 1;
	bd_log_info("attached to kvpoold: rank %d's arena, %zu bytes", w->o.rank,
		    w->geo->arena_bytes);
	return 0;
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
	if (rr->attach_token.len != BD_POOL_TOKEN_BYTES) {
		bd_log_err("RegisterReply: an attach token of %zu bytes (want %d); registering "
			   "again", rr->attach_token.len, BD_POOL_TOKEN_BYTES);
		w->retry_at = bd_now_ms() + 1000;
		return 0;
	}
	memcpy(w->attach_token, rr->attach_token.data, BD_POOL_TOKEN_BYTES);
	if (!w->pool) {
		int a = pool_attach(w);

		if (a)
			return a > 0 ? 1 : 0;
	}
	int r = w->be->join(w, rr);
	if (r < 0) {
		if (w->be->health(w) == WD_DEAD)
			return 1;
		/* a reply that cannot be used waits like a refused registration */
		w->retry_at = bd_now_ms() + (r == -EBADMSG ? 1000 : 500);
		return 0;
	}
	w->epoch = rr->epoch;
	w->owner = rr->owner;
	atomic_store(&w->pub_epoch, w->epoch);
	bd_log_info("in the group: epoch %llu, rank %d of %d", (unsigned long long)w->epoch,
		w->o.rank, w->o.tp);
	bd_daemon_status(&w->d, "rank %d of %d: serving, epoch %llu", w->o.rank, w->o.tp,
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
		if (w->epoch && w->be->health(w) == WD_REJOIN) {
			bd_log_warn("the %s of epoch %llu failed: registering again",
				    w->be->collective, (unsigned long long)w->epoch);
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
		bd_daemon_status(&w->d, "rank %d of %d: the router stopped; waiting for it",
				 w->o.rank, w->o.tp);
		break;
	default:
		bd_log_warn("router frame of no known type: ignored");
		break;
	}
	bdfp4__router_message__free_unpacked(m, NULL);
	return fatal;
}

/* ---- start, loop, stop ------------------------------------------------------------------- */

/* The backends this workerd was built with; the cuda one only where nvcc was. */
static const struct wd_backend *const backends[] = {
	&wd_backend_cpu,
#ifdef BD_WORKERD_CUDA
	&wd_backend_cuda,
#endif
};

/* The backend called name (the pool's), or NULL (logged). */
static const struct wd_backend *find_backend(const char *name)
{
	for (size_t i = 0; i < sizeof(backends) / sizeof(backends[0]); i++)
		if (!strcmp(backends[i]->name, name))
			return backends[i];
	if (!strcmp(name, "cuda"))
		bd_log_err("the pool's backend is cuda, but this workerd was built without CUDA "
			   "support (no nvcc at build time, or a SAN=1 build): rebuild on a machine "
			   "with the CUDA toolkit, or run kvpoold --backend cpu");
	else
		bd_log_err("the pool's backend is '%s': workerd runs cpu and cuda", name);
	return NULL;
}

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
	if ((r = bd_sha256_file(w->o.calib, w->calib_sha)) < 0) {
		bd_log_err("cannot checksum %s: %s", w->o.calib, strerror(-r));
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
		if ((r = bd_model_set_threads(w->model, w->o.threads)) < 0) {
			bd_log_err("model: cannot start %d threads: %s", w->o.threads, strerror(-r));
			return r;
		}
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

	/* the geometry only: the attachment needs the token the router's RegisterReply brings */
	r = bd_pool_query(w->o.pool_socket, w->o.rank, perr, sizeof(perr), &w->pool_geo);
	if (r < 0) {
		bd_log_err("kvpoold at %s: %s", w->o.pool_socket, perr);
		return r;
	}
	w->geo = &w->pool_geo;
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
	if (!(w->be = find_backend(w->geo->backend)))
		return -ENOTSUP;
	if (w->o.batch_invariant && !w->be->batch_invariant) {
		bd_log_err("batch_invariant = 1: the %s backend cannot decode batch-invariantly (its "
			   "products and decode kernels choose their reduction order by the batch); "
			   "set batch_invariant = 0 or run kvpoold --backend cpu",
			   w->be->name);
		return -ENOTSUP;
	}
	if ((r = w->be->setup(w)) < 0)
		return r;
	bd_log_info("kvpoold's pool: %s backend, %s, %zu pages, %zu slots", w->geo->backend,
		w->geo->kv_config, w->geo->n_pages, w->geo->n_slots);

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
	if (w->be)
		leave_group(w);
	wd_io_stop(w);
	bd_wire_close(&w->pair);
	bd_wire_ctx_term(&w->zctx);
	if (w->be)
		w->be->teardown(w);
	bd_pool_detach(w->pool);
	bd_model_free(w->model);
	bd_calib_free(w->calib);
}

/* The signals pending. Returns 1 when one asks to stop. */
static int on_signals(struct wd *w)
{
	int signo;

	while ((signo = bd_daemon_signal(&w->d)) > 0) {
		if (signo == SIGUSR1) {
			/* the benchmark's cue: timing of the steps since the last */
			w->be->report(w);
			continue;
		}
		bd_log_info("signal %d: stopping", signo);
		return 1;
	}
	return 0;
}

/* kvpoold stopped at lost_ms (its attach socket read EOF): the mapping stays valid while the
 * memory lives, and a kvpoold restarted on its stored arenas hands out the same memory, so the
 * worker attaches again and keeps serving meanwhile. Returns 0 when attached again or still
 * trying, -1 when it must exit (other arenas: its pages are gone; or no kvpoold in time). */
static int pool_reattach(struct wd *w, int64_t lost_ms, int64_t now)
{
	char perr[256];
	int r = bd_pool_reattach(w->pool, w->o.pool_socket, w->attach_token, perr, sizeof(perr));

	if (r == 0) {
		bd_log_info("attached again to kvpoold after %lld ms: the same arenas, the mapping "
			    "kept", (long long)(now - lost_ms));
		return 0;
	}
	if (r == -ESTALE) {
		bd_log_err("kvpoold at %s: %s: exiting (to be restarted on the new arenas)",
			   w->o.pool_socket, perr);
		return -1;
	}
	if (now - lost_ms >= POOL_REATTACH_MS) {
		bd_log_err("kvpoold at %s did not come back in %d ms (%s): exiting",
			   w->o.pool_socket, POOL_REATTACH_MS, perr);
		return -1;
	}
	return 1;
}

/* Returns the exit status. */
static int run(struct wd *w)
{
	int64_t pool_lost = 0, pool_retry = 0; /* ms: kvpoold stopped, the next reattach */

	send_register(w);
	for (;;) {
		zmq_pollitem_t it[3] = {
			{ w->pair, 0, ZMQ_POLLIN, 0 },
			{ NULL, w->d.signal_fd, ZMQ_POLLIN, 0 },
			{ NULL, bd_pool_attach_fd(w->pool), pool_lost || !w->pool ? 0 : ZMQ_POLLIN,
			  0 },
		};
		/* no attach socket before the first RegisterReply's token attached the pool */
		if (zmq_poll(it, w->pool ? 3 : 2, pool_lost ? POOL_REATTACH_RETRY_MS : 200) < 0 &&
		    zmq_errno() != EINTR) {
			bd_log_err("poll: %s", zmq_strerror(zmq_errno()));
			return 1;
		}
		if ((it[1].revents & ZMQ_POLLIN) && on_signals(w))
			return 0;
		if (it[2].revents & ZMQ_POLLIN) {
			bd_log_warn("kvpoold closed the attach socket (it stopped): attaching again "
				    "when it is back (up to %d ms)", POOL_REATTACH_MS);
			pool_lost = pool_retry = bd_now_ms();
		}
		if (pool_lost && bd_now_ms() >= pool_retry) {
			int r = pool_reattach(w, pool_lost, bd_now_ms());

			if (r < 0)
				return 1;
			pool_lost = r ? pool_lost : 0;
			pool_retry = bd_now_ms() + POOL_REATTACH_RETRY_MS;
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
			if (w->be->health(w) == WD_DEAD) {
				bd_log_err("the %s backend failed: exiting (to be restarted)",
					   w->be->name);
				return 1;
			}
			/* a signal waits at most one frame */
			struct pollfd pfd = { .fd = w->d.signal_fd, .events = POLLIN };
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
}

int main(int argc, char **argv)
{
	struct wd w = { .d = { .name = "workerd", .about = ABOUT, .section = SECTION,
			       .keys = keys } };
	int e = bd_daemon_start(&w.d, argc, argv), status = 1;

	if (e == 0)
		e = read_opts(&w);
	if (e != 0) {
		bd_daemon_end(&w.d);
		/* --help: 0; a bad flag, file or value: 2; anything else (no memory): 1 */
		return e > 0 ? 0 : e == -EINVAL ? 2 : 1;
	}
	{
		char ident[32];

		snprintf(ident, sizeof(ident), "workerd[%d]", w.o.rank);
		bd_log_init(ident);
	}
	bd_log_set_debug(w.o.verbose);
	if (setup(&w) == 0) {
		bd_daemon_ready(&w.d);
		bd_daemon_status(&w.d, "rank %d of %d: registering with %s", w.o.rank, w.o.tp,
				 w.o.router);
		bd_log_info("ready: rank %d of %d, router %s", w.o.rank, w.o.tp, w.o.router);
		status = run(&w);
		bd_daemon_stopping(&w.d);
		w.be->report(&w);
	}
	teardown(&w);
	bd_daemon_end(&w.d);
	return status;
}
