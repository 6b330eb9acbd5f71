/* safetensors.c — the safetensors parser and FP32 conversion (bd_safetensors.h).
 *
 * The JSON header goes through jansson (duplicate keys refused, UTF-8 checked, nesting
 * bounded); every number it yields is range-checked here before it becomes an offset or a
 * size, and the tensors must tile the byte buffer exactly, so any data pointer handed out lies
 * inside the file.
 */
#include <errno.h>
#include <stddef.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "quant/bd_fp4.h"
#include "base/bd_err.h"
#include "base/bd_mapfile.h"
#include "base/bd_names.h"
#include "formats/bd_ggml_quants.h"
#include "formats/bd_safetensors.h"

#define LEN_BYTES 8
#define MAX_63 ((uint64_t)INT64_MAX)

struct meta {
	const char *key, *value; /* inside root */
};

struct bd_st {
	const uint8_t *base;
	size_t size;
	struct bd_mapfile file; /* the mapping of bd_st_open (zeroed for a memory image) */
	size_t header_len, data_offset;
	json_t *root; /* owns every name, key and value string handed out */

	size_t n_tensors;
	struct bd_st_tensor *tensors;           /* by data offset */
	struct bd_names t_index;                /* by name */

	size_t n_meta;
	struct meta *meta;
};

static const struct {
	const char *name;
	size_t size;
} dtypes[BD_ST_DTYPE_COUNT] = {
	[BD_ST_BOOL] = { "BOOL", 1 },       [BD_ST_U8] = { "U8", 1 },
	[BD_ST_I8] = { "I8", 1 },           [BD_ST_F8_E5M2] = { "F8_E5M2", 1 },
	[BD_ST_F8_E4M3] = { "F8_E4M3", 1 }, [BD_ST_F8_E8M0] = { "F8_E8M0", 1 },
	[BD_ST_I16] = { "I16", 2 },         [BD_ST_U16] = { "U16", 2 },
	[BD_ST_F16] = { "F16", 2 },         [BD_ST_BF16] = { "BF16", 2 },
	[BD_ST_I32] = { "I32", 4 },         [BD_ST_U32] = { "U32", 4 },
	[BD_ST_F32] = { "F32", 4 },         [BD_ST_F64] = { "F64", 8 },
	[BD_ST_I64] = { "I64", 8 },         [BD_ST_U64] = { "U64", 8 },
};

#define fail(err, code, ...) bd_errf(err, BD_ST_ERR_MAX, code, __VA_ARGS__)

const char *bd_st_dtype_name(int dtype)
{
	return dtype >= 0 && dtype < BD_ST_DTYPE_COUNT ? dtypes[dtype].name : NULL;
}

size_t bd_st_dtype_size(int dtype)
{
	return dtype >= 0 && dtype < BD_ST_DTYPE_COUNT ? dtypes[dtype].size : 0;
}

static int dtype_of(const char *s)
{
	for (int i = 0; i < BD_ST_DTYPE_COUNT; i++)
		if (strcmp(s, dtypes[i].name) == 0)
			return i;
	return -1;
}

/* ---- parsing ------------------------------------------------------------------------------- */

/* A JSON integer in [0, 2^63) as u64. */
static bool get_u63(const json_t *v, uint64_t *ret)
{
	if (!json_is_integer(v) || json_integer_value(v) < 0)
		return false;
	*ret = (uint64_t)json_integer_value(v);
	return true;
}

/* Names in messages are cut so that the rest of the message still fits. */
#define NAME_FMT "'%.64s'"

static int parse_tensor(const char *name, json_t *v, size_t buf_size, const uint8_t *buf,
			struct bd_st_tensor *t, char *err)
{
	if (!json_is_object(v))
		return fail(err, -EBADMSG, "tensor " NAME_FMT ": entry is not an object", name);
	const char *k;
	json_t *f;
	json_object_foreach(v, k, f)
		if (strcmp(k, "dtype") && strcmp(k, "shape") && strcmp(k, "data_offsets"))
			return fail(err, -EBADMSG, "tensor " NAME_FMT ": unknown field '%.32s'",
				    name, k);
	json_t *jd = json_object_get(v, "dtype"), *js = json_object_get(v, "shape");
	json_t *jo = json_object_get(v, "data_offsets");
	if (!jd || !js || !jo)
		return fail(err, -EBADMSG, "tensor " NAME_FMT ": missing %s", name,
			    !jd ? "dtype" : !js ? "shape" : "data_offsets");

