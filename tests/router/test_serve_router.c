/* test_serve_router.c — routerd against a real kvpoold and fake workers (threads of this test
 * that speak the worker side of proto/serve.proto and compute nothing).
 *
 * A fake rank 0 answers each row with token 300 + (p·31 + seed mod 1000) mod 500, p the
 * position the token will take (the first generated token of a prompt of n tokens is at p = n),
 * seed the request's sampling seed from its prefill row. So a client that sets the seed knows
 * every token it must get, across preemption and recompute too. The fakes also check every
 * plan against the protocol (positions, the pages a row completes, block tables, slots and
 * pages never shared by two live sequences, releases) and count violations.
 *
 * Scheduling, admission, preemption, cancel, disconnect, bad input, deadlines, worker death and
 * shutdown are tested here fast and deterministically; test_serve.c runs the real workers.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <grp.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <jansson.h>
#include <zmq.h>

#include "pool/bd_pool_client.h"
#include "serve/bd_client.h"
#include "formats/bd_gguf.h"
#include "quant/bd_layout.h"
#include "model/bd_tokenizer.h"
#include "serve.pb-c.h"
#include "serve_common.h"

#define WAIT_MS 20000
#define MAX_SEQ 64

static struct sv_env E;

/* ---- fake workers ------------------------------------------------------------------------ */

struct fseq {
	bool live;
	uint64_t id, seed;
	int n_pos, slot, n_pages;
	int32_t pages[64];
};

struct fake {
	int rank;
	pthread_t th;
	bool started;
	atomic_bool stop, die, hang;
	atomic_int delay_ms;
	atomic_int steps, violations, registrations, resets, released;
	pthread_mutex_t mu;
	char violation[256];
	struct fseq seq[MAX_SEQ];
	uint64_t epoch;
};

static struct fake F[2];
/* what the fakes say they run (RegisterRequest.whole_prompts): they take prefill rows at
 * position 0 only, so a chunk at a later position sent to them is a violation */
static bool fake_whole_prompts;
/* the model the fakes register (a random-weights router names a preset) */
static const char *fake_model = "SmolLM2-135M-Instruct.Q4_1.gguf";

static uint32_t fake_token(uint64_t seed, int pos)
{
	return 300 + (uint32_t)(((uint64_t)pos * 31 + seed % 1000) % 500);
}

static void violate(struct fake *f, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void violate(struct fake *f, const char *fmt, ...)
{
	va_list ap;

	pthread_mutex_lock(&f->mu);
	if (!f->violations) {
		va_start(ap, fmt);
		vsnprintf(f->violation, sizeof(f->violation), fmt, ap);
		va_end(ap);
	}
	f->violations++;
	pthread_mutex_unlock(&f->mu);
}

static void fsend(void *s, const Bdfp4__WorkerMessage *m)
{
	size_t n = bdfp4__worker_message__get_packed_size(m);
	uint8_t *buf = malloc(n ? n : 1);

	bdfp4__worker_message__pack(m, buf);
	zmq_send(s, buf, n, 0);
	free(buf);
}

static void fregister(struct fake *f, void *s)
{
	Bdfp4__WorkerMessage m = BDFP4__WORKER_MESSAGE__INIT;
	Bdfp4__RegisterRequest r = BDFP4__REGISTER_REQUEST__INIT;
	char dk[64];

	/* what a cuda worker reports of its decode kernels; the router relays it to --info */
	snprintf(dk, sizeof(dk), "%s (fake rank %d)", f->rank ? "blackwell-tc" : "hopper", f->rank);
	r.decode_kernel = dk;
	r.version = 1;
	r.rank = f->rank;
	r.tp = 2;
	r.pid = getpid();
	r.backend = (char *)"cpu";
	r.device = -1;
	r.model = (char *)fake_model;
	r.whole_prompts = fake_whole_prompts;
	m.msg_case = BDFP4__WORKER_MESSAGE__MSG_REGISTER_REQUEST;
	m.register_request = &r;
	fsend(s, &m);
}

static struct fseq *fseq_find(struct fake *f, uint64_t id)
{
	for (int i = 0; i < MAX_SEQ; i++)
		if (f->seq[i].live && f->seq[i].id == id)
			return &f->seq[i];
	return NULL;
}

/* Slots and pages of live sequences must be disjoint. */
static void check_disjoint(struct fake *f, const struct fseq *s)
{
	for (int i = 0; i < MAX_SEQ; i++) {
		const struct fseq *o = &f->seq[i];

		if (!o->live || o == s)
			continue;
		if (o->slot == s->slot)
			violate(f, "slot %d held by requests %llu and %llu", s->slot,
				(unsigned long long)o->id, (unsigned long long)s->id);
		for (int a = 0; a < o->n_pages; a++)
			for (int b = 0; b < s->n_pages; b++)
				if (o->pages[a] == s->pages[b])
					violate(f, "page %d held by requests %llu and %llu",
						s->pages[b], (unsigned long long)o->id,
						(unsigned long long)s->id);
	}
}

static void fplan(struct fake *f, void *s, const Bdfp4__StepPlan *p)
{
	Bdfp4__WorkerMessage m = BDFP4__WORKER_MESSAGE__INIT;
	Bdfp4__StepResult res = BDFP4__STEP_RESULT__INIT;
	Bdfp4__RowResult *rows = calloc(p->n_rows + 1, sizeof(*rows));
	Bdfp4__RowResult **prow = calloc(p->n_rows + 1, sizeof(*prow));
	Bdfp4__TopLogit tl[3], *ptl[3];
	int delay = atomic_load(&f->delay_ms);

	if (delay)
		usleep((useconds_t)delay * 1000);
	if (p->epoch != f->epoch)
		violate(f, "plan of epoch %llu in epoch %llu", (unsigned long long)p->epoch,
			(unsigned long long)f->epoch);
	for (size_t i = 0; i < p->n_release; i++) {
		struct fseq *q = fseq_find(f, p->release[i]);

		if (q) {
			q->live = false;
			f->released++;
		}
	}
	for (size_t k = 0; k < p->n_rows; k++) {
		const Bdfp4__PlanRow *r = p->rows[k];
		struct fseq *q = fseq_find(f, r->request_id);
		int pos = r->position, n = (int)r->n_tokens, completes = 0;

		for (int t = pos; t < pos + n; t++)
			completes += (t + 1) % BD_PAGE_TOKENS == 0;
		if (r->n_new_pages != (size_t)completes)
			violate(f, "request %llu: %zu new pages for positions %d..%d",
				(unsigned long long)r->request_id, r->n_new_pages, pos, pos + n - 1);
		if (r->prefill) {
			if (q)
				violate(f, "prefill of live request %llu",
					(unsigned long long)r->request_id);
			if (pos != 0 || n < 1 || r->capacity < (uint32_t)n || !r->sampling ||
			    !r->sampling->seed || !*r->kv_config)
				violate(f, "bad prefill row of request %llu",
					(unsigned long long)r->request_id);
			for (int i = 0; !q && i < MAX_SEQ; i++)
				if (!f->seq[i].live)
					q = &f->seq[i];
			memset(q, 0, sizeof(*q));
			q->live = true;
			q->id = r->request_id;
			q->seed = r->sampling ? r->sampling->seed : 0;
		} else {
			if (!q) {
				violate(f, "decode of unknown request %llu",
					(unsigned long long)r->request_id);
				continue;
			}
			if (pos != q->n_pos || n != 1)
				violate(f, "request %llu: decode at %d, sequence holds %d",
					(unsigned long long)r->request_id, pos, q->n_pos);
			if (r->n_block_table != (size_t)q->n_pages ||
			    (q->n_pages &&
			     memcmp(r->block_table, q->pages, (size_t)q->n_pages * 4)))
				violate(f, "request %llu: block table differs from its pages",
					(unsigned long long)r->request_id);
			if (r->slot != q->slot)
				violate(f, "request %llu: slot moved", (unsigned long long)r->request_id);
		}
		q->slot = r->slot;
		for (size_t i = 0; i < r->n_new_pages && q->n_pages < 64; i++)
			q->pages[q->n_pages++] = r->new_pages[i];
		q->n_pos = pos + n;
		check_disjoint(f, q);
		bdfp4__row_result__init(&rows[k]);
		rows[k].request_id = r->request_id;
		rows[k].token = f->rank == 0 ? (int32_t)fake_token(q->seed, q->n_pos) : -1;
		if (f->rank == 0 && r->logits_top_k) {
			/* logit j of the top list: 10 - j, token: the sampled one first */
			for (int j = 0; j < 3; j++) {
				bdfp4__top_logit__init(&tl[j]);
				tl[j].token = rows[k].token + j;
				tl[j].logit = 10.0f - (float)j;
				ptl[j] = &tl[j];
			}
			rows[k].n_top = r->logits_top_k < 3 ? r->logits_top_k : 3;
			rows[k].top = ptl;
		}
		prow[k] = &rows[k];
	}
	res.epoch = p->epoch;
	res.step = p->step;
	res.rank = f->rank;
	res.n_rows = p->n_rows;
	res.rows = prow;
	m.msg_case = BDFP4__WORKER_MESSAGE__MSG_RESULT;
	m.result = &res;
	fsend(s, &m);
	f->steps++;
	free(rows);
	free(prow);
}

static void *fake_main(void *arg)
{
	struct fake *f = arg;
	void *ctx = zmq_ctx_new(), *s = zmq_socket(ctx, ZMQ_DEALER);
	int zero = 0;
	int64_t next_hb = 0, last_heard = sv_now_ms();

	zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero));
	zmq_connect(s, E.workers_ep);
	fregister(f, s);
	while (!atomic_load(&f->stop) && !atomic_load(&f->die)) {
		zmq_pollitem_t it = { .socket = s, .events = ZMQ_POLLIN };
		Bdfp4__RouterMessage *m;
		zmq_msg_t msg;

		if (atomic_load(&f->hang)) {
			usleep(10000);
			continue;
		}
		if (sv_now_ms() >= next_hb) {
			Bdfp4__WorkerMessage w = BDFP4__WORKER_MESSAGE__INIT;
			Bdfp4__WorkerHeartbeat hb = BDFP4__WORKER_HEARTBEAT__INIT;

			hb.rank = f->rank;
			hb.epoch = f->epoch;
			hb.steps = (uint64_t)f->steps;
			w.msg_case = BDFP4__WORKER_MESSAGE__MSG_HEARTBEAT;
			w.heartbeat = &hb;
			fsend(s, &w);
			next_hb = sv_now_ms() + 100;
		}
		if (sv_now_ms() - last_heard > 1000) {
			/* the router forgot us (or restarted): register again */
			fregister(f, s);
			last_heard = sv_now_ms();
		}
		if (zmq_poll(&it, 1, 10) <= 0)
			continue;
		last_heard = sv_now_ms();
		zmq_msg_init(&msg);
		if (zmq_msg_recv(&msg, s, 0) < 0) {
			zmq_msg_close(&msg);
			continue;
		}
		m = bdfp4__router_message__unpack(NULL, zmq_msg_size(&msg), zmq_msg_data(&msg));
		zmq_msg_close(&msg);
		if (!m) {
			violate(f, "router frame does not decode");
			continue;
		}
		switch (m->msg_case) {
		case BDFP4__ROUTER_MESSAGE__MSG_REGISTER_REPLY:
			if (m->register_reply->error)
				violate(f, "registration refused: %s", m->register_reply->message);
			if (m->register_reply->rank != f->rank || !*m->register_reply->allreduce_name)
				violate(f, "register reply for rank %d", m->register_reply->rank);
			f->epoch = m->register_reply->epoch;
			f->registrations++;
			break;
		case BDFP4__ROUTER_MESSAGE__MSG_PLAN:
			fplan(f, s, m->plan);
			break;
		case BDFP4__ROUTER_MESSAGE__MSG_RESET:
			memset(f->seq, 0, sizeof(f->seq));
			f->resets++;
			fregister(f, s);
			break;
		default:
			break;
		}
		bdfp4__router_message__free_unpacked(m, NULL);
	}
	zmq_close(s);
	zmq_ctx_term(ctx);
	return NULL;
}

