/* gguf.c — the GGUF parser, lookups and model hyperparameters (bd_gguf.h).
 *
 * Every read goes through a cursor that checks the remaining bytes first; counts are bounded
 * by what the remaining bytes could hold before anything is allocated for them, so a hostile
 * header cannot make us allocate more than a small multiple of the file's size.
 */
#include <errno.h>
#include <stddef.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/bd_err.h"
#include "base/bd_mapfile.h"
#include "base/bd_names.h"
#include "formats/bd_gguf.h"

#define GGUF_MAGIC "GGUF"
#define GGUF_HEADER_BYTES 24 /* magic, version, n_tensors, n_kv */
#define MAX_ARRAY_DEPTH 4

struct bd_gguf {
	const uint8_t *base;
	size_t size;
	struct bd_mapfile file; /* the mapping of bd_gguf_open (zeroed for a memory image) */
	uint32_t version;
	size_t alignment, data_offset;

	size_t n_kv;
	struct bd_gguf_kv *kvs;
	struct bd_names kv_index; /* by key */

	size_t n_tensors;
	struct bd_gguf_tensor *tensors;
	struct bd_names t_index; /* by name */
	int refs; /* the opener's and bd_gguf_ref()'s, atomically */
};

/* A bounds-checked little-endian reader over the file's bytes. */
struct cursor {
	const uint8_t *p;
	size_t size, off;
	char *err; /* NULL or BD_GGUF_ERR_MAX bytes */
};

#define fail(err, code, ...) bd_errf(err, BD_GGUF_ERR_MAX, code, __VA_ARGS__)

/* n more bytes must be there; what names the item for the message. */
static int need(struct cursor *c, uint64_t n, const char *what)
{
	if (n > c->size - c->off)
		return fail(c->err, -EBADMSG,
			    "truncated: %s at offset %zu needs %llu bytes, %zu left in the file", what,
			    c->off, (unsigned long long)n, c->size - c->off);
	return 0;
}

static uint64_t le(const uint8_t *p, int n)
{
	uint64_t v = 0;
	for (int i = n - 1; i >= 0; i--)
		v = v << 8 | p[i];
	return v;
}

static int rd_u32(struct cursor *c, uint32_t *ret, const char *what)
{
	int r = need(c, 4, what);
	if (r < 0)
		return r;
	*ret = (uint32_t)le(c->p + c->off, 4);
	c->off += 4;
	return 0;
}

static int rd_u64(struct cursor *c, uint64_t *ret, const char *what)
{
	int r = need(c, 8, what);
	if (r < 0)
		return r;
	*ret = le(c->p + c->off, 8);
	c->off += 8;
	return 0;
}

static int rd_str(struct cursor *c, struct bd_gguf_str *ret, const char *what)
{
	uint64_t len;
	size_t at = c->off;
	int r = rd_u64(c, &len, what);

	if (r < 0)
		return r;
	if (len > c->size - c->off)
		return fail(c->err, -EBADMSG,
			    "truncated: %s at offset %zu has length %llu, past the end of the file "
			    "(%zu bytes left)",
			    what, at, (unsigned long long)len, c->size - c->off);
	ret->s = (const char *)c->p + c->off;
	ret->len = (size_t)len;
	c->off += (size_t)len;
	return 0;
}

/* A NUL-terminated copy of a key or tensor name; names with a NUL inside are malformed
 * (two different names would compare equal). */
static int dup_name(struct cursor *c, const struct bd_gguf_str *s, size_t at, const char *what,
		    char **ret)
{
	if (memchr(s->s, 0, s->len))
		return fail(c->err, -EBADMSG, "%s at offset %zu contains a NUL byte", what, at);
	char *d = malloc(s->len + 1);
	if (!d)
		return fail(c->err, -ENOMEM, "out of memory");
	memcpy(d, s->s, s->len);
	d[s->len] = 0;
	*ret = d;
	return 0;
}

/* Bytes of one value of a fixed-size type; 0 for STRING, ARRAY and unknown types. */
static size_t fixed_size(uint32_t t)
{
	switch (t) {
	case BD_GGUF_UINT8:
	case BD_GGUF_INT8:
	case BD_GGUF_BOOL:
		return 1;
	case BD_GGUF_UINT16:
	case BD_GGUF_INT16:
		return 2;
	case BD_GGUF_UINT32:
	case BD_GGUF_INT32:
	case BD_GGUF_FLOAT32:
		return 4;
	case BD_GGUF_UINT64:
	case BD_GGUF_INT64:
	case BD_GGUF_FLOAT64:
		return 8;
	default:
		return 0;
	}
}

