/* test_sched.c — routerd's scheduler (router/sched.c) without a socket: requests and step
 * results go in as events, the actions that come out (chunks, plans) are read back, and the
 * pool is a fake that keeps its own books (slots, pages, reserved pages, records).
 *
 * Rank 0 of the fake group answers row k of a plan with token 10 + request id (so each
 * request's tokens are known), rank 1 with -1; a test changes an answer before it is
 * delivered to inject row errors, step errors, bad tokens or end-of-generation tokens.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "quant/bd_layout.h"
#include "sched.h"

#define N_VOCAB 1000
#define EOG 5
#define MAX_REC 32
#define MAX_PAGES 64

/* ---- the fake pool --------------------------------------------------------------------------- */

struct rec {
	bool live;
	uint64_t id;
	int32_t slot, reserved;
	int32_t pages[MAX_PAGES];
	int n_pages;
};

struct fpool {
	int n_pages, n_slots;
	bool page_used[MAX_PAGES], slot_used[MAX_PAGES];
	struct rec rec[MAX_REC];
	bool down;
	int fail_slot;       /* the next slot_assign fails with this (0: none) */
	bool fail_goes_down; /* ... and the pool is down from then on */
	int reserves, commits, releases, allocs;
};

static struct fpool P;

static struct rec *rec_of(uint64_t id)
{
	for (int i = 0; i < MAX_REC; i++)
		if (P.rec[i].live && P.rec[i].id == id)
			return &P.rec[i];
	return NULL;
}

static int free_page(void)
{
	for (int p = 0; p < P.n_pages; p++)
		if (!P.page_used[p])
			return p;
	return -1;
}

static int pages_free(void)
{
	int n = 0;

	for (int p = 0; p < P.n_pages; p++)
		n += !P.page_used[p];
	return n;
}

static int records(void)
{
	int n = 0;

	for (int i = 0; i < MAX_REC; i++)
		n += P.rec[i].live;
	return n;
}

/* The record a call on id works on: NULL with *ret_e -EHOSTDOWN while the pool is down, or
 * -ENOENT for an unknown request. */
static struct rec *fp_rec(uint64_t id, int *ret_e)
{
	struct rec *r = P.down ? NULL : rec_of(id);

	*ret_e = P.down ? -EHOSTDOWN : -ENOENT;
	return r;
}

static int fp_slot_assign(void *ctx, uint64_t id, int32_t *ret_slot)
{
	(void)ctx;
	if (P.down)
		return -EHOSTDOWN;
	if (P.fail_slot) {
		int e = P.fail_slot;

		P.fail_slot = 0;
		P.down = P.fail_goes_down;
		return e;
	}
	cr_assert_null(rec_of(id), "request %llu has a record already", (unsigned long long)id);
	for (int s = 0; s < P.n_slots; s++) {
		if (P.slot_used[s])
			continue;
		for (int i = 0; i < MAX_REC; i++) {
			if (P.rec[i].live)
				continue;
			P.rec[i] = (struct rec){ .live = true, .id = id, .slot = s,
						 .reserved = -1 };
			P.slot_used[s] = true;
			*ret_slot = s;
			return 0;
		}
	}
	return -ENOSPC;
}

static int fp_page_alloc(void *ctx, uint64_t id, uint32_t n, int32_t *ret_pages)
{
	int e;
	struct rec *r = fp_rec(id, &e);

	(void)ctx;
	if (!r)
		return e;
	P.allocs++;
	if ((uint32_t)pages_free() < n)
		return -ENOSPC;
	for (uint32_t i = 0; i < n; i++) {
		int p = free_page();

		P.page_used[p] = true;
		r->pages[r->n_pages++] = p;
		ret_pages[i] = p;
	}
	return 0;
}

static int fp_page_reserve(void *ctx, uint64_t id, int32_t *ret_page)
{
	int e, p;
	struct rec *r = fp_rec(id, &e);

	(void)ctx;
	if (!r)
		return e;
	cr_assert_eq(r->reserved, -1, "request %llu reserves a second page",
		     (unsigned long long)id);
	p = free_page();
	if (p < 0)
		return -ENOSPC;
	P.page_used[p] = true;
	r->reserved = p;
	*ret_page = p;
	P.reserves++;
	return 0;
}

static int fp_page_commit(void *ctx, uint64_t id, int32_t page)
{
	int e;
	struct rec *r = fp_rec(id, &e);

	(void)ctx;
	if (P.down)
		return e;
	cr_assert_not_null(r);
	cr_assert_eq(r->reserved, page, "commit of page %d, reserved %d", page, r->reserved);
	r->pages[r->n_pages++] = page;
	r->reserved = -1;
	P.commits++;
	return 0;
}

static int fp_release(void *ctx, uint64_t id)
{
	int e;
	struct rec *r = fp_rec(id, &e);

	(void)ctx;
	if (!r)
		return e;
	for (int i = 0; i < r->n_pages; i++)
		P.page_used[r->pages[i]] = false;
	if (r->reserved >= 0)
		P.page_used[r->reserved] = false;
	P.slot_used[r->slot] = false;
	r->live = false;
	P.releases++;
	return 0;
}

static bool fp_down(void *ctx, char *why, size_t cap)
{
	(void)ctx;
	if (why && cap)
		snprintf(why, cap, "%s", P.down ? "kvpoold unreachable: fake (for 1 ms)" : "");
	return P.down;
}

static const struct bd_sched_pool_ops fake_pool = {
	.slot_assign = fp_slot_assign,
	.page_alloc = fp_page_alloc,
	.page_reserve = fp_page_reserve,
	.page_commit = fp_page_commit,
	.release = fp_release,
	.down = fp_down,
};

/* ---- the scheduler, its actions -------------------------------------------------------------- */

struct chunk {
	uint64_t tag, id;
	int finish, error, n_gen, n_tokens; /* n_tokens: new since the last chunk */
	char msg[256];
	uint32_t preemptions;
};

static struct bd_sched S;
static bool eog[N_VOCAB];
static int64_t now;
static struct chunk C[512];
static int n_chunks;
static const Bdfp4__StepPlan *plan; /* the last one, NULL after it was answered */
static int n_plans;

static void setup(int max_batch, int max_queue, int max_prefill, int pages, int slots)
{
	const struct bd_sched_cfg cfg = { .max_batch = max_batch, .max_queue = max_queue,
					  .max_prefill_tokens = max_prefill, .n_vocab = N_VOCAB,
					  .eog = eog };

	memset(&P, 0, sizeof(P));
	P.n_pages = pages;
	P.n_slots = slots;
	memset(eog, 0, sizeof(eog));
	eog[EOG] = true;
	now = 1000;
	n_chunks = n_plans = 0;
	plan = NULL;
	cr_assert_eq(bd_sched_init(&S, &cfg, &fake_pool, NULL), 0);
	bd_sched_group_up(&S, 1);
}

static void teardown(void)
{
	bd_sched_fini(&S);
}

/* setup with prompts prefilled in chunks of at most chunk tokens, max_prefill a step. */
static void setup_chunked(int max_batch, int max_prefill, int chunk)
{
	setup(max_batch, 8, max_prefill, 16, 8);
	S.cfg.max_prefill_chunk = chunk;
}

TestSuite(sched, .fini = teardown, .timeout = 30);

/* Reads every queued action: chunks into C (what the frontend would send), the plan into plan. */
static void drain(void)
{
	struct bd_sched_act a;

	while (bd_sched_next(&S, &a)) {
		if (a.kind == BD_SCHED_PLAN) {
			plan = a.plan;
			n_plans++;
			continue;
		}
		cr_assert_eq(a.kind, BD_SCHED_CHUNK);
		cr_assert_lt(n_chunks, 512);
		C[n_chunks] = (struct chunk){ .tag = a.r->tag, .id = a.r->id, .finish = a.finish,
					      .error = a.error, .n_gen = a.r->n_gen,
					      .n_tokens = a.r->n_gen - a.r->n_sent,
					      .preemptions = a.r->preemptions };
		snprintf(C[n_chunks].msg, sizeof(C[n_chunks].msg), "%s", a.msg ? a.msg : "");
		a.r->n_sent = a.r->n_gen;
		n_chunks++;
	}
}

/* The pool as the scheduler found it: no request record, all `pages` pages free. */
static void expect_pool_clear(int pages)
{
	cr_expect_eq(records(), 0);
	cr_expect_eq(pages_free(), pages);
}

/* The clock at t (bd_sched_tick), what it did carried out (drain): the chunks sent so far. */
static int tick(int64_t t)
{
	bd_sched_tick(&S, t);
	drain();
	return n_chunks;
}

