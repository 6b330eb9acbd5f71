/* test_fdstore_run.c — fdstore-run (deploy/fdstore_run.c), the part of systemd that
 * deploy/run-local.sh gives kvpoold: a kvpoold killed with SIGKILL is started again on the fds
 * it stored, adopts its arenas (the same arena id) and answers; SIGTERM to fdstore-run stops
 * kvpoold and exits 0; bad usage exits 2.
 */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pool/bd_pool_client.h"
#include "serve_common.h"
#include "spawn.h"

#define WAIT_MS 60000

static struct sv_env E;

static void init(void)
{
	sv_init(&E);
}

static void fini(void)
{
	sv_fini(&E);
}

TestSuite(fdstore_run, .init = init, .fini = fini, .timeout = 300);

/* The pid in path, or 0 while there is none. */
static pid_t read_pid(const char *path)
{
	FILE *f = fopen(path, "r");
	int pid = 0;

	if (!f)
		return 0;
	if (fscanf(f, "%d", &pid) != 1)
		pid = 0;
	fclose(f);
	return (pid_t)pid;
}

/* Waits until path holds a pid other than not; returns it, or 0 at the deadline. */
static pid_t wait_pid(const char *path, pid_t not)
{
	for (int64_t end = sv_now_ms() + WAIT_MS; sv_now_ms() < end; usleep(50000)) {
		pid_t p = read_pid(path);

		if (p > 0 && p != not)
			return p;
	}
	return 0;
}

/* How many times what occurs in the file at path. */
static int count_in(const char *path, const char *what)
{
	char buf[65536];
	FILE *f = fopen(path, "r");
	size_t n;
	int k = 0;

	if (!f)
		return 0;
	n = fread(buf, 1, sizeof(buf) - 1, f);
	fclose(f);
	buf[n] = 0;
	for (const char *p = buf; (p = strstr(p, what)); p += strlen(what))
		k++;
	return k;
}

Test(fdstore_run, a_killed_kvpoold_starts_again_on_its_stored_fds)
{
	char run[PATH_MAX + 16], pool[PATH_MAX + 16], pidfile[128], notify[128], log[128];
	struct bd_pool_stats *s;

	snprintf(run, sizeof(run), "%s/fdstore-run", E.bin);
	snprintf(pool, sizeof(pool), "%s/kvpoold", E.bin);
	snprintf(pidfile, sizeof(pidfile), "%s/kvpoold.pid", E.dir);
	snprintf(notify, sizeof(notify), "%s/kvpoold-notify.sock", E.dir);
	snprintf(log, sizeof(log), "%s/kvpoold.log", E.dir);
	const char *argv[] = { run, pidfile, notify, log, "--", pool, "--no-config", "--socket",
			       E.pool_sock, "--endpoint", E.pool_ep, "--tp", "2", "--layers", "2",
			       "--kv-heads", "1", "--head-dim", "64", "--kv-config",
			       "bitdecoding-nvfp4", "--max-seq-len", "1024", "--pages", "16",
			       "--slots", "4", NULL };
	pid_t sup = sp_spawn(argv, log, NULL, NULL);
	cr_assert_gt(sup, 0);

	pid_t first = wait_pid(pidfile, 0);
	cr_assert_gt(first, 0, "no pid file; log:\n%s", sv_log_tail(&E.pool));
	s = sv_pool_stats(&E);
	cr_assert_not_null(s, "kvpoold does not answer");
	cr_expect_eq(s->pages_total, 16);
	bd_pool_stats_free(s);
	cr_assert_eq(count_in(log, "adopted the stored arenas"), 0, "a first start adopted");

	cr_assert_eq(kill(first, SIGKILL), 0);
	pid_t second = wait_pid(pidfile, first);
	cr_assert_gt(second, 0, "kvpoold was not started again");
	s = sv_pool_stats(&E);
	cr_assert_not_null(s, "the restarted kvpoold does not answer");
	cr_expect_eq(s->pages_total, 16);
	cr_expect_eq(s->pages_free, 16);
	bd_pool_stats_free(s);
	cr_expect_eq(count_in(log, "adopted the stored arenas"), 1,
		     "the restart did not adopt what the first kvpoold stored");
	cr_expect_eq(count_in(log, "ended with status 137"), 1);

	cr_assert_eq(kill(sup, SIGTERM), 0);
	cr_expect_eq(sp_reap(sup, WAIT_MS), 0, "fdstore-run did not pass kvpoold's exit 0 on");
	cr_expect_neq(kill(second, 0), 0, "kvpoold outlived fdstore-run's SIGTERM");
}

Test(fdstore_run, bad_usage_exits_2)
{
	char run[PATH_MAX + 16];

	snprintf(run, sizeof(run), "%s/fdstore-run", E.bin);
	const char *argv[] = { run, "a", "b", "c", "not-the-separator", "x", NULL };
	pid_t p = sp_spawn(argv, NULL, NULL, NULL);

	cr_assert_gt(p, 0);
	cr_expect_eq(sp_reap(p, WAIT_MS), 2);
}
