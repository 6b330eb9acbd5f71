/* allreduce.c — shared-memory all-reduce between TP ranks on the CPU backend (bd_allreduce.h).
 *
 * File: a 4 KiB header (geometry, the newest session and its members, one cache line of
 * control words per rank), then per rank two buffers of cap floats (rounds alternate). Each
 * rank's control line: arrive (rounds entered in the session, the futex word), session (the
 * session it is in, 0 none), want (its join token), pid (informational).
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "base/bd_clock.h"
#include "serve/bd_allreduce.h"

#define AR_MAGIC 0x4445524c4c414442ull /* "BDALLRED" little-endian */
#define AR_VERSION 1u
#define AR_HDR_BYTES 4096
#define AR_LINE 64
#define AR_INIT_LOCK_BYTE 64 /* serializes the sizing and initialization of the file */
#define AR_MAX_CAP ((size_t)1 << 26)
#define AR_SPIN 2000         /* polls before sleeping on the futex */
#define AR_SLICE_NS 2000000L /* futex sleeps; liveness is checked between them */

struct ar_rank {
	_Alignas(AR_LINE) uint32_t arrive;
	uint32_t session;
	uint64_t want;
	int32_t pid;
};

struct ar_header {
	uint64_t magic;
	uint32_t version, tp;
	uint64_t cap;
	uint32_t session; /* the newest session rank 0 started (0: none yet) */
	uint32_t pad;
	uint64_t members[BD_ALLREDUCE_MAX_TP]; /* the join tokens that session was made for */
	struct ar_rank r[BD_ALLREDUCE_MAX_TP];
};
_Static_assert(sizeof(struct ar_header) <= AR_HDR_BYTES, "all-reduce header too large");
_Static_assert(sizeof(struct ar_rank) == AR_LINE, "one control line per rank");

struct bd_allreduce {
	int fd, rank, tp, timeout_ms;
	size_t cap, buf_bytes, map_bytes;
	uint8_t *map;
	struct ar_header *h;
	uint32_t session; /* the session this handle is in (0: none) */
	uint32_t count;   /* rounds done in it */
	uint32_t pending; /* rank 0: a session started and not yet joined by all */
	uint64_t members[BD_ALLREDUCE_MAX_TP];
	uint64_t token;   /* other ranks: the token of the current join attempt */
};

/* ---- small helpers ----------------------------------------------------------------------- */

static void nap_ns(long ns)
{
	struct timespec ts = { 0, ns };
	nanosleep(&ts, NULL);
}

static void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#else
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

static uint32_t ld32(const uint32_t *p)
{
	return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}

static void st32(uint32_t *p, uint32_t v)
{
	__atomic_store_n(p, v, __ATOMIC_RELEASE);
}

static uint64_t ld64(const uint64_t *p)
{
	return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}

static void st64(uint64_t *p, uint64_t v)
{
	__atomic_store_n(p, v, __ATOMIC_RELEASE);
}

