/* test_kvmem_pool.c — the bd_kvmem over memory someone else allocates (bd_kvmem.h
 * bd_kvmem_ext_*, lib/model/kvmem.c; bd_kvmem_pool.h): what a sequence draws is what the
 * plan queued, ids outside the arena are refused without touching the queue, and a sequence
 * over it computes exactly what it computes over the private arena. Suite "kvmem_pool".
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <criterion/criterion.h>

#include "model/bd_forward.h"
#include "pool/bd_kvmem_pool.h"
#include "model_fill.h"

struct arena {
	struct bd_layout lay;
	void *pages, *slots;
	size_t n_slots;
};

static void arena_new(struct arena *a, int layers, int heads, int d, size_t n_pages,
		      size_t n_slots)
{
	cr_assert_eq(bd_layout_init(&a->lay, BD_PAGE_NVFP4, layers, heads, d, 0, n_pages), 0);
	a->pages = aligned_alloc(BD_PAGE_ALIGN, a->lay.arena_bytes);
	a->slots = aligned_alloc(BD_PAGE_ALIGN, n_slots * a->lay.slot_bytes);
	cr_assert(a->pages && a->slots);
	memset(a->pages, 0, a->lay.arena_bytes);
	memset(a->slots, 0, n_slots * a->lay.slot_bytes);
	a->n_slots = n_slots;
}

static void arena_free(struct arena *a)
{
	free(a->pages);
	free(a->slots);
}

Test(kvmem_pool, draws_what_was_queued)
{
	struct arena a;
	struct bd_kvmem *mem;
	arena_new(&a, 2, 1, 32, 5, 3);
	cr_assert_eq(bd_kvmem_ext_new(&a.lay, a.pages, a.slots, a.n_slots, &mem), 0);
	cr_assert_eq(mem->arena, a.pages);
	cr_assert_eq(mem->lay.page_bytes, a.lay.page_bytes);

	int32_t pg, q[2] = { 4, 2 };
	void *slot;
	/* nothing queued: nothing to draw */
	cr_assert_eq(mem->ops->page_alloc(mem, &pg), -ENOSPC);
	cr_assert_eq(mem->ops->slot_alloc(mem, &slot), -ENOSPC);

	cr_assert_eq(bd_kvmem_ext_provide(mem, 2, q, 2), 0);
	cr_assert_eq(bd_kvmem_ext_pending(mem), 2);
	cr_assert_eq(mem->ops->slot_alloc(mem, &slot), 0);
	cr_assert_eq(slot, (uint8_t *)a.slots + 2 * a.lay.slot_bytes);
	cr_assert_eq(bd_kvmem_ext_slot_id(mem, slot), 2);
	cr_assert_eq(mem->ops->slot_alloc(mem, &slot), -ENOSPC); /* one slot per queueing */
	cr_assert_eq(mem->ops->page_alloc(mem, &pg), 0);
	cr_assert_eq(pg, 4);
	cr_assert_eq(bd_kvmem_ext_pending(mem), 1);
	cr_assert_eq(mem->ops->page_alloc(mem, &pg), 0);
	cr_assert_eq(pg, 2);
	cr_assert_eq(mem->ops->page_alloc(mem, &pg), -ENOSPC);
	cr_assert_eq(bd_kvmem_ext_pending(mem), 0);
	/* freeing gives nothing back to this side: the router releases through kvpoold */
	mem->ops->page_free(mem, 4);
	mem->ops->slot_free(mem, slot);
	cr_assert_eq(mem->ops->page_alloc(mem, &pg), -ENOSPC);

	/* a new queue replaces what was left */
	cr_assert_eq(bd_kvmem_ext_provide(mem, -1, q, 2), 0);
	cr_assert_eq(bd_kvmem_ext_provide(mem, 0, q + 1, 1), 0);
	cr_assert_eq(bd_kvmem_ext_pending(mem), 1);
	cr_assert_eq(mem->ops->page_alloc(mem, &pg), 0);
	cr_assert_eq(pg, 2);
	bd_kvmem_ext_free(mem);
	bd_kvmem_ext_free(NULL);
	arena_free(&a);
}

