/* gpu.c — workerd's cuda backend: kvpoold's VMM arena imported on the rank's GPU,
 * the model there (bd_gmodel.h), NCCL between the ranks, and the step plans run as gmodel
 * calls.
 *
 * The worker allocates no KV of its own: pages and slots are the pool's arena
 * (bd_pool_cuda_map). The model is stateless per request; growmap.c checks each row against
 * the small record every rank keeps and turns it into a bd_grow. Prefill rows (a prompt's first
 * chunk, a later chunk at a page-aligned position, or one that resumes a request) run one by
 * one (or, with synthetic_prefill, as a synthetic fill plus a decode of the last prompt token:
 * then the worker registers with whole_prompts and the router sends no chunk), all decode rows
 * of a step in one bd_gmodel_decode call (max_batch at a time). A row marked resume rebuilds
 * the request's record from the row (slot, block table, position, draws) over the KV the pool
 * kept, so a restarted worker continues the requests of the group that failed.
 *
 * NCCL (tp > 1): rank 0 makes a unique id for every registration, the router relays it in the
 * RegisterReply, each rank joins with a non-blocking ncclCommInitRankConfig polled with a
 * deadline. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 unless the user set it). A dead peer
 * shows as -EPIPE or -ETIMEDOUT from the model: the communicator is aborted and the rank
 * registers again, which makes the router reset the group (a new epoch, a new communicator
 * handed to the model with bd_gmodel_set_comm). With tp > 1 the model is built when the first
 * communicator exists; with tp = 1 at start, and NCCL is never called.
 *
 * Compiled only where nvcc is (the Makefile's HAVE_NVCC), where main.c lists wd_backend_cuda
 * among its backends; a workerd built without it refuses a pool of the cuda backend at start.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime.h>
#include <nccl.h>

#include "cuda/bd_decode_select.h"
#include "cuda/bd_gmodel.h"
#include "cuda/bd_pool_cuda.h"
#include "growmap.h"
#include "workerd.h"

#define NCCL_JOIN_TIMEOUT_MS 60000

struct wd_gpu {
	void *base;              /* the arena, mapped */
	struct bd_gmodel *g;     /* NULL until built (tp > 1: at the first join) */
	ncclComm_t comm;
	bool broken;             /* the communicator of this epoch failed */
	bool dead;               /* the model failed for good */
	struct bd_model_hparams hp; /* what the model is built from (random weights: n_ctx raised) */
	struct bd_model_shard shard;
	int max_tokens, max_prefill;
	struct wd_gtab gtab;     /* the requests this rank serves */
	struct bd_kfamily_choice decode; /* the decode kernel family and why */
	char decode_info[256];   /* what RegisterRequest.decode_kernel says */

	/* step buffers */
	struct wd_gitem *items;
	int *mapped;             /* [cap] 1: items[i] holds a mapped row */
	int *dec;                /* [cap] the plan rows of the decode batch */
	size_t cap;
	struct bd_grow *rows;    /* [max_batch] */
	int32_t *toks, *out_tok, *top_ids;
	int *status;
	float *top_logits;
	bool *want_lp;           /* [max_batch] the call's rows that report log-probabilities */
	float *lp;               /* [max_batch] their sampled tokens' */
	int32_t *lp_ids;         /* [max_batch][WD_LOGPROBS_MAX] */
	float *lp_vals;          /* [max_batch][WD_LOGPROBS_MAX] */

	/* decode-step timing since the last report; a step is one bd_gmodel_decode call */
	double *ul, *dev;        /* upload + launch, device: µs per step */
	double *host;            /* the call's host wall time (entry to return), µs */
	size_t n_t, cap_t;
	size_t graph_steps;
	double rows_sum, upload_sum, launch_sum, host_sum;
	/* plans since the last report: wall time from wd_run_plan's entry to the StepResult sent */
	double *plan;            /* µs per plan */
	size_t n_p, cap_p;
	double plan_sum;
	size_t plan_rows, plan_dec_rows;
	int last_nd;             /* decode rows of the plan being run */
};

static struct wd_gpu *gpu(const struct wd *w)
{
	return w->be_state;
}

static int cuda_errno(cudaError_t e)
{
	switch (e) {
	case cudaSuccess:
		return 0;
	case cudaErrorInvalidDevice:
	case cudaErrorNoDevice:
	case cudaErrorInsufficientDriver:
		return -ENODEV;
	case cudaErrorMemoryAllocation:
		return -ENOMEM;
	default:
		return -EIO;
	}
}

