/* sched.c — routerd's scheduler: request life cycle, admission against the pool, continuous
 * batching into step plans, results, preemption by recompute.
 *
 * Pages (NUMERICS.md §8, bd_layout.h): position p lives in page p / 128; the token at position p
 * with (p + 1) % 128 == 0 completes its page, which the workers then promote from the BF16 slot
 * into an FP4 page. A prefill of n tokens completes n / 128 pages: they are allocated at
 * admission (PageAlloc). A decode that completes a page promotes into the page reserved for the
 * request (PageReserve), asked for one step ahead, committed (PageCommit) once every rank has
 * answered the step.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zmq.h>

#include "router.h"

/* ---- the request list ----------------------------------------------------------------------- */

void bd_req_free(struct bd_req *r)
{
	if (!r)
		return;
	free(r->toks);
	free(r->pages);
	for (int i = 0; i < r->n_stops; i++)
		free(r->stops[i]);
	free(r->forced);
	free(r->top);
	free(r->text);
	free(r);
}

int bd_router_add(struct bd_router *rt, struct bd_req *r)
{
	if (rt->n_reqs == rt->cap_reqs) {
		size_t cap = rt->cap_reqs ? rt->cap_reqs * 2 : 64;
		struct bd_req **p = realloc(rt->reqs, cap * sizeof(*p));

		if (!p)
			return -ENOMEM;
		rt->reqs = p;
		rt->cap_reqs = cap;
	}
	r->state = RQ_QUEUED;
	rt->reqs[rt->n_reqs++] = r;
	rt->n_queued++;
	rt->requests_total++;
	return 0;
}

struct bd_req *bd_router_find(struct bd_router *rt, const uint8_t *ident, size_t len,
			      uint64_t tag)
{
	for (size_t i = 0; i < rt->n_reqs; i++) {
		struct bd_req *r = rt->reqs[i];

		if (r->tag == tag && r->ident_len == len && !memcmp(r->ident, ident, len) &&
		    !r->finish_pending)
			return r;
	}
	return NULL;
}

static void remove_req(struct bd_router *rt, struct bd_req *r)
{
	for (size_t i = 0; i < rt->n_reqs; i++)
		if (rt->reqs[i] == r) {
			memmove(rt->reqs + i, rt->reqs + i + 1,
				(rt->n_reqs - i - 1) * sizeof(*rt->reqs));
			rt->n_reqs--;
			break;
		}
	bd_req_free(r);
}

static void push_release(struct bd_router *rt, uint64_t id)
{
	if (rt->n_release == rt->cap_release) {
		size_t cap = rt->cap_release ? rt->cap_release * 2 : 64;
		uint64_t *p = realloc(rt->release, cap * sizeof(*p));

		if (!p)
			return; /* the worker keeps a dead sequence until its next reset */
		rt->release = p;
		rt->cap_release = cap;
	}
	rt->release[rt->n_release++] = id;
}

/* ---- pool ----------------------------------------------------------------------------------- */

int bd_router_pool_refresh(struct bd_router *rt)
{
	struct bd_pool_stats *st = NULL;
	int e = POOL_CALL(rt, bd_pool_stats(rt->pool, 1, &st));

	if (e < 0)
		return e;
	rt->pages_free = st->pages_free;
	rt->slots_free = st->slots_free;
	rt->pages_total = st->pages_total;
	rt->slots_total = st->slots_total;
	bd_pool_stats_free(st);
	return 0;
}

static void held_add(struct bd_router *rt, int64_t n)
{
	rt->pages_held = (uint64_t)((int64_t)rt->pages_held + n);
	if (rt->pages_held > rt->pages_peak)
		rt->pages_peak = rt->pages_held;
}

