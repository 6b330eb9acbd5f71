/* test_workerd.c — the worker daemon on its own: a real kvpoold, two real workerd (TP = 2, the
 * embedded SmolLM2) and this test as their router, speaking proto/serve.proto's worker
 * protocol directly, so every message and every bad plan is under the test's control.
 * Suite "workerd".
 *
 * Daemons come from $BD_BIN (the Makefile's unit-run sets it), else ../bin beside this test
 * binary; each test gets a private temp dir (attach socket, ipc:// endpoints, all-reduce file,
 * notify sockets, logs); the daemons die with the test process (PR_SET_PDEATHSIG) and are
 * killed in .fini; every wait is bounded.
 *
 * The router side allocates nothing from kvpoold here: page and slot ids are named by the plans
 * as a router would after allocating them, which is all a worker sees.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <zmq.h>

#include "base/bd_clock.h"
#include "model/bd_forward.h"
#include "model/bd_sampler.h"
#include "pool/bd_pool_client.h"
#include "serve/bd_wire.h"
#include "serve.pb-c.h"
#include "spawn.h"

#define TIMEOUT_MS 60000 /* model loads under ASan on a busy machine */
#define N_PAGES 24
#define N_SLOTS 4

static struct {
	char dir[40], bin[PATH_MAX], pool_sock[96], workers_ep[128], model[PATH_MAX];
	char notify[2][96], log[3][96];
	pid_t pool_pid, w_pid[2];
	int notify_fd[2];
	void *zctx, *router;
	uint8_t ident[2][256];
	size_t ident_len[2];
	int64_t next_hb;
} T;

static void init(void)
{
	const char *bin = getenv("BD_BIN"), *src = getenv("BD_SRCDIR"), *model = getenv("BD_MODEL");
	char exe[PATH_MAX - 16];

	memset(&T, 0, sizeof(T));
	T.notify_fd[0] = T.notify_fd[1] = -1;
	if (bin && *bin) {
		snprintf(T.bin, sizeof(T.bin), "%s", bin);
	} else {
		ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
		cr_assert_gt(n, 0);
		exe[n] = 0;
		*strrchr(exe, '/') = 0;
		snprintf(T.bin, sizeof(T.bin), "%s/../bin", exe);
	}
	if (model && *model)
		snprintf(T.model, sizeof(T.model), "%s", model);
	else
		snprintf(T.model, sizeof(T.model), "%s/models/SmolLM2-135M-Instruct.Q4_1.gguf",
			 src && *src ? src : ".");
	char dir[sizeof(T.dir)] = "/tmp/bdfp4-wd-XXXXXX";
	cr_assert_not_null(mkdtemp(dir));
	memcpy(T.dir, dir, sizeof(dir));
	snprintf(T.pool_sock, sizeof(T.pool_sock), "%s/kvpool.sock", dir);
	snprintf(T.workers_ep, sizeof(T.workers_ep), "ipc://%s/workers.sock", dir);
	snprintf(T.log[2], sizeof(T.log[2]), "%s/kvpoold.log", dir);
	for (int r = 0; r < 2; r++) {
		snprintf(T.notify[r], sizeof(T.notify[r]), "%s/notify%d.sock", dir, r);
		snprintf(T.log[r], sizeof(T.log[r]), "%s/workerd%d.log", dir, r);
		T.notify_fd[r] = sp_notify_open(T.notify[r]);
		cr_assert_geq(T.notify_fd[r], 0);
	}
	T.zctx = zmq_ctx_new();
	T.router = zmq_socket(T.zctx, ZMQ_ROUTER);
	int linger = 0, mandatory = 1;
	zmq_setsockopt(T.router, ZMQ_LINGER, &linger, sizeof(linger));
	zmq_setsockopt(T.router, ZMQ_ROUTER_MANDATORY, &mandatory, sizeof(mandatory));
	cr_assert_eq(zmq_bind(T.router, T.workers_ep), 0);
}

static void kill_reap(pid_t *pid)
{
	if (*pid > 0)
		sp_reap(*pid, 0);
	*pid = 0;
}

static void fini(void)
{
	char cmd[128];
	kill_reap(&T.w_pid[0]);
	kill_reap(&T.w_pid[1]);
	kill_reap(&T.pool_pid);
	for (int r = 0; r < 2; r++)
		if (T.notify_fd[r] >= 0)
			close(T.notify_fd[r]);
	if (T.router)
		zmq_close(T.router);
	if (T.zctx)
		zmq_ctx_term(T.zctx);
	if (getenv("BD_KEEP_TMP")) /* debugging: keep the logs */
		return;
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", T.dir);
	if (system(cmd) != 0)
		fprintf(stderr, "could not remove %s\n", T.dir);
}

TestSuite(workerd, .init = init, .fini = fini, .timeout = 300);

static pid_t spawn(const char *prog, const char *const *args, const char *log,
		   const char *notify)
{
	const char *argv[40];
	char path[PATH_MAX + 16];
	size_t n = 0;

	snprintf(path, sizeof(path), "%s/%s", T.bin, prog);
	cr_assert_eq(access(path, X_OK), 0, "no %s at %s (set BD_BIN)", prog, path);
	argv[n++] = path;
	for (size_t i = 0; args[i]; i++)
		argv[n++] = args[i];
	argv[n] = NULL;
	pid_t pid = sp_spawn(argv, log, notify, NULL);
	cr_assert_geq(pid, 0);
	return pid;
}

