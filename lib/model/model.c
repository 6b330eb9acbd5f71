/* model.c — a decoder's weights on the CPU: allocation, GGUF loading and tensor-parallel
 * shards (bd_model.h). */
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/bd_err.h"
#include "base/bd_tpool.h"
#include "formats/bd_ggml_gemv.h"
#include "model/bd_model.h"

#define FLOAT_ALIGN 16 /* tensors start on 64-byte boundaries inside the model's allocation */

#define fail(ret_err, code, ...) bd_errf((ret_err), BD_MODEL_ERR_MAX, (code), __VA_ARGS__)
/* The GGUF calls write their messages straight into a model call's ret_err. */
_Static_assert(BD_GGUF_ERR_MAX <= BD_MODEL_ERR_MAX, "a GGUF message must fit ret_err");

/* ---- the tensors --------------------------------------------------------------------------- */

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

/* The sizes a tensor is cut along: a shard holds elements first .. first + n − 1 of the whole
 * model's all along each (the heads' rows or columns, the MLP columns; whole for the others). */
enum dim { DIM_NONE, DIM_E, DIM_Q, DIM_K, DIM_F, DIM_D, DIM_V, DIM_COUNT };

struct span {
	uint64_t all, first, n;
};

/* One tensor: its GGUF name (after "blk.N." for a layer's), where its pointer sits in struct
 * bd_model or struct bd_model_layer, its shape {cols, rows} in the file (rows DIM_NONE: a vector
 * of cols), and which hyperparameter it needs. The order is the allocation's and the loader's. */
struct tensor_def {
	const char *name;
	size_t off;
	enum dim cols, rows;
	enum { ALWAYS, IF_BIAS, IF_QK_NORM, IF_LM_HEAD, IF_UNTIED_LM_HEAD } when;
};

#define MODEL_T(nm, field, c, r, w) { nm, offsetof(struct bd_model, field), c, r, w }
#define LAYER_T(nm, field, c, r, w) { nm, offsetof(struct bd_model_layer, field), c, r, w }

static const struct tensor_def model_tensors[] = {
	/* the embedding is read as V rows even when the tensor pads the vocabulary */
	MODEL_T("token_embd.weight", tok_embd, DIM_E, DIM_V, ALWAYS),
	MODEL_T("output_norm.weight", output_norm, DIM_E, DIM_NONE, IF_LM_HEAD),
	MODEL_T("output.weight", output, DIM_E, DIM_V, IF_UNTIED_LM_HEAD),
};

static const struct tensor_def layer_tensors[] = {
	LAYER_T("attn_norm.weight", attn_norm, DIM_E, DIM_NONE, ALWAYS),
	LAYER_T("attn_q.weight", wq, DIM_E, DIM_Q, ALWAYS),
	LAYER_T("attn_k.weight", wk, DIM_E, DIM_K, ALWAYS),
	LAYER_T("attn_v.weight", wv, DIM_E, DIM_K, ALWAYS),
	LAYER_T("attn_output.weight", wo, DIM_Q, DIM_E, ALWAYS),
	LAYER_T("attn_q.bias", bq, DIM_Q, DIM_NONE, IF_BIAS),
	LAYER_T("attn_k.bias", bk, DIM_K, DIM_NONE, IF_BIAS),
	LAYER_T("attn_v.bias", bv, DIM_K, DIM_NONE, IF_BIAS),
	LAYER_T("attn_q_norm.weight", q_norm, DIM_D, DIM_NONE, IF_QK_NORM),
	LAYER_T("attn_k_norm.weight", k_norm, DIM_D, DIM_NONE, IF_QK_NORM),
	LAYER_T("ffn_norm.weight", ffn_norm, DIM_E, DIM_NONE, ALWAYS),
	LAYER_T("ffn_gate.weight", w_gate, DIM_E, DIM_F, ALWAYS),
	LAYER_T("ffn_up.weight", w_up, DIM_E, DIM_F, ALWAYS),
	LAYER_T("ffn_down.weight", w_down, DIM_F, DIM_E, ALWAYS),
};

