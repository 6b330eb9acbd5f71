/* pool.c — routerd's watch on kvpoold.
 *
 * The pool calls of the scheduler are blocking round trips bounded by pool_timeout_ms; one whose
 * connection closes before the answer (kvpoold killed) is sent again on a fresh connection with
 * its call number (bd_pool_conn_set_retry), so a kvpoold restarted within pool_timeout_ms
 * answers it, and one that had applied it answers with the first reply instead of applying it
 * twice. The pool has a state here: up, or down after a call or a probe got no answer, or the
 * connection closed. While it is down new requests get UNAVAILABLE and health says "kvpoold
 * unreachable: ..."; nothing is planned (the scheduler asks), and the running requests wait
 * for it, up to pool_wait_ms. A kvpoold that comes back on its stored arenas (the same arena
 * id: every page and record as before) lets them go on where they were. One that comes back
 * with other arenas (it started empty: their KV is gone), or none within pool_wait_ms, fails
 * them with UNAVAILABLE; from then on POOL_CALL fails at once (-EHOSTDOWN) until it answers.
 *
 * The probe is a StatsQuery on a DEALER socket of its own, sent every pool_probe_ms and never
 * waited for: its answer is read by the event loop. ZMQ_IMMEDIATE makes a send fail when no
 * connection exists, and the socket's monitor reports a closed connection at once (kvpoold
 * killed). The first answer after a failure brings the pool back: records the router may have
 * left in it are reclaimed (OwnerReclaim) before anything is admitted again.
 *
 * bd_router_pool_ops is the scheduler's pool (sched.h) over these calls: the router's owner id,
 * the health gate, and a note that a reclaim is due when a call may have left a record behind.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zmq.h>

#include "kvpool.pb-c.h"
#include "quant/bd_layout.h"
#include "router.h"

#define MON_ENDPOINT "inproc://routerd-pool-monitor"

int bd_router_pool_open(struct bd_router *rt)
{
	int zero = 0, one = 1;
	int64_t now = bd_now_ms();

	rt->probe = zmq_socket(rt->zctx, ZMQ_DEALER);
	if (!rt->probe)
		return -ENOMEM;
	/* IMMEDIATE: no queueing towards a pool that is not connected; the send fails instead */
	if (zmq_setsockopt(rt->probe, ZMQ_LINGER, &zero, sizeof(zero)) < 0 ||
	    zmq_setsockopt(rt->probe, ZMQ_IMMEDIATE, &one, sizeof(one)) < 0 ||
	    zmq_socket_monitor(rt->probe, MON_ENDPOINT, ZMQ_EVENT_DISCONNECTED) < 0)
		goto fail;
	if (*rt->o.pool_server_key) {
		char err[512];

		if (bd_zsec_client_files(rt->probe, rt->o.pool_server_key, rt->o.curve_secret_key,
					 err, sizeof(err)) < 0) {
			bd_log_err("pool probe %s: %s", rt->o.pool, err);
			return -EINVAL;
		}
	}
	rt->probe_mon = zmq_socket(rt->zctx, ZMQ_PAIR);
	if (!rt->probe_mon || zmq_setsockopt(rt->probe_mon, ZMQ_LINGER, &zero, sizeof(zero)) < 0 ||
	    zmq_connect(rt->probe_mon, MON_ENDPOINT) < 0 || zmq_connect(rt->probe, rt->o.pool) < 0)
		goto fail;
	rt->pool_ok = true;
	rt->pool_last_ok = now;
	rt->next_probe = now + rt->o.pool_probe_ms;
	/* a call whose connection closes is sent again until its timeout: a restart is quick */
	if (rt->pool)
		bd_pool_conn_set_retry(rt->pool, rt->o.pool_timeout_ms);
	return 0;
fail:
	bd_log_err("pool probe %s: %s", rt->o.pool, zmq_strerror(zmq_errno()));
	return -EIO;
}

