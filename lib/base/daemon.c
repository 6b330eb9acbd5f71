/* daemon.c — the daemons' common skeleton (bd_daemon.h). */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <systemd/sd-daemon.h>

#include "base/bd_daemon.h"
#include "base/bd_ipc.h"
#include "base/bd_log.h"
#include "base/bd_version.h"

static int signal_pipe_w = -1;

static void on_signal(int signo)
{
	int saved = errno;
	unsigned char b = (unsigned char)signo;

	if (write(signal_pipe_w, &b, 1) < 0) {
		/* the pipe is full: a stop is pending already */
	}
	errno = saved;
}

static int setup_signals(struct bd_daemon *d)
{
	static const int handled[] = { SIGTERM, SIGINT, SIGHUP, SIGUSR1 };
	struct sigaction sa = { .sa_handler = on_signal };
	sigset_t ss;
	int p[2];

	if (pipe2(p, O_CLOEXEC | O_NONBLOCK) < 0)
		return -errno;
	d->signal_fd = p[0];
	signal_pipe_w = p[1];
	sigemptyset(&sa.sa_mask);
	sa.sa_flags = SA_RESTART;
	signal(SIGPIPE, SIG_IGN);
	sigemptyset(&ss);
	for (size_t i = 0; i < sizeof(handled) / sizeof(handled[0]); i++) {
		if (sigaction(handled[i], &sa, NULL) < 0)
			return -errno;
		sigaddset(&ss, handled[i]);
	}
	/* a parent may have blocked them (a test harness, a shell's job control) */
	sigprocmask(SIG_UNBLOCK, &ss, NULL);
	return 0;
}

int bd_daemon_start(struct bd_daemon *d, int argc, char **argv)
{
	char err[256];
	const char *bad;
	int e;

	d->signal_fd = -1;
	d->cfg = NULL;
	d->status[0] = 0;
	d->watchdog_usec = 0;
	bd_log_init(d->name);
	e = setup_signals(d);
	if (e < 0) {
		bd_log_err("signal set-up: %s", strerror(-e));
		return e;
	}
	bd_ipc_raise_nofile();
	for (int i = 1; i < argc; i++)
		if (!strcmp(argv[i], "--version")) {
			printf("%s %s\n", d->name, bd_version());
			return 1;
		}
	d->cfg = bd_config_new();
	if (!d->cfg)
		return -ENOMEM;
	e = bd_config_parse_args(d->cfg, d->section, d->keys, BD_CONFIG_DEFAULT_PATH, argc, argv,
				 err, sizeof(err));
	if (e == 1) {
		bd_daemon_usage(d, stdout);
		return 1;
	}
	if (e < 0) {
		bd_log_err("%s", err);
		if (e == -EINVAL)
			bd_daemon_usage(d, stderr);
		return e == -ENOMEM ? e : -EINVAL;
	}
	bad = bd_config_unknown(d->cfg, d->section, d->keys);
	if (bad) {
		bd_log_err("unknown key '%s' in [%s]", bad, d->section);
		return -EINVAL;
	}
	return 0;
}

void bd_daemon_end(struct bd_daemon *d)
{
	if (!d)
		return;
	bd_config_free(d->cfg);
	d->cfg = NULL;
	if (d->signal_fd >= 0) {
		close(d->signal_fd);
		d->signal_fd = -1;
		signal(SIGTERM, SIG_DFL);
		signal(SIGINT, SIG_DFL);
		signal(SIGHUP, SIG_DFL);
		signal(SIGUSR1, SIG_DFL);
		close(signal_pipe_w);
		signal_pipe_w = -1;
	}
}

int bd_daemon_signal(struct bd_daemon *d)
{
	unsigned char b;

	while (d->signal_fd >= 0 && read(d->signal_fd, &b, 1) == 1) {
		if (b == SIGHUP) {
			bd_log_info("SIGHUP ignored: restart to reconfigure");
			continue;
		}
		return b;
	}
	return 0;
}

void bd_daemon_usage(const struct bd_daemon *d, FILE *f)
{
	bd_config_usage(f, d->name, d->about, d->section, d->keys);
}

