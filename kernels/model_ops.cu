/* model_ops.cu — the model kernels of the CUDA backend (kernels/bd_ops.h).
 *
 * Each kernel is the device twin of CPU code: lib/model/model.c (bd_rmsnorm, bd_rope, silu, the
 * prefill attention over BF16-rounded K/V), lib/quant/layout.c (bd_kv_write_token) and lib/model/sampler.c
 * (bd_sampler_probs). Built with -fmad=false and without fast math: a*b+c stays two roundings
 * as in the C code; __fmaf_rn appears only in the prefill attention's dot products, which the
 * CPU computes with (FMA-using) OpenBLAS sgemm in another order anyway.
 *
 * Random numbers are counter based, so a value depends only on its key and counter (no state,
 * capturable in graphs): R(seed, c) = mix64(mix64(seed) + (c + 1)·φ), φ = 0x9e3779b97f4a7c15,
 * mix64 the splitmix64 finalizer — the c-th output of splitmix64 started at mix64(seed).
 * Uniforms are (R >> 11)·2^-53 ∈ [0, 1).
 *   bd_op_sample: u = U(seed, step).
 *   bd_op_fill_normal: x_i = mean + sigma·z_i, z_i = sqrt(−2 ln(1 − U(seed, 2i)))·
 *                      cos(2π·U(seed, 2i + 1)) in double (Box–Muller, cosine branch only).
 *
 * Sampling (one CTA per row): keys okey(l) << 32 | ~id order tokens as the CPU's sort does
 * (larger logit first, then lower id; −0 equals +0). Top-k and top-p thresholds are found by
 * MSB-first radix selection over the keys (8 bits a pass, stopping early once the remaining
 * bin is decided), top-p with fixed-point masses m_i = round(exp((l_i − l_max)/T)·2^40) whose
 * integer sums are exact, so the result does not depend on the summation order. The kept set
 * is then the CPU's: top-k by key, then the shortest prefix (in key order) whose mass reaches
 * top_p · (mass of the top-k set). The draw walks the kept tokens in id order (any order gives
 * the same distribution) to the first whose cumulative mass exceeds ⌊u · kept mass⌋.
 * Masses below 2^-41 of the top token's round to zero (never drawn; the CPU gives them
 * probability < 1e-12). The per-row record of model_ops.h is left in the workspace.
 * Top-k (bd_op_topk) and the top log-probabilities (bd_op_logprobs) select the k largest keys
 * with the same radix selection in count mode. Log-probabilities are bd_sampler_logprobs's
 * double log-sum-exp (lib/model/bd_sampler.h), not fixed point: they are reported, not drawn
 * from, and must match the CPU's to FP32 rounding.
 */
#include <cuda_runtime.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

#include "bd_kvslot.cuh"
#include "bd_ops.h"
#include "model_ops.h"

namespace bdo {

/* ---- helpers ------------------------------------------------------------------------------- */

static int launched(void)
{
	return cudaGetLastError() == cudaSuccess ? 0 : -EIO;
}

static bool dt_ok(enum bd_dtype dt)
{
	return dt == BD_DT_BF16 || dt == BD_DT_F32;
}

/* Blocks for a grid-stride loop over len items with 256 threads. */
static unsigned grid_for(size_t len)
{
	size_t b = (len + 255) / 256;
	return (unsigned)(b < 8192 ? (b ? b : 1) : 8192);
}

/* Launches the grid-stride kernel k over len items (grid_for, 256 threads) on stream with
 * args; nothing for len 0. Returns 0, or -EIO when the launch failed. */
template <typename... P, typename... A>
static int launch_items(void (*k)(P...), size_t len, void *stream, A... args)
{
	if (len == 0)
		return 0;
	k<<<grid_for(len), 256, 0, (cudaStream_t)stream>>>(args...);
	return launched();
}

__device__ __forceinline__ float bf16_to_f32(uint16_t h)
{
	return __uint_as_float((uint32_t)h << 16);
}

__device__ __forceinline__ float load_dt(const void *p, int dt, size_t i)
{
	if (dt == BD_DT_BF16)
		return bf16_to_f32(((const uint16_t *)p)[i]);
	return ((const float *)p)[i];
}

__device__ __forceinline__ void store_dt(void *p, int dt, size_t i, float x)
{
	if (dt == BD_DT_BF16)
		((uint16_t *)p)[i] = f32_to_bf16(x);
	else
		((float *)p)[i] = x;
}

struct OpSum {
	template <typename T> __device__ __forceinline__ T operator()(T a, T b) const
	{
		return a + b;
	}
};

struct OpMax {
	template <typename T> __device__ __forceinline__ T operator()(T a, T b) const
	{
		return max(a, b);
	}
};

/* op over the warp (every lane gets it), by xor butterfly. */
template <typename T, typename Op> __device__ __forceinline__ T warp_reduce(T v, Op op)
{
	for (int o = 16; o > 0; o >>= 1)
		v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
	return v;
}

template <typename T> __device__ __forceinline__ T warp_sum(T v)
{
	return warp_reduce(v, OpSum());
}

/* op over the block's nw warps (every thread gets it); sh: 32 scratch values, free to reuse
 * after the next barrier. (T)0 stands for the warps past nw, so op must have it as its
 * identity (a sum; the max of unsigned values). Fixed tree: the result does not depend on
 * timing. */
template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, T (&sh)[32], Op op, int nw)
{
	const int w = threadIdx.x / 32, l = threadIdx.x % 32;

	v = warp_reduce(v, op);
	__syncthreads();
	if (l == 0)
		sh[w] = v;
	__syncthreads();
	if (w == 0) {
		T r = l < nw ? sh[l] : (T)0;
		r = warp_reduce(r, op);
		if (l == 0)
			sh[0] = r;
	}
	__syncthreads();
	return sh[0];
}

/* Sum over the block (every thread gets it); sh: 32 scratch values. */
template <typename T> __device__ T block_sum(T v, T (&sh)[32])
{
	return block_reduce(v, sh, OpSum(), blockDim.x / 32);
}

