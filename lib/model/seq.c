/* seq.c — one request's state: its KV cache, drawn from a bd_kvmem, and its write path
 * (bd_seq.h, bd_seq_impl.h). */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/bd_err.h"
#include "model/bd_seq_impl.h"

#define fail(ret_err, code, ...) bd_errf((ret_err), BD_MODEL_ERR_MAX, (code), __VA_ARGS__)

int bd_seq_new(const struct bd_model *m, const struct bd_kvcfg *cfg,
	       const struct bd_seq_opts *opts, struct bd_seq **ret, char *ret_err)
{
	if (ret_err)
		ret_err[0] = '\0';
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

	/* the sequence and its three page arrays of max_pages + 1 in one allocation */
	size_t np = (size_t)(opts->max_tokens / BD_PAGE_TOKENS) + 1;
	struct bd_seq *s = calloc(1, sizeof(*s) + np * (2 * sizeof(int32_t) + 1));
	if (!s)
		return fail(ret_err, -ENOMEM, "out of memory");
	s->block_table = s->pages;
	s->given = s->pages + np;
	s->drawn = (uint8_t *)(s->pages + 2 * np);
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
		size_t n_pages = s->max_pages > 0 ? (size_t)s->max_pages : 1;
		if ((r = bd_layout_init(&lay, cfg->page_fmt, hp->n_layers, Hl, d, 0, n_pages)) < 0 ||
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
	bool ok = true;
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

int bd_seq_promote(struct bd_seq *s)
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

int bd_seq_write_kv(struct bd_seq *s, int l, int pos, const float *k, const float *v)
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

int bd_seq_write_span(struct bd_seq *s, const float *kall, const float *vall, int p, int n)
{
	size_t N = (size_t)n, kd = (size_t)s->m->shard.n_kv_heads * (size_t)s->m->hp.head_dim;
	int r;

	for (int i = 0; i < n; i++) {
		int pos = p + i;
		for (int l = 0; l < s->m->hp.n_layers; l++) {
			size_t off = (size_t)l * N * kd + (size_t)i * kd;
			if ((r = bd_seq_write_kv(s, l, pos, kall + off, vall + off)) < 0) {
				s->failed = true;
				return r;
			}
		}
		if ((pos + 1) % BD_PAGE_TOKENS == 0 && (r = bd_seq_promote(s)) < 0) {
			s->failed = true;
			return r;
		}
	}
	s->n_tokens = p + n;
	return 0;
}

int bd_seq_cache_rows(const struct bd_seq *s, int l, const float *k, const float *v, int n,
		      void *scratch, float *ret_k, float *ret_v)
{
	const struct bd_layout *lay = s->lay;
	int H = s->m->shard.n_kv_heads, d = lay->d, r;
	size_t D = (size_t)d, kd = (size_t)H * D;

	for (int i = 0; i < n; i++) {
		for (int h = 0; h < H; h++) {
			size_t off = (size_t)i * kd + (size_t)h * D;
			/* position 16 of a scratch head: a recent row, not the sink */
			int pos = BD_SINK_TOKENS;
			const bd_bf16 *rk = bd_slot_recent_k(lay, scratch, 0, 0) + (size_t)pos * D;
			const bd_bf16 *rv = bd_slot_recent_v(lay, scratch, 0, 0) + (size_t)pos * D;

			r = bd_kv_write_token(lay, s->cfg, scratch, 0, 0, pos, k + off, v + off,
					      mu_of(s, l, h));
			if (r < 0)
				return r;
			for (int c = 0; c < d; c++) {
				ret_k[off + (size_t)c] = bd_bf16_to_f32(rk[c]);
				ret_v[off + (size_t)c] = bd_bf16_to_f32(rv[c]);
			}
		}
	}
	return 0;
}

int bd_seq_cache_context(const struct bd_seq *s, int l, float *tk, float *tv, float *ret_k,
			 float *ret_v)
{
	const struct bd_layout *lay = s->lay;
	int H = s->m->shard.n_kv_heads, d = lay->d, r;
	size_t D = (size_t)d, kd = (size_t)H * D;

	for (int j = 0; j < s->n_full; j++) {
		const uint8_t *page = bd_layout_page(lay, s->mem->arena, l, s->block_table[j]);
		for (int h = 0; h < H; h++) {
			if ((r = bd_page_read_head(lay, page, h, tk, tv, NULL)) < 0)
				return r;
			for (int t = 0; t < BD_PAGE_TOKENS; t++) {
				size_t dst = ((size_t)j * BD_PAGE_TOKENS + (size_t)t) * kd +
					     (size_t)h * D;
				memcpy(ret_k + dst, tk + (size_t)t * D, sizeof(float) * D);
				memcpy(ret_v + dst, tv + (size_t)t * D, sizeof(float) * D);
			}
		}
	}
	/* the decoder reads the first tokens from the BF16 sink when the configuration keeps one */
	if (!s->cfg->sink || s->n_full == 0)
		return 0;
	for (int h = 0; h < H; h++) {
		const bd_bf16 *sk = bd_slot_sink_k(lay, s->slot, l, h);
		const bd_bf16 *sv = bd_slot_sink_v(lay, s->slot, l, h);
		for (int t = 0; t < BD_SINK_TOKENS; t++)
			for (int c = 0; c < d; c++) {
				size_t dst = (size_t)t * kd + (size_t)h * D + (size_t)c;
				ret_k[dst] = bd_bf16_to_f32(sk[(size_t)t * D + (size_t)c]);
				ret_v[dst] = bd_bf16_to_f32(sv[(size_t)t * D + (size_t)c]);
			}
	}
	return 0;
}

/* The FP8 scales of every (layer, KV head) as the first page stores them. */
static int fp8_scales_from_page(struct bd_seq *s, int32_t page)
{
	const struct bd_layout *lay = s->lay;
	size_t n = (size_t)BD_PAGE_TOKENS * (size_t)lay->d;
	float *tk = malloc(sizeof(float) * n), *tv = malloc(sizeof(float) * n);
	size_t nf = (size_t)lay->n_layers * (size_t)lay->n_kv_heads * 2;
	int r = 0;

	if (!s->fp8)
		s->fp8 = malloc(sizeof(float) * nf);
	if (!tk || !tv || !s->fp8) {
		r = -ENOMEM;
		goto out;
	}
	for (size_t i = 0; i < nf; i++)
		s->fp8[i] = 1.0f;
	for (int l = 0; l < lay->n_layers && r == 0; l++)
		for (int h = 0; h < s->m->shard.n_kv_heads && r == 0; h++)
			r = bd_page_read_head(lay, bd_layout_page(lay, s->mem->arena, l, page), h,
					      tk, tv,
					      s->fp8 + ((size_t)l * (size_t)lay->n_kv_heads +
							(size_t)h) * 2);
out:
	free(tk);
	free(tv);
	if (r < 0) {
		free(s->fp8);
		s->fp8 = NULL;
	}
	return r;
}

int bd_seq_resume(struct bd_seq *s, const int32_t *pages, int n_pages, int n_tokens)
{
	if (!s || s->n_tokens != 0 || s->n_full != 0 || s->failed || n_tokens < 0 ||
	    n_tokens > s->max_tokens || n_pages != n_tokens / BD_PAGE_TOKENS ||
	    n_pages > s->max_pages || (n_pages > 0 && !pages))
		return -EINVAL;
	for (int i = 0; i < n_pages; i++)
		if (pages[i] < 0 || (size_t)pages[i] >= s->lay->n_pages)
			return -ERANGE;
	if (s->lay->fmt == BD_PAGE_FP8 && !s->fp8 && n_pages > 0) {
		int r = fp8_scales_from_page(s, pages[0]);
		if (r < 0)
			return r;
	}
	for (int i = 0; i < n_pages; i++) {
		s->block_table[i] = pages[i];
		s->drawn[i] = 0;
	}
	s->n_full = n_pages;
	s->n_tokens = n_tokens;
	return 0;
}
