/* attn_ref.c — the CPU reference decoder of bd_attn.h (NUMERICS.md §5, §6, §8; paper
 * Algorithm 1 for GQA, Algorithm 2 for MLA).
 *
 * It is the oracle of the decode kernels, so it mirrors their structure rather than computing
 * attention the shortest way: page keys in tiles of B_k, an online softmax in the exp2 domain per
 * split of contiguous tiles, decode scales applied per tile after the FP32 inner sums, P quantized
 * per block of keys inside a tile, the BF16 sink and recent tokens as one more partial, and the
 * log-sum-exp combine. Only the FP32 summation order may differ from a kernel.
 */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bd_attn.h"

#define LOG2E 1.4426950408889634f

/* What one decode call needs besides the per-head query: fixed for the whole call. */
struct dctx {
	const struct bd_kvcfg *cfg;
	const struct bd_decode_params *dp;
	const struct bd_kv_view *kv;
	const struct bd_layout *lay;
	bool mla;
	bool fp4_query;  /* the page path uses the FP4-quantized query (NVFP4 / MXFP4 pages) */
	enum bd_fp4_format qfmt;
	float gamma;     /* log2(e) · softmax_scale */
	float log2c;     /* log2(c) for underflow-aware P scaling, else 0 */
	int d, dr;       /* key dim (latent for MLA), positional dim (MLA, else 0) */
	int dv;          /* columns of a page's / slot's V rows */
	int bk;          /* keys per tile */
	int n_full;      /* full FP4 pages */
	int n_tiles;
};

/* Scratch buffers, allocated once per call. */
struct ws {
	float *pk, *pv;   /* the loaded page-head: [128][d], [128][dv] */
	int32_t loaded;   /* page id in pk/pv, −1 for none */
	float pg[2];      /* its {g_K, g_V} */
	float *qrot;      /* [d] q' (rotated when cfg->hadamard) */
	float *qbf;       /* [d] q' rounded to BF16 */
	float *sq;        /* [2][d] expanded FP4 query terms s·x̂, without g */
	float qg[2];      /* their decode scales */
	int nterms;
	float *qr;        /* [dr] BF16 positional query (MLA) */
	float *S, *P, *Pt; /* [bk] logits, probabilities, quantized probabilities */
	bool *masked;     /* [bk] */
	float *o_s;       /* [n_splits + 1][d] partial outputs */
	float *lse_s;     /* [n_splits + 1] */
	float *o;         /* [d] combined output of one head */
	float *bS;        /* [16 + 128] logits of the BF16 tokens */
};

static bool all_finite(const float *x, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (!isfinite(x[i]))
			return false;
	return true;
}

static float round_bf16(float x)
{
	return bd_bf16_to_f32(bd_f32_to_bf16(x));
}

static bool is_fp4_page(enum bd_page_format f)
{
	return f == BD_PAGE_NVFP4 || f == BD_PAGE_MXFP4;
}

