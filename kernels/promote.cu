/* promote.cu — promotion of full BF16 recent pages into FP4 pages on the device (NUMERICS.md
 * §2–§4, §8), byte for byte what bd_page_promote writes, and the numeric test hooks of
 * bd_kernels.h. Generic CUDA (every target of the Makefile): no Hopper-only instructions.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bd_kcommon.cuh"
#include "bd_kernels.h"

namespace bdk {

struct PromoteParams {
	uint8_t *arena;
	void *const *slots;
	const int32_t *pages;
	int *status;
	int n_layers, n_kv_heads, d, fmt;
	int search;
	uint64_t n_pages, layer_stride, page_bytes, head_bytes, gscale_off;
	uint64_t k_codes_off, k_scales_off, v_codes_off, v_scales_off;
	uint64_t slot_head_bytes, recent_k_off, recent_v_off;
};

/* Pass 1: one CTA per promotion checks its slot's recent rows of every layer and KV head, so
 * that a non-finite value leaves the arena untouched (bd_page_promote checks first too). */
__global__ void promote_check_kernel(const PromoteParams p)
{
	const int i = blockIdx.x;
	__shared__ int bad;
	const uint8_t *slot = (const uint8_t *)p.slots[i];
	const int32_t page = p.pages[i];
	if (threadIdx.x == 0)
		bad = (slot == nullptr || ((uintptr_t)slot & 15) || page < 0 ||
		       (uint64_t)page >= p.n_pages) ?
			      -EINVAL :
			      0;
	__syncthreads();
	if (bad) {
		if (threadIdx.x == 0)
			p.status[i] = bad;
		return;
	}
	const size_t row_bytes = (size_t)BD_RECENT_TOKENS * p.d * 2;
	const size_t vecs = row_bytes / 16;
	int nonfinite = 0;
	for (int lh = 0; lh < p.n_layers * p.n_kv_heads; lh++) {
		const uint8_t *sh = slot + (size_t)lh * p.slot_head_bytes;
		for (int part = 0; part < 2; part++) {
			const uint4 *v = (const uint4 *)(sh + (part ? p.recent_v_off : p.recent_k_off));
			for (size_t j = threadIdx.x; j < vecs; j += blockDim.x) {
				uint4 x = v[j];
				uint32_t w[4] = { x.x, x.y, x.z, x.w };
				for (int k = 0; k < 4; k++)
					if ((w[k] & 0x7f80u) == 0x7f80u || (w[k] & 0x7f800000u) == 0x7f800000u)
						nonfinite = 1;
			}
		}
	}
	nonfinite = __syncthreads_or(nonfinite);
	if (threadIdx.x == 0)
		p.status[i] = nonfinite ? -EDOM : 0;
}

__device__ __forceinline__ float block_amax(float v, float *red)
{
	for (int o = 16; o > 0; o >>= 1)
		v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
	if ((threadIdx.x & 31) == 0)
		red[threadIdx.x >> 5] = v;
	__syncthreads();
	float r = 0.0f;
	for (int w = 0; w < (int)(blockDim.x >> 5); w++)
		r = fmaxf(r, red[w]);
	__syncthreads();
	return r;
}

/* One block of BS values x quantized (NUMERICS.md §2): BS = 16 NVFP4 under the page's g, an
 * E4M3 scale code; BS = 32 MXFP4, a UE8M0 scale code (g unused). */
template <int BS>
__device__ __forceinline__ void quantize_block(const float (&x)[BS], float g, bool search,
					       uint32_t (&pk)[BS / 8], uint32_t *ret_scale)
{
	if constexpr (BS == 16)
		nvfp4_quantize_block(x, g, search, pk, ret_scale);
	else
		mxfp4_quantize_block(x, search, pk, ret_scale);
}