/* A request of n_prompt tokens (1000 + i) for up to max_tokens, tag, of the client ident. */
static struct bd_req *req(uint64_t tag, const char *ident, int n_prompt, int max_tokens)
{
	struct bd_req *r = calloc(1, sizeof(*r));

	cr_assert_not_null(r);
	r->cap = n_prompt + max_tokens;
	r->toks = malloc((size_t)r->cap * sizeof(int32_t));
	r->max_pages = r->cap / BD_PAGE_TOKENS + 1;
	r->pages = malloc((size_t)r->max_pages * sizeof(int32_t));
	cr_assert(r->toks && r->pages);
	for (int i = 0; i < n_prompt; i++)
		r->toks[i] = 100 + i % 800;
	r->n_prompt = n_prompt;
	r->max_tokens = max_tokens;
	r->tag = tag;
	r->ident_len = strlen(ident);
	memcpy(r->ident, ident, r->ident_len);
	r->kv_config = "bitdecoding-nvfp4";
	bdfp4__sampling_params__init(&r->sampling);
	r->sampling.top_p = 1.0f;
	r->t_arrival = now;
	r->deadline = now + 100000;
	return r;
}

/* Submits a request; returns it (owned by S). */
static struct bd_req *submit(uint64_t tag, int n_prompt, int max_tokens, bool stream)
{
	struct bd_req *r = req(tag, "client", n_prompt, max_tokens);

	r->stream = stream;
	cr_assert_eq(bd_sched_submit(&S, r), 0);
	return r;
}

/* Runs the scheduler: the plan it sends, NULL when it sends none. */
static const Bdfp4__StepPlan *step(void)
{
	int before = n_plans;

	bd_sched_schedule(&S, now);
	drain();
	return n_plans > before ? plan : NULL;
}

static Bdfp4__StepResult res[2], *pres[2];
static Bdfp4__RowResult rows[2][64], *prows[2][64];

/* The answers of both ranks to p, ready to be changed before deliver(). */
static void prepare(const Bdfp4__StepPlan *p)
{
	cr_assert_not_null(p);
	cr_assert_leq(p->n_rows, 64);
	for (int rank = 0; rank < 2; rank++) {
		bdfp4__step_result__init(&res[rank]);
		res[rank].epoch = p->epoch;
		res[rank].step = p->step;
		res[rank].rank = rank;
		res[rank].n_rows = p->n_rows;
		res[rank].rows = prows[rank];
		for (size_t k = 0; k < p->n_rows; k++) {
			bdfp4__row_result__init(&rows[rank][k]);
			rows[rank][k].request_id = p->rows[k]->request_id;
			rows[rank][k].token = rank ? -1 : (int32_t)(10 + p->rows[k]->request_id);
			prows[rank][k] = &rows[rank][k];
		}
		pres[rank] = &res[rank];
	}
}

static void deliver(void)
{
	bd_sched_step_done(&S, pres, 2, now);
	plan = NULL;
	drain();
}

static void answer(const Bdfp4__StepPlan *p)
{
	prepare(p);
	deliver();
}

/* Runs steps, answering each, until no plan goes out (at most limit steps); returns them. */
static int run_to_idle(int limit)
{
	int n = 0;
	const Bdfp4__StepPlan *p;

	while (n < limit && (p = step())) {
		answer(p);
		now += 10;
		n++;
	}
	return n;
}

/* The row of request id in p, NULL when it has none. */
static const Bdfp4__PlanRow *row_of(const Bdfp4__StepPlan *p, uint64_t id)
{
	for (size_t k = 0; k < p->n_rows; k++)
		if (p->rows[k]->request_id == id)
			return p->rows[k];
	return NULL;
}

/* Request id's row in p, asserted there, expected to be a prefill chunk of n_tokens tokens at
 * position. */
static const Bdfp4__PlanRow *expect_chunk(const Bdfp4__StepPlan *p, uint64_t id, int32_t position,
					  size_t n_tokens)
{
	const Bdfp4__PlanRow *r = row_of(p, id);

	cr_assert_not_null(r, "request %llu has no row", (unsigned long long)id);
	cr_expect(r->prefill, "request %llu: a prefill row", (unsigned long long)id);
	cr_expect_eq(r->position, position, "request %llu: position %d, want %d",
		     (unsigned long long)id, r->position, position);
	cr_expect_eq(r->n_tokens, n_tokens, "request %llu: %zu tokens, want %zu",
		     (unsigned long long)id, r->n_tokens, n_tokens);
	return r;
}

static bool released(const Bdfp4__StepPlan *p, uint64_t id)
{
	for (size_t i = 0; i < p->n_release; i++)
		if (p->release[i] == id)
			return true;
	return false;
}

/* The last chunk of tag, NULL when none came. */
static const struct chunk *last_chunk(uint64_t tag)
{
	for (int i = n_chunks; i-- > 0;)
		if (C[i].tag == tag)
			return &C[i];
	return NULL;
}

/* The request of tag ended: its last chunk is final with finish and error, and msg (exact,
 * NULL: not checked). */
static void expect_end(uint64_t tag, int finish, int error, const char *msg)
{
	const struct chunk *c = last_chunk(tag);

	cr_assert_not_null(c, "no chunk of tag %llu", (unsigned long long)tag);
	cr_expect_eq(c->finish, finish, "tag %llu: finish %d, not %d", (unsigned long long)tag,
		     c->finish, finish);
	cr_expect_eq(c->error, error, "tag %llu: error %d, not %d (%s)", (unsigned long long)tag,
		     c->error, error, c->msg);
	if (msg)
		cr_expect_str_eq(c->msg, msg, "tag %llu", (unsigned long long)tag);
}

/* The request of tag ended FINISH_ERROR with error and msg. */
static void expect_failed(uint64_t tag, int error, const char *msg)
{
	expect_end(tag, BDFP4__FINISH_REASON__FINISH_ERROR, error, msg);
}

/* n requests of tags 1..n, n_prompt tokens each, for up to max_tokens, not streamed. */
static void submit_n(int n, int n_prompt, int max_tokens)
{
	for (int i = 1; i <= n; i++)
		submit((uint64_t)i, n_prompt, max_tokens, false);
}

/* n requests (tags 1..n, 10 prompt tokens, up to 50 tokens) with max_batch rows: the first
 * max_batch run, their decode step is in flight (returned), the others are queued. */
static const Bdfp4__StepPlan *in_flight(int max_batch, int n)
{
	const Bdfp4__StepPlan *p;

	setup(max_batch, 8, 8192, 16, 4);
	submit_n(n, 10, 50);
	answer(step());
	p = step();
	cr_assert_not_null(p);
	cr_assert_eq(p->n_rows, (size_t)max_batch);
	cr_assert_eq(S.n_queued, (size_t)(n - max_batch));
	return p;
}

static int chunks_of(uint64_t tag)
{
	int n = 0;

	for (int i = 0; i < n_chunks; i++)
		n += C[i].tag == tag;
	return n;
}

/* ---- admission and batching ------------------------------------------------------------------ */

