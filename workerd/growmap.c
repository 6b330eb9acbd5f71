/* growmap.c — PlanRow → bd_grow for workerd's CUDA backend, and the per-request records
 * (growmap.h). Pure host code.
 */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/bd_err.h"
#include "growmap.h"
#include "workerd.h"

/* What rank 0 hands back of a row that samples: the top logits and the log-probabilities the
 * row asks for, cut at what a row result holds (WD_TOP_MAX, WD_LOGPROBS_MAX); top_logprobs
 * without logprobs asks for nothing, as on the cpu backend. */
static void set_outputs(struct wd_gitem *it, const Bdfp4__PlanRow *row)
{
	it->sample = row->sample;
	it->top_k = row->logits_top_k < WD_TOP_MAX ? row->logits_top_k : WD_TOP_MAX;
	it->logprobs = row->sample && row->logprobs;
	it->top_logprobs = !it->logprobs ? 0
			   : row->top_logprobs < WD_LOGPROBS_MAX ? row->top_logprobs
								 : WD_LOGPROBS_MAX;
}

void wd_gtab_clear(struct wd_gtab *t)
{
	for (size_t i = 0; i < t->n; i++)
		free(t->r[i].pages);
	free(t->r);
	memset(t, 0, sizeof(*t));
}

struct wd_greq *wd_gtab_find(struct wd_gtab *t, uint64_t id)
{
	for (size_t i = 0; i < t->n; i++)
		if (t->r[i].id == id)
			return &t->r[i];
	return NULL;
}

void wd_gtab_drop(struct wd_gtab *t, uint64_t id)
{
	struct wd_greq *q = wd_gtab_find(t, id);
	if (!q)
		return;
	free(q->pages);
	*q = t->r[--t->n];
}

/* Page ids p[n] all inside the pool; the first bad one in *bad. */
static bool pages_ok(const int32_t *p, size_t n, size_t n_pages, int32_t *bad)
{
	for (size_t i = 0; i < n; i++)
		if (p[i] < 0 || (size_t)p[i] >= n_pages) {
			*bad = p[i];
			return false;
		}
	return true;
}

/* The row's sampler (serve.proto SamplingParams; none: greedy). Returns 0 or a ServeError. */
static int row_sampler(const Bdfp4__PlanRow *row, struct bd_sampler_params *ret, char *msg,
		       size_t cap)
{
	struct bd_sampler_params sp = bd_sampler_params_greedy();
	if (row->sampling) {
		const Bdfp4__SamplingParams *s = row->sampling;
		sp.temperature = s->temperature;
		sp.top_k = s->top_k > INT_MAX ? -1 : (int)s->top_k;
		sp.top_p = s->top_p > 0.0f ? s->top_p : 1.0f;
		sp.seed = s->seed;
	}
	if (!isfinite(sp.temperature) || sp.temperature < 0 || sp.top_k < 0 ||
	    !(sp.top_p > 0.0f && sp.top_p <= 1.0f))
		return bd_errf(msg, cap, BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT,
			       "bad sampling parameters");
	*ret = sp;
	return 0;
}

/* A new record for the request of row (a prefill at position 0, or a row that resumes it)
 * after the checks every rank makes: configuration, capacity for position + n_tokens, slot
 * inside the pool and held by no other request, sampler. Whatever the table held of the request
 * is dropped first (a preempted request starts over; a resumed one is rebuilt). The record
 * holds no tokens and no pages yet and is not busy. Returns 0 or a ServeError. */
static int new_record(struct wd_gtab *t, const Bdfp4__PlanRow *row, const struct wd_glimits *lim,
		      struct wd_greq **ret, char *msg, size_t cap)
{
	const int inv = BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
	int64_t need = (int64_t)row->position + (int64_t)row->n_tokens;
	struct bd_sampler_params sp;
	int code;