const char *bd_gguf_type_name(int type)
{
	static const char *const names[BD_GGUF_TYPE_COUNT] = {
		"UINT8", "INT8",  "UINT16", "INT16",  "UINT32", "INT32",   "FLOAT32",
		"BOOL",  "STRING", "ARRAY", "UINT64", "INT64",  "FLOAT64",
	};
	return type >= 0 && type < BD_GGUF_TYPE_COUNT ? names[type] : "?";
}

/* Parse n values of type t at the cursor. strs: where STRING values go ([n]) or NULL to only
 * validate (inside nested arrays). depth counts enclosing arrays. */
static int parse_values(struct cursor *c, uint32_t t, uint64_t n, struct bd_gguf_str *strs,
			int depth, const char *key)
{
	size_t at = c->off;
	size_t fs = fixed_size(t);
	int r;

	if (fs) {
		if (n > (c->size - c->off) / fs)
			return fail(c->err, -EBADMSG,
				    "truncated: key '%s': %llu values of %s at offset %zu need more "
				    "than the %zu bytes left",
				    key, (unsigned long long)n, bd_gguf_type_name((int)t), at,
				    c->size - c->off);
		if (t == BD_GGUF_BOOL)
			for (uint64_t i = 0; i < n; i++)
				if (c->p[c->off + i] > 1)
					return fail(c->err, -EBADMSG,
						    "key '%s': bool at offset %llu is %u, not 0 or 1",
						    key, (unsigned long long)(c->off + i),
						    c->p[c->off + i]);
		c->off += (size_t)(n * fs);
		return 0;
	}
	if (t == BD_GGUF_STRING) {
		if (n > (c->size - c->off) / 8)
			return fail(c->err, -EBADMSG,
				    "truncated: key '%s': %llu strings at offset %zu cannot fit in the "
				    "%zu bytes left",
				    key, (unsigned long long)n, at, c->size - c->off);
		for (uint64_t i = 0; i < n; i++) {
			struct bd_gguf_str s;
			if ((r = rd_str(c, &s, "string value")) < 0)
				return r;
			if (strs)
				strs[i] = s;
		}
		return 0;
	}
	if (t == BD_GGUF_ARRAY) {
		if (depth >= MAX_ARRAY_DEPTH)
			return fail(c->err, -EBADMSG,
				    "key '%s': arrays nested deeper than %d at offset %zu", key,
				    MAX_ARRAY_DEPTH, at);
		/* each element is at least a u32 type and a u64 count */
		if (n > (c->size - c->off) / 12)
			return fail(c->err, -EBADMSG,
				    "truncated: key '%s': %llu arrays at offset %zu cannot fit in the "
				    "%zu bytes left",
				    key, (unsigned long long)n, at, c->size - c->off);
		for (uint64_t i = 0; i < n; i++) {
			uint32_t et;
			uint64_t en;
			if ((r = rd_u32(c, &et, "array element type")) < 0 ||
			    (r = rd_u64(c, &en, "array length")) < 0)
				return r;
			if (et >= BD_GGUF_TYPE_COUNT)
				return fail(c->err, -EBADMSG,
					    "key '%s': unknown array element type %u at offset %zu",
					    key, et, c->off - 12);
			if ((r = parse_values(c, et, en, NULL, depth + 1, key)) < 0)
				return r;
		}
		return 0;
	}
	return fail(c->err, -EBADMSG, "key '%s': unknown value type %u", key, t);
}

