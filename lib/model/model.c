/* model.c — Llama/Qwen2/Qwen3 forward pass on the CPU with the bdfp4 KV cache (bd_model.h). */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>

#include "model/bd_model.h"
#include "base/bd_err.h"
#include "model/bd_sampler.h"

#define FLOAT_ALIGN 16 /* tensors start on 64-byte boundaries inside the model's allocation */
#define PREFILL_CHUNK 64 /* query rows per attention block in prefill */

#define fail(ret_err, code, ...) bd_errf((ret_err), BD_MODEL_ERR_MAX, (code), __VA_ARGS__)

static void clear_err(char *ret_err)
{
	if (ret_err)
		ret_err[0] = '\0';
}

/* ---- allocation -------------------------------------------------------------------------- */

static bool hp_ok(const struct bd_model_hparams *hp)
{
	const int lim = 1 << 24;
	if (hp->n_layers < 1 || hp->n_embd < 1 || hp->n_ff < 1 || hp->n_heads < 1 ||
	    hp->n_kv_heads < 1 || hp->head_dim < 1 || hp->n_vocab < 1 || hp->n_ctx_train < 1)
		return false;
	if (hp->n_layers > lim || hp->n_embd > lim || hp->n_ff > lim || hp->n_heads > lim ||
	    hp->head_dim > lim || hp->n_vocab > lim)
		return false;
	if (hp->n_heads % hp->n_kv_heads != 0 || hp->head_dim_v != hp->head_dim)
		return false;
	if (hp->n_rot < 2 || hp->n_rot % 2 != 0 || hp->n_rot > hp->head_dim)
		return false;
	if (!isfinite(hp->rope_base) || !(hp->rope_base > 0.0f) || !isfinite(hp->norm_eps) ||
	    !(hp->norm_eps > 0.0f))
		return false;
	return hp->rope_style == BD_ROPE_NORM || hp->rope_style == BD_ROPE_NEOX;
}

/* Hand out n floats from the model's block (or just count them when base is NULL). */
static float *carve(float *base, size_t *cursor, size_t n)
{
	float *p = base ? base + *cursor : NULL;
	*cursor += (n + FLOAT_ALIGN - 1) / FLOAT_ALIGN * FLOAT_ALIGN;
	return p;
}

/* Lay out every tensor of the model in base (NULL: only count); returns the float count. */
static size_t lay_out(struct bd_model *m, float *base)
{
	const struct bd_model_hparams *hp = &m->hp;
	const struct bd_model_shard *sh = &m->shard;
	size_t E = (size_t)hp->n_embd, F = (size_t)sh->n_ff, V = (size_t)hp->n_vocab;
	size_t qd = (size_t)sh->n_heads * (size_t)hp->head_dim;
	size_t kd = (size_t)sh->n_kv_heads * (size_t)hp->head_dim;
	size_t d = (size_t)hp->head_dim, cur = 0;

	m->tok_embd = carve(base, &cur, V * E);
	m->output_norm = NULL;
	m->output = NULL;
	if (sh->lm_head) {
		m->output_norm = carve(base, &cur, E);
		m->output = hp->tied_embeddings ? m->tok_embd : carve(base, &cur, V * E);
	}
	for (int l = 0; l < hp->n_layers; l++) {
		struct bd_model_layer ly = { 0 };
		ly.attn_norm = carve(base, &cur, E);
		ly.wq = carve(base, &cur, qd * E);
		ly.wk = carve(base, &cur, kd * E);
		ly.wv = carve(base, &cur, kd * E);
		ly.wo = carve(base, &cur, E * qd);
		if (hp->attn_bias) {
			ly.bq = carve(base, &cur, qd);
			ly.bk = carve(base, &cur, kd);
			ly.bv = carve(base, &cur, kd);
		}
		if (hp->qk_norm) {
			ly.q_norm = carve(base, &cur, d);
			ly.k_norm = carve(base, &cur, d);
		}
		ly.ffn_norm = carve(base, &cur, E);
		ly.w_gate = carve(base, &cur, F * E);
		ly.w_up = carve(base, &cur, F * E);
		ly.w_down = carve(base, &cur, E * F);
		if (base)
			m->layers[l] = ly;
	}
	return cur;
}

/* a, b: the share of n that rank gets when n is dealt over tp ranks, first ranks first */
static void deal(int n, int tp, int rank, int *ret_first, int *ret_count)
{
	int base = n / tp, extra = n % tp;
	*ret_count = base + (rank < extra ? 1 : 0);
	*ret_first = rank * base + (rank < extra ? rank : extra);
}

int bd_model_shard_plan(const struct bd_model_hparams *hp, int rank, int tp,
			struct bd_model_shard *ret)
{
	if (!hp || !ret || !hp_ok(hp) || tp < 1 || rank < 0 || rank >= tp ||
	    tp > hp->n_kv_heads || tp > hp->n_ff)
		return -EINVAL;
	struct bd_model_shard sh = { .rank = rank, .tp = tp, .lm_head = rank == 0 };
	int G = hp->n_heads / hp->n_kv_heads;
	deal(hp->n_kv_heads, tp, rank, &sh.kv_head0, &sh.n_kv_heads);
	sh.head0 = sh.kv_head0 * G;
	sh.n_heads = sh.n_kv_heads * G;
	deal(hp->n_ff, tp, rank, &sh.ff0, &sh.n_ff);
	*ret = sh;
	return 0;
}

static int alloc_shard(const struct bd_model_hparams *hp, const struct bd_model_shard *sh,
		       struct bd_model **ret)
{
	struct bd_model *m = calloc(1, sizeof(*m));
	if (!m)
		return -ENOMEM;
	m->hp = *hp;
	m->shard = *sh;
	m->layers = calloc((size_t)hp->n_layers, sizeof(*m->layers));
	size_t n = lay_out(m, NULL);
	if (!m->layers || n > SIZE_MAX / sizeof(float)) {
		bd_model_free(m);
		return -ENOMEM;
	}
	m->mem_bytes = n * sizeof(float);
	m->mem = aligned_alloc(64, m->mem_bytes);
	if (!m->mem) {
		bd_model_free(m);
		return -ENOMEM;
	}
	memset(m->mem, 0, m->mem_bytes);
	lay_out(m, m->mem);
	*ret = m;
	return 0;
}

int bd_model_alloc(const struct bd_model_hparams *hp, struct bd_model **ret)
{
	struct bd_model_shard sh;
	if (!hp || !ret || bd_model_shard_plan(hp, 0, 1, &sh) < 0)
		return -EINVAL;
	return alloc_shard(hp, &sh, ret);
}

void bd_model_free(struct bd_model *m)
{
	if (!m)
		return;
	free(m->mem);
	free(m->layers);
	free(m);
}

/* ---- GGUF loading ------------------------------------------------------------------------- */

/* Dequantize rows r0 .. r0+nr−1, columns c0 .. c0+nc−1 of tensor `name`, of shape
 * {cols, rows} (rows = 0: a vector of cols; rows_at_least: the tensor may have more rows),
 * into dst [nr][nc]. A column slice goes row by row through a scratch row. */
