/* client.c — the router's C client (bd_client.h) over ZeroMQ DEALER + serve.proto. */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <zmq.h>

#include "base/bd_clock.h"
#include "base/bd_ipc.h"
#include "base/bd_rand.h"
#include "base/bd_zsec.h"
#include "serve/bd_client.h"
#include "serve/bd_wire.h"
#include "serve.pb-c.h"

#define MAX_PROMPT_BYTES (64 << 10)
#define MAX_MESSAGES 64
#define MAX_STOP_BYTES 64

struct bd_client {
	void *zctx, *sock;
	void *mon;           /* PAIR: the socket's handshake failures (zmq_socket_monitor) */
	char endpoint[256];
	char err[512];       /* the last handshake failure */
	uint64_t next_tag, first_tag;
	uint64_t connection; /* ClientRequest.connection of every request */
	Bdfp4__ClientReply *last; /* the reply the last event points into */
	struct bd_client_top *top; /* the last chunk's logits table */
	struct bd_client_logprob *lp; /* the last chunk's log-probabilities */
};

static const char *const error_names[BD_SERVE_ERR_COUNT] = {
	"ok", "malformed", "oversize", "unknown-type", "invalid-argument", "too-long",
	"unknown-kv-config", "resource-exhausted", "unavailable", "worker-failed",
	"deadline-exceeded", "cancelled", "not-found", "shutting-down", "internal", "version",
};

const char *bd_serve_error_name(int code)
{
	return code >= 0 && code < BD_SERVE_ERR_COUNT ? error_names[code] : "unknown";
}

const char *bd_finish_name(int reason)
{
	static const char *const n[] = { "none", "stop", "length", "stop-string", "cancelled",
					 "error" };

	return reason >= 0 && reason < (int)(sizeof(n) / sizeof(n[0])) ? n[reason] : "unknown";
}

static void drop_last(struct bd_client *c)
{
	if (c->last)
		bdfp4__client_reply__free_unpacked(c->last, NULL);
	c->last = NULL;
	free(c->top);
	c->top = NULL;
	free(c->lp);
	c->lp = NULL;
}

int bd_client_new(const char *endpoint, struct bd_client **ret)
{
	return bd_client_new_opts(endpoint, NULL, ret, NULL, 0);
}

#define MON_EVENTS (ZMQ_EVENT_HANDSHAKE_FAILED_AUTH | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | \
		    ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL)

int bd_client_new_opts(const char *endpoint, const struct bd_client_opts *o,
		       struct bd_client **ret, char *err, size_t cap)
{
	const char *srv = o && o->server_key_file ? o->server_key_file : getenv("BDFP4_SERVER_KEY");
	const char *sec = o && o->secret_key_file ? o->secret_key_file : getenv("BDFP4_SECRET_KEY");
	struct bd_client *c;
	char mon[64];
	int zero = 0, e;

	if (err && cap)
		err[0] = 0;
	if (!ret)
		return -EINVAL;
	if (!endpoint)
		endpoint = BD_CLIENT_DEFAULT_ENDPOINT;
	/* ZeroMQ retries a refused ipc connect silently: the caller would see a timeout */
	if (bd_ipc_endpoint_check(endpoint, 1000) == -EACCES)
		return -EACCES;
	c = calloc(1, sizeof(*c));
	if (!c)
		return -ENOMEM;
	endpoint = endpoint ? endpoint : BD_CLIENT_DEFAULT_ENDPOINT;
	snprintf(c->endpoint, sizeof(c->endpoint), "%s", endpoint);
	c->zctx = zmq_ctx_new();
	if (!c->zctx) {
		free(c);
		return -ENOMEM;
	}
	c->sock = zmq_socket(c->zctx, ZMQ_DEALER);
	if (!c->sock || zmq_setsockopt(c->sock, ZMQ_LINGER, &zero, sizeof(zero)) < 0)
		goto zfail;
	if ((e = bd_zsec_client_files(c->sock, srv, sec, err, cap)) < 0) {
		bd_client_free(c);
		return e;
	}
	/* the handshake's failures, so that a refused client hears of it at once instead of
	 * waiting for a reply that cannot come */
	snprintf(mon, sizeof(mon), "inproc://bd-client-mon-%p", (void *)c);
	if (zmq_socket_monitor(c->sock, mon, MON_EVENTS) < 0 ||
	    !(c->mon = zmq_socket(c->zctx, ZMQ_PAIR)) ||
	    zmq_setsockopt(c->mon, ZMQ_LINGER, &zero, sizeof(zero)) < 0 || zmq_connect(c->mon, mon) < 0 ||
	    zmq_connect(c->sock, endpoint) < 0)
		goto zfail;
	/* tags need only be unique on this connection; a varied start eases reading logs */
	c->next_tag = ((uint64_t)bd_now_ms() & 0xffff) << 16 | 1;
	c->first_tag = c->next_tag;
	{
		uint64_t x = (uint64_t)bd_now_ms() ^ (uint64_t)getpid() << 32 ^ (uintptr_t)c;

		c->connection = bd_splitmix64(&x) | 1;
	}
	*ret = c;
	return 0;
zfail:
	e = zmq_errno();
	bd_client_free(c);
	return -(e ? e : EINVAL);
}

