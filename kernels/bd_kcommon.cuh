/* bd_kcommon.cuh — device helpers shared by the kernels: the NUMERICS.md §1–2 encoders and
 * quantizers written with the same FP32 operations as lib/fp4.c (so bytes match the CPU), FP4
 * expansion to FP16, tensor-core and copy-engine wrappers, and the query preparation of §5.
 *
 * Built without fast math and with -fmad=false: every a*b+c below stays two roundings, as in
 * the C code it mirrors. Internal to kernels/; the C API is bd_kernels.h.
 */
#ifndef BD_KCOMMON_CUH
#define BD_KCOMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <float.h>
#include <stdint.h>

#include "bd_cuda_errno.h"

namespace bdk {

/* ---- CUDA errors → -errno ------------------------------------------------------------------ */

/* bd_cuda_errno.h's mapping, and -EINVAL for cudaErrorInvalidValue: the launchers pass their
 * callers' sizes and pointers on to the runtime. */
static inline int cuda_err(cudaError_t e)
{
	return e == cudaErrorInvalidValue ? -EINVAL : bd_cuda_errno_of(e);
}

#define BDK_TRY(call)                                  \
	do {                                           \
		int bdk_r_ = bdk::cuda_err(call);      \
		if (bdk_r_ < 0)                        \
			return bdk_r_;                 \
	} while (0)

/* ---- element formats (NUMERICS.md §1), as lib/fp4.c ------------------------------------------ */

/* E2M1 code of a finite x: sign kept for values rounding to zero. */
__device__ __forceinline__ uint32_t e2m1_encode(float x)
{
	uint32_t sign = (__float_as_uint(x) >> 28) & 8u;
	float a = fabsf(x);
	uint32_t mag = a <= 0.25f ? 0u : a < 0.75f ? 1u : a <= 1.25f ? 2u : a < 1.75f ? 3u :
		       a <= 2.5f ? 4u : a < 3.5f ? 5u : a <= 5.0f ? 6u : 7u;
	return sign | mag;
}

/* E2M1 grid value nearest to a ≥ 0 (the decode of e2m1_encode(a)), for probabilities: adding
 * and subtracting 2^22·2^E (E = a's binade, at least 0) rounds to the grid step of that binade
 * (0.5 below 2, 1 in [2, 4), 2 above) to nearest even, which is E2M1's tie rule; then cap at 6. */
__device__ __forceinline__ float e2m1_round_pos(float a)
{
	uint32_t eb = max(__float_as_uint(a) & 0x7f800000u, 0x3f800000u);
	float C = __uint_as_float(eb + (22u << 23));
	return fminf(__fsub_rn(__fadd_rn(a, C), C), 6.0f);
}

__device__ __forceinline__ float e2m1_decode(uint32_t code)
{
	const uint32_t m = code & 7u;
	/* {0, .5, 1, 1.5, 2, 3, 4, 6} */
	float v = m < 4u ? 0.5f * (float)m : (float)(m == 7u ? 6u : m - 2u);
	return (code & 8u) ? -v : v;
}

/* E4M3 software encoder, operation for operation bd_e4m3_encode. */
__device__ __forceinline__ uint32_t e4m3_encode_soft(float x)
{
	if (isnan(x))
		return 0x7fu;
	uint32_t sign = (__float_as_uint(x) >> 24) & 0x80u;
	float a = fabsf(x);
	if (isinf(a))
		return sign | 0x7eu;
	if (a < 0x1p-6f) {
		int m = (int)rintf(__fmul_rn(a, 512.0f));
		return sign | (uint32_t)m;
	}
	int e;
	float f = frexpf(a, &e);
	e -= 1;
	int m = (int)rintf(__fmul_rn(__fsub_rn(__fmul_rn(f, 2.0f), 1.0f), 8.0f));
	if (m == 8) {
		m = 0;
		e += 1;
	}
	if (e > 8 || (e == 8 && m > 6))
		return sign | 0x7eu;
	return sign | ((uint32_t)(e + 7) << 3) | (uint32_t)m;
}

/* E4M3 by the hardware (sm_89+): round to nearest even, satfinite. */
__device__ __forceinline__ uint32_t e4m3_encode_hw(float x)
{
	uint16_t r;
	asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(x));
	return r & 0xffu;
}

