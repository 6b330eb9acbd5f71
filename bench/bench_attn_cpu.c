/* bench_attn_cpu.c — decode attention time per generated token on the CPU, the model's shape:
 * SmolLM2-135M's 30 layers, 3 KV heads of d = 64, G = 3 (the default `make run` model), one
 * request, bf16 and bitdecoding-nvfp4 KV, the reference decoder against the SIMD path
 * (bd_attn_cpu.h) on each instruction set this CPU has.
 *
 * usage: bench_attn_cpu [--repeats N] [--contexts N,N,...] [--threads N]
 * A step is one decode call per layer over all 3 KV heads, the layers' KV in one arena as the
 * model keeps it (so a step reads every layer's pages, not one layer's from cache). Every case
 * is validated before it is timed: the SIMD output within relative L2 error 1e-3 of the
 * reference's. Times are medians of N steps after one warm-up step: with one thread (the
 * default, no pool) in the thread's CPU time (CLOCK_THREAD_CPUTIME_ID: the machine it
 * was written on is shared, so wall time would count other jobs), with --threads N > 1 in wall
 * time (CLOCK_MONOTONIC) with a pool of N threads (bd_tpool.h); a markdown table goes to
 * stdout.
 *
 * Data: tests/common/testgen.h's generator: keys N(0, 1) plus a per-channel bias N(0, 2²) and
 * 3 outlier channels at 12×, values N(0, 1) with 3 outlier channels at 8×, μ_k near the bias,
 * queries 1.5·N(0, 1) with one channel at 6× (the inputs of tests/gpu/gpu_check.c).
 */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/bd_tpool.h"
#include "quant/bd_attn_cpu.h"
#include "quant/bd_attn_ref.h"
#include "testgen.h"

#define L 30
#define HKV 3
#define G 3
#define D 64
#define MAX_REPEATS 101

/* The KV of a context of n tokens (testgen.h): L layers, HKV heads of D, queries of every
 * layer [L][HKV][G][D]. */
static int kv_build(struct tg_paged *x, const struct bd_kvcfg *cfg, int n, uint64_t seed)
{
	return tg_paged_build(x, cfg, L, HKV, G, D, n, 1, L * HKV, seed, false);
}

/* One decode step: every layer, all KV heads; ref = true runs bd_ref_decode_gqa head by head. */
static struct bd_tpool *pool; /* --threads N: N − 1 threads, else NULL */

static int step(const struct tg_paged *x, bool ref, float *o)
{
	struct bd_decode_params dp = bd_decode_params_default();

	for (int l = 0; l < L; l++) {
		struct bd_kv_view kv = tg_paged_view(x, l, 0);
		const float *q = x->q + (size_t)l * HKV * G * D;
		float *ol = o + (size_t)l * HKV * G * D;
		int rc;
		if (!ref) {
			rc = bd_attn_cpu_decode_gqa(x->cfg, &dp, &kv, HKV, q, G, ol, NULL, NULL,
						    pool);
			if (rc < 0)
				return rc;
			continue;
		}
		for (int h = 0; h < HKV; h++) {
			kv.kv_head = h;
			rc = bd_ref_decode_gqa(x->cfg, &dp, &kv, q + h * G * D, G, ol + h * G * D,
					       NULL, NULL);
			if (rc < 0)
				return rc;
		}
	}
	return 0;
}

static int cmp_d(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return x < y ? -1 : x > y;
}

/* This thread's CPU time in seconds: on a shared machine it counts the step's own work, not
 * the time other processes held the cores. */
static bool wall;