static void fake_start(int rank)
{
	struct fake *f = &F[rank];

	if (f->started) {
		f->stop = true;
		pthread_join(f->th, NULL);
	}
	memset(f, 0, sizeof(*f));
	pthread_mutex_init(&f->mu, NULL);
	f->rank = rank;
	cr_assert_eq(pthread_create(&f->th, NULL, fake_main, f), 0);
	f->started = true;
}

static void fakes_stop(void)
{
	for (int i = 0; i < 2; i++)
		if (F[i].started) {
			F[i].stop = true;
			pthread_join(F[i].th, NULL);
			F[i].started = false;
		}
}

static void expect_no_violations(void)
{
	for (int i = 0; i < 2; i++)
		cr_expect_eq(F[i].violations, 0, "fake rank %d: %d protocol violation(s), first: %s",
			     i, F[i].violations, F[i].violation);
}

/* ---- setup ------------------------------------------------------------------------------- */

static void init(void)
{
	sv_init(&E);
}

static void fini(void)
{
	fakes_stop();
	sv_fini(&E);
}

TestSuite(serve_router, .init = init, .fini = fini, .timeout = 120);

/* kvpoold with `pages` pages and `slots` slots (1 layer: the fakes write nothing), the router
 * with extra flags, two fake ranks, and a wait for the group. */
static void up(const char *pages, const char *slots, const char *const *router_extra)
{
	/* the longest request must fit the pool: max_seq_len = pages · 128 up to 1024 */
	char seq[16];
	const char *pool_extra[] = { "--layers", "1", "--pages", pages, "--slots", slots,
				     "--max-seq-len", seq, NULL };

	snprintf(seq, sizeof(seq), "%d", atoi(pages) * 128 < 1024 ? atoi(pages) * 128 : 1024);

	/* the fake ranks rebuild nothing: a lost rank fails its requests at once (no resume), and
	 * no prompt starts from cached pages (a prefix hit's first row resumes at position > 0 and
	 * rebuilds the sink; tests/system/test_prefix.c serves those with real workers) */
	static const char *const args[] = { "--resume-timeout-ms", "0", "--prefix-cache=0", NULL };

	sv_start_pool(&E, pool_extra);
	sv_start_router2(&E, args, router_extra);
	fake_start(0);
	fake_start(1);
	sv_expect_healthy(&E, WAIT_MS, "the group did not form");
}

/* up() with 16 pages and 4 slots and extra router flags, fake rank 0 taking 10 ms a step (time
 * to act in the middle of a generation); returns a client. */
static struct bd_client *up_slow(const char *const *extra)
{
	up("16", "4", extra);
	F[0].delay_ms = 10;
	return sv_client(&E);
}

struct result {
	int32_t tokens[2048];
	size_t n;
	char text[16384];
	size_t text_len;
	int chunks, finish, error;
	char message[256];
	struct bd_client_usage usage;
	bool has_usage;
	float top0[2048];
	int32_t top_tok[2048];
};

/* Collects events of tag until its final chunk or error. */
static void collect(struct bd_client *c, uint64_t tag, struct result *r)
{
	struct bd_client_event ev;

	memset(r, 0, sizeof(*r));
	r->finish = -1;
	for (;;) {
		int e = bd_client_next(c, WAIT_MS, &ev);

		cr_assert_eq(e, 0, "no reply: %s; router log:\n%s", strerror(-e),
			     sv_log_tail(&E.router));
		if (ev.tag != tag)
			continue;
		if (ev.kind == BD_CLIENT_ERROR) {
			r->finish = BD_FINISH_ERROR;
			r->error = ev.error;
			snprintf(r->message, sizeof(r->message), "%s", ev.message);
			return;
		}
		if (ev.kind != BD_CLIENT_CHUNK)
			continue;
		r->chunks++;
		for (size_t i = 0; i < ev.n_tokens && r->n < 2048; i++) {
			if (ev.top_k) {
				r->top_tok[r->n] = ev.top[i * ev.top_k].token;
				r->top0[r->n] = ev.top[i * ev.top_k].logit;
			}
			r->tokens[r->n++] = ev.tokens[i];
		}
		cr_assert_lt(r->text_len + ev.text_len, sizeof(r->text));
		memcpy(r->text + r->text_len, ev.text, ev.text_len);
		r->text_len += ev.text_len;
		if (ev.finish != BD_FINISH_NONE) {
			r->finish = ev.finish;
			r->error = ev.error;
			snprintf(r->message, sizeof(r->message), "%s", ev.message);
			r->usage = ev.usage;
			r->has_usage = ev.has_usage;
			return;
		}
	}
}

