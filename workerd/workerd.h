/* workerd.h — the tensor-parallel worker daemon's context, shared by its files (issue 5).
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

#include "bd_allreduce.h"
#include "bd_model.h"
#include "bd_pool.h"
#include "bd_sampler.h"
#include "serve.pb-c.h"

#define WD_PROTO_VERSION 1
#define WD_MAX_FRAME (64u << 20)        /* router frames beyond this are refused */
#define WD_AR_CAP (1u << 16)            /* floats per all-reduce round */
#define WD_JOIN_TIMEOUT_MS 10000
#define WD_DEFAULT_HEARTBEAT_MS 250
#define WD_IO_ENDPOINT_FMT "inproc://workerd-io-%p"

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
};

struct wd {
	struct wd_opts o;
	struct bd_model *model;
	char model_name[256]; /* base name, as registered */
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
	struct wd_seq *seqs;
	float *logits; /* [V], rank 0 */

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
/* Runs one plan and sends the StepResult. Never fails: errors go into the result. */
void wd_run_plan(struct wd *w, const Bdfp4__StepPlan *plan);
/* Drops every sequence (Reset, a new epoch, exit). */
void wd_drop_all(struct wd *w);

/* main.c */
void wd_log(int prio, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define wd_err(...) wd_log(3, __VA_ARGS__)
#define wd_warn(...) wd_log(4, __VA_ARGS__)
#define wd_info(...) wd_log(6, __VA_ARGS__)
#define wd_debug(...) wd_log(7, __VA_ARGS__)
int64_t wd_now_ms(void);

#endif
