/* bd_gaux.h — small device helpers of the GPU model (lib/cuda/gmodel.c) that the
 * model kernels of bd_ops.h do not cover. Asynchronous on `stream` (a cudaStream_t; NULL: the
 * default stream). Returns 0, -EINVAL (nothing launched) or -EIO (the launch failed).
 */
#ifndef BD_GAUX_H
#define BD_GAUX_H

#include <stddef.h>
#include <stdint.h>

#include "quant/bd_kvcfg.h"
#include "quant/bd_layout.h"

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

/* The decode step's metadata staging, the first kernel of a decode step (one CTA per row):
 * copies hdr_bytes (a multiple of 16) from src (host memory mapped into the device's address
 * space: the pinned buffer the host packed, read over the bus by the kernel, so that the step
 * needs no copy call of its own) to dst, applies each row's block-table patch to the per-slot
 * tables and gathers each row's table for the decode kernel. spans [B][4] (mapped host) per
 * row i: {slot (−1: padding row), n_pages, j0, val_off}: entries j0..n_pages−1 of slot's
 * table become vals[val_off + j − j0] (vals: mapped host), then bt_rows[i][0..n_pages) =
 * bt_slots[slot][0..n_pages); tables have bt_stride entries a row. */
int bd_gaux_step_stage(const void *src, void *dst, size_t hdr_bytes, const int32_t *spans,
		       const int32_t *vals, int32_t *bt_slots, int32_t *bt_rows, int bt_stride,
		       int B, void *stream);

/* The part of a decode step between the q/k/v product and decode attention, one kernel (one
 * warp per (row, head)): from qkv [n][ld_qkv] (q heads, then k heads, then v heads, FP32)
 * plus bias (NULL: none), per head RMSNorm with q_norm/k_norm (NULL: no q/k norm), RoPE at
 * positions pos [n] (device), q heads into q [n][ld_q], and the layer's K (after k − μ_k and
 * the Hadamard rotation when cfg says so) and V rounded to BF16 into each row's slot
 * (slots [n], device pointers). Bit for bit what bd_op_bias_add, two bd_op_head_rmsnorm, two
 * bd_op_rope and bd_op_kv_write give (same FP32/double operation order); like bd_op_kv_write
 * it refuses nothing at run time. Hq, Hkv heads of dimension d ≤ 256 (power of two with the
 * Hadamard rotation), lay's heads ≥ Hkv. */
struct bd_gaux_qkv {
	const float *qkv, *bias, *q_norm, *k_norm, *mu; /* mu: [Hkv][d] of this layer or NULL */
	const int32_t *pos;
	float *q;
	void *const *slots;
	int n, Hq, Hkv, d, ld_qkv, ld_q, n_rot, rope_style, layer;
	float rope_base, eps;
};
int bd_gaux_qkv_decode(const struct bd_gaux_qkv *a, const struct bd_layout *lay,
		       const struct bd_kvcfg *cfg, void *stream);

#ifdef __cplusplus
}
#endif
#endif