/* Checks shared by GQA and MLA, and the derived constants. */
static int ctx_init(struct dctx *x, const struct bd_kvcfg *cfg, const struct bd_decode_params *dp,
		    const struct bd_kv_view *kv, bool mla)
{
	const struct bd_layout *lay;

	if (!cfg || !dp || !kv || !kv->lay || !kv->slot)
		return -EINVAL;
	lay = kv->lay;
	if (lay->fmt != cfg->page_fmt || lay->d <= 0 || lay->d > BD_FWHT_MAX)
		return -EINVAL;
	if (mla ? lay->d_rope <= 0 || lay->dv != lay->d_rope : lay->d_rope != 0 || lay->dv != lay->d)
		return -EINVAL;
	if (kv->n_tokens < 1 || kv->layer < 0 || kv->layer >= lay->n_layers || kv->kv_head < 0 ||
	    kv->kv_head >= lay->n_kv_heads || (mla && kv->kv_head != 0))
		return -EINVAL;

	int pblock = cfg->p_quant == BD_P_MXFP4 ? BD_MXFP4_BLOCK : BD_NVFP4_BLOCK;
	if (dp->n_splits < 1 || dp->tile_keys <= 0 || dp->tile_keys % pblock != 0 ||
	    BD_PAGE_TOKENS % dp->tile_keys != 0)
		return -EINVAL;
	if (!isfinite(dp->c) || !(dp->c > 0.0f) || !isfinite(dp->tau) || !(dp->tau >= 0.0f) ||
	    !isfinite(dp->softmax_scale) || (mla && dp->softmax_scale == 0.0f))
		return -EINVAL;

	bool fp4q = is_fp4_page(cfg->page_fmt);
	if (fp4q && cfg->query_terms != 1 && cfg->query_terms != 2)
		return -EINVAL;

	int n_full = (kv->n_tokens - 1) / BD_PAGE_TOKENS;
	if (n_full > 0) {
		if (!kv->arena || !kv->block_table)
			return -EINVAL;
		for (int i = 0; i < n_full; i++)
			if (kv->block_table[i] < 0 || (size_t)kv->block_table[i] >= lay->n_pages)
				return -EINVAL;
	}

	float scale = dp->softmax_scale != 0.0f ? dp->softmax_scale : 1.0f / sqrtf((float)lay->d);
	*x = (struct dctx){
		.cfg = cfg,
		.dp = dp,
		.kv = kv,
		.lay = lay,
		.mla = mla,
		.fp4_query = fp4q,
		.qfmt = cfg->page_fmt == BD_PAGE_MXFP4 ? BD_FP4_MXFP4 : BD_FP4_NVFP4,
		.gamma = LOG2E * scale,
		/* MLA never quantizes P (c = 1); GQA scales only with the underflow-aware rule */
		.log2c = !mla && cfg->p_quant == BD_P_NVFP4_UNDERFLOW ? log2f(dp->c) : 0.0f,
		.d = lay->d,
		.dr = mla ? lay->d_rope : 0,
		.dv = lay->dv,
		.bk = dp->tile_keys,
		.n_full = n_full,
		.n_tiles = n_full * BD_PAGE_TOKENS / dp->tile_keys,
	};
	return 0;
}

static void ws_free(struct ws *w)
{
	free(w->pk);
	free(w->pv);
	free(w->qrot);
	free(w->qbf);
	free(w->sq);
	free(w->qr);
	free(w->S);
	free(w->P);
	free(w->Pt);
	free(w->masked);
	free(w->o_s);
	free(w->lse_s);
	free(w->o);
	free(w->bS);
}

static int ws_alloc(struct ws *w, const struct dctx *x)
{
	size_t d = (size_t)x->d, np = (size_t)x->dp->n_splits + 1;

	*w = (struct ws){ .loaded = -1 };
	w->pk = malloc(sizeof(float) * BD_PAGE_TOKENS * d);
	w->pv = malloc(sizeof(float) * BD_PAGE_TOKENS * (size_t)x->dv);
	w->qrot = malloc(sizeof(float) * d);
	w->qbf = malloc(sizeof(float) * d);
	w->sq = malloc(sizeof(float) * 2 * d);
	w->qr = malloc(sizeof(float) * ((size_t)x->dr + 1));
	w->S = malloc(sizeof(float) * (size_t)x->bk);
	w->P = malloc(sizeof(float) * (size_t)x->bk);
	w->Pt = malloc(sizeof(float) * (size_t)x->bk);
	w->masked = malloc(sizeof(bool) * (size_t)x->bk);
	w->o_s = np <= SIZE_MAX / sizeof(float) / d ? malloc(sizeof(float) * np * d) : NULL;
	w->lse_s = malloc(sizeof(float) * np);
	w->o = malloc(sizeof(float) * d);
	w->bS = malloc(sizeof(float) * (BD_SINK_TOKENS + BD_RECENT_TOKENS));
	if (!w->pk || !w->pv || !w->qrot || !w->qbf || !w->sq || !w->qr || !w->S || !w->P ||
	    !w->Pt || !w->masked || !w->o_s || !w->lse_s || !w->o || !w->bS) {
		ws_free(w);
		return -ENOMEM;
	}
	return 0;
}

/* Step 1–2: q' = Hq (if rotating), its BF16 rounding, and for FP4 pages the expanded FP4 query
 * terms ŝq_t = s·x̂ (without g_t) of the dual-residual (or one-term) quantization (§5). q_r, when
 * given, is the MLA positional query, rounded to BF16 and never quantized. */
