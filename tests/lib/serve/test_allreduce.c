/* test_allreduce.c — bd_allreduce.h: the shared-memory all-reduce of the CPU backend's TP.
 * Suite "allreduce".
 *
 * Ranks run as threads (each with its own handle on one file, as two processes would have) or
 * as forked processes where death matters. Exactness: integers below 2^24 are exact in FP32,
 * so their sums must be exact; random floats are checked against the FP32 sum in rank order
 * (bitwise: the contract fixes that order) and against the FP64 sum (error ≤ (tp−1)·u·Σ|x|,
 * u = 2^−24, the bound of recursive summation).
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <criterion/criterion.h>

#include "base/bd_clock.h"
#include "serve/bd_allreduce.h"
#include "ar_file.h"


/* xorshift64*: the test's own inputs */
static uint64_t rng_next(uint64_t *s)
{
	*s ^= *s >> 12;
	*s ^= *s << 25;
	*s ^= *s >> 27;
	return *s * 0x2545f4914f6cdd1dull;
}

static float rng_float(uint64_t *s)
{
	/* spread over several binades, both signs */
	double u = (double)(rng_next(s) >> 11) / 9007199254740992.0;
	double e = (double)(rng_next(s) % 16) - 8.0;
	return (float)((u - 0.5) * ldexp(1.0, (int)e));
}

struct rank_job {
	int rank, tp, rounds;
	size_t cap, n;
	const float *in;  /* [rounds][n] this rank's inputs */
	float *out;       /* [rounds][n] what it got back */
	int join_rc, rc;
};

static void *rank_main(void *arg)
{
	struct rank_job *j = arg;
	struct bd_allreduce *ar = NULL;
	j->rc = bd_allreduce_open(ar_path, j->rank, j->tp, j->cap, 20000, &ar);
	if (j->rc < 0)
		return NULL;
	j->join_rc = bd_allreduce_join(ar, 20000);
	for (int r = 0; r < j->rounds && j->join_rc == 0 && j->rc == 0; r++) {
		float *o = j->out + (size_t)r * j->n;
		memcpy(o, j->in + (size_t)r * j->n, sizeof(float) * j->n);
		j->rc = bd_allreduce_sum(ar, o, j->n);
	}
	bd_allreduce_close(ar);
	return NULL;
}

/* Run tp ranks as threads over in[rank][rounds][n]; out likewise. */
static void run_ranks(int tp, size_t cap, size_t n, int rounds, float **in, float **out)
{
	pthread_t th[BD_ALLREDUCE_MAX_TP];
	struct rank_job jobs[BD_ALLREDUCE_MAX_TP];
	for (int r = 0; r < tp; r++) {
		jobs[r] = (struct rank_job){ .rank = r, .tp = tp, .rounds = rounds, .cap = cap,
					     .n = n, .in = in[r], .out = out[r] };
		cr_assert_eq(pthread_create(&th[r], NULL, rank_main, &jobs[r]), 0);
	}
	for (int r = 0; r < tp; r++) {
		pthread_join(th[r], NULL);
		cr_assert_eq(jobs[r].rc, 0, "rank %d: %d", r, jobs[r].rc);
		cr_assert_eq(jobs[r].join_rc, 0, "rank %d join: %d", r, jobs[r].join_rc);
	}
}

TestSuite(allreduce, .init = ar_file_setup, .fini = ar_file_teardown, .timeout = 120);

/* Integers: every sum exact, every rank the same; 300 rounds alternate the two buffers, and a
 * length of 2.5 caps cuts each sum into three rounds. */
Test(allreduce, integer_sums_exact_two_ranks)
{
	const int rounds = 300;
	const size_t cap = 64, n = 160;
	float *in[2], *out[2];
	for (int r = 0; r < 2; r++) {
		in[r] = malloc(sizeof(float) * rounds * n);
		out[r] = malloc(sizeof(float) * rounds * n);
		for (size_t i = 0; i < rounds * n; i++)
			/* rank 0: i, rank 1: −3i + 7 (sum −2i + 7), all below 2^24 */
			in[r][i] = r == 0 ? (float)i : (float)(7 - 3 * (long)i);
	}
	run_ranks(2, cap, n, rounds, in, out);
	for (size_t i = 0; i < rounds * n; i++) {
		float want = (float)(7 - 2 * (long)i);
		cr_assert_eq(out[0][i], want, "element %zu: %g, want %g", i, out[0][i], want);
		cr_assert_eq(memcmp(&out[0][i], &out[1][i], sizeof(float)), 0);
	}
	for (int r = 0; r < 2; r++) {
		free(in[r]);
		free(out[r]);
	}
}