#ifndef BDK_E4M3_HW
#define BDK_E4M3_HW 1
#endif

/* The encoder the kernels use (the gpu test checks both against the CPU). */
__device__ __forceinline__ uint32_t e4m3_encode(float x)
{
#if BDK_E4M3_HW
	return e4m3_encode_hw(x);
#else
	return e4m3_encode_soft(x);
#endif
}

/* RN(x / 6) for finite x ≥ 0 without __fdiv_rn's range check and slow path: q = RN(x·RN(1/6)),
 * the exact remainder x − 6q (one FMA), then RN(q + r·RN(1/6)) (Markstein's correction). The
 * same bits as x / 6 for every FP32 x in [2^-125, 2^127) (checked exhaustively; on the device
 * for [0, 8] by bd_kernels_div6_exhaustive); below 2^-125 the quotient is subnormal and may
 * differ in its last bit, which E4M3 encodes as 0 either way. */
__device__ __forceinline__ float div6_rn(float x)
{
	const float z = 1.0f / 6.0f;
	const float q = __fmul_rn(x, z);
	return __fmaf_rn(__fmaf_rn(-6.0f, q, x), z, q);
}

/* Exact E4M3 decode of a non-NaN code. */
__device__ __forceinline__ float e4m3_decode(uint32_t code)
{
	uint32_t e = (code >> 3) & 0xfu, m = code & 7u;
	float v = e == 0 ? __fmul_rn((float)m, 0x1p-9f) : __uint_as_float(((e + 120u) << 23) | (m << 20));
	return (code & 0x80u) ? -v : v;
}

/* Two E4M3 codes (low byte first) to an FP16 pair, exactly (hardware cvt, sm_89+). */
__device__ __forceinline__ uint32_t e4m3x2_to_h2(uint32_t two)
{
	uint32_t r;
	asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"((uint16_t)two));
	return r;
}

/* ---- block quantizers (NUMERICS.md §2), as lib/fp4.c ----------------------------------------- */

/* NVFP4 decode scale of a page-head from its amax: amax / (6·smax), 1 when not normal. */
__device__ __forceinline__ float nvfp4_g(float amax, float smax)
{
	float g = __fdiv_rn(amax, __fmul_rn(6.0f, smax));
	return g >= FLT_MIN ? g : 1.0f;
}

/* The E2M1 codes of x_i · inv, packed into pk (element i in nibble i % 8 of word i / 8), and
 * the squared reconstruction error Σ (scale·x̂_i − x_i)² accumulated in order i = 0..N−1: one
 * candidate of NUMERICS.md §2, as lib/quant/fp4.c's e2m1_candidate. */
template <int N>
__device__ __forceinline__ float e2m1_candidate(const float (&x)[N], float inv, float scale,
						uint32_t (&pk)[N / 8])
{
	float err = 0.0f;
#pragma unroll
	for (int j = 0; j < N / 8; j++)
		pk[j] = 0;
#pragma unroll
	for (int i = 0; i < N; i++) {
		uint32_t c = e2m1_encode(__fmul_rn(x[i], inv));
		float d = __fsub_rn(__fmul_rn(scale, e2m1_decode(c)), x[i]);
		err = __fadd_rn(err, __fmul_rn(d, d));
		pk[i >> 3] |= (c & 0xfu) << (4 * (i & 7));
	}
	return err;
}

/* One NVFP4 candidate (κ = kappa): packed codes pk[2] (element 2j in the low nibble of byte j),
 * returns Σ ((g·s)·x̂ − x)² accumulated in order i = 0..15. */
__device__ __forceinline__ float nvfp4_candidate(const float (&x)[16], float amax_b, float g,
						 float kappa, uint32_t (&pk)[2], uint32_t *ret_scale)
{
	uint32_t s = e4m3_encode(__fdiv_rn(__fdiv_rn(amax_b, kappa), g));
	float sv = e4m3_decode(s);
	float inv = sv == 0.0f ? 0.0f : __fdiv_rn(1.0f, __fmul_rn(sv, g));
	*ret_scale = s;
	return e2m1_candidate<16>(x, inv, __fmul_rn(g, sv), pk);
}

