/* decode_sm100.cu — the native FP4 decode for sm_100a/sm_103a (B200, B300): NVFP4 and MXFP4
 * pages multiplied as FP4 by the block-scaled tcgen05 MMA (kind::mxf4nvf4 block16 with UE4M3
 * scales, kind::mxf4 block32 with UE8M0; paper §4) into tensor-memory accumulators, built on
 * CuTe's atoms, descriptors and TMEM layouts (kernels/bd_umma_sm100.cuh), the BF16
 * sink+recent partial and the LSE combine, behind bd_kernels_bw.h. Built for sm_100a and
 * sm_103a only.
 *
 * The work is bd_decode_run's (bd_kernels.h): one CTA of four warps per (split, KV head,
 * request), split n_splits being the BF16 partial, the last CTA of a (request, KV head) to
 * finish doing the combine, over the same workspace. Per page of a split (NUMERICS.md §5–§6
 * with the page as the tile):
 *   1. the page-head streams into a shared-memory stage (bulk copy, STAGES deep);
 *   2. the 128 threads place its K and V codes and scales into the MMA operand tiles where
 *      quant/bd_mma_sm100.h says (bd_umma_off, bd_umma_sf_off), which frees the stage;
 *   3. warp 0 copies the scale tiles to TMEM (tcgen05.cp) and issues S^T = K̂ Q̂^T: M = the
 *      page's 128 keys, N = 16 stacked query terms, d/64 instructions, committed to an mbarrier;
 *   4. thread t reads key t's row of S^T from TMEM: logits ((acc₁·g_q1 + acc₂·g_q2)·g_K)·γ, the
 *      P block maxima (lane shuffles), the tile maximum (one CTA barrier), P = 2^(S − m + log2 c)
 *      and ℓ, its P̂ code (underflow-aware NVFP4 or OCP MXFP4); eight lanes merge their codes
 *      into a word of the P tile and block leaders write the P scales;
 *   5. warp 0 issues O^T = V̂^T P̂^T: M = 128 channels (rows ≥ d zero), N = 16 heads, two
 *      instructions over the page's keys;
 *   6. thread t reads channel t's row of O^T: o = α·o + acc·g_V, as the reference.
 * The query (rotation, dual-residual terms: bd_kcommon.cuh, the same bytes as the CPU) fills the
 * Q tile once per CTA. Every FP4 product is exact on the tensor cores; only FP32 summation
 * order differs from the reference decoder, and lib/quant/mma_sm100.c runs this dataflow on
 * the CPU (bd_umma_decode_gqa). TMEM is allocated and freed inside the kernel and nothing
 * waits on the host: a run can be captured in a CUDA graph.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <cute/arch/copy_sm100.hpp>
#include <cute/arch/tmem_allocator_sm100.hpp>
#include <cute/atom/copy_traits_sm100.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/detail/sm100_tmem_helper.hpp>

#include "bd_kcommon.cuh"
#include "bd_kernels_bw.h"
#include "bd_umma_sm100.cuh"
#include "quant/bd_mma_sm100.h"

namespace bd100 {

constexpr int WARPS = 4;
constexpr int THREADS = 32 * WARPS;
constexpr int MAX_G = 8;
constexpr int TMEM_COLS = 64; /* two 16-column accumulators and four scale-factor tiles */
constexpr int BF16_ROWS = BD_SINK_TOKENS + BD_RECENT_TOKENS;

constexpr int up(int x, int a)
{
	return (x + a - 1) / a * a;
}

/* Shared memory of one CTA, from a 1024-byte aligned base: the operand tiles (their rows that
 * a page never writes stay zero), the scale-factor tiles, STAGES page-heads, then the page
 * decode scales, the cross-warp maxima and sums, the query decode scales, the mbarriers
 * (stages, S^T done, O^T done) and the TMEM address. The BF16 CTA and the combine reuse it
 * from the start. */
template <int D, bool MX>
struct Smem {
	static constexpr int VS = MX ? BD_MXFP4_BLOCK : BD_NVFP4_BLOCK;
	static constexpr int HB = D * (MX ? 136 : 144); /* page-head bytes (bd_layout_init) */
	static constexpr int STAGES = D == 128 ? 3 : 4;
	static constexpr int KT = 0;
	static constexpr int VT = KT + up(BD_UMMA_M * D / 2, BD_UMMA_TILE_ALIGN);
	static constexpr int QT = VT + BD_UMMA_M * BD_UMMA_PV_ROW;
	static constexpr int PT = QT + BD_UMMA_TILE_ALIGN;
	static constexpr int KSF = PT + BD_UMMA_TILE_ALIGN;
	static constexpr int QSF = KSF + (int)bd_umma_sf_bytes(D / VS);
	static constexpr int VSF = QSF + (int)bd_umma_sf_bytes(D / VS);
	static constexpr int PSF = VSF + (int)bd_umma_sf_bytes(BD_PAGE_TOKENS / VS);
	static constexpr int STAGE = up(PSF + (int)bd_umma_sf_bytes(BD_PAGE_TOKENS / VS), BD_UMMA_TILE_ALIGN);
	static constexpr int GBUF = STAGE + STAGES * HB;          /* float [STAGES][4] */
	static constexpr int REDM = GBUF + 16 * STAGES;           /* float [2][WARPS][8] */
	static constexpr int REDL = REDM + 2 * WARPS * MAX_G * 4; /* float [WARPS][8] */
	static constexpr int QG = REDL + WARPS * MAX_G * 4;       /* float [2][8] */
	static constexpr int BAR = QG + 2 * MAX_G * 4;            /* u64 [STAGES + 2] */
	static constexpr int TMEM = BAR + 8 * (STAGES + 2);
	static constexpr int BYTES = TMEM + 16;
	static constexpr int ALLOC = BYTES + BD_UMMA_TILE_ALIGN; /* with the base's alignment */
	/* the combine's weights, (n_splits + 1)·G floats with n_splits ≤ 1024 */
	static_assert(1025 * MAX_G * 4 <= BYTES, "combine weights fit");
	static_assert(HB % 128 == 0 && GBUF % 16 == 0 && BAR % 8 == 0, "aligned buffers");
};

