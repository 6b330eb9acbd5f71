/* layout.c — page and slot geometry, the KV write path and promotion (bd_layout.h).
 *
 * Every byte a page or slot holds is placed here; the decoders and kernels only read what this
 * file writes. Quantization goes through bd_fp4.h so that the page bytes are exactly what the
 * NUMERICS.md quantizers produce.
 */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant/bd_layout.h"
#include "quant/bd_kvemul.h"

/* ---- checked size arithmetic ------------------------------------------------------------ */

static size_t mul_z(size_t a, size_t b, bool *ovf)
{
	size_t r;

	if (__builtin_mul_overflow(a, b, &r)) {
		*ovf = true;
		return 0;
	}
	return r;
}

static size_t add_z(size_t a, size_t b, bool *ovf)
{
	size_t r;

	if (__builtin_add_overflow(a, b, &r)) {
		*ovf = true;
		return 0;
	}
	return r;
}

static size_t align_z(size_t x, size_t a, bool *ovf)
{
	size_t r = add_z(x, a - 1, ovf);

	return r - r % a;
}

/* Place a region of `bytes` at the cursor (already aligned), then advance the cursor to the
 * next region boundary. */
static void place(size_t *cursor, size_t bytes, size_t *ret_off, size_t *ret_bytes, bool *ovf)
{
	*ret_off = *cursor;
	*ret_bytes = bytes;
	*cursor = align_z(add_z(*cursor, bytes, ovf), BD_REGION_ALIGN, ovf);
}

/* ---- geometry ----------------------------------------------------------------------------- */