static int load_slice(const struct bd_gguf *g, const char *name, uint64_t cols, uint64_t rows,
		      bool rows_at_least, uint64_t r0, uint64_t nr, uint64_t c0, uint64_t nc,
		      float *dst, char *ret_err)
{
	const struct bd_gguf_tensor *t = bd_gguf_find_tensor(g, name);
	if (!t)
		return fail(ret_err, -EBADMSG, "tensor %s is missing", name);
	uint64_t want1 = rows ? rows : 1;
	bool shape_ok = t->ne[0] == cols && t->ne[2] == 1 && t->ne[3] == 1 &&
			(rows_at_least ? t->ne[1] >= want1 : t->ne[1] == want1);
	if (!shape_ok)
		return fail(ret_err, -EBADMSG,
			    "tensor %s has shape {%llu, %llu, %llu, %llu}, expected {%llu, %llu}",
			    name, (unsigned long long)t->ne[0], (unsigned long long)t->ne[1],
			    (unsigned long long)t->ne[2], (unsigned long long)t->ne[3],
			    (unsigned long long)cols, (unsigned long long)want1);
	int r = 0;
	if (c0 == 0 && nc == cols) {
		r = bd_gguf_tensor_rows_f32(t, r0, nr, dst);
	} else {
		float *row = malloc(sizeof(float) * cols);
		if (!row)
			return fail(ret_err, -ENOMEM, "out of memory");
		for (uint64_t i = 0; i < nr && r == 0; i++) {
			r = bd_gguf_tensor_rows_f32(t, r0 + i, 1, row);
			if (r == 0)
				memcpy(dst + i * nc, row + c0, sizeof(float) * nc);
		}
		free(row);
	}
	if (r == -ENOTSUP)
		return fail(ret_err, r, "tensor %s has type %s, which cannot be dequantized", name,
			    bd_ggml_type_name(t->type) ? bd_ggml_type_name(t->type) : "?");
	if (r < 0)
		return fail(ret_err, r, "tensor %s: dequantization failed (%d)", name, r);
	return 0;
}

int bd_model_from_gguf_shard(const struct bd_gguf *g, int rank, int tp, struct bd_model **ret,
			     char *ret_err)
{
	struct bd_model_hparams hp;
	struct bd_model_shard sh;
	struct bd_model *m = NULL;
	char gerr[BD_GGUF_ERR_MAX];
	int r;

	clear_err(ret_err);
	if (!g || !ret)
		return fail(ret_err, -EINVAL, "no model or no result pointer");
	if ((r = bd_gguf_model_hparams(g, &hp, gerr)) < 0)
		return fail(ret_err, r, "%s", gerr);
	if (hp.head_dim_v != hp.head_dim)
		return fail(ret_err, -ENOTSUP, "value head dim %d differs from key head dim %d",
			    hp.head_dim_v, hp.head_dim);
	if (bd_model_shard_plan(&hp, rank, tp, &sh) < 0) {
		if (!hp_ok(&hp))
			return fail(ret_err, -EINVAL, "hyperparameters out of range");
		return fail(ret_err, -EINVAL,
			    "rank %d of %d: the model's %d KV heads and %d MLP columns cannot be "
			    "split that way", rank, tp, hp.n_kv_heads, hp.n_ff);
	}
	if ((r = alloc_shard(&hp, &sh, &m)) < 0)
		return fail(ret_err, r, "out of memory for the weights");

	uint64_t E = (uint64_t)hp.n_embd, F = (uint64_t)hp.n_ff, V = (uint64_t)hp.n_vocab;
	uint64_t d = (uint64_t)hp.head_dim;
	uint64_t qd = (uint64_t)hp.n_heads * d, kd = (uint64_t)hp.n_kv_heads * d;
	uint64_t q0 = (uint64_t)sh.head0 * d, nq = (uint64_t)sh.n_heads * d;
	uint64_t k0 = (uint64_t)sh.kv_head0 * d, nk = (uint64_t)sh.n_kv_heads * d;
	uint64_t f0 = (uint64_t)sh.ff0, nf = (uint64_t)sh.n_ff;
	char name[96];

/* whole tensor; rows r0.. of a matrix; columns c0.. of a matrix or a vector */
#define LOAD(nm, cols, rows, atleast, dst)                                                 \
	do {                                                                               \
		if ((r = load_slice(g, nm, cols, rows, atleast, 0, (rows) ? (rows) : 1, 0,  \
				    cols, dst, ret_err)) < 0)                              \
			goto out;                                                          \
	} while (0)
#define LOADL(suffix, cols, rows, r0, nr, c0, nc, dst)                                     \
	do {                                                                               \
		snprintf(name, sizeof(name), "blk.%d.%s", l, suffix);                      \
		if ((r = load_slice(g, name, cols, rows, false, r0, nr, c0, nc, dst,        \
				    ret_err)) < 0)                                         \
			goto out;                                                          \
	} while (0)

	/* the embedding is read as V rows even when the tensor pads the vocabulary */
	LOAD("token_embd.weight", E, V, true, m->tok_embd);
	if (sh.lm_head) {
		LOAD("output_norm.weight", E, 0, false, m->output_norm);
		if (!hp.tied_embeddings)
			LOAD("output.weight", E, V, true, m->output);
	}
	for (int l = 0; l < hp.n_layers; l++) {
		struct bd_model_layer *ly = &m->layers[l];
		LOADL("attn_norm.weight", E, 0, 0, 1, 0, E, ly->attn_norm);
		LOADL("attn_q.weight", E, qd, q0, nq, 0, E, ly->wq);
		LOADL("attn_k.weight", E, kd, k0, nk, 0, E, ly->wk);
		LOADL("attn_v.weight", E, kd, k0, nk, 0, E, ly->wv);
		LOADL("attn_output.weight", qd, E, 0, E, q0, nq, ly->wo);
		if (hp.attn_bias) {
			LOADL("attn_q.bias", qd, 0, 0, 1, q0, nq, ly->bq);
			LOADL("attn_k.bias", kd, 0, 0, 1, k0, nk, ly->bk);
			LOADL("attn_v.bias", kd, 0, 0, 1, k0, nk, ly->bv);
		}
		if (hp.qk_norm) {
			LOADL("attn_q_norm.weight", d, 0, 0, 1, 0, d, ly->q_norm);
			LOADL("attn_k_norm.weight", d, 0, 0, 1, 0, d, ly->k_norm);
		}
		LOADL("ffn_norm.weight", E, 0, 0, 1, 0, E, ly->ffn_norm);
		LOADL("ffn_gate.weight", E, F, f0, nf, 0, E, ly->w_gate);
		LOADL("ffn_up.weight", E, F, f0, nf, 0, E, ly->w_up);
		LOADL("ffn_down.weight", F, E, 0, E, f0, nf, ly->w_down);
	}
#undef LOADL
#undef LOAD
	*ret = m;
	return 0;
out:
	bd_model_free(m);
	return r;
}

int bd_model_from_gguf(const struct bd_gguf *g, struct bd_model **ret, char *ret_err)
{
	return bd_model_from_gguf_shard(g, 0, 1, ret, ret_err);
}

int bd_model_load_shard(const char *path, int rank, int tp, struct bd_model **ret,
			char *ret_err)
{
	struct bd_gguf *g = NULL;
	char gerr[BD_GGUF_ERR_MAX];
	int r;

	clear_err(ret_err);
	if (!path || !ret)
		return fail(ret_err, -EINVAL, "no path or no result pointer");
	if ((r = bd_gguf_open(path, &g, gerr)) < 0)
		return gerr[0] ? fail(ret_err, r, "%s", gerr)
			       : fail(ret_err, r, "%s: %s", path, strerror(-r));
	r = bd_model_from_gguf_shard(g, rank, tp, ret, ret_err);
	bd_gguf_free(g);
	return r;
}

/* Copy rows r0.. (nr of them) and columns c0.. (nc) of src [][cols] into dst [nr][nc]. */
static void copy_block(const float *src, size_t cols, size_t r0, size_t nr, size_t c0,
		       size_t nc, float *dst)
{
	for (size_t i = 0; i < nr; i++)
		memcpy(dst + i * nc, src + (r0 + i) * cols + c0, sizeof(float) * nc);
}

