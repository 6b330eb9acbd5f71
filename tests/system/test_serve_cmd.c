/* test_serve_cmd.c — `bdfp4 serve`: the whole system in the foreground. It comes up serving
 * on the HTTP and ZeroMQ endpoints it prints, restarts a worker that was killed, and stops
 * every daemon cleanly on SIGTERM (exit 0, its runtime directory removed).
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "serve/bd_client.h"
#include "serve_common.h"

#define WAIT_MS 180000

static struct sv_env E;
static struct sv_daemon serve = { .notify_fd = -1 };

static void init(void)
{
	sv_init(&E);
}

static void fini(void)
{
	if (serve.pid > 0) {
		kill(serve.pid, SIGKILL);
		waitpid(serve.pid, NULL, 0);
	}
	sv_fini(&E);
}

TestSuite(serve_cmd, .init = init, .fini = fini, .timeout = 600);

static char *slurp(const char *path)
{
	static char buf[1 << 16];
	FILE *f = fopen(path, "r");
	size_t n = 0;

	if (f) {
		n = fread(buf, 1, sizeof(buf) - 1, f);
		fclose(f);
	}
	buf[n] = 0;
	return buf;
}

/* The HTTP status of GET url (curl), 0 when none. */
static int http_status(const char *url)
{
	char cmd[400], out[16] = "";
	FILE *p;

	snprintf(cmd, sizeof(cmd), "curl -s -o /dev/null -w '%%{http_code}' '%s'", url);
	p = popen(cmd, "r");
	cr_assert(p);
	if (!fgets(out, sizeof(out), p))
		out[0] = 0;
	pclose(p);
	return atoi(out);
}

static bool health(struct bd_client_health *h)
{
	struct bd_client *c;
	bool ok;

	if (bd_client_new(E.front_ep, &c) < 0)
		return false;
	ok = bd_client_health(c, 2000, h) == 0;
	bd_client_free(c);
	return ok;
}

Test(serve_cmd, up_restart_and_stop)
{
	const char *args[] = { "serve", "--model", E.model, "--http", "127.0.0.1:0", "--frontend",
			       E.front_ep, "--run-dir", E.dir, NULL };
	struct bd_client_health h;
	char url[160], *p, *log;
	int old_pid, st;
	int64_t end;
	bool back = false;

	sv_spawn(&E, &serve, "bdfp4", args);
	cr_assert(sv_wait_notify(&serve, "READY=1", WAIT_MS), "serve did not come up:\n%s",
		  sv_log_tail(&serve));
	log = slurp(serve.log);
	p = strstr(log, "HTTP    http://");
	cr_assert(p, "no HTTP endpoint printed:\n%s", log);
	p += strlen("HTTP    ");
	cr_assert(strstr(p, "/v1"), "%s", log);
	snprintf(url, sizeof(url), "%.*s", (int)(strstr(p, "/v1") - p), p);
	cr_expect(strstr(log, "ZeroMQ  ") && strstr(log, E.front_ep), "no ZeroMQ endpoint:\n%s",
		  log);
	{
		char u[200];

		snprintf(u, sizeof(u), "%s/health", url);
		cr_expect_eq(http_status(u), 200, "GET %s", u);
		snprintf(u, sizeof(u), "%s/v1/models", url);
		cr_expect_eq(http_status(u), 200, "GET %s", u);
	}

	/* a worker killed: serve starts another, the group forms again */
	cr_assert(health(&h) && h.healthy && h.n_workers == 2);
	old_pid = h.workers[1].pid;
	cr_assert_gt(old_pid, 0);
	cr_assert_eq(kill(old_pid, SIGKILL), 0);
	end = sv_now_ms() + WAIT_MS;
	while (sv_now_ms() < end && !back) {
		usleep(200000);
		back = health(&h) && h.healthy && h.workers[1].alive &&
		       h.workers[1].pid != old_pid && h.workers[1].pid > 0;
	}
	cr_assert(back, "the killed worker was not restarted:\n%s", sv_log_tail(&serve));
	cr_expect(strstr(slurp(serve.log), "workerd-1 exited"), "serve said nothing of it");

	/* SIGTERM: everything stops, exit 0 */
	cr_assert_eq(kill(serve.pid, SIGTERM), 0);
	end = sv_now_ms() + WAIT_MS;
	while (sv_now_ms() < end && waitpid(serve.pid, &st, WNOHANG) != serve.pid)
		usleep(50000);
	cr_assert(sv_now_ms() < end, "serve did not stop:\n%s", sv_log_tail(&serve));
	serve.pid = 0;
	cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "serve's exit status %d:\n%s", st,
		  sv_log_tail(&serve));
	cr_expect(strstr(slurp(serve.log), "stopped cleanly"));
	cr_expect(kill(h.workers[1].pid, 0) < 0 && errno == ESRCH, "a worker outlived serve");
	cr_expect(health(&h) == false, "the router still answers");
}