Test(sched, admits_in_arrival_order_up_to_max_batch)
{
	const Bdfp4__StepPlan *p;
	struct bd_req *a, *b, *c;

	setup(2, 8, 8192, 16, 8);
	a = submit(1, 10, 3, false);
	b = submit(2, 10, 3, false);
	c = submit(3, 10, 3, false);
	cr_expect_eq(a->id, 1);
	cr_expect_eq(c->id, 3);
	p = step();
	cr_assert_not_null(p);
	cr_assert_eq(p->n_rows, 2, "max_batch 2");
	cr_expect_eq(p->rows[0]->request_id, a->id);
	cr_expect_eq(p->rows[1]->request_id, b->id);
	for (int k = 0; k < 2; k++) {
		cr_expect(p->rows[k]->prefill);
		cr_expect_eq(p->rows[k]->position, 0);
		cr_expect_eq(p->rows[k]->n_tokens, 10);
		cr_expect_eq(p->rows[k]->tokens[9], 109);
		cr_expect_eq(p->rows[k]->capacity, 13);
		cr_expect_eq(p->rows[k]->n_new_pages, 0, "10 tokens complete no page");
		cr_expect(p->rows[k]->sample);
	}
	cr_expect_neq(p->rows[0]->slot, p->rows[1]->slot);
	cr_expect_eq(p->epoch, 1);
	cr_expect_eq(S.n_running, 2);
	cr_expect_eq(S.n_queued, 1);
	cr_expect_eq(records(), 2, "c holds nothing while queued");
	cr_expect_null(step(), "one step in flight at a time");
	answer(p);
	cr_expect_eq(n_chunks, 0, "not streaming: nothing before the end");

	/* decode rows of a and b; c waits for a free row */
	p = step();
	cr_assert_eq(p->n_rows, 2);
	cr_expect_not(p->rows[0]->prefill);
	cr_expect_eq(p->rows[0]->position, 10);
	cr_expect_eq(p->rows[0]->n_tokens, 1);
	cr_expect_eq(p->rows[0]->tokens[0], 10 + (int)a->id, "the token sampled last step");
	cr_expect_null(row_of(p, c->id));
	answer(p);
	p = step();
	answer(p);
	/* a and b reach max_tokens: one final chunk each, with all three tokens */
	cr_assert_eq(n_chunks, 2);
	expect_end(1, BDFP4__FINISH_REASON__FINISH_LENGTH, 0, "");
	cr_expect_eq(last_chunk(1)->n_tokens, 3);
	expect_end(2, BDFP4__FINISH_REASON__FINISH_LENGTH, 0, "");
	cr_expect_eq(records(), 0, "their slots went back");
	/* c's prefill, and the workers drop a and b */
	p = step();
	cr_assert_eq(p->n_rows, 1);
	cr_expect_eq(p->rows[0]->request_id, 3);
	cr_expect(p->rows[0]->prefill);
	cr_expect_eq(p->n_release, 2);
	cr_expect(released(p, 1) && released(p, 2));
	answer(p);
	run_to_idle(10);
	expect_end(3, BDFP4__FINISH_REASON__FINISH_LENGTH, 0, "");
	cr_expect_eq(S.requests_total, 3);
	cr_expect_eq(S.tokens_generated, 9);
	cr_expect_eq(S.n_reqs, 0);
}

Test(sched, prefill_budget_spreads_admissions_but_admits_one_long_prompt)
{
	const Bdfp4__StepPlan *p;

	setup(8, 8, 100, 16, 8);
	submit(1, 60, 4, false);
	submit(2, 60, 4, false);
	submit(3, 150, 4, false);
	p = step();
	cr_assert_eq(p->n_rows, 1, "60 + 60 tokens are over the budget of 100");
	cr_expect_eq(p->rows[0]->request_id, 1);
	answer(p);
	p = step();
	cr_assert_eq(p->n_rows, 2);
	cr_expect_not(row_of(p, 1)->prefill);
	cr_expect(row_of(p, 2)->prefill);
	cr_expect_null(row_of(p, 3), "60 + 150 is over the budget");
	answer(p);
	p = step();
	cr_assert_eq(p->n_rows, 3);
	cr_expect(row_of(p, 3)->prefill, "a prompt over the budget goes alone");
	cr_expect_eq(row_of(p, 3)->n_tokens, 150);
	cr_expect_eq(row_of(p, 3)->n_new_pages, 1, "150 tokens complete page 0");
	answer(p);
}

/* A 600-token prompt beside a 10-token one, chunks of 256 within a budget of 256 a step: the
 * short one decodes while the long one is prefilled in chunks of whole pages, each chunk's row
 * naming the pages before it and the pages it fills, and only the last chunk samples. */
Test(sched, a_long_prompt_is_prefilled_in_chunks_between_decode_steps)
{
	const Bdfp4__StepPlan *p;
	const Bdfp4__PlanRow *rb;
	struct bd_req *a, *b;

	setup_chunked(8, 256, 256);
	a = submit(1, 10, 6, true);
	b = submit(2, 600, 2, true);
	p = step();
	cr_assert_eq(p->n_rows, 2);
	cr_expect_eq(row_of(p, a->id)->n_tokens, 10);
	/* 246 tokens of the budget are left: one whole page */
	rb = expect_chunk(p, b->id, 0, 128);
	cr_expect_not(rb->sample, "more of the prompt follows");
	cr_expect_eq(rb->logits_top_k, 0);
	cr_expect_eq(rb->n_block_table, 0);
	cr_assert_eq(rb->n_new_pages, 1);
	cr_expect_eq(rb->new_pages[0], b->pages[0]);
	cr_expect_eq(rb->capacity, 602);
	cr_expect_eq(P.rec[1].n_pages, 4, "the prompt's 4 full pages are allocated at admission");
	answer(p);
	cr_expect_eq(a->n_gen, 1, "the short prompt's first token");
	cr_expect_eq(b->n_gen, 0);
	cr_expect_eq(chunks_of(2), 0, "nothing streams from a chunk that samples nothing");

	p = step();
	cr_assert_eq(p->n_rows, 2);
	cr_expect_eq(p->rows[0]->request_id, a->id, "decode rows first");
	cr_expect_not(p->rows[0]->prefill);
	rb = p->rows[1];
	cr_expect(rb->prefill);
	cr_expect_eq(rb->position, 128);
	cr_expect_eq(rb->n_tokens, 256);
	cr_expect_eq(rb->tokens[0], 100 + 128);
	cr_expect_not(rb->sample);
	cr_assert_eq(rb->n_block_table, 1);
	cr_expect_eq(rb->block_table[0], b->pages[0]);
	cr_assert_eq(rb->n_new_pages, 2);
	cr_expect_eq(rb->new_pages[0], b->pages[1]);
	cr_expect_eq(rb->new_pages[1], b->pages[2]);
	answer(p);
	cr_expect_eq(a->n_gen, 2);
	cr_expect_eq(b->n_gen, 0);

	p = step();
	rb = expect_chunk(p, b->id, 384, 216); /* the rest of the prompt */
	cr_expect(rb->sample, "the last chunk samples");
	cr_expect_eq(rb->n_block_table, 3);
	cr_assert_eq(rb->n_new_pages, 1, "600 tokens complete page 3 of 4");
	cr_expect_eq(rb->new_pages[0], b->pages[3]);
	answer(p);
	cr_expect_eq(b->n_gen, 1);
	cr_expect_eq(chunks_of(2), 1);

	p = step();
	rb = row_of(p, b->id);
	cr_assert_not_null(rb);
	cr_expect_not(rb->prefill, "b decodes");
	cr_expect_eq(rb->position, 600);
	cr_expect_eq(rb->n_block_table, 4);
	answer(p);
	run_to_idle(20);
	expect_end(1, BDFP4__FINISH_REASON__FINISH_LENGTH, 0, "");
	expect_end(2, BDFP4__FINISH_REASON__FINISH_LENGTH, 0, "");
	expect_pool_clear(16);
}

/* A request with logprobs: its sampling rows ask rank 0 for them (a chunk that samples nothing
 * does not), the other request's rows do not; each step's answer lands at its token's place,
 * the sampled token first (with a forced token too), then the top ones. */
Test(sched, logprobs_are_asked_on_sampling_rows_and_kept_per_token)
{
	Bdfp4__TokenLogprob tl[2], *ptl[2] = { &tl[0], &tl[1] };
	const Bdfp4__StepPlan *p;
	struct bd_req *a;
	int32_t forced[1] = { 3 };

	setup_chunked(8, 256, 128);
	a = req(1, "client", 200, 4);
	a->logprobs = true;
	a->top_logprobs = 2;
	a->lp = malloc(4 * 3 * sizeof(*a->lp));
	cr_assert_not_null(a->lp);
	for (int i = 0; i < 12; i++)
		a->lp[i] = (struct bd_req_logprob){ -1, 0.0f };
	a->forced = malloc(sizeof(forced));
	memcpy(a->forced, forced, sizeof(forced));
	a->n_forced = 1;
	cr_assert_eq(bd_sched_submit(&S, a), 0);
	uint64_t b_id = submit(2, 10, 3, false)->id; /* b ends, and is freed, on the way */
	for (int step_no = 0; a->n_gen < 3; step_no++) {
		p = step();
		cr_assert_not_null(p);
		const Bdfp4__PlanRow *ra = row_of(p, a->id), *rb = row_of(p, b_id);

		if (rb)
			cr_expect_not(rb->logprobs);
		cr_assert_not_null(ra);
		cr_expect_eq(ra->logprobs, ra->sample, "step %d: logprobs only where it samples",
			     step_no);
		cr_expect_eq(ra->top_logprobs, ra->sample ? 2u : 0u);
		prepare(p);
		for (size_t k = 0; k < p->n_rows; k++) {
			if (p->rows[k]->request_id != a->id || !ra->sample)
				continue;
			int n = a->n_gen;

			for (int j = 0; j < 2; j++) {
				bdfp4__token_logprob__init(&tl[j]);
				tl[j].token = 20 + j;
				tl[j].logprob = -0.5f * (float)(j + 1) - (float)n;
			}
			rows[0][k].logprob = -0.25f - (float)n;
			rows[0][k].n_top_logprobs = 2;
			rows[0][k].top_logprobs = ptl;
		}
		deliver();
		now += 10;
		cr_assert_lt(step_no, 4, "a's 2 chunks, then a token a step");
	}
	for (int i = 0; i < 3; i++) {
		const struct bd_req_logprob *e = a->lp + 3 * i;

		cr_expect_eq(e[0].token, (int32_t)(10 + a->id), "token %d: the sampled one", i);
		cr_expect_float_eq(e[0].logprob, -0.25f - (float)i, 1e-6);
		cr_expect_eq(e[1].token, 20);
		cr_expect_eq(e[2].token, 21);
		cr_expect_float_eq(e[2].logprob, -1.0f - (float)i, 1e-6);
	}
	cr_expect_eq(a->toks[a->n_prompt], 3, "the forced token is fed");
	run_to_idle(10);
	expect_end(1, BDFP4__FINISH_REASON__FINISH_LENGTH, 0, "");
	cr_expect_eq(records(), 0);
}

