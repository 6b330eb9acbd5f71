/* bd_ops.h — the model kernels of the CUDA backend besides decode attention.
 *
 * Each is the device twin of a CPU building block of lib/model/model.c (bd_model.h) and computes
 * what that code computes, in the same FP32 operation order where the CPU order is fixed
 * (RMSNorm's sum in double, RoPE angles in double, BF16 rounding of K and V before prefill
 * attention), so that the FP32-weight model on the GPU reproduces the CPU backend's greedy
 * tokens. All device pointers; all asynchronous on `stream` (a cudaStream_t; NULL: the default
 * stream) and capturable in a CUDA graph (no allocation, no host synchronization, no host
 * reads of device data). Activations are FP32 row-major [rows][width]; weight vectors and GEMM
 * inputs are BF16 or FP32 (enum bd_dtype). Returns 0, -EINVAL (a NULL pointer, a size out of
 * range: nothing launched) or -EIO (the launch failed). Nothing is printed.
 */
#ifndef BD_OPS_H
#define BD_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "quant/bd_kvcfg.h"
#include "quant/bd_layout.h"

#ifdef __cplusplus
extern "C" {
#endif

enum bd_dtype {
	BD_DT_BF16 = 0, /* raw bfloat16 bits, uint16_t */
	BD_DT_F32 = 1,
};

/* x[i][:] = table[tokens[i]][:] as FP32, i < n; table [V][E] of dtype dt. A token outside
 * [0, V) gives a zero row and ORs 1 into *status (status may be NULL). */
int bd_op_embed(const void *table, enum bd_dtype dt, int V, int E, const int32_t *tokens, int n,
		float *x, int *status, void *stream);

/* y[i] = x[i] / sqrt(mean(x[i]²) + eps) · w, mean accumulated in double (bd_rmsnorm);
 * x [n][E] FP32, w [E] of dtype wdt, y [n][E] of dtype ydt (BF16: round to nearest even). */
int bd_op_rmsnorm(const float *x, const void *w, enum bd_dtype wdt, int n, int E, float eps,
		  void *y, enum bd_dtype ydt, void *stream);

/* In place per head (Qwen3 q/k norm): x [n][H][d] FP32, w [d] of dtype wdt. */
int bd_op_head_rmsnorm(float *x, const void *w, enum bd_dtype wdt, int n, int H, int d, float eps,
		       void *stream);

/* x[i][:] += b, x [n][width] FP32, b [width] of dtype bdt (Qwen2 q/k/v biases). */
int bd_op_bias_add(float *x, const void *b, enum bd_dtype bdt, int n, int width, void *stream);

/* RoPE in place as bd_rope: x [n][H][d] FP32, row i at position pos[i] (device [n]), angles
 * pos·base^(−2j/n_rot) in double; neox 0 rotates the pairs (2i, 2i+1) (GGUF Llama), 1 the
 * pairs (i, i + n_rot/2) (Qwen2, Qwen3). -EINVAL for any other neox. */
int bd_op_rope(float *x, int n, int H, int d, int n_rot, const int32_t *pos, float base,
	       int neox, void *stream);

/* SwiGLU as lib/model/model.c: y[i][j] = silu(gu[i][j]) · gu[i][F + j], gu [n][2F] FP32 (gate
 * columns first, then up), y [n][F] of dtype ydt. */
int bd_op_swiglu(const float *gu, int n, int F, void *y, enum bd_dtype ydt, void *stream);

/* x[k] += y[k], k < len (residual). */
int bd_op_add(float *x, const float *y, size_t len, void *stream);

/* y[k] = x[k] converted to ydt (BF16: round to nearest even; F32: copy), k < len. */
int bd_op_cast(const float *x, void *y, enum bd_dtype ydt, size_t len, void *stream);

/* Causal GQA attention over a prompt as lib/model/model.c's prefill: q [n][Hq][d], k and v
 * [n][Hkv][d] FP32 post-RoPE; K and V rounded to BF16 first; query head h reads KV head
 * h / (Hq/Hkv); softmax of scale·q·k over positions ≤ i in FP32; out [n][Hq][d] FP32. Tiled
 * (flash-style, online softmax), so n may be long (≤ 1 << 20); d ∈ {64, 128}; every pointer
 * 16-byte aligned (-EINVAL otherwise). */
int bd_op_prefill_attn(const float *q, const float *k, const float *v, int n, int Hq, int Hkv,
		       int d, float scale, float *out, void *stream);

/* Causal GQA attention of a prefill chunk (bd_model_prefill_chunk's attention): n query rows
 * q [n][Hq][d] at positions p .. p+n−1 over the p + n keys k, v [p+n][Hkv][d] FP32, used as
 * given (no BF16 rounding here: the caller's keys are the context as the cache holds it —
 * bd_op_kv_context — and the chunk's rows as the write path will store them — bd_op_kv_rows);
 * query row i sees keys 0 .. p+i; softmax of scale·q·k in FP32, online over key tiles of 32;
 * out [n][Hq][d] FP32. p = 0 computes what bd_op_prefill_attn computes on BF16-exact K and V
 * up to FP32 summation order (its key tiles are 64). Same limits as bd_op_prefill_attn, and
 * p + n ≤ 1 << 20. */
int bd_op_prefill_attn_ctx(const float *q, const float *k, const float *v, int n, int p, int Hq,
			   int Hkv, int d, float scale, float *out, void *stream);

/* The K' and V rows the write path would store for n tokens, read back as FP32
 * (bd_seq_cache_rows): ret_k[i][h] = BF16(H(k[i][h] − μ_k[h])) (smoothing and rotation as cfg
 * says, the arithmetic of bd_op_kv_write), ret_v[i][h] = BF16(v[i][h]); k, v, ret_k, ret_v
 * [n][H][d] FP32 (ret_* may be rows of a larger buffer of the same row width), mu_k [H][d] or
 * NULL. GQA layouts only (dv = d). Writes no slot. */
int bd_op_kv_rows(const struct bd_layout *lay, const struct bd_kvcfg *cfg, int layer,
		  const float *k, const float *v, const float *mu_k, int n, int H, float *ret_k,
		  float *ret_v, void *stream);

/* In place x[r] ← H x[r] for rows r < rows of d values (d a power of two ≤ BD_FWHT_MAX):
 * bd_fwht's butterflies and 1/√d scale (NUMERICS.md §3), the query rotation q' = Hq of a
 * chunk's prefill. Non-finite rows are transformed too (they stay non-finite). */
int bd_op_fwht_rows(float *x, int rows, int d, void *stream);

/* The context of a prefill chunk as the cache holds it (bd_seq_cache_context): for the n_full
 * promoted pages pages[n_full] (device page ids, token order) of layer `layer` of the arena
 * laid out by lay (GQA pages of any format), KV heads 0..H−1, ret_k and ret_v
 * [n_full·128][H][d] FP32 get K' and V dequantized as bd_page_read_head does (NVFP4 and the
 * channel-blocked NVFP4 (g·s)·x̂ with the page-head's g_K, g_V; MXFP4 s·x̂; FP8 x̂·g; BF16 as
 * stored: NUMERICS.md §2–§4), and, when cfg keeps a sink (§8), positions 0..15 from the slot's
 * BF16 sink rows instead (slot: the request's slot, device). Page ids are not checked here
 * (the caller's). */
int bd_op_kv_context(const struct bd_layout *lay, const struct bd_kvcfg *cfg, int layer,
		     const void *arena, const int32_t *pages, int n_full, const void *slot, int H,
		     float *ret_k, float *ret_v, void *stream);

/* The KV write path of one layer on the device (bd_layout.h's bd_kv_write_token): for each row
 * i < n, the token at position pos[i] of the request whose slot is slots[i] (device array of
 * device pointers) gets k[i] (after k − μ_k and the Hadamard rotation when cfg says so) and
 * v[i], rounded to BF16, in the sink (pos < 16) or the recent ring, heads 0..H−1 of lay.
 * k: [n][H][d], v: [n][H][dv] FP32 (dv = d except MLA); mu_k: [H][d] FP32 of this layer
 * (the rank's KV heads) or NULL (0). Same bytes as the CPU write. Rows of one call must name
 * distinct (slot, position mod 128) pairs (two positions 128 apart share a recent row). Unlike
 * the CPU write, non-finite K/V are not refused (they are stored as BF16 NaN/inf): callers run
 * bd_op_check_finite on the activations first. Positions are device data: a negative one is
 * the caller's error. */
int bd_op_kv_write(const struct bd_layout *lay, const struct bd_kvcfg *cfg, int layer,
		   void *const *slots, const int32_t *pos, const float *k, const float *v,
		   const float *mu_k, int n, int H, void *stream);

/* Sampling parameters of one row, device memory (bd_sampler.h's, plus the draw counter). */
struct bd_gsample {
	float temperature; /* 0: greedy (argmax, lowest id on ties) */
	int top_k;         /* 0: all */
	float top_p;       /* (0, 1]; 1: all */
	int pad;
	uint64_t seed, step; /* counter-based draw: u = U(seed, step) ∈ [0, 1) */
};

/* Scratch bytes bd_op_sample needs for n rows of V logits (32 per row). */
size_t bd_op_sample_ws_bytes(int n, int V);

/* ret[i]: a token drawn from row i of logits [n][V] under p[i]: the kept set and its
 * probabilities are bd_sampler_probs's (temperature, then top-k, then top-p over the sorted
 * distribution); greedy is the argmax (temperature ≤ 0 or NaN counts as greedy). A NaN or
 * +inf logit gives -1. Probability masses are summed in 2^-40 fixed point, so V ≤ 2^23 and a
 * token below 2^-41 of the top token's probability is never drawn (the CPU's probability of it
 * is < 1e-12). ws: bd_op_sample_ws_bytes. */
int bd_op_sample(const float *logits, int n, int V, const struct bd_gsample *p, int32_t *ret,
		 void *ws, void *stream);

/* The k ≤ 64 largest logits of each row, largest first, ties by lower id, NaN ranked below
 * -inf: ids, vals [n][k]. */
int bd_op_topk(const float *logits, int n, int V, int k, int32_t *ids, float *vals,
	       void *stream);

/* Log-probabilities of the model's distribution at one step: the device twin of
 * bd_sampler_logprobs (lib/model/sampler.c, what the cpu backend reports). For each j < m,
 * row r = rows[j] (rows: device-readable [m] indices into logits; NULL: r = j) of logits
 * [*][V] — FP32, the LM head's raw logits: temperature 1, before top-k and top-p, the
 * distribution OpenAI's logprobs describe, whatever the row samples with — in double, the same
 * operations as the CPU:
 *     m_r = max_v x_v,  lse_r = m_r + log Σ_v exp(x_v − m_r),  lp_v = (float)(x_v − lse_r)
 * (max-subtracted log-sum-exp; the sum in a fixed tree, so a row's result does not depend on
 * timing or on the other rows). lp[j] gets lp of tokens[r] (tokens: device [*], indexed like
 * logits' rows, e.g. bd_op_sample's output); ids [m][k] and vals [m][k] the k ≤ 64 most likely
 * tokens and their lp, most likely first, ties by the lower id, −0 equal to +0 (bd_sampler_top's
 * order; bd_op_topk's selection). A −inf logit has lp −inf. A row with a NaN or +inf logit, or
 * with every logit −inf (the CPU's -EDOM), gets lp[j] = NaN, ids −1 and vals NaN; a token
 * outside [0, V) (a refused draw: −1) gets lp[j] = NaN, its row's top entries as usual.
 * Results agree with the CPU's to one FP32 ulp plus the double rounding of the two sums
 * ((V + 2)·2^-52 + 2^-51·(|m_r| + ln V), ops_check). One CTA per row of the m: steps that
 * want no log-probabilities launch nothing. Returns 0 or -EINVAL (NULL logits, tokens or lp,
 * V < 1, m < 0, k outside 0..min(64, V), k > 0 with NULL ids or vals). */
int bd_op_logprobs(const float *logits, int V, const int32_t *rows, int m, const int32_t *tokens,
		   int k, float *lp, int32_t *ids, float *vals, void *stream);

/* x[i] = mean + sigma · N(0, 1) draw i of a counter-based generator keyed by seed (the same
 * values for the same (seed, i) whatever len), stored as dt; i < len. */
int bd_op_fill_normal(void *x, enum bd_dtype dt, size_t len, uint64_t seed, float mean,
		      float sigma, void *stream);

/* ORs 1 into *status when any x[k], k < len, is NaN or ±inf. */
int bd_op_check_finite(const float *x, size_t len, int *status, void *stream);

#ifdef __cplusplus
}
#endif
#endif
