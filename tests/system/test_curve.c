/* test_curve.c — CURVE on the daemons' TCP endpoints with real daemons on the CPU backend:
 * kvpoold, routerd with a CURVE frontend and a CURVE worker endpoint on loopback TCP, two
 * workerd with their own keys. A client whose key the router's allow-list holds is served (the
 * C client and the Python client); one with another key, and a plain one, fail at once with the
 * handshake's error; the router logs the refused peer. kvpoold's allocation endpoint speaks
 * CURVE to the router and to a kvpoolctl with a listed key. Plain TCP on a non-loopback address
 * is refused at start (routerd, workerd and kvpoold exit 1 with the reason) unless
 * insecure_tcp.
 */
#include <criterion/criterion.h>
#include <limits.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/bd_zsec.h"
#include "serve/bd_client.h"
#include "serve_common.h"

#define WAIT_MS 60000
/* a refused handshake must be reported well before any timeout a caller would pick */
#define FAST_MS 3000

SV_TEST_SUITE(curve, 240);

/* DIR/name.key and DIR/name.pub; the public key into pub (may be NULL). */
static void keygen(const char *name, char *pub)
{
	char prefix[256], err[512];
	struct bd_zsec_keypair kp;

	snprintf(prefix, sizeof(prefix), "%s/%s", E.dir, name);
	cr_assert_eq(bd_zsec_keygen(prefix, &kp, err, sizeof(err)), 0, "%s", err);
	if (pub)
		strcpy(pub, kp.pub);
}

static void write_text(const char *name, const char *text)
{
	char path[256];
	FILE *f;

	snprintf(path, sizeof(path), "%s/%s", E.dir, name);
	f = fopen(path, "w");
	cr_assert_not_null(f);
	fputs(text, f);
	fclose(f);
}

static const char *path_of(const char *name)
{
	static char buf[4][256];
	static int k;

	k = (k + 1) % 4;
	snprintf(buf[k], sizeof(buf[k]), "%s/%s", E.dir, name);
	return buf[k];
}

/* A daemon started with args, waited for until READY (its notify socket then closed, as the
 * shared helpers do). */
static void start_ready(struct sv_daemon *d, const char *name, const char *const *args)
{
	sv_spawn(&E, d, name, args);
	cr_assert(sv_wait_notify(d, "READY=1", WAIT_MS), "%s did not get ready; log:\n%s", name,
		  sv_log_tail(d));
	close(d->notify_fd);
	d->notify_fd = -1;
	unlink(d->notify);
}

/* A daemon that must refuse to start: exit status 1 within 30 s, its log saying why. */
static void expect_refused(struct sv_daemon *d, const char *name, const char *const *args,
			   const char *why)
{
	int64_t end;
	int st = -1;

	sv_spawn(&E, d, name, args);
	for (end = sv_now_ms() + 30000; sv_now_ms() < end; usleep(10000))
		if (waitpid(d->pid, &st, WNOHANG) == d->pid) {
			d->pid = 0;
			break;
		}
	if (d->pid > 0)
		sv_stop(d, SIGKILL, 1000);
	close(d->notify_fd);
	d->notify_fd = -1;
	unlink(d->notify);
	cr_expect(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 1,
		  "%s: status %#x, want exit 1; log:\n%s", name, st, sv_log_tail(d));
	cr_expect(strstr(sv_log_tail(d), why), "%s's log does not say '%s':\n%s", name, why,
		  sv_log_tail(d));
}

static struct bd_client *curve_client(const char *ep, const char *secret)
{
	struct bd_client_opts o = { path_of("router.pub"), secret ? path_of(secret) : NULL };
	struct bd_client *c;
	char err[512] = "";

	cr_assert_eq(bd_client_new_opts(ep, &o, &c, err, sizeof(err)), 0, "%s", err);
	return c;
}

/* The Python client (clients/python/bdfp4_client.py) asking for health with a secret key file
 * (NULL: plain): its exit status, its output in out[cap]. */
