/* cuda_err.c — CUDA runtime errors as -errno (bd_cuda_err.h). */
#include <errno.h>

#include "cuda/bd_cuda_err.h"

int bd_cuda_errno(cudaError_t e)
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
