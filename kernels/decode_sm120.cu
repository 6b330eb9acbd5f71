/* decode_sm120.cu — the native FP4 decode for sm_120a (RTX PRO 5000/6000, RTX 50): NVFP4 and
 * MXFP4 pages multiplied as FP4 by the warp-level block-scaled mma.sync (kind::mxf4nvf4,
 * scale_vec::4X with E4M3 scales, 2X with UE8M0; paper §4), the BF16 sink+recent partial and
 * the LSE combine, behind bd_kernels_bw.h. Built for sm_120a only.
 *
 * The work is bd_decode_run's (bd_kernels.h): one CTA of four warps per (split, KV head,
 * request), split n_splits being the BF16 partial, the last CTA of a (request, KV head) to
 * finish doing the combine, over the same workspace. A page-head streams into shared memory
 * by the bulk copy engine, STAGES deep (sm_120 has about 100 KB of shared memory per SM: two
 * stages of 18 KB at d = 128, two CTAs per SM). Per page (NUMERICS.md §5–§6 with the page as
 * the tile):
 *   S^T = K̂ Q̂^T: warp w multiplies key tiles 2w, 2w+1 (16 keys each) by the stacked query
 *     terms of the group, A and its scales straight from the page's bytes, B the prologue's
 *     FP4 query (operand bytes: quant/bd_mma_sm120.h); logits ((acc₁·g_q1 + acc₂·g_q2)·g_K)·γ;
 *   the tile maximum over the four warps (a barrier), P = exp2(S − m + log2 c) and ℓ per
 *     thread, P̂ and its block scales (underflow-aware for NVFP4, OCP for MXFP4) written to the
 *     P tile in shared memory (a barrier);
 *   O^T = V̂^T P̂^T: warp w multiplies channel tiles of 16 by the P tile, V and its scales
 *     straight from the page; o = α·o + acc·g_V once per page, as the reference.
 * Every FP4 product is exact on the tensor cores; only FP32 summation order differs from the
 * reference decoder (lib/quant/attn_ref.c). tests/lib/quant/test_mma_sm120.c runs a CPU model
 * of this loop (the same operand bytes through the emulated instruction, the same order of
 * the FP32 steps; P quantized by the reference's block quantizers, which this file's mirror)
 * against that decoder. The kernel reads the plan and arguments as they are (grid constants),
 * so a plan of bd_decode_plan_init (its n_splits, workspace offsets) serves it unchanged.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bd_kcommon.cuh"
#include "bd_kernels_bw.h"
#include "quant/bd_mma_sm120.h"

namespace bd120 {

constexpr int WARPS = BD_MMA120_WARPS;
constexpr int THREADS = 32 * WARPS;
constexpr int BF16_ROWS = BD_SINK_TOKENS + BD_RECENT_TOKENS; /* at most 144 */
constexpr int BF16_CHUNK = 64;                               /* rows per shared-memory chunk */
constexpr int COMBINE_CHUNK = 512;                           /* partials per weight chunk */

/* Shared memory of one CTA. FP4 CTAs: STAGES page-heads (the largest, NVFP4's 144·D bytes),
 * then the page decode scales, the query, the P tile, the cross-warp maxima and sums, the
 * mbarriers. The BF16 CTA and the combine reuse the stage area. */
template <int D>
struct Smem {
	static constexpr int STAGES = D == 128 ? 2 : 4;
	static constexpr int STAGE_BYTES = 144 * D;
	static constexpr int MAIN = STAGES * STAGE_BYTES;
	static constexpr int GBUF = MAIN;                   /* float [STAGES][4] */
	static constexpr int QC = GBUF + 16 * STAGES;       /* [2][8][D/2] packed codes */
	static constexpr int QS = QC + 2 * 8 * (D / 2);     /* [2][8][D/16] scale bytes */
	static constexpr int GQ = QS + 2 * 8 * (D / 16);    /* float [2][8] */
	static constexpr int PT = GQ + 2 * 8 * 4;           /* [8][64] P̂ codes */
	static constexpr int PS = PT + 8 * BD_MMA120_P_ROW; /* [8][8] P scales */
	static constexpr int REDM = PS + 8 * 8;             /* float [WARPS][8] */
	static constexpr int REDL = REDM + WARPS * 8 * 4;   /* float [WARPS][8] */
	static constexpr int BAR = REDL + WARPS * 8 * 4;    /* u64 [STAGES] */
	static constexpr int BYTES = BAR + 8 * STAGES;
	/* the BF16 CTA: key or value rows padded by 16 bytes (conflict-free row reads), q'
	 * transposed [D][8], logits then P [8][144] */
	static constexpr int ROWB = 2 * D + 16;
	static constexpr int QT = BF16_CHUNK * ROWB;
	static constexpr int SV = QT + D * 8 * 4;
	static_assert(SV + 8 * BF16_ROWS * 4 <= MAIN, "BF16 partial fits the stage area");
	static_assert(COMBINE_CHUNK * 8 * 8 <= MAIN, "combine weights fit the stage area");
	static_assert(QC % 16 == 0 && PT % 16 == 0 && BAR % 8 == 0, "aligned buffers");
};

/* What every CTA derives from the plan and the arguments. */
struct Step {
	const uint8_t *arena; /* layer base */
	float *ws_o, *ws_lse;
	int *counters;
	int NS, G, D;
};

