/* bd_safetensors.h — reading safetensors files (Hugging Face weights).
 *
 * A safetensors file is: a u64 little-endian N, N bytes of UTF-8 JSON (the header), then the
 * byte buffer. The header is one JSON object: each key but "__metadata__" names a tensor,
 *     "name": {"dtype": "BF16", "shape": [rows, cols], "data_offsets": [begin, end]}
 * with begin/end byte offsets into the buffer (end exclusive) and shape in PyTorch order (the
 * last dimension is contiguous); "__metadata__", optional, maps strings to strings.
 *
 * The parser (st = safetensors in the names below) works on bytes it does not own and never
 * reads outside them. It checks, with overflow-safe arithmetic, before anything is used:
 *   - 8 ≤ file size, N ≤ 100,000,000 and 8 + N ≤ file size; the header starts with '{' and is
 *     one JSON object (trailing spaces allowed), no duplicate keys;
 *   - every tensor entry has exactly the fields dtype (a known name), shape (≤ BD_ST_MAX_DIMS
 *     non-negative integers) and data_offsets (two non-negative integers, begin ≤ end);
 *   - element count and byte size fit in 63 bits; end − begin = element count · dtype size;
 *   - the tensors tile the buffer exactly: sorted by offset, each begins where the previous
 *     ended, the first at 0, the last ends at the end of the file (no overlap, no hole, no
 *     trailing bytes, as the format requires);
 *   - __metadata__ is an object of strings.
 * Tensor data need not be aligned (N is arbitrary); conversions read it byte by byte.
 *
 * Errors (negative errno):
 *   -EINVAL     a NULL or otherwise bad argument
 *   -EBADMSG    malformed or truncated (any check above; the message names the tensor and
 *               the offending value)
 *   -EOVERFLOW  a tensor's element count or byte size does not fit in 63 bits
 *   -ENOMEM
 *   -errno of open(2), fstat(2), mmap(2) (e.g. -ENOENT); -EISDIR for a directory
 */
#ifndef BD_SAFETENSORS_H
#define BD_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define BD_ST_ERR_MAX 256              /* bytes of an error message buffer, NUL included */
#define BD_ST_MAX_DIMS 8
#define BD_ST_MAX_HEADER 100000000ull  /* the reference implementation's header limit */

/* Element types the format names. Only F32, F16 and BF16 convert to FP32 here; the others
 * parse (their sizes are checked) so that a checkpoint holding, say, an I64 buffer loads. */
enum bd_st_dtype {
	BD_ST_BOOL = 0,
	BD_ST_U8,
	BD_ST_I8,
	BD_ST_F8_E5M2,
	BD_ST_F8_E4M3,
	BD_ST_F8_E8M0,
	BD_ST_I16,
	BD_ST_U16,
	BD_ST_F16,
	BD_ST_BF16,
	BD_ST_I32,
	BD_ST_U32,
	BD_ST_F32,
	BD_ST_F64,
	BD_ST_I64,
	BD_ST_U64,
	BD_ST_DTYPE_COUNT
};

/* One tensor. Pointers stay valid until bd_st_free(). */
struct bd_st_tensor {
	const char *name;             /* NUL-terminated, no NUL inside */
	enum bd_st_dtype dtype;
	int n_dims;                   /* 0..BD_ST_MAX_DIMS; 0 is a scalar */
	uint64_t shape[BD_ST_MAX_DIMS]; /* PyTorch order: shape[n_dims − 1] is contiguous;
					 * entries past n_dims are 1 */
	uint64_t n_elements;          /* product of shape (1 for a scalar) */
	uint64_t begin, end;          /* data_offsets: bytes from the start of the buffer */
	size_t nbytes;                /* end − begin */
	const void *data;             /* inside the file, any alignment */
};

struct bd_st;

/* Open and parse a safetensors file, mapping it read-only (the mapping lives as long as the
 * handle). ret_err: NULL or BD_ST_ERR_MAX bytes; on failure a one-line message naming the file
 * and what is wrong, on success the empty string.
 * Returns 0 and *ret a handle for bd_st_free(), or a negative errno (see the file comment);
 * on error *ret is not written. */
int bd_st_open(const char *path, struct bd_st **ret, char *ret_err);

/* Parse a safetensors image held in memory: buf[size], any alignment, not copied (the caller
 * keeps it alive and unchanged until bd_st_free()). Same checks, errors and ret_err as
 * bd_st_open(). */
int bd_st_open_mem(const void *buf, size_t size, struct bd_st **ret, char *ret_err);

/* Release a handle (and its mapping). NULL is a no-op. */
void bd_st_free(struct bd_st *st);

/* Header length N (bytes), offset of the byte buffer from the file start (8 + N, bytes),
 * file size (bytes). */
size_t bd_st_header_len(const struct bd_st *st);
size_t bd_st_data_offset(const struct bd_st *st);
size_t bd_st_file_size(const struct bd_st *st);

/* ---- tensors ----------------------------------------------------------------------------- */

/* Number of tensors and tensor i (0..n−1, in data-offset order; NULL when out of range). */
size_t bd_st_n_tensors(const struct bd_st *st);
const struct bd_st_tensor *bd_st_tensor_at(const struct bd_st *st, size_t i);

/* The tensor with this exact name, or NULL (none, or NULL arguments). O(log n). */
const struct bd_st_tensor *bd_st_find_tensor(const struct bd_st *st, const char *name);

/* The format's name of a dtype ("BF16", …) or NULL for an unknown value; its element size in
 * bytes, or 0 for an unknown value. */
const char *bd_st_dtype_name(int dtype);
size_t bd_st_dtype_size(int dtype);

/* Convert a whole tensor to FP32: ret_x [n_elements] in storage order (last dim fastest).
 * F32 is copied, F16 widened exactly (subnormals, ±inf, NaN kept), BF16 is the upper half of
 * an FP32. Returns 0, -EINVAL (NULL), -ENOTSUP (another dtype); on error nothing is written. */
int bd_st_tensor_to_f32(const struct bd_st_tensor *t, float *ret_x);

/* Rows [row0, row0 + n_rows) of a tensor seen as a matrix of shape[n_dims − 1] columns (1 for
 * a scalar) and n_elements / columns rows: ret_x [n_rows][columns] FP32. Returns 0, -EINVAL
 * (NULL, rows out of range), -ENOTSUP; on error nothing is written. */
int bd_st_tensor_rows_f32(const struct bd_st_tensor *t, uint64_t row0, uint64_t n_rows,
			  float *ret_x);

/* ---- metadata ---------------------------------------------------------------------------- */

/* Number of __metadata__ entries; entry i (0..n−1, header order) as NUL-terminated key and
 * value (valid until bd_st_free()). Returns 0 or -EINVAL (NULL, i out of range; nothing
 * written). */
size_t bd_st_n_metadata(const struct bd_st *st);
int bd_st_metadata_at(const struct bd_st *st, size_t i, const char **ret_key,
		      const char **ret_value);

/* The value of metadata key `key`, or NULL (absent, or NULL arguments). */
const char *bd_st_metadata_get(const struct bd_st *st, const char *key);

#ifdef __cplusplus
}
#endif
#endif
