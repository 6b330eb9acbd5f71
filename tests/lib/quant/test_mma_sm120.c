/* test_mma_sm120.c — the sm_120a block-scaled FP4 MMA and its operand packing
 * (bd_mma_sm120.h).
 *
 * - The header's fragment functions against the PTX ISA's formulas ("Matrix Fragments for
 *   mma.m16n8k64", "Block Scaling for mma.sync"), written here as the ISA writes them.
 * - The emulation on hand-worked cases (one block, scale extremes, signs, ±0, selectors) and on
 *   random operands packed by the ISA's formulas against an FP64 sum.
 * - Every operand byte the decode kernel's lanes pass (K and V codes and scales of a page
 *   written by bd_page_write_head, the query, the P tile) against the layouts' own indexing,
 *   each byte read exactly once.
 * - A CPU model of kernels/decode_sm120.cu (page → packing → emulated MMA → online softmax
 *   with P quantization → split partials, BF16 sink+recent partial, LSE combine) against the
 *   reference decoder bd_ref_decode_gqa with the kernels' tiling (B_k = 128, same splits).
 */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "quant/bd_attn_ref.h"
#include "quant/bd_mma_sm120.h"
#include "testgen.h"

#define LANES BD_MMA120_LANES

/* ---- the ISA's formulas, element index i of a lane's fragment ------------------------------ */

/* A: a_i (register i/8, nibble i%8): row groupID for i < 8 or 16 ≤ i < 24, else groupID + 8;
 * column threadID_in_group·8 + (i & 7), plus 32 for i ≥ 16. */
static void isa_a(int lane, int i, int *row, int *col)
{
	const int group = lane >> 2, tig = lane % 4;

	*row = (i < 8 || (i >= 16 && i < 24)) ? group : group + 8;
	*col = tig * 8 + (i & 7) + (i >= 16 ? 32 : 0);
}

/* B: b_i (register i/8): row (k) threadID_in_group·8 + (i & 7), plus 32 for i ≥ 8; column
 * groupID. */
static void isa_b(int lane, int i, int *k, int *n)
{
	*k = (lane % 4) * 8 + (i & 7) + (i >= 8 ? 32 : 0);
	*n = lane >> 2;
}

/* C, D: c_i: row groupID for i < 2, else groupID + 8; column threadID_in_group·2 + (i & 1). */
static void isa_c(int lane, int i, int *row, int *col)
{
	*row = i < 2 ? lane >> 2 : (lane >> 2) + 8;
	*col = (lane % 4) * 2 + (i & 1);
}

/* The lane that supplies the scales of A's row m (B's column n) for a thread-id: the pair
 * lane % 4 ∈ {2 tid, 2 tid + 1} of quad m % 8, the upper thread for rows 8..15; lane 4n + tid. */
static int isa_sfa_lane(int m, int tid)
{
	return 4 * (m % 8) + 2 * tid + m / 8;
}

static int isa_sfb_lane(int n, int tid)
{
	return 4 * n + tid;
}

Test(mma_sm120, fragments_follow_the_isa)
{
	int seen_a[16][64] = { { 0 } }, seen_b[64][8] = { { 0 } }, seen_c[16][8] = { { 0 } };

	for (int lane = 0; lane < LANES; lane++) {
		for (int i = 0; i < 32; i++) {
			int row, col;
			isa_a(lane, i, &row, &col);
			cr_assert_eq(bd_mma120_a_row(lane, i / 8), row, "A lane %d a%d", lane, i);
			cr_assert_eq(bd_mma120_a_col(lane, i / 8, i % 8), col, "A lane %d a%d",
				     lane, i);
			seen_a[row][col]++;
		}
		for (int i = 0; i < 16; i++) {
			int k, n;
			isa_b(lane, i, &k, &n);
			cr_assert_eq(bd_mma120_b_k(lane, i / 8, i % 8), k, "B lane %d b%d", lane,
				     i);
			cr_assert_eq(bd_mma120_b_n(lane), n);
			seen_b[k][n]++;
		}
		for (int i = 0; i < 4; i++) {
			int row, col;
			isa_c(lane, i, &row, &col);
			cr_assert_eq(bd_mma120_c_row(lane, i), row);
			cr_assert_eq(bd_mma120_c_col(lane, i), col);
			seen_c[row][col]++;
		}
	}
	for (int m = 0; m < 16; m++) {
		for (int k = 0; k < 64; k++)
			cr_assert_eq(seen_a[m][k], 1, "A[%d][%d] held %d times", m, k,
				     seen_a[m][k]);
		for (int n = 0; n < 8; n++)
			cr_assert_eq(seen_c[m][n], 1);
		for (int tid = 0; tid < 2; tid++) {
			int lane = isa_sfa_lane(m, tid);
			cr_assert_eq(bd_mma120_sfa_row(lane), m);
			cr_assert_eq(bd_mma120_sfa_tid(lane), tid);
		}
	}
	for (int k = 0; k < 64; k++)
		for (int n = 0; n < 8; n++)
			cr_assert_eq(seen_b[k][n], 1);
	for (int n = 0; n < 8; n++)
		for (int tid = 0; tid < 4; tid++) {
			cr_assert_eq(bd_mma120_sfb_col(isa_sfb_lane(n, tid)), n);
			cr_assert_eq(bd_mma120_sfb_tid(isa_sfb_lane(n, tid)), tid);
		}
}

/* ---- the emulation -------------------------------------------------------------------------- */

/* One instruction as matrices: E2M1 codes of A [16][64] and B [64][8], scale bytes of A's rows
 * and B's columns per block (4 blocks of 16 for NVFP4, 2 of 32 for MXFP4), C. */
struct mats {
	uint8_t A[16][64], B[64][8];
	uint8_t SA[16][4], SB[4][8];
	float C[16][8];
};

/* The warp's registers for m by the ISA's formulas, scales in the lanes and bytes that the
 * selectors (bid, tid_a, tid_b) read; every other scale byte is `fill`. */
static void pack_op(const struct mats *m, enum bd_fp4_format fmt, int bid, int tid_a, int tid_b,
		    uint8_t fill, struct bd_mma120_op *op, float acc[LANES][4])
{
	const int nb = fmt == BD_FP4_NVFP4 ? 4 : 2;

	memset(op, 0, sizeof(*op));
	memset(op->sfa, fill, sizeof(op->sfa));
	memset(op->sfb, fill, sizeof(op->sfb));
	op->bid_a = op->bid_b = bid;
	op->tid_a = tid_a;
	op->tid_b = tid_b;
	for (int lane = 0; lane < LANES; lane++) {
		for (int i = 0; i < 32; i++) {
			int row, col;
			isa_a(lane, i, &row, &col);
			op->a[lane][i / 8] |= (uint32_t)m->A[row][col] << (4 * (i % 8));
		}
		for (int i = 0; i < 16; i++) {
			int k, n;
			isa_b(lane, i, &k, &n);
			op->b[lane][i / 8] |= (uint32_t)m->B[k][n] << (4 * (i % 8));
		}
		for (int i = 0; i < 4; i++) {
			int row, col;
			isa_c(lane, i, &row, &col);
			acc[lane][i] = m->C[row][col];
		}
	}
	for (int j = 0; j < nb; j++) {
		for (int r = 0; r < 16; r++) {
			uint32_t *s = &op->sfa[isa_sfa_lane(r, tid_a)];
			*s = (*s & ~(0xffu << (8 * (bid + j)))) | (uint32_t)m->SA[r][j]
									  << (8 * (bid + j));
		}
		for (int n = 0; n < 8; n++) {
			uint32_t *s = &op->sfb[isa_sfb_lane(n, tid_b)];
			*s = (*s & ~(0xffu << (8 * (bid + j)))) | (uint32_t)m->SB[j][n]
									  << (8 * (bid + j));
		}
	}
}

/* D[row][col] from the lanes' accumulators, by the ISA's formula. */
static float acc_at(float acc[LANES][4], int row, int col)
{
	for (int lane = 0; lane < LANES; lane++)
		for (int i = 0; i < 4; i++) {
			int r, c;
			isa_c(lane, i, &r, &c);
			if (r == row && c == col)
				return acc[lane][i];
		}
	cr_assert_fail("no lane holds D[%d][%d]", row, col);
	return NAN;
}

static int emulate(const struct mats *m, enum bd_fp4_format fmt, float acc[LANES][4])
{
	struct bd_mma120_op op;

	pack_op(m, fmt, 0, 0, 0, 0, &op, acc);
	return bd_mma120_emulate(fmt, &op, acc);
}