__device__ __forceinline__ uint64_t mix64(uint64_t z)
{
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

__device__ __forceinline__ double uniform01(uint64_t seed, uint64_t ctr)
{
	uint64_t r = mix64(mix64(seed) + (ctr + 1) * 0x9e3779b97f4a7c15ull);

	return (double)(r >> 11) * 0x1p-53;
}

/* ---- embedding ------------------------------------------------------------------------------- */

__global__ void embed_kernel(const void *table, int dt, int V, int E, const int32_t *tokens,
			     float *x, int *status)
{
	const size_t i = blockIdx.x;
	const int t = tokens[i];
	const bool ok = t >= 0 && t < V;

	if (!ok && status && threadIdx.x == 0)
		atomicOr(status, 1);
	for (int c = threadIdx.x; c < E; c += blockDim.x)
		x[i * (size_t)E + (size_t)c] = ok ? load_dt(table, dt, (size_t)t * (size_t)E + (size_t)c) :
						    0.0f;
}

/* ---- RMSNorm (bd_rmsnorm: Σx² in double, scale = (float)(1/sqrt(ss/n + eps)), x·scale·w) ---- */

__global__ void rmsnorm_kernel(const float *x, const void *w, int wdt, int E, float eps, void *y,
			       int ydt)
{
	__shared__ double sh[32];
	const size_t row = blockIdx.x;
	const float *xr = x + row * (size_t)E;
	double ss = 0.0;

	for (int c = threadIdx.x; c < E; c += blockDim.x)
		ss += (double)xr[c] * (double)xr[c];
	ss = block_sum(ss, sh);
	const float scale = (float)(1.0 / sqrt(ss / E + (double)eps));
	for (int c = threadIdx.x; c < E; c += blockDim.x)
		store_dt(y, ydt, row * (size_t)E + (size_t)c, xr[c] * scale * load_dt(w, wdt, c));
}

/* One warp per (row, head), in place. */
__global__ void head_rmsnorm_kernel(float *x, const void *w, int wdt, size_t nh, int d, float eps)
{
	const size_t g = (size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
	const int l = threadIdx.x % 32;

	if (g >= nh)
		return;
	float *xr = x + g * (size_t)d;
	double ss = 0.0;
	for (int c = l; c < d; c += 32)
		ss += (double)xr[c] * (double)xr[c];
	ss = warp_sum(ss);
	const float scale = (float)(1.0 / sqrt(ss / d + (double)eps));
	for (int c = l; c < d; c += 32)
		xr[c] = xr[c] * scale * load_dt(w, wdt, c);
}

/* ---- elementwise --------------------------------------------------------------------------- */

__global__ void bias_add_kernel(float *x, const void *b, int bdt, size_t len, int width)
{
	for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < len;
	     k += (size_t)gridDim.x * blockDim.x)
		x[k] = x[k] + load_dt(b, bdt, k % (size_t)width);
}

/* lib/model/model.c's silu: x / (1 + expf(−x)). expf here is exp in double rounded once to FP32,
 * the correctly rounded value glibc's expf also returns (but in rare near-ties). */
__device__ __forceinline__ float silu(float x)
{
	const float e = (float)exp(-(double)x);

	return x / (1.0f + e);
}

__global__ void swiglu_kernel(const float *gu, size_t len, int F, void *y, int ydt)
{
	for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < len;
	     k += (size_t)gridDim.x * blockDim.x) {
		const size_t i = k / (size_t)F, j = k % (size_t)F;
		const float *g = gu + i * 2 * (size_t)F;

		store_dt(y, ydt, k, silu(g[j]) * g[(size_t)F + j]);
	}
}

__global__ void add_kernel(float *x, const float *y, size_t len)
{
	for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < len;
	     k += (size_t)gridDim.x * blockDim.x)
		x[k] = x[k] + y[k];
}

__global__ void cast_kernel(const float *x, void *y, int ydt, size_t len)
{
	for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < len;
	     k += (size_t)gridDim.x * blockDim.x)
		store_dt(y, ydt, k, x[k]);
}

__global__ void check_finite_kernel(const float *x, size_t len, int *status)
{
	int bad = 0;

	for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < len;
	     k += (size_t)gridDim.x * blockDim.x)
		bad |= !isfinite(x[k]);
	if (__any_sync(0xffffffffu, bad) && threadIdx.x % 32 == 0)
		atomicOr(status, 1);
}

__global__ void fill_normal_kernel(void *x, int dt, size_t len, uint64_t seed, float mean,
				   float sigma)
{
	for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < len;
	     k += (size_t)gridDim.x * blockDim.x) {
		const double u1 = 1.0 - uniform01(seed, 2 * (uint64_t)k);
		const double u2 = uniform01(seed, 2 * (uint64_t)k + 1);
		const double z = sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);

		store_dt(x, dt, k, mean + sigma * (float)z);
	}
}

/* ---- RoPE (bd_rope: θ = pos·base^(−2i/n_rot) in double, cos/sin rounded to FP32) ---------- */

__global__ void rope_kernel(float *x, int n, int H, int d, int n_rot, const int32_t *pos,
			    float base, int neox)
{
	const int half = n_rot / 2;
	const size_t g = (size_t)blockIdx.x * blockDim.x + threadIdx.x;

	if (g >= (size_t)n * (size_t)half)
		return;
	const size_t r = g / (size_t)half;
	const int i = (int)(g % (size_t)half);
	const double theta = (double)pos[r] * pow((double)base, -2.0 * i / n_rot);
	const float c = (float)cos(theta), s = (float)sin(theta);
	const int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
	for (int h = 0; h < H; h++) {
		float *v = x + (r * (size_t)H + (size_t)h) * (size_t)d;
		const float a = v[i0], b = v[i1];

		v[i0] = a * c - b * s;
		v[i1] = a * s + b * c;
	}
}

/* ---- KV write (bd_kv_write_token) ------------------------------------------------------------ */

struct KvParams {
	int H, d, dv;
	KvSlot s;
};

/* k' = H(k − μ) of one head row into buf[d] (shared memory), with lib/fp4.c's butterfly stages
 * (each stage is exact pairwise a ± b, so any thread order gives the CPU's values); smoothing
 * and rotation as the flags say (mu NULL: μ = 0). Every thread of the CTA calls it; buf is
 * complete for every thread on return. */
__device__ __forceinline__ void kv_transform(const float *kr, const float *mu, int smoothing,
					     int hadamard, float fwht_scale, int d, float *buf)
{
	for (int c = threadIdx.x; c < d; c += blockDim.x)
		buf[c] = smoothing && mu ? kr[c] - mu[c] : kr[c];
	if (hadamard) {
		for (int s = 1; s < d; s *= 2) {
			__syncthreads();
			for (int t = threadIdx.x; t < d / 2; t += blockDim.x) {
				const int j = (t / s) * 2 * s + t % s;
				const float a = buf[j], b = buf[j + s];

				buf[j] = a + b;
				buf[j + s] = a - b;
			}
		}
		__syncthreads();
		for (int c = threadIdx.x; c < d; c += blockDim.x)
			buf[c] = buf[c] * fwht_scale;
	}
	__syncthreads();
}

/* One CTA per (row, head): k' = H(k − μ) (kv_transform), then K' and V stored as BF16.
 * Unlike bd_kv_write_token nothing is refused here (no status): a non-finite value is written
 * as its BF16 NaN/inf, so callers check activations first (bd_op_check_finite). Two rows of one
 * slot whose positions are equal mod 128 race for one recent row: the CPU writes position by
 * position and promotes in between, so callers split such batches at page boundaries. */
__global__ void kv_write_kernel(const KvParams p, void *const *slots, const int32_t *pos,
				const float *k, const float *v, const float *mu)
{
	extern __shared__ float buf[];
	const int i = blockIdx.x, h = blockIdx.y, d = p.d, dv = p.dv;
	const float *kr = k + ((size_t)i * p.H + h) * (size_t)d;
	const float *vr = v + ((size_t)i * p.H + h) * (size_t)dv;

	kv_transform(kr, mu ? mu + (size_t)h * d : NULL, p.s.smoothing, p.s.hadamard,
		     p.s.fwht_scale, d, buf);
	const KvRows dst = kv_rows(p.s, slots[i], h, pos[i], d, dv);
	for (int c = threadIdx.x; c < d; c += blockDim.x) {
		const uint16_t b = f32_to_bf16(buf[c]);

		dst.rk[c] = b;
		if (dst.sink)
			dst.sk[c] = b;
	}
	for (int c = threadIdx.x; c < dv; c += blockDim.x) {
		const uint16_t b = f32_to_bf16(vr[c]);

		dst.rv[c] = b;
		if (dst.sink)
			dst.sv[c] = b;
	}
}