/* Prefills under way share the step's budget in arrival order, each one chunk a step, and a
 * request cancelled between its chunks gives back every page of its prompt. */
Test(sched, chunks_share_the_budget_and_a_cancel_between_chunks_frees_the_prompt)
{
	const Bdfp4__StepPlan *p;
	struct bd_req *a, *b;
	uint64_t a_id;

	setup_chunked(8, 512, 384);
	a = submit(1, 1000, 2, false);
	b = submit(2, 700, 2, false);
	p = step();
	cr_assert_eq(p->n_rows, 2);
	expect_chunk(p, a->id, 0, 384);
	expect_chunk(p, b->id, 0, 128); /* 512 - 384 left in the budget */
	answer(p);
	p = step();
	cr_assert_eq(p->n_rows, 2);
	expect_chunk(p, a->id, 384, 384);
	expect_chunk(p, b->id, 128, 128);
	answer(p);
	cr_expect_eq(pages_free(), 16 - 7 - 5);
	a_id = a->id; /* a is freed once it ended */
	bd_sched_cancel(&S, a);
	drain();
	expect_end(1, BDFP4__FINISH_REASON__FINISH_CANCELLED,
		   BDFP4__SERVE_ERROR__SERVE_ERR_CANCELLED, "cancelled by the client");
	cr_expect_eq(pages_free(), 16 - 5, "a's 7 pages are back");
	p = step();
	cr_assert_not_null(p);
	cr_expect(released(p, a_id), "the workers drop a's partial sequence");
	cr_assert_eq(p->n_rows, 1);
	cr_expect_eq(p->rows[0]->position, 256);
	cr_expect_eq(p->rows[0]->n_tokens, 384);
	cr_expect_not(p->rows[0]->sample, "700 - 640: 60 tokens to go");
	answer(p);
	run_to_idle(20);
	expect_end(2, BDFP4__FINISH_REASON__FINISH_LENGTH, 0, "");
	expect_pool_clear(16);
}

/* The same two prompts with batch_invariant: b's chunks are 384 tokens as when it runs alone,
 * so it waits (queued) while a's chunks leave less of the budget, and comes in two chunks, 384
 * and 316, once a decodes. */
Test(sched, batch_invariant_chunks_do_not_depend_on_the_other_prompts)
{
	const Bdfp4__StepPlan *p;
	struct bd_req *a, *b;

	setup_chunked(8, 512, 384);
	S.cfg.batch_invariant = true;
	a = submit(1, 1000, 2, false);
	b = submit(2, 700, 2, false);
	p = step();
	cr_assert_eq(p->n_rows, 1, "b's 384-token chunk does not fit beside a's");
	cr_expect_eq(row_of(p, a->id)->n_tokens, 384);
	answer(p);
	p = step();
	cr_assert_eq(p->n_rows, 1);
	expect_chunk(p, a->id, 384, 384);
	answer(p);
	p = step();
	cr_assert_eq(p->n_rows, 1, "a's last 232 tokens leave 280: still not b's 384");
	cr_expect_eq(row_of(p, a->id)->n_tokens, 232);
	answer(p);
	p = step();
	cr_assert_eq(p->n_rows, 2, "a decodes, b's first chunk");
	cr_expect_eq(row_of(p, a->id)->n_tokens, 1);
	expect_chunk(p, b->id, 0, 384);
	answer(p);
	p = step();
	expect_chunk(p, b->id, 384, 316);
	answer(p);
	run_to_idle(40);
	expect_end(1, BDFP4__FINISH_REASON__FINISH_LENGTH, 0, "");
	expect_end(2, BDFP4__FINISH_REASON__FINISH_LENGTH, 0, "");
	cr_expect_eq(pages_free(), 16);
}

Test(sched, streamed_requests_get_a_chunk_per_token)
{
	setup(4, 8, 8192, 16, 8);
	submit(1, 5, 4, true);
	submit(2, 5, 4, false);
	cr_expect_eq(run_to_idle(10), 5, "a prefill, three decodes, the releases");
	cr_expect_eq(chunks_of(1), 4);
	for (int i = 0; i < 3; i++) {
		cr_expect_eq(C[i].tag, 1);
		cr_expect_eq(C[i].n_tokens, 1);
		cr_expect_eq(C[i].finish, BDFP4__FINISH_REASON__FINISH_NONE);
	}
	expect_end(1, BDFP4__FINISH_REASON__FINISH_LENGTH, 0, "");
	cr_expect_eq(last_chunk(1)->n_tokens, 1, "the final chunk carries the last token");
	cr_expect_eq(chunks_of(2), 1);
	cr_expect_eq(last_chunk(2)->n_tokens, 4);
}

/* ---- pages ----------------------------------------------------------------------------------- */

Test(sched, pages_come_at_prefill_and_one_step_ahead_of_the_decode_that_fills_them)
{
	const Bdfp4__StepPlan *p;
	const Bdfp4__PlanRow *row;
	struct bd_req *a;
	int32_t page1 = -1;

	setup(4, 8, 8192, 16, 8);
	a = submit(1, 200, 100, false);
	p = step();
	row = row_of(p, a->id);
	cr_assert_eq(row->n_new_pages, 1, "positions 0..199 complete page 0");
	cr_expect_eq(row->new_pages[0], 0);
	cr_expect_eq(P.allocs, 1);
	answer(p);
	/* decodes at positions 200 .. 254 fill nothing; the one at 254 reserves for 255 */
	for (int pos = 200; pos < 255; pos++) {
		p = step();
		row = row_of(p, a->id);
		cr_assert_eq(row->position, pos);
		cr_assert_eq(row->n_new_pages, 0, "position %d completes no page", pos);
		cr_assert_eq(row->n_block_table, 1);
		cr_assert_eq(P.reserves, pos == 254, "reserved at the plan of position %d", pos);
		answer(p);
	}
	cr_expect_eq(rec_of(a->id)->reserved, 1);
	p = step();
	row = row_of(p, a->id);
	cr_expect_eq(row->position, 255);
	cr_assert_eq(row->n_new_pages, 1, "position 255 completes page 1");
	page1 = row->new_pages[0];
	cr_expect_eq(page1, 1, "into the reserved page");
	cr_expect_eq(P.commits, 0, "committed only when every rank answered");
	answer(p);
	cr_expect_eq(P.commits, 1);
	cr_expect_eq(rec_of(a->id)->n_pages, 2);
	p = step();
	row = row_of(p, a->id);
	cr_assert_eq(row->n_block_table, 2);
	cr_expect_eq(row->block_table[0], 0);
	cr_expect_eq(row->block_table[1], page1);
	answer(p);
	cr_expect_eq(S.pages_held, 2);
	cr_expect_eq(S.pages_peak, 2);
	run_to_idle(100);
	expect_end(1, BDFP4__FINISH_REASON__FINISH_LENGTH, 0, "");
	cr_expect_eq(last_chunk(1)->n_gen, 100);
	cr_expect_eq(pages_free(), 16);
	cr_expect_eq(S.pages_held, 0);
}

/* One page for two requests whose first decode completes a page: the one admitted last is
 * preempted, released (the workers drop its sequence), queued again at the head, and admitted
 * once the first is done, with a prefill of its prompt and the token it had generated. */