void bd_daemon_ready(struct bd_daemon *d)
{
	if (sd_watchdog_enabled(0, &d->watchdog_usec) <= 0)
		d->watchdog_usec = 0;
	d->next_watchdog_ms = 0;
	sd_notify(0, "READY=1");
}

void bd_daemon_stopping(struct bd_daemon *d)
{
	(void)d;
	sd_notify(0, "STOPPING=1");
}

void bd_daemon_status(struct bd_daemon *d, const char *fmt, ...)
{
	char buf[sizeof(d->status)];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(buf, sizeof(buf), fmt, ap);
	va_end(ap);
	if (!strcmp(buf, d->status))
		return;
	memcpy(d->status, buf, sizeof(buf));
	sd_notifyf(0, "STATUS=%s", buf);
}

int64_t bd_daemon_watchdog(struct bd_daemon *d, int64_t now_ms)
{
	if (!d->watchdog_usec)
		return INT64_MAX;
	if (now_ms >= d->next_watchdog_ms) {
		sd_notify(0, "WATCHDOG=1");
		d->next_watchdog_ms = now_ms + (int64_t)(d->watchdog_usec / 2000);
	}
	return d->next_watchdog_ms - now_ms;
}

const char *bd_daemon_get_str(const struct bd_daemon *d, const char *key)
{
	return bd_config_str(d->cfg, d->section, d->keys, key);
}

/* The default text of key in d's table ("" when it has none). -ENOENT: key is not there. */
static int key_default(const struct bd_daemon *d, const char *key, const char **ret)
{
	for (const struct bd_config_key *k = d->keys; k->name; k++)
		if (!strcmp(k->name, key)) {
			*ret = k->def ? k->def : "";
			return 0;
		}
	return -ENOENT;
}

/* Logs key's refused value once: what it should be (`not_a`) when it does not parse, the
 * allowed `range` when it is out of range (-ERANGE). Returns e. */
static int refused(const struct bd_daemon *d, const char *key, int e, const char *not_a,
		   const char *range)
{
	if (e == -ERANGE)
		bd_log_err("%s = '%s': out of range (allowed %s)", key, bd_daemon_get_str(d, key),
			   range);
	else
		bd_log_err("%s = '%s': %s", key, bd_daemon_get_str(d, key), not_a);
	return e;
}

/* A number of each type a key takes: INT in i, BYTES in u, DOUBLE in x (8 bytes each). */
union num {
	int64_t i;
	uint64_t u;
	double x;
};
_Static_assert(sizeof(union num) == sizeof(int64_t) && sizeof(double) == sizeof(int64_t),
	       "get_num stores each number in 8 bytes");

/* key's value of type t (INT, BYTES or DOUBLE) in [lo, hi] into *ret, an int64_t, uint64_t or
 * double as t says: the file's or a flag's, else the default text of d's table. A refused
 * value is logged once with what it should be and the allowed range (refused); *ret is then
 * unchanged. */
static int get_num(const struct bd_daemon *d, const char *key, enum bd_config_type t,
		   union num lo, union num hi, void *ret)
{
	const char *def_text;
	char range[64], not_a[96];
	union num def = { 0 }, v;
	int e = key_default(d, key, &def_text);

	if (e < 0)
		return e;
	switch (t) {
	case BD_CONFIG_INT:
		if (*def_text)
			def.i = strtoll(def_text, NULL, 0);
		e = bd_config_get_i64(d->cfg, d->section, key, def.i, lo.i, hi.i, &v.i);
		snprintf(range, sizeof(range), "%lld..%lld", (long long)lo.i, (long long)hi.i);
		snprintf(not_a, sizeof(not_a), "not an integer (allowed %s)", range);
		break;
	case BD_CONFIG_BYTES:
		if (*def_text)
			bd_config_parse_bytes(def_text, &def.u);
		e = bd_config_get_bytes(d->cfg, d->section, key, def.u, lo.u, hi.u, &v.u);
		snprintf(range, sizeof(range), "%llu..%llu bytes", (unsigned long long)lo.u,
			 (unsigned long long)hi.u);
		snprintf(not_a, sizeof(not_a), "not a byte size");
		break;
	default:
		if (*def_text)
			def.x = strtod(def_text, NULL);
		e = bd_config_get_double(d->cfg, d->section, key, def.x, lo.x, hi.x, &v.x);
		snprintf(range, sizeof(range), "%g..%g", lo.x, hi.x);
		snprintf(not_a, sizeof(not_a), "not a number");
	}
	if (e < 0)
		return refused(d, key, e, not_a, range);
	memcpy(ret, &v, sizeof(v));
	return 0;
}