/* One CTA per (row, head): what kv_write_kernel would store, read back as FP32 into
 * ok, ov [n][H][d] (bd_seq_cache_rows). */
__global__ void kv_rows_kernel(const KvParams p, const float *k, const float *v, const float *mu,
			       float *ok, float *ov)
{
	extern __shared__ float buf[];
	const int i = blockIdx.x, h = blockIdx.y, d = p.d;
	const size_t off = ((size_t)i * p.H + h) * (size_t)d;

	kv_transform(k + off, mu ? mu + (size_t)h * d : NULL, p.s.smoothing, p.s.hadamard,
		     p.s.fwht_scale, d, buf);
	for (int c = threadIdx.x; c < d; c += blockDim.x) {
		ok[off + c] = bf16_to_f32(f32_to_bf16(buf[c]));
		ov[off + c] = bf16_to_f32(f32_to_bf16(v[off + c]));
	}
}

/* One CTA per row of d values: x ← H x (bd_fwht: the butterflies, then ·1/√d). */
__global__ void fwht_rows_kernel(float *x, int d, float scale)
{
	extern __shared__ float buf[];
	float *xr = x + (size_t)blockIdx.x * (size_t)d;

	kv_transform(xr, NULL, 0, 1, scale, d, buf);
	for (int c = threadIdx.x; c < d; c += blockDim.x)
		xr[c] = buf[c];
}

/* ---- a chunk's context from the cache (bd_seq_cache_context) -------------------------------- */

struct CtxParams {
	const uint8_t *arena;
	const int32_t *pages;  /* [n_full] the block table */
	const uint8_t *slot;   /* the request's slot */
	struct bd_layout lay;  /* where every byte lies (bd_layout.h) */
	int H, layer, sink;
};

/* E2M1 value of code (NUMERICS.md §1): {0, .5, 1, 1.5, 2, 3, 4, 6} with the sign bit 3. */
__device__ __forceinline__ float e2m1_value(uint32_t code)
{
	const uint32_t m = code & 7u;
	const float v = m < 4u ? 0.5f * (float)m : (float)(m == 7u ? 6u : m - 2u);
	return (code & 8u) ? -v : v;
}

/* A UE8M0 code (MXFP4) or an E4M3 code (any other format: NVFP4 block scales, FP8 elements)
 * as FP32, exactly as bd_ue8m0_decode and bd_e4m3_decode (the NaN codes are never stored:
 * promotion refuses non-finite values). */
__device__ __forceinline__ float block_scale(int fmt, uint32_t code)
{
	if (fmt == BD_PAGE_MXFP4)
		return __uint_as_float(code != 0u ? code << 23 : 0x00400000u);
	const uint32_t e = (code >> 3) & 0xfu, m = code & 7u;
	const float v = e == 0 ? __fmul_rn((float)m, 0x1p-9f)
			       : __uint_as_float(((e + 120u) << 23) | (m << 20));
	return (code & 0x80u) ? -v : v;
}

/* An NVFP4 or MXFP4 element of a region whose rows of n values are blocked by B along the row
 * (row r's codes at r·n/2, its scales at r·(n/B)): (g·s)·x̂ as bd_nvfp4_dequantize_block
 * (g = 1 for MXFP4, where 1·s = s exactly). */
__device__ __forceinline__ float fp4_elem(const uint8_t *codes, const uint8_t *scales, int fmt,
					  int B, int n, int r, int i, float g)
{
	const uint32_t cb = codes[(size_t)r * (n / 2) + i / 2];
	const uint32_t sb = scales[(size_t)r * (n / B) + i / B];
	return __fmul_rn(__fmul_rn(g, block_scale(fmt, sb)), e2m1_value((i & 1) ? cb >> 4 : cb & 15u));
}

/* One CTA per (page j, KV head h): element (t, c) of the page-head's K and V as
 * bd_page_read_head gives it (NVFP4: (g·s)·x̂ with K token-major and V channel-major; the
 * channel-blocked NVFP4 of trtllm-nvfp4 with both token-major; MXFP4: s·x̂; FP8: x̂·g; BF16 as
 * stored), or, for t < 16 of page 0 when the configuration keeps a sink, the BF16 sink row of
 * the slot; into ok, ov at row j·128 + t, column h·d + c of rows of H·d. */
__global__ void kv_context_kernel(const CtxParams p, float *ok, float *ov)
{
	const struct bd_layout &L = p.lay;
	const int j = blockIdx.x, h = blockIdx.y, d = L.d, B = L.block, T = BD_PAGE_TOKENS;
	const int fmt = (int)L.fmt;
	const uint8_t *page = p.arena + (size_t)p.layer * L.layer_stride +
			      (size_t)p.pages[j] * L.page_bytes;
	const uint8_t *head = page + (size_t)h * L.head_bytes;
	const float *g = (const float *)(page + L.gscale_off) + 2 * h;
	const bool scaled = fmt == BD_PAGE_NVFP4 || fmt == BD_PAGE_NVFP4_CH || fmt == BD_PAGE_FP8;
	const float gk = scaled ? g[0] : 1.0f, gv = scaled ? g[1] : 1.0f;
	const uint8_t *sh = p.slot + ((size_t)p.layer * L.n_kv_heads + (size_t)h) * L.slot_head_bytes;
	const size_t ld = (size_t)p.H * d;

	for (int e = threadIdx.x; e < T * d; e += blockDim.x) {
		const int t = e / d, c = e % d;
		const size_t o = ((size_t)j * T + t) * ld + (size_t)h * d + c;
		float kx, vx;

		if (p.sink && j == 0 && t < BD_SINK_TOKENS) {
			kx = bf16_to_f32(((const uint16_t *)(sh + L.slot_sink_k_off))[(size_t)t * d + c]);
			vx = bf16_to_f32(((const uint16_t *)(sh + L.slot_sink_v_off))[(size_t)t * d + c]);
		} else if (fmt == BD_PAGE_BF16) {
			kx = bf16_to_f32(((const uint16_t *)(head + L.k_codes_off))[(size_t)t * d + c]);
			vx = bf16_to_f32(((const uint16_t *)(head + L.v_codes_off))[(size_t)t * d + c]);
		} else if (fmt == BD_PAGE_FP8) {
			kx = __fmul_rn(block_scale(fmt, head[L.k_codes_off + (size_t)t * d + c]), gk);
			vx = __fmul_rn(block_scale(fmt, head[L.v_codes_off + (size_t)t * d + c]), gv);
		} else {
			const uint8_t *kc = head + L.k_codes_off, *ks = head + L.k_scales_off;
			const uint8_t *vc = head + L.v_codes_off, *vs = head + L.v_scales_off;
			kx = fp4_elem(kc, ks, fmt, B, d, t, c, gk);
			vx = fmt == BD_PAGE_NVFP4_CH ? fp4_elem(vc, vs, fmt, B, d, t, c, gv)
						     : fp4_elem(vc, vs, fmt, B, T, c, t, gv);
		}
		ok[o] = kx;
		ov[o] = vx;
	}
}

/* ---- prefill attention ----------------------------------------------------------------------- */

