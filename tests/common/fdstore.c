/* fdstore.c — systemd's fd store and restart, played by a test (fdstore.h). */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/bd_clock.h"
#include "base/bd_ipc.h"
#include "fdstore.h"
#include "spawn.h"

int fs_open(struct fs_store *s, const char *path)
{
	memset(s, 0, sizeof(*s));
	s->notify_fd = -1;
	if (!path || strlen(path) >= sizeof(s->path))
		return -ENAMETOOLONG;
	snprintf(s->path, sizeof(s->path), "%s", path);
	s->notify_fd = sp_notify_open(path);
	return s->notify_fd < 0 ? s->notify_fd : 0;
}

static void free_args(struct fs_store *s)
{
	for (size_t i = 0; s->argv[i]; i++) {
		free(s->argv[i]);
		s->argv[i] = NULL;
	}
	free(s->log);
	s->log = NULL;
}

void fs_close(struct fs_store *s)
{
	if (s->pid > 0) {
		kill(s->pid, SIGKILL);
		waitpid(s->pid, NULL, 0);
		s->pid = 0;
	}
	for (size_t i = 0; i < s->n; i++)
		close(s->fds[i]);
	s->n = 0;
	if (s->notify_fd >= 0)
		close(s->notify_fd);
	s->notify_fd = -1;
	free_args(s);
}

/* The rest of the message's line that starts with key ("FDNAME="), into out; false when no
 * line does. A notification is NAME=VALUE lines. */
static bool field(const char *msg, const char *key, char *out, size_t cap)
{
	size_t k = strlen(key);

	for (const char *p = msg; *p; p += strcspn(p, "\n") + (p[strcspn(p, "\n")] != 0))
		if (!strncmp(p, key, k)) {
			int n = (int)strcspn(p + k, "\n");

			snprintf(out, cap, "%.*s", n, p + k);
			return true;
		}
	return false;
}

/* The message sets key (e.g. "FDSTORE=") to 1. */
static bool is_set(const char *msg, const char *key)
{
	char v[8];

	return field(msg, key, v, sizeof(v)) && !strcmp(v, "1");
}

/* One FDSTORE=1 fd under name, unless the store holds that file already (systemd keeps one
 * copy of a file: the same inode). */
static void keep(struct fs_store *s, int fd, const char *name)
{
	struct stat a, b;

	if (fstat(fd, &a) == 0)
		for (size_t i = 0; i < s->n; i++)
			if (fstat(s->fds[i], &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino) {
				close(fd);
				return;
			}
	if (s->n == FS_MAX_FDS) {
		close(fd);
		return;
	}
	s->fds[s->n] = fd;
	snprintf(s->names[s->n], sizeof(s->names[0]), "%s", name);
	s->n++;
}

static void forget(struct fs_store *s, const char *name)
{
	for (size_t i = 0; i < s->n;)
		if (!strcmp(s->names[i], name)) {
			close(s->fds[i]);
			s->n--;
			s->fds[i] = s->fds[s->n];
			memcpy(s->names[i], s->names[s->n], sizeof(s->names[0]));
		} else {
			i++;
		}
}

/* One datagram, if one is queued: its fds kept (FDSTORE=1) or closed, FDSTOREREMOVE=1 done.
 * Returns 1 and the text in msg, 0 when none was queued. */
static int read_one(struct fs_store *s, char *msg, size_t cap)
{
	union {
		struct cmsghdr h;
		char b[CMSG_SPACE(sizeof(int) * FS_MAX_FDS)];
	} ctl;
	struct iovec iov = { .iov_base = msg, .iov_len = cap - 1 };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = &ctl,
			     .msg_controllen = sizeof(ctl) };
	int fds[FS_MAX_FDS], n_fds = 0;
	char name[64];
	ssize_t n = recvmsg(s->notify_fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);

	if (n < 0)
		return 0;
	msg[n] = 0;
	for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
		if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
			size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);

			memcpy(fds + n_fds, CMSG_DATA(c), k * sizeof(int));
			n_fds += (int)k;
		}
	if (!field(msg, "FDNAME=", name, sizeof(name)))
		snprintf(name, sizeof(name), "stored");
	for (int i = 0; i < n_fds; i++)
		if (is_set(msg, "FDSTORE="))
			keep(s, fds[i], name);
		else
			close(fds[i]); /* fds without FDSTORE=1 are not the manager's to keep */
	if (is_set(msg, "FDSTOREREMOVE=")) {
		forget(s, name);
		s->removed++;
	}
	return 1;
}

