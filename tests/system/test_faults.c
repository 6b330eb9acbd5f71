/* test_faults.c — the router's answers in the corners of its life, with real daemons
 * (kvpoold, two workerd, routerd on the CPU backend). Suite "faults".
 *
 * - The drain: closed-loop clients keep sending while the router drains after SIGTERM; every
 *   request gets its answer (its tokens, or SHUTTING_DOWN for one sent during the drain),
 *   none is met with silence, and routerd exits 0.
 * - Identity reuse: a client with a fixed ZeroMQ routing id goes away with a request queued and
 *   a new connection takes the same id; the predecessor's request is dropped (its pool record
 *   released) and never answered to the successor.
 * - A chat message of a role the template does not know is refused, nothing allocated.
 * - A worker killed and started again registers, the group forms in a new epoch whose attach
 *   tokens the router registered with kvpoold, the new process attaches with its rank's token
 *   (no attach refused), and the system serves.
 */
#include <criterion/criterion.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zmq.h>

#include "serve.pb-c.h"
#include "serve/bd_client.h"
#include "pool/bd_pool_client.h"
#include "serve_common.h"

#define WAIT_MS 120000
#define N_CLIENTS 4

SV_TEST_SUITE(faults, 600);

static void up(const char *const *router_args)
{
	sv_start_system(&E, router_args, WAIT_MS);
}

/* ---- the drain ----------------------------------------------------------------------------- */

struct loop_client {
	pthread_t th;
	int index;
	atomic_int done;        /* requests answered with their tokens */
	int refused;            /* answered SHUTTING_DOWN (the client then stops) */
	int silent;             /* sent and never answered within WAIT_MS */
	int other;              /* answered otherwise */
	char what[256];
};

static void *loop_main(void *arg)
{
	struct loop_client *lc = arg;
	struct bd_client *c;
	int32_t ids[16];

	if (bd_client_new(E.front_ep, &c) < 0) {
		snprintf(lc->what, sizeof(lc->what), "no client");
		lc->other++;
		return NULL;
	}
	for (int i = 0; i < 16; i++)
		ids[i] = 400 + 37 * i + lc->index;
	for (;;) {
		struct bd_client_gen g = { .token_ids = ids, .n_token_ids = 16, .max_tokens = 6,
					   .ignore_eos = true };
		struct bd_client_event ev;
		uint64_t tag;
		int e;

		if (bd_client_generate_start(c, &g, &tag) < 0) {
			lc->other++;
			break;
		}
		do
			e = bd_client_next(c, WAIT_MS, &ev);
		while (e == 0 && !(ev.tag == tag && ev.finish != BD_FINISH_NONE));
		if (e < 0) {
			lc->silent++;
			break;
		}
		if (ev.finish == BD_FINISH_LENGTH) {
			atomic_fetch_add(&lc->done, 1);
			continue;
		}
		if (ev.error == BD_SERVE_ERR_SHUTTING_DOWN) {
			lc->refused++;
			snprintf(lc->what, sizeof(lc->what), "%s", ev.message);
		} else {
			lc->other++;
			snprintf(lc->what, sizeof(lc->what), "%s (%s): %s",
				 bd_finish_name(ev.finish), bd_serve_error_name(ev.error),
				 ev.message);
		}
		break;
	}
	bd_client_free(c);
	return NULL;
}

