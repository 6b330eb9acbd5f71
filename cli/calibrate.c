/* calibrate.c — `bdfp4 calibrate`: μ_k and τ for a model and a context window (NUMERICS.md §7,
 * paper appendices B and C), and the calibration lookup that generate and eval-kl share.
 *
 * Calibration text: eight everyday one-sentence requests, each put through the model's chat
 * template as a user turn and continued greedily with BF16 KV for up to 256 tokens (until the
 * model ends its turn). Prompts and continuations are joined (template tokens included, so the
 * text is a run of well-formed chat turns) and tiled to exactly the context window. One prefill
 * with BF16 KV then runs a hook at every (layer, position):
 * - μ_k: the mean of the post-RoPE keys over all positions, per layer and KV head (FP64 sums);
 * - τ: the queries of the last 128 positions are decode queries that continue the calibration
 *   text (with BF16 KV the query of position p in a causal prefill is the decode query at p).
 *   For each one and each query head, the BF16 logits γ·⟨bf16(q), bf16(k_i)⟩ over the keys a
 *   decoder at that position holds in pages (tokens [0, 128·⌊p/128⌋), the first 16 masked as
 *   the BF16 sink) go through the replayed online softmax (B_k = 64, c = 8), and τ is the
 *   candidate on the E4M3 grid with the least total squared error of c·p (bd_calib.h).
 */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "quant/bd_calib.h"
#include "model/bd_forward.h"
#include "model/bd_sampler.h"
#include "model/bd_tokenizer.h"
#include "cli.h"

#define DEFAULT_MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define GEN_TOKENS 256
#define N_QUERIES 128 /* decode queries replayed for τ */
#define TILE_KEYS 64
#define P_SCALE_C 8.0f
#define LOG2E 1.4426950408889634

/* Short everyday requests (NUMERICS.md §7: "eight one-sentence everyday prompts"). */
static const char *const prompts[8] = {
	"Describe how to make a cup of tea.",
	"What should I pack for a weekend camping trip?",
	"Explain how to plant tomatoes in a small garden.",
	"Give me some tips for getting a good night's sleep.",
	"How do I clean a cast iron pan?",
	"Write a short note thanking a neighbour for watering my plants.",
	"What is a simple recipe for vegetable soup?",
	"Suggest a few ways to save money on groceries.",
};

/* ---- shared by the subcommands ------------------------------------------------------------- */

void cli_model_path(const char *opt, char *buf, size_t cap)
{
	char exe[PATH_MAX];
	const char *env = getenv("BD_MODEL");

	if (opt) {
		snprintf(buf, cap, "%s", opt);
		return;
	}
	if (env && *env) {
		snprintf(buf, cap, "%s", env);
		return;
	}
	/* the embedded model, next to the binary's repository (BUILD/bin/bdfp4 lies two or three
	 * levels below it), else relative to the working directory */
	ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
	if (n > 0) {
		exe[n] = '\0';
		for (int up = 0; up < 4; up++) {
			char *slash = strrchr(exe, '/');
			if (!slash)
				break;
			*slash = '\0';
			snprintf(buf, cap, "%s/%s", exe, DEFAULT_MODEL);
			if (access(buf, R_OK) == 0)
				return;
		}
	}
	snprintf(buf, cap, "%s", DEFAULT_MODEL);
}

void cli_calib_default_path(const char *model_path, int n_ctx, char *buf, size_t cap)
{
	size_t n = strlen(model_path);
	if (n > 5 && strcmp(model_path + n - 5, ".gguf") == 0)
		n -= 5;
	snprintf(buf, cap, "%.*s.ctx%d.calib", (int)n, model_path, n_ctx);
}

int cli_calib_setup(const char *tool, const char *explicit_path, const char *model_path,
		    const struct bd_model_hparams *hp, int want_ctx, int auto_ctx, bool quiet,
		    struct bd_calib **ret)
{
	char path[PATH_MAX + 32], err[BD_CALIB_ERR_MAX];
	uint8_t sha[BD_SHA256_BYTES];
	int r;

