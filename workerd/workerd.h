/* workerd.h — the tensor-parallel worker daemon's context, shared by its files.
 *
 * Two threads: the compute thread (main.c's loop and step.c) owns the model, the pool arena,
 * the sequences and the all-reduce; the I/O thread (io.c) owns the ZeroMQ DEALER to the router,
 * forwards frames both ways over an inproc PAIR and sends heartbeats (and the systemd
 * watchdog) on its own clock, so a long step never starves them.
 */
#ifndef BD_WORKERD_H
#define BD_WORKERD_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "base/bd_clock.h"
#include "base/bd_log.h"
#include "serve/bd_allreduce.h"
#include "quant/bd_calib.h"
#include "model/bd_forward.h"
#include "pool/bd_kvmem_pool.h"
#include "pool/bd_pool_client.h"
#include "model/bd_sampler.h"
#include "growmap.h"
#include "serve.pb-c.h"

#define WD_PROTO_VERSION 1
#define WD_MAX_FRAME (64u << 20)        /* router frames beyond this are refused */
#define WD_AR_CAP (1u << 16)            /* floats per all-reduce round */
#define WD_JOIN_TIMEOUT_MS 10000
#define WD_DEFAULT_HEARTBEAT_MS 250
#define WD_IO_ENDPOINT_FMT "inproc://workerd-io-%p"
#define WD_MSG_MAX 200
#define WD_TOP_MAX 64

/* Frames on the inproc pair, compute → I/O: one frame, sent to the router as it is; an empty
 * frame stops the I/O thread. I/O → compute: a router frame as it came. */

struct wd_seq {
	uint64_t request_id;
	struct bd_seq *seq;
	struct bd_sampler *sampler; /* rank 0 */
	struct wd_seq *next;
};

struct wd_opts {
	int rank, tp, threads, ar_timeout_ms;
	const char *model, *pool_socket, *router, *ar_dir;
	bool verbose;
	/* the cuda backend */
	int device;                 /* -1: the pool's device of this rank */
	const char *weights;        /* "bf16" or "f32" */
	const char *random_weights; /* a bd_model_preset name, or "" */
	uint64_t seed;              /* of the random weights */
	bool synthetic_prefill;
	int max_batch, max_tokens, max_prefill; /* max_tokens 0: the pool's max_seq_len */
	bool cuda_graphs;
	const char *calib;          /* calibration file (μ_k, τ), or "" */
};

/* One row's result as it is built (step.c, gpu.c). */
struct wd_row_out {
	Bdfp4__RowResult rr;
	char msg[WD_MSG_MAX];
	Bdfp4__TopLogit top[WD_TOP_MAX];
	Bdfp4__TopLogit *topp[WD_TOP_MAX];
};

struct wd_gpu; /* gpu.c's state: device, model, NCCL communicator, timing */

struct wd {
	struct wd_opts o;
	struct bd_model *model;   /* CPU backend: the shard (the cuda backend frees it once uploaded) */
	struct bd_model_hparams hp; /* the whole model's shape */
	char model_name[256]; /* base name (or the preset's name), as registered */
	struct bd_calib *calib;   /* or NULL */
	struct bd_decode_params dp; /* the defaults, τ from the calibration */
	struct bd_pool_attach *pool;
	const struct bd_pool_geometry *geo;
	const struct bd_kvcfg *pool_cfg;
	struct bd_kvmem *mem;

	void *zctx, *pair; /* compute side of the inproc pair */
	char io_endpoint[64];
	pthread_t io;
	bool io_started;
	int sig_fd;

	/* the group: 0 until a RegisterReply; the all-reduce of this epoch */
	uint64_t epoch, owner;
	struct bd_allreduce *ar;
	bool registering;
	struct wd_seq *seqs;      /* CPU backend */
	float *logits; /* [V], rank 0 */
	struct wd_gpu *gpu;       /* cuda backend, else NULL */
	struct wd_gtab gtab;      /* cuda backend: the requests this rank serves */

	int64_t last_register, retry_at; /* ms; retry_at 0: no retry planned */

	/* shared with the I/O thread */
	_Atomic uint64_t pub_epoch, pub_steps;
	_Atomic int heartbeat_ms;
	_Atomic int64_t last_router_ms; /* the last frame from the router */
	_Atomic int64_t last_drop_ms;   /* the last frame to it dropped (no connection) */
	uint64_t watchdog_usec;
	char status[256]; /* the last STATUS= sent */
	bool stop;
};

/* io.c */
int wd_io_start(struct wd *w);
void wd_io_stop(struct wd *w);
/* Sends a WorkerMessage to the router through the I/O thread. Returns 0 or -errno. */
int wd_send(struct wd *w, const Bdfp4__WorkerMessage *m);

/* step.c */
/* ServeError of a -errno of the model or the pool. */
Bdfp4__ServeError wd_serve_error(int e);
/* Fails a row (error code and message). Returns -1. */
int wd_row_fail(struct wd_row_out *o, Bdfp4__ServeError code, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
/* Runs one plan and sends the StepResult. Never fails: errors go into the result. */
void wd_run_plan(struct wd *w, const Bdfp4__StepPlan *plan);
/* Drops every sequence (Reset, a new epoch, exit). */
void wd_drop_all(struct wd *w);

/* gpu.c: the cuda backend (a workerd built without CUDA has stubs that refuse it) */
/* Maps kvpoold's arena, builds the model on the device (w->model uploaded and freed, or
 * random weights), fills w->gpu. Returns 0 or -errno (logged). */
int wd_gpu_setup(struct wd *w);
void wd_gpu_teardown(struct wd *w);
/* Rank 0 of tp > 1: a new NCCL unique id for the RegisterRequest, id[*len] (≤ 128 bytes).
 * Returns 0 (*len 0 when no id is needed) or -errno. */
int wd_gpu_register_id(struct wd *w, uint8_t *id, size_t *len);
/* RegisterReply: join the group's communicator (tp > 1) and hand it to the model. Returns 0, or
 * -errno (logged; register again), or -EIO when the model cannot go on (fatal). */
int wd_gpu_join(struct wd *w, const uint8_t *id, size_t len);
/* Out of the group: the communicator aborted (the model keeps no request state). */
void wd_gpu_leave(struct wd *w);
/* True when this epoch's communicator failed (a peer died): steps fail until a Reset. */
bool wd_gpu_broken(const struct wd *w);
/* True when the model failed for good (-EIO): the worker exits 1 and is restarted. */
bool wd_gpu_dead(const struct wd *w);
/* Runs the rows of a plan (out[] initialized); sets *ret_error and msg when the step failed. */
void wd_gpu_run_rows(struct wd *w, const Bdfp4__StepPlan *plan, struct wd_row_out *out,
		     Bdfp4__ServeError *ret_error, char *msg, size_t cap);
/* Logs the decode-step timing since the last report (SIGUSR1, exit) and starts over. */
void wd_gpu_report(struct wd *w);
/* A plan of n_rows rows run and its StepResult sent, us µs after wd_run_plan's entry (the
 * plan's wall time on the worker, for the timing report). No-op without a cuda backend. */
void wd_gpu_note_plan(struct wd *w, size_t n_rows, double us);

#endif