	memset(t, 0, sizeof(*t));
	t->name = name;
	int dt = json_is_string(jd) ? dtype_of(json_string_value(jd)) : -1;
	if (dt < 0)
		return fail(err, -EBADMSG, "tensor " NAME_FMT ": unknown dtype %s%.16s%s", name,
			    json_is_string(jd) ? "'" : "(not a string)",
			    json_is_string(jd) ? json_string_value(jd) : "",
			    json_is_string(jd) ? "'" : "");
	t->dtype = (enum bd_st_dtype)dt;

	if (!json_is_array(js))
		return fail(err, -EBADMSG, "tensor " NAME_FMT ": shape is not an array", name);
	if (json_array_size(js) > BD_ST_MAX_DIMS)
		return fail(err, -EBADMSG, "tensor " NAME_FMT ": %zu dims, at most %d supported",
			    name, json_array_size(js), BD_ST_MAX_DIMS);
	t->n_dims = (int)json_array_size(js);
	uint64_t n = 1;
	bool over = false;
	for (int i = 0; i < BD_ST_MAX_DIMS; i++) {
		t->shape[i] = 1;
		if (i >= t->n_dims)
			continue;
		if (!get_u63(json_array_get(js, (size_t)i), &t->shape[i]))
			return fail(err, -EBADMSG, "tensor " NAME_FMT ": shape[%d] is not a "
				    "non-negative integer", name, i);
		/* a zero anywhere makes the product 0 whatever the other dims are */
		if (t->shape[i] && n > MAX_63 / t->shape[i])
			over = true;
		n *= t->shape[i];
	}
	bool zero = false;
	for (int i = 0; i < t->n_dims; i++)
		zero |= t->shape[i] == 0;
	if (zero) {
		n = 0;
		over = false;
	}
	size_t es = dtypes[dt].size;
	if (over || n > MAX_63 / es)
		return fail(err, -EOVERFLOW, "tensor " NAME_FMT ": element count or byte size "
			    "does not fit in 63 bits", name);
	t->n_elements = n;

	if (!json_is_array(jo) || json_array_size(jo) != 2 ||
	    !get_u63(json_array_get(jo, 0), &t->begin) || !get_u63(json_array_get(jo, 1), &t->end))
		return fail(err, -EBADMSG, "tensor " NAME_FMT ": data_offsets is not two "
			    "non-negative integers", name);
	if (t->begin > t->end)
		return fail(err, -EBADMSG, "tensor " NAME_FMT ": data_offsets [%llu, %llu] run "
			    "backwards", name, (unsigned long long)t->begin,
			    (unsigned long long)t->end);
	if (t->end - t->begin != n * es)
		return fail(err, -EBADMSG, "tensor " NAME_FMT ": data_offsets hold %llu bytes, "
			    "dtype %s and shape need %llu", name,
			    (unsigned long long)(t->end - t->begin), dtypes[dt].name,
			    (unsigned long long)(n * es));
	if (t->end > buf_size)
		return fail(err, -EBADMSG, "tensor " NAME_FMT ": data_offsets end %llu is past "
			    "the end of the file (%zu bytes of data)", name,
			    (unsigned long long)t->end, buf_size);
	t->nbytes = (size_t)(t->end - t->begin);
	t->data = buf + t->begin;
	return 0;
}

static int parse_metadata(struct bd_st *st, json_t *v, char *err)
{
	if (!json_is_object(v))
		return fail(err, -EBADMSG, "__metadata__ is not an object");
	size_t n = json_object_size(v);
	st->meta = calloc(n ? n : 1, sizeof(*st->meta));
	if (!st->meta)
		return fail(err, -ENOMEM, "out of memory");
	const char *k;
	json_t *s;
	json_object_foreach(v, k, s) {
		if (!json_is_string(s))
			return fail(err, -EBADMSG, "__metadata__ entry '%.64s' is not a string", k);
		st->meta[st->n_meta].key = k;
		st->meta[st->n_meta].value = json_string_value(s);
		st->n_meta++;
	}
	return 0;
}

static int by_offset(const void *a, const void *b)
{
	const struct bd_st_tensor *x = a, *y = b;
	if (x->begin != y->begin)
		return x->begin < y->begin ? -1 : 1;
	if (x->end != y->end)
		return x->end < y->end ? -1 : 1;
	return 0;
}

