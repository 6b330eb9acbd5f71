/* calib.c — SHA-256, the calibration file, the μ_k accumulator and the τ search (bd_calib.h,
 * NUMERICS.md §7). */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "quant/bd_calib.h"
#include "base/bd_err.h"
#include "quant/bd_fp4.h"

/* ---- SHA-256 (FIPS 180-4 §4.2.2, §5.3.3, §6.2) ----------------------------------------- */

/* First 32 bits of the fractional parts of the cube roots of the first 64 primes. */
static const uint32_t sha_k[64] = {
	0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
	0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
	0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
	0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
	0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
	0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
	0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
	0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
	0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
	0xc67178f2,
};

static uint32_t ror32(uint32_t x, int n)
{
	return (x >> n) | (x << (32 - n));
}

static void sha_block(uint32_t h[8], const uint8_t *p)
{
	uint32_t w[64], a, b, c, d, e, f, g, hh;

	for (int i = 0; i < 16; i++)
		w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 |
		       (uint32_t)p[4 * i + 2] << 8 | (uint32_t)p[4 * i + 3];
	for (int i = 16; i < 64; i++) {
		uint32_t s0 = ror32(w[i - 15], 7) ^ ror32(w[i - 15], 18) ^ (w[i - 15] >> 3);
		uint32_t s1 = ror32(w[i - 2], 17) ^ ror32(w[i - 2], 19) ^ (w[i - 2] >> 10);
		w[i] = w[i - 16] + s0 + w[i - 7] + s1;
	}
	a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
	for (int i = 0; i < 64; i++) {
		uint32_t S1 = ror32(e, 6) ^ ror32(e, 11) ^ ror32(e, 25);
		uint32_t ch = (e & f) ^ (~e & g);
		uint32_t t1 = hh + S1 + ch + sha_k[i] + w[i];
		uint32_t S0 = ror32(a, 2) ^ ror32(a, 13) ^ ror32(a, 22);
		uint32_t maj = (a & b) ^ (a & c) ^ (b & c);
		uint32_t t2 = S0 + maj;
		hh = g;
		g = f;
		f = e;
		e = d + t1;
		d = c;
		c = b;
		b = a;
		a = t1 + t2;
	}
	h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += hh;
}

void bd_sha256_init(struct bd_sha256 *s)
{
	/* first 32 bits of the fractional parts of the square roots of the first 8 primes */
	static const uint32_t h0[8] = { 0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
					0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19 };
	memcpy(s->h, h0, sizeof(h0));
	s->n_bytes = 0;
	s->fill = 0;
}

void bd_sha256_update(struct bd_sha256 *s, const void *data, size_t n)
{
	const uint8_t *p = data;

	s->n_bytes += n;
	if (s->fill) {
		size_t take = 64 - s->fill < n ? 64 - s->fill : n;
		memcpy(s->buf + s->fill, p, take);
		s->fill += take;
		p += take;
		n -= take;
		if (s->fill < 64)
			return;
		sha_block(s->h, s->buf);
		s->fill = 0;
	}
	for (; n >= 64; p += 64, n -= 64)
		sha_block(s->h, p);
	if (n)
		memcpy(s->buf, p, n);
	s->fill = n;
}

void bd_sha256_final(struct bd_sha256 *s, uint8_t ret[BD_SHA256_BYTES])
{
	uint64_t bits = s->n_bytes * 8;
	uint8_t pad[72] = { 0x80 };
	/* pad with 0x80, zeros to 56 mod 64, then the big-endian bit length */
	size_t npad = (s->fill < 56 ? 56 : 120) - s->fill;
	for (int i = 0; i < 8; i++)
		pad[npad + (size_t)i] = (uint8_t)(bits >> (56 - 8 * i));
	bd_sha256_update(s, pad, npad + 8);
	for (int i = 0; i < 8; i++)
		for (int j = 0; j < 4; j++)
			ret[4 * i + j] = (uint8_t)(s->h[i] >> (24 - 8 * j));
}

void bd_sha256(const void *data, size_t n, uint8_t ret[BD_SHA256_BYTES])
{
	struct bd_sha256 s;
	bd_sha256_init(&s);
	bd_sha256_update(&s, data, n);
	bd_sha256_final(&s, ret);
}

