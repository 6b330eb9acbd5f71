/* log.c — the daemons' log lines (bd_log.h). */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/bd_log.h"

static char log_ident[BD_LOG_IDENT_MAX] = "bdfp4";
static bool log_journal;
static bool log_debug;

static const char *const level_names[] = { "emerg", "alert", "crit",	"error",
					   "warning", "notice", "info", "debug" };

void bd_log_init(const char *ident)
{
	snprintf(log_ident, sizeof(log_ident), "%s", ident && *ident ? ident : "bdfp4");
	log_journal = getenv("JOURNAL_STREAM") != NULL;
}

void bd_log_set_debug(bool on)
{
	log_debug = on;
}

bool bd_log_debug_enabled(void)
{
	return log_debug;
}

char *bd_log_timestamp(char *buf, unsigned long len)
{
	struct timespec ts;
	struct tm tm;
	char sec[32];

	clock_gettime(CLOCK_REALTIME, &ts);
	gmtime_r(&ts.tv_sec, &tm);
	strftime(sec, sizeof(sec), "%Y-%m-%dT%H:%M:%S", &tm);
	snprintf(buf, len, "%s.%03ldZ", sec, ts.tv_nsec / 1000000);
	return buf;
}

void bd_log(int prio, const char *fmt, ...)
{
	char line[4096 + 160], stamp[32];
	int saved = errno, n;
	va_list ap;

	if (prio < 0 || prio > BD_LOG_DEBUG)
		prio = BD_LOG_ERR;
	if (prio == BD_LOG_DEBUG && !log_debug)
		return;
	if (log_journal)
		n = snprintf(line, 160, "<%d>%s: ", prio, log_ident);
	else
		n = snprintf(line, 160, "%s %s: %s: ", bd_log_timestamp(stamp, sizeof(stamp)),
			     log_ident, level_names[prio]);
	if (n < 0 || n >= 160)
		n = 0;
	va_start(ap, fmt);
	int m = vsnprintf(line + n, 4096, fmt, ap);
	va_end(ap);
	if (m < 0)
		m = 0;
	n += m < 4096 ? m : 4095;
	line[n++] = '\n';
	/* one write: stderr is shared by threads, and by the ranks under run-local.sh */
	if (write(STDERR_FILENO, line, (size_t)n) < 0) {
		/* nowhere left to report it */
	}
	errno = saved;
}