static int prep_query(const struct dctx *x, struct ws *w, const float *q, const float *q_r)
{
	int d = x->d, r;

	memcpy(w->qrot, q, sizeof(float) * (size_t)d);
	if (x->cfg->hadamard) {
		r = bd_fwht(w->qrot, d);
		if (r < 0)
			return r;
	}
	for (int c = 0; c < d; c++)
		w->qbf[c] = round_bf16(w->qrot[c]);
	for (int c = 0; c < x->dr; c++)
		w->qr[c] = round_bf16(q_r[c]);

	w->nterms = 0;
	if (!x->fp4_query)
		return 0;

	struct bd_qquant qq;
	r = bd_query_quantize(w->qrot, d, x->qfmt, x->cfg->query_terms, &qq);
	if (r < 0)
		return r;
	w->nterms = qq.nterms;
	for (int t = 0; t < qq.nterms; t++) {
		float *sq = w->sq + (size_t)t * (size_t)d;
		for (int c = 0; c < d; c++) {
			float xh = bd_e2m1_decode(bd_fp4_get(qq.codes[t], (size_t)c));
			if (x->qfmt == BD_FP4_NVFP4)
				sq[c] = bd_e4m3_decode(qq.scales[t][c / BD_NVFP4_BLOCK]) * xh;
			else
				sq[c] = bd_ue8m0_decode(qq.scales[t][c / BD_MXFP4_BLOCK]) * xh;
		}
		w->qg[t] = qq.g[t];
	}
	return 0;
}

/* Make page id `page` the loaded one: expanded s·x̂ values and {g_K, g_V}. */
static int load_page(const struct dctx *x, struct ws *w, int32_t page)
{
	if (w->loaded == page)
		return 0;
	const uint8_t *base = bd_layout_page(x->lay, (void *)x->kv->arena, x->kv->layer, page);
	int r = bd_page_read_head(x->lay, base, x->kv->kv_head, w->pk, w->pv, w->pg);
	if (r < 0) {
		w->loaded = -1;
		return r;
	}
	w->loaded = page;
	return 0;
}

/* Logit of row `row` of the loaded page (§5): FP32 inner sums over channels in ascending order,
 * then the query decode scales, the page's g_K, and γ, in that order. */
static float page_logit(const struct dctx *x, const struct ws *w, int row)
{
	const float *k = w->pk + (size_t)row * (size_t)x->d;
	float dot;

	if (x->fp4_query) {
		float acc[2] = { 0.0f, 0.0f };
		for (int t = 0; t < w->nterms; t++) {
			const float *sq = w->sq + (size_t)t * (size_t)x->d;
			for (int c = 0; c < x->d; c++)
				acc[t] = acc[t] + sq[c] * k[c];
		}
		dot = acc[0] * w->qg[0];
		if (w->nterms == 2)
			dot = dot + acc[1] * w->qg[1];
	} else {
		dot = 0.0f;
		for (int c = 0; c < x->d; c++)
			dot = dot + w->qbf[c] * k[c];
	}

	if (!x->mla)
		return (dot * w->pg[0]) * x->gamma;

	/* MLA: the positional part is BF16 in the V rows of the page, scaled by nothing */
	const float *kr = w->pv + (size_t)row * (size_t)x->dv;
	float accr = 0.0f;
	for (int c = 0; c < x->dr; c++)
		accr = accr + w->qr[c] * kr[c];
	return (dot * w->pg[0] + accr) * x->gamma;
}

/* Quantize the tile's probabilities P[bk] into Pt[bk] per cfg->p_quant (§6), counting
 * probability blocks in st[0] and underflowed ones in st[1]. */
