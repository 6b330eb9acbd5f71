/* cpu.c — workerd's cpu backend: the shard on the host (bd_model.h) over kvpoold's memfd
 * arena, the ranks joined by the shared-memory all-reduce (bd_allreduce.h).
 *
 * KV: bd_kvmem_pool_new over the arena of this rank; the router allocates, the plans name
 * slot and page ids. Each request is a bd_seq (and, on rank 0, its sampler). A plan runs its
 * prefill rows one by one in plan order, then every decode row as one batch
 * (bd_model_decode_batch: each weight read once per step).
 *
 * Every check that can refuse a row depends only on the plan and on state both ranks share
 * (their sequences were built by the same plans), so both ranks refuse the same rows and make
 * the same all-reduce calls. What only rank 0 does (sampling, top logits) comes after the
 * forward pass, never before it.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/bd_forward.h"
#include "model/bd_kvmem.h"
#include "model/bd_sampler.h"
#include "model/bd_seq.h"
#include "pool/bd_kvmem_pool.h"
#include "serve/bd_allreduce.h"
#include "workerd.h"

#define AR_CAP (1u << 16)        /* floats per all-reduce round */
#define JOIN_TIMEOUT_MS 10000    /* the other ranks' arrival in the all-reduce */

struct wd_seq {
	uint64_t request_id;
	struct bd_seq *seq;
	struct bd_sampler *sampler; /* rank 0 */
	struct wd_seq *next;
};

struct wd_cpu {
	struct bd_kvmem *mem;    /* the pool's arena of this rank */
	struct bd_allreduce *ar; /* this epoch's (tp > 1), else NULL */
	struct wd_seq *seqs;
	float *logits;           /* [V], rank 0 */
};

static struct wd_cpu *cpu(const struct wd *w)
{
	return w->be_state;
}

/* ---- requests ------------------------------------------------------------------------------- */

static struct wd_seq *find(struct wd_cpu *c, uint64_t id)
{
	for (struct wd_seq *s = c->seqs; s; s = s->next)
		if (s->request_id == id)
			return s;
	return NULL;
}

static void drop(struct wd_cpu *c, uint64_t id)
{
	for (struct wd_seq **p = &c->seqs; *p; p = &(*p)->next) {
		if ((*p)->request_id == id) {
			struct wd_seq *s = *p;
			*p = s->next;
			bd_seq_free(s->seq);
			bd_sampler_free(s->sampler);
			free(s);
			return;
		}
	}
}

static void cpu_release(struct wd *w, uint64_t id)
{
	drop(cpu(w), id);
}

/* ---- rows ----------------------------------------------------------------------------------- */

/* The k largest logits, largest first (k ≤ WD_TOP_MAX; ties: the lower id first). */
static void top_logits(struct wd_row_out *o, const float *lg, int V, uint32_t k)
{
	int32_t ids[WD_TOP_MAX];
	int n = bd_sampler_top(lg, V, k < WD_TOP_MAX ? (int)k : WD_TOP_MAX, ids);

	for (int i = 0; i < n; i++) {
		bdfp4__top_logit__init(&o->top[i]);
		o->top[i].token = ids[i];
		o->top[i].logit = lg[ids[i]];
		o->topp[i] = &o->top[i];
	}
	o->rr.n_top = n > 0 ? (size_t)n : 0;
	o->rr.top = o->topp;
}

/* The sampled token's log-probability and the k most likely (k ≤ WD_LOGPROBS_MAX): the
 * log-softmax of the raw logits (bd_sampler_logprobs) into o (wd_row_logprobs). Returns 0, or
 * -1 with the row failed (non-finite logits). */
static int logprobs(struct wd_row_out *o, const float *lg, int V, uint32_t k)
{
	int32_t ids[WD_LOGPROBS_MAX];
	float lp[WD_LOGPROBS_MAX], tok = NAN;
	int n = bd_sampler_logprobs(lg, V, o->rr.token, k < WD_LOGPROBS_MAX ? (int)k
									 : WD_LOGPROBS_MAX,
				    &tok, ids, lp);

	return wd_row_logprobs(o, n < 0 ? NAN : tok, ids, lp, n);
}

/* Rank 0, after a forward pass of a row that samples: the token, the top logits and the
 * log-probabilities the row asks for. */
