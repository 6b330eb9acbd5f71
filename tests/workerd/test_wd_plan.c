/* test_wd_plan.c — workerd's cuda backend, the pure part (workerd/growmap.c): plan rows mapped
 * to the stateless GPU model's rows (struct bd_grow) and the per-request records every rank
 * keeps. Suite "wd_plan".
 *
 * Expected page splits are worked out by hand from serve.proto's rule: page j holds positions
 * 128·j .. 128·j + 127, and the token at position p completes page p / 128 when
 * (p + 1) % 128 == 0.
 */
#include <criterion/criterion.h>
#include <string.h>

#include "growmap.h"

#define INV BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT

TestSuite(wd_plan);

static const struct wd_glimits LIM = {
	.n_pages = 100, .n_slots = 8, .max_tokens = 4096, .max_prefill = 512, .n_vocab = 1000,
	.synthetic = false, .kv_config = "bitdecoding-nvfp4",
};

static int32_t PROMPT[1024];

static void prefill_row(Bdfp4__PlanRow *r, uint64_t id, int n, int32_t slot, int32_t *pages,
			uint32_t capacity)
{
	bdfp4__plan_row__init(r);
	for (int i = 0; i < n; i++)
		PROMPT[i] = (i * 7) % 1000;
	r->request_id = id;
	r->prefill = true;
	r->n_tokens = (size_t)n;
	r->tokens = PROMPT;
	r->slot = slot;
	r->n_new_pages = (size_t)(n / 128);
	r->new_pages = pages;
	r->capacity = capacity;
	r->sample = true;
}

/* A plan row of request id: n tokens at position pos over the block table bt[n_bt],
 * promoting into newp[n_new]. */
static void plan_row(Bdfp4__PlanRow *r, uint64_t id, bool prefill, int pos, int32_t *tokens, int n,
		     int32_t slot, int32_t *bt, size_t n_bt, int32_t *newp, size_t n_new, bool sample)
{
	bdfp4__plan_row__init(r);
	r->request_id = id;
	r->prefill = prefill;
	r->position = pos;
	r->n_tokens = (size_t)n;
	r->tokens = tokens;
	r->slot = slot;
	r->block_table = bt;
	r->n_block_table = n_bt;
	r->new_pages = newp;
	r->n_new_pages = n_new;
	r->sample = sample;
}

static void decode_row(Bdfp4__PlanRow *r, uint64_t id, int pos, int32_t *tok, int32_t slot,
		       int32_t *bt, size_t n_bt, int32_t *newp, size_t n_new)
{
	plan_row(r, id, false, pos, tok, 1, slot, bt, n_bt, newp, n_new, true);
}

/* A prefill of request id that maps and runs: its record then holds the n tokens. */
static void prefilled(struct wd_gtab *t, uint64_t id, int n, int32_t slot, int32_t *pages,
		      uint32_t capacity)
{
	Bdfp4__PlanRow r;
	struct wd_gitem it;
	char msg[200];

	prefill_row(&r, id, n, slot, pages, capacity);
	cr_assert_eq(wd_gmap(t, &r, &LIM, &it, msg, sizeof(msg)), 0, "%s", msg);
	wd_gdone(t, &it, true);
}

/* r refused under lim with code and a message that names why. */
static void refused(struct wd_gtab *t, const Bdfp4__PlanRow *r, const struct wd_glimits *lim,
		    int code, const char *why)
{
	struct wd_gitem it;
	char msg[200];

	cr_assert_eq(wd_gmap(t, r, lim, &it, msg, sizeof(msg)), code, "%s", msg);
	cr_assert_not_null(strstr(msg, why), "%s", msg);
}

/* it is a prefill of n_tokens of PROMPT into slot at position, over the block table bt[n_bt]
 * (bt NULL: none), promoting into newp[n_new]. */
static void expect_prefill(const struct wd_gitem *it, int n_tokens, int32_t slot, int32_t position,
			   const int32_t *bt, int n_bt, const int32_t *newp, int n_new)
{
	cr_assert_eq(it->kind, WD_G_PREFILL);
	cr_assert_eq(it->n_tokens, n_tokens);
	cr_assert_eq(it->tokens, PROMPT);
	cr_assert_eq(it->g.slot, slot);
	cr_assert_eq(it->g.position, position);
	cr_assert_eq(it->g.n_pages, n_bt);
	if (bt)
		cr_assert_eq(it->g.block_table, bt);
	cr_assert_eq(it->g.n_new, n_new);
	cr_assert_eq(it->g.new_pages, newp);
}

/* A real prefill of 300 tokens fills pages 0 and 1 (positions 0..255); the record then holds
 * 300 tokens, those two pages, one draw, and the sampling parameters of the row. */
