/* generate.c — `bdfp4 generate`: complete a prompt with the CPU model and the bdfp4 KV cache,
 * streaming the tokens as they are sampled. */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <cblas.h>

#include "base/bd_tpool.h"

#include "quant/bd_calib.h"
#include "quant/bd_kvcfg.h"
#include "model/bd_forward.h"
#include "model/bd_sampler.h"
#include "model/bd_tokenizer.h"
#include "cli.h"

#define DEFAULT_MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"

static void usage(FILE *f)
{
	fprintf(f,
		"usage: bdfp4 generate [OPTIONS] PROMPT\n"
		"\n"
		"Complete PROMPT with the model on the CPU, its KV cache held as CONFIG says\n"
		"(NUMERICS.md section 9), printing tokens as they come.\n"
		"\n"
		"  --model PATH       GGUF model (default: $BD_MODEL, else the embedded\n"
		"                     " DEFAULT_MODEL ")\n"
		"  --kv CONFIG        KV cache configuration (default bitdecoding-nvfp4):\n"
		"                     ");
	for (int i = 0; i < BD_KVCFG_COUNT; i++)
		fprintf(f, "%s%s", bd_kvcfg_get(i)->name, i + 1 < BD_KVCFG_COUNT ? " " : "\n");
	cli_gen_usage(f, CLI_GEN_MAX_STOPS, "the same stream every run");
	fprintf(f,
		"  --chat             wrap PROMPT in the model's chat template as a user turn\n"
		"  --calib FILE       calibration of μ_k and τ (`bdfp4 calibrate`; default: the\n"
		"                     model's MODEL.ctx%d.calib of `make calib`, if present and\n"
		"                     made for this model)\n"
		"  --no-calib         μ_k = 0 and τ = 21/1024\n"
		"  --stats            print prefill time, decode speed and peak memory to stderr\n"
		"  --threads N        CPU threads of the products and attention, 1..%d\n"
		"                     (default: the CPUs online)\n"
		"  -h, --help         this text\n",
		CLI_DEFAULT_CTX, BD_TPOOL_MAX_THREADS);
}

static long peak_rss_kib(void)
{
	struct rusage ru;
	return getrusage(RUSAGE_SELF, &ru) == 0 ? ru.ru_maxrss : -1;
}

/* Resident memory now (the model file is unmapped by then: weights, tokenizer, KV cache). */
static long rss_now_kib(void)
{
	long size, resident = -1;
	FILE *f = fopen("/proc/self/statm", "r");
	if (f) {
		if (fscanf(f, "%ld %ld", &size, &resident) != 2)
			resident = -1;
		fclose(f);
	}
	return resident < 0 ? -1 : resident * (sysconf(_SC_PAGESIZE) / 1024);
}

struct stream {
	const struct bd_tokenizer *tok;
	struct bd_tok_stream st;
	char *piece;      /* [piece_cap] */
	size_t piece_cap;
	char *text;       /* everything generated, for the stop strings */
	size_t len, cap, shown;
	const char *const *stops; /* [n_stops] */
	int n_stops;
	int err;
	int n_tokens;
	double t_first, t_last;
	long *rss_kib; /* set at every token: the cache is still alive then */
};

/* Print what is final: up to a stop string, holding back a tail that may start one. */
static bool show(struct stream *s, bool final)
{
	size_t from = s->shown;
	bool hit = bd_stop_text_scan(s->text, s->len, s->stops, s->n_stops, final, &s->shown);

	if (s->shown > from) {
		fwrite(s->text + from, 1, s->shown - from, stdout);
		fflush(stdout);
	}
	return hit;
}

static int on_token(void *ctx, int32_t t)
{
	struct stream *s = ctx;
	size_t n = 0;
	int r;

	s->t_last = bd_now_s();
	if (s->rss_kib)
		*s->rss_kib = rss_now_kib();
	if (s->n_tokens++ == 0)
		s->t_first = s->t_last;
	if ((r = bd_tokenizer_stream_push(s->tok, &s->st, t, s->piece, s->piece_cap, &n)) < 0 ||
	    (r = bd_stop_text_append(&s->text, &s->len, &s->cap, s->piece, n)) < 0) {
		s->err = r;
		return 1;
	}
	return show(s, false) ? 1 : 0;
}