static int python_health(const char *ep, const char *secret, char *out, size_t cap)
{
	const char *py = getenv("BD_PYTHON");
	char cmd[4 * PATH_MAX];
	size_t n;
	FILE *p;

	if (!py || !*py)
		py = access("/usr/bin/python3", X_OK) == 0 ? "/usr/bin/python3" : "python3";
	snprintf(cmd, sizeof(cmd),
		 "%s %s/clients/python/bdfp4_client.py --router %s --out-dir %s --proto-dir %s/proto "
		 "--timeout-ms 20000 --health --server-key %s%s%s 2>&1",
		 py, E.root, ep, E.dir, E.root, path_of("router.pub"), secret ? " --secret-key " : "",
		 secret ? path_of(secret) : "");
	if (!secret) /* no secret key: a plain client (no server key either) */
		snprintf(cmd, sizeof(cmd),
			 "%s %s/clients/python/bdfp4_client.py --router %s --out-dir %s --proto-dir "
			 "%s/proto --timeout-ms 20000 --health 2>&1",
			 py, E.root, ep, E.dir, E.root);
	p = popen(cmd, "r");
	cr_assert_not_null(p);
	n = fread(out, 1, cap - 1, p);
	out[n] = 0;
	return WEXITSTATUS(pclose(p));
}

Test(curve, allowed_key_is_served_others_fail_fast)
{
	char front[64], workers[64], pub_a[64], pub_w0[64], pub_w1[64], list[512];
	const char *wargv[2][32];
	char rank[2][12];
	struct bd_client *c, *rogue, *plain;
	struct bd_client_health h;
	int64_t t0;
	int e;

	unsetenv("BDFP4_SERVER_KEY");
	unsetenv("BDFP4_SECRET_KEY");
	snprintf(front, sizeof(front), "tcp://127.0.0.1:%d", sv_free_port());
	snprintf(workers, sizeof(workers), "tcp://127.0.0.1:%d", sv_free_port());
	keygen("router", NULL);
	keygen("alice", pub_a);
	keygen("mallory", NULL);
	keygen("w0", pub_w0);
	keygen("w1", pub_w1);
	snprintf(list, sizeof(list), "# the clients this router serves\n%s alice\n\n", pub_a);
	write_text("clients.allow", list);
	snprintf(list, sizeof(list), "%s rank0\n%s rank1\n", pub_w0, pub_w1);
	write_text("workers.allow", list);

	sv_start_pool(&E, NULL);
	sv_start_router(&E, (const char *const[]){ "--frontend", front, "--workers", workers,
						   "--curve-secret-key", path_of("router.key"),
						   "--curve-clients", path_of("clients.allow"),
						   "--curve-workers", path_of("workers.allow"),
						   NULL });
	for (int r = 0; r < 2; r++) {
		const char *a[] = { "--no-config", "--rank", rank[r], "--tp", "2", "--model",
				    E.model, "--pool-socket", E.pool_sock, "--router", workers,
				    "--allreduce-dir", E.dir, "--threads", "1",
				    "--router-server-key", path_of("router.pub"),
				    "--curve-secret-key", path_of(r ? "w1.key" : "w0.key"), NULL };
		char name[24];

		snprintf(rank[r], sizeof(rank[r]), "%d", r);
		memcpy(wargv[r], a, sizeof(a));
		snprintf(name, sizeof(name), "workerd-%d", r);
		start_ready(&E.worker[r], name, wargv[r]);
	}

	/* the allowed client: the group forms over CURVE and a generation runs to its end */
	c = curve_client(front, "alice.key");
	t0 = sv_now_ms();
	do {
		e = bd_client_health(c, 1000, &h);
		if (e == 0 && h.healthy)
			break;
		usleep(50000);
	} while (sv_now_ms() - t0 < WAIT_MS);
	cr_assert(e == 0 && h.healthy, "health %d (%s); router log:\n%s", e, bd_client_error(c),
		  sv_log_tail(&E.router));
	{
		struct bd_client_gen g = { .prompt = "What is the capital of France?", .chat = true,
					   .max_tokens = 4, .ignore_eos = true };
		struct bd_client_event ev;
		uint64_t tag;

		cr_assert_eq(bd_client_generate_start(c, &g, &tag), 0);
		do {
			cr_assert_eq(bd_client_next(c, WAIT_MS, &ev), 0);
		} while (ev.tag != tag || (ev.kind == BD_CLIENT_CHUNK && ev.finish == BD_FINISH_NONE));
		cr_expect_eq(ev.kind, BD_CLIENT_CHUNK, "event %d: %s", ev.kind, ev.message);
		cr_expect_eq(ev.finish, BD_FINISH_LENGTH, "finish %d: %s", ev.finish, ev.message);
		cr_expect_eq(ev.n_tokens, 4);
	}

	/* another key: refused by the ZAP handler, at once and with the reason */
	rogue = curve_client(front, "mallory.key");
	t0 = sv_now_ms();
	e = bd_client_health(rogue, 20000, &h);
	cr_expect_eq(e, -EACCES, "a client without an allowed key got %d", e);
	cr_expect_lt(sv_now_ms() - t0, FAST_MS, "the refusal took %lld ms",
		     (long long)(sv_now_ms() - t0));
	cr_expect(strstr(bd_client_error(rogue), "allow-list"), "message: %s",
		  bd_client_error(rogue));
	bd_client_free(rogue);

	/* a plain client at a CURVE endpoint: the mechanisms disagree */
	cr_assert_eq(bd_client_new_opts(front, &(struct bd_client_opts){ NULL, NULL }, &plain,
					NULL, 0), 0);
	t0 = sv_now_ms();
	e = bd_client_health(plain, 20000, &h);
	cr_expect_eq(e, -EPROTO, "a plain client got %d", e);
	cr_expect_lt(sv_now_ms() - t0, FAST_MS, "the refusal took %lld ms",
		     (long long)(sv_now_ms() - t0));
	bd_client_free(plain);

	/* the Python client: the same keys, the same answers */
	{
		char out[4096];
		int64_t t1;

		cr_expect_eq(python_health(front, "alice.key", out, sizeof(out)), 0, "%s", out);
		cr_expect(strncmp(out, "serving\n", 8) == 0, "%s", out);
		t1 = sv_now_ms();
		cr_expect_eq(python_health(front, "mallory.key", out, sizeof(out)), 1, "%s", out);
		cr_expect(strstr(out, "allow-list"), "%s", out);
		/* the interpreter and protoc take their time; the refusal itself does not wait */
		cr_expect_lt(sv_now_ms() - t1, 15000, "%lld ms", (long long)(sv_now_ms() - t1));
		cr_expect_eq(python_health(front, NULL, out, sizeof(out)), 1, "%s", out);
		cr_expect(strstr(out, "disagree on CURVE"), "%s", out);
	}

	/* the refused peer is in the router's log, the allowed one still served */
	cr_expect(strstr(sv_log_tail(&E.router), "refused clients peer"), "router log:\n%s",
		  sv_log_tail(&E.router));
	cr_expect_eq(bd_client_health(c, 5000, &h), 0);
	cr_expect(h.healthy);
	bd_client_free(c);

	cr_expect_eq(sv_stop(&E.router, SIGTERM, WAIT_MS), 0, "routerd:\n%s",
		     sv_log_tail(&E.router));
}