Test(wd_plan, prefill_maps_and_the_record_follows)
{
	struct wd_gtab t = { 0 };
	struct wd_gitem it;
	Bdfp4__PlanRow r;
	Bdfp4__SamplingParams sp = BDFP4__SAMPLING_PARAMS__INIT;
	int32_t pages[2] = { 17, 4 };
	char msg[200];

	prefill_row(&r, 5, 300, 3, pages, 400);
	sp.temperature = 0.7f;
	sp.top_k = 40;
	sp.top_p = 0.0f; /* serve.proto: 0 means 1 */
	sp.seed = 99;
	r.sampling = &sp;
	r.logits_top_k = 200; /* capped at 64 */
	cr_assert_eq(wd_gmap(&t, &r, &LIM, &it, msg, sizeof(msg)), 0, "%s", msg);
	expect_prefill(&it, 300, 3, 0, NULL, 0, pages, 2);
	cr_assert_eq(it.g.rng_step, 0);
	cr_assert_float_eq(it.g.sampling.temperature, 0.7f, 0);
	cr_assert_eq(it.g.sampling.top_k, 40);
	cr_assert_float_eq(it.g.sampling.top_p, 1.0f, 0);
	cr_assert_eq(it.g.sampling.seed, 99);
	cr_assert_eq(it.top_k, 64);
	wd_gdone(&t, &it, true);

	struct wd_greq *q = wd_gtab_find(&t, 5);
	cr_assert_not_null(q);
	cr_assert_eq(q->n_tokens, 300);
	cr_assert_eq(q->n_pages, 2);
	cr_assert(q->pages[0] == 17 && q->pages[1] == 4);
	cr_assert_eq(q->draws, 1);
	cr_assert(!q->busy);

	/* the next decode: position 300, block table = the two pages, rng_step 1, the
	 * request's sampling */
	int32_t tok = 12;
	decode_row(&r, 5, 300, &tok, 3, pages, 2, NULL, 0);
	cr_assert_eq(wd_gmap(&t, &r, &LIM, &it, msg, sizeof(msg)), 0, "%s", msg);
	cr_assert_eq(it.kind, WD_G_DECODE);
	cr_assert_eq(it.g.position, 300);
	cr_assert_eq(it.g.n_pages, 2);
	cr_assert_eq(it.g.rng_step, 1);
	cr_assert_eq(it.g.sampling.seed, 99);
	cr_assert_eq(it.token, 12);
	wd_gdone(&t, &it, true);
	cr_assert_eq(wd_gtab_find(&t, 5)->n_tokens, 301);
	cr_assert_eq(wd_gtab_find(&t, 5)->draws, 2);
	wd_gtab_clear(&t);
}

/* Log-probabilities: a sampling row that asks gets them, top_logprobs cut at what a row result
 * holds (WD_LOGPROBS_MAX = 20); top_logprobs without logprobs, or logprobs on a row that does
 * not sample (a prefill chunk before the last), ask for nothing. Prefill and decode alike. */
Test(wd_plan, logprobs_are_asked_on_sampling_rows)
{
	struct wd_gtab t = { 0 };
	struct wd_gitem it;
	Bdfp4__PlanRow r;
	int32_t tok = 7;
	char msg[200];
	const struct {
		bool prefill, sample, logprobs;
		uint32_t top, want_top;
		bool want;
	} c[] = {
		{ true, true, true, 5, 5, true },    { true, true, true, 0, 0, true },
		{ true, true, true, 64, 20, true },  { true, true, false, 3, 0, false },
		{ true, false, true, 3, 0, false },  { false, true, true, 20, 20, true },
		{ false, true, true, 21, 20, true }, { false, true, false, 4, 0, false },
		{ false, false, true, 4, 0, false },
	};

	for (size_t i = 0; i < sizeof(c) / sizeof(c[0]); i++) {
		if (c[i].prefill) {
			prefill_row(&r, 3, 10, 1, NULL, 64);
		} else {
			prefilled(&t, 3, 10, 1, NULL, 64);
			decode_row(&r, 3, 10, &tok, 1, NULL, 0, NULL, 0);
		}
		r.sample = c[i].sample;
		r.logprobs = c[i].logprobs;
		r.top_logprobs = c[i].top;
		cr_assert_eq(wd_gmap(&t, &r, &LIM, &it, msg, sizeof(msg)), 0, "case %zu: %s", i,
			     msg);
		cr_assert_eq(it.logprobs, c[i].want, "case %zu", i);
		cr_assert_eq(it.top_logprobs, c[i].want_top, "case %zu", i);
		cr_assert_eq(it.sample, c[i].sample, "case %zu", i);
		wd_gdone(&t, &it, true);
		cr_assert_not_null(wd_gtab_find(&t, 3), "case %zu: the record stays", i);
		wd_gtab_clear(&t);
	}
}

/* Decoding through a page boundary: the token at position 383 completes page 2, so that row
 * must name one new page; the one after has it in its block table. */
