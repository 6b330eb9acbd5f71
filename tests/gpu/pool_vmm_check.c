/* pool_vmm_check.c — kvpoold's CUDA arenas shared by worker processes, on a GPU.
 *
 * `make gpu-test-pool` runs it. It starts kvpoold ($BD_BIN/kvpoold) on the CUDA backend in a
 * temp dir (tp = number of GPUs, at most 2; BD_POOL_CHECK_TP overrides), NVFP4 pages
 * (bitdecoding-nvfp4), 2 layers, 2 KV heads per rank, d = 128, 256 MiB per device cut in 64 MiB
 * chunks (several chunks, so the back-to-back mapping is exercised), then for each rank:
 *   - process A attaches, maps the arena with bd_pool_cuda_map, takes two pages and a slot
 *     through the ZeroMQ API, copies random BF16 K'/V into the slot's recent rows, synchronizes,
 *     promotes them into the first page with bd_promote_run, synchronizes, unmaps and detaches
 *     before it tells B (pipe) the page, the slot and the seed (kvpoold allows one live
 *     attachment per rank, so the two processes take turns);
 *   - process B attaches and maps the same arena, reads the slot and the page back, checks the
 *     slot holds A's data and that the page equals bd_page_promote of it on the CPU, byte for
 *     byte, then writes a pattern into the second page, synchronizes, detaches and tells A,
 *     who attaches again, reads it back and checks it (both directions);
 *   - A releases its request and a new one takes two pages and a slot: each that was the old
 *     request's still holds its bytes, bd_pool_cuda_scrub (what workerd runs on its stream when
 *     a plan gives a page or slot to a request) clears it, and it reads back zero;
 * then a process attached and mapped on rank 0 is SIGKILLed: the attachment count must drop
 * back, its pages come back through owner reclaim, and an allocation must work afterwards;
 * `kvpoolctl stats` is shown; SIGTERM must stop kvpoold with exit status 0.
 * The parent never touches CUDA (children fork from a CUDA-free process). Every wait is
 * bounded; it prints PASS/FAIL per check and exits 1 on any failure, 2 when it cannot run.
 * Writes only under a private dir in /tmp (tests/common/tmpdir.h), removed at the end.
 * `--cpu` checks the harness itself where there is no GPU: kvpoold on the CPU backend, the
 * workers map its memfd arena, memcpy stands for the copies and bd_page_promote for the
 * kernel (so the page comparison is trivially equal there); everything else as on the GPU.
 */
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "bd_kernels.h"
#include "base/bd_clock.h"
#include "quant/bd_kvcfg.h"
#include "quant/bd_layout.h"
#include "pool/bd_pool_client.h"
#include "cuda/bd_cuda_err.h"
#include "cuda/bd_pool_cuda.h"
#include "spawn.h"
#include "tmpdir.h"

#define WAIT_MS 30000
#define KV_CONFIG "bitdecoding-nvfp4"
#define OWNER_KILLED 0x4b11ull

static struct {
	char dir[32], sock[64], endpoint[80], notify[64], log[64], bin[PATH_MAX];
	pid_t daemon;
	int notify_fd;
	int n_pass, n_fail;
	bool cpu; /* --cpu: the harness alone on the CPU backend (no GPU, no worker pairs) */
} S = { .notify_fd = -1 };

