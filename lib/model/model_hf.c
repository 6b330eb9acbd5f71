/* model_hf.c — Hugging Face checkpoints (config.json + safetensors) into a bd_model
 * (bd_model_hf.h). Built on the public model API: bd_model_alloc, then every tensor converted
 * into the slot it allocated; shards through bd_model_shard_of.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "model/bd_model_hf.h"
#include "base/bd_err.h"
#include "formats/bd_safetensors.h"

#define HP_MAX (1 << 24)           /* the GGUF loader's bound on every size */
#define MAX_JSON_BYTES (64u << 20) /* config.json and the index are small; refuse a huge one */
#define INDEX_NAME "model.safetensors.index.json"

#define fail(err, code, ...) bd_errf((err), BD_MODEL_ERR_MAX, (code), __VA_ARGS__)

static void clear_err(char *err)
{
	if (err)
		err[0] = 0;
}

/* Read a whole (small) file into a malloc'ed buffer. Returns 0 or -errno (-EFBIG: too big). */
static int slurp(const char *path, char **ret, size_t *ret_len)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -errno;
	struct stat sb;
	if (fstat(fd, &sb) < 0) {
		int e = errno;
		close(fd);
		return -e;
	}
	if (!S_ISREG(sb.st_mode)) {
		close(fd);
		return S_ISDIR(sb.st_mode) ? -EISDIR : -EINVAL;
	}
	if (sb.st_size > (off_t)MAX_JSON_BYTES) {
		close(fd);
		return -EFBIG;
	}
	size_t n = (size_t)sb.st_size, got = 0;
	char *buf = malloc(n + 1);
	if (!buf) {
		close(fd);
		return -ENOMEM;
	}
	while (got < n) {
		ssize_t k = read(fd, buf + got, n - got);
		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0) {
			int e = k < 0 ? errno : EIO; /* shrank while reading */
			free(buf);
			close(fd);
			return -e;
		}
		got += (size_t)k;
	}
	close(fd);
	buf[n] = 0;
	*ret = buf;
	*ret_len = n;
	return 0;
}

/* ---- config.json ----------------------------------------------------------------------------- */

/* A key's value, with JSON null read as absent. */
static json_t *get(const json_t *o, const char *key)
{
	json_t *v = json_object_get(o, key);
	return json_is_null(v) ? NULL : v;
}

/* The value of key if present (not absent or null) and of kind k: 1 and *ret, 0 absent, or
 * -EBADMSG "config.json: key is not ...". */
enum cfg_kind { CFG_INT, CFG_NUMBER, CFG_BOOL };

static int cfg_value(const json_t *o, const char *key, enum cfg_kind k, json_t **ret,
		     char *err)
{
	static const char *const what[] = { "an integer", "a number", "true or false" };
	json_t *v = get(o, key);
	if (!v)
		return 0;
	bool ok = k == CFG_INT ? json_is_integer(v)
		: k == CFG_NUMBER ? json_is_number(v) : json_is_boolean(v);
	if (!ok)
		return fail(err, -EBADMSG, "config.json: %s is not %s", key, what[k]);
	*ret = v;
	return 1;
}

/* An integer in 1..HP_MAX; def < 0: required. */
static int cfg_int(const json_t *o, const char *key, int def, int *ret, char *err)
{
	json_t *v = NULL;
	int r = cfg_value(o, key, CFG_INT, &v, err);
	if (r == 0 && def < 0)
		return fail(err, -EBADMSG, "config.json: %s is missing", key);
	if (r <= 0) {
		if (r == 0)
			*ret = def;
		return r;
	}
	json_int_t x = json_integer_value(v);
	if (x < 1 || x > HP_MAX)
		return fail(err, -EBADMSG, "config.json: %s = %lld is outside 1..%d", key,
			    (long long)x, HP_MAX);
	*ret = (int)x;
	return 0;
}

