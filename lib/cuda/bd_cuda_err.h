/* bd_cuda_err.h — CUDA runtime errors as -errno, for the CUDA host code (the contracts of
 * bd_gmodel.h and bd_gemm.h): an argument is checked before any CUDA call, so a failing call
 * means the device, the driver or memory failed, never a bad argument of the caller.
 */
#ifndef BD_CUDA_ERR_H
#define BD_CUDA_ERR_H

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 0 for cudaSuccess; -ENOMEM out of device or pinned memory; -ENODEV no device, no such
 * device or a driver too old for the runtime; -EIO any other error. */
int bd_cuda_errno(cudaError_t e);

/* Runs the CUDA runtime call `call` (an expression of type cudaError_t) and, when it fails, the
 * statements that follow it, with the error in bd_cuda_e (cudaGetErrorString(bd_cuda_e) names
 * it): the one skeleton of the error macros of the CUDA host code and of the GPU checks, which
 * differ only in what a failure does (return a -errno, end the program). */
#define BD_CUDA_TRY(call, ...)                                                             \
	do {                                                                               \
		cudaError_t bd_cuda_e = (call);                                            \
		if (bd_cuda_e != cudaSuccess) {                                            \
			__VA_ARGS__;                                                       \
		}                                                                          \
	} while (0)

#ifdef __cplusplus
}
#endif
#endif
