/* eval_kl.c — `bdfp4 eval-kl`: the accuracy proxy of NUMERICS.md §10 (paper appendix A) on the
 * real model and real text, for every KV configuration of §9.
 *
 * Texts: the given files are read whole, joined with blank lines and tokenized as plain text
 * (no special tokens, no chat template). Trajectory t's prompt is the window of
 * P = ctx − steps + 1 tokens starting at ⌊t·(M − P)/(T − 1)⌋ of the M tokens, so the windows
 * spread evenly over the texts (they overlap when M < T·P: a note says so).
 *
 * Per trajectory: the reference run (KV `bf16`) prefills the prompt and decodes steps − 1
 * tokens, each chosen by its sampler from the logits (greedy by default; --temperature and
 * --seed sample, seed + t for trajectory t), recording the logits ℓ_t of every step. Each
 * configuration holds the same prompt and decodes the same tokens (teacher forcing), through
 * its real cache write path (bd_kv_write_token, promotion) and decoder (bd_ref_decode_gqa),
 * with the calibration's μ_k and τ. The prompt is prefilled once per trajectory, for the
 * reference and every configuration together (bd_model_prefill_multi: prefill attention is
 * BF16 whatever the cache, so one forward pass feeds every configuration's write path, each
 * cache ending as its own prefill would leave it); the configurations' prefill logits are the
 * reference's. D_t (bd_eval.h, over the 128 most
 * likely reference tokens) and the top-1 agreement are taken at all steps, prefill's logits
 * included; a trajectory's KL is the mean over its steps and a configuration's the mean over
 * trajectories. paired_t compares each configuration's per-trajectory KL with
 * bitdecoding-nvfp4's (bd_eval_paired_t; > 0: higher KL than bitdecoding-nvfp4).
 *
 * On the model's real KV, also measured: the query share of the logit error, query/(key +
 * query) of bd_qerr.h's split, summed over every (layer, KV head, query head, page key) at the
 * decode steps s with s % qerr_every == 0 (the unquantized keys k' = H(k − μ_k), transformed
 * when needed from the post-RoPE keys of the forward passes: the prompt's, kept once per
 * trajectory through the reference's hook, and the decoded positions', through each
 * configuration's own hook; the cache is the sequence's own); and the fraction of probability
 * blocks whose E4M3 scale underflowed to 0 (bd_seq_stats) over all decode steps.
 *
 * Work items, spread over --threads threads: a trajectory's reference run (the shared
 * prefill, then the reference's decode steps) and, once it is done, each configuration's
 * decode steps on it. A free thread takes the first item that can run, so the threads work
 * on the configurations of one trajectory together, or on the prefills of the next ones.
 * With more than one thread OpenBLAS is set to one thread per call, and results do not depend
 * on the thread count; with --threads 1 OpenBLAS keeps its own threads, which can split a
 * product differently and change the last bits (so the numbers of a 1-thread run can differ
 * slightly from those of any other). A trajectory's caches live from its prefill to its last configuration's
 * run (13 sequences with every configuration).
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "quant/bd_calib.h"
#include "model/bd_eval.h"
#include "quant/bd_kvcfg.h"
#include "quant/bd_kvemul.h"
#include "model/bd_forward.h"
#include "quant/bd_qerr.h"
#include "model/bd_sampler.h"
#include "model/bd_tokenizer.h"
#include "cli.h"

#define BASELINE "bitdecoding-nvfp4"

struct opts {
	struct cli_eval_common ev; /* --model, --calib, --no-calib, --log, --json, --summarize, TEXT */
	const struct bd_kvcfg *cfg[BD_KVCFG_COUNT];
	int n_cfg;
	int steps, trajectories, qerr_every;
	struct bd_sampler_params sp;
};

/* One configuration's results on one trajectory. */
struct result {
	double kl, top1;        /* means over the steps */
	uint64_t p_blocks, p_zero;
	struct bd_qerr_sums q;  /* over layers, KV heads and query heads */
	double seconds;
};

/* What the hook of a configuration's sequence keeps: the post-RoPE keys of the decoded
 * positions (the prompt's are the trajectory's kraw) and the last queries of every layer. */
struct qhook {
	const struct bd_kvcfg *cfg;
	const struct bd_model_hparams *hp;
	const float *mu;
	int P, steps;
	float *kdec; /* [L][Hkv][steps][d]: position P + i in row i */
	float *q;    /* [L][Hq][d] */
};

/* One configuration's sequence on one trajectory: prefilled with the reference, then waiting
 * for its decode steps. */
struct cfg_run {
	struct bd_kvmem *mem;
	struct bd_seq *s;
	struct qhook qh;
};

struct traj {
	const int32_t *prompt; /* [P], inside the token stream */
	int32_t *y;            /* [steps] the reference's tokens (the last one is not decoded) */
	float *ref;            /* [steps][V] the reference's logits */
	float *kraw;           /* [L][Hkv][P][d] the prompt's post-RoPE keys */
	struct cfg_run *run;   /* [n_cfg], made by the reference run */
	bool ref_done;
	int cfg_left;          /* configurations still to run on it */
};

