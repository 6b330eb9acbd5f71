/* http.c — routerd's HTTP front door (http.h): libmicrohttpd, one thread per connection,
 * each request a GenerateRequest to the event loop over an inproc DEALER socket. */
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include <jansson.h>
#include <microhttpd.h>
#include <zmq.h>

#include "http.h"
#include "metrics.h"
#include "router.h"
#include "model/bd_utf8.h"
#include "serve/bd_wire.h"

#define INPROC_EP "inproc://bdfp4-http"
#define MAX_BODY (1 << 20)
#define POLL_MS 200          /* how often a waiting thread looks at its client and the stop */
#define LOOP_ANSWER_MS 5000  /* health: the loop answers within this or is taken as stuck */
#define TAG 1                /* one request per DEALER socket */
#define BD_HTTP_MAX_LOGPROBS 5  /* completions' logprobs: OpenAI's limit */
#define LOGPROB_FLOOR -9999.0   /* OpenAI's value for a token too unlikely to say (-inf) */

static const char EP_COMPL[] = "/v1/completions", EP_CHAT[] = "/v1/chat/completions",
		  EP_MODELS[] = "/v1/models", EP_HEALTH[] = "/health", EP_METRICS[] = "/metrics",
		  EP_OTHER[] = "other";

struct bd_http {
	struct MHD_Daemon *mhd;
	void *zctx;
	struct bd_router_metrics *metrics;
	char model[128];
	int n_ctx;
	long created;       /* start, Unix seconds: the model object's "created" */
	atomic_bool stopping;
};

/* A connection's request: its body, then what it is answered with. */
struct hreq {
	char *body;
	size_t len, cap;
	bool too_big;
};

/* A generation under way: its DEALER socket and what goes out next. */
struct gen {
	struct bd_http *h;
	void *sock;
	int fd;             /* the client's TCP socket, watched for its close */
	bool watch_fd;
	bool chat, stream, include_usage;
	bool logprobs;      /* the answer carries log-probabilities */
	bool finished, done_sent, cancelled;
	char id[48];
	long created;
	uint64_t request_id;
	int finish, error;
	uint32_t prompt_tokens, completion_tokens;
	char *text;         /* non-streaming: the whole text */
	size_t text_len;
	char *out;          /* streaming: the bytes not yet written */
	size_t out_len, out_off, out_cap;
	json_t *lp;         /* non-streaming, logprobs: the choice's logprobs so far */
	json_int_t offset;  /* completions: characters of the tokens so far (text_offset) */
};

/* ---- small helpers -------------------------------------------------------------------------- */

static enum MHD_Result queue_bytes(struct MHD_Connection *c, int status, const char *type,
				   const char *data, size_t len)
{
	struct MHD_Response *resp = MHD_create_response_from_buffer(len, (void *)data,
								      MHD_RESPMEM_MUST_COPY);
	enum MHD_Result ret;

	if (!resp)
		return MHD_NO;
	MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, type);
	ret = MHD_queue_response(c, (unsigned)status, resp);
	MHD_destroy_response(resp);
	return ret;
}

/* Answers j (taken) as JSON with status, counted under endpoint. */
static enum MHD_Result reply_json(struct bd_http *h, struct MHD_Connection *c,
				  const char *endpoint, int status, json_t *j)
{
	char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
	enum MHD_Result ret;

	json_decref(j);
	if (!s)
		return MHD_NO;
	bd_router_metrics_http(h->metrics, endpoint, status);
	ret = queue_bytes(c, status, "application/json", s, strlen(s));
	free(s);
	return ret;
}

static const char *error_type(int status)
{
	switch (status) {
	case 400: case 404: case 405: case 413:
		return "invalid_request_error";
	case 429:
		return "rate_limit_error";
	case 503:
		return "service_unavailable";
	default:
		return "server_error";
	}
}

static json_t *error_obj(int status, const char *code, const char *param, const char *msg)
{
	return json_pack("{s:{s:s, s:s, s:s?, s:s?}}", "error", "message", msg, "type",
			 error_type(status), "param", param, "code", code);
}

static enum MHD_Result reply_error(struct bd_http *h, struct MHD_Connection *c,
				   const char *endpoint, int status, const char *code,
				   const char *param, const char *fmt, ...)
	__attribute__((format(printf, 7, 8)));

static enum MHD_Result reply_error(struct bd_http *h, struct MHD_Connection *c,
				   const char *endpoint, int status, const char *code,
				   const char *param, const char *fmt, ...)
{
	char msg[512];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	return reply_json(h, c, endpoint, status, error_obj(status, code, param, msg));
}

/* The HTTP status and OpenAI code of a ServeError. */
static int serve_status(int err, const char **ret_code)
{
	switch (err) {
	case BDFP4__SERVE_ERROR__SERVE_ERR_TOO_LONG:
		*ret_code = "context_length_exceeded";
		return 413;
	case BDFP4__SERVE_ERROR__SERVE_ERR_OVERSIZE:
		*ret_code = "too_large";
		return 413;
	case BDFP4__SERVE_ERROR__SERVE_ERR_RESOURCE_EXHAUSTED:
		*ret_code = "rate_limit_exceeded";
		return 429;
	case BDFP4__SERVE_ERROR__SERVE_ERR_UNAVAILABLE:
	case BDFP4__SERVE_ERROR__SERVE_ERR_SHUTTING_DOWN:
		*ret_code = "unavailable";
		return 503;
	case BDFP4__SERVE_ERROR__SERVE_ERR_DEADLINE_EXCEEDED:
		*ret_code = "deadline_exceeded";
		return 504;
	case BDFP4__SERVE_ERROR__SERVE_ERR_WORKER_FAILED:
	case BDFP4__SERVE_ERROR__SERVE_ERR_INTERNAL:
	case BDFP4__SERVE_ERROR__SERVE_ERR_CANCELLED:
		*ret_code = "internal_error";
		return 500;
	default:
		*ret_code = "invalid_request";
		return 400;
	}
}

