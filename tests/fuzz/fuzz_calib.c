/* fuzz_calib.c — libFuzzer target for the calibration file decoder (quant/bd_calib.h).
 *
 * Build and run: `make fuzz-calib`. Every input is decoded without and with an expectation
 * (the shape and context of its own header, and of another shape). Checks: a refusal says why
 * and a success says nothing; what decodes holds finite τ and μ_k of a positive shape, encodes
 * back to exactly the input bytes, and matches an expectation of its own shape; another shape
 * is -ESTALE.
 */
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant/bd_calib.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_err(int e, const char *err)
{
	if (!memchr(err, 0, BD_CALIB_ERR_MAX) || (e == 0) != (err[0] == 0))
		abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char err[BD_CALIB_ERR_MAX];
	struct bd_calib *c = NULL, *c2 = NULL;
	int e = bd_calib_decode(data, size, NULL, &c, err);

	check_err(e, err);
	if (e < 0) {
		if (e != -EBADMSG && e != -EPROTONOSUPPORT && e != -ENOMEM)
			abort();
		return 0;
	}
	if (c->n_layers <= 0 || c->n_kv_heads <= 0 || c->head_dim <= 0 || !isfinite(c->tau))
		abort();
	{
		size_t n = (size_t)c->n_layers * c->n_kv_heads * c->head_dim;
		size_t bytes = bd_calib_file_bytes(c->n_layers, c->n_kv_heads, c->head_dim);
		uint8_t *out;
		long w;

		for (size_t i = 0; i < n; i++)
			if (!isfinite(c->mu_k[i]))
				abort();
		if (bytes != size)
			abort(); /* a file is exactly its shape's size */
		out = malloc(bytes);
		if (!out)
			abort();
		w = bd_calib_encode(c, out, bytes);
		/* the decoder accepts only what the encoder writes (c > 0 included) */
		if (w != (long)size || memcmp(out, data, size))
			abort();
		free(out);
	}
	{
		uint8_t sha[32];
		struct bd_calib_expect want = { sha, 0, c->n_layers, c->n_kv_heads, c->head_dim };

		memcpy(sha, data + 64, 32);
		e = bd_calib_decode(data, size, &want, &c2, err);
		check_err(e, err);
		if (e != 0)
			abort();
		bd_calib_free(c2);
		c2 = NULL;
		want.n_layers++;
		e = bd_calib_decode(data, size, &want, &c2, err);
		check_err(e, err);
		if (e != -ESTALE)
			abort();
	}
	bd_calib_free(c);
	return 0;
}
