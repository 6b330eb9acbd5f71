/* cli.h — the subcommands of the bdfp4 tool. Each takes the arguments after the tool's name
 * (argv[0] is the subcommand) and returns the process exit status: 0 success, 1 failure,
 * 2 bad usage. */
#ifndef BDFP4_CLI_H
#define BDFP4_CLI_H

#include <stdbool.h>
#include <stddef.h>

#include "base/bd_clock.h"

int cmd_quant_report(int argc, char **argv);
int cmd_generate(int argc, char **argv);
int cmd_client(int argc, char **argv);

int cmd_calibrate(int argc, char **argv);
int cmd_eval_kl(int argc, char **argv);

/* Number arguments (cli/args.c): the whole of s a decimal integer in [lo, hi] (cli_parse_int
 * also needs [lo, hi] inside int), or a finite float; false leaves *ret unchanged. */
bool cli_parse_long(const char *s, long lo, long hi, long *ret);
bool cli_parse_int(const char *s, long lo, long hi, int *ret);
bool cli_parse_float(const char *s, float *ret);

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