enum { ITEM_TODO = 0, ITEM_RUNNING, ITEM_DONE };

struct shared {
	const struct opts *o;
	const struct bd_model *m;
	const float *mu;       /* [L][Hkv][d] or NULL */
	struct bd_decode_params dp;
	int P, V;
	struct traj *tr;       /* [T] */
	struct result *res;    /* [T][n_cfg] */
	/* work: item i < T·(n_cfg + 1): trajectory i / (n_cfg + 1), run i % (n_cfg + 1) − 1
	 * (−1: the reference) */
	int n_items, *state;
	int done, err;
	char errmsg[BD_MODEL_ERR_MAX + 64];
	pthread_mutex_t lock;
	pthread_cond_t cv;
	FILE *log;
	bool tty;
	double t0;
};

/* ---- the runs --------------------------------------------------------------------------------- */

static void qhook(void *ctx, int layer, int pos, const float *q, const float *k, const float *v)
{
	struct qhook *h = ctx;
	size_t Hkv = (size_t)h->hp->n_kv_heads, d = (size_t)h->hp->head_dim;
	(void)v;

	if (pos < h->P || pos >= h->P + h->steps) /* the prompt: the trajectory's kraw */
		return;
	for (size_t j = 0; j < Hkv; j++)
		memcpy(h->kdec + (((size_t)layer * Hkv + j) * (size_t)h->steps +
				  (size_t)(pos - h->P)) * d,
		       k + j * d, sizeof(float) * d);
	memcpy(h->q + (size_t)layer * (size_t)h->hp->n_heads * d, q,
	       sizeof(float) * (size_t)h->hp->n_heads * d);
}

/* The reference's hook: the prompt's post-RoPE keys into kraw. */
struct rawhook {
	const struct bd_model_hparams *hp;
	int P;
	float *kraw;
};

static void rawhook(void *ctx, int layer, int pos, const float *q, const float *k, const float *v)
{
	struct rawhook *h = ctx;
	size_t Hkv = (size_t)h->hp->n_kv_heads, d = (size_t)h->hp->head_dim;
	(void)q;
	(void)v;

	if (pos >= h->P)
		return;
	for (size_t j = 0; j < Hkv; j++)
		memcpy(h->kraw + (((size_t)layer * Hkv + j) * (size_t)h->P + (size_t)pos) * d,
		       k + j * d, sizeof(float) * d);
}

static void cfg_run_free(struct cfg_run *cr)
{
	bd_seq_free(cr->s);
	bd_kvmem_private_free(cr->mem);
	free(cr->qh.kdec);
	free(cr->qh.q);
	memset(cr, 0, sizeof(*cr));
}

/* Every configuration's sequence of trajectory t (still) allocated goes, then its prompt keys. */
static void traj_free_runs(struct shared *sh, int t)
{
	struct traj *tr = &sh->tr[t];
	for (int ci = 0; tr->run && ci < sh->o->n_cfg; ci++)
		cfg_run_free(&tr->run[ci]);
	free(tr->run);
	tr->run = NULL;
	free(tr->kraw);
	tr->kraw = NULL;
}

/* An empty sequence of configuration cfg in its own arena, with its hook. */
static int cfg_run_new(struct shared *sh, const struct bd_kvcfg *cfg, struct cfg_run *cr,
		       char *err)
{
	const struct opts *o = sh->o;
	const struct bd_model_hparams *hp = &sh->m->hp;
	struct bd_layout lay;
	int r;

	cr->qh = (struct qhook){ .cfg = cfg, .hp = hp, .mu = sh->mu, .P = sh->P,
				 .steps = o->steps };
	cr->qh.kdec = malloc(sizeof(float) * (size_t)hp->n_layers * (size_t)hp->n_kv_heads *
			     (size_t)o->steps * (size_t)hp->head_dim);
	cr->qh.q = malloc(sizeof(float) * (size_t)hp->n_layers * (size_t)hp->n_heads *
			  (size_t)hp->head_dim);
	if (!cr->qh.kdec || !cr->qh.q) {
		snprintf(err, BD_MODEL_ERR_MAX, "out of memory");
		return -ENOMEM;
	}
	size_t n_pages = o->ev.ctx / BD_PAGE_TOKENS > 0 ? (size_t)(o->ev.ctx / BD_PAGE_TOKENS) : 1;
	if ((r = bd_layout_init(&lay, cfg->page_fmt, hp->n_layers, hp->n_kv_heads, hp->head_dim, 0,
				n_pages)) < 0 ||
	    (r = bd_kvmem_private_new(&lay, &cr->mem)) < 0) {
		snprintf(err, BD_MODEL_ERR_MAX, "%s: cannot make a KV arena (%s)", cfg->name,
			 strerror(-r));
		return r;
	}
	struct bd_seq_opts so = { .max_tokens = o->ev.ctx, .mu_k = sh->mu, .dp = &sh->dp,
				  .mem = cr->mem, .hook = qhook, .hook_ctx = &cr->qh };
	return bd_seq_new(sh->m, cfg, &so, &cr->s, err);
}