static uint64_t start_ids(struct bd_client *c, const int32_t *ids, size_t n, uint32_t max,
			  uint64_t seed, bool stream)
{
	struct bd_client_gen g = { .token_ids = ids, .n_token_ids = n, .max_tokens = max,
				   .stream = stream };
	uint64_t tag;

	g.sampling.seed = seed;
	g.sampling.top_p = 1;
	cr_assert_eq(bd_client_generate_start(c, &g, &tag), 0);
	return tag;
}

/* A streamed request of ids[n] for max tokens of this seed, collected into *r. Returns its
 * tag. */
static uint64_t generate(struct bd_client *c, const int32_t *ids, size_t n, uint32_t max,
			 uint64_t seed, struct result *r)
{
	uint64_t tag = start_ids(c, ids, n, max, seed, true);

	collect(c, tag, r);
	return tag;
}

static void prompt_ids(int32_t *ids, size_t n, int salt)
{
	for (size_t i = 0; i < n; i++)
		ids[i] = 1000 + (int32_t)((i * 7 + (size_t)salt * 13) % 3000);
}

static void expect_tokens(const struct result *r, size_t n_prompt, uint64_t seed, size_t n)
{
	cr_assert_eq(r->n, n, "got %zu tokens, want %zu (finish %d: %s)", r->n, n, r->finish,
		     r->message);
	for (size_t i = 0; i < n; i++)
		cr_assert_eq((uint32_t)r->tokens[i], fake_token(seed, (int)(n_prompt + i)),
			     "token %zu", i);
}

/* Reads chunks of tag until at least n tokens came; returns how many. */
static size_t read_tokens(struct bd_client *c, uint64_t tag, size_t n)
{
	struct bd_client_event ev;
	size_t got = 0;

	while (got < n) {
		cr_assert_eq(bd_client_next(c, WAIT_MS, &ev), 0, "router log:\n%s",
			     sv_log_tail(&E.router));
		if (ev.kind == BD_CLIENT_CHUNK && ev.tag == tag) {
			cr_assert_eq(ev.finish, BD_FINISH_NONE, "finished early: %s", ev.message);
			got += ev.n_tokens;
		}
	}
	return got;
}

/* Starts a streamed request of n prompt tokens (prompt_ids of salt, kept in ids) for 1000
 * tokens of this seed, and reads its first 3. Returns its tag. */
static uint64_t start_long(struct bd_client *c, int32_t *ids, size_t n, int salt, uint64_t seed)
{
	uint64_t tag;

	prompt_ids(ids, n, salt);
	tag = start_ids(c, ids, n, 1000, seed, true);
	read_tokens(c, tag, 3);
	return tag;
}

/* Fake rank `rank` vanishes: its thread ends and its connection closes, as a killed
 * process's does. */
static void fake_kill(int rank)
{
	F[rank].die = true;
	pthread_join(F[rank].th, NULL);
	F[rank].started = false;
}

/* ---- tests ------------------------------------------------------------------------------- */

Test(serve_router, stream_tokens_pages_and_usage)
{
	struct bd_client *c;
	struct result r;
	struct bd_client_info info;
	int32_t ids[200];

	up("16", "4", NULL);
	c = sv_client(&E);
	/* 200 prompt tokens fill page 0 at prefill; 100 more decode past position 255 and fill
	 * page 1 at position 255 (the 56th generated token) */
	prompt_ids(ids, 200, 1);
	generate(c, ids, 200, 100, 77, &r);
	cr_expect_eq(r.finish, BD_FINISH_LENGTH, "finish %d: %s", r.finish, r.message);
	expect_tokens(&r, 200, 77, 100);
	cr_expect_eq(r.chunks, 100, "one chunk per token when streaming");
	cr_assert(r.has_usage);
	cr_expect_eq(r.usage.prompt_tokens, 200);
	cr_expect_eq(r.usage.completion_tokens, 100);
	cr_expect_leq(r.usage.ttft_us, r.usage.total_us);
	cr_assert_eq(bd_client_info(c, WAIT_MS, &info), 0);
	/* page 0 (prefill), page 1 reserved ahead of position 255 */
	cr_expect_eq(info.pages_peak, 2);
	cr_expect_eq(info.tokens_generated, 100);
	cr_expect_eq(info.requests_total, 1);
	cr_expect_eq(info.n_ctx, 1024, "the pool's max_seq_len caps the model context");
	cr_expect_str_eq(info.kv_config, "bitdecoding-nvfp4");
	cr_expect_str_eq(info.decode_kernel,
			 "rank 0: hopper (fake rank 0); rank 1: blackwell-tc (fake rank 1)");
	cr_expect(sv_pool_idle(&E, WAIT_MS), "the pool still holds pages or slots");
	bd_client_free(c);
	expect_no_violations();
}

/* Workers that register whole_prompts (a cuda worker with synthetic_prefill cannot continue a
 * prompt) get a 300-token prompt in one row although the router is set to chunks of 128: a
 * row at position 128 would be a violation of the fakes. */
Test(serve_router, workers_that_take_whole_prompts_get_no_chunk)
{
	struct bd_client *c;
	struct result r;
	int32_t ids[300];

	fake_whole_prompts = true;
	up("16", "4", (const char *const[]){ "--max-prefill-chunk", "128", "--max-prefill-tokens",
					     "256", NULL });
	c = sv_client(&E);
	prompt_ids(ids, 300, 3);
	generate(c, ids, 300, 20, 91, &r);
	cr_expect_eq(r.finish, BD_FINISH_LENGTH, "finish %d: %s", r.finish, r.message);
	expect_tokens(&r, 300, 91, 20);
	cr_expect(sv_pool_idle(&E, WAIT_MS), "the pool still holds pages or slots");
	bd_client_free(c);
	expect_no_violations();
}

Test(serve_router, chat_text_and_non_stream_agree_with_the_tokenizer)
{
	struct bd_client *c = NULL;
	struct result a, b;
	struct bd_gguf *g;
	struct bd_tokenizer *tok;
	struct bd_client_gen gen = { .prompt = "Say hi", .chat = true, .max_tokens = 12,
				     .stream = true };
	char *want;
	size_t want_len;
	uint64_t tag;
	int32_t *ids;
	size_t n_ids;
	struct bd_chat_msg msg = { "user", "Say hi" };

	up("16", "4", NULL);
	c = sv_client(&E);
	gen.sampling.seed = 5;
	cr_assert_eq(bd_client_generate_start(c, &gen, &tag), 0);
	collect(c, tag, &a);
	gen.stream = false;
	cr_assert_eq(bd_client_generate_start(c, &gen, &tag), 0);
	collect(c, tag, &b);
	cr_expect_eq(b.chunks, 1, "not streaming: one final reply");
	cr_assert_eq(a.n, 12);
	cr_assert_eq(b.n, 12);
	cr_expect_eq(memcmp(a.tokens, b.tokens, sizeof(int32_t) * 12), 0);
	/* the prompt went through the chat template: the tokens say how long it was */
	char gerr[BD_GGUF_ERR_MAX];

	cr_assert_eq(bd_gguf_open(E.model, &g, gerr), 0);
	cr_assert_eq(bd_tokenizer_new_from_gguf(g, &tok, NULL), 0);
	bd_gguf_free(g);
	cr_assert_eq(bd_tokenizer_chat_apply(tok, &msg, 1, true, &ids, &n_ids, NULL), 0);
	expect_tokens(&a, n_ids, 5, 12);
	cr_assert_eq(bd_tokenizer_decode(tok, a.tokens, a.n, 1, &want, &want_len), 0);
	cr_expect_eq(a.text_len, want_len);
	cr_expect_eq(memcmp(a.text, want, want_len), 0, "streamed text != decoded tokens");
	cr_expect_eq(b.text_len, want_len);
	cr_expect_eq(memcmp(b.text, want, want_len), 0, "final text != decoded tokens");
	free(want);
	free(ids);
	bd_tokenizer_free(tok);
	bd_client_free(c);
	expect_no_violations();
}