int bd_layout_init(struct bd_layout *ret, enum bd_page_format fmt, int n_layers, int n_kv_heads,
		   int d, int d_rope, size_t n_pages)
{
	struct bd_layout l = { 0 };
	size_t kc, ks, vc, vs, D, R, cur = 0;
	bool ovf = false;

	if (!ret || (int)fmt < 0 || fmt >= BD_PAGE_FORMAT_COUNT || n_layers < 1 ||
	    n_kv_heads < 1 || d < 32 || d % 32 != 0 || d > BD_FWHT_MAX || d_rope < 0 ||
	    d_rope % 16 != 0 || n_pages < 1)
		return -EINVAL;
	/* MLA: one latent head, and only the formats Algorithm 2 has a kernel for */
	if (d_rope > 0 && (n_kv_heads != 1 || (fmt != BD_PAGE_BF16 && fmt != BD_PAGE_NVFP4 &&
					       fmt != BD_PAGE_MXFP4)))
		return -EINVAL;

	l.fmt = fmt;
	l.n_layers = n_layers;
	l.n_kv_heads = n_kv_heads;
	l.d = d;
	l.d_rope = d_rope;
	l.dv = d_rope > 0 ? d_rope : d;
	l.block = fmt == BD_PAGE_MXFP4 ? BD_MXFP4_BLOCK :
		  (fmt == BD_PAGE_NVFP4 || fmt == BD_PAGE_NVFP4_CH) ? BD_NVFP4_BLOCK : 0;

	D = (size_t)d;
	R = (size_t)d_rope;
	switch (fmt) {
	case BD_PAGE_NVFP4:
	case BD_PAGE_MXFP4:
		kc = BD_PAGE_TOKENS * D / 2;
		ks = BD_PAGE_TOKENS * D / (size_t)l.block;
		/* V blocks run along tokens: channel-major rows of 128 tokens */
		vc = D * BD_PAGE_TOKENS / 2;
		vs = D * BD_PAGE_TOKENS / (size_t)l.block;
		break;
	case BD_PAGE_NVFP4_CH:
		kc = BD_PAGE_TOKENS * D / 2;
		ks = BD_PAGE_TOKENS * D / BD_NVFP4_BLOCK;
		vc = kc;
		vs = ks;
		break;
	case BD_PAGE_FP8:
		kc = BD_PAGE_TOKENS * D;
		ks = 0;
		vc = BD_PAGE_TOKENS * D;
		vs = 0;
		break;
	case BD_PAGE_BF16:
	default:
		kc = BD_PAGE_TOKENS * D * sizeof(bd_bf16);
		ks = 0;
		vc = BD_PAGE_TOKENS * D * sizeof(bd_bf16);
		vs = 0;
		break;
	}
	if (d_rope > 0) {
		/* the V-codes region holds the BF16 positional part; MLA has no V */
		vc = mul_z(BD_PAGE_TOKENS * sizeof(bd_bf16), R, &ovf);
		vs = 0;
	}

	place(&cur, kc, &l.k_codes_off, &l.k_codes_bytes, &ovf);
	place(&cur, ks, &l.k_scales_off, &l.k_scales_bytes, &ovf);
	place(&cur, vc, &l.v_codes_off, &l.v_codes_bytes, &ovf);
	place(&cur, vs, &l.v_scales_off, &l.v_scales_bytes, &ovf);
	l.head_bytes = cur; /* already a multiple of BD_REGION_ALIGN */

	l.gscale_off = mul_z((size_t)n_kv_heads, l.head_bytes, &ovf);
	l.page_bytes = align_z(add_z(l.gscale_off,
				     mul_z(2 * sizeof(float), (size_t)n_kv_heads, &ovf), &ovf),
			       BD_PAGE_ALIGN, &ovf);
	l.n_pages = n_pages;
	l.layer_stride = mul_z(n_pages, l.page_bytes, &ovf);
	l.arena_bytes = mul_z((size_t)n_layers, l.layer_stride, &ovf);

	cur = 0;
	l.slot_sink_k_off = cur;
	cur = align_z(add_z(cur, BD_SINK_TOKENS * D * sizeof(bd_bf16), &ovf), BD_REGION_ALIGN,
		      &ovf);
	l.slot_sink_v_off = cur;
	cur = align_z(add_z(cur, mul_z(BD_SINK_TOKENS * sizeof(bd_bf16), (size_t)l.dv, &ovf),
			    &ovf),
		      BD_REGION_ALIGN, &ovf);
	l.slot_recent_k_off = cur;
	cur = align_z(add_z(cur, BD_RECENT_TOKENS * D * sizeof(bd_bf16), &ovf), BD_REGION_ALIGN,
		      &ovf);
	l.slot_recent_v_off = cur;
	cur = add_z(cur, mul_z(BD_RECENT_TOKENS * sizeof(bd_bf16), (size_t)l.dv, &ovf), &ovf);
	l.slot_head_bytes = align_z(cur, BD_PAGE_ALIGN, &ovf);
	l.slot_bytes = mul_z(mul_z((size_t)n_layers, (size_t)n_kv_heads, &ovf), l.slot_head_bytes,
			     &ovf);

	if (ovf)
		return -EOVERFLOW;
	*ret = l;
	return 0;
}

/* ---- slots -------------------------------------------------------------------------------- */

static bool head_ok(const struct bd_layout *lay, int layer, int kv_head)
{
	return layer >= 0 && layer < lay->n_layers && kv_head >= 0 && kv_head < lay->n_kv_heads;
}

/* Region `off` of (layer, kv_head) in a slot, or NULL for a bad index. */
static bd_bf16 *slot_region(const struct bd_layout *lay, void *slot, int layer, int kv_head,
			    size_t off)
{
	size_t head;

	if (!lay || !slot || !head_ok(lay, layer, kv_head))
		return NULL;
	head = (size_t)layer * (size_t)lay->n_kv_heads + (size_t)kv_head;
	return (bd_bf16 *)((uint8_t *)slot + head * lay->slot_head_bytes + off);
}

bd_bf16 *bd_slot_sink_k(const struct bd_layout *lay, void *slot, int layer, int kv_head)
{
	return slot_region(lay, slot, layer, kv_head, lay ? lay->slot_sink_k_off : 0);
}