__device__ __forceinline__ void flag(const bd_decode_args &a, int bits)
{
	if (a.status)
		atomicOr(a.status, bits);
}

/* Request b's context: its length and full pages, and split s's pages [pb, pb + np) by the
 * reference's chunk rule; a length the block table cannot hold is flagged and taken as 0. */
struct Ctx {
	int len, n_full, pb, np;
};

__device__ __forceinline__ Ctx ctx_of(const bd_decode_plan &pl, const bd_decode_args &a, int b, int s)
{
	Ctx c;
	c.len = a.seq_lens[b];
	c.n_full = c.len >= 1 ? (c.len - 1) / BD_PAGE_TOKENS : 0;
	if (c.len < 1 || c.n_full > a.bt_stride) {
		if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0)
			flag(a, BD_KSTATUS_BAD_LEN);
		c.len = c.n_full = 0;
	}
	const int chunk = max((c.n_full + pl.n_splits - 1) / pl.n_splits, 1);
	c.pb = (int)min((long long)s * chunk, (long long)c.n_full);
	c.np = min(c.pb + chunk, c.n_full) - c.pb;
	return c;
}

/* Slot of partial s of (b, h) among the workspace's [B][Hkv][n_splits + 1]. */
__device__ __forceinline__ size_t slot_of(const bd_decode_plan &pl, int b, int h, int s)
{
	return ((size_t)b * pl.Hkv + h) * (size_t)(pl.n_splits + 1) + s;
}

__device__ __forceinline__ float *ws_out(const bd_decode_args &a)
{
	return (float *)a.workspace;
}

__device__ __forceinline__ float *ws_lse(const bd_decode_plan &pl, const bd_decode_args &a)
{
	return (float *)((uint8_t *)a.workspace + pl.ws_lse_off);
}

/* Query head hd of (b, h): FP32, lane-strided (x[i] = q[lane + 32i]), rotated if the
 * configuration rotates keys (NUMERICS.md §5). */
template <int D>
__device__ __forceinline__ void query_of(const bd_decode_plan &pl, const bd_decode_args &a, int b,
					 int h, int hd, float (&x)[D / 32])
{
	const float *q = a.q + ((size_t)b * pl.Hq + (size_t)h * pl.G + hd) * D;
	const int lane = threadIdx.x & 31;
#pragma unroll
	for (int i = 0; i < D / 32; i++)
		x[i] = q[lane + 32 * i];
	if (pl.hadamard)
		bdk::fwht_warp<D>(x, 1.0f / sqrtf((float)D));
}

/* ---- tcgen05 ordering ------------------------------------------------------------------------- */

/* Order this thread's tcgen05 operations (TMEM loads, MMAs) before, resp. after, a thread
 * synchronization (PTX ISA, tcgen05 memory consistency). */
__device__ __forceinline__ void tc_before_sync()
{
	asm volatile("tcgen05.fence::before_thread_sync;" ::: "memory");
}

__device__ __forceinline__ void tc_after_sync()
{
	asm volatile("tcgen05.fence::after_thread_sync;" ::: "memory");
}

/* One scale-factor tile (shared memory, layout SfLayout) to its TMEM tensor, by CuTe's
 * tcgen05.cp.32x128b.warpx4 copy (each 512-byte chunk to four columns of every subpartition).
 * One thread issues it. */
template <class SfLayout, class TmemSf>
__device__ __forceinline__ void sf_to_tmem(uint8_t *src, TmemSf const &tsf)
{
	using namespace cute;
	using Op = SM100_UTCCP_4x32dp128bit_1cta;
	using SF = typename TmemSf::value_type;
	Tensor s = make_tensor(make_smem_ptr(reinterpret_cast<SF *>(src)), SfLayout{});
	Tensor sc = make_tensor(s.data(), filter_zeros(s.layout()));
	Tensor tc = make_tensor(tsf.data(), filter_zeros(tsf.layout()));
	auto cp = make_utccp_copy(Op{}, tc);
	auto thr = cp.get_slice(0);
	Tensor src_desc = get_utccp_smem_desc_tensor<Op>(thr.partition_S(sc));
	Tensor dst = thr.partition_D(tc);
	copy(cp, src_desc, dst);
}

/* acc = A·B over the k-blocks of A's descriptors (CuTe's SM100_MMA_MXF4_SS, one elected lane
 * of the calling warp issues each instruction). */
template <class Mma, class FA, class FB, class SFA, class SFB, class Acc>
__device__ __forceinline__ void mma_tile(Mma &mma, FA const &fa, FB const &fb, SFA const &sfa,
					 SFB const &sfb, Acc &acc)
{
	using namespace cute;
	mma.accumulate_ = UMMA::ScaleOut::Zero;
#pragma unroll
	for (int kb = 0; kb < size<2>(fa); kb++) {
		gemm(mma.with(mma.accumulate_, sfa(_, _, kb), sfb(_, _, kb)), fa(_, _, kb), fb(_, _, kb), acc);
		mma.accumulate_ = UMMA::ScaleOut::One;
	}
}

