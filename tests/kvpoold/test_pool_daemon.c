/* test_pool_daemon.c — a real kvpoold on the CPU backend, with the lib client (bd_pool_client.h),
 * other processes and kvpoolctl.
 *
 * The daemon comes from $BD_BIN (the Makefile's unit-run sets it), else ../bin beside this test
 * binary. Each test gets a private temp dir for the attach socket, the ipc:// allocation
 * endpoint and an sd_notify socket (NOTIFY_SOCKET) on which READY=1 says the daemon listens.
 * The daemon dies with the test process (PR_SET_PDEATHSIG) and is killed in .fini otherwise;
 * every wait is bounded.
 *
 * Geometry (flags): NVFP4, 1 layer, 1 KV head, d = 64, 40 pages, 2 slots, max_seq_len 1024.
 * By hand from bd_layout.h (see test_pool_plan.c): page 9472 bytes, slot 36864 bytes; arena
 * 40·9472 = 378880 → 380928 at 4 KiB, + 2·36864 = 454656 bytes.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <grp.h>
#include <jansson.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>
#include <dirent.h>

#include <zmq.h>

#include "base/bd_clock.h"
#include "quant/bd_kvcfg.h"
#include "quant/bd_layout.h"
#include "pool/bd_pool_client.h"
#include "kvpool.pb-c.h"
#include "pool_test.h"
#include "spawn.h"

#define TIMEOUT_MS 20000

static struct {
	struct pt_env e;
	pid_t pid;
	int notify_fd;
} D;

static const char *const SMALL[] = { "--tp", "1", "--layers", "1", "--kv-heads", "1",
				     "--head-dim", "64", "--pages", "40", "--slots", "2",
				     "--max-seq-len", "1024", NULL };

static void init(void)
{
	memset(&D, 0, sizeof(D));
	D.notify_fd = -1;
	pt_init(&D.e, "bdfp4-pool");
	D.notify_fd = sp_notify_open(D.e.notify);
	cr_assert_geq(D.notify_fd, 0, "notify socket %s: %d", D.e.notify, D.notify_fd);
}

static void fini(void)
{
	if (D.pid > 0) {
		kill(D.pid, SIGKILL);
		waitpid(D.pid, NULL, 0);
		D.pid = 0;
	}
	if (D.notify_fd >= 0)
		close(D.notify_fd);
	pt_fini(&D.e);
}

TestSuite(pool_daemon, .init = init, .fini = fini, .timeout = 120);

/* Starts kvpoold with the SMALL geometry unless `own` is set, then `extra`; env_extra (may be
 * NULL) is one NAME=VALUE added to the environment. Does not wait. */
static pid_t spawn(bool own, const char *const *extra, const char *env_extra)
{
	const char *argv[64];
	pid_t pid;

	pt_argv(&D.e, argv, 64, own, own ? NULL : SMALL, extra);
	pid = sp_spawn(argv, D.e.log, D.e.notify, env_extra);
	cr_assert_gt(pid, 0);
	D.pid = pid;
	return pid;
}

/* Waits for a notify datagram containing what; false on timeout or when the daemon exits. */
static bool wait_notify(const char *what, int timeout_ms)
{
	return sp_wait_notify(D.notify_fd, &D.pid, what, timeout_ms);
}

static void start(bool own, const char *const *extra)
{
	spawn(own, extra, NULL);
	cr_assert(wait_notify("READY=1", TIMEOUT_MS), "kvpoold did not get ready (log in %s)",
		  D.e.log);
}

static int stop(void)
{
	int st;

	kill(D.pid, SIGTERM);
	st = sp_reap(D.pid, TIMEOUT_MS);
	D.pid = 0;
	return st;
}

static struct bd_pool_conn *conn(void)
{
	return pt_conn(&D.e);
}

static struct bd_pool_stats *stats(struct bd_pool_conn *c)
{
	return pt_stats(c);
}

static int count_fds(pid_t pid)
{
	char path[64];
	struct dirent *de;
	DIR *d;
	int n = 0;

	snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
	d = opendir(path);
	if (!d)
		return -1;
	while ((de = readdir(d)))
		n += de->d_name[0] != '.';
	closedir(d);
	return n;
}

static bool log_has(const char *what)
{
	return pt_log_has(&D.e, what);
}

/* ---- start, stats, stop ------------------------------------------------------------------ */

Test(pool_daemon, ready_status_stats_and_clean_stop)
{
	struct bd_pool_conn *c;
	struct bd_pool_stats *s;
	struct stat st;

	start(false, NULL);
	cr_expect(wait_notify("STATUS=pages 0/40 used", TIMEOUT_MS), "no STATUS with the fill");
	c = conn();
	s = stats(c);
	cr_expect_str_eq(s->backend, "cpu");
	cr_expect_str_eq(s->page_format, "nvfp4");
	cr_expect_eq(s->pages_total, 40);
	cr_expect_eq(s->pages_free, 40);
	cr_expect_eq(s->slots_total, 2);
	cr_expect_eq(s->page_bytes, 9472);
	cr_expect_eq(s->slot_bytes, 36864);
	cr_expect_eq(s->max_seq_len, 1024);
	cr_assert_eq(s->n_devices, 1);
	if (sysconf(_SC_PAGESIZE) == 4096)
		cr_expect_eq(s->devices[0].arena_bytes, 454656);
	cr_expect_eq(s->devices[0].page_region_bytes, 40 * 9472);
	cr_expect_eq(s->devices[0].slot_region_bytes, 2 * 36864);
	bd_pool_stats_free(s);
	bd_pool_conn_free(c);
	/* both sockets are 0660 */
	cr_assert_eq(stat(D.e.sock, &st), 0);
	cr_expect_eq(st.st_mode & 0777, 0660);
	cr_assert_eq(stat(D.e.endpoint + 6, &st), 0);
	cr_expect_eq(st.st_mode & 0777, 0660);
	cr_expect_eq(stop(), 0, "SIGTERM must exit 0 (log in %s)", D.e.log);
	cr_expect_neq(access(D.e.sock, F_OK), 0, "the attach socket was left behind");
}

Test(pool_daemon, watchdog_pings)
{
	spawn(false, NULL, "WATCHDOG_USEC=200000");
	cr_assert(wait_notify("READY=1", TIMEOUT_MS));
	cr_expect(wait_notify("WATCHDOG=1", 5000), "no WATCHDOG=1 with WATCHDOG_USEC set");
}

/* kvpoold with only `extra` flags exits 1 at start, its log holding each of says[] (pairs of
 * a text and why it must be there, NULL-terminated). */
static void fails_at_start(const char *const *extra, const char *const *says)
{
	cr_expect_eq(sp_reap(spawn(true, extra, NULL), TIMEOUT_MS), 1);
	D.pid = 0;
	for (size_t i = 0; says[i]; i += 2)
		cr_expect(log_has(says[i]), "%s: no '%s' in the log", says[i + 1], says[i]);
}

Test(pool_daemon, budget_too_small_fails_at_start)
{
	static const char *const extra[] = { "--no-config", "--memory-bytes", "1M",
					     "--max-seq-len", "1000000", "--tp", "1", NULL };
	static const char *const says[] = {
		"max_seq_len=1000000", "the message names the request length",
		"raise memory_bytes", "the message says what to change", NULL,
	};

	fails_at_start(extra, says);
}

/* An absolute budget beyond the machine's RAM is refused at start, before any page
 * bookkeeping is planned for memory the kernel cannot back. */
