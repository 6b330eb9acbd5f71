/* bd_utf8.h — the small UTF-8 pieces the tokenizer and the chat template share: one character
 * of the Basic Multilingual Plane written or read. (The stream decoder of generated tokens,
 * which turns any bytes into valid UTF-8, is bd_tokenizer.h's bd_tokenizer_stream_*.)
 */
#ifndef BD_UTF8_H
#define BD_UTF8_H

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

#ifdef __cplusplus
}
#endif
#endif
