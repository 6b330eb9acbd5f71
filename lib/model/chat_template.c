/* chat_template.c — a chat template recognized from its Jinja text and applied without a Jinja
 * engine (bd_chat_template.h). */
#include <ctype.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/bd_err.h"
#include "model/bd_chat_template.h"
#include "model/bd_utf8.h"

#define fail(err, code, ...) bd_errf((err), BD_CHAT_ERR_MAX, (code), __VA_ARGS__)

/* ---- pieces of text ------------------------------------------------------------------------ */

/* A piece of text with a kind: a token of a tag (enum jtok_kind) or a term a template emits
 * (enum term_kind). s is a NUL-terminated copy of len bytes, or NULL (a term that stands for
 * a message's role or content). */
struct piece {
	int kind;
	char *s;
	size_t len;
};

struct pieces {
	struct piece *t;
	size_t n;
};

static void pieces_free(struct pieces *p)
{
	for (size_t i = 0; i < p->n; i++)
		free(p->t[i].s);
	free(p->t);
	p->t = NULL;
	p->n = 0;
}

/* Append a piece, copying s[len] (s NULL: no text). */
static int pieces_add(struct pieces *p, int kind, const char *s, size_t len)
{
	struct piece *t = realloc(p->t, (p->n + 1) * sizeof(*t));
	if (!t)
		return -ENOMEM;
	p->t = t;
	char *c = NULL;
	if (s) {
		if (!(c = malloc(len + 1)))
			return -ENOMEM;
		memcpy(c, s, len);
		c[len] = '\0';
	}
	t[p->n++] = (struct piece){ .kind = kind, .s = c, .len = s ? len : 0 };
	return 0;
}

/* ---- terms: what a template emits ---------------------------------------------------------- */

/* T_LIT: template text (special tokens in it are recognized); T_ROLE, T_CONTENT: the
 * message's. */
enum term_kind { T_LIT, T_ROLE, T_CONTENT };

/* A recognized template: the terms before, in and after the loop over the messages, the
 * default system text before a first message that is not a system one, and the generation
 * prompt. */
struct bd_chat_template {
	struct pieces prefix;   /* once, before the loop */
	struct pieces def_sys;  /* literals only; n == 0: none */
	bool has_def_sys;
	struct pieces body;     /* per message */
	struct pieces suffix;   /* once, after the loop */
	struct pieces gen;      /* if add_generation_prompt */
	struct pieces tail;     /* once, at the end */
};

void bd_chat_template_free(struct bd_chat_template *c)
{
	if (!c)
		return;
	pieces_free(&c->prefix);
	pieces_free(&c->def_sys);
	pieces_free(&c->body);
	pieces_free(&c->suffix);
	pieces_free(&c->gen);
	pieces_free(&c->tail);
	free(c);
}

/* Append a term, joining adjacent literals. */
static int terms_add(struct pieces *ts, enum term_kind k, const char *s, size_t len)
{
	if (k == T_LIT && len == 0)
		return 0;
	if (k == T_LIT && ts->n && ts->t[ts->n - 1].kind == T_LIT) {
		struct piece *last = &ts->t[ts->n - 1];
		char *p = realloc(last->s, last->len + len + 1);
		if (!p)
			return -ENOMEM;
		memcpy(p + last->len, s, len);
		last->len += len;
		p[last->len] = '\0';
		last->s = p;
		return 0;
	}
	return pieces_add(ts, k, k == T_LIT ? s : NULL, len);
}

/* ---- the template's text: tags, their tokens -------------------------------------------- */

/* Jinja expression tokens: identifiers, string literals (unescaped), punctuation. */
enum jtok_kind { J_IDENT, J_STR, J_NUM, J_OP };

