/* decode_sm90.cu — paged decode attention for Hopper: NVFP4 and MXFP4 pages (paper §4 as an
 * exact FP16 emulation of the FP4 MMA), BF16 pages (the in-house baseline), channel-blocked
 * NVFP4 pages (trtllm-nvfp4: expanded to BF16 rows, then the BF16 path), the BF16
 * sink+recent partial, the LSE combine, and the plan/run launchers of bd_kernels.h.
 *
 * One CTA (4 warps) per (split, KV head, request); split n_splits is the BF16 partial, and the
 * last CTA of each (request, KV head) to finish does the LSE combine. A page (128 tokens, one
 * tile) streams into shared memory through the bulk copy engine, STAGES deep; warp w owns keys
 * 32w..32w+31 of every page:
 *   S^T = K̃ Q̃^T (keys on M): the dual-residual query terms sit in adjacent columns, so one MMA
 *   per key tile computes both and a thread adds the halves in FP32;
 *   the P block maxima come from the butterfly reduction of S, the tile max from four warps;
 *   P̃ (E2M1 × E4M3, underflow-aware) goes through movmatrix into the B operand of
 *   O^T = Ṽ^T P̃^T, V blocked along tokens; g_K and g_V are applied once per page.
 * The k index of O^T may order the warp's 32 tokens freely (V and P scales are applied per
 * element before the MMA): thread t owns V word t of each channel row, and the rows of S^T
 * follow that order (see the main loop), which makes every FP4 word expand whole.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bd_kcommon.cuh"
#include "bd_kernels.h"

/* Switches of the page loop for timing its parts (bench/KERNELS-NOTES.md, v8): BD_V8_SPLIT 0
 * keeps the per-page __syncthreads for the tile maximum instead of the split mbarrier, so that
 * the split barrier can be timed alone; BD_V8_VPRE is how many V row pairs are expanded between
 * the split barrier's arrive and its wait. */
#ifndef BD_V8_SPLIT
#define BD_V8_SPLIT 1
#endif
#ifndef BD_V8_VPRE
#define BD_V8_VPRE 2
#endif
/* The v9 page loop (bench/KERNELS-NOTES.md), on by default since gpu_check, memcheck and
 * racecheck passed with it on an H200 and it was 0.5-7 % faster at 52 of 54 timed points
 * (bench/RESULTS.md); each switch set to 0 gives back the v8 code for A/B runs.
 * BD_V9_LDSM 1 reads the V words of the FP4 pages by ldmatrix.x4 (four channel rows per
 * instruction) instead of one LDS.32 per row; BD_V9_SOFT 1 shares the tile maximum through one
 * LDS.128 per head, divides c·p_max by 6 without the division's slow path and takes g_prev/g_cur
 * from rcp.approx (see the page loop); BD_V9_MXK 1 gives MXFP4 key rows one MMA k-step pair per
 * block, so the UE8M0 block scales multiply FP32 sums instead of FP16 operands (s_tile_mx). */
#ifndef BD_V9_LDSM
#define BD_V9_LDSM 1
#endif
#ifndef BD_V9_SOFT
#define BD_V9_SOFT 1
#endif
#ifndef BD_V9_MXK
#define BD_V9_MXK 1
#endif
/* BD_PERSIST 1 (the default) builds fp4_decode_kernel_persist, a fixed grid of resident CTAs
 * that claim the splits and the BF16 partials as work items, and lets the plan choose it for
 * small batches whose BF16-partial CTAs would need a wave of their own (bd_decode_plan_init);
 * 0 builds the grid kernel alone. */
#ifndef BD_PERSIST
#define BD_PERSIST 1
#endif
/* BD_PLAN_TAIL 1 (the default) lets the split search see the grid kernel's BF16-partial CTAs:
 * where they overflow the splits' last wave, the CTAs left over start only when the first ones
 * finish, and the persistent kernel (which absorbs them) is costed as the plan will launch it.
 * On an H200 it changed the plan at B = 8, N = 8K only, 15-18 % faster there (bench/RESULTS.md);
 * 0 counts the splits' waves alone, for A/B runs. */
#ifndef BD_PLAN_TAIL
#define BD_PLAN_TAIL 1
#endif
/* With any of them, <128, 2, NVFP4> is held to 128 registers (4 CTAs per SM; ptxas took 133
 * with all three, which leaves 3) */
#define BD_V9_ANY (BD_V9_LDSM || BD_V9_SOFT || BD_V9_MXK)

/* Code for sm_120 (99 KB of shared memory per block, 100 KB per SM, against Hopper's and sm_100's
 * 227 KB) takes the BF16-row kernels with fewer stages; the host sizes a launch by the device's
 * compute capability (major ≥ 12) to match. */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
#define BDK_SMALL_SMEM true
#else
#define BDK_SMALL_SMEM false
#endif

namespace bdk {

constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int MAXIDS = 128;    /* page ids of one split held in shared memory (4 CTAs per SM) */
constexpr int AUX_BYTES = 2048;
constexpr int PARTIAL_ROWS = BD_SINK_TOKENS + BD_RECENT_TOKENS; /* 144 */

/* RN(1/x) of the positive E4M3 values by mantissa: normal (1 + m/8)·2^(e−7) → c_rcp[m]·2^(7−e),
 * subnormal m·2^-9 → c_rcp[8 + m] (= RN(1/m)·2^9; 0 for m = 0, where the reference takes inv 0).
 * Filled from the host's IEEE divisions, so inv equals the reference's 1.0f / s_P exactly. */
__constant__ float c_rcp[16];

__device__ __forceinline__ float e4m3_rcp(uint32_t code)
{
	const uint32_t e = (code >> 3) & 0xfu, m = code & 7u;
	if (e == 0)
		return c_rcp[8 + m];
	return __uint_as_float(__float_as_uint(c_rcp[m]) + ((7u - e) << 23));
}

/* 1/x by the SFU alone (rcp.approx.ftz: relative error about 2^-23, as __fdividef's), for the
 * ratio of two pages' g_V, where x ≥ FLT_MIN. */
__device__ __forceinline__ float rcp_ftz(float x)
{
	float y;
	asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
	return y;
}

struct DecodeParams {
	const float *q;
	const uint8_t *arena; /* layer base */
	const int32_t *bt;
	const int32_t *seq_lens;
	void *const *slots;
	float *ws_o;   /* [B][Hkv][NS+1][G][D] */
	int *sched;    /* persistent kernel: claims made this run, zero between runs */
	int n_items, n_bh; /* persistent kernel: B·Hkv·(NS+1) work items, B·Hkv */
	float *ws_lse; /* [B][Hkv][NS+1][G] */
	int *counters; /* [B][Hkv] partials written this run, zero between runs */
	float *out;    /* [B][Hq][D] */
	float *lse;    /* [B][Hq] or NULL */
	int *status;
	int bt_stride;
	int Hq, Hkv, G, NS;
	int sink, hadamard, underflow, nterms;
	int qmass; /* page partials divided by the quantized mass Σ s_P·P̂ (cfg->p_norm) */
	float gamma, c, log2c, tau_c, inv_sqrt_d;
	uint32_t head_bytes, k_codes_off, k_scales_off, v_codes_off, v_scales_off, gscale_off;
	uint64_t page_bytes;
	int n_pages;
	uint64_t slot_head_off; /* (layer·Hkv)·slot_head_bytes: add h·slot_head_bytes */
	uint64_t slot_head_bytes;
	uint32_t sink_k_off, sink_v_off, recent_k_off, recent_v_off;
};

__device__ __forceinline__ void flag(const DecodeParams &p, int bits)
{
	if (p.status)
		atomicOr(p.status, bits);
}

/* Split boundaries: bd_attn_ref.h's chunk rule over n_full page tiles. */
__device__ __forceinline__ void split_range(int n_full, int NS, int s, int *pb, int *pe)
{
	int chunk = (n_full + NS - 1) / NS;
	if (chunk < 1)
		chunk = 1;
	long long b = (long long)s * chunk, e = b + chunk;
	*pb = (int)(b < n_full ? b : n_full);
	*pe = (int)(e < n_full ? e : n_full);
}

/* Validated context length and full-page count of request b; report: this CTA flags a bad
 * length (one work item per request does: split 0 of KV head 0). */
__device__ __forceinline__ int request_len(const DecodeParams &p, int b, bool report, int *n_full)
{
	int len = p.seq_lens[b];
	int nf = len >= 1 ? (len - 1) / BD_PAGE_TOKENS : 0;
	if (len < 1 || nf > p.bt_stride) {
		if (threadIdx.x == 0 && report)
			flag(p, BD_KSTATUS_BAD_LEN);
		len = 0;
		nf = 0;
	}
	*n_full = nf;
	return len;
}

/* Split s of request b: its full pages [pb, pb + np) and their block-table entries bt. */
struct Split {
	int pb, np;
	const int32_t *bt;
};

__device__ __forceinline__ Split split_of(const DecodeParams &p, int b, int h, int s)
{
	int n_full, pb, pe;
	(void)request_len(p, b, s == 0 && h == 0, &n_full);
	split_range(n_full, p.NS, s, &pb, &pe);
	return Split{ pb, pe - pb, p.bt + (size_t)b * p.bt_stride + pb };
}

__device__ __forceinline__ int32_t checked_page(const DecodeParams &p, int32_t id)
{
	if (id < 0 || id >= p.n_pages) {
		flag(p, BD_KSTATUS_BAD_PAGE);
		return 0; /* readable memory; the request's result is then wrong, and flagged */
	}
	return id;
}

__device__ __forceinline__ size_t partial_index(const DecodeParams &p, int b, int h, int s)
{
	return ((size_t)b * p.Hkv + h) * (size_t)(p.NS + 1) + s;
}

/* Final per-CTA step shared by every path: warps' (m, ℓ, o) → normalized partial.
 * red: [WARPS][8][D] floats of o per warp, rm/rl: [WARPS][8] m and ℓ; all warps share m in the
 * FP4 path (then rm holds equal values) and differ in the BF16 paths. rq: [WARPS][8] the
 * warps' quantized mass Σ s_P·P̂ when o is divided by it (the LSE stays log2 ℓ; NUMERICS.md,
 * page-partial normalization), or NULL to divide by ℓ. */
template <int D>
__device__ __forceinline__ void write_partial(const DecodeParams &p, int b, int h, int s,
					      const float *red, const float *rm, const float *rl,
					      float log2c, const float *rq = nullptr)
{
	const size_t pi = partial_index(p, b, h, s);
	for (int e = threadIdx.x; e < p.G * D; e += THREADS) {
		const int hd = e / D, ch = e % D;
		float M = -INFINITY;
		for (int w = 0; w < WARPS; w++)
			M = fmaxf(M, rm[w * 8 + hd]);
		float l = 0.0f, o = 0.0f, lq = 0.0f;
		if (M != -INFINITY) {
			for (int w = 0; w < WARPS; w++) {
				if (rm[w * 8 + hd] == -INFINITY)
					continue;
				float sc = exp2f(rm[w * 8 + hd] - M);
				l = l + sc * rl[w * 8 + hd];
				if (rq)
					lq = lq + sc * rq[w * 8 + hd];
				o = o + sc * red[(w * 8 + hd) * D + ch];
			}
		}
		float *dst = p.ws_o + (pi * p.G + hd) * D;
		if (l == 0.0f) {
			dst[ch] = 0.0f;
			if (ch == 0)
				p.ws_lse[pi * p.G + hd] = -INFINITY;
		} else {
			dst[ch] = o / (rq && lq > 0.0f ? lq : l);
			if (ch == 0)
				p.ws_lse[pi * p.G + hd] = M + log2f(l) - log2c;
		}
	}
}

/* Load query head hd of request b (lane-strided) and rotate it if the configuration does. */
template <int D>
__device__ __forceinline__ void load_query(const DecodeParams &p, int b, int h, int hd,
					   float (&x)[D / 32])
{
	const int lane = threadIdx.x & 31;
	const float *qh = p.q + ((size_t)b * p.Hq + (size_t)h * p.G + hd) * D;
#pragma unroll
	for (int i = 0; i < D / 32; i++)
		x[i] = qh[lane + 32 * i];
	if (p.hadamard)
		fwht_warp<D>(x, p.inv_sqrt_d);
}

/* ---- the BF16 partial: sink + recent tokens of one (request, KV head) ----------------------- */

/* Rows of the BF16 region of a request: the sink rows then a contiguous run of recent rows. */
struct Bf16Rows {
	int cnt, nsink, r0;
};

__device__ __forceinline__ Bf16Rows bf16_rows(const DecodeParams &p, int len, int n_full)
{
	Bf16Rows r;
	r.nsink = p.sink ? (len < BD_SINK_TOKENS ? len : BD_SINK_TOKENS) : 0;
	int t_recent = n_full * BD_PAGE_TOKENS;
	if (p.sink && t_recent < BD_SINK_TOKENS)
		t_recent = BD_SINK_TOKENS;
	int nrec = len - t_recent;
	if (nrec < 0)
		nrec = 0;
	r.r0 = t_recent - n_full * BD_PAGE_TOKENS;
	r.cnt = r.nsink + nrec;
	return r;
}

/* One warp's online softmax over BF16 key tiles of 16 (S^T = K q'^T, P in FP32 split into two
 * BF16 terms hi + lo for P·V, so P keeps 16 bits): heads 2t, 2t+1 of the thread. With KSCALE
 * the logits are (dot·kscale)·γ, kscale the page's g_K (channel-blocked NVFP4 pages). */
template <int D>
struct Bf16State {
	float m[2], l[2];
	float o[D / 16][4];

