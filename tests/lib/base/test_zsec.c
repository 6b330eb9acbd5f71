/* test_zsec.c — base/bd_zsec.h: key files and their modes, allow-lists, the plain-TCP rule,
 * and the ZAP handler with real ZeroMQ sockets (a CURVE ROUTER on loopback, DEALER clients
 * with an allowed key, another key and none). */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <zmq.h>

#include "base/bd_zsec.h"
#include "tmpdir.h"

static char dir[256];

static void setup(void)
{
	cr_assert_eq(td_make(dir, sizeof(dir), "bd-zsec"), 0);
}

static void teardown(void)
{
	td_remove(dir);
}

TestSuite(zsec, .init = setup, .fini = teardown);

static const char *at(const char *name)
{
	static char buf[4][320];
	static int k;

	k = (k + 1) % 4;
	snprintf(buf[k], sizeof(buf[k]), "%s/%s", dir, name);
	return buf[k];
}

static void put(const char *name, const char *text, mode_t mode)
{
	int fd = open(at(name), O_WRONLY | O_CREAT | O_TRUNC, mode);

	cr_assert_geq(fd, 0);
	cr_assert_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
	fchmod(fd, mode);
	close(fd);
}

Test(zsec, keygen_writes_a_private_secret_and_a_matching_public_key)
{
	struct bd_zsec_keypair kp, back;
	char pub[BD_ZSEC_Z85 + 1], err[512];
	struct stat st;
	mode_t old = umask(0);

	cr_assert(bd_zsec_available(), "this libzmq has no CURVE");
	cr_assert_eq(bd_zsec_keygen(at("k"), &kp, err, sizeof(err)), 0, "%s", err);
	umask(old);
	cr_assert_eq(stat(at("k.key"), &st), 0);
	cr_expect_eq(st.st_mode & 07777, 0600, "secret key mode %o under umask 0",
		     st.st_mode & 07777);
	cr_assert_eq(bd_zsec_load_secret(at("k.key"), &back, err, sizeof(err)), 0, "%s", err);
	cr_expect_str_eq(back.sec, kp.sec);
	cr_expect_str_eq(back.pub, kp.pub, "the derived public key differs");
	cr_assert_eq(bd_zsec_load_public(at("k.pub"), pub, err, sizeof(err)), 0, "%s", err);
	cr_expect_str_eq(pub, kp.pub);
	/* never over an existing secret */
	cr_expect_eq(bd_zsec_keygen(at("k"), NULL, err, sizeof(err)), -EEXIST);
	cr_assert_eq(bd_zsec_load_secret(at("k.key"), &back, err, sizeof(err)), 0);
	cr_expect_str_eq(back.sec, kp.sec, "the first secret was replaced");
}

Test(zsec, bad_key_files_are_refused_with_the_reason)
{
	struct bd_zsec_keypair kp;
	char err[512], pub[BD_ZSEC_Z85 + 1];

	cr_assert_eq(bd_zsec_keygen(at("k"), &kp, err, sizeof(err)), 0, "%s", err);
	chmod(at("k.key"), 0640);
	cr_expect_eq(bd_zsec_load_secret(at("k.key"), &kp, err, sizeof(err)), -EPERM);
	cr_expect(strstr(err, "chmod 600"), "%s", err);
	put("short.key", "abc\n", 0600);
	cr_expect_eq(bd_zsec_load_secret(at("short.key"), &kp, err, sizeof(err)), -EBADMSG);
	/* 40 characters, but '"' is outside Z85 */
	put("bad.pub", "\"123456789012345678901234567890123456789\n", 0644);
	cr_expect_eq(bd_zsec_load_public(at("bad.pub"), pub, err, sizeof(err)), -EBADMSG);
	cr_expect_eq(bd_zsec_load_public(at("none.pub"), pub, err, sizeof(err)), -ENOENT);
	cr_expect(strstr(err, "none.pub"), "%s", err);
}