/* Row threadIdx.x of a 128 × 16 FP32 accumulator into v[16] (v[i] = column i; the layout
 * tests/gpu/umma_sm100_check.cu checks), then wait for the load. */
template <class Acc>
__device__ __forceinline__ void acc_row(Acc const &acc, float (&v)[BD_UMMA_N])
{
	using namespace cute;
	auto t2r = make_tmem_copy(SM100_TMEM_LOAD_32dp32b16x{}, acc);
	auto thr = t2r.get_slice(threadIdx.x);
	Tensor r = make_tensor<float>(shape(thr.partition_D(make_identity_tensor(shape(acc)))));
	copy(t2r, thr.partition_S(acc), r);
	cutlass::arch::fence_view_async_tmem_load();
#pragma unroll
	for (int i = 0; i < BD_UMMA_N; i++)
		v[i] = r(i);
}

/* ---- the query into the Q tile (NUMERICS.md §5) --------------------------------------------- */

/* Warp: term t of one query head (lane-strided codes and block scale codes, NUMERICS.md §5)
 * into row `row` of the Q tile and its scales: odd channels' codes come from the next lane. */
template <int D, bool MX>
__device__ __forceinline__ void term_to_tile(const uint32_t (&codes)[D / 32],
					     const uint32_t (&scode)[D / 32], uint32_t row, uint8_t *qt,
					     uint8_t *qsf)
{
	constexpr int VS = MX ? BD_MXFP4_BLOCK : BD_NVFP4_BLOCK;
	const uint32_t lane = threadIdx.x & 31;

#pragma unroll
	for (int i = 0; i < D / 32; i++) {
		const uint32_t c = lane + 32 * i, odd = __shfl_down_sync(0xffffffffu, codes[i], 1);
		if (!(lane & 1))
			qt[bd_umma_off(D / 2, row, c / 2)] = (uint8_t)((codes[i] & 15u) | (odd & 15u) << 4);
		if (c % VS == 0)
			qsf[bd_umma_sf_off(row, c / VS)] = (uint8_t)scode[i];
	}
}

/* Warp: query head hd's FP4 terms (bd_kcommon.cuh's quantizers, the CPU's bytes) into rows
 * bd_umma_qrow(hd, t) of the Q tile and its scales, their decode scales into qg[t·8 + hd]
 * (MXFP4: 1, the UE8M0 scales are in the tile). */
template <int D, bool MX>
__device__ void query_to_tile(const bd_decode_plan &pl, const bd_decode_args &a, int b, int h,
			      int hd, uint8_t *qt, uint8_t *qsf, float *qg)
{
	constexpr int W = D / 32;
	float x[W], unused[2][W], g[2]; /* unused: the Hopper kernel's FP16 operands */
	uint32_t codes[2][W], scode[2][W];

	query_of<D>(pl, a, b, h, hd, x);
	if constexpr (MX)
		bdk::mx_query_quant_warp<D>(x, pl.nterms, unused, codes, scode, g);
	else
		bdk::query_quant_warp<D>(x, pl.nterms, unused, codes, scode, g);
	term_to_tile<D, MX>(codes[0], scode[0], bd_umma_qrow((uint32_t)hd, 0), qt, qsf);
	if (pl.nterms == 2)
		term_to_tile<D, MX>(codes[1], scode[1], bd_umma_qrow((uint32_t)hd, 1), qt, qsf);
	if ((threadIdx.x & 31) == 0) {
		qg[hd] = MX ? 1.0f : g[0];
		qg[MAX_G + hd] = pl.nterms == 2 ? (MX ? 1.0f : g[1]) : 0.0f;
	}
}

/* ---- the page splits ------------------------------------------------------------------------ */

/* The stage's page-head placed into the operand and scale tiles by all threads: 16-byte pieces
 * of the codes, scale rows a word (or, MXFP4 with d = 64, two bytes) at a time. */
template <int D, bool MX>
__device__ __forceinline__ void place_page(const bd_decode_plan &pl, const uint8_t *raw, uint8_t *sm)
{
	using L = Smem<D, MX>;
	constexpr int KPIECES = D / 32, VS = L::VS, KSC = D / VS, VSC = BD_PAGE_TOKENS / VS;
	const int tid = threadIdx.x;
	const uint8_t *kc = raw + pl.lay.k_codes_off, *vc = raw + pl.lay.v_codes_off;

#pragma unroll
	for (int j = 0; j < BD_PAGE_TOKENS * KPIECES / THREADS; j++) {
		const int e = tid + THREADS * j;
		*(uint4 *)(sm + L::KT + bd_umma_off(D / 2, e / KPIECES, 16 * (e % KPIECES))) =
			*(const uint4 *)(kc + 16 * e);
	}
#pragma unroll
	for (int j = 0; j < D * 4 / THREADS; j++) {
		const int e = tid + THREADS * j;
		*(uint4 *)(sm + L::VT + bd_umma_off(BD_UMMA_PV_ROW, e / 4, 16 * (e % 4))) =
			*(const uint4 *)(vc + 16 * e);
	}
	/* thread r: key r's K scales and (r < d) channel r's V scales */
	const uint8_t *ks = raw + pl.lay.k_scales_off + tid * KSC;
	if constexpr (KSC % 4 == 0) {
#pragma unroll
		for (int j = 0; j < KSC; j += 4)
			*(uint32_t *)(sm + L::KSF + bd_umma_sf_off(tid, j)) = *(const uint32_t *)(ks + j);
	} else {
#pragma unroll
		for (int j = 0; j < KSC; j++)
			sm[L::KSF + bd_umma_sf_off(tid, j)] = ks[j];
	}
	if (tid < D) {
		const uint8_t *vs = raw + pl.lay.v_scales_off + tid * VSC;
#pragma unroll
		for (int j = 0; j < VSC; j += 4)
			*(uint32_t *)(sm + L::VSF + bd_umma_sf_off(tid, j)) = *(const uint32_t *)(vs + j);
	}
}