static int parse_kv(struct cursor *c, struct bd_gguf_kv *kv)
{
	struct bd_gguf_str key;
	size_t at = c->off;
	uint32_t t;
	int r;

	if ((r = rd_str(c, &key, "metadata key")) < 0)
		return r;
	if ((r = dup_name(c, &key, at, "metadata key", (char **)&kv->key)) < 0)
		return r;
	if ((r = rd_u32(c, &t, "metadata value type")) < 0)
		return r;
	if (t >= BD_GGUF_TYPE_COUNT)
		return fail(c->err, -EBADMSG, "key '%s': unknown value type %u at offset %zu",
			    kv->key, t, c->off - 4);
	kv->type = (enum bd_gguf_type)t;
	kv->n = 1;
	if (t == BD_GGUF_ARRAY) {
		uint32_t et;
		uint64_t n;
		if ((r = rd_u32(c, &et, "array element type")) < 0 ||
		    (r = rd_u64(c, &n, "array length")) < 0)
			return r;
		if (et >= BD_GGUF_TYPE_COUNT)
			return fail(c->err, -EBADMSG,
				    "key '%s': unknown array element type %u at offset %zu", kv->key,
				    et, c->off - 12);
		kv->arr_type = (enum bd_gguf_type)et;
		kv->n = n;
		kv->data = c->p + c->off;
		if (et == BD_GGUF_STRING) {
			/* bounded by the bytes left before allocating: ≥ 8 bytes per string */
			if (n > (c->size - c->off) / 8)
				return fail(c->err, -EBADMSG,
					    "truncated: key '%s': %llu strings at offset %zu cannot "
					    "fit in the %zu bytes left",
					    kv->key, (unsigned long long)n, c->off, c->size - c->off);
			struct bd_gguf_str *strs = calloc(n ? (size_t)n : 1, sizeof(*strs));
			if (!strs)
				return fail(c->err, -ENOMEM, "out of memory");
			kv->strs = strs;
			return parse_values(c, et, n, strs, 1, kv->key);
		}
		return parse_values(c, et, n, NULL, 1, kv->key);
	}
	kv->data = c->p + c->off;
	if (t == BD_GGUF_STRING) {
		struct bd_gguf_str *s = calloc(1, sizeof(*s));
		if (!s)
			return fail(c->err, -ENOMEM, "out of memory");
		kv->strs = s;
		return rd_str(c, s, "string value");
	}
	return parse_values(c, t, 1, NULL, 0, kv->key);
}

static int parse_tensor_info(struct cursor *c, struct bd_gguf_tensor *t)
{
	struct bd_gguf_str name;
	size_t at = c->off;
	uint32_t n_dims, type;
	int r;

	if ((r = rd_str(c, &name, "tensor name")) < 0)
		return r;
	if ((r = dup_name(c, &name, at, "tensor name", (char **)&t->name)) < 0)
		return r;
	if ((r = rd_u32(c, &n_dims, "tensor n_dims")) < 0)
		return r;
	if (n_dims > BD_GGUF_MAX_DIMS)
		return fail(c->err, -EBADMSG, "tensor '%s' at offset %zu has %u dims (at most %d)",
			    t->name, at, n_dims, BD_GGUF_MAX_DIMS);
	t->n_dims = (int)n_dims;
	uint64_t nel = 1;
	for (int i = 0; i < BD_GGUF_MAX_DIMS; i++) {
		uint64_t ne = 1;
		if ((uint32_t)i < n_dims && (r = rd_u64(c, &ne, "tensor dim")) < 0)
			return r;
		if (ne > (uint64_t)INT64_MAX || (ne && nel > (uint64_t)INT64_MAX / ne))
			return fail(c->err, -EOVERFLOW,
				    "tensor '%s' at offset %zu: dims overflow 63 bits", t->name, at);
		t->ne[i] = ne;
		nel *= ne;
	}
	t->n_elements = nel;
	if ((r = rd_u32(c, &type, "tensor type")) < 0)
		return r;
	size_t blck, tsize;
	if (bd_ggml_type_info((int)type, &blck, &tsize) < 0)
		return fail(c->err, -EBADMSG, "tensor '%s' at offset %zu has unknown type %u",
			    t->name, at, type);
	t->type = (enum bd_ggml_type)type;
	if (t->ne[0] % blck)
		return fail(c->err, -EBADMSG,
			    "tensor '%s': row length %llu is not a multiple of the %s block (%zu)",
			    t->name, (unsigned long long)t->ne[0], bd_ggml_type_name((int)type),
			    blck);
	uint64_t nblocks = nel / blck;
	if (nblocks > (uint64_t)INT64_MAX / tsize)
		return fail(c->err, -EOVERFLOW, "tensor '%s': byte size overflows 63 bits",
			    t->name);
	t->nbytes = (size_t)(nblocks * tsize);
	return rd_u64(c, &t->offset, "tensor offset");
}

struct bd_gguf *bd_gguf_ref(const struct bd_gguf *g)
{
	struct bd_gguf *h = (struct bd_gguf *)g;
	if (h)
		__atomic_add_fetch(&h->refs, 1, __ATOMIC_RELAXED);
	return h;
}

void bd_gguf_free(struct bd_gguf *g)
{
	if (!g || __atomic_sub_fetch(&g->refs, 1, __ATOMIC_ACQ_REL) > 0)
		return;
	if (g->kvs)
		for (size_t i = 0; i < g->n_kv; i++) {
			free((char *)g->kvs[i].key);
			free((struct bd_gguf_str *)g->kvs[i].strs);
		}
	if (g->tensors)
		for (size_t i = 0; i < g->n_tensors; i++)
			free((char *)g->tensors[i].name);
	free(g->kvs);
	bd_names_free(&g->kv_index);
	free(g->tensors);
	bd_names_free(&g->t_index);
	bd_mapfile_close(&g->file);
	free(g);
}

