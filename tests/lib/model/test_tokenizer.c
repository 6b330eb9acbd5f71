/* test_tokenizer.c — bd_tokenizer.h (and through it bd_chat_template.h): byte-level BPE from
 * GGUF metadata and tokenizer.json, decoding, the stream decoder and the chat template.
 * Suite "tokenizer".
 *
 * The embedded model's tokenizer (models/, `make model`) is checked against
 * tests/data/tokenizer/smollm2.json, token ids that Hugging Face `tokenizers` computed from the same
 * GGUF's vocabulary and merges (tests/data/tokenizer/gen_golden.py), chat ids from jinja2 rendering
 * the same template, and Python's UTF-8 decoding with errors="replace" for the stream decoder.
 * A small vocabulary in a GGUF image built here in memory checks merge order by hand, the
 * pre-tokenizer choice, template shapes, and every kind of malformed metadata.
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <criterion/criterion.h>
#include <jansson.h>

#include "formats/bd_gguf.h"
#include "model/bd_tokenizer.h"
#include "gguf_writer.h"
#include "model_data.h"

static json_t *golden(void)
{
	return td_load_json("tests/data/tokenizer/smollm2.json");
}

/* The tokenizer of g, asserted to load with an empty message; g is freed at once (the
 * tokenizer copies what it keeps). */
static struct bd_tokenizer *tok_of(struct bd_gguf *g)
{
	struct bd_tokenizer *tok = NULL;
	char terr[BD_TOKENIZER_ERR_MAX];
	cr_assert_eq(bd_tokenizer_new_from_gguf(g, &tok, terr), 0, "%s", terr);
	cr_assert_str_empty(terr);
	bd_gguf_free(g);
	return tok;
}

/* The ids of the NUL-terminated s under flags (encoding asserted to succeed), malloc'ed:
 * *ret_n of them. */
static int32_t *encode_str(const struct bd_tokenizer *tok, const char *s, unsigned flags,
			   size_t *ret_n)
{
	int32_t *ids;
	cr_assert_eq(bd_tokenizer_encode(tok, s, strlen(s), flags, &ids, ret_n), 0,
		     "encode \"%s\" (flags %u)", s, flags);
	return ids;
}

/* The embedded model's tokenizer. */
static struct bd_tokenizer *model_tok(void)
{
	return tok_of(td_open_model());
}

/* A GGUF image of m's metadata entries and no tensors, opened: the header goes in front, in an
 * exactly sized buffer so that ASan sees any overread. m->p is freed; the image, *ret_buf, must
 * outlive the handle and is the caller's to free. */
static struct bd_gguf *open_metadata(struct gguf_w *m, uint8_t **ret_buf)
{
	uint8_t *buf = malloc(24 + m->n);
	cr_assert_not_null(buf);
	uint32_t ver = 3;
	uint64_t hdr[2] = { 0, m->keys };
	memcpy(buf, "GGUF", 4);
	memcpy(buf + 4, &ver, 4); /* the test machines are little-endian, as GGUF is */
	memcpy(buf + 8, hdr, 16);
	memcpy(buf + 24, m->p, m->n);
	struct bd_gguf *g = NULL;
	char err[BD_GGUF_ERR_MAX];
	cr_assert_eq(bd_gguf_open_mem(buf, 24 + m->n, &g, err), 0, "%s", err);
	free(m->p);
	*ret_buf = buf;
	return g;
}

static int32_t *json_ids(json_t *a, size_t *ret_n)
{
	size_t n = json_array_size(a);
	int32_t *v = malloc((n ? n : 1) * sizeof(*v));
	cr_assert_not_null(v);
	for (size_t i = 0; i < n; i++)
		v[i] = (int32_t)json_integer_value(json_array_get(a, i));
	*ret_n = n;
	return v;
}

static void assert_ids(const int32_t *got, size_t n_got, json_t *want, const char *what)
{
	size_t n;
	int32_t *w = json_ids(want, &n);
	size_t i = 0;
	while (i < n && i < n_got && got[i] == w[i])
		i++;
	cr_assert(i == n && n == n_got,
		  "%s: %zu ids, want %zu; first difference at %zu (got %d, want %d)", what, n_got,
		  n, i, i < n_got ? got[i] : -1, i < n ? w[i] : -1);
	free(w);
}

/* The len bytes of text encoded with flags are the ids of the golden array want. */
static void expect_encode(const struct bd_tokenizer *tok, const char *text, size_t len,
			  unsigned flags, json_t *want, const char *what)
{
	int32_t *ids;
	size_t n;

	cr_assert_eq(bd_tokenizer_encode(tok, text, len, flags, &ids, &n), 0, "%s", what);
	assert_ids(ids, n, want, what);
	free(ids);
}

/* Complete, shortest-form UTF-8 without surrogates (written from RFC 3629 §4). */
static bool valid_utf8(const uint8_t *s, size_t n)
{
	size_t i = 0;
	while (i < n) {
		uint8_t b = s[i];
		size_t l;
		uint8_t lo = 0x80, hi = 0xbf;
		if (b < 0x80) {
			i++;
			continue;
		} else if (b >= 0xc2 && b <= 0xdf) {
			l = 2;
		} else if (b >= 0xe0 && b <= 0xef) {
			l = 3;
			lo = b == 0xe0 ? 0xa0 : 0x80;
			hi = b == 0xed ? 0x9f : 0xbf;
		} else if (b >= 0xf0 && b <= 0xf4) {
			l = 4;
			lo = b == 0xf0 ? 0x90 : 0x80;
			hi = b == 0xf4 ? 0x8f : 0xbf;
		} else {
			return false;
		}
		if (i + l > n || s[i + 1] < lo || s[i + 1] > hi)
			return false;
		for (size_t k = 2; k < l; k++)
			if (s[i + k] < 0x80 || s[i + k] > 0xbf)
				return false;
		i += l;
	}
	return true;
}

/* s[n] without the bytes the vocabulary has no token for (encoding leaves them out). */
static char *kept_bytes(const struct bd_tokenizer *tok, const char *s, size_t n, size_t *ret_n)
{
	char *k = malloc(n + 1);
	cr_assert_not_null(k);
	size_t m = 0;
	for (size_t i = 0; i < n; i++)
		if (bd_tokenizer_byte_token(tok, (uint8_t)s[i]) >= 0)
			k[m++] = s[i];
	*ret_n = m;
	return k;
}

/* ids decode to text[len] without the bytes the vocabulary lacks (encoding leaves them
 * out), NUL-terminated; returns the kept length. what names the case in a failure. */
static size_t expect_round_trip(const struct bd_tokenizer *tok, const int32_t *ids, size_t n,
				const char *text, size_t len, const char *what)
{
	char *back;
	size_t blen, klen;
	char *kept = kept_bytes(tok, text, len, &klen);
	cr_assert_eq(bd_tokenizer_decode(tok, ids, n, 0, &back, &blen), 0, "%s", what);
	cr_assert(blen == klen && (klen == 0 || memcmp(back, kept, klen) == 0) &&
		  back[blen] == '\0', "%s: decode(encode(x)) != x", what);
	free(kept);
	free(back);
	return klen;
}

/* ---- the embedded model against the golden ids ------------------------------------------ */