static void start_pool(void)
{
	char endpoint[128], pages[16], slots[16];
	snprintf(endpoint, sizeof(endpoint), "ipc://%s/alloc.sock", T.dir);
	snprintf(pages, sizeof(pages), "%d", N_PAGES);
	snprintf(slots, sizeof(slots), "%d", N_SLOTS);
	const char *args[] = { "--no-config", "--socket", T.pool_sock, "--endpoint", endpoint,
			       "--tp", "2", "--layers", "30", "--kv-heads", "3", "--head-dim",
			       "64", "--kv-config", "bitdecoding-nvfp4", "--pages", pages,
			       "--slots", slots, "--max-seq-len", "1024", NULL };
	T.pool_pid = spawn("kvpoold", args, T.log[2], NULL);
	/* ready when the attach socket accepts */
	for (int64_t end = bd_now_ms() + TIMEOUT_MS; bd_now_ms() < end; usleep(20000)) {
		struct sockaddr_un sa = { .sun_family = AF_UNIX };
		int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
		snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", T.pool_sock);
		int ok = connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0;
		close(fd);
		if (ok)
			return;
		cr_assert_eq(waitpid(T.pool_pid, NULL, WNOHANG), 0, "kvpoold exited (log %s)",
			     T.log[2]);
	}
	cr_assert_fail("kvpoold did not start (log %s)", T.log[2]);
}

static void start_worker(int rank)
{
	char r[8];
	snprintf(r, sizeof(r), "%d", rank);
	const char *args[] = { "--no-config", "--rank", r, "--tp", "2", "--model", T.model,
			       "--pool-socket", T.pool_sock, "--router", T.workers_ep,
			       "--allreduce-dir", T.dir, "--allreduce-timeout-ms", "20000", NULL };
	T.w_pid[rank] = spawn("workerd", args, T.log[rank], T.notify[rank]);
}

/* A datagram of rank's notify socket that holds what, within timeout_ms (false also when the
 * rank exits first). */
static bool got_notify(int rank, const char *what, int timeout_ms)
{
	return sp_wait_notify(T.notify_fd[rank], &T.w_pid[rank], what, timeout_ms);
}

/* ---- the router side -------------------------------------------------------------------- */

static void send_to(int rank, const Bdfp4__RouterMessage *m)
{
	cr_assert_eq(bd_wire_send(T.router, T.ident[rank], T.ident_len[rank], false, &m->base, 0),
		     0);
}

static void send_raw(int rank, const void *buf, size_t n)
{
	zmq_send(T.router, T.ident[rank], T.ident_len[rank], ZMQ_SNDMORE);
	zmq_send(T.router, buf, n, 0);
}

/* Receive the next message that is not a heartbeat, keeping the workers' silence timers fed
 * with router heartbeats meanwhile. *ret_ident_rank: the rank whose identity sent it (-1 when
 * unknown: a registration). Returns NULL on timeout. */
static Bdfp4__WorkerMessage *recv_msg(int timeout_ms, uint8_t *ret_ident, size_t *ret_len)
{
	for (int64_t end = bd_now_ms() + timeout_ms; bd_now_ms() < end;) {
		if (bd_now_ms() >= T.next_hb) {
			Bdfp4__RouterMessage m = BDFP4__ROUTER_MESSAGE__INIT;
			Bdfp4__RouterHeartbeat hb = BDFP4__ROUTER_HEARTBEAT__INIT;
			m.msg_case = BDFP4__ROUTER_MESSAGE__MSG_HEARTBEAT;
			m.heartbeat = &hb;
			uint8_t buf[16];
			size_t n = bdfp4__router_message__pack(&m, buf);
			for (int r = 0; r < 2; r++)
				if (T.ident_len[r] && zmq_send(T.router, T.ident[r], T.ident_len[r],
							      ZMQ_SNDMORE | ZMQ_DONTWAIT) >= 0)
					zmq_send(T.router, buf, n, ZMQ_DONTWAIT);
			T.next_hb = bd_now_ms() + 200;
		}
		zmq_pollitem_t it = { T.router, 0, ZMQ_POLLIN, 0 };
		if (zmq_poll(&it, 1, 50) <= 0)
			continue;
		uint8_t id[256], body[1 << 16];
		int il = zmq_recv(T.router, id, sizeof(id), 0);
		int bl = zmq_recv(T.router, body, sizeof(body), 0);
		cr_assert(il > 0 && bl >= 0 && bl <= (int)sizeof(body));
		Bdfp4__WorkerMessage *m = bdfp4__worker_message__unpack(NULL, (size_t)bl, body);
		cr_assert_not_null(m, "a worker sent a malformed frame");
		if (m->msg_case == BDFP4__WORKER_MESSAGE__MSG_HEARTBEAT) {
			bdfp4__worker_message__free_unpacked(m, NULL);
			continue;
		}
		memcpy(ret_ident, id, (size_t)il);
		*ret_len = (size_t)il;
		return m;
	}
	return NULL;
}

