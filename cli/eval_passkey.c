/* eval_passkey.c — `bdfp4 eval-passkey`: passkey retrieval, a task accuracy of every KV
 * configuration on the real model, beside the KL proxy of eval-kl (NUMERICS.md §10).
 *
 * Trial t of T = depths × keys: depth index i = t mod depths (depth i/(depths − 1) of the
 * haystack, 0 its start, 1 its end), key j = t div depths, so that the first trials of a run
 * cover every depth. The key is a 5-digit number drawn from bd_rng (seed, t). The haystack is
 * a window of the texts' tokens (the window of trial t starts at ⌊t·(M − H)/(T − 1)⌋ of the M
 * tokens, as eval-kl's prompts do), decoded back to text and cut at the first space or newline
 * at or after depth · its length, where the needle goes:
 *
 *   user:      INTRO haystack[..cut] NEEDLE haystack[cut..] QUESTION
 *   assistant: The pass key is
 *
 * rendered through the model's chat template (the assistant's turn opened and its answer
 * started, so the next tokens are the key). H is chosen so the prompt fills --ctx less
 * --max-new tokens.
 *
 * Per trial: the prompt less its last --tail tokens (by default 8: the assistant's turn marker
 * and the answer's start) is prefilled once for the bf16 reference and every configuration
 * (bd_model_prefill_multi: prefill attention is BF16 whatever the cache, so one forward pass
 * feeds every configuration's write path). Each sequence then decodes the tail tokens through
 * its own cache and decoder, as a question asked about a document already in the cache is,
 * and generates greedily up to --max-new tokens (an end-of-generation token stops it, and so
 * does the end of the first run of digits). The
 * answer is the first run of digits in the generated text; a trial succeeds when it is the key
 * exactly. Without the tail, the first digit would come from the prefill's logits, the same for
 * every configuration.
 *
 * Reported per configuration: successes / trials, the accuracy with its 95 % Wilson interval
 * (bd_eval_wilson), the trials whose answer equals the reference's (the bf16 row is the
 * reference run again: its agreement is the noise floor, 1 on the CPU backend, whose runs are
 * deterministic), and the successes per depth. The reference's own row comes first.
 *
 * Work: one trial per thread at a time (--threads), OpenBLAS at one thread per call with more
 * than one; results do not depend on the thread count. --log appends one JSON line per trial;
 * --summarize LOG reports the trials of a log (a run cut short, or split over invocations).
 */
#include <ctype.h>
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
#include <unistd.h>

#include "base/bd_rand.h"
#include "quant/bd_calib.h"
#include "model/bd_chat_template.h"
#include "model/bd_eval.h"
#include "quant/bd_kvcfg.h"
#include "model/bd_forward.h"
#include "model/bd_sampler.h"
#include "model/bd_tokenizer.h"
#include "cli.h"

#define TOOL "eval-passkey"
#define DEFAULT_KV "bf16,fp8,trtllm-nvfp4,bitdecoding-nvfp4,bitdecoding-mxfp4"
#define REF_NAME "bf16 (reference)"
#define ANSWER_MAX 16 /* bytes kept of an answer's digits */
#define MAX_DEPTHS 64
#define Z95 1.959963984540054

static const char INTRO[] =
	"There is an important piece of information hidden inside a lot of irrelevant text. "
	"Find it and memorize it. I will quiz you about the important information there.\n\n";
static const char QUESTION[] = "\n\nWhat is the pass key? Answer with the 5-digit number only.";
static const char ANSWER_START[] = "The pass key is";

struct opts {
	struct cli_eval_common ev; /* --model, --calib, --no-calib, --log, --json, --summarize, TEXT */
	const struct bd_kvcfg *cfg[BD_KVCFG_COUNT];
	int n_cfg;
	int depths, keys, max_new, tail;
	uint64_t seed;
};

/* One trial's outcome: the answers of the reference (index 0) and of each configuration. */
struct trial {
	int depth, n_prompt;
	char key[8];
	char ans[1 + BD_KVCFG_COUNT][ANSWER_MAX];
	bool done;
	double seconds;
};

