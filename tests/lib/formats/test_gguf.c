/* test_gguf.c — bd_gguf.h and bd_ggml_quants.h: the GGUF parser, its lookups, the model
 * hyperparameters and the dequantizers. Suite "gguf".
 *
 * The parser is fed small GGUF images this file builds byte by byte (valid ones, then each kind
 * of corruption, through both the in-memory and the mmap path, in exactly-sized buffers so that
 * ASan sees any read past the end). Dequantization is checked bit for bit against
 * tests/data/gguf/quants.json, written by tests/data/gguf/gen_golden.py with gguf-py's numpy dequantizers,
 * and against blocks worked out by hand below. The embedded model (models/, `make model`) is
 * checked against tests/data/gguf/smollm2.json, gguf-py's reading of the same file.
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <criterion/criterion.h>
#include <jansson.h>

#include "formats/bd_gguf.h"
#include "gguf_writer.h"
#include "model_data.h"

/* ---- a GGUF image builder -------------------------------------------------------------- */

struct img {
	struct gguf_w w; /* the bytes */
	/* byte offsets of the fields the corruption tests patch */
	size_t version, n_tensors, n_kv;
	size_t key0_len;   /* length of the first key */
	size_t arch_len;   /* length of general.architecture's value */
	size_t align_val;  /* general.alignment's value */
	size_t u8_type;    /* value type of test.u8 */
	size_t i8_key;     /* bytes of the key "test.i8" */
	size_t bool_val;   /* test.bool's byte */
	size_t arr_i32_n;  /* count of test.arr_i32 */
	size_t arr_str_n;  /* count of test.arr_str */
	size_t arr_f32_type; /* element type of test.arr_f32 */
	size_t t_name[3], t_ndims[3], t_ne[3], t_type[3], t_off[3];
	size_t data;       /* start of the data section */
};

struct build_opts {
	uint32_t version; /* 0: 3 */
	bool no_align;    /* leave general.alignment out (default 32 applies) */
	int nest;         /* levels of the nested-array entry; 0: 2 */
};

static void patch_le(struct img *m, size_t off, uint64_t v, int bytes)
{
	cr_assert_leq(off + (size_t)bytes, m->w.n);
	for (int i = 0; i < bytes; i++)
		m->w.p[off + i] = (uint8_t)(v >> (8 * i));
}

static uint32_t f32_bits(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	return u;
}

static uint64_t f64_bits(double d)
{
	uint64_t u;
	memcpy(&u, &d, 8);
	return u;
}

/* An array whose elements are arrays, `levels` deep in all, the innermost holding u8 {7, 8}. */
static void put_nested(struct img *m, int levels)
{
	if (levels == 1) {
		gw_u32(&m->w, BD_GGUF_UINT8);
		gw_u64(&m->w, 2);
		gw_le(&m->w, 7, 1);
		gw_le(&m->w, 8, 1);
		return;
	}
	gw_u32(&m->w, BD_GGUF_ARRAY);
	gw_u64(&m->w, 2);
	put_nested(m, levels - 1);
	put_nested(m, levels - 1);
}

#define T_A_VALUES 8
#define T_B_ROWS 2

/* The valid test image: 18 metadata entries (one of every type) and three tensors:
 *   "a" F32 [4, 2] at 0, values −1 + 0.5 i
 *   "b" Q8_0 [32, 2] at 64: block 0 d = 0.5, q_j = j − 16; block 1 d = −2, q_j = 127 − 8j
 *   "c" F16 [3] at 192: 1, −2^-24 (a subnormal), 65504 (the largest half)
 * The file ends where "c" ends. */
static struct img build(const struct build_opts *o)
{
	struct img m = { 0 };
	int nest = o && o->nest ? o->nest : 2;

	gw_put(&m.w, "GGUF", 4);
	m.version = m.w.n;
	gw_u32(&m.w, o && o->version ? o->version : 3);
	m.n_tensors = m.w.n;
	gw_u64(&m.w, 3);
	m.n_kv = m.w.n;
	gw_u64(&m.w, o && o->no_align ? 17 : 18);

	m.key0_len = m.w.n;
	gw_key(&m.w, "general.architecture", BD_GGUF_STRING);
	m.arch_len = m.w.n;
	gw_cstr(&m.w, "llama");
	if (!(o && o->no_align)) {
		gw_key(&m.w, "general.alignment", BD_GGUF_UINT32);
		m.align_val = m.w.n;
		gw_u32(&m.w, 64);
	}
	gw_cstr(&m.w, "test.u8");
	m.u8_type = m.w.n;
	gw_u32(&m.w, BD_GGUF_UINT8);
	gw_le(&m.w, 200, 1);
	m.i8_key = m.w.n + 8;
	gw_key(&m.w, "test.i8", BD_GGUF_INT8);
	gw_le(&m.w, (uint8_t)-100, 1);
	gw_key(&m.w, "test.u16", BD_GGUF_UINT16);
	gw_le(&m.w, 60000, 2);
	gw_key(&m.w, "test.i16", BD_GGUF_INT16);
	gw_le(&m.w, (uint16_t)-30000, 2);
	gw_key(&m.w, "test.u32", BD_GGUF_UINT32);
	gw_u32(&m.w, 4000000000u);
	gw_key(&m.w, "test.i32", BD_GGUF_INT32);
	gw_u32(&m.w, (uint32_t)-2000000000);
	gw_key(&m.w, "test.f32", BD_GGUF_FLOAT32);
	gw_u32(&m.w, f32_bits(0.1f));
	gw_key(&m.w, "test.bool", BD_GGUF_BOOL);
	m.bool_val = m.w.n;
	gw_le(&m.w, 1, 1);
	gw_key(&m.w, "test.u64", BD_GGUF_UINT64);
	gw_u64(&m.w, (1ull << 63) + 5);
	gw_key(&m.w, "test.i64", BD_GGUF_INT64);
	gw_u64(&m.w, (uint64_t)-(1ll << 40));
	gw_key(&m.w, "test.f64", BD_GGUF_FLOAT64);
	gw_u64(&m.w, f64_bits(-1.5e300));
	gw_key(&m.w, "test.arr_i32", BD_GGUF_ARRAY);
	gw_u32(&m.w, BD_GGUF_INT32);
	m.arr_i32_n = m.w.n;
	gw_u64(&m.w, 3);
	gw_u32(&m.w, 1);
	gw_u32(&m.w, (uint32_t)-2);
	gw_u32(&m.w, 3);
	gw_key(&m.w, "test.arr_str", BD_GGUF_ARRAY);
	gw_u32(&m.w, BD_GGUF_STRING);
	m.arr_str_n = m.w.n;
	gw_u64(&m.w, 3);
	gw_cstr(&m.w, "a");
	gw_cstr(&m.w, "");
	gw_cstr(&m.w, "h\xc3\xa9llo");
	gw_key(&m.w, "test.arr_f32", BD_GGUF_ARRAY);
	m.arr_f32_type = m.w.n;
	gw_u32(&m.w, BD_GGUF_FLOAT32);
	gw_u64(&m.w, 2);
	gw_u32(&m.w, f32_bits(0.25f));
	gw_u32(&m.w, f32_bits(-8.0f));
	gw_key(&m.w, "test.empty", BD_GGUF_ARRAY);
	gw_u32(&m.w, BD_GGUF_UINT8);
	gw_u64(&m.w, 0);
	gw_key(&m.w, "test.nested", BD_GGUF_ARRAY);
	put_nested(&m, nest);

