/* attn_cpu.c — the CPU backend's SIMD decode attention (bd_attn_cpu.h; NUMERICS.md §5, §6,
 * §8; paper Algorithm 1).
 *
 * The orchestration mirrors attn_ref.c step for step (query preparation, split-KV over tiles,
 * the per-tile online softmax with P quantization, the BF16 partial, the combine); the vector
 * kernels it calls are bd_attn_cpu_simd.h, compiled once for AVX-512 and once for AVX2 and
 * picked at the first call from what the CPU reports. A tile's keys and values are expanded
 * once into FP32 scratch shared by the G query heads of the group, and each kernel loops over
 * the heads, so the codes are read once per KV head.
 */
#include <errno.h>
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/bd_tpool.h"
#include "quant/bd_attn_cpu.h"

#define LOG2E 1.4426950408889634f
#define N_BF16_ROWS (BD_SINK_TOKENS + BD_RECENT_TOKENS)

/* The vector kernels, one table per instruction set (shapes in bd_attn_cpu_simd.h). */
struct kern {
	int (*mask_check)(float *S, int n, int nmask);
	void (*rescale_add)(float *o, float alpha, const float *acc, float gv, int d);
	void (*expand_fp4_rows)(const uint8_t *codes, const uint8_t *scales, int block,
				const float *slut, int n, int cols, float *out);
	void (*expand_fp4_cols)(const uint8_t *codes, const uint8_t *scales, int block,
				const float *slut, int cols, int row0, int bk, float *out);
	void (*expand_bf16_rows)(const bd_bf16 *const *rows, int n, int cols, float *out);
	void (*logits)(const float *k, int n, int d, const float *q, int G, float a, float b,
		       float *S, int ss);
	float (*softmax_tile)(const float *S, int n, float log2c, float *m, float *P, float *alpha);
	void (*quant_p_nvfp4)(const float *S, const float *P, int n, float m,
			      const struct bd_pscale *ps, float *Pt, uint64_t st[2]);
	void (*quant_p_mxfp4)(const float *S, const float *P, int n, float *Pt, uint64_t st[2]);
	void (*pv_cols)(const float *v, int n, int d, const float *Pt, int ps, int G, float *acc);
	void (*pv_rows)(const float *v, int n, int d, const float *Pt, int ps, int G, float *acc);
};

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,bmi2")
#define KW 16
#define KN(x) x##_avx512
#include "quant/bd_attn_cpu_simd.h"
#undef KN
#undef KW
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define KW 8
#define KN(x) x##_avx2
#include "quant/bd_attn_cpu_simd.h"
#undef KN
#undef KW
#pragma GCC pop_options

/* Exact decode tables of the scale codes (the values bd_e4m3_decode / bd_ue8m0_decode give). */
static float lut_e2m1[16], lut_e4m3[256], lut_ue8m0[256];
static const struct kern *kern_sel;
static const char *kern_name = "ref";
static pthread_once_t init_once = PTHREAD_ONCE_INIT;

static void init(void)
{
	bd_fp4_decode_tables(lut_e2m1, lut_e4m3, lut_ue8m0);
	__builtin_cpu_init();
	/* BD_ATTN_ISA (bd_attn_cpu.h): the best path the CPU has unless one is named */
	const char *want = getenv("BD_ATTN_ISA");
	if (want && *want == 0)
		want = NULL;
	if (want && strcmp(want, "auto") != 0 && strcmp(want, "avx512") != 0 &&
	    strcmp(want, "avx2") != 0)
		return; /* "ref", or a name this build does not know: the reference */
	bool any = !want || strcmp(want, "auto") == 0;
	if ((any || strcmp(want, "avx512") == 0) && __builtin_cpu_supports("avx512f") &&
	    __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
	    __builtin_cpu_supports("avx512dq")) {
		kern_sel = &kern_avx512;
		kern_name = "avx512";
	} else if ((any || strcmp(want, "avx2") == 0) && __builtin_cpu_supports("avx2") &&
		   __builtin_cpu_supports("fma")) {
		kern_sel = &kern_avx2;
		kern_name = "avx2";
	}
}

