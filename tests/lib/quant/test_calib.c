/* test_calib.c — bd_calib.h: SHA-256 against the FIPS 180-2 examples, the calibration file
 * (round trip, mismatched model / context / shape, corruption, truncation), the μ_k mean, and
 * the τ search on hand-made probability blocks. */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "quant/bd_calib.h"

static void hex_eq(const uint8_t d[32], const char *want)
{
	char h[65];
	bd_sha256_hex(d, h);
	cr_assert_str_eq(h, want);
}

Test(calib, sha256_known_answers)
{
	uint8_t d[32];

	/* FIPS 180-2 appendix B examples and the digest of the empty string */
	bd_sha256("abc", 3, d);
	hex_eq(d, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
	bd_sha256("", 0, d);
	hex_eq(d, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
	const char *m2 = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
	bd_sha256(m2, strlen(m2), d);
	hex_eq(d, "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");

	/* one million 'a', fed in uneven pieces to exercise the buffering */
	struct bd_sha256 s;
	char a[997];
	memset(a, 'a', sizeof(a));
	bd_sha256_init(&s);
	size_t left = 1000000, piece = 1;
	while (left) {
		size_t k = piece < left ? piece : left;
		bd_sha256_update(&s, a, k);
		left -= k;
		piece = piece * 7 % 997 + 1;
	}
	bd_sha256_final(&s, d);
	hex_eq(d, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

Test(calib, sha256_file)
{
	char path[] = "/tmp/bd_calib_sha_XXXXXX";
	int fd = mkstemp(path);
	cr_assert(fd >= 0);
	cr_assert_eq(write(fd, "abc", 3), 3);
	close(fd);
	uint8_t d[32];
	cr_assert_eq(bd_sha256_file(path, d), 0);
	hex_eq(d, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
	unlink(path);
	cr_assert_eq(bd_sha256_file(path, d), -ENOENT);
}

/* ---- the file ------------------------------------------------------------------------------ */

enum { L = 3, H = 2, D = 32 };

static struct bd_calib *sample(void)
{
	struct bd_calib *c;
	cr_assert_eq(bd_calib_new(L, H, D, &c), 0);
	for (int i = 0; i < 32; i++)
		c->model_sha256[i] = (uint8_t)(i * 37 + 1);
	c->n_ctx = 2048;
	c->tau = 17.0f / 512.0f;
	c->tau_index = 17;
	c->n_key_tokens = 2048;
	c->n_p_blocks = 123456789012ull;
	for (int i = 0; i < L * H * D; i++)
		c->mu_k[i] = (float)sin(i * 0.7) * 3.0f - 0.001f * (float)i;
	c->mu_k[5] = -0.0f;
	c->mu_k[6] = 1e-40f; /* a subnormal survives */
	return c;
}

static struct bd_calib_expect expect_of(const struct bd_calib *c)
{
	return (struct bd_calib_expect){ .model_sha256 = c->model_sha256, .n_ctx = c->n_ctx,
					 .n_layers = L, .n_kv_heads = H, .head_dim = D };
}

static char *tmp_path(void)
{
	static char p[64];
	snprintf(p, sizeof(p), "/tmp/bd_calib_%d.bin", (int)getpid());
	return p;
}

static uint8_t *read_all(const char *path, size_t *ret_n)
{
	FILE *f = fopen(path, "rb");
	cr_assert(f);
	fseek(f, 0, SEEK_END);
	long n = ftell(f);
	fseek(f, 0, SEEK_SET);
	uint8_t *b = malloc((size_t)n);
	cr_assert(b && fread(b, 1, (size_t)n, f) == (size_t)n);
	fclose(f);
	*ret_n = (size_t)n;
	return b;
}

Test(calib, file_round_trip)
{
	struct bd_calib *c = sample(), *back = NULL;
	struct bd_calib_expect want = expect_of(c);
	char err[BD_CALIB_ERR_MAX];
	const char *path = tmp_path();

	cr_assert_eq(bd_calib_save(c, path), 0);
	size_t n;
	uint8_t *img = read_all(path, &n);
	cr_assert_eq(n, 96 + 4 * L * H * D + 32);
	cr_assert_eq(n, bd_calib_file_bytes(L, H, D));
	cr_assert(memcmp(img, "BDFP4CAL", 8) == 0);
	/* little-endian fields at the offsets bd_calib.h documents */
	cr_assert_eq(img[8], 1);
	cr_assert_eq(img[12] | img[13] << 8, 2048);
	cr_assert_eq(img[16], L);
	cr_assert_eq(img[20], H);
	cr_assert_eq(img[24], D);
	cr_assert(memcmp(img + 64, c->model_sha256, 32) == 0);
	/* the trailer is the SHA-256 of everything before it */
	uint8_t sum[32];
	bd_sha256(img, n - 32, sum);
	cr_assert(memcmp(sum, img + n - 32, 32) == 0);
	free(img);

	cr_assert_eq(bd_calib_load(path, &want, &back, err), 0, "%s", err);
	cr_assert_str_eq(err, "");
	cr_assert_eq(back->n_ctx, 2048);
	cr_assert_eq(back->n_layers, L);
	cr_assert_eq(back->n_kv_heads, H);
	cr_assert_eq(back->head_dim, D);
	cr_assert_eq(back->tile_keys, 64);
	cr_assert(back->tau == 17.0f / 512.0f);
	cr_assert(back->c == 8.0f);
	cr_assert_eq(back->tau_index, 17);
	cr_assert_eq(back->n_key_tokens, 2048);
	cr_assert_eq(back->n_p_blocks, 123456789012ull);
	cr_assert(memcmp(back->model_sha256, c->model_sha256, 32) == 0);
	cr_assert(memcmp(back->mu_k, c->mu_k, sizeof(float) * L * H * D) == 0);
	bd_calib_free(back);

	/* n_ctx 0: any context is accepted */
	want.n_ctx = 0;
	cr_assert_eq(bd_calib_load(path, &want, &back, err), 0);
	bd_calib_free(back);
	unlink(path);
	bd_calib_free(c);
}

Test(calib, mismatch_is_an_error_and_loads_nothing)
{
	struct bd_calib *c = sample();
	struct bd_calib *const sentinel = (struct bd_calib *)&c; /* must stay untouched */
	struct bd_calib *back = sentinel;
	char err[BD_CALIB_ERR_MAX];
	const char *path = tmp_path();
	uint8_t other[32];

	cr_assert_eq(bd_calib_save(c, path), 0);

	struct bd_calib_expect w = expect_of(c);
	memcpy(other, c->model_sha256, 32);
	other[31] ^= 1;
	w.model_sha256 = other;
	cr_assert_eq(bd_calib_load(path, &w, &back, err), -ESTALE);
	cr_assert(strstr(err, "another model"), "%s", err);
	cr_assert(back == sentinel);

	w = expect_of(c);
	w.n_ctx = 8192;
	cr_assert_eq(bd_calib_load(path, &w, &back, err), -ESTALE);
	cr_assert(strstr(err, "2048") && strstr(err, "8192"), "%s", err);
	cr_assert(back == sentinel);

	w = expect_of(c);
	w.n_kv_heads = 3;
	cr_assert_eq(bd_calib_load(path, &w, &back, err), -ESTALE);
	cr_assert(back == sentinel);

	cr_assert_eq(bd_calib_load("/nonexistent/dir/x.calib", &w, &back, err), -ENOENT);
	cr_assert(back == sentinel);
	unlink(path);
	bd_calib_free(c);
}

Test(calib, corrupted_or_truncated_is_an_error)
{
	struct bd_calib *c = sample();
	struct bd_calib *const sentinel = (struct bd_calib *)&c;
	struct bd_calib *back = sentinel;
	struct bd_calib_expect w = expect_of(c);
	char err[BD_CALIB_ERR_MAX];
	size_t n = bd_calib_file_bytes(L, H, D);
	uint8_t *img = malloc(n + 1), *bad = malloc(n + 1);

	cr_assert(img && bad);
	cr_assert_eq(bd_calib_encode(c, img, n), (long)n);

	/* one flipped bit anywhere: magic, header, μ_k, trailer */
	static const size_t at[] = { 0, 9, 13, 33, 70, 96, 200, 96 + 4 * L * H * D + 5 };
	for (size_t i = 0; i < sizeof(at) / sizeof(at[0]); i++) {
		memcpy(bad, img, n);
		bad[at[i]] ^= 0x10;
		int r = bd_calib_decode(bad, n, &w, &back, err);
		/* a flipped version byte reads as another version before the checksum */
		cr_assert(r == -EBADMSG || (at[i] == 9 && r == -EPROTONOSUPPORT),
			  "byte %zu: %d %s", at[i], r, err);
		cr_assert(back == sentinel);
	}
	/* every truncation, and a trailing byte */
	for (size_t k = 0; k < n; k += (k < 140 ? 1 : 61)) {
		cr_assert_eq(bd_calib_decode(img, k, &w, &back, err), -EBADMSG, "length %zu", k);
		cr_assert(back == sentinel);
	}
	cr_assert_eq(bd_calib_decode(img, n - 1, &w, &back, err), -EBADMSG);
	memcpy(bad, img, n);
	bad[n] = 0;
	cr_assert_eq(bd_calib_decode(bad, n + 1, &w, &back, err), -EBADMSG);
	cr_assert(strstr(err, "trailing"), "%s", err);
	cr_assert(back == sentinel);

	/* a well-formed file of another version: the version check, not the checksum */
	memcpy(bad, img, n);
	bad[8] = 2;
	bd_sha256(bad, n - 32, bad + n - 32);
	cr_assert_eq(bd_calib_decode(bad, n, &w, &back, err), -EPROTONOSUPPORT);
	/* a well-formed file with a NaN μ_k */
	memcpy(bad, img, n);
	memcpy(bad + 96 + 8, &(float){ NAN }, 4);
	bd_sha256(bad, n - 32, bad + n - 32);
	cr_assert_eq(bd_calib_decode(bad, n, &w, &back, err), -EBADMSG);
	cr_assert(back == sentinel);

	/* a truncated file on disk */
	const char *path = tmp_path();
	FILE *f = fopen(path, "wb");
	cr_assert(f && fwrite(img, 1, n / 2, f) == n / 2);
	fclose(f);
	cr_assert_eq(bd_calib_load(path, &w, &back, err), -EBADMSG);
	cr_assert(strstr(err, "truncated"), "%s", err);
	cr_assert(back == sentinel);
	unlink(path);
	free(img);
	free(bad);
	bd_calib_free(c);
}

Test(calib, encode_and_save_reject_bad_values)
{
	struct bd_calib *c = sample();
	size_t n = bd_calib_file_bytes(L, H, D);
	uint8_t *img = malloc(n);
	cr_assert(img);

	cr_assert_eq(bd_calib_encode(c, img, n - 1), -EINVAL);
	c->mu_k[3] = INFINITY;
	cr_assert_eq(bd_calib_encode(c, img, n), -EINVAL);
	c->mu_k[3] = 0.0f;
	c->tau = NAN;
	cr_assert_eq(bd_calib_encode(c, img, n), -EINVAL);
	c->tau = 0.01f;
	c->n_ctx = 0;
	cr_assert_eq(bd_calib_encode(c, img, n), -EINVAL);
	c->n_ctx = 16;
	/* a directory that does not exist: an error and no file */
	cr_assert_eq(bd_calib_save(c, "/nonexistent/dir/x.calib"), -ENOENT);
	cr_assert_eq(bd_calib_new(0, 1, 1, &c), -EINVAL);
	free(img);
	bd_calib_free(c);
}

/* ---- μ_k ---------------------------------------------------------------------------------- */

Test(calib, mu_mean)
{
	struct bd_mu_acc *a;
	float mu[2 * 1 * 2];
	uint64_t cnt = 0;

	cr_assert_eq(bd_mu_acc_new(2, 1, 2, &a), 0);
	/* layer 0: (1, 2), (3, -2), (2, 9) → (2, 3); layer 1: (0.5, 0), (0.5, 1), (2, 2) →
	 * (1, 1) */
	static const float k0[3][2] = { { 1, 2 }, { 3, -2 }, { 2, 9 } };
	static const float k1[3][2] = { { 0.5f, 0 }, { 0.5f, 1 }, { 2, 2 } };
	for (int i = 0; i < 3; i++) {
		cr_assert_eq(bd_mu_acc_add(a, 0, k0[i]), 0);
		if (i < 2)
			cr_assert_eq(bd_mu_acc_add(a, 1, k1[i]), 0);
	}
	/* layer 1 is one position short: no mean yet */
	cr_assert_eq(bd_mu_acc_mean(a, mu, &cnt), -EINVAL);
	cr_assert_eq(bd_mu_acc_add(a, 1, (const float[2]){ NAN, 0 }), -EDOM);
	cr_assert_eq(bd_mu_acc_add(a, 2, k1[2]), -EINVAL);
	cr_assert_eq(bd_mu_acc_add(a, 1, k1[2]), 0);
	cr_assert_eq(bd_mu_acc_mean(a, mu, &cnt), 0);
	cr_assert_eq(cnt, 3);
	cr_assert(mu[0] == 2.0f && mu[1] == 3.0f && mu[2] == 1.0f && mu[3] == 1.0f,
		  "%g %g %g %g", mu[0], mu[1], mu[2], mu[3]);
	bd_mu_acc_free(a);
}

/* ---- τ --------------------------------------------------------------------------------------- */

Test(calib, tau_candidates)
{
	/* E4M3 subnormals are m·2^-9, normals of exponent 1 are (8 + m)·2^-9: codes 10 and 11 are
	 * 20/1024 and 22/1024, so index 11 is the paper's 21/1024 */
	cr_assert(bd_tau_candidate(0) == 0.0f);
	cr_assert(bd_tau_candidate(1) == 0.5f / 512.0f);
	cr_assert(bd_tau_candidate(3) == 2.5f / 512.0f);
	cr_assert(bd_tau_candidate(11) == 21.0f / 1024.0f);
	cr_assert(bd_tau_candidate(17) == 17.0f / 512.0f);
	cr_assert(bd_tau_candidate(81) == 8.5f);   /* between 8 (0x50) and 9 */
	cr_assert(bd_tau_candidate(126) == 432.0f); /* between 416 and 448 */
	cr_assert(isnan(bd_tau_candidate(127)) && isnan(bd_tau_candidate(-1)));
}

/* Four blocks whose errors under κ = 6 and κ = 2 are worked out by hand (c = 8; P = c·p;
 * s = E4M3(c·p_max / κ); P̂ = E2M1(P / s); error Σ (s·P̂ − P)²; u = 2^-18):
 *  A: p_max 2^-11, P = (2^-8): κ 6: 2^-8/6 rounds to s = 0, error (2^-8)² = 4u;
 *     κ 2: s = 2^-9, P̂ = 2, exact. Switches to κ = 2 at τ ≥ 2^-8: index 3 (2.5·2^-9).
 *  B: p_max 1, P = (8, 5): κ 6: s = E4M3(1.333) = 1.375, P̂ = (6, 4) → (8.25, 5.5), error
 *     .0625 + .25 = .3125; κ 2: s = 4, P̂ = (2, 1.25 → 1 by ties-to-even) → (8, 4), error 1.
 *     Switches at τ ≥ 8: index 81 (8.5).
 *  C: p_max 2^-8, P = (2^-5): κ 6: s = E4M3(.0052) = 3·2^-9, P̂ = 6 (5.33) → 18·2^-9 against
 *     16·2^-9, error 4u; κ 2: s = 2^-6, exact. Switches at τ ≥ 16·2^-9: index 17 (17·2^-9).
 *  D: p_max 2^-7, P = (2^-4, 2^-7): κ 6: s = 5·2^-9 (5.33 → 5), P̂ = (6 (6.4), 1 (0.8)) →
 *     (30, 5)·2^-9 against (32, 4)·2^-9, error 5u; κ 2: s = 2^-5, P̂ = (2, 0 (0.25 ties to
 *     0)), error (4·2^-9)² = 16u. Switches at τ ≥ 32·2^-9: index 25 (34·2^-9).
 * Totals: index < 3: .3125 + 13u; 3..16: .3125 + 9u; 17..24: .3125 + 5u; 25..80: .3125 + 16u;
 * ≥ 81: 1 + 16u. The least is at index 17: τ = 17/512. */
Test(calib, tau_search_hand_blocks)
{
	struct bd_tau_search ts;
	const double u = ldexp(1.0, -18);
	float P[16];

	cr_assert_eq(bd_tau_search_init(&ts, 8.0f), 0);
#define BLOCK(pmax, p0, p1)                                                 \
	do {                                                                \
		memset(P, 0, sizeof(P));                                    \
		P[0] = (p0);                                                \
		P[1] = (p1);                                                \
		cr_assert_eq(bd_tau_search_add_block(&ts, P, (pmax)), 0); \
	} while (0)
	BLOCK(ldexpf(1, -11), ldexpf(1, -8), 0.0f);
	BLOCK(1.0f, 8.0f, 5.0f);
	BLOCK(ldexpf(1, -8), ldexpf(1, -5), 0.0f);
	BLOCK(ldexpf(1, -7), ldexpf(1, -4), ldexpf(1, -7));
#undef BLOCK
	int j = -1;
	float tau = 0.0f;
	double best, all[BD_TAU_CANDIDATES];
	cr_assert_eq(bd_tau_search_result(&ts, &j, &tau, &best, all), 0);
	cr_assert_eq(ts.n_blocks, 4);
	cr_assert_eq(j, 17);
	cr_assert(tau == 17.0f / 512.0f);
	cr_assert_float_eq(best, 0.3125 + 5 * u, 1e-15);
	cr_assert_float_eq(all[0], 0.3125 + 13 * u, 1e-15);
	cr_assert_float_eq(all[2], 0.3125 + 13 * u, 1e-15);
	cr_assert_float_eq(all[3], 0.3125 + 9 * u, 1e-15);
	cr_assert_float_eq(all[16], 0.3125 + 9 * u, 1e-15);
	cr_assert_float_eq(all[24], 0.3125 + 5 * u, 1e-15);
	cr_assert_float_eq(all[25], 0.3125 + 16 * u, 1e-15);
	cr_assert_float_eq(all[80], 0.3125 + 16 * u, 1e-15);
	cr_assert_float_eq(all[81], 1.0 + 16 * u, 1e-15);
	cr_assert_float_eq(all[126], 1.0 + 16 * u, 1e-15);
}

/* b, fresh, given by hand the two P blocks of the replay below (c = 8): block 0 all f, 0 at key 0
 * (masked), 8f at key 2, p_max f; block 1 all 2^-8, 8 at key 4 (key 20 of the page), p_max 1. */
static void hand_blocks(struct bd_tau_search *b, float f)
{
	float P[16];

	cr_assert_eq(bd_tau_search_init(b, 8.0f), 0);
	for (int i = 0; i < 16; i++)
		P[i] = f;
	P[0] = 0.0f;
	P[2] = 8.0f * f;
	cr_assert_eq(bd_tau_search_add_block(b, P, f), 0);
	for (int i = 0; i < 16; i++)
		P[i] = ldexpf(1.0f, -8);
	P[4] = 8.0f;
	cr_assert_eq(bd_tau_search_add_block(b, P, 1.0f), 0);
}

/* The softmax replay feeds the blocks a decoder would quantize. Two tiles of 16 keys, key 0
 * masked (sink): tile 0 has S = −3 except S_2 = 0, so m = 0 and P = 8·2^S: 8 at key 2, 1
 * elsewhere, 0 at key 0, p_max 1; tile 1 has S = −10 except S_20 = 1, so m = 1: P_20 = 8,
 * others 8·2^-11, p_max 1. A replay must add exactly those two blocks. */
Test(calib, tau_replay_matches_hand_blocks)
{
	struct bd_tau_search a, b;
	float S[32];

	for (int i = 0; i < 32; i++)
		S[i] = i < 16 ? -3.0f : -10.0f;
	S[2] = 0.0f;
	S[20] = 1.0f;
	S[0] = NAN; /* masked: never read */
	cr_assert_eq(bd_tau_search_init(&a, 8.0f), 0);
	cr_assert_eq(bd_tau_search_add_logits(&a, S, 32, 1, 16), 0);

	hand_blocks(&b, 1.0f);

	cr_assert_eq(a.n_blocks, 2);
	cr_assert(a.err6 == b.err6);
	cr_assert(memcmp(a.delta, b.delta, sizeof(a.delta)) == 0);

	/* a tile of 32 keys (one tile): m = 1 from the start, so block 0 is scaled down by 2 */
	cr_assert_eq(bd_tau_search_init(&a, 8.0f), 0);
	cr_assert_eq(bd_tau_search_add_logits(&a, S, 32, 1, 32), 0);
	hand_blocks(&b, 0.5f);
	cr_assert(a.err6 == b.err6);
	cr_assert(memcmp(a.delta, b.delta, sizeof(a.delta)) == 0);
}

Test(calib, tau_bad_inputs)
{
	struct bd_tau_search ts;
	float P[16] = { 1.0f }, S[4] = { 0, 1, INFINITY, 2 };
	int j = 99;

	cr_assert_eq(bd_tau_search_init(&ts, 0.0f), -EINVAL);
	cr_assert_eq(bd_tau_search_init(&ts, 8.0f), 0);
	cr_assert_eq(bd_tau_search_result(&ts, &j, NULL, NULL, NULL), -EINVAL);
	cr_assert_eq(j, 99);
	cr_assert_eq(bd_tau_search_add_block(&ts, P, 2.0f), -EDOM);
	P[3] = -1.0f;
	cr_assert_eq(bd_tau_search_add_block(&ts, P, 0.5f), -EDOM);
	cr_assert_eq(bd_tau_search_add_logits(&ts, S, 4, 0, 16), -EDOM);
	cr_assert_eq(bd_tau_search_add_logits(&ts, S, 4, 0, 24), -EINVAL);
	cr_assert_eq(ts.n_blocks, 0);
	cr_assert(ts.err6 == 0.0);
	/* keys at n and beyond are never read */
	cr_assert_eq(bd_tau_search_add_logits(&ts, S, 2, 0, 16), 0);
	cr_assert_eq(ts.n_blocks, 1);
}