bd_bf16 *bd_slot_sink_v(const struct bd_layout *lay, void *slot, int layer, int kv_head)
{
	return slot_region(lay, slot, layer, kv_head, lay ? lay->slot_sink_v_off : 0);
}

bd_bf16 *bd_slot_recent_k(const struct bd_layout *lay, void *slot, int layer, int kv_head)
{
	return slot_region(lay, slot, layer, kv_head, lay ? lay->slot_recent_k_off : 0);
}

bd_bf16 *bd_slot_recent_v(const struct bd_layout *lay, void *slot, int layer, int kv_head)
{
	return slot_region(lay, slot, layer, kv_head, lay ? lay->slot_recent_v_off : 0);
}

/* ---- KV write path (NUMERICS.md §3) ------------------------------------------------------- */

static bool bf16_finite(bd_bf16 h)
{
	return (h & 0x7f80u) != 0x7f80u;
}

static bool is_pow2(int n)
{
	return n > 0 && (n & (n - 1)) == 0;
}

int bd_kv_write_token(const struct bd_layout *lay, const struct bd_kvcfg *cfg, void *slot,
		      int layer, int kv_head, int pos, const float *k, const float *v,
		      const float *mu)
{
	float kp[BD_FWHT_MAX];
	bd_bf16 kb[BD_FWHT_MAX];
	bd_bf16 *rk, *rv, *sk, *sv;
	size_t d, dv, row;

	if (!lay || !cfg || !slot || !k || !v || pos < 0 || !head_ok(lay, layer, kv_head) ||
	    lay->d < 1 || lay->d > BD_FWHT_MAX || lay->dv < 1)
		return -EINVAL;
	if (cfg->hadamard && !is_pow2(lay->d))
		return -EINVAL;
	d = (size_t)lay->d;
	dv = (size_t)lay->dv;
	if (!bd_all_finite(k, d) || !bd_all_finite(v, dv) || (mu && !bd_all_finite(mu, d)))
		return -EDOM;

	for (size_t i = 0; i < d; i++)
		kp[i] = cfg->smoothing && mu ? k[i] - mu[i] : k[i];
	/* finite inputs can still overflow in k − μ or inside the butterflies */
	if (!bd_all_finite(kp, d))
		return -EDOM;
	if (cfg->hadamard) {
		int r = bd_fwht(kp, lay->d);

		if (r < 0)
			return r;
		if (!bd_all_finite(kp, d))
			return -EDOM;
	}
	for (size_t i = 0; i < d; i++) {
		kb[i] = bd_f32_to_bf16(kp[i]);
		if (!bf16_finite(kb[i]))
			return -EDOM; /* rounds past the BF16 range */
	}
	for (size_t i = 0; i < dv; i++)
		if (!bf16_finite(bd_f32_to_bf16(v[i])))
			return -EDOM;

	row = (size_t)(pos % BD_RECENT_TOKENS);
	rk = bd_slot_recent_k(lay, slot, layer, kv_head) + row * d;
	rv = bd_slot_recent_v(lay, slot, layer, kv_head) + row * dv;
	memcpy(rk, kb, d * sizeof(*kb));
	for (size_t i = 0; i < dv; i++)
		rv[i] = bd_f32_to_bf16(v[i]);
	if (pos < BD_SINK_TOKENS) {
		sk = bd_slot_sink_k(lay, slot, layer, kv_head) + (size_t)pos * d;
		sv = bd_slot_sink_v(lay, slot, layer, kv_head) + (size_t)pos * dv;
		memcpy(sk, rk, d * sizeof(*rk));
		memcpy(sv, rv, dv * sizeof(*rv));
	}
	return 0;
}

/* ---- page write and read ------------------------------------------------------------------ */

/* Largest |x| of n BF16 values, or -1 when one is non-finite. */
static float bf16_amax(const bd_bf16 *x, size_t n)
{
	float amax = 0.0f;

	for (size_t i = 0; i < n; i++) {
		float a;

		if (!bf16_finite(x[i]))
			return -1.0f;
		a = fabsf(bd_bf16_to_f32(x[i]));
		if (a > amax)
			amax = a;
	}
	return amax;
}

