/* bd_daemon.h — what every bdfp4 daemon does the same way: start-up (signals, open-file limit,
 * log identity, configuration file and flags), the signal fd of its event loop, sd_notify
 * READY/STATUS/WATCHDOG/STOPPING, and typed configuration values that log one clear error.
 *
 * Signals: SIGTERM and SIGINT ask the daemon to stop, SIGUSR1 for a report (a daemon without one
 * ignores it), SIGHUP is logged and ignored (restart to reconfigure), SIGPIPE is ignored. They reach the loop through a self-pipe fed by a handler
 * rather than a signalfd: libraries that start threads before main() (OpenBLAS) leave every
 * signal unblocked on them, and a signalfd would miss a SIGTERM one of those threads takes.
 *
 * Usage, in a daemon's main:
 *
 *	struct bd_daemon d = { .name = "kvpoold", .section = "pool", .keys = keys };
 *	int e = bd_daemon_start(&d, argc, argv);      // 1: --help was printed
 *	... read options with bd_daemon_get_*, set up ...
 *	bd_daemon_ready(&d);
 *	loop: poll d.signal_fd with the rest; bd_daemon_signal(&d) tells what came;
 *	      bd_daemon_watchdog(&d, bd_now_ms()) in the tick; bd_daemon_status(&d, ...)
 *	bd_daemon_stopping(&d); ... cleanup ...; bd_daemon_end(&d);
 *
 * One daemon per process (the signal handler writes to one pipe).
 */
#ifndef BD_DAEMON_H
#define BD_DAEMON_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "base/bd_config.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The key of the sd_notify STATUS period every daemon with a periodic STATUS takes, the same
 * name, default, help and range (10 ms to an hour) in each: an entry of a key table whose int
 * field `field` of the options struct st holds the period in milliseconds. */
#define BD_DAEMON_KEY_STATUS_INTERVAL(st, field)                                               \
	{ "status_interval_ms", "1000", "sd_notify STATUS period",                              \
	  BD_CONFIG_FIELD(INT, st, field, 10, 3600000) }

struct bd_daemon {
	/* the caller's, before bd_daemon_start */
	const char *name;                 /* program name: log identity and usage */
	const char *about;                /* usage's line about the daemon, may be NULL */
	const char *section;              /* its [section] of the configuration file */
	const struct bd_config_key *keys; /* its keys (also its flags), { NULL }-terminated */

	/* bd_daemon_start's */
	struct bd_config *cfg;            /* the file's [section] with the flags applied */
	int signal_fd;                    /* readable when a signal is pending; −1 before start */
	uint64_t watchdog_usec;           /* the unit's WatchdogSec=, 0 when none */
	int64_t next_watchdog_ms;
	char status[256];                 /* the last STATUS= sent */
};

/* Starts the daemon: SIGPIPE ignored, SIGTERM/SIGINT/SIGHUP handled through the signal fd,
 * the open-file limit raised to its hard limit (bd_ipc_raise_nofile), bd_log_init(d->name),
 * the configuration read (bd_config_parse_args with BD_CONFIG_DEFAULT_PATH) and checked for
 * unknown keys. Errors are logged and, for a bad command line, the usage printed to stderr.
 * Returns 0; 1 when --help printed the usage or --version the build (bd_version.h) to stdout
 * (the daemon exits 0); -EINVAL (bad flag, file or unknown key), -ENOMEM, or another -errno.
 * bd_daemon_end() undoes it either way. */
int bd_daemon_start(struct bd_daemon *d, int argc, char **argv);

/* Frees the configuration and closes the signal fd. A zeroed or never started d is fine. */
void bd_daemon_end(struct bd_daemon *d);

/* The next pending signal (SIGTERM, SIGINT, SIGUSR1), 0 when none is pending. Reads the signal
 * fd; SIGHUP is logged ("ignored") and skipped. */
int bd_daemon_signal(struct bd_daemon *d);

/* The usage of d's command line to f (bd_config_usage). */
void bd_daemon_usage(const struct bd_daemon *d, FILE *f);

/* sd_notify: READY=1 (and the watchdog timer starts), STOPPING=1. No-ops outside systemd. */
void bd_daemon_ready(struct bd_daemon *d);
void bd_daemon_stopping(struct bd_daemon *d);

/* STATUS=text, sent only when it differs from the last one: each datagram queues at the
 * notify socket's reader, and a reader that stopped reading would block a sender that repeats
 * itself. */
void bd_daemon_status(struct bd_daemon *d, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));

/* WATCHDOG=1 when half the unit's WatchdogSec= has passed since the last one. Returns the
 * milliseconds until the next is due (for the loop's poll timeout), INT64_MAX without a
 * watchdog. */
int64_t bd_daemon_watchdog(struct bd_daemon *d, int64_t now_ms);

/* Typed values of d's section: the key's default from d->keys when neither the file nor a flag
 * set it. A bad value is logged once ("max_batch = 'x': not an integer (allowed 1..4096)") and
 * returns -EINVAL (no parse) or -ERANGE (outside [min, max]); *ret is then unchanged. An
 * unknown key is -ENOENT. */
int bd_daemon_get_i64(const struct bd_daemon *d, const char *key, int64_t min, int64_t max,
		      int64_t *ret);
int bd_daemon_get_int(const struct bd_daemon *d, const char *key, int min, int max, int *ret);
int bd_daemon_get_bytes(const struct bd_daemon *d, const char *key, uint64_t min, uint64_t max,
			uint64_t *ret);
int bd_daemon_get_double(const struct bd_daemon *d, const char *key, double min, double max,
			 double *ret);
int bd_daemon_get_bool(const struct bd_daemon *d, const char *key, bool *ret);

/* The string value (file, flag or default; "" for a key without one). Lives as long as d's
 * configuration. */
const char *bd_daemon_get_str(const struct bd_daemon *d, const char *key);

/* Reads every key of d->keys that has a type (BD_CONFIG_FIELD, BD_CONFIG_TEXT) into the options
 * struct opts, in table order, with the getters above: the first bad value is logged and
 * returned (-EINVAL, -ERANGE) and the keys after it are not read. BD_CONFIG_CODE keys are left
 * to the caller. -EINVAL also for a table entry whose size is not that of its type. */
int bd_daemon_read_opts(const struct bd_daemon *d, void *opts);

#ifdef __cplusplus
}
#endif
#endif
