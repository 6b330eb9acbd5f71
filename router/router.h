/* router.h — what routerd is made of, behind its main (DESIGN.md "router").
 *
 *   main.c      configuration (the daemon skeleton), sockets, the event loop, the drain; it
 *               carries out the scheduler's actions (chunks to frontend.c, plans to workers.c)
 *   sched.c     the scheduler (sched.h): requests, admission, batching, plans and results,
 *               preemption, deadlines; no I/O
 *   frontend.c  the client API: frames in, validation, tokenization, replies and chunks out
 *   workers.c   worker registration, heartbeats, the group, the results of a step
 *   pool.c      kvpoold's health and the scheduler's pool interface over it
 *   wire.c      the ZeroMQ plumbing the sockets share
 *   http.c      the HTTP front door (http.h): the OpenAI API, /health, /metrics, in threads
 *               that reach the loop only as inproc clients of the frontend
 *   metrics.c   the Prometheus metrics and the access log (metrics.h)
 *
 * Calls go one way: main.c calls everyone; frontend.c and workers.c hand their events to the
 * scheduler, which calls none of them (its pool is an injected interface); frontend.c asks
 * pool.c for the pool's state; wire.c calls nobody. One context (struct bd_router) holds it
 * all; nothing is global. The loop is single-threaded: pool calls are blocking round trips on
 * an ipc:// socket, bounded by a timeout; so that a dead kvpoold costs that timeout once and not
 * once per call, pool.c watches the pool (a non-blocking probe and the connection's events) and,
 * while it is down, new requests get UNAVAILABLE, nothing is planned and the running requests
 * wait for it (pool_wait_ms: a restart on its stored arenas lets them go on); past that wait,
 * pool calls fail at once (POOL_CALL).
 *
 * Stopping (SIGTERM/SIGINT): the router drains: new requests get SHUTTING_DOWN, the running
 * and queued ones are stepped to their end for up to drain_timeout_ms; then what is left fails
 * with SHUTTING_DOWN, the workers get Shutdown, the pool records are released, exit 0.
 */
#ifndef BD_ROUTER_H
#define BD_ROUTER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <protobuf-c/protobuf-c.h>
#include <zmq.h>

#include "base/bd_clock.h"
#include "base/bd_daemon.h"
#include "base/bd_log.h"
#include "base/bd_zsec.h"
#include "pool/bd_pool_client.h"
#include "model/bd_tokenizer.h"
#include "sched.h"
#include "serve.pb-c.h"

#define BD_ROUTER_VERSION "0.5.0"
#define BD_SERVE_PROTO_VERSION 1
#define BD_ROUTER_MAX_TP 8
#define BD_ROUTER_MAX_STOP_BYTES 64
#define BD_ROUTER_MAX_PROMPT_BYTES (64 << 10)
#define BD_ROUTER_MAX_MESSAGES 64
#define BD_ROUTER_MAX_TOP 64
#define BD_ROUTER_MAX_ENDPOINTS 8
#define BD_ROUTER_WORKER_MAX_FRAME (64 << 20)

enum bd_router_state { RS_STARTING = 0, RS_SERVING = 1, RS_DEGRADED = 2, RS_STOPPING = 3 };

struct bd_router_opts {
	char *frontends[BD_ROUTER_MAX_ENDPOINTS];
	int n_frontends;
	const char *workers, *pool, *model, *kv_config;
	const char *http;     /* HTTP listen address (http.h), "" for none */
	const char *random_weights; /* a bd_model_preset name, or "": model is a GGUF */
	int tp;
	/* the scheduler's limits and policies as configured (max_batch, max_queue,
	 * max_prefill_tokens, max_prefill_chunk, batch_invariant, resume_timeout_ms,
	 * prefix_cache); the model's part (n_vocab, eog, tok) is set at start */
	struct bd_sched_cfg sched;
	int max_frame;
	int deadline_ms, heartbeat_ms, heartbeat_timeout_ms, step_timeout_ms, keepalive_ms;
	int pool_timeout_ms, pool_wait_ms, pool_probe_ms, status_ms;
	int drain_timeout_ms; /* 0: stop at once */
	int socket_mode;      /* file mode of the ipc:// endpoints, set after bind */
	uint64_t owner;
	/* CURVE (base/bd_zsec.h): the router's secret key file, the allow-lists of the client
	 * and worker sockets (both sockets become CURVE servers when their list is set), and
	 * whether plain TCP off loopback is allowed */
	const char *curve_secret_key, *curve_clients, *curve_workers;
	const char *pool_server_key; /* kvpoold's public key: the pool connections speak CURVE */
	bool insecure_tcp;
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
	char decode_kernel[256]; /* RegisterRequest.decode_kernel ("" on the cpu backend) */
	bool whole_prompts;  /* RegisterRequest.whole_prompts: no prefill chunk at position > 0 */
	uint32_t max_prefill; /* RegisterRequest.max_prefill: longest prefill row (0: no bound) */
	uint8_t nccl_id[128];
	size_t nccl_len;
	uint64_t calib_id;   /* the first 8 bytes of RegisterRequest.calib_sha256, 0: none */
};