int cmd_generate(int argc, char **argv)
{
	enum { O_MODEL = 256, O_KV, O_CHAT, O_STATS };
	static const struct option opts[] = {
		{ "model", required_argument, NULL, O_MODEL },
		{ "kv", required_argument, NULL, O_KV },
		CLI_OPTS_GENERATION,
		{ "chat", no_argument, NULL, O_CHAT },
		{ "stats", no_argument, NULL, O_STATS },
		{ "threads", required_argument, NULL, CLI_O_THREADS },
		CLI_OPTS_CALIB,
		CLI_OPTS_END,
	};
	const char *model_path = NULL, *kv = "bitdecoding-nvfp4", *calib_path = NULL, *bad;
	struct bd_sampler_params sp;
	struct cli_gen_opts gen;
	bool chat = false, stats = false, no_calib = false;
	struct stream s = { 0 };
	long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
	int c, k, threads = ncpu < 1 ? 1 : ncpu > BD_TPOOL_MAX_THREADS ? BD_TPOOL_MAX_THREADS
									  : (int)ncpu;

	cli_gen_init(&gen, &sp, CLI_GEN_MAX_STOPS);
	optind = 0; /* glibc: full reinitialization, argv[0] is the subcommand */
	opterr = 0;
	while ((c = getopt_long(argc, argv, ":h", opts, NULL)) != -1) {
		if ((k = cli_gen_opt("generate", usage, c, optarg, &gen)) == 2)
			return 2;
		if (k)
			continue;
		switch (c) {
		case O_MODEL:
			model_path = optarg;
			break;
		case O_KV:
			if (!bd_kvcfg_find(optarg))
				return cli_bad_usage("generate", usage,
						     "unknown KV configuration '%s'", optarg);
			kv = optarg;
			break;
		case O_CHAT:
			chat = true;
			break;
		case O_STATS:
			stats = true;
			break;
		case CLI_O_THREADS:
			if (!cli_parse_int(optarg, 1, BD_TPOOL_MAX_THREADS, &threads))
				return cli_bad_usage("generate", usage,
						     "--threads wants an integer in 1..64, not '%s'",
						     optarg);
			break;
		case CLI_O_CALIB:
			calib_path = optarg;
			break;
		case CLI_O_NOCALIB:
			no_calib = true;
			break;
		default:
			return cli_getopt_other("generate", usage, c, argv);
		}
	}
	if ((bad = cli_prompt_bad(argc - optind)))
		return cli_bad_usage("generate", usage, bad, "");
	const char *prompt = argv[optind];

	if (calib_path && no_calib)
		return cli_bad_usage("generate", usage,
				     "--calib and --no-calib exclude each other%s", "");
	char pathbuf[PATH_MAX + 64];
	cli_model_path(model_path, pathbuf, sizeof(pathbuf));
	model_path = pathbuf;
	if (access(model_path, R_OK) != 0) {
		fprintf(stderr,
			"bdfp4 generate: cannot read the model %s: %s\n"
			"  (`make model` fetches the embedded one; or pass --model PATH / set "
			"BD_MODEL)\n",
			model_path, strerror(errno));
		return 1;
	}

	int rc = 1, r;
	struct bd_model *m = NULL;
	struct bd_tokenizer *tok = NULL;
	struct bd_calib *cal = NULL;
	int32_t *ids = NULL, *out = NULL, *stop_ids = NULL;
	size_t n_ids = 0;
	int n_stop = 0, n_out = 0;
	long rss_end = -1;
	char err[BD_MODEL_ERR_MAX], terr[BD_TOKENIZER_ERR_MAX];
	double t0 = bd_now_s();

	if (cli_load_model("generate", model_path, &m, &tok) < 0)
		goto out;
	openblas_set_num_threads(threads);
	if ((r = bd_model_set_threads(m, threads)) < 0) {
		fprintf(stderr, "bdfp4 generate: cannot start %d threads: %s\n", threads,
			strerror(-r));
		goto out;
	}
	double t_load = bd_now_s() - t0;
	if (!no_calib && cli_calib_setup("generate", calib_path, model_path, &m->hp, 0,
					 CLI_DEFAULT_CTX, !stats, &cal) < 0)
		goto out;
	struct bd_decode_params dp = bd_decode_params_default();
	if (cal) {
		dp.tau = cal->tau;
		dp.c = cal->c;
	}

	if (chat) {
		struct bd_chat_msg msg = { .role = "user", .content = prompt };
		r = bd_tokenizer_chat_apply(tok, &msg, 1, true, &ids, &n_ids, terr);
		if (r < 0) {
			fprintf(stderr, "bdfp4 generate: --chat: %s\n", terr);
			goto out;
		}
	} else if ((r = bd_tokenizer_encode(tok, prompt, strlen(prompt), BD_TOK_ADD_SPECIAL, &ids,
					    &n_ids)) < 0) {
		fprintf(stderr, "bdfp4 generate: cannot tokenize the prompt: %s\n", strerror(-r));
		goto out;
	}
	if (n_ids == 0) {
		fprintf(stderr, "bdfp4 generate: the prompt is empty\n");
		goto out;
	}
	if (n_ids > (size_t)m->hp.n_ctx_train || (long)n_ids + gen.max_tokens > m->hp.n_ctx_train) {
		fprintf(stderr, "bdfp4 generate: prompt (%zu tokens) + --max-tokens %d exceed the "
				"model's context of %d tokens\n",
			n_ids, gen.max_tokens, m->hp.n_ctx_train);
		goto out;
	}

	out = malloc(sizeof(*out) * (size_t)gen.max_tokens);
	s.piece_cap = bd_tokenizer_stream_cap(tok);
	s.piece = malloc(s.piece_cap);
	if (cli_eog_ids(tok, &stop_ids, &n_stop) < 0 || !out || !s.piece) {
		fprintf(stderr, "bdfp4 generate: out of memory\n");
		goto out;
	}
	s.tok = tok;
	s.stops = gen.stops;
	s.n_stops = gen.n_stops;
	bd_tokenizer_stream_init(&s.st, BD_TOK_SKIP_SPECIAL);

	struct bd_gen_params gp = {
		.kv = kv,
		.max_tokens = gen.max_tokens,
		.sampling = &sp,
		.stop_ids = stop_ids,
		.n_stop_ids = n_stop,
		.mu_k = cal ? cal->mu_k : NULL,
		.on_token = on_token,
		.cb_ctx = &s,
		.dp = &dp,
	};
	double t_gen = bd_now_s();
	s.rss_kib = &rss_end;
	r = bd_generate(m, ids, (int)n_ids, &gp, out, &n_out, err);
	if (r < 0) {
		fprintf(stderr, "\nbdfp4 generate: %s\n", err);
		goto out;
	}
	if (s.err < 0) {
		fprintf(stderr, "\nbdfp4 generate: decoding the output failed: %s\n",
			strerror(-s.err));
		goto out;
	}
	size_t tail = 0;
	if (bd_tokenizer_stream_flush(&s.st, s.piece, s.piece_cap, &tail) == 0 && tail &&
	    bd_stop_text_append(&s.text, &s.len, &s.cap, s.piece, tail) < 0)
		goto out;
	show(&s, true);
	if (s.shown == 0 || s.text[s.shown - 1] != '\n')
		fputc('\n', stdout);
	fflush(stdout);

	if (stats) {
		double prefill = s.n_tokens ? s.t_first - t_gen : bd_now_s() - t_gen;
		double dec = s.t_last - s.t_first;
		fprintf(stderr,
			"[stats] kv %s: model load %.2f s; prompt %zu tokens, prefill + first "
			"token %.3f s; %d tokens streamed",
			kv, t_load, n_ids, prefill, s.n_tokens);
		if (s.n_tokens > 1 && dec > 0.0)
			fprintf(stderr, ", decode %.2f tokens/s", (s.n_tokens - 1) / dec);
		fprintf(stderr, "; RSS at the last token %.1f MiB, peak %.1f MiB\n",
			(double)rss_end / 1024.0, (double)peak_rss_kib() / 1024.0);
	}
	rc = 0;
out:
	bd_calib_free(cal);
	bd_model_free(m);
	bd_tokenizer_free(tok);
	free(ids);
	free(out);
	free(stop_ids);
	free(s.piece);
	free(s.text);
	return rc;
}
