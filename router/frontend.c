/* frontend.c — routerd's client API: ClientRequest frames in, ClientReply frames out
 * (proto/serve.proto). Every request is validated before the scheduler gets it, so before
 * anything is allocated in the pool; a bad one gets an ErrorReply and the daemon goes on
 * serving. New requests, cancels and clients found gone are the scheduler's events
 * (bd_sched_submit, _cancel, _client_gone); its chunks come back through bd_router_send_chunk. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zmq.h>

#include "quant/bd_kvcfg.h"
#include "router.h"

struct envelope {
	uint8_t ident[256];
	size_t ident_len;
	bool delim;
};

/* Sends one ClientReply to a client. Returns 0 or -EHOSTUNREACH (gone or too slow). */
static int send_reply(struct bd_router *rt, const uint8_t *ident, size_t ident_len, bool delim,
		      const Bdfp4__ClientReply *rep)
{
	return bd_router_send(rt->front, ident, ident_len, delim, &rep->base);
}

static void send_error(struct bd_router *rt, const struct envelope *env, uint64_t tag, int code,
		       const char *msg)
{
	Bdfp4__ClientReply rep = BDFP4__CLIENT_REPLY__INIT;
	Bdfp4__ErrorReply er = BDFP4__ERROR_REPLY__INIT;

	er.client_tag = tag;
	er.error = (Bdfp4__ServeError)code;
	er.message = (char *)msg;
	rep.msg_case = BDFP4__CLIENT_REPLY__MSG_ERROR;
	rep.error = &er;
	bd_log_debug("request %llu refused: %s", (unsigned long long)tag, msg);
	send_reply(rt, env->ident, env->ident_len, env->delim, &rep);
}

/* A kept log-probability as a TokenLogprob into *t, its token's bytes borrowed from the
 * tokenizer (none without one). */
static void token_logprob(struct bd_router *rt, const struct bd_req_logprob *l,
			  Bdfp4__TokenLogprob *t)
{
	const char *b;
	size_t n;

	bdfp4__token_logprob__init(t);
	t->token = l->token;
	t->logprob = l->logprob;
	if (rt->tok && bd_tokenizer_token_bytes(rt->tok, l->token, &b, &n) == 0) {
		t->piece.data = (uint8_t *)b;
		t->piece.len = n;
	}
}

