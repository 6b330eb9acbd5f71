/* test_http.c — routerd's HTTP front door (router/http.c) with real daemons: kvpoold, two
 * workerd on the CPU backend with the embedded SmolLM2, routerd listening on a free loopback
 * port, driven by the curl program (and by the openai Python package where `make deps`
 * installed it: BD_OPENAI_PY names its interpreter).
 *
 * Answers are checked against each other and against the native API: greedy text through
 * HTTP is the C client's greedy text; a stream's pieces put together are the non-streamed
 * answer; a stop string cuts the text where it first appears. /metrics is checked with
 * promtool and its counters against what the test sent.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <jansson.h>

#include "serve/bd_client.h"
#include "serve_common.h"

#define WAIT_MS 120000
#define N_CLIENTS 64
#define N_DISTINCT 8

static struct sv_env E;
static char url[160];
static int n_calls;

static void init(void)
{
	sv_init(&E);
}

static void fini(void)
{
	sv_fini(&E);
}

TestSuite(http, .init = init, .fini = fini, .timeout = 600);

/* ---- the system and curl -------------------------------------------------------------------- */

static char *read_file(const char *path, size_t *ret_len)
{
	FILE *f = fopen(path, "rb");
	char *buf;
	long n;

	if (!f)
		return NULL;
	fseek(f, 0, SEEK_END);
	n = ftell(f);
	fseek(f, 0, SEEK_SET);
	buf = malloc((size_t)n + 1);
	cr_assert(buf);
	n = (long)fread(buf, 1, (size_t)n, f);
	buf[n] = 0;
	fclose(f);
	if (ret_len)
		*ret_len = (size_t)n;
	return buf;
}

static void write_file(const char *path, const char *data)
{
	FILE *f = fopen(path, "wb");

	cr_assert(f, "%s: %s", path, strerror(errno));
	fputs(data, f);
	fclose(f);
}

/* The URL routerd logged (it listens on a port the kernel picked). */
static void find_url(void)
{
	int64_t end = sv_now_ms() + WAIT_MS;

	while (sv_now_ms() < end) {
		char *log = read_file(E.router.log, NULL), *p;

		p = log ? strstr(log, "http: listening on ") : NULL;
		if (p) {
			p += strlen("http: listening on ");
			snprintf(url, sizeof(url), "%.*s", (int)strcspn(p, " \n"), p);
			free(log);
			return;
		}
		free(log);
		usleep(50000);
	}
	cr_assert_fail("routerd logged no HTTP address:\n%s", sv_log_tail(&E.router));
}

static void up_with(const char *const *router_extra, bool workers)
{
	const char *args[SV_MAX_ARGS] = { "--http", "127.0.0.1:0" };
	int n = 2;

	for (int i = 0; router_extra && router_extra[i] && n < SV_MAX_ARGS - 1; i++)
		args[n++] = router_extra[i];
	args[n] = NULL;
	sv_start_pool(&E, NULL);
	sv_start_router(&E, args);
	find_url();
	if (workers) {
		sv_start_worker(&E, 0);
		sv_start_worker(&E, 1);
		sv_expect_healthy(&E, WAIT_MS, "the group did not form");
	}
}

static void up(void)
{
	up_with(NULL, true);
}

/* Starts curl on path (with body as JSON when not NULL), its body into out, its status into
 * code (NULL: none). Returns its pid. */