const char *bd_client_error(const struct bd_client *c)
{
	return c ? c->err : "";
}

/* A monitor event that is pending: its -errno (bd_zsec_handshake_error), 0 when none was or
 * it means nothing here. */
static int read_monitor(struct bd_client *c)
{
	zmq_msg_t ev, addr;
	int r = 0;

	zmq_msg_init(&ev);
	if (zmq_msg_recv(&ev, c->mon, ZMQ_DONTWAIT) < 0) {
		zmq_msg_close(&ev);
		return 0;
	}
	zmq_msg_init(&addr);
	if (zmq_msg_more(&ev) && zmq_msg_recv(&addr, c->mon, 0) >= 0 && zmq_msg_size(&ev) >= 6) {
		const uint8_t *d = zmq_msg_data(&ev);
		uint16_t event;
		uint32_t value;

		memcpy(&event, d, 2);
		memcpy(&value, d + 2, 4);
		r = bd_zsec_handshake_error(event, (int)value, c->endpoint, c->err, sizeof(c->err));
	}
	zmq_msg_close(&addr);
	zmq_msg_close(&ev);
	return r;
}

void bd_client_free(struct bd_client *c)
{
	if (!c)
		return;
	drop_last(c);
	bd_wire_close(&c->sock);
	bd_wire_close(&c->mon);
	bd_wire_ctx_term(&c->zctx);
	free(c);
}

static int send_request(struct bd_client *c, Bdfp4__ClientRequest *req)
{
	req->connection = c->connection;
	return bd_wire_send(c->sock, NULL, 0, false, &req->base, 0);
}

int bd_client_send_raw(struct bd_client *c, const void *frame, size_t len)
{
	if (!c || (!frame && len))
		return -EINVAL;
	return zmq_send(c->sock, frame, len, 0) < 0 ? -zmq_errno() : 0;
}

