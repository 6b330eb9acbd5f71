/* mma_sm100.c — the CPU side of bd_mma_sm100.h: the operand packers, the block-scaled MMA
 * instruction's semantics, and the sm_100 kernel's decode built from them (paper §4,
 * NUMERICS.md §5–§8).
 *
 * The decoder follows the kernel's dataflow (one page is one tile: pack, S^T MMAs, softmax per
 * key and head, P packed, O^T MMAs, o rescaled in FP32) with the reference decoder's FP32
 * operations, so its results equal bd_ref_decode_gqa's bit for bit: every MMA product is exact
 * and the emulated sums run in the reference's order (bd_umma_emulate).
 */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant/bd_mma_sm100.h"

#define LOG2E 1.4426950408889634f

/* ---- packing -------------------------------------------------------------------------------- */

int bd_umma_sizes(const struct bd_layout *lay, struct bd_umma_sizes *ret)
{
	if (!lay || !ret)
		return -EINVAL;
	if ((lay->fmt != BD_PAGE_NVFP4 && lay->fmt != BD_PAGE_MXFP4) || lay->d_rope != 0 ||
	    (lay->d != 64 && lay->d != 128))
		return -EOPNOTSUPP;
	const size_t rb = (size_t)lay->d / 2;
	*ret = (struct bd_umma_sizes){
		.k_tile = BD_UMMA_M * rb,
		.k_sf = bd_umma_sf_bytes((uint32_t)(lay->d / lay->block)),
		.q_tile = BD_UMMA_N * rb,
		.v_tile = BD_UMMA_M * BD_UMMA_PV_ROW,
		.v_sf = bd_umma_sf_bytes((uint32_t)(BD_PAGE_TOKENS / lay->block)),
		.p_tile = BD_UMMA_N * BD_UMMA_PV_ROW,
	};
	return 0;
}

/* rows rows of rb code bytes and nsc scale bytes each, row-major (a page region), into an
 * operand tile and its scale-factor tile of `tile_bytes`, `sf_bytes` (zeroed first) */
static void pack_rows(const uint8_t *codes, const uint8_t *scales, int rows, int rb, int nsc,
		      uint8_t *tile, size_t tile_bytes, uint8_t *sf, size_t sf_bytes)
{
	memset(tile, 0, tile_bytes);
	memset(sf, 0, sf_bytes);
	for (int r = 0; r < rows; r++) {
		for (int j = 0; j < rb; j++)
			tile[bd_umma_off((uint32_t)rb, (uint32_t)r, (uint32_t)j)] = codes[r * rb + j];
		for (int s = 0; s < nsc; s++)
			sf[bd_umma_sf_off((uint32_t)r, (uint32_t)s)] = scales[r * nsc + s];
	}
}

/* The K (v = false) or V region of a page-head into its A tile and scale tile. */
static int pack_page(const struct bd_layout *lay, const uint8_t *head, bool v, uint8_t *ret_tile,
		     uint8_t *ret_sf)
{
	struct bd_umma_sizes z;
	int r = bd_umma_sizes(lay, &z);

	if (r < 0)
		return r;
	if (v)
		pack_rows(head + lay->v_codes_off, head + lay->v_scales_off, lay->d, BD_UMMA_PV_ROW,
			  BD_PAGE_TOKENS / lay->block, ret_tile, z.v_tile, ret_sf, z.v_sf);
	else
		pack_rows(head + lay->k_codes_off, head + lay->k_scales_off, BD_PAGE_TOKENS,
			  lay->d / 2, lay->d / lay->block, ret_tile, z.k_tile, ret_sf, z.k_sf);
	return 0;
}

int bd_umma_pack_k(const struct bd_layout *lay, const uint8_t *head, uint8_t *ret_tile,
		   uint8_t *ret_sf)
{
	return pack_page(lay, head, false, ret_tile, ret_sf);
}

int bd_umma_pack_v(const struct bd_layout *lay, const uint8_t *head, uint8_t *ret_tile,
		   uint8_t *ret_sf)
{
	return pack_page(lay, head, true, ret_tile, ret_sf);
}