Test(wd_plan, decode_promotes_at_the_page_boundary)
{
	struct wd_gtab t = { 0 };
	struct wd_gitem it;
	Bdfp4__PlanRow r;
	int32_t pages[3] = { 1, 2, 9 }, tok = 3;
	char msg[200];

	prefilled(&t, 1, 383, 0, pages, 1000);
	cr_assert_eq(wd_gtab_find(&t, 1)->n_pages, 2);

	/* no page named: refused, and the sequence is dropped */
	decode_row(&r, 1, 383, &tok, 0, pages, 2, NULL, 0);
	refused(&t, &r, &LIM, INV, "fills a page");
	cr_assert_null(wd_gtab_find(&t, 1));

	/* again, with the page */
	prefilled(&t, 1, 383, 0, pages, 1000);
	decode_row(&r, 1, 383, &tok, 0, pages, 2, &pages[2], 1);
	cr_assert_eq(wd_gmap(&t, &r, &LIM, &it, msg, sizeof(msg)), 0, "%s", msg);
	cr_assert_eq(it.g.n_new, 1);
	cr_assert_eq(it.g.new_pages[0], 9);
	wd_gdone(&t, &it, true);
	decode_row(&r, 1, 384, &tok, 0, pages, 3, NULL, 0);
	cr_assert_eq(wd_gmap(&t, &r, &LIM, &it, msg, sizeof(msg)), 0, "%s", msg);
	cr_assert_eq(it.g.n_pages, 3);
	/* a page named for position 384, which completes none */
	wd_gdone(&t, &it, true);
	decode_row(&r, 1, 385, &tok, 0, pages, 3, &pages[0], 1);
	refused(&t, &r, &LIM, INV, "fills none");
	wd_gtab_clear(&t);
}

/* --synthetic-prefill: n − 1 tokens filled, the last decoded at n − 1.
 *   n = 300: the fill (positions 0..298) completes pages 0 and 1 ((299 − 1 + 1) / 128 = 2);
 *            position 299 completes none.
 *   n = 256: the fill (0..254) completes page 0 only; position 255 completes page 1.
 *   n = 1:   nothing to fill; decode at position 0. */
Test(wd_plan, synthetic_prefill_splits_fill_and_last_token)
{
	struct wd_gtab t = { 0 };
	struct wd_gitem it;
	Bdfp4__PlanRow r;
	struct wd_glimits lim = LIM;
	int32_t pages[8] = { 10, 11, 12, 13, 14, 15, 16, 17 };
	char msg[200];

	lim.synthetic = true;
	prefill_row(&r, 1, 300, 0, pages, 400);
	cr_assert_eq(wd_gmap(&t, &r, &lim, &it, msg, sizeof(msg)), 0, "%s", msg);
	cr_assert_eq(it.kind, WD_G_FILL_DECODE);
	cr_assert_eq(it.n_fill, 299);
	cr_assert_eq(it.fill.n_new, 2);
	cr_assert_eq(it.fill.new_pages, pages);
	cr_assert_eq(it.fill.slot, 0);
	cr_assert_eq(it.g.position, 299);
	cr_assert_eq(it.g.n_pages, 2);
	cr_assert_eq(it.g.block_table, pages);
	cr_assert_eq(it.g.n_new, 0);
	cr_assert_eq(it.token, PROMPT[299]);
	wd_gdone(&t, &it, true);
	cr_assert_eq(wd_gtab_find(&t, 1)->n_tokens, 300);
	cr_assert_eq(wd_gtab_find(&t, 1)->n_pages, 2);

	prefill_row(&r, 2, 256, 1, pages + 2, 400);
	cr_assert_eq(wd_gmap(&t, &r, &lim, &it, msg, sizeof(msg)), 0, "%s", msg);
	cr_assert_eq(it.n_fill, 255);
	cr_assert_eq(it.fill.n_new, 1);
	cr_assert_eq(it.fill.new_pages[0], 12);
	cr_assert_eq(it.g.position, 255);
	cr_assert_eq(it.g.n_pages, 1);
	cr_assert_eq(it.g.block_table[0], 12);
	cr_assert_eq(it.g.n_new, 1);
	cr_assert_eq(it.g.new_pages[0], 13);
	wd_gdone(&t, &it, true);
	struct wd_greq *q = wd_gtab_find(&t, 2);
	cr_assert(q->n_tokens == 256 && q->n_pages == 2 && q->pages[0] == 12 &&
		  q->pages[1] == 13);

	prefill_row(&r, 3, 1, 2, NULL, 8);
	cr_assert_eq(wd_gmap(&t, &r, &lim, &it, msg, sizeof(msg)), 0, "%s", msg);
	cr_assert_eq(it.n_fill, 0);
	cr_assert_eq(it.g.position, 0);
	cr_assert_eq(it.g.n_pages, 0);
	cr_assert_eq(it.g.n_new, 0);

	/* a prompt beyond max_prefill is fine synthetic, refused real */
	struct wd_gitem it2;
	prefill_row(&r, 4, 600, 3, pages, 700);
	cr_assert_eq(wd_gmap(&t, &r, &lim, &it2, msg, sizeof(msg)), 0, "%s", msg);
	prefill_row(&r, 5, 600, 4, pages, 700);
	refused(&t, &r, &LIM, INV, "max_prefill");
	cr_assert_null(wd_gtab_find(&t, 5));
	wd_gtab_clear(&t);
}

