/* test_safetensors.c — bd_safetensors.h and bd_model_hf.h: the safetensors parser, config.json
 * and Hugging Face checkpoints. Suite "safetensors".
 *
 * The parser is fed small images this file builds (a length, a JSON header written out by
 * hand, the data), valid ones and then each kind of corruption, in exactly-sized buffers so
 * that ASan sees any read past the end. Expected values are worked out by hand in the comments.
 * Tiny random Llama, Qwen2 and Qwen3 models are written as safetensors + config.json (their
 * weights chosen to be exact in the dtype they are stored in), loaded through bd_model_from_hf
 * and compared, tensor by tensor and logit by logit, with the same weights put into
 * bd_model_alloc directly. HF's RoPE order is checked against llama.cpp's: the same Llama
 * weights with q/k rows permuted as convert_hf_to_gguf does and NORM RoPE give the same logits.
 */
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <criterion/criterion.h>
#include <jansson.h>

#include "model/bd_forward.h"
#include "model/bd_model_hf.h"
#include "formats/bd_safetensors.h"
#include "model_data.h"

/* ---- images ---------------------------------------------------------------------------------- */

/* u64 LE length of header, header, data: malloc'ed, exactly sized. */
static uint8_t *image(const char *header, const void *data, size_t data_len, size_t *ret_n)
{
	size_t h = strlen(header), n = 8 + h + data_len;
	uint8_t *p = malloc(n ? n : 1);
	cr_assert_not_null(p);
	for (int i = 0; i < 8; i++)
		p[i] = (uint8_t)((uint64_t)h >> (8 * i));
	memcpy(p + 8, header, h);
	if (data_len)
		memcpy(p + 8 + h, data, data_len);
	*ret_n = n;
	return p;
}

/* Parse hdr + data_len zero bytes; expect code (0: success, then the handle is freed). */
static void expect_code(const char *hdr, size_t data_len, int code)
{
	uint8_t *zeros = calloc(data_len ? data_len : 1, 1);
	size_t n;
	uint8_t *img = image(hdr, zeros, data_len, &n);
	struct bd_st *sentinel = (struct bd_st *)&n, *st = sentinel;
	char err[BD_ST_ERR_MAX];
	memset(err, 'x', sizeof(err));
	int r = bd_st_open_mem(img, n, &st, err);
	cr_expect_eq(r, code, "header %s: got %d (%s), want %d", hdr, r, r ? err : "", code);
	if (code < 0) {
		cr_expect_eq(st, sentinel, "header %s: *ret written on error", hdr);
		cr_expect(memchr(err, 0, sizeof(err)) && err[0], "header %s: no message", hdr);
	} else if (r == 0) {
		bd_st_free(st);
	}
	free(img);
	free(zeros);
}

/* The valid three-tensor file of the first test. Data, 22 bytes, in the order c, a, b:
 *   c BF16 [3]    [0, 6):   0x3FC0 = 1.5, 0xC040 = −3.0, 0x0000 = 0
 *   a F32  [2]    [6, 14):  0x3FC00000 = 1.5, 0xBE800000 = −0.25 (unaligned: 8 + N + 6)
 *   b F16  [2, 2] [14, 22): 0x3C00 = 1.0, 0xC000 = −2.0, 0x0001 = 2^−24, 0x7BFF = 65504 */
static const char VALID_HDR[] =
	"{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [6, 14]},"
	" \"__metadata__\": {\"format\": \"pt\", \"note\": \"x\"},"
	" \"b\": {\"dtype\": \"F16\", \"shape\": [2, 2], \"data_offsets\": [14, 22]},"
	" \"c\": {\"dtype\": \"BF16\", \"shape\": [3], \"data_offsets\": [0, 6]}}   ";
static const uint8_t VALID_DATA[22] = {
	0xC0, 0x3F, 0x40, 0xC0, 0x00, 0x00,                   /* c */
	0x00, 0x00, 0xC0, 0x3F, 0x00, 0x00, 0x80, 0xBE,       /* a */
	0x00, 0x3C, 0x00, 0xC0, 0x01, 0x00, 0xFF, 0x7B,       /* b */
};

static void check_valid(const struct bd_st *st, const uint8_t *base)
{
	size_t N = strlen(VALID_HDR);
	cr_assert_eq(bd_st_n_tensors(st), 3);
	cr_expect_eq(bd_st_header_len(st), N);
	cr_expect_eq(bd_st_data_offset(st), 8 + N);
	cr_expect_eq(bd_st_file_size(st), 8 + N + 22);
	/* index order is data order: c, a, b */
	cr_expect_str_eq(bd_st_tensor_at(st, 0)->name, "c");
	cr_expect_str_eq(bd_st_tensor_at(st, 1)->name, "a");
	cr_expect_str_eq(bd_st_tensor_at(st, 2)->name, "b");
	cr_expect_null(bd_st_tensor_at(st, 3));

	const struct bd_st_tensor *a = bd_st_find_tensor(st, "a");
	const struct bd_st_tensor *b = bd_st_find_tensor(st, "b");
	const struct bd_st_tensor *c = bd_st_find_tensor(st, "c");
	cr_assert(a && b && c);
	cr_expect_null(bd_st_find_tensor(st, "__metadata__"));
	cr_expect_null(bd_st_find_tensor(st, "d"));
	cr_expect_eq(a->dtype, BD_ST_F32);
	cr_expect_eq(a->n_dims, 1);
	cr_expect_eq(a->shape[0], 2);
	cr_expect_eq(a->shape[1], 1);
	cr_expect_eq(a->n_elements, 2);
	cr_expect_eq(a->begin, 6);
	cr_expect_eq(a->end, 14);
	cr_expect_eq(a->nbytes, 8);
	cr_expect_eq((const uint8_t *)a->data, base + 8 + N + 6);
	cr_expect_eq(b->dtype, BD_ST_F16);
	cr_expect_eq(b->n_dims, 2);
	cr_expect_eq(b->shape[0], 2);
	cr_expect_eq(b->shape[1], 2);
	cr_expect_eq(b->n_elements, 4);
	cr_expect_eq(c->dtype, BD_ST_BF16);

	float x[4];
	cr_assert_eq(bd_st_tensor_to_f32(a, x), 0);
	cr_expect(x[0] == 1.5f && x[1] == -0.25f, "F32: %g %g", x[0], x[1]);
	cr_assert_eq(bd_st_tensor_to_f32(b, x), 0);
	cr_expect(x[0] == 1.0f && x[1] == -2.0f && x[2] == 0x1p-24f && x[3] == 65504.0f,
		  "F16: %g %g %g %g", x[0], x[1], x[2], x[3]);
	cr_assert_eq(bd_st_tensor_to_f32(c, x), 0);
	cr_expect(x[0] == 1.5f && x[1] == -3.0f && x[2] == 0.0f, "BF16: %g %g %g", x[0], x[1],
		  x[2]);
	/* row 1 of b (2 columns): 2^−24, 65504 */
	float row[2] = { 7, 7 };
	cr_assert_eq(bd_st_tensor_rows_f32(b, 1, 1, row), 0);
	cr_expect(row[0] == 0x1p-24f && row[1] == 65504.0f);

	cr_expect_eq(bd_st_n_metadata(st), 2);
	cr_expect_str_eq(bd_st_metadata_get(st, "format"), "pt");
	cr_expect_str_eq(bd_st_metadata_get(st, "note"), "x");
	cr_expect_null(bd_st_metadata_get(st, "a"));
	const char *k, *v;
	cr_assert_eq(bd_st_metadata_at(st, 0, &k, &v), 0);
	cr_expect(strcmp(k, "format") == 0 && strcmp(v, "pt") == 0);
}

Test(safetensors, valid_f32_f16_bf16_in_memory)
{
	size_t n;
	uint8_t *img = image(VALID_HDR, VALID_DATA, sizeof(VALID_DATA), &n);
	struct bd_st *st = NULL;
	char err[BD_ST_ERR_MAX];
	int r = bd_st_open_mem(img, n, &st, err);
	cr_assert_eq(r, 0, "%d %s", r, err);
	cr_expect_str_empty(err);
	check_valid(st, img);
	bd_st_free(st);
	free(img);
}

static char tmpdir[64];

static void make_tmpdir(void)
{
	snprintf(tmpdir, sizeof(tmpdir), "/tmp/bd_st_XXXXXX");
	cr_assert_not_null(mkdtemp(tmpdir));
}

static void rm_tmpdir(void)
{
	DIR *d = opendir(tmpdir);
	if (!d)
		return;
	struct dirent *e;
	char p[512];
	while ((e = readdir(d)))
		if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
			snprintf(p, sizeof(p), "%s/%s", tmpdir, e->d_name);
			unlink(p);
		}
	closedir(d);
	rmdir(tmpdir);
}