	/* no keys yet: m = −inf, ℓ = 0, o = 0 */
	__device__ __forceinline__ void reset()
	{
		m[0] = m[1] = -INFINITY;
		l[0] = l[1] = 0.0f;
#pragma unroll
		for (int mc = 0; mc < D / 16; mc++)
#pragma unroll
			for (int e = 0; e < 4; e++)
				o[mc][e] = 0.0f;
	}
};

template <int D, int ROWB, bool KSCALE = false>
__device__ __forceinline__ void bf16_tile16(const uint8_t *Ks, const uint8_t *Vs, int key0,
					    int nvalid, const uint32_t (&qb)[D / 16][2], float gamma,
					    Bf16State<D> &st, float kscale = 1.0f)
{
	const int lane = threadIdx.x & 31, g = lane >> 2;
	float sacc[4] = { 0.f, 0.f, 0.f, 0.f };
	const int mrow = ((lane >> 3) & 1) * 8 + (lane & 7), mcol = (lane >> 4) * 8;
#pragma unroll
	for (int kk = 0; kk < D / 16; kk++) {
		uint32_t a[4];
		ldmatrix_x4(a, Ks + (size_t)(key0 + mrow) * ROWB + (16 * kk + mcol) * 2);
		mma_bf16(sacc, a, qb[kk][0], qb[kk][1]);
	}
	float S[2][2]; /* [hs][r] */
#pragma unroll
	for (int r = 0; r < 2; r++)
#pragma unroll
		for (int hs = 0; hs < 2; hs++)
			if constexpr (KSCALE) /* channel-blocked NVFP4: (dot·g_K)·γ as bd_attn_ref.h */
				S[hs][r] = (g + 8 * r < nvalid) ? (sacc[2 * r + hs] * kscale) * gamma :
								  -INFINITY;
			else
				S[hs][r] = (g + 8 * r < nvalid) ? gamma * sacc[2 * r + hs] : -INFINITY;
	float alpha[2];
	uint32_t bhi[2], blo[2];
	float P[2][2];
#pragma unroll
	for (int hs = 0; hs < 2; hs++) {
		float mx = fmaxf(S[hs][0], S[hs][1]);
		mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
		mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
		mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
		float mn = fmaxf(st.m[hs], mx); /* finite: the tile has a valid key */
		alpha[hs] = st.m[hs] == -INFINITY ? 0.0f : exp2f(st.m[hs] - mn);
		float sum = 0.0f;
#pragma unroll
		for (int r = 0; r < 2; r++) {
			P[hs][r] = S[hs][r] == -INFINITY ? 0.0f : exp2f(S[hs][r] - mn);
			sum = sum + P[hs][r];
		}
		st.l[hs] = alpha[hs] * st.l[hs] + sum;
		st.m[hs] = mn;
	}
#pragma unroll
	for (int r = 0; r < 2; r++) {
		uint32_t hi = f2_to_bf2(P[0][r], P[1][r]);
		float lo0 = P[0][r] - bf16_lo_f(hi), lo1 = P[1][r] - bf16_hi_f(hi);
		bhi[r] = movmatrix_t(hi);
		blo[r] = movmatrix_t(f2_to_bf2(lo0, lo1));
	}
	const int vrow = (lane >> 4) * 8 + (lane & 7), vcol = ((lane >> 3) & 1) * 8;
#pragma unroll
	for (int mc = 0; mc < D / 16; mc++) {
#pragma unroll
		for (int e = 0; e < 4; e++)
			st.o[mc][e] = st.o[mc][e] * alpha[e & 1];
		uint32_t a[4];
		ldmatrix_x4_t(a, Vs + (size_t)(key0 + vrow) * ROWB + (16 * mc + vcol) * 2);
		mma_bf16(st.o[mc], a, bhi[0], bhi[1]);
		mma_bf16(st.o[mc], a, blo[0], blo[1]);
	}
}

/* Build the B fragments of q' rounded to BF16 (column g = head g) from qbf [8][D] in smem. */
template <int D>
__device__ __forceinline__ void bf16_qfrag(const __nv_bfloat16 *qbf, int G, uint32_t (&qb)[D / 16][2])
{
	const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
	for (int kk = 0; kk < D / 16; kk++) {
		if (g < G) {
			qb[kk][0] = *(const uint32_t *)(qbf + g * D + 16 * kk + 2 * t);
			qb[kk][1] = *(const uint32_t *)(qbf + g * D + 16 * kk + 2 * t + 8);
		} else {
			qb[kk][0] = qb[kk][1] = 0;
		}
	}
}

/* q' of the group's heads, rounded to BF16, into qbf [8][D] (warp w: heads w, w+4). */
template <int D>
__device__ __forceinline__ void bf16_query(const DecodeParams &p, int b, int h, __nv_bfloat16 *qbf)
{
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
	for (int hd = warp; hd < p.G; hd += WARPS) {
		float x[D / 32];
		load_query<D>(p, b, h, hd, x);
#pragma unroll
		for (int i = 0; i < D / 32; i++)
			qbf[hd * D + lane + 32 * i] = __float2bfloat16_rn(x[i]);
	}
}

/* q' of (b, h) rounded to BF16 through qbf [8][D] (shared) into every warp's B fragments qb;
 * a __syncthreads between (the CTA's threads all call it). */
template <int D>
__device__ __forceinline__ void bf16_query_frag(const DecodeParams &p, int b, int h,
						__nv_bfloat16 *qbf, uint32_t (&qb)[D / 16][2])
{
	bf16_query<D>(p, b, h, qbf);
	__syncthreads();
	bf16_qfrag<D>(qbf, p.G, qb);
}

/* Per-warp state → shared (o, m, ℓ per head) for write_partial. red must not alias live data. */
template <int D>
__device__ __forceinline__ void bf16_state_to_smem(Bf16State<D> &st, float *red, float *rm, float *rl)
{
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
	for (int hs = 0; hs < 2; hs++) {
		float l = st.l[hs];
		l = l + __shfl_xor_sync(0xffffffffu, l, 4);
		l = l + __shfl_xor_sync(0xffffffffu, l, 8);
		l = l + __shfl_xor_sync(0xffffffffu, l, 16);
		if (g == 0) {
			rm[warp * 8 + 2 * t + hs] = st.m[hs];
			rl[warp * 8 + 2 * t + hs] = l;
		}
	}
#pragma unroll
	for (int mc = 0; mc < D / 16; mc++)
#pragma unroll
		for (int e = 0; e < 4; e++)
			red[(warp * 8 + 2 * t + (e & 1)) * D + 16 * mc + g + 8 * (e >> 1)] = st.o[mc][e];
}

template <int D>
__device__ void bf16_split_end(const DecodeParams &p, int b, int h, int s, Bf16State<D> &st,
			       uint8_t *smem, float *rm, float *rl);

__device__ __forceinline__ int claim_item(const DecodeParams &p);

/* The BF16 partial CTA: the sink and recent rows in chunks of 64 through shared memory
 * (K chunk [64][ROWB], V chunk [64][ROWB], then q' [8][D] BF16), warp w taking key tile w of
 * each chunk with its own online softmax. PER (a work item of the persistent kernel): thread 0
 * claims the next item when the rows are done and stores it in *claim (shared) at the end. */
constexpr int PCHUNK = 64;

template <int D, int ROWB, bool PER = false>
__device__ void bf16_partial(const DecodeParams &p, int b, int h, uint8_t *smem, float *rm,
			     float *rl, int *claim = nullptr)
{
	const int tid = threadIdx.x, warp = tid >> 5;
	int n_full;
	const int len = request_len(p, b, false, &n_full);
	Bf16Rows rows = bf16_rows(p, len, n_full);
	const uint8_t *slot = (const uint8_t *)p.slots[b];
	if (rows.cnt > 0 && (slot == nullptr || ((uintptr_t)slot & 15) != 0)) {
		if (tid == 0)
			flag(p, BD_KSTATUS_BAD_SLOT);
		rows.cnt = 0;
	}
	uint8_t *Ks = smem, *Vs = smem + (size_t)PCHUNK * ROWB;
	__nv_bfloat16 *qbf = (__nv_bfloat16 *)(smem + (size_t)2 * PCHUNK * ROWB);
	const uint8_t *sh = slot + p.slot_head_off + (size_t)h * p.slot_head_bytes;
	constexpr int CPR = 2 * D / 16; /* 16-byte pieces per row */

	uint32_t qb[D / 16][2];
	bf16_query_frag<D>(p, b, h, qbf, qb);

	Bf16State<D> st;
	st.reset();
	for (int k0 = 0; k0 < rows.cnt; k0 += PCHUNK) {
		const int n = rows.cnt - k0 < PCHUNK ? rows.cnt - k0 : PCHUNK;
		for (int e = tid; e < 2 * n * CPR; e += THREADS) {
			const int which = e / (n * CPR), rem = e % (n * CPR);
			const int kr = rem / CPR, c = rem % CPR, k = k0 + kr;
			size_t off;
			if (k < rows.nsink)
				off = (which ? p.sink_v_off : p.sink_k_off) + (size_t)k * 2 * D;
			else
				off = (which ? p.recent_v_off : p.recent_k_off) +
				      (size_t)(rows.r0 + k - rows.nsink) * 2 * D;
			cp_async16((which ? Vs : Ks) + (size_t)kr * ROWB + c * 16, sh + off + c * 16);
		}
		cp_async_commit();
		/* zero the rows that pad the last key tile: P = 0 must not meet NaN garbage in V */
		const int n16 = (n + 15) & ~15;
		for (int e = tid; e < (n16 - n) * (ROWB / 16); e += THREADS) {
			int r = n + e / (ROWB / 16), c = e % (ROWB / 16);
			((uint4 *)(Ks + (size_t)r * ROWB))[c] = make_uint4(0, 0, 0, 0);
			((uint4 *)(Vs + (size_t)r * ROWB))[c] = make_uint4(0, 0, 0, 0);
		}
		cp_async_wait<0>();
		__syncthreads();
		if (warp * 16 < n)
			bf16_tile16<D, ROWB>(Ks, Vs, warp * 16, n - warp * 16, qb, p.gamma, st);
		__syncthreads(); /* the chunk is free for the next one (or the reduction) */
	}
	[[maybe_unused]] int next = 0;
	if constexpr (PER) {
		if (tid == 0)
			next = claim_item(p);
	}
	bf16_split_end<D>(p, b, h, p.NS, st, smem, rm, rl);
	if constexpr (PER) {
		if (tid == 0)
			*claim = next;
	}
}

/* ---- the LSE combine, fused: the last CTA of a (request, KV head) to finish does it ---------- */

/* bd_lse_combine over the NS+1 partials of (b, h): o = Σ w_s o_s / Σ w_s, w_s = exp2(lse_s − M),
 * M and the weights in FP64 as the reference (weights kept as FP32 in shared memory). Called
 * by every thread of the CTA; smem: (NS+1)·G floats. */
template <int D>
__device__ void combine_group(const DecodeParams &p, int b, int h, float *smem)
{
	const int NS1 = p.NS + 1, G = p.G, tid = threadIdx.x;
	const size_t base = partial_index(p, b, h, 0);
	__shared__ double Ms[8], Ws[8];
	float *w = smem; /* [NS1][G] */
	for (int e = tid; e < NS1 * G; e += THREADS)
		w[e] = __ldcg(p.ws_lse + base * G + e);
	__syncthreads();
	if (tid < G) {
		double M = -INFINITY;
		for (int s = 0; s < NS1; s++)
			M = fmax(M, (double)w[s * G + tid]);
		Ms[tid] = M;
	}
	__syncthreads();
	for (int e = tid; e < NS1 * G; e += THREADS) {
		const double M = Ms[e % G];
		const float l = w[e];
		w[e] = (M == -INFINITY || l == -INFINITY) ? 0.0f : (float)exp2((double)l - M);
	}
	__syncthreads();
	if (tid < G) {
		double ws = 0.0;
		for (int s = 0; s < NS1; s++)
			ws += (double)w[s * G + tid];
		Ws[tid] = ws;
	}
	__syncthreads();
	/* The partials come from L2 (latency, not bandwidth bound): warp w sums partials
	 * s ≡ w (mod 4) with float4 loads, 16 in flight per thread; then the four warps' sums
	 * are added in shared memory (after the weights). */
	const int warp = tid >> 5, lane = tid & 31;
	const int nv = G * D / 4; /* float4 per partial, ≤ 256 */
	float4 *part = (float4 *)(w + ((NS1 * G + 3) & ~3)); /* [WARPS][nv] */
	for (int v0 = lane; v0 < nv; v0 += 32 * 4) {
		float4 acc[4];
#pragma unroll
		for (int k = 0; k < 4; k++)
			acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
		for (int s0 = warp; s0 < NS1; s0 += WARPS * 4) {
			float4 v[4][4];
			float wt[4][4];
#pragma unroll
			for (int j = 0; j < 4; j++) {
				const int s = s0 + WARPS * j;
#pragma unroll
				for (int k = 0; k < 4; k++) {
					const int vi = v0 + 32 * k;
					const bool ok = s < NS1 && vi < nv;
					v[j][k] = ok ? __ldcg((const float4 *)(p.ws_o + (base + s) * G * D) + vi) :
						       make_float4(0.f, 0.f, 0.f, 0.f);
					wt[j][k] = ok ? w[s * G + vi * 4 / D] : 0.0f;
				}
			}
#pragma unroll
			for (int j = 0; j < 4; j++)
#pragma unroll
				for (int k = 0; k < 4; k++) {
					acc[k].x += wt[j][k] * v[j][k].x;
					acc[k].y += wt[j][k] * v[j][k].y;
					acc[k].z += wt[j][k] * v[j][k].z;
					acc[k].w += wt[j][k] * v[j][k].w;
				}
		}
#pragma unroll
		for (int k = 0; k < 4; k++)
			if (v0 + 32 * k < nv)
				part[warp * nv + v0 + 32 * k] = acc[k];
	}
	__syncthreads();
	float *out = p.out + ((size_t)b * p.Hq + (size_t)h * G) * D;
	for (int vi = tid; vi < nv; vi += THREADS) {
		float4 r = part[vi];
		for (int ww = 1; ww < WARPS; ww++) {
			const float4 q4 = part[ww * nv + vi];
			r.x += q4.x;
			r.y += q4.y;
			r.z += q4.z;
			r.w += q4.w;
		}
		const double ws = Ws[vi * 4 / D];
		const float inv = ws > 0.0 ? (float)(1.0 / ws) : 0.0f;
		((float4 *)out)[vi] = make_float4(r.x * inv, r.y * inv, r.z * inv, r.w * inv);
	}
	if (p.lse && tid < G)
		p.lse[(size_t)b * p.Hq + (size_t)h * G + tid] =
			Ws[tid] > 0.0 ? (float)(Ms[tid] + log2(Ws[tid])) : -INFINITY;
}

/* After a CTA wrote its partial: count it; the last of the NS+1 CTAs of (b, h) combines. */
template <int D>
__device__ __forceinline__ void finish_group(const DecodeParams &p, int b, int h, uint8_t *smem)
{
	__shared__ int last;
	__threadfence(); /* this CTA's partial is visible device-wide before it is counted */
	__syncthreads();
	if (threadIdx.x == 0) {
		int *cnt = p.counters + (size_t)b * p.Hkv + h;
		last = atomicAdd(cnt, 1) == p.NS;
		if (last)
			*cnt = 0; /* every CTA of this group has counted: ready for the next run */
	}
	__syncthreads();
	if (last) {
		__threadfence();
		combine_group<D>(p, b, h, (float *)smem);
	}
}

/* The end of every work item whose warps hold a Bf16State (the BF16 partial and the BF16-row
 * split kernels): no copies left in flight, the warps' states → the normalized partial of split
 * s of (b, h) (smem reused from 0, [WARPS][8][D] floats), then the count and the combine. */
template <int D>
__device__ void bf16_split_end(const DecodeParams &p, int b, int h, int s, Bf16State<D> &st,
			       uint8_t *smem, float *rm, float *rl)
{
	float *red = (float *)smem;
	cp_async_wait<0>();
	__syncthreads();
	bf16_state_to_smem<D>(st, red, rm, rl);
	__syncthreads();
	write_partial<D>(p, b, h, s, red, rm, rl, 0.0f);
	finish_group<D>(p, b, h, smem);
}

/* The pages of split s < NS of (request b, KV head h); the first ≤ maxids checked page ids go
 * to ids (shared: the caller's __syncthreads publishes them). Split NS is the BF16 partial
 * (bf16_partial) instead. */
__device__ __forceinline__ Split split_pages(const DecodeParams &p, int b, int h, int s,
					     int32_t *ids, int maxids)
{
	const Split sp = split_of(p, b, h, s);
	for (int i = threadIdx.x; i < sp.np && i < maxids; i += THREADS)
		ids[i] = checked_page(p, sp.bt[i]);
	return sp;
}

/* ---- the FP4 page path ----------------------------------------------------------------------- */

/* Where a warp reads the V rows of a page in shared memory: vcw word t of the warp's tokens in
 * channel row 0 (rows 64 bytes apart), vsw the NVFP4 V block scale of the thread's tokens in
 * row 0 (rows 8 bytes apart), vs the MXFP4 V scales [d][4]; the warp and the thread's row g. */
struct VRows {
	const uint8_t *vcw, *vsw, *vs;
	int warp, g;
};

/* Word t of the warp's tokens in V channel row c + g (rows 64 bytes apart). */
__device__ __forceinline__ uint32_t v_word(const VRows &vr, int c)
{
	return *(const uint32_t *)(vr.vcw + (c + vr.g) * 64);
}

/* V row pair mc of a page (channels c0 = 16mc + g, c1 = c0 + 8; words x0, x1 of the warp's
 * tokens) as MMA A halves: NVFP4 × the V block scales (exact, as fp4x8_h2 says), MXFP4 bare x̂_V.
 * The two rows' scale bytes are merged by an IMAD into one cvt. */
template <bool MX>
__device__ __forceinline__ void v_rows(const VRows &vr, int mc, uint32_t x0, uint32_t x1,
				       uint32_t (&a0)[4], uint32_t (&a1)[4])
{
	const int c0 = 16 * mc + vr.g, c1 = c0 + 8;
	fp4x8_h2_fma(x0, a0);
	fp4x8_h2_fma(x1, a1);
	if constexpr (!MX) {
		const uint32_t sc = e4m3x2_to_h2(mad256(vr.vsw[c1 * 8], vr.vsw[c0 * 8]));
#pragma unroll
		for (int j = 0; j < 4; j++) {
			a0[j] = hmul2_lo(a0[j], sc);
			a1[j] = hmul2_hi(a1[j], sc);
		}
	}
}

/* MXK (BD_V9_MXK): one S^T tile of MXFP4 keys with the block scales outside the MMA. The two
 * k-steps of a thread's word (fp4x8_h2's pairs) are then block kb for all four threads (word t
 * of block kb, by ldmatrix), so each block's dot of the FP16 x̂·2^-14 with the query's
 * x̂·2^(e − r_q) is summed on its own and added into sacc (FP32) times 2^(e_K − 127), exactly: no
 * FP16 rounding of key blocks far under the row's largest. A scale code 0 (2^-127) counts as 0,
 * its block weighing under 6·2^-127·|q|. kw: this lane's ldmatrix row address (tile rows g,
 * g + 8, blocks 2kp + (lane >> 4)); sc: the UE8M0 scales of row g ([KB] bytes a row, row g + 8
 * the next); qf[nt][2kb + hh]: the query's B fragments; sacc[nt][e] as mma_f16's c. */
template <int D, int NTS>
__device__ __forceinline__ void s_tile_mx(const uint8_t *kw, const uint8_t *sc,
					  const uint32_t (&qf)[NTS][D / 16][2], float (&sacc)[NTS][4])
{
	constexpr int KB = D / 32;
	uint32_t sw[2];
	if constexpr (KB == 4) {
		sw[0] = *(const uint32_t *)sc;
		sw[1] = *(const uint32_t *)(sc + KB);
	} else {
		sw[0] = *(const uint16_t *)sc;
		sw[1] = *(const uint16_t *)(sc + KB);
	}
#pragma unroll
	for (int kp = 0; kp < KB / 2; kp++) {
		uint32_t w[4]; /* row g block 2kp, row g + 8, row g block 2kp + 1, row g + 8 */
		ldmatrix_x4(w, kw + 32 * kp);
#pragma unroll
		for (int j = 0; j < 2; j++) {
			const int kb = 2 * kp + j;
			uint32_t a0[4], a1[4];
			fp4x8_h2_fma(w[2 * j], a0);
			fp4x8_h2_fma(w[2 * j + 1], a1);
			float f[2];
#pragma unroll
			for (int r = 0; r < 2; r++) /* byte kb of sw[r] to the FP32 exponent field */
				f[r] = __uint_as_float((kb < 3 ? sw[r] << (23 - 8 * kb) : sw[r] >> (8 * kb - 23)) &
						       0x7f800000u);
#pragma unroll
			for (int nt = 0; nt < NTS; nt++) {
				float d[4] = { 0.0f, 0.0f, 0.0f, 0.0f };
#pragma unroll
				for (int hh = 0; hh < 2; hh++) {
					const uint32_t a[4] = { a0[2 * hh], a1[2 * hh], a0[2 * hh + 1],
								a1[2 * hh + 1] };
					mma_f16(d, a, qf[nt][2 * kb + hh][0], qf[nt][2 * kb + hh][1]);
				}
#pragma unroll
				for (int e = 0; e < 4; e++)
					sacc[nt][e] = __fmaf_rn(d[e], f[e >> 1], sacc[nt][e]);
			}
		}
	}
}

/* MODE 0: one query term, G ≤ 8 (column g = head g; a thread holds heads 2t, 2t+1).
 * MODE 1: two terms, G ≤ 4 (column g = head g/2, term g%2; a thread holds head t).
 * MODE 2: two terms, G ≤ 8, two column tiles (heads t and 4 + t). */
template <int MODE>
struct ModeT {
	static constexpr int NTS = MODE == 2 ? 2 : 1; /* column tiles of the S MMA */
	static constexpr int HS = MODE == 1 ? 1 : 2;  /* heads per thread */
	__device__ static int head(int hs, int t)
	{
		return MODE == 0 ? 2 * t + hs : 4 * hs + t;
	}
};

template <int D>
struct Fp4Cfg {
	static constexpr int HB = D == 128 ? 18432 : 9216; /* page-head bytes (NVFP4) */
	static constexpr int STAGES = D == 128 ? 3 : 5;   /* 4 CTAs per SM */
	static constexpr int STAGE_BYTES = HB * STAGES;
	static constexpr int PART_BYTES = 2 * PCHUNK * 2 * D + 8 * D * 2; /* BF16 chunk + q' */
	static constexpr int MAIN = STAGE_BYTES > PART_BYTES ? STAGE_BYTES : PART_BYTES;
	/* layout: main | page ids | gbuf[STAGES][16] | red[2][WARPS][8] | rm, rl | bars */
	static constexpr int AUX_OFF = MAIN;
	static constexpr int GBUF_OFF = AUX_OFF + MAXIDS * 4;
	static constexpr int RED_OFF = GBUF_OFF + STAGES * 16;
	static constexpr int RM_OFF = RED_OFF + 2 * WARPS * 2 * 8 * 4; /* block maxima */
	static constexpr int RL_OFF = RM_OFF + WARPS * 8 * 4;
	static constexpr int BAR_OFF = RL_OFF + WARPS * 8 * 4;
	static constexpr int SMEM = BAR_OFF + (STAGES + 1) * 8; /* stages, tile maximum */
};

/* MX: MXFP4 pages (UE8M0 scales, blocks of 32; NUMERICS.md §2, §6). A warp's 32 tokens are
 * then exactly one V block per channel and one P block per head, so both scales leave the
 * PV MMA: it multiplies bare x̂_V by bare P̂, and 2^(e_V + e_P) scales its FP32 output. K keeps
 * its scales inside the MMA (a k-step mixes the four threads' blocks), as FP16 powers of two
 * relative to the row's largest block exponent, which the logit's FP32 factor restores. */
constexpr int fp4_min_ctas(int D, int MODE, bool MX)
{
	return (D == 128 && MODE == 2 && (MX || !BD_V9_ANY)) ? 3 : 4;
}

/* Whether the page loop syncs its warps by a split barrier (arrive, expand the first V rows,
 * wait) rather than __syncthreads; MODE 2 keeps the __syncthreads: no registers to spare for
 * the split barrier's V rows. */
__host__ __device__ constexpr bool fp4_split_barrier(int MODE)
{
	return BD_V8_SPLIT && MODE != 2;
}

/* The barriers of the FP4 page path (thread 0; the caller's __syncthreads publishes them):
 * bar[0 .. STAGES - 1] complete when stage k's bulk copies have landed (one arrival with the
 * bytes), bar[STAGES] (SPLIT) when every thread has posted page i's tile maxima (phase i). */
template <int STAGES, bool SPLIT>
__device__ __forceinline__ void fp4_bars_init(uint64_t *bar)
{
	if (threadIdx.x == 0) {
		for (int i = 0; i < STAGES; i++)
			mbar_init(&bar[i], 1);
		if (SPLIT)
			mbar_init(&bar[STAGES], THREADS);
		mbar_fence_init();
	}
}

/* The persistent kernel's next work item: items 0 .. gridDim.x − 1 are the CTAs' first ones,
 * then *p.sched counts claims. Nothing waits on the result until it is stored, so its latency
 * overlaps the rest of the current item. Every item processed is followed by exactly one claim,
 * so a run makes n_items claims and the one that returns gridDim.x + n_items − 1 is its last. */
__device__ __forceinline__ int claim_item(const DecodeParams &p)
{
	return (int)gridDim.x + atomicAdd(p.sched, 1);
}

/* Split s < NS of (request b, KV head h) on the FP4 pages: the whole work of one CTA of
 * fp4_decode_kernel, or one work item of fp4_decode_kernel_persist (PER), which then claims its
 * next item into *claim (shared) after the page loop, and leaves the shared memory free and the
 * mbarriers at even parity for the next item. */
template <int D, int MODE, bool MX, bool PER>
__device__ __forceinline__ void fp4_split(const DecodeParams &p, int b, int h, int s, int *claim)
{
	using C = Fp4Cfg<D>;
	using M = ModeT<MODE>;
	constexpr int NTS = M::NTS, HS = M::HS, KSTEPS = D / 16, W = D / 32, MC = D / 16;
	constexpr int STAGES = C::STAGES;
	constexpr bool SPLIT = fp4_split_barrier(MODE);
	constexpr int VPRE = SPLIT ? BD_V8_VPRE : 0;
	constexpr bool MXK = MX && BD_V9_MXK; /* MXFP4 block scales on the FP32 sums */
	constexpr bool LDSM = BD_V9_LDSM;      /* V words by ldmatrix */
	constexpr bool SOFT = BD_V9_SOFT;      /* the tile maximum by LDS.128, the fast divisions */
	constexpr int KB = D / 32;             /* MXFP4 blocks of a key row */
	extern __shared__ __align__(128) uint8_t smem[];
	uint8_t *aux = smem + C::AUX_OFF;
	float *gbuf = (float *)(smem + C::GBUF_OFF);
	float *red = (float *)(smem + C::RED_OFF);
	float *rm = (float *)(smem + C::RM_OFF);
	float *rl = (float *)(smem + C::RL_OFF);
	uint64_t *bar = (uint64_t *)(smem + C::BAR_OFF);

	const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
	int32_t *ids = (int32_t *)aux;
	const Split sp = split_pages(p, b, h, s, ids, MAXIDS);
	const int pb = sp.pb, np = sp.np;
	const int32_t *bt = sp.bt;
	if (!PER)
		fp4_bars_init<STAGES, SPLIT>(bar); /* PER: once per CTA, by the persistent kernel */
	__syncthreads();

	const uint32_t hb = p.head_bytes;
	auto issue = [&](int i, int stg) {
		int32_t id = i < MAXIDS ? ids[i] : checked_page(p, bt[i]);
		const uint8_t *src = p.arena + (size_t)id * p.page_bytes;
		mbar_arrive_tx(&bar[stg], hb + 16u);
		bulk_g2s(smem + (size_t)stg * hb, src + (size_t)h * hb, hb, &bar[stg]);
		bulk_g2s(gbuf + stg * 4, src + p.gscale_off + (size_t)(h & ~1) * 8, 16, &bar[stg]);
	};
	/* the last stage's buffer holds the query while the first pages stream in */
	if (tid == 0)
		for (int i = 0; i < STAGES - 1 && i < np; i++)
			issue(i, i);

	/* ---- prologue: rotated, dual-residual FP4 query (NUMERICS.md §5) ---- */
	__half *sq = (__half *)(smem + (size_t)(STAGES - 1) * hb); /* [2][8][D] ŝ = s·x̂ */
	float *qg = (float *)(sq + 2 * 8 * D);                     /* [2][8] */
	for (int hd = warp; hd < p.G; hd += WARPS) {
		float x[W], xs[2][W], gq[2];
		uint32_t codes[2][W], scode[2][W];
		load_query<D>(p, b, h, hd, x);
		if constexpr (MX)
			mx_query_quant_warp<D>(x, p.nterms, xs, codes, scode, gq);
		else
			query_quant_warp<D>(x, p.nterms, xs, codes, scode, gq);
#pragma unroll
		for (int tt = 0; tt < 2; tt++)
#pragma unroll
			for (int i = 0; i < W; i++)
				sq[(tt * 8 + hd) * D + lane + 32 * i] = __float2half_rn(xs[tt][i]);
		if (lane == 0) {
			qg[hd] = gq[0];
			qg[8 + hd] = gq[1];
		}
	}
	__syncthreads();
	uint32_t qf[NTS][KSTEPS][2];
	float k1[HS], k2[HS];
#pragma unroll
	for (int nt = 0; nt < NTS; nt++) {
		const int hd = MODE == 0 ? g : 4 * nt + (g >> 1);
		const int term = MODE == 0 ? 0 : (g & 1);
		const __half *src = sq + (term * 8 + hd) * D;
#pragma unroll
		for (int kk = 0; kk < KSTEPS; kk++) {
			/* k-step kk: thread t's k 2t, 2t + 1 are channels c0, c0 + 4 of its word kk/2 of
			 * a key row, k 2t + 8, 2t + 9 channels c0 + 1, c0 + 5 (fp4x8_h2's pairs); MXK:
			 * the thread's word of k-steps 2kb, 2kb + 1 is word t of block kb */
			const int c0 = MXK ? 32 * (kk >> 1) + 8 * t + 2 * (kk & 1) :
					     t * (D / 4) + 8 * (kk >> 1) + 2 * (kk & 1);
			if (hd < p.G) {
				qf[nt][kk][0] = (uint32_t)__half_as_ushort(src[c0]) |
						((uint32_t)__half_as_ushort(src[c0 + 4]) << 16);
				qf[nt][kk][1] = (uint32_t)__half_as_ushort(src[c0 + 1]) |
						((uint32_t)__half_as_ushort(src[c0 + 5]) << 16);
			} else {
				qf[nt][kk][0] = qf[nt][kk][1] = 0;
			}
		}
	}
#pragma unroll
	for (int hs = 0; hs < HS; hs++) {
		const int hd = M::head(hs, t);
		/* the K operand carries 2^-14 (fp4x2_h2); fold it back with g_q, exactly (MXFP4
		 * without MXK: the row factor restores it, all but the 1/2 taken here) */
		const float kq = MX && !MXK ? 0.5f : 16384.0f;
		k1[hs] = hd < p.G ? kq * qg[hd] : 0.0f;
		k2[hs] = hd < p.G ? kq * qg[8 + hd] : 0.0f;
	}
	fence_proxy_async();
	__syncthreads();
	if (tid == 0 && STAGES - 1 < np)
		issue(STAGES - 1, STAGES - 1);

	/* ---- main loop over the split's pages ---- */
	/* Token order (the k index of O^T = Ṽ^T P̃^T may mix tokens freely, since the V and P
	 * scales are applied per element before the MMA): thread t owns V word t of a channel row
	 * (tokens 8t..8t+7 of the warp's 32), pairs (2ks, 2ks+4) and (2ks+1, 2ks+5) of it feed
	 * k-step ks. So S^T tile ks row g is token 8(g>>1) + 2ks + 4(g&1), row g + 8 the next one,
	 * and all four logits of a thread lie in one P block: tokens 0–15 for g < 4, 16–31 else. */
	const int krow = 32 * warp + 8 * (g >> 1) + 4 * (g & 1);
	/* ldmatrix rows: lane l gives row l & 7 of matrix l >> 3. MXK's K words: matrix j holds
	 * the rows of tile row g + 8(j & 1) (keys krow + 2mt, + 1), word t of block kb + (j >> 1);
	 * LDSM's V words: matrix j holds channel rows 16(mc + (j >> 1)) + 8(j & 1) + row. */
	const int kld = (32 * warp + 8 * ((lane & 7) >> 1) + 4 * (lane & 1) + ((lane >> 3) & 1)) *
				(D / 2) + 16 * (lane >> 4);
	const int vld = lane * 64 + 16 * warp;
	const bool sink0 = p.sink && pb == 0 && warp == 0 && g < 4;
	float m_run[HS], l_run[HS], q_run[HS], o[MC][4], gv2_prev = 1.0f;
#pragma unroll
	for (int hs = 0; hs < HS; hs++) {
		m_run[hs] = -INFINITY;
		l_run[hs] = 0.0f;
		q_run[hs] = 0.0f; /* the quantized mass Σ s_P·P̂ (p.qmass) */
	}
#pragma unroll
	for (int mc = 0; mc < MC; mc++)
#pragma unroll
		for (int e = 0; e < 4; e++)
			o[mc][e] = 0.0f;

	for (int i = 0; i < np; i++) {
		const int stg = i % STAGES;
		mbar_wait(&bar[stg], (uint32_t)(i / STAGES) & 1u);
		const uint8_t *base = smem + (size_t)stg * hb;
		const uint8_t *kc = base + p.k_codes_off, *ks = base + p.k_scales_off;
		const uint8_t *vc = base + p.v_codes_off, *vs = base + p.v_scales_off;
		const float gk = gbuf[stg * 4 + (h & 1) * 2], gv = gbuf[stg * 4 + (h & 1) * 2 + 1];

		/* S^T = K̃ Q̃^T for the warp's two key tiles; kf[mt][r]: the FP32 factor of row r
		 * of tile mt (g_K, or for MXFP4 2^(r_row − 127), r_row the row's largest UE8M0) */
		float sacc[2][NTS][4], kf[2][2];
#pragma unroll
		for (int mt = 0; mt < 2; mt++) {
#pragma unroll
			for (int nt = 0; nt < NTS; nt++)
#pragma unroll
				for (int e = 0; e < 4; e++)
					sacc[mt][nt][e] = 0.0f;
			if constexpr (MXK) {
				s_tile_mx<D, NTS>(kc + kld + mt * 2 * (D / 2), ks + (krow + 2 * mt) * KB, qf,
						  sacc[mt]);
				kf[mt][0] = kf[mt][1] = 1.0f; /* the block factors are in sacc */
			} else {
				const int r0 = krow + 2 * mt;
				uint32_t w0[W], w1[W], s0 = 0, s1 = 0;
				if constexpr (D == 128) {
					uint4 a = *(const uint4 *)(kc + r0 * (D / 2) + t * 16);
					uint4 bq = *(const uint4 *)(kc + (r0 + 1) * (D / 2) + t * 16);
					w0[0] = a.x; w0[1] = a.y; w0[2] = a.z; w0[3] = a.w;
					w1[0] = bq.x; w1[1] = bq.y; w1[2] = bq.z; w1[3] = bq.w;
					if constexpr (!MX) {
						s0 = *(const uint16_t *)(ks + r0 * (D / 16) + 2 * t);
						s1 = *(const uint16_t *)(ks + (r0 + 1) * (D / 16) + 2 * t);
					}
				} else {
					uint2 a = *(const uint2 *)(kc + r0 * (D / 2) + t * 8);
					uint2 bq = *(const uint2 *)(kc + (r0 + 1) * (D / 2) + t * 8);
					w0[0] = a.x; w0[1] = a.y;
					w1[0] = bq.x; w1[1] = bq.y;
					if constexpr (!MX) {
						s0 = ks[r0 * (D / 16) + t];
						s1 = ks[(r0 + 1) * (D / 16) + t];
					}
				}
				/* the HMUL2 scale operands of rows r0 and r0 + 1: MXFP4 one FP16 pair for the
				 * thread's block; NVFP4 the FP16 scales of the low and the high block, which the
				 * HMUL2 operand selector broadcasts (.H0_H0 / .H1_H1) */
				uint32_t ks0, ks1;
				if constexpr (MX) {
					/* the thread's channels are one MXFP4 block (D = 128: block t; 64: t/2) */
					const int sb = D == 128 ? t : (t >> 1);
					const int e0 = ks[r0 * (D / 32) + sb], e1 = ks[(r0 + 1) * (D / 32) + sb];
					int m0 = max(e0, __shfl_xor_sync(0xffffffffu, e0, 1));
					int m1 = max(e1, __shfl_xor_sync(0xffffffffu, e1, 1));
					m0 = max(m0, __shfl_xor_sync(0xffffffffu, m0, 2));
					m1 = max(m1, __shfl_xor_sync(0xffffffffu, m1, 2));
					/* FP16 2^(e − m + 15), at least 2^-14: blocks 24 binades under the row's
					 * largest stay exact, lower ones round (their weight is < 2^-24) */
					const uint32_t b0 = (uint32_t)(max(e0 - m0 + 15, -14) + 15) << 10;
					const uint32_t b1 = (uint32_t)(max(e1 - m1 + 15, -14) + 15) << 10;
					ks0 = b0 | (b0 << 16);
					ks1 = b1 | (b1 << 16);
					kf[mt][0] = ue8m0_f32((uint32_t)m0); /* × the 1/2 in k1, k2 */
					kf[mt][1] = ue8m0_f32((uint32_t)m1);
				} else {
					ks0 = e4m3x2_to_h2(s0); /* D = 64: one block, high half 0 */
					ks1 = e4m3x2_to_h2(s1);
					kf[mt][0] = kf[mt][1] = gk;
				}
#pragma unroll
				for (int wi = 0; wi < W; wi++) {
					/* word wi of the thread's channels lies in block (D == 128 ? wi/2 : 0) */
					const bool hi = D == 128 && (wi >> 1);
					uint32_t a0[4], a1[4];
					fp4x8_h2_fma(w0[wi], a0);
					fp4x8_h2_fma(w1[wi], a1);
#pragma unroll
					for (int j = 0; j < 4; j++) {
						if constexpr (MX) {
							a0[j] = hmul2(a0[j], ks0);
							a1[j] = hmul2(a1[j], ks1);
						} else {
							a0[j] = hi ? hmul2_hi(a0[j], ks0) : hmul2_lo(a0[j], ks0);
							a1[j] = hi ? hmul2_hi(a1[j], ks1) : hmul2_lo(a1[j], ks1);
						}
					}
#pragma unroll
					for (int hh = 0; hh < 2; hh++) {
						const uint32_t a[4] = { a0[2 * hh], a1[2 * hh], a0[2 * hh + 1],
									a1[2 * hh + 1] };
#pragma unroll
						for (int nt = 0; nt < NTS; nt++)
							mma_f16(sacc[mt][nt], a, qf[nt][2 * wi + hh][0],
								qf[nt][2 * wi + hh][1]);
					}
				}
			}
		}

		/* logits (bd_attn_ref.h order): ((acc1·g_q1 + acc2·g_q2)·g_K)·γ; the sink's page copy
		 * (keys 0–15 of the request's first page: block 0 of warp 0) is masked */
		const bool masked = sink0 && i == 0;
		float S[2][HS][2], bm[HS];
#pragma unroll
		for (int hs = 0; hs < HS; hs++) {
			float v = -INFINITY;
#pragma unroll
			for (int mt = 0; mt < 2; mt++) {
#pragma unroll
				for (int r = 0; r < 2; r++) {
					float dot;
					if constexpr (MODE == 0) {
						dot = sacc[mt][0][2 * r + hs] * k1[hs];
					} else {
						dot = sacc[mt][hs][2 * r] * k1[hs];
						dot = dot + sacc[mt][hs][2 * r + 1] * k2[hs];
					}
					S[mt][hs][r] = masked ? -INFINITY : (dot * kf[mt][r]) * p.gamma;
					v = fmaxf(v, S[mt][hs][r]);
				}
			}
			/* the P block maximum: the 16 logits of the block sit in lanes of one half
			 * (MXFP4: the 32 of the warp) */
			v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 4));
			v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 8));
			if constexpr (MX)
				v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 16));
			bm[hs] = v;
		}
		if constexpr (SOFT) {
			/* the warp's maximum of each head (the two P blocks' maxima: lanes g, g ^ 4) at
			 * red[i & 1][head][warp], so that one LDS.128 reads a head's four */
#pragma unroll
			for (int hs = 0; hs < HS; hs++) {
				const float wm = MX ? bm[hs] : fmaxf(bm[hs], __shfl_xor_sync(0xffffffffu, bm[hs], 16));
				if (g == 0)
					red[((i & 1) * 8 + M::head(hs, t)) * WARPS + warp] = wm;
			}
		} else if (g == 0 || g == 4) {
#pragma unroll
			for (int hs = 0; hs < HS; hs++)
				red[(((i & 1) * WARPS + warp) * 2 + (g >> 2)) * 8 + M::head(hs, t)] = bm[hs];
		}
		fence_proxy_async(); /* this thread's reads of page i-1's stage precede its refill */
		/* word t of the warp's tokens, its V block's scale */
		const VRows vr = { vc + 16 * warp + 4 * t, vs + 2 * warp + (t >> 1), vs, warp, g };
		/* the V words of row pair mc (channels 16mc + g, + 8; word t of the warp's tokens):
		 * LDSM, one ldmatrix.x4 per two pairs (matrix j: channels 16(mc + (j >> 1)) +
		 * 8(j & 1) + row) */
		uint32_t vw4[4];
		auto v_pair = [&](int mc, uint32_t &x0, uint32_t &x1) {
			if constexpr (LDSM) {
				if ((mc & 1) == 0)
					ldmatrix_x4(vw4, vc + vld + mc * 16 * 64);
				x0 = vw4[2 * (mc & 1)];
				x1 = vw4[2 * (mc & 1) + 1];
			} else {
				x0 = v_word(vr, 16 * mc);
				x1 = v_word(vr, 16 * mc + 8);
			}
		};
		/* pair mc as the MMA A halves a0, a1 (v_rows) */
		auto v_operand = [&](int mc, uint32_t (&a0)[4], uint32_t (&a1)[4]) {
			uint32_t x0, x1;
			v_pair(mc, x0, x1);
			v_rows<MX>(vr, mc, x0, x1, a0, a1);
		};
		uint32_t vpre[VPRE > 0 ? VPRE : 1][2][4];
		if constexpr (SPLIT) {
			/* every thread arrives (release of its maxima and its reads of page i-1),
			 * expands the first V rows of page i, which need no tile maximum, then waits */
			mbar_arrive(&bar[STAGES]);
#pragma unroll
			for (int mc = 0; mc < VPRE; mc++)
				v_operand(mc, vpre[mc][0], vpre[mc][1]);
			mbar_wait(&bar[STAGES], (uint32_t)i & 1u);
		} else {
			__syncthreads();
		}
		if (tid == 0 && i >= 1 && i - 1 + STAGES < np)
			issue(i - 1 + STAGES, (i - 1) % STAGES);

		float m_new[HS], alpha[HS];