	static const char *const names[3] = { "a", "b", "c" };
	static const uint32_t types[3] = { BD_GGML_F32, BD_GGML_Q8_0, BD_GGML_F16 };
	static const uint64_t ne[3][2] = { { 4, 2 }, { 32, 2 }, { 3, 0 } };
	static const uint64_t offs[3] = { 0, 64, 192 };
	for (int t = 0; t < 3; t++) {
		m.t_name[t] = m.w.n;
		gw_cstr(&m.w, names[t]);
		m.t_ndims[t] = m.w.n;
		int nd = ne[t][1] ? 2 : 1;
		gw_u32(&m.w, (uint32_t)nd);
		m.t_ne[t] = m.w.n;
		for (int i = 0; i < nd; i++)
			gw_u64(&m.w, ne[t][i]);
		m.t_type[t] = m.w.n;
		gw_u32(&m.w, types[t]);
		m.t_off[t] = m.w.n;
		gw_u64(&m.w, offs[t]);
	}
	size_t align = o && o->no_align ? 32 : 64;
	while (m.w.n % align)
		gw_le(&m.w, 0, 1);
	m.data = m.w.n;
	for (int i = 0; i < T_A_VALUES; i++)
		gw_u32(&m.w, f32_bits(-1.0f + 0.5f * (float)i));
	while (m.w.n < m.data + 64)
		gw_le(&m.w, 0, 1);
	gw_le(&m.w, 0x3800, 2); /* 0.5 */
	for (int j = 0; j < 32; j++)
		gw_le(&m.w, (uint8_t)(j - 16), 1);
	gw_le(&m.w, 0xc000, 2); /* -2 */
	for (int j = 0; j < 32; j++)
		gw_le(&m.w, (uint8_t)(127 - 8 * j), 1);
	while (m.w.n < m.data + 192)
		gw_le(&m.w, 0, 1);
	gw_le(&m.w, 0x3c00, 2);
	gw_le(&m.w, 0x8001, 2);
	gw_le(&m.w, 0x7bff, 2);
	return m;
}

/* ---- opening helpers ------------------------------------------------------------------- */

static char *write_tmp(const void *p, size_t n)
{
	char *path = strdup("/tmp/bd_gguf_test_XXXXXX");
	int fd = mkstemp(path);
	cr_assert_geq(fd, 0);
	cr_assert_eq(write(fd, p, n), (ssize_t)n);
	close(fd);
	return path;
}

/* Parse p[n] from an exactly-sized heap copy (ASan catches any read past it). On success the
 * copy must outlive the handle: close_exact() frees both. */
static void *last_copy;

static int open_exact(const void *p, size_t n, struct bd_gguf **ret, char *err)
{
	void *copy = malloc(n ? n : 1);
	cr_assert_not_null(copy);
	memcpy(copy, p, n);
	int r = bd_gguf_open_mem(copy, n, ret, err);
	if (r < 0)
		free(copy);
	else
		last_copy = copy;
	return r;
}

static void close_exact(struct bd_gguf *g)
{
	bd_gguf_free(g);
	free(last_copy);
	last_copy = NULL;
}

/* The image build(o) makes, parsed through open_exact() and asserted valid; the built bytes
 * are freed (the handle reads open_exact's copy, which close_exact() frees). ret_data: NULL, or
 * the data section offset build() recorded. */
static struct bd_gguf *open_built(const struct build_opts *o, size_t *ret_data)
{
	struct img m = build(o);
	struct bd_gguf *g = NULL;
	char err[BD_GGUF_ERR_MAX];

	cr_assert_eq(open_exact(m.w.p, m.w.n, &g, err), 0, "%s", err);
	if (ret_data)
		*ret_data = m.data;
	free(m.w.p);
	return g;
}

/* Both paths must refuse p[n] with code, say something containing what, and leave *ret alone. */
static void expect_err(const void *p, size_t n, int code, const char *what)
{
	static struct bd_gguf *const sentinel = (struct bd_gguf *)&sentinel;
	struct bd_gguf *g = sentinel;
	char err[BD_GGUF_ERR_MAX];

	memset(err, 0, sizeof(err));
	int r = open_exact(p, n, &g, err);
	cr_assert_eq(r, code, "open_mem of %zu bytes: got %d (%s), want %d", n, r, err, code);
	cr_assert_eq(g, sentinel, "ret written on error");
	cr_assert(strstr(err, what), "message '%s' lacks '%s'", err, what);

	char *path = write_tmp(p, n);
	memset(err, 0, sizeof(err));
	r = bd_gguf_open(path, &g, err);
	cr_assert_eq(r, code, "open of %zu bytes: got %d (%s), want %d", n, r, err, code);
	cr_assert_eq(g, sentinel);
	cr_assert(strstr(err, what), "message '%s' lacks '%s'", err, what);
	cr_assert(strstr(err, path), "message '%s' does not name the file", err);
	unlink(path);
	free(path);
}

/* ---- valid images ------------------------------------------------------------------------ */

