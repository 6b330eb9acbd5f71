/* bench_info.h — the machine and commit of a benchmark run, for its RESULTS.md heading. */
#ifndef BENCH_INFO_H
#define BENCH_INFO_H

#include <stddef.h>
#include <stdio.h>

/* The CPU's model name from /proc/cpuinfo into buf[len] ("unknown CPU" without one). */
void bench_machine(char *buf, size_t len);
/* $BD_COMMIT, else `git rev-parse --short HEAD`, else "unknown", into buf[len]. */
void bench_commit(char *buf, size_t len);

/* The heading facts of a run appended to RESULTS.md: the CPU (bench_machine), the commit
 * (bench_commit) and the date in UTC ("2026-12-02 07:10 UTC"). */
struct bench_info {
	char cpu[256], commit[64], date[32];
};
/* path opened for appending, *ret filled. Returns the stream, or NULL after printing
 * "PROG: path: why" on stderr. */
FILE *bench_results_open(const char *prog, const char *path, struct bench_info *ret);

#endif