/* The alignment from general.alignment: a UINT32 power of two; default 32. */
static int read_alignment(struct bd_gguf *g, char *err)
{
	const struct bd_gguf_kv *kv = bd_gguf_find_kv(g, "general.alignment");

	g->alignment = BD_GGUF_DEFAULT_ALIGNMENT;
	if (!kv)
		return 0;
	if (kv->type != BD_GGUF_UINT32)
		return fail(err, -EBADMSG, "general.alignment has type %s, not UINT32",
			    bd_gguf_type_name(kv->type));
	uint32_t a = (uint32_t)le(kv->data, 4);
	if (a == 0 || (a & (a - 1)))
		return fail(err, -EBADMSG, "general.alignment %u is not a power of two", a);
	g->alignment = a;
	return 0;
}

static int parse(struct bd_gguf *g, char *err)
{
	struct cursor c = { .p = g->base, .size = g->size, .err = err };
	uint64_t n_tensors, n_kv;
	const char *dup = NULL;
	int r;

	if (g->size >= 4 && memcmp(g->base, GGUF_MAGIC, 4) != 0)
		return fail(err, -ENOEXEC, "not a GGUF file (magic %02x %02x %02x %02x)",
			    g->base[0], g->base[1], g->base[2], g->base[3]);
	if (g->size < GGUF_HEADER_BYTES)
		return fail(err, -EBADMSG, "truncated: %zu bytes, shorter than the %d-byte header",
			    g->size, GGUF_HEADER_BYTES);
	c.off = 4;
	(void)rd_u32(&c, &g->version, "version");
	if (g->version != 2 && g->version != 3) {
		if (g->version == 0x03000000u || g->version == 0x02000000u)
			return fail(err, -EPROTONOSUPPORT,
				    "big-endian GGUF files are not supported");
		return fail(err, -EPROTONOSUPPORT, "unsupported GGUF version %u (need 2 or 3)",
			    g->version);
	}
	(void)rd_u64(&c, &n_tensors, "tensor count");
	(void)rd_u64(&c, &n_kv, "metadata count");

	/* a metadata entry takes ≥ 13 bytes (key length, type, 1-byte value), a tensor info ≥ 24
	 * (name length, n_dims, type, offset): bound both before allocating */
	if (n_kv > (c.size - c.off) / 13)
		return fail(err, -EBADMSG, "truncated: %llu metadata entries cannot fit in %zu bytes",
			    (unsigned long long)n_kv, c.size - c.off);
	if (n_tensors > (c.size - c.off) / 24)
		return fail(err, -EBADMSG, "truncated: %llu tensor infos cannot fit in %zu bytes",
			    (unsigned long long)n_tensors, c.size - c.off);

	g->kvs = calloc(n_kv ? (size_t)n_kv : 1, sizeof(*g->kvs));
	if (!g->kvs)
		return fail(err, -ENOMEM, "out of memory");
	for (size_t i = 0; i < n_kv; i++) {
		g->n_kv = i + 1; /* so bd_gguf_free releases what entry i allocated */
		if ((r = parse_kv(&c, &g->kvs[i])) < 0)
			return r;
	}
	r = bd_names_build(&g->kv_index, g->kvs, g->n_kv, sizeof(*g->kvs),
			   offsetof(struct bd_gguf_kv, key), &dup);
	if (r < 0)
		return r == -EEXIST ? fail(err, -EBADMSG, "duplicate metadata key '%s'", dup)
				    : fail(err, -ENOMEM, "out of memory");
	if ((r = read_alignment(g, err)) < 0)
		return r;

	if (n_tensors > (c.size - c.off) / 24)
		return fail(err, -EBADMSG, "truncated: %llu tensor infos cannot fit in %zu bytes",
			    (unsigned long long)n_tensors, c.size - c.off);
	g->tensors = calloc(n_tensors ? (size_t)n_tensors : 1, sizeof(*g->tensors));
	if (!g->tensors)
		return fail(err, -ENOMEM, "out of memory");
	for (size_t i = 0; i < n_tensors; i++) {
		g->n_tensors = i + 1;
		if ((r = parse_tensor_info(&c, &g->tensors[i])) < 0)
			return r;
	}
	r = bd_names_build(&g->t_index, g->tensors, g->n_tensors, sizeof(*g->tensors),
			   offsetof(struct bd_gguf_tensor, name), &dup);
	if (r < 0)
		return r == -EEXIST ? fail(err, -EBADMSG, "duplicate tensor name '%s'", dup)
				    : fail(err, -ENOMEM, "out of memory");

	/* the data section starts at the next multiple of the alignment */
	size_t pad = (g->alignment - c.off % g->alignment) % g->alignment;
	if (pad > SIZE_MAX - c.off)
		return fail(err, -EOVERFLOW, "data offset overflows");
	g->data_offset = c.off + pad;
	for (size_t i = 0; i < g->n_tensors; i++) {
		struct bd_gguf_tensor *t = &g->tensors[i];
		if (t->offset % g->alignment)
			return fail(err, -EBADMSG,
				    "tensor '%s': offset %llu is not a multiple of the alignment %zu",
				    t->name, (unsigned long long)t->offset, g->alignment);
		if (g->data_offset > g->size || t->offset > g->size - g->data_offset ||
		    t->nbytes > g->size - g->data_offset - t->offset)
			return fail(err, -EBADMSG,
				    "truncated: tensor '%s' (%zu bytes at data offset %llu) ends past "
				    "the end of the file (%zu bytes)",
				    t->name, t->nbytes, (unsigned long long)t->offset, g->size);
		t->data = g->base + g->data_offset + t->offset;
	}
	return 0;
}

