/* cli.h — the subcommands of the bdfp4 tool. Each takes the arguments after the tool's name
 * (argv[0] is the subcommand) and returns the process exit status: 0 success, 1 failure,
 * 2 bad usage. */
#ifndef BDFP4_CLI_H
#define BDFP4_CLI_H

#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "base/bd_clock.h"

int cmd_quant_report(int argc, char **argv);
int cmd_generate(int argc, char **argv);
int cmd_client(int argc, char **argv);
int cmd_serve(int argc, char **argv);
int cmd_keygen(int argc, char **argv);
int cmd_kv_where(int argc, char **argv);

int cmd_calibrate(int argc, char **argv);
int cmd_eval_kl(int argc, char **argv);
int cmd_eval_passkey(int argc, char **argv);

/* The evaluations' inputs (cli/evalio.c). cli_read_texts: the files paths[n] read whole and
 * joined with blank lines into *ret (malloc'ed, NUL after the *ret_len bytes; the caller frees
 * it). cli_parse_kv_list: the comma-separated configuration names of list (bd_kvcfg.h, or the
 * eval-only emu-* formats of bd_kvemul.h) into cfg
 * [BD_KVCFG_COUNT] in order, a name given twice kept once, *ret_n of them. Both return 0, or -1
 * after printing why ("bdfp4 TOOL: ..."; an empty list prints nothing) with the outputs
 * unchanged. */
struct bd_kvcfg;
/* The options every evaluation takes, with the same codes in each option table. */
enum { CLI_O_MODEL = 300, CLI_O_KV, CLI_O_CTX, CLI_O_CALIB, CLI_O_NOCALIB, CLI_O_THREADS,
       CLI_O_LOG, CLI_O_JSON, CLI_O_SUMMARIZE };
/* --calib FILE and --no-calib, also generate's. */
#define CLI_OPTS_CALIB                                                \
	{ "calib", required_argument, NULL, CLI_O_CALIB },            \
	{ "no-calib", no_argument, NULL, CLI_O_NOCALIB }
#define CLI_OPTS_EVAL                                                 \
	{ "model", required_argument, NULL, CLI_O_MODEL },            \
	{ "kv", required_argument, NULL, CLI_O_KV },                  \
	{ "ctx", required_argument, NULL, CLI_O_CTX },                \
	CLI_OPTS_CALIB,                                               \
	{ "threads", required_argument, NULL, CLI_O_THREADS },        \
	{ "log", required_argument, NULL, CLI_O_LOG },                \
	{ "json", no_argument, NULL, CLI_O_JSON },                    \
	{ "summarize", required_argument, NULL, CLI_O_SUMMARIZE },    \
	{ "help", no_argument, NULL, 'h' }
/* The values of those options but --kv, with the TEXT arguments; cli_eval_init sets the
 * defaults: --ctx CLI_DEFAULT_CTX of at least ctx_min, --threads the CPUs online. */
struct cli_eval_common {
	const char *model, *calib, *log, *summary;
	bool json, no_calib;
	int ctx, ctx_min, threads;
	char **texts; /* [n_texts] */
	int n_texts;
};
/* What an evaluation runs on: the model (e->model as cli_model_path takes it) and its
 * tokenizer, the calibration for e->ctx (e->calib, else the default file; none with
 * e->no_calib), and the texts of e tokenized as plain text (no special tokens). */
struct cli_eval_input {
	char model_path[PATH_MAX + 64];
	struct bd_model *m;
	struct bd_tokenizer *tok;
	struct bd_calib *cal; /* NULL: uncalibrated */
	int32_t *stream;      /* [n_stream] the texts' tokens */
	size_t n_stream;
};
/* Fills in (zeroed first). Returns 0, or -1 after printing why ("bdfp4 TOOL: ...": the model,
 * a ctx beyond its context, the calibration, a text), with what was made freed. */
int cli_eval_load(const char *tool, const struct cli_eval_common *e, struct cli_eval_input *in);
/* Frees what cli_eval_load made (a zeroed or failed one too). */
void cli_eval_input_free(struct cli_eval_input *in);
int cli_read_texts(const char *tool, char *const *paths, int n, char **ret, size_t *ret_len);
void cli_eval_init(struct cli_eval_common *e, int ctx_min);
/* An evaluation's command line: getopt_long over lopts (optstring ":h"), each option one of
 * ints (cli_int_opt, n_ints of them), one of CLI_OPTS_EVAL's (into e), --kv (cli_parse_kv_list into
 * cfg[BD_KVCFG_COUNT], *n_cfg), a sampling option into sp (cli_sampling_opt), or --help and
 * the unknown (cli_getopt_other); then the TEXT arguments into e, which stand with --summarize
 * when there are none, without it when there are some, and --calib not with --no-calib (a
 * summary loads neither). Returns -1 when the command goes on, else its exit status (0 after
 * --help, 2 after cli_bad_usage). */