/* A finite number > 0 (also as FP32). */
static int cfg_float(const json_t *o, const char *key, double def, float *ret, char *err)
{
	json_t *v = NULL;
	int r = cfg_value(o, key, CFG_NUMBER, &v, err);
	if (r <= 0) {
		if (r == 0)
			*ret = (float)def;
		return r;
	}
	double x = json_number_value(v);
	float f = (float)x;
	if (!isfinite(x) || !(x > 0.0) || !isfinite(f) || !(f > 0.0f))
		return fail(err, -EBADMSG, "config.json: %s = %g is not a finite positive FP32 "
			    "value", key, x);
	*ret = f;
	return 0;
}

static int cfg_bool(const json_t *o, const char *key, bool def, bool *ret, char *err)
{
	json_t *v = NULL;
	int r = cfg_value(o, key, CFG_BOOL, &v, err);
	if (r >= 0)
		*ret = r ? json_is_true(v) : def;
	return r < 0 ? r : 0;
}

/* rope_scaling / rope_parameters: only the plain kind (no scaling) is implemented. */
static int cfg_rope_kind(const json_t *o, const char *key, bool type_required, char *err)
{
	json_t *v = get(o, key);
	if (!v)
		return 0;
	if (!json_is_object(v))
		return fail(err, -EBADMSG, "config.json: %s is not an object", key);
	json_t *t = get(v, "rope_type");
	if (!t)
		t = get(v, "type");
	if (!t) {
		if (type_required)
			return fail(err, -EBADMSG, "config.json: %s has no rope_type", key);
		return 0;
	}
	if (!json_is_string(t))
		return fail(err, -EBADMSG, "config.json: %s.rope_type is not a string", key);
	if (strcmp(json_string_value(t), "default") != 0)
		return fail(err, -ENOTSUP, "config.json: %s kind '%.32s' is not supported (only "
			    "unscaled RoPE)", key, json_string_value(t));
	return 0;
}

static const struct {
	const char *hf_class, *model_type;
	enum bd_arch arch;
	int def_ctx;
} archs[] = {
	{ "LlamaForCausalLM", "llama", BD_ARCH_LLAMA, 2048 },
	{ "Qwen2ForCausalLM", "qwen2", BD_ARCH_QWEN2, 32768 },
	{ "Qwen3ForCausalLM", "qwen3", BD_ARCH_QWEN3, 32768 },
};
#define N_ARCHS (int)(sizeof(archs) / sizeof(archs[0]))

static int cfg_arch(const json_t *root, int *ret, char *err)
{
	json_t *a = get(root, "architectures"), *mt = get(root, "model_type");
	int ai = -1, mi = -1;

	if (mt && !json_is_string(mt))
		return fail(err, -EBADMSG, "config.json: model_type is not a string");
	if (mt)
		for (int i = 0; i < N_ARCHS; i++)
			if (strcmp(json_string_value(mt), archs[i].model_type) == 0)
				mi = i;
	if (a) {
		if (!json_is_array(a) || json_array_size(a) < 1 ||
		    !json_is_string(json_array_get(a, 0)))
			return fail(err, -EBADMSG,
				    "config.json: architectures is not a list of names");
		const char *cls = json_string_value(json_array_get(a, 0));
		for (int i = 0; i < N_ARCHS; i++)
			if (strcmp(cls, archs[i].hf_class) == 0)
				ai = i;
		if (ai < 0)
			return fail(err, -ENOTSUP, "config.json: architecture '%.48s' is not "
				    "supported (LlamaForCausalLM, Qwen2ForCausalLM, "
				    "Qwen3ForCausalLM)", cls);
		if (mt && mi != ai)
			return fail(err, -EBADMSG, "config.json: model_type '%.32s' does not match "
				    "architecture %s", json_string_value(mt), cls);
	} else {
		if (!mt)
			return fail(err, -EBADMSG,
				    "config.json: neither architectures nor model_type is given");
		if (mi < 0)
			return fail(err, -ENOTSUP, "config.json: model_type '%.32s' is not "
				    "supported (llama, qwen2, qwen3)", json_string_value(mt));
		ai = mi;
	}
	*ret = ai;
	return 0;
}

