/* zsec.c — CURVE keys, allow-lists, the ZAP handler and the plain-TCP rule (bd_zsec.h). */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <zmq.h>

#include "base/bd_err.h"
#include "base/bd_zsec.h"

#define ZAP_ENDPOINT "inproc://zeromq.zap.01"
#define MAX_KEYS 4096
#define MAX_DOMAINS 8
#define NAME_MAX_LEN 64

bool bd_zsec_available(void)
{
	return zmq_has("curve") != 0;
}

/* ---- key files ----------------------------------------------------------------------------- */

/* Whether s[0..40) is Z85 text that decodes (zmq_z85_decode checks the alphabet). */
static bool z85_key(const char *s, unsigned char out[32])
{
	char tmp[BD_ZSEC_Z85 + 1];

	memcpy(tmp, s, BD_ZSEC_Z85);
	tmp[BD_ZSEC_Z85] = 0;
	return zmq_z85_decode(out, tmp) != NULL;
}

/* The first line of a small file (at most cap - 1 bytes) into buf, without its newline. */
static int read_line_file(const char *path, const char *what, char *buf, size_t cap,
			  struct stat *st, char *err, size_t ecap)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
	ssize_t n;

	if (fd < 0)
		return bd_errf(err, ecap, -errno, "%s %s: %s", what, path, strerror(errno));
	if (fstat(fd, st) < 0 || !S_ISREG(st->st_mode)) {
		close(fd);
		return bd_errf(err, ecap, -EBADMSG, "%s %s: not a regular file", what, path);
	}
	n = read(fd, buf, cap - 1);
	close(fd);
	if (n < 0)
		return bd_errf(err, ecap, -errno, "%s %s: %s", what, path, strerror(errno));
	buf[n] = 0;
	buf[strcspn(buf, "\r\n")] = 0;
	return 0;
}

/* The key of a key file into key[BD_ZSEC_Z85 + 1]: one line of 40 Z85 characters; a secret
 * key's file (secret) must be its owner's alone, as ssh wants of a private key. */
static int read_key_file(const char *path, bool secret, char *key, char *err, size_t cap)
{
	const char *what = secret ? "secret key file" : "public key file";
	char line[128];
	unsigned char raw[32];
	struct stat st;
	int e;

	if (!path || !*path || !key)
		return bd_errf(err, cap, -EINVAL, "no %s", what);
	if ((e = read_line_file(path, what, line, sizeof(line), &st, err, cap)) < 0)
		return e;
	if (secret && (st.st_mode & 077))
		return bd_errf(err, cap, -EPERM, "secret key file %s: mode %04o lets others read it "
			    "(chmod 600)", path, (unsigned)(st.st_mode & 07777));
	if (strlen(line) != BD_ZSEC_Z85 || !z85_key(line, raw))
		return bd_errf(err, cap, -EBADMSG, "%s %s: not a 40-character Z85 key%s", what, path,
			       secret ? " (bdfp4 keygen makes one)" : "");
	memcpy(key, line, BD_ZSEC_Z85 + 1);
	return 0;
}

int bd_zsec_load_secret(const char *path, struct bd_zsec_keypair *ret, char *err, size_t cap)
{
	int e = read_key_file(path, true, ret ? ret->sec : NULL, err, cap);

	if (e < 0)
		return e;
	if (zmq_curve_public(ret->pub, ret->sec) < 0)
		return bd_errf(err, cap, -ENOTSUP, "secret key file %s: %s", path,
			    zmq_strerror(zmq_errno()));
	return 0;
}

int bd_zsec_load_public(const char *path, char *ret, char *err, size_t cap)
{
	return read_key_file(path, false, ret, err, cap);
}

static int write_file(const char *path, const char *text, int flags, mode_t mode, char *err,
		      size_t cap)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW | flags, mode);
	size_t n = strlen(text);

	if (fd < 0)
		return bd_errf(err, cap, -errno, "%s: %s", path, strerror(errno));
	/* the mode whatever the umask, and an existing public file's old mode replaced */
	if (fchmod(fd, mode) < 0 || write(fd, text, n) != (ssize_t)n || fsync(fd) < 0) {
		int e = errno ? errno : EIO;

		close(fd);
		unlink(path);
		return bd_errf(err, cap, -e, "%s: %s", path, strerror(e));
	}
	close(fd);
	return 0;
}