static const char *finish_name(int finish)
{
	switch (finish) {
	case BDFP4__FINISH_REASON__FINISH_LENGTH:
		return "length";
	case BDFP4__FINISH_REASON__FINISH_STOP:
	case BDFP4__FINISH_REASON__FINISH_STOP_STRING:
		return "stop";
	default:
		return "abort";
	}
}

/* ---- the event loop's side: one DEALER per request ------------------------------------------ */

static void *loop_socket(struct bd_http *h)
{
	void *s = zmq_socket(h->zctx, ZMQ_DEALER);
	int linger = 1000;

	if (!s)
		return NULL;
	/* a cancel sent right before the close still reaches the loop */
	zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof(linger));
	if (zmq_connect(s, INPROC_EP) < 0) {
		zmq_close(s);
		return NULL;
	}
	return s;
}

static int send_request(void *sock, Bdfp4__ClientRequest *req)
{
	return bd_wire_send(sock, NULL, 0, false, &req->base, ZMQ_DONTWAIT);
}

/* True when the client closed its connection (fd readable with nothing to read). */
static bool client_gone(struct gen *g)
{
	struct pollfd p = { .fd = g->fd, .events = POLLIN };
	char c;
	ssize_t n;

	if (!g->watch_fd || poll(&p, 1, 0) <= 0)
		return false;
	n = recv(g->fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
	if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR))
		return true;
	if (n > 0)
		g->watch_fd = false; /* a pipelined request: not ours to read, stop looking */
	return false;
}

/* The next reply of the loop on sock: 1 with *ret (free it), -EPIPE when the client left,
 * -ESHUTDOWN when the server stops, -ETIMEDOUT after timeout_ms (< 0: none), -EIO. */
static int wait_reply(struct bd_http *h, struct gen *g, void *sock, int timeout_ms,
		      Bdfp4__ClientReply **ret)
{
	int64_t end = bd_now_ms() + timeout_ms;

	for (;;) {
		zmq_pollitem_t it = { .socket = sock, .events = ZMQ_POLLIN };
		zmq_msg_t msg;
		int r;

		if (atomic_load(&h->stopping))
			return -ESHUTDOWN;
		if (g && client_gone(g))
			return -EPIPE;
		if (timeout_ms >= 0 && bd_now_ms() >= end)
			return -ETIMEDOUT;
		r = zmq_poll(&it, 1, POLL_MS);
		if (r < 0 && zmq_errno() != EINTR)
			return -EIO;
		if (r <= 0)
			continue;
		zmq_msg_init(&msg);
		if (zmq_msg_recv(&msg, sock, ZMQ_DONTWAIT) < 0) {
			zmq_msg_close(&msg);
			continue;
		}
		*ret = bdfp4__client_reply__unpack(NULL, zmq_msg_size(&msg), zmq_msg_data(&msg));
		while (zmq_msg_more(&msg)) { /* the reply is the last frame */
			if (*ret)
				bdfp4__client_reply__free_unpacked(*ret, NULL);
			zmq_msg_close(&msg);
			zmq_msg_init(&msg);
			if (zmq_msg_recv(&msg, sock, 0) < 0)
				break;
			*ret = bdfp4__client_reply__unpack(NULL, zmq_msg_size(&msg),
							   zmq_msg_data(&msg));
		}
		zmq_msg_close(&msg);
		if (*ret)
			return 1;
	}
}

#define CANCEL_WAIT_MS 2000 /* for the loop's answer to a cancel */

/* Cancels the request and waits (up to CANCEL_WAIT_MS) for the loop's answer, so that the
 * socket is still there when the loop handles it: a cancel that finds its client gone ends
 * the request without its final chunk, and so without its access log line. */
static void send_cancel(struct gen *g)
{
	Bdfp4__ClientRequest req = BDFP4__CLIENT_REQUEST__INIT;
	Bdfp4__CancelRequest cr = BDFP4__CANCEL_REQUEST__INIT;
	int64_t end = bd_now_ms() + CANCEL_WAIT_MS;

	if (g->finished || g->cancelled || !g->sock)
		return;
	cr.client_tag = TAG;
	req.msg_case = BDFP4__CLIENT_REQUEST__MSG_CANCEL;
	req.cancel = &cr;
	g->cancelled = true;
	bd_log_info("http %s: the client went away: cancelled", *g->id ? g->id : "request");
	if (send_request(g->sock, &req) < 0)
		return;
	while (bd_now_ms() < end) {
		Bdfp4__ClientReply *rep = NULL;
		bool answered;

		if (wait_reply(g->h, NULL, g->sock, (int)(end - bd_now_ms()), &rep) < 0)
			return;
		answered = rep->msg_case == BDFP4__CLIENT_REPLY__MSG_CANCEL ||
			   rep->msg_case == BDFP4__CLIENT_REPLY__MSG_ERROR ||
			   (rep->msg_case == BDFP4__CLIENT_REPLY__MSG_CHUNK &&
			    rep->chunk->finish_reason != BDFP4__FINISH_REASON__FINISH_NONE);
		bdfp4__client_reply__free_unpacked(rep, NULL);
		if (answered)
			return;
	}
}

static void gen_free(struct gen *g)
{
	if (!g)
		return;
	if (g->sock)
		zmq_close(g->sock);
	free(g->text);
	free(g->out);
	json_decref(g->lp);
	free(g);
}

/* ---- JSON in: the OpenAI request as a GenerateRequest ---------------------------------------- */

/* What a GenerateRequest built from JSON points at (strings borrowed from the JSON document). */
struct gen_parts {
	Bdfp4__GenerateRequest g;
	Bdfp4__SamplingParams sp;
	Bdfp4__ChatMessage msgs[BD_ROUTER_MAX_MESSAGES], *pmsgs[BD_ROUTER_MAX_MESSAGES];
	char *owned[BD_ROUTER_MAX_MESSAGES]; /* contents joined from parts */
	char *stops[BD_ROUTER_MAX_STOPS];
	int32_t *ids;
};

static void parts_free(struct gen_parts *p)
{
	for (int i = 0; i < BD_ROUTER_MAX_MESSAGES; i++)
		free(p->owned[i]);
	free(p->ids);
}