struct option;
struct cli_int_opt;
struct bd_sampler_params;
int cli_eval_parse(const char *tool, void (*usage)(FILE *f), const struct option *lopts,
		   const struct cli_int_opt *ints, size_t n_ints, int argc, char **argv,
		   struct cli_eval_common *e, const struct bd_kvcfg **cfg, int *n_cfg,
		   struct bd_sampler_params *sp);
/* An evaluation's usage in three parts: cli_eval_usage_head the synopsis of tool, about (its
 * paragraph, ending in a newline) and --model; then the tool's own options, in the same
 * columns (names from column 3, help from column 23); cli_eval_usage_tail the options every
 * evaluation takes, item what one of its threads works on and its --log records ("run"),
 * summary what --summarize reports ("a --log file's runs"). */
void cli_eval_usage_head(FILE *f, const char *tool, const char *about);
void cli_eval_usage_tail(FILE *f, const char *item, const char *summary);
/* The decode parameters of calibration cal (NULL: uncalibrated): bd_decode_params_default()
 * with the calibration's τ and c (NUMERICS.md §7). */
struct bd_decode_params;
void cli_eval_decode_params(const struct bd_calib *cal, struct bd_decode_params *ret);
/* On f: the calibration line of in, then "texts: N tokens from" and the texts of e, without
 * the line's end (the caller adds what it says of them). */
void cli_eval_print_inputs(FILE *f, const struct cli_eval_input *in,
			   const struct cli_eval_common *e);
/* --log: path (NULL: none, *ret NULL) opened for appending into *ret. Returns 0, or -1 after
 * printing why ("bdfp4 TOOL: cannot open ..."). */
int cli_eval_open_log(const char *tool, const char *path, FILE **ret);
/* worker(arg) on n ≥ 1 threads (OpenBLAS single-threaded inside each when n > 1), joined.
 * Returns how many ran, or -1 after printing why (memory, or not one thread started). */
int cli_eval_threads(const char *tool, int n, void *(*worker)(void *), void *arg);
/* --summarize's reading: each line of the log at path parsed (NULL when it is no JSON) and
 * handed to rec with its 1-based number; rec returns < 0 to stop (after printing why), else
 * ≥ 0; the value is freed after it returns. Returns 0 at the end of the file, -1 when it could
 * not be opened (printed) or rec stopped. */
struct json_t;
int cli_eval_read_log(const char *tool, const char *path,
		      int (*rec)(void *ctx, struct json_t *j, int lineno), void *ctx);

int cli_parse_kv_list(const char *tool, const char *list, const struct bd_kvcfg **cfg, int *ret_n);

/* Number arguments (cli/args.c): the whole of s a decimal integer in [lo, hi] (cli_parse_int
 * also needs [lo, hi] inside int), or a finite float; false leaves *ret unchanged. */
bool cli_parse_long(const char *s, long lo, long hi, long *ret);
bool cli_parse_int(const char *s, long lo, long hi, int *ret);
bool cli_parse_float(const char *s, float *ret);

/* An integer option of a subcommand: its getopt_long code, the allowed range [lo, hi] (inside
 * int), where the value goes and the message for cli_bad_usage when it is refused (one %s: the
 * value). */
struct cli_int_opt {
	int code;
	long lo, hi;
	int *ret;
	const char *bad;
};

/* When c (getopt_long's return) is the code of one of the n entries of opts, parses arg into
 * that entry's *ret (cli_parse_int). Returns 0 when c is none of them, 1 when arg was taken,
 * -1 when it was refused (*ret unchanged; *ret_bad: the entry's message). */
int cli_int_opt(const struct cli_int_opt *opts, size_t n, int c, const char *arg,
		const char **ret_bad);

/* Bad usage (cli/args.c): "bdfp4 TOOL: " and fmt (one %s: arg) on stderr, then the tool's
 * usage; returns 2, the exit status of bad usage. */
int cli_bad_usage(const char *tool, void (*usage)(FILE *f), const char *fmt, const char *arg);

/* n_args, the arguments left after the options of a subcommand that takes one PROMPT: NULL
 * when there is one, else the message for cli_bad_usage (with an empty arg). */
const char *cli_prompt_bad(int n_args);

/* The cases a subcommand's getopt_long switch leaves to this (opterr 0, optstring starting
 * ":h"): 'h' prints the usage to stdout (exit status 0), ':' (an option without its value)
 * and anything else (an unknown option) are bad usage (2). c: getopt_long's return. */
int cli_getopt_other(const char *tool, void (*usage)(FILE *f), int c, char **argv);

/* The end of every subcommand's option table: --help (getopt_long returns 'h', as for -h), then
 * the terminating entry. */
