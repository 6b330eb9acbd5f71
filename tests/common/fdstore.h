/* fdstore.h — systemd's part in a daemon's restart, played by a test: the daemon's NOTIFY_SOCKET,
 * which keeps the fds sent to it with FDSTORE=1 (by FDNAME=, dropping them on FDSTOREREMOVE=1),
 * and a start that hands them back as systemd does: the fds at 3, 4, ... and LISTEN_FDS,
 * LISTEN_PID and LISTEN_FDNAMES (sd_listen_fds_with_names). So a kvpoold SIGKILLed and started
 * again through it finds its arenas and its state, as under systemd with Restart=on-failure.
 *
 * Plain C (no Criterion), like spawn.h; every wait is bounded; the daemon gets SIGKILL when the
 * test process dies (PR_SET_PDEATHSIG).
 *
 * Usage:
 *
 *	struct fs_store st;
 *	fs_open(&st, "/tmp/dir/notify.sock");            // the daemon's NOTIFY_SOCKET
 *	fs_start(&st, argv, "/tmp/dir/kvpoold.log", 20000); // spawned, READY=1 seen; fds kept
 *	... st.pid is the daemon (a serving test sets E.pool.pid = st.pid for sv_fini) ...
 *	fs_restart(&st, SIGKILL, 20000);                 // killed, reaped, started with the fds
 *	fs_close(&st);                                   // kills what runs, closes every fd
 *
 * fs_start and fs_restart keep reading the notify socket until READY=1; in between, fs_pump
 * reads what is queued (a daemon blocks in sd_notify once its datagram queue is full: a test
 * that runs one for long with STATUS lines pumps now and then).
 */
#ifndef TEST_FDSTORE_H
#define TEST_FDSTORE_H

#include <stdbool.h>
#include <sys/types.h>

#define FS_MAX_FDS 256
#define FS_MAX_ARGS 64

struct fs_store {
	int notify_fd;
	char path[108];
	pid_t pid;                  /* the daemon, 0: none */
	size_t n;                   /* fds kept */
	int fds[FS_MAX_FDS];
	char names[FS_MAX_FDS][64]; /* FDNAME= of each ("stored" when it named none) */
	unsigned removed;           /* FDSTOREREMOVE=1 messages seen */
	char *argv[FS_MAX_ARGS + 1], *log; /* of the last fs_start, for fs_restart */
};

/* Binds the notify socket at path (a stale file there is removed); no fds, no daemon. Returns
 * 0 or -errno. */
int fs_open(struct fs_store *s, const char *path);

/* Kills the daemon if one runs (SIGKILL, reaped), closes every kept fd and the socket. */
void fs_close(struct fs_store *s);

/* Spawns argv (argv[0] the program, NULL-terminated) with NOTIFY_SOCKET = the store, stdout
 * and stderr appended to log (NULL: inherited), the kept fds passed as systemd passes them (none
 * kept: no LISTEN_* variables), and waits up to timeout_ms for READY=1, keeping what it stores
 * meanwhile. Returns 0 (s->pid runs); -ECHILD when it exited first (reaped, s->pid 0);
 * -ETIMEDOUT (s->pid still runs); -errno of fork. */
int fs_start(struct fs_store *s, const char *const *argv, const char *log, int timeout_ms);

/* Sends sig to the daemon, reaps it (SIGKILL after timeout_ms), reads what it stored before it
 * died, and starts it again with the argv and log of the last fs_start: fs_start's returns. */
int fs_restart(struct fs_store *s, int sig, int timeout_ms);

/* Reads every datagram queued on the notify socket (fds kept or dropped as systemd does). Returns
 * the number read; *saw (may be NULL) is set when one of them contains what (may be NULL). */
int fs_pump(struct fs_store *s, const char *what, bool *saw);

/* The kept fd named name (the first of that name), or -1. It stays the store's. */
int fs_find(const struct fs_store *s, const char *name);

/* Closes every kept fd, as a service manager does whose fd store was emptied (systemctl clean
 * --what=fdstore): the next start gets no LISTEN_FDS. */
void fs_clear(struct fs_store *s);

/* Puts fd (taken over) in place of the kept fd named name, which is closed: a test's way to hand
 * a restarted daemon something else than what it stored. Returns 0 or -ENOENT. */
int fs_replace(struct fs_store *s, const char *name, int fd);

#endif
