/* bd_attn_cpu_simd.h — the vector kernels of attn_cpu.c, written once for a vector of KW FP32
 * lanes and included by attn_cpu.c once per instruction set (KW 16: AVX-512F/BW, KW 8: AVX2
 * with FMA), inside a `#pragma GCC target` region; KN(name) gives each copy its own names.
 * Private to attn_cpu.c: it defines static functions and is no interface.
 *
 * Expansions are exact: an FP4 code is looked up as the integer 2·x̂ (E2M1, NUMERICS.md §1),
 * converted to FP32 and multiplied by s/2, which equals s·x̂ (both products are exact in FP32);
 * BF16 widens by a shift. Arrays of d or tile elements are multiples of 16 long.
 */
#ifndef KW
#error "bd_attn_cpu_simd.h is included by attn_cpu.c with KW and KN defined"
#endif

typedef float KN(vf) __attribute__((vector_size(KW * 4)));
typedef int32_t KN(vi) __attribute__((vector_size(KW * 4)));

#if KW == 16
#define KFMA(a, b, c) ((KN(vf))_mm512_fmadd_ps((__m512)(a), (__m512)(b), (__m512)(c)))
#define KMAX(a, b) ((KN(vf))_mm512_max_ps((__m512)(a), (__m512)(b)))
#define KMIN(a, b) ((KN(vf))_mm512_min_ps((__m512)(a), (__m512)(b)))
#define KROUND(a) \
	((KN(vf))_mm512_roundscale_ps((__m512)(a), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))
#else
#define KFMA(a, b, c) ((KN(vf))_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(c)))
#define KMAX(a, b) ((KN(vf))_mm256_max_ps((__m256)(a), (__m256)(b)))
#define KMIN(a, b) ((KN(vf))_mm256_min_ps((__m256)(a), (__m256)(b)))
#define KROUND(a) \
	((KN(vf))_mm256_round_ps((__m256)(a), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))
#endif

static inline KN(vf) KN(ld)(const float *p)
{
	KN(vf) v;

	memcpy(&v, p, sizeof(v));
	return v;
}

static inline void KN(st)(float *p, KN(vf) v)
{
	memcpy(p, &v, sizeof(v));
}

static inline KN(vf) KN(set1)(float x)
{
	return (KN(vf)){ 0 } + x;
}

/* The lanes of v folded by one operation, as a float: AVX-512's reduce instruction r512; on
 * AVX2 the halves, quarters and pairs folded with the packed op and the last two lanes with its
 * scalar form op_ss. */
#if KW == 16
#define KHFOLD(v, r512, op, op_ss) r512((__m512)(v))
#else
#define KHFOLD(v, r512, op, op_ss)                                                            \
	({                                                                                     \
		__m128 s_ = op(_mm256_castps256_ps128((__m256)(v)),                             \
			       _mm256_extractf128_ps((__m256)(v), 1));                          \
		s_ = op(s_, _mm_movehl_ps(s_, s_));                                            \
		s_ = op_ss(s_, _mm_shuffle_ps(s_, s_, 1));                                     \
		_mm_cvtss_f32(s_);                                                             \
	})
#endif

static inline float KN(hsum)(KN(vf) v)
{
	return KHFOLD(v, _mm512_reduce_add_ps, _mm_add_ps, _mm_add_ss);
}

static inline float KN(hmax)(KN(vf) v)
{
	return KHFOLD(v, _mm512_reduce_max_ps, _mm_max_ps, _mm_max_ss);
}

/* 16 packed E2M1 codes (8 bytes, element 0 in the low nibble) times a block scale: out[16] =
 * s·x̂, given s_half = s/2. */
static inline void KN(dec_fp4_16)(const uint8_t *p, float s_half, float *out)
{
	const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
	const __m128i m4 = _mm_set1_epi8(0x0f);
	__m128i b = _mm_loadl_epi64((const __m128i *)(const void *)p);
	__m128i lo = _mm_and_si128(b, m4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m4);
	__m128i v = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi));
#if KW == 16
	KN(vf) f = (KN(vf))_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
	KN(st)(out, f * s_half);
#else
	KN(vf) f0 = (KN(vf))_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
	KN(vf) f1 = (KN(vf))_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
	KN(st)(out, f0 * s_half);
	KN(st)(out + 8, f1 * s_half);