int bd_umma_pack_query(const struct bd_layout *lay, const struct bd_qquant *qq, int G,
		       uint8_t *ret_tile, uint8_t *ret_sf)
{
	struct bd_umma_sizes z;
	int r = bd_umma_sizes(lay, &z);

	if (r < 0)
		return r;
	const enum bd_fp4_format fmt = lay->fmt == BD_PAGE_MXFP4 ? BD_FP4_MXFP4 : BD_FP4_NVFP4;
	const uint32_t rb = (uint32_t)lay->d / 2, nsc = (uint32_t)(lay->d / lay->block);
	if (!qq || G < 1 || G > 8)
		return -EINVAL;
	for (int h = 0; h < G; h++)
		if (qq[h].d != lay->d || qq[h].fmt != fmt || qq[h].nterms < 1 || qq[h].nterms > 2)
			return -EINVAL;
	memset(ret_tile, 0, z.q_tile);
	memset(ret_sf, 0, z.k_sf);
	for (int h = 0; h < G; h++) {
		for (int t = 0; t < qq[h].nterms; t++) {
			const uint32_t row = bd_umma_qrow((uint32_t)h, (uint32_t)t);
			for (uint32_t j = 0; j < rb; j++)
				ret_tile[bd_umma_off(rb, row, j)] = qq[h].codes[t][j];
			for (uint32_t s = 0; s < nsc; s++)
				ret_sf[bd_umma_sf_off(row, s)] = qq[h].scales[t][s];
		}
	}
	return 0;
}

void bd_umma_pack_p_row(const struct bd_layout *lay, int h, const uint8_t *codes,
			const uint8_t *scales, uint8_t *tile, uint8_t *sf)
{
	for (uint32_t j = 0; j < BD_UMMA_PV_ROW; j++)
		tile[bd_umma_off(BD_UMMA_PV_ROW, (uint32_t)h, j)] =
			(uint8_t)((codes[2 * j] & 15u) | (codes[2 * j + 1] & 15u) << 4);
	for (uint32_t s = 0; s < (uint32_t)(BD_PAGE_TOKENS / lay->block); s++)
		sf[bd_umma_sf_off((uint32_t)h, s)] = scales[s];
}

/* ---- the instruction ------------------------------------------------------------------------ */

/* Elements [64kb, 64kb + 64) of row r of an operand, times their block scales: each value
 * x̂·s is exact in FP32 (at most 6 significant bits, 2^-128 at the smallest). */
static void scaled_row(const struct bd_umma_mma *op, const uint8_t *tile, int rb,
		       const uint8_t *sf, int r, float ret[BD_UMMA_K])
{
	const int vs = op->fmt == BD_FP4_MXFP4 ? BD_MXFP4_BLOCK : BD_NVFP4_BLOCK;

	for (int i = 0; i < BD_UMMA_K; i++) {
		const uint32_t k = (uint32_t)(BD_UMMA_K * op->kb + i);
		const uint8_t sc = sf[bd_umma_sf_off((uint32_t)r, k / (uint32_t)vs)];
		const float s = op->fmt == BD_FP4_MXFP4 ? bd_ue8m0_decode(sc) : bd_e4m3_decode(sc);
		ret[i] = bd_e2m1_decode((uint8_t)bd_umma_code(tile, (uint32_t)rb, (uint32_t)r, k)) * s;
	}
}

void bd_umma_emulate(const struct bd_umma_mma *op, float *d)
{
	float a[BD_UMMA_M][BD_UMMA_K], b[BD_UMMA_K];

	for (int m = 0; m < BD_UMMA_M; m++)
		scaled_row(op, op->a, op->a_rb, op->sfa, m, a[m]);
	for (int n = 0; n < op->n; n++) {
		scaled_row(op, op->b, op->b_rb, op->sfb, n, b);
		for (int m = 0; m < BD_UMMA_M; m++) {
			/* one FP32 rounding per product (exact) and per addition, k ascending */
			float acc = op->accumulate ? d[m * op->n + n] : 0.0f;
			for (int k = 0; k < BD_UMMA_K; k++)
				acc = acc + a[m][k] * b[k];
			d[m * op->n + n] = acc;
		}
	}
}