Test(pool_daemon, budget_beyond_ram_fails_at_start)
{
	static const char *const extra[] = { "--no-config", "--memory-bytes", "1000T", "--tp", "2",
					     NULL };
	static const char *const says[] = {
		"more than the", "the message compares with the RAM",
		"of RAM", "the message names the RAM", NULL,
	};

	fails_at_start(extra, says);
}

/* No GPU or no driver (the build machine): the CUDA backend says why and exits 1, no crash,
 * no socket left. On a machine with a GPU the daemon comes up instead: skipped. */
Test(pool_daemon, cuda_backend_without_a_gpu_says_why)
{
	static const char *const extra[] = { "--backend", "cuda", NULL };
	int64_t end = bd_now_ms() + TIMEOUT_MS;
	pid_t pid = spawn(false, extra, NULL);
	int st = -1;

	while (bd_now_ms() < end) {
		if (waitpid(pid, &st, WNOHANG) == pid)
			break;
		if (log_has("listening on")) {
			stop();
			cr_skip_test("a CUDA device is present");
		}
		usleep(10000);
	}
	D.pid = 0;
	cr_assert(WIFEXITED(st), "kvpoold --backend cuda did not exit by itself (status %d)", st);
	cr_expect_eq(WEXITSTATUS(st), 1);
	cr_expect(log_has("backend cuda: "), "the log names the backend (log in %s)", D.e.log);
	cr_expect(log_has("no CUDA driver") || log_has("CUDA devices") || log_has("cuInit") ||
		  log_has("built without CUDA"), "the log says what is missing (log in %s)", D.e.log);
	cr_expect_neq(access(D.e.sock, F_OK), 0, "an attach socket was left behind");
}

Test(pool_daemon, config_file_then_flags)
{
	char conf[128], arg[160];
	FILE *f;
	struct bd_pool_conn *c;
	struct bd_pool_stats *s;
	const char *extra[] = { "--config", conf, "--slots", "5", NULL };

	snprintf(conf, sizeof(conf), "%s/bdfp4.conf", D.e.dir);
	f = fopen(conf, "w");
	cr_assert_not_null(f);
	fputs("[pool]\ntp = 1\nlayers = 1\nkv_heads = 1\nhead_dim = 64\npages = 40\n"
	      "slots = 3\nmax_seq_len = 2048\n[router]\nunrelated = 1\n",
	      f);
	fclose(f);
	start(true, extra);
	c = conn();
	s = stats(c);
	cr_expect_eq(s->slots_total, 5, "the flag overrides the file");
	cr_expect_eq(s->max_seq_len, 2048, "the file overrides the default");
	bd_pool_stats_free(s);
	bd_pool_conn_free(c);
	cr_expect_eq(stop(), 0);

	/* a key [pool] does not know is fatal */
	f = fopen(conf, "a");
	fputs("[pool]\nslost = 4\n", f);
	fclose(f);
	snprintf(arg, sizeof(arg), "%s", conf);
	{
		const char *bad[] = { "--config", arg, NULL };

		cr_expect_eq(sp_reap(spawn(true, bad, NULL), TIMEOUT_MS), 1);
		D.pid = 0;
		cr_expect(log_has("unknown key 'slost'"));
	}
}

/* ---- two processes, one page ------------------------------------------------------------- */

static void fill(bd_bf16 *x, size_t n, uint32_t seed)
{
	for (size_t i = 0; i < n; i++) {
		seed = seed * 1664525u + 1013904223u;
		x[i] = bd_f32_to_bf16(((float)(seed >> 8) / 16777216.0f - 0.5f) * 4.0f);
	}
}

/* The page-head contents both children agree on: K and V of head h, seeded by h. */
static int write_heads(const struct bd_layout *lay, void *page)
{
	const struct bd_kvcfg *cfg = bd_kvcfg_find("bitdecoding-nvfp4");
	size_t n = (size_t)BD_PAGE_TOKENS * (size_t)lay->d;
	bd_bf16 *k = malloc(n * sizeof(*k)), *v = malloc(n * sizeof(*v));
	int e = 0;

	for (int h = 0; h < lay->n_kv_heads && !e; h++) {
		fill(k, n, 100u + (uint32_t)h);
		fill(v, n, 200u + (uint32_t)h);
		e = bd_page_write_head(lay, cfg, k, v, NULL, page, h);
	}
	free(k);
	free(v);
	return e;
}

static int write_slot_token(const struct bd_layout *lay, void *slot)
{
	const struct bd_kvcfg *cfg = bd_kvcfg_find("bitdecoding-nvfp4");
	float k[64], v[64];

	for (int i = 0; i < 64; i++) {
		k[i] = (float)(i % 7) - 3.0f;
		v[i] = 0.25f * (float)i;
	}
	return bd_kv_write_token(lay, cfg, slot, 1, 1, 3, k, v, NULL);
}

/* Writer: allocates a page and a slot, attaches rank 1 and writes them, detaches (one live
 * attachment per rank: the reader takes rank 1 next), tells the reader where, waits for it. */
static int writer(int go_fd, int where_fd, int done_fd, const char *sock, const char *endpoint)
{
	struct bd_pool_attach *a;
	struct bd_pool_conn *c;
	const struct bd_pool_geometry *g;
	int32_t where[2];
	char b;

	if (read(go_fd, &b, 1) != 1)
		return 10; /* the reader attached first */
	if (bd_pool_conn_new(endpoint, 5000, &c) < 0)
		return 11;
	if (bd_pool_page_alloc(c, 501, 9, 1, &where[0]) < 0 ||
	    bd_pool_slot_assign(c, 501, 9, &where[1]) < 0)
		return 12;
	if (pt_attach(sock, endpoint, 1, NULL, 0, &a) < 0)
		return 13;
	g = bd_pool_attach_geometry(a);
	if (write_heads(&g->layout, bd_layout_page(&g->layout, bd_pool_attach_pages(a), 1,
						   where[0])) < 0)
		return 14;
	if (write_slot_token(&g->layout, bd_pool_attach_slot(a, where[1])) < 0)
		return 15;
	bd_pool_detach(a);
	if (write(where_fd, where, sizeof(where)) != sizeof(where))
		return 16;
	if (read(done_fd, &b, 1) != 1)
		return 17;
	bd_pool_conn_free(c);
	return 0;
}

static bool all_zero(const uint8_t *p, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (p[i])
			return false;
	return true;
}

/* Reader: attaches rank 0, lets the writer go, attaches rank 1 once the writer has left it, then
 * finds exactly the bytes the layout module writes for the same inputs, in the page and in the
 * slot, on rank 1 and only there. */
static int reader(int go_fd, int where_fd, int done_fd, const char *sock, const char *endpoint)
{
	struct bd_pool_attach *a, *a0;
	const struct bd_pool_geometry *g;
	char err[256];
	int32_t where[2];
	uint8_t *want_page, *want_slot, *got;
	int rc = 0;

	if (pt_attach(sock, endpoint, 0, err, sizeof(err), &a0) < 0)
		return 21;
	if (write(go_fd, "g", 1) != 1 || read(where_fd, where, sizeof(where)) != sizeof(where))
		return 23;
	if (pt_attach(sock, endpoint, 1, err, sizeof(err), &a) < 0)
		return 20;
	g = bd_pool_attach_geometry(a);
	if (g->layout.n_kv_heads != 2 || g->layout.n_layers != 2 || g->tp != 2 || g->rank != 1)
		return 22;
	want_page = calloc(1, g->layout.page_bytes);
	want_slot = calloc(1, g->layout.slot_bytes);
	if (write_heads(&g->layout, want_page) < 0 || write_slot_token(&g->layout, want_slot) < 0)
		return 24;
	got = bd_layout_page(&g->layout, bd_pool_attach_pages(a), 1, where[0]);
	if (all_zero(want_page, g->layout.page_bytes))
		rc = 25;
	else if (memcmp(got, want_page, g->layout.page_bytes))
		rc = 26;
	else if (memcmp(bd_pool_attach_slot(a, where[1]), want_slot, g->layout.slot_bytes))
		rc = 27;
	else if (!all_zero(bd_layout_page(&g->layout, bd_pool_attach_pages(a0), 1, where[0]),
			   g->layout.page_bytes))
		rc = 28; /* rank 0 has its own arena */
	if (write(done_fd, "d", 1) != 1)
		rc = 29;
	free(want_page);
	free(want_slot);
	bd_pool_detach(a0);
	bd_pool_detach(a);
	return rc;
}