/* Both ranks register; answer them (epoch, all-reduce name). */
static void form_group(uint64_t epoch, const char *ar_name)
{
	bool seen[2] = { false, false };
	while (!seen[0] || !seen[1]) {
		uint8_t id[256];
		size_t il;
		Bdfp4__WorkerMessage *m = recv_msg(TIMEOUT_MS, id, &il);
		cr_assert_not_null(m, "no registration from rank %d (logs in %s)", seen[0] ? 1 : 0,
				   T.dir);
		cr_assert_eq(m->msg_case, BDFP4__WORKER_MESSAGE__MSG_REGISTER_REQUEST);
		Bdfp4__RegisterRequest *rq = m->register_request;
		cr_assert(rq->rank == 0 || rq->rank == 1);
		cr_assert_eq(rq->version, 1);
		cr_assert_eq(rq->tp, 2);
		cr_assert_str_eq(rq->backend, "cpu");
		cr_assert_eq(rq->device, -1);
		cr_assert_str_eq(rq->model, "SmolLM2-135M-Instruct.Q4_1.gguf");
		cr_assert_eq(rq->n_vocab, 49152);
		cr_assert_eq(rq->n_layers, 30);
		cr_assert_str_eq(rq->kv_config, "bitdecoding-nvfp4");
		cr_assert_eq(rq->nccl_unique_id.len, 0, "no NCCL on the cpu backend");
		cr_assert_eq(rq->pid, T.w_pid[rq->rank]);
		memcpy(T.ident[rq->rank], id, il);
		T.ident_len[rq->rank] = il;
		seen[rq->rank] = true;
		bdfp4__worker_message__free_unpacked(m, NULL);
	}
	/* the router's part: the epoch's attach tokens, registered with kvpoold first */
	uint8_t tokens[2 * BD_POOL_TOKEN_BYTES];
	struct bd_pool_conn *pc;
	char ep[128];

	for (size_t i = 0; i < sizeof(tokens); i++)
		tokens[i] = (uint8_t)(epoch * 31 + i);
	snprintf(ep, sizeof(ep), "ipc://%s/alloc.sock", T.dir);
	cr_assert_eq(bd_pool_conn_new(ep, 5000, &pc), 0);
	cr_assert_eq(bd_pool_group_register(pc, 1, epoch, tokens, 2), 0, "%s",
		     bd_pool_conn_error(pc, NULL));
	bd_pool_conn_free(pc);
	for (int r = 0; r < 2; r++) {
		Bdfp4__RouterMessage m = BDFP4__ROUTER_MESSAGE__INIT;
		Bdfp4__RegisterReply rr = BDFP4__REGISTER_REPLY__INIT;
		rr.version = 1;
		rr.epoch = epoch;
		rr.attach_token = (ProtobufCBinaryData){ BD_POOL_TOKEN_BYTES,
							 tokens + r * BD_POOL_TOKEN_BYTES };
		rr.rank = r;
		rr.tp = 2;
		rr.allreduce_name = (char *)ar_name;
		rr.heartbeat_ms = 100;
		rr.owner = 1;
		m.msg_case = BDFP4__ROUTER_MESSAGE__MSG_REGISTER_REPLY;
		m.register_reply = &rr;
		send_to(r, &m);
	}
}

/* Send plan to both ranks; collect both StepResults into res[2]. */
static void step(const Bdfp4__StepPlan *plan, Bdfp4__StepResult *res[2])
{
	Bdfp4__RouterMessage m = BDFP4__ROUTER_MESSAGE__INIT;
	m.msg_case = BDFP4__ROUTER_MESSAGE__MSG_PLAN;
	m.plan = (Bdfp4__StepPlan *)plan;
	res[0] = res[1] = NULL;
	send_to(0, &m);
	send_to(1, &m);
	while (!res[0] || !res[1]) {
		uint8_t id[256];
		size_t il;
		Bdfp4__WorkerMessage *w = recv_msg(TIMEOUT_MS, id, &il);
		cr_assert_not_null(w, "step %llu not answered (logs in %s)",
				   (unsigned long long)plan->step, T.dir);
		/* a worker that heard nothing for a second after registering (this process was
		 * descheduled on a loaded machine) repeats its register: not an error here */
		if (w->msg_case == BDFP4__WORKER_MESSAGE__MSG_REGISTER_REQUEST &&
		    w->register_request->pid == T.w_pid[w->register_request->rank & 1]) {
			bdfp4__worker_message__free_unpacked(w, NULL);
			continue;
		}
		cr_assert_eq(w->msg_case, BDFP4__WORKER_MESSAGE__MSG_RESULT,
			     "step %llu: message %d (a register from rank %d?)",
			     (unsigned long long)plan->step, w->msg_case,
			     w->msg_case == BDFP4__WORKER_MESSAGE__MSG_REGISTER_REQUEST
				     ? w->register_request->rank : -1);
		Bdfp4__StepResult *r = w->result;
		cr_assert(r->rank == 0 || r->rank == 1);
		cr_assert_eq(r->step, plan->step);
		cr_assert_null(res[r->rank]);
		w->result = NULL;
		w->msg_case = BDFP4__WORKER_MESSAGE__MSG__NOT_SET;
		bdfp4__worker_message__free_unpacked(w, NULL);
		res[r->rank] = r;
	}
}

static void free_results(Bdfp4__StepResult *res[2])
{
	for (int r = 0; r < 2; r++)
		bdfp4__step_result__free_unpacked(res[r], NULL);
}

struct row_spec {
	uint64_t id;
	bool prefill;
	int position, n_tokens, slot, n_bt, n_new;
	const int32_t *tokens, *bt, *new_pages;
	uint32_t capacity, top_k;
	const char *kv;
};

static void make_row(Bdfp4__PlanRow *row, const struct row_spec *s)
{
	bdfp4__plan_row__init(row);
	row->request_id = s->id;
	row->prefill = s->prefill;
	row->position = s->position;
	row->n_tokens = (size_t)s->n_tokens;
	row->tokens = (int32_t *)s->tokens;
	row->slot = s->slot;
	row->n_block_table = (size_t)s->n_bt;
	row->block_table = (int32_t *)s->bt;
	row->n_new_pages = (size_t)s->n_new;
	row->new_pages = (int32_t *)s->new_pages;
	row->capacity = s->capacity;
	row->kv_config = (char *)(s->kv ? s->kv : "");
	row->sample = true;
	row->logits_top_k = s->top_k;
}

/* One plan of one row. */
static void step1(uint64_t epoch, uint64_t stepno, const struct row_spec *s,
		  Bdfp4__StepResult *res[2])
{
	Bdfp4__StepPlan plan = BDFP4__STEP_PLAN__INIT;
	Bdfp4__PlanRow row, *rows[1] = { &row };
	make_row(&row, s);
	plan.epoch = epoch;
	plan.step = stepno;
	plan.n_rows = 1;
	plan.rows = rows;
	step(&plan, res);
}