__device__ __forceinline__ Step step_of(const bd_decode_plan &pl, const bd_decode_args &a)
{
	Step s;
	s.arena = (const uint8_t *)a.arena + (size_t)a.layer * pl.lay.layer_stride;
	s.ws_o = (float *)a.workspace;
	s.ws_lse = (float *)((uint8_t *)a.workspace + pl.ws_lse_off);
	s.counters = (int *)((uint8_t *)a.workspace + pl.ws_cnt_off);
	s.NS = pl.n_splits;
	s.G = pl.G;
	s.D = pl.d;
	return s;
}

__device__ __forceinline__ void flag(const bd_decode_args &a, int bits)
{
	if (a.status)
		atomicOr(a.status, bits);
}

/* Context length of request b and its full pages; a length the block table cannot hold is
 * flagged (once per request) and treated as empty. */
__device__ __forceinline__ int context_len(const bd_decode_args &a, int b, int *ret_full)
{
	const int len = a.seq_lens[b], full = len >= 1 ? (len - 1) / BD_PAGE_TOKENS : 0;
	const bool ok = len >= 1 && full <= a.bt_stride;

	if (!ok && threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0)
		flag(a, BD_KSTATUS_BAD_LEN);
	*ret_full = ok ? full : 0;
	return ok ? len : 0;
}

/* Index of partial s of (b, h) in the workspace's [B][Hkv][NS+1] partials. */
__device__ __forceinline__ size_t part_at(const bd_decode_plan &pl, int b, int h, int s)
{
	return ((size_t)b * pl.Hkv + h) * (size_t)(pl.n_splits + 1) + s;
}

/* ---- the block-scaled FP4 MMA ---------------------------------------------------------------- */

/* d += (A·SF_A)(B·SF_B) for k-step KS of an operand pair (selectors of bd_mma_sm120.h). One
 * PTX template, the scale vector and type pasted in. */
#define BD120_MMA(vec_type)                                                                        \
	asm("mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale." vec_type               \
	    " {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3}, %10, {%11,%12}, %13, "         \
	    "{%14,%15};"                                                                           \
	    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                       \
	    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(sfa), "h"(bid),    \
	      "h"(ta), "r"(sfb), "h"(bid), "h"(tb))
template <bool MX, int KS>
__device__ __forceinline__ void mma_fp4(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
					uint32_t b1, uint32_t sfa, uint32_t sfb)
{
	constexpr uint16_t bid = BD_MMA120_BID(MX, KS), ta = BD_MMA120_TIDA(MX, KS);
	constexpr uint16_t tb = BD_MMA120_TIDB(MX, KS);
	if constexpr (MX)
		BD120_MMA("scale_vec::2X.f32.e2m1.e2m1.f32.ue8m0");
	else
		BD120_MMA("scale_vec::4X.f32.e2m1.e2m1.f32.ue4m3");
}
#undef BD120_MMA

/* The same with the k-step a (constant after unrolling) loop index. */
template <bool MX>
__device__ __forceinline__ void mma_step(int ks, float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
					 uint32_t b1, uint32_t sfa, uint32_t sfb)
{
	if (ks == 0)
		mma_fp4<MX, 0>(d, a, b0, b1, sfa, sfb);
	else
		mma_fp4<MX, 1>(d, a, b0, b1, sfa, sfb);
}

__device__ __forceinline__ uint32_t ld_u32(const uint8_t *p)
{
	return *(const uint32_t *)p;
}

/* A scale register: 4 bytes, or 2 where bd_mma120_scale_bytes says so. */
__device__ __forceinline__ uint32_t ld_scales(const uint8_t *p, int bytes)
{
	return bytes == 4 ? *(const uint32_t *)p : *(const uint16_t *)p;
}

/* Query head hd of the group of (b, h): [d] FP32. */
__device__ __forceinline__ const float *query_head(const bd_decode_plan &pl,
						   const bd_decode_args &a, int b, int h, int hd)
{
	return a.q + ((size_t)b * pl.Hq + (size_t)h * pl.G + hd) * pl.d;
}

/* A query head qh lane-strided (x[i] = qh[lane + 32i]), rotated q' = Hq when hadamard
 * (bd_fwht's operations, fwht_warp). */
template <int D>
__device__ __forceinline__ void rotated_query(const float *qh, bool hadamard, float (&x)[D / 32])
{
#pragma unroll
	for (int i = 0; i < D / 32; i++)
		x[i] = qh[(threadIdx.x & 31) + 32 * i];
	if (hadamard)
		bdk::fwht_warp<D>(x, __fdiv_rn(1.0f, sqrtf((float)D)));
}

/* ---- the BF16 partial: sink + recent rows of one (request, KV head) -------------------------- */

/* NUMERICS.md §8 on CUDA cores, in the reference's order: each logit γ·Σ_c q̃'_c·k_c over c in
 * order (q' rounded to BF16), the maximum, P = exp2(S − m) and ℓ summed in row order by one
 * thread per head, each output channel Σ P·v in row order by one thread, o/ℓ. Rows go through
 * shared memory 64 at a time by cp.async. */