const char *bd_attn_cpu_isa(void)
{
	pthread_once(&init_once, init);
	return kern_name;
}

int bd_attn_cpu_set_isa(const char *name)
{
	pthread_once(&init_once, init);
	if (!name)
		return -EINVAL;
	if (strcmp(name, "ref") == 0) {
		kern_sel = NULL;
		kern_name = "ref";
	} else if (strcmp(name, "avx2") == 0) {
		__builtin_cpu_init();
		if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma"))
			return -ENOTSUP;
		kern_sel = &kern_avx2;
		kern_name = "avx2";
	} else if (strcmp(name, "avx512") == 0) {
		if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
		    !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512dq"))
			return -ENOTSUP;
		kern_sel = &kern_avx512;
		kern_name = "avx512";
	} else {
		return -EINVAL;
	}
	return 0;
}

static bool fast_format(enum bd_page_format f)
{
	return f == BD_PAGE_BF16 || f == BD_PAGE_NVFP4 || f == BD_PAGE_MXFP4 ||
	       f == BD_PAGE_NVFP4_CH;
}

bool bd_attn_cpu_supported(const struct bd_kvcfg *cfg)
{
	pthread_once(&init_once, init);
	return cfg && kern_sel && fast_format(cfg->page_fmt);
}

/* What one group's decode needs, fixed for the call. */
struct job {
	const struct kern *k;
	const struct bd_kvcfg *cfg;
	const struct bd_decode_params *dp;
	const struct bd_kv_view *kv;
	const struct bd_layout *lay;
	int kv_head, G, d, bk, ns, n_full, n_tiles;
	bool fp4q;       /* FP4 pages: the page path uses the FP4 query terms (§5) */
	float gamma;     /* log2(e) · softmax_scale */
	float log2c;     /* log2(c) with underflow-aware P scaling, else 0 */
	struct bd_pscale ps;
};

/* Scratch of one group: sized for G heads of dim d, tiles of bk keys, ns splits. */
struct scratch {
	float *qp;    /* [2][G][d] the page path's query: the FP4 terms ŝq_t (without g_t) or
		       * q' in BF16 in [0] */
	float *qg;    /* [G][2] the FP4 terms' decode scales g_t */
	int *qn;      /* [G] the FP4 terms of each head */
	float *qbf;   /* [G][d] q' rounded to BF16 (the BF16 tokens' query) */
	float *kx;    /* [144][d] expanded K rows of a tile or of the BF16 tokens */
	float *vx;    /* [144][d] expanded V rows, or channel-major [d][bk] of an FP4 tile */
	float *S, *P, *Pt; /* [G][144] */
	float *acc;   /* [G][d] one tile's P̃·V */
	float *ow;    /* [G][d] the running outputs of the split being computed */
	float *m, *l, *alpha; /* [G] running max and sum, a tile's rescale factor */
	float *lq;    /* [G] running quantized mass Σ s_P·P̂ (cfg->p_norm = QMASS) */
	float *o_s;   /* [G][ns + 1][d] partial outputs */
	float *lse_s; /* [G][ns + 1] */
	const bd_bf16 *krow[N_BF16_ROWS], *vrow[N_BF16_ROWS];
	void *mem;
};

