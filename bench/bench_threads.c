/* bench_threads.c — the CPU model's decode step on 1 thread and on N (bd_model_set_threads:
 * the block products split by weight rows, the decode attention by KV head), the embedded
 * model, one sequence, after a prompt of each --contexts length (a walk over the vocabulary),
 * for each --kv configuration. Two copies of the model (1 and N threads), each with its own
 * sequence, decode in alternation, step by step, so both see the same load on a shared
 * machine; each step is checked to give the other copy's logits bit for bit.
 *
 * Reported per (KV, context, threads): the fastest step and the median step in wall time, the
 * decode tok/s of each, and the process's user and system CPU time per step (getrusage: all
 * its threads, so the pool's spinning and sleeping show). The fastest step is the one the
 * scheduler left alone: on a machine whose cores other jobs share, it is the estimate of an
 * idle machine's step; the median is what this run got.
 *
 * usage: bench_threads [--model PATH] [--threads N] [--contexts 39,1943] [--steps 48]
 *                      [--kv bf16,bitdecoding-nvfp4]
 * A markdown table goes to stdout.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "base/bd_clock.h"
#include "base/bd_tpool.h"
#include "model/bd_forward.h"
#include "model/bd_sampler.h"

#define MAX_STEPS 1024
#define MAX_LIST 8

static double tv_s(struct timeval t)
{
	return (double)t.tv_sec + (double)t.tv_usec * 1e-6;
}

static int cmp_d(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

/* "a,b,c" into out[MAX_LIST] (pointers into s, which is modified). Returns the count. */
static int split_list(char *s, char **out)
{
	int n = 0;
	for (char *t = strtok(s, ","); t && n < MAX_LIST; t = strtok(NULL, ","))
		out[n++] = t;
	return n;
}

struct row {
	double wall[MAX_STEPS], user, sys;
};

/* One (configuration, context): both copies prefilled, then steps alternating. */
static int run(struct bd_model *const m[2], const struct bd_kvcfg *cfg, int ctx, int steps,
	       struct row r[2])
{
	struct bd_seq *s[2] = { NULL, NULL };
	int V = m[0]->hp.n_vocab, rc = -ENOMEM;
	int32_t *p = malloc(sizeof(int32_t) * (size_t)ctx);
	float *lg[2] = { malloc(sizeof(float) * (size_t)V), malloc(sizeof(float) * (size_t)V) };
	char err[BD_MODEL_ERR_MAX];

	if (!p || !lg[0] || !lg[1])
		goto out;
	for (int i = 0; i < ctx; i++)
		p[i] = (int32_t)(300 + (i * 7919) % 40000);
	struct bd_seq_opts o = { .max_tokens = ctx + steps + 1 };
	for (int k = 0; k < 2; k++) {
		r[k].user = r[k].sys = 0.0;
		if ((rc = bd_seq_new(m[k], cfg, &o, &s[k], err)) < 0 ||
		    (rc = bd_model_prefill(m[k], s[k], p, ctx, lg[k])) < 0) {
			fprintf(stderr, "bench_threads: %s, %d tokens: %s\n", cfg->name, ctx,
				rc == -ENOMEM ? "out of memory" : err);
			goto out;
		}
	}
	for (int t = 0; t < steps; t++) {
		int32_t tok = (int32_t)bd_argmax(lg[0], V);
		for (int j = 0; j < 2; j++) {
			int k = (t + j) % 2; /* which copy goes first turns each step */
			struct rusage u0, u1;
			getrusage(RUSAGE_SELF, &u0);
			double w0 = bd_now_s();
			if ((rc = bd_model_decode(m[k], s[k], tok, lg[k])) < 0)
				goto out;
			r[k].wall[t] = bd_now_s() - w0;
			getrusage(RUSAGE_SELF, &u1);
			r[k].user += tv_s(u1.ru_utime) - tv_s(u0.ru_utime);
			r[k].sys += tv_s(u1.ru_stime) - tv_s(u0.ru_stime);
		}
		if (memcmp(lg[0], lg[1], sizeof(float) * (size_t)V) != 0) {
			fprintf(stderr, "bench_threads: %s, %d tokens, step %d: the logits of 1 "
					"and N threads differ\n",
				cfg->name, ctx, t);
			rc = -EDOM;
			goto out;
		}
	}
	rc = 0;
out:
	for (int k = 0; k < 2; k++) {
		bd_seq_free(s[k]);
		free(lg[k]);
	}
	free(p);
	return rc;
}

