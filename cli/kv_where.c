/* kv_where.c — `bdfp4 kv-where`: which of several bdfp4 stacks holds a prompt's KV pages.
 *
 * Each stack's kvpoold publishes its prefix cache as vLLM's KV events (kvpoold/kvpool.h "KV
 * events") and keeps its last batches for a replay endpoint. This replays every stack's kept
 * batches, hashes the prompt's full pages as the router does (pool/bd_prefix.h, the one owner
 * of the chain) and reports, per stack, how many of the prompt's leading pages its events say
 * are held: the pages a request of that prompt would read from cache there. It is the view a
 * KV-aware router (Dynamo, llm-d) builds from the same streams, for an operator. */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>
#include <msgpack.h>
#include <zmq.h>

#include "formats/bd_gguf.h"
#include "model/bd_tokenizer.h"
#include "pool/bd_prefix.h"
#include "quant/bd_calib.h"
#include "quant/bd_kvcfg.h"
#include "quant/bd_layout.h"
#include "cli.h"

#define TOOL "kv-where"
#define MAX_STREAMS 16

static void usage(FILE *f)
{
	fprintf(f,
		"usage: bdfp4 kv-where [OPTIONS] --events EP[,EP...] --prompt-file FILE\n"
		"\n"
		"Replay the KV event stream of each stack (kvpoold's kv_events_replay endpoint), hash\n"
		"the prompt's full pages of 128 tokens as the router does, and print for each stack\n"
		"how many of the prompt's leading pages it holds (a request of that prompt sent there\n"
		"reads them from cache instead of prefilling them).\n"
		"\n"
		"  --events LIST      the stacks' kv_events_replay endpoints, comma-separated\n"
		"  --prompt-file FILE the prompt (plain text, tokenized as /v1/completions does)\n"
		"  --chat             FILE is one user turn, through the model's chat template (as\n"
		"                     /v1/chat/completions)\n"
		"  --system TEXT      with --chat: a system message before the user turn\n"
		"  --model FILE       the GGUF the routers serve (default: $BD_MODEL, else the\n"
		"                     embedded model); its tokenizer, and its file name names the pages\n"
		"  --kv CONFIG        the pools' and the requests' KV configuration (default\n"
		"                     bitdecoding-nvfp4)\n"
		"  --calib FILE       the workers' calibration file (default: none)\n"
		"  --salt TEXT        the requests' cache_salt (default: none)\n"
		"  --timeout-ms N     wait this long for each replay (default 5000)\n"
		"  --json             one JSON object instead of the table\n"
		"  -h, --help         this text\n");
}

/* What one stream says of the prompt's pages. */
struct stream {
	const char *endpoint;
	bool *held;        /* [n_pages] page j of the prompt held */
	long blocks;       /* stored minus removed since the last clear */
	long batches;      /* replayed */
	bool cleared;      /* an AllBlocksCleared was replayed (the view starts from empty) */
	char err[256];     /* non-empty: the stream could not be read */
};

static int page_of(const uint64_t *h, int n, uint64_t x)
{
	for (int j = 0; j < n; j++)
		if (h[j] == x)
			return j;
	return -1;
}

static bool is_str(const msgpack_object *o, const char *s)
{
	return o->type == MSGPACK_OBJECT_STR && o->via.str.size == strlen(s) &&
	       memcmp(o->via.str.ptr, s, o->via.str.size) == 0;
}

/* Applies the block hashes of array o (stored: held true) to st. -EBADMSG when o is no array
 * of unsigned integers. */