/* The parser bd_mapfile_parse calls: a handle over img, which it takes over; on failure the
 * handle and img are freed. */
static int open_image(struct bd_mapfile *img, void *ret, char *ret_err)
{
	struct bd_gguf *g = calloc(1, sizeof(*g));
	if (!g) {
		bd_mapfile_close(img);
		return fail(ret_err, -ENOMEM, "out of memory");
	}
	g->refs = 1;
	g->file = *img;
	g->base = img->base;
	g->size = img->size;
	int r = parse(g, ret_err);
	if (r < 0) {
		bd_gguf_free(g);
		return r;
	}
	*(struct bd_gguf **)ret = g;
	return 0;
}

int bd_gguf_open_mem(const void *buf, size_t size, struct bd_gguf **ret, char *ret_err)
{
	return bd_mapfile_parse(NULL, buf, size, open_image, ret, ret_err, BD_GGUF_ERR_MAX);
}

int bd_gguf_open(const char *path, struct bd_gguf **ret, char *ret_err)
{
	if (!path)
		return fail(ret_err, -EINVAL, "invalid argument");
	return bd_mapfile_parse(path, NULL, 0, open_image, ret, ret_err, BD_GGUF_ERR_MAX);
}

uint32_t bd_gguf_version(const struct bd_gguf *g)
{
	return g ? g->version : 0;
}

size_t bd_gguf_alignment(const struct bd_gguf *g)
{
	return g ? g->alignment : 0;
}

size_t bd_gguf_data_offset(const struct bd_gguf *g)
{
	return g ? g->data_offset : 0;
}

size_t bd_gguf_file_size(const struct bd_gguf *g)
{
	return g ? g->size : 0;
}

/* ---- metadata lookups ------------------------------------------------------------------- */

size_t bd_gguf_n_kv(const struct bd_gguf *g)
{
	return g ? g->n_kv : 0;
}

const struct bd_gguf_kv *bd_gguf_kv_at(const struct bd_gguf *g, size_t i)
{
	return g && i < g->n_kv ? &g->kvs[i] : NULL;
}

const struct bd_gguf_kv *bd_gguf_find_kv(const struct bd_gguf *g, const char *key)
{
	return g ? bd_names_find(&g->kv_index, key) : NULL;
}

static bool is_int_type(enum bd_gguf_type t)
{
	return t <= BD_GGUF_INT32 || t == BD_GGUF_UINT64 || t == BD_GGUF_INT64;
}

/* Integer value of type t at p (little-endian); -ERANGE for a UINT64 above INT64_MAX. */
static int int_at(enum bd_gguf_type t, const uint8_t *p, int64_t *ret)
{
	switch (t) {
	case BD_GGUF_UINT8: *ret = p[0]; break;
	case BD_GGUF_INT8: *ret = (int8_t)p[0]; break;
	case BD_GGUF_UINT16: *ret = (uint16_t)le(p, 2); break;
	case BD_GGUF_INT16: *ret = (int16_t)(uint16_t)le(p, 2); break;
	case BD_GGUF_UINT32: *ret = (uint32_t)le(p, 4); break;
	case BD_GGUF_INT32: *ret = (int32_t)(uint32_t)le(p, 4); break;
	case BD_GGUF_INT64: *ret = (int64_t)le(p, 8); break;
	case BD_GGUF_UINT64: {
		uint64_t u = le(p, 8);
		if (u > (uint64_t)INT64_MAX)
			return -ERANGE;
		*ret = (int64_t)u;
		break;
	}
	default:
		return -EBADMSG;
	}
	return 0;
}

