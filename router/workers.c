/* workers.c — routerd's side of the worker protocol (proto/serve.proto, "router <-> worker"):
 * registration into a group of tp ranks (one epoch per group), heartbeats both ways, results,
 * and the failure of a group when a rank dies.
 *
 * Liveness: outside a step a rank must send something every heartbeat_timeout_ms. During a step
 * a rank may be busy computing and quiet, so there the test is the connection itself: the
 * router's heartbeats are sent with ZMQ_ROUTER_MANDATORY, and a send to a rank whose process
 * died (its socket closed) fails at once; a rank that stops heartbeating (killed, stopped) is
 * caught by heartbeat_timeout_ms even inside a step, and a rank whose step is stuck while its
 * I/O thread still beats by step_timeout_ms; a step-level error of one rank of tp > 1 (its
 * collective failed) fails the group at once, since its peers cannot finish that step.
 *
 * The scheduler hears of the group (bd_sched_group_up/_down) and of a step once every rank has
 * answered it (bd_sched_step_done); it never calls here: main.c hands its plans to
 * bd_router_send_plan.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include <zmq.h>

#include "metrics.h"
#include "pool/bd_prefix.h"
#include "router.h"

/* Sends m to rank; -EHOSTUNREACH when that worker is gone. */
static int send_worker(struct bd_router *rt, int rank, const Bdfp4__RouterMessage *m)
{
	struct bd_worker *w = &rt->w[rank];

	if (!w->connected)
		return -EHOSTUNREACH;
	return bd_router_send(rt->wsock, w->ident, w->ident_len, false, &m->base);
}

static void send_reset(struct bd_router *rt, int rank, const char *why)
{
	Bdfp4__RouterMessage m = BDFP4__ROUTER_MESSAGE__INIT;
	Bdfp4__Reset rs = BDFP4__RESET__INIT;

	rs.epoch = rt->epoch;
	rs.reason = (char *)why;
	m.msg_case = BDFP4__ROUTER_MESSAGE__MSG_RESET;
	m.reset = &rs;
	if (send_worker(rt, rank, &m) < 0)
		rt->w[rank].connected = false;
}

/* Frees the answers gathered for the step in flight; no step is in flight then. */
static void step_clear(struct bd_router *rt)
{
	for (int i = 0; i < BD_ROUTER_MAX_TP; i++) {
		if (rt->step.res[i])
			bdfp4__step_result__free_unpacked(rt->step.res[i], NULL);
		rt->step.res[i] = NULL;
	}
	rt->step.n_res = 0;
	rt->step.active = false;
}

/* The group is broken (dead_rank gone, or -1): the step in flight is lost, the scheduler
 * fails what the group ran, the other ranks are reset, health turns degraded. */
static void group_fail(struct bd_router *rt, int dead_rank, const char *msg)
{
	bool was_ready = rt->group_ready;

	bd_log_err("worker group failed: %s", msg);
	if (dead_rank >= 0) {
		rt->w[dead_rank].connected = false;
		rt->w[dead_rank].registered = false;
	}
	rt->group_ready = false;
	step_clear(rt);
	bd_sched_group_down(&rt->sched, msg, bd_now_ms());
	for (int i = 0; i < rt->o.tp; i++) {
		if (rt->w[i].connected && was_ready)
			send_reset(rt, i, msg);
		rt->w[i].registered = false;
	}
	if (rt->state != RS_STOPPING)
		rt->state = RS_DEGRADED;
	snprintf(rt->reason, sizeof(rt->reason), "%s; waiting for every rank to register", msg);
}

