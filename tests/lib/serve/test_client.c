/* test_client.c — lib/serve/client.c (bd_client.h) against a fake router: a ZeroMQ ROUTER socket in
 * this test that decodes what the client sends and answers by hand. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <zmq.h>

#include "serve/bd_client.h"
#include "serve.pb-c.h"

static struct {
	char dir[40], ep[96];
	void *ctx, *router;
} T;

static void init(void)
{
	int zero = 0;

	snprintf(T.dir, sizeof(T.dir), "/tmp/bdfp4-client-XXXXXX");
	cr_assert_not_null(mkdtemp(T.dir));
	snprintf(T.ep, sizeof(T.ep), "ipc://%s/r.sock", T.dir);
	T.ctx = zmq_ctx_new();
	T.router = zmq_socket(T.ctx, ZMQ_ROUTER);
	zmq_setsockopt(T.router, ZMQ_LINGER, &zero, sizeof(zero));
	cr_assert_eq(zmq_bind(T.router, T.ep), 0);
}

static void fini(void)
{
	char cmd[96];

	zmq_close(T.router);
	zmq_ctx_term(T.ctx);
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", T.dir);
	if (system(cmd) != 0)
		fprintf(stderr, "could not remove %s\n", T.dir);
}

TestSuite(client, .init = init, .fini = fini, .timeout = 30);

/* Receives one client frame: its routing id into ident, the decoded request as return. */
static Bdfp4__ClientRequest *fake_recv(uint8_t *ident, size_t *ident_len)
{
	zmq_msg_t id, body;
	Bdfp4__ClientRequest *req;
	int tmo = 5000;

	zmq_setsockopt(T.router, ZMQ_RCVTIMEO, &tmo, sizeof(tmo));
	zmq_msg_init(&id);
	cr_assert_geq(zmq_msg_recv(&id, T.router, 0), 0, "the client sent nothing");
	*ident_len = zmq_msg_size(&id);
	memcpy(ident, zmq_msg_data(&id), *ident_len);
	cr_assert(zmq_msg_more(&id));
	zmq_msg_init(&body);
	cr_assert_geq(zmq_msg_recv(&body, T.router, 0), 0);
	cr_assert_not(zmq_msg_more(&body), "one frame per request");
	req = bdfp4__client_request__unpack(NULL, zmq_msg_size(&body), zmq_msg_data(&body));
	zmq_msg_close(&id);
	zmq_msg_close(&body);
	cr_assert_not_null(req, "the client's frame is not a ClientRequest");
	return req;
}

static void fake_send(const uint8_t *ident, size_t len, const Bdfp4__ClientReply *rep)
{
	uint8_t buf[4096];
	size_t n = bdfp4__client_reply__pack(rep, buf);

	cr_assert_leq(n, sizeof(buf));
	cr_assert_eq(zmq_send(T.router, ident, len, ZMQ_SNDMORE), (int)len);
	cr_assert_eq(zmq_send(T.router, buf, n, 0), (int)n);
}

Test(client, codes_mirror_the_proto)
{
	/* the header's enums restate serve.proto's numbers for C callers: they must not drift */
	cr_expect_eq(BD_SERVE_ERR_RESOURCE_EXHAUSTED, BDFP4__SERVE_ERROR__SERVE_ERR_RESOURCE_EXHAUSTED);
	cr_expect_eq(BD_SERVE_ERR_WORKER_FAILED, BDFP4__SERVE_ERROR__SERVE_ERR_WORKER_FAILED);
	cr_expect_eq(BD_SERVE_ERR_VERSION, BDFP4__SERVE_ERROR__SERVE_ERR_VERSION);
	cr_expect_eq(BD_SERVE_ERR_COUNT, BDFP4__SERVE_ERROR__SERVE_ERR_VERSION + 1);
	cr_expect_eq(BD_FINISH_STOP_STRING, BDFP4__FINISH_REASON__FINISH_STOP_STRING);
	cr_expect_eq(BD_FINISH_ERROR, BDFP4__FINISH_REASON__FINISH_ERROR);
	cr_expect_str_eq(bd_serve_error_name(7), "resource-exhausted");
	cr_expect_str_eq(bd_serve_error_name(-1), "unknown");
	cr_expect_str_eq(bd_serve_error_name(BD_SERVE_ERR_COUNT), "unknown");
	cr_expect_str_eq(bd_finish_name(3), "stop-string");
	cr_expect_str_eq(bd_finish_name(6), "unknown");
}