/* Three ranks, random floats: rank order (b0 + b1) + b2 bit for bit on every rank, within the
 * recursive-summation bound of the FP64 sum. */
Test(allreduce, float_sums_rank_order_three_ranks)
{
	const int tp = 3, rounds = 20;
	const size_t cap = 1000, n = 1000;
	float *in[3], *out[3];
	uint64_t seed = 0x9e3779b97f4a7c15ull;
	for (int r = 0; r < tp; r++) {
		in[r] = malloc(sizeof(float) * rounds * n);
		out[r] = malloc(sizeof(float) * rounds * n);
		for (size_t i = 0; i < rounds * n; i++)
			in[r][i] = rng_float(&seed);
	}
	run_ranks(tp, cap, n, rounds, in, out);
	const double u = ldexp(1.0, -24);
	int order_matters = 0;
	for (size_t i = 0; i < rounds * n; i++) {
		float a = in[0][i], b = in[1][i], c = in[2][i];
		volatile float ab = a + b;
		float want = ab + c;
		volatile float cb = c + b;
		if ((float)(cb + a) != want)
			order_matters++;
		for (int r = 0; r < tp; r++)
			cr_assert_eq(memcmp(&out[r][i], &want, sizeof(float)), 0,
				     "rank %d element %zu: %a, want %a", r, i, out[r][i], want);
		double exact = (double)a + (double)b + (double)c;
		double bound = 2.0 * u * (fabs(a) + fabs(b) + fabs(c));
		cr_assert_leq(fabs((double)out[0][i] - exact), bound);
	}
	/* the inputs do tell the orders apart, so the bitwise check above means something */
	cr_assert_gt(order_matters, 0);
	for (int r = 0; r < tp; r++) {
		free(in[r]);
		free(out[r]);
	}
}

Test(allreduce, bad_arguments_leave_nothing)
{
	struct bd_allreduce *ar = (struct bd_allreduce *)0x1, *a0 = NULL;
	cr_assert_eq(bd_allreduce_open(NULL, 0, 2, 16, 0, &ar), -EINVAL);
	cr_assert_eq(bd_allreduce_open(ar_path, 0, 1, 16, 0, &ar), -EINVAL);
	cr_assert_eq(bd_allreduce_open(ar_path, 2, 2, 16, 0, &ar), -EINVAL);
	cr_assert_eq(bd_allreduce_open(ar_path, -1, 2, 16, 0, &ar), -EINVAL);
	cr_assert_eq(bd_allreduce_open(ar_path, 0, BD_ALLREDUCE_MAX_TP + 1, 16, 0, &ar), -EINVAL);
	cr_assert_eq(bd_allreduce_open(ar_path, 0, 2, 0, 0, &ar), -EINVAL);
	cr_assert_eq(bd_allreduce_open(ar_path, 0, 2, 16, 0, NULL), -EINVAL);
	cr_assert_eq(ar, (struct bd_allreduce *)0x1);
	cr_assert_eq(access(ar_path, F_OK), -1, "a refused open created the file");

	cr_assert_eq(bd_allreduce_open(ar_path, 0, 2, 16, 0, &a0), 0);
	cr_assert_eq(bd_allreduce_rank(a0), 0);
	cr_assert_eq(bd_allreduce_tp(a0), 2);
	/* the same rank twice while the first is open */
	cr_assert_eq(bd_allreduce_open(ar_path, 0, 2, 16, 0, &ar), -EBUSY);
	/* another geometry while a rank lives */
	cr_assert_eq(bd_allreduce_open(ar_path, 1, 2, 32, 0, &ar), -EINVAL);
	cr_assert_eq(bd_allreduce_open(ar_path, 1, 3, 16, 0, &ar), -EINVAL);
	cr_assert_eq(ar, (struct bd_allreduce *)0x1);

	/* no session yet: rounds refused, the buffer untouched */
	float buf[4] = { 1, 2, 3, 4 };
	cr_assert_eq(bd_allreduce_sum(a0, buf, 4), -EPIPE);
	cr_assert_eq(bd_allreduce_check(a0), -EPIPE);
	cr_assert(buf[0] == 1 && buf[1] == 2 && buf[2] == 3 && buf[3] == 4);
	cr_assert_eq(bd_allreduce_sum(a0, NULL, 4), -EINVAL);
	cr_assert_eq(bd_allreduce_sum(NULL, buf, 4), -EINVAL);
	cr_assert_eq(bd_allreduce_join(NULL, 10), -EINVAL);
	cr_assert_eq(bd_allreduce_check(NULL), -EINVAL);
	cr_assert_eq(bd_allreduce_rank(NULL), -EINVAL);

	/* nobody to join: a bounded wait */
	int64_t t0 = bd_now_ms();
	cr_assert_eq(bd_allreduce_join(a0, 100), -ETIMEDOUT);
	cr_assert_lt(bd_now_ms() - t0, 2000);
	bd_allreduce_close(a0);
	bd_allreduce_close(NULL);

	/* with no live rank, a new geometry re-initializes the file */
	cr_assert_eq(bd_allreduce_open(ar_path, 1, 2, 32, 0, &a0), 0);
	bd_allreduce_close(a0);
}