static void form_group(struct bd_router *rt)
{
	Bdfp4__RouterMessage m = BDFP4__ROUTER_MESSAGE__INIT;
	Bdfp4__RegisterReply rr = BDFP4__REGISTER_REPLY__INIT;
	char name[64];
	int failed = -1;

	rt->epoch++;
	snprintf(name, sizeof(name), "bdfp4-ar-%d-%llu", (int)getpid(),
		 (unsigned long long)rt->epoch);
	/* the epoch's attach tokens, in kvpoold before any worker holds one: a pool that does
	 * not take them now gets them when its probe answers (pool.c), and a worker whose attach
	 * is refused meanwhile registers again */
	rt->group_in_pool = false;
	if (getrandom(rt->tokens, sizeof(rt->tokens), 0) != (ssize_t)sizeof(rt->tokens)) {
		group_fail(rt, -1, "no random bytes for the attach tokens");
		return;
	}
	bd_router_pool_group(rt);
	rr.version = BD_SERVE_PROTO_VERSION;
	rr.epoch = rt->epoch;
	rr.tp = (uint32_t)rt->o.tp;
	rr.nccl_unique_id.data = rt->w[0].nccl_id;
	rr.nccl_unique_id.len = rt->w[0].nccl_len;
	rr.allreduce_name = name;
	rr.heartbeat_ms = (uint32_t)rt->o.heartbeat_ms;
	rr.owner = rt->o.owner;
	m.msg_case = BDFP4__ROUTER_MESSAGE__MSG_REGISTER_REPLY;
	m.register_reply = &rr;
	for (int i = 0; i < rt->o.tp; i++) {
		rr.rank = i;
		rr.attach_token = (ProtobufCBinaryData){ BD_POOL_TOKEN_BYTES,
							 rt->tokens + i * BD_POOL_TOKEN_BYTES };
		if (send_worker(rt, i, &m) < 0 && failed < 0)
			failed = i;
	}
	rr.attach_token = (ProtobufCBinaryData){ 0, NULL };
	rt->group_ready = true;
	/* the group's calibration names the KV bytes of the pages it writes (pool/bd_prefix.h) */
	bd_sched_set_prefix(&rt->sched, rt->sched.cfg.prefix_cache,
			    bd_prefix_seed(rt->model_name, rt->kv_config, rt->page_format,
						  rt->w[0].calib_id));
	if (failed >= 0) {
		char msg[96];

		snprintf(msg, sizeof(msg), "worker rank %d left while the group formed", failed);
		group_fail(rt, failed, msg);
		return;
	}
	if (rt->state != RS_STOPPING) /* a group formed during the drain serves the drain */
		rt->state = RS_SERVING;
	rt->reason[0] = 0;
	/* what every rank runs: the least of the ranks' prefill rows */
	bool whole = false;
	uint32_t max_row = 0;
	for (int i = 0; i < rt->o.tp; i++) {
		whole |= rt->w[i].whole_prompts;
		if (rt->w[i].max_prefill && (!max_row || rt->w[i].max_prefill < max_row))
			max_row = rt->w[i].max_prefill;
	}
	bd_sched_set_workers(&rt->sched, whole, max_row > INT32_MAX ? INT32_MAX : (int)max_row);
	bd_sched_group_up(&rt->sched, rt->epoch);
	bd_log_info("worker group of %d rank(s) formed: epoch %llu", rt->o.tp,
		  (unsigned long long)rt->epoch);
	for (int i = 0; i < rt->o.tp; i++)
		bd_log_info("  rank %d: pid %d, %s", i, rt->w[i].pid, rt->w[i].backend);
}

static void register_refuse(struct bd_router *rt, const uint8_t *ident, size_t len, int code,
			    const char *why)
{
	Bdfp4__RouterMessage m = BDFP4__ROUTER_MESSAGE__INIT;
	Bdfp4__RegisterReply rr = BDFP4__REGISTER_REPLY__INIT;

	bd_log_warn("worker registration refused: %s", why);
	rr.error = (Bdfp4__ServeError)code;
	rr.message = (char *)why;
	rr.version = BD_SERVE_PROTO_VERSION;
	m.msg_case = BDFP4__ROUTER_MESSAGE__MSG_REGISTER_REPLY;
	m.register_reply = &rr;
	bd_router_send(rt->wsock, ident, len, false, &m.base);
}

