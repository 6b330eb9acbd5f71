/* gmodel_aux.cu — device helpers of the GPU model that bd_ops.h does not cover (bd_gaux.h):
 * synthetic KV, the decode step's metadata staging and its fused q/k/v epilogue (norms, RoPE,
 * KV write). Built with -fmad=false like model_ops.cu, whose operation order the fused kernel
 * repeats so that its results are the separate ops' bit for bit. */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "bd_gaux.h"
#include "bd_kvslot.cuh"

namespace {

__device__ __forceinline__ uint64_t mix64(uint64_t z)
{
	z += 0x9e3779b97f4a7c15ull;
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

/* Box-Muller on the two 32-bit halves of one hash: a standard normal draw */
__device__ __forceinline__ float normal_of(uint64_t h)
{
	const float u1 = ((float)(uint32_t)(h >> 32) + 0.5f) * 2.3283064365386963e-10f;
	const float u2 = ((float)(uint32_t)h + 0.5f) * 2.3283064365386963e-10f;
	return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
}

__device__ __forceinline__ float bf16_value(float x)
{
	return __bfloat162float(__float2bfloat16_rn(x));
}

__global__ void synth_kv_kernel(float *k, float *v, int rows, int H, int d, int layer, int pos0,
				uint64_t seed)
{
	const size_t n = (size_t)rows * (size_t)H * (size_t)d;
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x) {
		const int c = (int)(i % (size_t)d);
		const int h = (int)((i / (size_t)d) % (size_t)H);
		const uint64_t pos = (uint64_t)pos0 + i / ((size_t)H * (size_t)d);
		/* the counter names the element, not its place in this launch */
		uint64_t key = mix64(seed ^ mix64(((uint64_t)layer << 40) ^ pos));
		key = mix64(key ^ (((uint64_t)h << 20) | (uint64_t)c));
		const float outlier = (c % 32) == ((7 * h + layer) % 32) ? 8.0f : 1.0f;
		k[i] = bf16_value(normal_of(mix64(key ^ 0x6b)) * outlier);
		v[i] = bf16_value(normal_of(mix64(key ^ 0x76)));
	}
}


__device__ __forceinline__ double warp_sum_d(double v)
{
	for (int o = 16; o > 0; o >>= 1)
		v += __shfl_xor_sync(0xffffffffu, v, o);
	return v;
}

/* One CTA per row; the header is spread over all CTAs. Host-mapped data is read with
 * cache-volatile loads: the host rewrote it since the last step. */
__global__ void step_stage_kernel(const uint4 *src, uint4 *dst, size_t n16, const int32_t *spans,
				  const int32_t *vals, int32_t *bt_slots, int32_t *bt_rows,
				  int stride, int B)
{
	const int i = blockIdx.x;
	for (size_t k = (size_t)i * blockDim.x + threadIdx.x; k < n16;
	     k += (size_t)B * blockDim.x)
		dst[k] = __ldcv(src + k);
	const int slot = __ldcv(spans + 4 * i), np = __ldcv(spans + 4 * i + 1);
	const int j0 = __ldcv(spans + 4 * i + 2), vo = __ldcv(spans + 4 * i + 3);
	if (slot < 0)
		return;
	int32_t *ts = bt_slots + (size_t)slot * (size_t)stride;
	int32_t *tr = bt_rows + (size_t)i * (size_t)stride;
	for (int j = threadIdx.x; j < np; j += blockDim.x) {
		int32_t v;
		if (j >= j0) {
			v = __ldcv(vals + vo + (j - j0));
			ts[j] = v;
		} else {
			v = ts[j];
		}
		tr[j] = v;
	}
}

struct QkvP {
	const float *qkv, *bias, *q_norm, *k_norm, *mu;
	const int32_t *pos;
	float *q;
	void *const *slots;
	int n, Hq, Hkv, d, ld_qkv, ld_q, n_rot, neox;
	float rope_base, eps;
	KvSlot s;
};

constexpr int QKV_WARPS = 4;

/* Warp w of CTA (i, y) takes head t = 4y + w of row i: q heads first, then k heads (whose v
 * head goes with them). Each step is the separate op's loop: bias x + b; head RMSNorm (lane l
 * sums channels l, l + 32, … in double, then the xor-shuffle tree; x·scale·w); RoPE with
 * angles in double; K' = H(k − μ)·d^(−1/2) by the butterflies of lib/fp4.c; BF16 stores. */
__global__ void __launch_bounds__(32 * QKV_WARPS) qkv_decode_kernel(const QkvP p)
{
	extern __shared__ float sm[];
	const int w = threadIdx.x / 32, l = threadIdx.x % 32, d = p.d;
	const int i = blockIdx.x, t = blockIdx.y * QKV_WARPS + w;

	if (t >= p.Hq + p.Hkv)
		return; /* whole warps only: nothing below synchronizes the CTA */
	const bool isq = t < p.Hq;
	const int h = isq ? t : t - p.Hq;
	float *buf = sm + (size_t)w * d;
	const size_t col = (size_t)(isq ? h : p.Hq + h) * (size_t)d;
	const float *src = p.qkv + (size_t)i * (size_t)p.ld_qkv + col;

	for (int c = l; c < d; c += 32)
		buf[c] = p.bias ? src[c] + p.bias[col + c] : src[c];
	const float *nw = isq ? p.q_norm : p.k_norm;
	if (nw) {
		double ss = 0.0;
		for (int c = l; c < d; c += 32)
			ss += (double)buf[c] * (double)buf[c];
		ss = warp_sum_d(ss);
		const float scale = (float)(1.0 / sqrt(ss / d + (double)p.eps));
		for (int c = l; c < d; c += 32)
			buf[c] = buf[c] * scale * nw[c];
	}
	__syncwarp();
	const int half = p.n_rot / 2, ps = p.pos[i];
	for (int j = l; j < half; j += 32) {
		const double theta = (double)ps * pow((double)p.rope_base, -2.0 * j / p.n_rot);
		const float cs = (float)cos(theta), sn = (float)sin(theta);
		const int i0 = p.neox ? j : 2 * j, i1 = p.neox ? j + half : 2 * j + 1;
		const float a = buf[i0], b = buf[i1];

		buf[i0] = a * cs - b * sn;
		buf[i1] = a * sn + b * cs;
	}
	__syncwarp();
	if (isq) {
		float *qr = p.q + (size_t)i * (size_t)p.ld_q + (size_t)h * (size_t)d;
		for (int c = l; c < d; c += 32)
			qr[c] = buf[c];
		return;
	}
	if (p.s.smoothing && p.mu)
		for (int c = l; c < d; c += 32)
			buf[c] = buf[c] - p.mu[(size_t)h * d + c];
	if (p.s.hadamard) {
		for (int s = 1; s < d; s *= 2) {
			__syncwarp();
			for (int u = l; u < d / 2; u += 32) {
				const int j = (u / s) * 2 * s + u % s;
				const float a = buf[j], b = buf[j + s];

				buf[j] = a + b;
				buf[j + s] = a - b;
			}
		}
		__syncwarp();
		for (int c = l; c < d; c += 32)
			buf[c] = buf[c] * p.s.fwht_scale;
	}
	const KvRows dst = kv_rows(p.s, p.slots[i], h, ps, d, d);
	const size_t vcol = (size_t)(p.Hq + p.Hkv + h) * (size_t)d;
	const float *vs = p.qkv + (size_t)i * (size_t)p.ld_qkv + vcol;
	for (int c = l; c < d; c += 32) {
		const uint16_t bk = f32_to_bf16(buf[c]);
		const uint16_t bv = f32_to_bf16(p.bias ? vs[c] + p.bias[vcol + c] : vs[c]);

		dst.rk[c] = bk;
		dst.rv[c] = bv;
		if (dst.sink) {
			dst.sk[c] = bk;
			dst.sv[c] = bv;
		}
	}
}

} // namespace

