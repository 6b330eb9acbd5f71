/* evalio.c — what the evaluation subcommands (eval-kl, eval-passkey) share: the model, its
 * calibration and the texts their prompts are cut from, and the --kv list of configurations. */
#include <errno.h>
#include <limits.h>
#include <getopt.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cblas.h>

#include "quant/bd_attn_ref.h"
#include "quant/bd_calib.h"
#include "quant/bd_kvcfg.h"
#include "quant/bd_kvemul.h"
#include "model/bd_model.h"
#include "model/bd_sampler.h"
#include "model/bd_tokenizer.h"
#include "cli.h"

int cli_read_texts(const char *tool, char *const *paths, int n, char **ret, size_t *ret_len)
{
	char *buf = NULL;
	size_t len = 0;

	for (int i = 0; i < n; i++) {
		FILE *f = fopen(paths[i], "rb");
		if (!f) {
			fprintf(stderr, "bdfp4 %s: cannot read %s: %s\n", tool, paths[i],
				strerror(errno));
			free(buf);
			return -1;
		}
		char chunk[65536];
		size_t got;
		if (i > 0) {
			char *t = realloc(buf, len + 2);
			if (!t) {
				fclose(f);
				goto oom;
			}
			buf = t;
			memcpy(buf + len, "\n\n", 2);
			len += 2;
		}
		while ((got = fread(chunk, 1, sizeof(chunk), f)) > 0) {
			char *t = realloc(buf, len + got + 1);
			if (!t) {
				fclose(f);
				goto oom;
			}
			buf = t;
			memcpy(buf + len, chunk, got);
			len += got;
		}
		bool bad = ferror(f);
		fclose(f);
		if (bad) {
			fprintf(stderr, "bdfp4 %s: error reading %s\n", tool, paths[i]);
			free(buf);
			return -1;
		}
	}
	/* the NUL the contract promises (an empty last file leaves no byte for it) */
	{
		char *t = realloc(buf, len + 1);

		if (!t)
			goto oom;
		buf = t;
		buf[len] = 0;
	}
	*ret = buf;
	*ret_len = len;
	return 0;
oom:
	fprintf(stderr, "bdfp4 %s: out of memory\n", tool);
	free(buf);
	return -1;
}

int cli_parse_kv_list(const char *tool, const char *list, const struct bd_kvcfg **cfg, int *ret_n)
{
	char *copy = strdup(list), *save = NULL;
	int n = 0;
	if (!copy)
		return -1;
	for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
		const struct bd_kvcfg *c = bd_kvcfg_find(tok);
		if (!c)
			c = bd_kvemul_find(tok); /* the eval-only emulated K/V formats */
		if (!c) {
			fprintf(stderr, "bdfp4 %s: unknown KV configuration '%s'\n", tool, tok);
			free(copy);
			return -1;
		}
		for (int i = 0; i < n; i++)
			if (cfg[i] == c)
				c = NULL;
		if (c && n < BD_KVCFG_COUNT)
			cfg[n++] = c;
	}
	free(copy);
	if (n == 0)
		return -1;
	*ret_n = n;
	return 0;
}

int cli_eval_load(const char *tool, const struct cli_eval_common *e, struct cli_eval_input *in)
{
	const int ctx = e->ctx;
	char *text = NULL;
	size_t len = 0;
	int r;

	memset(in, 0, sizeof(*in));
	cli_model_path(e->model, in->model_path, sizeof(in->model_path));
	if (cli_load_model(tool, in->model_path, &in->m, &in->tok) < 0)
		goto fail;
	if (ctx > in->m->hp.n_ctx_train) {
		fprintf(stderr, "bdfp4 %s: --ctx %d exceeds the model's context of %d\n", tool, ctx,
			in->m->hp.n_ctx_train);
		goto fail;
	}
	if (!e->no_calib &&
	    cli_calib_setup(tool, e->calib, in->model_path, &in->m->hp, ctx, ctx, true, &in->cal) < 0)
		goto fail;
	if (cli_read_texts(tool, e->texts, e->n_texts, &text, &len) < 0)
		goto fail;
	if ((r = bd_tokenizer_encode(in->tok, text, len, 0, &in->stream, &in->n_stream)) < 0) {
		fprintf(stderr, "bdfp4 %s: cannot tokenize the texts: %s\n", tool, strerror(-r));
		goto fail;
	}
	free(text);
	return 0;
fail:
	free(text);
	cli_eval_input_free(in);
	return -1;
}