/* Options that change the architecture in ways the forward pass does not implement. */
static int cfg_unsupported(const json_t *root, const struct bd_model_hparams *hp, char *err)
{
	bool b;
	int r;
	json_t *v;

	if ((v = get(root, "hidden_act")) &&
	    (!json_is_string(v) || strcmp(json_string_value(v), "silu") != 0))
		return fail(err, -ENOTSUP, "config.json: hidden_act must be \"silu\"");
	if (hp->arch != BD_ARCH_QWEN2) {
		if ((r = cfg_bool(root, "attention_bias", false, &b, err)) < 0)
			return r;
		if (b)
			return fail(err, -ENOTSUP, "config.json: attention_bias adds an o_proj bias, "
				    "which is not supported");
	}
	if ((r = cfg_bool(root, "mlp_bias", false, &b, err)) < 0)
		return r;
	if (b)
		return fail(err, -ENOTSUP, "config.json: mlp_bias is not supported");
	if ((r = cfg_bool(root, "use_sliding_window", false, &b, err)) < 0)
		return r;
	if (b)
		return fail(err, -ENOTSUP, "config.json: sliding-window attention is not supported");
	if ((v = get(root, "layer_types"))) {
		if (!json_is_array(v))
			return fail(err, -EBADMSG, "config.json: layer_types is not a list");
		size_t i;
		json_t *t;
		json_array_foreach(v, i, t)
			if (!json_is_string(t) ||
			    strcmp(json_string_value(t), "full_attention") != 0)
				return fail(err, -ENOTSUP, "config.json: layer_types[%zu] is not "
					    "\"full_attention\"", i);
	}
	return 0;
}

static int config_from_json(const json_t *root, struct bd_model_hparams *ret, char *err)
{
	struct bd_model_hparams hp = { 0 };
	int ai = 0, r;

	if (!json_is_object(root))
		return fail(err, -EBADMSG, "config.json: not a JSON object");
	if ((r = cfg_arch(root, &ai, err)) < 0)
		return r;
	hp.arch = archs[ai].arch;
	snprintf(hp.arch_name, sizeof(hp.arch_name), "%s", archs[ai].model_type);
	hp.rope_style = BD_ROPE_NEOX; /* rotate_half: pairs (i, i + n_rot/2), see the header */
	hp.qk_norm = hp.arch == BD_ARCH_QWEN3;
	hp.attn_bias = hp.arch == BD_ARCH_QWEN2;

	if ((r = cfg_int(root, "hidden_size", -1, &hp.n_embd, err)) < 0 ||
	    (r = cfg_int(root, "intermediate_size", -1, &hp.n_ff, err)) < 0 ||
	    (r = cfg_int(root, "num_attention_heads", -1, &hp.n_heads, err)) < 0 ||
	    (r = cfg_int(root, "num_key_value_heads", hp.n_heads, &hp.n_kv_heads, err)) < 0 ||
	    (r = cfg_int(root, "num_hidden_layers", -1, &hp.n_layers, err)) < 0 ||
	    (r = cfg_int(root, "vocab_size", -1, &hp.n_vocab, err)) < 0 ||
	    (r = cfg_int(root, "max_position_embeddings", archs[ai].def_ctx, &hp.n_ctx_train,
			 err)) < 0)
		return r;
	if (hp.n_heads % hp.n_kv_heads)
		return fail(err, -EBADMSG, "config.json: %d attention heads are not a multiple of "
			    "%d KV heads", hp.n_heads, hp.n_kv_heads);
	int def_hd = hp.arch == BD_ARCH_QWEN3 ? 128 : hp.n_embd / hp.n_heads;
	if (!get(root, "head_dim") && hp.arch != BD_ARCH_QWEN3 && hp.n_embd % hp.n_heads)
		return fail(err, -EBADMSG, "config.json: no head_dim, and hidden_size %d is not a "
			    "multiple of %d heads", hp.n_embd, hp.n_heads);
	if ((r = cfg_int(root, "head_dim", def_hd < 1 ? -1 : def_hd, &hp.head_dim, err)) < 0)
		return r;
	hp.head_dim_v = hp.head_dim;
	hp.n_rot = hp.head_dim;
	json_t *prf = get(root, "partial_rotary_factor");
	if (prf) {
		double f = json_is_number(prf) ? json_number_value(prf) : -1.0;
		if (!(f > 0.0 && f <= 1.0))
			return fail(err, -EBADMSG, "config.json: partial_rotary_factor is not in "
				    "(0, 1]");
		hp.n_rot = (int)((double)hp.head_dim * f); /* transformers truncates too */
	}
	if (hp.head_dim % 2 || hp.n_rot < 2 || hp.n_rot % 2)
		return fail(err, -EBADMSG, "config.json: head_dim %d and rotated dims %d must be "
			    "even", hp.head_dim, hp.n_rot);

	if ((r = cfg_rope_kind(root, "rope_scaling", true, err)) < 0 ||
	    (r = cfg_rope_kind(root, "rope_parameters", false, err)) < 0)
		return r;
	json_t *rp = get(root, "rope_parameters");
	double def_theta = 10000.0;
	if (!get(root, "rope_theta") && rp && get(rp, "rope_theta")) {
		if ((r = cfg_float(rp, "rope_theta", 0.0, &hp.rope_base, err)) < 0)
			return r;
		def_theta = hp.rope_base;
	}
	if ((r = cfg_float(root, "rope_theta", def_theta, &hp.rope_base, err)) < 0 ||
	    (r = cfg_float(root, "rms_norm_eps", 1e-6, &hp.norm_eps, err)) < 0 ||
	    (r = cfg_bool(root, "tie_word_embeddings", false, &hp.tied_embeddings, err)) < 0 ||
	    (r = cfg_unsupported(root, &hp, err)) < 0)
		return r;
	*ret = hp;
	return 0;
}

