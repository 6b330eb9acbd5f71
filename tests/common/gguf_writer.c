/* gguf_writer.c — GGUF images written by hand (gguf_writer.h). */
#include <stdlib.h>
#include <string.h>

#include <criterion/criterion.h>

#include "gguf_writer.h"

void gw_put(struct gguf_w *w, const void *s, size_t n)
{
	if (w->n + n > w->cap) {
		w->cap = (w->n + n) * 2 + 64;
		w->p = realloc(w->p, w->cap);
		cr_assert_not_null(w->p);
	}
	if (n)
		memcpy(w->p + w->n, s, n);
	w->n += n;
}

void gw_le(struct gguf_w *w, uint64_t v, int bytes)
{
	uint8_t b[8];
	for (int i = 0; i < bytes; i++)
		b[i] = (uint8_t)(v >> (8 * i));
	gw_put(w, b, (size_t)bytes);
}

void gw_u32(struct gguf_w *w, uint32_t v)
{
	gw_le(w, v, 4);
}

void gw_u64(struct gguf_w *w, uint64_t v)
{
	gw_le(w, v, 8);
}

void gw_str(struct gguf_w *w, const char *s, size_t n)
{
	gw_u64(w, n);
	gw_put(w, s, n);
}

void gw_cstr(struct gguf_w *w, const char *s)
{
	gw_str(w, s, strlen(s));
}

void gw_key(struct gguf_w *w, const char *key, uint32_t type)
{
	gw_cstr(w, key);
	gw_u32(w, type);
	w->keys++;
}
