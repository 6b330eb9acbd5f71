/* test_ipc.c — Unix sockets, SCM_RIGHTS and peer credentials (lib/base/ipc.c, bd_ipc.h). */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/bd_ipc.h"

static char dir[64];

static void init(void)
{
	snprintf(dir, sizeof(dir), "/tmp/bdfp4-ipc-XXXXXX");
	cr_assert_not_null(mkdtemp(dir));
}

static void fini(void)
{
	char cmd[128];

	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
	cr_expect_eq(system(cmd), 0);
}

TestSuite(ipc, .init = init, .fini = fini);

Test(ipc, fds_travel_and_point_to_the_same_file)
{
	int sv[2], pipefd[2], got[4], n_got = -1;
	char buf[16];
	ssize_t n;

	cr_assert_eq(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv), 0);
	cr_assert_eq(pipe(pipefd), 0);
	cr_assert_eq(bd_ipc_send(sv[0], "hello", 5, pipefd, 2), 0);
	n = bd_ipc_recv(sv[1], buf, sizeof(buf), got, 4, &n_got);
	cr_assert_eq(n, 5);
	cr_expect_eq(memcmp(buf, "hello", 5), 0);
	cr_assert_eq(n_got, 2);
	cr_expect_neq(got[0], pipefd[0], "a new descriptor was expected");
	/* close-on-exec on what arrives */
	cr_expect(fcntl(got[0], F_GETFD) & FD_CLOEXEC);
	/* the received write end feeds the original read end */
	cr_assert_eq(write(got[1], "xy", 2), 2);
	cr_assert_eq(read(pipefd[0], buf, 2), 2);
	cr_expect_eq(memcmp(buf, "xy", 2), 0);
	for (int i = 0; i < 2; i++) {
		close(got[i]);
		close(pipefd[i]);
		close(sv[i]);
	}
}

Test(ipc, too_many_fds_or_too_long_a_packet)
{
	int sv[2], fds[3], got[2] = { -7, -7 }, n_got = -1;
	char buf[4];

	cr_assert_eq(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv), 0);
	for (int i = 0; i < 3; i++)
		fds[i] = open("/dev/null", O_RDONLY | O_CLOEXEC);
	/* three fds for room for two: refused, and none of them left open here */
	cr_assert_eq(bd_ipc_send(sv[0], "abc", 3, fds, 3), 0);
	cr_expect_eq(bd_ipc_recv(sv[1], buf, sizeof(buf), got, 2, &n_got), -EMSGSIZE);
	cr_expect_eq(n_got, 0);
	cr_expect_eq(got[0], -7, "fds written on error");
	/* a packet longer than the buffer */
	cr_assert_eq(bd_ipc_send(sv[0], "abcdefgh", 8, NULL, 0), 0);
	cr_expect_eq(bd_ipc_recv(sv[1], buf, sizeof(buf), got, 2, &n_got), -EMSGSIZE);
	/* bad arguments */
	cr_expect_eq(bd_ipc_send(sv[0], "a", 0, NULL, 0), -EINVAL);
	cr_expect_eq(bd_ipc_send(sv[0], "a", 1, NULL, 1), -EINVAL);
	cr_expect_eq(bd_ipc_send(sv[0], "a", 1, fds, BD_IPC_MAX_FDS + 1), -EINVAL);
	/* end of stream reads as 0 */
	close(sv[0]);
	cr_expect_eq(bd_ipc_recv(sv[1], buf, sizeof(buf), got, 2, &n_got), 0);
	close(sv[1]);
	for (int i = 0; i < 3; i++)
		close(fds[i]);
}

