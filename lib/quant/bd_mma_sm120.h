/* bd_mma_sm120.h — the warp-level block-scaled FP4 MMA of sm_120a as the native decode kernel
 * uses it: which bytes of a page, of the query and of the P tile each lane passes as A, B and
 * their scales, written once for kernels/decode_sm120.cu and for the CPU, and a plain-C
 * emulation of the instruction (lib/quant/mma_sm120.c).
 *
 * The instruction (PTX ISA, "Warp-level matrix multiply-accumulate instructions": "Block
 * Scaling for mma.sync" and "Matrix Fragments for mma.m16n8k64"):
 *   NVFP4  mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X
 *          .f32.e2m1.e2m1.f32.ue4m3  d, a, b, c, sfa, {bid_a, tid_a}, sfb, {bid_b, tid_b}
 *   MXFP4  the same with .scale_vec::2X and .ue8m0
 * computes D[16][8] = (A·SF_A)(B·SF_B) + C over K = 64: the k range is cut into blocks of 16
 * (4X) or 32 (2X) and every product A[m][k]·B[k][n] is scaled by SF_A[m][blk]·SF_B[blk][n]
 * (ptxas emits OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X, resp. .E8, for sm_120a). Each lane holds
 * four A registers and two B registers of eight E2M1 codes (element i of a register in nibble
 * i, low nibble first), one 32-bit scale register for A and one for B, and four FP32
 * accumulators; the bd_mma120_{a,b,c,sfa,sfb}_* functions below are the ISA's fragment
 * formulas.
 *
 * The decode (NUMERICS.md §3–§6, paper §4) computes per page of 128 keys of one (request, KV
 * head), four warps to a CTA:
 *   S^T = K̂ Q̂^T  M = keys (8 tiles of 16; warp w computes tiles 2w, 2w + 1), K = channels
 *                 (d/64 k-steps), N = the stacked query terms of the GQA group (column tiles
 *                 of 8: bd_mma120_col_head / _col_term);
 *   O^T = V̂^T P̂^T M = channels (d/16 tiles; warp w computes tiles (d/64)·w + j, j < d/64),
 *                 K = the page's keys (2 k-steps of 64), N = the group's heads.
 * A comes straight from the page's bytes (token-major K codes and scales, NUMERICS.md §3;
 * channel-major V codes and scales, §4: bd_layout.h): a register is one aligned 32-bit word of
 * the page, a scale register 4 (MXFP4 d = 64: 2) consecutive scale bytes. B comes from the
 * quantized query (packed like a K row: element c in nibble c % 2 of byte c / 2, §5) and from
 * the P tile, which the softmax writes: per head a row of 64 bytes holding the page's 128 keys
 * (key κ in nibble κ % 2 of byte κ / 2) and a row of P scales (NVFP4: 8 E4M3 codes, block b =
 * keys 16b..16b+15; MXFP4: 4 UE8M0 codes, block b = keys 32b..32b+31; §6). K and V blocks are
 * NUMERICS.md's blocks, so every scale block of the instruction is one quantization block of
 * both operands: the k index runs over channels (S^T) or keys (O^T) in natural order, and
 * row r of S^T tile mt is key bd_mma120_s_key(mt, r), which puts the two keys a lane's
 * accumulator rows hold side by side in one byte of the P tile.
 *
 * Scale selectors: k-step ks (of S^T over channels, of O^T over keys) is the instruction with
 * BD_MMA120_BID/_TIDA/_TIDB(mx, ks): NVFP4 reads its four E4M3 bytes from the lanes whose pair
 * (A: lane % 4 / 2) or lane (B: lane % 4) index is ks, MXFP4 its two UE8M0 bytes from byte
 * pair ks of the first lanes. So one scale register per lane and tile serves both k-steps.
 *
 * Usable from C and CUDA (kernels/ includes only quant/): the functions here are inline and
 * __host__ __device__ under nvcc; the emulation is C only.
 */
#ifndef BD_MMA_SM120_H
#define BD_MMA_SM120_H

#include <stdint.h>

#include "quant/bd_fp4.h"
#include "quant/bd_layout.h"

#ifdef __CUDACC__
#define BD_MMA120_FN static inline __host__ __device__
#else
#define BD_MMA120_FN static inline
#endif

