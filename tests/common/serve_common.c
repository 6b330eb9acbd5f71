/* serve_common.c — daemons for the serving integration tests (serve_common.h). */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "serve/bd_client.h"
#include "pool/bd_pool_client.h"
#include "serve_common.h"
#include "tmpdir.h"

#define MODEL_REL "models/SmolLM2-135M-Instruct.Q4_1.gguf"

int64_t sv_now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void exe_dir(char *buf, size_t cap)
{
	ssize_t n = readlink("/proc/self/exe", buf, cap - 1);

	cr_assert_gt(n, 0);
	buf[n] = 0;
	*strrchr(buf, '/') = 0;
}

/* The repository: the working directory when it holds proto/serve.proto, else the first
 * ancestor of the test binary that does. */
static void find_root(char *buf, size_t cap)
{
	char exe[PATH_MAX - 64], probe[PATH_MAX];

	if (access("proto/serve.proto", R_OK) == 0) {
		cr_assert_not_null(getcwd(buf, cap));
		return;
	}
	exe_dir(exe, sizeof(exe));
	for (int up = 0; up < 5; up++) {
		char *slash = strrchr(exe, '/');

		if (!slash)
			break;
		*slash = 0;
		snprintf(probe, sizeof(probe), "%s/proto/serve.proto", exe);
		if (access(probe, R_OK) == 0) {
			snprintf(buf, cap, "%s", exe);
			return;
		}
	}
	cr_assert_fail("cannot find the repository (proto/serve.proto)");
}

void sv_init(struct sv_env *e)
{
	const char *bin = getenv("BD_BIN"), *model = getenv("BD_MODEL");
	char exe[PATH_MAX - 64];

	memset(e, 0, sizeof(*e));
	e->pool.notify_fd = e->router.notify_fd = -1;
	e->worker[0].notify_fd = e->worker[1].notify_fd = -1;
	exe_dir(exe, sizeof(exe));
	if (bin && *bin)
		snprintf(e->bin, sizeof(e->bin), "%s", bin);
	else
		snprintf(e->bin, sizeof(e->bin), "%s/../bin", exe); /* $(BUILD)/tests/unit */
	if (model && *model) {
		snprintf(e->model, sizeof(e->model), "%s", model);
	} else if (access(MODEL_REL, R_OK) == 0) {
		cr_assert_not_null(realpath(MODEL_REL, e->model));
	} else {
		/* $(BUILD)/tests or $(BUILD)/san/tests below the repository */
		for (int up = 0; up < 4; up++) {
			char *slash = strrchr(exe, '/');

			if (!slash)
				break;
			*slash = 0;
			snprintf(e->model, sizeof(e->model), "%s/%s", exe, MODEL_REL);
			if (access(e->model, R_OK) == 0)
				break;
		}
	}
	cr_assert_eq(access(e->model, R_OK), 0, "no model at %s (make model)", e->model);
	find_root(e->root, sizeof(e->root));
	/* $TMPDIR when short enough for Unix socket paths, else /tmp */
	snprintf(e->dir, sizeof(e->dir), "%s/bdfp4-serve-XXXXXX",
		 getenv("TMPDIR") && *getenv("TMPDIR") && strlen(getenv("TMPDIR")) < 40
			 ? getenv("TMPDIR")
			 : "/tmp");
	cr_assert_not_null(mkdtemp(e->dir));
	snprintf(e->pool_sock, sizeof(e->pool_sock), "%s/kvpool.sock", e->dir);
	snprintf(e->pool_ep, sizeof(e->pool_ep), "ipc://%s/kvpool-alloc.sock", e->dir);
	snprintf(e->front_ep, sizeof(e->front_ep), "ipc://%s/router.sock", e->dir);
	snprintf(e->workers_ep, sizeof(e->workers_ep), "ipc://%s/router-workers.sock", e->dir);
}

static void kill_daemon(struct sv_daemon *d)
{
	if (d->pid > 0) {
		kill(d->pid, SIGKILL);
		waitpid(d->pid, NULL, 0);
		d->pid = 0;
	}
	if (d->notify_fd >= 0)
		close(d->notify_fd);
	d->notify_fd = -1;
}

