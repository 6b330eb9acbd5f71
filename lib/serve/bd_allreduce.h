/* bd_allreduce.h — the shared-memory all-reduce of the CPU backend's tensor parallelism
 * (DESIGN.md "Backends": NCCL on the GPU, this between the worker processes on the CPU).
 *
 * The tp ranks map one file (a tmpfs file in the runtime directory, e.g. /run/bdfp4) holding
 * a header and, per rank, two buffers of `cap` floats used by alternate rounds. A round: each
 * rank copies its contribution into its buffer, publishes its arrival count, waits (a short
 * spin, then futex waits in slices) until every rank has arrived, and sums the buffers in rank
 * order 0, 1, …, tp−1 into its output. Every rank therefore gets the same bytes; the second
 * buffer lets a rank start the next round before the slowest has read this one.
 *
 * Liveness: each rank holds an open-file-description lock on byte `rank` of the file for as
 * long as it is open, so a peer that dies (kill -9 included) is seen at once. Ranks work in a
 * session that rank 0 starts and every rank joins (bd_allreduce_join); a dead peer, a peer
 * that left or restarted, or a timeout breaks the session: the call returns -EPIPE or
 * -ETIMEDOUT and every later round returns -EPIPE until the ranks join again.
 *
 * Every rank must make the same sequence of calls (same n) in a session. One handle per rank;
 * handles are not thread-safe, but several handles of one file may live in one process (the
 * tests run the ranks as threads).
 */
#ifndef BD_ALLREDUCE_H
#define BD_ALLREDUCE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define BD_ALLREDUCE_MAX_TP 8
#define BD_ALLREDUCE_DEFAULT_TIMEOUT_MS 30000

struct bd_allreduce;

/* Whether the directory of path may hold an all-reduce file: a directory that is not
 * world-writable (sticky or not: anyone could plant a name in it) and belongs to this process's
 * user or root. Returns 0; -EPERM (world-writable, or another user's); -ENOTDIR; -EINVAL (NULL
 * or empty path), -ENAMETOOLONG, or the -errno of stat (-ENOENT: no such directory). */
int bd_allreduce_dir_check(const char *path);

/* Opens (creating, sizing and initializing it when no other rank uses it) the region at path
 * as rank `rank` of tp (2..BD_ALLREDUCE_MAX_TP), each round carrying up to cap floats per rank
 * (1..2^26; longer sums are cut into rounds of cap). timeout_ms (> 0, or ≤ 0 for the
 * default) bounds each wait of a round. The handle starts outside any session.
 * The file holds every rank's activations, so only a private one is used: its directory must
 * pass bd_allreduce_dir_check; the first rank creates it (O_CREAT | O_EXCL | O_NOFOLLOW, mode
 * 0600), the others open it without following a symbolic link and take it only when fstat
 * shows a regular file of this user, mode 0600 or narrower, one link.
 * Returns 0 and *ret; -EINVAL (bad argument; or a live rank uses the file with another tp or
 * cap), -EPERM (the directory: world-writable or another user's), -ELOOP (path is a symbolic
 * link), -EACCES (an existing file of another user, with group or other access, or not a
 * regular file), -EBUSY (rank `rank` is already open, alive, elsewhere), -ENOMEM, or the
 * -errno of open/ftruncate/mmap/fcntl. */
int bd_allreduce_open(const char *path, int rank, int tp, size_t cap, int timeout_ms,
		      struct bd_allreduce **ret);

/* Leaves the session (peers' rounds then fail with -EPIPE), unmaps and closes. The file stays.
 * NULL is accepted. */
void bd_allreduce_close(struct bd_allreduce *ar);

/* Starts (rank 0) or joins (other ranks) a session of all tp ranks, waiting up to timeout_ms
 * (≤ 0: wait for the handle's timeout) for the others. Returns 0 once every rank is in the
 * session, -ETIMEDOUT (call again to keep waiting: the attempt goes on), -EINVAL (NULL).
 * Calling it in a healthy session leaves that session and starts a new one. */
int bd_allreduce_join(struct bd_allreduce *ar, int timeout_ms);

/* 0 while the session is whole (every peer alive and in it), -EPIPE when it is broken (also
 * before the first join), -EINVAL (NULL). Cheap; daemons poll it between steps. */
int bd_allreduce_check(struct bd_allreduce *ar);

/* Sums buf[0..n) over the ranks in place: buf_i ← Σ_r buf_i(rank r), added in rank order in
 * FP32, the same bytes on every rank. n = 0 is a barrier. Returns 0; -EINVAL (NULL buf with
 * n > 0, NULL handle); -EPIPE (no session, or a peer died, left or restarted); -ETIMEDOUT (a
 * peer did not arrive within the timeout). On error the session is broken and buf is unchanged
 * when n ≤ cap (longer sums keep the rounds that completed). */
int bd_allreduce_sum(struct bd_allreduce *ar, float *buf, size_t n);

/* bd_allreduce_sum with the handle as a void * context: the shape of the model's all-reduce
 * callback (bd_model.h bd_model_allreduce_fn). */
int bd_allreduce_model_cb(void *ar, float *buf, size_t n);

/* The rank and number of ranks of the handle (-EINVAL for NULL). */
int bd_allreduce_rank(const struct bd_allreduce *ar);
int bd_allreduce_tp(const struct bd_allreduce *ar);

#ifdef __cplusplus
}
#endif
#endif