static int quantize_p(const struct dctx *x, struct ws *w, float m_new, uint64_t st[2])
{
	enum bd_pquant pq = x->mla ? BD_P_FP32 : x->cfg->p_quant;

	if (pq == BD_P_FP32) {
		for (int i = 0; i < x->bk; i++)
			/* MLA's P·C runs in FP16 (Algorithm 2): round P to FP16, nearest even */
			w->Pt[i] = x->mla ? (float)(_Float16)w->P[i] : w->P[i];
		return 0;
	}

	if (pq == BD_P_MXFP4) {
		for (int b = 0; b < x->bk; b += BD_MXFP4_BLOCK) {
			uint8_t packed[BD_MXFP4_BLOCK / 2], e;
			bool any = false;
			float pmax = 0.0f;
			for (int i = b; i < b + BD_MXFP4_BLOCK; i++) {
				any = any || !w->masked[i];
				pmax = fmaxf(pmax, w->P[i]);
			}
			int r = bd_mxfp4_quantize_block(w->P + b, BD_SCALE_STANDARD, packed, &e);
			if (r < 0)
				return r;
			bd_mxfp4_dequantize_block(packed, e, w->Pt + b);
			if (!any)
				continue;
			bool zero = true;
			for (int i = b; i < b + BD_MXFP4_BLOCK; i++)
				zero = zero && w->Pt[i] == 0.0f;
			st[0]++;
			st[1] += zero && pmax > 0.0f;
		}
		return 0;
	}

	struct bd_pscale ps = pq == BD_P_NVFP4_UNDERFLOW ?
				      (struct bd_pscale){ x->dp->c, x->dp->tau, true } :
				      (struct bd_pscale){ 1.0f, x->dp->tau, false };
	for (int b = 0; b < x->bk; b += BD_NVFP4_BLOCK) {
		float smax = -INFINITY, phat[BD_NVFP4_BLOCK];
		uint8_t code;
		for (int i = b; i < b + BD_NVFP4_BLOCK; i++)
			if (!w->masked[i])
				smax = fmaxf(smax, w->S[i]);
		/* p_max is the unscaled block maximum, exp2(max S_b − m); c enters via ps */
		float pmax = smax == -INFINITY ? 0.0f : exp2f(smax - m_new);
		bd_p_quantize_block_nvfp4(w->P + b, pmax, &ps, phat, &code);
		float sp = bd_e4m3_decode(code);
		for (int i = 0; i < BD_NVFP4_BLOCK; i++)
			w->Pt[b + i] = sp * phat[i];
		if (smax != -INFINITY) {
			st[0]++;
			st[1] += code == 0;
		}
	}
	return 0;
}

/* Step 3: one split of the page path, tiles [tb, te), online softmax in the exp2 domain.
 * ret_o [d] normalized, ret_lse its log2 LSE (−inf and o = 0 when the split saw no key). */
static int page_split(const struct dctx *x, struct ws *w, int tb, int te, float *ret_o,
		      float *ret_lse, uint64_t st[2])
{
	int d = x->d, bk = x->bk;
	float m = -INFINITY, l = 0.0f;
	float *o = ret_o;

	memset(o, 0, sizeof(float) * (size_t)d);
	for (int j = tb; j < te; j++) {
		int t0 = j * bk;
		int row0 = t0 % BD_PAGE_TOKENS;
		int r = load_page(x, w, x->kv->block_table[t0 / BD_PAGE_TOKENS]);
		if (r < 0)
			return r;

		float m_tile = -INFINITY;
		for (int i = 0; i < bk; i++) {
			/* sink tokens are read from BF16; their page copy is masked (§8) */
			w->masked[i] = x->cfg->sink && t0 + i < BD_SINK_TOKENS;
			w->S[i] = w->masked[i] ? -INFINITY : page_logit(x, w, row0 + i);
			if (!w->masked[i] && !isfinite(w->S[i]))
				return -EDOM; /* the logit overflowed FP32 */
			m_tile = fmaxf(m_tile, w->S[i]);
		}
		float m_new = fmaxf(m, m_tile);
		if (m_new == -INFINITY)
			continue;
		float alpha = m == -INFINITY ? 0.0f : exp2f(m - m_new);

		float sum = 0.0f;
		for (int i = 0; i < bk; i++) {
			w->P[i] = w->masked[i] ? 0.0f : exp2f(w->S[i] - m_new + x->log2c);
			sum = sum + w->P[i];
		}
		l = alpha * l + sum; /* ℓ uses the unquantized P */

		r = quantize_p(x, w, m_new, st);
		if (r < 0)
			return r;

		for (int c = 0; c < d; c++) {
			float acc = 0.0f;
			if (x->mla) {
				/* C̃ dequantized per element (g_C), P̃ in FP16 */
				for (int i = 0; i < bk; i++)
					if (!w->masked[i])
						acc = acc + w->Pt[i] *
								    (w->pk[(size_t)(row0 + i) * (size_t)d + c] *
								     w->pg[0]);
				o[c] = alpha * o[c] + acc;
			} else {
				/* g_V applied once per tile, after the FP32 sum of P̃·ŝv */
				for (int i = 0; i < bk; i++)
					if (!w->masked[i])
						acc = acc + w->Pt[i] *
								    w->pv[(size_t)(row0 + i) * (size_t)x->dv + c];
				o[c] = alpha * o[c] + acc * w->pg[1];
			}
		}
		m = m_new;
	}

	if (l == 0.0f) {
		memset(o, 0, sizeof(float) * (size_t)d);
		*ret_lse = -INFINITY;
		return 0;
	}
	for (int c = 0; c < d; c++)
		o[c] = o[c] / l;
	*ret_lse = m + log2f(l) - x->log2c;
	return 0;
}