/* One FP4 block of `block` values (16: NVFP4 with g, 32: MXFP4). */
static int quant_block(int block, const float *x, float g, enum bd_scale_rule rule,
		       uint8_t *codes, uint8_t *scale)
{
	if (block == BD_NVFP4_BLOCK)
		return bd_nvfp4_quantize_block(x, g, rule, codes, scale);
	return bd_mxfp4_quantize_block(x, rule, codes, scale);
}

static void dequant_block(int block, const uint8_t *codes, uint8_t scale, float g, float *ret_x)
{
	if (block == BD_NVFP4_BLOCK)
		bd_nvfp4_dequantize_block(codes, scale, g, ret_x);
	else
		bd_mxfp4_dequantize_block(codes, scale, ret_x);
}

/* The FP4 blocks of x[128][cols] along one axis: `rows` rows of n values, value i of row r at
 * element r·rs + i·es of x; row r's codes at byte r·n/2 of its region, its block scales at
 * r·(n/block). Token-major (NUMERICS.md §3: keys, and both K and V of trtllm-nvfp4): a row is
 * a token's channels. Channel-major (§4: values): a row is a channel's 128 tokens. */
struct fp4_axis {
	size_t rows, n, rs, es;
};

static struct fp4_axis token_major(size_t cols)
{
	return (struct fp4_axis){ BD_PAGE_TOKENS, cols, cols, 1 };
}

static struct fp4_axis channel_major(size_t cols)
{
	return (struct fp4_axis){ cols, BD_PAGE_TOKENS, 1, cols };
}

static int quant_axis(int block, struct fp4_axis a, const bd_bf16 *x, float g,
		      enum bd_scale_rule rule, uint8_t *codes, uint8_t *scales)
{
	size_t nb = a.n / (size_t)block;
	float buf[BD_MXFP4_BLOCK];

	for (size_t r = 0; r < a.rows; r++) {
		for (size_t b = 0; b < nb; b++) {
			const bd_bf16 *src = x + r * a.rs + b * (size_t)block * a.es;
			int rc;

			for (int i = 0; i < block; i++)
				buf[i] = bd_bf16_to_f32(src[(size_t)i * a.es]);
			rc = quant_block(block, buf, g, rule,
					 codes + r * (a.n / 2) + b * (size_t)block / 2, scales + r * nb + b);
			if (rc < 0)
				return rc;
		}
	}
	return 0;
}

static void dequant_axis(int block, struct fp4_axis a, const uint8_t *codes,
			 const uint8_t *scales, float g, float *ret_x)
{
	size_t nb = a.n / (size_t)block;
	float buf[BD_MXFP4_BLOCK];

	for (size_t r = 0; r < a.rows; r++) {
		for (size_t b = 0; b < nb; b++) {
			float *dst = ret_x + r * a.rs + b * (size_t)block * a.es;

			dequant_block(block, codes + r * (a.n / 2) + b * (size_t)block / 2,
				      scales[r * nb + b], g, buf);
			for (int i = 0; i < block; i++)
				dst[(size_t)i * a.es] = buf[i];
		}
	}
}

/* Zero the bytes of a page-head that no region covers, so equal inputs give equal pages. */
static void zero_gaps(const struct bd_layout *lay, uint8_t *head)
{
	const size_t off[4] = { lay->k_codes_off, lay->k_scales_off, lay->v_codes_off,
				lay->v_scales_off };
	const size_t len[4] = { lay->k_codes_bytes, lay->k_scales_bytes, lay->v_codes_bytes,
				lay->v_scales_bytes };

	for (int i = 0; i < 4; i++) {
		size_t end = off[i] + len[i];
		size_t next = i < 3 ? off[i + 1] : lay->head_bytes;

		if (next > end)
			memset(head + end, 0, next - end);
	}
}