void bd_router_pool_close(struct bd_router *rt)
{
	if (rt->probe)
		zmq_socket_monitor(rt->probe, NULL, 0);
	if (rt->probe_mon)
		zmq_close(rt->probe_mon);
	if (rt->probe)
		zmq_close(rt->probe);
	rt->probe = rt->probe_mon = NULL;
}

static void mark_down(struct bd_router *rt, const char *why)
{
	rt->pool_failures++;
	if (!rt->pool_ok)
		return;
	rt->pool_ok = false;
	rt->pool_waiting = true;
	rt->pool_down_since = bd_now_ms();
	snprintf(rt->pool_err, sizeof(rt->pool_err), "%.250s", why);
	bd_log_err("kvpoold unreachable: %s; new requests are refused until it answers again, "
		   "running ones wait up to %d ms (pool_wait_ms)", why, rt->o.pool_wait_ms);
}

/* Takes the arena id of a stats reply. Returns false when the pool had other arenas before:
 * it restarted empty and the KV of every running request is gone (the tick fails them). */
static bool same_arenas(struct bd_router *rt, const ProtobufCBinaryData *id)
{
	bool same = !rt->pool_arena_known || id->len != sizeof(rt->pool_arena_id) ||
		    !memcmp(rt->pool_arena_id, id->data, sizeof(rt->pool_arena_id));

	if (id->len == sizeof(rt->pool_arena_id)) {
		memcpy(rt->pool_arena_id, id->data, sizeof(rt->pool_arena_id));
		rt->pool_arena_known = true;
	}
	if (same)
		return true;
	if (rt->pool_ok) {
		rt->pool_ok = false;
		rt->pool_down_since = bd_now_ms();
	}
	rt->pool_waiting = false;
	rt->pool_lost = true;
	snprintf(rt->pool_err, sizeof(rt->pool_err), "kvpoold restarted without its stored arenas "
		 "(another arena id): the KV of the running requests is gone");
	bd_log_err("%s", rt->pool_err);
	return false;
}

int bd_router_pool_note(struct bd_router *rt, int e)
{
	int code = BD_POOL_OK;
	char why[300];

	bd_pool_conn_error(rt->pool, &code);
	/* an answer: success, or the daemon's refusal (a code); local argument and memory errors
	 * say nothing about the pool */
	if (e >= 0 || code != BD_POOL_OK || e == -EINVAL || e == -ENOMEM) {
		rt->pool_last_ok = bd_now_ms();
		rt->pool_failures = 0;
		return e;
	}
	if (e == -ETIMEDOUT)
		snprintf(why, sizeof(why), "no answer in %d ms (pool_timeout_ms)",
			 rt->o.pool_timeout_ms);
	else
		snprintf(why, sizeof(why), "%s", strerror(-e));
	mark_down(rt, why);
	return e;
}

void bd_router_pool_reason(const struct bd_router *rt, char *buf, size_t cap)
{
	if (rt->pool_ok) {
		buf[0] = 0;
		return;
	}
	snprintf(buf, cap, "kvpoold unreachable: %s (for %lld ms)", rt->pool_err,
		 (long long)(bd_now_ms() - rt->pool_down_since));
}

int bd_router_pool_refresh(struct bd_router *rt)
{
	struct bd_pool_stats *st = NULL;
	int e = POOL_CALL(rt, bd_pool_stats(rt->pool, 1, &st));

	if (e < 0)
		return e;
	rt->pages_free = st->pages_free;
	rt->slots_free = st->slots_free;
	rt->pages_cached = st->pages_cached;
	rt->prefix_evictions = st->prefix_evictions;
	rt->pages_total = st->pages_total;
	rt->slots_total = st->slots_total;
	/* the first refresh (at start) learns the arena id; a later one holds the pool to it */
	if (!same_arenas(rt, &(ProtobufCBinaryData){ sizeof(st->arena_id), st->arena_id })) {
		bd_pool_stats_free(st);
		return -ESTALE;
	}
	bd_pool_stats_free(st);
	return 0;
}

