/* test_tpool.c — bd_tpool.h: every task of every call runs exactly once, whatever the thread
 * count, with two callers at once, from inside a task and in a child after fork(); the
 * refusals. Suite "tpool".
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <criterion/criterion.h>

#include "base/bd_tpool.h"

#define MAX_TASKS 1000

struct count {
	int runs[MAX_TASKS]; /* atomic */
	int n;
};

static void count_task(void *arg, int t)
{
	struct count *c = arg;
	if (t >= 0 && t < c->n)
		__atomic_add_fetch(&c->runs[t], 1, __ATOMIC_RELAXED);
	else
		__atomic_add_fetch(&c->runs[0], 1000000, __ATOMIC_RELAXED); /* out of range */
}

/* `calls` calls of n tasks on p; returns how many (call, task) pairs did not run once. */
static int run_calls(struct bd_tpool *p, int n, int calls)
{
	struct count *c = calloc(1, sizeof(*c));
	int bad = 0;
	cr_assert_not_null(c);
	c->n = n;
	for (int k = 0; k < calls; k++) {
		memset(c->runs, 0, sizeof(c->runs));
		bd_tpool_run(p, count_task, c, n);
		for (int t = 0; t < (n > 0 ? n : 1); t++)
			bad += n > 0 ? c->runs[t] != 1 : c->runs[t] != 0;
	}
	free(c);
	return bad;
}

Test(tpool, every_task_once)
{
	static const int ns[] = { 0, 1, 2, 3, 7, 64, MAX_TASKS };
	for (int th = 1; th <= 4; th++) {
		struct bd_tpool *p = NULL;
		cr_assert_eq(bd_tpool_new(th, &p), 0);
		cr_assert_eq(bd_tpool_threads(p), th);
		for (size_t i = 0; i < sizeof(ns) / sizeof(ns[0]); i++)
			cr_expect_eq(run_calls(p, ns[i], 300), 0, "%d threads, %d tasks", th, ns[i]);
		bd_tpool_free(p);
	}
	/* no pool: all on the caller */
	cr_expect_eq(bd_tpool_threads(NULL), 1);
	cr_expect_eq(run_calls(NULL, 64, 3), 0);
}

struct caller {
	struct bd_tpool *p;
	int bad;
};

static void *caller_main(void *a)
{
	struct caller *c = a;
	c->bad = run_calls(c->p, 37, 2000);
	return NULL;
}

/* Two threads call one pool at once: one of them runs its call itself; neither loses a task. */
Test(tpool, two_callers_at_once)
{
	struct bd_tpool *p = NULL;
	cr_assert_eq(bd_tpool_new(3, &p), 0);
	struct caller c[2] = { { p, -1 }, { p, -1 } };
	pthread_t t;
	cr_assert_eq(pthread_create(&t, NULL, caller_main, &c[1]), 0);
	caller_main(&c[0]);
	pthread_join(t, NULL);
	cr_expect_eq(c[0].bad, 0);
	cr_expect_eq(c[1].bad, 0);
	bd_tpool_free(p);
}

struct nest {
	struct bd_tpool *p;
	struct count inner[8];
};

static void nest_task(void *arg, int t)
{
	struct nest *n = arg;
	n->inner[t].n = 5;
	bd_tpool_run(n->p, count_task, &n->inner[t], 5);
}

/* A task that calls the pool it runs on gets its call run on its own thread. */
Test(tpool, call_from_inside_a_task)
{
	struct bd_tpool *p = NULL;
	struct nest *n = calloc(1, sizeof(*n));
	cr_assert_not_null(n);
	cr_assert_eq(bd_tpool_new(2, &p), 0);
	n->p = p;
	bd_tpool_run(p, nest_task, n, 8);
	for (int t = 0; t < 8; t++)
		for (int i = 0; i < 5; i++)
			cr_expect_eq(n->inner[t].runs[i], 1, "task %d, inner %d", t, i);
	bd_tpool_free(p);
	free(n);
}

/* The child of fork() has none of the pool's threads; its calls run all their tasks. */
Test(tpool, child_after_fork)
{
	struct bd_tpool *p = NULL;
	cr_assert_eq(bd_tpool_new(2, &p), 0);
	cr_assert_eq(run_calls(p, 16, 10), 0);
	pid_t pid = fork();
	cr_assert_geq(pid, 0);
	if (pid == 0)
		_exit(run_calls(p, 16, 100) == 0 ? 0 : 1);
	int st = 0;
	cr_assert_eq(waitpid(pid, &st, 0), pid);
	cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the child lost tasks");
	cr_expect_eq(run_calls(p, 16, 10), 0);
	bd_tpool_free(p);
}

Test(tpool, refusals)
{
	struct bd_tpool *p = (struct bd_tpool *)&p;
	cr_expect_eq(bd_tpool_new(0, &p), -EINVAL);
	cr_expect_eq(bd_tpool_new(BD_TPOOL_MAX_THREADS + 1, &p), -EINVAL);
	cr_expect_eq(bd_tpool_new(2, NULL), -EINVAL);
	cr_expect_eq(p, (struct bd_tpool *)&p, "*ret written on error");
	bd_tpool_free(NULL);
}