/* Head values of the page's logits, softmax step and P row for the thread's key (tid):
 * NUMERICS.md §6. sv: the key's S^T row; gk: g_K (1 for MXFP4). Updates m, ℓ and α per head
 * and writes the head's row of the P tile and its scales. */
template <int D, bool MX>
__device__ __forceinline__ void softmax_page(const bd_decode_plan &pl, int i, bool masked,
					     const float (&sv)[BD_UMMA_N], float gk, const float *qg,
					     float *redm, uint8_t *sm, float (&m)[MAX_G],
					     float (&l)[MAX_G], float (&alpha)[MAX_G], float (&lq)[MAX_G])
{
	using L = Smem<D, MX>;
	const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, G = pl.G;
	const float tau_c = pl.tau / pl.c;
	float S[MAX_G], bmax[MAX_G];
	float *red = redm + (i & 1) * WARPS * MAX_G;

#pragma unroll
	for (int hd = 0; hd < MAX_G; hd++) {
		float dot = sv[bd_umma_qrow(hd, 0)] * qg[hd];
		if (pl.nterms == 2)
			dot = dot + sv[bd_umma_qrow(hd, 1)] * qg[MAX_G + hd];
		S[hd] = masked || hd >= G ? -INFINITY : (dot * gk) * pl.gamma;
		/* the P block maximum: 16 keys are half a warp, 32 (MXFP4) all of it */
		float v = S[hd];
		for (int o = 1; o < L::VS; o <<= 1)
			v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
		bmax[hd] = v;
		if (!MX)
			v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 16));
		if (lane == 0)
			red[warp * MAX_G + hd] = v;
	}
	__syncthreads();
#pragma unroll
	for (int hd = 0; hd < MAX_G; hd++) {
		float mt = red[hd];
#pragma unroll
		for (int w = 1; w < WARPS; w++)
			mt = fmaxf(mt, red[w * MAX_G + hd]);
		const float mn = fmaxf(m[hd], mt), mref = mn == -INFINITY ? 0.0f : mn;
		alpha[hd] = m[hd] == -INFINITY ? 0.0f : bdk::ex2_ftz(m[hd] - mn);
		const float P = bdk::ex2_ftz(__fadd_rn(__fsub_rn(S[hd], mref), pl.log2c));
		l[hd] = alpha[hd] * l[hd] + P;
		m[hd] = mn;

		const float pmax = bdk::ex2_ftz(bmax[hd] - mref);
		uint32_t code, scale;
		if constexpr (MX) {
			/* OCP: e = floor(log2 p_max) − 2 from the exponent bits, −127 for zero or
			 * subnormal p_max (the CPU's clamp); c = 1 */
			const int e = max((int)((__float_as_uint(pmax) >> 23) & 0xffu) - 129, -127);
			code = bdk::e2m1_encode(__fmul_rn(P, __uint_as_float((uint32_t)(127 - e) << 23)));
			scale = (uint32_t)(e + 127);
		} else {
			const float cp = __fmul_rn(pl.c, pmax);
			/* κ = 2 below τ/c (x/2 is x·0.5 exactly), else κ = 6 */
			scale = bdk::e4m3_encode(pl.underflow && pmax <= tau_c ? __fmul_rn(cp, 0.5f) :
										 __fdiv_rn(cp, 6.0f));
			const float s = bdk::e4m3_decode(scale);
			code = bdk::e2m1_encode(__fmul_rn(P, s == 0.0f ? 0.0f : __frcp_rn(s)));
		}
		if (pl.qmass) /* the quantized mass of this key's P̃ = s_P·P̂ (FP32, per thread) */
			lq[hd] = alpha[hd] * lq[hd] +
				 __fmul_rn(MX ? __uint_as_float(scale > 0u ? scale << 23 : 0x00400000u) :
						bdk::e4m3_decode(scale),
					   bdk::e2m1_decode(code));
		/* eight keys' codes to one word of the head's P row; block leaders write scales */
		uint32_t w = (code & 15u) << (4 * (lane & 7));
		w |= __shfl_xor_sync(0xffffffffu, w, 1);
		w |= __shfl_xor_sync(0xffffffffu, w, 2);
		w |= __shfl_xor_sync(0xffffffffu, w, 4);
		if (hd < G && (lane & 7) == 0)
			*(uint32_t *)(sm + L::PT + bd_umma_off(BD_UMMA_PV_ROW, hd, tid / 2)) = w;
		if (hd < G && tid % L::VS == 0)
			sm[L::PSF + bd_umma_sf_off(hd, tid / L::VS)] = (uint8_t)scale;
	}
}