Test(tokenizer, model_vocabulary)
{
	struct bd_tokenizer *tok = model_tok();
	json_t *gold = golden();

	cr_assert_eq(bd_tokenizer_n_vocab(tok), json_integer_value(json_object_get(gold, "n_vocab")));
	/* tokenizer.ggml.bos_token_id 1, eos 2, padding 2 in the file (gguf-py) */
	cr_assert_eq(bd_tokenizer_bos(tok), 1);
	cr_assert_eq(bd_tokenizer_eos(tok), 2);
	cr_assert_eq(bd_tokenizer_pad(tok), 2);

	const char *key;
	json_t *v;
	json_object_foreach(json_object_get(gold, "specials"), key, v) {
		int32_t id = (int32_t)json_integer_value(v);
		cr_assert_eq(bd_tokenizer_find(tok, key, strlen(key)), id, "%s", key);
		cr_assert_eq(bd_tokenizer_token_type(tok, id), BD_TOKEN_CONTROL, "%s", key);
		const char *s;
		size_t n;
		cr_assert_eq(bd_tokenizer_token_bytes(tok, id, &s, &n), 0);
		cr_assert(n == strlen(key) && memcmp(s, key, n) == 0, "%s decodes as itself", key);
		/* generation ends at <|im_end|> (the eos) and <|endoftext|>, at no other special */
		bool eog = strcmp(key, "<|im_end|>") == 0 || strcmp(key, "<|endoftext|>") == 0;
		cr_assert_eq(bd_tokenizer_is_eog(tok, id), eog, "%s", key);
	}
	cr_assert(!bd_tokenizer_is_eog(tok, -1));
	cr_assert(!bd_tokenizer_is_eog(tok, 49152));

	/* The GPT-2 byte map, by hand: bytes 0x00–0x20 are the first 33 remapped bytes, so "\n"
	 * (0x0a) is U+010A "Ċ" and " " (0x20) is U+0120 "Ġ"; 0x7f–0xa0 follow (34 more), so the
	 * soft hyphen 0xad, the 68th, is U+0143 "Ń"; "A" stands for itself. */
	static const struct { const char *text; const char *bytes; } map[] = {
		{ "\xc4\x8a", "\n" }, { "\xc4\xa0", " " }, { "\xc5\x83", "\xad" }, { "A", "A" },
		{ "\xc3\xa9", "\xe9" }, /* é U+00E9 stands for byte 0xe9 */
	};
	for (size_t i = 0; i < sizeof(map) / sizeof(map[0]); i++) {
		int32_t id = bd_tokenizer_find(tok, map[i].text, strlen(map[i].text));
		cr_assert_geq(id, 0, "byte token %zu", i);
		const char *s;
		size_t n;
		cr_assert_eq(bd_tokenizer_token_bytes(tok, id, &s, &n), 0);
		cr_assert(n == 1 && s[0] == map[i].bytes[0], "byte token %zu decodes to 0x%02x", i,
			  (uint8_t)map[i].bytes[0]);
		cr_assert_eq(bd_tokenizer_token_text(tok, id, &s, &n), 0);
		cr_assert(n == strlen(map[i].text) && memcmp(s, map[i].text, n) == 0);
	}
	/* the golden encoding of " " is that byte token (216) */
	cr_assert_eq(bd_tokenizer_find(tok, "\xc4\xa0", 2), 216);
	cr_assert_eq(bd_tokenizer_find(tok, "no such token at all", 20), -ENOENT);
	cr_assert_geq(bd_tokenizer_max_token_bytes(tok), 16);

	/* the bytes without a token, as gguf-py lists the vocabulary */
	bool missing[256] = { false };
	size_t i;
	json_array_foreach(json_object_get(gold, "missing_bytes"), i, v)
		missing[json_integer_value(v)] = true;
	cr_assert_eq(i, 21);
	for (unsigned b = 0; b < 256; b++) {
		int32_t id = bd_tokenizer_byte_token(tok, (uint8_t)b);
		if (missing[b]) {
			cr_assert_eq(id, -ENOENT, "byte 0x%02x", b);
			continue;
		}
		cr_assert_geq(id, 0, "byte 0x%02x", b);
		const char *s;
		size_t n;
		cr_assert_eq(bd_tokenizer_token_bytes(tok, id, &s, &n), 0);
		cr_assert(n == 1 && (uint8_t)s[0] == b, "byte 0x%02x", b);
	}
	cr_assert_eq(bd_tokenizer_byte_token(NULL, 0), -EINVAL);

	json_decref(gold);
	bd_tokenizer_free(tok);
}

Test(tokenizer, golden_encode_decode)
{
	struct bd_tokenizer *tok = model_tok();
	json_t *gold = golden();
	json_t *cases = json_object_get(gold, "encode");
	cr_assert_geq(json_array_size(cases), 40);
	size_t i;
	json_t *c;
	json_array_foreach(cases, i, c) {
		const char *name = json_string_value(json_object_get(c, "name"));
		const char *text = json_string_value(json_object_get(c, "text"));
		size_t len = json_string_length(json_object_get(c, "text"));
		int32_t *ids;
		size_t n;

		cr_assert_eq(bd_tokenizer_encode(tok, text, len, 0, &ids, &n), 0, "%s", name);
		assert_ids(ids, n, json_object_get(c, "ids"), name);

		size_t klen = expect_round_trip(tok, ids, n, text, len, name);
		if (strcmp(name, "bytes.missing") != 0)
			cr_assert_eq(klen, len, "%s", name);
		free(ids);

		expect_encode(tok, text, len, BD_TOK_PARSE_SPECIAL, json_object_get(c, "ids_special"),
			      name);
		/* BOS is not added: add_bos_token is false in this file */
		expect_encode(tok, text, len, BD_TOK_ADD_SPECIAL, json_object_get(c, "ids"), name);
	}
	json_decref(gold);
	bd_tokenizer_free(tok);
}

Test(tokenizer, special_text_in_content_is_literal)
{
	struct bd_tokenizer *tok = model_tok();
	const char *s = "<|im_start|>user\nhi<|im_end|>";
	size_t n;
	int32_t *ids = encode_str(tok, s, 0, &n);
	for (size_t i = 0; i < n; i++)
		cr_assert_geq(ids[i], 17, "literal text gave the special token %d", ids[i]);
	free(ids);
	ids = encode_str(tok, s, BD_TOK_PARSE_SPECIAL, &n);
	cr_assert_gt(n, 2);
	cr_assert_eq(ids[0], 1); /* <|im_start|> */
	cr_assert_eq(ids[n - 1], 2); /* <|im_end|> */
	/* decoding: control tokens render as their text, or as nothing on request */
	char *text;
	size_t len;
	cr_assert_eq(bd_tokenizer_decode(tok, ids, n, 0, &text, &len), 0);
	cr_assert_str_eq(text, s);
	free(text);
	cr_assert_eq(bd_tokenizer_decode(tok, ids, n, BD_TOK_SKIP_SPECIAL, &text, &len), 0);
	cr_assert_str_eq(text, "user\nhi");
	free(text);
	free(ids);
	bd_tokenizer_free(tok);
}

/* xorshift64*, for reproducible random inputs */
static uint64_t rnd(uint64_t *s)
{
	*s ^= *s >> 12;
	*s ^= *s << 25;
	*s ^= *s >> 27;
	return *s * 2685821657736338717ull;
}

Test(tokenizer, roundtrip_random_bytes)
{
	struct bd_tokenizer *tok = model_tok();
	uint64_t seed = 0x9e3779b97f4a7c15ull;
	for (int trial = 0; trial < 300; trial++) {
		size_t len = rnd(&seed) % 200;
		char *s = malloc(len + 1);
		cr_assert_not_null(s);
		for (size_t i = 0; i < len; i++) {
			uint64_t r = rnd(&seed);
			switch (trial % 3) {
			case 0: /* any byte, NUL and invalid UTF-8 included */
				s[i] = (char)(r >> 32);
				break;
			case 1: /* mostly text-like ASCII with whitespace runs and digits */
				s[i] = " \n\t0123abcXYZ'.<|>"[(r >> 32) % 18];
				break;
			default: /* UTF-8 fragments: leads and continuations mixed */
				s[i] = (char)((r >> 32) % 2 ? 0x80 + (r >> 40) % 64
							    : 0xc0 + (r >> 40) % 64);
			}
		}
		for (unsigned flags = 0; flags <= BD_TOK_PARSE_SPECIAL; flags++) {
			int32_t *ids;
			size_t n;
			char what[48];
			snprintf(what, sizeof(what), "trial %d flags %u", trial, flags);
			cr_assert_eq(bd_tokenizer_encode(tok, s, len, flags, &ids, &n), 0);
			cr_assert_leq(n, len);
			expect_round_trip(tok, ids, n, s, len, what);
			free(ids);
		}
		free(s);
	}
	bd_tokenizer_free(tok);
}

Test(tokenizer, encode_buf)
{
	struct bd_tokenizer *tok = model_tok();
	const char *s = "What is the capital of France?";
	size_t n, m = 0;
	int32_t *ids = encode_str(tok, s, 0, &n);
	int32_t buf[64];
	for (size_t k = 0; k < 64; k++)
		buf[k] = -7;
	cr_assert_eq(bd_tokenizer_encode_buf(tok, s, strlen(s), 0, buf, 64, NULL), -EINVAL);
	cr_assert_eq(bd_tokenizer_encode_buf(tok, s, strlen(s), 0, NULL, 5, &m), -EINVAL);
	cr_assert_eq(m, 0);
	cr_assert_eq(bd_tokenizer_encode_buf(tok, s, strlen(s), 0, NULL, 0, &m), -ENOBUFS);
	cr_assert_eq(m, n);
	cr_assert_eq(bd_tokenizer_encode_buf(tok, s, strlen(s), 0, buf, n - 1, &m), -ENOBUFS);
	cr_assert_eq(m, n);
	cr_assert_eq(bd_tokenizer_encode_buf(tok, s, strlen(s), 0, buf, n, &m), 0);
	cr_assert_eq(m, n);
	cr_assert_arr_eq(buf, ids, n * sizeof(int32_t));
	cr_assert_eq(buf[n], -7, "wrote past the ids");
	free(ids);
	bd_tokenizer_free(tok);
}

