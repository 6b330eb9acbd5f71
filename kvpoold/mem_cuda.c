/* mem_cuda.c — the CUDA memory backend: VMM arenas exported as POSIX fds (kvpool.h).
 *
 * Each chunk is one cuMemCreate allocation of physical memory on the device (a multiple of the
 * recommended granularity, a few large chunks rather than one per page), exported with
 * cuMemExportToShareableHandle; the daemon never maps it. A restarted daemon adopts the exported
 * fds of its predecessor (kept by the fd store) by importing them again: the fd names the same
 * physical memory, which lives as long as any handle, mapping or exported fd of it does. libcuda is opened at run time with
 * dlopen, so kvpoold has no link-time dependency on the driver and starts with the CPU backend
 * on machines without one. Compiled only where cuda.h exists (BD_HAVE_CUDA_H); elsewhere the
 * backend reports itself unsupported.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "kvpool.h"

#ifdef BD_HAVE_CUDA_H
#include "pool/bd_cudrv.h"

static const struct bd_cudrv *cu;

/* The driver (bd_cudrv.h), opened once; 0 or -errno with the reason. */
static int cu_load(char *err, size_t errlen)
{
	int e = -ENODEV;

	if (!cu)
		cu = bd_cudrv_get(&e, err, errlen);
	return cu ? 0 : e;
}

static int cuda_supported(int n_devices, char *err, size_t errlen)
{
	int count = 0, e;
	CUresult r;

	if (n_devices < 1) {
		snprintf(err, errlen, "no devices asked for");
		return -EINVAL;
	}
	e = cu_load(err, errlen);
	if (e < 0)
		return e;
	r = cu->device_count(&count);
	if (r != CUDA_SUCCESS) {
		bd_cudrv_errf(r, err, errlen, "cuDeviceGetCount");
		return -ENODEV;
	}
	if (count < n_devices) {
		snprintf(err, errlen, "%d CUDA devices, %d wanted (one per TP rank)", count,
			 n_devices);
		return -ENODEV;
	}
	return 0;
}

static int cuda_device_memory(int device, uint64_t *ret, char *err, size_t errlen)
{
	CUdevice dev;
	size_t bytes;
	CUresult r;
	int e = cu_load(err, errlen);

	if (e < 0)
		return e;
	r = cu->device_get(&dev, device);
	if (r == CUDA_SUCCESS)
		r = cu->total_mem(&bytes, dev);
	if (r != CUDA_SUCCESS) {
		bd_cudrv_errf(r, err, errlen, "device %d", device);
		return -ENODEV;
	}
	*ret = bytes;
	return 0;
}

static int cuda_granularity(int device, size_t *ret, char *err, size_t errlen)
{
	CUmemAllocationProp prop;
	size_t g = 0;
	CUresult r;
	int e = cu_load(err, errlen);

	if (e < 0)
		return e;
	bd_cudrv_chunk_prop(&prop, device);
	r = cu->granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
	if (r != CUDA_SUCCESS || g == 0 || (g & (g - 1))) {
		snprintf(err, errlen, "cuMemGetAllocationGranularity(device %d): %s", device,
			 r != CUDA_SUCCESS ? bd_cudrv_error(r) : "not a power of two");
		return -ENODEV;
	}
	*ret = g;
	return 0;
}

static void cuda_arena_destroy(struct bd_kvpool_arena *a)
{
	if (!a)
		return;
	for (size_t i = 0; i < a->n_chunks; i++) {
		if (a->chunks[i].fd >= 0)
			close(a->chunks[i].fd);
		if (a->chunks[i].handle && cu)
			cu->release((CUmemGenericAllocationHandle)a->chunks[i].handle);
	}
	a->n_chunks = 0;
	a->bytes = 0;
}

/* Makes the device's primary context current: some drivers want one for the VMM calls. */
static CUresult primary_context(int device)
{
	CUcontext ctx;
	CUdevice dev;
	CUresult r = cu->device_get(&dev, device);

	if (r == CUDA_SUCCESS)
		r = cu->ctx_retain(&ctx, dev);
	if (r == CUDA_SUCCESS)
		r = cu->ctx_set(ctx);
	return r;
}

/* What creating and adopting an arena start with: the plan's chunk count checked (-EINVAL), the
 * driver loaded (its error), ret emptied for device. */
static int arena_begin(int device, const struct bd_kvpool_plan *plan,
		       struct bd_kvpool_arena *ret, char *err, size_t errlen)
{
	int e;

	if (!plan || !ret || plan->n_chunks < 1 || plan->n_chunks > BD_POOL_MAX_CHUNKS)
		return -EINVAL;
	e = cu_load(err, errlen);
	if (e < 0)
		return e;
	memset(ret, 0, sizeof(*ret));
	ret->device = device;
	return 0;
}

static int cuda_arena_create(int device, const struct bd_kvpool_plan *plan,
			     struct bd_kvpool_arena *ret, char *err, size_t errlen)
{
	CUmemAllocationProp prop;
	CUresult r;
	int e;

