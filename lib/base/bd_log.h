/* bd_log.h — the daemons' log lines on stderr.
 *
 * Outside systemd a line reads "2026-12-01T21:20:31.123Z kvpoold: error: text" (UTC wall clock,
 * ISO 8601 with milliseconds, then the program's identity and the level); under systemd's
 * journal (JOURNAL_STREAM set) it reads "<3>kvpoold: text", the journal adding its own
 * timestamp and taking the level from the <N> prefix. Levels are syslog's (3 error ... 7 debug);
 * debug lines are dropped unless bd_log_set_debug(true). Each line goes out in one write(2), so
 * lines of several threads or processes sharing stderr do not interleave.
 *
 * Library code logs nothing above debug (lib/README.md): these are for daemons and tools.
 */
#ifndef BD_LOG_H
#define BD_LOG_H

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
	BD_LOG_ERR = 3,
	BD_LOG_WARNING = 4,
	BD_LOG_NOTICE = 5,
	BD_LOG_INFO = 6,
	BD_LOG_DEBUG = 7,
};

#define BD_LOG_IDENT_MAX 64

/* The identity every later line carries ("kvpoold", "workerd[1]"; cut to BD_LOG_IDENT_MAX − 1
 * bytes) and whether stderr is the journal (read from JOURNAL_STREAM now). Call it once at
 * start, before other threads log; again to change the identity (a worker learns its rank). */
void bd_log_init(const char *ident);

/* Debug lines on (true) or off (the default). */
void bd_log_set_debug(bool on);
bool bd_log_debug_enabled(void);

/* One line at level prio (BD_LOG_ERR..BD_LOG_DEBUG); the text is cut at 4 KiB. */
void bd_log(int prio, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define bd_log_err(...) bd_log(BD_LOG_ERR, __VA_ARGS__)
#define bd_log_warn(...) bd_log(BD_LOG_WARNING, __VA_ARGS__)
#define bd_log_notice(...) bd_log(BD_LOG_NOTICE, __VA_ARGS__)
#define bd_log_info(...) bd_log(BD_LOG_INFO, __VA_ARGS__)
#define bd_log_debug(...) bd_log(BD_LOG_DEBUG, __VA_ARGS__)

/* The timestamp of a line: now as "YYYY-MM-DDTHH:MM:SS.mmmZ" into buf (at least 25 bytes).
 * Returns buf. */
char *bd_log_timestamp(char *buf, unsigned long len);

#ifdef __cplusplus
}
#endif
#endif