#define CLI_OPTS_END { "help", no_argument, NULL, 'h' }, { NULL, 0, NULL, 0 }
/* The end of a table that lists --help in a group of its own (CLI_OPTS_EVAL). */
#define CLI_OPTS_NULL { NULL, 0, NULL, 0 }

/* The sampling options, with the same codes in every subcommand's option table (each lists
 * the ones it takes). */
enum { CLI_O_TEMP = 200, CLI_O_TOPK, CLI_O_TOPP, CLI_O_SEED };
#define CLI_OPT_TEMPERATURE { "temperature", required_argument, NULL, CLI_O_TEMP }
#define CLI_OPT_TOP_K { "top-k", required_argument, NULL, CLI_O_TOPK }
#define CLI_OPT_TOP_P { "top-p", required_argument, NULL, CLI_O_TOPP }
#define CLI_OPT_SEED { "seed", required_argument, NULL, CLI_O_SEED }

/* A generation's options, with the same codes in the option table of each subcommand that
 * generates (client, generate): --max-tokens N, the sampling options and --stop STRING. */
enum { CLI_O_MAXTOK = 220, CLI_O_STOP };
#define CLI_GEN_MAX_STOPS 16
#define CLI_OPTS_GENERATION                                                       \
	{ "max-tokens", required_argument, NULL, CLI_O_MAXTOK }, CLI_OPT_TEMPERATURE, \
		CLI_OPT_TOP_K, CLI_OPT_TOP_P, CLI_OPT_SEED,                           \
		{ "stop", required_argument, NULL, CLI_O_STOP }
/* Their values: max_tokens (default 256), sp (greedy), stops[n_stops] of at most max_stops
 * (≤ CLI_GEN_MAX_STOPS, the subcommand's limit), all set by cli_gen_init. */
struct cli_gen_opts {
	int max_tokens;
	struct bd_sampler_params *sp;
	const char *stops[CLI_GEN_MAX_STOPS];
	int n_stops, max_stops;
};
void cli_gen_init(struct cli_gen_opts *g, struct bd_sampler_params *sp, int max_stops);
/* The usage lines of those options (columns 3 and 22), seed0 what --seed 0 means. */
void cli_gen_usage(FILE *f, int max_stops, const char *seed0);
/* When c (getopt_long's return) is one of CLI_OPTS_GENERATION's codes: arg into g (a stop string
 * must be non-empty, one over max_stops is refused). Returns 1 when it took arg, 0 when c is
 * none of them, 2 (bad usage) after cli_bad_usage. */
int cli_gen_opt(const char *tool, void (*usage)(FILE *f), int c, const char *arg,
		struct cli_gen_opts *g);

/* The value arg of sampling option opt (one of CLI_O_*) into sp: --temperature a number ≥ 0,
 * --top-k an integer ≥ 0, --top-p a number in (0, 1], --seed an unsigned 64-bit integer.
 * Returns NULL, or (a bad value; sp unchanged) the message for cli_bad_usage. */
struct bd_sampler_params;
const char *cli_sampling_opt(int opt, const char *arg, struct bd_sampler_params *sp);

/* The model and its tokenizer from the GGUF file at path (cli/load.c), the file unmapped
 * again. Returns 0, or -1 after printing why ("bdfp4 TOOL: path: ..."). */
struct bd_model;
struct bd_tokenizer;
int cli_load_model(const char *tool, const char *path, struct bd_model **ret_m,
		   struct bd_tokenizer **ret_tok);

/* The ids generation stops at (bd_tokenizer_is_eog), malloc'ed into *ret_ids (the caller frees
 * it), *ret_n of them. Returns 0 or -ENOMEM. */
int cli_eog_ids(const struct bd_tokenizer *tok, int32_t **ret_ids, int *ret_n);

/* Calibration lookup shared by calibrate, eval-kl and generate (cli/calibrate.c). */
struct bd_model_hparams;
struct bd_calib;
#define CLI_DEFAULT_CTX 2048 /* context of `make calib` and of eval-kl without --ctx */
/* The model path: opt, else $BD_MODEL, else the embedded model next to the binary. */
void cli_model_path(const char *opt, char *buf, size_t cap);
/* MODEL-without-.gguf.ctxN.calib: where `make calib` writes and the tools look. */
void cli_calib_default_path(const char *model_path, int n_ctx, char *buf, size_t cap);
/* The calibration to use: explicit_path (any error is fatal), else the default file for
 * auto_ctx if present (a mismatch warns and runs uncalibrated). want_ctx: the context the
 * file must have, 0 for any. *ret NULL: uncalibrated. Returns 0, or -1 after printing why. */
int cli_calib_setup(const char *tool, const char *explicit_path, const char *model_path,
		    const struct bd_model_hparams *hp, int want_ctx, int auto_ctx, bool quiet,
		    struct bd_calib **ret);

#endif