static pid_t curl_start(const char *method, const char *path, const char *body, const char *out,
			const char *code)
{
	char target[256], bodyfile[128], data[140];
	const char *argv[24];
	int n = 0;
	pid_t pid;

	snprintf(target, sizeof(target), "%s%s", url, path);
	snprintf(bodyfile, sizeof(bodyfile), "%s/body-%d-%d.json", E.dir, (int)getpid(),
		 n_calls++);
	argv[n++] = "curl";
	argv[n++] = "-s";
	argv[n++] = "-N";
	argv[n++] = "-o";
	argv[n++] = out;
	argv[n++] = "-w";
	argv[n++] = "%{http_code}";
	argv[n++] = "-X";
	argv[n++] = method;
	if (body) {
		write_file(bodyfile, body);
		snprintf(data, sizeof(data), "@%s", bodyfile);
		argv[n++] = "-H";
		argv[n++] = "Content-Type: application/json";
		argv[n++] = "--data-binary";
		argv[n++] = data;
	}
	argv[n++] = target;
	argv[n] = NULL;
	pid = fork();
	cr_assert(pid >= 0);
	if (pid == 0) {
		int fd = open(code ? code : "/dev/null", O_WRONLY | O_CREAT | O_TRUNC, 0644);

		if (fd >= 0)
			dup2(fd, 1);
		execvp("curl", (char *const *)argv);
		_exit(127);
	}
	return pid;
}

/* Waits for curl and returns the HTTP status it wrote. */
static int curl_wait(pid_t pid, const char *code)
{
	int st;
	char *s;
	int status;

	cr_assert_eq(waitpid(pid, &st, 0), pid);
	cr_assert(WIFEXITED(st) && WEXITSTATUS(st) != 127, "curl did not run");
	s = read_file(code, NULL);
	cr_assert(s, "no status from curl");
	status = atoi(s);
	free(s);
	return status;
}

/* One request: the HTTP status, the body into *ret_body (free it). */
static int http(const char *method, const char *path, const char *body, char **ret_body)
{
	char out[128], code[128];
	int k = n_calls;
	int status;

	snprintf(out, sizeof(out), "%s/out-%d-%d", E.dir, (int)getpid(), k);
	snprintf(code, sizeof(code), "%s/code-%d-%d", E.dir, (int)getpid(), k);
	status = curl_wait(curl_start(method, path, body, out, code), code);
	*ret_body = read_file(out, NULL);
	if (!*ret_body)
		*ret_body = strdup("");
	return status;
}

static json_t *parse(const char *s)
{
	json_error_t e;
	json_t *j = json_loads(s, 0, &e);

	cr_assert(j, "not JSON (%s): %s", e.text, s);
	return j;
}

/* A request expected to answer JSON with status want. */
static json_t *http_json(const char *method, const char *path, const char *body, int want)
{
	char *out;
	int st = http(method, path, body, &out);
	json_t *j;

	cr_assert_eq(st, want, "%s %s %.300s: status %d, want %d: %.500s", method, path,
		     body ? body : "", st, want, out);
	j = parse(out);
	free(out);
	return j;
}

static const char *jstr(json_t *j, const char *path)
{
	json_t *v = j;
	char key[64];

	/* a dotted path; a number selects an array element */
	for (const char *p = path; v && *p;) {
		size_t n = strcspn(p, ".");

		snprintf(key, sizeof(key), "%.*s", (int)n, p);
		v = json_is_array(v) ? json_array_get(v, (size_t)atoi(key))
				     : json_object_get(v, key);
		p += n + (p[n] == '.');
	}
	cr_assert(json_is_string(v), "%s is not a string in %s", path, json_dumps(j, 0));
	return json_string_value(v);
}

static json_int_t jint(json_t *j, const char *path)
{
	json_t *v = j;
	char key[64];

	for (const char *p = path; v && *p;) {
		size_t n = strcspn(p, ".");

		snprintf(key, sizeof(key), "%.*s", (int)n, p);
		v = json_is_array(v) ? json_array_get(v, (size_t)atoi(key))
				     : json_object_get(v, key);
		p += n + (p[n] == '.');
	}
	cr_assert(json_is_integer(v), "%s is not an integer in %s", path, json_dumps(j, 0));
	return json_integer_value(v);
}

/* ---- server-sent events --------------------------------------------------------------------- */

struct stream {
	char text[8192];
	size_t len;
	int n_events;         /* data events before [DONE] */
	bool done;            /* the last event was [DONE] */
	bool role_first;      /* chat: the first delta was the assistant's role */
	char finish[32];
	json_int_t prompt_tokens, completion_tokens; /* -1: no usage event */
	char id[64];
	bool ids_same;
};

