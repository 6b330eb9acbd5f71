/* ggml_gemv.c — matrix–vector products over ggml weight blocks in AVX-512, AVX2 and portable C
 * (bd_ggml_gemv.h).
 *
 * Every path decodes a block of 32 weights into FP32 lanes (2 vectors of 16, 4 of 8, or 32
 * scalars: bd_ggml_gemv_simd.h for the vector paths) and adds each block's w · x per
 * activation row into one accumulator for even and one for odd blocks; the two are added lane
 * by lane, then the lanes from the lowest up.
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

/* One path: the product of rows [out] for n_x activation rows, and the decoding of nb blocks
 * into FP32 (arguments checked). */
typedef void (*gemv_fn)(const uint8_t *W, size_t row_bytes, int out, int nb, const float *x,
			size_t ldx, int n_x, float *y, size_t ldy);
typedef void (*unpack_fn)(const uint8_t *src, int nb, float *ret);

struct path {
	const char *name;
	gemv_fn fn[3];       /* Q4_0, Q4_1, Q8_0 */
	unpack_fn unpack[3];
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

static size_t block_bytes(int slot)
{
	return slot == 0 ? 18 : slot == 1 ? 20 : 34;
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
	size_t bs = block_bytes(slot);
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
	}                                                                                       \
	static void unpack_c_##slot(const uint8_t *src, int nb, float *ret)                     \
	{                                                                                       \
		for (int b = 0; b < nb; b++)                                                    \
			block_c(slot, src + (size_t)b * block_bytes(slot), ret + (size_t)b * QK); \
	}
C_FN(0)
C_FN(1)
C_FN(2)
#undef C_FN

static const struct path path_c = { "c", { gemv_c_0, gemv_c_1, gemv_c_2 },
				    { unpack_c_0, unpack_c_1, unpack_c_2 } };

/* ---- AVX-512 and AVX2 ----------------------------------------------------------------------- */

/* GCC takes a region's target by pragma; clang (the fuzz builds) as an attribute of every
 * function in it */
#define SIMD_PRAGMA(x) _Pragma(#x)
#ifdef __clang__
#define SIMD_BEGIN(t)                                                                              \
	SIMD_PRAGMA(clang attribute push(__attribute__((target(t))), apply_to = function))
#define SIMD_END SIMD_PRAGMA(clang attribute pop)
#else
#define SIMD_BEGIN(t) SIMD_PRAGMA(GCC push_options) SIMD_PRAGMA(GCC target(t))
#define SIMD_END SIMD_PRAGMA(GCC pop_options)
#endif

SIMD_BEGIN("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define KW 16
#define KN(x) x##_avx512
#define KNAME "avx512"
#include "formats/bd_ggml_gemv_simd.h"
#undef KNAME
#undef KN
#undef KW
SIMD_END

SIMD_BEGIN("avx2,fma,f16c")
#define KW 8
#define KN(x) x##_avx2
#define KNAME "avx2"
#include "formats/bd_ggml_gemv_simd.h"
#undef KNAME
#undef KN
#undef KW
SIMD_END

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

int bd_ggml_gemv_dequantize(int t, const void *src, size_t n, float *ret_x)
{
	size_t blck, ts;
	int slot = type_slot(t);
	if (slot < 0)
		return -ENOTSUP;
	bd_ggml_type_info(t, &blck, &ts);
	if (!src || !ret_x || n % blck != 0 || n / blck > INT32_MAX)
		return -EINVAL;
	pthread_once(&init_once, init);
	sel->unpack[slot](src, (int)(n / blck), ret_x);
	return 0;
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
	sel->fn[slot](W, row_bytes, out, (int)((size_t)in / blck), x, ldx, n_x, y, ldy);
	return 0;
}