int bd_hf_config_parse(const char *json, size_t len, struct bd_model_hparams *ret,
		       char *ret_err)
{
	clear_err(ret_err);
	if (!json || !ret)
		return fail(ret_err, -EINVAL, "invalid argument");
	json_error_t je;
	json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &je);
	if (!root)
		return fail(ret_err, -EBADMSG, "config.json is not JSON: %.120s (line %d)", je.text,
			    je.line);
	int r = config_from_json(root, ret, ret_err);
	json_decref(root);
	return r;
}

int bd_hf_config_load(const char *path, struct bd_model_hparams *ret, char *ret_err)
{
	char *buf;
	size_t len;

	clear_err(ret_err);
	if (!path || !ret)
		return fail(ret_err, -EINVAL, "invalid argument");
	int r = slurp(path, &buf, &len);
	if (r < 0)
		return fail(ret_err, r, "%s: %s", path, strerror(-r));
	char msg[BD_MODEL_ERR_MAX];
	r = bd_hf_config_parse(buf, len, ret, msg);
	free(buf);
	if (r < 0)
		return fail(ret_err, r, "%s: %s", path, msg);
	return 0;
}

/* ---- weight files ---------------------------------------------------------------------------- */

struct wfiles {
	int n, cap;
	struct bd_st **st;
	char **path;
};

static void wfiles_free(struct wfiles *w)
{
	for (int i = 0; i < w->n; i++) {
		bd_st_free(w->st[i]);
		free(w->path[i]);
	}
	free(w->st);
	free(w->path);
}

static int wfiles_add(struct wfiles *w, const char *path, char *err)
{
	if (w->n == w->cap) {
		int cap = w->cap ? 2 * w->cap : 8;
		struct bd_st **st = realloc(w->st, sizeof(*st) * (size_t)cap);
		if (st)
			w->st = st;
		char **p = realloc(w->path, sizeof(*p) * (size_t)cap);
		if (p)
			w->path = p;
		if (!st || !p)
			return fail(err, -ENOMEM, "out of memory");
		w->cap = cap;
	}
	char *copy = strdup(path);
	if (!copy)
		return fail(err, -ENOMEM, "out of memory");
	char serr[BD_ST_ERR_MAX];
	int r = bd_st_open(path, &w->st[w->n], serr);
	if (r < 0) {
		free(copy);
		return fail(err, r, "%s", serr);
	}
	w->path[w->n++] = copy;
	return 0;
}