static int apply_hashes(struct stream *st, const msgpack_object *o, const uint64_t *h, int n,
			bool stored)
{
	if (o->type != MSGPACK_OBJECT_ARRAY)
		return -EBADMSG;
	for (uint32_t i = 0; i < o->via.array.size; i++) {
		const msgpack_object *x = &o->via.array.ptr[i];
		int j;

		if (x->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
			return -EBADMSG;
		if ((j = page_of(h, n, x->via.u64)) >= 0)
			st->held[j] = stored;
	}
	st->blocks += stored ? (long)o->via.array.size : -(long)o->via.array.size;
	return 0;
}

/* One batch's payload, msgpack [ts, [event, ...], rank] (kvpoold/events.c), applied to st.
 * 0, or -EBADMSG for a payload in no encoding of vLLM's events. */
static int apply_batch(struct stream *st, const void *p, size_t len, const uint64_t *h, int n)
{
	msgpack_unpacked u;
	const msgpack_object *evs;
	int e = -EBADMSG;

	msgpack_unpacked_init(&u);
	if (msgpack_unpack_next(&u, p, len, NULL) != MSGPACK_UNPACK_SUCCESS ||
	    u.data.type != MSGPACK_OBJECT_ARRAY || u.data.via.array.size < 2)
		goto out;
	evs = &u.data.via.array.ptr[1];
	if (evs->type != MSGPACK_OBJECT_ARRAY)
		goto out;
	for (uint32_t i = 0; i < evs->via.array.size; i++) {
		const msgpack_object *ev = &evs->via.array.ptr[i];
		const msgpack_object *a;

		if (ev->type != MSGPACK_OBJECT_ARRAY || ev->via.array.size < 1)
			goto out;
		a = ev->via.array.ptr;
		if (is_str(&a[0], "AllBlocksCleared")) {
			memset(st->held, 0, sizeof(bool) * (size_t)n);
			st->blocks = 0;
			st->cleared = true;
		} else if (is_str(&a[0], "BlockStored") || is_str(&a[0], "BlockRemoved")) {
			if (ev->via.array.size < 2 ||
			    apply_hashes(st, &a[1], h, n, is_str(&a[0], "BlockStored")) < 0)
				goto out;
		} else {
			goto out;
		}
	}
	e = 0;
out:
	msgpack_unpacked_destroy(&u);
	return e;
}

static uint64_t be64(const uint8_t *b)
{
	uint64_t x = 0;

	for (int i = 0; i < 8; i++)
		x = x << 8 | b[i];
	return x;
}

/* Replays st->endpoint from sequence number 0 into st; on failure st->err says why. */
static void replay(void *ctx, struct stream *st, const uint64_t *h, int n, int timeout_ms)
{
	void *s = zmq_socket(ctx, ZMQ_DEALER);
	uint8_t start[8] = { 0 };
	int zero = 0;

	if (!s || zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero)) < 0 ||
	    zmq_connect(s, st->endpoint) < 0) {
		snprintf(st->err, sizeof(st->err), "%s", zmq_strerror(zmq_errno()));
		goto out;
	}
	if (zmq_send(s, "", 0, ZMQ_SNDMORE) < 0 || zmq_send(s, start, 8, 0) < 0) {
		snprintf(st->err, sizeof(st->err), "send: %s", zmq_strerror(zmq_errno()));
		goto out;
	}
	for (;;) {
		zmq_pollitem_t pi = { .socket = s, .events = ZMQ_POLLIN };
		zmq_msg_t m[3];
		int nf = 0, more = 1;
		uint64_t seq;

		if (zmq_poll(&pi, 1, timeout_ms) < 1) {
			snprintf(st->err, sizeof(st->err), "no answer in %d ms", timeout_ms);
			goto out;
		}
		/* [""][seq][payload]; a message of another shape is refused after it is read */
		while (more) {
			zmq_msg_t x;
			size_t sz = sizeof(more);

			zmq_msg_init(&x);
			if (zmq_msg_recv(&x, s, 0) < 0) {
				zmq_msg_close(&x);
				for (int i = 0; i < nf; i++)
					zmq_msg_close(&m[i]);
				snprintf(st->err, sizeof(st->err), "recv: %s",
					 zmq_strerror(zmq_errno()));
				goto out;
			}
			zmq_getsockopt(s, ZMQ_RCVMORE, &more, &sz);
			if (nf < 3) {
				m[nf++] = x;
			} else {
				zmq_msg_close(&x);
				nf = 4;
			}
		}
		if (nf != 3 || zmq_msg_size(&m[0]) != 0 || zmq_msg_size(&m[1]) != 8) {
			for (int i = 0; i < (nf < 3 ? nf : 3); i++)
				zmq_msg_close(&m[i]);
			snprintf(st->err, sizeof(st->err), "an answer that is not [\"\"][seq][batch]");
			goto out;
		}
		seq = be64(zmq_msg_data(&m[1]));
		if (seq == UINT64_MAX) { /* -1: the end of the kept batches */
			for (int i = 0; i < 3; i++)
				zmq_msg_close(&m[i]);
			break;
		}
		st->batches++;
		if (apply_batch(st, zmq_msg_data(&m[2]), zmq_msg_size(&m[2]), h, n) < 0)
			snprintf(st->err, sizeof(st->err),
				 "batch %llu is not in vLLM's KV event encoding",
				 (unsigned long long)seq);
		for (int i = 0; i < 3; i++)
			zmq_msg_close(&m[i]);
		if (st->err[0])
			goto out;
	}
