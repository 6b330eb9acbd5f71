/* tpool.c — the pool of threads of one call's tasks (bd_tpool.h).
 *
 * A call is announced by a claim word: the call's generation above TASK_BITS, the next task
 * below. An odd generation means the call's fields are being written; the caller makes it odd,
 * writes the function, argument and task count, and makes it even with task 0. A thread claims
 * a task by compare-and-swap of the word it loaded before reading the fields: the swap succeeds
 * only while that word is still there, so the fields it read are that call's (a write of the
 * next call's fields comes after the odd word, which would have failed the swap), and the call
 * still has that task unclaimed, so it has not returned. The caller claims tasks the same way
 * and then waits only for the tasks others claimed, never for a thread that has not woken up:
 * on a machine whose cores are shared, a call does not wait for the scheduler to run an idle
 * thread. Spins before sleeping are bounded by BD_TPOOL_SPIN_US. */
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "base/bd_tpool.h"

#define TASK_BITS 24
#define TASK_MASK ((UINT64_C(1) << TASK_BITS) - 1)
#define GEN(c) ((c) >> TASK_BITS)

struct bd_tpool {
	pthread_mutex_t mu, busy; /* mu: the sleeps below; busy: held by the running call */
	pthread_cond_t work, done;
	int n_workers, sleepers; /* sleepers: threads in cond_wait(work), under mu */
	bool stop, waiting;      /* waiting: the caller is in cond_wait(done), under mu */
	unsigned forks;          /* fork_count when the threads were started */
	uint64_t claim;          /* atomic: generation << TASK_BITS | next task */
	int n_done;              /* atomic: tasks of the call finished */
	bd_tpool_fn fn;          /* the call's, written before its claim word */
	void *arg;
	int n_tasks;
	pthread_t th[BD_TPOOL_MAX_THREADS];
};

/* fork() leaves a child with none of the pool's threads: a call there runs on the caller. */
static unsigned fork_count;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void on_fork_child(void)
{
	fork_count++;
}

static void atfork_init(void)
{
	pthread_atfork(NULL, NULL, on_fork_child);
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#else
	__asm__ __volatile__("" ::: "memory");
#endif
}

static int64_t now_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static bool gen_moved(const struct bd_tpool *p, uint64_t gen)
{
	return GEN(__atomic_load_n(&p->claim, __ATOMIC_ACQUIRE)) != gen;
}

static bool all_done(const struct bd_tpool *p, uint64_t n)
{
	return (uint64_t)__atomic_load_n(&p->n_done, __ATOMIC_ACQUIRE) == n;
}

/* Spin until ready(p, v) or BD_TPOOL_SPIN_US have passed; returns whether it got ready. */
static inline bool spin(bool (*ready)(const struct bd_tpool *, uint64_t), const struct bd_tpool *p,
			uint64_t v)
{
	int64_t t0 = 0;
	for (unsigned i = 1;; i++) {
		if (ready(p, v))
			return true;
		cpu_relax();
		if ((i & 255) == 0) {
			int64_t t = now_us();
			if (!t0)
				t0 = t;
			else if (t - t0 > BD_TPOOL_SPIN_US)
				return false;
		}
	}
}

/* Claim and run tasks of the call whose claim word is c (as loaded) until it has none left or
 * a later call replaced it. Returns the generation it worked on (odd: none, the fields were
 * being written). The last task to finish wakes a caller that sleeps. */
static uint64_t take_tasks(struct bd_tpool *p, uint64_t c)
{
	uint64_t gen = GEN(c);
	if (gen & 1)
		return gen;
	for (;;) {
		bd_tpool_fn fn = __atomic_load_n(&p->fn, __ATOMIC_RELAXED);
		void *arg = __atomic_load_n(&p->arg, __ATOMIC_RELAXED);
		int n = __atomic_load_n(&p->n_tasks, __ATOMIC_RELAXED);
		__atomic_thread_fence(__ATOMIC_ACQUIRE); /* the fields before the swap below */
		if (GEN(c) != gen || (int)(c & TASK_MASK) >= n)
			return gen;
		if (!__atomic_compare_exchange_n(&p->claim, &c, c + 1, false, __ATOMIC_ACQ_REL,
						 __ATOMIC_ACQUIRE))
			continue; /* c now holds the word that is there */
		fn(arg, (int)(c & TASK_MASK));
		if (__atomic_add_fetch(&p->n_done, 1, __ATOMIC_ACQ_REL) == n) {
			pthread_mutex_lock(&p->mu);
			if (p->waiting)
				pthread_cond_signal(&p->done);
			pthread_mutex_unlock(&p->mu);
			return gen;
		}
		c = __atomic_load_n(&p->claim, __ATOMIC_ACQUIRE);
	}
}