/* 100 KB of real text (the golden strings, repeated) encodes well under a second. */
Test(tokenizer, speed_100kb)
{
	struct bd_tokenizer *tok = model_tok();
	json_t *gold = golden();
	char *big = malloc(100 * 1024 + 8192);
	size_t len = 0;
	cr_assert_not_null(big);
	while (len < 100 * 1024) {
		size_t i;
		json_t *c;
		json_array_foreach(json_object_get(gold, "encode"), i, c) {
			json_t *t = json_object_get(c, "text");
			size_t l = json_string_length(t);
			if (len + l > 100 * 1024 + 8192)
				break;
			memcpy(big + len, json_string_value(t), l);
			len += l;
		}
	}
	struct timespec a, b;
	int32_t *ids;
	size_t n;
	clock_gettime(CLOCK_MONOTONIC, &a);
	cr_assert_eq(bd_tokenizer_encode(tok, big, len, 0, &ids, &n), 0);
	clock_gettime(CLOCK_MONOTONIC, &b);
	double s = (double)(b.tv_sec - a.tv_sec) + (double)(b.tv_nsec - a.tv_nsec) * 1e-9;
#ifdef __SANITIZE_ADDRESS__
	double limit = 10.0; /* ASan+UBSan builds run several times slower */
#else
	double limit = 0.5;
#endif
	cr_assert_lt(s, limit, "encoding %zu bytes took %.3f s", len, s);
	expect_round_trip(tok, ids, n, big, len, "the long text");
	free(ids);
	free(big);
	json_decref(gold);
	bd_tokenizer_free(tok);
}

struct thr {
	const struct bd_tokenizer *tok;
	const char *text;
	size_t len;
	int32_t *ids;
	size_t n;
	int r;
};

static void *thr_main(void *p)
{
	struct thr *t = p;
	for (int k = 0; k < 20 && t->r == 0; k++) {
		free(t->ids);
		t->ids = NULL;
		t->r = bd_tokenizer_encode(t->tok, t->text, t->len, 0, &t->ids, &t->n);
	}
	return NULL;
}

/* A built tokenizer is shared by threads without locks. */
Test(tokenizer, concurrent_encode)
{
	struct bd_tokenizer *tok = model_tok();
	json_t *gold = golden();
	json_t *c = json_array_get(json_object_get(gold, "encode"), 0);
	struct thr t[2];
	pthread_t th[2];
	for (int i = 0; i < 2; i++) {
		t[i] = (struct thr){ tok, json_string_value(json_object_get(c, "text")),
				     json_string_length(json_object_get(c, "text")), NULL, 0, 0 };
		cr_assert_eq(pthread_create(&th[i], NULL, thr_main, &t[i]), 0);
	}
	for (int i = 0; i < 2; i++) {
		pthread_join(th[i], NULL);
		cr_assert_eq(t[i].r, 0);
		assert_ids(t[i].ids, t[i].n, json_object_get(c, "ids"), "thread");
		free(t[i].ids);
	}
	json_decref(gold);
	bd_tokenizer_free(tok);
}

/* ---- stream decoder ---------------------------------------------------------------------- */

/* Stream ids[n]; every chunk must be valid UTF-8. Returns the concatenation (malloc'ed) and
 * how many pushes held bytes back. */
static char *stream_all(const struct bd_tokenizer *tok, const int32_t *ids, size_t n,
			unsigned flags, size_t *ret_len, size_t *ret_held)
{
	struct bd_tok_stream st;
	bd_tokenizer_stream_init(&st, flags);
	size_t cap = bd_tokenizer_stream_cap(tok);
	char *buf = malloc(cap);
	char *all = malloc(3 * (n * bd_tokenizer_max_token_bytes(tok) + 4));
	cr_assert(buf && all);
	size_t len = 0, held = 0, k;
	for (size_t i = 0; i < n; i++) {
		cr_assert_eq(bd_tokenizer_stream_push(tok, &st, ids[i], buf, cap, &k), 0);
		cr_assert(valid_utf8((uint8_t *)buf, k), "chunk %zu is not valid UTF-8", i);
		held += st.n_pend > 0;
		memcpy(all + len, buf, k);
		len += k;
	}
	cr_assert_eq(bd_tokenizer_stream_flush(&st, buf, cap, &k), 0);
	cr_assert(valid_utf8((uint8_t *)buf, k));
	memcpy(all + len, buf, k);
	len += k;
	free(buf);
	*ret_len = len;
	*ret_held = held;
	return all;
}

Test(tokenizer, stream_golden_text)
{
	struct bd_tokenizer *tok = model_tok();
	json_t *gold = golden();
	size_t i, held_total = 0;
	json_t *c;
	json_array_foreach(json_object_get(gold, "encode"), i, c) {
		size_t n, len, held;
		int32_t *ids = json_ids(json_object_get(c, "ids"), &n);
		char *out = stream_all(tok, ids, n, 0, &len, &held);
		json_t *t = json_object_get(c, "text");
		size_t klen;
		char *kept = kept_bytes(tok, json_string_value(t), json_string_length(t), &klen);
		cr_assert(len == klen && memcmp(out, kept, len) == 0,
			  "%s: the stream differs from the text",
			  json_string_value(json_object_get(c, "name")));
		held_total += held;
		free(kept);
		free(out);
		free(ids);
	}
	/* CJK and Arabic text is split inside characters by byte tokens: the holding back was
	 * exercised */
	cr_assert_gt(held_total, 10);
	json_decref(gold);
	bd_tokenizer_free(tok);
}

/* The stream replaces what can never be valid exactly as Python's errors="replace" does. */
Test(tokenizer, stream_invalid_utf8)
{
	struct bd_tokenizer *tok = model_tok();
	json_t *gold = golden();
	size_t i;
	json_t *c;
	json_array_foreach(json_object_get(gold, "utf8_replace"), i, c) {
		const char *hex = json_string_value(json_object_get(c, "hex"));
		size_t nb = strlen(hex) / 2;
		char *b = malloc(nb);
		for (size_t k = 0; k < nb; k++) {
			unsigned v;
			cr_assert_eq(sscanf(hex + 2 * k, "%2x", &v), 1);
			b[k] = (char)v;
		}
		int32_t *ids;
		size_t n, len, held;
		cr_assert_eq(bd_tokenizer_encode(tok, b, nb, 0, &ids, &n), 0);
		char *out = stream_all(tok, ids, n, 0, &len, &held);
		json_t *want = json_object_get(c, "replaced");
		cr_assert(len == json_string_length(want) &&
			  memcmp(out, json_string_value(want), len) == 0, "case %zu (%s)", i, hex);
		free(out);
		free(ids);
		free(b);
	}
	json_decref(gold);
	bd_tokenizer_free(tok);
}

static int32_t byte_tok(const struct bd_tokenizer *tok, uint8_t b)
{
	int32_t *ids;
	size_t n;
	cr_assert_eq(bd_tokenizer_encode(tok, (const char *)&b, 1, 0, &ids, &n), 0);
	cr_assert_eq(n, 1);
	int32_t id = ids[0];
	free(ids);
	return id;
}