Test(gguf, valid_header_and_lookups)
{
	struct img m = build(NULL);
	struct bd_gguf *g = NULL;
	char err[BD_GGUF_ERR_MAX] = "junk";
	void *copy = malloc(m.w.n);
	memcpy(copy, m.w.p, m.w.n);

	cr_assert_eq(bd_gguf_open_mem(copy, m.w.n, &g, err), 0, "%s", err);
	cr_assert_str_empty(err);
	cr_assert_eq(bd_gguf_version(g), 3);
	cr_assert_eq(bd_gguf_alignment(g), 64);
	cr_assert_eq(bd_gguf_data_offset(g), m.data);
	cr_assert_eq(bd_gguf_data_offset(g) % 64, 0);
	cr_assert_eq(bd_gguf_file_size(g), m.w.n);
	cr_assert_eq(bd_gguf_n_kv(g), 18);
	cr_assert_eq(bd_gguf_n_tensors(g), 3);
	cr_assert_str_eq(bd_gguf_kv_at(g, 0)->key, "general.architecture");
	cr_assert_str_eq(bd_gguf_kv_at(g, 17)->key, "test.nested");
	cr_assert_null(bd_gguf_kv_at(g, 18));

	int64_t i;
	cr_assert_eq(bd_gguf_get_int(g, "test.u8", &i), 0);
	cr_assert_eq(i, 200);
	cr_assert_eq(bd_gguf_get_int(g, "test.i8", &i), 0);
	cr_assert_eq(i, -100);
	cr_assert_eq(bd_gguf_get_int(g, "test.u16", &i), 0);
	cr_assert_eq(i, 60000);
	cr_assert_eq(bd_gguf_get_int(g, "test.i16", &i), 0);
	cr_assert_eq(i, -30000);
	cr_assert_eq(bd_gguf_get_int(g, "test.u32", &i), 0);
	cr_assert_eq(i, 4000000000ll);
	cr_assert_eq(bd_gguf_get_int(g, "test.i32", &i), 0);
	cr_assert_eq(i, -2000000000ll);
	cr_assert_eq(bd_gguf_get_int(g, "test.i64", &i), 0);
	cr_assert_eq(i, -(1ll << 40));
	cr_assert_eq(bd_gguf_get_int(g, "general.alignment", &i), 0);
	cr_assert_eq(i, 64);
	/* 2^63 + 5 does not fit: -ERANGE and i untouched */
	i = 42;
	cr_assert_eq(bd_gguf_get_int(g, "test.u64", &i), -ERANGE);
	cr_assert_eq(i, 42);
	cr_assert_eq(bd_gguf_get_int(g, "test.f32", &i), -EBADMSG);
	cr_assert_eq(bd_gguf_get_int(g, "no.such.key", &i), -ENOENT);
	cr_assert_eq(i, 42);
	cr_assert_eq(bd_gguf_get_int(NULL, "test.u8", &i), -EINVAL);
	cr_assert_eq(bd_gguf_get_int(g, "test.u8", NULL), -EINVAL);

	double d = 7;
	cr_assert_eq(bd_gguf_get_float(g, "test.f32", &d), 0);
	cr_assert_eq(d, (double)0.1f); /* widened exactly, not 0.1 */
	cr_assert_eq(bd_gguf_get_float(g, "test.f64", &d), 0);
	cr_assert_eq(d, -1.5e300);
	d = 7;
	cr_assert_eq(bd_gguf_get_float(g, "test.i32", &d), -EBADMSG);
	cr_assert_eq(d, 7);

	bool b = false;
	cr_assert_eq(bd_gguf_get_bool(g, "test.bool", &b), 0);
	cr_assert(b);
	cr_assert_eq(bd_gguf_get_bool(g, "test.u8", &b), -EBADMSG);

	struct bd_gguf_str s = { 0 };
	cr_assert_eq(bd_gguf_get_str(g, "general.architecture", &s), 0);
	cr_assert_eq(s.len, 5);
	cr_assert_eq(memcmp(s.s, "llama", 5), 0);
	/* the string points into the image, right after its length */
	cr_assert_eq((const uint8_t *)s.s, (const uint8_t *)copy + m.arch_len + 8);
	cr_assert_eq(bd_gguf_get_str(g, "test.arr_str", &s), -EBADMSG);

	const struct bd_gguf_kv *kv = bd_gguf_find_kv(g, "test.arr_i32");
	cr_assert_not_null(kv);
	cr_assert_eq(kv->type, BD_GGUF_ARRAY);
	cr_assert_eq(kv->arr_type, BD_GGUF_INT32);
	cr_assert_eq(kv->n, 3);
	int64_t want_i32[3] = { 1, -2, 3 };
	for (uint64_t k = 0; k < 3; k++) {
		cr_assert_eq(bd_gguf_arr_int(kv, k, &i), 0);
		cr_assert_eq(i, want_i32[k]);
	}
	i = 42;
	cr_assert_eq(bd_gguf_arr_int(kv, 3, &i), -EINVAL);
	cr_assert_eq(bd_gguf_arr_float(kv, 0, &d), -EBADMSG);
	cr_assert_eq(i, 42);
	/* a scalar is not an array */
	cr_assert_eq(bd_gguf_arr_int(bd_gguf_find_kv(g, "test.u8"), 0, &i), -EINVAL);

	kv = bd_gguf_find_kv(g, "test.arr_str");
	cr_assert_eq(kv->arr_type, BD_GGUF_STRING);
	cr_assert_eq(kv->n, 3);
	cr_assert_eq(bd_gguf_arr_str(kv, 0, &s), 0);
	cr_assert(s.len == 1 && s.s[0] == 'a');
	cr_assert_eq(bd_gguf_arr_str(kv, 1, &s), 0);
	cr_assert_eq(s.len, 0);
	cr_assert_eq(bd_gguf_arr_str(kv, 2, &s), 0);
	cr_assert(s.len == 6 && !memcmp(s.s, "h\xc3\xa9llo", 6));
	cr_assert_eq(bd_gguf_arr_int(kv, 0, &i), -EBADMSG);

	kv = bd_gguf_find_kv(g, "test.arr_f32");
	cr_assert_eq(bd_gguf_arr_float(kv, 1, &d), 0);
	cr_assert_eq(d, -8.0);
	kv = bd_gguf_find_kv(g, "test.empty");
	cr_assert(kv && kv->n == 0 && kv->arr_type == BD_GGUF_UINT8);
	cr_assert_eq(bd_gguf_arr_int(kv, 0, &i), -EINVAL);
	kv = bd_gguf_find_kv(g, "test.nested");
	cr_assert(kv && kv->type == BD_GGUF_ARRAY && kv->arr_type == BD_GGUF_ARRAY && kv->n == 2);
	cr_assert_eq(bd_gguf_arr_int(kv, 0, &i), -EBADMSG);

	cr_assert_null(bd_gguf_find_kv(g, "test"));
	cr_assert_null(bd_gguf_find_kv(g, NULL));
	cr_assert_str_eq(bd_gguf_type_name(BD_GGUF_FLOAT64), "FLOAT64");
	cr_assert_str_eq(bd_gguf_type_name(13), "?");
	bd_gguf_free(g);
	free(copy);
	free(m.w.p);
}

Test(gguf, valid_tensors)
{
	struct img m = build(NULL);
	struct bd_gguf *g = NULL;
	char err[BD_GGUF_ERR_MAX];
	char *path = write_tmp(m.w.p, m.w.n);

	cr_assert_eq(bd_gguf_open(path, &g, err), 0, "%s", err);
	cr_assert_eq(bd_gguf_n_tensors(g), 3);

	const struct bd_gguf_tensor *a = bd_gguf_find_tensor(g, "a");
	cr_assert_not_null(a);
	cr_assert_eq(a, bd_gguf_tensor_at(g, 0));
	cr_assert_eq(a->type, BD_GGML_F32);
	cr_assert_eq(a->n_dims, 2);
	cr_assert(a->ne[0] == 4 && a->ne[1] == 2 && a->ne[2] == 1 && a->ne[3] == 1);
	cr_assert_eq(a->n_elements, 8);
	cr_assert_eq(a->nbytes, 32);
	/* mmap is page aligned, so the data is aligned as the file says */
	cr_assert_eq((uintptr_t)a->data % 64, 0);
	float x[64];
	cr_assert_eq(bd_gguf_tensor_to_f32(a, x), 0);
	for (int k = 0; k < T_A_VALUES; k++)
		cr_assert_eq(x[k], -1.0f + 0.5f * (float)k);

	const struct bd_gguf_tensor *bq = bd_gguf_find_tensor(g, "b");
	cr_assert_eq(bq->type, BD_GGML_Q8_0);
	cr_assert_eq(bq->nbytes, 2 * 34);
	cr_assert_eq(bq->offset, 64);
	cr_assert_eq((const uint8_t *)bq->data - (const uint8_t *)a->data, 64);
	cr_assert_eq(bd_gguf_tensor_to_f32(bq, x), 0);
	for (int j = 0; j < 32; j++) {
		cr_assert_eq(x[j], 0.5f * (float)(j - 16));          /* d = 0.5 */
		cr_assert_eq(x[32 + j], -2.0f * (float)(127 - 8 * j)); /* d = -2 */
	}
	/* row 1 alone is the second block */
	float row[32];
	cr_assert_eq(bd_gguf_tensor_rows_f32(bq, 1, 1, row), 0);
	cr_assert_eq(row[0], -254.0f);
	cr_assert_eq(row[31], -2.0f * (127 - 248));
	row[0] = 99;
	cr_assert_eq(bd_gguf_tensor_rows_f32(bq, 1, 2, row), -EINVAL);
	cr_assert_eq(bd_gguf_tensor_rows_f32(bq, 3, 0, row), -EINVAL);
	cr_assert_eq(row[0], 99);

	const struct bd_gguf_tensor *c = bd_gguf_find_tensor(g, "c");
	cr_assert_eq(c->n_dims, 1);
	cr_assert_eq(c->ne[0], 3);
	cr_assert_eq(bd_gguf_tensor_to_f32(c, x), 0);
	cr_assert_eq(x[0], 1.0f);
	cr_assert_eq(x[1], -ldexpf(1.0f, -24));
	cr_assert_eq(x[2], 65504.0f);
	cr_assert_null(bd_gguf_find_tensor(g, "d"));
	cr_assert_null(bd_gguf_find_tensor(g, ""));
	cr_assert_null(bd_gguf_tensor_at(g, 3));

	bd_gguf_free(g);
	bd_gguf_free(NULL);
	unlink(path);
	free(path);
	free(m.w.p);
}

Test(gguf, valid_variants)
{
	char err[BD_GGUF_ERR_MAX];
	size_t data;

	/* no general.alignment: the default 32 */
	struct bd_gguf *g = open_built(&(struct build_opts){ .no_align = true }, &data);
	cr_assert_eq(bd_gguf_alignment(g), 32);
	cr_assert_eq(bd_gguf_data_offset(g), data);
	cr_assert_eq(bd_gguf_data_offset(g) % 32, 0);
	cr_assert_eq(bd_gguf_n_kv(g), 17);
	close_exact(g);

	/* version 2 has the same layout */
	g = open_built(&(struct build_opts){ .version = 2 }, NULL);
	cr_assert_eq(bd_gguf_version(g), 2);
	close_exact(g);

	/* four levels of arrays are accepted */
	close_exact(open_built(&(struct build_opts){ .nest = 4 }, NULL));

	/* the smallest file: a header with nothing in it */
	uint8_t h[24] = { 'G', 'G', 'U', 'F', 3 };
	cr_assert_eq(open_exact(h, sizeof(h), &g, err), 0, "%s", err);
	cr_assert_eq(bd_gguf_n_kv(g), 0);
	cr_assert_eq(bd_gguf_n_tensors(g), 0);
	cr_assert_null(bd_gguf_find_kv(g, "general.alignment"));
	cr_assert_null(bd_gguf_find_tensor(g, "a"));
	close_exact(g);
}

