/* bench_ref.c — timing of the CPU reference decoder (bd_ref_decode_gqa) for bf16, nvfp4-base
 * and bitdecoding-nvfp4 at 4K and 32K tokens, G = 4, d = 128, one KV head.
 *
 * usage: bench_ref [--repeats N] [--out FILE]
 * Every case is validated before it is timed: the output must be finite and within a loose
 * relative bound of bd_attn_exact_f64 (0.05 for bf16, 0.5 for the FP4 configurations). Each
 * time is the median of N ≥ 5 single-threaded calls (CLOCK_MONOTONIC), after one warm-up call.
 * keys/s counts the KV head's keys (each serves G query heads); bytes is the KV data one decode
 * reads: the full pages' codes, block scales and decode scales, plus the BF16 recent (and sink)
 * tokens. A markdown table goes to stdout, and with --out it is appended to FILE under a heading
 * with the date, machine and commit (BD_COMMIT, else `git rev-parse --short HEAD`, else
 * "unknown").
 *
 * Data: keys with a per-channel bias ±U(1, 3), 4 outlier channels at 10–20× and N(0, 1) noise,
 * values N(0, 1), each query head peaked on one random key, whose logit lies 10 nats above the
 * mean logit (tests/common/testgen.h, fixed seed).
 */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/bd_clock.h"
#include "quant/bd_attn_ref.h"
#include "quant/bd_kvcfg.h"
#include "quant/bd_layout.h"
#include "bench_info.h"
#include "testgen.h"

#define D 128
#define G 4
#define MAX_REPEATS 101

static const int contexts[] = { 4096, 32768 };
static const char *const cfg_names[] = { "bf16", "nvfp4-base", "bitdecoding-nvfp4" };

struct data {
	int n;
	float *k, *v, *q, *mu;
};

static int data_gen(struct data *x, int n, uint64_t seed)
{
	struct tg_rng r = { seed };
	double bias[D];

	x->n = n;
	x->k = malloc(sizeof(float) * (size_t)n * D);
	x->v = malloc(sizeof(float) * (size_t)n * D);
	x->q = malloc(sizeof(float) * G * D);
	x->mu = calloc(D, sizeof(float));
	if (!x->k || !x->v || !x->q || !x->mu)
		return -ENOMEM;
	for (int c = 0; c < D; c++)
		bias[c] = (tg_next(&r) & 1 ? 1.0 : -1.0) * (1.0 + 2.0 * tg_uniform(&r)) *
			  (c % 32 == 7 ? 10.0 + 10.0 * tg_uniform(&r) : 1.0);
	for (int t = 0; t < n; t++)
		for (int c = 0; c < D; c++)
			x->k[(size_t)t * D + c] = (float)(bias[c] + tg_normal(&r));
	for (size_t i = 0; i < (size_t)n * D; i++)
		x->v[i] = (float)tg_normal(&r);
	for (int c = 0; c < D; c++) {
		double m = 0.0;

		for (int t = 0; t < n; t++)
			m += x->k[(size_t)t * D + c];
		x->mu[c] = (float)(m / n);
	}
	/* q ∝ the centred key u of one random token, scaled so that ⟨q, u⟩/√d = 10 nats */
	for (int g = 0; g < G; g++) {
		const float *kn = x->k + (size_t)(tg_uniform(&r) * n) * D;
		double nrm = 0.0;

		for (int c = 0; c < D; c++)
			nrm += (kn[c] - bias[c]) * (kn[c] - bias[c]);
		for (int c = 0; c < D; c++)
			x->q[g * D + c] = (float)(10.0 * sqrt((double)D) / nrm * (kn[c] - bias[c]));
	}
	return 0;
}

static void data_free(struct data *x)
{
	free(x->k);
	free(x->v);
	free(x->q);
	free(x->mu);
}

struct cache {
	struct bd_layout lay;
	void *arena, *slot;
	int32_t *bt;
};