void sv_fini(struct sv_env *e)
{
	char cmd[128];

	/* the router first, so it does not see the others go */
	kill_daemon(&e->router);
	kill_daemon(&e->worker[0]);
	kill_daemon(&e->worker[1]);
	kill_daemon(&e->pool);
	if (!e->dir[0])
		return;
	if (getenv("BD_KEEP_LOGS")) {
		fprintf(stderr, "logs kept in %s\n", e->dir);
		return;
	}
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", e->dir);
	if (system(cmd) != 0)
		fprintf(stderr, "could not remove %s\n", e->dir);
}

void sv_spawn(struct sv_env *e, struct sv_daemon *d, const char *name, const char *const *args)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	const char *argv[SV_MAX_ARGS + 2];
	char path[PATH_MAX + 32];
	size_t n = 0;
	pid_t pid;

	if (d->notify_fd >= 0)
		close(d->notify_fd);
	snprintf(d->name, sizeof(d->name), "%s", name);
	snprintf(d->log, sizeof(d->log), "%s/%s.log", e->dir, name);
	snprintf(d->notify, sizeof(d->notify), "%s/notify-%s.sock", e->dir, name);
	unlink(d->notify);
	d->notify_fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	cr_assert_geq(d->notify_fd, 0);
	cr_assert_lt(strlen(d->notify), sizeof(sa.sun_path));
	memcpy(sa.sun_path, d->notify, strlen(d->notify) + 1);
	cr_assert_eq(bind(d->notify_fd, (struct sockaddr *)&sa, sizeof(sa)), 0);

	/* workerd-1 etc. run the binary workerd */
	snprintf(path, sizeof(path), "%s/%.*s", e->bin, (int)strcspn(name, "-"), name);
	cr_assert_eq(access(path, X_OK), 0, "no %s (set BD_BIN)", path);
	argv[n++] = path;
	for (size_t i = 0; args && args[i] && n < SV_MAX_ARGS; i++)
		argv[n++] = args[i];
	argv[n] = NULL;
	fflush(NULL);
	pid = fork();
	cr_assert_geq(pid, 0);
	if (pid == 0) {
		int fd = open(d->log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);

		prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (fd >= 0) {
			dup2(fd, 1);
			dup2(fd, 2);
		}
		setenv("NOTIFY_SOCKET", d->notify, 1);
		unsetenv("WATCHDOG_USEC");
		unsetenv("WATCHDOG_PID");
		unsetenv("JOURNAL_STREAM");
		setenv("OPENBLAS_NUM_THREADS", "1", 1);
		execv(path, (char *const *)argv);
		_exit(127);
	}
	d->pid = pid;
}

bool sv_wait_notify(struct sv_daemon *d, const char *what, int timeout_ms)
{
	int64_t end = sv_now_ms() + timeout_ms;
	char buf[1024];

	while (sv_now_ms() < end) {
		struct pollfd p = { .fd = d->notify_fd, .events = POLLIN };

		if (poll(&p, 1, 50) == 1) {
			ssize_t n = recv(d->notify_fd, buf, sizeof(buf) - 1, 0);

			if (n > 0) {
				buf[n] = 0;
				if (strstr(buf, what))
					return true;
			}
			continue;
		}
		if (d->pid > 0 && waitpid(d->pid, NULL, WNOHANG) == d->pid) {
			d->pid = 0;
			return false;
		}
	}
	return false;
}

const char *sv_log_tail(const struct sv_daemon *d)
{
	static char buf[2048];
	FILE *f = fopen(d->log, "r");
	long size;
	size_t n;

	buf[0] = 0;
	if (!f)
		return buf;
	fseek(f, 0, SEEK_END);
	size = ftell(f);
	fseek(f, size > (long)sizeof(buf) - 1 ? size - (long)sizeof(buf) + 1 : 0, SEEK_SET);
	n = fread(buf, 1, sizeof(buf) - 1, f);
	buf[n] = 0;
	fclose(f);
	return buf;
}

static void start_and_wait(struct sv_env *e, struct sv_daemon *d, const char *name,
			   const char *const *args)
{
	sv_spawn(e, d, name, args);
	cr_assert(sv_wait_notify(d, "READY=1", SV_TIMEOUT_MS), "%s did not get ready; log:\n%s",
		  name, sv_log_tail(d));
	/* nobody reads STATUS= lines from here on: a full datagram queue would block the
	 * daemon's sd_notify, so the socket goes (sd_notify then fails at once) */
	close(d->notify_fd);
	d->notify_fd = -1;
	unlink(d->notify);
}