Test(ipc, listen_connect_and_peer_credentials)
{
	char path[128];
	struct stat st;
	pid_t pid;
	uid_t uid;
	gid_t gid;
	int l, c, a;

	snprintf(path, sizeof(path), "%s/s.sock", dir);
	l = bd_ipc_listen(path, 0660, (gid_t)-1, 4);
	cr_assert_geq(l, 0, "%s", strerror(-l));
	cr_assert_eq(stat(path, &st), 0);
	cr_expect_eq(st.st_mode & 0777, 0660);
	c = bd_ipc_connect(path);
	cr_assert_geq(c, 0);
	a = accept(l, NULL, NULL);
	cr_assert_geq(a, 0);
	cr_assert_eq(bd_ipc_peer_cred(a, &pid, &uid, &gid), 0);
	cr_expect_eq(pid, getpid());
	cr_expect_eq(uid, geteuid());
	cr_expect_eq(gid, getegid());
	/* we are our own uid: always allowed */
	cr_expect_eq(bd_ipc_peer_allowed(a, geteuid(), (gid_t)-1), 1);
	close(a);
	close(c);
	close(l);
	/* a stale socket file is replaced; a regular file is not */
	l = bd_ipc_listen(path, 0600, (gid_t)-1, 4);
	cr_expect_geq(l, 0);
	close(l);
	unlink(path);
	close(creat(path, 0600));
	cr_expect_eq(bd_ipc_listen(path, 0600, (gid_t)-1, 4), -EEXIST);
	cr_expect_eq(bd_ipc_connect(path), -ECONNREFUSED);
	cr_expect_eq(bd_ipc_connect("/nonexistent/dir/x.sock"), -ENOENT);
	memset(path, 'a', sizeof(path) - 1);
	path[sizeof(path) - 1] = 0;
	cr_expect_eq(bd_ipc_listen(path, 0600, (gid_t)-1, 4), -EINVAL);
}

/* A peer that is neither root nor us is judged by its group. Needs root to become nobody. */
Test(ipc, other_users_need_the_group)
{
	char path[128];
	int l, st;
	pid_t child;

	if (geteuid() != 0)
		cr_skip_test("needs root to act as another user");
	snprintf(path, sizeof(path), "%s/g.sock", dir);
	chmod(dir, 0711);
	l = bd_ipc_listen(path, 0666, (gid_t)-1, 4);
	cr_assert_geq(l, 0);
	child = fork();
	cr_assert_geq(child, 0);
	if (child == 0) {
		int c;

		if (setgroups(0, NULL) < 0 || setgid(65534) < 0 || setuid(65534) < 0)
			_exit(2);
		c = bd_ipc_connect(path);
		if (c < 0)
			_exit(3);
		pause(); /* the parent looks at us, then kills us */
		_exit(0);
	}
	{
		int a = -1;

		for (int i = 0; i < 500 && a < 0; i++) {
			a = accept4(l, NULL, NULL, 0);
			if (a < 0)
				usleep(10000);
		}
		cr_assert_geq(a, 0, "the child did not connect");
		/* uid 65534, gid 65534: not root, not us */
		cr_expect_eq(bd_ipc_peer_allowed(a, 0x7ffffff0, (gid_t)-1), 0);
		cr_expect_eq(bd_ipc_peer_allowed(a, 0x7ffffff0, 1), 0);
		cr_expect_eq(bd_ipc_peer_allowed(a, 0x7ffffff0, 65534), 1);
		cr_expect_eq(bd_ipc_peer_allowed(a, 65534, (gid_t)-1), 1);
		close(a);
	}
	kill(child, SIGKILL);
	waitpid(child, &st, 0);
	cr_expect(WIFSIGNALED(st), "the child failed early with %d", WEXITSTATUS(st));
	close(l);
}

Test(ipc, a_live_listener_is_never_taken_over)
{
	char path[96], other[96], ep[128];
	int l, l2, st, c;

	snprintf(path, sizeof(path), "%s/live.sock", dir);
	snprintf(other, sizeof(other), "%s/stream.sock", dir);
	snprintf(ep, sizeof(ep), "ipc://%s", path);
	cr_assert_eq(bd_ipc_path_in_use(path), 0, "no file yet");
	cr_expect_eq(bd_ipc_endpoint_in_use(ep), 0);
	l = bd_ipc_listen(path, 0660, (gid_t)-1, 4);
	cr_assert_geq(l, 0, "%s", strerror(-l));
	cr_assert_eq(bd_ipc_path_in_use(path), 1);
	/* the same listener named as a ZeroMQ endpoint; a bare path is no ipc:// endpoint */
	cr_expect_eq(bd_ipc_endpoint_in_use(ep), 1);
	cr_expect_eq(bd_ipc_endpoint_in_use(path), 0);
	/* a second daemon on the same path is refused, and the first still accepts */
	l2 = bd_ipc_listen(path, 0660, (gid_t)-1, 4);
	cr_assert_eq(l2, -EADDRINUSE, "%d", l2);
	c = bd_ipc_connect(path);
	cr_assert_geq(c, 0, "the live listener lost its path: %s", strerror(-c));
	close(c);
	close(l);
	/* the file the closed listener left is stale: it is replaced */
	cr_assert_eq(bd_ipc_path_in_use(path), 0);
	cr_expect_eq(bd_ipc_endpoint_in_use(ep), 0);
	l2 = bd_ipc_listen(path, 0660, (gid_t)-1, 4);
	cr_assert_geq(l2, 0, "%s", strerror(-l2));
	close(l2);
	/* ZeroMQ's ipc endpoints are stream sockets: those count too */
	st = bd_ipc_bind(other, SOCK_STREAM);
	cr_assert_geq(st, 0, "%s", strerror(-st));
	cr_assert_eq(listen(st, 1), 0);
	cr_assert_eq(bd_ipc_path_in_use(other), 1);
	close(st);
	cr_assert_eq(bd_ipc_path_in_use(other), 0);
	cr_assert_eq(bd_ipc_path_in_use(""), -EINVAL);
}