static int sample(struct wd *w, struct wd_seq *s, const Bdfp4__PlanRow *row, const float *lg,
		  struct wd_row_out *o)
{
	if (w->o.rank != 0 || !row->sample)
		return 0;
	int r = bd_sampler_sample(s->sampler, lg, &o->rr.token);
	if (r < 0)
		return wd_row_fail(o, BDFP4__SERVE_ERROR__SERVE_ERR_INTERNAL,
				"sampling failed: non-finite logits");
	if (row->logits_top_k)
		top_logits(o, lg, w->model->hp.n_vocab, row->logits_top_k);
	if (row->logprobs)
		return logprobs(o, lg, w->model->hp.n_vocab, row->top_logprobs);
	return 0;
}

static int model_fail(struct wd_row_out *o, int r, const char *what)
{
	if (r == -EPIPE || r == -ETIMEDOUT)
		return wd_row_fail(o, wd_serve_error(r), "%s: the all-reduce with the other rank %s",
				   what, r == -EPIPE ? "broke (a rank died or left)" : "timed out");
	return wd_row_fail(o, wd_serve_error(r), "%s failed: %s", what, strerror(-r));
}

/* The sampler of a request that drew `draws` tokens before (rank 0): made with the request's
 * parameters and moved past those draws (bd_sampler_skip), so a resumed request draws what an
 * undisturbed run draws next, and with the same logits streams the same tokens. */
static int make_sampler(struct wd *w, const Bdfp4__PlanRow *row, struct bd_sampler **ret)
{
	struct bd_sampler_params sp = bd_sampler_params_greedy();

	if (row->sampling) {
		sp.temperature = row->sampling->temperature;
		sp.top_k = (int)row->sampling->top_k;
		sp.top_p = row->sampling->top_p > 0.0f ? row->sampling->top_p : 1.0f;
		sp.seed = row->sampling->seed;
	}
	int r = bd_sampler_new(&sp, w->model->hp.n_vocab, ret);
	if (r == 0)
		bd_sampler_skip(*ret, row->draws);
	return r;
}

/* A new sequence for row (a prefill at position 0, or a row that resumes a request): its
 * configuration, capacity and slot checked as every rank checks them, the slot taken from the
 * pool as it is, and rank 0's sampler. Returns it, not yet in the list, or NULL with the row
 * failed. */
static struct wd_seq *seq_make(struct wd *w, const Bdfp4__PlanRow *row, struct wd_row_out *o)
{
	struct wd_cpu *c = cpu(w);
	const struct bd_model_hparams *hp = &w->model->hp;
	const char *kv = row->kv_config && *row->kv_config ? row->kv_config
							    : w->pool_cfg->name;
	const struct bd_kvcfg *cfg = bd_kvcfg_find(kv);
	char err[BD_MODEL_ERR_MAX];
	int64_t need = (int64_t)row->position + (int64_t)row->n_tokens;
	int r;

	if (!cfg) {
		wd_row_fail(o, BDFP4__SERVE_ERROR__SERVE_ERR_UNKNOWN_KV_CONFIG,
			    "unknown KV configuration '%s'", kv);
		return NULL;
	}
	if (cfg->page_fmt != w->geo->layout.fmt) {
		wd_row_fail(o, BDFP4__SERVE_ERROR__SERVE_ERR_UNKNOWN_KV_CONFIG,
			    "KV configuration '%s' needs another page format than the pool's '%s'",
			    kv, w->pool_cfg->name);
		return NULL;
	}
	if ((int64_t)row->capacity < need || row->capacity > (uint32_t)hp->n_ctx_train ||
	    row->capacity > w->geo->max_seq_len) {
		wd_row_fail(o, BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT,
			    "capacity %u for %lld tokens (context %d, pool %u)", row->capacity,
			    (long long)need, hp->n_ctx_train, w->geo->max_seq_len);
		return NULL;
	}
	for (struct wd_seq *t = c->seqs; t; t = t->next)
		if (bd_kvmem_ext_slot_id(c->mem, bd_seq_slot(t->seq)) == row->slot) {
			wd_row_fail(o, BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT,
				    "slot %d is held by request %llu", row->slot,
				    (unsigned long long)t->request_id);
			return NULL;
		}
	if ((r = bd_kvmem_ext_provide(c->mem, row->slot, NULL, 0)) < 0) {
		wd_row_fail(o, wd_serve_error(r), "slot %d is outside the pool (%zu slots)",
			    row->slot, w->geo->n_slots);
		return NULL;
	}
	struct wd_seq *s = calloc(1, sizeof(*s));
	if (!s) {
		wd_row_fail(o, BDFP4__SERVE_ERROR__SERVE_ERR_RESOURCE_EXHAUSTED, "out of memory");
		return NULL;
	}
	s->request_id = row->request_id;
	struct bd_seq_opts so = { .max_tokens = (int)row->capacity, .mem = c->mem,
				  .mu_k = w->calib ? w->calib->mu_k : NULL, .dp = &w->dp };
	if (c->ar) {
		so.allreduce = bd_allreduce_model_cb;
		so.allreduce_ctx = c->ar;
	}
	if ((r = bd_seq_new(w->model, cfg, &so, &s->seq, err)) < 0) {
		free(s);
		wd_row_fail(o, wd_serve_error(r), "sequence: %s", err);
		return NULL;
	}
	if (w->o.rank == 0 && (r = make_sampler(w, row, &s->sampler)) < 0) {
		bd_seq_free(s->seq);
		free(s);
		wd_row_fail(o, wd_serve_error(r), "bad sampling parameters");
		return NULL;
	}
	return s;
}