/* Gives back everything r holds in the pool; the workers drop its sequence in the next plan. */
static void release_all(struct bd_router *rt, struct bd_req *r)
{
	if (r->pool_held) {
		int e = POOL_CALL(rt, bd_pool_request_release(rt->pool, r->id, NULL));

		if (e < 0 && e != -ENOENT) {
			/* the record stays behind: reclaimed when the pool answers again */
			rt->pool_reclaim = true;
			if (rt->pool_ok) /* else the pool's state was logged, once */
				bd_log_warn("request %llu: pool release: %s",
					  (unsigned long long)r->id, strerror(-e));
		}
		held_add(rt, -(int64_t)(r->n_pages + (r->reserved >= 0)));
	}
	r->pool_held = false;
	r->slot = -1;
	r->n_pages = 0;
	r->reserved = -1;
	if (r->on_workers)
		push_release(rt, r->id);
	r->on_workers = false;
	r->n_pos = 0;
}

/* ---- text ---------------------------------------------------------------------------------- */

static int text_append(struct bd_req *r, const char *p, size_t n)
{
	if (r->len + n + 1 > r->cap_text) {
		size_t cap = (r->len + n + 1) * 2;
		char *t = realloc(r->text, cap);

		if (!t)
			return -ENOMEM;
		r->text = t;
		r->cap_text = cap;
	}
	memcpy(r->text + r->len, p, n);
	r->len += n;
	r->text[r->len] = 0;
	return 0;
}

/* Advances r->shown to what is final; true when a stop string matched (text cut there). */
static bool text_scan(struct bd_req *r, bool final)
{
	bool hit = false;
	size_t upto = bd_stop_scan(r->text ? r->text : "", r->len,
				   (const char *const *)r->stops, r->n_stops, &hit);

	if (hit) {
		r->len = upto;
		if (r->text)
			r->text[upto] = 0;
	} else if (final) {
		upto = r->len;
	}
	if (upto > r->shown)
		r->shown = upto;
	return hit;
}

/* The end of the text stream: a held-back partial character, then the held-back tail. */
static void text_final(struct bd_router *rt, struct bd_req *r, int reason)
{
	size_t n = 0;

	if (reason == BDFP4__FINISH_REASON__FINISH_STOP_STRING)
		return;
	if (rt->tok && bd_tokenizer_stream_flush(&r->ts, rt->piece, rt->piece_cap, &n) == 0 && n)
		text_append(r, rt->piece, n);
	text_scan(r, true);
}

/* Appends generated token t; returns the finish reason it causes (FINISH_NONE: go on). */
static int append_token(struct bd_router *rt, struct bd_req *r, int32_t t)
{
	size_t n = 0;

	r->toks[r->n_prompt + r->n_gen++] = t;
	rt->tokens_generated++;
	if (rt->eog[t] && !r->ignore_eos)
		return BDFP4__FINISH_REASON__FINISH_STOP;
	if (rt->tok &&
	    bd_tokenizer_stream_push(rt->tok, &r->ts, t, rt->piece, rt->piece_cap, &n) == 0 && n)
		text_append(r, rt->piece, n);
	if (text_scan(r, false))
		return BDFP4__FINISH_REASON__FINISH_STOP_STRING;
	if (r->n_gen >= r->max_tokens)
		return BDFP4__FINISH_REASON__FINISH_LENGTH;
	return BDFP4__FINISH_REASON__FINISH_NONE;
}

/* ---- finishing ----------------------------------------------------------------------------- */

void bd_router_finish(struct bd_router *rt, struct bd_req *r, int reason, int error,
		      const char *msg, bool notify)
{
	uint8_t ident[256];
	size_t ident_len = r->ident_len;
	bool gone = false;

	if (r->in_step) {
		if (!r->finish_pending) {
			r->finish_pending = true;
			r->fin_reason = reason;
			r->fin_error = error;
			r->fin_notify = notify;
			snprintf(r->fin_msg, sizeof(r->fin_msg), "%s", msg ? msg : "");
		}
		return;
	}
	if (r->state == RQ_RUNNING)
		rt->n_running--;
	else
		rt->n_queued--;
	release_all(rt, r);
	if (reason == BDFP4__FINISH_REASON__FINISH_ERROR)
		rt->requests_failed++;
	if (notify) {
		text_final(rt, r, reason);
		gone = bd_router_send_chunk(rt, r, reason, error, msg) == -EHOSTUNREACH;
	}
	bd_log_debug("request %llu finished: %d (%s), %d tokens", (unsigned long long)r->id, reason,
		   msg ? msg : "", r->n_gen);
	memcpy(ident, r->ident, ident_len);
	remove_req(rt, r);
	if (gone)
		bd_router_client_gone(rt, ident, ident_len);
}