Test(pool_daemon, two_processes_share_a_page)
{
	static const char *const extra[] = { "--tp", "2", "--layers", "2", "--kv-heads", "4",
					     "--head-dim", "64", "--pages", "16", "--slots", "2",
					     "--max-seq-len", "1024", NULL };
	int go[2], where[2], done[2];
	pid_t w, r;

	start(true, extra);
	cr_assert_eq(pipe(go), 0);
	cr_assert_eq(pipe(where), 0);
	cr_assert_eq(pipe(done), 0);
	r = fork();
	cr_assert_geq(r, 0);
	if (r == 0)
		_exit(reader(go[1], where[0], done[1], D.e.sock, D.e.endpoint));
	w = fork();
	cr_assert_geq(w, 0);
	if (w == 0)
		_exit(writer(go[0], where[1], done[0], D.e.sock, D.e.endpoint));
	close(go[0]);
	close(go[1]);
	close(where[0]);
	close(where[1]);
	close(done[0]);
	close(done[1]);
	cr_expect_eq(sp_reap(r, TIMEOUT_MS), 0, "reader (codes in reader())");
	cr_expect_eq(sp_reap(w, TIMEOUT_MS), 0, "writer (codes in writer())");
}

/* ---- clients that die, clients that may not attach --------------------------------------- */

Test(pool_daemon, dead_client_is_detached_without_leaks)
{
	struct bd_pool_conn *c;
	struct bd_pool_stats *s;
	uint64_t n_req = 0, freed = 0;
	int base, fds = -1;
	int64_t end;
	pid_t child;
	int ready[2];
	char b;

	start(false, NULL);
	c = conn();
	s = stats(c); /* our own connection is part of the baseline */
	bd_pool_stats_free(s);
	base = count_fds(D.pid);
	cr_assert_gt(base, 0);
	cr_assert_eq(pipe(ready), 0);
	child = fork();
	cr_assert_geq(child, 0);
	if (child == 0) {
		struct bd_pool_attach *a;
		struct bd_pool_conn *cc;
		int32_t p[3];

		if (pt_attach(D.e.sock, D.e.endpoint, 0, NULL, 0, &a) < 0 ||
		    bd_pool_conn_new(D.e.endpoint, 5000, &cc) < 0 ||
		    bd_pool_page_alloc(cc, 900, 42, 3, p) < 0)
			_exit(1);
		memset(bd_pool_attach_pages(a), 0x11, 64);
		if (write(ready[1], "r", 1) != 1)
			_exit(2);
		pause(); /* until the parent kills it: no detach, no close */
		_exit(3);
	}
	close(ready[1]);
	cr_assert_eq(read(ready[0], &b, 1), 1, "the child failed before attaching");
	close(ready[0]);
	s = stats(c);
	cr_expect_eq(s->devices[0].attached, 1);
	cr_expect_eq(s->n_attachments, 1);
	bd_pool_stats_free(s);
	kill(child, SIGKILL);
	cr_expect_eq(sp_reap(child, TIMEOUT_MS), 128 + SIGKILL);
	/* the attachment goes, its fd goes */
	end = bd_now_ms() + TIMEOUT_MS;
	do {
		s = stats(c);
		fds = count_fds(D.pid);
		if (s->devices[0].attached == 0 && s->n_attachments == 0 && fds == base)
			break;
		bd_pool_stats_free(s);
		s = NULL;
		usleep(20000);
	} while (bd_now_ms() < end);
	cr_assert_not_null(s, "still attached or %d fds (baseline %d)", fds, base);
	/* its pages stay: a worker may die without losing KV; the owner's reclaim frees them */
	cr_expect_eq(s->pages_used, 3);
	bd_pool_stats_free(s);
	cr_assert_eq(bd_pool_owner_reclaim(c, 42, &n_req, &freed), 0);
	cr_expect_eq(n_req, 1);
	cr_expect_eq(freed, 3);
	s = stats(c);
	cr_expect_eq(s->pages_free, s->pages_total);
	cr_expect_eq(s->requests, 0);
	bd_pool_stats_free(s);
	bd_pool_conn_free(c);
	cr_expect_eq(stop(), 0);
}

/* A child as uid/gid 65534 (nobody/nogroup) attaches; returns its bd_pool_attach result as an
 * exit code: 0 attached and mapped, 1 refused with -EACCES, other codes: something else. */
static int attach_as_nobody(void)
{
	uint8_t token[BD_POOL_TOKEN_BYTES];
	pid_t child;

	/* the token comes from the group registered here (the router's part), as a worker's
	 * comes in its RegisterReply: the uid is what the daemon checks */
	cr_assert_eq(pt_group(D.e.endpoint, 1, token, NULL), 0);
	child = fork();

	cr_assert_geq(child, 0);
	if (child == 0) {
		struct bd_pool_attach *a;
		char err[256];
		int e;

		if (setgroups(0, NULL) < 0 || setgid(65534) < 0 || setuid(65534) < 0)
			_exit(10);
		e = bd_pool_attach(D.e.sock, 0, token, err, sizeof(err), &a);
		if (e == -EACCES)
			_exit(strstr(err, "not allowed") ? 1 : 11);
		if (e < 0) {
			fprintf(stderr, "attach as nobody: %s\n", err);
			_exit(12);
		}
		memset(bd_pool_attach_pages(a), 0x22, 16); /* mapped read-write */
		bd_pool_detach(a);
		_exit(0);
	}
	return sp_reap(child, TIMEOUT_MS);
}

/* Starts the daemon with --group group and its attach socket open to everyone, for a test
 * that acts as another user (skipped unless root): a non-member then reaches connect(), so
 * SO_PEERCRED is what refuses it. */
static void start_open_to_all(const char *group)
{
	const char *const extra[] = { "--group", group, NULL };

	if (geteuid() != 0)
		cr_skip_test("needs root to act as another user");
	start(false, extra);
	cr_assert_eq(chmod(D.e.dir, 0711), 0);
	cr_assert_eq(chmod(D.e.sock, 0666), 0);
}

Test(pool_daemon, peers_outside_the_group_are_refused)
{
	struct bd_pool_attach *a;
	struct bd_pool_stats *s;
	struct bd_pool_conn *c;

	start_open_to_all("1");
	{
		int rc = attach_as_nobody();

		cr_expect_eq(rc, 1, "uid 65534 outside group 1 must be refused (child: %d)", rc);
	}
	/* and the daemon still serves the rest */
	cr_assert_eq(pt_attach(D.e.sock, D.e.endpoint, 0, NULL, 0, &a), 0);
	c = conn();
	s = stats(c);
	cr_expect_eq(s->devices[0].attached, 1);
	bd_pool_stats_free(s);
	bd_pool_conn_free(c);
	bd_pool_detach(a);
	cr_expect_eq(stop(), 0);
}

