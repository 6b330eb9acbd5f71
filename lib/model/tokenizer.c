/* tokenizer.c — byte-level BPE from GGUF metadata or tokenizer.json, decoding, streaming and
 * the chat template (bd_tokenizer.h).
 *
 * Programs that link this file need -lpcre2-8 (pre-tokenizer regexes) and -ljansson
 * (tokenizer.json).
 */
#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <jansson.h>

#include "formats/bd_gguf.h"
#include "model/bd_tokenizer.h"

#define MAX_RE 4          /* regexes applied in sequence by one pre-tokenizer */
#define HEAP_NONE UINT32_MAX

__attribute__((format(printf, 3, 4))) static int fail(char *err, int code, const char *fmt, ...)
{
	if (err) {
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(err, BD_TOKENIZER_ERR_MAX, fmt, ap);
		va_end(ap);
	}
	return code;
}

/* ---- growable arrays --------------------------------------------------------------------- */

struct ivec {
	int32_t *v;
	size_t n, cap;
};

static int ivec_push(struct ivec *a, int32_t x)
{
	if (a->n == a->cap) {
		size_t cap = a->cap ? a->cap * 2 : 64;
		int32_t *v = realloc(a->v, cap * sizeof(*v));
		if (!v)
			return -ENOMEM;
		a->v = v;
		a->cap = cap;
	}
	a->v[a->n++] = x;
	return 0;
}

struct bbuf {
	char *p;
	size_t n, cap;
};

static int bbuf_put(struct bbuf *b, const void *s, size_t n)
{
	if (n > b->cap - b->n || !b->p) {
		size_t cap = b->cap ? b->cap : 256;
		while (cap - b->n < n + 1)
			cap *= 2;
		char *p = realloc(b->p, cap);
		if (!p)
			return -ENOMEM;
		b->p = p;
		b->cap = cap;
	}
	if (n)
		memcpy(b->p + b->n, s, n);
	b->n += n;
	b->p[b->n] = '\0'; /* room was reserved: cap − n ≥ 1 after the copy */
	return 0;
}

/* ---- the tokenizer ----------------------------------------------------------------------- */

enum term_kind { T_LIT, T_ROLE, T_CONTENT };

struct term {
	enum term_kind kind;
	char *s; /* T_LIT: template text (special tokens in it are recognized) */
	size_t len;
};

struct terms {
	struct term *t;
	size_t n;
};

/* A recognized chat template: per message, the default system text before a first message
 * that is not a system one, and the generation prompt. */
struct chat_tpl {
	struct terms prefix;   /* once, before the loop */
	struct terms def_sys;  /* literals only; n == 0: none */
	bool has_def_sys;
	struct terms body;     /* per message */
	struct terms suffix;   /* once, after the loop */
	struct terms gen;      /* if add_generation_prompt */
	struct terms tail;     /* once, at the end */
};

struct merge_ent {
	uint64_t key; /* left id << 32 | right id; UINT64_MAX: empty */
	uint32_t rank;
	int32_t id;
};

struct bd_tokenizer {
	int32_t n_vocab;
	char *text;                /* vocabulary strings, back to back */
	size_t *text_off;          /* [n_vocab + 1] */
	char *bytes;               /* decoded bytes of each token, back to back */
	size_t *bytes_off;         /* [n_vocab + 1] */
	uint8_t *type;             /* enum bd_token_type */
	uint8_t *eog;              /* 1: ends generation */
	size_t max_token_bytes;

	int32_t *vocab_ht;         /* open addressing over text; −1 empty */
	size_t vocab_mask;
	struct merge_ent *merge_ht;
	size_t merge_mask;
	int32_t byte_id[256];      /* the token of each single byte; −1: none */
	uint16_t byte_cp[256];     /* the character standing for each byte */

	pcre2_code *re[MAX_RE];
	int n_re;
	bool ignore_merges;        /* a pre-token that is a whole token is not merged (Llama 3) */

	int32_t *special;          /* control and user-defined ids, longest text first */
	size_t n_special;
	uint8_t special_first[32]; /* bit set of the first bytes of their texts */

	int32_t bos, eos, pad;
	int32_t unk;               /* stands for a byte without a token; −1: such bytes are dropped */
	bool fuse_unk;             /* one unk for a run of them */
	bool add_bos, add_eos;

	struct chat_tpl *chat;     /* NULL: chat_err says why */
	char chat_err[BD_TOKENIZER_ERR_MAX];
};

static const char *tok_text(const struct bd_tokenizer *t, int32_t id, size_t *len)
{
	*len = t->text_off[id + 1] - t->text_off[id];
	return t->text + t->text_off[id];
}

static uint64_t hash_bytes(const char *s, size_t n)
{
	uint64_t h = 1469598103934665603ull; /* FNV-1a */
	for (size_t i = 0; i < n; i++)
		h = (h ^ (uint8_t)s[i]) * 1099511628211ull;
	return h;
}

static uint64_t hash_u64(uint64_t x)
{
	x ^= x >> 33; /* murmur3 finalizer */
	x *= 0xff51afd7ed558ccdull;
	x ^= x >> 33;
	x *= 0xc4ceb9fe1a85ec53ull;
	x ^= x >> 33;
	return x;
}

static size_t pow2_above(size_t n)
{
	size_t c = 16;
	while (c < 2 * n)
		c *= 2;
	return c;
}

static int32_t vocab_lookup(const struct bd_tokenizer *t, const char *s, size_t n)
{
	for (size_t i = hash_bytes(s, n) & t->vocab_mask;; i = (i + 1) & t->vocab_mask) {
		int32_t id = t->vocab_ht[i];
		if (id < 0)
			return -ENOENT;
		size_t len;
		const char *p = tok_text(t, id, &len);
		if (len == n && memcmp(p, s, n) == 0)
			return id;
	}
}

static const struct merge_ent *merge_lookup(const struct bd_tokenizer *t, int32_t a, int32_t b)
{
	uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
	for (size_t i = hash_u64(key) & t->merge_mask;; i = (i + 1) & t->merge_mask) {
		const struct merge_ent *e = &t->merge_ht[i];
		if (e->key == key)
			return e;
		if (e->key == UINT64_MAX)
			return NULL;
	}
}

/* ---- GPT-2 byte ↔ unicode map ------------------------------------------------------------ */

#define BYTE_CP_END 0x144 /* the mapped characters are below U+0144 */

/* Printable Latin-1 bytes stand for themselves; the other 68 bytes map, in byte order, to
 * U+0100 onwards, so that every byte is a visible character in the vocabulary. */
static void byte_map(uint16_t cp[256], int16_t inv[BYTE_CP_END])
{
	unsigned k = 0;
	for (unsigned b = 0; b < 256; b++) {
		bool keep = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
		cp[b] = (uint16_t)(keep ? b : 0x100 + k++);
	}
	for (unsigned c = 0; c < BYTE_CP_END; c++)
		inv[c] = -1;
	for (unsigned b = 0; b < 256; b++)
		inv[cp[b]] = (int16_t)b;
}

static size_t put_utf8(char *out, uint32_t cp)
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

/* Decode one UTF-8 character of s[n] (valid, shortest form); returns its length or 0. */
static size_t get_utf8(const char *s, size_t n, uint32_t *cp)
{
	const uint8_t *u = (const uint8_t *)s;
	if (n >= 1 && u[0] < 0x80) {
		*cp = u[0];
		return 1;
	}
	if (n >= 2 && u[0] >= 0xc2 && u[0] <= 0xdf && (u[1] & 0xc0) == 0x80) {
		*cp = (uint32_t)(u[0] & 0x1f) << 6 | (u[1] & 0x3f);
		return 2;
	}
	if (n >= 3 && (u[0] & 0xf0) == 0xe0 && (u[1] & 0xc0) == 0x80 && (u[2] & 0xc0) == 0x80) {
		uint32_t c = (uint32_t)(u[0] & 0x0f) << 12 | (uint32_t)(u[1] & 0x3f) << 6 |
			     (u[2] & 0x3f);
		if (c < 0x800 || (c >= 0xd800 && c <= 0xdfff))
			return 0;
		*cp = c;
		return 3;
	}
	return 0; /* 4-byte characters are never byte-map characters */
}

/* ---- pre-tokenizers ---------------------------------------------------------------------- */

#define RE_GPT2 "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"
#define RE_LLAMA3_HEAD "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
#define RE_LLAMA3_TAIL "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"

/* tokenizer.ggml.pre values, as llama.cpp's converter writes them, and their regexes (the
 * tokenizer.json pre_tokenizer of each family). Each regex splits every piece the previous
 * one produced; text between matches is kept as pieces too. */
static const struct pre_def {
	const char *names;      /* '|'-separated */
	const char *re[MAX_RE];
	bool ignore_merges;
} pre_defs[] = {
	/* Digits(individual_digits) then the GPT-2 ByteLevel regex: SmolLM, StarCoder */
	{ "smollm|starcoder|refact|command-r|codeshell|exaone|minerva-7b",
	  { "\\p{N}", RE_GPT2 }, false },
	{ "default|gpt-2|gpt2|phi-2|jina-es|jina-de|poro-chat|olmo|mpt|jais", { RE_GPT2 }, false },
	{ "llama3|llama-v3|llama-bpe|falcon3",
	  { RE_LLAMA3_HEAD "\\p{N}{1,3}" RE_LLAMA3_TAIL }, true },
	{ "qwen2|stablelm2|deepseek-r1-qwen|megrez", { RE_LLAMA3_HEAD "\\p{N}" RE_LLAMA3_TAIL },
	  false },
};

static const struct pre_def *find_pre(const char *s, size_t n)
{
	for (size_t i = 0; i < sizeof(pre_defs) / sizeof(pre_defs[0]); i++) {
		const char *p = pre_defs[i].names;
		while (*p) {
			size_t l = strcspn(p, "|");
			if (l == n && memcmp(p, s, n) == 0)
				return &pre_defs[i];
			p += l + (p[l] == '|');
		}
	}
	return NULL;
}