int bd_sha256_file(const char *path, uint8_t ret[BD_SHA256_BYTES])
{
	struct bd_sha256 s;
	uint8_t *buf;
	int fd, r = 0;

	if (!path || !ret)
		return -EINVAL;
	if ((fd = open(path, O_RDONLY | O_CLOEXEC)) < 0)
		return -errno;
	if (!(buf = malloc(1 << 20))) {
		close(fd);
		return -ENOMEM;
	}
	bd_sha256_init(&s);
	for (;;) {
		ssize_t n = read(fd, buf, 1 << 20);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0) {
			r = -errno;
			break;
		}
		if (n == 0)
			break;
		bd_sha256_update(&s, buf, (size_t)n);
	}
	free(buf);
	close(fd);
	if (r == 0)
		bd_sha256_final(&s, ret);
	return r;
}

void bd_sha256_hex(const uint8_t d[BD_SHA256_BYTES], char ret[2 * BD_SHA256_BYTES + 1])
{
	static const char hx[] = "0123456789abcdef";
	for (int i = 0; i < BD_SHA256_BYTES; i++) {
		ret[2 * i] = hx[d[i] >> 4];
		ret[2 * i + 1] = hx[d[i] & 15];
	}
	ret[2 * BD_SHA256_BYTES] = '\0';
}

/* ---- the calibration file --------------------------------------------------------------- */

#define CALIB_MAGIC "BDFP4CAL"
#define MAX_ELEMS (1u << 26) /* L·Hkv·d: far above any model this project runs */

#define fail(err, r, ...) bd_errf((err), BD_CALIB_ERR_MAX, (r), __VA_ARGS__)

static bool shape_ok(long L, long H, long d)
{
	return L > 0 && H > 0 && d > 0 && L <= MAX_ELEMS && H <= MAX_ELEMS && d <= MAX_ELEMS &&
	       (uint64_t)L * (uint64_t)H * (uint64_t)d <= MAX_ELEMS;
}

static size_t n_mu(const struct bd_calib *c)
{
	return (size_t)c->n_layers * (size_t)c->n_kv_heads * (size_t)c->head_dim;
}

int bd_calib_new(int n_layers, int n_kv_heads, int head_dim, struct bd_calib **ret)
{
	if (!ret || !shape_ok(n_layers, n_kv_heads, head_dim))
		return -EINVAL;
	struct bd_calib shape = { .n_layers = n_layers, .n_kv_heads = n_kv_heads,
				  .head_dim = head_dim };
	/* the calibration and its μ_k in one allocation, μ_k right after the struct */
	struct bd_calib *c = calloc(1, sizeof(*c) + n_mu(&shape) * sizeof(*c->mu_k));
	if (!c)
		return -ENOMEM;
	*c = shape;
	c->tile_keys = 64;
	c->tau = 21.0f / 1024.0f;
	c->c = 8.0f;
	c->tau_index = 11;
	c->mu_k = (float *)(c + 1);
	*ret = c;
	return 0;
}

void bd_calib_free(struct bd_calib *c)
{
	free(c);
}

size_t bd_calib_file_bytes(int n_layers, int n_kv_heads, int head_dim)
{
	if (!shape_ok(n_layers, n_kv_heads, head_dim))
		return 0;
	return BD_CALIB_HEADER_BYTES +
	       4 * (size_t)n_layers * (size_t)n_kv_heads * (size_t)head_dim + BD_SHA256_BYTES;
}

static void put32(uint8_t *p, uint32_t v)
{
	for (int i = 0; i < 4; i++)
		p[i] = (uint8_t)(v >> (8 * i));
}

