/* umma_sm100_check.cu — CuTe's layouts of the sm_100a decode kernel's MMA operands
 * (kernels/bd_umma_sm100.cuh) evaluated on the host against the placement that
 * quant/bd_mma_sm100.h states and the kernel's stores use. Host code only: it needs no GPU and
 * runs wherever it builds (`make umma-sm100-check`).
 *
 * For D ∈ {64, 128} and NVFP4 / MXFP4:
 *   - every byte of the K, Q, V and P operand tiles: CuTe's swizzled smem layout (the one
 *     make_umma_desc turns into the descriptor) puts (row, byte) where bd_umma_off says;
 *   - every scale of the K, Q, V and P scale-factor tiles: CuTe's block-scaled smem layout (the
 *     source of the tcgen05.cp copies) puts (row, scale) where bd_umma_sf_off says;
 *   - the TMEM load the kernel uses (SM100_TMEM_LOAD_32dp32b16x over a 128 × 16 accumulator):
 *     thread t's register i holds row t, column i; the kernel's TMEM tensors fit its 64
 *     allocated columns;
 *   - the shapes the kernel relies on (k-blocks per tile, bytes per tile).
 * Exits non-zero on the first mismatch class, after printing it.
 */
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <cute/atom/copy_traits_sm100.hpp>

#include "bd_umma_sm100.cuh"

using namespace cute;

static int n_fail, n_pass;

static void check(bool ok, const char *what, int D, bool mx, int r, int j, long got, long want)
{
	if (ok) {
		n_pass++;
		return;
	}
	if (n_fail++ < 20)
		std::printf("FAIL %s D=%d %s: row %d, index %d at %ld, the header says %ld\n", what, D,
			    mx ? "MXFP4" : "NVFP4", r, j, got, want);
}

alignas(4096) static uint8_t arena[1 << 16];

/* Byte j of row r of an operand tile layout (((rows, 64 elements), 1, k-blocks)). */
template <class Layout>
static long tile_byte(Layout const &lay, int r, int j)
{
	Tensor t = make_tensor(make_smem_ptr(reinterpret_cast<bdk::umma::E2M1 *>(arena)), lay);
	Tensor t8 = recast<uint8_t>(t); /* ((rows, 32 bytes), 1, k-blocks) */
	uint8_t *p = raw_pointer_cast(&t8(make_coord(make_coord(r, j % 32), 0, j / 32)));
	return (long)(p - arena);
}

template <class Layout>
static void check_tile(const char *what, Layout const &lay, int D, bool mx, int rows, int rb)
{
	static_assert(decltype(size<0, 1>(Layout{}))::value == BD_UMMA_K, "64 elements per k-block");
	check((int)size<2>(lay) * 32 == rb, what, D, mx, -1, -1, (long)size<2>(lay) * 32, rb);
	check((long)cosize(lay) / 2 == (long)rows * rb, what, D, mx, -1, -1, (long)cosize(lay) / 2,
	      (long)rows * rb);
	for (int r = 0; r < rows; r++)
		for (int j = 0; j < rb; j++) {
			long got = tile_byte(lay, r, j);
			long want = bd_umma_off((uint32_t)rb, (uint32_t)r, (uint32_t)j);
			check(got == want, what, D, mx, r, j, got, want);
		}
}

/* Scale s of row r of a block-scaled smem layout ((MN, (VS, NSF)), 1, (chunks' share, chunks)). */
template <class Layout>
static long sf_index(Layout const &lay, int r, int s, int nsf)
{
	return (long)lay(make_coord(make_coord(r, make_coord(0, s % nsf)), 0,
				    make_coord((s / nsf) % (4 / nsf), s / 4)));
}

template <class Layout>
static void check_sf(const char *what, Layout const &lay, int D, bool mx, int rows, int scales)
{
	constexpr int nsf = BD_UMMA_K / (decltype(size<0, 1, 0>(Layout{}))::value);
	for (int r = 0; r < rows; r++)
		for (int s = 0; s < scales; s++) {
			long got = sf_index(lay, r, s, nsf);
			long want = bd_umma_sf_off((uint32_t)r, (uint32_t)s);
			check(got == want, what, D, mx, r, s, got, want);
		}
	check((long)cosize(filter_zeros(lay)) == (long)bd_umma_sf_bytes((uint32_t)scales) ||
		      (mx && D == 64 && (long)cosize(filter_zeros(lay)) == BD_UMMA_SF_CHUNK),
	      what, D, mx, -1, -1, (long)cosize(filter_zeros(lay)), bd_umma_sf_bytes((uint32_t)scales));
}