static void parse_sse(const char *body, bool chat, struct stream *s)
{
	const char *p = body;

	memset(s, 0, sizeof(*s));
	s->prompt_tokens = s->completion_tokens = -1;
	s->ids_same = true;
	while ((p = strstr(p, "data: "))) {
		const char *end = strstr(p, "\n\n");
		char *ev;
		json_t *j, *ch, *c0, *t;

		cr_assert(end, "an event without its blank line: %s", p);
		ev = strndup(p + 6, (size_t)(end - p - 6));
		p = end + 2;
		cr_assert(!s->done, "an event after [DONE]: %s", ev);
		if (!strcmp(ev, "[DONE]")) {
			s->done = true;
			free(ev);
			continue;
		}
		j = parse(ev);
		free(ev);
		cr_assert(!json_object_get(j, "error"), "error event: %s", json_dumps(j, 0));
		if (!s->n_events++)
			snprintf(s->id, sizeof(s->id), "%s", jstr(j, "id"));
		else if (strcmp(s->id, jstr(j, "id")))
			s->ids_same = false;
		cr_assert_str_eq(jstr(j, "object"), chat ? "chat.completion.chunk"
							 : "text_completion");
		if (json_object_get(j, "usage")) {
			s->prompt_tokens = jint(j, "usage.prompt_tokens");
			s->completion_tokens = jint(j, "usage.completion_tokens");
		}
		ch = json_object_get(j, "choices");
		c0 = json_array_get(ch, 0);
		if (c0) {
			t = chat ? json_object_get(json_object_get(c0, "delta"), "content")
				 : json_object_get(c0, "text");
			if (chat && s->n_events == 1)
				s->role_first = !strcmp(jstr(c0, "delta.role"), "assistant");
			if (json_is_string(t)) {
				cr_assert(s->len + json_string_length(t) < sizeof(s->text));
				memcpy(s->text + s->len, json_string_value(t),
				       json_string_length(t));
				s->len += json_string_length(t);
				s->text[s->len] = 0;
			}
			if (json_is_string(json_object_get(c0, "finish_reason")))
				snprintf(s->finish, sizeof(s->finish), "%s",
					 jstr(c0, "finish_reason"));
		}
		json_decref(j);
	}
}

/* ---- metrics -------------------------------------------------------------------------------- */

/* The value of the sample whose line starts with prefix (name{labels...), -1 when none. */
static double metric(const char *text, const char *prefix)
{
	for (const char *p = text; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL) {
		if (!strncmp(p, prefix, strlen(prefix))) {
			const char *sp = strchr(p, ' ');

			return sp ? strtod(sp + 1, NULL) : -1;
		}
	}
	return -1;
}

static char *scrape(void)
{
	char *out;

	cr_assert_eq(http("GET", "/metrics", NULL, &out), 200, "%s", out);
	return out;
}

/* promtool's check of the exposition text: parsed, and no lint problem but the colons of the
 * vLLM-style names (promtool asks for names without ':'). */
static void promtool_check(const char *text)
{
	char in[128], cmd[400], *res, *line, *save = NULL;
	int st;

	if (system("command -v promtool >/dev/null 2>&1") != 0) {
		cr_log_warn("no promtool (Debian prometheus; make deps): not checked");
		return;
	}
	snprintf(in, sizeof(in), "%s/metrics.txt", E.dir);
	write_file(in, text);
	snprintf(cmd, sizeof(cmd), "promtool check metrics < %s > %s/promtool.out 2>&1", in,
		 E.dir);
	st = system(cmd);
	snprintf(in, sizeof(in), "%s/promtool.out", E.dir);
	res = read_file(in, NULL);
	cr_assert(res);
	cr_assert(WIFEXITED(st) && (WEXITSTATUS(st) == 0 || WEXITSTATUS(st) == 3),
		  "promtool failed (status %d): %s", st, res);
	for (line = strtok_r(res, "\n", &save); line; line = strtok_r(NULL, "\n", &save))
		cr_expect(strstr(line, "metric names should not contain ':'"),
			  "promtool: %s", line);
	free(res);
}