Test(tokenizer, stream_by_hand)
{
	struct bd_tokenizer *tok = model_tok();
	struct bd_tok_stream st;
	char buf[256];
	size_t k;

	/* € is E2 82 AC: nothing until the third byte */
	bd_tokenizer_stream_init(&st, 0);
	cr_assert_eq(bd_tokenizer_stream_push(tok, &st, byte_tok(tok, 0xe2), buf, 256, &k), 0);
	cr_assert_eq(k, 0);
	cr_assert_eq(bd_tokenizer_stream_push(tok, &st, byte_tok(tok, 0x82), buf, 256, &k), 0);
	cr_assert_eq(k, 0);
	cr_assert_eq(bd_tokenizer_stream_push(tok, &st, byte_tok(tok, 0xac), buf, 256, &k), 0);
	cr_assert(k == 3 && memcmp(buf, "\xe2\x82\xac", 3) == 0);

	/* C3 then "A": the lead is cut off, so U+FFFD then "A" */
	cr_assert_eq(bd_tokenizer_stream_push(tok, &st, byte_tok(tok, 0xc3), buf, 256, &k), 0);
	cr_assert_eq(k, 0);
	cr_assert_eq(bd_tokenizer_stream_push(tok, &st, byte_tok(tok, 'A'), buf, 256, &k), 0);
	cr_assert(k == 4 && memcmp(buf, "\xef\xbf\xbd" "A", 4) == 0);

	/* F0 9F held at the end of the stream: flush gives one U+FFFD */
	cr_assert_eq(bd_tokenizer_stream_push(tok, &st, byte_tok(tok, 0xf0), buf, 256, &k), 0);
	cr_assert_eq(bd_tokenizer_stream_push(tok, &st, byte_tok(tok, 0x9f), buf, 256, &k), 0);
	cr_assert_eq(k, 0);
	cr_assert_eq(st.n_pend, 2);
	/* a buffer too small for the flush leaves the stream as it was */
	cr_assert_eq(bd_tokenizer_stream_flush(&st, buf, 2, &k), -ENOBUFS);
	cr_assert_eq(st.n_pend, 2);
	cr_assert_eq(bd_tokenizer_stream_flush(&st, buf, 256, &k), 0);
	cr_assert(k == 3 && memcmp(buf, "\xef\xbf\xbd", 3) == 0);
	cr_assert_eq(st.n_pend, 0);
	cr_assert_eq(bd_tokenizer_stream_flush(&st, NULL, 0, &k), 0);
	cr_assert_eq(k, 0);

	/* control tokens: text, or nothing with BD_TOK_SKIP_SPECIAL */
	cr_assert_eq(bd_tokenizer_stream_push(tok, &st, 2, buf, 256, &k), 0);
	cr_assert(k == 10 && memcmp(buf, "<|im_end|>", 10) == 0);
	bd_tokenizer_stream_init(&st, BD_TOK_SKIP_SPECIAL);
	cr_assert_eq(bd_tokenizer_stream_push(tok, &st, 2, buf, 256, &k), 0);
	cr_assert_eq(k, 0);

	/* errors leave the state untouched */
	bd_tokenizer_stream_init(&st, 0);
	cr_assert_eq(bd_tokenizer_stream_push(tok, &st, byte_tok(tok, 0xe2), buf, 256, &k), 0);
	struct bd_tok_stream before = st;
	k = 777;
	cr_assert_eq(bd_tokenizer_stream_push(tok, &st, -1, buf, 256, &k), -ERANGE);
	cr_assert_eq(bd_tokenizer_stream_push(tok, &st, 49152, buf, 256, &k), -ERANGE);
	/* "<|im_end|>" after a held lead: U+FFFD + 10 bytes do not fit in 12 */
	cr_assert_eq(bd_tokenizer_stream_push(tok, &st, 2, buf, 12, &k), -ENOBUFS);
	cr_assert_eq(bd_tokenizer_stream_push(NULL, &st, 2, buf, 256, &k), -EINVAL);
	cr_assert_eq(bd_tokenizer_stream_push(tok, NULL, 2, buf, 256, &k), -EINVAL);
	cr_assert_eq(bd_tokenizer_stream_push(tok, &st, 2, buf, 256, NULL), -EINVAL);
	cr_assert_eq(k, 777);
	cr_assert_arr_eq(&st, &before, sizeof(st));
	cr_assert_eq(bd_tokenizer_stream_push(tok, &st, 2, buf, 13, &k), 0);
	cr_assert(k == 13 && memcmp(buf, "\xef\xbf\xbd<|im_end|>", 13) == 0);
	bd_tokenizer_free(tok);
}

/* ---- chat -------------------------------------------------------------------------------- */

Test(tokenizer, golden_chat)
{
	struct bd_tokenizer *tok = model_tok();
	json_t *gold = golden();
	char err[BD_TOKENIZER_ERR_MAX];
	cr_assert_eq(bd_tokenizer_chat_check(tok, err), 0, "%s", err);
	size_t i;
	json_t *c;
	json_array_foreach(json_object_get(gold, "chat"), i, c) {
		const char *name = json_string_value(json_object_get(c, "name"));
		json_t *jm = json_object_get(c, "messages");
		size_t nm = json_array_size(jm);
		struct bd_chat_msg msgs[8];
		cr_assert_leq(nm, 8);
		for (size_t k = 0; k < nm; k++) {
			msgs[k].role = json_string_value(json_object_get(json_array_get(jm, k), "role"));
			msgs[k].content =
				json_string_value(json_object_get(json_array_get(jm, k), "content"));
		}
		bool gen = json_is_true(json_object_get(c, "add_generation_prompt"));
		int32_t *ids;
		size_t n;
		cr_assert_eq(bd_tokenizer_chat_apply(tok, msgs, nm, gen, &ids, &n, err), 0, "%s: %s",
			     name, err);
		assert_ids(ids, n, json_object_get(c, "ids"), name);
		free(ids);

		char *text;
		size_t len;
		cr_assert_eq(bd_tokenizer_chat_render(tok, msgs, nm, gen, &text, &len, err), 0);
		cr_assert_str_eq(text, json_string_value(json_object_get(c, "text")), "%s", name);
		cr_assert_eq(len, strlen(text));
		free(text);
	}
	json_decref(gold);
	bd_tokenizer_free(tok);
}

Test(tokenizer, chat_bad_arguments)
{
	struct bd_tokenizer *tok = model_tok();
	struct bd_chat_msg m[2] = { { "user", "hi" }, { "assistant", NULL } };
	int32_t *ids = (int32_t *)&m; /* sentinel: must stay */
	size_t n = 99;
	char err[BD_TOKENIZER_ERR_MAX];
	cr_assert_eq(bd_tokenizer_chat_apply(tok, m, 2, true, &ids, &n, err), -EINVAL);
	cr_assert_str_not_empty(err);
	cr_assert_eq(ids, (int32_t *)&m);
	cr_assert_eq(n, 99);
	cr_assert_eq(bd_tokenizer_chat_apply(tok, NULL, 1, true, &ids, &n, NULL), -EINVAL);
	cr_assert_eq(bd_tokenizer_chat_apply(NULL, m, 1, true, &ids, &n, NULL), -EINVAL);
	cr_assert_eq(bd_tokenizer_chat_apply(tok, m, 1, true, NULL, &n, NULL), -EINVAL);
	char *text = (char *)&m;
	cr_assert_eq(bd_tokenizer_chat_render(tok, m, 2, true, &text, &n, NULL), -EINVAL);
	cr_assert_eq(text, (char *)&m);
	cr_assert_eq(bd_tokenizer_chat_check(NULL, NULL), -EINVAL);
	bd_tokenizer_free(tok);
}

/* ---- bad arguments ----------------------------------------------------------------------- */

Test(tokenizer, bad_arguments)
{
	struct bd_tokenizer *tok = model_tok();
	int32_t *ids = (int32_t *)&tok; /* sentinels */
	size_t n = 99;
	cr_assert_eq(bd_tokenizer_encode(NULL, "a", 1, 0, &ids, &n), -EINVAL);
	cr_assert_eq(bd_tokenizer_encode(tok, NULL, 1, 0, &ids, &n), -EINVAL);
	cr_assert_eq(bd_tokenizer_encode(tok, "a", 1, 0, NULL, &n), -EINVAL);
	cr_assert_eq(bd_tokenizer_encode(tok, "a", 1, 0, &ids, NULL), -EINVAL);
	cr_assert_eq(bd_tokenizer_encode(tok, "a", 1, 1u << 7, &ids, &n), -EINVAL);
	cr_assert_eq(ids, (int32_t *)&tok);
	cr_assert_eq(n, 99);
	/* NULL text of length 0 is the empty text */
	cr_assert_eq(bd_tokenizer_encode(tok, NULL, 0, 0, &ids, &n), 0);
	cr_assert_eq(n, 0);
	free(ids);

	int32_t bad[3] = { 42, 49152, 7 }, neg[1] = { -1 };
	char *text = (char *)&tok;
	size_t len = 99;
	cr_assert_eq(bd_tokenizer_decode(tok, bad, 3, 0, &text, &len), -ERANGE);
	cr_assert_eq(bd_tokenizer_decode(tok, neg, 1, 0, &text, &len), -ERANGE);
	cr_assert_eq(bd_tokenizer_decode(tok, NULL, 1, 0, &text, &len), -EINVAL);
	cr_assert_eq(bd_tokenizer_decode(NULL, bad, 1, 0, &text, &len), -EINVAL);
	cr_assert_eq(bd_tokenizer_decode(tok, bad, 1, 1u << 5, &text, &len), -EINVAL);
	cr_assert_eq(bd_tokenizer_decode(tok, bad, 1, 0, NULL, &len), -EINVAL);
	cr_assert_eq(text, (char *)&tok);
	cr_assert_eq(len, 99);
	cr_assert_eq(bd_tokenizer_decode(tok, NULL, 0, 0, &text, &len), 0);
	cr_assert_eq(len, 0);
	cr_assert_str_eq(text, "");
	free(text);

	const char *s = (const char *)&tok;
	cr_assert_eq(bd_tokenizer_token_text(tok, 49152, &s, &len), -ERANGE);
	cr_assert_eq(bd_tokenizer_token_bytes(tok, -1, &s, &len), -ERANGE);
	cr_assert_eq(bd_tokenizer_token_text(NULL, 0, &s, &len), -EINVAL);
	cr_assert_eq(s, (const char *)&tok);
	cr_assert_eq(bd_tokenizer_token_type(tok, -5), -ERANGE);
	cr_assert_eq(bd_tokenizer_token_type(NULL, 0), -EINVAL);
	cr_assert_eq(bd_tokenizer_find(tok, NULL, 3), -EINVAL);
	cr_assert_eq(bd_tokenizer_n_vocab(NULL), -EINVAL);
	cr_assert_eq(bd_tokenizer_bos(NULL), -1);
	bd_tokenizer_free(NULL);

	struct bd_tokenizer *t2 = (struct bd_tokenizer *)&tok;
	char err[BD_TOKENIZER_ERR_MAX];
	cr_assert_eq(bd_tokenizer_new_from_gguf(NULL, &t2, err), -EINVAL);
	cr_assert_eq(t2, (struct bd_tokenizer *)&tok);
	bd_tokenizer_free(tok);
}