Test(pool_daemon, group_members_may_attach)
{
	start_open_to_all("65534");
	cr_expect_eq(attach_as_nobody(), 0, "gid 65534 is the pool's group");
	cr_expect_eq(stop(), 0);
}

Test(pool_daemon, attach_errors)
{
	struct bd_pool_attach *a = NULL;
	char err[256];

	start(false, NULL);
	cr_expect_eq(pt_attach(D.e.sock, D.e.endpoint, 1, err, sizeof(err), &a), -ENODEV); /* tp 1 */
	cr_expect_neq(strstr(err, "rank 1"), NULL, "%s", err);
	cr_expect_null(a);
	cr_expect_eq(pt_attach(D.e.sock, D.e.endpoint, -1, err, sizeof(err), &a), -EINVAL);
	/* a connection that sends something else than an AttachRequest */
	{
		const char *path = D.e.sock;
		struct sockaddr_un sa = { .sun_family = AF_UNIX };
		int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
		struct pollfd p = { .fd = fd, .events = POLLIN };
		char b;

		snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
		cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
		/* garbage instead of an AttachRequest: an error reply, then EOF */
		cr_assert_eq(send(fd, "\xff\xff\xff", 3, 0), 3);
		cr_assert_eq(poll(&p, 1, TIMEOUT_MS), 1);
		cr_expect_gt(recv(fd, &b, 1, MSG_TRUNC), 0, "an error reply first");
		cr_assert_eq(poll(&p, 1, TIMEOUT_MS), 1);
		cr_expect_eq(recv(fd, &b, 1, 0), 0, "then the connection closes");
		close(fd);
	}
	cr_expect_eq(stop(), 0);
}

/* ---- protocol abuse over the live socket --------------------------------------------------- */

static int reply_code(const void *buf, size_t len)
{
	Bdfp4__PoolReply *rep = bdfp4__pool_reply__unpack(NULL, len, buf);
	int code;

	cr_assert_not_null(rep, "the reply does not parse");
	code = rep->error;
	bdfp4__pool_reply__free_unpacked(rep, NULL);
	return code;
}

static int raw_code(struct bd_pool_conn *c, const void *frame, size_t len)
{
	void *rep;
	size_t rlen;
	int code;

	cr_assert_eq(bd_pool_call_raw(c, frame, len, &rep, &rlen), 0);
	code = reply_code(rep, rlen);
	free(rep);
	return code;
}

Test(pool_daemon, malformed_frames_get_errors_and_the_daemon_serves_on)
{
	static const char *const extra[] = { "--max-frame-bytes", "4096", NULL };
	static const uint8_t junk[] = { 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
					0xff, 0xff };
	static const uint8_t truncated[] = { 0x0a, 0x06, 0x08, 0x01 }; /* 6 promised, 2 sent */
	struct bd_pool_conn *c;
	struct bd_pool_stats *s;
	uint8_t *big = calloc(1, 1 << 20);
	int32_t p[2];
	void *ctx, *req;
	zmq_msg_t m;
	int timeout = 5000, zero = 0;

	start(false, extra);
	c = conn();
	cr_expect_eq(raw_code(c, junk, sizeof(junk)), BD_POOL_ERR_MALFORMED);
	cr_expect_eq(raw_code(c, truncated, sizeof(truncated)), BD_POOL_ERR_MALFORMED);
	cr_expect_eq(raw_code(c, big, 1 << 20), BD_POOL_ERR_OVERSIZE);
	cr_expect_eq(raw_code(c, "", 0), BD_POOL_ERR_UNKNOWN_TYPE);
	free(big);
	/* a request in two parts */
	ctx = zmq_ctx_new();
	req = zmq_socket(ctx, ZMQ_REQ);
	zmq_setsockopt(req, ZMQ_RCVTIMEO, &timeout, sizeof(timeout));
	zmq_setsockopt(req, ZMQ_LINGER, &zero, sizeof(zero));
	cr_assert_eq(zmq_connect(req, D.e.endpoint), 0);
	cr_assert_eq(zmq_send(req, "a", 1, ZMQ_SNDMORE), 1);
	cr_assert_eq(zmq_send(req, "b", 1, 0), 1);
	zmq_msg_init(&m);
	cr_assert_geq(zmq_msg_recv(&m, req, 0), 0, "no reply to a multi-part request");
	cr_expect_eq(reply_code(zmq_msg_data(&m), zmq_msg_size(&m)), BD_POOL_ERR_MALFORMED);
	zmq_msg_close(&m);
	zmq_close(req);
	zmq_ctx_term(ctx);
	/* allocator errors through the client carry the daemon's code and text */
	cr_expect_eq(bd_pool_page_free(c, 77, (int32_t[]){ 0 }, 1, NULL), -ENOENT);
	{
		int code;
		const char *t = bd_pool_conn_error(c, &code);

		cr_expect_eq(code, BD_POOL_ERR_UNKNOWN_REQUEST);
		cr_expect_neq(strstr(t, "77"), NULL, "%s", t);
	}
	/* still serving, nothing lost */
	cr_assert_eq(bd_pool_page_alloc(c, 1, 1, 2, p), 0);
	cr_expect_eq(bd_pool_page_free(c, 1, p, 1, NULL), 0);
	cr_expect_eq(bd_pool_page_free(c, 1, p, 1, NULL), -EALREADY);
	s = stats(c);
	cr_expect_eq(s->pages_used, 1);
	cr_expect_eq(s->errors, 7);
	bd_pool_stats_free(s);
	bd_pool_conn_free(c);
	cr_expect_eq(stop(), 0);
}

/* ---- kvpoolctl ----------------------------------------------------------------------------- */

static char *run_ctl(const char *args, int *ret_status)
{
	char cmd[PATH_MAX + 512];
	static char out[65536];
	size_t n;
	FILE *f;

	snprintf(cmd, sizeof(cmd), "'%s/kvpoolctl' --endpoint '%s' %s 2>&1", D.e.bin, D.e.endpoint,
		 args);
	f = popen(cmd, "r");
	cr_assert_not_null(f);
	n = fread(out, 1, sizeof(out) - 1, f);
	out[n] = 0;
	*ret_status = pclose(f);
	return out;
}