#ifdef __cplusplus
extern "C" {
#endif

enum {
	BD_MMA120_LANES = 32,
	BD_MMA120_M = 16,        /* rows of A, D */
	BD_MMA120_N = 8,         /* columns of B, D */
	BD_MMA120_K = 64,        /* E2M1 elements of K per instruction */
	BD_MMA120_WARPS = 4,     /* warps of a decode CTA */
	BD_MMA120_S_TILES = 8,   /* S^T M-tiles of a page: 128 keys / 16 */
	BD_MMA120_P_ROW = 64,    /* bytes of a P tile row: 128 keys */
	BD_MMA120_MAX_HEADS = 8, /* rows of the P tile: the GQA group */
};

/* ---- the instruction's fragments (PTX ISA "Matrix Fragments for mma.m16n8k64") ------------ */

/* A [16][64]: nibble i (0..7) of register r (0..3) of lane is A[row][col]. */
BD_MMA120_FN int bd_mma120_a_row(int lane, int r)
{
	return (lane >> 2) + 8 * (r & 1);
}

BD_MMA120_FN int bd_mma120_a_col(int lane, int r, int i)
{
	return 8 * (lane & 3) + i + 32 * (r >> 1);
}

/* B [64][8]: nibble i of register r (0..1) of lane is B[k][n]. */
BD_MMA120_FN int bd_mma120_b_k(int lane, int r, int i)
{
	return 8 * (lane & 3) + i + 32 * r;
}

BD_MMA120_FN int bd_mma120_b_n(int lane)
{
	return lane >> 2;
}

/* C, D [16][8]: element e (0..3) of lane. */
BD_MMA120_FN int bd_mma120_c_row(int lane, int e)
{
	return (lane >> 2) + 8 * (e >> 1);
}

BD_MMA120_FN int bd_mma120_c_col(int lane, int e)
{
	return 2 * (lane & 3) + (e & 1);
}

/* SF_A (PTX ISA "Block Scaling for mma.sync"): with thread-id-a = tid, the lanes whose pair
 * index (lane % 4) / 2 is tid supply the scales of row bd_mma120_sfa_row(lane); the others are
 * not read. */
BD_MMA120_FN int bd_mma120_sfa_row(int lane)
{
	return (lane >> 2) + 8 * (lane & 1);
}

BD_MMA120_FN int bd_mma120_sfa_tid(int lane)
{
	return (lane >> 1) & 1;
}

/* SF_B: with thread-id-b = tid, the lanes with lane % 4 == tid supply the scales of column
 * bd_mma120_sfb_col(lane). */
BD_MMA120_FN int bd_mma120_sfb_col(int lane)
{
	return lane >> 2;
}

BD_MMA120_FN int bd_mma120_sfb_tid(int lane)
{
	return lane & 3;
}

/* Which scale bytes: 4X reads all four bytes of the register, byte j scaling k ∈ [16j, 16j+16)
 * (byte-id must be 0); 2X reads bytes bid and bid + 1 (bid ∈ {0, 2}), byte bid + j scaling
 * k ∈ [32j, 32j+32). */

/* ---- the decode's selectors: k-step ks of S^T or O^T (mx: 0 NVFP4, 1 MXFP4) -------------- */

#define BD_MMA120_BID(mx, ks) ((mx) ? 2 * (ks) : 0)
#define BD_MMA120_TIDA(mx, ks) ((mx) ? 0 : (ks))
#define BD_MMA120_TIDB(mx, ks) ((mx) ? 0 : (ks))

/* ---- S^T = K̂ Q̂^T: the page's K and the query -------------------------------------------- */

/* The key (0..127 in the page) of row r (0..15) of S^T tile mt (0..7): rows r and r + 8 are
 * keys 2i and 2i + 1 of the tile (i = r % 8), one byte of the P tile. */
BD_MMA120_FN int bd_mma120_s_key(int mt, int r)
{
	return 16 * mt + 2 * (r & 7) + (r >> 3);
}

/* Byte offset, in the page-head's K codes region ([128][d/2], token-major), of A register r of
 * lane for tile mt, k-step ks (channels 64ks..64ks+63): 8 channels of one key, one aligned
 * word. */
BD_MMA120_FN uint32_t bd_mma120_k_codes_off(int d, int mt, int ks, int lane, int r)
{
	int key = bd_mma120_s_key(mt, bd_mma120_a_row(lane, r));

	return (uint32_t)(key * (d / 2) + (64 * ks + bd_mma120_a_col(lane, r, 0)) / 2);
}

/* Byte offset, in the K scales region ([128][d/B]), of the lane's SF_A register for tile mt:
 * the scale bytes of key bd_mma120_s_key(mt, bd_mma120_sfa_row(lane)) for its k-step (NVFP4:
 * the lane pair's tid when d = 128, else 0: four E4M3 bytes; MXFP4: the row's d/32 UE8M0
 * bytes, both k-steps). bd_mma120_scale_bytes gives how many bytes to read. */
BD_MMA120_FN uint32_t bd_mma120_k_sfa_off(int mx, int d, int mt, int lane)
{
	int key = bd_mma120_s_key(mt, bd_mma120_sfa_row(lane));

	if (mx)
		return (uint32_t)(key * (d / BD_MXFP4_BLOCK));
	return (uint32_t)(key * (d / BD_NVFP4_BLOCK) +
			  4 * (d == 128 ? bd_mma120_sfa_tid(lane) : 0));
}

/* Bytes of a K (or query) scale register: 4, but 2 for MXFP4 with d = 64 (one k-step). */
BD_MMA120_FN int bd_mma120_scale_bytes(int mx, int d)
{
	return mx ? d / BD_MXFP4_BLOCK : 4;
}

/* Byte offset, in one query column's packed codes ([d/2]: element c in nibble c % 2 of byte
 * c / 2), of B register r of lane for k-step ks. The column is bd_mma120_b_n(lane). */
BD_MMA120_FN uint32_t bd_mma120_q_codes_off(int ks, int lane, int r)
{
	return (uint32_t)((64 * ks + bd_mma120_b_k(lane, r, 0)) / 2);
}

/* Byte offset, in one query column's scales ([d/B]), of the lane's SF_B register (NVFP4: the
 * four E4M3 bytes of k-step lane % 4 when that is < d/64, else of k-step 0; MXFP4: all d/32
 * UE8M0 bytes). The column is bd_mma120_sfb_col(lane). */
BD_MMA120_FN uint32_t bd_mma120_q_sfb_off(int mx, int d, int lane)
{
	if (mx)
		return 0;
	return (uint32_t)(4 * (d == 128 ? (bd_mma120_sfb_tid(lane) & 1) : 0));
}

/* The stacked query terms (N of S^T). Pairs layout (two terms, or G ≤ 4): column n of column
 * tile nt is term n % 2 of head 4nt + n/2, so a lane's two accumulator columns are both terms
 * of one head; single layout (one term, G > 4): column n is head n. Columns of heads ≥ G or of
 * a missing second term are zero. */
BD_MMA120_FN int bd_mma120_pairs(int G, int nterms)
{
	return nterms == 2 || G <= 4;
}

BD_MMA120_FN int bd_mma120_col_tiles(int G, int nterms)
{
	return bd_mma120_pairs(G, nterms) && G > 4 ? 2 : 1;
}

BD_MMA120_FN int bd_mma120_col_head(int pairs, int nt, int n)
{
	return pairs ? 4 * nt + (n >> 1) : n;
}

BD_MMA120_FN int bd_mma120_col_term(int pairs, int n)
{
	return pairs ? (n & 1) : 0;
}

/* ---- the P tile: written by the softmax in S^T's accumulator layout ------------------------ */

/* Byte of the head's P tile row holding the two keys of accumulator rows c_row(lane, 0) and
 * c_row(lane, 2) of S^T tile mt (low nibble: e = 0, 1; high nibble: e = 2, 3). */
BD_MMA120_FN uint32_t bd_mma120_p_byte(int mt, int lane)
{
	return (uint32_t)(bd_mma120_s_key(mt, bd_mma120_c_row(lane, 0)) / 2);
}

/* ---- O^T = V̂^T P̂^T: the page's V and the P tile ------------------------------------------- */

/* Byte offset, in the page-head's V codes region ([d][64], channel-major), of A register r of
 * lane for channel tile mc and k-step ks (keys 64ks..64ks+63): 8 tokens of one channel. */
BD_MMA120_FN uint32_t bd_mma120_v_codes_off(int mc, int ks, int lane, int r)
{
	int ch = 16 * mc + bd_mma120_a_row(lane, r);

	return (uint32_t)(ch * BD_MMA120_P_ROW + (64 * ks + bd_mma120_a_col(lane, r, 0)) / 2);
}

/* Byte offset, in the V scales region ([d][128/B]), of the lane's SF_A register for channel
 * tile mc: NVFP4 the four E4M3 bytes of the lane pair's k-step, MXFP4 the channel's four UE8M0
 * bytes (both k-steps); always 4 bytes. */
BD_MMA120_FN uint32_t bd_mma120_v_sfa_off(int mx, int mc, int lane)
{
	int ch = 16 * mc + bd_mma120_sfa_row(lane);

	if (mx)
		return (uint32_t)(ch * (BD_PAGE_TOKENS / BD_MXFP4_BLOCK));
	return (uint32_t)(ch * (BD_PAGE_TOKENS / BD_NVFP4_BLOCK) + 4 * bd_mma120_sfa_tid(lane));
}

/* Byte offset, in the P tile ([8][64]), of B register r of lane for k-step ks: head
 * bd_mma120_b_n(lane), 8 keys. */
BD_MMA120_FN uint32_t bd_mma120_p_codes_off(int ks, int lane, int r)
{
	return (uint32_t)(bd_mma120_b_n(lane) * BD_MMA120_P_ROW +
			  (64 * ks + bd_mma120_b_k(lane, r, 0)) / 2);
}

/* Bytes of a P scale row: 8 (NVFP4) or 4 (MXFP4). */
BD_MMA120_FN int bd_mma120_p_scale_row(int mx)
{
	return mx ? BD_PAGE_TOKENS / BD_MXFP4_BLOCK : BD_PAGE_TOKENS / BD_NVFP4_BLOCK;
}

/* Byte offset, in the P scales ([8][p_scale_row]), of the lane's SF_B register: head
 * bd_mma120_sfb_col(lane); NVFP4 the four bytes of k-step lane % 2, MXFP4 all four. */
BD_MMA120_FN uint32_t bd_mma120_p_sfb_off(int mx, int lane)
{
	int head = bd_mma120_sfb_col(lane);

	if (mx)
		return (uint32_t)(head * bd_mma120_p_scale_row(1));
	return (uint32_t)(head * bd_mma120_p_scale_row(0) + 4 * (bd_mma120_sfb_tid(lane) & 1));
}

/* ---- the emulation (lib/quant/mma_sm120.c) -------------------------------------------------- */

/* One warp's operands of one instruction, indexed by lane. */
struct bd_mma120_op {
	uint32_t a[BD_MMA120_LANES][4];
	uint32_t b[BD_MMA120_LANES][2];
	uint32_t sfa[BD_MMA120_LANES], sfb[BD_MMA120_LANES];
	int bid_a, tid_a, bid_b, tid_b;
};

/* The instruction on the CPU: acc[lane][e] holds C on entry and D on return (the decode
 * chains k-steps through it). fmt BD_FP4_NVFP4 is scale_vec::4X with UE4M3 scales (blocks of
 * 16), BD_FP4_MXFP4 scale_vec::2X with UE8M0 scales (blocks of 32). For every element, in lane
 * and element order: d = C, then for each block j in k order, d = d + RN32(p_j · sa_j · sb_j)
 * in FP32, where p_j = Σ_k x̂_A·x̂_B over the block's 16 (32) products is exact (E2M1 products are
 * multiples of 1/4; a block that sums to zero gives +0) and the scale product is exact;
 * RN32 rounds to FP32 (nearest even; it changes the value only outside FP32's range, which
 * only UE8M0 products reach). The ISA does not document the hardware's internal summation, so
 * a GPU may differ from this order in the last bits of d.
 * Returns 0; -EINVAL (NULL, or a selector outside the ISA's table: 4X byte-id ≠ 0, 2X byte-id
 * ∉ {0, 2}, thread-id-a ∉ {0, 1}, thread-id-b ∉ 0..3); -EDOM when a scale byte the
 * instruction reads is not a number of its type (UE4M3: bit 7 set or 0x7f; UE8M0: 0xff).
 * On error acc is unchanged. */
int bd_mma120_emulate(enum bd_fp4_format fmt, const struct bd_mma120_op *op,
		      float acc[BD_MMA120_LANES][4]);

#ifdef __cplusplus
}
#endif
#endif