/* ---- the kernel's decode on the CPU ---------------------------------------------------------- */

/* Fixed for one call. */
struct ectx {
	const struct bd_kvcfg *cfg;
	const struct bd_kv_view *kv;
	const struct bd_layout *lay;
	struct bd_umma_sizes z;
	struct bd_pscale ps;
	bool mx;
	int d, G, ns, n_full;
	float gamma, log2c;
};

/* One head's running state and results. */
struct ehead {
	struct bd_qquant qq;
	float qbf[BD_FWHT_MAX]; /* q' rounded to BF16: the BF16 partial's query */
	float m, l;
	float lq;               /* the quantized mass Σ s_P·P̂ (cfg->p_norm = QMASS) */
	float *o;               /* [ns + 1][d] partial outputs */
	float *lse;             /* [ns + 1] */
};

/* Scratch: the tiles of one page and query, the two accumulators, a head's logits. */
struct escratch {
	uint8_t *kt, *ksf, *qt, *qsf, *vt, *vsf, *pt, *psf;
	float ds[BD_UMMA_M * BD_UMMA_N], dv[BD_UMMA_M * BD_UMMA_N];
	float S[BD_PAGE_TOKENS], P[BD_PAGE_TOKENS];
	uint8_t code[BD_PAGE_TOKENS], scale[BD_PAGE_TOKENS / BD_NVFP4_BLOCK];
	float alpha[8];
	bool active[8];
};

/* Row i of the request's BF16 region (the sink rows, then the recent rows of the tokens past
 * the last full page, sink tokens excluded; NUMERICS.md §8) as K and V pointers; returns the
 * number of rows. With i < 0 only the count is computed. */
static int bf16_row(const struct ectx *x, int i, const bd_bf16 **ret_k, const bd_bf16 **ret_v)
{
	const int n = x->kv->n_tokens, nsink = x->cfg->sink ? (n < BD_SINK_TOKENS ? n : BD_SINK_TOKENS) : 0;
	int t0 = x->n_full * BD_PAGE_TOKENS;

	if (x->cfg->sink && t0 < BD_SINK_TOKENS)
		t0 = BD_SINK_TOKENS;
	const int rows = nsink + (n > t0 ? n - t0 : 0);
	if (i < 0)
		return rows;
	void *slot = (void *)x->kv->slot;
	const int l = x->kv->layer, h = x->kv->kv_head;
	const size_t at = i < nsink ? (size_t)i : (size_t)((t0 + i - nsink) % BD_RECENT_TOKENS);
	*ret_k = (i < nsink ? bd_slot_sink_k(x->lay, slot, l, h) : bd_slot_recent_k(x->lay, slot, l, h)) +
		 at * (size_t)x->d;
	*ret_v = (i < nsink ? bd_slot_sink_v(x->lay, slot, l, h) : bd_slot_recent_v(x->lay, slot, l, h)) +
		 at * (size_t)x->d;
	return rows;
}

/* Σ_c q[c]·k[c] in FP32, c ascending (the products of BF16 values are exact). */
static float bf16_dot(const float *q, const bd_bf16 *k, int d)
{
	float acc = 0.0f;

	for (int c = 0; c < d; c++)
		acc = acc + q[c] * bd_bf16_to_f32(k[c]);
	return acc;
}

/* Σ_i P[i]·v_i[c] over the BF16 rows in row order. */
static float bf16_pv(const struct ectx *x, const float *P, int rows, int c)
{
	const bd_bf16 *k, *v;
	float acc = 0.0f;

	for (int i = 0; i < rows; i++) {
		bf16_row(x, i, &k, &v);
		acc = acc + P[i] * bd_bf16_to_f32(v[c]);
	}
	return acc;
}