/* Flash-style: one CTA of 256 threads per (64-query block, query head), key tiles of BK in
 * shared memory, online softmax in FP32. Query row r sits at position p0 + r and sees keys
 * 0 .. p0 + r (causal over p0 + n keys). F32KV false: K and V are rounded to BF16 on load and
 * kept as BF16, BK = 64 (the whole-prompt prefill); true: K and V are used as given (FP32: a
 * chunk's context dequantized from the cache and its own rows already rounded as the cache
 * holds them), BK = 32 so that the FP32 tiles fit the 99 KiB of an sm_120 CTA.
 * Thread (tx, ty) = (tid % 16, tid / 16) owns query rows 4ty..4ty+3; in Q·Kᵀ the keys
 * tx + 16j (j < BK/16), in P·V the columns 4tx + 64g + e. Rows of one query live in 16 lanes of
 * one warp, so row max and sum are shuffles. Heaviest query blocks (latest) start first. */
constexpr int PF_BQ = 64, PF_THREADS = 256, PF_PST = PF_BQ + 4;

template <bool F32KV> __host__ __device__ constexpr int prefill_bk()
{
	return F32KV ? 32 : 64;
}

template <int D, bool F32KV> constexpr size_t prefill_smem()
{
	return (size_t)PF_BQ * (D + 4) * 4 +
	       2 * (size_t)prefill_bk<F32KV>() * (D + 4) * (F32KV ? 4 : 2) +
	       (size_t)prefill_bk<F32KV>() * PF_PST * 4;
}

__device__ __forceinline__ uint32_t pack_bf16x2(float a, float b)
{
	return (uint32_t)f32_to_bf16(a) | ((uint32_t)f32_to_bf16(b) << 16);
}

/* Four consecutive K or V values of a shared-memory row as FP32. */
template <bool F32KV> __device__ __forceinline__ float4 kv4(const void *row, int c)
{
	if constexpr (F32KV) {
		return *(const float4 *)((const float *)row + c);
	} else {
		const uint2 u = *(const uint2 *)((const uint16_t *)row + c);
		return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
				   __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
	}
}

template <int D, bool F32KV>
__global__ void __launch_bounds__(PF_THREADS) prefill_kernel(const float *q, const float *k,
							     const float *v, int n, int p0, int Hq,
							     int Hkv, float scale, float *out)
{
	constexpr int ST = D + 4; /* row stride of Q and K, V: conflict-free */
	constexpr int NG = D / 64; /* float4 column groups per thread in P·V */
	constexpr int BK = prefill_bk<F32KV>(), NJ = BK / 16;
	using KT = typename std::conditional<F32KV, float, uint16_t>::type;
	extern __shared__ __align__(16) unsigned char smem[];
	float *Qs = (float *)smem;
	KT *Ks = (KT *)(Qs + PF_BQ * ST);
	KT *Vs = Ks + BK * ST;
	float *Ps = (float *)(Vs + BK * ST);

	const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
	const int qb = (int)gridDim.x - 1 - (int)blockIdx.x;
	const int h = blockIdx.y, hk = h / (Hq / Hkv);
	const int q0 = qb * PF_BQ, nk = p0 + n;
	const size_t ldq = (size_t)Hq * D, ldk = (size_t)Hkv * D;

	for (int e = tid; e < PF_BQ * D / 4; e += PF_THREADS) {
		const int r = e / (D / 4), c = (e % (D / 4)) * 4;
		float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);

		if (q0 + r < n)
			x = *(const float4 *)(q + (size_t)(q0 + r) * ldq + (size_t)h * D + c);
		*(float4 *)&Qs[r * ST + c] = x;
	}

	float o[4][4 * NG], m[4], l[4];
	for (int i = 0; i < 4; i++) {
		m[i] = -INFINITY;
		l[i] = 0.0f;
		for (int c = 0; c < 4 * NG; c++)
			o[i][c] = 0.0f;
	}

	const int kend = min(nk, p0 + q0 + PF_BQ);
	for (int k0 = 0; k0 < kend; k0 += BK) {
		__syncthreads(); /* the previous tile's P·V is done */
		for (int e = tid; e < BK * D / 4; e += PF_THREADS) {
			const int r = e / (D / 4), c = (e % (D / 4)) * 4;
			float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f), b = a;

			if (k0 + r < nk) {
				const size_t off = (size_t)(k0 + r) * ldk + (size_t)hk * D + c;
				a = *(const float4 *)(k + off);
				b = *(const float4 *)(v + off);
			}
			if constexpr (F32KV) {
				*(float4 *)&Ks[r * ST + c] = a;
				*(float4 *)&Vs[r * ST + c] = b;
			} else {
				*(uint2 *)&Ks[r * ST + c] =
					make_uint2(pack_bf16x2(a.x, a.y), pack_bf16x2(a.z, a.w));
				*(uint2 *)&Vs[r * ST + c] =
					make_uint2(pack_bf16x2(b.x, b.y), pack_bf16x2(b.z, b.w));
			}
		}
		__syncthreads();

		float s[4][NJ];
		for (int i = 0; i < 4; i++)
			for (int j = 0; j < NJ; j++)
				s[i][j] = 0.0f;
#pragma unroll 4
		for (int c = 0; c < D; c += 4) {
			float4 qv[4], kf[NJ];

			for (int i = 0; i < 4; i++)
				qv[i] = *(const float4 *)&Qs[(ty * 4 + i) * ST + c];
			for (int j = 0; j < NJ; j++)
				kf[j] = kv4<F32KV>(&Ks[(tx + 16 * j) * ST], c);
			for (int i = 0; i < 4; i++)
				for (int j = 0; j < NJ; j++) {
					s[i][j] = __fmaf_rn(qv[i].x, kf[j].x, s[i][j]);
					s[i][j] = __fmaf_rn(qv[i].y, kf[j].y, s[i][j]);
					s[i][j] = __fmaf_rn(qv[i].z, kf[j].z, s[i][j]);
					s[i][j] = __fmaf_rn(qv[i].w, kf[j].w, s[i][j]);
				}
		}

		for (int i = 0; i < 4; i++) {
			const int qi = p0 + q0 + ty * 4 + i;
			float mx = -INFINITY;

			for (int j = 0; j < NJ; j++) {
				const int kj = k0 + tx + 16 * j;

				s[i][j] = kj <= qi && kj < nk ? s[i][j] * scale : -INFINITY;
				mx = fmaxf(mx, s[i][j]);
			}
			for (int off = 8; off > 0; off >>= 1)
				mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
			/* key 0 is visible to every row, so mnew is finite from the first tile on */
			const float mnew = fmaxf(m[i], mx);
			const float alpha = expf(m[i] - mnew);
			float rs = 0.0f;

			for (int j = 0; j < NJ; j++) {
				s[i][j] = expf(s[i][j] - mnew);
				rs += s[i][j];
			}
			for (int off = 8; off > 0; off >>= 1)
				rs += __shfl_xor_sync(0xffffffffu, rs, off);
			l[i] = l[i] * alpha + rs;
			m[i] = mnew;
			for (int c = 0; c < 4 * NG; c++)
				o[i][c] = o[i][c] * alpha;
		}
		for (int j = 0; j < NJ; j++)
			*(float4 *)&Ps[(tx + 16 * j) * PF_PST + ty * 4] =
				make_float4(s[0][j], s[1][j], s[2][j], s[3][j]);
		__syncthreads();

		const int kn = min(BK, kend - k0);
		for (int kk = 0; kk < kn; kk++) {
			const float4 p4 = *(const float4 *)&Ps[kk * PF_PST + ty * 4];
			const float pr[4] = { p4.x, p4.y, p4.z, p4.w };

			for (int g = 0; g < NG; g++) {
				const float4 v4 = kv4<F32KV>(&Vs[kk * ST], tx * 4 + 64 * g);
				const float vf[4] = { v4.x, v4.y, v4.z, v4.w };

				for (int i = 0; i < 4; i++)
					for (int e = 0; e < 4; e++)
						o[i][4 * g + e] = __fmaf_rn(pr[i], vf[e], o[i][4 * g + e]);
			}
		}
	}

	for (int i = 0; i < 4; i++) {
		const int qi = q0 + ty * 4 + i;

		if (qi >= n)
			continue;
		/* as the CPU: normalize the outputs by 1/sum */
		const float inv = 1.0f / l[i];
		for (int g = 0; g < NG; g++) {
			float4 r = make_float4(o[i][4 * g] * inv, o[i][4 * g + 1] * inv,
					       o[i][4 * g + 2] * inv, o[i][4 * g + 3] * inv);

			*(float4 *)(out + (size_t)qi * ldq + (size_t)h * D + tx * 4 + 64 * g) = r;
		}
	}
}