Test(sched, the_request_admitted_last_is_preempted_and_recomputed)
{
	const Bdfp4__StepPlan *p;
	const Bdfp4__PlanRow *row;
	struct bd_req *a, *b;
	int steps;

	setup(4, 8, 8192, 1, 4);
	a = submit(1, 127, 6, false);
	b = submit(2, 127, 6, false);
	p = step();
	cr_assert_eq(p->n_rows, 2);
	cr_expect_eq(rec_of(a->id)->reserved, 0, "a reserved the only page for position 127");
	cr_expect_eq(rec_of(b->id)->reserved, -1, "none left for b");
	answer(p);
	p = step();
	cr_expect_eq(S.preemptions, 1);
	cr_expect_null(rec_of(b->id), "the preempted request holds nothing");
	cr_expect(released(p, b->id), "the workers drop b's sequence");
	cr_assert_eq(p->n_rows, 1, "b is queued again, and nothing is admitted this step");
	row = row_of(p, a->id);
	cr_expect_eq(row->position, 127);
	cr_expect_eq(row->n_new_pages, 1);
	cr_expect_eq(S.n_queued, 1);
	cr_expect_eq(S.n_running, 1);
	answer(p);
	/* b cannot come back while a holds the page: 127 + 1 tokens need one */
	for (steps = 0; steps < 10 && !row_of(p = step(), b->id); steps++)
		answer(p);
	expect_end(1, BDFP4__FINISH_REASON__FINISH_LENGTH, 0, "");
	cr_expect_eq(last_chunk(1)->n_gen, 6);
	row = row_of(p, b->id);
	cr_assert(row->prefill);
	cr_expect_eq(row->n_tokens, 128, "prompt + the generated token");
	cr_expect_eq(row->tokens[127], 10 + (int)b->id, "its first generated token");
	cr_expect_eq(row->n_new_pages, 1);
	answer(p);
	run_to_idle(20);
	expect_end(2, BDFP4__FINISH_REASON__FINISH_LENGTH, 0, "");
	cr_expect_eq(last_chunk(2)->n_gen, 6, "every token, across the preemption");
	cr_expect_eq(last_chunk(2)->preemptions, 1);
	cr_expect_eq(records(), 0);
}

Test(sched, a_request_the_pool_cannot_hold_fails_resource_exhausted)
{
	const Bdfp4__StepPlan *p;

	setup(4, 8, 8192, 1, 4);
	submit(1, 300, 4, false); /* its prefill alone completes two pages */
	submit(2, 10, 2, false);
	p = step();
	expect_failed(1, BDFP4__SERVE_ERROR__SERVE_ERR_RESOURCE_EXHAUSTED,
		      "the pool has no room for this request now (other owners hold its pages "
		      "or slots, or it needs more than the pool has): No space left on device");
	cr_expect_null(rec_of(1), "its slot went back");
	cr_assert_not_null(p, "the next one is admitted in the same step");
	cr_expect_eq(p->n_rows, 1);
	cr_expect_eq(p->rows[0]->request_id, 2);
	cr_expect_eq(S.requests_failed, 1);
}

Test(sched, no_admission_while_the_slots_are_taken)
{
	const Bdfp4__StepPlan *p;

	setup(8, 8, 8192, 16, 2);
	submit_n(3, 10, 2);
	p = step();
	cr_expect_eq(p->n_rows, 2, "two slots");
	cr_expect_null(row_of(p, 3));
	cr_expect_eq(S.n_queued, 1);
	answer(p);
	answer(step());
	p = step();
	cr_assert_not_null(row_of(p, 3), "admitted when a slot is free");
	cr_expect(row_of(p, 3)->prefill);
}

/* ---- queue, cancel, clients, deadlines ------------------------------------------------------- */

Test(sched, the_queue_refuses_beyond_max_queue)
{
	struct bd_req *r;

	setup(1, 2, 8192, 16, 4);
	submit_n(2, 10, 2);
	r = req(3, "client", 10, 2);
	cr_expect_eq(bd_sched_submit(&S, r), -ENOSPC);
	cr_expect_eq(S.n_queued, 2);
	cr_expect_eq(S.requests_total, 2, "a refused request is not counted");
	/* one leaves the queue: room again */
	step();
	cr_expect_eq(bd_sched_submit(&S, r), 0);
	cr_expect_eq(r->id, 3, "ids go only to accepted requests");
}

Test(sched, cancel_of_a_queued_request_ends_it_at_once)
{
	struct bd_req *a;

	setup(1, 8, 8192, 16, 4);
	submit(1, 10, 5, false);
	a = submit(2, 10, 5, false);
	step();
	bd_sched_cancel(&S, a);
	drain();
	cr_assert_eq(n_chunks, 1);
	expect_end(2, BDFP4__FINISH_REASON__FINISH_CANCELLED,
		   BDFP4__SERVE_ERROR__SERVE_ERR_CANCELLED, "cancelled by the client");
	cr_expect_eq(S.n_queued, 0);
	cr_expect_null(bd_sched_find(&S, (const uint8_t *)"client", 6, 2));
}

/* A request in the step in flight ends only when the step's results are in: the workers may
 * still be writing its pages. */
Test(sched, cancel_in_flight_ends_when_the_step_is_in)
{
	const Bdfp4__StepPlan *p;
	struct bd_req *a;

	setup(4, 8, 8192, 16, 4);
	a = submit(1, 10, 50, true);
	answer(step());
	answer(step());
	cr_expect_eq(n_chunks, 2);
	p = step();
	cr_expect_eq(bd_sched_find(&S, (const uint8_t *)"client", 6, 1), a);
	bd_sched_cancel(&S, a);
	drain();
	cr_expect_eq(n_chunks, 2, "no final chunk while in the step");
	cr_expect_null(bd_sched_find(&S, (const uint8_t *)"client", 6, 1), "but it is ending");
	cr_expect_not_null(rec_of(1), "its pool record stays until the step is in");
	answer(p);
	cr_assert_eq(n_chunks, 3);
	cr_expect_eq(C[2].finish, BDFP4__FINISH_REASON__FINISH_CANCELLED);
	cr_expect_eq(C[2].n_gen, 2, "the token of the cancelled step is not appended");
	cr_expect_null(rec_of(1));
	p = step();
	cr_assert_not_null(p, "a plan goes out for the release alone");
	cr_expect_eq(p->n_rows, 0);
	cr_expect(released(p, 1));
}

Test(sched, a_gone_client_loses_its_requests_without_a_reply)
{
	struct bd_req *x1, *x2, *y;
	const Bdfp4__StepPlan *p;

	setup(1, 8, 8192, 16, 4);
	x1 = req(1, "client-x", 10, 5);
	x2 = req(2, "client-x", 10, 5);
	y = req(1, "client-y", 10, 5);
	cr_assert_eq(bd_sched_submit(&S, x1), 0);
	cr_assert_eq(bd_sched_submit(&S, y), 0);
	cr_assert_eq(bd_sched_submit(&S, x2), 0);
	answer(step()); /* x1 runs */
	cr_expect_eq(bd_sched_find(&S, (const uint8_t *)"client-y", 8, 1), y,
		     "tags are per connection");
	bd_sched_client_gone(&S, (const uint8_t *)"client-x", 8);
	drain();
	cr_expect_eq(n_chunks, 0, "nobody to tell");
	cr_expect_eq(S.n_reqs, 1);
	cr_expect_null(rec_of(1), "x1's slot went back");
	p = step();
	cr_assert_not_null(p);
	cr_expect(released(p, 1), "the workers drop x1");
	cr_expect_eq(p->rows[0]->request_id, 2, "y (request 2) is admitted");
	answer(p);
	run_to_idle(10);
	cr_expect_eq(last_chunk(1)->id, 2);
	expect_end(1, BDFP4__FINISH_REASON__FINISH_LENGTH, 0, "");
}

Test(sched, deadlines_fail_queued_and_running_requests)
{
	struct bd_req *a, *b;
	const Bdfp4__StepPlan *p;

	setup(1, 8, 8192, 16, 4);
	a = submit(1, 10, 50, false);
	b = submit(2, 10, 50, false);
	a->deadline = now + 100;
	b->deadline = now + 50;
	answer(step());
	cr_expect_eq(tick(now + 49), 0);
	cr_assert_eq(tick(now + 50), 1);
	expect_failed(2, BDFP4__SERVE_ERROR__SERVE_ERR_DEADLINE_EXCEEDED,
		      "deadline of 50 ms passed");
	p = step();
	cr_expect_eq(tick(now + 100), 1, "a is in the step: it ends with it");
	answer(p);
	cr_assert_eq(n_chunks, 2);
	expect_failed(1, BDFP4__SERVE_ERROR__SERVE_ERR_DEADLINE_EXCEEDED,
		      "deadline of 100 ms passed");
	cr_expect_eq(records(), 0);
	cr_expect_eq(S.requests_failed, 2);
}