int bd_router_send_chunk(struct bd_router *rt, struct bd_req *r, int finish, int error,
			 const char *msg)
{
	Bdfp4__ClientReply rep = BDFP4__CLIENT_REPLY__INIT;
	Bdfp4__GenerateChunk ch = BDFP4__GENERATE_CHUNK__INIT;
	Bdfp4__Usage us = BDFP4__USAGE__INIT;
	Bdfp4__StepLogits *sl = NULL, **psl = NULL;
	Bdfp4__TopLogit **ptop = NULL;
	Bdfp4__StepLogprobs *slp = NULL, **pslp = NULL;
	Bdfp4__TokenLogprob *tlp = NULL, **plp = NULL;
	int from = r->stream ? r->n_sent : 0, n = r->n_gen - from, e;
	size_t text_from = r->stream ? r->shown_sent : 0;
	char *text;
	bool final = finish != BDFP4__FINISH_REASON__FINISH_NONE;

	if (!final && n <= 0 && r->shown == text_from)
		return 0;
	text = strndup(r->text ? r->text + text_from : "", r->shown - text_from);
	if (!text)
		return -ENOMEM;
	ch.client_tag = r->tag;
	ch.request_id = r->id;
	ch.n_token_ids = (size_t)(n > 0 ? n : 0);
	ch.token_ids = r->toks + r->n_prompt + from;
	ch.text = text;
	ch.finish_reason = (Bdfp4__FinishReason)finish;
	ch.error = (Bdfp4__ServeError)error;
	ch.message = (char *)(msg ? msg : "");
	if (r->top_k && n > 0) {
		sl = calloc((size_t)n, sizeof(*sl));
		psl = calloc((size_t)n, sizeof(*psl));
		ptop = calloc((size_t)n * r->top_k, sizeof(*ptop));
		if (!sl || !psl || !ptop) {
			e = -ENOMEM;
			goto out;
		}
		for (int i = 0; i < n; i++) {
			Bdfp4__TopLogit *t = r->top + (size_t)(from + i) * r->top_k;
			size_t k = 0;

			bdfp4__step_logits__init(&sl[i]);
			while (k < r->top_k && t[k].token >= 0) {
				ptop[(size_t)i * r->top_k + k] = &t[k];
				k++;
			}
			sl[i].n_top = k;
			sl[i].top = ptop + (size_t)i * r->top_k;
			psl[i] = &sl[i];
		}
		ch.n_logits = (size_t)n;
		ch.logits = psl;
	}
	if (r->lp && n > 0) {
		size_t w = 1 + r->top_logprobs;

		slp = calloc((size_t)n, sizeof(*slp));
		pslp = calloc((size_t)n, sizeof(*pslp));
		tlp = calloc((size_t)n * w, sizeof(*tlp));
		plp = calloc((size_t)n * w, sizeof(*plp));
		if (!slp || !pslp || !tlp || !plp) {
			e = -ENOMEM;
			goto out;
		}
		for (int i = 0; i < n; i++) {
			const struct bd_req_logprob *l = r->lp + (size_t)(from + i) * w;
			Bdfp4__TokenLogprob *t = tlp + (size_t)i * w;
			size_t k = 0;

			bdfp4__step_logprobs__init(&slp[i]);
			token_logprob(rt, &l[0], &t[0]);
			slp[i].sampled = &t[0];
			while (k < r->top_logprobs && l[1 + k].token >= 0) {
				token_logprob(rt, &l[1 + k], &t[1 + k]);
				plp[(size_t)i * w + k] = &t[1 + k];
				k++;
			}
			slp[i].n_top = k;
			slp[i].top = plp + (size_t)i * w;
			pslp[i] = &slp[i];
		}
		ch.n_logprobs = (size_t)n;
		ch.logprobs = pslp;
	}
	if (final) {
		int64_t now = bd_now_ms();

		us.prompt_tokens = (uint32_t)r->n_prompt;
		us.completion_tokens = (uint32_t)r->n_gen;
		us.queue_us = r->t_admit ? (uint64_t)(r->t_admit - r->t_arrival) * 1000 : 0;
		us.ttft_us = r->t_first ? (uint64_t)(r->t_first - r->t_arrival) * 1000 : 0;
		us.total_us = (uint64_t)(now - r->t_arrival) * 1000;
		us.preemptions = r->preemptions;
		ch.usage = &us;
	}
	rep.msg_case = BDFP4__CLIENT_REPLY__MSG_CHUNK;
	rep.chunk = &ch;
	e = send_reply(rt, r->ident, r->ident_len, r->delim, &rep);
	if (e == 0) {
		r->n_sent = r->n_gen;
		r->shown_sent = r->shown;
		r->last_sent = bd_now_ms();
	}
out:
	free(text);
	free(sl);
	free(psl);
	free(ptop);
	free(slp);
	free(pslp);
	free(tlp);
	free(plp);
	return e;
}

void bd_router_keepalive(struct bd_router *rt, int64_t now)
{
	Bdfp4__ClientReply rep = BDFP4__CLIENT_REPLY__INIT;
	Bdfp4__Keepalive ka = BDFP4__KEEPALIVE__INIT;

	struct bd_sched *s = &rt->sched;

	rep.msg_case = BDFP4__CLIENT_REPLY__MSG_KEEPALIVE;
	rep.keepalive = &ka;
	for (size_t i = 0; i < s->n_reqs; i++) {
		struct bd_req *r = s->reqs[i];

		if (r->finish_pending || now - r->last_sent < rt->o.keepalive_ms)
			continue;
		if (send_reply(rt, r->ident, r->ident_len, r->delim, &rep) < 0) {
			/* r stays readable until the scheduler's actions are drained */
			bd_sched_client_gone(s, r->ident, r->ident_len);
			i = (size_t)-1; /* the list changed: start over (gone ones are skipped) */
			continue;
		}
		/* one keepalive per connection per period */
		for (size_t j = 0; j < s->n_reqs; j++)
			if (s->reqs[j]->ident_len == r->ident_len &&
			    !memcmp(s->reqs[j]->ident, r->ident, r->ident_len))
				s->reqs[j]->last_sent = now;
	}
}

/* ---- health and info ------------------------------------------------------------------------ */

