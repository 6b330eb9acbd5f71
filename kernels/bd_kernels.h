/* bd_kernels.h — the C launchers of the CUDA decode kernels, callable from C.
 *
 * One header in front of kernels/ (STYLE.md 1, 8): a decode step is split into a plan, computed
 * once per batch shape (splits, workspace size, launch geometry), and a run over caller-provided
 * device buffers. Block tables, sequence lengths and slot pointers are read from device arrays,
 * so a run can be captured in a CUDA graph and replayed with new contents.
 *
 * Kernel families (STYLE.md 2; the table and its rule in quant/bd_kfamily.h): the portable
 * `hopper` family (kernels/decode_sm90.cu, built for sm_90a and, in a Blackwell build, for
 * sm_100a, sm_103a and sm_120a), the native `blackwell-tc` (sm_100a/sm_103a) and
 * `blackwell-mma` (sm_120a) families (bd_kernels_bw.h). Each device serves with one family,
 * hopper unless bd_decode_family_set chose another (the worker does, after its self-check:
 * cuda/bd_decode_select.h); a plan records its family and bd_decode_run launches that one.
 * The description below is the hopper family's; the native ones compute the same quantities
 * with the FP4 products on FP4 tensor cores (bd_kernels_bw.h).
 *
 * What the kernels compute is NUMERICS.md §5–§8 exactly as the CPU reference (bd_attn_ref.h) does
 * with tile_keys = BD_KERNEL_TILE_KEYS (one 128-token page per tile) and the plan's n_splits:
 * the same split boundaries, the same P quantization per block of 16 keys, the same BF16
 * sink+recent partial and LSE combine; only FP32 summation order differs. FP4 codes and E4M3
 * scales are expanded in registers to FP16 (E2M1 × E4M3 products are exact in FP16) and
 * multiplied on the FP16 tensor cores with FP32 accumulation (paper §4 on Hopper). Channel-
 * blocked NVFP4 pages (trtllm-nvfp4) are expanded exactly to BF16 s·x̂ rows in shared memory and
 * go through the BF16 path: BF16 query, FP32 P (split into two BF16 terms for P·V), the page's
 * g_K on the FP32 logit sum and g_V once per page, as the reference applies them.
 *
 * Errors are -errno, returned before any launch where they can be known on the host:
 * -EINVAL (bad argument, misaligned pointer, block table too narrow), -EOPNOTSUPP (a
 * configuration or shape the kernels do not implement), -ENODEV (no CUDA device), -ENOMEM,
 * -EIO (any other CUDA error, including a failed launch). Nothing is printed.
 */
#ifndef BD_KERNELS_H
#define BD_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "quant/bd_attn_ref.h"
#include "quant/bd_kfamily.h"
#include "quant/bd_kvcfg.h"
#include "quant/bd_layout.h"

