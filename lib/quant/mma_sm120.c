/* mma_sm120.c — the CPU emulation of sm_120a's block-scaled FP4 mma.sync (bd_mma_sm120.h).
 *
 * The registers are unpacked into the matrices the PTX ISA's fragment formulas say they hold
 * (the bd_mma120_{a,b,sfa,sfb}_* functions), then every element of D is summed block by block
 * in the order the header states. Exactness: an E2M1 value is a multiple of 1/2 of magnitude
 * ≤ 6, so a product is a multiple of 1/4 of magnitude ≤ 36 and a block's sum of ≤ 32 products
 * a multiple of 1/4 below 2^11: exact in FP32. Times an E4M3 × E4M3 scale product (8
 * significant bits) or a power of two (UE8M0), the scaled block sum has at most 21 significant
 * bits: exact in FP64, and in FP32 whenever it is inside FP32's range.
 */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>

#include "quant/bd_mma_sm120.h"

/* The value of scale byte s of the instruction's type, or −1 when it is not a number of it. */
static double scale_value(enum bd_fp4_format fmt, uint32_t s)
{
	if (fmt == BD_FP4_NVFP4)
		return (s & 0x80u) || s == 0x7fu ? -1.0 : (double)bd_e4m3_decode((uint8_t)s);
	return s == 0xffu ? -1.0 : (double)bd_ue8m0_decode((uint8_t)s);
}

static int selectors_ok(enum bd_fp4_format fmt, const struct bd_mma120_op *op)
{
	int bid_ok = fmt == BD_FP4_NVFP4 ? op->bid_a == 0 && op->bid_b == 0
					 : (op->bid_a == 0 || op->bid_a == 2) &&
						   (op->bid_b == 0 || op->bid_b == 2);

	return bid_ok && (op->tid_a == 0 || op->tid_a == 1) && op->tid_b >= 0 && op->tid_b <= 3;
}

int bd_mma120_emulate(enum bd_fp4_format fmt, const struct bd_mma120_op *op,
		      float acc[BD_MMA120_LANES][4])
{
	float A[BD_MMA120_M][BD_MMA120_K], B[BD_MMA120_K][BD_MMA120_N];
	double sa[BD_MMA120_M][4], sb[4][BD_MMA120_N];
	float d[BD_MMA120_LANES][4];

	if (!op || !acc || (fmt != BD_FP4_NVFP4 && fmt != BD_FP4_MXFP4) || !selectors_ok(fmt, op))
		return -EINVAL;
	const int nb = fmt == BD_FP4_NVFP4 ? 4 : 2, bk = BD_MMA120_K / nb;

	for (int lane = 0; lane < BD_MMA120_LANES; lane++) {
		for (int r = 0; r < 4; r++)
			for (int i = 0; i < 8; i++)
				A[bd_mma120_a_row(lane, r)][bd_mma120_a_col(lane, r, i)] =
					bd_e2m1_decode((uint8_t)(op->a[lane][r] >> (4 * i)));
		for (int r = 0; r < 2; r++)
			for (int i = 0; i < 8; i++)
				B[bd_mma120_b_k(lane, r, i)][bd_mma120_b_n(lane)] = bd_e2m1_decode(
					(uint8_t)(op->b[lane][r] >> (4 * i)));
		/* each row (column) has exactly one supplying lane for a given thread-id */
		for (int j = 0; j < nb; j++) {
			if (bd_mma120_sfa_tid(lane) == op->tid_a) {
				double v = scale_value(
					fmt, (op->sfa[lane] >> (8 * (op->bid_a + j))) & 0xffu);
				if (v < 0.0)
					return -EDOM;
				sa[bd_mma120_sfa_row(lane)][j] = v;
			}
			if (bd_mma120_sfb_tid(lane) == op->tid_b) {
				double v = scale_value(
					fmt, (op->sfb[lane] >> (8 * (op->bid_b + j))) & 0xffu);
				if (v < 0.0)
					return -EDOM;
				sb[j][bd_mma120_sfb_col(lane)] = v;
			}
		}
	}

	for (int lane = 0; lane < BD_MMA120_LANES; lane++) {
		for (int e = 0; e < 4; e++) {
			const int m = bd_mma120_c_row(lane, e), n = bd_mma120_c_col(lane, e);
			float x = acc[lane][e];
			for (int j = 0; j < nb; j++) {
				float p = 0.0f;
				for (int k = j * bk; k < (j + 1) * bk; k++)
					p = p + A[m][k] * B[k][n];
				x = x + (float)((double)p * (sa[m][j] * sb[j][n]));
			}
			d[lane][e] = x;
		}
	}
	for (int lane = 0; lane < BD_MMA120_LANES; lane++)
		for (int e = 0; e < 4; e++)
			acc[lane][e] = d[lane][e];
	return 0;
}