static void futex_wake(uint32_t *addr)
{
	syscall(SYS_futex, addr, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static void futex_wait(uint32_t *addr, uint32_t val, long ns)
{
	struct timespec ts = { 0, ns };
	syscall(SYS_futex, addr, FUTEX_WAIT, val, &ts, NULL, 0);
}

/* Open-file-description locks: one byte per rank, held while the rank is open. */
static int lock_byte(int fd, int byte, bool wait)
{
	struct flock fl = { .l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = byte, .l_len = 1 };
	if (fcntl(fd, wait ? F_OFD_SETLKW : F_OFD_SETLK, &fl) < 0)
		return errno == EAGAIN || errno == EACCES ? -EBUSY : -errno;
	return 0;
}

static void unlock_byte(int fd, int byte)
{
	struct flock fl = { .l_type = F_UNLCK, .l_whence = SEEK_SET, .l_start = byte, .l_len = 1 };
	fcntl(fd, F_OFD_SETLK, &fl);
}

/* Whether rank p holds its lock, i.e. is open and alive (an error counts as alive: the
 * timeout still bounds the wait). */
static bool alive(const struct bd_allreduce *ar, int p)
{
	struct flock fl = { .l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = p, .l_len = 1 };
	if (fcntl(ar->fd, F_OFD_GETLK, &fl) < 0)
		return true;
	return fl.l_type != F_UNLCK;
}

static uint64_t new_token(void)
{
	static _Atomic uint64_t counter;
	uint64_t x = (uint64_t)bd_now_us() ^ ((uint64_t)getpid() << 40) ^
		     (atomic_fetch_add(&counter, 1) << 20);
	/* splitmix64 finalizer: distinct inputs give well spread, almost surely distinct tokens */
	x ^= x >> 30;
	x *= 0xbf58476d1ce4e5b9ull;
	x ^= x >> 27;
	x *= 0x94d049bb133111ebull;
	x ^= x >> 31;
	return x ? x : 1;
}

static float *buffer(const struct bd_allreduce *ar, int rank, uint32_t parity)
{
	return (float *)(ar->map + AR_HDR_BYTES +
			 ((size_t)rank * 2 + parity) * ar->buf_bytes);
}

/* Leave the session: peers waiting on us see session 0 and fail their round. */
static void leave(struct bd_allreduce *ar)
{
	struct ar_rank *me = &ar->h->r[ar->rank];
	ar->session = 0;
	ar->pending = 0;
	ar->token = 0;
	st32(&me->session, 0);
	futex_wake(&me->arrive);
}

/* ---- open and close ---------------------------------------------------------------------- */

static size_t file_bytes(int tp, size_t buf_bytes)
{
	return AR_HDR_BYTES + (size_t)tp * 2 * buf_bytes;
}

/* Under the init lock: check the file's geometry, or (no live rank) size and initialize it. */
static int init_file(struct bd_allreduce *ar)
{
	size_t want = file_bytes(ar->tp, ar->buf_bytes);
	struct ar_header hdr;
	struct stat st;
	bool live = false;

	if (fstat(ar->fd, &st) < 0)
		return -errno;
	bool valid = (size_t)st.st_size >= sizeof(hdr) &&
		     pread(ar->fd, &hdr, sizeof(hdr), 0) == (ssize_t)sizeof(hdr) &&
		     hdr.magic == AR_MAGIC && hdr.version == AR_VERSION;
	if (valid && (size_t)st.st_size == want && hdr.tp == (uint32_t)ar->tp &&
	    hdr.cap == ar->cap)
		return 0;
	/* a rank that has opened it initialized it first (under this lock): a file without a
	 * header is new, whoever else holds a rank lock */
	for (int p = 0; valid && p < BD_ALLREDUCE_MAX_TP; p++)
		if (p != ar->rank && alive(ar, p))
			live = true;
	if (live)
		return -EINVAL; /* a live rank uses another geometry */
	if (ftruncate(ar->fd, 0) < 0 || ftruncate(ar->fd, (off_t)want) < 0)
		return -errno;
	memset(&hdr, 0, sizeof(hdr));
	hdr.magic = AR_MAGIC;
	hdr.version = AR_VERSION;
	hdr.tp = (uint32_t)ar->tp;
	hdr.cap = ar->cap;
	if (pwrite(ar->fd, &hdr, sizeof(hdr), 0) != (ssize_t)sizeof(hdr))
		return -EIO;
	return 0;
}

int bd_allreduce_dir_check(const char *path)
{
	char dir[PATH_MAX];
	const char *slash;
	struct stat st;

	if (!path || !*path)
		return -EINVAL;
	slash = strrchr(path, '/');
	if (!slash) {
		dir[0] = '.';
		dir[1] = 0;
	} else if (slash == path) {
		dir[0] = '/';
		dir[1] = 0;
	} else {
		if ((size_t)(slash - path) >= sizeof(dir))
			return -ENAMETOOLONG;
		memcpy(dir, path, (size_t)(slash - path));
		dir[slash - path] = 0;
	}
	if (stat(dir, &st) < 0)
		return -errno;
	if (!S_ISDIR(st.st_mode))
		return -ENOTDIR;
	/* anyone could plant or swap names in it (the sticky bit keeps files, not names) */
	if (st.st_mode & S_IWOTH)
		return -EPERM;
	if (st.st_uid != geteuid() && st.st_uid != 0)
		return -EPERM;
	return 0;
}

/* The all-reduce file at path for this process: created O_EXCL with mode 0600, or one that
 * exists opened without following a symbolic link and accepted only as a regular file of this
 * user with no access for group or others (another rank of the same user made it). Returns
 * the fd or -errno (bd_allreduce_open's). */
static int open_private(const char *path)
{
	struct stat st;
	int fd, r;

	r = bd_allreduce_dir_check(path);
	if (r < 0)
		return r;
	fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
	if (fd >= 0) {
		/* the umask may only have narrowed 0600; set it exactly */
		if (fchmod(fd, 0600) < 0) {
			r = -errno;
			close(fd);
			return r;
		}
		return fd;
	}
	if (errno != EEXIST)
		return -errno;
	fd = open(path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
	if (fd < 0)
		return -errno; /* -ELOOP: a symbolic link */
	if (fstat(fd, &st) < 0) {
		r = -errno;
		close(fd);
		return r;
	}
	if (!S_ISREG(st.st_mode) || st.st_uid != geteuid() || (st.st_mode & 0077) ||
	    st.st_nlink != 1) {
		close(fd);
		return -EACCES;
	}
	return fd;
}

int bd_allreduce_open(const char *path, int rank, int tp, size_t cap, int timeout_ms,
		      struct bd_allreduce **ret)
{
	if (!path || !*path || !ret || tp < 2 || tp > BD_ALLREDUCE_MAX_TP || rank < 0 ||
	    rank >= tp || cap < 1 || cap > AR_MAX_CAP)
		return -EINVAL;
	struct bd_allreduce *ar = calloc(1, sizeof(*ar));
	if (!ar)
		return -ENOMEM;
	ar->rank = rank;
	ar->tp = tp;
	ar->cap = cap;
	ar->timeout_ms = timeout_ms > 0 ? timeout_ms : BD_ALLREDUCE_DEFAULT_TIMEOUT_MS;
	ar->buf_bytes = (cap * sizeof(float) + AR_LINE - 1) / AR_LINE * AR_LINE;
	ar->map_bytes = file_bytes(tp, ar->buf_bytes);
	int r;

	ar->fd = open_private(path);
	if (ar->fd < 0) {
		r = ar->fd;
		free(ar);
		return r;
	}
	if ((r = lock_byte(ar->fd, rank, false)) < 0)
		goto fail;
	if ((r = lock_byte(ar->fd, AR_INIT_LOCK_BYTE, true)) < 0)
		goto fail;
	r = init_file(ar);
	unlock_byte(ar->fd, AR_INIT_LOCK_BYTE);
	if (r < 0)
		goto fail;
	ar->map = mmap(NULL, ar->map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, ar->fd, 0);
	if (ar->map == MAP_FAILED) {
		r = -errno;
		ar->map = NULL;
		goto fail;
	}
	ar->h = (struct ar_header *)ar->map;
	struct ar_rank *me = &ar->h->r[rank];
	st32(&me->session, 0);
	st32(&me->arrive, 0);
	st64(&me->want, 0);
	__atomic_store_n(&me->pid, (int32_t)getpid(), __ATOMIC_RELAXED);
	futex_wake(&me->arrive);
	*ret = ar;
	return 0;
fail:
	close(ar->fd);
	free(ar);
	return r;
}

void bd_allreduce_close(struct bd_allreduce *ar)
{
	if (!ar)
		return;
	if (ar->h) {
		leave(ar);
		st64(&ar->h->r[ar->rank].want, 0);
		munmap(ar->map, ar->map_bytes);
	}
	close(ar->fd); /* drops the rank's lock: peers see it gone */
	free(ar);
}

int bd_allreduce_rank(const struct bd_allreduce *ar)
{
	return ar ? ar->rank : -EINVAL;
}

int bd_allreduce_tp(const struct bd_allreduce *ar)
{
	return ar ? ar->tp : -EINVAL;
}

/* ---- sessions ---------------------------------------------------------------------------- */

/* Rank 0: start a session for the followers present now, or see one started earlier through.
 * Returns 0 (joined), 1 (not yet). */
static int leader_step(struct bd_allreduce *ar)
{
	struct ar_header *h = ar->h;

	if (ar->pending) {
		bool all = true;
		for (int p = 1; p < ar->tp; p++) {
			if (!alive(ar, p) || ld64(&h->r[p].want) != ar->members[p]) {
				/* a member died or restarted: start over with whoever is there */
				ar->pending = 0;
				st32(&h->r[0].session, 0);
				return 1;
			}
			if (ld32(&h->r[p].session) != ar->pending)
				all = false;
		}
		if (!all)
			return 1;
		ar->session = ar->pending;
		ar->pending = 0;
		ar->count = 0;
		return 0;
	}
	for (int p = 1; p < ar->tp; p++) {
		ar->members[p] = ld64(&h->r[p].want);
		if (!ar->members[p] || !alive(ar, p))
			return 1;
	}
	uint32_t s = ld32(&h->session) + 1;
	if (s == 0)
		s = 1;
	for (int p = 1; p < ar->tp; p++)
		st64(&h->members[p], ar->members[p]);
	st32(&h->r[0].arrive, 0);
	st32(&h->session, s);
	st32(&h->r[0].session, s);
	futex_wake(&h->r[0].arrive);
	ar->pending = s;
	return 1;
}

/* Other ranks: join the session rank 0 started for this handle's token. */
static int follower_step(struct bd_allreduce *ar)
{
	struct ar_header *h = ar->h;
	struct ar_rank *me = &h->r[ar->rank];
	uint32_t s = ld32(&h->session);

	if (!s || ld64(&h->members[ar->rank]) != ar->token || !alive(ar, 0) ||
	    ld32(&h->r[0].session) != s)
		return 1;
	if (ld32(&me->session) != s) {
		st32(&me->arrive, 0);
		st32(&me->session, s);
		futex_wake(&me->arrive);
	}
	for (int p = 0; p < ar->tp; p++)
		if (p != ar->rank && (ld32(&h->r[p].session) != s || !alive(ar, p)))
			return 1;
	ar->session = s;
	ar->count = 0;
	return 0;
}

int bd_allreduce_join(struct bd_allreduce *ar, int timeout_ms)
{
	if (!ar)
		return -EINVAL;
	if (ar->session)
		leave(ar);
	if (ar->rank != 0 && !ar->token) {
		ar->token = new_token();
		st64(&ar->h->r[ar->rank].want, ar->token);
	}
	int64_t deadline = bd_now_us() + (int64_t)(timeout_ms > 0 ? timeout_ms : ar->timeout_ms) *
					       1000;
	for (;;) {
		int r = ar->rank == 0 ? leader_step(ar) : follower_step(ar);
		if (r == 0)
			return 0;
		if (bd_now_us() >= deadline)
			return -ETIMEDOUT;
		nap_ns(1000000);
	}
}

int bd_allreduce_check(struct bd_allreduce *ar)
{
	if (!ar)
		return -EINVAL;
	if (!ar->session)
		return -EPIPE;
	for (int p = 0; p < ar->tp; p++) {
		if (p == ar->rank)
			continue;
		if (ld32(&ar->h->r[p].session) != ar->session || !alive(ar, p)) {
			leave(ar);
			return -EPIPE;
		}
	}
	return 0;
}

/* ---- rounds ------------------------------------------------------------------------------ */

/* Wait until rank p has entered round `target` − 1 of our session (its arrive ≥ target). */
static int wait_arrive(struct bd_allreduce *ar, int p, uint32_t target, int64_t deadline)
{
	struct ar_rank *rp = &ar->h->r[p];
	for (long i = 0;; i++) {
		uint32_t v = ld32(&rp->arrive), s = ld32(&rp->session);
		/* arrived, even if it has left since: its buffer of this round stays intact */
		if ((int32_t)(v - target) >= 0 && (s == ar->session || s == 0))
			return 0;
		if (s != ar->session)
			return -EPIPE;
		if (i < AR_SPIN) {
			cpu_relax();
			continue;
		}
		if (!alive(ar, p))
			return -EPIPE;
		if (bd_now_us() >= deadline)
			return -ETIMEDOUT;
		futex_wait(&rp->arrive, v, AR_SLICE_NS);
	}
}

static int round_sum(struct bd_allreduce *ar, float *buf, size_t n)
{
	uint32_t parity = ar->count & 1u, target = ar->count + 1;
	struct ar_rank *me = &ar->h->r[ar->rank];
	int64_t deadline = bd_now_us() + (int64_t)ar->timeout_ms * 1000;

	if (n)
		memcpy(buffer(ar, ar->rank, parity), buf, n * sizeof(float));
	st32(&me->arrive, target);
	futex_wake(&me->arrive);
	for (int p = 0; p < ar->tp; p++) {
		if (p == ar->rank)
			continue;
		int r = wait_arrive(ar, p, target, deadline);
		if (r < 0) {
			/* take the arrival back: a peer that has not looked yet fails too */
			st32(&me->arrive, ar->count);
			return r;
		}
	}
	/* rank order, FP32: the same additions on every rank, so the same bytes */
	const float *b0 = buffer(ar, 0, parity);
	for (size_t i = 0; i < n; i++) {
		float s = b0[i];
		for (int p = 1; p < ar->tp; p++)
			s += buffer(ar, p, parity)[i];
		buf[i] = s;
	}
	ar->count++;
	return 0;
}

int bd_allreduce_sum(struct bd_allreduce *ar, float *buf, size_t n)
{
	if (!ar || (n && !buf))
		return -EINVAL;
	if (!ar->session)
		return -EPIPE;
	size_t off = 0;
	do {
		size_t m = n - off < ar->cap ? n - off : ar->cap;
		int r = round_sum(ar, buf + off, m);
		if (r < 0) {
			leave(ar);
			return r;
		}
		off += m;
	} while (off < n);
	return 0;
}

int bd_allreduce_model_cb(void *ar, float *buf, size_t n)
{
	return bd_allreduce_sum(ar, buf, n);
}