Test(faults, every_request_of_closed_loop_clients_is_answered_through_the_drain)
{
	static struct loop_client lc[N_CLIENTS];
	int64_t end;

	up((const char *const[]){ "--drain-timeout-ms", "60000", NULL });
	for (int i = 0; i < N_CLIENTS; i++) {
		lc[i] = (struct loop_client){ .index = i };
		cr_assert_eq(pthread_create(&lc[i].th, NULL, loop_main, &lc[i]), 0);
	}
	/* every client under way (one answer each at least), then SIGTERM */
	end = sv_now_ms() + WAIT_MS;
	for (int i = 0; i < N_CLIENTS; i++)
		while (atomic_load(&lc[i].done) < 1 && sv_now_ms() < end)
			usleep(20000);
	cr_assert_eq(kill(E.router.pid, SIGTERM), 0);
	for (int i = 0; i < N_CLIENTS; i++)
		pthread_join(lc[i].th, NULL);
	cr_expect_eq(sv_stop(&E.router, 0, WAIT_MS), 0, "routerd:\n%s", sv_log_tail(&E.router));
	for (int i = 0; i < N_CLIENTS; i++) {
		cr_expect_geq(atomic_load(&lc[i].done), 1);
		cr_expect_eq(lc[i].silent, 0, "client %d: a request got no answer", i);
		cr_expect_eq(lc[i].other, 0, "client %d: %s", i, lc[i].what);
		cr_expect_eq(lc[i].refused, 1, "client %d: its request during the drain", i);
		cr_expect_not_null(strstr(lc[i].what, "shutting down"), "client %d: %s", i,
				   lc[i].what);
	}
	cr_expect(sv_pool_idle(&E, WAIT_MS), "the drain left pages or slots in the pool");
}

/* ---- identity reuse ------------------------------------------------------------------------ */

/* A DEALER with routing id "reused-id" on the router's frontend. */
static void *fixed_id_client(void *zctx)
{
	void *s = zmq_socket(zctx, ZMQ_DEALER);
	int zero = 0;

	cr_assert_not_null(s);
	cr_assert_eq(zmq_setsockopt(s, ZMQ_ROUTING_ID, "reused-id", 9), 0);
	cr_assert_eq(zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero)), 0);
	cr_assert_eq(zmq_connect(s, E.front_ep), 0);
	return s;
}

static void send_req(void *s, Bdfp4__ClientRequest *req)
{
	uint8_t buf[4096];
	size_t n = bdfp4__client_request__get_packed_size(req);

	cr_assert_leq(n, sizeof(buf));
	bdfp4__client_request__pack(req, buf);
	cr_assert_eq(zmq_send(s, buf, n, 0), (int)n);
}

static void send_generate(void *s, uint64_t conn, uint64_t tag, int32_t *ids, size_t n,
			  uint32_t max_tokens)
{
	Bdfp4__ClientRequest req = BDFP4__CLIENT_REQUEST__INIT;
	Bdfp4__GenerateRequest g = BDFP4__GENERATE_REQUEST__INIT;

	g.client_tag = tag;
	g.token_ids = ids;
	g.n_token_ids = n;
	g.max_tokens = max_tokens;
	g.ignore_eos = true;
	req.msg_case = BDFP4__CLIENT_REQUEST__MSG_GENERATE;
	req.generate = &g;
	req.connection = conn;
	send_req(s, &req);
}

/* The next reply on s within timeout_ms, NULL on timeout (free it). */
static Bdfp4__ClientReply *next_reply(void *s, int timeout_ms)
{
	zmq_pollitem_t it = { .socket = s, .events = ZMQ_POLLIN };
	zmq_msg_t m;
	Bdfp4__ClientReply *r;

	if (zmq_poll(&it, 1, timeout_ms) <= 0)
		return NULL;
	zmq_msg_init(&m);
	cr_assert_geq(zmq_msg_recv(&m, s, 0), 0);
	r = bdfp4__client_reply__unpack(NULL, zmq_msg_size(&m), zmq_msg_data(&m));
	zmq_msg_close(&m);
	cr_assert_not_null(r);
	return r;
}

static uint64_t reply_tag(const Bdfp4__ClientReply *r)
{
	return r->msg_case == BDFP4__CLIENT_REPLY__MSG_CHUNK	? r->chunk->client_tag
	       : r->msg_case == BDFP4__CLIENT_REPLY__MSG_ERROR ? r->error->client_tag
							       : 0;
}

/* Sends health requests on s (under connection conn) until one is answered: the router has
 * taken this connection (a second one of a routing id in use is refused until the first is
 * gone). No reply of tag `never` may come meanwhile. */