/* bd_nvfp4_quantize_block: 8 code bytes as pk[2], E4M3 scale code. */
__device__ __forceinline__ void nvfp4_quantize_block(const float (&x)[16], float g, bool search,
						     uint32_t (&pk)[2], uint32_t *ret_scale)
{
	uint32_t p4[2], s6, s4;
	float amax_b = 0.0f;
#pragma unroll
	for (int i = 0; i < 16; i++)
		amax_b = fabsf(x[i]) > amax_b ? fabsf(x[i]) : amax_b;
	float e6 = nvfp4_candidate(x, amax_b, g, 6.0f, pk, &s6);
	*ret_scale = s6;
	if (search) {
		/* Four Over Six: κ = 4 only on a strict improvement (ties keep κ = 6) */
		float e4 = nvfp4_candidate(x, amax_b, g, 4.0f, p4, &s4);
		if (e4 < e6) {
			pk[0] = p4[0];
			pk[1] = p4[1];
			*ret_scale = s4;
		}
	}
}

/* MXFP4 candidate with unbiased exponent e: pk[4], Σ (2^e·x̂ − x)² in order. */
__device__ __forceinline__ float mxfp4_candidate(const float (&x)[32], int e, uint32_t (&pk)[4])
{
	return e2m1_candidate<32>(x, ldexpf(1.0f, -e), ldexpf(1.0f, e), pk);
}

__device__ __forceinline__ int clamp_e8(int e)
{
	return e < -127 ? -127 : e > 127 ? 127 : e;
}

/* bd_mxfp4_quantize_block: 16 code bytes as pk[4], UE8M0 scale code. */
__device__ __forceinline__ void mxfp4_quantize_block(const float (&x)[32], bool search,
						     uint32_t (&pk)[4], uint32_t *ret_scale)
{
	uint32_t p1[4];
	float amax_b = 0.0f;
#pragma unroll
	for (int i = 0; i < 32; i++)
		amax_b = fabsf(x[i]) > amax_b ? fabsf(x[i]) : amax_b;
	int e_ocp;
	if (amax_b == 0.0f) {
		e_ocp = -127;
	} else {
		int e;
		(void)frexpf(amax_b, &e);
		e_ocp = (e - 1) - 2;
	}
	int e0 = clamp_e8(e_ocp);
	float err0 = mxfp4_candidate(x, e0, pk);
	*ret_scale = (uint32_t)(e0 + 127);
	if (search) {
		/* ties keep e_ocp (paper appendix E) */
		int e1 = clamp_e8(e_ocp + 1);
		float err1 = mxfp4_candidate(x, e1, p1);
		if (err1 < err0) {
#pragma unroll
			for (int j = 0; j < 4; j++)
				pk[j] = p1[j];
			*ret_scale = (uint32_t)(e1 + 127);
		}
	}
}

/* ---- FP4 → FP16 expansion ------------------------------------------------------------------ */

/* Nibbles J (low half) and J+4 (high half) of a word of 8 E2M1 codes as an FP16 pair of
 * x̂·2^-14: the sign to bit 15, e1 e0 m to bits 11..9 (low exponent bits and top mantissa bit),
 * so e = 0 lands on the FP16 subnormals exactly. Multiplied by an E4M3 scale in FP16 the
 * product s·x̂·2^-14 is a multiple of 2^-24 below 0.17, hence exact. */
template <int J>
__device__ __forceinline__ uint32_t fp4x2_h2(uint32_t w)
{
	if constexpr (J == 3)
		return (w & 0x80008000u) | ((w >> 3) & 0x0e000e00u);
	else
		return ((w << (12 - 4 * J)) & 0x80008000u) | ((w << (9 - 4 * J)) & 0x0e000e00u);
}

/* All eight codes of a word as four FP16 pairs of x̂·2^-14, out[J] = (n_J, n_J+4) exactly as
 * fp4x2_h2<J>, in 11 integer operations instead of 15: first each code is spread to a byte in
 * FP16-high-byte form (sign to bit 7, e1 e0 m to bits 3..1), even codes in ue = [n0 n2 n4 n6],
 * odd ones in uo = [n1 n3 n5 n7]; then a byte permute or a mask puts two of them in the high
 * bytes of an FP16 pair. */