/* One plan of three decode rows whose middle row's block table is not the pages its request
 * promoted: that row fails with INVALID_ARGUMENT (its record dropped), the others map. */
Test(wd_plan, inconsistent_row_fails_others_run)
{
	struct wd_gtab t = { 0 };
	struct wd_gitem it[3];
	Bdfp4__PlanRow r[3];
	int32_t pages[3][2] = { { 1, 2 }, { 3, 4 }, { 5, 6 } }, wrong[2] = { 4, 3 }, tok = 7;
	char msg[3][200];

	for (int i = 0; i < 3; i++)
		prefilled(&t, 10 + (uint64_t)i, 260, i, pages[i], 600);
	decode_row(&r[0], 10, 260, &tok, 0, pages[0], 2, NULL, 0);
	decode_row(&r[1], 11, 260, &tok, 1, wrong, 2, NULL, 0);
	decode_row(&r[2], 12, 260, &tok, 2, pages[2], 2, NULL, 0);
	int code[3];
	for (int i = 0; i < 3; i++)
		code[i] = wd_gmap(&t, &r[i], &LIM, &it[i], msg[i], 200);
	cr_assert_eq(code[0], 0, "%s", msg[0]);
	cr_assert_eq(code[1], INV);
	cr_assert_not_null(strstr(msg[1], "block table"), "%s", msg[1]);
	cr_assert_eq(code[2], 0, "%s", msg[2]);
	cr_assert_null(wd_gtab_find(&t, 11));
	cr_assert_eq(it[0].g.block_table, pages[0]);
	cr_assert_eq(it[2].g.slot, 2);
	wd_gdone(&t, &it[0], true);
	wd_gdone(&t, &it[2], true);
	cr_assert_eq(wd_gtab_find(&t, 10)->n_tokens, 261);
	cr_assert_eq(wd_gtab_find(&t, 12)->n_tokens, 261);
	cr_assert_eq(t.n, 2);
	wd_gtab_clear(&t);
}

/* A prefill chunk of request id over PROMPT (plan_row). */
static void chunk_row(Bdfp4__PlanRow *r, uint64_t id, int pos, int n, int32_t slot, int32_t *bt,
		      size_t n_bt, int32_t *newp, size_t n_new, bool sample)
{
	for (int i = 0; i < n; i++)
		PROMPT[i] = (i * 11 + 3) % 1000;
	plan_row(r, id, true, pos, PROMPT, n, slot, bt, n_bt, newp, n_new, sample);
}

/* A 600-token prompt in chunks of 256, 256, 88: the first at 0 makes the record (fills pages
 * 0, 1), the second at 256 reads them (block table of 2) and fills pages 2, 3, the last at 512
 * fills none (512 + 88 < 640) and samples; the record then holds 600 tokens, 4 pages, one
 * draw, and the decode at 600 maps on it. */
Test(wd_plan, chunks_continue_the_record)
{
	struct wd_gtab t = { 0 };
	struct wd_gitem it;
	Bdfp4__PlanRow r;
	int32_t pages[4] = { 7, 3, 9, 1 }, tok = 4;
	char msg[200];

	chunk_row(&r, 6, 0, 256, 2, NULL, 0, pages, 2, false);
	r.capacity = 640;
	cr_assert_eq(wd_gmap(&t, &r, &LIM, &it, msg, sizeof(msg)), 0, "%s", msg);
	cr_assert_eq(it.kind, WD_G_PREFILL);
	cr_assert_eq(it.g.position, 0);
	cr_assert_not(it.sample);
	wd_gdone(&t, &it, true);
	cr_assert_eq(wd_gtab_find(&t, 6)->n_tokens, 256);
	cr_assert_eq(wd_gtab_find(&t, 6)->draws, 0, "a chunk that samples nothing draws nothing");

	chunk_row(&r, 6, 256, 256, 2, pages, 2, pages + 2, 2, false);
	cr_assert_eq(wd_gmap(&t, &r, &LIM, &it, msg, sizeof(msg)), 0, "%s", msg);
	expect_prefill(&it, 256, 2, 256, pages, 2, pages + 2, 2);
	cr_assert(wd_gtab_find(&t, 6)->busy);
	wd_gdone(&t, &it, true);
	struct wd_greq *q = wd_gtab_find(&t, 6);
	cr_assert(q->n_tokens == 512 && q->n_pages == 4 && q->pages[2] == 9 && q->pages[3] == 1);

	chunk_row(&r, 6, 512, 88, 2, pages, 4, NULL, 0, true);
	cr_assert_eq(wd_gmap(&t, &r, &LIM, &it, msg, sizeof(msg)), 0, "%s", msg);
	cr_assert_eq(it.g.position, 512);
	cr_assert_eq(it.g.n_new, 0);
	cr_assert_eq(it.g.rng_step, 0);
	cr_assert(it.sample);
	wd_gdone(&t, &it, true);
	cr_assert_eq(wd_gtab_find(&t, 6)->n_tokens, 600);
	cr_assert_eq(wd_gtab_find(&t, 6)->draws, 1);

	decode_row(&r, 6, 600, &tok, 2, pages, 4, NULL, 0);
	cr_assert_eq(wd_gmap(&t, &r, &LIM, &it, msg, sizeof(msg)), 0, "%s", msg);
	cr_assert_eq(it.g.rng_step, 1);
	wd_gtab_clear(&t);
}

