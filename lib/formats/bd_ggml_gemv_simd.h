/* bd_ggml_gemv_simd.h — the vector paths of ggml_gemv.c, written once for a vector of KW FP32
 * lanes and included by ggml_gemv.c once per instruction set (KW 16: AVX-512F/BW/VL/DQ, KW 8:
 * AVX2 with FMA and F16C), inside a `#pragma GCC target` region; KN(name) gives each copy its
 * own names. Private to ggml_gemv.c: it defines static functions and is no interface.
 *
 * A block of 32 weights decodes into NV = 32 / KW vectors, element j of the block in lane
 * j mod KW of vector j / KW, with the dequantizer's values (bd_ggml_gemv.h). A product keeps,
 * per activation row, accumulators apart for even and odd blocks (KN_ACC says how a block goes
 * in); at the end they are added lane by lane and the lanes from the lowest up.
 */
#ifndef KW
#error "bd_ggml_gemv_simd.h is included by ggml_gemv.c with KW and KN defined"
#endif

#define NV (32 / KW)

typedef float KN(vf) __attribute__((vector_size(KW * 4)));
typedef int32_t KN(vi) __attribute__((vector_size(KW * 4)));

#if KW == 16
#define KFMA(a, b, c) ((KN(vf))_mm512_fmadd_ps((__m512)(a), (__m512)(b), (__m512)(c)))
#else
#define KFMA(a, b, c) ((KN(vf))_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(c)))
#endif

static inline KN(vf) KN(ld)(const float *p)
{
	KN(vf) v;
	memcpy(&v, p, sizeof(v));
	return v;
}

/* KW bytes at p as KW int32 lanes, zero- or sign-extended (vpmovzxbd / vpmovsxbd). */
#if KW == 16
#define KLD8(p) _mm_loadu_si128((const __m128i *)(const void *)(p))
#define KN_U8(p) ((KN(vi))_mm512_cvtepu8_epi32(KLD8(p)))
#define KN_S8(p) ((KN(vi))_mm512_cvtepi8_epi32(KLD8(p)))
#else
#define KLD8(p) _mm_loadl_epi64((const __m128i *)(const void *)(p))
#define KN_U8(p) ((KN(vi))_mm256_cvtepu8_epi32(KLD8(p)))
#define KN_S8(p) ((KN(vi))_mm256_cvtepi8_epi32(KLD8(p)))
#endif

static inline KN(vi) KN(ld_u8)(const uint8_t *p)
{
	return KN_U8(p);
}

static inline KN(vi) KN(ld_s8)(const uint8_t *p)
{
	return KN_S8(p);
}

static inline KN(vf) KN(to_f)(KN(vi) v)
{
	return __builtin_convertvector(v, KN(vf));
}

/* The 32 weights of the block at b (slot: 0 Q4_0, 1 Q4_1, 2 Q8_0) into w[NV]. */
static inline __attribute__((always_inline)) void KN(decode)(int slot, const uint8_t *b,
							     KN(vf) w[NV])
{
	KN(vf) d = (KN(vf)){ 0 } + _cvtsh_ss(rd16(b));
	if (slot == 2) {
		for (int i = 0; i < NV; i++)
			w[i] = d * KN(to_f)(KN(ld_s8)(b + 2 + KW * i));
		return;
	}
	const uint8_t *qs = b + (slot == 1 ? 4 : 2);
	KN(vf) m = (KN(vf)){ 0 } + (slot == 1 ? _cvtsh_ss(rd16(b + 2)) : 0.0f);
	for (int i = 0; i < NV / 2; i++) {
		KN(vi) q = KN(ld_u8)(qs + KW * i);
		KN(vi) lo = q & 0xf, hi = q >> 4;
		if (slot == 0) {
			w[i] = d * KN(to_f)(lo - 8);
			w[i + NV / 2] = d * KN(to_f)(hi - 8);
		} else {
			w[i] = KFMA(d, KN(to_f)(lo), m);
			w[i + NV / 2] = KFMA(d, KN(to_f)(hi), m);
		}
	}
}

/* One block's w · x into the accumulators a[2] of its parity: with two vectors a block (KW 16)
 * each w_i·x_i by FMA into its own a[i]; with four (KW 8) s = w_0·x_0, then s += w_i·x_i by
 * FMA, and a[0] += s. KN_FOLD gives the row's vector from the even and odd accumulators. */
