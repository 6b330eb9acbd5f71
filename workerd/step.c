/* step.c — executing a StepPlan (proto/serve.proto): release, then each row's prefill or
 * decode step over the pool arena, rank 0 sampling; one StepResult back.
 *
 * Every check that can refuse a row depends only on the plan and on state both ranks share
 * (their sequences were built by the same plans), so both ranks refuse the same rows and make
 * the same all-reduce calls. What only rank 0 does (sampling, top logits) comes after the
 * forward pass, never before it.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "workerd.h"

#define MSG_MAX WD_MSG_MAX
#define TOP_MAX WD_TOP_MAX


static struct wd_seq *find(struct wd *w, uint64_t id)
{
	for (struct wd_seq *s = w->seqs; s; s = s->next)
		if (s->request_id == id)
			return s;
	return NULL;
}

static void drop(struct wd *w, uint64_t id)
{
	for (struct wd_seq **p = &w->seqs; *p; p = &(*p)->next) {
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

void wd_drop_all(struct wd *w)
{
	while (w->seqs)
		drop(w, w->seqs->request_id);
	wd_gtab_clear(&w->gtab);
}

Bdfp4__ServeError wd_serve_error(int e)
{
	switch (e) {
	case -EINVAL:
	case -ERANGE:
		return BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
	case -ENOSPC:
	case -ENOMEM:
		return BDFP4__SERVE_ERROR__SERVE_ERR_RESOURCE_EXHAUSTED;
	case -EPIPE:
	case -ETIMEDOUT:
		return BDFP4__SERVE_ERROR__SERVE_ERR_WORKER_FAILED;
	default:
		return BDFP4__SERVE_ERROR__SERVE_ERR_INTERNAL;
	}
}

int wd_row_fail(struct wd_row_out *o, Bdfp4__ServeError code, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(o->msg, sizeof(o->msg), fmt, ap);
	va_end(ap);
	o->rr.error = code;
	o->rr.message = o->msg;
	return -1;
}

/* The k largest logits, largest first (k ≤ TOP_MAX; ties: the lower id first). */
static void top_logits(struct wd_row_out *o, const float *lg, int V, uint32_t k)
{
	size_t n = 0;
	if (k > TOP_MAX)
		k = TOP_MAX;
	for (int v = 0; v < V; v++) {
		if (n == k && !(lg[v] > o->top[n - 1].logit))
			continue;
		size_t i = n < k ? n++ : n - 1;
		while (i > 0 && lg[v] > o->top[i - 1].logit) {
			o->top[i] = o->top[i - 1];
			i--;
		}
		bdfp4__top_logit__init(&o->top[i]);
		o->top[i].token = v;
		o->top[i].logit = lg[v];
	}
	for (size_t i = 0; i < n; i++)
		o->topp[i] = &o->top[i];
	o->rr.n_top = n;
	o->rr.top = o->topp;
}

/* Rank 0, after a forward pass of a row that samples: the token and the top logits. */
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
	return 0;
}

static int model_fail(struct wd *w, struct wd_row_out *o, int r, const char *what)
{
	if (r == -EPIPE || r == -ETIMEDOUT)
		return wd_row_fail(o, wd_serve_error(r), "%s: the all-reduce with the other rank %s",
				   what, r == -EPIPE ? "broke (a rank died or left)" : "timed out");
	(void)w;
	return wd_row_fail(o, wd_serve_error(r), "%s failed: %s", what, strerror(-r));
}