__device__ __forceinline__ void fp4x8_h2(uint32_t w, uint32_t (&out)[4])
{
	const uint32_t ue = ((w << 1) & 0x0e0e0e0eu) | ((w << 4) & 0x80808080u);
	const uint32_t uo = ((w >> 3) & 0x0e0e0e0eu) | (w & 0x80808080u);
	out[0] = __byte_perm(ue, 0, 0x2404);
	out[1] = __byte_perm(uo, 0, 0x2404);
	out[2] = ue & 0xff00ff00u;
	out[3] = uo & 0xff00ff00u;
}

/* 2^x by the SFU alone (ex2.approx.ftz: relative error about 2^-22, as exp2f, whose extra
 * instructions only rescue subnormal results; those P < 2^-126 weigh nothing next to the tile
 * maximum's 1). 2^-inf = 0. */
__device__ __forceinline__ float ex2_ftz(float x)
{
	float y;
	asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
	return y;
}

__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b)
{
	uint32_t d;
	asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
	return d;
}

/* a × (the low or high FP16 of b, in both halves): the broadcast is the HMUL2 operand selector
 * (.H0_H0 / .H1_H1), not an instruction. One PTX template, the half ("l" or "h") pasted in. */
#define BDK_HMUL2_HALF(name, half)                                                          \
	__device__ __forceinline__ uint32_t name(uint32_t a, uint32_t b)                    \
	{                                                                                   \
		uint32_t d;                                                                 \
		asm("{.reg .b16 l, h;\n\t.reg .b32 s;\n\tmov.b32 {l, h}, %2;\n\t"              \
		    "mov.b32 s, {" half ", " half "};\n\tmul.rn.f16x2 %0, %1, s;}"              \
		    : "=r"(d)                                                               \
		    : "r"(a), "r"(b));                                                      \
		return d;                                                                   \
	}
BDK_HMUL2_HALF(hmul2_lo, "l")
BDK_HMUL2_HALF(hmul2_hi, "h")
#undef BDK_HMUL2_HALF

/* hi·256 + lo (lo < 256: the byte merge) on the FMA pipe; ptxas keeps a PTX mad an IMAD,
 * where it turns the C expression into a PRMT on the integer ALU pipe. */
__device__ __forceinline__ uint32_t mad256(uint32_t hi, uint32_t lo)
{
	uint32_t d;
	asm("mad.lo.u32 %0, %1, 256, %2;" : "=r"(d) : "r"(hi), "r"(lo));
	return d;
}

/* fp4x8_h2 with the right shift of the odd codes as IMAD.HI (w·2^29 / 2^32 = w >> 3) on the
 * FMA pipe instead of SHF on the integer ALU pipe; the left shifts are IMAD.SHL already (ptxas),
 * so 8 of the 11 operations stay on the ALU pipe instead of 9. Same bits as fp4x8_h2. */
__device__ __forceinline__ void fp4x8_h2_fma(uint32_t w, uint32_t (&out)[4])
{
	uint32_t w3;
	asm("mul.hi.u32 %0, %1, 0x20000000;" : "=r"(w3) : "r"(w));
	const uint32_t ue = ((w << 1) & 0x0e0e0e0eu) | ((w << 4) & 0x80808080u);
	const uint32_t uo = (w3 & 0x0e0e0e0eu) | (w & 0x80808080u);
	out[0] = __byte_perm(ue, 0, 0x2404);
	out[1] = __byte_perm(uo, 0, 0x2404);
	out[2] = ue & 0xff00ff00u;
	out[3] = uo & 0xff00ff00u;
}

/* Two FP32 to an FP16 pair (x low), round to nearest: exact for the P̃ values. */
__device__ __forceinline__ uint32_t f2_to_h2(float lo, float hi)
{
	uint32_t r;
	asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
	return r;
}

__device__ __forceinline__ uint32_t f2_to_bf2(float lo, float hi)
{
	uint32_t r;
	asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
	return r;
}

__device__ __forceinline__ float bf16_lo_f(uint32_t v)
{
	return __uint_as_float(v << 16);
}
__device__ __forceinline__ float bf16_hi_f(uint32_t v)
{
	return __uint_as_float(v & 0xffff0000u);
}