static void write_bytes(const char *path, const void *p, size_t n)
{
	FILE *f = fopen(path, "wb");
	cr_assert_not_null(f, "%s", path);
	cr_assert_eq(fwrite(p, 1, n, f), n);
	cr_assert_eq(fclose(f), 0);
}

Test(safetensors, valid_file_through_mmap_and_open_errors)
{
	size_t n;
	uint8_t *img = image(VALID_HDR, VALID_DATA, sizeof(VALID_DATA), &n);
	char path[128], err[BD_ST_ERR_MAX];
	struct bd_st *st = NULL, *sentinel = (struct bd_st *)&n;

	make_tmpdir();
	snprintf(path, sizeof(path), "%s/t.safetensors", tmpdir);
	write_bytes(path, img, n);
	int r = bd_st_open(path, &st, err);
	cr_assert_eq(r, 0, "%d %s", r, err);
	/* the mapping's bytes are what a mem parse of the same image sees */
	const struct bd_st_tensor *a = bd_st_find_tensor(st, "a");
	cr_assert_not_null(a);
	cr_expect_eq(memcmp(a->data, VALID_DATA + 6, 8), 0);
	float x[2];
	cr_assert_eq(bd_st_tensor_to_f32(a, x), 0);
	cr_expect(x[0] == 1.5f && x[1] == -0.25f);
	bd_st_free(st);

	st = sentinel;
	snprintf(path, sizeof(path), "%s/missing.safetensors", tmpdir);
	cr_expect_eq(bd_st_open(path, &st, err), -ENOENT);
	cr_expect(strstr(err, "missing.safetensors") != NULL, "%s", err);
	cr_expect_eq(bd_st_open(tmpdir, &st, err), -EISDIR);
	snprintf(path, sizeof(path), "%s/empty.safetensors", tmpdir);
	write_bytes(path, "", 0);
	cr_expect_eq(bd_st_open(path, &st, err), -EBADMSG);
	cr_expect(strstr(err, "empty.safetensors") != NULL, "%s", err);
	cr_expect_eq(st, sentinel);
	rm_tmpdir();
	free(img);
}

Test(safetensors, every_truncation_is_an_error)
{
	size_t n;
	uint8_t *img = image(VALID_HDR, VALID_DATA, sizeof(VALID_DATA), &n);
	for (size_t k = 0; k < n; k++) {
		/* an exactly sized copy: a read past k bytes is an ASan error */
		uint8_t *cut = malloc(k ? k : 1);
		memcpy(cut, img, k);
		struct bd_st *st = NULL;
		char err[BD_ST_ERR_MAX];
		int r = bd_st_open_mem(k ? cut : NULL, k, &st, err);
		cr_expect_eq(r, -EBADMSG, "prefix of %zu bytes: %d", k, r);
		cr_expect_null(st);
		free(cut);
	}
	free(img);
}

/* Errors; each must leave *ret alone and say why. Data bytes are zeros of the given length. */
Test(safetensors, header_errors)
{
	/* file shorter than the 8-byte length */
	{
		uint8_t five[5] = { 0 };
		struct bd_st *st = NULL;
		char err[BD_ST_ERR_MAX];
		cr_expect_eq(bd_st_open_mem(five, 5, &st, err), -EBADMSG);
		cr_expect(strstr(err, "truncated") != NULL, "%s", err);
	}
	/* header length past the end of the file: N = 1000 with 10 bytes after it */
	{
		uint8_t b[18] = { 0xE8, 0x03, 0, 0, 0, 0, 0, 0, '{', '}', ' ', ' ', ' ',
				  ' ', ' ', ' ', ' ', ' ' };
		struct bd_st *st = NULL;
		char err[BD_ST_ERR_MAX];
		cr_expect_eq(bd_st_open_mem(b, sizeof(b), &st, err), -EBADMSG);
		cr_expect(strstr(err, "past the end") != NULL, "%s", err);
		/* N = 2^64 − 1: 8 + N must not wrap around */
		memset(b, 0xFF, 8);
		cr_expect_eq(bd_st_open_mem(b, sizeof(b), &st, err), -EBADMSG);
		/* N = 2^40: over the 100 MB header limit */
		memset(b, 0, 8);
		b[5] = 1;
		cr_expect_eq(bd_st_open_mem(b, sizeof(b), &st, err), -EBADMSG);
		cr_expect_null(st);
	}
	expect_code("", 0, -EBADMSG);                        /* N = 0 */
	expect_code("{}", 0, 0);                             /* no tensors, no data: valid */
	expect_code("{}", 4, -EBADMSG);                      /* data nobody owns */
	expect_code("{\"a\": ", 0, -EBADMSG);                /* not JSON */
	expect_code("{\"a\": 1} x", 0, -EBADMSG);            /* garbage after the object */
	expect_code(" {}", 0, -EBADMSG);                     /* must start with '{' */
	expect_code("[1, 2]", 0, -EBADMSG);                  /* not an object */
	expect_code("{\"a\": 1}", 0, -EBADMSG);              /* entry not an object */
	expect_code("{\"a\\u0000b\": {\"dtype\": \"F32\", \"shape\": [1], "
		    "\"data_offsets\": [0, 4]}}", 4, -EBADMSG); /* NUL inside a name */
	expect_code("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]},"
		    " \"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}}", 8,
		    -EBADMSG); /* the same name twice */
	expect_code("{\"__metadata__\": [\"x\"]}", 0, -EBADMSG);
	expect_code("{\"__metadata__\": {\"k\": 1}}", 0, -EBADMSG);
	expect_code("{\"__metadata__\": {\"k\": \"v\"}}", 0, 0);
}

/* One tensor entry {"t": {"dtype": dtype, "shape": shape, "data_offsets": offsets}}, each a
 * JSON value, a field left out where NULL, over data_len zero bytes: expect code. */
static void expect_entry(const char *dtype, const char *shape, const char *offsets,
			 size_t data_len, int code)
{
	char hdr[256];
	int n = snprintf(hdr, sizeof(hdr), "{\"t\": {");

	if (dtype)
		n += snprintf(hdr + n, sizeof(hdr) - (size_t)n, "\"dtype\": %s, ", dtype);
	if (shape)
		n += snprintf(hdr + n, sizeof(hdr) - (size_t)n, "\"shape\": %s, ", shape);
	if (offsets)
		n += snprintf(hdr + n, sizeof(hdr) - (size_t)n, "\"data_offsets\": %s, ", offsets);
	cr_assert_lt((size_t)n, sizeof(hdr) - 2);
	snprintf(hdr + n - 2, sizeof(hdr) - (size_t)n + 2, "}}"); /* over the last ", " */
	expect_code(hdr, data_len, code);
}

Test(safetensors, tensor_entry_errors)
{
	struct entry {
		const char *dtype, *shape, *offsets;
		size_t data_len;
		int code;
	};
	static const struct entry accepted[] = {
		{ "\"F32\"", "[2]", "[0, 8]", 8, 0 }, /* the reference: F32 [2] in [0, 8) */
		{ "\"F32\"", "[1,1,1,1,1,1,1,2]", "[0, 8]", 8, 0 }, /* 8 dims */
		/* a zero dim makes the product 0 whatever the others are */
		{ "\"F32\"", "[4294967296, 0, 4294967296]", "[0, 0]", 0, 0 },
	};
	static const struct entry refused[] = {
		/* missing fields */
		{ NULL, "[2]", "[0, 8]", 8, -EBADMSG },
		{ "\"F32\"", NULL, "[0, 8]", 8, -EBADMSG },
		{ "\"F32\"", "[2]", NULL, 8, -EBADMSG },
		/* unknown dtype, dtype not a string */
		{ "\"F128\"", "[2]", "[0, 8]", 8, -EBADMSG },
		{ "\"f32\"", "[2]", "[0, 8]", 8, -EBADMSG },
		{ "4", "[2]", "[0, 8]", 8, -EBADMSG },
		/* bad shapes: negative, fractional, not an array, 9 dims */
		{ "\"F32\"", "[-2]", "[0, 8]", 8, -EBADMSG },
		{ "\"F32\"", "[2.0]", "[0, 8]", 8, -EBADMSG },
		{ "\"F32\"", "2", "[0, 8]", 8, -EBADMSG },
		{ "\"F32\"", "[1,1,1,1,1,1,1,1,2]", "[0, 8]", 8, -EBADMSG },
		/* offsets: three of them, negative, backwards, past the end of the file */
		{ "\"F32\"", "[2]", "[0, 8, 8]", 8, -EBADMSG },
		{ "\"F32\"", "[2]", "[-8, 0]", 8, -EBADMSG },
		{ "\"F32\"", "[0]", "[8, 0]", 8, -EBADMSG },
		{ "\"F32\"", "[2]", "[0, 8]", 4, -EBADMSG },
		/* size mismatch: 3 F32 are 12 bytes, not 8; BF16 [2] is 4 bytes */
		{ "\"F32\"", "[3]", "[0, 8]", 8, -EBADMSG },
		{ "\"BF16\"", "[2]", "[0, 8]", 8, -EBADMSG },
		/* overflow: 2^32 · 2^32 elements; 2^62 · 2 elements fit but 2^63 · 4 bytes do not */
		{ "\"U8\"", "[4294967296, 4294967296]", "[0, 8]", 8, -EOVERFLOW },
		{ "\"F32\"", "[4611686018427387904, 2]", "[0, 8]", 8, -EOVERFLOW },
		/* a number too large for jansson's integers is refused as JSON */
		{ "\"F32\"", "[99999999999999999999]", "[0, 8]", 8, -EBADMSG },
	};
	const struct entry *e;

	for (e = accepted; e < accepted + sizeof(accepted) / sizeof(accepted[0]); e++)
		expect_entry(e->dtype, e->shape, e->offsets, e->data_len, e->code);
	for (e = refused; e < refused + sizeof(refused) / sizeof(refused[0]); e++)
		expect_entry(e->dtype, e->shape, e->offsets, e->data_len, e->code);
	/* an unknown field */
	expect_code("{\"t\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8], "
		    "\"x\": 1}}", 8, -EBADMSG);
}