int bd_model_shard_of(const struct bd_model *full, int rank, int tp, struct bd_model **ret)
{
	struct bd_model_shard sh;
	struct bd_model *m;
	int r;

	if (!full || !ret || full->shard.tp != 1 ||
	    bd_model_shard_plan(&full->hp, rank, tp, &sh) < 0)
		return -EINVAL;
	if ((r = alloc_shard(&full->hp, &sh, &m)) < 0)
		return r;
	const struct bd_model_hparams *hp = &full->hp;
	size_t E = (size_t)hp->n_embd, F = (size_t)hp->n_ff, V = (size_t)hp->n_vocab;
	size_t d = (size_t)hp->head_dim;
	size_t qd = (size_t)hp->n_heads * d, kd = (size_t)hp->n_kv_heads * d;
	size_t q0 = (size_t)sh.head0 * d, nq = (size_t)sh.n_heads * d;
	size_t k0 = (size_t)sh.kv_head0 * d, nk = (size_t)sh.n_kv_heads * d;
	size_t f0 = (size_t)sh.ff0, nf = (size_t)sh.n_ff;

	memcpy(m->tok_embd, full->tok_embd, sizeof(float) * V * E);
	if (sh.lm_head) {
		memcpy(m->output_norm, full->output_norm, sizeof(float) * E);
		if (!hp->tied_embeddings)
			memcpy(m->output, full->output, sizeof(float) * V * E);
	}
	for (int l = 0; l < hp->n_layers; l++) {
		const struct bd_model_layer *a = &full->layers[l];
		struct bd_model_layer *b = &m->layers[l];
		memcpy(b->attn_norm, a->attn_norm, sizeof(float) * E);
		copy_block(a->wq, E, q0, nq, 0, E, b->wq);
		copy_block(a->wk, E, k0, nk, 0, E, b->wk);
		copy_block(a->wv, E, k0, nk, 0, E, b->wv);
		copy_block(a->wo, qd, 0, E, q0, nq, b->wo);
		if (hp->attn_bias) {
			copy_block(a->bq, qd, 0, 1, q0, nq, b->bq);
			copy_block(a->bk, kd, 0, 1, k0, nk, b->bk);
			copy_block(a->bv, kd, 0, 1, k0, nk, b->bv);
		}
		if (hp->qk_norm) {
			memcpy(b->q_norm, a->q_norm, sizeof(float) * d);
			memcpy(b->k_norm, a->k_norm, sizeof(float) * d);
		}
		memcpy(b->ffn_norm, a->ffn_norm, sizeof(float) * E);
		copy_block(a->w_gate, E, f0, nf, 0, E, b->w_gate);
		copy_block(a->w_up, E, f0, nf, 0, E, b->w_up);
		copy_block(a->w_down, F, 0, E, f0, nf, b->w_down);
	}
	*ret = m;
	return 0;
}

int bd_model_load(const char *path, struct bd_model **ret, char *ret_err)
{
	struct bd_gguf *g = NULL;
	char gerr[BD_GGUF_ERR_MAX];
	int r;

	clear_err(ret_err);
	if (!path || !ret)
		return fail(ret_err, -EINVAL, "no path or no result pointer");
	if ((r = bd_gguf_open(path, &g, gerr)) < 0)
		return gerr[0] ? fail(ret_err, r, "%s", gerr)
			       : fail(ret_err, r, "%s: %s", path, strerror(-r));
	r = bd_model_from_gguf(g, ret, ret_err);
	bd_gguf_free(g);
	return r;
}

/* ---- building blocks ---------------------------------------------------------------------- */

int bd_rmsnorm(const float *x, const float *w, int n, float eps, float *ret_y)
{
	if (!x || !w || !ret_y || n < 1 || !(eps > 0.0f))
		return -EINVAL;
	double ss = 0.0;
	for (int i = 0; i < n; i++)
		ss += (double)x[i] * (double)x[i];
	float scale = (float)(1.0 / sqrt(ss / n + (double)eps));
	for (int i = 0; i < n; i++)
		ret_y[i] = x[i] * scale * w[i];
	return 0;
}

int bd_rope(float *x, int n_heads, int head_dim, int n_rot, int pos, float base,
	    enum bd_rope_style style)
{
	if (!x || n_heads < 1 || n_rot < 2 || n_rot % 2 != 0 || n_rot > head_dim || pos < 0 ||
	    !isfinite(base) || !(base > 0.0f) || (style != BD_ROPE_NORM && style != BD_ROPE_NEOX))
		return -EINVAL;
	int half = n_rot / 2;
	for (int i = 0; i < half; i++) {
		double theta = (double)pos * pow((double)base, -2.0 * i / n_rot);
		float c = (float)cos(theta), s = (float)sin(theta);
		int i0 = style == BD_ROPE_NORM ? 2 * i : i;
		int i1 = style == BD_ROPE_NORM ? 2 * i + 1 : i + half;
		for (int h = 0; h < n_heads; h++) {
			float *v = x + (size_t)h * (size_t)head_dim;
			float a = v[i0], b = v[i1];
			v[i0] = a * c - b * s;
			v[i1] = a * s + b * c;
		}
	}
	return 0;
}

/* y[rows][out] = x[rows][in] · W[out][in]ᵀ (+ bias). */
static void matmul(const float *x, int rows, int in, const float *W, int out, const float *bias,
		   float *y)
{
	if (rows == 1)
		cblas_sgemv(CblasRowMajor, CblasNoTrans, out, in, 1.0f, W, in, x, 1, 0.0f, y, 1);
	else
		cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, out, in, 1.0f, x, in, W,
			    in, 0.0f, y, out);
	if (bias)
		for (int r = 0; r < rows; r++)
			for (int o = 0; o < out; o++)
				y[(size_t)r * (size_t)out + (size_t)o] += bias[o];
}

static float silu(float x)
{
	return x / (1.0f + expf(-x));
}

/* ---- KV memory: the private arena ---------------------------------------------------------- */

struct private_mem {
	uint8_t *used; /* [n_pages] */
};

static int priv_page_alloc(struct bd_kvmem *mem, int32_t *ret_page)
{
	struct private_mem *pm = mem->priv;
	for (size_t p = 0; p < mem->lay.n_pages && p <= INT32_MAX; p++) {
		if (!pm->used[p]) {
			pm->used[p] = 1;
			*ret_page = (int32_t)p;
			return 0;
		}
	}
	return -ENOSPC;
}

static void priv_page_free(struct bd_kvmem *mem, int32_t page)
{
	struct private_mem *pm = mem->priv;
	if (page >= 0 && (size_t)page < mem->lay.n_pages)
		pm->used[page] = 0;
}

static int priv_slot_alloc(struct bd_kvmem *mem, void **ret_slot)
{
	void *s = aligned_alloc(BD_PAGE_ALIGN, mem->lay.slot_bytes);
	if (!s)
		return -ENOMEM;
	memset(s, 0, mem->lay.slot_bytes);
	*ret_slot = s;
	return 0;
}

static void priv_slot_free(struct bd_kvmem *mem, void *slot)
{
	(void)mem;
	free(slot);
}

static const struct bd_kvmem_ops private_ops = {
	.page_alloc = priv_page_alloc,
	.page_free = priv_page_free,
	.slot_alloc = priv_slot_alloc,
	.slot_free = priv_slot_free,
};