#pragma unroll
		for (int hs = 0; hs < HS; hs++) {
			const int hd = M::head(hs, t);
			float mx;
			if constexpr (SOFT) {
				static_assert(WARPS == 4, "one float4 of warp maxima per head");
				const float4 r4 = *(const float4 *)(red + ((i & 1) * 8 + hd) * WARPS);
				mx = fmaxf(fmaxf(r4.x, r4.y), fmaxf(r4.z, r4.w));
			} else {
				mx = red[((i & 1) * WARPS * 2) * 8 + hd];
#pragma unroll
				for (int w = 1; w < 2 * WARPS; w++)
					mx = fmaxf(mx, red[((i & 1) * WARPS * 2 + w) * 8 + hd]);
			}
			m_new[hs] = fmaxf(m_run[hs], mx);
			alpha[hs] = m_run[hs] == -INFINITY ? 0.0f : ex2_ftz(m_run[hs] - m_new[hs]);
		}

		/* P, ℓ and the thread's NVFP4 (MXFP4) P block (NUMERICS.md §6) */
		float Pt[2][2][2]; /* [mt][hs][r], P̃ = s_P·P̂ (MXFP4: P̂; zero for a missing head) */
		float sph[2];      /* MXFP4: 2^(e_P + 14), the P scale and the V operand's 2^-14 */