void bd_router_fail_running(struct bd_router *rt, int error, const char *msg)
{
	for (size_t i = rt->n_reqs; i-- > 0;) {
		struct bd_req *r;

		if (i >= rt->n_reqs)
			continue;
		r = rt->reqs[i];
		if (r->state != RQ_RUNNING || r->in_step)
			continue;
		r->on_workers = false;
		bd_router_finish(rt, r, BDFP4__FINISH_REASON__FINISH_ERROR, error, msg, true);
	}
}

void bd_router_deadlines(struct bd_router *rt, int64_t now)
{
	for (size_t i = rt->n_reqs; i-- > 0;) {
		struct bd_req *r;

		if (i >= rt->n_reqs)
			continue;
		r = rt->reqs[i];
		if (now >= r->deadline && !r->finish_pending) {
			char m[96];

			snprintf(m, sizeof(m), "deadline of %lld ms passed",
				 (long long)(r->deadline - r->t_arrival));
			bd_router_finish(rt, r, BDFP4__FINISH_REASON__FINISH_ERROR,
					 BDFP4__SERVE_ERROR__SERVE_ERR_DEADLINE_EXCEEDED, m, true);
		}
	}
}

/* ---- admission and preemption ---------------------------------------------------------------- */

/* Slot and prefill pages for r. 0, -ENOSPC (the pool is short: nothing held), other -errno. */
static int admit(struct bd_router *rt, struct bd_req *r)
{
	int n = r->n_prompt + r->n_gen, np = n / BD_PAGE_TOKENS, e;

	e = POOL_CALL(rt, bd_pool_slot_assign(rt->pool, r->id, rt->o.owner, &r->slot));
	if (e < 0) {
		if (!rt->pool_ok)
			rt->pool_reclaim = true; /* the slot may be assigned, its answer lost */
		return e;
	}
	r->pool_held = true;
	if (np) {
		e = POOL_CALL(rt, bd_pool_page_alloc(rt->pool, r->id, rt->o.owner, (uint32_t)np,
						      r->pages));
		if (e < 0) {
			if (POOL_CALL(rt, bd_pool_request_release(rt->pool, r->id, NULL)) < 0 &&
			    !rt->pool_ok)
				rt->pool_reclaim = true;
			r->pool_held = false;
			r->slot = -1;
			return e;
		}
	}
	r->n_pages = np;
	held_add(rt, np);
	r->state = RQ_RUNNING;
	rt->n_queued--;
	rt->n_running++;
	if (!r->t_admit)
		r->t_admit = bd_now_ms();
	return 0;
}

/* Releases r's pages and slot and puts it back in the queue; its tokens are recomputed by a
 * prefill of prompt + generated when it is admitted again. */
static void preempt(struct bd_router *rt, struct bd_req *r)
{
	bd_log_info("request %llu preempted (pool full): %d tokens to recompute",
		  (unsigned long long)r->id, r->n_prompt + r->n_gen);
	release_all(rt, r);
	r->state = RQ_QUEUED;
	rt->n_running--;
	rt->n_queued++;
	r->preemptions++;
	rt->preemptions++;
}

/* The running request admitted last (largest order): the cheapest to lose. */
static struct bd_req *pick_victim(struct bd_router *rt)
{
	struct bd_req *v = NULL;

	for (size_t i = 0; i < rt->n_reqs; i++) {
		struct bd_req *r = rt->reqs[i];

		if (r->state == RQ_RUNNING && !r->finish_pending && (!v || r->order > v->order))
			v = r;
	}
	return v;
}

/* Makes sure r has the page its next decode promotes into. Returns 0, or -ENOSPC when r itself
 * was preempted, or another -errno (r must fail). */