static int hexval(char c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	c = (char)tolower((unsigned char)c);
	return c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/* Unescape a Jinja string literal body s[n] (Python escapes) into out, which has room for n
 * bytes (no escape is shorter than what it stands for), and return the length in *ret_len. */
static int unescape(const char *s, size_t n, char *out, size_t *ret_len)
{
	size_t k = 0;
	for (size_t i = 0; i < n; i++) {
		char c = s[i];
		if (c != '\\') {
			out[k++] = c;
			continue;
		}
		if (++i == n)
			return -ENOTSUP;
		uint32_t cp = 0;
		int digits = 0;
		switch (s[i]) {
		case 'n': out[k++] = '\n'; continue;
		case 't': out[k++] = '\t'; continue;
		case 'r': out[k++] = '\r'; continue;
		case '\\': out[k++] = '\\'; continue;
		case '\'': out[k++] = '\''; continue;
		case '"': out[k++] = '"'; continue;
		case 'x': digits = 2; break;
		case 'u': digits = 4; break;
		default: return -ENOTSUP;
		}
		for (int d = 0; d < digits; d++) {
			if (i + 1 >= n || hexval(s[i + 1]) < 0)
				return -ENOTSUP;
			cp = cp << 4 | (uint32_t)hexval(s[++i]);
		}
		if (cp >= 0xd800 && cp <= 0xdfff)
			return -ENOTSUP;
		k += bd_utf8_put_bmp(out + k, cp);
	}
	*ret_len = k;
	return 0;
}

/* Lex the inside of a tag. ".name" becomes "[ 'name' ]" so both spellings compare equal. */
static int jlex(const char *s, size_t n, struct pieces *out)
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
				if (pieces_add(out, J_OP, "[", 1) < 0 ||
				    pieces_add(out, J_STR, s + i, j - i) < 0 ||
				    pieces_add(out, J_OP, "]", 1) < 0)
					return -ENOMEM;
			} else if (pieces_add(out, J_IDENT, s + i, j - i) < 0) {
				return -ENOMEM;
			}
			i = j;
		} else if (isdigit((unsigned char)c)) {
			size_t j = i;
			while (j < n && isdigit((unsigned char)s[j]))
				j++;
			if (pieces_add(out, J_NUM, s + i, j - i) < 0)
				return -ENOMEM;
			i = j;
		} else if (c == '\'' || c == '"') {
			size_t j = i + 1;
			while (j < n && s[j] != c)
				j += s[j] == '\\' ? 2 : 1;
			if (j >= n)
				return -ENOTSUP;
			size_t ul = 0;
			char *u = malloc(j - i);
			int r = u ? unescape(s + i + 1, j - i - 1, u, &ul) : -ENOMEM;
			if (r == 0)
				r = pieces_add(out, J_STR, u, ul);
			free(u);
			if (r < 0)
				return r;
			i = j + 1;
		} else {
			size_t l = (i + 1 < n && s[i + 1] == '=' && strchr("!=<>", c)) ? 2 : 1;
			if (pieces_add(out, J_OP, s + i, l) < 0)
				return -ENOMEM;
			i += l;
		}
	}
	return 0;
}

/* Whether the tag's tokens equal the tokens of pattern. */
static bool jmatch(const struct pieces *j, const char *pattern)
{
	struct pieces p = { 0 };
	bool eq = jlex(pattern, strlen(pattern), &p) == 0 && p.n == j->n;
	for (size_t i = 0; eq && i < j->n; i++)
		eq = p.t[i].kind == j->t[i].kind && p.t[i].len == j->t[i].len &&
		     memcmp(p.t[i].s, j->t[i].s, j->t[i].len) == 0;
	pieces_free(&p);
	return eq;
}

enum item_kind { I_RAW, I_OUT, I_STMT };