Test(kvmem_pool, bad_ids_leave_the_queue)
{
	struct arena a;
	struct bd_kvmem *mem, *keep = (void *)0x1;
	arena_new(&a, 1, 1, 32, 5, 2);
	cr_assert_eq(bd_kvmem_ext_new(NULL, a.pages, a.slots, 2, &keep), -EINVAL);
	cr_assert_eq(bd_kvmem_ext_new(&a.lay, NULL, a.slots, 2, &keep), -EINVAL);
	cr_assert_eq(bd_kvmem_ext_new(&a.lay, a.pages, a.slots, 0, &keep), -EINVAL);
	cr_assert_eq(bd_kvmem_pool_new(NULL, &keep), -EINVAL);
	cr_assert_eq(keep, (void *)0x1);
	cr_assert_eq(bd_kvmem_ext_new(&a.lay, a.pages, a.slots, 2, &mem), 0);

	int32_t good[2] = { 1, 3 }, bad[2] = { 0, 5 }, neg = -1, pg;
	cr_assert_eq(bd_kvmem_ext_provide(mem, 1, good, 2), 0);
	cr_assert_eq(bd_kvmem_ext_provide(mem, 0, bad, 2), -ERANGE);   /* page 5 of 0..4 */
	cr_assert_eq(bd_kvmem_ext_provide(mem, 0, &neg, 1), -ERANGE);
	cr_assert_eq(bd_kvmem_ext_provide(mem, 2, good, 2), -ERANGE);  /* slot 2 of 0..1 */
	cr_assert_eq(bd_kvmem_ext_provide(mem, -2, good, 2), -ERANGE);
	cr_assert_eq(bd_kvmem_ext_provide(mem, 0, NULL, 1), -EINVAL);
	cr_assert_eq(bd_kvmem_ext_provide(mem, 0, good, -1), -EINVAL);
	cr_assert_eq(bd_kvmem_ext_provide(mem, 0, good, BD_KVMEM_EXT_MAX_QUEUE + 1), -EINVAL);
	cr_assert_eq(bd_kvmem_ext_provide(NULL, 0, good, 1), -EINVAL);
	/* the first queue is intact */
	void *slot;
	cr_assert_eq(bd_kvmem_ext_pending(mem), 2);
	cr_assert_eq(mem->ops->slot_alloc(mem, &slot), 0);
	cr_assert_eq(bd_kvmem_ext_slot_id(mem, slot), 1);
	cr_assert_eq(mem->ops->page_alloc(mem, &pg), 0);
	cr_assert_eq(pg, 1);

	/* slot ids of pointers that are not slot starts */
	cr_assert_eq(bd_kvmem_ext_slot_id(mem, (uint8_t *)a.slots + 8), -1);
	cr_assert_eq(bd_kvmem_ext_slot_id(mem, (uint8_t *)a.slots + 2 * a.lay.slot_bytes), -1);
	cr_assert_eq(bd_kvmem_ext_slot_id(mem, a.pages), -1);
	cr_assert_eq(bd_kvmem_ext_slot_id(mem, NULL), -1);

	/* the private arena is not an ext kvmem */
	struct bd_kvmem *pm;
	cr_assert_eq(bd_kvmem_private_new(&a.lay, &pm), 0);
	cr_assert_eq(bd_kvmem_ext_provide(pm, 0, good, 1), -EINVAL);
	cr_assert_eq(bd_kvmem_ext_pending(pm), -EINVAL);
	cr_assert_eq(bd_kvmem_ext_slot_id(pm, a.slots), -1);
	bd_kvmem_private_free(pm);
	bd_kvmem_ext_free(mem);
	arena_free(&a);
}

static uint64_t rng_state = 0x243f6a8885a308d3ull;

static void fill(float *p, size_t n, float mean, float sd)
{
	for (size_t i = 0; i < n; i++)
		p[i] = mean + sd * mf_normal(&rng_state);
}