Test(mma_sm120, one_block_by_hand)
{
	static struct mats m;
	float acc[LANES][4];

	/* row 3 × column 5 over block 1 (k 16..19): (1.5·4) + (−2·3) + (6·−0.5) + (0.5·1) = −2.5,
	 * scaled by 2.5 (E4M3 0x42) · 0.375 (0x2c) = −2.34375, plus C = 1 → −1.34375; every
	 * other element is its C. */
	memset(&m, 0, sizeof(m));
	m.A[3][16] = 0x3;                 /* 1.5 */
	m.A[3][17] = 0xc;                 /* −2 */
	m.A[3][18] = 0x7;                 /* 6 */
	m.A[3][19] = 0x1;                 /* 0.5 */
	m.B[16][5] = 0x6;                 /* 4 */
	m.B[17][5] = 0x5;                 /* 3 */
	m.B[18][5] = 0x9;                 /* −0.5 */
	m.B[19][5] = 0x2;                 /* 1 */
	m.A[3][40] = m.B[40][5] = 0x7;    /* block 2: 6·6 scaled by 0 */
	memset(m.SA, 0x38, sizeof(m.SA)); /* 1.0 */
	memset(m.SB, 0x38, sizeof(m.SB));
	m.SA[3][1] = 0x42;
	m.SB[1][5] = 0x2c;
	m.SA[3][2] = 0x00;
	for (int r = 0; r < 16; r++)
		for (int c = 0; c < 8; c++)
			m.C[r][c] = (float)(r * 8 + c);
	m.C[3][5] = 1.0f;
	cr_assert_eq(emulate(&m, BD_FP4_NVFP4, acc), 0);
	for (int r = 0; r < 16; r++)
		for (int c = 0; c < 8; c++) {
			float want = r == 3 && c == 5 ? -1.34375f : (float)(r * 8 + c);
			cr_assert_eq(acc_at(acc, r, c), want, "D[%d][%d] = %g, want %g", r, c,
				     acc_at(acc, r, c), want);
		}
}

Test(mma_sm120, scale_extremes)
{
	static struct mats m;
	float acc[LANES][4];

	/* NVFP4: 16 products 6·6 at scales 448·448: 16·36·200704 = 115605504, exact in FP32 */
	memset(&m, 0, sizeof(m));
	for (int k = 0; k < 16; k++)
		m.A[0][k] = m.B[k][0] = 0x7;
	memset(m.SA, 0x7e, sizeof(m.SA));
	memset(m.SB, 0x7e, sizeof(m.SB));
	/* the smallest product: 0.5·0.5 at the subnormal scales 2^-9 · 2^-9 = 2^-20 */
	m.A[1][63] = m.B[63][1] = 0x1;
	m.SA[1][3] = 0x01;
	m.SB[3][1] = 0x01;
	cr_assert_eq(emulate(&m, BD_FP4_NVFP4, acc), 0);
	cr_assert_eq(acc_at(acc, 0, 0), 115605504.0f);
	cr_assert_eq(acc_at(acc, 1, 1), 0x1p-20f);
	cr_assert_eq(acc_at(acc, 0, 1), 0.0f);

	/* MXFP4: 2^127 · 2^-127 is 1 (UE8M0 codes 254 and 0); 2^127 · 2^127 · 36 is past FP32
	 * (+inf); 2^-127 · 2^-127 · 36 under its subnormals (+0) */
	memset(&m, 0, sizeof(m));
	for (int k = 0; k < 32; k++) {
		m.A[2][k] = 0x7;
		m.B[k][2] = 0x2; /* 1 */
	}
	m.A[4][32] = m.B[32][4] = 0x7;
	m.A[5][33] = m.B[33][6] = 0x7;
	memset(m.SA, 127, sizeof(m.SA));
	memset(m.SB, 127, sizeof(m.SB));
	m.SA[2][0] = 254;
	m.SB[0][2] = 0;
	m.SA[4][1] = m.SB[1][4] = 254;
	m.SA[5][1] = m.SB[1][6] = 0;
	cr_assert_eq(emulate(&m, BD_FP4_MXFP4, acc), 0);
	cr_assert_eq(acc_at(acc, 2, 2), 192.0f); /* 32 · 6 · 1 */
	cr_assert(isinf(acc_at(acc, 4, 4)) && acc_at(acc, 4, 4) > 0.0f);
	cr_assert_eq(acc_at(acc, 5, 6), 0.0f);
	cr_assert(!signbit(acc_at(acc, 5, 6)));
}

Test(mma_sm120, signs_and_zeros)
{
	static struct mats m;
	float acc[LANES][4];

	memset(&m, 0, sizeof(m));
	memset(m.SA, 0x38, sizeof(m.SA));
	memset(m.SB, 0x38, sizeof(m.SB));
	/* (−3)·(−4) = 12 in row 0; 3·(−4) = −12 in row 1; −0 (code 8) times 6 is 0 in row 2,
	 * as +0 is; a zero block added to C = −0 gives +0 (the emulation's block sums start at
	 * +0) */
	m.A[0][5] = 0xd;
	m.B[5][0] = 0xe;
	m.A[1][5] = 0x5;
	m.B[5][1] = 0xe;
	m.A[2][9] = 0x8;
	m.B[9][2] = 0x7;
	m.A[2][10] = 0x0;
	m.B[10][2] = 0xf; /* −6 */
	m.C[2][2] = -0.0f;
	m.C[0][0] = -12.0f;
	cr_assert_eq(emulate(&m, BD_FP4_NVFP4, acc), 0);
	cr_assert_eq(acc_at(acc, 0, 0), 0.0f);
	cr_assert_eq(acc_at(acc, 1, 1), -12.0f);
	cr_assert_eq(acc_at(acc, 2, 2), 0.0f);
	cr_assert(!signbit(acc_at(acc, 2, 2)));
}

Test(mma_sm120, selectors)
{
	static struct mats m;
	struct bd_mma120_op op;
	float acc[LANES][4], keep[LANES][4];

	memset(&m, 0, sizeof(m));
	for (int k = 0; k < 64; k++)
		for (int r = 0; r < 16; r++)
			m.A[r][k] = 0x2; /* 1 */
	for (int k = 0; k < 64; k++)
		for (int n = 0; n < 8; n++)
			m.B[k][n] = 0x2;
	for (int r = 0; r < 16; r++)
		for (int j = 0; j < 4; j++)
			m.SA[r][j] = (uint8_t)(127 + (r % 3) + j); /* 2^(r%3 + j) */
	for (int j = 0; j < 4; j++)
		for (int n = 0; n < 8; n++)
			m.SB[j][n] = (uint8_t)(126 + n % 2);
	/* 2X, byte pair 2, thread-ids 1 and 3; every byte not read is 0xff (NaN in UE8M0), so a
	 * read from the wrong lane or byte fails with -EDOM */
	pack_op(&m, BD_FP4_MXFP4, 2, 1, 3, 0xff, &op, acc);
	cr_assert_eq(bd_mma120_emulate(BD_FP4_MXFP4, &op, acc), 0);
	for (int r = 0; r < 16; r++)
		for (int n = 0; n < 8; n++) {
			/* 32 · (2^(r%3) · 2^(n%2 − 1) + 2^(r%3 + 1) · 2^(n%2 − 1)) */
			float want = 32.0f * ldexpf(3.0f, r % 3 + n % 2 - 1);
			cr_assert_eq(acc_at(acc, r, n), want, "D[%d][%d] %g want %g", r, n,
				     acc_at(acc, r, n), want);
		}
	/* a byte the instruction reads that is no number of its type */
	op.sfa[isa_sfa_lane(7, 1)] = 0xffffffffu;
	memcpy(keep, acc, sizeof(acc));
	cr_assert_eq(bd_mma120_emulate(BD_FP4_MXFP4, &op, acc), -EDOM);
	cr_assert_eq(memcmp(keep, acc, sizeof(acc)), 0);
	/* 4X: E4M3 0x7f and bytes with bit 7 set are refused; thread-id-a 1 is read */
	memset(m.SA, 0x38, sizeof(m.SA));
	memset(m.SB, 0x38, sizeof(m.SB));
	pack_op(&m, BD_FP4_NVFP4, 0, 1, 2, 0x80, &op, acc);
	cr_assert_eq(bd_mma120_emulate(BD_FP4_NVFP4, &op, acc), 0);
	cr_assert_eq(acc_at(acc, 9, 3), 64.0f);
	op.sfb[isa_sfb_lane(3, 2)] = 0x387f3838u;
	cr_assert_eq(bd_mma120_emulate(BD_FP4_NVFP4, &op, acc), -EDOM);
	/* selectors outside the ISA's table */
	op.sfb[isa_sfb_lane(3, 2)] = 0x38383838u;
	op.bid_a = 2;
	cr_assert_eq(bd_mma120_emulate(BD_FP4_NVFP4, &op, acc), -EINVAL);
	op.bid_a = 0;
	op.tid_a = 2;
	cr_assert_eq(bd_mma120_emulate(BD_FP4_NVFP4, &op, acc), -EINVAL);
	op.tid_a = 0;
	op.tid_b = 4;
	cr_assert_eq(bd_mma120_emulate(BD_FP4_NVFP4, &op, acc), -EINVAL);
	op.tid_b = 0;
	op.bid_b = 1;
	cr_assert_eq(bd_mma120_emulate(BD_FP4_MXFP4, &op, acc), -EINVAL);
	cr_assert_eq(bd_mma120_emulate(BD_FP4_NVFP4, NULL, acc), -EINVAL);
	cr_assert_eq(bd_mma120_emulate((enum bd_fp4_format)7, &op, acc), -EINVAL);
}