static int scratch_alloc(struct scratch *w, int G, int d, int ns)
{
	size_t D = (size_t)d, g = (size_t)G, np = (size_t)ns + 1, r = N_BF16_ROWS;
	size_t n = 3 * g * D + 2 * g + 2 * r * D + 3 * g * r + 2 * g * D + 4 * g + g * np * D +
		   g * np;
	float *p;

	if (np > SIZE_MAX / sizeof(float) / 4 / g / (D + 1))
		return -ENOMEM;
	/* one block, 64-byte aligned so that the rows start on cache lines */
	if (posix_memalign(&w->mem, 64, sizeof(float) * n) != 0)
		return -ENOMEM;
	w->qn = malloc(sizeof(int) * g);
	if (!w->qn) {
		free(w->mem);
		return -ENOMEM;
	}
	p = w->mem;
	w->qp = p, p += 2 * g * D;
	w->qbf = p, p += g * D;
	w->kx = p, p += r * D;
	w->vx = p, p += r * D;
	w->S = p, p += g * r;
	w->P = p, p += g * r;
	w->Pt = p, p += g * r;
	w->acc = p, p += g * D;
	w->ow = p, p += g * D;
	w->m = p, p += g;
	w->l = p, p += g;
	w->alpha = p, p += g;
	w->lq = p, p += g;
	w->o_s = p, p += g * np * D;
	w->lse_s = p, p += g * np;
	w->qg = p; /* last: the rows above stay 64-byte aligned */
	return 0;
}

static float round_bf16(float x)
{
	return bd_bf16_to_f32(bd_f32_to_bf16(x));
}

/* Step 1–2 for head g: q' = Hq (with cfg->hadamard), its BF16 rounding, and for FP4 pages the
 * dual-residual (or one-term) FP4 query (only when the view has full pages: the BF16 tokens
 * never use it), its terms expanded to s·x̂ in qp[t][g] and their scales g_t in qg[g][t]. The
 * terms stay apart, as in the reference: s·x̂ times an expanded key code is exact in FP32, so
 * each term's inner sum is (nearly always) exact whatever its order, and the logits equal the
 * reference's; a query folded into Σ_t (s·x̂)_t·g_t rounds per channel, and those few-ulp logit
 * errors move P across E2M1 rounding ties (a 4 ↔ 6 step of a large probability). */
static int prep_query(const struct job *j, struct scratch *w, int g, const float *q)
{
	int d = j->d, r;
	size_t gd = (size_t)j->G * (size_t)d;
	float *qr = w->qp + (size_t)g * (size_t)d, *qb = w->qbf + (size_t)g * (size_t)d;

	memcpy(qr, q, sizeof(float) * (size_t)d);
	if (j->cfg->hadamard && (r = bd_fwht(qr, d)) < 0)
		return r;
	for (int c = 0; c < d; c++)
		qb[c] = round_bf16(qr[c]);
	if (!j->fp4q || j->n_tiles == 0) {
		/* BF16 pages, or no page at all: the page path's query is q' in BF16 (or unused) */
		memcpy(qr, qb, sizeof(float) * (size_t)d);
		return 0;
	}
	struct bd_qquant qq;
	enum bd_fp4_format fmt = j->lay->fmt == BD_PAGE_MXFP4 ? BD_FP4_MXFP4 : BD_FP4_NVFP4;
	if ((r = bd_query_quantize(qr, d, fmt, j->cfg->query_terms, &qq)) < 0)
		return r;
	int blk = fmt == BD_FP4_MXFP4 ? BD_MXFP4_BLOCK : BD_NVFP4_BLOCK;
	const float *slut = fmt == BD_FP4_MXFP4 ? lut_ue8m0 : lut_e4m3;
	w->qn[g] = qq.nterms;
	for (int t = 0; t < 2; t++) {
		float *qt = qr + (size_t)t * gd;
		w->qg[2 * g + t] = t < qq.nterms ? qq.g[t] : 0.0f;
		for (int c = 0; c < d; c++) {
			float xh = lut_e2m1[bd_fp4_get(qq.codes[t < qq.nterms ? t : 0], (size_t)c)];
			qt[c] = t < qq.nterms ? slut[qq.scales[t][c / blk]] * xh : 0.0f;
		}
	}
	return 0;
}

/* Rows row0 .. row0 + bk − 1 of a token-major [128][d] part of a page head (K; V of the
 * token-major formats): BF16 values at codes, or FP4 codes at codes with their block scales at
 * scales (slut: the scale code's table), expanded to FP32 into out [bk][d]. rows: scratch for
 * bk row pointers. */