/* The reference run of trajectory t: the prompt prefilled once into the reference's and every
 * configuration's cache, then the reference's decode steps. On failure the configurations'
 * sequences go too. */
static int run_reference(struct shared *sh, int t, char *err)
{
	const struct opts *o = sh->o;
	const struct bd_model_hparams *hp = &sh->m->hp;
	struct traj *tr = &sh->tr[t];
	struct bd_seq *s = NULL, **seqs = NULL;
	struct bd_sampler *smp = NULL;
	struct bd_sampler_params sp = o->sp;
	struct rawhook rh = { .hp = hp, .P = sh->P };
	size_t V = (size_t)sh->V;
	int r = -ENOMEM;

	sp.seed = o->sp.seed + (uint64_t)t;
	tr->kraw = malloc(sizeof(float) * (size_t)hp->n_layers * (size_t)hp->n_kv_heads *
			  (size_t)sh->P * (size_t)hp->head_dim);
	tr->run = calloc((size_t)o->n_cfg, sizeof(*tr->run));
	seqs = calloc((size_t)o->n_cfg + 1, sizeof(*seqs));
	if (!tr->kraw || !tr->run || !seqs) {
		snprintf(err, BD_MODEL_ERR_MAX, "out of memory");
		goto out;
	}
	rh.kraw = tr->kraw;
	struct bd_seq_opts so = { .max_tokens = o->ev.ctx, .mu_k = sh->mu, .dp = &sh->dp,
				  .hook = rawhook, .hook_ctx = &rh };
	if ((r = bd_sampler_new(&sp, sh->V, &smp)) < 0) {
		snprintf(err, BD_MODEL_ERR_MAX, "bad sampling parameters");
		goto out;
	}
	if ((r = bd_seq_new(sh->m, bd_kvcfg_find("bf16"), &so, &s, err)) < 0)
		goto out;
	seqs[0] = s;
	for (int ci = 0; ci < o->n_cfg; ci++) {
		if ((r = cfg_run_new(sh, o->cfg[ci], &tr->run[ci], err)) < 0)
			goto out;
		seqs[1 + ci] = tr->run[ci].s;
	}
	if ((r = bd_model_prefill_multi(sh->m, seqs, o->n_cfg + 1, tr->prompt, sh->P, tr->ref)) <
	    0) {
		snprintf(err, BD_MODEL_ERR_MAX, "prefill: %s", strerror(-r));
		goto out;
	}
	for (int k = 0; k < o->steps; k++) {
		if (k > 0 && (r = bd_model_decode(sh->m, s, tr->y[k - 1], tr->ref + (size_t)k * V)) <
				     0) {
			snprintf(err, BD_MODEL_ERR_MAX, "reference decode: %s", strerror(-r));
			goto out;
		}
		if ((r = bd_sampler_sample(smp, tr->ref + (size_t)k * V, &tr->y[k])) < 0) {
			snprintf(err, BD_MODEL_ERR_MAX, "reference sampling: non-finite logits");
			goto out;
		}
	}
out:
	if (r < 0)
		traj_free_runs(sh, t);
	free(seqs);
	bd_seq_free(s);
	bd_sampler_free(smp);
	return r;
}

/* The logit error split of the decode step that just ran at position pos, every layer and KV
 * head, added to sum. The page keys' k' = H(k − μ_k) are made here from the raw keys (the
 * prompt's kraw, then the decoded positions' kdec). */
static int qerr_step(struct qhook *h, const float *kraw, const struct bd_kvmem *mem,
		     const struct bd_seq *s, int pos, struct bd_qerr_sums *sum)
{
	const struct bd_model_hparams *hp = h->hp;
	int d = hp->head_dim, Hkv = hp->n_kv_heads, G = hp->n_heads / Hkv, r;
	const int32_t *bt = NULL;
	/* the keys bd_qerr_group reads: the full pages of pos + 1 tokens */
	size_t rows = (size_t)(pos / BD_PAGE_TOKENS) * BD_PAGE_TOKENS, D = (size_t)d;
	size_t P = (size_t)h->P;

	if ((r = bd_seq_block_table(s, &bt)) < 0)
		return r;
	float *qp = malloc(sizeof(float) * (size_t)G * D);
	float *kp = malloc(sizeof(float) * (rows > 0 ? rows : 1) * D);
	struct bd_qerr_sums *gs = calloc((size_t)G, sizeof(*gs));
	if (!qp || !kp || !gs) {
		free(qp);
		free(kp);
		free(gs);
		return -ENOMEM;
	}
	for (int l = 0; l < hp->n_layers && r >= 0; l++) {
		for (int j = 0; j < Hkv && r >= 0; j++) {
			size_t lh = (size_t)l * (size_t)Hkv + (size_t)j;
			const float *mu = h->mu ? h->mu + lh * D : NULL;
			const float *pre = kraw + lh * P * D;
			const float *dec = h->kdec + lh * (size_t)h->steps * D;
			for (size_t p = 0; p < rows && r >= 0; p++)
				r = bd_qerr_transform(h->cfg, p < P ? pre + p * D : dec + (p - P) * D,
						      mu, d, kp + p * D);
			const float *ql = h->q + ((size_t)l * (size_t)hp->n_heads + (size_t)(j * G)) * D;
			for (int g = 0; g < G && r >= 0; g++)
				r = bd_qerr_transform(h->cfg, ql + (size_t)g * D, NULL, d,
						      qp + (size_t)g * D);
			if (r < 0)
				break;
			struct bd_kv_view kv = { .lay = &mem->lay, .arena = mem->arena,
						 .block_table = bt, .slot = bd_seq_slot(s),
						 .layer = l, .kv_head = j, .n_tokens = pos + 1 };
			r = bd_qerr_group(h->cfg, &kv, qp, G, kp, 0.0f, gs);
		}
	}
	for (int g = 0; g < G && r >= 0; g++)
		bd_qerr_sums_add(sum, &gs[g]);
	free(qp);
	free(kp);
	free(gs);
	return r < 0 ? r : 0;
}

