/* pool_import_cuda.c — import kvpoold's CUDA arena chunks and map them as one range
 * (bd_pool_cuda.h).
 *
 * Driver API through dlopen("libcuda.so.1"), like kvpoold/mem_cuda.c: the CUDA runtime (static)
 * opens the same library, so this adds no link dependency. The imported handles are released
 * right after mapping: the mapping keeps the memory alive, and unmapping then needs nothing
 * but the geometry.
 */
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cuda.h>
#include <dlfcn.h>

#include "bd_pool_cuda.h"

static struct {
	void *lib;
	int inited;
	__typeof__(cuInit) *init;
	__typeof__(cuDeviceGet) *device_get;
	__typeof__(cuGetErrorName) *error_name;
	__typeof__(cuDevicePrimaryCtxRetain) *ctx_retain;
	__typeof__(cuDevicePrimaryCtxRelease) *ctx_release;
	__typeof__(cuCtxSetCurrent) *ctx_set;
	__typeof__(cuMemGetAllocationGranularity) *granularity;
	__typeof__(cuMemImportFromShareableHandle) *import;
	__typeof__(cuMemRelease) *release;
	__typeof__(cuMemAddressReserve) *reserve;
	__typeof__(cuMemAddressFree) *addr_free;
	__typeof__(cuMemMap) *map;
	__typeof__(cuMemUnmap) *unmap;
	__typeof__(cuMemSetAccess) *set_access;
} cu;

static pthread_mutex_t cu_lock = PTHREAD_MUTEX_INITIALIZER;

