/* workerd.h — the tensor-parallel worker daemon's context and its backend table, shared by
 * its files.
 *
 * Two threads: the compute thread (main.c's loop, step.c and the backend) owns the model, the
 * pool arena, the requests and the collective between the ranks; the I/O thread (io.c) owns
 * the ZeroMQ DEALER to the router, forwards frames both ways over an inproc PAIR and sends
 * heartbeats (and the systemd watchdog) on its own clock, so a long step never starves them.
 *
 * Who calls whom: main.c calls every file; step.c calls io.c and the backend through the table;
 * cpu.c and gpu.c (the backends) call row.c, gpu.c also growmap.c; io.c, row.c and growmap.c
 * call no other file of workerd/. No file calls back into one that calls it.
 */
#ifndef BD_WORKERD_H
#define BD_WORKERD_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/bd_clock.h"
#include "base/bd_daemon.h"
#include "base/bd_log.h"
#include "quant/bd_attn_ref.h"
#include "quant/bd_calib.h"
#include "quant/bd_kfamily.h"
#include "model/bd_forward.h"
#include "pool/bd_kvmem_pool.h"
#include "pool/bd_pool_client.h"
#include "serve.pb-c.h"

#define WD_PROTO_VERSION 1
#define WD_MAX_FRAME (64u << 20)        /* router frames beyond this are refused */
#define WD_DEFAULT_HEARTBEAT_MS 250
#define WD_IO_ENDPOINT_FMT "inproc://workerd-io-%p"
#define WD_MSG_MAX 200
#define WD_TOP_MAX 64
#define WD_LOGPROBS_MAX 20              /* PlanRow.top_logprobs beyond this are cut */
#define WD_NCCL_ID_MAX 128              /* bytes of RegisterRequest.nccl_unique_id */

/* Frames on the inproc pair, compute → I/O: one frame, sent to the router as it is; an empty
 * frame stops the I/O thread. I/O → compute: a router frame as it came. */

struct wd_opts {
	int rank, tp, threads, ar_timeout_ms;
	const char *model, *pool_socket, *router, *ar_dir;
	const char *router_server_key, *curve_secret_key; /* CURVE to the router ("": plain) */
	bool insecure_tcp;          /* a plain TCP router endpoint off loopback allowed */
	char ar_dir_buf[256];       /* ar_dir when chosen from the environment */
	int verbose;                /* 0 or 1: log every step */
	/* the cuda backend */
	int device;                 /* -1: the pool's device of this rank */
	const char *weights;        /* "bf16" or "f32" */
	const char *random_weights; /* a bd_model_preset name, or "" */
	uint64_t seed;              /* of the random weights */
	bool synthetic_prefill;
	int max_batch, max_tokens, max_prefill; /* max_tokens 0: the pool's max_seq_len */
	bool cuda_graphs;
	bool batch_invariant;       /* decode rows batch-invariant (BD_BATCH_INVARIANT) */
	enum bd_kfamily_mode decode_kernel; /* how the decode kernel family is chosen */
	const char *calib;          /* calibration file (μ_k, τ), or "" */
};

/* One row's result as it is built (row.c; filled by the backends). */
struct wd_row_out {
	Bdfp4__RowResult rr;
	char msg[WD_MSG_MAX];
	Bdfp4__TopLogit top[WD_TOP_MAX];
	Bdfp4__TopLogit *topp[WD_TOP_MAX];
	Bdfp4__TokenLogprob lp[WD_LOGPROBS_MAX];
	Bdfp4__TokenLogprob *lpp[WD_LOGPROBS_MAX];
};

/* What a backend says of itself between steps. */
enum wd_health {
	WD_HEALTHY = 0,
	/* the collective of this epoch is broken (a rank died or left) or not there yet: steps
	 * fail with SERVE_ERR_WORKER_FAILED until the router resets the group */
	WD_BROKEN,
	/* broken, and this rank registers again itself, which makes the router reset the group
	 * (NCCL cannot tell a hung peer from a slow one the way the all-reduce's file locks do) */
	WD_REJOIN,
	/* the backend failed for good: the worker exits 1 and is restarted */
	WD_DEAD,
};

struct wd;

