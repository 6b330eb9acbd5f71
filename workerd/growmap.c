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

#define TOP_MAX 64

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

static int map_prefill(struct wd_gtab *t, const Bdfp4__PlanRow *row,
		       const struct wd_glimits *lim, struct wd_gitem *it, char *msg, size_t cap)
{
	const int inv = BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
	int n = (int)row->n_tokens;
	int32_t bad;

	if (row->kv_config && *row->kv_config && strcmp(row->kv_config, lim->kv_config))
		return bd_errf(msg, cap, BDFP4__SERVE_ERROR__SERVE_ERR_UNKNOWN_KV_CONFIG,
			    "KV configuration '%.40s': the cuda backend runs the pool's '%s' only",
			    row->kv_config, lim->kv_config);
	if (row->position != 0 || row->n_tokens < 1 || row->n_tokens > INT_MAX / 2)
		return bd_errf(msg, cap, inv, "prefill of %zu tokens at position %d", row->n_tokens,
			    row->position);
	if (row->capacity < (uint32_t)n || row->capacity > (uint32_t)lim->max_tokens)
		return bd_errf(msg, cap, inv, "capacity %u for a %d-token prompt (the model holds %d "
			    "tokens)", row->capacity, n, lim->max_tokens);
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
	if (row->slot < 0 || (size_t)row->slot >= lim->n_slots)
		return bd_errf(msg, cap, inv, "slot %d is outside the pool (%zu slots)", row->slot,
			    lim->n_slots);
	for (int i = 0; i < n; i++)
		if (row->tokens[i] < 0 || row->tokens[i] >= lim->n_vocab)
			return bd_errf(msg, cap, inv, "token %d at %d is outside the vocabulary (%d)",
				    row->tokens[i], i, lim->n_vocab);

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
		return bd_errf(msg, cap, inv, "bad sampling parameters");

	/* a preempted request starts over; another live request must not hold the slot */
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
	q->busy = true;

	it->id = row->request_id;
	it->sample = row->sample;
	it->top_k = row->logits_top_k < TOP_MAX ? row->logits_top_k : TOP_MAX;
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

static int map_decode(struct wd_gtab *t, const Bdfp4__PlanRow *row,
		      const struct wd_glimits *lim, struct wd_gitem *it, char *msg, size_t cap)
{
	const int inv = BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
	struct wd_greq *q = wd_gtab_find(t, row->request_id);
	const char *bad = NULL;
	int32_t badp;

	if (!q)
		return bd_errf(msg, cap, inv, "no sequence for request %llu on this worker",
			    (unsigned long long)row->request_id);
	if (q->busy)
		return bd_errf(msg, cap, inv, "request %llu appears twice in the plan",
			    (unsigned long long)row->request_id);
	bool fills = (row->position + 1) % BD_PAGE_TOKENS == 0;
	if (row->n_tokens != 1)
		bad = "a decode row feeds one token";
	else if (row->position != q->n_tokens)
		bad = "position is not the count of tokens held";
	else if (row->position >= q->capacity)
		bad = "the sequence is at its capacity";
	else if (row->slot != q->slot)
		bad = "slot differs from the prefill's";
	else if (row->n_block_table != (size_t)q->n_pages ||
		 (q->n_pages &&
		  memcmp(row->block_table, q->pages, sizeof(int32_t) * (size_t)q->n_pages)))
		bad = "block table differs from the pages promoted";
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
	it->sample = row->sample;
	it->top_k = row->logits_top_k < TOP_MAX ? row->logits_top_k : TOP_MAX;
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
	/* the GPU's sampler hands back tokens and top logits, not the log-softmax */
	if (row->logprobs || row->top_logprobs) {
		wd_gtab_drop(t, row->request_id);
		return bd_errf(msg, cap, BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT,
			       "request %llu: log-probabilities are not served by the cuda backend "
			       "(its sampler runs on the GPU)", (unsigned long long)row->request_id);
	}
	return row->prefill ? map_prefill(t, row, lim, it, msg, cap)
			    : map_decode(t, row, lim, it, msg, cap);
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
	*ret_slot = it->kind == WD_G_DECODE ? -1 : row->slot;
}