/* ---- tensor cores, register transposes, shared loads ----------------------------------------- */

/* c += A·B on the tensor cores, m16n8k16, FP32 accumulators: A [16][16] (a[4], the row
 * fragment), B [16][8] (b0, b1, the column fragment), FP16 (mma_f16) or BF16 (mma_bf16)
 * inputs. One PTX template, the input type pasted in. */
#define BDK_MMA_16816(name, ty)                                                                 \
	__device__ __forceinline__ void name(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, \
					     uint32_t b1)                                        \
	{                                                                                        \
		asm("mma.sync.aligned.m16n8k16.row.col.f32." ty "." ty ".f32 {%0,%1,%2,%3}, "       \
		    "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"                                          \
		    : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                  \
		    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                   \
	}
BDK_MMA_16816(mma_f16, "f16")
BDK_MMA_16816(mma_bf16, "bf16")
#undef BDK_MMA_16816

/* Transpose of an 8×8 16-bit matrix held as the accumulator layout (thread g·4+t: row g,
 * columns 2t, 2t+1) into the same layout of its transpose. */
__device__ __forceinline__ uint32_t movmatrix_t(uint32_t a)
{
	uint32_t d;
	asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(a));
	return d;
}

__device__ __forceinline__ uint32_t smem_u32(const void *p)
{
	return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void *p)
{
	asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
		     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
		     : "r"(smem_u32(p)));
}

__device__ __forceinline__ void ldmatrix_x4_t(uint32_t (&r)[4], const void *p)
{
	asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
		     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
		     : "r"(smem_u32(p)));
}

/* ---- mbarriers and the bulk copy engine (sm_90) --------------------------------------------- */

__device__ __forceinline__ void mbar_init(uint64_t *bar, uint32_t count)
{
	asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count)
		     : "memory");
}

__device__ __forceinline__ void mbar_fence_init()
{
	asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive_tx(uint64_t *bar, uint32_t bytes)
{
	asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
		     "r"(bytes)
		     : "memory");
}

/* Arrive without waiting (release: this thread's earlier shared writes are seen by whoever
 * waits on the phase). With mbar_wait later, a split barrier. */
__device__ __forceinline__ void mbar_arrive(uint64_t *bar)
{
	asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

/* Spin until the phase with this parity completed. The loop is inside the asm so that the
 * compiler sees straight-line code (no divergence to reconverge before the next mma.sync). */
__device__ __forceinline__ void mbar_wait(uint64_t *bar, uint32_t parity)
{
	asm volatile("{\n\t.reg .pred p;\n"
		     "BDK_WAIT:\n\t"
		     "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t"
		     "@!p bra BDK_WAIT;\n\t}" ::"r"(smem_u32(bar)),
		     "r"(parity)
		     : "memory");
}

/* Order this thread's generic-proxy shared accesses before later async-proxy (copy engine)
 * writes to the same bytes. */
__device__ __forceinline__ void fence_proxy_async()
{
	asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

/* 16-byte global → shared copy through L2 only (cp.async.cg), grouped by commit/wait. */
__device__ __forceinline__ void cp_async16(void *dst, const void *src)
{
	asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst)), "l"(src)
		     : "memory");
}
__device__ __forceinline__ void cp_async_commit()
{
	asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait()
{
	asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

/* Copy `bytes` (multiple of 16; both addresses 16-byte aligned) global → shared, completing
 * on bar; the stream is read once, so it is marked evict-first in L2. */
__device__ __forceinline__ void bulk_g2s(void *dst, const void *src, uint32_t bytes, uint64_t *bar)
{
	asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], "
		     "%2, [%3];" ::"r"(smem_u32(dst)),
		     "l"(src), "r"(bytes), "r"(smem_u32(bar))
		     : "memory");
}

/* ---- query preparation (NUMERICS.md §5) ------------------------------------------------------ */

/* One warp prepares one query head of D channels held as lane-strided registers
 * (x[i] = q[lane + 32·i]): q' = H q (bd_fwht: butterflies of stride 1, 2, 4, … then × 1/√d,
 * the same FP32 operations), then returns in place. */