static int parse(struct bd_st *st, char *err)
{
	if (st->size < LEN_BYTES)
		return fail(err, -EBADMSG, "truncated: %zu bytes, the header length alone takes %d",
			    st->size, LEN_BYTES);
	uint64_t N = 0;
	for (int i = LEN_BYTES - 1; i >= 0; i--)
		N = N << 8 | st->base[i];
	if (N > BD_ST_MAX_HEADER)
		return fail(err, -EBADMSG, "header length %llu exceeds the limit of %llu bytes",
			    (unsigned long long)N, BD_ST_MAX_HEADER);
	if (N > st->size - LEN_BYTES)
		return fail(err, -EBADMSG, "truncated: header length %llu is past the end of the "
			    "file (%zu bytes after the length)", (unsigned long long)N,
			    st->size - LEN_BYTES);
	if (N < 2 || st->base[LEN_BYTES] != '{')
		return fail(err, -EBADMSG, "header does not start with '{'");
	st->header_len = (size_t)N;
	st->data_offset = LEN_BYTES + (size_t)N;

	json_error_t je;
	st->root = json_loadb((const char *)st->base + LEN_BYTES, (size_t)N,
			      JSON_REJECT_DUPLICATES, &je);
	if (!st->root)
		return fail(err, -EBADMSG, "header is not JSON: %.120s (header byte %d)", je.text,
			    je.position);
	if (!json_is_object(st->root))
		return fail(err, -EBADMSG, "header is not a JSON object");

	size_t n = json_object_size(st->root);
	st->tensors = calloc(n ? n : 1, sizeof(*st->tensors));
	if (!st->tensors)
		return fail(err, -ENOMEM, "out of memory");

	const uint8_t *buf = st->base + st->data_offset;
	size_t buf_size = st->size - st->data_offset;
	const char *k;
	json_t *v;
	int r;
	json_object_foreach(st->root, k, v) {
		if (strcmp(k, "__metadata__") == 0) {
			if ((r = parse_metadata(st, v, err)) < 0)
				return r;
			continue;
		}
		if ((r = parse_tensor(k, v, buf_size, buf, &st->tensors[st->n_tensors], err)) < 0)
			return r;
		st->n_tensors++;
	}

	/* The tensors must cover the buffer exactly, in some order. */
	qsort(st->tensors, st->n_tensors, sizeof(*st->tensors), by_offset);
	uint64_t at = 0;
	for (size_t i = 0; i < st->n_tensors; i++) {
		const struct bd_st_tensor *t = &st->tensors[i];
		if (t->begin < at)
			return fail(err, -EBADMSG, "tensor " NAME_FMT " at bytes [%llu, %llu) "
				    "overlaps the tensor before it (which ends at %llu)", t->name,
				    (unsigned long long)t->begin, (unsigned long long)t->end,
				    (unsigned long long)at);
		if (t->begin > at)
			return fail(err, -EBADMSG, "bytes [%llu, %llu) of the data belong to no "
				    "tensor (a hole before " NAME_FMT ")", (unsigned long long)at,
				    (unsigned long long)t->begin, t->name);
		at = t->end;
	}
	if (at != buf_size)
		return fail(err, -EBADMSG, "bytes [%llu, %zu) of the data belong to no tensor "
			    "(trailing bytes)", (unsigned long long)at, buf_size);

	const char *dup = NULL; /* none: jansson refused duplicate keys */
	r = bd_names_build(&st->t_index, st->tensors, st->n_tensors, sizeof(*st->tensors),
			   offsetof(struct bd_st_tensor, name), &dup);
	if (r < 0)
		return r == -EEXIST ? fail(err, -EBADMSG, "duplicate tensor name " NAME_FMT, dup)
				    : fail(err, -ENOMEM, "out of memory");
	return 0;
}

/* The parser bd_mapfile_parse calls: a handle over img, which it takes over; on failure the
 * handle and img are freed. */
static int open_image(struct bd_mapfile *img, void *ret, char *ret_err)
{
	struct bd_st *st = calloc(1, sizeof(*st));
	if (!st) {
		bd_mapfile_close(img);
		return fail(ret_err, -ENOMEM, "out of memory");
	}
	st->file = *img;
	st->base = img->base;
	st->size = img->size;
	int r = parse(st, ret_err);
	if (r < 0) {
		bd_st_free(st);
		return r;
	}
	*(struct bd_st **)ret = st;
	return 0;
}