/* The model on the device, over the arena; comm is the group's (NULL with tp = 1). */
static int build_model(struct wd *w, ncclComm_t comm)
{
	struct wd_gpu *gp = gpu(w);
	const struct bd_pool_geometry *geo = w->geo;
	char err[BD_MODEL_ERR_MAX] = "";
	struct bd_gmodel_opts o = {
		.device = w->o.device,
		.weights = strcmp(w->o.weights, "f32") ? BD_GWEIGHTS_BF16 : BD_GWEIGHTS_F32,
		.cfg = w->pool_cfg,
		.lay = geo->layout,
		.pages = (char *)gp->base + geo->pages_offset,
		.slots = (char *)gp->base + geo->slots_offset,
		.n_slots = geo->n_slots,
		.mu_k = w->calib ? w->calib->mu_k : NULL,
		.dp = &w->dp,
		.max_batch = w->o.max_batch,
		.max_tokens = gp->max_tokens,
		.max_prefill = gp->max_prefill,
		.nccl_comm = comm,
		.use_graphs = w->o.cuda_graphs,
		.ar_timeout_ms = w->o.ar_timeout_ms,
	};
	int64_t t0 = bd_now_ms();
	int r;

	if (*w->o.random_weights)
		r = bd_gmodel_new_random(&gp->hp, &gp->shard, w->o.seed, &o, &gp->g, err);
	else
		r = bd_gmodel_new(w->model, &o, &gp->g, err);
	if (r < 0) {
		bd_log_err("model on device %d: %s (%s)", w->o.device, *err ? err : "failed",
		       strerror(-r));
		return r;
	}
	/* the host copy served its purpose */
	bd_model_free(w->model);
	w->model = NULL;
	bd_log_info("%s on device %d in %lld ms: %s weights%s, max batch %d, max tokens %d, max "
		"prefill %d, graphs %s", w->model_name, w->o.device,
		(long long)(bd_now_ms() - t0), w->o.weights,
		*w->o.random_weights ? " (random)" : "", w->o.max_batch, gp->max_tokens,
		gp->max_prefill, w->o.cuda_graphs ? "on" : "off");
	return 0;
}

static int gpu_setup(struct wd *w)
{
	const struct bd_pool_geometry *geo = w->geo;
	struct wd_gpu *gp;
	int r;

	if (w->o.device >= 0 && w->o.device != geo->device) {
		bd_log_err("device %d: kvpoold put rank %d's arena on device %d (the arena is mapped "
		       "where it lives)", w->o.device, w->o.rank, geo->device);
		return -EINVAL;
	}
	w->o.device = geo->device;
	/* NVLink multicast (NVLS) off unless asked for: before the first NCCL call */
	setenv("NCCL_NVLS_ENABLE", "0", 0);
	cudaError_t ce = cudaSetDevice(w->o.device);
	if ((r = cuda_errno(ce)) < 0) {
		bd_log_err("CUDA device %d: %s", w->o.device, cudaGetErrorString(ce));
		return r;
	}
	gp = calloc(1, sizeof(*gp));
	if (!gp)
		return -ENOMEM;
	w->be_state = gp;
	/* the decode kernel family, before any plan: refused here, not at a request */
	r = bd_decode_select(w->o.decode_kernel, w->pool_cfg, &geo->layout,
			     w->hp.n_heads / w->hp.n_kv_heads, NULL, &gp->decode);
	if (r < 0) {
		bd_log_err("decode kernel on device %d: %s (%s)", w->o.device, gp->decode.why,
			   strerror(-r));
		return r;
	}
	snprintf(gp->decode_info, sizeof(gp->decode_info), "%s (%s)",
		 bd_kfamily_name(gp->decode.family), gp->decode.why);
	if (gp->decode.selfcheck && gp->decode.selfcheck_result != 0)
		bd_log_warn("decode kernel on device %d: %s", w->o.device, gp->decode_info);
	else
		bd_log_info("decode kernel on device %d: %s", w->o.device, gp->decode_info);
	gp->hp = w->hp;
	gp->max_tokens = w->o.max_tokens ? w->o.max_tokens : (int)geo->max_seq_len;
	if (gp->max_tokens > (int)geo->max_seq_len)
		gp->max_tokens = (int)geo->max_seq_len;
	if (*w->o.random_weights) {
		/* no checkpoint to hold to: RoPE goes as far as the pool does */
		if (gp->hp.n_ctx_train < gp->max_tokens)
			gp->hp.n_ctx_train = gp->max_tokens;
	} else if (gp->max_tokens > gp->hp.n_ctx_train) {
		gp->max_tokens = gp->hp.n_ctx_train;
	}
	gp->max_prefill = w->o.max_prefill < gp->max_tokens ? w->o.max_prefill : gp->max_tokens;
	if ((r = bd_model_shard_plan(&gp->hp, w->o.rank, w->o.tp, &gp->shard)) < 0)
		return r;
	size_t B = (size_t)w->o.max_batch;
	gp->rows = calloc(B, sizeof(*gp->rows));
	gp->toks = calloc(B, sizeof(*gp->toks));
	gp->out_tok = calloc(B, sizeof(*gp->out_tok));
	gp->status = calloc(B, sizeof(*gp->status));
	gp->top_ids = calloc(B * WD_TOP_MAX, sizeof(*gp->top_ids));
	gp->top_logits = calloc(B * WD_TOP_MAX, sizeof(*gp->top_logits));
	gp->want_lp = calloc(B, sizeof(*gp->want_lp));
	gp->lp = calloc(B, sizeof(*gp->lp));
	gp->lp_ids = calloc(B * WD_LOGPROBS_MAX, sizeof(*gp->lp_ids));
	gp->lp_vals = calloc(B * WD_LOGPROBS_MAX, sizeof(*gp->lp_vals));
	if (!gp->rows || !gp->toks || !gp->out_tok || !gp->status || !gp->top_ids ||
	    !gp->top_logits || !gp->want_lp || !gp->lp || !gp->lp_ids || !gp->lp_vals)
		return -ENOMEM;
	bd_log_info("cuda backend: device %d, tp %d%s", w->o.device, w->o.tp,
		w->o.synthetic_prefill ? ", synthetic prefill" : "");
	return 0;
}

