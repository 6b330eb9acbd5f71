/* ggml_quants.c — dequantization of ggml's block formats (bd_ggml_quants.h).
 *
 * Written from the block layouts; every multi-byte field is read byte by byte as
 * little-endian, so src may have any alignment and the host any byte order.
 */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "formats/bd_ggml_quants.h"

#define QK 32   /* elements per block of the _0/_1 formats */
#define QK_K 256 /* elements per super-block of the K formats */

struct type_desc {
	const char *name;
	uint16_t blck, size;
};

static const struct type_desc types[BD_GGML_TYPE_LIMIT] = {
	[BD_GGML_F32] = { "F32", 1, 4 },
	[BD_GGML_F16] = { "F16", 1, 2 },
	[BD_GGML_Q4_0] = { "Q4_0", QK, 2 + QK / 2 },
	[BD_GGML_Q4_1] = { "Q4_1", QK, 4 + QK / 2 },
	[BD_GGML_Q5_0] = { "Q5_0", QK, 2 + 4 + QK / 2 },
	[BD_GGML_Q5_1] = { "Q5_1", QK, 4 + 4 + QK / 2 },
	[BD_GGML_Q8_0] = { "Q8_0", QK, 2 + QK },
	/* d and s as two halves: 36 bytes (gguf-py's table still says 40, from before ggml
	 * narrowed them from floats) */
	[BD_GGML_Q8_1] = { "Q8_1", QK, 4 + QK },
	[BD_GGML_Q2_K] = { "Q2_K", QK_K, 84 },
	[BD_GGML_Q3_K] = { "Q3_K", QK_K, 110 },
	[BD_GGML_Q4_K] = { "Q4_K", QK_K, 4 + 12 + QK_K / 2 },
	[BD_GGML_Q5_K] = { "Q5_K", QK_K, 4 + 12 + QK_K / 8 + QK_K / 2 },
	[BD_GGML_Q6_K] = { "Q6_K", QK_K, QK_K / 2 + QK_K / 4 + QK_K / 16 + 2 },
	[BD_GGML_Q8_K] = { "Q8_K", QK_K, 292 },
	[BD_GGML_IQ2_XXS] = { "IQ2_XXS", QK_K, 66 },
	[BD_GGML_IQ2_XS] = { "IQ2_XS", QK_K, 74 },
	[BD_GGML_IQ3_XXS] = { "IQ3_XXS", QK_K, 98 },
	[BD_GGML_IQ1_S] = { "IQ1_S", QK_K, 50 },
	[BD_GGML_IQ4_NL] = { "IQ4_NL", QK, 18 },
	[BD_GGML_IQ3_S] = { "IQ3_S", QK_K, 110 },
	[BD_GGML_IQ2_S] = { "IQ2_S", QK_K, 82 },
	[BD_GGML_IQ4_XS] = { "IQ4_XS", QK_K, 136 },
	[BD_GGML_I8] = { "I8", 1, 1 },
	[BD_GGML_I16] = { "I16", 1, 2 },
	[BD_GGML_I32] = { "I32", 1, 4 },
	[BD_GGML_I64] = { "I64", 1, 8 },
	[BD_GGML_F64] = { "F64", 1, 8 },
	[BD_GGML_IQ1_M] = { "IQ1_M", QK_K, 56 },
	[BD_GGML_BF16] = { "BF16", 1, 2 },
	[BD_GGML_TQ1_0] = { "TQ1_0", QK_K, 54 },
	[BD_GGML_TQ2_0] = { "TQ2_0", QK_K, 66 },
	[BD_GGML_MXFP4] = { "MXFP4", QK, 17 },
	[BD_GGML_NVFP4] = { "NVFP4", 64, 36 },
	[BD_GGML_Q1_0] = { "Q1_0", 128, 18 },
};

static const struct type_desc *desc(int t)
{
	if (t < 0 || t >= BD_GGML_TYPE_LIMIT || !types[t].name)
		return NULL;
	return &types[t];
}

int bd_ggml_type_info(int t, size_t *ret_blck, size_t *ret_type_size)
{
	const struct type_desc *d = desc(t);

	if (!d)
		return -EINVAL;
	if (ret_blck)
		*ret_blck = d->blck;
	if (ret_type_size)
		*ret_type_size = d->size;
	return 0;
}

const char *bd_ggml_type_name(int t)
{
	const struct type_desc *d = desc(t);
	return d ? d->name : NULL;
}