/* Step 4: the BF16 partial over the sink rows (with cfg->sink) and the recent rows, plain FP32
 * softmax in the exp2 domain. Values are the slot's V rows (GQA) or its latent K rows (MLA). */
static void bf16_partial(const struct dctx *x, struct ws *w, float *ret_o, float *ret_lse)
{
	const struct bd_kv_view *kv = x->kv;
	void *slot = (void *)kv->slot;
	int n = kv->n_tokens, d = x->d, dv = x->dv;
	const bd_bf16 *krows[BD_SINK_TOKENS + BD_RECENT_TOKENS];
	const bd_bf16 *vrows[BD_SINK_TOKENS + BD_RECENT_TOKENS];
	int cnt = 0;

	const bd_bf16 *sk = bd_slot_sink_k(x->lay, slot, kv->layer, kv->kv_head);
	const bd_bf16 *sv = bd_slot_sink_v(x->lay, slot, kv->layer, kv->kv_head);
	const bd_bf16 *rk = bd_slot_recent_k(x->lay, slot, kv->layer, kv->kv_head);
	const bd_bf16 *rv = bd_slot_recent_v(x->lay, slot, kv->layer, kv->kv_head);
	int t_recent = x->n_full * BD_PAGE_TOKENS;

	if (x->cfg->sink) {
		for (int t = 0; t < n && t < BD_SINK_TOKENS; t++) {
			krows[cnt] = sk + (size_t)t * (size_t)d;
			vrows[cnt] = sv + (size_t)t * (size_t)dv;
			cnt++;
		}
		if (t_recent < BD_SINK_TOKENS)
			t_recent = BD_SINK_TOKENS;
	}
	for (int t = t_recent; t < n; t++) {
		int row = t % BD_RECENT_TOKENS;
		krows[cnt] = rk + (size_t)row * (size_t)d;
		vrows[cnt] = rv + (size_t)row * (size_t)dv;
		cnt++;
	}

	memset(ret_o, 0, sizeof(float) * (size_t)d);
	if (cnt == 0) {
		*ret_lse = -INFINITY;
		return;
	}

	float m = -INFINITY;
	for (int i = 0; i < cnt; i++) {
		float acc = 0.0f;
		for (int c = 0; c < d; c++)
			acc = acc + w->qbf[c] * bd_bf16_to_f32(krows[i][c]);
		if (x->mla) {
			float accr = 0.0f;
			for (int c = 0; c < x->dr; c++)
				accr = accr + w->qr[c] * bd_bf16_to_f32(vrows[i][c]);
			w->bS[i] = (acc + accr) * x->gamma;
		} else {
			w->bS[i] = x->gamma * acc;
		}
		m = fmaxf(m, w->bS[i]);
	}

	float l = 0.0f;
	for (int i = 0; i < cnt; i++) {
		w->bS[i] = exp2f(w->bS[i] - m); /* now P_i */
		l = l + w->bS[i];
	}
	for (int c = 0; c < d; c++) {
		float acc = 0.0f;
		for (int i = 0; i < cnt; i++) {
			/* MLA values are the latent rows (slot K); GQA values the V rows */
			const bd_bf16 *val = x->mla ? krows[i] : vrows[i];
			acc = acc + w->bS[i] * bd_bf16_to_f32(val[c]);
		}
		ret_o[c] = acc / l;
	}
	*ret_lse = m + log2f(l);
}