out:
	if (s)
		zmq_close(s);
}

static int leading(const struct stream *st, int n)
{
	int k = 0;

	while (k < n && st->held[k])
		k++;
	return k;
}

static int count_held(const struct stream *st, int n)
{
	int c = 0;

	for (int j = 0; j < n; j++)
		c += st->held[j];
	return c;
}

/* The prompt's tokens as the router makes them (router/frontend.c: chat through the template
 * with the generation prompt, plain text with the special tokens). 0, or -1 after printing. */
static int tokenize(const char *model, const char *text, size_t len, bool chat,
		    const char *system, int32_t **ret, size_t *ret_n)
{
	char gerr[BD_GGUF_ERR_MAX] = "", terr[BD_TOKENIZER_ERR_MAX] = "";
	struct bd_gguf *g = NULL;
	struct bd_tokenizer *tok = NULL;
	int e;

	if ((e = bd_gguf_open(model, &g, gerr)) < 0) {
		fprintf(stderr, "bdfp4 " TOOL ": %s: %s\n", model, gerr[0] ? gerr : strerror(-e));
		return -1;
	}
	e = bd_tokenizer_new_from_gguf(g, &tok, terr);
	bd_gguf_free(g);
	if (e < 0) {
		fprintf(stderr, "bdfp4 " TOOL ": %s: tokenizer: %s\n", model, terr);
		return -1;
	}
	if (chat) {
		struct bd_chat_msg m[2];
		size_t nm = 0;

		if (system)
			m[nm++] = (struct bd_chat_msg){ "system", system };
		m[nm++] = (struct bd_chat_msg){ "user", text };
		e = bd_tokenizer_chat_apply(tok, m, nm, true, ret, ret_n, terr);
	} else {
		e = bd_tokenizer_encode(tok, text, len, BD_TOK_ADD_SPECIAL, ret, ret_n);
	}
	bd_tokenizer_free(tok);
	if (e < 0) {
		fprintf(stderr, "bdfp4 " TOOL ": cannot tokenize the prompt: %s\n",
			terr[0] ? terr : strerror(-e));
		return -1;
	}
	return 0;
}