/* ---- the tests ------------------------------------------------------------------------------ */

/* /v1/models names the served model and its context; /health says ok; unknown paths and
 * methods get OpenAI-shaped 404/405. */
Test(http, models_health_and_paths)
{
	json_t *j;
	char *out;

	up();
	j = http_json("GET", "/v1/models", NULL, 200);
	cr_expect_str_eq(jstr(j, "object"), "list");
	cr_expect_str_eq(jstr(j, "data.0.id"), "SmolLM2-135M-Instruct.Q4_1.gguf");
	cr_expect_eq(jint(j, "data.0.max_model_len"), 1024, "the pool's max_seq_len caps it");
	json_decref(j);
	j = http_json("GET", "/health", NULL, 200);
	cr_expect_str_eq(jstr(j, "status"), "ok");
	cr_expect_str_eq(jstr(j, "state"), "serving");
	json_decref(j);
	j = http_json("GET", "/v1/nothing", NULL, 404);
	cr_expect_str_eq(jstr(j, "error.type"), "invalid_request_error");
	json_decref(j);
	j = http_json("GET", "/v1/completions", NULL, 405);
	cr_expect(strstr(jstr(j, "error.message"), "POST"));
	json_decref(j);
	cr_expect_eq(http("POST", "/health", "{}", &out), 405);
	free(out);
}

/* Without workers: /health is 503 with the reason, and a request gets 503 "not serving". */
Test(http, not_serving_is_503)
{
	json_t *j;

	up_with(NULL, false);
	j = http_json("GET", "/health", NULL, 503);
	cr_expect_str_eq(jstr(j, "state"), "starting");
	cr_expect(strstr(jstr(j, "reason"), "worker"), "%s", jstr(j, "reason"));
	json_decref(j);
	j = http_json("POST", "/v1/completions", "{\"prompt\": \"Hello\"}", 503);
	cr_expect_str_eq(jstr(j, "error.type"), "service_unavailable");
	cr_expect(strstr(jstr(j, "error.message"), "not serving"), "%s", jstr(j, "error.message"));
	json_decref(j);
}

/* The greedy completion through HTTP is the C client's over ZeroMQ, token count and text; the
 * stream of the same request puts together to the same text, one id, usage last, [DONE]. */
Test(http, completions_match_native_api)
{
	static const char *body = "{\"prompt\": \"The capital of France is\", \"max_tokens\": 12,"
				  " \"temperature\": 0, \"ignore_eos\": true}";
	struct bd_client *c;
	struct bd_client_gen g;
	struct bd_client_event ev;
	uint64_t tag;
	struct stream s;
	json_t *j;
	char *out;

	up();
	j = http_json("POST", "/v1/completions", body, 200);
	cr_expect_str_eq(jstr(j, "object"), "text_completion");
	cr_expect_str_eq(jstr(j, "choices.0.finish_reason"), "length");
	cr_expect_eq(jint(j, "usage.completion_tokens"), 12);
	cr_expect_eq(jint(j, "usage.total_tokens"),
		     jint(j, "usage.prompt_tokens") + jint(j, "usage.completion_tokens"));

	c = sv_client(&E);
	memset(&g, 0, sizeof(g));
	g.prompt = "The capital of France is";
	g.max_tokens = 12;
	g.ignore_eos = true; /* zero sampling: greedy */
	cr_assert_eq(bd_client_generate_start(c, &g, &tag), 0);
	cr_assert_eq(bd_client_next(c, WAIT_MS, &ev), 0);
	cr_assert_eq(ev.kind, BD_CLIENT_CHUNK);
	cr_assert_neq(ev.finish, BD_FINISH_NONE, "not streamed: one final chunk");
	cr_expect_str_eq(jstr(j, "choices.0.text"), ev.text, "HTTP and the native API differ");
	cr_expect_eq(jint(j, "usage.prompt_tokens"), ev.usage.prompt_tokens);
	bd_client_free(c);

	cr_assert_eq(http("POST", "/v1/completions",
			  "{\"prompt\": \"The capital of France is\", \"max_tokens\": 12,"
			  " \"temperature\": 0, \"ignore_eos\": true, \"stream\": true,"
			  " \"stream_options\": {\"include_usage\": true}}", &out), 200, "%s", out);
	parse_sse(out, false, &s);
	free(out);
	cr_expect(s.done, "no [DONE] at the end");
	cr_expect(s.ids_same, "every chunk carries the id of the first");
	cr_expect_str_eq(s.text, jstr(j, "choices.0.text"), "stream and answer differ");
	cr_expect_str_eq(s.finish, "length");
	cr_expect_eq(s.completion_tokens, 12);
	json_decref(j);
}

