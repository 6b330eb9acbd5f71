/* quant_report.c — `bdfp4 quant-report`: the paper's error analysis (BitDecoding-FP4 §3.1–3.3,
 * Eq. 2), runnable, for every configuration of NUMERICS.md §9.
 *
 * Each trial is one synthetic GQA decode problem (one KV head, G query heads, ctx tokens). Its
 * KV is written through the real write path (bd_kv_write_token, bd_page_promote into pages of a
 * block table) and decoded by the CPU reference decoder; the logit error split comes from
 * bd_qerr_group, the output error from bd_attn_exact_f64 on the unquantized FP32 q, k, v.
 *
 * The synthetic problem (fixed before looking at any result, not tuned):
 * - keys k_t,c = b_c + σ_c·z: a static per-channel bias b_c = ±U(1, 3); d/32 outlier channels
 *   (4 of 128) have a bias 10–20× larger (b_c·U(10, 20)) and a larger per-token spread σ_c = 2
 *   (σ_c = 1 elsewhere), i.e. fixed channels of large, mostly static magnitude, the structure
 *   that smoothing (k − μ_k) and the Hadamard rotation address (paper §3.3);
 * - values: i.i.d. N(0, 1);
 * - 4 "needle" tokens at uniform random positions; query head g is q_g = a_g·(Σ_j w_gj·(k_nj − b)
 *   + η_g), w_gj ~ U(0.25, 1), η_g,c ~ σ_c·N(0, 1), the content part of keys, so that attention
 *   is peaked on the needles with a long tail over the rest; a_g sets the natural-log logit
 *   spread over non-needle keys, sqrt(Σ_c q_c²σ_c²/d), to U(1.5, 3) (heads differ in sharpness);
 * - μ_k for smoothing: the per-channel mean of the problem's keys, i.e. the calibrated mean
 *   under a stationary key distribution (NUMERICS.md §7 calibrates it on other text);
 * - FP8 scales: amax/448 of the problem's K and V.
 *
 * Random numbers: xoshiro256** seeded through splitmix64 from (seed, trial index), normals by
 * Box–Muller (FP64). Each trial has its own stream, so results do not depend on --threads.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "quant/bd_attn_ref.h"
#include "quant/bd_kvcfg.h"
#include "quant/bd_layout.h"
#include "quant/bd_qerr.h"
#include "base/bd_rand.h"
#include "cli.h"

#define N_NEEDLES 4

struct opts {
	bool json;
	int ctx, d, G, trials, threads;
	uint64_t seed;
};

/* ---- random numbers ----------------------------------------------------------------------- */

/* ---- the synthetic problem ----------------------------------------------------------------- */

struct problem {
	int n, d, G;
	float *k, *v; /* [n][d] */
	float *q;     /* [G][d] */
	float *mu;    /* [d] per-channel key mean (calibrated μ_k) */
	float fp8_scales[2];
};

static void problem_free(struct problem *p)
{
	free(p->k);
	free(p->v);
	free(p->q);
	free(p->mu);
}