/* A peer that is alive but never comes: -ETIMEDOUT after about the timeout, then -EPIPE. */
Test(allreduce, silent_peer_times_out)
{
	struct bd_allreduce *a0, *a1;
	cr_assert_eq(bd_allreduce_open(ar_path, 0, 2, 8, 300, &a0), 0);
	cr_assert_eq(bd_allreduce_open(ar_path, 1, 2, 8, 300, &a1), 0);
	/* join from one thread: alternate short attempts until both are in */
	int j0 = -ETIMEDOUT, j1 = -ETIMEDOUT;
	for (int i = 0; i < 200 && (j0 || j1); i++) {
		if (j0)
			j0 = bd_allreduce_join(a0, 5);
		if (j1)
			j1 = bd_allreduce_join(a1, 5);
	}
	cr_assert_eq(j0, 0);
	cr_assert_eq(j1, 0);
	cr_assert_eq(bd_allreduce_check(a0), 0);

	float buf[3] = { 1, 2, 3 };
	int64_t t0 = bd_now_ms();
	cr_assert_eq(bd_allreduce_sum(a0, buf, 3), -ETIMEDOUT);
	int64_t dt = bd_now_ms() - t0;
	cr_assert(dt >= 250 && dt < 5000, "waited %lld ms for a 300 ms timeout", (long long)dt);
	cr_assert(buf[0] == 1 && buf[1] == 2 && buf[2] == 3, "a failed round changed the buffer");
	cr_assert_eq(bd_allreduce_sum(a0, buf, 3), -EPIPE);
	/* the other side sees the broken session at once instead of waiting */
	t0 = bd_now_ms();
	cr_assert_eq(bd_allreduce_sum(a1, buf, 3), -EPIPE);
	cr_assert_lt(bd_now_ms() - t0, 250);
	bd_allreduce_close(a0);
	bd_allreduce_close(a1);
}

/* Fork rank 1; it joins, does `rounds` rounds of [1, 2] and then, per mode, exits or waits to
 * be killed. Returns its pid. */
static pid_t fork_peer(int rounds, bool wait_forever)
{
	pid_t pid = fork();
	cr_assert_neq(pid, -1);
	if (pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		struct bd_allreduce *ar;
		if (bd_allreduce_open(ar_path, 1, 2, 8, 20000, &ar) < 0 ||
		    bd_allreduce_join(ar, 20000) < 0)
			_exit(3);
		for (int i = 0; i < rounds; i++) {
			float b[2] = { 1, 2 };
			if (bd_allreduce_sum(ar, b, 2) < 0)
				_exit(4);
		}
		if (wait_forever)
			for (;;)
				pause();
		_exit(0); /* no close: the kernel drops its lock as it would for a crash */
	}
	return pid;
}

/* A peer that dies (exit without closing, then kill -9 mid-wait): the survivor's round fails
 * with -EPIPE long before its 20 s timeout; a restarted peer joins a new session. */