struct shared {
	const struct opts *o;
	const struct bd_model *m;
	const struct bd_tokenizer *tok;
	const float *mu;
	struct bd_decode_params dp;
	const int32_t *stream;
	size_t n_stream;
	int32_t *eog;
	int n_eog;
	int T, next, done, err;
	struct trial *tr;
	char errmsg[BD_MODEL_ERR_MAX + 64];
	pthread_mutex_t lock;
	FILE *log;
	double t0;
	bool shown;
};

/* ---- one trial ------------------------------------------------------------------------------ */

/* The first run of ASCII digits of text (at most ANSWER_MAX − 1 of them) into out; "" when
 * there is none. */
static void first_digits(const char *text, size_t len, char *out)
{
	size_t i = 0, n = 0;
	while (i < len && !isdigit((unsigned char)text[i]))
		i++;
	while (i < len && isdigit((unsigned char)text[i]) && n + 1 < ANSWER_MAX)
		out[n++] = text[i++];
	out[n] = '\0';
}

/* Whether the text of gen [n] holds a run of digits followed by something else: the answer's
 * first run of digits is complete, and more tokens cannot change it. */
static bool digits_done(const struct bd_tokenizer *tok, const int32_t *gen, int n)
{
	char *text = NULL;
	size_t len = 0, i = 0;
	bool done = false;
	if (bd_tokenizer_decode(tok, gen, (size_t)n, BD_TOK_SKIP_SPECIAL, &text, &len) < 0)
		return false;
	while (i < len && !isdigit((unsigned char)text[i]))
		i++;
	if (i < len) {
		while (i < len && isdigit((unsigned char)text[i]))
			i++;
		done = i < len;
	}
	free(text);
	return done;
}

/* Trial t's prompt with a haystack of H tokens: *ret_ids (malloc'ed), *ret_n of them. */
static int build_prompt(const struct shared *sh, int t, int H, const char *key, int depth,
			int32_t **ret_ids, size_t *ret_n, char *err)
{
	const struct opts *o = sh->o;
	double stride = sh->T > 1 ? (double)(sh->n_stream - (size_t)H) / (double)(sh->T - 1) : 0.0;
	const int32_t *win = sh->stream + (size_t)floor(stride * t);
	char *hay = NULL, *user = NULL;
	size_t hay_len = 0;
	int32_t *chat = NULL, *start = NULL, *ids = NULL;
	size_t n_chat = 0, n_start = 0;
	int r;

	if ((r = bd_tokenizer_decode(sh->tok, win, (size_t)H, 0, &hay, &hay_len)) < 0) {
		snprintf(err, BD_MODEL_ERR_MAX, "cannot decode the haystack: %s", strerror(-r));
		return r;
	}
	double frac = o->depths > 1 ? (double)depth / (o->depths - 1) : 0.5;
	size_t cut = (size_t)floor(frac * (double)hay_len);
	while (cut < hay_len && hay[cut] != ' ' && hay[cut] != '\n')
		cut++;
	char needle[128];
	snprintf(needle, sizeof(needle), "%sThe pass key is %s. Remember it. %s is the pass key.%s",
		 cut > 0 ? " " : "", key, key, cut < hay_len ? " " : "");
	size_t ul = strlen(INTRO) + hay_len + strlen(needle) + strlen(QUESTION) + 1;
	if (!(user = malloc(ul))) {
		r = -ENOMEM;
		goto out;
	}
	snprintf(user, ul, "%s%.*s%s%.*s%s", INTRO, (int)cut, hay, needle, (int)(hay_len - cut),
		 hay + cut, QUESTION);
	/* text from the texts holds no NUL; a decoded haystack that did would cut the prompt */
	struct bd_chat_msg msg = { .role = "user", .content = user };
	char terr[BD_TOKENIZER_ERR_MAX];
	if ((r = bd_tokenizer_chat_apply(sh->tok, &msg, 1, true, &chat, &n_chat, terr)) < 0) {
		snprintf(err, BD_MODEL_ERR_MAX, "chat template: %.200s", terr);
		goto out;
	}
	if ((r = bd_tokenizer_encode(sh->tok, ANSWER_START, strlen(ANSWER_START), 0, &start,
				     &n_start)) < 0) {
		snprintf(err, BD_MODEL_ERR_MAX, "cannot tokenize the answer's start");
		goto out;
	}
	if (!(ids = malloc(sizeof(*ids) * (n_chat + n_start)))) {
		r = -ENOMEM;
		goto out;
	}
	memcpy(ids, chat, sizeof(*ids) * n_chat);
	memcpy(ids + n_chat, start, sizeof(*ids) * n_start);
	*ret_ids = ids;
	*ret_n = n_chat + n_start;
	r = 0;
out:
	if (r == -ENOMEM)
		snprintf(err, BD_MODEL_ERR_MAX, "out of memory");
	free(hay);
	free(user);
	free(chat);
	free(start);
	return r;
}

