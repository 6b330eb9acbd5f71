/* wire.c — one protobuf message out over ZeroMQ (bd_wire.h). */
#include <errno.h>
#include <stdlib.h>
#include <zmq.h>

#include "serve/bd_wire.h"

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
	if ((ident && zmq_send(sock, ident, ident_len, ZMQ_SNDMORE | flags) < 0) ||
	    (ident && delim && zmq_send(sock, "", 0, ZMQ_SNDMORE | flags) < 0) ||
	    zmq_send(sock, buf, n, flags) < 0)
		e = -zmq_errno();
	if (buf != stackbuf)
		free(buf);
	return e;
}
