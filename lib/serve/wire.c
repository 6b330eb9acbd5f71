/* wire.c — one protobuf message out over ZeroMQ (bd_wire.h). */
#include <errno.h>
#include <stdlib.h>
#include <zmq.h>

#include "serve/bd_wire.h"

/* A frame after the first of a message (see bd_wire.h): retried while interrupted or would
 * block, a bounded number of times. 0 or the last -errno. */
static int send_rest(void *sock, const void *p, size_t n, int flags)
{
	int e = 0;

	for (int tries = 0; tries < 1000; tries++) {
		if (zmq_send(sock, p, n, flags) >= 0)
			return 0;
		e = zmq_errno();
		if (e != EINTR && e != EAGAIN)
			break;
	}
	return -e;
}

int bd_wire_send(void *sock, const uint8_t *ident, size_t ident_len, bool delim,
		 const ProtobufCMessage *m, int flags)
{
	size_t n = protobuf_c_message_get_packed_size(m);
	/* most messages are small: those need no allocation */
	uint8_t stackbuf[1024], *buf = n <= sizeof(stackbuf) ? stackbuf : malloc(n);
	int e = 0;

	if (!buf)
		return -ENOMEM;
	protobuf_c_message_pack(m, buf);
	if (!ident) {
		if (zmq_send(sock, buf, n, flags) < 0)
			e = -zmq_errno();
	} else if (zmq_send(sock, ident, ident_len, ZMQ_SNDMORE | flags) < 0) {
		e = -zmq_errno(); /* nothing was taken */
	} else if ((delim && (e = send_rest(sock, "", 0, ZMQ_SNDMORE | flags)) < 0) ||
		   (e = send_rest(sock, buf, n, flags)) < 0) {
		/* the socket is inside this message: end it */
		send_rest(sock, "", 0, flags);
	}
	if (buf != stackbuf)
		free(buf);
	return e;
}

void bd_wire_close(void **sock)
{
	if (*sock)
		zmq_close(*sock);
	*sock = NULL;
}

void bd_wire_ctx_term(void **ctx)
{
	if (*ctx)
		zmq_ctx_term(*ctx);
	*ctx = NULL;
}