int bd_kvmem_private_new(const struct bd_layout *lay, struct bd_kvmem **ret)
{
	if (!lay || !ret || lay->n_pages < 1 || lay->arena_bytes == 0 ||
	    lay->arena_bytes % BD_PAGE_ALIGN != 0)
		return -EINVAL;
	struct bd_kvmem *mem = calloc(1, sizeof(*mem));
	struct private_mem *pm = calloc(1, sizeof(*pm));
	if (!mem || !pm)
		goto nomem;
	mem->priv = pm;
	pm->used = calloc(lay->n_pages, 1);
	mem->arena = aligned_alloc(BD_PAGE_ALIGN, lay->arena_bytes);
	if (!pm->used || !mem->arena)
		goto nomem;
	memset(mem->arena, 0, lay->arena_bytes);
	mem->ops = &private_ops;
	mem->lay = *lay;
	*ret = mem;
	return 0;
nomem:
	if (pm)
		free(pm->used);
	free(pm);
	if (mem)
		free(mem->arena);
	free(mem);
	return -ENOMEM;
}

void bd_kvmem_private_free(struct bd_kvmem *mem)
{
	if (!mem)
		return;
	struct private_mem *pm = mem->priv;
	if (pm)
		free(pm->used);
	free(pm);
	free(mem->arena);
	free(mem);
}

/* ---- sequences ---------------------------------------------------------------------------- */

struct bd_seq {
	const struct bd_model *m;
	const struct bd_kvcfg *cfg;
	struct bd_kvmem *mem;
	bool own_mem;
	const struct bd_layout *lay; /* &mem->lay */
	void *slot;
	int32_t *block_table; /* [max_pages] */
	uint8_t *drawn;       /* [max_pages]: the page came from mem (freed with the sequence) */
	int n_full;           /* pages promoted */
	int max_pages;
	int32_t *given;       /* [max_pages] pages handed in by bd_seq_give_pages */
	int n_given, given_next;
	int n_tokens, max_tokens;
	bool failed;
	float *mu;            /* [L][Hkv][d] or NULL */
	float *fp8;           /* [L][Hkv][2] or NULL until known */
	struct bd_decode_params dp;
	struct bd_decode_stats stats;
	bd_kv_hook hook;
	void *hook_ctx;
	bd_model_allreduce_fn allreduce; /* NULL: one rank */
	void *allreduce_ctx;
};

int bd_seq_new(const struct bd_model *m, const struct bd_kvcfg *cfg,
	       const struct bd_seq_opts *opts, struct bd_seq **ret, char *ret_err)
{
	clear_err(ret_err);
	if (!m || !cfg || !opts || !ret)
		return fail(ret_err, -EINVAL, "missing model, configuration, options or result");
	const struct bd_model_hparams *hp = &m->hp;
	int d = hp->head_dim;
	if (opts->max_tokens < 1 || opts->max_tokens > hp->n_ctx_train)
		return fail(ret_err, -EINVAL, "capacity %d tokens is outside 1..%d (the context)",
			    opts->max_tokens, hp->n_ctx_train);
	if (d % 32 != 0 || d > BD_FWHT_MAX || (cfg->hadamard && (d & (d - 1)) != 0))
		return fail(ret_err, -ENOTSUP, "head dim %d cannot be held by the %s cache", d,
			    cfg->name);

	struct bd_seq *s = calloc(1, sizeof(*s));
	if (!s)
		return fail(ret_err, -ENOMEM, "out of memory");
	s->m = m;
	s->cfg = cfg;
	s->max_tokens = opts->max_tokens;
	s->max_pages = opts->max_tokens / BD_PAGE_TOKENS;
	s->dp = opts->dp ? *opts->dp : bd_decode_params_default();
	s->hook = opts->hook;
	s->hook_ctx = opts->hook_ctx;
	if (m->shard.tp > 1) {
		s->allreduce = opts->allreduce;
		s->allreduce_ctx = opts->allreduce_ctx;
	}
	int r, Hl = m->shard.n_kv_heads;

	if (m->shard.tp > 1 && !opts->allreduce) {
		bd_seq_free(s);
		return fail(ret_err, -EINVAL, "rank %d of %d needs an all-reduce", m->shard.rank,
			    m->shard.tp);
	}
	if (opts->mem) {
		const struct bd_layout *l = &opts->mem->lay;
		/* a shard's heads sit first in pages sized for ceil(Hkv / tp) heads */
		bool heads_ok = m->shard.tp > 1 ? l->n_kv_heads >= Hl : l->n_kv_heads == Hl;
		if (l->fmt != cfg->page_fmt || l->n_layers != hp->n_layers || !heads_ok ||
		    l->d != d || l->d_rope != 0) {
			bd_seq_free(s);
			return fail(ret_err, -EINVAL, "the KV memory's layout does not match the "
						      "model and the %s configuration", cfg->name);
		}
		s->mem = opts->mem;
	} else {
		struct bd_layout lay;
		size_t np = s->max_pages > 0 ? (size_t)s->max_pages : 1;
		if ((r = bd_layout_init(&lay, cfg->page_fmt, hp->n_layers, Hl, d, 0, np)) < 0 ||
		    (r = bd_kvmem_private_new(&lay, &s->mem)) < 0) {
			bd_seq_free(s);
			return fail(ret_err, r == -ENOMEM ? r : -ENOTSUP,
				    "cannot make a %s KV arena for this model (%d)", cfg->name, r);
		}
		s->own_mem = true;
	}
	s->lay = &s->mem->lay;
	if ((r = s->mem->ops->slot_alloc(s->mem, &s->slot)) < 0) {
		s->slot = NULL;
		bd_seq_free(s);
		return fail(ret_err, r, "no BF16 slot for the sequence (%d)", r);
	}

	size_t L = (size_t)hp->n_layers, H = (size_t)Hl, D = (size_t)d;
	size_t Hg = (size_t)hp->n_kv_heads, h0 = (size_t)m->shard.kv_head0;
	size_t HL = (size_t)s->lay->n_kv_heads;
	s->block_table = calloc((size_t)s->max_pages + 1, sizeof(*s->block_table));
	s->drawn = calloc((size_t)s->max_pages + 1, 1);
	s->given = calloc((size_t)s->max_pages + 1, sizeof(*s->given));
	bool ok = s->block_table && s->drawn && s->given;
	/* mu_k and fp8_scales come indexed by the global KV head: keep this rank's heads */
	if (ok && opts->mu_k) {
		s->mu = malloc(sizeof(float) * L * H * D);
		ok = s->mu != NULL;
		for (size_t l = 0; ok && l < L; l++)
			memcpy(s->mu + l * H * D, opts->mu_k + (l * Hg + h0) * D,
			       sizeof(float) * H * D);
	}
	if (ok && opts->fp8_scales) {
		/* [L][layout heads][2], as bd_page_promote reads them; heads past ours unused */
		s->fp8 = malloc(sizeof(float) * L * HL * 2);
		ok = s->fp8 != NULL;
		for (size_t i = 0; ok && i < L * HL * 2; i++)
			s->fp8[i] = 1.0f;
		for (size_t l = 0; ok && l < L; l++)
			memcpy(s->fp8 + l * HL * 2, opts->fp8_scales + (l * Hg + h0) * 2,
			       sizeof(float) * H * 2);
	}
	if (!ok) {
		bd_seq_free(s);
		return fail(ret_err, -ENOMEM, "out of memory");
	}
	*ret = s;
	return 0;
}

void bd_seq_free(struct bd_seq *s)
{
	if (!s)
		return;
	if (s->mem) {
		for (int i = 0; i < s->n_full; i++)
			if (s->drawn[i])
				s->mem->ops->page_free(s->mem, s->block_table[i]);
		if (s->slot)
			s->mem->ops->slot_free(s->mem, s->slot);
		if (s->own_mem)
			bd_kvmem_private_free(s->mem);
	}
	free(s->block_table);
	free(s->drawn);
	free(s->given);
	free(s->mu);
	free(s->fp8);
	free(s);
}