/* ---- tokens ---------------------------------------------------------------------------------- */

Test(sched, end_of_generation_and_forced_tokens)
{
	const Bdfp4__StepPlan *p;
	struct bd_req *b, *c;
	int32_t forced[2] = { 42, EOG };

	setup(4, 8, 8192, 16, 4);
	submit(1, 10, 5, false);
	b = submit(2, 10, 5, false);
	b->ignore_eos = true;
	c = req(3, "client", 10, 5);
	c->forced = malloc(sizeof(forced));
	memcpy(c->forced, forced, sizeof(forced));
	c->n_forced = 2;
	cr_assert_eq(bd_sched_submit(&S, c), 0);
	p = step();
	prepare(p);
	rows[0][0].token = EOG;
	rows[0][1].token = EOG;
	deliver();
	expect_end(1, BDFP4__FINISH_REASON__FINISH_STOP, 0, "");
	cr_expect_eq(last_chunk(1)->n_gen, 1);
	cr_expect_null(last_chunk(2), "ignore_eos: b goes on");
	cr_expect_eq(b->toks[10], EOG);
	cr_expect_eq(c->toks[10], 42, "the forced token, not the sampled one");
	answer(step());
	/* a forced end-of-generation token ends it too */
	expect_end(3, BDFP4__FINISH_REASON__FINISH_STOP, 0, "");
	cr_expect_eq(last_chunk(3)->n_gen, 2);
	cr_expect_null(last_chunk(2));
}

Test(sched, row_errors_and_bad_tokens_fail_their_request_only)
{
	const Bdfp4__StepPlan *p;

	setup(4, 8, 8192, 16, 4);
	submit_n(3, 10, 5);
	p = step();
	prepare(p);
	rows[1][0].error = BDFP4__SERVE_ERROR__SERVE_ERR_RESOURCE_EXHAUSTED;
	rows[1][0].message = (char *)"out of memory";
	rows[0][1].token = N_VOCAB;
	deliver();
	expect_failed(1, BDFP4__SERVE_ERROR__SERVE_ERR_WORKER_FAILED,
		      "worker rank 1: out of memory");
	expect_failed(2, BDFP4__SERVE_ERROR__SERVE_ERR_INTERNAL,
		      "worker rank 0 sampled token 1000, outside the vocabulary");
	cr_expect_null(last_chunk(3));
	p = step();
	cr_expect(released(p, 1) && released(p, 2));
	cr_expect_eq(p->n_rows, 1);
	/* a result that does not match the plan */
	prepare(p);
	rows[0][0].request_id = 99;
	deliver();
	expect_failed(3, BDFP4__SERVE_ERROR__SERVE_ERR_INTERNAL,
		      "worker rank 0: result rows do not match the plan");
}

Test(sched, results_of_another_step_are_ignored)
{
	const Bdfp4__StepPlan *p;

	setup(4, 8, 8192, 16, 4);
	submit(1, 10, 5, false);
	p = step();
	prepare(p);
	res[0].step = res[1].step = p->step + 1;
	bd_sched_step_done(&S, pres, 2, now);
	drain();
	cr_expect(S.step.active, "still waiting for the step");
	cr_expect_null(step());
	res[0].step = res[1].step = p->step;
	deliver();
	cr_expect_not(S.step.active);
	cr_expect_eq(S.steps_done, 1);
}

/* ---- the worker group and the pool ----------------------------------------------------------- */

Test(sched, without_a_resume_timeout_a_failed_group_fails_what_runs_and_keeps_the_queue)
{
	const Bdfp4__StepPlan *p = in_flight(2, 3);

	bd_sched_group_down(&S, "worker rank 1 (pid 7) disconnected", now);
	drain();
	cr_assert_eq(n_chunks, 2);
	for (uint64_t tag = 1; tag <= 2; tag++)
		expect_failed(tag, BDFP4__SERVE_ERROR__SERVE_ERR_WORKER_FAILED,
			      "worker rank 1 (pid 7) disconnected");
	cr_expect_eq(records(), 0);
	cr_expect_eq(S.n_queued, 1, "the queued one waits for a group");
	cr_expect_null(step(), "no plan without a group");
	bd_sched_group_up(&S, 2);
	p = step();
	cr_assert_not_null(p);
	cr_expect_eq(p->epoch, 2);
	cr_expect_eq(p->n_release, 0, "a new group holds no sequence to drop");
	cr_expect_eq(p->rows[0]->request_id, 3);
	cr_expect(p->rows[0]->prefill);
}

/* A group fails with a decode row and a prefill chunk in flight: nothing fails, the pool keeps
 * every record, and the next group re-runs the lost step, each request's row marked resume
 * with what a worker needs to rebuild it; afterwards the requests go on to their length with
 * no token lost or repeated. */
Test(sched, a_failed_group_holds_the_running_requests_and_the_next_group_resumes_them)
{
	const Bdfp4__StepPlan *p;
	const Bdfp4__PlanRow *ra, *rb;
	struct bd_req *a, *b;
	int32_t tok_a;

	setup_chunked(4, 256, 128);
	S.cfg.resume_timeout_ms = 5000;
	a = submit(1, 10, 20, true);
	b = submit(2, 300, 5, true);
	answer(step());
	p = step();
	cr_assert_eq(p->n_rows, 2);
	tok_a = row_of(p, a->id)->tokens[0];
	cr_expect_eq(row_of(p, b->id)->position, 128);
	cr_expect_not(row_of(p, a->id)->resume);
	bd_sched_group_down(&S, "worker rank 1 (pid 7) disconnected", now);
	drain();
	cr_expect_eq(n_chunks, 1, "only a's first token: nothing failed");
	cr_expect_eq(records(), 2, "the pool keeps both records");
	cr_expect_eq(pages_free(), 16 - 2, "b's prompt pages stay allocated");
	cr_expect_eq(S.n_running, 2);
	cr_expect(bd_sched_resuming(&S));
	cr_expect_null(step(), "no plan without a group");
	now += 1000;
	cr_expect_eq(tick(now), 1, "within resume_timeout_ms nothing fails");

	bd_sched_group_up(&S, 2);
	cr_expect_not(bd_sched_resuming(&S));
	p = step();
	cr_assert_not_null(p);
	cr_expect_eq(p->epoch, 2);
	cr_expect_eq(p->n_release, 0);
	ra = row_of(p, a->id);
	rb = row_of(p, b->id);
	cr_assert(ra && rb);
	cr_expect_not(ra->prefill);
	cr_expect(ra->resume);
	cr_expect_eq(ra->position, 10, "the lost step runs again");
	cr_expect_eq(ra->tokens[0], tok_a);
	cr_expect_eq(ra->draws, 1, "a sampled its first token");
	cr_expect_eq(ra->capacity, 30);
	cr_expect_str_eq(ra->kv_config, "bitdecoding-nvfp4");
	cr_assert_not_null(ra->sampling);
	cr_expect_eq(ra->sampling->seed, a->sampling.seed);
	cr_expect(rb->prefill);
	cr_expect(rb->resume);
	cr_expect_eq(rb->position, 128);
	cr_expect_eq(rb->n_tokens, 128);
	cr_assert_eq(rb->n_block_table, 1, "the page the first chunk promoted");
	cr_expect_eq(rb->block_table[0], b->pages[0]);
	cr_expect_eq(rb->draws, 0);
	answer(p);
	p = step();
	cr_expect_not(row_of(p, a->id)->resume, "only the first row after the new group");
	cr_expect_not(row_of(p, b->id)->resume);
	answer(p);
	run_to_idle(40);
	expect_end(1, BDFP4__FINISH_REASON__FINISH_LENGTH, 0, "");
	expect_end(2, BDFP4__FINISH_REASON__FINISH_LENGTH, 0, "");
	cr_expect_eq(last_chunk(1)->n_gen, 20); /* a and b are freed once they ended */
	cr_expect_eq(S.tokens_generated, 25, "no token twice");
	expect_pool_clear(16);
}

/* The group's workers decide how a prompt is cut (bd_sched_set_workers, from their
 * RegisterRequests): rows of at most 200 tokens cut the 256-token chunks to one page; a group
 * that takes whole prompts only gets each prompt in one row, and a prompt held in the middle
 * of its prefill when such a group forms starts over at position 0 (no row at 128 is sent). */