static int ensure_reserved(struct bd_router *rt, struct bd_req *r)
{
	for (;;) {
		int e = POOL_CALL(rt, bd_pool_page_reserve(rt->pool, r->id, rt->o.owner,
							    &r->reserved));
		struct bd_req *v;

		if (e == 0) {
			held_add(rt, 1);
			return 0;
		}
		r->reserved = -1;
		if (e != -ENOSPC)
			return e;
		v = pick_victim(rt);
		if (!v)
			return -ENOSPC;
		preempt(rt, v);
		if (v == r)
			return -ENOSPC;
	}
}

/* ---- steps ----------------------------------------------------------------------------------- */

static int grow_rows(struct bd_router *rt, int n)
{
	struct bd_step_row *p = realloc(rt->step.rows, (size_t)n * sizeof(*p));

	if (!p)
		return -ENOMEM;
	rt->step.rows = p;
	return 0;
}

static void fail_req(struct bd_router *rt, struct bd_req *r, int error, const char *what, int e)
{
	char m[600];

	if (!rt->pool_ok) {
		/* not the request's fault, nor an internal error: the pool does not answer */
		error = BDFP4__SERVE_ERROR__SERVE_ERR_UNAVAILABLE;
		bd_router_pool_reason(rt, m, sizeof(m));
	} else {
		snprintf(m, sizeof(m), "%s: %s", what, strerror(-e));
	}
	bd_log_warn("request %llu: %s", (unsigned long long)r->id, m);
	bd_router_finish(rt, r, BDFP4__FINISH_REASON__FINISH_ERROR, error, m, true);
}

/* Decode rows, then admissions; fills rt->step.rows. */
static int plan_rows(struct bd_router *rt)
{
	int n = 0, prefill_tokens = 0, e;
	bool preempted = false;

	if (grow_rows(rt, rt->o.max_batch) < 0)
		return -ENOMEM;
	/* the page each decode fills, before any row is fixed (a preemption may drop one) */
	for (size_t i = 0; i < rt->n_reqs; i++) {
		struct bd_req *r = rt->reqs[i];
		uint64_t before = rt->preemptions;

		if (r->state != RQ_RUNNING || r->n_pos == 0 || r->finish_pending)
			continue;
		if ((r->n_pos + 1) % BD_PAGE_TOKENS || r->reserved >= 0)
			continue;
		e = ensure_reserved(rt, r);
		preempted |= rt->preemptions != before;
		if (e < 0 && e != -ENOSPC) {
			fail_req(rt, r, BDFP4__SERVE_ERROR__SERVE_ERR_INTERNAL, "pool reserve", e);
			i = (size_t)-1; /* the list changed; rows are built below, so restart */
		}
	}
	for (size_t i = 0; i < rt->n_reqs && n < rt->o.max_batch; i++) {
		struct bd_req *r = rt->reqs[i];

		if (r->state != RQ_RUNNING || r->n_pos == 0)
			continue;
		rt->step.rows[n++] = (struct bd_step_row){
			.r = r, .n_feed = 1,
			.new_page = (r->n_pos + 1) % BD_PAGE_TOKENS ? -1 : r->reserved,
		};
	}
	/* admissions, oldest first, unless the pool just ran short */
	for (size_t i = 0; i < rt->n_reqs && !preempted && n < rt->o.max_batch; i++) {
		struct bd_req *r = rt->reqs[i];
		int feed = r->n_prompt + r->n_gen;

		if (r->state != RQ_QUEUED)
			continue;
		if (prefill_tokens && prefill_tokens + feed > rt->o.max_prefill_tokens)
			break;
		e = admit(rt, r);
		if (e == -ENOSPC) {
			if (rt->n_running == 0) {
				fail_req(rt, r, BDFP4__SERVE_ERROR__SERVE_ERR_RESOURCE_EXHAUSTED,
					 "the pool cannot hold this request", e);
				i--;
				continue;
			}
			break;
		}
		if (e < 0) {
			fail_req(rt, r, BDFP4__SERVE_ERROR__SERVE_ERR_INTERNAL, "pool admission", e);
			i--;
			continue;
		}
		prefill_tokens += feed;
		rt->step.rows[n++] = (struct bd_step_row){ .r = r, .prefill = true, .n_feed = feed,
							   .new_page = -1 };
	}
	/* one step ahead: the page the next decode of each row will fill */
	for (int k = 0; k < n; k++) {
		struct bd_req *r = rt->step.rows[k].r;
		int next = r->n_pos + rt->step.rows[k].n_feed;

		if ((next + 1) % BD_PAGE_TOKENS || r->reserved >= 0)
			continue;
		/* short of pages: the next plan reserves it, or preempts */
		if (POOL_CALL(rt, bd_pool_page_reserve(rt->pool, r->id, rt->o.owner,
						       &r->reserved)) == 0)
			held_add(rt, 1);
		else
			r->reserved = -1;
	}
	return n;
}