static int cache_build(struct cache *c, const struct bd_kvcfg *cfg, const struct data *x)
{
	int n_full = (x->n - 1) / BD_PAGE_TOKENS, r;

	memset(c, 0, sizeof(*c));
	r = bd_layout_init(&c->lay, cfg->page_fmt, 1, 1, D, 0, n_full > 0 ? (size_t)n_full : 1);
	if (r < 0)
		return r;
	c->arena = aligned_alloc(BD_PAGE_ALIGN, c->lay.arena_bytes);
	c->slot = aligned_alloc(BD_PAGE_ALIGN, c->lay.slot_bytes);
	c->bt = malloc(sizeof(int32_t) * (size_t)(n_full > 0 ? n_full : 1));
	if (!c->arena || !c->slot || !c->bt)
		return -ENOMEM;
	memset(c->slot, 0, c->lay.slot_bytes);
	for (int p = 0; p < n_full; p++)
		c->bt[p] = p;
	for (int t = 0; t < x->n; t++) {
		r = bd_kv_write_token(&c->lay, cfg, c->slot, 0, 0, t, x->k + (size_t)t * D,
				      x->v + (size_t)t * D, cfg->smoothing ? x->mu : NULL);
		if (r < 0)
			return r;
		if (t % BD_PAGE_TOKENS == BD_PAGE_TOKENS - 1 && t / BD_PAGE_TOKENS < n_full) {
			r = bd_page_promote(&c->lay, cfg, NULL, c->slot, c->arena, c->bt[t / 128]);
			if (r < 0)
				return r;
		}
	}
	return 0;
}

static void cache_free(struct cache *c)
{
	free(c->arena);
	free(c->slot);
	free(c->bt);
}

/* KV bytes one decode reads: page data (no alignment padding) and the BF16 tokens */
static double kv_bytes(const struct bd_kvcfg *cfg, const struct bd_layout *lay, int n)
{
	int n_full = (n - 1) / BD_PAGE_TOKENS, recent = n - n_full * BD_PAGE_TOKENS;
	double page = (double)(lay->k_codes_bytes + lay->k_scales_bytes + lay->v_codes_bytes +
			       lay->v_scales_bytes);

	if (lay->fmt == BD_PAGE_NVFP4 || lay->fmt == BD_PAGE_NVFP4_CH)
		page += 2 * sizeof(float); /* g_K, g_V */
	return n_full * page + (double)(recent + (cfg->sink ? BD_SINK_TOKENS : 0)) *
				       (lay->d + lay->dv) * sizeof(bd_bf16);
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return (x > y) - (x < y);
}

/* Validate, then time one case. Returns 0, 1 when validation fails, -errno. */
static int bench_case(const struct bd_kvcfg *cfg, const struct data *x, int repeats,
		      double *ret_ms, double *ret_bytes, double *ret_err)
{
	struct bd_decode_params dp = bd_decode_params_default();
	struct cache c;
	struct bd_kv_view kv;
	float o[G * D];
	double ex[D], t[MAX_REPEATS], worst = 0.0;
	int r;

	r = cache_build(&c, cfg, x);
	if (r < 0)
		goto out;
	kv = (struct bd_kv_view){ .lay = &c.lay, .arena = c.arena, .block_table = c.bt,
				  .slot = c.slot, .n_tokens = x->n };
	r = bd_ref_decode_gqa(cfg, &dp, &kv, x->q, G, o, NULL, NULL);
	if (r < 0)
		goto out;
	for (int g = 0; g < G; g++) {
		double num = 0.0, den = 0.0;

		r = bd_attn_exact_f64(x->q + g * D, x->k, x->v, x->n, D, D, 0.0, ex);
		if (r < 0)
			goto out;
		for (int i = 0; i < D; i++) {
			if (!isfinite(o[g * D + i]))
				num = INFINITY;
			num += (o[g * D + i] - ex[i]) * (o[g * D + i] - ex[i]);
			den += ex[i] * ex[i];
		}
		worst = fmax(worst, sqrt(num / den));
	}
	*ret_err = worst;
	if (!(worst <= (cfg->page_fmt == BD_PAGE_BF16 ? 0.05 : 0.5))) {
		r = 1;
		goto out;
	}
	for (int i = 0; i < repeats; i++) {
		double t0 = bd_now_s();

		r = bd_ref_decode_gqa(cfg, &dp, &kv, x->q, G, o, NULL, NULL);
		t[i] = bd_now_s() - t0;
		if (r < 0)
			goto out;
	}
	qsort(t, (size_t)repeats, sizeof(double), cmp_double);
	*ret_ms = t[repeats / 2] * 1e3;
	*ret_bytes = kv_bytes(cfg, &c.lay, x->n);
out:
	cache_free(&c);
	return r;
}