/* The tail tokens decoded through s, then greedy generation: the answer's digits into ans. */
static int answer(const struct shared *sh, struct bd_seq *s, const int32_t *tail, int n_tail,
		  float *logits, char *ans, char *err)
{
	const struct opts *o = sh->o;
	int32_t gen[256];
	int n_gen = 0, V = sh->m->hp.n_vocab, r;

	for (int i = 0; i < n_tail; i++)
		if ((r = bd_model_decode(sh->m, s, tail[i], logits)) < 0) {
			snprintf(err, BD_MODEL_ERR_MAX, "decode: %s", strerror(-r));
			return r;
		}
	for (;;) {
		int32_t y = bd_argmax(logits, V);
		bool eog = false;
		for (int i = 0; i < sh->n_eog; i++)
			eog = eog || sh->eog[i] == y;
		if (eog)
			break;
		gen[n_gen++] = y;
		if (n_gen >= o->max_new || digits_done(sh->tok, gen, n_gen))
			break;
		if ((r = bd_model_decode(sh->m, s, y, logits)) < 0) {
			snprintf(err, BD_MODEL_ERR_MAX, "decode: %s", strerror(-r));
			return r;
		}
	}
	char *text = NULL;
	size_t len = 0;
	if ((r = bd_tokenizer_decode(sh->tok, gen, (size_t)n_gen, BD_TOK_SKIP_SPECIAL, &text,
				     &len)) < 0) {
		snprintf(err, BD_MODEL_ERR_MAX, "cannot decode the answer: %s", strerror(-r));
		return r;
	}
	first_digits(text, len, ans);
	free(text);
	return 0;
}

static int run_trial(struct shared *sh, int t, char *err)
{
	const struct opts *o = sh->o;
	struct trial *tr = &sh->tr[t];
	int n_seq = o->n_cfg + 1, budget = o->ev.ctx - o->max_new, r;
	struct bd_seq **seqs = calloc((size_t)n_seq, sizeof(*seqs));
	float *logits = malloc(sizeof(float) * (size_t)sh->m->hp.n_vocab);
	int32_t *ids = NULL;
	size_t n = 0;
	struct bd_rng rng;

	if (!seqs || !logits) {
		snprintf(err, BD_MODEL_ERR_MAX, "out of memory");
		r = -ENOMEM;
		goto out;
	}
	bd_rng_seed(&rng, o->seed, (uint64_t)t);
	snprintf(tr->key, sizeof(tr->key), "%05d", 10000 + (int)(bd_rng_u64(&rng) % 90000u));
	tr->depth = t % o->depths;
	/* the haystack's size: a first guess, then corrected by what the prompt came to */
	int H = budget > 384 ? budget - 192 : budget / 2;
	for (int tries = 0;; tries++) {
		if (H < 1 || (size_t)H > sh->n_stream) {
			snprintf(err, BD_MODEL_ERR_MAX, "no haystack fits a context of %d", o->ev.ctx);
			r = -EINVAL;
			goto out;
		}
		free(ids);
		ids = NULL;
		if ((r = build_prompt(sh, t, H, tr->key, tr->depth, &ids, &n, err)) < 0)
			goto out;
		if (n <= (size_t)budget && (n + 8 >= (size_t)budget || tries >= 4))
			break;
		H += budget - (int)n - (n <= (size_t)budget ? 0 : 4);
	}
	if ((int)n <= o->tail) {
		snprintf(err, BD_MODEL_ERR_MAX, "the prompt (%zu tokens) is not longer than --tail", n);
		r = -EINVAL;
		goto out;
	}
	tr->n_prompt = (int)n;

	struct bd_seq_opts so = { .max_tokens = o->ev.ctx, .mu_k = sh->mu, .dp = &sh->dp };
	for (int i = 0; i < n_seq; i++)
		if ((r = bd_seq_new(sh->m, i == 0 ? bd_kvcfg_find("bf16") : o->cfg[i - 1], &so,
				    &seqs[i], err)) < 0)
			goto out;
	int n_pre = (int)n - o->tail;
	if ((r = bd_model_prefill_multi(sh->m, seqs, n_seq, ids, n_pre, NULL)) < 0) {
		snprintf(err, BD_MODEL_ERR_MAX, "prefill: %s", strerror(-r));
		goto out;
	}
	for (int i = 0; i < n_seq; i++) {
		if ((r = answer(sh, seqs[i], ids + n_pre, o->tail, logits, tr->ans[i], err)) < 0)
			goto out;
		bd_seq_free(seqs[i]); /* its memory goes before the next one decodes */
		seqs[i] = NULL;
	}
	pthread_mutex_lock(&sh->lock);
	if (!sh->shown) { /* what the decoded tail is, once */
		char *txt = NULL;
		size_t tl = 0;
		if (bd_tokenizer_decode(sh->tok, ids + n_pre, (size_t)o->tail, 0, &txt, &tl) == 0)
			fprintf(o->ev.json ? stderr : stdout, "decoded tail (%d tokens): \"%s\"\n",
				o->tail, txt);
		free(txt);
		sh->shown = true;
	}
	pthread_mutex_unlock(&sh->lock);
	r = 0;
out:
	for (int i = 0; seqs && i < n_seq; i++)
		bd_seq_free(seqs[i]);
	free(seqs);
	free(logits);
	free(ids);
	return r;
}

