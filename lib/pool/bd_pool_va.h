/* bd_pool_va.h — where the chunks of a kvpoold CUDA arena go in one virtual address range.
 *
 * The pure half of importing an arena on a GPU (cuda/bd_pool_cuda.h maps it): no driver calls,
 * so the CPU tests check it.
 */
#ifndef BD_POOL_VA_H
#define BD_POOL_VA_H

#include <stddef.h>

#include "pool/bd_pool_client.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Where the chunks of geometry g go in a virtual range whose start is aligned to granularity
 * (a power of two, bytes): chunk i at byte ret_offsets[i] (ret_offsets holds g->n_chunks
 * entries, may be NULL), the range *ret_va_bytes long (arena_bytes rounded up to granularity).
 * Each chunk must be a non-zero multiple of granularity (cuMemMap maps whole granules) and
 * the chunks must add up to arena_bytes exactly, with 1..BD_POOL_MAX_CHUNKS chunks.
 * Returns 0, or -EINVAL (outputs untouched). */
int bd_pool_va_plan(const struct bd_pool_geometry *g, size_t granularity,
		    size_t *ret_va_bytes, size_t *ret_offsets);

/* The bytes of page id (every layer) or, with slot, of slot id in an arena of geometry g, as a
 * 2-D span from the arena's byte 0: height rows of width bytes, row r at offset + r·pitch (a
 * page: one row per layer, pitch layer_stride, width page_bytes; a slot: one row of slot_bytes).
 * What a worker zeroes when a page or slot becomes a request's (bd_pool_cuda_scrub).
 * Returns 0, or -ERANGE (id outside 0..n_pages−1 or 0..n_slots−1; *ret untouched), -EINVAL. */
struct bd_pool_span {
	size_t offset, pitch, width, height;
};
int bd_pool_scrub_span(const struct bd_pool_geometry *g, bool slot, int32_t id,
		       struct bd_pool_span *ret);

#ifdef __cplusplus
}
#endif
#endif