/* The BF16 partial of head e into its slot ns: FP32 softmax over the BF16 rows, each sum in
 * row (channel) order, γ·⟨q', k⟩ logits (NUMERICS.md §5, §8). S: scratch of 144 floats. */
static void bf16_part(const struct ectx *x, struct ehead *e, float *S)
{
	const bd_bf16 *k, *v;
	const int rows = bf16_row(x, -1, NULL, NULL);
	float *o = e->o + (size_t)x->ns * (size_t)x->d, m = -INFINITY, l = 0.0f;

	for (int i = 0; i < rows; i++) {
		bf16_row(x, i, &k, &v);
		S[i] = x->gamma * bf16_dot(e->qbf, k, x->d);
		m = fmaxf(m, S[i]);
	}
	for (int i = 0; i < rows; i++) {
		S[i] = exp2f(S[i] - m); /* now P_i */
		l = l + S[i];
	}
	for (int c = 0; c < x->d; c++)
		o[c] = rows ? bf16_pv(x, S, rows, c) / l : 0.0f;
	e->lse[x->ns] = rows ? m + log2f(l) : -INFINITY;
}

/* Head e's logits of the page from the S^T accumulator (NUMERICS.md §5), its online-softmax
 * step and its P row (§6): P tile row h, or a zero row when every key of the page is masked
 * for it so far (the head is then left as it was). sink0: keys 0–15 are masked. */
static int head_page(const struct ectx *x, struct escratch *w, struct ehead *e, int h, float gk,
		     bool sink0)
{
	const int nb = BD_PAGE_TOKENS / x->lay->block;
	float mt = -INFINITY;

	for (int i = 0; i < BD_PAGE_TOKENS; i++) {
		const float *row = w->ds + i * BD_UMMA_N;
		float dot = row[bd_umma_qrow((uint32_t)h, 0)] * e->qq.g[0];
		if (e->qq.nterms == 2)
			dot = dot + row[bd_umma_qrow((uint32_t)h, 1)] * e->qq.g[1];
		w->S[i] = (sink0 && i < BD_SINK_TOKENS) ? -INFINITY : (dot * gk) * x->gamma;
		if (w->S[i] != -INFINITY && !isfinite(w->S[i]))
			return -EDOM;
		mt = fmaxf(mt, w->S[i]);
	}
	const float mn = fmaxf(e->m, mt);
	w->active[h] = mn != -INFINITY;
	if (!w->active[h])
		return 0;
	w->alpha[h] = e->m == -INFINITY ? 0.0f : exp2f(e->m - mn);
	float sum = 0.0f;
	for (int i = 0; i < BD_PAGE_TOKENS; i++) {
		w->P[i] = w->S[i] == -INFINITY ? 0.0f : exp2f(w->S[i] - mn + x->log2c);
		sum = sum + w->P[i];
	}
	e->l = w->alpha[h] * e->l + sum;

	for (int b = 0; b < nb; b++) {
		const int k0 = b * x->lay->block;
		if (x->mx) {
			uint8_t packed[BD_MXFP4_BLOCK / 2];
			int r = bd_mxfp4_quantize_block(w->P + k0, BD_SCALE_STANDARD, packed, &w->scale[b]);
			if (r < 0)
				return r;
			for (int i = 0; i < BD_MXFP4_BLOCK; i++)
				w->code[k0 + i] = bd_fp4_get(packed, (size_t)i);
			continue;
		}
		float smax = -INFINITY, phat[BD_NVFP4_BLOCK];
		for (int i = k0; i < k0 + BD_NVFP4_BLOCK; i++)
			smax = fmaxf(smax, w->S[i]);
		/* p_max is the block maximum before c, exp2(max S_b − m); masked keys have P = 0 */
		const float pmax = smax == -INFINITY ? 0.0f : exp2f(smax - mn);
		bd_p_quantize_block_nvfp4(w->P + k0, pmax, &x->ps, phat, &w->scale[b]);
		for (int i = 0; i < BD_NVFP4_BLOCK; i++)
			w->code[k0 + i] = bd_e2m1_encode(phat[i]);
	}
	if (x->cfg->p_norm == BD_NORM_QMASS) {
		/* the quantized mass of the P̂ codes and scales the MMA multiplies, in key order */
		float sumq = 0.0f;
		for (int i = 0; i < BD_PAGE_TOKENS; i++) {
			const uint8_t sc = w->scale[i / x->lay->block];
			sumq = sumq + (x->mx ? bd_ue8m0_decode(sc) : bd_e4m3_decode(sc)) *
					      bd_e2m1_decode(w->code[i]);
		}
		e->lq = w->alpha[h] * e->lq + sumq;
	}
	bd_umma_pack_p_row(x->lay, h, w->code, w->scale, w->pt, w->psf);
	e->m = mn;
	return 0;
}

