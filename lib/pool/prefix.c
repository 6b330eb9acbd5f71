/* prefix.c — the chained page hashes of prefix caching (bd_prefix.h), BLAKE2b from libsodium. */
#include <sodium.h>
#include <string.h>

#include "quant/bd_layout.h"
#include "pool/bd_prefix.h"

/* BLAKE2b's shortest output (crypto_generichash_BYTES_MIN); its first 8 bytes are the hash */
#define OUT 16
_Static_assert(OUT >= crypto_generichash_BYTES_MIN, "libsodium's minimum");

static uint64_t le64(const uint8_t b[8])
{
	uint64_t x = 0;

	for (int i = 7; i >= 0; i--)
		x = x << 8 | b[i];
	return x;
}

static void put64(uint8_t b[8], uint64_t x)
{
	for (int i = 0; i < 8; i++)
		b[i] = (uint8_t)(x >> (8 * i));
}

static uint64_t finish(crypto_generichash_state *st)
{
	uint8_t out[OUT];
	uint64_t h;

	crypto_generichash_final(st, out, sizeof(out));
	h = le64(out);
	return h ? h : 1;
}

uint64_t bd_prefix_seed(const char *model, const char *kv_config, const char *page_format,
			uint64_t calib_id)
{
	crypto_generichash_state st;
	const char *s[3] = { model ? model : "", kv_config ? kv_config : "",
			     page_format ? page_format : "" };
	uint8_t b[8];

	crypto_generichash_init(&st, NULL, 0, OUT);
	for (int i = 0; i < 3; i++)
		crypto_generichash_update(&st, (const uint8_t *)s[i], strlen(s[i]) + 1);
	put64(b, calib_id);
	crypto_generichash_update(&st, b, sizeof(b));
	return finish(&st);
}

uint64_t bd_prefix_salted(uint64_t seed, const char *salt, size_t len)
{
	crypto_generichash_state st;
	uint8_t b[8];

	if (!len)
		return seed;
	crypto_generichash_init(&st, NULL, 0, OUT);
	put64(b, seed);
	crypto_generichash_update(&st, b, sizeof(b));
	crypto_generichash_update(&st, (const uint8_t *)"salt", 5);
	crypto_generichash_update(&st, (const uint8_t *)salt, len);
	return finish(&st);
}

uint64_t bd_prefix_request_seed(uint64_t seed, const char *kv_config, const char *salt,
				size_t salt_len)
{
	return bd_prefix_salted(bd_prefix_salted(seed, kv_config, strlen(kv_config)), salt,
				salt_len);
}

void bd_prefix_hashes(uint64_t seed, const int32_t *toks, int n_pages, uint64_t *ret)
{
	uint64_t prev = seed;

	for (int j = 0; j < n_pages; j++) {
		crypto_generichash_state st;
		uint8_t b[8], t[4 * BD_PAGE_TOKENS];

		put64(b, prev);
		for (int i = 0; i < BD_PAGE_TOKENS; i++) {
			uint32_t v = (uint32_t)toks[(size_t)j * BD_PAGE_TOKENS + (size_t)i];

			t[4 * i] = (uint8_t)v;
			t[4 * i + 1] = (uint8_t)(v >> 8);
			t[4 * i + 2] = (uint8_t)(v >> 16);
			t[4 * i + 3] = (uint8_t)(v >> 24);
		}
		crypto_generichash_init(&st, NULL, 0, OUT);
		crypto_generichash_update(&st, b, sizeof(b));
		crypto_generichash_update(&st, t, sizeof(t));
		prev = ret[j] = finish(&st);
	}
}
