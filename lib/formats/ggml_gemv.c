/* ggml_gemv.c — matrix–vector products over ggml weight blocks in AVX-512, AVX2 and portable C
 * (bd_ggml_gemv.h).
 *
 * Every path decodes a block of 32 weights into FP32 lanes (2 vectors of 16, 4 of 8, or 32
 * scalars) and accumulates w · x per activation row into accumulators kept apart for even and
 * odd blocks; the accumulators are added lane by lane, then the lanes from the lowest up.
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <immintrin.h>

#include "formats/bd_ggml_gemv.h"
#include "formats/bd_ggml_quants.h"

#define QK 32

/* One path: the product of rows [out] for n_x activation rows (arguments checked). */
typedef void (*gemv_fn)(const uint8_t *W, size_t row_bytes, int out, int nb, const float *x,
			size_t ldx, int n_x, float *y, size_t ldy);

struct path {
	const char *name;
	gemv_fn fn[3]; /* Q4_0, Q4_1, Q8_0 */
};

static int type_slot(int t)
{
	switch (t) {
	case BD_GGML_Q4_0: return 0;
	case BD_GGML_Q4_1: return 1;
	case BD_GGML_Q8_0: return 2;
	default: return -1;
	}
}

static uint16_t rd16(const uint8_t *p)
{
	return (uint16_t)(p[0] | (unsigned)p[1] << 8);
}

/* The n lanes l stored from a vector, added from the lowest up (the paths' final sum). */
static float lanes_sum(const float *l, int n)
{
	float s = 0.0f;
	for (int i = 0; i < n; i++)
		s += l[i];
	return s;
}

/* ---- portable C ----------------------------------------------------------------------------- */

/* The 32 weights of one block, as bd_ggml_dequantize() gives them. */
static void block_c(int slot, const uint8_t *b, float *w)
{
	float d = bd_f16_to_f32(rd16(b));
	if (slot == 2) {
		for (int j = 0; j < QK; j++)
			w[j] = d * (float)(int8_t)b[2 + j];
		return;
	}
	float m = slot == 1 ? bd_f16_to_f32(rd16(b + 2)) : 0.0f;
	const uint8_t *qs = b + (slot == 1 ? 4 : 2);
	for (int j = 0; j < QK / 2; j++) {
		int lo = qs[j] & 0xf, hi = qs[j] >> 4;
		if (slot == 0) {
			w[j] = d * (float)(lo - 8);
			w[j + QK / 2] = d * (float)(hi - 8);
		} else {
			w[j] = d * (float)lo + m;
			w[j + QK / 2] = d * (float)hi + m;
		}
	}
}

static void gemv_c(int slot, const uint8_t *W, size_t row_bytes, int out, int nb,
		   const float *x, size_t ldx, int n_x, float *y, size_t ldy)
{
	size_t bs = slot == 0 ? 18 : slot == 1 ? 20 : 34;
	float w[QK];
	for (int o = 0; o < out; o++) {
		const uint8_t *row = W + (size_t)o * row_bytes;
		float acc[BD_GGML_GEMV_MAX_X][2] = { { 0 } };
		for (int b = 0; b < nb; b++) {
			block_c(slot, row + (size_t)b * bs, w);
			for (int r = 0; r < n_x; r++) {
				const float *xb = x + (size_t)r * ldx + (size_t)b * QK;
				float s = 0.0f;
				for (int j = 0; j < QK; j++)
					s += w[j] * xb[j];
				acc[r][b & 1] += s;
			}
		}
		for (int r = 0; r < n_x; r++)
			y[(size_t)r * ldy + (size_t)o] = acc[r][0] + acc[r][1];
	}
}

#define C_FN(slot)                                                                              \
	static void gemv_c_##slot(const uint8_t *W, size_t rb, int out, int nb, const float *x,  \
				  size_t ldx, int n_x, float *y, size_t ldy)                     \
	{                                                                                       \
		gemv_c(slot, W, rb, out, nb, x, ldx, n_x, y, ldy);                              \
	}
C_FN(0)
C_FN(1)
C_FN(2)

static const struct path path_c = { "c", { gemv_c_0, gemv_c_1, gemv_c_2 } };

/* ---- AVX-512 -------------------------------------------------------------------------------- */

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")

