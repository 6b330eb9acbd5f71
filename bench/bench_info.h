/* bench_info.h — the machine and commit of a benchmark run, for its RESULTS.md heading. */
#ifndef BENCH_INFO_H
#define BENCH_INFO_H

#include <stddef.h>

/* The CPU's model name from /proc/cpuinfo into buf[len] ("unknown CPU" without one). */
void bench_machine(char *buf, size_t len);
/* $BD_COMMIT, else `git rev-parse --short HEAD`, else "unknown", into buf[len]. */
void bench_commit(char *buf, size_t len);

#endif
