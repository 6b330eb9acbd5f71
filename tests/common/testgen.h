/* testgen.h — seeded random inputs for the unit tests, the GPU checks and the benchmarks, and
 * the relative error by which they measure an output against its reference.
 *
 * One generator, so that a seed means the same data in every program that makes test data
 * (tests/lib/quant, tests/gpu/gpu_check.c, bench/bench_ref.c, bench/kernels/bench_kernels.c):
 * the stream is base/bd_rand.h's splitmix64 step over a 64-bit state (the generator that seeds
 * xoshiro256**; its outputs are equidistributed over 64 bits and each state is one counter),
 * uniforms take its top 53 bits, normals come from Box–Muller. Not for cryptography; each
 * struct tg_rng is one stream, owned by its caller (no global state).
 */
#ifndef BD_TESTGEN_H
#define BD_TESTGEN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "quant/bd_attn_ref.h"
#include "quant/bd_layout.h"

/* A stream: `struct tg_rng r = { seed };` starts it; equal seeds give equal sequences. */
struct tg_rng {
	uint64_t s;
};

/* The next 64 random bits (advances r by one splitmix64 step). */
uint64_t tg_next(struct tg_rng *r);

/* Uniform in the open interval (0, 1): (top 53 bits + 1/2) / 2^53, one draw. */
double tg_unit(struct tg_rng *r);

/* Standard normal (Box–Muller: sqrt(−2 ln u)·cos(2π v) of two tg_unit draws, u first),
 * rounded to FP32; two draws. */
float tg_gauss(struct tg_rng *r);

/* Uniform in [0, 1): top 53 bits / 2^53, one draw. */
double tg_uniform(struct tg_rng *r);

/* Standard normal in FP64: sqrt(−2 ln(1 − u))·cos(2π v) of two tg_uniform draws, u first (the
 * Box–Muller form of bd_rand.h, its cosine half only). bench/bench_ref.c draws its data from it:
 * the errors it reports (bench/RESULTS.md) are recorded for these inputs. */
double tg_normal(struct tg_rng *r);

/* A cheap approximately normal value (mean 0, variance 1, bounded by ±2√3): the centred sum of
 * the four 16-bit fields of one draw, for bulk benchmark data. */
float tg_norm4(struct tg_rng *r);

/* a[0..n) shuffled in place by Fisher–Yates from the top (for i = n−1 … 1: swap a[i] with
 * a[tg_next % (i + 1)]); n − 1 draws. */
void tg_shuffle_i32(struct tg_rng *r, int32_t *a, size_t n);

/* x[0..n) = scale · tg_gauss, in order. */
void tg_fill_gauss(struct tg_rng *r, float *x, size_t n, float scale);

/* Decode queries q [n_heads][d] with outliers: every element 1.5 · tg_gauss in order, then per
 * head one channel (tg_next mod d) scaled by 6, so attention is peaked and the FP4 query
 * terms see a large channel. */
void tg_fill_queries(struct tg_rng *r, float *q, size_t n_heads, int d);

/* ‖a − ref‖₂ / ‖ref‖₂ over a[n], ref[n], both sums in FP64 (the error of an output against its
 * reference that tests/lib/quant and bench/bench_wmat.c bound and report); NaN for n = 0 or an
 * all-zero ref with a = ref, +inf for an all-zero ref otherwise. */
double tg_rel_l2(const float *a, const float *ref, size_t n);

/* A paged decode problem of the CPU decode tests and bench_attn_cpu: n tokens of L layers of Hkv
 * KV heads of dimension d (GQA), written in configuration cfg through the slot
 * (bd_kv_write_token) and promoted into the pages of a shuffled block table of
 * ⌊(n − 1)/128⌋ + extra_pages pages (bd_page_promote; FP8 pages at scale 0.25). Each head's keys
 * are a bias of 2·tg_gauss per channel plus tg_gauss, its values tg_gauss, with six outlier
 * channels (three ×12 in K, three ×8 in V); its μ_k is the bias plus 0.1·tg_gauss. Then the
 * queries q [n_q][G][d] (tg_fill_queries). unit_v: every value 1 and every query 0 (the
 * normalization's inputs). Every draw from one stream of seed. */
struct tg_paged {
	const struct bd_kvcfg *cfg;
	struct bd_layout lay;
	int n, d, Hkv, G;
	void *arena, *slot;
	int32_t *bt;
	float *q;
};
/* Returns 0, -ENOMEM, or the -errno of the layout, the write or the promotion (P freed). */
int tg_paged_build(struct tg_paged *P, const struct bd_kvcfg *cfg, int L, int Hkv, int G, int d,
		   int n, int extra_pages, int n_q, uint64_t seed, bool unit_v);
/* Frees what tg_paged_build made (a zeroed P too). */
void tg_paged_free(struct tg_paged *P);
/* The view of P's KV for one layer, starting at KV head head. */
struct bd_kv_view tg_paged_view(const struct tg_paged *P, int layer, int head);

#endif
