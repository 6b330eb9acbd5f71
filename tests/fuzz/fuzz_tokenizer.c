/* fuzz_tokenizer.c — libFuzzer target for the BPE tokenizer (model/bd_tokenizer.h) with the
 * embedded model's vocabulary, merges and pre-tokenizer regex.
 *
 * Build and run: `make fuzz-tokenizer`. The first byte picks the flags, the rest is text (any
 * bytes). Checks: user text (no special parsing) decodes back to exactly its bytes; the buffer
 * encoder agrees with the allocating one; the streaming decoder's chunks are valid UTF-8 and,
 * when the text is valid UTF-8, join to the text; the input read as token ids decodes or is
 * -ERANGE exactly when an id is out of the vocabulary.
 */
#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define FZ_TOK_INITIALIZE
#include "fuzz_model_tok.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
/* Whether s[n] is valid UTF-8 (no overlong forms, surrogates or values above U+10FFFF). */
static bool valid_utf8(const uint8_t *s, size_t n)
{
	size_t i = 0;

	while (i < n) {
		uint8_t b = s[i];
		size_t k;
		uint32_t cp, min;

		if (b < 0x80) {
			i++;
			continue;
		}
		if ((b & 0xe0) == 0xc0)
			k = 1, cp = b & 0x1f, min = 0x80;
		else if ((b & 0xf0) == 0xe0)
			k = 2, cp = b & 0x0f, min = 0x800;
		else if ((b & 0xf8) == 0xf0)
			k = 3, cp = b & 0x07, min = 0x10000;
		else
			return false;
		for (size_t j = 1; j <= k; j++) {
			if (i + j >= n || (s[i + j] & 0xc0) != 0x80)
				return false;
			cp = cp << 6 | (s[i + j] & 0x3f);
		}
		if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
			return false;
		i += k + 1;
	}
	return true;
}

static void stream_check(const int32_t *ids, size_t n, const uint8_t *text, size_t len,
			 unsigned flags)
{
	size_t cap = bd_tokenizer_stream_cap(fz_tok), got = 0, k;
	char *buf = malloc(cap), *all = malloc(n * cap + 4);
	struct bd_tok_stream st;

	if (!buf || !all)
		abort();
	bd_tokenizer_stream_init(&st, flags);
	for (size_t i = 0; i < n; i++) {
		if (bd_tokenizer_stream_push(fz_tok, &st, ids[i], buf, cap, &k) < 0)
			abort();
		if (!valid_utf8((uint8_t *)buf, k))
			abort();
		memcpy(all + got, buf, k);
		got += k;
	}
	if (bd_tokenizer_stream_flush(&st, buf, cap, &k) < 0 || !valid_utf8((uint8_t *)buf, k))
		abort();
	memcpy(all + got, buf, k);
	got += k;
	if (text && valid_utf8(text, len) && (got != len || memcmp(all, text, len)))
		abort();
	free(buf);
	free(all);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	int32_t *ids = NULL, small[64];
	size_t n = 0, n2 = 0, len;
	const char *text;
	unsigned flags;
	char *out = NULL;
	size_t out_len = 0;
	int e;

	if (size < 1)
		return 0;
	flags = data[0] & (BD_TOK_PARSE_SPECIAL | BD_TOK_ADD_SPECIAL);
	text = (const char *)data + 1;
	len = size - 1;

	e = bd_tokenizer_encode(fz_tok, text, len, flags, &ids, &n);
	if (e == -EIO) /* a PCRE2 match error (match limits) is a refusal, not a crash */
		return 0;
	if (e < 0)
		abort();
	e = bd_tokenizer_encode_buf(fz_tok, text, len, flags, small, 64, &n2);
	if (n2 != n || (e == 0 && memcmp(small, ids, n * sizeof(*ids))) ||
	    (e < 0 && (e != -ENOBUFS || n <= 64)))
		abort();
	if (bd_tokenizer_decode(fz_tok, ids, n, 0, &out, &out_len) < 0)
		abort();
	/* user text (no special parsing, no BOS/EOS) is every byte of the input, each once, less
	 * the bytes the vocabulary has no token for (SmolLM2 has none for bytes that never occur
	 * in UTF-8, such as 0xff: bd_tokenizer_byte_token) */
	if (!flags) {
		char *kept = malloc(len + 1);
		size_t n_kept = 0;

		if (!kept)
			abort();
		for (size_t i = 0; i < len; i++)
			if (bd_tokenizer_byte_token(fz_tok, (uint8_t)text[i]) >= 0)
				kept[n_kept++] = text[i];
		if (out_len != n_kept || memcmp(out, kept, n_kept))
			abort();
		stream_check(ids, n, n_kept == len ? (const uint8_t *)text : NULL, len, 0);
		free(kept);
	} else {
		stream_check(ids, n, NULL, 0, 0);
	}
	free(out);
	free(ids);

	/* the input as token ids, some of them out of range */
	{
		size_t m = len / 4;
		int32_t *raw = malloc(m * sizeof(int32_t) + 1), nv = bd_tokenizer_n_vocab(fz_tok);
		bool bad = false;

		if (!raw)
			abort();
		for (size_t i = 0; i < m; i++) {
			uint32_t v;

			memcpy(&v, text + 4 * i, 4);
			/* mostly in range: the low bits pick a token, the top bit a wild id */
			raw[i] = (v & 0x80000000u) ? (int32_t)v : (int32_t)(v % (uint32_t)(nv + 2));
			bad |= raw[i] < 0 || raw[i] >= nv;
		}
		e = bd_tokenizer_decode(fz_tok, raw, m, data[0] & BD_TOK_SKIP_SPECIAL, &out, &out_len);
		if ((e == -ERANGE) != bad || (e < 0 && e != -ERANGE))
			abort();
		if (e == 0) {
			free(out);
			stream_check(raw, m, NULL, 0, data[0] & BD_TOK_SKIP_SPECIAL);
		}
		free(raw);
	}
	return 0;
}