static float nvfp4_kv_g(float amax)
{
	float g = 1.0f;

	/* g depends only on the amax of the page-head, so the decode scale of that one value is
	 * the decode scale of all 128·d values (NUMERICS.md §2) without an FP32 copy of them */
	if (bd_nvfp4_decode_scale(&amax, 1, BD_NVFP4_KV_SMAX, &g) < 0)
		return -1.0f;
	return g;
}

static void put_g(const struct bd_layout *lay, uint8_t *page, int kv_head, float g_k, float g_v)
{
	const float g[2] = { g_k, g_v };

	memcpy(page + lay->gscale_off + (size_t)kv_head * sizeof(g), g, sizeof(g));
}

static void get_g(const struct bd_layout *lay, const uint8_t *page, int kv_head, float ret_g[2])
{
	memcpy(ret_g, page + lay->gscale_off + (size_t)kv_head * 2 * sizeof(float),
	       2 * sizeof(float));
}

/* A page-head's shape: channels d (K) and dv (V), values nk, nv of a page's K and V, and
 * whether it is an MLA latent head (no channel-major V). */
struct head_shape {
	size_t d, dv, nk, nv;
	bool mla;
};

/* false unless lay is set, kv_head is one of its heads and it has channels; else *ret. */
static bool head_shape_of(const struct bd_layout *lay, int kv_head, struct head_shape *ret)
{
	if (!lay || kv_head < 0 || kv_head >= lay->n_kv_heads || lay->d < 1 || lay->dv < 1)
		return false;
	ret->d = (size_t)lay->d;
	ret->dv = (size_t)lay->dv;
	ret->nk = BD_PAGE_TOKENS * ret->d;
	ret->nv = BD_PAGE_TOKENS * ret->dv;
	ret->mla = lay->d_rope > 0;
	return true;
}

/* An emulated configuration's BF16 page-head (bd_kvemul.h): K and V fake-quantized. */
static int emul_write(const struct bd_kvcfg *cfg, const bd_bf16 *k, const bd_bf16 *v, size_t d,
		      size_t dv, uint8_t *k_dst, uint8_t *v_dst)
{
	size_t nk = BD_PAGE_TOKENS * d, nv = BD_PAGE_TOKENS * dv;
	bd_bf16 *ck = malloc(sizeof(*ck) * nk), *cv = malloc(sizeof(*cv) * nv);
	int r = ck && cv ? 0 : -ENOMEM;

	if (r == 0) {
		memcpy(ck, k, sizeof(*ck) * nk);
		memcpy(cv, v, sizeof(*cv) * nv);
		r = bd_kvemul_head(cfg, ck, cv, d, dv);
	}
	if (r == 0) {
		memcpy(k_dst, ck, sizeof(*ck) * nk);
		memcpy(v_dst, cv, sizeof(*cv) * nv);
	}
	free(ck);
	free(cv);
	return r;
}