/* Appends extra after the fixed arguments (argv is NULL-padded to SV_MAX_ARGS + 1). */
static void add_args(const char **argv, const char *const *extra)
{
	size_t n = 0;

	while (argv[n])
		n++;
	for (size_t i = 0; extra && extra[i] && n < SV_MAX_ARGS; i++)
		argv[n++] = extra[i];
	argv[n] = NULL;
}

void sv_start_pool(struct sv_env *e, const char *const *extra)
{
	const char *argv[SV_MAX_ARGS + 1] = {
		"--no-config", "--socket", e->pool_sock, "--endpoint", e->pool_ep,
		"--tp", "2", "--layers", "30", "--kv-heads", "3", "--head-dim", "64",
		"--kv-config", "bitdecoding-nvfp4", "--max-seq-len", "1024", "--pages", "64",
		"--slots", "24", "--status-interval-ms", "200",
	};

	add_args(argv, extra);
	start_and_wait(e, &e->pool, "kvpoold", argv);
}

void sv_start_router(struct sv_env *e, const char *const *extra)
{
	sv_start_router2(e, extra, NULL);
}

void sv_start_router2(struct sv_env *e, const char *const *extra, const char *const *more)
{
	const char *argv[SV_MAX_ARGS + 1] = {
		"--no-config", "--frontend", e->front_ep, "--workers", e->workers_ep,
		"--pool", e->pool_ep, "--model", e->model, "--tp", "2",
		"--heartbeat-ms", "100", "--heartbeat-timeout-ms", "1500",
		"--keepalive-ms", "200", "--status-interval-ms", "200",
		"--http", "", /* no HTTP listener unless a test asks for one (--http HOST:PORT) */
	};

	add_args(argv, extra);
	add_args(argv, more);
	start_and_wait(e, &e->router, "routerd", argv);
}

void sv_start_worker(struct sv_env *e, int rank)
{
	sv_start_worker_args(e, rank, NULL);
}

void sv_start_worker_args(struct sv_env *e, int rank, const char *const *extra)
{
	char r[8], name[16];
	const char *argv[SV_MAX_ARGS + 1] = { "--no-config", "--rank", r, "--tp", "2", "--model",
					      e->model, "--pool-socket", e->pool_sock, "--router",
					      e->workers_ep, "--allreduce-dir", e->dir, "--threads",
					      "1" };

	add_args(argv, extra);
	snprintf(r, sizeof(r), "%d", rank);
	snprintf(name, sizeof(name), "workerd-%d", rank);
	start_and_wait(e, &e->worker[rank], name, argv);
}

/* Whether health h lists workers 0 and 1 alive with the pids of e's worker daemons. */
static bool group_is_ours(const struct sv_env *e, const struct bd_client_health *h)
{
	for (int r = 0; r < 2; r++) {
		bool found = false;
		for (size_t i = 0; i < h->n_workers; i++)
			found |= h->workers[i].rank == r && h->workers[i].pid == e->worker[r].pid &&
				 h->workers[i].alive;
		if (!found)
			return false;
	}
	return true;
}

void sv_start_workers(struct sv_env *e, int timeout_ms, const char *what)
{
	int64_t end;
	struct bd_client *c;
	bool ok = false;

	sv_start_worker(e, 0);
	sv_start_worker(e, 1);
	/* healthy with these two: a router that has not yet seen a previous group's workers
	 * exit still says healthy for that group, and would route to it */
	end = sv_now_ms() + timeout_ms;
	cr_assert_eq(bd_client_new(e->front_ep, &c), 0);
	do {
		struct bd_client_health h;

		if (bd_client_health(c, 1000, &h) == 0 && h.healthy && group_is_ours(e, &h)) {
			ok = true;
			break;
		}
		usleep(20000);
	} while (sv_now_ms() < end);
	bd_client_free(c);
	cr_assert(ok, "%s; router log:\n%s", what, sv_log_tail(&e->router));
}

void sv_start_system(struct sv_env *e, const char *const *router_extra, int timeout_ms)
{
	sv_start_pool(e, NULL);
	sv_start_router(e, router_extra);
	sv_start_workers(e, timeout_ms, "the group did not form");
}