Test(curve, plain_tcp_off_loopback_is_refused_unless_insecure_tcp)
{
	char any[64], ep[64];
	struct bd_client *c;
	struct bd_client_health h;
	int port = sv_free_port();

	snprintf(any, sizeof(any), "tcp://0.0.0.0:%d", port);
	/* no pool is needed: the rule is checked with the configuration, before anything */
	expect_refused(&E.router, "routerd",
		       (const char *const[]){ "--no-config", "--frontend", any, "--workers",
					      E.workers_ep, "--pool", E.pool_ep, "--model", E.model,
					      "--http", "", NULL },
		       "plain TCP off loopback is refused");
	expect_refused(&E.router, "routerd-workers",
		       (const char *const[]){ "--no-config", "--frontend", E.front_ep,
					      "--workers", any, "--pool", E.pool_ep, "--model",
					      E.model, "--http", "", NULL },
		       "plain TCP off loopback is refused");
	expect_refused(&E.worker[0], "workerd",
		       (const char *const[]){ "--no-config", "--rank", "0", "--model", E.model,
					      "--pool-socket", E.pool_sock, "--router",
					      "tcp://192.0.2.1:5555", "--allreduce-dir", E.dir,
					      NULL },
		       "plain TCP off loopback is refused");
	expect_refused(&E.pool, "kvpoold",
		       (const char *const[]){ "--no-config", "--socket", E.pool_sock, "--endpoint",
					      any, "--tp", "2", "--layers", "30", "--kv-heads",
					      "3", "--head-dim", "64", "--max-seq-len", "1024", "--pages", "16", "--slots",
					      "4", NULL },
		       "plain TCP off loopback is refused");
	/* a key file with no allow-list is a configuration error too */
	keygen("router", NULL);
	expect_refused(&E.router, "routerd-half-curve",
		       (const char *const[]){ "--no-config", "--frontend", E.front_ep,
					      "--workers", E.workers_ep, "--pool", E.pool_ep,
					      "--model", E.model, "--http", "",
					      "--curve-secret-key", path_of("router.key"), NULL },
		       "CURVE needs curve_secret_key and an allow-list");

	/* insecure_tcp: it starts and answers a plain client on that port */
	sv_start_pool(&E, NULL);
	sv_start_router(&E, (const char *const[]){ "--frontend", any, "--insecure-tcp", NULL });
	snprintf(ep, sizeof(ep), "tcp://127.0.0.1:%d", port);
	cr_assert_eq(bd_client_new_opts(ep, &(struct bd_client_opts){ NULL, NULL }, &c, NULL, 0),
		     0);
	cr_expect_eq(bd_client_health(c, 10000, &h), 0, "router log:\n%s",
		     sv_log_tail(&E.router));
	bd_client_free(c);
	cr_expect_eq(sv_stop(&E.router, SIGTERM, WAIT_MS), 0, "routerd:\n%s",
		     sv_log_tail(&E.router));
}