/* A message's content: a string, or an array of {"type": "text", "text": ...} parts joined. */
static int content_of(json_t *v, struct gen_parts *p, int i, char **ret, char *err, size_t cap)
{
	size_t k, n = 0;
	json_t *part;
	char *s;

	if (json_is_string(v)) {
		*ret = (char *)json_string_value(v);
		return 0;
	}
	if (json_is_null(v)) {
		*ret = (char *)"";
		return 0;
	}
	if (!json_is_array(v)) {
		snprintf(err, cap, "messages[%d].content must be a string or an array of text "
			 "parts", i);
		return -EINVAL;
	}
	json_array_foreach(v, k, part) {
		json_t *t = json_object_get(part, "text");

		if (!json_is_string(t) || strcmp(json_string_value(json_object_get(part, "type")) ?:
						 "", "text")) {
			snprintf(err, cap, "messages[%d].content[%zu]: only text parts are served",
				 i, k);
			return -EINVAL;
		}
		n += json_string_length(t);
	}
	s = malloc(n + 1);
	if (!s)
		return -ENOMEM;
	n = 0;
	json_array_foreach(v, k, part) {
		json_t *t = json_object_get(part, "text");

		memcpy(s + n, json_string_value(t), json_string_length(t));
		n += json_string_length(t);
	}
	s[n] = 0;
	p->owned[i] = s;
	*ret = s;
	return 0;
}

static int parse_messages(json_t *ms, struct gen_parts *p, char *err, size_t cap)
{
	size_t i;
	json_t *m;
	int e;

	if (!json_is_array(ms) || json_array_size(ms) == 0) {
		snprintf(err, cap, "messages must be a non-empty array");
		return -EINVAL;
	}
	if (json_array_size(ms) > BD_ROUTER_MAX_MESSAGES) {
		snprintf(err, cap, "at most %d messages", BD_ROUTER_MAX_MESSAGES);
		return -EINVAL;
	}
	json_array_foreach(ms, i, m) {
		const char *role = json_string_value(json_object_get(m, "role"));
		char *content;

		if (!role || (strcmp(role, "system") && strcmp(role, "user") &&
			      strcmp(role, "assistant") && strcmp(role, "developer"))) {
			snprintf(err, cap, "messages[%zu].role must be system, user or assistant",
				 i);
			return -EINVAL;
		}
		e = content_of(json_object_get(m, "content"), p, (int)i, &content, err, cap);
		if (e < 0)
			return e;
		bdfp4__chat_message__init(&p->msgs[i]);
		/* OpenAI's developer turn is the system turn of older models */
		p->msgs[i].role = (char *)(strcmp(role, "developer") ? role : "system");
		p->msgs[i].content = content;
		p->pmsgs[i] = &p->msgs[i];
	}
	p->g.n_messages = json_array_size(ms);
	p->g.messages = p->pmsgs;
	return 0;
}

static int parse_prompt(json_t *v, struct gen_parts *p, char *err, size_t cap)
{
	size_t i, n;
	json_t *t;

	if (json_is_array(v) && json_array_size(v) == 1 && json_is_string(json_array_get(v, 0)))
		v = json_array_get(v, 0);
	if (json_is_string(v)) {
		p->g.prompt = (char *)json_string_value(v);
		return 0;
	}
	if (!json_is_array(v) || (n = json_array_size(v)) == 0) {
		snprintf(err, cap, "prompt must be a string, an array of one string, or an array "
			 "of token ids");
		return -EINVAL;
	}
	p->ids = calloc(n, sizeof(*p->ids));
	if (!p->ids)
		return -ENOMEM;
	json_array_foreach(v, i, t) {
		json_int_t id = json_integer_value(t);

		if (!json_is_integer(t) || id < 0 || id > INT32_MAX) {
			snprintf(err, cap, "prompt: one prompt per request (n = 1), as a string or "
				 "token ids ≥ 0");
			return -EINVAL;
		}
		p->ids[i] = (int32_t)id;
	}
	p->g.n_token_ids = n;
	p->g.token_ids = p->ids;
	return 0;
}

/* A number field: absent leaves *v; present must be a number. */
static int get_num(json_t *root, const char *key, double *v, char *err, size_t cap)
{
	json_t *t = json_object_get(root, key);

	if (!t || json_is_null(t))
		return 0;
	if (!json_is_number(t)) {
		snprintf(err, cap, "%s must be a number", key);
		return -EINVAL;
	}
	*v = json_number_value(t);
	return 0;
}

static int get_int(json_t *root, const char *key, json_int_t min, json_int_t max,
		   json_int_t *v, char *err, size_t cap)
{
	json_t *t = json_object_get(root, key);

	if (!t || json_is_null(t))
		return 0;
	if (!json_is_integer(t) || json_integer_value(t) < min || json_integer_value(t) > max) {
		snprintf(err, cap, "%s must be an integer in [%lld, %lld]", key, (long long)min,
			 (long long)max);
		return -EINVAL;
	}
	*v = json_integer_value(t);
	return 0;
}

/* OpenAI's log-probability fields: completions take logprobs = N ≤ 5 (the sampled token and
 * the N most likely), chat logprobs = true with top_logprobs ≤ 20. Sets *ret_param to the field
 * at fault. Returns 0 or -EINVAL. */
static int parse_logprobs(json_t *root, bool chat, struct gen_parts *p, struct gen *g,
			  const char **ret_param, char *err, size_t cap)
{
	json_t *lp = json_object_get(root, "logprobs"), *top = json_object_get(root, "top_logprobs");
	json_int_t n = 0;

	*ret_param = "logprobs";
	if (!chat) {
		if (top && !json_is_null(top)) {
			*ret_param = "top_logprobs";
			snprintf(err, cap, "top_logprobs is a chat field: completions take logprobs "
				 "(an integer in [0, %d])", BD_HTTP_MAX_LOGPROBS);
			return -EINVAL;
		}
		if (get_int(root, "logprobs", 0, BD_HTTP_MAX_LOGPROBS, &n, err, cap) < 0)
			return -EINVAL;
		g->logprobs = lp && !json_is_null(lp);
	} else {
		if (lp && !json_is_null(lp) && !json_is_boolean(lp)) {
			snprintf(err, cap, "logprobs must be a boolean");
			return -EINVAL;
		}
		g->logprobs = json_is_true(lp);
		*ret_param = "top_logprobs";
		if (get_int(root, "top_logprobs", 0, BD_ROUTER_MAX_TOP_LOGPROBS, &n, err, cap) < 0)
			return -EINVAL;
		if (top && !json_is_null(top) && !g->logprobs) {
			snprintf(err, cap, "top_logprobs needs logprobs set to true");
			return -EINVAL;
		}
	}
	p->g.logprobs = g->logprobs;
	p->g.top_logprobs = (uint32_t)n;
	return 0;
}