/* Chunks that do not continue their record, each refused (its record dropped): off a page
 * boundary, at another position than the tokens held, another block table, the wrong count of
 * new pages, past the capacity, longer than max_prefill, on a synthetic-prefill worker. */
Test(wd_plan, chunks_that_lie_are_refused_and_drop_the_record)
{
	struct wd_gtab t = { 0 };
	struct wd_glimits syn = LIM;
	Bdfp4__PlanRow r;
	int32_t pages[8] = { 1, 2, 3, 4, 5, 6, 7, 8 }, wrong[1] = { 9 };
	struct {
		int held, pos, n, n_bt, n_new;
		int32_t *bt;
		const struct wd_glimits *lim;
		const char *why;
	} c[] = {
		{ 300, 300, 10, 2, 0, pages, &LIM, "starts on a page" },
		{ 256, 128, 10, 1, 0, pages, &LIM, "count of tokens held" },
		{ 128, 128, 10, 1, 0, wrong, &LIM, "block table" },
		{ 128, 128, 256, 1, 1, pages, &LIM, "new pages" },
		{ 128, 128, 400, 1, 3, pages, &LIM, "capacity" },
		{ 128, 128, 513, 1, 4, pages, &LIM, "max_prefill" },
		{ 128, 128, 10, 1, 0, pages, &syn, "whole prompts" },
	};
	syn.synthetic = true;
	for (size_t i = 0; i < sizeof(c) / sizeof(c[0]); i++) {
		prefilled(&t, 8, c[i].held, 1, pages, 512);
		chunk_row(&r, 8, c[i].pos, c[i].n, 1, c[i].bt, (size_t)c[i].n_bt, pages + 4,
			  (size_t)c[i].n_new, true);
		refused(&t, &r, c[i].lim, INV, c[i].why);
		cr_assert_null(wd_gtab_find(&t, 8), "%s: the record stays", c[i].why);
	}
	wd_gtab_clear(&t);
}

/* A restarted worker holds nothing: a decode row with resume (position 300, pages 5 and 6,
 * draws 7) rebuilds the record and maps on it with rng_step 7 and the row's sampler; a chunk
 * row with resume maps as a chunk; a resume replaces a stale record of the request. Bad resume
 * rows (block table of another length than position/128, a page outside the pool, a slot
 * another request holds) are refused and make no record. */
Test(wd_plan, resume_rows_rebuild_the_record)
{
	struct wd_gtab t = { 0 };
	struct wd_gitem it;
	Bdfp4__PlanRow r;
	Bdfp4__SamplingParams sp = BDFP4__SAMPLING_PARAMS__INIT;
	int32_t bt[3] = { 5, 6, 11 }, far[2] = { 5, 100 }, tok = 8;
	char msg[200];

	sp.temperature = 0.5f;
	sp.seed = 42;
	decode_row(&r, 3, 300, &tok, 4, bt, 2, NULL, 0);
	r.resume = true;
	r.draws = 7;
	r.capacity = 400;
	r.sampling = &sp;
	cr_assert_eq(wd_gmap(&t, &r, &LIM, &it, msg, sizeof(msg)), 0, "%s", msg);
	cr_assert_eq(it.kind, WD_G_DECODE);
	cr_assert_eq(it.g.slot, 4);
	cr_assert_eq(it.g.position, 300);
	cr_assert_eq(it.g.n_pages, 2);
	cr_assert_eq(it.g.rng_step, 7);
	cr_assert_eq(it.g.sampling.seed, 42);
	cr_assert_float_eq(it.g.sampling.temperature, 0.5f, 0);
	wd_gdone(&t, &it, true);
	struct wd_greq *q = wd_gtab_find(&t, 3);
	cr_assert(q && q->n_tokens == 301 && q->draws == 8 && q->capacity == 400 &&
		  q->n_pages == 2 && q->pages[1] == 6);

	/* a stale record of request 3 (a different slot) is replaced by the resume */
	chunk_row(&r, 3, 256, 100, 5, bt, 2, NULL, 0, true);
	r.resume = true;
	r.capacity = 400;
	cr_assert_eq(wd_gmap(&t, &r, &LIM, &it, msg, sizeof(msg)), 0, "%s", msg);
	cr_assert_eq(it.kind, WD_G_PREFILL);
	cr_assert_eq(it.g.position, 256);
	cr_assert_eq(it.g.slot, 5);
	cr_assert_eq(it.g.n_pages, 2);
	wd_gdone(&t, &it, true);
	cr_assert_eq(wd_gtab_find(&t, 3)->n_tokens, 356);
	cr_assert_eq(t.n, 1);

	struct {
		int32_t slot, *bt;
		size_t n_bt;
		uint32_t capacity;
		const char *why;
	} bad[] = {
		{ 6, bt, 3, 400, "cannot resume" },
		{ 6, far, 2, 400, "outside the pool" },
		{ 5, bt, 2, 400, "held by request 3" },
		{ 6, bt, 2, 200, "capacity" },
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		decode_row(&r, 4, 300, &tok, bad[i].slot, bad[i].bt, bad[i].n_bt, NULL, 0);
		r.resume = true;
		r.capacity = bad[i].capacity;
		refused(&t, &r, &LIM, INV, bad[i].why);
	}
	cr_assert_null(wd_gtab_find(&t, 4));
	cr_assert_eq(t.n, 1);
	wd_gtab_clear(&t);
}