/* One --flag VALUE option: the value into a string pointer, a buffer, or an int. */
struct barg {
	const char *flag;
	const char **str;
	char *buf;
	size_t len;
	int *num;
};

int main(int argc, char **argv)
{
	const char *model = getenv("BD_MODEL");
	char ctxs[256] = "39,1943", kvs[256] = "bf16,bitdecoding-nvfp4";
	int threads = 2, steps = 48;
	const struct barg args[] = {
		{ "--model", &model, NULL, 0, NULL },
		{ "--threads", NULL, NULL, 0, &threads },
		{ "--contexts", NULL, ctxs, sizeof(ctxs), NULL },
		{ "--steps", NULL, NULL, 0, &steps },
		{ "--kv", NULL, kvs, sizeof(kvs), NULL },
	};

	if (!model || !*model)
		model = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
	for (int i = 1; i < argc; i++) {
		if (strcmp(argv[i], "--help") == 0) {
			printf("usage: bench_threads [--model PATH] [--threads N] [--contexts 39,1943] "
			       "[--steps 48] [--kv bf16,bitdecoding-nvfp4]\n");
			return 0;
		}
		const struct barg *o = NULL;
		for (size_t k = 0; k < sizeof(args) / sizeof(args[0]); k++)
			if (strcmp(argv[i], args[k].flag) == 0)
				o = &args[k];
		if (!o || i + 1 >= argc) {
			fprintf(stderr, "bench_threads: unknown option or missing value: %s\n",
				argv[i]);
			return 2;
		}
		const char *v = argv[++i];
		if (o->str)
			*o->str = v;
		else if (o->buf)
			snprintf(o->buf, o->len, "%s", v);
		else
			*o->num = atoi(v);
	}
	char *cl[MAX_LIST], *kl[MAX_LIST];
	int nc = split_list(ctxs, cl), nk = split_list(kvs, kl);
	if (threads < 2 || threads > BD_TPOOL_MAX_THREADS || steps < 1 || steps > MAX_STEPS ||
	    nc < 1 || nk < 1) {
		fprintf(stderr, "bench_threads: bad arguments (bench_threads --help)\n");
		return 2;
	}
	struct bd_model *m[2] = { NULL, NULL };
	char err[BD_MODEL_ERR_MAX];
	for (int k = 0; k < 2; k++) {
		if (bd_model_load(model, &m[k], err) < 0) {
			fprintf(stderr, "bench_threads: %s\n", err);
			return 1;
		}
	}
	if (bd_model_set_threads(m[1], threads) < 0) {
		fprintf(stderr, "bench_threads: cannot start %d threads\n", threads);
		return 1;
	}
	printf("Decode step of %s, 1 thread against %d, %d steps alternated; wall time per step: "
	       "fastest and median; CPU time of the process per step\n\n",
	       model, threads, steps);
	printf("| kv | context | threads | fastest ms | tok/s (fastest) | median ms | tok/s "
	       "(median) | user ms | sys ms |\n");
	printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
	static struct row r[2];
	int rc = 0;
	for (int ki = 0; ki < nk && rc == 0; ki++) {
		const struct bd_kvcfg *cfg = bd_kvcfg_find(kl[ki]);
		if (!cfg) {
			fprintf(stderr, "bench_threads: unknown KV configuration '%s'\n", kl[ki]);
			rc = 2;
			break;
		}
		for (int ci = 0; ci < nc && rc == 0; ci++) {
			int ctx = atoi(cl[ci]);
			if (ctx < 1 || ctx + steps + 1 > m[0]->hp.n_ctx_train) {
				fprintf(stderr, "bench_threads: bad context %s\n", cl[ci]);
				rc = 2;
				break;
			}
			if (run(m, cfg, ctx, steps, r) < 0) {
				rc = 1;
				break;
			}
			for (int k = 0; k < 2; k++) {
				qsort(r[k].wall, (size_t)steps, sizeof(double), cmp_d);
				double lo_ms = r[k].wall[0] * 1e3, med = r[k].wall[steps / 2] * 1e3;
				printf("| %s | %d | %d | %.2f | %.1f | %.2f | %.1f | %.2f | %.2f |\n",
				       cfg->name, ctx, k ? threads : 1, lo_ms, 1e3 / lo_ms, med,
				       1e3 / med, r[k].user * 1e3 / steps, r[k].sys * 1e3 / steps);
			}
			fflush(stdout);
		}
	}
	bd_model_free(m[0]);
	bd_model_free(m[1]);
	return rc;
}