static int32_t *golden_prompt(const char *name, int *ret_n)
{
	char path[PATH_MAX];
	const char *src = getenv("BD_SRCDIR");
	json_error_t je;
	snprintf(path, sizeof(path), "%s/tests/data/model/golden.json", src && *src ? src : ".");
	json_t *g = json_load_file(path, 0, &je);
	cr_assert_not_null(g, "%s: %s", path, je.text);
	json_t *ps = json_object_get(g, "prompts"), *ids = NULL;
	for (size_t i = 0; i < json_array_size(ps); i++)
		if (!strcmp(json_string_value(json_object_get(json_array_get(ps, i), "name")),
			    name))
			ids = json_object_get(json_array_get(ps, i), "prompt_ids");
	cr_assert_not_null(ids);
	int n = (int)json_array_size(ids);
	int32_t *p = malloc(sizeof(int32_t) * (size_t)n);
	for (int i = 0; i < n; i++)
		p[i] = (int32_t)json_integer_value(json_array_get(ids, (size_t)i));
	json_decref(g);
	*ret_n = n;
	return p;
}

/* The exit status of *pid within timeout_ms (sp_reap), *pid then 0; -1 when it was already
 * reaped. */
static int exit_status(pid_t *pid, int timeout_ms)
{
	int st = *pid > 0 ? sp_reap(*pid, timeout_ms) : -1;
	*pid = 0;
	return st;
}

static bool dir_has(const char *name)
{
	char p[160];
	snprintf(p, sizeof(p), "%s/%s", T.dir, name);
	return access(p, F_OK) == 0;
}

/* A plan of one two-token prefill in the group of epoch: both ranks serve it. */
static void serves_a_prefill(uint64_t epoch, uint64_t stepno)
{
	Bdfp4__StepResult *res[2];
	int32_t tok[2] = { 1, 2 };
	struct row_spec ok = { .id = 1, .prefill = true, .n_tokens = 2, .tokens = tok, .slot = 0,
			       .capacity = 4 };

	step1(epoch, stepno, &ok, res);
	for (int r = 0; r < 2; r++)
		cr_assert_eq(res[r]->rows[0]->error, 0, "%s", res[r]->rows[0]->message);
	free_results(res);
}

/* ---- tests ------------------------------------------------------------------------------- */

/* The whole life of a group: READY, registration, the chat prompt prefilled for two requests
 * and 8 tokens decoded (the two rows as one batch) teacher-forced along the single-process
 * greedy run (rank 0 samples greedily and reports the top logits, rank 1 reports no token),
 * release, then SIGTERM → exit 0 for every daemon. */