struct bad_row {
	Bdfp4__PlanRow r;
	int want;          /* the code it is refused with */
	const char *what;  /* how it lies */
};

/* The next bad row, b[(*n)++]: a prefill of request 2 (n_tok tokens into slot, the pages
 * named, capacity) refused with want because of what. Returns its row, for a lie
 * prefill_row does not make. */
static Bdfp4__PlanRow *bad_prefill(struct bad_row *b, int *n, int n_tok, int32_t slot,
				   int32_t *pages, uint32_t capacity, int want, const char *what)
{
	struct bad_row *x = &b[(*n)++];

	prefill_row(&x->r, 2, n_tok, slot, pages, capacity);
	x->want = want;
	x->what = what;
	return &x->r;
}

/* Every way a row can lie: each refused with its code, and the records of other requests are
 * left as they were (a refused prefill creates nothing). */
Test(wd_plan, bad_rows_are_refused)
{
	struct wd_gtab t = { 0 };
	struct wd_gitem it;
	Bdfp4__PlanRow r;
	int32_t pages[4] = { 1, 2, 3, 4 }, far = 100, tok = 5, big = 1000;
	char msg[200];

	prefilled(&t, 1, 10, 2, NULL, 64);

	struct bad_row bad[16];
	Bdfp4__SamplingParams sp = BDFP4__SAMPLING_PARAMS__INIT;
	int n = 0;
	sp.top_p = 1.5f;
	bad_prefill(bad, &n, 10, 3, NULL, 64, BDFP4__SERVE_ERROR__SERVE_ERR_UNKNOWN_KV_CONFIG,
		    "another KV configuration than the pool's")->kv_config = (char *)"bf16";
	bad_prefill(bad, &n, 10, 2, NULL, 64, INV, "a slot request 1 holds");
	bad_prefill(bad, &n, 10, 8, NULL, 64, INV, "a slot outside the pool");
	bad_prefill(bad, &n, 10, 3, NULL, 5000, INV, "capacity above max_tokens");
	bad_prefill(bad, &n, 10, 3, NULL, 9, INV, "capacity below the prompt");
	bad_prefill(bad, &n, 256, 3, pages, 300, INV,
		    "one page named for a prompt that fills two")->n_new_pages = 1;
	bad_prefill(bad, &n, 128, 3, &far, 300, INV, "a page outside the pool");
	bad_prefill(bad, &n, 1, 3, NULL, 8, INV, "a token = the vocabulary size")->tokens = &big;
	bad_prefill(bad, &n, 10, 3, NULL, 64, INV, "top_p above 1")->sampling = &sp;
	bad_prefill(bad, &n, 10, 3, NULL, 64, INV,
		    "a chunk at position 4 of a request this rank does not hold")->position = 4;
	decode_row(&bad[n].r, 77, 0, &tok, 3, NULL, 0, NULL, 0);
	bad[n].want = INV;
	bad[n++].what = "a decode of an unknown request";

	for (int i = 0; i < n; i++) {
		int code = wd_gmap(&t, &bad[i].r, &LIM, &it, msg, sizeof(msg));
		cr_assert_eq(code, bad[i].want, "%s: got %d (%s)", bad[i].what, code, msg);
		cr_assert_gt(strlen(msg), 0, "%s: no message", bad[i].what);
		cr_assert_null(wd_gtab_find(&t, 2), "%s: a record was made", bad[i].what);
		cr_assert_eq(t.n, 1, "%s", bad[i].what);
		struct wd_greq *q = wd_gtab_find(&t, 1);
		cr_assert(q && q->n_tokens == 10 && q->slot == 2 && !q->busy, "%s", bad[i].what);
	}

	/* decodes of request 1 that lie: wrong position, wrong slot; each drops it */
	decode_row(&r, 1, 11, &tok, 2, NULL, 0, NULL, 0);
	refused(&t, &r, &LIM, INV, "position");
	cr_assert_null(wd_gtab_find(&t, 1));
	prefilled(&t, 1, 10, 2, NULL, 64);
	decode_row(&r, 1, 10, &tok, 5, NULL, 0, NULL, 0);
	refused(&t, &r, &LIM, INV, "slot");
	cr_assert_null(wd_gtab_find(&t, 1));
	prefilled(&t, 1, 10, 2, NULL, 64);

	/* one request twice in a plan: the second row is refused */
	prefill_row(&r, 1, 10, 2, NULL, 64);
	cr_assert_eq(wd_gmap(&t, &r, &LIM, &it, msg, sizeof(msg)), 0);
	refused(&t, &r, &LIM, INV, "twice");
	wd_gdone(&t, &it, false); /* the first failed on the device: dropped */
	cr_assert_null(wd_gtab_find(&t, 1));

	/* a release of an unknown id is ignored */
	wd_gtab_drop(&t, 12345);
	cr_assert_eq(t.n, 0);
	wd_gtab_clear(&t);
}