/* A block's BS/2 code bytes to dst, in one aligned store. */
template <int BS>
__device__ __forceinline__ void store_codes(uint8_t *dst, const uint32_t (&pk)[BS / 8])
{
	if constexpr (BS == 16)
		*(uint2 *)dst = make_uint2(pk[0], pk[1]);
	else
		*(uint4 *)dst = make_uint4(pk[0], pk[1], pk[2], pk[3]);
}

/* The FP4 regions of one page head from K' and V [128][d] BF16 (bd_page_promote's layout,
 * BS as quantize_block): K in blocks of BS channels of a token (token-major codes and
 * scales, the searched block scale when search), V in blocks of BS tokens of a channel
 * (channel-major). */
template <int BS>
__device__ __forceinline__ void quantize_page(const uint16_t *K, const uint16_t *V, int d, float gk,
					      float gv, bool search, uint8_t *kc, uint8_t *ks,
					      uint8_t *vc, uint8_t *vs)
{
	const int nt = BD_PAGE_TOKENS, nbk = d / BS;

	for (int blk = threadIdx.x; blk < nt * nbk; blk += blockDim.x) {
		const int tok = blk / nbk, bi = blk % nbk;
		float x[BS];
		uint32_t pk[BS / 8], sc;
#pragma unroll
		for (int e = 0; e < BS; e++)
			x[e] = __uint_as_float((uint32_t)K[tok * d + bi * BS + e] << 16);
		quantize_block<BS>(x, gk, search, pk, &sc);
		store_codes<BS>(kc + (size_t)tok * d / 2 + bi * (BS / 2), pk);
		ks[(size_t)tok * nbk + bi] = (uint8_t)sc;
	}
	for (int blk = threadIdx.x; blk < d * (nt / BS); blk += blockDim.x) {
		const int ch = blk / (nt / BS), bi = blk % (nt / BS);
		float x[BS];
		uint32_t pk[BS / 8], sc;
#pragma unroll
		for (int e = 0; e < BS; e++)
			x[e] = __uint_as_float((uint32_t)V[(bi * BS + e) * d + ch] << 16);
		quantize_block<BS>(x, gv, false, pk, &sc);
		store_codes<BS>(vc + (size_t)ch * (nt / 2) + bi * (BS / 2), pk);
		vs[(size_t)ch * (nt / BS) + bi] = (uint8_t)sc;
	}
}