/* The arena imported on the rank's device; tp = 1: the model built over it (tp > 1 builds it
 * at the first join, with the communicator). */
static int gpu_map(struct wd *w)
{
	struct wd_gpu *gp = gpu(w);
	char err[256] = "";
	int r;

	cudaSetDevice(w->o.device);
	if ((r = bd_pool_cuda_map(w->pool, &gp->base, err, sizeof(err))) < 0) {
		bd_log_err("importing kvpoold's arena on device %d: %s", w->o.device, err);
		gp->base = NULL;
		return r;
	}
	bd_log_info("cuda backend: arena of %zu bytes mapped on device %d", w->geo->arena_bytes,
		    w->o.device);
	if (w->o.tp == 1)
		return build_model(w, NULL);
	return 0;
}

/* The rank's device; rank 0 of tp > 1 a fresh NCCL unique id for the next epoch. */
static int gpu_register_fill(struct wd *w, Bdfp4__RegisterRequest *rq, uint8_t *id)
{
	ncclUniqueId uid;
	ncclResult_t nr;

	rq->device = w->o.device;
	rq->decode_kernel = gpu(w)->decode_info;
	/* a synthetic fill starts a sequence at 0 only; a real prefill row takes max_prefill */
	rq->whole_prompts = w->o.synthetic_prefill;
	rq->max_prefill = w->o.synthetic_prefill ? 0 : (uint32_t)gpu(w)->max_prefill;
	if (w->o.tp == 1 || w->o.rank != 0)
		return 0;
	if ((nr = ncclGetUniqueId(&uid)) != ncclSuccess) {
		bd_log_err("ncclGetUniqueId: %s", ncclGetErrorString(nr));
		return -EIO;
	}
	_Static_assert(sizeof(uid) <= WD_NCCL_ID_MAX, "RegisterRequest carries 128 bytes");
	memcpy(id, &uid, sizeof(uid));
	rq->nccl_unique_id.data = id;
	rq->nccl_unique_id.len = sizeof(uid);
	return 0;
}

/* tp > 1: the communicator of the relayed id joined (the model built at the first join, handed
 * the communicator at later ones); tp = 1: nothing to join. -EIO, with the backend dead, when
 * the model cannot be built or refuses the communicator for good. */