void bd_router_fill_health(struct bd_router *rt, Bdfp4__HealthReply *h, Bdfp4__WorkerStatus *ws,
			   Bdfp4__WorkerStatus **pws)
{
	int64_t now = bd_now_ms();

	char pool[320];

	bdfp4__health_reply__init(h);
	bd_router_pool_reason(rt, pool, sizeof(pool));
	h->state = (Bdfp4__ServingState)rt->state;
	if (rt->state == RS_SERVING && !rt->pool_ok)
		h->state = BDFP4__SERVING_STATE__STATE_DEGRADED;
	h->healthy = rt->state == RS_SERVING && rt->pool_ok;
	/* the cause first: a pool that is down also takes the workers with it */
	if (rt->state == RS_STOPPING)
		snprintf(rt->health_reason, sizeof(rt->health_reason),
			 "draining %zu request(s) (%zu running, %zu queued, %lld ms left): the "
			 "router is stopping%s%s",
			 rt->sched.n_reqs, rt->sched.n_running, rt->sched.n_queued,
			 (long long)(rt->draining && rt->drain_end > now ? rt->drain_end - now : 0),
			 *pool ? "; " : "", pool);
	else if (*pool && rt->state != RS_SERVING)
		snprintf(rt->health_reason, sizeof(rt->health_reason), "%s; %s", pool, rt->reason);
	else
		snprintf(rt->health_reason, sizeof(rt->health_reason), "%s",
			 *pool ? pool : rt->state == RS_SERVING ? "" : rt->reason);
	h->reason = rt->health_reason;
	h->pool_ok = rt->pool_ok;
	h->pool_error = rt->pool_ok ? (char *)"" : rt->pool_err;
	h->pool_last_ok_ms = (uint64_t)(now - rt->pool_last_ok);
	for (int i = 0; i < rt->o.tp; i++) {
		bdfp4__worker_status__init(&ws[i]);
		ws[i].rank = i;
		ws[i].pid = rt->w[i].connected ? rt->w[i].pid : 0;
		ws[i].alive = rt->w[i].connected;
		ws[i].last_heartbeat_ms =
			rt->w[i].connected ? (uint64_t)(now - rt->w[i].last_seen) : 0;
		ws[i].steps = rt->w[i].steps;
		ws[i].backend = rt->w[i].backend;
		pws[i] = &ws[i];
	}
	h->n_workers = (size_t)rt->o.tp;
	h->workers = pws;
}

static void on_health(struct bd_router *rt, const struct envelope *env)
{
	Bdfp4__ClientReply rep = BDFP4__CLIENT_REPLY__INIT;
	Bdfp4__HealthReply h;
	Bdfp4__WorkerStatus ws[BD_ROUTER_MAX_TP], *pws[BD_ROUTER_MAX_TP];

	bd_router_fill_health(rt, &h, ws, pws);
	rep.msg_case = BDFP4__CLIENT_REPLY__MSG_HEALTH;
	rep.health = &h;
	send_reply(rt, env->ident, env->ident_len, env->delim, &rep);
}

static void on_info(struct bd_router *rt, const struct envelope *env)
{
	Bdfp4__ClientReply rep = BDFP4__CLIENT_REPLY__INIT;
	Bdfp4__ServerInfo si = BDFP4__SERVER_INFO__INIT;
	Bdfp4__HealthReply h;
	Bdfp4__WorkerStatus ws[BD_ROUTER_MAX_TP], *pws[BD_ROUTER_MAX_TP];
	const struct bd_kvcfg *pool_cfg = bd_kvcfg_find(rt->kv_config);
	char *names[64];
	size_t n_names = 0;

	bd_router_pool_refresh(rt);
	for (int i = 0; i < BD_KVCFG_COUNT && n_names < 64; i++) {
		const struct bd_kvcfg *k = bd_kvcfg_get(i);

		if (k && pool_cfg && k->page_fmt == pool_cfg->page_fmt)
			names[n_names++] = (char *)k->name;
	}
	bd_router_fill_health(rt, &h, ws, pws);
	si.version = (char *)BD_ROUTER_VERSION;
	si.model = rt->model_name;
	si.arch = rt->arch;
	si.n_vocab = (uint32_t)rt->n_vocab;
	si.n_ctx = (uint32_t)rt->n_ctx;
	si.kv_config = rt->kv_config;
	si.n_kv_configs = n_names;
	si.kv_configs = names;
	si.tp = (uint32_t)rt->o.tp;
	si.backend = rt->backend;
	si.max_batch = (uint32_t)rt->o.sched.max_batch;
	si.max_queue = (uint32_t)rt->o.sched.max_queue;
	si.max_frame_bytes = (uint32_t)rt->o.max_frame;
	si.queued = (uint32_t)rt->sched.n_queued;
	si.running = (uint32_t)rt->sched.n_running;
	si.requests_total = rt->sched.requests_total;
	si.requests_failed = rt->sched.requests_failed;
	si.tokens_generated = rt->sched.tokens_generated;
	si.steps = rt->sched.steps_done;
	si.preemptions = rt->sched.preemptions;
	si.pages_total = rt->pages_total;
	si.pages_free = rt->pages_free;
	si.slots_total = rt->slots_total;
	si.slots_free = rt->slots_free;
	si.pages_peak = rt->sched.pages_peak;
	si.uptime_ms = (uint64_t)(bd_now_ms() - rt->t_start);
	si.health = &h;
	/* the ranks' decode kernels, "rank r: ..." each */
	char dk[BD_ROUTER_MAX_TP * 272] = "";
	for (int i = 0, n = 0; i < rt->o.tp; i++)
		if (*rt->w[i].decode_kernel && n < (int)sizeof(dk))
			n += snprintf(dk + n, sizeof(dk) - (size_t)n, "%srank %d: %s", n ? "; " : "",
				      i, rt->w[i].decode_kernel);
	si.decode_kernel = dk;
	rep.msg_case = BDFP4__CLIENT_REPLY__MSG_INFO;
	rep.info = &si;
	send_reply(rt, env->ident, env->ident_len, env->delim, &rep);
}

