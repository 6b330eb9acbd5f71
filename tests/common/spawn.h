/* spawn.h — a daemon started by a test and waited for: its readiness by sd_notify on a
 * private datagram socket, bounded waits, its exit status.
 *
 * Plain C (no Criterion), so that both the unit suite (tests/kvpoold) and the GPU checks
 * (tests/gpu/pool_vmm_check.c) use it. Every wait is bounded; a child dies with the process
 * that started it (PR_SET_PDEATHSIG).
 */
#ifndef TEST_SPAWN_H
#define TEST_SPAWN_H

#include <stdbool.h>
#include <sys/types.h>

/* Binds a datagram socket at path (removing a stale file there) to stand for systemd's
 * NOTIFY_SOCKET. Returns the fd (close-on-exec) or -errno (-ENAMETOOLONG for a path longer
 * than sun_path). */
int sp_notify_open(const char *path);

/* Forks and execs argv[0] with argv (NULL-terminated): stdout and stderr appended to log
 * (NULL: inherited), NOTIFY_SOCKET=notify (NULL: unset), no watchdog or journal variables,
 * env_extra (one NAME=VALUE, may be NULL) added; the child gets SIGKILL when its parent dies.
 * stdio is flushed first, so nothing buffered is written twice. Returns the child's pid or
 * -errno of fork. */
pid_t sp_spawn(const char *const *argv, const char *log, const char *notify,
	       const char *env_extra);

/* Waits up to timeout_ms for a datagram on notify_fd that contains `what` ("READY=1").
 * Returns true when one came; false on timeout, or when the process *pid exits first (it is
 * reaped and *pid set to 0). pid may be NULL or point to 0: then only the time bounds it. */
bool sp_wait_notify(int notify_fd, pid_t *pid, const char *what, int timeout_ms);

/* Waits up to timeout_ms for pid to end: its exit status, or 128 + the signal that killed it;
 * -1 when it had to be SIGKILLed at the deadline (and is reaped then). */
int sp_reap(pid_t pid, int timeout_ms);

#endif