/* Fills p from the request root of an endpoint (chat or not). Returns 0, -EINVAL with the
 * message in err and the offending field in *ret_param, -ENOENT (an unknown model), -ENOMEM. */
static int parse_request(struct bd_http *h, json_t *root, bool chat, struct gen_parts *p,
			 struct gen *g, const char **ret_param, char *err, size_t cap)
{
	json_int_t max_tokens = chat ? INT32_MAX : 16, n = 1, top_k = 0, seed = 0;
	double temperature = 1.0, top_p = 1.0, pen = 0;
	json_t *t, *stop;
	const char *model;
	int e;

	bdfp4__generate_request__init(&p->g);
	bdfp4__sampling_params__init(&p->sp);
	if (!json_is_object(root)) {
		snprintf(err, cap, "the body must be a JSON object");
		return -EINVAL;
	}
	model = json_string_value(json_object_get(root, "model"));
	if (model && *model && strcmp(model, h->model)) {
		*ret_param = "model";
		snprintf(err, cap, "The model '%s' does not exist; this server serves '%s'", model,
			 h->model);
		return -ENOENT;
	}
#define FIELD(call, name)                 \
	do {                              \
		*ret_param = name;        \
		if ((e = (call)) < 0)     \
			return e;         \
	} while (0)
	if (chat)
		FIELD(parse_messages(json_object_get(root, "messages"), p, err, cap), "messages");
	else
		FIELD(parse_prompt(json_object_get(root, "prompt"), p, err, cap), "prompt");
	FIELD(get_int(root, "max_tokens", 0, UINT32_MAX, &max_tokens, err, cap), "max_tokens");
	if (chat)
		FIELD(get_int(root, "max_completion_tokens", 0, UINT32_MAX, &max_tokens, err, cap),
		      "max_completion_tokens");
	FIELD(get_num(root, "temperature", &temperature, err, cap), "temperature");
	FIELD(get_num(root, "top_p", &top_p, err, cap), "top_p");
	FIELD(get_int(root, "top_k", -1, INT32_MAX, &top_k, err, cap), "top_k");
	FIELD(get_int(root, "seed", INT64_MIN, INT64_MAX, &seed, err, cap), "seed");
	FIELD(get_int(root, "n", 1, 1, &n, err, cap), "n");
	FIELD(parse_logprobs(root, chat, p, g, ret_param, err, cap), *ret_param);
	for (const char *const *k = (const char *const[]){ "frequency_penalty", "presence_penalty",
							    NULL }; *k; k++) {
		*ret_param = *k;
		pen = 0;
		if (get_num(root, *k, &pen, err, cap) < 0)
			return -EINVAL;
		if (pen != 0) {
			snprintf(err, cap, "%s is not served (only 0)", *k);
			return -EINVAL;
		}
	}
	if (json_is_true(json_object_get(root, "echo")) || json_object_get(root, "suffix") ||
	    json_array_size(json_object_get(root, "tools")) > 0 ||
	    (json_object_get(root, "best_of") &&
	     json_integer_value(json_object_get(root, "best_of")) != 1)) {
		*ret_param = NULL;
		snprintf(err, cap, "echo, suffix, best_of and tools are not served");
		return -EINVAL;
	}
	*ret_param = "stop";
	stop = json_object_get(root, "stop");
	if (json_is_string(stop)) {
		p->stops[0] = (char *)json_string_value(stop);
		p->g.n_stop = 1;
	} else if (json_is_array(stop)) {
		size_t i;

		if (json_array_size(stop) > BD_ROUTER_MAX_STOPS) {
			snprintf(err, cap, "at most %d stop strings", BD_ROUTER_MAX_STOPS);
			return -EINVAL;
		}
		json_array_foreach(stop, i, t) {
			if (!json_is_string(t)) {
				snprintf(err, cap, "stop must be a string or an array of strings");
				return -EINVAL;
			}
			p->stops[i] = (char *)json_string_value(t);
		}
		p->g.n_stop = json_array_size(stop);
	} else if (stop && !json_is_null(stop)) {
		snprintf(err, cap, "stop must be a string or an array of strings");
		return -EINVAL;
	}
	p->g.stop = p->stops;
	*ret_param = "stream";
	t = json_object_get(root, "stream");
	if (t && !json_is_boolean(t) && !json_is_null(t)) {
		snprintf(err, cap, "stream must be a boolean");
		return -EINVAL;
	}
	g->stream = json_is_true(t);
	g->include_usage = json_is_true(json_object_get(json_object_get(root, "stream_options"),
							"include_usage"));
	*ret_param = NULL;
	p->sp.temperature = (float)temperature;
	p->sp.top_p = (float)top_p;
	p->sp.top_k = top_k > 0 ? (uint32_t)top_k : 0;
	p->sp.seed = (uint64_t)seed;
	p->g.sampling = &p->sp;
	p->g.client_tag = TAG;
	p->g.max_tokens = (uint32_t)max_tokens;
	p->g.stream = g->stream;
	p->g.ignore_eos = json_is_true(json_object_get(root, "ignore_eos"));
	t = json_object_get(root, "cache_salt");
	if (t && !json_is_null(t)) {
		*ret_param = "cache_salt";
		if (!json_is_string(t)) {
			snprintf(err, cap, "cache_salt must be a string");
			return -EINVAL;
		}
		p->g.cache_salt = (char *)json_string_value(t);
		*ret_param = NULL;
	}
	return 0;
#undef FIELD
}

/* ---- JSON out ------------------------------------------------------------------------------ */