Test(client, bad_arguments_send_nothing)
{
	struct bd_client *c;
	struct bd_client_event ev;
	const char *stops[9] = { "a", "b", "c", "d", "e", "f", "g", "h", "i" };
	const char *nulls[1] = { NULL };
	struct bd_client_msg msg = { "user", NULL };
	int32_t ids[2] = { 1, 2 };
	uint64_t tag = 12345;
	char *big = malloc((64 << 10) + 2);
	zmq_pollitem_t it = { .socket = T.router, .events = ZMQ_POLLIN };

	cr_assert_eq(bd_client_new(T.ep, NULL), -EINVAL);
	cr_assert_eq(bd_client_new(T.ep, &c), 0);
	memset(big, 'a', (64 << 10) + 1);
	big[(64 << 10) + 1] = 0;
	/* each a request with one thing wrong: nothing, or two of prompt / messages / token_ids;
	 * beyond a limit of serve.proto; a NULL stop, logprobs or message content */
	const struct {
		struct bd_client_gen g;
		int want;
		const char *what;
	} bad[] = {
		{ { .max_tokens = 4 }, -EINVAL, "no prompt" },
		{ { .max_tokens = 4, .prompt = "x", .token_ids = ids, .n_token_ids = 2 }, -EINVAL,
		  "a prompt and token ids" },
		{ { .max_tokens = 4, .prompt = "x", .stops = stops, .n_stops = 9 }, -EMSGSIZE,
		  "9 stop strings" },
		{ { .max_tokens = 4, .prompt = "x", .stops = nulls, .n_stops = 1 }, -EINVAL,
		  "a NULL stop string" },
		{ { .max_tokens = 4, .prompt = "x", .logits_top_k = 65 }, -EMSGSIZE, "logits_top_k 65" },
		{ { .max_tokens = 4, .prompt = "x", .logprobs = true, .top_logprobs = 21 }, -EMSGSIZE,
		  "top_logprobs 21" },
		{ { .max_tokens = 4, .prompt = "x", .top_logprobs = 2 }, -EINVAL,
		  "top_logprobs without logprobs" },
		{ { .max_tokens = 4, .prompt = big }, -EMSGSIZE, "a prompt over 64 KiB" },
		{ { .max_tokens = 4, .messages = &msg, .n_messages = 1 }, -EINVAL,
		  "a message without content" },
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
		cr_expect_eq(bd_client_generate_start(c, &bad[i].g, &tag), bad[i].want, "%s",
			     bad[i].what);
	cr_expect_eq(tag, 12345, "the tag was written on failure");
	cr_expect_eq(bd_client_cancel(c, 0), -EINVAL);
	cr_expect_eq(bd_client_next(c, -1, &ev), -EINVAL);
	/* none of the above reached the router */
	cr_expect_eq(zmq_poll(&it, 1, 100), 0, "a refused request was sent anyway");
	/* and nothing comes back from a router that does not answer */
	cr_expect_eq(bd_client_next(c, 50, &ev), -ETIMEDOUT);
	free(big);
	bd_client_free(c);
	bd_client_free(NULL);
}

Test(client, chat_request_on_the_wire)
{
	struct bd_client *c;
	struct bd_client_gen g = { .prompt = "Hi there", .chat = true, .max_tokens = 7,
				   .stream = true, .kv_config = "bitdecoding-mxfp4",
				   .logits_top_k = 3, .logprobs = true, .top_logprobs = 20 };
	const char *stops[2] = { "\n\n", "END" };
	int32_t forced[2] = { 5, 6 };
	Bdfp4__ClientRequest *req;
	uint8_t ident[256];
	size_t ident_len;
	uint64_t tag1, tag2;

	g.stops = stops;
	g.n_stops = 2;
	g.forced_tokens = forced;
	g.n_forced = 2;
	g.sampling.temperature = 0.5f;
	g.sampling.top_k = 40;
	g.sampling.top_p = 0.9f;
	g.sampling.seed = 99;
	cr_assert_eq(bd_client_new(T.ep, &c), 0);
	cr_assert_eq(bd_client_generate_start(c, &g, &tag1), 0);
	req = fake_recv(ident, &ident_len);
	cr_assert_eq(req->msg_case, BDFP4__CLIENT_REQUEST__MSG_GENERATE);
	cr_expect_eq(req->generate->client_tag, tag1);
	cr_expect_neq(tag1, 0);
	/* chat: one user message, no raw prompt */
	cr_expect_str_eq(req->generate->prompt, "");
	cr_assert_eq(req->generate->n_messages, 1);
	cr_expect_str_eq(req->generate->messages[0]->role, "user");
	cr_expect_str_eq(req->generate->messages[0]->content, "Hi there");
	cr_expect_eq(req->generate->max_tokens, 7);
	cr_expect(req->generate->stream);
	cr_expect_str_eq(req->generate->kv_config, "bitdecoding-mxfp4");
	cr_assert_eq(req->generate->n_stop, 2);
	cr_expect_str_eq(req->generate->stop[1], "END");
	cr_assert_eq(req->generate->n_forced_tokens, 2);
	cr_expect_eq(req->generate->forced_tokens[1], 6);
	cr_expect_eq(req->generate->logits_top_k, 3);
	cr_expect(req->generate->logprobs);
	cr_expect_eq(req->generate->top_logprobs, 20);
	cr_assert_not_null(req->generate->sampling);
	cr_expect_float_eq(req->generate->sampling->temperature, 0.5f, 0);
	cr_expect_eq(req->generate->sampling->top_k, 40);
	cr_expect_eq(req->generate->sampling->seed, 99);
	bdfp4__client_request__free_unpacked(req, NULL);
	/* a second request gets another tag; raw text goes as prompt */
	g.chat = false;
	cr_assert_eq(bd_client_generate_start(c, &g, &tag2), 0);
	cr_expect_neq(tag2, tag1);
	req = fake_recv(ident, &ident_len);
	cr_expect_str_eq(req->generate->prompt, "Hi there");
	cr_expect_eq(req->generate->n_messages, 0);
	bdfp4__client_request__free_unpacked(req, NULL);
	cr_assert_eq(bd_client_cancel(c, tag2), 0);
	req = fake_recv(ident, &ident_len);
	cr_assert_eq(req->msg_case, BDFP4__CLIENT_REQUEST__MSG_CANCEL);
	cr_expect_eq(req->cancel->client_tag, tag2);
	bdfp4__client_request__free_unpacked(req, NULL);
	bd_client_free(c);
}

Test(client, keepalives_skipped_chunks_and_logit_table)
{
	struct bd_client *c;
	struct bd_client_gen g = { .prompt = "x", .max_tokens = 2 };
	struct bd_client_event ev;
	Bdfp4__ClientRequest *req;
	Bdfp4__ClientReply ka = BDFP4__CLIENT_REPLY__INIT, rep = BDFP4__CLIENT_REPLY__INIT;
	Bdfp4__Keepalive k = BDFP4__KEEPALIVE__INIT;
	Bdfp4__GenerateChunk ch = BDFP4__GENERATE_CHUNK__INIT;
	Bdfp4__Usage us = BDFP4__USAGE__INIT;
	Bdfp4__StepLogits sl[2] = { BDFP4__STEP_LOGITS__INIT, BDFP4__STEP_LOGITS__INIT };
	Bdfp4__StepLogits *psl[2] = { &sl[0], &sl[1] };
	Bdfp4__TopLogit t[3] = { BDFP4__TOP_LOGIT__INIT, BDFP4__TOP_LOGIT__INIT,
				 BDFP4__TOP_LOGIT__INIT };
	Bdfp4__TopLogit *p0[2] = { &t[0], &t[1] }, *p1[1] = { &t[2] };
	Bdfp4__TokenLogprob lp[4] = { BDFP4__TOKEN_LOGPROB__INIT, BDFP4__TOKEN_LOGPROB__INIT,
				      BDFP4__TOKEN_LOGPROB__INIT, BDFP4__TOKEN_LOGPROB__INIT };
	Bdfp4__TokenLogprob *lt0[2] = { &lp[1], &lp[2] };
	Bdfp4__StepLogprobs st[2] = { BDFP4__STEP_LOGPROBS__INIT, BDFP4__STEP_LOGPROBS__INIT };
	Bdfp4__StepLogprobs *pst[2] = { &st[0], &st[1] };
	int32_t toks[2] = { 17, 42 };
	uint8_t ident[256];
	size_t ident_len;
	uint64_t tag;

	cr_assert_eq(bd_client_new(T.ep, &c), 0);
	cr_assert_eq(bd_client_generate_start(c, &g, &tag), 0);
	req = fake_recv(ident, &ident_len);
	bdfp4__client_request__free_unpacked(req, NULL);
	/* keepalives, then the final chunk: two tokens, top lists of 2 and 1 entries */
	ka.msg_case = BDFP4__CLIENT_REPLY__MSG_KEEPALIVE;
	ka.keepalive = &k;
	t[0].token = 17, t[0].logit = 3.5f;
	t[1].token = 9, t[1].logit = 1.25f;
	t[2].token = 42, t[2].logit = -2.0f;
	sl[0].n_top = 2, sl[0].top = p0;
	sl[1].n_top = 1, sl[1].top = p1;
	ch.client_tag = tag;
	ch.request_id = 77;
	ch.n_token_ids = 2;
	ch.token_ids = toks;
	ch.text = (char *)"ab";
	ch.finish_reason = BDFP4__FINISH_REASON__FINISH_LENGTH;
	ch.n_logits = 2;
	ch.logits = psl;
	/* log-probabilities: step 0 sampled 17 with two top entries, step 1 sampled 42, none */
	lp[0].token = 17, lp[0].logprob = -0.5f;
	lp[0].piece = (ProtobufCBinaryData){ 2, (uint8_t *)"ab" };
	lp[1].token = 17, lp[1].logprob = -0.5f;
	lp[2].token = 9, lp[2].logprob = -1.5f;
	lp[3].token = 42, lp[3].logprob = -3.0f;
	st[0].sampled = &lp[0], st[0].n_top = 2, st[0].top = lt0;
	st[1].sampled = &lp[3];
	ch.n_logprobs = 2;
	ch.logprobs = pst;
	us.prompt_tokens = 1;
	us.completion_tokens = 2;
	us.ttft_us = 1000;
	ch.usage = &us;
	rep.msg_case = BDFP4__CLIENT_REPLY__MSG_CHUNK;
	rep.chunk = &ch;
	fake_send(ident, ident_len, &ka);
	fake_send(ident, ident_len, &ka);
	fake_send(ident, ident_len, &rep);
	cr_assert_eq(bd_client_next(c, 5000, &ev), 0);
	cr_expect_eq(ev.kind, BD_CLIENT_CHUNK, "a keepalive came out as an event");
	cr_expect_eq(ev.tag, tag);
	cr_expect_eq(ev.request_id, 77);
	cr_assert_eq(ev.n_tokens, 2);
	cr_expect_eq(ev.tokens[1], 42);
	cr_expect_eq(ev.text_len, 2);
	cr_expect_str_eq(ev.text, "ab");
	cr_expect_eq(ev.finish, BD_FINISH_LENGTH);
	cr_assert(ev.has_usage);
	cr_expect_eq(ev.usage.completion_tokens, 2);
	cr_expect_eq(ev.usage.ttft_us, 1000);
	/* dense [2][2]: the missing second entry of step 1 is token -1 */
	cr_assert_eq(ev.top_k, 2);
	cr_expect_eq(ev.top[0].token, 17);
	cr_expect_float_eq(ev.top[1].logit, 1.25f, 0);
	cr_expect_eq(ev.top[2].token, 42);
	cr_expect_eq(ev.top[3].token, -1);
	/* dense [2][1 + 2]: the sampled token, then the top ones (-1: fewer) */
	cr_assert_eq(ev.n_top_logprobs, 2);
	cr_assert_not_null(ev.logprobs);
	cr_expect_eq(ev.logprobs[0].token, 17);
	cr_expect_eq(ev.logprobs[0].piece_len, 2);
	cr_expect(!memcmp(ev.logprobs[0].piece, "ab", 2));
	cr_expect_float_eq(ev.logprobs[2].logprob, -1.5f, 0);
	cr_expect_eq(ev.logprobs[3].token, 42);
	cr_expect_float_eq(ev.logprobs[3].logprob, -3.0f, 0);
	cr_expect_eq(ev.logprobs[4].token, -1);
	cr_expect_eq(ev.logprobs[5].token, -1);
	/* a frame that is not a ClientReply */
	cr_assert_eq(zmq_send(T.router, ident, ident_len, ZMQ_SNDMORE), (int)ident_len);
	cr_assert_eq(zmq_send(T.router, "\xff\xff\xff", 3, 0), 3);
	cr_expect_eq(bd_client_next(c, 5000, &ev), -EBADMSG);
	bd_client_free(c);
}