Test(pool_daemon, kvpoolctl_shows_a_live_pool)
{
	struct bd_pool_conn *c;
	struct bd_pool_attach *a;
	json_t *j, *largest;
	json_error_t jerr;
	int32_t p[3], slot;
	char *out;
	int st;

	start(false, NULL);
	c = conn();
	cr_assert_eq(bd_pool_page_alloc(c, 77, 5, 3, p), 0);
	cr_assert_eq(bd_pool_slot_assign(c, 77, 5, &slot), 0);
	cr_assert_eq(bd_pool_page_alloc(c, 78, 6, 1, p), 0);
	cr_assert_eq(pt_attach(D.e.sock, D.e.endpoint, 0, NULL, 0, &a), 0);

	out = run_ctl("stats --json", &st);
	cr_assert_eq(st, 0, "%s", out);
	j = json_loads(out, 0, &jerr);
	cr_assert_not_null(j, "not JSON: %s", jerr.text);
	cr_expect_eq(json_integer_value(json_object_get(json_object_get(j, "pages"), "total")), 40);
	cr_expect_eq(json_integer_value(json_object_get(json_object_get(j, "pages"), "used")), 4);
	cr_expect_eq(json_integer_value(json_object_get(json_object_get(j, "slots"), "free")), 1);
	/* bytes by format: 4 pages of 9472 in use, 1 slot of 36864 */
	cr_expect_eq(json_integer_value(json_object_get(
			     json_object_get(json_object_get(j, "bytes"), "nvfp4"), "used")),
		     4 * 9472);
	cr_expect_eq(json_integer_value(json_object_get(
			     json_object_get(json_object_get(j, "bytes"), "bf16_slots"), "used")),
		     36864);
	largest = json_object_get(j, "largest");
	cr_assert_geq(json_array_size(largest), 2);
	cr_expect_eq(json_integer_value(json_object_get(json_array_get(largest, 0), "request_id")),
		     77);
	cr_expect_eq(json_integer_value(json_object_get(
			     json_array_get(json_object_get(j, "devices"), 0), "attached")),
		     1);
	json_decref(j);

	out = run_ctl("stats", &st);
	cr_expect_eq(st, 0);
	cr_expect_neq(strstr(out, "40 total, 36 free, 4 used"), NULL, "%s", out);

	out = run_ctl("requests", &st);
	cr_expect_eq(st, 0);
	cr_expect_neq(strstr(out, "77"), NULL, "%s", out);
	cr_expect_neq(strstr(out, "78"), NULL, "%s", out);

	out = run_ctl("reclaim 5", &st);
	cr_expect_eq(st, 0);
	cr_expect_neq(strstr(out, "released 1 requests, 3 pages freed"), NULL, "%s", out);
	out = run_ctl("release 999", &st);
	cr_expect_neq(st, 0, "releasing an unknown request must fail");
	out = run_ctl("frobnicate", &st);
	cr_expect_eq(WEXITSTATUS(st), 2);

	bd_pool_detach(a);
	bd_pool_conn_free(c);
	cr_expect_eq(stop(), 0);
}

/* The frame limits as --help states them: up to max_frame_bytes served, above it up to 16 MiB
 * an OVERSIZE reply, above 16 MiB no reply and the connection closed (the client refuses to
 * send such a frame); the daemon serves on and keeps what it held. */
Test(pool_daemon, frames_over_the_limits_get_oversize_or_a_closed_connection)
{
	struct bd_pool_conn *c;
	struct bd_pool_stats *s;
	size_t hard = BD_POOL_FRAME_HARD_MAX;
	uint8_t *big = calloc(1, hard + 1);
	void *ctx, *req, *mon;
	void *rep;
	size_t rlen;
	int32_t p[3];
	int zero = 0;
	bool closed = false;
	int64_t end;
	char help[8192];
	FILE *f;
	size_t n;

	/* --help says what happens */
	snprintf(help, sizeof(help), "%s --help 2>&1", D.e.kvpoold);
	f = popen(help, "r");
	cr_assert_not_null(f);
	n = fread(help, 1, sizeof(help) - 1, f);
	help[n] = 0;
	pclose(f);
	cr_expect_not_null(strstr(help, "over 16M (16777216 bytes) gets none: its connection is "
				  "closed"), "%s", help);

	cr_assert_not_null(big);
	start(false, NULL);
	c = conn();
	cr_assert_eq(bd_pool_page_alloc(c, 3, 1, 3, p), 0);
	/* the default limit, 65536: one byte over it gets OVERSIZE, as does 16 MiB */
	cr_expect_eq(raw_code(c, big, 65537), BD_POOL_ERR_OVERSIZE);
	cr_expect_eq(raw_code(c, big, hard), BD_POOL_ERR_OVERSIZE);
	/* one byte more: the client does not send it */
	cr_expect_eq(bd_pool_call_raw(c, big, hard + 1, &rep, &rlen), -EMSGSIZE);
	/* sent anyway, by a socket of our own: the daemon closes the connection */
	ctx = zmq_ctx_new();
	req = zmq_socket(ctx, ZMQ_REQ);
	mon = zmq_socket(ctx, ZMQ_PAIR);
	cr_assert_not_null(req);
	cr_assert_not_null(mon);
	zmq_setsockopt(req, ZMQ_LINGER, &zero, sizeof(zero));
	zmq_setsockopt(mon, ZMQ_LINGER, &zero, sizeof(zero));
	cr_assert_eq(zmq_socket_monitor(req, "inproc://oversize-mon", ZMQ_EVENT_DISCONNECTED), 0);
	cr_assert_eq(zmq_connect(mon, "inproc://oversize-mon"), 0);
	cr_assert_eq(zmq_connect(req, D.e.endpoint), 0);
	cr_assert_eq(zmq_send(req, big, hard + 1, 0), (int)(hard + 1));
	end = bd_now_ms() + TIMEOUT_MS;
	while (!closed && bd_now_ms() < end) {
		zmq_pollitem_t it = { .socket = mon, .events = ZMQ_POLLIN };
		zmq_msg_t ev;
		uint16_t id = 0;
		int more = 0;
		size_t ml = sizeof(more);

		if (zmq_poll(&it, 1, 100) <= 0)
			continue;
		zmq_msg_init(&ev);
		if (zmq_msg_recv(&ev, mon, 0) >= 2)
			memcpy(&id, zmq_msg_data(&ev), 2);
		zmq_getsockopt(mon, ZMQ_RCVMORE, &more, &ml);
		zmq_msg_close(&ev);
		if (more) {
			zmq_msg_init(&ev);
			zmq_msg_recv(&ev, mon, 0);
			zmq_msg_close(&ev);
		}
		closed = id == ZMQ_EVENT_DISCONNECTED;
	}
	cr_expect(closed, "the daemon did not close the connection of a frame over 16 MiB");
	zmq_socket_monitor(req, NULL, 0);
	zmq_close(mon);
	zmq_close(req);
	zmq_ctx_term(ctx);
	free(big);
	/* serving on, the pages of request 3 still held */
	s = stats(c);
	cr_expect_eq(s->pages_used, 3);
	cr_expect_eq(s->requests, 1);
	bd_pool_stats_free(s);
	cr_expect_eq(bd_pool_page_free(c, 3, p, 3, NULL), 0);
	bd_pool_conn_free(c);
	cr_expect_eq(stop(), 0);
}

/* ---- who may attach and allocate, what a freed page holds --------------------------------- */

/* Another process attaches rank 0 while this one holds it: refused with the reason, and the
 * first attachment keeps its mapping, its connection and the daemon's service. Returns the
 * child's code: 0 refused as expected, 1 attached, 2 another error. */
static int rogue_attach(int rank)
{
	pid_t child = fork();

	cr_assert_geq(child, 0);
	if (child == 0) {
		struct bd_pool_attach *a = NULL;
		char err[256] = "";
		int e = pt_attach(D.e.sock, D.e.endpoint, rank, err, sizeof(err), &a);

		if (e == 0)
			_exit(1);
		_exit(e == -EISCONN && strstr(err, "attached") && strstr(err, "one live") ? 0 : 2);
	}
	return sp_reap(child, TIMEOUT_MS);
}