	if (row->kv_config && *row->kv_config && strcmp(row->kv_config, lim->kv_config))
		return bd_errf(msg, cap, BDFP4__SERVE_ERROR__SERVE_ERR_UNKNOWN_KV_CONFIG,
			    "KV configuration '%.40s': the cuda backend runs the pool's '%s' only",
			    row->kv_config, lim->kv_config);
	if ((int64_t)row->capacity < need || row->capacity > (uint32_t)lim->max_tokens)
		return bd_errf(msg, cap, inv, "capacity %u for %lld tokens (the model holds %d "
			    "tokens)", row->capacity, (long long)need, lim->max_tokens);
	if (row->slot < 0 || (size_t)row->slot >= lim->n_slots)
		return bd_errf(msg, cap, inv, "slot %d is outside the pool (%zu slots)", row->slot,
			    lim->n_slots);
	if ((code = row_sampler(row, &sp, msg, cap)) != 0)
		return code;
	struct wd_greq *old = wd_gtab_find(t, row->request_id);
	if (old && old->busy)
		return bd_errf(msg, cap, inv, "request %llu appears twice in the plan",
			    (unsigned long long)row->request_id);
	wd_gtab_drop(t, row->request_id);
	for (size_t i = 0; i < t->n; i++)
		if (t->r[i].slot == row->slot)
			return bd_errf(msg, cap, inv, "slot %d is held by request %llu", row->slot,
				    (unsigned long long)t->r[i].id);

	if (t->n == t->cap) {
		size_t nc = t->cap ? 2 * t->cap : 16;
		struct wd_greq *nr = realloc(t->r, nc * sizeof(*nr));
		if (!nr)
			return bd_errf(msg, cap, BDFP4__SERVE_ERROR__SERVE_ERR_RESOURCE_EXHAUSTED,
				    "out of memory");
		t->r = nr;
		t->cap = nc;
	}
	struct wd_greq *q = &t->r[t->n];
	memset(q, 0, sizeof(*q));
	q->pages = malloc(sizeof(int32_t) * ((size_t)row->capacity / BD_PAGE_TOKENS + 1));
	if (!q->pages)
		return bd_errf(msg, cap, BDFP4__SERVE_ERROR__SERVE_ERR_RESOURCE_EXHAUSTED,
			    "out of memory");
	t->n++;
	q->id = row->request_id;
	q->slot = row->slot;
	q->capacity = (int)row->capacity;
	q->sp = sp;
	*ret = q;
	return 0;
}

/* A row with resume set: the record rebuilt from the row over the KV the pool kept (slot,
 * position tokens, block table = their position/128 promoted pages, draws). The row itself is
 * then checked against it as any row continuing a request. Returns 0 or a ServeError. */
static int resume_record(struct wd_gtab *t, const Bdfp4__PlanRow *row,
			 const struct wd_glimits *lim, char *msg, size_t cap)
{
	const int inv = BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
	struct wd_greq *q;
	int32_t bad;
	int code;

	struct wd_greq *old = wd_gtab_find(t, row->request_id);
	if (old && old->busy)
		return bd_errf(msg, cap, inv, "request %llu appears twice in the plan",
			    (unsigned long long)row->request_id);
	wd_gtab_drop(t, row->request_id); /* whatever this rank held of it is not trusted */
	if (row->position < 0 || row->n_block_table != (size_t)(row->position / BD_PAGE_TOKENS))
		return bd_errf(msg, cap, inv, "cannot resume request %llu at position %d with %zu "
			    "pages (want %d)", (unsigned long long)row->request_id, row->position,
			    row->n_block_table, row->position < 0 ? 0 : row->position / BD_PAGE_TOKENS);
	if (!pages_ok(row->block_table, row->n_block_table, lim->n_pages, &bad))
		return bd_errf(msg, cap, inv, "cannot resume request %llu: page %d is outside the "
			    "pool (%zu pages)", (unsigned long long)row->request_id, bad,
			    lim->n_pages);
	if ((code = new_record(t, row, lim, &q, msg, cap)) != 0)
		return code;
	q->n_tokens = row->position;
	q->n_pages = (int)row->n_block_table;
	if (q->n_pages)
		memcpy(q->pages, row->block_table, sizeof(int32_t) * (size_t)q->n_pages);
	q->draws = row->draws;
	return 0;
}