/* ---- sampling and top-k ------------------------------------------------------------------ */

constexpr int SNT = 1024; /* threads of a sampling / top-k CTA */

/* Order-preserving bits of a logit: NaN lowest, −0 equal to +0. */
__device__ __forceinline__ uint32_t okey(float f)
{
	uint32_t u = __float_as_uint(f);

	if (f != f)
		return 0u;
	if (f == 0.0f)
		u = 0u;
	return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* The sort key: larger logit first, then lower id. Distinct for distinct ids. */
__device__ __forceinline__ uint64_t skey(float f, int id)
{
	return ((uint64_t)okey(f) << 32) | (uint64_t)(uint32_t)~(uint32_t)id;
}

__device__ __forceinline__ int key_id(uint64_t key)
{
	return (int)~(uint32_t)key;
}

__device__ __forceinline__ uint64_t fmass(float l, float lmax, double T)
{
	const double p = exp(((double)l - (double)lmax) / T);

	return __double2ull_rn(p * BD_OP_MASS_ONE);
}

struct SelShared {
	unsigned long long hv[256]; /* mass per bin (mass mode) */
	unsigned int hc[256];       /* tokens per bin */
	unsigned long long prefix, mask, need;
	int done;
	unsigned long long red[32];
	int id;
};

/* The largest threshold t with metric{key ≥ t, key ≥ lo} ≥ need, where the metric counts
 * tokens (count mode: t is the need-th largest key) or sums fixed-point masses (mass mode). The
 * lower key bits are left zero once the rest is decided (the selected bin wholly in). */
__device__ uint64_t radix_select(const float *lg, int V, bool by_mass, float lmax, double T,
				 uint64_t lo, uint64_t need, SelShared &sh)
{
	const int tid = threadIdx.x, lane = tid % 32;

	if (tid == 0) {
		sh.prefix = 0;
		sh.mask = 0;
		sh.need = need;
		sh.done = 0;
	}
	for (int shift = 56; shift >= 0; shift -= 8) {
		for (int b = tid; b < 256; b += SNT) {
			sh.hv[b] = 0;
			sh.hc[b] = 0;
		}
		__syncthreads();
		const uint64_t prefix = sh.prefix, mask = sh.mask;
		for (int i = tid; i < V; i += SNT) {
			const float l = lg[i];
			const uint64_t key = skey(l, i);

			if ((key & mask) != prefix || key < lo)
				continue;
			const int b = (int)((key >> shift) & 255u);
			atomicAdd(&sh.hc[b], 1u);
			if (by_mass)
				atomicAdd(&sh.hv[b], (unsigned long long)fmass(l, lmax, T));
		}
		__syncthreads();
		if (tid < 32) {
			unsigned long long val[8], loc = 0, suf;

			for (int e = 0; e < 8; e++) {
				val[e] = by_mass ? sh.hv[8 * lane + e] : sh.hc[8 * lane + e];
				loc += val[e];
			}
			/* suffix sums over lanes: suf = Σ of lanes ≥ lane */
			suf = loc;
			for (int o = 1; o < 32; o <<= 1) {
				unsigned long long t = __shfl_down_sync(0xffffffffu, suf, o);

				if (lane + o < 32)
					suf += t;
			}
			const unsigned long long nd = sh.need;
			/* every lane has read need before the chosen lane rewrites it (the ballot
			 * orders them too; racecheck models only explicit warp barriers) */
			__syncwarp();
			const unsigned ball = __ballot_sync(0xffffffffu, suf >= nd);
			/* ball ≠ 0: lane 0's suffix is the total, ≥ need by construction */
			if (lane == 31 - __clz((int)ball)) {
				unsigned long long acc = suf - loc;
				int b = 8 * lane;

				for (int e = 7; e >= 0; e--) {
					if (acc + val[e] >= nd) {
						b = 8 * lane + e;
						break;
					}
					acc += val[e];
				}
				const unsigned long long rest = nd - acc;
				sh.need = rest;
				sh.prefix = prefix | ((uint64_t)b << shift);
				sh.mask = mask | (255ull << shift);
				if (sh.hc[b] == 1 || (!by_mass && sh.hc[b] == rest))
					sh.done = 1;
			}
		}
		__syncthreads();
		if (sh.done)
			break;
	}
	/* the bin's uncounted keys below lo stay out */
	const uint64_t r = sh.prefix > lo ? sh.prefix : lo;
	__syncthreads();
	return r;
}

/* Σ fixed-point mass of the tokens with key ≥ thresh. */
__device__ uint64_t mass_above(const float *lg, int V, float lmax, double T, uint64_t thresh,
			       SelShared &sh)
{
	unsigned long long s = 0;

	for (int i = threadIdx.x; i < V; i += SNT) {
		const float l = lg[i];

		if (skey(l, i) >= thresh)
			s += fmass(l, lmax, T);
	}
	return block_sum(s, sh.red);
}

/* Exclusive prefix sum over the block. */
__device__ unsigned long long block_excl_scan(unsigned long long v, SelShared &sh)
{
	const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
	unsigned long long x = v;

	for (int o = 1; o < 32; o <<= 1) {
		unsigned long long t = __shfl_up_sync(0xffffffffu, x, o);

		if (lane >= o)
			x += t;
	}
	__syncthreads();
	if (lane == 31)
		sh.red[w] = x;
	__syncthreads();
	if (w == 0) {
		unsigned long long y = sh.red[lane];

		for (int o = 1; o < 32; o <<= 1) {
			unsigned long long t = __shfl_up_sync(0xffffffffu, y, o);

			if (lane >= o)
				y += t;
		}
		sh.red[lane] = y - sh.red[lane]; /* exclusive over warps */
	}
	__syncthreads();
	return sh.red[w] + x - v;
}

/* Max over a CTA of SNT threads; sh.red is free again when it returns. */
__device__ unsigned long long block_max_u64(unsigned long long v, SelShared &sh)
{
	const unsigned long long r = block_reduce(v, sh.red, OpMax(), SNT / 32);

	__syncthreads();
	return r;
}

__global__ void __launch_bounds__(SNT) sample_kernel(const float *logits, int V,
						     const struct bd_gsample *params, int32_t *ret,
						     struct bd_op_sample_rec *recs)
{
	__shared__ SelShared sh;
	const int row = blockIdx.x, tid = threadIdx.x;
	const float *lg = logits + (size_t)row * (size_t)V;
	const struct bd_gsample p = params[row];
	unsigned long long best = 0;
	int bad = 0;

	for (int i = tid; i < V; i += SNT) {
		const float l = lg[i];

		bad |= isnan(l) || l == INFINITY;
		best = max(best, (unsigned long long)skey(l, i));
	}
	bad = __syncthreads_or(bad);
	best = block_max_u64(best, sh);
	const int amax = key_id(best);
	const float lmax = lg[amax];
	struct bd_op_sample_rec rec = { 0, 0, 0, 0.0 };

	if (bad || lmax == -INFINITY) {
		if (tid == 0) {
			ret[row] = -1;
			recs[row] = rec;
		}
		return;
	}
	/* temperature 0 (or not a positive number) and top-k 1 are greedy, as is_greedy() */
	if (!(p.temperature > 0.0f) || p.temperature == INFINITY || p.top_k == 1) {
		if (tid == 0) {
			rec.thresh = best;
			ret[row] = amax;
			recs[row] = rec;
		}
		return;
	}
	const double T = (double)p.temperature;
	uint64_t thresh = 0;
	if (p.top_k > 0 && p.top_k < V)
		thresh = radix_select(lg, V, false, lmax, T, 0, (uint64_t)p.top_k, sh);
	const uint64_t cand = mass_above(lg, V, lmax, T, thresh, sh);
	uint64_t kept = cand;
	if (p.top_p > 0.0f && p.top_p < 1.0f) {
		/* CPU: the shortest prefix with cum ≥ top_p · total */
		double w = ceil((double)p.top_p * (double)cand);
		uint64_t want = w < 1.0 ? 1 : w >= (double)cand ? cand : (uint64_t)w;

		thresh = radix_select(lg, V, true, lmax, T, thresh, want, sh);
		kept = mass_above(lg, V, lmax, T, thresh, sh);
	}
	const double u = uniform01(p.seed, p.step);
	uint64_t target = (uint64_t)(u * (double)kept);
	if (target >= kept)
		target = kept - 1;

	/* the draw: contiguous id ranges per thread, a block scan of their kept mass */
	const int chunk = (V + SNT - 1) / SNT;
	const int b0 = min(V, tid * chunk), b1 = min(V, b0 + chunk);
	unsigned long long own = 0;
	for (int i = b0; i < b1; i++) {
		const float l = lg[i];

		if (skey(l, i) >= thresh)
			own += fmass(l, lmax, T);
	}
	if (tid == 0)
		ret[row] = -1; /* overwritten by the drawing thread below (ordered by the scan's barriers) */
	const unsigned long long excl = block_excl_scan(own, sh);
	if (own > 0 && excl <= target && target < excl + own) {
		unsigned long long acc = excl;

		for (int i = b0; i < b1; i++) {
			const float l = lg[i];

			if (skey(l, i) < thresh)
				continue;
			acc += fmass(l, lmax, T);
			if (target < acc) {
				ret[row] = i;
				break;
			}
		}
	}
	if (tid == 0) {
		rec.thresh = thresh;
		rec.kept_mass = kept;
		rec.cand_mass = cand;
		rec.u = u;
		recs[row] = rec;
	}
}

/* What top_rank needs in shared memory. */
struct TopShared {
	SelShared sel;
	unsigned long long keys[64];
	int cnt;
};

/* The k ≤ min(64, V) largest keys of row lg (skey order: value desc, id asc, −0 = +0, NaN
 * last): thread tid < k gets the id of one of them and its rank 0..k−1 (0 the largest) and
 * returns true; the others return false. Every thread of the CTA calls it. */
__device__ bool top_rank(const float *lg, int V, int k, TopShared &sh, int &rank, int &id)
{
	const int tid = threadIdx.x;
	const uint64_t thresh =
		k < V ? radix_select(lg, V, false, 0.0f, 1.0, 0, (uint64_t)k, sh.sel) : 0;

	if (tid == 0)
		sh.cnt = 0;
	__syncthreads();
	for (int i = tid; i < V; i += SNT) {
		const uint64_t key = skey(lg[i], i);

		/* keys are distinct, so exactly k of them reach the k-th largest */
		if (key >= thresh) {
			const int at = atomicAdd(&sh.cnt, 1);

			if (at < 64)
				sh.keys[at] = key;
		}
	}
	__syncthreads();
	if (tid >= k)
		return false;
	const unsigned long long me = sh.keys[tid];
	int r = 0;

	for (int j = 0; j < k; j++)
		r += sh.keys[j] > me;
	rank = r;
	id = key_id(me);
	return true;
}

__global__ void __launch_bounds__(SNT) topk_kernel(const float *logits, int V, int k,
						   int32_t *ids, float *vals)
{
	__shared__ TopShared sh;
	const int row = blockIdx.x;
	const float *lg = logits + (size_t)row * (size_t)V;
	int rank, id;

	if (top_rank(lg, V, k, sh, rank, id)) {
		ids[(size_t)row * k + rank] = id;
		vals[(size_t)row * k + rank] = lg[id];
	}
}

/* bd_op_logprobs: one CTA per wanted row j, r = rows[j]. */
__global__ void __launch_bounds__(SNT) logprobs_kernel(const float *logits, int V,
						       const int32_t *rows, const int32_t *tokens,
						       int k, float *lp, int32_t *ids, float *vals)
{
	__shared__ TopShared sh;
	__shared__ float fred[32];
	__shared__ double dred[32];
	const int j = blockIdx.x, tid = threadIdx.x;
	const int row = rows ? rows[j] : j;
	const float *lg = logits + (size_t)row * (size_t)V;
	float mx = -INFINITY;
	int bad = 0;

	for (int i = tid; i < V; i += SNT) {
		const float l = lg[i];

		bad |= isnan(l) || l == INFINITY;
		mx = fmaxf(mx, l); /* NaN is never kept (and refuses the row) */
	}
	bad = __syncthreads_or(bad);
	mx = block_reduce(mx, fred, OpMax(), SNT / 32); /* every warp present: no padding */
	if (bad || mx == -INFINITY) {
		/* the CPU's -EDOM */
		if (tid == 0)
			lp[j] = NAN;
		if (tid < k) {
			ids[(size_t)j * k + tid] = -1;
			vals[(size_t)j * k + tid] = NAN;
		}
		return;
	}
	const double m = (double)mx;
	double s = 0.0;

	for (int i = tid; i < V; i += SNT)
		s += exp((double)lg[i] - m);
	s = block_sum(s, dred);
	const double lse = m + log(s);

	if (tid == 0) {
		const int32_t t = tokens[row];

		lp[j] = t >= 0 && t < V ? (float)((double)lg[t] - lse) : NAN;
	}
	if (k == 0)
		return;
	int rank, id;

	if (top_rank(lg, V, k, sh, rank, id)) {
		ids[(size_t)j * k + rank] = id;
		vals[(size_t)j * k + rank] = (float)((double)lg[id] - lse);
	}
}

} /* namespace bdo */

