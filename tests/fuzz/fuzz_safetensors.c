/* fuzz_safetensors.c — libFuzzer target for the safetensors parser (bd_safetensors.h).
 *
 * Build and run: `make fuzz-st` (clang -fsanitize=fuzzer,address,undefined), seeded from
 * tests/fuzz/st-corpus. Every input must either be refused with an error and a message, or
 * parse into a handle whose every tensor (its bytes, its first and last rows) and metadata
 * entry can be read without touching a byte outside the input, with tensors that tile the
 * data exactly.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "formats/bd_safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static volatile uint64_t sink; /* keeps the reads from being optimized away */

static void touch(const void *p, size_t n)
{
	const uint8_t *b = p;
	for (size_t i = 0; i < n; i++)
		sink += b[i];
}

static void walk_tensor(const struct bd_st *st, const struct bd_st_tensor *t)
{
	static float row[1 << 14];

	if (bd_st_find_tensor(st, t->name) != t)
		abort(); /* lookups must find every name they parsed */
	if (!bd_st_dtype_name(t->dtype) || t->nbytes != t->n_elements * bd_st_dtype_size(t->dtype))
		abort();
	touch(t->name, strlen(t->name));
	touch(t->data, t->nbytes);
	uint64_t cols = t->n_dims ? t->shape[t->n_dims - 1] : 1;
	if (!cols || cols > sizeof(row) / sizeof(row[0]) || !t->n_elements)
		return;
	uint64_t rows = t->n_elements / cols;
	if (bd_st_tensor_rows_f32(t, 0, 1, row) == 0 && rows > 1)
		(void)bd_st_tensor_rows_f32(t, rows - 1, 1, row);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct bd_st *st = NULL;
	char err[BD_ST_ERR_MAX];

	if (bd_st_open_mem(data, size, &st, err) < 0) {
		if (!err[0] || !memchr(err, 0, sizeof(err)))
			abort(); /* every refusal says why, in a terminated string */
		return 0;
	}
	uint64_t at = 0;
	for (size_t i = 0; i < bd_st_n_tensors(st); i++) {
		const struct bd_st_tensor *t = bd_st_tensor_at(st, i);
		if (t->begin != at)
			abort(); /* data order, no hole, no overlap */
		at = t->end;
		walk_tensor(st, t);
	}
	if (bd_st_data_offset(st) + at != size)
		abort();
	for (size_t i = 0; i < bd_st_n_metadata(st); i++) {
		const char *k, *v;
		if (bd_st_metadata_at(st, i, &k, &v) < 0 || bd_st_metadata_get(st, k) != v)
			abort();
		touch(k, strlen(k));
		touch(v, strlen(v));
	}
	bd_st_free(st);
	return 0;
}
