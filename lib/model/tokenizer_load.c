/* tokenizer_load.c — the tokenizer's front ends: GGUF metadata (tokenizer.ggml.*) and a Hugging
 * Face tokenizer.json with its tokenizer_config.json, each gathered into a struct
 * bd_tokenizer_spec for bd_tokenizer_build (bd_tokenizer.h, bd_tokenizer_spec.h). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "base/bd_err.h"
#include "formats/bd_gguf.h"
#include "model/bd_tokenizer_spec.h"

#define fail(err, code, ...) bd_errf((err), BD_TOKENIZER_ERR_MAX, (code), __VA_ARGS__)

/* ---- pre-tokenizers ------------------------------------------------------------------------ */

#define RE_GPT2 "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"
#define RE_LLAMA3_HEAD "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
#define RE_LLAMA3_TAIL "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"

/* tokenizer.ggml.pre values, as llama.cpp's converter writes them, and their regexes (the
 * tokenizer.json pre_tokenizer of each family). Each regex splits every piece the previous
 * one produced; text between matches is kept as pieces too. */
static const struct pre_def {
	const char *names;      /* '|'-separated */
	const char *re[BD_TOK_MAX_RE];
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

/* A merge written "A B" (A not empty, B not empty) into its two halves. */
static bool split_merge(const struct bd_gguf_str *m, struct bd_gguf_str ret[2])
{
	const char *s = m->len > 1 ? memchr(m->s + 1, ' ', m->len - 1) : NULL;
	if (!s || s + 1 == m->s + m->len)
		return false;
	ret[0] = (struct bd_gguf_str){ m->s, (size_t)(s - m->s) };
	ret[1] = (struct bd_gguf_str){ s + 1, m->len - (size_t)(s - m->s) - 1 };
	return true;
}

static void spec_free(struct bd_tokenizer_spec *sp)
{
	free(sp->tok_owned);
	free(sp->type);
	free(sp->merge);
}

/* ---- from GGUF metadata -------------------------------------------------------------------- */

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

static int gguf_spec(const struct bd_gguf *g, struct bd_tokenizer_spec *sp, char *err)
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
	for (int i = 0; i < BD_TOK_MAX_RE && pd->re[i]; i++)
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
	for (size_t i = 0; i < merges->n; i++)
		if (!split_merge(&merges->strs[i], sp->merge[i]))
			return fail(err, -EBADMSG, "tokenizer.ggml.merges[%zu] is not \"A B\"", i);
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
	struct bd_tokenizer_spec sp = { .bos = -1, .eos = -1, .pad = -1, .unk = -1 };
	int r = gguf_spec(g, &sp, ret_err);
	if (r == 0)
		r = bd_tokenizer_build(&sp, ret, ret_err);
	spec_free(&sp);
	return r;
}

/* ---- from tokenizer.json ------------------------------------------------------------------- */

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

static int json_pre(json_t *pre, struct bd_tokenizer_spec *sp, char *err)
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
		if (sp->n_re == BD_TOK_MAX_RE)
			return fail(err, -ENOTSUP, "pre_tokenizer has more than %d splitting steps",
				    BD_TOK_MAX_RE);
		sp->re[sp->n_re++] = re;
	}
	return 0;
}

/* Find a token by text: added tokens first (they override the vocabulary), then any. */
static int64_t spec_find(const struct bd_tokenizer_spec *sp, const struct bd_gguf_str *s)
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
static int json_special(const struct bd_tokenizer_spec *sp, json_t *cfg, const char *key,
			int64_t *ret, char *err)
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

static int json_config(json_t *cfg, struct bd_tokenizer_spec *sp, char *err)
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

static int json_model(json_t *root, struct bd_tokenizer_spec *sp, char *err)
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
			if (!split_merge(&m, out))
				return fail(err, -EBADMSG, "model.merges[%zu] is not \"A B\"", i);
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
	struct bd_tokenizer_spec sp = { .bos = -1, .eos = -1, .pad = -1, .unk = -1,
			   .no_tpl = "no tokenizer_config.json was given" };
	int r = load_json(tokenizer_json, &root, ret_err);
	if (r == 0 && !json_is_object(root))
		r = fail(ret_err, -EBADMSG, "%s is not a JSON object", tokenizer_json);
	if (r == 0)
		r = json_model(root, &sp, ret_err);
	if (r == 0 && config_json && (r = load_json(config_json, &cfg, ret_err)) == 0)
		r = json_config(cfg, &sp, ret_err);
	if (r == 0)
		r = bd_tokenizer_build(&sp, ret, ret_err);
	spec_free(&sp);
	json_decref(cfg);
	json_decref(root);
	return r;
}
