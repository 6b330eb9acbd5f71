/* bd_mma_sm100.h — the operands of the sm_100a/sm_103a decode kernel's block-scaled FP4 MMAs,
 * written once for the kernel (kernels/decode_sm100.cu) and its CPU emulation (paper §4,
 * NUMERICS.md §3–§6).
 *
 * The kernel computes two products per page (128 keys) of one (request, KV head) with
 * tcgen05.mma.cta_group::1, M = 128, N = 16, K = 64 per instruction, A and B in shared memory,
 * D in tensor memory (TMEM), scale factors in TMEM:
 *   S^T = K̂ Q̂^T   A = the page's K codes [128 keys][d], B = the stacked query terms [16][d]
 *   O^T = V̂^T P̂^T A = the page's V codes [128 channels][128 keys], B = P̂ [16 heads][128 keys]
 * NVFP4 pages use kind::mxf4nvf4.block_scale.block16 (E2M1 × E2M1, UE4M3 scale per 16
 * elements along K); MXFP4 pages kind::mxf4.block_scale.block32 (UE8M0 per 32). Both are the
 * PTX ISA's block-scaled MMA: D[m][n] (+)= Σ_k (A[m][k]·SFA[m][k/VS])·(B[n][k]·SFB[n][k/VS]).
 *
 * Operand tiles (shared memory, K-major, the canonical layouts of CuTe's
 * UMMA::Layout_K_SW64_Atom / Layout_K_SW32_Atom): row r of a tile holds rb bytes of packed
 * E2M1 (element 2j in the low nibble of byte j, as in a page); rows follow each other, and the
 * 16-byte chunk c of row r is stored at chunk c ^ sw(r): sw(r) = (r >> 1) & 3 for 64-byte rows
 * (SWIZZLE_64B), (r >> 2) & 1 for 32-byte rows (SWIZZLE_32B). Tiles start on 1024-byte
 * boundaries (the swizzle acts on address bits). Instruction kb reads bytes [32kb, 32kb + 32) of
 * every row, i.e. elements [64kb, 64kb + 64).
 *   K tile   [128][d/2]: row t = key t of the page, bytes as the page's token-major K codes;
 *   Q tile   [16][d/2]:  row bd_umma_qrow(h, t) = term t of query head h (unused rows zero);
 *   V tile   [128][64]:  row c = channel c, bytes as the page's channel-major V codes (rows
 *                        c ≥ d zero, so d = 64 runs the same M = 128 instruction);
 *   P tile   [16][64]:   row h = head h's quantized probabilities, key k in nibble k % 2 of
 *                        byte k / 2 (rows h ≥ G zero).
 * Scale-factor tiles (shared memory, copied to TMEM by tcgen05.cp.32x128b.warpx4, the layout
 * of cutlass/detail/sm100_blockscaled_layout.hpp): chunks of 512 bytes, each holding four
 * consecutive scales along K of all 128 rows; scale s of row r is byte
 * (s / 4)·512 + (r % 32)·16 + (r / 32)·4 + s % 4. An NVFP4 instruction reads one chunk (its
 * four block16 scales), an MXFP4 instruction half of one (its two block32 scales: bytes 0–1 of
 * each word for even kb, 2–3 for odd kb). Rows of B (N = 16) fill the first 16 rows of a chunk;
 * the others are zero. The page's K scales [128][d/B] and V scales [d][128/B] map to these
 * tiles row for row, the query's and P's scales likewise.
 *
 * Usable from C and CUDA (kernels/ includes only quant/): the placement functions below are
 * inline, and constexpr __host__ __device__ under nvcc; the rest is the CPU side
 * (lib/quant/mma_sm100.c).
 */
#ifndef BD_MMA_SM100_H
#define BD_MMA_SM100_H

#include <stddef.h>
#include <stdint.h>

#include "quant/bd_attn_ref.h"
#include "quant/bd_fp4.h"
#include "quant/bd_kvcfg.h"
#include "quant/bd_layout.h"

#ifdef __CUDACC__
#define BD_UMMA_FN static inline constexpr __host__ __device__
#else
#define BD_UMMA_FN static inline
#endif