static int send_plan(struct bd_router *rt, int n)
{
	Bdfp4__RouterMessage msg = BDFP4__ROUTER_MESSAGE__INIT;
	Bdfp4__StepPlan plan = BDFP4__STEP_PLAN__INIT;
	Bdfp4__PlanRow *rows = calloc((size_t)n + 1, sizeof(*rows));
	Bdfp4__PlanRow **prow = calloc((size_t)n + 1, sizeof(*prow));
	int e = 0;

	if (!rows || !prow) {
		free(rows);
		free(prow);
		return -ENOMEM;
	}
	for (int k = 0; k < n; k++) {
		const struct bd_step_row *sr = &rt->step.rows[k];
		struct bd_req *r = sr->r;
		Bdfp4__PlanRow *p = &rows[k];

		bdfp4__plan_row__init(p);
		p->request_id = r->id;
		p->prefill = sr->prefill;
		p->position = r->n_pos;
		p->n_tokens = (size_t)sr->n_feed;
		p->tokens = r->toks + r->n_pos;
		p->slot = r->slot;
		p->sample = true;
		p->logits_top_k = r->top_k;
		if (sr->prefill) {
			p->n_new_pages = (size_t)r->n_pages;
			p->new_pages = r->pages;
			p->capacity = (uint32_t)r->cap;
			p->kv_config = (char *)r->kv_config;
			p->sampling = &r->sampling;
		} else {
			p->n_block_table = (size_t)r->n_pages;
			p->block_table = r->pages;
			p->n_new_pages = sr->new_page >= 0 ? 1 : 0;
			p->new_pages = (int32_t *)&sr->new_page;
		}
		prow[k] = p;
	}
	plan.epoch = rt->epoch;
	plan.step = rt->next_step;
	plan.n_rows = (size_t)n;
	plan.rows = prow;
	plan.n_release = rt->n_release;
	plan.release = rt->release;
	msg.msg_case = BDFP4__ROUTER_MESSAGE__MSG_PLAN;
	msg.plan = &plan;
	for (int rank = 0; rank < rt->o.tp && !e; rank++) {
		e = bd_router_send_worker(rt, rank, &msg);
		if (e < 0) {
			char m[128];

			snprintf(m, sizeof(m), "worker rank %d (pid %d) is gone", rank,
				 rt->w[rank].pid);
			/* the plan's rows fail through the group failure */
			rt->step.active = true;
			rt->step.n_rows = n;
			for (int k = 0; k < n; k++)
				rt->step.rows[k].r->in_step = true;
			bd_router_group_fail(rt, rank, m);
		}
	}
	free(rows);
	free(prow);
	return e;
}