/* The 32 weights of a block of type slot in two vectors of 16 (elements 0..15, 16..31). */
static inline __attribute__((always_inline)) void block_avx512(int slot, const uint8_t *b,
							       __m512 *w0, __m512 *w1)
{
	__m512 d = _mm512_set1_ps(_cvtsh_ss(rd16(b)));
	if (slot == 2) {
		__m128i q0 = _mm_loadu_si128((const __m128i *)(const void *)(b + 2));
		__m128i q1 = _mm_loadu_si128((const __m128i *)(const void *)(b + 18));
		*w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)));
		*w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)));
		return;
	}
	__m128i qs = _mm_loadu_si128((const __m128i *)(const void *)(b + (slot == 1 ? 4 : 2)));
	__m512i q = _mm512_cvtepu8_epi32(qs);
	__m512i lo = _mm512_and_si512(q, _mm512_set1_epi32(0xf));
	__m512i hi = _mm512_srli_epi32(q, 4);
	if (slot == 0) {
		__m512i eight = _mm512_set1_epi32(8);
		*w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(lo, eight)));
		*w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(hi, eight)));
	} else {
		__m512 m = _mm512_set1_ps(_cvtsh_ss(rd16(b + 2)));
		*w0 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(lo), m);
		*w1 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(hi), m);
	}
}

static inline float hsum_avx512(__m512 v)
{
	float l[16];
	_mm512_storeu_ps(l, v);
	return lanes_sum(l, 16);
}

static inline __attribute__((always_inline)) void gemv_avx512(int slot, const uint8_t *W,
							      size_t row_bytes, int out, int nb,
							      const float *x, size_t ldx,
							      int n_x, float *y, size_t ldy)
{
	size_t bs = slot == 0 ? 18 : slot == 1 ? 20 : 34;
	for (int o = 0; o < out; o++) {
		const uint8_t *row = W + (size_t)o * row_bytes;
		__m512 acc[BD_GGML_GEMV_MAX_X][4];
		for (int r = 0; r < BD_GGML_GEMV_MAX_X; r++)
			for (int k = 0; k < 4; k++)
				acc[r][k] = _mm512_setzero_ps();
		for (int b = 0; b < nb; b++) {
			__m512 w0, w1;
			int k = (b & 1) * 2;
			block_avx512(slot, row + (size_t)b * bs, &w0, &w1);
			for (int r = 0; r < n_x; r++) {
				const float *xb = x + (size_t)r * ldx + (size_t)b * QK;
				acc[r][k] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb), acc[r][k]);
				acc[r][k + 1] =
					_mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), acc[r][k + 1]);
			}
		}
		for (int r = 0; r < n_x; r++) {
			__m512 s = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]),
						 _mm512_add_ps(acc[r][2], acc[r][3]));
			y[(size_t)r * ldy + (size_t)o] = hsum_avx512(s);
		}
	}
}

#define AVX512_FN(slot)                                                                         \
	static void gemv_avx512_##slot(const uint8_t *W, size_t rb, int out, int nb,             \
				       const float *x, size_t ldx, int n_x, float *y, size_t ldy) \
	{                                                                                       \
		gemv_avx512(slot, W, rb, out, nb, x, ldx, n_x, y, ldy);                         \
	}
AVX512_FN(0)
AVX512_FN(1)
AVX512_FN(2)

#pragma GCC pop_options

static const struct path path_avx512 = { "avx512",
					 { gemv_avx512_0, gemv_avx512_1, gemv_avx512_2 } };

/* ---- AVX2 ----------------------------------------------------------------------------------- */

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

/* The 32 weights of a block in four vectors of 8 (elements 0..7, 8..15, 16..23, 24..31). */
static inline __attribute__((always_inline)) void block_avx2(int slot, const uint8_t *b,
							     __m256 w[4])
{
	__m256 d = _mm256_set1_ps(_cvtsh_ss(rd16(b)));
	if (slot == 2) {
		for (int i = 0; i < 4; i++) {
			__m128i q = _mm_loadl_epi64((const __m128i *)(const void *)(b + 2 + 8 * i));
			w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
		}
		return;
	}
	const uint8_t *qs = b + (slot == 1 ? 4 : 2);
	__m256i q[2] = {
		_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)qs)),
		_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(qs + 8))),
	};
	__m256i n[4] = {
		_mm256_and_si256(q[0], _mm256_set1_epi32(0xf)),
		_mm256_and_si256(q[1], _mm256_set1_epi32(0xf)),
		_mm256_srli_epi32(q[0], 4),
		_mm256_srli_epi32(q[1], 4),
	};
	if (slot == 0) {
		for (int i = 0; i < 4; i++)
			w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(
							_mm256_sub_epi32(n[i], _mm256_set1_epi32(8))));
	} else {
		__m256 m = _mm256_set1_ps(_cvtsh_ss(rd16(b + 2)));
		for (int i = 0; i < 4; i++)
			w[i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(n[i]), m);
	}
}