static void expand_token_rows(const struct kern *K, const struct bd_layout *lay,
			      const uint8_t *codes, const uint8_t *scales, const float *slut,
			      int row0, int bk, int d, const bd_bf16 **rows, float *out)
{
	if (lay->fmt == BD_PAGE_BF16) {
		const bd_bf16 *b = (const bd_bf16 *)(const void *)codes;
		for (int i = 0; i < bk; i++)
			rows[i] = b + (size_t)(row0 + i) * (size_t)d;
		K->expand_bf16_rows(rows, bk, d, out);
	} else {
		size_t cs = (size_t)row0 * (size_t)d / 2;
		size_t ss = (size_t)row0 * (size_t)d / (size_t)lay->block;
		K->expand_fp4_rows(codes + cs, scales + ss, lay->block, slut, bk, d, out);
	}
}

/* One tile of the page path for all G heads: keys t0 .. t0 + bk − 1 (rows row0.. of page
 * `page`); m, l, o: the heads' running max, sum and output of the split. */
static int page_tile(const struct job *j, struct scratch *w, int t0, uint64_t st[2])
{
	float *m = w->m, *l = w->l, *alpha = w->alpha, *o = w->ow;
	const struct kern *K = j->k;
	const struct bd_layout *lay = j->lay;
	int d = j->d, bk = j->bk, G = j->G, row0 = t0 % BD_PAGE_TOKENS, rs = N_BF16_ROWS;
	int32_t page = j->kv->block_table[t0 / BD_PAGE_TOKENS];
	const uint8_t *base = bd_layout_page(lay, (void *)j->kv->arena, j->kv->layer, page);
	const uint8_t *head = base + (size_t)j->kv_head * lay->head_bytes;
	const float *slut = lay->fmt == BD_PAGE_MXFP4 ? lut_ue8m0 : lut_e4m3;
	float pg[2] = { 1.0f, 1.0f };
	bool chmajor = lay->fmt == BD_PAGE_NVFP4 || lay->fmt == BD_PAGE_MXFP4;

	if (lay->fmt == BD_PAGE_NVFP4 || lay->fmt == BD_PAGE_NVFP4_CH)
		memcpy(pg, base + lay->gscale_off + (size_t)j->kv_head * 2 * sizeof(float),
		       sizeof(pg));

	/* logits (§5): inner sums, then g_K, then γ */
	expand_token_rows(K, lay, head + lay->k_codes_off, head + lay->k_scales_off, slut, row0, bk,
			  d, w->krow, w->kx);
	if (!j->fp4q) {
		K->logits(w->kx, bk, d, w->qp, G, pg[0], j->gamma, w->S, rs);
	} else {
		/* per term the inner sums (into S, then P as scratch), then, in the reference's
		 * order, dot = dot_0·g_0 (+ dot_1·g_1), S = (dot·g_K)·γ */
		size_t gd = (size_t)G * (size_t)d;
		K->logits(w->kx, bk, d, w->qp, G, 1.0f, 1.0f, w->S, rs);
		bool any2 = false;
		for (int g = 0; g < G; g++)
			any2 = any2 || w->qn[g] == 2;
		if (any2)
			K->logits(w->kx, bk, d, w->qp + gd, G, 1.0f, 1.0f, w->P, rs);
		for (int g = 0; g < G; g++) {
			float *S = w->S + (size_t)g * (size_t)rs;
			const float *S1 = w->P + (size_t)g * (size_t)rs;
			float g0 = w->qg[2 * g], g1 = w->qg[2 * g + 1];
			bool two = w->qn[g] == 2;
			for (int i = 0; i < bk; i++) {
				float dot = S[i] * g0;
				if (two)
					dot = dot + S1[i] * g1;
				S[i] = (dot * pg[0]) * j->gamma;
			}
		}
	}
	/* sink tokens are read from BF16 (§8): their page copies are masked */
	int nmask = j->cfg->sink && t0 < BD_SINK_TOKENS ? BD_SINK_TOKENS - t0 : 0;
	for (int g = 0; g < G; g++)
		if (K->mask_check(w->S + (size_t)g * (size_t)rs, bk, nmask) < 0)
			return -EDOM;

	/* online softmax and P quantization, per head (§6) */
	for (int g = 0; g < G; g++) {
		float *S = w->S + (size_t)g * (size_t)rs, *P = w->P + (size_t)g * (size_t)rs;
		float *Pt = w->Pt + (size_t)g * (size_t)rs;
		float sum = K->softmax_tile(S, bk, j->log2c, &m[g], P, &alpha[g]);
		if (sum < 0.0f) {
			alpha[g] = -1.0f; /* no key of this tile: o stays */
			memset(Pt, 0, sizeof(float) * (size_t)bk);
			continue;
		}
		l[g] = alpha[g] * l[g] + sum; /* ℓ uses the unquantized P */
		switch (j->cfg->p_quant) {
		case BD_P_FP32:
			memcpy(Pt, P, sizeof(float) * (size_t)bk);
			break;
		case BD_P_MXFP4:
			K->quant_p_mxfp4(S, P, bk, Pt, st);
			break;
		default:
			K->quant_p_nvfp4(S, P, bk, m[g], &j->ps, Pt, st);
			break;
		}
		if (j->cfg->p_norm == BD_NORM_QMASS) {
			/* the quantized mass in key order, as the reference sums it (masked keys
			 * hold P̃ = 0) */
			float sumq = 0.0f;
			for (int i = 0; i < bk; i++)
				sumq = sumq + Pt[i];
			w->lq[g] = alpha[g] * w->lq[g] + sumq;
		}
	}

	/* P̃·V, then o ← α·o + acc·g_V (g_V once per tile, after the FP32 sum) */
	if (chmajor) {
		K->expand_fp4_cols(head + lay->v_codes_off, head + lay->v_scales_off, lay->block,
				   slut, d, row0, bk, w->vx);
		K->pv_cols(w->vx, bk, d, w->Pt, rs, G, w->acc);
	} else {
		expand_token_rows(K, lay, head + lay->v_codes_off, head + lay->v_scales_off, slut,
				  row0, bk, d, w->vrow, w->vx);
		K->pv_rows(w->vx, bk, d, w->Pt, rs, G, w->acc);
	}
	for (int g = 0; g < G; g++) {
		if (alpha[g] < 0.0f)
			continue;
		K->rescale_add(o + (size_t)g * (size_t)d, alpha[g], w->acc + (size_t)g * (size_t)d,
			       pg[1], d);
	}
	return 0;
}