/* ---- malformed images ------------------------------------------------------------------ */

Test(gguf, bad_magic_and_version)
{
	struct img m = build(NULL);

	m.w.p[3] = 'X';
	expect_err(m.w.p, m.w.n, -ENOEXEC, "not a GGUF file");
	m.w.p[3] = 'F';
	patch_le(&m, m.version, 1, 4);
	expect_err(m.w.p, m.w.n, -EPROTONOSUPPORT, "version 1");
	patch_le(&m, m.version, 4, 4);
	expect_err(m.w.p, m.w.n, -EPROTONOSUPPORT, "version 4");
	patch_le(&m, m.version, 0x03000000u, 4); /* 3 written big-endian */
	expect_err(m.w.p, m.w.n, -EPROTONOSUPPORT, "big-endian");
	free(m.w.p);
}

Test(gguf, truncated_everywhere)
{
	struct img m = build(NULL);

	/* every strict prefix lacks bytes somewhere: the last tensor ends at EOF */
	for (size_t n = 0; n < m.w.n; n++) {
		struct bd_gguf *g = NULL;
		char err[BD_GGUF_ERR_MAX] = "";
		int r = open_exact(m.w.p, n, &g, err);
		cr_assert_eq(r, -EBADMSG, "prefix %zu: %d (%s)", n, r, err);
		cr_assert_null(g);
		cr_assert(strstr(err, "truncated"), "prefix %zu: '%s'", n, err);
	}
	expect_err(m.w.p, 10, -EBADMSG, "header");
	expect_err(m.w.p, 0, -EBADMSG, "truncated");
	free(m.w.p);
}

Test(gguf, string_length_past_eof)
{
	struct img m = build(NULL);
	size_t left = m.w.n - (m.key0_len + 8);

	patch_le(&m, m.key0_len, left + 1, 8);
	expect_err(m.w.p, m.w.n, -EBADMSG, "past the end");
	patch_le(&m, m.key0_len, UINT64_MAX, 8); /* off + len would wrap */
	expect_err(m.w.p, m.w.n, -EBADMSG, "past the end");
	patch_le(&m, m.key0_len, 20, 8);
	patch_le(&m, m.arch_len, UINT64_MAX - 3, 8);
	expect_err(m.w.p, m.w.n, -EBADMSG, "past the end");
	free(m.w.p);
}

Test(gguf, tensor_data_past_eof)
{
	struct img m = build(NULL);

	/* "c" moved one alignment step on: its 6 bytes now end past EOF */
	patch_le(&m, m.t_off[2], 256, 8);
	expect_err(m.w.p, m.w.n, -EBADMSG, "tensor 'c'");
	/* an offset so large that data_offset + offset wraps */
	patch_le(&m, m.t_off[2], UINT64_MAX - 63, 8);
	expect_err(m.w.p, m.w.n, -EBADMSG, "past the end");
	/* a row count that makes "a" larger than the file */
	patch_le(&m, m.t_off[2], 192, 8);
	patch_le(&m, m.t_ne[0] + 8, 1u << 20, 8);
	expect_err(m.w.p, m.w.n, -EBADMSG, "tensor 'a'");
	free(m.w.p);
}

Test(gguf, overflowing_dims)
{
	struct img m = build(NULL);

	/* 2^32 · 2^32 elements overflow 64 bits */
	patch_le(&m, m.t_ne[0], 1ull << 32, 8);
	patch_le(&m, m.t_ne[0] + 8, 1ull << 32, 8);
	expect_err(m.w.p, m.w.n, -EOVERFLOW, "overflow");
	/* one dim above INT64_MAX */
	patch_le(&m, m.t_ne[0], 4, 8);
	patch_le(&m, m.t_ne[0] + 8, 1ull << 63, 8);
	expect_err(m.w.p, m.w.n, -EOVERFLOW, "overflow");
	/* elements fit in 63 bits but their bytes do not: Q8_0 [992, 2^53] is 31·2^58 ≈ 8.9e18
	 * elements (< 2^63 ≈ 9.2e18) in 31·2^53 blocks of 34 bytes ≈ 9.5e18 bytes */
	patch_le(&m, m.t_ne[0] + 8, 2, 8);
	patch_le(&m, m.t_ne[1], 992, 8);
	patch_le(&m, m.t_ne[1] + 8, 1ull << 53, 8);
	expect_err(m.w.p, m.w.n, -EOVERFLOW, "byte size");
	/* a zero dim with a huge one is no overflow, and an empty tensor fits anywhere */
	patch_le(&m, m.t_ne[1], 0, 8);
	patch_le(&m, m.t_ne[1] + 8, UINT64_MAX >> 1, 8);
	struct bd_gguf *g = NULL;
	char err[BD_GGUF_ERR_MAX];
	cr_assert_eq(open_exact(m.w.p, m.w.n, &g, err), 0, "%s", err);
	cr_assert_eq(bd_gguf_find_tensor(g, "b")->nbytes, 0);
	close_exact(g);
	free(m.w.p);
}

Test(gguf, misaligned_offset)
{
	struct img m = build(NULL);

	patch_le(&m, m.t_off[1], 64 + 32, 8); /* a multiple of 32, not of general.alignment 64 */
	expect_err(m.w.p, m.w.n, -EBADMSG, "not a multiple of the alignment 64");
	patch_le(&m, m.t_off[1], 64, 8);
	patch_le(&m, m.align_val, 48, 4);
	expect_err(m.w.p, m.w.n, -EBADMSG, "power of two");
	patch_le(&m, m.align_val, 0, 4);
	expect_err(m.w.p, m.w.n, -EBADMSG, "power of two");
	free(m.w.p);
}

Test(gguf, huge_counts)
{
	struct img m = build(NULL);
	const uint64_t huge[] = { 1ull << 40, 1ull << 62, UINT64_MAX };

	/* none of these may allocate for the claimed count: the bound comes first */
	for (size_t k = 0; k < sizeof(huge) / sizeof(huge[0]); k++) {
		struct img c = build(NULL);
		patch_le(&c, c.n_kv, huge[k], 8);
		expect_err(c.w.p, c.w.n, -EBADMSG, "metadata entries");
		patch_le(&c, c.n_kv, 18, 8);
		patch_le(&c, c.n_tensors, huge[k], 8);
		expect_err(c.w.p, c.w.n, -EBADMSG, "tensor infos");
		patch_le(&c, c.n_tensors, 3, 8);
		patch_le(&c, c.arr_i32_n, huge[k], 8);
		expect_err(c.w.p, c.w.n, -EBADMSG, "test.arr_i32");
		patch_le(&c, c.arr_i32_n, 3, 8);
		patch_le(&c, c.arr_str_n, huge[k], 8);
		expect_err(c.w.p, c.w.n, -EBADMSG, "test.arr_str");
		free(c.w.p);
	}
	/* one more metadata entry than the bytes after the header could hold at 13 bytes each */
	patch_le(&m, m.n_kv, (m.w.n - 24) / 13 + 1, 8);
	expect_err(m.w.p, m.w.n, -EBADMSG, "metadata entries");
	patch_le(&m, m.n_kv, 18, 8);
	free(m.w.p);
}

