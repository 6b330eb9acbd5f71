/* test_pool_va.c — where the chunks of a CUDA arena go when a worker imports them
 * (bd_pool_va_plan, lib/pool/pool_va.c). The import itself needs a GPU:
 * tests/gpu/pool_vmm_check.c.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "cuda/bd_pool_cuda.h"
#include "kvpool.h"

#define MiB ((size_t)1 << 20)

/* a geometry with only what the plan reads: chunk sizes and the arena size */
static struct bd_pool_geometry geo(const uint64_t *chunks, size_t n, size_t arena)
{
	struct bd_pool_geometry g;

	memset(&g, 0, sizeof(g));
	snprintf(g.backend, sizeof(g.backend), "cuda");
	g.n_chunks = n;
	for (size_t i = 0; i < n && i < BD_POOL_MAX_CHUNKS; i++)
		g.chunk_bytes[i] = chunks[i];
	g.arena_bytes = arena;
	return g;
}

TestSuite(pool_import);

Test(pool_import, chunks_back_to_back)
{
	/* 4 + 4 + 2 MiB at 0, 4 MiB and 8 MiB: a 10 MiB range */
	static const uint64_t c[] = { 4 * MiB, 4 * MiB, 2 * MiB };
	struct bd_pool_geometry g = geo(c, 3, 10 * MiB);
	size_t va = 0, off[3] = { 7, 7, 7 };

	cr_assert_eq(bd_pool_va_plan(&g, 2 * MiB, &va, off), 0);
	cr_expect_eq(va, 10 * MiB);
	cr_expect_eq(off[0], 0);
	cr_expect_eq(off[1], 4 * MiB);
	cr_expect_eq(off[2], 8 * MiB);
	/* the offsets are optional */
	va = 0;
	cr_assert_eq(bd_pool_va_plan(&g, 2 * MiB, &va, NULL), 0);
	cr_expect_eq(va, 10 * MiB);
	/* a finer granularity accepts the same chunks */
	cr_expect_eq(bd_pool_va_plan(&g, 64 << 10, &va, off), 0);
}

Test(pool_import, refusals_leave_the_outputs_alone)
{
	static const uint64_t good[] = { 4 * MiB, 2 * MiB };
	static const uint64_t odd[] = { 4 * MiB, 3 * MiB };     /* 3 MiB: not whole 2 MiB */
	static const uint64_t zero[] = { 4 * MiB, 0 };
	static const uint64_t wrap[] = { UINT64_MAX - MiB + 1, 2 * MiB }; /* sum wraps */
	struct bd_pool_geometry g = geo(good, 2, 6 * MiB);
	struct bd_pool_geometry bad;
	size_t va = 12345, off[BD_POOL_MAX_CHUNKS + 1];

	for (size_t i = 0; i < BD_POOL_MAX_CHUNKS + 1; i++)
		off[i] = 777;
	/* arguments */
	cr_expect_eq(bd_pool_va_plan(NULL, 2 * MiB, &va, off), -EINVAL);
	cr_expect_eq(bd_pool_va_plan(&g, 2 * MiB, NULL, off), -EINVAL);
	cr_expect_eq(bd_pool_va_plan(&g, 0, &va, off), -EINVAL);
	cr_expect_eq(bd_pool_va_plan(&g, 3 * MiB, &va, off), -EINVAL); /* not a power of 2 */
	/* chunks */
	bad = geo(odd, 2, 7 * MiB);
	cr_expect_eq(bd_pool_va_plan(&bad, 2 * MiB, &va, off), -EINVAL);
	bad = geo(zero, 2, 4 * MiB);
	cr_expect_eq(bd_pool_va_plan(&bad, 2 * MiB, &va, off), -EINVAL);
	bad = geo(good, 2, 8 * MiB); /* chunks add up to 6 MiB, not the arena's 8 */
	cr_expect_eq(bd_pool_va_plan(&bad, 2 * MiB, &va, off), -EINVAL);
	bad = geo(good, 2, 4 * MiB);
	cr_expect_eq(bd_pool_va_plan(&bad, 2 * MiB, &va, off), -EINVAL);
	bad = geo(wrap, 2, MiB);
	cr_expect_eq(bd_pool_va_plan(&bad, MiB, &va, off), -EINVAL);
	bad = geo(good, 0, 0);
	cr_expect_eq(bd_pool_va_plan(&bad, 2 * MiB, &va, off), -EINVAL);
	bad = geo(good, 2, 6 * MiB);
	bad.n_chunks = BD_POOL_MAX_CHUNKS + 1;
	cr_expect_eq(bd_pool_va_plan(&bad, 2 * MiB, &va, off), -EINVAL);
	/* in odd, the first chunk was fine: still nothing written */
	cr_expect_eq(va, 12345);
	for (size_t i = 0; i < BD_POOL_MAX_CHUNKS + 1; i++)
		cr_expect_eq(off[i], 777, "offset %zu written", i);
}