Test(safetensors, layout_errors)
{
#define E(name, dt, shape, b, e) \
	"\"" name "\": {\"dtype\": \"" dt "\", \"shape\": " shape ", \"data_offsets\": [" #b ", " #e "]}"
	/* two F32 [2] tensors tiling [0, 16) in either key order */
	expect_code("{" E("a", "F32", "[2]", 0, 8) ", " E("b", "F32", "[2]", 8, 16) "}", 16, 0);
	expect_code("{" E("b", "F32", "[2]", 8, 16) ", " E("a", "F32", "[2]", 0, 8) "}", 16, 0);
	/* overlap: [0, 8) and [4, 12) */
	expect_code("{" E("a", "F32", "[2]", 0, 8) ", " E("b", "F32", "[2]", 4, 12) "}", 12,
		    -EBADMSG);
	/* the same bytes twice (aliasing) */
	expect_code("{" E("a", "F32", "[2]", 0, 8) ", " E("b", "F32", "[2]", 0, 8) "}", 8,
		    -EBADMSG);
	/* a zero-sized tensor inside another one */
	expect_code("{" E("a", "F32", "[2]", 0, 8) ", " E("z", "F32", "[0]", 4, 4) "}", 8,
		    -EBADMSG);
	/* a zero-sized tensor at a boundary is fine */
	expect_code("{" E("a", "F32", "[2]", 0, 8) ", " E("z", "F32", "[0]", 8, 8) "}", 8, 0);
	/* hole: [4, 8) belongs to nobody */
	expect_code("{" E("a", "F32", "[1]", 0, 4) ", " E("b", "F32", "[2]", 8, 16) "}", 16,
		    -EBADMSG);
	/* not starting at 0 */
	expect_code("{" E("a", "F32", "[1]", 4, 8) "}", 8, -EBADMSG);
	/* trailing bytes after the last tensor */
	expect_code("{" E("a", "F32", "[1]", 0, 4) "}", 8, -EBADMSG);
	/* a scalar (shape []) is one element */
	expect_code("{" E("s", "F64", "[]", 0, 8) "}", 8, 0);
#undef E
}

Test(safetensors, bad_arguments_and_other_dtypes)
{
	const char *hdr = "{\"i\": {\"dtype\": \"I32\", \"shape\": [2], \"data_offsets\": [0, 8]},"
			  " \"f\": {\"dtype\": \"F32\", \"shape\": [2, 1], \"data_offsets\": [8, 16]}}";
	uint8_t data[16] = { 1, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0x80, 0x3F, 0, 0, 0, 0x40 };
	size_t n;
	uint8_t *img = image(hdr, data, sizeof(data), &n);
	struct bd_st *st = NULL, *sentinel = (struct bd_st *)&n;
	char err[BD_ST_ERR_MAX];

	cr_expect_eq(bd_st_open_mem(img, n, NULL, err), -EINVAL);
	st = sentinel;
	cr_expect_eq(bd_st_open_mem(NULL, 8, &st, err), -EINVAL);
	cr_expect_eq(bd_st_open(NULL, &st, err), -EINVAL);
	cr_expect_eq(st, sentinel);

	cr_assert_eq(bd_st_open_mem(img, n, &st, err), 0, "%s", err);
	const struct bd_st_tensor *ti = bd_st_find_tensor(st, "i"), *tf = bd_st_find_tensor(st, "f");
	cr_assert(ti && tf);
	cr_expect_eq(ti->dtype, BD_ST_I32);
	float x[2] = { 7, 7 };
	cr_expect_eq(bd_st_tensor_to_f32(ti, x), -ENOTSUP);
	cr_expect_eq(bd_st_tensor_rows_f32(ti, 0, 1, x), -ENOTSUP);
	cr_expect(x[0] == 7 && x[1] == 7, "written on error");
	cr_expect_eq(bd_st_tensor_to_f32(NULL, x), -EINVAL);
	cr_expect_eq(bd_st_tensor_to_f32(tf, NULL), -EINVAL);
	/* f is [2, 1]: rows 0..1 of one column: 1.0 (0x3F800000), 2.0 (0x40000000) */
	cr_expect_eq(bd_st_tensor_rows_f32(tf, 1, 2, x), -EINVAL);
	cr_expect_eq(bd_st_tensor_rows_f32(tf, 3, 0, x), -EINVAL);
	cr_expect(x[0] == 7 && x[1] == 7, "written on error");
	cr_assert_eq(bd_st_tensor_rows_f32(tf, 0, 2, x), 0);
	cr_expect(x[0] == 1.0f && x[1] == 2.0f);
	const char *k = NULL, *v = NULL;
	cr_expect_eq(bd_st_metadata_at(st, 0, &k, &v), -EINVAL); /* there is none */
	cr_expect(k == NULL && v == NULL);
	cr_expect_eq(bd_st_n_tensors(NULL), 0);
	cr_expect_null(bd_st_find_tensor(NULL, "i"));
	cr_expect_null(bd_st_find_tensor(st, NULL));
	cr_expect_str_eq(bd_st_dtype_name(BD_ST_BF16), "BF16");
	cr_expect_null(bd_st_dtype_name(BD_ST_DTYPE_COUNT));
	cr_expect_eq(bd_st_dtype_size(BD_ST_F64), 8);
	cr_expect_eq(bd_st_dtype_size(-1), 0);
	bd_st_free(st);
	bd_st_free(NULL);
	free(img);
}

/* A file written by the reference implementation (the PyPI package safetensors 0.8.0,
 * tests/fuzz/make_st_seeds.py, whose docstring lists the values): it orders data by dtype size,
 * not by name, and pads the header with spaces. */
Test(safetensors, reference_writer_file)
{
	const char *d = getenv("BD_SRCDIR");
	char path[512], err[BD_ST_ERR_MAX];
	struct bd_st *st = NULL;

	snprintf(path, sizeof(path), "%s/tests/fuzz/st-corpus/types.safetensors",
		 d && *d ? d : ".");
	int r = bd_st_open(path, &st, err);
	cr_assert_eq(r, 0, "%d %s (run from the repository root or set BD_SRCDIR)", r, err);
	cr_expect_eq(bd_st_n_tensors(st), 6);
	cr_expect_eq(bd_st_data_offset(st) % 8, 0);
	cr_expect_str_eq(bd_st_metadata_get(st, "format"), "pt");
	cr_expect_str_eq(bd_st_metadata_get(st, "source"), "make_st_seeds.py");

	const struct bd_st_tensor *t = bd_st_find_tensor(st, "f32");
	float x[6];
	cr_assert(t && t->dtype == BD_ST_F32 && t->n_dims == 2 && t->shape[0] == 2 &&
		  t->shape[1] == 3);
	cr_assert_eq(bd_st_tensor_to_f32(t, x), 0);
	for (int i = 0; i < 6; i++)
		cr_expect_eq(x[i], (float)i / 2.0f - 1.0f, "f32[%d] = %g", i, x[i]);
	t = bd_st_find_tensor(st, "f16");
	cr_assert(t && t->dtype == BD_ST_F16 && t->n_elements == 3);
	cr_assert_eq(bd_st_tensor_to_f32(t, x), 0);
	cr_expect(x[0] == 1.0f && x[1] == -2.5f && x[2] == 65504.0f, "%g %g %g", x[0], x[1], x[2]);
	t = bd_st_find_tensor(st, "bf16");
	cr_assert(t && t->dtype == BD_ST_BF16 && t->n_elements == 4);
	cr_assert_eq(bd_st_tensor_to_f32(t, x), 0);
	cr_expect(x[0] == 1.0f && x[1] == -2.0f && x[2] == 0.0f && isinf(x[3]) && x[3] > 0);
	t = bd_st_find_tensor(st, "i64");
	cr_assert(t && t->dtype == BD_ST_I64 && t->nbytes == 16);
	const uint8_t *b = t->data; /* −1 then 2^40, little-endian */
	cr_expect(b[0] == 0xff && b[7] == 0xff && b[8] == 0 && b[13] == 1 && b[15] == 0);
	t = bd_st_find_tensor(st, "empty");
	cr_assert(t && t->dtype == BD_ST_U8 && t->n_elements == 0 && t->nbytes == 0);
	t = bd_st_find_tensor(st, "s");
	cr_assert(t && t->dtype == BD_ST_F64 && t->n_dims == 0 && t->n_elements == 1);
	double s;
	memcpy(&s, t->data, 8);
	cr_expect_eq(s, 0.25);
	bd_st_free(st);
}

