/* io.c — workerd's I/O thread: the DEALER to the router, heartbeats and the watchdog.
 *
 * The compute thread may spend seconds in one step; the router declares a quiet worker dead
 * outside steps, and systemd a quiet service. So frames go through this thread, which keeps
 * both clocks on its own: router frames are forwarded to the compute thread over an inproc
 * PAIR as they come, the compute thread's frames go out as they come.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <systemd/sd-daemon.h>
#include <zmq.h>

#include "base/bd_zsec.h"

#include "serve/bd_wire.h"
#include "workerd.h"

struct io {
	struct wd *w;
	void *dealer, *pair;
	int64_t last_drop_log, last_bad_log;
	uint64_t watchdog_usec; /* the unit's WatchdogSec=, 0 when none */
};

static void send_heartbeat(struct io *io)
{
	Bdfp4__WorkerMessage m = BDFP4__WORKER_MESSAGE__INIT;
	Bdfp4__WorkerHeartbeat hb = BDFP4__WORKER_HEARTBEAT__INIT;

	hb.rank = io->w->o.rank;
	hb.epoch = atomic_load(&io->w->pub_epoch);
	hb.steps = atomic_load(&io->w->pub_steps);
	hb.pid = (int32_t)getpid();
	m.msg_case = BDFP4__WORKER_MESSAGE__MSG_HEARTBEAT;
	m.heartbeat = &hb;
	/* a full queue: the next one will do */
	bd_wire_send(io->dealer, NULL, 0, false, &m.base, ZMQ_DONTWAIT);
}

/* Drops the rest of a multipart message whose first frame was read. Returns its frames. */
static int drop_rest(void *from)
{
	int n = 1;

	for (bool more = true; more; n++) {
		zmq_msg_t extra;
		zmq_msg_init(&extra);
		if (zmq_msg_recv(&extra, from, 0) < 0) {
			zmq_msg_close(&extra);
			break;
		}
		more = zmq_msg_more(&extra);
		zmq_msg_close(&extra);
	}
	return n;
}

/* Move every pending message of `from` to `to`. The protocol's messages are one frame each: a
 * router message of several frames is dropped whole (none of its frames can be told to be a
 * message of its own), an empty one too. Returns 1 when the compute thread asked to stop. */
static int pump(struct io *io, void *from, void *to, bool from_compute)
{
	for (;;) {
		zmq_msg_t msg;
		zmq_msg_init(&msg);
		if (zmq_msg_recv(&msg, from, ZMQ_DONTWAIT) < 0) {
			zmq_msg_close(&msg);
			return 0;
		}
		bool more = zmq_msg_more(&msg);
		if (!from_compute)
			atomic_store(&io->w->last_router_ms, bd_now_ms());
		if (from_compute && zmq_msg_size(&msg) == 0) {
			zmq_msg_close(&msg);
			return 1;
		}
		if (!from_compute && (more || zmq_msg_size(&msg) == 0)) {
			size_t first = zmq_msg_size(&msg);
			int n = more ? drop_rest(from) : 1;
			int64_t now = bd_now_ms();

			zmq_msg_close(&msg);
			if (now - io->last_bad_log > 10000) {
				io->last_bad_log = now;
				bd_log_warn("a router message of %d frame(s) (the first %zu bytes) "
					    "dropped whole: the protocol's messages are one frame", n,
					    first);
			}
			continue;
		}
		if (zmq_msg_send(&msg, to, ZMQ_DONTWAIT) < 0) {
			/* no connection to the router (ZMQ_IMMEDIATE): say so now and then */
			int64_t now = bd_now_ms();
			if (from_compute)
				atomic_store(&io->w->last_drop_ms, now);
			if (from_compute && now - io->last_drop_log > 10000) {
				io->last_drop_log = now;
				bd_log_warn("no connection to the router at %s: a frame was dropped",
					io->w->o.router);
			}
			zmq_msg_close(&msg);
		}
		if (more)
			drop_rest(from);
	}
}

