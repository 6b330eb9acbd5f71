/* bd_kernels_bw.h — the C launchers of the native Blackwell FP4 decode kernels, callable from C.
 *
 * Each native family runs a decode step on the plan and buffers of bd_kernels.h
 * (struct bd_decode_plan from bd_decode_plan_init, struct bd_decode_args, a workspace set up by
 * bd_decode_workspace_init) and leaves what bd_decode_run leaves: the same split partials and
 * LSEs in the workspace (the plan's n_splits and offsets), the same BF16 sink+recent partial,
 * the same LSE combine into args->out and args->lse, the same *status bits. Numerics are
 * NUMERICS.md §5–§8 as bd_kernels.h states them, with the FP4 products on the FP4 tensor
 * cores instead of an FP16 emulation, so only FP32 summation order differs from the reference.
 * Supported: NVFP4 pages (kind 1: every §9 NVFP4 configuration with FP4 pages) and MXFP4 pages
 * (kind 3: bitdecoding-mxfp4); d ∈ {64, 128}; 1 ≤ G ≤ 8.
 *
 * Errors are -errno: -EINVAL (bad argument, as bd_decode_run), -EOPNOTSUPP (a plan this family
 * does not implement), -ENODEV (the current device cannot run it), -EIO (any other CUDA error).
 * Nothing is printed.
 */
#ifndef BD_KERNELS_BW_H
#define BD_KERNELS_BW_H

#include "bd_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- blackwell-mma: sm_120a (RTX PRO 5000/6000, RTX 50), warp-level block-scaled mma.sync
 * (kernels/decode_sm120.cu, operand packing in quant/bd_mma_sm120.h) ---- */

/* Make plan runnable by bd_decode_run_sm120 on the current device: checks that the plan is one
 * the family implements and that the device is compute capability 12.0, and raises the
 * kernel's shared-memory limit (host calls that must not happen during graph capture; once
 * per plan and device). Returns 0, -EINVAL (NULL), -EOPNOTSUPP, -ENODEV, -EIO. */
int bd_decode_prepare_sm120(const struct bd_decode_plan *plan);

/* Enqueue one decode step on stream (a cudaStream_t; NULL for the default stream) as
 * bd_decode_run does, after bd_decode_prepare_sm120 succeeded for plan on this device: one
 * kernel of B·Hkv·(n_splits + 1) CTAs, no host synchronization and no allocation
 * (capturable in a CUDA graph). Returns 0, -EINVAL (bad plan, NULL or misaligned buffer, bad
 * layer, bt_stride too small), -EOPNOTSUPP, -EIO (launch failed). */
int bd_decode_run_sm120(const struct bd_decode_plan *plan, const struct bd_decode_args *args,
			void *stream);

/* ---- blackwell-tc: sm_100a/sm_103a (B200, B300), tcgen05 block-scaled MMA into tensor memory
 * on CuTe (kernels/decode_sm100.cu, operand packing in quant/bd_mma_sm100.h, its CPU emulation
 * bd_umma_decode_gqa) ---- */

/* Make plan runnable by bd_decode_run_sm100 on the current device: checks that the plan is one
 * the family implements and that the device is compute capability 10.0 or 10.3 (the sm_100a
 * and sm_103a code), and raises the kernel's shared-memory limit (host calls that must not
 * happen during graph capture; once per plan and device). Returns 0, -EINVAL (NULL),
 * -EOPNOTSUPP, -ENODEV, -EIO. */
int bd_decode_prepare_sm100(const struct bd_decode_plan *plan);

/* Enqueue one decode step on stream (a cudaStream_t; NULL for the default stream) as
 * bd_decode_run does, after bd_decode_prepare_sm100 succeeded for plan on this device: one
 * kernel of B·Hkv·(n_splits + 1) CTAs, each page CTA allocating and freeing 64 TMEM columns
 * itself, no host synchronization and no allocation (capturable in a CUDA graph). Returns 0,
 * -EINVAL (bad plan, NULL or misaligned buffer, bad layer, bt_stride too small), -EOPNOTSUPP,
 * -EIO (launch failed). */
int bd_decode_run_sm100(const struct bd_decode_plan *plan, const struct bd_decode_args *args,
			void *stream);

#ifdef __cplusplus
}
#endif
#endif