Test(pool_daemon, rogue_attach_of_a_live_rank_is_refused)
{
	struct bd_pool_attach *a;
	struct bd_pool_conn *c;
	struct bd_pool_stats *s;
	struct pollfd p;
	int32_t pages[2];
	uint8_t *page;

	start(false, NULL);
	cr_assert_eq(pt_attach(D.e.sock, D.e.endpoint, 0, NULL, 0, &a), 0);
	c = conn();
	cr_assert_eq(bd_pool_page_alloc(c, 3, 7, 2, pages), 0);
	page = bd_layout_page(&bd_pool_attach_geometry(a)->layout, bd_pool_attach_pages(a), 0,
			      pages[0]);
	memset(page, 0x5a, 64);
	cr_expect_eq(rogue_attach(0), 0, "a second attach of live rank 0 (log in %s)", D.e.log);
	cr_expect(log_has("one live attachment per rank"), "the refusal is not in the log");
	/* the live rank still attached, its connection open, its memory and the pool serving */
	s = stats(c);
	cr_assert_eq(s->n_attachments, 1);
	cr_expect_eq(s->attachments[0].pid, getpid());
	cr_expect_eq(s->devices[0].attached, 1);
	bd_pool_stats_free(s);
	p = (struct pollfd){ .fd = bd_pool_attach_fd(a), .events = POLLIN };
	cr_expect_eq(poll(&p, 1, 100), 0, "kvpoold closed the live rank's connection");
	cr_expect_eq(page[63], 0x5a);
	cr_expect_eq(bd_pool_page_alloc(c, 3, 7, 1, pages), 0);
	/* once it detaches, the rank may be attached again */
	bd_pool_detach(a);
	cr_expect_eq(rogue_attach(0), 1, "rank 0 is free again after the detach");
	bd_pool_conn_free(c);
	cr_expect_eq(stop(), 0);
}

/* Every byte of page p (all layers) and of slot s of the mapping is zero (0) or not (1). */
static bool page_is_zero(const struct bd_pool_attach *a, int32_t page)
{
	const struct bd_layout *l = &bd_pool_attach_geometry(a)->layout;

	for (int k = 0; k < l->n_layers; k++)
		if (!all_zero(bd_layout_page(l, bd_pool_attach_pages(a), k, page), l->page_bytes))
			return false;
	return true;
}

static void fill_page(const struct bd_pool_attach *a, int32_t page, int byte)
{
	const struct bd_layout *l = &bd_pool_attach_geometry(a)->layout;

	for (int k = 0; k < l->n_layers; k++)
		memset(bd_layout_page(l, bd_pool_attach_pages(a), k, page), byte, l->page_bytes);
}

/* A request's pages and slot read back zero once freed, whichever call frees them; a page
 * still held by a sharer keeps its bytes until the last reference goes. With --scrub false
 * the bytes stay (what this test would see without the scrub). */
static void freed_memory_reads(bool scrubbed)
{
	static const char *const geo[] = { "--tp", "2", "--layers", "3", "--kv-heads", "2",
					   "--head-dim", "64", "--pages", "12", "--slots", "2",
					   "--max-seq-len", "1024", NULL, NULL, NULL };
	const char *argv[20];
	struct bd_pool_attach *a[2];
	struct bd_pool_conn *c;
	int32_t pages[3], slot, neighbour[1];
	size_t n = 0;
	const struct bd_layout *l;
	uint64_t freed;

	for (; geo[n]; n++)
		argv[n] = geo[n];
	argv[n++] = "--scrub";
	argv[n++] = scrubbed ? "true" : "false";
	argv[n] = NULL;
	start(true, argv);
	for (int r = 0; r < 2; r++)
		cr_assert_eq(pt_attach(D.e.sock, D.e.endpoint, r, NULL, 0, &a[r]), 0);
	l = &bd_pool_attach_geometry(a[0])->layout;
	c = conn();
	cr_assert_eq(bd_pool_page_alloc(c, 10, 7, 3, pages), 0);
	cr_assert_eq(bd_pool_slot_assign(c, 10, 7, &slot), 0);
	cr_assert_eq(bd_pool_page_alloc(c, 11, 7, 1, neighbour), 0);
	cr_assert_eq(bd_pool_page_ref(c, 12, 7, &pages[2], 1), 0); /* a sharer of page 2 */
	for (int r = 0; r < 2; r++) {
		for (int i = 0; i < 3; i++)
			fill_page(a[r], pages[i], 0xa5);
		fill_page(a[r], neighbour[0], 0x3c);
		memset(bd_pool_attach_slot(a[r], slot), 0xc3, l->slot_bytes);
	}
	/* page 0 by PageFree, the rest by RequestRelease */
	cr_assert_eq(bd_pool_page_free(c, 10, pages, 1, &freed), 0);
	cr_expect_eq(freed, 1);
	cr_assert_eq(bd_pool_request_release(c, 10, &freed), 0);
	cr_expect_eq(freed, 1, "page 2 is still shared");
	for (int r = 0; r < 2; r++) {
		cr_expect_eq(page_is_zero(a[r], pages[0]), scrubbed, "rank %d page %d", r, pages[0]);
		cr_expect_eq(page_is_zero(a[r], pages[1]), scrubbed, "rank %d page %d", r, pages[1]);
		cr_expect_eq(all_zero(bd_pool_attach_slot(a[r], slot), l->slot_bytes), scrubbed,
			     "rank %d slot %d", r, slot);
		cr_expect(!page_is_zero(a[r], pages[2]), "a shared page was cleared under its sharer");
		cr_expect(!page_is_zero(a[r], neighbour[0]), "a page of another request was cleared");
	}
	cr_assert_eq(bd_pool_request_release(c, 12, &freed), 0);
	cr_expect_eq(freed, 1);
	for (int r = 0; r < 2; r++)
		cr_expect_eq(page_is_zero(a[r], pages[2]), scrubbed, "rank %d: the last sharer left",
			     r);
	bd_pool_conn_free(c);
	for (int r = 0; r < 2; r++)
		bd_pool_detach(a[r]);
	cr_expect_eq(stop(), 0);
}

Test(pool_daemon, freed_pages_and_slots_read_back_zero)
{
	freed_memory_reads(true);
}

Test(pool_daemon, without_scrub_freed_pages_keep_their_bytes)
{
	freed_memory_reads(false);
}

/* One owner runs into its quotas: each refusal says quota (not "exhausted"), other owners still
 * allocate, and nothing the first owner held is lost. */
Test(pool_daemon, owner_quotas_refuse_with_quota_and_spare_other_owners)
{
	static const char *const extra[] = { "--owner-max-pages", "5", "--owner-max-slots", "1",
					     "--owner-max-requests", "2", NULL };
	struct bd_pool_conn *c;
	struct bd_pool_holder *h;
	struct bd_pool_stats *s;
	int32_t p[8], slot;
	size_t n;
	int code;

	start(false, extra);
	c = conn();
	cr_assert_eq(bd_pool_page_alloc(c, 1, 7, 4, p), 0);
	cr_expect_eq(bd_pool_page_alloc(c, 2, 7, 2, p + 4), -EDQUOT);
	cr_expect_eq(bd_pool_conn_error(c, &code) != NULL, true);
	cr_expect_eq(code, BD_POOL_ERR_QUOTA);
	cr_expect_neq(strstr(bd_pool_conn_error(c, NULL), "owner_max_pages"), NULL, "%s",
		      bd_pool_conn_error(c, NULL));
	cr_assert_eq(bd_pool_page_alloc(c, 2, 7, 1, p + 4), 0);
	cr_expect_eq(bd_pool_page_reserve(c, 2, 7, p + 5), -EDQUOT);
	cr_expect_eq(bd_pool_page_ref(c, 2, 7, p, 1), -EDQUOT, "a shared reference counts too");
	cr_assert_eq(bd_pool_slot_assign(c, 1, 7, &slot), 0);
	cr_expect_eq(bd_pool_slot_assign(c, 2, 7, &slot), -EDQUOT);
	cr_expect_neq(strstr(bd_pool_conn_error(c, NULL), "owner_max_slots"), NULL);
	cr_expect_eq(bd_pool_slot_assign(c, 3, 7, &slot), -EDQUOT);
	cr_expect_neq(strstr(bd_pool_conn_error(c, NULL), "owner_max_requests"), NULL, "%s",
		      bd_pool_conn_error(c, NULL));
	/* the pool itself has room: another owner gets it, up to its own quota */
	cr_assert_eq(bd_pool_page_alloc(c, 20, 8, 5, p), 0);
	cr_assert_eq(bd_pool_slot_assign(c, 20, 8, &slot), 0);
	/* owner 7's records are as they were */
	cr_assert_eq(bd_pool_requests(c, &h, &n), 0);
	cr_assert_eq(n, 3);
	cr_expect_eq(h[0].request_id, 1);
	cr_expect_eq(h[0].pages, 4);
	cr_expect_geq(h[0].slot, 0);
	cr_expect_eq(h[1].request_id, 2);
	cr_expect_eq(h[1].pages, 1);
	cr_expect_eq(h[1].reserved, 0);
	cr_expect_eq(h[1].slot, -1);
	cr_expect_eq(h[2].owner, 8);
	free(h);
	s = stats(c);
	cr_expect_eq(s->pages_used, 10);
	cr_expect_eq(s->slots_free, 0);
	bd_pool_stats_free(s);
	/* what an owner frees is its to take again */
	cr_assert_eq(bd_pool_request_release(c, 2, NULL), 0);
	cr_expect_eq(bd_pool_page_alloc(c, 4, 7, 1, p), 0);
	bd_pool_conn_free(c);
	cr_expect_eq(stop(), 0);
}