/* Chat: the template's answer, non-streamed and streamed alike (the role delta first); a stop
 * string cuts the text before its first occurrence with finish_reason "stop". */
Test(http, chat_stream_and_stop)
{
	static const char *msgs = "\"messages\": [{\"role\": \"system\", \"content\": \"You are "
				  "terse.\"}, {\"role\": \"user\", \"content\": \"Name three "
				  "colors.\"}], \"max_tokens\": 24, \"temperature\": 0, "
				  "\"ignore_eos\": true";
	char body[1024], stop[64], *out, *cut;
	const char *text, *sp;
	struct stream s;
	json_t *j, *k;

	up();
	snprintf(body, sizeof(body), "{%s}", msgs);
	j = http_json("POST", "/v1/chat/completions", body, 200);
	cr_expect_str_eq(jstr(j, "object"), "chat.completion");
	cr_expect_str_eq(jstr(j, "choices.0.message.role"), "assistant");
	text = jstr(j, "choices.0.message.content");
	cr_assert(strlen(text) > 8, "a too short answer to cut: '%s'", text);

	snprintf(body, sizeof(body), "{%s, \"stream\": true}", msgs);
	cr_assert_eq(http("POST", "/v1/chat/completions", body, &out), 200, "%s", out);
	parse_sse(out, true, &s);
	free(out);
	cr_expect(s.role_first, "the first delta is the assistant's role");
	cr_expect(s.done);
	cr_expect_str_eq(s.text, text);
	cr_expect_eq(s.completion_tokens, -1, "usage only with stream_options.include_usage");

	/* a stop string from the middle of the answer: the 3 bytes after its first space */
	sp = strchr(text + 1, ' ');
	cr_assert(sp && strlen(sp) > 3, "no word to stop at in '%s'", text);
	snprintf(stop, sizeof(stop), "%.3s", sp);
	cut = strstr(text, stop);
	snprintf(body, sizeof(body), "{%s, \"stop\": [\"%s\", \"never-seen-zq\"]}", msgs, stop);
	k = http_json("POST", "/v1/chat/completions", body, 200);
	cr_expect_eq(strlen(jstr(k, "choices.0.message.content")), (size_t)(cut - text),
		     "cut at '%s' of '%s': got '%s'", stop, text,
		     jstr(k, "choices.0.message.content"));
	cr_expect(!strncmp(jstr(k, "choices.0.message.content"), text, (size_t)(cut - text)));
	cr_expect_str_eq(jstr(k, "choices.0.finish_reason"), "stop");
	json_decref(k);
	json_decref(j);
}

