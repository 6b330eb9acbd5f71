/* fdstore_run.c — systemd's part for one daemon outside systemd, as deploy/kvpoold.service
 * sets it up (Restart=on-failure, RestartSec=100ms, FileDescriptorStoreMax=512), for
 * deploy/run-local.sh: kvpoold killed or crashed is started again on the fds it stored, so the
 * local system keeps its KV across a kvpoold restart as the installed one does.
 *
 *	fdstore-run PIDFILE NOTIFY_SOCKET LOG -- PROGRAM [ARGS...]
 *
 * Starts PROGRAM through the fd store of fdstore.h (NOTIFY_SOCKET bound at the given path,
 * FDSTORE=512 in its environment, stdout and stderr appended to LOG), waits for its READY=1 and
 * writes its pid to PIDFILE (again after each restart). When it ends other than with exit 0 it
 * is started again 100 ms later with what it stored. SIGTERM or SIGINT is passed on to it, and
 * fdstore-run exits with its status (0 when it exited 0, 1 otherwise). Exit 2: bad usage or a
 * start that failed (a message on stderr).
 */
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fdstore.h"
#include "spawn.h"

#define START_MS 120000 /* READY=1 of a start (a pool of many GiB maps its arenas first) */

static int write_pid(const char *path, pid_t pid)
{
	char tmp[4096];
	FILE *f;

	if (snprintf(tmp, sizeof(tmp), "%s.tmp", path) >= (int)sizeof(tmp) ||
	    !(f = fopen(tmp, "w")))
		return -1;
	fprintf(f, "%d\n", (int)pid);
	if (fclose(f) != 0 || rename(tmp, path) != 0)
		return -1;
	return 0;
}

/* The daemon's status once it ended, without reaping it (fs_restart reaps); -1 while it runs. */
static int ended(pid_t pid)
{
	siginfo_t si;

	memset(&si, 0, sizeof(si));
	if (waitid(P_PID, (id_t)pid, &si, WEXITED | WNOHANG | WNOWAIT) < 0 || si.si_pid != pid)
		return -1;
	return si.si_code == CLD_EXITED ? si.si_status : 128 + si.si_status;
}

int main(int argc, char **argv)
{
	struct fs_store st;
	sigset_t set;
	int sfd, r, status;

	if (argc < 6 || strcmp(argv[4], "--")) {
		fprintf(stderr, "usage: fdstore-run PIDFILE NOTIFY_SOCKET LOG -- PROGRAM [ARGS...]\n");
		return 2;
	}
	const char *pidfile = argv[1], *notify = argv[2], *log = argv[3];
	const char *const *cmd = (const char *const *)&argv[5];

	sigemptyset(&set);
	sigaddset(&set, SIGTERM);
	sigaddset(&set, SIGINT);
	if (sigprocmask(SIG_BLOCK, &set, NULL) < 0 ||
	    (sfd = signalfd(-1, &set, SFD_CLOEXEC)) < 0) {
		fprintf(stderr, "fdstore-run: signalfd: %s\n", strerror(errno));
		return 2;
	}
	setenv("FDSTORE", "512", 1); /* what systemd sets from FileDescriptorStoreMax= */
	if ((r = fs_open(&st, notify)) < 0) {
		fprintf(stderr, "fdstore-run: %s: %s\n", notify, strerror(-r));
		return 2;
	}
	/* the daemon gets the signals unblocked, as from systemd */
	sigprocmask(SIG_UNBLOCK, &set, NULL);
	r = fs_start(&st, cmd, log, START_MS);
	sigprocmask(SIG_BLOCK, &set, NULL);
	if (r < 0 || write_pid(pidfile, st.pid) < 0) {
		fprintf(stderr, "fdstore-run: %s did not start: %s\n", cmd[0],
			r < 0 ? strerror(-r) : "cannot write the pid file");
		fs_close(&st);
		return 2;
	}
	for (;;) {
		struct pollfd p[2] = { { .fd = st.notify_fd, .events = POLLIN },
				       { .fd = sfd, .events = POLLIN } };

		if (poll(p, 2, 100) < 0 && errno != EINTR)
			break;
		if (p[0].revents & POLLIN)
			fs_pump(&st, NULL, NULL);
		if (p[1].revents & POLLIN) {
			struct signalfd_siginfo si;

			if (read(sfd, &si, sizeof(si)) != sizeof(si))
				continue;
			kill(st.pid, SIGTERM);
			status = sp_reap(st.pid, 60000);
			st.pid = 0;
			fs_close(&st);
			return status == 0 ? 0 : 1;
		}
		if ((status = ended(st.pid)) < 0)
			continue;
		if (status == 0) {
			sp_reap(st.pid, 1000);
			st.pid = 0;
			fs_close(&st);
			return 0;
		}
		fprintf(stderr, "fdstore-run: %s (pid %d) ended with status %d: restarting on its "
				"%zu stored fd(s) in 100 ms\n", cmd[0], (int)st.pid, status, st.n);
		usleep(100000);
		sigprocmask(SIG_UNBLOCK, &set, NULL);
		r = fs_restart(&st, SIGKILL, START_MS);
		sigprocmask(SIG_BLOCK, &set, NULL);
		if (r < 0 || write_pid(pidfile, st.pid) < 0) {
			fprintf(stderr, "fdstore-run: the restart of %s failed: %s\n", cmd[0],
				r < 0 ? strerror(-r) : "cannot write the pid file");
			fs_close(&st);
			return 1;
		}
	}
	fs_close(&st);
	return 1;
}
