/* plan.c — how big one device's arena is and how it is cut (kvpool.h).
 *
 * Arena: the pages of every layer (bd_layout.h, n_pages · n_layers · page_bytes) at offset 0,
 * then, from the next 4 KiB boundary, n_slots BF16 slots; the whole rounded up to the
 * allocation granularity and cut into chunks of at most chunk_bytes (the last one shorter).
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "kvpool.h"

#define SLOT_ALIGN 4096

static size_t round_up(size_t x, size_t a)
{
	return (x + a - 1) / a * a;
}

/* bytes of the arena for n pages (0 on overflow) */
static size_t arena_for(const struct bd_kvpool_params *p, size_t page_all_layers, size_t slot,
			size_t n, size_t *ret_slots_off)
{
	size_t pages, off, total;

	if (__builtin_mul_overflow(n, page_all_layers, &pages) ||
	    pages > SIZE_MAX - 2 * SLOT_ALIGN)
		return 0;
	off = round_up(pages, SLOT_ALIGN);
	if (__builtin_mul_overflow(p->n_slots, slot, &total) ||
	    __builtin_add_overflow(total, off, &total) ||
	    total > SIZE_MAX - p->granularity)
		return 0;
	*ret_slots_off = off;
	return total;
}

static void human(char *buf, size_t len, uint64_t b)
{
	if (b >= (1ull << 30))
		snprintf(buf, len, "%.2f GiB", (double)b / (double)(1ull << 30));
	else
		snprintf(buf, len, "%.2f MiB", (double)b / (double)(1ull << 20));
}

int bd_kvpool_plan(const struct bd_kvpool_params *p, struct bd_kvpool_plan *ret, char *err,
		   size_t errlen)
{
	struct bd_layout one;
	size_t page_all, need_pages, n, slots_off = 0, used, chunk;
	char b1[32], b2[32], b3[32];
	int e;

	if (!p || !ret || !err || !errlen)
		return -EINVAL;
	err[0] = 0;
	if (p->max_seq_len == 0 || p->n_slots < 1 || p->n_slots > INT32_MAX ||
	    p->granularity == 0 || (p->granularity & (p->granularity - 1)) ||
	    p->chunk_bytes == 0 || p->n_pages > INT32_MAX) {
		snprintf(err, errlen, "bad pool parameters (max_seq_len, slots, granularity or "
				      "chunk size)");
		return -EINVAL;
	}
	e = bd_layout_init(&one, p->fmt, p->n_layers, p->n_kv_heads, p->d, p->d_rope, 1);
	if (e < 0) {
		snprintf(err, errlen,
			 "the page layout refuses %d layers, %d KV heads, head_dim %d, d_rope %d "
			 "in format %s", p->n_layers, p->n_kv_heads, p->d, p->d_rope,
			 bd_page_format_name(p->fmt));
		return e;
	}
	page_all = one.layer_stride * (size_t)p->n_layers; /* one page, every layer */
	need_pages = (p->max_seq_len + BD_PAGE_TOKENS - 1) / BD_PAGE_TOKENS;

	if (p->n_pages) {
		n = p->n_pages;
	} else {
		/* the largest n whose arena, rounded to the granularity, fits the budget */
		uint64_t budget = p->budget_bytes / p->granularity * p->granularity;
		uint64_t fixed = (uint64_t)p->n_slots * one.slot_bytes;

		n = budget > fixed ? (size_t)((budget - fixed) / page_all) : 0;
		if (n > INT32_MAX)
			n = INT32_MAX;
		while (n > 0) {
			size_t t = arena_for(p, page_all, one.slot_bytes, n, &slots_off);

			if (t && round_up(t, p->granularity) <= budget)
				break;
			n--;
		}
	}
	if (n < need_pages || n == 0) {
		human(b1, sizeof(b1), p->budget_bytes);
		human(b2, sizeof(b2), (uint64_t)need_pages * page_all);
		human(b3, sizeof(b3), one.slot_bytes);
		if (p->n_pages)
			snprintf(err, errlen,
				 "pool of %zu pages cannot hold one request of max_seq_len=%u "
				 "tokens: it needs %zu pages of 128 tokens (%s); raise pages or "
				 "lower max_seq_len", n, p->max_seq_len, need_pages, b2);
		else
			snprintf(err, errlen,
				 "pool budget of %s per device holds %zu pages (%zu tokens) with "
				 "%zu slots of %s; one request of max_seq_len=%u tokens needs %zu "
				 "pages (%s) plus one slot: raise memory_bytes or "
				 "gpu_memory_fraction, or lower max_seq_len or slots",
				 b1, n, n * BD_PAGE_TOKENS, p->n_slots, b3, p->max_seq_len,
				 need_pages, b2);
		return -ENOSPC;
	}
	memset(ret, 0, sizeof(*ret));
	e = bd_layout_init(&ret->layout, p->fmt, p->n_layers, p->n_kv_heads, p->d, p->d_rope, n);
	if (e < 0) {
		snprintf(err, errlen, "%zu pages overflow the arena size", n);
		return e;
	}
	used = arena_for(p, page_all, one.slot_bytes, n, &slots_off);
	if (!used) {
		snprintf(err, errlen, "%zu pages overflow the arena size", n);
		return -EOVERFLOW;
	}
	ret->n_pages = n;
	ret->n_slots = p->n_slots;
	ret->pages_offset = 0;
	ret->slots_offset = slots_off;
	ret->used_bytes = used;
	ret->arena_bytes = round_up(used, p->granularity);
	/* chunks: as few as BD_POOL_MAX_CHUNKS allows, none above chunk_bytes if possible */
	chunk = round_up(p->chunk_bytes, p->granularity);
	if (chunk > ret->arena_bytes)
		chunk = ret->arena_bytes;
	while ((ret->arena_bytes + chunk - 1) / chunk > BD_POOL_MAX_CHUNKS)
		chunk *= 2;
	ret->chunk_bytes = chunk;
	ret->n_chunks = (ret->arena_bytes + chunk - 1) / chunk;
	ret->last_chunk_bytes = ret->arena_bytes - (ret->n_chunks - 1) * chunk;
	ret->max_pages_per_request = (uint32_t)need_pages;
	return 0;
}

size_t bd_kvpool_plan_chunk(const struct bd_kvpool_plan *p, size_t i)
{
	return i + 1 < p->n_chunks ? p->chunk_bytes : p->last_chunk_bytes;
}