/* What one tensor of a shard is: its place, its whole shape and the block the shard holds. */
struct tensor {
	const char *name; /* the full GGUF name */
	int layer;        /* −1: a model tensor */
	size_t off;       /* of its pointer in struct bd_model (layer −1) or bd_model_layer */
	uint64_t cols, rows;   /* the whole model's shape; rows 0: a vector */
	bool rows_at_least;    /* the file's tensor may have more rows (a padded vocabulary) */
	uint64_t r0, nr, c0, nc; /* the shard's block: rows r0.., columns c0.. */
	bool mat;                /* a matrix (struct bd_wmat at off), else a vector (float *) */
};

static void spans_of(const struct bd_model_hparams *hp, const struct bd_model_shard *sh,
		     struct span ret[DIM_COUNT])
{
	uint64_t d = (uint64_t)hp->head_dim;
	ret[DIM_NONE] = (struct span){ 1, 0, 1 };
	ret[DIM_E] = (struct span){ (uint64_t)hp->n_embd, 0, (uint64_t)hp->n_embd };
	ret[DIM_Q] = (struct span){ (uint64_t)hp->n_heads * d, (uint64_t)sh->head0 * d,
				    (uint64_t)sh->n_heads * d };
	ret[DIM_K] = (struct span){ (uint64_t)hp->n_kv_heads * d, (uint64_t)sh->kv_head0 * d,
				    (uint64_t)sh->n_kv_heads * d };
	ret[DIM_F] = (struct span){ (uint64_t)hp->n_ff, (uint64_t)sh->ff0, (uint64_t)sh->n_ff };
	ret[DIM_D] = (struct span){ d, 0, d };
	ret[DIM_V] = (struct span){ (uint64_t)hp->n_vocab, 0, (uint64_t)hp->n_vocab };
}

static bool tensor_held(const struct bd_model_hparams *hp, const struct bd_model_shard *sh,
			const struct tensor_def *t)
{
	switch (t->when) {
	case IF_BIAS: return hp->attn_bias;
	case IF_QK_NORM: return hp->qk_norm;
	case IF_LM_HEAD: return sh->lm_head;
	case IF_UNTIED_LM_HEAD: return sh->lm_head && !hp->tied_embeddings;
	default: return true;
	}
}

/* The pointer of vector t in m. */
static float **tensor_ptr(struct bd_model *m, const struct tensor *t)
{
	char *base = t->layer < 0 ? (char *)m : (char *)&m->layers[t->layer];
	return (float **)(void *)(base + t->off);
}

/* The matrix t of m. */
static struct bd_wmat *tensor_mat(struct bd_model *m, const struct tensor *t)
{
	char *base = t->layer < 0 ? (char *)m : (char *)&m->layers[t->layer];
	return (struct bd_wmat *)(void *)(base + t->off);
}

/* The FP32 rows of t's shard block as a float array: a vector's pointer or a matrix's f32. */
static float *tensor_f32(struct bd_model *m, const struct tensor *t)
{
	return t->mat ? tensor_mat(m, t)->f32 : *tensor_ptr(m, t);
}

typedef int (*tensor_fn)(void *ctx, struct bd_model *m, const struct tensor *t);

/* Call fn on every tensor the shard m holds, in the tables' order, layer by layer; stops at
 * the first error and returns it. */