#pragma unroll
		for (int hs = 0; hs < HS; hs++) {
			const float pmax = ex2_ftz(bm[hs] - m_new[hs]);
			float spv, inv;
			if constexpr (MX) {
				/* OCP: e = floor(log2 p_max) − 2 from the exponent bits, −127 for zero
				 * or subnormal p_max (where the CPU's clamp lands too); c = 1 */
				const int e = max((int)((__float_as_uint(pmax) >> 23) & 0xffu) - 129, -127);
				spv = 1.0f;
				inv = __uint_as_float((uint32_t)(127 - e) << 23);
				sph[hs] = __uint_as_float((uint32_t)(e + 14 + 127) << 23);
			} else {
				const float cp = __fmul_rn(p.c, pmax);
				/* κ = 2 below τ/c (x/2 is x·0.5 exactly), else κ = 6 */
				const uint32_t sp = e4m3_encode((p.underflow && pmax <= p.tau_c) ?
									__fmul_rn(cp, 0.5f) :
									SOFT ? div6_rn(cp) : __fdiv_rn(cp, 6.0f));
				spv = e4m3_decode(sp);
				inv = e4m3_rcp(sp);
			}
			float lsum = 0.0f, qsum = 0.0f;
#pragma unroll
			for (int mt = 0; mt < 2; mt++) {
#pragma unroll
				for (int r = 0; r < 2; r++) {
					/* m_new is finite (a tile has unmasked keys); masked S = −inf → P = 0 */
					const float P = ex2_ftz(__fadd_rn(__fsub_rn(S[mt][hs][r], m_new[hs]),
									  p.log2c));
					lsum = lsum + P;
					const float ph = e2m1_round_pos(__fmul_rn(P, inv));
					Pt[mt][hs][r] = MX ? ph : __fmul_rn(spv, ph);
					qsum = qsum + Pt[mt][hs][r];
				}
			}
			l_run[hs] = alpha[hs] * l_run[hs] + lsum;
			if (p.qmass) {
				/* MXFP4: P̃ = P̂·2^e, the block's scale (sph = 2^(e + 14)) */
				const float pe = MX ? __fmul_rn(sph[hs], 0x1p-14f) : 1.0f;
				q_run[hs] = alpha[hs] * q_run[hs] + __fmul_rn(qsum, pe);
			}
			m_run[hs] = m_new[hs];
		}
		if constexpr (HS == 1) {
#pragma unroll
			for (int mt = 0; mt < 2; mt++)
				Pt[mt][1][0] = Pt[mt][1][1] = 0.0f;
			sph[1] = 0.0f;
		}

		/* O^T += Ṽ^T P̃^T. o is kept in units of this page's g_V·2^14 (the K and V operands
		 * carry 2^-14): rescaling it by α·g_prev/g_cur first lets the MMAs accumulate the
		 * page's sum into it, and g_V is applied once per page as NUMERICS.md §6 says. */
		uint32_t bfr[2][2];
