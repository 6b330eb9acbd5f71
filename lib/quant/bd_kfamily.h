/* bd_kfamily.h — which decode kernel family serves a device: the families, what each supports,
 * and the start-up choice among them, as pure C (no CUDA) so the rule is one table that the
 * CUDA launchers (kernels/bd_kernels.h), the worker and the unit suite all read.
 *
 * Families (DESIGN.md "Backends"):
 *   hopper         FP4 codes expanded in registers, exact FP16 emulation of the FP4 MMA on
 *                  mma.sync (paper §4 on Hopper); the portable family: built for sm_90a and,
 *                  in a Blackwell build, for sm_100a, sm_103a and sm_120a too;
 *   blackwell-tc   sm_100a/sm_103a (B200, B300): tcgen05 block-scaled FP4 MMA into TMEM;
 *   blackwell-mma  sm_120a (RTX PRO 5000/6000, RTX 50): block-scaled mma.sync m16n8k64.
 * An "a" target's code runs on exactly its compute capability (9.0, 10.0, 10.3, 12.0), so a
 * device outside those has no family at all.
 *
 * The choice (bd_kfamily_choose, then bd_kfamily_finish with the self-check's outcome):
 *   portable  the hopper family, no self-check;
 *   auto      the device's native family when it exists, is built and supports the shape,
 *             and only if its self-check against the portable family passes; else portable;
 *   native    the native family, required: no native family for the device or shape is an
 *             error; a self-check mismatch is reported but served as forced; a native kernel
 *             that cannot run is an error.
 * Errors are -errno with a sentence in the caller's buffer: -ENODEV (no family of this build
 * runs on the device), -EOPNOTSUPP (the configuration or shape is not implemented by the
 * family asked for), -EINVAL (bad argument).
 */
#ifndef BD_KFAMILY_H
#define BD_KFAMILY_H

#include <stdbool.h>
#include <stddef.h>

#include "quant/bd_kvcfg.h"

#ifdef __cplusplus
extern "C" {
#endif

enum bd_kfamily {
	BD_KFAMILY_HOPPER = 0,        /* the portable family */
	BD_KFAMILY_BLACKWELL_TC = 1,  /* sm_100a, sm_103a */
	BD_KFAMILY_BLACKWELL_MMA = 2, /* sm_120a */
	BD_KFAMILY_COUNT
};

enum bd_kfamily_mode {
	BD_KFAMILY_AUTO = 0,
	BD_KFAMILY_NATIVE = 1,
	BD_KFAMILY_PORTABLE = 2,
};

/* What a family's support depends on: the device and the build. */
struct bd_kfamily_device {
	int cc_major, cc_minor; /* compute capability */
	bool have_bw;           /* this build holds the Blackwell objects (sm_100a/103a/120a) */
};

/* The decode shape a family is asked to serve: one KV head's group of G query heads of
 * head dimension d (lay->d) with lay->d_rope rotary-only channels (MLA: not served). */
struct bd_kfamily_shape {
	int d, d_rope, G;
};

#define BD_KFAMILY_WHY_MAX 192

/* The outcome of the choice, as the worker reports it. */
struct bd_kfamily_choice {
	enum bd_kfamily_mode mode;
	enum bd_kfamily family;    /* the family that serves (after bd_kfamily_finish) */
	int native;                /* the device's native family for this shape, or -1 */
	bool selfcheck;            /* a self-check of native against portable is to run / ran */
	int selfcheck_result;      /* after finish: 0 passed, 1 mismatch, -errno could not run;
				    * 2 when none ran */
	char why[BD_KFAMILY_WHY_MAX]; /* one sentence: why this family */
};

/* "hopper", "blackwell-tc", "blackwell-mma"; NULL for a value outside the enum. */
const char *bd_kfamily_name(enum bd_kfamily f);

/* "auto", "native", "portable" → *ret. Returns 0 or -EINVAL (NULL or another word). */
int bd_kfamily_mode_parse(const char *s, enum bd_kfamily_mode *ret);

/* The native family of a device of compute capability major.minor: blackwell-tc for 10.0 and
 * 10.3, blackwell-mma for 12.0, -1 for any other (Hopper has only the portable family). */
int bd_kfamily_native(int cc_major, int cc_minor);

/* Whether family f can run cfg at shape on dev: 0, or -ENODEV (no code of this build for the
 * device), -EOPNOTSUPP (configuration or shape not implemented by f), -EINVAL (NULL, f out of
 * range), with one sentence in why[cap] (may be NULL) on failure. The rule: hopper runs on
 * 9.0 always and on 10.0, 10.3 and 12.0 when have_bw; it serves NVFP4 pages (1 or 2 query
 * terms, P by max/6 or underflow-aware), MXFP4 pages (P in MXFP4), BF16 pages (FP32 P) and
 * channel-blocked NVFP4 pages (FP32 P, no sink). The native families need have_bw and their
 * compute capability, and serve the NVFP4 and MXFP4 pages only. Every family: d ∈ {64, 128},
 * d_rope = 0, 1 ≤ G ≤ 8. A device's shared-memory limit (sm_120: 99 KB per block) is the
 * launchers' to check (bd_decode_plan_init's -EOPNOTSUPP). */
int bd_kfamily_supported(enum bd_kfamily f, const struct bd_kfamily_device *dev,
			 const struct bd_kvcfg *cfg, const struct bd_kfamily_shape *shape,
			 char *why, size_t cap);

/* The first step of the start-up choice (the rule in the header's comment): fills *ret
 * (mode, native, family = what serves unless a self-check is to run, selfcheck = one must run
 * with ret->native against hopper, why). Returns 0, or -ENODEV / -EOPNOTSUPP with ret->why
 * saying why the device or shape cannot be served in this mode, -EINVAL (NULL). */
int bd_kfamily_choose(enum bd_kfamily_mode mode, const struct bd_kfamily_device *dev,
		      const struct bd_kvcfg *cfg, const struct bd_kfamily_shape *shape,
		      struct bd_kfamily_choice *ret);

/* The second step, after the self-check bd_kfamily_choose asked for (a no-op returning 0 when
 * it asked for none): result 0 (native and portable agree), 1 (they differ; detail says how),
 * or -errno (the native kernel could not run; detail says where). Sets family, the result
 * and why. Returns 0, or result (< 0) when the mode is native and the native kernel cannot
 * run, -EINVAL (NULL, result out of range). */
int bd_kfamily_finish(struct bd_kfamily_choice *c, int result, const char *detail);

#ifdef __cplusplus
}
#endif
#endif
