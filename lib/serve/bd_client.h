/* bd_client.h — the C client of the router: generate, stream, cancel, health, info.
 *
 * One client is one ZeroMQ DEALER connection to the router's frontend (proto/serve.proto's
 * ClientRequest / ClientReply). A connection may carry several generations at once: each has a
 * tag (non-zero, chosen here, unique on the connection) that names it in every event.
 * Generation is asynchronous: bd_client_generate_start() sends the request, bd_client_next()
 * returns the router's replies one at a time (streamed chunks, the final chunk, errors, cancel
 * acknowledgements). The router sends a keepalive to a connection with live requests when it
 * has been quiet for a second, so a bd_client_next() that hears nothing for timeout_ms means
 * the router is gone (-ETIMEDOUT). Closing the client (bd_client_free) is a disconnect: the
 * router cancels the connection's requests and releases what they held.
 *
 * Errors: -errno. -EINVAL bad argument, -ENOMEM, -EMSGSIZE a request over the size limits of
 * serve.proto, -ETIMEDOUT nothing from the router in time, -EBADMSG a reply that does not
 * decode, or the -errno of ZeroMQ. The router's own errors come back as events (error field
 * with a BD_SERVE_* code and a message), not as return values. Not thread-safe: one client per
 * thread.
 */
#ifndef BD_CLIENT_H
#define BD_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model/bd_sampler.h"

