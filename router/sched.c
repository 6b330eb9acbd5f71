/* sched.c — routerd's scheduler (sched.h): events in, actions out, the pool through its
 * interface; no socket, no clock of its own. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/bd_log.h"
#include "base/bd_rand.h"
#include "model/bd_sampler.h"
#include "quant/bd_layout.h"
#include "pool/bd_prefix.h"
#include "sched.h"

/* ---- requests and actions ------------------------------------------------------------------- */

void bd_req_free(struct bd_req *r)
{
	if (!r)
		return;
	free(r->toks);
	free(r->pages);
	free(r->hashes);
	for (int i = 0; i < r->n_stops; i++)
		free(r->stops[i]);
	free(r->forced);
	free(r->top);
	free(r->lp);
	free(r->text);
	free(r);
}

/* Grows the array that the pointer at pp points to (*cap elements of size bytes) to hold n,
 * doubling. 0 or -ENOMEM (the array is left as it was). */
static int grow(void *pp, size_t *cap, size_t n, size_t size)
{
	size_t c = *cap ? *cap : 16;
	void *p, *q;

	if (n <= *cap)
		return 0;
	while (c < n)
		c *= 2;
	memcpy(&p, pp, sizeof(p));
	q = realloc(p, c * size);
	if (!q)
		return -ENOMEM;
	memcpy(pp, &q, sizeof(q));
	*cap = c;
	return 0;
}

static void push_act(struct bd_sched *s, const struct bd_sched_act *a)
{
	if (grow(&s->acts, &s->cap_acts, s->n_acts + 1, sizeof(*s->acts)) < 0) {
		bd_log_err("out of memory: an action for request %llu is lost",
			   a->r ? (unsigned long long)a->r->id : 0ull);
		return;
	}
	s->acts[s->n_acts++] = *a;
}

static void push_chunk(struct bd_sched *s, struct bd_req *r, int finish, int error,
		       const char *msg)
{
	struct bd_sched_act a = { .kind = BD_SCHED_CHUNK, .r = r, .finish = finish,
				  .error = error, .msg = msg };

	push_act(s, &a);
}

bool bd_sched_next(struct bd_sched *s, struct bd_sched_act *ret)
{
	if (s->next_act < s->n_acts) {
		*ret = s->acts[s->next_act++];
		return true;
	}
	s->n_acts = s->next_act = 0;
	while (s->ended) {
		struct bd_req *r = s->ended;

		s->ended = r->next_ended;
		bd_req_free(r);
	}
	return false;
}

int bd_sched_submit(struct bd_sched *s, struct bd_req *r)
{
	if (s->n_queued >= (size_t)s->cfg.max_queue)
		return -ENOSPC;
	if (grow(&s->reqs, &s->cap_reqs, s->n_reqs + 1, sizeof(*s->reqs)) < 0)
		return -ENOMEM;
	r->id = s->next_id++;
	r->order = s->next_order++;
	r->state = RQ_QUEUED;
	r->slot = -1;
	r->reserved = -1;
	if (!r->sampling.seed) {
		uint64_t x = r->id ^ (uint64_t)r->t_arrival;

		r->sampling.seed = bd_splitmix64(&x) | 1;
	}
	s->reqs[s->n_reqs++] = r;
	s->n_queued++;
	s->requests_total++;
	return 0;
}

struct bd_req *bd_sched_find(struct bd_sched *s, const uint8_t *ident, size_t len, uint64_t tag)
{
	for (size_t i = 0; i < s->n_reqs; i++) {
		struct bd_req *r = s->reqs[i];

		if (r->tag == tag && r->ident_len == len && !memcmp(r->ident, ident, len) &&
		    !r->finish_pending)
			return r;
	}
	return NULL;
}

/* r leaves the live list for the ended one (freed once the actions are drained). */
static void retire(struct bd_sched *s, struct bd_req *r)
{
	for (size_t i = 0; i < s->n_reqs; i++)
		if (s->reqs[i] == r) {
			memmove(s->reqs + i, s->reqs + i + 1, (s->n_reqs - i - 1) * sizeof(*s->reqs));
			s->n_reqs--;
			break;
		}
	r->next_ended = s->ended;
	s->ended = r;
}

static void push_release(struct bd_sched *s, uint64_t id)
{
	if (grow(&s->release, &s->cap_release, s->n_release + 1, sizeof(*s->release)) < 0)
		return; /* the worker keeps a dead sequence until its next reset */
	s->release[s->n_release++] = id;
}

/* ---- the pool -------------------------------------------------------------------------------- */

static bool pool_down(const struct bd_sched *s, char *why, size_t cap)
{
	return s->pool->down(s->pool_ctx, why, cap);
}

static void held_add(struct bd_sched *s, int64_t n)
{
	s->pages_held = (uint64_t)((int64_t)s->pages_held + n);
	if (s->pages_held > s->pages_peak)
		s->pages_peak = s->pages_held;
}