/* Configuration ci's teacher-forced steps on trajectory t: step 0 is the shared prefill's
 * logits (the reference's), steps 1.. decode the reference's tokens. Its sequence goes. */
static int run_config(struct shared *sh, int t, int ci, char *err)
{
	const struct opts *o = sh->o;
	const struct bd_kvcfg *cfg = o->cfg[ci];
	struct traj *tr = &sh->tr[t];
	struct cfg_run *cr = &tr->run[ci];
	struct result *res = &sh->res[(size_t)t * (size_t)o->n_cfg + (size_t)ci];
	struct bd_eval_acc acc = { 0 };
	size_t V = (size_t)sh->V;
	float *logits = malloc(sizeof(float) * V);
	int r = -ENOMEM;

	if (!logits) {
		snprintf(err, BD_MODEL_ERR_MAX, "out of memory");
		goto out;
	}
	for (int k = 0; k < o->steps; k++) {
		r = 0;
		if (k == 0)
			memcpy(logits, tr->ref, sizeof(float) * V);
		else
			r = bd_model_decode(sh->m, cr->s, tr->y[k - 1], logits);
		if (r < 0) {
			snprintf(err, BD_MODEL_ERR_MAX, "%s: step %d: %s", cfg->name, k,
				 strerror(-r));
			goto out;
		}
		if ((r = bd_eval_add_step(&acc, tr->ref + (size_t)k * V, logits, sh->V)) < 0) {
			snprintf(err, BD_MODEL_ERR_MAX, "%s: step %d: non-finite logits", cfg->name,
				 k);
			goto out;
		}
		if (k > 0 && k % o->qerr_every == 0 &&
		    (r = qerr_step(&cr->qh, tr->kraw, cr->mem, cr->s, sh->P + k - 1, &res->q)) <
			    0) {
			snprintf(err, BD_MODEL_ERR_MAX, "%s: step %d: logit error split: %s",
				 cfg->name, k, strerror(-r));
			goto out;
		}
	}
	struct bd_decode_stats st = bd_seq_stats(cr->s);
	res->p_blocks = st.p_blocks;
	res->p_zero = st.p_zero_blocks;
	bd_eval_means(&acc, &res->kl, &res->top1);
	r = 0;
out:
	cfg_run_free(cr);
	free(logits);
	return r;
}

/* ---- scheduling ------------------------------------------------------------------------------- */

static bool item_ready(const struct shared *sh, int i)
{
	int per = sh->o->n_cfg + 1, t = i / per, k = i % per;
	return k == 0 || sh->tr[t].ref_done;
}

static void log_run(struct shared *sh, int t, int ci, double sec)
{
	if (!sh->log)
		return;
	if (ci < 0) {
		fprintf(sh->log, "{\"traj\": %d, \"config\": \"(reference bf16)\", \"seconds\": %.2f}\n",
			t, sec);
	} else {
		const struct result *r = &sh->res[(size_t)t * (size_t)sh->o->n_cfg + (size_t)ci];
		fprintf(sh->log,
			"{\"traj\": %d, \"config\": \"%s\", \"kl\": %.9g, \"top1_mismatch\": %.6g, "
			"\"p_blocks\": %" PRIu64 ", \"p_zero_blocks\": %" PRIu64 ", \"qerr_pairs\": "
			"%" PRIu64 ", \"key_term\": %.9g, \"query_term\": %.9g, \"cross_term\": "
			"%.9g, \"seconds\": %.2f}\n",
			t, sh->o->cfg[ci]->name, r->kl, r->top1, r->p_blocks, r->p_zero, r->q.n,
			r->q.key_term, r->q.query_term, r->q.cross_term, sec);
	}
	fflush(sh->log);
}

