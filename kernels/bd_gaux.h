/* bd_gaux.h — small device helpers of the GPU model (lib/gmodel_cuda.c, issue 7) that the
 * model kernels of bd_ops.h do not cover. Asynchronous on `stream` (a cudaStream_t; NULL: the
 * default stream). Returns 0, -EINVAL (nothing launched) or -EIO (the launch failed).
 */
#ifndef BD_GAUX_H
#define BD_GAUX_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Synthetic post-RoPE keys and values for serving benchmarks (bd_gmodel_fill_synthetic):
 * k, v [rows][H][d] FP32, row r the token at position pos0 + r of layer `layer`. Element
 * (h, c): v = z, k = z'·(1 + 7·o(layer, h, c)) with z, z' standard normal draws of a
 * counter-based hash of (seed, layer, position, h, c) and o = 1 on 4 of every 128 channels
 * (c ≡ 7h + layer mod 32), the outlier channels real keys have (NUMERICS.md §3); both rounded
 * to BF16 values. A fixed function of its arguments, whatever rows and pos0 split it into. */
int bd_gaux_synth_kv(float *k, float *v, int rows, int H, int d, int layer, int pos0,
		     uint64_t seed, void *stream);

#ifdef __cplusplus
}
#endif
#endif