static void *io_main(void *arg)
{
	struct io *io = arg;
	struct wd *w = io->w;
	int64_t next_hb = 0, next_wd = 0;

	for (;;) {
		int64_t now = bd_now_ms();
		if (now >= next_hb) {
			send_heartbeat(io);
			next_hb = now + atomic_load(&w->heartbeat_ms);
		}
		if (io->watchdog_usec && now >= next_wd) {
			sd_notify(0, "WATCHDOG=1");
			next_wd = now + (int64_t)(io->watchdog_usec / 2000);
		}
		int64_t until = next_hb;
		if (io->watchdog_usec && next_wd < until)
			until = next_wd;
		zmq_pollitem_t it[2] = { { io->dealer, 0, ZMQ_POLLIN, 0 },
					 { io->pair, 0, ZMQ_POLLIN, 0 } };
		long timeout = until > now ? (long)(until - now) : 0;
		if (zmq_poll(it, 2, timeout) < 0) {
			if (zmq_errno() == EINTR)
				continue;
			if (zmq_errno() == ETERM)
				break;
			bd_log_err("I/O thread: poll: %s", zmq_strerror(zmq_errno()));
			break;
		}
		if (it[0].revents & ZMQ_POLLIN)
			pump(io, io->dealer, io->pair, false);
		if ((it[1].revents & ZMQ_POLLIN) && pump(io, io->pair, io->dealer, true))
			break;
	}
	zmq_close(io->dealer);
	zmq_close(io->pair);
	free(io);
	return NULL;
}

int wd_io_start(struct wd *w)
{
	struct io *io = calloc(1, sizeof(*io));
	int linger = 0, ivl = 100, ivl_max = 1000;
	int64_t maxmsg = WD_MAX_FRAME;

	if (!io)
		return -ENOMEM;
	io->w = w;
	/* this thread keeps the watchdog (a long step must not starve it), from before READY */
	if (sd_watchdog_enabled(0, &io->watchdog_usec) <= 0)
		io->watchdog_usec = 0;
	io->dealer = zmq_socket(w->zctx, ZMQ_DEALER);
	io->pair = zmq_socket(w->zctx, ZMQ_PAIR);
	if (!io->dealer || !io->pair)
		goto fail;
	/* queue nothing while the router is away: a register sent then must not arrive late,
	 * after a later one formed the group */
	int immediate = 1;
	zmq_setsockopt(io->dealer, ZMQ_IMMEDIATE, &immediate, sizeof(immediate));
	zmq_setsockopt(io->dealer, ZMQ_LINGER, &linger, sizeof(linger));
	zmq_setsockopt(io->dealer, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
	zmq_setsockopt(io->dealer, ZMQ_RECONNECT_IVL, &ivl, sizeof(ivl));
	zmq_setsockopt(io->dealer, ZMQ_RECONNECT_IVL_MAX, &ivl_max, sizeof(ivl_max));
	zmq_setsockopt(io->pair, ZMQ_LINGER, &linger, sizeof(linger));
	{
		char err[512];

		if (bd_zsec_client_files(io->dealer, w->o.router_server_key, w->o.curve_secret_key,
					 err, sizeof(err)) < 0) {
			bd_log_err("router connection: %s", err);
			goto fail;
		}
	}
	if (zmq_connect(io->dealer, w->o.router) < 0) {
		bd_log_err("router endpoint '%s': %s", w->o.router, zmq_strerror(zmq_errno()));
		goto fail;
	}
	if (zmq_connect(io->pair, w->io_endpoint) < 0)
		goto fail;
	/* sockets move to the new thread; pthread_create is the barrier that makes it legal */
	if (pthread_create(&w->io, NULL, io_main, io) != 0)
		goto fail;
	w->io_started = true;
	return 0;
fail:
	bd_wire_close(&io->dealer);
	bd_wire_close(&io->pair);
	free(io);
	return -EINVAL;
}

void wd_io_stop(struct wd *w)
{
	if (!w->io_started)
		return;
	zmq_send(w->pair, "", 0, 0);
	pthread_join(w->io, NULL);
	w->io_started = false;
}

int wd_send(struct wd *w, const Bdfp4__WorkerMessage *m)
{
	/* a message without its oneof packs to the empty frame that stops the I/O thread */
	if (m->msg_case == BDFP4__WORKER_MESSAGE__MSG__NOT_SET)
		return -EINVAL;
	return bd_wire_send(w->pair, NULL, 0, false, &m->base, 0);
}