static int problem_gen(struct problem *p, const struct opts *o, int trial)
{
	int n = o->ctx, d = o->d, G = o->G, needles[N_NEEDLES];
	double *bias = NULL, *sig = NULL, *acc = NULL;
	int *perm = NULL;
	struct bd_rng r;
	int ret = -ENOMEM;

	memset(p, 0, sizeof(*p));
	p->n = n;
	p->d = d;
	p->G = G;
	p->k = malloc(sizeof(float) * (size_t)n * (size_t)d);
	p->v = malloc(sizeof(float) * (size_t)n * (size_t)d);
	p->q = malloc(sizeof(float) * (size_t)G * (size_t)d);
	p->mu = malloc(sizeof(float) * (size_t)d);
	bias = malloc(sizeof(double) * (size_t)d);
	sig = malloc(sizeof(double) * (size_t)d);
	acc = malloc(sizeof(double) * (size_t)d);
	perm = malloc(sizeof(int) * (size_t)d);
	if (!p->k || !p->v || !p->q || !p->mu || !bias || !sig || !acc || !perm)
		goto out;

	bd_rng_seed(&r, o->seed, (uint64_t)trial);
	for (int c = 0; c < d; c++) {
		bias[c] = (bd_rng_u64(&r) & 1 ? 1.0 : -1.0) * (1.0 + 2.0 * bd_rng_uniform(&r));
		sig[c] = 1.0;
		perm[c] = c;
	}
	/* outlier channels: the first d/32 of a partial Fisher–Yates shuffle */
	for (int i = 0; i < d / 32; i++) {
		int j = i + (int)(bd_rng_uniform(&r) * (double)(d - i));
		int t = perm[i];

		perm[i] = perm[j];
		perm[j] = t;
		bias[perm[i]] *= 10.0 + 10.0 * bd_rng_uniform(&r);
		sig[perm[i]] = 2.0;
	}

	double amax_k = 0.0, amax_v = 0.0;
	for (int c = 0; c < d; c++)
		acc[c] = 0.0;
	for (int t = 0; t < n; t++) {
		float *kt = p->k + (size_t)t * (size_t)d;

		for (int c = 0; c < d; c++) {
			kt[c] = (float)(bias[c] + sig[c] * bd_rng_normal(&r));
			acc[c] += kt[c];
			amax_k = fmax(amax_k, fabs(kt[c]));
		}
	}
	for (size_t i = 0; i < (size_t)n * (size_t)d; i++) {
		p->v[i] = (float)bd_rng_normal(&r);
		amax_v = fmax(amax_v, fabs(p->v[i]));
	}
	for (int c = 0; c < d; c++)
		p->mu[c] = (float)(acc[c] / n);
	p->fp8_scales[0] = (float)(amax_k / 448.0);
	p->fp8_scales[1] = (float)(amax_v / 448.0);

	for (int j = 0; j < N_NEEDLES; j++) {
		bool dup;

		do {
			needles[j] = (int)(bd_rng_uniform(&r) * n);
			dup = false;
			for (int i = 0; i < j; i++)
				dup |= needles[i] == needles[j] && n > N_NEEDLES;
		} while (dup);
	}
	for (int g = 0; g < G; g++) {
		float *q = p->q + (size_t)g * (size_t)d;
		double var = 0.0, spread, a;

		for (int c = 0; c < d; c++)
			acc[c] = sig[c] * bd_rng_normal(&r);
		for (int j = 0; j < N_NEEDLES; j++) {
			double w = 0.25 + 0.75 * bd_rng_uniform(&r);
			const float *kn = p->k + (size_t)needles[j] * (size_t)d;

			for (int c = 0; c < d; c++)
				acc[c] += w * ((double)kn[c] - bias[c]);
		}
		for (int c = 0; c < d; c++)
			var += acc[c] * acc[c] * sig[c] * sig[c];
		spread = 1.5 + 1.5 * bd_rng_uniform(&r);
		a = spread * sqrt((double)d) / sqrt(var);
		for (int c = 0; c < d; c++)
			q[c] = (float)(a * acc[c]);
	}
	ret = 0;
out:
	free(bias);
	free(sig);
	free(acc);
	free(perm);
	if (ret < 0)
		problem_free(p);
	return ret;
}

/* ---- one trial ----------------------------------------------------------------------------- */

struct cfg_result {
	struct bd_qerr_sums sums; /* over the G heads */
	struct bd_decode_stats stats;
	double rel_err;           /* mean over heads of ‖o − o_exact‖/‖o_exact‖ */
};

struct trial_result {
	int rc;
	struct cfg_result cfg[BD_KVCFG_COUNT];
};

/* Configurations with the same page format, smoothing, rotation and key search write the
 * same cache; the sink changes only what decode reads. */
static bool same_cache(const struct bd_kvcfg *a, const struct bd_kvcfg *b)
{
	return a->page_fmt == b->page_fmt && a->smoothing == b->smoothing &&
	       a->hadamard == b->hadamard && a->key_search == b->key_search;
}

struct cache {
	struct bd_layout lay;
	void *arena, *slot;
	int32_t *bt;
	float *kref; /* [128·n_full][d] transformed FP32 reference keys */
};

static void cache_free(struct cache *c)
{
	free(c->arena);
	free(c->slot);
	free(c->bt);
	free(c->kref);
}

