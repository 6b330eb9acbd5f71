/* bd_attn_cpu.h — the CPU backend's decode attention: the reference decoder's algorithm
 * (bd_attn_ref.h, NUMERICS.md §5, §6, §8; paper Algorithm 1) in SIMD, for the GQA
 * configurations whose pages hold FP4 codes or BF16 (NUMERICS.md §9).
 *
 * Same structure as the reference, so the same numerics up to FP32 summation order: page keys
 * in tiles of B_k, the online softmax in the exp2 domain per split of contiguous tiles, P
 * quantized per block of keys inside a tile (§6), the BF16 sink and recent tokens as one more
 * partial, the log-sum-exp combine. Differences a test tolerates (the GPU kernels' tolerance,
 * relative L2 error 1e-3 and |Δlse| 1e-3 against bd_ref_decode_gqa): FMA in the inner sums, the
 * inner sums of the dual-residual query terms taken apart and combined in the reference's
 * order, and exp2 by a polynomial (relative error below 1e-7).
 *
 * Each page-head of a tile is expanded to s·x̂ once and used by all G query heads of its group.
 * The path is chosen once, at first use, from BD_ATTN_ISA in the environment: unset, empty
 * or "auto", the best the CPU has (AVX-512 with F/BW/VL/DQ, else AVX2 with FMA); "avx512" or
 * "avx2", that one where the CPU has it (else the reference); "ref" or any other value, the
 * reference decoder (the opt-out, for comparisons and bisecting). On a CPU without AVX2 and
 * FMA, and for configurations without a fast path (FP8 pages), the call is the reference
 * decoder's.
 * A call with several KV heads and enough keys shares its groups out over the caller's pool
 * of threads (bd_tpool.h); a group's arithmetic does not depend on the thread that runs it.
 */
#ifndef BD_ATTN_CPU_H
#define BD_ATTN_CPU_H

#include <stdbool.h>

#include "quant/bd_attn_ref.h"
#include "quant/bd_kvcfg.h"

#ifdef __cplusplus
extern "C" {
#endif

struct bd_tpool; /* base/bd_tpool.h */

/* Decode attention of n_kv_heads consecutive GQA groups of one request and layer: KV heads
 * kv->kv_head .. kv->kv_head + n_kv_heads − 1 of the view (the other fields shared), G query
 * heads each. q: [n_kv_heads][G][d] post-RoPE FP32 queries (unrotated), group h's heads at
 * q + h·G·d; ret_o: [n_kv_heads][G][d] in the value space; ret_lse: [n_kv_heads][G] log2-domain
 * LSE of γ·logits, or NULL; stats: added to (probability blocks, underflowed blocks), or NULL;
 * pool: the threads that share the groups out, or NULL (this thread only).
 * The result for each group is bd_ref_decode_gqa's within the tolerance above.
 * Returns 0, -EINVAL (bad params, view or shapes, n_kv_heads < 1 or past the layout's heads),
 * -EDOM (non-finite q or a logit that overflows FP32), -ENOMEM; on error ret_o, ret_lse and
 * stats are untouched. */
int bd_attn_cpu_decode_gqa(const struct bd_kvcfg *cfg, const struct bd_decode_params *dp,
			   const struct bd_kv_view *kv, int n_kv_heads, const float *q, int G,
			   float *ret_o, float *ret_lse, struct bd_decode_stats *stats,
			   struct bd_tpool *pool);

/* Which code path bd_attn_cpu_decode_gqa() takes on this CPU: "avx512", "avx2", or "ref" (the
 * reference decoder). */
const char *bd_attn_cpu_isa(void);

/* Force a code path: "avx512", "avx2" or "ref" (tests and benchmarks compare them on one CPU).
 * Returns 0, -ENOTSUP when this CPU lacks the instructions, -EINVAL for another name. Not
 * thread-safe against concurrent decode calls. */
int bd_attn_cpu_set_isa(const char *name);

/* True when cfg has a SIMD path here (BF16 or FP4 pages and a CPU with AVX2 and FMA); false
 * means bd_attn_cpu_decode_gqa() runs the reference decoder. */
bool bd_attn_cpu_supported(const struct bd_kvcfg *cfg);

#ifdef __cplusplus
}
#endif
#endif