Test(allreduce, dead_peer_fails_fast_and_rejoin_works)
{
	struct bd_allreduce *a0;
	cr_assert_eq(bd_allreduce_open(ar_path, 0, 2, 8, 20000, &a0), 0);

	pid_t pid = fork_peer(1, false);
	cr_assert_eq(bd_allreduce_join(a0, 20000), 0);
	float b[2] = { 10, 20 };
	cr_assert_eq(bd_allreduce_sum(a0, b, 2), 0);
	cr_assert(b[0] == 11 && b[1] == 22);
	int st;
	cr_assert_eq(waitpid(pid, &st, 0), pid);
	cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
	int64_t t0 = bd_now_ms();
	b[0] = 5;
	cr_assert_eq(bd_allreduce_sum(a0, b, 2), -EPIPE);
	cr_assert_lt(bd_now_ms() - t0, 2000);
	cr_assert_eq(b[0], 5);

	/* a new incarnation: both join again; then kill -9 while rank 0 waits in a round */
	pid = fork_peer(2, true);
	cr_assert_eq(bd_allreduce_join(a0, 20000), 0);
	for (int i = 0; i < 2; i++) {
		b[0] = 1;
		b[1] = 1;
		cr_assert_eq(bd_allreduce_sum(a0, b, 2), 0);
		cr_assert(b[0] == 2 && b[1] == 3);
	}
	/* the peer now sits in pause(): kill it 200 ms into our wait */
	pid_t killer = fork();
	cr_assert_neq(killer, -1);
	if (killer == 0) {
		usleep(200000);
		kill(pid, SIGKILL);
		_exit(0);
	}
	t0 = bd_now_ms();
	cr_assert_eq(bd_allreduce_sum(a0, b, 2), -EPIPE);
	int64_t dt = bd_now_ms() - t0;
	cr_assert(dt >= 150 && dt < 3000, "dead peer seen after %lld ms", (long long)dt);
	waitpid(killer, &st, 0);
	cr_assert_eq(waitpid(pid, &st, 0), pid);
	cr_assert(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
	bd_allreduce_close(a0);
}

/* n = 0 is a barrier: it completes only when both ranks arrive. */
struct barrier_job {
	int64_t arrived_ms;
	int rc;
};

static void *late_rank1(void *arg)
{
	struct barrier_job *j = arg;
	struct bd_allreduce *ar = NULL;
	j->rc = bd_allreduce_open(ar_path, 1, 2, 4, 10000, &ar);
	if (j->rc == 0 && (j->rc = bd_allreduce_join(ar, 10000)) == 0) {
		usleep(300000);
		j->arrived_ms = bd_now_ms();
		j->rc = bd_allreduce_sum(ar, NULL, 0);
	}
	bd_allreduce_close(ar);
	return NULL;
}

Test(allreduce, empty_sum_is_a_barrier)
{
	struct bd_allreduce *a0;
	struct barrier_job j = { 0 };
	pthread_t th;
	cr_assert_eq(bd_allreduce_open(ar_path, 0, 2, 4, 10000, &a0), 0);
	cr_assert_eq(pthread_create(&th, NULL, late_rank1, &j), 0);
	cr_assert_eq(bd_allreduce_join(a0, 10000), 0);
	int rc = bd_allreduce_sum(a0, NULL, 0);
	cr_assert_eq(rc, 0, "barrier: %d", rc);
	int64_t done = bd_now_ms();
	pthread_join(th, NULL);
	cr_assert_eq(j.rc, 0);
	cr_assert_geq(done, j.arrived_ms, "the barrier let rank 0 through before rank 1 came");
	bd_allreduce_close(a0);
}

/* A peer that holds its rank lock but has not initialized the file yet (it is waiting for the
 * init lock) is no reason to refuse: the empty file is new, the first to get the init lock
 * initializes it. (Seen as a race between two workerd starting together.) */
Test(allreduce, empty_file_with_a_live_peer_is_initialized)
{
	int fd = open(ar_path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
	cr_assert_geq(fd, 0);
	struct flock fl = { .l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1 };
	cr_assert_eq(fcntl(fd, F_OFD_SETLK, &fl), 0); /* "rank 0", alive, mid-open */
	struct bd_allreduce *a1;
	cr_assert_eq(bd_allreduce_open(ar_path, 1, 2, 16, 1000, &a1), 0);
	/* now the header is there: another geometry is refused while "rank 0" lives */
	struct bd_allreduce *a1b = (void *)0x1;
	bd_allreduce_close(a1);
	cr_assert_eq(bd_allreduce_open(ar_path, 1, 2, 32, 1000, &a1b), -EINVAL);
	cr_assert_eq(a1b, (void *)0x1);
	close(fd);
}

/* The directory of ar_path (the test's own, mode 0700). */
static void ar_dir(char *buf, size_t cap)
{
	snprintf(buf, cap, "%s", ar_path);
	*strrchr(buf, '/') = 0;
}

/* A symbolic link planted at the path (another user's trick to make a worker overwrite a file
 * it may write) is refused, and the file it points at keeps its bytes. */
Test(allreduce, symlink_path_is_refused)
{
	char dir[96], target[128], buf[8] = { 0 };
	struct bd_allreduce *ar = (void *)0x1;
	int fd;

	ar_dir(dir, sizeof(dir));
	snprintf(target, sizeof(target), "%s/victim", dir);
	fd = open(target, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
	cr_assert_geq(fd, 0);
	cr_assert_eq(write(fd, "precious", 8), 8);
	close(fd);
	cr_assert_eq(symlink(target, ar_path), 0);
	cr_assert_eq(bd_allreduce_open(ar_path, 0, 2, 16, 0, &ar), -ELOOP);
	cr_assert_eq(bd_allreduce_open(ar_path, 1, 2, 16, 0, &ar), -ELOOP);
	cr_assert_eq(ar, (void *)0x1);
	fd = open(target, O_RDONLY | O_CLOEXEC);
	cr_assert_eq(read(fd, buf, 8), 8);
	close(fd);
	cr_assert_eq(memcmp(buf, "precious", 8), 0, "the link's target was written");
}

/* A file someone made beforehand with access for others (0666), or one of another user, is
 * not taken: another rank of this user creates it 0600. */
Test(allreduce, precreated_file_is_refused)
{
	struct bd_allreduce *ar = (void *)0x1;
	struct stat st;
	int fd = open(ar_path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);

	cr_assert_geq(fd, 0);
	cr_assert_eq(fchmod(fd, 0666), 0);
	cr_assert_eq(bd_allreduce_open(ar_path, 0, 2, 16, 0, &ar), -EACCES);
	cr_assert_eq(fchmod(fd, 0640), 0);
	cr_assert_eq(bd_allreduce_open(ar_path, 1, 2, 16, 0, &ar), -EACCES);
	cr_assert_eq(fstat(fd, &st), 0);
	cr_assert_eq(st.st_size, 0, "a refused file was sized");
	if (geteuid() == 0) {
		cr_assert_eq(fchmod(fd, 0600), 0);
		cr_assert_eq(fchown(fd, 65534, 65534), 0);
		cr_assert_eq(bd_allreduce_open(ar_path, 0, 2, 16, 0, &ar), -EACCES);
	}
	cr_assert_eq(ar, (void *)0x1);
	close(fd);
	/* gone, the path is created afresh, 0600 whatever the umask */
	cr_assert_eq(unlink(ar_path), 0);
	mode_t old = umask(0);
	cr_assert_eq(bd_allreduce_open(ar_path, 0, 2, 16, 0, &ar), 0);
	umask(old);
	cr_assert_eq(stat(ar_path, &st), 0);
	cr_assert_eq(st.st_mode & 07777, 0600);
	bd_allreduce_close(ar);
}

/* A world-writable directory, sticky (/dev/shm, /tmp) or not, is refused before anything is
 * created in it. */
Test(allreduce, world_writable_dir_is_refused)
{
	static const mode_t modes[] = { 01777, 0777, 0703 };
	struct bd_allreduce *ar = (void *)0x1;
	char dir[96];

	ar_dir(dir, sizeof(dir));
	for (size_t i = 0; i < sizeof(modes) / sizeof(modes[0]); i++) {
		cr_assert_eq(chmod(dir, modes[i]), 0);
		cr_assert_eq(bd_allreduce_dir_check(ar_path), -EPERM, "mode %o", modes[i]);
		cr_assert_eq(bd_allreduce_open(ar_path, 0, 2, 16, 0, &ar), -EPERM, "mode %o",
			     modes[i]);
		cr_assert_eq(access(ar_path, F_OK), -1, "a file was made in a %o directory",
			     modes[i]);
	}
	cr_assert_eq(chmod(dir, 0700), 0);
	cr_assert_eq(bd_allreduce_dir_check(ar_path), 0);
	cr_assert_eq(bd_allreduce_dir_check("/dev/shm/bdfp4-ar"), -EPERM);
	cr_assert_eq(ar, (void *)0x1);
}
