/* bd_wire.h — one protobuf message as the last frame of a ZeroMQ message: what the client
 * library, the router and the workers send (serve.proto, and the router's kvpool.proto probe).
 */
#ifndef BD_WIRE_H
#define BD_WIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <protobuf-c/protobuf-c.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Packs m and sends it on the ZeroMQ socket sock, after an envelope when ident is not NULL:
 * the frames [ident] (ident_len bytes; 0 makes the empty delimiter a DEALER puts before a
 * REP's request) [""] (when delim) [m packed]. flags (0 or ZMQ_DONTWAIT) apply to every frame.
 * m is packed before any frame goes out, so a failure to get its buffer sends nothing. The
 * caller keeps m. Returns 0, -ENOMEM (no buffer for the packed message), or the -errno of the
 * zmq_send that failed (-EAGAIN: a full queue under ZMQ_DONTWAIT; -EHOSTUNREACH: a gone peer
 * of a ROUTER socket with ZMQ_ROUTER_MANDATORY).
 * A message is never left half-sent: once its first frame is taken (on a ROUTER socket that
 * frame picks the peer, and the socket then counts every frame until one without SNDMORE as
 * that peer's), the later frames are retried on -EINTR and -EAGAIN, and should one still fail
 * the message is closed with an empty last frame (a frame the peer drops), so that the frames
 * of the next message never go to this peer as the tail of this one. */
int bd_wire_send(void *sock, const uint8_t *ident, size_t ident_len, bool delim,
		 const ProtobufCMessage *m, int flags);

/* Closes the ZeroMQ socket *sock when it is open and sets *sock NULL; a NULL *sock is fine.
 * Sockets are closed before their context is terminated (zmq_ctx_term waits for them). */
void bd_wire_close(void **sock);

/* Terminates the ZeroMQ context *ctx when there is one and sets *ctx NULL; a NULL *ctx is
 * fine. */
void bd_wire_ctx_term(void **ctx);

#ifdef __cplusplus
}
#endif
#endif