static json_t *usage_obj(const struct gen *g)
{
	return json_pack("{s:I, s:I, s:I}", "prompt_tokens", (json_int_t)g->prompt_tokens,
			 "completion_tokens", (json_int_t)g->completion_tokens, "total_tokens",
			 (json_int_t)g->prompt_tokens + g->completion_tokens);
}

/* The envelope of a response object or stream chunk, with choices (taken). */
static json_t *envelope(const struct gen *g, json_t *choices, bool chunk)
{
	const char *object = g->chat ? (chunk ? "chat.completion.chunk" : "chat.completion")
				     : "text_completion";

	return json_pack("{s:s, s:s, s:I, s:s, s:o}", "id", g->id, "object", object, "created",
			 (json_int_t)g->created, "model", g->h->model, "choices", choices);
}

/* A token's text for JSON (bd_utf8_or_bytes's form: its bytes when UTF-8). */
static json_t *token_str(const ProtobufCBinaryData *b)
{
	char buf[4 * 256 + 8];

	return json_string(bd_utf8_or_bytes((const char *)b->data, b->len, buf, sizeof(buf)));
}

static json_t *logprob_num(float lp)
{
	return json_real(lp >= (float)LOGPROB_FLOOR ? (double)lp : LOGPROB_FLOOR);
}

/* Chat: {"token", "logprob", "bytes"} of t. */
static json_t *chat_logprob(const Bdfp4__TokenLogprob *t)
{
	json_t *o = json_object(), *bytes = json_array();

	for (size_t i = 0; i < t->piece.len; i++)
		json_array_append_new(bytes, json_integer(t->piece.data[i]));
	json_object_set_new(o, "token", token_str(&t->piece));
	json_object_set_new(o, "logprob", logprob_num(t->logprob));
	json_object_set_new(o, "bytes", bytes);
	return o;
}

/* Appends the chunk's log-probabilities to lp: chat's {"content": [...]} or completions'
 * {"tokens", "token_logprobs", "top_logprobs", "text_offset"} (the sampled token among the
 * top ones, as OpenAI's legacy API has it). */
static void logprobs_add(struct gen *g, json_t *lp, const Bdfp4__GenerateChunk *ch)
{
	for (size_t i = 0; i < ch->n_logprobs; i++) {
		const Bdfp4__StepLogprobs *st = ch->logprobs[i];
		const Bdfp4__TokenLogprob *sa = st->sampled;

		if (!sa)
			continue;
		if (g->chat) {
			json_t *e = chat_logprob(sa), *top = json_array();

			for (size_t k = 0; k < st->n_top; k++)
				json_array_append_new(top, chat_logprob(st->top[k]));
			json_object_set_new(e, "top_logprobs", top);
			json_array_append_new(json_object_get(lp, "content"), e);
			continue;
		}
		json_t *top = json_object(), *tok = token_str(&sa->piece);

		for (size_t k = 0; k < st->n_top; k++) {
			json_t *key = token_str(&st->top[k]->piece);

			if (!json_object_get(top, json_string_value(key)))
				json_object_set_new(top, json_string_value(key),
						    logprob_num(st->top[k]->logprob));
			json_decref(key);
		}
		if (!json_object_get(top, json_string_value(tok)))
			json_object_set_new(top, json_string_value(tok), logprob_num(sa->logprob));
		json_array_append_new(json_object_get(lp, "tokens"), tok);
		json_array_append_new(json_object_get(lp, "token_logprobs"),
				      logprob_num(sa->logprob));
		json_array_append_new(json_object_get(lp, "top_logprobs"), top);
		json_array_append_new(json_object_get(lp, "text_offset"), json_integer(g->offset));
		/* characters: the bytes that start one (not UTF-8 continuation bytes) */
		for (size_t b = 0; b < sa->piece.len; b++)
			g->offset += (sa->piece.data[b] & 0xc0) != 0x80;
	}
}

/* An empty logprobs object of the endpoint's shape. */
static json_t *logprobs_new(const struct gen *g)
{
	return g->chat ? json_pack("{s:[]}", "content")
		       : json_pack("{s:[], s:[], s:[], s:[]}", "tokens", "token_logprobs",
				   "top_logprobs", "text_offset");
}

/* One choice: the text (a delta when streaming), its log-probabilities (lp, taken; NULL:
 * null), its finish reason or null. */
static json_t *choice(const struct gen *g, const char *text, size_t len, const char *finish,
		      bool chunk, bool role, json_t *lp)
{
	json_t *c = json_pack("{s:i, s:o}", "index", 0, "logprobs", lp ? lp : json_null());

	json_object_set_new(c, "finish_reason", finish ? json_string(finish) : json_null());
	if (!g->chat) {
		json_object_set_new(c, "text", json_stringn(text, len));
	} else if (chunk) {
		json_t *d = json_object();

		if (role)
			json_object_set_new(d, "role", json_string("assistant"));
		if (len || role)
			json_object_set_new(d, "content", json_stringn(text, len));
		json_object_set_new(c, "delta", d);
	} else {
		json_object_set_new(c, "message", json_pack("{s:s, s:s%}", "role", "assistant",
							    "content", text, len));
	}
	return c;
}

/* Appends "data: J\n\n" (j taken) to the stream's pending bytes. */
static int sse_event(struct gen *g, json_t *j)
{
	char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
	size_t n = s ? strlen(s) : 0;

	json_decref(j);
	if (!s)
		return -ENOMEM;
	if (g->out_len + n + 9 > g->out_cap) {
		size_t cap = (g->out_len + n + 9) * 2;
		char *o = realloc(g->out, cap);

		if (!o) {
			free(s);
			return -ENOMEM;
		}
		g->out = o;
		g->out_cap = cap;
	}
	g->out_len += (size_t)sprintf(g->out + g->out_len, "data: %s\n\n", s);
	free(s);
	return 0;
}

static int sse_raw(struct gen *g, const char *s)
{
	size_t n = strlen(s);

	if (g->out_len + n > g->out_cap) {
		char *o = realloc(g->out, g->out_len + n + 64);

		if (!o)
			return -ENOMEM;
		g->out = o;
		g->out_cap = g->out_len + n + 64;
	}
	memcpy(g->out + g->out_len, s, n);
	g->out_len += n;
	return 0;
}

