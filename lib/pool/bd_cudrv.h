/* bd_cudrv.h — the CUDA driver API opened at run time (dlopen of libcuda.so.1).
 *
 * kvpoold (VMM arenas: cuMemCreate, export) and the workers (import, reserve, map, access) call
 * the driver directly, and kvpoold must start on a machine without a driver (its CPU backend), so
 * neither links libcuda: both take the entry points from here. Compiled with cuda.h where the
 * toolkit is (BD_HAVE_CUDA_H); without it bd_cudrv_get always fails with -ENODEV.
 */
#ifndef BD_CUDRV_H
#define BD_CUDRV_H

#include <stddef.h>

#ifdef BD_HAVE_CUDA_H
#include <cuda.h>

/* The entry points, cuInit(0) already called. */
struct bd_cudrv {
	__typeof__(cuDeviceGetCount) *device_count;
	__typeof__(cuDeviceGet) *device_get;
	__typeof__(cuDeviceTotalMem) *total_mem;
	__typeof__(cuGetErrorName) *error_name;
	__typeof__(cuDevicePrimaryCtxRetain) *ctx_retain;
	__typeof__(cuDevicePrimaryCtxRelease) *ctx_release;
	__typeof__(cuCtxSetCurrent) *ctx_set;
	__typeof__(cuMemGetAllocationGranularity) *granularity;
	__typeof__(cuMemCreate) *create;
	__typeof__(cuMemRelease) *release;
	__typeof__(cuMemExportToShareableHandle) *export_handle;
	__typeof__(cuMemImportFromShareableHandle) *import;
	__typeof__(cuMemAddressReserve) *reserve;
	__typeof__(cuMemAddressFree) *addr_free;
	__typeof__(cuMemMap) *map;
	__typeof__(cuMemUnmap) *unmap;
	__typeof__(cuMemSetAccess) *set_access;
	__typeof__(cuMemGetAllocationPropertiesFromHandle) *get_prop;
};

/* The name of a driver result ("CUDA_ERROR_OUT_OF_MEMORY"), or "unknown CUDA error". */
const char *bd_cudrv_error(CUresult r);

/* The -errno of a driver result: -ENOMEM, -ENODEV (no or bad device, not initialized),
 * -ENOSYS (not supported), else -EIO. */
int bd_cudrv_errno(CUresult r);

/* Formats fmt, then ": " and the name of r ("cuMemMap(chunk 2): CUDA_ERROR_INVALID_VALUE"),
 * into err (errlen bytes; nothing when err is NULL or errlen is 0) and returns
 * bd_cudrv_errno(r), so that `return bd_cudrv_errf(r, err, len, "cuX(%d)", i);` fails and
 * explains at once. */
int bd_cudrv_errf(CUresult r, char *err, size_t errlen, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));

/* The allocation properties of a pool arena chunk: pinned memory on device `device`, shareable
 * as a POSIX fd. kvpoold creates its chunks with them; a worker asks the granularity of the
 * same allocations before it maps them. */
void bd_cudrv_chunk_prop(CUmemAllocationProp *ret, int device);
#else
struct bd_cudrv;
#endif

/* The driver, opened and initialized once per process (thread-safe). Returns it, or NULL with
 * *ret_err (may be NULL) = -ENODEV (no libcuda.so.1, cuInit failed, built without cuda.h) or
 * -ENOSYS (an entry point missing) and err (errlen bytes, may be NULL) saying why. */
const struct bd_cudrv *bd_cudrv_get(int *ret_err, char *err, size_t errlen);

#endif