template <int D, bool MX>
static void check_types()
{
	using T = bdk::umma::Types<D, MX>;
	const int B = MX ? 32 : 16;

	check_tile("K tile", typename T::KTile{}, D, MX, BD_UMMA_M, D / 2);
	check_tile("Q tile", typename T::QTile{}, D, MX, BD_UMMA_N, D / 2);
	check_tile("V tile", typename T::VTile{}, D, MX, BD_UMMA_M, BD_UMMA_PV_ROW);
	check_tile("P tile", typename T::PTile{}, D, MX, BD_UMMA_N, BD_UMMA_PV_ROW);
	check_sf("K scales", typename T::KSf{}, D, MX, BD_UMMA_M, D / B);
	check_sf("Q scales", typename T::QSf{}, D, MX, BD_UMMA_N, D / B);
	check_sf("V scales", typename T::VSf{}, D, MX, BD_UMMA_M, BD_PAGE_TOKENS / B);
	check_sf("P scales", typename T::PSf{}, D, MX, BD_UMMA_N, BD_PAGE_TOKENS / B);

	/* TMEM columns of the kernel's tensors (accumulators of S^T and O^T, the scale factors of
	 * K, Q, V, P, one after the other: cutlass::detail::find_tmem_tensor_col_offset's count,
	 * taken here on the layouts) within its allocation of 64 */
	{
		using SF = typename T::SF;
		auto colsof = [](auto lay, auto ty) {
			return (long)(cosize(recast_layout<decltype(ty), uint32_t>(lay)) & 0xffff);
		};
		const long a = colsof(typename T::Mma{}.make_fragment_C(typename T::AccShape{}).layout(), float{});
		const long k = colsof(make_tensor<typename T::Mma::FrgTypeSFA>(shape(typename T::KSf{})).layout(), SF{});
		const long q = colsof(make_tensor<typename T::Mma::FrgTypeSFB>(shape(typename T::QSf{})).layout(), SF{});
		const long v = colsof(make_tensor<typename T::Mma::FrgTypeSFA>(shape(typename T::VSf{})).layout(), SF{});
		const long p = colsof(make_tensor<typename T::Mma::FrgTypeSFB>(shape(typename T::PSf{})).layout(), SF{});
		check(a == BD_UMMA_N, "accumulator columns", D, MX, -1, -1, a, BD_UMMA_N);
		check(2 * a + k + q + v + p <= 64, "TMEM columns", D, MX, -1, -1, 2 * a + k + q + v + p, 64);
		if (D == 128 && !MX)
			std::printf("TMEM columns (D=128, NVFP4): accumulators 2 x %ld, scales K %ld Q %ld V %ld P %ld\n",
				    a, k, q, v, p);
	}

	/* thread t of the TMEM load holds row t, columns 0..15 in order */
	Tensor acc = typename T::Mma{}.make_fragment_C(typename T::AccShape{});
	auto t2r = make_tmem_copy(SM100_TMEM_LOAD_32dp32b16x{}, acc);
	Tensor id = make_identity_tensor(shape(acc));
	for (int t = 0; t < 128; t++) {
		Tensor c = t2r.get_slice(t).partition_D(id);
		check(size(c) == BD_UMMA_N, "TMEM load size", D, MX, t, -1, (long)size(c), BD_UMMA_N);
		for (int i = 0; i < size(c); i++) {
			const int row = get<0, 0>(c(i)), col = get<0, 1>(c(i));
			check(row == t, "TMEM load row", D, MX, t, i, row, t);
			check(col == i, "TMEM load column", D, MX, t, i, col, i);
		}
	}
}

int main()
{
	check_types<128, false>();
	check_types<64, false>();
	check_types<128, true>();
	check_types<64, true>();
	std::printf("umma_sm100_check: %d checks, %d failed\n", n_pass + n_fail, n_fail);
	return n_fail ? 1 : 0;
}
