/* wire.c — the ZeroMQ plumbing of routerd's sockets (router.h): the ROUTER sockets' options,
 * one protobuf message out behind its envelope, one whole message in. */
#include <errno.h>
#include <stdlib.h>

#include "router.h"
#include "serve/bd_wire.h"

void *bd_router_socket(void *zctx, int64_t maxmsg)
{
	void *s = zmq_socket(zctx, ZMQ_ROUTER);
	int zero = 0, one = 1, hwm = 100000;

	if (!s)
		return NULL;
	/* MANDATORY: a send to a gone peer fails (EHOSTUNREACH) instead of vanishing; that is
	 * how a disconnected client or a dead worker shows up */
	if (zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero)) < 0 ||
	    zmq_setsockopt(s, ZMQ_ROUTER_MANDATORY, &one, sizeof(one)) < 0 ||
	    /* HANDOVER: a peer that connects with a routing id in use (a client that sets
	     * ZMQ_ROUTING_ID and reconnects before its old connection is seen to close) takes
	     * it over instead of being refused for good; the frontend then drops the
	     * predecessor's requests (ClientRequest.connection) */
	    zmq_setsockopt(s, ZMQ_ROUTER_HANDOVER, &one, sizeof(one)) < 0 ||
	    zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg)) < 0 ||
	    zmq_setsockopt(s, ZMQ_SNDHWM, &hwm, sizeof(hwm)) < 0 ||
	    zmq_setsockopt(s, ZMQ_RCVHWM, &hwm, sizeof(hwm)) < 0) {
		zmq_close(s);
		return NULL;
	}
	return s;
}

int bd_router_send(void *sock, const uint8_t *ident, size_t ident_len, bool delim,
		   const ProtobufCMessage *m)
{
	int e = bd_wire_send(sock, ident, ident_len, delim, m, ZMQ_DONTWAIT);

	return e == 0 || e == -ENOMEM ? e : -EHOSTUNREACH;
}

void bd_router_frames_close(zmq_msg_t *parts, int n, int max)
{
	for (int i = 0; i < n && i < max; i++)
		zmq_msg_close(&parts[i]);
}

int bd_router_recv(void *sock, zmq_msg_t *parts, int max)
{
	zmq_msg_t extra;
	int n = 0;
	bool more = true;

	/* the first frame without waiting; the others of a message are there already */
	while (more) {
		zmq_msg_t *m = n < max ? &parts[n] : &extra;

		zmq_msg_init(m);
		if (zmq_msg_recv(m, sock, n ? 0 : ZMQ_DONTWAIT) < 0) {
			zmq_msg_close(m);
			bd_router_frames_close(parts, n, max);
			return 0;
		}
		more = zmq_msg_more(m);
		if (m == &extra)
			zmq_msg_close(m);
		n++;
	}
	return n;
}
