/* tokenizer.c — byte-level BPE: the tokenizer built from a front end's spec, its vocabulary,
 * encoding (pre-tokenizer regexes, then merges lowest rank first), decoding, and the chat
 * functions that encode a template's output (bd_tokenizer.h). The front ends are
 * tokenizer_load.c, the template engine chat_template.c, the stream decoder utf8.c.
 *
 * Programs that link this file need -lpcre2-8 (pre-tokenizer regexes).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "base/bd_err.h"
#include "model/bd_chat_template.h"
#include "model/bd_tokenizer_spec.h"
#include "model/bd_utf8.h"

#define HEAP_NONE UINT32_MAX

#define fail(err, code, ...) bd_errf((err), BD_TOKENIZER_ERR_MAX, (code), __VA_ARGS__)

/* ---- growable arrays ----------------------------------------------------------------------- */

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
	/* n bytes and the NUL after them */
	if (n >= b->cap - b->n || !b->p) {
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

/* ---- the tokenizer ------------------------------------------------------------------------- */

struct merge_ent {
	uint64_t key; /* left id << 32 | right id; UINT64_MAX: empty */
	uint32_t rank;
	int32_t id;
};

struct bd_tokenizer {
	int32_t n_vocab;
	/* the vocabulary's tables, one allocation (load_vocab) at text_off */
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

	pcre2_code *re[BD_TOK_MAX_RE];
	int n_re;
	bool ignore_merges;        /* a pre-token that is a whole token is not merged (Llama 3) */

	int32_t *special;          /* control and user-defined ids, longest text first */
	size_t n_special;
	uint8_t special_first[32]; /* bit set of the first bytes of their texts */

	int32_t bos, eos, pad;
	int32_t unk;               /* stands for a byte without a token; −1: such bytes are dropped */
	bool fuse_unk;             /* one unk for a run of them */
	bool add_bos, add_eos;

	struct bd_chat_template *chat; /* NULL: chat_err says why */
	char chat_err[BD_CHAT_ERR_MAX];
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

/* ---- GPT-2 byte ↔ unicode map -------------------------------------------------------------- */

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

/* ---- construction -------------------------------------------------------------------------- */

void bd_tokenizer_free(struct bd_tokenizer *t)
{
	if (!t)
		return;
	for (int i = 0; i < t->n_re; i++)
		pcre2_code_free(t->re[i]);
	free(t->text_off); /* and the vocabulary's other tables */
	free(t->merge_ht);
	free(t->special);
	bd_chat_template_free(t->chat);
	free(t);
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

static int load_vocab(struct bd_tokenizer *t, const struct bd_tokenizer_spec *sp)
{
	size_t n = sp->n_vocab, total = 0;
	int16_t inv[BYTE_CP_END];
	byte_map(t->byte_cp, inv);
	t->n_vocab = (int32_t)n;
	for (size_t i = 0; i < n; i++)
		total += sp->tok[i].len;
	t->vocab_mask = pow2_above(n) - 1;
	/* one block, the 8- and 4-byte arrays first: the offsets of the texts and of their
	 * decoded bytes, the hash table, the texts, the bytes (a token never decodes to more
	 * bytes than its text), the types, the end-of-generation flags */
	t->text_off = calloc(1, 2 * (n + 1) * sizeof(size_t) +
				    (t->vocab_mask + 1) * sizeof(int32_t) + 2 * (total + 1) + 2 * n);
	if (!t->text_off)
		return -ENOMEM;
	t->bytes_off = t->text_off + n + 1;
	t->vocab_ht = (int32_t *)(t->bytes_off + n + 1);
	t->text = (char *)(t->vocab_ht + t->vocab_mask + 1);
	t->bytes = t->text + total + 1;
	t->type = (uint8_t *)t->bytes + total + 1;
	t->eog = t->type + n;
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
			size_t l = bd_utf8_get_bmp(s->s + k, s->len - k, &cp);
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
		size_t l = bd_utf8_put_bmp(u, t->byte_cp[b]);
		int32_t id = vocab_lookup(t, u, l);
		t->byte_id[b] = id < 0 ? -1 : id; /* SmolLM2 lacks 21 of them */
	}
	return 0;
}

static int load_merges(struct bd_tokenizer *t, const struct bd_tokenizer_spec *sp, char *err)
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

int bd_tokenizer_build(const struct bd_tokenizer_spec *sp, struct bd_tokenizer **ret,
		       char *err)
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
	if (!sp->has_tpl) {
		bd_errf(t->chat_err, sizeof(t->chat_err), -ENOTSUP, "%s", sp->no_tpl);
	} else {
		struct bd_chat_specials cs = { 0 };
		if (t->bos >= 0)
			cs.bos = tok_text(t, t->bos, &cs.bos_len);
		if (t->eos >= 0)
			cs.eos = tok_text(t, t->eos, &cs.eos_len);
		r = bd_chat_template_new(sp->tpl.s, sp->tpl.len, &cs, &t->chat, t->chat_err);
		if (r == -ENOMEM)
			goto fail;
	}
	*ret = t;
	return 0;
fail:
	if (r == -ENOMEM)
		fail(err, r, "out of memory");
	bd_tokenizer_free(t);
	return r;
}

/* ---- vocabulary queries -------------------------------------------------------------------- */

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

/* Token id's vocabulary string, or the bytes it decodes to. */
static int token_view(const struct bd_tokenizer *t, int32_t id, bool decoded,
		      const char **ret_s, size_t *ret_len)
{
	if (!t || !ret_s || !ret_len)
		return -EINVAL;
	if (id < 0 || id >= t->n_vocab)
		return -ERANGE;
	const size_t *off = decoded ? t->bytes_off : t->text_off;
	*ret_s = (decoded ? t->bytes : t->text) + off[id];
	*ret_len = off[id + 1] - off[id];
	return 0;
}

int bd_tokenizer_token_text(const struct bd_tokenizer *t, int32_t id, const char **ret_s,
			    size_t *ret_len)
{
	return token_view(t, id, false, ret_s, ret_len);
}

int bd_tokenizer_token_bytes(const struct bd_tokenizer *t, int32_t id, const char **ret_s,
			     size_t *ret_len)
{
	return token_view(t, id, true, ret_s, ret_len);
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

/* ---- encoding ------------------------------------------------------------------------------ */

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
			m += bd_utf8_put_bmp(e->mapped + m, t->byte_cp[(uint8_t)s[i]]);
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

/* ---- decoding ------------------------------------------------------------------------------ */

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

/* ---- chat ---------------------------------------------------------------------------------- */

/* The template applied to msgs[n] through out, after the checks the chat functions share. */
static int chat_run(const struct bd_tokenizer *t, const struct bd_chat_msg *msgs, size_t n,
		    bool add_gen, const struct bd_chat_emit *out, char *err)
{
	if (err)
		err[0] = '\0';
	if (!t || (!msgs && n))
		return fail(err, -EINVAL, "NULL argument");
	for (size_t i = 0; i < n; i++)
		if (!msgs[i].role || !msgs[i].content)
			return fail(err, -EINVAL, "message %zu has a NULL role or content", i);
	if (!t->chat)
		return fail(err, -ENOTSUP, "%s", t->chat_err);
	return bd_chat_template_run(t->chat, msgs, n, add_gen, out);
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
		struct bd_chat_emit o = { enc_tpl_cb, enc_user_cb, &e };
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
	struct bd_chat_emit o = { text_cb, text_cb, &b };
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