static double cpu_s(void)
{
	struct timespec ts;

	clock_gettime(wall ? CLOCK_MONOTONIC : CLOCK_THREAD_CPUTIME_ID, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double median_ms(const struct tg_paged *x, bool ref, int repeats, float *o)
{
	double t[MAX_REPEATS];

	if (step(x, ref, o) < 0)
		return NAN;
	for (int i = 0; i < repeats; i++) {
		double t0 = cpu_s();
		if (step(x, ref, o) < 0)
			return NAN;
		t[i] = (cpu_s() - t0) * 1e3;
	}
	qsort(t, (size_t)repeats, sizeof(double), cmp_d);
	return t[repeats / 2];
}

static double rel_l2(const float *a, const float *b, size_t n)
{
	double n2 = 0.0, d2 = 0.0;

	for (size_t i = 0; i < n; i++) {
		n2 += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
		d2 += (double)b[i] * b[i];
	}
	return d2 > 0.0 ? sqrt(n2 / d2) : sqrt(n2);
}

int main(int argc, char **argv)
{
	static const char *const cfgs[] = { "bf16", "bitdecoding-nvfp4" };
	static const char *const isas[] = { "avx512", "avx2" };
	int contexts[8] = { 37, 2048, 7000 }, nctx = 3, repeats = 7, threads = 1, opt;
	static const struct option longopts[] = { { "repeats", required_argument, NULL, 'r' },
						   { "contexts", required_argument, NULL, 'c' },
						   { "threads", required_argument, NULL, 't' },
						   { NULL, 0, NULL, 0 } };

	while ((opt = getopt_long(argc, argv, "r:c:t:", longopts, NULL)) != -1) {
		if (opt == 't') {
			threads = atoi(optarg);
		} else if (opt == 'r') {
			repeats = atoi(optarg);
		} else if (opt == 'c') {
			char *s = optarg;
			for (nctx = 0; nctx < 8 && *s; nctx++) {
				contexts[nctx] = (int)strtol(s, &s, 10);
				if (*s == ',')
					s++;
			}
		} else {
			fprintf(stderr, "usage: bench_attn_cpu [--repeats N] [--contexts N,...] "
					"[--threads N]\n");
			return 2;
		}
	}
	if (repeats < 1 || repeats > MAX_REPEATS)
		repeats = 7;
	if (threads < 1 || threads > 8)
		threads = 1;
	if (threads > 1 && bd_tpool_new(threads, &pool) < 0)
		return 1;
	wall = threads > 1;
	for (int i = 0; i < nctx; i++)
		if (contexts[i] < 1)
			return 2;

	size_t no = (size_t)L * HKV * G * D;
	float *o = malloc(sizeof(float) * no), *oref = malloc(sizeof(float) * no);
	if (!o || !oref)
		return 1;
	printf("decode attention per token: %d layers x %d KV heads, G = %d, d = %d, %d thread(s) "
	       "(the reference: 1), median of %d %s times (default ISA: %s)\n\n",
	       L, HKV, G, D, threads, repeats, wall ? "wall" : "CPU", bd_attn_cpu_isa());
	printf("| kv | context | ref ms | avx2 ms | avx512 ms | speed-up (best) | max rel err |\n");
	printf("| --- | --- | --- | --- | --- | --- | --- |\n");
	for (int ci = 0; ci < nctx; ci++) {
		for (int k = 0; k < 2; k++) {
			struct tg_paged x;
			const struct bd_kvcfg *cfg = bd_kvcfg_find(cfgs[k]);
			if (kv_build(&x, cfg, contexts[ci], 42u + (uint64_t)ci) < 0) {
				fprintf(stderr, "bench_attn_cpu: building the KV failed\n");
				return 1;
			}
			double tref = median_ms(&x, true, repeats, oref);
			double t[2] = { NAN, NAN }, err = 0.0;
			for (int ii = 0; ii < 2; ii++) {
				if (bd_attn_cpu_set_isa(isas[ii]) < 0)
					continue;
				t[ii] = median_ms(&x, false, repeats, o);
				double e = rel_l2(o, oref, no);
				err = e > err ? e : err;
				if (!(e <= 1e-3)) {
					fprintf(stderr, "bench_attn_cpu: %s %s n=%d: rel err %.3g\n",
						isas[ii], cfgs[k], contexts[ci], e);
					return 1;
				}
			}
			double best = fmin(isnan(t[0]) ? INFINITY : t[0],
					   isnan(t[1]) ? INFINITY : t[1]);
			printf("| %s | %d | %.2f | %.2f | %.2f | %.1f× | %.2g |\n", cfgs[k],
			       contexts[ci], tref, t[1], t[0], tref / best, err);
			fflush(stdout);
			tg_paged_free(&x);
		}
	}
	free(o);
	free(oref);
	return 0;
}
