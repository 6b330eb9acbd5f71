/* ipc.c — Unix SOCK_SEQPACKET sockets, SCM_RIGHTS and peer credentials (bd_ipc.h).
 */
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <limits.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "base/bd_ipc.h"

static int fill_addr(struct sockaddr_un *sa, const char *path)
{
	size_t n;

	if (!path)
		return -EINVAL;
	n = strlen(path);
	if (n == 0 || n >= sizeof(sa->sun_path))
		return -EINVAL;
	memset(sa, 0, sizeof(*sa));
	sa->sun_family = AF_UNIX;
	memcpy(sa->sun_path, path, n + 1);
	return 0;
}

/* A new Unix socket of type `type` (flags included), bound to sa (do_bind) or connected to it.
 * Returns the fd or the -errno of socket, bind or connect. */
static int open_at(const struct sockaddr_un *sa, int type, bool do_bind)
{
	const struct sockaddr *a = (const struct sockaddr *)sa;
	int fd = socket(AF_UNIX, type, 0), r;

	if (fd < 0)
		return -errno;
	if ((do_bind ? bind(fd, a, sizeof(*sa)) : connect(fd, a, sizeof(*sa))) < 0) {
		r = -errno;
		close(fd);
		return r;
	}
	return fd;
}

int bd_ipc_path_in_use(const char *path)
{
	struct sockaddr_un sa;
	static const int types[] = { SOCK_STREAM, SOCK_SEQPACKET };

	if (fill_addr(&sa, path) < 0)
		return -EINVAL;
	/* a listener of either type answers a connect of its own type; a stale file refuses */
	for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
		int fd = socket(AF_UNIX, types[i] | SOCK_CLOEXEC, 0);
		if (fd < 0)
			return -errno;
		int r = connect(fd, (struct sockaddr *)&sa, sizeof(sa));
		int e = errno;
		close(fd);
		if (r == 0 || e == EAGAIN)
			return 1; /* EAGAIN: a listener whose backlog is full */
	}
	return 0;
}

const char *bd_ipc_endpoint_path(const char *endpoint)
{
	if (!endpoint || strncmp(endpoint, "ipc://", 6))
		return NULL;
	return endpoint + 6;
}

int bd_ipc_endpoint_in_use(const char *endpoint)
{
	const char *path = bd_ipc_endpoint_path(endpoint);

	return path ? bd_ipc_path_in_use(path) : 0;
}

int bd_ipc_endpoint_secure(const char *endpoint, mode_t mode, gid_t gid)
{
	const char *path = bd_ipc_endpoint_path(endpoint);

	if (!endpoint)
		return -EINVAL;
	if (!path)
		return 0;
	if (chmod(path, mode) < 0)
		return -errno;
	if (gid != (gid_t)-1 && chown(path, (uid_t)-1, gid) < 0)
		return -errno;
	return 0;
}

/* A non-blocking connect of fd to addr, up to timeout_ms: 0 or -errno. */
static int connect_wait(int fd, const struct sockaddr *addr, socklen_t len, int timeout_ms)
{
	struct pollfd p = { .fd = fd, .events = POLLOUT };
	socklen_t elen = sizeof(int);
	int err = 0, r;

	if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK) < 0)
		return -errno;
	if (connect(fd, addr, len) == 0)
		return 0;
	if (errno != EINPROGRESS && errno != EAGAIN)
		return -errno;
	r = poll(&p, 1, timeout_ms);
	if (r == 0)
		return -ETIMEDOUT;
	if (r < 0)
		return -errno;
	if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &elen) < 0)
		return -errno;
	return -err;
}

int bd_ipc_endpoint_check(const char *endpoint, int timeout_ms)
{
	struct addrinfo hints = { .ai_socktype = SOCK_STREAM }, *ai = NULL;
	char host[256];
	const char *colon;
	int fd, e;

	if (!endpoint)
		return -EINVAL;
	if (!strncmp(endpoint, "ipc://", 6)) {
		struct sockaddr_un sa;
		struct stat st;

		if (fill_addr(&sa, endpoint + 6) < 0)
			return -EINVAL;
		if (stat(endpoint + 6, &st) < 0)
			return -errno;
		fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
		if (fd < 0)
			return -errno;
		e = connect_wait(fd, (struct sockaddr *)&sa, sizeof(sa), timeout_ms);
		close(fd);
		return e == -EAGAIN ? 0 : e; /* EAGAIN: a listener with a full backlog */
	}
	if (strncmp(endpoint, "tcp://", 6))
		return 0;
	colon = strrchr(endpoint + 6, ':');
	if (!colon || (size_t)(colon - endpoint - 6) >= sizeof(host) || colon == endpoint + 6)
		return -EINVAL;
	memcpy(host, endpoint + 6, (size_t)(colon - endpoint - 6));
	host[colon - endpoint - 6] = 0;
	if (host[0] == '[' && strlen(host) > 2 && host[strlen(host) - 1] == ']') {
		memmove(host, host + 1, strlen(host));
		host[strlen(host) - 1] = 0;
	}
	if (getaddrinfo(host, colon + 1, &hints, &ai) != 0 || !ai)
		return -EINVAL;
	fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
	e = fd < 0 ? -errno : connect_wait(fd, ai->ai_addr, ai->ai_addrlen, timeout_ms);
	if (fd >= 0)
		close(fd);
	freeaddrinfo(ai);
	return e;
}