static int map_prefill(struct wd_gtab *t, const Bdfp4__PlanRow *row,
		       const struct wd_glimits *lim, struct wd_gitem *it, char *msg, size_t cap)
{
	const int inv = BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
	int n = (int)row->n_tokens;
	struct wd_greq *q;
	int32_t bad;
	int code;

	if (row->n_tokens < 1 || row->n_tokens > INT_MAX / 2)
		return bd_errf(msg, cap, inv, "prefill of %zu tokens at position %d", row->n_tokens,
			    row->position);
	if (!lim->synthetic && n > lim->max_prefill)
		return bd_errf(msg, cap, inv, "a %d-token prompt; one prefill takes at most %d "
			    "(max_prefill)", n, lim->max_prefill);
	if (row->n_new_pages != (size_t)(n / BD_PAGE_TOKENS) || row->n_block_table != 0)
		return bd_errf(msg, cap, inv, "a %d-token prompt fills %d pages; the plan names %zu "
			    "(and %zu promoted)", n, n / BD_PAGE_TOKENS, row->n_new_pages,
			    row->n_block_table);
	if (!pages_ok(row->new_pages, row->n_new_pages, lim->n_pages, &bad))
		return bd_errf(msg, cap, inv, "page %d is outside the pool (%zu pages)", bad,
			    lim->n_pages);
	for (int i = 0; i < n; i++)
		if (row->tokens[i] < 0 || row->tokens[i] >= lim->n_vocab)
			return bd_errf(msg, cap, inv, "token %d at %d is outside the vocabulary (%d)",
				    row->tokens[i], i, lim->n_vocab);
	if ((code = new_record(t, row, lim, &q, msg, cap)) != 0)
		return code;
	q->busy = true;

	struct bd_sampler_params sp = q->sp;
	it->id = row->request_id;
	set_outputs(it, row);
	it->g = (struct bd_grow){ .slot = row->slot, .position = 0, .sampling = sp };
	if (!lim->synthetic) {
		it->kind = WD_G_PREFILL;
		it->tokens = row->tokens;
		it->n_tokens = n;
		it->g.new_pages = row->new_pages;
		it->g.n_new = (int)row->n_new_pages;
		return 0;
	}
	/* positions 0..n−2 synthetic, the last prompt token decoded: the fill completes the
	 * first (n−1)/128 pages, the decode the last one when n is a multiple of 128 */
	int k = (n - 1) / BD_PAGE_TOKENS;
	it->kind = WD_G_FILL_DECODE;
	it->n_fill = n - 1;
	it->fill = (struct bd_grow){ .slot = row->slot, .position = 0, .new_pages = row->new_pages,
				     .n_new = k, .sampling = sp };
	it->g.position = n - 1;
	it->g.block_table = row->new_pages;
	it->g.n_pages = k;
	it->g.new_pages = row->new_pages + k;
	it->g.n_new = (int)row->n_new_pages - k;
	it->token = row->tokens[n - 1];
	return 0;
}

/* The record of the request row continues, not yet in this plan: 0 with *ret, or a ServeError. */
static int held_record(struct wd_gtab *t, const Bdfp4__PlanRow *row, struct wd_greq **ret,
		       char *msg, size_t cap)
{
	const int inv = BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
	struct wd_greq *q = wd_gtab_find(t, row->request_id);

	if (!q)
		return bd_errf(msg, cap, inv, "no sequence for request %llu on this worker",
			    (unsigned long long)row->request_id);
	if (q->busy)
		return bd_errf(msg, cap, inv, "request %llu appears twice in the plan",
			    (unsigned long long)row->request_id);
	*ret = q;
	return 0;
}