/* Gives back everything r holds in the pool; the workers drop its sequence in the next plan. */
static void release_all(struct bd_sched *s, struct bd_req *r)
{
	if (r->pool_held) {
		int e = s->pool->release(s->pool_ctx, r->id);

		/* a record left behind is reclaimed when the pool answers again; a pool that is
		 * down was logged once, by its watch */
		if (e < 0 && e != -ENOENT && !pool_down(s, NULL, 0))
			bd_log_warn("request %llu: pool release: %s", (unsigned long long)r->id,
				    strerror(-e));
		held_add(s, -(int64_t)(r->n_pages + (r->reserved >= 0)));
	}
	r->pool_held = false;
	r->slot = -1;
	r->n_pages = 0;
	r->n_cached = r->n_stored = 0;
	r->reserved = -1;
	if (r->on_workers)
		push_release(s, r->id);
	r->on_workers = false;
	r->n_pos = 0;
}

/* ---- output text ----------------------------------------------------------------------------- */

/* Advances r->shown to what is final; true when a stop string matched (text cut there). */
static bool text_scan(struct bd_req *r, bool final)
{
	bool hit = bd_stop_text_scan(r->text, r->len, (const char *const *)r->stops, r->n_stops,
				     final, &r->shown);

	if (hit) {
		r->len = r->shown;
		r->text[r->len] = 0;
	}
	return hit;
}

/* The end of the text stream: a held-back partial character, then the held-back tail. */
static void text_final(struct bd_sched *s, struct bd_req *r, int reason)
{
	size_t n = 0;

	if (reason == BDFP4__FINISH_REASON__FINISH_STOP_STRING)
		return;
	if (s->cfg.tok && bd_tokenizer_stream_flush(&r->ts, s->piece, s->piece_cap, &n) == 0 && n)
		bd_stop_text_append(&r->text, &r->len, &r->cap_text, s->piece, n);
	text_scan(r, true);
}

/* Appends generated token t; returns the finish reason it causes (FINISH_NONE: go on). */
static int append_token(struct bd_sched *s, struct bd_req *r, int32_t t)
{
	size_t n = 0;

	r->toks[r->n_prompt + r->n_gen++] = t;
	s->tokens_generated++;
	if (s->cfg.eog[t] && !r->ignore_eos)
		return BDFP4__FINISH_REASON__FINISH_STOP;
	if (s->cfg.tok &&
	    bd_tokenizer_stream_push(s->cfg.tok, &r->ts, t, s->piece, s->piece_cap, &n) == 0 && n)
		bd_stop_text_append(&r->text, &r->len, &r->cap_text, s->piece, n);
	if (text_scan(r, false))
		return BDFP4__FINISH_REASON__FINISH_STOP_STRING;
	if (r->n_gen >= r->max_tokens)
		return BDFP4__FINISH_REASON__FINISH_LENGTH;
	return BDFP4__FINISH_REASON__FINISH_NONE;
}

/* ---- ending ---------------------------------------------------------------------------------- */

/* Ends r: releases what it holds, queues the final chunk when notify, retires it. A request in
 * the step in flight is marked and ended when the step completes (or is lost). */
static void finish(struct bd_sched *s, struct bd_req *r, int reason, int error, const char *msg,
		   bool notify)
{
	char m[sizeof(r->fin_msg)];

	snprintf(m, sizeof(m), "%s", msg ? msg : "");
	if (r->in_step) {
		if (!r->finish_pending) {
			r->finish_pending = true;
			r->fin_reason = reason;
			r->fin_error = error;
			r->fin_notify = notify;
			memcpy(r->fin_msg, m, sizeof(m));
		}
		return;
	}
	if (r->state == RQ_RUNNING)
		s->n_running--;
	else
		s->n_queued--;
	release_all(s, r);
	if (reason == BDFP4__FINISH_REASON__FINISH_ERROR)
		s->requests_failed++;
	r->finish_pending = false;
	r->fin_reason = reason;
	r->fin_error = error;
	memcpy(r->fin_msg, m, sizeof(m));
	if (notify) {
		text_final(s, r, reason);
		push_chunk(s, r, reason, error, r->fin_msg);
	}
	bd_log_debug("request %llu finished: %d (%s), %d tokens", (unsigned long long)r->id, reason,
		     m, r->n_gen);
	retire(s, r);
}

/* A finish decided while r was in the step now takes effect. */
static bool apply_pending(struct bd_sched *s, struct bd_req *r)
{
	if (!r->finish_pending)
		return false;
	r->finish_pending = false;
	finish(s, r, r->fin_reason, r->fin_error, r->fin_msg, r->fin_notify);
	return true;
}

void bd_sched_cancel(struct bd_sched *s, struct bd_req *r)
{
	bd_log_info("request %llu: cancelled by the client", (unsigned long long)r->id);
	finish(s, r, BDFP4__FINISH_REASON__FINISH_CANCELLED,
	       BDFP4__SERVE_ERROR__SERVE_ERR_CANCELLED, "cancelled by the client", true);
}

/* The loops below run from the newest request: finish() retires only the one it is given, so
 * the indices still to visit stay valid. */

void bd_sched_client_gone(struct bd_sched *s, const uint8_t *ident, size_t len)
{
	for (size_t i = s->n_reqs; i-- > 0;) {
		struct bd_req *r = s->reqs[i];

		if (r->ident_len != len || memcmp(r->ident, ident, len) || r->finish_pending)
			continue;
		bd_log_info("request %llu: client gone, cancelled", (unsigned long long)r->id);
		finish(s, r, BDFP4__FINISH_REASON__FINISH_CANCELLED,
		       BDFP4__SERVE_ERROR__SERVE_ERR_CANCELLED, "client disconnected", false);
	}
}