static void log_trial(struct shared *sh, int t)
{
	const struct trial *tr = &sh->tr[t];
	json_t *j = json_object(), *a = json_object();
	if (!j || !a)
		goto out;
	json_object_set_new(a, REF_NAME, json_string(tr->ans[0]));
	for (int i = 0; i < sh->o->n_cfg; i++)
		json_object_set_new(a, sh->o->cfg[i]->name, json_string(tr->ans[1 + i]));
	json_object_set_new(j, "trial", json_integer(t));
	json_object_set_new(j, "ctx", json_integer(sh->o->ev.ctx));
	json_object_set_new(j, "depth", json_integer(tr->depth));
	json_object_set_new(j, "depths", json_integer(sh->o->depths));
	json_object_set_new(j, "key", json_string(tr->key));
	json_object_set_new(j, "prompt_tokens", json_integer(tr->n_prompt));
	json_object_set_new(j, "answers", a);
	a = NULL;
	json_object_set_new(j, "seconds", json_real(tr->seconds));
	json_dumpf(j, sh->log, JSON_COMPACT | JSON_REAL_PRECISION(4));
	fputc('\n', sh->log);
	fflush(sh->log);
out:
	json_decref(a);
	json_decref(j);
}

static void *worker(void *arg)
{
	struct shared *sh = arg;
	char err[BD_MODEL_ERR_MAX];

	pthread_mutex_lock(&sh->lock);
	while (!sh->err && sh->next < sh->T) {
		int t = sh->next++;
		pthread_mutex_unlock(&sh->lock);
		double t0 = bd_now_s();
		err[0] = '\0';
		int r = run_trial(sh, t, err);
		pthread_mutex_lock(&sh->lock);
		if (r < 0) {
			if (!sh->err) {
				sh->err = r;
				snprintf(sh->errmsg, sizeof(sh->errmsg), "trial %d: %s", t,
					 err[0] ? err : strerror(-r));
			}
			break;
		}
		sh->tr[t].seconds = bd_now_s() - t0;
		sh->tr[t].done = true;
		sh->done++;
		if (sh->log)
			log_trial(sh, t);
		double el = bd_now_s() - sh->t0;
		fprintf(stderr, "[" TOOL "] trial %d (depth %d, %d tokens) %.0f s; %d/%d, elapsed "
				"%.0f s, about %.0f s left\n",
			t, sh->tr[t].depth, sh->tr[t].n_prompt, sh->tr[t].seconds, sh->done, sh->T, el,
			el / sh->done * (sh->T - sh->done));
	}
	pthread_mutex_unlock(&sh->lock);
	return NULL;
}

