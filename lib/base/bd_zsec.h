/* bd_zsec.h — the security of the daemons' ZeroMQ endpoints: CURVE key pairs and allow-lists
 * in files, the sockets' CURVE options, a ZAP handler (ZeroMQ RFC 27) that admits the listed
 * client keys, the rule that refuses plain TCP off loopback, and what a client's failed
 * handshake means.
 *
 * Keys are libzmq's own CURVE (Curve25519 through libsodium, ZeroMQ RFC 26), 32 bytes written
 * as 40 characters of Z85. The files:
 *   - a secret key file: the 40-character secret key on one line (mode 0600; its public key is
 *     derived with zmq_curve_public);
 *   - a public key file: the 40-character public key on one line;
 *   - an allow-list: one public key per line, optionally followed by blanks and a name used
 *     in logs; blank lines and lines starting with '#' are ignored.
 * bd_zsec_keygen() writes a pair (`bdfp4 keygen`).
 *
 * A server socket (ROUTER, REP) with a key pair is a CURVE server: every peer must complete the
 * CURVE handshake with the server's public key, and the ZAP handler, which runs in its own
 * thread on the socket's ZeroMQ context, then admits the peer only if its public key is in the
 * allow-list of the socket's ZAP domain. A socket without keys speaks plain ZMTP (NULL
 * mechanism): fine on ipc:// (file modes and SO_PEERCRED guard it) and on loopback TCP, and
 * refused off loopback unless the configuration says insecure_tcp (bd_zsec_endpoint_check).
 *
 * Errors are -errno with a one-line message in err[cap] (err may be NULL): -ENOENT and the
 * other -errno of open/read/write, -EBADMSG a file that does not hold what it should, -EPERM
 * a secret key file readable by others or plain TCP off loopback, -ENOMEM, -ENOTSUP a libzmq
 * built without CURVE, -EIO a ZeroMQ call that failed.
 */
#ifndef BD_ZSEC_H
#define BD_ZSEC_H

#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define BD_ZSEC_Z85 40 /* characters of one Z85 key (32 bytes) */

/* A CURVE key pair, Z85, NUL-terminated. */
struct bd_zsec_keypair {
	char pub[BD_ZSEC_Z85 + 1];
	char sec[BD_ZSEC_Z85 + 1];
};

/* Whether this libzmq has CURVE (zmq_has("curve")). */
bool bd_zsec_available(void);

/* Makes a new key pair (zmq_curve_keypair) and writes PREFIX.key (the secret key, created
 * with mode 0600 and O_EXCL: an existing file is not overwritten, -EEXIST) and PREFIX.pub (the
 * public key, 0644, replaced if there). ret (may be NULL) gets the pair. */
int bd_zsec_keygen(const char *prefix, struct bd_zsec_keypair *ret, char *err, size_t cap);

/* Reads a secret key file into ret (the public key derived from it). A file that group or
 * others may read or write is refused (-EPERM), as ssh refuses a private key. */
int bd_zsec_load_secret(const char *path, struct bd_zsec_keypair *ret, char *err, size_t cap);

/* Reads a public key file: ret[BD_ZSEC_Z85 + 1]. */
int bd_zsec_load_public(const char *path, char *ret, char *err, size_t cap);

/* An allow-list of public keys. */
struct bd_zsec_allow;

/* Reads an allow-list file (at most 4096 keys). An empty list is valid and admits nobody. */
int bd_zsec_allow_load(const char *path, struct bd_zsec_allow **ret, char *err, size_t cap);

void bd_zsec_allow_free(struct bd_zsec_allow *a);

/* The name of the 32-byte public key key in a (its Z85 text when the line gave no name), or
 * NULL when a does not hold it. */
const char *bd_zsec_allow_find(const struct bd_zsec_allow *a, const unsigned char key[32]);