/* A tied Llama of E = d = 32 with one KV head, every weight drawn N(0, 0.3²). */
static struct bd_model *tiny_llama(int n_layers, int n_ff, int n_heads, int n_vocab, int n_ctx)
{
	struct bd_model_hparams hp = {
		.arch = BD_ARCH_LLAMA, .n_layers = n_layers, .n_embd = 32, .n_ff = n_ff,
		.n_heads = n_heads, .n_kv_heads = 1, .head_dim = 32, .head_dim_v = 32,
		.n_rot = 32, .rope_style = BD_ROPE_NORM, .rope_base = 10000.0f, .norm_eps = 1e-5f,
		.n_ctx_train = n_ctx, .n_vocab = n_vocab, .tied_embeddings = true,
	};
	struct bd_model *m;
	cr_assert_eq(bd_model_alloc(&hp, &m), 0);
	fill(m->mem, m->mem_bytes / sizeof(float), 0.0f, 0.3f);
	return m;
}

/* Over the ext arena, with the plan's page ids (3 then 0) and slot 1, a sequence gives the
 * same logits bit for bit as over its private arena, its block table holds the plan's ids,
 * and only those pages of the arena are written. 200 prompt tokens (page 0 in the prefill), 60 decode
 * steps (page 1 at position 255). */
Test(kvmem_pool, sequence_matches_private_arena)
{
	struct bd_model *m = tiny_llama(2, 24, 2, 29, 512);
	for (int l = 0; l < 2; l++) {
		fill(m->layers[l].attn_norm, 32, 1.0f, 0.1f);
		fill(m->layers[l].ffn_norm, 32, 1.0f, 0.1f);
	}
	fill(m->output_norm, 32, 1.0f, 0.1f);

	const struct bd_kvcfg *cfg = bd_kvcfg_find("bitdecoding-nvfp4");
	const int n = 200, steps = 60, V = 29;
	int32_t prompt[200];
	for (int i = 0; i < n; i++)
		prompt[i] = (i * 5 + 1) % V;
	float la[29], lb[29];
	struct bd_seq *sa, *sb;
	struct bd_seq_opts oa = { .max_tokens = n + steps };
	cr_assert_eq(bd_seq_new(m, cfg, &oa, &sa, NULL), 0);

	struct arena a;
	struct bd_kvmem *mem;
	arena_new(&a, 2, 1, 32, 4, 2);
	cr_assert_eq(bd_kvmem_ext_new(&a.lay, a.pages, a.slots, 2, &mem), 0);
	int32_t p0 = 3, p1 = 0;
	cr_assert_eq(bd_kvmem_ext_provide(mem, 1, &p0, 1), 0);
	struct bd_seq_opts ob = { .max_tokens = n + steps, .mem = mem };
	cr_assert_eq(bd_seq_new(m, cfg, &ob, &sb, NULL), 0);
	cr_assert_eq(bd_kvmem_ext_slot_id(mem, bd_seq_slot(sb)), 1);

	cr_assert_eq(bd_model_prefill(m, sa, prompt, n, la), 0);
	cr_assert_eq(bd_model_prefill(m, sb, prompt, n, lb), 0);
	cr_assert_eq(memcmp(la, lb, sizeof(la)), 0);
	cr_assert_eq(bd_kvmem_ext_pending(mem), 0);
	for (int i = 0; i < steps; i++) {
		int pos = n + i;
		cr_assert_eq(bd_kvmem_ext_provide(mem, -1, &p1, (pos + 1) % 128 == 0), 0);
		int32_t t = (i * 3 + 2) % V;
		cr_assert_eq(bd_model_decode(m, sa, t, la), 0);
		cr_assert_eq(bd_model_decode(m, sb, t, lb), 0);
		cr_assert_eq(memcmp(la, lb, sizeof(la)), 0, "step %d", i);
	}
	cr_assert_eq(bd_kvmem_ext_pending(mem), 0);
	const int32_t *bta, *btb;
	cr_assert_eq(bd_seq_block_table(sa, &bta), 2);
	cr_assert_eq(bd_seq_block_table(sb, &btb), 2);
	cr_assert(btb[0] == 3 && btb[1] == 0);
	/* the plan's pages hold the promoted tokens */
	float kb[128 * 32], vb[128 * 32];
	for (int l = 0; l < 2; l++) {
		for (int j = 0; j < 2; j++) {
			const void *pg = bd_layout_page(&a.lay, a.pages, l, btb[j]);
			cr_assert_eq(bd_page_read_head(&a.lay, pg, 0, kb, vb, NULL), 0);
			float amax = 0.0f;
			for (int i = 0; i < 128 * 32; i++)
				amax = fmaxf(amax, fabsf(kb[i]) + fabsf(vb[i]));
			cr_assert_gt(amax, 0.0f, "layer %d: page %d was never written", l, btb[j]);
		}
	}
	/* pages 1 and 2 of the arena were named by no plan: untouched */
	for (int l = 0; l < 2; l++)
		for (int32_t p = 1; p <= 2; p++) {
			const uint8_t *pg = bd_layout_page(&a.lay, a.pages, l, p);
			for (size_t i = 0; i < a.lay.page_bytes; i++)
				cr_assert_eq(pg[i], 0, "layer %d page %d byte %zu", l, p, i);
		}
	bd_seq_free(sa);
	bd_seq_free(sb);
	bd_kvmem_ext_free(mem);
	arena_free(&a);
	bd_model_free(m);
}

