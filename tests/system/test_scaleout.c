/* test_scaleout.c — scale-out on one machine (deploy/README.md "Scale-out"): two complete
 * stacks (kvpoold, routerd with its HTTP front door, two workerd on the CPU backend each), each
 * in its own directory with its own sockets and port and its own KV event stream, behind one
 * nginx (Debian's, a non-root process with its own prefix under /tmp, running deploy's
 * scale-out/nginx-bdfp4.conf: a `least_conn` upstream, here over the two front doors). Suite
 * "scaleout".
 *
 * 16 concurrent chat completions through nginx all succeed, and each router's /metrics counts
 * some of them: least_conn spread the load. A long prompt (~5 pages of GPL-3 through the chat
 * template) goes through nginx to one stack; `bdfp4 kv-where` over both event streams finds
 * its pages on the stack whose metrics say it served it and on no page of the other, having
 * hashed the prompt with the router's chain (pool/bd_prefix.h) from the prompt text alone (its
 * token count is the router's). The same prompt sent again to that stack reads its leading
 * pages from cache (prefix_cache_hits_total) and answers the same greedy text; the other stack
 * counts no hit.
 *
 * Without nginx (Debian nginx; `make deps` installs it) that test is skipped with that message.
 * A second test gives kv-where bad usage, a stream nobody serves and one that answers a batch
 * in no encoding of vLLM's events: each refused with why.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <pthread.h>
#include <pwd.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <jansson.h>
#include <zmq.h>

#include "serve_common.h"
#include "tmpdir.h"

#define WAIT_MS 240000
#define N_LOAD 16
#define LONG_BYTES 3000 /* of GPL-3: about 5 full pages of 128 tokens */

static struct sv_env S[2];
static char ngdir[64], lb[64];
static pid_t nginx_pid;

static void init(void)
{
	sv_init(&S[0]);
	sv_init(&S[1]);
}

static void fini(void)
{
	if (nginx_pid > 0) {
		kill(nginx_pid, SIGTERM);
		waitpid(nginx_pid, NULL, 0);
		nginx_pid = 0;
	}
	if (ngdir[0] && !getenv("BD_KEEP_LOGS"))
		td_remove(ngdir);
	ngdir[0] = 0;
	sv_fini(&S[0]);
	sv_fini(&S[1]);
}

TestSuite(scaleout, .init = init, .fini = fini, .timeout = 900);

static void write_file(const char *path, const char *data, size_t len)
{
	FILE *f = fopen(path, "wb");

	cr_assert(f, "%s: %s", path, strerror(errno));
	cr_assert_eq(fwrite(data, 1, len, f), len);
	fclose(f);
}

/* Stack s: kvpoold publishing its KV events (and a replay endpoint) in its directory,
 * routerd's HTTP on a port of its own, the two workers; its base URL into url. */
static void start_stack(struct sv_env *e, char *url, size_t cap)
{
	static const char *const http[] = { "--http", "127.0.0.1:0", NULL };
	char ev[160], rp[160];

	snprintf(ev, sizeof(ev), "ipc://%.64s/kv-events.sock", e->dir);
	snprintf(rp, sizeof(rp), "ipc://%.64s/kv-replay.sock", e->dir);
	sv_start_pool(e, (const char *const[]){ "--max-seq-len", "2048", "--pages", "48",
						"--kv-events", ev, "--kv-events-replay", rp, NULL });
	sv_start_router(e, http);
	sv_http_url(e, url, cap, WAIT_MS);
	sv_start_workers(e, WAIT_MS, "the group did not form");
}

/* s with its one occurrence of from replaced by to (malloc'ed); asserted to be there once. */
static char *replace_once(char *s, const char *from, const char *to)
{
	char *at = strstr(s, from), *r;

	cr_assert(at && !strstr(at + 1, from), "deploy's nginx file has no single \"%s\"", from);
	cr_assert_geq(asprintf(&r, "%.*s%s%s", (int)(at - s), s, to, at + strlen(from)), 0);
	free(s);
	return r;
}

