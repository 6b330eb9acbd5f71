/* bd_umma_sm100.cuh — the CuTe types of the sm_100a/sm_103a decode kernel's block-scaled FP4
 * MMAs (kernels/decode_sm100.cu): the MMA atom, the shared-memory operand and scale-factor
 * layouts the descriptors are made from, for a head dimension D and a page format.
 *
 * They are NVIDIA's own (CuTe's SM100_MMA_MXF4_SS, UMMA::Layout_K_SW64/SW32_Atom, the
 * block-scaled chunks of cutlass/detail/sm100_blockscaled_layout.hpp); quant/bd_mma_sm100.h
 * states the same placement as plain functions for the kernel's stores and the CPU, and
 * tests/gpu/umma_sm100_check.cu evaluates these layouts on the host against them.
 * Needs the CUTLASS headers (make deps) on the include path; host and device code.
 */
#ifndef BD_UMMA_SM100_CUH
#define BD_UMMA_SM100_CUH

#include <type_traits>

#include <cute/atom/mma_traits_sm100.hpp>
#include <cute/tensor.hpp>
#include <cutlass/detail/sm100_blockscaled_layout.hpp>

#include "quant/bd_mma_sm100.h"

namespace bdk {
namespace umma {

using E2M1 = cutlass::float_e2m1_t;

/* D: head dimension (64, 128); MX: MXFP4 pages (UE8M0 scales per 32, kind::mxf4) rather than
 * NVFP4 (UE4M3 per 16, kind::mxf4nvf4). */
template <int D, bool MX>
struct Types {
	static constexpr int VS = MX ? 32 : 16;
	using SF = std::conditional_t<MX, cutlass::float_ue8m0_t, cutlass::float_ue4m3_t>;
	/* M = 128 (keys of S^T, channels of O^T), N = 16 (query terms, heads), K = 64 */
	using Atom = cute::SM100_MMA_MXF4_SS<E2M1, E2M1, float, SF, BD_UMMA_M, BD_UMMA_N, VS,
					     cute::UMMA::Major::K, cute::UMMA::Major::K>;
	using Mma = decltype(cute::make_tiled_mma(Atom{}));

	using M_ = cute::Int<BD_UMMA_M>;
	using N_ = cute::Int<BD_UMMA_N>;
	using D_ = cute::Int<D>;
	using Keys = cute::Int<BD_PAGE_TOKENS>;

	/* K rows are D/2 bytes: SWIZZLE_64B for D = 128, SWIZZLE_32B for D = 64; V and P rows are
	 * 64 bytes (128 keys) */
	using SwK = std::conditional_t<D == 128, cute::UMMA::Layout_K_SW64_Atom<E2M1>,
				       cute::UMMA::Layout_K_SW32_Atom<E2M1>>;
	using SwV = cute::UMMA::Layout_K_SW64_Atom<E2M1>;

	/* ((MMA_M, MMA_K), 1, k-blocks) operand tiles of S^T = K̂ Q̂^T and O^T = V̂^T P̂^T */
	using KTile = decltype(cute::UMMA::tile_to_mma_shape(
		SwK{}, cute::partition_shape_A(Mma{}, cute::make_shape(M_{}, D_{}))));
	using QTile = decltype(cute::UMMA::tile_to_mma_shape(
		SwK{}, cute::partition_shape_B(Mma{}, cute::make_shape(N_{}, D_{}))));
	using VTile = decltype(cute::UMMA::tile_to_mma_shape(
		SwV{}, cute::partition_shape_A(Mma{}, cute::make_shape(M_{}, Keys{}))));
	using PTile = decltype(cute::UMMA::tile_to_mma_shape(
		SwV{}, cute::partition_shape_B(Mma{}, cute::make_shape(N_{}, Keys{}))));

	/* Scale-factor tiles: one chunk holds four scales of each row, so the K extent of the
	 * layouts is at least 4·VS (MXFP4 with D = 64 uses the first half of a chunk) */
	static constexpr int SFK = D > 4 * VS ? D : 4 * VS;
	using Blk = cutlass::detail::Sm1xxBlockScaledConfig<VS>;
	using KSf = decltype(Blk::deduce_smem_layoutSFA(Mma{}, cute::make_shape(M_{}, N_{}, cute::Int<SFK>{})));
	using QSf = decltype(Blk::deduce_smem_layoutSFB(Mma{}, cute::make_shape(M_{}, N_{}, cute::Int<SFK>{})));
	using VSf = decltype(Blk::deduce_smem_layoutSFA(Mma{}, cute::make_shape(M_{}, N_{}, Keys{})));
	using PSf = decltype(Blk::deduce_smem_layoutSFB(Mma{}, cute::make_shape(M_{}, N_{}, Keys{})));

	/* the accumulators' shape ((128, 16), 1, 1) */
	using AccShape = decltype(cute::partition_shape_C(Mma{}, cute::make_shape(M_{}, N_{})));

	static constexpr int S_KBLOCKS = D / BD_UMMA_K;
	static constexpr int PV_KBLOCKS = BD_PAGE_TOKENS / BD_UMMA_K;
};

} // namespace umma
} // namespace bdk

#endif