#ifdef __cplusplus
extern "C" {
#endif

#define BD_CLIENT_DEFAULT_ENDPOINT "tcp://127.0.0.1:5555"
#define BD_CLIENT_MAX_STOPS 8
#define BD_CLIENT_MAX_TOP 64
#define BD_CLIENT_MAX_TOP_LOGPROBS 20

/* serve.proto's ServeError codes, for callers that do not include the generated code. */
enum bd_serve_error {
	BD_SERVE_OK = 0,
	BD_SERVE_ERR_MALFORMED = 1,
	BD_SERVE_ERR_OVERSIZE = 2,
	BD_SERVE_ERR_UNKNOWN_TYPE = 3,
	BD_SERVE_ERR_INVALID_ARGUMENT = 4,
	BD_SERVE_ERR_TOO_LONG = 5,
	BD_SERVE_ERR_UNKNOWN_KV_CONFIG = 6,
	BD_SERVE_ERR_RESOURCE_EXHAUSTED = 7,
	BD_SERVE_ERR_UNAVAILABLE = 8,
	BD_SERVE_ERR_WORKER_FAILED = 9,
	BD_SERVE_ERR_DEADLINE_EXCEEDED = 10,
	BD_SERVE_ERR_CANCELLED = 11,
	BD_SERVE_ERR_NOT_FOUND = 12,
	BD_SERVE_ERR_SHUTTING_DOWN = 13,
	BD_SERVE_ERR_INTERNAL = 14,
	BD_SERVE_ERR_VERSION = 15,
	BD_SERVE_ERR_COUNT
};

/* A short lower-case name of a ServeError code ("ok", "invalid-argument", ...; "unknown"). */
const char *bd_serve_error_name(int code);

/* serve.proto's FinishReason. */
enum bd_finish {
	BD_FINISH_NONE = 0,
	BD_FINISH_STOP = 1,
	BD_FINISH_LENGTH = 2,
	BD_FINISH_STOP_STRING = 3,
	BD_FINISH_CANCELLED = 4,
	BD_FINISH_ERROR = 5,
};

/* "none", "stop", "length", "stop-string", "cancelled", "error" ("unknown" otherwise). */
const char *bd_finish_name(int reason);

struct bd_client;

/* Connects to the router at endpoint (NULL: BD_CLIENT_DEFAULT_ENDPOINT), with the security of
 * the environment (bd_client_new_opts). ZeroMQ connects lazily, so a router that is not up yet
 * shows only as a timeout later; an ipc:// socket that this process may not connect to (its
 * file mode or directory) is refused here at once.
 * Returns 0 and *ret, -EINVAL, -ENOMEM, -EACCES (permission denied on the ipc:// socket), or
 * the -errno of ZeroMQ (a malformed endpoint). */
int bd_client_new(const char *endpoint, struct bd_client **ret);

/* The security of a connection: CURVE (base/bd_zsec.h) when both files are set, plain when
 * neither is. The environment fills what the caller leaves NULL: BDFP4_SERVER_KEY (the
 * router's public key file), BDFP4_SECRET_KEY (this client's secret key file). */
struct bd_client_opts {
	const char *server_key_file;
	const char *secret_key_file;
};

/* bd_client_new with options (o NULL: the environment's only). Every call on the client then
 * fails fast when the security handshake does: -EACCES when the router's ZAP handler refuses
 * this client's key (not in its allow-list), -EPROTO when the two sides disagree on CURVE (a
 * plain client at a CURVE router, the wrong server key); bd_client_error says which. Returns
 * 0 and *ret, the errors of bd_client_new, or those of loading the key files (err[cap], may be
 * NULL, says why). */
int bd_client_new_opts(const char *endpoint, const struct bd_client_opts *o,
		       struct bd_client **ret, char *err, size_t cap);

/* The message of the last failed handshake ("" when none). */
const char *bd_client_error(const struct bd_client *c);

/* Closes the connection without waiting (the router cancels its live requests). NULL is
 * accepted. */
void bd_client_free(struct bd_client *c);

struct bd_client_msg {
	const char *role, *content; /* NUL-terminated UTF-8 */
};

/* One generation. Exactly one of prompt (raw text, no template), messages (chat, rendered with
 * the model's template), token_ids must be set. Zero values are the server's defaults except
 * max_tokens, which must be ≥ 1. */
struct bd_client_gen {
	const char *prompt;
	bool chat;                         /* wrap prompt in the chat template as one user turn */
	const struct bd_client_msg *messages;
	size_t n_messages;
	const int32_t *token_ids;
	size_t n_token_ids;
	uint32_t max_tokens;
	struct bd_sampler_params sampling; /* zero: greedy (seed 0: the router picks one) */
	const char *const *stops;          /* [n_stops] ≤ BD_CLIENT_MAX_STOPS */
	int n_stops;
	bool stream;                       /* chunk per token (else one final event) */
	const char *kv_config;             /* NULL: the server's */
	uint32_t deadline_ms;              /* 0: the server's */
	bool ignore_eos;
	const int32_t *forced_tokens;      /* teacher forcing: [n_forced] ≤ max_tokens */
	size_t n_forced;
	uint32_t logits_top_k;             /* ≤ BD_CLIENT_MAX_TOP */
	/* log-probabilities of each generated token and of its step's top_logprobs most likely
	 * tokens: the log-softmax of the raw logits (bd_sampler_logprobs); top_logprobs needs
	 * logprobs. Both backends serve them. */
	bool logprobs;
	uint32_t top_logprobs;             /* ≤ BD_CLIENT_MAX_TOP_LOGPROBS */
	const char *cache_salt;            /* prefix caching: share cached pages only with
					    * requests of this salt (NULL or "": unsalted) */
};

/* Sends a generation request. Returns 0 and its tag in *ret_tag, -EINVAL (no prompt, several
 * of prompt/messages/token_ids, NULL strings), -EMSGSIZE, -ENOMEM, or a ZeroMQ -errno. */
int bd_client_generate_start(struct bd_client *c, const struct bd_client_gen *g,
			     uint64_t *ret_tag);

/* Asks the router to cancel generation `tag`; the request then ends with a final chunk
 * (BD_FINISH_CANCELLED) and a cancel acknowledgement event. Returns 0 or -errno. */
int bd_client_cancel(struct bd_client *c, uint64_t tag);

enum bd_client_event_kind {
	BD_CLIENT_CHUNK = 1,   /* tokens of a generation; final when finish != BD_FINISH_NONE */
	BD_CLIENT_ERROR = 2,   /* the router refused a request (tag, or 0: an unreadable frame) */
	BD_CLIENT_CANCELLED = 3, /* acknowledgement of bd_client_cancel (error: OK or NOT_FOUND) */
	BD_CLIENT_OTHER = 4,   /* health or info reply (use the synchronous calls for those) */
};

struct bd_client_usage {
	uint32_t prompt_tokens, completion_tokens, preemptions;
	uint64_t queue_us, ttft_us, total_us; /* from the request's arrival at the router */
};

struct bd_client_top {
	int32_t token;
	float logit;
};

/* A token's log-probability (natural log, ≤ 0; -inf: ruled out) and its bytes (piece[len],
 * not NUL-terminated; may be part of a UTF-8 sequence; empty without a tokenizer). */
struct bd_client_logprob {
	int32_t token;
	float logprob;
	const char *piece;
	size_t piece_len;
};

/* One event. Every pointer is owned by the client and valid until the next call on it. */
struct bd_client_event {
	enum bd_client_event_kind kind;
	uint64_t tag;
	uint64_t request_id;       /* the router's id */
	const int32_t *tokens;     /* [n_tokens] the tokens of this chunk (all, if not streaming) */
	size_t n_tokens;
	const char *text;          /* [text_len] UTF-8 of those tokens, NUL-terminated */
	size_t text_len;
	enum bd_finish finish;
	int error;                 /* enum bd_serve_error */
	const char *message;       /* the router's text ("" when none) */
	bool has_usage;            /* final chunks */
	struct bd_client_usage usage;
	const struct bd_client_top *top; /* [n_tokens][top_k] when logits_top_k was asked */
	size_t top_k;
	/* logprobs: [n_tokens][1 + n_top_logprobs], per token the sampled one, then the most
	 * likely first (token -1: fewer were reported); NULL when not asked */
	const struct bd_client_logprob *logprobs;
	size_t n_top_logprobs;
};

/* Waits up to timeout_ms (≥ 0) for the next event (keepalives are skipped but restart the
 * wait). Returns 0 and *ret, -ETIMEDOUT, -EBADMSG (a frame that is not a ClientReply), or a
 * ZeroMQ -errno. */
int bd_client_next(struct bd_client *c, int timeout_ms, struct bd_client_event *ret);

struct bd_client_worker {
	int rank, pid;
	bool alive;
	uint64_t last_heartbeat_ms, steps;
};

struct bd_client_health {
	bool healthy;
	int state;                 /* serve.proto ServingState: 0 starting, 1 serving, 2 degraded,
				    * 3 stopping */
	char reason[512];
	size_t n_workers;
	struct bd_client_worker workers[8];
	bool pool_ok;              /* kvpoold answers the router (false: requests get unavailable) */
	char pool_error[256];      /* why the router takes kvpoold as down, "" while pool_ok */
	uint64_t pool_last_ok_ms;  /* since kvpoold last answered the router */
};

/* Health of the router (synchronous; events of live generations that arrive meanwhile are
 * dropped, so use a client without any). Returns 0, -ETIMEDOUT, -EBADMSG, -errno. */
int bd_client_health(struct bd_client *c, int timeout_ms, struct bd_client_health *ret);

struct bd_client_info {
	char version[32], model[128], arch[16], kv_config[32], backend[8];
	uint32_t n_vocab, n_ctx, tp, max_batch, max_queue, max_frame_bytes, queued, running;
	uint64_t requests_total, requests_failed, tokens_generated, steps, preemptions;
	uint64_t pages_total, pages_free, slots_total, slots_free, pages_peak, uptime_ms;
	bool healthy;
	char decode_kernel[1024]; /* the ranks' decode kernel families and why ("" on the cpu) */
};

/* Server info (synchronous, as bd_client_health). */
int bd_client_info(struct bd_client *c, int timeout_ms, struct bd_client_info *ret);

/* Sends one raw frame (tests: malformed and oversize input). Returns 0 or -errno. */
int bd_client_send_raw(struct bd_client *c, const void *frame, size_t len);

#ifdef __cplusplus
}
#endif
#endif