static int run_prefill(struct wd *w, const Bdfp4__PlanRow *row, struct wd_row_out *o)
{
	const struct bd_model_hparams *hp = &w->model->hp;
	const char *kv = row->kv_config && *row->kv_config ? row->kv_config
							    : w->pool_cfg->name;
	const struct bd_kvcfg *cfg = bd_kvcfg_find(kv);
	char err[BD_MODEL_ERR_MAX];
	int n = (int)row->n_tokens, r;

	drop(w, row->request_id); /* preempted and recomputed: start over */
	if (!cfg)
		return wd_row_fail(o, BDFP4__SERVE_ERROR__SERVE_ERR_UNKNOWN_KV_CONFIG,
				"unknown KV configuration '%s'", kv);
	if (cfg->page_fmt != w->geo->layout.fmt)
		return wd_row_fail(o, BDFP4__SERVE_ERROR__SERVE_ERR_UNKNOWN_KV_CONFIG,
				"KV configuration '%s' needs another page format than the pool's "
				"'%s'", kv, w->pool_cfg->name);
	if (row->position != 0 || n < 1)
		return wd_row_fail(o, BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT,
				"prefill of %d tokens at position %d", n, row->position);
	if (row->capacity < (uint32_t)n || row->capacity > (uint32_t)hp->n_ctx_train ||
	    row->capacity > w->geo->max_seq_len)
		return wd_row_fail(o, BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT,
				"capacity %u for a %d-token prompt (context %d, pool %u)",
				row->capacity, n, hp->n_ctx_train, w->geo->max_seq_len);
	if (row->n_new_pages != (size_t)(n / BD_PAGE_TOKENS) || row->n_block_table != 0)
		return wd_row_fail(o, BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT,
				"a %d-token prompt fills %d pages; the plan names %zu (and %zu "
				"promoted)", n, n / BD_PAGE_TOKENS, row->n_new_pages,
				row->n_block_table);
	for (struct wd_seq *t = w->seqs; t; t = t->next)
		if (bd_kvmem_ext_slot_id(w->mem, bd_seq_slot(t->seq)) == row->slot)
			return wd_row_fail(o, BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT,
					"slot %d is held by request %llu", row->slot,
					(unsigned long long)t->request_id);
	if ((r = bd_kvmem_ext_provide(w->mem, row->slot, NULL, 0)) < 0)
		return wd_row_fail(o, wd_serve_error(r), "slot %d is outside the pool (%zu slots)",
				row->slot, w->geo->n_slots);

	struct wd_seq *s = calloc(1, sizeof(*s));
	if (!s)
		return wd_row_fail(o, BDFP4__SERVE_ERROR__SERVE_ERR_RESOURCE_EXHAUSTED, "out of memory");
	s->request_id = row->request_id;
	struct bd_seq_opts so = { .max_tokens = (int)row->capacity, .mem = w->mem,
				  .mu_k = w->calib ? w->calib->mu_k : NULL, .dp = &w->dp };
	if (w->ar) {
		so.allreduce = bd_allreduce_model_cb;
		so.allreduce_ctx = w->ar;
	}
	if ((r = bd_seq_new(w->model, cfg, &so, &s->seq, err)) < 0) {
		free(s);
		return wd_row_fail(o, wd_serve_error(r), "sequence: %s", err);
	}
	if ((r = bd_seq_give_pages(s->seq, row->new_pages, (int)row->n_new_pages)) < 0) {
		bd_seq_free(s->seq);
		free(s);
		return wd_row_fail(o, wd_serve_error(r), "a page id is outside the pool (%zu pages)",
				w->geo->n_pages);
	}
	r = bd_model_prefill(w->model, s->seq, (const int32_t *)row->tokens, n,
			     w->o.rank == 0 ? w->logits : NULL);
	if (r < 0) {
		bd_seq_free(s->seq);
		free(s);
		return model_fail(w, o, r, "prefill");
	}
	if (w->o.rank == 0) {
		struct bd_sampler_params sp = bd_sampler_params_greedy();
		if (row->sampling) {
			sp.temperature = row->sampling->temperature;
			sp.top_k = (int)row->sampling->top_k;
			sp.top_p = row->sampling->top_p > 0.0f ? row->sampling->top_p : 1.0f;
			sp.seed = row->sampling->seed;
		}
		if ((r = bd_sampler_new(&sp, w->model->hp.n_vocab, &s->sampler)) < 0) {
			bd_seq_free(s->seq);
			free(s);
			return wd_row_fail(o, wd_serve_error(r), "bad sampling parameters");
		}
	}
	s->next = w->seqs;
	w->seqs = s;
	if (sample(w, s, row, w->logits, o) < 0) {
		drop(w, row->request_id);
		return -1;
	}
	return 0;
}

/* Checks a decode row against the sequence it names and hands it the plan's page. Returns the
 * sequence, or NULL with the row failed (and the sequence dropped). */
static struct wd_seq *prepare_decode(struct wd *w, const Bdfp4__PlanRow *row, struct wd_row_out *o)
{
	struct wd_seq *s = find(w, row->request_id);
	const int32_t *bt;
	int r;