/* The step in flight as the ranks see it: sent, its answers gathered (workers.c). */
struct bd_router_step {
	bool active;
	uint64_t epoch, id;
	int64_t deadline;
	Bdfp4__StepResult *res[BD_ROUTER_MAX_TP];
	int n_res;
};

struct bd_router {
	struct bd_daemon d;
	struct bd_router_opts o;
	int n_front_bound;    /* frontends bound by this process (their ipc files are ours) */
	bool workers_bound;

	/* model */
	struct bd_tokenizer *tok;   /* NULL for a random-weights model: token ids only */
	char model_name[128], arch[16];
	int n_vocab, n_ctx, n_layers;
	bool *eog;                  /* [n_vocab] */

	/* pool */
	struct bd_pool_conn *pool;
	char kv_config[32], page_format[16], backend[8];
	uint64_t pages_total, slots_total, pages_free, slots_free;
	uint64_t pages_cached, prefix_evictions; /* kvpoold's prefix index (stats) */

	/* pool health (pool.c): down after a call without an answer (timeout, connection gone);
	 * back when a probe is answered */
	bool pool_ok;
	bool pool_waiting;          /* down, and the running requests wait for it (pool_wait_ms) */
	bool pool_lost;             /* their KV is gone or the wait ran out: the tick fails them */
	bool pool_arena_known;
	uint8_t pool_arena_id[16];  /* the pool's arenas (stats): a restart that kept them keeps it */
	bool pool_reclaim;          /* records may be left behind: reclaim before serving again */
	uint64_t pool_unreleased[64]; /* ended requests whose release got no answer: sent again */
	size_t n_pool_unreleased;
	char pool_err[256];         /* why it is down ("" while up) */
	int64_t pool_last_ok, pool_down_since; /* ms, monotonic */
	uint64_t pool_failures;     /* calls and probes unanswered since the last answer */
	void *probe, *probe_mon;    /* DEALER to the pool's endpoint, its event monitor */
	bool probe_out;             /* a probe waits for its answer */
	int64_t probe_sent, next_probe;

	/* sockets */
	void *zctx, *front, *wsock;
	struct bd_zsec_zap *zap;    /* the ZAP handler while a socket is a CURVE server */

	struct bd_sched sched;

	struct bd_http *http;                /* http.c: the HTTP front door, NULL when off */
	struct bd_router_metrics *metrics;   /* metrics.c: what /metrics shows */

	/* workers (workers.c) and the serving state */
	enum bd_router_state state;
	char reason[256];
	char health_reason[600];    /* what HealthReply says (built by bd_router_fill_health) */
	struct bd_worker w[BD_ROUTER_MAX_TP];
	uint64_t epoch;
	bool group_ready;
	/* the epoch's kvpoold attach tokens (rank r's at r · BD_POOL_TOKEN_BYTES), and whether
	 * the pool has them (pool.c registers them again when its group_epoch is another) */
	uint8_t tokens[BD_ROUTER_MAX_TP * BD_POOL_TOKEN_BYTES];
	bool group_in_pool;
	struct bd_router_step step;
	int64_t next_heartbeat;

	int64_t t_start, next_status;
	bool draining;              /* SIGTERM seen: finishing what was accepted */
	int64_t drain_start, drain_end;
	bool stop;
};

/* ---- frontend.c ---- */
/* Reads every pending frontend frame and answers it; new requests, cancels and gone clients go
 * to the scheduler. */
void bd_router_on_frontend(struct bd_router *rt);
/* Sends a chunk of r's new output (final: with finish reason, error, msg and usage). Returns 0,
 * -EHOSTUNREACH when the client is gone (the caller tells the scheduler), -ENOMEM. */
int bd_router_send_chunk(struct bd_router *rt, struct bd_req *r, int finish, int error,
			 const char *msg);
/* Keepalives to clients with live requests that heard nothing for keepalive_ms; a client
 * found gone is the scheduler's news. */