	*ret = NULL;
	if (explicit_path)
		snprintf(path, sizeof(path), "%s", explicit_path);
	else
		cli_calib_default_path(model_path, auto_ctx, path, sizeof(path));
	if (!explicit_path && access(path, F_OK) != 0)
		return 0; /* no default calibration: μ_k = 0 and the default τ */

	if ((r = bd_sha256_file(model_path, sha)) < 0) {
		fprintf(stderr, "bdfp4 %s: cannot checksum %s: %s\n", tool, model_path,
			strerror(-r));
		return -1;
	}
	struct bd_calib_expect want = { .model_sha256 = sha, .n_ctx = want_ctx,
					.n_layers = hp->n_layers, .n_kv_heads = hp->n_kv_heads,
					.head_dim = hp->head_dim };
	if ((r = bd_calib_load(path, &want, ret, err)) < 0) {
		if (explicit_path) {
			fprintf(stderr, "bdfp4 %s: calibration %s: %s\n", tool, path, err);
			return -1;
		}
		fprintf(stderr,
			"bdfp4 %s: warning: ignoring the calibration %s: %s (run `make calib` or "
			"`bdfp4 calibrate` again); running with μ_k = 0 and τ = 21/1024\n",
			tool, path, err);
		*ret = NULL;
		return 0;
	}
	if (!quiet)
		fprintf(stderr, "bdfp4 %s: calibration %s (context %d, τ = %.6g)\n", tool, path,
			(*ret)->n_ctx, (double)(*ret)->tau);
	return 0;
}

/* ---- calibrate --------------------------------------------------------------------------------- */

static void usage(FILE *f)
{
	fprintf(f,
		"usage: bdfp4 calibrate [--model PATH] [--ctx N] -o FILE\n"
		"\n"
		"Calibrate the key means μ_k and the probability threshold τ of a model for a\n"
		"context window (NUMERICS.md section 7) and write them to FILE, tied to the model\n"
		"file's SHA-256 and the context.\n"
		"\n"
		"  --model PATH   GGUF model (default: $BD_MODEL, else the embedded " DEFAULT_MODEL
		")\n"
		"  --ctx N        context window in tokens, 256..the model's (default %d)\n"
		"  -o FILE        output file (eval-kl and generate look for\n"
		"                 MODEL-without-.gguf.ctxN.calib next to the model)\n"
		"  -h, --help     this text\n",
		CLI_DEFAULT_CTX);
}

struct gen_progress {
	bool tty;
	int prompt, n;
};

static int on_token(void *ctx, int32_t t)
{
	struct gen_progress *p = ctx;
	(void)t;
	p->n++;
	if (p->tty && p->n % 8 == 0)
		fprintf(stderr, "\r[calibrate] prompt %d/8: %3d tokens", p->prompt + 1, p->n);
	return 0;
}

/* The hook of the calibration prefill (layer by layer, positions in order). */
struct hook {
	const struct bd_model_hparams *hp;
	struct bd_mu_acc *mu;
	struct bd_tau_search ts;
	int n, q0;     /* prompt length; positions ≥ q0 replay softmax */
	float *kbf;    /* [n][Hkv][d] BF16-rounded keys of the layer being run */
	float *S;      /* [n] */
	float gamma;
	int err;
	bool tty;
	int last_layer;
	double t0;
};

static float bf16r(float x)
{
	return bd_bf16_to_f32(bd_f32_to_bf16(x));
}

