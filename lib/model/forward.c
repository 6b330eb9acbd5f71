/* forward.c — the decoder's forward pass on the CPU: prefill, decode, batched decode and
 * generation over a sequence's bdfp4 cache (bd_forward.h). */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>

#include "base/bd_err.h"
#include "model/bd_forward.h"
#include "model/bd_sampler.h"
#include "model/bd_seq_impl.h"
#include "quant/bd_attn_cpu.h"

#define PREFILL_CHUNK 64 /* query rows per attention block in prefill */

#define fail(ret_err, code, ...) bd_errf((ret_err), BD_MODEL_ERR_MAX, (code), __VA_ARGS__)

/* ---- building blocks ----------------------------------------------------------------------- */

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

/* y[i] [rows][W[i].rows] = x[rows][W[i].cols] · W[i]ᵀ (+ bias[i], NULL: none) for i < k, by
 * bd_wmat_mul_many on m's pool (per_row: each row's sums in the order of the one-row product
 * whatever rows is, the batch-invariant decode); wscr: bd_wmat_scratch_floats of the widest
 * matrix, or NULL when rows ≤ BD_WMAT_GEMV_ROWS. A product that fails (it cannot for a loaded
 * model's matrices) gives NaN rows, which the finite checks refuse, so a rank still makes its
 * all-reduce calls (bd_model_allreduce_fn). */
static void matmul_many(const struct bd_model *m, int k, const float *x, int rows,
			const struct bd_wmat *const *W, const float *const *bias, bool per_row,
			float *wscr, float *const *y)
{
	bool failed = bd_wmat_mul_many(k, W, x, rows, per_row, wscr, m->pool, y) < 0;
	for (int i = 0; i < k; i++) {
		size_t out = (size_t)W[i]->rows;
		if (failed) {
			for (size_t e = 0; e < (size_t)rows * out; e++)
				y[i][e] = NAN;
			continue;
		}
		if (bias[i])
			for (size_t r = 0; r < (size_t)rows; r++)
				for (size_t o = 0; o < out; o++)
					y[i][r * out + o] += bias[i][o];
	}
}

/* matmul_many of one matrix. */
static void matmul_rows(const struct bd_model *m, const float *x, int rows,
			const struct bd_wmat *W, const float *bias, bool per_row, float *wscr,
			float *y)
{
	matmul_many(m, 1, x, rows, &W, &bias, per_row, wscr, &y);
}

/* The scratch matmul_rows needs for rows rows of m's products (NULL: none needed, or out of
 * memory, which *ret_oom says). */
static float *wscratch_new(const struct bd_model *m, int rows, bool per_row, bool *ret_oom)
{
	*ret_oom = false;
	if (rows <= BD_WMAT_GEMV_ROWS || per_row)
		return NULL;
	int cols = m->hp.n_embd;
	int qd = m->shard.n_heads * m->hp.head_dim;
	cols = m->shard.n_ff > cols ? m->shard.n_ff : cols;
	cols = qd > cols ? qd : cols;
	float *w = malloc(sizeof(float) * bd_wmat_scratch_floats(cols));
	*ret_oom = !w;
	return w;
}

static float silu(float x)
{
	return x / (1.0f + expf(-x));
}

/* Sum a shard's partial products over the ranks (one rank: nothing to do). */
static int reduce(const struct bd_seq *s, float *buf, size_t n)
{
	return s->allreduce ? s->allreduce(s->allreduce_ctx, buf, n) : 0;
}

static int check_tokens(const struct bd_model *m, const int32_t *t, int n)
{
	for (int i = 0; i < n; i++)
		if (t[i] < 0 || t[i] >= m->hp.n_vocab)
			return -EINVAL;
	return 0;
}

/* Per-head norms (Qwen3), RoPE at pos and the hooks of seqs[0..n_seqs) for one row of
 * q [Hq'][d], k [Hkv'][d] and v [Hkv'][d]. Returns 0 or bd_rope's error (no hook is called). */
static int qk_row(const struct bd_model *m, const struct bd_model_layer *ly,
		  struct bd_seq *const *seqs, int n_seqs, int pos, float *qr, float *kr,
		  const float *vr)
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
	if (rc < 0)
		return rc;
	for (int i = 0; i < n_seqs; i++)
		if (seqs[i]->hook)
			seqs[i]->hook(seqs[i]->hook_ctx, (int)(ly - m->layers), pos, qr, kr, vr);
	return 0;
}