#pragma unroll
		for (int mt = 0; mt < 2; mt++)
#pragma unroll
			for (int r = 0; r < 2; r++)
				bfr[mt][r] = movmatrix_t(f2_to_h2(Pt[mt][0][r], Pt[mt][1][r]));
		/* a garbage page (flagged id) must not turn o into inf: g ≥ FLT_MIN for real pages
		 * (MXFP4 keeps o in absolute units) */
		const float gv2 = MX ? 1.0f : fmaxf(16384.0f * gv, FLT_MIN);
		const float rg = MX ? 1.0f : SOFT ? gv2_prev * rcp_ftz(gv2) : __fdividef(gv2_prev, gv2);
		float fct[2];
#pragma unroll
		for (int hs = 0; hs < 2; hs++)
			fct[hs] = alpha[HS == 2 ? hs : 0] * rg;
		gv2_prev = gv2;
#pragma unroll
		for (int mc = 0; mc < MC; mc++) {
			const int c0 = 16 * mc + g, c1 = c0 + 8;
			uint32_t a0[4], a1[4];
			if (mc < VPRE) {
#pragma unroll
				for (int j = 0; j < 4; j++) {
					a0[j] = vpre[mc < VPRE ? mc : 0][0][j];
					a1[j] = vpre[mc < VPRE ? mc : 0][1][j];
				}
			} else {
				v_operand(mc, a0, a1);
			}
			float acc[4] = { 0.0f, 0.0f, 0.0f, 0.0f };
			if constexpr (!MX) {
#pragma unroll
				for (int e = 0; e < 4; e++)
					o[mc][e] = o[mc][e] * fct[e & 1];
			}
#pragma unroll
			for (int ks2 = 0; ks2 < 2; ks2++) {
				const uint32_t a[4] = { a0[2 * ks2], a1[2 * ks2], a0[2 * ks2 + 1],
							a1[2 * ks2 + 1] };
				mma_f16(MX ? acc : o[mc], a, bfr[ks2][0], bfr[ks2][1]);
			}
			if constexpr (MX) {
				/* V scales [d][4]: channel c's block of the warp's tokens is byte 4c + w;
				 * element e: channel c0 (e < 2) or c1, head column e & 1 */
				const float sv0 = ue8m0_f32(vs[c0 * 4 + warp]);
				const float sv1 = ue8m0_f32(vs[c1 * 4 + warp]);
#pragma unroll
				for (int e = 0; e < 4; e++)
					o[mc][e] = __fmaf_rn(acc[e], (e < 2 ? sv0 : sv1) * sph[e & 1],
							     o[mc][e] * fct[e & 1]);
			}
		}
	}

	[[maybe_unused]] int next = 0; /* PER: the claimed item, in thread 0 */
	if constexpr (PER) {
		if (tid == 0)
			next = claim_item(p); /* used after the partial's write and the combine */
	}
	/* ---- the four warps' partial sums (same m) → this split's normalized partial ---- */
	__syncthreads(); /* all stages consumed: reuse them */
	float *redo = (float *)smem;
#pragma unroll
	for (int hs = 0; hs < 2; hs++) {
		float l = hs < HS ? l_run[hs] : 0.0f;
		l = l + __shfl_xor_sync(0xffffffffu, l, 4);
		l = l + __shfl_xor_sync(0xffffffffu, l, 8);
		l = l + __shfl_xor_sync(0xffffffffu, l, 16);
		float lq = hs < HS ? q_run[hs] : 0.0f;
		lq = lq + __shfl_xor_sync(0xffffffffu, lq, 4);
		lq = lq + __shfl_xor_sync(0xffffffffu, lq, 8);
		lq = lq + __shfl_xor_sync(0xffffffffu, lq, 16);
		const int hd = MODE == 0 ? 2 * t + hs : 4 * hs + t;
		if (g == 0) {
			rm[warp * 8 + hd] = hs < HS ? m_run[hs] : -INFINITY;
			rl[warp * 8 + hd] = l;
			red[warp * 8 + hd] = lq; /* the block maxima's buffer is free after the loop */
		}
	}
#pragma unroll
	for (int mc = 0; mc < MC; mc++)