/* ---- config.json ----------------------------------------------------------------------------- */

static int parse_cfg(const char *json, struct bd_model_hparams *hp, char *err)
{
	return bd_hf_config_parse(json, strlen(json), hp, err);
}

Test(safetensors, config_llama)
{
	/* SmolLM2-135M's shape: head_dim = 576 / 9 = 64 */
	const char *cfg = "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\","
			  " \"hidden_size\": 576, \"intermediate_size\": 1536,"
			  " \"num_attention_heads\": 9, \"num_key_value_heads\": 3,"
			  " \"num_hidden_layers\": 30, \"rms_norm_eps\": 1e-05,"
			  " \"rope_theta\": 100000, \"vocab_size\": 49152,"
			  " \"max_position_embeddings\": 8192, \"tie_word_embeddings\": true,"
			  " \"attention_bias\": false, \"mlp_bias\": false, \"hidden_act\": \"silu\","
			  " \"rope_scaling\": null, \"torch_dtype\": \"bfloat16\"}";
	struct bd_model_hparams hp;
	char err[BD_MODEL_ERR_MAX];
	int r = parse_cfg(cfg, &hp, err);
	cr_assert_eq(r, 0, "%d %s", r, err);
	/* HF keeps q/k rows unpermuted: rotate_half pairs (i, i + d/2), NEOX */
	td_expect_hparams(&hp, &(struct bd_model_hparams){
		.arch = BD_ARCH_LLAMA, .arch_name = "llama", .n_layers = 30, .n_embd = 576,
		.n_ff = 1536, .n_heads = 9, .n_kv_heads = 3, .head_dim = 64, .head_dim_v = 64,
		.n_rot = 64, .rope_style = BD_ROPE_NEOX, .rope_base = 100000.0f, .norm_eps = 1e-5f,
		.n_ctx_train = 8192, .n_vocab = 49152, .tied_embeddings = true },
		"SmolLM2 config");
}

Test(safetensors, config_qwen_defaults_and_options)
{
	struct bd_model_hparams hp;
	char err[BD_MODEL_ERR_MAX];
	/* Qwen3 without head_dim: transformers' default 128, not 256 / 4; defaults for the rest */
	int r = parse_cfg("{\"architectures\": [\"Qwen3ForCausalLM\"], \"hidden_size\": 256,"
			  " \"intermediate_size\": 512, \"num_attention_heads\": 4,"
			  " \"num_hidden_layers\": 2, \"vocab_size\": 1000}", &hp, err);
	cr_assert_eq(r, 0, "%d %s", r, err);
	cr_expect_eq(hp.arch, BD_ARCH_QWEN3);
	cr_expect_eq(hp.head_dim, 128);
	cr_expect_eq(hp.n_kv_heads, 4);
	cr_expect_eq(hp.norm_eps, 1e-6f);
	cr_expect_eq(hp.rope_base, 10000.0f);
	cr_expect_eq(hp.n_ctx_train, 32768);
	cr_expect(hp.qk_norm && !hp.attn_bias && !hp.tied_embeddings);
	cr_expect_eq(hp.rope_style, BD_ROPE_NEOX);

	/* Qwen2 from model_type alone: q/k/v biases; head_dim 896 / 14 = 64; null = absent;
	 * partial rotary 0.5 → 32 rotated dims */
	r = parse_cfg("{\"model_type\": \"qwen2\", \"hidden_size\": 896,"
		      " \"intermediate_size\": 4864, \"num_attention_heads\": 14,"
		      " \"num_key_value_heads\": 2, \"num_hidden_layers\": 24,"
		      " \"vocab_size\": 151936, \"rope_theta\": 1000000.0, \"head_dim\": null,"
		      " \"partial_rotary_factor\": 0.5, \"use_sliding_window\": false,"
		      " \"rope_scaling\": {\"rope_type\": \"default\"}}", &hp, err);
	cr_assert_eq(r, 0, "%d %s", r, err);
	cr_expect_eq(hp.arch, BD_ARCH_QWEN2);
	cr_expect(hp.attn_bias && !hp.qk_norm);
	cr_expect_eq(hp.head_dim, 64);
	cr_expect_eq(hp.n_rot, 32);
	cr_expect_eq(hp.rope_base, 1e6f);

	/* transformers 5: rope_parameters carries theta */
	r = parse_cfg("{\"architectures\": [\"Qwen3ForCausalLM\"], \"hidden_size\": 64,"
		      " \"intermediate_size\": 128, \"num_attention_heads\": 4, \"head_dim\": 16,"
		      " \"num_hidden_layers\": 2, \"vocab_size\": 100, \"layer_types\":"
		      " [\"full_attention\", \"full_attention\"], \"rope_parameters\":"
		      " {\"rope_type\": \"default\", \"rope_theta\": 500000}}", &hp, err);
	cr_assert_eq(r, 0, "%d %s", r, err);
	cr_expect_eq(hp.head_dim, 16);
	cr_expect_eq(hp.rope_base, 500000.0f);
}

#define BASE_CFG(extra)                                                                    \
	"{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64,"                  \
	" \"intermediate_size\": 128, \"num_attention_heads\": 4, \"num_key_value_heads\": 2," \
	" \"num_hidden_layers\": 2, \"vocab_size\": 100" extra "}"

static void expect_cfg(const char *json, int code)
{
	struct bd_model_hparams hp, before;
	char err[BD_MODEL_ERR_MAX];
	memset(&hp, 0x5a, sizeof(hp));
	before = hp;
	int r = parse_cfg(json, &hp, err);
	cr_expect_eq(r, code, "%s: got %d (%s)", json, r, r ? err : "");
	if (code < 0) {
		cr_expect_eq(memcmp(&hp, &before, sizeof(hp)), 0, "%s: hparams written", json);
		cr_expect(err[0], "%s: no message", json);
	}
}