/* What the cuda backend zeroes before a step: a prefill's slot and its new pages; a decode row's
 * reserved page only, never its slot (it holds the sequence) nor its block table (shared or
 * already written). */
Test(wd_plan, scrub_takes_new_pages_and_a_new_sequence_slot)
{
	struct wd_gtab t = { 0 };
	struct wd_gitem it;
	Bdfp4__PlanRow r;
	int32_t pages[3] = { 4, 7, 11 }, tok = 3, slot;
	const int32_t *sp;
	size_t n;
	char msg[200];

	prefill_row(&r, 5, 300, 2, pages, 1000);
	cr_assert_eq(wd_gmap(&t, &r, &LIM, &it, msg, sizeof(msg)), 0, "%s", msg);
	wd_gscrub(&r, &it, &sp, &n, &slot);
	cr_expect_eq(slot, 2);
	cr_assert_eq(n, 2);
	cr_expect(sp[0] == 4 && sp[1] == 7);
	wd_gdone(&t, &it, true);
	/* positions 300..382 complete nothing; 383 completes page 2 */
	decode_row(&r, 5, 300, &tok, 2, pages, 2, NULL, 0);
	cr_assert_eq(wd_gmap(&t, &r, &LIM, &it, msg, sizeof(msg)), 0, "%s", msg);
	wd_gscrub(&r, &it, &sp, &n, &slot);
	cr_expect_eq(slot, -1, "a decode row's slot is the sequence's");
	cr_expect_eq(n, 0);
	wd_gdone(&t, &it, true);
	for (int p = 301; p < 383; p++) {
		decode_row(&r, 5, p, &tok, 2, pages, 2, NULL, 0);
		cr_assert_eq(wd_gmap(&t, &r, &LIM, &it, msg, sizeof(msg)), 0, "%d: %s", p, msg);
		wd_gdone(&t, &it, true);
	}
	decode_row(&r, 5, 383, &tok, 2, pages, 2, &pages[2], 1);
	cr_assert_eq(wd_gmap(&t, &r, &LIM, &it, msg, sizeof(msg)), 0, "%s", msg);
	wd_gscrub(&r, &it, &sp, &n, &slot);
	cr_expect_eq(slot, -1);
	cr_assert_eq(n, 1);
	cr_expect_eq(sp[0], 11, "the reserved page, not the block table's 4 and 7");
	wd_gdone(&t, &it, true);
	wd_gtab_clear(&t);
}

/* r as a prefix hit's resume row: prefix_pages shared pages lead its block table, the sink is
 * rebuilt from the context ctx[n_context]; capacity 1000. */
static void as_hit(Bdfp4__PlanRow *r, uint32_t prefix_pages, size_t n_context, int32_t *ctx)
{
	r->resume = true;
	r->capacity = 1000;
	r->prefix_pages = prefix_pages;
	r->n_context = n_context;
	r->context = ctx;
}

/* A prefix hit's first chunk: a resume row over 4 shared pages at 512, with the context's
 * tokens; it maps to the chunk with its first 16 tokens to rebuild the sink, zeroes its new
 * slot and its own new page, never the shared pages; a hit with more shared pages than its
 * block table, or with no context, is refused and leaves no record. */
