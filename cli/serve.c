/* serve.c — `bdfp4 serve`: the whole serving system in the foreground, without systemd.
 *
 * Starts kvpoold, routerd (its ZeroMQ frontend and the HTTP API) and the tensor-parallel
 * workerd ranks as deploy/run-local.sh does, each in a private runtime directory, waits until
 * the router serves, prints the endpoints, and keeps them up: a daemon that exits is started
 * again (after 1 s, doubling to 30 s while it keeps failing). SIGINT (Ctrl-C) or SIGTERM
 * stops them in order: the router first (it drains its requests), then the workers, then
 * the pool; a second signal makes the router stop at once. The daemons' logs go to stderr.
 *
 * Under a supervisor that set NOTIFY_SOCKET, READY=1 goes out once the router serves (the
 * daemons themselves do not notify it).
 *
 * Exit status: 0 after a clean stop (every daemon exited 0), 1 when the system did not come
 * up or a daemon did not stop cleanly, 2 bad usage.
 */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>

#include <systemd/sd-daemon.h>

#include "cli.h"
#include "formats/bd_gguf.h"
#include "pool/bd_pool_client.h"
#include "serve/bd_client.h"

#define TOOL "serve"
#define MAX_ARGS 48
#define N_PROCS (2 + 2)   /* pool, router, up to 2 ranks */
#define UP_MS 300000      /* the system must serve within this */
#define STOP_MS 45000     /* one daemon's stop (the router's drain is 30 s) */
#define BACKOFF_MAX_MS 30000

struct proc {
	char name[24];
	char *argv[MAX_ARGS];
	pid_t pid;
	int exit_status;   /* of its last exit */
	int64_t start_at;  /* ms; a restart pending when pid == 0 and start_at != 0 */
	int backoff_ms;
	int64_t started;
};

static volatile sig_atomic_t got_stop, got_chld;

static void on_signal(int sig)
{
	if (sig == SIGCHLD)
		got_chld = 1;
	else
		got_stop++;
}

static void usage(FILE *f)
{
	fprintf(f,
		"usage: bdfp4 serve [OPTIONS]\n"
		"Runs kvpoold, routerd and the workerd ranks in the foreground, keeps them up.\n\n"
		"  --model PATH       GGUF model (default models/SmolLM2-135M-Instruct.Q4_1.gguf)\n"
		"  --http HOST:PORT   HTTP API address (default 127.0.0.1:8000; port 0: any free)\n"
		"  --frontend EP      ZeroMQ client endpoint (default tcp://127.0.0.1:5555)\n"
		"  --tp N             tensor-parallel ranks, 1 or 2 (default 2)\n"
		"  --backend B        cpu or cuda (default cpu)\n"
		"  --kv-config NAME   KV configuration of the pool (default bitdecoding-nvfp4)\n"
		"  --max-seq-len N    longest sequence in the pool (default 8192)\n"
		"  --slots N          BF16 slots: running requests at most (default 16)\n"
		"  --threads N        CPU threads per worker (default 1)\n"
		"  --bin DIR          the daemons' directory (default: this program's)\n"
		"  --run-dir DIR      where the runtime directory goes (default $XDG_RUNTIME_DIR, "
		"else /tmp)\n");
}

static void argv_set(struct proc *p, const char *name, const char *const *args)
{
	int n = 0;

	snprintf(p->name, sizeof(p->name), "%s", name);
	for (; args[n] && n < MAX_ARGS - 1; n++)
		p->argv[n] = strdup(args[n]);
	p->argv[n] = NULL;
}

static void argv_free(struct proc *p)
{
	for (int i = 0; p->argv[i]; i++)
		free(p->argv[i]);
}

static int start(struct proc *p)
{
	pid_t pid = fork();

	if (pid < 0) {
		fprintf(stderr, "bdfp4 serve: fork: %s\n", strerror(errno));
		return -errno;
	}
	if (pid == 0) {
		sigset_t none;

		/* its own process group: a terminal's Ctrl-C reaches serve only, which stops the
		 * daemons in order; they die with serve */
		setpgid(0, 0);
		prctl(PR_SET_PDEATHSIG, SIGTERM);
		signal(SIGINT, SIG_DFL);
		signal(SIGTERM, SIG_DFL);
		signal(SIGCHLD, SIG_DFL);
		sigemptyset(&none);
		sigprocmask(SIG_SETMASK, &none, NULL);
		execv(p->argv[0], p->argv);
		fprintf(stderr, "bdfp4 serve: %s: %s\n", p->argv[0], strerror(errno));
		_exit(127);
	}
	p->pid = pid;
	p->start_at = 0;
	p->started = bd_now_ms();
	return 0;
}

static void sleep_ms(int ms)
{
	struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000L };

	nanosleep(&ts, NULL);
}