#pragma unroll
		for (int e = 0; e < 4; e++) {
			const int hd = MODE == 0 ? 2 * t + (e & 1) : 4 * (e & 1) + t;
			redo[(warp * 8 + hd) * D + 16 * mc + g + 8 * (e >> 1)] = o[mc][e] * gv2_prev;
		}
	__syncthreads();
	write_partial<D>(p, b, h, s, redo, rm, rl, p.log2c, p.qmass ? red : nullptr);
	finish_group<D>(p, b, h, smem);
	if constexpr (PER) {
		/* every thread's generic accesses to the stages precede the next item's bulk
		 * copies; every wait on the barriers is done */
		if (tid == 0) {
			*claim = next;
			/* stage k was waited on c_k times (pages k, k + STAGES, … below np): an odd
			 * c_k gets one more phase, completed by an arrival without bytes, so every
			 * barrier is at even parity again and the next item's waits on parity
			 * (i / STAGES) & 1 hold without re-initialising anything */
			for (int k = 0; k < STAGES && k < np; k++)
				if ((((np - 1 - k) / STAGES) & 1) == 0)
					mbar_arrive(&bar[k]);
		}
		if (SPLIT && (np & 1)) /* the tile-maximum barrier, phase i per page */
			mbar_arrive(&bar[STAGES]);
		fence_proxy_async();
		__syncthreads();
	}
}

template <int D, int MODE, bool MX>
__global__ void __launch_bounds__(THREADS, fp4_min_ctas(D, MODE, MX))
	fp4_decode_kernel(const DecodeParams p)
{
	using C = Fp4Cfg<D>;
	extern __shared__ __align__(128) uint8_t smem[];
	const int s = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
	if (s == p.NS) {
		bf16_partial<D, 2 * D>(p, b, h, smem, (float *)(smem + C::RM_OFF),
				       (float *)(smem + C::RL_OFF));
		return;
	}
	fp4_split<D, MODE, MX, false>(p, b, h, s, nullptr);
}

/* The persistent form for small batches (BD_PERSIST): gridDim.x CTAs, all resident, take the
 * n_items = B·Hkv·(NS + 1) work items of fp4_decode_kernel's grid in the order: the splits of
 * every (b, h), (b·Hkv + h)·NS + s, then the BF16 partials, b·Hkv + h; CTA c starts with item c
 * and claims the next free one when it is done with an item's pages or rows (before the
 * partial's write and the combine). The longest items go first and the BF16 partials fill the
 * slots that splits leave, instead of a wave of their own. Each item computes exactly what its
 * CTA in fp4_decode_kernel computes, and the last of a group's NS + 1 items combines, so the
 * results are the same bits whatever the CTA count. No CTA waits for another. */
template <int D, int MODE, bool MX>
__global__ void __launch_bounds__(THREADS, fp4_min_ctas(D, MODE, MX))
	fp4_decode_kernel_persist(const DecodeParams p)
{
	using C = Fp4Cfg<D>;
	extern __shared__ __align__(128) uint8_t smem[];
	__shared__ int claim;
	float *rm = (float *)(smem + C::RM_OFF), *rl = (float *)(smem + C::RL_OFF);
	const int nsp = p.n_bh * p.NS;
	/* the page path's barriers live across items: each split item leaves them at even parity */
	fp4_bars_init<C::STAGES, fp4_split_barrier(MODE)>((uint64_t *)(smem + C::BAR_OFF));
	__syncthreads();
	int j = blockIdx.x;
	while (j < p.n_items) {
		const int bh = j < nsp ? j / p.NS : j - nsp;
		if (j < nsp) {
			const int s = j - bh * p.NS;
			fp4_split<D, MODE, MX, true>(p, bh / p.Hkv, bh % p.Hkv, s, &claim);
		} else {
			const int b = bh / p.Hkv, h = bh % p.Hkv;
			bf16_partial<D, 2 * D, true>(p, b, h, smem, rm, rl, &claim);
			fence_proxy_async(); /* its generic writes precede the next bulk copies */
			__syncthreads();
		}
		j = claim;
		__syncthreads(); /* every thread has read it before the next item claims again */
	}
	/* the run's last claim: none can follow it, so the counter is zeroed for the next run */
	if (threadIdx.x == 0 && j == (int)gridDim.x + p.n_items - 1)
		atomicExch(p.sched, 0);
}

/* ---- the BF16 page path (the in-house baseline) ----------------------------------------------- */

/* The start of a kernel whose splits stream BF16 rows (the BF16 and the channel-blocked NVFP4
 * paths; C its shared-memory layout: ROWB, IDS_OFF, MAX_IDS, RM_OFF, RL_OFF): the CTA with
 * blockIdx.x = NS runs the BF16 partial and gets false; a split CTA gets its pages in *ret and
 * its first page ids in shared memory, published by a __syncthreads. */
template <int D, class C>
__device__ __forceinline__ bool rows_split_begin(const DecodeParams &p, uint8_t *smem, Split *ret)
{
	if (blockIdx.x == p.NS) {
		bf16_partial<D, C::ROWB>(p, blockIdx.z, blockIdx.y, smem, (float *)(smem + C::RM_OFF),
					 (float *)(smem + C::RL_OFF));
		return false;
	}
	*ret = split_pages(p, blockIdx.z, blockIdx.y, blockIdx.x, (int32_t *)(smem + C::IDS_OFF),
			   C::MAX_IDS);
	__syncthreads();
	return true;
}

/* Shared memory of a BF16-row kernel after its main region of MAIN bytes: q' BF16 [8][D]
 * (AUX_BYTES), page ids [MAX_IDS], then the warps' m and ℓ [WARPS][8] each. */
template <int MAIN>
struct RowsTail {
	static constexpr int MAX_IDS = 512;
	static constexpr int AUX_OFF = MAIN;
	static constexpr int IDS_OFF = AUX_OFF + AUX_BYTES;
	static constexpr int RM_OFF = IDS_OFF + MAX_IDS * 4;
	static constexpr int RL_OFF = RM_OFF + WARPS * 8 * 4;
	static constexpr int SMEM = RL_OFF + WARPS * 8 * 4;
};

template <int D, bool SMALL>
struct Bf16Main {
	static constexpr int ROWB = 2 * D + 16; /* padded rows: conflict-free ldmatrix */
	static constexpr int STAGES = SMALL ? 2 : 3;
	static constexpr int STAGE_BYTES = 2 * BD_PAGE_TOKENS * ROWB;
	static constexpr int PART_BYTES = 2 * PARTIAL_ROWS * ROWB;
	static constexpr int MAIN = STAGES * STAGE_BYTES > PART_BYTES ? STAGES * STAGE_BYTES : PART_BYTES;
};

template <int D, bool SMALL = BDK_SMALL_SMEM>
struct Bf16Cfg : Bf16Main<D, SMALL>, RowsTail<Bf16Main<D, SMALL>::MAIN> {
};

template <int D>
__global__ void __launch_bounds__(THREADS, 1) bf16_decode_kernel(const DecodeParams p)
{
	using C = Bf16Cfg<D>;
	constexpr int ROWB = C::ROWB, STAGES = C::STAGES, CPR = 2 * D / 16;
	extern __shared__ __align__(128) uint8_t smem[];
	uint8_t *aux = smem + C::AUX_OFF;
	const int32_t *ids = (const int32_t *)(smem + C::IDS_OFF);
	Split sp;
	if (!rows_split_begin<D, C>(p, smem, &sp))
		return;
	const int tid = threadIdx.x, warp = tid >> 5, h = blockIdx.y, b = blockIdx.z;
	const int np = sp.np;
	const int32_t *bt = sp.bt;
	/* every thread copies 16-byte pieces of the page-head's K and V rows into padded rows */
	auto issue = [&](int i, int stg) {
		if (i < np) {
			const int32_t id = i < C::MAX_IDS ? ids[i] : checked_page(p, bt[i]);
			const uint8_t *src = p.arena + (size_t)id * p.page_bytes + (size_t)h * p.head_bytes;
			uint8_t *dst = smem + (size_t)stg * C::STAGE_BYTES;
			for (int e = tid; e < 2 * BD_PAGE_TOKENS * CPR; e += THREADS) {
				const int which = e / (BD_PAGE_TOKENS * CPR), rem = e % (BD_PAGE_TOKENS * CPR);
				const int r = rem / CPR, c = rem % CPR;
				cp_async16(dst + (size_t)(which * BD_PAGE_TOKENS + r) * ROWB + c * 16,
					   src + (which ? p.v_codes_off : p.k_codes_off) + (size_t)r * 2 * D + c * 16);
			}
		}
		cp_async_commit(); /* an empty group keeps the count */
	};
	for (int i = 0; i < STAGES - 1; i++)
		issue(i, i);
	__nv_bfloat16 *qbf = (__nv_bfloat16 *)aux;
	uint32_t qb[D / 16][2];
	bf16_query_frag<D>(p, b, h, qbf, qb);

	Bf16State<D> st;
	st.reset();
	for (int i = 0; i < np; i++) {
		cp_async_wait<STAGES - 2>();
		__syncthreads(); /* page i landed for everyone; page i-1's stage is free */
		issue(i + STAGES - 1, (i + STAGES - 1) % STAGES);
		const uint8_t *Ks = smem + (size_t)(i % STAGES) * C::STAGE_BYTES;
		const uint8_t *Vs = Ks + (size_t)BD_PAGE_TOKENS * ROWB;
		bf16_tile16<D, ROWB>(Ks, Vs, 32 * warp, 16, qb, p.gamma, st);
		bf16_tile16<D, ROWB>(Ks, Vs, 32 * warp + 16, 16, qb, p.gamma, st);
	}
	bf16_split_end<D>(p, blockIdx.z, blockIdx.y, blockIdx.x, st, smem,
			  (float *)(smem + C::RM_OFF), (float *)(smem + C::RL_OFF));
}

/* ---- the channel-blocked NVFP4 page path (trtllm-nvfp4) --------------------------------------- */

/* K and V are both token-major NVFP4 (16-channel blocks, E4M3 scales, g_K and g_V per page-head),
 * the query BF16 and P FP32 (NUMERICS.md §9): the BF16 paged path with a tile loader that
 * expands the codes. Warp w owns tokens 32w..32w+31 of every page, as in the BF16 path, so it
 * streams its own slice of each page-head (K and V codes and scales, and the decode scales)
 * into private buffers, STAGES deep, and expands 16 tokens at a time into private BF16 rows:
 * no CTA barrier in the main loop, and the four warps' expansions overlap each other's MMAs.
 * Layout of a warp's region: STAGES × raw [K codes 32·D/2][K scales 32·D/16][V codes][V scales]
 * [g: 16 bytes], then K [16][ROWB] and V [16][ROWB] BF16. */
template <int D, bool SMALL>
struct ChMain {
	static constexpr int ROWB = 2 * D + 16; /* padded rows: conflict-free ldmatrix */
	static constexpr int STAGES = D == 128 && !SMALL ? 4 : 3;
	static constexpr int CODES = 32 * D / 2;  /* a warp's K (V) codes per page */
	static constexpr int SCALES = 32 * D / 16;
	static constexpr int G_OFF = 2 * (CODES + SCALES);
	static constexpr int RAW = G_OFF + 16;
	static constexpr int PIECES = RAW / 16; /* 16-byte copies per stage */
	static constexpr int TILE_OFF = STAGES * RAW;
	static constexpr int WARP_BYTES = TILE_OFF + 2 * 16 * ROWB;
	static constexpr int PART_BYTES = 2 * PCHUNK * ROWB + 8 * D * 2; /* BF16 partial */
	static constexpr int MAIN = WARPS * WARP_BYTES > PART_BYTES ? WARPS * WARP_BYTES : PART_BYTES;
	static_assert(RAW % 16 == 0 && WARP_BYTES % 16 == 0, "16-byte aligned buffers");
};

template <int D, bool SMALL = BDK_SMALL_SMEM>
struct ChCfg : ChMain<D, SMALL>, RowsTail<ChMain<D, SMALL>::MAIN> {
};

/* Rows r0..r0+15 of a warp's raw token-major NVFP4 (codes [32][D/2], scales [32][D/16]) to
 * BF16 rows dst [16][ROWB] of s·x̂·2^-14: a word of 8 codes lies in one block; E2M1 × E4M3 is
 * exact in FP16 (fp4x8_h2), and the exact FP16 values convert exactly to FP32 and BF16. */
template <int D, int ROWB>
__device__ __forceinline__ void ch_expand16(const uint8_t *codes, const uint8_t *scales, int r0,
					    uint8_t *dst)
{
	constexpr int WPR = D / 8; /* words per row */
	const int lane = threadIdx.x & 31;
#pragma unroll
	for (int j = 0; j < 16 * WPR / 32; j++) {
		const int e = lane + 32 * j, row = e / WPR, wi = e % WPR;
		const uint32_t w = *(const uint32_t *)(codes + (r0 + row) * (D / 2) + 4 * wi);
		const uint32_t sb = scales[(r0 + row) * (D / 16) + (wi >> 1)];
		const uint32_t sc = e4m3x2_to_h2(sb | (sb << 8));
		uint32_t a[4];
		float f[8];
		fp4x8_h2(w, a); /* a[J] = (code J, code J + 4) */
#pragma unroll
		for (int J = 0; J < 4; J++) {
			const uint32_t m = hmul2(a[J], sc);
			f[J] = __half2float(__ushort_as_half((unsigned short)(m & 0xffffu)));
			f[J + 4] = __half2float(__ushort_as_half((unsigned short)(m >> 16)));
		}
		uint4 o;
		o.x = f2_to_bf2(f[0], f[1]);
		o.y = f2_to_bf2(f[2], f[3]);
		o.z = f2_to_bf2(f[4], f[5]);
		o.w = f2_to_bf2(f[6], f[7]);
		*(uint4 *)(dst + (size_t)row * ROWB + 16 * wi) = o;
	}
}