Test(serve_router, stop_string_cuts_the_text)
{
	struct bd_client *c;
	struct result full, cut;
	int32_t ids[20];
	uint64_t tag;
	const char *stops[1];
	char stop[8];
	struct bd_client_gen g = { .max_tokens = 30, .stream = true, .n_stops = 1 };
	size_t at;

	up("16", "4", NULL);
	c = sv_client(&E);
	prompt_ids(ids, 20, 3);
	tag = generate(c, ids, 20, 30, 11, &full);
	cr_assert_eq(full.n, 30);
	cr_assert_gt(full.text_len, 20);
	/* a stop string taken from the middle of the full text; the answer ends right before
	 * its first occurrence */
	memcpy(stop, full.text + full.text_len / 2, 3);
	stop[3] = 0;
	at = (size_t)(strstr(full.text, stop) - full.text);
	stops[0] = stop;
	g.stops = stops;
	g.token_ids = ids;
	g.n_token_ids = 20;
	g.sampling.seed = 11;
	cr_assert_eq(bd_client_generate_start(c, &g, &tag), 0);
	collect(c, tag, &cut);
	cr_expect_eq(cut.finish, BD_FINISH_STOP_STRING);
	cr_expect_eq(cut.text_len, at, "text of %zu bytes, the stop string is at %zu",
		     cut.text_len, at);
	cr_expect_eq(memcmp(cut.text, full.text, at), 0);
	cr_expect_lt(cut.n, 30);
	cr_expect(sv_pool_idle(&E, WAIT_MS));
	bd_client_free(c);
}

Test(serve_router, concurrent_requests_preempt_and_recompute)
{
	static const char *const extra[] = { "--max-batch", "8", NULL };
	struct bd_client *c[4];
	struct result r;
	struct bd_client_info info;
	int32_t ids[4][120];
	uint64_t tag[4];
	uint32_t preempted = 0;

	/* 5 pages for 4 requests that each reach 120 + 200 = 320 tokens (2 pages of their own
	 * and a reserved third when they pass 255): not all fit at once */
	up("5", "4", extra);
	for (int i = 0; i < 4; i++) {
		c[i] = sv_client(&E);
		prompt_ids(ids[i], 120, i);
		tag[i] = start_ids(c[i], ids[i], 120, 200, 100 + (uint64_t)i, i % 2 == 0);
	}
	for (int i = 0; i < 4; i++) {
		collect(c[i], tag[i], &r);
		cr_expect_eq(r.finish, BD_FINISH_LENGTH, "request %d: finish %d: %s", i, r.finish,
			     r.message);
		expect_tokens(&r, 120, 100 + (uint64_t)i, 200);
		preempted += r.usage.preemptions;
	}
	cr_assert_eq(bd_client_info(c[0], WAIT_MS, &info), 0);
	cr_expect_gt(info.preemptions, 0, "5 pages cannot hold 4 such requests");
	cr_expect_eq(preempted, info.preemptions);
	cr_expect(sv_pool_idle(&E, WAIT_MS), "the pool still holds pages or slots");
	for (int i = 0; i < 4; i++)
		bd_client_free(c[i]);
	expect_no_violations();
}

/* --random-weights: no GGUF and no tokenizer. The model name, vocabulary and shape are
 * the preset's (Qwen3-4B: 151936 ids), the context the pool's max_seq_len (1024 here, not the
 * preset's 40960); text prompts are refused, token ids are served and chunks carry no text. */
Test(serve_router, random_weights_model_serves_token_ids_only)
{
	static const char *const extra[] = { "--random-weights", "qwen3-4b", NULL };
	struct bd_client *c;
	struct bd_client_info info;
	struct result r;
	struct bd_client_gen g = { .max_tokens = 4, .prompt = "hello" };
	int32_t ids[3] = { 151935, 49152, 7 }, past = 151936;
	uint64_t tag;

	fake_model = "qwen3-4b";
	up("16", "4", extra);
	c = sv_client(&E);
	cr_assert_eq(bd_client_info(c, WAIT_MS, &info), 0);
	cr_expect_str_eq(info.model, "qwen3-4b");
	cr_expect_str_eq(info.arch, "qwen3");
	cr_expect_eq(info.n_vocab, 151936);
	cr_expect_eq(info.n_ctx, 1024);

	cr_assert_eq(bd_client_generate_start(c, &g, &tag), 0);
	collect(c, tag, &r);
	cr_expect_eq(r.error, BD_SERVE_ERR_INVALID_ARGUMENT, "text prompt: %d %s", r.error,
		     r.message);
	cr_expect_not_null(strstr(r.message, "token_ids"), "%s", r.message);

	/* ids the GGUF's 49152-token vocabulary would refuse are the preset's */
	tag = generate(c, ids, 3, 5, 42, &r);
	cr_assert_eq(r.finish, BD_FINISH_LENGTH, "%d %s", r.error, r.message);
	expect_tokens(&r, 3, 42, 5);
	cr_expect_eq(r.text_len, 0);
	tag = generate(c, &past, 1, 5, 42, &r);
	cr_expect_eq(r.error, BD_SERVE_ERR_INVALID_ARGUMENT, "id = vocabulary: %s", r.message);
	bd_client_free(c);
	expect_no_violations();
	cr_expect(sv_pool_idle(&E, WAIT_MS));
}

Test(serve_router, bad_inputs_get_errors_and_leave_nothing)
{
	static const char *const extra[] = { "--max-frame-bytes", "4096", NULL };
	struct bd_client *c;
	struct bd_client_event ev;
	struct result r;
	int32_t ids[1100], bad = 49152, ok = 1000;
	struct bd_client_gen g = { .max_tokens = 4 };
	uint64_t tag;
	uint8_t junk[8000];

	up("16", "4", extra);
	c = sv_client(&E);
	prompt_ids(ids, 1100, 0);

	/* empty prompt (text) */
	g.prompt = "";
	cr_assert_eq(bd_client_generate_start(c, &g, &tag), 0);
	collect(c, tag, &r);
	cr_expect_eq(r.error, BD_SERVE_ERR_INVALID_ARGUMENT, "empty prompt: %d %s", r.error,
		     r.message);
	/* max_tokens 0 */
	g.prompt = "hello";
	g.max_tokens = 0;
	cr_assert_eq(bd_client_generate_start(c, &g, &tag), 0);
	collect(c, tag, &r);
	cr_expect_eq(r.error, BD_SERVE_ERR_INVALID_ARGUMENT, "max_tokens 0: %s", r.message);
	g.max_tokens = 4;
	/* prompt longer than the context (1024 here) */
	g.prompt = NULL;
	g.token_ids = ids;
	g.n_token_ids = 1100;
	cr_assert_eq(bd_client_generate_start(c, &g, &tag), 0);
	collect(c, tag, &r);
	cr_expect_eq(r.error, BD_SERVE_ERR_TOO_LONG, "too long: %d %s", r.error, r.message);
	/* a token id outside the vocabulary (49152 ids) */
	g.token_ids = &bad;
	g.n_token_ids = 1;
	cr_assert_eq(bd_client_generate_start(c, &g, &tag), 0);
	collect(c, tag, &r);
	cr_expect_eq(r.error, BD_SERVE_ERR_INVALID_ARGUMENT, "bad id: %s", r.message);
	cr_expect_not_null(strstr(r.message, "49152"), "the message names the id: %s", r.message);
	/* unknown KV configuration, and one whose pages the pool does not hold */
	g.token_ids = &ok;
	g.kv_config = "nvfp5";
	cr_assert_eq(bd_client_generate_start(c, &g, &tag), 0);
	collect(c, tag, &r);
	cr_expect_eq(r.error, BD_SERVE_ERR_UNKNOWN_KV_CONFIG);
	g.kv_config = "bitdecoding-mxfp4";
	cr_assert_eq(bd_client_generate_start(c, &g, &tag), 0);
	collect(c, tag, &r);
	cr_expect_eq(r.error, BD_SERVE_ERR_UNKNOWN_KV_CONFIG, "mxfp4 on nvfp4 pages: %s",
		     r.message);
	g.kv_config = NULL;
	/* frames that are not requests: garbage, an empty ClientRequest, one over the limit */
	memset(junk, 0xff, sizeof(junk));
	cr_assert_eq(bd_client_send_raw(c, junk, 16), 0);
	cr_assert_eq(bd_client_next(c, WAIT_MS, &ev), 0);
	cr_expect_eq(ev.kind, BD_CLIENT_ERROR);
	cr_expect_eq(ev.error, BD_SERVE_ERR_MALFORMED);
	cr_assert_eq(bd_client_send_raw(c, junk, 0), 0);
	cr_assert_eq(bd_client_next(c, WAIT_MS, &ev), 0);
	cr_expect_eq(ev.error, BD_SERVE_ERR_UNKNOWN_TYPE);
	cr_assert_eq(bd_client_send_raw(c, junk, sizeof(junk)), 0);
	cr_assert_eq(bd_client_next(c, WAIT_MS, &ev), 0);
	cr_expect_eq(ev.error, BD_SERVE_ERR_OVERSIZE);
	/* the daemon kept serving, and nothing was allocated for any of the above */
	cr_expect(sv_pool_idle(&E, WAIT_MS));
	tag = generate(c, ids, 10, 5, 9, &r);
	cr_expect_eq(r.finish, BD_FINISH_LENGTH, "a good request after bad ones: %s", r.message);
	expect_tokens(&r, 10, 9, 5);
	cr_expect(sv_pool_idle(&E, WAIT_MS));
	bd_client_free(c);
	expect_no_violations();
}