int bd_router_pool_group(struct bd_router *rt)
{
	int e;

	if (!rt->epoch)
		return 0;
	e = POOL_CALL(rt, bd_pool_group_register(rt->pool, rt->o.owner, rt->epoch, rt->tokens,
						 (size_t)rt->o.tp));
	if (e < 0) {
		bd_log_err("pool: registering the attach tokens of epoch %llu: %s%s%s",
			   (unsigned long long)rt->epoch, strerror(-e),
			   *bd_pool_conn_error(rt->pool, NULL) ? ": " : "",
			   bd_pool_conn_error(rt->pool, NULL));
		return e;
	}
	rt->group_in_pool = true;
	bd_log_info("pool: attach tokens of epoch %llu registered", (unsigned long long)rt->epoch);
	return 0;
}

/* A stats answer's group against the router's: a kvpoold that restarted (its group is not
 * stored) or did not take the registration gets the epoch's tokens again. */
static void check_group(struct bd_router *rt, const Bdfp4__PoolStats *st)
{
	if (!rt->epoch || !rt->pool_ok)
		return;
	if (st->group_epoch == rt->epoch && st->group_owner == rt->o.owner && rt->group_in_pool)
		return;
	if (rt->group_in_pool)
		bd_log_warn("pool: kvpoold has the group of epoch %llu, the router %llu (kvpoold "
			    "restarted?): registering again", (unsigned long long)st->group_epoch,
			    (unsigned long long)rt->epoch);
	rt->group_in_pool = false;
	bd_router_pool_group(rt);
}

/* Request id ended, its record possibly left in the pool (a release or an assignment without an
 * answer): released again when the pool answers, since a reclaim of the whole owner would take
 * the records of the requests that wait for it. A full list falls back to that reclaim. */
static void unreleased(struct bd_router *rt, uint64_t id)
{
	if (rt->n_pool_unreleased < sizeof(rt->pool_unreleased) / sizeof(rt->pool_unreleased[0]))
		rt->pool_unreleased[rt->n_pool_unreleased++] = id;
	else
		rt->pool_reclaim = true;
}

/* The pool answered while down: release or reclaim what ended requests may have left, then
 * serve. busy: a step is in flight or a request holds a record. */
static void recover(struct bd_router *rt, bool busy)
{
	uint64_t n_req = 0, n_pages = 0;
	int64_t down_ms = bd_now_ms() - rt->pool_down_since;
	int e;

	/* first the requests fail (the tick), and the step in flight ends: a worker may still
	 * write into its pages, and a reclaim must not take a live request's record */
	if (rt->pool_lost || (rt->pool_reclaim && busy))
		return;
	rt->pool_ok = true; /* lets the calls below through; a failure marks it down again */
	while (rt->n_pool_unreleased) {
		uint64_t id = rt->pool_unreleased[rt->n_pool_unreleased - 1];

		e = POOL_CALL(rt, bd_pool_request_release(rt->pool, id, NULL));
		if (e < 0 && e != -ENOENT) {
			if (rt->pool_ok) {
				bd_log_err("pool: release of request %llu: %s",
					   (unsigned long long)id, strerror(-e));
				rt->pool_ok = false;
			}
			return;
		}
		rt->n_pool_unreleased--;
	}
	if (rt->pool_reclaim) {
		e = POOL_CALL(rt, bd_pool_owner_reclaim(rt->pool, rt->o.owner, &n_req, &n_pages));
		if (e < 0) {
			if (rt->pool_ok) {
				bd_log_err("pool: reclaim of owner %llu: %s",
					 (unsigned long long)rt->o.owner, strerror(-e));
				rt->pool_ok = false;
			}
			return;
		}
		rt->pool_reclaim = false;
		if (n_req)
			bd_log_info("pool: reclaimed %llu request record(s), %llu page(s) left by "
				  "failed requests", (unsigned long long)n_req,
				  (unsigned long long)n_pages);
	}
	if (bd_router_pool_refresh(rt) < 0)
		return;
	bd_log_info("kvpoold answers again (down for %lld ms): serving", (long long)down_ms);
	rt->pool_waiting = false;
	rt->pool_err[0] = 0;
	rt->pool_failures = 0;
}