/* "dir/name" into buf (PATH_MAX). */
/* The length of dir without its trailing slashes ("/" stays). */
static size_t dir_len(const char *dir)
{
	size_t n = strlen(dir);
	while (n > 1 && dir[n - 1] == '/')
		n--;
	return n;
}

static int join(char *buf, const char *dir, size_t n, const char *name, char *err)
{
	int k = snprintf(buf, PATH_MAX, "%.*s/%s", (int)n, dir, name);
	if (k < 0 || k >= PATH_MAX)
		return fail(err, -ENAMETOOLONG, "path %.*s/%.64s is too long", (int)n, dir, name);
	return 0;
}

static bool shard_name_ok(const char *s)
{
	return *s && !strchr(s, '/') && strcmp(s, ".") && strcmp(s, "..");
}

/* Open the shards an index names (relative to the index's directory) and check that each
 * tensor of its weight_map is in the shard it names. */
static int add_index(struct wfiles *w, const char *index_path, char *err)
{
	char *buf;
	size_t len;
	int r = slurp(index_path, &buf, &len);
	if (r < 0)
		return fail(err, r, "%s: %s", index_path, strerror(-r));
	json_error_t je;
	json_t *root = json_loadb(buf, len, JSON_REJECT_DUPLICATES, &je);
	free(buf);
	if (!root)
		return fail(err, -EBADMSG, "%s is not JSON: %.120s (line %d)", index_path, je.text,
			    je.line);
	json_t *map = json_object_get(root, "weight_map");
	const char *slash = strrchr(index_path, '/');
	const char *dir = slash ? index_path : ".";
	size_t dir_len = slash ? (size_t)(slash - index_path) : 1;
	if (slash && dir_len == 0) {
		dir = "/";
		dir_len = 0; /* "/index.json": shards are "/name" */
	}
	char path[PATH_MAX];
	const char *name;
	json_t *v;
	int first = w->n;

	if (!json_is_object(map)) {
		r = fail(err, -EBADMSG, "%s: weight_map is missing or not an object", index_path);
		goto out;
	}
	/* open each distinct shard once, in the order they first appear */
	json_object_foreach(map, name, v) {
		if (!json_is_string(v) || !shard_name_ok(json_string_value(v))) {
			r = fail(err, -EBADMSG, "%s: weight_map entry '%.64s' does not name a file "
				 "beside the index", index_path, name);
			goto out;
		}
		if ((r = join(path, dir, dir_len, json_string_value(v), err)) < 0)
			goto out;
		bool seen = false;
		for (int i = first; i < w->n && !seen; i++)
			seen = strcmp(w->path[i], path) == 0;
		if (!seen && (r = wfiles_add(w, path, err)) < 0)
			goto out;
	}
	json_object_foreach(map, name, v) {
		if ((r = join(path, dir, dir_len, json_string_value(v), err)) < 0)
			goto out;
		int i;
		for (i = first; i < w->n && strcmp(w->path[i], path) != 0; i++)
			;
		if (i == w->n || !bd_st_find_tensor(w->st[i], name)) {
			r = fail(err, -EBADMSG, "%s: tensor '%.64s' is not in %s, as weight_map says",
				 index_path, name, path);
			goto out;
		}
	}
	r = 0;
out:
	json_decref(root);
	return r;
}

static bool ends_with(const char *s, const char *suffix)
{
	size_t n = strlen(s), k = strlen(suffix);
	return n >= k && strcmp(s + n - k, suffix) == 0;
}

/* The one tensor of this name among the files, converted into dst, shape [rows][cols]
 * (rows = 0: a vector of cols). */