	if (!s) {
		wd_row_fail(o, BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT,
			 "no sequence for request %llu on this worker",
			 (unsigned long long)row->request_id);
		return NULL;
	}
	int held = bd_seq_n_tokens(s->seq), nbt = bd_seq_block_table(s->seq, &bt);
	bool fills = (row->position + 1) % BD_PAGE_TOKENS == 0;
	const char *bad = NULL;
	if (row->n_tokens != 1)
		bad = "a decode row feeds one token";
	else if (row->position != held)
		bad = "position is not the count of tokens held";
	else if (row->slot != bd_kvmem_ext_slot_id(w->mem, bd_seq_slot(s->seq)))
		bad = "slot differs from the prefill's";
	else if (row->n_block_table != (size_t)nbt ||
		 (nbt && memcmp(row->block_table, bt, sizeof(int32_t) * (size_t)nbt)))
		bad = "block table differs from the pages promoted";
	else if (row->n_new_pages != (fills ? 1u : 0u))
		bad = fills ? "this token fills a page and no page was named"
			    : "a page was named for a token that fills none";
	if (bad) {
		wd_row_fail(o, BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT,
			 "request %llu at position %d (holds %d tokens, %d pages): %s",
			 (unsigned long long)row->request_id, row->position, held, nbt, bad);
		drop(w, row->request_id);
		return NULL;
	}
	if ((r = bd_seq_give_pages(s->seq, row->new_pages, (int)row->n_new_pages)) < 0) {
		wd_row_fail(o, wd_serve_error(r), "page %d is outside the pool (%zu pages)",
			 row->new_pages[0], w->geo->n_pages);
		drop(w, row->request_id);
		return NULL;
	}
	return s;
}

/* The decode rows that passed their checks, as one batch (bd_model_decode_batch: the weights
 * are read once for all rows). Returns the all-reduce error that broke the batch, or 0. */
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
	r = bd_model_decode_batch(w->model, bs, tok, nb, lg, st);
out:
	for (int b = 0; b < nb; b++) {
		const Bdfp4__PlanRow *row = plan->rows[rows[b]];
		struct wd_row_out *o = &out[rows[b]];
		int e = r < 0 ? r : st[b];
		if (e < 0) {
			model_fail(w, o, e, "decode");
			drop(w, row->request_id);
		} else if (sample(w, seqs[b], row, lg ? lg + (size_t)b * V : NULL, o) < 0) {
			drop(w, row->request_id);
		}
	}
	free(bs);
	free(tok);
	free(st);
	free(lg);
	return r == -EPIPE || r == -ETIMEDOUT ? r : 0;
}

static bool ar_broken(int e)
{
	return e == BDFP4__SERVE_ERROR__SERVE_ERR_WORKER_FAILED;
}

/* The CPU backend's rows: prefills one by one in plan order, then every decode row in one
 * batch (the same order on every rank, so the same all-reduce calls). Sets *ret_error and msg
 * when the all-reduce broke. */
static void run_cpu_rows(struct wd *w, const Bdfp4__StepPlan *plan, struct wd_row_out *out,
			 Bdfp4__ServeError *ret_error, char *msg, size_t cap)
{
	struct wd_seq **batch = calloc(plan->n_rows ? plan->n_rows : 1, sizeof(*batch));
	size_t *batch_rows = calloc(plan->n_rows ? plan->n_rows : 1, sizeof(*batch_rows));
	bool broken = false;

	if (!batch || !batch_rows) {
		for (size_t i = 0; i < plan->n_rows; i++)
			wd_row_fail(&out[i], BDFP4__SERVE_ERROR__SERVE_ERR_RESOURCE_EXHAUSTED,
				    "out of memory");
		goto out;
	}
	for (size_t i = 0; i < plan->n_rows; i++) {
		const Bdfp4__PlanRow *row = plan->rows[i];
		struct wd_row_out *o = &out[i];
		if (!row->prefill)
			continue;
		if (broken) {
			/* the other rank is gone: nothing more can be computed in this epoch */
			wd_row_fail(o, BDFP4__SERVE_ERROR__SERVE_ERR_WORKER_FAILED,
				    "the all-reduce broke earlier in this step");
			drop(w, row->request_id);
			continue;
		}
		run_prefill(w, row, o);
		if (ar_broken(o->rr.error)) {
			broken = true;
			*ret_error = BDFP4__SERVE_ERROR__SERVE_ERR_WORKER_FAILED;
			snprintf(msg, cap, "rank %d: %s", w->o.rank, o->msg);
		}
	}
	int nb = 0;
	for (size_t i = 0; i < plan->n_rows; i++) {
		const Bdfp4__PlanRow *row = plan->rows[i];
		if (row->prefill)
			continue;
		if (broken) {
			wd_row_fail(&out[i], BDFP4__SERVE_ERROR__SERVE_ERR_WORKER_FAILED,
				    "the all-reduce broke earlier in this step");
			drop(w, row->request_id);
			continue;
		}
		struct wd_seq *s = prepare_decode(w, row, &out[i]);
		if (s) {
			batch[nb] = s;
			batch_rows[nb++] = i;
		}
	}
	if (nb > 0 && run_decode_batch(w, plan, out, batch, batch_rows, nb) < 0) {
		*ret_error = BDFP4__SERVE_ERROR__SERVE_ERR_WORKER_FAILED;
		snprintf(msg, cap, "rank %d: %s", w->o.rank, out[batch_rows[0]].msg);
	}
out:
	free(batch);
	free(batch_rows);
}