Test(safetensors, config_errors)
{
	expect_cfg(BASE_CFG(""), 0);
	/* unsupported RoPE scaling kinds, architecture and options */
	expect_cfg(BASE_CFG(", \"rope_scaling\": {\"type\": \"linear\", \"factor\": 2.0}"),
		   -ENOTSUP);
	expect_cfg(BASE_CFG(", \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0}"),
		   -ENOTSUP);
	expect_cfg(BASE_CFG(", \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0}"),
		   -ENOTSUP);
	expect_cfg(BASE_CFG(", \"rope_scaling\": {\"rope_type\": \"dynamic\"}"), -ENOTSUP);
	expect_cfg(BASE_CFG(", \"rope_parameters\": {\"rope_type\": \"longrope\"}"), -ENOTSUP);
	expect_cfg(BASE_CFG(", \"rope_scaling\": {\"rope_type\": \"default\"}"), 0);
	expect_cfg(BASE_CFG(", \"rope_scaling\": \"linear\""), -EBADMSG);
	expect_cfg(BASE_CFG(", \"rope_scaling\": {\"factor\": 2.0}"), -EBADMSG);
	expect_cfg(BASE_CFG(", \"attention_bias\": true"), -ENOTSUP);
	expect_cfg(BASE_CFG(", \"mlp_bias\": true"), -ENOTSUP);
	expect_cfg(BASE_CFG(", \"hidden_act\": \"gelu\""), -ENOTSUP);
	expect_cfg(BASE_CFG(", \"use_sliding_window\": true"), -ENOTSUP);
	expect_cfg(BASE_CFG(", \"layer_types\": [\"full_attention\", \"sliding_attention\"]"),
		   -ENOTSUP);
	expect_cfg("{\"architectures\": [\"MistralForCausalLM\"], \"hidden_size\": 64}", -ENOTSUP);
	expect_cfg("{\"model_type\": \"gemma\", \"hidden_size\": 64}", -ENOTSUP);
	/* malformed */
	expect_cfg("{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"qwen2\"}",
		   -EBADMSG);
	expect_cfg("{\"hidden_size\": 64}", -EBADMSG); /* no architecture at all */
	expect_cfg("{\"architectures\": \"LlamaForCausalLM\"}", -EBADMSG);
	expect_cfg("{\"architectures\": []}", -EBADMSG);
	expect_cfg("[1]", -EBADMSG);
	expect_cfg("{\"architectures\": [\"LlamaForCausalLM\"],", -EBADMSG);
	expect_cfg(BASE_CFG(", \"rope_theta\": 1e5, \"rope_theta\": 1e6"), -EBADMSG);
	expect_cfg("{\"architectures\": [\"LlamaForCausalLM\"], \"intermediate_size\": 128,"
		   " \"num_attention_heads\": 4, \"num_hidden_layers\": 2, \"vocab_size\": 100}",
		   -EBADMSG); /* hidden_size missing */
	expect_cfg(BASE_CFG(", \"max_position_embeddings\": \"4096\""), -EBADMSG);
	expect_cfg(BASE_CFG(", \"max_position_embeddings\": 4096.5"), -EBADMSG);
	expect_cfg(BASE_CFG(", \"max_position_embeddings\": 0"), -EBADMSG);
	expect_cfg(BASE_CFG(", \"max_position_embeddings\": 99999999999"), -EBADMSG);
	expect_cfg(BASE_CFG(", \"num_key_value_heads\": 3"), -EBADMSG); /* 4 % 3 */
	expect_cfg(BASE_CFG(", \"rms_norm_eps\": -1e-6"), -EBADMSG);
	expect_cfg(BASE_CFG(", \"rms_norm_eps\": 1e-60"), -EBADMSG); /* 0 in FP32 */
	expect_cfg(BASE_CFG(", \"rope_theta\": \"1e4\""), -EBADMSG);
	expect_cfg(BASE_CFG(", \"tie_word_embeddings\": 1"), -EBADMSG);
	expect_cfg(BASE_CFG(", \"head_dim\": 15"), -EBADMSG); /* odd */
	expect_cfg(BASE_CFG(", \"partial_rotary_factor\": 1.5"), -EBADMSG);
	/* hidden 66 over 4 heads and no head_dim */
	expect_cfg("{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 66,"
		   " \"intermediate_size\": 128, \"num_attention_heads\": 4,"
		   " \"num_hidden_layers\": 2, \"vocab_size\": 100}", -EBADMSG);

	struct bd_model_hparams hp;
	char err[BD_MODEL_ERR_MAX];
	cr_expect_eq(bd_hf_config_parse(NULL, 0, &hp, err), -EINVAL);
	cr_expect_eq(bd_hf_config_parse("{}", 2, NULL, err), -EINVAL);
	cr_expect_eq(bd_hf_config_load("/nonexistent/config.json", &hp, err), -ENOENT);
	cr_expect(strstr(err, "/nonexistent/config.json") != NULL, "%s", err);
}

/* ---- tiny checkpoints ------------------------------------------------------------------------ */

static uint64_t rng_state;

static float rng_sym(float a)
{
	rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
	return (float)(((double)(rng_state >> 11) * 0x1.0p-53 * 2.0 - 1.0) * a);
}

/* Storage dtypes, and a rounding of FP32 values onto each one's grid done here, not by the
 * library: BF16 keeps 8 significant bits (the upper 16 bits of a normal FP32, computed with
 * frexp: gcc 12 -O1 with ASan dropped a bit-masking version); F16 here holds k / 1024 for
 * |k| < 2048, which F16 represents exactly (11 significant bits). */
enum sdt { S_F32, S_F16, S_BF16, S_I32 };

static float on_grid(enum sdt t, float v)
{
	int e;
	switch (t) {
	case S_BF16: {
		/* keep 8 significant bits, rounding toward zero: the upper 16 bits of v */
		double m = frexp((double)v, &e); /* |m| in [0.5, 1) */
		return (float)ldexp(trunc(m * 256.0) / 256.0, e);
	}
	case S_F16: {
		double k = nearbyint((double)v * 1024.0);
		cr_assert(fabs(k) < 2048.0);
		return (float)(k / 1024.0);
	}
	default:
		return v;
	}
}

/* F16 bits of a value on the F16 grid above (zero or normal). */
static uint16_t f16_bits(float v)
{
	if (v == 0.0f)
		return signbit(v) ? 0x8000 : 0;
	int e;
	double m = frexp(fabs((double)v), &e); /* |v| = m · 2^e, m in [0.5, 1) */
	int ef = e - 1 + 15;
	double frac = (m * 2.0 - 1.0) * 1024.0;
	cr_assert(ef >= 1 && ef <= 30 && frac == floor(frac), "%g is not an F16 normal", v);
	return (uint16_t)((v < 0 ? 0x8000 : 0) | ef << 10 | (int)frac);
}

struct entry {
	char name[96];
	enum sdt dt;
	int nd;
	uint64_t shape[2];
	const float *x;
	int file; /* which shard */
};

struct ckpt {
	struct entry e[256];
	int n;
};

static void add(struct ckpt *c, const char *name, enum sdt dt, uint64_t rows, uint64_t cols,
		const float *x)
{
	cr_assert_lt(c->n, 256);
	struct entry *e = &c->e[c->n++];
	snprintf(e->name, sizeof(e->name), "%s", name);
	e->dt = dt;
	e->nd = rows ? 2 : 1;
	e->shape[0] = rows ? rows : cols;
	e->shape[1] = cols;
	e->x = x;
	e->file = 0;
}

static struct entry *entry_named(struct ckpt *c, const char *name)
{
	for (int i = 0; i < c->n; i++)
		if (strcmp(c->e[i].name, name) == 0)
			return &c->e[i];
	cr_assert_fail("no entry %s", name);
	return NULL;
}

static size_t dt_size(enum sdt t)
{
	return t == S_F16 || t == S_BF16 ? 2 : 4;
}

static const char *dt_name(enum sdt t)
{
	static const char *n[] = { "F32", "F16", "BF16", "I32" };
	return n[t];
}

/* Write the entries of shard `file` as one safetensors file (header by jansson, padded with
 * spaces to a multiple of 8 as the reference writer does). */
static void write_shard(const struct ckpt *c, int file, const char *path)
{
	json_t *h = json_object();
	json_object_set_new(h, "__metadata__", json_pack("{s:s}", "format", "pt"));
	uint64_t off = 0;
	for (int i = 0; i < c->n; i++) {
		const struct entry *e = &c->e[i];
		if (e->file != file)
			continue;
		uint64_t n = e->nd == 2 ? e->shape[0] * e->shape[1] : e->shape[0];
		json_t *shape = e->nd == 2 ? json_pack("[II]", (json_int_t)e->shape[0],
						       (json_int_t)e->shape[1])
					   : json_pack("[I]", (json_int_t)e->shape[0]);
		json_object_set_new(h, e->name,
				    json_pack("{s:s, s:o, s:[II]}", "dtype", dt_name(e->dt),
					      "shape", shape, "data_offsets", (json_int_t)off,
					      (json_int_t)(off + n * dt_size(e->dt))));
		off += n * dt_size(e->dt);
	}
	char *txt = json_dumps(h, JSON_COMPACT);
	json_decref(h);
	size_t hl = strlen(txt), pad = (8 - hl % 8) % 8;
	uint8_t *buf = calloc(1, 8 + hl + pad + off);
	cr_assert_not_null(buf);
	for (int i = 0; i < 8; i++)
		buf[i] = (uint8_t)((hl + pad) >> (8 * i));
	memcpy(buf + 8, txt, hl);
	memset(buf + 8 + hl, ' ', pad);
	free(txt);
	uint8_t *p = buf + 8 + hl + pad;
	for (int i = 0; i < c->n; i++) {
		const struct entry *e = &c->e[i];
		if (e->file != file)
			continue;
		uint64_t n = e->nd == 2 ? e->shape[0] * e->shape[1] : e->shape[0];
		for (uint64_t j = 0; j < n; j++) {
			uint32_t u;
			memcpy(&u, &e->x[j], 4);
			uint32_t bits = e->dt == S_F32 ? u
				      : e->dt == S_BF16 ? u >> 16
				      : e->dt == S_F16 ? f16_bits(e->x[j])
				      : (uint32_t)(int32_t)e->x[j];
			for (size_t b = 0; b < dt_size(e->dt); b++)
				*p++ = (uint8_t)(bits >> (8 * b));
		}
	}
	write_bytes(path, buf, 8 + hl + pad + off);
	free(buf);
}

/* Shards 0..n_files−1 as model-0000k-of-0000n.safetensors plus the index (n_files > 1), or one
 * model.safetensors. */