#ifdef __cplusplus
extern "C" {
#endif

#define BD_KERNEL_TILE_KEYS 128 /* B_k of the kernels: one page per tile */
#define BD_KERNEL_MAX_G 8       /* query heads per KV head (GQA group) */
#define BD_KERNEL_ALIGN 256     /* alignment the workspace must have */

/* Bits a run ORs into *status (a device int) for request data it cannot check on the host;
 * the affected request's output is then zero, never garbage from outside its buffers. */
enum {
	BD_KSTATUS_BAD_LEN = 1 << 0,  /* seq_lens[b] < 1 or its pages exceed bt_stride */
	BD_KSTATUS_BAD_PAGE = 1 << 1, /* a block-table entry outside [0, lay->n_pages) */
	BD_KSTATUS_BAD_SLOT = 1 << 2, /* a slot pointer that is NULL or not 16-byte aligned */
};

/* A decode plan: computed by bd_decode_plan_init, read-only afterwards (copy it freely). */
struct bd_decode_plan {
	int B, Hq, Hkv, G, d;  /* batch, query heads, KV heads, group Hq/Hkv, head dim */
	int max_tokens;        /* longest context the plan was sized for */
	int bt_stride;         /* minimum block-table row length: pages of max_tokens */
	int n_splits;          /* page splits per (request, KV head), ≤ 1024; split s covers tiles
				* [s·c, min((s+1)·c, n_tiles)), c = ceil(n_tiles / n_splits) */
	int tile_keys;         /* BD_KERNEL_TILE_KEYS */
	int kind;              /* internal: 1 NVFP4 pages, 2 BF16 pages, 3 MXFP4 pages,
				* 4 channel-blocked NVFP4 pages */
	int nterms;            /* FP4 query terms, 1 or 2 (0: BF16 query, kinds 2 and 4) */
	int sink, hadamard, underflow; /* cfg flags the kernels use */
	int qmass;             /* FP4 P: page partials divided by Σ s_P·P̂ (cfg->p_norm) */
	float gamma;           /* log2(e) · softmax scale */
	float c, log2c, tau;   /* probability scaling (c = 1, log2c = 0 without it) */
	int smem_bytes;        /* dynamic shared memory of the decode kernel */
	int grid_ctas;         /* CTAs of the decode kernel: B·Hkv·(n_splits + 1) */
	size_t ws_bytes;       /* workspace the run needs (partials, counters), bytes */
	size_t ws_lse_off;     /* internal: offset of the partial LSEs in the workspace */
	size_t ws_cnt_off;     /* internal: offset of the per-(request, KV head) counters */
	struct bd_layout lay;  /* copy of the arena geometry */
	int persist_ctas;      /* > 0: the run launches the persistent kernel with this many CTAs,
				* which claim the grid's CTAs' work as items (same results, bit for
				* bit, at any count ≥ 1: a test may set it); 0: grid_ctas CTAs */
	int family;            /* enum bd_kfamily that bd_decode_run launches */
};

/* ---- the families ---- */

/* Whether family f can serve cfg over lay with G query heads per KV head on the current
 * device: bd_kfamily_supported with the device's compute capability and this build's objects
 * (have_bw: the Blackwell objects were linked in), one sentence in why[cap] (may be NULL) on
 * failure. Shared-memory limits show at bd_decode_plan_init_family (-EOPNOTSUPP). Returns 0,
 * -ENODEV, -EOPNOTSUPP, -EINVAL, -EIO (the device could not be queried). */
int bd_decode_family_supported(enum bd_kfamily f, const struct bd_kvcfg *cfg,
			       const struct bd_layout *lay, int G, char *why, size_t cap);

/* The family the current device serves with (hopper until bd_decode_family_set). */
enum bd_kfamily bd_decode_family_get(void);

/* Make f the current device's family for every later bd_decode_plan_init (plans made before
 * keep theirs). Checks only that f's code can run on the device. Returns 0, -ENODEV, -EINVAL,
 * -EIO. */
int bd_decode_family_set(enum bd_kfamily f);

/* This build's description of a device: compute capability of the current device and whether
 * the Blackwell objects are linked in. Returns 0, -ENODEV, -EIO. */
int bd_decode_device(struct bd_kfamily_device *ret);

/* bd_decode_plan_init with family f instead of the device's: the same geometry (splits and
 * workspace are the hopper family's rule, so every family runs every plan of the same shape
 * on the same workspace), then f's preparation on the current device. Returns what
 * bd_decode_plan_init returns; -ENODEV or -EOPNOTSUPP also when f cannot serve this device or
 * shape (bd_decode_family_supported). */
int bd_decode_plan_init_family(struct bd_decode_plan *ret, enum bd_kfamily f,
			       const struct bd_kvcfg *cfg, const struct bd_layout *lay,
			       const struct bd_decode_params *dp, int B, int Hq, int max_tokens,
			       int n_splits);

/* Plan a decode step of B requests with Hq query heads over an arena laid out by lay (one
 * layer of it per run), configuration cfg (NVFP4 pages: every §9 configuration that has them;
 * MXFP4 pages: bitdecoding-mxfp4, P in MXFP4 blocks of 32 keys by the OCP rule, c = 1;
 * "bf16": the BF16 paged baseline; channel-blocked NVFP4 pages: trtllm-nvfp4, BF16 query and
 * FP32 P, no sink). dp: NULL for bd_decode_params_default() except tile_keys,
 * which the kernels fix at 128 (a dp with another tile_keys is -EINVAL); dp->n_splits is
 * ignored. n_splits: 0 chooses the splits from the batch shape and max_tokens so that the grid
 * fills the device in whole waves (split-KV sized by bytes); > 0 forces that many (tests).
 * Shapes: Hq = G·lay->n_kv_heads, 1 ≤ G ≤ 8, lay->d ∈ {64, 128}, B ≥ 1, max_tokens ≥ 1.
 * Queries the current CUDA device (SM count, occupancy) and raises the kernels' shared-memory
 * limit; the plan gets the device's family (bd_decode_family_get) and that family's
 * preparation. Returns 0, -EINVAL, -EOPNOTSUPP (FP8 pages, MLA, other d or G, channel-blocked
 * pages with a sink or a quantized P, a shape the family does not serve or whose shared
 * memory the device lacks), -ENODEV (no code of the family for this device), -EIO. */
int bd_decode_plan_init(struct bd_decode_plan *ret, const struct bd_kvcfg *cfg,
			const struct bd_layout *lay, const struct bd_decode_params *dp, int B,
			int Hq, int max_tokens, int n_splits);

/* Device buffers of one decode run. */
struct bd_decode_args {
	const float *q;              /* [B][Hq][d] FP32 post-RoPE queries, unrotated; 16-B aligned */
	const void *arena;           /* the KV arena (lay), 128-B aligned */
	int layer;                   /* 0 ≤ layer < lay.n_layers */
	const int32_t *block_table;  /* [B][bt_stride] page ids of each request's full pages */
	int bt_stride;               /* ≥ plan->bt_stride */
	const int32_t *seq_lens;     /* [B] context lengths n ≥ 1, the decoded token included */
	void *const *slots;          /* [B] device pointers to each request's BF16 slot */
	float *out;                  /* [B][Hq][d] FP32 attention output; 16-B aligned */
	float *lse;                  /* [B][Hq] log2-domain LSE of γ·logits, or NULL */
	void *workspace;             /* plan->ws_bytes, BD_KERNEL_ALIGN aligned, initialized once
				      * by bd_decode_workspace_init */
	int *status;                 /* device int OR-ed with BD_KSTATUS_* bits, or NULL */
};

/* Zero the completion counters of a freshly allocated workspace (on stream). Runs leave them
 * zero again, so this is needed once per workspace, not per run. Returns 0, -EINVAL, -EIO. */
int bd_decode_workspace_init(const struct bd_decode_plan *plan, void *workspace, void *stream);

/* Enqueue one decode step on stream (a cudaStream_t; NULL for the default stream) with the
 * plan's family: one kernel whose CTAs are the FP4 (or BF16) page splits and the BF16
 * sink+recent partial of every (request, KV head), query rotation and dual-residual
 * quantization in their prologue; the last CTA of each (request, KV head) to finish does the
 * LSE combine. With plan->persist_ctas > 0 (hopper family, FP4 pages, a build with
 * BD_PERSIST, the default) that many resident CTAs take the same splits and partials as work
 * items from a counter in the workspace, longest first. Asynchronous; capturable in a CUDA graph; runs
 * sharing a workspace must be ordered (one stream). Returns 0, -EINVAL (NULL or misaligned
 * buffer, bad layer, bt_stride too small, persist_ctas < 0), -EOPNOTSUPP (persist_ctas > 0
 * without the persistent kernel, on BF16 or channel-blocked pages or another family), -EIO
 * (launch failed). */
int bd_decode_run(const struct bd_decode_plan *plan, const struct bd_decode_args *args,
		  void *stream);

/* The hopper family's own plan and run (kernels/decode_sm90.cu): bd_decode_plan_init and
 * bd_decode_run without the family table (a plan of family 0). On sm_120 the BF16-row kernels
 * take fewer pipeline stages (99 KB of shared memory per block); BF16 pages at d = 128 do not
 * fit and are -EOPNOTSUPP there. */
int bd_decode_plan_init_hopper(struct bd_decode_plan *ret, const struct bd_kvcfg *cfg,
			       const struct bd_layout *lay, const struct bd_decode_params *dp,
			       int B, int Hq, int max_tokens, int n_splits);
int bd_decode_run_hopper(const struct bd_decode_plan *plan, const struct bd_decode_args *args,
			 void *stream);

/* Promotion (NUMERICS.md §8) on the device: for i < n, quantize the full recent page of slot
 * slots[i] (all layers and KV heads of lay) into page pages[i] of arena, bytes identical to
 * bd_page_promote (same quantizers, same FP32 operation order, gaps zeroed). Formats: NVFP4,
 * MXFP4 (scale search per cfg->key_search) and BF16 (a copy). slots: [n] device pointers, 16-B
 * aligned; pages: [n] device page ids; status: [n] device ints set to 0 (promoted), -EDOM (a
 * non-finite value anywhere in the slot's recent rows: nothing of that page written) or
 * -EINVAL (page id out of range or bad slot pointer: nothing written). Returns 0, -EINVAL,
 * -EOPNOTSUPP (FP8, channel-blocked or MLA layouts), -EIO. */
int bd_promote_run(const struct bd_layout *lay, const struct bd_kvcfg *cfg, void *arena,
		   void *const *slots, const int32_t *pages, int n, int *status, void *stream);

/* Test hook: the device's query preparation (NUMERICS.md §5) for n heads of dimension d:
 * q' = Hq if hadamard, then the FP4 query of nterms terms exactly as the decode prologue makes
 * it. q: [n][d] FP32 device; ret_codes: [n][2][d/2] packed E2M1; ret_scales: [n][2][d/16]
 * E4M3; ret_g: [n][2] (term 2 zeroed when nterms = 1). Same bytes as bd_fwht and
 * bd_query_quantize on the CPU. Synchronous. Returns 0, -EINVAL, -EIO. */
int bd_kernels_query_quantize(const float *q, int n, int d, int hadamard, int nterms,
			      uint8_t *ret_codes, uint8_t *ret_scales, float *ret_g);

/* Test hook: the MXFP4 query preparation of the decode prologue (bitdecoding-mxfp4): q' = Hq
 * if hadamard, then nterms MXFP4 terms (UE8M0 scales, blocks of 32, OCP rule, g = 1). q: [n][d]
 * FP32 device; ret_codes: [n][2][d/2] packed E2M1; ret_scales: [n][2][d/32] UE8M0 codes (term
 * 2 zeroed when nterms = 1). Same bytes as bd_fwht and bd_query_quantize(BD_FP4_MXFP4).
 * Synchronous. Returns 0, -EINVAL, -EIO. */
int bd_kernels_query_quantize_mx(const float *q, int n, int d, int hadamard, int nterms,
				 uint8_t *ret_codes, uint8_t *ret_scales);

/* Test hook: E4M3 encoders on the device. For every FP32 bit pattern of a finite value
 * compare the hardware conversion (cvt.rn.satfinite.e4m3x2.f32) with the device's software
 * encoder; ret_mismatch: number of differing patterns, ret_first: the first one (or 0).
 * Synchronous. Returns 0, -EINVAL, -EIO. */
int bd_kernels_e4m3_exhaustive(uint64_t *ret_mismatch, uint32_t *ret_first);

/* Test hook: the decode kernels' division of c·p_max by 6 (div6_rn, NUMERICS.md §6: s_P =
 * E4M3(c·p_max/6)) against __fdiv_rn on every FP32 x in [0, 8]: the same bits for x ≥ 2^-125,
 * the same E4M3 code below. ret_mismatch: the count of x where they differ, ret_first: the
 * first one's bit pattern (or 0). Synchronous. Returns 0, -EINVAL, -EIO. */
int bd_kernels_div6_exhaustive(uint64_t *ret_mismatch, uint32_t *ret_first);

/* Test hook: encode x[n] (device) with the kernels' E4M3 encoder into ret_codes[n] (device),
 * hardware path when hw != 0. Synchronous. Returns 0, -EINVAL, -EIO. */
int bd_kernels_e4m3_encode(const float *x, size_t n, int hw, uint8_t *ret_codes);

#ifdef __cplusplus
}
#endif
#endif