/* The Q, K and V products (biases added) of rows rows of xn [rows][E] for one layer:
 * q [rows][Hq'·d], k and v [rows][Hkv'·d]. */
static void qkv(const struct bd_model *m, const struct bd_model_layer *ly, const float *xn,
		int rows, bool per_row, float *wscr, float *q, float *k, float *v)
{
	const struct bd_wmat *W[3] = { &ly->wq, &ly->wk, &ly->wv };
	const float *b[3] = { ly->bq, ly->bk, ly->bv };
	float *y[3] = { q, k, v };
	matmul_many(m, 3, xn, rows, W, b, per_row, wscr, y);
}

/* x += the sum over the ranks of a shard's partial product part [n] (all-reduced in place).
 * Returns 0 or the all-reduce's error (x unchanged). */
static int add_reduced(const struct bd_seq *s, float *x, float *part, size_t n)
{
	int r = reduce(s, part, n);
	if (r < 0)
		return r;
	for (size_t i = 0; i < n; i++)
		x[i] += part[i];
	return 0;
}

/* x += W_down(silu(W_gate xn) · W_up xn) for rows rows; gate, up: [rows][F'] (a shard's
 * columns: the down product is partial until the all-reduce). Returns 0 or its error. */
static int mlp(const struct bd_model *m, const struct bd_seq *s, const struct bd_model_layer *ly,
	       float *x, float *xn, int rows, bool per_row, float *wscr, float *gate, float *up,
	       float *tmp)
{
	int E = m->hp.n_embd, F = m->shard.n_ff;
	size_t n = (size_t)rows * (size_t)E;
	for (int r = 0; r < rows; r++)
		bd_rmsnorm(x + (size_t)r * (size_t)E, ly->ffn_norm, E, m->hp.norm_eps,
			   xn + (size_t)r * (size_t)E);
	const struct bd_wmat *W[2] = { &ly->w_gate, &ly->w_up };
	const float *b[2] = { NULL, NULL };
	float *y[2] = { gate, up };
	matmul_many(m, 2, xn, rows, W, b, per_row, wscr, y);
	for (size_t i = 0; i < (size_t)rows * (size_t)F; i++)
		gate[i] = silu(gate[i]) * up[i];
	matmul_rows(m, gate, rows, &ly->w_down, NULL, per_row, wscr, tmp);
	return add_reduced(s, x, tmp, n);
}

/* The rest of a layer after attention: x += W_o o (all-reduced), then the MLP; o [rows][Hq'·d],
 * gate, up [rows][F'] and tmp [rows][E] scratch, wscr matmul_rows'. Returns 0 or the
 * all-reduce's error. */
static int attn_out_mlp(const struct bd_model *m, const struct bd_seq *s,
			const struct bd_model_layer *ly, const float *o, int rows, bool per_row,
			float *wscr, float *x, float *xn, float *gate, float *up, float *tmp)
{
	size_t n = (size_t)rows * (size_t)m->hp.n_embd;
	matmul_rows(m, o, rows, &ly->wo, NULL, per_row, wscr, tmp);
	int r = add_reduced(s, x, tmp, n);
	return r < 0 ? r : mlp(m, s, ly, x, xn, rows, per_row, wscr, gate, up, tmp);
}

/* Final norm and LM head of rows hidden rows x [rows][E] (xn: scratch of the same size):
 * ret_logits [rows][V]. */
static void lm_head(const struct bd_model *m, const float *x, int rows, bool per_row,
		    float *wscr, float *xn, float *ret_logits)
{
	int E = m->hp.n_embd;
	for (int r = 0; r < rows; r++)
		bd_rmsnorm(x + (size_t)r * (size_t)E, m->output_norm, E, m->hp.norm_eps,
			   xn + (size_t)r * (size_t)E);
	matmul_rows(m, xn, rows, &m->output, NULL, per_row, wscr, ret_logits);
}

/* x [n][E] = the embeddings of tokens [n] (checked ids). Returns 0 or -EINVAL (a matrix not
 * held, which a loaded model cannot have). */
static int embed(const struct bd_model *m, const int32_t *tokens, int n, float *x)
{
	size_t E = (size_t)m->hp.n_embd;
	for (int i = 0; i < n; i++) {
		int r = bd_wmat_rows_f32(&m->tok_embd, tokens[i], 1, x + (size_t)i * E);
		if (r < 0)
			return r;
	}
	return 0;
}

static float bf16_round(float x)
{
	return bd_bf16_to_f32(bd_f32_to_bf16(x));
}

