/* client.c — `bdfp4 client`: send a prompt to the router and stream the answer, or
 * ask it for its health and server info. Talks serve.proto through lib/serve/bd_client.h. */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "base/bd_ipc.h"
#include "model/bd_utf8.h"
#include "serve/bd_client.h"
#include "cli.h"

static void usage(FILE *f)
{
	fprintf(f,
		"usage: bdfp4 client [OPTIONS] PROMPT\n"
		"       bdfp4 client [OPTIONS] --health | --info\n"
		"\n"
		"Send PROMPT to the router (as a chat user turn) and stream the answer.\n"
		"PROMPT - reads it from stdin, @FILE from FILE.\n"
		"\n"
		"  --router ADDR      router endpoint (default: $BD_ROUTER, else " BD_CLIENT_DEFAULT_ENDPOINT
		")\n"
		"  --json             one JSON object per line: each chunk, then the final one\n"
		"  --raw              send PROMPT as plain text, without the chat template\n"
		"  --system TEXT      a system message before the user turn\n"
		"  --kv CONFIG        KV configuration (default: the server's)\n");
	cli_gen_usage(f, BD_CLIENT_MAX_STOPS, "the router picks one");
	fprintf(f,
		"  --no-stream        one reply at the end instead of a chunk per token\n"
		"  --logprobs N       each token's log-probability and the N (0-%d) most likely\n"
		"                     (natural log of the model's distribution; after the text, one\n"
		"                     line per token: id, logprob, piece, then id:logprob of each)\n"
		"  --deadline-ms N    the request's deadline at the router (default: the router's)\n"
		"  --timeout-ms N     give up when the router is silent this long (default 30000)\n"
		"  --wait-ready SEC   first wait up to SEC seconds for the router to be serving\n"
		"  --stats            print token counts, time to first token and speed to stderr\n"
		"  --health           print the router's health (exit 0 when serving) and exit\n"
		"  --info             print the router's server info and exit\n"
		"  --server-key FILE  the router's CURVE public key (default: $BDFP4_SERVER_KEY)\n"
		"  --secret-key FILE  this client's CURVE secret key (default: $BDFP4_SECRET_KEY;\n"
		"                     bdfp4 keygen makes a pair); both set: the connection is CURVE\n"
		"  -h, --help         this text\n",
		BD_CLIENT_MAX_TOP_LOGPROBS);
}

static const char *state_name(int s)
{
	static const char *const n[] = { "starting", "serving", "degraded", "stopping" };

	return s >= 0 && s < 4 ? n[s] : "unknown";
}

static int print_json(json_t *o)
{
	char *s = json_dumps(o, JSON_COMPACT | JSON_ENSURE_ASCII | JSON_REAL_PRECISION(9));

	json_decref(o);
	if (!s)
		return -ENOMEM;
	puts(s);
	free(s);
	fflush(stdout);
	return 0;
}

/* The endpoint the client talks to, for messages that say whom it waited for. */
static const char *g_router = BD_CLIENT_DEFAULT_ENDPOINT;

/* What the -errno e of a call on c means: the refused handshake's own message, else
 * strerror. */
static const char *client_err(const struct bd_client *c, int e)
{
	return (e == -EACCES || e == -EPROTO) && *bd_client_error(c) ? bd_client_error(c)
								    : strerror(-e);
}

static int do_health(struct bd_client *c, int timeout_ms, bool json)
{
	struct bd_client_health h;
	int e = bd_client_health(c, timeout_ms, &h);

	if (e < 0) {
		if (e == -ETIMEDOUT)
			fprintf(stderr, "bdfp4 client: health: no answer from a router at %s in %d ms "
				"(is routerd running there? --router ADDR)\n", g_router, timeout_ms);
		else
			fprintf(stderr, "bdfp4 client: health: %s\n", client_err(c, e));
		return 1;
	}
	if (json) {
		json_t *ws = json_array();

		for (size_t i = 0; i < h.n_workers; i++)
			json_array_append_new(
				ws, json_pack("{s:i, s:i, s:b, s:I, s:I}", "rank", h.workers[i].rank,
					      "pid", h.workers[i].pid, "alive", h.workers[i].alive,
					      "last_heartbeat_ms",
					      (json_int_t)h.workers[i].last_heartbeat_ms, "steps",
					      (json_int_t)h.workers[i].steps));
		print_json(json_pack("{s:b, s:s, s:s, s:o, s:{s:b, s:s, s:I}}", "healthy",
				     h.healthy, "state", state_name(h.state), "reason", h.reason,
				     "workers", ws, "pool", "ok", h.pool_ok, "error", h.pool_error,
				     "last_ok_ms", (json_int_t)h.pool_last_ok_ms));
	} else {
		printf("%s%s%s\n", state_name(h.state), *h.reason ? ": " : "", h.reason);
		printf("  kvpoold: %s%s%s, last answer %llu ms ago\n",
		       h.pool_ok ? "answering" : "unreachable", *h.pool_error ? ": " : "",
		       h.pool_error, (unsigned long long)h.pool_last_ok_ms);
		for (size_t i = 0; i < h.n_workers; i++)
			printf("  rank %d: %s, pid %d, last heartbeat %llu ms ago, %llu steps\n",
			       h.workers[i].rank, h.workers[i].alive ? "alive" : "absent",
			       h.workers[i].pid, (unsigned long long)h.workers[i].last_heartbeat_ms,
			       (unsigned long long)h.workers[i].steps);
	}
	return h.healthy ? 0 : 1;
}

static int do_info(struct bd_client *c, int timeout_ms, bool json)
{
	struct bd_client_info s;
	int e = bd_client_info(c, timeout_ms, &s);

	if (e < 0) {
		fprintf(stderr, "bdfp4 client: info: %s\n",
			e == -ETIMEDOUT ? "no answer from the router (is routerd running? --router ADDR)"
					: client_err(c, e));
		return 1;
	}
	if (json) {
		print_json(json_pack(
			"{s:s, s:s, s:s, s:i, s:i, s:s, s:i, s:s, s:i, s:i, s:i, s:i, s:I, s:I, "
			"s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:b, s:s}",
			"version", s.version, "model", s.model, "arch", s.arch, "n_vocab",
			(int)s.n_vocab, "n_ctx", (int)s.n_ctx, "kv_config", s.kv_config, "tp",
			(int)s.tp, "backend", s.backend, "max_batch", (int)s.max_batch, "max_queue",
			(int)s.max_queue, "queued", (int)s.queued, "running", (int)s.running,
			"requests_total", (json_int_t)s.requests_total, "requests_failed",
			(json_int_t)s.requests_failed, "tokens_generated",
			(json_int_t)s.tokens_generated, "steps", (json_int_t)s.steps, "pages_total",
			(json_int_t)s.pages_total, "pages_free", (json_int_t)s.pages_free,
			"pages_peak", (json_int_t)s.pages_peak, "slots_total",
			(json_int_t)s.slots_total, "slots_free", (json_int_t)s.slots_free,
			"uptime_ms", (json_int_t)s.uptime_ms, "healthy", s.healthy,
			"decode_kernel", s.decode_kernel));
		return 0;
	}
	printf("router %s: %s (%s, vocabulary %u, context %u), tp %u, %s backend, kv %s\n",
	       s.version, s.model, s.arch, s.n_vocab, s.n_ctx, s.tp, s.backend, s.kv_config);
	printf("  %s; %u running, %u queued (max batch %u, max queue %u)\n",
	       s.healthy ? "serving" : "not serving", s.running, s.queued, s.max_batch,
	       s.max_queue);
	printf("  %llu requests (%llu failed), %llu tokens, %llu steps, %llu preemptions, up %.1f s\n",
	       (unsigned long long)s.requests_total, (unsigned long long)s.requests_failed,
	       (unsigned long long)s.tokens_generated, (unsigned long long)s.steps,
	       (unsigned long long)s.preemptions, (double)s.uptime_ms / 1000.0);
	printf("  pool: %llu/%llu pages free (router peak %llu held), %llu/%llu slots free\n",
	       (unsigned long long)s.pages_free, (unsigned long long)s.pages_total,
	       (unsigned long long)s.pages_peak, (unsigned long long)s.slots_free,
	       (unsigned long long)s.slots_total);
	if (*s.decode_kernel)
		printf("  decode kernel: %s\n", s.decode_kernel);
	return 0;
}