/* ---- generate ------------------------------------------------------------------------------- */

/* The kv_config a request may name: the pool's, or another of the same page format (the pages
 * are laid out the same; the write path and decoder differ per sequence). NULL: none. */
static const char *pick_kv(struct bd_router *rt, const char *name, char *err, size_t cap)
{
	const struct bd_kvcfg *pool_cfg = bd_kvcfg_find(rt->kv_config), *k;

	if (!name || !*name)
		return pool_cfg ? pool_cfg->name : NULL;
	k = bd_kvcfg_find(name);
	if (!k) {
		snprintf(err, cap, "unknown KV configuration '%.64s'", name);
		return NULL;
	}
	if (!pool_cfg || k->page_fmt != pool_cfg->page_fmt) {
		snprintf(err, cap, "KV configuration '%s' needs other pages than this server's "
				   "pool holds (%s, %s)", k->name, rt->kv_config, rt->page_format);
		return NULL;
	}
	return k->name;
}

/* Checks everything that does not need the tokenizer. Returns 0 or a ServeError with err. */
static int validate(struct bd_router *rt, const Bdfp4__GenerateRequest *g, char *err, size_t cap)
{
	int n_set = (g->prompt && *g->prompt) + (g->n_messages > 0) + (g->n_token_ids > 0);
	size_t text = 0, content = 0;

	if (g->client_tag == 0) {
		snprintf(err, cap, "client_tag must be non-zero");
		return BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
	}
	if (n_set == 0) {
		snprintf(err, cap, "empty prompt: set prompt, messages or token_ids");
		return BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
	}
	if (n_set > 1) {
		snprintf(err, cap, "set only one of prompt, messages and token_ids");
		return BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
	}
	if (g->max_tokens == 0) {
		snprintf(err, cap, "max_tokens must be at least 1");
		return BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
	}
	if (g->prompt && strlen(g->prompt) > BD_ROUTER_MAX_PROMPT_BYTES) {
		snprintf(err, cap, "prompt longer than %d bytes", BD_ROUTER_MAX_PROMPT_BYTES);
		return BDFP4__SERVE_ERROR__SERVE_ERR_OVERSIZE;
	}
	if (g->n_messages > BD_ROUTER_MAX_MESSAGES) {
		snprintf(err, cap, "more than %d messages", BD_ROUTER_MAX_MESSAGES);
		return BDFP4__SERVE_ERROR__SERVE_ERR_OVERSIZE;
	}
	for (size_t i = 0; i < g->n_messages; i++) {
		content += strlen(g->messages[i]->content);
		text += strlen(g->messages[i]->content) + strlen(g->messages[i]->role);
	}
	if (text > BD_ROUTER_MAX_PROMPT_BYTES) {
		snprintf(err, cap, "messages longer than %d bytes", BD_ROUTER_MAX_PROMPT_BYTES);
		return BDFP4__SERVE_ERROR__SERVE_ERR_OVERSIZE;
	}
	for (size_t i = 0; i < g->n_messages; i++) {
		const char *role = g->messages[i]->role;

		if (strcmp(role, "system") && strcmp(role, "user") && strcmp(role, "assistant")) {
			snprintf(err, cap, "message %zu: role '%.32s%s' is none of system, user, "
				 "assistant", i, role, strlen(role) > 32 ? "..." : "");
			return BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
		}
	}
	if (g->n_messages && content == 0) {
		snprintf(err, cap, "empty prompt: the messages hold no text");
		return BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
	}
	if (g->n_token_ids >= (size_t)rt->n_ctx) {
		snprintf(err, cap, "prompt of %zu tokens; the context holds %d", g->n_token_ids,
			 rt->n_ctx);
		return BDFP4__SERVE_ERROR__SERVE_ERR_TOO_LONG;
	}
	for (size_t i = 0; i < g->n_token_ids; i++)
		if (g->token_ids[i] < 0 || g->token_ids[i] >= rt->n_vocab) {
			snprintf(err, cap, "token id %d at %zu is outside the vocabulary (0..%d)",
				 g->token_ids[i], i, rt->n_vocab - 1);
			return BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
		}
	if (g->n_stop > BD_ROUTER_MAX_STOPS) {
		snprintf(err, cap, "more than %d stop strings", BD_ROUTER_MAX_STOPS);
		return BDFP4__SERVE_ERROR__SERVE_ERR_OVERSIZE;
	}
	for (size_t i = 0; i < g->n_stop; i++) {
		if (!*g->stop[i]) {
			snprintf(err, cap, "empty stop string");
			return BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
		}
		if (strlen(g->stop[i]) > BD_ROUTER_MAX_STOP_BYTES) {
			snprintf(err, cap, "stop string longer than %d bytes",
				 BD_ROUTER_MAX_STOP_BYTES);
			return BDFP4__SERVE_ERROR__SERVE_ERR_OVERSIZE;
		}
	}
	if (g->cache_salt && strlen(g->cache_salt) >= sizeof(((struct bd_req *)0)->cache_salt)) {
		snprintf(err, cap, "cache_salt longer than %zu bytes",
			 sizeof(((struct bd_req *)0)->cache_salt) - 1);
		return BDFP4__SERVE_ERROR__SERVE_ERR_OVERSIZE;
	}
	if (g->n_forced_tokens > g->max_tokens) {
		snprintf(err, cap, "more forced tokens than max_tokens");
		return BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
	}
	for (size_t i = 0; i < g->n_forced_tokens; i++)
		if (g->forced_tokens[i] < 0 || g->forced_tokens[i] >= rt->n_vocab) {
			snprintf(err, cap, "forced token %d at %zu is outside the vocabulary",
				 g->forced_tokens[i], i);
			return BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
		}
	if (g->logits_top_k > BD_ROUTER_MAX_TOP) {
		snprintf(err, cap, "logits_top_k above %d", BD_ROUTER_MAX_TOP);
		return BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
	}
	if (g->top_logprobs > BD_ROUTER_MAX_TOP_LOGPROBS || (g->top_logprobs && !g->logprobs)) {
		snprintf(err, cap, g->logprobs ? "top_logprobs above %d"
					      : "top_logprobs needs logprobs (%d at most)",
			 BD_ROUTER_MAX_TOP_LOGPROBS);
		return BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
	}
	if (g->sampling) {
		const Bdfp4__SamplingParams *s = g->sampling;

		if (!isfinite(s->temperature) || s->temperature < 0 || !isfinite(s->top_p) ||
		    s->top_p < 0 || s->top_p > 1 || s->top_k > (uint32_t)rt->n_vocab) {
			snprintf(err, cap, "bad sampling parameters (temperature >= 0, top_p in "
					   "(0, 1], top_k <= vocabulary)");
			return BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
		}
	}
	return 0;
}