template <int D>
__global__ void __launch_bounds__(THREADS, D == 128 ? 2 : 4) ch_decode_kernel(const DecodeParams p)
{
	using C = ChCfg<D>;
	constexpr int ROWB = C::ROWB, STAGES = C::STAGES;
	extern __shared__ __align__(128) uint8_t smem[];
	Split sp;
	if (!rows_split_begin<D, C>(p, smem, &sp))
		return;
	const int32_t *ids = (const int32_t *)(smem + C::IDS_OFF), *bt = sp.bt;
	const int h = blockIdx.y, b = blockIdx.z, np = sp.np;
	const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

	uint8_t *wbuf = smem + (size_t)warp * C::WARP_BYTES;
	uint8_t *Kt = wbuf + C::TILE_OFF, *Vt = Kt + 16 * ROWB;
	/* the warp's lanes copy its slice of page i into stage i % STAGES; one commit group per
	 * call (empty past the split's end) keeps the wait counts uniform */
	auto issue = [&](int i) {
		if (i < np) {
			const int32_t id = i < C::MAX_IDS ? ids[i] : checked_page(p, bt[i]);
			const uint8_t *pg = p.arena + (size_t)id * p.page_bytes;
			const uint8_t *hd = pg + (size_t)h * p.head_bytes;
			uint8_t *dst = wbuf + (size_t)(i % STAGES) * C::RAW;
			constexpr int NC = C::CODES / 16, NSC = C::SCALES / 16;
			for (int e = lane; e < C::PIECES; e += 32) {
				const uint8_t *src;
				if (e < NC)
					src = hd + p.k_codes_off + warp * C::CODES + 16 * e;
				else if (e < NC + NSC)
					src = hd + p.k_scales_off + warp * C::SCALES + 16 * (e - NC);
				else if (e < 2 * NC + NSC)
					src = hd + p.v_codes_off + warp * C::CODES + 16 * (e - NC - NSC);
				else if (e < 2 * (NC + NSC))
					src = hd + p.v_scales_off + warp * C::SCALES + 16 * (e - 2 * NC - NSC);
				else /* {g_K, g_V} of heads h & ~1 and h | 1 */
					src = pg + p.gscale_off + (size_t)(h & ~1) * 8;
				cp_async16(dst + 16 * e, src);
			}
		}
		cp_async_commit();
	};
	for (int i = 0; i < STAGES - 1; i++)
		issue(i);

	/* q' rounded to BF16, then × 2^14 (exact): the expanded K carries 2^-14, so the MMA sums
	 * the reference's products q'·(s·x̂) themselves */
	__nv_bfloat16 *qbf = (__nv_bfloat16 *)(smem + C::AUX_OFF);
	for (int hd = warp; hd < p.G; hd += WARPS) {
		float x[D / 32];
		load_query<D>(p, b, h, hd, x);
#pragma unroll
		for (int i = 0; i < D / 32; i++)
			qbf[hd * D + lane + 32 * i] = __float2bfloat16_rn(
				__bfloat162float(__float2bfloat16_rn(x[i])) * 16384.0f);
	}
	__syncthreads();
	uint32_t qb[D / 16][2];
	bf16_qfrag<D>(qbf, p.G, qb);

	Bf16State<D> st;
	st.reset();
	/* o is kept in units of the current page's g_V·2^14 (V carries 2^-14): rescaled by
	 * g_prev/g_cur when a page starts, so the MMAs add the page's P̃·ŝv and g_V is applied
	 * per page as NUMERICS.md §6 says. Garbage g of a flagged page id is clamped so that o
	 * stays finite (real pages have g ≥ FLT_MIN). */
	float gv_prev = 1.0f;
	for (int i = 0; i < np; i++) {
		cp_async_wait<STAGES - 2>();
		__syncwarp(); /* page i landed for the warp; the stage of page i-1 is free */
		issue(i + STAGES - 1);
		const uint8_t *raw = wbuf + (size_t)(i % STAGES) * C::RAW;
		const float *gp = (const float *)(raw + C::G_OFF) + (h & 1) * 2;
		const float gk = gp[0], gv = fmaxf(gp[1], FLT_MIN);
		const float rg = i == 0 ? 1.0f : gv_prev / gv;
		gv_prev = gv;
#pragma unroll
		for (int mc = 0; mc < D / 16; mc++)
#pragma unroll
			for (int e = 0; e < 4; e++)
				st.o[mc][e] = st.o[mc][e] * rg;
#pragma unroll 1
		for (int half = 0; half < 2; half++) {
			ch_expand16<D, ROWB>(raw, raw + C::CODES, 16 * half, Kt);
			ch_expand16<D, ROWB>(raw + C::CODES + C::SCALES, raw + 2 * C::CODES + C::SCALES,
					     16 * half, Vt);
			__syncwarp();
			bf16_tile16<D, ROWB, true>(Kt, Vt, 0, 16, qb, p.gamma, st, gk);
			__syncwarp(); /* the rows are read before the next half overwrites them */
		}
	}
#pragma unroll
	for (int mc = 0; mc < D / 16; mc++)
#pragma unroll
		for (int e = 0; e < 4; e++)
			st.o[mc][e] = (st.o[mc][e] * 16384.0f) * gv_prev;
	bf16_split_end<D>(p, blockIdx.z, blockIdx.y, blockIdx.x, st, smem,
			  (float *)(smem + C::RM_OFF), (float *)(smem + C::RL_OFF));
}

/* ---- host side ------------------------------------------------------------------------------- */

typedef void (*kern_t)(DecodeParams);

/* small: the device's shared memory is sm_120's (BDK_SMALL_SMEM in its code) */
static kern_t pick_kernel(int kind, int d, int mode, bool small, int *ret_smem)
{
	if (kind == 2) {
		*ret_smem = d == 128 ? (small ? Bf16Cfg<128, true>::SMEM : Bf16Cfg<128, false>::SMEM) :
				       (small ? Bf16Cfg<64, true>::SMEM : Bf16Cfg<64, false>::SMEM);
		return d == 128 ? bf16_decode_kernel<128> : bf16_decode_kernel<64>;
	}
	if (kind == 4) {
		*ret_smem = d == 128 ? (small ? ChCfg<128, true>::SMEM : ChCfg<128, false>::SMEM) :
				       (small ? ChCfg<64, true>::SMEM : ChCfg<64, false>::SMEM);
		return d == 128 ? ch_decode_kernel<128> : ch_decode_kernel<64>;
	}
	*ret_smem = d == 128 ? Fp4Cfg<128>::SMEM : Fp4Cfg<64>::SMEM;
	if (kind == 3) {
		if (d == 128)
			return mode == 0 ? fp4_decode_kernel<128, 0, true> :
			       mode == 1 ? fp4_decode_kernel<128, 1, true> : fp4_decode_kernel<128, 2, true>;
		return mode == 0 ? fp4_decode_kernel<64, 0, true> :
		       mode == 1 ? fp4_decode_kernel<64, 1, true> : fp4_decode_kernel<64, 2, true>;
	}
	if (d == 128)
		return mode == 0 ? fp4_decode_kernel<128, 0, false> :
		       mode == 1 ? fp4_decode_kernel<128, 1, false> : fp4_decode_kernel<128, 2, false>;
	return mode == 0 ? fp4_decode_kernel<64, 0, false> :
	       mode == 1 ? fp4_decode_kernel<64, 1, false> : fp4_decode_kernel<64, 2, false>;
}

#if BD_PERSIST
static kern_t pick_persist(int kind, int d, int mode)
{
	if (kind == 3) {
		if (d == 128)
			return mode == 0 ? fp4_decode_kernel_persist<128, 0, true> :
			       mode == 1 ? fp4_decode_kernel_persist<128, 1, true> :
					   fp4_decode_kernel_persist<128, 2, true>;
		return mode == 0 ? fp4_decode_kernel_persist<64, 0, true> :
		       mode == 1 ? fp4_decode_kernel_persist<64, 1, true> :
				   fp4_decode_kernel_persist<64, 2, true>;
	}
	if (d == 128)
		return mode == 0 ? fp4_decode_kernel_persist<128, 0, false> :
		       mode == 1 ? fp4_decode_kernel_persist<128, 1, false> :
				   fp4_decode_kernel_persist<128, 2, false>;
	return mode == 0 ? fp4_decode_kernel_persist<64, 0, false> :
	       mode == 1 ? fp4_decode_kernel_persist<64, 1, false> :
			   fp4_decode_kernel_persist<64, 2, false>;
}
#endif

/* G ≤ 4 always uses the stacked layout (one head per thread); with one query term the
 * second term's columns are zero. G > 4 with one term fits one column tile (two heads per
 * thread); with two terms it takes two. */
static int plan_mode(const struct bd_decode_plan *pl)
{
	return pl->G <= 4 ? 1 : pl->nterms == 1 ? 0 : 2;
}

/* Every FP32 x in [0, 8] (c·p_max with c ≤ 8): div6_rn(x) against __fdiv_rn(x, 6) — the same
 * bits for x ≥ 2^-125, the same E4M3 code below. */
__global__ void div6_exhaustive_kernel(unsigned long long *mismatch, unsigned int *first)
{
	const uint32_t hi = 0x41000000u; /* 8.0f */
	const uint32_t stride = gridDim.x * blockDim.x;
	unsigned long long bad = 0;
	for (uint32_t u = blockIdx.x * blockDim.x + threadIdx.x; u <= hi; u += stride) {
		const float x = __uint_as_float(u), a = div6_rn(x), b = __fdiv_rn(x, 6.0f);
		const bool same = u >= 0x01000000u ? __float_as_uint(a) == __float_as_uint(b) :
						     e4m3_encode(a) == e4m3_encode(b);
		if (!same) {
			bad++;
			atomicMin(first, u);
		}
	}
	if (bad)
		atomicAdd(mismatch, bad);
}

/* c_rcp from the host's IEEE divisions (once per process and device) */
static int rcp_table_init(void)
{
	float t[16];
	for (int m = 0; m < 8; m++) {
		t[m] = 1.0f / (1.0f + (float)m / 8.0f);
		t[8 + m] = m == 0 ? 0.0f : (1.0f / (float)m) * 512.0f;
	}
	return cuda_err(cudaMemcpyToSymbol(c_rcp, t, sizeof(t)));
}

} // namespace bdk

using namespace bdk;

/* Whether the plan launches the persistent kernel for ns splits of per pages over work
 * (request, KV head) groups: B ≤ 16, the persistent kernel as resident as the grid kernel
 * (occ_p, occ CTAs per SM; occ_p < 0 where the build or the page format has none), the splits in
 * one wave of slots CTAs, the partials' CTAs overflowing it, and the free slots able to run the
 * partials (about 4 pages each) while the splits run. */
static bool persist_fits(int B, int occ, int occ_p, long long slots, long long work, int ns,
			 long long per)
{
	const long long sw = (work * ns + slots - 1) / slots;
	const long long aw = (work * (ns + 1) + slots - 1) / slots;
	return BD_PERSIST && occ_p == occ && B <= 16 && sw == 1 && aw > sw &&
	       (slots - work * ns) * per >= 4 * work;
}