Test(workerd, serves_a_prompt_like_the_single_process_run)
{
	int n;
	int32_t *prompt = golden_prompt("chat_capital", &n);
	const int steps = 8;

	/* the single-process reference first: nothing heartbeats the workers meanwhile */
	struct bd_model *m;
	char err[BD_MODEL_ERR_MAX];
	cr_assert_eq(bd_model_load(T.model, &m, err), 0, "%s", err);
	int V = m->hp.n_vocab;
	float *ref = malloc(sizeof(float) * (size_t)V * (steps + 1));
	int32_t toks[8];
	struct bd_seq *s;
	struct bd_seq_opts o = { .max_tokens = n + steps };
	cr_assert_eq(bd_seq_new(m, bd_kvcfg_find("bitdecoding-nvfp4"), &o, &s, err), 0);
	cr_assert_eq(bd_model_prefill(m, s, prompt, n, ref), 0);
	for (int i = 0; i < steps; i++) {
		toks[i] = bd_argmax(ref + (size_t)i * V, V);
		if (i + 1 < steps)
			cr_assert_eq(bd_model_decode(m, s, toks[i], ref + (size_t)(i + 1) * V), 0);
	}
	bd_seq_free(s);
	bd_model_free(m);

	start_pool();
	start_worker(0);
	start_worker(1);
	for (int r = 0; r < 2; r++)
		cr_assert(got_notify(r, "READY=1", TIMEOUT_MS), "rank %d never READY (log %s)", r,
			  T.log[r]);
	form_group(7, "t-ar");

	/* two requests with the prompt, each step one plan of both rows: the prefills, then
	 * decodes that run as one batch */
	Bdfp4__StepResult *res[2];
	int agree = 0;
	double maxd = 0;
	for (int i = 0; i < steps; i++) {
		Bdfp4__StepPlan plan = BDFP4__STEP_PLAN__INIT;
		Bdfp4__PlanRow prow[2], *prows[2] = { &prow[0], &prow[1] };
		for (int q = 0; q < 2; q++) {
			struct row_spec rs = { .id = 42 + (uint64_t)q, .prefill = i == 0,
					       .position = i ? n + i - 1 : 0, .n_tokens = i ? 1 : n,
					       .tokens = i ? &toks[i - 1] : prompt, .slot = 2 + q,
					       .capacity = (uint32_t)(n + steps), .top_k = 5 };
			make_row(&prow[q], &rs);
		}
		prow[0].logprobs = true; /* the first request's: the sampled token's and the top 5 */
		prow[0].top_logprobs = 5;
		plan.epoch = 7;
		plan.step = (uint64_t)i + 1;
		plan.n_rows = 2;
		plan.rows = prows;
		step(&plan, res);
		for (int r = 0; r < 2; r++) {
			cr_assert_eq(res[r]->error, 0, "rank %d: %s", r, res[r]->message);
			cr_assert_eq(res[r]->epoch, 7);
			cr_assert_eq(res[r]->n_rows, 2);
			for (int q = 0; q < 2; q++) {
				cr_assert_eq(res[r]->rows[q]->request_id, 42 + (uint64_t)q);
				cr_assert_eq(res[r]->rows[q]->error, 0, "rank %d step %d row %d: %s",
					     r, i, q, res[r]->rows[q]->message);
			}
		}
		for (int q = 0; q < 2; q++) {
			cr_assert_eq(res[1]->rows[q]->token, -1);
			cr_assert_eq(res[1]->rows[q]->n_top, 0);
			const Bdfp4__RowResult *rr = res[0]->rows[q];
			cr_assert_eq(rr->n_top, 5);
			cr_assert_eq(rr->top[0]->token, rr->token,
				     "greedy: the sample is the top logit");
			for (size_t k = 1; k < 5; k++)
				cr_assert_geq(rr->top[k - 1]->logit, rr->top[k]->logit);
			const float *lr = ref + (size_t)i * V;
			for (size_t k = 0; k < 5; k++)
				maxd = fmax(maxd, fabs(rr->top[k]->logit - lr[rr->top[k]->token]));
			agree += rr->token == toks[i];
			cr_assert_eq(res[1]->rows[q]->n_top_logprobs, 0);
			if (q == 1) {
				cr_assert_eq(rr->n_top_logprobs, 0, "not asked for");
				continue;
			}
			/* log-probabilities: the same ranking as the logits, each the logit less
			 * one log-sum-exp, the sampled token's the first (greedy) */
			cr_assert_eq(rr->n_top_logprobs, 5);
			double lse = rr->top[0]->logit - rr->top_logprobs[0]->logprob;
			cr_assert_eq(rr->logprob, rr->top_logprobs[0]->logprob);
			for (size_t k = 0; k < 5; k++) {
				cr_assert_eq(rr->top_logprobs[k]->token, rr->top[k]->token);
				cr_assert_leq(rr->top_logprobs[k]->logprob, 0.0f);
				cr_assert_float_eq(rr->top[k]->logit - rr->top_logprobs[k]->logprob,
						   lse, 1e-4, "step %d rank %zu", i, k);
			}
			/* and that log-sum-exp is the single-process logits' (after the prefill,
			 * where the two runs agree closely) */
			double lmax = -INFINITY, sum = 0;
			for (int v = 0; v < V; v++)
				lmax = fmax(lmax, lr[v]);
			for (int v = 0; v < V; v++)
				sum += exp((double)lr[v] - lmax);
			if (i == 0)
				cr_assert_float_eq(lse, lmax + log(sum), 0.01, "log-sum-exp of step 0");
		}
		free_results(res);
	}
	fprintf(stderr, "[workerd] TP=2 daemons vs single process, chat prompt twice + %d steps "
			"(decodes batched): top-1 %d/%d, max |dlogit| of the top 5 %.4f\n", steps,
		agree, 2 * steps, maxd);
	cr_assert_geq(agree, 2 * steps - 2);
	cr_assert_leq(maxd, 1.5);
	cr_assert(!dir_has("t-ar"), "the all-reduce file was left behind");

	/* release: the sequence is gone; a decode for it is refused */
	Bdfp4__StepPlan plan = BDFP4__STEP_PLAN__INIT;
	uint64_t rel[2] = { 42, 43 };
	plan.epoch = 7;
	plan.step = 100;
	plan.n_release = 2;
	plan.release = rel;
	step(&plan, res);
	cr_assert(res[0]->error == 0 && res[1]->error == 0 && res[0]->n_rows == 0);
	free_results(res);

	kill(T.w_pid[0], SIGTERM);
	kill(T.w_pid[1], SIGTERM);
	cr_assert_eq(exit_status(&T.w_pid[0], TIMEOUT_MS), 0);
	cr_assert_eq(exit_status(&T.w_pid[1], TIMEOUT_MS), 0);
	kill(T.pool_pid, SIGTERM);
	cr_assert_eq(exit_status(&T.pool_pid, TIMEOUT_MS), 0);
	free(ref);
	free(prompt);
}