int bd_page_write_head(const struct bd_layout *lay, const struct bd_kvcfg *cfg,
		       const bd_bf16 *k, const bd_bf16 *v, const float fp8_scale[2], void *page,
		       int kv_head)
{
	uint8_t *head;
	struct head_shape hs;
	float amax_k, amax_v, g_k = 1.0f, g_v = 1.0f;
	int block, r = 0;

	if (!cfg || !k || !v || !page || !head_shape_of(lay, kv_head, &hs))
		return -EINVAL;
	if (lay->fmt == BD_PAGE_FP8 &&
	    (!fp8_scale || !isfinite(fp8_scale[0]) || !isfinite(fp8_scale[1]) ||
	     !(fp8_scale[0] > 0.0f) || !(fp8_scale[1] > 0.0f)))
		return -EINVAL;

	const size_t d = hs.d, dv = hs.dv, nk = hs.nk, nv = hs.nv;
	const bool mla = hs.mla;
	block = lay->block;
	amax_k = bf16_amax(k, nk);
	amax_v = bf16_amax(v, nv);
	if (amax_k < 0.0f || amax_v < 0.0f)
		return -EDOM;

	head = (uint8_t *)page + (size_t)kv_head * lay->head_bytes;
	if (lay->fmt == BD_PAGE_NVFP4 || lay->fmt == BD_PAGE_NVFP4_CH) {
		g_k = nvfp4_kv_g(amax_k);
		if (!mla)
			g_v = nvfp4_kv_g(amax_v);
		if (!(g_k > 0.0f) || !(g_v > 0.0f))
			return -EDOM;
	}
	zero_gaps(lay, head);

	switch (lay->fmt) {
	case BD_PAGE_NVFP4:
	case BD_PAGE_MXFP4:
		r = quant_axis(block, token_major(d), k, g_k,
			       cfg->key_search ? BD_SCALE_SEARCH : BD_SCALE_STANDARD,
			       head + lay->k_codes_off, head + lay->k_scales_off);
		if (r == 0 && !mla)
			r = quant_axis(block, channel_major(dv), v, g_v, BD_SCALE_STANDARD,
				       head + lay->v_codes_off, head + lay->v_scales_off);
		break;
	case BD_PAGE_NVFP4_CH:
		/* trtllm-nvfp4: no recipe, both K and V blocked along channels */
		r = quant_axis(block, token_major(d), k, g_k, BD_SCALE_STANDARD,
			       head + lay->k_codes_off, head + lay->k_scales_off);
		if (r == 0)
			r = quant_axis(block, token_major(dv), v, g_v, BD_SCALE_STANDARD,
				       head + lay->v_codes_off, head + lay->v_scales_off);
		break;
	case BD_PAGE_FP8:
		g_k = fp8_scale[0];
		g_v = fp8_scale[1];
		for (size_t i = 0; i < nk; i++)
			head[lay->k_codes_off + i] = bd_e4m3_encode(bd_bf16_to_f32(k[i]) / g_k);
		for (size_t i = 0; i < nv; i++)
			head[lay->v_codes_off + i] = bd_e4m3_encode(bd_bf16_to_f32(v[i]) / g_v);
		break;
	case BD_PAGE_BF16:
	default:
		if (cfg->emul && !mla) {
			r = emul_write(cfg, k, v, d, dv, head + lay->k_codes_off,
				       head + lay->v_codes_off);
			if (r < 0)
				return r;
			put_g(lay, (uint8_t *)page, kv_head, g_k, g_v);
			return 0;
		}
		memcpy(head + lay->k_codes_off, k, nk * sizeof(*k));
		break;
	}
	if (r < 0)
		return r; /* unreachable after the checks above: the quantizers only fail on them */
	if (mla || lay->fmt == BD_PAGE_BF16)
		memcpy(head + lay->v_codes_off, v, nv * sizeof(*v));
	put_g(lay, (uint8_t *)page, kv_head, g_k, g_v);
	return 0;
}

static void bf16_to_f32_n(const uint8_t *src, size_t n, float *ret_x)
{
	for (size_t i = 0; i < n; i++) {
		bd_bf16 h;

		memcpy(&h, src + i * sizeof(h), sizeof(h));
		ret_x[i] = bd_bf16_to_f32(h);
	}
}