int bd_ipc_mkdir_parent(const char *path, mode_t mode)
{
	char dir[PATH_MAX], *slash;
	struct stat st;

	if (!path || strlen(path) >= sizeof(dir))
		return -EINVAL;
	memcpy(dir, path, strlen(path) + 1);
	slash = strrchr(dir, '/');
	if (!slash || slash == dir)
		return 0; /* the working directory, or / */
	*slash = 0;
	if (mkdir(dir, mode) == 0)
		return 0;
	if (errno != EEXIST)
		return -errno;
	if (stat(dir, &st) < 0)
		return -errno;
	return S_ISDIR(st.st_mode) ? 0 : -ENOTDIR;
}

int bd_ipc_raise_nofile(void)
{
	struct rlimit rl;

	if (getrlimit(RLIMIT_NOFILE, &rl) < 0)
		return -errno;
	if (rl.rlim_cur < rl.rlim_max) {
		rl.rlim_cur = rl.rlim_max;
		if (setrlimit(RLIMIT_NOFILE, &rl) < 0)
			return -errno;
	}
	return rl.rlim_cur > (rlim_t)INT32_MAX ? INT32_MAX : (int)rl.rlim_cur;
}

int bd_ipc_listen(const char *path, mode_t mode, gid_t gid, int backlog)
{
	struct sockaddr_un sa;
	struct stat st;
	int fd, r;

	r = fill_addr(&sa, path);
	if (r < 0 || backlog < 1)
		return -EINVAL;
	if (lstat(path, &st) == 0) {
		/* a socket left by a daemon that died; never remove anything else, nor the
		 * socket of a daemon that still listens there */
		if (!S_ISSOCK(st.st_mode))
			return -EEXIST;
		if ((r = bd_ipc_path_in_use(path)) != 0)
			return r < 0 ? r : -EADDRINUSE;
		if (unlink(path) < 0)
			return -errno;
	}
	fd = open_at(&sa, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, true);
	if (fd < 0)
		return fd;
	if (chmod(path, mode) < 0)
		goto fail_unlink;
	if (gid != (gid_t)-1 && chown(path, (uid_t)-1, gid) < 0)
		goto fail_unlink;
	if (listen(fd, backlog) < 0)
		goto fail_unlink;
	return fd;

fail_unlink:
	r = -errno;
	unlink(path);
	close(fd);
	return r;
}

int bd_ipc_bind(const char *path, int type)
{
	struct sockaddr_un sa;
	int r = fill_addr(&sa, path);

	return r < 0 ? r : open_at(&sa, type, true);
}

int bd_ipc_connect(const char *path)
{
	struct sockaddr_un sa;
	int r = fill_addr(&sa, path);

	return r < 0 ? r : open_at(&sa, SOCK_SEQPACKET | SOCK_CLOEXEC, false);
}

int bd_ipc_send(int sock, const void *buf, size_t len, const int *fds, int n_fds)
{
	union {
		char b[CMSG_SPACE(BD_IPC_MAX_FDS * sizeof(int))];
		struct cmsghdr align;
	} ctl;
	struct iovec iov = { .iov_base = (void *)buf, .iov_len = len };
	struct msghdr m = { .msg_iov = &iov, .msg_iovlen = 1 };
	ssize_t n;

	if (sock < 0 || !buf || len == 0 || n_fds < 0 || n_fds > BD_IPC_MAX_FDS ||
	    (n_fds && !fds))
		return -EINVAL;
	if (n_fds) {
		struct cmsghdr *cm;

		memset(&ctl, 0, sizeof(ctl));
		m.msg_control = ctl.b;
		m.msg_controllen = CMSG_SPACE((size_t)n_fds * sizeof(int));
		cm = CMSG_FIRSTHDR(&m);
		cm->cmsg_level = SOL_SOCKET;
		cm->cmsg_type = SCM_RIGHTS;
		cm->cmsg_len = CMSG_LEN((size_t)n_fds * sizeof(int));
		memcpy(CMSG_DATA(cm), fds, (size_t)n_fds * sizeof(int));
	}
	do
		n = sendmsg(sock, &m, MSG_NOSIGNAL);
	while (n < 0 && errno == EINTR);
	if (n < 0)
		return -errno;
	return (size_t)n == len ? 0 : -EMSGSIZE;
}

static void close_all(int *fds, int n)
{
	for (int i = 0; i < n; i++)
		close(fds[i]);
}

ssize_t bd_ipc_recv(int sock, void *buf, size_t cap, int *ret_fds, int max_fds, int *ret_n_fds)
{
	union {
		char b[CMSG_SPACE(BD_IPC_MAX_FDS * sizeof(int))];
		struct cmsghdr align;
	} ctl;
	struct iovec iov = { .iov_base = buf, .iov_len = cap };
	struct msghdr m = { .msg_iov = &iov, .msg_iovlen = 1 };
	int got[BD_IPC_MAX_FDS], n_got = 0;
	bool too_many = false;
	ssize_t n;

	if (sock < 0 || !buf || cap == 0 || !ret_n_fds || max_fds < 0 ||
	    max_fds > BD_IPC_MAX_FDS || (max_fds && !ret_fds))
		return -EINVAL;
	*ret_n_fds = 0;
	m.msg_control = ctl.b;
	m.msg_controllen = sizeof(ctl.b);
	do
		n = recvmsg(sock, &m, MSG_CMSG_CLOEXEC);
	while (n < 0 && errno == EINTR);
	if (n < 0)
		return -errno;
	for (struct cmsghdr *cm = CMSG_FIRSTHDR(&m); cm; cm = CMSG_NXTHDR(&m, cm)) {
		size_t k;

		if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
			continue;
		k = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
		for (size_t i = 0; i < k; i++) {
			int fd;

			memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
			if (n_got < BD_IPC_MAX_FDS)
				got[n_got++] = fd;
			else
				close(fd);
		}
	}
	if (n_got > max_fds || (m.msg_flags & MSG_CTRUNC))
		too_many = true;
	if (too_many || (m.msg_flags & MSG_TRUNC)) {
		close_all(got, n_got);
		return -EMSGSIZE;
	}
	if (n_got)
		memcpy(ret_fds, got, (size_t)n_got * sizeof(int));
	*ret_n_fds = n_got;
	return n;
}

int bd_ipc_peer_cred(int sock, pid_t *ret_pid, uid_t *ret_uid, gid_t *ret_gid)
{
	struct ucred uc;
	socklen_t len = sizeof(uc);

	if (sock < 0)
		return -EINVAL;
	if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &uc, &len) < 0)
		return -errno;
	if (ret_pid)
		*ret_pid = uc.pid;
	if (ret_uid)
		*ret_uid = uc.uid;
	if (ret_gid)
		*ret_gid = uc.gid;
	return 0;
}

int bd_ipc_peer_allowed(int sock, uid_t self_uid, gid_t allowed)
{
	gid_t small[64], *groups = small;
	socklen_t len = sizeof(small);
	uid_t uid = 0;
	gid_t gid = 0;
	int r;

	r = bd_ipc_peer_cred(sock, NULL, &uid, &gid);
	if (r < 0)
		return r;
	if (uid == 0 || uid == self_uid)
		return 1;
	if (allowed == (gid_t)-1)
		return 0;
	if (gid == allowed)
		return 1;
	/* supplementary groups: on ERANGE the kernel says how much room they need */
	if (getsockopt(sock, SOL_SOCKET, SO_PEERGROUPS, groups, &len) < 0) {
		if (errno == ENOPROTOOPT)
			return 0;
		if (errno != ERANGE)
			return -errno;
		groups = malloc(len);
		if (!groups)
			return -ENOMEM;
		if (getsockopt(sock, SOL_SOCKET, SO_PEERGROUPS, groups, &len) < 0) {
			r = -errno;
			free(groups);
			return r;
		}
	}
	r = 0;
	for (size_t i = 0; i < len / sizeof(gid_t); i++)
		if (groups[i] == allowed)
			r = 1;
	if (groups != small)
		free(groups);
	return r;
}