/* Tokens of the prompt (malloc'ed) or a ServeError. */
static int tokenize(struct bd_router *rt, const Bdfp4__GenerateRequest *g, int32_t **ret,
		    size_t *ret_n, char *err, size_t cap)
{
	char terr[BD_TOKENIZER_ERR_MAX] = "";
	int e;

	if (!g->n_token_ids && !rt->tok) {
		snprintf(err, cap, "model %s has random weights and no tokenizer: send token_ids",
			 rt->model_name);
		return BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
	}
	if (g->n_token_ids) {
		*ret = malloc(g->n_token_ids * sizeof(int32_t));
		if (!*ret)
			goto nomem;
		memcpy(*ret, g->token_ids, g->n_token_ids * sizeof(int32_t));
		*ret_n = g->n_token_ids;
		return 0;
	}
	if (g->n_messages) {
		struct bd_chat_msg *m = calloc(g->n_messages, sizeof(*m));

		if (!m)
			goto nomem;
		for (size_t i = 0; i < g->n_messages; i++)
			m[i] = (struct bd_chat_msg){ g->messages[i]->role, g->messages[i]->content };
		e = bd_tokenizer_chat_apply(rt->tok, m, g->n_messages, true, ret, ret_n, terr);
		free(m);
		if (e == -ENOMEM)
			goto nomem;
		if (e < 0) {
			snprintf(err, cap, "chat template: %.200s", *terr ? terr : strerror(-e));
			return BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
		}
		return 0;
	}
	e = bd_tokenizer_encode(rt->tok, g->prompt, strlen(g->prompt), BD_TOK_ADD_SPECIAL, ret,
				ret_n);
	if (e == -ENOMEM)
		goto nomem;
	if (e < 0) {
		snprintf(err, cap, "cannot tokenize the prompt: %s", strerror(-e));
		return BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
	}
	return 0;
nomem:
	snprintf(err, cap, "out of memory");
	return BDFP4__SERVE_ERROR__SERVE_ERR_INTERNAL;
}