using namespace bdo;

/* ---- the C API (bd_ops.h) ------------------------------------------------------------------- */

extern "C" int bd_op_embed(const void *table, enum bd_dtype dt, int V, int E,
			   const int32_t *tokens, int n, float *x, int *status, void *stream)
{
	if (!table || !dt_ok(dt) || V < 1 || E < 1 || !tokens || n < 0 || !x)
		return -EINVAL;
	if (n == 0)
		return 0;
	embed_kernel<<<n, 256, 0, (cudaStream_t)stream>>>(table, dt, V, E, tokens, x, status);
	return launched();
}

extern "C" int bd_op_rmsnorm(const float *x, const void *w, enum bd_dtype wdt, int n, int E,
			     float eps, void *y, enum bd_dtype ydt, void *stream)
{
	if (!x || !w || !dt_ok(wdt) || n < 0 || E < 1 || !(eps > 0.0f) || !isfinite(eps) || !y ||
	    !dt_ok(ydt))
		return -EINVAL;
	if (n == 0)
		return 0;
	rmsnorm_kernel<<<n, E >= 1024 ? 512 : 256, 0, (cudaStream_t)stream>>>(x, w, wdt, E, eps, y,
									     ydt);
	return launched();
}

extern "C" int bd_op_head_rmsnorm(float *x, const void *w, enum bd_dtype wdt, int n, int H, int d,
				  float eps, void *stream)
{
	if (!x || !w || !dt_ok(wdt) || n < 0 || H < 1 || d < 1 || !(eps > 0.0f) || !isfinite(eps))
		return -EINVAL;
	if (n == 0)
		return 0;
	const size_t nh = (size_t)n * (size_t)H;
	const size_t blocks = (nh + 7) / 8;
	if (blocks > 0x7fffffffu)
		return -EINVAL;
	head_rmsnorm_kernel<<<(unsigned)blocks, 256, 0, (cudaStream_t)stream>>>(x, w, wdt, nh, d,
									      eps);
	return launched();
}