template <int D, bool MX>
__device__ void page_split(const bd_decode_plan &pl, const bd_decode_args &a, int b, int h, int s,
			   uint8_t *sm)
{
	using namespace cute;
	using L = Smem<D, MX>;
	using T = bdk::umma::Types<D, MX>;
	constexpr int STAGES = L::STAGES;
	const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, G = pl.G;
	const Ctx cx = ctx_of(pl, a, b, s);
	const int32_t *bt = a.block_table + (size_t)b * a.bt_stride + cx.pb;
	const uint8_t *arena = (const uint8_t *)a.arena + (size_t)a.layer * pl.lay.layer_stride;
	float *gbuf = (float *)(sm + L::GBUF), *redm = (float *)(sm + L::REDM);
	float *redl = (float *)(sm + L::REDL), *qg = (float *)(sm + L::QG);
	uint64_t *bar = (uint64_t *)(sm + L::BAR);
	uint32_t *tmem_at = (uint32_t *)(sm + L::TMEM);
	float m[MAX_G], l[MAX_G], o[MAX_G], alpha[MAX_G], lq[MAX_G];

#pragma unroll
	for (int hd = 0; hd < MAX_G; hd++) {
		m[hd] = -INFINITY;
		l[hd] = o[hd] = lq[hd] = 0.0f;
	}
	if (cx.np > 0) {
		for (int e = tid; e < L::STAGE / 16; e += THREADS)
			((uint4 *)sm)[e] = make_uint4(0, 0, 0, 0);
		if (tid < 2 * MAX_G)
			qg[tid] = 0.0f;
		if (tid == 0) {
			for (int i = 0; i < STAGES + 2; i++)
				bdk::mbar_init(&bar[i], 1);
			bdk::mbar_fence_init();
		}
		if (warp == 0) {
			TMEM::Allocator1Sm alloc;
			alloc.allocate(TMEM_COLS, tmem_at);
			alloc.release_allocation_lock();
			tc_before_sync();
		}
		__syncthreads();
		tc_after_sync();

		/* page i of the split into stage stg: the page-head and its {g_K, g_V} */
		auto issue = [&](int i, int stg) {
			int32_t id = bt[i];
			if (id < 0 || (size_t)id >= pl.lay.n_pages) {
				flag(a, BD_KSTATUS_BAD_PAGE);
				id = 0; /* readable memory; the request's result is wrong, and flagged */
			}
			const uint8_t *src = arena + (size_t)id * pl.lay.page_bytes;
			bdk::mbar_arrive_tx(&bar[stg], (uint32_t)L::HB + 16u);
			bdk::bulk_g2s(sm + L::STAGE + (size_t)stg * L::HB, src + (size_t)h * L::HB, L::HB, &bar[stg]);
			bdk::bulk_g2s(gbuf + 4 * stg, src + pl.lay.gscale_off + (size_t)(h & ~1) * 8, 16, &bar[stg]);
		};
		if (tid == 0)
			for (int i = 0; i < STAGES && i < cx.np; i++)
				issue(i, i);
		for (int hd = warp; hd < G; hd += WARPS)
			query_to_tile<D, MX>(pl, a, b, h, hd, sm + L::QT, sm + L::QSF, qg);
		bdk::fence_proxy_async();
		__syncthreads();

		/* TMEM: the two accumulators, then the scale factors of K, Q, V and P */
		typename T::Mma mma;
		const uint32_t base = *tmem_at;
		Tensor accS = mma.make_fragment_C(typename T::AccShape{});
		Tensor accO = mma.make_fragment_C(typename T::AccShape{});
		Tensor tK = make_tensor<typename T::Mma::FrgTypeSFA>(shape(typename T::KSf{}));
		Tensor tQ = make_tensor<typename T::Mma::FrgTypeSFB>(shape(typename T::QSf{}));
		Tensor tV = make_tensor<typename T::Mma::FrgTypeSFA>(shape(typename T::VSf{}));
		Tensor tP = make_tensor<typename T::Mma::FrgTypeSFB>(shape(typename T::PSf{}));
		accS.data() = base;
		accO.data() = accS.data().get() + cutlass::detail::find_tmem_tensor_col_offset(accS);
		tK.data() = accO.data().get() + cutlass::detail::find_tmem_tensor_col_offset(accO);
		tQ.data() = tK.data().get() + cutlass::detail::find_tmem_tensor_col_offset(tK);
		tV.data() = tQ.data().get() + cutlass::detail::find_tmem_tensor_col_offset(tQ);
		tP.data() = tV.data().get() + cutlass::detail::find_tmem_tensor_col_offset(tV);
		/* the operand descriptors */
		Tensor fK = mma.make_fragment_A(make_tensor(make_smem_ptr((bdk::umma::E2M1 *)(sm + L::KT)), typename T::KTile{}));
		Tensor fQ = mma.make_fragment_B(make_tensor(make_smem_ptr((bdk::umma::E2M1 *)(sm + L::QT)), typename T::QTile{}));
		Tensor fV = mma.make_fragment_A(make_tensor(make_smem_ptr((bdk::umma::E2M1 *)(sm + L::VT)), typename T::VTile{}));
		Tensor fP = mma.make_fragment_B(make_tensor(make_smem_ptr((bdk::umma::E2M1 *)(sm + L::PT)), typename T::PTile{}));
		if (warp == 0 && elect_one_sync())
			sf_to_tmem<typename T::QSf>(sm + L::QSF, tQ);

		for (int i = 0; i < cx.np; i++) {
			const int stg = i % STAGES;
			bdk::mbar_wait(&bar[stg], (uint32_t)(i / STAGES) & 1u);
			place_page<D, MX>(pl, sm + L::STAGE + (size_t)stg * L::HB, sm);
			const float gk = MX ? 1.0f : gbuf[4 * stg + (h & 1) * 2];
			const float gv = MX ? 1.0f : gbuf[4 * stg + (h & 1) * 2 + 1];
			bdk::fence_proxy_async(); /* tile stores and stage reads before the async proxy */
			__syncthreads();
			if (tid == 0 && i + STAGES < cx.np)
				issue(i + STAGES, stg);
			if (warp == 0) {
				tc_after_sync();
				if (elect_one_sync()) {
					sf_to_tmem<typename T::KSf>(sm + L::KSF, tK);
					sf_to_tmem<typename T::VSf>(sm + L::VSF, tV);
				}
				__syncwarp();
				mma_tile(mma, fK, fQ, tK, tQ, accS);
				cutlass::arch::umma_arrive(&bar[STAGES]);
			}
			bdk::mbar_wait(&bar[STAGES], (uint32_t)i & 1u);
			tc_after_sync();
			float sv[BD_UMMA_N];
			acc_row(accS, sv);

			/* the sink's page copy (keys 0–15 of the request's first page) is masked (§8) */
			const bool masked = pl.sink && cx.pb + i == 0 && tid < BD_SINK_TOKENS;
			softmax_page<D, MX>(pl, i, masked, sv, gk, qg, redm, sm, m, l, alpha, lq);
			bdk::fence_proxy_async();
			tc_before_sync();
			__syncthreads();
			if (warp == 0) {
				tc_after_sync();
				if (elect_one_sync())
					sf_to_tmem<typename T::PSf>(sm + L::PSF, tP);
				__syncwarp();
				mma_tile(mma, fV, fP, tV, tP, accO);
				cutlass::arch::umma_arrive(&bar[STAGES + 1]);
			}
			bdk::mbar_wait(&bar[STAGES + 1], (uint32_t)i & 1u);
			tc_after_sync();
			float ov[BD_UMMA_N];
			acc_row(accO, ov);
#pragma unroll
			for (int hd = 0; hd < MAX_G; hd++)
				o[hd] = alpha[hd] * o[hd] + ov[hd] * gv;
			tc_before_sync();
		}
		__syncthreads();
		if (warp == 0) {
			tc_after_sync();
			TMEM::Allocator1Sm().free(base, TMEM_COLS);
		}
	}

	/* ℓ (and the quantized mass, into the free block-maxima buffer) over the 128 keys'
	 * threads, then this split's normalized partial (§6) */
#pragma unroll
	for (int hd = 0; hd < MAX_G; hd++) {
		float v = l[hd], vq = lq[hd];
		for (int off = 16; off > 0; off >>= 1) {
			v = v + __shfl_xor_sync(0xffffffffu, v, off);
			vq = vq + __shfl_xor_sync(0xffffffffu, vq, off);
		}
		if (lane == 0) {
			redl[warp * MAX_G + hd] = v;
			redm[warp * MAX_G + hd] = vq;
		}
	}
	__syncthreads();
	const size_t pi = slot_of(pl, b, h, s);
#pragma unroll
	for (int hd = 0; hd < MAX_G; hd++) {
		const float lt = redl[hd] + redl[MAX_G + hd] + redl[2 * MAX_G + hd] + redl[3 * MAX_G + hd];
		const float qt = redm[hd] + redm[MAX_G + hd] + redm[2 * MAX_G + hd] + redm[3 * MAX_G + hd];
		const float den = pl.qmass && qt > 0.0f ? qt : lt;
		if (hd < G && tid < D)
			ws_out(a)[(pi * G + hd) * D + tid] = lt == 0.0f ? 0.0f : o[hd] / den;
		if (hd < G && tid == 0)
			ws_lse(pl, a)[pi * G + hd] = lt == 0.0f ? -INFINITY : m[hd] + log2f(lt) - pl.log2c;
	}
}