int bd_seq_n_tokens(const struct bd_seq *s)
{
	return s ? s->n_tokens : -EINVAL;
}

int bd_seq_capacity(const struct bd_seq *s)
{
	return s ? s->max_tokens : -EINVAL;
}

struct bd_decode_stats bd_seq_stats(const struct bd_seq *s)
{
	struct bd_decode_stats z = { 0 };
	return s ? s->stats : z;
}

void *bd_seq_slot(const struct bd_seq *s)
{
	return s ? s->slot : NULL;
}

int bd_seq_block_table(const struct bd_seq *s, const int32_t **ret_pages)
{
	if (!s || !ret_pages)
		return -EINVAL;
	*ret_pages = s->block_table;
	return s->n_full;
}

/* Sum a shard's partial products over the ranks (one rank: nothing to do). */
static int reduce(const struct bd_seq *s, float *buf, size_t n)
{
	return s->allreduce ? s->allreduce(s->allreduce_ctx, buf, n) : 0;
}

/* FP8 scales of the first page when none were given: amax / 448 of each (layer, KV head)'s
 * K' and V rows in the full recent page (1 for an all-zero head). */
static void fp8_scales_from_slot(struct bd_seq *s)
{
	const struct bd_layout *lay = s->lay;
	size_t n = (size_t)BD_RECENT_TOKENS * (size_t)lay->d;
	for (int l = 0; l < lay->n_layers; l++) {
		for (int h = 0; h < lay->n_kv_heads; h++) {
			const bd_bf16 *rows[2] = { bd_slot_recent_k(lay, s->slot, l, h),
						   bd_slot_recent_v(lay, s->slot, l, h) };
			for (int j = 0; j < 2; j++) {
				float amax = 0.0f;
				for (size_t i = 0; i < n; i++)
					amax = fmaxf(amax, fabsf(bd_bf16_to_f32(rows[j][i])));
				s->fp8[((size_t)l * (size_t)lay->n_kv_heads + (size_t)h) * 2 + j] =
					amax > 0.0f && isfinite(amax) ? amax / 448.0f : 1.0f;
			}
		}
	}
}

/* The token at position pos completed a page: quantize the recent page into a fresh page. */
static int promote(struct bd_seq *s)
{
	int32_t page;
	int r;

	if (s->n_full >= s->max_pages)
		return -ENOSPC;
	if (s->lay->fmt == BD_PAGE_FP8 && !s->fp8) {
		size_t n = (size_t)s->lay->n_layers * (size_t)s->lay->n_kv_heads * 2;
		if (!(s->fp8 = malloc(sizeof(float) * n)))
			return -ENOMEM;
		fp8_scales_from_slot(s);
	}
	bool drawn = s->given_next >= s->n_given;
	if (!drawn)
		page = s->given[s->given_next++];
	else if ((r = s->mem->ops->page_alloc(s->mem, &page)) < 0)
		return r;
	if ((r = bd_page_promote(s->lay, s->cfg, s->fp8, s->slot, s->mem->arena, page)) < 0) {
		if (drawn)
			s->mem->ops->page_free(s->mem, page);
		return r;
	}
	s->drawn[s->n_full] = drawn;
	s->block_table[s->n_full++] = page;
	return 0;
}

int bd_seq_give_pages(struct bd_seq *s, const int32_t *pages, int n)
{
	if (!s || n < 0 || (n > 0 && !pages) || n > s->max_pages - s->n_full)
		return -EINVAL;
	for (int i = 0; i < n; i++)
		if (pages[i] < 0 || (size_t)pages[i] >= s->lay->n_pages)
			return -ERANGE;
	if (n > 0)
		memcpy(s->given, pages, sizeof(*pages) * (size_t)n);
	s->n_given = n;
	s->given_next = 0;
	return 0;
}

int bd_seq_given_pages(const struct bd_seq *s)
{
	return s ? s->n_given - s->given_next : -EINVAL;
}

static const float *mu_of(const struct bd_seq *s, int l, int h)
{
	if (!s->mu)
		return NULL;
	size_t d = (size_t)s->lay->d;
	return s->mu + ((size_t)l * (size_t)s->m->shard.n_kv_heads + (size_t)h) * d;
}

/* Write one position's K and V of layer l (k, v: [Hkv][d]) into the slot. */
static int write_kv(struct bd_seq *s, int l, int pos, const float *k, const float *v)
{
	size_t d = (size_t)s->lay->d;
	for (int h = 0; h < s->m->shard.n_kv_heads; h++) {
		int r = bd_kv_write_token(s->lay, s->cfg, s->slot, l, h, pos, k + (size_t)h * d,
					  v + (size_t)h * d, mu_of(s, l, h));
		if (r < 0)
			return r;
	}
	return 0;
}

static int check_tokens(const struct bd_model *m, const int32_t *t, int n)
{
	for (int i = 0; i < n; i++)
		if (t[i] < 0 || t[i] >= m->hp.n_vocab)
			return -EINVAL;
	return 0;
}

/* Q/K/V of rows positions pos0.. for one layer: biases, Qwen3 norms, RoPE, and the hook of
 * each of the n_seqs sequences fed by this forward pass. */
static int qkv(const struct bd_model *m, const struct bd_model_layer *ly,
	       struct bd_seq *const *seqs, int n_seqs, const float *xn, int rows, int pos0,
	       float *q, float *k, float *v)
{
	const struct bd_model_hparams *hp = &m->hp;
	int Hq = m->shard.n_heads, Hkv = m->shard.n_kv_heads;
	int E = hp->n_embd, d = hp->head_dim, qd = Hq * d, kd = Hkv * d;

	matmul(xn, rows, E, ly->wq, qd, ly->bq, q);
	matmul(xn, rows, E, ly->wk, kd, ly->bk, k);
	matmul(xn, rows, E, ly->wv, kd, ly->bv, v);
	for (int r = 0; r < rows; r++) {
		float *qr = q + (size_t)r * (size_t)qd, *kr = k + (size_t)r * (size_t)kd;
		if (hp->qk_norm) {
			for (int h = 0; h < Hq; h++)
				bd_rmsnorm(qr + (size_t)h * (size_t)d, ly->q_norm, d, hp->norm_eps,
					   qr + (size_t)h * (size_t)d);
			for (int h = 0; h < Hkv; h++)
				bd_rmsnorm(kr + (size_t)h * (size_t)d, ly->k_norm, d, hp->norm_eps,
					   kr + (size_t)h * (size_t)d);
		}
		int rc = bd_rope(qr, Hq, d, hp->n_rot, pos0 + r, hp->rope_base, hp->rope_style);
		if (rc == 0)
			rc = bd_rope(kr, Hkv, d, hp->n_rot, pos0 + r, hp->rope_base,
				     hp->rope_style);
		if (rc < 0)
			return rc;
		for (int i = 0; i < n_seqs; i++)
			if (seqs[i]->hook)
				seqs[i]->hook(seqs[i]->hook_ctx, (int)(ly - m->layers), pos0 + r,
					      qr, kr, v + (size_t)r * (size_t)kd);
	}
	return 0;
}

/* x += W_down(silu(W_gate xn) · W_up xn) for rows rows; gate, up: [rows][F'] (a shard's
 * columns: the down product is partial until the all-reduce). Returns 0 or its error. */