static void check(bool ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void check(bool ok, const char *fmt, ...)
{
	va_list ap;

	*(ok ? &S.n_pass : &S.n_fail) += 1;
	fputs(ok ? "PASS: " : "FAIL: ", stdout);
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	fputc('\n', stdout);
	fflush(stdout);
}

/* ---- random data ----------------------------------------------------------------------------- */

static uint64_t mix(uint64_t z)
{
	z += 0x9e3779b97f4a7c15ull;
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

/* A's slot content: every recent K'/V row of every (layer, head) random (sink rows stay zero),
 * with outlier channels, from seed. */
static void fill_recent(const struct bd_layout *lay, uint8_t *slot, uint64_t seed)
{
	uint64_t s = seed;

	memset(slot, 0, lay->slot_bytes);
	for (int l = 0; l < lay->n_layers; l++)
		for (int h = 0; h < lay->n_kv_heads; h++) {
			bd_bf16 *k = bd_slot_recent_k(lay, slot, l, h);
			bd_bf16 *v = bd_slot_recent_v(lay, slot, l, h);

			for (int i = 0; i < BD_RECENT_TOKENS * lay->d; i++) {
				/* uniform in (-1, 1), channel 5 an outlier, scaled per token */
				double a = (double)((s = mix(s)) >> 11) / 4503599627370496.0 - 1.0;
				double b = (double)((s = mix(s)) >> 11) / 4503599627370496.0 - 1.0;
				float tk = 1.0f + (float)((i / lay->d) % 7);

				k[i] = bd_f32_to_bf16((float)a * tk * (i % lay->d == 5 ? 30.0f : 1.0f));
				v[i] = bd_f32_to_bf16((float)b * 2.0f);
			}
		}
}

/* B's pattern for page2, layer l, byte i. */
static uint8_t pattern(uint64_t seed, int l, size_t i)
{
	return (uint8_t)(mix(seed ^ ((uint64_t)l << 40) ^ i) >> 17);
}

/* ---- workers (children) ---------------------------------------------------------------------- */

struct msg {
	int32_t page, page2, slot;
	uint64_t seed;
};

struct worker {
	const char *who;
	int rank;
	struct bd_pool_attach *att;
	const struct bd_pool_geometry *g;
	struct bd_pool_conn *conn;
	uint8_t *base; /* device */
	bool fail;
};

static void wfail(struct worker *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void wfail(struct worker *w, const char *fmt, ...)
{
	va_list ap;

	w->fail = true;
	printf("FAIL: rank %d %s: ", w->rank, w->who);
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	fputc('\n', stdout);
	fflush(stdout);
}

static void wpass(struct worker *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void wpass(struct worker *w, const char *fmt, ...)
{
	va_list ap;

	printf("PASS: rank %d %s: ", w->rank, w->who);
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	fputc('\n', stdout);
	fflush(stdout);
}

/* exits the child on a CUDA runtime error */
#define WCK(w, call)                                                                       \
	BD_CUDA_TRY(call, wfail(w, "%s: %s", #call, cudaGetErrorString(bd_cuda_e)); _exit(1))

/* Attaches w's rank and maps its arena (kvpoold allows one live attachment per rank, so the
 * processes of one rank take turns: each detaches before it hands over). */
static void worker_attach(struct worker *w)
{
	static uint64_t n_groups;
	uint8_t tokens[BD_POOL_MAX_TP * BD_POOL_TOKEN_BYTES];
	struct bd_pool_geometry q;
	struct bd_pool_conn *c;
	char err[512];
	void *base = NULL;
	int e;

	/* the router's part: a group epoch with a token per rank (the geometry says how many
	 * ranks), then the attach with this rank's token */
	e = bd_pool_query(S.sock, w->rank, err, sizeof(err), &q);
	if (e == 0 && getrandom(tokens, sizeof(tokens), 0) != (ssize_t)sizeof(tokens))
		e = -EIO;
	if (e == 0 && (e = bd_pool_conn_new(S.endpoint, 5000, &c)) == 0) {
		e = bd_pool_group_register(c, 1, (uint64_t)getpid() * 1000 + ++n_groups, tokens,
					   (size_t)q.tp);
		snprintf(err, sizeof(err), "%s", bd_pool_conn_error(c, NULL));
		bd_pool_conn_free(c);
	}
	if (e < 0) {
		wfail(w, "the group's tokens: %s (%d)", err, e);
		_exit(1);
	}
	e = bd_pool_attach(S.sock, w->rank, tokens + (size_t)w->rank * BD_POOL_TOKEN_BYTES, err,
			   sizeof(err), &w->att);
	if (e < 0) {
		wfail(w, "bd_pool_attach: %s (%d)", err, e);
		_exit(1);
	}
	w->g = bd_pool_attach_geometry(w->att);
	if (S.cpu) {
		w->base = (uint8_t *)bd_pool_attach_pages(w->att) - w->g->pages_offset;
		return;
	}
	e = bd_pool_cuda_map(w->att, &base, err, sizeof(err));
	if (e < 0) {
		wfail(w, "bd_pool_cuda_map: %s (%d)", err, e);
		_exit(1);
	}
	w->base = base;
	/* the runtime on this thread uses the primary context the map made current */
	WCK(w, cudaSetDevice(w->g->device));
}

/* Synchronizes, unmaps and detaches (what it wrote stays in the pool's arena). */
static void worker_detach(struct worker *w)
{
	cudaError_t ce = S.cpu || !w->att ? cudaSuccess : cudaDeviceSynchronize();

	if (ce != cudaSuccess)
		wfail(w, "synchronize before detaching: %s", cudaGetErrorString(ce));
	if (!w->att)
		return;
	if (!S.cpu)
		bd_pool_cuda_unmap(w->att, w->base);
	bd_pool_detach(w->att);
	w->att = NULL;
	w->g = NULL;
	w->base = NULL;
}

static void worker_start(struct worker *w, const char *who, int rank)
{
	int e;

	memset(w, 0, sizeof(*w));
	w->who = who;
	w->rank = rank;
	prctl(PR_SET_PDEATHSIG, SIGKILL);
	alarm(60); /* never outlive the run */
	worker_attach(w);
	e = bd_pool_conn_new(S.endpoint, 5000, &w->conn);
	if (e < 0) {
		wfail(w, "bd_pool_conn_new: %d", e);
		_exit(1);
	}
}

__attribute__((noreturn)) static void worker_end(struct worker *w)
{
	worker_detach(w);
	bd_pool_conn_free(w->conn);
	fflush(stdout);
	_exit(w->fail ? 1 : 0);
}

static uint8_t *page_ptr(const struct worker *w, int layer, int32_t page)
{
	return bd_layout_page(&w->g->layout, w->base + w->g->pages_offset, layer, page);
}

static uint8_t *slot_ptr(const struct worker *w, int32_t slot)
{
	return w->base + w->g->slots_offset + (size_t)slot * w->g->layout.slot_bytes;
}

/* A copy between the arena and the host (memcpy with --cpu), then a synchronize: the bytes
 * have landed when it returns. */
static void xfer(struct worker *w, void *dst, const void *src, size_t n, bool to_device)
{
	if (S.cpu) {
		memcpy(dst, src, n);
		return;
	}
	WCK(w, cudaMemcpy(dst, src, n, to_device ? cudaMemcpyHostToDevice
						 : cudaMemcpyDeviceToHost));
	WCK(w, cudaDeviceSynchronize());
}

/* Promotes slot into page: bd_promote_run on the device (bd_page_promote with --cpu, which
 * only exercises the harness). Returns the promotion status. */
static int promote(struct worker *w, const struct bd_kvcfg *cfg, int32_t slot, int32_t page)
{
	const struct bd_layout *lay = &w->g->layout;
	void **d_ptrs, *sp = slot_ptr(w, slot);
	int32_t *d_page;
	int *d_status, status = 1, e;

	if (S.cpu)
		return bd_page_promote(lay, cfg, NULL, sp, w->base + w->g->pages_offset, page);
	WCK(w, cudaMalloc((void **)&d_ptrs, sizeof(void *)));
	WCK(w, cudaMalloc((void **)&d_page, sizeof(int32_t)));
	WCK(w, cudaMalloc((void **)&d_status, sizeof(int)));
	WCK(w, cudaMemcpy(d_ptrs, &sp, sizeof(sp), cudaMemcpyHostToDevice));
	WCK(w, cudaMemcpy(d_page, &page, sizeof(int32_t), cudaMemcpyHostToDevice));
	WCK(w, cudaMemset(d_status, 0x55, sizeof(int)));
	e = bd_promote_run(lay, cfg, w->base + w->g->pages_offset, (void *const *)d_ptrs, d_page,
			   1, d_status, NULL);
	if (e < 0) {
		wfail(w, "bd_promote_run: %d", e);
		_exit(1);
	}
	/* the kernel is done before anyone is told */
	WCK(w, cudaDeviceSynchronize());
	WCK(w, cudaMemcpy(&status, d_status, sizeof(int), cudaMemcpyDeviceToHost));
	cudaFree(d_ptrs);
	cudaFree(d_page);
	cudaFree(d_status);
	return status;
}

/* every layer of page p, device → host[n_layers][page_bytes] */
static void read_page(struct worker *w, int32_t p, uint8_t *host)
{
	const struct bd_layout *lay = &w->g->layout;

	for (int l = 0; l < lay->n_layers; l++)
		xfer(w, host + (size_t)l * lay->page_bytes, page_ptr(w, l, p), lay->page_bytes,
		     false);
}

static bool read_full(int fd, void *buf, size_t n, int timeout_ms)
{
	struct pollfd p = { .fd = fd, .events = POLLIN };

	if (poll(&p, 1, timeout_ms) != 1)
		return false;
	return read(fd, buf, n) == (ssize_t)n;
}

/* Whether n bytes at p are all zero; the count of non-zero ones in *ret_nz. */
static bool zero_bytes(const uint8_t *p, size_t n, size_t *ret_nz)
{
	size_t nz = 0;

	for (size_t i = 0; i < n; i++)
		nz += p[i] != 0;
	*ret_nz = nz;
	return nz == 0;
}

/* Pages and slots change owner zeroed. The request that held old_pages (A's promoted page, B's
 * pattern) and old_slot (A's K'/V) was released; a new request req takes two pages and a slot.
 * Each that was the old request's still holds its bytes on the CUDA backend (kvpoold does not
 * map device memory), the worker's bd_pool_cuda_scrub clears it on the stream, and it reads
 * back zero. On --cpu kvpoold zeroed them when they were freed: they read zero at once. */
static void check_scrub(struct worker *w, uint64_t req, uint64_t owner, const int32_t *old_pages,
			int32_t old_slot, uint8_t *host)
{
	const struct bd_layout *lay = &w->g->layout;
	size_t page_all = lay->page_bytes * (size_t)lay->n_layers, nz, reused = 0;
	int32_t pages[2], slot;
	char err[256];
	int e;

	e = bd_pool_page_alloc(w->conn, req, owner, 2, pages);
	if (e == 0)
		e = bd_pool_slot_assign(w->conn, req, owner, &slot);
	if (e < 0) {
		wfail(w, "scrub: allocation: %d %s", e, bd_pool_conn_error(w->conn, NULL));
		return;
	}
	for (int k = 0; k < 3; k++) {
		bool is_slot = k == 2;
		int32_t id = is_slot ? slot : pages[k];
		size_t n = is_slot ? lay->slot_bytes : page_all;
		bool was_old = is_slot ? id == old_slot : id == old_pages[0] || id == old_pages[1];

		if (!was_old)
			continue; /* a page no request wrote: nothing to show */
		reused++;
		if (is_slot)
			xfer(w, host, slot_ptr(w, id), n, false);
		else
			read_page(w, id, host);
		if (!S.cpu) {
			if (zero_bytes(host, n, &nz))
				wfail(w, "scrub: %s %d reads zero before the scrub: the check cannot "
				      "tell it worked", is_slot ? "slot" : "page", id);
			e = bd_pool_cuda_scrub(w->g, w->base, is_slot, id, NULL, err, sizeof(err));
			if (e < 0) {
				wfail(w, "scrub: %s", err);
				continue;
			}
			WCK(w, cudaDeviceSynchronize());
			if (is_slot)
				xfer(w, host, slot_ptr(w, id), n, false);
			else
				read_page(w, id, host);
		}
		if (zero_bytes(host, n, &nz))
			wpass(w, "%s %d of the released request reads zero for the next one (%zu "
			      "bytes)", is_slot ? "slot" : "page", id, n);
		else
			wfail(w, "%s %d of the released request: %zu of %zu bytes not zero for the "
			      "next one", is_slot ? "slot" : "page", id, nz, n);
	}
	if (!reused)
		wfail(w, "scrub: the new request got none of the old one's pages or slot");
	e = bd_pool_request_release(w->conn, req, NULL);
	if (e < 0)
		wfail(w, "scrub: release: %d %s", e, bd_pool_conn_error(w->conn, NULL));
}

/* A: promote on the device, hand over to B, then check what B wrote. */
__attribute__((noreturn)) static void process_a(int rank, int to_b, int from_b, uint64_t seed)
{
	struct worker w;
	const struct bd_layout *lay;
	const struct bd_kvcfg *cfg;
	uint64_t req = 0xA000 + (uint64_t)rank, owner = 0xA0 + (uint64_t)rank;
	int32_t pages[2], slot;
	int status;
	uint8_t *host;
	struct msg m;
	size_t diff = 0, first = 0;
	int e;

	worker_start(&w, "A", rank);
	lay = &w.g->layout;
	cfg = bd_kvcfg_find(w.g->kv_config);
	if (!cfg || cfg->page_fmt != lay->fmt) {
		wfail(&w, "kv_config %s unknown or not of the arena's format", w.g->kv_config);
		_exit(1);
	}
	e = bd_pool_page_alloc(w.conn, req, owner, 2, pages);
	if (e == 0)
		e = bd_pool_slot_assign(w.conn, req, owner, &slot);
	if (e < 0) {
		wfail(&w, "allocation: %d %s", e, bd_pool_conn_error(w.conn, NULL));
		_exit(1);
	}
	host = malloc(lay->slot_bytes > lay->page_bytes * (size_t)lay->n_layers
			      ? lay->slot_bytes
			      : lay->page_bytes * (size_t)lay->n_layers);
	if (!host)
		_exit(1);
	fill_recent(lay, host, seed);
	/* a pageable copy: xfer synchronizes, so the DMA has landed before the kernel reads */
	xfer(&w, slot_ptr(&w, slot), host, lay->slot_bytes, true);
	status = promote(&w, cfg, slot, pages[0]);
	if (status != 0)
		wfail(&w, "promotion status %d", status);
	else
		wpass(&w, "promoted slot %d into page %d on device %d (arena %zu bytes in %zu chunks)",
		      slot, pages[0], w.g->device, w.g->arena_bytes, w.g->n_chunks);
	m = (struct msg){ .page = pages[0], .page2 = pages[1], .slot = slot, .seed = seed };
	worker_detach(&w); /* B attaches the same rank next */
	if (write(to_b, &m, sizeof(m)) != (ssize_t)sizeof(m)) {
		wfail(&w, "pipe to B: %s", strerror(errno));
		_exit(1);
	}
	/* B → A: the pattern in page2 */
	if (!read_full(from_b, &m, sizeof(m), WAIT_MS)) {
		wfail(&w, "no word from B");
		_exit(1);
	}
	worker_attach(&w);
	lay = &w.g->layout;
	read_page(&w, pages[1], host);
	for (int l = 0; l < lay->n_layers; l++)
		for (size_t i = 0; i < lay->page_bytes; i++)
			if (host[(size_t)l * lay->page_bytes + i] != pattern(m.seed, l, i) &&
			    diff++ == 0)
				first = (size_t)l * lay->page_bytes + i;
	if (diff)
		wfail(&w, "page %d written by B: %zu of %zu bytes differ (first at %zu)", pages[1],
		      diff, lay->page_bytes * (size_t)lay->n_layers, first);
	else
		wpass(&w, "page %d written by B reads back identical (%zu bytes)", pages[1],
		      lay->page_bytes * (size_t)lay->n_layers);
	e = bd_pool_request_release(w.conn, req, NULL);
	if (e < 0)
		wfail(&w, "request release: %d %s", e, bd_pool_conn_error(w.conn, NULL));
	else
		check_scrub(&w, req + 0x100, owner, pages, slot, host);
	free(host);
	worker_end(&w);
}

/* B: check A's page against the CPU promotion, then write a pattern for A. */
__attribute__((noreturn)) static void process_b(int rank, int from_a, int to_a)
{
	struct worker w;
	struct bd_layout one;
	const struct bd_layout *lay;
	const struct bd_kvcfg *cfg;
	uint8_t *slot_dev, *slot_ref, *page_dev, *page_ref;
	size_t all, diff = 0, first = 0;
	struct msg m;
	int e;

	if (!read_full(from_a, &m, sizeof(m), WAIT_MS)) {
		printf("FAIL: rank %d B: no word from A\n", rank);
		_exit(1);
	}
	worker_start(&w, "B", rank); /* A has detached */
	lay = &w.g->layout;
	cfg = bd_kvcfg_find(w.g->kv_config);
	if (!cfg) {
		wfail(&w, "unknown kv_config %s", w.g->kv_config);
		_exit(1);
	}
	all = lay->page_bytes * (size_t)lay->n_layers;
	slot_dev = malloc(lay->slot_bytes);
	slot_ref = malloc(lay->slot_bytes);
	page_dev = malloc(all);
	page_ref = calloc(1, all);
	if (!slot_dev || !slot_ref || !page_dev || !page_ref)
		_exit(1);
	xfer(&w, slot_dev, slot_ptr(&w, m.slot), lay->slot_bytes, false);
	read_page(&w, m.page, page_dev);
	/* the slot holds what A wrote */
	fill_recent(lay, slot_ref, m.seed);
	if (memcmp(slot_dev, slot_ref, lay->slot_bytes))
		wfail(&w, "slot %d does not hold A's data", m.slot);
	else
		wpass(&w, "slot %d holds A's %zu bytes", m.slot, lay->slot_bytes);
	/* the CPU promotion of the slot as read here, into a one-page arena of the same layout */
	e = bd_layout_init(&one, lay->fmt, lay->n_layers, lay->n_kv_heads, lay->d, lay->d_rope, 1);
	if (e == 0)
		e = bd_page_promote(&one, cfg, NULL, slot_dev, page_ref, 0);
	if (e < 0) {
		wfail(&w, "CPU promotion: %d", e);
		_exit(1);
	}
	for (size_t i = 0; i < all; i++)
		if (page_dev[i] != page_ref[i] && diff++ == 0)
			first = i;
	if (diff)
		wfail(&w, "page %d promoted by A: %zu of %zu bytes differ from bd_page_promote "
		      "(first at %zu: %02x, want %02x)", m.page, diff, all, first, page_dev[first],
		      page_ref[first]);
	else
		wpass(&w, "page %d promoted by A equals bd_page_promote (%zu bytes, %d layers)",
		      m.page, all, lay->n_layers);
	/* B → A: a pattern in page2 */
	m.seed = mix(m.seed + 1);
	for (int l = 0; l < lay->n_layers; l++)
		for (size_t i = 0; i < lay->page_bytes; i++)
			page_dev[(size_t)l * lay->page_bytes + i] = pattern(m.seed, l, i);
	for (int l = 0; l < lay->n_layers; l++)
		xfer(&w, page_ptr(&w, l, m.page2), page_dev + (size_t)l * lay->page_bytes,
		     lay->page_bytes, true);
	worker_detach(&w); /* A attaches again to read page2 */
	if (write(to_a, &m, sizeof(m)) != (ssize_t)sizeof(m))
		wfail(&w, "pipe to A: %s", strerror(errno));
	free(slot_dev);
	free(slot_ref);
	free(page_dev);
	free(page_ref);
	worker_end(&w);
}

/* K: attached and mapped, holding a page under OWNER_KILLED, until SIGKILLed. */
__attribute__((noreturn)) static void process_k(int to_parent)
{
	struct worker w;
	int32_t page;
	char ok = 1;
	int e;

	worker_start(&w, "K", 0);
	e = bd_pool_page_alloc(w.conn, 0xC0FFEE, OWNER_KILLED, 1, &page);
	if (e < 0) {
		wfail(&w, "allocation: %d", e);
		_exit(1);
	}
	if (S.cpu) {
		memset(page_ptr(&w, 0, page), 0xAB, w.g->layout.page_bytes);
	} else {
		WCK(&w, cudaMemset(page_ptr(&w, 0, page), 0xAB, w.g->layout.page_bytes));
		WCK(&w, cudaDeviceSynchronize());
	}
	if (write(to_parent, &ok, 1) != 1)
		_exit(1);
	for (;;)
		pause();
}

/* ---- the parent ------------------------------------------------------------------------------ */

static void show_log(void)
{
	char buf[4096];
	FILE *f = fopen(S.log, "r");
	size_t n;

	if (!f)
		return;
	n = fread(buf, 1, sizeof(buf) - 1, f);
	fclose(f);
	buf[n] = 0;
	printf("---- kvpoold log ----\n%s---------------------\n", buf);
}

/* GPUs and the name of the first, from a child: the parent stays CUDA-free. */
static int probe_gpus(char *name, size_t len)
{
	struct pollfd pf = { .fd = -1, .events = POLLIN };
	int p[2], count = 0, st;
	char buf[300] = "";
	pid_t pid;

	if (pipe(p))
		return -1;
	fflush(stdout);
	pid = fork();
	if (pid == 0) {
		struct cudaDeviceProp prop;
		int n = 0;

		close(p[0]);
		if (cudaGetDeviceCount(&n) != cudaSuccess)
			n = 0;
		if (n > 0 && cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
			snprintf(buf, sizeof(buf), "%d %s", n, prop.name);
		else
			snprintf(buf, sizeof(buf), "%d", n);
		if (write(p[1], buf, strlen(buf) + 1) < 0)
			_exit(1);
		_exit(0);
	}
	close(p[1]);
	pf.fd = p[0];
	if (pid < 0 || poll(&pf, 1, WAIT_MS) != 1 || read(p[0], buf, sizeof(buf) - 1) <= 0)
		count = -1;
	else if (sscanf(buf, "%d", &count) == 1 && strchr(buf, ' '))
		snprintf(name, len, "%s", strchr(buf, ' ') + 1);
	close(p[0]);
	if (pid > 0)
		waitpid(pid, &st, 0);
	return count;
}

static int start_daemon(int tp)
{
	char path[PATH_MAX + 16], tps[16];
	const char *argv[] = { path, "--no-config", "--backend", S.cpu ? "cpu" : "cuda",
			       "--tp", tps, "--socket", S.sock, "--endpoint", S.endpoint,
			       "--kv-config", KV_CONFIG, "--layers", "2", "--kv-heads", "4",
			       "--kv-heads-per-rank", tp == 1 ? "4" : "2", "--head-dim", "128",
			       "--max-seq-len", "4096", "--slots", "4", "--memory-bytes", "256M",
			       "--chunk-bytes", "64M", "--status-interval-ms", "200", NULL };

	snprintf(path, sizeof(path), "%s/kvpoold", S.bin);
	snprintf(tps, sizeof(tps), "%d", tp);
	if (access(path, X_OK)) {
		printf("FAIL: no kvpoold at %s (set BD_BIN)\n", path);
		return -1;
	}
	S.notify_fd = sp_notify_open(S.notify);
	if (S.notify_fd < 0)
		return -1;
	S.daemon = sp_spawn(argv, S.log, S.notify, NULL);
	return S.daemon > 0 ? 0 : -1;
}

/* fork() with stdout flushed first (no line printed twice) */
static pid_t spawn(void)
{
	fflush(stdout);
	return fork();
}

static void rank_pair(int rank)
{
	int ab[2], ba[2], sa, sb;
	pid_t a, b;
	uint64_t seed = mix(0x5eed0000ull + (uint64_t)rank + (uint64_t)time(NULL));

	if (pipe(ab) || pipe(ba)) {
		check(false, "rank %d: pipes: %s", rank, strerror(errno));
		return;
	}
	a = spawn();
	if (a == 0) {
		close(ab[0]);
		close(ba[1]);
		process_a(rank, ab[1], ba[0], seed);
	}
	b = spawn();
	if (b == 0) {
		close(ab[1]);
		close(ba[0]);
		process_b(rank, ab[0], ba[1]);
	}
	close(ab[0]);
	close(ab[1]);
	close(ba[0]);
	close(ba[1]);
	sa = a > 0 ? sp_reap(a, 2 * WAIT_MS) : -1;
	sb = b > 0 ? sp_reap(b, 2 * WAIT_MS) : -1;
	check(sa == 0 && sb == 0, "rank %d: process A exit %d, process B exit %d (kernel in one "
	      "process, read in the other, both ways)", rank, sa, sb);
}

/* Stats, or NULL with a FAIL. */
static struct bd_pool_stats *get_stats(struct bd_pool_conn *c)
{
	struct bd_pool_stats *s = NULL;
	int e = bd_pool_stats(c, 0, &s);

	if (e < 0) {
		check(false, "stats: %d %s", e, bd_pool_conn_error(c, NULL));
		return NULL;
	}
	return s;
}

/* Waits until rank 0 has `want` attachments; returns the last count seen. */
static long wait_attached(struct bd_pool_conn *c, uint32_t want, int timeout_ms)
{
	int64_t end = bd_now_ms() + timeout_ms;
	long seen = -1;

	do {
		struct bd_pool_stats *s = NULL;

		if (bd_pool_stats(c, 0, &s) == 0) {
			seen = s->n_devices ? (long)s->devices[0].attached : -1;
			bd_pool_stats_free(s);
			if (seen == (long)want)
				return seen;
		}
		usleep(20000);
	} while (bd_now_ms() < end);
	return seen;
}

static void kill_check(struct bd_pool_conn *c)
{
	struct bd_pool_stats *s;
	uint64_t nreq = 0, freed = 0;
	int p[2], e;
	bool listed = false;
	int32_t page;
	char ok = 0;
	long seen;
	pid_t k;

	seen = wait_attached(c, 0, 5000);
	check(seen == 0, "no attachment left on rank 0 after A and B exited (%ld)", seen);
	if (pipe(p)) {
		check(false, "pipe: %s", strerror(errno));
		return;
	}
	k = spawn();
	if (k == 0) {
		close(p[0]);
		process_k(p[1]);
	}
	close(p[1]);
	if (k < 0 || !read_full(p[0], &ok, 1, WAIT_MS) || ok != 1) {
		check(false, "process K did not attach, map and allocate");
		close(p[0]);
		if (k > 0)
			sp_reap(k, 100);
		return;
	}
	close(p[0]);
	s = get_stats(c);
	if (!s)
		return;
	for (size_t i = 0; i < s->n_attachments; i++)
		listed |= s->attachments[i].pid == k && s->attachments[i].rank == 0;
	check(s->devices[0].attached == 1 && listed && s->pages_used == 1,
	      "K attached: rank 0 attachments %u (want 1), K's pid listed %d, pages used %llu "
	      "(want 1)", s->devices[0].attached, listed, (unsigned long long)s->pages_used);
	bd_pool_stats_free(s);
	kill(k, SIGKILL);
	e = sp_reap(k, 5000);
	check(e == 128 + SIGKILL, "K died of SIGKILL (status %d)", e);
	seen = wait_attached(c, 0, 5000);
	check(seen == 0, "the attachment of the killed process dropped (rank 0: %ld)", seen);
	e = bd_pool_owner_reclaim(c, OWNER_KILLED, &nreq, &freed);
	check(e == 0 && nreq == 1 && freed == 1,
	      "owner reclaim of the killed process: %d, %llu requests, %llu pages freed (want 1, 1)",
	      e, (unsigned long long)nreq, (unsigned long long)freed);
	e = bd_pool_page_alloc(c, 0xD00D, 0xD0, 1, &page);
	check(e == 0, "the pool still serves: page alloc %d (page %d)", e, e == 0 ? page : -1);
	if (e == 0)
		bd_pool_request_release(c, 0xD00D, NULL);
	s = get_stats(c);
	if (s) {
		check(s->pages_used == 0 && s->slots_free == s->slots_total && s->requests == 0,
		      "pool back to empty: pages used %llu, slots free %llu/%llu, requests %llu",
		      (unsigned long long)s->pages_used, (unsigned long long)s->slots_free,
		      (unsigned long long)s->slots_total, (unsigned long long)s->requests);
		bd_pool_stats_free(s);
	}
}

static void show_ctl(void)
{
	char cmd[PATH_MAX * 2], line[512];
	bool cuda = false;
	FILE *f;
	int st;

	snprintf(cmd, sizeof(cmd), "'%s/kvpoolctl' --no-config --endpoint '%s' stats 2>&1", S.bin,
		 S.endpoint);
	fflush(stdout);
	f = popen(cmd, "r");
	if (!f) {
		check(false, "kvpoolctl: %s", strerror(errno));
		return;
	}
	printf("---- kvpoolctl stats ----\n");
	while (fgets(line, sizeof(line), f)) {
		fputs(line, stdout);
		cuda |= strstr(line, S.cpu ? "cpu" : "cuda") != NULL;
	}
	printf("-------------------------\n");
	st = pclose(f);
	check(st == 0 && cuda, "kvpoolctl stats exit %d, shows the %s backend %d",
	      WIFEXITED(st) ? WEXITSTATUS(st) : -1, S.cpu ? "cpu" : "cuda", cuda);
}

int main(int argc, char **argv)
{
	const char *bin = getenv("BD_BIN"), *tpenv = getenv("BD_POOL_CHECK_TP");
	struct bd_pool_conn *c = NULL;
	struct bd_pool_stats *s;
	char gpu[256] = "?";
	int64_t t0 = bd_now_ms();
	int n_gpu, tp, st;

	setvbuf(stdout, NULL, _IOLBF, 0);
	snprintf(S.bin, sizeof(S.bin), "%s", bin && *bin ? bin : "build/bin");
	S.cpu = argc > 1 && !strcmp(argv[1], "--cpu");
	n_gpu = S.cpu ? 2 : probe_gpus(gpu, sizeof(gpu));
	if (n_gpu < 1) {
		printf("FAIL: no CUDA device (%d)\n", n_gpu);
		return 2;
	}
	tp = n_gpu >= 2 ? 2 : 1;
	if (tpenv && *tpenv)
		tp = atoi(tpenv) == 1 ? 1 : 2;
	if (tp > n_gpu) {
		printf("FAIL: BD_POOL_CHECK_TP=%d with %d GPUs\n", tp, n_gpu);
		return 2;
	}
	printf("pool_vmm_check: %d GPU(s) (%s), tp %d, kvpoold from %s\n", S.cpu ? 0 : n_gpu,
	       S.cpu ? "--cpu: the CPU backend" : gpu, tp, S.bin);
	st = td_make(S.dir, sizeof(S.dir), "bdfp4-vmm");
	if (st < 0) {
		printf("FAIL: a temp dir: %s\n", strerror(-st));
		return 2;
	}
	snprintf(S.sock, sizeof(S.sock), "%s/kvpool.sock", S.dir);
	snprintf(S.endpoint, sizeof(S.endpoint), "ipc://%s/alloc.sock", S.dir);
	snprintf(S.notify, sizeof(S.notify), "%s/notify.sock", S.dir);
	snprintf(S.log, sizeof(S.log), "%s/kvpoold.log", S.dir);

	if (start_daemon(tp) < 0 || !sp_wait_notify(S.notify_fd, &S.daemon, "READY=1", WAIT_MS)) {
		check(false, "kvpoold --backend %s --tp %d did not get ready", S.cpu ? "cpu" : "cuda",
		      tp);
		show_log();
		goto out;
	}
	check(true, "kvpoold ready on the %s backend, tp %d (%.1f s)", S.cpu ? "cpu" : "cuda",
	      tp, (double)(bd_now_ms() - t0) / 1000.0);
	if (bd_pool_conn_new(S.endpoint, 5000, &c) < 0) {
		check(false, "connecting to %s", S.endpoint);
		goto stop;
	}
	s = get_stats(c);
	if (s) {
		bool devs = s->n_devices == (size_t)tp;

		for (size_t i = 0; devs && i < s->n_devices; i++)
			devs = s->devices[i].device == (S.cpu ? -1 : (int)i) &&
			       s->devices[i].arena_bytes > 0;
		check(!strcmp(s->backend, S.cpu ? "cpu" : "cuda") &&
			      !strcmp(s->page_format, "nvfp4") && devs,
		      "stats: backend %s, format %s, %zu devices (rank r on device r), %llu pages",
		      s->backend, s->page_format, s->n_devices,
		      (unsigned long long)s->pages_total);
		bd_pool_stats_free(s);
	}
	for (int r = 0; r < tp; r++)
		rank_pair(r);
	kill_check(c);
	show_ctl();
stop:
	bd_pool_conn_free(c);
	kill(S.daemon, SIGTERM);
	st = sp_reap(S.daemon, 10000);
	S.daemon = 0;
	check(st == 0, "kvpoold exits 0 on SIGTERM (status %d)", st);
	if (st != 0 || S.n_fail)
		show_log();
out:
	if (S.daemon > 0) {
		kill(S.daemon, SIGKILL);
		waitpid(S.daemon, NULL, 0);
	}
	if (S.notify_fd >= 0)
		close(S.notify_fd);
	if (td_remove(S.dir) < 0)
		printf("note: could not remove %s\n", S.dir);
	printf("%s: %d checks passed, %d failed (%.1f s)\n", S.n_fail ? "FAIL" : "PASS", S.n_pass,
	       S.n_fail, (double)(bd_now_ms() - t0) / 1000.0);
	return S.n_fail ? 1 : 0;
}