int bd_client_generate_start(struct bd_client *c, const struct bd_client_gen *g,
			     uint64_t *ret_tag)
{
	Bdfp4__ClientRequest req = BDFP4__CLIENT_REQUEST__INIT;
	Bdfp4__GenerateRequest gen = BDFP4__GENERATE_REQUEST__INIT;
	Bdfp4__SamplingParams sp = BDFP4__SAMPLING_PARAMS__INIT;
	Bdfp4__ChatMessage one = BDFP4__CHAT_MESSAGE__INIT;
	Bdfp4__ChatMessage *msgs = NULL, **pmsgs = NULL, *pone = &one;
	int n_set, e;
	size_t text = 0;

	if (!c || !g || !ret_tag)
		return -EINVAL;
	n_set = (g->prompt != NULL) + (g->n_messages > 0) + (g->n_token_ids > 0);
	if (n_set != 1 || (g->n_messages && !g->messages) || (g->n_token_ids && !g->token_ids) ||
	    g->n_stops < 0 || (g->n_stops && !g->stops) || (g->n_forced && !g->forced_tokens))
		return -EINVAL;
	if (g->n_stops > BD_CLIENT_MAX_STOPS || g->n_messages > MAX_MESSAGES ||
	    g->logits_top_k > BD_CLIENT_MAX_TOP || g->top_logprobs > BD_CLIENT_MAX_TOP_LOGPROBS)
		return -EMSGSIZE;
	if (g->top_logprobs && !g->logprobs)
		return -EINVAL;
	for (int i = 0; i < g->n_stops; i++) {
		if (!g->stops[i])
			return -EINVAL;
		if (strlen(g->stops[i]) > MAX_STOP_BYTES)
			return -EMSGSIZE;
	}
	for (size_t i = 0; i < g->n_messages; i++) {
		if (!g->messages[i].role || !g->messages[i].content)
			return -EINVAL;
		text += strlen(g->messages[i].content);
	}
	if ((g->prompt && strlen(g->prompt) > MAX_PROMPT_BYTES) || text > MAX_PROMPT_BYTES)
		return -EMSGSIZE;

	gen.client_tag = c->next_tag++;
	if (g->prompt && g->chat) {
		one.role = (char *)"user";
		one.content = (char *)g->prompt;
		gen.n_messages = 1;
		gen.messages = &pone;
	} else if (g->prompt) {
		gen.prompt = (char *)g->prompt;
	} else if (g->n_messages) {
		msgs = calloc(g->n_messages, sizeof(*msgs));
		pmsgs = calloc(g->n_messages, sizeof(*pmsgs));
		if (!msgs || !pmsgs) {
			free(msgs);
			free(pmsgs);
			return -ENOMEM;
		}
		for (size_t i = 0; i < g->n_messages; i++) {
			bdfp4__chat_message__init(&msgs[i]);
			msgs[i].role = (char *)g->messages[i].role;
			msgs[i].content = (char *)g->messages[i].content;
			pmsgs[i] = &msgs[i];
		}
		gen.n_messages = g->n_messages;
		gen.messages = pmsgs;
	} else {
		gen.n_token_ids = g->n_token_ids;
		gen.token_ids = (int32_t *)g->token_ids;
	}
	sp.temperature = g->sampling.temperature;
	sp.top_k = g->sampling.top_k > 0 ? (uint32_t)g->sampling.top_k : 0;
	sp.top_p = g->sampling.top_p;
	sp.seed = g->sampling.seed;
	gen.sampling = &sp;
	gen.max_tokens = g->max_tokens;
	gen.n_stop = (size_t)g->n_stops;
	gen.stop = (char **)g->stops;
	gen.stream = g->stream;
	gen.kv_config = (char *)(g->kv_config ? g->kv_config : "");
	gen.deadline_ms = g->deadline_ms;
	gen.ignore_eos = g->ignore_eos;
	if (g->cache_salt)
		gen.cache_salt = (char *)g->cache_salt;
	gen.n_forced_tokens = g->n_forced;
	gen.forced_tokens = (int32_t *)g->forced_tokens;
	gen.logits_top_k = g->logits_top_k;
	gen.logprobs = g->logprobs;
	gen.top_logprobs = g->top_logprobs;
	req.msg_case = BDFP4__CLIENT_REQUEST__MSG_GENERATE;
	req.generate = &gen;
	e = send_request(c, &req);
	free(msgs);
	free(pmsgs);
	if (e < 0)
		return e;
	*ret_tag = gen.client_tag;
	return 0;
}

int bd_client_cancel(struct bd_client *c, uint64_t tag)
{
	Bdfp4__ClientRequest req = BDFP4__CLIENT_REQUEST__INIT;
	Bdfp4__CancelRequest cr = BDFP4__CANCEL_REQUEST__INIT;

	if (!c || !tag)
		return -EINVAL;
	cr.client_tag = tag;
	req.msg_case = BDFP4__CLIENT_REQUEST__MSG_CANCEL;
	req.cancel = &cr;
	return send_request(c, &req);
}