static double float_at(enum bd_gguf_type t, const uint8_t *p)
{
	if (t == BD_GGUF_FLOAT32) {
		uint32_t u = (uint32_t)le(p, 4);
		float f;
		memcpy(&f, &u, sizeof(f));
		return f;
	}
	uint64_t u = le(p, 8);
	double d;
	memcpy(&d, &u, sizeof(d));
	return d;
}

/* Element i of the values of type t at data (strs: their strings) as an integer, a float or
 * a string: 0, -EBADMSG when t is not of that kind, -ERANGE (int_at); *ret is set only on
 * success. */
static int int_elem(enum bd_gguf_type t, const void *data, uint64_t i, int64_t *ret)
{
	if (!is_int_type(t))
		return -EBADMSG;
	return int_at(t, (const uint8_t *)data + i * fixed_size(t), ret);
}

static int float_elem(enum bd_gguf_type t, const void *data, uint64_t i, double *ret)
{
	if (t != BD_GGUF_FLOAT32 && t != BD_GGUF_FLOAT64)
		return -EBADMSG;
	*ret = float_at(t, (const uint8_t *)data + i * fixed_size(t));
	return 0;
}

static int str_elem(enum bd_gguf_type t, const struct bd_gguf_str *strs, uint64_t i,
		    struct bd_gguf_str *ret)
{
	if (t != BD_GGUF_STRING)
		return -EBADMSG;
	*ret = strs[i];
	return 0;
}

/* The entry for key as a scalar: -EINVAL (also for a NULL ret), -ENOENT, or 0. */
static int scalar(const struct bd_gguf *g, const char *key, const void *ret,
		  const struct bd_gguf_kv **ret_kv)
{
	if (!g || !key || !ret)
		return -EINVAL;
	*ret_kv = bd_gguf_find_kv(g, key);
	return *ret_kv ? 0 : -ENOENT;
}

int bd_gguf_get_int(const struct bd_gguf *g, const char *key, int64_t *ret)
{
	const struct bd_gguf_kv *kv;
	int r = scalar(g, key, ret, &kv);
	return r < 0 ? r : int_elem(kv->type, kv->data, 0, ret);
}

int bd_gguf_get_float(const struct bd_gguf *g, const char *key, double *ret)
{
	const struct bd_gguf_kv *kv;
	int r = scalar(g, key, ret, &kv);
	return r < 0 ? r : float_elem(kv->type, kv->data, 0, ret);
}

int bd_gguf_get_bool(const struct bd_gguf *g, const char *key, bool *ret)
{
	const struct bd_gguf_kv *kv;
	int r = scalar(g, key, ret, &kv);
	if (r < 0)
		return r;
	if (kv->type != BD_GGUF_BOOL)
		return -EBADMSG;
	*ret = *(const uint8_t *)kv->data != 0;
	return 0;
}

int bd_gguf_get_str(const struct bd_gguf *g, const char *key, struct bd_gguf_str *ret)
{
	const struct bd_gguf_kv *kv;
	int r = scalar(g, key, ret, &kv);
	return r < 0 ? r : str_elem(kv->type, kv->strs, 0, ret);
}

/* Element i of kv's array: -EINVAL (not an array, i out of range, NULL), or 0. */
static int arr_check(const struct bd_gguf_kv *kv, uint64_t i, const void *ret)
{
	if (!kv || !ret || kv->type != BD_GGUF_ARRAY || i >= kv->n)
		return -EINVAL;
	return 0;
}

int bd_gguf_arr_int(const struct bd_gguf_kv *kv, uint64_t i, int64_t *ret)
{
	int r = arr_check(kv, i, ret);
	return r < 0 ? r : int_elem(kv->arr_type, kv->data, i, ret);
}

int bd_gguf_arr_float(const struct bd_gguf_kv *kv, uint64_t i, double *ret)
{
	int r = arr_check(kv, i, ret);
	return r < 0 ? r : float_elem(kv->arr_type, kv->data, i, ret);
}

int bd_gguf_arr_str(const struct bd_gguf_kv *kv, uint64_t i, struct bd_gguf_str *ret)
{
	int r = arr_check(kv, i, ret);
	return r < 0 ? r : str_elem(kv->arr_type, kv->strs, i, ret);
}

/* ---- tensors ------------------------------------------------------------------------------ */

size_t bd_gguf_n_tensors(const struct bd_gguf *g)
{
	return g ? g->n_tensors : 0;
}