/* The request of g for the client of env: its prompt ids[n_ids] (copied), max_tokens already
 * cut to the context, kv its configuration. NULL when out of memory. */
static struct bd_req *new_req(struct bd_router *rt, const struct envelope *env,
			      const Bdfp4__GenerateRequest *g, const int32_t *ids, size_t n_ids,
			      int max_tokens, const char *kv)
{
	struct bd_req *r = calloc(1, sizeof(*r));

	if (!r)
		return NULL;
	r->cap = (int)n_ids + max_tokens;
	r->toks = malloc((size_t)r->cap * sizeof(int32_t));
	r->max_pages = r->cap / BD_PAGE_TOKENS + 1;
	r->pages = malloc((size_t)r->max_pages * sizeof(int32_t));
	if (!r->toks || !r->pages)
		goto nomem;
	memcpy(r->toks, ids, n_ids * sizeof(int32_t));
	r->n_prompt = (int)n_ids;
	r->max_tokens = max_tokens;
	r->tag = g->client_tag;
	memcpy(r->ident, env->ident, env->ident_len);
	r->ident_len = env->ident_len;
	r->delim = env->delim;
	r->kv_config = kv;
	bdfp4__sampling_params__init(&r->sampling);
	if (g->sampling) {
		r->sampling.temperature = g->sampling->temperature;
		r->sampling.top_k = g->sampling->top_k;
		r->sampling.top_p = g->sampling->top_p > 0 ? g->sampling->top_p : 1.0f;
		r->sampling.seed = g->sampling->seed;
	} else {
		r->sampling.top_p = 1.0f;
	}
	r->stream = g->stream;
	r->ignore_eos = g->ignore_eos;
	if (g->cache_salt) {
		r->cache_salt_len = strnlen(g->cache_salt, sizeof(r->cache_salt) - 1);
		memcpy(r->cache_salt, g->cache_salt, r->cache_salt_len);
	}
	for (size_t i = 0; i < g->n_stop; i++) {
		r->stops[i] = strdup(g->stop[i]);
		if (!r->stops[i])
			goto nomem;
		r->n_stops++;
	}
	if (g->n_forced_tokens) {
		r->forced = malloc(g->n_forced_tokens * sizeof(int32_t));
		if (!r->forced)
			goto nomem;
		memcpy(r->forced, g->forced_tokens, g->n_forced_tokens * sizeof(int32_t));
		r->n_forced = (int)g->n_forced_tokens;
	}
	r->top_k = g->logits_top_k;
	if (r->top_k) {
		r->top = calloc((size_t)max_tokens * r->top_k, sizeof(*r->top));
		if (!r->top)
			goto nomem;
		for (size_t i = 0; i < (size_t)max_tokens * r->top_k; i++) {
			bdfp4__top_logit__init(&r->top[i]);
			r->top[i].token = -1;
		}
	}
	r->logprobs = g->logprobs;
	r->top_logprobs = g->logprobs ? g->top_logprobs : 0;
	if (r->logprobs) {
		size_t n = (size_t)max_tokens * (1 + r->top_logprobs);

		r->lp = malloc(n * sizeof(*r->lp));
		if (!r->lp)
			goto nomem;
		for (size_t i = 0; i < n; i++)
			r->lp[i] = (struct bd_req_logprob){ -1, 0.0f };
	}
	bd_tokenizer_stream_init(&r->ts, BD_TOK_SKIP_SPECIAL);
	r->t_arrival = bd_now_ms();
	r->last_sent = r->t_arrival;
	r->deadline = r->t_arrival + (g->deadline_ms ? (int64_t)g->deadline_ms
						     : (int64_t)rt->o.deadline_ms);
	return r;
nomem:
	bd_req_free(r);
	return NULL;
}