static void seq_free(struct wd_seq *s)
{
	bd_seq_free(s->seq);
	bd_sampler_free(s->sampler);
	free(s);
}

/* A prefix hit's row (wd_row_prefix_sink) holds nothing in its slot: its BF16 sink (the first
 * n_sink tokens of the context, NUMERICS.md §8) is written by a prefill of context[0..n_sink)
 * at position 0 into the slot (no page fills: 16 < 128; the recent rows it also writes are
 * rewritten by the chunk that follows before anything reads them), then *ps is made anew over
 * the same slot, as it is, for bd_seq_resume. The positions 0..15 see the same tokens as in the
 * prefill that wrote the shared pages, so the sink holds what that request's sink held.
 * Returns 0, or -1 with the row failed and *ps freed. */
static int rebuild_sink(struct wd *w, const Bdfp4__PlanRow *row, int n_sink,
			struct wd_row_out *o, struct wd_seq **ps)
{
	int r = bd_model_prefill(w->model, (*ps)->seq, (const int32_t *)row->context, n_sink,
				 NULL);

	seq_free(*ps);
	*ps = NULL;
	if (r < 0)
		return model_fail(o, r, "sink prefill");
	if (!(*ps = seq_make(w, row, o)))
		return -1;
	return 0;
}

/* A row that resumes a request (a group formed after a failure): whatever this worker held
 * of it is dropped, and the sequence is rebuilt from the row over the KV the pool kept: its
 * slot as it is, its promoted pages (the block table), its position. Returns the sequence,
 * in the list, or NULL with the row failed. */
static struct wd_seq *resume(struct wd *w, const Bdfp4__PlanRow *row, struct wd_row_out *o)
{
	struct wd_cpu *c = cpu(w);
	struct wd_seq *s;
	char why[WD_MSG_MAX];
	int n_sink, r;

	drop(c, row->request_id);
	if ((n_sink = wd_row_prefix_sink(row, why, sizeof(why))) < 0) {
		wd_row_fail(o, BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT, "%s", why);
		return NULL;
	}
	if (!(s = seq_make(w, row, o)))
		return NULL;
	if (n_sink && rebuild_sink(w, row, n_sink, o, &s) < 0)
		return NULL;
	r = bd_seq_resume(s->seq, row->block_table, (int)row->n_block_table, row->position);
	if (r < 0) {
		seq_free(s);
		wd_row_fail(o, wd_serve_error(r),
			    "cannot resume request %llu at position %d with %zu pages: %s",
			    (unsigned long long)row->request_id, row->position,
			    row->n_block_table, r == -ERANGE ? "a page is outside the pool"
							     : "they do not fit it");
		return NULL;
	}
	s->next = c->seqs;
	c->seqs = s;
	return s;
}

/* The first chunk of a prompt (position 0): a new sequence, prefilled. */
static int run_prefill_start(struct wd *w, const Bdfp4__PlanRow *row, struct wd_row_out *o)
{
	struct wd_cpu *c = cpu(w);
	int n = (int)row->n_tokens, r;
	struct wd_seq *s;

	drop(c, row->request_id); /* preempted and recomputed: start over */
	if (n < 1 || row->n_new_pages != (size_t)(n / BD_PAGE_TOKENS) || row->n_block_table != 0)
		return wd_row_fail(o, BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT,
				   "a %d-token prefill at 0 fills %d pages; the plan names %zu (and "
				   "%zu promoted)", n, n / BD_PAGE_TOKENS, row->n_new_pages,
				   row->n_block_table);
	if (!(s = seq_make(w, row, o)))
		return -1;
	if ((r = bd_seq_give_pages(s->seq, row->new_pages, (int)row->n_new_pages)) < 0) {
		seq_free(s);
		return wd_row_fail(o, wd_serve_error(r), "a page id is outside the pool (%zu pages)",
				   w->geo->n_pages);
	}
	r = bd_model_prefill(w->model, s->seq, (const int32_t *)row->tokens, n,
			     w->o.rank == 0 && row->sample ? c->logits : NULL);
	if (r < 0) {
		seq_free(s);
		return model_fail(o, r, "prefill");
	}
	s->next = c->seqs;
	c->seqs = s;
	return 0;
}