static void on_register(struct bd_router *rt, const uint8_t *ident, size_t len,
			const Bdfp4__RegisterRequest *reg)
{
	struct bd_worker *w;
	char why[256];

	if (reg->version != BD_SERVE_PROTO_VERSION) {
		snprintf(why, sizeof(why), "protocol version %u; the router speaks %d",
			 reg->version, BD_SERVE_PROTO_VERSION);
		register_refuse(rt, ident, len, BDFP4__SERVE_ERROR__SERVE_ERR_VERSION, why);
		return;
	}
	if (reg->rank < 0 || reg->rank >= rt->o.tp || reg->tp != (uint32_t)rt->o.tp) {
		snprintf(why, sizeof(why), "rank %d of tp %u; the router runs ranks 0..%d of tp %d",
			 reg->rank, reg->tp, rt->o.tp - 1, rt->o.tp);
		register_refuse(rt, ident, len, BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT,
				why);
		return;
	}
	if ((*reg->model && strcmp(reg->model, rt->model_name)) ||
	    (reg->n_vocab && reg->n_vocab != (uint32_t)rt->n_vocab)) {
		snprintf(why, sizeof(why), "model %.64s (vocabulary %u); the router serves %.64s "
					   "(vocabulary %d)",
			 reg->model, reg->n_vocab, rt->model_name, rt->n_vocab);
		register_refuse(rt, ident, len, BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT,
				why);
		return;
	}
	if (*reg->kv_config && strcmp(reg->kv_config, rt->kv_config)) {
		snprintf(why, sizeof(why), "worker attached to a pool of %.32s; the router's holds "
					   "%s", reg->kv_config, rt->kv_config);
		register_refuse(rt, ident, len, BDFP4__SERVE_ERROR__SERVE_ERR_UNKNOWN_KV_CONFIG,
				why);
		return;
	}
	if (reg->nccl_unique_id.len > sizeof(rt->w[0].nccl_id)) {
		register_refuse(rt, ident, len, BDFP4__SERVE_ERROR__SERVE_ERR_OVERSIZE,
				"nccl_unique_id longer than 128 bytes");
		return;
	}
	w = &rt->w[reg->rank];
	if (w->connected && rt->group_ready) {
		/* a new process for a live rank (restarted), or the same one starting over: the
		 * group's state on every rank is gone either way */
		snprintf(why, sizeof(why), "worker rank %d registered again (pid %d, was %d)",
			 reg->rank, reg->pid, w->pid);
		group_fail(rt, -1, why);
	}
	w->connected = true;
	w->registered = true;
	memcpy(w->ident, ident, len);
	w->ident_len = len;
	w->pid = reg->pid;
	w->device = reg->device;
	w->last_seen = bd_now_ms();
	snprintf(w->backend, sizeof(w->backend), "%s", reg->backend);
	snprintf(w->decode_kernel, sizeof(w->decode_kernel), "%s",
		 reg->decode_kernel ? reg->decode_kernel : "");
	if (reg->nccl_unique_id.len)
		memcpy(w->nccl_id, reg->nccl_unique_id.data, reg->nccl_unique_id.len);
	w->nccl_len = reg->nccl_unique_id.len;
	w->whole_prompts = reg->whole_prompts;
	w->max_prefill = reg->max_prefill;
	w->calib_id = 0;
	for (size_t i = 0; i < 8 && i < reg->calib_sha256.len; i++)
		w->calib_id = w->calib_id << 8 | reg->calib_sha256.data[i];
	bd_log_info("worker rank %d registered: pid %d, %s%s", reg->rank, reg->pid, w->backend,
		    reg->whole_prompts ? " (whole prompts only)" : "");
	for (int i = 0; i < rt->o.tp; i++)
		if (!rt->w[i].registered)
			return;
	form_group(rt);
}

static int rank_of(struct bd_router *rt, const uint8_t *ident, size_t len)
{
	for (int i = 0; i < rt->o.tp; i++)
		if (rt->w[i].connected && rt->w[i].ident_len == len &&
		    !memcmp(rt->w[i].ident, ident, len))
			return i;
	return -1;
}

