/* fuzz_router.c — libFuzzer target for routerd's frame decoders: the client API's frames
 * (router/frontend.c, bd_router_on_frontend) and the workers' frames (router/workers.c,
 * bd_router_on_workers), through the router's own ROUTER sockets and scheduler.
 *
 * Build and run: `make fuzz-router-client` (this file built with FUZZ_SIDE_WORKERS=0) and
 * `make fuzz-router-workers` (=1). The router runs in this process as routerd's loop runs it:
 * its frontend and worker ROUTER sockets on inproc endpoints, the real scheduler over a real
 * kvpoold handler (kvpoold/handler.c behind a REP socket on an ipc:// endpoint, served by a
 * thread), the embedded model's tokenizer when it can be loaded. One input is a sequence of
 * records [frames][len][bytes]: the bytes are cut into (frames & 3) + 1 frames and sent as one
 * message from a client DEALER (client side) or from worker rank (frames >> 2) & 1's DEALER
 * (workers side), then the router reads it and carries out the scheduler's actions. The other
 * side is well-formed: first both ranks register (the group forms, requests get planned), and
 * on the workers side a client then asks for a generation of 4 tokens (step 1 is in flight).
 * Checks: no crash or sanitizer report, the scheduler's books stay consistent (queued +
 * running ≤ live requests), the pool's allocator keeps its invariants, and once the live
 * requests are released the pool holds no record (nothing the router ended was left there).
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <zmq.h>

#include "kvpool.h"
#include "kvpool.pb-c.h"
#include "router.h"
#include "serve/bd_wire.h"
#include "fuzz_model_tok.h"

#ifndef FUZZ_SIDE_WORKERS
#define FUZZ_SIDE_WORKERS 0
#endif

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

#define N_PAGES 64
#define N_SLOTS 8
#define PPR 16
#define N_REQ 32
#define MAX_RECORDS 24

static struct bd_router rt;
static void *client, *wdealer[2];
static char pool_ep[128], dir[64];

/* ---- the pool: kvpoold's handler behind a REP socket --------------------------------------- */

static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static struct bd_kvpool_handler pool_h;

static void *pool_main(void *arg)
{
	void *rep = arg;

	for (;;) {
		zmq_msg_t m;
		uint8_t *out = NULL;
		size_t out_len = 0;

		zmq_msg_init(&m);
		if (zmq_msg_recv(&m, rep, 0) < 0) {
			zmq_msg_close(&m);
			if (zmq_errno() == ETERM)
				break;
			continue;
		}
		pthread_mutex_lock(&pool_mu);
		if (bd_kvpool_handle(&pool_h, zmq_msg_data(&m), zmq_msg_size(&m), &out, &out_len) < 0)
			abort();
		pthread_mutex_unlock(&pool_mu);
		zmq_msg_close(&m);
		zmq_send(rep, out, out_len, 0);
		free(out);
	}
	zmq_close(rep);
	return NULL;
}

static void pool_start(void)
{
	static pthread_t t;
	void *pctx = zmq_ctx_new(), *rep = zmq_socket(pctx, ZMQ_REP);
	struct bd_kvpool_alloc *a;

	snprintf(dir, sizeof(dir), "/tmp/fuzz-router-XXXXXX");
	if (!mkdtemp(dir) || bd_kvpool_alloc_new(N_PAGES, N_SLOTS, PPR, N_REQ, &a) < 0)
		abort();
	pool_h = (struct bd_kvpool_handler){ .alloc = a, .max_frame = 65536, .default_top = 4 };
	snprintf(pool_ep, sizeof(pool_ep), "ipc://%s/pool.sock", dir);
	if (zmq_bind(rep, pool_ep) < 0 || pthread_create(&t, NULL, pool_main, rep) != 0)
		abort();
}

/* A fresh allocator for the next input (the old one must have every page back). */
static void pool_reset(void)
{
	struct bd_kvpool_alloc *a;
	struct bd_kvpool_counts c;
	struct bd_pool_holder held[N_REQ];
	size_t n;

	pthread_mutex_lock(&pool_mu);
	if (bd_kvpool_alloc_check(pool_h.alloc) != 0)
		abort();
	/* the live requests were released by reset(); the router released every request it
	 * ended itself */
	n = bd_kvpool_alloc_holders(pool_h.alloc, false, held, N_REQ);
	bd_kvpool_alloc_counts(pool_h.alloc, &c);
	if (n)
		abort();
	if (c.pages_free != N_PAGES || c.slots_free != N_SLOTS || c.requests != 0)
		abort();
	bd_kvpool_alloc_free(pool_h.alloc);
	if (bd_kvpool_alloc_new(N_PAGES, N_SLOTS, PPR, N_REQ, &a) < 0)
		abort();
	pool_h.alloc = a;
	pthread_mutex_unlock(&pool_mu);
}