/* ---- a small vocabulary in a GGUF image built here ---------------------------------------- */

static void kv_str(struct gguf_w *m, const char *key, const char *v)
{
	gw_key(m, key, BD_GGUF_STRING);
	gw_cstr(m, v);
}

static void kv_u32(struct gguf_w *m, const char *key, uint32_t v)
{
	gw_key(m, key, BD_GGUF_UINT32);
	gw_u32(m, v);
}

static void kv_strs(struct gguf_w *m, const char *key, char **v, const size_t *len, size_t n)
{
	gw_key(m, key, BD_GGUF_ARRAY);
	gw_u32(m, BD_GGUF_STRING);
	gw_u64(m, n);
	for (size_t i = 0; i < n; i++)
		gw_str(m, v[i], len[i]);
}

static void kv_i32s(struct gguf_w *m, const char *key, const int32_t *v, size_t n)
{
	gw_key(m, key, BD_GGUF_ARRAY);
	gw_u32(m, BD_GGUF_INT32);
	gw_u64(m, n);
	for (size_t i = 0; i < n; i++)
		gw_u32(m, (uint32_t)v[i]);
}

/* What to build; zero fields give the valid default. */
struct mini {
	const char *model;    /* default "gpt2" */
	const char *pre;      /* default "gpt-2"; "-" leaves the key out */
	const char *tpl;      /* chat template; NULL: none */
	const char *merge_extra; /* one more merge string */
	bool no_tokens, tokens_as_ints, short_types, bos_out_of_range;
	bool drop_byte_token; /* the token of "z" becomes "~~" */
};

/* Tokens 0–255: the byte tokens of bytes 0–255 (each byte's GPT-2 character); 256
 * <|im_start|>, 257 <|im_end|>, 258 <|endoftext|> (control); 259 "ab", 260 "bc", 261 "abc",
 * 262 "12". Merges, by rank: "b c", "a b", "a bc", "1 2". bos 256, eos 257. */
#define MINI_N 263
static struct bd_gguf *mini_gguf(const struct mini *o, uint8_t **ret_buf)
{
	struct gguf_w m = { 0 };
	char *tok[MINI_N];
	size_t len[MINI_N];
	int32_t type[MINI_N];
	size_t k = 0;
	unsigned next = 0x100;
	for (unsigned b = 0; b < 256; b++) {
		/* the GPT-2 byte map, written out: printable Latin-1 stays, others from U+0100 */
		bool keep = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
		unsigned cp = keep ? b : next++;
		tok[k] = malloc(3);
		if (cp < 0x80) {
			tok[k][0] = (char)cp;
			len[k] = 1;
		} else {
			tok[k][0] = (char)(0xc0 | cp >> 6);
			tok[k][1] = (char)(0x80 | (cp & 0x3f));
			len[k] = 2;
		}
		type[k++] = BD_TOKEN_NORMAL;
	}
	if (o->drop_byte_token) /* replace the token of "z" by another string */
		tok['z'][0] = '~', tok['z'][1] = '~', len['z'] = 2;
	const char *rest[] = { "<|im_start|>", "<|im_end|>", "<|endoftext|>", "ab", "bc", "abc",
			       "12" };
	for (size_t i = 0; i < 7; i++) {
		tok[k] = strdup(rest[i]);
		len[k] = strlen(rest[i]);
		type[k++] = i < 3 ? BD_TOKEN_CONTROL : BD_TOKEN_NORMAL;
	}
	char *merges[5] = { "b c", "a b", "a bc", "1 2", (char *)o->merge_extra };
	size_t mlen[5];
	for (int i = 0; i < 5; i++)
		mlen[i] = merges[i] ? strlen(merges[i]) : 0;

	kv_str(&m, "tokenizer.ggml.model", o->model ? o->model : "gpt2");
	if (!o->pre || strcmp(o->pre, "-") != 0)
		kv_str(&m, "tokenizer.ggml.pre", o->pre ? o->pre : "gpt-2");
	if (o->tokens_as_ints)
		kv_i32s(&m, "tokenizer.ggml.tokens", type, MINI_N);
	else if (!o->no_tokens)
		kv_strs(&m, "tokenizer.ggml.tokens", tok, len, MINI_N);
	kv_i32s(&m, "tokenizer.ggml.token_type", type, o->short_types ? MINI_N - 1 : MINI_N);
	kv_strs(&m, "tokenizer.ggml.merges", merges, mlen, o->merge_extra ? 5 : 4);
	kv_u32(&m, "tokenizer.ggml.bos_token_id", o->bos_out_of_range ? MINI_N : 256);
	kv_u32(&m, "tokenizer.ggml.eos_token_id", 257);
	if (o->tpl)
		kv_str(&m, "tokenizer.chat_template", o->tpl);
	for (size_t i = 0; i < MINI_N; i++)
		free(tok[i]);

	return open_metadata(&m, ret_buf);
}

static struct bd_tokenizer *mini_tok(const struct mini *o)
{
	uint8_t *buf;
	struct bd_tokenizer *t = tok_of(mini_gguf(o, &buf));
	free(buf);
	return t;
}

static void expect_ids(const struct bd_tokenizer *t, const char *s, unsigned flags,
		       const int32_t *want, size_t n_want)
{
	size_t n;
	int32_t *ids = encode_str(t, s, flags, &n);
	cr_assert(n == n_want && memcmp(ids, want, n * sizeof(int32_t)) == 0,
		  "\"%s\": %zu ids, want %zu (first %d, want %d)", s, n, n_want, n ? ids[0] : -1,
		  want[0]);
	free(ids);
}

Test(tokenizer, mini_merge_order)
{
	struct bd_tokenizer *t = mini_tok(&(struct mini){ 0 });
	cr_assert_eq(bd_tokenizer_n_vocab(t), MINI_N);
	/* "abc": (b,c) has rank 0 and goes first although (a,b) is leftmost, then (a,bc) */
	expect_ids(t, "abc", 0, (int32_t[]){ 261 }, 1);
	/* "abab": (a,b) twice, no (b,a) merge */
	expect_ids(t, "abab", 0, (int32_t[]){ 259, 259 }, 2);
	/* "abcbc": bc at 1 (leftmost of the two rank-0 pairs), bc at 3, then a+bc → abc, bc */
	expect_ids(t, "abcbc", 0, (int32_t[]){ 261, 260 }, 2);
	/* "ab c": the GPT-2 regex cuts "ab" | " c"; byte tokens are ids 0x20 and 'c' */
	expect_ids(t, "ab c", 0, (int32_t[]){ 259, ' ', 'c' }, 3);
	/* gpt-2 keeps digit runs whole: "12" merges */
	expect_ids(t, "12", 0, (int32_t[]){ 262 }, 1);
	/* special text only with the flag; BOS/EOS are not added (add_*_token absent) */
	expect_ids(t, "<|im_end|>x", BD_TOK_PARSE_SPECIAL | BD_TOK_ADD_SPECIAL,
		   (int32_t[]){ 257, 'x' }, 2);
	expect_ids(t, "<|im_end|>", 0,
		   (int32_t[]){ '<', '|', 'i', 'm', '_', 'e', 'n', 'd', '|', '>' }, 10);
	/* eos (257) and <|endoftext|> end generation; bos does not */
	cr_assert(bd_tokenizer_is_eog(t, 257) && bd_tokenizer_is_eog(t, 258));
	cr_assert(!bd_tokenizer_is_eog(t, 256) && !bd_tokenizer_is_eog(t, 259));
	/* no template: the chat functions say so */
	char err[BD_TOKENIZER_ERR_MAX];
	cr_assert_eq(bd_tokenizer_chat_check(t, err), -ENOTSUP);
	cr_assert(strstr(err, "chat_template"), "%s", err);
	int32_t *ids;
	size_t n;
	cr_assert_eq(bd_tokenizer_chat_apply(t, NULL, 0, true, &ids, &n, err), -ENOTSUP);
	bd_tokenizer_free(t);

	/* "smollm": digits are split one by one before the GPT-2 regex, so "12" cannot merge */
	t = mini_tok(&(struct mini){ .pre = "smollm" });
	expect_ids(t, "12", 0, (int32_t[]){ '1', '2' }, 2);
	expect_ids(t, "abc", 0, (int32_t[]){ 261 }, 1);
	bd_tokenizer_free(t);
	/* a byte without a token is left out, and its neighbours merge */
	t = mini_tok(&(struct mini){ .drop_byte_token = true });
	cr_assert_eq(bd_tokenizer_byte_token(t, 'z'), -ENOENT);
	cr_assert_eq(bd_tokenizer_byte_token(t, 'a'), 'a');
	expect_ids(t, "zazbz", 0, (int32_t[]){ 259 }, 1);
	bd_tokenizer_free(t);
	/* no pre key: the GPT-2 regex */
	t = mini_tok(&(struct mini){ .pre = "-" });
	expect_ids(t, "12", 0, (int32_t[]){ 262 }, 1);
	bd_tokenizer_free(t);
}