/* ---- a second uid -------------------------------------------------------------------------- */

/* Runs fn as uid/gid 65534 in a child; returns its exit code. */
static int as_nobody(int (*fn)(void))
{
	pid_t child = fork();

	cr_assert_geq(child, 0);
	if (child == 0) {
		if (setgroups(0, NULL) < 0 || setgid(65534) < 0 || setuid(65534) < 0)
			_exit(100);
		_exit(fn());
	}
	return sp_reap(child, TIMEOUT_MS);
}

/* With the pool's default modes (sockets 0660 of root's group): every door says permission
 * denied at once. Codes: 0 all refused fast; others name the door that was not. */
static int nobody_everywhere(void)
{
	struct bd_pool_attach *a;
	struct bd_pool_conn *c;
	char err[256] = "", cmd[PATH_MAX + 256];
	int64_t t0 = bd_now_ms();

	if (pt_attach(D.e.sock, D.e.endpoint, 0, err, sizeof(err), &a) != -EACCES)
		return 1;
	if (bd_pool_conn_new(D.e.endpoint, 30000, &c) != -EACCES)
		return 2;
	snprintf(cmd, sizeof(cmd), "'%s/kvpoolctl' --endpoint '%s' stats 2>&1 | grep -q 'Permission "
		 "denied'", D.e.bin, D.e.endpoint);
	if (system(cmd) != 0)
		return 3;
	if (bd_now_ms() - t0 > 5000)
		return 4; /* not the 30 s of a timeout */
	return 0;
}

Test(pool_daemon, a_second_uid_is_refused_everywhere)
{
	struct stat st;
	int rc;

	if (geteuid() != 0)
		cr_skip_test("needs root to act as another user (uid 65534)");
	start(false, NULL);
	/* the directory lets anyone reach the sockets: their own modes must refuse */
	cr_assert_eq(chmod(D.e.dir, 0711), 0);
	cr_assert_eq(stat(D.e.endpoint + 6, &st), 0);
	cr_expect_eq(st.st_mode & 0777, 0660);
	rc = as_nobody(nobody_everywhere);
	cr_expect_eq(rc, 0, "uid 65534 got past door %d", rc);
	/* the pool serves on, nothing attached */
	{
		struct bd_pool_conn *c = conn();
		struct bd_pool_stats *s = stats(c);

		cr_expect_eq(s->n_attachments, 0);
		cr_expect_eq(s->requests, 0);
		bd_pool_stats_free(s);
		bd_pool_conn_free(c);
	}
	cr_expect_eq(stop(), 0);
}

/* A child of as_nobody_conn: conn_child on a fresh allocation connection (code 1: none). */
static int (*conn_child)(struct bd_pool_conn *c);

static int conn_child_main(void)
{
	struct bd_pool_conn *c;
	int code;

	if (bd_pool_conn_new(D.e.endpoint, 5000, &c) < 0)
		return 1;
	code = conn_child(c);
	bd_pool_conn_free(c);
	return code;
}

static int as_nobody_conn(int (*fn)(struct bd_pool_conn *c))
{
	conn_child = fn;
	return as_nobody(conn_child_main);
}

/* Whether r is kvpoold's refusal -EACCES with error code and a message that holds text. */
static bool refused_as(struct bd_pool_conn *c, int r, int code, const char *text)
{
	int got = 0;

	if (r != -EACCES)
		return false;
	bd_pool_conn_error(c, &got);
	return got == code && strstr(bd_pool_conn_error(c, NULL), text);
}

/* A uid that reaches the allocation socket (its file opened to all) but is not of the pool's
 * group gets POOL_ERR_DENIED from kvpoold itself, read from SO_PEERCRED. */
static int nobody_allocates(struct bd_pool_conn *c)
{
	int32_t p[1];

	return refused_as(c, bd_pool_page_alloc(c, 50, 50, 1, p), BD_POOL_ERR_DENIED, "uid 65534")
		       ? 0
		       : 2;
}

/* A member of the pool's group of another uid may allocate for its own owner, not act on the
 * requests of an owner that another uid holds: the prefix index's calls as the others (a
 * match names its owner as PageRef does, a store acts on a request, the clear is the
 * operator's). */
static int member_meddles(struct bd_pool_conn *c)
{
	static const uint64_t hash[1] = { 0x42 };
	int32_t p[1], got[1];
	size_t k = 9;

	if (!refused_as(c, bd_pool_request_release(c, 60, NULL), BD_POOL_ERR_OWNER,
			"belongs to uid 0"))
		return 2;
	if (!refused_as(c, bd_pool_prefix_match(c, 63, 7, hash, 1, got, &k), BD_POOL_ERR_OWNER,
			"owner 7 belongs to uid 0") || k != 0)
		return 7;
	if (!refused_as(c, bd_pool_prefix_store(c, 60, &(int32_t){ 1 }, hash, 1, NULL, 0, 0, NULL),
			BD_POOL_ERR_OWNER, "belongs to uid 0"))
		return 9;
	if (!refused_as(c, bd_pool_prefix_clear(c, NULL), BD_POOL_ERR_DENIED, "operator"))
		return 10;
	if (bd_pool_page_alloc(c, 61, 7, 1, p) != -EACCES)
		return 4;
	if (bd_pool_owner_reclaim(c, 7, NULL, NULL) != -EACCES)
		return 5;
	if (bd_pool_page_alloc(c, 62, 99, 1, p) != 0)
		return 6;
	return 0;
}