/* nginx (the program: a path, or a name on PATH) on port lb_port in front of the two front
 * doors: deploy/scale-out/nginx-bdfp4.conf (the conf.d file of a multi-node install) with its
 * two server lines pointed at the stacks and its listen line at lb_port, included by a main
 * configuration of this test's own; the prefix, logs and pid file in ngdir; as nobody when the test runs as root (nginx then stays
 * an unprivileged process: no `user` directive, no privileged port). */
static void start_nginx(const char *nginx, const char *url0, const char *url1, int lb_port)
{
	char conf[4096], path[PATH_MAX + 64], site[160], err[160], cmd[256], line[200];
	struct passwd *nobody = geteuid() == 0 ? getpwnam("nobody") : NULL;
	char *deploy;
	int64_t end;
	int n;

	cr_assert_eq(td_make(ngdir, sizeof(ngdir), "bdfp4-nginx"), 0);
	snprintf(path, sizeof(path), "%s/deploy/scale-out/nginx-bdfp4.conf", S[0].root);
	deploy = td_read_file(path, NULL);
	cr_assert(deploy, "no %s", path);
	snprintf(line, sizeof(line), "server %.160s ", url0 + strlen("http://"));
	deploy = replace_once(deploy, "server 10.0.0.11:8000 ", line);
	snprintf(line, sizeof(line), "server %.160s ", url1 + strlen("http://"));
	deploy = replace_once(deploy, "server 10.0.0.12:8000 ", line);
	snprintf(line, sizeof(line), "listen 127.0.0.1:%d;", lb_port);
	deploy = replace_once(deploy, "listen 80;", line);
	snprintf(site, sizeof(site), "%s/bdfp4.conf", ngdir);
	write_file(site, deploy, strlen(deploy));
	free(deploy);
	n = snprintf(conf, sizeof(conf),
		     "daemon off;\n"
		     "worker_processes 1;\n"
		     "pid %s/nginx.pid;\n"
		     "error_log %s/error.log info;\n"
		     "events { worker_connections 256; }\n"
		     "http {\n"
		     "  access_log %s/access.log;\n"
		     "  client_body_temp_path %s/body;\n"
		     "  proxy_temp_path %s/proxy;\n"
		     "  fastcgi_temp_path %s/fastcgi;\n"
		     "  uwsgi_temp_path %s/uwsgi;\n"
		     "  scgi_temp_path %s/scgi;\n"
		     "  include %s;\n"
		     "}\n",
		     ngdir, ngdir, ngdir, ngdir, ngdir, ngdir, ngdir, ngdir, site);
	cr_assert_lt(n, (int)sizeof(conf));
	snprintf(path, sizeof(path), "%s/nginx.conf", ngdir);
	write_file(path, conf, (size_t)n);
	snprintf(err, sizeof(err), "%s/error.log", ngdir);
	if (nobody) {
		cr_assert_eq(chown(ngdir, nobody->pw_uid, nobody->pw_gid), 0, "%s", strerror(errno));
		cr_assert_eq(chown(path, nobody->pw_uid, nobody->pw_gid), 0);
		cr_assert_eq(chown(site, nobody->pw_uid, nobody->pw_gid), 0);
	}
	fflush(NULL);
	nginx_pid = fork();
	cr_assert_geq(nginx_pid, 0);
	if (nginx_pid == 0) {
		char out[160];
		int fd;

		snprintf(out, sizeof(out), "%s/nginx.out", ngdir);
		fd = open(out, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (fd >= 0) {
			dup2(fd, 1);
			dup2(fd, 2);
		}
		if (nobody && (setgroups(0, NULL) < 0 || setgid(nobody->pw_gid) < 0 ||
			       setuid(nobody->pw_uid) < 0))
			_exit(126);
		execlp(nginx, "nginx", "-p", ngdir, "-c", path, "-e", err, (char *)NULL);
		_exit(127);
	}
	/* up when it answers /health (from one of the routers) */
	snprintf(cmd, sizeof(cmd), "curl -s -o /dev/null -w '%%{http_code}' http://%s/health", lb);
	end = sv_now_ms() + 20000;
	for (;;) {
		char code[16] = "";

		sv_run_output(cmd, code, sizeof(code));
		if (!strcmp(code, "200"))
			break;
		if (sv_now_ms() > end || waitpid(nginx_pid, NULL, WNOHANG) == nginx_pid) {
			char *log = td_read_file(err, NULL);

			cr_assert_fail("nginx did not come up on %s:\n%s", lb, log ? log : "");
		}
		usleep(100000);
	}
}

/* The /metrics text of base URL url (malloc'ed). */
static char *scrape(const char *url)
{
	char cmd[256];
	static char out[1 << 18];

	snprintf(cmd, sizeof(cmd), "curl -s -f %s/metrics", url);
	cr_assert_eq(sv_run_output(cmd, out, sizeof(out)), 0, "no /metrics at %s", url);
	return strdup(out);
}

/* A counter of router url's /metrics (name{model_name="...",labels}), 0 when not listed. */
static double counter(const char *url, const char *name, const char *labels)
{
	const char *slash = strrchr(S[0].model, '/');
	char prefix[PATH_MAX + 256], *m = scrape(url);
	double v;

	snprintf(prefix, sizeof(prefix), "bdfp4:%s{model_name=\"%s\"%s%s}", name,
		 slash ? slash + 1 : S[0].model, labels ? "," : "", labels ? labels : "");
	v = sv_metric(m, prefix);
	free(m);
	return v < 0 ? 0 : v;
}

static double chats_served(const char *url)
{
	return counter(url, "http_requests_total", "endpoint=\"/v1/chat/completions\",status=\"200\"");
}

/* POSTs body (JSON) to target; returns the parsed answer (asserted 200 and JSON). */
static json_t *post(const char *dir, const char *target, const char *body, const char *tag)
{
	char in[160], out[160], cmd[640], code[16] = "";
	json_error_t je;
	json_t *j;

	snprintf(in, sizeof(in), "%s/%s.body", dir, tag);
	snprintf(out, sizeof(out), "%s/%s.json", dir, tag);
	write_file(in, body, strlen(body));
	snprintf(cmd, sizeof(cmd), "curl -s -o %s -w '%%{http_code}' -H 'Content-Type: "
		 "application/json' --data-binary @%s %s", out, in, target);
	sv_run_output(cmd, code, sizeof(code));
	j = json_load_file(out, 0, &je);
	cr_assert_str_eq(code, "200", "%s: HTTP %s: %s", target, code, td_read_file(out, NULL));
	cr_assert(j, "%s: no JSON: %s", target, je.text);
	return j;
}

static const char *content_of(json_t *j)
{
	const char *s = json_string_value(json_object_get(json_object_get(
		json_array_get(json_object_get(j, "choices"), 0), "message"), "content"));

	cr_assert(s, "no choices[0].message.content");
	return s;
}

/* `bdfp4 kv-where --json` over both stacks' replay endpoints for the chat prompt in file. */
static json_t *kv_where(const char *file)
{
	static char out[1 << 16];
	char cmd[3 * PATH_MAX];
	json_error_t je;
	json_t *j;
	int rc;

	snprintf(cmd, sizeof(cmd), "'%s/bdfp4' kv-where --json --chat --model '%s' --events "
		 "ipc://%s/kv-replay.sock,ipc://%s/kv-replay.sock --prompt-file %s", S[0].bin,
		 S[0].model, S[0].dir, S[1].dir, file);
	rc = sv_run_output(cmd, out, sizeof(out));
	cr_assert_eq(rc, 0, "%s: exit %d\n%s", cmd, rc, out);
	j = json_loads(out, 0, &je);
	cr_assert(j, "kv-where printed no JSON (%s):\n%s", je.text, out);
	return j;
}

static long long stream_int(json_t *kw, int i, const char *key)
{
	json_t *v = json_object_get(json_array_get(json_object_get(kw, "streams"), (size_t)i), key);

	cr_assert(json_is_integer(v), "stream %d has no %s", i, key);
	return json_integer_value(v);
}

Test(scaleout, two_stacks_behind_nginx_serve_one_load_and_kv_where_finds_the_prefix)
{
	char url[2][160], body[4096], cmd[1024], out[4096], target[160], pfile[160];
	char *text, *first;
	const char *nginx;
	double served[2], before[2], hits[2];
	json_t *j, *kw, *msg;
	size_t len;
	int s, o, pages, prompt_tokens, port;

	/* Debian's is /usr/sbin/nginx, which a non-root PATH may leave out */
	nginx = access("/usr/sbin/nginx", X_OK) == 0 ? "/usr/sbin/nginx" : "nginx";
	if (strcmp(nginx, "nginx") == 0 && system("command -v nginx >/dev/null 2>&1") != 0)
		cr_skip_test("no nginx (Debian nginx; make deps installs it): the two-stack "
			     "load-balancer test is skipped");
	for (int i = 0; i < 2; i++)
		start_stack(&S[i], url[i], sizeof(url[i]));
	port = sv_free_port();
	snprintf(lb, sizeof(lb), "127.0.0.1:%d", port);
	start_nginx(nginx, url[0], url[1], port);

	/* the load: 16 concurrent chat completions through nginx */
	for (int i = 0; i < N_LOAD; i++) {
		char path[160];

		snprintf(body, sizeof(body), "{\"messages\": [{\"role\": \"user\", \"content\": "
			 "\"Question %d: name one colour of the rainbow.\"}], \"max_tokens\": 8, "
			 "\"temperature\": 0}", i);
		snprintf(path, sizeof(path), "%s/load-%d.body", S[0].dir, i);
		write_file(path, body, strlen(body));
	}
	snprintf(cmd, sizeof(cmd), "cd %s && for i in $(seq 0 %d); do curl -s -o load-$i.json "
		 "-w '%%{http_code}' -H 'Content-Type: application/json' --data-binary "
		 "@load-$i.body http://%s/v1/chat/completions > load-$i.code & done; wait",
		 S[0].dir, N_LOAD - 1, lb);
	cr_assert_eq(sv_run_output(cmd, out, sizeof(out)), 0);
	for (int i = 0; i < N_LOAD; i++) {
		char path[160], *code;
		json_error_t je;

		snprintf(path, sizeof(path), "%s/load-%d.code", S[0].dir, i);
		code = td_read_file(path, NULL);
		snprintf(path, sizeof(path), "%s/load-%d.json", S[0].dir, i);
		cr_assert(code && !strcmp(code, "200"), "request %d: HTTP %s: %s", i,
			  code ? code : "(none)", td_read_file(path, NULL));
		free(code);
		j = json_load_file(path, 0, &je);
		cr_assert(j, "request %d: %s", i, je.text);
		cr_expect_gt(json_integer_value(json_object_get(json_object_get(j, "usage"),
								"completion_tokens")), 0);
		content_of(j);
		json_decref(j);
	}
	for (int i = 0; i < 2; i++)
		served[i] = chats_served(url[i]);
	cr_expect_eq(served[0] + served[1], N_LOAD, "the routers served %g + %g chats of %d",
		     served[0], served[1], N_LOAD);
	cr_log_info("least_conn: %g chats to stack 0, %g to stack 1", served[0], served[1]);
	cr_expect_geq(served[0], 1, "least_conn sent nothing to stack 0 (%g / %g)", served[0],
		      served[1]);
	cr_expect_geq(served[1], 1, "least_conn sent nothing to stack 1 (%g / %g)", served[0],
		      served[1]);

	/* a long prompt through nginx: one stack serves it and indexes its pages */
	text = td_read_file("/usr/share/common-licenses/GPL-3", &len);
	cr_assert(text && len > LONG_BYTES, "no /usr/share/common-licenses/GPL-3");
	text[LONG_BYTES] = 0;
	snprintf(pfile, sizeof(pfile), "%s/long-prompt.txt", S[0].dir);
	write_file(pfile, text, LONG_BYTES);
	msg = json_pack("{s:[{s:s, s:s}], s:i, s:i}", "messages", "role", "user", "content", text,
			"max_tokens", 6, "temperature", 0);
	first = json_dumps(msg, JSON_COMPACT);
	json_decref(msg);
	for (int i = 0; i < 2; i++)
		before[i] = chats_served(url[i]);
	snprintf(target, sizeof(target), "http://%s/v1/chat/completions", lb);
	j = post(S[0].dir, target, first, "long-1");
	prompt_tokens = (int)json_integer_value(
		json_object_get(json_object_get(j, "usage"), "prompt_tokens"));
	for (int i = 0; i < 2; i++)
		served[i] = chats_served(url[i]) - before[i];
	cr_assert_eq(served[0] + served[1], 1, "the long prompt was served %g + %g times",
		     served[0], served[1]);
	s = served[0] == 1 ? 0 : 1;
	o = 1 - s;

	/* the event streams: the prompt's pages on stack s, none on o (the events leave kvpoold
	 * in its next batch: a few tries) */
	for (int t = 0;; t++) {
		kw = kv_where(pfile);
		if (stream_int(kw, s, "leading_pages") > 0 || t == 50)
			break;
		json_decref(kw);
		usleep(200000);
	}
	pages = (int)json_integer_value(json_object_get(kw, "prompt_pages"));
	cr_expect_eq(json_integer_value(json_object_get(kw, "prompt_tokens")), prompt_tokens,
		     "kv-where tokenized the prompt into another count than the router");
	cr_assert_eq(pages, prompt_tokens / 128);
	cr_log_info("the long prompt (%d tokens, %d pages) went to stack %d; kv-where: %lld leading "
		    "pages there, %lld on stack %d", prompt_tokens, pages, s,
		    stream_int(kw, s, "leading_pages"), stream_int(kw, o, "leading_pages"), o);
	cr_assert_geq(pages, 4, "the long prompt is only %d tokens", prompt_tokens);
	cr_expect_eq(stream_int(kw, s, "leading_pages"), pages,
		     "stack %d served the prompt but its stream holds %lld of its %d pages", s,
		     stream_int(kw, s, "leading_pages"), pages);
	cr_expect_eq(stream_int(kw, o, "prompt_pages_held"), 0,
		     "stack %d never saw the prompt but its stream holds %lld of its pages", o,
		     stream_int(kw, o, "prompt_pages_held"));
	json_decref(kw);

	/* the same prompt again to stack s: its leading pages come from the cache there (the
	 * router looks up (n − 1) / 128 pages: the last token is always computed) */
	for (int i = 0; i < 2; i++)
		hits[i] = counter(url[i], "prefix_cache_hits_total", NULL);
	snprintf(target, sizeof(target), "%s/v1/chat/completions", url[s]);
	{
		json_t *again = post(S[s].dir, target, first, "long-2");

		cr_expect_str_eq(content_of(again), content_of(j),
				 "the cached prefix changed the greedy answer");
		json_decref(again);
	}
	cr_expect_eq(counter(url[s], "prefix_cache_hits_total", NULL) - hits[s],
		     128.0 * ((prompt_tokens - 1) / 128), "stack %d's prefix hits", s);
	cr_expect_eq(counter(url[o], "prefix_cache_hits_total", NULL), 0,
		     "stack %d counted a hit, having served only short prompts", o);
	json_decref(j);
	free(first);
	free(text);
}

/* A replay endpoint that answers one request with a batch that is no msgpack of vLLM's events,
 * then the end mark (arg: its endpoint). */
static void *bad_replay(void *arg)
{
	void *ctx = zmq_ctx_new(), *s = zmq_socket(ctx, ZMQ_ROUTER);
	uint8_t seq[8] = { 0 }, end[8];
	zmq_msg_t id;
	int more = 1, zero = 0;
	size_t sz = sizeof(more);

	memset(end, 0xff, sizeof(end));
	zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero));
	if (zmq_bind(s, arg) == 0) {
		zmq_msg_init(&id);
		zmq_msg_recv(&id, s, 0);
		while (zmq_getsockopt(s, ZMQ_RCVMORE, &more, &sz) == 0 && more) {
			char junk[64];

			zmq_recv(s, junk, sizeof(junk), 0);
		}
		zmq_send(s, zmq_msg_data(&id), zmq_msg_size(&id), ZMQ_SNDMORE);
		zmq_send(s, "", 0, ZMQ_SNDMORE);
		zmq_send(s, seq, 8, ZMQ_SNDMORE);
		zmq_send(s, "\x93\x01\x02\x03", 4, 0); /* [1, 2, 3]: events is no array */
		zmq_send(s, zmq_msg_data(&id), zmq_msg_size(&id), ZMQ_SNDMORE);
		zmq_send(s, "", 0, ZMQ_SNDMORE);
		zmq_send(s, end, 8, ZMQ_SNDMORE);
		zmq_send(s, "", 0, 0);
		zmq_msg_close(&id);
		usleep(200000);
	}
	zmq_close(s);
	zmq_ctx_term(ctx);
	return NULL;
}