/* One page (tile j of the request) for every head: the kernel's two MMA groups and the
 * softmax between them; o[h] = α·o[h] + D_PV[·][h]·g_V. */
static int page_step(const struct ectx *x, struct escratch *w, struct ehead *hs, int s, int j)
{
	const struct bd_layout *lay = x->lay;
	const int32_t id = x->kv->block_table[j];
	const uint8_t *page = bd_layout_page(lay, (void *)x->kv->arena, x->kv->layer, id);
	const uint8_t *head = page + (size_t)x->kv->kv_head * lay->head_bytes;
	float g[2] = { 1.0f, 1.0f };
	const uint32_t rb = (uint32_t)x->d / 2;

	if (!x->mx)
		memcpy(g, page + lay->gscale_off + (size_t)x->kv->kv_head * sizeof(g), sizeof(g));
	bd_umma_pack_k(lay, head, w->kt, w->ksf);
	bd_umma_pack_v(lay, head, w->vt, w->vsf);
	const enum bd_fp4_format fmt = x->mx ? BD_FP4_MXFP4 : BD_FP4_NVFP4;
	for (int kb = 0; kb < x->d / BD_UMMA_K; kb++) {
		struct bd_umma_mma op = { fmt, w->kt, w->qt, (int)rb, (int)rb, w->ksf, w->qsf, kb,
					  BD_UMMA_N, kb > 0 };
		bd_umma_emulate(&op, w->ds);
	}

	memset(w->pt, 0, x->z.p_tile);
	memset(w->psf, 0, x->z.v_sf);
	for (int h = 0; h < x->G; h++) {
		int r = head_page(x, w, &hs[h], h, g[0], x->cfg->sink && j == 0);
		if (r < 0)
			return r;
	}
	for (int kb = 0; kb < BD_PAGE_TOKENS / BD_UMMA_K; kb++) {
		struct bd_umma_mma op = { fmt, w->vt, w->pt, BD_UMMA_PV_ROW, BD_UMMA_PV_ROW, w->vsf,
					  w->psf, kb, BD_UMMA_N, kb > 0 };
		bd_umma_emulate(&op, w->dv);
	}
	for (int h = 0; h < x->G; h++) {
		if (!w->active[h])
			continue;
		float *o = hs[h].o + (size_t)s * (size_t)x->d;
		for (int c = 0; c < x->d; c++)
			o[c] = w->alpha[h] * o[c] + w->dv[c * BD_UMMA_N + h] * g[1];
	}
	return 0;
}

/* Split s of the page tiles [tb, te) for every head: normalized partial and log2 LSE. */
static int split_run(const struct ectx *x, struct escratch *w, struct ehead *hs, int s, int tb,
		     int te)
{
	for (int h = 0; h < x->G; h++) {
		memset(hs[h].o + (size_t)s * (size_t)x->d, 0, sizeof(float) * (size_t)x->d);
		hs[h].m = -INFINITY;
		hs[h].l = 0.0f;
		hs[h].lq = 0.0f;
	}
	for (int j = tb; j < te; j++) {
		int r = page_step(x, w, hs, s, j);
		if (r < 0)
			return r;
	}
	for (int h = 0; h < x->G; h++) {
		float *o = hs[h].o + (size_t)s * (size_t)x->d;
		const bool empty = hs[h].l == 0.0f;
		/* ℓ or the quantized mass divides; the LSE is from ℓ */
		const float den = x->cfg->p_norm == BD_NORM_QMASS && hs[h].lq > 0.0f ? hs[h].lq : hs[h].l;
		for (int c = 0; c < x->d; c++)
			o[c] = empty ? 0.0f : o[c] / den;
		hs[h].lse[s] = empty ? -INFINITY : hs[h].m + log2f(hs[h].l) - x->log2c;
	}
	return 0;
}