/* Checks a row that continues the sequence it names (a prefill chunk at position > 0, or a
 * decode) against it and hands it the plan's pages. Returns the sequence, or NULL with the
 * row failed (and the sequence dropped). */
static struct wd_seq *prepare_row(struct wd *w, const Bdfp4__PlanRow *row, struct wd_row_out *o)
{
	struct wd_cpu *c = cpu(w);
	struct wd_seq *s = row->resume ? resume(w, row, o) : find(c, row->request_id);
	const int32_t *bt;
	int r;

	if (!s) {
		if (!row->resume)
			wd_row_fail(o, BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT,
				    "no sequence for request %llu on this worker",
				    (unsigned long long)row->request_id);
		return NULL;
	}
	int held = bd_seq_n_tokens(s->seq), nbt = bd_seq_block_table(s->seq, &bt);
	int p = row->position, n = (int)row->n_tokens;
	int fills = (p + n) / BD_PAGE_TOKENS - p / BD_PAGE_TOKENS;
	const char *bad = NULL;
	if (!row->prefill && n != 1)
		bad = "a decode row feeds one token";
	else if (row->prefill && (n < 1 || p % BD_PAGE_TOKENS))
		bad = "a prefill chunk starts on a page and feeds a token at least";
	else if (p != held)
		bad = "position is not the count of tokens held";
	else if (row->slot != bd_kvmem_ext_slot_id(c->mem, bd_seq_slot(s->seq)))
		bad = "slot differs from the prefill's";
	else if (row->n_block_table != (size_t)nbt ||
		 (nbt && memcmp(row->block_table, bt, sizeof(int32_t) * (size_t)nbt)))
		bad = "block table differs from the pages promoted";
	else if (row->n_new_pages != (size_t)fills)
		bad = fills ? "these tokens fill a page and no page was named"
			    : "a page was named for tokens that fill none";
	if (bad) {
		wd_row_fail(o, BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT,
			    "request %llu at position %d (holds %d tokens, %d pages): %s",
			    (unsigned long long)row->request_id, row->position, held, nbt, bad);
		drop(c, row->request_id);
		return NULL;
	}
	if ((r = bd_seq_give_pages(s->seq, row->new_pages, (int)row->n_new_pages)) < 0) {
		wd_row_fail(o, wd_serve_error(r), "page %d is outside the pool (%zu pages)",
			    row->new_pages[0], w->geo->n_pages);
		drop(c, row->request_id);
		return NULL;
	}
	return s;
}

/* A prefill row: the first chunk starts a sequence, a later one (or one that resumes)
 * continues it on top of the cache the earlier chunks wrote; the last samples. */
static int run_prefill(struct wd *w, const Bdfp4__PlanRow *row, struct wd_row_out *o)
{
	struct wd_cpu *c = cpu(w);
	struct wd_seq *s;
	float *lg = w->o.rank == 0 && row->sample ? c->logits : NULL;
	int r;

	if (row->position == 0 && !row->resume) {
		if (run_prefill_start(w, row, o) < 0)
			return -1;
		s = find(c, row->request_id);
	} else {
		if (!(s = prepare_row(w, row, o)))
			return -1;
		r = bd_model_prefill_chunk(w->model, s->seq, (const int32_t *)row->tokens,
					   (int)row->n_tokens, lg);
		if (r < 0) {
			drop(c, row->request_id);
			return model_fail(o, r, "prefill");
		}
	}
	if (sample(w, s, row, lg, o) < 0) {
		drop(c, row->request_id);
		return -1;
	}
	return 0;
}

/* The decode rows that passed their checks, as one batch (bd_model_decode_batch: the weights
 * are read once for all rows; with batch_invariant, a matrix–vector product per row, so each
 * row's logits are those of the row alone). Returns the all-reduce error that broke the batch, or 0. */