template <int D>
__device__ void bf16_partial(const bd_decode_plan &pl, const bd_decode_args &a, const Step &st,
			     int b, int h, uint8_t *smem)
{
	using S = Smem<D>;
	const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, G = st.G;
	uint8_t *rows = smem;
	float *qt = (float *)(smem + S::QT); /* [D][8] */
	float *sv = (float *)(smem + S::SV); /* [8][BF16_ROWS] */
	__shared__ float head_m[8], head_l[8];
	int n_full;
	const int len = context_len(a, b, &n_full);
	const int nsink = pl.sink ? min(len, BD_SINK_TOKENS) : 0;
	const int t_recent = pl.sink ? max(n_full * BD_PAGE_TOKENS, BD_SINK_TOKENS)
				     : n_full * BD_PAGE_TOKENS;
	const int r0 = t_recent - n_full * BD_PAGE_TOKENS;
	const uint8_t *slot = (const uint8_t *)a.slots[b];
	int cnt = nsink + max(len - t_recent, 0);

	if (cnt > 0 && (slot == nullptr || ((uintptr_t)slot & 15) != 0)) {
		if (tid == 0)
			flag(a, BD_KSTATUS_BAD_SLOT);
		cnt = 0;
	}
	const uint8_t *sh = slot + ((size_t)a.layer * pl.Hkv + h) * pl.lay.slot_head_bytes;
	/* row k of the region: sink row k, then recent row r0 + k − nsink; V when v */
	auto row_src = [&](int k, bool v) {
		const size_t off = k < nsink
					   ? (v ? pl.lay.slot_sink_v_off : pl.lay.slot_sink_k_off) +
						     (size_t)k * 2 * D
					   : (v ? pl.lay.slot_recent_v_off
						: pl.lay.slot_recent_k_off) +
						     (size_t)(r0 + k - nsink) * 2 * D;
		return sh + off;
	};
	auto load_rows = [&](int k0, int n, bool v) {
		constexpr int PIECES = 2 * D / 16;
		for (int e = tid; e < n * PIECES; e += THREADS)
			bdk::cp_async16(rows + (size_t)(e / PIECES) * S::ROWB + 16 * (e % PIECES),
					row_src(k0 + e / PIECES, v) + 16 * (e % PIECES));
		bdk::cp_async_commit();
		bdk::cp_async_wait<0>();
		__syncthreads();
	};

	for (int hd = warp; hd < G; hd += WARPS) {
		float x[D / 32];
		rotated_query<D>(query_head(pl, a, b, h, hd), pl.hadamard, x);
#pragma unroll
		for (int i = 0; i < D / 32; i++)
			qt[(lane + 32 * i) * 8 + hd] = __bfloat162float(__float2bfloat16_rn(x[i]));
	}
	__syncthreads();

	/* logits: thread pairs (head, row) with the 8 rows of a warp's lane group distinct, so the
	 * padded rows fall in distinct banks and q' is read as a broadcast per head */
	for (int k0 = 0; k0 < cnt; k0 += BF16_CHUNK) {
		const int n = min(BF16_CHUNK, cnt - k0);
		load_rows(k0, n, false);
		for (int it = 0; it < 4; it++) {
			const int k = (lane & 7) + 8 * (warp + WARPS * (it & 1)),
				  hd = (lane >> 3) + 4 * (it >> 1);
			if (k >= n || hd >= G)
				continue;
			const __nv_bfloat16 *kr = (const __nv_bfloat16 *)(rows +
									  (size_t)k * S::ROWB);
			float acc = 0.0f;
			for (int c = 0; c < D; c++)
				acc = __fadd_rn(acc,
						__fmul_rn(qt[c * 8 + hd], __bfloat162float(kr[c])));
			sv[hd * BF16_ROWS + k0 + k] = __fmul_rn(pl.gamma, acc);
		}
		__syncthreads();
	}
	if (tid < G) {
		float m = -INFINITY, l = 0.0f;
		for (int k = 0; k < cnt; k++)
			m = fmaxf(m, sv[tid * BF16_ROWS + k]);
		for (int k = 0; k < cnt; k++) {
			const float P = exp2f(__fsub_rn(sv[tid * BF16_ROWS + k], m));
			sv[tid * BF16_ROWS + k] = P;
			l = __fadd_rn(l, P);
		}
		head_m[tid] = m;
		head_l[tid] = l;
	}
	__syncthreads();

	constexpr int PER = 8 * D / THREADS; /* outputs per thread, G = 8 */
	float acc[PER];
#pragma unroll
	for (int u = 0; u < PER; u++)
		acc[u] = 0.0f;
	for (int k0 = 0; k0 < cnt; k0 += BF16_CHUNK) {
		const int n = min(BF16_CHUNK, cnt - k0);
		load_rows(k0, n, true);
#pragma unroll
		for (int u = 0; u < PER; u++) {
			const int e = tid + THREADS * u, hd = e / D, c = e % D;
			if (hd >= G)
				continue;
			const uint8_t *col = rows + 2 * c; /* value c of row k: col + k·ROWB */
			for (int k = 0; k < n; k++) {
				const float v = __bfloat162float(
					*(const __nv_bfloat16 *)(col + (size_t)k * S::ROWB));
				acc[u] = __fadd_rn(acc[u],
						   __fmul_rn(sv[hd * BF16_ROWS + k0 + k], v));
			}
		}
		__syncthreads();
	}
	const size_t pi = part_at(pl, b, h, st.NS);
#pragma unroll
	for (int u = 0; u < PER; u++) {
		const int e = tid + THREADS * u, hd = e / D, c = e % D;
		if (hd < G)
			st.ws_o[(pi * G + hd) * D + c] = cnt ? __fdiv_rn(acc[u], head_l[hd]) : 0.0f;
	}
	if (tid < G)
		st.ws_lse[pi * G + tid] = cnt ? __fadd_rn(head_m[tid], log2f(head_l[tid]))
					      : -INFINITY;
}

/* ---- the LSE combine: the last CTA of a (request, KV head) to finish ------------------------ */