static void *worker(void *arg)
{
	struct shared *sh = arg;
	int per = sh->o->n_cfg + 1;
	char err[BD_MODEL_ERR_MAX];

	pthread_mutex_lock(&sh->lock);
	for (;;) {
		int pick = -1;
		bool todo = false;
		for (int i = 0; i < sh->n_items && !sh->err; i++) {
			if (sh->state[i] != ITEM_TODO)
				continue;
			todo = true;
			if (item_ready(sh, i)) {
				pick = i;
				break;
			}
		}
		if (sh->err || !todo)
			break;
		if (pick < 0) {
			pthread_cond_wait(&sh->cv, &sh->lock);
			continue;
		}
		sh->state[pick] = ITEM_RUNNING;
		pthread_mutex_unlock(&sh->lock);

		int t = pick / per, ci = pick % per - 1, r;
		double t0 = bd_now_s();
		err[0] = '\0';
		r = ci < 0 ? run_reference(sh, t, err) : run_config(sh, t, ci, err);
		double sec = bd_now_s() - t0;
		if (r == 0 && ci >= 0)
			sh->res[(size_t)t * (size_t)sh->o->n_cfg + (size_t)ci].seconds = sec;

		pthread_mutex_lock(&sh->lock);
		sh->state[pick] = ITEM_DONE;
		if (r < 0 && !sh->err) {
			sh->err = r;
			snprintf(sh->errmsg, sizeof(sh->errmsg), "trajectory %d: %s", t,
				 err[0] ? err : strerror(-r));
		}
		if (r == 0) {
			log_run(sh, t, ci, sec);
			sh->done++;
			if (ci < 0) {
				sh->tr[t].ref_done = true;
			} else if (--sh->tr[t].cfg_left == 0) {
				/* every configuration has run on it: the reference's logits go */
				free(sh->tr[t].ref);
				sh->tr[t].ref = NULL;
				traj_free_runs(sh, t);
			}
			double el = bd_now_s() - sh->t0;
			double eta = el / sh->done * (sh->n_items - sh->done);
			if (sh->tty)
				fprintf(stderr,
					"\r[eval-kl] %d/%d runs (trajectory %d, %s, %.0f s); "
					"elapsed %.0f s, about %.0f s left   ",
					sh->done, sh->n_items, t,
					ci < 0 ? "reference" : sh->o->cfg[ci]->name, sec, el, eta);
			else if (ci >= 0 && sh->tr[t].cfg_left == 0)
				fprintf(stderr,
					"[eval-kl] trajectory %d done: %d/%d runs, elapsed %.0f s, "
					"about %.0f s left\n",
					t, sh->done, sh->n_items, el, eta);
		}
		pthread_cond_broadcast(&sh->cv);
	}
	pthread_cond_broadcast(&sh->cv);
	pthread_mutex_unlock(&sh->lock);
	return NULL;
}

/* ---- output -------------------------------------------------------------------------------- */

struct row {
	const char *name;
	double kl_e3, kl_se_e3, top1, t, qshare, zfrac;
	bool has_t, has_q, has_z;
};

static json_t *jnum_or_null(double x, bool ok)
{
	return ok && isfinite(x) ? json_real(x) : json_null();
}

static int print_json(const struct row *rows, int n)
{
	json_t *arr = json_array();
	if (!arr)
		return -1;
	for (int i = 0; i < n; i++) {
		json_t *obj = json_object();
		if (!obj || json_object_set_new(obj, "config", json_string(rows[i].name)) ||
		    json_object_set_new(obj, "kl_e3", jnum_or_null(rows[i].kl_e3, true)) ||
		    json_object_set_new(obj, "kl_se_e3", jnum_or_null(rows[i].kl_se_e3, true)) ||
		    json_object_set_new(obj, "top1_mismatch", jnum_or_null(rows[i].top1, true)) ||
		    json_object_set_new(obj, "paired_t", jnum_or_null(rows[i].t, rows[i].has_t)) ||
		    json_object_set_new(obj, "query_share",
					jnum_or_null(rows[i].qshare, rows[i].has_q)) ||
		    json_object_set_new(obj, "p_zero_block_frac",
					jnum_or_null(rows[i].zfrac, rows[i].has_z)) ||
		    json_array_append_new(arr, obj)) {
			json_decref(obj);
			json_decref(arr);
			return -1;
		}
	}
	int r = json_dumpf(arr, stdout, JSON_INDENT(2) | JSON_REAL_PRECISION(6));
	fputc('\n', stdout);
	json_decref(arr);
	return r;
}

static void print_table(FILE *f, const struct row *rows, int n)
{
	fprintf(f, "| config | KL x1e-3 | s.e. | top-1 mismatch | paired t vs " BASELINE
		   " | query share | zero P blocks |\n");
	fprintf(f, "| --- | --- | --- | --- | --- | --- | --- |\n");
	for (int i = 0; i < n; i++) {
		const struct row *r = &rows[i];
		char t[32] = "-", q[32] = "-", z[32] = "-";
		if (r->has_t && isfinite(r->t))
			snprintf(t, sizeof(t), "%.2f", r->t);
		if (r->has_q)
			snprintf(q, sizeof(q), "%.4f", r->qshare);
		if (r->has_z)
			snprintf(z, sizeof(z), "%.4f", r->zfrac);
		fprintf(f, "| %s | %.4g | %.2g | %.4f | %s | %s | %s |\n", r->name, r->kl_e3,
			r->kl_se_e3, r->top1, t, q, z);
	}
}