#endif
}

/* 16 BF16 values to FP32. */
static inline void KN(dec_bf16_16)(const bd_bf16 *p, float *out)
{
#if KW == 16
	__m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(const void *)p));
	KN(st)(out, (KN(vf))_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
#else
	for (int h = 0; h < 2; h++) {
		__m128i x = _mm_loadu_si128((const __m128i *)(const void *)(p + 8 * h));
		__m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16);
		KN(st)(out + 8 * h, (KN(vf))_mm256_castsi256_ps(w));
	}
#endif
}

/* n token-major FP4 rows of cols elements (codes [n][cols/2], scales [n][cols/block], block 16
 * or 32 along the row) to out [n][cols] = s·x̂. */
static void KN(expand_fp4_rows)(const uint8_t *codes, const uint8_t *scales, int block,
				const float *slut, int n, int cols, float *out)
{
	int nb = cols / block;

	for (int t = 0; t < n; t++) {
		const uint8_t *cr = codes + (size_t)t * (size_t)cols / 2;
		const uint8_t *sr = scales + (size_t)t * (size_t)nb;
		float *o = out + (size_t)t * (size_t)cols;
		for (int c = 0; c < cols; c += 16)
			KN(dec_fp4_16)(cr + c / 2, 0.5f * slut[sr[c / block]], o + c);
	}
}

/* Tokens row0 .. row0 + bk − 1 of a channel-major FP4 V (codes [cols][64], scales
 * [cols][128/block], blocks along tokens) to out [cols][bk] = s·x̂. */
static void KN(expand_fp4_cols)(const uint8_t *codes, const uint8_t *scales, int block,
				const float *slut, int cols, int row0, int bk, float *out)
{
	int nb = BD_PAGE_TOKENS / block;

	for (int c = 0; c < cols; c++) {
		const uint8_t *cc = codes + (size_t)c * (BD_PAGE_TOKENS / 2);
		const uint8_t *sc = scales + (size_t)c * (size_t)nb;
		float *o = out + (size_t)c * (size_t)bk;
		for (int t = row0; t < row0 + bk; t += 16)
			KN(dec_fp4_16)(cc + t / 2, 0.5f * slut[sc[t / block]], o + t - row0);
	}
}

/* n BF16 rows (rows[i] → cols values each) to out [n][cols]. */
static void KN(expand_bf16_rows)(const bd_bf16 *const *rows, int n, int cols, float *out)
{
	for (int t = 0; t < n; t++)
		for (int c = 0; c < cols; c += 16)
			KN(dec_bf16_16)(rows[t] + c, out + (size_t)t * (size_t)cols + c);
}

/* Lane i of the result = Σ of the KW lanes of a[i] (a is clobbered): a transposing tree,
 * each level adding the low and high halves of pairs of vectors, then one permutation that
 * undoes the tree's bit-reversed order. */
static inline __attribute__((always_inline)) KN(vf) KN(reduce)(KN(vf) *a)
{
#if KW == 16
	const KN(vi) l8 = { 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23 };
	const KN(vi) h8 = { 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31 };
	const KN(vi) l4 = { 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27 };
	const KN(vi) h4 = { 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31 };
	const KN(vi) l2 = { 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29 };
	const KN(vi) h2 = { 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31 };
	const KN(vi) l1 = { 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30 };
	const KN(vi) h1 = { 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31 };
	const KN(vi) fin = { 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15 };
#pragma GCC unroll 8
	for (int i = 0; i < 8; i++)
		a[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], l8) +
		       __builtin_shuffle(a[2 * i], a[2 * i + 1], h8);
#else
	const KN(vi) l4 = { 0, 1, 2, 3, 8, 9, 10, 11 }, h4 = { 4, 5, 6, 7, 12, 13, 14, 15 };
	const KN(vi) l2 = { 0, 1, 8, 9, 4, 5, 12, 13 }, h2 = { 2, 3, 10, 11, 6, 7, 14, 15 };
	const KN(vi) l1 = { 0, 8, 2, 10, 4, 12, 6, 14 }, h1 = { 1, 9, 3, 11, 5, 13, 7, 15 };
	const KN(vi) fin = { 0, 4, 2, 6, 1, 5, 3, 7 };