static void hook(void *ctx, int layer, int pos, const float *q, const float *k, const float *v)
{
	struct hook *h = ctx;
	const struct bd_model_hparams *hp = h->hp;
	int d = hp->head_dim, Hkv = hp->n_kv_heads, G = hp->n_heads / hp->n_kv_heads, r;
	size_t kd = (size_t)Hkv * (size_t)d;

	(void)v;
	if (h->err)
		return;
	if (h->tty && layer != h->last_layer) {
		fprintf(stderr, "\r[calibrate] prefill of %d tokens: layer %d/%d (%.0f s)   ", h->n,
			layer + 1, hp->n_layers, bd_now_s() - h->t0);
		h->last_layer = layer;
	}
	if ((r = bd_mu_acc_add(h->mu, layer, k)) < 0) {
		h->err = r;
		return;
	}
	float *kb = h->kbf + (size_t)pos * kd;
	for (size_t i = 0; i < kd; i++)
		kb[i] = bf16r(k[i]);
	if (pos < h->q0)
		return;

	/* a decode query at pos: its page keys [0, 128·⌊pos/128⌋), the sink masked */
	int nk = pos / BD_PAGE_TOKENS * BD_PAGE_TOKENS;
	float qb[BD_FWHT_MAX];
	for (int j = 0; j < hp->n_heads; j++) {
		int kvh = j / G;
		for (int c = 0; c < d; c++)
			qb[c] = bf16r(q[(size_t)j * (size_t)d + (size_t)c]);
		for (int i = 0; i < nk; i++) {
			const float *ki = h->kbf + (size_t)i * kd + (size_t)kvh * (size_t)d;
			float acc = 0.0f;
			for (int c = 0; c < d; c++)
				acc = acc + qb[c] * ki[c];
			h->S[i] = h->gamma * acc;
		}
		if ((r = bd_tau_search_add_logits(&h->ts, h->S, nk, BD_SINK_TOKENS, TILE_KEYS)) <
		    0) {
			h->err = r;
			return;
		}
	}
}