template <int D>
__device__ __forceinline__ void fwht_warp(float (&x)[D / 32], float inv_sqrt_d)
{
	const int lane = threadIdx.x & 31;
#pragma unroll
	for (int hstride = 1; hstride < 32; hstride *= 2) {
#pragma unroll
		for (int i = 0; i < D / 32; i++) {
			float o = __shfl_xor_sync(0xffffffffu, x[i], hstride);
			/* the lane holding j + h computes a − b with a = x[j]: o − x */
			x[i] = (lane & hstride) ? __fsub_rn(o, x[i]) : __fadd_rn(x[i], o);
		}
	}
#pragma unroll
	for (int hs = 1; hs < D / 32; hs *= 2) {
#pragma unroll
		for (int i = 0; i < D / 32; i++) {
			if (i & hs)
				continue;
			float a = x[i], b = x[i + hs];
			x[i] = __fadd_rn(a, b);
			x[i + hs] = __fsub_rn(a, b);
		}
	}
#pragma unroll
	for (int i = 0; i < D / 32; i++)
		x[i] = __fmul_rn(x[i], inv_sqrt_d);
}

__device__ __forceinline__ float warp_max(float v, int from)
{
	for (int o = from; o > 0; o >>= 1)
		v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
	return v;
}

/* One NVFP4 query term of the lane-strided vector x (bd_nvfp4_quantize with smax = 448 and the
 * standard rule): codes[i] for x[i], sv[i] the decoded E4M3 scale of x[i]'s block, scode[i] its
 * code, g the decode scale. Blocks of 16 are lane halves (lanes 0–15, 16–31) of each i. */
template <int D>
__device__ __forceinline__ void qterm_warp(const float (&x)[D / 32], uint32_t (&codes)[D / 32],
					   float (&sv)[D / 32], uint32_t (&scode)[D / 32], float *ret_g)
{
	float amax = 0.0f;
#pragma unroll
	for (int i = 0; i < D / 32; i++)
		amax = fmaxf(amax, fabsf(x[i]));
	amax = warp_max(amax, 16);
	float g = nvfp4_g(amax, 448.0f);
#pragma unroll
	for (int i = 0; i < D / 32; i++) {
		float ab = fabsf(x[i]);
		for (int o = 8; o > 0; o >>= 1)
			ab = fmaxf(ab, __shfl_xor_sync(0xffffffffu, ab, o));
		uint32_t s = e4m3_encode(__fdiv_rn(__fdiv_rn(ab, 6.0f), g));
		float v = e4m3_decode(s);
		float inv = v == 0.0f ? 0.0f : __fdiv_rn(1.0f, __fmul_rn(v, g));
		codes[i] = e2m1_encode(__fmul_rn(x[i], inv));
		sv[i] = v;
		scode[i] = s;
	}
	*ret_g = g;
}

/* Dual-residual (or one-term) query of one head, lane-strided: term t's expanded values
 * ŝ = s·x̂ in xs[t][i], codes and scale codes, g[t]. q⁽²⁾ = Q(q' − (g·s)·x̂⁽¹⁾). */
template <int D>
__device__ __forceinline__ void query_quant_warp(const float (&x)[D / 32], int nterms,
						 float (&xs)[2][D / 32], uint32_t (&codes)[2][D / 32],
						 uint32_t (&scode)[2][D / 32], float (&g)[2])
{
	float sv[D / 32];
	qterm_warp<D>(x, codes[0], sv, scode[0], &g[0]);
	float r[D / 32];
#pragma unroll
	for (int i = 0; i < D / 32; i++) {
		float xh = e2m1_decode(codes[0][i]);
		xs[0][i] = __fmul_rn(sv[i], xh);
		r[i] = __fsub_rn(x[i], __fmul_rn(__fmul_rn(g[0], sv[i]), xh));
	}
	g[1] = 0.0f;
	if (nterms == 2) {
		qterm_warp<D>(r, codes[1], sv, scode[1], &g[1]);
#pragma unroll
		for (int i = 0; i < D / 32; i++)
			xs[1][i] = __fmul_rn(sv[i], e2m1_decode(codes[1][i]));
	} else {
#pragma unroll
		for (int i = 0; i < D / 32; i++) {
			xs[1][i] = 0.0f;
			codes[1][i] = 0;
			scode[1][i] = 0;
		}
	}
}

