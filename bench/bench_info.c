/* bench_info.c — what a benchmark's RESULTS.md heading says about where it ran (bench_info.h). */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include <time.h>

#include "bench_info.h"

void bench_machine(char *buf, size_t len)
{
	FILE *f = fopen("/proc/cpuinfo", "r");
	char line[512];

	snprintf(buf, len, "unknown CPU");
	while (f && fgets(line, sizeof(line), f)) {
		char *p = strchr(line, ':');

		if (strncmp(line, "model name", 10) == 0 && p) {
			p += 1 + strspn(p + 1, " \t");
			p[strcspn(p, "\n")] = '\0';
			snprintf(buf, len, "%s", p);
			break;
		}
	}
	if (f)
		fclose(f);
}

void bench_commit(char *buf, size_t len)
{
	const char *env = getenv("BD_COMMIT");
	FILE *p;

	snprintf(buf, len, "unknown");
	if (env && *env) {
		snprintf(buf, len, "%s", env);
		return;
	}
	p = popen("git rev-parse --short HEAD 2>/dev/null", "r");
	if (!p)
		return;
	if (fgets(buf, (int)len, p))
		buf[strcspn(buf, "\n")] = '\0';
	if (pclose(p) != 0 || !*buf)
		snprintf(buf, len, "unknown");
}

FILE *bench_results_open(const char *prog, const char *path, struct bench_info *ret)
{
	FILE *f = fopen(path, "a");
	time_t now = time(NULL);

	if (!f) {
		fprintf(stderr, "%s: %s: %s\n", prog, path, strerror(errno));
		return NULL;
	}
	bench_machine(ret->cpu, sizeof(ret->cpu));
	bench_commit(ret->commit, sizeof(ret->commit));
	strftime(ret->date, sizeof(ret->date), "%Y-%m-%d %H:%M UTC", gmtime(&now));
	return f;
}