/* bd_lse_combine of the NS + 1 partials, in its FP64 order: M = max lse_s, weights
 * w_s = exp2(lse_s − M) (partials with lse −inf skipped), o = Σ_s w_s·o_s / Σ_s w_s summed in
 * s order by one thread per output, lse = M + log2 Σ w_s. Weights go through shared memory
 * COMBINE_CHUNK partials at a time. */
template <int D>
__device__ void combine(const bd_decode_plan &pl, const bd_decode_args &a, const Step &st, int b,
			int h, uint8_t *smem)
{
	const int tid = threadIdx.x, G = st.G, NS1 = st.NS + 1;
	const size_t base = part_at(pl, b, h, 0);
	double *w = (double *)smem; /* [COMBINE_CHUNK][G] */
	__shared__ double head_M[8], head_W[8];
	constexpr int PER = 8 * D / THREADS;
	double acc[PER];

	if (tid < G) {
		double M = -INFINITY;
		for (int s = 0; s < NS1; s++)
			M = fmax(M, (double)__ldcg(st.ws_lse + (base + s) * G + tid));
		head_M[tid] = M;
		head_W[tid] = 0.0;
	}
#pragma unroll
	for (int u = 0; u < PER; u++)
		acc[u] = 0.0;
	__syncthreads();
	for (int s0 = 0; s0 < NS1; s0 += COMBINE_CHUNK) {
		const int n = min(COMBINE_CHUNK, NS1 - s0);
		for (int e = tid; e < n * G; e += THREADS) {
			const double M = head_M[e % G];
			const float l = __ldcg(st.ws_lse + (base + s0 + e / G) * G + e % G);
			w[e] = M == -INFINITY || l == -INFINITY ? 0.0 : exp2((double)l - M);
		}
		__syncthreads();
		if (tid < G)
			for (int s = 0; s < n; s++)
				head_W[tid] += w[s * G + tid];
#pragma unroll
		for (int u = 0; u < PER; u++) {
			const int e = tid + THREADS * u, hd = e / D, c = e % D;
			if (hd >= G)
				continue;
			for (int s = 0; s < n; s++) {
				const double ws = w[s * G + hd];
				const float *os = st.ws_o + ((base + s0 + s) * G + hd) * D;
				if (ws != 0.0)
					acc[u] += ws * (double)__ldcg(os + c);
			}
		}
		__syncthreads();
	}
	float *out = a.out + ((size_t)b * pl.Hq + (size_t)h * G) * D;
#pragma unroll
	for (int u = 0; u < PER; u++) {
		const int e = tid + THREADS * u, hd = e / D;
		if (hd < G)
			out[e] = head_M[hd] == -INFINITY ? 0.0f : (float)(acc[u] / head_W[hd]);
	}
	if (a.lse && tid < G)
		a.lse[(size_t)b * pl.Hq + (size_t)h * G + tid] =
			head_M[tid] == -INFINITY ? -INFINITY
						 : (float)(head_M[tid] + log2(head_W[tid]));
}

/* Count this CTA's partial; the last of the NS + 1 CTAs of (b, h) to count (every thread of it
 * learns so through the barrier's OR) resets the counter for the next run and combines. */
template <int D>
__device__ void finish(const bd_decode_plan &pl, const bd_decode_args &a, const Step &st, int b,
		       int h, uint8_t *smem)
{
	int *cnt = st.counters + (size_t)b * pl.Hkv + h;
	int last = 0;

	__threadfence(); /* the partial is visible device-wide before it is counted */
	__syncthreads();
	if (threadIdx.x == 0)
		last = atomicAdd(cnt, 1) == st.NS;
	if (!__syncthreads_or(last))
		return;
	if (threadIdx.x == 0)
		*cnt = 0;
	__threadfence(); /* the other CTAs' partials, counted before ours, are seen */
	combine<D>(pl, a, st, b, h, smem);
}

/* ---- the FP4 page splits --------------------------------------------------------------------- */

/* PAIRS: the query columns are (head, term) pairs, NTS column tiles (bd_mma120_pairs /
 * _col_tiles); else one term per head, one tile. A thread's S slots: HS heads. */
template <int MODE>
struct Cols {
	static constexpr bool PAIRS = MODE != 0;
	static constexpr int NTS = MODE == 2 ? 2 : 1;
	static constexpr int HS = PAIRS ? NTS : 2;
	__device__ static int head(int hs, int t)
	{
		return PAIRS ? 4 * hs + t : 2 * t + hs;
	}
};

/* The running maximum of head hd after a page: m_new = max(m, the four warps' maxima), and
 * α = 2^(m − m_new) (0 before the first key). */
__device__ __forceinline__ void rescale(const float *redm, int hd, float m, float *ret_m,
					float *ret_alpha)
{
	float mx = redm[hd];
#pragma unroll
	for (int w = 1; w < WARPS; w++)
		mx = fmaxf(mx, redm[w * 8 + hd]);
	*ret_m = fmaxf(m, mx);
	*ret_alpha = m == -INFINITY ? 0.0f : exp2f(__fsub_rn(m, *ret_m));
}

/* MODE 0: one term, G > 4; 1: pairs in one column tile (G ≤ 4); 2: pairs in two (G > 4, two
 * terms). MX: MXFP4 pages. */