static int for_each_tensor(struct bd_model *m, tensor_fn fn, void *ctx)
{
	struct span sp[DIM_COUNT];
	char name[96];
	spans_of(&m->hp, &m->shard, sp);
	for (int l = -1; l < m->hp.n_layers; l++) {
		const struct tensor_def *defs = l < 0 ? model_tensors : layer_tensors;
		size_t n = l < 0 ? sizeof(model_tensors) / sizeof(model_tensors[0])
				 : sizeof(layer_tensors) / sizeof(layer_tensors[0]);
		for (size_t i = 0; i < n; i++) {
			const struct tensor_def *d = &defs[i];
			if (!tensor_held(&m->hp, &m->shard, d))
				continue;
			const struct span *c = &sp[d->cols], *r = &sp[d->rows];
			if (l < 0)
				snprintf(name, sizeof(name), "%s", d->name);
			else
				snprintf(name, sizeof(name), "blk.%d.%s", l, d->name);
			struct tensor t = {
				.name = name, .layer = l, .off = d->off,
				.cols = c->all, .rows = d->rows == DIM_NONE ? 0 : r->all,
				.rows_at_least = d->rows == DIM_V,
				.r0 = r->first, .nr = r->n, .c0 = c->first, .nc = c->n,
				.mat = d->rows != DIM_NONE,
			};
			int rc = fn(ctx, m, &t);
			if (rc < 0)
				return rc;
		}
	}
	return 0;
}

/* ---- allocation ---------------------------------------------------------------------------- */

/* Hands out each tensor's floats from base (NULL: only counts them in *cursor). */
struct carver {
	float *base;
	size_t cursor;
};

static int carve(void *ctx, struct bd_model *m, const struct tensor *t)
{
	struct carver *cv = ctx;
	size_t n = (size_t)(t->nr * t->nc);
	float *p = cv->base ? cv->base + cv->cursor : NULL;
	if (t->mat) {
		struct bd_wmat *w = tensor_mat(m, t);
		if (w->blocks)
			return 0; /* placed in the file's blocks */
		*w = (struct bd_wmat){ .f32 = p, .type = BD_GGML_F32, .rows = (int)t->nr,
				       .cols = (int)t->nc };
	} else {
		*tensor_ptr(m, t) = p;
	}
	cv->cursor += (n + FLOAT_ALIGN - 1) / FLOAT_ALIGN * FLOAT_ALIGN;
	return 0;
}

/* Point matrix t of m at its shard block inside rows of blocks (row r of the whole tensor at
 * src + r·row_bytes) when the block's columns start and end on block boundaries; else leave
 * it for FP32. Returns whether it did. */
static bool place_blocks(struct bd_model *m, const struct tensor *t, int type, const void *src,
			 size_t row_bytes)
{
	size_t blck, ts;
	if (!t->mat || !bd_ggml_gemv_supported(type) || bd_ggml_type_info(type, &blck, &ts) < 0 ||
	    t->c0 % blck != 0 || t->nc % blck != 0)
		return false;
	*tensor_mat(m, t) = (struct bd_wmat){
		.blocks = (const char *)src + t->r0 * row_bytes + t->c0 / blck * ts,
		.row_bytes = row_bytes,
		.type = (enum bd_ggml_type)type,
		.rows = (int)t->nr,
		.cols = (int)t->nc,
	};
	m->block_bytes += (size_t)t->nr * (size_t)(t->nc / blck * ts);
	return true;
}

/* Allocate shard sh of a model of shape hp: place (NULL: none) first points the matrices it
 * can at file blocks (place_blocks), then every other tensor gets FP32 storage. */
static int alloc_shard(const struct bd_model_hparams *hp, const struct bd_model_shard *sh,
		       tensor_fn place, void *place_ctx, struct bd_model **ret)
{
	struct bd_model *m = calloc(1, sizeof(*m));
	if (!m)
		return -ENOMEM;
	m->hp = *hp;
	m->shard = *sh;
	m->layers = calloc((size_t)hp->n_layers, sizeof(*m->layers));
	if (m->layers && place)
		for_each_tensor(m, place, place_ctx);
	struct carver count = { NULL, 0 };
	if (m->layers)
		for_each_tensor(m, carve, &count);
	if (!m->layers || count.cursor > SIZE_MAX / sizeof(float)) {
		bd_model_free(m);
		return -ENOMEM;
	}
	m->mem_bytes = count.cursor * sizeof(float);
	m->mem = aligned_alloc(64, m->mem_bytes);
	if (!m->mem) {
		bd_model_free(m);
		return -ENOMEM;
	}
	memset(m->mem, 0, m->mem_bytes);
	struct carver cv = { m->mem, 0 };
	for_each_tensor(m, carve, &cv);
	if (sh->lm_head && hp->tied_embeddings)
		m->output = m->tok_embd;
	*ret = m;
	return 0;
}

