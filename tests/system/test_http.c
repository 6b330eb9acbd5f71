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
#include <math.h>

#include "formats/bd_gguf.h"
#include "model/bd_forward.h"
#include "model/bd_sampler.h"
#include "model/bd_tokenizer.h"
#include "quant/bd_kvcfg.h"
#include "serve/bd_client.h"
#include "serve_common.h"
#include "tmpdir.h"

#define WAIT_MS 120000
#define N_CLIENTS 64
#define N_DISTINCT 8

static char url[160];
static int n_calls;

SV_TEST_SUITE(http, 600);

/* ---- the system and curl -------------------------------------------------------------------- */

static void write_file(const char *path, const char *data)
{
	FILE *f = fopen(path, "wb");

	cr_assert(f, "%s: %s", path, strerror(errno));
	fputs(data, f);
	fclose(f);
}

static void up_with(const char *const *router_extra, bool workers)
{
	static const char *const args[] = { "--http", "127.0.0.1:0", NULL };

	sv_start_pool(&E, NULL);
	sv_start_router2(&E, args, router_extra);
	sv_http_url(&E, url, sizeof(url), WAIT_MS);
	if (workers) {
		sv_start_workers(&E, WAIT_MS, "the group did not form");
	}
}

static void up(void)
{
	up_with(NULL, true);
}

/* up() with batch-invariant decoding on the router and both workers: a greedy request's
 * tokens do not depend on the requests batched beside it. */
static void up_batch_invariant(void)
{
	static const char *const inv[] = { "--batch-invariant", NULL };

	up_with(inv, false);
	for (int r = 0; r < 2; r++)
		sv_start_worker_args(&E, r, inv);
	sv_expect_healthy(&E, WAIT_MS, "the group did not form");
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
	s = td_read_file(code, NULL);
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
	*ret_body = td_read_file(out, NULL);
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

/* The value at a dotted path of j ("choices.0.text": a number selects an array element), NULL
 * when there is none. */
static json_t *jget(json_t *j, const char *path)
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
	return v;
}

static const char *jstr(json_t *j, const char *path)
{
	json_t *v = jget(j, path);

	cr_assert(json_is_string(v), "%s is not a string in %s", path, json_dumps(j, 0));
	return json_string_value(v);
}

static json_int_t jint(json_t *j, const char *path)
{
	json_t *v = jget(j, path);

	cr_assert(json_is_integer(v), "%s is not an integer in %s", path, json_dumps(j, 0));
	return json_integer_value(v);
}

static double jnum(json_t *j, const char *path)
{
	json_t *v = jget(j, path);

	cr_assert(json_is_number(v), "%s is not a number in %s", path, json_dumps(j, 0));
	return json_number_value(v);
}

/* http_json of a request that succeeds (200) with an OpenAI object of type object. */
static json_t *http_object(const char *method, const char *path, const char *body,
			   const char *object)
{
	json_t *j = http_json(method, path, body, 200);

	cr_expect_str_eq(jstr(j, "object"), object, "%s %s", method, path);
	return j;
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
	json_t *lp;           /* the choices' logprobs put together (NULL: none came) */
};

/* Appends the arrays of the logprobs object from to those of *into (created on first use). */
static void logprobs_join(json_t **into, json_t *from)
{
	const char *k;
	json_t *a;

	if (!*into) {
		*into = json_deep_copy(from);
		return;
	}
	json_object_foreach(from, k, a)
		json_array_extend(json_object_get(*into, k), a);
}

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
			if (json_is_object(json_object_get(c0, "logprobs")))
				logprobs_join(&s->lp, json_object_get(c0, "logprobs"));
			if (json_is_string(json_object_get(c0, "finish_reason")))
				snprintf(s->finish, sizeof(s->finish), "%s",
					 jstr(c0, "finish_reason"));
		}
		json_decref(j);
	}
}

/* ---- metrics -------------------------------------------------------------------------------- */