static void on_generate(struct bd_router *rt, const struct envelope *env,
			const Bdfp4__GenerateRequest *g, uint64_t conn)
{
	char err[256] = "";
	const char *kv;
	int32_t *ids = NULL;
	size_t n_ids = 0;
	struct bd_req *r;
	int code, max_tokens, e;
	uint64_t pages_needed;

	if (rt->state == RS_STOPPING) {
		snprintf(err, sizeof(err), "the router is shutting down (draining %zu accepted "
				   "request(s)): no new requests; retry on another server or after "
				   "the restart", rt->sched.n_reqs);
		send_error(rt, env, g->client_tag, BDFP4__SERVE_ERROR__SERVE_ERR_SHUTTING_DOWN, err);
		return;
	}
	code = validate(rt, g, err, sizeof(err));
	if (!code && bd_sched_find(&rt->sched, env->ident, env->ident_len, g->client_tag)) {
		snprintf(err, sizeof(err), "client_tag %llu is already live on this connection",
			 (unsigned long long)g->client_tag);
		code = BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
	}
	kv = code ? NULL : pick_kv(rt, g->kv_config, err, sizeof(err));
	if (!code && !kv)
		code = BDFP4__SERVE_ERROR__SERVE_ERR_UNKNOWN_KV_CONFIG;
	if (!code)
		code = tokenize(rt, g, &ids, &n_ids, err, sizeof(err));
	if (!code && n_ids == 0) {
		snprintf(err, sizeof(err), "empty prompt: it tokenizes to nothing");
		code = BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
	}
	if (!code && n_ids >= (size_t)rt->n_ctx) {
		snprintf(err, sizeof(err), "prompt of %zu tokens; the context holds %d", n_ids,
			 rt->n_ctx);
		code = BDFP4__SERVE_ERROR__SERVE_ERR_TOO_LONG;
	}
	/* max_tokens is cut to what the context leaves */
	max_tokens = code ? 0 : (int)(g->max_tokens < (uint32_t)(rt->n_ctx - (int)n_ids)
					      ? g->max_tokens
					      : (uint32_t)(rt->n_ctx - (int)n_ids));
	pages_needed = (uint64_t)((int)n_ids + max_tokens) / BD_PAGE_TOKENS;
	if (!code && pages_needed > rt->pages_total) {
		snprintf(err, sizeof(err), "the request needs %llu pages; the pool has %llu",
			 (unsigned long long)pages_needed, (unsigned long long)rt->pages_total);
		code = BDFP4__SERVE_ERROR__SERVE_ERR_RESOURCE_EXHAUSTED;
	}
	if (!code && !rt->pool_ok) {
		/* refused at once: admitting it would only wait on a pool that does not answer */
		char pool[240];

		bd_router_pool_reason(rt, pool, sizeof(pool));
		snprintf(err, sizeof(err), "not serving: %s", pool);
		code = BDFP4__SERVE_ERROR__SERVE_ERR_UNAVAILABLE;
	}
	/* while the running requests wait for the group to form again, new ones queue behind them
	 * (and share their resume_timeout_ms) */
	if (!code && rt->state != RS_SERVING && !bd_sched_resuming(&rt->sched)) {
		snprintf(err, sizeof(err), "not serving: %.200s", rt->reason);
		code = BDFP4__SERVE_ERROR__SERVE_ERR_UNAVAILABLE;
	}
	r = code ? NULL : new_req(rt, env, g, ids, n_ids, max_tokens, kv);
	free(ids);
	if (r)
		r->conn = conn;
	if (!code && !r) {
		snprintf(err, sizeof(err), "out of memory");
		code = BDFP4__SERVE_ERROR__SERVE_ERR_INTERNAL;
	}
	e = code ? 0 : bd_sched_submit(&rt->sched, r);
	if (e == -ENOSPC) {
		snprintf(err, sizeof(err), "the queue is full (%d requests waiting)",
			 rt->o.sched.max_queue);
		code = BDFP4__SERVE_ERROR__SERVE_ERR_RESOURCE_EXHAUSTED;
	} else if (e < 0) {
		snprintf(err, sizeof(err), "out of memory");
		code = BDFP4__SERVE_ERROR__SERVE_ERR_INTERNAL;
	}
	if (e < 0)
		bd_req_free(r);
	if (code) {
		send_error(rt, env, g->client_tag, code, err);
		return;
	}
	bd_log_debug("request %llu: %d prompt tokens, max %d, %s", (unsigned long long)r->id,
		     r->n_prompt, r->max_tokens, r->kv_config);
}

