/* testgen.c — seeded random inputs for tests and benchmarks (testgen.h). */
#include <math.h>

#include "base/bd_rand.h"
#include "testgen.h"

uint64_t tg_next(struct tg_rng *r)
{
	return bd_splitmix64(&r->s);
}

double tg_unit(struct tg_rng *r)
{
	return ((double)(tg_next(r) >> 11) + 0.5) / 9007199254740992.0;
}

float tg_gauss(struct tg_rng *r)
{
	double u = tg_unit(r), v = tg_unit(r);

	return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}

double tg_uniform(struct tg_rng *r)
{
	return (double)(tg_next(r) >> 11) * 0x1p-53;
}

double tg_normal(struct tg_rng *r)
{
	double u1 = 1.0 - tg_uniform(r), u2 = tg_uniform(r);

	return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

float tg_norm4(struct tg_rng *r)
{
	uint64_t x = tg_next(r);
	float s = 0.0f;

	for (int i = 0; i < 4; i++)
		s += (float)((x >> (16 * i)) & 0xffff) * (1.0f / 65536.0f);
	return (s - 2.0f) * 1.7320508f;
}

void tg_shuffle_i32(struct tg_rng *r, int32_t *a, size_t n)
{
	for (size_t i = n; i-- > 1;) {
		size_t j = (size_t)(tg_next(r) % (uint64_t)(i + 1));
		int32_t t = a[i];

		a[i] = a[j];
		a[j] = t;
	}
}

void tg_fill_gauss(struct tg_rng *r, float *x, size_t n, float scale)
{
	for (size_t i = 0; i < n; i++)
		x[i] = scale * tg_gauss(r);
}

void tg_fill_queries(struct tg_rng *r, float *q, size_t n_heads, int d)
{
	tg_fill_gauss(r, q, n_heads * (size_t)d, 1.5f);
	for (size_t h = 0; h < n_heads; h++)
		q[h * (size_t)d + (size_t)(tg_next(r) % (uint64_t)d)] *= 6.0f;
}
