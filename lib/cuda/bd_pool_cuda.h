/* bd_pool_cuda.h — a worker's view of kvpoold's CUDA arena: import the chunk fds of
 * an attachment (bd_pool_client.h) into this process and map them as one device range.
 *
 * The daemon creates each rank's arena as a few cuMemCreate chunks exported as POSIX fds;
 * bd_pool_attach() hands them over (SCM_RIGHTS). bd_pool_cuda_map() imports them
 * (cuMemImportFromShareableHandle), reserves one virtual range, maps the chunks back to back in
 * arena order and grants read-write access to the rank's device, so the arena is one flat
 * device buffer: layer l of page p at base + pages_offset + l·layer_stride + p·page_bytes
 * (bd_layout.h), slot s at base + slots_offset + s·slot_bytes.
 *
 * Context: the work happens on the device's primary context, retained by the map and made
 * current on the calling thread, so the CUDA runtime API (cudaMemcpy, kernel launches) used
 * afterwards on that thread reaches the same memory. The driver (libcuda.so.1) is opened at run
 * time: programs need no -lcuda.
 *
 * Coherence between processes: the memory is the same, the streams are not. A writer must
 * finish its work (cudaDeviceSynchronize or a stream/event synchronize; a copy from pageable
 * host memory may return before its DMA lands) BEFORE it tells another process the bytes are
 * there (pipe, socket, ZeroMQ message).
 *
 * CUDA layer (lib/cuda/pool_cuda.c); where the chunks go in the range is the pool layer's pure
 * bd_pool_va_plan (pool/bd_pool_va.h), unit-tested without a GPU.
 */
#ifndef BD_POOL_CUDA_H
#define BD_POOL_CUDA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pool/bd_pool_client.h"
#include "pool/bd_pool_va.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Imports and maps the arena of attachment a (CUDA backend) on its geometry's device.
 * *ret_base: the device address of byte 0 of the arena (arena_bytes mapped read-write; the
 * virtual range reserved may be longer, rounded to the allocation granularity). err (errlen
 * bytes, may be NULL) gets a one-line reason on failure. All or nothing: on failure every chunk
 * imported or mapped, the range and the context reference are released, *ret_base untouched.
 * The fds stay owned by a (the import dups nothing; a may be detached after unmapping only).
 * Returns 0, or:
 *   -EINVAL   a or ret_base NULL, the attachment is not of the "cuda" backend, or its chunk
 *             sizes are not multiples of the device's granularity (bd_pool_va_plan, pool/bd_pool_va.h);
 *   -ENODEV   no driver (libcuda.so.1), cuInit failed, or no such device;
 *   -ENOSYS   the driver lacks a VMM entry point;
 *   -ENOMEM   out of virtual address space or memory;
 *   -EIO      another driver error (its name in err). */
int bd_pool_cuda_map(const struct bd_pool_attach *a, void **ret_base, char *err, size_t errlen);

/* Undoes bd_pool_cuda_map(a, &base): unmaps every chunk (the imported memory goes when the
 * daemon and every other importer let go of it too), frees the virtual range, releases the
 * primary context reference. The caller synchronizes its work on the arena first. NULL a or
 * base is a no-op. */
void bd_pool_cuda_unmap(const struct bd_pool_attach *a, void *base);

/* Zeroes page id (every layer) or, with slot, slot id of the arena of geometry g mapped at base
 * (bd_pool_cuda_map), enqueued on stream (a cudaStream_t; NULL: the legacy default stream)
 * without waiting: work enqueued after it on that stream sees zeros. The CUDA backend's scrub:
 * kvpoold does not map device memory, so a worker clears a page or slot when a step plan first
 * gives it to a request (its new pages, a new sequence's slot), before the step writes it;
 * the bytes of the spans of bd_pool_scrub_span. Returns 0, -EINVAL (NULL g or base), -ERANGE
 * (id out of range), -EIO (the memset was refused; err says why). */
int bd_pool_cuda_scrub(const struct bd_pool_geometry *g, void *base, bool slot, int32_t id,
		       void *stream, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif
