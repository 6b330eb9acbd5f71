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
#include "../common/fuzz_walk.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int rows_f32(const void *t, uint64_t row0, uint64_t n_rows, float *out)
{
	return bd_st_tensor_rows_f32(t, row0, n_rows, out);
}

static void walk_tensor(const struct bd_st *st, const struct bd_st_tensor *t)
{
	if (bd_st_find_tensor(st, t->name) != t)
		abort(); /* lookups must find every name they parsed */
	if (!bd_st_dtype_name(t->dtype) || t->nbytes != t->n_elements * bd_st_dtype_size(t->dtype))
		abort();
	fw_touch(t->name, strlen(t->name));
	fw_touch(t->data, t->nbytes);
	fw_first_last_rows(rows_f32, t, t->n_dims ? t->shape[t->n_dims - 1] : 1, t->n_elements);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct bd_st *st = NULL;
	char err[BD_ST_ERR_MAX];

	if (!fw_opened(bd_st_open_mem(data, size, &st, err), err, sizeof(err)))
		return 0;
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
		fw_touch(k, strlen(k));
		fw_touch(v, strlen(v));
	}
	bd_st_free(st);
	return 0;
}