/* Reaps exited children: their pid cleared, exit_status set. */
static void reap(struct proc *ps, int n)
{
	pid_t pid;
	int st;

	got_chld = 0;
	while ((pid = waitpid(-1, &st, WNOHANG)) > 0)
		for (int i = 0; i < n; i++)
			if (ps[i].pid == pid) {
				ps[i].pid = 0;
				ps[i].exit_status = WIFEXITED(st) ? WEXITSTATUS(st)
								  : 128 + WTERMSIG(st);
			}
}

static bool pool_answers(const char *ep)
{
	struct bd_pool_conn *c;
	struct bd_pool_stats *s = NULL;
	bool ok;

	if (bd_pool_conn_new(ep, 500, &c) < 0)
		return false;
	ok = bd_pool_stats(c, 0, &s) == 0;
	bd_pool_stats_free(s);
	bd_pool_conn_free(c);
	return ok;
}

/* The router's health: 1 serving, 0 answering but not serving, -1 no answer. */
static int router_health(const char *ep)
{
	struct bd_client *c;
	struct bd_client_health h;
	int r = -1;

	if (bd_client_new(ep, &c) < 0)
		return -1;
	if (bd_client_health(c, 1000, &h) == 0)
		r = h.healthy ? 1 : 0;
	bd_client_free(c);
	return r;
}

/* Stops p with SIGTERM (SIGKILL after STOP_MS): true when it exited 0. */
static bool stop_one(struct proc *ps, int n, struct proc *p)
{
	int64_t end = bd_now_ms() + STOP_MS;
	int sent = got_stop;

	if (!p->pid)
		return true; /* gone already (its exit was reported) */
	kill(p->pid, SIGTERM);
	while (p->pid && bd_now_ms() < end) {
		sleep_ms(50);
		reap(ps, n);
		if (got_stop > sent && p->pid) { /* another Ctrl-C: the router ends its drain */
			kill(p->pid, SIGTERM);
			sent = got_stop;
		}
	}
	if (p->pid) {
		fprintf(stderr, "bdfp4 serve: %s did not stop within %d s: killed\n", p->name,
			STOP_MS / 1000);
		kill(p->pid, SIGKILL);
		while (p->pid) {
			sleep_ms(20);
			reap(ps, n);
		}
		return false;
	}
	if (p->exit_status)
		fprintf(stderr, "bdfp4 serve: %s exited with status %d\n", p->name, p->exit_status);
	return p->exit_status == 0;
}

static void exe_dir(char *buf, size_t cap)
{
	ssize_t n = readlink("/proc/self/exe", buf, cap - 1);
	char *slash;

	if (n <= 0) {
		snprintf(buf, cap, ".");
		return;
	}
	buf[n] = 0;
	slash = strrchr(buf, '/');
	if (slash)
		*slash = 0;
}

/* HOST:0 becomes HOST:P with a port that is free now. */
static void pick_port(char *http, size_t cap)
{
	char *colon = strrchr(http, ':');
	struct sockaddr_in a = { .sin_family = AF_INET };
	socklen_t len = sizeof(a);
	int fd;

	if (!colon || strcmp(colon, ":0"))
		return;
	*colon = 0;
	fd = socket(AF_INET, SOCK_STREAM, 0);
	if (fd >= 0 && inet_pton(AF_INET, http, &a.sin_addr) == 1 &&
	    bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0 &&
	    getsockname(fd, (struct sockaddr *)&a, &len) == 0) {
		size_t hl = strlen(http);

		snprintf(http + hl, cap - hl, ":%u", ntohs(a.sin_port));
	} else {
		*colon = ':';
	}
	if (fd >= 0)
		close(fd);
}