/* Random operands whose scales keep every partial sum inside FP32's 24 bits (NVFP4 scales in
 * [1, 2), UE8M0 in 2^-2..2^2, C a multiple of 1/4), so the emulation must equal the FP64 sum
 * of the matrices exactly: a misplaced element or scale changes it. */
Test(mma_sm120, random_operands_match_the_matrix_product)
{
	static struct mats m;
	struct tg_rng rng = { 1201 };

	for (int trial = 0; trial < 40; trial++) {
		enum bd_fp4_format fmt = trial % 2 ? BD_FP4_MXFP4 : BD_FP4_NVFP4;
		const int nb = fmt == BD_FP4_NVFP4 ? 4 : 2, bk = 64 / nb;
		const int bid = fmt == BD_FP4_MXFP4 ? 2 * (trial / 2 % 2) : 0;
		const int tid_a = trial / 4 % 2, tid_b = trial / 8 % 4;
		struct bd_mma120_op op;
		float acc[LANES][4];

		for (int r = 0; r < 16; r++)
			for (int k = 0; k < 64; k++)
				m.A[r][k] = (uint8_t)(tg_next(&rng) & 0xf);
		for (int k = 0; k < 64; k++)
			for (int n = 0; n < 8; n++)
				m.B[k][n] = (uint8_t)(tg_next(&rng) & 0xf);
		for (int j = 0; j < nb; j++) {
			for (int r = 0; r < 16; r++)
				m.SA[r][j] = (uint8_t)(fmt == BD_FP4_NVFP4
							       ? 0x38 + tg_next(&rng) % 8
							       : 125 + tg_next(&rng) % 5);
			for (int n = 0; n < 8; n++)
				m.SB[j][n] = (uint8_t)(fmt == BD_FP4_NVFP4
							       ? 0x38 + tg_next(&rng) % 8
							       : 125 + tg_next(&rng) % 5);
		}
		for (int r = 0; r < 16; r++)
			for (int n = 0; n < 8; n++)
				m.C[r][n] = (float)((int)(tg_next(&rng) % 801) - 400) / 4.0f;
		pack_op(&m, fmt, bid, tid_a, tid_b, 0, &op, acc);
		cr_assert_eq(bd_mma120_emulate(fmt, &op, acc), 0);
		for (int r = 0; r < 16; r++)
			for (int n = 0; n < 8; n++) {
				double want = m.C[r][n];
				for (int k = 0; k < 64; k++) {
					double s =
						fmt == BD_FP4_NVFP4
							? (double)bd_e4m3_decode(m.SA[r][k / bk]) *
								  bd_e4m3_decode(m.SB[k / bk][n])
							: (double)bd_ue8m0_decode(m.SA[r][k / bk]) *
								  bd_ue8m0_decode(m.SB[k / bk][n]);
					want += (double)bd_e2m1_decode(m.A[r][k]) *
						bd_e2m1_decode(m.B[k][n]) * s;
				}
				cr_assert_eq(acc_at(acc, r, n), (float)want,
					     "trial %d D[%d][%d] %.9g want %.9g", trial, r, n,
					     acc_at(acc, r, n), want);
			}
	}
}

/* ---- the decode kernel's operand bytes ------------------------------------------------------ */

static uint32_t rd_bytes(const uint8_t *p, int n)
{
	uint32_t v = 0;

	for (int i = 0; i < n; i++)
		v |= (uint32_t)p[i] << (8 * i);
	return v;
}

/* Element e of a packed E2M1 array (low nibble first), the test's own indexing. */
static uint8_t nib(const uint8_t *p, int e)
{
	return (uint8_t)((p[e / 2] >> (4 * (e % 2))) & 0xf);
}

/* The register word at byte off of region holds its packed elements first..first+7 (the
 * region's own element indexing); cnt[off..off+3] counts the reads. */
static void check_word(const uint8_t *region, uint32_t off, int first, int *cnt, const char *what,
		       int lane, int r)
{
	const uint32_t w = rd_bytes(region + off, 4);

	for (int i = 0; i < 8; i++)
		cr_assert_eq((w >> (4 * i)) & 0xf, nib(region, first + i),
			     "%s lane %d reg %d nibble %d", what, lane, r, i);
	for (int b = 0; cnt && b < 4; b++)
		cnt[off + b]++;
}

/* The scale bytes k-step ks reads from register s (byte-id BID(mx, ks), then nb bytes) are
 * want[0..nb). */
static void check_scales(uint32_t s, int mx, int ks, const uint8_t *want, const char *what,
			 int lane)
{
	const int nb = mx ? 2 : 4;

	for (int j = 0; j < nb; j++)
		cr_assert_eq((s >> (8 * (BD_MMA120_BID(mx, ks) + j))) & 0xff, want[j],
			     "%s ks %d lane %d scale byte %d", what, ks, lane, j);
}

static const struct bd_kvcfg *cfg_named(const char *name)
{
	const struct bd_kvcfg *c = bd_kvcfg_find(name);

	cr_assert(c, "no configuration %s", name);
	return c;
}

/* One page-head of random K and V written by bd_page_write_head; *ret_lay its geometry. */
static uint8_t *random_page(const char *cfgname, int d, uint64_t seed, struct bd_layout *ret_lay)
{
	const struct bd_kvcfg *cfg = cfg_named(cfgname);
	bd_bf16 *k = malloc(sizeof(bd_bf16) * BD_PAGE_TOKENS * (size_t)d);
	bd_bf16 *v = malloc(sizeof(bd_bf16) * BD_PAGE_TOKENS * (size_t)d);
	struct tg_rng rng = { seed };
	uint8_t *page;

	cr_assert(k && v);
	cr_assert_eq(bd_layout_init(ret_lay, cfg->page_fmt, 1, 1, d, 0, 1), 0);
	page = calloc(1, ret_lay->page_bytes);
	cr_assert(page);
	for (int i = 0; i < BD_PAGE_TOKENS * d; i++) {
		/* a spread of magnitudes, so that block scales differ */
		k[i] = bd_f32_to_bf16(tg_gauss(&rng) * ldexpf(1.0f, (int)(tg_next(&rng) % 5)));
		v[i] = bd_f32_to_bf16(tg_gauss(&rng) * ldexpf(1.0f, (int)(tg_next(&rng) % 5)));
	}
	cr_assert_eq(bd_page_write_head(ret_lay, cfg, k, v, NULL, page, 0), 0);
	free(k);
	free(v);
	return page;
}

/* For every lane of every instruction that reads a page's K (S^T tiles, k-steps) or V (O^T
 * tiles, k-steps), the word at the header's offset holds the elements the instruction's
 * fragment formulas say it holds, read from the page by the layout's own indexing (K:
 * token-major, element key·d + channel; V: channel-major, element channel·128 + token), and
 * the scale bytes the selectors pick are the blocks of those elements. Each code byte of the
 * page is read exactly once. */