static inline float hsum_avx2(__m256 v)
{
	float l[8];
	_mm256_storeu_ps(l, v);
	return lanes_sum(l, 8);
}

static inline __attribute__((always_inline)) void gemv_avx2(int slot, const uint8_t *W,
							    size_t row_bytes, int out, int nb,
							    const float *x, size_t ldx, int n_x,
							    float *y, size_t ldy)
{
	size_t bs = slot == 0 ? 18 : slot == 1 ? 20 : 34;
	for (int o = 0; o < out; o++) {
		const uint8_t *row = W + (size_t)o * row_bytes;
		__m256 acc[BD_GGML_GEMV_MAX_X][2];
		for (int r = 0; r < BD_GGML_GEMV_MAX_X; r++)
			acc[r][0] = acc[r][1] = _mm256_setzero_ps();
		for (int b = 0; b < nb; b++) {
			__m256 w[4];
			int k = b & 1;
			block_avx2(slot, row + (size_t)b * bs, w);
			for (int r = 0; r < n_x; r++) {
				const float *xb = x + (size_t)r * ldx + (size_t)b * QK;
				__m256 s = _mm256_mul_ps(w[0], _mm256_loadu_ps(xb));
				s = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb + 8), s);
				s = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + 16), s);
				s = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), s);
				acc[r][k] = _mm256_add_ps(acc[r][k], s);
			}
		}
		for (int r = 0; r < n_x; r++)
			y[(size_t)r * ldy + (size_t)o] =
				hsum_avx2(_mm256_add_ps(acc[r][0], acc[r][1]));
	}
}

#define AVX2_FN(slot)                                                                           \
	static void gemv_avx2_##slot(const uint8_t *W, size_t rb, int out, int nb,               \
				     const float *x, size_t ldx, int n_x, float *y, size_t ldy)   \
	{                                                                                       \
		gemv_avx2(slot, W, rb, out, nb, x, ldx, n_x, y, ldy);                           \
	}
AVX2_FN(0)
AVX2_FN(1)
AVX2_FN(2)

#pragma GCC pop_options

static const struct path path_avx2 = { "avx2", { gemv_avx2_0, gemv_avx2_1, gemv_avx2_2 } };

/* ---- the choice ----------------------------------------------------------------------------- */

static const struct path *sel = &path_c;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;

static bool has_avx512(void)
{
	return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
	       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

static bool has_avx2(void)
{
	/* F16C comes with every AVX2 CPU; GCC's builtin has no name for it */
	return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

static const struct path *best(void)
{
	return has_avx512() ? &path_avx512 : has_avx2() ? &path_avx2 : &path_c;
}

static void init(void)
{
	__builtin_cpu_init();
	/* BD_GEMV_ISA (bd_ggml_gemv.h): the best path unless a narrower one is named */
	const char *want = getenv("BD_GEMV_ISA");
	sel = best();
	if (want && strcmp(want, "c") == 0)
		sel = &path_c;
	else if (want && strcmp(want, "avx2") == 0 && has_avx2())
		sel = &path_avx2;
}

const char *bd_ggml_gemv_isa(void)
{
	pthread_once(&init_once, init);
	return sel->name;
}

int bd_ggml_gemv_set_isa(const char *name)
{
	pthread_once(&init_once, init);
	if (!name)
		return -EINVAL;
	if (strcmp(name, "c") == 0)
		sel = &path_c;
	else if (strcmp(name, "avx2") == 0 && has_avx2())
		sel = &path_avx2;
	else if (strcmp(name, "avx512") == 0 && has_avx512())
		sel = &path_avx512;
	else if (strcmp(name, "avx2") == 0 || strcmp(name, "avx512") == 0)
		return -ENOTSUP;
	else
		return -EINVAL;
	return 0;
}

bool bd_ggml_gemv_supported(int t)
{
	return type_slot(t) >= 0;
}

int bd_ggml_gemv(int t, const void *W, size_t row_bytes, int out, int in, const float *x,
		 size_t ldx, int n_x, float *y, size_t ldy)
{
	size_t blck, ts;
	if (!W || !x || !y || out < 1 || in < 1 || n_x < 1 || n_x > BD_GGML_GEMV_MAX_X ||
	    ldx < (size_t)in || ldy < (size_t)out)
		return -EINVAL;
	int slot = type_slot(t);
	if (slot < 0)
		return -ENOTSUP;
	bd_ggml_type_info(t, &blck, &ts);
	if ((size_t)in % blck != 0 || row_bytes < (size_t)in / blck * ts)
		return -EINVAL;
	pthread_once(&init_once, init);
	sel->fn[slot](W, row_bytes, out, in / QK, x, ldx, n_x, y, ldy);
	return 0;
}
