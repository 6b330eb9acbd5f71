/* bdfp4.c — the bdfp4 tool: one binary, subcommands dispatched by name. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/bd_version.h"
#include "cli.h"

struct subcommand {
	const char *name;
	int (*run)(int argc, char **argv);
	const char *summary;
};

static const struct subcommand commands[] = {
	{ "quant-report", cmd_quant_report,
	  "logit and probability error split of every KV configuration (paper §3, Eq. 2)" },
	{ "generate", cmd_generate, "complete a prompt on the CPU with the FP4 KV cache" },
	{ "calibrate", cmd_calibrate, "calibrate μ_k and τ of a model for a context (§7)" },
	{ "eval-kl", cmd_eval_kl, "teacher-forced KL of every KV configuration on real text (§10)" },
	{ "eval-passkey", cmd_eval_passkey,
	  "passkey retrieval accuracy of every KV configuration at a context (task accuracy)" },
	{ "client", cmd_client, "send a prompt to the router and stream the answer" },
	{ "serve", cmd_serve,
	  "run kvpoold, the router (ZeroMQ and HTTP) and the workers in the foreground" },
	{ "keygen", cmd_keygen, "make a CURVE key pair for an encrypted TCP endpoint" },
	{ "kv-where", cmd_kv_where, "which stack's KV event stream holds a prompt's leading pages" },
};

static void usage(FILE *f)
{
	fprintf(f, "usage: bdfp4 COMMAND [OPTIONS]   (bdfp4 COMMAND --help for its options; "
		   "bdfp4 --version)\n\n"
		   "commands:\n");
	for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
		fprintf(f, "  %-14s %s\n", commands[i].name, commands[i].summary);
}

int main(int argc, char **argv)
{
	/* OpenBLAS's idle threads spin on sched_yield() for 2^28 cycles (about 0.1 s) after each
	 * call, longer than a decode step, so they never sleep: at 2 threads that is a quarter of
	 * the CPU time in the kernel, taken from the decode thread whenever the cores are shared.
	 * The library reads OPENBLAS_THREAD_TIMEOUT (log2 cycles) when it loads, before main: set it
	 * to its minimum and run again, once; a value the user set is kept. */
	if (!getenv("OPENBLAS_THREAD_TIMEOUT") && setenv("OPENBLAS_THREAD_TIMEOUT", "4", 1) == 0)
		execv("/proc/self/exe", argv); /* on failure, go on with the spinning threads */
	if (argc < 2) {
		usage(stderr);
		return 2;
	}
	if (strcmp(argv[1], "--version") == 0) {
		printf("bdfp4 %s\n", bd_version());
		return 0;
	}
	if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
		usage(stdout);
		return 0;
	}
	for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
		if (strcmp(argv[1], commands[i].name) == 0)
			return commands[i].run(argc - 1, argv + 1);
	fprintf(stderr, "bdfp4: unknown command '%s'\n", argv[1]);
	usage(stderr);
	return 2;
}