/* ---- the report ----------------------------------------------------------------------------- */

/* The table of the trials tr [T] (done ones only) with answers of names [n_rows] (the reference
 * first), and the JSON to stdout with --json. Returns 0 or -1. */
static int report(const struct opts *o, const char *const *names, int n_rows,
		  const struct trial *tr, int T, int depths)
{
	FILE *f = o->ev.json ? stderr : stdout;
	json_t *arr = o->ev.json ? json_array() : NULL;
	int n = 0;
	for (int t = 0; t < T; t++)
		n += tr[t].done;
	if (n == 0) {
		fprintf(stderr, "bdfp4 " TOOL ": no finished trial\n");
		return -1;
	}
	fprintf(f, "\n%d trials: accuracy = exact key; 95 %% Wilson interval; \"= ref\": answer equal "
		   "to the bf16 reference's; per depth: successes at depth 0 .. %d (start to end "
		   "of the haystack)\n\n",
		n, depths - 1);
	fprintf(f, "| config | correct | accuracy | 95 %% interval | = ref | per depth |\n");
	fprintf(f, "| --- | --- | --- | --- | --- | --- |\n");
	for (int i = 0; i < n_rows; i++) {
		int ok = 0, same = 0, by[MAX_DEPTHS] = { 0 };
		for (int t = 0; t < T; t++) {
			if (!tr[t].done)
				continue;
			bool c = strcmp(tr[t].ans[i], tr[t].key) == 0;
			ok += c;
			same += strcmp(tr[t].ans[i], tr[t].ans[0]) == 0;
			if (c && tr[t].depth >= 0 && tr[t].depth < MAX_DEPTHS)
				by[tr[t].depth]++;
		}
		double lo = 0.0, hi = 0.0;
		bd_eval_wilson(ok, n, Z95, &lo, &hi);
		char per[4 * MAX_DEPTHS + 1] = "";
		size_t pl = 0;
		for (int d = 0; d < depths && d < MAX_DEPTHS; d++)
			pl += (size_t)snprintf(per + pl, sizeof(per) - pl, d ? " %d" : "%d", by[d]);
		fprintf(f, "| %s | %d/%d | %.3f | %.3f–%.3f | %d/%d | %s |\n", names[i], ok, n,
			(double)ok / n, lo, hi, same, n, per);
		if (arr) {
			json_t *j = json_pack("{s:s, s:i, s:i, s:f, s:f, s:f, s:i}", "config", names[i],
					      "correct", ok, "trials", n, "accuracy", (double)ok / n,
					      "wilson_lo", lo, "wilson_hi", hi, "same_as_ref", same);
			if (!j || json_array_append_new(arr, j)) {
				json_decref(arr);
				return -1;
			}
		}
	}
	int r = 0;
	if (arr) {
		r = json_dumpf(arr, stdout, JSON_INDENT(2) | JSON_REAL_PRECISION(6));
		fputc('\n', stdout);
		json_decref(arr);
	}
	return r < 0 ? -1 : 0;
}

/* --summarize: the trials of a --log file of one context (the first record's), for the
 * configurations of --kv that every counted record answers. */
struct summary {
	const struct opts *o;
	const char *path;
	const char *const *names; /* [1 + n_cfg] */
	struct trial *tr;         /* [T] of cap */
	int T, cap, ctx, depths;
};