static void put64(uint8_t *p, uint64_t v)
{
	for (int i = 0; i < 8; i++)
		p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get32(const uint8_t *p)
{
	return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t get64(const uint8_t *p)
{
	return (uint64_t)get32(p) | (uint64_t)get32(p + 4) << 32;
}

long bd_calib_encode(const struct bd_calib *c, void *buf, size_t cap)
{
	if (!c || !buf || !c->mu_k || !shape_ok(c->n_layers, c->n_kv_heads, c->head_dim))
		return -EINVAL;
	size_t need = bd_calib_file_bytes(c->n_layers, c->n_kv_heads, c->head_dim), n = n_mu(c);
	if (cap < need || c->n_ctx < 1 || c->tile_keys < 1 || !isfinite(c->tau) || c->tau < 0.0f ||
	    !isfinite(c->c) || !(c->c > 0.0f))
		return -EINVAL;
	for (size_t i = 0; i < n; i++)
		if (!isfinite(c->mu_k[i]))
			return -EINVAL;

	uint8_t *p = buf;
	memset(p, 0, BD_CALIB_HEADER_BYTES);
	memcpy(p, CALIB_MAGIC, 8);
	put32(p + 8, BD_CALIB_VERSION);
	put32(p + 12, (uint32_t)c->n_ctx);
	put32(p + 16, (uint32_t)c->n_layers);
	put32(p + 20, (uint32_t)c->n_kv_heads);
	put32(p + 24, (uint32_t)c->head_dim);
	put32(p + 28, (uint32_t)c->tile_keys);
	put32(p + 32, bd_f32_bits(c->tau));
	put32(p + 36, bd_f32_bits(c->c));
	put32(p + 40, (uint32_t)c->tau_index);
	put64(p + 48, c->n_key_tokens);
	put64(p + 56, c->n_p_blocks);
	memcpy(p + 64, c->model_sha256, BD_SHA256_BYTES);
	for (size_t i = 0; i < n; i++)
		put32(p + BD_CALIB_HEADER_BYTES + 4 * i, bd_f32_bits(c->mu_k[i]));
	bd_sha256(p, need - BD_SHA256_BYTES, p + need - BD_SHA256_BYTES);
	return (long)need;
}

int bd_calib_save(const struct bd_calib *c, const char *path)
{
	if (!c || !path)
		return -EINVAL;
	size_t need = bd_calib_file_bytes(c->n_layers, c->n_kv_heads, c->head_dim);
	if (need == 0)
		return -EINVAL;
	uint8_t *buf = malloc(need);
	if (!buf)
		return -ENOMEM;
	long n = bd_calib_encode(c, buf, need);
	if (n < 0) {
		free(buf);
		return (int)n;
	}

	size_t plen = strlen(path);
	char *tmp = malloc(plen + 16);
	if (!tmp) {
		free(buf);
		return -ENOMEM;
	}
	snprintf(tmp, plen + 16, "%s.tmpXXXXXX", path);
	int fd = mkostemp(tmp, O_CLOEXEC), r = 0;
	if (fd < 0) {
		r = -errno;
		free(tmp);
		free(buf);
		return r;
	}
	for (size_t off = 0; off < need && r == 0;) {
		ssize_t w = write(fd, buf + off, need - off);
		if (w < 0 && errno == EINTR)
			continue;
		if (w < 0)
			r = -errno;
		else
			off += (size_t)w;
	}
	if (r == 0 && fchmod(fd, 0644) < 0)
		r = -errno;
	if (r == 0 && fsync(fd) < 0)
		r = -errno;
	if (close(fd) < 0 && r == 0)
		r = -errno;
	if (r == 0 && rename(tmp, path) < 0)
		r = -errno;
	if (r < 0)
		unlink(tmp);
	free(tmp);
	free(buf);
	return r;
}

int bd_calib_decode(const void *buf, size_t n, const struct bd_calib_expect *want,
		    struct bd_calib **ret, char *ret_err)
{
	const uint8_t *p = buf;
	uint8_t sum[BD_SHA256_BYTES];

	if (ret_err)
		ret_err[0] = '\0';
	if (!buf || !ret)
		return fail(ret_err, -EINVAL, "missing argument");
	if (n < 8 || memcmp(p, CALIB_MAGIC, 8) != 0)
		return fail(ret_err, -EBADMSG, "not a bdfp4 calibration file (no BDFP4CAL magic)");
	if (n < BD_CALIB_HEADER_BYTES + BD_SHA256_BYTES)
		return fail(ret_err, -EBADMSG, "truncated: %zu bytes, a header alone is %d", n,
			    BD_CALIB_HEADER_BYTES + BD_SHA256_BYTES);
	uint32_t version = get32(p + 8);
	if (version != BD_CALIB_VERSION)
		return fail(ret_err, -EPROTONOSUPPORT,
			    "calibration format version %u, this build reads version %d", version,
			    BD_CALIB_VERSION);
	uint32_t ctx = get32(p + 12), L = get32(p + 16), H = get32(p + 20), d = get32(p + 24);
	if (!shape_ok(L, H, d))
		return fail(ret_err, -EBADMSG, "corrupted: shape %u layers × %u KV heads × %u", L,
			    H, d);
	size_t need = bd_calib_file_bytes((int)L, (int)H, (int)d);
	if (n != need)
		return fail(ret_err, -EBADMSG, "%s: %zu bytes where the header says %zu",
			    n < need ? "truncated" : "trailing bytes", n, need);
	bd_sha256(p, need - BD_SHA256_BYTES, sum);
	if (memcmp(sum, p + need - BD_SHA256_BYTES, BD_SHA256_BYTES) != 0)
		return fail(ret_err, -EBADMSG, "corrupted: the file's checksum does not match");

	float tau = bd_f32_from_bits(get32(p + 32)), c = bd_f32_from_bits(get32(p + 36));
	uint32_t tile = get32(p + 28);
	int32_t tidx = (int32_t)get32(p + 40);
	if (ctx < 1 || ctx > INT32_MAX || tile < 1 || tile > INT32_MAX || !isfinite(tau) ||
	    tau < 0.0f || !isfinite(c) || !(c > 0.0f))
		return fail(ret_err, -EBADMSG, "corrupted: context %u, B_k %u, τ %g, c %g", ctx,
			    tile, (double)tau, (double)c);

	if (want) {
		if (want->model_sha256 &&
		    memcmp(want->model_sha256, p + 64, BD_SHA256_BYTES) != 0) {
			char a[65], b[65];
			bd_sha256_hex(p + 64, a);
			bd_sha256_hex(want->model_sha256, b);
			return fail(ret_err, -ESTALE,
				    "calibrated for another model file (sha256 %.16s…, this model "
				    "%.16s…)",
				    a, b);
		}
		if (want->n_ctx > 0 && (uint32_t)want->n_ctx != ctx)
			return fail(ret_err, -ESTALE,
				    "calibrated for a context of %u tokens, not %d", ctx,
				    want->n_ctx);
		if ((uint32_t)want->n_layers != L || (uint32_t)want->n_kv_heads != H ||
		    (uint32_t)want->head_dim != d)
			return fail(ret_err, -ESTALE,
				    "calibrated for %u layers × %u KV heads × %u, the model has "
				    "%d × %d × %d",
				    L, H, d, want->n_layers, want->n_kv_heads, want->head_dim);
	}

	struct bd_calib *cal;
	int r = bd_calib_new((int)L, (int)H, (int)d, &cal);
	if (r < 0)
		return fail(ret_err, r, "out of memory");
	for (size_t i = 0; i < n_mu(cal); i++) {
		cal->mu_k[i] = bd_f32_from_bits(get32(p + BD_CALIB_HEADER_BYTES + 4 * i));
		if (!isfinite(cal->mu_k[i])) {
			bd_calib_free(cal);
			return fail(ret_err, -EBADMSG, "corrupted: a non-finite μ_k value");
		}
	}
	cal->n_ctx = (int)ctx;
	cal->tile_keys = (int)tile;
	cal->tau = tau;
	cal->c = c;
	cal->tau_index = tidx;
	cal->n_key_tokens = get64(p + 48);
	cal->n_p_blocks = get64(p + 56);
	memcpy(cal->model_sha256, p + 64, BD_SHA256_BYTES);
	*ret = cal;
	return 0;
}

int bd_calib_load(const char *path, const struct bd_calib_expect *want, struct bd_calib **ret,
		  char *ret_err)
{
	size_t cap = BD_CALIB_HEADER_BYTES + 4 * (size_t)MAX_ELEMS + BD_SHA256_BYTES;
	struct stat st;
	int fd, r = 0;

	if (ret_err)
		ret_err[0] = '\0';
	if (!path || !ret)
		return fail(ret_err, -EINVAL, "missing argument");
	if ((fd = open(path, O_RDONLY | O_CLOEXEC)) < 0 || fstat(fd, &st) < 0) {
		r = -errno;
		if (fd >= 0)
			close(fd);
		return fail(ret_err, r, "%s", strerror(-r));
	}
	if (!S_ISREG(st.st_mode) || (uint64_t)st.st_size > cap) {
		close(fd);
		return fail(ret_err, -EBADMSG, "not a calibration file (%s)",
			    S_ISREG(st.st_mode) ? "too large" : "not a regular file");
	}
	size_t n = (size_t)st.st_size, got = 0;
	uint8_t *buf = malloc(n ? n : 1);
	if (!buf) {
		close(fd);
		return fail(ret_err, -ENOMEM, "out of memory");
	}
	while (got < n) {
		ssize_t k = read(fd, buf + got, n - got);
		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0) {
			r = k < 0 ? -errno : -EBADMSG; /* shrank while read */
			break;
		}
		got += (size_t)k;
	}
	close(fd);
	if (r == 0)
		r = bd_calib_decode(buf, n, want, ret, ret_err);
	else
		fail(ret_err, r, "read failed: %s", strerror(-r));
	free(buf);
	return r;
}

/* ---- μ_k ------------------------------------------------------------------------------------ */

struct bd_mu_acc {
	int L, H, d;
	uint64_t *count;  /* [L] positions added; after sum[] */
	double sum[];     /* [L][H][d] */
};

int bd_mu_acc_new(int n_layers, int n_kv_heads, int head_dim, struct bd_mu_acc **ret)
{
	if (!ret || !shape_ok(n_layers, n_kv_heads, head_dim))
		return -EINVAL;
	size_t n = (size_t)n_layers * (size_t)n_kv_heads * (size_t)head_dim;
	/* the accumulator and its two arrays in one allocation */
	struct bd_mu_acc *a = calloc(1, sizeof(*a) + n * sizeof(*a->sum) +
					       (size_t)n_layers * sizeof(*a->count));
	if (!a)
		return -ENOMEM;
	*a = (struct bd_mu_acc){ .L = n_layers, .H = n_kv_heads, .d = head_dim };
	a->count = (uint64_t *)(a->sum + n);
	*ret = a;
	return 0;
}

void bd_mu_acc_free(struct bd_mu_acc *a)
{
	free(a);
}

int bd_mu_acc_add(struct bd_mu_acc *a, int layer, const float *k)
{
	if (!a || !k || layer < 0 || layer >= a->L)
		return -EINVAL;
	size_t n = (size_t)a->H * (size_t)a->d;
	for (size_t i = 0; i < n; i++)
		if (!isfinite(k[i]))
			return -EDOM;
	double *s = a->sum + (size_t)layer * n;
	for (size_t i = 0; i < n; i++)
		s[i] += k[i];
	a->count[layer]++;
	return 0;
}

int bd_mu_acc_mean(const struct bd_mu_acc *a, float *ret_mu, uint64_t *ret_count)
{
	if (!a || !ret_mu)
		return -EINVAL;
	uint64_t c = a->count[0];
	for (int l = 0; l < a->L; l++)
		if (a->count[l] != c)
			return -EINVAL;
	if (c == 0)
		return -EINVAL;
	size_t n = (size_t)a->L * (size_t)a->H * (size_t)a->d;
	for (size_t i = 0; i < n; i++)
		ret_mu[i] = (float)(a->sum[i] / (double)c);
	if (ret_count)
		*ret_count = c;
	return 0;
}

/* ---- τ ------------------------------------------------------------------------------------- */

float bd_tau_candidate(int j)
{
	if (j < 0 || j >= BD_TAU_CANDIDATES)
		return NAN;
	if (j == 0)
		return 0.0f;
	/* the mean of two neighbouring E4M3 values is exact in FP32 */
	return (bd_e4m3_decode((uint8_t)(j - 1)) + bd_e4m3_decode((uint8_t)j)) * 0.5f;
}

int bd_tau_search_init(struct bd_tau_search *ts, float c)
{
	if (!ts || !isfinite(c) || !(c > 0.0f))
		return -EINVAL;
	memset(ts, 0, sizeof(*ts));
	ts->c = c;
	return 0;
}

/* Σ (s_P·P̂_i − P_i)² of one block quantized with parameters ps. */
static double block_err(const float P[16], float p_max, const struct bd_pscale *ps)
{
	float phat[BD_NVFP4_BLOCK];
	uint8_t code = 0;
	double e = 0.0;

	bd_p_quantize_block_nvfp4(P, p_max, ps, phat, &code);
	double s = bd_e4m3_decode(code);
	for (int i = 0; i < BD_NVFP4_BLOCK; i++) {
		double x = s * phat[i] - (double)P[i];
		e += x * x;
	}
	return e;
}

int bd_tau_search_add_block(struct bd_tau_search *ts, const float P[16], float p_max)
{
	if (!ts || !P)
		return -EINVAL;
	if (!isfinite(p_max) || p_max < 0.0f || p_max > 1.0f)
		return -EDOM;
	for (int i = 0; i < BD_NVFP4_BLOCK; i++)
		if (!isfinite(P[i]) || P[i] < 0.0f)
			return -EDOM;

	/* κ = 6 for every block (underflow_aware off), κ = 2 forced by a τ with τ/c ≥ 1 ≥ p_max */
	const struct bd_pscale six = { ts->c, 0.0f, false }, two = { ts->c, ts->c, true };
	double e6 = block_err(P, p_max, &six), e2 = block_err(P, p_max, &two);

	/* the first candidate whose test p_max ≤ τ_j / c passes; later ones pass too */
	int lo = 0, hi = BD_TAU_CANDIDATES; /* answer in [lo, hi]; hi: none */
	while (lo < hi) {
		int mid = (lo + hi) / 2;
		if (p_max <= bd_tau_candidate(mid) / ts->c)
			hi = mid;
		else
			lo = mid + 1;
	}
	ts->err6 += e6;
	if (lo < BD_TAU_CANDIDATES)
		ts->delta[lo] += e2 - e6;
	ts->n_blocks++;
	return 0;
}

int bd_tau_search_add_logits(struct bd_tau_search *ts, const float *S, int n, int n_skip,
			     int tile_keys)
{
	if (!ts || (!S && n > 0) || n < 0 || n_skip < 0 || tile_keys < BD_NVFP4_BLOCK ||
	    tile_keys % BD_NVFP4_BLOCK != 0)
		return -EINVAL;
	for (int i = n_skip; i < n; i++)
		if (!isfinite(S[i]))
			return -EDOM;

	float log2c = log2f(ts->c), m = -INFINITY;
	for (int t0 = 0; t0 < n; t0 += tile_keys) {
		int t1 = t0 + tile_keys < n ? t0 + tile_keys : n;
		float m_tile = -INFINITY;
		for (int i = t0 < n_skip ? n_skip : t0; i < t1; i++)
			m_tile = fmaxf(m_tile, S[i]);
		float m_new = fmaxf(m, m_tile);
		if (m_new == -INFINITY)
			continue;
		for (int b = t0; b < t1; b += BD_NVFP4_BLOCK) {
			float P[BD_NVFP4_BLOCK], smax = -INFINITY;
			for (int i = 0; i < BD_NVFP4_BLOCK; i++) {
				int k = b + i;
				bool live = k >= n_skip && k < t1;
				P[i] = live ? exp2f(S[k] - m_new + log2c) : 0.0f;
				if (live)
					smax = fmaxf(smax, S[k]);
			}
			if (smax == -INFINITY)
				continue;
			int r = bd_tau_search_add_block(ts, P, exp2f(smax - m_new));
			if (r < 0)
				return r;
		}
		m = m_new;
	}
	return 0;
}

int bd_tau_search_result(const struct bd_tau_search *ts, int *ret_index, float *ret_tau,
			 double *ret_err, double *ret_err_all)
{
	if (!ts || ts->n_blocks == 0)
		return -EINVAL;
	double tot = ts->err6, best = INFINITY;
	int bj = 0;
	for (int j = 0; j < BD_TAU_CANDIDATES; j++) {
		tot += ts->delta[j];
		if (ret_err_all)
			ret_err_all[j] = tot;
		if (tot < best) {
			best = tot;
			bj = j;
		}
	}
	if (ret_index)
		*ret_index = bj;
	if (ret_tau)
		*ret_tau = bd_tau_candidate(bj);
	if (ret_err)
		*ret_err = best;
	return 0;
}