#if NV == 2
#define KN_ACC(a, w, xb)                                                                        \
	do {                                                                                    \
		(a)[0] = KFMA((w)[0], KN(ld)(xb), (a)[0]);                                      \
		(a)[1] = KFMA((w)[1], KN(ld)((xb) + KW), (a)[1]);                               \
	} while (0)
#define KN_FOLD(e, o) (((e)[0] + (e)[1]) + ((o)[0] + (o)[1]))
#else
#define KN_ACC(a, w, xb)                                                                        \
	do {                                                                                    \
		KN(vf) s_ = (w)[0] * KN(ld)(xb);                                                 \
		for (int i_ = 1; i_ < NV; i_++)                                                 \
			s_ = KFMA((w)[i_], KN(ld)((xb) + KW * i_), s_);                         \
		(a)[0] += s_;                                                                   \
	} while (0)
#define KN_FOLD(e, o) ((e)[0] + (o)[0])
#endif

static inline float KN(fold)(const KN(vf) * e, const KN(vf) * o)
{
	float l[KW];
	KN(vf) t = KN_FOLD(e, o);
	memcpy(l, &t, sizeof(l));
	return lanes_sum(l, KW);
}

static inline __attribute__((always_inline)) void KN(gemv)(int slot, const uint8_t *W,
							   size_t row_bytes, int out, int nb,
							   const float *x, size_t ldx, int n_x,
							   float *y, size_t ldy)
{
	size_t bs = block_bytes(slot);
	int o = 0;
	if (n_x == 1) {
		/* one activation row: two weight rows at a time, accumulators in registers (the
		 * same operations per row as below, so the same bits) */
		for (; o + 1 < out; o += 2) {
			const uint8_t *r0 = W + (size_t)o * row_bytes, *r1 = r0 + row_bytes;
			KN(vf) a0[2][2] = { { { 0 } } }, a1[2][2] = { { { 0 } } };
			for (int b = 0; b < nb; b++) {
				KN(vf) w0[NV], w1[NV];
				KN(decode)(slot, r0 + (size_t)b * bs, w0);
				KN(decode)(slot, r1 + (size_t)b * bs, w1);
				const float *xb = x + (size_t)b * 32;
				KN_ACC(a0[b & 1], w0, xb);
				KN_ACC(a1[b & 1], w1, xb);
			}
			y[o] = KN(fold)(a0[0], a0[1]);
			y[o + 1] = KN(fold)(a1[0], a1[1]);
		}
	}
	for (; o < out; o++) {
		const uint8_t *row = W + (size_t)o * row_bytes;
		KN(vf) acc[BD_GGML_GEMV_MAX_X][2][2] = { { { { 0 } } } };
		for (int b = 0; b < nb; b++) {
			KN(vf) w[NV];
			KN(decode)(slot, row + (size_t)b * bs, w);
			for (int r = 0; r < n_x; r++)
				KN_ACC(acc[r][b & 1], w, x + (size_t)r * ldx + (size_t)b * 32);
		}
		for (int r = 0; r < n_x; r++)
			y[(size_t)r * ldy + (size_t)o] = KN(fold)(acc[r][0], acc[r][1]);
	}
}

static inline __attribute__((always_inline)) void KN(unpack)(int slot, const uint8_t *src,
							     int nb, float *ret)
{
	size_t bs = block_bytes(slot);
	for (int b = 0; b < nb; b++) {
		KN(vf) w[NV];
		KN(decode)(slot, src + (size_t)b * bs, w);
		memcpy(ret + (size_t)b * 32, w, sizeof(w));
	}
}

#define KN_SLOT(slot)                                                                           \
	static void KN(gemv_##slot)(const uint8_t *W, size_t rb, int out, int nb,               \
				    const float *x, size_t ldx, int n_x, float *y, size_t ldy)   \
	{                                                                                       \
		KN(gemv)(slot, W, rb, out, nb, x, ldx, n_x, y, ldy);                            \
	}                                                                                       \
	static void KN(unpack_##slot)(const uint8_t *src, int nb, float *ret)                   \
	{                                                                                       \
		KN(unpack)(slot, src, nb, ret);                                                 \
	}
KN_SLOT(0)
KN_SLOT(1)
KN_SLOT(2)
#undef KN_SLOT

static const struct path KN(path) = {
	KNAME, { KN(gemv_0), KN(gemv_1), KN(gemv_2) }, { KN(unpack_0), KN(unpack_1), KN(unpack_2) },
};

#undef KN_ACC
#undef KN_FOLD
#undef KFMA
#undef KLD8
#undef KN_U8
#undef KN_S8
#undef NV
