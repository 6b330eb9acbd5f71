/* router.h — what routerd is made of, behind its main (DESIGN.md "router").
 *
 *   main.c      configuration, sockets, the event loop (zmq_poll + timers), signals, sd_notify
 *   frontend.c  the client API: frames in, validation, tokenization, replies and chunks out
 *   sched.c     request life cycle, admission against the pool, continuous batching, step plans
 *               and their results, preemption by recompute
 *   workers.c   worker registration, heartbeats, the worker group and its failure
 *
 * One context (struct bd_router) is passed everywhere; nothing is global. The loop is single-
 * threaded: pool calls are blocking round trips on an ipc:// socket, bounded by a timeout; so
 * that a dead kvpoold costs that timeout once and not once per call, pool.c watches the pool
 * (a non-blocking probe and the connection's events) and, while it is down, pool calls fail at
 * once (POOL_CALL) and new requests get UNAVAILABLE.
 *
 * Stopping (SIGTERM/SIGINT): the router drains: new requests get SHUTTING_DOWN, the running
 * and queued ones are stepped to their end for up to drain_timeout_ms; then what is left fails
 * with SHUTTING_DOWN, the workers get Shutdown, the pool records are released, exit 0.
 *
 * Request life cycle: QUEUED (accepted, holds nothing) → RUNNING (holds a slot and pages in the
 * pool; prefill in its first step, then one decode row per step) → finished, cancelled or
 * failed (everything it held released, final chunk sent, record freed). A request in the step
 * in flight is finished only when that step's results are in, so that no worker is still
 * writing pages the pool has handed to someone else.
 */
#ifndef BD_ROUTER_H
#define BD_ROUTER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/bd_clock.h"
#include "base/bd_log.h"
#include "pool/bd_pool_client.h"
#include "model/bd_sampler.h"
#include "model/bd_tokenizer.h"
#include "serve.pb-c.h"

#define BD_ROUTER_VERSION "0.5.0"
#define BD_SERVE_PROTO_VERSION 1
#define BD_ROUTER_MAX_TP 8
#define BD_ROUTER_MAX_STOPS 8
#define BD_ROUTER_MAX_STOP_BYTES 64
#define BD_ROUTER_MAX_PROMPT_BYTES (64 << 10)
#define BD_ROUTER_MAX_MESSAGES 64
#define BD_ROUTER_MAX_TOP 64
#define BD_ROUTER_MAX_ENDPOINTS 8
#define BD_ROUTER_WORKER_MAX_FRAME (64 << 20)

enum bd_router_state { RS_STARTING = 0, RS_SERVING = 1, RS_DEGRADED = 2, RS_STOPPING = 3 };

enum bd_req_state { RQ_QUEUED, RQ_RUNNING };

struct bd_router_opts {
	char *frontends[BD_ROUTER_MAX_ENDPOINTS];
	int n_frontends;
	const char *workers, *pool, *model, *kv_config;
	const char *random_weights; /* a bd_model_preset name, or "": model is a GGUF */
	int tp;
	int max_batch, max_queue, max_frame, max_prefill_tokens;
	int deadline_ms, heartbeat_ms, heartbeat_timeout_ms, step_timeout_ms, keepalive_ms;
	int pool_timeout_ms, pool_wait_ms, pool_probe_ms, status_ms;
	int drain_timeout_ms; /* 0: stop at once */
	uint64_t owner;
};

struct bd_req {
	uint64_t id;        /* the router's id, also the pool's request id */
	uint64_t order;     /* admission priority: arrival order, kept across preemption */
	uint64_t tag;       /* the client's */
	uint8_t ident[256]; /* the client's ZeroMQ routing id */
	size_t ident_len;
	bool delim;         /* a REQ client: replies carry an empty delimiter frame */
	enum bd_req_state state;

	int32_t *toks;      /* [cap] prompt then generated tokens */
	int n_prompt, n_gen, cap, max_tokens;
	int n_pos;          /* tokens the workers hold (0: needs a prefill) */

	int32_t slot;       /* -1: none */
	int32_t *pages;     /* [max_pages] promoted pages in order */
	int n_pages, max_pages;
	int32_t reserved;   /* the page reserved for the next promotion, -1: none */
	bool pool_held;     /* the pool has a record for it */
	bool on_workers;    /* workers hold a sequence for it */
	bool in_step;