/* Step 3: split s of the page path, tiles [tb, te), every head of the group; normalized
 * outputs to o_s[g][s], log2 LSE to lse_s[g][s] (−inf and o = 0 for a split that saw no key). */
static int page_split(const struct job *j, struct scratch *w, int s, int tb, int te,
		      uint64_t st[2])
{
	int G = j->G, d = j->d, np = j->ns + 1, r;

	memset(w->ow, 0, sizeof(float) * (size_t)G * (size_t)d);
	for (int g = 0; g < G; g++) {
		w->m[g] = -INFINITY;
		w->l[g] = 0.0f;
		w->lq[g] = 0.0f;
	}
	for (int t = tb; t < te; t++)
		if ((r = page_tile(j, w, t * j->bk, st)) < 0)
			return r;
	for (int g = 0; g < G; g++) {
		float *os = w->o_s + ((size_t)g * (size_t)np + (size_t)s) * (size_t)d;
		const float *og = w->ow + (size_t)g * (size_t)d;
		if (w->l[g] == 0.0f) {
			memset(os, 0, sizeof(float) * (size_t)d);
			w->lse_s[(size_t)g * (size_t)np + (size_t)s] = -INFINITY;
			continue;
		}
		/* divided by ℓ or by the quantized mass; the LSE from ℓ either way */
		float den = j->cfg->p_norm == BD_NORM_QMASS && w->lq[g] > 0.0f ? w->lq[g] : w->l[g];
		for (int c = 0; c < d; c++)
			os[c] = og[c] / den;
		w->lse_s[(size_t)g * (size_t)np + (size_t)s] = w->m[g] + log2f(w->l[g]) - j->log2c;
	}
	return 0;
}