/* ---- the router ---------------------------------------------------------------------------- */

static void sched_start(void)
{
	struct bd_sched_cfg cfg = rt.o.sched;

	cfg.n_vocab = rt.n_vocab;
	cfg.eog = rt.eog;
	cfg.tok = rt.tok;
	if (bd_sched_init(&rt.sched, &cfg, &bd_router_pool_ops, &rt) < 0)
		abort();
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	int zero = 0;

	(void)argc;
	(void)argv;
	bd_log_set_debug(false);
	if (getenv("BD_FUZZ_MODEL") || access("models/SmolLM2-135M-Instruct.Q4_1.gguf", R_OK) == 0)
		fz_tok_load();
	pool_start();
	rt.o = (struct bd_router_opts){
		.tp = 2, .max_frame = 65536, .deadline_ms = 300000,
		.sched = { .max_batch = 4, .max_queue = 8, .max_prefill_tokens = 1024,
			   .max_prefill_chunk = 512, .resume_timeout_ms = 0 },
		.heartbeat_ms = 250, .heartbeat_timeout_ms = 3000, .step_timeout_ms = 120000,
		.keepalive_ms = 1000, .pool_timeout_ms = 2000,
		.pool_wait_ms = 0, .pool_probe_ms = 1000, .status_ms = 1000, .owner = 1,
	};
	rt.tok = fz_tok;
	rt.n_vocab = fz_tok ? bd_tokenizer_n_vocab(fz_tok) : 1000;
	rt.n_ctx = 2048;
	rt.n_layers = 30;
	rt.eog = calloc((size_t)rt.n_vocab, sizeof(bool));
	for (int i = 0; fz_tok && i < rt.n_vocab; i++)
		rt.eog[i] = bd_tokenizer_is_eog(fz_tok, i);
	snprintf(rt.model_name, sizeof(rt.model_name), "fuzz-model");
	snprintf(rt.arch, sizeof(rt.arch), "llama");
	snprintf(rt.kv_config, sizeof(rt.kv_config), "bitdecoding-nvfp4");
	snprintf(rt.page_format, sizeof(rt.page_format), "nvfp4");
	snprintf(rt.backend, sizeof(rt.backend), "cpu");
	rt.pages_total = N_PAGES;
	rt.slots_total = N_SLOTS;
	rt.pool_ok = true;
	if (bd_pool_conn_new(pool_ep, rt.o.pool_timeout_ms, &rt.pool) < 0)
		abort();
	rt.zctx = zmq_ctx_new();
	rt.front = bd_router_socket(rt.zctx, 1 << 20);
	rt.wsock = bd_router_socket(rt.zctx, BD_ROUTER_WORKER_MAX_FRAME);
	if (!rt.front || !rt.wsock || zmq_bind(rt.front, "inproc://fz-front") < 0 ||
	    zmq_bind(rt.wsock, "inproc://fz-workers") < 0)
		abort();
	client = zmq_socket(rt.zctx, ZMQ_DEALER);
	zmq_setsockopt(client, ZMQ_LINGER, &zero, sizeof(zero));
	zmq_setsockopt(client, ZMQ_ROUTING_ID, "client", 6);
	if (zmq_connect(client, "inproc://fz-front") < 0)
		abort();
	for (int r = 0; r < 2; r++) {
		char id[4] = { 'w', (char)('0' + r), 0, 0 };

		wdealer[r] = zmq_socket(rt.zctx, ZMQ_DEALER);
		zmq_setsockopt(wdealer[r], ZMQ_LINGER, &zero, sizeof(zero));
		zmq_setsockopt(wdealer[r], ZMQ_ROUTING_ID, id, 2);
		if (zmq_connect(wdealer[r], "inproc://fz-workers") < 0)
			abort();
	}
	sched_start();
	return 0;
}

/* What routerd's loop does after reading a socket: the scheduler's step, its actions. */
static void carry_out(void)
{
	struct bd_sched_act a;

	bd_sched_schedule(&rt.sched, bd_now_ms());
	while (bd_sched_next(&rt.sched, &a)) {
		if (a.kind == BD_SCHED_PLAN) {
			bd_router_send_plan(&rt, a.plan, bd_now_ms());
			continue;
		}
		if (bd_router_send_chunk(&rt, a.r, a.finish, a.error, a.msg) == -EHOSTUNREACH)
			bd_sched_client_gone(&rt.sched, a.r->ident, a.r->ident_len);
	}
	if (rt.sched.n_queued + rt.sched.n_running > rt.sched.n_reqs)
		abort();
}