static void expect_chat(const char *tpl, const struct bd_chat_msg *m, size_t n, bool gen,
			const char *want_text, const int32_t *want, size_t n_want)
{
	struct bd_tokenizer *t = mini_tok(&(struct mini){ .tpl = tpl });
	char err[BD_TOKENIZER_ERR_MAX];
	cr_assert_eq(bd_tokenizer_chat_check(t, err), 0, "%s", err);
	char *text;
	size_t len;
	cr_assert_eq(bd_tokenizer_chat_render(t, m, n, gen, &text, &len, err), 0, "%s", err);
	cr_assert_str_eq(text, want_text);
	free(text);
	if (want) {
		int32_t *ids;
		size_t ni;
		cr_assert_eq(bd_tokenizer_chat_apply(t, m, n, gen, &ids, &ni, err), 0, "%s", err);
		cr_assert(ni == n_want && memcmp(ids, want, ni * sizeof(int32_t)) == 0,
			  "%zu ids, want %zu", ni, n_want);
		free(ids);
	}
	bd_tokenizer_free(t);
}

/* transformers' default ChatML template (no default system message) */
#define CHATML "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + " \
	"message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}" \
	"{{ '<|im_start|>assistant\n' }}{% endif %}"

Test(tokenizer, mini_chat_templates)
{
	/* rendered by hand from the template text */
	struct bd_chat_msg m[2] = { { "ab", "abc" }, { "bc", "<|im_end|>" } };
	/* ids: <|im_start|>=256 "ab"=259 "\n"=byte 0x0a, "abc"=261, <|im_end|>=257; content
	 * "<|im_end|>" is literal bytes */
	const int32_t want[] = { 256, 259, '\n', 261, 257, '\n', 256, 260, '\n', '<', '|', 'i', 'm',
				 '_', 'e', 'n', 'd', '|', '>', 257, '\n' };
	expect_chat(CHATML, m, 2, false,
		    "<|im_start|>ab\nabc<|im_end|>\n<|im_start|>bc\n<|im_end|><|im_end|>\n", want,
		    sizeof(want) / sizeof(want[0]));
	/* the generation prompt, and "assistant" spelled out in byte tokens */
	expect_chat(CHATML, m, 1, true, "<|im_start|>ab\nabc<|im_end|>\n<|im_start|>assistant\n",
		    NULL, 0);

	/* the same template written over several lines with whitespace control and the
	 * attribute syntax: Jinja with trim_blocks and lstrip_blocks renders it identically */
	expect_chat("{%- if not add_generation_prompt is defined %}\n"
		    "  {% set add_generation_prompt = false %}\n"
		    "{% endif %}\n"
		    "{% for message in messages %}\n"
		    "    {{- \"<|im_start|>\" ~ message.role ~ \"\\n\" }}{{ message.content }}"
		    "{{ '<|im_end|>\\n' -}}\n"
		    "{% endfor %}\n"
		    "{% if add_generation_prompt %}\n"
		    "{{ '<|im_start|>assistant\\n' }}\n"
		    "{%- endif %}",
		    m, 1, true, "<|im_start|>ab\nabc<|im_end|>\n<|im_start|>assistant\n", NULL, 0);

	/* SmolLM2's shape: a default system message unless the first message is a system one;
	 * raw text between tags is output as written */
	const char *def = "{% for message in messages %}{% if loop.first and messages[0]['role'] "
			  "!= 'system' %}{{ '<|im_start|>system\nbe ab<|im_end|>\n' }}{% endif %}"
			  "[{{ message['role'] }}]{{ message['content'] }};{% endfor %}"
			  "{% if add_generation_prompt %}>{% endif %}.";
	struct bd_chat_msg s[2] = { { "system", "x" }, { "user", "y" } };
	expect_chat(def, s, 2, true, "[system]x;[user]y;>.", NULL, 0);
	expect_chat(def, s + 1, 1, false, "<|im_start|>system\nbe ab<|im_end|>\n[user]y;.", NULL,
		    0);
	expect_chat(def, NULL, 0, true, ">.", NULL, 0);
}

/* A rendered text that fills its buffer to the last byte (256, 512, ... bytes before the NUL):
 * every length from 1 to 600 renders in full, byte for byte (ASan catches a NUL written past
 * the buffer). */
Test(tokenizer, chat_render_exact_buffer_sizes)
{
	struct bd_tokenizer *t = mini_tok(&(struct mini){ .tpl = CHATML });
	char content[601], want[700], err[BD_TOKENIZER_ERR_MAX];

	memset(content, 'b', sizeof(content));
	for (size_t len = 1; len <= 600; len++) {
		struct bd_chat_msg m = { "ab", content };
		char *text;
		size_t n;
		int w;

		content[len] = 0;
		w = snprintf(want, sizeof(want), "<|im_start|>ab\n%s<|im_end|>\n", content);
		cr_assert_eq(bd_tokenizer_chat_render(t, &m, 1, false, &text, &n, err), 0, "%s", err);
		cr_assert(n == (size_t)w && !memcmp(text, want, n) && text[n] == 0,
			  "content of %zu bytes: %zu bytes rendered, want %d", len, n, w);
		free(text);
		content[len] = 'b';
	}
	bd_tokenizer_free(t);
}

Test(tokenizer, mini_unsupported_templates)
{
	static const char *const bad[] = {
		/* Llama 3 style: conditions on roles and a filter */
		"{% for message in messages %}{% if message['role'] == 'user' %}{{ '<|u|>' + "
		"message['content'] | trim }}{% endif %}{% endfor %}",
		/* raise_exception */
		"{{ raise_exception('no') }}",
		/* a loop over something else */
		"{% for m in msgs %}{{ m }}{% endfor %}",
		/* unterminated tag */
		"{% for message in messages %}{{ message['content'] ",
		/* an unknown escape in a literal */
		"{% for message in messages %}{{ '\\q' }}{% endfor %}",
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		struct bd_tokenizer *t = mini_tok(&(struct mini){ .tpl = bad[i] });
		char err[BD_TOKENIZER_ERR_MAX] = "";
		cr_assert_eq(bd_tokenizer_chat_check(t, err), -ENOTSUP, "template %zu", i);
		cr_assert(strstr(err, "chat template"), "template %zu: message \"%s\"", i, err);
		struct bd_chat_msg m = { "user", "hi" };
		int32_t *ids = (int32_t *)&m;
		size_t n = 5;
		err[0] = '\0';
		cr_assert_eq(bd_tokenizer_chat_apply(t, &m, 1, true, &ids, &n, err), -ENOTSUP);
		cr_assert_str_not_empty(err);
		cr_assert_eq(ids, (int32_t *)&m);
		cr_assert_eq(n, 5);
		bd_tokenizer_free(t);
	}
}

Test(tokenizer, mini_malformed_metadata)
{
	static const struct {
		struct mini o;
		int err;
		const char *msg; /* a word the message must hold */
	} cases[] = {
		{ { .model = "llama" }, -ENOTSUP, "llama" },
		{ { .pre = "no-such-pre" }, -ENOTSUP, "no-such-pre" },
		{ { .no_tokens = true }, -EBADMSG, "tokens" },
		{ { .tokens_as_ints = true }, -EBADMSG, "tokens" },
		{ { .short_types = true }, -EBADMSG, "token_type" },
		{ { .merge_extra = "abc" }, -EBADMSG, "merges[4]" },
		{ { .merge_extra = "a " }, -EBADMSG, "merges[4]" },
		{ { .merge_extra = "a zz" }, -EBADMSG, "merges[4]" },
		{ { .merge_extra = "ab ab" }, -EBADMSG, "merges[4]" }, /* "abab" is no token */
		{ { .bos_out_of_range = true }, -EBADMSG, "bos_token_id" },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		uint8_t *buf;
		struct bd_gguf *g = mini_gguf(&cases[i].o, &buf);
		struct bd_tokenizer *t = (struct bd_tokenizer *)&buf;
		char err[BD_TOKENIZER_ERR_MAX] = "";
		cr_assert_eq(bd_tokenizer_new_from_gguf(g, &t, err), cases[i].err, "case %zu: %s",
			     i, err);
		cr_assert_eq(t, (struct bd_tokenizer *)&buf, "case %zu wrote *ret", i);
		cr_assert(strstr(err, cases[i].msg), "case %zu: message \"%s\"", i, err);
		bd_gguf_free(g);
		free(buf);
	}
}