template <int D, int MODE, bool MX>
__global__ void __launch_bounds__(THREADS, 2)
	fp4_mma_decode(const __grid_constant__ bd_decode_plan pl,
		       const __grid_constant__ bd_decode_args a)
{
	using S = Smem<D>;
	using C = Cols<MODE>;
	constexpr int KS = D / 64, NTS = C::NTS, HS = C::HS, STAGES = S::STAGES;
	extern __shared__ __align__(128) uint8_t smem[];
	const Step st = step_of(pl, a);
	const int s = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
	if (s == st.NS) {
		bf16_partial<D>(pl, a, st, b, h, smem);
		finish<D>(pl, a, st, b, h, smem);
		return;
	}
	const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
	const int G = st.G, sb = bd_mma120_scale_bytes(MX, D);
	float *gbuf = (float *)(smem + S::GBUF);
	uint8_t *qc = smem + S::QC, *qs = smem + S::QS, *pt = smem + S::PT, *ps = smem + S::PS;
	float *gq = (float *)(smem + S::GQ);
	float *redm = (float *)(smem + S::REDM), *redl = (float *)(smem + S::REDL);
	uint64_t *bar = (uint64_t *)(smem + S::BAR);

	/* this split's pages: the reference's chunk rule over the request's full pages */
	int n_full;
	(void)context_len(a, b, &n_full);
	const int chunk = max((n_full + st.NS - 1) / st.NS, 1);
	const int pb = min(s * chunk, n_full), np = min(s * chunk + chunk, n_full) - pb;
	const int32_t *bt = a.block_table + (size_t)b * a.bt_stride + pb;
	const uint32_t hb = (uint32_t)pl.lay.head_bytes;

	for (int i = tid; i < (S::REDM - S::QC) / 4; i += THREADS)
		((uint32_t *)qc)[i] = 0; /* query, P tile: zero where nothing is written */
	for (int i = tid; i < 2 * WARPS * 8; i += THREADS)
		redm[i] = i < WARPS * 8 ? -INFINITY : 0.0f; /* redl follows redm */
	if (tid == 0) {
		for (int i = 0; i < STAGES; i++)
			bdk::mbar_init(&bar[i], 1);
		bdk::mbar_fence_init();
	}
	__syncthreads();
	auto issue = [&](int i, int stg) {
		int32_t id = bt[i];
		if (id < 0 || id >= (int32_t)pl.lay.n_pages) {
			flag(a, BD_KSTATUS_BAD_PAGE);
			id = 0; /* readable memory; the request's result is wrong, and flagged */
		}
		const uint8_t *src = st.arena + (size_t)id * pl.lay.page_bytes;
		bdk::mbar_arrive_tx(&bar[stg], hb + 16u);
		bdk::bulk_g2s(smem + (size_t)stg * S::STAGE_BYTES, src + (size_t)h * hb, hb,
			      &bar[stg]);
		bdk::bulk_g2s(gbuf + 4 * stg, src + pl.lay.gscale_off + (size_t)(h & ~1) * 8, 16,
			      &bar[stg]);
	};
	if (tid == 0)
		for (int i = 0; i < STAGES && i < np; i++)
			issue(i, i);

	/* ---- prologue: q' = Hq, the FP4 query terms (NUMERICS.md §5), packed as a K row ---- */
	for (int hd = warp; hd < G; hd += WARPS) {
		constexpr int W = D / 32;
		float x[W], xs[2][W], gt[2];
		uint32_t codes[2][W], scode[2][W];
		rotated_query<D>(query_head(pl, a, b, h, hd), pl.hadamard, x);
		if constexpr (MX)
			bdk::mx_query_quant_warp<D>(x, pl.nterms, xs, codes, scode, gt);
		else
			bdk::query_quant_warp<D>(x, pl.nterms, xs, codes, scode, gt);
#pragma unroll
		for (int tt = 0; tt < 2; tt++) {
			if (tt >= pl.nterms)
				break;
			uint8_t *crow = qc + (tt * 8 + hd) * (D / 2),
				*srow = qs + (tt * 8 + hd) * (D / 16);
#pragma unroll
			for (int i = 0; i < W; i++) {
				const uint32_t up = __shfl_down_sync(0xffffffffu, codes[tt][i], 1);
				if ((lane & 1) == 0)
					crow[(lane + 32 * i) / 2] =
						(uint8_t)((codes[tt][i] & 0xfu) | (up & 0xfu) << 4);
				if (MX ? lane == 0 : (lane & 15) == 0)
					srow[MX ? i : (lane + 32 * i) / 16] = (uint8_t)scode[tt][i];
			}
			if (lane == 0)
				/* MXFP4: g = 1, the scales carry all */
				gq[tt * 8 + hd] = MX ? 1.0f : gt[tt];
		}
	}
	__syncthreads();
	uint32_t qb[NTS][KS][2], qsf[NTS];
	float k1[HS], k2[HS];
#pragma unroll
	for (int nt = 0; nt < NTS; nt++) {
		const int bn = bd_mma120_b_n(lane), sn = bd_mma120_sfb_col(lane);
		const uint8_t *ccol = qc + (bd_mma120_col_term(C::PAIRS, bn) * 8 +
					    bd_mma120_col_head(C::PAIRS, nt, bn)) *
						   (D / 2);
		const uint8_t *scol = qs + (bd_mma120_col_term(C::PAIRS, sn) * 8 +
					    bd_mma120_col_head(C::PAIRS, nt, sn)) *
						   (D / 16);
#pragma unroll
		for (int ks = 0; ks < KS; ks++)
#pragma unroll
			for (int r = 0; r < 2; r++)
				qb[nt][ks][r] = ld_u32(ccol + bd_mma120_q_codes_off(ks, lane, r));
		qsf[nt] = ld_scales(scol + bd_mma120_q_sfb_off(MX, D, lane), sb);
	}
#pragma unroll
	for (int hs = 0; hs < HS; hs++) {
		k1[hs] = gq[C::head(hs, t)];
		k2[hs] = gq[8 + C::head(hs, t)];
	}

	/* ---- the split's pages ---- */
	/* running maxima of the thread's S heads (m_s) and of its O^T columns' heads 2t, 2t + 1
	 * (m_o): every thread derives them from the same tile maxima, so equal heads agree */
	float m_s[HS], m_o[2] = { -INFINITY, -INFINITY }, l_run[HS] = {}, o[KS][4] = {};
	float q_run[HS] = {}; /* the quantized mass Σ s_P·P̂ (pl.qmass) */
#pragma unroll
	for (int hs = 0; hs < HS; hs++)
		m_s[hs] = -INFINITY;

	for (int i = 0; i < np; i++) {
		const int stg = i % STAGES;
		bdk::mbar_wait(&bar[stg], (uint32_t)(i / STAGES) & 1u);
		const uint8_t *page = smem + (size_t)stg * S::STAGE_BYTES;
		const uint8_t *kc = page + pl.lay.k_codes_off, *ksc = page + pl.lay.k_scales_off;
		const uint8_t *vc = page + pl.lay.v_codes_off, *vsc = page + pl.lay.v_scales_off;
		const float gk = MX ? 1.0f : gbuf[4 * stg + 2 * (h & 1)];
		const float gv = MX ? 1.0f : gbuf[4 * stg + 2 * (h & 1) + 1];
		/* keys 0..15 of the request's first page: the sink's page copy, masked */
		const bool masked_page = pl.sink && pb + i == 0;

		/* S^T for key tiles 2·warp + j; logits S[j][hs][r], r: accumulator rows g, g + 8 */
		float S[2][HS][2], bm[2][HS];
#pragma unroll
		for (int j = 0; j < 2; j++) {
			const int mt = 2 * warp + j;
			const uint32_t sfa = ld_scales(ksc + bd_mma120_k_sfa_off(MX, D, mt, lane),
						       sb);
			float acc[NTS][4];
#pragma unroll
			for (int nt = 0; nt < NTS; nt++)
#pragma unroll
				for (int e = 0; e < 4; e++)
					acc[nt][e] = 0.0f;
#pragma unroll
			for (int ks = 0; ks < KS; ks++) {
				uint32_t af[4];
#pragma unroll
				for (int r = 0; r < 4; r++)
					af[r] = ld_u32(kc +
						       bd_mma120_k_codes_off(D, mt, ks, lane, r));
#pragma unroll
				for (int nt = 0; nt < NTS; nt++)
					mma_step<MX>(ks, acc[nt], af, qb[nt][ks][0], qb[nt][ks][1],
						     sfa, qsf[nt]);
			}
#pragma unroll
			for (int hs = 0; hs < HS; hs++) {
				const bool live = C::head(hs, t) < G && !(masked_page && mt == 0);
#pragma unroll
				for (int r = 0; r < 2; r++) {
					float dot;
					if constexpr (C::PAIRS) {
						dot = __fmul_rn(acc[hs][2 * r], k1[hs]);
						if (pl.nterms == 2)
							dot = __fadd_rn(
								dot, __fmul_rn(acc[hs][2 * r + 1],
									       k2[hs]));
					} else {
						dot = __fmul_rn(acc[0][2 * r + hs], k1[hs]);
					}
					S[j][hs][r] = live ? __fmul_rn(__fmul_rn(dot, gk), pl.gamma)
							   : -INFINITY;
				}
				/* the P block maximum: NVFP4 a tile (16 keys over the 8 lanes of
				 * column t), MXFP4 the warp's 32 keys */
				float v = fmaxf(S[j][hs][0], S[j][hs][1]);
				v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 4));
				v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 8));
				v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 16));
				bm[j][hs] = v;
			}
		}