/* Checks and the constants of one call. */
static int ectx_init(struct ectx *x, const struct bd_kvcfg *cfg, const struct bd_decode_params *dp,
		     const struct bd_kv_view *kv, int G)
{
	const struct bd_layout *lay = kv ? kv->lay : NULL;
	int r;

	if (!cfg || !dp || !kv || !lay || !kv->slot || G < 1)
		return -EINVAL;
	if (lay->fmt != cfg->page_fmt || kv->n_tokens < 1 || kv->layer < 0 ||
	    kv->layer >= lay->n_layers || kv->kv_head < 0 || kv->kv_head >= lay->n_kv_heads)
		return -EINVAL;
	if (dp->n_splits < 1 || !isfinite(dp->c) || !(dp->c > 0.0f) || !isfinite(dp->tau) ||
	    !(dp->tau >= 0.0f) || !isfinite(dp->softmax_scale))
		return -EINVAL;
	r = bd_umma_sizes(lay, &x->z);
	if (r < 0)
		return r;
	const bool mx = lay->fmt == BD_PAGE_MXFP4;
	if (G > 8 || dp->tile_keys != BD_PAGE_TOKENS || (cfg->query_terms != 1 && cfg->query_terms != 2) ||
	    (mx ? cfg->p_quant != BD_P_MXFP4 :
		  cfg->p_quant != BD_P_NVFP4_MAX6 && cfg->p_quant != BD_P_NVFP4_UNDERFLOW))
		return -EOPNOTSUPP;
	r = bd_kv_view_full_pages(kv, &x->n_full);
	if (r < 0)
		return r;
	const bool under = cfg->p_quant == BD_P_NVFP4_UNDERFLOW;
	const float scale = dp->softmax_scale != 0.0f ? dp->softmax_scale : 1.0f / sqrtf((float)lay->d);
	x->cfg = cfg;
	x->kv = kv;
	x->lay = lay;
	x->ps = under ? (struct bd_pscale){ dp->c, dp->tau, true } :
			(struct bd_pscale){ 1.0f, dp->tau, false };
	x->mx = mx;
	x->d = lay->d;
	x->G = G;
	x->ns = dp->n_splits;
	x->gamma = LOG2E * scale;
	x->log2c = under ? log2f(dp->c) : 0.0f;
	return 0;
}

static void scratch_free(struct escratch *w, struct ehead *hs, int G)
{
	if (w) {
		free(w->kt);
		free(w->qt);
		free(w->vt);
		free(w->pt);
		free(w);
	}
	for (int h = 0; hs && h < G; h++) {
		free(hs[h].o);
		free(hs[h].lse);
	}
	free(hs);
}

/* The tiles in four allocations (tile, then its scales). */
static struct escratch *scratch_new(const struct ectx *x)
{
	struct escratch *w = calloc(1, sizeof(*w));

	if (!w)
		return NULL;
	w->kt = malloc(x->z.k_tile + x->z.k_sf);
	w->qt = malloc(x->z.q_tile + x->z.k_sf);
	w->vt = malloc(x->z.v_tile + x->z.v_sf);
	w->pt = malloc(x->z.p_tile + x->z.v_sf);
	if (!w->kt || !w->qt || !w->vt || !w->pt) {
		scratch_free(w, NULL, 0);
		return NULL;
	}
	w->ksf = w->kt + x->z.k_tile;
	w->qsf = w->qt + x->z.q_tile;
	w->vsf = w->vt + x->z.v_tile;
	w->psf = w->pt + x->z.p_tile;
	return w;
}