/* Why row, which continues the request of record q, names another slot or block table than q's
 * (NULL: it names q's). */
static const char *continuation_mismatch(const struct wd_greq *q, const Bdfp4__PlanRow *row)
{
	if (row->slot != q->slot)
		return "slot differs from the prefill's";
	if (row->n_block_table != (size_t)q->n_pages ||
	    (q->n_pages && memcmp(row->block_table, q->pages, sizeof(int32_t) * (size_t)q->n_pages)))
		return "block table differs from the pages promoted";
	return NULL;
}

/* A prefill chunk at position p > 0 continuing the request's record (its tokens so far, its
 * slot and pages). A row that does not fit drops the record, as a decode row does. */
static int map_chunk(struct wd_gtab *t, const Bdfp4__PlanRow *row, const struct wd_glimits *lim,
		     struct wd_gitem *it, char *msg, size_t cap)
{
	const int inv = BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
	struct wd_greq *q = NULL;
	const char *bad = NULL;
	int32_t badp;
	int code;
	int64_t p = row->position, n = (int64_t)row->n_tokens;

	if ((code = held_record(t, row, &q, msg, cap)) != 0)
		return code;
	if (lim->synthetic)
		bad = "a synthetic-prefill worker prefills whole prompts only";
	else if (n < 1 || p % BD_PAGE_TOKENS)
		bad = "a prefill chunk starts on a page and feeds a token at least";
	else if (n > lim->max_prefill)
		bad = "the chunk is longer than one prefill takes (max_prefill)";
	else if (p != q->n_tokens)
		bad = "position is not the count of tokens held";
	else if (p + n > q->capacity)
		bad = "the chunk runs past the sequence's capacity";
	else if ((bad = continuation_mismatch(q, row)) != NULL)
		;
	else if (row->n_new_pages != (size_t)(n / BD_PAGE_TOKENS))
		bad = "the new pages are not the pages the chunk fills";
	else if (!pages_ok(row->new_pages, row->n_new_pages, lim->n_pages, &badp))
		bad = "a new page is outside the pool";
	for (int64_t i = 0; !bad && i < n; i++)
		if (row->tokens[i] < 0 || row->tokens[i] >= lim->n_vocab)
			bad = "a token is outside the vocabulary";
	if (bad) {
		int held = q->n_tokens, np = q->n_pages;
		wd_gtab_drop(t, row->request_id);
		return bd_errf(msg, cap, inv, "request %llu, chunk of %zu at position %d (holds %d "
			    "tokens, %d pages): %s", (unsigned long long)row->request_id,
			    row->n_tokens, row->position, held, np, bad);
	}
	q->busy = true;
	it->kind = WD_G_PREFILL;
	it->id = row->request_id;
	set_outputs(it, row);
	it->tokens = row->tokens;
	it->n_tokens = (int)n;
	it->g = (struct bd_grow){ .slot = q->slot, .position = row->position,
				  .block_table = row->block_table, .n_pages = q->n_pages,
				  .new_pages = row->new_pages, .n_new = (int)row->n_new_pages,
				  .sampling = q->sp, .rng_step = q->draws };
	return 0;
}