/* Bad plans get error results from both ranks, in step, and the daemons keep serving. */
Test(workerd, bad_plans_get_errors_and_serving_goes_on)
{
	start_pool();
	start_worker(0);
	start_worker(1);
	form_group(3, "t-ar-bad");
	Bdfp4__StepResult *res[2];
	int32_t tok[4] = { 1, 2, 3, 4 }, big = 49152, far_page = N_PAGES + 5;
	struct row_spec ok = { .id = 5, .prefill = true, .n_tokens = 4, .tokens = tok, .slot = 1,
			       .capacity = 16 };

	/* a plan of another epoch: refused whole */
	step1(2, 1, &ok, res);
	for (int r = 0; r < 2; r++) {
		cr_assert_eq(res[r]->error, BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT);
		cr_assert_eq(res[r]->n_rows, 0);
		cr_assert_not_null(strstr(res[r]->message, "epoch"));
	}
	free_results(res);

	struct {
		struct row_spec s;
		Bdfp4__ServeError want;
		const char *what;
	} bad[] = {
		{ { .id = 9, .position = 3, .n_tokens = 1, .tokens = tok, .slot = 1 },
		  BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT, "decode of an unknown request" },
		{ { .id = 6, .prefill = true, .n_tokens = 1, .tokens = &big, .slot = 1,
		    .capacity = 8 },
		  BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT, "token id = vocabulary size" },
		{ { .id = 6, .prefill = true, .n_tokens = 4, .tokens = tok, .slot = N_SLOTS,
		    .capacity = 8 },
		  BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT, "slot outside the pool" },
		{ { .id = 6, .prefill = true, .n_tokens = 4, .tokens = tok, .slot = 1,
		    .capacity = 2 },
		  BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT, "capacity below the prompt" },
		{ { .id = 6, .prefill = true, .n_tokens = 4, .tokens = tok, .slot = 1,
		    .capacity = 8, .n_new = 1, .new_pages = &far_page },
		  BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT, "a page for a 4-token prompt" },
		{ { .id = 6, .prefill = true, .n_tokens = 4, .tokens = tok, .slot = 1,
		    .capacity = 8, .kv = "no-such-config" },
		  BDFP4__SERVE_ERROR__SERVE_ERR_UNKNOWN_KV_CONFIG, "unknown KV configuration" },
		{ { .id = 6, .prefill = true, .n_tokens = 4, .tokens = tok, .slot = 1,
		    .capacity = 8, .kv = "bf16" },
		  BDFP4__SERVE_ERROR__SERVE_ERR_UNKNOWN_KV_CONFIG, "bf16 in an nvfp4 pool" },
	};
	uint64_t stepno = 10;
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		step1(3, stepno++, &bad[i].s, res);
		for (int r = 0; r < 2; r++) {
			cr_assert_eq(res[r]->error, 0, "%s: rank %d failed the step", bad[i].what,
				     r);
			cr_assert_eq(res[r]->rows[0]->error, bad[i].want, "%s: rank %d error %d (%s)",
				     bad[i].what, r, res[r]->rows[0]->error,
				     res[r]->rows[0]->message);
			cr_assert_gt(strlen(res[r]->rows[0]->message), 0);
			cr_assert_eq(res[r]->rows[0]->token, -1);
		}
		free_results(res);
	}

	/* garbage frames are ignored */
	send_raw(0, "\xff\xff\xff", 3);
	send_raw(1, "not a protobuf", 14);

	/* a good prefill, then decodes that lie about the sequence: each refused, the sequence
	 * dropped; the next good request is served */
	step1(3, stepno++, &ok, res);
	cr_assert(res[0]->rows[0]->error == 0 && res[1]->rows[0]->error == 0, "%s",
		  res[0]->rows[0]->message);
	int32_t t = res[0]->rows[0]->token;
	cr_assert(t >= 0 && t < 49152);
	free_results(res);
	struct row_spec wrongpos = { .id = 5, .position = 7, .n_tokens = 1, .tokens = &t,
				     .slot = 1 };
	step1(3, stepno++, &wrongpos, res);
	for (int r = 0; r < 2; r++)
		cr_assert_eq(res[r]->rows[0]->error, BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT);
	free_results(res);
	struct row_spec gone = { .id = 5, .position = 4, .n_tokens = 1, .tokens = &t, .slot = 1 };
	step1(3, stepno++, &gone, res);
	for (int r = 0; r < 2; r++)
		cr_assert_eq(res[r]->rows[0]->error, BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT,
			     "the refused sequence should be gone");
	free_results(res);

	/* two rows in one plan: one good, one bad; the good one is served */
	Bdfp4__StepPlan plan = BDFP4__STEP_PLAN__INIT;
	Bdfp4__PlanRow r0, r1, *rows[2] = { &r0, &r1 };
	struct row_spec good2 = ok, bad2 = { .id = 8, .prefill = true, .n_tokens = 4,
					     .tokens = tok, .slot = 1, .capacity = 8 };
	good2.id = 7;
	make_row(&r0, &good2);
	make_row(&r1, &bad2); /* slot 1 now held by request 7 */
	plan.epoch = 3;
	plan.step = stepno++;
	plan.n_rows = 2;
	plan.rows = rows;
	step(&plan, res);
	for (int r = 0; r < 2; r++) {
		cr_assert_eq(res[r]->n_rows, 2);
		cr_assert_eq(res[r]->rows[0]->error, 0);
		cr_assert_eq(res[r]->rows[1]->error, BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT);
		cr_assert_not_null(strstr(res[r]->rows[1]->message, "slot 1"));
	}
	cr_assert_eq(res[0]->rows[0]->token, t, "the same prompt, the same greedy token");
	free_results(res);
	cr_assert_eq(waitpid(T.w_pid[0], NULL, WNOHANG), 0);
	cr_assert_eq(waitpid(T.w_pid[1], NULL, WNOHANG), 0);
}

/* kill -9 of rank 1: rank 0 answers the next plan with WORKER_FAILED at once (no 20 s
 * all-reduce timeout), re-registers after a Reset, and a restarted rank 1 forms a new group
 * that serves. */
Test(workerd, killed_peer_fails_fast_and_group_reforms)
{
	start_pool();
	start_worker(0);
	start_worker(1);
	form_group(1, "t-ar-kill");
	Bdfp4__StepResult *res[2];
	int32_t tok[3] = { 10, 20, 30 };
	struct row_spec ok = { .id = 1, .prefill = true, .n_tokens = 3, .tokens = tok, .slot = 0,
			       .capacity = 8 };
	step1(1, 1, &ok, res);
	cr_assert(res[0]->rows[0]->error == 0 && res[1]->rows[0]->error == 0);
	int32_t first = res[0]->rows[0]->token;
	free_results(res);

	kill(T.w_pid[1], SIGKILL);
	waitpid(T.w_pid[1], NULL, 0);
	T.w_pid[1] = 0;

	/* to rank 0 alone */
	Bdfp4__RouterMessage m = BDFP4__ROUTER_MESSAGE__INIT;
	Bdfp4__StepPlan plan = BDFP4__STEP_PLAN__INIT;
	Bdfp4__PlanRow row, *rows[1] = { &row };
	struct row_spec dec = { .id = 1, .position = 3, .n_tokens = 1, .tokens = &first,
				.slot = 0 };
	make_row(&row, &dec);
	plan.epoch = 1;
	plan.step = 2;
	plan.n_rows = 1;
	plan.rows = rows;
	m.msg_case = BDFP4__ROUTER_MESSAGE__MSG_PLAN;
	m.plan = &plan;
	int64_t t0 = bd_now_ms();
	send_to(0, &m);
	uint8_t id[256];
	size_t il;
	Bdfp4__WorkerMessage *w = recv_msg(TIMEOUT_MS, id, &il);
	cr_assert_not_null(w);
	cr_assert_eq(w->msg_case, BDFP4__WORKER_MESSAGE__MSG_RESULT);
	cr_assert_eq(w->result->rank, 0);
	cr_assert_eq(w->result->error, BDFP4__SERVE_ERROR__SERVE_ERR_WORKER_FAILED);
	cr_assert_lt(bd_now_ms() - t0, 10000, "rank 0 waited for the dead rank");
	bdfp4__worker_message__free_unpacked(w, NULL);

	/* Reset: rank 0 registers again; rank 1 restarts; a new group serves */
	Bdfp4__RouterMessage rm = BDFP4__ROUTER_MESSAGE__INIT;
	Bdfp4__Reset rs = BDFP4__RESET__INIT;
	rs.epoch = 1;
	rs.reason = (char *)"rank 1 died";
	rm.msg_case = BDFP4__ROUTER_MESSAGE__MSG_RESET;
	rm.reset = &rs;
	send_to(0, &rm);
	T.ident_len[1] = 0;
	start_worker(1);
	form_group(2, "t-ar-kill2");
	step1(2, 3, &ok, res);
	cr_assert(res[0]->rows[0]->error == 0 && res[1]->rows[0]->error == 0, "%s",
		  res[0]->rows[0]->message);
	cr_assert_eq(res[0]->rows[0]->token, first, "the same prompt, the same greedy token");
	free_results(res);
	cr_assert(!dir_has("t-ar-kill") && !dir_has("t-ar-kill2"));
}

