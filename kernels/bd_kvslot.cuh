/* bd_kvslot.cuh — the KV write of one layer into the requests' BF16 slots, as the model kernels
 * share it (bd_op_kv_write in model_ops.cu and the fused decode epilogue bd_gaux_qkv_decode in
 * gmodel_aux.cu): where a head's rows lie in a slot (bd_layout.h), how K is transformed before
 * it is stored (NUMERICS.md §3: k' = H(k − μ_k) when the configuration says so), and the BF16
 * rounding of lib/quant/fp4.c's bd_f32_to_bf16. Internal to kernels/.
 */
#ifndef BD_KVSLOT_CUH
#define BD_KVSLOT_CUH

#include <math.h>
#include <stdint.h>

#include <cuda_runtime.h>

#include "quant/bd_kvcfg.h"
#include "quant/bd_layout.h"

/* A layer's slot geometry and K transform, a kernel parameter. */
struct KvSlot {
	int n_kv_heads, layer, smoothing, hadamard;
	float fwht_scale; /* 1/√d of the rotation */
	uint64_t slot_head_bytes, sink_k_off, sink_v_off, recent_k_off, recent_v_off;
};

/* The slot geometry of layer `layer` of lay and the K transform of cfg. */
static inline KvSlot kv_slot(const struct bd_layout *lay, const struct bd_kvcfg *cfg, int layer)
{
	KvSlot s;
	s.n_kv_heads = lay->n_kv_heads;
	s.layer = layer;
	s.smoothing = cfg->smoothing;
	s.hadamard = cfg->hadamard;
	/* lib/quant/fp4.c's bd_fwht scale, computed by the same two IEEE operations */
	s.fwht_scale = 1.0f / sqrtf((float)lay->d);
	s.slot_head_bytes = lay->slot_head_bytes;
	s.sink_k_off = lay->slot_sink_k_off;
	s.sink_v_off = lay->slot_sink_v_off;
	s.recent_k_off = lay->slot_recent_k_off;
	s.recent_v_off = lay->slot_recent_v_off;
	return s;
}

/* Where KV head h of position ps goes in slot: its recent ring rows (rk, rv) and, for a sink
 * position (ps < 16), its sink rows (sk, sv; computed for any ps, written only for the sink).
 * d, dv: the K and V row lengths in BF16 values. */
struct KvRows {
	uint16_t *rk, *rv, *sk, *sv;
	bool sink;
};

__device__ __forceinline__ KvRows kv_rows(const KvSlot &s, void *slot, int h, int ps, int d, int dv)
{
	const int row = ps % BD_RECENT_TOKENS;
	uint8_t *sh = (uint8_t *)slot + ((size_t)s.layer * s.n_kv_heads + (size_t)h) * s.slot_head_bytes;
	KvRows r;
	r.rk = (uint16_t *)(sh + s.recent_k_off) + (size_t)row * d;
	r.rv = (uint16_t *)(sh + s.recent_v_off) + (size_t)row * dv;
	r.sk = (uint16_t *)(sh + s.sink_k_off) + (size_t)ps * d;
	r.sv = (uint16_t *)(sh + s.sink_v_off) + (size_t)ps * dv;
	r.sink = ps < BD_SINK_TOKENS;
	return r;
}

/* bd_f32_to_bf16: nearest even; NaN stays a quiet NaN. */
__device__ __forceinline__ uint16_t f32_to_bf16(float x)
{
	uint32_t u = __float_as_uint(x);

	if ((u & 0x7fffffffu) > 0x7f800000u)
		return (uint16_t)((u >> 16) | 0x0040u);
	u += 0x7fffu + ((u >> 16) & 1u);
	return (uint16_t)(u >> 16);
}

#endif