Test(ipc, a_bound_datagram_socket_receives_and_keeps_its_path)
{
	char path[96], buf[16], big[200];
	int fd, again, tx, type = 0;
	socklen_t len = sizeof(type);
	struct sockaddr_un sa = { .sun_family = AF_UNIX };

	snprintf(path, sizeof(path), "%s/notify.sock", dir);
	fd = bd_ipc_bind(path, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK);
	cr_assert_geq(fd, 0, "%s", strerror(-fd));
	cr_expect(fcntl(fd, F_GETFD) & FD_CLOEXEC);
	cr_expect(fcntl(fd, F_GETFL) & O_NONBLOCK);
	cr_assert_eq(getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len), 0);
	cr_expect_eq(type, SOCK_DGRAM);
	cr_expect_eq(recv(fd, buf, sizeof(buf), 0), -1, "nothing sent yet, and it does not block");
	cr_expect_eq(errno, EAGAIN);
	/* a second socket on the same path fails and leaves the first one its file */
	again = bd_ipc_bind(path, SOCK_DGRAM);
	cr_expect_eq(again, -EADDRINUSE, "%d", again);
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	tx = socket(AF_UNIX, SOCK_DGRAM, 0);
	cr_assert_geq(tx, 0);
	cr_assert_eq(sendto(tx, "READY=1", 7, 0, (struct sockaddr *)&sa, sizeof(sa)), 7);
	cr_assert_eq(recv(fd, buf, sizeof(buf), 0), 7);
	cr_expect_eq(memcmp(buf, "READY=1", 7), 0);
	close(tx);
	close(fd);
	/* no path, an empty one, one longer than sun_path */
	memset(big, 'a', sizeof(big) - 1);
	big[sizeof(big) - 1] = 0;
	cr_expect_eq(bd_ipc_bind(NULL, SOCK_DGRAM), -EINVAL);
	cr_expect_eq(bd_ipc_bind("", SOCK_DGRAM), -EINVAL);
	cr_expect_eq(bd_ipc_bind(big, SOCK_DGRAM), -EINVAL);
}

Test(ipc, the_open_file_limit_is_raised_to_the_hard_limit)
{
	struct rlimit rl;
	cr_assert_eq(getrlimit(RLIMIT_NOFILE, &rl), 0);
	int r = bd_ipc_raise_nofile();
	cr_assert_gt(r, 0, "%s", strerror(-r));
	struct rlimit after;
	cr_assert_eq(getrlimit(RLIMIT_NOFILE, &after), 0);
	cr_assert_eq(after.rlim_cur, rl.rlim_max);
}

Test(ipc, endpoint_paths)
{
	cr_expect_str_eq(bd_ipc_endpoint_path("ipc:///run/bdfp4/router.sock"),
			 "/run/bdfp4/router.sock");
	cr_expect_str_eq(bd_ipc_endpoint_path("ipc://rel.sock"), "rel.sock");
	cr_expect_null(bd_ipc_endpoint_path("tcp://127.0.0.1:5555"));
	cr_expect_null(bd_ipc_endpoint_path("inproc://x"));
	cr_expect_null(bd_ipc_endpoint_path("ipc:/one-slash"));
	cr_expect_null(bd_ipc_endpoint_path(NULL));
	cr_expect_eq(bd_ipc_endpoint_in_use("tcp://127.0.0.1:1"), 0);
	cr_expect_eq(bd_ipc_endpoint_in_use(NULL), 0);
	cr_expect_eq(bd_ipc_endpoint_in_use("ipc://"), -EINVAL);
}