/* A RegisterReply the worker cannot use (an all-reduce name with a '/') is not fatal: each rank
 * registers again, and the next reply forms the group. */
Test(workerd, unusable_reply_registers_again)
{
	start_pool();
	start_worker(0);
	start_worker(1);
	form_group(1, "../escape");
	form_group(2, "t-ar-ok");
	serves_a_prefill(2, 1);
}

static bool log_has(const char *path, const char *what)
{
	static char buf[65536];
	FILE *f = fopen(path, "r");
	size_t n = f ? fread(buf, 1, sizeof(buf) - 1, f) : 0;
	if (f)
		fclose(f);
	buf[n] = 0;
	return strstr(buf, what) != NULL;
}

static pid_t start_worker_args(int rank, const char *const *extra)
{
	char r[8];
	const char *args[32] = { "--no-config", "--rank", r, "--tp", "2", "--model", T.model,
				 "--pool-socket", T.pool_sock, "--router", T.workers_ep,
				 "--allreduce-dir", T.dir };
	size_t n = 13;
	snprintf(r, sizeof(r), "%d", rank);
	for (size_t i = 0; extra[i] && n < 31; i++)
		args[n++] = extra[i];
	args[n] = NULL;
	return spawn("workerd", args, T.log[rank], NULL);
}

/* The cuda backend's flags: an unknown --random-weights shape, a --weights other than
 * bf16/f32 or a --decode-kernel other than auto/native/portable is a bad flag (exit 2 before
 * anything is loaded); --synthetic-prefill and
 * --random-weights need a pool of the cuda backend, so against this cpu pool they are refused
 * at start (exit 1) with a message that says so, and no group forms. */
Test(workerd, cuda_backend_flags_are_checked)
{
	static const char *const bad_preset[] = { "--random-weights", "qwen3-5b", NULL };
	static const char *const bad_weights[] = { "--weights", "fp16", NULL };
	static const char *const bad_batch[] = { "--max-batch", "0", NULL };
	static const char *const bad_kernel[] = { "--decode-kernel", "hopper", NULL };
	static const char *const synth[] = { "--synthetic-prefill", NULL };
	static const char *const synth_off[] = { "--synthetic-prefill=0", "--max-batch", "8",
						 "--weights", "f32", "--decode-kernel", "native",
						 NULL };

	T.w_pid[0] = start_worker_args(0, bad_preset);
	cr_assert_eq(exit_status(&T.w_pid[0], TIMEOUT_MS), 2);
	cr_assert(log_has(T.log[0], "no such model shape"), "log %s", T.log[0]);
	T.w_pid[0] = start_worker_args(0, bad_weights);
	cr_assert_eq(exit_status(&T.w_pid[0], TIMEOUT_MS), 2);
	cr_assert(log_has(T.log[0], "bf16 or f32"));
	T.w_pid[0] = start_worker_args(0, bad_batch);
	cr_assert_eq(exit_status(&T.w_pid[0], TIMEOUT_MS), 2);
	T.w_pid[0] = start_worker_args(0, bad_kernel);
	cr_assert_eq(exit_status(&T.w_pid[0], TIMEOUT_MS), 2);
	cr_assert(log_has(T.log[0], "decode_kernel = 'hopper': auto, native or portable"), "log %s",
		  T.log[0]);

	start_pool();
	T.w_pid[0] = start_worker_args(0, synth);
	cr_assert_eq(exit_status(&T.w_pid[0], TIMEOUT_MS), 1);
	cr_assert(log_has(T.log[0], "synthetic_prefill needs a pool of the cuda backend"),
		  "log %s", T.log[0]);

	/* the same flags switched off (or meaningless on the cpu backend) serve as before */
	T.w_pid[0] = start_worker_args(0, synth_off);
	start_worker(1);
	form_group(4, "t-ar-flags");
	serves_a_prefill(4, 1);
}

/* Waits up to timeout_ms for what to appear in the log at path. */
static bool log_shows(const char *path, const char *what, int timeout_ms)
{
	for (int64_t end = bd_now_ms() + timeout_ms; bd_now_ms() < end; usleep(20000))
		if (log_has(path, what))
			return true;
	return log_has(path, what);
}