static int mlp(const struct bd_model *m, const struct bd_seq *s, const struct bd_model_layer *ly,
	       float *x, float *xn, int rows, float *gate, float *up, float *tmp)
{
	int E = m->hp.n_embd, F = m->shard.n_ff;
	size_t n = (size_t)rows * (size_t)E;
	for (int r = 0; r < rows; r++)
		bd_rmsnorm(x + (size_t)r * (size_t)E, ly->ffn_norm, E, m->hp.norm_eps,
			   xn + (size_t)r * (size_t)E);
	matmul(xn, rows, E, ly->w_gate, F, NULL, gate);
	matmul(xn, rows, E, ly->w_up, F, NULL, up);
	for (size_t i = 0; i < (size_t)rows * (size_t)F; i++)
		gate[i] = silu(gate[i]) * up[i];
	matmul(gate, rows, F, ly->w_down, E, NULL, tmp);
	int r = reduce(s, tmp, n);
	if (r < 0)
		return r;
	for (size_t i = 0; i < n; i++)
		x[i] += tmp[i];
	return 0;
}

/* Final norm and LM head of one hidden row: ret_logits [V]. */
static void lm_head(const struct bd_model *m, const float *x, float *xn, float *ret_logits)
{
	int E = m->hp.n_embd;
	bd_rmsnorm(x, m->output_norm, E, m->hp.norm_eps, xn);
	matmul(xn, 1, E, m->output, m->hp.n_vocab, NULL, ret_logits);
}

static float bf16_round(float x)
{
	return bd_bf16_to_f32(bd_f32_to_bf16(x));
}

/* Causal attention of the prompt for one layer: q [n][Hq·d], k and v [n][Hkv·d] already
 * BF16-rounded; ret_o [n][Hq·d]. S: scratch [PREFILL_CHUNK][n]. */
static void prefill_attention(const struct bd_model *m, const float *q, const float *k,
			      const float *v, int n, float *S, float *ret_o)
{
	int Hq = m->shard.n_heads, Hkv = m->shard.n_kv_heads;
	int d = m->hp.head_dim, G = Hq / Hkv;
	int ldq = Hq * d, ldk = Hkv * d;
	float scale = 1.0f / sqrtf((float)d), inv[PREFILL_CHUNK];

	for (int h = 0; h < Hq; h++) {
		const float *kh = k + (size_t)(h / G) * (size_t)d;
		const float *vh = v + (size_t)(h / G) * (size_t)d;
		for (int i0 = 0; i0 < n; i0 += PREFILL_CHUNK) {
			int rows = n - i0 < PREFILL_CHUNK ? n - i0 : PREFILL_CHUNK;
			int cols = i0 + rows; /* keys 0..i0+rows−1 can be seen by this block */
			cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, cols, d, scale,
				    q + (size_t)i0 * (size_t)ldq + (size_t)h * (size_t)d, ldq, kh,
				    ldk, 0.0f, S, cols);
			for (int r = 0; r < rows; r++) {
				float *sr = S + (size_t)r * (size_t)cols;
				int last = i0 + r; /* causal: keys 0..last */
				float mx = -INFINITY, sum = 0.0f;
				for (int j = 0; j <= last; j++)
					mx = sr[j] > mx ? sr[j] : mx;
				for (int j = 0; j <= last; j++) {
					sr[j] = expf(sr[j] - mx);
					sum += sr[j];
				}
				for (int j = last + 1; j < cols; j++)
					sr[j] = 0.0f;
				inv[r] = 1.0f / sum;
			}
			float *oh = ret_o + (size_t)i0 * (size_t)ldq + (size_t)h * (size_t)d;
			cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, d, cols, 1.0f,
				    S, cols, vh, ldk, 0.0f, oh, ldq);
			/* normalize the d outputs of a row rather than its i probabilities */
			for (int r = 0; r < rows; r++)
				for (int c = 0; c < d; c++)
					oh[(size_t)r * (size_t)ldq + (size_t)c] *= inv[r];
		}
	}
}

/* Why seqs cannot be prefilled with tokens [n] together (0: they can). Nothing is changed.
 * The checks run in bd_model_prefill's order, so one sequence gets its codes. */
static int prefill_refusal(const struct bd_model *m, struct bd_seq *const *seqs, int n_seqs,
			   const int32_t *tokens, int n, const float *ret_logits)
{
	if (!m || !seqs || n_seqs < 1 || !tokens || n < 1)
		return -EINVAL;
	for (int i = 0; i < n_seqs; i++) {
		if (!seqs[i] || seqs[i]->m != m)
			return -EINVAL;
		for (int j = 0; j < i; j++)
			if (seqs[j] == seqs[i])
				return -EINVAL;
	}
	for (int i = 0; i < n_seqs; i++)
		if (seqs[i]->failed)
			return -EIO;
	for (int i = 0; i < n_seqs; i++)
		if (seqs[i]->n_tokens != 0)
			return -EINVAL;
	if (check_tokens(m, tokens, n) < 0 || (ret_logits && !m->output))
		return -EINVAL;
	/* one forward pass makes one all-reduce call per product for all of them */
	for (int i = 1; i < n_seqs; i++)
		if (seqs[i]->allreduce != seqs[0]->allreduce ||
		    seqs[i]->allreduce_ctx != seqs[0]->allreduce_ctx)
			return -EINVAL;
	for (int i = 0; i < n_seqs; i++)
		if (n > seqs[i]->max_tokens)
			return -ENOSPC;
	return 0;
}

/* The prompt's KV of every layer (kall, vall: [L][n][Hkv'][d]) through s's write path,
 * position by position, promoting pages as they fill. A failure fails s. */
static int prefill_write(struct bd_seq *s, const float *kall, const float *vall, int n)
{
	size_t N = (size_t)n, kd = (size_t)s->m->shard.n_kv_heads * (size_t)s->m->hp.head_dim;
	int r;

	for (int pos = 0; pos < n; pos++) {
		for (int l = 0; l < s->m->hp.n_layers; l++) {
			size_t off = (size_t)l * N * kd + (size_t)pos * kd;
			if ((r = write_kv(s, l, pos, kall + off, vall + off)) < 0) {
				s->failed = true;
				return r;
			}
		}
		if ((pos + 1) % BD_PAGE_TOKENS == 0 && (r = promote(s)) < 0) {
			s->failed = true;
			return r;
		}
	}
	s->n_tokens = n;
	return 0;
}

int bd_model_prefill(const struct bd_model *m, struct bd_seq *s, const int32_t *tokens, int n,
		     float *ret_logits)
{
	return bd_model_prefill_multi(m, &s, 1, tokens, n, ret_logits);
}