Test(wd_plan, prefix_hit_rebuilds_the_sink_in_its_new_slot)
{
	struct wd_gtab t = { 0 };
	struct wd_gitem it;
	Bdfp4__PlanRow r;
	int32_t shared[4] = { 7, 3, 9, 1 }, fresh = 12, slot;
	int32_t ctx[600];
	const int32_t *sp;
	size_t n;
	char msg[200];

	for (int i = 0; i < 600; i++)
		ctx[i] = (i * 7 + 1) % 1000;
	chunk_row(&r, 9, 512, 128, 6, shared, 4, &fresh, 1, true);
	as_hit(&r, 4, 512, ctx);
	cr_assert_eq(wd_gmap(&t, &r, &LIM, &it, msg, sizeof(msg)), 0, "%s", msg);
	cr_assert_eq(it.kind, WD_G_PREFILL);
	cr_expect_eq(it.g.position, 512);
	cr_expect_eq(it.g.n_pages, 4);
	cr_expect_eq(it.n_sink, 16);
	cr_expect(it.sink_tokens == ctx, "the sink is rebuilt from the context's first tokens");
	wd_gscrub(&r, &it, &sp, &n, &slot);
	cr_expect_eq(slot, 6, "a hit's slot is new: zeroed");
	cr_assert_eq(n, 1);
	cr_expect_eq(sp[0], 12, "only the chunk's own page, not the shared 7 3 9 1");
	wd_gdone(&t, &it, true);
	struct wd_greq *q = wd_gtab_find(&t, 9);
	cr_assert(q && q->n_tokens == 640 && q->n_pages == 5 && q->pages[0] == 7 &&
		  q->pages[4] == 12);
	wd_gtab_clear(&t);

	/* a 10-token context rebuilds a 10-token sink */
	chunk_row(&r, 9, 512, 128, 6, shared, 4, &fresh, 1, true);
	as_hit(&r, 4, 10, ctx);
	cr_assert_eq(wd_gmap(&t, &r, &LIM, &it, msg, sizeof(msg)), 0, "%s", msg);
	cr_expect_eq(it.n_sink, 10);
	wd_gdone(&t, &it, true);
	wd_gtab_clear(&t);

	struct {
		uint32_t prefix_pages;
		size_t n_context;
		const char *why;
	} bad[] = { { 5, 512, "more shared pages than the block table" },
		    { 4, 0, "no context to rebuild the sink from" } };
	for (size_t b = 0; b < sizeof(bad) / sizeof(bad[0]); b++) {
		chunk_row(&r, 9, 512, 128, 6, shared, 4, &fresh, 1, true);
		as_hit(&r, bad[b].prefix_pages, bad[b].n_context, bad[b].n_context ? ctx : NULL);
		cr_expect_eq(wd_gmap(&t, &r, &LIM, &it, msg, sizeof(msg)),
			     BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT, "%s", bad[b].why);
		cr_expect(strstr(msg, "prefix hit"), "%s: %s", bad[b].why, msg);
		cr_expect_null(wd_gtab_find(&t, 9), "%s: no record left", bad[b].why);
	}
	/* a decode row never carries a hit */
	decode_row(&r, 9, 512, ctx, 6, shared, 4, NULL, 0);
	as_hit(&r, 4, 512, ctx);
	cr_expect_eq(wd_gmap(&t, &r, &LIM, &it, msg, sizeof(msg)),
		     BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT);
	wd_gtab_clear(&t);
}

/* A prompt's later chunk keeps its slot (the sink and recent rows of the first chunk) and
 * zeroes only the pages it fills; so does a resume row, whose slot is the interrupted
 * request's. */
Test(wd_plan, scrub_keeps_the_slot_of_a_later_chunk_and_a_resume)
{
	struct wd_gtab t = { 0 };
	struct wd_gitem it;
	Bdfp4__PlanRow r;
	int32_t pages[4] = { 7, 3, 9, 1 }, slot;
	const int32_t *sp;
	size_t n;
	char msg[200];

	chunk_row(&r, 8, 0, 256, 5, NULL, 0, pages, 2, false);
	r.capacity = 1000;
	cr_assert_eq(wd_gmap(&t, &r, &LIM, &it, msg, sizeof(msg)), 0, "%s", msg);
	wd_gscrub(&r, &it, &sp, &n, &slot);
	cr_expect_eq(slot, 5, "the first chunk starts the sequence in a new slot");
	cr_expect_eq(n, 2);
	wd_gdone(&t, &it, true);
	chunk_row(&r, 8, 256, 256, 5, pages, 2, &pages[2], 2, false);
	cr_assert_eq(wd_gmap(&t, &r, &LIM, &it, msg, sizeof(msg)), 0, "%s", msg);
	wd_gscrub(&r, &it, &sp, &n, &slot);
	cr_expect_eq(slot, -1, "a later chunk's slot holds the first chunk's sink");
	cr_assert_eq(n, 2);
	cr_expect(sp[0] == 9 && sp[1] == 1, "the chunk's own pages, not the block table's");
	wd_gdone(&t, &it, true);
	wd_gtab_clear(&t);

	/* the same second chunk on a fresh worker, as the first row of a new group */
	chunk_row(&r, 8, 256, 256, 5, pages, 2, &pages[2], 2, false);
	r.resume = true;
	r.capacity = 1000;
	cr_assert_eq(wd_gmap(&t, &r, &LIM, &it, msg, sizeof(msg)), 0, "%s", msg);
	wd_gscrub(&r, &it, &sp, &n, &slot);
	cr_expect_eq(slot, -1, "a resumed request's slot holds its sink");
	cr_expect_eq(n, 2);
	wd_gdone(&t, &it, true);
	wd_gtab_clear(&t);
}