/* Every live request that is not ending already ends FINISH_ERROR with (error, msg). */
static void fail_all(struct bd_sched *s, int error, const char *msg)
{
	for (size_t i = s->n_reqs; i-- > 0;)
		if (!s->reqs[i]->finish_pending)
			finish(s, s->reqs[i], BDFP4__FINISH_REASON__FINISH_ERROR, error, msg, true);
}

int bd_sched_client_replaced(struct bd_sched *s, const uint8_t *ident, size_t len,
			     uint64_t conn)
{
	int n = 0;

	for (size_t i = s->n_reqs; conn && i-- > 0;) {
		struct bd_req *r = s->reqs[i];

		if (r->ident_len != len || memcmp(r->ident, ident, len) || r->finish_pending ||
		    !r->conn || r->conn == conn)
			continue;
		bd_log_info("request %llu: its routing id reconnected (connection %llx, was "
			    "%llx): cancelled", (unsigned long long)r->id,
			    (unsigned long long)conn, (unsigned long long)r->conn);
		finish(s, r, BDFP4__FINISH_REASON__FINISH_CANCELLED,
		       BDFP4__SERVE_ERROR__SERVE_ERR_CANCELLED, "client reconnected", false);
		n++;
	}
	return n;
}

void bd_sched_tick(struct bd_sched *s, int64_t now)
{
	if (!s->group_ready && s->resume_by && now >= s->resume_by) {
		char m[sizeof(s->down_msg) + 96];

		snprintf(m, sizeof(m), "the worker group did not form again within "
			 "resume_timeout_ms (%d ms): %s", s->cfg.resume_timeout_ms, s->down_msg);
		bd_log_warn("%zu request(s) fail: %s", s->n_reqs, m);
		s->resume_by = 0;
		fail_all(s, BDFP4__SERVE_ERROR__SERVE_ERR_WORKER_FAILED, m);
	}
	for (size_t i = s->n_reqs; i-- > 0;) {
		struct bd_req *r = s->reqs[i];
		char m[96];

		if (now < r->deadline || r->finish_pending)
			continue;
		snprintf(m, sizeof(m), "deadline of %lld ms passed",
			 (long long)(r->deadline - r->t_arrival));
		finish(s, r, BDFP4__FINISH_REASON__FINISH_ERROR,
		       BDFP4__SERVE_ERROR__SERVE_ERR_DEADLINE_EXCEEDED, m, true);
	}
}

void bd_sched_pool_down(struct bd_sched *s, const char *msg)
{
	fail_all(s, BDFP4__SERVE_ERROR__SERVE_ERR_UNAVAILABLE, msg);
}

bool bd_sched_pool_busy(const struct bd_sched *s)
{
	if (s->step.active)
		return true;
	for (size_t i = 0; i < s->n_reqs; i++)
		if (s->reqs[i]->pool_held)
			return true;
	return false;
}

/* ---- admission and preemption ---------------------------------------------------------------- */

/* Lookups and stores need the pool's two calls, and workers that continue a prompt at a
 * position > 0: a hit's suffix is prefilled after the cached pages (not with whole_prompts). */
static bool prefix_on(const struct bd_sched *s)
{
	return s->cfg.prefix_cache && !s->whole_prompts && s->pool->prefix_match &&
	       s->pool->prefix_store;
}

void bd_sched_set_prefix(struct bd_sched *s, bool on, uint64_t seed)
{
	s->cfg.prefix_cache = on;
	s->cfg.prefix_seed = seed;
}

/* The leading pages of r's fill of n tokens that kvpoold has indexed become its first pages
 * (r->n_cached; its prefill starts after them). At most (n − 1) / 128 pages: the last token is
 * always prefilled, for its logits. None with batch_invariant: a hit's sink is rebuilt by a
 * 16-token prefill, whose products may round otherwise than the longer first chunk that wrote
 * the original sink (router/README.md "Prefix caching"), and batch_invariant promises the
 * tokens of a run alone bit for bit. A lookup that fails costs the hit, not the request. */
static void match_prefix(struct bd_sched *s, struct bd_req *r, int n)
{
	int np = n / BD_PAGE_TOKENS, look = s->cfg.batch_invariant ? 0 : (n - 1) / BD_PAGE_TOKENS;
	uint64_t seed;
	size_t k = 0;

	if (!prefix_on(s) || np < 1)
		return;
	if (!r->hashes && !(r->hashes = calloc((size_t)r->max_pages, sizeof(*r->hashes))))
		return;
	/* the request's own KV configuration (one of the pool's page format) and its salt */
	seed = bd_prefix_request_seed(s->cfg.prefix_seed, r->kv_config, r->cache_salt,
				      r->cache_salt_len);
	bd_prefix_hashes(seed, r->toks, np, r->hashes);
	r->n_hashed = np;
	s->prefix_queries += (uint64_t)look * BD_PAGE_TOKENS;
	if (look < 1 || s->pool->prefix_match(s->pool_ctx, r->id, r->hashes, (size_t)look, r->pages,
					     &k) < 0)
		return;
	s->prefix_hits += (uint64_t)k * BD_PAGE_TOKENS;
	r->n_cached = r->n_stored = (int)k;
}