int bd_model_prefill_multi(const struct bd_model *m, struct bd_seq *const *seqs, int n_seqs,
			   const int32_t *tokens, int n, float *ret_logits)
{
	int r = prefill_refusal(m, seqs, n_seqs, tokens, n, ret_logits);
	if (r < 0)
		return r;
	struct bd_seq *s = seqs[0]; /* the all-reduce they share */

	const struct bd_model_hparams *hp = &m->hp;
	size_t N = (size_t)n, E = (size_t)hp->n_embd, F = (size_t)m->shard.n_ff;
	size_t L = (size_t)hp->n_layers;
	size_t qd = (size_t)m->shard.n_heads * (size_t)hp->head_dim;
	size_t kd = (size_t)m->shard.n_kv_heads * (size_t)hp->head_dim;
	size_t chunk = (size_t)PREFILL_CHUNK * N;

	r = -ENOMEM;
	float *x = malloc(sizeof(float) * N * E), *xn = malloc(sizeof(float) * N * E);
	float *q = malloc(sizeof(float) * N * qd), *o = malloc(sizeof(float) * N * qd);
	float *kr = malloc(sizeof(float) * N * kd), *vr = malloc(sizeof(float) * N * kd);
	float *gate = malloc(sizeof(float) * N * F), *up = malloc(sizeof(float) * N * F);
	float *S = malloc(sizeof(float) * chunk);
	float *tmp = malloc(sizeof(float) * N * (E > qd ? E : qd));
	/* every layer's post-RoPE K and V, FP32, for the write path after the forward pass */
	float *kall = malloc(sizeof(float) * L * N * kd);
	float *vall = malloc(sizeof(float) * L * N * kd);
	if (!x || !xn || !q || !o || !kr || !vr || !gate || !up || !S || !tmp || !kall || !vall)
		goto out;

	for (size_t i = 0; i < N; i++)
		memcpy(x + i * E, m->tok_embd + (size_t)tokens[i] * E, sizeof(float) * E);
	for (int l = 0; l < hp->n_layers; l++) {
		const struct bd_model_layer *ly = &m->layers[l];
		float *kl = kall + (size_t)l * N * kd, *vl = vall + (size_t)l * N * kd;
		for (size_t i = 0; i < N; i++)
			bd_rmsnorm(x + i * E, ly->attn_norm, (int)E, hp->norm_eps, xn + i * E);
		if ((r = qkv(m, ly, seqs, n_seqs, xn, n, 0, q, kl, vl)) < 0)
			goto out;
		for (size_t i = 0; i < N * kd; i++) {
			kr[i] = bf16_round(kl[i]);
			vr[i] = bf16_round(vl[i]);
		}
		prefill_attention(m, q, kr, vr, n, S, o);
		matmul(o, n, (int)qd, ly->wo, (int)E, NULL, tmp);
		/* all-reduce failures leave the caches unwritten: the sequences stay empty */
		if ((r = reduce(s, tmp, N * E)) < 0)
			goto out;
		for (size_t i = 0; i < N * E; i++)
			x[i] += tmp[i];
		if ((r = mlp(m, s, ly, x, xn, n, gate, up, tmp)) < 0)
			goto out;
	}
	for (size_t i = 0; i < N * E; i++) {
		if (!isfinite(x[i])) {
			r = -EDOM;
			goto out; /* nothing written yet: the sequences stay empty and usable */
		}
	}

	/* The prompt's KV through each sequence's own write path, one sequence after the other:
	 * separate prefills in this order draw a shared kvmem's pages in the same order. A
	 * sequence that fails does not stop the others; the first error is returned. */
	r = 0;
	for (int i = 0; i < n_seqs; i++) {
		int ri = prefill_write(seqs[i], kall, vall, n);
		if (ri < 0 && r == 0)
			r = ri;
	}
	if (r == 0 && ret_logits)
		lm_head(m, x + (N - 1) * E, xn, ret_logits);
out:
	free(x);
	free(xn);
	free(q);
	free(o);
	free(kr);
	free(vr);
	free(gate);
	free(up);
	free(S);
	free(tmp);
	free(kall);
	free(vall);
	return r;
}

/* Per-head norms (Qwen3), RoPE at pos and the hook for one row of q [Hq'][d] and k [Hkv'][d]. */
static int qk_row(const struct bd_model *m, const struct bd_model_layer *ly, struct bd_seq *s,
		  int pos, float *qr, float *kr, const float *vr)
{
	const struct bd_model_hparams *hp = &m->hp;
	int Hq = m->shard.n_heads, Hkv = m->shard.n_kv_heads, d = hp->head_dim;
	if (hp->qk_norm) {
		for (int h = 0; h < Hq; h++)
			bd_rmsnorm(qr + (size_t)h * (size_t)d, ly->q_norm, d, hp->norm_eps,
				   qr + (size_t)h * (size_t)d);
		for (int h = 0; h < Hkv; h++)
			bd_rmsnorm(kr + (size_t)h * (size_t)d, ly->k_norm, d, hp->norm_eps,
				   kr + (size_t)h * (size_t)d);
	}
	int rc = bd_rope(qr, Hq, d, hp->n_rot, pos, hp->rope_base, hp->rope_style);
	if (rc == 0)
		rc = bd_rope(kr, Hkv, d, hp->n_rot, pos, hp->rope_base, hp->rope_style);
	if (rc == 0 && s->hook)
		s->hook(s->hook_ctx, (int)(ly - m->layers), pos, qr, kr, vr);
	return rc;
}

/* Why row s cannot decode token now (0: it can). Nothing is changed. */
static int decode_refusal(const struct bd_model *m, const struct bd_seq *s, int32_t token)
{
	if (!s || s->m != m)
		return -EINVAL;
	if (s->failed)
		return -EIO;
	if (check_tokens(m, &token, 1) < 0)
		return -EINVAL;
	if (s->n_tokens >= s->max_tokens)
		return -ENOSPC;
	return 0;
}