static int load(const struct wfiles *w, const char *name, uint64_t rows, uint64_t cols,
		float *dst, char *err)
{
	const struct bd_st_tensor *t = NULL;
	int at = -1;
	for (int i = 0; i < w->n; i++) {
		const struct bd_st_tensor *x = bd_st_find_tensor(w->st[i], name);
		if (!x)
			continue;
		if (t)
			return fail(err, -EBADMSG, "tensor %s is in both %s and %s", name,
				    w->path[at], w->path[i]);
		t = x;
		at = i;
	}
	if (!t)
		return fail(err, -EBADMSG, "tensor %s is missing", name);
	bool ok = rows ? t->n_dims == 2 && t->shape[0] == rows && t->shape[1] == cols
		       : t->n_dims == 1 && t->shape[0] == cols;
	if (!ok) {
		char got[96] = "[", *p = got + 1;
		for (int i = 0; i < t->n_dims && p < got + sizeof(got) - 24; i++)
			p += snprintf(p, (size_t)(got + sizeof(got) - p), "%s%llu", i ? ", " : "",
				      (unsigned long long)t->shape[i]);
		snprintf(p, (size_t)(got + sizeof(got) - p), "]");
		if (rows)
			return fail(err, -EBADMSG, "tensor %s has shape %s, expected [%llu, %llu]",
				    name, got, (unsigned long long)rows, (unsigned long long)cols);
		return fail(err, -EBADMSG, "tensor %s has shape %s, expected [%llu]", name, got,
			    (unsigned long long)cols);
	}
	int r = bd_st_tensor_to_f32(t, dst);
	if (r == -ENOTSUP)
		return fail(err, r, "tensor %s has dtype %s; F32, F16 or BF16 expected", name,
			    bd_st_dtype_name(t->dtype));
	if (r < 0)
		return fail(err, r, "tensor %s: conversion failed (%d)", name, r);
	return 0;
}

static int fill(struct bd_model *m, const struct wfiles *w, char *err)
{
	const struct bd_model_hparams *hp = &m->hp;
	uint64_t E = (uint64_t)hp->n_embd, F = (uint64_t)hp->n_ff, V = (uint64_t)hp->n_vocab;
	uint64_t d = (uint64_t)hp->head_dim;
	uint64_t qd = (uint64_t)hp->n_heads * d, kd = (uint64_t)hp->n_kv_heads * d;
	char name[128];
	int r;

#define LOAD(nm, rows, cols, dst)                                                          \
	do {                                                                               \
		if ((r = load(w, nm, rows, cols, dst, err)) < 0)                            \
			return r;                                                          \
	} while (0)
#define LOADL(suffix, rows, cols, dst)                                                     \
	do {                                                                               \
		snprintf(name, sizeof(name), "model.layers.%d.%s", l, suffix);             \
		LOAD(name, rows, cols, dst);                                               \
	} while (0)

	LOAD("model.embed_tokens.weight", V, E, m->tok_embd.f32);
	LOAD("model.norm.weight", 0, E, m->output_norm);
	if (!hp->tied_embeddings)
		LOAD("lm_head.weight", V, E, m->output.f32);
	for (int l = 0; l < hp->n_layers; l++) {
		struct bd_model_layer *ly = &m->layers[l];
		LOADL("input_layernorm.weight", 0, E, ly->attn_norm);
		LOADL("self_attn.q_proj.weight", qd, E, ly->wq.f32);
		LOADL("self_attn.k_proj.weight", kd, E, ly->wk.f32);
		LOADL("self_attn.v_proj.weight", kd, E, ly->wv.f32);
		LOADL("self_attn.o_proj.weight", E, qd, ly->wo.f32);
		if (hp->attn_bias) {
			LOADL("self_attn.q_proj.bias", 0, qd, ly->bq);
			LOADL("self_attn.k_proj.bias", 0, kd, ly->bk);
			LOADL("self_attn.v_proj.bias", 0, kd, ly->bv);
		}
		if (hp->qk_norm) {
			LOADL("self_attn.q_norm.weight", 0, d, ly->q_norm);
			LOADL("self_attn.k_norm.weight", 0, d, ly->k_norm);
		}
		LOADL("post_attention_layernorm.weight", 0, E, ly->ffn_norm);
		LOADL("mlp.gate_proj.weight", F, E, ly->w_gate.f32);
		LOADL("mlp.up_proj.weight", F, E, ly->w_up.f32);
		LOADL("mlp.down_proj.weight", E, F, ly->w_down.f32);
	}
#undef LOADL
#undef LOAD
	return 0;
}