struct item {
	enum item_kind kind;
	struct pieces toks; /* I_OUT, I_STMT */
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
		pieces_free(&it->v[i].toks);
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
				pieces_free(&it.toks);
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
static int parse_out(const struct bd_chat_specials *sp, const struct pieces *j, struct pieces *ts)
{
	size_t i = 0;
	for (;;) {
		if (i >= j->n)
			return -ENOTSUP;
		const struct piece *a = &j->t[i];
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
			bool bos = a->s[0] == 'b';
			const char *p = bos ? sp->bos : sp->eos;
			if (!p)
				return -ENOTSUP;
			r = terms_add(ts, T_LIT, p, bos ? sp->bos_len : sp->eos_len);
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
static int parse_outs(const struct bd_chat_specials *sp, const struct items *it, size_t *pos,
		      struct pieces *ts)
{
	for (; *pos < it->n && it->v[*pos].kind != I_STMT; (*pos)++) {
		const struct item *x = &it->v[*pos];
		int r = x->kind == I_RAW ? terms_add(ts, T_LIT, x->raw, x->raw_len)
					 : parse_out(sp, &x->toks, ts);
		if (r < 0)
			return r;
	}
	return 0;
}

static bool stmt_is(const struct items *it, size_t pos, const char *pattern)
{
	return pos < it->n && it->v[pos].kind == I_STMT && jmatch(&it->v[pos].toks, pattern);
}

/* parse_outs into ts, then the statement pattern at *pos, passed. Returns 0, the error of
 * parse_outs, or 1 when the statement there is another. */
static int outs_then(const struct bd_chat_specials *sp, const struct items *it, size_t *pos,
		     struct pieces *ts, const char *pattern)
{
	int r = parse_outs(sp, it, pos, ts);

	if (r < 0)
		return r;
	return stmt_is(it, (*pos)++, pattern) ? 0 : 1;
}

static bool terms_literal(const struct pieces *ts)
{
	for (size_t i = 0; i < ts->n; i++)
		if (ts->t[i].kind != T_LIT)
			return false;
	return true;
}

int bd_chat_template_new(const char *s, size_t n, const struct bd_chat_specials *sp,
			 struct bd_chat_template **ret, char *err)
{
	if (!s || !sp || !ret)
		return fail(err, -EINVAL, "NULL argument");
	struct items it = { 0 };
	struct bd_chat_template *c = calloc(1, sizeof(*c));
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
	if ((r = outs_then(sp, &it, &p, &c->prefix, "for message in messages")) != 0)
		goto bad;
	if (stmt_is(&it, p, "if loop.first and messages[0]['role'] != 'system'")) {
		p++;
		c->has_def_sys = true;
		if ((r = parse_outs(sp, &it, &p, &c->def_sys)) < 0)
			goto bad_out;
		if (!terms_literal(&c->def_sys) || !stmt_is(&it, p++, "endif"))
			goto unsupported;
	}
	if ((r = outs_then(sp, &it, &p, &c->body, "endfor")) != 0)
		goto bad;
	if ((r = parse_outs(sp, &it, &p, &c->suffix)) < 0)
		goto bad_out;
	if (stmt_is(&it, p, "if add_generation_prompt")) {
		p++;
		if ((r = outs_then(sp, &it, &p, &c->gen, "endif")) != 0)
			goto bad;
	}
	if ((r = parse_outs(sp, &it, &p, &c->tail)) < 0)
		goto bad_out;
	if (p != it.n || !terms_literal(&c->prefix) || !terms_literal(&c->suffix) ||
	    !terms_literal(&c->gen) || !terms_literal(&c->tail))
		goto unsupported;
	*ret = c;
	c = NULL;
	r = 0;
	goto out;
bad:
	if (r > 0)
		goto unsupported;
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
	bd_chat_template_free(c);
	return r;
}

/* ---- applying ------------------------------------------------------------------------------ */

static int emit_terms(const struct pieces *ts, const struct bd_chat_msg *m,
		      const struct bd_chat_emit *o)
{
	for (size_t i = 0; i < ts->n; i++) {
		const struct piece *x = &ts->t[i];
		int r = x->kind == T_LIT ? o->tpl(o->ctx, x->s, x->len)
			: o->user(o->ctx, x->kind == T_ROLE ? m->role : m->content,
				  strlen(x->kind == T_ROLE ? m->role : m->content));
		if (r < 0)
			return r;
	}
	return 0;
}

int bd_chat_template_run(const struct bd_chat_template *c, const struct bd_chat_msg *msgs,
			 size_t n, bool add_gen, const struct bd_chat_emit *o)
{
	if (!c || (!msgs && n) || !o)
		return -EINVAL;
	for (size_t i = 0; i < n; i++)
		if (!msgs[i].role || !msgs[i].content)
			return -EINVAL;
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