static void on_answer(struct bd_router *rt, const uint8_t *body, size_t len, bool busy)
{
	Bdfp4__PoolReply *rep = bdfp4__pool_reply__unpack(NULL, len, body);

	if (!rep) {
		bd_log_warn("pool probe: an answer that does not parse");
		return;
	}
	rt->probe_out = false;
	rt->pool_last_ok = bd_now_ms();
	if (rep->stats && !same_arenas(rt, &rep->stats->arena_id)) {
		bdfp4__pool_reply__free_unpacked(rep, NULL);
		return;
	}
	if (rt->pool_ok) {
		rt->pool_failures = 0;
		if (rep->stats) {
			rt->pages_free = rep->stats->pages_free;
			rt->slots_free = rep->stats->slots_free;
			rt->pages_cached = rep->stats->pages_cached;
			rt->prefix_evictions = rep->stats->prefix_evictions;
			rt->pages_total = rep->stats->pages_total;
			rt->slots_total = rep->stats->slots_total;
		}
	} else {
		recover(rt, busy);
	}
	if (rep->stats)
		check_group(rt, rep->stats);
	bdfp4__pool_reply__free_unpacked(rep, NULL);
}

void bd_router_pool_on_probe(struct bd_router *rt, bool busy)
{
	for (int budget = 0; budget < 64; budget++) {
		zmq_msg_t m[2];
		/* [""] [PoolReply], the envelope a REP socket answers a DEALER with */
		int n = bd_router_recv(rt->probe, m, 2);
		zmq_msg_t *body = n >= 2 && zmq_msg_size(&m[0]) == 0 ? &m[1] : &m[0];

		if (!n)
			break;
		on_answer(rt, zmq_msg_data(body), zmq_msg_size(body), busy);
		bd_router_frames_close(m, n, 2);
	}
	for (int budget = 0; budget < 64; budget++) {
		zmq_msg_t ev;
		uint16_t id = 0;
		/* [event id (16 bits) + value (32 bits)] [endpoint] */
		int n = bd_router_recv(rt->probe_mon, &ev, 1);

		if (!n)
			break;
		if (zmq_msg_size(&ev) >= 2)
			memcpy(&id, zmq_msg_data(&ev), 2);
		bd_router_frames_close(&ev, n, 1);
		if (id == ZMQ_EVENT_DISCONNECTED) {
			char why[300];

			snprintf(why, sizeof(why), "the connection to %s closed", rt->o.pool);
			mark_down(rt, why);
			rt->probe_out = false;
			rt->next_probe = bd_now_ms(); /* probe at once: a restart is quick */
		}
	}
}

static void send_probe(struct bd_router *rt, int64_t now)
{
	Bdfp4__PoolRequest req = BDFP4__POOL_REQUEST__INIT;
	Bdfp4__StatsQuery q = BDFP4__STATS_QUERY__INIT;

	q.top = 1;
	req.op_case = BDFP4__POOL_REQUEST__OP_STATS;
	req.stats = &q;
	/* while it is down, often: the requests wait for the first answer */
	rt->next_probe = now + (rt->pool_ok || rt->o.pool_probe_ms < 100 ? rt->o.pool_probe_ms : 100);
	if (bd_router_send(rt->probe, (const uint8_t *)"", 0, false, &req.base) < 0) {
		char why[300];

		/* IMMEDIATE: no connection to the pool */
		snprintf(why, sizeof(why), "not connected to %s", rt->o.pool);
		mark_down(rt, why);
		return;
	}
	rt->probe_out = true;
	rt->probe_sent = now;
}

