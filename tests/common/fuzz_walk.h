/* fuzz_walk.h — what the weight-format fuzzers (tests/fuzz/fuzz_gguf.c, fuzz_safetensors.c)
 * check alike, header-only so that each links nothing more: every byte a parsed handle hands
 * out is read, a refusal always says why (and a success says nothing), and a tensor's first
 * and last rows convert.
 */
#ifndef TEST_FUZZ_WALK_H
#define TEST_FUZZ_WALK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static volatile uint64_t fw_sink; /* keeps the reads from being optimized away */

/* Reads p[0..n). */
static inline void fw_touch(const void *p, size_t n)
{
	const uint8_t *b = p;
	for (size_t i = 0; i < n; i++)
		fw_sink += b[i];
}

/* What a parser's open over the input returned: r, and its message buffer err of cap bytes.
 * True when it made a handle, whose message must then be the empty string; false for a
 * refusal, whose message must be non-empty and terminated. Aborts on either breach. */
static inline bool fw_opened(int r, const char *err, size_t cap)
{
	if (!memchr(err, 0, cap) || (r >= 0) != (err[0] == 0))
		abort();
	return r >= 0;
}

/* Converts the first and the last row of a tensor of n_elements in rows of cols elements,
 * when a row fits FW_ROW_MAX floats: rows_f32(t, row0, n_rows, out) is the format's
 * converter (its errors are the parser's business, not a failure here). */
#define FW_ROW_MAX (1 << 16)
typedef int (*fw_rows_fn)(const void *t, uint64_t row0, uint64_t n_rows, float *out);

static inline void fw_first_last_rows(fw_rows_fn rows_f32, const void *t, uint64_t cols,
				      uint64_t n_elements)
{
	static float row[FW_ROW_MAX];
	if (cols == 0 || cols > FW_ROW_MAX || n_elements == 0)
		return;
	uint64_t rows = n_elements / cols;
	if (rows_f32(t, 0, 1, row) == 0 && rows > 1)
		(void)rows_f32(t, rows - 1, 1, row);
}

#endif