Test(serve_router, queue_bound_gives_resource_exhausted)
{
	static const char *const extra[] = { "--max-batch", "1", "--max-queue", "1", NULL };
	struct bd_client *c;
	struct result r[3];
	int32_t ids[8];
	uint64_t tag[3];

	up("16", "4", extra);
	F[0].delay_ms = 20;
	c = sv_client(&E);
	prompt_ids(ids, 8, 0);
	tag[0] = start_ids(c, ids, 8, 40, 1, true);
	{
		struct bd_client_event ev;

		cr_assert_eq(bd_client_next(c, WAIT_MS, &ev), 0); /* the first one runs */
	}
	for (int i = 1; i < 3; i++)
		tag[i] = start_ids(c, ids, 8, 40, 1, true);
	/* one runs, one waits in the queue, the third is refused at once */
	collect(c, tag[2], &r[2]);
	cr_expect_eq(r[2].error, BD_SERVE_ERR_RESOURCE_EXHAUSTED, "got %d: %s", r[2].error,
		     r[2].message);
	collect(c, tag[0], &r[0]);
	collect(c, tag[1], &r[1]);
	cr_expect_eq(r[0].n, 39, "the first chunk was read before collecting");
	cr_expect_eq(r[0].finish, BD_FINISH_LENGTH);
	cr_expect_eq(r[1].finish, BD_FINISH_LENGTH);
	cr_expect(sv_pool_idle(&E, WAIT_MS));
	bd_client_free(c);
}

Test(serve_router, cancel_mid_stream_releases_everything)
{
	struct bd_client *c;
	struct bd_client_event ev;
	int32_t ids[150];
	uint64_t tag;
	int chunks = 0;
	bool acked = false, final = false;

	c = up_slow(NULL);
	prompt_ids(ids, 150, 2);
	tag = start_ids(c, ids, 150, 500, 3, true);
	while (!acked || !final) {
		cr_assert_eq(bd_client_next(c, WAIT_MS, &ev), 0);
		if (ev.kind == BD_CLIENT_CHUNK && ev.finish == BD_FINISH_NONE && ++chunks == 5)
			cr_assert_eq(bd_client_cancel(c, tag), 0);
		if (ev.kind == BD_CLIENT_CANCELLED) {
			cr_expect_eq(ev.error, BD_SERVE_OK);
			acked = true;
		}
		if (ev.kind == BD_CLIENT_CHUNK && ev.finish != BD_FINISH_NONE) {
			cr_expect_eq(ev.finish, BD_FINISH_CANCELLED);
			cr_expect_eq(ev.error, BD_SERVE_ERR_CANCELLED);
			cr_expect_lt(ev.usage.completion_tokens, 500);
			final = true;
		}
	}
	cr_expect(sv_pool_idle(&E, WAIT_MS), "pages or the slot of a cancelled request kept");
	/* the workers are told to drop the sequence, at the latest with the next plan */
	tag = start_ids(c, ids, 4, 2, 3, true);
	{
		struct result r;

		collect(c, tag, &r);
		cr_expect_eq(r.finish, BD_FINISH_LENGTH);
	}
	cr_expect_geq(F[0].released, 1, "no release of the cancelled request reached rank 0");
	/* a second cancel of a finished tag */
	cr_assert_eq(bd_client_cancel(c, tag), 0);
	cr_assert_eq(bd_client_next(c, WAIT_MS, &ev), 0);
	cr_expect_eq(ev.kind, BD_CLIENT_CANCELLED);
	cr_expect_eq(ev.error, BD_SERVE_ERR_NOT_FOUND);
	bd_client_free(c);
	expect_no_violations();
}

Test(serve_router, client_disconnect_releases_everything)
{
	struct bd_client *c, *c2;
	struct result r;
	struct bd_client_info info;
	int32_t ids[140];

	c = up_slow(NULL);
	/* a streamed one and a non-streamed one (only keepalives reach that client) */
	start_long(c, ids, 140, 5, 3);
	bd_client_free(c);
	cr_expect(sv_pool_idle(&E, WAIT_MS), "a gone client's request still holds the pool");
	c = sv_client(&E);
	start_ids(c, ids, 140, 1000, 3, false);
	usleep(300000);
	bd_client_free(c);
	cr_expect(sv_pool_idle(&E, WAIT_MS), "a gone non-streaming client's request kept");
	c2 = sv_client(&E);
	cr_assert_eq(bd_client_info(c2, WAIT_MS, &info), 0);
	cr_expect_eq(info.running + info.queued, 0);
	generate(c2, ids, 10, 3, 1, &r);
	cr_expect_eq(r.finish, BD_FINISH_LENGTH);
	bd_client_free(c2);
	expect_no_violations();
}

Test(serve_router, deadline_fails_the_request)
{
	struct bd_client *c;
	struct result r;
	int32_t ids[10];
	uint64_t tag;
	struct bd_client_gen g = { .token_ids = ids, .n_token_ids = 10, .max_tokens = 1000,
				   .stream = true, .deadline_ms = 300 };

	up("16", "4", NULL);
	F[0].delay_ms = 20;
	c = sv_client(&E);
	prompt_ids(ids, 10, 0);
	cr_assert_eq(bd_client_generate_start(c, &g, &tag), 0);
	collect(c, tag, &r);
	cr_expect_eq(r.finish, BD_FINISH_ERROR);
	cr_expect_eq(r.error, BD_SERVE_ERR_DEADLINE_EXCEEDED, "got %d: %s", r.error, r.message);
	cr_expect_gt(r.n, 0);
	cr_expect_lt(r.n, 1000);
	cr_expect(sv_pool_idle(&E, WAIT_MS));
	bd_client_free(c);
}

Test(serve_router, worker_death_fails_clearly_and_serving_resumes)
{
	struct bd_client *c;
	struct bd_client_health h;
	struct result r;
	int32_t ids[140];
	uint64_t tag;
	int64_t t0;

	c = up_slow(NULL);
	tag = start_long(c, ids, 140, 7, 3);
	t0 = sv_now_ms();
	fake_kill(1);
	collect(c, tag, &r);
	cr_expect_eq(r.finish, BD_FINISH_ERROR);
	cr_expect_eq(r.error, BD_SERVE_ERR_WORKER_FAILED, "got %d: %s", r.error, r.message);
	cr_expect_not_null(strstr(r.message, "rank 1"), "the message names the rank: %s",
			   r.message);
	cr_expect_lt(sv_now_ms() - t0, 5000, "the failure took too long");
	cr_expect(sv_pool_idle(&E, WAIT_MS), "the failed request's pages were not released");
	cr_assert_eq(bd_client_health(c, WAIT_MS, &h), 0);
	cr_expect_not(h.healthy);
	cr_expect_eq(h.state, 2);
	/* new requests are refused while a rank is missing */
	tag = generate(c, ids, 10, 3, 1, &r);
	cr_expect_eq(r.error, BD_SERVE_ERR_UNAVAILABLE);
	/* the rank comes back: rank 0 was reset and registers again, the group forms anew */
	fake_start(1);
	sv_expect_healthy(&E, WAIT_MS, "no recovery");
	cr_expect_geq(F[0].resets, 1);
	cr_expect_geq(F[0].registrations, 2);
	tag = generate(c, ids, 10, 3, 1, &r);
	cr_expect_eq(r.finish, BD_FINISH_LENGTH, "after recovery: %s", r.message);
	expect_tokens(&r, 10, 1, 3);
	bd_client_free(c);
	expect_no_violations();
}

Test(serve_router, silent_worker_makes_the_router_unhealthy)
{
	up("16", "4", NULL);
	F[1].hang = true; /* connected but silent: only the heartbeat timeout sees it */
	cr_expect(sv_wait_health(&E, false, WAIT_MS), "a silent rank went unnoticed");
	F[1].hang = false;
	cr_expect(sv_wait_health(&E, true, WAIT_MS), "no recovery after the rank spoke again");
}