/* ---- other pre-tokenizers and tokenizer.json, over the embedded model's vocabulary -------- */

static void kv_gstrs(struct gguf_w *m, const char *key, const struct bd_gguf_kv *kv)
{
	gw_key(m, key, BD_GGUF_ARRAY);
	gw_u32(m, BD_GGUF_STRING);
	gw_u64(m, kv->n);
	for (size_t i = 0; i < kv->n; i++)
		gw_str(m, kv->strs[i].s, kv->strs[i].len);
}

/* The model's tokenizer metadata with another tokenizer.ggml.pre. */
static struct bd_tokenizer *model_tok_with_pre(const char *pre)
{
	struct bd_gguf *src = td_open_model();
	const struct bd_gguf_kv *toks = bd_gguf_find_kv(src, "tokenizer.ggml.tokens");
	const struct bd_gguf_kv *types = bd_gguf_find_kv(src, "tokenizer.ggml.token_type");
	const struct bd_gguf_kv *merges = bd_gguf_find_kv(src, "tokenizer.ggml.merges");
	cr_assert(toks && types && merges);
	struct gguf_w m = { 0 };
	kv_str(&m, "tokenizer.ggml.model", "gpt2");
	kv_str(&m, "tokenizer.ggml.pre", pre);
	kv_gstrs(&m, "tokenizer.ggml.tokens", toks);
	kv_gstrs(&m, "tokenizer.ggml.merges", merges);
	int32_t *ty = malloc(types->n * sizeof(int32_t));
	for (size_t i = 0; i < types->n; i++) {
		int64_t v;
		cr_assert_eq(bd_gguf_arr_int(types, i, &v), 0);
		ty[i] = (int32_t)v;
	}
	kv_i32s(&m, "tokenizer.ggml.token_type", ty, types->n);
	free(ty);
	bd_gguf_free(src);

	uint8_t *buf;
	struct bd_tokenizer *t = tok_of(open_metadata(&m, &buf));
	free(buf);
	return t;
}

static void check_golden_ids(const struct bd_tokenizer *t, const char *field)
{
	json_t *gold = golden();
	size_t i, differ = 0;
	json_t *c;
	json_array_foreach(json_object_get(gold, "encode"), i, c) {
		const char *name = json_string_value(json_object_get(c, "name"));
		json_t *text = json_object_get(c, "text");
		int32_t *ids;
		size_t n;
		cr_assert_eq(bd_tokenizer_encode(t, json_string_value(text), json_string_length(text),
						 0, &ids, &n), 0);
		char what[128];
		snprintf(what, sizeof(what), "%s (%s)", name, field);
		assert_ids(ids, n, json_object_get(c, field), what);
		differ += !json_equal(json_object_get(c, field), json_object_get(c, "ids"));
		free(ids);
	}
	/* the other regexes do cut differently somewhere (Qwen2: 7 strings), or nothing would
	 * be shown */
	if (strcmp(field, "ids_qwen2") == 0)
		cr_assert_gt(differ, 0);
	json_decref(gold);
}

Test(tokenizer, gguf_other_pre_tokenizers)
{
	struct bd_tokenizer *t = model_tok_with_pre("qwen2");
	check_golden_ids(t, "ids_qwen2");
	bd_tokenizer_free(t);
	t = model_tok_with_pre("llama-bpe");
	check_golden_ids(t, "ids_llama3");
	bd_tokenizer_free(t);
}

struct tmpdir {
	char dir[64];
	char tok[128], cfg[128];
};

static void tmp_make(struct tmpdir *d)
{
	snprintf(d->dir, sizeof(d->dir), "/tmp/bd_tok_XXXXXX");
	cr_assert_not_null(mkdtemp(d->dir));
	snprintf(d->tok, sizeof(d->tok), "%s/tokenizer.json", d->dir);
	snprintf(d->cfg, sizeof(d->cfg), "%s/tokenizer_config.json", d->dir);
}

static void tmp_clean(struct tmpdir *d)
{
	unlink(d->tok);
	unlink(d->cfg);
	rmdir(d->dir);
}

static void write_text(const char *path, const char *text)
{
	FILE *f = fopen(path, "w");
	cr_assert_not_null(f);
	fputs(text, f);
	fclose(f);
}

/* tokenizer.json of a golden variant: tokenizers' own file, with the model's vocabulary and
 * merges (as [A, B] pairs) put back; tokenizer_config.json with SmolLM2's specials and the
 * GGUF's chat template. */
static void write_model_json(const struct tmpdir *d, const char *variant)
{
	json_t *gold = golden();
	json_t *root = json_deep_copy(json_object_get(json_object_get(gold, "tokenizer_json"),
						      variant));
	cr_assert_not_null(root);
	struct bd_gguf *g = td_open_model();
	const struct bd_gguf_kv *toks = bd_gguf_find_kv(g, "tokenizer.ggml.tokens");
	const struct bd_gguf_kv *merges = bd_gguf_find_kv(g, "tokenizer.ggml.merges");
	json_t *vocab = json_object(), *mj = json_array();
	for (size_t i = 0; i < toks->n; i++)
		json_object_setn_new(vocab, toks->strs[i].s, toks->strs[i].len, json_integer(i));
	for (size_t i = 0; i < merges->n; i++) {
		const char *s = merges->strs[i].s, *sp = memchr(s + 1, ' ', merges->strs[i].len - 1);
		json_array_append_new(mj, json_pack("[s#s#]", s, (int)(sp - s), sp + 1,
						    (int)(merges->strs[i].len - (size_t)(sp - s) - 1)));
	}
	json_t *model = json_object_get(root, "model");
	json_object_set_new(model, "vocab", vocab);
	json_object_set_new(model, "merges", mj);
	cr_assert_eq(json_dump_file(root, d->tok, 0), 0);

	struct bd_gguf_str tpl;
	cr_assert_eq(bd_gguf_get_str(g, "tokenizer.chat_template", &tpl), 0);
	json_t *cfg = json_pack("{s:s, s:{s:s}, s:s, s:b, s:s#}", "bos_token", "<|im_start|>",
				"eos_token", "content", "<|im_end|>", "pad_token", "<|im_end|>",
				"add_bos_token", 0, "chat_template", tpl.s, (int)tpl.len);
	cr_assert_not_null(cfg);
	cr_assert_eq(json_dump_file(cfg, d->cfg, 0), 0);
	json_decref(cfg);
	json_decref(root);
	json_decref(gold);
	bd_gguf_free(g);
}

Test(tokenizer, json_model_golden)
{
	struct tmpdir d;
	tmp_make(&d);
	write_model_json(&d, "smollm");
	struct bd_tokenizer *t = NULL;
	char err[BD_TOKENIZER_ERR_MAX];
	cr_assert_eq(bd_tokenizer_new_from_json(d.tok, d.cfg, &t, err), 0, "%s", err);
	cr_assert_eq(bd_tokenizer_n_vocab(t), 49152);
	cr_assert_eq(bd_tokenizer_bos(t), 1);
	cr_assert_eq(bd_tokenizer_eos(t), 2);
	cr_assert_eq(bd_tokenizer_pad(t), 2);
	cr_assert_eq(bd_tokenizer_token_type(t, 2), BD_TOKEN_CONTROL);
	cr_assert(bd_tokenizer_is_eog(t, 2) && bd_tokenizer_is_eog(t, 0));
	check_golden_ids(t, "ids");

	/* chat, from tokenizer_config.json's template */
	json_t *gold = golden();
	size_t i;
	json_t *c;
	json_array_foreach(json_object_get(gold, "chat"), i, c) {
		json_t *jm = json_object_get(c, "messages");
		struct bd_chat_msg msgs[8];
		size_t nm = json_array_size(jm);
		for (size_t k = 0; k < nm; k++) {
			msgs[k].role = json_string_value(json_object_get(json_array_get(jm, k), "role"));
			msgs[k].content =
				json_string_value(json_object_get(json_array_get(jm, k), "content"));
		}
		int32_t *ids;
		size_t n;
		cr_assert_eq(bd_tokenizer_chat_apply(t, msgs, nm,
						     json_is_true(json_object_get(
							     c, "add_generation_prompt")),
						     &ids, &n, err), 0, "%s", err);
		assert_ids(ids, n, json_object_get(c, "ids"),
			   json_string_value(json_object_get(c, "name")));
		free(ids);
	}
	json_decref(gold);
	bd_tokenizer_free(t);

	/* without a config: no specials, no template */
	cr_assert_eq(bd_tokenizer_new_from_json(d.tok, NULL, &t, err), 0, "%s", err);
	cr_assert_eq(bd_tokenizer_bos(t), -1);
	cr_assert_eq(bd_tokenizer_chat_check(t, err), -ENOTSUP);
	bd_tokenizer_free(t);
	tmp_clean(&d);
}