/* Pass 2: one CTA per (layer · KV head, promotion). smem: K' [128][d] and V [128][d] BF16. */
__global__ void promote_kernel(const PromoteParams p)
{
	extern __shared__ __align__(16) uint8_t psm[];
	__shared__ float red[32];
	const int lh = blockIdx.x, i = blockIdx.y;
	if (p.status[i] != 0)
		return;
	const int layer = lh / p.n_kv_heads, h = lh % p.n_kv_heads, d = p.d;
	const uint8_t *sh = (const uint8_t *)p.slots[i] + (size_t)lh * p.slot_head_bytes;
	uint8_t *page = p.arena + (size_t)layer * p.layer_stride + (size_t)p.pages[i] * p.page_bytes;
	uint8_t *head = page + (size_t)h * p.head_bytes;
	const size_t nbytes = (size_t)BD_RECENT_TOKENS * d * 2;
	const uint16_t *K = (const uint16_t *)psm, *V = (const uint16_t *)(psm + nbytes);

	for (size_t j = threadIdx.x; j < nbytes / 16; j += blockDim.x) {
		((uint4 *)psm)[j] = ((const uint4 *)(sh + p.recent_k_off))[j];
		((uint4 *)(psm + nbytes))[j] = ((const uint4 *)(sh + p.recent_v_off))[j];
	}
	/* zero the bytes between regions (layout.c's zero_gaps) */
	{
		const uint64_t off[4] = { p.k_codes_off, p.k_scales_off, p.v_codes_off, p.v_scales_off };
		uint64_t l4[4] = { (uint64_t)BD_PAGE_TOKENS * d / 2, 0, (uint64_t)d * BD_PAGE_TOKENS / 2, 0 };
		if (p.fmt == BD_PAGE_BF16) {
			l4[0] = l4[2] = (uint64_t)BD_PAGE_TOKENS * d * 2;
		} else {
			const int blk = p.fmt == BD_PAGE_MXFP4 ? 32 : 16;
			l4[1] = (uint64_t)BD_PAGE_TOKENS * d / blk;
			l4[3] = (uint64_t)d * BD_PAGE_TOKENS / blk;
		}
		for (int r = 0; r < 4; r++) {
			uint64_t end = off[r] + l4[r], next = r < 3 ? off[r + 1] : p.head_bytes;
			for (uint64_t x = end + threadIdx.x; x < next; x += blockDim.x)
				head[x] = 0;
		}
	}
	__syncthreads();

	const int nt = BD_PAGE_TOKENS;
	if (p.fmt == BD_PAGE_BF16) {
		for (size_t j = threadIdx.x; j < nbytes / 16; j += blockDim.x) {
			((uint4 *)(head + p.k_codes_off))[j] = ((const uint4 *)K)[j];
			((uint4 *)(head + p.v_codes_off))[j] = ((const uint4 *)V)[j];
		}
		if (threadIdx.x == 0) {
			float *g = (float *)(page + p.gscale_off + (size_t)h * 8);
			g[0] = 1.0f;
			g[1] = 1.0f;
		}
		return;
	}

	float ak = 0.0f, av = 0.0f;
	for (int j = threadIdx.x; j < nt * d; j += blockDim.x) {
		ak = fmaxf(ak, fabsf(__uint_as_float((uint32_t)K[j] << 16)));
		av = fmaxf(av, fabsf(__uint_as_float((uint32_t)V[j] << 16)));
	}
	float gk = 1.0f, gv = 1.0f;
	if (p.fmt == BD_PAGE_NVFP4) {
		gk = nvfp4_g(block_amax(ak, red), BD_NVFP4_KV_SMAX);
		gv = nvfp4_g(block_amax(av, red), BD_NVFP4_KV_SMAX);
	}
	uint8_t *kc = head + p.k_codes_off, *ks = head + p.k_scales_off;
	uint8_t *vc = head + p.v_codes_off, *vs = head + p.v_scales_off;

	if (p.fmt == BD_PAGE_NVFP4)
		quantize_page<16>(K, V, d, gk, gv, p.search, kc, ks, vc, vs);
	else
		quantize_page<32>(K, V, d, gk, gv, p.search, kc, ks, vc, vs);
	if (threadIdx.x == 0) {
		float *g = (float *)(page + p.gscale_off + (size_t)h * 8);
		g[0] = gk;
		g[1] = gv;
	}
}

/* ---- test hooks ------------------------------------------------------------------------------- */

/* The query of the decode prologue, one warp per head: MX false — query_quant_warp (NVFP4),
 * codes [n][2][D/2], E4M3 scale codes [n][2][D/16], g [n][2]; MX true — mx_query_quant_warp,
 * codes as NVFP4, UE8M0 scale codes [n][2][D/32] (gout unused). */
template <int D, bool MX>
__global__ void qquant_kernel(const float *q, int n, int hadamard, int nterms, float inv_sqrt_d,
			      uint8_t *codes, uint8_t *scales, float *gout)
{
	const int hd = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
	if (hd >= n)
		return;
	float x[D / 32], xs[2][D / 32], g[2];
	uint32_t c[2][D / 32], sc[2][D / 32];
	for (int i = 0; i < D / 32; i++)
		x[i] = q[(size_t)hd * D + lane + 32 * i];
	if (hadamard)
		fwht_warp<D>(x, inv_sqrt_d);
	if constexpr (MX)
		mx_query_quant_warp<D>(x, nterms, xs, c, sc, g);
	else
		query_quant_warp<D>(x, nterms, xs, c, sc, g);
	for (int t = 0; t < 2; t++) {
		for (int i = 0; i < D / 32; i++) {
			const int e = lane + 32 * i;
			/* pack pairs: the odd element's lane sends its code to the even one */
			uint32_t hi = __shfl_down_sync(0xffffffffu, c[t][i], 1);
			if ((e & 1) == 0)
				codes[((size_t)hd * 2 + t) * (D / 2) + e / 2] =
					(uint8_t)((c[t][i] & 0xfu) | ((hi & 0xfu) << 4));
			if (MX ? lane == 0 : (e & 15) == 0)
				scales[((size_t)hd * 2 + t) * (D / (MX ? 32 : 16)) +
				       (MX ? i : e / 16)] = (uint8_t)sc[t][i];
		}
		if (!MX && lane == 0)
			gout[(size_t)hd * 2 + t] = g[t];
	}
}