/* ---- the BF16 partial: the sink and recent rows (NUMERICS.md §8) ----------------------------- */

/* The (layer, KV head h) part of request b's BF16 slot, or nullptr when the slot pointer is
 * NULL or not 16-byte aligned (flagged; the partial is then empty). Called only when the
 * request has BF16 rows. */
__device__ __forceinline__ const uint8_t *slot_head(const bd_decode_plan &pl, const bd_decode_args &a,
						    int b, int h)
{
	const uintptr_t slot = (uintptr_t)a.slots[b];

	if (slot == 0 || (slot & 15) != 0) {
		if (threadIdx.x == 0)
			flag(a, BD_KSTATUS_BAD_SLOT);
		return nullptr;
	}
	return (const uint8_t *)slot + ((size_t)a.layer * pl.Hkv + h) * pl.lay.slot_head_bytes;
}

/* FP32 on the CUDA cores, each sum in the reference's order: a thread per (row, head) logit
 * γ·Σ_c q̃'_c·k_c (q' rounded to BF16), a warp per head for the maximum, P = 2^(S − m) and ℓ,
 * a thread per (head, channel) for Σ_rows P·v; the rows are read from the slot in place. */
template <int D>
__device__ void bf16_part(const bd_decode_plan &pl, const bd_decode_args &a, int b, int h, uint8_t *sm)
{
	const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, G = pl.G;
	float *qs = (float *)sm;              /* [8][D] q' rounded to BF16 */
	float *S = qs + MAX_G * D;            /* [8][BF16_ROWS] logits, then P */
	float *ml = S + MAX_G * BF16_ROWS;    /* [8][2] m, ℓ */
	const Ctx cx = ctx_of(pl, a, b, 0);
	const int nsink = pl.sink ? min(cx.len, BD_SINK_TOKENS) : 0;
	const int t0 = max(cx.n_full * BD_PAGE_TOKENS, pl.sink ? BD_SINK_TOKENS : 0);
	int rows = nsink + max(cx.len - t0, 0);
	const uint8_t *sh = rows ? slot_head(pl, a, b, h) : nullptr;
	if (!sh)
		rows = 0;
	/* BF16 row r of the region: K (v = 0) or V */
	auto row = [&](int r, int v) {
		const bool sink = r < nsink;
		const size_t at = sink ? (size_t)r : (size_t)((t0 + r - nsink) % BD_RECENT_TOKENS);
		const size_t off = sink ? (v ? pl.lay.slot_sink_v_off : pl.lay.slot_sink_k_off) :
					  (v ? pl.lay.slot_recent_v_off : pl.lay.slot_recent_k_off);
		return (const __nv_bfloat16 *)(sh + off + at * 2 * D);
	};

	for (int hd = warp; hd < G; hd += WARPS) {
		float x[D / 32];
		query_of<D>(pl, a, b, h, hd, x);
#pragma unroll
		for (int i = 0; i < D / 32; i++)
			qs[hd * D + lane + 32 * i] = __bfloat162float(__float2bfloat16_rn(x[i]));
	}
	__syncthreads();
	for (int e = tid; e < rows * G; e += THREADS) {
		const int r = e / G, hd = e % G;
		const __nv_bfloat16 *k = row(r, 0);
		float dot = 0.0f;
		for (int c = 0; c < D; c++)
			dot = dot + qs[hd * D + c] * __bfloat162float(k[c]);
		S[hd * BF16_ROWS + r] = pl.gamma * dot;
	}
	__syncthreads();
	for (int hd = warp; hd < G; hd += WARPS) {
		float mx = -INFINITY, sum = 0.0f;
		for (int r = lane; r < rows; r += 32)
			mx = fmaxf(mx, S[hd * BF16_ROWS + r]);
		mx = bdk::warp_max(mx, 16);
		for (int r = lane; r < rows; r += 32) {
			const float P = exp2f(S[hd * BF16_ROWS + r] - mx);
			S[hd * BF16_ROWS + r] = P;
			sum = sum + P;
		}
		for (int off = 16; off > 0; off >>= 1)
			sum = sum + __shfl_xor_sync(0xffffffffu, sum, off);
		if (lane == 0) {
			ml[2 * hd] = mx;
			ml[2 * hd + 1] = sum;
		}
	}
	__syncthreads();
	const size_t pi = slot_of(pl, b, h, pl.n_splits);
	for (int e = tid; e < G * D; e += THREADS) {
		const int hd = e / D, c = e % D;
		float acc = 0.0f;
		for (int r = 0; r < rows; r++)
			acc = acc + S[hd * BF16_ROWS + r] * __bfloat162float(row(r, 1)[c]);
		ws_out(a)[(pi * G + hd) * D + c] = rows ? acc / ml[2 * hd + 1] : 0.0f;
		if (c == 0)
			ws_lse(pl, a)[pi * G + hd] = rows ? ml[2 * hd] + log2f(ml[2 * hd + 1]) : -INFINITY;
	}
}