static void health_answered(void *s, uint64_t conn, uint64_t never)
{
	int64_t end = sv_now_ms() + 20000;

	for (bool answered = false; !answered;) {
		Bdfp4__ClientRequest req = BDFP4__CLIENT_REQUEST__INIT;
		Bdfp4__HealthRequest h = BDFP4__HEALTH_REQUEST__INIT;
		Bdfp4__ClientReply *r;

		cr_assert_lt(sv_now_ms(), end, "the router never answered connection %llu",
			     (unsigned long long)conn);
		req.msg_case = BDFP4__CLIENT_REQUEST__MSG_HEALTH;
		req.health = &h;
		req.connection = conn;
		send_req(s, &req);
		while ((r = next_reply(s, 1000))) {
			cr_expect_neq(reply_tag(r), never, "the predecessor's reply");
			answered |= r->msg_case == BDFP4__CLIENT_REPLY__MSG_HEALTH;
			bdfp4__client_reply__free_unpacked(r, NULL);
			if (answered)
				break;
		}
	}
}

static bool log_has(const struct sv_daemon *d, const char *what)
{
	static char buf[1 << 20];
	FILE *f = fopen(d->log, "r");
	size_t n = f ? fread(buf, 1, sizeof(buf) - 1, f) : 0;

	if (f)
		fclose(f);
	buf[n] = 0;
	return strstr(buf, what) != NULL;
}

Test(faults, a_reused_routing_id_gets_no_reply_of_its_predecessor)
{
	void *zctx = zmq_ctx_new();
	void *a, *b;
	struct bd_client *busy;
	struct bd_client_event ev;
	int32_t ids[12];
	uint64_t busy_tag;
	bool b_done = false;

	for (int i = 0; i < 12; i++)
		ids[i] = 500 + 11 * i;
	/* one row: a request queued behind a long one waits and sends nothing, and no keepalive
	 * tells the router that its client went away */
	up((const char *const[]){ "--max-batch", "1", "--keepalive-ms", "3600000", NULL });
	busy = sv_client(&E);
	struct bd_client_gen g = { .token_ids = ids, .n_token_ids = 12, .max_tokens = 40,
				   .stream = true, .ignore_eos = true };
	cr_assert_eq(bd_client_generate_start(busy, &g, &busy_tag), 0);
	cr_assert_eq(bd_client_next(busy, WAIT_MS, &ev), 0, "the long request does not run");

	a = fixed_id_client(zctx);
	send_generate(a, 1111, 7, ids, 12, 4); /* queued behind the long one */
	health_answered(a, 1111, 7); /* after the request, on the same connection: it arrived */
	zmq_close(a);

	/* the same routing id on a new connection: once the router has taken it (a health
	 * request answered), its predecessor's request is gone */
	b = fixed_id_client(zctx);
	health_answered(b, 2222, 7);
	send_generate(b, 2222, 8, ids, 12, 3);
	/* tag 8 is queued behind tag 7's place: without the drop, 7's reply would come first */
	while (!b_done) {
		Bdfp4__ClientReply *r = next_reply(b, WAIT_MS);

		cr_assert_not_null(r, "no reply to the new connection; router log:\n%s",
				   sv_log_tail(&E.router));
		cr_expect_neq(reply_tag(r), 7, "the predecessor's request was answered to its "
					       "successor");
		b_done = reply_tag(r) == 8 && r->msg_case == BDFP4__CLIENT_REPLY__MSG_CHUNK &&
			 r->chunk->finish_reason != BDFP4__FINISH_REASON__FINISH_NONE;
		if (b_done)
			cr_expect_eq(r->chunk->finish_reason, BDFP4__FINISH_REASON__FINISH_LENGTH);
		bdfp4__client_reply__free_unpacked(r, NULL);
	}
	cr_expect(log_has(&E.router, "its routing id reconnected"), "router log:\n%s",
		  sv_log_tail(&E.router));
	do
		cr_assert_eq(bd_client_next(busy, WAIT_MS, &ev), 0);
	while (ev.finish == BD_FINISH_NONE);
	cr_expect(sv_pool_idle(&E, WAIT_MS), "the predecessor's request left pages or a slot");
	zmq_close(b);
	bd_client_free(busy);
	zmq_ctx_term(zctx);
}

/* ---- roles ---------------------------------------------------------------------------------- */