/* Indexes r's promoted pages past those indexed already, up to its hashed ones: the pages its
 * prefill has filled. A refusal costs later hits only. */
static void store_prefix(struct bd_sched *s, struct bd_req *r)
{
	int upto = r->n_pos / BD_PAGE_TOKENS, from = r->n_stored;

	if (upto > r->n_hashed)
		upto = r->n_hashed;
	if (!prefix_on(s) || !r->hashes || upto <= from)
		return;
	if (s->pool->prefix_store(s->pool_ctx, r->id, r->pages + from, r->hashes + from,
				  (size_t)(upto - from), r->toks + (size_t)from * BD_PAGE_TOKENS,
				  from ? r->hashes[from - 1] : 0) == 0)
		r->n_stored = upto;
}

/* Slot and prefill pages for r: the leading ones from the prefix index when it has them, the
 * rest allocated. 0, -ENOSPC (the pool is short: nothing held), other -errno. */
static int admit(struct bd_sched *s, struct bd_req *r, int64_t now)
{
	int n = r->n_prompt + r->n_gen, np = n / BD_PAGE_TOKENS, e;

	e = s->pool->slot_assign(s->pool_ctx, r->id, &r->slot);
	if (e < 0)
		return e;
	r->pool_held = true;
	r->n_cached = r->n_stored = 0;
	match_prefix(s, r, n);
	if (np > r->n_cached) {
		e = s->pool->page_alloc(s->pool_ctx, r->id, (uint32_t)(np - r->n_cached),
					r->pages + r->n_cached);
		if (e < 0) {
			s->pool->release(s->pool_ctx, r->id);
			r->pool_held = false;
			r->slot = -1;
			r->n_cached = r->n_stored = 0;
			return e;
		}
	}
	r->n_pages = np;
	held_add(s, np);
	/* the cached pages are its KV: the prefill goes on after them, on a fresh slot */
	r->n_pos = r->n_cached * BD_PAGE_TOKENS;
	r->resume = r->n_cached > 0;
	r->state = RQ_RUNNING;
	s->n_queued--;
	s->n_running++;
	if (!r->t_admit)
		r->t_admit = now;
	return 0;
}

/* Releases r's pages and slot and puts it back in the queue; its tokens are recomputed by a
 * prefill of prompt + generated when it is admitted again. */
static void preempt(struct bd_sched *s, struct bd_req *r)
{
	bd_log_info("request %llu preempted (pool full): %d tokens to recompute",
		    (unsigned long long)r->id, r->n_prompt + r->n_gen);
	release_all(s, r);
	r->state = RQ_QUEUED;
	s->n_running--;
	s->n_queued++;
	r->preemptions++;
	s->preemptions++;
}

/* The running request admitted last (largest order): the cheapest to lose. */
static struct bd_req *pick_victim(struct bd_sched *s)
{
	struct bd_req *v = NULL;

	for (size_t i = 0; i < s->n_reqs; i++) {
		struct bd_req *r = s->reqs[i];

		if (r->state == RQ_RUNNING && !r->finish_pending && (!v || r->order > v->order))
			v = r;
	}
	return v;
}

/* Makes sure r has the page its next decode promotes into. Returns 0, or -ENOSPC when r itself
 * was preempted, or another -errno (r must fail). */
static int ensure_reserved(struct bd_sched *s, struct bd_req *r)
{
	for (;;) {
		int e = s->pool->page_reserve(s->pool_ctx, r->id, &r->reserved);
		struct bd_req *v;

		if (e == 0) {
			held_add(s, 1);
			return 0;
		}
		r->reserved = -1;
		/* the pool is full, or this router's quota in it spent: room comes from its own */
		if (e != -ENOSPC && e != -EDQUOT)
			return e;
		v = pick_victim(s);
		if (!v)
			return -ENOSPC;
		preempt(s, v);
		if (v == r)
			return -ENOSPC;
	}
}

static void fail_req(struct bd_sched *s, struct bd_req *r, int error, const char *what, int e)
{
	char m[600];

	if (pool_down(s, m, sizeof(m)))
		/* not the request's fault, nor an internal error: the pool does not answer */
		error = BDFP4__SERVE_ERROR__SERVE_ERR_UNAVAILABLE;
	else
		snprintf(m, sizeof(m), "%s: %s", what, strerror(-e));
	bd_log_warn("request %llu: %s", (unsigned long long)r->id, m);
	finish(s, r, BDFP4__FINISH_REASON__FINISH_ERROR, error, m, true);
}

/* ---- steps ----------------------------------------------------------------------------------- */

/* True when r's workers hold its whole prefill: its rows are decodes. */
static bool decoding(const struct bd_req *r)
{
	return r->state == RQ_RUNNING && r->n_pos > 0 && r->n_pos >= r->n_fill;
}