/* Means over T trajectories of res [T][n_cfg], paired t against the baseline, then the table
 * (stdout, or stderr with --json) and the JSON (stdout). Returns 0 or -1 after a message. */
static int report(const struct opts *o, const struct result *res, int T)
{
	int base = -1;
	if (o->n_cfg < 1 || o->n_cfg > BD_KVCFG_COUNT || T < 1)
		return -1;
	for (int i = 0; i < o->n_cfg; i++)
		if (strcmp(o->cfg[i]->name, BASELINE) == 0)
			base = i;
	double *a = malloc(sizeof(double) * (size_t)T), *b = malloc(sizeof(double) * (size_t)T);
	struct row *rows = calloc(BD_KVCFG_COUNT, sizeof(*rows));
	if (!a || !b || !rows) {
		free(a);
		free(b);
		free(rows);
		fprintf(stderr, "bdfp4 eval-kl: out of memory\n");
		return -1;
	}
	for (int i = 0; i < o->n_cfg; i++) {
		struct row *rw = &rows[i];
		struct bd_qerr_sums q = { 0 };
		uint64_t pb = 0, pz = 0;
		double s1 = 0.0, s2 = 0.0, tm = 0.0;
		for (int t = 0; t < T; t++) {
			const struct result *r = &res[(size_t)t * (size_t)o->n_cfg + (size_t)i];
			a[t] = r->kl;
			s1 += r->kl;
			s2 += r->kl * r->kl;
			tm += r->top1;
			pb += r->p_blocks;
			pz += r->p_zero;
			bd_qerr_sums_add(&q, &r->q);
			if (base >= 0)
				b[t] = res[(size_t)t * (size_t)o->n_cfg + (size_t)base].kl;
		}
		rw->name = o->cfg[i]->name;
		rw->kl_e3 = s1 / T * 1e3;
		double var = T > 1 ? (s2 - s1 * s1 / T) / (T - 1) : 0.0;
		rw->kl_se_e3 = T > 1 && var > 0.0 ? sqrt(var / T) * 1e3 : 0.0;
		rw->top1 = tm / T;
		rw->has_t = base >= 0 && i != base && bd_eval_paired_t(a, b, T, &rw->t) == 0;
		rw->has_q = q.key_term + q.query_term > 0.0;
		rw->qshare = rw->has_q ? q.query_term / (q.key_term + q.query_term) : 0.0;
		rw->has_z = pb > 0;
		rw->zfrac = pb ? (double)pz / (double)pb : 0.0;
	}
	free(a);
	free(b);

	FILE *tf = o->ev.json ? stderr : stdout;
	fprintf(tf, "\nKL: mean over trajectories of the mean over steps of D_t (top-%d BF16 "
		    "tokens), x1e-3 nats; s.e. over trajectories.\n",
		BD_EVAL_TOPK);
	fprintf(tf, "paired t: per-trajectory KL minus " BASELINE "'s, t over %d trajectories "
		    "(> 0: higher KL).\n",
		T);
	fprintf(tf, "query share: query/(key + query) of the logit error split over page keys at "
		    "every %d-th decode step; zero P blocks: blocks whose E4M3 scale underflowed.\n\n",
		o->qerr_every);
	print_table(tf, rows, o->n_cfg);
	int r = 0;
	if (o->ev.json && print_json(rows, o->n_cfg) < 0) {
		fprintf(stderr, "bdfp4 eval-kl: cannot write JSON\n");
		r = -1;
	}
	free(rows);
	return r;
}

/* --summarize: the report of the trajectories of a --log file on which every configuration of
 * the list finished (a run cut short, or runs split over several invocations). */
struct summary {
	const struct opts *o;
	const char *path;
	struct result *res;   /* [n_traj][n_cfg] */
	unsigned char *have;  /* [n_traj][n_cfg] */
	int n_traj;
};