bool bd_router_pool_tick(struct bd_router *rt, int64_t now)
{
	if (rt->probe_out && now - rt->probe_sent > rt->o.pool_timeout_ms) {
		char why[300];

		snprintf(why, sizeof(why), "no answer to a probe in %d ms (pool_timeout_ms)",
			 rt->o.pool_timeout_ms);
		rt->probe_out = false;
		mark_down(rt, why);
	}
	if (!rt->probe_out && now >= rt->next_probe)
		send_probe(rt, now);
	if (!rt->pool_ok && rt->pool_waiting && now - rt->pool_down_since >= rt->o.pool_wait_ms) {
		bd_log_err("kvpoold did not answer for %d ms (pool_wait_ms): the running requests "
			   "fail", rt->o.pool_wait_ms);
		rt->pool_waiting = false;
		rt->pool_lost = true;
	}
	if (!rt->pool_lost)
		return false;
	/* what was accepted cannot be served: a pool restarted empty lost its pages, a hung one
	 * allocates none; and they may have left records behind */
	rt->pool_lost = false;
	rt->pool_reclaim = true;
	rt->n_pool_unreleased = 0; /* the reclaim takes them */
	return true;
}

/* ---- the scheduler's pool -------------------------------------------------------------------- */

static int pool_slot_assign(void *ctx, uint64_t id, int32_t *ret_slot)
{
	struct bd_router *rt = ctx;
	int e = POOL_CALL(rt, bd_pool_slot_assign(rt->pool, id, rt->o.owner, ret_slot));

	if (e < 0 && !rt->pool_ok)
		unreleased(rt, id); /* the slot may be assigned, its answer lost */
	return e;
}

static int pool_page_alloc(void *ctx, uint64_t id, uint32_t n, int32_t *ret_pages)
{
	struct bd_router *rt = ctx;

	return POOL_CALL(rt, bd_pool_page_alloc(rt->pool, id, rt->o.owner, n, ret_pages));
}

static int pool_page_reserve(void *ctx, uint64_t id, int32_t *ret_page)
{
	struct bd_router *rt = ctx;

	return POOL_CALL(rt, bd_pool_page_reserve(rt->pool, id, rt->o.owner, ret_page));
}

static int pool_page_commit(void *ctx, uint64_t id, int32_t page)
{
	struct bd_router *rt = ctx;

	return POOL_CALL(rt, bd_pool_page_commit(rt->pool, id, page));
}

static int pool_release(void *ctx, uint64_t id)
{
	struct bd_router *rt = ctx;
	int e = POOL_CALL(rt, bd_pool_request_release(rt->pool, id, NULL));

	if (e < 0 && e != -ENOENT)
		unreleased(rt, id); /* the record stays behind until it is released again */
	return e;
}

static int pool_prefix_match(void *ctx, uint64_t id, const uint64_t *hashes, size_t n,
			     int32_t *ret_pages, size_t *ret_n)
{
	struct bd_router *rt = ctx;

	return POOL_CALL(rt, bd_pool_prefix_match(rt->pool, id, rt->o.owner, hashes, n, ret_pages,
						  ret_n));
}

static int pool_prefix_store(void *ctx, uint64_t id, const int32_t *pages, const uint64_t *hashes,
			     size_t n, const int32_t *tokens, uint64_t parent)
{
	struct bd_router *rt = ctx;

	return POOL_CALL(rt, bd_pool_prefix_store(rt->pool, id, pages, hashes, n, tokens,
						  n * BD_PAGE_TOKENS, parent, NULL));
}

static bool pool_is_down(void *ctx, char *why, size_t cap)
{
	struct bd_router *rt = ctx;

	if (why && cap)
		bd_router_pool_reason(rt, why, cap);
	return !rt->pool_ok;
}

const struct bd_sched_pool_ops bd_router_pool_ops = {
	.slot_assign = pool_slot_assign,
	.page_alloc = pool_page_alloc,
	.page_reserve = pool_page_reserve,
	.page_commit = pool_page_commit,
	.release = pool_release,
	.prefix_match = pool_prefix_match,
	.prefix_store = pool_prefix_store,
	.down = pool_is_down,
};