/* A StepResult of rank (taken over): kept until every rank has answered the step in flight,
 * then handed to the scheduler. */
static void on_result(struct bd_router *rt, int rank, Bdfp4__StepResult *res)
{
	struct bd_router_step *st = &rt->step;

	if (!st->active || res->epoch != st->epoch || res->step != st->id || st->res[rank]) {
		bd_log_debug("stale result of step %llu from rank %d dropped",
			     (unsigned long long)res->step, rank);
		bdfp4__step_result__free_unpacked(res, NULL);
		return;
	}
	st->res[rank] = res;
	rt->w[rank].steps++;
	bd_router_metrics_step(rt->metrics, rank, res->compute_us);
	if (++st->n_res == rt->o.tp) {
		bd_sched_step_done(&rt->sched, st->res, rt->o.tp, bd_now_ms());
		step_clear(rt);
	} else if (res->error != BDFP4__SERVE_ERROR__SERVE_OK) {
		/* a rank that failed the whole step (its all-reduce lost the peer) leaves its peers
		 * waiting in a collective that cannot finish: do not wait for them */
		char msg[320], missing[64] = "";
		size_t off = 0;

		for (int i = 0; i < rt->o.tp && off < sizeof(missing); i++)
			if (!st->res[i])
				off += (size_t)snprintf(missing + off, sizeof(missing) - off, "%s%d",
							off ? ", " : "", i);
		snprintf(msg, sizeof(msg), "no answer from worker rank %s to step %llu, which "
			 "failed on rank %d: %s", missing, (unsigned long long)res->step, rank,
			 *res->message ? res->message : "step failed");
		group_fail(rt, -1, msg);
	}
}

void bd_router_on_workers(struct bd_router *rt)
{
	for (int budget = 0; budget < 256; budget++) {
		zmq_msg_t parts[2];
		Bdfp4__WorkerMessage *m;
		uint8_t ident[256];
		size_t len;
		/* [identity] [WorkerMessage]; further frames are not ours */
		int n = bd_router_recv(rt->wsock, parts, 2), rank;

		if (!n)
			return;
		if (n < 2) {
			bd_router_frames_close(parts, n, 2);
			continue;
		}
		len = zmq_msg_size(&parts[0]) < sizeof(ident) ? zmq_msg_size(&parts[0])
							     : sizeof(ident);
		memcpy(ident, zmq_msg_data(&parts[0]), len);
		m = bdfp4__worker_message__unpack(NULL, zmq_msg_size(&parts[1]),
						  zmq_msg_data(&parts[1]));
		bd_router_frames_close(parts, n, 2);
		rank = rank_of(rt, ident, len);
		if (rank >= 0)
			rt->w[rank].last_seen = bd_now_ms();
		if (!m) {
			bd_log_warn("malformed frame from %s worker", rank >= 0 ? "a" : "an unknown");
			continue;
		}
		switch (m->msg_case) {
		case BDFP4__WORKER_MESSAGE__MSG_REGISTER_REQUEST:
			on_register(rt, ident, len, m->register_request);
			break;
		case BDFP4__WORKER_MESSAGE__MSG_RESULT:
			if (rank >= 0 && m->result->rank == rank) {
				Bdfp4__StepResult *res = m->result;

				m->result = NULL;
				m->msg_case = BDFP4__WORKER_MESSAGE__MSG__NOT_SET;
				on_result(rt, rank, res);
			}
			break;
		case BDFP4__WORKER_MESSAGE__MSG_HEARTBEAT:
			if (rank >= 0) {
				rt->w[rank].steps = m->heartbeat->steps;
			} else if (m->heartbeat->epoch) {
				/* a worker we dropped (timed out, or a router restart) thinks it
				 * is in a group: tell it to register again */
				Bdfp4__RouterMessage rm = BDFP4__ROUTER_MESSAGE__INIT;
				Bdfp4__Reset rs = BDFP4__RESET__INIT;

				rs.epoch = m->heartbeat->epoch;
				rs.reason = (char *)"unknown to the router: register again";
				rm.msg_case = BDFP4__ROUTER_MESSAGE__MSG_RESET;
				rm.reset = &rs;
				bd_router_send(rt->wsock, ident, len, false, &rm.base);
			}
			break;
		default:
			bd_log_warn("worker frame of no known type");
			break;
		}
		bdfp4__worker_message__free_unpacked(m, NULL);
	}
}

