/* fuzz_chat.c — libFuzzer target for the chat template engine (model/bd_chat_template.h) and
 * the tokenizer's chat path (bd_tokenizer_chat_apply/_render) with the embedded model.
 *
 * Build and run: `make fuzz-chat`. An input is a template text, a NUL byte, then messages
 * "role\x01content" separated by NUL bytes. Checks: a template is recognized or refused with a
 * message; a recognized one runs over the messages with every piece inside what it was given
 * (template pieces from the template's literals, user pieces exactly a role or a content); the
 * model's own template applied to the messages gives ids that decode to the text it renders
 * (less the bytes the vocabulary has no token for) when no content holds special-token text.
 */
#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "model/bd_chat_template.h"
#define FZ_TOK_INITIALIZE
#include "fuzz_model_tok.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
#define MAX_MSGS 8

struct pieces {
	const struct bd_chat_msg *m;
	size_t n_m, n_user, tpl_bytes;
};

static int on_tpl(void *ctx, const char *s, size_t n)
{
	struct pieces *p = ctx;

	if (n && !s)
		abort();
	p->tpl_bytes += n;
	return 0;
}

/* a user piece is one whole role or content of one of the messages */
static int on_user(void *ctx, const char *s, size_t n)
{
	struct pieces *p = ctx;

	for (size_t i = 0; i < p->n_m; i++)
		if ((s == p->m[i].role && n == strlen(s)) || (s == p->m[i].content && n == strlen(s))) {
			p->n_user++;
			return 0;
		}
	abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char *buf = malloc(size + 1), err[BD_CHAT_ERR_MAX], terr[BD_TOKENIZER_ERR_MAX];
	struct bd_chat_msg m[MAX_MSGS];
	struct bd_chat_template *c = NULL;
	/* a tokenizer with BOS/EOS texts, or with none (its template must not use them) */
	struct bd_chat_specials sp = { "<s>", 3, "</s>", 4 }, none = { NULL, 0, NULL, 0 };
	size_t tpl_len, n_m = 0;
	bool special_text = false;
	int e;

	if (!buf)
		abort();
	memcpy(buf, data, size);
	buf[size] = 0;
	tpl_len = strlen(buf);
	for (size_t p = tpl_len + 1; p < size && n_m < MAX_MSGS; p += strlen(buf + p) + 1) {
		char *sep = strchr(buf + p, '\x01');

		m[n_m].role = buf + p;
		m[n_m].content = "";
		if (sep) {
			*sep = 0;
			m[n_m].content = sep + 1;
		}
		special_text |= strstr(m[n_m].content, "<|") || strstr(m[n_m].role, "<|");
		n_m++;
	}

	err[0] = 0;
	e = bd_chat_template_new(buf, tpl_len, size && (data[0] & 1) ? &sp : &none, &c, err);
	if (!memchr(err, 0, sizeof(err)) || (e == 0) != (err[0] == 0) ||
	    (e < 0 && e != -ENOTSUP && e != -ENOMEM))
		abort();
	if (e == 0) {
		struct pieces p = { m, n_m, 0, 0 };
		struct bd_chat_emit out = { on_tpl, on_user, &p };

		for (int g = 0; g < 2; g++)
			if (bd_chat_template_run(c, m, n_m, g, &out) < 0)
				abort();
		bd_chat_template_free(c);
	}

	/* the model's template over the same messages */
	{
		int32_t *ids = NULL;
		size_t n = 0, len = 0, dlen = 0;
		char *text = NULL, *dec = NULL;
		bool gen = size && (data[size - 1] & 1);

		e = bd_tokenizer_chat_apply(fz_tok, m, n_m, gen, &ids, &n, terr);
		if (e == -EIO) {
			free(buf);
			return 0;
		}
		if (e < 0)
			abort(); /* the embedded model's template is recognized */
		if (bd_tokenizer_chat_render(fz_tok, m, n_m, gen, &text, &len, terr) < 0)
			abort();
		if (bd_tokenizer_decode(fz_tok, ids, n, 0, &dec, &dlen) < 0)
			abort();
		/* the rendered text less the bytes the vocabulary has no token for (as in
		 * fuzz_tokenizer.c: they are left out when encoding) */
		{
			size_t k = 0;

			for (size_t j = 0; j < len; j++)
				if (bd_tokenizer_byte_token(fz_tok, (uint8_t)text[j]) >= 0)
					text[k++] = text[j];
			if (!special_text && (dlen != k || memcmp(dec, text, k)))
				abort();
		}
		free(ids);
		free(text);
		free(dec);
	}
	free(buf);
	return 0;
}