static int cache_build(struct cache *c, const struct bd_kvcfg *cfg, const struct problem *p)
{
	int n_full = (p->n - 1) / BD_PAGE_TOKENS, d = p->d, r;
	size_t n_pages = n_full > 0 ? (size_t)n_full : 1;
	const float *mu = cfg->smoothing ? p->mu : NULL;

	memset(c, 0, sizeof(*c));
	r = bd_layout_init(&c->lay, cfg->page_fmt, 1, 1, d, 0, n_pages);
	if (r < 0)
		return r;
	c->arena = aligned_alloc(BD_PAGE_ALIGN, c->lay.arena_bytes);
	c->slot = aligned_alloc(BD_PAGE_ALIGN, c->lay.slot_bytes);
	c->bt = malloc(sizeof(*c->bt) * n_pages);
	c->kref = malloc(sizeof(float) * (size_t)n_full * BD_PAGE_TOKENS * (size_t)d + 1);
	if (!c->arena || !c->slot || !c->bt || !c->kref)
		return -ENOMEM;
	memset(c->slot, 0, c->lay.slot_bytes);
	for (size_t i = 0; i < n_pages; i++)
		c->bt[i] = (int32_t)i;
	for (int t = 0; t < p->n; t++) {
		const float *k = p->k + (size_t)t * (size_t)d;

		r = bd_kv_write_token(&c->lay, cfg, c->slot, 0, 0, t, k, p->v + (size_t)t * (size_t)d,
				      mu);
		if (r < 0)
			return r;
		if (t / BD_PAGE_TOKENS < n_full) {
			r = bd_qerr_transform(cfg, k, mu, d, c->kref + (size_t)t * (size_t)d);
			if (r < 0)
				return r;
			/* promote after the token that fills the page, as the server does */
			if (t % BD_PAGE_TOKENS == BD_PAGE_TOKENS - 1) {
				r = bd_page_promote(&c->lay, cfg,
						    cfg->page_fmt == BD_PAGE_FP8 ? p->fp8_scales : NULL,
						    c->slot, c->arena,
						    c->bt[t / BD_PAGE_TOKENS]);
				if (r < 0)
					return r;
			}
		}
	}
	return 0;
}

static int run_cfg(const struct bd_kvcfg *cfg, const struct cache *c, const struct problem *p,
		   const double *o_exact, float *scratch, struct cfg_result *res)
{
	struct bd_decode_params dp = bd_decode_params_default();
	struct bd_kv_view kv = { .lay = &c->lay, .arena = c->arena, .block_table = c->bt,
				 .slot = c->slot, .layer = 0, .kv_head = 0, .n_tokens = p->n };
	struct bd_qerr_sums sums[64] = { 0 }; /* G ≤ 64, checked at parsing */
	int d = p->d, G = p->G, r;
	float *qp = scratch, *o = scratch + (size_t)G * (size_t)d;

	for (int g = 0; g < G; g++) {
		r = bd_qerr_transform(cfg, p->q + (size_t)g * (size_t)d, NULL, d,
				      qp + (size_t)g * (size_t)d);
		if (r < 0)
			return r;
	}
	r = bd_qerr_group(cfg, &kv, qp, G, c->kref, 0.0f, sums);
	if (r < 0)
		return r;
	r = bd_ref_decode_gqa(cfg, &dp, &kv, p->q, G, o, NULL, &res->stats);
	if (r < 0)
		return r;
	res->rel_err = 0.0;
	for (int g = 0; g < G; g++) {
		const double *ex = o_exact + (size_t)g * (size_t)d;
		double num = 0.0, den = 0.0;

		bd_qerr_sums_add(&res->sums, &sums[g]);
		for (int i = 0; i < d; i++) {
			double e = (double)o[(size_t)g * (size_t)d + (size_t)i] - ex[i];

			num += e * e;
			den += ex[i] * ex[i];
		}
		res->rel_err += sqrt(num / den) / G;
	}
	return 0;
}

