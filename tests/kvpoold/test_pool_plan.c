/* test_pool_plan.c — kvpoold's arena sizing (kvpoold/plan.c) and its CPU memory backend
 * (kvpoold/mem_cpu.c).
 *
 * Geometry used throughout, by hand from bd_layout.h: NVFP4, 1 layer, 1 KV head, d = 64.
 * Page-head: K codes 128·32 = 4096, K scales 128·4 = 512, V codes 64·64 = 4096, V scales
 * 64·8 = 512, all 128-aligned: 9216 bytes; g[1][2] FP32 at 9216 → 9224 → page_bytes 9472
 * (256-aligned). Slot: sink K and V 16·64·2 = 2048 each, recent K and V 128·64·2 = 16384 each:
 * 36864 bytes.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvpool.h"

#define PAGE 9472u
#define SLOT 36864u

static struct bd_kvpool_params params(uint32_t max_seq_len, size_t slots, uint64_t budget)
{
	return (struct bd_kvpool_params){
		.fmt = BD_PAGE_NVFP4, .n_layers = 1, .n_kv_heads = 1, .d = 64, .d_rope = 0,
		.max_seq_len = max_seq_len, .n_slots = slots, .budget_bytes = budget,
		.granularity = 4096, .chunk_bytes = 1 << 30,
	};
}

TestSuite(pool_plan);

Test(pool_plan, geometry_matches_the_hand_derivation)
{
	struct bd_kvpool_params p = params(1024, 2, 1 << 20);
	struct bd_kvpool_plan pl;
	char err[256];

	cr_assert_eq(bd_kvpool_plan(&p, &pl, err, sizeof(err)), 0, "%s", err);
	cr_expect_eq(pl.layout.page_bytes, PAGE);
	cr_expect_eq(pl.layout.slot_bytes, SLOT);
	/* 1 MiB: (1048576 − 2·36864) / 9472 = 102.9 → 102 pages = 966144 bytes, slots from the
	 * next 4 KiB boundary 966656, end 966656 + 73728 = 1040384 (a multiple of 4096) */
	cr_expect_eq(pl.n_pages, 102);
	cr_expect_eq(pl.pages_offset, 0);
	cr_expect_eq(pl.slots_offset, 966656);
	cr_expect_eq(pl.used_bytes, 1040384);
	cr_expect_eq(pl.arena_bytes, 1040384);
	cr_expect_eq(pl.n_chunks, 1);
	cr_expect_eq(pl.last_chunk_bytes, 1040384);
	cr_expect_eq(pl.max_pages_per_request, 8); /* 1024 / 128 */
}

Test(pool_plan, budget_must_hold_one_max_length_request)
{
	/* 8 pages (1024 tokens): 75776 → 77824 aligned, + 73728 of slots = 151552 bytes */
	struct bd_kvpool_params p = params(1024, 2, 151552);
	struct bd_kvpool_plan pl;
	char err[512];

	cr_assert_eq(bd_kvpool_plan(&p, &pl, err, sizeof(err)), 0, "%s", err);
	cr_expect_eq(pl.n_pages, 8);
	cr_expect_eq(pl.arena_bytes, 151552);

	/* one byte less rounds the budget down to 147456: 7 pages only */
	memset(&pl, 0x5a, sizeof(pl));
	p.budget_bytes = 151551;
	cr_assert_eq(bd_kvpool_plan(&p, &pl, err, sizeof(err)), -ENOSPC);
	cr_expect_neq(strstr(err, "max_seq_len=1024"), NULL, "message: %s", err);
	cr_expect_neq(strstr(err, "needs 8 pages"), NULL, "message: %s", err);
	cr_expect_neq(strstr(err, "holds 7 pages"), NULL, "message: %s", err);
	cr_expect_eq(((unsigned char *)&pl)[0], 0x5a, "plan written on error");

	/* a budget below the slots alone */
	p.budget_bytes = 4096;
	cr_expect_eq(bd_kvpool_plan(&p, &pl, err, sizeof(err)), -ENOSPC);
}

Test(pool_plan, fixed_page_count)
{
	struct bd_kvpool_params p = params(1024, 2, 0);
	struct bd_kvpool_plan pl;
	char err[512];

	p.n_pages = 7;
	cr_expect_eq(bd_kvpool_plan(&p, &pl, err, sizeof(err)), -ENOSPC);
	p.n_pages = 8;
	cr_assert_eq(bd_kvpool_plan(&p, &pl, err, sizeof(err)), 0, "%s", err);
	cr_expect_eq(pl.n_pages, 8);
	cr_expect_eq(pl.arena_bytes, 151552);
}