#pragma unroll
		for (int hs = 0; hs < HS; hs++) {
			const float wmax = fmaxf(bm[0][hs], bm[1][hs]);
			if (MX)
				bm[0][hs] = bm[1][hs] = wmax;
			if (g == 0)
				redm[warp * 8 + C::head(hs, t)] = wmax;
		}
		/* this thread's reads of page i-1's stage precede its refill; then the barrier of
		 * the tile maximum, after which page i-1 is consumed by everyone */
		bdk::fence_proxy_async();
		__syncthreads();
		if (tid == 0 && i >= 1 && i - 1 + STAGES < np)
			issue(i - 1 + STAGES, (i - 1) % STAGES);

		float mn_s[HS], al_s[HS], mn_o[2], al_o[2];
#pragma unroll
		for (int hs = 0; hs < HS; hs++)
			rescale(redm, C::head(hs, t), m_s[hs], &mn_s[hs], &al_s[hs]);
#pragma unroll
		for (int e = 0; e < 2; e++)
			rescale(redm, 2 * t + e, m_o[e], &mn_o[e], &al_o[e]);

			/* P, ℓ, and the P tile (NUMERICS.md §6) */
#pragma unroll
		for (int hs = 0; hs < HS; hs++) {
			const int hd = C::head(hs, t);
			const float mn = mn_s[hs];
			const bool live = mn != -INFINITY;
			float lsum = 0.0f, qsum = 0.0f;
#pragma unroll
			for (int j = 0; j < 2; j++) {
				const int mt = 2 * warp + j;
				float spq; /* the block's P scale as a value */
				const float pmax = live ? exp2f(__fsub_rn(bm[j][hs], mn)) : 0.0f;
				uint32_t sp;
				float inv;
				if constexpr (MX) {
					/* OCP: e = floor(log2 p_max) − 2, −127 for zero (c = 1) */
					const int e = bdk::mx_e_ocp(pmax);
					sp = (uint32_t)(e + 127);
					inv = bdk::pow2f(-e);
					spq = bdk::pow2f(e);
				} else {
					/* κ = 2 below τ/c (x/2 is x·0.5 exactly), else 6 */
					const float cp = __fmul_rn(pl.c, pmax);
					sp = bdk::e4m3_encode(
						pl.underflow && pmax <= __fdiv_rn(pl.tau, pl.c)
							? __fmul_rn(cp, 0.5f)
							: __fdiv_rn(cp, 6.0f));
					const float spv = bdk::e4m3_decode(sp);
					inv = spv == 0.0f ? 0.0f : __fdiv_rn(1.0f, spv);
					spq = spv;
				}
				uint32_t code[2];
#pragma unroll
				for (int r = 0; r < 2; r++) {
					const float sr = S[j][hs][r];
					const float P = live && sr != -INFINITY
								? exp2f(__fadd_rn(__fsub_rn(sr, mn),
										  pl.log2c))
								: 0.0f;
					lsum = __fadd_rn(lsum, P);
					code[r] = bdk::e2m1_encode(__fmul_rn(P, inv)) & 0xfu;
					qsum = __fadd_rn(qsum,
							 __fmul_rn(spq, bdk::e2m1_decode(code[r])));
				}
				pt[hd * BD_MMA120_P_ROW + bd_mma120_p_byte(mt, lane)] =
					(uint8_t)(code[0] | code[1] << 4);
				if (g == 0 && (!MX || j == 0))
					ps[hd * bd_mma120_p_scale_row(MX) + (MX ? warp : mt)] =
						(uint8_t)sp;
			}
			l_run[hs] = __fadd_rn(__fmul_rn(al_s[hs], l_run[hs]), lsum);
			if (pl.qmass)
				q_run[hs] = __fadd_rn(__fmul_rn(al_s[hs], q_run[hs]), qsum);
		}
		__syncthreads(); /* the P tile is complete */

		/* O^T for channel tiles KS·warp + j */
		const uint32_t psf = ld_u32(ps + bd_mma120_p_sfb_off(MX, lane));