/* One table of operations per backend (STYLE.md 2), chosen once at start from the pool's
 * backend (main.c); cpu.c and gpu.c implement it. Every operation runs on the compute thread;
 * each keeps its state behind wd->be_state. */
struct wd_backend {
	const char *name;       /* the pool's backend it runs on: "cpu", "cuda" */
	const char *collective; /* what joins the ranks, for messages: "all-reduce", ... */
	/* whether it serves batch_invariant (wd_opts): a decode row's products and reductions in
	 * an order that does not depend on the batch */
	bool batch_invariant;
	/* After the pool's geometry was read (w->geo; nothing attached yet) and the shard (or
	 * its shape, with random_weights) loaded: the backend's state. Returns 0 or -errno,
	 * logged (-ENOTSUP: an option this backend cannot serve). teardown runs either way. */
	int (*setup)(struct wd *w);
	/* Once, after the first attach (w->pool, made with the epoch's token of the first
	 * RegisterReply), before the first join: the KV memory over the pool's arena. Returns 0
	 * or -errno, logged (the worker exits). */
	int (*map)(struct wd *w);
	/* Frees what setup made, after leave; accepts a setup that failed part way, or none. */
	void (*teardown)(struct wd *w);
	/* The backend's part of a RegisterRequest: rq->device and rq->nccl_unique_id (its bytes
	 * into id[WD_NCCL_ID_MAX], which the caller keeps until the send). Returns 0, or -errno
	 * (logged: register again later). */
	int (*register_fill)(struct wd *w, Bdfp4__RegisterRequest *rq, uint8_t *id);
	/* The RegisterReply's group joined (the all-reduce file it names, the NCCL id it relays).
	 * Returns 0, -EBADMSG when the reply cannot be used (logged: register again in a
	 * second), or another -errno (logged: register again soon); health() is WD_DEAD when the
	 * failure is for good. */
	int (*join)(struct wd *w, const Bdfp4__RegisterReply *rr);
	/* Out of the group: every request dropped, the collective closed. Accepts a backend
	 * never joined or never set up. */
	void (*leave)(struct wd *w);
	enum wd_health (*health)(const struct wd *w);
	/* StepPlan.release: the request's state dropped (unknown ids are ignored). */
	void (*release)(struct wd *w, uint64_t request_id);
	/* Runs the rows of a plan, out[n_rows] initialized (request id, token −1, no error): each
	 * row's result or row error into out[i], in the same calls on every rank. Sets *ret_error
	 * and msg[cap] when the step as a whole failed (the collective broke). */
	void (*run_rows)(struct wd *w, const Bdfp4__StepPlan *plan, struct wd_row_out *out,
			 Bdfp4__ServeError *ret_error, char *msg, size_t cap);
	/* A plan of n_rows rows run and its StepResult sent, us µs after wd_run_plan's entry. */
	void (*note_plan)(struct wd *w, size_t n_rows, double us);
	/* The timing since the last report logged (SIGUSR1, exit) and started over. */
	void (*report)(struct wd *w);
};

/* The table of the backend whose operations are named PREFIX_setup, PREFIX_teardown, ... in
 * its file: each backend fills every operation, under one naming rule. */
#define WD_BACKEND(prefix, name_, collective_, ...)                                            \
	{                                                                                       \
		__VA_ARGS__ .name = name_, .collective = collective_, .setup = prefix##_setup,  \
		.map = prefix##_map, .teardown = prefix##_teardown, .register_fill = prefix##_register_fill,         \
		.join = prefix##_join, .leave = prefix##_leave, .health = prefix##_health,      \
		.release = prefix##_release, .run_rows = prefix##_run_rows,                     \
		.note_plan = prefix##_note_plan, .report = prefix##_report,                     \
	}

extern const struct wd_backend wd_backend_cpu; /* cpu.c */
#ifdef BD_WORKERD_CUDA
extern const struct wd_backend wd_backend_cuda; /* gpu.c, built where nvcc is */
#endif