Test(sched, the_workers_capabilities_cut_the_chunks)
{
	const Bdfp4__StepPlan *p;
	const Bdfp4__PlanRow *rb;
	struct bd_req *b;

	setup_chunked(4, 512, 256);
	S.cfg.resume_timeout_ms = 5000;
	bd_sched_set_workers(&S, false, 200);
	b = submit(2, 600, 3, true);
	p = step();
	rb = row_of(p, b->id);
	cr_assert_not_null(rb);
	cr_expect_eq(rb->position, 0);
	cr_expect_eq(rb->n_tokens, 128, "max_row 200 holds one whole page");
	answer(p);
	p = step();
	rb = row_of(p, b->id);
	cr_expect_eq(rb->position, 128);
	cr_expect_eq(rb->n_tokens, 128);

	/* the group fails with b at 128; the next one takes whole prompts only */
	bd_sched_group_down(&S, "worker rank 0 (pid 9) disconnected", now);
	drain();
	bd_sched_set_workers(&S, true, 0);
	bd_sched_group_up(&S, 2);
	p = step();
	rb = row_of(p, b->id);
	cr_assert_not_null(rb);
	cr_expect(rb->prefill);
	cr_expect_not(rb->resume, "a prefill at 0 starts the sequence anyway");
	cr_expect_eq(rb->position, 0, "the prefill starts over");
	cr_expect_eq(rb->n_tokens, 600, "the whole prompt in one row");
	cr_expect_eq(rb->n_block_table, 0);
	cr_assert_eq(rb->n_new_pages, 4);
	cr_expect_eq(rb->new_pages[0], b->pages[0], "on the pages it was admitted with");
	cr_expect(rb->sample);
	answer(p);
	run_to_idle(20);
	expect_end(2, BDFP4__FINISH_REASON__FINISH_LENGTH, 0, "");
	cr_expect_eq(S.tokens_generated, 3, "no token twice");
	expect_pool_clear(16);
}

/* max_prefill_chunk 0 (whole prompts) on workers that take rows of at most 300 tokens: a
 * 600-token prompt goes in rows of 256, 256 and 88, beyond the step's budget as a whole prompt
 * would; a 200-token prompt in one row. */
Test(sched, whole_prompts_longer_than_the_workers_rows_go_in_chunks)
{
	const Bdfp4__StepPlan *p;
	const Bdfp4__PlanRow *rb;
	struct bd_req *a, *b;
	const int want[3][2] = { { 0, 256 }, { 256, 256 }, { 512, 88 } };

	setup(4, 8, 128, 16, 8);
	bd_sched_set_workers(&S, false, 300);
	b = submit(2, 600, 2, true);
	for (int k = 0; k < 3; k++) {
		p = step();
		rb = row_of(p, b->id);
		cr_assert_not_null(rb);
		cr_expect(rb->prefill);
		cr_expect_eq(rb->position, want[k][0]);
		cr_expect_eq(rb->n_tokens, want[k][1]);
		cr_expect_eq(rb->sample, k == 2);
		answer(p);
	}
	run_to_idle(20);
	expect_end(2, BDFP4__FINISH_REASON__FINISH_LENGTH, 0, "");
	a = submit(3, 200, 1, true);
	p = step();
	cr_assert_not_null(row_of(p, a->id));
	cr_expect_eq(row_of(p, a->id)->n_tokens, 200);
	answer(p);
	run_to_idle(20);
	cr_expect_eq(records(), 0);
}

/* No group forms within resume_timeout_ms: every live request, running or queued, fails
 * WORKER_FAILED saying so, and the pool gets everything back. */
Test(sched, a_resume_that_times_out_fails_every_request_clearly_and_frees_the_pool)
{
	const Bdfp4__StepPlan *p = in_flight(2, 3);
	const char *want = "the worker group did not form again within resume_timeout_ms "
			   "(5000 ms): worker rank 1 (pid 7) stopped heartbeating (3000 ms)";

	(void)p;
	S.cfg.resume_timeout_ms = 5000;
	bd_sched_group_down(&S, "worker rank 1 (pid 7) stopped heartbeating (3000 ms)", now);
	drain();
	cr_expect_eq(n_chunks, 0);
	cr_expect_eq(records(), 2);
	cr_expect_eq(tick(now + 4999), 0);
	cr_assert_eq(tick(now + 5000), 3);
	for (uint64_t tag = 1; tag <= 3; tag++)
		expect_failed(tag, BDFP4__SERVE_ERROR__SERVE_ERR_WORKER_FAILED, want);
	expect_pool_clear(16);
	cr_expect_eq(S.n_reqs, 0);
	cr_expect_not(bd_sched_resuming(&S));
	bd_sched_group_up(&S, 2);
	cr_expect_null(step(), "nothing left to run");
}

/* A request cancelled while it waits for the group ends at once and frees its pages; the
 * others resume. */
Test(sched, a_cancel_while_held_ends_at_once)
{
	const Bdfp4__StepPlan *p = in_flight(2, 2);
	struct bd_req *a = S.reqs[0];

	S.cfg.resume_timeout_ms = 5000;
	bd_sched_group_down(&S, "worker rank 0 (pid 9) disconnected", now);
	bd_sched_cancel(&S, a);
	drain();
	expect_end(1, BDFP4__FINISH_REASON__FINISH_CANCELLED,
		   BDFP4__SERVE_ERROR__SERVE_ERR_CANCELLED, "cancelled by the client");
	cr_expect_eq(records(), 1);
	bd_sched_group_up(&S, 2);
	p = step();
	cr_assert_eq(p->n_rows, 1);
	cr_expect_eq(p->rows[0]->request_id, 2);
	cr_expect(p->rows[0]->resume);
	cr_expect_eq(p->n_release, 0, "a new group holds nothing to drop");
	answer(p);
}

Test(sched, a_pool_that_goes_down_fails_every_request_unavailable)
{
	const Bdfp4__StepPlan *p = in_flight(1, 2);

	cr_expect(bd_sched_pool_busy(&S));
	P.down = true;
	bd_sched_pool_down(&S, "kvpoold unreachable: no answer in 2000 ms (for 5 ms)");
	drain();
	cr_assert_eq(n_chunks, 1, "the queued one now, the running one with its step");
	expect_failed(2, BDFP4__SERVE_ERROR__SERVE_ERR_UNAVAILABLE,
		      "kvpoold unreachable: no answer in 2000 ms (for 5 ms)");
	answer(p);
	cr_assert_eq(n_chunks, 2);
	expect_failed(1, BDFP4__SERVE_ERROR__SERVE_ERR_UNAVAILABLE,
		      "kvpoold unreachable: no answer in 2000 ms (for 5 ms)");
	cr_expect_not(bd_sched_pool_busy(&S), "a reclaim may take the records now");
	/* the release the workers are owed still goes out; a request that reaches admission
	 * while the pool is down fails with the pool's reason */
	submit(3, 10, 5, false);
	p = step();
	cr_assert_not_null(p);
	cr_expect_eq(p->n_rows, 0);
	cr_expect(released(p, 1));
	expect_failed(3, BDFP4__SERVE_ERROR__SERVE_ERR_UNAVAILABLE,
		      "kvpoold unreachable: fake (for 1 ms)");
	answer(p);
	cr_expect_null(step(), "nothing to plan while the pool is down");
}

/* A pool call without an answer (the pool is down from then on) is not the request's fault:
 * UNAVAILABLE with the pool's reason; a refusal of a pool that answers is INTERNAL. */
Test(sched, a_failed_admission_call_says_whose_fault_it_is)
{
	setup(1, 8, 8192, 16, 4);
	submit(1, 10, 5, false);
	P.fail_slot = -ETIMEDOUT;
	P.fail_goes_down = true;
	cr_expect_null(step(), "nothing to run");
	expect_failed(1, BDFP4__SERVE_ERROR__SERVE_ERR_UNAVAILABLE,
		      "kvpoold unreachable: fake (for 1 ms)");
	P.down = false;
	submit(2, 10, 5, false);
	P.fail_slot = -EIO;
	P.fail_goes_down = false;
	cr_expect_null(step());
	expect_failed(2, BDFP4__SERVE_ERROR__SERVE_ERR_INTERNAL,
		      "pool admission: Input/output error");
	cr_expect_eq(records(), 0);
	cr_expect_eq(S.requests_failed, 2);
}

Test(sched, stop_ends_everything_shutting_down)
{
	in_flight(1, 2);
	bd_sched_stop(&S, BDFP4__SERVE_ERROR__SERVE_ERR_SHUTTING_DOWN, "the router is stopping");
	drain();
	cr_assert_eq(n_chunks, 2, "the one in the step in flight too");
	for (uint64_t tag = 1; tag <= 2; tag++)
		expect_failed(tag, BDFP4__SERVE_ERROR__SERVE_ERR_SHUTTING_DOWN,
			      "the router is stopping");
	cr_expect_eq(S.n_reqs, 0);
	cr_expect_eq(records(), 0);
	cr_expect_not(S.step.active);
	cr_expect_null(step());
}