Test(serve_router, req_socket_client_and_sigterm_exit_zero)
{
	void *ctx = zmq_ctx_new(), *s = zmq_socket(ctx, ZMQ_REQ);
	Bdfp4__ClientRequest req = BDFP4__CLIENT_REQUEST__INIT;
	Bdfp4__HealthRequest hr = BDFP4__HEALTH_REQUEST__INIT;
	Bdfp4__ClientReply *rep;
	uint8_t buf[64], in[4096];
	int n, zero = 0, tmo = WAIT_MS;

	up("16", "4", NULL);
	/* a REQ socket adds an empty delimiter frame; the reply must carry it back */
	zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero));
	zmq_setsockopt(s, ZMQ_RCVTIMEO, &tmo, sizeof(tmo));
	cr_assert_eq(zmq_connect(s, E.front_ep), 0);
	req.msg_case = BDFP4__CLIENT_REQUEST__MSG_HEALTH;
	req.health = &hr;
	n = (int)bdfp4__client_request__pack(&req, buf);
	cr_assert_eq(zmq_send(s, buf, (size_t)n, 0), n);
	n = zmq_recv(s, in, sizeof(in), 0);
	cr_assert_gt(n, 0, "no reply to a REQ client");
	rep = bdfp4__client_reply__unpack(NULL, (size_t)n, in);
	cr_assert_not_null(rep);
	cr_expect_eq(rep->msg_case, BDFP4__CLIENT_REPLY__MSG_HEALTH);
	cr_expect(rep->health->healthy);
	cr_expect_eq(rep->health->n_workers, 2);
	bdfp4__client_reply__free_unpacked(rep, NULL);
	zmq_close(s);
	zmq_ctx_term(ctx);
	cr_expect_eq(sv_stop(&E.router, SIGTERM, WAIT_MS), 0, "routerd: SIGTERM must exit 0");
	cr_expect_eq(sv_stop(&E.pool, SIGTERM, WAIT_MS), 0, "kvpoold: SIGTERM must exit 0");
}

/* The Python client (clients/python/bdfp4_client.py, messages compiled from the same .proto by
 * protoc at test time) gets the tokens the fakes make for its prompt, in one JSON line as
 * `bdfp4 client --json --no-stream` prints it. */
Test(serve_router, python_client_from_the_same_proto)
{
	const char *py = getenv("BD_PYTHON");
	char cmd[5 * PATH_MAX], out[65536], gerr[BD_GGUF_ERR_MAX];
	struct bd_chat_msg msg = { "user", "Say hi" };
	struct bd_gguf *g;
	struct bd_tokenizer *tok;
	json_t *j, *toks;
	json_error_t jerr;
	int32_t *ids;
	size_t n_ids, n;
	FILE *p;

	if (!py || !*py)
		py = access("/usr/bin/python3", X_OK) == 0 ? "/usr/bin/python3" : "python3";
	up("16", "4", NULL);
	snprintf(cmd, sizeof(cmd),
		 "%s %s/clients/python/bdfp4_client.py --router %s --out-dir %s --proto-dir "
		 "%s/proto --json --no-stream --max-tokens 6 --seed 5 'Say hi' 2>&1",
		 py, E.root, E.front_ep, E.dir, E.root);
	p = popen(cmd, "r");
	cr_assert_not_null(p);
	n = fread(out, 1, sizeof(out) - 1, p);
	out[n] = 0;
	cr_assert_eq(pclose(p), 0, "%s failed:\n%s", cmd, out);
	j = json_loads(out, 0, &jerr);
	cr_assert_not_null(j, "not one JSON line: %s", out);
	cr_expect_str_eq(json_string_value(json_object_get(j, "finish")), "length");
	toks = json_object_get(j, "tokens");
	cr_assert_eq(json_array_size(toks), 6);
	cr_assert_eq(bd_gguf_open(E.model, &g, gerr), 0);
	cr_assert_eq(bd_tokenizer_new_from_gguf(g, &tok, NULL), 0);
	bd_gguf_free(g);
	cr_assert_eq(bd_tokenizer_chat_apply(tok, &msg, 1, true, &ids, &n_ids, NULL), 0);
	for (size_t i = 0; i < 6; i++)
		cr_expect_eq(json_integer_value(json_array_get(toks, i)),
			     fake_token(5, (int)(n_ids + i)), "token %zu", i);
	free(ids);
	bd_tokenizer_free(tok);
	json_decref(j);
	expect_no_violations();
}

/* ---- drain on SIGTERM, kvpoold's health ---------------------------------------------------- */

/* Polls health until pred holds; the last reply in *h. */
static bool wait_health_for(struct bd_client *c, bool (*pred)(const struct bd_client_health *),
			    int timeout_ms, struct bd_client_health *h)
{
	int64_t end = sv_now_ms() + timeout_ms;

	do {
		if (bd_client_health(c, 1000, h) == 0 && pred(h))
			return true;
		usleep(10000);
	} while (sv_now_ms() < end);
	return false;
}

static bool is_stopping(const struct bd_client_health *h)
{
	return h->state == 3;
}

static bool pool_down(const struct bd_client_health *h)
{
	return !h->pool_ok;
}

/* The router up as up_slow(extra) brings it; returns its client, and in *ret_watch a second
 * one, for health while the first one's requests run. */
static struct bd_client *up_watched(const char *const *extra, struct bd_client **ret_watch)
{
	struct bd_client *c = up_slow(extra);

	*ret_watch = sv_client(&E);
	return c;
}

/* kvpoold, failed at t0 under the running request tag of c, shows in health through watch
 * within within_ms (else what): unhealthy, degraded, the reason "kvpoold unreachable: …", a
 * pool error (the health in *h); and the request ends FINISH_ERROR, UNAVAILABLE, naming
 * kvpoold. */
static void expect_pool_down(struct bd_client *c, struct bd_client *watch, uint64_t tag,
			     int64_t t0, int within_ms, const char *what,
			     struct bd_client_health *h)
{
	struct result r;

	cr_assert(wait_health_for(watch, pool_down, WAIT_MS, h), "%s", what);
	cr_expect_lt(sv_now_ms() - t0, within_ms, "noticed after %lld ms",
		     (long long)(sv_now_ms() - t0));
	cr_expect_not(h->healthy);
	cr_expect_eq(h->state, 2);
	cr_expect_eq(strncmp(h->reason, "kvpoold unreachable: ", 21), 0, "reason: %s", h->reason);
	cr_expect_neq(h->pool_error[0], 0);
	collect(c, tag, &r);
	cr_expect_eq(r.finish, BD_FINISH_ERROR);
	cr_expect_eq(r.error, BD_SERVE_ERR_UNAVAILABLE, "got %d: %s", r.error, r.message);
	cr_expect_not_null(strstr(r.message, "kvpoold unreachable"), "message: %s", r.message);
}

/* Serving again: a request of c, 10 prompt tokens (prompt_ids of salt), runs to its 3 tokens
 * of this seed. */
static void expect_serving(struct bd_client *c, int salt, uint64_t seed)
{
	int32_t ids[10];
	struct result r;

	prompt_ids(ids, 10, salt);
	generate(c, ids, 10, 3, seed, &r);
	cr_expect_eq(r.finish, BD_FINISH_LENGTH, "after recovery: %d %s", r.error, r.message);
	expect_tokens(&r, 10, seed, 3);
}

/* SIGTERM to the router, then health (asked through c) says STOPPING; its reply in *h. */
static void sigterm_until_stopping(struct bd_client *c, struct bd_client_health *h)
{
	cr_assert_eq(kill(E.router.pid, SIGTERM), 0);
	cr_assert(wait_health_for(c, is_stopping, WAIT_MS, h), "no STOPPING state; log:\n%s",
		  sv_log_tail(&E.router));
}

/* SIGTERM with one request running and one queued (max_batch 1): both run to their end with
 * every token, a request sent during the drain is refused with SHUTTING_DOWN, health says
 * STOPPING, routerd exits 0 and the pool gets every page and slot back. */