int bd_model_from_hf_files(const char *config_path, const char *const *paths, int n_paths,
			   struct bd_model **ret, char *ret_err)
{
	struct bd_model_hparams hp;
	struct bd_model *m = NULL;
	struct wfiles w = { 0 };
	int r = 0;

	clear_err(ret_err);
	if (!config_path || !paths || n_paths < 1 || !ret)
		return fail(ret_err, -EINVAL, "no config, no weight files or no result pointer");
	for (int i = 0; i < n_paths; i++)
		if (!paths[i])
			return fail(ret_err, -EINVAL, "weight file %d is NULL", i);
	/* the config first: its errors come before any weights are mapped */
	if ((r = bd_hf_config_load(config_path, &hp, ret_err)) < 0)
		return r;
	for (int i = 0; i < n_paths && r == 0; i++)
		r = ends_with(paths[i], ".json") ? add_index(&w, paths[i], ret_err)
						 : wfiles_add(&w, paths[i], ret_err);
	if (r == 0 && (r = bd_model_alloc(&hp, &m)) < 0)
		r = r == -ENOMEM ? fail(ret_err, r, "out of memory for the weights")
				 : fail(ret_err, r, "%s: hyperparameters out of range", config_path);
	if (r == 0 && (r = fill(m, &w, ret_err)) < 0)
		bd_model_free(m);
	if (r == 0)
		*ret = m;
	wfiles_free(&w);
	return r;
}

int bd_model_from_hf(const char *dir, struct bd_model **ret, char *ret_err)
{
	char config[PATH_MAX], weights[PATH_MAX];
	struct stat sb;
	int r;

	clear_err(ret_err);
	if (!dir || !ret)
		return fail(ret_err, -EINVAL, "no directory or no result pointer");
	size_t n = dir_len(dir);
	if ((r = join(config, dir, n, "config.json", ret_err)) < 0 ||
	    (r = join(weights, dir, n, INDEX_NAME, ret_err)) < 0)
		return r;
	/* no index: the single file (whose absence open() then reports) */
	if (stat(weights, &sb) < 0 && (r = join(weights, dir, n, "model.safetensors", ret_err)) < 0)
		return r;
	const char *paths[1] = { weights };
	return bd_model_from_hf_files(config, paths, 1, ret, ret_err);
}

int bd_model_from_hf_shard(const char *dir, int rank, int tp, struct bd_model **ret,
			   char *ret_err)
{
	char config[PATH_MAX];
	struct bd_model_hparams hp;
	struct bd_model *full = NULL;
	struct bd_model_shard sh;
	int r;

	clear_err(ret_err);
	if (!dir || !ret)
		return fail(ret_err, -EINVAL, "no directory or no result pointer");
	size_t n = dir_len(dir); /* the split is checked before any weights are read */
	if ((r = join(config, dir, n, "config.json", ret_err)) < 0 ||
	    (r = bd_hf_config_load(config, &hp, ret_err)) < 0)
		return r;
	if (bd_model_shard_plan(&hp, rank, tp, &sh) < 0)
		return fail(ret_err, -EINVAL, "rank %d of %d: the model's %d KV heads and %d MLP "
			    "columns cannot be split that way", rank, tp, hp.n_kv_heads, hp.n_ff);
	if ((r = bd_model_from_hf(dir, &full, ret_err)) < 0)
		return r;
	if (tp == 1) {
		*ret = full;
		return 0;
	}
	r = bd_model_shard_of(full, rank, tp, ret);
	if (r < 0)
		fail(ret_err, r, "cutting rank %d of %d out of the model failed", rank, tp);
	bd_model_free(full);
	return r;
}