int bd_model_decode_batch(const struct bd_model *m, struct bd_seq *const *seqs,
			  const int32_t *tokens, int n, float *ret_logits, int *ret_status)
{
	if (!m || !seqs || !tokens || !ret_status || n < 1 || (ret_logits && !m->output))
		return -EINVAL;
	for (int i = 0; i < n; i++)
		for (int j = 0; j < i; j++)
			if (seqs[i] && seqs[i] == seqs[j])
				return -EINVAL;

	const struct bd_model_hparams *hp = &m->hp;
	int Hkv = m->shard.n_kv_heads, G = m->shard.n_heads / Hkv;
	size_t E = (size_t)hp->n_embd, d = (size_t)hp->head_dim, F = (size_t)m->shard.n_ff;
	size_t qd = (size_t)m->shard.n_heads * d, kd = (size_t)Hkv * d, V = (size_t)hp->n_vocab;
	struct bd_seq *s0 = NULL;
	int nb = 0, r = -ENOMEM;

	/* refused rows change nothing; the rest must share one all-reduce */
	for (int i = 0; i < n; i++) {
		ret_status[i] = decode_refusal(m, seqs[i], tokens[i]);
		if (ret_status[i] < 0)
			continue;
		if (!s0) {
			s0 = seqs[i];
		} else if (seqs[i]->allreduce != s0->allreduce ||
			   seqs[i]->allreduce_ctx != s0->allreduce_ctx) {
			return -EINVAL;
		}
		nb++;
	}
	if (nb == 0)
		return 0;

	size_t NB = (size_t)nb;
	int *idx = malloc(sizeof(int) * NB), *err = calloc(NB, sizeof(int));
	float *x = malloc(sizeof(float) * NB * E), *xn = malloc(sizeof(float) * NB * E);
	float *q = malloc(sizeof(float) * NB * qd), *o = malloc(sizeof(float) * NB * qd);
	float *k = malloc(sizeof(float) * NB * kd), *v = malloc(sizeof(float) * NB * kd);
	float *att = malloc(sizeof(float) * NB * E);
	float *gate = malloc(sizeof(float) * NB * F), *up = malloc(sizeof(float) * NB * F);
	float *lg = ret_logits && nb > 1 ? malloc(sizeof(float) * NB * V) : NULL;
	if (!idx || !err || !x || !xn || !q || !o || !k || !v || !att || !gate || !up ||
	    (ret_logits && nb > 1 && !lg)) {
		for (int i = 0; i < n; i++)
			if (ret_status[i] == 0)
				ret_status[i] = -ENOMEM;
		goto out;
	}
	nb = 0;
	for (int i = 0; i < n; i++)
		if (ret_status[i] == 0)
			idx[nb++] = i;

	/* A row's local error does not stop the layers: it goes on with NaN partial sums so that
	 * the ranks make the same all-reduce calls (bd_model_allreduce_fn). */
	for (size_t b = 0; b < NB; b++)
		memcpy(x + b * E, m->tok_embd + (size_t)tokens[idx[b]] * E, sizeof(float) * E);
	for (int l = 0; l < hp->n_layers; l++) {
		const struct bd_model_layer *ly = &m->layers[l];
		for (size_t b = 0; b < NB; b++)
			bd_rmsnorm(x + b * E, ly->attn_norm, (int)E, hp->norm_eps, xn + b * E);
		matmul(xn, nb, (int)E, ly->wq, (int)qd, ly->bq, q);
		matmul(xn, nb, (int)E, ly->wk, (int)kd, ly->bk, k);
		matmul(xn, nb, (int)E, ly->wv, (int)kd, ly->bv, v);
		for (size_t b = 0; b < NB; b++) {
			struct bd_seq *s = seqs[idx[b]];
			int pos = s->n_tokens, rc;
			float *qb = q + b * qd, *kb = k + b * kd, *vb = v + b * kd, *ob = o + b * qd;
			if (!err[b] && (rc = qk_row(m, ly, s, pos, qb, kb, vb)) < 0)
				err[b] = rc;
			if (!err[b] && (rc = write_kv(s, l, pos, kb, vb)) < 0)
				err[b] = rc;
			for (int h = 0; h < Hkv && !err[b]; h++) {
				struct bd_kv_view kv = {
					.lay = s->lay,
					.arena = s->mem->arena,
					.block_table = s->block_table,
					.slot = s->slot,
					.layer = l,
					.kv_head = h,
					.n_tokens = pos + 1,
				};
				size_t off = (size_t)h * (size_t)G * d;
				rc = bd_ref_decode_gqa(s->cfg, &s->dp, &kv, qb + off, G, ob + off, NULL,
						       &s->stats);
				if (rc < 0)
					err[b] = rc;
			}
			if (err[b])
				for (size_t i = 0; i < qd; i++)
					ob[i] = NAN;
		}
		matmul(o, nb, (int)qd, ly->wo, (int)E, NULL, att);
		if ((r = reduce(s0, att, NB * E)) < 0)
			goto fail_all;
		for (size_t i = 0; i < NB * E; i++)
			x[i] += att[i];
		if ((r = mlp(m, s0, ly, x, xn, nb, gate, up, att)) < 0)
			goto fail_all;
	}
	/* a token that completes a page promotes it, row by row in order (the order in which a
	 * shared kvmem hands out pages) */
	for (size_t b = 0; b < NB; b++) {
		struct bd_seq *s = seqs[idx[b]];
		int pos = s->n_tokens, rc = err[b];
		if (rc == 0 && (pos + 1) % BD_PAGE_TOKENS == 0)
			rc = promote(s);
		if (rc < 0) {
			s->failed = true;
			ret_status[idx[b]] = rc;
			continue;
		}
		s->n_tokens = pos + 1;
	}
	if (ret_logits) {
		if (nb == 1) {
			if (ret_status[idx[0]] == 0)
				lm_head(m, x, xn, ret_logits + (size_t)idx[0] * V);
		} else {
			for (size_t b = 0; b < NB; b++)
				bd_rmsnorm(x + b * E, m->output_norm, (int)E, hp->norm_eps,
					   xn + b * E);
			matmul(xn, nb, (int)E, m->output, (int)V, NULL, lg);
			for (size_t b = 0; b < NB; b++)
				if (ret_status[idx[b]] == 0)
					memcpy(ret_logits + (size_t)idx[b] * V, lg + b * V,
					       sizeof(float) * V);
		}
	}
	r = 0;
	goto out;
fail_all:
	for (size_t b = 0; b < NB; b++) {
		seqs[idx[b]]->failed = true;
		ret_status[idx[b]] = r;
	}
out:
	free(idx);
	free(err);
	free(x);
	free(xn);
	free(q);
	free(o);
	free(k);
	free(v);
	free(att);
	free(gate);
	free(up);
	free(lg);
	return r < 0 ? r : 0;
}

int bd_model_decode(const struct bd_model *m, struct bd_seq *s, int32_t token, float *ret_logits)
{
	int st;
	if (!m || !s || s->m != m)
		return -EINVAL;
	int r = bd_model_decode_batch(m, &s, &token, 1, ret_logits, &st);
	return r < 0 ? r : st;
}

/* ---- generation ---------------------------------------------------------------------------- */

static bool is_stop(const struct bd_gen_params *p, int32_t t)
{
	for (int i = 0; p->stop_ids && i < p->n_stop_ids; i++)
		if (p->stop_ids[i] == t)
			return true;
	return false;
}

int bd_generate(const struct bd_model *m, const int32_t *prompt, int n_prompt,
		const struct bd_gen_params *p, int32_t *ret_tokens, int *ret_n, char *ret_err)
{
	struct bd_seq *s = NULL;
	struct bd_sampler *smp = NULL;
	float *logits = NULL;
	int r, n = 0;

	clear_err(ret_err);
	if (!m || !prompt || !p || !ret_tokens || !ret_n || !p->kv)
		return fail(ret_err, -EINVAL, "missing argument");
	if (m->shard.tp > 1)
		return fail(ret_err, -EINVAL, "rank %d of %d cannot generate alone",
			    m->shard.rank, m->shard.tp);
	const struct bd_kvcfg *cfg = bd_kvcfg_find(p->kv);
	if (!cfg)
		return fail(ret_err, -EINVAL, "unknown KV configuration '%s'", p->kv);
	if (p->max_tokens < 1)
		return fail(ret_err, -EINVAL, "max tokens must be at least 1 (got %d)",
			    p->max_tokens);
	if (n_prompt < 1)
		return fail(ret_err, -EINVAL, "empty prompt");
	if (check_tokens(m, prompt, n_prompt) < 0)
		return fail(ret_err, -EINVAL, "prompt token id out of the vocabulary (0..%d)",
			    m->hp.n_vocab - 1);
	if (n_prompt > m->hp.n_ctx_train - p->max_tokens)
		return fail(ret_err, -EINVAL,
			    "prompt (%d tokens) + max tokens (%d) exceed the context of %d",
			    n_prompt, p->max_tokens, m->hp.n_ctx_train);

	struct bd_sampler_params greedy = bd_sampler_params_greedy();
	if ((r = bd_sampler_new(p->sampling ? p->sampling : &greedy, m->hp.n_vocab, &smp)) < 0) {
		fail(ret_err, r, "bad sampling parameters");
		goto out;
	}
	struct bd_seq_opts o = { .max_tokens = n_prompt + p->max_tokens, .mu_k = p->mu_k };
	if ((r = bd_seq_new(m, cfg, &o, &s, ret_err)) < 0)
		goto out;
	if (!(logits = malloc(sizeof(float) * (size_t)m->hp.n_vocab))) {
		r = fail(ret_err, -ENOMEM, "out of memory");
		goto out;
	}
	if ((r = bd_model_prefill(m, s, prompt, n_prompt, logits)) < 0) {
		fail(ret_err, r, "prefill failed (%s)", strerror(-r));
		goto out;
	}
	for (;;) {
		int32_t t;
		if ((r = bd_sampler_sample(smp, logits, &t)) < 0) {
			fail(ret_err, r, "sampling failed: non-finite logits");
			goto out;
		}
		ret_tokens[n++] = t;
		if (is_stop(p, t))
			break;
		if (p->on_token && p->on_token(p->cb_ctx, t) != 0)
			break;
		if (n >= p->max_tokens)
			break;
		if ((r = bd_model_decode(m, s, t, logits)) < 0) {
			fail(ret_err, r, "decode step %d failed (%s)", n, strerror(-r));
			goto out;
		}
	}
	r = 0;
out:
	*ret_n = n;
	free(logits);
	bd_seq_free(s);
	bd_sampler_free(smp);
	return r;
}