int sv_stop(struct sv_daemon *d, int sig, int timeout_ms)
{
	int64_t end = sv_now_ms() + timeout_ms;
	int st;

	if (d->pid <= 0)
		return -2;
	kill(d->pid, sig);
	while (sv_now_ms() < end) {
		if (waitpid(d->pid, &st, WNOHANG) == d->pid) {
			d->pid = 0;
			return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
		}
		usleep(5000);
	}
	kill(d->pid, SIGKILL);
	waitpid(d->pid, NULL, 0);
	d->pid = 0;
	return -1;
}

struct bd_pool_stats *sv_pool_stats(struct sv_env *e)
{
	struct bd_pool_conn *c;
	struct bd_pool_stats *s = NULL;

	if (bd_pool_conn_new(e->pool_ep, 3000, &c) < 0)
		return NULL;
	if (bd_pool_stats(c, 0, &s) < 0)
		s = NULL;
	bd_pool_conn_free(c);
	return s;
}

bool sv_pool_idle(struct sv_env *e, int timeout_ms)
{
	int64_t end = sv_now_ms() + timeout_ms;

	do {
		struct bd_pool_stats *s = sv_pool_stats(e);
		bool idle = s && s->requests == 0 && s->pages_free == s->pages_total &&
			    s->slots_free == s->slots_total;

		bd_pool_stats_free(s);
		if (idle)
			return true;
		usleep(20000);
	} while (sv_now_ms() < end);
	return false;
}

bool sv_wait_health(struct sv_env *e, bool want, int timeout_ms)
{
	int64_t end = sv_now_ms() + timeout_ms;
	struct bd_client *c;
	bool ok = false;

	if (bd_client_new(e->front_ep, &c) < 0)
		return false;
	do {
		struct bd_client_health h;

		if (bd_client_health(c, 1000, &h) == 0 && h.healthy == want) {
			ok = true;
			break;
		}
		usleep(20000);
	} while (sv_now_ms() < end);
	bd_client_free(c);
	return ok;
}

void sv_expect_healthy(struct sv_env *e, int timeout_ms, const char *what)
{
	cr_assert(sv_wait_health(e, true, timeout_ms), "%s; router log:\n%s", what,
		  sv_log_tail(&e->router));
}

struct bd_client *sv_client(struct sv_env *e)
{
	struct bd_client *c;

	cr_assert_eq(bd_client_new(e->front_ep, &c), 0);
	return c;
}

int sv_run_output(const char *cmd, char *out, size_t cap)
{
	FILE *p = popen(cmd, "r");
	size_t n;

	cr_assert_not_null(p, "%s", cmd);
	n = fread(out, 1, cap - 1, p);
	out[n] = 0;
	return pclose(p);
}

void sv_http_url(struct sv_env *e, char *url, size_t cap, int timeout_ms)
{
	static const char mark[] = "http: listening on ";
	int64_t end = sv_now_ms() + timeout_ms;

	while (sv_now_ms() < end) {
		char *log = td_read_file(e->router.log, NULL), *p;

		p = log ? strstr(log, mark) : NULL;
		if (p) {
			p += strlen(mark);
			snprintf(url, cap, "%.*s", (int)strcspn(p, " \n"), p);
			free(log);
			return;
		}
		free(log);
		usleep(50000);
	}
	cr_assert_fail("routerd logged no HTTP address:\n%s", sv_log_tail(&e->router));
}

double sv_metric(const char *text, const char *prefix)
{
	for (const char *p = text; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL) {
		if (!strncmp(p, prefix, strlen(prefix))) {
			const char *sp = strchr(p, ' ');

			return sp ? strtod(sp + 1, NULL) : -1;
		}
	}
	return -1;
}

int sv_free_port(void)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	socklen_t len = sizeof(a);
	int fd = socket(AF_INET, SOCK_STREAM, 0), port;

	cr_assert_geq(fd, 0);
	cr_assert_eq(bind(fd, (struct sockaddr *)&a, sizeof(a)), 0);
	cr_assert_eq(getsockname(fd, (struct sockaddr *)&a, &len), 0);
	port = ntohs(a.sin_port);
	close(fd);
	return port;
}
