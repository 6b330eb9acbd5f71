/* decode_v6_sm90.cu — kernels/decode_sm90.cu compiled with the v6 page loop, for
 * bench/kernels/ab.sh to time against the product's v8 loop (bench/KERNELS-NOTES.md, v6 and v8).
 *
 * Everything but the page loop's variant points is the product file itself (included below);
 * PageV6 supplies those points as v6 had them:
 *   - FP4 words expand with fp4x8_h2 (the odd codes' shift on the integer ALU pipe);
 *   - a K row's E4M3 scales become one FP16 pair per block, broadcast by PRMT (h2_lo, h2_hi),
 *     and multiply by a plain HMUL2;
 *   - each V row's scale byte is broadcast by PRMT and converted on its own;
 *   - the tile maximum is shared by one __syncthreads per page (no split mbarrier, so shared
 *     memory holds no barrier for it).
 * Built in place of kernels/decode_sm90.cu by `make DECODE_SRC=bench/kernels/decode_v6_sm90.cu`
 * (sm_90a only); the launchers and every other kernel are the product's. Results are the same
 * bytes as the product's (the variant points compute the same values).
 */
#include <stdint.h>

#include "bd_kcommon.cuh"

namespace bdk {

struct VRows; /* decode_sm90.cu: where a warp reads a page's V rows */

/* The low (high) FP16 of a pair in both halves. */
__device__ __forceinline__ uint32_t h2_lo(uint32_t a)
{
	return __byte_perm(a, 0, 0x1010);
}
__device__ __forceinline__ uint32_t h2_hi(uint32_t a)
{
	return __byte_perm(a, 0, 0x3232);
}

/* The page-loop policy of decode_sm90.cu (PageLoop documents the members) with v6's code. */
struct PageV6 {
	static constexpr int TILE_BARS = 0;
	static constexpr bool SPLIT = false;

	__device__ static __forceinline__ void expand(uint32_t w, uint32_t (&a)[4])
	{
		fp4x8_h2(w, a);
	}

	/* ks[0], ks[1]: the low and the high block's scale in both halves of a pair (D = 64: the
	 * one block's scale byte broadcast before the conversion) */
	template <int D>
	__device__ static __forceinline__ void kscale(uint32_t s, uint32_t (&ks)[2])
	{
		const uint32_t h = e4m3x2_to_h2(D == 128 ? s : __byte_perm(s, 0, 0x0000));
		ks[0] = h2_lo(h);
		ks[1] = h2_hi(h);
	}

	__device__ static __forceinline__ uint32_t kmul(uint32_t a, const uint32_t (&ks)[2], bool hi)
	{
		return hmul2(a, hi ? ks[1] : ks[0]);
	}

	template <bool MX>
	__device__ static __forceinline__ void vexpand(const VRows &vr, int mc, uint32_t (&a0)[4],
						       uint32_t (&a1)[4]);
};

} /* namespace bdk */

#define BD_DECODE_PAGE PageV6
#include "decode_sm90.cu"

namespace bdk {

template <bool MX>
__device__ __forceinline__ void PageV6::vexpand(const VRows &vr, int mc, uint32_t (&a0)[4],
						uint32_t (&a1)[4])
{
	const int c0 = 16 * mc + vr.g, c1 = c0 + 8;
	const uint32_t x0 = *(const uint32_t *)(vr.vcw + c0 * 64);
	const uint32_t x1 = *(const uint32_t *)(vr.vcw + c1 * 64);
	fp4x8_h2(x0, a0);
	fp4x8_h2(x1, a1);
	if constexpr (!MX) {
		const uint32_t sc0 = e4m3x2_to_h2(__byte_perm((uint32_t)vr.vsw[c0 * 8], 0, 0x0000));
		const uint32_t sc1 = e4m3x2_to_h2(__byte_perm((uint32_t)vr.vsw[c1 * 8], 0, 0x0000));
#pragma unroll
		for (int j = 0; j < 4; j++) {
			a0[j] = hmul2(a0[j], sc0);
			a1[j] = hmul2(a1[j], sc1);
		}
	}
}

} /* namespace bdk */