static int gpu_join(struct wd *w, const Bdfp4__RegisterReply *rr)
{
	struct wd_gpu *gp = gpu(w);
	ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
	ncclUniqueId uid;
	ncclComm_t comm = NULL;
	ncclResult_t nr, st = ncclInProgress;
	int r;

	if (gp->dead)
		return -EIO;
	if (w->o.tp == 1)
		return 0; /* the model was built over the arena at map */
	if (rr->nccl_unique_id.len != sizeof(uid)) {
		bd_log_err("RegisterReply: NCCL unique id of %zu bytes (want %zu); registering again",
			   rr->nccl_unique_id.len, sizeof(uid));
		return -EINVAL;
	}
	memcpy(&uid, rr->nccl_unique_id.data, sizeof(uid));
	cudaSetDevice(w->o.device);
	cfg.blocking = 0;
	int64_t t0 = bd_now_ms();
	nr = ncclCommInitRankConfig(&comm, w->o.tp, uid, w->o.rank, &cfg);
	if (nr != ncclSuccess && nr != ncclInProgress) {
		bd_log_err("ncclCommInitRankConfig: %s; registering again", ncclGetErrorString(nr));
		if (comm)
			ncclCommAbort(comm);
		return -ECONNREFUSED;
	}
	/* non-blocking init: poll, so a rank that never comes cannot hang this one */
	while (bd_now_ms() - t0 < NCCL_JOIN_TIMEOUT_MS) {
		if (ncclCommGetAsyncError(comm, &st) != ncclSuccess || st != ncclInProgress)
			break;
		usleep(1000);
	}
	if (st != ncclSuccess) {
		bd_log_err("NCCL communicator of rank %d of %d: %s; registering again", w->o.rank,
		       w->o.tp, st == ncclInProgress ? "timed out" : ncclGetErrorString(st));
		ncclCommAbort(comm);
		return st == ncclInProgress ? -ETIMEDOUT : -ECONNREFUSED;
	}
	if (!gp->g) {
		if (build_model(w, comm) < 0) {
			ncclCommAbort(comm);
			gp->dead = true;
			return -EIO;
		}
	} else if ((r = bd_gmodel_set_comm(gp->g, comm)) < 0) {
		bd_log_err("the model refused the new communicator: %s", strerror(-r));
		ncclCommAbort(comm);
		if (r == -EIO) {
			gp->dead = true;
			return -EIO;
		}
		return r;
	}
	gp->comm = comm;
	gp->broken = false;
	bd_log_info("NCCL communicator of %d ranks joined in %lld ms", w->o.tp,
		(long long)(bd_now_ms() - t0));
	return 0;
}

/* Every request's record dropped and the communicator aborted; the model keeps no request
 * state. */
static void gpu_leave(struct wd *w)
{
	struct wd_gpu *gp = gpu(w);

	if (!gp)
		return;
	wd_gtab_clear(&gp->gtab);
	/* abort, not destroy: the peer may be dead, and destroy would wait for it; the model
	 * lets go of it first (its graphs hold the communicator's resources), unless it
	 * aborted it itself when a wait saw the peer fail (then it is gone: never twice) */
	bool held = gp->comm && (!gp->g || bd_gmodel_comm(gp->g) == (void *)gp->comm);
	if (gp->g && w->o.tp > 1)
		bd_gmodel_set_comm(gp->g, NULL);
	if (held)
		ncclCommAbort(gp->comm);
	gp->comm = NULL;
	gp->broken = false;
}

static enum wd_health gpu_health(const struct wd *w)
{
	const struct wd_gpu *gp = gpu(w);

	if (gp->dead)
		return WD_DEAD;
	if (!gp->g)
		return WD_BROKEN; /* tp > 1 before the first join: no model yet */
	return gp->broken ? WD_REJOIN : WD_HEALTHY;
}

static void gpu_release(struct wd *w, uint64_t request_id)
{
	wd_gtab_drop(&gpu(w)->gtab, request_id);
}

static void gpu_teardown(struct wd *w)
{
	struct wd_gpu *gp = gpu(w);

	if (!gp)
		return;
	bd_gmodel_free(gp->g);
	if (gp->base) {
		cudaDeviceSynchronize();
		bd_pool_cuda_unmap(w->pool, gp->base);
	}
	free(gp->items);
	free(gp->mapped);
	free(gp->dec);
	free(gp->rows);
	free(gp->toks);
	free(gp->out_tok);
	free(gp->status);
	free(gp->top_ids);
	free(gp->top_logits);
	free(gp->want_lp);
	free(gp->lp);
	free(gp->lp_ids);
	free(gp->lp_vals);
	free(gp->ul);
	free(gp->dev);
	free(gp->host);
	free(gp->plan);
	free(gp);
	w->be_state = NULL;
}

/* ---- steps ---------------------------------------------------------------------------------- */