/* A chunk of the loop: the stream's events for it, or (not streaming) its text gathered. */
static int take_chunk(struct gen *g, const Bdfp4__GenerateChunk *ch, bool first)
{
	bool final = ch->finish_reason != BDFP4__FINISH_REASON__FINISH_NONE;
	size_t n = strlen(ch->text);
	int e = 0;

	g->request_id = ch->request_id;
	if (final) {
		g->finished = true;
		g->finish = ch->finish_reason;
		g->error = ch->error;
		if (ch->usage) {
			g->prompt_tokens = ch->usage->prompt_tokens;
			g->completion_tokens = ch->usage->completion_tokens;
		}
	}
	if (!g->stream) {
		char *t = realloc(g->text, g->text_len + n + 1);

		if (g->logprobs && ch->n_logprobs) {
			if (!g->lp)
				g->lp = logprobs_new(g);
			logprobs_add(g, g->lp, ch);
		}
		if (!t)
			return -ENOMEM;
		memcpy(t + g->text_len, ch->text, n + 1);
		g->text = t;
		g->text_len += n;
		return 0;
	}
	if (first && g->chat)
		e = sse_event(g, envelope(g, json_pack("[o]", choice(g, "", 0, NULL, true, true,
								   NULL)), true));
	if (!e && (n || (g->logprobs && ch->n_logprobs))) {
		json_t *lp = NULL;

		if (g->logprobs && ch->n_logprobs) {
			lp = logprobs_new(g);
			logprobs_add(g, lp, ch);
		}
		e = sse_event(g, envelope(g, json_pack("[o]", choice(g, ch->text, n, NULL, true,
								       false, lp)), true));
	}
	if (!e && final && ch->finish_reason == BDFP4__FINISH_REASON__FINISH_ERROR) {
		const char *code;
		int st = serve_status(ch->error, &code);

		e = sse_event(g, error_obj(st, code, NULL, ch->message));
	} else if (!e && final) {
		e = sse_event(g, envelope(g, json_pack("[o]", choice(g, "", 0,
								   finish_name(g->finish), true,
								   false, NULL)), true));
	}
	if (!e && final && g->include_usage) {
		json_t *u = envelope(g, json_array(), true);

		json_object_set_new(u, "usage", usage_obj(g));
		e = sse_event(g, u);
	}
	if (!e && final)
		e = sse_raw(g, "data: [DONE]\n\n");
	return e;
}

/* ---- the streaming body --------------------------------------------------------------------- */

static ssize_t sse_reader(void *cls, uint64_t pos, char *buf, size_t max)
{
	struct gen *g = cls;
	size_t n;

	(void)pos;
	while (g->out_off == g->out_len) {
		Bdfp4__ClientReply *rep = NULL;
		int e;

		g->out_off = g->out_len = 0;
		if (g->finished)
			return MHD_CONTENT_READER_END_OF_STREAM;
		e = wait_reply(g->h, g, g->sock, -1, &rep);
		if (e < 0) {
			send_cancel(g);
			return MHD_CONTENT_READER_END_WITH_ERROR;
		}
		if (rep->msg_case == BDFP4__CLIENT_REPLY__MSG_CHUNK)
			e = take_chunk(g, rep->chunk, false);
		bdfp4__client_reply__free_unpacked(rep, NULL);
		if (e < 0) {
			send_cancel(g);
			return MHD_CONTENT_READER_END_WITH_ERROR;
		}
	}
	n = g->out_len - g->out_off < max ? g->out_len - g->out_off : max;
	memcpy(buf, g->out + g->out_off, n);
	g->out_off += n;
	return (ssize_t)n;
}

/* The response is gone (written, or the connection dropped): a request still running is the
 * dropped one's. */
static void sse_free(void *cls)
{
	struct gen *g = cls;

	send_cancel(g);
	gen_free(g);
}

/* ---- the endpoints -------------------------------------------------------------------------- */