Test(pool_plan, chunks)
{
	struct bd_kvpool_params p = params(1024, 2, 1 << 20);
	struct bd_kvpool_plan pl;
	char err[256];

	/* 1040384 in chunks of 256 KiB: 3 full (786432) and 253952 */
	p.chunk_bytes = 256 << 10;
	cr_assert_eq(bd_kvpool_plan(&p, &pl, err, sizeof(err)), 0, "%s", err);
	cr_expect_eq(pl.n_chunks, 4);
	cr_expect_eq(pl.chunk_bytes, 262144);
	cr_expect_eq(pl.last_chunk_bytes, 253952);
	/* 4 KiB chunks would be 254 > BD_POOL_MAX_CHUNKS: doubled to 16 KiB, 64 chunks, the
	 * last 1040384 − 63·16384 = 8192 */
	p.chunk_bytes = 4096;
	cr_assert_eq(bd_kvpool_plan(&p, &pl, err, sizeof(err)), 0, "%s", err);
	cr_expect_eq(pl.chunk_bytes, 16384);
	cr_expect_eq(pl.n_chunks, 64);
	cr_expect_eq(pl.last_chunk_bytes, 8192);
	/* a chunk size that is not a multiple of the granularity is rounded up */
	p.chunk_bytes = 5000;
	cr_assert_eq(bd_kvpool_plan(&p, &pl, err, sizeof(err)), 0, "%s", err);
	cr_expect_eq(pl.chunk_bytes % 4096, 0);
}

Test(pool_plan, bad_parameters)
{
	struct bd_kvpool_params p = params(1024, 2, 1 << 20);
	struct bd_kvpool_plan pl;
	char err[256];

	p.n_slots = 0;
	cr_expect_eq(bd_kvpool_plan(&p, &pl, err, sizeof(err)), -EINVAL);
	p = params(1024, 2, 1 << 20);
	p.granularity = 3000;
	cr_expect_eq(bd_kvpool_plan(&p, &pl, err, sizeof(err)), -EINVAL);
	p = params(0, 2, 1 << 20);
	cr_expect_eq(bd_kvpool_plan(&p, &pl, err, sizeof(err)), -EINVAL);
	p = params(1024, 2, 1 << 20);
	p.d = 48; /* not a multiple of 32: the layout refuses */
	cr_expect_eq(bd_kvpool_plan(&p, &pl, err, sizeof(err)), -EINVAL);
	cr_expect_neq(strlen(err), 0);
}

Test(pool_plan, cpu_arena_is_sealed_shared_memory)
{
	struct bd_kvpool_params p = params(1024, 2, 1 << 20);
	const struct bd_kvpool_mem_ops *m = bd_kvpool_mem_find("cpu");
	struct bd_kvpool_arena ar;
	struct bd_kvpool_plan pl;
	char err[256];
	struct stat st;
	uint8_t *a, *b;
	int fd0;

	cr_assert_not_null(m);
	cr_expect_eq(bd_kvpool_mem_find("tpu"), NULL);
	cr_assert_eq(m->supported(1, err, sizeof(err)), 0, "%s", err);
	p.chunk_bytes = 256 << 10;
	cr_assert_eq(bd_kvpool_plan(&p, &pl, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(m->arena_create(0, &pl, &ar, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(ar.n_chunks, 4);
	cr_expect_eq(ar.bytes, pl.arena_bytes);
	for (size_t i = 0; i < ar.n_chunks; i++) {
		int seals = fcntl(ar.chunks[i].fd, F_GET_SEALS);

		cr_assert_eq(fstat(ar.chunks[i].fd, &st), 0);
		cr_expect_eq((size_t)st.st_size, ar.chunks[i].bytes);
		cr_expect(seals & F_SEAL_SHRINK);
		cr_expect(seals & F_SEAL_SEAL);
		/* sealed: it cannot shrink under a mapping */
		cr_expect_eq(ftruncate(ar.chunks[i].fd, 4096), -1);
	}
	/* two mappings of one chunk see the same bytes */
	a = mmap(NULL, ar.chunks[1].bytes, PROT_READ | PROT_WRITE, MAP_SHARED, ar.chunks[1].fd, 0);
	b = mmap(NULL, ar.chunks[1].bytes, PROT_READ, MAP_SHARED, ar.chunks[1].fd, 0);
	cr_assert_neq(a, MAP_FAILED);
	cr_assert_neq(b, MAP_FAILED);
	a[12345] = 0xa7;
	cr_expect_eq(b[12345], 0xa7);
	munmap(a, ar.chunks[1].bytes);
	munmap(b, ar.chunks[1].bytes);
	fd0 = ar.chunks[0].fd;
	m->arena_destroy(&ar);
	cr_expect_eq(ar.n_chunks, 0);
	cr_expect_eq(fcntl(fd0, F_GETFD), -1, "chunk fd left open");
	m->arena_destroy(&ar); /* twice is harmless */
}

Test(pool_plan, cuda_backend_fails_cleanly_without_a_gpu)
{
	const struct bd_kvpool_mem_ops *m = bd_kvpool_mem_find("cuda");
	char err[256] = "";
	int e;

	cr_assert_not_null(m);
	e = m->supported(1, err, sizeof(err));
	/* on a machine with a GPU this says 0; here there is none or no driver */
	if (e == 0)
		cr_skip_test("a CUDA device is present");
	cr_expect_lt(e, 0);
	cr_expect_neq(strlen(err), 0, "no reason given");
}
