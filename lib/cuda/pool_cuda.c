/* pool_cuda.c — import kvpoold's CUDA arena chunks and map them as one range
 * (bd_pool_cuda.h).
 *
 * Driver API through dlopen("libcuda.so.1"), like kvpoold/mem_cuda.c: the CUDA runtime (static)
 * opens the same library, so this adds no link dependency. The imported handles are released
 * right after mapping: the mapping keeps the memory alive, and unmapping then needs nothing
 * but the geometry. The scrub (bd_pool_cuda_scrub) is a runtime memset on the caller's stream,
 * ordered with the kernels that stream runs.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "base/bd_err.h"
#include "pool/bd_cudrv.h"
#include "cuda/bd_pool_cuda.h"

static const struct bd_cudrv *cu;

/* The driver (bd_cudrv.h), opened once per process; 0 or -errno with the reason. */
static int cu_load(char *err, size_t errlen)
{
	int e = -ENODEV;
	const struct bd_cudrv *d = bd_cudrv_get(&e, err, errlen);

	if (!d)
		return e;
	cu = d;
	return 0;
}

/* Minimum (what cuMemMap needs) and recommended (the alignment the daemon used) granularity. */
static CUresult granularities(int device, size_t *ret_min, size_t *ret_rec)
{
	CUmemAllocationProp prop;
	CUresult r;

	bd_cudrv_chunk_prop(&prop, device);
	r = cu->granularity(ret_min, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
	if (r == CUDA_SUCCESS)
		r = cu->granularity(ret_rec, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
	return r;
}

int bd_pool_cuda_map(const struct bd_pool_attach *a, void **ret_base, char *err, size_t errlen)
{
	const struct bd_pool_geometry *g;
	size_t offsets[BD_POOL_MAX_CHUNKS], va_bytes, gmin = 0, grec = 0, n_mapped = 0, n_fds;
	const int *fds;
	CUmemAccessDesc access;
	CUdeviceptr base = 0;
	CUcontext ctx = NULL;
	CUdevice dev;
	CUresult r;
	int e;

	if (err && errlen)
		err[0] = 0;
	if (!a || !ret_base)
		return bd_errf(err, errlen, -EINVAL, "no attachment or no output");
	g = bd_pool_attach_geometry(a);
	n_fds = bd_pool_attach_chunks(a, &fds);
	if (strcmp(g->backend, "cuda"))
		return bd_errf(err, errlen, -EINVAL, "the pool's backend is %s, not cuda",
			       g->backend);
	if (n_fds != g->n_chunks || g->device < 0)
		return bd_errf(err, errlen, -EINVAL,
			       "attachment of %zu fds for %zu chunks on device %d", n_fds,
			       g->n_chunks, g->device);
	e = cu_load(err, errlen);
	if (e < 0)
		return e;
	r = cu->device_get(&dev, g->device);
	if (r != CUDA_SUCCESS) {
		bd_cudrv_errf(r, err, errlen, "device %d", g->device);
		return -ENODEV;
	}
	r = cu->ctx_retain(&ctx, dev);
	if (r != CUDA_SUCCESS)
		return bd_cudrv_errf(r, err, errlen, "cuDevicePrimaryCtxRetain(device %d)",
				     g->device);
	r = cu->ctx_set(ctx);
	if (r != CUDA_SUCCESS) {
		e = bd_cudrv_errf(r, err, errlen, "cuCtxSetCurrent(device %d)", g->device);
		goto fail_ctx;
	}
	r = granularities(g->device, &gmin, &grec);
	if (r != CUDA_SUCCESS) {
		e = bd_cudrv_errf(r, err, errlen, "cuMemGetAllocationGranularity(device %d)",
				  g->device);
		goto fail_ctx;
	}
	e = bd_pool_va_plan(g, gmin, &va_bytes, offsets);
	if (e < 0) {
		bd_errf(err, errlen, e, "arena of %zu bytes in %zu chunks: not whole granules of "
			"%zu bytes on device %d", g->arena_bytes, g->n_chunks, gmin, g->device);
		goto fail_ctx;
	}
	r = cu->reserve(&base, va_bytes, grec > gmin ? grec : gmin, 0, 0);
	if (r != CUDA_SUCCESS) {
		e = bd_cudrv_errf(r, err, errlen, "cuMemAddressReserve(%zu bytes)", va_bytes);
		goto fail_ctx;
	}
	for (; n_mapped < g->n_chunks; n_mapped++) {
		CUmemGenericAllocationHandle h = 0;
		size_t i = n_mapped;

		r = cu->import(&h, (void *)(intptr_t)fds[i],
			      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
		if (r != CUDA_SUCCESS) {
			e = bd_cudrv_errf(r, err, errlen,
					  "cuMemImportFromShareableHandle(chunk %zu, fd %d)", i,
					  fds[i]);
			goto fail_map;
		}
		r = cu->map(base + offsets[i], (size_t)g->chunk_bytes[i], 0, h, 0);
		/* the mapping (if any) holds the memory from here on */
		cu->release(h);
		if (r != CUDA_SUCCESS) {
			e = bd_cudrv_errf(r, err, errlen, "cuMemMap(chunk %zu, %llu bytes)", i,
					  (unsigned long long)g->chunk_bytes[i]);
			goto fail_map;
		}
	}
	memset(&access, 0, sizeof(access));
	access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	access.location.id = g->device;
	access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
	r = cu->set_access(base, va_bytes, &access, 1);
	if (r != CUDA_SUCCESS) {
		e = bd_cudrv_errf(r, err, errlen, "cuMemSetAccess(device %d, %zu bytes)",
				  g->device, va_bytes);
		goto fail_map;
	}
	*ret_base = (void *)(uintptr_t)base;
	return 0;

fail_map:
	while (n_mapped > 0) {
		n_mapped--;
		cu->unmap(base + offsets[n_mapped], (size_t)g->chunk_bytes[n_mapped]);
	}
	cu->addr_free(base, va_bytes);
fail_ctx:
	cu->ctx_release(dev);
	return e;
}

void bd_pool_cuda_unmap(const struct bd_pool_attach *a, void *base)
{
	const struct bd_pool_geometry *g;
	size_t offsets[BD_POOL_MAX_CHUNKS], va_bytes, gmin = 0, grec = 0;
	CUdeviceptr b = (CUdeviceptr)(uintptr_t)base;
	CUdevice dev;

	if (!a || !base || !cu)
		return;
	g = bd_pool_attach_geometry(a);
	if (cu->device_get(&dev, g->device) != CUDA_SUCCESS ||
	    granularities(g->device, &gmin, &grec) != CUDA_SUCCESS ||
	    bd_pool_va_plan(g, gmin, &va_bytes, offsets) < 0)
		return; /* it could not have been mapped */
	for (size_t i = 0; i < g->n_chunks; i++)
		cu->unmap(b + offsets[i], (size_t)g->chunk_bytes[i]);
	cu->addr_free(b, va_bytes);
	cu->ctx_release(dev);
}

int bd_pool_cuda_scrub(const struct bd_pool_geometry *g, void *base, bool slot, int32_t id,
		       void *stream, char *err, size_t errlen)
{
	struct bd_pool_span s;
	cudaError_t ce;
	int e;

	if (!g || !base)
		return bd_errf(err, errlen, -EINVAL, "bad argument");
	if ((e = bd_pool_scrub_span(g, slot, id, &s)) < 0)
		return bd_errf(err, errlen, e, "%s %d is outside the pool", slot ? "slot" : "page",
			       id);
	ce = cudaMemset2DAsync((uint8_t *)base + s.offset, s.pitch, 0, s.width, s.height,
			       (cudaStream_t)stream);
	if (ce != cudaSuccess)
		return bd_errf(err, errlen, -EIO, "zeroing %s %d: %s", slot ? "slot" : "page", id,
			       cudaGetErrorString(ce));
	return 0;
}