Test(ipc, the_directory_of_a_socket_is_made_once)
{
	char path[192], sub[128], deep[192];
	char *big = malloc(PATH_MAX + 8);
	struct stat st;
	mode_t old = umask(022);

	snprintf(sub, sizeof(sub), "%s/run", dir);
	snprintf(path, sizeof(path), "%s/x.sock", sub);
	cr_assert_eq(bd_ipc_mkdir_parent(path, 0750), 0);
	cr_assert_eq(stat(sub, &st), 0);
	cr_expect(S_ISDIR(st.st_mode));
	cr_expect_eq(st.st_mode & 0777, 0750);
	/* there already: fine, and its mode is left alone */
	cr_expect_eq(bd_ipc_mkdir_parent(path, 0700), 0);
	cr_assert_eq(stat(sub, &st), 0);
	cr_expect_eq(st.st_mode & 0777, 0750);
	/* the umask applies */
	snprintf(path, sizeof(path), "%s/open/y.sock", dir);
	cr_expect_eq(bd_ipc_mkdir_parent(path, 0777), 0);
	snprintf(sub, sizeof(sub), "%s/open", dir);
	cr_assert_eq(stat(sub, &st), 0);
	cr_expect_eq(st.st_mode & 0777, 0755);
	/* one level only */
	snprintf(deep, sizeof(deep), "%s/a/b/z.sock", dir);
	cr_expect_eq(bd_ipc_mkdir_parent(deep, 0755), -ENOENT);
	/* no directory part, or the root */
	cr_expect_eq(bd_ipc_mkdir_parent("z.sock", 0755), 0);
	cr_expect_eq(bd_ipc_mkdir_parent("/z.sock", 0755), 0);
	/* a file where the directory would go */
	snprintf(sub, sizeof(sub), "%s/file", dir);
	close(creat(sub, 0600));
	snprintf(path, sizeof(path), "%s/file/x.sock", dir);
	cr_expect_eq(bd_ipc_mkdir_parent(path, 0755), -ENOTDIR);
	cr_expect_eq(bd_ipc_mkdir_parent(NULL, 0755), -EINVAL);
	cr_assert_not_null(big);
	memset(big, 'a', PATH_MAX + 7);
	big[PATH_MAX + 7] = 0;
	cr_expect_eq(bd_ipc_mkdir_parent(big, 0755), -EINVAL);
	free(big);
	umask(old);
}

/* A listening Unix socket of dir at name (SOCK_STREAM, as ZeroMQ's ipc:// listens). */
static int listen_at(const char *name, char *ep, size_t cap)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int fd = socket(AF_UNIX, SOCK_STREAM, 0);

	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s/%s", dir, name);
	snprintf(ep, cap, "ipc://%s", sa.sun_path);
	cr_assert_eq(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
	cr_assert_eq(listen(fd, 4), 0);
	return fd;
}

/* Each way an endpoint can be missing gets its own error, at once; a listener is 0. */
Test(ipc, endpoint_check_tells_why)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	socklen_t len = sizeof(a);
	char ep[160], tcp[64];
	int fd, tfd;

	fd = listen_at("live.sock", ep, sizeof(ep));
	cr_expect_eq(bd_ipc_endpoint_check(ep, 1000), 0);
	close(fd); /* the file stays: a stale socket refuses */
	cr_expect_eq(bd_ipc_endpoint_check(ep, 1000), -ECONNREFUSED);
	snprintf(ep, sizeof(ep), "ipc://%s/none.sock", dir);
	cr_expect_eq(bd_ipc_endpoint_check(ep, 1000), -ENOENT);

	tfd = socket(AF_INET, SOCK_STREAM, 0);
	cr_assert_eq(bind(tfd, (struct sockaddr *)&a, sizeof(a)), 0);
	cr_assert_eq(getsockname(tfd, (struct sockaddr *)&a, &len), 0);
	snprintf(tcp, sizeof(tcp), "tcp://127.0.0.1:%u", ntohs(a.sin_port));
	cr_expect_eq(bd_ipc_endpoint_check(tcp, 1000), -ECONNREFUSED, "bound, not listening");
	cr_assert_eq(listen(tfd, 4), 0);
	cr_expect_eq(bd_ipc_endpoint_check(tcp, 1000), 0);
	close(tfd);

	cr_expect_eq(bd_ipc_endpoint_check("tcp://127.0.0.1", 1000), -EINVAL, "no port");
	cr_expect_eq(bd_ipc_endpoint_check("ipc://", 1000), -EINVAL);
	cr_expect_eq(bd_ipc_endpoint_check("inproc://x", 1000), 0, "not checked");
	cr_expect_eq(bd_ipc_endpoint_check(NULL, 1000), -EINVAL);
}