static void check_page_operands(const char *cfgname, int d)
{
	struct bd_layout lay;
	uint8_t *page = random_page(cfgname, d, 77 + (uint64_t)d, &lay);
	const int mx = lay.fmt == BD_PAGE_MXFP4, KS = d / 64, B = lay.block, nb = 64 / B;
	char what[64];
	const uint8_t *kc = page + lay.k_codes_off, *ksc = page + lay.k_scales_off;
	const uint8_t *vc = page + lay.v_codes_off, *vsc = page + lay.v_scales_off;
	int *kcnt = calloc(lay.k_codes_bytes, sizeof(int)),
	    *vcnt = calloc(lay.v_codes_bytes, sizeof(int));

	cr_assert(kcnt && vcnt);
	for (int mt = 0; mt < BD_MMA120_S_TILES; mt++) {
		int keys = 0;
		for (int r = 0; r < 16; r++)
			keys |= 1 << (bd_mma120_s_key(mt, r) - 16 * mt);
		cr_assert_eq(keys, 0xffff, "tile %d: its rows are not keys 16mt..16mt+15", mt);
		snprintf(what, sizeof(what), "%s d %d K tile %d", cfgname, d, mt);
		for (int ks = 0; ks < KS; ks++)
			for (int lane = 0; lane < LANES; lane++) {
				for (int r = 0; r < 4; r++) {
					const int key = bd_mma120_s_key(mt,
									bd_mma120_a_row(lane, r));
					check_word(kc, bd_mma120_k_codes_off(d, mt, ks, lane, r),
						   key * d + 64 * ks + bd_mma120_a_col(lane, r, 0),
						   kcnt, what, lane, r);
				}
				if (bd_mma120_sfa_tid(lane) != BD_MMA120_TIDA(mx, ks))
					continue;
				const int key = bd_mma120_s_key(mt, bd_mma120_sfa_row(lane));
				check_scales(rd_bytes(ksc + bd_mma120_k_sfa_off(mx, d, mt, lane),
						      bd_mma120_scale_bytes(mx, d)),
					     mx, ks, ksc + key * (d / B) + nb * ks, what, lane);
			}
	}
	for (int mc = 0; mc < d / 16; mc++) {
		snprintf(what, sizeof(what), "%s d %d V tile %d", cfgname, d, mc);
		for (int ks = 0; ks < 2; ks++)
			for (int lane = 0; lane < LANES; lane++) {
				for (int r = 0; r < 4; r++) {
					const int ch = 16 * mc + bd_mma120_a_row(lane, r);
					check_word(vc, bd_mma120_v_codes_off(mc, ks, lane, r),
						   ch * BD_PAGE_TOKENS + 64 * ks +
							   bd_mma120_a_col(lane, r, 0),
						   vcnt, what, lane, r);
				}
				if (bd_mma120_sfa_tid(lane) != BD_MMA120_TIDA(mx, ks))
					continue;
				const int ch = 16 * mc + bd_mma120_sfa_row(lane);
				check_scales(rd_bytes(vsc + bd_mma120_v_sfa_off(mx, mc, lane), 4),
					     mx, ks, vsc + ch * (BD_PAGE_TOKENS / B) + nb * ks,
					     what, lane);
			}
	}
	for (size_t i = 0; i < lay.k_codes_bytes; i++)
		cr_assert_eq(kcnt[i], 1, "%s d %d: K code byte %zu read %d times", cfgname, d, i,
			     kcnt[i]);
	for (size_t i = 0; i < lay.v_codes_bytes; i++)
		cr_assert_eq(vcnt[i], 1, "%s d %d: V code byte %zu read %d times", cfgname, d, i,
			     vcnt[i]);
	free(kcnt);
	free(vcnt);
	free(page);
}

Test(mma_sm120, page_operands_are_the_layout_bytes)
{
	for (int d = 64; d <= 128; d *= 2) {
		check_page_operands("bitdecoding-nvfp4", d);
		check_page_operands("bitdecoding-mxfp4", d);
	}
}

/* The query's B operand and scales (one column's packed codes and scales, as bd_query_quantize
 * leaves them), the P tile's B operand and scales, and the stacked columns. */
Test(mma_sm120, query_and_p_operands)
{
	struct tg_rng rng = { 4242 };

	for (int d = 64; d <= 128; d *= 2)
		for (int mx = 0; mx < 2; mx++) {
			const int nb = mx ? 64 / BD_MXFP4_BLOCK : 64 / BD_NVFP4_BLOCK, KS = d / 64;
			float q[128];
			struct bd_qquant qq;
			int cnt[64] = { 0 };

			for (int c = 0; c < d; c++)
				q[c] = tg_gauss(&rng);
			cr_assert_eq(
				bd_query_quantize(q, d, mx ? BD_FP4_MXFP4 : BD_FP4_NVFP4, 1, &qq),
				0);
			for (int ks = 0; ks < KS; ks++)
				for (int lane = 0; lane < LANES; lane++) {
					/* the lanes of column 0 count: every column's read alike */
					for (int r = 0; r < 2; r++)
						check_word(qq.codes[0],
							   bd_mma120_q_codes_off(ks, lane, r),
							   64 * ks + bd_mma120_b_k(lane, r, 0),
							   lane < 4 ? cnt : NULL, "query", lane, r);
					if (bd_mma120_sfb_tid(lane) != BD_MMA120_TIDB(mx, ks))
						continue;
					check_scales(rd_bytes(qq.scales[0] + bd_mma120_q_sfb_off(
										     mx, d, lane),
							      bd_mma120_scale_bytes(mx, d)),
						     mx, ks, qq.scales[0] + nb * ks, "query scales",
						     lane);
				}
			for (int i = 0; i < d / 2; i++)
				cr_assert_eq(cnt[i], 1, "d %d: query byte %d read %d times", d, i,
					     cnt[i]);
		}

	/* P tile: [8][64] codes (key κ of head h in nibble κ % 2 of byte 64h + κ/2), scales [8][8]
	 * (NVFP4, block of 16) or [8][4] (MXFP4, block of 32) */
	for (int mx = 0; mx < 2; mx++) {
		uint8_t pt[8 * 64], ps[8 * 8];
		const int row = bd_mma120_p_scale_row(mx), nb = mx ? 2 : 4;
		int cnt[8 * 64] = { 0 };

		cr_assert_eq(row, mx ? 4 : 8);
		for (int i = 0; i < 8 * 64; i++)
			pt[i] = (uint8_t)tg_next(&rng);
		for (int i = 0; i < 8 * 8; i++)
			ps[i] = (uint8_t)tg_next(&rng);
		for (int ks = 0; ks < 2; ks++)
			for (int lane = 0; lane < LANES; lane++) {
				/* head h's key κ is element 128h + κ of the tile */
				for (int r = 0; r < 2; r++)
					check_word(pt, bd_mma120_p_codes_off(ks, lane, r),
						   128 * bd_mma120_b_n(lane) + 64 * ks +
							   bd_mma120_b_k(lane, r, 0),
						   cnt, "P tile", lane, r);
				if (bd_mma120_sfb_tid(lane) != BD_MMA120_TIDB(mx, ks))
					continue;
				check_scales(rd_bytes(ps + bd_mma120_p_sfb_off(mx, lane), 4), mx,
					     ks, ps + bd_mma120_sfb_col(lane) * row + nb * ks,
					     "P scales", lane);
			}
		for (int i = 0; i < 8 * 64; i++)
			cr_assert_eq(cnt[i], 1);
	}

	/* the softmax's byte for S^T rows (c_row(lane, 0), c_row(lane, 2)) of tile mt holds keys
	 * 2j (low nibble) and 2j + 1 */
	for (int mt = 0; mt < BD_MMA120_S_TILES; mt++)
		for (int lane = 0; lane < LANES; lane++) {
			uint32_t j = bd_mma120_p_byte(mt, lane);
			cr_assert_eq(bd_mma120_s_key(mt, bd_mma120_c_row(lane, 0)), (int)(2 * j));
			cr_assert_eq(bd_mma120_s_key(mt, bd_mma120_c_row(lane, 2)),
				     (int)(2 * j + 1));
		}

	/* stacked columns: every (head < G, term < nterms) once; pairs put both terms of a head in
	 * one lane's two accumulator columns */
	for (int G = 1; G <= 8; G++)
		for (int nterms = 1; nterms <= 2; nterms++) {
			const int pairs = bd_mma120_pairs(G, nterms);
			const int tiles = bd_mma120_col_tiles(G, nterms);
			int seen[8][2] = { { 0 } };
			cr_assert(tiles * 8 >= G * nterms);
			for (int t = 0; t < tiles; t++)
				for (int n = 0; n < 8; n++) {
					int h = bd_mma120_col_head(pairs, t, n),
					    tm = bd_mma120_col_term(pairs, n);
					if (h < G && tm < nterms)
						seen[h][tm]++;
					if (pairs && n % 2 == 1)
						cr_assert_eq(bd_mma120_col_head(pairs, t, n - 1),
							     h);
				}
			for (int h = 0; h < G; h++)
				for (int tm = 0; tm < nterms; tm++)
					cr_assert_eq(seen[h][tm], 1,
						     "G %d nterms %d head %d term %d", G, nterms, h,
						     tm);
		}
}