const struct bd_gguf_tensor *bd_gguf_tensor_at(const struct bd_gguf *g, size_t i)
{
	return g && i < g->n_tensors ? &g->tensors[i] : NULL;
}

const struct bd_gguf_tensor *bd_gguf_find_tensor(const struct bd_gguf *g, const char *name)
{
	return g ? bd_names_find(&g->t_index, name) : NULL;
}

int bd_gguf_tensor_rows_f32(const struct bd_gguf_tensor *t, uint64_t row0, uint64_t n_rows,
			    float *ret_x)
{
	if (!t || !ret_x)
		return -EINVAL;
	if (!bd_ggml_can_dequantize(t->type))
		return -ENOTSUP;
	uint64_t cols = t->ne[0];
	uint64_t rows = cols ? t->n_elements / cols : 0;
	if (row0 > rows || n_rows > rows - row0)
		return -EINVAL;
	if (!n_rows || !cols)
		return 0;
	size_t blck, tsize;
	(void)bd_ggml_type_info(t->type, &blck, &tsize);
	size_t row_bytes = (size_t)(cols / blck * tsize);
	return bd_ggml_dequantize(t->type, (const uint8_t *)t->data + row0 * row_bytes,
				  (size_t)(n_rows * cols), ret_x);
}

int bd_gguf_tensor_to_f32(const struct bd_gguf_tensor *t, float *ret_x)
{
	if (!t || !ret_x)
		return -EINVAL;
	uint64_t rows = t->ne[0] ? t->n_elements / t->ne[0] : 0;
	return bd_gguf_tensor_rows_f32(t, 0, rows, ret_x);
}

/* ---- model hyperparameters ---------------------------------------------------------------- */

#define HP_MAX (1 << 24) /* sanity bound on every size: later code multiplies them */

/* "<arch>.<suffix>" as an int in [1, HP_MAX]; def < 0 means required. */
static int hp_int(const struct bd_gguf *g, const char *arch, const char *suffix, int def,
		  int *ret, char *err)
{
	char key[128];
	int64_t v;

	snprintf(key, sizeof(key), "%s.%s", arch, suffix);
	int r = bd_gguf_get_int(g, key, &v);
	if (r == -ENOENT && def >= 0) {
		*ret = def;
		return 0;
	}
	if (r == -ENOENT)
		return fail(err, -EBADMSG, "metadata key %s is missing", key);
	if (r < 0) {
		const struct bd_gguf_kv *kv = bd_gguf_find_kv(g, key);
		return fail(err, -EBADMSG, "metadata key %s has type %s, not an integer", key,
			    bd_gguf_type_name(kv ? (int)kv->type : -1));
	}
	if (v < 1 || v > HP_MAX)
		return fail(err, -EBADMSG, "metadata key %s = %lld is out of range", key,
			    (long long)v);
	*ret = (int)v;
	return 0;
}

/* "<arch>.<suffix>" as a finite float > 0; def < 0 means required. */
static int hp_float(const struct bd_gguf *g, const char *arch, const char *suffix, double def,
		    float *ret, char *err)
{
	char key[128];
	double v;

	snprintf(key, sizeof(key), "%s.%s", arch, suffix);
	int r = bd_gguf_get_float(g, key, &v);
	if (r == -ENOENT && def > 0) {
		*ret = (float)def;
		return 0;
	}
	if (r == -ENOENT)
		return fail(err, -EBADMSG, "metadata key %s is missing", key);
	if (r < 0)
		return fail(err, -EBADMSG, "metadata key %s is not a float", key);
	if (!isfinite(v) || !(v > 0) || !isfinite((float)v) || !((float)v > 0))
		return fail(err, -EBADMSG, "metadata key %s = %g is out of range", key, v);
	*ret = (float)v;
	return 0;
}