extern "C" int bd_gaux_synth_kv(float *k, float *v, int rows, int H, int d, int layer, int pos0,
				uint64_t seed, void *stream)
{
	if (!k || !v || rows < 1 || H < 1 || d < 1 || layer < 0 || pos0 < 0)
		return -EINVAL;
	const size_t n = (size_t)rows * (size_t)H * (size_t)d;
	const size_t want = (n + 255) / 256;
	const unsigned blocks = (unsigned)(want < 4096 ? want : 4096);
	synth_kv_kernel<<<blocks, 256, 0, (cudaStream_t)stream>>>(k, v, rows, H, d, layer, pos0,
								    seed);
	return cudaGetLastError() == cudaSuccess ? 0 : -EIO;
}

extern "C" int bd_gaux_step_stage(const void *src, void *dst, size_t hdr_bytes,
				  const int32_t *spans, const int32_t *vals, int32_t *bt_slots,
				  int32_t *bt_rows, int bt_stride, int B, void *stream)
{
	if (!src || !dst || !spans || !vals || !bt_slots || !bt_rows || hdr_bytes % 16 ||
	    ((uintptr_t)src | (uintptr_t)dst) % 16 || bt_stride < 1 || B < 1 || B > 65535)
		return -EINVAL;
	step_stage_kernel<<<(unsigned)B, 256, 0, (cudaStream_t)stream>>>(
		(const uint4 *)src, (uint4 *)dst, hdr_bytes / 16, spans, vals, bt_slots, bt_rows,
		bt_stride, B);
	return cudaGetLastError() == cudaSuccess ? 0 : -EIO;
}