/* Causal attention of n query rows at positions p .. p+n−1 for one layer: q [n][Hq·d], k and
 * v [p+n][Hkv·d] (every key a query row may see: row i sees keys 0 .. p+i), already rounded as
 * the cache holds them; ret_o [n][Hq·d]. S: scratch [PREFILL_CHUNK][p+n]. */
static void prefill_attention(const struct bd_model *m, const float *q, const float *k,
			      const float *v, int n, int p, float *S, float *ret_o)
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
			int cols = p + i0 + rows; /* keys this block can see */
			cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, cols, d, scale,
				    q + (size_t)i0 * (size_t)ldq + (size_t)h * (size_t)d, ldq, kh,
				    ldk, 0.0f, S, cols);
			for (int r = 0; r < rows; r++) {
				float *sr = S + (size_t)r * (size_t)cols;
				int last = p + i0 + r; /* causal: keys 0..last */
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
	if (check_tokens(m, tokens, n) < 0 || (ret_logits && !m->output.rows))
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

int bd_model_prefill(const struct bd_model *m, struct bd_seq *s, const int32_t *tokens, int n,
		     float *ret_logits)
{
	return bd_model_prefill_multi(m, &s, 1, tokens, n, ret_logits);
}

/* The rotation decode gives the query when the configuration rotates keys (q' = Hq): scores
 * against K' = H(k − μ) are then q·(k − μ), which softmax does not tell from q·k (the q·μ term
 * is the same for every key of a query). q [n][Hq'·d], in place. */
static void rotate_queries(const struct bd_model *m, const struct bd_kvcfg *cfg, float *q, int n)
{
	size_t d = (size_t)m->hp.head_dim, H = (size_t)m->shard.n_heads;

	if (!cfg->hadamard)
		return;
	for (size_t i = 0; i < (size_t)n * H; i++)
		bd_fwht(q + i * d, (int)d); /* a non-finite row stays: its scores are NaN anyway */
}

/* The forward pass of tokens [n] at positions p .. p+n−1, then their KV through each
 * sequence's write path. p = 0: seqs are empty and attention is over the tokens' own K and V
 * (BF16-rounded); p > 0 (one sequence, holding its p = 128·n_full tokens): attention is over
 * the context as s's cache holds it (bd_seq_cache_context) and the tokens' K' and V as the
 * cache will hold them, with the query rotated as the decoder rotates it. Validation is the
 * caller's. */
static int prefill_run(const struct bd_model *m, struct bd_seq *const *seqs, int n_seqs,
		       const int32_t *tokens, int n, int p, float *ret_logits)
{
	struct bd_seq *s = seqs[0]; /* the all-reduce they share */
	const struct bd_model_hparams *hp = &m->hp;
	size_t N = (size_t)n, E = (size_t)hp->n_embd, F = (size_t)m->shard.n_ff;
	size_t L = (size_t)hp->n_layers, NK = (size_t)p + N, D = (size_t)hp->head_dim;
	size_t qd = (size_t)m->shard.n_heads * D, kd = (size_t)m->shard.n_kv_heads * D;
	size_t chunk = (size_t)PREFILL_CHUNK * NK;
	int r = -ENOMEM;

	float *x = malloc(sizeof(float) * N * E), *xn = malloc(sizeof(float) * N * E);
	float *q = malloc(sizeof(float) * N * qd), *o = malloc(sizeof(float) * N * qd);
	/* the keys and values attention reads: [p + n][kd] */
	float *kr = malloc(sizeof(float) * NK * kd), *vr = malloc(sizeof(float) * NK * kd);
	float *gate = malloc(sizeof(float) * N * F), *up = malloc(sizeof(float) * N * F);
	float *S = malloc(sizeof(float) * chunk);
	float *tmp = malloc(sizeof(float) * N * (E > qd ? E : qd));
	/* every layer's post-RoPE K and V, FP32, for the write path after the forward pass */
	float *kall = malloc(sizeof(float) * L * N * kd);
	float *vall = malloc(sizeof(float) * L * N * kd);
	/* p > 0: a page-head read back, and one slot head to make K' rows in */
	float *tk = p ? malloc(sizeof(float) * BD_PAGE_TOKENS * D) : NULL;
	float *tv = p ? malloc(sizeof(float) * BD_PAGE_TOKENS * D) : NULL;
	void *scratch = p ? calloc(1, s->lay->slot_head_bytes) : NULL;
	bool oom;
	float *wscr = wscratch_new(m, n, false, &oom);
	if (!x || !xn || !q || !o || !kr || !vr || !gate || !up || !S || !tmp || !kall || !vall ||
	    (p && (!tk || !tv || !scratch)) || oom)
		goto out;

	if ((r = embed(m, tokens, n, x)) < 0)
		goto out;
	for (int l = 0; l < hp->n_layers; l++) {
		const struct bd_model_layer *ly = &m->layers[l];
		float *kl = kall + (size_t)l * N * kd, *vl = vall + (size_t)l * N * kd;
		for (size_t i = 0; i < N; i++)
			bd_rmsnorm(x + i * E, ly->attn_norm, (int)E, hp->norm_eps, xn + i * E);
		qkv(m, ly, xn, n, false, wscr, q, kl, vl);
		for (size_t i = 0; i < N; i++)
			if ((r = qk_row(m, ly, seqs, n_seqs, p + (int)i, q + i * qd, kl + i * kd,
					vl + i * kd)) < 0)
				goto out;
		if (p == 0) {
			for (size_t i = 0; i < N * kd; i++) {
				kr[i] = bf16_round(kl[i]);
				vr[i] = bf16_round(vl[i]);
			}
		} else {
			/* a refused K' row is NaN: the pass goes on (the ranks make the same
			 * all-reduce calls) and the finite check below refuses it */
			if ((r = bd_seq_cache_context(s, l, tk, tv, kr, vr)) < 0)
				goto out;
			bd_seq_cache_rows(s, l, kl, vl, n, scratch, kr + (size_t)p * kd,
					  vr + (size_t)p * kd);
			rotate_queries(m, s->cfg, q, n);
		}
		prefill_attention(m, q, kr, vr, n, p, S, o);
		/* all-reduce failures leave the caches unwritten: the sequences stay as they were */
		if ((r = attn_out_mlp(m, s, ly, o, n, false, wscr, x, xn, gate, up, tmp)) < 0)
			goto out;
	}
	for (size_t i = 0; i < N * E; i++) {
		if (!isfinite(x[i])) {
			r = -EDOM;
			goto out; /* nothing written yet: the sequences stay as they were */
		}
	}

	/* The tokens' KV through each sequence's own write path, one sequence after the other:
	 * separate prefills in this order draw a shared kvmem's pages in the same order. A
	 * sequence that fails does not stop the others; the first error is returned. */
	r = 0;
	for (int i = 0; i < n_seqs; i++) {
		int ri = bd_seq_write_span(seqs[i], kall, vall, p, n);
		if (ri < 0 && r == 0)
			r = ri;
	}
	if (r == 0 && ret_logits)
		lm_head(m, x + (N - 1) * E, 1, false, NULL, xn, ret_logits);
out:
	free(wscr);
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
	free(tk);
	free(tv);
	free(scratch);
	return r;
}

int bd_model_prefill_multi(const struct bd_model *m, struct bd_seq *const *seqs, int n_seqs,
			   const int32_t *tokens, int n, float *ret_logits)
{
	int r = prefill_refusal(m, seqs, n_seqs, tokens, n, ret_logits);

	return r < 0 ? r : prefill_run(m, seqs, n_seqs, tokens, n, 0, ret_logits);
}

int bd_model_prefill_chunk(const struct bd_model *m, struct bd_seq *s, const int32_t *tokens,
			   int n, float *ret_logits)
{
	int p;

	if (!m || !s || s->m != m || !tokens || n < 1)
		return -EINVAL;
	if (s->failed)
		return -EIO;
	p = s->n_tokens;
	if (p == 0)
		return bd_model_prefill(m, s, tokens, n, ret_logits);
	if (p % BD_PAGE_TOKENS || s->n_full != p / BD_PAGE_TOKENS ||
	    check_tokens(m, tokens, n) < 0 || (ret_logits && !m->output.rows))
		return -EINVAL;
	if (n > s->max_tokens - p)
		return -ENOSPC;
	return prefill_run(m, &s, 1, tokens, n, p, ret_logits);
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
	return bd_model_decode_batch_mode(m, seqs, tokens, n, ret_logits, ret_status,
					  BD_BATCH_FAST);
}

int bd_model_decode_batch_mode(const struct bd_model *m, struct bd_seq *const *seqs,
			       const int32_t *tokens, int n, float *ret_logits, int *ret_status,
			       enum bd_batch_mode mode)
{
	bool per_row = mode == BD_BATCH_INVARIANT;
	if ((mode != BD_BATCH_FAST && mode != BD_BATCH_INVARIANT) || !m || !seqs || !tokens || !ret_status || n < 1 || (ret_logits && !m->output.rows))
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
	bool oom;
	float *wscr = wscratch_new(m, nb, per_row, &oom);
	if (!idx || !err || !x || !xn || !q || !o || !k || !v || !att || !gate || !up ||
	    (ret_logits && nb > 1 && !lg) || oom) {
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
		if (embed(m, &tokens[idx[b]], 1, x + b * E) < 0)
			for (size_t i = 0; i < E; i++)
				x[b * E + i] = NAN;
	for (int l = 0; l < hp->n_layers; l++) {
		const struct bd_model_layer *ly = &m->layers[l];
		for (size_t b = 0; b < NB; b++)
			bd_rmsnorm(x + b * E, ly->attn_norm, (int)E, hp->norm_eps, xn + b * E);
		qkv(m, ly, xn, nb, per_row, wscr, q, k, v);
		for (size_t b = 0; b < NB; b++) {
			struct bd_seq *s = seqs[idx[b]];
			int pos = s->n_tokens, rc;
			float *qb = q + b * qd, *kb = k + b * kd, *vb = v + b * kd, *ob = o + b * qd;
			if (!err[b] && (rc = qk_row(m, ly, &s, 1, pos, qb, kb, vb)) < 0)
				err[b] = rc;
			if (!err[b] && (rc = bd_seq_write_kv(s, l, pos, kb, vb)) < 0)
				err[b] = rc;
			if (!err[b]) {
				/* all Hkv groups of the row in one call: q, o [Hkv][G][d] */
				struct bd_kv_view kv = {
					.lay = s->lay,
					.arena = s->mem->arena,
					.block_table = s->block_table,
					.slot = s->slot,
					.layer = l,
					.kv_head = 0,
					.n_tokens = pos + 1,
				};
				rc = bd_attn_cpu_decode_gqa(s->cfg, &s->dp, &kv, Hkv, qb, G, ob,
							    NULL, &s->stats, m->pool);
				if (rc < 0)
					err[b] = rc;
			}
			if (err[b])
				for (size_t i = 0; i < qd; i++)
					ob[i] = NAN;
		}
		if ((r = attn_out_mlp(m, s0, ly, o, nb, per_row, wscr, x, xn, gate, up, att)) < 0)
			goto fail_all;
	}
	/* a token that completes a page promotes it, row by row in order (the order in which a
	 * shared kvmem hands out pages) */
	for (size_t b = 0; b < NB; b++) {
		struct bd_seq *s = seqs[idx[b]];
		int pos = s->n_tokens, rc = err[b];
		if (rc == 0 && (pos + 1) % BD_PAGE_TOKENS == 0)
			rc = bd_seq_promote(s);
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
				lm_head(m, x, 1, per_row, NULL, xn,
					ret_logits + (size_t)idx[0] * V);
		} else {
			lm_head(m, x, nb, per_row, wscr, xn, lg);
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
	free(wscr);
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

	if (ret_err)
		ret_err[0] = '\0';
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
	struct bd_seq_opts o = { .max_tokens = n_prompt + p->max_tokens, .mu_k = p->mu_k,
				 .dp = p->dp };
	if ((r = bd_seq_new(m, cfg, &o, &s, ret_err)) < 0)
		goto out;
	if (!(logits = malloc(sizeof(float) * (size_t)m->hp.n_vocab))) {
		r = fail(ret_err, -ENOMEM, "out of memory");
		goto out;
	}
	/* a long prompt in chunks, so the prefill's scratch (every layer's K and V, the rows'
	 * activations) is that of BD_GEN_PREFILL_CHUNK tokens, not of the whole prompt */
	for (int p0 = 0; p0 < n_prompt; p0 += BD_GEN_PREFILL_CHUNK) {
		int c = n_prompt - p0 < BD_GEN_PREFILL_CHUNK ? n_prompt - p0 : BD_GEN_PREFILL_CHUNK;
		float *lg = p0 + c == n_prompt ? logits : NULL;
		r = p0 ? bd_model_prefill_chunk(m, s, prompt + p0, c, lg)
		       : bd_model_prefill(m, s, prompt, c, lg);
		if (r < 0) {
			fail(ret_err, r, "prefill failed at token %d (%s)", p0, strerror(-r));
			goto out;
		}
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