static int grow_items(struct wd_gpu *gp, size_t n)
{
	if (n <= gp->cap)
		return 0;
	struct wd_gitem *it = realloc(gp->items, n * sizeof(*it));
	if (!it)
		return -ENOMEM;
	gp->items = it;
	int *m = realloc(gp->mapped, n * sizeof(*m));
	if (!m)
		return -ENOMEM;
	gp->mapped = m;
	int *d = realloc(gp->dec, n * sizeof(*d));
	if (!d)
		return -ENOMEM;
	gp->dec = d;
	gp->cap = n;
	return 0;
}

/* A model error of row o. Communicator errors break the epoch (the rank registers again);
 * -EIO, and any failure of a tp = 1 model past -EINVAL/-ERANGE/-EDOM/-ENOMEM, is for good. */
static void model_error(struct wd *w, struct wd_row_out *o, int r, const char *what,
			const char *err)
{
	struct wd_gpu *gp = gpu(w);
	bool comm = (r == -EPIPE || r == -ETIMEDOUT) && w->o.tp > 1;

	if (comm)
		gp->broken = true;
	else if (r == -EIO || r == -EPIPE || r == -ETIMEDOUT || r == -ENODEV)
		gp->dead = true;
	wd_row_fail(o, comm ? BDFP4__SERVE_ERROR__SERVE_ERR_WORKER_FAILED
			    : r == -EIO ? BDFP4__SERVE_ERROR__SERVE_ERR_INTERNAL : wd_serve_error(r),
		    "%s: %s", what, err && *err ? err : strerror(-r));
}

/* What a call's rows ask of rank 0: the most top logits and top log-probabilities any of
 * them wants, and whether any wants log-probabilities. */
struct gask {
	int top_k, lp_k;
	bool lp;
};

/* Row k of a call: item it asks for its outputs (gp->want_lp[k] set) and widens *a. */
static void ask(struct wd_gpu *gp, const struct wd_gitem *it, int k, struct gask *a)
{
	gp->want_lp[k] = it->sample && it->logprobs;
	if (!it->sample)
		return;
	if ((int)it->top_k > a->top_k)
		a->top_k = (int)it->top_k;
	if (it->logprobs) {
		/* no more alternatives than the vocabulary has (bd_sampler_logprobs's min) */
		int want = (int)it->top_logprobs < gp->hp.n_vocab ? (int)it->top_logprobs
								  : gp->hp.n_vocab;
		a->lp = true;
		if (want > a->lp_k)
			a->lp_k = want;
	}
}

/* Rank 0's outputs of one call (a: what its rows ask). */
static struct bd_gout *gout(struct wd *w, struct bd_gout *go, const struct gask *a)
{
	struct wd_gpu *gp = gpu(w);

	if (w->o.rank != 0)
		return NULL;
	*go = (struct bd_gout){ .tokens = gp->out_tok, .top_k = a->top_k,
				.top_ids = a->top_k ? gp->top_ids : NULL,
				.top_logits = a->top_k ? gp->top_logits : NULL,
				.want_lp = a->lp ? gp->want_lp : NULL, .lp_k = a->lp_k,
				.lp = gp->lp, .lp_ids = gp->lp_ids, .lp_vals = gp->lp_vals };
	return go;
}

/* Row k of a call's outputs into o (rank 0, a row that samples). Returns 0, or -1 with the
 * row failed (its log-probabilities could not be made: non-finite logits). */
static int put_result(struct wd *w, const struct wd_gitem *it, int k, const struct gask *a,
		      struct wd_row_out *o)
{
	struct wd_gpu *gp = gpu(w);

	if (w->o.rank != 0 || !it->sample)
		return 0;
	o->rr.token = gp->out_tok[k];
	uint32_t n = it->top_k < (uint32_t)a->top_k ? it->top_k : (uint32_t)a->top_k;
	for (uint32_t j = 0; j < n; j++) {
		bdfp4__top_logit__init(&o->top[j]);
		o->top[j].token = gp->top_ids[(size_t)k * (size_t)a->top_k + j];
		o->top[j].logit = gp->top_logits[(size_t)k * (size_t)a->top_k + j];
		o->topp[j] = &o->top[j];
	}
	o->rr.n_top = n;
	o->rr.top = n ? o->topp : NULL;
	if (!it->logprobs)
		return 0;
	size_t at = (size_t)k * (size_t)a->lp_k;
	int nl = it->top_logprobs < (uint32_t)a->lp_k ? (int)it->top_logprobs : a->lp_k;
	return wd_row_logprobs(o, gp->lp[k], gp->lp_ids + at, gp->lp_vals + at, nl);
}

static double mono_us(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return (double)t.tv_sec * 1e6 + (double)t.tv_nsec * 1e-3;
}