static int run_trial(const struct opts *o, int trial, struct trial_result *res)
{
	struct problem p;
	double *o_exact = NULL;
	float *scratch = NULL;
	bool done[BD_KVCFG_COUNT] = { false };
	int r;

	memset(res, 0, sizeof(*res));
	r = problem_gen(&p, o, trial);
	if (r < 0)
		return r;
	o_exact = malloc(sizeof(double) * (size_t)o->G * (size_t)o->d);
	scratch = malloc(sizeof(float) * 2 * (size_t)o->G * (size_t)o->d);
	if (!o_exact || !scratch) {
		r = -ENOMEM;
		goto out;
	}
	for (int g = 0; g < o->G; g++) {
		r = bd_attn_exact_f64(p.q + (size_t)g * (size_t)o->d, p.k, p.v, p.n, p.d, p.d, 0.0,
				      o_exact + (size_t)g * (size_t)o->d);
		if (r < 0)
			goto out;
	}
	for (int i = 0; i < BD_KVCFG_COUNT; i++) {
		const struct bd_kvcfg *rep = bd_kvcfg_get(i);
		struct cache c;

		if (done[i])
			continue;
		r = cache_build(&c, rep, &p);
		for (int j = i; r == 0 && j < BD_KVCFG_COUNT; j++) {
			const struct bd_kvcfg *cfg = bd_kvcfg_get(j);

			if (done[j] || !same_cache(rep, cfg))
				continue;
			r = run_cfg(cfg, &c, &p, o_exact, scratch, &res->cfg[j]);
			done[j] = true;
		}
		cache_free(&c);
		if (r < 0)
			goto out;
	}
out:
	free(o_exact);
	free(scratch);
	problem_free(&p);
	return r;
}

struct pool {
	const struct opts *o;
	struct trial_result *res;
	atomic_int next;
};

static void *worker(void *arg)
{
	struct pool *pl = arg;
	int t;

	while ((t = atomic_fetch_add(&pl->next, 1)) < pl->o->trials)
		pl->res[t].rc = run_trial(pl->o, t, &pl->res[t]);
	return NULL;
}

/* ---- summary ------------------------------------------------------------------------------- */

struct summary {
	const char *name;
	double logit_mse, key_term, query_term, cross_term, query_share, p_zero_frac;
	double rel_err, ci_lo, ci_hi; /* ci: NAN with one trial */
};

/* Two-sided 95 % Student t quantile t_{0.975, ν}: table for ν ≤ 30, beyond it the
 * Cornish–Fisher expansion around z = 1.959964 (error < 1e-3). */
static double t975(int nu)
{
	static const double tab[31] = { NAN,   12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365,
					2.306, 2.262,  2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
					2.120, 2.110,  2.101, 2.093, 2.086, 2.080, 2.074, 2.069,
					2.064, 2.060,  2.056, 2.052, 2.048, 2.045, 2.042 };
	double z = 1.959964, v = nu;

	if (nu <= 30)
		return tab[nu < 1 ? 0 : nu];
	return z + (z * z * z + z) / (4 * v) +
	       (5 * pow(z, 5) + 16 * pow(z, 3) + 3 * z) / (96 * v * v);
}

static void summarize(const struct opts *o, const struct trial_result *res,
		      struct summary *ret)
{
	for (int i = 0; i < BD_KVCFG_COUNT; i++) {
		struct bd_qerr_sums s = { 0 };
		uint64_t blocks = 0, zero = 0;
		double mean = 0.0, ss = 0.0;
		struct summary *out = &ret[i];

		for (int t = 0; t < o->trials; t++) {
			bd_qerr_sums_add(&s, &res[t].cfg[i].sums);
			blocks += res[t].cfg[i].stats.p_blocks;
			zero += res[t].cfg[i].stats.p_zero_blocks;
			mean += res[t].cfg[i].rel_err;
		}
		mean /= o->trials;
		for (int t = 0; t < o->trials; t++)
			ss += (res[t].cfg[i].rel_err - mean) * (res[t].cfg[i].rel_err - mean);

		double n = s.n ? (double)s.n : NAN;
		*out = (struct summary){
			.name = bd_kvcfg_get(i)->name,
			.logit_mse = s.sq_err / n,
			.key_term = s.key_term / n,
			.query_term = s.query_term / n,
			.cross_term = s.cross_term / n,
			.query_share = s.key_term + s.query_term > 0.0
					       ? s.query_term / (s.key_term + s.query_term)
					       : 0.0,
			.p_zero_frac = blocks ? (double)zero / (double)blocks : 0.0,
			.rel_err = mean,
			.ci_lo = NAN,
			.ci_hi = NAN,
		};
		/* per-trial means are independent (heads of one trial share the KV) */
		if (o->trials > 1) {
			double half = t975(o->trials - 1) * sqrt(ss / (o->trials - 1) / o->trials);

			out->ci_lo = mean - half;
			out->ci_hi = mean + half;
		}
	}
}