static int compile_re(struct bd_tokenizer *t, const char *pat, size_t len, char *err)
{
	int ec;
	PCRE2_SIZE eo;
	pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, len,
				    PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &ec, &eo, NULL);
	if (!re) {
		PCRE2_UCHAR msg[128];
		pcre2_get_error_message(ec, msg, sizeof(msg));
		return fail(err, ec == PCRE2_ERROR_NOMEMORY ? -ENOMEM : -EIO,
			    "PCRE2 rejects a pre-tokenizer regex at %zu: %s", (size_t)eo,
			    (const char *)msg);
	}
	pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* the interpreter serves when JIT is missing */
	t->re[t->n_re++] = re;
	return 0;
}

/* ---- chat template recognition ----------------------------------------------------------- */

static void terms_free(struct terms *ts)
{
	for (size_t i = 0; i < ts->n; i++)
		free(ts->t[i].s);
	free(ts->t);
	ts->t = NULL;
	ts->n = 0;
}

static void chat_free(struct chat_tpl *c)
{
	if (!c)
		return;
	terms_free(&c->prefix);
	terms_free(&c->def_sys);
	terms_free(&c->body);
	terms_free(&c->suffix);
	terms_free(&c->gen);
	terms_free(&c->tail);
	free(c);
}

/* Append a term, joining adjacent literals. */
static int terms_add(struct terms *ts, enum term_kind k, const char *s, size_t len)
{
	if (k == T_LIT && len == 0)
		return 0;
	if (k == T_LIT && ts->n && ts->t[ts->n - 1].kind == T_LIT) {
		struct term *last = &ts->t[ts->n - 1];
		char *p = realloc(last->s, last->len + len + 1);
		if (!p)
			return -ENOMEM;
		memcpy(p + last->len, s, len);
		last->len += len;
		p[last->len] = '\0';
		last->s = p;
		return 0;
	}
	struct term *t = realloc(ts->t, (ts->n + 1) * sizeof(*t));
	if (!t)
		return -ENOMEM;
	ts->t = t;
	t[ts->n] = (struct term){ .kind = k };
	if (k == T_LIT) {
		t[ts->n].s = malloc(len + 1);
		if (!t[ts->n].s)
			return -ENOMEM;
		memcpy(t[ts->n].s, s, len);
		t[ts->n].s[len] = '\0';
		t[ts->n].len = len;
	}
	ts->n++;
	return 0;
}

/* Jinja expression tokens: identifiers, string literals (unescaped), punctuation. */
enum jtok_kind { J_IDENT, J_STR, J_NUM, J_OP };

struct jtok {
	enum jtok_kind kind;
	char *s;
	size_t len;
};

struct jtoks {
	struct jtok *t;
	size_t n;
};

static void jtoks_free(struct jtoks *j)
{
	for (size_t i = 0; i < j->n; i++)
		free(j->t[i].s);
	free(j->t);
	j->t = NULL;
	j->n = 0;
}

static int jtoks_add(struct jtoks *j, enum jtok_kind k, const char *s, size_t len)
{
	struct jtok *t = realloc(j->t, (j->n + 1) * sizeof(*t));
	if (!t)
		return -ENOMEM;
	j->t = t;
	char *c = malloc(len + 1);
	if (!c)
		return -ENOMEM;
	memcpy(c, s, len);
	c[len] = '\0';
	t[j->n++] = (struct jtok){ .kind = k, .s = c, .len = len };
	return 0;
}