int bd_zsec_keygen(const char *prefix, struct bd_zsec_keypair *ret, char *err, size_t cap)
{
	struct bd_zsec_keypair kp;
	char path[4096], line[BD_ZSEC_Z85 + 2];
	int e;

	if (!prefix || !*prefix)
		return bd_errf(err, cap, -EINVAL, "no file prefix");
	if (!bd_zsec_available())
		return bd_errf(err, cap, -ENOTSUP, "this libzmq has no CURVE (built without libsodium)");
	if (zmq_curve_keypair(kp.pub, kp.sec) < 0)
		return bd_errf(err, cap, -EIO, "zmq_curve_keypair: %s", zmq_strerror(zmq_errno()));
	if (snprintf(path, sizeof(path), "%s.key", prefix) >= (int)sizeof(path))
		return bd_errf(err, cap, -ENAMETOOLONG, "prefix too long");
	snprintf(line, sizeof(line), "%s\n", kp.sec);
	if ((e = write_file(path, line, O_EXCL, 0600, err, cap)) < 0)
		return e;
	snprintf(path, sizeof(path), "%s.pub", prefix);
	snprintf(line, sizeof(line), "%s\n", kp.pub);
	if ((e = write_file(path, line, O_TRUNC, 0644, err, cap)) < 0) {
		snprintf(path, sizeof(path), "%s.key", prefix);
		unlink(path);
		return e;
	}
	if (ret)
		*ret = kp;
	return 0;
}

/* ---- allow-lists --------------------------------------------------------------------------- */

struct allow_ent {
	unsigned char key[32];
	char name[NAME_MAX_LEN + 1];
};

struct bd_zsec_allow {
	struct allow_ent *e;
	size_t n;
};

int bd_zsec_allow_load(const char *path, struct bd_zsec_allow **ret, char *err, size_t cap)
{
	struct bd_zsec_allow *a;
	char line[512];
	FILE *f;
	int lineno = 0;

	if (!path || !*path || !ret)
		return bd_errf(err, cap, -EINVAL, "no allow-list file");
	f = fopen(path, "re");
	if (!f)
		return bd_errf(err, cap, -errno, "allow-list %s: %s", path, strerror(errno));
	a = calloc(1, sizeof(*a));
	if (!a || !(a->e = calloc(MAX_KEYS, sizeof(*a->e)))) {
		free(a);
		fclose(f);
		return bd_errf(err, cap, -ENOMEM, "out of memory");
	}
	while (fgets(line, sizeof(line), f)) {
		char *s = line, *name;
		struct allow_ent *ent;

		lineno++;
		s += strspn(s, " \t");
		s[strcspn(s, "\r\n")] = 0;
		if (!*s || *s == '#')
			continue;
		if (a->n == MAX_KEYS) {
			fclose(f);
			bd_zsec_allow_free(a);
			return bd_errf(err, cap, -EBADMSG, "allow-list %s: more than %d keys", path,
				    MAX_KEYS);
		}
		ent = &a->e[a->n];
		name = s + strcspn(s, " \t");
		if (name - s != BD_ZSEC_Z85 || !z85_key(s, ent->key)) {
			fclose(f);
			bd_zsec_allow_free(a);
			return bd_errf(err, cap, -EBADMSG, "allow-list %s line %d: not a 40-character "
				    "Z85 public key", path, lineno);
		}
		name += strspn(name, " \t");
		snprintf(ent->name, sizeof(ent->name), "%.*s", *name ? NAME_MAX_LEN : BD_ZSEC_Z85,
			 *name ? name : s);
		a->n++;
	}
	fclose(f);
	*ret = a;
	return 0;
}

void bd_zsec_allow_free(struct bd_zsec_allow *a)
{
	if (!a)
		return;
	free(a->e);
	free(a);
}

const char *bd_zsec_allow_find(const struct bd_zsec_allow *a, const unsigned char key[32])
{
	for (size_t i = 0; a && i < a->n; i++)
		if (!memcmp(a->e[i].key, key, 32))
			return a->e[i].name;
	return NULL;
}

/* ---- socket options ------------------------------------------------------------------------ */

int bd_zsec_server(void *sock, const struct bd_zsec_keypair *kp, const char *domain)
{
	int one = 1;

	if (!sock || !kp || !domain)
		return -EINVAL;
	if (!bd_zsec_available())
		return -ENOTSUP;
	if (zmq_setsockopt(sock, ZMQ_CURVE_SERVER, &one, sizeof(one)) < 0 ||
	    zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, kp->sec, BD_ZSEC_Z85 + 1) < 0 ||
	    zmq_setsockopt(sock, ZMQ_ZAP_DOMAIN, domain, strlen(domain)) < 0)
		return -EIO;
	return 0;
}

