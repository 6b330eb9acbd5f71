/* bd_utf8.h — the small UTF-8 pieces the tokenizer and the chat template share: one character
 * of the Basic Multilingual Plane written or read, whether bytes are UTF-8, and their display form. (The stream decoder of generated tokens,
 * which turns any bytes into valid UTF-8, is bd_tokenizer.h's bd_tokenizer_stream_*.)
 */
#ifndef BD_UTF8_H
#define BD_UTF8_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Writes code point cp (< 0x10000; a surrogate is written as its 3 bytes) to out[0..3) as
 * UTF-8 and returns the byte count, 1 to 3. */
size_t bd_utf8_put_bmp(char out[3], uint32_t cp);

/* Reads one character of s[n] that is valid, shortest-form UTF-8 of at most 3 bytes (no
 * surrogates) into *ret_cp and returns its length, or 0 (n = 0, invalid, or a 4-byte
 * character: *ret_cp is then not written). */
size_t bd_utf8_get_bmp(const char *s, size_t n, uint32_t *ret_cp);

/* Whether s[n] is valid UTF-8 (shortest forms, no surrogates, nothing above U+10FFFF; NUL
 * bytes are characters). s may be NULL when n is 0. */
bool bd_utf8_valid(const char *s, size_t n);

/* The display form of bytes s[n] (a token's piece): the bytes themselves when they are valid
 * UTF-8, else "bytes:" and "\\xNN" for each byte (how OpenAI's API shows a byte token cut out
 * of a character). Writes it NUL-terminated into buf[cap] (cut to fit; cap ≥ 1) and returns
 * buf. */
const char *bd_utf8_or_bytes(const char *s, size_t n, char *buf, size_t cap);

#ifdef __cplusplus
}
#endif
#endif