static void write_ckpt(const struct ckpt *c, int n_files, const char *dir)
{
	char path[512];
	if (n_files == 1) {
		snprintf(path, sizeof(path), "%s/model.safetensors", dir);
		write_shard(c, 0, path);
		return;
	}
	json_t *map = json_object();
	for (int f = 0; f < n_files; f++) {
		char name[64];
		snprintf(name, sizeof(name), "model-%05d-of-%05d.safetensors", f + 1, n_files);
		snprintf(path, sizeof(path), "%s/%s", dir, name);
		write_shard(c, f, path);
		for (int i = 0; i < c->n; i++)
			if (c->e[i].file == f)
				json_object_set_new(map, c->e[i].name, json_string(name));
	}
	json_t *idx = json_pack("{s:{s:I}, s:o}", "metadata", "total_size", (json_int_t)0,
				"weight_map", map);
	snprintf(path, sizeof(path), "%s/model.safetensors.index.json", dir);
	cr_assert_eq(json_dump_file(idx, path, JSON_INDENT(2)), 0);
	json_decref(idx);
}

static void write_text(const char *dir, const char *name, const char *text)
{
	char path[512];
	snprintf(path, sizeof(path), "%s/%s", dir, name);
	write_bytes(path, text, strlen(text));
}

/* A tiny model of arch (td_tiny_hparams, the shape of test_model.c's tiny models: E 48, F 40,
 * Hq 4, Hkv 2, d 32, V 37, 2 layers), its weights random and on the grid of the dtype each is stored in, and the
 * checkpoint entries naming them (HF names) and its config.json text. */
struct tiny {
	struct bd_model *m;
	struct ckpt ck;
	char config[1024];
	float inv_freq[16]; /* a tensor HF checkpoints may carry and the loader ignores */
};

static void fill_grid(float *w, size_t n, float center, float a, enum sdt t)
{
	for (size_t i = 0; i < n; i++)
		w[i] = on_grid(t, center + rng_sym(a));
}

static struct tiny *tiny(enum bd_arch arch)
{
	struct bd_model_hparams hp = td_tiny_hparams(arch);
	static const char *names[] = { "llama", "qwen2", "qwen3" };
	static const char *classes[] = { "LlamaForCausalLM", "Qwen2ForCausalLM",
					 "Qwen3ForCausalLM" };
	snprintf(hp.arch_name, sizeof(hp.arch_name), "%s", names[arch]);
	struct tiny *t = calloc(1, sizeof(*t));
	cr_assert_not_null(t);
	cr_assert_eq(bd_model_alloc(&hp, &t->m), 0);
	snprintf(t->config, sizeof(t->config),
		 "{\"architectures\": [\"%s\"], \"model_type\": \"%s\", \"hidden_size\": 48,"
		 " \"intermediate_size\": 40, \"num_attention_heads\": 4,"
		 " \"num_key_value_heads\": 2, \"head_dim\": 32, \"num_hidden_layers\": 2,"
		 " \"rms_norm_eps\": 1e-05, \"rope_theta\": 10000.0, \"vocab_size\": 37,"
		 " \"max_position_embeddings\": 512, \"tie_word_embeddings\": %s,"
		 " \"hidden_act\": \"silu\", \"rope_scaling\": null, \"torch_dtype\": \"bfloat16\"}",
		 classes[arch], names[arch], hp.tied_embeddings ? "true" : "false");

	struct bd_model *m = t->m;
	struct ckpt *c = &t->ck;
	size_t E = 48, F = 40, qd = 4 * 32, kd = 2 * 32, V = 37, d = 32;
	char nm[96];
	rng_state = 0x5851f42d4c957f2dull + (uint64_t)arch;

	fill_grid(m->tok_embd.f32, V * E, 0.0f, 1.0f, S_BF16);
	add(c, "model.embed_tokens.weight", S_BF16, V, E, m->tok_embd.f32);
	fill_grid(m->output_norm, E, 1.0f, 0.2f, S_F32);
	add(c, "model.norm.weight", S_F32, 0, E, m->output_norm);
	if (!hp.tied_embeddings) {
		fill_grid(m->output.f32, V * E, 0.0f, 0.3f, S_F32);
		add(c, "lm_head.weight", S_F32, V, E, m->output.f32);
	}
#define W(suffix, dt, rows, cols, ptr, center, a)                                           \
	do {                                                                               \
		fill_grid(ptr, (rows ? rows : 1) * cols, center, a, dt);                   \
		snprintf(nm, sizeof(nm), "model.layers.%d.%s", l, suffix);                 \
		add(c, nm, dt, rows, cols, ptr);                                           \
	} while (0)
	for (int l = 0; l < 2; l++) {
		struct bd_model_layer *ly = &m->layers[l];
		W("input_layernorm.weight", S_F32, 0, E, ly->attn_norm, 1.0f, 0.2f);
		W("self_attn.q_proj.weight", S_F16, qd, E, ly->wq.f32, 0.0f, 0.3f);
		W("self_attn.k_proj.weight", S_F16, kd, E, ly->wk.f32, 0.0f, 0.3f);
		W("self_attn.v_proj.weight", S_F16, kd, E, ly->wv.f32, 0.0f, 0.3f);
		W("self_attn.o_proj.weight", S_BF16, E, qd, ly->wo.f32, 0.0f, 0.15f);
		if (hp.attn_bias) {
			W("self_attn.q_proj.bias", S_F16, 0, qd, ly->bq, 0.0f, 0.5f);
			W("self_attn.k_proj.bias", S_F32, 0, kd, ly->bk, 0.0f, 0.5f);
			W("self_attn.v_proj.bias", S_BF16, 0, kd, ly->bv, 0.0f, 0.5f);
		}
		if (hp.qk_norm) {
			W("self_attn.q_norm.weight", S_BF16, 0, d, ly->q_norm, 1.0f, 0.3f);
			W("self_attn.k_norm.weight", S_F16, 0, d, ly->k_norm, 1.0f, 0.3f);
		}
		W("post_attention_layernorm.weight", S_F32, 0, E, ly->ffn_norm, 1.0f, 0.2f);
		W("mlp.gate_proj.weight", S_BF16, F, E, ly->w_gate.f32, 0.0f, 0.3f);
		W("mlp.up_proj.weight", S_F16, F, E, ly->w_up.f32, 0.0f, 0.3f);
		W("mlp.down_proj.weight", S_BF16, E, F, ly->w_down.f32, 0.0f, 0.3f);
	}
#undef W
	for (int i = 0; i < 16; i++)
		t->inv_freq[i] = (float)pow(10000.0, -2.0 * i / 32);
	add(c, "model.layers.0.self_attn.rotary_emb.inv_freq", S_F32, 0, 16, t->inv_freq);
	return t;
}

static void tiny_free(struct tiny *t)
{
	bd_model_free(t->m);
	free(t);
}