void wd_run_plan(struct wd *w, const Bdfp4__StepPlan *plan)
{
	Bdfp4__WorkerMessage m = BDFP4__WORKER_MESSAGE__INIT;
	Bdfp4__StepResult res = BDFP4__STEP_RESULT__INIT;
	struct wd_row_out *out = NULL;
	Bdfp4__RowResult **rows = NULL;
	char msg[MSG_MAX + 32] = "";
	struct timespec t0, t1;

	clock_gettime(CLOCK_MONOTONIC, &t0);
	res.epoch = plan->epoch;
	res.step = plan->step;
	res.rank = w->o.rank;
	m.msg_case = BDFP4__WORKER_MESSAGE__MSG_RESULT;
	m.result = &res;

	if (!w->epoch || plan->epoch != w->epoch) {
		res.error = BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
		snprintf(msg, sizeof(msg), "plan of epoch %llu; this worker is in epoch %llu",
			 (unsigned long long)plan->epoch, (unsigned long long)w->epoch);
		goto send;
	}
	if (w->gpu ? wd_gpu_broken(w)
		   : w->o.tp > 1 && (!w->ar || bd_allreduce_check(w->ar) < 0)) {
		res.error = BDFP4__SERVE_ERROR__SERVE_ERR_WORKER_FAILED;
		snprintf(msg, sizeof(msg), "rank %d: the %s of epoch %llu is broken (a rank "
					   "died or left); waiting for a reset", w->o.rank,
			 w->gpu ? "NCCL communicator" : "all-reduce",
			 (unsigned long long)w->epoch);
		goto send;
	}
	for (size_t i = 0; i < plan->n_release; i++) {
		drop(w, plan->release[i]);
		wd_gtab_drop(&w->gtab, plan->release[i]);
	}

	out = calloc(plan->n_rows ? plan->n_rows : 1, sizeof(*out));
	rows = calloc(plan->n_rows ? plan->n_rows : 1, sizeof(*rows));
	if (!out || !rows) {
		res.error = BDFP4__SERVE_ERROR__SERVE_ERR_INTERNAL;
		snprintf(msg, sizeof(msg), "out of memory for %zu rows", plan->n_rows);
		goto send;
	}
	for (size_t i = 0; i < plan->n_rows; i++) {
		struct wd_row_out *o = &out[i];
		bdfp4__row_result__init(&o->rr);
		o->rr.request_id = plan->rows[i]->request_id;
		o->rr.token = -1;
		rows[i] = &o->rr;
	}
	if (w->gpu)
		wd_gpu_run_rows(w, plan, out, &res.error, msg, sizeof(msg));
	else
		run_cpu_rows(w, plan, out, &res.error, msg, sizeof(msg));
	res.n_rows = plan->n_rows;
	res.rows = rows;
send:
	if (msg[0])
		res.message = msg;
	atomic_fetch_add(&w->pub_steps, 1);
	clock_gettime(CLOCK_MONOTONIC, &t1);
	res.compute_us = (uint64_t)((t1.tv_sec - t0.tv_sec) * 1000000 +
				    (t1.tv_nsec - t0.tv_nsec) / 1000);
	if (res.error)
		bd_log_warn("step %llu: %s", (unsigned long long)plan->step, msg);
	if (w->o.verbose)
		bd_log_debug("step %llu: %zu rows, %zu released, %llu us",
			 (unsigned long long)plan->step, plan->n_rows, plan->n_release,
			 (unsigned long long)res.compute_us);
	int r = wd_send(w, &m);
	if (r < 0)
		bd_log_err("step %llu: result not sent: %s", (unsigned long long)plan->step,
		       strerror(-r));
	if (w->gpu) {
		/* the plan's wall time on this worker, the send included (serve_gpu.sh) */
		clock_gettime(CLOCK_MONOTONIC, &t1);
		wd_gpu_note_plan(w, plan->n_rows,
				 (double)(t1.tv_sec - t0.tv_sec) * 1e6 +
					 (double)(t1.tv_nsec - t0.tv_nsec) * 1e-3);
	}
	free(out);
	free(rows);
}