static int summary_record(void *ctx, json_t *j, int lineno)
{
	struct summary *S = ctx;
	const struct opts *o = S->o;
	json_t *jt = json_object_get(j, "traj"), *jc = json_object_get(j, "config");
	if (!j || !json_is_integer(jt) || !json_is_string(jc)) {
		fprintf(stderr, "bdfp4 eval-kl: %s:%d: not a run record\n", S->path, lineno);
		return -1;
	}
	json_int_t t = json_integer_value(jt);
	int ci = -1;
	for (int i = 0; i < o->n_cfg; i++)
		if (strcmp(o->cfg[i]->name, json_string_value(jc)) == 0)
			ci = i;
	if (ci < 0 || t < 0 || t >= (1 << 20)) /* a reference run, or not in the list */
		return 0;
	if (t >= S->n_traj) {
		int n = (int)t + 1;
		struct result *r2 = realloc(S->res, sizeof(*S->res) * (size_t)n * (size_t)o->n_cfg);
		unsigned char *h2 = r2 ? realloc(S->have, (size_t)n * (size_t)o->n_cfg) : NULL;
		if (r2)
			S->res = r2;
		if (!r2 || !h2) {
			fprintf(stderr, "bdfp4 eval-kl: out of memory\n");
			return -1;
		}
		S->have = h2;
		memset(S->have + (size_t)S->n_traj * (size_t)o->n_cfg, 0,
		       (size_t)(n - S->n_traj) * (size_t)o->n_cfg);
		S->n_traj = n;
	}
	S->res[(size_t)t * (size_t)o->n_cfg + (size_t)ci] = (struct result){
		.kl = json_number_value(json_object_get(j, "kl")),
		.top1 = json_number_value(json_object_get(j, "top1_mismatch")),
		.p_blocks = (uint64_t)json_integer_value(json_object_get(j, "p_blocks")),
		.p_zero = (uint64_t)json_integer_value(json_object_get(j, "p_zero_blocks")),
		.q = { .n = (uint64_t)json_integer_value(json_object_get(j, "qerr_pairs")),
		       .key_term = json_number_value(json_object_get(j, "key_term")),
		       .query_term = json_number_value(json_object_get(j, "query_term")),
		       .cross_term = json_number_value(json_object_get(j, "cross_term")) },
	};
	S->have[(size_t)t * (size_t)o->n_cfg + (size_t)ci] = 1;
	return 0;
}

static int summarize(const struct opts *o, const char *path)
{
	struct summary S = { .o = o, .path = path };
	int rc = -1;

	if (cli_eval_read_log("eval-kl", path, summary_record, &S) < 0)
		goto out;
	/* keep the complete trajectories, in order */
	int T = 0;
	for (int t = 0; t < S.n_traj; t++) {
		bool all = true;
		for (int i = 0; i < o->n_cfg; i++)
			all = all && S.have[(size_t)t * (size_t)o->n_cfg + (size_t)i];
		if (!all)
			continue;
		memmove(S.res + (size_t)T * (size_t)o->n_cfg, S.res + (size_t)t * (size_t)o->n_cfg,
			sizeof(*S.res) * (size_t)o->n_cfg);
		T++;
	}
	fprintf(o->ev.json ? stderr : stdout,
		"eval-kl summary of %s: %d trajectories on which all %d configurations ran (of %d "
		"seen)\n",
		path, T, o->n_cfg, S.n_traj);
	if (T == 0)
		fprintf(stderr, "bdfp4 eval-kl: no complete trajectory in %s\n", path);
	else
		rc = report(o, S.res, T);
out:
	free(S.res);
	free(S.have);
	return rc;
}

/* ---- the command ---------------------------------------------------------------------------- */

static void usage(FILE *f)
{
	cli_eval_usage_head(f, "eval-kl",
			    "Teacher-forced KL of KV cache configurations against BF16 KV on prompts cut from\n"
			    "the TEXT files (NUMERICS.md section 10).\n");
	fprintf(f,
		"  --kv LIST           comma-separated configurations (default: all of them);\n"
		"                      NAME:norm=qmass for the quantized-mass normalization,\n"
		"                      emu-* for the emulated K/V formats of bd_kvemul.h\n"
		"  --ctx N             context: prompt + decoded tokens (default %d)\n"
		"  --steps N           compared steps per trajectory, the prefill's included\n"
		"                      (default 64)\n"
		"  --trajectories T    prompts (default 16)\n"
		"  --temperature T     reference sampler temperature, 0 = greedy (default 0)\n"
		"  --seed S            reference sampler seed (trajectory t uses S + t; default 0)\n"
		"  --qerr-every N      logit error split every N decode steps (default 16)\n",
		CLI_DEFAULT_CTX);
	cli_eval_usage_tail(f, "run",
			    "the trajectories of a --log file\n"
			    "                      on which every configuration of --kv finished");
}