	const char *kv_config; /* static name (bd_kvcfg) */
	Bdfp4__SamplingParams sampling;
	char *stops[BD_ROUTER_MAX_STOPS];
	int n_stops;
	bool stream, ignore_eos;
	int32_t *forced;
	int n_forced;
	uint32_t top_k;

	/* output: text so far (stop strings are matched on it), how much was sent */
	struct bd_tok_stream ts;
	char *text;
	size_t len, cap_text, shown, shown_sent;
	int n_sent;                 /* tokens already sent in chunks */
	Bdfp4__TopLogit *top;       /* [cap - n_prompt][top_k] logits of each generated token */

	int64_t t_arrival, t_admit, t_first, deadline, last_sent; /* ms, monotonic */
	uint32_t preemptions;

	/* a finish decided while in the step in flight */
	bool finish_pending, fin_notify;
	int fin_reason, fin_error;
	char fin_msg[256];
};

struct bd_worker {
	bool connected;      /* a registered identity we hear from */
	bool registered;     /* sent RegisterRequest for the forming epoch */
	uint8_t ident[256];
	size_t ident_len;
	int pid, device;
	int64_t last_seen;
	uint64_t steps;
	char backend[8];
	uint8_t nccl_id[128];
	size_t nccl_len;
};

struct bd_step_row {
	struct bd_req *r;
	bool prefill;
	int n_feed;         /* tokens fed (positions r->n_pos ..) */
	int32_t new_page;   /* decode: the reserved page promoted into, -1: none */
};

struct bd_step {
	bool active;
	uint64_t id;
	int64_t started, deadline;
	struct bd_step_row *rows;
	int n_rows;
	Bdfp4__StepResult *res[BD_ROUTER_MAX_TP];
	int n_res;
};

struct bd_router {
	int n_front_bound;    /* frontends bound by this process (their ipc files are ours) */
	bool workers_bound;
	struct bd_router_opts o;
	struct bd_config *cfg;

	/* model */
	struct bd_tokenizer *tok;   /* NULL for a random-weights model: token ids only */
	char model_name[128], arch[16];
	int n_vocab, n_ctx, n_layers;
	bool *eog;                  /* [n_vocab] */
	char *piece;                /* [piece_cap] one streamed token's text */
	size_t piece_cap;

	/* pool */
	struct bd_pool_conn *pool;
	char kv_config[32], page_format[16], backend[8];
	uint64_t pages_total, slots_total, pages_free, slots_free;
	uint64_t pages_held, pages_peak; /* by this router, now and at most */

	/* pool health (pool.c): down after a call without an answer (timeout, connection gone);
	 * back when a probe is answered */
	bool pool_ok;
	bool pool_went_down;        /* noted inside a call; the loop fails the requests */
	bool pool_reclaim;          /* records may be left behind: reclaim before serving again */
	char pool_err[256];         /* why it is down ("" while up) */
	int64_t pool_last_ok, pool_down_since; /* ms, monotonic */
	uint64_t pool_failures;     /* calls and probes unanswered since the last answer */
	void *probe, *probe_mon;    /* DEALER to the pool's endpoint, its event monitor */
	bool probe_out;             /* a probe waits for its answer */
	int64_t probe_sent, next_probe;

	/* sockets */
	void *zctx, *front, *wsock;
	int sig_fd;

	/* requests, by arrival */
	struct bd_req **reqs;
	size_t n_reqs, cap_reqs;
	uint64_t next_id, next_order;
	size_t n_queued, n_running;
	uint64_t *release;          /* request ids the workers drop in the next plan */
	size_t n_release, cap_release;

	/* workers */
	enum bd_router_state state;
	char reason[256];
	char health_reason[600];    /* what HealthReply says (built by bd_router_fill_health) */
	struct bd_worker w[BD_ROUTER_MAX_TP];
	uint64_t epoch;
	bool group_ready;
	struct bd_step step;
	uint64_t next_step;

	/* counters */
	uint64_t requests_total, requests_failed, tokens_generated, steps_done, preemptions;
	int64_t t_start;

	uint64_t watchdog_usec;
	int64_t next_status, next_watchdog, next_heartbeat, next_tick;
	bool draining;              /* SIGTERM seen: finishing what was accepted */
	int64_t drain_start, drain_end;
	bool stop;
};