/* Makes sock a CURVE server with kp (ZMQ_CURVE_SERVER, ZMQ_CURVE_SECRETKEY) whose peers the
 * ZAP handler judges under domain (ZMQ_ZAP_DOMAIN, the allow-list's name there). Call before
 * zmq_bind. Returns 0, -ENOTSUP, -EIO. */
int bd_zsec_server(void *sock, const struct bd_zsec_keypair *kp, const char *domain);

/* Makes sock a CURVE client of the server whose public key is server_pub (Z85), with its own
 * key pair kp. Call before zmq_connect. Returns 0, -ENOTSUP, -EIO. */
int bd_zsec_client(void *sock, const char *server_pub, const struct bd_zsec_keypair *kp);

/* The key files of a CURVE client (paths, "" or NULL when unset) loaded and applied to sock:
 * both set, CURVE with them; both unset, plain (returns 0, nothing done); one of them only,
 * -EINVAL ("a CURVE client needs both ..."). The errors of the loaders and bd_zsec_client. */
int bd_zsec_client_files(void *sock, const char *server_key_file, const char *secret_key_file,
			 char *err, size_t cap);

/* The ZAP handler: a thread with a REP socket bound at inproc://zeromq.zap.01 on zctx (one
 * per context), answering every handshake of the context's CURVE server sockets. A peer is
 * admitted (200) when its public key is in the allow-list of the socket's domain, refused (400)
 * otherwise, and for a mechanism other than CURVE; each refusal goes to on_refuse (NULL: none;
 * called on the handler's thread) with the domain, the peer's address and its key in Z85.
 * Start it before binding the server sockets: libzmq admits every peer while no handler is
 * bound. */
struct bd_zsec_zap;
typedef void (*bd_zsec_refuse_fn)(void *ctx, const char *domain, const char *address,
				  const char *key_z85);

int bd_zsec_zap_start(void *zctx, bd_zsec_refuse_fn on_refuse, void *ctx,
		      struct bd_zsec_zap **ret, char *err, size_t cap);

/* Adds the allow-list of a domain (a is taken over; freed by bd_zsec_zap_stop). At most 8
 * domains; call before the server sockets of that domain are bound. Returns 0, -EINVAL, -ENOSPC. */
int bd_zsec_zap_add(struct bd_zsec_zap *z, const char *domain, struct bd_zsec_allow *a);

/* Peers admitted and refused so far. */
void bd_zsec_zap_counts(const struct bd_zsec_zap *z, unsigned long *ret_admitted,
			unsigned long *ret_refused);

/* Stops the thread, closes its socket and frees the lists. NULL is accepted. */
void bd_zsec_zap_stop(struct bd_zsec_zap *z);

/* Whether a TCP endpoint's host is loopback: "tcp://127.x.y.z:P", "tcp://[::1]:P",
 * "tcp://localhost:P", "tcp://lo:P" (a source address before ';' is skipped). False for any
 * other host, a wildcard ('*', 0.0.0.0) included. */
bool bd_zsec_tcp_loopback(const char *endpoint);

/* The plain-TCP rule for an endpoint a daemon binds or connects: 0 for ipc:// and inproc://,
 * for tcp:// on loopback, for tcp:// with curve, and for tcp:// elsewhere with insecure_tcp;
 * else -EPERM with a message naming the endpoint and the two ways out. what names the key in
 * the message ("frontend"). */
int bd_zsec_endpoint_check(const char *endpoint, const char *what, bool curve, bool insecure_tcp,
			   char *err, size_t cap);

/* What a client's connection monitor saw: a ZMQ_EVENT_HANDSHAKE_FAILED_* event (value, the
 * ZAP status or errno libzmq gives) as -errno with a message: -EACCES for a refused key (the
 * server's ZAP handler said no: the key is not in its allow-list), -EPROTO for any other failed
 * handshake (a CURVE server and a plain client, a plain server and a CURVE client, a wrong
 * server key); 0 for any other event. */
int bd_zsec_handshake_error(int event, int value, const char *endpoint, char *err, size_t cap);

#ifdef __cplusplus
}
#endif
#endif