void cli_eval_input_free(struct cli_eval_input *in)
{
	free(in->stream);
	bd_calib_free(in->cal);
	bd_model_free(in->m);
	bd_tokenizer_free(in->tok);
	in->stream = NULL;
	in->cal = NULL;
	in->m = NULL;
	in->tok = NULL;
	in->n_stream = 0;
}

/* Where the value of a common option goes in e: a text for --model, --calib, --log and
 * --summarize, a flag for --no-calib and --json; both NULL for any other option. */
static void common_opt(int c, struct cli_eval_common *e, const char ***ret_text, bool **ret_flag)
{
	*ret_text = c == CLI_O_MODEL ? &e->model :
		    c == CLI_O_CALIB ? &e->calib :
		    c == CLI_O_LOG ? &e->log :
		    c == CLI_O_SUMMARIZE ? &e->summary : NULL;
	*ret_flag = c == CLI_O_NOCALIB ? &e->no_calib : c == CLI_O_JSON ? &e->json : NULL;
}

void cli_eval_usage_head(FILE *f, const char *tool, const char *about)
{
	fprintf(f,
		"usage: bdfp4 %s [OPTIONS] TEXT...\n"
		"       bdfp4 %s [--kv LIST] [--json] --summarize LOG\n"
		"\n"
		"%s"
		"\n"
		"  --model PATH        GGUF model (default: $BD_MODEL, else the embedded one)\n",
		tool, tool, about);
}

void cli_eval_usage_tail(FILE *f, const char *item, const char *summary)
{
	fprintf(f,
		"  --calib FILE        calibration (default: MODEL.ctxN.calib next to the model if\n"
		"                      present and matching)\n"
		"  --no-calib          mu_k = 0 and tau = 21/1024\n"
		"  --threads N         %ss at once (default: the CPUs online)\n"
		"  --log FILE          append one JSON line per finished %s\n"
		"  --json              JSON to stdout (the table goes to stderr)\n"
		"  --summarize LOG     no runs: the report of %s\n"
		"  -h, --help          this text\n",
		item, item, summary);
}

void cli_eval_decode_params(const struct bd_calib *cal, struct bd_decode_params *ret)
{
	*ret = bd_decode_params_default();
	if (cal) {
		ret->tau = cal->tau;
		ret->c = cal->c;
	}
}

void cli_eval_print_inputs(FILE *f, const struct cli_eval_input *in,
			   const struct cli_eval_common *e)
{
	const struct bd_calib *cal = in->cal;

	if (cal) {
		char hex[65];
		bd_sha256_hex(cal->model_sha256, hex);
		fprintf(f, "calibration: context %d, tau = %.6g (grid index %d), model sha256 %.16s…\n",
			cal->n_ctx, (double)cal->tau, cal->tau_index, hex);
	} else {
		fprintf(f, "calibration: none (mu_k = 0, tau = 21/1024)\n");
	}
	fprintf(f, "texts: %zu tokens from", in->n_stream);
	for (int i = 0; i < e->n_texts; i++)
		fprintf(f, " %s", e->texts[i]);
}

int cli_eval_open_log(const char *tool, const char *path, FILE **ret)
{
	*ret = NULL;
	if (path && !(*ret = fopen(path, "a"))) {
		fprintf(stderr, "bdfp4 %s: cannot open %s: %s\n", tool, path, strerror(errno));
		return -1;
	}
	return 0;
}

int cli_eval_threads(const char *tool, int n, void *(*worker)(void *), void *arg)
{
	pthread_t *th = calloc((size_t)n, sizeof(*th));
	int n_th = 0;

	if (!th) {
		fprintf(stderr, "bdfp4 %s: out of memory\n", tool);
		return -1;
	}
	if (n > 1)
		openblas_set_num_threads(1);
	for (; n_th < n; n_th++)
		if (pthread_create(&th[n_th], NULL, worker, arg) != 0)
			break;
	for (int i = 0; i < n_th; i++)
		pthread_join(th[i], NULL);
	free(th);
	if (n_th == 0) {
		fprintf(stderr, "bdfp4 %s: cannot start a thread\n", tool);
		return -1;
	}
	return n_th;
}