static int summary_record(void *ctx, json_t *j, int lineno)
{
	struct summary *S = ctx;
	const struct opts *o = S->o;
	json_t *a = json_object_get(j, "answers"), *jk = json_object_get(j, "key");
	if (!j || !json_is_object(a) || !json_is_string(jk) ||
	    !json_is_integer(json_object_get(j, "ctx")) ||
	    !json_is_integer(json_object_get(j, "depth"))) {
		fprintf(stderr, "bdfp4 " TOOL ": %s:%d: not a trial record\n", S->path, lineno);
		return -1;
	}
	int c = (int)json_integer_value(json_object_get(j, "ctx"));
	int dd = (int)json_integer_value(json_object_get(j, "depths"));
	if (S->ctx < 0) {
		S->ctx = c;
		S->depths = dd;
	}
	bool all = c == S->ctx && dd == S->depths;
	for (int i = 0; i < 1 + o->n_cfg && all; i++)
		all = json_is_string(json_object_get(a, S->names[i]));
	if (!all)
		return 0;
	if (S->T == S->cap) {
		int cap = S->cap ? 2 * S->cap : 128;
		struct trial *t2 = realloc(S->tr, sizeof(*S->tr) * (size_t)cap);
		if (!t2) {
			fprintf(stderr, "bdfp4 " TOOL ": out of memory\n");
			return -1;
		}
		S->tr = t2;
		S->cap = cap;
	}
	struct trial *x = &S->tr[S->T++];
	memset(x, 0, sizeof(*x));
	x->done = true;
	x->depth = (int)json_integer_value(json_object_get(j, "depth"));
	snprintf(x->key, sizeof(x->key), "%s", json_string_value(jk));
	for (int i = 0; i < 1 + o->n_cfg; i++)
		snprintf(x->ans[i], ANSWER_MAX, "%s",
			 json_string_value(json_object_get(a, S->names[i])));
	return 0;
}

/* The report's rows: the reference, then the configurations of --kv. */
static void row_names(const struct opts *o, const char *names[1 + BD_KVCFG_COUNT])
{
	names[0] = REF_NAME;
	for (int i = 0; i < o->n_cfg; i++)
		names[1 + i] = o->cfg[i]->name;
}

static int summarize(const struct opts *o, const char *path)
{
	const char *names[1 + BD_KVCFG_COUNT];
	struct summary S = { .o = o, .path = path, .names = names, .ctx = -1, .depths = -1 };
	int rc = -1;

	row_names(o, names);
	if (cli_eval_read_log(TOOL, path, summary_record, &S) == 0) {
		fprintf(o->ev.json ? stderr : stdout, TOOL " summary of %s: context %d, %d trials\n",
			path, S.ctx, S.T);
		if (S.T > 0 && S.depths > 0 && S.depths <= MAX_DEPTHS)
			rc = report(o, names, 1 + o->n_cfg, S.tr, S.T, S.depths);
		else
			fprintf(stderr, "bdfp4 " TOOL ": no trial of every configuration in %s\n",
				path);
	}
	free(S.tr);
	return rc;
}

/* ---- the command ---------------------------------------------------------------------------- */

static void usage(FILE *f)
{
	cli_eval_usage_head(f, TOOL,
			    "Passkey retrieval: a 5-digit key hidden at one of --depths depths of a haystack cut\n"
			    "from the TEXT files, asked for through the chat template, answered greedily with\n"
			    "each KV configuration; accuracy with its 95% Wilson interval.\n");
	fprintf(f,
		"  --kv LIST           comma-separated configurations (default %s)\n"
		"  --ctx N             context: prompt + answer (default %d)\n"
		"  --depths N          needle depths, evenly from start to end (default 10)\n"
		"  --keys N            trials per depth (default 10)\n"
		"  --max-new N         answer tokens at most (default 8)\n"
		"  --tail N            last prompt tokens decoded through each cache (default 8)\n"
		"  --seed S            the keys' seed (default 0)\n",
		DEFAULT_KV, CLI_DEFAULT_CTX);
	cli_eval_usage_tail(f, "trial", "a --log file's trials");
}