/* A worker that must stop at start with status want, its log naming why. */
static void refused_at_start(const char *const *args, int want, const char *why)
{
	T.w_pid[0] = spawn("workerd", args, T.log[0], NULL);
	cr_assert_eq(exit_status(&T.w_pid[0], TIMEOUT_MS), want, "%s %s: log %s", args[0],
		     args[1] ? args[1] : "", T.log[0]);
	cr_assert(log_has(T.log[0], why), "%s: no '%s' in %s", args[0], why, T.log[0]);
}

/* The daemon's start and signals: --help exits 0; an unknown flag, an unknown key of the
 * configuration file, a file that is not there and a value out of range exit 2 before anything
 * is loaded. Serving, the notify socket gets READY, then STATUS as the rank registers and
 * joins; SIGUSR1 (no timing report on the cpu backend) and SIGHUP (logged, ignored) leave it
 * serving; --verbose 1 logs each step at debug level, on that rank only; SIGTERM exits 0
 * after STOPPING. */
Test(workerd, starts_stops_and_reports_like_a_daemon)
{
	char conf[96];
	snprintf(conf, sizeof(conf), "%s/bad.conf", T.dir);
	FILE *f = fopen(conf, "w");
	cr_assert_not_null(f);
	fputs("[worker]\nrank = 0\nno_such_key = 1\n", f);
	fclose(f);

	static const char *const help[] = { "--help", NULL };
	static const char *const bad_flag[] = { "--no-config", "--no-such-flag", "1", NULL };
	static const char *const no_file[] = { "--config", "/nonexistent/bdfp4.conf", NULL };
	static const char *const bad_threads[] = { "--no-config", "--threads", "0", NULL };
	const char *const bad_key[] = { "--config", conf, NULL };
	refused_at_start(help, 0, "--allreduce-timeout-ms   longest wait for the other rank");
	refused_at_start(bad_flag, 2, "no-such-flag");
	refused_at_start(no_file, 2, "/nonexistent/bdfp4.conf");
	refused_at_start(bad_threads, 2, "threads = '0': out of range (allowed 1..64)");
	refused_at_start(bad_key, 2, "unknown key 'no_such_key' in [worker]");

	static const char *const verbose[] = { "--verbose", "1", NULL };
	start_pool();
	T.w_pid[0] = start_worker_args(0, verbose);
	start_worker(1);
	/* start_worker_args gives no notify socket: rank 1's tells the story */
	cr_assert(got_notify(1, "READY=1", TIMEOUT_MS), "rank 1 never READY (log %s)", T.log[1]);
	cr_assert(got_notify(1, "STATUS=rank 1 of 2: registering with ", TIMEOUT_MS));
	form_group(5, "t-ar-daemon");
	cr_assert(got_notify(1, "STATUS=rank 1 of 2: serving, epoch 5", TIMEOUT_MS),
		  "no serving STATUS (log %s)", T.log[1]);

	for (int r = 0; r < 2; r++) {
		kill(T.w_pid[r], SIGUSR1);
		kill(T.w_pid[r], SIGHUP);
	}
	for (int r = 0; r < 2; r++)
		cr_assert(log_shows(T.log[r], "SIGHUP ignored", TIMEOUT_MS), "log %s", T.log[r]);
	serves_a_prefill(5, 1);
	serves_a_prefill(5, 2);
	cr_assert(log_shows(T.log[0], "step 2: 1 rows, 0 released", TIMEOUT_MS), "log %s",
		  T.log[0]);
	cr_assert(!log_has(T.log[1], "rows, 0 released"), "rank 1 is not verbose");
	for (int r = 0; r < 2; r++)
		cr_assert(!log_has(T.log[r], "decode-timing"), "a cpu rank reported GPU timing");

	kill(T.w_pid[1], SIGTERM);
	cr_assert_eq(exit_status(&T.w_pid[1], TIMEOUT_MS), 0);
	cr_assert(got_notify(1, "STOPPING=1", TIMEOUT_MS));
	kill(T.w_pid[0], SIGINT);
	cr_assert_eq(exit_status(&T.w_pid[0], TIMEOUT_MS), 0);
	cr_assert(log_has(T.log[0], "signal 2: stopping"), "log %s", T.log[0]);
}

/* The frames a ROUTER left mid-message would deliver: a message of several frames (here the
 * other rank's 5-byte identity, then a heartbeat) is dropped whole, logged, and the next plan
 * is served; no frame of it is taken for a message of its own. */
Test(workerd, a_multipart_router_message_is_dropped_whole)
{
	Bdfp4__RouterMessage m = BDFP4__ROUTER_MESSAGE__INIT;
	Bdfp4__RouterHeartbeat hb = BDFP4__ROUTER_HEARTBEAT__INIT;
	uint8_t buf[64];
	size_t n;

	start_pool();
	start_worker(0);
	start_worker(1);
	form_group(4, "t-ar-multi");
	hb.epoch = 4;
	m.msg_case = BDFP4__ROUTER_MESSAGE__MSG_HEARTBEAT;
	m.heartbeat = &hb;
	n = bdfp4__router_message__pack(&m, buf);
	for (int r = 0; r < 2; r++) {
		cr_assert_eq(zmq_send(T.router, T.ident[r], T.ident_len[r], ZMQ_SNDMORE),
			     (int)T.ident_len[r]);
		cr_assert_eq(zmq_send(T.router, T.ident[1 - r], T.ident_len[1 - r], ZMQ_SNDMORE),
			     (int)T.ident_len[1 - r]);
		cr_assert_eq(zmq_send(T.router, buf, n, 0), (int)n);
	}
	for (int r = 0; r < 2; r++)
		cr_expect(log_shows(T.log[r], "dropped whole", 30000), "rank %d kept a frame", r);
	serves_a_prefill(4, 1);
	for (int r = 0; r < 2; r++)
		cr_expect_not(log_has(T.log[r], "malformed frame"), "rank %d", r);
}