/* ---- the combine, by the last CTA of (b, h) --------------------------------------------------- */

/* bd_lse_combine over the n_splits + 1 partials: a warp per head finds M = max lse_s and the
 * weights w_s = 2^(lse_s − M) (−inf partials weigh 0) and their FP64 sum, then a thread per
 * output sums w_s·o_s in FP64 in s order. w: (n_splits + 1)·G floats of shared memory. */
template <int D>
__device__ void combine(const bd_decode_plan &pl, const bd_decode_args &a, int b, int h, float *w)
{
	const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, G = pl.G, n = pl.n_splits + 1;
	const size_t p0 = slot_of(pl, b, h, 0);
	const float *lse = ws_lse(pl, a) + p0 * G, *part = ws_out(a) + p0 * G * D;
	__shared__ double Ms[MAX_G], Ws[MAX_G];

	for (int hd = warp; hd < G; hd += WARPS) {
		float mx = -INFINITY;
		for (int s = lane; s < n; s += 32)
			mx = fmaxf(mx, __ldcg(lse + s * G + hd));
		mx = bdk::warp_max(mx, 16);
		double sum = 0.0;
		for (int s = lane; s < n; s += 32) {
			const float v = __ldcg(lse + s * G + hd);
			w[hd * n + s] = mx == -INFINITY || v == -INFINITY ? 0.0f : (float)exp2((double)v - mx);
			sum += (double)w[hd * n + s];
		}
		for (int off = 16; off > 0; off >>= 1)
			sum += __shfl_xor_sync(0xffffffffu, sum, off);
		if (lane == 0) {
			Ms[hd] = mx;
			Ws[hd] = sum;
		}
	}
	__syncthreads();
	float *out = a.out + ((size_t)b * pl.Hq + (size_t)h * G) * D;
	for (int e = tid; e < G * D; e += THREADS) {
		const int hd = e / D;
		double acc = 0.0;
		for (int s = 0; s < n; s++)
			if (w[hd * n + s] != 0.0f)
				acc += (double)w[hd * n + s] * (double)__ldcg(part + (size_t)s * G * D + e);
		out[e] = Ws[hd] > 0.0 ? (float)(acc / Ws[hd]) : 0.0f;
	}
	if (a.lse && tid < G)
		a.lse[(size_t)b * pl.Hq + (size_t)h * G + tid] =
			Ws[tid] > 0.0 ? (float)(Ms[tid] + log2(Ws[tid])) : -INFINITY;
}

/* Count this CTA's partial (after every thread's writes are visible device-wide); the last
 * of the n_splits + 1 CTAs of (b, h) zeroes the counter for the next run and combines. */