/* Grows *v (capacity *cap doubles) to hold n + 1. */
static int grow_doubles(double **v, size_t *cap, size_t n)
{
	if (n < *cap)
		return 0;
	size_t nc = *cap ? 2 * *cap : 4096;
	double *a = realloc(*v, nc * sizeof(double));
	if (!a)
		return -ENOMEM;
	*v = a;
	*cap = nc;
	return 0;
}

/* One decode call of n rows that took host_us on the host. */
static void note_timing(struct wd *w, int n, double host_us)
{
	struct wd_gpu *gp = gpu(w);
	struct bd_gmodel_timing t;
	size_t c = gp->cap_t;

	bd_gmodel_last_timing(gp->g, &t);
	/* the three arrays share one capacity: grow each from the same old one */
	if (gp->n_t == gp->cap_t) {
		size_t c1 = c, c2 = c;
		if (grow_doubles(&gp->ul, &c, gp->n_t) < 0 || grow_doubles(&gp->dev, &c1, gp->n_t) < 0 ||
		    grow_doubles(&gp->host, &c2, gp->n_t) < 0)
			return;
		gp->cap_t = c;
	}
	gp->ul[gp->n_t] = t.upload_us + t.launch_us;
	gp->dev[gp->n_t] = t.device_us;
	gp->host[gp->n_t++] = host_us;
	gp->graph_steps += t.graph != 0;
	gp->rows_sum += n;
	gp->upload_sum += t.upload_us;
	gp->launch_sum += t.launch_us;
	gp->host_sum += host_us;
	if (w->o.verbose)
		bd_log_debug("decode of %d rows: upload %.1f us, launch %.1f us%s, device %.1f us, "
			 "host %.1f us", n, t.upload_us, t.launch_us, t.graph ? " (graph)" : "",
			 t.device_us, host_us);
}

static void gpu_note_plan(struct wd *w, size_t n_rows, double us)
{
	struct wd_gpu *gp = gpu(w);

	if (grow_doubles(&gp->plan, &gp->cap_p, gp->n_p) == 0) {
		gp->plan[gp->n_p++] = us;
		gp->plan_sum += us;
		gp->plan_rows += n_rows;
		gp->plan_dec_rows += (size_t)gp->last_nd;
	}
	gp->last_nd = 0;
}

/* The decode rows dec[0..nd) (plan row indices), max_batch per call. */
static void run_decodes(struct wd *w, const Bdfp4__StepPlan *plan, struct wd_row_out *out,
			int nd, bool *broken)
{
	struct wd_gpu *gp = gpu(w);
	char err[BD_MODEL_ERR_MAX];

	for (int k0 = 0; k0 < nd; k0 += w->o.max_batch) {
		int n = nd - k0 < w->o.max_batch ? nd - k0 : w->o.max_batch, r;
		struct bd_gout go;
		struct gask a = { 0, 0, false };
		for (int k = 0; k < n; k++) {
			const struct wd_gitem *it = &gp->items[gp->dec[k0 + k]];
			gp->rows[k] = it->g;
			gp->toks[k] = it->token;
			ask(gp, it, k, &a);
		}
		if (*broken) {
			r = -EPIPE;
			snprintf(err, sizeof(err), "the communicator broke earlier in this step");
		} else {
			err[0] = 0;
			double t0 = mono_us();
			r = bd_gmodel_decode(gp->g, gp->rows, gp->toks, n, gout(w, &go, &a),
					     gp->status, err);
			double t1 = mono_us();
			if (r == 0) {
				note_timing(w, n, t1 - t0);
				gp->last_nd += n;
			}
		}
		for (int k = 0; k < n; k++) {
			size_t i = (size_t)gp->dec[k0 + k];
			struct wd_gitem *it = &gp->items[i];
			int e = r < 0 ? r : gp->status[k];
			if (e < 0) {
				model_error(w, &out[i], e, "decode", r < 0 ? err : NULL);
				wd_gtab_drop(&gp->gtab, it->id);
			} else {
				wd_gdone(&gp->gtab, it, put_result(w, it, k, &a, &out[i]) == 0);
			}
		}
		if (r < 0)
			*broken = true;
	}
	(void)plan;
}

/* The pages and the slot the row takes over (wd_gscrub) zeroed on the model's stream, before
 * the step's kernels: what an earlier request left there is never read by this one. Returns 0,
 * or -1 with the row failed and the backend dead (a memset of ids the row checked is refused
 * only by a broken device, and the ranks must keep making the same calls: the worker exits). */