int bd_zsec_client(void *sock, const char *server_pub, const struct bd_zsec_keypair *kp)
{
	if (!sock || !server_pub || !kp)
		return -EINVAL;
	if (!bd_zsec_available())
		return -ENOTSUP;
	if (zmq_setsockopt(sock, ZMQ_CURVE_SERVERKEY, server_pub, BD_ZSEC_Z85 + 1) < 0 ||
	    zmq_setsockopt(sock, ZMQ_CURVE_PUBLICKEY, kp->pub, BD_ZSEC_Z85 + 1) < 0 ||
	    zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, kp->sec, BD_ZSEC_Z85 + 1) < 0)
		return -EIO;
	return 0;
}

int bd_zsec_client_files(void *sock, const char *server_key_file, const char *secret_key_file,
			 char *err, size_t cap)
{
	bool have_srv = server_key_file && *server_key_file;
	bool have_sec = secret_key_file && *secret_key_file;
	struct bd_zsec_keypair kp;
	char srv[BD_ZSEC_Z85 + 1];
	int e;

	if (!have_srv && !have_sec)
		return 0;
	if (!have_srv || !have_sec)
		return bd_errf(err, cap, -EINVAL, "a CURVE client needs both the server's public key "
			    "file and its own secret key file (%s is missing)",
			    have_srv ? "the secret key" : "the server key");
	if ((e = bd_zsec_load_public(server_key_file, srv, err, cap)) < 0 ||
	    (e = bd_zsec_load_secret(secret_key_file, &kp, err, cap)) < 0)
		return e;
	e = bd_zsec_client(sock, srv, &kp);
	memset(&kp, 0, sizeof(kp));
	if (e < 0)
		return bd_errf(err, cap, e, "CURVE client options: %s",
			    e == -ENOTSUP ? "this libzmq has no CURVE" : zmq_strerror(zmq_errno()));
	return 0;
}

/* ---- the ZAP handler (ZeroMQ RFC 27) -------------------------------------------------------- */

struct bd_zsec_zap {
	void *zctx, *rep, *ctl_main;
	char ctl_ep[64];
	pthread_t thread;
	bool started;
	bd_zsec_refuse_fn on_refuse;
	void *cb_ctx;
	struct {
		char name[32];
		struct bd_zsec_allow *allow;
	} dom[MAX_DOMAINS];
	int n_dom;
	pthread_mutex_t lock;
	unsigned long admitted, refused;
};

/* One request's frames: version, request id, domain, address, identity, mechanism, then the
 * mechanism's credentials (CURVE: the client's 32-byte public key). */
#define ZAP_FRAMES 8

static void zap_answer(struct bd_zsec_zap *z, zmq_msg_t *f, int n)
{
	const char *code = "400", *text = "no such key", *user = "";
	char domain[32] = "", address[64] = "", key_z85[BD_ZSEC_Z85 + 1] = "";
	bool curve = false;

	if (n >= 6) {
		size_t dl = zmq_msg_size(&f[2]), al = zmq_msg_size(&f[3]);

		snprintf(domain, sizeof(domain), "%.*s", (int)(dl < 31 ? dl : 31),
			 (const char *)zmq_msg_data(&f[2]));
		snprintf(address, sizeof(address), "%.*s", (int)(al < 63 ? al : 63),
			 (const char *)zmq_msg_data(&f[3]));
		curve = zmq_msg_size(&f[5]) == 5 && !memcmp(zmq_msg_data(&f[5]), "CURVE", 5);
	}
	if (n < 6 || zmq_msg_size(&f[0]) != 3 || memcmp(zmq_msg_data(&f[0]), "1.0", 3)) {
		code = "500";
		text = "malformed ZAP request";
	} else if (!curve) {
		text = "CURVE only";
	} else if (n >= 7 && zmq_msg_size(&f[6]) == 32) {
		const unsigned char *key = zmq_msg_data(&f[6]);

		zmq_z85_encode(key_z85, key, 32);
		pthread_mutex_lock(&z->lock);
		for (int i = 0; i < z->n_dom; i++)
			if (!strcmp(z->dom[i].name, domain)) {
				const char *name = bd_zsec_allow_find(z->dom[i].allow, key);

				if (name) {
					code = "200";
					text = "OK";
					user = name;
				}
				break;
			}
		pthread_mutex_unlock(&z->lock);
	}
	if (!strcmp(code, "200")) {
		__atomic_add_fetch(&z->admitted, 1, __ATOMIC_RELAXED);
	} else {
		__atomic_add_fetch(&z->refused, 1, __ATOMIC_RELAXED);
		if (z->on_refuse)
			z->on_refuse(z->cb_ctx, domain, address, *key_z85 ? key_z85 : "(no CURVE key)");
	}
	/* version, request id (echoed), status code, status text, user id, metadata */
	zmq_send(z->rep, "1.0", 3, ZMQ_SNDMORE);
	if (n >= 2)
		zmq_send(z->rep, zmq_msg_data(&f[1]), zmq_msg_size(&f[1]), ZMQ_SNDMORE);
	else
		zmq_send(z->rep, "", 0, ZMQ_SNDMORE);
	zmq_send(z->rep, code, 3, ZMQ_SNDMORE);
	zmq_send(z->rep, text, strlen(text), ZMQ_SNDMORE);
	zmq_send(z->rep, user, strlen(user), ZMQ_SNDMORE);
	zmq_send(z->rep, "", 0, 0);
}