Test(gguf, bad_types_and_names)
{
	struct img m = build(NULL);

	patch_le(&m, m.u8_type, 13, 4);
	expect_err(m.w.p, m.w.n, -EBADMSG, "unknown value type 13");
	patch_le(&m, m.u8_type, BD_GGUF_UINT8, 4);
	patch_le(&m, m.arr_f32_type, 99, 4);
	expect_err(m.w.p, m.w.n, -EBADMSG, "unknown array element type 99");
	patch_le(&m, m.arr_f32_type, BD_GGUF_FLOAT32, 4);
	patch_le(&m, m.t_type[2], 4, 4); /* Q4_2: an id ggml retired */
	expect_err(m.w.p, m.w.n, -EBADMSG, "unknown type 4");
	patch_le(&m, m.t_type[2], 1000, 4);
	expect_err(m.w.p, m.w.n, -EBADMSG, "unknown type 1000");
	patch_le(&m, m.t_type[2], BD_GGML_F16, 4);
	patch_le(&m, m.t_ndims[0], 5, 4);
	expect_err(m.w.p, m.w.n, -EBADMSG, "5 dims");
	patch_le(&m, m.t_ndims[0], 2, 4);
	patch_le(&m, m.t_ne[1], 33, 8); /* Q8_0 rows are whole blocks of 32 */
	expect_err(m.w.p, m.w.n, -EBADMSG, "not a multiple of the Q8_0 block");
	patch_le(&m, m.t_ne[1], 32, 8);
	m.w.p[m.bool_val] = 2;
	expect_err(m.w.p, m.w.n, -EBADMSG, "not 0 or 1");
	m.w.p[m.bool_val] = 1;
	m.w.p[m.i8_key + 5] = 'u'; /* "test.i8" → "test.u8" */
	expect_err(m.w.p, m.w.n, -EBADMSG, "duplicate metadata key 'test.u8'");
	m.w.p[m.i8_key + 5] = 'i';
	m.w.p[m.i8_key + 2] = 0;
	expect_err(m.w.p, m.w.n, -EBADMSG, "NUL");
	m.w.p[m.i8_key + 2] = 's';
	m.w.p[m.t_name[1] + 8] = 'a';
	expect_err(m.w.p, m.w.n, -EBADMSG, "duplicate tensor name 'a'");
	m.w.p[m.t_name[1] + 8] = 'b';
	/* general.alignment of another type than UINT32 */
	patch_le(&m, m.align_val - 4, BD_GGUF_INT32, 4);
	expect_err(m.w.p, m.w.n, -EBADMSG, "general.alignment has type INT32");
	patch_le(&m, m.align_val - 4, BD_GGUF_UINT32, 4);

	/* after all the patches undone, the image is valid again */
	struct bd_gguf *g = NULL;
	char err[BD_GGUF_ERR_MAX];
	cr_assert_eq(open_exact(m.w.p, m.w.n, &g, err), 0, "%s", err);
	close_exact(g);
	free(m.w.p);

	struct build_opts o = { .nest = 5 };
	m = build(&o);
	expect_err(m.w.p, m.w.n, -EBADMSG, "nested deeper than 4");
	free(m.w.p);
}

Test(gguf, bad_arguments_and_files)
{
	static struct bd_gguf *const sentinel = (struct bd_gguf *)&sentinel;
	struct bd_gguf *g = sentinel;
	char err[BD_GGUF_ERR_MAX];

	cr_assert_eq(bd_gguf_open(NULL, &g, err), -EINVAL);
	cr_assert_eq(bd_gguf_open("x", NULL, err), -EINVAL);
	cr_assert_eq(bd_gguf_open_mem(NULL, 5, &g, err), -EINVAL);
	cr_assert_eq(bd_gguf_open("/nonexistent/bd_gguf.gguf", &g, err), -ENOENT);
	cr_assert(strstr(err, "/nonexistent/bd_gguf.gguf"));
	cr_assert_eq(bd_gguf_open("/tmp", &g, err), -EISDIR);
	cr_assert_eq(bd_gguf_open("/tmp", &g, NULL), -EISDIR); /* no message buffer is fine */
	cr_assert_eq(g, sentinel);
	cr_assert_eq(bd_gguf_version(NULL), 0);
	cr_assert_eq(bd_gguf_n_kv(NULL), 0);
	cr_assert_null(bd_gguf_find_tensor(NULL, "a"));
	struct bd_model_hparams hp;
	cr_assert_eq(bd_gguf_model_hparams(NULL, &hp, err), -EINVAL);
}

/* ---- hyperparameters from a synthetic Qwen3 image ------------------------------------------ */

static void put_u32_kv(struct img *m, const char *key, uint32_t v)
{
	gw_key(&m->w, key, BD_GGUF_UINT32);
	gw_u32(&m->w, v);
}

/* A Qwen3-4B-shaped image (its published config: hidden 2560, 36 layers, 32 query / 8 KV heads
 * of dim 128, FFN 9728, θ = 1e6, ε = 1e-6, 40960 positions) with the vocabulary cut to 16 rows
 * so that token_embd.weight [2560, 16] F16 stays small, and a q-norm tensor. */
static struct img build_qwen3(const char *arch, bool with_key_length, uint32_t kv_heads)
{
	struct img m = { 0 };
	char key[96];
	int nkv = with_key_length ? 10 : 9;

	gw_put(&m.w, "GGUF", 4);
	gw_u32(&m.w, 3);
	gw_u64(&m.w, 2);
	gw_u64(&m.w, (uint64_t)nkv);
	gw_key(&m.w, "general.architecture", BD_GGUF_STRING);
	gw_cstr(&m.w, arch);
#define KV(suffix, v)                                            \
	do {                                                     \
		snprintf(key, sizeof(key), "%s." suffix, arch);  \
		put_u32_kv(&m, key, v);                          \
	} while (0)
	KV("block_count", 36);
	KV("embedding_length", 2560);
	KV("feed_forward_length", 9728);
	KV("attention.head_count", 32);
	KV("attention.head_count_kv", kv_heads);
	KV("context_length", 40960);
	if (with_key_length)
		KV("attention.key_length", 128);
#undef KV
	snprintf(key, sizeof(key), "%s.rope.freq_base", arch);
	gw_key(&m.w, key, BD_GGUF_FLOAT32);
	gw_u32(&m.w, f32_bits(1000000.0f));
	snprintf(key, sizeof(key), "%s.attention.layer_norm_rms_epsilon", arch);
	gw_key(&m.w, key, BD_GGUF_FLOAT32);
	gw_u32(&m.w, f32_bits(1e-6f));
	gw_cstr(&m.w, "token_embd.weight");
	gw_u32(&m.w, 2);
	gw_u64(&m.w, 2560);
	gw_u64(&m.w, 16);
	gw_u32(&m.w, BD_GGML_F16);
	gw_u64(&m.w, 0);
	gw_cstr(&m.w, "blk.0.attn_q_norm.weight");
	gw_u32(&m.w, 1);
	gw_u64(&m.w, 128);
	gw_u32(&m.w, BD_GGML_F32);
	gw_u64(&m.w, 2560 * 16 * 2);
	while (m.w.n % 32)
		gw_le(&m.w, 0, 1);
	static const uint8_t zero[2560 * 16 * 2 + 128 * 4];
	gw_put(&m.w, zero, sizeof(zero));
	return m;
}

