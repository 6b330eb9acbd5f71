/* cuda_err.c — CUDA runtime errors as -errno (bd_cuda_err.h), by the kernels' mapping. */
#include "cuda/bd_cuda_err.h"
#include "bd_cuda_errno.h"

int bd_cuda_errno(cudaError_t e)
{
	return bd_cuda_errno_of(e);
}