int bd_gguf_model_hparams(const struct bd_gguf *g, struct bd_model_hparams *ret, char *ret_err)
{
	static const struct {
		const char *name;
		enum bd_arch arch;
		enum bd_rope_style rope;
	} archs[] = {
		{ "llama", BD_ARCH_LLAMA, BD_ROPE_NORM },
		{ "qwen2", BD_ARCH_QWEN2, BD_ROPE_NEOX },
		{ "qwen3", BD_ARCH_QWEN3, BD_ROPE_NEOX },
	};
	struct bd_model_hparams hp = { 0 };
	struct bd_gguf_str an;
	int r;

	if (ret_err)
		ret_err[0] = 0;
	if (!g || !ret)
		return fail(ret_err, -EINVAL, "invalid argument");
	r = bd_gguf_get_str(g, "general.architecture", &an);
	if (r < 0)
		return fail(ret_err, -EBADMSG, "general.architecture is %s",
			    r == -ENOENT ? "missing" : "not a string");
	size_t ai;
	for (ai = 0; ai < sizeof(archs) / sizeof(archs[0]); ai++)
		if (an.len == strlen(archs[ai].name) && !memcmp(an.s, archs[ai].name, an.len))
			break;
	if (ai == sizeof(archs) / sizeof(archs[0]))
		return fail(ret_err, -ENOTSUP, "architecture '%.*s' is not supported (llama, "
			    "qwen2, qwen3)", (int)(an.len > 32 ? 32 : an.len), an.s);
	const char *a = archs[ai].name;
	hp.arch = archs[ai].arch;
	hp.rope_style = archs[ai].rope;
	snprintf(hp.arch_name, sizeof(hp.arch_name), "%s", a);

	if ((r = hp_int(g, a, "block_count", -1, &hp.n_layers, ret_err)) < 0 ||
	    (r = hp_int(g, a, "embedding_length", -1, &hp.n_embd, ret_err)) < 0 ||
	    (r = hp_int(g, a, "feed_forward_length", -1, &hp.n_ff, ret_err)) < 0 ||
	    (r = hp_int(g, a, "attention.head_count", -1, &hp.n_heads, ret_err)) < 0 ||
	    (r = hp_int(g, a, "attention.head_count_kv", hp.n_heads, &hp.n_kv_heads,
			ret_err)) < 0 ||
	    (r = hp_int(g, a, "context_length", -1, &hp.n_ctx_train, ret_err)) < 0)
		return r;
	if (hp.n_heads % hp.n_kv_heads)
		return fail(ret_err, -EBADMSG, "%d query heads are not a multiple of %d KV heads",
			    hp.n_heads, hp.n_kv_heads);
	int def_hd = hp.n_embd / hp.n_heads;
	if ((r = hp_int(g, a, "attention.key_length", def_hd, &hp.head_dim, ret_err)) < 0 ||
	    (r = hp_int(g, a, "attention.value_length", hp.head_dim, &hp.head_dim_v,
			ret_err)) < 0 ||
	    (r = hp_int(g, a, "rope.dimension_count", hp.head_dim, &hp.n_rot, ret_err)) < 0)
		return r;
	if (hp.head_dim < 2 || hp.head_dim % 2 || hp.n_rot % 2 || hp.n_rot > hp.head_dim)
		return fail(ret_err, -EBADMSG, "head dim %d / rotated dims %d are not even and "
			    "nested", hp.head_dim, hp.n_rot);
	if ((r = hp_float(g, a, "rope.freq_base", 10000.0, &hp.rope_base, ret_err)) < 0 ||
	    (r = hp_float(g, a, "attention.layer_norm_rms_epsilon", -1, &hp.norm_eps,
			  ret_err)) < 0)
		return r;

	const struct bd_gguf_tensor *emb = bd_gguf_find_tensor(g, "token_embd.weight");
	if (!emb)
		return fail(ret_err, -EBADMSG, "tensor token_embd.weight is missing");
	if (emb->n_dims != 2 || emb->ne[0] != (uint64_t)hp.n_embd || emb->ne[1] > HP_MAX)
		return fail(ret_err, -EBADMSG, "token_embd.weight has shape [%llu, %llu], want "
			    "[%d, vocab]", (unsigned long long)emb->ne[0],
			    (unsigned long long)emb->ne[1], hp.n_embd);
	const struct bd_gguf_kv *toks = bd_gguf_find_kv(g, "tokenizer.ggml.tokens");
	int def_vocab = (int)emb->ne[1];
	if (toks && toks->type == BD_GGUF_ARRAY && toks->n <= HP_MAX)
		def_vocab = (int)toks->n;
	if ((r = hp_int(g, a, "vocab_size", def_vocab, &hp.n_vocab, ret_err)) < 0)
		return r;
	if (emb->ne[1] < (uint64_t)hp.n_vocab)
		return fail(ret_err, -EBADMSG, "token_embd.weight has %llu rows for %d tokens",
			    (unsigned long long)emb->ne[1], hp.n_vocab);

	hp.qk_norm = hp.arch == BD_ARCH_QWEN3 || bd_gguf_find_tensor(g, "blk.0.attn_q_norm.weight");
	hp.attn_bias = bd_gguf_find_tensor(g, "blk.0.attn_q.bias") != NULL;
	hp.tied_embeddings = bd_gguf_find_tensor(g, "output.weight") == NULL;
	*ret = hp;
	return 0;
}