/* The tokens of r's next prefill row when `left` tokens of the step's budget are left: the
 * rest of its prefill when it fits (max_prefill_chunk and the budget), else whole pages up to
 * both (a chunk other than the last ends on a page boundary, so that the next one starts on
 * one); 0 when not a page fits. max_prefill_chunk 0: the whole prefill, budget or not (the
 * caller keeps one prompt a step at least). batch_invariant: min(rest, max_prefill_chunk) or
 * 0 when the budget cannot take that, so the chunks of a prompt are the same whatever else
 * the steps hold. The group's workers (bd_sched_set_workers) may take whole prompts only (then
 * the rest, as for max_prefill_chunk 0) or rows of at most max_row tokens (the chunk is cut
 * to whole pages within it, also with max_prefill_chunk 0). */
static int chunk_len(const struct bd_sched *s, const struct bd_req *r, int left)
{
	int rest = r->n_fill - r->n_pos, c = s->cfg.max_prefill_chunk, n;

	int cap = s->max_row >= BD_PAGE_TOKENS ? s->max_row - s->max_row % BD_PAGE_TOKENS : 0;

	if (s->whole_prompts)
		return rest;
	if (c <= 0) /* whole prompts, but never a row longer than the workers take */
		return cap && rest > cap ? cap : rest;
	if (cap && c > cap)
		c = cap;
	if (s->cfg.batch_invariant) {
		n = rest < c ? rest : c;
		return n <= left ? n : 0;
	}
	if (rest <= c && rest <= left)
		return rest;
	n = c < left ? c : left;
	n -= n % BD_PAGE_TOKENS;
	return n < rest ? n : rest;
}

/* Decode rows, then the next chunk of each prefill under way, then admissions; fills
 * s->step.rows. Returns the rows or -ENOMEM. */
static int plan_rows(struct bd_sched *s, int64_t now)
{
	struct bd_sched_step *st = &s->step;
	int n = 0, prefill_tokens = 0, e;
	bool preempted = false;

	if (grow(&st->rows, &st->cap_rows, (size_t)s->cfg.max_batch, sizeof(*st->rows)) < 0)
		return -ENOMEM;
	/* the page each decode fills, before any row is fixed (a preemption may drop one) */
	for (size_t i = 0; i < s->n_reqs; i++) {
		struct bd_req *r = s->reqs[i];
		uint64_t before = s->preemptions;

		if (!decoding(r) || r->finish_pending)
			continue;
		if ((r->n_pos + 1) % BD_PAGE_TOKENS || r->reserved >= 0)
			continue;
		e = ensure_reserved(s, r);
		preempted |= s->preemptions != before;
		if (e < 0 && e != -ENOSPC) {
			fail_req(s, r, BDFP4__SERVE_ERROR__SERVE_ERR_INTERNAL, "pool reserve", e);
			i = (size_t)-1; /* the list changed; rows are built below, so restart */
		}
	}
	for (size_t i = 0; i < s->n_reqs && n < s->cfg.max_batch; i++) {
		struct bd_req *r = s->reqs[i];

		if (!decoding(r))
			continue;
		st->rows[n++] = (struct bd_sched_row){
			.r = r, .n_feed = 1,
			.new_page = (r->n_pos + 1) % BD_PAGE_TOKENS ? -1 : r->reserved,
		};
	}
	/* prefills under way, oldest first: their next chunk within the step's budget */
	for (size_t i = 0; i < s->n_reqs && n < s->cfg.max_batch; i++) {
		struct bd_req *r = s->reqs[i];
		int feed;

		if (r->state != RQ_RUNNING || r->n_pos >= r->n_fill)
			continue;
		if (s->whole_prompts && r->n_pos > 0) {
			/* a group that cannot continue a prompt: its pages were allocated at
			 * admission, so the prefill starts over at 0 and rewrites them */
			r->n_pos = 0;
			r->resume = false;
		}
		feed = chunk_len(s, r, s->cfg.max_prefill_tokens - prefill_tokens);
		if (feed <= 0)
			break;
		prefill_tokens += feed;
		st->rows[n++] = (struct bd_sched_row){ .r = r, .prefill = true, .n_feed = feed,
						       .new_page = -1 };
	}
	/* admissions, oldest first, unless the pool just ran short */
	for (size_t i = 0; i < s->n_reqs && !preempted && n < s->cfg.max_batch; i++) {
		struct bd_req *r = s->reqs[i];
		int feed;

		if (r->state != RQ_QUEUED)
			continue;
		r->n_pos = 0;
		r->n_fill = r->n_prompt + r->n_gen;
		feed = chunk_len(s, r, s->cfg.max_prefill_tokens - prefill_tokens);
		if (feed <= 0 ||
		    (prefill_tokens && prefill_tokens + feed > s->cfg.max_prefill_tokens))
			break;
		e = admit(s, r, now);
		if (e == 0 && r->n_pos > 0) /* a prefix hit: less to prefill */
			feed = chunk_len(s, r, s->cfg.max_prefill_tokens - prefill_tokens);
		if (e == -ENOSPC || e == -EDQUOT) {
			if (s->n_running == 0) {
				/* nothing of ours runs, so nothing of ours will free room: this
				 * router's quota is spent, or others hold the pool (the frontend
				 * refuses a request larger than the whole pool) */
				fail_req(s, r, BDFP4__SERVE_ERROR__SERVE_ERR_RESOURCE_EXHAUSTED,
					 e == -EDQUOT ? "this router's quota in the pool (kvpoold's "
							"owner_max_*) is spent"
						      : "the pool has no room for this request now "
							"(other owners hold its pages or slots, or it "
							"needs more than the pool has)",
					 e);
				i--;
				continue;
			}
			break;
		}
		if (e < 0) {
			fail_req(s, r, BDFP4__SERVE_ERROR__SERVE_ERR_INTERNAL, "pool admission", e);
			i--;
			continue;
		}
		prefill_tokens += feed;
		st->rows[n++] = (struct bd_sched_row){ .r = r, .prefill = true, .n_feed = feed,
						       .new_page = -1 };
	}
	/* one step ahead: the page the next decode of each row will fill (a chunk that leaves
	 * more to prefill ends on a page boundary, so it never asks for one) */
	for (int k = 0; k < n; k++) {
		struct bd_req *r = st->rows[k].r;
		int next = r->n_pos + st->rows[k].n_feed;

		if ((next + 1) % BD_PAGE_TOKENS || r->reserved >= 0)
			continue;
		/* short of pages: the next plan reserves it, or preempts */
		if (s->pool->page_reserve(s->pool_ctx, r->id, &r->reserved) == 0)
			held_add(s, 1);
		else
			r->reserved = -1;
	}
	return n;
}

