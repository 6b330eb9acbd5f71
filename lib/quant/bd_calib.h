/* bd_calib.h — calibration of the key mean μ_k and the probability threshold τ (NUMERICS.md §7,
 * paper appendices B and C), and the file that carries them.
 *
 * μ_k is the mean post-RoPE key of every (layer, KV head) over one prefill of calibration text
 * that fills the context window; the KV write path subtracts it before the Hadamard rotation
 * (§3). τ is the threshold of underflow-aware probability scaling (§6): a block of 16
 * probabilities whose c·max(p_b) is at most τ uses κ = 2 instead of 6. It is chosen on the E4M3
 * grid of c·max(p_b) — each candidate lies halfway between two neighbouring E4M3 values — as
 * the candidate with the least total squared quantization error of c·p over the probability
 * blocks of a replayed online softmax.
 *
 * A calibration holds for one checkpoint and one context window, so its file names both: the
 * SHA-256 of the model file and the context length, besides the shape (layers, KV heads, head
 * dim). The file, little-endian:
 *
 *   offset  size  field
 *        0     8  magic "BDFP4CAL"
 *        8     4  u32 format version (1)
 *       12     4  u32 n_ctx: context window the calibration prompt filled, tokens
 *       16     4  u32 n_layers
 *       20     4  u32 n_kv_heads
 *       24     4  u32 head_dim d
 *       28     4  u32 tile_keys B_k of the softmax replay
 *       32     4  f32 τ
 *       36     4  f32 c of the replay
 *       40     4  i32 τ's grid index (bd_tau_candidate)
 *       44     4  u32 zero
 *       48     8  u64 key tokens averaged into μ_k (per layer and head)
 *       56     8  u64 probability blocks the τ search saw
 *       64    32  SHA-256 of the model file
 *       96  4·L·Hkv·d  f32 μ_k [L][Hkv][d]
 *      end    32  SHA-256 of every byte before it (a corrupted or cut file is detected)
 *
 * Errors are -errno: -EINVAL a bad argument, -EBADMSG a file that is not a calibration file or
 * is truncated or corrupted, -EPROTONOSUPPORT another format version, -ESTALE a calibration of
 * another model, context or shape, -ENOMEM, and the -errno of open/read/write.
 */
#ifndef BD_CALIB_H
#define BD_CALIB_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define BD_CALIB_ERR_MAX 256     /* bytes of an error message buffer, NUL included */
#define BD_CALIB_VERSION 1
#define BD_CALIB_HEADER_BYTES 96
#define BD_SHA256_BYTES 32

/* ---- SHA-256 (FIPS 180-4) --------------------------------------------------------------- */

struct bd_sha256 {
	uint32_t h[8];
	uint64_t n_bytes;
	uint8_t buf[64];
	size_t fill;
};

void bd_sha256_init(struct bd_sha256 *s);
/* Feed n bytes (data may be NULL when n is 0). */
void bd_sha256_update(struct bd_sha256 *s, const void *data, size_t n);
/* The digest of everything fed; s must be initialized again before reuse. */
void bd_sha256_final(struct bd_sha256 *s, uint8_t ret[BD_SHA256_BYTES]);
/* One-shot digest of data[n]. */
void bd_sha256(const void *data, size_t n, uint8_t ret[BD_SHA256_BYTES]);
/* Digest of a whole file (the model file, for a calibration's identity).
 * Returns 0, -EINVAL (NULL), or the -errno of open/read. */
int bd_sha256_file(const char *path, uint8_t ret[BD_SHA256_BYTES]);
/* Lower-case hex of a digest: ret gets 64 characters and a NUL. */
void bd_sha256_hex(const uint8_t d[BD_SHA256_BYTES], char ret[2 * BD_SHA256_BYTES + 1]);

/* ---- the calibration ---------------------------------------------------------------------- */

struct bd_calib {
	uint8_t model_sha256[BD_SHA256_BYTES];
	int n_ctx;            /* context window, tokens */
	int n_layers, n_kv_heads, head_dim;
	int tile_keys;        /* B_k of the softmax replay that chose τ */
	float tau;            /* τ, for bd_decode_params.tau */
	float c;              /* the c τ was chosen with (bd_decode_params.c) */
	int tau_index;        /* τ = bd_tau_candidate(tau_index) */
	uint64_t n_key_tokens; /* tokens averaged into μ_k */
	uint64_t n_p_blocks;  /* probability blocks of the τ search */
	float *mu_k;          /* [n_layers][n_kv_heads][head_dim] post-RoPE key means */
};

/* A calibration of this shape with μ_k zero and τ = 21/1024, c = 8, B_k = 64 (the defaults of
 * NUMERICS.md §6), everything else zero. Sizes must be positive, L·Hkv·d ≤ 2^26. μ_k lies in
 * the calibration's own allocation (bd_calib_free releases both; do not repoint mu_k).
 * Returns 0, -EINVAL, -ENOMEM; *ret only on success. */
int bd_calib_new(int n_layers, int n_kv_heads, int head_dim, struct bd_calib **ret);

/* Release a calibration. NULL is a no-op. */
void bd_calib_free(struct bd_calib *c);

/* Bytes of the file of a calibration of this shape (header, μ_k, checksum). */
size_t bd_calib_file_bytes(int n_layers, int n_kv_heads, int head_dim);

/* Encode c into buf[cap] (cap ≥ bd_calib_file_bytes). Returns the bytes written, -EINVAL
 * (NULL, cap too small, a field out of range: non-positive sizes or context, τ or c not finite
 * or c ≤ 0, a non-finite μ_k). */
long bd_calib_encode(const struct bd_calib *c, void *buf, size_t cap);