/* ---- prefix caching ---------------------------------------------------------------------------
 * The fake's index: hash → page, as PrefixStore leaves it; a match takes the pages of the
 * leading indexed hashes into the request's record. What the scheduler is checked for: the
 * hashes it sends (chained, salted), where a hit's prefill starts, the row that rebuilds the
 * sink, and the pages it stores after a chunk. */

#define MAX_IDX 64

static struct {
	uint64_t hash[MAX_IDX];
	int32_t page[MAX_IDX];
	int n, stores, matches;
	uint64_t last_parent;
	int32_t last_token0;
} X;

static int fp_prefix_match(void *ctx, uint64_t id, const uint64_t *hashes, size_t n,
			   int32_t *ret_pages, size_t *ret_n)
{
	int e;
	struct rec *r = fp_rec(id, &e);
	size_t k = 0;

	(void)ctx;
	if (!r)
		return e;
	X.matches++;
	for (; k < n; k++) {
		int i = 0;

		while (i < X.n && X.hash[i] != hashes[k])
			i++;
		if (i == X.n)
			break;
		ret_pages[k] = X.page[i];
		r->pages[r->n_pages++] = X.page[i];
	}
	*ret_n = k;
	return 0;
}

static int fp_prefix_store(void *ctx, uint64_t id, const int32_t *pages, const uint64_t *hashes,
			   size_t n, const int32_t *tokens, uint64_t parent)
{
	(void)ctx;
	cr_assert_not_null(rec_of(id));
	X.stores++;
	X.last_parent = parent;
	X.last_token0 = tokens[0];
	for (size_t i = 0; i < n && X.n < MAX_IDX; i++) {
		X.hash[X.n] = hashes[i];
		X.page[X.n++] = pages[i];
	}
	return 0;
}

/* fake_pool with the index (setup_prefix fills it) */
static struct bd_sched_pool_ops fake_pool_prefix;

static void setup_prefix(void)
{
	const struct bd_sched_cfg cfg = { .max_batch = 8, .max_queue = 8,
					  .max_prefill_tokens = 1024, .max_prefill_chunk = 128,
					  .n_vocab = N_VOCAB, .eog = eog };

	setup(8, 8, 1024, MAX_PAGES, 8);
	bd_sched_fini(&S);
	memset(&X, 0, sizeof(X));
	fake_pool_prefix = fake_pool;
	fake_pool_prefix.prefix_match = fp_prefix_match;
	fake_pool_prefix.prefix_store = fp_prefix_store;
	cr_assert_eq(bd_sched_init(&S, &cfg, &fake_pool_prefix, NULL), 0);
	bd_sched_set_prefix(&S, true, 42);
	bd_sched_group_up(&S, 1);
}

Test(sched, a_cached_prefix_starts_the_prefill_after_it_and_rebuilds_the_sink)
{
	struct bd_req *a, *b, *c;
	const Bdfp4__StepPlan *p;
	const Bdfp4__PlanRow *row;
	int32_t a_pages[2];

	setup_prefix();
	/* A: 300 tokens in chunks of 128: pages 0 and 1 are stored as each chunk fills them */
	a = submit(1, 300, 1, false);
	cr_assert_not_null(p = step());
	cr_expect_eq(X.matches, 1, "A looked its pages up (and found none)");
	cr_expect_eq(row_of(p, a->id)->position, 0);
	cr_expect_eq(row_of(p, a->id)->prefix_pages, 0);
	answer(p);
	cr_expect_eq(X.stores, 1, "the first chunk's page is stored");
	cr_expect_eq(X.n, 1);
	cr_expect_eq(X.last_parent, 0, "page 0 has no parent");
	memcpy(a_pages, a->pages, sizeof(a_pages));
	run_to_idle(8);
	cr_expect_eq(X.n, 2, "A's 2 full pages are indexed");
	cr_expect_neq(X.hash[0], X.hash[1]);
	cr_expect_eq(X.last_parent, X.hash[0], "page 1's parent is page 0's hash");
	cr_expect_eq(X.last_token0, 100 + 128, "page 1's tokens start at position 128");
	expect_end(1, BDFP4__FINISH_REASON__FINISH_LENGTH, 0, NULL);

	/* B: the same 300 tokens: (300 − 1) / 128 = 2 pages hit, the prefill starts at 256 */
	b = submit(2, 300, 1, false);
	cr_assert_not_null(p = step());
	row = row_of(p, b->id);
	cr_assert_not_null(row);
	cr_expect_eq(row->position, 256);
	cr_expect_eq(row->n_tokens, 44);
	cr_expect(row->resume, "the worker builds the sequence over the cached pages");
	cr_expect_eq(row->prefix_pages, 2);
	cr_expect_eq(row->n_block_table, 2);
	cr_expect_eq(row->block_table[0], a_pages[0]);
	cr_expect_eq(row->block_table[1], a_pages[1]);
	cr_expect_eq(row->n_context, 256, "the sink is rebuilt from the cached tokens");
	cr_expect_eq(row->context[0], 100);
	cr_expect_eq(row->n_new_pages, 0);
	cr_expect_eq(S.prefix_hits, 256);
	cr_expect_eq(S.prefix_queries, 512);
	answer(p);
	cr_expect_eq(X.n, 2, "nothing new to store");
	run_to_idle(8);
	expect_end(2, BDFP4__FINISH_REASON__FINISH_LENGTH, 0, NULL);

	/* C: the same tokens with a cache salt: other hashes, no hit */
	c = req(3, "client", 300, 1);
	memcpy(c->cache_salt, "tenant", 6);
	c->cache_salt_len = 6;
	cr_assert_eq(bd_sched_submit(&S, c), 0);
	cr_assert_not_null(p = step());
	cr_expect_eq(row_of(p, c->id)->position, 0);
	cr_expect_eq(S.prefix_hits, 256);
	answer(p);
	run_to_idle(8);
	cr_expect_eq(X.n, 4, "the salted pages are indexed apart");
	cr_expect_neq(X.hash[2], X.hash[0]);
	cr_expect_eq(records(), 0, "every record released");
}

Test(sched, prefix_caching_off_looks_nothing_up)
{
	struct bd_req *a;
	const Bdfp4__StepPlan *p;

	setup_prefix();
	bd_sched_set_prefix(&S, false, 42);
	a = submit(1, 300, 1, false);
	cr_assert_not_null(p = step());
	cr_expect_eq(row_of(p, a->id)->position, 0);
	run_to_idle(8);
	cr_expect_eq(X.matches, 0);
	cr_expect_eq(X.stores, 0);
}

/* Workers that take whole prompts only (bd_sched_set_workers) cannot prefill a hit's suffix at
 * position 128·k: a prompt whose pages are indexed is prefilled whole, from 0, and the cache is
 * neither asked nor fed. */
Test(sched, whole_prompt_workers_get_no_prefix_hit)
{
	struct bd_req *b;
	const Bdfp4__StepPlan *p;

	setup_prefix();
	/* A's 2 full pages indexed by a group that ran chunks */
	submit(1, 300, 1, false);
	run_to_idle(8);
	expect_end(1, BDFP4__FINISH_REASON__FINISH_LENGTH, 0, NULL);
	cr_assert_eq(X.n, 2);
	X.matches = X.stores = 0;
	S.prefix_queries = S.prefix_hits = 0;

	/* B, the same tokens, on whole-prompt workers */
	bd_sched_set_workers(&S, true, 0);
	b = submit(2, 300, 1, false);
	cr_assert_not_null(p = step());
	cr_expect_eq(row_of(p, b->id)->position, 0);
	cr_expect_eq(row_of(p, b->id)->n_tokens, 300, "the prompt in one row");
	cr_expect_eq(row_of(p, b->id)->prefix_pages, 0);
	cr_expect_not(row_of(p, b->id)->resume);
	answer(p);
	run_to_idle(8);
	expect_end(2, BDFP4__FINISH_REASON__FINISH_LENGTH, 0, NULL);
	cr_expect_eq(X.matches, 0, "no lookup");
	cr_expect_eq(X.stores, 0, "no store");
	cr_expect_eq(S.prefix_queries, 0);
	cr_expect_eq(S.prefix_hits, 0);
	cr_expect_eq(records(), 0, "every record released");
}