/* ---- a CPU model of kernels/decode_sm120.cu -------------------------------------------------- */

/* One (request, KV head) of a step as the kernel holds it: the configuration's constants and
 * the query as its prologue leaves it in shared memory (q' per head; packed codes and scales
 * per term and head, zero for heads ≥ G and a missing second term; g_q per term and head). */
struct kmodel {
	const struct bd_kvcfg *cfg;
	const struct bd_layout *lay;
	enum bd_fp4_format fmt;
	int mx, d, G, nterms, pairs, tiles, hs_n;
	float gamma, log2c;
	struct bd_pscale pscale;
	float qrot[8][128];
	uint8_t qc[2][8][64], qs[2][8][8];
	float gq[2][8];
};

/* The threads of one split CTA: the running maximum per head (every thread computes the same
 * values), ℓ per thread and S slot, the O^T accumulators per thread and channel tile. */
struct ksplit {
	float m[8];
	float l[BD_MMA120_WARPS][LANES][2];
	float lq[BD_MMA120_WARPS][LANES][2]; /* the quantized mass Σ s_P·P̂ (cfg->p_norm) */
	float o[BD_MMA120_WARPS][LANES][2][4];
};

/* The head of a thread's S slot hs: its accumulator columns are both terms of head 4hs + t in
 * the pairs layout, heads 2t and 2t + 1 in the single layout (t = lane % 4). */
static int s_head(const struct kmodel *M, int hs, int lane)
{
	return M->pairs ? 4 * hs + (lane & 3) : 2 * (lane & 3) + hs;
}

static void kmodel_init(struct kmodel *M, const struct bd_kvcfg *cfg, const struct bd_layout *lay,
			const struct bd_decode_params *dp, int G, const float *q)
{
	const bool under = cfg->p_quant == BD_P_NVFP4_UNDERFLOW;
	const float scale = dp->softmax_scale != 0.0f ? dp->softmax_scale
						      : 1.0f / sqrtf((float)lay->d);

	memset(M, 0, sizeof(*M));
	M->cfg = cfg;
	M->lay = lay;
	M->mx = lay->fmt == BD_PAGE_MXFP4;
	M->fmt = M->mx ? BD_FP4_MXFP4 : BD_FP4_NVFP4;
	M->d = lay->d;
	M->G = G;
	M->nterms = cfg->query_terms;
	M->pairs = bd_mma120_pairs(G, M->nterms);
	M->tiles = bd_mma120_col_tiles(G, M->nterms);
	M->hs_n = M->pairs ? M->tiles : 2;
	M->gamma = 1.4426950408889634f * scale;
	M->log2c = under ? log2f(dp->c) : 0.0f;
	M->pscale = under ? (struct bd_pscale){ dp->c, dp->tau, true }
			  : (struct bd_pscale){ 1.0f, dp->tau, false };
	for (int hd = 0; hd < G; hd++) {
		struct bd_qquant qq;
		memcpy(M->qrot[hd], q + (size_t)hd * M->d, sizeof(float) * (size_t)M->d);
		if (cfg->hadamard)
			cr_assert_eq(bd_fwht(M->qrot[hd], M->d), 0);
		cr_assert_eq(bd_query_quantize(M->qrot[hd], M->d, M->fmt, M->nterms, &qq), 0);
		for (int t = 0; t < M->nterms; t++) {
			memcpy(M->qc[t][hd], qq.codes[t], (size_t)M->d / 2);
			memcpy(M->qs[t][hd], qq.scales[t], (size_t)(M->d / lay->block));
			M->gq[t][hd] = qq.g[t];
		}
	}
}

/* S^T tile mt of a page-head: acc[nt] the accumulators of column tile nt, k-steps chained
 * through C as the kernel chains them. */
static void s_tile(const struct kmodel *M, const uint8_t *head, int mt, float acc[2][LANES][4])
{
	const struct bd_layout *lay = M->lay;
	const int d = M->d, mx = M->mx, sb = bd_mma120_scale_bytes(mx, d);

	memset(acc, 0, sizeof(float) * 2 * LANES * 4);
	for (int ks = 0; ks < d / 64; ks++)
		for (int nt = 0; nt < M->tiles; nt++) {
			struct bd_mma120_op op = { .bid_a = BD_MMA120_BID(mx, ks),
						   .tid_a = BD_MMA120_TIDA(mx, ks),
						   .bid_b = BD_MMA120_BID(mx, ks),
						   .tid_b = BD_MMA120_TIDB(mx, ks) };
			for (int lane = 0; lane < LANES; lane++) {
				const int bn = bd_mma120_b_n(lane), sn = bd_mma120_sfb_col(lane);
				const uint8_t *qcol = M->qc[bd_mma120_col_term(M->pairs, bn)]
							   [bd_mma120_col_head(M->pairs, nt, bn)];
				const uint8_t *qscol = M->qs[bd_mma120_col_term(M->pairs, sn)]
							    [bd_mma120_col_head(M->pairs, nt, sn)];
				for (int r = 0; r < 4; r++)
					op.a[lane][r] = rd_bytes(
						head + lay->k_codes_off +
							bd_mma120_k_codes_off(d, mt, ks, lane, r),
						4);
				op.sfa[lane] = rd_bytes(
					head + lay->k_scales_off +
						bd_mma120_k_sfa_off(mx, d, mt, lane),
					sb);
				for (int r = 0; r < 2; r++)
					op.b[lane][r] = rd_bytes(
						qcol + bd_mma120_q_codes_off(ks, lane, r), 4);
				op.sfb[lane] = rd_bytes(qscol + bd_mma120_q_sfb_off(mx, d, lane),
							sb);
			}
			cr_assert_eq(bd_mma120_emulate(M->fmt, &op, acc[nt]), 0);
		}
}

/* O^T channel tile mc of a page-head with the P tile (codes pt [8][64], scales ps). */
static void o_tile(const struct kmodel *M, const uint8_t *head, const uint8_t *pt,
		   const uint8_t *ps, int mc, float acc[LANES][4])
{
	const struct bd_layout *lay = M->lay;
	const int mx = M->mx;

	memset(acc, 0, sizeof(float) * LANES * 4);
	for (int ks = 0; ks < 2; ks++) {
		struct bd_mma120_op op = { .bid_a = BD_MMA120_BID(mx, ks),
					   .tid_a = BD_MMA120_TIDA(mx, ks),
					   .bid_b = BD_MMA120_BID(mx, ks),
					   .tid_b = BD_MMA120_TIDB(mx, ks) };
		for (int lane = 0; lane < LANES; lane++) {
			for (int r = 0; r < 4; r++)
				op.a[lane][r] = rd_bytes(
					head + lay->v_codes_off +
						bd_mma120_v_codes_off(mc, ks, lane, r),
					4);
			op.sfa[lane] = rd_bytes(
				head + lay->v_scales_off + bd_mma120_v_sfa_off(mx, mc, lane), 4);
			for (int r = 0; r < 2; r++)
				op.b[lane][r] = rd_bytes(pt + bd_mma120_p_codes_off(ks, lane, r),
							 4);
			op.sfb[lane] = rd_bytes(ps + bd_mma120_p_sfb_off(mx, lane), 4);
		}
		cr_assert_eq(bd_mma120_emulate(M->fmt, &op, acc), 0);
	}
}

/* The value at `lane` after the kernel's butterfly over the 8 lanes of a column
 * (v = v + shfl_xor(v, 4), then 8, then 16). */
static float lanes_sum(const float v[LANES], int lane)
{
	float a[LANES], b[LANES];

	memcpy(a, v, sizeof(a));
	for (int off = 4; off < LANES; off *= 2) {
		for (int l = 0; l < LANES; l++)
			b[l] = a[l] + a[l ^ off];
		memcpy(a, b, sizeof(a));
	}
	return a[lane];
}