/* Step 4: the BF16 partial of every head over the sink rows (with cfg->sink) and the recent
 * rows: FP32 softmax in the exp2 domain with q' in BF16, into o_s[g][ns], lse_s[g][ns]. */
static void bf16_partial(const struct job *j, struct scratch *w)
{
	const struct kern *K = j->k;
	const struct bd_kv_view *kv = j->kv;
	void *slot = (void *)kv->slot;
	int n = kv->n_tokens, d = j->d, G = j->G, np = j->ns + 1, rs = N_BF16_ROWS;
	int cnt = bd_slot_rows(j->lay, slot, kv->layer, j->kv_head, n, j->n_full, j->cfg->sink, d,
			       d, w->krow, w->vrow);
	for (int g = 0; g < G; g++) {
		float *os = w->o_s + ((size_t)g * (size_t)np + (size_t)j->ns) * (size_t)d;
		memset(os, 0, sizeof(float) * (size_t)d);
		w->lse_s[(size_t)g * (size_t)np + (size_t)j->ns] = -INFINITY;
	}
	if (cnt == 0)
		return;

	int cpad = (cnt + 15) / 16 * 16;
	K->expand_bf16_rows(w->krow, cnt, d, w->kx);
	K->expand_bf16_rows(w->vrow, cnt, d, w->vx);
	/* padding keys to a multiple of 16: zero rows, their logits replaced by −inf below */
	memset(w->kx + (size_t)cnt * (size_t)d, 0,
	       sizeof(float) * (size_t)(cpad - cnt) * (size_t)d);
	K->logits(w->kx, cpad, d, w->qbf, G, 1.0f, j->gamma, w->S, rs);
	for (int g = 0; g < G; g++) {
		float *S = w->S + (size_t)g * (size_t)rs, *P = w->P + (size_t)g * (size_t)rs;
		float m = -INFINITY, alpha;
		for (int i = cnt; i < cpad; i++)
			S[i] = -INFINITY;
		float l = K->softmax_tile(S, cpad, 0.0f, &m, P, &alpha);
		float *os = w->o_s + ((size_t)g * (size_t)np + (size_t)j->ns) * (size_t)d;
		K->pv_rows(w->vx, cnt, d, P, rs, 1, os);
		for (int c = 0; c < d; c++)
			os[c] = os[c] / l;
		w->lse_s[(size_t)g * (size_t)np + (size_t)j->ns] = m + log2f(l);
	}
}

/* Steps 1–5 for KV head j->kv_head: q [G][d], outputs ret_o [G][d], ret_lse [G]. */
static int decode_group(const struct job *j, struct scratch *w, const float *q, float *ret_o,
			float *ret_lse, uint64_t st[2])
{
	int G = j->G, d = j->d, ns = j->ns, np = ns + 1, r;

	for (int g = 0; g < G; g++)
		if ((r = prep_query(j, w, g, q + (size_t)g * (size_t)d)) < 0)
			return r;
	for (int s = 0; s < ns; s++) {
		int tb, te;
		bd_split_tiles(j->n_tiles, ns, s, &tb, &te);
		if ((r = page_split(j, w, s, tb, te, st)) < 0)
			return r;
	}
	bf16_partial(j, w);
	for (int g = 0; g < G; g++) {
		const float *ls = w->lse_s + (size_t)g * (size_t)np;
		for (int s = 0; s <= ns; s++)
			if (!isfinite(ls[s]) && ls[s] != -INFINITY)
				return -EDOM; /* a BF16 logit overflowed FP32 */
		bd_lse_combine(w->o_s + (size_t)g * (size_t)np * (size_t)d, ls, np, d,
			       ret_o + (size_t)g * (size_t)d, &ret_lse[g]);
	}
	return 0;
}