#endif
#pragma GCC unroll 4
	for (int i = 0; i < 4; i++)
		a[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], l4) +
		       __builtin_shuffle(a[2 * i], a[2 * i + 1], h4);
#pragma GCC unroll 2
	for (int i = 0; i < 2; i++)
		a[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], l2) +
		       __builtin_shuffle(a[2 * i], a[2 * i + 1], h2);
	a[0] = __builtin_shuffle(a[0], a[1], l1) + __builtin_shuffle(a[0], a[1], h1);
	return __builtin_shuffle(a[0], fin);
}

/* The KW dot products ⟨x, r_j⟩, j < KW, of x [len] with the rows r_j = r + j·stride [len] (len
 * a multiple of KW): KW lanes of each summed in FMA order, then the KW sums reduced together. */
static inline __attribute__((always_inline)) KN(vf)
	KN(dots)(const float *x, const float *r, size_t stride, int len)
{
	KN(vf) acc[KW];
#pragma GCC unroll 16
	for (int j = 0; j < KW; j++)
		acc[j] = (KN(vf)){ 0 };
	for (int c = 0; c < len; c += KW) {
		KN(vf) xv = KN(ld)(x + c);
#pragma GCC unroll 16
		for (int j = 0; j < KW; j++)
			acc[j] = KFMA(xv, KN(ld)(r + j * stride + c), acc[j]);
	}
	return KN(reduce)(acc);
}

/* S[g·ss + i] = (⟨q_g, k_i⟩ · a) · b for keys k [n][d], queries q [G][d]; n a multiple of KW,
 * KW keys at a time (their sums reduced together). */
static void KN(logits)(const float *k, int n, int d, const float *q, int G, float a, float b,
		       float *S, int ss)
{
	for (int g = 0; g < G; g++) {
		const float *qg = q + (size_t)g * (size_t)d;
		for (int i0 = 0; i0 < n; i0 += KW) {
			const float *k0 = k + (size_t)i0 * (size_t)d;
			KN(st)(S + (size_t)g * (size_t)ss + (size_t)i0,
			       (KN(dots)(qg, k0, (size_t)d, d) * a) * b);
		}
	}
}

/* 2^x for x ≤ 128: x clamped below at −127 (2^−127 and less give 0), split as n + f with n the
 * nearest integer and |f| ≤ 1/2, 2^f by its Taylor series to degree 7 (truncation error below
 * 6e-9 relative), times 2^n built in the exponent field. */
static inline KN(vf) KN(exp2)(KN(vf) x)
{
	x = KMIN(KMAX(x, KN(set1)(-127.0f)), KN(set1)(127.0f));
	KN(vf) n = KROUND(x), f = x - n;
	KN(vf) p = KN(set1)(1.5252733804059838e-05f);
	p = KFMA(p, f, KN(set1)(1.5403530393381606e-04f));
	p = KFMA(p, f, KN(set1)(1.3333558146428441e-03f));
	p = KFMA(p, f, KN(set1)(9.6181291076284770e-03f));
	p = KFMA(p, f, KN(set1)(5.5504108664821576e-02f));
	p = KFMA(p, f, KN(set1)(2.4022650695910070e-01f));
	p = KFMA(p, f, KN(set1)(6.9314718055994530e-01f));
	p = KFMA(p, f, KN(set1)(1.0f));
	KN(vi) e = (__builtin_convertvector(n, KN(vi)) + 127) << 23;
	return p * (KN(vf))e;
}

/* E2M1 value of a ≥ 0 (NUMERICS.md §1: nearest of {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the
 * even mantissa, saturating at 6): the sum of the steps whose thresholds a passes, the ties
 * 0.25, 1.25, 2.5 and 5 rounding down and 0.75, 1.75, 3.5 up. */
static inline KN(vf) KN(e2m1)(KN(vf) a)
{
	KN(vi) h = (a > KN(set1)(0.25f)) + (a >= KN(set1)(0.75f)) + (a > KN(set1)(1.25f)) +
		   (a >= KN(set1)(1.75f));
	KN(vi) w = (a > KN(set1)(2.5f)) + (a >= KN(set1)(3.5f)) + 2 * (a > KN(set1)(5.0f));
	return __builtin_convertvector(-h, KN(vf)) * 0.5f + __builtin_convertvector(-w, KN(vf));
}