static void print_json(const struct stream *st, int n_st, size_t n_tok, const uint64_t *h, int n)
{
	json_t *o = json_object(), *hs = json_array(), *ss = json_array();
	char *s;

	/* unsigned 64-bit, beyond JSON's exact integers: decimal strings */
	for (int j = 0; j < n; j++) {
		char b[24];

		snprintf(b, sizeof(b), "%llu", (unsigned long long)h[j]);
		json_array_append_new(hs, json_string(b));
	}
	for (int i = 0; i < n_st; i++) {
		json_t *x = json_pack("{s:s, s:i, s:i, s:I, s:I, s:b}", "endpoint", st[i].endpoint,
				      "leading_pages", leading(&st[i], n), "prompt_pages_held",
				      count_held(&st[i], n), "blocks", (json_int_t)st[i].blocks,
				      "batches", (json_int_t)st[i].batches, "from_empty",
				      st[i].cleared);

		json_object_set_new(x, "error", st[i].err[0] ? json_string(st[i].err) : json_null());
		json_array_append_new(ss, x);
	}
	json_object_set_new(o, "prompt_tokens", json_integer((json_int_t)n_tok));
	json_object_set_new(o, "prompt_pages", json_integer(n));
	json_object_set_new(o, "page_hashes", hs);
	json_object_set_new(o, "streams", ss);
	s = json_dumps(o, JSON_COMPACT);
	if (s)
		puts(s);
	free(s);
	json_decref(o);
}

static void print_table(const struct stream *st, int n_st, size_t n_tok, int n)
{
	printf("prompt: %zu tokens, %d full pages of %d\n", n_tok, n, BD_PAGE_TOKENS);
	printf("%-48s %8s %8s %8s %8s\n", "stream", "leading", "held", "blocks", "batches");
	for (int i = 0; i < n_st; i++) {
		if (st[i].err[0]) {
			printf("%-48s %s\n", st[i].endpoint, st[i].err);
			continue;
		}
		printf("%-48s %8d %8d %8ld %8ld%s\n", st[i].endpoint, leading(&st[i], n),
		       count_held(&st[i], n), st[i].blocks, st[i].batches,
		       st[i].cleared ? "" : "  (older batches dropped: the view may be short)");
	}
}

enum { O_EVENTS = 400, O_PROMPT, O_CHAT, O_SYSTEM, O_MODEL, O_KV, O_CALIB, O_SALT, O_TIMEOUT,
       O_JSON };