/* Polls health until serving or wait_s passes. */
/* The prompt argument: "-" is stdin, "@FILE" the file's text, anything else itself. Returns
 * a malloc'ed string, or NULL after printing why. */
static char *read_prompt(const char *arg)
{
	FILE *f = stdin;
	char *buf = NULL;
	size_t len = 0, n;
	char chunk[4096];

	if (strcmp(arg, "-") && arg[0] != '@')
		return strdup(arg);
	if (arg[0] == '@' && !(f = fopen(arg + 1, "r"))) {
		fprintf(stderr, "bdfp4 client: %s: %s\n", arg + 1, strerror(errno));
		return NULL;
	}
	while ((n = fread(chunk, 1, sizeof(chunk), f)) > 0) {
		char *b = realloc(buf, len + n + 1);

		if (!b) {
			free(buf);
			buf = NULL;
			break;
		}
		buf = b;
		memcpy(buf + len, chunk, n);
		len += n;
	}
	if (ferror(f) || !buf) {
		fprintf(stderr, "bdfp4 client: %s: %s\n", f == stdin ? "stdin" : arg + 1,
			buf ? strerror(errno) : "empty or unreadable");
		free(buf);
		buf = NULL;
	} else {
		buf[len] = 0;
	}
	if (f != stdin)
		fclose(f);
	return buf;
}

static void free_str(char **p)
{
	free(*p);
}

static int wait_ready(struct bd_client *c, long wait_s)
{
	double end = bd_now_s() + (double)wait_s;
	struct bd_client_health h = { 0 };

	do {
		int e = bd_client_health(c, 1000, &h);

		if (e == 0 && h.healthy)
			return 0;
		if (e == -EACCES || e == -EPROTO) { /* waiting cannot help */
			fprintf(stderr, "bdfp4 client: %s\n", client_err(c, e));
			return 1;
		}
		usleep(200000);
	} while (bd_now_s() < end);
	fprintf(stderr, "bdfp4 client: the router is not serving after %ld s%s%s\n", wait_s,
		*h.reason ? ": " : "", h.reason);
	return 1;
}

/* A token's piece as a JSON string (bd_utf8_or_bytes's form). */
static json_t *piece_json(const struct bd_client_logprob *l)
{
	char buf[4 * 256 + 8];

	return json_string(bd_utf8_or_bytes(l->piece, l->piece_len, buf, sizeof(buf)));
}

static json_t *logprob_json(const struct bd_client_logprob *l)
{
	return json_pack("{s:i, s:o, s:f}", "token", l->token, "piece", piece_json(l), "logprob",
			 (double)l->logprob);
}

/* The event's log-probabilities: [{token, piece, logprob, top: [{token, piece, logprob}]}]. */
static json_t *logprobs_json(const struct bd_client_event *ev)
{
	json_t *a = json_array();

	for (size_t i = 0; i < ev->n_tokens; i++) {
		const struct bd_client_logprob *row = ev->logprobs + i * (1 + ev->n_top_logprobs);
		json_t *e = logprob_json(&row[0]), *top = json_array();

		for (size_t k = 0; k < ev->n_top_logprobs && row[1 + k].token >= 0; k++)
			json_array_append_new(top, logprob_json(&row[1 + k]));
		json_object_set_new(e, "top", top);
		json_array_append_new(a, e);
	}
	return a;
}

/* Text mode: one line per token, "ID<TAB>LOGPROB<TAB>PIECE" (PIECE as a JSON string), then
 * "<TAB>ID:LOGPROB" for each of the most likely. */
