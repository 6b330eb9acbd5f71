/* model_ops.h — what kernels/model_ops.cu leaves in bd_op_sample's workspace, for checks.
 *
 * Internal to kernels/ and tests/gpu/ops_check.c: the orchestration (bd_gmodel.h) treats the
 * workspace as opaque scratch. One record per row, written by every bd_op_sample call.
 */
#ifndef BD_MODEL_OPS_H
#define BD_MODEL_OPS_H

#include <stdint.h>

/* Masses are fixed point: m_i = round(exp((l_i − l_max)/T) · 2^40), so sums are exact
 * integers (order independent, hence deterministic). A token is kept iff its sort key
 * okey(l_i) << 32 | ~i (larger logit first, then lower id) is ≥ thresh. */
#define BD_OP_MASS_ONE 0x1p40

struct bd_op_sample_rec {
	uint64_t thresh;    /* kept iff key ≥ thresh (0: every token; greedy: the argmax key) */
	uint64_t kept_mass; /* Σ m_i over the kept set (0 for greedy and refusals) */
	uint64_t cand_mass; /* Σ m_i after top-k, before top-p */
	double u;           /* the uniform draw U(seed, step) */
};

#endif