int fs_pump(struct fs_store *s, const char *what, bool *saw)
{
	char msg[4096];
	int n = 0;

	while (read_one(s, msg, sizeof(msg))) {
		n++;
		if (what && saw && strstr(msg, what))
			*saw = true;
	}
	return n;
}

/* The child: the kept fds at 3, 4, ... with LISTEN_*, the rest as sp_spawn sets it up. */
static void child(struct fs_store *s)
{
	char names[FS_MAX_FDS * 65] = "", num[32];
	int high[FS_MAX_FDS], base = 3 + (int)s->n + 16;

	prctl(PR_SET_PDEATHSIG, SIGKILL);
	/* first out of the way of 3.., then down into place (dup2 clears close-on-exec) */
	for (size_t i = 0; i < s->n; i++)
		high[i] = fcntl(s->fds[i], F_DUPFD_CLOEXEC, base);
	if (s->log) {
		int fd = open(s->log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);

		if (fd >= 0) {
			dup2(fd, 1);
			dup2(fd, 2);
			close(fd);
		}
	}
	for (size_t i = 0; i < s->n; i++) {
		if (high[i] < 0 || dup2(high[i], 3 + (int)i) < 0)
			_exit(126);
		strcat(names, i ? ":" : "");
		strcat(names, s->names[i]);
	}
	/* nothing else of the test's reaches the daemon, as nothing of systemd's does */
	close_range(3 + (unsigned)s->n, ~0u, 0);
	setenv("NOTIFY_SOCKET", s->path, 1);
	unsetenv("WATCHDOG_USEC");
	unsetenv("WATCHDOG_PID");
	unsetenv("JOURNAL_STREAM");
	if (s->n) {
		snprintf(num, sizeof(num), "%zu", s->n);
		setenv("LISTEN_FDS", num, 1);
		snprintf(num, sizeof(num), "%d", (int)getpid());
		setenv("LISTEN_PID", num, 1);
		setenv("LISTEN_FDNAMES", names, 1);
	} else {
		unsetenv("LISTEN_FDS");
		unsetenv("LISTEN_PID");
		unsetenv("LISTEN_FDNAMES");
	}
	execv(s->argv[0], s->argv);
	_exit(127);
}

/* Spawns the saved argv and waits for READY=1 (fs_start's returns). */
static int spawn_and_wait(struct fs_store *s, int timeout_ms)
{
	int64_t end = bd_now_ms() + timeout_ms;
	pid_t pid;

	/* what an earlier daemon sent before it ended is the manager's before this start */
	fs_pump(s, NULL, NULL);
	fflush(NULL);
	pid = fork();
	if (pid < 0)
		return -errno;
	if (pid == 0)
		child(s);
	s->pid = pid;
	while (bd_now_ms() < end) {
		struct pollfd p = { .fd = s->notify_fd, .events = POLLIN };
		bool ready = false;

		if (poll(&p, 1, 20) == 1) {
			fs_pump(s, "READY=1", &ready);
			if (ready)
				return 0;
			continue;
		}
		if (waitpid(s->pid, NULL, WNOHANG) == s->pid) {
			s->pid = 0;
			fs_pump(s, NULL, NULL);
			return -ECHILD;
		}
	}
	return -ETIMEDOUT;
}

int fs_start(struct fs_store *s, const char *const *argv, const char *log, int timeout_ms)
{
	size_t n = 0;

	if (!argv || !argv[0])
		return -EINVAL;
	free_args(s);
	while (argv[n] && n < FS_MAX_ARGS) {
		s->argv[n] = strdup(argv[n]);
		n++;
	}
	s->argv[n] = NULL;
	s->log = log ? strdup(log) : NULL;
	return spawn_and_wait(s, timeout_ms);
}

int fs_restart(struct fs_store *s, int sig, int timeout_ms)
{
	if (!s->argv[0])
		return -EINVAL;
	if (s->pid > 0) {
		kill(s->pid, sig);
		sp_reap(s->pid, timeout_ms);
		s->pid = 0;
	}
	return spawn_and_wait(s, timeout_ms);
}

int fs_find(const struct fs_store *s, const char *name)
{
	for (size_t i = 0; i < s->n; i++)
		if (!strcmp(s->names[i], name))
			return s->fds[i];
	return -1;
}

void fs_clear(struct fs_store *s)
{
	for (size_t i = 0; i < s->n; i++)
		close(s->fds[i]);
	s->n = 0;
}

int fs_replace(struct fs_store *s, const char *name, int fd)
{
	for (size_t i = 0; i < s->n; i++)
		if (!strcmp(s->names[i], name)) {
			close(s->fds[i]);
			s->fds[i] = fd;
			return 0;
		}
	return -ENOENT;
}