static int hexval(char c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	c = (char)tolower((unsigned char)c);
	return c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/* Unescape a Jinja string literal body (Python escapes) into b. */
static int unescape(const char *s, size_t n, struct bbuf *b)
{
	for (size_t i = 0; i < n; i++) {
		char c = s[i];
		if (c != '\\') {
			if (bbuf_put(b, &c, 1) < 0)
				return -ENOMEM;
			continue;
		}
		if (++i == n)
			return -ENOTSUP;
		char o;
		uint32_t cp = 0;
		int digits = 0;
		switch (s[i]) {
		case 'n': o = '\n'; break;
		case 't': o = '\t'; break;
		case 'r': o = '\r'; break;
		case '\\': o = '\\'; break;
		case '\'': o = '\''; break;
		case '"': o = '"'; break;
		case 'x': digits = 2; break;
		case 'u': digits = 4; break;
		default: return -ENOTSUP;
		}
		if (!digits) {
			if (bbuf_put(b, &o, 1) < 0)
				return -ENOMEM;
			continue;
		}
		for (int k = 0; k < digits; k++) {
			if (i + 1 >= n || hexval(s[i + 1]) < 0)
				return -ENOTSUP;
			cp = cp << 4 | (uint32_t)hexval(s[++i]);
		}
		char u[4];
		if (cp >= 0xd800 && cp <= 0xdfff)
			return -ENOTSUP;
		if (bbuf_put(b, u, put_utf8(u, cp)) < 0)
			return -ENOMEM;
	}
	return 0;
}

/* Lex the inside of a tag. ".name" becomes "[ 'name' ]" so both spellings compare equal. */
static int jlex(const char *s, size_t n, struct jtoks *out)
{
	size_t i = 0;
	while (i < n) {
		char c = s[i];
		if (isspace((unsigned char)c)) {
			i++;
		} else if (isalpha((unsigned char)c) || c == '_') {
			size_t j = i;
			while (j < n && (isalnum((unsigned char)s[j]) || s[j] == '_'))
				j++;
			bool attr = out->n && out->t[out->n - 1].kind == J_OP &&
				    strcmp(out->t[out->n - 1].s, ".") == 0;
			if (attr) {
				free(out->t[out->n - 1].s);
				out->n--;
				if (jtoks_add(out, J_OP, "[", 1) < 0 ||
				    jtoks_add(out, J_STR, s + i, j - i) < 0 ||
				    jtoks_add(out, J_OP, "]", 1) < 0)
					return -ENOMEM;
			} else if (jtoks_add(out, J_IDENT, s + i, j - i) < 0) {
				return -ENOMEM;
			}
			i = j;
		} else if (isdigit((unsigned char)c)) {
			size_t j = i;
			while (j < n && isdigit((unsigned char)s[j]))
				j++;
			if (jtoks_add(out, J_NUM, s + i, j - i) < 0)
				return -ENOMEM;
			i = j;
		} else if (c == '\'' || c == '"') {
			size_t j = i + 1;
			while (j < n && s[j] != c)
				j += s[j] == '\\' ? 2 : 1;
			if (j >= n)
				return -ENOTSUP;
			struct bbuf b = { 0 };
			int r = unescape(s + i + 1, j - i - 1, &b);
			if (r == 0)
				r = jtoks_add(out, J_STR, b.p ? b.p : "", b.n);
			free(b.p);
			if (r < 0)
				return r;
			i = j + 1;
		} else {
			size_t l = (i + 1 < n && s[i + 1] == '=' && strchr("!=<>", c)) ? 2 : 1;
			if (jtoks_add(out, J_OP, s + i, l) < 0)
				return -ENOMEM;
			i += l;
		}
	}
	return 0;
}

/* Whether the tag's tokens equal the tokens of pattern. */
static bool jmatch(const struct jtoks *j, const char *pattern)
{
	struct jtoks p = { 0 };
	bool eq = jlex(pattern, strlen(pattern), &p) == 0 && p.n == j->n;
	for (size_t i = 0; eq && i < j->n; i++)
		eq = p.t[i].kind == j->t[i].kind && p.t[i].len == j->t[i].len &&
		     memcmp(p.t[i].s, j->t[i].s, j->t[i].len) == 0;
	jtoks_free(&p);
	return eq;
}

enum item_kind { I_RAW, I_OUT, I_STMT };

struct item {
	enum item_kind kind;
	struct jtoks toks; /* I_OUT, I_STMT */
	char *raw;         /* I_RAW: the text as rendered (whitespace control applied) */
	size_t raw_len;
};

struct items {
	struct item *v;
	size_t n;
};

static void items_free(struct items *it)
{
	for (size_t i = 0; i < it->n; i++) {
		jtoks_free(&it->v[i].toks);
		free(it->v[i].raw);
	}
	free(it->v);
}

/* Cut the template into raw text, {{ }} and {% %} items ({# #} dropped), applying the whitespace
 * rules of transformers' Jinja environment: trim_blocks (the newline after a {% %} tag goes),
 * lstrip_blocks (spaces from a line start up to a {% tag go), and the '-' markers. */
static int jsplit(const char *s, size_t n, struct items *out, char *err)
{
	size_t i = 0;
	bool trim_next = false, strip_all_next = false;
	while (i <= n) {
		/* the next tag */
		size_t t = i;
		while (t + 1 < n && !(s[t] == '{' && s[t + 1] && strchr("{%#", s[t + 1])))
			t++;
		if (t + 1 >= n)
			t = n;
		char open = t < n ? s[t + 1] : 0;
		bool lstrip_mark = t < n && t + 2 < n && s[t + 2] == '-';
		/* raw text [i, t) */
		size_t a = i, b = t;
		if (strip_all_next)
			while (a < b && isspace((unsigned char)s[a]))
				a++;
		else if (trim_next && a < b && s[a] == '\n')
			a++;
		if (lstrip_mark) {
			while (b > a && isspace((unsigned char)s[b - 1]))
				b--;
		} else if (open == '%' || open == '#') {
			size_t k = b;
			while (k > a && (s[k - 1] == ' ' || s[k - 1] == '\t'))
				k--;
			if (k == 0 || s[k - 1] == '\n')
				b = k;
		}
		if (b > a) {
			struct item *v = realloc(out->v, (out->n + 1) * sizeof(*v));
			if (!v)
				return -ENOMEM;
			out->v = v;
			v[out->n] = (struct item){ .kind = I_RAW, .raw = malloc(b - a), .raw_len = b - a };
			if (!v[out->n].raw)
				return -ENOMEM;
			memcpy(v[out->n].raw, s + a, b - a);
			out->n++;
		}
		if (t >= n)
			break;
		const char *close = open == '{' ? "}}" : open == '%' ? "%}" : "#}";
		size_t body = t + 2 + lstrip_mark, e = body;
		while (e + 1 < n && !(s[e] == close[0] && s[e + 1] == close[1]))
			e++;
		if (e + 1 >= n)
			return fail(err, -ENOTSUP, "chat template: unterminated tag at byte %zu", t);
		bool rstrip_mark = e > body && s[e - 1] == '-';
		if (open != '#') {
			struct item it = { .kind = open == '{' ? I_OUT : I_STMT };
			int r = jlex(s + body, e - rstrip_mark - body, &it.toks);
			struct item *v = r < 0 ? NULL : realloc(out->v, (out->n + 1) * sizeof(*v));
			if (!v) {
				jtoks_free(&it.toks);
				return r == -ENOTSUP ? fail(err, r, "chat template: a string literal "
							    "at byte %zu is not understood", t)
						     : -ENOMEM;
			}
			out->v = v;
			v[out->n++] = it;
		}
		strip_all_next = rstrip_mark;
		trim_next = open == '%' || open == '#';
		i = e + 2;
	}
	return 0;
}

/* The output of a {{ }} tag: operand (+|~ operand)*, operands being string literals,
 * message['role'], message['content'], bos_token and eos_token. */
static int parse_out(const struct bd_tokenizer *tk, const struct jtoks *j, struct terms *ts)
{
	size_t i = 0;
	for (;;) {
		if (i >= j->n)
			return -ENOTSUP;
		const struct jtok *a = &j->t[i];
		int r;
		if (a->kind == J_STR) {
			r = terms_add(ts, T_LIT, a->s, a->len);
			i++;
		} else if (a->kind == J_IDENT && strcmp(a->s, "message") == 0 && i + 3 < j->n &&
			   j->t[i + 1].kind == J_OP && strcmp(j->t[i + 1].s, "[") == 0 &&
			   j->t[i + 2].kind == J_STR && j->t[i + 3].kind == J_OP &&
			   strcmp(j->t[i + 3].s, "]") == 0 &&
			   (strcmp(j->t[i + 2].s, "role") == 0 ||
			    strcmp(j->t[i + 2].s, "content") == 0)) {
			r = terms_add(ts, strcmp(j->t[i + 2].s, "role") == 0 ? T_ROLE : T_CONTENT,
				      NULL, 0);
			i += 4;
		} else if (a->kind == J_IDENT &&
			   (strcmp(a->s, "bos_token") == 0 || strcmp(a->s, "eos_token") == 0)) {
			int32_t id = a->s[0] == 'b' ? tk->bos : tk->eos;
			if (id < 0)
				return -ENOTSUP;
			size_t len;
			const char *p = tok_text(tk, id, &len);
			r = terms_add(ts, T_LIT, p, len);
			i++;
		} else {
			return -ENOTSUP;
		}
		if (r < 0)
			return r;
		if (i == j->n)
			return 0;
		if (j->t[i].kind != J_OP || (strcmp(j->t[i].s, "+") && strcmp(j->t[i].s, "~")))
			return -ENOTSUP;
		i++;
	}
}

/* Output items (raw text and {{ }}) from *pos up to the next statement. */
static int parse_outs(const struct bd_tokenizer *tk, const struct items *it, size_t *pos,
		      struct terms *ts)
{
	for (; *pos < it->n && it->v[*pos].kind != I_STMT; (*pos)++) {
		const struct item *x = &it->v[*pos];
		int r = x->kind == I_RAW ? terms_add(ts, T_LIT, x->raw, x->raw_len)
					 : parse_out(tk, &x->toks, ts);
		if (r < 0)
			return r;
	}
	return 0;
}

static bool stmt_is(const struct items *it, size_t pos, const char *pattern)
{
	return pos < it->n && it->v[pos].kind == I_STMT && jmatch(&it->v[pos].toks, pattern);
}

static bool terms_literal(const struct terms *ts)
{
	for (size_t i = 0; i < ts->n; i++)
		if (ts->t[i].kind != T_LIT)
			return false;
	return true;
}

/* Recognize the template (see bd_tokenizer_chat_check()). The accepted shape:
 *   [if not add_generation_prompt is defined; set add_generation_prompt = false; endif]
 *   literals
 *   for message in messages
 *     [if loop.first and messages[0]['role'] != 'system'; literals; endif]
 *     literals, message['role'], message['content'] in any order
 *   endfor
 *   literals
 *   [if add_generation_prompt; literals; endif]
 *   literals */
static int chat_parse(const struct bd_tokenizer *tk, const char *s, size_t n,
		      struct chat_tpl **ret, char *err)
{
	struct items it = { 0 };
	struct chat_tpl *c = calloc(1, sizeof(*c));
	int r = c ? jsplit(s, n, &it, err) : -ENOMEM;
	if (r < 0)
		goto out;
	size_t p = 0;
	r = -ENOTSUP;
	if (stmt_is(&it, p, "if not add_generation_prompt is defined")) {
		if (!stmt_is(&it, p + 1, "set add_generation_prompt = false") ||
		    !stmt_is(&it, p + 2, "endif"))
			goto unsupported;
		p += 3;
	}
	if ((r = parse_outs(tk, &it, &p, &c->prefix)) < 0)
		goto bad_out;
	if (!stmt_is(&it, p++, "for message in messages"))
		goto unsupported;
	if (stmt_is(&it, p, "if loop.first and messages[0]['role'] != 'system'")) {
		p++;
		c->has_def_sys = true;
		if ((r = parse_outs(tk, &it, &p, &c->def_sys)) < 0)
			goto bad_out;
		if (!terms_literal(&c->def_sys) || !stmt_is(&it, p++, "endif"))
			goto unsupported;
	}
	if ((r = parse_outs(tk, &it, &p, &c->body)) < 0)
		goto bad_out;
	if (!stmt_is(&it, p++, "endfor"))
		goto unsupported;
	if ((r = parse_outs(tk, &it, &p, &c->suffix)) < 0)
		goto bad_out;
	if (stmt_is(&it, p, "if add_generation_prompt")) {
		p++;
		if ((r = parse_outs(tk, &it, &p, &c->gen)) < 0)
			goto bad_out;
		if (!stmt_is(&it, p++, "endif"))
			goto unsupported;
	}
	if ((r = parse_outs(tk, &it, &p, &c->tail)) < 0)
		goto bad_out;
	if (p != it.n || !terms_literal(&c->prefix) || !terms_literal(&c->suffix) ||
	    !terms_literal(&c->gen) || !terms_literal(&c->tail))
		goto unsupported;
	*ret = c;
	c = NULL;
	r = 0;
	goto out;
bad_out:
	if (r != -ENOTSUP)
		goto out;
	r = fail(err, -ENOTSUP, "chat template: an output expression other than literals, "
			       "message['role'], message['content'], bos_token, eos_token");
	goto out;
unsupported:
	r = fail(err, -ENOTSUP, "chat template not recognized: only the ChatML shape (a loop "
			       "over messages with an optional default system message and "
			       "generation prompt) is implemented; item %zu differs", p);
out:
	items_free(&it);
	chat_free(c);
	return r;
}

/* ---- construction ------------------------------------------------------------------------ */

void bd_tokenizer_free(struct bd_tokenizer *t)
{
	if (!t)
		return;
	for (int i = 0; i < t->n_re; i++)
		pcre2_code_free(t->re[i]);
	free(t->text);
	free(t->text_off);
	free(t->bytes);
	free(t->bytes_off);
	free(t->type);
	free(t->eog);
	free(t->vocab_ht);
	free(t->merge_ht);
	free(t->special);
	chat_free(t->chat);
	free(t);
}

/* What a front end (GGUF metadata, tokenizer.json) gathers; build() makes the tokenizer from
 * it. Strings point into the front end's data and need to live only during build(). */
struct spec {
	size_t n_vocab;
	const struct bd_gguf_str *tok;  /* [n_vocab] */
	struct bd_gguf_str *tok_owned;  /* tok when the front end made it */
	uint8_t *type;                  /* [n_vocab] enum bd_token_type */
	size_t n_merges;
	struct bd_gguf_str (*merge)[2]; /* [n_merges] pairs, by rank */
	const char *merges_key;         /* names the merges in messages */
	struct bd_gguf_str re[MAX_RE];  /* pre-tokenizer regexes, in order */
	int n_re;
	bool ignore_merges;
	int64_t bos, eos, pad, unk;     /* −1: none */
	bool fuse_unk;
	bool add_bos, add_eos;
	bool has_tpl;
	struct bd_gguf_str tpl;
	const char *no_tpl;             /* why there is no template, for chat_err */
};

static void spec_free(struct spec *sp)
{
	free(sp->tok_owned);
	free(sp->type);
	free(sp->merge);
}

static int load_vocab(struct bd_tokenizer *t, const struct spec *sp)
{
	size_t n = sp->n_vocab, total = 0;
	int16_t inv[BYTE_CP_END];
	byte_map(t->byte_cp, inv);
	t->n_vocab = (int32_t)n;
	for (size_t i = 0; i < n; i++)
		total += sp->tok[i].len;
	t->text = malloc(total + 1);
	t->text_off = malloc((n + 1) * sizeof(size_t));
	t->bytes = malloc(total + 1); /* a token never decodes to more bytes than its text */
	t->bytes_off = malloc((n + 1) * sizeof(size_t));
	t->type = malloc(n);
	t->eog = calloc(n, 1);
	t->vocab_mask = pow2_above(n) - 1;
	t->vocab_ht = malloc((t->vocab_mask + 1) * sizeof(int32_t));
	if (!t->text || !t->text_off || !t->bytes || !t->bytes_off || !t->type || !t->eog ||
	    !t->vocab_ht)
		return -ENOMEM;
	memset(t->vocab_ht, 0xff, (t->vocab_mask + 1) * sizeof(int32_t));
	memcpy(t->type, sp->type, n);

	size_t off = 0, boff = 0;
	for (size_t i = 0; i < n; i++) {
		const struct bd_gguf_str *s = &sp->tok[i];
		t->text_off[i] = off;
		if (s->len)
			memcpy(t->text + off, s->s, s->len);
		off += s->len;

		/* decoded bytes: control and user-defined tokens as written; the others through
		 * the inverse byte map, or as written if a character is not in it (as the
		 * Hugging Face ByteLevel decoder does) */
		t->bytes_off[i] = boff;
		bool mapped = t->type[i] != BD_TOKEN_CONTROL && t->type[i] != BD_TOKEN_USER_DEFINED;
		size_t bstart = boff;
		for (size_t k = 0; mapped && k < s->len;) {
			uint32_t cp;
			size_t l = get_utf8(s->s + k, s->len - k, &cp);
			int b = l && cp < BYTE_CP_END ? inv[cp] : -1;
			if (b < 0) {
				mapped = false;
				boff = bstart;
				break;
			}
			t->bytes[boff++] = (char)b;
			k += l;
		}
		if (!mapped) {
			if (s->len)
				memcpy(t->bytes + boff, s->s, s->len);
			boff += s->len;
		}
		if (boff - bstart > t->max_token_bytes)
			t->max_token_bytes = boff - bstart;

		/* first id wins for duplicate strings */
		size_t h = hash_bytes(s->s, s->len) & t->vocab_mask;
		bool dup = false;
		for (; t->vocab_ht[h] >= 0 && !dup; h = (h + 1) & t->vocab_mask) {
			size_t len;
			const char *p = tok_text(t, t->vocab_ht[h], &len);
			dup = len == s->len && memcmp(p, s->s, len) == 0;
		}
		t->text_off[i + 1] = off; /* tok_text(i) is used by the probe above only for < i */
		if (!dup)
			t->vocab_ht[h] = (int32_t)i;
	}
	t->text_off[n] = off;
	t->bytes_off[n] = boff;

	for (unsigned b = 0; b < 256; b++) {
		char u[3];
		size_t l = put_utf8(u, t->byte_cp[b]);
		int32_t id = vocab_lookup(t, u, l);
		t->byte_id[b] = id < 0 ? -1 : id; /* SmolLM2 lacks 21 of them */
	}
	return 0;
}

static int load_merges(struct bd_tokenizer *t, const struct spec *sp, char *err)
{
	size_t n = sp->n_merges;
	t->merge_mask = pow2_above(n) - 1;
	t->merge_ht = malloc((t->merge_mask + 1) * sizeof(*t->merge_ht));
	char *cat = malloc(t->text_off[t->n_vocab] + 1);
	if (!t->merge_ht || !cat) {
		free(cat);
		return -ENOMEM;
	}
	for (size_t i = 0; i <= t->merge_mask; i++)
		t->merge_ht[i].key = UINT64_MAX;
	int r = 0;
	for (size_t i = 0; i < n; i++) {
		const struct bd_gguf_str *ma = &sp->merge[i][0], *mb = &sp->merge[i][1];
		int32_t a = vocab_lookup(t, ma->s, ma->len), b = vocab_lookup(t, mb->s, mb->len);
		int32_t ab = -ENOENT;
		if (ma->len + mb->len <= t->text_off[t->n_vocab]) {
			memcpy(cat, ma->s, ma->len);
			memcpy(cat + ma->len, mb->s, mb->len);
			ab = vocab_lookup(t, cat, ma->len + mb->len);
		}
		if (a < 0 || b < 0 || ab < 0) {
			r = fail(err, -EBADMSG, "%s[%zu] names a token that is not in the vocabulary",
				 sp->merges_key, i);
			break;
		}
		uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
		size_t h = hash_u64(key) & t->merge_mask;
		while (t->merge_ht[h].key != UINT64_MAX && t->merge_ht[h].key != key)
			h = (h + 1) & t->merge_mask;
		if (t->merge_ht[h].key == key)
			continue; /* a repeated pair keeps its first (lowest) rank */
		t->merge_ht[h] = (struct merge_ent){ .key = key, .rank = (uint32_t)i, .id = ab };
	}
	free(cat);
	return r;
}

static int cmp_special(const void *a, const void *b, void *arg)
{
	const struct bd_tokenizer *t = arg;
	size_t la, lb;
	tok_text(t, *(const int32_t *)a, &la);
	tok_text(t, *(const int32_t *)b, &lb);
	if (la != lb)
		return la > lb ? -1 : 1;
	return *(const int32_t *)a < *(const int32_t *)b ? -1 : 1;
}

static int load_special(struct bd_tokenizer *t)
{
	static const char *const eog_texts[] = {
		"<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>",
		"<|end|>", "<end_of_turn>",
	};
	size_t k = 0;
	for (int32_t i = 0; i < t->n_vocab; i++)
		k += t->type[i] == BD_TOKEN_CONTROL || t->type[i] == BD_TOKEN_USER_DEFINED;
	t->special = malloc((k ? k : 1) * sizeof(int32_t));
	if (!t->special)
		return -ENOMEM;
	for (int32_t i = 0; i < t->n_vocab; i++) {
		size_t len;
		const char *s = tok_text(t, i, &len);
		if (t->type[i] == BD_TOKEN_CONTROL)
			for (size_t e = 0; e < sizeof(eog_texts) / sizeof(eog_texts[0]); e++)
				if (len == strlen(eog_texts[e]) && memcmp(s, eog_texts[e], len) == 0)
					t->eog[i] = 1;
		if ((t->type[i] == BD_TOKEN_CONTROL || t->type[i] == BD_TOKEN_USER_DEFINED) && len) {
			t->special[t->n_special++] = i;
			t->special_first[(uint8_t)s[0] >> 3] |= (uint8_t)(1u << ((uint8_t)s[0] & 7));
		}
	}
	qsort_r(t->special, t->n_special, sizeof(int32_t), cmp_special, t);
	if (t->eos >= 0)
		t->eog[t->eos] = 1;
	return 0;
}

static int check_id(int64_t v, const char *what, size_t n, int32_t *ret, char *err)
{
	if (v < -1 || v >= (int64_t)n)
		return fail(err, -EBADMSG, "%s %lld is outside the vocabulary [0, %zu)", what,
			    (long long)v, n);
	*ret = (int32_t)v;
	return 0;
}

static int build(const struct spec *sp, struct bd_tokenizer **ret, char *err)
{
	if (sp->n_vocab == 0 || sp->n_vocab > INT32_MAX / 2)
		return fail(err, -EBADMSG, "the vocabulary holds %zu tokens", sp->n_vocab);
	if (sp->n_merges > UINT32_MAX / 4)
		return fail(err, -EBADMSG, "%zu merges are too many", sp->n_merges);
	int r;
	struct bd_tokenizer *t = calloc(1, sizeof(*t));
	if (!t)
		return fail(err, -ENOMEM, "out of memory");
	t->ignore_merges = sp->ignore_merges;
	t->add_bos = sp->add_bos;
	t->add_eos = sp->add_eos;
	t->fuse_unk = sp->fuse_unk;
	if ((r = check_id(sp->bos, "bos_token_id", sp->n_vocab, &t->bos, err)) < 0 ||
	    (r = check_id(sp->eos, "eos_token_id", sp->n_vocab, &t->eos, err)) < 0 ||
	    (r = check_id(sp->pad, "padding_token_id", sp->n_vocab, &t->pad, err)) < 0 ||
	    (r = check_id(sp->unk, "unknown_token_id", sp->n_vocab, &t->unk, err)) < 0)
		goto fail;
	if ((t->add_bos && t->bos < 0) || (t->add_eos && t->eos < 0)) {
		r = fail(err, -EBADMSG, "add_%s_token is set but no id is given",
			 t->add_bos && t->bos < 0 ? "bos" : "eos");
		goto fail;
	}
	if ((r = load_vocab(t, sp)) < 0 || (r = load_merges(t, sp, err)) < 0 ||
	    (r = load_special(t)) < 0)
		goto fail;
	for (int i = 0; i < sp->n_re; i++)
		if ((r = compile_re(t, sp->re[i].s, sp->re[i].len, err)) < 0)
			goto fail;

	/* The chat template is checked here once; a template we cannot apply is no error
	 * until a chat function is called. */
	if (!sp->has_tpl)
		fail(t->chat_err, -ENOTSUP, "%s", sp->no_tpl);
	else if ((r = chat_parse(t, sp->tpl.s, sp->tpl.len, &t->chat, t->chat_err)) == -ENOMEM)
		goto fail;
	*ret = t;
	return 0;
fail:
	if (r == -ENOMEM)
		fail(err, r, "out of memory");
	bd_tokenizer_free(t);
	return r;
}

/* ---- from GGUF metadata ------------------------------------------------------------------ */

static int get_array(const struct bd_gguf *g, const char *key, bool strings, bool need,
		     const struct bd_gguf_kv **ret, char *err)
{
	const struct bd_gguf_kv *kv = bd_gguf_find_kv(g, key);
	*ret = NULL;
	if (!kv)
		return need ? fail(err, -EBADMSG, "%s is missing", key) : 0;
	bool ok = kv->type == BD_GGUF_ARRAY;
	if (ok && strings)
		ok = kv->arr_type == BD_GGUF_STRING;
	else if (ok)
		ok = kv->arr_type <= BD_GGUF_INT32 || kv->arr_type == BD_GGUF_UINT64 ||
		     kv->arr_type == BD_GGUF_INT64;
	if (!ok)
		return fail(err, -EBADMSG, "%s is a %s, not an array of %s", key,
			    bd_gguf_type_name(kv->type == BD_GGUF_ARRAY ? (int)kv->arr_type
									 : (int)kv->type),
			    strings ? "strings" : "integers");
	*ret = kv;
	return 0;
}

static int get_opt_id(const struct bd_gguf *g, const char *key, int64_t *ret, char *err)
{
	int r = bd_gguf_get_int(g, key, ret);
	if (r == -ENOENT) {
		*ret = -1;
		return 0;
	}
	return r < 0 ? fail(err, -EBADMSG, "%s is not an integer", key) : 0;
}

static int get_opt_bool(const struct bd_gguf *g, const char *key, bool *ret, char *err)
{
	int r = bd_gguf_get_bool(g, key, ret);
	if (r == -ENOENT) {
		*ret = false;
		return 0;
	}
	return r < 0 ? fail(err, -EBADMSG, "%s is not a bool", key) : 0;
}

static int gguf_spec(const struct bd_gguf *g, struct spec *sp, char *err)
{
	struct bd_gguf_str model, pre;
	int r = bd_gguf_get_str(g, "tokenizer.ggml.model", &model);
	if (r < 0)
		return fail(err, -EBADMSG, "tokenizer.ggml.model is %s",
			    r == -ENOENT ? "missing" : "not a string");
	if (model.len != 4 || memcmp(model.s, "gpt2", 4) != 0)
		return fail(err, -ENOTSUP, "tokenizer model \"%.*s\": only byte-level BPE "
			    "(\"gpt2\") is implemented", (int)(model.len > 32 ? 32 : model.len),
			    model.s);
	r = bd_gguf_get_str(g, "tokenizer.ggml.pre", &pre);
	if (r < 0 && r != -ENOENT)
		return fail(err, -EBADMSG, "tokenizer.ggml.pre is not a string");
	if (r == -ENOENT)
		pre = (struct bd_gguf_str){ "default", 7 };
	const struct pre_def *pd = find_pre(pre.s, pre.len);
	if (!pd)
		return fail(err, -ENOTSUP, "pre-tokenizer \"%.*s\" is not known",
			    (int)(pre.len > 32 ? 32 : pre.len), pre.s);
	for (int i = 0; i < MAX_RE && pd->re[i]; i++)
		sp->re[sp->n_re++] = (struct bd_gguf_str){ pd->re[i], strlen(pd->re[i]) };
	sp->ignore_merges = pd->ignore_merges;

	const struct bd_gguf_kv *toks, *types, *merges;
	if ((r = get_array(g, "tokenizer.ggml.tokens", true, true, &toks, err)) < 0 ||
	    (r = get_array(g, "tokenizer.ggml.token_type", false, false, &types, err)) < 0 ||
	    (r = get_array(g, "tokenizer.ggml.merges", true, true, &merges, err)) < 0)
		return r;
	size_t n = toks->n;
	if (types && types->n != n)
		return fail(err, -EBADMSG, "tokenizer.ggml.token_type has %llu entries for %zu "
			    "tokens", (unsigned long long)types->n, n);
	sp->n_vocab = n;
	sp->tok = toks->strs;
	sp->type = malloc(n ? n : 1);
	sp->n_merges = merges->n;
	sp->merge = malloc((merges->n ? merges->n : 1) * sizeof(*sp->merge));
	sp->merges_key = "tokenizer.ggml.merges";
	if (!sp->type || !sp->merge)
		return fail(err, -ENOMEM, "out of memory");
	for (size_t i = 0; i < n; i++) {
		int64_t ty = BD_TOKEN_NORMAL;
		if (types && (bd_gguf_arr_int(types, i, &ty) < 0 || ty < 0 || ty > BD_TOKEN_BYTE))
			return fail(err, -EBADMSG, "tokenizer.ggml.token_type[%zu] is not a type",
				    i);
		sp->type[i] = (uint8_t)ty;
	}
	for (size_t i = 0; i < merges->n; i++) {
		const struct bd_gguf_str *m = &merges->strs[i];
		const char *s = m->len > 1 ? memchr(m->s + 1, ' ', m->len - 1) : NULL;
		if (!s || s + 1 == m->s + m->len)
			return fail(err, -EBADMSG, "tokenizer.ggml.merges[%zu] is not \"A B\"", i);
		sp->merge[i][0] = (struct bd_gguf_str){ m->s, (size_t)(s - m->s) };
		sp->merge[i][1] = (struct bd_gguf_str){ s + 1, m->len - (size_t)(s - m->s) - 1 };
	}
	/* tokenizer.ggml.unknown_token_id is not used: Hugging Face's byte-level BPE, which
	 * the GGUF converters read, has no unknown token (SmolLM2: bytes without a token are
	 * left out) */
	sp->unk = -1;
	if ((r = get_opt_id(g, "tokenizer.ggml.bos_token_id", &sp->bos, err)) < 0 ||
	    (r = get_opt_id(g, "tokenizer.ggml.eos_token_id", &sp->eos, err)) < 0 ||
	    (r = get_opt_id(g, "tokenizer.ggml.padding_token_id", &sp->pad, err)) < 0 ||
	    (r = get_opt_bool(g, "tokenizer.ggml.add_bos_token", &sp->add_bos, err)) < 0 ||
	    (r = get_opt_bool(g, "tokenizer.ggml.add_eos_token", &sp->add_eos, err)) < 0)
		return r;
	r = bd_gguf_get_str(g, "tokenizer.chat_template", &sp->tpl);
	sp->has_tpl = r == 0;
	sp->no_tpl = r == -ENOENT ? "the model has no tokenizer.chat_template"
				  : "tokenizer.chat_template is not a string";
	return 0;
}

int bd_tokenizer_new_from_gguf(const struct bd_gguf *g, struct bd_tokenizer **ret, char *ret_err)
{
	if (ret_err)
		ret_err[0] = '\0';
	if (!g || !ret)
		return fail(ret_err, -EINVAL, "NULL argument");
	struct spec sp = { .bos = -1, .eos = -1, .pad = -1, .unk = -1 };
	int r = gguf_spec(g, &sp, ret_err);
	if (r == 0)
		r = build(&sp, ret, ret_err);
	spec_free(&sp);
	return r;
}

/* ---- from tokenizer.json ----------------------------------------------------------------- */

/* A JSON string's bytes as a string view (jansson keeps them alive with the document). */
static bool jstr(json_t *j, struct bd_gguf_str *ret)
{
	if (!json_is_string(j))
		return false;
	*ret = (struct bd_gguf_str){ json_string_value(j), json_string_length(j) };
	return true;
}

/* JSON null or absent: true; other values: what pred says. */
static bool null_or(json_t *j, bool ok)
{
	return !j || json_is_null(j) || ok;
}

static int json_pre(json_t *pre, struct spec *sp, char *err)
{
	json_t *list = pre;
	if (json_is_object(pre) && json_is_string(json_object_get(pre, "type")) &&
	    strcmp(json_string_value(json_object_get(pre, "type")), "Sequence") == 0)
		list = json_object_get(pre, "pretokenizers");
	else if (json_is_object(pre))
		list = NULL;
	size_t n = list ? json_array_size(list) : 1;
	if (!json_is_object(pre) || (list && !json_is_array(list)) || n == 0)
		return fail(err, -ENOTSUP, "pre_tokenizer: byte-level BPE needs a ByteLevel step");
	for (size_t i = 0; i < n; i++) {
		json_t *p = list ? json_array_get(list, i) : pre;
		const char *type = json_string_value(json_object_get(p, "type"));
		if (!type)
			return fail(err, -EBADMSG, "pre_tokenizer step %zu has no type", i);
		bool last = i + 1 == n;
		struct bd_gguf_str re = { NULL, 0 };
		if (strcmp(type, "Split") == 0) {
			json_t *pat = json_object_get(p, "pattern");
			const char *beh = json_string_value(json_object_get(p, "behavior"));
			if (!jstr(json_object_get(pat, "Regex"), &re) || !beh ||
			    strcmp(beh, "Isolated") != 0 || json_is_true(json_object_get(p, "invert")))
				return fail(err, -ENOTSUP, "pre_tokenizer: only Split with a Regex "
					    "pattern, behavior Isolated and no invert is implemented");
		} else if (strcmp(type, "Digits") == 0) {
			bool one = json_is_true(json_object_get(p, "individual_digits"));
			re = one ? (struct bd_gguf_str){ "\\p{N}", 5 }
				 : (struct bd_gguf_str){ "\\p{N}+", 6 };
		} else if (strcmp(type, "ByteLevel") == 0 && last) {
			if (json_is_true(json_object_get(p, "add_prefix_space")))
				return fail(err, -ENOTSUP, "pre_tokenizer: ByteLevel with "
					    "add_prefix_space is not implemented");
			if (!json_is_false(json_object_get(p, "use_regex")))
				re = (struct bd_gguf_str){ RE_GPT2, strlen(RE_GPT2) };
		} else {
			return fail(err, -ENOTSUP, "pre_tokenizer step %zu (%s) is not implemented%s",
				    i, type, strcmp(type, "ByteLevel") == 0 ? " before the last" : "");
		}
		if (last && strcmp(type, "ByteLevel") != 0)
			return fail(err, -ENOTSUP, "pre_tokenizer: byte-level BPE needs a ByteLevel "
				    "last step");
		if (!re.s)
			continue;
		if (sp->n_re == MAX_RE)
			return fail(err, -ENOTSUP, "pre_tokenizer has more than %d splitting steps",
				    MAX_RE);
		sp->re[sp->n_re++] = re;
	}
	return 0;
}

/* Find a token by text: added tokens first (they override the vocabulary), then any. */
static int64_t spec_find(const struct spec *sp, const struct bd_gguf_str *s)
{
	int64_t any = -1;
	for (size_t i = 0; i < sp->n_vocab; i++)
		if (sp->tok[i].len == s->len && sp->tok[i].s &&
		    memcmp(sp->tok[i].s, s->s, s->len) == 0) {
			if (sp->type[i] == BD_TOKEN_CONTROL || sp->type[i] == BD_TOKEN_USER_DEFINED)
				return (int64_t)i;
			if (any < 0)
				any = (int64_t)i;
		}
	return any;
}

/* bos_token and the like in tokenizer_config.json: a string, {"content": …}, null or absent. */
static int json_special(const struct spec *sp, json_t *cfg, const char *key, int64_t *ret,
			char *err)
{
	json_t *v = json_object_get(cfg, key);
	struct bd_gguf_str s;
	*ret = -1;
	if (!v || json_is_null(v))
		return 0;
	if (json_is_object(v))
		v = json_object_get(v, "content");
	if (!jstr(v, &s))
		return fail(err, -EBADMSG, "tokenizer_config.json: %s is not a string", key);
	if ((*ret = spec_find(sp, &s)) < 0)
		return fail(err, -EBADMSG, "tokenizer_config.json: %s \"%.*s\" is not a token", key,
			    (int)(s.len > 40 ? 40 : s.len), s.s);
	return 0;
}

static int json_config(json_t *cfg, struct spec *sp, char *err)
{
	int r;
	if (!json_is_object(cfg))
		return fail(err, -EBADMSG, "tokenizer_config.json is not an object");
	if ((r = json_special(sp, cfg, "bos_token", &sp->bos, err)) < 0 ||
	    (r = json_special(sp, cfg, "eos_token", &sp->eos, err)) < 0 ||
	    (r = json_special(sp, cfg, "pad_token", &sp->pad, err)) < 0)
		return r;
	json_t *ab = json_object_get(cfg, "add_bos_token"), *ae = json_object_get(cfg,
										 "add_eos_token");
	if (!null_or(ab, json_is_boolean(ab)) || !null_or(ae, json_is_boolean(ae)))
		return fail(err, -EBADMSG, "tokenizer_config.json: add_bos_token or add_eos_token "
			    "is not a bool");
	sp->add_bos = json_is_true(ab);
	sp->add_eos = json_is_true(ae);

	/* chat_template: a string, or a list of {name, template} of which "default" is used */
	json_t *ct = json_object_get(cfg, "chat_template");
	size_t i;
	json_t *e;
	if (json_is_array(ct)) {
		json_t *def = NULL;
		json_array_foreach(ct, i, e) {
			const char *name = json_string_value(json_object_get(e, "name"));
			if (name && strcmp(name, "default") == 0)
				def = json_object_get(e, "template");
		}
		ct = def;
	}
	sp->has_tpl = jstr(ct, &sp->tpl);
	sp->no_tpl = "tokenizer_config.json has no chat_template";
	return 0;
}

static int json_model(json_t *root, struct spec *sp, char *err)
{
	json_t *model = json_object_get(root, "model");
	json_t *vocab = json_object_get(model, "vocab"), *merges = json_object_get(model, "merges");
	json_t *added = json_object_get(root, "added_tokens");
	const char *type = json_string_value(json_object_get(model, "type"));
	if (!json_is_object(model) || (type && strcmp(type, "BPE") != 0))
		return fail(err, -ENOTSUP, "model type %s: only BPE is implemented",
			    type ? type : "(none)");
	if (!json_is_object(vocab) || !json_is_array(merges))
		return fail(err, -EBADMSG, "model.vocab or model.merges is missing");
	if (!null_or(added, json_is_array(added)))
		return fail(err, -EBADMSG, "added_tokens is not an array");
	json_t *pfx = json_object_get(model, "continuing_subword_prefix");
	json_t *sfx = json_object_get(model, "end_of_word_suffix");
	json_t *drop = json_object_get(model, "dropout");
	if (json_is_true(json_object_get(model, "byte_fallback")) ||
	    !null_or(pfx, json_is_string(pfx) && !*json_string_value(pfx)) ||
	    !null_or(sfx, json_is_string(sfx) && !*json_string_value(sfx)) ||
	    !null_or(drop, json_is_number(drop) && json_number_value(drop) == 0))
		return fail(err, -ENOTSUP, "model: byte_fallback, subword prefixes or suffixes and "
			    "dropout are not implemented");
	json_t *norm = json_object_get(root, "normalizer");
	const char *nt = json_string_value(json_object_get(norm, "type"));
	/* NFC is accepted and not applied, as llama.cpp does for Qwen2: text already in NFC
	 * (nearly all text) tokenizes the same */
	if (!null_or(norm, nt && strcmp(nt, "NFC") == 0))
		return fail(err, -ENOTSUP, "normalizer %s is not implemented", nt ? nt : "?");
	sp->ignore_merges = json_is_true(json_object_get(model, "ignore_merges"));
	sp->fuse_unk = json_is_true(json_object_get(model, "fuse_unk"));

	/* ids: the vocabulary's and the added tokens'; holes stay empty UNUSED tokens */
	int64_t max_id = -1;
	const char *key;
	json_t *v;
	size_t i;
	json_object_foreach(vocab, key, v) {
		if (!json_is_integer(v) || json_integer_value(v) < 0 ||
		    json_integer_value(v) >= INT32_MAX / 2)
			return fail(err, -EBADMSG, "model.vocab: the id of \"%.40s\" is not valid",
				    key);
		if (json_integer_value(v) > max_id)
			max_id = json_integer_value(v);
	}
	json_array_foreach(added, i, v) {
		json_t *id = json_object_get(v, "id");
		if (!json_is_integer(id) || json_integer_value(id) < 0 ||
		    json_integer_value(id) >= INT32_MAX / 2 ||
		    !json_is_string(json_object_get(v, "content")))
			return fail(err, -EBADMSG, "added_tokens[%zu] has no valid id or content", i);
		if (json_integer_value(id) > max_id)
			max_id = json_integer_value(id);
	}
	size_t n = (size_t)(max_id + 1);
	sp->n_vocab = n;
	sp->tok_owned = calloc(n ? n : 1, sizeof(*sp->tok_owned));
	sp->type = malloc(n ? n : 1);
	sp->n_merges = json_array_size(merges);
	sp->merge = malloc((sp->n_merges ? sp->n_merges : 1) * sizeof(*sp->merge));
	sp->merges_key = "model.merges";
	if (!sp->tok_owned || !sp->type || !sp->merge)
		return fail(err, -ENOMEM, "out of memory");
	sp->tok = sp->tok_owned;
	memset(sp->type, BD_TOKEN_UNUSED, n);
	json_object_foreach(vocab, key, v) {
		size_t id = (size_t)json_integer_value(v);
		sp->tok_owned[id] = (struct bd_gguf_str){ key, strlen(key) };
		sp->type[id] = BD_TOKEN_NORMAL;
	}
	json_array_foreach(added, i, v) {
		size_t id = (size_t)json_integer_value(json_object_get(v, "id"));
		jstr(json_object_get(v, "content"), &sp->tok_owned[id]);
		sp->type[id] = json_is_true(json_object_get(v, "special")) ? BD_TOKEN_CONTROL
									    : BD_TOKEN_USER_DEFINED;
	}
	for (size_t k = 0; k < n; k++)
		if (!sp->tok_owned[k].s)
			sp->tok_owned[k].s = "";

	/* merges: "A B" strings (older files) or ["A", "B"] pairs */
	json_array_foreach(merges, i, v) {
		struct bd_gguf_str m, *out = sp->merge[i];
		if (jstr(v, &m)) {
			const char *s = m.len > 1 ? memchr(m.s + 1, ' ', m.len - 1) : NULL;
			if (!s || s + 1 == m.s + m.len)
				return fail(err, -EBADMSG, "model.merges[%zu] is not \"A B\"", i);
			out[0] = (struct bd_gguf_str){ m.s, (size_t)(s - m.s) };
			out[1] = (struct bd_gguf_str){ s + 1, m.len - (size_t)(s - m.s) - 1 };
		} else if (json_array_size(v) != 2 || !jstr(json_array_get(v, 0), &out[0]) ||
			   !jstr(json_array_get(v, 1), &out[1])) {
			return fail(err, -EBADMSG, "model.merges[%zu] is neither \"A B\" nor [A, B]",
				    i);
		}
	}

	json_t *unk = json_object_get(model, "unk_token");
	struct bd_gguf_str us;
	if (jstr(unk, &us) && (sp->unk = spec_find(sp, &us)) < 0)
		return fail(err, -EBADMSG, "model.unk_token is not a token");
	else if (!null_or(unk, json_is_string(unk)))
		return fail(err, -EBADMSG, "model.unk_token is not a string");
	return json_pre(json_object_get(root, "pre_tokenizer"), sp, err);
}

static int load_json(const char *path, json_t **ret, char *err)
{
	FILE *f = fopen(path, "rb");
	if (!f)
		return fail(err, -errno, "%s: %s", path, strerror(errno));
	json_error_t je;
	*ret = json_loadf(f, JSON_REJECT_DUPLICATES, &je);
	fclose(f);
	if (!*ret)
		return fail(err, -EBADMSG, "%s:%d: %s", path, je.line, je.text);
	return 0;
}

int bd_tokenizer_new_from_json(const char *tokenizer_json, const char *config_json,
			       struct bd_tokenizer **ret, char *ret_err)
{
	if (ret_err)
		ret_err[0] = '\0';
	if (!tokenizer_json || !ret)
		return fail(ret_err, -EINVAL, "NULL argument");
	json_t *root = NULL, *cfg = NULL;
	struct spec sp = { .bos = -1, .eos = -1, .pad = -1, .unk = -1,
			   .no_tpl = "no tokenizer_config.json was given" };
	int r = load_json(tokenizer_json, &root, ret_err);
	if (r == 0 && !json_is_object(root))
		r = fail(ret_err, -EBADMSG, "%s is not a JSON object", tokenizer_json);
	if (r == 0)
		r = json_model(root, &sp, ret_err);
	if (r == 0 && config_json && (r = load_json(config_json, &cfg, ret_err)) == 0)
		r = json_config(cfg, &sp, ret_err);
	if (r == 0)
		r = build(&sp, ret, ret_err);
	spec_free(&sp);
	json_decref(cfg);
	json_decref(root);
	return r;
}

/* ---- vocabulary queries ------------------------------------------------------------------ */

int32_t bd_tokenizer_n_vocab(const struct bd_tokenizer *t)
{
	return t ? t->n_vocab : -EINVAL;
}

int32_t bd_tokenizer_bos(const struct bd_tokenizer *t)
{
	return t ? t->bos : -1;
}

int32_t bd_tokenizer_eos(const struct bd_tokenizer *t)
{
	return t ? t->eos : -1;
}

int32_t bd_tokenizer_pad(const struct bd_tokenizer *t)
{
	return t ? t->pad : -1;
}

bool bd_tokenizer_is_eog(const struct bd_tokenizer *t, int32_t id)
{
	return t && id >= 0 && id < t->n_vocab && t->eog[id];
}

int bd_tokenizer_token_type(const struct bd_tokenizer *t, int32_t id)
{
	if (!t)
		return -EINVAL;
	return id >= 0 && id < t->n_vocab ? t->type[id] : -ERANGE;
}

int bd_tokenizer_token_text(const struct bd_tokenizer *t, int32_t id, const char **ret_s,
			    size_t *ret_len)
{
	if (!t || !ret_s || !ret_len)
		return -EINVAL;
	if (id < 0 || id >= t->n_vocab)
		return -ERANGE;
	*ret_s = tok_text(t, id, ret_len);
	return 0;
}

int bd_tokenizer_token_bytes(const struct bd_tokenizer *t, int32_t id, const char **ret_s,
			     size_t *ret_len)
{
	if (!t || !ret_s || !ret_len)
		return -EINVAL;
	if (id < 0 || id >= t->n_vocab)
		return -ERANGE;
	*ret_s = t->bytes + t->bytes_off[id];
	*ret_len = t->bytes_off[id + 1] - t->bytes_off[id];
	return 0;
}

int32_t bd_tokenizer_find(const struct bd_tokenizer *t, const char *s, size_t len)
{
	if (!t || (!s && len))
		return -EINVAL;
	return vocab_lookup(t, s ? s : "", len);
}

int32_t bd_tokenizer_byte_token(const struct bd_tokenizer *t, uint8_t b)
{
	if (!t)
		return -EINVAL;
	return t->byte_id[b] < 0 ? -ENOENT : t->byte_id[b];
}

size_t bd_tokenizer_max_token_bytes(const struct bd_tokenizer *t)
{
	return t ? t->max_token_bytes : 0;
}

/* ---- encoding ---------------------------------------------------------------------------- */

/* A candidate merge of symbol pos with its right neighbour. A rank names one pair, so the entry
 * is stale exactly when the pair now at pos has another rank (or none). */
struct heap_ent {
	uint32_t rank, pos;
};

/* State of one encode call. */
struct enc {
	const struct bd_tokenizer *t;
	pcre2_match_data *md;
	struct ivec *out;
	struct bbuf lit;      /* literal text waiting to be encoded (chat, special parsing) */
	/* BPE scratch, grown to the longest pre-token */
	int32_t *id;
	uint32_t *prev, *next;
	struct heap_ent *heap;
	size_t cap, heap_n;
	char *mapped;         /* the pre-token in the byte alphabet (ignore_merges) */
};

static bool heap_less(const struct heap_ent *a, const struct heap_ent *b)
{
	return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static void heap_push(struct enc *e, struct heap_ent x)
{
	size_t i = e->heap_n++;
	while (i > 0 && heap_less(&x, &e->heap[(i - 1) / 2])) {
		e->heap[i] = e->heap[(i - 1) / 2];
		i = (i - 1) / 2;
	}
	e->heap[i] = x;
}

static struct heap_ent heap_pop(struct enc *e)
{
	struct heap_ent top = e->heap[0], x = e->heap[--e->heap_n];
	size_t i = 0, n = e->heap_n;
	for (;;) {
		size_t c = 2 * i + 1;
		if (c >= n)
			break;
		if (c + 1 < n && heap_less(&e->heap[c + 1], &e->heap[c]))
			c++;
		if (!heap_less(&e->heap[c], &x))
			break;
		e->heap[i] = e->heap[c];
		i = c;
	}
	if (n)
		e->heap[i] = x;
	return top;
}

static void try_pair(struct enc *e, uint32_t l, uint32_t r)
{
	const struct merge_ent *m = merge_lookup(e->t, e->id[l], e->id[r]);
	if (m)
		heap_push(e, (struct heap_ent){ m->rank, l });
}

static int grow(struct enc *e, size_t n)
{
	if (n <= e->cap)
		return 0;
	size_t cap = e->cap ? e->cap : 64;
	while (cap < n)
		cap *= 2;
	int32_t *id = realloc(e->id, cap * sizeof(*id));
	if (id)
		e->id = id;
	uint32_t *prev = realloc(e->prev, cap * sizeof(*prev));
	if (prev)
		e->prev = prev;
	uint32_t *next = realloc(e->next, cap * sizeof(*next));
	if (next)
		e->next = next;
	/* each merge pushes at most two entries: n − 1 initial pairs + 2 (n − 1) */
	struct heap_ent *heap = realloc(e->heap, 3 * cap * sizeof(*heap));
	if (heap)
		e->heap = heap;
	char *mapped = realloc(e->mapped, 2 * cap);
	if (mapped)
		e->mapped = mapped;
	if (!id || !prev || !next || !heap || !mapped)
		return -ENOMEM;
	e->cap = cap;
	return 0;
}

/* Byte-pair encode one pre-token s[n] (n ≥ 1). */
static int bpe(struct enc *e, const char *s, size_t n)
{
	const struct bd_tokenizer *t = e->t;
	int r = grow(e, n);
	if (r < 0)
		return r;
	if (t->ignore_merges) {
		size_t m = 0;
		for (size_t i = 0; i < n; i++)
			m += put_utf8(e->mapped + m, t->byte_cp[(uint8_t)s[i]]);
		int32_t whole = vocab_lookup(t, e->mapped, m);
		if (whole >= 0)
			return ivec_push(e->out, whole);
	}
	/* a byte without a token becomes the unknown token if there is one (tokenizer.json),
	 * else it is left out and its neighbours meet, as in Hugging Face's BPE */
	size_t k = 0;
	bool last_unk = false;
	for (size_t i = 0; i < n; i++) {
		int32_t id = t->byte_id[(uint8_t)s[i]];
		if (id < 0 && t->unk >= 0 && !(t->fuse_unk && last_unk))
			e->id[k++] = t->unk;
		else if (id >= 0)
			e->id[k++] = id;
		last_unk = id < 0;
	}
	if (k == 0)
		return 0;
	for (size_t i = 0; i < k; i++) {
		e->prev[i] = i ? (uint32_t)i - 1 : HEAP_NONE;
		e->next[i] = i + 1 < k ? (uint32_t)i + 1 : HEAP_NONE;
	}
	e->heap_n = 0;
	for (size_t i = 0; i + 1 < k; i++)
		try_pair(e, (uint32_t)i, (uint32_t)i + 1);
	while (e->heap_n) {
		struct heap_ent h = heap_pop(e);
		uint32_t l = h.pos, rr = e->next[l];
		/* removed symbols keep id −1 and no right neighbour */
		const struct merge_ent *m = e->id[l] >= 0 && rr != HEAP_NONE
			? merge_lookup(t, e->id[l], e->id[rr]) : NULL;
		if (!m || m->rank != h.rank)
			continue;
		e->id[l] = m->id;
		e->next[l] = e->next[rr];
		if (e->next[rr] != HEAP_NONE)
			e->prev[e->next[rr]] = l;
		e->id[rr] = -1;
		e->next[rr] = HEAP_NONE;
		if (e->prev[l] != HEAP_NONE)
			try_pair(e, e->prev[l], l);
		if (e->next[l] != HEAP_NONE)
			try_pair(e, l, e->next[l]);
	}
	for (uint32_t i = 0; i != HEAP_NONE; i = e->next[i])
		if ((r = ivec_push(e->out, e->id[i])) < 0)
			return r;
	return 0;
}

/* Split s[n] by regex `level` and pass every match and every gap between matches on. */
static int pretok(struct enc *e, int level, const char *s, size_t n)
{
	if (n == 0)
		return 0;
	if (level == e->t->n_re)
		return bpe(e, s, n);
	size_t at = 0, gap = 0;
	while (at < n) {
		int rc = pcre2_match(e->t->re[level], (PCRE2_SPTR)s, n, at, 0, e->md, NULL);
		if (rc == PCRE2_ERROR_NOMATCH)
			break;
		if (rc < 0)
			return rc == PCRE2_ERROR_NOMEMORY ? -ENOMEM : -EIO;
		PCRE2_SIZE *ov = pcre2_get_ovector_pointer(e->md);
		size_t a = ov[0], b = ov[1];
		if (b <= a) { /* the patterns have no empty match; guard anyway */
			at = a + 1;
			continue;
		}
		int r = pretok(e, level + 1, s + gap, a - gap);
		if (r == 0)
			r = pretok(e, level + 1, s + a, b - a);
		if (r < 0)
			return r;
		at = gap = b;
	}
	return pretok(e, level + 1, s + gap, n - gap);
}

static int flush_lit(struct enc *e)
{
	int r = pretok(e, 0, e->lit.p, e->lit.n);
	e->lit.n = 0;
	return r;
}

static bool special_at(const struct bd_tokenizer *t, const char *s, size_t n, int32_t *ret_id,
		       size_t *ret_len)
{
	uint8_t c = (uint8_t)s[0];
	if (!(t->special_first[c >> 3] & (1u << (c & 7))))
		return false;
	for (size_t k = 0; k < t->n_special; k++) { /* longest first */
		size_t len;
		const char *p = tok_text(t, t->special[k], &len);
		if (len <= n && memcmp(p, s, len) == 0) {
			*ret_id = t->special[k];
			*ret_len = len;
			return true;
		}
	}
	return false;
}

/* Template text: special-token text in it becomes those tokens; the rest joins the pending
 * literal text. */
static int enc_template(struct enc *e, const char *s, size_t n)
{
	size_t i = 0, from = 0;
	while (i < n) {
		int32_t id;
		size_t len;
		if (!special_at(e->t, s + i, n - i, &id, &len)) {
			i++;
			continue;
		}
		int r = bbuf_put(&e->lit, s + from, i - from);
		if (r == 0)
			r = flush_lit(e);
		if (r == 0)
			r = ivec_push(e->out, id);
		if (r < 0)
			return r;
		i = from = i + len;
	}
	return bbuf_put(&e->lit, s + from, n - from);
}

static int enc_init(struct enc *e, const struct bd_tokenizer *t, struct ivec *out)
{
	*e = (struct enc){ .t = t, .out = out };
	e->md = pcre2_match_data_create_from_pattern(t->re[0], NULL);
	return e->md ? 0 : -ENOMEM;
}

static void enc_done(struct enc *e)
{
	pcre2_match_data_free(e->md);
	free(e->lit.p);
	free(e->id);
	free(e->prev);
	free(e->next);
	free(e->heap);
	free(e->mapped);
}

static int encode_vec(const struct bd_tokenizer *t, const char *text, size_t len, unsigned flags,
		      struct ivec *out)
{
	struct enc e;
	int r = enc_init(&e, t, out);
	if (r == 0 && (flags & BD_TOK_ADD_SPECIAL) && t->add_bos)
		r = ivec_push(out, t->bos);
	if (r == 0 && (flags & BD_TOK_PARSE_SPECIAL)) {
		r = enc_template(&e, text, len);
		if (r == 0)
			r = flush_lit(&e);
	} else if (r == 0) {
		r = pretok(&e, 0, text, len);
	}
	if (r == 0 && (flags & BD_TOK_ADD_SPECIAL) && t->add_eos)
		r = ivec_push(out, t->eos);
	enc_done(&e);
	return r;
}

int bd_tokenizer_encode(const struct bd_tokenizer *t, const char *text, size_t len,
			unsigned flags, int32_t **ret_ids, size_t *ret_n)
{
	if (!t || !ret_ids || !ret_n || (!text && len) ||
	    (flags & ~(unsigned)(BD_TOK_PARSE_SPECIAL | BD_TOK_ADD_SPECIAL)))
		return -EINVAL;
	struct ivec v = { 0 };
	int r = encode_vec(t, text ? text : "", len, flags, &v);
	if (r == 0 && !v.v && !(v.v = malloc(sizeof(int32_t))))
		r = -ENOMEM;
	if (r < 0) {
		free(v.v);
		return r;
	}
	*ret_ids = v.v;
	*ret_n = v.n;
	return 0;
}

int bd_tokenizer_encode_buf(const struct bd_tokenizer *t, const char *text, size_t len,
			    unsigned flags, int32_t *ids, size_t cap, size_t *ret_n)
{
	if ((!ids && cap) || !ret_n)
		return -EINVAL;
	int32_t *v;
	size_t n;
	int r = bd_tokenizer_encode(t, text, len, flags, &v, &n);
	if (r < 0)
		return r;
	*ret_n = n;
	if (n > cap) {
		free(v);
		return -ENOBUFS;
	}
	if (n)
		memcpy(ids, v, n * sizeof(*v));
	free(v);
	return 0;
}

/* ---- decoding ---------------------------------------------------------------------------- */

int bd_tokenizer_decode(const struct bd_tokenizer *t, const int32_t *ids, size_t n,
			unsigned flags, char **ret_text, size_t *ret_len)
{
	if (!t || (!ids && n) || !ret_text || !ret_len || (flags & ~(unsigned)BD_TOK_SKIP_SPECIAL))
		return -EINVAL;
	size_t total = 0;
	for (size_t i = 0; i < n; i++) {
		if (ids[i] < 0 || ids[i] >= t->n_vocab)
			return -ERANGE;
		total += t->bytes_off[ids[i] + 1] - t->bytes_off[ids[i]];
	}
	char *s = malloc(total + 1), *p = s;
	if (!s)
		return -ENOMEM;
	for (size_t i = 0; i < n; i++) {
		if ((flags & BD_TOK_SKIP_SPECIAL) && t->type[ids[i]] == BD_TOKEN_CONTROL)
			continue;
		size_t l = t->bytes_off[ids[i] + 1] - t->bytes_off[ids[i]];
		if (l)
			memcpy(p, t->bytes + t->bytes_off[ids[i]], l);
		p += l;
	}
	*p = '\0';
	*ret_text = s;
	*ret_len = (size_t)(p - s);
	return 0;
}

void bd_tokenizer_stream_init(struct bd_tok_stream *s, unsigned flags)
{
	if (s)
		*s = (struct bd_tok_stream){ .flags = flags };
}

size_t bd_tokenizer_stream_cap(const struct bd_tokenizer *t)
{
	return t ? 3 * (t->max_token_bytes + 3) : 0;
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
	if (id < 0 || id >= t->n_vocab)
		return -ERANGE;
	struct bd_tok_stream st = *s;
	struct sink k = { .buf = buf, .cap = cap };
	if (!((st.flags & BD_TOK_SKIP_SPECIAL) && t->type[id] == BD_TOKEN_CONTROL)) {
		const uint8_t *p = (const uint8_t *)t->bytes + t->bytes_off[id];
		size_t n = t->bytes_off[id + 1] - t->bytes_off[id];
		for (size_t i = 0; i < n; i++)
			stream_byte(&st, p[i], &k);
	}
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

/* ---- chat -------------------------------------------------------------------------------- */

/* Where the pieces of a rendered chat go: template text (may hold markers) or user text. */
struct chat_out {
	int (*tpl)(void *ctx, const char *s, size_t n);
	int (*user)(void *ctx, const char *s, size_t n);
	void *ctx;
};

static int emit_terms(const struct terms *ts, const struct bd_chat_msg *m,
		      const struct chat_out *o)
{
	for (size_t i = 0; i < ts->n; i++) {
		const struct term *x = &ts->t[i];
		int r = x->kind == T_LIT ? o->tpl(o->ctx, x->s, x->len)
			: o->user(o->ctx, x->kind == T_ROLE ? m->role : m->content,
				  strlen(x->kind == T_ROLE ? m->role : m->content));
		if (r < 0)
			return r;
	}
	return 0;
}

static int chat_run(const struct bd_tokenizer *t, const struct bd_chat_msg *msgs, size_t n,
		    bool add_gen, const struct chat_out *o, char *err)
{
	if (err)
		err[0] = '\0';
	if (!t || (!msgs && n))
		return fail(err, -EINVAL, "NULL argument");
	for (size_t i = 0; i < n; i++)
		if (!msgs[i].role || !msgs[i].content)
			return fail(err, -EINVAL, "message %zu has a NULL role or content", i);
	const struct chat_tpl *c = t->chat;
	if (!c)
		return fail(err, -ENOTSUP, "%s", t->chat_err);
	int r = emit_terms(&c->prefix, NULL, o);
	for (size_t i = 0; i < n && r == 0; i++) {
		if (i == 0 && c->has_def_sys && strcmp(msgs[0].role, "system") != 0)
			r = emit_terms(&c->def_sys, NULL, o);
		if (r == 0)
			r = emit_terms(&c->body, &msgs[i], o);
	}
	if (r == 0)
		r = emit_terms(&c->suffix, NULL, o);
	if (r == 0 && add_gen)
		r = emit_terms(&c->gen, NULL, o);
	if (r == 0)
		r = emit_terms(&c->tail, NULL, o);
	return r;
}

int bd_tokenizer_chat_check(const struct bd_tokenizer *t, char *ret_err)
{
	if (ret_err)
		ret_err[0] = '\0';
	if (!t)
		return fail(ret_err, -EINVAL, "NULL argument");
	return t->chat ? 0 : fail(ret_err, -ENOTSUP, "%s", t->chat_err);
}

static int enc_tpl_cb(void *ctx, const char *s, size_t n)
{
	return enc_template(ctx, s, n);
}

static int enc_user_cb(void *ctx, const char *s, size_t n)
{
	return bbuf_put(&((struct enc *)ctx)->lit, s, n);
}

int bd_tokenizer_chat_apply(const struct bd_tokenizer *t, const struct bd_chat_msg *msgs,
			    size_t n, bool add_generation_prompt, int32_t **ret_ids,
			    size_t *ret_n, char *ret_err)
{
	if (!t || !ret_ids || !ret_n)
		return fail(ret_err, -EINVAL, "NULL argument");
	struct ivec v = { 0 };
	struct enc e;
	int r = enc_init(&e, t, &v);
	if (r == 0) {
		struct chat_out o = { enc_tpl_cb, enc_user_cb, &e };
		r = chat_run(t, msgs, n, add_generation_prompt, &o, ret_err);
	}
	if (r == 0)
		r = flush_lit(&e);
	if (r == 0 && !v.v && !(v.v = malloc(sizeof(int32_t))))
		r = -ENOMEM;
	enc_done(&e);
	if (r < 0) {
		if (r == -ENOMEM || r == -EIO)
			fail(ret_err, r, r == -EIO ? "PCRE2 match error" : "out of memory");
		free(v.v);
		return r;
	}
	*ret_ids = v.v;
	*ret_n = v.n;
	return 0;
}

static int text_cb(void *ctx, const char *s, size_t n)
{
	return bbuf_put(ctx, s, n);
}

int bd_tokenizer_chat_render(const struct bd_tokenizer *t, const struct bd_chat_msg *msgs,
			     size_t n, bool add_generation_prompt, char **ret_text,
			     size_t *ret_len, char *ret_err)
{
	if (!t || !ret_text || !ret_len)
		return fail(ret_err, -EINVAL, "NULL argument");
	struct bbuf b = { 0 };
	struct chat_out o = { text_cb, text_cb, &b };
	int r = chat_run(t, msgs, n, add_generation_prompt, &o, ret_err);
	if (r == 0)
		r = bbuf_put(&b, "", 0);
	if (r < 0) {
		if (r == -ENOMEM)
			fail(ret_err, r, "out of memory");
		free(b.p);
		return r;
	}
	*ret_text = b.p;
	*ret_len = b.n;
	return 0;
}
