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
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <zmq.h>

#include "router.h"

int bd_router_send_worker(struct bd_router *rt, int rank, const Bdfp4__RouterMessage *m)
{
	struct bd_worker *w = &rt->w[rank];
	size_t n = bdfp4__router_message__get_packed_size(m);
	uint8_t stackbuf[512], *buf;
	int e = 0;

	if (!w->connected)
		return -EHOSTUNREACH;
	buf = n <= sizeof(stackbuf) ? stackbuf : malloc(n);
	if (!buf)
		return -ENOMEM;
	bdfp4__router_message__pack(m, buf);
	if (zmq_send(rt->wsock, w->ident, w->ident_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
	    zmq_send(rt->wsock, buf, n, ZMQ_DONTWAIT) < 0)
		e = -EHOSTUNREACH;
	if (buf != stackbuf)
		free(buf);
	return e;
}

static void send_to_ident(struct bd_router *rt, const uint8_t *ident, size_t len,
			  const Bdfp4__RouterMessage *m)
{
	size_t n = bdfp4__router_message__get_packed_size(m);
	uint8_t *buf = malloc(n ? n : 1);

	if (!buf)
		return;
	bdfp4__router_message__pack(m, buf);
	if (zmq_send(rt->wsock, ident, len, ZMQ_SNDMORE | ZMQ_DONTWAIT) == 0)
		zmq_send(rt->wsock, buf, n, ZMQ_DONTWAIT);
	free(buf);
}

static void send_reset(struct bd_router *rt, int rank, const char *why)
{
	Bdfp4__RouterMessage m = BDFP4__ROUTER_MESSAGE__INIT;
	Bdfp4__Reset rs = BDFP4__RESET__INIT;

	rs.epoch = rt->epoch;
	rs.reason = (char *)why;
	m.msg_case = BDFP4__ROUTER_MESSAGE__MSG_RESET;
	m.reset = &rs;
	if (bd_router_send_worker(rt, rank, &m) < 0)
		rt->w[rank].connected = false;
}

void bd_router_group_fail(struct bd_router *rt, int dead_rank, const char *msg)
{
	bool was_ready = rt->group_ready;

	bd_log_err("worker group failed: %s", msg);
	if (dead_rank >= 0) {
		rt->w[dead_rank].connected = false;
		rt->w[dead_rank].registered = false;
	}
	rt->group_ready = false;
	bd_router_abort_step(rt, msg);
	bd_router_fail_running(rt, BDFP4__SERVE_ERROR__SERVE_ERR_WORKER_FAILED, msg);
	rt->n_release = 0; /* every rank drops every sequence on reset */
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
		if (bd_router_send_worker(rt, i, &m) < 0 && failed < 0)
			failed = i;
	}
	rt->group_ready = true;
	rt->n_release = 0;
	if (failed >= 0) {
		char msg[96];

		snprintf(msg, sizeof(msg), "worker rank %d left while the group formed", failed);
		bd_router_group_fail(rt, failed, msg);
		return;
	}
	if (rt->state != RS_STOPPING) /* a group formed during the drain serves the drain */
		rt->state = RS_SERVING;
	rt->reason[0] = 0;
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
	send_to_ident(rt, ident, len, &m);
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
		bd_router_group_fail(rt, -1, why);
	}
	w->connected = true;
	w->registered = true;
	memcpy(w->ident, ident, len);
	w->ident_len = len;
	w->pid = reg->pid;
	w->device = reg->device;
	w->last_seen = bd_now_ms();
	snprintf(w->backend, sizeof(w->backend), "%s", reg->backend);
	if (reg->nccl_unique_id.len)
		memcpy(w->nccl_id, reg->nccl_unique_id.data, reg->nccl_unique_id.len);
	w->nccl_len = reg->nccl_unique_id.len;
	bd_log_info("worker rank %d registered: pid %d, %s", reg->rank, reg->pid, w->backend);
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

void bd_router_on_workers(struct bd_router *rt)
{
	for (int budget = 0; budget < 256; budget++) {
		zmq_msg_t id, body;
		Bdfp4__WorkerMessage *m;
		uint8_t ident[256];
		size_t len;
		int rank;

		zmq_msg_init(&id);
		if (zmq_msg_recv(&id, rt->wsock, ZMQ_DONTWAIT) < 0) {
			zmq_msg_close(&id);
			return;
		}
		len = zmq_msg_size(&id) < sizeof(ident) ? zmq_msg_size(&id) : sizeof(ident);
		memcpy(ident, zmq_msg_data(&id), len);
		zmq_msg_init(&body);
		if (!zmq_msg_more(&id) || zmq_msg_recv(&body, rt->wsock, 0) < 0) {
			zmq_msg_close(&id);
			zmq_msg_close(&body);
			continue;
		}
		/* extra frames: not ours */
		while (zmq_msg_more(&body)) {
			zmq_msg_close(&body);
			zmq_msg_init(&body);
			if (zmq_msg_recv(&body, rt->wsock, 0) < 0)
				break;
		}
		zmq_msg_close(&id);
		m = bdfp4__worker_message__unpack(NULL, zmq_msg_size(&body), zmq_msg_data(&body));
		zmq_msg_close(&body);
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
				bd_router_on_result(rt, rank, res);
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
				send_to_ident(rt, ident, len, &rm);
			}
			break;
		default:
			bd_log_warn("worker frame of no known type");
			break;
		}
		bdfp4__worker_message__free_unpacked(m, NULL);
	}
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
		if (beat && bd_router_send_worker(rt, i, &m) < 0) {
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
			bd_router_group_fail(rt, i, msg);
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
		bd_router_group_fail(rt, -1, msg);
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
			bd_router_send_worker(rt, i, &m);
}