template <int D>
__device__ void count_and_combine(const bd_decode_plan &pl, const bd_decode_args &a, int b, int h,
				  uint8_t *sm)
{
	int *cnt = (int *)((uint8_t *)a.workspace + pl.ws_cnt_off) + (size_t)b * pl.Hkv + h;

	__threadfence();
	__syncthreads();
	if (!__syncthreads_or(threadIdx.x == 0 && atomicAdd(cnt, 1) == pl.n_splits))
		return;
	if (threadIdx.x == 0)
		*cnt = 0;
	__threadfence();
	combine<D>(pl, a, b, h, (float *)sm);
}

template <int D, bool MX>
__global__ void __launch_bounds__(THREADS, 1)
	umma_decode(const __grid_constant__ bd_decode_plan pl, const __grid_constant__ bd_decode_args a)
{
	extern __shared__ uint8_t smem_raw[];
	uint8_t *sm = smem_raw + ((BD_UMMA_TILE_ALIGN - (bdk::smem_u32(smem_raw) & (BD_UMMA_TILE_ALIGN - 1))) &
				  (BD_UMMA_TILE_ALIGN - 1));
	const int s = blockIdx.x, h = blockIdx.y, b = blockIdx.z;

	if (s == pl.n_splits)
		bf16_part<D>(pl, a, b, h, sm);
	else
		page_split<D, MX>(pl, a, b, h, s, sm);
	count_and_combine<D>(pl, a, b, h, sm);
}

typedef void (*kern_t)(const bd_decode_plan, const bd_decode_args);

/* The instantiation for a plan and its shared memory, or NULL where the family has none. */
static kern_t pick(const bd_decode_plan &pl, int *ret_smem)
{
	struct bd_umma_sizes z;
	const bool mx = pl.kind == 3;

	if ((pl.kind != 1 && pl.kind != 3) || bd_umma_sizes(&pl.lay, &z) < 0 || pl.lay.d != pl.d ||
	    pl.G < 1 || pl.G > MAX_G || (pl.nterms != 1 && pl.nterms != 2))
		return nullptr;
	/* the page-head geometry the bulk copies and the in-stage offsets rely on */
	if (pl.lay.head_bytes != (size_t)pl.d * (mx ? 136 : 144) || pl.lay.gscale_off % 16 ||
	    pl.lay.page_bytes % 16 || pl.lay.k_codes_off % 16 || pl.lay.v_codes_off % 16 ||
	    pl.lay.k_scales_off % 4 || pl.lay.v_scales_off % 4)
		return nullptr;
	if (pl.d == 128) {
		*ret_smem = mx ? Smem<128, true>::ALLOC : Smem<128, false>::ALLOC;
		return mx ? umma_decode<128, true> : umma_decode<128, false>;
	}
	*ret_smem = mx ? Smem<64, true>::ALLOC : Smem<64, false>::ALLOC;
	return mx ? umma_decode<64, true> : umma_decode<64, false>;
}

} // namespace bd100

extern "C" int bd_decode_prepare_sm100(const struct bd_decode_plan *pl)
{
	int smem = 0, dev = 0, cc[2] = { 0, 0 }, occ = 0;

	if (!pl)
		return -EINVAL;
	const bd100::kern_t k = bd100::pick(*pl, &smem);
	if (!k)
		return -EOPNOTSUPP;
	BDK_TRY(cudaGetDevice(&dev));
	BDK_TRY(cudaDeviceGetAttribute(&cc[0], cudaDevAttrComputeCapabilityMajor, dev));
	BDK_TRY(cudaDeviceGetAttribute(&cc[1], cudaDevAttrComputeCapabilityMinor, dev));
	/* sm_100a and sm_103a code: compute capability 10.0 (B200) and 10.3 (B300) only */
	if (cc[0] != 10 || (cc[1] != 0 && cc[1] != 3))
		return -ENODEV;
	BDK_TRY(cudaFuncSetAttribute((const void *)k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
	BDK_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, (const void *)k, bd100::THREADS,
							      (size_t)smem));
	return occ >= 1 ? 0 : -EOPNOTSUPP;
}

extern "C" int bd_decode_run_sm100(const struct bd_decode_plan *pl, const struct bd_decode_args *a,
				   void *stream)
{
	int smem = 0;

	if (!pl || !a || !a->q || !a->out || !a->arena || !a->workspace || !a->block_table ||
	    !a->seq_lens || !a->slots)
		return -EINVAL;
	/* alignment masks of q, out, arena, workspace, block table, lengths, slots, lse, status */
	const uintptr_t mis = ((uintptr_t)a->q | (uintptr_t)a->out) & 15u;
	const uintptr_t mis2 = ((uintptr_t)a->arena & 127u) | ((uintptr_t)a->workspace & (BD_KERNEL_ALIGN - 1)) |
			       (((uintptr_t)a->block_table | (uintptr_t)a->seq_lens | (uintptr_t)a->lse |
				 (uintptr_t)a->status) & 3u) | ((uintptr_t)a->slots & 7u);
	if (mis || mis2 || a->layer < 0 || a->layer >= pl->lay.n_layers || a->bt_stride < 0 ||
	    a->bt_stride < pl->bt_stride || pl->B < 1 || pl->Hkv < 1 || pl->n_splits < 1 ||
	    pl->n_splits > 1024 || pl->Hq != pl->G * pl->Hkv)
		return -EINVAL;
	const bd100::kern_t k = bd100::pick(*pl, &smem);
	if (!k)
		return -EOPNOTSUPP;
	k<<<dim3(pl->n_splits + 1, pl->Hkv, pl->B), bd100::THREADS, smem, (cudaStream_t)stream>>>(*pl, *a);
	BDK_TRY(cudaGetLastError());
	return 0;
}