/* Output of a program of $BD_BIN with args (its stdout and stderr) into buf; its exit status. */
static int run_prog(const char *cmdline, char *buf, size_t cap)
{
	char cmd[PATH_MAX + 512];
	FILE *p;
	size_t n;
	int st;

	snprintf(cmd, sizeof(cmd), "%s/%s 2>&1", E.bin, cmdline);
	p = popen(cmd, "r");
	cr_assert(p);
	n = fread(buf, 1, cap - 1, p);
	buf[n] = 0;
	st = pclose(p);
	return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

/* --version on every program: its name and the build's git description, exit 0. */
Test(serve_cmd, every_program_has_version)
{
	static const char *const progs[] = { "kvpoold", "kvpoolctl", "routerd", "workerd",
					     "bdfp4", "loadgen" };
	char cmd[64], out[512], first[512] = "";

	for (size_t i = 0; i < sizeof(progs) / sizeof(progs[0]); i++) {
		snprintf(cmd, sizeof(cmd), "%s --version", progs[i]);
		cr_expect_eq(run_prog(cmd, out, sizeof(out)), 0, "%s: %s", cmd, out);
		cr_expect(!strncmp(out, progs[i], strlen(progs[i])) && out[strlen(progs[i])] == ' ',
			  "%s: '%s'", cmd, out);
		cr_expect_gt(strlen(out), strlen(progs[i]) + 2, "%s: no version", cmd);
		if (!i)
			snprintf(first, sizeof(first), "%s", out + strlen(progs[i]));
		else
			cr_expect_str_eq(out + strlen(progs[i]), first, "one build, one version");
	}
}

/* A client pointed at a router that is not there fails at once with why; a prompt from a file
 * that does not exist too. */
Test(serve_cmd, client_fails_fast_and_reads_prompts)
{
	char cmd[PATH_MAX], out[1024];

	snprintf(cmd, sizeof(cmd), "bdfp4 client --router ipc://%s/none.sock Hello", E.dir);
	cr_expect_eq(run_prog(cmd, out, sizeof(out)), 1);
	cr_expect(strstr(out, "no such socket"), "%s", out);
	snprintf(cmd, sizeof(cmd), "kvpoolctl --endpoint ipc://%s/none.sock stats", E.dir);
	cr_expect_eq(run_prog(cmd, out, sizeof(out)), 1);
	cr_expect(strstr(out, "no such socket"), "%s", out);
	snprintf(cmd, sizeof(cmd), "bdfp4 client --router %s @%s/no-such-file", E.front_ep, E.dir);
	cr_expect_eq(run_prog(cmd, out, sizeof(out)), 1);
	cr_expect(strstr(out, "no-such-file: No such file"), "%s", out);
}

/* Prompts from stdin (-) and from a file (@FILE) reach the router as the same text. */
Test(serve_cmd, prompt_from_stdin_and_file)
{
	char cmd[PATH_MAX * 2], a[4096], b[4096], c[4096], file[PATH_MAX];
	FILE *f;

	sv_start_system(&E, NULL, WAIT_MS);
	snprintf(file, sizeof(file), "%s/prompt.txt", E.dir);
	f = fopen(file, "w");
	cr_assert(f);
	fputs("The capital of France is", f);
	fclose(f);
	snprintf(cmd, sizeof(cmd), "bdfp4 client --router %s --raw --max-tokens 6 "
		 "'The capital of France is'", E.front_ep);
	cr_assert_eq(run_prog(cmd, a, sizeof(a)), 0, "%s", a);
	snprintf(cmd, sizeof(cmd), "bdfp4 client --router %s --raw --max-tokens 6 @%s", E.front_ep,
		 file);
	cr_assert_eq(run_prog(cmd, b, sizeof(b)), 0, "%s", b);
	snprintf(cmd, sizeof(cmd), "bdfp4 client --router %s --raw --max-tokens 6 - < %s",
		 E.front_ep, file);
	cr_assert_eq(run_prog(cmd, c, sizeof(c)), 0, "%s", c);
	cr_expect_gt(strlen(a), 0);
	cr_expect_str_eq(b, a, "the @file prompt's answer differs");
	cr_expect_str_eq(c, a, "the stdin prompt's answer differs");
}
