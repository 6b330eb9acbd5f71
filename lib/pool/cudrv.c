/* cudrv.c — the CUDA driver API opened at run time (bd_cudrv.h). */
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "pool/bd_cudrv.h"

#ifdef BD_HAVE_CUDA_H
#include <dlfcn.h>

static struct bd_cudrv drv;
static __typeof__(cuInit) *drv_init;
static pthread_mutex_t drv_lock = PTHREAD_MUTEX_INITIALIZER;
static int drv_state; /* 0 not tried, 1 ready, < 0 the -errno of the failed load */
static char drv_msg[256];

const char *bd_cudrv_error(CUresult r)
{
	const char *s = NULL;

	if (drv.error_name && drv.error_name(r, &s) == CUDA_SUCCESS && s)
		return s;
	return "unknown CUDA error";
}

int bd_cudrv_errno(CUresult r)
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

int bd_cudrv_errf(CUresult r, char *err, size_t errlen, const char *fmt, ...)
{
	if (err && errlen) {
		va_list ap;
		int n;

		va_start(ap, fmt);
		n = vsnprintf(err, errlen, fmt, ap);
		va_end(ap);
		if (n >= 0 && (size_t)n < errlen)
			snprintf(err + n, errlen - (size_t)n, ": %s", bd_cudrv_error(r));
	}
	return bd_cudrv_errno(r);
}

void bd_cudrv_chunk_prop(CUmemAllocationProp *ret, int device)
{
	memset(ret, 0, sizeof(*ret));
	ret->type = CU_MEM_ALLOCATION_TYPE_PINNED;
	ret->requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
	ret->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	ret->location.id = device;
}

static int load(void)
{
	void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	CUresult r;

	if (!lib) {
		snprintf(drv_msg, sizeof(drv_msg), "no CUDA driver: %s", dlerror());
		return -ENODEV;
	}
#define SYM(dst, name)                                                                    \
	do {                                                                              \
		*(void **)&(dst) = dlsym(lib, name);                                      \
		if (!(dst)) {                                                             \
			snprintf(drv_msg, sizeof(drv_msg), "libcuda.so.1 lacks %s", name); \
			return -ENOSYS;                                                   \
		}                                                                         \
	} while (0)
	/* the versioned names where cuda.h maps a call to a _v2 symbol */
	SYM(drv_init, "cuInit");
	SYM(drv.device_count, "cuDeviceGetCount");
	SYM(drv.device_get, "cuDeviceGet");
	SYM(drv.total_mem, "cuDeviceTotalMem_v2");
	SYM(drv.error_name, "cuGetErrorName");
	SYM(drv.ctx_retain, "cuDevicePrimaryCtxRetain");
	SYM(drv.ctx_release, "cuDevicePrimaryCtxRelease_v2");
	SYM(drv.ctx_set, "cuCtxSetCurrent");
	SYM(drv.granularity, "cuMemGetAllocationGranularity");
	SYM(drv.create, "cuMemCreate");
	SYM(drv.release, "cuMemRelease");
	SYM(drv.export_handle, "cuMemExportToShareableHandle");
	SYM(drv.import, "cuMemImportFromShareableHandle");
	SYM(drv.reserve, "cuMemAddressReserve");
	SYM(drv.addr_free, "cuMemAddressFree");
	SYM(drv.map, "cuMemMap");
	SYM(drv.unmap, "cuMemUnmap");
	SYM(drv.set_access, "cuMemSetAccess");
	SYM(drv.get_prop, "cuMemGetAllocationPropertiesFromHandle");
#undef SYM
	r = drv_init(0);
	if (r != CUDA_SUCCESS) {
		snprintf(drv_msg, sizeof(drv_msg), "cuInit: %s", bd_cudrv_error(r));
		return -ENODEV;
	}
	return 1;
}

const struct bd_cudrv *bd_cudrv_get(int *ret_err, char *err, size_t errlen)
{
	pthread_mutex_lock(&drv_lock);
	if (drv_state == 0)
		drv_state = load();
	int st = drv_state;
	pthread_mutex_unlock(&drv_lock);
	if (st == 1)
		return &drv;
	if (ret_err)
		*ret_err = st;
	if (err && errlen)
		snprintf(err, errlen, "%s", drv_msg);
	return NULL;
}
#else
const struct bd_cudrv *bd_cudrv_get(int *ret_err, char *err, size_t errlen)
{
	if (ret_err)
		*ret_err = -ENODEV;
	if (err && errlen)
		snprintf(err, errlen, "built without the CUDA toolkit (no cuda.h)");
	return NULL;
}
#endif