int bd_router_send_plan(struct bd_router *rt, const Bdfp4__StepPlan *plan, int64_t now)
{
	Bdfp4__RouterMessage msg = BDFP4__ROUTER_MESSAGE__INIT;

	msg.msg_case = BDFP4__ROUTER_MESSAGE__MSG_PLAN;
	msg.plan = (Bdfp4__StepPlan *)plan;
	step_clear(rt);
	rt->step.active = true;
	rt->step.epoch = plan->epoch;
	rt->step.id = plan->step;
	rt->step.deadline = now + rt->o.step_timeout_ms;
	for (int rank = 0; rank < rt->o.tp; rank++) {
		if (send_worker(rt, rank, &msg) < 0) {
			char m[128];

			/* the plan's rows fail through the group failure */
			snprintf(m, sizeof(m), "worker rank %d (pid %d) is gone", rank,
				 rt->w[rank].pid);
			group_fail(rt, rank, m);
			return -EHOSTUNREACH;
		}
	}
	return 0;
}

void bd_router_workers_tick(struct bd_router *rt, int64_t now)
{
	bool beat = now >= rt->next_heartbeat;
	Bdfp4__RouterMessage m = BDFP4__ROUTER_MESSAGE__INIT;
	Bdfp4__RouterHeartbeat hb = BDFP4__ROUTER_HEARTBEAT__INIT;

	hb.epoch = rt->epoch;
	m.msg_case = BDFP4__ROUTER_MESSAGE__MSG_HEARTBEAT;
	m.heartbeat = &hb;
	if (beat)
		rt->next_heartbeat = now + rt->o.heartbeat_ms;
	for (int i = 0; i < rt->o.tp; i++) {
		struct bd_worker *w = &rt->w[i];
		char msg[160];

		if (!w->connected)
			continue;
		if (beat && send_worker(rt, i, &m) < 0) {
			snprintf(msg, sizeof(msg), "worker rank %d (pid %d) disconnected", i, w->pid);
		} else if (now - w->last_seen > rt->o.heartbeat_timeout_ms) {
			/* also inside a step: a worker's I/O thread beats on its own clock however
			 * long the step, so silence means the process is gone or stopped */
			snprintf(msg, sizeof(msg), "worker rank %d (pid %d) stopped heartbeating "
						   "(%lld ms)",
				 i, w->pid, (long long)(now - w->last_seen));
		} else {
			continue;
		}
		if (rt->group_ready) {
			group_fail(rt, i, msg);
		} else {
			bd_log_warn("%s", msg);
			w->connected = false;
			w->registered = false;
		}
	}
	if (rt->step.active && now > rt->step.deadline) {
		char msg[96];

		snprintf(msg, sizeof(msg), "step %llu not answered in %d ms",
			 (unsigned long long)rt->step.id, rt->o.step_timeout_ms);
		group_fail(rt, -1, msg);
	}
}

void bd_router_workers_shutdown(struct bd_router *rt)
{
	Bdfp4__RouterMessage m = BDFP4__ROUTER_MESSAGE__INIT;
	Bdfp4__Shutdown sd = BDFP4__SHUTDOWN__INIT;

	sd.reason = (char *)"the router is stopping";
	m.msg_case = BDFP4__ROUTER_MESSAGE__MSG_SHUTDOWN;
	m.shutdown = &sd;
	for (int i = 0; i < rt->o.tp; i++)
		if (rt->w[i].connected)
			send_worker(rt, i, &m);
}