static void *worker(void *a)
{
	struct bd_tpool *p = a;
	uint64_t seen = 0;

	for (;;) {
		if (!spin(gen_moved, p, seen)) {
			pthread_mutex_lock(&p->mu);
			while (GEN(__atomic_load_n(&p->claim, __ATOMIC_ACQUIRE)) == seen &&
			       !p->stop) {
				p->sleepers++;
				pthread_cond_wait(&p->work, &p->mu);
				p->sleepers--;
			}
			bool stop = p->stop;
			pthread_mutex_unlock(&p->mu);
			if (stop)
				return NULL;
		}
		seen = take_tasks(p, __atomic_load_n(&p->claim, __ATOMIC_ACQUIRE));
	}
}

/* Stop the threads th[0 .. n − 1] and join them. */
static void stop_join(struct bd_tpool *p, int n)
{
	pthread_mutex_lock(&p->mu);
	p->stop = true;
	pthread_cond_broadcast(&p->work);
	pthread_mutex_unlock(&p->mu);
	for (int i = 0; i < n; i++)
		pthread_join(p->th[i], NULL);
}

int bd_tpool_new(int n_threads, struct bd_tpool **ret)
{
	if (!ret || n_threads < 1 || n_threads > BD_TPOOL_MAX_THREADS)
		return -EINVAL;
	struct bd_tpool *p = calloc(1, sizeof(*p));
	if (!p)
		return -ENOMEM;
	pthread_once(&atfork_once, atfork_init);
	pthread_mutex_init(&p->mu, NULL);
	pthread_mutex_init(&p->busy, NULL);
	pthread_cond_init(&p->work, NULL);
	pthread_cond_init(&p->done, NULL);
	p->forks = __atomic_load_n(&fork_count, __ATOMIC_RELAXED);
	for (int i = 0; i < n_threads - 1; i++) {
		if (pthread_create(&p->th[i], NULL, worker, p) != 0) {
			bd_tpool_free(p); /* stops and joins the n_workers started */
			return -EAGAIN;
		}
		p->n_workers++;
	}
	*ret = p;
	return 0;
}

void bd_tpool_run(struct bd_tpool *p, bd_tpool_fn fn, void *arg, int n_tasks)
{
	if (n_tasks <= 0)
		return;
	if (!p || p->n_workers == 0 || n_tasks == 1 || (uint64_t)n_tasks > TASK_MASK ||
	    p->forks != __atomic_load_n(&fork_count, __ATOMIC_RELAXED) ||
	    pthread_mutex_trylock(&p->busy) != 0) {
		for (int t = 0; t < n_tasks; t++)
			fn(arg, t);
		return;
	}
	/* every task of the previous call is done: no thread runs one; a thread that read its
	 * word fails its swap against the odd word stored first */
	uint64_t gen = GEN(__atomic_load_n(&p->claim, __ATOMIC_RELAXED));
	__atomic_store_n(&p->claim, (gen + 1) << TASK_BITS, __ATOMIC_RELAXED);
	__atomic_thread_fence(__ATOMIC_RELEASE); /* the odd word before the fields */
	__atomic_store_n(&p->fn, fn, __ATOMIC_RELAXED);
	__atomic_store_n(&p->arg, arg, __ATOMIC_RELAXED);
	__atomic_store_n(&p->n_tasks, n_tasks, __ATOMIC_RELAXED);
	__atomic_store_n(&p->n_done, 0, __ATOMIC_RELAXED);
	uint64_t c = (gen + 2) << TASK_BITS;
	__atomic_store_n(&p->claim, c, __ATOMIC_RELEASE);
	pthread_mutex_lock(&p->mu);
	if (p->sleepers)
		pthread_cond_broadcast(&p->work);
	pthread_mutex_unlock(&p->mu);

	take_tasks(p, c);
	if (!spin(all_done, p, (uint64_t)n_tasks)) {
		pthread_mutex_lock(&p->mu);
		p->waiting = true;
		while (__atomic_load_n(&p->n_done, __ATOMIC_ACQUIRE) < n_tasks)
			pthread_cond_wait(&p->done, &p->mu);
		p->waiting = false;
		pthread_mutex_unlock(&p->mu);
	}
	pthread_mutex_unlock(&p->busy);
}

int bd_tpool_threads(const struct bd_tpool *p)
{
	return p ? p->n_workers + 1 : 1;
}

void bd_tpool_free(struct bd_tpool *p)
{
	if (!p)
		return;
	if (p->n_workers)
		stop_join(p, p->n_workers);
	pthread_mutex_destroy(&p->mu);
	pthread_mutex_destroy(&p->busy);
	pthread_cond_destroy(&p->work);
	pthread_cond_destroy(&p->done);
	free(p);
}