/* Write c to path: to a temporary file beside it, then renamed over path, so that a reader
 * never sees half a file. Returns 0, the errors of bd_calib_encode, or the -errno of the file
 * calls (nothing is left behind on failure). */
int bd_calib_save(const struct bd_calib *c, const char *path);

/* What a loader expects: the model's checksum, context and shape. n_ctx 0 accepts any context
 * (a tool that runs at whatever length its prompt needs). */
struct bd_calib_expect {
	const uint8_t *model_sha256; /* [32] */
	int n_ctx;
	int n_layers, n_kv_heads, head_dim;
};

/* Decode a calibration file image buf[n] and check it against want (NULL: no check).
 * ret_err: NULL or BD_CALIB_ERR_MAX bytes, a one-line message on failure ("" on success).
 * Returns 0 and *ret, or -EINVAL (NULL), -EBADMSG (wrong magic, a size other than the header
 * says, a checksum mismatch, a field out of range: non-positive sizes, τ or μ_k not finite),
 * -EPROTONOSUPPORT (another version), -ESTALE (another model, context or shape than want),
 * -ENOMEM. On error *ret is not written. */
int bd_calib_decode(const void *buf, size_t n, const struct bd_calib_expect *want,
		    struct bd_calib **ret, char *ret_err);

/* Read and decode the file at path (bd_calib_decode). Returns its errors or the -errno of
 * open/read; a file larger than any calibration of a plausible shape is -EBADMSG. */
int bd_calib_load(const char *path, const struct bd_calib_expect *want, struct bd_calib **ret,
		  char *ret_err);

/* ---- μ_k: mean post-RoPE keys ------------------------------------------------------------ */

struct bd_mu_acc;

/* An accumulator of keys for n_layers × n_kv_heads heads of head_dim channels (FP64 sums).
 * Returns 0, -EINVAL, -ENOMEM. */
int bd_mu_acc_new(int n_layers, int n_kv_heads, int head_dim, struct bd_mu_acc **ret);
void bd_mu_acc_free(struct bd_mu_acc *a);

/* Add the keys of one position of one layer: k [n_kv_heads][head_dim] post-RoPE FP32.
 * Returns 0, -EINVAL (NULL, layer out of range), -EDOM (a non-finite key: nothing added). */
int bd_mu_acc_add(struct bd_mu_acc *a, int layer, const float *k);

/* The means, ret_mu [L][Hkv][d] (FP64 sum / count, rounded to FP32), and the number of
 * positions every layer received. Returns 0, -EINVAL (NULL, or layers that received different
 * numbers of positions, or none). */
int bd_mu_acc_mean(const struct bd_mu_acc *a, float *ret_mu, uint64_t *ret_count);

/* ---- τ: threshold search on the E4M3 grid -------------------------------------------------- */

/* Candidates: index 0 is τ = 0 (κ = 6 for every block with p_max > 0, the standard rule);
 * index j ≥ 1 is halfway between E4M3 codes j − 1 and j, (e4m3(j−1) + e4m3(j)) / 2, up to
 * j = 126 (432, between codes 0x7d = 416 and 0x7e = 448). The paper's Qwen3 value, between
 * codes 10 and 11, is index 11: τ = 21/1024. */
#define BD_TAU_CANDIDATES 127

/* τ of candidate j (0..126), or NaN outside. */
float bd_tau_candidate(int j);

/* The squared quantization error of c·p of every block under every candidate, accumulated as
 * the κ = 6 error of all blocks plus, per candidate, the change of the blocks it is the first
 * to switch to κ = 2. */
struct bd_tau_search {
	float c;
	uint64_t n_blocks;
	double err6;                         /* Σ_b err_b(κ = 6) */
	double delta[BD_TAU_CANDIDATES];     /* Σ over blocks first switched at j of err(2) − err(6) */
};

/* Start a search for probability scale c (finite, > 0). Returns 0 or -EINVAL. */
int bd_tau_search_init(struct bd_tau_search *ts, float c);

/* Add one block: P [16] the scaled probabilities c·p_i = exp2(S_i − m + log2 c) (masked keys
 * 0), p_max = exp2(max S_b − m) its unscaled maximum. Each κ is evaluated with
 * bd_p_quantize_block_nvfp4; the error is Σ_i (s_P·P̂_i − P_i)² in FP64. A block switches to
 * κ = 2 at the first candidate with p_max ≤ τ_j / c (the decoder's test).
 * Returns 0, -EINVAL (NULL), -EDOM (non-finite or negative input, p_max > 1). */
int bd_tau_search_add_block(struct bd_tau_search *ts, const float P[16], float p_max);

/* Replay the online softmax of one decode query over n keys (§6): S [n] its log2-domain
 * logits γ·⟨q, k_i⟩, keys 0..n_skip−1 masked (the BF16 sink), tiles of tile_keys keys (a
 * multiple of 16; the last tile may be partial, its missing keys masked) with running max
 * m_j = max(m_{j−1}, max S_j); every 16-key block holding an unmasked key is added with
 * P_i = exp2(S_i − m_j + log2 c), p_max = exp2(max S_b − m_j).
 * Returns 0, -EINVAL (NULL, n < 0, n_skip < 0, bad tile_keys), -EDOM (a non-finite S). */
int bd_tau_search_add_logits(struct bd_tau_search *ts, const float *S, int n, int n_skip,
			     int tile_keys);

/* The result: the candidate with the least total error (the lowest index on ties), its τ and
 * its total error, and optionally every candidate's total (ret_err_all [BD_TAU_CANDIDATES] or
 * NULL). Returns 0, -EINVAL (NULL, or no block added). */
int bd_tau_search_result(const struct bd_tau_search *ts, int *ret_index, float *ret_tau,
			 double *ret_err, double *ret_err_all);

#ifdef __cplusplus
}
#endif
#endif