int bd_page_read_head(const struct bd_layout *lay, const void *page, int kv_head, float *ret_k,
		      float *ret_v, float *ret_g)
{
	const uint8_t *head;
	struct head_shape hs;
	float g[2], g_k, g_v;

	if (!page || !ret_k || !ret_v || !head_shape_of(lay, kv_head, &hs))
		return -EINVAL;

	const size_t d = hs.d, dv = hs.dv, nk = hs.nk, nv = hs.nv;
	const bool mla = hs.mla;
	head = (const uint8_t *)page + (size_t)kv_head * lay->head_bytes;
	get_g(lay, page, kv_head, g);
	if (lay->fmt == BD_PAGE_BF16 || lay->fmt == BD_PAGE_MXFP4)
		g[0] = g[1] = 1.0f;
	if (mla)
		g[1] = 1.0f;
	/* without ret_g the decode scale goes into the values; with it, (1·s)·x̂ = s·x̂ exactly */
	g_k = ret_g ? 1.0f : g[0];
	g_v = ret_g ? 1.0f : g[1];

	switch (lay->fmt) {
	case BD_PAGE_NVFP4:
	case BD_PAGE_MXFP4:
		dequant_axis(lay->block, token_major(d), head + lay->k_codes_off,
			     head + lay->k_scales_off, g_k, ret_k);
		if (!mla)
			dequant_axis(lay->block, channel_major(dv), head + lay->v_codes_off,
				     head + lay->v_scales_off, g_v, ret_v);
		break;
	case BD_PAGE_NVFP4_CH:
		dequant_axis(lay->block, token_major(d), head + lay->k_codes_off,
			     head + lay->k_scales_off, g_k, ret_k);
		dequant_axis(lay->block, token_major(dv), head + lay->v_codes_off,
			     head + lay->v_scales_off, g_v, ret_v);
		break;
	case BD_PAGE_FP8:
		for (size_t i = 0; i < nk; i++) {
			float x = bd_e4m3_decode(head[lay->k_codes_off + i]);

			ret_k[i] = ret_g ? x : x * g[0];
		}
		for (size_t i = 0; i < nv; i++) {
			float x = bd_e4m3_decode(head[lay->v_codes_off + i]);

			ret_v[i] = ret_g ? x : x * g[1];
		}
		break;
	case BD_PAGE_BF16:
	default:
		bf16_to_f32_n(head + lay->k_codes_off, nk, ret_k);
		break;
	}
	if (mla || lay->fmt == BD_PAGE_BF16)
		bf16_to_f32_n(head + lay->v_codes_off, nv, ret_v);
	if (ret_g) {
		ret_g[0] = g[0];
		ret_g[1] = g[1];
	}
	return 0;
}

/* ---- promotion (NUMERICS.md §8) ----------------------------------------------------------- */

int bd_page_promote(const struct bd_layout *lay, const struct bd_kvcfg *cfg,
		    const float *fp8_scales, void *slot, void *arena, int32_t page)
{
	size_t nk, nv, heads;

	if (!lay || !cfg || !slot || !arena || page < 0 || (size_t)page >= lay->n_pages ||
	    lay->d < 1 || lay->dv < 1)
		return -EINVAL;
	heads = (size_t)lay->n_layers * (size_t)lay->n_kv_heads;
	if (lay->fmt == BD_PAGE_FP8) {
		if (!fp8_scales)
			return -EINVAL;
		for (size_t i = 0; i < 2 * heads; i++)
			if (!isfinite(fp8_scales[i]) || !(fp8_scales[i] > 0.0f))
				return -EINVAL;
	}

	/* check the whole slot first so that a bad value leaves the arena as it was */
	nk = BD_RECENT_TOKENS * (size_t)lay->d;
	nv = BD_RECENT_TOKENS * (size_t)lay->dv;
	for (int l = 0; l < lay->n_layers; l++) {
		for (int h = 0; h < lay->n_kv_heads; h++) {
			if (bf16_amax(bd_slot_recent_k(lay, slot, l, h), nk) < 0.0f ||
			    bf16_amax(bd_slot_recent_v(lay, slot, l, h), nv) < 0.0f)
				return -EDOM;
		}
	}

	for (int l = 0; l < lay->n_layers; l++) {
		for (int h = 0; h < lay->n_kv_heads; h++) {
			const float *s = NULL;
			int r;

			if (lay->fmt == BD_PAGE_FP8)
				s = fp8_scales + ((size_t)l * (size_t)lay->n_kv_heads + (size_t)h) * 2;
			r = bd_page_write_head(lay, cfg, bd_slot_recent_k(lay, slot, l, h),
					       bd_slot_recent_v(lay, slot, l, h), s,
					       bd_layout_page(lay, arena, l, page), h);
			if (r < 0)
				return r;
		}
	}
	return 0;
}
