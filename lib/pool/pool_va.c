/* pool_va.c — where each chunk of a CUDA arena goes in its virtual range (bd_pool_va.h). */
#include <errno.h>

#include "pool/bd_pool_va.h"

int bd_pool_va_plan(const struct bd_pool_geometry *g, size_t granularity,
		    size_t *ret_va_bytes, size_t *ret_offsets)
{
	size_t off = 0, va;

	if (!g || !ret_va_bytes || granularity == 0 || (granularity & (granularity - 1)) ||
	    g->n_chunks < 1 || g->n_chunks > BD_POOL_MAX_CHUNKS)
		return -EINVAL;
	/* check everything before writing anything */
	for (size_t i = 0; i < g->n_chunks; i++) {
		uint64_t c = g->chunk_bytes[i];

		if (c == 0 || c % granularity || c > SIZE_MAX ||
		    __builtin_add_overflow(off, (size_t)c, &off))
			return -EINVAL;
	}
	if (off != g->arena_bytes)
		return -EINVAL;
	va = off; /* a sum of whole granules is one */
	if (ret_offsets) {
		off = 0;
		for (size_t i = 0; i < g->n_chunks; i++) {
			ret_offsets[i] = off;
			off += (size_t)g->chunk_bytes[i];
		}
	}
	*ret_va_bytes = va;
	return 0;
}

int bd_pool_scrub_span(const struct bd_pool_geometry *g, bool slot, int32_t id,
		       struct bd_pool_span *ret)
{
	if (!g || !ret)
		return -EINVAL;
	if (id < 0 || (size_t)id >= (slot ? g->n_slots : g->n_pages))
		return -ERANGE;
	if (slot)
		*ret = (struct bd_pool_span){ .offset = g->slots_offset +
							(size_t)id * g->layout.slot_bytes,
					      .pitch = g->layout.slot_bytes,
					      .width = g->layout.slot_bytes, .height = 1 };
	else
		*ret = (struct bd_pool_span){ .offset = g->pages_offset +
							(size_t)id * g->layout.page_bytes,
					      .pitch = g->layout.layer_stride,
					      .width = g->layout.page_bytes,
					      .height = (size_t)g->layout.n_layers };
	return 0;
}