int cmd_calibrate(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "model", required_argument, NULL, 'm' },
		{ "ctx", required_argument, NULL, 'c' },
		{ "output", required_argument, NULL, 'o' },
		CLI_OPTS_END,
	};
	const char *model_opt = NULL, *out_path = NULL;
	int ctx = CLI_DEFAULT_CTX, c;

	optind = 0;
	opterr = 0;
	while ((c = getopt_long(argc, argv, ":ho:", opts, NULL)) != -1) {
		switch (c) {
		case 'm':
			model_opt = optarg;
			break;
		case 'c':
			if (!cli_parse_int(optarg, 256, INT_MAX, &ctx))
				return cli_bad_usage("calibrate", usage,
						     "--ctx wants an integer ≥ 256, not '%s'", optarg);
			break;
		case 'o':
			out_path = optarg;
			break;
		default:
			return cli_getopt_other("calibrate", usage, c, argv);
		}
	}
	if (optind != argc || !out_path)
		return cli_bad_usage("calibrate", usage, "%s", optind != argc
				     ? "no positional arguments" : "-o FILE is required");

	char model_path[PATH_MAX + 64];
	cli_model_path(model_opt, model_path, sizeof(model_path));

	int rc = 1, r;
	bool tty = isatty(STDERR_FILENO);
	struct bd_model *m = NULL;
	struct bd_tokenizer *tok = NULL;
	struct bd_calib *cal = NULL;
	struct hook hk = { 0 };
	struct bd_seq *seq = NULL;
	int32_t *joined = NULL, *tiled = NULL, *stop = NULL, *gen = NULL;
	size_t n_joined = 0;
	char err[BD_MODEL_ERR_MAX], terr[BD_TOKENIZER_ERR_MAX];
	uint8_t sha[BD_SHA256_BYTES];
	double t0 = bd_now_s();

	if ((r = bd_sha256_file(model_path, sha)) < 0) {
		fprintf(stderr, "bdfp4 calibrate: cannot read the model %s: %s\n  (`make model` "
				"fetches the embedded one; or pass --model PATH / set BD_MODEL)\n",
			model_path, strerror(-r));
		return 1;
	}
	if (cli_load_model("calibrate", model_path, &m, &tok) < 0)
		goto out;
	const struct bd_model_hparams *hp = &m->hp;
	if (ctx > hp->n_ctx_train) {
		fprintf(stderr, "bdfp4 calibrate: --ctx %d exceeds the model's context of %d\n", ctx,
			hp->n_ctx_train);
		goto out;
	}

	/* 1. the calibration text: eight prompts, each continued greedily with BF16 KV */
	int n_stop = 0;
	gen = malloc(sizeof(*gen) * GEN_TOKENS);
	if (cli_eog_ids(tok, &stop, &n_stop) < 0 || !gen)
		goto oom;
	size_t cap_joined = 0;
	for (int i = 0; i < 8; i++) {
		struct bd_chat_msg msg = { .role = "user", .content = prompts[i] };
		int32_t *ids = NULL;
		size_t n_ids = 0;
		int n_gen = 0;
		if ((r = bd_tokenizer_chat_apply(tok, &msg, 1, true, &ids, &n_ids, terr)) < 0) {
			fprintf(stderr, "bdfp4 calibrate: chat template: %s\n", terr);
			goto out;
		}
		struct gen_progress gpr = { .tty = tty, .prompt = i };
		struct bd_gen_params gp = { .kv = "bf16", .max_tokens = GEN_TOKENS,
					    .stop_ids = stop, .n_stop_ids = n_stop,
					    .on_token = on_token, .cb_ctx = &gpr };
		r = bd_generate(m, ids, (int)n_ids, &gp, gen, &n_gen, err);
		if (r < 0) {
			free(ids);
			fprintf(stderr, "\nbdfp4 calibrate: generating: %s\n", err);
			goto out;
		}
		if (n_joined + n_ids + (size_t)n_gen > cap_joined) {
			cap_joined = (n_joined + n_ids + (size_t)n_gen) * 2;
			int32_t *t = realloc(joined, sizeof(*t) * cap_joined);
			if (!t) {
				free(ids);
				goto oom;
			}
			joined = t;
		}
		memcpy(joined + n_joined, ids, sizeof(*ids) * n_ids);
		n_joined += n_ids;
		memcpy(joined + n_joined, gen, sizeof(*gen) * (size_t)n_gen);
		n_joined += (size_t)n_gen;
		free(ids);
		if (tty)
			fprintf(stderr, "\r[calibrate] prompt %d/8: %3d tokens generated%s\n", i + 1,
				n_gen, n_gen < GEN_TOKENS ? " (end of turn)" : "");
	}

	/* 2. tiled to the context window */
	if (!(tiled = malloc(sizeof(*tiled) * (size_t)ctx)))
		goto oom;
	for (int i = 0; i < ctx; i++)
		tiled[i] = joined[(size_t)i % n_joined];

	/* 3. one prefill, μ_k and the τ search in its hook */
	if ((r = bd_calib_new(hp->n_layers, hp->n_kv_heads, hp->head_dim, &cal)) < 0 ||
	    (r = bd_mu_acc_new(hp->n_layers, hp->n_kv_heads, hp->head_dim, &hk.mu)) < 0)
		goto oom;
	hk.hp = hp;
	hk.n = ctx;
	hk.q0 = ctx - N_QUERIES;
	hk.gamma = (float)(LOG2E / sqrt((double)hp->head_dim));
	hk.tty = tty;
	hk.last_layer = -1;
	hk.t0 = bd_now_s();
	bd_tau_search_init(&hk.ts, P_SCALE_C);
	hk.kbf = malloc(sizeof(float) * (size_t)ctx * (size_t)hp->n_kv_heads *
			(size_t)hp->head_dim);
	hk.S = malloc(sizeof(float) * (size_t)ctx);
	if (!hk.kbf || !hk.S)
		goto oom;
	struct bd_seq_opts so = { .max_tokens = ctx, .hook = hook, .hook_ctx = &hk };
	if ((r = bd_seq_new(m, bd_kvcfg_find("bf16"), &so, &seq, err)) < 0) {
		fprintf(stderr, "bdfp4 calibrate: %s\n", err);
		goto out;
	}
	if ((r = bd_model_prefill(m, seq, tiled, ctx, NULL)) < 0 || hk.err < 0) {
		fprintf(stderr, "\nbdfp4 calibrate: prefill failed: %s\n",
			strerror(-(r < 0 ? r : hk.err)));
		goto out;
	}
	if (tty)
		fprintf(stderr, "\r[calibrate] prefill of %d tokens done (%.0f s)%24s\n", ctx,
			bd_now_s() - hk.t0, "");

	double best, all[BD_TAU_CANDIDATES];
	if ((r = bd_mu_acc_mean(hk.mu, cal->mu_k, &cal->n_key_tokens)) < 0 ||
	    (r = bd_tau_search_result(&hk.ts, &cal->tau_index, &cal->tau, &best, all)) < 0) {
		fprintf(stderr, "bdfp4 calibrate: no keys or probability blocks were seen\n");
		goto out;
	}
	memcpy(cal->model_sha256, sha, sizeof(sha));
	cal->n_ctx = ctx;
	cal->tile_keys = TILE_KEYS;
	cal->c = P_SCALE_C;
	cal->n_p_blocks = hk.ts.n_blocks;
	if ((r = bd_calib_save(cal, out_path)) < 0) {
		fprintf(stderr, "bdfp4 calibrate: cannot write %s: %s\n", out_path, strerror(-r));
		goto out;
	}

	double mabs = 0.0;
	size_t nmu = (size_t)hp->n_layers * (size_t)hp->n_kv_heads * (size_t)hp->head_dim;
	for (size_t i = 0; i < nmu; i++)
		mabs += fabs(cal->mu_k[i]);
	char hex[65];
	bd_sha256_hex(sha, hex);
	printf("calibration of %s (sha256 %s) for a context of %d tokens -> %s\n", model_path, hex,
	       ctx, out_path);
	printf("text: 8 chat prompts continued greedily with bf16 KV (≤ %d tokens each), %zu "
	       "tokens joined, tiled to %d\n",
	       GEN_TOKENS, n_joined, ctx);
	printf("mu_k: mean over %llu positions of %d layers x %d KV heads x %d; mean |mu_k| %.4g\n",
	       (unsigned long long)cal->n_key_tokens, hp->n_layers, hp->n_kv_heads, hp->head_dim,
	       mabs / (double)nmu);
	printf("tau: %d decode queries x %d heads x %d layers, %llu probability blocks (B_k %d, "
	       "c %g)\n",
	       N_QUERIES, hp->n_heads, hp->n_layers, (unsigned long long)cal->n_p_blocks, TILE_KEYS,
	       (double)P_SCALE_C);
	if (cal->tau_index > 0)
		printf("tau = %.9g (grid index %d, between E4M3 codes %d and %d)", (double)cal->tau,
		       cal->tau_index, cal->tau_index - 1, cal->tau_index);
	else
		printf("tau = 0 (grid index 0: kappa = 6 for every block)");
	printf("; squared error of c*p %.9g (tau = 0: %.9g, tau = 21/1024: %.9g)\n", best, all[0],
	       all[11]);
	printf("wall time %.1f s\n", bd_now_s() - t0);
	rc = 0;
	goto out;
oom:
	fprintf(stderr, "bdfp4 calibrate: out of memory\n");
out:
	bd_seq_free(seq);
	bd_mu_acc_free(hk.mu);
	free(hk.kbf);
	free(hk.S);
	bd_calib_free(cal);
	bd_model_free(m);
	bd_tokenizer_free(tok);
	free(joined);
	free(tiled);
	free(stop);
	free(gen);
	return rc;
}
