/* bd_kvemul.h — eval-time emulated K/V formats: research configurations of `bdfp4 eval-kl`.
 *
 * An emulated configuration stores BF16 pages (decoded like bf16: BF16 query q' = Hq, FP32 P,
 * the BF16 sink and recent tokens as configured), but its page writer first quantizes the
 * page-head's K' and V rows to a chosen format and back (fake quantization), then rounds the
 * dequantized values to BF16. That isolates what the stored K and V cost from what the FP4
 * query and probabilities cost, and lets write-side candidates (other block-scale choices,
 * per-channel key rescaling, value smoothing, FP8 for one of K and V) be measured by the KL
 * proxy (NUMERICS.md §10) without a page format or a kernel for each. They are not served:
 * bd_kvcfg_find() does not know them, only bd_kvemul_find() does.
 *
 * The quantizers follow NUMERICS.md §2–4 (NVFP4 g = page-head amax / (6·256), blocks of 16;
 * MXFP4 blocks of 32 with the OCP exponent; keys token-wise, values along tokens). FP8 here
 * uses one E4M3 scale per page-head (amax / 448), not fp8's per-(layer, head) scale.
 */
#ifndef BD_KVEMUL_H
#define BD_KVEMUL_H

#include <stddef.h>

#include "quant/bd_fp4.h"
#include "quant/bd_kvcfg.h"

#ifdef __cplusplus
extern "C" {
#endif

enum bd_emul_fmt {
	BD_EMUL_BF16 = 0, /* left as written */
	BD_EMUL_FP8,      /* E4M3, one scale per page-head */
	BD_EMUL_NVFP4,    /* NVFP4: keys token-wise, values along tokens */
	BD_EMUL_MXFP4,    /* MXFP4 in the same directions */
};

/* How a block's scale is chosen. */
enum bd_emul_rule {
	BD_EMUL_STANDARD = 0, /* κ = 6 (MXFP4: e_ocp) */
	BD_EMUL_SEARCH,       /* the paper's search: κ ∈ {6, 4} (MXFP4: e_ocp, e_ocp + 1) */
	BD_EMUL_WIDE,         /* κ ∈ {6, 5, 4, 3} (MXFP4: e_ocp − 1 .. e_ocp + 1) */
	BD_EMUL_OPTIMAL,      /* NVFP4: every E4M3 code from E4M3(amax/6/g) − 1 up to
			       * E4M3(amax/3/g) + 1, the one with the least squared error; MXFP4: as WIDE */
};

struct bd_emul {
	enum bd_emul_fmt k, v;
	enum bd_emul_rule k_rule, v_rule;
	/* Keys divided per channel by r_c = RMS over the page-head's 128 tokens of H·K'
	 * (= k − μ_k) before the rotation and quantization, multiplied back after: an exact
	 * rescaling of q·k (the query would carry r_c), estimated per page (an oracle for a
	 * calibrated per-(layer, head) r). */
	bool k_rescale;
	/* Values minus their page-head per-channel mean before quantization, mean added back
	 * (exact after a convex normalization; per page: an oracle for a calibrated mean). */
	bool v_smooth;
};

/* The emulated configuration named name ("emu-…", the list in kvemul.c), or NULL. */
const struct bd_kvcfg *bd_kvemul_find(const char *name);

/* Fake-quantize one page-head in place: k [128][d] (the K' rows as written, H(k − μ_k) when
 * cfg->hadamard), v [128][dv], per cfg->emul; ties and rounding in FP32, results rounded to
 * BF16. d a multiple of 32 (a power of two with k_rescale). Returns 0, -EINVAL (no emul, bad
 * shape), -ENOMEM, -EDOM (non-finite input: nothing is changed). */
int bd_kvemul_head(const struct bd_kvcfg *cfg, bd_bf16 *k, bd_bf16 *v, size_t d, size_t dv);

#ifdef __cplusplus
}
#endif
#endif