int bd_model_alloc(const struct bd_model_hparams *hp, struct bd_model **ret)
{
	struct bd_model_shard sh;
	if (!hp || !ret || bd_model_shard_plan(hp, 0, 1, &sh) < 0)
		return -EINVAL;
	return alloc_shard(hp, &sh, NULL, NULL, ret);
}

int bd_model_set_threads(struct bd_model *m, int n_threads)
{
	struct bd_tpool *p = NULL;
	if (!m || n_threads < 1 || n_threads > BD_TPOOL_MAX_THREADS)
		return -EINVAL;
	if (n_threads > 1) {
		int r = bd_tpool_new(n_threads, &p);
		if (r < 0)
			return r;
	}
	bd_tpool_free(m->pool);
	m->pool = p;
	return 0;
}

void bd_model_free(struct bd_model *m)
{
	if (!m)
		return;
	bd_tpool_free(m->pool);
	bd_gguf_free(m->gguf);
	free(m->mem);
	free(m->layers);
	free(m);
}

/* ---- GGUF loading -------------------------------------------------------------------------- */

/* Whether GGUF tensor t has shape {cols, rows} (rows = 0: a vector of cols; rows_at_least:
 * it may have more rows). */
static bool shape_ok(const struct bd_gguf_tensor *t, uint64_t cols, uint64_t rows,
		     bool rows_at_least)
{
	uint64_t want1 = rows ? rows : 1;
	return t->ne[0] == cols && t->ne[2] == 1 && t->ne[3] == 1 &&
	       (rows_at_least ? t->ne[1] >= want1 : t->ne[1] == want1);
}

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
	if (!shape_ok(t, cols, rows, rows_at_least))
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

struct gguf_load {
	const struct bd_gguf *g;
	char *err;
};

/* Points a matrix whose file tensor has the right shape and a type bd_ggml_gemv() multiplies
 * at its blocks (a wrong shape is load_tensor's to report). */
static int place_gguf(void *ctx, struct bd_model *m, const struct tensor *t)
{
	const struct gguf_load *ld = ctx;
	const struct bd_gguf_tensor *gt = t->mat ? bd_gguf_find_tensor(ld->g, t->name) : NULL;
	size_t blck, ts;
	if (gt && shape_ok(gt, t->cols, t->rows, t->rows_at_least) &&
	    bd_ggml_type_info(gt->type, &blck, &ts) == 0)
		place_blocks(m, t, gt->type, gt->data, gt->ne[0] / blck * ts);
	return 0;
}

static int load_tensor(void *ctx, struct bd_model *m, const struct tensor *t)
{
	const struct gguf_load *ld = ctx;
	if (t->mat && tensor_mat(m, t)->blocks)
		return 0;
	return load_slice(ld->g, t->name, t->cols, t->rows, t->rows_at_least, t->r0, t->nr, t->c0,
			  t->nc, tensor_f32(m, t), ld->err);
}

int bd_model_from_gguf_shard(const struct bd_gguf *g, int rank, int tp, struct bd_model **ret,
			     char *ret_err)
{
	struct bd_model_hparams hp;
	struct bd_model_shard sh;
	struct bd_model *m = NULL;
	int r;

	if (ret_err)
		ret_err[0] = '\0';
	if (!g || !ret)
		return fail(ret_err, -EINVAL, "no model or no result pointer");
	if ((r = bd_gguf_model_hparams(g, &hp, ret_err)) < 0)
		return r;
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
	struct gguf_load ld = { g, ret_err };
	if ((r = alloc_shard(&hp, &sh, place_gguf, &ld, &m)) < 0)
		return fail(ret_err, r, "out of memory for the weights");
	if (m->block_bytes)
		m->gguf = bd_gguf_ref(g);
	if ((r = for_each_tensor(m, load_tensor, &ld)) < 0) {
		bd_model_free(m);
		return r;
	}
	*ret = m;
	return 0;
}