static void *zap_thread(void *arg)
{
	struct bd_zsec_zap *z = arg;
	void *ctl = zmq_socket(z->zctx, ZMQ_PAIR);

	if (!ctl || zmq_connect(ctl, z->ctl_ep) < 0) {
		if (ctl)
			zmq_close(ctl);
		return NULL;
	}
	for (;;) {
		zmq_pollitem_t it[2] = { { .socket = z->rep, .events = ZMQ_POLLIN },
					 { .socket = ctl, .events = ZMQ_POLLIN } };
		zmq_msg_t f[ZAP_FRAMES], extra;
		int n = 0, more = 1;

		if (zmq_poll(it, 2, -1) < 0) {
			if (zmq_errno() == EINTR)
				continue;
			break;
		}
		if (it[1].revents & ZMQ_POLLIN)
			break;
		if (!(it[0].revents & ZMQ_POLLIN))
			continue;
		while (more) {
			zmq_msg_t *m = n < ZAP_FRAMES ? &f[n] : &extra;

			zmq_msg_init(m);
			if (zmq_msg_recv(m, z->rep, n ? 0 : ZMQ_DONTWAIT) < 0) {
				zmq_msg_close(m);
				break;
			}
			more = zmq_msg_more(m);
			if (m == &extra)
				zmq_msg_close(m);
			n++;
		}
		if (n)
			zap_answer(z, f, n < ZAP_FRAMES ? n : ZAP_FRAMES);
		for (int i = 0; i < n && i < ZAP_FRAMES; i++)
			zmq_msg_close(&f[i]);
	}
	zmq_close(ctl);
	return NULL;
}

int bd_zsec_zap_start(void *zctx, bd_zsec_refuse_fn on_refuse, void *ctx,
		      struct bd_zsec_zap **ret, char *err, size_t cap)
{
	struct bd_zsec_zap *z;
	int zero = 0;

	if (!zctx || !ret)
		return bd_errf(err, cap, -EINVAL, "no ZeroMQ context");
	z = calloc(1, sizeof(*z));
	if (!z)
		return bd_errf(err, cap, -ENOMEM, "out of memory");
	pthread_mutex_init(&z->lock, NULL);
	z->zctx = zctx;
	z->on_refuse = on_refuse;
	z->cb_ctx = ctx;
	snprintf(z->ctl_ep, sizeof(z->ctl_ep), "inproc://bd-zsec-ctl-%p", (void *)z);
	z->rep = zmq_socket(zctx, ZMQ_REP);
	z->ctl_main = zmq_socket(zctx, ZMQ_PAIR);
	if (!z->rep || !z->ctl_main || zmq_setsockopt(z->rep, ZMQ_LINGER, &zero, sizeof(zero)) < 0 ||
	    zmq_setsockopt(z->ctl_main, ZMQ_LINGER, &zero, sizeof(zero)) < 0 ||
	    zmq_bind(z->ctl_main, z->ctl_ep) < 0 || zmq_bind(z->rep, ZAP_ENDPOINT) < 0) {
		int e = zmq_errno();

		bd_zsec_zap_stop(z);
		return bd_errf(err, cap, -EIO, "ZAP handler at %s: %s", ZAP_ENDPOINT, zmq_strerror(e));
	}
	if (pthread_create(&z->thread, NULL, zap_thread, z) != 0) {
		bd_zsec_zap_stop(z);
		return bd_errf(err, cap, -EAGAIN, "ZAP handler thread: cannot start");
	}
	z->started = true;
	*ret = z;
	return 0;
}