/* The StepPlan of the n rows in s->step.rows and the pending releases. 0 or -ENOMEM. */
static int build_plan(struct bd_sched *s, int n)
{
	struct bd_sched_step *st = &s->step;

	if (grow(&st->release, &st->cap_release, s->n_release, sizeof(*st->release)) < 0 ||
	    grow(&st->prow, &st->cap_prow, (size_t)n, sizeof(*st->prow)) < 0 ||
	    grow(&st->pprow, &st->cap_pprow, (size_t)n, sizeof(*st->pprow)) < 0)
		return -ENOMEM;
	for (int k = 0; k < n; k++) {
		const struct bd_sched_row *sr = &st->rows[k];
		struct bd_req *r = sr->r;
		Bdfp4__PlanRow *p = &st->prow[k];

		bdfp4__plan_row__init(p);
		p->request_id = r->id;
		p->prefill = sr->prefill;
		p->position = r->n_pos;
		p->n_tokens = (size_t)sr->n_feed;
		p->tokens = r->toks + r->n_pos;
		p->slot = r->slot;
		p->resume = r->resume && r->n_pos > 0;
		p->sample = !sr->prefill || r->n_pos + sr->n_feed == r->n_fill;
		p->logits_top_k = p->sample ? r->top_k : 0;
		p->logprobs = p->sample && r->logprobs;
		p->top_logprobs = p->logprobs ? r->top_logprobs : 0;
		if (sr->prefill) {
			/* the pages this chunk fills; those before it are promoted */
			int first = r->n_pos / BD_PAGE_TOKENS;

			p->n_block_table = (size_t)first;
			p->block_table = r->pages;
			p->n_new_pages = (size_t)((r->n_pos + sr->n_feed) / BD_PAGE_TOKENS - first);
			p->new_pages = r->pages + first;
			p->capacity = (uint32_t)r->cap;
			p->kv_config = (char *)r->kv_config;
			p->sampling = &r->sampling;
		} else {
			p->n_block_table = (size_t)r->n_pages;
			p->block_table = r->pages;
			p->n_new_pages = sr->new_page >= 0 ? 1 : 0;
			p->new_pages = (int32_t *)&sr->new_page;
		}
		if (p->resume) {
			/* what a worker that holds nothing of r rebuilds it from */
			p->capacity = (uint32_t)r->cap;
			p->kv_config = (char *)r->kv_config;
			p->sampling = &r->sampling;
			p->draws = (uint64_t)r->n_gen;
		}
		if (p->resume && sr->prefill && r->n_cached && !r->on_workers &&
		    r->n_pos == r->n_cached * BD_PAGE_TOKENS) {
			/* a prefix hit's first chunk: the sink is rebuilt from its tokens */
			p->prefix_pages = (uint32_t)r->n_cached;
			p->n_context = (size_t)r->n_pos;
			p->context = r->toks;
		}
		st->pprow[k] = p;
	}
	if (s->n_release)
		memcpy(st->release, s->release, s->n_release * sizeof(*s->release));
	bdfp4__step_plan__init(&st->plan);
	st->plan.epoch = s->epoch;
	st->plan.step = s->next_step;
	st->plan.n_rows = (size_t)n;
	st->plan.rows = st->pprow;
	st->plan.n_release = s->n_release;
	st->plan.release = st->release;
	return 0;
}

void bd_sched_schedule(struct bd_sched *s, int64_t now)
{
	struct bd_sched_act a = { .kind = BD_SCHED_PLAN };
	int n;

	/* nothing is planned while the pool is down (the requests fail: bd_sched_pool_down),
	 * except the releases the workers are owed */
	if (!s->group_ready || s->step.active)
		return;
	if (pool_down(s, NULL, 0) && !s->n_release)
		return;
	if (!s->n_running && !s->n_queued && !s->n_release)
		return;
	n = plan_rows(s, now);
	if (n < 0 || (n == 0 && !s->n_release))
		return;
	if (build_plan(s, n) < 0) {
		bd_log_err("out of memory for the plan of step %llu",
			   (unsigned long long)s->next_step);
		return;
	}
	bd_log_debug("step %llu: %d row(s), %zu release(s)", (unsigned long long)s->next_step, n,
		     s->n_release);
	s->step.active = true;
	s->step.id = s->next_step++;
	s->step.n_rows = n;
	for (int k = 0; k < n; k++)
		s->step.rows[k].r->in_step = true;
	s->n_release = 0;
	a.plan = &s->step.plan;
	push_act(s, &a);
}