#ifdef __cplusplus
extern "C" {
#endif

enum {
	BD_UMMA_M = 128,       /* rows of A and D: the keys of a page (S^T), channels (O^T) */
	BD_UMMA_N = 16,        /* rows of B, columns of D: query terms (S^T), heads (O^T) */
	BD_UMMA_K = 64,        /* FP4 elements of K per instruction (32 bytes of a row) */
	BD_UMMA_SF_CHUNK = 512, /* bytes of one scale-factor chunk: 128 rows × 4 scales */
	BD_UMMA_TILE_ALIGN = 1024, /* alignment of every tile in shared memory */
	BD_UMMA_PV_ROW = BD_PAGE_TOKENS / 2, /* bytes of a V or P tile row: 128 keys */
};

/* Byte offset of byte j (elements 2j, 2j + 1) of row r in a K-major operand tile with rb-byte
 * rows (rb = 64: SWIZZLE_64B; rb = 32: SWIZZLE_32B; j < rb). */
BD_UMMA_FN uint32_t bd_umma_off(uint32_t rb, uint32_t r, uint32_t j)
{
	const uint32_t sw = rb == 64 ? (r >> 1) & 3u : (r >> 2) & 1u;

	return r * rb + ((((j >> 4) ^ sw) & (rb / 16 - 1)) << 4) + (j & 15u);
}

/* Byte offset of scale s (counted along K over the whole row) of row r in a scale-factor
 * tile (the 512-byte chunks of the file comment; r < 128). */
BD_UMMA_FN uint32_t bd_umma_sf_off(uint32_t r, uint32_t s)
{
	return (s >> 2) * BD_UMMA_SF_CHUNK + (r & 31u) * 16 + (r >> 5) * 4 + (s & 3u);
}

/* Bytes of a scale-factor tile for rows of `scales` scales: whole chunks. */
BD_UMMA_FN uint32_t bd_umma_sf_bytes(uint32_t scales)
{
	return (scales + 3) / 4 * BD_UMMA_SF_CHUNK;
}

/* The B row (and the D column of S^T) of query term t (0 or 1) of head h (< 8): terms in
 * blocks of eight rows, so a one-term query uses rows 0–7 only (NUMERICS.md §5). */
BD_UMMA_FN uint32_t bd_umma_qrow(uint32_t h, uint32_t t)
{
	return h + 8 * t;
}

/* The E2M1 code of element k of row r of a tile with rb-byte rows. */
BD_UMMA_FN uint32_t bd_umma_code(const uint8_t *tile, uint32_t rb, uint32_t r, uint32_t k)
{
	return (uint32_t)(tile[bd_umma_off(rb, r, k >> 1)] >> (4 * (k & 1))) & 15u;
}

/* ---- the CPU side: packing, the instruction, the decoder ---------------------------------- */

/* Bytes of the tiles of one page-head and query (shapes of the file comment) for a page of
 * layout lay (NVFP4 or MXFP4, d 64 or 128). */
struct bd_umma_sizes {
	size_t k_tile, k_sf; /* K tile [128][d/2] and its scales; the Q tile uses k_sf too */
	size_t q_tile;       /* [16][d/2] */
	size_t v_tile, v_sf; /* V tile [128][64] and its scales; the P tile uses v_sf too */
	size_t p_tile;       /* [16][64] */
};

/* The sizes for lay. Returns 0 or -EOPNOTSUPP (not NVFP4/MXFP4 token-blocked pages, d not 64
 * or 128, MLA). */
int bd_umma_sizes(const struct bd_layout *lay, struct bd_umma_sizes *ret);

/* K of one page-head (head: the KV head's region of a page, lay's offsets) into the S^T A
 * tile ret_tile [k_tile] and its scales ret_sf [k_sf] (zero-filled first). Returns 0 or
 * -EOPNOTSUPP as bd_umma_sizes. */
int bd_umma_pack_k(const struct bd_layout *lay, const uint8_t *head, uint8_t *ret_tile,
		   uint8_t *ret_sf);

/* V of one page-head into the O^T A tile ret_tile [v_tile] and ret_sf [v_sf] (rows ≥ d zero).
 * Returns 0 or -EOPNOTSUPP. */
int bd_umma_pack_v(const struct bd_layout *lay, const uint8_t *head, uint8_t *ret_tile,
		   uint8_t *ret_sf);

/* The quantized query terms of G heads (qq[G], all of d channels, NVFP4 or MXFP4 as lay) into
 * the S^T B tile ret_tile [q_tile] and ret_sf [k_sf] (rows bd_umma_qrow; absent terms and
 * heads zero). The decode scales g stay outside (applied to D in FP32). Returns 0, -EINVAL
 * (G outside 1..8, a qq of another d or format), -EOPNOTSUPP. */
int bd_umma_pack_query(const struct bd_layout *lay, const struct bd_qquant *qq, int G,
		       uint8_t *ret_tile, uint8_t *ret_sf);

/* One head's quantized probabilities into row h of the O^T B tile: codes [128] E2M1 codes of
 * keys 0..127, scales [128/B] their block scale codes (E4M3 for NVFP4, UE8M0 for MXFP4; block
 * B = lay->block). tile [p_tile] and sf [v_sf] are written in place (row h only). */
void bd_umma_pack_p_row(const struct bd_layout *lay, int h, const uint8_t *codes,
			const uint8_t *scales, uint8_t *tile, uint8_t *sf);

/* One tcgen05.mma instruction of the kernel, as its operands sit in shared memory. */
struct bd_umma_mma {
	enum bd_fp4_format fmt;   /* NVFP4: block16 UE4M3 scales; MXFP4: block32 UE8M0 */
	const uint8_t *a, *b;     /* A [128][a_rb], B [n][b_rb] tiles (bd_umma_off) */
	int a_rb, b_rb;           /* 32 or 64 */
	const uint8_t *sfa, *sfb; /* their scale-factor tiles (bd_umma_sf_off) */
	int kb;                   /* the instruction's k-block: elements [64kb, 64kb + 64) */
	int n;                    /* N: 8..256, a multiple of 8 (the kernel: 16) */
	int accumulate;           /* 0: D = A·B (D's old contents ignored), 1: D += A·B */
};

/* The instruction's documented semantics on the CPU: for every m < 128, n' < n,
 *   D[m][n'] = (accumulate ? D[m][n'] : +0) + Σ_{k in the k-block} a_k·s_a·b_k·s_b
 * with every product exact (x̂·x̂·s·s has at most 12 significant bits) and rounded once to
 * FP32 (exact unless it lies below FP32's normal range), the sum taken in ascending k with
 * FP32 round-to-nearest additions. The PTX ISA does not fix the hardware's summation order;
 * this one is the reference decoder's (bd_attn_ref.h), so equal inputs give its FP32 sums.
 * d: [128][n] row-major FP32. Scale codes: E4M3 0x7f/0xff and UE8M0 0xff (NaN) are never
 * written by the packers and read as NaN. */
void bd_umma_emulate(const struct bd_umma_mma *op, float *d);

/* The sm_100 kernel's decode of one GQA group on the CPU: the operands packed as above, every
 * MMA through bd_umma_emulate, and around it the kernel's steps in the reference decoder's
 * FP32 order (NUMERICS.md §5–§8): S = ((D[q1]·g_q1 + D[q2]·g_q2)·g_K)·γ per key and head, the
 * online softmax per page (tile_keys must be 128), P quantized per §6 into the P tile (NVFP4
 * blocks of 16 with c and τ from dp; MXFP4 blocks of 32, OCP rule), o = α·o + D_PV·g_V, the
 * BF16 sink+recent partial in FP32 and the LSE combine. Same arguments, shapes and results as
 * bd_ref_decode_gqa (no stats). Returns 0, -EINVAL, -EDOM, -ENOMEM, -EOPNOTSUPP (pages other
 * than NVFP4/MXFP4 token-blocked, d not 64 or 128, G > 8, tile_keys ≠ 128). */
int bd_umma_decode_gqa(const struct bd_kvcfg *cfg, const struct bd_decode_params *dp,
		       const struct bd_kv_view *kv, const float *q, int G, float *ret_o,
		       float *ret_lse);

#ifdef __cplusplus
}
#endif
#endif