int bd_zsec_zap_add(struct bd_zsec_zap *z, const char *domain, struct bd_zsec_allow *a)
{
	if (!z || !domain || !a || strlen(domain) >= sizeof(z->dom[0].name))
		return -EINVAL;
	pthread_mutex_lock(&z->lock);
	if (z->n_dom == MAX_DOMAINS) {
		pthread_mutex_unlock(&z->lock);
		return -ENOSPC;
	}
	snprintf(z->dom[z->n_dom].name, sizeof(z->dom[0].name), "%s", domain);
	z->dom[z->n_dom++].allow = a;
	pthread_mutex_unlock(&z->lock);
	return 0;
}

void bd_zsec_zap_counts(const struct bd_zsec_zap *z, unsigned long *ret_admitted,
			unsigned long *ret_refused)
{
	if (ret_admitted)
		*ret_admitted = z ? __atomic_load_n(&z->admitted, __ATOMIC_RELAXED) : 0;
	if (ret_refused)
		*ret_refused = z ? __atomic_load_n(&z->refused, __ATOMIC_RELAXED) : 0;
}

void bd_zsec_zap_stop(struct bd_zsec_zap *z)
{
	if (!z)
		return;
	if (z->started) {
		zmq_send(z->ctl_main, "", 0, 0);
		pthread_join(z->thread, NULL);
	}
	if (z->rep)
		zmq_close(z->rep);
	if (z->ctl_main)
		zmq_close(z->ctl_main);
	for (int i = 0; i < z->n_dom; i++)
		bd_zsec_allow_free(z->dom[i].allow);
	pthread_mutex_destroy(&z->lock);
	free(z);
}

/* ---- the plain-TCP rule -------------------------------------------------------------------- */

bool bd_zsec_tcp_loopback(const char *ep)
{
	const char *host, *semi, *end;
	char h[256];
	size_t n;

	if (!ep || strncmp(ep, "tcp://", 6))
		return false;
	host = ep + 6;
	semi = strchr(host, ';');
	if (semi)
		host = semi + 1;
	end = strrchr(host, ':');
	if (!end)
		return false;
	n = (size_t)(end - host);
	if (n >= sizeof(h))
		return false;
	memcpy(h, host, n);
	h[n] = 0;
	if (!strcmp(h, "[::1]") || !strcmp(h, "::1") || !strcmp(h, "localhost") || !strcmp(h, "lo"))
		return true;
	/* 127.0.0.0/8, written as a dotted quad */
	{
		unsigned a, b, c, d;
		char tail;

		if (sscanf(h, "%u.%u.%u.%u%c", &a, &b, &c, &d, &tail) == 4 && a == 127 && b < 256 &&
		    c < 256 && d < 256)
			return true;
	}
	return false;
}

int bd_zsec_endpoint_check(const char *ep, const char *what, bool curve, bool insecure_tcp,
			   char *err, size_t cap)
{
	if (!ep)
		return bd_errf(err, cap, -EINVAL, "%s: no endpoint", what);
	if (strncmp(ep, "tcp://", 6) || curve || insecure_tcp || bd_zsec_tcp_loopback(ep))
		return 0;
	return bd_errf(err, cap, -EPERM, "%s %s: plain TCP off loopback is refused (anyone on the "
		    "network could read and send frames): configure CURVE keys "
		    "(curve_secret_key and an allow-list; bdfp4 keygen), or set insecure_tcp = true",
		    what, ep);
}

int bd_zsec_handshake_error(int event, int value, const char *ep, char *err, size_t cap)
{
	if (event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)
		return bd_errf(err, cap, -EACCES, "%s refused this client's CURVE key (ZAP status %d): "
			    "its public key is not in the server's allow-list", ep ? ep : "the server",
			    value);
	if (event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL ||
	    event == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL)
		return bd_errf(err, cap, -EPROTO, "security handshake with %s failed: the server and "
			    "this client disagree on CURVE (a CURVE server and a plain client, or "
			    "the other way round, or the wrong server public key)", ep ? ep : "the server");
	return 0;
}