void bd_router_keepalive(struct bd_router *rt, int64_t now);
/* Fills the HealthReply of the current state (strings borrowed from rt). */
void bd_router_fill_health(struct bd_router *rt, Bdfp4__HealthReply *h,
			   Bdfp4__WorkerStatus *ws, Bdfp4__WorkerStatus **pws);

/* ---- pool.c ---- */
/* The scheduler's pool interface (ctx: the struct bd_router): kvpoold's calls of this router's
 * owner through the health gate. */
extern const struct bd_sched_pool_ops bd_router_pool_ops;
/* The probe socket and its monitor (after rt->zctx); 0 or -errno. */
int bd_router_pool_open(struct bd_router *rt);
void bd_router_pool_close(struct bd_router *rt);
/* Records the outcome e of a blocking pool call: an answer (0 or the daemon's refusal) keeps or
 * makes the pool up; no answer (timeout, connection error) marks it down. Returns e. */
int bd_router_pool_note(struct bd_router *rt, int e);
/* Probe answers and connection events (the probe and monitor sockets are readable). A pool
 * that answers again is taken back into service, after a reclaim of the records failed
 * requests may have left, once busy (bd_sched_pool_busy) is false. */
void bd_router_pool_on_probe(struct bd_router *rt, bool busy);
/* Sends probes and times them out. Returns true when the pool went down since the last call:
 * the accepted requests must fail (bd_sched_pool_down). */
bool bd_router_pool_tick(struct bd_router *rt, int64_t now);
/* "kvpoold unreachable: WHY (for N ms)" into buf while the pool is down, "" while up. */
void bd_router_pool_reason(const struct bd_router *rt, char *buf, size_t cap);
/* Refreshes pages/slots free from the pool; 0 or -errno (-EHOSTDOWN while it is down). */
int bd_router_pool_refresh(struct bd_router *rt);
/* Registers the group of rt->epoch (rt->tokens) with kvpoold: a blocking call through the
 * health gate. Returns 0 (rt->group_in_pool set) or -errno (logged; the probe tries again). */
int bd_router_pool_group(struct bd_router *rt);

/* A blocking pool call through the health gate: -EHOSTDOWN at once while the pool is down and
 * no longer waited for, else the call (repeated on a fresh connection until pool_timeout_ms when
 * its connection closes: a restarting kvpoold answers it), its outcome recorded. */
#define POOL_CALL(rt, call)                                                                \
	((rt)->pool_ok || (rt)->pool_waiting ? bd_router_pool_note((rt), (call)) : -EHOSTDOWN)

/* ---- workers.c ---- */
/* Reads every pending worker frame: registrations (a group forms: bd_sched_group_up),
 * heartbeats, results (a step every rank answered: bd_sched_step_done). */
void bd_router_on_workers(struct bd_router *rt);
/* Heartbeats out, heartbeat and step timeouts in. */
void bd_router_workers_tick(struct bd_router *rt, int64_t now);
/* Sends the plan to every rank; the step is in flight until every rank answered it or the
 * group fails. Returns 0, or -EHOSTUNREACH when a rank is gone (the group failed). */
int bd_router_send_plan(struct bd_router *rt, const Bdfp4__StepPlan *plan, int64_t now);
/* Tells every connected worker that the router stops. */
void bd_router_workers_shutdown(struct bd_router *rt);

/* ---- wire.c ---- */
/* A ROUTER socket of zctx for peers that send frames up to maxmsg bytes: no linger, large
 * queues, and ZMQ_ROUTER_MANDATORY so that a send to a gone peer fails instead of vanishing.
 * NULL on failure (zmq_errno). */
void *bd_router_socket(void *zctx, int64_t maxmsg);
/* Sends the frames [ident] [""] (when delim) [m packed] without waiting (an empty ident is the
 * empty delimiter a DEALER puts before a REP's request). Returns 0, -EHOSTUNREACH (the peer is
 * gone, or its queue is full), -ENOMEM. */
int bd_router_send(void *sock, const uint8_t *ident, size_t ident_len, bool delim,
		   const ProtobufCMessage *m);
/* Receives one whole message without waiting: its first max frames into parts (initialized
 * here), the others dropped. Returns the number of frames the message had (then the caller
 * closes parts with bd_router_frames_close), 0 when none was pending or the receive failed. */
int bd_router_recv(void *sock, zmq_msg_t *parts, int max);
/* Closes the frames bd_router_recv kept of an n-frame message. */
void bd_router_frames_close(zmq_msg_t *parts, int n, int max);

#endif
