/* cli.h — the subcommands of the bdfp4 tool. Each takes the arguments after the tool's name
 * (argv[0] is the subcommand) and returns the process exit status: 0 success, 1 failure,
 * 2 bad usage. */
#ifndef BDFP4_CLI_H
#define BDFP4_CLI_H

int cmd_quant_report(int argc, char **argv);
int cmd_generate(int argc, char **argv);

#endif