static void on_cancel(struct bd_router *rt, const struct envelope *env, uint64_t tag)
{
	Bdfp4__ClientReply rep = BDFP4__CLIENT_REPLY__INIT;
	Bdfp4__CancelReply cr = BDFP4__CANCEL_REPLY__INIT;
	struct bd_req *r = bd_sched_find(&rt->sched, env->ident, env->ident_len, tag);

	cr.client_tag = tag;
	cr.error = r ? BDFP4__SERVE_ERROR__SERVE_OK : BDFP4__SERVE_ERROR__SERVE_ERR_NOT_FOUND;
	rep.msg_case = BDFP4__CLIENT_REPLY__MSG_CANCEL;
	rep.cancel = &cr;
	if (send_reply(rt, env->ident, env->ident_len, env->delim, &rep) < 0)
		bd_sched_client_gone(&rt->sched, env->ident, env->ident_len);
	else if (r)
		bd_sched_cancel(&rt->sched, r);
}

static void handle(struct bd_router *rt, const struct envelope *env, const uint8_t *data,
		   size_t len)
{
	Bdfp4__ClientRequest *req;

	if (len > (size_t)rt->o.max_frame) {
		char m[96];

		snprintf(m, sizeof(m), "frame of %zu bytes; the limit is %d", len, rt->o.max_frame);
		send_error(rt, env, 0, BDFP4__SERVE_ERROR__SERVE_ERR_OVERSIZE, m);
		return;
	}
	req = bdfp4__client_request__unpack(NULL, len, data);
	if (!req) {
		send_error(rt, env, 0, BDFP4__SERVE_ERROR__SERVE_ERR_MALFORMED,
			   "the frame is not a ClientRequest");
		return;
	}
	/* a routing id that reappears under another connection: its predecessor is gone */
	bd_sched_client_replaced(&rt->sched, env->ident, env->ident_len, req->connection);
	switch (req->msg_case) {
	case BDFP4__CLIENT_REQUEST__MSG_GENERATE:
		on_generate(rt, env, req->generate, req->connection);
		break;
	case BDFP4__CLIENT_REQUEST__MSG_CANCEL:
		on_cancel(rt, env, req->cancel->client_tag);
		break;
	case BDFP4__CLIENT_REQUEST__MSG_HEALTH:
		on_health(rt, env);
		break;
	case BDFP4__CLIENT_REQUEST__MSG_INFO:
		on_info(rt, env);
		break;
	default:
		send_error(rt, env, 0, BDFP4__SERVE_ERROR__SERVE_ERR_UNKNOWN_TYPE,
			   "no request type set (unknown message?)");
		break;
	}
	bdfp4__client_request__free_unpacked(req, NULL);
}

void bd_router_on_frontend(struct bd_router *rt)
{
	for (int budget = 0; budget < 256; budget++) {
		zmq_msg_t parts[3];
		struct envelope env = { 0 };
		/* [identity] payload, or [identity] "" payload from a REQ */
		int n = bd_router_recv(rt->front, parts, 3);

		if (!n)
			return;
		env.ident_len = zmq_msg_size(&parts[0]);
		if (env.ident_len > sizeof(env.ident))
			env.ident_len = sizeof(env.ident);
		memcpy(env.ident, zmq_msg_data(&parts[0]), env.ident_len);
		if (n == 2) {
			handle(rt, &env, zmq_msg_data(&parts[1]), zmq_msg_size(&parts[1]));
		} else if (n == 3 && zmq_msg_size(&parts[1]) == 0) {
			env.delim = true;
			handle(rt, &env, zmq_msg_data(&parts[2]), zmq_msg_size(&parts[2]));
		} else {
			send_error(rt, &env, 0, BDFP4__SERVE_ERROR__SERVE_ERR_MALFORMED,
				   "one ClientRequest frame per message");
		}
		bd_router_frames_close(parts, n, 3);
	}
}