int bd_daemon_get_i64(const struct bd_daemon *d, const char *key, int64_t min, int64_t max,
		      int64_t *ret)
{
	return get_num(d, key, BD_CONFIG_INT, (union num){ .i = min }, (union num){ .i = max },
		       ret);
}

int bd_daemon_get_int(const struct bd_daemon *d, const char *key, int min, int max, int *ret)
{
	int64_t v;
	int e = bd_daemon_get_i64(d, key, min, max, &v);

	if (e == 0)
		*ret = (int)v;
	return e;
}

int bd_daemon_get_bytes(const struct bd_daemon *d, const char *key, uint64_t min, uint64_t max,
			uint64_t *ret)
{
	return get_num(d, key, BD_CONFIG_BYTES, (union num){ .u = min }, (union num){ .u = max },
		       ret);
}

int bd_daemon_get_double(const struct bd_daemon *d, const char *key, double min, double max,
			 double *ret)
{
	return get_num(d, key, BD_CONFIG_DOUBLE, (union num){ .x = min }, (union num){ .x = max },
		       ret);
}

int bd_daemon_get_bool(const struct bd_daemon *d, const char *key, bool *ret)
{
	const char *def_text;
	bool def = false;
	int e = key_default(d, key, &def_text);

	if (e < 0)
		return e;
	if (*def_text)
		bd_config_parse_bool(def_text, &def);
	e = bd_config_get_bool(d->cfg, d->section, key, def, ret);
	if (e < 0)
		refused(d, key, e, "not a boolean (1/0, true/false, yes/no, on/off)", NULL);
	return e;
}

/* Stores the integer v in the size-byte field at p (a 4-byte field takes v's low 32 bits: an
 * int or an unsigned whose range the key's [min, max] keeps). */
static int store_int(const struct bd_config_key *k, void *p, int64_t v)
{
	if (k->size == sizeof(int32_t)) {
		int32_t v32 = (int32_t)v;

		memcpy(p, &v32, sizeof(v32));
		return 0;
	}
	if (k->size == sizeof(int64_t)) {
		memcpy(p, &v, sizeof(v));
		return 0;
	}
	bd_log_err("%s: a %zu-byte field cannot hold an integer", k->name, k->size);
	return -EINVAL;
}

int bd_daemon_read_opts(const struct bd_daemon *d, void *opts)
{
	for (const struct bd_config_key *k = d->keys; k->name; k++) {
		char *p = (char *)opts + k->offset;
		const char *s;
		int64_t v;
		uint64_t u;
		double x;
		bool b;
		int e = 0;

		switch (k->type) {
		case BD_CONFIG_CODE:
			break;
		case BD_CONFIG_STR:
			s = bd_daemon_get_str(d, k->name);
			memcpy(p, &s, sizeof(s));
			break;
		case BD_CONFIG_INT:
			e = bd_daemon_get_i64(d, k->name, k->min, k->max, &v);
			if (e == 0)
				e = store_int(k, p, v);
			break;
		case BD_CONFIG_BYTES:
			e = bd_daemon_get_bytes(d, k->name, (uint64_t)k->min, (uint64_t)k->max, &u);
			if (e == 0)
				e = store_int(k, p, (int64_t)u);
			break;
		case BD_CONFIG_DOUBLE:
			e = bd_daemon_get_double(d, k->name, (double)k->min, (double)k->max, &x);
			if (e == 0)
				memcpy(p, &x, sizeof(x));
			break;
		case BD_CONFIG_BOOL:
			e = bd_daemon_get_bool(d, k->name, &b);
			if (e == 0)
				memcpy(p, &b, sizeof(b));
			break;
		default:
			bd_log_err("%s: unknown key type %d", k->name, (int)k->type);
			e = -EINVAL;
		}
		if (e < 0)
			return e;
	}
	return 0;
}
