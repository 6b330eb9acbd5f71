/* bench_scrub.c — what zeroing freed pages and slots costs kvpoold on the CPU backend
 * (kvpoold/scrub.c): the allocator's RequestRelease of one request of n pages and a slot, with
 * and without the scrub hook, over real memfd arenas of tp = 2 ranks made and mapped as the
 * daemon makes them. Before each release the request's pages and slot are written (as the
 * workers write them), so the scrub clears resident memory as it does in service.
 *
 * A third column frees the same ranges with fallocate(FALLOC_FL_PUNCH_HOLE) on the memfds
 * instead (the kernel unmaps them everywhere and reads them back as zero), the alternative
 * kvpoold does not use: its cost moves to the page faults of the worker that writes the page
 * next, shown as the refill columns (writing the request's bytes again after each).
 *
 * Usage: bench_scrub [RESULTS.md]  — prints a Markdown table; with a file, appends it there
 * under a heading with the date, machine, build and command.
 *
 * Geometries: the embedded SmolLM2-135M (30 layers, 2 of its 3 KV heads per rank, d = 64) and
 * Qwen3-4B (36 layers, 4 of 8 KV heads per rank, d = 128), both bitdecoding-nvfp4 pages.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "base/bd_clock.h"
#include "base/bd_version.h"
#include "quant/bd_kvcfg.h"
#include "kvpool.h"
#include "bench_info.h"

#define TP 2
#define REPS 40

struct shape {
	const char *name;
	int layers, heads, d;
	uint32_t n_pages; /* pages of one request: n_pages · 128 tokens */
};