int main(int argc, char **argv)
{
	static const struct option longopts[] = {
		{ "repeats", required_argument, NULL, 'r' },
		{ "out", required_argument, NULL, 'o' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	const char *out_path = NULL;
	char table[4096];
	size_t len = 0;
	int repeats = 7, c, status = 0;

	while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
		char *end;

		switch (c) {
		case 'r':
			repeats = (int)strtol(optarg, &end, 10);
			if (*end || repeats < 5 || repeats > MAX_REPEATS) {
				fprintf(stderr, "bench_ref: --repeats takes 5..%d\n", MAX_REPEATS);
				return 2;
			}
			break;
		case 'o':
			out_path = optarg;
			break;
		case 'h':
			printf("usage: bench_ref [--repeats N (5..%d, default 7)] [--out FILE]\n",
			       MAX_REPEATS);
			return 0;
		default:
			fprintf(stderr, "usage: bench_ref [--repeats N] [--out FILE]\n");
			return 2;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "usage: bench_ref [--repeats N] [--out FILE]\n");
		return 2;
	}

	len += (size_t)snprintf(table + len, sizeof(table) - len,
				"| config | ctx | ms per decode | keys/s | KV bytes per decode | "
				"max rel err vs FP64 |\n| --- | --- | --- | --- | --- | --- |\n");
	for (size_t ci = 0; ci < sizeof(contexts) / sizeof(contexts[0]); ci++) {
		struct data x;
		int r = data_gen(&x, contexts[ci], 0x5eed + ci);

		for (size_t k = 0; r == 0 && k < sizeof(cfg_names) / sizeof(cfg_names[0]); k++) {
			const struct bd_kvcfg *cfg = bd_kvcfg_find(cfg_names[k]);
			double ms = 0, bytes = 0, err = 0;

			r = bench_case(cfg, &x, repeats, &ms, &bytes, &err);
			if (r == 1) {
				fprintf(stderr, "bench_ref: %s at %d tokens fails validation: "
						"rel err %g\n", cfg->name, x.n, err);
				status = 1;
				r = 0;
				continue;
			}
			if (r < 0)
				break;
			len += (size_t)snprintf(table + len, sizeof(table) - len,
						"| %s | %d | %.2f | %.3g | %.0f | %.3g |\n", cfg->name,
						x.n, ms, x.n / (ms * 1e-3), bytes, err);
		}
		data_free(&x);
		if (r < 0) {
			fprintf(stderr, "bench_ref: %s\n", strerror(-r));
			return 1;
		}
	}
	fputs(table, stdout);

	if (out_path) {
		struct bench_info bi;
		FILE *f = bench_results_open("bench_ref", out_path, &bi);

		if (!f)
			return 1;
		fprintf(f,
			"\n## bench_ref — CPU reference decoder, %s\n\n"
			"Machine: %s, %ld cores online; commit %s; command `bench_ref --repeats %d`; "
			"G = %d, d = %d, one KV head, B_k = 64, 1 split, single thread, median of %d.\n\n"
			"%s",
			bi.date, bi.cpu, sysconf(_SC_NPROCESSORS_ONLN), bi.commit, repeats, G, D, repeats,
			table);
		if (fclose(f) != 0) {
			fprintf(stderr, "bench_ref: %s: write failed\n", out_path);
			return 1;
		}
	}
	return status;
}