int cmd_eval_passkey(int argc, char **argv)
{
	enum {
		O_DEPTHS = 256, O_KEYS, O_MAXNEW, O_TAIL
	};
	static const struct option lopts[] = {
		CLI_OPTS_EVAL,
		{ "depths", required_argument, NULL, O_DEPTHS },
		{ "keys", required_argument, NULL, O_KEYS },
		{ "max-new", required_argument, NULL, O_MAXNEW },
		{ "tail", required_argument, NULL, O_TAIL },
		CLI_OPT_SEED,
		CLI_OPTS_NULL,
	};
	struct opts o = { .depths = 10, .keys = 10, .max_new = 8,
			  .tail = 8 };
	const struct cli_int_opt ints[] = {
		{ O_DEPTHS, 1, MAX_DEPTHS, &o.depths, "--depths wants an integer in 1..64, not '%s'" },
		{ O_KEYS, 1, 1 << 16, &o.keys, "--keys wants an integer ≥ 1, not '%s'" },
		{ O_MAXNEW, 1, 256, &o.max_new, "--max-new wants an integer in 1..256, not '%s'" },
		{ O_TAIL, 1, 4096, &o.tail, "--tail wants an integer in 1..4096, not '%s'" },
	};
	struct bd_sampler_params sp = bd_sampler_params_greedy();
	int k;

	cli_eval_init(&o.ev, 64);
	if (cli_parse_kv_list(TOOL, DEFAULT_KV, o.cfg, &o.n_cfg) < 0)
		return 1;
	if ((k = cli_eval_parse(TOOL, usage, lopts, ints, sizeof(ints) / sizeof(ints[0]), argc, argv,
				&o.ev, o.cfg, &o.n_cfg, &sp)) >= 0)
		return k;
	o.seed = sp.seed;
	if (o.ev.summary)
		return summarize(&o, o.ev.summary) < 0 ? 1 : 0;
	if (o.tail + o.max_new + 64 > o.ev.ctx)
		return cli_bad_usage(TOOL, usage, "--ctx is too small for --tail and --max-new%s",
				     "");

	int rc = 1;
	struct cli_eval_input in = { 0 };
	struct shared sh = { .o = &o };
	double t_start = bd_now_s();
	char terr[BD_TOKENIZER_ERR_MAX];

	pthread_mutex_init(&sh.lock, NULL);
	if (cli_eval_load(TOOL, &o.ev, &in) < 0)
		goto out;
	const struct bd_model *m = in.m;
	const struct bd_tokenizer *tok = in.tok;
	const struct bd_calib *cal = in.cal;
	const char *model_path = in.model_path;
	if (bd_tokenizer_chat_check(tok, terr) < 0) {
		fprintf(stderr, "bdfp4 " TOOL ": %s: %s\n", model_path, terr);
		goto out;
	}
	sh.n_stream = in.n_stream;
	if (cli_eog_ids(tok, &sh.eog, &sh.n_eog) < 0)
		goto oom;
	sh.m = m;
	sh.tok = tok;
	sh.stream = in.stream;
	sh.mu = cal ? cal->mu_k : NULL;
	cli_eval_decode_params(cal, &sh.dp);
	sh.T = o.depths * o.keys;
	sh.tr = calloc((size_t)sh.T, sizeof(*sh.tr));
	if (!sh.tr)
		goto oom;

	FILE *info = o.ev.json ? stderr : stdout;
	fprintf(info, TOOL ": %s, ctx %d, %d depths x %d keys = %d trials, greedy, answers of at "
		      "most %d tokens, the last %d prompt tokens decoded\n",
		model_path, o.ev.ctx, o.depths, o.keys, sh.T, o.max_new, o.tail);
	cli_eval_print_inputs(info, &in, &o.ev);
	fputc('\n', info);
	fflush(info);

	if (cli_eval_open_log(TOOL, o.ev.log, &sh.log) < 0)
		goto out;
	sh.t0 = bd_now_s();
	int n_th = cli_eval_threads(TOOL, o.ev.threads < sh.T ? o.ev.threads : sh.T, worker, &sh);
	if (n_th < 0)
		goto out;
	if (sh.err) {
		fprintf(stderr, "bdfp4 " TOOL ": %s\n", sh.errmsg);
		goto out;
	}
	fprintf(info, "\nwall time %.0f s (%d threads)\n", bd_now_s() - t_start, n_th);
	const char *names[1 + BD_KVCFG_COUNT];
	row_names(&o, names);
	if (report(&o, names, 1 + o.n_cfg, sh.tr, sh.T, o.depths) < 0)
		goto out;
	rc = 0;
	goto out;
oom:
	fprintf(stderr, "bdfp4 " TOOL ": out of memory\n");
out:
	if (sh.log)
		fclose(sh.log);
	free(sh.tr);
	free(sh.eog);
	cli_eval_input_free(&in);
	pthread_mutex_destroy(&sh.lock);
	return rc;
}