static void print_logprobs(FILE *f, const struct bd_client_event *ev)
{
	for (size_t i = 0; i < ev->n_tokens; i++) {
		const struct bd_client_logprob *row = ev->logprobs + i * (1 + ev->n_top_logprobs);
		json_t *p = piece_json(&row[0]);
		char *ps = json_dumps(p, JSON_ENCODE_ANY | JSON_ENSURE_ASCII);

		fprintf(f, "%d\t%.4f\t%s", row[0].token, (double)row[0].logprob, ps ? ps : "\"\"");
		for (size_t k = 0; k < ev->n_top_logprobs && row[1 + k].token >= 0; k++)
			fprintf(f, "\t%d:%.4f", row[1 + k].token, (double)row[1 + k].logprob);
		fputc('\n', f);
		free(ps);
		json_decref(p);
	}
}

static json_t *chunk_json(const struct bd_client_event *ev)
{
	json_t *o = json_object(), *toks = json_array();

	for (size_t i = 0; i < ev->n_tokens; i++)
		json_array_append_new(toks, json_integer(ev->tokens[i]));
	json_object_set_new(o, "tag", json_integer((json_int_t)ev->tag));
	json_object_set_new(o, "request_id", json_integer((json_int_t)ev->request_id));
	json_object_set_new(o, "tokens", toks);
	json_object_set_new(o, "text", json_stringn(ev->text, ev->text_len));
	json_object_set_new(o, "finish", json_string(bd_finish_name(ev->finish)));
	if (ev->error)
		json_object_set_new(o, "error", json_string(bd_serve_error_name(ev->error)));
	if (*ev->message)
		json_object_set_new(o, "message", json_string(ev->message));
	if (ev->logprobs)
		json_object_set_new(o, "logprobs", logprobs_json(ev));
	if (ev->has_usage)
		json_object_set_new(
			o, "usage",
			json_pack("{s:i, s:i, s:I, s:I, s:I, s:i}", "prompt_tokens",
				  (int)ev->usage.prompt_tokens, "completion_tokens",
				  (int)ev->usage.completion_tokens, "queue_us",
				  (json_int_t)ev->usage.queue_us, "ttft_us",
				  (json_int_t)ev->usage.ttft_us, "total_us",
				  (json_int_t)ev->usage.total_us, "preemptions",
				  (int)ev->usage.preemptions));
	return o;
}