/* One page of a split (NUMERICS.md §6 with tile = page): S^T per warp, logits in the
 * reference's order ((acc₁·g_q1 + acc₂·g_q2)·g_K)·γ, the tile maximum over the four warps,
 * P and ℓ per thread, P quantized per block in key order into the P tile, O^T per warp and
 * o = α·o + acc·g_V. masked0: the request's first page with a sink (tile 0 = keys 0..15). */
static void kmodel_page(const struct kmodel *M, struct ksplit *T, const uint8_t *head,
			const float g[2], bool masked0)
{
	const int G = M->G, KS = M->d / 64;
	float S[BD_MMA120_WARPS][LANES][2][2][2]; /* [w][lane][j][hs][r] */
	float Sk[8][BD_PAGE_TOKENS], Pk[8][BD_PAGE_TOKENS], mnew[8], alpha[8];
	uint8_t pt[8 * BD_MMA120_P_ROW] = { 0 }, ps[8 * 8] = { 0 };

	for (int hd = 0; hd < 8; hd++)
		for (int k = 0; k < BD_PAGE_TOKENS; k++)
			Sk[hd][k] = -INFINITY;
	for (int w = 0; w < BD_MMA120_WARPS; w++)
		for (int j = 0; j < 2; j++) {
			const int mt = 2 * w + j;
			float acc[2][LANES][4];
			s_tile(M, head, mt, acc);
			for (int lane = 0; lane < LANES; lane++)
				for (int hs = 0; hs < M->hs_n; hs++)
					for (int r = 0; r < 2; r++) {
						const int hd = s_head(M, hs, lane);
						float dot;
						if (M->pairs) {
							dot = acc[hs][lane][2 * r] * M->gq[0][hd];
							if (M->nterms == 2)
								dot = dot +
								      acc[hs][lane][2 * r + 1] *
									      M->gq[1][hd];
						} else {
							dot = acc[0][lane][2 * r + hs] *
							      M->gq[0][hd];
						}
						S[w][lane][j][hs][r] = hd >= G || (masked0 &&
										   mt == 0)
									       ? -INFINITY
									       : (dot * g[0]) *
											 M->gamma;
						Sk[hd][bd_mma120_s_key(
							mt, bd_mma120_c_row(lane, 2 * r))] =
							S[w][lane][j][hs][r];
					}
		}
	for (int hd = 0; hd < 8; hd++) {
		float mx = -INFINITY;
		for (int k = 0; k < BD_PAGE_TOKENS; k++)
			mx = fmaxf(mx, Sk[hd][k]);
		mnew[hd] = fmaxf(T->m[hd], mx);
		alpha[hd] = T->m[hd] == -INFINITY ? 0.0f : exp2f(T->m[hd] - mnew[hd]);
	}
	/* P and ℓ per thread in its order (tile j, then row), then per block in key order */
	for (int w = 0; w < BD_MMA120_WARPS; w++)
		for (int lane = 0; lane < LANES; lane++)
			for (int hs = 0; hs < M->hs_n; hs++) {
				const int hd = s_head(M, hs, lane);
				float lsum = 0.0f;
				for (int j = 0; j < 2; j++)
					for (int r = 0; r < 2; r++) {
						const float s = S[w][lane][j][hs][r];
						const float P = s == -INFINITY || mnew[hd] ==
											  -INFINITY
									? 0.0f
									: exp2f(s - mnew[hd] +
										M->log2c);
						lsum = lsum + P;
						Pk[hd][bd_mma120_s_key(
							2 * w + j, bd_mma120_c_row(lane, 2 * r))] =
							P;
					}
				T->l[w][lane][hs] = alpha[hd] * T->l[w][lane][hs] + lsum;
			}
	for (int hd = 0; hd < G; hd++) {
		if (M->mx) {
			for (int b = 0; b < 4; b++)
				cr_assert_eq(
					bd_mxfp4_quantize_block(Pk[hd] + 32 * b, BD_SCALE_STANDARD,
								pt + BD_MMA120_P_ROW * hd + 16 * b,
								&ps[4 * hd + b]),
					0);
			continue;
		}
		for (int b = 0; b < 8; b++) {
			float smax = -INFINITY, phat[16];
			for (int i = 0; i < 16; i++)
				smax = fmaxf(smax, Sk[hd][16 * b + i]);
			const float pmax = smax == -INFINITY ? 0.0f : exp2f(smax - mnew[hd]);
			bd_p_quantize_block_nvfp4(Pk[hd] + 16 * b, pmax, &M->pscale, phat,
						  &ps[8 * hd + b]);
			for (int i = 0; i < 16; i++)
				bd_fp4_set(pt + BD_MMA120_P_ROW * hd, (size_t)(16 * b + i),
					   bd_e2m1_encode(phat[i]));
		}
	}
	/* the quantized mass per thread, in its order (tile j, then row), as the kernel sums
	 * its blocks' s_P·P̂ */
	for (int w = 0; w < BD_MMA120_WARPS && M->cfg->p_norm == BD_NORM_QMASS; w++)
		for (int lane = 0; lane < LANES; lane++)
			for (int hs = 0; hs < M->hs_n; hs++) {
				const int hd = s_head(M, hs, lane);
				float qsum = 0.0f;
				for (int j = 0; j < 2; j++)
					for (int r = 0; r < 2; r++) {
						const int key = bd_mma120_s_key(
							2 * w + j, bd_mma120_c_row(lane, 2 * r));
						const float sp =
							M->mx ? bd_ue8m0_decode(ps[4 * hd + key / 32])
							      : bd_e4m3_decode(ps[8 * hd + key / 16]);
						qsum = qsum + sp * bd_e2m1_decode(bd_fp4_get(
									   pt + BD_MMA120_P_ROW * hd,
									   (size_t)key));
					}
				T->lq[w][lane][hs] = alpha[hd] * T->lq[w][lane][hs] + qsum;
			}
	for (int w = 0; w < BD_MMA120_WARPS; w++)
		for (int j = 0; j < KS; j++) {
			float acc[LANES][4];
			o_tile(M, head, pt, ps, KS * w + j, acc);
			for (int lane = 0; lane < LANES; lane++)
				for (int e = 0; e < 4; e++) {
					const int hd = bd_mma120_c_col(lane, e);
					T->o[w][lane][j][e] = alpha[hd] * T->o[w][lane][j][e] +
							      acc[lane][e] * g[1];
				}
		}
	memcpy(T->m, mnew, sizeof(mnew));
}

/* The split's normalized partial: ℓ summed per warp by the butterfly, then over the warps in
 * order; o_s [G][NS + 1][d] and lse_s [G][NS + 1] at split s (−inf and 0 for an empty split). */
static void kmodel_finish(const struct kmodel *M, const struct ksplit *T, int s, int NS, float *o_s,
			  float *lse_s)
{
	const int d = M->d, KS = d / 64;
	float L[8] = { 0 }, Q[8] = { 0 };

	for (int w = 0; w < BD_MMA120_WARPS; w++) {
		float red[8] = { 0 }, redq[8] = { 0 };
		for (int hs = 0; hs < M->hs_n; hs++) {
			float v[LANES], vq[LANES];
			for (int lane = 0; lane < LANES; lane++) {
				v[lane] = T->l[w][lane][hs];
				vq[lane] = T->lq[w][lane][hs];
			}
			for (int lane = 0; lane < 4; lane++) {
				red[s_head(M, hs, lane)] = lanes_sum(v, lane);
				redq[s_head(M, hs, lane)] = lanes_sum(vq, lane);
			}
		}
		for (int hd = 0; hd < 8; hd++) {
			L[hd] = L[hd] + red[hd];
			Q[hd] = Q[hd] + redq[hd];
		}
	}
	/* the divisor: ℓ, or the quantized mass (the LSE stays from ℓ) */
	float den[8];
	for (int hd = 0; hd < 8; hd++)
		den[hd] = M->cfg->p_norm == BD_NORM_QMASS && Q[hd] > 0.0f ? Q[hd] : L[hd];
	for (int w = 0; w < BD_MMA120_WARPS; w++)
		for (int j = 0; j < KS; j++)
			for (int lane = 0; lane < LANES; lane++)
				for (int e = 0; e < 4; e++) {
					const int hd = bd_mma120_c_col(lane, e);
					const int ch = 16 * (KS * w + j) + bd_mma120_c_row(lane, e);
					if (hd < M->G)
						o_s[((size_t)hd * (NS + 1) + s) * d + ch] =
							L[hd] == 0.0f ? 0.0f
								      : T->o[w][lane][j][e] / den[hd];
				}
	for (int hd = 0; hd < M->G; hd++)
		lse_s[hd * (NS + 1) + s] = L[hd] == 0.0f ? -INFINITY
							 : T->m[hd] + log2f(L[hd]) - M->log2c;
}