bool bd_ggml_can_dequantize(int t)
{
	switch (t) {
	case BD_GGML_F32:
	case BD_GGML_F16:
	case BD_GGML_BF16:
	case BD_GGML_Q4_0:
	case BD_GGML_Q4_1:
	case BD_GGML_Q5_0:
	case BD_GGML_Q5_1:
	case BD_GGML_Q8_0:
	case BD_GGML_Q4_K:
	case BD_GGML_Q5_K:
	case BD_GGML_Q6_K:
		return true;
	default:
		return false;
	}
}

static float bits_to_f32(uint32_t u)
{
	float f;
	memcpy(&f, &u, sizeof(f));
	return f;
}

static uint16_t rd16(const uint8_t *p)
{
	return (uint16_t)(p[0] | (unsigned)p[1] << 8);
}

static uint32_t rd32(const uint8_t *p)
{
	return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

float bd_f16_to_f32(uint16_t h)
{
	uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
	uint32_t exp = (h >> 10) & 0x1fu;
	uint32_t man = h & 0x3ffu;

	if (exp == 0x1f) /* inf / NaN: payload moves to the top of the FP32 mantissa */
		return bits_to_f32(sign | 0x7f800000u | man << 13);
	if (exp == 0) {
		if (man == 0)
			return bits_to_f32(sign);
		/* subnormal m·2^-24: normalize, every one is a normal FP32 */
		int e = -1;
		do {
			man <<= 1;
			e++;
		} while (!(man & 0x400u));
		man &= 0x3ffu;
		return bits_to_f32(sign | (uint32_t)(127 - 15 - e) << 23 | man << 13);
	}
	return bits_to_f32(sign | (exp + 127 - 15) << 23 | man << 13);
}

static float f16_at(const uint8_t *p)
{
	return bd_f16_to_f32(rd16(p));
}

/* x_j = d · (q_j − 8): Q4_0, 18 bytes. */
static void deq_q4_0(const uint8_t *b, float *y)
{
	float d = f16_at(b);
	const uint8_t *qs = b + 2;

	for (int j = 0; j < QK / 2; j++) {
		y[j] = d * (float)((qs[j] & 0xf) - 8);
		y[j + QK / 2] = d * (float)((qs[j] >> 4) - 8);
	}
}

/* x_j = d · q_j + m: Q4_1, 20 bytes. */
static void deq_q4_1(const uint8_t *b, float *y)
{
	float d = f16_at(b), m = f16_at(b + 2);
	const uint8_t *qs = b + 4;

	for (int j = 0; j < QK / 2; j++) {
		y[j] = d * (float)(qs[j] & 0xf) + m;
		y[j + QK / 2] = d * (float)(qs[j] >> 4) + m;
	}
}

/* Q5_0 (22 bytes: d, qh, qs) and Q5_1 (24 bytes: d, m, qh, qs). */
static void deq_q5(const uint8_t *b, float *y, bool has_min)
{
	float d = f16_at(b), m = has_min ? f16_at(b + 2) : 0.0f;
	const uint8_t *p = b + (has_min ? 4 : 2);
	uint32_t qh = rd32(p);
	const uint8_t *qs = p + 4;

	for (int j = 0; j < QK / 2; j++) {
		int lo = (qs[j] & 0xf) | (int)((qh >> j) & 1u) << 4;
		int hi = (qs[j] >> 4) | (int)((qh >> (j + QK / 2)) & 1u) << 4;
		if (has_min) {
			y[j] = d * (float)lo + m;
			y[j + QK / 2] = d * (float)hi + m;
		} else {
			y[j] = d * (float)(lo - 16);
			y[j + QK / 2] = d * (float)(hi - 16);
		}
	}
}

/* x_j = d · q_j: Q8_0, 34 bytes. */
static void deq_q8_0(const uint8_t *b, float *y)
{
	float d = f16_at(b);

	for (int j = 0; j < QK; j++)
		y[j] = d * (float)(int8_t)b[2 + j];
}

/* The 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes of Q4_K/Q5_K:
 * sub-blocks 0..3 sit in the low 6 bits of bytes j (scale) and j+4 (min); sub-blocks 4..7
 * take their low 4 bits from byte j+4 (scale: low nibble, min: high nibble) and their top
 * 2 bits from the spare top bits of bytes j−4 (scale) and j (min). */
static void k_scale_min(int j, const uint8_t *s, int *ret_sc, int *ret_m)
{
	if (j < 4) {
		*ret_sc = s[j] & 63;
		*ret_m = s[j + 4] & 63;
	} else {
		*ret_sc = (s[j + 4] & 0xf) | (s[j - 4] >> 6) << 4;
		*ret_m = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
	}
}

/* Q4_K (144 bytes) and Q5_K (176 bytes: qh[32] before the nibbles). Each 64 elements use 32
 * bytes of nibbles, low nibbles for the first 32, high for the next; in Q5_K, element l of
 * sub-block k has its 5th bit at bit k of qh[l]. */
static void deq_qk45(const uint8_t *b, float *y, bool five)
{
	float d = f16_at(b), dmin = f16_at(b + 2);
	const uint8_t *sc = b + 4;
	const uint8_t *qh = b + 16;
	const uint8_t *qs = b + 16 + (five ? QK_K / 8 : 0);

	for (int k = 0; k < QK_K / 32; k++) {
		int s, mn;
		k_scale_min(k, sc, &s, &mn);
		float dk = d * (float)s, mk = dmin * (float)mn;
		const uint8_t *q = qs + (k / 2) * 32;
		int shift = (k & 1) * 4;
		for (int l = 0; l < 32; l++) {
			int v = (q[l] >> shift) & 0xf;
			if (five)
				v |= ((qh[l] >> k) & 1) << 4;
			y[k * 32 + l] = dk * (float)v - mk;
		}
	}
}

/* Q6_K (210 bytes): ql[128], qh[64], int8 scales[16], d. Per half of 128 elements (ql +64,
 * qh +32, scales +8): element 32·r + l (r = 0..3, l = 0..31) takes its low nibble from
 * ql[l + 32·(r & 1)] (low nibble for r < 2, high for r ≥ 2), its two high bits from bits
 * 2r..2r+1 of qh[l], and the scale of its 16-element group. */
static void deq_q6_k(const uint8_t *b, float *y)
{
	const uint8_t *ql = b, *qh = b + QK_K / 2;
	const int8_t *scales = (const int8_t *)(b + QK_K / 2 + QK_K / 4);
	float d = f16_at(b + QK_K / 2 + QK_K / 4 + QK_K / 16);

	for (int half = 0; half < 2; half++) {
		for (int r = 0; r < 4; r++) {
			for (int l = 0; l < 32; l++) {
				int lo = (ql[l + 32 * (r & 1)] >> (4 * (r >> 1))) & 0xf;
				int hi = (qh[l] >> (2 * r)) & 3;
				int q = (lo | hi << 4) - 32;
				float ds = d * (float)scales[(32 * r + l) / 16];
				y[32 * r + l] = ds * (float)q;
			}
		}
		y += 128;
		ql += 64;
		qh += 32;
		scales += 8;
	}
}

int bd_ggml_dequantize(int t, const void *src, size_t n, float *ret_x)
{
	const struct type_desc *td = desc(t);

	if (!src || !ret_x || !td)
		return -EINVAL;
	if (!bd_ggml_can_dequantize(t))
		return -ENOTSUP;
	if (n % td->blck)
		return -EINVAL;

	const uint8_t *p = src;
	size_t nb = n / td->blck;

	switch (t) {
	case BD_GGML_F32:
		for (size_t i = 0; i < n; i++)
			ret_x[i] = bits_to_f32(rd32(p + 4 * i));
		break;
	case BD_GGML_F16:
		for (size_t i = 0; i < n; i++)
			ret_x[i] = f16_at(p + 2 * i);
		break;
	case BD_GGML_BF16:
		for (size_t i = 0; i < n; i++)
			ret_x[i] = bits_to_f32((uint32_t)rd16(p + 2 * i) << 16);
		break;
	default:
		for (size_t i = 0; i < nb; i++, p += td->size, ret_x += td->blck) {
			switch (t) {
			case BD_GGML_Q4_0: deq_q4_0(p, ret_x); break;
			case BD_GGML_Q4_1: deq_q4_1(p, ret_x); break;
			case BD_GGML_Q5_0: deq_q5(p, ret_x, false); break;
			case BD_GGML_Q5_1: deq_q5(p, ret_x, true); break;
			case BD_GGML_Q8_0: deq_q8_0(p, ret_x); break;
			case BD_GGML_Q4_K: deq_qk45(p, ret_x, false); break;
			case BD_GGML_Q5_K: deq_qk45(p, ret_x, true); break;
			case BD_GGML_Q6_K: deq_q6_k(p, ret_x); break;
			}
		}
		break;
	}
	return 0;
}
