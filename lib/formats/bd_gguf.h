/* bd_gguf.h — reading GGUF model files (versions 2 and 3; the embedded default model's format).
 *
 * A GGUF file is, little-endian: "GGUF", u32 version, u64 n_tensors, u64 n_kv; n_kv metadata
 * entries (string key, u32 value type, value); n_tensors tensor infos (string name, u32 n_dims,
 * u64 ne[n_dims], u32 ggml type, u64 offset); padding to the alignment (general.alignment,
 * default 32); the tensor data section, each tensor at data_offset + offset. A string is a u64
 * byte count and that many bytes (no terminator); an array is a u32 element type, a u64 count
 * and the elements.
 *
 * The parser works on bytes it does not own (a mapping of the file, or a caller's buffer) and
 * never reads outside them: every count, string length, offset and tensor extent is checked,
 * with overflow-safe arithmetic, before it is used. A malformed file is an error code plus a
 * one-line message, never a crash.
 *
 * Errors (negative errno):
 *   -EINVAL           a NULL or otherwise bad argument
 *   -ENOEXEC          the file does not start with "GGUF"
 *   -EPROTONOSUPPORT  a version other than 2 or 3 (a big-endian file reads as one)
 *   -EBADMSG          malformed or truncated: a string, array, value, tensor info or tensor data
 *                     past the end, a count the remaining bytes cannot hold, an unknown value or
 *                     tensor type, more than 4 dims, a row length not a multiple of the type's
 *                     block, a bad general.alignment, a tensor offset not a multiple of it, a
 *                     duplicate key or tensor name, a NUL byte inside one, a bool not 0 or 1,
 *                     arrays nested deeper than 4
 *   -EOVERFLOW        a tensor's element count or byte size does not fit in 63 bits
 *   -ENOMEM
 *   -errno of open(2), fstat(2), mmap(2) (e.g. -ENOENT)
 */
#ifndef BD_GGUF_H
#define BD_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "formats/bd_ggml_quants.h"