#pragma unroll
		for (int j = 0; j < KS; j++) {
			const int mc = KS * warp + j;
			const uint32_t vsf = ld_u32(vsc + bd_mma120_v_sfa_off(MX, mc, lane));
			float acc[4] = { 0.0f, 0.0f, 0.0f, 0.0f };
#pragma unroll
			for (int ks = 0; ks < 2; ks++) {
				uint32_t af[4];
#pragma unroll
				for (int r = 0; r < 4; r++)
					af[r] = ld_u32(vc + bd_mma120_v_codes_off(mc, ks, lane, r));
				mma_step<MX>(ks, acc, af,
					     ld_u32(pt + bd_mma120_p_codes_off(ks, lane, 0)),
					     ld_u32(pt + bd_mma120_p_codes_off(ks, lane, 1)), vsf,
					     psf);
			}
#pragma unroll
			for (int e = 0; e < 4; e++)
				o[j][e] = __fadd_rn(__fmul_rn(al_o[e & 1], o[j][e]),
						    __fmul_rn(acc[e], gv));
		}
#pragma unroll
		for (int hs = 0; hs < HS; hs++)
			m_s[hs] = mn_s[hs];
		m_o[0] = mn_o[0];
		m_o[1] = mn_o[1];
	}

	/* ---- this split's normalized partial: ℓ over the lanes, then the warps in order; the
	 * final maxima through redm (no thread reads the tile maxima any more); the quantized
	 * masses (pl.qmass) through the P tile once every warp is past its last O^T ---- */
	float *redq = (float *)pt;
	if (pl.qmass)
		__syncthreads();
#pragma unroll
	for (int hs = 0; hs < HS; hs++) {
		float l = l_run[hs], lq = q_run[hs];
		l = __fadd_rn(l, __shfl_xor_sync(0xffffffffu, l, 4));
		l = __fadd_rn(l, __shfl_xor_sync(0xffffffffu, l, 8));
		l = __fadd_rn(l, __shfl_xor_sync(0xffffffffu, l, 16));
		lq = __fadd_rn(lq, __shfl_xor_sync(0xffffffffu, lq, 4));
		lq = __fadd_rn(lq, __shfl_xor_sync(0xffffffffu, lq, 8));
		lq = __fadd_rn(lq, __shfl_xor_sync(0xffffffffu, lq, 16));
		if (g == 0) {
			if (pl.qmass)
				redq[warp * 8 + C::head(hs, t)] = lq;
			redl[warp * 8 + C::head(hs, t)] = l;
			if (warp == 0)
				redm[C::head(hs, t)] = m_s[hs];
		}
	}
	__syncthreads();
	const size_t pi = part_at(pl, b, h, s);
#pragma unroll
	for (int j = 0; j < KS; j++)
