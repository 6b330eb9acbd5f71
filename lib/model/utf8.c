/* utf8.c — UTF-8: one BMP character written or read, whether bytes are UTF-8 (bd_utf8.h), and the stream decoder that
 * turns generated tokens into valid UTF-8 chunks (bd_tokenizer.h, bd_tokenizer_stream_*). */
#include <errno.h>
#include <stdio.h>
#include <stdbool.h>
#include <string.h>

#include "model/bd_tokenizer.h"
#include "model/bd_utf8.h"

size_t bd_utf8_put_bmp(char out[3], uint32_t cp)
{
	if (cp < 0x80) {
		out[0] = (char)cp;
		return 1;
	}
	if (cp < 0x800) {
		out[0] = (char)(0xc0 | cp >> 6);
		out[1] = (char)(0x80 | (cp & 0x3f));
		return 2;
	}
	out[0] = (char)(0xe0 | cp >> 12);
	out[1] = (char)(0x80 | (cp >> 6 & 0x3f));
	out[2] = (char)(0x80 | (cp & 0x3f));
	return 3;
}

size_t bd_utf8_get_bmp(const char *s, size_t n, uint32_t *ret_cp)
{
	const uint8_t *u = (const uint8_t *)s;
	if (n >= 1 && u[0] < 0x80) {
		*ret_cp = u[0];
		return 1;
	}
	if (n >= 2 && u[0] >= 0xc2 && u[0] <= 0xdf && (u[1] & 0xc0) == 0x80) {
		*ret_cp = (uint32_t)(u[0] & 0x1f) << 6 | (u[1] & 0x3f);
		return 2;
	}
	if (n >= 3 && (u[0] & 0xf0) == 0xe0 && (u[1] & 0xc0) == 0x80 && (u[2] & 0xc0) == 0x80) {
		uint32_t c = (uint32_t)(u[0] & 0x0f) << 12 | (uint32_t)(u[1] & 0x3f) << 6 |
			     (u[2] & 0x3f);
		if (c < 0x800 || (c >= 0xd800 && c <= 0xdfff))
			return 0;
		*ret_cp = c;
		return 3;
	}
	return 0; /* 4-byte characters are never byte-map characters */
}

/* ---- the stream decoder -------------------------------------------------------------------- */

void bd_tokenizer_stream_init(struct bd_tok_stream *s, unsigned flags)
{
	if (s)
		*s = (struct bd_tok_stream){ .flags = flags };
}

size_t bd_tokenizer_stream_cap(const struct bd_tokenizer *t)
{
	return t ? 3 * (bd_tokenizer_max_token_bytes(t) + 3) : 0;
}

/* Length of the UTF-8 sequence a lead byte starts, 0 if it cannot start one. */
static int utf8_len(uint8_t b)
{
	return b < 0x80 ? 1 : b >= 0xc2 && b <= 0xdf ? 2 : b >= 0xe0 && b <= 0xef ? 3
		: b >= 0xf0 && b <= 0xf4 ? 4 : 0;
}

/* Whether b can follow the bytes p[k] of a sequence (k ≥ 1): the second byte's range depends
 * on the lead (no overlong forms, no surrogates, nothing above U+10FFFF). */
static bool utf8_cont(const uint8_t *p, int k, uint8_t b)
{
	if (k == 1) {
		uint8_t lo = 0x80, hi = 0xbf;
		if (p[0] == 0xe0)
			lo = 0xa0;
		else if (p[0] == 0xed)
			hi = 0x9f;
		else if (p[0] == 0xf0)
			lo = 0x90;
		else if (p[0] == 0xf4)
			hi = 0x8f;
		return b >= lo && b <= hi;
	}
	return b >= 0x80 && b <= 0xbf;
}

bool bd_utf8_valid(const char *s, size_t n)
{
	const uint8_t *u = (const uint8_t *)s;

	for (size_t i = 0; i < n;) {
		int len = utf8_len(u[i]);

		if (!len || (size_t)len > n - i)
			return false;
		for (int k = 1; k < len; k++)
			if (!utf8_cont(u + i, k, u[i + (size_t)k]))
				return false;
		i += (size_t)len;
	}
	return true;
}

const char *bd_utf8_or_bytes(const char *piece, size_t len, char *buf, size_t cap)
{
	size_t n;

	if (bd_utf8_valid(piece, len)) {
		n = len < cap - 1 ? len : cap - 1;
		if (n)
			memcpy(buf, piece, n);
		buf[n] = 0;
		return buf;
	}
	n = (size_t)snprintf(buf, cap, "bytes:");
	for (size_t i = 0; i < len && n + 4 < cap; i++)
		n += (size_t)snprintf(buf + n, cap - n, "\\x%02x", (unsigned char)piece[i]);
	return buf;
}

struct sink {
	char *buf;
	size_t cap, n;
	bool over;
};

static void sink_put(struct sink *k, const void *s, size_t n)
{
	if (n > k->cap - k->n) {
		k->over = true;
		return;
	}
	memcpy(k->buf + k->n, s, n);
	k->n += n;
}

static const char REPLACEMENT[3] = { (char)0xef, (char)0xbf, (char)0xbd }; /* U+FFFD */

static void stream_byte(struct bd_tok_stream *s, uint8_t b, struct sink *k)
{
	if (s->n_pend) {
		if (utf8_cont(s->pend, s->n_pend, b)) {
			if (s->n_pend + 1 == utf8_len(s->pend[0])) {
				sink_put(k, s->pend, s->n_pend);
				sink_put(k, &b, 1);
				s->n_pend = 0;
			} else {
				s->pend[s->n_pend++] = b;
			}
			return;
		}
		/* the held bytes are a maximal invalid subpart; b starts afresh */
		sink_put(k, REPLACEMENT, 3);
		s->n_pend = 0;
	}
	int l = utf8_len(b);
	if (l == 1)
		sink_put(k, &b, 1);
	else if (l == 0)
		sink_put(k, REPLACEMENT, 3);
	else
		s->pend[s->n_pend++] = b;
}

int bd_tokenizer_stream_push(const struct bd_tokenizer *t, struct bd_tok_stream *s, int32_t id,
			     char *buf, size_t cap, size_t *ret_n)
{
	if (!t || !s || (!buf && cap) || !ret_n || s->n_pend > 3)
		return -EINVAL;
	const char *p;
	size_t n;
	if (bd_tokenizer_token_bytes(t, id, &p, &n) < 0)
		return -ERANGE;
	struct bd_tok_stream st = *s;
	struct sink k = { .buf = buf, .cap = cap };
	bool skip = (st.flags & BD_TOK_SKIP_SPECIAL) &&
		    bd_tokenizer_token_type(t, id) == BD_TOKEN_CONTROL;
	for (size_t i = 0; !skip && i < n; i++)
		stream_byte(&st, (uint8_t)p[i], &k);
	if (k.over)
		return -ENOBUFS;
	*s = st;
	*ret_n = k.n;
	return 0;
}

int bd_tokenizer_stream_flush(struct bd_tok_stream *s, char *buf, size_t cap, size_t *ret_n)
{
	if (!s || (!buf && cap) || !ret_n)
		return -EINVAL;
	size_t n = s->n_pend ? 3 : 0;
	if (n > cap)
		return -ENOBUFS;
	if (n)
		memcpy(buf, REPLACEMENT, 3);
	s->n_pend = 0;
	*ret_n = n;
	return 0;
}
