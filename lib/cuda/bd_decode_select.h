/* bd_decode_select.h — the start-up choice of the decode kernel family on the current device
 * (the rule of quant/bd_kfamily.h) with the native family's self-check against the portable
 * one, for the cuda backend of workerd.
 *
 * The self-check is one fixed problem in the serving configuration and head shape: 2 requests
 * of 421 and 129 tokens (3 and 1 full pages, a sink, partial recent pages) over 2 KV heads,
 * seeded keys with a channel bias and outliers, values and queries, 2 forced splits (the split
 * partials, the BF16 sink+recent partial and the LSE combine all run). The native and the
 * hopper family each decode it once on the same plan geometry; they agree when every
 * (request, head) has a relative L2 difference ≤ BD_DECODE_SELFCHECK_TOL and an LSE difference
 * ≤ BD_DECODE_SELFCHECK_TOL (the kernels' tolerance against the reference, tests/gpu), every
 * value is finite and neither sets a status bit. Synchronous; about 1 ms of device time and
 * a few MB of device memory, freed before returning.
 */
#ifndef BD_DECODE_SELECT_H
#define BD_DECODE_SELECT_H

#include <stdbool.h>
#include <stddef.h>

#include "quant/bd_kfamily.h"
#include "quant/bd_kvcfg.h"
#include "quant/bd_layout.h"

#ifdef __cplusplus
extern "C" {
#endif

#define BD_DECODE_SELFCHECK_TOL 1e-3

/* Test hooks (tests/gpu/decode_select_check.c): exercise the self-check and the fallback on a
 * device without a native family. NULL in production. */
struct bd_decode_select_test {
	int cc_major, cc_minor;  /* the device taken to be of this capability, its code built
				  * (0.0: the device and build as they are) */
	bool portable_as_native; /* the hopper family runs in the native family's place, in the
				  * self-check and as the family set for the device */
	float perturb;           /* added to output element 0 of the native run before the
				  * comparison (0: none) */
};

/* Run family native and hopper on the fixed problem (header comment) for cfg at head dim d
 * (64 or 128) and G query heads per KV head, on the current device. Returns 0 (they agree),
 * 1 (they differ: detail[cap] says where and by how much), or -errno (a family could not
 * plan or run it: -ENODEV, -EOPNOTSUPP, -ENOMEM, -EIO; detail says which family and step).
 * -EINVAL for bad arguments. */
int bd_decode_selfcheck(enum bd_kfamily native, const struct bd_kvcfg *cfg, int d, int G,
			const struct bd_decode_select_test *test, char *detail, size_t cap);

/* Choose the family the current device serves cfg over lay with G heads per KV head in mode
 * (bd_kfamily_choose), run the self-check it asks for, finish the choice
 * (bd_kfamily_finish) and make the result the device's family (bd_decode_family_set): every
 * later bd_decode_plan_init on this device uses it. *ret: the outcome to report, also on
 * failure (ret->why). Returns 0, or -ENODEV / -EOPNOTSUPP (no family of this build serves the
 * device or shape in this mode), -errno of a forced native family that cannot run, -EINVAL,
 * -EIO. */
int bd_decode_select(enum bd_kfamily_mode mode, const struct bd_kvcfg *cfg,
		     const struct bd_layout *lay, int G, const struct bd_decode_select_test *test,
		     struct bd_kfamily_choice *ret);

#ifdef __cplusplus
}
#endif
#endif