/* Every message waiting on a DEALER, dropped; how many there were. */
static int drain(void *s)
{
	int n = 0;

	for (;;) {
		zmq_msg_t m;

		zmq_msg_init(&m);
		if (zmq_msg_recv(&m, s, ZMQ_DONTWAIT) < 0) {
			zmq_msg_close(&m);
			return n;
		}
		if (!zmq_msg_more(&m))
			n++;
		zmq_msg_close(&m);
	}
}

/* Sends b[n] from s as frames+1 frames (cut at even shares). */
static void send_frames(void *s, const uint8_t *b, size_t n, int frames)
{
	size_t at = 0;

	for (int f = 0; f <= frames; f++) {
		size_t take = f == frames ? n - at : n / (size_t)(frames + 1);

		zmq_send(s, b + at, take, f == frames ? ZMQ_DONTWAIT : ZMQ_SNDMORE | ZMQ_DONTWAIT);
		at += take;
	}
}

static void send_msg(void *s, const ProtobufCMessage *m)
{
	if (bd_wire_send(s, NULL, 0, false, m, ZMQ_DONTWAIT) < 0)
		abort();
}

/* The well-formed other side: both ranks register (client side), or a client asks for a
 * generation (workers side). */
static void prelude(void)
{
	for (int r = 0; r < 2; r++) {
		Bdfp4__WorkerMessage m = BDFP4__WORKER_MESSAGE__INIT;
		Bdfp4__RegisterRequest rq = BDFP4__REGISTER_REQUEST__INIT;

		rq.version = BD_SERVE_PROTO_VERSION;
		rq.rank = r;
		rq.tp = 2;
		rq.pid = 100 + r;
		rq.backend = (char *)"cpu";
		m.msg_case = BDFP4__WORKER_MESSAGE__MSG_REGISTER_REQUEST;
		m.register_request = &rq;
		send_msg(wdealer[r], &m.base);
		bd_router_on_workers(&rt);
	}
	carry_out();
#if FUZZ_SIDE_WORKERS
	{
		Bdfp4__ClientRequest req = BDFP4__CLIENT_REQUEST__INIT;
		Bdfp4__GenerateRequest g = BDFP4__GENERATE_REQUEST__INIT;
		int32_t ids[3] = { 1, 2, 3 };

		/* request 1, planned as step 1 of epoch 1 */
		g.client_tag = 7;
		g.token_ids = ids;
		g.n_token_ids = 3;
		g.max_tokens = 4;
		g.ignore_eos = true;
		req.msg_case = BDFP4__CLIENT_REQUEST__MSG_GENERATE;
		req.generate = &g;
		req.connection = 1;
		send_msg(client, &req.base);
		bd_router_on_frontend(&rt);
		carry_out();
	}
#endif
}

/* Back to a router with no group and no request, and a fresh pool. */
static void reset(void)
{
	for (size_t i = 0; i < rt.sched.n_reqs; i++)
		bd_router_pool_ops.release(&rt, rt.sched.reqs[i]->id);
	bd_sched_fini(&rt.sched);
	for (int i = 0; i < BD_ROUTER_MAX_TP; i++) {
		if (rt.step.res[i])
			bdfp4__step_result__free_unpacked(rt.step.res[i], NULL);
		rt.step.res[i] = NULL;
	}
	memset(&rt.step, 0, sizeof(rt.step));
	memset(rt.w, 0, sizeof(rt.w));
	rt.epoch = 0;
	rt.group_ready = false;
	rt.state = RS_STARTING;
	rt.pool_ok = true;
	rt.pool_waiting = false;
	drain(client);
	drain(wdealer[0]);
	drain(wdealer[1]);
	pool_reset();
	sched_start();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	size_t i = 0;
	int records = 0;

	prelude();
	drain(client);
	while (i + 2 <= size && records++ < MAX_RECORDS) {
		uint8_t sel = data[i];
		size_t len = data[i + 1];

		i += 2;
		if (len > size - i)
			len = size - i;
#if FUZZ_SIDE_WORKERS
		send_frames(wdealer[(sel >> 2) & 1], data + i, len, sel & 3);
		bd_router_on_workers(&rt);
#else
		send_frames(client, data + i, len, sel & 3);
		bd_router_on_frontend(&rt);
		drain(client);
#endif
		carry_out();
		i += len;
	}
	reset();
	return 0;
}