Test(gguf, hparams_qwen3)
{
	struct img m = build_qwen3("qwen3", true, 8);
	struct bd_gguf *g = NULL;
	char err[BD_GGUF_ERR_MAX];
	struct bd_model_hparams hp;

	cr_assert_eq(bd_gguf_open_mem(m.w.p, m.w.n, &g, err), 0, "%s", err);
	cr_assert_eq(bd_gguf_model_hparams(g, &hp, err), 0, "%s", err);
	/* key_length 128 wins over 2560 / 32 = 80 (value length and rotated dims follow it);
	 * n_vocab: no vocab_size, no tokens, so the embedding's 16 rows; no output.weight: tied */
	td_expect_hparams(&hp, &(struct bd_model_hparams){
		.arch = BD_ARCH_QWEN3, .arch_name = "qwen3", .n_layers = 36, .n_embd = 2560,
		.n_ff = 9728, .n_heads = 32, .n_kv_heads = 8, .head_dim = 128, .head_dim_v = 128,
		.n_rot = 128, .rope_style = BD_ROPE_NEOX, .rope_base = 1000000.0f, .norm_eps = 1e-6f,
		.n_ctx_train = 40960, .n_vocab = 16, .qk_norm = true, .tied_embeddings = true },
		"qwen3 image");
	bd_gguf_free(g);
	free(m.w.p);

	/* without key_length the head dim is n_embd / n_heads = 80 */
	m = build_qwen3("qwen2", false, 8);
	cr_assert_eq(bd_gguf_open_mem(m.w.p, m.w.n, &g, err), 0, "%s", err);
	cr_assert_eq(bd_gguf_model_hparams(g, &hp, err), 0, "%s", err);
	cr_assert_eq(hp.arch, BD_ARCH_QWEN2);
	cr_assert_eq(hp.head_dim, 80);
	bd_gguf_free(g);
	free(m.w.p);

	/* 32 query heads over 5 KV heads: refused, hp untouched */
	m = build_qwen3("qwen3", true, 5);
	cr_assert_eq(bd_gguf_open_mem(m.w.p, m.w.n, &g, err), 0, "%s", err);
	memset(&hp, 0x5a, sizeof(hp));
	cr_assert_eq(bd_gguf_model_hparams(g, &hp, err), -EBADMSG);
	cr_assert(strstr(err, "KV heads"), "%s", err);
	cr_assert_eq(hp.n_layers, 0x5a5a5a5a);
	bd_gguf_free(g);
	free(m.w.p);

	m = build_qwen3("gemma", true, 8);
	cr_assert_eq(bd_gguf_open_mem(m.w.p, m.w.n, &g, err), 0, "%s", err);
	cr_assert_eq(bd_gguf_model_hparams(g, &hp, err), -ENOTSUP);
	cr_assert(strstr(err, "gemma"), "%s", err);
	bd_gguf_free(g);
	free(m.w.p);

	/* the test image of build() is "llama" without any llama.* keys */
	m = build(NULL);
	cr_assert_eq(bd_gguf_open_mem(m.w.p, m.w.n, &g, err), 0, "%s", err);
	cr_assert_eq(bd_gguf_model_hparams(g, &hp, err), -EBADMSG);
	cr_assert(strstr(err, "llama.block_count is missing"), "%s", err);
	bd_gguf_free(g);
	free(m.w.p);
}

/* ---- dequantization ---------------------------------------------------------------------- */

static uint32_t bits(float f)
{
	return f32_bits(f);
}

static uint8_t *unhex(const char *s, size_t *ret_n)
{
	size_t n = strlen(s) / 2;
	uint8_t *p = malloc(n ? n : 1);
	cr_assert_not_null(p);
	for (size_t i = 0; i < n; i++) {
		unsigned v;
		cr_assert_eq(sscanf(s + 2 * i, "%2x", &v), 1);
		p[i] = (uint8_t)v;
	}
	*ret_n = n;
	return p;
}

/* got[n] against the little-endian FP32 bytes of want_hex: bit for bit, any NaN for a NaN. */
static void assert_f32_hex(const float *got, size_t n, const char *want_hex, const char *what)
{
	size_t nb;
	uint8_t *w = unhex(want_hex, &nb);
	cr_assert_eq(nb, 4 * n, "%s: %zu golden bytes for %zu values", what, nb, n);
	for (size_t i = 0; i < n; i++) {
		uint32_t u = (uint32_t)w[4 * i] | (uint32_t)w[4 * i + 1] << 8 |
			     (uint32_t)w[4 * i + 2] << 16 | (uint32_t)w[4 * i + 3] << 24;
		float want;
		memcpy(&want, &u, 4);
		if (isnan(want))
			cr_assert(isnan(got[i]), "%s[%zu]: %a, want NaN", what, i, (double)got[i]);
		else
			cr_assert_eq(bits(got[i]), u, "%s[%zu]: %a, want %a", what, i,
				     (double)got[i], (double)want);
	}
	free(w);
}

Test(gguf, dequant_golden_gguf_py)
{
	json_t *j = td_load_json("tests/data/gguf/quants.json");
	json_t *cases = json_object_get(j, "cases");
	size_t k;
	json_t *c;
	int seen = 0;

	json_array_foreach(cases, k, c) {
		const char *name = json_string_value(json_object_get(c, "type"));
		int t = (int)json_integer_value(json_object_get(c, "ggml_type"));
		size_t n = (size_t)json_integer_value(json_object_get(c, "n"));
		size_t nraw, blck, tsize;
		uint8_t *raw = unhex(json_string_value(json_object_get(c, "raw_hex")), &nraw);

		cr_assert_str_eq(bd_ggml_type_name(t), name);
		cr_assert(bd_ggml_can_dequantize(t), "%s", name);
		cr_assert_eq(bd_ggml_type_info(t, &blck, &tsize), 0);
		cr_assert_eq(nraw, n / blck * tsize, "%s: block size disagrees with gguf-py", name);
		/* one byte of slack in front: the dequantizer must not need aligned input */
		uint8_t *src = malloc(nraw + 1);
		memcpy(src + 1, raw, nraw);
		float *x = malloc(n * sizeof(float));
		cr_assert_eq(bd_ggml_dequantize(t, src + 1, n, x), 0, "%s", name);
		assert_f32_hex(x, n, json_string_value(json_object_get(c, "out_hex")), name);
		free(x);
		free(src);
		free(raw);
		seen |= 1 << (t % 31);
	}
	/* the types the issue names, and the default model's, are all in the golden file */
	static const int need[] = { BD_GGML_F32, BD_GGML_F16, BD_GGML_BF16, BD_GGML_Q8_0,
				    BD_GGML_Q4_0, BD_GGML_Q4_1, BD_GGML_Q4_K, BD_GGML_Q6_K };
	for (size_t i = 0; i < sizeof(need) / sizeof(need[0]); i++)
		cr_assert(seen & (1 << (need[i] % 31)), "type %d missing from quants.json", need[i]);
	json_decref(j);
}