Test(zsec, allow_list_lines)
{
	struct bd_zsec_keypair a, b, c;
	struct bd_zsec_allow *al;
	unsigned char raw[32];
	char text[512], err[512];

	cr_assert_eq(bd_zsec_keygen(at("a"), &a, err, sizeof(err)), 0);
	cr_assert_eq(bd_zsec_keygen(at("b"), &b, err, sizeof(err)), 0);
	cr_assert_eq(bd_zsec_keygen(at("c"), &c, err, sizeof(err)), 0);
	snprintf(text, sizeof(text), "# clients\n\n  %s alice\n%s\n", a.pub, b.pub);
	put("list", text, 0644);
	cr_assert_eq(bd_zsec_allow_load(at("list"), &al, err, sizeof(err)), 0, "%s", err);
	zmq_z85_decode(raw, a.pub);
	cr_expect_str_eq(bd_zsec_allow_find(al, raw), "alice");
	zmq_z85_decode(raw, b.pub);
	cr_expect_str_eq(bd_zsec_allow_find(al, raw), b.pub, "an unnamed key is its own name");
	zmq_z85_decode(raw, c.pub);
	cr_expect_null(bd_zsec_allow_find(al, raw));
	bd_zsec_allow_free(al);

	snprintf(text, sizeof(text), "%s\nnot-a-key\n", a.pub);
	put("bad", text, 0644);
	cr_expect_eq(bd_zsec_allow_load(at("bad"), &al, err, sizeof(err)), -EBADMSG);
	cr_expect(strstr(err, "line 2"), "%s", err);
}

Test(zsec, plain_tcp_rule)
{
	static const struct { const char *ep; bool loop; } cases[] = {
		{ "tcp://127.0.0.1:5555", true },  { "tcp://127.1.2.3:1", true },
		{ "tcp://[::1]:5555", true },      { "tcp://localhost:5555", true },
		{ "tcp://lo:5555", true },         { "tcp://eth0;127.0.0.1:9", true },
		{ "tcp://0.0.0.0:5555", false },   { "tcp://*:5555", false },
		{ "tcp://10.0.0.1:5555", false },  { "tcp://127.0.0.1.evil:1", false },
		{ "tcp://128.0.0.1:5555", false }, { "tcp://[::]:5555", false },
		{ "tcp://127.0.0.1", false },      { "ipc:///run/x.sock", false },
	};
	char err[512];

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
		cr_expect_eq(bd_zsec_tcp_loopback(cases[i].ep), cases[i].loop, "%s", cases[i].ep);
	cr_expect_eq(bd_zsec_endpoint_check("ipc:///run/x.sock", "f", false, false, err, 512), 0);
	cr_expect_eq(bd_zsec_endpoint_check("inproc://x", "f", false, false, err, 512), 0);
	cr_expect_eq(bd_zsec_endpoint_check("tcp://127.0.0.1:1", "f", false, false, err, 512), 0);
	cr_expect_eq(bd_zsec_endpoint_check("tcp://0.0.0.0:1", "f", true, false, err, 512), 0);
	cr_expect_eq(bd_zsec_endpoint_check("tcp://0.0.0.0:1", "f", false, true, err, 512), 0);
	cr_expect_eq(bd_zsec_endpoint_check("tcp://0.0.0.0:1", "frontend", false, false, err, 512),
		     -EPERM);
	cr_expect(strstr(err, "frontend tcp://0.0.0.0:1") && strstr(err, "insecure_tcp"), "%s",
		  err);
}

struct refusals {
	int n;
	char domain[32], key[64];
};

static void on_refuse(void *ctx, const char *domain, const char *address, const char *key)
{
	struct refusals *r = ctx;

	(void)address;
	r->n++;
	snprintf(r->domain, sizeof(r->domain), "%s", domain);
	snprintf(r->key, sizeof(r->key), "%s", key);
}

/* One request from a DEALER (CURVE with kp when kp is set) to the echoing server: 0 when the
 * echo came back, else the -errno of the first handshake failure its monitor saw, -ETIMEDOUT
 * when neither came in 3 s. */