int bd_st_open_mem(const void *buf, size_t size, struct bd_st **ret, char *ret_err)
{
	return bd_mapfile_parse(NULL, buf, size, open_image, ret, ret_err, BD_ST_ERR_MAX);
}

int bd_st_open(const char *path, struct bd_st **ret, char *ret_err)
{
	if (!path)
		return fail(ret_err, -EINVAL, "invalid argument");
	return bd_mapfile_parse(path, NULL, 0, open_image, ret, ret_err, BD_ST_ERR_MAX);
}

void bd_st_free(struct bd_st *st)
{
	if (!st)
		return;
	free(st->tensors);
	bd_names_free(&st->t_index);
	free(st->meta);
	json_decref(st->root);
	bd_mapfile_close(&st->file);
	free(st);
}

size_t bd_st_header_len(const struct bd_st *st)
{
	return st ? st->header_len : 0;
}

size_t bd_st_data_offset(const struct bd_st *st)
{
	return st ? st->data_offset : 0;
}

size_t bd_st_file_size(const struct bd_st *st)
{
	return st ? st->size : 0;
}

/* ---- lookups ------------------------------------------------------------------------------- */

size_t bd_st_n_tensors(const struct bd_st *st)
{
	return st ? st->n_tensors : 0;
}

const struct bd_st_tensor *bd_st_tensor_at(const struct bd_st *st, size_t i)
{
	return st && i < st->n_tensors ? &st->tensors[i] : NULL;
}

const struct bd_st_tensor *bd_st_find_tensor(const struct bd_st *st, const char *name)
{
	return st ? bd_names_find(&st->t_index, name) : NULL;
}

size_t bd_st_n_metadata(const struct bd_st *st)
{
	return st ? st->n_meta : 0;
}

int bd_st_metadata_at(const struct bd_st *st, size_t i, const char **ret_key,
		      const char **ret_value)
{
	if (!st || !ret_key || !ret_value || i >= st->n_meta)
		return -EINVAL;
	*ret_key = st->meta[i].key;
	*ret_value = st->meta[i].value;
	return 0;
}

const char *bd_st_metadata_get(const struct bd_st *st, const char *key)
{
	if (!st || !key)
		return NULL;
	for (size_t i = 0; i < st->n_meta; i++)
		if (strcmp(st->meta[i].key, key) == 0)
			return st->meta[i].value;
	return NULL;
}

/* ---- conversion ---------------------------------------------------------------------------- */

static void convert(enum bd_st_dtype dt, const uint8_t *p, size_t n, float *x)
{
	switch (dt) {
	case BD_ST_F32:
		for (size_t i = 0; i < n; i++, p += 4) {
			union {
				uint32_t u;
				float f;
			} v = { .u = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
				     (uint32_t)p[3] << 24 };
			x[i] = v.f;
		}
		break;
	case BD_ST_F16:
		for (size_t i = 0; i < n; i++, p += 2)
			x[i] = bd_f16_to_f32((uint16_t)(p[0] | p[1] << 8));
		break;
	case BD_ST_BF16:
		for (size_t i = 0; i < n; i++, p += 2)
			x[i] = bd_bf16_to_f32((bd_bf16)(p[0] | p[1] << 8));
		break;
	default:
		break;
	}
}

static bool convertible(enum bd_st_dtype dt)
{
	return dt == BD_ST_F32 || dt == BD_ST_F16 || dt == BD_ST_BF16;
}

int bd_st_tensor_to_f32(const struct bd_st_tensor *t, float *ret_x)
{
	if (!t || !ret_x)
		return -EINVAL;
	if (!convertible(t->dtype))
		return -ENOTSUP;
	convert(t->dtype, t->data, (size_t)t->n_elements, ret_x);
	return 0;
}

int bd_st_tensor_rows_f32(const struct bd_st_tensor *t, uint64_t row0, uint64_t n_rows,
			  float *ret_x)
{
	if (!t || !ret_x)
		return -EINVAL;
	if (!convertible(t->dtype))
		return -ENOTSUP;
	uint64_t cols = t->n_dims ? t->shape[t->n_dims - 1] : 1;
	uint64_t rows = cols ? t->n_elements / cols : 0;
	if (row0 > rows || n_rows > rows - row0)
		return -EINVAL;
	if (!n_rows || !cols)
		return 0;
	size_t es = dtypes[t->dtype].size;
	convert(t->dtype, (const uint8_t *)t->data + row0 * cols * es, (size_t)(n_rows * cols),
		ret_x);
	return 0;
}