/* One query head's online-softmax step over a tile of n keys (NUMERICS.md §6): S [n] logits,
 * −inf where masked; given the running max *m, the new max goes to *m, P [n] =
 * exp2(S − m_new + log2c) (0 where masked), returns Σ P and sets *alpha = 2^(m_old − m_new)
 * (0 when m_old was −inf). A tile whose keys are all masked leaves everything unchanged and
 * returns −1. */
static float KN(softmax_tile)(const float *S, int n, float log2c, float *m, float *P,
			      float *alpha)
{
	KN(vf) vm = KN(set1)(-INFINITY);

	for (int i = 0; i < n; i += KW)
		vm = KMAX(vm, KN(ld)(S + i));
	float m_new = fmaxf(*m, KN(hmax)(vm));
	if (m_new == -INFINITY)
		return -1.0f;
	*alpha = *m == -INFINITY ? 0.0f : exp2f(*m - m_new);
	*m = m_new;
	KN(vf) vs = { 0 }, off = KN(set1)(m_new);
	for (int i = 0; i < n; i += KW) {
		KN(vf) s = KN(ld)(S + i);
		KN(vf) p = KN(exp2)((s - off) + log2c);
		/* masked keys: exactly 0 (the clamp at −127 gives 0 as well) */
		p = (KN(vf))((KN(vi))p & (s != KN(set1)(-INFINITY)));
		KN(st)(P + i, p);
		vs += p;
	}
	return KN(hsum)(vs);
}

/* P quantization of one head's tile, NVFP4 blocks of 16 (§6): per block p_max = exp2(max S_b −
 * m), κ = 2 when underflow-aware and p_max ≤ τ/c (else 6), s_P = E4M3(c·p_max/κ), P̃ = s_P ·
 * E2M1(P / s_P). st[0] counts blocks with an unmasked key, st[1] those whose s_P is 0. */
static void KN(quant_p_nvfp4)(const float *S, const float *P, int n, float m,
			      const struct bd_pscale *ps, float *Pt, uint64_t st[2])
{
	for (int b = 0; b < n; b += 16) {
		KN(vf) vm = KN(ld)(S + b);
#if KW == 8
		vm = KMAX(vm, KN(ld)(S + b + 8));
#endif
		float smax = KN(hmax)(vm);
		float pmax = smax == -INFINITY ? 0.0f : exp2f(smax - m);
		float kappa = ps->underflow_aware && pmax <= ps->tau / ps->c ? 2.0f : 6.0f;
		uint8_t code = bd_e4m3_encode((ps->c * pmax) / kappa);
		float sv = bd_e4m3_decode(code), inv = sv == 0.0f ? 0.0f : 1.0f / sv;
		for (int i = b; i < b + 16; i += KW)
			KN(st)(Pt + i, KN(e2m1)(KN(ld)(P + i) * inv) * sv);
		if (smax != -INFINITY) {
			st[0]++;
			st[1] += code == 0;
		}
	}
}

/* P quantization of one head's tile, MXFP4 blocks of 32 by the OCP rule (§6, c = 1):
 * e = floor(log2 max P_b) − 2 clamped to −127..127, P̃ = 2^e · E2M1(P · 2^−e). st as above,
 * st[1] counting blocks whose P̃ is all 0 while some P is not. */
static void KN(quant_p_mxfp4)(const float *S, const float *P, int n, float *Pt, uint64_t st[2])
{
	for (int b = 0; b < n; b += 32) {
		KN(vf) vm = KN(ld)(P + b), vs = KN(ld)(S + b);
		for (int i = b + KW; i < b + 32; i += KW) {
			vm = KMAX(vm, KN(ld)(P + i));
			vs = KMAX(vs, KN(ld)(S + i));
		}
		float amax = KN(hmax)(vm);
		int e = -127;
		if (amax != 0.0f) {
			(void)frexpf(amax, &e);
			e = e - 1 - 2;
			e = e < -127 ? -127 : e > 127 ? 127 : e;
		}
		float up = ldexpf(1.0f, -e), dn = ldexpf(1.0f, e);
		KN(vf) nz = { 0 };
		for (int i = b; i < b + 32; i += KW) {
			KN(vf) x = KN(e2m1)(KN(ld)(P + i) * up) * dn;
			KN(st)(Pt + i, x);
			nz = KMAX(nz, x);
		}
		if (KN(hmax)(vs) != -INFINITY) {
			st[0]++;
			st[1] += KN(hmax)(nz) == 0.0f && amax > 0.0f;
		}
	}
}