	e = arena_begin(device, plan, ret, err, errlen);
	if (e < 0)
		return e;
	bd_cudrv_chunk_prop(&prop, device);
	for (size_t i = 0; i < plan->n_chunks; i++) {
		size_t bytes = bd_kvpool_plan_chunk(plan, i);
		CUmemGenericAllocationHandle h = 0;
		int fd = -1;

		r = cu->create(&h, bytes, &prop, 0);
		if (r == CUDA_ERROR_INVALID_CONTEXT && (r = primary_context(device)) == CUDA_SUCCESS)
			r = cu->create(&h, bytes, &prop, 0);
		if (r != CUDA_SUCCESS) {
			bd_cudrv_errf(r, err, errlen, "cuMemCreate(%zu bytes on device %d)", bytes,
				      device);
			e = r == CUDA_ERROR_OUT_OF_MEMORY ? -ENOMEM : -EIO;
			goto fail;
		}
		r = cu->export_handle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
		if (r != CUDA_SUCCESS) {
			cu->release(h);
			bd_cudrv_errf(r, err, errlen, "cuMemExportToShareableHandle");
			e = -EIO;
			goto fail;
		}
		ret->chunks[i] = (struct bd_kvpool_chunk){ .fd = fd, .bytes = bytes, .handle = h };
		ret->n_chunks = i + 1;
		ret->bytes += bytes;
	}
	return 0;
fail:
	cuda_arena_destroy(ret);
	return e;
}

/* The chunks of an earlier run: each fd imported (it must be a VMM allocation, pinned on this
 * device, exportable as a POSIX fd: what cuda_arena_create made), the imported handle and the fd
 * then kept as a created chunk's are. The driver cannot tell an allocation's size from its
 * handle; the sizes are the plan's, which the state record matched. */
static int cuda_arena_adopt(int device, const struct bd_kvpool_plan *plan, const int *fds,
			    struct bd_kvpool_arena *ret, char *err, size_t errlen)
{
	CUmemAllocationProp prop;
	size_t i;
	CUresult r;
	int e;

	if (!fds)
		return -EINVAL;
	e = arena_begin(device, plan, ret, err, errlen);
	if (e < 0)
		return e;
	for (i = 0; i < plan->n_chunks; i++) {
		CUmemGenericAllocationHandle h = 0;
		void *shared = (void *)(uintptr_t)fds[i];

		r = cu->import(&h, shared, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
		if (r == CUDA_ERROR_INVALID_CONTEXT && (r = primary_context(device)) == CUDA_SUCCESS)
			r = cu->import(&h, shared, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
		if (r != CUDA_SUCCESS) {
			e = -EBADMSG;
			bd_cudrv_errf(r, err, errlen, "cuMemImportFromShareableHandle(chunk %zu)", i);
			goto fail;
		}
		ret->chunks[i] = (struct bd_kvpool_chunk){ .fd = fds[i],
							   .bytes = bd_kvpool_plan_chunk(plan, i),
							   .handle = h };
		ret->n_chunks = i + 1;
		r = cu->get_prop(&prop, h);
		if (r != CUDA_SUCCESS || prop.type != CU_MEM_ALLOCATION_TYPE_PINNED ||
		    prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop.location.id != device ||
		    !(prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) {
			e = -EBADMSG;
			if (r != CUDA_SUCCESS)
				bd_cudrv_errf(r, err, errlen, "the properties of chunk %zu", i);
			else
				snprintf(err, errlen, "chunk %zu is not pinned memory of device %d "
					 "exportable as a POSIX fd", i, device);
			goto fail;
		}
		ret->bytes += ret->chunks[i].bytes;
	}
	return 0;
fail:
	/* the handles imported here go; the fds stay the caller's */
	for (i = 0; i < ret->n_chunks; i++)
		cu->release((CUmemGenericAllocationHandle)ret->chunks[i].handle);
	ret->n_chunks = 0;
	ret->bytes = 0;
	return e;
}

#else /* no cuda.h at build time */

static int cuda_supported(int n_devices, char *err, size_t errlen)
{
	(void)n_devices;
	snprintf(err, errlen, "kvpoold was built without CUDA headers");
	return -ENOSYS;
}

static int cuda_device_memory(int device, uint64_t *ret, char *err, size_t errlen)
{
	(void)device;
	(void)ret;
	return cuda_supported(1, err, errlen);
}

static int cuda_granularity(int device, size_t *ret, char *err, size_t errlen)
{
	(void)device;
	(void)ret;
	return cuda_supported(1, err, errlen);
}

static int cuda_arena_create(int device, const struct bd_kvpool_plan *plan,
			     struct bd_kvpool_arena *ret, char *err, size_t errlen)
{
	(void)device;
	(void)plan;
	(void)ret;
	return cuda_supported(1, err, errlen);
}

static int cuda_arena_adopt(int device, const struct bd_kvpool_plan *plan, const int *fds,
			    struct bd_kvpool_arena *ret, char *err, size_t errlen)
{
	(void)device;
	(void)plan;
	(void)fds;
	(void)ret;
	return cuda_supported(1, err, errlen);
}

static void cuda_arena_destroy(struct bd_kvpool_arena *a)
{
	(void)a;
}

#endif

const struct bd_kvpool_mem_ops bd_kvpool_mem_cuda = BD_KVPOOL_MEM_OPS(cuda, "cuda");