static int run_decode_batch(struct wd *w, const Bdfp4__StepPlan *plan, struct wd_row_out *out,
			    struct wd_seq **seqs, const size_t *rows, int nb)
{
	size_t V = (size_t)w->model->hp.n_vocab;
	struct bd_seq **bs = calloc((size_t)nb, sizeof(*bs));
	int32_t *tok = calloc((size_t)nb, sizeof(*tok));
	int *st = calloc((size_t)nb, sizeof(*st));
	float *lg = w->o.rank == 0 ? malloc(sizeof(float) * V * (size_t)nb) : NULL;
	int r = 0;

	if (!bs || !tok || !st || (w->o.rank == 0 && !lg)) {
		r = -ENOMEM;
		goto out;
	}
	for (int b = 0; b < nb; b++) {
		bs[b] = seqs[b]->seq;
		tok[b] = plan->rows[rows[b]]->tokens[0];
	}
	r = bd_model_decode_batch_mode(w->model, bs, tok, nb, lg, st,
				       w->o.batch_invariant ? BD_BATCH_INVARIANT : BD_BATCH_FAST);
out:
	for (int b = 0; b < nb; b++) {
		const Bdfp4__PlanRow *row = plan->rows[rows[b]];
		struct wd_row_out *o = &out[rows[b]];
		int e = r < 0 ? r : st[b];
		if (e < 0) {
			model_fail(o, e, "decode");
			drop(cpu(w), row->request_id);
		} else if (sample(w, seqs[b], row, lg ? lg + (size_t)b * V : NULL, o) < 0) {
			drop(cpu(w), row->request_id);
		}
	}
	free(bs);
	free(tok);
	free(st);
	free(lg);
	return r == -EPIPE || r == -ETIMEDOUT ? r : 0;
}

/* A row after the all-reduce broke in this step: the other rank is gone, nothing more can be
 * computed in this epoch. */
static void fail_broken(struct wd *w, const Bdfp4__PlanRow *row, struct wd_row_out *o)
{
	wd_row_fail(o, BDFP4__SERVE_ERROR__SERVE_ERR_WORKER_FAILED,
		    "the all-reduce broke earlier in this step");
	drop(cpu(w), row->request_id);
}

/* Every decode row in one batch, then the prefill rows (whole prompts or chunks) one by one
 * in plan order: the same order on every rank, so the same all-reduce calls. */
static void cpu_run_rows(struct wd *w, const Bdfp4__StepPlan *plan, struct wd_row_out *out,
			 Bdfp4__ServeError *ret_error, char *msg, size_t cap)
{
	struct wd_seq **batch = calloc(plan->n_rows ? plan->n_rows : 1, sizeof(*batch));
	size_t *batch_rows = calloc(plan->n_rows ? plan->n_rows : 1, sizeof(*batch_rows));
	bool broken = false;
	int nb = 0;

	if (!batch || !batch_rows) {
		wd_rows_fail(plan, out, BDFP4__SERVE_ERROR__SERVE_ERR_RESOURCE_EXHAUSTED,
			     "out of memory");
		goto out;
	}
	for (size_t i = 0; i < plan->n_rows; i++) {
		const Bdfp4__PlanRow *row = plan->rows[i];
		if (row->prefill)
			continue;
		struct wd_seq *s = prepare_row(w, row, &out[i]);
		if (s) {
			batch[nb] = s;
			batch_rows[nb++] = i;
		}
	}
	if (nb > 0 && run_decode_batch(w, plan, out, batch, batch_rows, nb) < 0) {
		broken = true;
		*ret_error = BDFP4__SERVE_ERROR__SERVE_ERR_WORKER_FAILED;
		snprintf(msg, cap, "rank %d: %s", w->o.rank, out[batch_rows[0]].msg);
	}
	for (size_t i = 0; i < plan->n_rows; i++) {
		const Bdfp4__PlanRow *row = plan->rows[i];
		struct wd_row_out *o = &out[i];
		if (!row->prefill)
			continue;
		if (broken) {
			fail_broken(w, row, o);
			continue;
		}
		run_prefill(w, row, o);
		if (o->rr.error == BDFP4__SERVE_ERROR__SERVE_ERR_WORKER_FAILED) {
			broken = true;
			*ret_error = BDFP4__SERVE_ERROR__SERVE_ERR_WORKER_FAILED;
			snprintf(msg, cap, "rank %d: %s", w->o.rank, o->msg);
		}
	}
out:
	free(batch);
	free(batch_rows);
}

/* ---- the backend ---------------------------------------------------------------------------- */

static int cpu_setup(struct wd *w)
{
	struct wd_cpu *c;

	if (*w->o.random_weights || w->o.synthetic_prefill) {
		bd_log_err("%s needs a pool of the cuda backend; this pool's is cpu",
			   *w->o.random_weights ? "random_weights" : "synthetic_prefill");
		return -ENOTSUP;
	}
	if (!(c = calloc(1, sizeof(*c))))
		return -ENOMEM;
	w->be_state = c;
	if (w->o.rank == 0 && !(c->logits = malloc(sizeof(float) * (size_t)w->hp.n_vocab)))
		return -ENOMEM;
	return 0;
}

static int cpu_map(struct wd *w)
{
	struct wd_cpu *c = cpu(w);
	int r;

	if ((r = bd_kvmem_pool_new(w->pool, &c->mem)) < 0) {
		bd_log_err("pool arena: %s", strerror(-r));
		return r;
	}
	return 0;
}

static void cpu_leave(struct wd *w)
{
	struct wd_cpu *c = cpu(w);

	if (!c)
		return;
	while (c->seqs)
		drop(c, c->seqs->request_id);
	bd_allreduce_close(c->ar);
	c->ar = NULL;
}

static void cpu_teardown(struct wd *w)
{
	struct wd_cpu *c = cpu(w);

	if (!c)
		return;
	bd_kvmem_ext_free(c->mem);
	free(c->logits);
	free(c);
	w->be_state = NULL;
}

static int cpu_register_fill(struct wd *w, Bdfp4__RegisterRequest *rq, uint8_t *id)
{
	(void)w;
	(void)id;
	rq->device = -1;
	return 0;
}

/* An all-reduce file name the router may give: one path component of [-_.0-9A-Za-z], not
 * starting with a dot. */
static bool name_ok(const char *s)
{
	size_t n = strlen(s);
	if (n == 0 || n > 128 || s[0] == '.')
		return false;
	for (size_t i = 0; i < n; i++)
		if (!(s[i] == '-' || s[i] == '_' || s[i] == '.' || (s[i] >= '0' && s[i] <= '9') ||
		      (s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z')))
			return false;
	return true;
}

/* tp > 1: the all-reduce file the reply names, in allreduce_dir, opened and joined; the name
 * unlinked once every rank has it (or gave up). */
static int cpu_join(struct wd *w, const Bdfp4__RegisterReply *rr)
{
	struct wd_cpu *c = cpu(w);
	char path[512];
	int r;

	if (w->o.tp == 1)
		return 0;
	if (!rr->allreduce_name || !name_ok(rr->allreduce_name)) {
		bd_log_err("RegisterReply: bad all-reduce name '%s'",
			   rr->allreduce_name ? rr->allreduce_name : "");
		return -EBADMSG;
	}
	snprintf(path, sizeof(path), "%s/%s", w->o.ar_dir, rr->allreduce_name);
	r = bd_allreduce_open(path, w->o.rank, w->o.tp, AR_CAP, w->o.ar_timeout_ms, &c->ar);
	if (r == 0)
		r = bd_allreduce_join(c->ar, JOIN_TIMEOUT_MS);
	unlink(path);
	if (r < 0) {
		bd_log_err("all-reduce %s: %s; registering again", path,
			   r == -ELOOP ? "a symbolic link, refused"
			   : r == -EACCES ? "a file not made by this user with mode 0600, refused"
			   : r == -EPERM ? "its directory is world-writable or another user's"
			   : strerror(-r));
		bd_allreduce_close(c->ar);
		c->ar = NULL;
		return r;
	}
	return 0;
}

/* The all-reduce's file locks show a dead or restarted peer at once; the router sees the
 * failed step and resets the group. */
static enum wd_health cpu_health(const struct wd *w)
{
	const struct wd_cpu *c = cpu(w);

	return w->o.tp > 1 && (!c->ar || bd_allreduce_check(c->ar) < 0) ? WD_BROKEN : WD_HEALTHY;
}

/* No timing report on the cpu backend: each StepResult's compute_us times its step. */
static void cpu_note_plan(struct wd *w, size_t n_rows, double us)
{
	(void)w;
	(void)n_rows;
	(void)us;
}

static void cpu_report(struct wd *w)
{
	(void)w;
}

const struct wd_backend wd_backend_cpu = WD_BACKEND(cpu, "cpu", "all-reduce",
						      .batch_invariant = true,);
