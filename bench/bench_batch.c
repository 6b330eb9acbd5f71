/* bench_batch.c — the cost of batch-invariant decoding on the CPU backend: decode steps of B
 * rows of the embedded model through bd_model_decode_batch_mode, BD_BATCH_FAST (one
 * matrix–matrix product per weight) against BD_BATCH_INVARIANT (one matrix–vector product per
 * row and weight), one OpenBLAS thread (workerd's default), B sequences of --prompt tokens
 * each prefilled first (untimed). Reported per (B, mode): decoded tokens per second of the
 * calling thread's CPU time (the machine may be shared: CPU time is what the products cost)
 * and of wall time, and invariant / fast.
 *
 * usage: bench_batch [--model PATH] [--kv CONFIG] [--batches LIST] [--prompt N] [--steps N]
 *                    [--out FILE]
 */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cblas.h>

#include "base/bd_clock.h"
#include "model/bd_forward.h"
#include "bench_info.h"

#define MAX_B 64

static double cpu_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* steps decode steps of B fresh rows in mode: tokens per CPU second and per wall second. */
static int run(const struct bd_model *m, const struct bd_kvcfg *cfg, int B, int prompt,
	       int steps, enum bd_batch_mode mode, double *ret_cpu, double *ret_wall)
{
	struct bd_seq *s[MAX_B] = { NULL };
	int32_t *p = malloc(sizeof(int32_t) * (size_t)prompt), tok[MAX_B];
	float *lg = malloc(sizeof(float) * (size_t)B * (size_t)m->hp.n_vocab);
	int st[MAX_B], r = -ENOMEM;
	char err[BD_MODEL_ERR_MAX];

	if (!p || !lg)
		goto out;
	for (int b = 0; b < B; b++) {
		struct bd_seq_opts o = { .max_tokens = prompt + steps };
		for (int i = 0; i < prompt; i++) /* a walk over the vocabulary, one per row */
			p[i] = (int32_t)(300 + (i * 7919 + (b + 1) * 104729) % 40000);
		if ((r = bd_seq_new(m, cfg, &o, &s[b], err)) < 0 ||
		    (r = bd_model_prefill(m, s[b], p, prompt, NULL)) < 0)
			goto out;
		tok[b] = p[prompt - 1];
	}
	double c0 = cpu_s(), w0 = bd_now_s();
	for (int t = 0; t < steps; t++) {
		if ((r = bd_model_decode_batch_mode(m, s, tok, B, lg, st, mode)) < 0)
			goto out;
		for (int b = 0; b < B; b++) {
			if (st[b] < 0) {
				r = st[b];
				goto out;
			}
			tok[b] = (int32_t)(300 + (t * 31 + b * 17) % 40000);
		}
	}
	*ret_cpu = (double)B * steps / (cpu_s() - c0);
	*ret_wall = (double)B * steps / (bd_now_s() - w0);
	r = 0;
out:
	for (int b = 0; b < B; b++)
		bd_seq_free(s[b]);
	free(p);
	free(lg);
	return r;
}

int main(int argc, char **argv)
{
	static const struct option lo[] = {
		{ "model", required_argument, NULL, 'm' }, { "kv", required_argument, NULL, 'k' },
		{ "batches", required_argument, NULL, 'b' }, { "prompt", required_argument, NULL, 'p' },
		{ "steps", required_argument, NULL, 's' }, { "out", required_argument, NULL, 'o' },
		{ "help", no_argument, NULL, 'h' }, { NULL, 0, NULL, 0 },
	};
	const char *model = getenv("BD_MODEL"), *kv = "bitdecoding-nvfp4", *list = "1,4,16";
	const char *out_path = NULL;
	int prompt = 128, steps = 16, c;
	char err[BD_MODEL_ERR_MAX];

	if (!model || !*model)
		model = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
	while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
		switch (c) {
		case 'm': model = optarg; break;
		case 'k': kv = optarg; break;
		case 'b': list = optarg; break;
		case 'p': prompt = atoi(optarg); break;
		case 's': steps = atoi(optarg); break;
		case 'o': out_path = optarg; break;
		case 'h':
			printf("usage: bench_batch [--model PATH] [--kv CONFIG] [--batches 1,4,16] "
			       "[--prompt 128] [--steps 16] [--out FILE]\n");
			return 0;
		default:
			return 2;
		}
	}
	const struct bd_kvcfg *cfg = bd_kvcfg_find(kv);
	if (!cfg || prompt < 1 || steps < 1 || optind < argc) {
		fprintf(stderr, "bench_batch: bad arguments (bench_batch --help)\n");
		return 2;
	}
	struct bd_model *m = NULL;
	if (bd_model_load(model, &m, err) < 0) {
		fprintf(stderr, "bench_batch: %s: %s\n", model, err);
		return 1;
	}
	openblas_set_num_threads(1);

	char table[4096];
	size_t len = (size_t)snprintf(table, sizeof(table),
				      "| rows | fast tok/s (CPU) | invariant tok/s (CPU) | invariant "
				      "/ fast | fast tok/s (wall) | invariant tok/s (wall) |\n"
				      "| --- | --- | --- | --- | --- | --- |\n");
	char *copy = strdup(list), *save = NULL;
	int rc = 0;
	for (char *t = strtok_r(copy, ",", &save); t && rc == 0; t = strtok_r(NULL, ",", &save)) {
		int B = atoi(t);
		double fc, fw, ic, iw;
		if (B < 1 || B > MAX_B) {
			fprintf(stderr, "bench_batch: rows %s: 1..%d\n", t, MAX_B);
			rc = 2;
			break;
		}
		if (run(m, cfg, B, prompt, steps, BD_BATCH_FAST, &fc, &fw) < 0 ||
		    run(m, cfg, B, prompt, steps, BD_BATCH_INVARIANT, &ic, &iw) < 0) {
			fprintf(stderr, "bench_batch: decoding failed at %d rows\n", B);
			rc = 1;
			break;
		}
		len += (size_t)snprintf(table + len, sizeof(table) - len,
					"| %d | %.1f | %.1f | %.2f | %.1f | %.1f |\n", B, fc, ic,
					ic / fc, fw, iw);
		fprintf(stderr, "bench_batch: %d rows done\n", B);
	}
	free(copy);
	bd_model_free(m);
	if (rc)
		return rc;
	fputs(table, stdout);
	if (out_path) {
		struct bench_info bi;
		FILE *f = bench_results_open("bench_batch", out_path, &bi);
		double load = 0.0;
		if (!f)
			return 1;
		fprintf(f,
			"\n## bench_batch — the cost of batch-invariant decoding, %s\n\n"
			"Machine: %s, %ld cores online, load average %.2f at the end; commit %s; "
			"command `bench_batch --kv %s --batches %s --prompt %d --steps %d` (%s); one "
			"OpenBLAS thread; tok/s of the decoding thread's CPU time and of wall time.\n\n"
			"%s",
			bi.date, bi.cpu, sysconf(_SC_NPROCESSORS_ONLN),
			getloadavg(&load, 1) == 1 ? load : -1.0, bi.commit, kv, list, prompt,
			steps, model, table);
		if (fclose(f) != 0) {
			fprintf(stderr, "bench_batch: %s: write failed\n", out_path);
			return 1;
		}
	}
	return 0;
}
