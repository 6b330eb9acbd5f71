/* bd_ipc.h — Unix-socket helpers: listening and connecting SOCK_SEQPACKET sockets, packets with
 * file descriptors (SCM_RIGHTS) and peer credentials (SO_PEERCRED, SO_PEERGROUPS).
 *
 * kvpoold hands its arena fds to workers through these (DESIGN.md "Backends"); a packet is one
 * protobuf message, so no framing is needed on top. Every fd these functions create or receive
 * is close-on-exec.
 */
#ifndef BD_IPC_H
#define BD_IPC_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Most fds one packet carries (the kernel's SCM_MAX_FD is 253). */
#define BD_IPC_MAX_FDS 64

/* 1 when a process listens on the Unix socket at path (a connect of stream or seqpacket type
 * succeeds), 0 when nothing does (no file, or a stale one), -EINVAL for a bad path. Daemons call
 * it before binding a ZeroMQ ipc:// endpoint, which would silently take a live one over. */
int bd_ipc_path_in_use(const char *path);

/* The socket path of a ZeroMQ ipc:// endpoint ("ipc:///run/bdfp4/x.sock" gives
 * "/run/bdfp4/x.sock", pointing into endpoint); NULL for another transport (tcp://, inproc://)
 * or a NULL endpoint. */
const char *bd_ipc_endpoint_path(const char *endpoint);

/* bd_ipc_path_in_use() of an ipc:// endpoint's path: 1 when a process listens there, 0 when
 * nothing does or the endpoint is of another transport, -EINVAL for a bad path. ZeroMQ binds an
 * ipc:// path over a live listener's without an error, so a daemon asks this before
 * zmq_bind(). */
int bd_ipc_endpoint_in_use(const char *endpoint);

/* Whether a ZeroMQ endpoint has a listener now, for a client that should fail at once rather
 * than wait for an answer that cannot come: ipc://PATH is connected to (SOCK_STREAM), tcp://
 * HOST:PORT too, waiting up to timeout_ms. Returns 0 when something accepts (or the transport
 * is another: not checked), -ENOENT (no socket file), -EACCES (permission denied),
 * -ECONNREFUSED (nothing listens), -ETIMEDOUT, -EHOSTUNREACH or another connect() -errno,
 * -EINVAL (an endpoint that does not parse, or a host that does not resolve). */
int bd_ipc_endpoint_check(const char *endpoint, int timeout_ms);

/* Gives the socket file of a bound ipc:// endpoint file mode `mode` and group `gid` (unchanged
 * when gid is (gid_t)-1). ZeroMQ creates the file with the process's umask (0755 from a shell
 * with umask 022, so the group could not connect), so every daemon calls this after zmq_bind:
 * the mode is then the configured one whatever the umask. Returns 0 (done, or the endpoint is
 * of another transport), -EINVAL (NULL endpoint), or the -errno of chmod/chown. */
int bd_ipc_endpoint_secure(const char *endpoint, mode_t mode, gid_t gid);

/* Makes the directory a socket at path goes in (path up to its last '/', one level, with file
 * mode `mode` less the umask) when it does not exist yet: a daemon's runtime directory where
 * systemd has not made it. Returns 0 (made, there already, or path has no directory part),
 * -EINVAL (NULL path, or one of PATH_MAX bytes or more), -ENOTDIR (something else than a
 * directory is there), or the -errno of mkdir (-ENOENT when the level above is missing too). */
int bd_ipc_mkdir_parent(const char *path, mode_t mode);

/* Raises this process's soft limit of open files to its hard limit (a daemon's connections are
 * fds; running out makes libzmq abort). Returns the new soft limit (capped at INT32_MAX) or
 * -errno. */
int bd_ipc_raise_nofile(void);

/* Creates a listening SOCK_SEQPACKET socket bound at path (a stale socket file there is
 * replaced; any other kind of file is not, nor the socket of a live listener), with file mode
 * `mode` and group `gid` (unchanged when gid is (gid_t)-1). The socket is non-blocking. Returns
 * the fd, or -EINVAL (NULL path or one longer than sun_path), -EEXIST (path is not a socket),
 * -EADDRINUSE (a process listens there), or the -errno of the failed call. */
int bd_ipc_listen(const char *path, mode_t mode, gid_t gid, int backlog);

/* Creates a Unix socket of `type` (SOCK_DGRAM, SOCK_SEQPACKET or SOCK_STREAM, with
 * SOCK_CLOEXEC or SOCK_NONBLOCK ORed in as wanted) bound at path, with the process's umask;
 * a file already at path stays and the bind fails. Returns the fd, or -EINVAL (NULL, empty or
 * longer than sun_path), -EADDRINUSE (something is at path), or the -errno of socket or bind. */
int bd_ipc_bind(const char *path, int type);

/* Connects a blocking SOCK_SEQPACKET socket to path. Returns the fd or -errno (-ENOENT when
 * nothing listens there, -ECONNREFUSED, -EACCES, -EINVAL for a bad path). */
int bd_ipc_connect(const char *path);

/* Sends one packet of len bytes (1..) with n_fds (0..BD_IPC_MAX_FDS) descriptors attached. The
 * descriptors stay open in the caller. Never raises SIGPIPE. Returns 0, -EINVAL, -EMSGSIZE, or
 * the -errno of sendmsg (-EAGAIN on a full non-blocking socket, -EPIPE when the peer is gone). */
int bd_ipc_send(int sock, const void *buf, size_t len, const int *fds, int n_fds);

/* Receives one packet into buf (cap bytes) and up to max_fds descriptors into ret_fds, their
 * number into *ret_n_fds. Returns the packet length (0: the peer closed the connection), or
 * -EINVAL, -EMSGSIZE (the packet was longer than cap, or carried more than max_fds
 * descriptors: every descriptor received is closed and *ret_n_fds is 0), or the -errno of
 * recvmsg (-EAGAIN when nothing is pending on a non-blocking socket). */
ssize_t bd_ipc_recv(int sock, void *buf, size_t cap, int *ret_fds, int max_fds, int *ret_n_fds);

/* The peer's pid, uid and gid as of connect(). Returns 0 or -errno. */
int bd_ipc_peer_cred(int sock, pid_t *ret_pid, uid_t *ret_uid, gid_t *ret_gid);

/* True when the peer of sock may use a daemon run as self_uid and restricted to group `allowed`
 * ((gid_t)-1: no group): root, self_uid, a peer whose gid is `allowed`, or whose supplementary
 * groups (SO_PEERGROUPS) include it. Returns 1 (allowed), 0 (denied) or -errno. */
int bd_ipc_peer_allowed(int sock, uid_t self_uid, gid_t allowed);

#ifdef __cplusplus
}
#endif
#endif