/* The reference decoder's checks of a GQA call (bd_decode_check), d a multiple of 32, and the
 * constants. */
static int job_init(struct job *j, const struct bd_kvcfg *cfg, const struct bd_decode_params *dp,
		    const struct bd_kv_view *kv, int G)
{
	const struct bd_layout *lay;
	int n_full, r;

	if (G < 1 || bd_decode_check(cfg, dp, kv, false) < 0)
		return -EINVAL;
	lay = kv->lay;
	if (lay->d % 32 != 0)
		return -EINVAL;
	bool fp4q = lay->fmt == BD_PAGE_NVFP4 || lay->fmt == BD_PAGE_MXFP4;
	if ((r = bd_kv_view_full_pages(kv, &n_full)) < 0)
		return r;

	float scale = dp->softmax_scale != 0.0f ? dp->softmax_scale : 1.0f / sqrtf((float)lay->d);
	bool uaware = cfg->p_quant == BD_P_NVFP4_UNDERFLOW;
	*j = (struct job){
		.k = kern_sel,
		.cfg = cfg,
		.dp = dp,
		.kv = kv,
		.lay = lay,
		.kv_head = kv->kv_head,
		.G = G,
		.d = lay->d,
		.bk = dp->tile_keys,
		.ns = dp->n_splits,
		.n_full = n_full,
		.n_tiles = n_full * BD_PAGE_TOKENS / dp->tile_keys,
		.fp4q = fp4q,
		.gamma = LOG2E * scale,
		.log2c = uaware ? log2f(dp->c) : 0.0f,
		.ps = uaware ? (struct bd_pscale){ dp->c, dp->tau, true } :
			       (struct bd_pscale){ 1.0f, dp->tau, false },
	};
	return 0;
}

/* ---- threads over the KV heads of a call ---------------------------------------------------
 * A call's groups are independent (each has its own query heads, pages and outputs), so a
 * call long enough to pay for the hand-off shares them out over the caller's pool: one task
 * per thread, each taking groups until none is left. Each group's arithmetic is the
 * single-threaded one, so the result does not depend on the thread count. */

/* a call is shared out when it has at least this many keys over its groups */
#define POOL_MIN_KEYS 3072

struct batch {
	const struct job *j0;
	const float *q;
	float *o, *lse;
	int n_heads, next, rc, pending;
	uint64_t st[2];
};

/* Take groups of b until none is left: each with its own scratch, errors and counters into b. */
static void batch_run(struct batch *b)
{
	struct scratch w;
	uint64_t st[2] = { 0, 0 };
	int rc = 0, h;

	if (scratch_alloc(&w, b->j0->G, b->j0->d, b->j0->ns) < 0) {
		__atomic_store_n(&b->rc, -ENOMEM, __ATOMIC_RELAXED);
		return;
	}
	size_t gd = (size_t)b->j0->G * (size_t)b->j0->d;
	while (rc == 0 && (h = __atomic_fetch_add(&b->next, 1, __ATOMIC_RELAXED)) < b->n_heads) {
		struct job j = *b->j0;
		j.kv_head = b->j0->kv_head + h;
		rc = decode_group(&j, &w, b->q + (size_t)h * gd, b->o + (size_t)h * gd,
				  b->lse + (size_t)h * (size_t)j.G, st);
	}
	free(w.mem);
	free(w.qn);
	if (rc < 0)
		__atomic_store_n(&b->rc, rc, __ATOMIC_RELAXED);
	__atomic_fetch_add(&b->st[0], st[0], __ATOMIC_RELAXED);
	__atomic_fetch_add(&b->st[1], st[1], __ATOMIC_RELAXED);
}