/* Pages given to a sequence go first, in order; then it draws from its kvmem; only the drawn
 * ones go back to the kvmem when it is freed. Private arena of 4 pages, a tiny model. */
Test(kvmem_pool, given_pages_go_first)
{
	struct bd_model *m = tiny_llama(1, 16, 1, 11, 1024);
	struct bd_layout lay;
	struct bd_kvmem *mem;
	cr_assert_eq(bd_layout_init(&lay, BD_PAGE_NVFP4, 1, 1, 32, 0, 4), 0);
	cr_assert_eq(bd_kvmem_private_new(&lay, &mem), 0);
	const struct bd_kvcfg *cfg = bd_kvcfg_find("bitdecoding-nvfp4");
	struct bd_seq_opts o = { .max_tokens = 384, .mem = mem };
	struct bd_seq *a, *b;
	int32_t toks[384];
	for (int i = 0; i < 384; i++)
		toks[i] = i % 11;
	cr_assert_eq(bd_seq_new(m, cfg, &o, &a, NULL), 0);

	int32_t three = 3, four = 4, many[4] = { 3, 2, 1, 0 };
	cr_assert_eq(bd_seq_give_pages(a, &four, 1), -ERANGE);
	cr_assert_eq(bd_seq_give_pages(a, many, 4), -EINVAL); /* 384 tokens: 3 pages at most */
	cr_assert_eq(bd_seq_give_pages(a, NULL, 1), -EINVAL);
	cr_assert_eq(bd_seq_given_pages(a), 0);
	cr_assert_eq(bd_seq_give_pages(a, &three, 1), 0);
	cr_assert_eq(bd_seq_given_pages(a), 1);
	cr_assert_eq(bd_model_prefill(m, a, toks, 256, NULL), 0);
	const int32_t *bt;
	cr_assert_eq(bd_seq_block_table(a, &bt), 2);
	cr_assert_eq(bt[0], 3, "the given page first");
	cr_assert_eq(bt[1], 0, "then the kvmem's first free page");
	cr_assert_eq(bd_seq_given_pages(a), 0);

	/* b draws while a holds page 0: pages 1 and 2 (page 3 is the caller's, not the arena's) */
	cr_assert_eq(bd_seq_new(m, cfg, &o, &b, NULL), 0);
	cr_assert_eq(bd_model_prefill(m, b, toks, 256, NULL), 0);
	cr_assert_eq(bd_seq_block_table(b, &bt), 2);
	cr_assert(bt[0] == 1 && bt[1] == 2, "b drew %d, %d", bt[0], bt[1]);
	bd_seq_free(b);
	bd_seq_free(a); /* gives page 0 back, not page 3 */

	cr_assert_eq(bd_seq_new(m, cfg, &o, &b, NULL), 0);
	cr_assert_eq(bd_model_prefill(m, b, toks, 384, NULL), 0);
	cr_assert_eq(bd_seq_block_table(b, &bt), 3);
	cr_assert(bt[0] == 0 && bt[1] == 1 && bt[2] == 2, "b drew %d, %d, %d", bt[0], bt[1],
		  bt[2]);
	bd_seq_free(b);
	bd_kvmem_private_free(mem);
	bd_model_free(m);
}