static void print_table(FILE *f, const struct opts *o, const struct summary *s)
{
	fprintf(f,
		"quant-report: ctx %d, d %d, G %d, %d trials, seed %" PRIu64 ".\n"
		"Logit terms: nats^2, mean over page keys, heads and trials (Eq. 2: mse = key + "
		"query + cross); query_share = query/(key + query).\n"
		"p_zero_block_frac: P blocks whose E4M3 scale underflowed to 0, over all P blocks.\n"
		"out_rel_err: |o - o_exact|/|o_exact|, mean over trials and heads; 95%% CI: Student t "
		"over the per-trial means.\n\n",
		o->ctx, o->d, o->G, o->trials, o->seed);
	fprintf(f, "| config | logit_mse | key_term | query_term | cross_term | query_share | "
		   "p_zero_block_frac | out_rel_err | 95%% CI |\n");
	fprintf(f, "| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
	for (int i = 0; i < BD_KVCFG_COUNT; i++)
		fprintf(f,
			"| %s | %.4g | %.4g | %.4g | %.3g | %.4f | %.4f | %.4g | [%.4g, %.4g] |\n",
			s[i].name, s[i].logit_mse, s[i].key_term, s[i].query_term, s[i].cross_term,
			s[i].query_share, s[i].p_zero_frac, s[i].rel_err, s[i].ci_lo, s[i].ci_hi);
}

/* a JSON number, or null for a NaN (no page keys, a single trial) */
static json_t *jnum(double x)
{
	return isfinite(x) ? json_real(x) : json_null();
}

static int print_json(FILE *f, const struct summary *s)
{
	json_t *arr = json_array();
	int r = -ENOMEM;

	if (!arr)
		return -ENOMEM;
	for (int i = 0; i < BD_KVCFG_COUNT; i++) {
		json_t *ci = json_array(), *obj = json_object();

		if (!ci || !obj || json_array_append_new(ci, jnum(s[i].ci_lo)) ||
		    json_array_append_new(ci, jnum(s[i].ci_hi))) {
			json_decref(ci);
			json_decref(obj);
			goto out;
		}
		if (json_object_set_new(obj, "config", json_string(s[i].name)) ||
		    json_object_set_new(obj, "logit_mse", jnum(s[i].logit_mse)) ||
		    json_object_set_new(obj, "key_term", jnum(s[i].key_term)) ||
		    json_object_set_new(obj, "query_term", jnum(s[i].query_term)) ||
		    json_object_set_new(obj, "query_share", jnum(s[i].query_share)) ||
		    json_object_set_new(obj, "p_zero_block_frac", jnum(s[i].p_zero_frac)) ||
		    json_object_set_new(obj, "out_rel_err", jnum(s[i].rel_err)) ||
		    json_object_set_new(obj, "out_rel_err_ci95", ci) ||
		    json_array_append_new(arr, obj)) {
			json_decref(obj);
			goto out;
		}
	}
	if (json_dumpf(arr, f, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(6)) < 0)
		goto out;
	fputc('\n', f);
	r = 0;
out:
	json_decref(arr);
	return r;
}

/* ---- command line -------------------------------------------------------------------------- */

static void usage(FILE *f)
{
	fprintf(f,
		"usage: bdfp4 quant-report [--json] [--ctx N] [--d D] [--group G] [--trials T]\n"
		"                          [--seed S] [--threads J]\n"
		"Logit error split (paper Eq. 2), probability underflow and output error of every\n"
		"KV configuration on T synthetic GQA decode problems (one KV head, G query heads).\n"
		"  --json       JSON array on stdout (the table then goes to stderr)\n"
		"  --ctx N      context tokens, 145..4194304 (default 32768)\n"
		"  --d D        head dim, a power of two 32..1024 (default 128)\n"
		"  --group G    query heads per KV head, 1..64 (default 4)\n"
		"  --trials T   independent problems, 1..100000 (default 32)\n"
		"  --seed S     64-bit seed (default 1)\n"
		"  --threads J  worker threads, 1..256 (default 2); results do not depend on it\n");
}

static int parse_opts(int argc, char **argv, struct opts *o)
{
	static const struct option longopts[] = {
		{ "json", no_argument, NULL, 'j' },     { "ctx", required_argument, NULL, 'n' },
		{ "d", required_argument, NULL, 'd' },  { "group", required_argument, NULL, 'g' },
		{ "trials", required_argument, NULL, 't' }, { "seed", required_argument, NULL, 's' },
		{ "threads", required_argument, NULL, 'p' }, CLI_OPTS_END,
	};
	int c;

	*o = (struct opts){ .ctx = 32768, .d = 128, .G = 4, .trials = 32, .seed = 1, .threads = 2 };
	optind = 1;
	while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
		bool ok = true;
		char *end;

		switch (c) {
		case 'j':
			o->json = true;
			break;
		case 'n':
			ok = cli_parse_int(optarg, BD_PAGE_TOKENS + BD_SINK_TOKENS + 1, 1L << 22, &o->ctx);
			break;
		case 'd':
			ok = cli_parse_int(optarg, 32, BD_FWHT_MAX, &o->d) && (o->d & (o->d - 1)) == 0;
			break;
		case 'g':
			ok = cli_parse_int(optarg, 1, 64, &o->G);
			break;
		case 't':
			ok = cli_parse_int(optarg, 1, 100000, &o->trials);
			break;
		case 's':
			errno = 0;
			o->seed = strtoull(optarg, &end, 0);
			ok = !errno && end != optarg && !*end && optarg[0] != '-';
			break;
		case 'p':
			ok = cli_parse_int(optarg, 1, 256, &o->threads);
			break;
		case 'h':
			usage(stdout);
			return 1;
		default:
			ok = false;
		}
		if (!ok) {
			if (c != '?')
				fprintf(stderr, "bdfp4 quant-report: bad value '%s'\n", optarg);
			usage(stderr);
			return -EINVAL;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "bdfp4 quant-report: unexpected argument '%s'\n", argv[optind]);
		usage(stderr);
		return -EINVAL;
	}
	return 0;
}

