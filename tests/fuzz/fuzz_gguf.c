/* fuzz_gguf.c — libFuzzer target for the GGUF parser (bd_gguf.h).
 *
 * Build and run: `make fuzz` (clang -fsanitize=fuzzer,address,undefined). Every input must
 * either be refused with an error or parse into a handle whose every lookup, string, array
 * element and tensor row can be read without touching a byte outside the input.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "formats/bd_gguf.h"
#include "../common/fuzz_walk.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int rows_f32(const void *t, uint64_t row0, uint64_t n_rows, float *out)
{
	return bd_gguf_tensor_rows_f32(t, row0, n_rows, out);
}

static void walk_kv(const struct bd_gguf *g, const struct bd_gguf_kv *kv)
{
	int64_t iv;
	double dv;
	bool bv;
	struct bd_gguf_str s;

	if (bd_gguf_find_kv(g, kv->key) != kv)
		abort(); /* lookups must find every key they parsed */
	if (kv->type == BD_GGUF_ARRAY && kv->n) {
		/* first and last elements, whatever their type */
		uint64_t idx[2] = { 0, kv->n - 1 };
		for (int k = 0; k < 2; k++) {
			if (bd_gguf_arr_int(kv, idx[k], &iv) == 0)
				fw_sink += (uint64_t)iv;
			if (bd_gguf_arr_float(kv, idx[k], &dv) == 0)
				fw_sink += (uint64_t)(dv == dv);
			if (bd_gguf_arr_str(kv, idx[k], &s) == 0)
				fw_touch(s.s, s.len);
		}
		return;
	}
	if (bd_gguf_get_int(g, kv->key, &iv) == 0)
		fw_sink += (uint64_t)iv;
	if (bd_gguf_get_float(g, kv->key, &dv) == 0)
		fw_sink += (uint64_t)(dv == dv);
	if (bd_gguf_get_bool(g, kv->key, &bv) == 0)
		fw_sink += bv;
	if (bd_gguf_get_str(g, kv->key, &s) == 0)
		fw_touch(s.s, s.len);
}

static void walk_tensor(const struct bd_gguf *g, const struct bd_gguf_tensor *t)
{
	if (bd_gguf_find_tensor(g, t->name) != t)
		abort();
	fw_touch(t->data, t->nbytes);
	fw_first_last_rows(rows_f32, t, t->ne[0], t->n_elements);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct bd_gguf *g = NULL;
	char err[BD_GGUF_ERR_MAX];

	if (!fw_opened(bd_gguf_open_mem(data, size, &g, err), err, sizeof(err)))
		return 0;
	for (size_t i = 0; i < bd_gguf_n_kv(g); i++)
		walk_kv(g, bd_gguf_kv_at(g, i));
	for (size_t i = 0; i < bd_gguf_n_tensors(g); i++)
		walk_tensor(g, bd_gguf_tensor_at(g, i));
	struct bd_model_hparams hp;
	(void)bd_gguf_model_hparams(g, &hp, err);
	bd_gguf_free(g);
	return 0;
}