extern "C" int bd_op_bias_add(float *x, const void *b, enum bd_dtype bdt, int n, int width,
			      void *stream)
{
	if (!x || !b || !dt_ok(bdt) || n < 0 || width < 1)
		return -EINVAL;
	const size_t len = (size_t)n * (size_t)width;
	return launch_items(bias_add_kernel, len, stream, x, b, bdt, len, width);
}

extern "C" int bd_op_rope(float *x, int n, int H, int d, int n_rot, const int32_t *pos,
			  float base, int neox, void *stream)
{
	if (!x || !pos || n < 0 || H < 1 || d < 2 || n_rot < 2 || n_rot % 2 != 0 || n_rot > d ||
	    !isfinite(base) || !(base > 0.0f) || (neox != 0 && neox != 1))
		return -EINVAL;
	if (n == 0)
		return 0;
	const size_t items = (size_t)n * (size_t)(n_rot / 2);
	const size_t blocks = (items + 255) / 256;
	if (blocks > 0x7fffffffu)
		return -EINVAL;
	rope_kernel<<<(unsigned)blocks, 256, 0, (cudaStream_t)stream>>>(x, n, H, d, n_rot, pos, base,
								       neox);
	return launched();
}

extern "C" int bd_op_swiglu(const float *gu, int n, int F, void *y, enum bd_dtype ydt,
			    void *stream)
{
	if (!gu || n < 0 || F < 1 || !y || !dt_ok(ydt))
		return -EINVAL;
	const size_t len = (size_t)n * (size_t)F;
	return launch_items(swiglu_kernel, len, stream, gu, len, F, y, ydt);
}

extern "C" int bd_op_add(float *x, const float *y, size_t len, void *stream)
{
	if (!x || !y)
		return -EINVAL;
	return launch_items(add_kernel, len, stream, x, y, len);
}

extern "C" int bd_op_cast(const float *x, void *y, enum bd_dtype ydt, size_t len, void *stream)
{
	if (!x || !y || !dt_ok(ydt))
		return -EINVAL;
	return launch_items(cast_kernel, len, stream, x, y, ydt, len);
}

template <int D, bool F32KV>
static int prefill_launch(const float *q, const float *k, const float *v, int n, int p0, int Hq,
			  int Hkv, float scale, float *out, cudaStream_t st)
{
	/* the shared-memory opt-in, once per device (racing threads set the same value) */
	static int attr_set[64];
	const size_t smem = prefill_smem<D, F32KV>();
	int dev = 0;

	if (cudaGetDevice(&dev) != cudaSuccess)
		return -EIO;
	if (dev < 0 || dev >= 64 || !__atomic_load_n(&attr_set[dev], __ATOMIC_ACQUIRE)) {
		if (cudaFuncSetAttribute((const void *)prefill_kernel<D, F32KV>,
					 cudaFuncAttributeMaxDynamicSharedMemorySize,
					 (int)smem) != cudaSuccess)
			return -EIO;
		if (dev >= 0 && dev < 64)
			__atomic_store_n(&attr_set[dev], 1, __ATOMIC_RELEASE);
	}
	const dim3 grid((unsigned)((n + PF_BQ - 1) / PF_BQ), (unsigned)Hq);
	prefill_kernel<D, F32KV><<<grid, PF_THREADS, smem, st>>>(q, k, v, n, p0, Hq, Hkv, scale,
								 out);
	return launched();
}

/* The argument checks both prefill attentions share. */
static bool prefill_args_ok(const float *q, const float *k, const float *v, const float *out,
			    int n, int Hq, int Hkv, int d, float scale)
{
	if (!q || !k || !v || !out || n < 0 || n > (1 << 20) || Hq < 1 || Hkv < 1 || Hq > 65535 ||
	    Hq % Hkv != 0 || (d != 64 && d != 128) || !isfinite(scale))
		return false;
	/* float4 loads and stores */
	return (((uintptr_t)q | (uintptr_t)k | (uintptr_t)v | (uintptr_t)out) & 15) == 0;
}

extern "C" int bd_op_prefill_attn(const float *q, const float *k, const float *v, int n, int Hq,
				  int Hkv, int d, float scale, float *out, void *stream)
{
	if (!prefill_args_ok(q, k, v, out, n, Hq, Hkv, d, scale))
		return -EINVAL;
	if (n == 0)
		return 0;
	if (d == 64)
		return prefill_launch<64, false>(q, k, v, n, 0, Hq, Hkv, scale, out,
						 (cudaStream_t)stream);
	return prefill_launch<128, false>(q, k, v, n, 0, Hq, Hkv, scale, out, (cudaStream_t)stream);
}

extern "C" int bd_op_prefill_attn_ctx(const float *q, const float *k, const float *v, int n,
				      int p, int Hq, int Hkv, int d, float scale, float *out,
				      void *stream)
{
	if (!prefill_args_ok(q, k, v, out, n, Hq, Hkv, d, scale) || p < 0 ||
	    p > (1 << 20) - n)
		return -EINVAL;
	if (n == 0)
		return 0;
	if (d == 64)
		return prefill_launch<64, true>(q, k, v, n, p, Hq, Hkv, scale, out,
						(cudaStream_t)stream);
	return prefill_launch<128, true>(q, k, v, n, p, Hq, Hkv, scale, out, (cudaStream_t)stream);
}

