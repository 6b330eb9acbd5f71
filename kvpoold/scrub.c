/* scrub.c — zeroing what the allocator frees (kvpool.h "scrubbing"): the CPU backend's arenas
 * mapped in kvpoold, and the allocator's hook that clears a page (every layer, every rank) or
 * a slot the moment it becomes free, so that the next request to get it — of any owner — never
 * reads the KV of the one before.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "pool/bd_pool_va.h"
#include "kvpool.h"

struct bd_kvpool_scrub {
	struct bd_pool_geometry geo; /* what bd_pool_scrub_span reads of the plan */
	const struct bd_kvpool_arena *arenas;
	int n_arenas;
	uint8_t *(*map)[BD_POOL_MAX_CHUNKS]; /* [n_arenas][chunk] */
	uint64_t bytes;
};

void bd_kvpool_scrub_free(struct bd_kvpool_scrub *s)
{
	if (!s)
		return;
	for (int r = 0; s->map && r < s->n_arenas; r++)
		for (size_t i = 0; i < s->arenas[r].n_chunks; i++)
			if (s->map[r][i])
				munmap(s->map[r][i], s->arenas[r].chunks[i].bytes);
	free(s->map);
	free(s);
}

int bd_kvpool_scrub_new(const struct bd_kvpool_plan *plan, const struct bd_kvpool_arena *arenas,
			int n_arenas, struct bd_kvpool_scrub **ret, char *err, size_t errlen)
{
	struct bd_kvpool_scrub *s;
	int e;

	if (!plan || !arenas || n_arenas < 1 || !ret)
		return -EINVAL;
	s = calloc(1, sizeof(*s));
	if (s)
		s->map = calloc((size_t)n_arenas, sizeof(*s->map));
	if (!s || !s->map) {
		free(s);
		snprintf(err, errlen, "out of memory");
		return -ENOMEM;
	}
	s->geo = (struct bd_pool_geometry){ .layout = plan->layout, .n_pages = plan->n_pages,
					    .n_slots = plan->n_slots,
					    .pages_offset = plan->pages_offset,
					    .slots_offset = plan->slots_offset };
	s->arenas = arenas;
	s->n_arenas = n_arenas;
	for (int r = 0; r < n_arenas; r++)
		for (size_t i = 0; i < arenas[r].n_chunks; i++) {
			void *m = mmap(NULL, arenas[r].chunks[i].bytes, PROT_READ | PROT_WRITE,
				       MAP_SHARED, arenas[r].chunks[i].fd, 0);

			if (m == MAP_FAILED) {
				e = -errno;
				snprintf(err, errlen, "mapping chunk %zu of rank %d: %s", i, r,
					 strerror(-e));
				bd_kvpool_scrub_free(s);
				return e;
			}
			s->map[r][i] = m;
		}
	*ret = s;
	return 0;
}

/* Zeroes bytes [off, off + len) of rank r's arena, across chunk boundaries. */
static void zero_range(struct bd_kvpool_scrub *s, int r, size_t off, size_t len)
{
	const struct bd_kvpool_arena *ar = &s->arenas[r];
	size_t base = 0;

	for (size_t i = 0; i < ar->n_chunks && len; i++) {
		size_t sz = ar->chunks[i].bytes;

		if (off < base + sz) {
			size_t at = off - base, n = sz - at < len ? sz - at : len;

			memset(s->map[r][i] + at, 0, n);
			off += n;
			len -= n;
			s->bytes += n;
		}
		base += sz;
	}
}

void bd_kvpool_scrub_hook(void *ctx, bool slot, int32_t id)
{
	struct bd_kvpool_scrub *s = ctx;
	struct bd_pool_span sp;

	/* the same bytes a worker of the cuda backend clears (bd_pool_cuda_scrub) */
	if (bd_pool_scrub_span(&s->geo, slot, id, &sp) < 0)
		return;
	for (int r = 0; r < s->n_arenas; r++)
		for (size_t k = 0; k < sp.height; k++)
			zero_range(s, r, sp.offset + k * sp.pitch, sp.width);
}

uint64_t bd_kvpool_scrub_bytes(const struct bd_kvpool_scrub *s)
{
	return s ? s->bytes : 0;
}