#ifdef __cplusplus
extern "C" {
#endif

#define BD_GGUF_ERR_MAX 256     /* bytes of an error message buffer, NUL included */
#define BD_GGUF_MAX_DIMS 4
#define BD_GGUF_DEFAULT_ALIGNMENT 32

/* Metadata value types, as stored. */
enum bd_gguf_type {
	BD_GGUF_UINT8 = 0,
	BD_GGUF_INT8 = 1,
	BD_GGUF_UINT16 = 2,
	BD_GGUF_INT16 = 3,
	BD_GGUF_UINT32 = 4,
	BD_GGUF_INT32 = 5,
	BD_GGUF_FLOAT32 = 6,
	BD_GGUF_BOOL = 7,
	BD_GGUF_STRING = 8,
	BD_GGUF_ARRAY = 9,
	BD_GGUF_UINT64 = 10,
	BD_GGUF_INT64 = 11,
	BD_GGUF_FLOAT64 = 12,
	BD_GGUF_TYPE_COUNT
};

/* A string inside the file: len bytes at s, not NUL-terminated, may hold any byte. */
struct bd_gguf_str {
	const char *s;
	size_t len;
};

/* One metadata entry. Pointers stay valid until bd_gguf_free(). */
struct bd_gguf_kv {
	const char *key;            /* NUL-terminated copy, no NUL inside */
	enum bd_gguf_type type;
	enum bd_gguf_type arr_type; /* element type when type is ARRAY */
	uint64_t n;                 /* element count of an array; 1 for a scalar */
	const void *data;           /* the raw little-endian value (scalar) or elements (array of a
				     * fixed-size type), inside the file; for nested arrays, the
				     * encoded elements */
	const struct bd_gguf_str *strs; /* STRING: [1]; array of STRING: [n]; else NULL */
};

/* One tensor. ne[0] is the contiguous (row) dimension; dims past n_dims are 1. */
struct bd_gguf_tensor {
	const char *name; /* NUL-terminated copy */
	enum bd_ggml_type type;
	int n_dims;                       /* 0..4 */
	uint64_t ne[BD_GGUF_MAX_DIMS];
	uint64_t n_elements;              /* ne[0]·ne[1]·ne[2]·ne[3] */
	uint64_t offset;                  /* from the start of the data section */
	size_t nbytes;                    /* n_elements / blck · type_size */
	const void *data;                 /* inside the file; aligned as the file is (mmap: to
					   * the file's alignment) */
};

struct bd_gguf;

/* Open and parse a GGUF file, mapping it read-only (the mapping lives as long as the handle).
 * ret_err: NULL or BD_GGUF_ERR_MAX bytes; on failure it gets a one-line message naming what
 * is wrong and where (byte offset), on success the empty string.
 * Returns 0 and *ret a handle for bd_gguf_free(), or a negative errno (see the file comment);
 * on error *ret is not written. */
int bd_gguf_open(const char *path, struct bd_gguf **ret, char *ret_err);

/* Parse a GGUF image held in memory: buf[size], any alignment, not copied — the caller keeps
 * it alive and unchanged until bd_gguf_free(). Same checks, errors and ret_err as
 * bd_gguf_open(). */
int bd_gguf_open_mem(const void *buf, size_t size, struct bd_gguf **ret, char *ret_err);

/* Drop a reference to a handle; the last one releases it and its mapping. NULL is a no-op. */
void bd_gguf_free(struct bd_gguf *g);

/* Take one more reference to g (a model that keeps pointing into the file's tensors takes one,
 * so the opener may free its own): each bd_gguf_ref() is paired with a bd_gguf_free(). For an
 * image of bd_gguf_open_mem(), the caller's buffer must then outlive every reference. Safe
 * from several threads (the count is the handle's only mutable state, hence the const
 * argument). Returns g (NULL for NULL). */
struct bd_gguf *bd_gguf_ref(const struct bd_gguf *g);

/* Header facts: format version (2 or 3), alignment of the data section (bytes, a power of
 * two), data section offset from the file start (bytes), file size (bytes). */
uint32_t bd_gguf_version(const struct bd_gguf *g);
size_t bd_gguf_alignment(const struct bd_gguf *g);
size_t bd_gguf_data_offset(const struct bd_gguf *g);
size_t bd_gguf_file_size(const struct bd_gguf *g);

/* ---- metadata ---------------------------------------------------------------------------- */

/* Number of metadata entries and entry i (0..n−1, file order; NULL when out of range). */
size_t bd_gguf_n_kv(const struct bd_gguf *g);
const struct bd_gguf_kv *bd_gguf_kv_at(const struct bd_gguf *g, size_t i);

/* The entry with this exact key, or NULL (no entry, or NULL arguments). O(log n_kv). */
const struct bd_gguf_kv *bd_gguf_find_kv(const struct bd_gguf *g, const char *key);

/* Typed getters. Each returns 0 and writes *ret, -ENOENT when the key is absent, -EBADMSG
 * when the value has another type (nothing written), -EINVAL for NULL arguments.
 *   get_int   any integer type (u8..i64); -ERANGE if a UINT64 exceeds INT64_MAX
 *   get_float FLOAT32 or FLOAT64, widened to double
 *   get_bool  BOOL
 *   get_str   STRING (the bytes stay inside the file) */
int bd_gguf_get_int(const struct bd_gguf *g, const char *key, int64_t *ret);
int bd_gguf_get_float(const struct bd_gguf *g, const char *key, double *ret);
int bd_gguf_get_bool(const struct bd_gguf *g, const char *key, bool *ret);
int bd_gguf_get_str(const struct bd_gguf *g, const char *key, struct bd_gguf_str *ret);

/* Element i of an array entry, typed as above (integer elements through _int, float elements
 * through _float, string elements through _str). Returns 0, -EINVAL (NULL, not an array, or
 * i ≥ n), -EBADMSG (element type mismatch), -ERANGE (UINT64 > INT64_MAX). */
int bd_gguf_arr_int(const struct bd_gguf_kv *kv, uint64_t i, int64_t *ret);
int bd_gguf_arr_float(const struct bd_gguf_kv *kv, uint64_t i, double *ret);
int bd_gguf_arr_str(const struct bd_gguf_kv *kv, uint64_t i, struct bd_gguf_str *ret);

/* Name of a value type ("UINT32", "STRING", …) or "?" for an unknown one. */
const char *bd_gguf_type_name(int type);

/* ---- tensors ----------------------------------------------------------------------------- */

/* Number of tensors and tensor i (0..n−1, file order; NULL when out of range). */
size_t bd_gguf_n_tensors(const struct bd_gguf *g);
const struct bd_gguf_tensor *bd_gguf_tensor_at(const struct bd_gguf *g, size_t i);

/* The tensor with this exact name, or NULL. O(log n_tensors). */
const struct bd_gguf_tensor *bd_gguf_find_tensor(const struct bd_gguf *g, const char *name);

/* Dequantize a whole tensor to FP32: ret_x [n_elements], in ne[0]-fastest order.
 * Returns 0, -EINVAL (NULL), -ENOTSUP (a type bd_ggml_dequantize() does not handle);
 * on error nothing is written. */
int bd_gguf_tensor_to_f32(const struct bd_gguf_tensor *t, float *ret_x);

/* Dequantize rows [row0, row0 + n_rows) of a tensor seen as a matrix of ne[0] columns and
 * n_elements / ne[0] rows: ret_x [n_rows][ne[0]]. Returns 0, -EINVAL (NULL, rows out of
 * range), -ENOTSUP; on error nothing is written. */
int bd_gguf_tensor_rows_f32(const struct bd_gguf_tensor *t, uint64_t row0, uint64_t n_rows,
			    float *ret_x);

/* ---- model hyperparameters --------------------------------------------------------------- */

enum bd_arch {
	BD_ARCH_LLAMA = 0,
	BD_ARCH_QWEN2 = 1,
	BD_ARCH_QWEN3 = 2,
};

/* How RoPE pairs the channels of a head (llama.cpp's rope types). */
enum bd_rope_style {
	BD_ROPE_NORM = 0, /* pairs (2i, 2i+1): GGUF Llama, whose Q/K rows the converter permuted */
	BD_ROPE_NEOX = 1, /* pairs (i, i + n_rot/2): Qwen2, Qwen3 */
};

/* The decoder's shape and constants, read from "<arch>.*" metadata. */
struct bd_model_hparams {
	enum bd_arch arch;
	char arch_name[16];   /* general.architecture: "llama", "qwen2" or "qwen3" */
	int n_layers;         /* <arch>.block_count */
	int n_embd;           /* <arch>.embedding_length: residual width */
	int n_ff;             /* <arch>.feed_forward_length: MLP hidden width */
	int n_heads;          /* <arch>.attention.head_count: query heads Hq */
	int n_kv_heads;       /* <arch>.attention.head_count_kv (default n_heads): Hkv, divides Hq */
	int head_dim;         /* <arch>.attention.key_length (default n_embd / n_heads): d */
	int head_dim_v;       /* <arch>.attention.value_length (default head_dim) */
	int n_rot;            /* <arch>.rope.dimension_count (default head_dim): rotated channels */
	enum bd_rope_style rope_style;
	float rope_base;      /* <arch>.rope.freq_base (default 10000): θ_i = base^(−2i/n_rot) */
	float norm_eps;       /* <arch>.attention.layer_norm_rms_epsilon: RMSNorm ε */
	int n_ctx_train;      /* <arch>.context_length: training context, tokens */
	int n_vocab;          /* <arch>.vocab_size, else the length of tokenizer.ggml.tokens,
			       * else token_embd.weight's ne[1] */
	bool qk_norm;         /* per-head RMSNorm of q and k before RoPE (Qwen3) */
	bool attn_bias;       /* q/k/v projections have biases (blk.0.attn_q.bias present: Qwen2) */
	bool tied_embeddings; /* no output.weight: the LM head is token_embd.weight */
};

/* Read and validate the hyperparameters of a Llama, Qwen2 or Qwen3 model: positive sizes,
 * n_heads a multiple of n_kv_heads, head_dim even and n_rot even and ≤ head_dim, finite
 * rope_base > 0 and norm_eps > 0, token_embd.weight present with ne = {n_embd, ≥ n_vocab}.
 * ret_err: NULL or BD_GGUF_ERR_MAX bytes for a message.
 * Returns 0, -EINVAL (NULL), -ENOTSUP (another architecture), -EBADMSG (a key missing, of
 * the wrong type or out of range); on error *ret is not written. */
int bd_gguf_model_hparams(const struct bd_gguf *g, struct bd_model_hparams *ret, char *ret_err);

#ifdef __cplusplus
}
#endif
#endif
