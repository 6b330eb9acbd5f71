/* bd_pool_cuda.h — a worker's view of kvpoold's CUDA arena (issue 4): import the chunk fds of
 * an attachment (bd_pool.h) into this process and map them as one device range.
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
 * Lives in libbdfp4_cuda.a (lib/pool_import_cuda.c); bd_pool_cuda_va_plan() is pure and lives
 * in the CPU library (lib/pool_import.c) so it is unit-tested without a GPU.
 */
#ifndef BD_POOL_CUDA_H
#define BD_POOL_CUDA_H

#include <stddef.h>

#include "bd_pool.h"

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
 *             sizes are not multiples of the device's granularity (bd_pool_cuda_va_plan);
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

/* Where the chunks of geometry g go in a virtual range whose start is aligned to granularity
 * (a power of two, bytes): chunk i at byte ret_offsets[i] (ret_offsets holds g->n_chunks
 * entries, may be NULL), the range *ret_va_bytes long (arena_bytes rounded up to granularity).
 * Each chunk must be a non-zero multiple of granularity (cuMemMap maps whole granules) and
 * the chunks must add up to arena_bytes exactly, with 1..BD_POOL_MAX_CHUNKS chunks.
 * Returns 0, or -EINVAL (outputs untouched). */
int bd_pool_cuda_va_plan(const struct bd_pool_geometry *g, size_t granularity,
			 size_t *ret_va_bytes, size_t *ret_offsets);

#ifdef __cplusplus
}
#endif
#endif