/* The next reply other than a keepalive, into c->last. */
static int recv_reply(struct bd_client *c, int timeout_ms)
{
	int64_t end = bd_now_ms() + (timeout_ms > 0 ? timeout_ms : 0);

	drop_last(c);
	for (;;) {
		zmq_pollitem_t it[2] = { { .socket = c->sock, .events = ZMQ_POLLIN },
					 { .socket = c->mon, .events = ZMQ_POLLIN } };
		int64_t left = end - bd_now_ms();
		zmq_msg_t m;
		int r;

		r = zmq_poll(it, 2, (long)(left > 0 ? left : 0));
		if (r < 0) {
			if (zmq_errno() == EINTR)
				continue;
			return -zmq_errno();
		}
		if (r == 0)
			return -ETIMEDOUT;
		if ((it[1].revents & ZMQ_POLLIN) && (r = read_monitor(c)) < 0)
			return r;
		if (!(it[0].revents & ZMQ_POLLIN))
			continue;
		zmq_msg_init(&m);
		if (zmq_msg_recv(&m, c->sock, ZMQ_DONTWAIT) < 0) {
			zmq_msg_close(&m);
			continue;
		}
		/* a REQ-style empty delimiter never comes to a DEALER that sent none; skip any */
		if (zmq_msg_size(&m) == 0 && zmq_msg_more(&m)) {
			zmq_msg_close(&m);
			continue;
		}
		c->last = bdfp4__client_reply__unpack(NULL, zmq_msg_size(&m), zmq_msg_data(&m));
		zmq_msg_close(&m);
		if (!c->last)
			return -EBADMSG;
		if (c->last->msg_case == BDFP4__CLIENT_REPLY__MSG_KEEPALIVE) {
			drop_last(c);
			end = bd_now_ms() + (timeout_ms > 0 ? timeout_ms : 0);
			continue;
		}
		if (c->last->msg_case == BDFP4__CLIENT_REPLY__MSG__NOT_SET) {
			drop_last(c);
			return -EBADMSG;
		}
		return 0;
	}
}

static struct bd_client_logprob logprob_of(const Bdfp4__TokenLogprob *t)
{
	return (struct bd_client_logprob){ t->token, t->logprob, (const char *)t->piece.data,
					   t->piece.len };
}

/* The chunk's log-probabilities as a dense [n][1 + k] table (k the widest step). */
static int fill_logprobs(struct bd_client *c, const Bdfp4__GenerateChunk *ch,
			 struct bd_client_event *ev)
{
	size_t n = ch->n_token_ids, k = 0;

	if (ch->n_logprobs != n || n == 0)
		return 0;
	for (size_t i = 0; i < n; i++) {
		if (!ch->logprobs[i]->sampled)
			return -EBADMSG;
		if (ch->logprobs[i]->n_top > k)
			k = ch->logprobs[i]->n_top;
	}
	if (k > BD_CLIENT_MAX_TOP_LOGPROBS)
		return -EBADMSG;
	c->lp = calloc(n * (1 + k), sizeof(*c->lp));
	if (!c->lp)
		return -ENOMEM;
	for (size_t i = 0; i < n; i++) {
		const Bdfp4__StepLogprobs *s = ch->logprobs[i];
		struct bd_client_logprob *row = c->lp + i * (1 + k);

		row[0] = logprob_of(s->sampled);
		for (size_t j = 0; j < k; j++)
			row[1 + j] = j < s->n_top ? logprob_of(s->top[j])
						  : (struct bd_client_logprob){ .token = -1 };
	}
	ev->logprobs = c->lp;
	ev->n_top_logprobs = k;
	return 0;
}

static int fill_chunk(struct bd_client *c, const Bdfp4__GenerateChunk *ch,
		      struct bd_client_event *ev)
{
	size_t n = ch->n_token_ids, k = 0;

	ev->kind = BD_CLIENT_CHUNK;
	ev->tag = ch->client_tag;
	ev->request_id = ch->request_id;
	ev->tokens = ch->token_ids;
	ev->n_tokens = n;
	ev->text = ch->text ? ch->text : "";
	ev->text_len = strlen(ev->text);
	ev->finish = (enum bd_finish)ch->finish_reason;
	ev->error = (int)ch->error;
	ev->message = ch->message ? ch->message : "";
	if (ch->usage) {
		ev->has_usage = true;
		ev->usage = (struct bd_client_usage){
			.prompt_tokens = ch->usage->prompt_tokens,
			.completion_tokens = ch->usage->completion_tokens,
			.preemptions = ch->usage->preemptions,
			.queue_us = ch->usage->queue_us,
			.ttft_us = ch->usage->ttft_us,
			.total_us = ch->usage->total_us,
		};
	}
	/* logits: a dense [n][k] table, k the widest step (missing entries: token -1) */
	if (ch->n_logits == n && n > 0) {
		for (size_t i = 0; i < n; i++)
			if (ch->logits[i]->n_top > k)
				k = ch->logits[i]->n_top;
		if (k > BD_CLIENT_MAX_TOP)
			return -EBADMSG;
		if (k) {
			c->top = calloc(n * k, sizeof(*c->top));
			if (!c->top)
				return -ENOMEM;
			for (size_t i = 0; i < n; i++)
				for (size_t j = 0; j < k; j++) {
					const Bdfp4__StepLogits *s = ch->logits[i];

					c->top[i * k + j] =
						j < s->n_top ? (struct bd_client_top){
								       s->top[j]->token,
								       s->top[j]->logit }
							     : (struct bd_client_top){ -1, 0 };
				}
			ev->top = c->top;
			ev->top_k = k;
		}
	}
	return fill_logprobs(c, ch, ev);
}

/* True when r is about a tag this connection did not send. */
static bool foreign(const struct bd_client *c, const Bdfp4__ClientReply *r)
{
	uint64_t tag = 0;

	if (r->msg_case == BDFP4__CLIENT_REPLY__MSG_CHUNK)
		tag = r->chunk->client_tag;
	else if (r->msg_case == BDFP4__CLIENT_REPLY__MSG_ERROR)
		tag = r->error->client_tag;
	else if (r->msg_case == BDFP4__CLIENT_REPLY__MSG_CANCEL)
		tag = r->cancel->client_tag;
	return tag && (tag < c->first_tag || tag >= c->next_tag);
}

int bd_client_next(struct bd_client *c, int timeout_ms, struct bd_client_event *ret)
{
	int e;

	if (!c || !ret || timeout_ms < 0)
		return -EINVAL;
	for (int64_t end = bd_now_ms() + timeout_ms;;) {
		int64_t left = end - bd_now_ms();

		e = recv_reply(c, left > 0 ? (int)left : 0);
		if (e < 0)
			return e;
		/* a reply about a tag this connection never used is a predecessor's (one that
		 * had this routing id): not ours to see */
		if (!foreign(c, c->last))
			break;
		drop_last(c);
	}
	memset(ret, 0, sizeof(*ret));
	ret->text = "";
	ret->message = "";
	switch (c->last->msg_case) {
	case BDFP4__CLIENT_REPLY__MSG_CHUNK:
		return fill_chunk(c, c->last->chunk, ret);
	case BDFP4__CLIENT_REPLY__MSG_ERROR:
		ret->kind = BD_CLIENT_ERROR;
		ret->tag = c->last->error->client_tag;
		ret->error = (int)c->last->error->error;
		ret->message = c->last->error->message ? c->last->error->message : "";
		ret->finish = BD_FINISH_ERROR;
		return 0;
	case BDFP4__CLIENT_REPLY__MSG_CANCEL:
		ret->kind = BD_CLIENT_CANCELLED;
		ret->tag = c->last->cancel->client_tag;
		ret->error = (int)c->last->cancel->error;
		return 0;
	default:
		ret->kind = BD_CLIENT_OTHER;
		return 0;
	}
}

/* Sends a health (info false) or an info request and waits for its reply, in c->last,
 * dropping other events. */