/* The step in flight is lost (the group failed, the router stops): its requests end as they
 * were ending, or fail with (error, msg). */
static void abort_step(struct bd_sched *s, int error, const char *msg)
{
	if (!s->step.active)
		return;
	s->step.active = false;
	for (int k = 0; k < s->step.n_rows; k++) {
		struct bd_req *r = s->step.rows[k].r;

		r->in_step = false;
		r->on_workers = false;
		if (!apply_pending(s, r))
			finish(s, r, BDFP4__FINISH_REASON__FINISH_ERROR, error, msg, true);
	}
	s->step.n_rows = 0;
}

/* The error of row k on any rank, into m; 0 when every rank ran it. */
static int row_error(const struct bd_sched *s, Bdfp4__StepResult *const *res, int n_ranks, int k,
		     char *m, size_t cap)
{
	for (int rank = 0; rank < n_ranks; rank++) {
		const Bdfp4__StepResult *rs = res[rank];

		if (rs->error) {
			snprintf(m, cap, "worker rank %d: %s", rank,
				 *rs->message ? rs->message : "step failed");
			return (int)rs->error;
		}
		if (rs->n_rows != (size_t)s->step.n_rows ||
		    rs->rows[k]->request_id != s->step.rows[k].r->id) {
			snprintf(m, cap, "worker rank %d: result rows do not match the plan", rank);
			return BDFP4__SERVE_ERROR__SERVE_ERR_INTERNAL;
		}
		if (rs->rows[k]->error) {
			snprintf(m, cap, "worker rank %d: %s", rank,
				 *rs->rows[k]->message ? rs->rows[k]->message : "row failed");
			return (int)rs->rows[k]->error;
		}
	}
	return 0;
}

/* Row k ran on every rank: its token, its page, its output. */
static void complete_row(struct bd_sched *s, const struct bd_sched_row *sr,
			 const Bdfp4__RowResult *rr, int64_t now)
{
	struct bd_req *r = sr->r;
	char m[256];
	int fin, e;
	int32_t t;

	r->on_workers = true;
	r->n_pos += sr->n_feed;
	if (sr->prefill)
		store_prefix(s, r);
	if (sr->new_page >= 0) {
		e = s->pool->page_commit(s->pool_ctx, r->id, sr->new_page);
		r->reserved = -1;
		if (e < 0) {
			held_add(s, -1);
			if (!apply_pending(s, r))
				fail_req(s, r, BDFP4__SERVE_ERROR__SERVE_ERR_INTERNAL, "pool commit", e);
			return;
		}
		r->pages[r->n_pages++] = sr->new_page;
	}
	if (apply_pending(s, r))
		return;
	if (sr->prefill && r->n_pos < r->n_fill)
		return; /* a chunk that samples nothing: more of the prefill follows */
	t = rr->token;
	if (t < 0 || t >= s->cfg.n_vocab) {
		snprintf(m, sizeof(m), "worker rank 0 sampled token %d, outside the vocabulary", t);
		finish(s, r, BDFP4__FINISH_REASON__FINISH_ERROR,
		       BDFP4__SERVE_ERROR__SERVE_ERR_INTERNAL, m, true);
		return;
	}
	if (r->top_k) {
		Bdfp4__TopLogit *dst = r->top + (size_t)r->n_gen * r->top_k;

		for (size_t j = 0; j < rr->n_top && j < r->top_k; j++) {
			dst[j].token = rr->top[j]->token;
			dst[j].logit = rr->top[j]->logit;
		}
	}
	if (r->lp) {
		struct bd_req_logprob *dst = r->lp + (size_t)r->n_gen * (1 + r->top_logprobs);

		dst[0].token = t;
		dst[0].logprob = rr->logprob;
		for (size_t j = 0; j < rr->n_top_logprobs && j < r->top_logprobs; j++) {
			dst[1 + j].token = rr->top_logprobs[j]->token;
			dst[1 + j].logprob = rr->top_logprobs[j]->logprob;
		}
	}
	if (r->n_gen < r->n_forced)
		t = r->forced[r->n_gen];
	if (!r->t_first)
		r->t_first = now;
	fin = append_token(s, r, t);
	if (fin)
		finish(s, r, fin, 0, "", true);
	else if (r->stream)
		push_chunk(s, r, BDFP4__FINISH_REASON__FINISH_NONE, 0, NULL);
}

