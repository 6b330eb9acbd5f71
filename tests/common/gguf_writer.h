/* gguf_writer.h — GGUF images written by hand, for the tests of the GGUF parser and of the
 * tokenizer's GGUF front end: a growing buffer of little-endian values, GGUF strings and
 * metadata keys. What goes where (header, entries, tensor infos, data) is the test's own.
 */
#ifndef TEST_GGUF_WRITER_H
#define TEST_GGUF_WRITER_H

#include <stddef.h>
#include <stdint.h>

/* The image; zero-initialize it, free p when done. */
struct gguf_w {
	uint8_t *p;
	size_t n, cap; /* bytes written, bytes allocated */
	uint64_t keys; /* metadata keys written by gw_key */
};

/* Appends s[n]; the buffer grows as needed (an allocation failure fails the test). */
void gw_put(struct gguf_w *w, const void *s, size_t n);

/* Appends the low `bytes` bytes of v, little-endian. */
void gw_le(struct gguf_w *w, uint64_t v, int bytes);
void gw_u32(struct gguf_w *w, uint32_t v);
void gw_u64(struct gguf_w *w, uint64_t v);

/* A GGUF string: its u64 length, then s[n] (gw_cstr: a NUL-terminated s, NUL left out). */
void gw_str(struct gguf_w *w, const char *s, size_t n);
void gw_cstr(struct gguf_w *w, const char *s);

/* A metadata key and its u32 value type; the value comes next. Counts keys. */
void gw_key(struct gguf_w *w, const char *key, uint32_t type);

#endif