static int try_client(void *zctx, const char *ep, const char *srv_pub,
		      const struct bd_zsec_keypair *kp, void *server)
{
	void *s = zmq_socket(zctx, ZMQ_DEALER), *mon = zmq_socket(zctx, ZMQ_PAIR);
	char mep[64], err[512];
	int zero = 0, r = -ETIMEDOUT;
	static int k;

	snprintf(mep, sizeof(mep), "inproc://test-zsec-mon-%d", k++);
	zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero));
	zmq_setsockopt(mon, ZMQ_LINGER, &zero, sizeof(zero));
	if (kp)
		cr_assert_eq(bd_zsec_client(s, srv_pub, kp), 0);
	cr_assert_eq(zmq_socket_monitor(s, mep, ZMQ_EVENT_HANDSHAKE_FAILED_AUTH |
						    ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
						    ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL), 0);
	cr_assert_eq(zmq_connect(mon, mep), 0);
	cr_assert_eq(zmq_connect(s, ep), 0);
	zmq_send(s, "ping", 4, 0);
	for (int t = 0; t < 300 && r == -ETIMEDOUT; t++) {
		zmq_pollitem_t it[3] = { { .socket = s, .events = ZMQ_POLLIN },
					 { .socket = mon, .events = ZMQ_POLLIN },
					 { .socket = server, .events = ZMQ_POLLIN } };
		char buf[64];

		zmq_poll(it, 3, 10);
		if (it[2].revents & ZMQ_POLLIN) { /* the server echoes [id][ping] */
			zmq_msg_t id, body;

			zmq_msg_init(&id);
			zmq_msg_init(&body);
			zmq_msg_recv(&id, server, 0);
			zmq_msg_recv(&body, server, 0);
			zmq_msg_send(&id, server, ZMQ_SNDMORE);
			zmq_msg_send(&body, server, 0);
			zmq_msg_close(&id);
			zmq_msg_close(&body);
		}
		if ((it[0].revents & ZMQ_POLLIN) && zmq_recv(s, buf, sizeof(buf), 0) == 4)
			r = 0;
		if (it[1].revents & ZMQ_POLLIN) {
			zmq_msg_t ev;
			uint16_t event;
			uint32_t value;

			zmq_msg_init(&ev);
			zmq_msg_recv(&ev, mon, 0);
			memcpy(&event, zmq_msg_data(&ev), 2);
			memcpy(&value, (char *)zmq_msg_data(&ev) + 2, 4);
			zmq_msg_close(&ev);
			zmq_msg_init(&ev);
			zmq_msg_recv(&ev, mon, 0); /* the endpoint */
			zmq_msg_close(&ev);
			r = bd_zsec_handshake_error(event, (int)value, ep, err, sizeof(err));
		}
	}
	zmq_socket_monitor(s, NULL, 0);
	zmq_close(mon);
	zmq_close(s);
	return r;
}

Test(zsec, zap_admits_the_allow_list_only)
{
	struct bd_zsec_keypair srv, ok, bad;
	struct bd_zsec_allow *al;
	struct bd_zsec_zap *zap;
	struct refusals rf = { 0 };
	unsigned long adm, ref;
	char text[128], err[512], ep[64];
	size_t eplen = sizeof(ep);
	void *zctx = zmq_ctx_new(), *server = zmq_socket(zctx, ZMQ_ROUTER);
	int zero = 0;

	cr_assert_eq(bd_zsec_keygen(at("srv"), &srv, err, sizeof(err)), 0);
	cr_assert_eq(bd_zsec_keygen(at("ok"), &ok, err, sizeof(err)), 0);
	cr_assert_eq(bd_zsec_keygen(at("bad"), &bad, err, sizeof(err)), 0);
	snprintf(text, sizeof(text), "%s ok-client\n", ok.pub);
	put("list", text, 0644);
	cr_assert_eq(bd_zsec_allow_load(at("list"), &al, err, sizeof(err)), 0);
	cr_assert_eq(bd_zsec_zap_start(zctx, on_refuse, &rf, &zap, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(bd_zsec_zap_add(zap, "clients", al), 0);
	zmq_setsockopt(server, ZMQ_LINGER, &zero, sizeof(zero));
	cr_assert_eq(bd_zsec_server(server, &srv, "clients"), 0);
	cr_assert_eq(zmq_bind(server, "tcp://127.0.0.1:*"), 0);
	zmq_getsockopt(server, ZMQ_LAST_ENDPOINT, ep, &eplen);

	cr_expect_eq(try_client(zctx, ep, srv.pub, &ok, server), 0, "the allowed key");
	cr_expect_eq(try_client(zctx, ep, srv.pub, &bad, server), -EACCES, "another key");
	cr_expect_eq(rf.n, 1);
	cr_expect_str_eq(rf.domain, "clients");
	cr_expect_str_eq(rf.key, bad.pub, "the refused key is reported");
	cr_expect_eq(try_client(zctx, ep, NULL, NULL, server), -EPROTO, "a plain client");
	/* the right keys but the wrong server key: the handshake cannot complete */
	cr_expect_neq(try_client(zctx, ep, ok.pub, &ok, server), 0, "a wrong server key");
	bd_zsec_zap_counts(zap, &adm, &ref);
	cr_expect_eq(adm, 1);
	cr_expect_eq(ref, 1);
	zmq_close(server);
	bd_zsec_zap_stop(zap);
	zmq_ctx_term(zctx);
}