static int query(struct bd_client *c, int timeout_ms, bool info)
{
	Bdfp4__ClientRequest req = BDFP4__CLIENT_REQUEST__INIT;
	Bdfp4__HealthRequest hr = BDFP4__HEALTH_REQUEST__INIT;
	Bdfp4__InfoRequest ir = BDFP4__INFO_REQUEST__INIT;
	Bdfp4__ClientReply__MsgCase want;
	int64_t end = bd_now_ms() + timeout_ms;
	int e;

	if (!c || timeout_ms < 0)
		return -EINVAL;
	if (info) {
		req.msg_case = BDFP4__CLIENT_REQUEST__MSG_INFO;
		req.info = &ir;
		want = BDFP4__CLIENT_REPLY__MSG_INFO;
	} else {
		req.msg_case = BDFP4__CLIENT_REQUEST__MSG_HEALTH;
		req.health = &hr;
		want = BDFP4__CLIENT_REPLY__MSG_HEALTH;
	}
	if ((e = send_request(c, &req)) < 0)
		return e;
	for (;;) {
		int64_t left = end - bd_now_ms();

		if (left <= 0)
			return -ETIMEDOUT;
		if ((e = recv_reply(c, (int)left)) < 0)
			return e;
		if (c->last->msg_case == want)
			return 0;
		if (c->last->msg_case == BDFP4__CLIENT_REPLY__MSG_ERROR &&
		    c->last->error->client_tag == 0)
			return -EBADMSG;
	}
}

static void copy_str(char *dst, size_t cap, const char *s)
{
	snprintf(dst, cap, "%s", s ? s : "");
}

static void fill_health(const Bdfp4__HealthReply *h, struct bd_client_health *ret)
{
	memset(ret, 0, sizeof(*ret));
	ret->healthy = h->healthy;
	ret->state = (int)h->state;
	copy_str(ret->reason, sizeof(ret->reason), h->reason);
	ret->pool_ok = h->pool_ok;
	copy_str(ret->pool_error, sizeof(ret->pool_error), h->pool_error);
	ret->pool_last_ok_ms = h->pool_last_ok_ms;
	for (size_t i = 0; i < h->n_workers && i < 8; i++) {
		const Bdfp4__WorkerStatus *w = h->workers[i];

		ret->workers[i] = (struct bd_client_worker){
			.rank = w->rank, .pid = w->pid, .alive = w->alive,
			.last_heartbeat_ms = w->last_heartbeat_ms, .steps = w->steps,
		};
		ret->n_workers = i + 1;
	}
}

int bd_client_health(struct bd_client *c, int timeout_ms, struct bd_client_health *ret)
{
	int e = ret ? query(c, timeout_ms, false) : -EINVAL;

	if (e < 0)
		return e;
	fill_health(c->last->health, ret);
	drop_last(c);
	return 0;
}

int bd_client_info(struct bd_client *c, int timeout_ms, struct bd_client_info *ret)
{
	const Bdfp4__ServerInfo *s;
	int e = ret ? query(c, timeout_ms, true) : -EINVAL;

	if (e < 0)
		return e;
	s = c->last->info;
	memset(ret, 0, sizeof(*ret));
	copy_str(ret->version, sizeof(ret->version), s->version);
	copy_str(ret->model, sizeof(ret->model), s->model);
	copy_str(ret->arch, sizeof(ret->arch), s->arch);
	copy_str(ret->kv_config, sizeof(ret->kv_config), s->kv_config);
	copy_str(ret->backend, sizeof(ret->backend), s->backend);
	copy_str(ret->decode_kernel, sizeof(ret->decode_kernel), s->decode_kernel);
	ret->n_vocab = s->n_vocab;
	ret->n_ctx = s->n_ctx;
	ret->tp = s->tp;
	ret->max_batch = s->max_batch;
	ret->max_queue = s->max_queue;
	ret->max_frame_bytes = s->max_frame_bytes;
	ret->queued = s->queued;
	ret->running = s->running;
	ret->requests_total = s->requests_total;
	ret->requests_failed = s->requests_failed;
	ret->tokens_generated = s->tokens_generated;
	ret->steps = s->steps;
	ret->preemptions = s->preemptions;
	ret->pages_total = s->pages_total;
	ret->pages_free = s->pages_free;
	ret->slots_total = s->slots_total;
	ret->slots_free = s->slots_free;
	ret->pages_peak = s->pages_peak;
	ret->uptime_ms = s->uptime_ms;
	ret->healthy = s->health && s->health->healthy;
	drop_last(c);
	return 0;
}