/* The BF16 partial CTA: the sink rows (with a sink) and the recent rows, one thread per head
 * for the logits' maximum and ℓ and one per (head, channel) for P·V, each sum in row order. */
static void kmodel_bf16(const struct kmodel *M, const struct bd_kv_view *kv, int n_full, int NS,
			float *o_s, float *lse_s)
{
	const int d = M->d, n = kv->n_tokens;
	const int nsink = M->cfg->sink ? (n < BD_SINK_TOKENS ? n : BD_SINK_TOKENS) : 0;
	int t_recent = n_full * BD_PAGE_TOKENS;
	if (M->cfg->sink && t_recent < BD_SINK_TOKENS)
		t_recent = BD_SINK_TOKENS;
	const int cnt = nsink + (n > t_recent ? n - t_recent : 0),
		  r0 = t_recent - n_full * BD_PAGE_TOKENS;
	void *slot = (void *)kv->slot;
	const bd_bf16 *sk = bd_slot_sink_k(M->lay, slot, kv->layer, kv->kv_head);
	const bd_bf16 *sv = bd_slot_sink_v(M->lay, slot, kv->layer, kv->kv_head);
	const bd_bf16 *rk = bd_slot_recent_k(M->lay, slot, kv->layer, kv->kv_head);
	const bd_bf16 *rv = bd_slot_recent_v(M->lay, slot, kv->layer, kv->kv_head);

	for (int hd = 0; hd < M->G; hd++) {
		float P[BD_SINK_TOKENS + BD_RECENT_TOKENS], m = -INFINITY, l = 0.0f;
		float *o = o_s + ((size_t)hd * (NS + 1) + NS) * d;
		for (int i = 0; i < cnt; i++) {
			const bd_bf16 *kr = i < nsink ? sk + (size_t)i * d
						      : rk + (size_t)(r0 + i - nsink) * d;
			float acc = 0.0f;
			for (int c = 0; c < d; c++)
				acc = acc + bd_bf16_to_f32(bd_f32_to_bf16(M->qrot[hd][c])) *
						    bd_bf16_to_f32(kr[c]);
			P[i] = M->gamma * acc;
			m = fmaxf(m, P[i]);
		}
		for (int i = 0; i < cnt; i++) {
			P[i] = exp2f(P[i] - m);
			l = l + P[i];
		}
		for (int c = 0; c < d; c++) {
			float acc = 0.0f;
			for (int i = 0; i < cnt; i++) {
				const bd_bf16 *vr = i < nsink ? sv + (size_t)i * d
							      : rv + (size_t)(r0 + i - nsink) * d;
				acc = acc + P[i] * bd_bf16_to_f32(vr[c]);
			}
			o[c] = cnt ? acc / l : 0.0f;
		}
		lse_s[hd * (NS + 1) + NS] = cnt ? m + log2f(l) : -INFINITY;
	}
}

/* The model's output for the G heads of one view: the FP4 splits of dp->n_splits (the
 * reference's chunk rule), the BF16 partial, then bd_lse_combine (the kernel's combine follows
 * it operation for operation). */
static void kmodel_decode(const struct bd_kvcfg *cfg, const struct bd_decode_params *dp,
			  const struct bd_kv_view *kv, const float *q, int G, float *ret_o,
			  float *ret_lse)
{
	const struct bd_layout *lay = kv->lay;
	const int d = lay->d, NS = dp->n_splits, n_full = (kv->n_tokens - 1) / BD_PAGE_TOKENS;
	const int chunk = n_full > NS ? (n_full + NS - 1) / NS : 1;
	float *o_s = calloc((size_t)G * (NS + 1) * d, sizeof(float));
	float *lse_s = calloc((size_t)G * (NS + 1), sizeof(float));
	struct kmodel *M = malloc(sizeof(*M));
	struct ksplit *T = malloc(sizeof(*T));

	cr_assert(o_s && lse_s && M && T);
	kmodel_init(M, cfg, lay, dp, G, q);
	for (int s = 0; s < NS; s++) {
		const int pb = s * chunk < n_full ? s * chunk : n_full;
		const int pe = s * chunk + chunk < n_full ? s * chunk + chunk : n_full;
		memset(T, 0, sizeof(*T));
		for (int hd = 0; hd < 8; hd++)
			T->m[hd] = -INFINITY;
		for (int p = pb; p < pe; p++) {
			const uint8_t *base = bd_layout_page(lay, (void *)kv->arena, kv->layer,
							     kv->block_table[p]);
			float g[2] = { 1.0f, 1.0f };
			if (!M->mx)
				memcpy(g, base + lay->gscale_off + (size_t)kv->kv_head * sizeof(g),
				       sizeof(g));
			kmodel_page(M, T, base + (size_t)kv->kv_head * lay->head_bytes, g,
				    cfg->sink && p == 0);
		}
		kmodel_finish(M, T, s, NS, o_s, lse_s);
	}
	kmodel_bf16(M, kv, n_full, NS, o_s, lse_s);
	for (int hd = 0; hd < G; hd++)
		bd_lse_combine(o_s + (size_t)hd * (NS + 1) * d, lse_s + (size_t)hd * (NS + 1),
			       NS + 1, d, ret_o + (size_t)hd * d, &ret_lse[hd]);
	free(o_s);
	free(lse_s);
	free(M);
	free(T);
}

/* ---- decode problems ------------------------------------------------------------------------- */

enum { P_HEADS = 2, P_MAXREQ = 8 };

/* Requests of one layer and two KV heads written through the real write path
 * (bd_kv_write_token, bd_page_promote when a position fills a page) into a shuffled block
 * table: keys a per-channel bias plus unit noise with three outlier channels ×10–20, values a
 * bias plus noise, μ_k the mean key; queries unit Gaussian, or zero. */
struct problem {
	const struct bd_kvcfg *cfg;
	struct bd_layout lay;
	int d, G, nreq, len[P_MAXREQ];
	int bt_stride;  /* block-table row: pages of the longest request */
	uint8_t *arena; /* the arena, then the slots */
	uint8_t *slots; /* [nreq][lay.slot_bytes] */
	int32_t *bt;    /* [nreq][bt_stride] */
	float *q;       /* [nreq][P_HEADS][G][d] */
};

static uint8_t *slot_of(const struct problem *P, int r)
{
	return P->slots + (size_t)r * P->lay.slot_bytes;
}