/* Bad requests: the status, OpenAI's error shape and the field; nothing stays in the pool. */
Test(http, errors_and_statuses)
{
	static const struct {
		const char *path, *body;
		int status;
		const char *param; /* NULL: no param expected */
		const char *in_message;
	} cases[] = {
		{ "/v1/completions", "{\"prompt\": ", 400, NULL, "not JSON" },
		{ "/v1/completions", "[1, 2]", 400, NULL, "JSON object" },
		{ "/v1/completions", "{\"max_tokens\": 4}", 400, "prompt", "prompt" },
		{ "/v1/completions", "{\"prompt\": \"Hi\", \"n\": 2}", 400, "n", "n must be" },
		{ "/v1/completions", "{\"prompt\": \"Hi\", \"max_tokens\": -1}", 400, "max_tokens",
		  "max_tokens" },
		{ "/v1/completions", "{\"prompt\": \"Hi\", \"max_tokens\": 0}", 400, NULL,
		  "max_tokens" },
		{ "/v1/completions", "{\"prompt\": \"Hi\", \"temperature\": \"hot\"}", 400,
		  "temperature", "number" },
		{ "/v1/completions", "{\"prompt\": \"Hi\", \"stop\": [1]}", 400, "stop", "stop" },
		{ "/v1/completions", "{\"prompt\": \"Hi\", \"logprobs\": 2}", 400, "logprobs",
		  "logprobs" },
		{ "/v1/completions", "{\"prompt\": \"Hi\", \"model\": \"gpt-4\"}", 404, "model",
		  "does not exist" },
		{ "/v1/chat/completions", "{\"messages\": []}", 400, "messages", "non-empty" },
		{ "/v1/chat/completions", "{\"messages\": [{\"role\": \"robot\", \"content\": "
					  "\"x\"}]}", 400, "messages", "role" },
	};
	char big[8192], *huge;
	json_t *j;
	size_t n;

	up();
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		j = http_json("POST", cases[i].path, cases[i].body, cases[i].status);
		cr_expect(strstr(jstr(j, "error.message"), cases[i].in_message), "%s: %s",
			  cases[i].body, jstr(j, "error.message"));
		cr_expect(json_is_string(json_object_get(json_object_get(j, "error"), "type")));
		if (cases[i].param)
			cr_expect_str_eq(jstr(j, "error.param"), cases[i].param, "%s",
					 cases[i].body);
		json_decref(j);
	}
	/* a prompt longer than the context (1024 tokens): 413 context_length_exceeded */
	n = 0;
	n += (size_t)snprintf(big + n, sizeof(big) - n, "{\"prompt\": [");
	for (int i = 0; i < 1100; i++)
		n += (size_t)snprintf(big + n, sizeof(big) - n, "%s%d", i ? "," : "", 100 + i % 7);
	snprintf(big + n, sizeof(big) - n, "]}");
	j = http_json("POST", "/v1/completions", big, 413);
	cr_expect_str_eq(jstr(j, "error.code"), "context_length_exceeded");
	json_decref(j);
	/* a body over 1 MiB: 413 before any parsing */
	huge = malloc((2 << 20) + 64);
	cr_assert(huge);
	n = (size_t)sprintf(huge, "{\"prompt\": \"");
	memset(huge + n, 'a', 2 << 20);
	strcpy(huge + n + (2 << 20), "\"}");
	j = http_json("POST", "/v1/completions", huge, 413);
	free(huge);
	cr_expect(strstr(jstr(j, "error.message"), "larger"), "%s", jstr(j, "error.message"));
	json_decref(j);
	cr_expect(sv_pool_idle(&E, WAIT_MS), "a refused request left something in the pool");
	j = http_json("GET", "/health", NULL, 200);
	json_decref(j);
}

/* max_queue = 0: every request finds the queue full, 429 rate_limit_exceeded. */
Test(http, queue_full_is_429)
{
	json_t *j;

	up_with((const char *const[]){ "--max-queue", "0", NULL }, true);
	j = http_json("POST", "/v1/completions", "{\"prompt\": \"Hello\"}", 429);
	cr_expect_str_eq(jstr(j, "error.code"), "rate_limit_exceeded");
	cr_expect(strstr(jstr(j, "error.message"), "queue"));
	json_decref(j);
}

/* A streaming client that goes away mid-answer: its request is cancelled, the pool gets every
 * page and slot back, /metrics counts it as aborted; the server goes on serving. */