/* Steps 1–5 for one query head: the combined output (still in the cache's value space) in
 * w->o and its LSE. */
static int decode_head(const struct dctx *x, struct ws *w, const float *q, const float *q_r,
		       float *ret_lse, uint64_t st[2])
{
	int ns = x->dp->n_splits, d = x->d;
	int r = prep_query(x, w, q, q_r);
	if (r < 0)
		return r;

	/* 64-bit: n_tiles + ns and s·chunk may exceed INT_MAX when n_splits is large */
	long long chunk = ((long long)x->n_tiles + ns - 1) / ns;
	if (chunk < 1)
		chunk = 1;
	for (int s = 0; s < ns; s++) {
		long long tb = (long long)s * chunk, te = tb + chunk;
		if (tb > x->n_tiles)
			tb = x->n_tiles;
		if (te > x->n_tiles)
			te = x->n_tiles;
		r = page_split(x, w, (int)tb, (int)te, w->o_s + (size_t)s * (size_t)d, &w->lse_s[s],
			       st);
		if (r < 0)
			return r;
	}
	bf16_partial(x, w, w->o_s + (size_t)ns * (size_t)d, &w->lse_s[ns]);
	for (int s = 0; s <= ns; s++)
		if (!isfinite(w->lse_s[s]) && w->lse_s[s] != -INFINITY)
			return -EDOM; /* a BF16 logit overflowed FP32 */
	bd_lse_combine(w->o_s, w->lse_s, ns + 1, d, w->o, ret_lse);
	return 0;
}

struct bd_decode_params bd_decode_params_default(void)
{
	return (struct bd_decode_params){
		.tile_keys = 64,
		.n_splits = 1,
		.softmax_scale = 0.0f,
		.tau = 21.0f / 1024.0f,
		.c = 8.0f,
	};
}

int bd_ref_decode_gqa(const struct bd_kvcfg *cfg, const struct bd_decode_params *dp,
		      const struct bd_kv_view *kv, const float *q, int G, float *ret_o,
		      float *ret_lse, struct bd_decode_stats *stats)
{
	struct dctx x;
	struct ws w;
	uint64_t st[2] = { 0, 0 };
	int r;

	if (!q || !ret_o || G < 1)
		return -EINVAL;
	r = ctx_init(&x, cfg, dp, kv, false);
	if (r < 0)
		return r;
	if (!all_finite(q, (size_t)G * (size_t)x.d))
		return -EDOM;
	float *out = malloc(sizeof(float) * (size_t)G * (size_t)x.d);
	float *lse = malloc(sizeof(float) * (size_t)G);
	if (!out || !lse) {
		free(out);
		free(lse);
		return -ENOMEM;
	}
	r = ws_alloc(&w, &x);
	if (r < 0)
		goto out;

	for (int h = 0; h < G; h++) {
		r = decode_head(&x, &w, q + (size_t)h * (size_t)x.d, NULL, &lse[h], st);
		if (r < 0)
			goto out;
		memcpy(out + (size_t)h * (size_t)x.d, w.o, sizeof(float) * (size_t)x.d);
	}

	/* outputs only on success */
	memcpy(ret_o, out, sizeof(float) * (size_t)G * (size_t)x.d);
	if (ret_lse)
		memcpy(ret_lse, lse, sizeof(float) * (size_t)G);
	if (stats) {
		stats->p_blocks += st[0];
		stats->p_zero_blocks += st[1];
	}
out:
	ws_free(&w);
	free(out);
	free(lse);
	return r;
}

