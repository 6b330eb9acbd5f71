/* bd_tpool.h — a pool of threads that share out the tasks of one call (the CPU model's weight
 * products and decode attention).
 *
 * bd_tpool_run(p, fn, arg, n) calls fn(arg, t) once for each t in 0 .. n − 1 and returns when
 * all have returned: the calling thread takes tasks too, the pool's threads take the others,
 * each the next one not yet taken. Which thread runs a task, and in which order, is not fixed,
 * so a task must not depend on it: when each task writes only its own outputs with its own
 * arithmetic, the result is the same bits whatever the thread count.
 *
 * Idle threads sleep on a condition variable. After a call, a thread watches for the next one
 * for at most BD_TPOOL_SPIN_US microseconds (a decode step makes its calls microseconds apart,
 * and a wake-up through the kernel costs about as much as a small product) and then sleeps, so
 * a pool between steps takes no CPU from OpenBLAS's threads or another process.
 *
 * A call made while the pool runs another (from a second thread, or from inside a task), in a
 * child after fork(), or on a NULL pool runs all its tasks on the calling thread: the same
 * results, without waiting for the pool.
 */
#ifndef BD_TPOOL_H
#define BD_TPOOL_H

#ifdef __cplusplus
extern "C" {
#endif

#define BD_TPOOL_MAX_THREADS 64
#define BD_TPOOL_SPIN_US 50

struct bd_tpool;

/* One task: t in 0 .. n_tasks − 1 of the call, arg the call's. */
typedef void (*bd_tpool_fn)(void *arg, int t);

/* A pool of n_threads threads in all, the caller's included (n_threads − 1 are started; 1
 * starts none and every call runs on its caller). Returns 0, -EINVAL (n_threads outside
 * 1..BD_TPOOL_MAX_THREADS, ret NULL), -ENOMEM, -EAGAIN (a thread could not be started; none
 * is left running); *ret only on success. */
int bd_tpool_new(int n_threads, struct bd_tpool **ret);

/* fn(arg, t) for t in 0 .. n_tasks − 1 on the pool's threads and this one (see the file
 * comment); n_tasks ≤ 0 calls nothing. p may be NULL (all on this thread). Thread-safe. */
void bd_tpool_run(struct bd_tpool *p, bd_tpool_fn fn, void *arg, int n_tasks);

/* Threads a call can use, the caller's included: n_threads of bd_tpool_new, 1 for NULL. */
int bd_tpool_threads(const struct bd_tpool *p);

/* Stop and join the threads and free the pool; no call may be running. NULL is a no-op. */
void bd_tpool_free(struct bd_tpool *p);

#ifdef __cplusplus
}
#endif
#endif
