/* test_wire.c — one protobuf message over ZeroMQ (lib/serve/wire.c, bd_wire.h): the frames
 * with and without an envelope, a message larger than the stack buffer, and the errors of a
 * send that cannot go out. Suite "wire".
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zmq.h>

#include "serve/bd_wire.h"
#include "serve.pb-c.h"

static void *Z, *Router, *Dealer;

static void init(void)
{
	int one = 1, zero = 0;

	Z = zmq_ctx_new();
	cr_assert_not_null(Z);
	Router = zmq_socket(Z, ZMQ_ROUTER);
	Dealer = zmq_socket(Z, ZMQ_DEALER);
	cr_assert(Router && Dealer);
	cr_assert_eq(zmq_setsockopt(Router, ZMQ_ROUTER_MANDATORY, &one, sizeof(one)), 0);
	cr_assert_eq(zmq_setsockopt(Router, ZMQ_LINGER, &zero, sizeof(zero)), 0);
	cr_assert_eq(zmq_setsockopt(Dealer, ZMQ_LINGER, &zero, sizeof(zero)), 0);
	cr_assert_eq(zmq_setsockopt(Dealer, ZMQ_ROUTING_ID, "rank0", 5), 0);
	cr_assert_eq(zmq_bind(Router, "inproc://wire"), 0);
	cr_assert_eq(zmq_connect(Dealer, "inproc://wire"), 0);
}

static void fini(void)
{
	zmq_close(Dealer);
	zmq_close(Router);
	zmq_ctx_term(Z);
}

TestSuite(wire, .init = init, .fini = fini, .timeout = 30);

/* The frames of the next message on s (blocking) into parts; returns their count. */
static int recv_frames(void *s, zmq_msg_t *parts, int max)
{
	int n = 0, more = 1;

	while (more) {
		cr_assert_lt(n, max, "more than %d frames", max);
		zmq_msg_init(&parts[n]);
		cr_assert_geq(zmq_msg_recv(&parts[n], s, 0), 0, "%s", zmq_strerror(zmq_errno()));
		more = zmq_msg_more(&parts[n]);
		n++;
	}
	return n;
}

static void close_frames(zmq_msg_t *parts, int n)
{
	for (int i = 0; i < n; i++)
		zmq_msg_close(&parts[i]);
}

Test(wire, no_envelope_is_one_frame_that_unpacks_to_the_message)
{
	Bdfp4__ClientRequest req = BDFP4__CLIENT_REQUEST__INIT;
	Bdfp4__CancelRequest cancel = BDFP4__CANCEL_REQUEST__INIT;
	Bdfp4__ClientRequest *got;
	zmq_msg_t parts[4];
	int n;

	cancel.client_tag = 0x1234567890ull;
	req.msg_case = BDFP4__CLIENT_REQUEST__MSG_CANCEL;
	req.cancel = &cancel;
	cr_assert_eq(bd_wire_send(Dealer, NULL, 0, false, &req.base, 0), 0);
	n = recv_frames(Router, parts, 4);
	cr_assert_eq(n, 2, "the router's routing id, then the one frame sent");
	cr_expect_eq(zmq_msg_size(&parts[0]), 5);
	cr_expect_eq(memcmp(zmq_msg_data(&parts[0]), "rank0", 5), 0);
	cr_expect_eq(zmq_msg_size(&parts[1]), bdfp4__client_request__get_packed_size(&req));
	got = bdfp4__client_request__unpack(NULL, zmq_msg_size(&parts[1]), zmq_msg_data(&parts[1]));
	cr_assert_not_null(got);
	cr_expect_eq(got->msg_case, BDFP4__CLIENT_REQUEST__MSG_CANCEL);
	cr_expect_eq(got->cancel->client_tag, 0x1234567890ull);
	bdfp4__client_request__free_unpacked(got, NULL);
	close_frames(parts, n);
}

Test(wire, an_envelope_routes_and_its_delimiter_arrives, .description = "and a large message")
{
	Bdfp4__ClientReply rep = BDFP4__CLIENT_REPLY__INIT;
	Bdfp4__ErrorReply er = BDFP4__ERROR_REPLY__INIT;
	Bdfp4__ClientReply *got;
	zmq_msg_t parts[4];
	size_t big = 5000; /* over the 1024-byte stack buffer */
	char *text = malloc(big + 1);
	int n;

	cr_assert_not_null(text);
	for (size_t i = 0; i < big; i++)
		text[i] = (char)('a' + i % 26);
	text[big] = 0;
	/* the router learns the dealer's routing id from a first message */
	cr_assert_eq(zmq_send(Dealer, "hi", 2, 0), 2);
	n = recv_frames(Router, parts, 4);
	close_frames(parts, n);

	er.client_tag = 7;
	er.message = text;
	rep.msg_case = BDFP4__CLIENT_REPLY__MSG_ERROR;
	rep.error = &er;
	cr_assert_eq(bd_wire_send(Router, (const uint8_t *)"rank0", 5, true, &rep.base, 0), 0);
	n = recv_frames(Dealer, parts, 4);
	cr_assert_eq(n, 2, "the empty delimiter, then the message (the routing id is consumed)");
	cr_expect_eq(zmq_msg_size(&parts[0]), 0);
	got = bdfp4__client_reply__unpack(NULL, zmq_msg_size(&parts[1]), zmq_msg_data(&parts[1]));
	cr_assert_not_null(got);
	cr_expect_eq(got->msg_case, BDFP4__CLIENT_REPLY__MSG_ERROR);
	cr_expect_eq(got->error->client_tag, 7);
	cr_expect_str_eq(got->error->message, text);
	bdfp4__client_reply__free_unpacked(got, NULL);
	close_frames(parts, n);

	/* without the delimiter: the message alone */
	cr_assert_eq(bd_wire_send(Router, (const uint8_t *)"rank0", 5, false, &rep.base, 0), 0);
	n = recv_frames(Dealer, parts, 4);
	cr_expect_eq(n, 1);
	cr_expect_eq(zmq_msg_size(&parts[0]), bdfp4__client_reply__get_packed_size(&rep));
	close_frames(parts, n);
	free(text);
}

Test(wire, a_send_that_cannot_go_out_returns_the_zmq_errno)
{
	Bdfp4__ClientReply rep = BDFP4__CLIENT_REPLY__INIT;
	Bdfp4__Keepalive ka = BDFP4__KEEPALIVE__INIT;
	void *lone = zmq_socket(Z, ZMQ_DEALER);
	int zero = 0;

	rep.msg_case = BDFP4__CLIENT_REPLY__MSG_KEEPALIVE;
	rep.keepalive = &ka;
	/* a ROUTER with ROUTER_MANDATORY and a peer it does not know */
	cr_expect_eq(bd_wire_send(Router, (const uint8_t *)"nobody", 6, false, &rep.base,
				  ZMQ_DONTWAIT),
		     -EHOSTUNREACH);
	/* a DEALER connected to nothing has no pipe: the send would block */
	cr_assert_not_null(lone);
	cr_assert_eq(zmq_setsockopt(lone, ZMQ_LINGER, &zero, sizeof(zero)), 0);
	cr_expect_eq(bd_wire_send(lone, NULL, 0, false, &rep.base, ZMQ_DONTWAIT), -EAGAIN);
	zmq_close(lone);
}