static enum MHD_Result generate(struct bd_http *h, struct MHD_Connection *c, struct hreq *q,
				bool chat)
{
	const char *ep = chat ? EP_CHAT : EP_COMPL, *param = NULL, *code;
	const union MHD_ConnectionInfo *ci;
	Bdfp4__ClientRequest req = BDFP4__CLIENT_REQUEST__INIT;
	Bdfp4__ClientReply *rep = NULL;
	struct gen_parts parts = { 0 };
	struct MHD_Response *resp;
	json_error_t jerr;
	json_t *root;
	char err[512] = "";
	enum MHD_Result ret;
	struct gen *g;
	int e, st;

	if (q->too_big)
		return reply_error(h, c, ep, 413, "too_large", NULL,
				   "the request body is larger than %d bytes", MAX_BODY);
	root = json_loadb(q->body ? q->body : "", q->len, 0, &jerr);
	if (!root)
		return reply_error(h, c, ep, 400, "invalid_json", NULL,
				   "the body is not JSON: %s (line %d, column %d)", jerr.text,
				   jerr.line, jerr.column);
	g = calloc(1, sizeof(*g));
	if (!g) {
		json_decref(root);
		return MHD_NO;
	}
	g->h = h;
	g->chat = chat;
	g->created = (long)time(NULL);
	g->fd = -1;
	e = parse_request(h, root, chat, &parts, g, &param, err, sizeof(err));
	if (e < 0) {
		if (e == -ENOENT)
			ret = reply_error(h, c, ep, 404, "model_not_found", param, "%s", err);
		else if (e == -ENOMEM)
			ret = MHD_NO;
		else
			ret = reply_error(h, c, ep, 400, "invalid_request", param, "%s", err);
		goto out;
	}
	g->sock = loop_socket(h);
	req.msg_case = BDFP4__CLIENT_REQUEST__MSG_GENERATE;
	req.generate = &parts.g;
	if (!g->sock || send_request(g->sock, &req) < 0) {
		ret = reply_error(h, c, ep, 503, "unavailable", NULL,
				  "the router's event loop does not take requests");
		goto out;
	}
	ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
	g->fd = ci ? ci->connect_fd : -1;
	g->watch_fd = g->fd >= 0;
	/* the first answer decides the status: an error, or the first chunk */
	for (;;) {
		e = wait_reply(h, g, g->sock, -1, &rep);
		if (e < 0) {
			send_cancel(g);
			ret = e == -ESHUTDOWN ? reply_error(h, c, ep, 503, "unavailable", NULL,
							     "the router is stopping")
					      : MHD_NO;
			goto out;
		}
		if (rep->msg_case == BDFP4__CLIENT_REPLY__MSG_ERROR) {
			g->finished = true;
			st = serve_status(rep->error->error, &code);
			ret = reply_error(h, c, ep, st, code, NULL, "%s", rep->error->message);
			goto out;
		}
		if (rep->msg_case != BDFP4__CLIENT_REPLY__MSG_CHUNK) {
			bdfp4__client_reply__free_unpacked(rep, NULL);
			rep = NULL;
			continue; /* keepalives */
		}
		if (rep->chunk->finish_reason == BDFP4__FINISH_REASON__FINISH_ERROR &&
		    (!g->stream || !rep->chunk->n_token_ids)) {
			g->finished = true;
			st = serve_status(rep->chunk->error, &code);
			ret = reply_error(h, c, ep, st, code, NULL, "%s", rep->chunk->message);
			goto out;
		}
		snprintf(g->id, sizeof(g->id), "%s-%llu", chat ? "chatcmpl" : "cmpl",
			 (unsigned long long)rep->chunk->request_id);
		e = take_chunk(g, rep->chunk, true);
		bdfp4__client_reply__free_unpacked(rep, NULL);
		rep = NULL;
		if (e < 0) {
			send_cancel(g);
			ret = MHD_NO;
			goto out;
		}
		if (g->stream || g->finished)
			break;
	}
	if (!g->stream) {
		json_t *lp = g->logprobs ? (g->lp ? g->lp : logprobs_new(g)) : NULL;
		json_t *j;

		g->lp = NULL;
		j = envelope(g, json_pack("[o]", choice(g, g->text, g->text_len,
							finish_name(g->finish), false, false, lp)),
			     false);

		json_object_set_new(j, "usage", usage_obj(g));
		ret = reply_json(h, c, ep, 200, j);
		goto out;
	}
	resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 << 10, sse_reader, g,
						 sse_free);
	if (!resp) {
		send_cancel(g);
		ret = MHD_NO;
		goto out;
	}
	MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
	MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
	bd_router_metrics_http(h->metrics, ep, 200);
	ret = MHD_queue_response(c, 200, resp);
	MHD_destroy_response(resp);
	g = NULL; /* the response's */
out:
	if (rep)
		bdfp4__client_reply__free_unpacked(rep, NULL);
	parts_free(&parts);
	json_decref(root);
	gen_free(g);
	return ret;
}

static enum MHD_Result health(struct bd_http *h, struct MHD_Connection *c)
{
	Bdfp4__ClientRequest req = BDFP4__CLIENT_REQUEST__INIT;
	Bdfp4__HealthRequest hr = BDFP4__HEALTH_REQUEST__INIT;
	Bdfp4__ClientReply *rep = NULL;
	static const char *const states[] = { "starting", "serving", "degraded", "stopping" };
	void *s = loop_socket(h);
	enum MHD_Result ret;
	int e = -EIO;

	req.msg_case = BDFP4__CLIENT_REQUEST__MSG_HEALTH;
	req.health = &hr;
	if (s && send_request(s, &req) == 0)
		e = wait_reply(h, NULL, s, LOOP_ANSWER_MS, &rep);
	if (e < 0 || rep->msg_case != BDFP4__CLIENT_REPLY__MSG_HEALTH) {
		const char *why = e == -ESHUTDOWN ? "the router is stopping"
						  : "the router's event loop did not answer";

		ret = reply_json(h, c, EP_HEALTH, 503, json_pack("{s:s, s:s}", "status",
								 "unavailable", "reason", why));
	} else {
		Bdfp4__HealthReply *hp = rep->health;
		unsigned st = (unsigned)hp->state < 4 ? (unsigned)hp->state : 0;

		ret = reply_json(h, c, EP_HEALTH, hp->healthy ? 200 : 503,
				 json_pack("{s:s, s:s, s:s, s:b}", "status",
					   hp->healthy ? "ok" : "unavailable", "state", states[st],
					   "reason", hp->reason, "pool_ok", hp->pool_ok));
	}
	if (rep)
		bdfp4__client_reply__free_unpacked(rep, NULL);
	if (s)
		zmq_close(s);
	return ret;
}

static enum MHD_Result models(struct bd_http *h, struct MHD_Connection *c)
{
	return reply_json(h, c, EP_MODELS, 200,
			  json_pack("{s:s, s:[{s:s, s:s, s:I, s:s, s:i}]}", "object", "list",
				    "data", "id", h->model, "object", "model", "created",
				    (json_int_t)h->created, "owned_by", "bdfp4", "max_model_len",
				    h->n_ctx));
}

static enum MHD_Result metrics(struct bd_http *h, struct MHD_Connection *c)
{
	size_t len = 0;
	char *s;
	enum MHD_Result ret;