static int scrub_row(struct wd *w, const Bdfp4__PlanRow *row, const struct wd_gitem *it,
		     struct wd_row_out *o)
{
	struct wd_gpu *gp = gpu(w);
	void *st = bd_gmodel_stream(gp->g);
	const int32_t *pages;
	size_t n;
	int32_t slot;
	char err[160];
	int r = 0;

	wd_gscrub(row, it, &pages, &n, &slot);
	if (slot >= 0)
		r = bd_pool_cuda_scrub(w->geo, gp->base, true, slot, st, err, sizeof(err));
	for (size_t k = 0; k < n && r == 0; k++)
		r = bd_pool_cuda_scrub(w->geo, gp->base, false, pages[k], st, err, sizeof(err));
	if (r < 0) {
		bd_log_err("%s", err);
		gp->dead = true;
		return wd_row_fail(o, BDFP4__SERVE_ERROR__SERVE_ERR_WORKER_FAILED, "rank %d: %s",
				   w->o.rank, err);
	}
	return 0;
}

/* A prefix hit's BF16 sink (NUMERICS.md §8), rebuilt before its first chunk: the hit's first
 * it->n_sink tokens prefilled at position 0 into its new slot, with no page and no output,
 * so positions 0..15 see the same tokens as in the prefill that wrote the shared pages (its
 * recent rows are rewritten by the chunk before anything reads them). The same call on every
 * rank (its all-reduces). Returns bd_gmodel_prefill's result. */
static int rebuild_sink(struct wd_gpu *gp, const struct wd_gitem *it, char *err)
{
	struct bd_grow s = { .slot = it->g.slot, .position = 0, .sampling = it->g.sampling };
	return bd_gmodel_prefill(gp->g, &s, it->sink_tokens, it->n_sink, NULL, err);
}

static void gpu_run_rows(struct wd *w, const Bdfp4__StepPlan *plan, struct wd_row_out *out,
			 Bdfp4__ServeError *ret_error, char *msg, size_t cap)
{
	struct wd_gpu *gp = gpu(w);
	struct wd_glimits lim = {
		.n_pages = w->geo->n_pages, .n_slots = w->geo->n_slots,
		.max_tokens = gp->max_tokens, .max_prefill = gp->max_prefill,
		.n_vocab = gp->hp.n_vocab, .synthetic = w->o.synthetic_prefill,
		.kv_config = w->pool_cfg->name,
	};
	char err[BD_MODEL_ERR_MAX];
	bool broken = false;
	int nd = 0, r;

	gp->last_nd = 0;
	if (grow_items(gp, plan->n_rows) < 0) {
		wd_rows_fail(plan, out, BDFP4__SERVE_ERROR__SERVE_ERR_RESOURCE_EXHAUSTED,
			     "out of memory");
		return;
	}
	for (size_t i = 0; i < plan->n_rows; i++) {
		struct wd_row_out *o = &out[i];
		int code = wd_gmap(&gp->gtab, plan->rows[i], &lim, &gp->items[i], o->msg,
				   sizeof(o->msg));
		gp->mapped[i] = code == 0;
		if (code) {
			o->rr.error = (Bdfp4__ServeError)code;
			o->rr.message = o->msg;
		} else if (scrub_row(w, plan->rows[i], &gp->items[i], o) < 0) {
			gp->mapped[i] = false;
			wd_gdone(&gp->gtab, &gp->items[i], false);
		}
	}
	/* prefills in plan order (real, or the synthetic fill), then every decode row: the same
	 * calls on every rank */
	for (size_t i = 0; i < plan->n_rows; i++) {
		struct wd_gitem *it = &gp->items[i];
		struct bd_gout go;
		if (!gp->mapped[i] || it->kind == WD_G_DECODE)
			continue;
		if (broken) {
			wd_row_fail(&out[i], BDFP4__SERVE_ERROR__SERVE_ERR_WORKER_FAILED,
				    "the communicator broke earlier in this step");
			wd_gdone(&gp->gtab, it, false);
			continue;
		}
		err[0] = 0;
		if (it->kind == WD_G_PREFILL) {
			struct gask a = { 0, 0, false };
			ask(gp, it, 0, &a);
			r = it->n_sink ? rebuild_sink(gp, it, err) : 0;
			if (r == 0)
				r = bd_gmodel_prefill(gp->g, &it->g, it->tokens, it->n_tokens,
						      gout(w, &go, &a), err);
			if (r == 0) {
				wd_gdone(&gp->gtab, it, put_result(w, it, 0, &a, &out[i]) == 0);
				continue;
			}
		} else {
			/* the fill has no collective: its decode joins the batch */
			r = it->n_fill ? bd_gmodel_fill_synthetic(gp->g, &it->fill, it->n_fill,
								  it->id, err)
				       : 0;
			if (r == 0) {
				gp->dec[nd++] = (int)i;
				continue;
			}
		}
		model_error(w, &out[i], r, it->kind == WD_G_PREFILL ? "prefill" : "synthetic fill",
			    err);
		wd_gdone(&gp->gtab, it, false);
		if (gp->broken || gp->dead)
			broken = true;
	}
	for (size_t i = 0; i < plan->n_rows; i++)
		if (gp->mapped[i] && gp->items[i].kind == WD_G_DECODE)
			gp->dec[nd++] = (int)i;
	if (nd)
		run_decodes(w, plan, out, nd, &broken);
	if (gp->broken || gp->dead) {
		*ret_error = BDFP4__SERVE_ERROR__SERVE_ERR_WORKER_FAILED;
		snprintf(msg, cap, "rank %d: the %s failed", w->o.rank,
			 gp->dead ? "GPU model" : "NCCL communicator (a rank died or hung)");
	}
}