__global__ void e4m3_exhaustive_kernel(unsigned long long *mismatch, unsigned int *first)
{
	const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
	unsigned long long bad = 0;
	for (uint64_t u = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; u < (1ull << 32); u += stride) {
		const float x = __uint_as_float((uint32_t)u);
		if (!isfinite(x))
			continue;
		if (e4m3_encode_hw(x) != e4m3_encode_soft(x)) {
			bad++;
			atomicMin(first, (unsigned int)u);
		}
	}
	if (bad)
		atomicAdd(mismatch, bad);
}

__global__ void e4m3_encode_kernel(const float *x, size_t n, int hw, uint8_t *codes)
{
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x)
		codes[i] = (uint8_t)(hw ? e4m3_encode_hw(x[i]) : e4m3_encode_soft(x[i]));
}

} // namespace bdk

using namespace bdk;

extern "C" int bd_promote_run(const struct bd_layout *lay, const struct bd_kvcfg *cfg, void *arena,
			      void *const *slots, const int32_t *pages, int n, int *status,
			      void *stream)
{
	if (!lay || !cfg || !arena || !slots || !pages || !status || n < 0)
		return -EINVAL;
	if (lay->fmt != cfg->page_fmt || ((uintptr_t)arena & 15) || ((uintptr_t)slots & 7) ||
	    ((uintptr_t)pages & 3) || ((uintptr_t)status & 3))
		return -EINVAL;
	if (lay->d_rope != 0 || (lay->fmt != BD_PAGE_NVFP4 && lay->fmt != BD_PAGE_MXFP4 &&
				 lay->fmt != BD_PAGE_BF16))
		return -EOPNOTSUPP;
	if (lay->d < 32 || lay->d % 32 != 0 || lay->slot_recent_k_off % 16 ||
	    lay->slot_recent_v_off % 16 || lay->slot_head_bytes % 16)
		return -EINVAL;
	if (n == 0)
		return 0;
	PromoteParams p;
	memset(&p, 0, sizeof(p));
	p.arena = (uint8_t *)arena;
	p.slots = slots;
	p.pages = pages;
	p.status = status;
	p.n_layers = lay->n_layers;
	p.n_kv_heads = lay->n_kv_heads;
	p.d = lay->d;
	p.fmt = lay->fmt;
	p.search = cfg->key_search;
	p.n_pages = lay->n_pages;
	p.layer_stride = lay->layer_stride;
	p.page_bytes = lay->page_bytes;
	p.head_bytes = lay->head_bytes;
	p.gscale_off = lay->gscale_off;
	p.k_codes_off = lay->k_codes_off;
	p.k_scales_off = lay->k_scales_off;
	p.v_codes_off = lay->v_codes_off;
	p.v_scales_off = lay->v_scales_off;
	p.slot_head_bytes = lay->slot_head_bytes;
	p.recent_k_off = lay->slot_recent_k_off;
	p.recent_v_off = lay->slot_recent_v_off;

	cudaStream_t st = (cudaStream_t)stream;
	const size_t smem = (size_t)2 * BD_RECENT_TOKENS * lay->d * 2;
	BDK_TRY(cudaFuncSetAttribute((const void *)promote_kernel,
				     cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
	promote_check_kernel<<<n, 256, 0, st>>>(p);
	BDK_TRY(cudaGetLastError());
	promote_kernel<<<dim3(lay->n_layers * lay->n_kv_heads, n), 256, smem, st>>>(p);
	BDK_TRY(cudaGetLastError());
	return 0;
}

/* bd_kernels_query_quantize(_mx): one warp per head, 4 per block, then a synchronize. */
template <bool MX>
static int query_quantize(const float *q, int n, int d, int hadamard, int nterms, uint8_t *codes,
			  uint8_t *scales, float *g)
{
	if (!q || n < 1 || (d != 64 && d != 128) || (nterms != 1 && nterms != 2) || !codes ||
	    !scales || (!MX && !g))
		return -EINVAL;
	const float inv = 1.0f / sqrtf((float)d);
	const int blocks = (n + 3) / 4;
	if (d == 128)
		qquant_kernel<128, MX><<<blocks, 128>>>(q, n, hadamard, nterms, inv, codes, scales, g);
	else
		qquant_kernel<64, MX><<<blocks, 128>>>(q, n, hadamard, nterms, inv, codes, scales, g);
	BDK_TRY(cudaGetLastError());
	BDK_TRY(cudaDeviceSynchronize());
	return 0;
}

extern "C" int bd_kernels_query_quantize(const float *q, int n, int d, int hadamard, int nterms,
					 uint8_t *ret_codes, uint8_t *ret_scales, float *ret_g)
{
	return query_quantize<false>(q, n, d, hadamard, nterms, ret_codes, ret_scales, ret_g);
}

extern "C" int bd_kernels_query_quantize_mx(const float *q, int n, int d, int hadamard, int nterms,
					    uint8_t *ret_codes, uint8_t *ret_scales)
{
	return query_quantize<true>(q, n, d, hadamard, nterms, ret_codes, ret_scales, nullptr);
}

extern "C" int bd_kernels_e4m3_exhaustive(uint64_t *ret_mismatch, uint32_t *ret_first)
{
	unsigned long long *dm = nullptr;
	unsigned int *df = nullptr;
	unsigned long long hm = 0;
	unsigned int hf = 0xffffffffu;
	int r = 0;

	if (!ret_mismatch || !ret_first)
		return -EINVAL;
	if ((r = cuda_err(cudaMalloc(&dm, sizeof(*dm)))) < 0)
		return r;
	if ((r = cuda_err(cudaMalloc(&df, sizeof(*df)))) < 0)
		goto out;
	if ((r = cuda_err(cudaMemcpy(dm, &hm, sizeof(hm), cudaMemcpyHostToDevice))) < 0 ||
	    (r = cuda_err(cudaMemcpy(df, &hf, sizeof(hf), cudaMemcpyHostToDevice))) < 0)
		goto out;
	e4m3_exhaustive_kernel<<<1024, 256>>>(dm, df);
	if ((r = cuda_err(cudaGetLastError())) < 0 || (r = cuda_err(cudaDeviceSynchronize())) < 0)
		goto out;
	if ((r = cuda_err(cudaMemcpy(&hm, dm, sizeof(hm), cudaMemcpyDeviceToHost))) < 0 ||
	    (r = cuda_err(cudaMemcpy(&hf, df, sizeof(hf), cudaMemcpyDeviceToHost))) < 0)
		goto out;
	*ret_mismatch = hm;
	*ret_first = hm ? hf : 0;
out:
	cudaFree(dm);
	cudaFree(df);
	return r;
}

extern "C" int bd_kernels_e4m3_encode(const float *x, size_t n, int hw, uint8_t *ret_codes)
{
	if (!x || !ret_codes)
		return -EINVAL;
	if (n == 0)
		return 0;
	e4m3_encode_kernel<<<1024, 256>>>(x, n, hw, ret_codes);
	BDK_TRY(cudaGetLastError());
	BDK_TRY(cudaDeviceSynchronize());
	return 0;
}