void bd_router_schedule(struct bd_router *rt)
{
	int n;

	/* a drain (STOPPING) steps what was accepted; nothing is planned while the pool is down
	 * (the requests fail: pool.c), except the releases the workers are owed */
	if (!rt->group_ready || rt->step.active || (rt->state != RS_SERVING && !rt->draining))
		return;
	if (!rt->pool_ok && !rt->n_release)
		return;
	if (!rt->n_running && !rt->n_queued && !rt->n_release)
		return;
	if (!rt->piece) {
		rt->piece_cap = rt->tok ? bd_tokenizer_stream_cap(rt->tok) : 16;
		rt->piece = malloc(rt->piece_cap);
		if (!rt->piece)
			return;
	}
	n = plan_rows(rt);
	if (n < 0 || (n == 0 && !rt->n_release))
		return;
	if (send_plan(rt, n) < 0)
		return;
	bd_log_debug("step %llu: %d row(s), %zu release(s)", (unsigned long long)rt->next_step, n,
		   rt->n_release);
	rt->step.active = true;
	rt->step.id = rt->next_step++;
	rt->step.n_rows = n;
	rt->step.n_res = 0;
	rt->step.started = bd_now_ms();
	rt->step.deadline = rt->step.started + rt->o.step_timeout_ms;
	for (int k = 0; k < n; k++)
		rt->step.rows[k].r->in_step = true;
	rt->n_release = 0;
}

static void clear_results(struct bd_router *rt)
{
	for (int i = 0; i < BD_ROUTER_MAX_TP; i++) {
		if (rt->step.res[i])
			bdfp4__step_result__free_unpacked(rt->step.res[i], NULL);
		rt->step.res[i] = NULL;
	}
	rt->step.n_res = 0;
}

/* A pending finish (decided while r was in the step) now takes effect. */
static bool apply_pending(struct bd_router *rt, struct bd_req *r)
{
	char m[256];

	if (!r->finish_pending)
		return false;
	snprintf(m, sizeof(m), "%s", r->fin_msg);
	r->finish_pending = false;
	bd_router_finish(rt, r, r->fin_reason, r->fin_error, m, r->fin_notify);
	return true;
}

void bd_router_abort_step(struct bd_router *rt, const char *msg)
{
	if (!rt->step.active)
		return;
	rt->step.active = false;
	for (int k = 0; k < rt->step.n_rows; k++) {
		struct bd_req *r = rt->step.rows[k].r;

		r->in_step = false;
		r->on_workers = false;
		if (!apply_pending(rt, r))
			bd_router_finish(rt, r, BDFP4__FINISH_REASON__FINISH_ERROR,
					 BDFP4__SERVE_ERROR__SERVE_ERR_WORKER_FAILED, msg, true);
	}
	rt->step.n_rows = 0;
	clear_results(rt);
}

/* The error of row k on any rank, into m; 0 when every rank ran it. */
static int row_error(struct bd_router *rt, int k, char *m, size_t cap)
{
	for (int rank = 0; rank < rt->o.tp; rank++) {
		const Bdfp4__StepResult *res = rt->step.res[rank];

		if (res->error) {
			snprintf(m, cap, "worker rank %d: %s", rank,
				 *res->message ? res->message : "step failed");
			return (int)res->error;
		}
		if (res->n_rows != (size_t)rt->step.n_rows ||
		    res->rows[k]->request_id != rt->step.rows[k].r->id) {
			snprintf(m, cap, "worker rank %d: result rows do not match the plan", rank);
			return BDFP4__SERVE_ERROR__SERVE_ERR_INTERNAL;
		}
		if (res->rows[k]->error) {
			snprintf(m, cap, "worker rank %d: %s", rank,
				 *res->rows[k]->message ? res->rows[k]->message : "row failed");
			return (int)res->rows[k]->error;
		}
	}
	return 0;
}