int cmd_client(int argc, char **argv)
{
	enum {
		O_ROUTER = 256, O_JSON, O_RAW, O_SYSTEM, O_KV, O_NOSTREAM,
		O_DEADLINE, O_TIMEOUT, O_WAIT, O_STATS, O_HEALTH, O_INFO, O_SRVKEY, O_SECKEY,
		O_LOGPROBS
	};
	static const struct option opts[] = {
		{ "router", required_argument, NULL, O_ROUTER },
		{ "json", no_argument, NULL, O_JSON },
		{ "raw", no_argument, NULL, O_RAW },
		{ "system", required_argument, NULL, O_SYSTEM },
		CLI_OPTS_GENERATION,
		{ "kv", required_argument, NULL, O_KV },
		{ "no-stream", no_argument, NULL, O_NOSTREAM },
		{ "logprobs", required_argument, NULL, O_LOGPROBS },
		{ "deadline-ms", required_argument, NULL, O_DEADLINE },
		{ "timeout-ms", required_argument, NULL, O_TIMEOUT },
		{ "wait-ready", required_argument, NULL, O_WAIT },
		{ "stats", no_argument, NULL, O_STATS },
		{ "health", no_argument, NULL, O_HEALTH },
		{ "info", no_argument, NULL, O_INFO },
		{ "server-key", required_argument, NULL, O_SRVKEY },
		{ "secret-key", required_argument, NULL, O_SECKEY },
		CLI_OPTS_END,
	};
	char *prompt __attribute__((cleanup(free_str))) = NULL;
	const char *router = getenv("BD_ROUTER"), *system_msg = NULL, *bad;
	struct bd_client_gen g = { .stream = true, .chat = true };
	struct bd_client_msg msgs[2];
	bool json = false, stats = false, health = false, info = false, done = false;
	struct cli_gen_opts gen;
	int deadline_ms = 0, timeout_ms = 30000, wait_s = 0, logprobs = -1;
	const struct cli_int_opt ints[] = {
		{ O_DEADLINE, 1, INT_MAX, &deadline_ms,
		  "--deadline-ms wants an integer >= 1, not '%s'" },
		{ O_TIMEOUT, 1, INT_MAX, &timeout_ms,
		  "--timeout-ms wants an integer >= 1, not '%s'" },
		{ O_WAIT, 0, 86400, &wait_s, "--wait-ready wants seconds, not '%s'" },
		{ O_LOGPROBS, 0, BD_CLIENT_MAX_TOP_LOGPROBS, &logprobs,
		  "--logprobs wants an integer in [0, 20], not '%s'" },
	};
	struct bd_client *c = NULL;
	struct bd_client_opts copts = { NULL, NULL };
	struct bd_client_event ev;
	char *lp_buf = NULL;
	size_t lp_len = 0;
	FILE *lp_f = NULL;
	uint64_t tag;
	double t0, t_first = 0;
	size_t n_tokens = 0;
	int opt, k, e, rc = 1;

	cli_gen_init(&gen, &g.sampling, BD_CLIENT_MAX_STOPS);
	if (!router || !*router)
		router = BD_CLIENT_DEFAULT_ENDPOINT;
	optind = 0;
	opterr = 0;
	while ((opt = getopt_long(argc, argv, ":h", opts, NULL)) != -1) {
		if ((k = cli_int_opt(ints, sizeof(ints) / sizeof(ints[0]), opt, optarg, &bad)) < 0)
			return cli_bad_usage("client", usage, bad, optarg);
		if (k > 0 || (k = cli_gen_opt("client", usage, opt, optarg, &gen)) == 1)
			continue;
		if (k == 2)
			return 2;
		switch (opt) {
		case O_ROUTER:
			router = optarg;
			break;
		case O_JSON:
			json = true;
			break;
		case O_RAW:
			g.chat = false;
			break;
		case O_SYSTEM:
			system_msg = optarg;
			break;
		case O_KV:
			g.kv_config = optarg;
			break;
		case O_NOSTREAM:
			g.stream = false;
			break;
		case O_STATS:
			stats = true;
			break;
		case O_HEALTH:
			health = true;
			break;
		case O_INFO:
			info = true;
			break;
		case O_SRVKEY:
			copts.server_key_file = optarg;
			break;
		case O_SECKEY:
			copts.secret_key_file = optarg;
			break;
		default:
			return cli_getopt_other("client", usage, opt, argv);
		}
	}
	if (!health && !info && (bad = cli_prompt_bad(argc - optind)))
		return cli_bad_usage("client", usage, bad, "");
	if ((health || info) && optind != argc)
		return cli_bad_usage("client", usage, "--health and --info take no PROMPT%s",
				     "");
	if (!health && !info && !(prompt = read_prompt(argv[optind])))
		return 1;
	g.stops = gen.stops;
	g.n_stops = (size_t)gen.n_stops;
	g.max_tokens = (uint32_t)gen.max_tokens;
	g.logprobs = logprobs >= 0;
	g.top_logprobs = logprobs > 0 ? (uint32_t)logprobs : 0;
	g.deadline_ms = (uint32_t)deadline_ms;

	g_router = router;
	/* a router that is not there fails now, not after the timeout (--wait-ready waits) */
	e = wait_s ? 0 : bd_ipc_endpoint_check(router, 2000);
	if (e < 0) {
		fprintf(stderr, "bdfp4 client: %s: %s%s\n", router,
			e == -ENOENT ? "no such socket" : strerror(-e),
			e == -EACCES ? "" : " (is the router running? bdfp4 serve starts one)");
		return 1;
	}
	{
		char kerr[512] = "";

		e = bd_client_new_opts(router, &copts, &c, kerr, sizeof(kerr));
		if (e < 0) {
			fprintf(stderr, "bdfp4 client: %s: %s\n", router, *kerr ? kerr : strerror(-e));
			return 1;
		}
	}
	if (wait_s && wait_ready(c, wait_s)) {
		bd_client_free(c);
		return 1;
	}
	if (health || info) {
		rc = health ? do_health(c, timeout_ms, json) : do_info(c, timeout_ms, json);
		bd_client_free(c);
		return rc;
	}
	if (system_msg) {
		msgs[0] = (struct bd_client_msg){ "system", system_msg };
		msgs[1] = (struct bd_client_msg){ "user", prompt };
		g.messages = msgs;
		g.n_messages = 2;
	} else {
		g.prompt = prompt;
	}
	if (g.logprobs && !json && !(lp_f = open_memstream(&lp_buf, &lp_len))) {
		fprintf(stderr, "bdfp4 client: %s\n", strerror(errno));
		bd_client_free(c);
		return 1;
	}
	t0 = bd_now_s();
	e = bd_client_generate_start(c, &g, &tag);
	if (e < 0) {
		fprintf(stderr, "bdfp4 client: %s\n",
			e == -EMSGSIZE ? "the request is over the protocol's size limits"
				       : strerror(-e));
		bd_client_free(c);
		if (lp_f)
			fclose(lp_f);
		free(lp_buf);
		return 1;
	}
	while (!done) {
		e = bd_client_next(c, timeout_ms, &ev);
		if (e < 0) {
			if (e == -ETIMEDOUT)
				fprintf(stderr, "\nbdfp4 client: no answer from the router at %s for "
					"%ld ms (is routerd running there? --router ADDR)\n", g_router,
					(long)timeout_ms);
			else
				fprintf(stderr, "\nbdfp4 client: %s\n", client_err(c, e));
			break;
		}
		if (ev.tag != tag)
			continue;
		if (ev.kind == BD_CLIENT_ERROR) {
			if (json)
				print_json(json_pack("{s:I, s:s, s:s, s:s}", "tag", (json_int_t)tag,
						     "finish", "error", "error",
						     bd_serve_error_name(ev.error), "message",
						     ev.message));
			fprintf(stderr, "bdfp4 client: refused (%s): %s\n",
				bd_serve_error_name(ev.error), ev.message);
			break;
		}
		if (ev.kind != BD_CLIENT_CHUNK)
			continue;
		if (ev.n_tokens && !t_first)
			t_first = bd_now_s();
		n_tokens += ev.n_tokens;
		if (json) {
			print_json(chunk_json(&ev));
		} else {
			fwrite(ev.text, 1, ev.text_len, stdout);
			fflush(stdout);
			/* the table follows the text: kept until the end */
			if (ev.logprobs && lp_f)
				print_logprobs(lp_f, &ev);
		}
		if (ev.finish == BD_FINISH_NONE)
			continue;
		done = true;
		if (!json)
			fputc('\n', stdout);
		if (lp_f && fflush(lp_f) == 0)
			fwrite(lp_buf, 1, lp_len, stdout);
		fflush(stdout);
		if (ev.finish == BD_FINISH_ERROR || ev.finish == BD_FINISH_CANCELLED) {
			fprintf(stderr, "bdfp4 client: %s (%s): %s\n", bd_finish_name(ev.finish),
				bd_serve_error_name(ev.error), ev.message);
			break;
		}
		rc = 0;
		if (stats && ev.has_usage) {
			double total = bd_now_s() - t0;

			fprintf(stderr,
				"[stats] %u prompt + %u generated tokens (%s); first token %.3f s, "
				"total %.3f s",
				ev.usage.prompt_tokens, ev.usage.completion_tokens,
				bd_finish_name(ev.finish), (double)ev.usage.ttft_us / 1e6, total);
			if (n_tokens > 1 && total > (t_first - t0) && t_first > 0)
				fprintf(stderr, ", %.2f tokens/s after the first",
					(double)(n_tokens - 1) / (total - (t_first - t0)));
			fputc('\n', stderr);
		}
	}
	bd_client_free(c);
	if (lp_f)
		fclose(lp_f);
	free(lp_buf);
	return rc;
}