int bd_ref_decode_mla(const struct bd_kvcfg *cfg, const struct bd_decode_params *dp,
		      const struct bd_kv_view *kv, const float *q_c, const float *q_r, int H,
		      const float *mu, float *ret_o, float *ret_lse, struct bd_decode_stats *stats)
{
	struct dctx x;
	struct ws w;
	uint64_t st[2] = { 0, 0 };
	int r;

	if (!q_c || !q_r || !ret_o || H < 1)
		return -EINVAL;
	r = ctx_init(&x, cfg, dp, kv, true);
	if (r < 0)
		return r;
	size_t d = (size_t)x.d;
	if (!all_finite(q_c, (size_t)H * d) || !all_finite(q_r, (size_t)H * (size_t)x.dr) ||
	    (mu && !all_finite(mu, d)))
		return -EDOM;
	float *out = malloc(sizeof(float) * (size_t)H * d);
	float *lse = malloc(sizeof(float) * (size_t)H);
	if (!out || !lse) {
		free(out);
		free(lse);
		return -ENOMEM;
	}
	r = ws_alloc(&w, &x);
	if (r < 0)
		goto out;

	for (int h = 0; h < H; h++) {
		r = decode_head(&x, &w, q_c + (size_t)h * d, q_r + (size_t)h * (size_t)x.dr, &lse[h],
				st);
		if (r < 0)
			goto out;
		/* o' lives in the rotated, smoothed latent space H(c − μ): map back, o = H o' + μ
		 * (H is symmetric and orthonormal, so its own inverse) */
		if (cfg->hadamard) {
			r = bd_fwht(w.o, x.d);
			if (r < 0)
				goto out;
		}
		float *oh = out + (size_t)h * d;
		for (size_t c = 0; c < d; c++)
			oh[c] = cfg->smoothing && mu ? w.o[c] + mu[c] : w.o[c];
	}

	memcpy(ret_o, out, sizeof(float) * (size_t)H * d);
	if (ret_lse)
		memcpy(ret_lse, lse, sizeof(float) * (size_t)H);
	if (stats) {
		/* MLA quantizes no probabilities; kept for a uniform interface */
		stats->p_blocks += st[0];
		stats->p_zero_blocks += st[1];
	}
out:
	ws_free(&w);
	free(out);
	free(lse);
	return r;
}

void bd_lse_combine(const float *o_s, const float *lse_s, int n, int d, float *ret_o,
		    float *ret_lse)
{
	double M = -INFINITY;

	if (!ret_o || d < 0)
		return;
	for (int s = 0; lse_s && s < n; s++)
		if (lse_s[s] > M)
			M = lse_s[s];
	if (M == -INFINITY || !o_s) {
		memset(ret_o, 0, sizeof(float) * (size_t)d);
		if (ret_lse)
			*ret_lse = -INFINITY;
		return;
	}

	double wsum = 0.0;
	for (int s = 0; s < n; s++)
		if (lse_s[s] != -INFINITY)
			wsum += exp2((double)lse_s[s] - M);
	for (int c = 0; c < d; c++) {
		double acc = 0.0;
		/* empty partials are skipped, not multiplied by 0: their o_s may be anything */
		for (int s = 0; s < n; s++)
			if (lse_s[s] != -INFINITY)
				acc += exp2((double)lse_s[s] - M) * (double)o_s[(size_t)s * (size_t)d + c];
		ret_o[c] = (float)(acc / wsum);
	}
	if (ret_lse)
		*ret_lse = (float)(M + log2(wsum));
}

int bd_attn_exact_f64(const float *q, const float *k, const float *v, int n, int d, int dv,
		      double scale, double *ret_o)
{
	if (!q || !k || !v || !ret_o || n < 1 || d < 1 || dv < 1 || !isfinite(scale))
		return -EINVAL;
	if (scale == 0.0)
		scale = 1.0 / sqrt((double)d);

	/* two passes (max, then weights) recomputing the logits: exact, no allocation */
	double m = -INFINITY;
	for (int i = 0; i < n; i++) {
		double s = 0.0;
		for (int c = 0; c < d; c++)
			s += (double)q[c] * (double)k[(size_t)i * (size_t)d + c];
		s *= scale;
		if (s > m)
			m = s;
	}
	double l = 0.0;
	for (int c = 0; c < dv; c++)
		ret_o[c] = 0.0;
	for (int i = 0; i < n; i++) {
		double s = 0.0;
		for (int c = 0; c < d; c++)
			s += (double)q[c] * (double)k[(size_t)i * (size_t)d + c];
		double p = exp(s * scale - m);
		l += p;
		for (int c = 0; c < dv; c++)
			ret_o[c] += p * (double)v[(size_t)i * (size_t)dv + c];
	}
	for (int c = 0; c < dv; c++)
		ret_o[c] /= l;
	return 0;
}