Test(serve_router, sigterm_drains_running_and_queued_requests)
{
	const char *extra[] = { "--max-batch", "1", NULL };
	struct bd_client *ca, *cb, *cc;
	struct bd_client_health h;
	struct bd_client_info info;
	struct result ra, rb, rc;
	int32_t ids[10];
	uint64_t ta, tb, tc;
	size_t early;

	up("16", "4", extra);
	F[0].delay_ms = 5; /* 300 steps of A take 1.5 s at least */
	ca = sv_client(&E);
	cb = sv_client(&E);
	cc = sv_client(&E);
	prompt_ids(ids, 10, 1);
	ta = start_ids(ca, ids, 10, 300, 11, true);
	early = read_tokens(ca, ta, 3);
	tb = start_ids(cb, ids, 10, 20, 12, true);
	/* B travels on another connection: wait until the router has it */
	for (int64_t end = sv_now_ms() + WAIT_MS; sv_now_ms() < end; usleep(5000)) {
		cr_assert_eq(bd_client_info(cc, WAIT_MS, &info), 0);
		if (info.queued)
			break;
	}
	cr_assert_eq(info.running, 1);
	cr_assert_eq(info.queued, 1, "B must wait behind A (max_batch 1)");

	sigterm_until_stopping(cc, &h);
	cr_expect_not(h.healthy);
	cr_expect_not_null(strstr(h.reason, "draining"), "reason: %s", h.reason);
	tc = start_ids(cc, ids, 10, 5, 13, true);
	collect(cc, tc, &rc);
	cr_expect_eq(rc.finish, BD_FINISH_ERROR);
	cr_expect_eq(rc.error, BD_SERVE_ERR_SHUTTING_DOWN, "got %d: %s", rc.error, rc.message);
	cr_expect_not_null(strstr(rc.message, "shutting down"), "message: %s", rc.message);

	/* A: the tokens after the first `early` ones; the fake's token at position p is known */
	collect(ca, ta, &ra);
	cr_expect_eq(ra.finish, BD_FINISH_LENGTH, "A: %d %s", ra.error, ra.message);
	cr_assert_eq(early + ra.n, 300);
	for (size_t i = 0; i < ra.n; i++)
		cr_assert_eq((uint32_t)ra.tokens[i], fake_token(11, (int)(10 + early + i)),
			     "A token %zu", early + i);
	cr_expect_eq(ra.usage.completion_tokens, 300);
	collect(cb, tb, &rb);
	cr_expect_eq(rb.finish, BD_FINISH_LENGTH, "B: %d %s", rb.error, rb.message);
	expect_tokens(&rb, 10, 12, 20);

	cr_expect_eq(sv_stop(&E.router, 0, WAIT_MS), 0, "routerd must exit 0 after the drain:\n%s",
		     sv_log_tail(&E.router));
	cr_expect(sv_pool_idle(&E, WAIT_MS), "pages or slots were not given back");
	bd_client_free(ca);
	bd_client_free(cb);
	bd_client_free(cc);
	expect_no_violations();
}

/* drain_timeout_ms = 500 and a request of 1000 tokens at 10 ms a step: it goes on during the
 * drain, then fails with SHUTTING_DOWN about 0.5 s after SIGTERM; exit 0, pages back. */
Test(serve_router, drain_timeout_fails_what_is_left)
{
	const char *extra[] = { "--drain-timeout-ms", "500", NULL };
	struct bd_client *c;
	struct result r;
	int32_t ids[10];
	uint64_t tag;
	int64_t t0, dt;

	c = up_slow(extra);
	tag = start_long(c, ids, 10, 2, 21);
	t0 = sv_now_ms();
	cr_assert_eq(kill(E.router.pid, SIGTERM), 0);
	collect(c, tag, &r);
	dt = sv_now_ms() - t0;
	cr_expect_eq(r.finish, BD_FINISH_ERROR);
	cr_expect_eq(r.error, BD_SERVE_ERR_SHUTTING_DOWN, "got %d: %s", r.error, r.message);
	/* 500 ms at >= 10 ms a step: at most ~50 tokens, and surely more than a few */
	cr_expect_geq(r.n, 10, "only %zu tokens during the drain", r.n);
	cr_expect_geq(dt, 450, "failed %lld ms after SIGTERM, before the drain time",
		      (long long)dt);
	cr_expect_lt(dt, 3000, "failed %lld ms after SIGTERM", (long long)dt);
	cr_expect_eq(sv_stop(&E.router, 0, WAIT_MS), 0, "routerd:\n%s", sv_log_tail(&E.router));
	cr_expect(sv_pool_idle(&E, WAIT_MS), "pages or slots were not given back");
	bd_client_free(c);
	expect_no_violations();
}

/* The default drain (30 s) under way: the router up, a long streamed request of *c running
 * (prompt salt, seed), SIGTERM sent, and health through *c2 saying STOPPING. Returns the
 * request's tag. */
static uint64_t draining(struct bd_client **c, struct bd_client **c2, int salt, uint64_t seed)
{
	struct bd_client_health h;
	int32_t ids[10];
	uint64_t tag;

	*c = up_watched(NULL, c2);
	tag = start_long(*c, ids, 10, salt, seed);
	sigterm_until_stopping(*c2, &h);
	return tag;
}

/* The drain ended: routerd exits 0 within within_ms of t0 (else what), the pool has every page
 * and slot back; the clients are freed. */
static void expect_drain_end(struct bd_client *c, struct bd_client *c2, int64_t t0,
			     int within_ms, const char *what)
{
	cr_expect_eq(sv_stop(&E.router, 0, WAIT_MS), 0, "routerd:\n%s", sv_log_tail(&E.router));
	cr_expect_lt(sv_now_ms() - t0, within_ms, "%s", what);
	cr_expect(sv_pool_idle(&E, WAIT_MS), "pages or slots were not given back");
	bd_client_free(c);
	bd_client_free(c2);
}

/* A second SIGTERM ends the drain at once. */
Test(serve_router, second_sigterm_stops_at_once)
{
	struct bd_client *c, *c2;
	struct result r;
	uint64_t tag = draining(&c, &c2, 3, 31);
	int64_t t0 = sv_now_ms();

	cr_assert_eq(kill(E.router.pid, SIGTERM), 0);
	collect(c, tag, &r);
	cr_expect_eq(r.error, BD_SERVE_ERR_SHUTTING_DOWN, "got %d: %s", r.error, r.message);
	expect_drain_end(c, c2, t0, 2000, "the second SIGTERM did not stop at once");
}

/* kvpoold killed under a running request: health turns unhealthy with the pool's reason within
 * a few seconds, the running request fails with UNAVAILABLE, a new one is refused at once (not
 * after pool_timeout_ms), routerd stays up; a new kvpoold makes it healthy and serving again. */
Test(serve_router, kvpoold_death_shows_in_health_and_refuses_fast)
{
	const char *pool_extra[] = { "--layers", "1", "--pages", "16", "--slots", "4",
				     "--max-seq-len", "1024", NULL };
	struct bd_client *c2, *c = up_watched(NULL, &c2);
	struct bd_client_health h;
	struct result r;
	int32_t ids[10];

	/* pool_timeout_ms 2000, pool_probe_ms 1000: the defaults */
	cr_assert_eq(bd_client_health(c2, WAIT_MS, &h), 0);
	cr_expect(h.pool_ok);
	cr_expect_str_eq(h.pool_error, "");
	cr_expect_lt(h.pool_last_ok_ms, 3000, "the probe keeps it fresh");
	uint64_t tag = start_long(c, ids, 10, 4, 41);

	int64_t t0 = sv_now_ms();
	cr_expect_eq(sv_stop(&E.pool, SIGKILL, WAIT_MS), 128 + SIGKILL);
	expect_pool_down(c, c2, tag, t0, 4000, "the pool's death went unnoticed", &h);

	/* refused at once, not after one or more pool timeouts of 2 s */
	t0 = sv_now_ms();
	generate(c, ids, 10, 3, 42, &r);
	cr_expect_eq(r.error, BD_SERVE_ERR_UNAVAILABLE, "got %d: %s", r.error, r.message);
	cr_expect_not_null(strstr(r.message, "kvpoold unreachable"), "message: %s", r.message);
	cr_expect_lt(sv_now_ms() - t0, 500, "refusal took %lld ms", (long long)(sv_now_ms() - t0));
	cr_expect_eq(kill(E.router.pid, 0), 0, "routerd must stay up");
	cr_expect_eq(bd_client_health(c2, WAIT_MS, &h), 0);
	cr_expect_not(h.pool_ok);

	/* a new kvpoold (as systemd restarts it): healthy again, and serving */
	sv_start_pool(&E, pool_extra);
	sv_expect_healthy(&E, WAIT_MS, "no recovery");
	cr_assert_eq(bd_client_health(c2, WAIT_MS, &h), 0);
	cr_expect(h.pool_ok);
	cr_expect_str_eq(h.reason, "");
	expect_serving(c, 4, 43);
	cr_expect(sv_pool_idle(&E, WAIT_MS));
	bd_client_free(c);
	bd_client_free(c2);
}