int bd_model_from_gguf(const struct bd_gguf *g, struct bd_model **ret, char *ret_err)
{
	return bd_model_from_gguf_shard(g, 0, 1, ret, ret_err);
}

int bd_model_load_shard(const char *path, int rank, int tp, struct bd_model **ret,
			char *ret_err)
{
	struct bd_gguf *g = NULL;
	int r;

	if (!path || !ret)
		return fail(ret_err, -EINVAL, "no path or no result pointer");
	/* its message names the file; on success bd_model_from_gguf_shard clears ret_err */
	if ((r = bd_gguf_open(path, &g, ret_err)) < 0)
		return r;
	r = bd_model_from_gguf_shard(g, rank, tp, ret, ret_err);
	bd_gguf_free(g);
	return r;
}

int bd_model_load(const char *path, struct bd_model **ret, char *ret_err)
{
	return bd_model_load_shard(path, 0, 1, ret, ret_err);
}

/* ---- shards of a model in memory ----------------------------------------------------------- */

/* Points a matrix the whole model holds as blocks at the shard's part of them, when its
 * columns are cut on block boundaries. */
static int place_from(void *ctx, struct bd_model *m, const struct tensor *t)
{
	const struct bd_wmat *src = t->mat ? tensor_mat(ctx, t) : NULL;
	if (src && src->blocks)
		place_blocks(m, t, src->type, src->blocks, src->row_bytes);
	return 0;
}

/* Copies the shard's block of each FP32 tensor out of the whole model (a matrix of blocks cut
 * inside a block: dequantized row by row). Returns 0, -ENOMEM. */
static int copy_tensor(void *ctx, struct bd_model *m, const struct tensor *t)
{
	struct bd_model *full = ctx;
	const struct bd_wmat *sw = t->mat ? tensor_mat(full, t) : NULL;
	if (t->mat && tensor_mat(m, t)->blocks)
		return 0;
	float *dst = tensor_f32(m, t);
	if (sw && !sw->f32) {
		float *row = malloc(sizeof(float) * (size_t)t->cols);
		int r = row ? 0 : -ENOMEM;
		for (uint64_t i = 0; i < t->nr && r == 0; i++) {
			r = bd_wmat_rows_f32(sw, (int)(t->r0 + i), 1, row);
			if (r == 0)
				memcpy(dst + i * t->nc, row + t->c0, sizeof(float) * (size_t)t->nc);
		}
		free(row);
		return r;
	}
	const float *src = sw ? sw->f32 : *tensor_ptr(full, t);
	for (uint64_t i = 0; i < t->nr; i++)
		memcpy(dst + i * t->nc, src + (t->r0 + i) * t->cols + t->c0,
		       sizeof(float) * (size_t)t->nc);
	return 0;
}

int bd_model_shard_of(const struct bd_model *full, int rank, int tp, struct bd_model **ret)
{
	struct bd_model_shard sh;
	struct bd_model *m;
	int r;

	if (!full || !ret || full->shard.tp != 1 ||
	    bd_model_shard_plan(&full->hp, rank, tp, &sh) < 0)
		return -EINVAL;
	if ((r = alloc_shard(&full->hp, &sh, place_from, (void *)full, &m)) < 0)
		return r;
	if (m->block_bytes)
		m->gguf = bd_gguf_ref(full->gguf);
	if ((r = for_each_tensor(m, copy_tensor, (void *)full)) < 0) {
		bd_model_free(m);
		return r;
	}
	*ret = m;
	return 0;
}