/* ---- timing --------------------------------------------------------------------------------- */

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static double pct(const double *v, size_t n, double p)
{
	if (!n)
		return 0;
	size_t i = (size_t)(p * (double)(n - 1) + 0.5);
	return v[i < n ? i : n - 1];
}

static void gpu_report(struct wd *w)
{
	struct wd_gpu *gp = gpu(w);
	size_t n, np;

	n = gp->n_t;
	np = gp->n_p;
	double su = 0, sd = 0;
	for (size_t i = 0; i < n; i++) {
		su += gp->ul[i];
		sd += gp->dev[i];
	}
	if (n) {
		qsort(gp->ul, n, sizeof(double), cmp_double);
		qsort(gp->dev, n, sizeof(double), cmp_double);
		qsort(gp->host, n, sizeof(double), cmp_double);
	}
	if (np)
		qsort(gp->plan, np, sizeof(double), cmp_double);
	double dn = n ? (double)n : 1, dp = np ? (double)np : 1;
	/* decode throughput of this rank: rows over the host wall time of the decode calls only
	 * (a plan's prefill and synthetic fill are outside them) */
	double dec_tok_s = gp->host_sum > 0 ? gp->rows_sum / (gp->host_sum * 1e-6) : 0;
	/* one line of key=value pairs: bench/serve_gpu.sh reads it. µs unless named _ms; host_*:
	 * a decode call's wall time on the host; plan_*: a plan from wd_run_plan's entry (frame
	 * unpacked) to its StepResult handed to the I/O thread */
	bd_log_info("decode-timing steps=%zu graph_steps=%zu rows_mean=%.1f upload_mean=%.1f "
		"launch_mean=%.1f ul_mean=%.1f ul_p50=%.1f ul_p99=%.1f dev_mean=%.1f dev_p50=%.1f "
		"dev_p99=%.1f dec_rows=%.0f host_mean=%.1f host_p50=%.1f host_p99=%.1f "
		"host_sum_ms=%.3f dec_tok_s=%.2f plans=%zu plan_rows=%zu plan_dec_rows=%zu "
		"plan_mean=%.1f plan_p50=%.1f plan_p99=%.1f plan_sum_ms=%.3f",
		n, gp->graph_steps, gp->rows_sum / dn, gp->upload_sum / dn, gp->launch_sum / dn,
		su / dn, pct(gp->ul, n, 0.5), pct(gp->ul, n, 0.99), sd / dn, pct(gp->dev, n, 0.5),
		pct(gp->dev, n, 0.99), gp->rows_sum, gp->host_sum / dn, pct(gp->host, n, 0.5),
		pct(gp->host, n, 0.99), gp->host_sum * 1e-3, dec_tok_s, np, gp->plan_rows,
		gp->plan_dec_rows, gp->plan_sum / dp, pct(gp->plan, np, 0.5),
		pct(gp->plan, np, 0.99), gp->plan_sum * 1e-3);
	gp->n_t = 0;
	gp->n_p = 0;
	gp->graph_steps = 0;
	gp->rows_sum = gp->upload_sum = gp->launch_sum = gp->host_sum = 0;
	gp->plan_sum = 0;
	gp->plan_rows = gp->plan_dec_rows = 0;
}

const struct wd_backend wd_backend_cuda = WD_BACKEND(gpu, "cuda", "NCCL communicator");