Test(gguf, dequant_by_hand)
{
	uint8_t b[210];
	float x[256];

	/* Q4_0, d = 1 (0x3c00): byte j holds q_j in its low nibble and q_{j+16} = 15 − j in its
	 * high nibble, so x_j = j − 8 and x_{j+16} = 7 − j. */
	memset(b, 0, sizeof(b));
	b[0] = 0x00;
	b[1] = 0x3c;
	for (int j = 0; j < 16; j++)
		b[2 + j] = (uint8_t)(j | (15 - j) << 4);
	cr_assert_eq(bd_ggml_dequantize(BD_GGML_Q4_0, b, 32, x), 0);
	for (int j = 0; j < 16; j++) {
		cr_assert_eq(x[j], (float)(j - 8));
		cr_assert_eq(x[j + 16], (float)(7 - j));
	}

	/* Q5_1, d = 0.5, m = −4, qh = 0x80000001: element 0 gets a 5th bit (16 + 3 = 19),
	 * element 31 too (16 + 0); element 1 has none (3). x = 0.5 q − 4. */
	memset(b, 0, sizeof(b));
	b[1] = 0x38;       /* 0.5 */
	b[3] = 0xc4;       /* -4 */
	b[4] = 0x01;
	b[7] = 0x80;
	for (int j = 0; j < 16; j++)
		b[8 + j] = 0x03; /* low nibbles 3, high nibbles 0 */
	cr_assert_eq(bd_ggml_dequantize(BD_GGML_Q5_1, b, 32, x), 0);
	cr_assert_eq(x[0], 0.5f * 19 - 4);
	cr_assert_eq(x[1], 0.5f * 3 - 4);
	cr_assert_eq(x[16], -4.0f);
	cr_assert_eq(x[31], 0.5f * 16 - 4);

	/* Q4_K, d = 1, dmin = 0.5. Scales: byte 0 = 0xc3 → sub-block 0 scale 3, and the top
	 * bits 3 are sub-block 4's scale bits 4..5; byte 4 = 0x45 → sub-block 0 min 5, top bits 1
	 * are sub-block 4's min bits 4..5; byte 8 = 0x21 → sub-block 4 scale low nibble 1, min
	 * low nibble 2. So sub-block 4: scale 1 + 48 = 49, min 2 + 16 = 18. Every nibble byte
	 * 0x21: low nibble 1 (sub-blocks 0, 2, 4, 6), high nibble 2 (1, 3, 5, 7).
	 * Sub-block 0: 3·1 − 0.5·5 = 0.5; sub-block 4: 49·1 − 0.5·18 = 40; sub-block 1 (scale and
	 * min bytes 1 and 5 are 0): 0. */
	memset(b, 0, sizeof(b));
	b[1] = 0x3c;
	b[3] = 0x38;
	b[4 + 0] = 0xc3;
	b[4 + 4] = 0x45;
	b[4 + 8] = 0x21;
	memset(b + 16, 0x21, 128);
	cr_assert_eq(bd_ggml_dequantize(BD_GGML_Q4_K, b, 256, x), 0);
	for (int l = 0; l < 32; l++) {
		cr_assert_eq(x[l], 0.5f);
		cr_assert_eq(x[32 + l], 0.0f);
		cr_assert_eq(x[128 + l], 40.0f);
	}

	/* Q6_K, d = 2 (0x4000) at bytes 208..209, scale of group 0 = −3, of group 7 = 5.
	 * ql[0] = 0x5a: element 0 low nibble 0xa, element 64 low nibble 5; qh[0] = 0b11100100:
	 * element 0 high bits 0, element 32 high bits 1, element 64 high bits 2, element 96 3.
	 * x_0 = 2·(−3)·(10 − 32) = 132; x_64 = 2·s_4·(5 + 32 − 32) with s_4 = 0 → 0;
	 * element 112 (group 7) = 2·5·(ql[48] high nibble 0 + (qh[16] bits 6..7 = 0) − 32) = −320;
	 * element 32 (group 2, scale 0) = 0. */
	memset(b, 0, sizeof(b));
	b[0] = 0x5a;
	b[128] = 0xe4;
	b[192 + 0] = (uint8_t)-3;
	b[192 + 7] = 5;
	b[209] = 0x40;
	cr_assert_eq(bd_ggml_dequantize(BD_GGML_Q6_K, b, 256, x), 0);
	cr_assert_eq(x[0], 132.0f);
	cr_assert_eq(x[64], 0.0f);
	cr_assert_eq(x[112], -320.0f);
	cr_assert_eq(x[32], 0.0f);
	/* the second half uses scales 8..15, all 0 */
	cr_assert_eq(x[128], 0.0f);

	/* BF16 is the top half of an FP32 */
	uint8_t h[4] = { 0xc0, 0x3f, 0x80, 0xff }; /* 0x3fc0 = 1.5, 0xff80 = −inf */
	cr_assert_eq(bd_ggml_dequantize(BD_GGML_BF16, h, 2, x), 0);
	cr_assert_eq(x[0], 1.5f);
	cr_assert(isinf(x[1]) && x[1] < 0);
}