/* Every weight bit for bit. */
static void expect_same_weights(const struct bd_model *a, const struct bd_model *b)
{
	const struct bd_model_hparams *h = &a->hp;
	size_t E = (size_t)h->n_embd, F = (size_t)h->n_ff, V = (size_t)h->n_vocab;
	size_t d = (size_t)h->head_dim, qd = (size_t)h->n_heads * d, kd = (size_t)h->n_kv_heads * d;
#define SAME(x, n)                                                                         \
	cr_expect((a->x == NULL) == (b->x == NULL) &&                                      \
		  (!a->x || memcmp(a->x, b->x, sizeof(float) * (n)) == 0), #x " differs")
	SAME(tok_embd.f32, V * E);
	SAME(output_norm, E);
	SAME(output.f32, V * E);
	cr_expect_eq(a->output.f32 == a->tok_embd.f32, b->output.f32 == b->tok_embd.f32);
	for (int l = 0; l < h->n_layers; l++) {
		SAME(layers[l].attn_norm, E);
		SAME(layers[l].wq.f32, qd * E);
		SAME(layers[l].wk.f32, kd * E);
		SAME(layers[l].wv.f32, kd * E);
		SAME(layers[l].wo.f32, E * qd);
		SAME(layers[l].bq, qd);
		SAME(layers[l].bk, kd);
		SAME(layers[l].bv, kd);
		SAME(layers[l].q_norm, d);
		SAME(layers[l].k_norm, d);
		SAME(layers[l].ffn_norm, E);
		SAME(layers[l].w_gate.f32, F * E);
		SAME(layers[l].w_up.f32, F * E);
		SAME(layers[l].w_down.f32, E * F);
	}
#undef SAME
}

#define N_PROMPT 9
#define N_DECODE 4

/* Logits of a prefill of N_PROMPT tokens and N_DECODE decode steps: [1 + N_DECODE][V]. */
static float *run_logits(const struct bd_model *m, const char *kv)
{
	const struct bd_kvcfg *cfg = bd_kvcfg_find(kv);
	struct bd_seq_opts o = { .max_tokens = N_PROMPT + N_DECODE };
	struct bd_seq *s = NULL;
	char err[BD_MODEL_ERR_MAX];
	int V = m->hp.n_vocab;
	int32_t toks[N_PROMPT + N_DECODE];
	for (int i = 0; i < N_PROMPT + N_DECODE; i++)
		toks[i] = (int32_t)((i * 11 + 3) % V);
	float *lg = malloc(sizeof(float) * (size_t)V * (1 + N_DECODE));
	cr_assert_not_null(cfg);
	cr_assert_eq(bd_seq_new(m, cfg, &o, &s, err), 0, "%s", err);
	cr_assert_eq(bd_model_prefill(m, s, toks, N_PROMPT, lg), 0);
	for (int i = 0; i < N_DECODE; i++)
		cr_assert_eq(bd_model_decode(m, s, toks[N_PROMPT + i], lg + (size_t)V * (1 + i)),
			     0);
	bd_seq_free(s);
	return lg;
}

static void expect_same_hp(const struct bd_model_hparams *a, const struct bd_model_hparams *b)
{
	cr_expect_eq(a->arch, b->arch);
	cr_expect_str_eq(a->arch_name, b->arch_name);
	cr_expect_eq(a->n_layers, b->n_layers);
	cr_expect_eq(a->n_embd, b->n_embd);
	cr_expect_eq(a->n_ff, b->n_ff);
	cr_expect_eq(a->n_heads, b->n_heads);
	cr_expect_eq(a->n_kv_heads, b->n_kv_heads);
	cr_expect_eq(a->head_dim, b->head_dim);
	cr_expect_eq(a->head_dim_v, b->head_dim_v);
	cr_expect_eq(a->n_rot, b->n_rot);
	cr_expect_eq(a->rope_style, b->rope_style);
	cr_expect_eq(a->rope_base, b->rope_base);
	cr_expect_eq(a->norm_eps, b->norm_eps);
	cr_expect_eq(a->n_ctx_train, b->n_ctx_train);
	cr_expect_eq(a->n_vocab, b->n_vocab);
	cr_expect_eq(a->qk_norm, b->qk_norm);
	cr_expect_eq(a->attn_bias, b->attn_bias);
	cr_expect_eq(a->tied_embeddings, b->tied_embeddings);
}

static void expect_same_model(const struct bd_model *ref, const struct bd_model *got)
{
	expect_same_hp(&ref->hp, &got->hp);
	expect_same_weights(ref, got);
	size_t n = (size_t)ref->hp.n_vocab * (1 + N_DECODE);
	for (int k = 0; k < 2; k++) {
		const char *kv = k ? "bitdecoding-nvfp4" : "bf16";
		float *a = run_logits(ref, kv), *b = run_logits(got, kv);
		cr_expect_eq(memcmp(a, b, sizeof(float) * n), 0, "%s logits differ", kv);
		free(a);
		free(b);
	}
}

Test(safetensors, hf_tiny_models_match_direct_fill, .timeout = 120)
{
	for (int arch = BD_ARCH_LLAMA; arch <= BD_ARCH_QWEN3; arch++) {
		struct tiny *t = tiny((enum bd_arch)arch);
		struct bd_model *m = NULL;
		char err[BD_MODEL_ERR_MAX];
		int r;

		make_tmpdir();
		write_text(tmpdir, "config.json", t->config);
		if (arch == BD_ARCH_QWEN3) {
			/* three shards behind an index, tensors dealt round robin */
			for (int i = 0; i < t->ck.n; i++)
				t->ck.e[i].file = i % 3;
			write_ckpt(&t->ck, 3, tmpdir);
		} else {
			write_ckpt(&t->ck, 1, tmpdir);
		}
		r = bd_model_from_hf(tmpdir, &m, err);
		cr_assert_eq(r, 0, "arch %d: %d %s", arch, r, err);
		cr_expect_str_empty(err);
		expect_same_model(t->m, m);
		bd_model_free(m);

		/* the explicit-files form: config + the one file, or config + the index */
		char cfg[512], w[512];
		snprintf(cfg, sizeof(cfg), "%s/config.json", tmpdir);
		snprintf(w, sizeof(w), "%s/%s", tmpdir,
			 arch == BD_ARCH_QWEN3 ? "model.safetensors.index.json" : "model.safetensors");
		const char *paths[] = { w };
		m = NULL;
		r = bd_model_from_hf_files(cfg, paths, 1, &m, err);
		cr_assert_eq(r, 0, "arch %d: %d %s", arch, r, err);
		expect_same_weights(t->m, m);
		bd_model_free(m);
		rm_tmpdir();
		tiny_free(t);
	}
}

Test(safetensors, hf_shard_files_listed_explicitly)
{
	struct tiny *t = tiny(BD_ARCH_QWEN2);
	struct bd_model *m = NULL;
	char err[BD_MODEL_ERR_MAX], cfg[512], p0[512], p1[512];

	make_tmpdir();
	write_text(tmpdir, "config.json", t->config);
	for (int i = 0; i < t->ck.n; i++)
		t->ck.e[i].file = i < t->ck.n / 2 ? 0 : 1;
	write_ckpt(&t->ck, 2, tmpdir);
	snprintf(cfg, sizeof(cfg), "%s/config.json", tmpdir);
	snprintf(p0, sizeof(p0), "%s/model-00001-of-00002.safetensors", tmpdir);
	snprintf(p1, sizeof(p1), "%s/model-00002-of-00002.safetensors", tmpdir);
	const char *both[] = { p1, p0 };
	int r = bd_model_from_hf_files(cfg, both, 2, &m, err);
	cr_assert_eq(r, 0, "%d %s", r, err);
	expect_same_weights(t->m, m);
	bd_model_free(m);

	/* one shard only: the other half is missing */
	struct bd_model *sentinel = (struct bd_model *)&r;
	m = sentinel;
	cr_expect_eq(bd_model_from_hf_files(cfg, both, 1, &m, err), -EBADMSG);
	cr_expect(strstr(err, "missing") != NULL, "%s", err);
	/* the same shard twice: its tensors are in two files */
	const char *twice[] = { p0, p1, p0 };
	cr_expect_eq(bd_model_from_hf_files(cfg, twice, 3, &m, err), -EBADMSG);
	cr_expect(strstr(err, "both") != NULL, "%s", err);
	cr_expect_eq(m, sentinel);
	rm_tmpdir();
	tiny_free(t);
}

/* convert_hf_to_gguf.py's permute() of Llama's q/k rows, per head of d rows:
 * reshape(n_head, 2, d/2, E).swapaxes(1, 2): new row 2j + s = old row s·d/2 + j. */
static void permute_rows(float *w, int n_head, int d, int E)
{
	float *tmp = malloc(sizeof(float) * (size_t)d * (size_t)E);
	for (int h = 0; h < n_head; h++) {
		float *blk = w + (size_t)h * (size_t)d * (size_t)E;
		for (int j = 0; j < d / 2; j++)
			for (int s = 0; s < 2; s++)
				memcpy(tmp + (size_t)(2 * j + s) * (size_t)E,
				       blk + (size_t)(s * d / 2 + j) * (size_t)E,
				       sizeof(float) * (size_t)E);
		memcpy(blk, tmp, sizeof(float) * (size_t)d * (size_t)E);
	}
	free(tmp);
}

Test(safetensors, hf_llama_rope_is_neox_of_unpermuted_rows, .timeout = 60)
{
	struct tiny *t = tiny(BD_ARCH_LLAMA);
	struct bd_model *hf = NULL;
	char err[BD_MODEL_ERR_MAX];

	make_tmpdir();
	write_text(tmpdir, "config.json", t->config);
	write_ckpt(&t->ck, 1, tmpdir);
	cr_assert_eq(bd_model_from_hf(tmpdir, &hf, err), 0, "%s", err);
	rm_tmpdir();

	/* what llama.cpp holds for the same checkpoint: permuted rows, NORM RoPE */
	struct bd_model *gg = t->m;
	gg->hp.rope_style = BD_ROPE_NORM;
	for (int l = 0; l < 2; l++) {
		permute_rows(gg->layers[l].wq.f32, 4, 32, 48);
		permute_rows(gg->layers[l].wk.f32, 2, 32, 48);
	}
	float *a = run_logits(hf, "bf16"), *b = run_logits(gg, "bf16");
	size_t n = 37 * (1 + N_DECODE);
	double worst = 0.0, big = 0.0;
	for (size_t i = 0; i < n; i++) {
		worst = fmax(worst, fabs((double)a[i] - (double)b[i]));
		big = fmax(big, fabs((double)a[i]));
	}
	/* only the order of the q·k sums differs */
	cr_expect_lt(worst, 1e-4 * big, "NEOX on HF rows vs NORM on permuted rows: %g of %g",
		     worst, big);

	/* control: NORM RoPE on the unpermuted HF rows is a different model */
	hf->hp.rope_style = BD_ROPE_NORM;
	float *c = run_logits(hf, "bf16");
	double off = 0.0;
	for (size_t i = 0; i < n; i++)
		off = fmax(off, fabs((double)c[i] - (double)b[i]));
	cr_expect_gt(off, 1e-2 * big, "the check cannot tell the RoPE styles apart: %g", off);
	free(a);
	free(b);
	free(c);
	bd_model_free(hf);
	tiny_free(t);
}

Test(safetensors, hf_shard_matches_shard_of)
{
	struct tiny *t = tiny(BD_ARCH_QWEN3);
	struct bd_model *sh = NULL, *ref = NULL;
	char err[BD_MODEL_ERR_MAX];

	make_tmpdir();
	write_text(tmpdir, "config.json", t->config);
	write_ckpt(&t->ck, 1, tmpdir);
	int r = bd_model_from_hf_shard(tmpdir, 1, 2, &sh, err);
	cr_assert_eq(r, 0, "%d %s", r, err);
	cr_assert_eq(bd_model_shard_of(t->m, 1, 2, &ref), 0);
	/* rank 1 of 2: KV head 1 (query heads 2, 3), MLP columns 20..39, no LM head */
	cr_expect_eq(sh->shard.rank, 1);
	cr_expect_eq(sh->shard.tp, 2);
	cr_expect_eq(sh->shard.kv_head0, 1);
	cr_expect_eq(sh->shard.n_kv_heads, 1);
	cr_expect_eq(sh->shard.head0, 2);
	cr_expect_eq(sh->shard.ff0, 20);
	cr_expect_eq(sh->shard.n_ff, 20);
	cr_expect(!sh->shard.lm_head);
	cr_expect_null(sh->output.f32);
	cr_expect_eq(sh->mem_bytes, ref->mem_bytes);
	cr_expect_eq(memcmp(sh->mem, ref->mem, ref->mem_bytes), 0, "shard weights differ");
	bd_model_free(sh);
	bd_model_free(ref);

	/* tp 1 is the whole model */
	sh = NULL;
	cr_assert_eq(bd_model_from_hf_shard(tmpdir, 0, 1, &sh, err), 0, "%s", err);
	expect_same_weights(t->m, sh);
	bd_model_free(sh);

	struct bd_model *sentinel = (struct bd_model *)&r;
	sh = sentinel;
	cr_expect_eq(bd_model_from_hf_shard(tmpdir, 2, 2, &sh, err), -EINVAL);
	cr_expect_eq(bd_model_from_hf_shard(tmpdir, 0, 3, &sh, err), -EINVAL); /* 2 KV heads */
	cr_expect_eq(sh, sentinel);
	rm_tmpdir();
	tiny_free(t);
}

/* Load tmpdir and expect code, *ret untouched, and a message containing `what`. */
static void expect_load(int code, const char *what)
{
	struct bd_model *sentinel = (struct bd_model *)&code, *m = sentinel;
	char err[BD_MODEL_ERR_MAX] = "";
	int r = bd_model_from_hf(tmpdir, &m, err);
	cr_expect_eq(r, code, "got %d (%s), want %d", r, err, code);
	if (code < 0)
		cr_expect_eq(m, sentinel, "*ret written on error");
	if (r == 0 && m != sentinel)
		bd_model_free(m);
	cr_expect(strstr(err, what) != NULL, "message '%s' lacks '%s'", err, what);
}

Test(safetensors, hf_load_errors, .timeout = 60)
{
	struct tiny *t = tiny(BD_ARCH_QWEN2);
	struct ckpt saved = t->ck;
	char path[512];

	make_tmpdir();
	expect_load(-ENOENT, "config.json"); /* empty directory */
	write_text(tmpdir, "config.json", t->config);
	expect_load(-ENOENT, "model.safetensors");

	/* a tensor missing */
	t->ck = saved;
	t->ck.e[5] = t->ck.e[--t->ck.n];
	write_ckpt(&t->ck, 1, tmpdir);
	expect_load(-EBADMSG, saved.e[5].name);

	/* o_proj stored transposed: [Hq·d, E] = [128, 48] instead of [48, 128] */
	t->ck = saved;
	struct entry *o = entry_named(&t->ck, "model.layers.1.self_attn.o_proj.weight");
	o->shape[0] = 128;
	o->shape[1] = 48;
	write_ckpt(&t->ck, 1, tmpdir);
	expect_load(-EBADMSG, "[48, 128]");

	/* a norm stored as a matrix */
	t->ck = saved;
	struct entry *nrm = entry_named(&t->ck, "model.norm.weight");
	nrm->nd = 2;
	nrm->shape[0] = 1;
	nrm->shape[1] = 48;
	write_ckpt(&t->ck, 1, tmpdir);
	expect_load(-EBADMSG, "model.norm.weight");

	/* a weight in a dtype the loader does not convert */
	t->ck = saved;
	entry_named(&t->ck, "model.layers.0.post_attention_layernorm.weight")->dt = S_I32;
	write_ckpt(&t->ck, 1, tmpdir);
	expect_load(-ENOTSUP, "I32");

	/* the embedding with a vocabulary of 36, config says 37 */
	t->ck = saved;
	entry_named(&t->ck, "model.embed_tokens.weight")->shape[0] = 36;
	write_ckpt(&t->ck, 1, tmpdir);
	expect_load(-EBADMSG, "embed_tokens");

	/* a corrupt weights file: the parser's error comes through */
	t->ck = saved;
	write_ckpt(&t->ck, 1, tmpdir);
	snprintf(path, sizeof(path), "%s/model.safetensors", tmpdir);
	cr_assert_eq(truncate(path, 100), 0);
	expect_load(-EBADMSG, "model.safetensors");
	unlink(path);

	/* an unsupported configuration */
	write_text(tmpdir, "config.json",
		   "{\"architectures\": [\"Qwen2ForCausalLM\"], \"hidden_size\": 48,"
		   " \"intermediate_size\": 40, \"num_attention_heads\": 4,"
		   " \"num_hidden_layers\": 2, \"vocab_size\": 37,"
		   " \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4.0}}");
	for (int i = 0; i < t->ck.n; i++)
		t->ck.e[i].file = i % 2;
	write_ckpt(&t->ck, 2, tmpdir);
	expect_load(-ENOTSUP, "yarn");
	write_text(tmpdir, "config.json", t->config);
	expect_load(0, ""); /* and with the right config the sharded checkpoint loads */

	/* the index names a shard that is not there */
	snprintf(path, sizeof(path), "%s/model-00002-of-00002.safetensors", tmpdir);
	unlink(path);
	expect_load(-ENOENT, "model-00002-of-00002.safetensors");

	/* the index puts a tensor in the wrong shard */
	write_ckpt(&t->ck, 2, tmpdir);
	write_text(tmpdir, "model.safetensors.index.json",
		   "{\"weight_map\": {\"model.norm.weight\": \"model-00001-of-00002.safetensors\","
		   " \"model.embed_tokens.weight\": \"model-00001-of-00002.safetensors\","
		   " \"lm_head.weight\": \"model-00002-of-00002.safetensors\"}}");
	t->ck = saved; /* norm and embed are entries 1 and 0: in shard 1 and 0 */
	cr_assert(entry_named(&t->ck, "model.norm.weight") == &t->ck.e[1]);
	expect_load(-EBADMSG, "model.norm.weight");

	/* an index escaping its directory, and one that is not JSON */
	write_text(tmpdir, "model.safetensors.index.json",
		   "{\"weight_map\": {\"model.norm.weight\": \"../model.safetensors\"}}");
	expect_load(-EBADMSG, "model.norm.weight");
	write_text(tmpdir, "model.safetensors.index.json", "{\"weight_map\": ");
	expect_load(-EBADMSG, "not JSON");
	write_text(tmpdir, "model.safetensors.index.json", "{\"metadata\": {}}");
	expect_load(-EBADMSG, "weight_map");

	struct bd_model *m = NULL;
	char err[BD_MODEL_ERR_MAX];
	cr_expect_eq(bd_model_from_hf(NULL, &m, err), -EINVAL);
	cr_expect_eq(bd_model_from_hf(tmpdir, NULL, err), -EINVAL);
	const char *none[] = { NULL };
	cr_expect_eq(bd_model_from_hf_files("x", none, 1, &m, err), -EINVAL);
	cr_expect_eq(bd_model_from_hf_files("x", none, 0, &m, err), -EINVAL);
	cr_expect_null(m);
	rm_tmpdir();
	tiny_free(t);
}