/* ---- MXFP4 helpers (UE8M0 scales, NUMERICS.md §2, §5, §6) ----------------------------------- */

/* 2^n exactly in FP32 for -149 ≤ n ≤ 127 (subnormals below -126), 0 below. */
__device__ __forceinline__ float pow2f(int n)
{
	if (n >= -126)
		return __uint_as_float((uint32_t)(n + 127) << 23);
	return n >= -149 ? __uint_as_float(1u << (n + 149)) : 0.0f;
}

/* UE8M0 code e (0..254) as the FP32 2^(e − 127), exactly: code 0 is the subnormal 2^-127. */
__device__ __forceinline__ float ue8m0_f32(uint32_t e)
{
	return __uint_as_float(e != 0u ? e << 23 : 0x00400000u);
}

/* The OCP block exponent of amax ≥ 0: floor(log2 amax) − 2, −127 for 0, clamped to ±127
 * (bd_mxfp4_quantize_block's e_ocp with the standard rule). */
__device__ __forceinline__ int mx_e_ocp(float amax)
{
	if (amax == 0.0f)
		return -127;
	int e;
	(void)frexpf(amax, &e);
	return clamp_e8((e - 1) - 2);
}

/* One MXFP4 query term of the lane-strided vector x (block i = x[i] over the 32 lanes):
 * codes, unbiased exponents e[i], and the dequantized values 2^e·x̂ in deq (FP32, exact). */
template <int D>
__device__ __forceinline__ void mx_qterm_warp(const float (&x)[D / 32], uint32_t (&codes)[D / 32],
					      int (&e)[D / 32], float (&deq)[D / 32])
{
#pragma unroll
	for (int i = 0; i < D / 32; i++) {
		e[i] = mx_e_ocp(warp_max(fabsf(x[i]), 16));
		/* 2^-e is a normal float for e in −127..125 (amax < 2^128) */
		codes[i] = e2m1_encode(__fmul_rn(x[i], pow2f(-e[i])));
		deq[i] = __fmul_rn(pow2f(e[i]), e2m1_decode(codes[i]));
	}
}

/* Dual-residual (or one-term) MXFP4 query of one head (bd_query_quantize, BD_FP4_MXFP4):
 * codes and biased UE8M0 codes per term and block, and for the tensor cores the FP16 operand
 * x̂·2^(e − r_t) in hq[t][i] with r_t the term's largest block exponent (so the largest block
 * keeps x̂ ≤ 6 and 24 binades below it stay exact), 2^r_t in g[t] (0 for a missing term). */
template <int D>
__device__ __forceinline__ void mx_query_quant_warp(const float (&x)[D / 32], int nterms,
						    float (&hq)[2][D / 32], uint32_t (&codes)[2][D / 32],
						    uint32_t (&scode)[2][D / 32], float (&g)[2])
{
	float r[D / 32], deq[D / 32];
	int e[D / 32];
	mx_qterm_warp<D>(x, codes[0], e, deq);
#pragma unroll
	for (int t = 0; t < 2; t++) {
		if (t == 1) {
			if (nterms != 2) {
#pragma unroll
				for (int i = 0; i < D / 32; i++) {
					hq[1][i] = 0.0f;
					codes[1][i] = scode[1][i] = 0;
				}
				g[1] = 0.0f;
				break;
			}
#pragma unroll
			for (int i = 0; i < D / 32; i++)
				r[i] = __fsub_rn(x[i], deq[i]);
			mx_qterm_warp<D>(r, codes[1], e, deq);
		}
		int rt = -127;
#pragma unroll
		for (int i = 0; i < D / 32; i++)
			rt = max(rt, e[i]);
#pragma unroll
		for (int i = 0; i < D / 32; i++) {
			hq[t][i] = __fmul_rn(pow2f(e[i] - rt), e2m1_decode(codes[t][i]));
			scode[t][i] = (uint32_t)(e[i] + 127);
		}
		g[t] = pow2f(rt);
	}
}

} // namespace bdk

#endif