int cmd_serve(int argc, char **argv)
{
	enum { O_MODEL = 1, O_HTTP, O_FRONT, O_TP, O_BACKEND, O_KV, O_SEQ, O_SLOTS, O_THREADS,
	       O_BIN, O_RUN };
	static const struct option opts[] = {
		{ "model", required_argument, NULL, O_MODEL },
		{ "http", required_argument, NULL, O_HTTP },
		{ "frontend", required_argument, NULL, O_FRONT },
		{ "tp", required_argument, NULL, O_TP },
		{ "backend", required_argument, NULL, O_BACKEND },
		{ "kv-config", required_argument, NULL, O_KV },
		{ "max-seq-len", required_argument, NULL, O_SEQ },
		{ "slots", required_argument, NULL, O_SLOTS },
		{ "threads", required_argument, NULL, O_THREADS },
		{ "bin", required_argument, NULL, O_BIN },
		{ "run-dir", required_argument, NULL, O_RUN },
		CLI_OPTS_END,
	};
	const char *model = "models/SmolLM2-135M-Instruct.Q4_1.gguf", *front = NULL;
	const char *backend = "cpu", *kv = "bitdecoding-nvfp4", *seq = "8192", *slots = "16";
	const char *threads = "1", *base = getenv("XDG_RUNTIME_DIR");
	char bin[PATH_MAX] = "", http[160] = "127.0.0.1:8000", rt[PATH_MAX], path[PATH_MAX + 64];
	char pool_sock[PATH_MAX + 32], pool_ep[PATH_MAX + 32], front_ipc[PATH_MAX + 32];
	char workers_ep[PATH_MAX + 32], layers[16], heads[16], hdim[16], fronts[PATH_MAX * 2];
	char gerr[BD_GGUF_ERR_MAX] = "", notify[PATH_MAX] = "";
	struct proc ps[N_PROCS] = { 0 };
	struct bd_model_hparams hp;
	struct bd_gguf *g = NULL;
	struct sigaction sa = { .sa_handler = on_signal };
	int tp = 2, n, c, h = -1, rc = 0;
	int64_t end;

	opterr = 0;
	while ((c = getopt_long(argc, argv, ":h", opts, NULL)) != -1) {
		switch (c) {
		case O_MODEL: model = optarg; break;
		case O_HTTP: snprintf(http, sizeof(http), "%s", optarg); break;
		case O_FRONT: front = optarg; break;
		case O_TP:
			if (!cli_parse_int(optarg, 1, 2, &tp))
				return cli_bad_usage(TOOL, usage, "--tp is 1 or 2, not '%s'",
						     optarg);
			break;
		case O_BACKEND:
			if (strcmp(optarg, "cpu") && strcmp(optarg, "cuda"))
				return cli_bad_usage(TOOL, usage,
						     "--backend is cpu or cuda, not '%s'", optarg);
			backend = optarg;
			break;
		case O_KV: kv = optarg; break;
		case O_SEQ: seq = optarg; break;
		case O_SLOTS: slots = optarg; break;
		case O_THREADS: threads = optarg; break;
		case O_BIN: snprintf(bin, sizeof(bin), "%s", optarg); break;
		case O_RUN: base = optarg; break;
		default: return cli_getopt_other(TOOL, usage, c, argv);
		}
	}
	if (optind < argc)
		return cli_bad_usage(TOOL, usage, "unexpected argument '%s'", argv[optind]);
	if (!*bin)
		exe_dir(bin, sizeof(bin));
	if (bd_gguf_open(model, &g, gerr) < 0 || bd_gguf_model_hparams(g, &hp, gerr) < 0) {
		fprintf(stderr, "bdfp4 serve: %s: %s (make model fetches the default)\n", model,
			*gerr ? gerr : strerror(errno));
		bd_gguf_free(g);
		return 1;
	}
	bd_gguf_free(g);
	snprintf(layers, sizeof(layers), "%d", hp.n_layers);
	snprintf(heads, sizeof(heads), "%d", hp.n_kv_heads);
	snprintf(hdim, sizeof(hdim), "%d", hp.head_dim);
	pick_port(http, sizeof(http));

	snprintf(rt, sizeof(rt), "%s/bdfp4-serve.XXXXXX", base && *base ? base : "/tmp");
	if (strlen(rt) > 80)
		snprintf(rt, sizeof(rt), "/tmp/bdfp4-serve.XXXXXX"); /* Unix socket paths */
	if (!mkdtemp(rt)) {
		fprintf(stderr, "bdfp4 serve: %s: %s\n", rt, strerror(errno));
		return 1;
	}
	snprintf(pool_sock, sizeof(pool_sock), "%s/kvpool.sock", rt);
	snprintf(pool_ep, sizeof(pool_ep), "ipc://%s/kvpool-alloc.sock", rt);
	snprintf(front_ipc, sizeof(front_ipc), "ipc://%s/router.sock", rt);
	snprintf(workers_ep, sizeof(workers_ep), "ipc://%s/router-workers.sock", rt);
	snprintf(fronts, sizeof(fronts), "%s,%s", front ? front : "tcp://127.0.0.1:5555",
		 front_ipc);

	snprintf(path, sizeof(path), "%s/kvpoold", bin);
	argv_set(&ps[0], "kvpoold", (const char *const[]){
		path, "--no-config", "--socket", pool_sock, "--endpoint", pool_ep, "--backend",
		backend, "--tp", tp == 2 ? "2" : "1", "--kv-config", kv, "--layers", layers,
		"--kv-heads", heads, "--head-dim", hdim, "--max-seq-len", seq, "--slots", slots,
		"--memory-bytes", strcmp(backend, "cpu") ? "0" : "256M", NULL });
	snprintf(path, sizeof(path), "%s/routerd", bin);
	argv_set(&ps[1], "routerd", (const char *const[]){
		path, "--no-config", "--frontend", fronts, "--workers", workers_ep, "--pool",
		pool_ep, "--model", model, "--tp", tp == 2 ? "2" : "1", "--http", http, NULL });
	snprintf(path, sizeof(path), "%s/workerd", bin);
	n = 2 + tp;
	for (int r = 0; r < tp; r++) {
		char name[24];

		snprintf(name, sizeof(name), "workerd-%d", r);
		argv_set(&ps[2 + r], name, (const char *const[]){
			path, "--no-config", "--rank", r ? "1" : "0", "--tp", tp == 2 ? "2" : "1",
			"--model", model, "--pool-socket", pool_sock, "--router", workers_ep,
			"--allreduce-dir", rt, "--threads", threads, NULL });
	}

	sigemptyset(&sa.sa_mask);
	sigaction(SIGINT, &sa, NULL);
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGCHLD, &sa, NULL);
	setenv("OPENBLAS_NUM_THREADS", "1", 0);
	if (getenv("NOTIFY_SOCKET")) {
		snprintf(notify, sizeof(notify), "%s", getenv("NOTIFY_SOCKET"));
		unsetenv("NOTIFY_SOCKET"); /* serve's, not its children's */
	}

	fprintf(stderr, "bdfp4 serve: runtime directory %s; starting kvpoold\n", rt);
	end = bd_now_ms() + UP_MS;
	if (start(&ps[0]) < 0)
		goto fail;
	while (!pool_answers(pool_ep)) {
		reap(ps, n);
		if (!ps[0].pid || got_stop || bd_now_ms() > end) {
			fprintf(stderr, "bdfp4 serve: kvpoold %s\n",
				got_stop ? "start interrupted" : "did not come up");
			goto fail;
		}
		sleep_ms(100);
	}
	fprintf(stderr, "bdfp4 serve: starting routerd and %d worker rank(s)\n", tp);
	for (int i = 1; i < n; i++)
		if (start(&ps[i]) < 0)
			goto fail;
	while ((h = router_health(front_ipc)) != 1) {
		reap(ps, n);
		for (int i = 0; i < n; i++)
			if (!ps[i].pid) {
				fprintf(stderr, "bdfp4 serve: %s exited at start (status %d)\n",
					ps[i].name, ps[i].exit_status);
				goto fail;
			}
		if (got_stop || bd_now_ms() > end) {
			fprintf(stderr, "bdfp4 serve: the router %s\n",
				got_stop ? "start interrupted" : "did not start serving");
			goto fail;
		}
		sleep_ms(200);
	}
	printf("bdfp4 serve: serving %s (tp %d, %s backend, %s)\n"
	       "  HTTP    http://%s/v1  (OpenAI API; /health, /metrics at http://%s)\n"
	       "  ZeroMQ  %s\n"
	       "  Ctrl-C stops it\n", model, tp, backend, kv, http, http, fronts);
	fflush(stdout);
	if (*notify) {
		setenv("NOTIFY_SOCKET", notify, 1);
		sd_notify(1, "READY=1"); /* 1: NOTIFY_SOCKET unset again */
	}

	while (!got_stop) {
		int64_t now = bd_now_ms();

		sleep_ms(100);
		reap(ps, n);
		for (int i = 0; i < n && !got_stop; i++) {
			struct proc *p = &ps[i];

			if (p->pid || (p->start_at && now < p->start_at))
				continue;
			if (!p->start_at) {
				/* it ran long enough: failures are spaced from 1 s again */
				if (now - p->started > 60000)
					p->backoff_ms = 0;
				p->backoff_ms = p->backoff_ms ? p->backoff_ms * 2 : 1000;
				if (p->backoff_ms > BACKOFF_MAX_MS)
					p->backoff_ms = BACKOFF_MAX_MS;
				p->start_at = now + p->backoff_ms;
				fprintf(stderr, "bdfp4 serve: %s exited (status %d): restarting in "
					"%d ms\n", p->name, p->exit_status, p->backoff_ms);
				continue;
			}
			fprintf(stderr, "bdfp4 serve: restarting %s\n", p->name);
			start(p);
		}
	}
	fprintf(stderr, "bdfp4 serve: stopping (the router drains its requests first)\n");
	goto stop;
fail:
	rc = 1;
stop:
	/* the router first (its drain needs the workers), then the workers, then the pool */
	if (!stop_one(ps, n, &ps[1]))
		rc = 1;
	for (int i = 2; i < n; i++)
		if (!stop_one(ps, n, &ps[i]))
			rc = 1;
	if (!stop_one(ps, n, &ps[0]))
		rc = 1;
	for (int i = 0; i < n; i++)
		argv_free(&ps[i]);
	snprintf(path, sizeof(path), "rm -rf '%s'", rt);
	if (system(path) != 0)
		fprintf(stderr, "bdfp4 serve: %s was not removed\n", rt);
	fprintf(stderr, "bdfp4 serve: %s\n", rc ? "stopped, with errors" : "stopped cleanly");
	return rc;
}