/* acc[g·d + c] = Σ_i Pt[g·ps + i] · v[c·n + i] for channel-major values v [d][n], KW channels
 * at a time (d a multiple of KW). */
static void KN(pv_cols)(const float *v, int n, int d, const float *Pt, int ps, int G,
			float *acc)
{
	for (int g = 0; g < G; g++) {
		const float *pg = Pt + (size_t)g * (size_t)ps;
		for (int c0 = 0; c0 < d; c0 += KW) {
			const float *v0 = v + (size_t)c0 * (size_t)n;
			KN(st)(acc + (size_t)g * (size_t)d + (size_t)c0, KN(dots)(pg, v0, (size_t)n, n));
		}
	}
}

/* acc[g·d + c] = Σ_i Pt[g·ps + i] · v[i·d + c] for token-major values v [n][d], keys in order,
 * 4·KW channels of a head held in registers over the keys. */
static void KN(pv_rows)(const float *v, int n, int d, const float *Pt, int ps, int G, float *acc)
{
	for (int g = 0; g < G; g++) {
		const float *pg = Pt + (size_t)g * (size_t)ps;
		for (int c0 = 0; c0 < d; c0 += 4 * KW) {
			int m = (d - c0) / KW < 4 ? (d - c0) / KW : 4;
			KN(vf) a[4] = { { 0 }, { 0 }, { 0 }, { 0 } };
			for (int i = 0; i < n; i++) {
				const float *vr = v + (size_t)i * (size_t)d + c0;
				KN(vf) p = KN(set1)(pg[i]);
#pragma GCC unroll 4
				for (int j = 0; j < 4; j++)
					if (j < m)
						a[j] = KFMA(p, KN(ld)(vr + j * KW), a[j]);
			}
			float *ag = acc + (size_t)g * (size_t)d + (size_t)c0;
			for (int j = 0; j < m; j++)
				KN(st)(ag + (size_t)j * KW, a[j]);
		}
	}
}

/* Logits of a tile: the first nmask (the sink tokens' page copies, §8) become −inf; returns
 * −1 when another one is not finite (a logit that overflowed FP32), else 0. n a multiple of
 * KW. */
static int KN(mask_check)(float *S, int n, int nmask)
{
	KN(vi) bad = { 0 };

	for (int i = 0; i < nmask && i < n; i++)
		S[i] = -INFINITY;
	for (int i = nmask < n ? nmask / KW * KW : n; i < n; i += KW) {
		KN(vf) x = KN(ld)(S + i);
		KN(vi) lane = { 0 };
		for (int j = 0; j < KW; j++)
			lane[j] = i + j >= nmask;
		/* x − x is 0 for finite x, NaN for ±inf and NaN */
		bad |= (x - x != KN(set1)(0.0f)) & (lane != 0);
	}
	for (int j = 0; j < KW; j++)
		if (bad[j])
			return -1;
	return 0;
}

/* o[c] = alpha·o[c] + acc[c]·gv for c < d (d a multiple of KW). */
static void KN(rescale_add)(float *o, float alpha, const float *acc, float gv, int d)
{
	for (int c = 0; c < d; c += KW)
		KN(st)(o + c, KN(ld)(o + c) * alpha + KN(ld)(acc + c) * gv);
}

static const struct kern KN(kern) = {
	.mask_check = KN(mask_check),
	.rescale_add = KN(rescale_add),
	.expand_fp4_rows = KN(expand_fp4_rows),
	.expand_fp4_cols = KN(expand_fp4_cols),
	.expand_bf16_rows = KN(expand_bf16_rows),
	.logits = KN(logits),
	.softmax_tile = KN(softmax_tile),
	.quant_p_nvfp4 = KN(quant_p_nvfp4),
	.quant_p_mxfp4 = KN(quant_p_mxfp4),
	.pv_cols = KN(pv_cols),
	.pv_rows = KN(pv_rows),
};

#undef KFMA
#undef KMAX
#undef KMIN
#undef KROUND
#undef KHFOLD