/* The checks and kernel parameters both KV write launchers share: heads 0..H−1 of layer
 * `layer`, the transform of cfg. false: a bad argument. */
static bool kv_params(const struct bd_layout *lay, const struct bd_kvcfg *cfg, int layer, int n,
		      int H, KvParams *ret)
{
	if (!lay || !cfg || n < 0 || layer < 0 || layer >= lay->n_layers || H < 1 ||
	    H > lay->n_kv_heads || H > 65535 || lay->d < 1 || lay->d > BD_FWHT_MAX ||
	    lay->dv < 1 || lay->dv > BD_FWHT_MAX)
		return false;
	if (cfg->hadamard && (lay->d & (lay->d - 1)) != 0)
		return false;
	memset(ret, 0, sizeof(*ret));
	ret->H = H;
	ret->d = lay->d;
	ret->dv = lay->dv;
	ret->s = kv_slot(lay, cfg, layer);
	return true;
}

extern "C" int bd_op_kv_write(const struct bd_layout *lay, const struct bd_kvcfg *cfg, int layer,
			      void *const *slots, const int32_t *pos, const float *k,
			      const float *v, const float *mu_k, int n, int H, void *stream)
{
	KvParams p;

	if (!slots || !pos || !k || !v || !kv_params(lay, cfg, layer, n, H, &p))
		return -EINVAL;
	if (n == 0)
		return 0;
	const int threads = lay->d >= 256 ? 256 : 128;
	kv_write_kernel<<<dim3((unsigned)n, (unsigned)H), threads, (size_t)lay->d * sizeof(float),
			  (cudaStream_t)stream>>>(p, slots, pos, k, v, mu_k);
	return launched();
}

extern "C" int bd_op_kv_rows(const struct bd_layout *lay, const struct bd_kvcfg *cfg, int layer,
			     const float *k, const float *v, const float *mu_k, int n, int H,
			     float *ret_k, float *ret_v, void *stream)
{
	KvParams p;

	if (!k || !v || !ret_k || !ret_v || !kv_params(lay, cfg, layer, n, H, &p) ||
	    lay->dv != lay->d)
		return -EINVAL;
	if (n == 0)
		return 0;
	const int threads = lay->d >= 256 ? 256 : 128;
	kv_rows_kernel<<<dim3((unsigned)n, (unsigned)H), threads, (size_t)lay->d * sizeof(float),
			 (cudaStream_t)stream>>>(p, k, v, mu_k, ret_k, ret_v);
	return launched();
}

extern "C" int bd_op_fwht_rows(float *x, int rows, int d, void *stream)
{
	if (!x || rows < 0 || d < 2 || d > BD_FWHT_MAX || (d & (d - 1)) != 0)
		return -EINVAL;
	if (rows == 0)
		return 0;
	/* lib/quant/fp4.c's bd_fwht scale, by the same two IEEE operations */
	const float scale = 1.0f / sqrtf((float)d);
	fwht_rows_kernel<<<(unsigned)rows, d >= 256 ? 256 : 128, (size_t)d * sizeof(float),
			   (cudaStream_t)stream>>>(x, d, scale);
	return launched();
}

extern "C" int bd_op_kv_context(const struct bd_layout *lay, const struct bd_kvcfg *cfg,
				int layer, const void *arena, const int32_t *pages, int n_full,
				const void *slot, int H, float *ret_k, float *ret_v, void *stream)
{
	if (!lay || !cfg || !arena || !pages || !slot || !ret_k || !ret_v || n_full < 0 ||
	    n_full > 65535 || layer < 0 || layer >= lay->n_layers || H < 1 ||
	    H > lay->n_kv_heads || H > 65535 || lay->d_rope != 0 || lay->dv != lay->d ||
	    (int)lay->fmt < 0 || lay->fmt >= BD_PAGE_FORMAT_COUNT)
		return -EINVAL;
	const bool fp4 = lay->fmt == BD_PAGE_NVFP4 || lay->fmt == BD_PAGE_NVFP4_CH ||
			 lay->fmt == BD_PAGE_MXFP4;
	if (fp4 && (lay->block < 2 || lay->d % lay->block != 0 ||
		    BD_PAGE_TOKENS % lay->block != 0))
		return -EINVAL;
	if (n_full == 0)
		return 0;
	CtxParams p;
	memset(&p, 0, sizeof(p));
	p.arena = (const uint8_t *)arena;
	p.pages = pages;
	p.slot = (const uint8_t *)slot;
	p.lay = *lay;
	p.H = H;
	p.layer = layer;
	p.sink = cfg->sink ? 1 : 0;
	kv_context_kernel<<<dim3((unsigned)n_full, (unsigned)H), 256, 0, (cudaStream_t)stream>>>(
		p, ret_k, ret_v);
	return launched();
}

extern "C" size_t bd_op_sample_ws_bytes(int n, int V)
{
	(void)V;
	return (size_t)(n > 0 ? n : 1) * sizeof(struct bd_op_sample_rec);
}

extern "C" int bd_op_sample(const float *logits, int n, int V, const struct bd_gsample *p,
			    int32_t *ret, void *ws, void *stream)
{
	/* fixed-point masses: V · 2^40 must fit in 64 bits */
	if (!logits || n < 0 || V < 1 || V > (1 << 23) || !p || !ret || !ws ||
	    ((uintptr_t)ws & 7) || ((uintptr_t)p & 7))
		return -EINVAL;
	if (n == 0)
		return 0;
	sample_kernel<<<n, SNT, 0, (cudaStream_t)stream>>>(logits, V, p, ret,
							   (struct bd_op_sample_rec *)ws);
	return launched();
}

extern "C" int bd_op_topk(const float *logits, int n, int V, int k, int32_t *ids, float *vals,
			  void *stream)
{
	if (!logits || n < 0 || V < 1 || k < 1 || k > 64 || k > V || !ids || !vals)
		return -EINVAL;
	if (n == 0)
		return 0;
	topk_kernel<<<n, SNT, 0, (cudaStream_t)stream>>>(logits, V, k, ids, vals);
	return launched();
}

extern "C" int bd_op_logprobs(const float *logits, int V, const int32_t *rows, int m,
			      const int32_t *tokens, int k, float *lp, int32_t *ids, float *vals,
			      void *stream)
{
	if (!logits || V < 1 || m < 0 || !tokens || !lp || k < 0 || k > 64 || k > V ||
	    (k > 0 && (!ids || !vals)))
		return -EINVAL;
	if (m == 0)
		return 0;
	logprobs_kernel<<<m, SNT, 0, (cudaStream_t)stream>>>(logits, V, rows, tokens, k, lp, ids,
							     vals);
	return launched();
}

extern "C" int bd_op_fill_normal(void *x, enum bd_dtype dt, size_t len, uint64_t seed,
				 float mean, float sigma, void *stream)
{
	if (!x || !dt_ok(dt) || !isfinite(mean) || !isfinite(sigma))
		return -EINVAL;
	return launch_items(fill_normal_kernel, len, stream, x, dt, len, seed, mean, sigma);
}

extern "C" int bd_op_check_finite(const float *x, size_t len, int *status, void *stream)
{
	if (!x || !status)
		return -EINVAL;
	return launch_items(check_finite_kernel, len, stream, x, len, status);
}
