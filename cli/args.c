/* args.c — the arguments of the bdfp4 subcommands: numbers, the sampling options, bad usage
 * (cli.h). */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "model/bd_sampler.h"
#include "cli.h"

bool cli_parse_long(const char *s, long lo, long hi, long *ret)
{
	char *end;
	errno = 0;
	long v = strtol(s, &end, 10);
	if (errno || end == s || *end || v < lo || v > hi)
		return false;
	*ret = v;
	return true;
}

bool cli_parse_int(const char *s, long lo, long hi, int *ret)
{
	long v;
	if (hi > INT_MAX || lo < INT_MIN || !cli_parse_long(s, lo, hi, &v))
		return false;
	*ret = (int)v;
	return true;
}

bool cli_parse_float(const char *s, float *ret)
{
	char *end;
	errno = 0;
	float v = strtof(s, &end);
	if (errno || end == s || *end || !isfinite(v))
		return false;
	*ret = v;
	return true;
}

int cli_int_opt(const struct cli_int_opt *opts, size_t n, int c, const char *arg,
		const char **ret_bad)
{
	for (size_t i = 0; i < n; i++) {
		if (opts[i].code != c)
			continue;
		if (cli_parse_int(arg, opts[i].lo, opts[i].hi, opts[i].ret))
			return 1;
		*ret_bad = opts[i].bad;
		return -1;
	}
	return 0;
}

int cli_bad_usage(const char *tool, void (*usage)(FILE *f), const char *fmt, const char *arg)
{
	fprintf(stderr, "bdfp4 %s: ", tool);
	fprintf(stderr, fmt, arg);
	fprintf(stderr, "\n");
	usage(stderr);
	return 2;
}

int cli_getopt_other(const char *tool, void (*usage)(FILE *f), int c, char **argv)
{
	if (c == 'h') {
		usage(stdout);
		return 0;
	}
	return cli_bad_usage(tool, usage, c == ':' ? "option '%s' needs a value"
						   : "unknown option '%s'", argv[optind - 1]);
}

const char *cli_sampling_opt(int opt, const char *arg, struct bd_sampler_params *sp)
{
	long v;
	float f;
	switch (opt) {
	case CLI_O_TEMP:
		if (!cli_parse_float(arg, &f) || f < 0.0f)
			return "--temperature wants a number ≥ 0, not '%s'";
		sp->temperature = f;
		return NULL;
	case CLI_O_TOPK:
		if (!cli_parse_long(arg, 0, INT_MAX, &v))
			return "--top-k wants an integer ≥ 0, not '%s'";
		sp->top_k = (int)v;
		return NULL;
	case CLI_O_TOPP:
		if (!cli_parse_float(arg, &f) || !(f > 0.0f) || f > 1.0f)
			return "--top-p wants a number in (0, 1], not '%s'";
		sp->top_p = f;
		return NULL;
	case CLI_O_SEED: {
		char *end;
		errno = 0;
		unsigned long long u = strtoull(arg, &end, 10);
		if (errno || end == arg || *end || arg[0] == '-')
			return "--seed wants an unsigned integer, not '%s'";
		sp->seed = u;
		return NULL;
	}
	default:
		return "'%s' is not a sampling option";
	}
}

void cli_gen_init(struct cli_gen_opts *g, struct bd_sampler_params *sp, int max_stops)
{
	*g = (struct cli_gen_opts){ .max_tokens = 256, .sp = sp, .max_stops = max_stops };
	*sp = bd_sampler_params_greedy();
}

int cli_gen_opt(const char *tool, void (*usage)(FILE *f), int c, const char *arg,
		struct cli_gen_opts *g)
{
	char msg[96];
	const char *bad;

	switch (c) {
	case CLI_O_MAXTOK:
		if (!cli_parse_int(arg, 1, INT_MAX, &g->max_tokens))
			return cli_bad_usage(tool, usage, "--max-tokens wants an integer ≥ 1, not '%s'",
					     arg);
		return 1;
	case CLI_O_TEMP:
	case CLI_O_TOPK:
	case CLI_O_TOPP:
	case CLI_O_SEED:
		if ((bad = cli_sampling_opt(c, arg, g->sp)))
			return cli_bad_usage(tool, usage, bad, arg);
		return 1;
	case CLI_O_STOP:
		if (g->n_stops == g->max_stops) {
			snprintf(msg, sizeof(msg), "too many --stop strings (the limit is %d)",
				 g->max_stops);
			return cli_bad_usage(tool, usage, "%s", msg);
		}
		if (!*arg)
			return cli_bad_usage(tool, usage, "--stop wants a non-empty string%s", "");
		g->stops[g->n_stops++] = arg;
		return 1;
	default:
		return 0;
	}
}

void cli_gen_usage(FILE *f, int max_stops, const char *seed0)
{
	fprintf(f,
		"  --max-tokens N     generate at most N tokens (default 256)\n"
		"  --temperature T    sampling temperature, 0 = greedy (default 0)\n"
		"  --top-k K          keep the K most likely tokens, 0 = all (default 0)\n"
		"  --top-p P          keep the most likely tokens up to mass P in (0, 1]\n"
		"                     (default 1)\n"
		"  --seed S           the sampler's seed (default 0: %s)\n"
		"  --stop STRING      stop before STRING appears (repeatable, up to %d)\n",
		seed0, max_stops);
}

const char *cli_prompt_bad(int n_args)
{
	if (n_args == 1)
		return NULL;
	return n_args < 1 ? "no PROMPT given%s" : "one PROMPT only (quote it)%s";
}