static void seterr(char *buf, size_t len, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

static void seterr(char *buf, size_t len, const char *fmt, ...)
{
	va_list ap;

	if (!buf || !len)
		return;
	va_start(ap, fmt);
	vsnprintf(buf, len, fmt, ap);
	va_end(ap);
}

static const char *cu_name(CUresult r)
{
	const char *s = NULL;

	if (cu.error_name && cu.error_name(r, &s) == CUDA_SUCCESS && s)
		return s;
	return "unknown CUDA error";
}

static int cu_errno(CUresult r)
{
	switch (r) {
	case CUDA_ERROR_OUT_OF_MEMORY:
		return -ENOMEM;
	case CUDA_ERROR_NO_DEVICE:
	case CUDA_ERROR_INVALID_DEVICE:
	case CUDA_ERROR_NOT_INITIALIZED:
		return -ENODEV;
	case CUDA_ERROR_NOT_SUPPORTED:
		return -ENOSYS;
	default:
		return -EIO;
	}
}

/* Opens the driver and runs cuInit once per process; 0 or -errno with the reason. */
static int cu_load_locked(char *err, size_t errlen)
{
	CUresult r;

	if (cu.inited)
		return 0;
	if (!cu.lib) {
		cu.lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
		if (!cu.lib) {
			seterr(err, errlen, "no CUDA driver: %s", dlerror());
			return -ENODEV;
		}
	}
#define SYM(field, name)                                                                  \
	do {                                                                              \
		*(void **)&cu.field = dlsym(cu.lib, name);                                \
		if (!cu.field) {                                                          \
			seterr(err, errlen, "libcuda.so.1 lacks %s", name);               \
			return -ENOSYS;                                                   \
		}                                                                         \
	} while (0)
	/* the versioned names where cuda.h maps a call to a _v2 symbol */
	SYM(init, "cuInit");
	SYM(device_get, "cuDeviceGet");
	SYM(error_name, "cuGetErrorName");
	SYM(ctx_retain, "cuDevicePrimaryCtxRetain");
	SYM(ctx_release, "cuDevicePrimaryCtxRelease_v2");
	SYM(ctx_set, "cuCtxSetCurrent");
	SYM(granularity, "cuMemGetAllocationGranularity");
	SYM(import, "cuMemImportFromShareableHandle");
	SYM(release, "cuMemRelease");
	SYM(reserve, "cuMemAddressReserve");
	SYM(addr_free, "cuMemAddressFree");
	SYM(map, "cuMemMap");
	SYM(unmap, "cuMemUnmap");
	SYM(set_access, "cuMemSetAccess");
#undef SYM
	r = cu.init(0);
	if (r != CUDA_SUCCESS) {
		seterr(err, errlen, "cuInit: %s", cu_name(r));
		return -ENODEV;
	}
	cu.inited = 1;
	return 0;
}

static int cu_load(char *err, size_t errlen)
{
	int e;

	pthread_mutex_lock(&cu_lock);
	e = cu_load_locked(err, errlen);
	pthread_mutex_unlock(&cu_lock);
	return e;
}

static void prop_of(CUmemAllocationProp *p, int device)
{
	memset(p, 0, sizeof(*p));
	p->type = CU_MEM_ALLOCATION_TYPE_PINNED;
	p->requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
	p->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	p->location.id = device;
}

/* Minimum (what cuMemMap needs) and recommended (the alignment the daemon used) granularity. */
static CUresult granularities(int device, size_t *ret_min, size_t *ret_rec)
{
	CUmemAllocationProp prop;
	CUresult r;

	prop_of(&prop, device);
	r = cu.granularity(ret_min, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
	if (r == CUDA_SUCCESS)
		r = cu.granularity(ret_rec, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
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
	if (!a || !ret_base) {
		seterr(err, errlen, "no attachment or no output");
		return -EINVAL;
	}
	g = bd_pool_attach_geometry(a);
	n_fds = bd_pool_attach_chunks(a, &fds);
	if (strcmp(g->backend, "cuda")) {
		seterr(err, errlen, "the pool's backend is %s, not cuda", g->backend);
		return -EINVAL;
	}
	if (n_fds != g->n_chunks || g->device < 0) {
		seterr(err, errlen, "attachment of %zu fds for %zu chunks on device %d", n_fds,
		       g->n_chunks, g->device);
		return -EINVAL;
	}
	e = cu_load(err, errlen);
	if (e < 0)
		return e;
	r = cu.device_get(&dev, g->device);
	if (r != CUDA_SUCCESS) {
		seterr(err, errlen, "device %d: %s", g->device, cu_name(r));
		return -ENODEV;
	}
	r = cu.ctx_retain(&ctx, dev);
	if (r != CUDA_SUCCESS) {
		seterr(err, errlen, "cuDevicePrimaryCtxRetain(device %d): %s", g->device,
		       cu_name(r));
		return cu_errno(r);
	}
	r = cu.ctx_set(ctx);
	if (r != CUDA_SUCCESS) {
		seterr(err, errlen, "cuCtxSetCurrent(device %d): %s", g->device, cu_name(r));
		e = cu_errno(r);
		goto fail_ctx;
	}
	r = granularities(g->device, &gmin, &grec);
	if (r != CUDA_SUCCESS) {
		seterr(err, errlen, "cuMemGetAllocationGranularity(device %d): %s", g->device,
		       cu_name(r));
		e = cu_errno(r);
		goto fail_ctx;
	}
	e = bd_pool_cuda_va_plan(g, gmin, &va_bytes, offsets);
	if (e < 0) {
		seterr(err, errlen, "arena of %zu bytes in %zu chunks: not whole granules of %zu "
		       "bytes on device %d", g->arena_bytes, g->n_chunks, gmin, g->device);
		goto fail_ctx;
	}
	r = cu.reserve(&base, va_bytes, grec > gmin ? grec : gmin, 0, 0);
	if (r != CUDA_SUCCESS) {
		seterr(err, errlen, "cuMemAddressReserve(%zu bytes): %s", va_bytes, cu_name(r));
		e = cu_errno(r);
		goto fail_ctx;
	}
	for (; n_mapped < g->n_chunks; n_mapped++) {
		CUmemGenericAllocationHandle h = 0;
		size_t i = n_mapped;

		r = cu.import(&h, (void *)(intptr_t)fds[i],
			      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
		if (r != CUDA_SUCCESS) {
			seterr(err, errlen, "cuMemImportFromShareableHandle(chunk %zu, fd %d): %s",
			       i, fds[i], cu_name(r));
			e = cu_errno(r);
			goto fail_map;
		}
		r = cu.map(base + offsets[i], (size_t)g->chunk_bytes[i], 0, h, 0);
		/* the mapping (if any) holds the memory from here on */
		cu.release(h);
		if (r != CUDA_SUCCESS) {
			seterr(err, errlen, "cuMemMap(chunk %zu, %llu bytes): %s", i,
			       (unsigned long long)g->chunk_bytes[i], cu_name(r));
			e = cu_errno(r);
			goto fail_map;
		}
	}
	memset(&access, 0, sizeof(access));
	access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	access.location.id = g->device;
	access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
	r = cu.set_access(base, va_bytes, &access, 1);
	if (r != CUDA_SUCCESS) {
		seterr(err, errlen, "cuMemSetAccess(device %d, %zu bytes): %s", g->device, va_bytes,
		       cu_name(r));
		e = cu_errno(r);
		goto fail_map;
	}
	*ret_base = (void *)(uintptr_t)base;
	return 0;

fail_map:
	while (n_mapped > 0) {
		n_mapped--;
		cu.unmap(base + offsets[n_mapped], (size_t)g->chunk_bytes[n_mapped]);
	}
	cu.addr_free(base, va_bytes);
fail_ctx:
	cu.ctx_release(dev);
	return e;
}

void bd_pool_cuda_unmap(const struct bd_pool_attach *a, void *base)
{
	const struct bd_pool_geometry *g;
	size_t offsets[BD_POOL_MAX_CHUNKS], va_bytes, gmin = 0, grec = 0;
	CUdeviceptr b = (CUdeviceptr)(uintptr_t)base;
	CUdevice dev;

	if (!a || !base || !cu.inited)
		return;
	g = bd_pool_attach_geometry(a);
	if (cu.device_get(&dev, g->device) != CUDA_SUCCESS ||
	    granularities(g->device, &gmin, &grec) != CUDA_SUCCESS ||
	    bd_pool_cuda_va_plan(g, gmin, &va_bytes, offsets) < 0)
		return; /* it could not have been mapped */
	for (size_t i = 0; i < g->n_chunks; i++)
		cu.unmap(b + offsets[i], (size_t)g->chunk_bytes[i]);
	cu.addr_free(b, va_bytes);
	cu.ctx_release(dev);
}