/* ---- frontend.c ---- */
/* Reads every pending frontend frame and answers it. */
void bd_router_on_frontend(struct bd_router *rt);
/* Sends a chunk of r's new tokens (final: with finish reason and usage). Returns 0, or
 * -EHOSTUNREACH when the client is gone (the caller cancels its requests). */
int bd_router_send_chunk(struct bd_router *rt, struct bd_req *r, int finish, int error,
			 const char *msg);
/* Keepalives to clients with live requests that heard nothing for keepalive_ms. */
void bd_router_keepalive(struct bd_router *rt, int64_t now);
/* The client with this routing id is gone: its requests end without a reply. */
void bd_router_client_gone(struct bd_router *rt, const uint8_t *ident, size_t len);
/* Fills the ServerInfo / HealthReply of the current state (strings borrowed from rt). */
void bd_router_fill_health(struct bd_router *rt, Bdfp4__HealthReply *h,
			   Bdfp4__WorkerStatus *ws, Bdfp4__WorkerStatus **pws);

/* ---- sched.c ---- */
/* Appends a new QUEUED request (takes ownership of r). Returns 0 or -ENOMEM. */
int bd_router_add(struct bd_router *rt, struct bd_req *r);
void bd_req_free(struct bd_req *r);
struct bd_req *bd_router_find(struct bd_router *rt, const uint8_t *ident, size_t len,
			      uint64_t tag);
/* Ends a request: releases what it holds, sends the final chunk when notify, frees it. A
 * request in the step in flight is marked and ended when the step completes. */
void bd_router_finish(struct bd_router *rt, struct bd_req *r, int reason, int error,
		      const char *msg, bool notify);
/* Plans and sends the next step when the group is ready and no step is in flight. */
void bd_router_schedule(struct bd_router *rt);
/* A StepResult from a rank (takes ownership of res). */
void bd_router_on_result(struct bd_router *rt, int rank, Bdfp4__StepResult *res);
/* The step in flight is lost (a worker failed): its requests fail with msg. */
void bd_router_abort_step(struct bd_router *rt, const char *msg);
/* Fails every RUNNING request with (error, msg), releasing their pool records. */
void bd_router_fail_running(struct bd_router *rt, int error, const char *msg);
/* Deadlines of queued and running requests. */
void bd_router_deadlines(struct bd_router *rt, int64_t now);
/* Refreshes pages/slots free from the pool; 0 or -errno (-EHOSTDOWN while it is down). */
int bd_router_pool_refresh(struct bd_router *rt);

/* ---- pool.c ---- */
/* The probe socket and its monitor (after rt->zctx); 0 or -errno. */
int bd_router_pool_open(struct bd_router *rt);
void bd_router_pool_close(struct bd_router *rt);
/* Records the outcome e of a blocking pool call: an answer (0 or the daemon's refusal) keeps or
 * makes the pool up; no answer (timeout, connection error) marks it down. Returns e. */
int bd_router_pool_note(struct bd_router *rt, int e);
/* Probe answers and connection events (the probe and monitor sockets are readable). */
void bd_router_pool_on_probe(struct bd_router *rt);
/* Sends probes, times them out, and acts on the pool going down (the requests fail with
 * UNAVAILABLE) or coming back (stale records reclaimed, serving resumes). */
void bd_router_pool_tick(struct bd_router *rt, int64_t now);
/* "kvpoold unreachable: WHY (for N ms)" into buf while the pool is down, "" while up. */
void bd_router_pool_reason(const struct bd_router *rt, char *buf, size_t cap);

/* A blocking pool call through the health gate: -EHOSTDOWN at once while the pool is down,
 * else the call, its outcome recorded. */
#define POOL_CALL(rt, call) ((rt)->pool_ok ? bd_router_pool_note((rt), (call)) : -EHOSTDOWN)

/* ---- workers.c ---- */
void bd_router_on_workers(struct bd_router *rt);
/* Heartbeats out, heartbeat timeouts in, step timeout. */
void bd_router_workers_tick(struct bd_router *rt, int64_t now);
/* Sends a RouterMessage to rank; -EHOSTUNREACH when that worker is gone. */
int bd_router_send_worker(struct bd_router *rt, int rank, const Bdfp4__RouterMessage *m);
/* The group is broken (a rank is gone or failed): fails running requests with msg, resets
 * the other ranks. */
void bd_router_group_fail(struct bd_router *rt, int dead_rank, const char *msg);
/* Tells every connected worker that the router stops. */
void bd_router_workers_shutdown(struct bd_router *rt);

#endif