extern "C" int bd_decode_plan_init_hopper(struct bd_decode_plan *ret, const struct bd_kvcfg *cfg,
					  const struct bd_layout *lay,
					  const struct bd_decode_params *dp, int B, int Hq,
					  int max_tokens, int n_splits)
{
	struct bd_decode_plan pl;
	struct bd_decode_params dflt = bd_decode_params_default();

	if (!ret || !cfg || !lay || B < 1 || Hq < 1 || max_tokens < 1 || n_splits < 0)
		return -EINVAL;
	dflt.tile_keys = BD_KERNEL_TILE_KEYS;
	if (!dp)
		dp = &dflt;
	if (dp->tile_keys != BD_KERNEL_TILE_KEYS || !isfinite(dp->c) || !(dp->c > 0.0f) ||
	    !isfinite(dp->tau) || !(dp->tau >= 0.0f) || !isfinite(dp->softmax_scale) ||
	    dp->softmax_scale < 0.0f)
		return -EINVAL;
	if (lay->fmt != cfg->page_fmt || lay->n_kv_heads < 1 || Hq % lay->n_kv_heads != 0)
		return -EINVAL;
	if (lay->d_rope != 0 || (lay->d != 64 && lay->d != 128))
		return -EOPNOTSUPP;
	if (cfg->page_fmt == BD_PAGE_NVFP4) {
		if (cfg->query_terms != 1 && cfg->query_terms != 2)
			return -EOPNOTSUPP;
		if (cfg->p_quant != BD_P_NVFP4_MAX6 && cfg->p_quant != BD_P_NVFP4_UNDERFLOW)
			return -EOPNOTSUPP;
	} else if (cfg->page_fmt == BD_PAGE_MXFP4) {
		if (cfg->query_terms != 1 && cfg->query_terms != 2)
			return -EOPNOTSUPP;
		if (cfg->p_quant != BD_P_MXFP4)
			return -EOPNOTSUPP;
	} else if (cfg->page_fmt == BD_PAGE_BF16) {
		if (cfg->p_quant != BD_P_FP32)
			return -EOPNOTSUPP;
	} else if (cfg->page_fmt == BD_PAGE_NVFP4_CH) {
		/* trtllm-nvfp4: FP32 P, and no sink (its page copy is not masked on this path) */
		if (cfg->p_quant != BD_P_FP32 || cfg->sink)
			return -EOPNOTSUPP;
	} else {
		return -EOPNOTSUPP;
	}
	memset(&pl, 0, sizeof(pl));
	pl.B = B;
	pl.Hq = Hq;
	pl.Hkv = lay->n_kv_heads;
	pl.G = Hq / lay->n_kv_heads;
	pl.d = lay->d;
	if (pl.G < 1 || pl.G > BD_KERNEL_MAX_G)
		return -EOPNOTSUPP;
	pl.kind = cfg->page_fmt == BD_PAGE_NVFP4 ? 1 : cfg->page_fmt == BD_PAGE_MXFP4 ? 3 :
		  cfg->page_fmt == BD_PAGE_NVFP4_CH ? 4 : 2;
	pl.nterms = pl.kind == 1 || pl.kind == 3 ? cfg->query_terms : 0;
	pl.sink = cfg->sink;
	pl.hadamard = cfg->hadamard;
	pl.underflow = cfg->p_quant == BD_P_NVFP4_UNDERFLOW;
	/* with FP32 P the quantized mass is ℓ itself: only FP4 P needs the second sum */
	pl.qmass = cfg->p_norm == BD_NORM_QMASS && (pl.kind == 1 || pl.kind == 3);
	pl.c = pl.underflow ? dp->c : 1.0f;
	pl.log2c = pl.underflow ? log2f(dp->c) : 0.0f;
	pl.tau = dp->tau;
	{
		float scale = dp->softmax_scale != 0.0f ? dp->softmax_scale :
							  1.0f / sqrtf((float)lay->d);
		pl.gamma = 1.4426950408889634f * scale; /* as attn_ref.c's γ */
	}
	/* the kernels assume the NVFP4 / MXFP4 / BF16 geometry of bd_layout_init */
	{
		size_t hb = (size_t)lay->d *
			    (pl.kind == 1 || pl.kind == 4 ? 144 : pl.kind == 3 ? 136 : 512);
		if (lay->head_bytes != hb || lay->gscale_off % 16 != 0 ||
		    lay->gscale_off + 16 * (size_t)((lay->n_kv_heads + 1) / 2) > lay->page_bytes ||
		    lay->page_bytes % 128 != 0 || lay->k_codes_off % 16 || lay->v_codes_off % 16 ||
		    lay->k_scales_off % 16 || lay->v_scales_off % 16)
			return -EINVAL;
	}
	pl.max_tokens = max_tokens;
	pl.bt_stride = (max_tokens - 1) / BD_PAGE_TOKENS;
	pl.tile_keys = BD_KERNEL_TILE_KEYS;
	pl.lay = *lay;

	int dev = 0, sms = 0, occ = 0, major = 0, optin = 0;
	BDK_TRY(cudaGetDevice(&dev));
	BDK_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
	BDK_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
	BDK_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
	kern_t k = pick_kernel(pl.kind, pl.d, plan_mode(&pl), major >= 12, &pl.smem_bytes);
	if (pl.smem_bytes > optin)
		return -EOPNOTSUPP; /* BF16 pages at d = 128 on sm_120: two stages exceed 99 KB */
	BDK_TRY(cudaFuncSetAttribute((const void *)k, cudaFuncAttributeMaxDynamicSharedMemorySize,
				     pl.smem_bytes));
	{
		int r = rcp_table_init();
		if (r < 0)
			return r;
	}
	BDK_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, (const void *)k, THREADS,
							      (size_t)pl.smem_bytes));
	if (occ < 1)
		return -EOPNOTSUPP;

	const int pages = pl.bt_stride;
	if (n_splits > 1024)
		return -EINVAL;
	/* the persistent kernel's occupancy, for persist_fits (it runs the same work items with the
	 * same results; a partial, 144 rows in three dependent loads, takes about as long as 4
	 * pages of a split at full occupancy) */
	const long long slots = (long long)sms * occ, work = (long long)B * pl.Hkv;
	int occ_p = -1;
#if BD_PERSIST
	if (pl.kind == 1 || pl.kind == 3) {
		kern_t kp = pick_persist(pl.kind, pl.d, plan_mode(&pl));
		BDK_TRY(cudaFuncSetAttribute((const void *)kp,
					     cudaFuncAttributeMaxDynamicSharedMemorySize,
					     pl.smem_bytes));
		BDK_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ_p, (const void *)kp,
								      THREADS,
								      (size_t)pl.smem_bytes));
	}
#endif
	if (n_splits > 0) {
		pl.n_splits = n_splits;
	} else if (pages <= 1) {
		pl.n_splits = 1;
	} else {
		/* split-KV by bytes: whole waves of equal splits, each split's start (prologue and
		 * pipeline fill, about 6 pages) counted as work, and the combine's latency per split
		 * (about a quarter page); with BD_PLAN_TAIL, partials that overflow the last wave
		 * of the grid kernel delay the CTAs left over by one partial (4 pages and a start)
		 * or one split, whichever ends first */
		const int min_ns = pl.kind == 1 || pl.kind == 3 ? (pages + MAXIDS - 1) / MAXIDS : 1;
		long long best = -1;
		int best_ns = min_ns;
		for (int ns = min_ns; ns <= pages && ns <= 1024; ns++) {
			long long waves = (work * ns + slots - 1) / slots;
			long long per = (pages + ns - 1) / ns;
			long long cost = 4 * waves * (per + 6) + ns;
#if BD_PLAN_TAIL
			if (work * (ns + 1) > waves * slots &&
			    !persist_fits(B, occ, occ_p, slots, work, ns, per))
				cost += 4 * (per + 6 < 10 ? per + 6 : 10);
#endif
			if (best < 0 || cost < best) {
				best = cost;
				best_ns = ns;
			}
		}
		pl.n_splits = best_ns;
	}
	pl.grid_ctas = B * pl.Hkv * (pl.n_splits + 1);
	pl.persist_ctas = 0;
	if (persist_fits(B, occ, occ_p, slots, work, pl.n_splits,
			 (pages + pl.n_splits - 1) / pl.n_splits))
		pl.persist_ctas = (int)(slots < pl.grid_ctas ? slots : pl.grid_ctas);
	{
		size_t parts = (size_t)B * pl.Hkv * (size_t)(pl.n_splits + 1) * pl.G;
		size_t o_bytes = parts * (size_t)pl.d * sizeof(float);
		pl.ws_lse_off = (o_bytes + BD_KERNEL_ALIGN - 1) / BD_KERNEL_ALIGN * BD_KERNEL_ALIGN;
		pl.ws_cnt_off = (pl.ws_lse_off + parts * sizeof(float) + BD_KERNEL_ALIGN - 1) /
				BD_KERNEL_ALIGN * BD_KERNEL_ALIGN;
		pl.ws_bytes = pl.ws_cnt_off + ((size_t)B * pl.Hkv + 1) * sizeof(int);
	}
	*ret = pl;
	return 0;
}

extern "C" int bd_decode_run_hopper(const struct bd_decode_plan *pl,
				    const struct bd_decode_args *a, void *stream)
{
	if (!pl || !a || pl->kind < 1 || pl->kind > 4)
		return -EINVAL;
	if (!a->q || !a->arena || !a->block_table || !a->seq_lens || !a->slots || !a->out ||
	    !a->workspace)
		return -EINVAL;
	if (((uintptr_t)a->q & 15) || ((uintptr_t)a->out & 15) || ((uintptr_t)a->arena & 127) ||
	    ((uintptr_t)a->workspace & (BD_KERNEL_ALIGN - 1)) || ((uintptr_t)a->block_table & 3) ||
	    ((uintptr_t)a->seq_lens & 3) || ((uintptr_t)a->slots & 7) || ((uintptr_t)a->lse & 3) ||
	    ((uintptr_t)a->status & 3))
		return -EINVAL;
	if (a->layer < 0 || a->layer >= pl->lay.n_layers || a->bt_stride < pl->bt_stride ||
	    a->bt_stride < 0 || pl->persist_ctas < 0)
		return -EINVAL;
	if (pl->persist_ctas > 0 && (!BD_PERSIST || (pl->kind != 1 && pl->kind != 3)))
		return -EOPNOTSUPP;

	DecodeParams p;
	memset(&p, 0, sizeof(p));
	p.q = a->q;
	p.arena = (const uint8_t *)a->arena + (size_t)a->layer * pl->lay.layer_stride;
	p.bt = a->block_table;
	p.seq_lens = a->seq_lens;
	p.slots = a->slots;
	p.ws_o = (float *)a->workspace;
	p.ws_lse = (float *)((uint8_t *)a->workspace + pl->ws_lse_off);
	p.counters = (int *)((uint8_t *)a->workspace + pl->ws_cnt_off);
	p.sched = p.counters + (size_t)pl->B * pl->Hkv;
	p.n_bh = pl->B * pl->Hkv;
	p.n_items = p.n_bh * (pl->n_splits + 1);
	p.out = a->out;
	p.lse = a->lse;
	p.status = a->status;
	p.bt_stride = a->bt_stride;
	p.Hq = pl->Hq;
	p.Hkv = pl->Hkv;
	p.G = pl->G;
	p.NS = pl->n_splits;
	p.sink = pl->sink;
	p.hadamard = pl->hadamard;
	p.underflow = pl->underflow;
	p.qmass = pl->qmass;
	p.nterms = pl->nterms;
	p.gamma = pl->gamma;
	p.c = pl->c;
	p.log2c = pl->log2c;
	p.tau_c = pl->tau / pl->c;
	p.inv_sqrt_d = 1.0f / sqrtf((float)pl->d); /* bd_fwht's scale, the same expression */
	p.head_bytes = (uint32_t)pl->lay.head_bytes;
	p.k_codes_off = (uint32_t)pl->lay.k_codes_off;
	p.k_scales_off = (uint32_t)pl->lay.k_scales_off;
	p.v_codes_off = (uint32_t)pl->lay.v_codes_off;
	p.v_scales_off = (uint32_t)pl->lay.v_scales_off;
	p.gscale_off = (uint32_t)pl->lay.gscale_off;
	p.page_bytes = pl->lay.page_bytes;
	p.n_pages = (int)pl->lay.n_pages;
	p.slot_head_bytes = pl->lay.slot_head_bytes;
	p.slot_head_off = (uint64_t)a->layer * (uint64_t)pl->Hkv * pl->lay.slot_head_bytes;
	p.sink_k_off = (uint32_t)pl->lay.slot_sink_k_off;
	p.sink_v_off = (uint32_t)pl->lay.slot_sink_v_off;
	p.recent_k_off = (uint32_t)pl->lay.slot_recent_k_off;
	p.recent_v_off = (uint32_t)pl->lay.slot_recent_v_off;

	int smem;
	kern_t k = pick_kernel(pl->kind, pl->d, plan_mode(pl), false, &smem);
	cudaStream_t st = (cudaStream_t)stream;
#if BD_PERSIST
	if (pl->persist_ctas > 0) {
		kern_t kp = pick_persist(pl->kind, pl->d, plan_mode(pl));
		kp<<<pl->persist_ctas, THREADS, smem, st>>>(p);
		BDK_TRY(cudaGetLastError());
		return 0;
	}
#endif
	dim3 grid(pl->n_splits + 1, pl->Hkv, pl->B);
	k<<<grid, THREADS, pl->smem_bytes, st>>>(p); /* the plan's: sized for its device */
	BDK_TRY(cudaGetLastError());
	return 0;
}

extern "C" int bd_kernels_div6_exhaustive(uint64_t *ret_mismatch, uint32_t *ret_first)
{
	unsigned long long *dm;
	unsigned int *df;
	unsigned long long m = 0;
	unsigned int f = 0xffffffffu;

	if (!ret_mismatch || !ret_first)
		return -EINVAL;
	BDK_TRY(cudaMalloc((void **)&dm, sizeof(m)));
	int r = cuda_err(cudaMalloc((void **)&df, sizeof(f)));
	if (r == 0)
		r = cuda_err(cudaMemcpy(dm, &m, sizeof(m), cudaMemcpyHostToDevice));
	if (r == 0)
		r = cuda_err(cudaMemcpy(df, &f, sizeof(f), cudaMemcpyHostToDevice));
	if (r == 0) {
		div6_exhaustive_kernel<<<1024, 256>>>(dm, df);
		r = cuda_err(cudaGetLastError());
	}
	if (r == 0)
		r = cuda_err(cudaMemcpy(&m, dm, sizeof(m), cudaMemcpyDeviceToHost));
	if (r == 0)
		r = cuda_err(cudaMemcpy(&f, df, sizeof(f), cudaMemcpyDeviceToHost));
	cudaFree(dm);
	cudaFree(df);
	if (r < 0)
		return r;
	*ret_mismatch = m;
	*ret_first = m ? f : 0;
	return 0;
}

extern "C" int bd_decode_workspace_init(const struct bd_decode_plan *pl, void *workspace,
					void *stream)
{
	if (!pl || !workspace || ((uintptr_t)workspace & (BD_KERNEL_ALIGN - 1)))
		return -EINVAL;
	BDK_TRY(cudaMemsetAsync((uint8_t *)workspace + pl->ws_cnt_off, 0,
				((size_t)pl->B * pl->Hkv + 1) * sizeof(int), (cudaStream_t)stream));
	return 0;
}