static void problem_build(struct problem *P, const char *cfgname, int d, int G, const int *lens,
			  int nreq, uint64_t seed, bool q_zero)
{
	struct tg_rng rng = { seed };
	int pages = 0, next = 0, maxlen = 0;

	memset(P, 0, sizeof(*P));
	P->cfg = cfg_named(cfgname);
	P->d = d;
	P->G = G;
	P->nreq = nreq;
	for (int r = 0; r < nreq; r++) {
		pages += lens[r] / BD_PAGE_TOKENS + 1;
		maxlen = lens[r] > maxlen ? lens[r] : maxlen;
	}
	P->bt_stride = maxlen / BD_PAGE_TOKENS + 1;
	cr_assert_eq(bd_layout_init(&P->lay, P->cfg->page_fmt, 1, P_HEADS, d, 0, (size_t)pages), 0);
	P->arena = calloc(1, P->lay.arena_bytes + (size_t)nreq * P->lay.slot_bytes);
	P->slots = P->arena + P->lay.arena_bytes;
	P->bt = calloc((size_t)nreq * P->bt_stride, sizeof(int32_t));
	int32_t *pool = malloc(sizeof(int32_t) * (size_t)pages);
	float *k = malloc(sizeof(float) * P_HEADS * (size_t)maxlen * d);
	float *v = malloc(sizeof(float) * P_HEADS * (size_t)maxlen * d);
	float mu[P_HEADS][128];
	cr_assert(P->arena && P->bt && pool && k && v);
	for (int i = 0; i < pages; i++)
		pool[i] = i;
	tg_shuffle_i32(&rng, pool, (size_t)pages);

	for (int r = 0; r < nreq; r++) {
		const int n = lens[r];
		int32_t *bt = P->bt + (size_t)r * P->bt_stride;
		P->len[r] = n;
		for (int i = 0; i <= n / BD_PAGE_TOKENS; i++)
			bt[i] = pool[next++];
		for (int h = 0; h < P_HEADS; h++) {
			float bias[128], gain[128], vbias[128];
			float *kh = k + (size_t)h * maxlen * d, *vh = v + (size_t)h * maxlen * d;
			for (int c = 0; c < d; c++) {
				bias[c] = 0.7f * tg_gauss(&rng);
				vbias[c] = tg_gauss(&rng);
				gain[c] = 1.0f;
				mu[h][c] = 0.0f;
			}
			for (int o = 0; o < 3; o++)
				gain[tg_next(&rng) % (uint64_t)d] = 10.0f +
								    10.0f * (float)tg_unit(&rng);
			for (int t = 0; t < n; t++)
				for (int c = 0; c < d; c++) {
					kh[(size_t)t * d + c] = (bias[c] + tg_gauss(&rng)) *
								gain[c];
					vh[(size_t)t * d + c] = vbias[c] + tg_gauss(&rng);
					mu[h][c] += kh[(size_t)t * d + c] / (float)n;
				}
		}
		for (int t = 0; t < n; t++) {
			for (int h = 0; h < P_HEADS; h++)
				cr_assert_eq(bd_kv_write_token(&P->lay, P->cfg, slot_of(P, r), 0, h,
							       t, k + ((size_t)h * maxlen + t) * d,
							       v + ((size_t)h * maxlen + t) * d,
							       mu[h]),
					     0);
			if (t % BD_PAGE_TOKENS == BD_PAGE_TOKENS - 1)
				cr_assert_eq(bd_page_promote(&P->lay, P->cfg, NULL, slot_of(P, r),
							     P->arena, bt[t / BD_PAGE_TOKENS]),
					     0);
		}
	}
	P->q = malloc(sizeof(float) * (size_t)nreq * P_HEADS * G * d);
	cr_assert(P->q);
	for (int i = 0; i < nreq * P_HEADS * G * d; i++)
		P->q[i] = q_zero ? 0.0f : tg_gauss(&rng);
	free(pool);
	free(k);
	free(v);
}

static void problem_free(struct problem *P)
{
	free(P->arena);
	free(P->bt);
	free(P->q);
}

/* Worst per-(request, KV head) relative L2 error and LSE difference of the model against the
 * reference, over every request, head and split count; bit-exact when `exact`. */
static void decode_case(const char *cfgname, int d, int G, const int *lens, int nreq,
			const int *splits, int nsplits, uint64_t seed, bool exact, double *ret_rel,
			double *ret_lse)
{
	struct problem P;
	float ref[8 * 128], out[8 * 128], rlse[8], lse[8];

	problem_build(&P, cfgname, d, G, lens, nreq, seed, exact);
	for (int si = 0; si < nsplits; si++) {
		struct bd_decode_params dp = bd_decode_params_default();
		dp.tile_keys = BD_PAGE_TOKENS;
		dp.n_splits = splits[si];
		for (int r = 0; r < nreq; r++)
			for (int h = 0; h < P_HEADS; h++) {
				const struct bd_kv_view kv = {
					.lay = &P.lay,
					.arena = P.arena,
					.block_table = P.bt + (size_t)r * P.bt_stride,
					.slot = slot_of(&P, r),
					.layer = 0,
					.kv_head = h,
					.n_tokens = P.len[r]
				};
				const float *q = P.q + ((size_t)r * P_HEADS + h) * G * d;
				double num = 0.0, den = 0.0;
				cr_assert_eq(
					bd_ref_decode_gqa(P.cfg, &dp, &kv, q, G, ref, rlse, NULL),
					0);
				kmodel_decode(P.cfg, &dp, &kv, q, G, out, lse);
				if (exact) {
					cr_assert_eq(
						memcmp(out, ref, sizeof(float) * (size_t)G * d), 0,
						"%s d %d G %d n %d head %d splits %d: output not "
						"bit-exact",
						cfgname, d, G, P.len[r], h, splits[si]);
					cr_assert_eq(memcmp(lse, rlse, sizeof(float) * (size_t)G),
						     0);
				}
				for (int i = 0; i < G * d; i++) {
					cr_assert(isfinite(out[i]));
					num += ((double)out[i] - ref[i]) *
					       ((double)out[i] - ref[i]);
					den += (double)ref[i] * ref[i];
				}
				const double rel = sqrt(num / den);
				*ret_rel = rel > *ret_rel ? rel : *ret_rel;
				for (int g = 0; g < G; g++) {
					const double e = fabs((double)lse[g] - rlse[g]);
					cr_assert(isfinite(lse[g]));
					*ret_lse = e > *ret_lse ? e : *ret_lse;
				}
				/* gpu_check's tolerance: the Hopper kernel against the reference */
				cr_assert_leq(rel, 1e-3,
					      "%s d %d G %d n %d head %d splits %d: rel %g",
					      cfgname, d, G, P.len[r], h, splits[si], rel);
				cr_assert_leq(*ret_lse, 1e-3);
			}
	}
	problem_free(&P);
}

static const char *const decode_cfgs[] = { "bitdecoding-nvfp4", "nvfp4-base", "bitdecoding-mxfp4",
					    "bitdecoding-nvfp4:norm=qmass",
					    "bitdecoding-mxfp4:norm=qmass" };

/* The model's S^T sums each k-step block exactly and adds the blocks into FP32 accumulators
 * where the reference sums channel by channel, and its P·V, ℓ and the split's reductions go in
 * the kernel's order; so outputs agree to FP32 rounding, held to gpu_check's 1e-3. Lengths:
 * BF16 only (1, 16, 17), one page plus the next token (129), partial last pages, seven pages;
 * splits 1, 3 and 8 (more splits than pages: empty splits). */
Test(mma_sm120, decode_matches_reference, .timeout = 120)
{
	static const int lens[] = { 1, 16, 17, 129, 300, 640, 1000 };
	static const int splits[] = { 1, 3, 8 };
	static const int Gs[] = { 1, 4, 8 };

	for (size_t c = 0; c < sizeof(decode_cfgs) / sizeof(decode_cfgs[0]); c++) {
		double rel = 0.0, lse = 0.0;
		for (int d = 64; d <= 128; d *= 2)
			for (size_t g = 0; g < 3; g++)
				decode_case(decode_cfgs[c], d, Gs[g], lens, 7, splits, 3,
					    900 + 10 * c + (uint64_t)d + g, false, &rel, &lse);
		cr_log_info(
			"%s: model vs reference, worst relative L2 %.3g, worst |lse diff| %.3g\n",
			decode_cfgs[c], rel, lse);
	}
}

/* A long context (32 pages) through one and several splits. */
Test(mma_sm120, decode_long_context, .timeout = 120)
{
	static const int lens[] = { 4095, 4097 };
	static const int splits[] = { 1, 5 };
	double rel = 0.0, lse = 0.0;

	decode_case("bitdecoding-nvfp4", 128, 4, lens, 2, splits, 2, 1300, false, &rel, &lse);
	decode_case("bitdecoding-mxfp4", 128, 8, lens, 2, splits, 2, 1301, false, &rel, &lse);
	cr_log_info("long context: worst relative L2 %.3g, worst |lse diff| %.3g\n", rel, lse);
}

/* Where every sum is exact the order of operations cannot matter: with q = 0 every logit is 0,
 * P is c (1 for MXFP4) at every unmasked key, and the P·V sums are multiples of the V scales'
 * quantum far inside 24 bits; then the model equals the reference bit for bit (the sink mask,
 * the P blocks and scales, the V operand, g_V, the splits, the BF16 partial and the combine). */
Test(mma_sm120, decode_bit_exact_where_sums_are_exact, .timeout = 120)
{
	static const int lens[] = { 17, 129, 300, 1000 };
	static const int splits[] = { 1, 3 };
	static const int Gs[] = { 1, 8 };
	double rel = 0.0, lse = 0.0;

	for (size_t c = 0; c < sizeof(decode_cfgs) / sizeof(decode_cfgs[0]); c++)
		for (int d = 64; d <= 128; d *= 2)
			for (size_t g = 0; g < 2; g++)
				decode_case(decode_cfgs[c], d, Gs[g], lens, 4, splits, 2,
					    1100 + 10 * c + (uint64_t)d + g, true, &rel, &lse);
	cr_assert_eq(rel, 0.0);
	cr_assert_eq(lse, 0.0);
}
