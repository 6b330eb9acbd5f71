/* attn_ref.c — the CPU reference decoder of bd_attn_ref.h (NUMERICS.md §5, §6, §8; paper
 * Algorithm 1 for GQA, Algorithm 2 for MLA).
 *
 * It is the oracle of the decode kernels, so it mirrors their structure rather than computing
 * attention the shortest way: page keys in tiles of B_k, an online softmax in the exp2 domain per
 * split of contiguous tiles, decode scales applied per tile after the FP32 inner sums, P quantized
 * per block of keys inside a tile, the BF16 sink and recent tokens as one more partial, and the
 * log-sum-exp combine. Only the FP32 summation order may differ from a kernel.
 *
 * Speed without changing a bit: the heads of a GQA group (MLA: all heads) walk the tiles in
 * lockstep, so each page is expanded once per call rather than once per head; codes are
 * expanded through exact tables (E2M1 values, E4M3 / UE8M0 scales); and the per-key logit and
 * per-channel P·V sums run over many keys or channels at once, each sum still the same sequence
 * of FP32 operations in the same order.
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant/bd_attn_ref.h"

#define LOG2E 1.4426950408889634f

/* What one decode call needs besides the per-head query: fixed for the whole call. */
struct dctx {
	const struct bd_kvcfg *cfg;
	const struct bd_decode_params *dp;
	const struct bd_kv_view *kv; /* its lay: the page layout */
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

/* One query head's prepared query and partial results. */
struct head {
	float *qrot;  /* [d] q' (rotated when cfg->hadamard) */
	float *qbf;   /* [d] q' rounded to BF16 */
	float *sq;    /* [2][d] expanded FP4 query terms s·x̂, without g */
	float qg[2];  /* their decode scales */
	int nterms;
	float *qr;    /* [dr] BF16 positional query (MLA) */
	float *o_s;   /* [n_splits + 1][d] partial outputs */
	float *lse_s; /* [n_splits + 1] */
	float m, l;   /* running max and sum of the split being computed */
	float lq;     /* running quantized mass Σ s_P·P̂ of the split (cfg->p_norm = QMASS) */
};

/* Scratch of one call. A page is expanded once per call and shared by every head of the group,
 * which the heads then walk in lockstep (tile by tile); each head's arithmetic is unchanged. */
struct ws {
	int nh;
	struct head *h;    /* [nh] */
	float *pk;         /* the loaded page-head's K: [128][d] token-major */
	float *pkT;        /* the same, channel-major [d][128]: logits vectorize over keys */
	float *pv;         /* [128][dv] token-major */
	int32_t loaded;    /* page id in pk/pv, −1 for none */
	float pg[2];       /* its {g_K, g_V} */
	float *S, *P, *Pt; /* [bk] logits, probabilities, quantized probabilities */
	float *dot[2];     /* [bk] inner sums of the query terms */
	bool *masked;      /* [bk] */
	float *acc;        /* [d] P̃·V of one tile */
	float *bS;         /* [16 + 128] logits of the BF16 tokens */
};

/* Exact decode tables: E2M1 code → value, E4M3 and UE8M0 code → scale. Products s·x̂ of two
 * table entries equal those of the bd_*_decode() functions bit for bit. */
static float lut_e2m1[16], lut_e4m3[256], lut_ue8m0[256];
static pthread_once_t lut_once = PTHREAD_ONCE_INIT;

static void lut_init(void)
{
	bd_fp4_decode_tables(lut_e2m1, lut_e4m3, lut_ue8m0);
}

static float round_bf16(float x)
{
	return bd_bf16_to_f32(bd_f32_to_bf16(x));
}

static bool is_fp4_page(enum bd_page_format f)
{
	return f == BD_PAGE_NVFP4 || f == BD_PAGE_MXFP4;
}

int bd_kv_view_full_pages(const struct bd_kv_view *kv, int *ret_n_full)
{
	int n_full = (kv->n_tokens - 1) / BD_PAGE_TOKENS;

	if (n_full > 0) {
		if (!kv->arena || !kv->block_table)
			return -EINVAL;
		for (int i = 0; i < n_full; i++)
			if (kv->block_table[i] < 0 || (size_t)kv->block_table[i] >= kv->lay->n_pages)
				return -EINVAL;
	}
	*ret_n_full = n_full;
	return 0;
}

int bd_decode_check(const struct bd_kvcfg *cfg, const struct bd_decode_params *dp,
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
	if (is_fp4_page(cfg->page_fmt) && cfg->query_terms != 1 && cfg->query_terms != 2)
		return -EINVAL;
	return 0;
}

/* Checks shared by GQA and MLA, and the derived constants. */
static int ctx_init(struct dctx *x, const struct bd_kvcfg *cfg, const struct bd_decode_params *dp,
		    const struct bd_kv_view *kv, bool mla)
{
	const struct bd_layout *lay;

	if (bd_decode_check(cfg, dp, kv, mla) < 0)
		return -EINVAL;
	lay = kv->lay;
	bool fp4q = is_fp4_page(cfg->page_fmt);

	int n_full, r = bd_kv_view_full_pages(kv, &n_full);
	if (r < 0)
		return r;

	float scale = dp->softmax_scale != 0.0f ? dp->softmax_scale : 1.0f / sqrtf((float)lay->d);
	*x = (struct dctx){
		.cfg = cfg,
		.dp = dp,
		.kv = kv,
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
	for (int i = 0; w->h && i < w->nh; i++) {
		struct head *h = &w->h[i];
		free(h->qrot);
		free(h->qbf);
		free(h->sq);
		free(h->qr);
		free(h->o_s);
		free(h->lse_s);
	}
	free(w->h);
	free(w->pk);
	free(w->pkT);
	free(w->pv);
	free(w->S);
	free(w->P);
	free(w->Pt);
	free(w->dot[0]);
	free(w->dot[1]);
	free(w->masked);
	free(w->acc);
	free(w->bS);
	*w = (struct ws){ .loaded = -1 };
}

static int ws_alloc(struct ws *w, const struct dctx *x, int nh)
{
	size_t d = (size_t)x->d, np = (size_t)x->dp->n_splits + 1, bk = (size_t)x->bk;

	*w = (struct ws){ .loaded = -1 };
	w->h = calloc((size_t)nh, sizeof(*w->h));
	if (!w->h)
		return -ENOMEM;
	w->nh = nh;
	bool ok = true;
	for (int i = 0; i < nh && ok; i++) {
		struct head *h = &w->h[i];
		h->qrot = malloc(sizeof(float) * d);
		h->qbf = malloc(sizeof(float) * d);
		h->sq = malloc(sizeof(float) * 2 * d);
		h->qr = malloc(sizeof(float) * ((size_t)x->dr + 1));
		h->o_s = np <= SIZE_MAX / sizeof(float) / d ? malloc(sizeof(float) * np * d) : NULL;
		h->lse_s = malloc(sizeof(float) * np);
		ok = h->qrot && h->qbf && h->sq && h->qr && h->o_s && h->lse_s;
	}
	w->pk = malloc(sizeof(float) * BD_PAGE_TOKENS * d);
	w->pkT = malloc(sizeof(float) * BD_PAGE_TOKENS * d);
	w->pv = malloc(sizeof(float) * BD_PAGE_TOKENS * (size_t)x->dv);
	w->S = malloc(sizeof(float) * bk);
	w->P = malloc(sizeof(float) * bk);
	w->Pt = malloc(sizeof(float) * bk);
	w->dot[0] = malloc(sizeof(float) * bk);
	w->dot[1] = malloc(sizeof(float) * bk);
	w->masked = malloc(sizeof(bool) * bk);
	w->acc = malloc(sizeof(float) * d);
	w->bS = malloc(sizeof(float) * (BD_SINK_TOKENS + BD_RECENT_TOKENS));
	if (!ok || !w->pk || !w->pkT || !w->pv || !w->S || !w->P || !w->Pt || !w->dot[0] ||
	    !w->dot[1] || !w->masked || !w->acc || !w->bS) {
		ws_free(w);
		return -ENOMEM;
	}
	return 0;
}

/* Step 1–2: q' = Hq (if rotating), its BF16 rounding, and for FP4 pages the expanded FP4 query
 * terms ŝq_t = s·x̂ (without g_t) of the dual-residual (or one-term) quantization (§5). q_r, when
 * given, is the MLA positional query, rounded to BF16 and never quantized. */
static int prep_query(const struct dctx *x, struct head *h, const float *q, const float *q_r)
{
	int d = x->d, r;

	memcpy(h->qrot, q, sizeof(float) * (size_t)d);
	if (x->cfg->hadamard) {
		r = bd_fwht(h->qrot, d);
		if (r < 0)
			return r;
	}
	for (int c = 0; c < d; c++)
		h->qbf[c] = round_bf16(h->qrot[c]);
	for (int c = 0; c < x->dr; c++)
		h->qr[c] = round_bf16(q_r[c]);

	h->nterms = 0;
	if (!x->fp4_query)
		return 0;

	struct bd_qquant qq;
	r = bd_query_quantize(h->qrot, d, x->qfmt, x->cfg->query_terms, &qq);
	if (r < 0)
		return r;
	h->nterms = qq.nterms;
	for (int t = 0; t < qq.nterms; t++) {
		float *sq = h->sq + (size_t)t * (size_t)d;
		for (int c = 0; c < d; c++) {
			float xh = lut_e2m1[bd_fp4_get(qq.codes[t], (size_t)c)];
			if (x->qfmt == BD_FP4_NVFP4)
				sq[c] = lut_e4m3[qq.scales[t][c / BD_NVFP4_BLOCK]] * xh;
			else
				sq[c] = lut_ue8m0[qq.scales[t][c / BD_MXFP4_BLOCK]] * xh;
		}
		h->qg[t] = qq.g[t];
	}
	return 0;
}

/* Token-major FP4 rows [128][cols] (blocks along the row): ret [128][cols] = s·x̂. */
static void expand_fp4_rows(const uint8_t *codes, const uint8_t *scales, int block,
			    const float *slut, size_t cols, float *ret)
{
	size_t nb = cols / (size_t)block;

	for (size_t t = 0; t < BD_PAGE_TOKENS; t++) {
		const uint8_t *cr = codes + t * cols / 2;
		float *out = ret + t * cols;
		for (size_t b = 0; b < nb; b++) {
			float s = slut[scales[t * nb + b]];
			for (size_t i = b * (size_t)block; i < (b + 1) * (size_t)block; i += 2) {
				uint8_t byte = cr[i / 2];
				out[i] = s * lut_e2m1[byte & 0xf];
				out[i + 1] = s * lut_e2m1[byte >> 4];
			}
		}
	}
}

/* Channel-major FP4 V (blocks along tokens: channel c's token t in nibble t%2 of byte
 * c·64 + t/2) expanded to token-major ret [128][cols]. */
static void expand_fp4_cols(const uint8_t *codes, const uint8_t *scales, int block,
			    const float *slut, size_t cols, float *ret)
{
	size_t nb = BD_PAGE_TOKENS / (size_t)block;

	for (size_t c = 0; c < cols; c++) {
		const uint8_t *cc = codes + c * (BD_PAGE_TOKENS / 2);
		for (size_t b = 0; b < nb; b++) {
			float s = slut[scales[c * nb + b]];
			for (size_t t = b * (size_t)block; t < (b + 1) * (size_t)block; t += 2) {
				uint8_t byte = cc[t / 2];
				ret[t * cols + c] = s * lut_e2m1[byte & 0xf];
				ret[(t + 1) * cols + c] = s * lut_e2m1[byte >> 4];
			}
		}
	}
}

static void expand_bf16(const uint8_t *src, size_t n, float *ret)
{
	for (size_t i = 0; i < n; i++) {
		bd_bf16 h;
		memcpy(&h, src + i * sizeof(h), sizeof(h));
		ret[i] = bd_bf16_to_f32(h);
	}
}

static void expand_e4m3(const uint8_t *src, size_t n, float *ret)
{
	for (size_t i = 0; i < n; i++)
		ret[i] = lut_e4m3[src[i]];
}

/* Make page id `page` the loaded one: K and V expanded to s·x̂ (the values bd_page_read_head()
 * gives with ret_g, without the page decode scale) and {g_K, g_V}. Decoded here through the
 * exact tables rather than through bd_page_read_head(), once per group of heads. */
static void load_page(const struct dctx *x, struct ws *w, int32_t page)
{
	if (w->loaded == page)
		return;
	const struct bd_layout *lay = x->kv->lay;
	const uint8_t *base = bd_layout_page(lay, (void *)x->kv->arena, x->kv->layer, page);
	const uint8_t *head = base + (size_t)x->kv->kv_head * lay->head_bytes;
	size_t d = (size_t)lay->d, dv = (size_t)lay->dv;
	const float *slut = lay->fmt == BD_PAGE_MXFP4 ? lut_ue8m0 : lut_e4m3;

	memcpy(w->pg, base + lay->gscale_off + (size_t)x->kv->kv_head * 2 * sizeof(float),
	       sizeof(w->pg));
	if (lay->fmt == BD_PAGE_BF16 || lay->fmt == BD_PAGE_MXFP4)
		w->pg[0] = w->pg[1] = 1.0f;
	if (x->mla)
		w->pg[1] = 1.0f;

	switch (lay->fmt) {
	case BD_PAGE_NVFP4:
	case BD_PAGE_MXFP4:
		expand_fp4_rows(head + lay->k_codes_off, head + lay->k_scales_off, lay->block, slut, d,
				w->pk);
		if (!x->mla)
			expand_fp4_cols(head + lay->v_codes_off, head + lay->v_scales_off,
					lay->block, slut, dv, w->pv);
		break;
	case BD_PAGE_NVFP4_CH:
		expand_fp4_rows(head + lay->k_codes_off, head + lay->k_scales_off, lay->block, slut, d,
				w->pk);
		expand_fp4_rows(head + lay->v_codes_off, head + lay->v_scales_off, lay->block, slut,
				dv, w->pv);
		break;
	case BD_PAGE_FP8:
		expand_e4m3(head + lay->k_codes_off, BD_PAGE_TOKENS * d, w->pk);
		expand_e4m3(head + lay->v_codes_off, BD_PAGE_TOKENS * dv, w->pv);
		break;
	case BD_PAGE_BF16:
	default:
		expand_bf16(head + lay->k_codes_off, BD_PAGE_TOKENS * d, w->pk);
		break;
	}
	if (x->mla || lay->fmt == BD_PAGE_BF16)
		expand_bf16(head + lay->v_codes_off, BD_PAGE_TOKENS * dv, w->pv);
	for (size_t t = 0; t < BD_PAGE_TOKENS; t++)
		for (size_t c = 0; c < d; c++)
			w->pkT[c * BD_PAGE_TOKENS + t] = w->pk[t * d + c];
	w->loaded = page;
}

/* acc[i] = acc[i] + a·x[i] for i < n (n a multiple of 16), each element one FP32 multiply and
 * one add, as a scalar loop would do them; written in blocks of 16 so that the compiler
 * vectorizes it at -O2 without changing any result. */
static void axpy16(float *restrict acc, const float *restrict x, float a, int n)
{
	for (int i = 0; i < n; i += 16)
		for (int j = 0; j < 16; j++)
			acc[i + j] = acc[i + j] + a * x[i + j];
}

/* Logits of rows row0..row0+bk−1 of the loaded page for head h into w->S (§5): per key, FP32
 * inner sums over channels in ascending order, then the query decode scales, the page's g_K,
 * and γ, in that order. Sums run over keys in parallel (channel-major K); each key's sum is the
 * same sequence of FP32 operations as a key-by-key loop. */
static void page_logits(const struct dctx *x, struct ws *w, const struct head *h, int row0)
{
	int d = x->d, bk = x->bk;
	int nt = x->fp4_query ? h->nterms : 1;

	for (int t = 0; t < nt; t++) {
		const float *qv = x->fp4_query ? h->sq + (size_t)t * (size_t)d : h->qbf;
		float *acc = w->dot[t];
		for (int i = 0; i < bk; i++)
			acc[i] = 0.0f;
		for (int c = 0; c < d; c++)
			axpy16(acc, w->pkT + (size_t)c * BD_PAGE_TOKENS + row0, qv[c], bk);
	}
	for (int i = 0; i < bk; i++) {
		float dot;
		if (x->fp4_query) {
			dot = w->dot[0][i] * h->qg[0];
			if (h->nterms == 2)
				dot = dot + w->dot[1][i] * h->qg[1];
		} else {
			dot = w->dot[0][i];
		}
		if (!x->mla) {
			w->S[i] = (dot * w->pg[0]) * x->gamma;
			continue;
		}
		/* MLA: the positional part is BF16 in the V rows of the page, scaled by nothing */
		const float *kr = w->pv + (size_t)(row0 + i) * (size_t)x->dv;
		float accr = 0.0f;
		for (int c = 0; c < x->dr; c++)
			accr = accr + h->qr[c] * kr[c];
		w->S[i] = (dot * w->pg[0] + accr) * x->gamma;
	}
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
		float sp = lut_e4m3[code];
		for (int i = 0; i < BD_NVFP4_BLOCK; i++)
			w->Pt[b + i] = sp * phat[i];
		if (smax != -INFINITY) {
			st[0]++;
			st[1] += code == 0;
		}
	}
	return 0;
}

/* One tile (rows row0.. of the loaded page) of head h's online softmax (§6): logits, running
 * max, P, ℓ, P quantization and o ← α·o + P̃·V. w->masked is set by the caller. */
static int tile_step(const struct dctx *x, struct ws *w, struct head *h, float *o, int row0,
		     uint64_t st[2])
{
	int d = x->d, bk = x->bk;

	page_logits(x, w, h, row0);
	float m_tile = -INFINITY;
	for (int i = 0; i < bk; i++) {
		if (w->masked[i])
			w->S[i] = -INFINITY; /* sink tokens are read from BF16 (§8) */
		else if (!isfinite(w->S[i]))
			return -EDOM; /* the logit overflowed FP32 */
		m_tile = fmaxf(m_tile, w->S[i]);
	}
	float m_new = fmaxf(h->m, m_tile);
	if (m_new == -INFINITY)
		return 0;
	float alpha = h->m == -INFINITY ? 0.0f : exp2f(h->m - m_new);

	float sum = 0.0f;
	for (int i = 0; i < bk; i++) {
		w->P[i] = w->masked[i] ? 0.0f : exp2f(w->S[i] - m_new + x->log2c);
		sum = sum + w->P[i];
	}
	h->l = alpha * h->l + sum; /* ℓ uses the unquantized P */

	int r = quantize_p(x, w, m_new, st);
	if (r < 0)
		return r;
	if (x->cfg->p_norm == BD_NORM_QMASS) {
		/* the quantized mass, in key order over the unmasked keys (page-partial
		 * normalization, NUMERICS.md) */
		float sumq = 0.0f;
		for (int i = 0; i < bk; i++)
			if (!w->masked[i])
				sumq = sumq + w->Pt[i];
		h->lq = alpha * h->lq + sumq;
	}

	/* per channel, the FP32 sum over the tile's keys in key order, then the scales */
	float *acc = w->acc;
	for (int c = 0; c < d; c++)
		acc[c] = 0.0f;
	for (int i = 0; i < bk; i++) {
		if (w->masked[i])
			continue;
		const float p = w->Pt[i];
		if (x->mla) {
			/* C̃ dequantized per element (g_C), P̃ in FP16 */
			const float *kr = w->pk + (size_t)(row0 + i) * (size_t)d;
			const float gk = w->pg[0];
			for (int c = 0; c < d; c++)
				acc[c] = acc[c] + p * (kr[c] * gk);
		} else {
			axpy16(acc, w->pv + (size_t)(row0 + i) * (size_t)x->dv, p, d);
		}
	}
	if (x->mla) {
		for (int c = 0; c < d; c++)
			o[c] = alpha * o[c] + acc[c];
	} else {
		/* g_V applied once per tile, after the FP32 sum of P̃·ŝv */
		for (int c = 0; c < d; c++)
			o[c] = alpha * o[c] + acc[c] * w->pg[1];
	}
	h->m = m_new;
	return 0;
}

/* Step 3: split s of the page path, tiles [tb, te), for every head of the group; each head's
 * normalized output goes to its o_s[s], its log2 LSE to lse_s[s] (−inf and o = 0 when the split
 * saw no key). */
static int page_split(const struct dctx *x, struct ws *w, int s, int tb, int te, uint64_t st[2])
{
	int d = x->d, bk = x->bk;

	for (int k = 0; k < w->nh; k++) {
		struct head *h = &w->h[k];
		memset(h->o_s + (size_t)s * (size_t)d, 0, sizeof(float) * (size_t)d);
		h->m = -INFINITY;
		h->l = 0.0f;
		h->lq = 0.0f;
	}
	for (int j = tb; j < te; j++) {
		int t0 = j * bk;
		int row0 = t0 % BD_PAGE_TOKENS;
		load_page(x, w, x->kv->block_table[t0 / BD_PAGE_TOKENS]);
		for (int i = 0; i < bk; i++)
			/* sink tokens are read from BF16; their page copy is masked (§8) */
			w->masked[i] = x->cfg->sink && t0 + i < BD_SINK_TOKENS;
		for (int k = 0; k < w->nh; k++) {
			struct head *h = &w->h[k];
			int r = tile_step(x, w, h, h->o_s + (size_t)s * (size_t)d, row0, st);
			if (r < 0)
				return r;
		}
	}

	for (int k = 0; k < w->nh; k++) {
		struct head *h = &w->h[k];
		float *o = h->o_s + (size_t)s * (size_t)d;
		if (h->l == 0.0f) {
			memset(o, 0, sizeof(float) * (size_t)d);
			h->lse_s[s] = -INFINITY;
			continue;
		}
		/* the LSE is from ℓ under either normalization; the quantized mass is positive
		 * whenever ℓ is (the block holding the maximum keeps a nonzero code) */
		float den = x->cfg->p_norm == BD_NORM_QMASS && h->lq > 0.0f ? h->lq : h->l;
		for (int c = 0; c < d; c++)
			o[c] = o[c] / den;
		h->lse_s[s] = h->m + log2f(h->l) - x->log2c;
	}
	return 0;
}

/* Step 4: the BF16 partial of head h over the sink rows (with cfg->sink) and the recent rows,
 * plain FP32 softmax in the exp2 domain. Values are the slot's V rows (GQA) or its latent K
 * rows (MLA). */
static void bf16_partial(const struct dctx *x, struct ws *w, const struct head *h, float *ret_o,
			 float *ret_lse)
{
	const struct bd_kv_view *kv = x->kv;
	void *slot = (void *)kv->slot;
	int n = kv->n_tokens, d = x->d, dv = x->dv;
	const bd_bf16 *krows[BD_SINK_TOKENS + BD_RECENT_TOKENS];
	const bd_bf16 *vrows[BD_SINK_TOKENS + BD_RECENT_TOKENS];
	int cnt = bd_slot_rows(kv->lay, slot, kv->layer, kv->kv_head, n, x->n_full, x->cfg->sink, d,
			       dv, krows, vrows);

	memset(ret_o, 0, sizeof(float) * (size_t)d);
	if (cnt == 0) {
		*ret_lse = -INFINITY;
		return;
	}

	float m = -INFINITY;
	for (int i = 0; i < cnt; i++) {
		float acc = 0.0f;
		for (int c = 0; c < d; c++)
			acc = acc + h->qbf[c] * bd_bf16_to_f32(krows[i][c]);
		if (x->mla) {
			float accr = 0.0f;
			for (int c = 0; c < x->dr; c++)
				accr = accr + h->qr[c] * bd_bf16_to_f32(vrows[i][c]);
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

/* Steps 1–5 for the w->nh query heads q [nh][d] (q_r [nh][dr] for MLA, else NULL): combined
 * outputs (still in the cache's value space) in ret_o [nh][d], LSEs in ret_lse [nh]. */
static int decode_group(const struct dctx *x, struct ws *w, const float *q, const float *q_r,
			float *ret_o, float *ret_lse, uint64_t st[2])
{
	int ns = x->dp->n_splits, d = x->d, r;

	for (int k = 0; k < w->nh; k++) {
		r = prep_query(x, &w->h[k], q + (size_t)k * (size_t)d,
			       q_r ? q_r + (size_t)k * (size_t)x->dr : NULL);
		if (r < 0)
			return r;
	}

	for (int s = 0; s < ns; s++) {
		int tb, te;
		bd_split_tiles(x->n_tiles, ns, s, &tb, &te);
		r = page_split(x, w, s, tb, te, st);
		if (r < 0)
			return r;
	}
	for (int k = 0; k < w->nh; k++) {
		struct head *h = &w->h[k];
		bf16_partial(x, w, h, h->o_s + (size_t)ns * (size_t)d, &h->lse_s[ns]);
		for (int s = 0; s <= ns; s++)
			if (!isfinite(h->lse_s[s]) && h->lse_s[s] != -INFINITY)
				return -EDOM; /* a BF16 logit overflowed FP32 */
		bd_lse_combine(h->o_s, h->lse_s, ns + 1, d, ret_o + (size_t)k * (size_t)d,
			       &ret_lse[k]);
	}
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

/* The common run of both decoders once their arguments are checked: nh heads into private
 * buffers, for MLA (q_r non-NULL) mapped back from the rotated, smoothed latent space, then
 * copied to the caller's (outputs only on success). */
static int run_decode(const struct bd_kvcfg *cfg, const struct dctx *x, const float *q,
		      const float *q_r, int nh, const float *mu, float *ret_o, float *ret_lse,
		      struct bd_decode_stats *stats)
{
	struct ws w = { .loaded = -1 };
	uint64_t st[2] = { 0, 0 };
	size_t d = (size_t)x->d;
	int r;

	pthread_once(&lut_once, lut_init);
	float *out = malloc(sizeof(float) * (size_t)nh * d);
	float *lse = malloc(sizeof(float) * (size_t)nh);
	if (!out || !lse) {
		free(out);
		free(lse);
		return -ENOMEM;
	}
	r = ws_alloc(&w, x, nh);
	if (r < 0)
		goto out;
	r = decode_group(x, &w, q, q_r, out, lse, st);
	if (r < 0)
		goto out;
	for (int h = 0; q_r && h < nh; h++) {
		/* o' lives in the rotated, smoothed latent space H(c − μ): map back, o = H o' + μ
		 * (H is symmetric and orthonormal, so its own inverse) */
		float *oh = out + (size_t)h * d;
		if (cfg->hadamard) {
			r = bd_fwht(oh, x->d);
			if (r < 0)
				goto out;
		}
		for (size_t c = 0; c < d; c++)
			oh[c] = cfg->smoothing && mu ? oh[c] + mu[c] : oh[c];
	}

	memcpy(ret_o, out, sizeof(float) * (size_t)nh * d);
	if (ret_lse)
		memcpy(ret_lse, lse, sizeof(float) * (size_t)nh);
	if (stats) {
		/* MLA quantizes no probabilities: its counts stay 0 (a uniform interface) */
		stats->p_blocks += st[0];
		stats->p_zero_blocks += st[1];
	}
out:
	ws_free(&w);
	free(out);
	free(lse);
	return r;
}

int bd_ref_decode_gqa(const struct bd_kvcfg *cfg, const struct bd_decode_params *dp,
		      const struct bd_kv_view *kv, const float *q, int G, float *ret_o,
		      float *ret_lse, struct bd_decode_stats *stats)
{
	struct dctx x;
	int r;

	if (!q || !ret_o || G < 1)
		return -EINVAL;
	r = ctx_init(&x, cfg, dp, kv, false);
	if (r < 0)
		return r;
	if (!bd_all_finite(q, (size_t)G * (size_t)x.d))
		return -EDOM;
	return run_decode(cfg, &x, q, NULL, G, NULL, ret_o, ret_lse, stats);
}

int bd_ref_decode_mla(const struct bd_kvcfg *cfg, const struct bd_decode_params *dp,
		      const struct bd_kv_view *kv, const float *q_c, const float *q_r, int H,
		      const float *mu, float *ret_o, float *ret_lse, struct bd_decode_stats *stats)
{
	struct dctx x;
	int r;

	if (!q_c || !q_r || !ret_o || H < 1)
		return -EINVAL;
	r = ctx_init(&x, cfg, dp, kv, true);
	if (r < 0)
		return r;
	size_t d = (size_t)x.d;
	if (!bd_all_finite(q_c, (size_t)H * d) ||
	    !bd_all_finite(q_r, (size_t)H * (size_t)x.dr) || (mu && !bd_all_finite(mu, d)))
		return -EDOM;
	return run_decode(cfg, &x, q_c, q_r, H, mu, ret_o, ret_lse, stats);
}

int bd_slot_rows(const struct bd_layout *lay, void *slot, int layer, int kv_head, int n,
		 int n_full, bool sink, int d, int dv, const bd_bf16 **ret_k,
		 const bd_bf16 **ret_v)
{
	const bd_bf16 *sk = bd_slot_sink_k(lay, slot, layer, kv_head);
	const bd_bf16 *sv = bd_slot_sink_v(lay, slot, layer, kv_head);
	const bd_bf16 *rk = bd_slot_recent_k(lay, slot, layer, kv_head);
	const bd_bf16 *rv = bd_slot_recent_v(lay, slot, layer, kv_head);
	int t_recent = n_full * BD_PAGE_TOKENS, cnt = 0;

	if (sink) {
		for (int t = 0; t < n && t < BD_SINK_TOKENS; t++) {
			ret_k[cnt] = sk + (size_t)t * (size_t)d;
			ret_v[cnt] = sv + (size_t)t * (size_t)dv;
			cnt++;
		}
		if (t_recent < BD_SINK_TOKENS)
			t_recent = BD_SINK_TOKENS;
	}
	for (int t = t_recent; t < n; t++) {
		int row = t % BD_RECENT_TOKENS;
		ret_k[cnt] = rk + (size_t)row * (size_t)d;
		ret_v[cnt] = rv + (size_t)row * (size_t)dv;
		cnt++;
	}
	return cnt;
}

void bd_split_tiles(int n_tiles, int n_splits, int s, int *ret_begin, int *ret_end)
{
	long long chunk = ((long long)n_tiles + n_splits - 1) / n_splits;
	if (chunk < 1)
		chunk = 1;
	long long tb = (long long)s * chunk, te = tb + chunk;
	*ret_begin = (int)(tb < n_tiles ? tb : n_tiles);
	*ret_end = (int)(te < n_tiles ? te : n_tiles);
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