int cmd_quant_report(int argc, char **argv)
{
	struct summary sum[BD_KVCFG_COUNT];
	struct opts o;
	struct pool pl;
	struct timespec t0, t1;
	pthread_t *th;
	int r, nth, started = 0;

	r = parse_opts(argc, argv, &o);
	if (r != 0)
		return r > 0 ? 0 : 2;

	pl.o = &o;
	pl.res = calloc((size_t)o.trials, sizeof(*pl.res));
	nth = o.threads < o.trials ? o.threads : o.trials;
	th = calloc((size_t)nth, sizeof(*th));
	if (!pl.res || !th) {
		fprintf(stderr, "bdfp4 quant-report: out of memory\n");
		free(pl.res);
		free(th);
		return 1;
	}
	atomic_init(&pl.next, 0);
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (int i = 0; i < nth; i++) {
		if (pthread_create(&th[i], NULL, worker, &pl) != 0)
			break;
		started++;
	}
	if (started == 0)
		worker(&pl); /* no thread could start: run here */
	for (int i = 0; i < started; i++)
		pthread_join(th[i], NULL);
	clock_gettime(CLOCK_MONOTONIC, &t1);
	free(th);

	for (int t = 0; t < o.trials; t++) {
		if (pl.res[t].rc < 0) {
			fprintf(stderr, "bdfp4 quant-report: trial %d failed: %s\n", t,
				strerror(-pl.res[t].rc));
			free(pl.res);
			return 1;
		}
	}
	summarize(&o, pl.res, sum);
	free(pl.res);

	print_table(o.json ? stderr : stdout, &o, sum);
	fflush(stdout);
	if (o.json && print_json(stdout, sum) < 0) {
		fprintf(stderr, "bdfp4 quant-report: cannot write JSON\n");
		return 1;
	}
	fprintf(stderr, "quant-report: %d trials of %d tokens in %.1f s on %d threads\n", o.trials,
		o.ctx, (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9,
		started ? started : 1);
	return 0;
}