/* q' = Hq (when rotating), its BF16 rounding and FP4 terms for every head, the Q tile. */
static int query_prep(const struct ectx *x, struct escratch *w, struct ehead *hs, const float *q)
{
	const int d = x->d;
	float qr[BD_FWHT_MAX];
	struct bd_qquant *qq = malloc(sizeof(*qq) * (size_t)x->G);
	int r = qq ? 0 : -ENOMEM;

	for (int h = 0; h < x->G && r == 0; h++) {
		memcpy(qr, q + (size_t)h * (size_t)d, sizeof(float) * (size_t)d);
		if (x->cfg->hadamard)
			r = bd_fwht(qr, d);
		for (int c = 0; c < d && r == 0; c++)
			hs[h].qbf[c] = bd_bf16_to_f32(bd_f32_to_bf16(qr[c]));
		if (r == 0)
			r = bd_query_quantize(qr, d, x->mx ? BD_FP4_MXFP4 : BD_FP4_NVFP4,
					      x->cfg->query_terms, &hs[h].qq);
		if (r == 0)
			qq[h] = hs[h].qq;
	}
	if (r == 0)
		r = bd_umma_pack_query(x->lay, qq, x->G, w->qt, w->qsf);
	free(qq);
	return r;
}

int bd_umma_decode_gqa(const struct bd_kvcfg *cfg, const struct bd_decode_params *dp,
		       const struct bd_kv_view *kv, const float *q, int G, float *ret_o,
		       float *ret_lse)
{
	struct ectx x;
	int r = q && ret_o ? ectx_init(&x, cfg, dp, kv, G) : -EINVAL;

	if (r < 0)
		return r;
	if (!bd_all_finite(q, (size_t)G * (size_t)x.d))
		return -EDOM;
	const size_t np = (size_t)x.ns + 1, d = (size_t)x.d;
	struct ehead *hs = calloc((size_t)G, sizeof(*hs));
	struct escratch *w = scratch_new(&x);
	float *out = malloc(sizeof(float) * (size_t)G * d), *lse = malloc(sizeof(float) * (size_t)G);
	float *bS = malloc(sizeof(float) * (BD_SINK_TOKENS + BD_RECENT_TOKENS));
	r = hs && w && out && lse && bS ? 0 : -ENOMEM;
	for (int h = 0; h < G && r == 0; h++) {
		hs[h].o = np <= SIZE_MAX / sizeof(float) / d ? malloc(sizeof(float) * np * d) : NULL;
		hs[h].lse = malloc(sizeof(float) * np);
		r = hs[h].o && hs[h].lse ? 0 : -ENOMEM;
	}
	if (r == 0)
		r = query_prep(&x, w, hs, q);

	/* split s covers tiles [s·chunk, (s+1)·chunk) clipped to the full pages (bd_attn_ref.h) */
	const long long n_tiles = x.n_full, c0 = (n_tiles + x.ns - 1) / x.ns, chunk = c0 > 1 ? c0 : 1;
	for (int s = 0; s < x.ns && r == 0; s++) {
		const long long tb = s * chunk, te = tb + chunk;
		r = split_run(&x, w, hs, s, (int)(tb < n_tiles ? tb : n_tiles),
			      (int)(te < n_tiles ? te : n_tiles));
	}
	for (int h = 0; h < G && r == 0; h++) {
		bf16_part(&x, &hs[h], bS);
		for (size_t s = 0; s < np; s++)
			if (!isfinite(hs[h].lse[s]) && hs[h].lse[s] != -INFINITY)
				r = -EDOM; /* a logit overflowed FP32 */
		if (r == 0)
			bd_lse_combine(hs[h].o, hs[h].lse, (int)np, x.d, out + (size_t)h * d, &lse[h]);
	}
	if (r == 0) {
		memcpy(ret_o, out, sizeof(float) * (size_t)G * d);
		if (ret_lse)
			memcpy(ret_lse, lse, sizeof(float) * (size_t)G);
	}
	scratch_free(w, hs, G);
	free(out);
	free(lse);
	free(bS);
	return r;
}