static int map_decode(struct wd_gtab *t, const Bdfp4__PlanRow *row,
		      const struct wd_glimits *lim, struct wd_gitem *it, char *msg, size_t cap)
{
	const int inv = BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
	struct wd_greq *q = NULL;
	const char *bad = NULL;
	int32_t badp;
	int code;

	if ((code = held_record(t, row, &q, msg, cap)) != 0)
		return code;
	bool fills = (row->position + 1) % BD_PAGE_TOKENS == 0;
	if (row->n_tokens != 1)
		bad = "a decode row feeds one token";
	else if (row->position != q->n_tokens)
		bad = "position is not the count of tokens held";
	else if (row->position >= q->capacity)
		bad = "the sequence is at its capacity";
	else if ((bad = continuation_mismatch(q, row)) != NULL)
		;
	else if (row->n_new_pages != (fills ? 1u : 0u))
		bad = fills ? "this token fills a page and no page was named"
			    : "a page was named for a token that fills none";
	else if (!pages_ok(row->new_pages, row->n_new_pages, lim->n_pages, &badp))
		bad = "the new page is outside the pool";
	else if (row->tokens[0] < 0 || row->tokens[0] >= lim->n_vocab)
		bad = "the token is outside the vocabulary";
	if (bad) {
		int held = q->n_tokens, np = q->n_pages;
		wd_gtab_drop(t, row->request_id);
		return bd_errf(msg, cap, inv, "request %llu at position %d (holds %d tokens, %d pages): "
			    "%s", (unsigned long long)row->request_id, row->position, held, np, bad);
	}
	q->busy = true;
	it->kind = WD_G_DECODE;
	it->id = row->request_id;
	set_outputs(it, row);
	it->token = row->tokens[0];
	it->g = (struct bd_grow){ .slot = q->slot, .position = row->position,
				  .block_table = row->block_table, .n_pages = q->n_pages,
				  .new_pages = row->new_pages, .n_new = (int)row->n_new_pages,
				  .sampling = q->sp, .rng_step = q->draws };
	return 0;
}

int wd_gmap(struct wd_gtab *t, const Bdfp4__PlanRow *row, const struct wd_glimits *lim,
	    struct wd_gitem *it, char *msg, size_t cap)
{
	memset(it, 0, sizeof(*it));
	if (msg && cap)
		msg[0] = 0;
	if (row->prefill && row->position == 0)
		return map_prefill(t, row, lim, it, msg, cap);
	int n_sink = 0;
	if (row->resume) {
		int code = resume_record(t, row, lim, msg, cap);
		if (code)
			return code;
		if ((n_sink = wd_row_prefix_sink(row, msg, cap)) < 0) {
			wd_gtab_drop(t, row->request_id);
			return BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
		}
	}
	if (!row->prefill)
		return map_decode(t, row, lim, it, msg, cap);
	int code = map_chunk(t, row, lim, it, msg, cap);
	if (code == 0 && n_sink) {
		it->sink_tokens = row->context;
		it->n_sink = n_sink;
	}
	return code;
}

void wd_gdone(struct wd_gtab *t, const struct wd_gitem *it, bool ok)
{
	struct wd_greq *q = wd_gtab_find(t, it->id);
	if (!q)
		return;
	if (!ok) {
		wd_gtab_drop(t, it->id);
		return;
	}
	q->busy = false;
	const struct bd_grow *g = &it->g;
	int fed = it->kind == WD_G_PREFILL ? it->n_tokens : 1;
	q->n_tokens = g->position + fed;
	/* the fill's pages, then the row's own */
	if (it->kind == WD_G_FILL_DECODE)
		for (int i = 0; i < it->fill.n_new; i++)
			q->pages[q->n_pages++] = it->fill.new_pages[i];
	for (int i = 0; i < g->n_new; i++)
		q->pages[q->n_pages++] = g->new_pages[i];
	if (it->sample)
		q->draws++;
}

void wd_gscrub(const Bdfp4__PlanRow *row, const struct wd_gitem *it, const int32_t **ret_pages,
	       size_t *ret_n, int32_t *ret_slot)
{
	*ret_pages = row->new_pages;
	*ret_n = row->n_new_pages;
	/* only a new sequence's slot: a later chunk's or a resumed request's slot holds its sink
	 * and recent rows; a prefix hit's is new */
	*ret_slot = it->kind == WD_G_FILL_DECODE || it->n_sink > 0 ||
				    (it->kind == WD_G_PREFILL && row->position == 0 && !row->resume)
			    ? row->slot
			    : -1;
}