/* The text of the router's /metrics. */
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
	res = td_read_file(in, NULL);
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
	j = http_object("GET", "/v1/models", NULL, "list");
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
	j = http_object("POST", "/v1/completions", body, "text_completion");
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
	j = http_object("POST", "/v1/chat/completions", body, "chat.completion");
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
		{ "/v1/completions", "{\"prompt\": \"Hi\", \"logprobs\": 6}", 400, "logprobs",
		  "logprobs must be an integer in [0, 5]" },
		{ "/v1/completions", "{\"prompt\": \"Hi\", \"logprobs\": true}", 400, "logprobs",
		  "integer" },
		{ "/v1/completions", "{\"prompt\": \"Hi\", \"top_logprobs\": 2}", 400,
		  "top_logprobs", "chat field" },
		{ "/v1/chat/completions", "{\"messages\": [{\"role\": \"user\", \"content\": "
					  "\"x\"}], \"logprobs\": true, \"top_logprobs\": 21}", 400,
		  "top_logprobs", "top_logprobs must be an integer in [0, 20]" },
		{ "/v1/chat/completions", "{\"messages\": [{\"role\": \"user\", \"content\": "
					  "\"x\"}], \"top_logprobs\": 2}", 400, "top_logprobs",
		  "needs logprobs" },
		{ "/v1/chat/completions", "{\"messages\": [{\"role\": \"user\", \"content\": "
					  "\"x\"}], \"logprobs\": 1}", 400, "logprobs", "boolean" },
		{ "/v1/completions", "{\"prompt\": \"Hi\", \"model\": \"gpt-4\"}", 404, "model",
		  "does not exist" },
		{ "/v1/chat/completions", "{\"messages\": []}", 400, "messages", "non-empty" },
		{ "/v1/completions", "{\"prompt\": \"Hi\", \"cache_salt\": 7}", 400, "cache_salt",
		  "cache_salt must be a string" },
		{ "/v1/completions", "{\"prompt\": \"Hi\", \"cache_salt\": \"0123456789012345678901"
				     "234567890123456789012345678901234567890123\"}", 413, NULL,
		  "cache_salt longer than 63 bytes" },
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
		text = td_read_file(out, NULL);
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
		if (sv_metric(m, "bdfp4:request_success_total{model_name=\"SmolLM2-135M-Instruct"
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
 * /metrics passes promtool and its counters are what was sent. The daemons decode
 * batch-invariant, so that the answer of a prompt is one text whatever ran beside it (the fast
 * batches' products sum in another order for another batch, and a near-tie of 80 greedy steps
 * may tip: one prompt of the 8 did, with the SIMD decode attention). */
Test(http, concurrent_streams_and_metrics)
{
	char ref[N_DISTINCT][4096], body[N_CLIENTS][256], out[N_CLIENTS][128], code[N_CLIENTS][128];
	json_int_t want_prompt = 0, want_gen = 0, prompt_tokens[N_DISTINCT];
	pid_t pid[N_CLIENTS];
	double p0, g0, l0;
	char *m;

	up_batch_invariant();
	m = scrape();
	promtool_check(m);
	p0 = sv_metric(m, "bdfp4:prompt_tokens_total{");
	g0 = sv_metric(m, "bdfp4:generation_tokens_total{");
	l0 = sv_metric(m, "bdfp4:request_success_total{model_name=\"SmolLM2-135M-Instruct.Q4_1."
		       "gguf\",finished_reason=\"length\"}");
	cr_expect_eq(p0, 0);
	cr_expect_eq(g0, 0);
	free(m);
	/* the references run batched too */
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
		o = td_read_file(out[i], NULL);
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
		text = td_read_file(out[c], NULL);
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
	cr_expect_eq(sv_metric(m, "bdfp4:prompt_tokens_total{"), (double)want_prompt);
	cr_expect_eq(sv_metric(m, "bdfp4:generation_tokens_total{"), (double)want_gen);
	cr_expect_eq(sv_metric(m, "bdfp4:request_success_total{model_name=\"SmolLM2-135M-Instruct."
			       "Q4_1.gguf\",finished_reason=\"length\"}") - l0,
		     N_CLIENTS + N_DISTINCT);
	cr_expect_eq(sv_metric(m, "bdfp4:time_to_first_token_seconds_count{"),
		     N_CLIENTS + N_DISTINCT);
	cr_expect_eq(sv_metric(m, "bdfp4:http_requests_total{model_name=\"SmolLM2-135M-Instruct."
			       "Q4_1.gguf\",endpoint=\"/v1/completions\",status=\"200\"}"),
		     N_CLIENTS + N_DISTINCT);
	/* 9 intervals per streamed request of 10 tokens */
	cr_expect_eq(sv_metric(m, "bdfp4:inter_token_latency_seconds_count{"), N_CLIENTS * 9);
	free(m);
	cr_expect(sv_pool_idle(&E, WAIT_MS));
}

/* ---- log-probabilities ------------------------------------------------------------------- */

/* |served − single-process| of a first token's log-probability: the prompt's logits after the
 * same prefill, summed in another order by the two ranks */
#define LOGPROB_TOL 0.02

/* The log-softmax of logits[V] at token t, in long double (the test's own). */
static double ref_logprob(const float *lg, int V, int32_t t)
{
	long double m = -INFINITY, sum = 0;

	for (int i = 0; i < V; i++)
		m = lg[i] > m ? lg[i] : m;
	for (int i = 0; i < V; i++)
		sum += expl((long double)lg[i] - m);
	return (double)((long double)lg[t] - m - logl(sum));
}

/* The single-process model's logits after prompt (tokenized as the router does), into lg[V]
 * (malloc'ed); the tokenizer into *ret_tok. */
static float *model_logits(const char *prompt, int *ret_v, struct bd_tokenizer **ret_tok)
{
	char gerr[BD_GGUF_ERR_MAX], merr[BD_MODEL_ERR_MAX];
	struct bd_gguf *g;
	struct bd_model *m;
	struct bd_seq *sq;
	int32_t *ids;
	size_t n;
	float *lg;

	cr_assert_eq(bd_gguf_open(E.model, &g, gerr), 0, "%s", gerr);
	cr_assert_eq(bd_model_from_gguf(g, &m, merr), 0, "%s", merr);
	cr_assert_eq(bd_tokenizer_new_from_gguf(g, ret_tok, NULL), 0);
	bd_gguf_free(g);
	cr_assert_eq(bd_tokenizer_encode(*ret_tok, prompt, strlen(prompt), BD_TOK_ADD_SPECIAL,
					 &ids, &n), 0);
	struct bd_seq_opts o = { .max_tokens = (int)n + 1 };
	cr_assert_eq(bd_seq_new(m, bd_kvcfg_find("bitdecoding-nvfp4"), &o, &sq, merr), 0, "%s",
		     merr);
	*ret_v = m->hp.n_vocab;
	lg = malloc(sizeof(float) * (size_t)*ret_v);
	cr_assert(lg);
	cr_assert_eq(bd_model_prefill(m, sq, ids, (int)n, lg), 0);
	bd_seq_free(sq);
	bd_model_free(m);
	free(ids);
	return lg;
}

/* One step's top log-probabilities: every value ≤ 0, the sampled token's the largest (greedy),
 * Σ exp ≤ 1. */
static void expect_step(double sampled, const double *top, size_t n, const char *what)
{
	double mass = 0, best = -INFINITY;

	cr_expect_leq(sampled, 0.0, "%s: logprob %f > 0", what, sampled);
	for (size_t k = 0; k < n; k++) {
		cr_expect_leq(top[k], 0.0, "%s: top %zu: %f", what, k, top[k]);
		best = top[k] > best ? top[k] : best;
		mass += exp(top[k]);
	}
	cr_expect_eq(sampled, best, "%s: the greedy token's %f is not the top's %f", what,
		     sampled, best);
	cr_expect_leq(mass, 1.0 + 1e-6, "%s: Σ exp(top) = %f", what, mass);
}

/* Completions with logprobs = 5 (curl): the four arrays, one entry per generated token, their
 * pieces put together are the text and text_offset points at each; every step as expect_step;
 * the first token's log-probabilities are the single-process model's log-softmax of the same
 * prompt (so a missing normalization, a base-2 log or a temperature would fail); the stream
 * carries the same entries. */
Test(http, completions_logprobs_are_the_model_s)
{
	static const char *prompt = "The capital of France is";
	char body[512], joined[1024] = "", what[32], *out;
	struct bd_tokenizer *tok;
	struct stream st;
	json_t *j, *lp;
	int V, n;

	snprintf(body, sizeof(body), "{\"prompt\": \"%s\", \"max_tokens\": 6, \"temperature\": 0,"
		 " \"ignore_eos\": true, \"logprobs\": 5}", prompt);
	up();
	j = http_json("POST", "/v1/completions", body, 200);
	lp = jget(j, "choices.0.logprobs");
	n = (int)jint(j, "usage.completion_tokens");
	cr_assert_eq(n, 6);
	cr_assert(json_is_object(lp), "no logprobs: %s", json_dumps(j, 0));
	for (const char *const *k = (const char *const[]){ "tokens", "token_logprobs",
							    "top_logprobs", "text_offset", NULL };
	     *k; k++)
		cr_assert_eq(json_array_size(json_object_get(lp, *k)), (size_t)n, "%s", *k);
	for (int i = 0; i < n; i++) {
		json_t *top = json_array_get(json_object_get(lp, "top_logprobs"), (size_t)i);
		const char *t = json_string_value(json_array_get(json_object_get(lp, "tokens"),
								 (size_t)i));
		double v[6];
		size_t m = 0;
		const char *key;
		json_t *x;

		cr_assert(t);
		cr_expect_eq(jint(lp, (snprintf(what, sizeof(what), "text_offset.%d", i), what)),
			     (json_int_t)strlen(joined), "the offset of token %d", i);
		strncat(joined, t, sizeof(joined) - strlen(joined) - 1);
		cr_expect(json_object_size(top) >= 5 && json_object_size(top) <= 6,
			  "step %d: %zu top entries", i, json_object_size(top));
		json_object_foreach(top, key, x)
			if (m < 6)
				v[m++] = json_number_value(x);
		cr_expect(json_object_get(top, t), "step %d: the sampled token is among the top", i);
		snprintf(what, sizeof(what), "token_logprobs.%d", i);
		expect_step(jnum(lp, what), v, m, what);
	}
	cr_expect_str_eq(joined, jstr(j, "choices.0.text"), "the tokens put together");

	/* the model's own distribution at the first step */
	float *lg = model_logits(prompt, &V, &tok);
	int32_t ids[5];
	double worst = 0;

	cr_assert_eq(bd_sampler_top(lg, V, 5, ids), 5);
	for (int k = 0; k < 5; k++) {
		const char *b;
		size_t bl;
		char piece[256];
		json_t *x;

		cr_assert_eq(bd_tokenizer_token_bytes(tok, ids[k], &b, &bl), 0);
		snprintf(piece, sizeof(piece), "%.*s", (int)bl, b);
		x = json_object_get(json_array_get(json_object_get(lp, "top_logprobs"), 0), piece);
		cr_expect(json_is_number(x), "the model's #%d token '%s' is not in the top: %s", k,
			  piece, json_dumps(jget(lp, "top_logprobs.0"), 0));
		if (!x)
			continue;
		double d = fabs(json_number_value(x) - ref_logprob(lg, V, ids[k]));
		worst = d > worst ? d : worst;
		cr_expect_leq(d, LOGPROB_TOL, "'%s': served %f, the model's %f", piece,
			      json_number_value(x), ref_logprob(lg, V, ids[k]));
	}
	cr_expect_leq(fabs(jnum(lp, "token_logprobs.0") - ref_logprob(lg, V, ids[0])), LOGPROB_TOL);
	fprintf(stderr, "http: first-token logprobs vs the single-process model: worst %.5f\n",
		worst);
	free(lg);
	bd_tokenizer_free(tok);

	snprintf(body, sizeof(body), "{\"prompt\": \"%s\", \"max_tokens\": 6, \"temperature\": 0,"
		 " \"ignore_eos\": true, \"logprobs\": 5, \"stream\": true}", prompt);
	cr_assert_eq(http("POST", "/v1/completions", body, &out), 200, "%s", out);
	parse_sse(out, false, &st);
	free(out);
	cr_assert(st.lp, "the stream carries no logprobs");
	cr_expect(json_equal(json_object_get(st.lp, "tokens"), json_object_get(lp, "tokens")));
	cr_expect(json_equal(json_object_get(st.lp, "text_offset"),
			     json_object_get(lp, "text_offset")));
	for (int i = 0; i < n; i++) {
		snprintf(what, sizeof(what), "token_logprobs.%d", i);
		cr_expect_float_eq(jnum(st.lp, what), jnum(lp, what), 1e-4, "%s", what);
	}
	json_decref(st.lp);
	json_decref(j);
}

/* Chat with logprobs and top_logprobs = 3 (curl), not streamed and streamed: one content entry
 * per generated token, its bytes those of its token, its top 3 most likely first with the
 * greedy token first; top_logprobs 0 gives the tokens alone. */
Test(http, chat_logprobs_streamed_and_not)
{
	static const char *msgs = "\"messages\": [{\"role\": \"user\", \"content\": \"Name three "
				  "colors.\"}], \"max_tokens\": 8, \"temperature\": 0, "
				  "\"ignore_eos\": true, \"logprobs\": true";
	char body[512], *out;
	struct stream st;
	json_t *j, *c;
	size_t i, n;

	up();
	snprintf(body, sizeof(body), "{%s, \"top_logprobs\": 3}", msgs);
	j = http_json("POST", "/v1/chat/completions", body, 200);
	c = jget(j, "choices.0.logprobs.content");
	n = (size_t)jint(j, "usage.completion_tokens");
	cr_assert_eq(json_array_size(c), n, "%s", json_dumps(j, 0));
	for (i = 0; i < n; i++) {
		json_t *e = json_array_get(c, i), *top = json_object_get(e, "top_logprobs"), *b;
		const char *t = jstr(e, "token");
		double v[3];
		char bytes[256];
		size_t k, nb = 0;

		cr_assert_eq(json_array_size(top), 3, "entry %zu", i);
		for (k = 0; k < 3; k++) {
			v[k] = jnum(json_array_get(top, k), "logprob");
			if (k)
				cr_expect_geq(v[k - 1], v[k], "entry %zu: most likely first", i);
		}
		cr_expect_str_eq(jstr(json_array_get(top, 0), "token"), t, "greedy: entry %zu", i);
		expect_step(jnum(e, "logprob"), v, 3, "chat");
		json_array_foreach(json_object_get(e, "bytes"), k, b) {
			cr_assert(json_integer_value(b) >= 0 && json_integer_value(b) < 256);
			if (nb < sizeof(bytes) - 1)
				bytes[nb++] = (char)json_integer_value(b);
		}
		bytes[nb] = 0;
		if (strncmp(t, "bytes:", 6))
			cr_expect_str_eq(bytes, t, "entry %zu: bytes and token differ", i);
	}
	snprintf(body, sizeof(body), "{%s, \"top_logprobs\": 3, \"stream\": true}", msgs);
	cr_assert_eq(http("POST", "/v1/chat/completions", body, &out), 200, "%s", out);
	parse_sse(out, true, &st);
	free(out);
	cr_assert(st.lp, "the stream carries no logprobs");
	cr_assert_eq(json_array_size(json_object_get(st.lp, "content")), n);
	for (i = 0; i < n; i++) {
		json_t *a = json_array_get(json_object_get(st.lp, "content"), i),
		       *b = json_array_get(c, i);

		cr_expect_str_eq(jstr(a, "token"), jstr(b, "token"), "entry %zu", i);
		cr_expect_float_eq(jnum(a, "logprob"), jnum(b, "logprob"), 1e-4, "entry %zu", i);
	}
	json_decref(st.lp);
	json_decref(j);

	snprintf(body, sizeof(body), "{%s, \"max_tokens\": 2}", msgs);
	j = http_json("POST", "/v1/chat/completions", body, 200);
	c = jget(j, "choices.0.logprobs.content");
	cr_assert_eq(json_array_size(c), 2);
	cr_expect_eq(json_array_size(jget(c, "0.top_logprobs")), 0);
	cr_expect_leq(jnum(c, "0.logprob"), 0.0);
	json_decref(j);
	cr_expect(sv_pool_idle(&E, WAIT_MS));
}

/* A JSON line of `bdfp4 client --json` without what names the connection and the times. */
static json_t *client_line(const char *line)
{
	json_t *j = parse(line), *u;

	json_object_del(j, "tag");
	json_object_del(j, "request_id");
	if ((u = json_object_get(j, "usage")))
		for (const char *const *k = (const char *const[]){ "queue_us", "ttft_us", "total_us",
								    NULL };
		     *k; k++)
			json_object_del(u, *k);
	return j;
}

/* The C client and the Python client (clients/python/) print the same for the same greedy
 * request with --logprobs 3: the text and the table of log-probabilities byte for byte, and
 * the same JSON lines (streamed and not) but for the tag, the request id and the times. */
Test(http, c_and_python_clients_print_the_same)
{
	const char *py = getenv("BD_PYTHON");
	static const char *const modes[] = { "", "--json", "--json --no-stream" };
	static char a[65536], b[65536];
	char cmd[3 * PATH_MAX + 256];

	if (!py || !*py)
		py = access("/usr/bin/python3", X_OK) == 0 ? "/usr/bin/python3" : "python3";
	up();
	for (size_t m = 0; m < sizeof(modes) / sizeof(modes[0]); m++) {
		snprintf(cmd, sizeof(cmd), "%s/bdfp4 client --router %s --raw --max-tokens 6 "
			 "--logprobs 3 %s 'The capital of France is'", E.bin, E.front_ep, modes[m]);
		cr_assert_eq(sv_run_output(cmd, a, sizeof(a)), 0, "%s: %s", cmd, a);
		snprintf(cmd, sizeof(cmd), "%s %s/clients/python/bdfp4_client.py --router %s "
			 "--out-dir %s --raw --max-tokens 6 --logprobs 3 %s 'The capital of France "
			 "is'", py, E.root, E.front_ep, E.dir, modes[m]);
		cr_assert_eq(sv_run_output(cmd, b, sizeof(b)), 0, "%s: %s", cmd, b);
		if (!*modes[m]) {
			cr_expect_str_eq(a, b, "text mode differs");
			cr_expect(strchr(a, '\t'), "no log-probability lines in '%s'", a);
			continue;
		}
		char *sa = NULL, *sb = NULL, *la = strtok_r(a, "\n", &sa), *lb = strtok_r(b, "\n", &sb);
		int lines = 0;

		for (; la && lb; la = strtok_r(NULL, "\n", &sa), lb = strtok_r(NULL, "\n", &sb)) {
			json_t *ja = client_line(la), *jb = client_line(lb);

			cr_expect(json_equal(ja, jb), "%s: line %d differs:\n  C:      %s\n  Python: %s",
				  modes[m], lines, la, lb);
			cr_expect(json_is_array(json_object_get(ja, "logprobs")), "%s", la);
			json_decref(ja);
			json_decref(jb);
			lines++;
		}
		cr_expect(!la && !lb, "%s: the line counts differ", modes[m]);
		cr_expect_eq(lines, m == 1 ? 6 : 1, "%s: %d lines", modes[m], lines);
	}
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
		char *o = td_read_file(cmd, NULL);

		cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "openai_check.py failed:\n%s",
			  o ? o : "");
		free(o);
	}
}