int cli_eval_read_log(const char *tool, const char *path,
		      int (*rec)(void *ctx, struct json_t *j, int lineno), void *ctx)
{
	FILE *f = fopen(path, "r");
	char *line = NULL;
	size_t cap = 0;
	int lineno = 0, r = 0;

	if (!f) {
		fprintf(stderr, "bdfp4 %s: cannot read %s: %s\n", tool, path, strerror(errno));
		return -1;
	}
	while (r >= 0 && getline(&line, &cap, f) > 0) {
		json_error_t je;
		json_t *j = json_loads(line, 0, &je);
		r = rec(ctx, j, ++lineno);
		json_decref(j);
	}
	free(line);
	fclose(f);
	return r < 0 ? -1 : 0;
}

void cli_eval_init(struct cli_eval_common *e, int ctx_min)
{
	long ncpu = sysconf(_SC_NPROCESSORS_ONLN);

	*e = (struct cli_eval_common){ .ctx = CLI_DEFAULT_CTX, .ctx_min = ctx_min,
				       .threads = ncpu > 0 ? (int)ncpu : 1 };
}

/* One option: 1 taken, 0 not one of cli_eval_parse's, 2 after cli_bad_usage. */
static int eval_opt(const char *tool, void (*usage)(FILE *f), const struct cli_int_opt *ints,
		    size_t n_ints, int c, const char *arg, struct cli_eval_common *e,
		    const struct bd_kvcfg **cfg, int *n_cfg, struct bd_sampler_params *sp)
{
	const char *bad;
	int k = cli_int_opt(ints, n_ints, c, arg, &bad);

	if (k < 0)
		return cli_bad_usage(tool, usage, bad, arg);
	const char **text;
	bool *flag;

	if (k > 0)
		return 1;
	common_opt(c, e, &text, &flag);
	if (text)
		*text = arg;
	if (flag)
		*flag = true;
	if (text || flag)
		return 1;
	switch (c) {
	case CLI_O_CTX:
		if (!cli_parse_int(arg, e->ctx_min, INT_MAX, &e->ctx)) {
			char msg[64];

			snprintf(msg, sizeof(msg), "--ctx wants an integer ≥ %d, not '%%s'", e->ctx_min);
			return cli_bad_usage(tool, usage, msg, arg);
		}
		return 1;
	case CLI_O_THREADS:
		if (!cli_parse_int(arg, 1, 1024, &e->threads))
			return cli_bad_usage(tool, usage,
					     "--threads wants an integer in 1..1024, not '%s'", arg);
		return 1;
	case CLI_O_KV:
		if (cli_parse_kv_list(tool, arg, cfg, n_cfg) < 0)
			return cli_bad_usage(tool, usage,
					     "--kv wants a comma-separated list of configurations, "
					     "not '%s'", arg);
		return 1;
	case CLI_O_TEMP:
	case CLI_O_TOPK:
	case CLI_O_TOPP:
	case CLI_O_SEED:
		if ((bad = cli_sampling_opt(c, arg, sp)))
			return cli_bad_usage(tool, usage, bad, arg);
		return 1;
	default:
		return 0;
	}
}

int cli_eval_parse(const char *tool, void (*usage)(FILE *f), const struct option *lopts,
		   const struct cli_int_opt *ints, size_t n_ints, int argc, char **argv,
		   struct cli_eval_common *e, const struct bd_kvcfg **cfg, int *n_cfg,
		   struct bd_sampler_params *sp)
{
	const char *bad = NULL;
	int c, k;

	optind = 0;
	opterr = 0;
	while ((c = getopt_long(argc, argv, ":h", lopts, NULL)) != -1) {
		k = eval_opt(tool, usage, ints, n_ints, c, optarg, e, cfg, n_cfg, sp);
		if (k == 0)
			return cli_getopt_other(tool, usage, c, argv);
		if (k == 2)
			return 2;
	}
	e->texts = argv + optind;
	e->n_texts = argc - optind;
	if (e->summary)
		bad = e->n_texts == 0 ? NULL : "--summarize takes no TEXT%s";
	else if (e->n_texts == 0)
		bad = "no TEXT file given%s";
	else if (e->calib && e->no_calib)
		bad = "--calib and --no-calib exclude each other%s";
	return bad ? cli_bad_usage(tool, usage, bad, "") : -1;
}