Test(pool_import, most_chunks)
{
	uint64_t c[BD_POOL_MAX_CHUNKS];
	struct bd_pool_geometry g;
	size_t va, off[BD_POOL_MAX_CHUNKS];

	for (size_t i = 0; i < BD_POOL_MAX_CHUNKS; i++)
		c[i] = 2 * MiB;
	g = geo(c, BD_POOL_MAX_CHUNKS, BD_POOL_MAX_CHUNKS * 2 * MiB);
	cr_assert_eq(bd_pool_va_plan(&g, 2 * MiB, &va, off), 0);
	cr_expect_eq(va, BD_POOL_MAX_CHUNKS * 2 * MiB);
	cr_expect_eq(off[BD_POOL_MAX_CHUNKS - 1], (BD_POOL_MAX_CHUNKS - 1) * 2 * MiB);
}

/* Whatever kvpoold cuts (plan.c) a worker can map: the GPU check's own geometry (NVFP4, 2
 * layers, 2 KV heads, d = 128, 4 slots, 256 MiB, 64 MiB chunks, 2 MiB granularity) and a
 * budget that leaves a short last chunk. */
Test(pool_import, every_plan_of_the_daemon_maps)
{
	static const uint64_t budgets[] = { 256 * MiB, 100 * MiB + 12345 };
	char err[512];

	for (size_t b = 0; b < 2; b++) {
		struct bd_kvpool_params p = {
			.fmt = BD_PAGE_NVFP4, .n_layers = 2, .n_kv_heads = 2, .d = 128,
			.max_seq_len = 4096, .n_slots = 4, .budget_bytes = budgets[b],
			.granularity = 2 * MiB, .chunk_bytes = 64 * MiB,
		};
		struct bd_kvpool_plan pl;
		uint64_t c[BD_POOL_MAX_CHUNKS];
		struct bd_pool_geometry g;
		size_t va = 0, off[BD_POOL_MAX_CHUNKS];

		cr_assert_eq(bd_kvpool_plan(&p, &pl, err, sizeof(err)), 0, "%s", err);
		for (size_t i = 0; i < pl.n_chunks; i++)
			c[i] = i + 1 < pl.n_chunks ? pl.chunk_bytes : pl.last_chunk_bytes;
		g = geo(c, pl.n_chunks, pl.arena_bytes);
		cr_assert_eq(bd_pool_va_plan(&g, 2 * MiB, &va, off), 0,
			     "budget %llu: %zu chunks of %zu, last %zu, arena %zu",
			     (unsigned long long)budgets[b], pl.n_chunks, pl.chunk_bytes,
			     pl.last_chunk_bytes, pl.arena_bytes);
		cr_expect_eq(va, pl.arena_bytes);
		cr_expect_eq(off[pl.n_chunks - 1], (pl.n_chunks - 1) * pl.chunk_bytes);
		/* 256 MiB: 4 chunks of 64 MiB; 100 MiB: 64 + 36 MiB at most */
		cr_expect_eq(pl.n_chunks, b == 0 ? 4 : 2);
	}
}

/* NVFP4, 2 layers, 1 KV head, d = 64, 40 pages (page 9472 bytes: test_pool_daemon.c), the
 * slots after the two layers of pages (2 · 378880 bytes) at 761856, 2 slots of 2 · 36864 bytes
 * (a slot holds every layer; 36864 for one layer: test_pool_daemon.c) */