static void complete_step(struct bd_router *rt)
{
	int n = rt->step.n_rows;

	rt->step.active = false;
	rt->steps_done++;
	for (int k = 0; k < n; k++) {
		const struct bd_step_row *sr = &rt->step.rows[k];
		struct bd_req *r = sr->r;
		const Bdfp4__RowResult *rr;
		char m[256];
		int err, fin, e;
		int32_t t;

		r->in_step = false;
		err = row_error(rt, k, m, sizeof(m));
		if (err) {
			r->on_workers = true; /* the release is harmless if it dropped it already */
			if (!apply_pending(rt, r)) {
				bd_log_warn("request %llu: %s", (unsigned long long)r->id, m);
				bd_router_finish(rt, r, BDFP4__FINISH_REASON__FINISH_ERROR,
						 err == BDFP4__SERVE_ERROR__SERVE_ERR_INTERNAL
							 ? err
							 : BDFP4__SERVE_ERROR__SERVE_ERR_WORKER_FAILED,
						 m, true);
			}
			continue;
		}
		r->on_workers = true;
		r->n_pos += sr->n_feed;
		if (sr->new_page >= 0) {
			e = POOL_CALL(rt, bd_pool_page_commit(rt->pool, r->id, sr->new_page));
			r->reserved = -1;
			if (e < 0) {
				held_add(rt, -1);
				if (!apply_pending(rt, r))
					fail_req(rt, r, BDFP4__SERVE_ERROR__SERVE_ERR_INTERNAL,
						 "pool commit", e);
				continue;
			}
			r->pages[r->n_pages++] = sr->new_page;
		}
		if (apply_pending(rt, r))
			continue;
		rr = rt->step.res[0]->rows[k];
		t = rr->token;
		if (t < 0 || t >= rt->n_vocab) {
			snprintf(m, sizeof(m), "worker rank 0 sampled token %d, outside the "
					       "vocabulary", t);
			bd_router_finish(rt, r, BDFP4__FINISH_REASON__FINISH_ERROR,
					 BDFP4__SERVE_ERROR__SERVE_ERR_INTERNAL, m, true);
			continue;
		}
		if (r->top_k) {
			Bdfp4__TopLogit *dst = r->top + (size_t)r->n_gen * r->top_k;

			for (size_t j = 0; j < rr->n_top && j < r->top_k; j++) {
				dst[j].token = rr->top[j]->token;
				dst[j].logit = rr->top[j]->logit;
			}
		}
		if (r->n_gen < r->n_forced)
			t = r->forced[r->n_gen];
		if (!r->t_first)
			r->t_first = bd_now_ms();
		fin = append_token(rt, r, t);
		if (fin) {
			bd_router_finish(rt, r, fin, 0, "", true);
		} else if (r->stream &&
			   bd_router_send_chunk(rt, r, BDFP4__FINISH_REASON__FINISH_NONE, 0, NULL) ==
				   -EHOSTUNREACH) {
			uint8_t ident[256];
			size_t len = r->ident_len;

			memcpy(ident, r->ident, len);
			/* its later rows in this step end when the loop reaches them */
			bd_router_client_gone(rt, ident, len);
		}
	}
	rt->step.n_rows = 0;
	clear_results(rt);
}

void bd_router_on_result(struct bd_router *rt, int rank, Bdfp4__StepResult *res)
{
	if (!rt->step.active || res->epoch != rt->epoch || res->step != rt->step.id ||
	    rank < 0 || rank >= rt->o.tp || rt->step.res[rank]) {
		bd_log_debug("stale result of step %llu from rank %d dropped",
			   (unsigned long long)res->step, rank);
		bdfp4__step_result__free_unpacked(res, NULL);
		return;
	}
	rt->step.res[rank] = res;
	rt->w[rank].steps++;
	if (++rt->step.n_res == rt->o.tp) {
		complete_step(rt);
	} else if (res->error != BDFP4__SERVE_ERROR__SERVE_OK) {
		/* a rank that failed the whole step (its all-reduce lost the peer) leaves its peers
		 * waiting in a collective that cannot finish: do not wait for them */
		char msg[320], missing[64] = "";
		size_t off = 0;
		for (int i = 0; i < rt->o.tp && off < sizeof(missing); i++)
			if (!rt->step.res[i])
				off += (size_t)snprintf(missing + off, sizeof(missing) - off, "%s%d",
							off ? ", " : "", i);
		snprintf(msg, sizeof(msg), "no answer from worker rank %s to step %llu, which "
			 "failed on rank %d: %s", missing, (unsigned long long)res->step, rank,
			 *res->message ? res->message : "step failed");
		bd_router_group_fail(rt, -1, msg);
	}
}