extern "C" int bd_gaux_qkv_decode(const struct bd_gaux_qkv *a, const struct bd_layout *lay,
				  const struct bd_kvcfg *cfg, void *stream)
{
	if (!a || !lay || !cfg || !a->qkv || !a->pos || !a->q || !a->slots || a->n < 1 ||
	    a->n > 0x7fffffff || a->Hq < 1 || a->Hkv < 1 || a->Hkv > lay->n_kv_heads ||
	    a->d != lay->d || lay->dv != lay->d || a->d < 32 || a->d > 256 || a->d % 32 ||
	    a->ld_qkv < (a->Hq + 2 * a->Hkv) * a->d || a->ld_q < a->Hq * a->d || a->n_rot < 2 ||
	    a->n_rot % 2 || a->n_rot > a->d || a->layer < 0 || a->layer >= lay->n_layers ||
	    (a->rope_style != 0 && a->rope_style != 1) || !(a->rope_base > 0.0f) ||
	    !isfinite(a->rope_base) || ((a->q_norm || a->k_norm) && !(a->eps > 0.0f)))
		return -EINVAL;
	if ((a->q_norm == NULL) != (a->k_norm == NULL))
		return -EINVAL;
	if (cfg->hadamard && (a->d & (a->d - 1)) != 0)
		return -EINVAL;
	QkvP p;
	memset(&p, 0, sizeof(p));
	p.qkv = a->qkv;
	p.bias = a->bias;
	p.q_norm = a->q_norm;
	p.k_norm = a->k_norm;
	p.mu = a->mu;
	p.pos = a->pos;
	p.q = a->q;
	p.slots = a->slots;
	p.n = a->n;
	p.Hq = a->Hq;
	p.Hkv = a->Hkv;
	p.d = a->d;
	p.ld_qkv = a->ld_qkv;
	p.ld_q = a->ld_q;
	p.n_rot = a->n_rot;
	p.neox = a->rope_style == 1; /* BD_ROPE_NEOX */
	p.rope_base = a->rope_base;
	p.eps = a->eps;
	p.s = kv_slot(lay, cfg, a->layer); /* bd_op_kv_write's slot rows and K transform */
	const int tasks = a->Hq + a->Hkv;
	const dim3 grid((unsigned)a->n, (unsigned)((tasks + QKV_WARPS - 1) / QKV_WARPS));
	qkv_decode_kernel<<<grid, 32 * QKV_WARPS, (size_t)QKV_WARPS * (size_t)a->d * sizeof(float),
			    (cudaStream_t)stream>>>(p);
	return cudaGetLastError() == cudaSuccess ? 0 : -EIO;
}