Test(gguf, f16_conversion)
{
	static const struct {
		uint16_t h;
		float f;
	} cases[] = {
		{ 0x3c00, 1.0f },     { 0xc000, -2.0f },  { 0x7bff, 65504.0f },
		{ 0x0400, 0x1p-14f }, /* smallest normal */
		{ 0x0001, 0x1p-24f }, /* smallest subnormal */
		{ 0x03ff, 1023 * 0x1p-24f }, /* largest subnormal */
		{ 0x3555, 0x1.554p-2f },      /* 0.333251953125 */
		{ 0x7c00, INFINITY }, { 0xfc00, -INFINITY },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
		cr_assert_eq(bits(bd_f16_to_f32(cases[i].h)), bits(cases[i].f), "0x%04x",
			     cases[i].h);
	cr_assert_eq(bits(bd_f16_to_f32(0x8000)), 0x80000000u); /* −0 keeps its sign */
	cr_assert(isnan(bd_f16_to_f32(0x7e00)));
	cr_assert(isnan(bd_f16_to_f32(0xfc01)));
}

Test(gguf, dequant_errors)
{
	uint8_t b[256] = { 0 };
	float x[64];
	size_t blck = 0, tsize = 0;

	for (int i = 0; i < 64; i++)
		x[i] = 7.0f;
	cr_assert_eq(bd_ggml_dequantize(BD_GGML_Q8_0, b, 33, x), -EINVAL); /* not whole blocks */
	cr_assert_eq(bd_ggml_dequantize(BD_GGML_Q2_K, b, 256, x), -ENOTSUP);
	cr_assert_eq(bd_ggml_dequantize(4, b, 32, x), -EINVAL); /* retired Q4_2 */
	cr_assert_eq(bd_ggml_dequantize(-1, b, 32, x), -EINVAL);
	cr_assert_eq(bd_ggml_dequantize(BD_GGML_F32, NULL, 1, x), -EINVAL);
	for (int i = 0; i < 64; i++)
		cr_assert_eq(x[i], 7.0f, "output written on error");

	/* block geometry from the format descriptions: Q8_0 = d + 32 int8; Q4_K = d, dmin,
	 * 12 scale bytes, 128 nibble bytes; Q6_K = 128 + 64 + 16 + 2 */
	cr_assert_eq(bd_ggml_type_info(BD_GGML_Q8_0, &blck, &tsize), 0);
	cr_assert(blck == 32 && tsize == 34);
	cr_assert_eq(bd_ggml_type_info(BD_GGML_Q4_K, &blck, &tsize), 0);
	cr_assert(blck == 256 && tsize == 144);
	cr_assert_eq(bd_ggml_type_info(BD_GGML_Q6_K, &blck, &tsize), 0);
	cr_assert(blck == 256 && tsize == 210);
	blck = 5;
	cr_assert_eq(bd_ggml_type_info(5, &blck, &tsize), -EINVAL);
	cr_assert_eq(bd_ggml_type_info(BD_GGML_TYPE_LIMIT, &blck, &tsize), -EINVAL);
	cr_assert_eq(blck, 5);
	cr_assert_null(bd_ggml_type_name(31));
	cr_assert(!bd_ggml_can_dequantize(BD_GGML_IQ2_XXS));
}

/* ---- the embedded model ------------------------------------------------------------------ */

/* The string array at key holds gold[n_field] entries, and the entries gold[field] names by
 * index ({"17": "text", ...}). */
static void expect_str_array(const struct bd_gguf *g, const char *key, json_t *gold,
			     const char *n_field, const char *field)
{
	const struct bd_gguf_kv *kv = bd_gguf_find_kv(g, key);
	const char *idx;
	json_t *e;
	cr_assert_not_null(kv, "%s", key);
	cr_assert_eq(kv->n, json_integer_value(json_object_get(gold, n_field)));
	json_object_foreach(json_object_get(gold, field), idx, e) {
		struct bd_gguf_str s;
		cr_assert_eq(bd_gguf_arr_str(kv, strtoull(idx, NULL, 10), &s), 0);
		cr_assert(s.len == strlen(json_string_value(e)) &&
			  !memcmp(s.s, json_string_value(e), s.len), "%s[%s]", key, idx);
	}
}

static struct bd_gguf *open_model(json_t **ret_golden)
{
	struct bd_gguf *g = td_open_model();
	*ret_golden = td_load_json("tests/data/gguf/smollm2.json");
	return g;
}

Test(gguf, model_metadata)
{
	json_t *gold;
	struct bd_gguf *g = open_model(&gold);

	cr_assert_eq(bd_gguf_version(g), json_integer_value(json_object_get(gold, "version")));
	cr_assert_eq(bd_gguf_n_kv(g), json_integer_value(json_object_get(gold, "n_kv")));
	cr_assert_eq(bd_gguf_n_tensors(g), json_integer_value(json_object_get(gold, "n_tensors")));
	cr_assert_eq(bd_gguf_data_offset(g),
		     json_integer_value(json_object_get(gold, "data_offset")));

	const char *key;
	json_t *e;
	json_object_foreach(json_object_get(gold, "kv"), key, e) {
		const char *type = json_string_value(json_object_get(e, "type"));
		json_t *v = json_object_get(e, "value");
		const struct bd_gguf_kv *kv = bd_gguf_find_kv(g, key);
		cr_assert_not_null(kv, "%s", key);
		cr_assert_str_eq(bd_gguf_type_name(kv->type), type, "%s", key);
		if (json_is_string(v)) {
			struct bd_gguf_str s;
			cr_assert_eq(bd_gguf_get_str(g, key, &s), 0);
			cr_assert(s.len == strlen(json_string_value(v)) &&
				  !memcmp(s.s, json_string_value(v), s.len), "%s", key);
		} else if (json_is_boolean(v)) {
			bool b;
			cr_assert_eq(bd_gguf_get_bool(g, key, &b), 0);
			cr_assert_eq(b, json_is_true(v), "%s", key);
		} else if (json_is_integer(v)) {
			int64_t i;
			cr_assert_eq(bd_gguf_get_int(g, key, &i), 0);
			cr_assert_eq(i, json_integer_value(v), "%s", key);
		} else {
			double d;
			cr_assert_eq(bd_gguf_get_float(g, key, &d), 0);
			/* gguf-py's float32, printed and re-read as double */
			cr_assert_eq((float)d, (float)json_number_value(v), "%s", key);
		}
	}

	expect_str_array(g, "tokenizer.ggml.tokens", gold, "n_tokens", "tokens");
	expect_str_array(g, "tokenizer.ggml.merges", gold, "n_merges", "merges");
	const struct bd_gguf_kv *tt = bd_gguf_find_kv(g, "tokenizer.ggml.token_type");
	json_object_foreach(json_object_get(gold, "token_type"), key, e) {
		int64_t i;
		cr_assert_eq(bd_gguf_arr_int(tt, strtoull(key, NULL, 10), &i), 0);
		cr_assert_eq(i, json_integer_value(e), "token_type %s", key);
	}
	struct bd_gguf_str tmpl;
	cr_assert_eq(bd_gguf_get_str(g, "tokenizer.chat_template", &tmpl), 0);
	cr_assert_eq(tmpl.len, json_integer_value(json_object_get(gold, "chat_template_len")));
	const char *pre = json_string_value(json_object_get(gold, "chat_template_prefix"));
	cr_assert_eq(memcmp(tmpl.s, pre, strlen(pre)), 0);

	/* hyperparameters: SmolLM2-135M is a Llama with 30 layers, 9 query and 3 KV heads of
	 * dim 576 / 9 = 64, FFN 1536, θ = 1e5, 8192 positions, 49152 tokens, tied embeddings */
	struct bd_model_hparams hp;
	char err[BD_GGUF_ERR_MAX];
	json_t *kvs = json_object_get(gold, "kv");
#define GOLD_INT(k) json_integer_value(json_object_get(json_object_get(kvs, k), "value"))
	cr_assert_eq(bd_gguf_model_hparams(g, &hp, err), 0, "%s", err);
	cr_assert_eq(hp.arch, BD_ARCH_LLAMA);
	cr_assert_eq(hp.rope_style, BD_ROPE_NORM);
	cr_assert_eq(hp.n_layers, GOLD_INT("llama.block_count"));
	cr_assert_eq(hp.n_layers, 30);
	cr_assert_eq(hp.n_heads, 9);
	cr_assert_eq(hp.n_kv_heads, 3);
	cr_assert_eq(hp.head_dim, 64);
	cr_assert_eq(hp.head_dim_v, 64);
	cr_assert_eq(hp.n_rot, GOLD_INT("llama.rope.dimension_count"));
	cr_assert_eq(hp.n_embd, GOLD_INT("llama.embedding_length"));
	cr_assert_eq(hp.n_ff, GOLD_INT("llama.feed_forward_length"));
	cr_assert_eq(hp.n_ctx_train, GOLD_INT("llama.context_length"));
	cr_assert_eq(hp.n_vocab, 49152);
	cr_assert_eq(hp.rope_base, 100000.0f);
	cr_assert_eq(hp.norm_eps, 1e-5f);
	cr_assert(!hp.qk_norm);
	cr_assert(!hp.attn_bias);
	cr_assert_eq(hp.tied_embeddings,
		     !json_is_true(json_object_get(gold, "has_output_weight")));
#undef GOLD_INT
	bd_gguf_free(g);
	json_decref(gold);
}

Test(gguf, model_tensors)
{
	json_t *gold;
	struct bd_gguf *g = open_model(&gold);

	/* tensor types as gguf-py counts them */
	const char *key;
	json_t *e;
	json_object_foreach(json_object_get(gold, "tensor_types"), key, e) {
		json_int_t n = 0;
		for (size_t i = 0; i < bd_gguf_n_tensors(g); i++)
			n += strcmp(bd_ggml_type_name(bd_gguf_tensor_at(g, i)->type), key) == 0;
		cr_assert_eq(n, json_integer_value(e), "%s", key);
	}
	size_t k;
	json_array_foreach(json_object_get(gold, "tensors"), k, e) {
		const char *name = json_string_value(json_object_get(e, "name"));
		const struct bd_gguf_tensor *t = bd_gguf_find_tensor(g, name);
		cr_assert_not_null(t, "%s", name);
		cr_assert_str_eq(bd_ggml_type_name(t->type),
				 json_string_value(json_object_get(e, "type")));
		json_t *ne = json_object_get(e, "ne");
		cr_assert_eq((size_t)t->n_dims, json_array_size(ne), "%s", name);
		for (int d = 0; d < t->n_dims; d++)
			cr_assert_eq(t->ne[d], (uint64_t)json_integer_value(json_array_get(ne, d)));
		/* gguf-py gives the absolute file offset */
		cr_assert_eq(bd_gguf_data_offset(g) + t->offset,
			     (uint64_t)json_integer_value(json_object_get(e, "offset")));
	}

	/* spot rows, bit for bit against gguf-py's dequantization */
	json_array_foreach(json_object_get(gold, "spots"), k, e) {
		const char *name = json_string_value(json_object_get(e, "tensor"));
		uint64_t row = (uint64_t)json_integer_value(json_object_get(e, "row"));
		const struct bd_gguf_tensor *t = bd_gguf_find_tensor(g, name);
		float *x = malloc(t->ne[0] * sizeof(float));
		cr_assert_eq(bd_gguf_tensor_rows_f32(t, row, 1, x), 0);
		char what[128];
		snprintf(what, sizeof(what), "%s row %llu", name, (unsigned long long)row);
		assert_f32_hex(x, t->ne[0], json_string_value(json_object_get(e, "out_hex")), what);
		free(x);
	}

	/* the whole of blk.0.attn_q.weight through the full-tensor path: its sums agree with
	 * gguf-py's to double rounding (the summation orders differ) */
	const struct bd_gguf_tensor *q = bd_gguf_find_tensor(g, "blk.0.attn_q.weight");
	float *x = malloc(q->n_elements * sizeof(float));
	cr_assert_eq(bd_gguf_tensor_to_f32(q, x), 0);
	double sum = 0, asum = 0;
	for (uint64_t i = 0; i < q->n_elements; i++) {
		sum += x[i];
		asum += fabs(x[i]);
	}
	double want = json_number_value(json_object_get(gold, "attn_q_sum"));
	double awant = json_number_value(json_object_get(gold, "attn_q_abs_sum"));
	cr_assert(fabs(sum - want) <= 1e-9 * awant, "sum %.12g, gguf-py %.12g", sum, want);
	cr_assert(fabs(asum - awant) <= 1e-12 * awant, "abs sum %.12g, gguf-py %.12g", asum,
		  awant);
	free(x);
	bd_gguf_free(g);
	json_decref(gold);
}
