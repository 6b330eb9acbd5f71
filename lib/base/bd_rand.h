/* bd_rand.h — the project's seeded pseudo-random generator: xoshiro256** (Blackman and Vigna)
 * seeded through splitmix64. One definition for the sampler, the synthetic problems of the tools
 * and the benchmarks, so that a seed means the same sequence everywhere. Not for cryptography.
 */
#ifndef BD_RAND_H
#define BD_RAND_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>

struct bd_rng {
	uint64_t s[4];
	bool have_spare; /* Box–Muller makes normals in pairs */
	double spare;
};

/* splitmix64 step: advances *x and returns the next output. */
static inline uint64_t bd_splitmix64(uint64_t *x)
{
	uint64_t z = (*x += 0x9e3779b97f4a7c15ull);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

/* Seed a generator from (seed, stream): independent streams for equal seeds (e.g. one per trial). */
static inline void bd_rng_seed(struct bd_rng *r, uint64_t seed, uint64_t stream)
{
	uint64_t x = seed ^ bd_splitmix64(&stream);

	for (int i = 0; i < 4; i++)
		r->s[i] = bd_splitmix64(&x);
	r->have_spare = false;
	r->spare = 0.0;
}

static inline uint64_t bd_rotl64(uint64_t x, int k)
{
	return (x << k) | (x >> (64 - k));
}

/* Next 64 random bits (xoshiro256**). */
static inline uint64_t bd_rng_u64(struct bd_rng *r)
{
	uint64_t *s = r->s, res = bd_rotl64(s[1] * 5, 7) * 9, t = s[1] << 17;

	s[2] ^= s[0];
	s[3] ^= s[1];
	s[1] ^= s[2];
	s[0] ^= s[3];
	s[2] ^= t;
	s[3] = bd_rotl64(s[3], 45);
	return res;
}

/* Uniform in [0, 1) with 53 random bits. */
static inline double bd_rng_uniform(struct bd_rng *r)
{
	return (double)(bd_rng_u64(r) >> 11) * 0x1p-53;
}

/* Standard normal by Box–Muller; u1 in (0, 1] keeps the log finite. */
static inline double bd_rng_normal(struct bd_rng *r)
{
	if (r->have_spare) {
		r->have_spare = false;
		return r->spare;
	}
	double u1 = 1.0 - bd_rng_uniform(r), u2 = bd_rng_uniform(r);
	double rad = sqrt(-2.0 * log(u1)), th = 6.283185307179586 * u2;

	r->spare = rad * sin(th);
	r->have_spare = true;
	return rad * cos(th);
}

#endif
