/* serve_common.h — what the serving integration tests share: a private runtime dir,
 * real daemons (kvpoold, routerd, workerd) started from $BD_BIN with readiness by sd_notify,
 * bounded waits, clean or forced stops, and a look at the pool's books.
 *
 * Every daemon dies with the test process (PR_SET_PDEATHSIG) and sv_fini() kills whatever is
 * left and removes the directory. Logs stay in the directory until then (sv_log_tail prints one
 * into a failure message).
 */
#ifndef TEST_SERVE_COMMON_H
#define TEST_SERVE_COMMON_H

#include <limits.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

struct bd_client;
struct bd_pool_stats;

#define SV_TIMEOUT_MS 60000
#define SV_MAX_ARGS 64

struct sv_daemon {
	pid_t pid;
	char name[32];
	char log[160], notify[160];
	int notify_fd;
};

struct sv_env {
	char dir[64];
	char bin[PATH_MAX];
	char model[PATH_MAX];
	char root[PATH_MAX];  /* the repository (proto/, deploy/, clients/) */
	char pool_sock[128], pool_ep[160], front_ep[160], workers_ep[160];
	struct sv_daemon pool, router, worker[2];
};

/* Makes the private dir and endpoint names, finds the binaries and the model. */
void sv_init(struct sv_env *e);
/* Kills every daemon still running and removes the dir. */
void sv_fini(struct sv_env *e);

/* The Criterion suite of a test file whose fixture is the environment alone: E, the static
 * struct sv_env its tests use, sv_init before each test and sv_fini after, timeout secs
 * (expands where criterion/criterion.h is included). */
#define SV_TEST_SUITE(suite, secs)                                                             \
	static struct sv_env E;                                                                 \
	static void suite##_init(void)                                                          \
	{                                                                                       \
		sv_init(&E);                                                                    \
	}                                                                                       \
	static void suite##_fini(void)                                                          \
	{                                                                                       \
		sv_fini(&E);                                                                    \
	}                                                                                       \
	TestSuite(suite, .init = suite##_init, .fini = suite##_fini, .timeout = (secs))

/* Starts a daemon (bin/name with args, NULL-terminated) and returns without waiting. */
void sv_spawn(struct sv_env *e, struct sv_daemon *d, const char *name, const char *const *args);
/* Waits for a notify datagram holding what; false on timeout or when the daemon exited. */
bool sv_wait_notify(struct sv_daemon *d, const char *what, int timeout_ms);

/* kvpoold for tp ranks with extra flags (NULL: none) over the defaults of the embedded model
 * geometry (30 layers, 3 KV heads of 64, bitdecoding-nvfp4), waits for READY. */
void sv_start_pool(struct sv_env *e, const char *const *extra);
/* routerd on the env's endpoints with extra flags, waits for READY. */
void sv_start_router(struct sv_env *e, const char *const *extra);
/* The same with the flags of extra, then those of more (either NULL). */
void sv_start_router2(struct sv_env *e, const char *const *extra, const char *const *more);
/* workerd of rank r (tp 2), waits for READY. */
void sv_start_worker(struct sv_env *e, int rank);
/* The same with extra flags (NULL: none). */
void sv_start_worker_args(struct sv_env *e, int rank, const char *const *extra);
/* Workers 0 and 1 (tp 2), then healthy within timeout_ms with these two in the router's
 * health (their pids alive; not a previous group the router has not yet seen go), else the
 * test fails with what. */
void sv_start_workers(struct sv_env *e, int timeout_ms, const char *what);
/* The whole system: kvpoold as sv_start_pool starts it, routerd with router_extra (NULL: none)
 * and sv_start_workers. */
void sv_start_system(struct sv_env *e, const char *const *router_extra, int timeout_ms);

/* Sends sig and waits up to timeout_ms for the exit: the exit status, 128 + signal when
 * killed by one, -1 if it had to be SIGKILLed. The daemon's pid is cleared. */
int sv_stop(struct sv_daemon *d, int sig, int timeout_ms);

/* The last bytes of a daemon's log (static buffer), for failure messages. */
const char *sv_log_tail(const struct sv_daemon *d);

/* kvpoold's stats (its books, its worker group and attachments), freed with
 * bd_pool_stats_free; NULL when the pool does not answer. */
struct bd_pool_stats *sv_pool_stats(struct sv_env *e);
/* Waits until the pool holds nothing for anyone (every page and slot free, no record). */
bool sv_pool_idle(struct sv_env *e, int timeout_ms);

/* Waits until the router reports healthy (want true) or not (want false). */
bool sv_wait_health(struct sv_env *e, bool want, int timeout_ms);
/* Asserts that the router reports healthy within timeout_ms (its worker group formed); the
 * failure says what ("no recovery") and shows the router's log. */
void sv_expect_healthy(struct sv_env *e, int timeout_ms, const char *what);

/* The base URL (http://HOST:PORT) that e's router logged it serves HTTP on (a router started
 * with --http HOST:0 listens on a port the kernel picked) into url[cap], waiting up to
 * timeout_ms for the line; the test fails, with the router's log, when it does not come. */
void sv_http_url(struct sv_env *e, char *url, size_t cap, int timeout_ms);

/* The value of the first sample of Prometheus exposition text whose line starts with prefix
 * (a metric's name and labels), -1 when there is none. */
double sv_metric(const char *text, const char *prefix);

/* A loopback TCP port nothing listens on now (bound to port 0 and released). */
int sv_free_port(void);

/* Runs the shell command cmd, its stdout into out[cap] (NUL-terminated, cut to fit); returns
 * its exit status as pclose(3) gives it. */
int sv_run_output(const char *cmd, char *out, size_t cap);

/* A client of the router's frontend (asserted; bd_client_free it). */
struct bd_client *sv_client(struct sv_env *e);

int64_t sv_now_ms(void);

#endif