struct wd {
	struct bd_daemon d;         /* configuration, signal fd, sd_notify (bd_daemon.h) */
	struct wd_opts o;
	const struct wd_backend *be; /* NULL until the pool's backend is known */
	void *be_state;             /* the backend's own (cpu.c, gpu.c) */
	struct bd_model *model;     /* the host shard (the cuda backend frees it once uploaded) */
	struct bd_model_hparams hp; /* the whole model's shape */
	char model_name[256]; /* base name (or the preset's name), as registered */
	struct bd_calib *calib;     /* or NULL */
	uint8_t calib_sha[32];      /* SHA-256 of its file (RegisterRequest.calib_sha256) */
	struct bd_decode_params dp; /* the defaults, τ from the calibration */
	struct bd_pool_attach *pool; /* NULL until the first RegisterReply's token attached it */
	struct bd_pool_geometry pool_geo; /* what bd_pool_query read before registering */
	const struct bd_pool_geometry *geo; /* &pool_geo */
	uint8_t attach_token[BD_POOL_TOKEN_BYTES]; /* the latest RegisterReply's (reattaches) */
	const struct bd_kvcfg *pool_cfg;

	void *zctx, *pair; /* compute side of the inproc pair */
	char io_endpoint[64];
	pthread_t io;
	bool io_started;

	/* the group: 0 until a RegisterReply */
	uint64_t epoch, owner;
	bool registering;
	int64_t last_register, retry_at; /* ms; retry_at 0: no retry planned */

	/* shared with the I/O thread */
	_Atomic uint64_t pub_epoch, pub_steps;
	_Atomic int heartbeat_ms;
	_Atomic int64_t last_router_ms; /* the last frame from the router */
	_Atomic int64_t last_drop_ms;   /* the last frame to it dropped (no connection) */
};

/* io.c */
/* Connects the DEALER to o.router and starts the I/O thread (the systemd watchdog period
 * read from the environment). Returns 0 or -errno (logged). */
int wd_io_start(struct wd *w);
/* Stops and joins the I/O thread; a no-op when it never started. */
void wd_io_stop(struct wd *w);
/* Sends a WorkerMessage to the router through the I/O thread. Returns 0 or -errno. */
int wd_send(struct wd *w, const Bdfp4__WorkerMessage *m);

/* step.c */
/* Runs one plan (epoch and health checked, releases, the backend's rows) and sends the
 * StepResult. Never fails: errors go into the result. */
void wd_run_plan(struct wd *w, const Bdfp4__StepPlan *plan);

/* row.c: building row results, for the backends */
/* ServeError of a -errno of the model or the pool. */
Bdfp4__ServeError wd_serve_error(int e);
/* Fails a row (error code and message). Returns -1. */
int wd_row_fail(struct wd_row_out *o, Bdfp4__ServeError code, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
/* Fails every row of the plan with code and msg (no memory to run them). */
void wd_rows_fail(const Bdfp4__StepPlan *plan, struct wd_row_out *out, Bdfp4__ServeError code,
		  const char *msg);
/* Rank 0's log-probabilities of a row that samples into its result, as both backends report
 * them (bd_sampler_logprobs on the cpu, bd_op_logprobs on the GPU): rr.logprob = logprob (the
 * sampled token's), rr.top_logprobs the first min(n, WD_LOGPROBS_MAX) of ids[n] and lp[n]
 * (most likely first; o's own arrays, nothing borrowed from the caller's). A NaN logprob
 * (the row's logits were not finite) fails the row with SERVE_ERR_INTERNAL instead and
 * returns -1, with no log-probabilities in the result; else returns 0. n < 0 counts as 0;
 * ids and lp may be NULL when n ≤ 0. */
int wd_row_logprobs(struct wd_row_out *o, float logprob, const int32_t *ids, const float *lp,
		    int n);
/* The rule of a prefix hit's row, one for both backends: a resume row with prefix_pages = k > 0
 * continues a request whose first k pages come from the prefix index (shared, leading its block
 * table) and whose slot is new, so it must be a prefill chunk at position 128·n_block_table
 * (k ≤ n_block_table) carrying the context's first tokens, from which its BF16 sink is rebuilt
 * (NUMERICS.md §8). Returns the sink's length, min(n_context, BD_SINK_TOKENS), for such a row;
 * 0 for a row that is no prefix hit (not a resume, or k = 0); -1 for a hit that breaks the rule,
 * with a one-line reason naming the prefix hit in msg[cap]. */
int wd_row_prefix_sink(const Bdfp4__PlanRow *row, char *msg, size_t cap);

#endif