Test(pool_daemon, allocation_calls_are_checked_against_the_caller_uid)
{
	static const char *const extra[] = { "--group", "65534", NULL };
	struct bd_pool_conn *c;
	struct bd_pool_holder *h;
	int32_t p[2];
	size_t n;
	int rc;

	if (geteuid() != 0)
		cr_skip_test("needs root to act as another user (uid 65534)");
	start(false, NULL);
	cr_assert_eq(chmod(D.e.dir, 0711), 0);
	cr_assert_eq(chmod(D.e.endpoint + 6, 0666), 0);
	rc = as_nobody_conn(nobody_allocates);
	cr_expect_eq(rc, 0, "outside the group (child code %d, log in %s)", rc, D.e.log);
	cr_expect_eq(stop(), 0);

	start(false, extra);
	cr_assert_eq(chmod(D.e.dir, 0711), 0);
	c = conn();
	cr_assert_eq(bd_pool_page_alloc(c, 60, 7, 2, p), 0);
	{
		static const uint64_t hash[1] = { 0x42 };
		uint64_t stored = 0;

		cr_assert_eq(bd_pool_prefix_store(c, 60, p, hash, 1, NULL, 0, 0, &stored), 0);
		cr_assert_eq(stored, 1);
	}
	rc = as_nobody_conn(member_meddles);
	cr_expect_eq(rc, 0, "a group member of uid 65534 (child code %d, log in %s)", rc, D.e.log);
	/* owner 7's request is intact; the member's own one is there */
	cr_assert_eq(bd_pool_requests(c, &h, &n), 0);
	cr_assert_eq(n, 2);
	cr_expect_eq(h[0].request_id, 60);
	cr_expect_eq(h[0].pages, 2);
	cr_expect_eq(h[1].owner, 99);
	free(h);
	{
		/* the index as owner 7's request left it: one page, held */
		struct bd_pool_stats *s = stats(c);

		cr_expect_eq(s->pages_cached, 1);
		cr_expect_eq(s->pages_cached_idle, 0);
		cr_expect_eq(s->prefix_hits, 0);
		bd_pool_stats_free(s);
	}
	bd_pool_conn_free(c);
	cr_expect_eq(stop(), 0);
}

/* ---- attach tokens (kvpool.proto GroupRegister) ------------------------------------------- */

/* bd_pool_attach of rank 0 with token (may be NULL): its code, with err holding the text; an
 * attachment made is detached at once. */
static int attach_with(const uint8_t *token, char *err, size_t cap)
{
	struct bd_pool_attach *a = NULL;
	int e;

	err[0] = 0;
	e = bd_pool_attach(D.e.sock, 0, token, err, cap, &a);
	bd_pool_detach(a);
	return e;
}

/* No group, no token, a wrong token, one of an earlier epoch, one already used: each refused
 * with its reason (-EKEYREJECTED), counted, and nothing of the pool changes; the current
 * epoch's token attaches once; the geometry needs no token. */
Test(pool_daemon, attach_tokens_are_checked)
{
	uint8_t t5[BD_POOL_TOKEN_BYTES], t6[BD_POOL_TOKEN_BYTES], bad[BD_POOL_TOKEN_BYTES];
	uint8_t two[2 * BD_POOL_TOKEN_BYTES];
	struct bd_pool_geometry q;
	struct bd_pool_stats *s0, *s;
	struct bd_pool_conn *c;
	int32_t pages[2], slot;
	char err[256];

	start(false, NULL);
	c = conn();
	cr_assert_eq(bd_pool_page_alloc(c, 8, 3, 2, pages), 0);
	cr_assert_eq(bd_pool_slot_assign(c, 8, 3, &slot), 0);
	s0 = stats(c);
	cr_expect_eq(s0->group_epoch, 0);
	memset(t5, 0x55, sizeof(t5));
	memset(t6, 0x66, sizeof(t6));

	cr_expect_eq(attach_with(t5, err, sizeof(err)), -EKEYREJECTED, "no group: %s", err);
	cr_expect_neq(strstr(err, "no worker group is registered"), NULL, "%s", err);
	cr_assert_eq(pt_group_register(D.e.endpoint, 5, t5, 1), 0);
	cr_expect_eq(attach_with(NULL, err, sizeof(err)), -EKEYREJECTED, "no token: %s", err);
	cr_expect_neq(strstr(err, "no attach token"), NULL, "%s", err);
	memcpy(bad, t5, sizeof(bad));
	bad[31] ^= 1;
	cr_expect_eq(attach_with(bad, err, sizeof(err)), -EKEYREJECTED, "wrong token: %s", err);
	cr_expect_neq(strstr(err, "not rank 0's of epoch 5"), NULL, "%s", err);
	cr_assert_eq(pt_group_register(D.e.endpoint, 6, t6, 1), 0);
	cr_expect_eq(attach_with(t5, err, sizeof(err)), -EKEYREJECTED, "stale token: %s", err);
	cr_expect_neq(strstr(err, "of epoch 6"), NULL, "%s", err);
	/* a group of another size is refused and leaves epoch 6 in place */
	memset(two, 0x77, sizeof(two));
	cr_expect_eq(pt_group_register(D.e.endpoint, 7, two, 2), -EINVAL);

	s = stats(c);
	cr_expect_eq(s->attach_refused, 4);
	cr_expect_eq(s->group_epoch, 6);
	cr_expect_eq(s->group_owner, 1);
	cr_expect_eq(s->n_attachments, 0);
	cr_expect_eq(s->devices[0].attached, 0);
	cr_expect_eq(s->pages_free, s0->pages_free, "the refusals changed the pool");
	cr_expect_eq(s->slots_free, s0->slots_free);
	cr_expect_eq(s->requests, s0->requests);
	bd_pool_stats_free(s);
	cr_expect(log_has("refused: the token is not rank 0's"), "the refusal is not logged");

	/* the geometry alone: no token, no attachment */
	cr_assert_eq(bd_pool_query(D.e.sock, 0, err, sizeof(err), &q), 0, "%s", err);
	cr_expect_eq(q.n_pages, 40);
	cr_expect_eq(q.n_slots, 2);
	cr_expect_eq(q.n_chunks, 1);
	/* the current token opens one attachment; a repeat of the registration leaves it used */
	cr_expect_eq(attach_with(t6, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(pt_group_register(D.e.endpoint, 6, t6, 1), 0);
	cr_expect_eq(attach_with(t6, err, sizeof(err)), -EKEYREJECTED, "a used token: %s", err);
	cr_expect_neq(strstr(err, "used already"), NULL, "%s", err);
	s = stats(c);
	cr_expect_eq(s->attach_refused, 5);
	cr_expect_eq(s->n_attachments, 0);
	cr_expect_eq(s->pages_free, s0->pages_free);
	bd_pool_stats_free(s);
	bd_pool_stats_free(s0);
	bd_pool_conn_free(c);
	cr_expect_eq(stop(), 0);
}

/* Only root and kvpoold's uid register groups: a member of the pool's group, who may allocate
 * and attach, may not hand out attach tokens. */
Test(pool_daemon, group_members_may_not_register_groups)
{
	pid_t child;

	start_open_to_all("65534");
	cr_assert_eq(chmod(D.e.endpoint + strlen("ipc://"), 0666), 0);
	child = fork();
	cr_assert_geq(child, 0);
	if (child == 0) {
		uint8_t t[BD_POOL_TOKEN_BYTES] = { 1 };
		struct bd_pool_conn *c;
		int e;

		if (setgroups(0, NULL) < 0 || setgid(65534) < 0 || setuid(65534) < 0)
			_exit(10);
		if (bd_pool_conn_new(D.e.endpoint, 5000, &c) < 0)
			_exit(11);
		e = bd_pool_group_register(c, 1, 9, t, 1);
		_exit(e == -EACCES && strstr(bd_pool_conn_error(c, NULL), "may not register") ? 0
											      : 12);
	}
	cr_expect_eq(sp_reap(child, TIMEOUT_MS), 0, "uid 65534 registered a group");
	{
		struct bd_pool_conn *c = conn();
		struct bd_pool_stats *s = stats(c);

		cr_expect_eq(s->group_epoch, 0, "the refused registration took effect");
		bd_pool_stats_free(s);
		bd_pool_conn_free(c);
	}
	cr_expect_eq(stop(), 0);
}