int cmd_eval_kl(int argc, char **argv)
{
	enum {
		O_STEPS = 256, O_TRAJ, O_QERR
	};
	static const struct option lopts[] = {
		CLI_OPTS_EVAL,
		{ "steps", required_argument, NULL, O_STEPS },
		{ "trajectories", required_argument, NULL, O_TRAJ },
		CLI_OPT_TEMPERATURE,
		CLI_OPT_SEED,
		{ "qerr-every", required_argument, NULL, O_QERR },
		CLI_OPTS_NULL,
	};
	struct opts o = { .steps = 64, .trajectories = 16,
			  .qerr_every = 16, .sp = bd_sampler_params_greedy() };
	const struct cli_int_opt ints[] = {
		{ O_STEPS, 1, INT_MAX, &o.steps, "--steps wants an integer ≥ 1, not '%s'" },
		{ O_TRAJ, 1, 1 << 20, &o.trajectories,
		  "--trajectories wants an integer ≥ 1, not '%s'" },
		{ O_QERR, 1, INT_MAX, &o.qerr_every,
		  "--qerr-every wants an integer ≥ 1, not '%s'" },
	};
	int k;

	cli_eval_init(&o.ev, 2);
	for (int i = 0; i < BD_KVCFG_COUNT; i++)
		o.cfg[o.n_cfg++] = bd_kvcfg_get(i);
	if ((k = cli_eval_parse("eval-kl", usage, lopts, ints, sizeof(ints) / sizeof(ints[0]), argc,
				argv, &o.ev, o.cfg, &o.n_cfg, &o.sp)) >= 0)
		return k;
	if (o.ev.summary)
		return summarize(&o, o.ev.summary) < 0 ? 1 : 0;
	if (o.steps >= o.ev.ctx)
		return cli_bad_usage("eval-kl", usage, "--steps must be below --ctx%s", "");

	int rc = 1;
	struct cli_eval_input in = { 0 };
	struct shared sh = { .o = &o };
	double t_start = bd_now_s();

	pthread_mutex_init(&sh.lock, NULL);
	pthread_cond_init(&sh.cv, NULL);
	if (cli_eval_load("eval-kl", &o.ev, &in) < 0)
		goto out;
	const struct bd_model *m = in.m;
	const struct bd_calib *cal = in.cal;
	const struct bd_model_hparams *hp = &m->hp;
	const char *model_path = in.model_path;
	size_t n_stream = in.n_stream;
	const int32_t *stream = in.stream;
	sh.P = o.ev.ctx - o.steps + 1;
	sh.V = hp->n_vocab;
	int T = o.trajectories;
	if (n_stream < (size_t)sh.P) {
		fprintf(stderr,
			"bdfp4 eval-kl: the texts hold %zu tokens; a prompt needs %d (--ctx %d, "
			"--steps %d): give more text\n",
			n_stream, sh.P, o.ev.ctx, o.steps);
		goto out;
	}
	double stride = T > 1 ? (double)(n_stream - (size_t)sh.P) / (double)(T - 1) : 0.0;

	sh.m = m;
	sh.mu = cal ? cal->mu_k : NULL;
	cli_eval_decode_params(cal, &sh.dp);
	sh.n_items = T * (o.n_cfg + 1);
	sh.tr = calloc((size_t)T, sizeof(*sh.tr));
	sh.res = calloc((size_t)T * (size_t)o.n_cfg, sizeof(*sh.res));
	sh.state = calloc((size_t)sh.n_items, sizeof(*sh.state));
	if (!sh.tr || !sh.res || !sh.state)
		goto oom;
	for (int t = 0; t < T; t++) {
		sh.tr[t].prompt = stream + (size_t)floor(stride * t);
		sh.tr[t].cfg_left = o.n_cfg;
		sh.tr[t].y = malloc(sizeof(int32_t) * (size_t)o.steps);
		sh.tr[t].ref = malloc(sizeof(float) * (size_t)o.steps * (size_t)sh.V);
		if (!sh.tr[t].y || !sh.tr[t].ref)
			goto oom;
	}

	FILE *info = o.ev.json ? stderr : stdout;
	fprintf(info, "eval-kl: %s, ctx %d (prompt %d tokens + %d decoded), %d steps compared per "
		      "trajectory, %d trajectories\n",
		model_path, o.ev.ctx, sh.P, o.steps - 1, o.steps, T);
	if (o.sp.temperature == 0.0f || o.sp.top_k == 1)
		fprintf(info, "reference: bf16 KV, greedy\n");
	else
		fprintf(info, "reference: bf16 KV, sampled at temperature %g, seed %" PRIu64 " + t\n",
			(double)o.sp.temperature, o.sp.seed);
	cli_eval_print_inputs(info, &in, &o.ev);
	fprintf(info, "; windows every %.0f tokens%s\n", stride,
		T > 1 && stride < sh.P ? " (they overlap: give more text for disjoint prompts)" : "");
	fflush(info);

	if (cli_eval_open_log("eval-kl", o.ev.log, &sh.log) < 0)
		goto out;
	sh.tty = isatty(STDERR_FILENO);
	sh.t0 = bd_now_s();
	int n_th = cli_eval_threads("eval-kl", o.ev.threads, worker, &sh);
	if (n_th < 0)
		goto out;
	if (sh.tty)
		fputc('\n', stderr);
	if (sh.err) {
		fprintf(stderr, "bdfp4 eval-kl: %s\n", sh.errmsg);
		goto out;
	}

	fprintf(o.ev.json ? stderr : stdout, "\nwall time %.0f s (%d threads)\n", bd_now_s() - t_start,
		n_th);
	if (report(&o, sh.res, T) < 0)
		goto out;
	rc = 0;
	goto out;
oom:
	fprintf(stderr, "bdfp4 eval-kl: out of memory\n");
out:
	if (sh.log)
		fclose(sh.log);
	for (int t = 0; sh.tr && t < o.trajectories; t++) {
		free(sh.tr[t].y);
		free(sh.tr[t].ref);
		traj_free_runs(&sh, t); /* a run stopped by another's error */
	}
	free(sh.tr);
	free(sh.res);
	free(sh.state);
	cli_eval_input_free(&in);
	pthread_mutex_destroy(&sh.lock);
	pthread_cond_destroy(&sh.cv);
	return rc;
}
