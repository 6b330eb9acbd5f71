/* spawn.c — a daemon started by a test and waited for (spawn.h). */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/bd_clock.h"
#include "base/bd_ipc.h"
#include "spawn.h"

int sp_notify_open(const char *path)
{
	if (!path || strlen(path) >= sizeof(((struct sockaddr_un *)0)->sun_path))
		return -ENAMETOOLONG;
	unlink(path);
	return bd_ipc_bind(path, SOCK_DGRAM | SOCK_CLOEXEC);
}

pid_t sp_spawn(const char *const *argv, const char *log, const char *notify,
	       const char *env_extra)
{
	pid_t pid;

	fflush(NULL);
	pid = fork();
	if (pid < 0)
		return -errno;
	if (pid > 0)
		return pid;
	prctl(PR_SET_PDEATHSIG, SIGKILL);
	if (log) {
		int fd = open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);

		if (fd >= 0) {
			dup2(fd, 1);
			dup2(fd, 2);
		}
	}
	if (notify)
		setenv("NOTIFY_SOCKET", notify, 1);
	else
		unsetenv("NOTIFY_SOCKET");
	unsetenv("WATCHDOG_USEC");
	unsetenv("WATCHDOG_PID");
	unsetenv("JOURNAL_STREAM");
	if (env_extra)
		putenv((char *)env_extra);
	execv(argv[0], (char *const *)argv);
	_exit(127);
}

bool sp_wait_notify(int notify_fd, pid_t *pid, const char *what, int timeout_ms)
{
	int64_t end = bd_now_ms() + timeout_ms;
	char buf[1024];

	while (bd_now_ms() < end) {
		struct pollfd p = { .fd = notify_fd, .events = POLLIN };

		if (poll(&p, 1, 50) == 1) {
			ssize_t n = recv(notify_fd, buf, sizeof(buf) - 1, 0);

			if (n > 0) {
				buf[n] = 0;
				if (strstr(buf, what))
					return true;
			}
			continue;
		}
		if (pid && *pid > 0 && waitpid(*pid, NULL, WNOHANG) == *pid) {
			*pid = 0;
			return false;
		}
	}
	return false;
}

int sp_reap(pid_t pid, int timeout_ms)
{
	int64_t end = bd_now_ms() + timeout_ms;
	int st;

	while (bd_now_ms() < end) {
		if (waitpid(pid, &st, WNOHANG) == pid)
			return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
		usleep(10000);
	}
	kill(pid, SIGKILL);
	waitpid(pid, &st, 0);
	return -1;
}