void bd_sched_step_done(struct bd_sched *s, Bdfp4__StepResult *const *res, int n_ranks,
			int64_t now)
{
	int n = s->step.n_rows;

	if (!s->step.active || n_ranks < 1 || res[0]->epoch != s->epoch ||
	    res[0]->step != s->step.id)
		return;
	s->step.active = false;
	s->steps_done++;
	for (int k = 0; k < n; k++) {
		const struct bd_sched_row *sr = &s->step.rows[k];
		struct bd_req *r = sr->r;
		char m[256];
		int err;

		r->in_step = false;
		r->resume = false;
		err = row_error(s, res, n_ranks, k, m, sizeof(m));
		if (err) {
			r->on_workers = true; /* the release is harmless if it dropped it already */
			if (!apply_pending(s, r)) {
				bd_log_warn("request %llu: %s", (unsigned long long)r->id, m);
				finish(s, r, BDFP4__FINISH_REASON__FINISH_ERROR,
				       err == BDFP4__SERVE_ERROR__SERVE_ERR_INTERNAL
					       ? err
					       : BDFP4__SERVE_ERROR__SERVE_ERR_WORKER_FAILED,
				       m, true);
			}
			continue;
		}
		complete_row(s, sr, res[0]->rows[k], now);
	}
	s->step.n_rows = 0;
}

/* ---- the worker group, the end --------------------------------------------------------------- */

void bd_sched_group_up(struct bd_sched *s, uint64_t epoch)
{
	s->group_ready = true;
	s->epoch = epoch;
	s->n_release = 0; /* a new group holds no sequence */
	s->resume_by = 0;
}

void bd_sched_set_workers(struct bd_sched *s, bool whole_prompts, int max_row)
{
	s->whole_prompts = whole_prompts;
	s->max_row = max_row > 0 ? max_row : 0;
}

bool bd_sched_resuming(const struct bd_sched *s)
{
	return !s->group_ready && s->resume_by != 0;
}

/* The group failed and resume_timeout_ms allows a wait: the step in flight is given up without
 * a trace (its rows run again: a position's KV write and a page's promotion give the same bytes
 * when repeated, and the reserved pages stay reserved), and every running request keeps what
 * it holds in the pool; its next row tells the workers to rebuild it (PlanRow.resume). */
static void hold_for_resume(struct bd_sched *s, const char *msg, int64_t now)
{
	if (s->step.active) {
		s->step.active = false;
		for (int k = 0; k < s->step.n_rows; k++) {
			struct bd_req *r = s->step.rows[k].r;

			r->in_step = false;
			apply_pending(s, r);
		}
		s->step.n_rows = 0;
	}
	for (size_t i = 0; i < s->n_reqs; i++) {
		struct bd_req *r = s->reqs[i];

		if (r->state != RQ_RUNNING)
			continue;
		r->on_workers = false;
		r->resume = r->n_pos > 0;
	}
	if (!s->resume_by) {
		s->resume_by = now + s->cfg.resume_timeout_ms;
		snprintf(s->down_msg, sizeof(s->down_msg), "%s", msg);
	}
	bd_log_info("%zu running request(s) wait up to %d ms for the worker group: %s",
		    s->n_running, s->cfg.resume_timeout_ms, msg);
}

void bd_sched_group_down(struct bd_sched *s, const char *msg, int64_t now)
{
	s->group_ready = false;
	if (s->cfg.resume_timeout_ms > 0) {
		hold_for_resume(s, msg, now);
		s->n_release = 0; /* every rank drops every sequence on reset */
		return;
	}
	abort_step(s, BDFP4__SERVE_ERROR__SERVE_ERR_WORKER_FAILED, msg);
	for (size_t i = s->n_reqs; i-- > 0;)
		if (s->reqs[i]->state == RQ_RUNNING)
			finish(s, s->reqs[i], BDFP4__FINISH_REASON__FINISH_ERROR,
			       BDFP4__SERVE_ERROR__SERVE_ERR_WORKER_FAILED, msg, true);
	s->n_release = 0; /* every rank drops every sequence on reset */
}

void bd_sched_stop(struct bd_sched *s, int error, const char *msg)
{
	/* those in the step in flight are marked, and giving the step up applies the mark */
	fail_all(s, error, msg);
	abort_step(s, error, msg);
	while (s->n_reqs)
		finish(s, s->reqs[s->n_reqs - 1], BDFP4__FINISH_REASON__FINISH_ERROR, error, msg,
		       true);
	s->group_ready = false;
}

/* ---- life ------------------------------------------------------------------------------------ */

int bd_sched_init(struct bd_sched *s, const struct bd_sched_cfg *cfg,
		  const struct bd_sched_pool_ops *pool, void *pool_ctx)
{
	memset(s, 0, sizeof(*s));
	s->cfg = *cfg;
	s->pool = pool;
	s->pool_ctx = pool_ctx;
	s->next_id = 1;
	s->next_step = 1;
	s->piece_cap = cfg->tok ? bd_tokenizer_stream_cap(cfg->tok) : 16;
	s->piece = malloc(s->piece_cap);
	return s->piece ? 0 : -ENOMEM;
}

void bd_sched_fini(struct bd_sched *s)
{
	struct bd_sched_act a;

	while (bd_sched_next(s, &a))
		;
	while (s->n_reqs)
		bd_req_free(s->reqs[--s->n_reqs]);
	free(s->reqs);
	free(s->release);
	free(s->acts);
	free(s->piece);
	free(s->step.rows);
	free(s->step.prow);
	free(s->step.pprow);
	free(s->step.release);
	memset(s, 0, sizeof(*s));
}