/* kv-where's bad usage (exit 2) and bad streams (exit 1, the reason printed, the other
 * streams still reported). */
Test(scaleout, kv_where_refuses_bad_input)
{
	static char out[1 << 16];
	char cmd[3 * PATH_MAX], pfile[160], ep[160], gone[160];
	pthread_t t;
	int rc;

	snprintf(pfile, sizeof(pfile), "%s/p.txt", S[0].dir);
	write_file(pfile, "Hello there.", 12);
	snprintf(ep, sizeof(ep), "ipc://%s/bad-replay.sock", S[0].dir);
	snprintf(gone, sizeof(gone), "ipc://%s/nobody.sock", S[0].dir);
	snprintf(cmd, sizeof(cmd), "'%s/bdfp4' kv-where --prompt-file %s 2>&1", S[0].bin, pfile);
	rc = sv_run_output(cmd, out, sizeof(out));
	cr_expect(WIFEXITED(rc) && WEXITSTATUS(rc) == 2, "no --events: %d\n%s", rc, out);
	cr_expect_not_null(strstr(out, "--events"), "%s", out);
	snprintf(cmd, sizeof(cmd), "'%s/bdfp4' kv-where --events %s --kv nvfp5 --prompt-file %s "
		 "2>&1", S[0].bin, gone, pfile);
	rc = sv_run_output(cmd, out, sizeof(out));
	cr_expect(WIFEXITED(rc) && WEXITSTATUS(rc) == 2, "unknown --kv: %d\n%s", rc, out);
	cr_expect_not_null(strstr(out, "nvfp5"), "%s", out);

	/* one endpoint nobody serves, one that answers garbage: both named with why */
	cr_assert_eq(pthread_create(&t, NULL, bad_replay, ep), 0);
	usleep(100000);
	snprintf(cmd, sizeof(cmd), "'%s/bdfp4' kv-where --json --model '%s' --timeout-ms 500 "
		 "--events %s,%s --prompt-file %s 2>/dev/null", S[0].bin, S[0].model, gone, ep,
		 pfile);
	rc = sv_run_output(cmd, out, sizeof(out));
	pthread_join(t, NULL);
	cr_expect(WIFEXITED(rc) && WEXITSTATUS(rc) == 1, "bad streams: %d\n%s", rc, out);
	cr_expect_not_null(strstr(out, "\"error\":\"no answer in 500 ms\""), "%s", out);
	cr_expect_not_null(strstr(out, "\"error\":\"batch 0 is not in vLLM's KV event encoding\""),
			   "%s", out);
}