int cmd_kv_where(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "events", required_argument, NULL, O_EVENTS },
		{ "prompt-file", required_argument, NULL, O_PROMPT },
		{ "chat", no_argument, NULL, O_CHAT },
		{ "system", required_argument, NULL, O_SYSTEM },
		{ "model", required_argument, NULL, O_MODEL },
		{ "kv", required_argument, NULL, O_KV },
		{ "calib", required_argument, NULL, O_CALIB },
		{ "salt", required_argument, NULL, O_SALT },
		{ "timeout-ms", required_argument, NULL, O_TIMEOUT },
		{ "json", no_argument, NULL, O_JSON },
		CLI_OPTS_END,
	};
	const char *events = NULL, *prompt = NULL, *system = NULL, *model_opt = NULL;
	const char *kv = "bitdecoding-nvfp4", *calib = NULL, *salt = NULL;
	char model[PATH_MAX], *list = NULL, *text = NULL, *base;
	bool chat = false, json = false;
	int timeout_ms = 5000, c, n_st = 0, n = 0, rc = 1;
	struct stream st[MAX_STREAMS] = { 0 };
	const struct bd_kvcfg *cfg;
	uint64_t seed, calib_id = 0, *h = NULL;
	int32_t *toks = NULL;
	size_t n_tok = 0, len;
	void *ctx = NULL;

	optind = 0;
	opterr = 0;
	while ((c = getopt_long(argc, argv, ":h", opts, NULL)) != -1) {
		switch (c) {
		case O_EVENTS: events = optarg; break;
		case O_PROMPT: prompt = optarg; break;
		case O_CHAT: chat = true; break;
		case O_SYSTEM: system = optarg; break;
		case O_MODEL: model_opt = optarg; break;
		case O_KV: kv = optarg; break;
		case O_CALIB: calib = optarg; break;
		case O_SALT: salt = optarg; break;
		case O_JSON: json = true; break;
		case O_TIMEOUT:
			if (!cli_parse_int(optarg, 1, 3600000, &timeout_ms))
				return cli_bad_usage(TOOL, usage, "bad --timeout-ms %s", optarg);
			break;
		default: return cli_getopt_other(TOOL, usage, c, argv);
		}
	}
	if (optind != argc)
		return cli_bad_usage(TOOL, usage, "unexpected argument %s", argv[optind]);
	if (!events || !*events)
		return cli_bad_usage(TOOL, usage, "%s", "--events EP[,EP...], please");
	if (!prompt)
		return cli_bad_usage(TOOL, usage, "%s", "--prompt-file FILE, please");
	if (system && !chat)
		return cli_bad_usage(TOOL, usage, "%s", "--system goes with --chat");
	if (!(cfg = bd_kvcfg_find(kv)))
		return cli_bad_usage(TOOL, usage, "unknown KV configuration %s", kv);
	if (!(list = strdup(events)))
		goto nomem;
	for (char *save = NULL, *t = strtok_r(list, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
		t += strspn(t, " ");
		if (!*t)
			continue;
		if (n_st == MAX_STREAMS) {
			free(list);
			return cli_bad_usage(TOOL, usage, "more than 16 streams in %s", events);
		}
		st[n_st++].endpoint = t;
	}
	if (!n_st) {
		free(list);
		return cli_bad_usage(TOOL, usage, "no endpoint in --events %s", events);
	}
	if (cli_read_texts(TOOL, (char *const *)&prompt, 1, &text, &len) < 0)
		goto out;
	if (!text || !len) {
		fprintf(stderr, "bdfp4 " TOOL ": %s is empty\n", prompt);
		goto out;
	}
	if (calib) {
		uint8_t sha[BD_SHA256_BYTES];
		int e = bd_sha256_file(calib, sha);

		if (e < 0) {
			fprintf(stderr, "bdfp4 " TOOL ": %s: %s\n", calib, strerror(-e));
			goto out;
		}
		/* the router reads the workers' calibration identity big-endian (workers.c) */
		for (int i = 0; i < 8; i++)
			calib_id = calib_id << 8 | sha[i];
	}
	cli_model_path(model_opt, model, sizeof(model));
	if (tokenize(model, text, len, chat, system, &toks, &n_tok) < 0)
		goto out;
	n = (int)(n_tok / BD_PAGE_TOKENS);
	/* the router's seed: the model's file name, the pool's configuration and page format,
	 * the workers' calibration; then the request's configuration and salt */
	base = strrchr(model, '/') ? strrchr(model, '/') + 1 : model;
	seed = bd_prefix_seed(base, cfg->name, bd_page_format_name(cfg->page_fmt), calib_id);
	seed = bd_prefix_request_seed(seed, cfg->name, salt ? salt : "", salt ? strlen(salt) : 0);
	if (!(h = calloc((size_t)n + 1, sizeof(*h))))
		goto nomem;
	bd_prefix_hashes(seed, toks, n, h);
	if (!(ctx = zmq_ctx_new()))
		goto nomem;
	rc = 0;
	for (int i = 0; i < n_st; i++) {
		if (!(st[i].held = calloc((size_t)n + 1, sizeof(bool))))
			goto nomem;
		replay(ctx, &st[i], h, n, timeout_ms);
		if (st[i].err[0]) {
			fprintf(stderr, "bdfp4 " TOOL ": %s: %s\n", st[i].endpoint, st[i].err);
			rc = 1;
		}
	}
	if (json)
		print_json(st, n_st, n_tok, h, n);
	else
		print_table(st, n_st, n_tok, n);
	goto out;
nomem:
	fprintf(stderr, "bdfp4 " TOOL ": out of memory\n");
	rc = 1;
out:
	for (int i = 0; i < n_st; i++)
		free(st[i].held);
	if (ctx)
		zmq_ctx_term(ctx);
	free(h);
	free(toks);
	free(text);
	free(list);
	return rc;
}