Test(faults, a_chat_role_outside_system_user_assistant_is_refused)
{
	static const struct bd_client_msg bad[] = { { "user", "Hi" }, { "wizard", "Obey." } };
	static const struct bd_client_msg good[] = { { "system", "Be brief." },
						     { "user", "Hi" } };
	struct bd_client *c;
	struct bd_client_event ev;
	uint64_t tag;

	up(NULL);
	c = sv_client(&E);
	struct bd_client_gen g = { .messages = bad, .n_messages = 2, .max_tokens = 3 };
	cr_assert_eq(bd_client_generate_start(c, &g, &tag), 0);
	cr_assert_eq(bd_client_next(c, WAIT_MS, &ev), 0);
	cr_expect_eq(ev.finish, BD_FINISH_ERROR);
	cr_expect_eq(ev.error, BD_SERVE_ERR_INVALID_ARGUMENT, "%s", ev.message);
	cr_expect_str_eq(ev.message, "message 1: role 'wizard' is none of system, user, "
				     "assistant");
	cr_expect(sv_pool_idle(&E, WAIT_MS));
	g.messages = good;
	cr_assert_eq(bd_client_generate_start(c, &g, &tag), 0);
	cr_assert_eq(bd_client_next(c, WAIT_MS, &ev), 0);
	cr_expect(ev.finish == BD_FINISH_LENGTH || ev.finish == BD_FINISH_STOP, "%s (%s): %s",
		  bd_finish_name(ev.finish), bd_serve_error_name(ev.error), ev.message);
	bd_client_free(c);
}

/* ---- a worker restart: a new epoch, new attach tokens ------------------------------------- */

/* A short request on c runs to its end. */
static void short_request(struct bd_client *c)
{
	const struct bd_client_gen g = { .prompt = "Hi!", .chat = true, .max_tokens = 4 };
	struct bd_client_event ev;
	uint64_t tag;

	cr_assert_eq(bd_client_generate_start(c, &g, &tag), 0);
	do
		cr_assert_eq(bd_client_next(c, WAIT_MS, &ev), 0, "no answer; router log:\n%s",
			     sv_log_tail(&E.router));
	while (ev.tag != tag || (ev.kind == BD_CLIENT_CHUNK && ev.finish == BD_FINISH_NONE));
	cr_expect(ev.finish == BD_FINISH_LENGTH || ev.finish == BD_FINISH_STOP, "%s (%s): %s",
		  bd_finish_name(ev.finish), bd_serve_error_name(ev.error), ev.message);
}

Test(faults, a_restarted_worker_attaches_with_a_new_epoch_token_and_serves)
{
	struct bd_client *c;
	struct bd_pool_stats *s1, *s2;
	int64_t end;

	up(NULL);
	c = sv_client(&E);
	short_request(c);
	s1 = sv_pool_stats(&E);
	cr_assert_not_null(s1, "kvpoold does not answer");
	cr_expect_gt(s1->group_epoch, 0, "the router registered no group with kvpoold");
	cr_expect_eq(s1->attach_refused, 0, "an attach of the group was refused");
	cr_expect_eq(s1->n_attachments, 2);

	cr_assert_eq(sv_stop(&E.worker[1], SIGKILL, WAIT_MS), 128 + SIGKILL);
	sv_start_worker(&E, 1);
	sv_expect_healthy(&E, WAIT_MS, "the group did not form again");
	/* the new rank 1 attached once the group formed: wait for its attachment */
	end = sv_now_ms() + WAIT_MS;
	while ((s2 = sv_pool_stats(&E)) && s2->n_attachments != 2 && sv_now_ms() < end) {
		bd_pool_stats_free(s2);
		usleep(20000);
	}
	cr_assert_not_null(s2, "kvpoold does not answer");
	cr_expect_gt(s2->group_epoch, s1->group_epoch,
		     "the restart formed no new epoch in kvpoold");
	cr_expect_eq(s2->n_attachments, 2, "rank 1 did not attach again");
	cr_expect_eq(s2->attach_refused, 0, "the new worker's token was refused; kvpoold log:\n%s",
		     sv_log_tail(&E.pool));
	bd_pool_stats_free(s1);
	bd_pool_stats_free(s2);
	short_request(c);
	bd_client_free(c);
}