Test(tokenizer, json_other_pre_tokenizers)
{
	static const char *const v[][2] = { { "qwen2", "ids_qwen2" }, { "llama3", "ids_llama3" } };
	for (int k = 0; k < 2; k++) {
		struct tmpdir d;
		tmp_make(&d);
		write_model_json(&d, v[k][0]);
		struct bd_tokenizer *t = NULL;
		char err[BD_TOKENIZER_ERR_MAX];
		cr_assert_eq(bd_tokenizer_new_from_json(d.tok, NULL, &t, err), 0, "%s", err);
		check_golden_ids(t, v[k][1]);
		bd_tokenizer_free(t);
		tmp_clean(&d);
	}
}

/* The mini vocabulary as tokenizer.json text: bytes a b c 1 2 and space, merges as strings. */
#define MINI_JSON(pre, extra) \
	"{\"added_tokens\": [{\"id\": 9, \"content\": \"<|im_end|>\", \"special\": true}," \
	" {\"id\": 10, \"content\": \"<x>\", \"special\": false}]," \
	" \"normalizer\": null, \"pre_tokenizer\": " pre "," \
	" \"model\": {\"type\": \"BPE\", " extra " \"vocab\": {\"a\": 0, \"b\": 1, \"c\": 2," \
	" \"1\": 3, \"2\": 4, \"\\u0120\": 5, \"ab\": 6, \"bc\": 7, \"abc\": 8, \"12\": 11}," \
	" \"merges\": [\"b c\", \"a b\", \"a bc\", \"1 2\"]}}"
#define BYTELEVEL "{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"use_regex\": true}"

Test(tokenizer, json_mini)
{
	struct tmpdir d;
	tmp_make(&d);
	char err[BD_TOKENIZER_ERR_MAX];
	struct bd_tokenizer *t = NULL;

	/* hand-derived as in mini_merge_order; "z" has no token and there is no unk: left out */
	write_text(d.tok, MINI_JSON(BYTELEVEL, ""));
	cr_assert_eq(bd_tokenizer_new_from_json(d.tok, NULL, &t, err), 0, "%s", err);
	cr_assert_eq(bd_tokenizer_n_vocab(t), 12);
	expect_ids(t, "abcbc", 0, (int32_t[]){ 8, 7 }, 2);
	expect_ids(t, "zabz 12", 0, (int32_t[]){ 6, 5, 11 }, 3);
	expect_ids(t, "<x><|im_end|>", BD_TOK_PARSE_SPECIAL, (int32_t[]){ 10, 9 }, 2);
	cr_assert_eq(bd_tokenizer_token_type(t, 10), BD_TOKEN_USER_DEFINED);
	bd_tokenizer_free(t);

	/* an unknown token, fused over a run of unknown bytes */
	write_text(d.tok, MINI_JSON(BYTELEVEL, "\"unk_token\": \"<x>\", \"fuse_unk\": true,"));
	cr_assert_eq(bd_tokenizer_new_from_json(d.tok, NULL, &t, err), 0, "%s", err);
	expect_ids(t, "azzb", 0, (int32_t[]){ 0, 10, 1 }, 3);
	bd_tokenizer_free(t);
	write_text(d.tok, MINI_JSON(BYTELEVEL, "\"unk_token\": \"<x>\","));
	cr_assert_eq(bd_tokenizer_new_from_json(d.tok, NULL, &t, err), 0, "%s", err);
	expect_ids(t, "azzb", 0, (int32_t[]){ 0, 10, 10, 1 }, 4);
	bd_tokenizer_free(t);

	/* Digits then ByteLevel (SmolLM's shape): "12" no longer merges */
	write_text(d.tok, MINI_JSON("{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": "
				    "\"Digits\", \"individual_digits\": true}, " BYTELEVEL "]}", ""));
	cr_assert_eq(bd_tokenizer_new_from_json(d.tok, NULL, &t, err), 0, "%s", err);
	expect_ids(t, "12", 0, (int32_t[]){ 3, 4 }, 2);
	bd_tokenizer_free(t);

	/* config: eos by content object, template absent */
	write_text(d.tok, MINI_JSON(BYTELEVEL, ""));
	write_text(d.cfg, "{\"eos_token\": {\"content\": \"<|im_end|>\"}, \"bos_token\": null}");
	cr_assert_eq(bd_tokenizer_new_from_json(d.tok, d.cfg, &t, err), 0, "%s", err);
	cr_assert_eq(bd_tokenizer_eos(t), 9);
	cr_assert_eq(bd_tokenizer_bos(t), -1);
	cr_assert_eq(bd_tokenizer_chat_check(t, err), -ENOTSUP);
	bd_tokenizer_free(t);
	tmp_clean(&d);
}

Test(tokenizer, json_malformed)
{
	static const struct {
		const char *tok, *cfg;
		int err;
		const char *msg;
	} cases[] = {
		{ "{\"model\": ", NULL, -EBADMSG, "tokenizer.json" },
		{ "[1, 2]", NULL, -EBADMSG, "not a JSON object" },
		{ "{\"model\": {\"type\": \"WordPiece\", \"vocab\": {}}}", NULL, -ENOTSUP,
		  "WordPiece" },
		{ "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}}}", NULL, -EBADMSG,
		  "merges" },
		{ MINI_JSON("{\"type\": \"Metaspace\"}", ""), NULL, -ENOTSUP, "Metaspace" },
		{ MINI_JSON("{\"type\": \"Sequence\", \"pretokenizers\": [" BYTELEVEL ", {\"type\": "
			    "\"Digits\"}]}", ""), NULL, -ENOTSUP, "ByteLevel" },
		{ MINI_JSON("{\"type\": \"ByteLevel\", \"add_prefix_space\": true}", ""), NULL,
		  -ENOTSUP, "add_prefix_space" },
		{ MINI_JSON(BYTELEVEL, "\"byte_fallback\": true,"), NULL, -ENOTSUP, "byte_fallback" },
		{ MINI_JSON(BYTELEVEL, "\"unk_token\": \"<nope>\","), NULL, -EBADMSG, "unk_token" },
		{ MINI_JSON(BYTELEVEL, "\"unk_token\": 7,"), NULL, -EBADMSG, "unk_token" },
		{ MINI_JSON(BYTELEVEL, ""), "{\"eos_token\": \"<nope>\"}", -EBADMSG, "eos_token" },
		{ MINI_JSON(BYTELEVEL, ""), "{\"add_bos_token\": 1}", -EBADMSG, "add_bos_token" },
		{ MINI_JSON(BYTELEVEL, ""), "{\"add_bos_token\": true}", -EBADMSG, "add_bos" },
		{ "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": "
		  "[\"a b\"]}, \"pre_tokenizer\": " BYTELEVEL "}", NULL, -EBADMSG, "merges[0]" },
		{ "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [[\"a\"]]}, "
		  "\"pre_tokenizer\": " BYTELEVEL "}", NULL, -EBADMSG, "merges[0]" },
		{ "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": -3}, \"merges\": []}}", NULL,
		  -EBADMSG, "model.vocab" },
		{ "{\"normalizer\": {\"type\": \"Lowercase\"}, \"model\": {\"type\": \"BPE\", "
		  "\"vocab\": {\"a\": 0}, \"merges\": []}}", NULL, -ENOTSUP, "Lowercase" },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		struct tmpdir d;
		tmp_make(&d);
		write_text(d.tok, cases[i].tok);
		if (cases[i].cfg)
			write_text(d.cfg, cases[i].cfg);
		struct bd_tokenizer *t = (struct bd_tokenizer *)&d;
		char err[BD_TOKENIZER_ERR_MAX] = "";
		cr_assert_eq(bd_tokenizer_new_from_json(d.tok, cases[i].cfg ? d.cfg : NULL, &t, err),
			     cases[i].err, "case %zu: %s", i, err);
		cr_assert_eq(t, (struct bd_tokenizer *)&d, "case %zu wrote *ret", i);
		cr_assert(strstr(err, cases[i].msg), "case %zu: message \"%s\"", i, err);
		tmp_clean(&d);
	}
	struct bd_tokenizer *t = NULL;
	char err[BD_TOKENIZER_ERR_MAX];
	cr_assert_eq(bd_tokenizer_new_from_json("/nonexistent/tokenizer.json", NULL, &t, err),
		     -ENOENT);
	cr_assert_null(t);
	cr_assert_eq(bd_tokenizer_new_from_json(NULL, NULL, &t, err), -EINVAL);
	cr_assert_eq(bd_tokenizer_new_from_json("x", NULL, NULL, err), -EINVAL);
}