/* kvpoold hung (SIGSTOP): the connection stays, only the probe's timeout sees it; the requests
 * fail with UNAVAILABLE and their records stay in the pool. SIGCONT: the router reclaims them,
 * the pool ends idle, and serving resumes. */
Test(serve_router, hung_kvpoold_times_out_then_records_are_reclaimed)
{
	const char *extra[] = { "--pool-timeout-ms", "500", "--pool-probe-ms", "200", NULL };
	struct bd_client *c2, *c = up_watched(extra, &c2);
	struct bd_client_health h;
	int32_t ids[140];

	/* 140 tokens fill a page at prefill: the request holds a page and a slot */
	uint64_t tag = start_long(c, ids, 140, 5, 51);
	int64_t t0 = sv_now_ms();
	cr_assert_eq(kill(E.pool.pid, SIGSTOP), 0);
	expect_pool_down(c, c2, tag, t0, 3000, "a hung pool went unnoticed", &h);
	cr_expect_not_null(strstr(h.pool_error, "no answer"), "pool_error: %s", h.pool_error);
	cr_assert_eq(kill(E.pool.pid, SIGCONT), 0);
	sv_expect_healthy(&E, WAIT_MS, "no recovery");
	cr_expect(sv_pool_idle(&E, WAIT_MS), "the failed request's records were not reclaimed");
	expect_serving(c, 5, 52);
	bd_client_free(c);
	bd_client_free(c2);
	expect_no_violations();
}

/* A worker lost during the drain ends it: nothing can progress without the group (a stop of
 * the whole server stops the workers too), so routerd exits 0 at once, not after 30 s. */
Test(serve_router, worker_loss_ends_the_drain)
{
	struct bd_client *c, *c2;
	struct result r;
	uint64_t tag = draining(&c, &c2, 6, 61);
	int64_t t0 = sv_now_ms();

	fake_kill(1);
	collect(c, tag, &r);
	cr_expect_eq(r.finish, BD_FINISH_ERROR);
	cr_expect_eq(r.error, BD_SERVE_ERR_WORKER_FAILED, "got %d: %s", r.error, r.message);
	expect_drain_end(c, c2, t0, 5000, "the drain went on without workers");
}

/* The drain tells systemd: STOPPING=1, then STATUS=draining N requests. (The router is started
 * here with its notify socket kept open and read.) */
Test(serve_router, drain_status_goes_to_sd_notify)
{
	const char *pool_extra[] = { "--layers", "1", "--pages", "16", "--slots", "4",
				     "--max-seq-len", "1024", NULL };
	const char *argv[] = { "--no-config", "--frontend", E.front_ep, "--workers", E.workers_ep,
			       "--pool", E.pool_ep, "--model", E.model, "--tp", "2",
			       "--heartbeat-ms", "100", "--status-interval-ms", "100", "--http", "",
			       NULL };
	struct bd_client *c;
	int32_t ids[10];

	sv_start_pool(&E, pool_extra);
	sv_spawn(&E, &E.router, "routerd", argv);
	cr_assert(sv_wait_notify(&E.router, "READY=1", WAIT_MS), "%s", sv_log_tail(&E.router));
	fake_start(0);
	fake_start(1);
	sv_expect_healthy(&E, WAIT_MS, "the group did not form");
	F[0].delay_ms = 10;
	c = sv_client(&E);
	start_long(c, ids, 10, 7, 71);
	cr_assert_eq(kill(E.router.pid, SIGTERM), 0);
	cr_expect(sv_wait_notify(&E.router, "STOPPING=1", WAIT_MS));
	cr_expect(sv_wait_notify(&E.router, "STATUS=draining 1 requests (1 running, 0 queued)",
				 WAIT_MS), "no draining STATUS");
	cr_assert_eq(kill(E.router.pid, SIGTERM), 0); /* the second: at once */
	cr_expect_eq(sv_stop(&E.router, 0, WAIT_MS), 0);
	bd_client_free(c);
}

/* ---- who may talk to the router, and what a refusal of the pool says ----------------------- */

/* The router's ipc sockets get socket_mode (0660) whatever the umask it starts under, and a
 * client of another uid (65534, not in the group) is refused at once with permission denied,
 * not after a timeout. */
Test(serve_router, sockets_are_0660_whatever_the_umask_and_another_uid_is_refused_fast)
{
	mode_t old = umask(0);
	struct stat st;
	pid_t child;
	int st_child;

	up("16", "4", NULL);
	umask(old);
	cr_assert_eq(stat(E.front_ep + 6, &st), 0);
	cr_expect_eq(st.st_mode & 0777, 0660, "frontend socket mode %o", st.st_mode & 0777);
	cr_assert_eq(stat(E.workers_ep + 6, &st), 0);
	cr_expect_eq(st.st_mode & 0777, 0660, "worker socket mode %o", st.st_mode & 0777);
	if (geteuid() != 0)
		cr_skip_test("needs root to act as another user (uid 65534)");
	cr_assert_eq(chmod(E.dir, 0711), 0); /* the sockets' own modes must refuse */
	child = fork();
	cr_assert_geq(child, 0);
	if (child == 0) {
		struct bd_client *c;
		int64_t t0 = sv_now_ms();

		if (setgroups(0, NULL) < 0 || setgid(65534) < 0 || setuid(65534) < 0)
			_exit(10);
		if (bd_client_new(E.front_ep, &c) != -EACCES)
			_exit(1);
		_exit(sv_now_ms() - t0 < 2000 ? 0 : 2);
	}
	cr_assert_eq(waitpid(child, &st_child, 0), child);
	cr_expect(WIFEXITED(st_child) && WEXITSTATUS(st_child) == 0, "uid 65534: child status %d",
		  st_child);
	expect_serving(sv_client(&E), 5, 51);
}

/* A request the pool could hold but cannot take now fails with a message that says why: this
 * router's quota spent (owner_max_pages) is not "other owners hold the room", and neither is the
 * frontend's "needs N pages; the pool has M" of a request that can never fit. */
Test(serve_router, a_quota_refusal_says_quota_not_that_the_request_cannot_fit)
{
	const char *pool_extra[] = { "--layers", "1", "--pages", "16", "--slots", "4",
				     "--max-seq-len", "1024", "--owner-max-pages", "1", NULL };
	const char *args[] = { "--resume-timeout-ms", "0", NULL };
	struct bd_client *c;
	struct result r;
	int32_t ids[300];

	sv_start_pool(&E, pool_extra);
	sv_start_router(&E, args);
	fake_start(0);
	fake_start(1);
	sv_expect_healthy(&E, WAIT_MS, "the group did not form");
	c = sv_client(&E);
	prompt_ids(ids, 300, 3); /* two full pages at prefill */
	generate(c, ids, 300, 2, 61, &r);
	cr_expect_eq(r.error, BD_SERVE_ERR_RESOURCE_EXHAUSTED, "got %d: %s", r.error, r.message);
	cr_expect_not_null(strstr(r.message, "quota"), "message: %s", r.message);
	cr_expect_null(strstr(r.message, "other owners"), "message: %s", r.message);
	/* within its quota it serves */
	expect_serving(c, 6, 62);
	bd_client_free(c);
}

Test(serve_router, a_pool_held_by_other_owners_says_so)
{
	struct bd_pool_conn *pc;
	struct bd_client *c;
	struct result r;
	int32_t ids[300], pages[8];

	up("16", "4", NULL);
	c = sv_client(&E);
	cr_assert_eq(bd_pool_conn_new(E.pool_ep, 5000, &pc), 0);
	cr_assert_eq(bd_pool_page_alloc(pc, 900, 99, 8, pages), 0);
	cr_assert_eq(bd_pool_page_alloc(pc, 901, 99, 8, pages), 0);
	prompt_ids(ids, 300, 3);
	generate(c, ids, 300, 2, 63, &r);
	cr_expect_eq(r.error, BD_SERVE_ERR_RESOURCE_EXHAUSTED, "got %d: %s", r.error, r.message);
	cr_expect_not_null(strstr(r.message, "other owners"), "message: %s", r.message);
	cr_expect_null(strstr(r.message, "quota"), "message: %s", r.message);
	/* once they are gone it serves */
	cr_assert_eq(bd_pool_owner_reclaim(pc, 99, NULL, NULL), 0);
	expect_serving(c, 7, 64);
	bd_pool_conn_free(pc);
	bd_client_free(c);
}
