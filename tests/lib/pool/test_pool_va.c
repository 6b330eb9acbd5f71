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