static void batch_task(void *arg, int t)
{
	(void)t;
	batch_run(arg);
}

/* Decode the batch's groups, on the pool when it pays, else on this thread. */
static void batch_decode(struct batch *b, int n_tokens, struct bd_tpool *pool)
{
	int nt = bd_tpool_threads(pool);
	if (b->n_heads < 2 || nt < 2 || (long long)n_tokens * b->n_heads < POOL_MIN_KEYS) {
		batch_run(b);
		return;
	}
	bd_tpool_run(pool, batch_task, b, nt < b->n_heads ? nt : b->n_heads);
}

int bd_attn_cpu_decode_gqa(const struct bd_kvcfg *cfg, const struct bd_decode_params *dp,
			   const struct bd_kv_view *kv, int n_kv_heads, const float *q, int G,
			   float *ret_o, float *ret_lse, struct bd_decode_stats *stats,
			   struct bd_tpool *pool)
{
	struct job j;
	uint64_t st[2] = { 0, 0 };
	int r;

	pthread_once(&init_once, init);
	if (!cfg || !kv || !kv->lay || !q || !ret_o || G < 1 || n_kv_heads < 1 ||
	    kv->kv_head < 0 || n_kv_heads > kv->lay->n_kv_heads - kv->kv_head)
		return -EINVAL;
	size_t d = (size_t)kv->lay->d, gd = (size_t)G * d;
	if (!kern_sel || !fast_format(cfg->page_fmt) || kv->lay->d_rope != 0) {
		/* no SIMD path: the reference decoder, group by group, outputs only on success */
		struct bd_decode_stats s0 = { 0, 0 };
		float *o = malloc(sizeof(float) * gd * (size_t)n_kv_heads);
		float *lse = malloc(sizeof(float) * (size_t)G * (size_t)n_kv_heads);
		r = o && lse ? 0 : -ENOMEM;
		for (int h = 0; h < n_kv_heads && r == 0; h++) {
			struct bd_kv_view v = *kv;
			v.kv_head = kv->kv_head + h;
			r = bd_ref_decode_gqa(cfg, dp, &v, q + (size_t)h * gd, G, o + (size_t)h * gd,
					      lse + (size_t)h * (size_t)G, &s0);
		}
		if (r == 0) {
			memcpy(ret_o, o, sizeof(float) * gd * (size_t)n_kv_heads);
			if (ret_lse)
				memcpy(ret_lse, lse, sizeof(float) * (size_t)G * (size_t)n_kv_heads);
			if (stats) {
				stats->p_blocks += s0.p_blocks;
				stats->p_zero_blocks += s0.p_zero_blocks;
			}
		}
		free(o);
		free(lse);
		return r;
	}
	if ((r = job_init(&j, cfg, dp, kv, G)) < 0)
		return r;
	if (!bd_all_finite(q, gd * (size_t)n_kv_heads))
		return -EDOM;
	float *o = malloc(sizeof(float) * gd * (size_t)n_kv_heads);
	float *lse = malloc(sizeof(float) * (size_t)G * (size_t)n_kv_heads);
	if (!o || !lse) {
		free(o);
		free(lse);
		return -ENOMEM;
	}
	struct batch b = { .j0 = &j, .q = q, .o = o, .lse = lse, .n_heads = n_kv_heads };
	batch_decode(&b, kv->n_tokens, pool);
	r = b.rc;
	st[0] = b.st[0];
	st[1] = b.st[1];
	if (r == 0) {
		memcpy(ret_o, o, sizeof(float) * gd * (size_t)n_kv_heads);
		if (ret_lse)
			memcpy(ret_lse, lse, sizeof(float) * (size_t)G * (size_t)n_kv_heads);
		if (stats) {
			stats->p_blocks += st[0];
			stats->p_zero_blocks += st[1];
		}
	}
	free(o);
	free(lse);
	return r;
}