	bd_router_metrics_http(h->metrics, EP_METRICS, 200);
	s = bd_router_metrics_render(h->metrics, &len);
	if (!s)
		return MHD_NO;
	ret = queue_bytes(c, 200, "text/plain; version=0.0.4; charset=utf-8", s, len);
	free(s);
	return ret;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
				  const char *method, const char *version,
				  const char *upload_data, size_t *upload_data_size, void **con_cls)
{
	struct bd_http *h = cls;
	struct hreq *q = *con_cls;
	bool post = !strcmp(method, "POST"), get = !strcmp(method, "GET");

	(void)version;
	if (!q) {
		q = calloc(1, sizeof(*q));
		if (!q)
			return MHD_NO;
		*con_cls = q;
		return MHD_YES;
	}
	if (*upload_data_size) {
		size_t n = *upload_data_size;

		*upload_data_size = 0;
		if (q->too_big || q->len + n > MAX_BODY) {
			q->too_big = true;
			return MHD_YES;
		}
		if (q->len + n > q->cap) {
			size_t cap = (q->len + n) * 2 < MAX_BODY ? (q->len + n) * 2 : MAX_BODY;
			char *b = realloc(q->body, cap);

			if (!b)
				return MHD_NO;
			q->body = b;
			q->cap = cap;
		}
		memcpy(q->body + q->len, upload_data, n);
		q->len += n;
		return MHD_YES;
	}
	if (!strcmp(url, EP_COMPL) || !strcmp(url, EP_CHAT)) {
		const char *ep = !strcmp(url, EP_CHAT) ? EP_CHAT : EP_COMPL;

		if (!post)
			return reply_error(h, c, ep, 405, "method_not_allowed", NULL,
					   "%s takes POST", ep);
		return generate(h, c, q, ep == EP_CHAT);
	}
	if (!strcmp(url, EP_MODELS) || !strcmp(url, EP_HEALTH) || !strcmp(url, EP_METRICS)) {
		const char *ep = !strcmp(url, EP_MODELS) ? EP_MODELS
				 : !strcmp(url, EP_HEALTH) ? EP_HEALTH : EP_METRICS;

		if (!get)
			return reply_error(h, c, ep, 405, "method_not_allowed", NULL,
					   "%s takes GET", ep);
		return ep == EP_MODELS ? models(h, c) : ep == EP_HEALTH ? health(h, c)
									: metrics(h, c);
	}
	return reply_error(h, c, EP_OTHER, 404, "not_found", NULL, "no endpoint %s %s", method,
			   url);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls,
			 enum MHD_RequestTerminationCode toe)
{
	struct hreq *q = *con_cls;

	(void)cls;
	(void)c;
	(void)toe;
	if (q) {
		free(q->body);
		free(q);
		*con_cls = NULL;
	}
}

static void mhd_log(void *cls, const char *fmt, va_list ap)
{
	char line[512];

	(void)cls;
	vsnprintf(line, sizeof(line), fmt, ap);
	line[strcspn(line, "\n")] = 0;
	bd_log_warn("http: %s", line);
}

/* ---- start and stop ------------------------------------------------------------------------- */

/* "HOST:PORT" or "[HOST]:PORT" into *ret (freeaddrinfo it). */
static int resolve(const char *listen, struct addrinfo **ret)
{
	struct addrinfo hints = { .ai_socktype = SOCK_STREAM,
				  .ai_flags = AI_PASSIVE | AI_NUMERICSERV };
	char host[256];
	const char *colon = strrchr(listen, ':');
	size_t hl;

	if (!colon || !colon[1] || strspn(colon + 1, "0123456789") != strlen(colon + 1))
		return -EINVAL;
	hl = (size_t)(colon - listen);
	if (hl >= 2 && listen[0] == '[' && listen[hl - 1] == ']') {
		listen++;
		hl -= 2;
	}
	if (hl == 0 || hl >= sizeof(host))
		return -EINVAL;
	memcpy(host, listen, hl);
	host[hl] = 0;
	return getaddrinfo(host, colon + 1, &hints, ret) ? -EINVAL : 0;
}

int bd_router_http_start(struct bd_router *rt)
{
	unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_POLL_INTERNAL_THREAD |
			 MHD_USE_ERROR_LOG;
	const union MHD_DaemonInfo *di;
	struct addrinfo *ai = NULL;
	struct bd_http *h;
	char host[128] = "";
	int e;

	rt->metrics = bd_router_metrics_new(rt->model_name, rt->o.tp);
	if (!rt->metrics)
		return -ENOMEM;
	if (!rt->o.http || !*rt->o.http)
		return 0;
	e = resolve(rt->o.http, &ai);
	if (e < 0) {
		bd_log_err("http = '%s': not HOST:PORT (e.g. 127.0.0.1:8000)", rt->o.http);
		return e;
	}
	if (zmq_bind(rt->front, INPROC_EP) < 0) {
		bd_log_err("http: %s: %s", INPROC_EP, zmq_strerror(zmq_errno()));
		freeaddrinfo(ai);
		return -EIO;
	}
	h = calloc(1, sizeof(*h));
	if (!h) {
		freeaddrinfo(ai);
		return -ENOMEM;
	}
	h->zctx = rt->zctx;
	h->metrics = rt->metrics;
	h->n_ctx = rt->n_ctx;
	h->created = (long)time(NULL);
	snprintf(h->model, sizeof(h->model), "%s", rt->model_name);
	if (ai->ai_family == AF_INET6)
		flags |= MHD_USE_IPv6;
	h->mhd = MHD_start_daemon(flags, 0, NULL, NULL, on_request, h, MHD_OPTION_SOCK_ADDR,
				  ai->ai_addr, MHD_OPTION_NOTIFY_COMPLETED, on_completed, h,
				  MHD_OPTION_EXTERNAL_LOGGER, mhd_log, h,
				  MHD_OPTION_CONNECTION_TIMEOUT, 0U, MHD_OPTION_END);
	getnameinfo(ai->ai_addr, ai->ai_addrlen, host, sizeof(host), NULL, 0, NI_NUMERICHOST);
	freeaddrinfo(ai);
	if (!h->mhd) {
		bd_log_err("http %s: cannot listen there (in use, or not an address of this "
			   "machine)", rt->o.http);
		free(h);
		return -EADDRINUSE;
	}
	di = MHD_get_daemon_info(h->mhd, MHD_DAEMON_INFO_BIND_PORT);
	bd_log_info("http: listening on http://%s%s%s:%u (OpenAI API at /v1, /health, /metrics)",
		    strchr(host, ':') ? "[" : "", host, strchr(host, ':') ? "]" : "",
		    di ? di->port : 0);
	rt->http = h;
	return 0;
}

void bd_router_http_stop(struct bd_router *rt)
{
	struct bd_http *h = rt->http;

	if (h) {
		atomic_store(&h->stopping, true);
		MHD_stop_daemon(h->mhd);
		free(h);
		rt->http = NULL;
	}
	bd_router_metrics_free(rt->metrics);
	rt->metrics = NULL;
}
