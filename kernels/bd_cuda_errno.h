/* bd_cuda_errno.h — CUDA runtime errors as -errno: the one mapping, shared by the kernels'
 * host code (bd_kcommon.cuh) and the CUDA host code of lib/cuda (bd_cuda_err.h). C and CUDA.
 */
#ifndef BD_CUDA_ERRNO_H
#define BD_CUDA_ERRNO_H

#include <errno.h>

#include <cuda_runtime_api.h>

/* 0 for cudaSuccess; -ENOMEM out of device or pinned memory; -ENODEV no device, no such
 * device or a driver too old for the runtime; -EIO any other error. */
static inline int bd_cuda_errno_of(cudaError_t e)
{
	switch (e) {
	case cudaSuccess:
		return 0;
	case cudaErrorMemoryAllocation:
		return -ENOMEM;
	case cudaErrorNoDevice:
	case cudaErrorInvalidDevice:
	case cudaErrorInsufficientDriver:
		return -ENODEV;
	default:
		return -EIO;
	}
}

#endif