Test(http, disconnect_cancels)
{
	char out[128], code[128], *m, *text = NULL;
	int64_t end;
	pid_t pid;
	json_t *j;

	up();
	snprintf(out, sizeof(out), "%s/long.sse", E.dir);
	snprintf(code, sizeof(code), "%s/long.code", E.dir);
	pid = curl_start("POST", "/v1/completions",
			 "{\"prompt\": \"Tell me a long story.\", \"max_tokens\": 900, "
			 "\"ignore_eos\": true, \"stream\": true}", out, code);
	/* wait until tokens flow, then drop the connection */
	end = sv_now_ms() + WAIT_MS;
	while (sv_now_ms() < end) {
		free(text);
		text = read_file(out, NULL);
		if (text && strstr(text, "data: ") && strstr(strstr(text, "data: ") + 6, "data: "))
			break;
		usleep(20000);
	}
	cr_assert(text && strstr(text, "data: "), "no tokens streamed");
	cr_expect(!strstr(text, "[DONE]"), "the answer ended before the disconnect");
	free(text);
	kill(pid, SIGKILL);
	waitpid(pid, NULL, 0);
	cr_expect(sv_pool_idle(&E, WAIT_MS), "the cancelled request still holds pool memory");
	end = sv_now_ms() + WAIT_MS;
	do {
		m = scrape();
		if (metric(m, "bdfp4:request_success_total{model_name=\"SmolLM2-135M-Instruct"
			      ".Q4_1.gguf\",finished_reason=\"abort\"}") == 1)
			break;
		free(m);
		m = NULL;
		usleep(50000);
	} while (sv_now_ms() < end);
	cr_expect(m, "the abort was not counted");
	free(m);
	j = http_json("POST", "/v1/completions", "{\"prompt\": \"Hi\", \"max_tokens\": 2}", 200);
	json_decref(j);
}

/* 64 streaming clients at once, 8 prompts of 8 clients each: every stream is complete, its
 * pieces put together are the greedy answer of its prompt (nothing lost, nothing twice); then
 * /metrics passes promtool and its counters are what was sent. */