/* kvpoold's allocation endpoint on loopback TCP with CURVE: the router (its curve_secret_key,
 * pool_server_key) and a kvpoolctl with a listed key are answered, a kvpoolctl with another key
 * is not, and kvpoold logs the refused peer. */
Test(curve, pool_endpoint_speaks_curve)
{
	char pool[64], pub_r[64], pub_c[64], list[256], cmd[4 * PATH_MAX], out[4096];
	FILE *p;
	size_t n;
	int rc;

	snprintf(pool, sizeof(pool), "tcp://127.0.0.1:%d", sv_free_port());
	keygen("pool", NULL);
	keygen("router", pub_r);
	keygen("ctl", pub_c);
	keygen("mallory", NULL);
	snprintf(list, sizeof(list), "%s router\n%s kvpoolctl\n", pub_r, pub_c);
	write_text("pool.allow", list);
	sv_start_pool(&E, (const char *const[]){ "--endpoint", pool, "--curve-secret-key",
						 path_of("pool.key"), "--curve-clients",
						 path_of("pool.allow"), NULL });
	/* READY only once its pool calls are answered */
	sv_start_router(&E, (const char *const[]){ "--pool", pool, "--pool-server-key",
						   path_of("pool.pub"), "--curve-secret-key",
						   path_of("router.key"), NULL });
	for (int k = 0; k < 2; k++) {
		snprintf(cmd, sizeof(cmd),
			 "%s/kvpoolctl --endpoint %s --timeout 2000 --server-key %s --secret-key %s "
			 "stats 2>&1", E.bin, pool, path_of("pool.pub"),
			 path_of(k ? "mallory.key" : "ctl.key"));
		p = popen(cmd, "r");
		cr_assert_not_null(p);
		n = fread(out, 1, sizeof(out) - 1, p);
		out[n] = 0;
		rc = WEXITSTATUS(pclose(p));
		if (k == 0)
			cr_expect(rc == 0 && strstr(out, "pages"), "kvpoolctl with a listed key: "
				  "%d\n%s", rc, out);
		else
			cr_expect_neq(rc, 0, "kvpoolctl with another key was answered:\n%s", out);
	}
	cr_expect(strstr(sv_log_tail(&E.pool), "refused pool peer"), "kvpoold log:\n%s",
		  sv_log_tail(&E.pool));
	cr_expect_eq(sv_stop(&E.router, SIGTERM, WAIT_MS), 0, "routerd:\n%s",
		     sv_log_tail(&E.router));
	cr_expect_eq(sv_stop(&E.pool, SIGTERM, WAIT_MS), 0, "kvpoold:\n%s", sv_log_tail(&E.pool));
}