static double now_us(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static int cmp_d(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return x < y ? -1 : x > y;
}

/* Writes byte into every layer of the request's pages and into its slot, on every rank. */
static void touch(uint8_t *const maps[TP], const struct bd_kvpool_plan *p, const int32_t *pages,
		  uint32_t n, int32_t slot, int byte)
{
	const struct bd_layout *l = &p->layout;

	for (int r = 0; r < TP; r++) {
		for (uint32_t i = 0; i < n; i++)
			for (int k = 0; k < l->n_layers; k++)
				memset(maps[r] + p->pages_offset + (size_t)k * l->layer_stride +
					       (size_t)pages[i] * l->page_bytes,
				       byte, l->page_bytes);
		memset(maps[r] + p->slots_offset + (size_t)slot * l->slot_bytes, byte,
		       l->slot_bytes);
	}
}

struct row {
	const char *shape;
	uint32_t pages;
	double mib, off_us, on_us, gbs, punch_us, refill_us, refill_punch_us;
};

/* The request's pages (every layer) and slot punched out of every rank's memfd. */
static int punch(const struct bd_kvpool_arena *ar, const struct bd_kvpool_plan *p,
		 const int32_t *pages, uint32_t n, int32_t slot)
{
	const struct bd_layout *l = &p->layout;
	const int mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE;

	for (int r = 0; r < TP; r++) {
		int fd = ar[r].chunks[0].fd;

		for (uint32_t i = 0; i < n; i++)
			for (int k = 0; k < l->n_layers; k++)
				if (fallocate(fd, mode,
					      (off_t)(p->pages_offset + (size_t)k * l->layer_stride +
						      (size_t)pages[i] * l->page_bytes),
					      (off_t)l->page_bytes) < 0)
					return -errno;
		if (fallocate(fd, mode, (off_t)(p->slots_offset + (size_t)slot * l->slot_bytes),
			      (off_t)l->slot_bytes) < 0)
			return -errno;
	}
	return 0;
}

static int run(const struct shape *sh, struct row *ret)
{
	struct bd_kvpool_params pp = { 0 };
	struct bd_kvpool_plan plan;
	struct bd_kvpool_arena ar[TP];
	struct bd_kvpool_alloc *a = NULL;
	struct bd_kvpool_scrub *s = NULL;
	uint8_t *maps[TP] = { NULL };
	double t_on[REPS], t_off[REPS], t_punch[REPS], t_refill[REPS], t_refill_punch[REPS];
	int32_t *pages = malloc(sh->n_pages * sizeof(*pages)), slot;
	char err[300];
	int e;

	pp.fmt = bd_kvcfg_find("bitdecoding-nvfp4")->page_fmt;
	pp.n_layers = sh->layers;
	pp.n_kv_heads = sh->heads;
	pp.d = sh->d;
	pp.max_seq_len = sh->n_pages * BD_PAGE_TOKENS;
	pp.n_slots = 4;
	pp.n_pages = 2 * sh->n_pages;
	pp.granularity = (size_t)sysconf(_SC_PAGESIZE);
	pp.chunk_bytes = (size_t)1 << 30;
	if (!pages || bd_kvpool_plan(&pp, &plan, err, sizeof(err)) < 0 || plan.n_chunks != 1) {
		fprintf(stderr, "bench_scrub: %s: plan: %s\n", sh->name, err);
		return -EINVAL;
	}
	for (int r = 0; r < TP; r++) {
		e = bd_kvpool_mem_cpu.arena_create(r, &plan, &ar[r], err, sizeof(err));
		if (e < 0) {
			fprintf(stderr, "bench_scrub: arena: %s\n", err);
			return e;
		}
		maps[r] = mmap(NULL, ar[r].bytes, PROT_READ | PROT_WRITE, MAP_SHARED,
			       ar[r].chunks[0].fd, 0);
		if (maps[r] == MAP_FAILED)
			return -errno;
	}
	if (bd_kvpool_alloc_new(plan.n_pages, plan.n_slots, plan.max_pages_per_request, 16, &a) <
		    0 ||
	    bd_kvpool_scrub_new(&plan, ar, TP, &s, err, sizeof(err)) < 0)
		return -ENOMEM;
	for (int i = 0; i < 2 * REPS; i++) {
		bool on = i & 1;
		double t0, t1;

		bd_kvpool_alloc_set_scrub(a, on ? bd_kvpool_scrub_hook : NULL, s);
		if (bd_kvpool_page_alloc(a, 1, 1, sh->n_pages, pages) < 0 ||
		    bd_kvpool_slot_assign(a, 1, 1, &slot) < 0)
			return -EIO;
		touch(maps, &plan, pages, sh->n_pages, slot, 0x5a + i);
		t0 = now_us();
		if (bd_kvpool_request_release(a, 1, NULL) < 0)
			return -EIO;
		t1 = now_us();
		(on ? t_on : t_off)[i / 2] = t1 - t0;
		if (on && maps[0][plan.pages_offset + (size_t)pages[0] * plan.layout.page_bytes])
			return -EFAULT; /* the scrub did not clear */
		if (on) {
			/* the next owner writes the same pages: memory already there */
			t0 = now_us();
			touch(maps, &plan, pages, sh->n_pages, slot, 0x11);
			t_refill[i / 2] = now_us() - t0;
		}
	}
	/* the alternative, in its own loop (a punch unmaps the scrub's mapping too): the pages
	 * punched out at the release, then written again by the next owner (page faults) */
	bd_kvpool_alloc_set_scrub(a, NULL, NULL);
	for (int i = 0; i < REPS; i++) {
		double t0;

		if (bd_kvpool_page_alloc(a, 1, 1, sh->n_pages, pages) < 0 ||
		    bd_kvpool_slot_assign(a, 1, 1, &slot) < 0)
			return -EIO;
		touch(maps, &plan, pages, sh->n_pages, slot, 0x33);
		t0 = now_us();
		if (bd_kvpool_request_release(a, 1, NULL) < 0 ||
		    punch(ar, &plan, pages, sh->n_pages, slot) < 0)
			return -EIO;
		t_punch[i] = now_us() - t0;
		if (maps[1][plan.slots_offset + (size_t)slot * plan.layout.slot_bytes])
			return -EFAULT;
		t0 = now_us();
		touch(maps, &plan, pages, sh->n_pages, slot, 0x22);
		t_refill_punch[i] = now_us() - t0;
	}
	qsort(t_on, REPS, sizeof(double), cmp_d);
	qsort(t_off, REPS, sizeof(double), cmp_d);
	qsort(t_punch, REPS, sizeof(double), cmp_d);
	qsort(t_refill, REPS, sizeof(double), cmp_d);
	qsort(t_refill_punch, REPS, sizeof(double), cmp_d);
	ret->punch_us = t_punch[REPS / 2];
	ret->refill_us = t_refill[REPS / 2];
	ret->refill_punch_us = t_refill_punch[REPS / 2];
	ret->shape = sh->name;
	ret->pages = sh->n_pages;
	ret->mib = (double)TP *
		   ((double)sh->n_pages * sh->layers * plan.layout.page_bytes +
		    plan.layout.slot_bytes) / (1 << 20);
	ret->on_us = t_on[REPS / 2];
	ret->off_us = t_off[REPS / 2];
	ret->gbs = ret->mib * (1 << 20) / ((ret->on_us - ret->off_us) * 1e3);
	bd_kvpool_scrub_free(s);
	bd_kvpool_alloc_free(a);
	for (int r = 0; r < TP; r++) {
		munmap(maps[r], ar[r].bytes);
		bd_kvpool_mem_cpu.arena_destroy(&ar[r]);
	}
	free(pages);
	return 0;
}

static void table(FILE *f, const struct row *rows, size_t n)
{
	fprintf(f, "| shape | pages of the request | bytes zeroed (MiB, %d ranks) | release "
		   "without scrub (µs) | with scrub (µs) | scrub per page (µs) | zeroing rate "
		   "(GB/s) | refill after scrub (µs) | punch-hole instead (µs) | refill after "
		   "punch (µs) |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
		TP);
	for (size_t i = 0; i < n; i++)
		fprintf(f, "| %s | %u | %.2f | %.1f | %.1f | %.2f | %.2f | %.1f | %.1f | %.1f |\n",
			rows[i].shape, rows[i].pages, rows[i].mib, rows[i].off_us, rows[i].on_us,
			(rows[i].on_us - rows[i].off_us) / rows[i].pages, rows[i].gbs,
			rows[i].refill_us, rows[i].punch_us, rows[i].refill_punch_us);
}

int main(int argc, char **argv)
{
	static const struct shape shapes[] = {
		{ "smollm2-135m", 30, 2, 64, 8 },
		{ "smollm2-135m", 30, 2, 64, 64 },
		{ "qwen3-4b", 36, 4, 128, 8 },
		{ "qwen3-4b", 36, 4, 128, 64 },
	};
	struct row rows[sizeof(shapes) / sizeof(shapes[0])];
	size_t n = sizeof(shapes) / sizeof(shapes[0]);

	for (size_t i = 0; i < n; i++) {
		int e = run(&shapes[i], &rows[i]);

		if (e < 0) {
			fprintf(stderr, "bench_scrub: %s: %s\n", shapes[i].name, strerror(-e));
			return 1;
		}
	}
	printf("RequestRelease of one request (its pages and a slot), median of %d; tp = %d\n\n",
	       REPS, TP);
	table(stdout, rows, n);
	if (argc > 1) {
		struct bench_info bi;
		FILE *f = bench_results_open("bench_scrub", argv[1], &bi);

		if (!f)
			return 1;
		fprintf(f, "\n## kvpoold page scrubbing on the CPU backend — %s\n\nMachine: %s, %ld "
			   "online core(s). Build: %s. Command: `%s %s`. RequestRelease of one "
			   "request in kvpoold's allocator over memfd arenas of %d ranks, its pages "
			   "and slot written before each release; median of %d.\n\n",
			bi.date, bi.cpu, sysconf(_SC_NPROCESSORS_ONLN), bd_version(), argv[0], argv[1],
			TP, REPS);
		table(f, rows, n);
		fclose(f);
	}
	return 0;
}