#pragma unroll
		for (int e = 0; e < 4; e++) {
			const int hd = bd_mma120_c_col(lane, e),
				  ch = 16 * (KS * warp + j) + bd_mma120_c_row(lane, e);
			if (hd >= G)
				continue;
			float L = 0.0f, Q = 0.0f;
#pragma unroll
			for (int w = 0; w < WARPS; w++) {
				L = __fadd_rn(L, redl[w * 8 + hd]);
				if (pl.qmass)
					Q = __fadd_rn(Q, redq[w * 8 + hd]);
			}
			const float den = pl.qmass && Q > 0.0f ? Q : L;
			st.ws_o[(pi * G + hd) * D + ch] = L == 0.0f ? 0.0f : __fdiv_rn(o[j][e], den);
		}
	if (tid < G) {
		float L = 0.0f;
#pragma unroll
		for (int w = 0; w < WARPS; w++)
			L = __fadd_rn(L, redl[w * 8 + tid]);
		st.ws_lse[pi * G + tid] = L == 0.0f ? -INFINITY
						    : __fsub_rn(__fadd_rn(redm[tid], log2f(L)),
								pl.log2c);
	}
	finish<D>(pl, a, st, b, h, smem);
}

typedef void (*kern_t)(const bd_decode_plan, const bd_decode_args);

/* The instantiation for a plan, or NULL where the family has none; its shared memory. */
static kern_t pick(const bd_decode_plan &pl, int *ret_smem)
{
	const bool mx = pl.kind == 3;
	const int mode = !bd_mma120_pairs(pl.G, pl.nterms)           ? 0
			 : bd_mma120_col_tiles(pl.G, pl.nterms) == 2 ? 2
								     : 1;
	static const kern_t k128[2][3] = {
		{ fp4_mma_decode<128, 0, false>, fp4_mma_decode<128, 1, false>,
		  fp4_mma_decode<128, 2, false> },
		{ fp4_mma_decode<128, 0, true>, fp4_mma_decode<128, 1, true>,
		  fp4_mma_decode<128, 2, true> },
	};
	static const kern_t k64[2][3] = {
		{ fp4_mma_decode<64, 0, false>, fp4_mma_decode<64, 1, false>,
		  fp4_mma_decode<64, 2, false> },
		{ fp4_mma_decode<64, 0, true>, fp4_mma_decode<64, 1, true>,
		  fp4_mma_decode<64, 2, true> },
	};

	if ((pl.kind != 1 && pl.kind != 3) || (pl.d != 64 && pl.d != 128) || pl.G < 1 ||
	    pl.G > BD_MMA120_MAX_HEADS || (pl.nterms != 1 && pl.nterms != 2) || pl.lay.d_rope != 0)
		return nullptr;
	/* the geometry bd_layout_init gives these pages, which the bulk copies rely on (the decode
	 * scales go in 16-byte pairs of heads) */
	if (pl.lay.head_bytes != (size_t)pl.d * (mx ? 136 : 144) || pl.lay.gscale_off % 16 != 0 ||
	    pl.lay.gscale_off + 16 * (size_t)((pl.lay.n_kv_heads + 1) / 2) > pl.lay.page_bytes ||
	    pl.lay.page_bytes % 16 != 0 || pl.lay.k_codes_off % 16 || pl.lay.k_scales_off % 16 ||
	    pl.lay.v_codes_off % 16 || pl.lay.v_scales_off % 16)
		return nullptr;
	*ret_smem = pl.d == 128 ? Smem<128>::BYTES : Smem<64>::BYTES;
	return (pl.d == 128 ? k128 : k64)[mx][mode];
}

} // namespace bd120

using namespace bd120;

extern "C" int bd_decode_prepare_sm120(const struct bd_decode_plan *pl)
{
	int smem = 0, dev = 0, major = 0, minor = 0, occ = 0;

	if (!pl)
		return -EINVAL;
	const kern_t k = pick(*pl, &smem);
	if (!k)
		return -EOPNOTSUPP;
	BDK_TRY(cudaGetDevice(&dev));
	BDK_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
	BDK_TRY(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
	if (major != 12 || minor != 0)
		return -ENODEV; /* sm_120a code runs on compute capability 12.0 only */
	BDK_TRY(cudaFuncSetAttribute((const void *)k, cudaFuncAttributeMaxDynamicSharedMemorySize,
				     smem));
	BDK_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, (const void *)k, THREADS,
							      (size_t)smem));
	return occ >= 1 ? 0 : -EOPNOTSUPP;
}

extern "C" int bd_decode_run_sm120(const struct bd_decode_plan *pl, const struct bd_decode_args *a,
				   void *stream)
{
	int smem = 0;

	if (!pl || !a)
		return -EINVAL;
	const struct {
		const void *p;
		uintptr_t align;
		bool required;
	} bufs[] = {
		{ a->q, 16, true },          { a->out, 16, true },
		{ a->arena, 128, true },     { a->workspace, BD_KERNEL_ALIGN, true },
		{ a->block_table, 4, true }, { a->seq_lens, 4, true },
		{ a->slots, 8, true },       { a->lse, 4, false },
		{ a->status, 4, false },
	};
	for (const auto &x : bufs)
		if ((x.required && !x.p) || ((uintptr_t)x.p & (x.align - 1)))
			return -EINVAL;
	if (a->layer < 0 || a->layer >= pl->lay.n_layers || a->bt_stride < pl->bt_stride ||
	    a->bt_stride < 0 || pl->B < 1 || pl->Hkv < 1 || pl->n_splits < 1 ||
	    pl->Hq != pl->G * pl->Hkv)
		return -EINVAL;
	const kern_t k = pick(*pl, &smem);
	if (!k)
		return -EOPNOTSUPP;
	k<<<dim3(pl->n_splits + 1, pl->Hkv, pl->B), THREADS, smem, (cudaStream_t)stream>>>(*pl, *a);
	BDK_TRY(cudaGetLastError());
	return 0;
}