static struct bd_pool_geometry scrub_geo(void)
{
	struct bd_pool_geometry g;

	memset(&g, 0, sizeof(g));
	cr_assert_eq(bd_layout_init(&g.layout, BD_PAGE_NVFP4, 2, 1, 64, 0, 40), 0);
	g.n_pages = 40;
	g.n_slots = 2;
	g.pages_offset = 0;
	g.slots_offset = 2 * 380928;
	g.arena_bytes = g.slots_offset + 2 * g.layout.slot_bytes;
	return g;
}

Test(pool_import, scrub_span_of_a_page_and_a_slot)
{
	struct bd_pool_geometry g = scrub_geo();
	struct bd_pool_span s = { 1, 1, 1, 1 };

	cr_assert_eq(g.layout.page_bytes, 9472);
	cr_assert_eq(g.layout.slot_bytes, 2 * 36864);
	cr_assert_eq(bd_pool_scrub_span(&g, false, 3, &s), 0);
	cr_expect_eq(s.offset, 3 * 9472);
	cr_expect_eq(s.pitch, 40 * 9472, "one row per layer, a layer apart");
	cr_expect_eq(s.width, 9472);
	cr_expect_eq(s.height, 2);
	cr_assert_eq(bd_pool_scrub_span(&g, true, 1, &s), 0);
	cr_expect_eq(s.offset, 2 * 380928 + 2 * 36864);
	cr_expect_eq(s.width, 2 * 36864);
	cr_expect_eq(s.height, 1);
}

/* Zeroing the span of page 3 clears page 3 of every layer (as bd_layout_page finds it) and
 * nothing else; the span of slot 1 clears slot 1 only. */
Test(pool_import, scrub_span_clears_exactly_its_bytes)
{
	struct bd_pool_geometry g = scrub_geo();
	uint8_t *arena = malloc(g.arena_bytes);
	struct bd_pool_span s;
	size_t zeros = 0;

	cr_assert_not_null(arena);
	memset(arena, 0xff, g.arena_bytes);
	for (int k = 0; k < 2; k++) {
		cr_assert_eq(bd_pool_scrub_span(&g, k == 1, k == 1 ? 1 : 3, &s), 0);
		for (size_t r = 0; r < s.height; r++)
			memset(arena + s.offset + r * s.pitch, 0, s.width);
	}
	for (int l = 0; l < 2; l++)
		for (int32_t p = 0; p < 40; p++) {
			const uint8_t *pg = bd_layout_page(&g.layout, arena + g.pages_offset, l, p);

			for (size_t i = 0; i < g.layout.page_bytes; i++)
				cr_assert_eq(pg[i], p == 3 ? 0 : 0xff, "layer %d page %d byte %zu", l,
					     p, i);
		}
	for (int32_t sl = 0; sl < 2; sl++) {
		const uint8_t *b = arena + g.slots_offset + (size_t)sl * g.layout.slot_bytes;

		for (size_t i = 0; i < g.layout.slot_bytes; i++)
			cr_assert_eq(b[i], sl == 1 ? 0 : 0xff, "slot %d byte %zu", sl, i);
	}
	for (size_t i = 0; i < g.arena_bytes; i++)
		zeros += arena[i] == 0;
	cr_expect_eq(zeros, 2 * 9472 + 2 * 36864, "no byte outside the page and the slot");
	free(arena);
}

Test(pool_import, scrub_span_out_of_range)
{
	struct bd_pool_geometry g = scrub_geo();
	struct bd_pool_span s = { 7, 7, 7, 7 };

	cr_expect_eq(bd_pool_scrub_span(&g, false, 40, &s), -ERANGE);
	cr_expect_eq(bd_pool_scrub_span(&g, false, -1, &s), -ERANGE);
	cr_expect_eq(bd_pool_scrub_span(&g, true, 2, &s), -ERANGE);
	cr_expect_eq(s.offset, 7, "untouched");
	cr_expect_eq(bd_pool_scrub_span(NULL, true, 0, &s), -EINVAL);
}