Test(http, concurrent_streams_and_metrics)
{
	char ref[N_DISTINCT][4096], body[N_CLIENTS][256], out[N_CLIENTS][128], code[N_CLIENTS][128];
	json_int_t want_prompt = 0, want_gen = 0, prompt_tokens[N_DISTINCT];
	pid_t pid[N_CLIENTS];
	double p0, g0, l0;
	char *m;

	up();
	m = scrape();
	promtool_check(m);
	p0 = metric(m, "bdfp4:prompt_tokens_total{");
	g0 = metric(m, "bdfp4:generation_tokens_total{");
	l0 = metric(m, "bdfp4:request_success_total{model_name=\"SmolLM2-135M-Instruct.Q4_1."
		       "gguf\",finished_reason=\"length\"}");
	cr_expect_eq(p0, 0);
	cr_expect_eq(g0, 0);
	free(m);
	/* the references run batched too: a row's greedy path may differ between a batch of one
	 * and a batch of many (the products sum in another order), not between two batches */
	for (int i = 0; i < N_DISTINCT; i++) {
		snprintf(body[i], sizeof(body[i]),
			 "{\"prompt\": \"Fact number %d about the sea:\", \"max_tokens\": 10, "
			 "\"temperature\": 0, \"ignore_eos\": true}", i + 1);
		snprintf(out[i], sizeof(out[i]), "%s/r%d.json", E.dir, i);
		snprintf(code[i], sizeof(code[i]), "%s/r%d.code", E.dir, i);
		pid[i] = curl_start("POST", "/v1/completions", body[i], out[i], code[i]);
	}
	for (int i = 0; i < N_DISTINCT; i++) {
		char *o;
		json_t *j;

		cr_assert_eq(curl_wait(pid[i], code[i]), 200, "reference %d", i);
		o = read_file(out[i], NULL);
		j = parse(o);
		free(o);
		snprintf(ref[i], sizeof(ref[i]), "%s", jstr(j, "choices.0.text"));
		prompt_tokens[i] = jint(j, "usage.prompt_tokens");
		want_prompt += prompt_tokens[i];
		want_gen += jint(j, "usage.completion_tokens");
		json_decref(j);
	}
	for (int c = 0; c < N_CLIENTS; c++) {
		snprintf(body[c], sizeof(body[c]), "{\"prompt\": \"Fact number %d about the sea:\","
			 " \"max_tokens\": 10, \"temperature\": 0, \"ignore_eos\": true, "
			 "\"stream\": true, \"stream_options\": {\"include_usage\": true}}",
			 c % N_DISTINCT + 1);
		snprintf(out[c], sizeof(out[c]), "%s/c%d.sse", E.dir, c);
		snprintf(code[c], sizeof(code[c]), "%s/c%d.code", E.dir, c);
		pid[c] = curl_start("POST", "/v1/completions", body[c], out[c], code[c]);
	}
	for (int c = 0; c < N_CLIENTS; c++) {
		struct stream s;
		char *text;

		cr_assert_eq(curl_wait(pid[c], code[c]), 200, "client %d", c);
		text = read_file(out[c], NULL);
		cr_assert(text);
		parse_sse(text, false, &s);
		free(text);
		cr_expect(s.done, "client %d: no [DONE]", c);
		cr_expect_str_eq(s.text, ref[c % N_DISTINCT], "client %d: lost or doubled text: "
				 "'%s', want '%s'", c, s.text, ref[c % N_DISTINCT]);
		cr_expect_eq(s.completion_tokens, 10, "client %d", c);
		cr_expect_eq(s.prompt_tokens, prompt_tokens[c % N_DISTINCT], "client %d", c);
		want_prompt += s.prompt_tokens;
		want_gen += s.completion_tokens;
	}
	m = scrape();
	promtool_check(m);
	cr_expect_eq(metric(m, "bdfp4:prompt_tokens_total{"), (double)want_prompt);
	cr_expect_eq(metric(m, "bdfp4:generation_tokens_total{"), (double)want_gen);
	cr_expect_eq(metric(m, "bdfp4:request_success_total{model_name=\"SmolLM2-135M-Instruct."
			       "Q4_1.gguf\",finished_reason=\"length\"}") - l0,
		     N_CLIENTS + N_DISTINCT);
	cr_expect_eq(metric(m, "bdfp4:time_to_first_token_seconds_count{"),
		     N_CLIENTS + N_DISTINCT);
	cr_expect_eq(metric(m, "bdfp4:http_requests_total{model_name=\"SmolLM2-135M-Instruct."
			       "Q4_1.gguf\",endpoint=\"/v1/completions\",status=\"200\"}"),
		     N_CLIENTS + N_DISTINCT);
	/* 9 intervals per streamed request of 10 tokens */
	cr_expect_eq(metric(m, "bdfp4:inter_token_latency_seconds_count{"), N_CLIENTS * 9);
	free(m);
	cr_expect(sv_pool_idle(&E, WAIT_MS));
}

/* The official openai package against the server (tests/python/openai_check.py): chat and
 * completions, streamed and not, and an error status; skipped when it is not installed. */
Test(http, openai_sdk)
{
	const char *py = getenv("BD_OPENAI_PY");
	char cmd[PATH_MAX + 600];
	int st;

	if (!py || access(py, X_OK) != 0) {
		cr_log_warn("no openai package (make deps installs it; BD_OPENAI_PY): skipped");
		cr_skip_test("BD_OPENAI_PY is not an interpreter with the openai package");
	}
	up();
	snprintf(cmd, sizeof(cmd), "%s %s/tests/python/openai_check.py %s/v1 "
		 "SmolLM2-135M-Instruct.Q4_1.gguf > %s/openai.out 2>&1", py, E.root, url, E.dir);
	st = system(cmd);
	snprintf(cmd, sizeof(cmd), "%s/openai.out", E.dir);
	{
		char *o = read_file(cmd, NULL);

		cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "openai_check.py failed:\n%s",
			  o ? o : "");
		free(o);
	}
}
