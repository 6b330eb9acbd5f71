/* ops_check.c — the model kernels (kernels/bd_ops.h) against their CPU counterparts (lib/).
 *
 * `make gpu-test-ops` runs it on a machine with an NVIDIA GPU; one invocation checks every op
 * on random data with outliers, in the shapes of SmolLM2-135M (E 576, 9/3 heads, d 64, F 1536,
 * V 49152) and Qwen3-4B (E 2560, 32/8 heads, d 128, F 9728, V 151936), prints one PASS or FAIL
 * line per check with its numbers and exits non-zero on any failure:
 *   - embed: rows bitwise equal to the (widened) table rows, zero rows and status 1 for ids
 *     outside [0, V);
 *   - RMSNorm, per-head RMSNorm: ≤ 3 ulp (FP32) / ≤ 1 BF16 code from bd_rmsnorm — the only
 *     difference is the order of the double sum of squares, which moves the FP32 scale by at
 *     most 1 ulp in rare cases (then x·scale and ·w round once more each); bias add, add,
 *     cast: bitwise (one IEEE operation each);
 *   - RoPE vs bd_rope (both styles, partial rotary, positions up to 131071): |Δ| ≤ 2^-21·
 *     (|a| + |b|) for the pair (a, b) — cos/sin come from double pow/cos/sin rounded to FP32,
 *     which the device's 2-ulp double functions can move by 1 FP32 ulp (≤ 2^-24) when the double
 *     lies next to an FP32 rounding boundary; then a·c − b·s moves by at most 5·2^-24·(|a|+|b|)
 *     (the changed factor and the three roundings after it); channels past n_rot bitwise;
 *   - SwiGLU vs lib/model/model.c's silu(g)·u: ≤ 4 ulp (FP32) / ≤ 1 BF16 code (expf may differ by
 *     1 ulp between glibc and the device, then 1 + e, the division and ·u round once each);
 *   - KV write: slot bytes identical to bd_kv_write_token's for every configuration, d 64 and
 *     128, positions 0, 15, 16, 17, 127, 128, 200, then 128, 143, 255 (sink, ring wrap), with
 *     and without μ_k, into poisoned slots of a layout with one more KV head than written;
 *   - prefill attention vs a double-precision softmax over BF16-rounded K/V (bd_model.h's
 *     prefill) for n = 1, 17, 300, 2048 in both shapes: error normalized by Σp|v|/Σp ≤
 *     max(3e-5, 3 × the error of an FP32 CPU-order evaluation of the same rows);
 *   - prefill attention at n = 8192 in the Qwen3-4B shape: time (must be < 250 ms), finite;
 *   - a prefill chunk's pieces: the attention with a query offset over FP32 K/V
 *     (bd_op_prefill_attn_ctx, p = 128, 256, 384) against the double reference, bound as
 *     above; the context from pages and sink (bd_op_kv_context) bitwise equal to
 *     bd_page_read_head + the BF16 sink for every configuration; the chunk's rows
 *     (bd_op_kv_rows) bitwise equal to bd_kv_write_token's; the query rotation
 *     (bd_op_fwht_rows) bitwise equal to bd_fwht;
 *   - sampling: greedy and top-k 1 rows equal bd_sampler_sample's (ties, ±0, NaN, ±inf rows);
 *     for temperature / top-k / top-p settings the kept set equals bd_sampler_probs's non-zero
 *     set exactly, its mass agrees to the fixed-point resolution, the empirical distribution of
 *     draws over 64 rows × many steps passes a chi-square test at p = 1e-5 against
 *     bd_sampler_probs, no token outside the kept set is drawn, and draws are deterministic;
 *   - top-k: ids and values exactly the first k of the (value desc, id asc) order, with ties,
 *     ±0 and -inf;
 *   - log-probabilities vs bd_sampler_logprobs (the cpu backend's double log-sum-exp) for
 *     k = 0, 1, 5, 20, 64 on rows with ties, a ±0 tie at the max, ±FLT_MAX, a spread of
 *     ~1e4, -inf entries, ten or one finite values, a nearly one-hot row, and NaN, +inf and
 *     all -inf rows (NaN, ids −1: the CPU's -EDOM), tokens −1 and V (NaN): ids exactly the
 *     CPU's, values within one FP32 ulp plus the double-rounding bound of the two sums (lp_tol),
 *     through a reversed row list and a subset; the time of a 64-row launch (INFO);
 *   - fill_normal: mean, variance and the ±1σ fraction within 5 standard errors, the same
 *     values for a shorter len, BF16 the rounding of the FP32 values;
 *   - refusals (-EINVAL, nothing written) and a CUDA graph capture replaying bitwise.
 * `--small` runs small cases of every kernel (for compute-sanitizer).
 */
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>

#include "quant/bd_fp4.h"
#include "formats/bd_gguf.h"
#include "quant/bd_kvcfg.h"
#include "quant/bd_layout.h"
#include "model/bd_forward.h"
#include "bd_ops.h"
#include "base/bd_clock.h"
#include "base/bd_rand.h"
#include "model/bd_sampler.h"
#include "model_ops.h"
#include "gpu_ck.h"

static bool small;
static struct bd_rng rng;

static void report(bool ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void report(bool ok, const char *fmt, ...)
{
	va_list ap;

	if (ok)
		n_pass++;
	else
		n_fail++;
	fputs(ok ? "PASS " : "FAIL ", stdout);
	va_start(ap, fmt);
	vfprintf(stdout, fmt, ap);
	va_end(ap);
	fputc('\n', stdout);
	fflush(stdout);
}

/* ---- helpers ---------------------------------------------------------------------------------- */

static void *dmalloc(size_t n)
{
	void *p = NULL;

	CK(cudaMalloc(&p, n ? n : 1));
	return p;
}

static void h2d(void *d, const void *h, size_t n)
{
	CK(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice));
}

static void d2h(void *h, const void *d, size_t n)
{
	CK(cudaMemcpy(h, d, n, cudaMemcpyDeviceToHost));
}

static void *dup_to_dev(const void *h, size_t n)
{
	void *d = dmalloc(n);

	h2d(d, h, n);
	return d;
}

static void dsync(void)
{
	CK(cudaDeviceSynchronize());
}

static float gauss(void)
{
	return (float)bd_rng_normal(&rng);
}

/* Normal values with a few outliers (×outlier on ~1% of them). */
static void fill_gauss(float *x, size_t n, float sigma, float outlier)
{
	for (size_t i = 0; i < n; i++) {
		x[i] = sigma * gauss();
		if (bd_rng_uniform(&rng) < 0.01)
			x[i] *= outlier;
	}
}

static float bf16r(float x)
{
	return bd_bf16_to_f32(bd_f32_to_bf16(x));
}

static uint32_t fbits(float f)
{
	uint32_t u;

	memcpy(&u, &f, sizeof(u));
	return u;
}

/* Distance in units in the last place (±0 equal; NaN only equals NaN). */
static int64_t ulp_dist(float a, float b)
{
	if (isnan(a) || isnan(b))
		return isnan(a) && isnan(b) ? 0 : INT64_MAX;
	uint32_t ua = fbits(a), ub = fbits(b);
	int64_t ka = (ua & 0x80000000u) ? -(int64_t)(ua & 0x7fffffffu) : (int64_t)ua;
	int64_t kb = (ub & 0x80000000u) ? -(int64_t)(ub & 0x7fffffffu) : (int64_t)ub;
	return ka > kb ? ka - kb : kb - ka;
}

/* Compare FP32 results with ulp tolerance; returns the max distance, *ret_diff the count of
 * inexact values. */
static int64_t cmp_ulp(const float *gpu, const float *cpu, size_t n, size_t *ret_diff)
{
	int64_t mx = 0;
	size_t diff = 0;

	for (size_t i = 0; i < n; i++) {
		int64_t u = ulp_dist(gpu[i], cpu[i]);

		if (u)
			diff++;
		if (u > mx)
			mx = u;
	}
	*ret_diff = diff;
	return mx;
}

/* BF16 codes against the rounding of FP32 CPU values: max code distance. */
static int64_t cmp_bf16(const uint16_t *gpu, const float *cpu, size_t n, size_t *ret_diff)
{
	int64_t mx = 0;
	size_t diff = 0;

	for (size_t i = 0; i < n; i++) {
		int64_t u = ulp_dist(bd_bf16_to_f32(gpu[i]), bf16r(cpu[i])) >> 16;

		if (gpu[i] != bd_f32_to_bf16(cpu[i]))
			diff++;
		if (u > mx)
			mx = u;
	}
	*ret_diff = diff;
	return mx;
}

struct shape {
	const char *name;
	int E, Hq, Hkv, d, F, V;
};

static const struct shape shapes[2] = {
	{ "SmolLM2", 576, 9, 3, 64, 1536, 49152 },
	{ "Qwen3-4B", 2560, 32, 8, 128, 9728, 151936 },
};

static const char *dt_name(enum bd_dtype dt)
{
	return dt == BD_DT_BF16 ? "bf16" : "f32";
}

/* A dtype buffer on the host from FP32 values (BF16: rounded), and its FP32 view. */
static void *host_dt(const float *x, size_t n, enum bd_dtype dt, float *ret_view)
{
	if (dt == BD_DT_F32) {
		float *r = xmalloc(n * sizeof(float));

		memcpy(r, x, n * sizeof(float));
		memcpy(ret_view, x, n * sizeof(float));
		return r;
	}
	uint16_t *r = xmalloc(n * sizeof(uint16_t));
	for (size_t i = 0; i < n; i++) {
		r[i] = bd_f32_to_bf16(x[i]);
		ret_view[i] = bd_bf16_to_f32(r[i]);
	}
	return r;
}

static size_t dt_size(enum bd_dtype dt)
{
	return dt == BD_DT_BF16 ? 2 : 4;
}

/* Compare a device result of dtype dt with FP32 CPU values; ulp bound for FP32, code bound 1
 * for BF16. */
static bool cmp_dt(const void *dev, enum bd_dtype dt, const float *cpu, size_t n, int64_t f32_ulps,
		   int64_t *ret_max, size_t *ret_diff)
{
	void *h = xmalloc(n * dt_size(dt));
	bool ok;

	d2h(h, dev, n * dt_size(dt));
	if (dt == BD_DT_F32) {
		*ret_max = cmp_ulp(h, cpu, n, ret_diff);
		ok = *ret_max <= f32_ulps;
	} else {
		*ret_max = cmp_bf16(h, cpu, n, ret_diff);
		ok = *ret_max <= 1;
	}
	free(h);
	return ok;
}

/* ---- elementwise ops ---------------------------------------------------------------------------- */

static void check_embed(const struct shape *s)
{
	const int V = small ? 300 : 4096, E = s->E, n = 7;
	const int32_t tok[7] = { 5, 0, V - 1, -1, V, 17, 5 };
	float *tab = xmalloc((size_t)V * E * sizeof(float)), *view = xmalloc((size_t)V * E * 4);
	float *x = xmalloc((size_t)n * E * sizeof(float));
	int32_t *dtok = dup_to_dev(tok, sizeof(tok));
	float *dx = dmalloc((size_t)n * E * sizeof(float));
	int *dst = dmalloc(sizeof(int));

	fill_gauss(tab, (size_t)V * E, 1.0f, 20.0f);
	for (int t = 0; t < 2; t++) {
		enum bd_dtype dt = t ? BD_DT_BF16 : BD_DT_F32;
		void *ht = host_dt(tab, (size_t)V * E, dt, view);
		void *dtab = dup_to_dev(ht, (size_t)V * E * dt_size(dt));
		int st = 0, st2 = 0;
		size_t bad = 0;

		CK(cudaMemset(dx, 0xff, (size_t)n * E * sizeof(float)));
		CK(cudaMemset(dst, 0, sizeof(int)));
		CKR(bd_op_embed(dtab, dt, V, E, dtok, n, dx, dst, NULL));
		d2h(x, dx, (size_t)n * E * sizeof(float));
		d2h(&st, dst, sizeof(int));
		for (int i = 0; i < n; i++) {
			bool in = tok[i] >= 0 && tok[i] < V;

			for (int c = 0; c < E; c++) {
				float want = in ? view[(size_t)tok[i] * E + c] : 0.0f;

				if (fbits(x[(size_t)i * E + c]) != fbits(want))
					bad++;
			}
		}
		/* the valid rows alone leave the status alone */
		CK(cudaMemset(dst, 0, sizeof(int)));
		CKR(bd_op_embed(dtab, dt, V, E, dtok, 3, dx, dst, NULL));
		CKR(bd_op_embed(dtab, dt, V, E, dtok, 3, dx, NULL, NULL));
		d2h(&st2, dst, sizeof(int));
		report(bad == 0 && st == 1 && st2 == 0,
		       "embed %s %s: %zu wrong values, status %d with ids -1 and V, %d without", s->name,
		       dt_name(dt), bad, st, st2);
		free(ht);
		CK(cudaFree(dtab));
	}
	FREE_HOST(tab, view, x);
	FREE_DEV(dtok, dx, dst);
}

static void check_rmsnorm(const struct shape *s)
{
	const int n = small ? 2 : 8, E = s->E;
	const float eps = 1e-6f;
	const size_t N = (size_t)n * E;
	float *x = xmalloc(N * 4), *w = xmalloc((size_t)E * 4), *wv = xmalloc((size_t)E * 4);
	float *y = xmalloc(N * 4);
	float *dxx = dmalloc(N * 4);
	void *dy = dmalloc(N * 4);

	fill_gauss(x, N, 1.0f, 30.0f);
	for (int c = 0; c < E; c++)
		x[c] *= 1e-3f; /* a tiny row */
	if (n > 1)
		for (int c = 0; c < E; c++)
			x[E + c] *= 1e3f; /* a huge one */
	for (int c = 0; c < E; c++)
		w[c] = 1.0f + 0.3f * gauss();
	h2d(dxx, x, N * 4);
	for (int a = 0; a < 2; a++) {
		enum bd_dtype wdt = a ? BD_DT_BF16 : BD_DT_F32;
		void *hw = host_dt(w, (size_t)E, wdt, wv);
		void *dw = dup_to_dev(hw, (size_t)E * dt_size(wdt));

		for (int i = 0; i < n; i++)
			CKR(bd_rmsnorm(x + (size_t)i * E, wv, E, eps, y + (size_t)i * E));
		for (int b = 0; b < 2; b++) {
			enum bd_dtype ydt = b ? BD_DT_BF16 : BD_DT_F32;
			int64_t mx;
			size_t diff;

			CKR(bd_op_rmsnorm(dxx, dw, wdt, n, E, eps, dy, ydt, NULL));
			bool ok = cmp_dt(dy, ydt, y, N, 3, &mx, &diff);
			report(ok, "rmsnorm %s w %s y %s: max %lld %s, %zu of %zu inexact", s->name,
			       dt_name(wdt), dt_name(ydt), (long long)mx,
			       ydt == BD_DT_F32 ? "ulp (≤ 3)" : "bf16 codes (≤ 1)", diff, N);
		}
		free(hw);
		CK(cudaFree(dw));
	}

	/* per head, in place: x [n][Hq][d] */
	const int H = s->Hq, d = s->d;
	const size_t M = (size_t)n * H * d;
	float *xh = xmalloc(M * 4), *yh = xmalloc(M * 4), *wh = xmalloc((size_t)d * 4);
	float *whv = xmalloc((size_t)d * 4);
	float *dxh = dmalloc(M * 4);
	fill_gauss(xh, M, 2.0f, 10.0f);
	for (int c = 0; c < d; c++)
		wh[c] = 1.0f + 0.5f * gauss();
	for (int a = 0; a < 2; a++) {
		enum bd_dtype wdt = a ? BD_DT_BF16 : BD_DT_F32;
		void *hw = host_dt(wh, (size_t)d, wdt, whv);
		void *dw = dup_to_dev(hw, (size_t)d * dt_size(wdt));
		int64_t mx;
		size_t diff;

		for (size_t g = 0; g < (size_t)n * H; g++)
			CKR(bd_rmsnorm(xh + g * d, whv, d, eps, yh + g * d));
		h2d(dxh, xh, M * 4);
		CKR(bd_op_head_rmsnorm(dxh, dw, wdt, n, H, d, eps, NULL));
		bool ok = cmp_dt(dxh, BD_DT_F32, yh, M, 3, &mx, &diff);
		report(ok, "head_rmsnorm %s w %s: max %lld ulp (≤ 3), %zu of %zu inexact", s->name,
		       dt_name(wdt), (long long)mx, diff, M);
		free(hw);
		CK(cudaFree(dw));
	}
	FREE_HOST(x, w, wv, y, xh, yh, wh, whv);
	FREE_DEV(dxx, dy, dxh);
}

static void check_bias_add_cast(const struct shape *s)
{
	const int n = small ? 2 : 5, W = s->Hq * s->d;
	const size_t N = (size_t)n * W;
	float *x = xmalloc(N * 4), *b = xmalloc((size_t)W * 4), *bv = xmalloc((size_t)W * 4);
	float *y = xmalloc(N * 4), *want = xmalloc(N * 4);
	float *dx = dmalloc(N * 4), *dy = dmalloc(N * 4);

	fill_gauss(x, N, 1.0f, 100.0f);
	fill_gauss(b, (size_t)W, 0.5f, 10.0f);
	for (int a = 0; a < 2; a++) {
		enum bd_dtype bdt = a ? BD_DT_BF16 : BD_DT_F32;
		void *hb = host_dt(b, (size_t)W, bdt, bv);
		void *db = dup_to_dev(hb, (size_t)W * dt_size(bdt));
		size_t diff;

		for (size_t k = 0; k < N; k++)
			want[k] = x[k] + bv[k % (size_t)W];
		h2d(dx, x, N * 4);
		CKR(bd_op_bias_add(dx, db, bdt, n, W, NULL));
		d2h(y, dx, N * 4);
		int64_t mx = cmp_ulp(y, want, N, &diff);
		report(mx == 0, "bias_add %s b %s: %zu of %zu differ (bitwise)", s->name, dt_name(bdt),
		       diff, N);
		free(hb);
		CK(cudaFree(db));
	}

	/* add: x += y */
	fill_gauss(y, N, 3.0f, 100.0f);
	for (size_t k = 0; k < N; k++)
		want[k] = x[k] + y[k];
	h2d(dx, x, N * 4);
	h2d(dy, y, N * 4);
	CKR(bd_op_add(dx, dy, N, NULL));
	float *got = xmalloc(N * 4);
	size_t diff;
	d2h(got, dx, N * 4);
	int64_t amx = cmp_ulp(got, want, N, &diff);
	report(amx == 0, "add %s: %zu of %zu differ (bitwise)", s->name, diff, N);

	/* cast: random values plus the special ones of BF16 rounding */
	const float special[] = { 0.0f, -0.0f, 1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, -(1.0f + 0x1p-8f),
				  0x1.fffffep127f, -0x1.fffffep127f, 0x1.ff8p127f, INFINITY,
				  -INFINITY, NAN, 0x1p-149f, -0x1p-140f, 0x1.00fffep0f };
	for (size_t k = 0; k < sizeof(special) / sizeof(special[0]) && k < N; k++)
		x[k] = special[k];
	h2d(dx, x, N * 4);
	uint16_t *hb = xmalloc(N * 2);
	void *db = dmalloc(N * 2);
	size_t bad = 0;
	CKR(bd_op_cast(dx, db, BD_DT_BF16, N, NULL));
	d2h(hb, db, N * 2);
	for (size_t k = 0; k < N; k++)
		bad += hb[k] != bd_f32_to_bf16(x[k]);
	CKR(bd_op_cast(dx, dy, BD_DT_F32, N, NULL));
	d2h(got, dy, N * 4);
	for (size_t k = 0; k < N; k++)
		bad += fbits(got[k]) != fbits(x[k]);
	report(bad == 0, "cast %s f32→bf16 (ties, ±max, ±inf, NaN, subnormals) and f32→f32: %zu "
			 "differ from bd_f32_to_bf16 / copy",
	       s->name, bad);
	free(hb);
	CK(cudaFree(db));

	/* check_finite */
	int *dst = dmalloc(sizeof(int));
	int st[3];
	for (size_t k = 0; k < N; k++)
		x[k] = gauss();
	h2d(dx, x, N * 4);
	CK(cudaMemset(dst, 0, sizeof(int)));
	CKR(bd_op_check_finite(dx, N, dst, NULL));
	d2h(&st[0], dst, sizeof(int));
	x[N - 1] = NAN;
	h2d(dx, x, N * 4);
	CK(cudaMemset(dst, 0, sizeof(int)));
	CKR(bd_op_check_finite(dx, N, dst, NULL));
	d2h(&st[1], dst, sizeof(int));
	x[N - 1] = 1.0f;
	x[N / 3] = -INFINITY;
	h2d(dx, x, N * 4);
	CK(cudaMemset(dst, 0, sizeof(int)));
	CKR(bd_op_check_finite(dx, N, dst, NULL));
	d2h(&st[2], dst, sizeof(int));
	report(st[0] == 0 && st[1] == 1 && st[2] == 1,
	       "check_finite %s: status %d finite, %d with a NaN last, %d with -inf", s->name, st[0],
	       st[1], st[2]);
	CK(cudaFree(dst));
	FREE_HOST(x, b, bv, y, want, got);
	CK(cudaFree(dx));
	CK(cudaFree(dy));
}

static void check_rope(const struct shape *s)
{
	const int32_t posv[8] = { 0, 1, 15, 128, 4095, 32768, 65535, 131071 };
	const int n = small ? 3 : 8, H = s->Hq, d = s->d;
	const size_t N = (size_t)n * H * d;
	float *x = xmalloc(N * 4), *y = xmalloc(N * 4), *got = xmalloc(N * 4);
	float *dx = dmalloc(N * 4);
	int32_t *dpos = dup_to_dev(posv, sizeof(posv));

	fill_gauss(x, N, 1.0f, 30.0f);
	for (int style = 0; style < 2; style++) {
		for (int part = 0; part < 2; part++) {
			const int n_rot = part ? d / 2 : d;
			const float base = style == BD_ROPE_NEOX ? 1000000.0f : 10000.0f;
			double worst = 0.0;
			size_t diff = 0, bad = 0;

			memcpy(y, x, N * 4);
			for (int i = 0; i < n; i++)
				CKR(bd_rope(y + (size_t)i * H * d, H, d, n_rot, posv[i], base,
					    (enum bd_rope_style)style));
			h2d(dx, x, N * 4);
			CKR(bd_op_rope(dx, n, H, d, n_rot, dpos, base, style == BD_ROPE_NEOX, NULL));
			d2h(got, dx, N * 4);
			for (size_t g = 0; g < (size_t)n * H; g++) {
				const float *xi = x + g * d, *yc = y + g * d, *yg = got + g * d;

				for (int c = 0; c < d; c++) {
					/* the pair partner of channel c (itself beyond n_rot) */
					int half = n_rot / 2, o = c;
					if (c < n_rot)
						o = style == BD_ROPE_NORM ? c ^ 1 :
									    (c < half ? c + half : c - half);
					double bound = 0x1p-21 * (fabs(xi[c]) + fabs(xi[o]));
					double e = fabs((double)yg[c] - (double)yc[c]);

					if (c >= n_rot)
						bound = 0.0; /* untouched */
					if (fbits(yg[c]) != fbits(yc[c]))
						diff++;
					if (!(e <= bound))
						bad++;
					if (bound > 0 && e / bound > worst)
						worst = e / bound;
				}
			}
			report(bad == 0,
			       "rope %s %s n_rot %d: %zu of %zu differ, %zu beyond 2^-21·(|a|+|b|) "
			       "(worst %.3g of the bound)",
			       s->name, style == BD_ROPE_NORM ? "norm" : "neox", n_rot, diff, N, bad,
			       worst);
		}
	}
	FREE_HOST(x, y, got);
	CK(cudaFree(dx));
	CK(cudaFree(dpos));
}

/* lib/model/model.c's silu */
static float silu_ref(float x)
{
	return x / (1.0f + expf(-x));
}

static void check_swiglu(const struct shape *s)
{
	const int n = small ? 2 : 4, F = s->F;
	const size_t N = (size_t)n * F;
	float *gu = xmalloc(2 * N * 4), *want = xmalloc(N * 4);
	float *dgu = dmalloc(2 * N * 4);
	void *dy = dmalloc(N * 4);
	const float special[] = { 0.0f, -0.0f, -90.0f, -88.5f, 80.0f, -20.0f, 1e-30f, -1e-42f };

	fill_gauss(gu, 2 * N, 3.0f, 10.0f);
	for (size_t k = 0; k < sizeof(special) / sizeof(special[0]); k++)
		gu[k] = special[k];
	for (int i = 0; i < n; i++)
		for (int j = 0; j < F; j++) {
			const float *g = gu + (size_t)i * 2 * F;

			want[(size_t)i * F + j] = silu_ref(g[j]) * g[F + j];
		}
	h2d(dgu, gu, 2 * N * 4);
	for (int b = 0; b < 2; b++) {
		enum bd_dtype ydt = b ? BD_DT_BF16 : BD_DT_F32;
		int64_t mx;
		size_t diff;

		CKR(bd_op_swiglu(dgu, n, F, dy, ydt, NULL));
		bool ok = cmp_dt(dy, ydt, want, N, 4, &mx, &diff);
		report(ok, "swiglu %s y %s: max %lld %s, %zu of %zu inexact", s->name, dt_name(ydt),
		       (long long)mx, ydt == BD_DT_F32 ? "ulp (≤ 4)" : "bf16 codes (≤ 1)", diff, N);
	}
	free(gu);
	free(want);
	CK(cudaFree(dgu));
	CK(cudaFree(dy));
}

/* ---- KV write ----------------------------------------------------------------------------------- */

static void check_kv_write(void)
{
	static const struct {
		int slot, pos;
	} rounds[2][7] = {
		{ { 0, 0 }, { 0, 15 }, { 0, 16 }, { 0, 17 }, { 0, 127 }, { 1, 128 }, { 1, 200 } },
		{ { 0, 128 }, { 0, 143 }, { 1, 255 }, { -1, 0 }, { -1, 0 }, { -1, 0 }, { -1, 0 } },
	};
	const int nrow[2] = { 7, 3 };
	const int dims[2][2] = { { 64, 3 }, { 128, 8 } };
	int n_cfg_ok = 0, n_cfg = 0;

	for (int ci = 0; ci < BD_KVCFG_COUNT; ci++) {
		const struct bd_kvcfg *cfg = bd_kvcfg_get(ci);

		if (small && ci != BD_KVCFG_BITDECODING_NVFP4 && ci != BD_KVCFG_BF16)
			continue;
		for (int di = 0; di < 2; di++) {
			const int d = dims[di][0], H = dims[di][1], layer = 1;
			struct bd_layout lay;

			if (bd_layout_init(&lay, cfg->page_fmt, 2, H + 1, d, 0, 1) < 0) {
				report(false, "kv_write %s d %d: bd_layout_init refused", cfg->name, d);
				continue;
			}
			for (int withmu = 0; withmu < 2; withmu++) {
				const size_t sb = lay.slot_bytes;
				uint8_t *hs = xmalloc(2 * sb), *gs = xmalloc(2 * sb);
				uint8_t *ds = dmalloc(2 * sb);
				float *mu = xmalloc((size_t)H * d * 4);
				float *dmu = dmalloc((size_t)H * d * 4);
				bool ok = true;
				size_t first_bad = 0;

				for (size_t b = 0; b < 2 * sb; b++)
					hs[b] = (uint8_t)(bd_rng_u64(&rng) >> 56);
				h2d(ds, hs, 2 * sb);
				fill_gauss(mu, (size_t)H * d, 0.5f, 8.0f);
				h2d(dmu, mu, (size_t)H * d * 4);
				for (int r = 0; r < 2 && ok; r++) {
					const int n = nrow[r];
					const size_t rowf = (size_t)H * d;
					float *k = xmalloc((size_t)n * rowf * 4), *v = xmalloc((size_t)n * rowf * 4);
					void *ptrs[7];
					int32_t pos[7];

					fill_gauss(k, (size_t)n * rowf, 1.0f, 20.0f);
					fill_gauss(v, (size_t)n * rowf, 1.0f, 20.0f);
					/* BF16 ties: 1 + 2^-8 → 1, 1 + 3·2^-8 → 1 + 2^-6 */
					v[0] = 1.0f + 0x1p-8f;
					v[1] = -(1.0f + 3 * 0x1p-8f);
					if (!cfg->hadamard && !cfg->smoothing)
						k[2] = 1.0f + 0x1p-8f;
					for (int i = 0; i < n; i++) {
						ptrs[i] = ds + (size_t)rounds[r][i].slot * sb;
						pos[i] = rounds[r][i].pos;
						for (int h = 0; h < H; h++)
							CKR(bd_kv_write_token(
								&lay, cfg, hs + (size_t)rounds[r][i].slot * sb,
								layer, h, pos[i], k + ((size_t)i * H + h) * d,
								v + ((size_t)i * H + h) * d,
								withmu ? mu + (size_t)h * d : NULL));
					}
					void **dptrs = dup_to_dev(ptrs, sizeof(void *) * (size_t)n);
					int32_t *dpos = dup_to_dev(pos, sizeof(int32_t) * (size_t)n);
					float *dk = dup_to_dev(k, (size_t)n * rowf * 4);
					float *dv = dup_to_dev(v, (size_t)n * rowf * 4);
					CKR(bd_op_kv_write(&lay, cfg, layer, (void *const *)dptrs, dpos, dk, dv,
							   withmu ? dmu : NULL, n, H, NULL));
					d2h(gs, ds, 2 * sb);
					for (size_t b = 0; b < 2 * sb; b++)
						if (gs[b] != hs[b]) {
							ok = false;
							first_bad = b;
							break;
						}
					free(k);
					free(v);
					FREE_DEV(dptrs, dpos, dk, dv);
				}
				n_cfg++;
				n_cfg_ok += ok;
				if (!ok)
					report(false, "kv_write %s d %d %s: slot bytes differ from "
						      "bd_kv_write_token's, first at byte %zu",
					       cfg->name, d, withmu ? "with mu" : "mu NULL", first_bad);
				FREE_HOST(hs, gs, mu);
				CK(cudaFree(ds));
				CK(cudaFree(dmu));
			}
		}
	}
	report(n_cfg_ok == n_cfg && n_cfg > 0,
	       "kv_write: slot bytes identical to bd_kv_write_token for %d of %d (configuration, d, "
	       "mu) cases, positions 0 15 16 17 127 128 200 then 128 143 255",
	       n_cfg_ok, n_cfg);
}

/* ---- prefill attention --------------------------------------------------------------------------- */

struct attn_err {
	double gpu, cpu32; /* max error normalized by Σp|v|/Σp */
	size_t rows;
};

/* Query row i (at position p0 + i, seeing keys 0 .. p0 + i), head h: the double reference
 * (K/V as given), an FP32 CPU-order evaluation, and their normalized errors against the GPU
 * output row. pd, pf: scratch [p0 + i + 1]. */
static void attn_row(const float *q, const float *kb, const float *vb, int Hq, int Hkv, int d,
		     float scale, int p0, int i, int h, const float *gpu, double *pd, float *pf,
		     struct attn_err *err)
{
	const int hk = h / (Hq / Hkv);
	const float *qr = q + ((size_t)i * Hq + h) * d;
	double mx = -INFINITY, sd = 0.0;
	float mxf = -INFINITY, sf = 0.0f;
	double ref[128], A[128];
	float o32[128];

	for (int j = 0; j <= p0 + i; j++) {
		const float *kr = kb + ((size_t)j * Hkv + hk) * d;
		double a = 0.0;
		float b = 0.0f;

		for (int c = 0; c < d; c++) {
			a += (double)qr[c] * (double)kr[c];
			b += qr[c] * kr[c];
		}
		pd[j] = a * scale;
		pf[j] = b * scale;
		mx = pd[j] > mx ? pd[j] : mx;
		mxf = pf[j] > mxf ? pf[j] : mxf;
	}
	for (int c = 0; c < d; c++) {
		ref[c] = 0.0;
		A[c] = 0.0;
		o32[c] = 0.0f;
	}
	for (int j = 0; j <= p0 + i; j++) {
		const float *vr = vb + ((size_t)j * Hkv + hk) * d;
		double p = exp(pd[j] - mx);
		float pfl = expf(pf[j] - mxf);

		sd += p;
		sf += pfl;
		for (int c = 0; c < d; c++) {
			ref[c] += p * vr[c];
			A[c] += p * fabs(vr[c]);
			o32[c] += pfl * vr[c];
		}
	}
	const float inv = 1.0f / sf;
	const float *g = gpu + ((size_t)i * Hq + h) * d;
	for (int c = 0; c < d; c++) {
		double den = A[c] / sd + 1e-30, r = ref[c] / sd;
		double eg = fabs((double)g[c] - r) / den, ec = fabs((double)(o32[c] * inv) - r) / den;

		if (!(eg <= err->gpu))
			err->gpu = isnan(eg) ? INFINITY : eg;
		if (ec > err->cpu32)
			err->cpu32 = ec;
	}
	err->rows++;
}

/* One prefill check's buffers: n query rows over nk_rows keys and values of shape s, Gaussian
 * (two outlier key channels when outliers, as post-RoPE keys have), on the host and copied to
 * the device; out and dout [n, Hq, d], dout filled with NaNs; pd and pf [nk_rows] for
 * attn_row. */
struct prefill_case {
	size_t nq, nk;
	float *q, *k, *v, *out, *pf;
	double *pd;
	float *dq, *dk, *dv, *dout;
	struct attn_err err;
};

static void prefill_case_new(struct prefill_case *c, const struct shape *s, int n, int nk_rows,
			     bool outliers)
{
	const int d = s->d;

	c->nq = (size_t)n * s->Hq * d;
	c->nk = (size_t)nk_rows * s->Hkv * d;
	c->q = xmalloc(c->nq * 4);
	c->k = xmalloc(c->nk * 4);
	c->v = xmalloc(c->nk * 4);
	c->out = xmalloc(c->nq * 4);
	c->pd = xmalloc((size_t)nk_rows * sizeof(double));
	c->pf = xmalloc((size_t)nk_rows * sizeof(float));
	c->err = (struct attn_err){ 0, 0, 0 };
	fill_gauss(c->q, c->nq, 2.0f, 3.0f);
	fill_gauss(c->k, c->nk, 1.0f, 1.0f);
	fill_gauss(c->v, c->nk, 1.0f, 8.0f);
	for (size_t t = 0; outliers && t < (size_t)nk_rows * s->Hkv; t++) {
		c->k[t * d + 3] *= 4.0f;
		c->k[t * d + 17] *= 4.0f;
	}
	c->dq = dup_to_dev(c->q, c->nq * 4);
	c->dk = dup_to_dev(c->k, c->nk * 4);
	c->dv = dup_to_dev(c->v, c->nk * 4);
	c->dout = dmalloc(c->nq * 4);
	CK(cudaMemset(c->dout, 0xff, c->nq * 4));
}

static void prefill_case_free(struct prefill_case *c)
{
	FREE_HOST(c->q, c->k, c->v, c->out, c->pd, c->pf);
	FREE_DEV(c->dq, c->dk, c->dv, c->dout);
}

static void check_prefill(const struct shape *s, int n)
{
	const int Hq = s->Hq, Hkv = s->Hkv, d = s->d;
	const float scale = 1.0f / sqrtf((float)d);
	struct prefill_case c;

	prefill_case_new(&c, s, n, n, true);
	float *q = c.q, *k = c.k, *v = c.v, *out = c.out, *pf = c.pf;
	double *pd = c.pd;
	CKR(bd_op_prefill_attn(c.dq, c.dk, c.dv, n, Hq, Hkv, d, scale, c.dout, NULL));
	d2h(out, c.dout, c.nq * 4);
	for (size_t t = 0; t < c.nk; t++) {
		k[t] = bf16r(k[t]);
		v[t] = bf16r(v[t]);
	}
	if (n <= 300) {
		for (int i = 0; i < n; i++)
			for (int h = 0; h < Hq; h++)
				attn_row(q, k, v, Hq, Hkv, d, scale, 0, i, h, out, pd, pf, &c.err);
	} else {
		/* every row of the first and last head, every head of 32 rows */
		for (int i = 0; i < n; i++) {
			attn_row(q, k, v, Hq, Hkv, d, scale, 0, i, 0, out, pd, pf, &c.err);
			attn_row(q, k, v, Hq, Hkv, d, scale, 0, i, Hq - 1, out, pd, pf, &c.err);
		}
		for (int r = 0; r < 32; r++) {
			int i = r < 4 ? n - 1 - r : (int)(bd_rng_u64(&rng) % (uint64_t)n);

			for (int h = 1; h < Hq - 1; h++)
				attn_row(q, k, v, Hq, Hkv, d, scale, 0, i, h, out, pd, pf, &c.err);
		}
	}
	const double tol = fmax(3e-5, 3.0 * c.err.cpu32);
	report(c.err.gpu <= tol,
	       "prefill_attn %s n %d: max error %.3g (FP32 CPU order %.3g, bound %.3g) of Σp|v|/Σp "
	       "over %zu (row, head)",
	       s->name, n, c.err.gpu, c.err.cpu32, tol, c.err.rows);
	prefill_case_free(&c);
}

/* The chunk form (bd_op_prefill_attn_ctx): n query rows at positions p .. p+n−1 over p + n
 * FP32 keys and values used as given (not BF16-exact here: the kernel must not round them),
 * against the double reference with the offset causal mask; bound as check_prefill's. */
static void check_prefill_ctx(const struct shape *s, int p, int n)
{
	const int Hq = s->Hq, Hkv = s->Hkv, d = s->d;
	const float scale = 1.0f / sqrtf((float)d);
	struct prefill_case c;

	prefill_case_new(&c, s, n, p + n, false);
	CKR(bd_op_prefill_attn_ctx(c.dq, c.dk, c.dv, n, p, Hq, Hkv, d, scale, c.dout, NULL));
	d2h(c.out, c.dout, c.nq * 4);
	for (int i = 0; i < n; i++)
		for (int h = 0; h < Hq; h++)
			attn_row(c.q, c.k, c.v, Hq, Hkv, d, scale, p, i, h, c.out, c.pd, c.pf,
				 &c.err);
	const double tol = fmax(3e-5, 3.0 * c.err.cpu32);
	report(c.err.gpu <= tol,
	       "prefill_attn_ctx %s p %d n %d: max error %.3g (FP32 CPU order %.3g, bound %.3g) of "
	       "Σp|v|/Σp over %zu (row, head), FP32 K/V", s->name, p, n, c.err.gpu, c.err.cpu32,
	       tol, c.err.rows);
	prefill_case_free(&c);
}

/* A chunk's context (bd_op_kv_context) against bd_seq_cache_context's arithmetic
 * (bd_page_read_head per page-head, then the BF16 sink rows for a configuration with a sink),
 * bitwise, for every configuration, d 64 and 128: three pages written by bd_page_write_head
 * from random BF16 K'/V with outlier channels, read in the block-table order {2, 0, 3} of a
 * 4-page arena of 2 layers (layer 1) and H + 1 heads (H read); then the chunk's own rows
 * (bd_op_kv_rows) against bd_kv_write_token's stored row read back (bd_seq_cache_rows), and
 * the query rotation (bd_op_fwht_rows) against bd_fwht, bitwise. */
static void check_chunk_context(void)
{
	const int dims[2][2] = { { 64, 3 }, { 128, 8 } }, layer = 1, nb = 3, n_rows = 37;
	const int32_t bt[3] = { 2, 0, 3 };
	const float fp8s[2] = { 0.03125f, 0.0625f };
	int n_ok = 0, n_case = 0, rows_ok = 0, rows_case = 0;

	for (int ci = 0; ci < BD_KVCFG_COUNT; ci++) {
		const struct bd_kvcfg *cfg = bd_kvcfg_get(ci);

		if (small && ci != BD_KVCFG_BITDECODING_NVFP4 && ci != BD_KVCFG_BF16)
			continue;
		for (int di = 0; di < 2; di++) {
			const int d = dims[di][0], H = dims[di][1];
			const size_t T = BD_PAGE_TOKENS, kd = (size_t)H * d, rows = nb * T;
			struct bd_layout lay;

			if (bd_layout_init(&lay, cfg->page_fmt, 2, H + 1, d, 0, 4) < 0 || lay.d_rope)
				continue;
			uint8_t *arena = xmalloc(lay.arena_bytes), *slot = xmalloc(lay.slot_bytes);
			bd_bf16 *kb = xmalloc(T * d * 2), *vb = xmalloc(T * d * 2);
			float *tk = xmalloc(T * d * 4), *tv = xmalloc(T * d * 4), *f = xmalloc(T * d * 4);
			float *rk = xmalloc(rows * kd * 4), *rv = xmalloc(rows * kd * 4);
			float *gk = xmalloc(rows * kd * 4), *gv = xmalloc(rows * kd * 4);
			bool ok = true;

			/* the slot: finite BF16 everywhere (its sink rows are what a sink reads) */
			{
				size_t nbf = lay.slot_bytes / 2;
				float *x = xmalloc(nbf * 4);
				fill_gauss(x, nbf, 1.0f, 10.0f);
				for (size_t i = 0; i < nbf; i++) {
					bd_bf16 b = bd_f32_to_bf16(x[i]);
					memcpy(slot + 2 * i, &b, 2);
				}
				free(x);
			}
			for (int pg = 0; pg < 4 && ok; pg++)
				for (int h = 0; h <= H && ok; h++) {
					fill_gauss(f, T * d, 1.0f, 16.0f);
					for (size_t i = 0; i < T * d; i++)
						kb[i] = bd_f32_to_bf16(f[i]);
					fill_gauss(f, T * d, 1.0f, 4.0f);
					for (size_t i = 0; i < T * d; i++)
						vb[i] = bd_f32_to_bf16(f[i]);
					ok = bd_page_write_head(&lay, cfg, kb, vb, fp8s,
								bd_layout_page(&lay, arena, layer, pg),
								h) == 0;
				}
			for (int j = 0; j < nb && ok; j++)
				for (int h = 0; h < H && ok; h++) {
					ok = bd_page_read_head(&lay, bd_layout_page(&lay, arena, layer, bt[j]),
							       h, tk, tv, NULL) == 0;
					for (size_t t = 0; t < T; t++)
						for (int c = 0; c < d; c++) {
							size_t o = ((size_t)j * T + t) * kd + (size_t)h * d +
								   (size_t)c;
							rk[o] = tk[t * d + (size_t)c];
							rv[o] = tv[t * d + (size_t)c];
						}
				}
			if (cfg->sink)
				for (int h = 0; h < H; h++) {
					const bd_bf16 *sk = bd_slot_sink_k(&lay, slot, layer, h);
					const bd_bf16 *sv = bd_slot_sink_v(&lay, slot, layer, h);
					for (int t = 0; t < BD_SINK_TOKENS; t++)
						for (int c = 0; c < d; c++) {
							size_t o = (size_t)t * kd + (size_t)h * d + (size_t)c;
							rk[o] = bd_bf16_to_f32(sk[(size_t)t * d + (size_t)c]);
							rv[o] = bd_bf16_to_f32(sv[(size_t)t * d + (size_t)c]);
						}
				}
			if (!ok) {
				report(false, "kv_context %s d %d: the CPU page write or read failed",
				       cfg->name, d);
			} else {
				void *da = dup_to_dev(arena, lay.arena_bytes);
				void *ds = dup_to_dev(slot, lay.slot_bytes);
				int32_t *dbt = dup_to_dev(bt, sizeof(bt));
				float *dk = dmalloc(rows * kd * 4), *dv = dmalloc(rows * kd * 4);
				CKR(bd_op_kv_context(&lay, cfg, layer, da, dbt, nb, ds, H, dk, dv, NULL));
				d2h(gk, dk, rows * kd * 4);
				d2h(gv, dv, rows * kd * 4);
				size_t bad = 0, first = 0;
				for (size_t i = 0; i < rows * kd; i++)
					if (fbits(gk[i]) != fbits(rk[i]) || fbits(gv[i]) != fbits(rv[i])) {
						if (!bad++)
							first = i;
					}
				ok = bad == 0;
				if (!ok)
					report(false, "kv_context %s d %d: %zu of %zu values differ from "
						      "bd_page_read_head's (first at row %zu, column %zu)",
					       cfg->name, d, bad, rows * kd, first / kd, first % kd);
				FREE_DEV(da, ds, dbt, dk, dv);
			}
			n_case++;
			n_ok += ok;

			/* the chunk's rows: bd_kv_write_token into a scratch slot, read back */
			{
				float *k = xmalloc((size_t)n_rows * kd * 4), *v = xmalloc((size_t)n_rows * kd * 4);
				float *mu = xmalloc(kd * 4), *ek = xmalloc((size_t)n_rows * kd * 4);
				float *ev = xmalloc((size_t)n_rows * kd * 4);
				float *ok_ = xmalloc((size_t)n_rows * kd * 4), *ov = xmalloc((size_t)n_rows * kd * 4);
				uint8_t *scratch = xmalloc(lay.slot_bytes);
				bool rok = true;
				fill_gauss(k, (size_t)n_rows * kd, 1.0f, 20.0f);
				fill_gauss(v, (size_t)n_rows * kd, 1.0f, 20.0f);
				fill_gauss(mu, kd, 0.5f, 8.0f);
				for (int i = 0; i < n_rows && rok; i++)
					for (int h = 0; h < H && rok; h++) {
						size_t o = (size_t)i * kd + (size_t)h * d;
						rok = bd_kv_write_token(&lay, cfg, scratch, 0, 0,
									BD_SINK_TOKENS, k + o, v + o,
									mu + (size_t)h * d) == 0;
						const bd_bf16 *sk = bd_slot_recent_k(&lay, scratch, 0, 0) +
								    (size_t)BD_SINK_TOKENS * d;
						const bd_bf16 *sv = bd_slot_recent_v(&lay, scratch, 0, 0) +
								    (size_t)BD_SINK_TOKENS * d;
						for (int c = 0; c < d; c++) {
							ek[o + (size_t)c] = bd_bf16_to_f32(sk[c]);
							ev[o + (size_t)c] = bd_bf16_to_f32(sv[c]);
						}
					}
				float *dk = dup_to_dev(k, (size_t)n_rows * kd * 4);
				float *dv = dup_to_dev(v, (size_t)n_rows * kd * 4);
				float *dmu = dup_to_dev(mu, kd * 4);
				float *dok = dmalloc((size_t)n_rows * kd * 4), *dov = dmalloc((size_t)n_rows * kd * 4);
				CKR(bd_op_kv_rows(&lay, cfg, layer, dk, dv, dmu, n_rows, H, dok, dov, NULL));
				d2h(ok_, dok, (size_t)n_rows * kd * 4);
				d2h(ov, dov, (size_t)n_rows * kd * 4);
				for (size_t i = 0; rok && i < (size_t)n_rows * kd; i++)
					rok = fbits(ok_[i]) == fbits(ek[i]) && fbits(ov[i]) == fbits(ev[i]);
				if (!rok)
					report(false, "kv_rows %s d %d: rows differ from bd_kv_write_token's",
					       cfg->name, d);
				rows_case++;
				rows_ok += rok;
				FREE_HOST(k, v, mu, ek, ev, ok_, ov, scratch);
				FREE_DEV(dk, dv, dmu, dok, dov);
			}
			FREE_HOST(arena, slot, kb, vb, tk, tv, f, rk, rv, gk, gv);
		}
	}
	report(n_ok == n_case && n_case > 0,
	       "kv_context: K'/V of 3 pages (block table 2 0 3) and the sink bitwise equal to "
	       "bd_page_read_head + the BF16 sink for %d of %d (configuration, d) cases",
	       n_ok, n_case);
	report(rows_ok == rows_case && rows_case > 0,
	       "kv_rows: a chunk's K'/V rows bitwise equal to bd_kv_write_token's stored rows for %d "
	       "of %d (configuration, d) cases, with mu", rows_ok, rows_case);

	/* the query rotation */
	for (int di = 0; di < 2; di++) {
		const int d = dims[di][0], R = 45;
		float *x = xmalloc((size_t)R * d * 4), *y = xmalloc((size_t)R * d * 4);
		fill_gauss(x, (size_t)R * d, 2.0f, 16.0f);
		float *dx = dup_to_dev(x, (size_t)R * d * 4);
		CKR(bd_op_fwht_rows(dx, R, d, NULL));
		d2h(y, dx, (size_t)R * d * 4);
		bool fok = true;
		for (int r = 0; r < R; r++)
			CKR(bd_fwht(x + (size_t)r * d, d));
		for (size_t i = 0; i < (size_t)R * d; i++)
			fok &= fbits(x[i]) == fbits(y[i]);
		report(fok, "fwht_rows d %d: %d rows bitwise equal to bd_fwht", d, R);
		FREE_HOST(x, y);
		FREE_DEV(dx);
	}
}

static void time_prefill(void)
{
	const struct shape *s = &shapes[1];
	const int n = 8192, Hq = s->Hq, Hkv = s->Hkv, d = s->d, reps = 3;
	const size_t nq = (size_t)n * Hq * d, nk = (size_t)n * Hkv * d;
	float *dq = dmalloc(nq * 4), *dk = dmalloc(nk * 4), *dv = dmalloc(nk * 4);
	float *dout = dmalloc(nq * 4);
	int *dst = dmalloc(sizeof(int)), st = 0;
	cudaEvent_t e0, e1;
	float ms = 0.0f;

	CKR(bd_op_fill_normal(dq, BD_DT_F32, nq, 1, 0.0f, 2.0f, NULL));
	CKR(bd_op_fill_normal(dk, BD_DT_F32, nk, 2, 0.0f, 1.0f, NULL));
	CKR(bd_op_fill_normal(dv, BD_DT_F32, nk, 3, 0.0f, 1.0f, NULL));
	CKR(bd_op_prefill_attn(dq, dk, dv, n, Hq, Hkv, d, 1.0f / sqrtf((float)d), dout, NULL));
	CK(cudaEventCreate(&e0));
	CK(cudaEventCreate(&e1));
	CK(cudaEventRecord(e0, NULL));
	for (int r = 0; r < reps; r++)
		CKR(bd_op_prefill_attn(dq, dk, dv, n, Hq, Hkv, d, 1.0f / sqrtf((float)d), dout, NULL));
	CK(cudaEventRecord(e1, NULL));
	CK(cudaEventSynchronize(e1));
	CK(cudaEventElapsedTime(&ms, e0, e1));
	ms /= reps;
	CK(cudaMemset(dst, 0, sizeof(int)));
	CKR(bd_op_check_finite(dout, nq, dst, NULL));
	d2h(&st, dst, sizeof(int));
	/* causal: n²/2 scores, 2 flops each for Q·K and P·V per channel */
	const double tflops = 2.0 * (double)n * n * Hq * d / (ms * 1e-3) / 1e12;
	report(ms < 250.0f && st == 0,
	       "prefill_attn timing %s n %d: %.2f ms per layer (%.1f TFLOP/s effective, causal), "
	       "outputs %s",
	       s->name, n, ms, tflops, st ? "NOT finite" : "finite");
	CK(cudaEventDestroy(e0));
	CK(cudaEventDestroy(e1));
	FREE_DEV(dq, dk, dv, dout, dst);
}

/* ---- sampling ------------------------------------------------------------------------------------ */

static uint64_t host_key(float f, int id)
{
	uint32_t u = fbits(f);

	if (isnan(f))
		u = 0;
	else {
		if (f == 0.0f)
			u = 0;
		u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
	}
	return ((uint64_t)u << 32) | (uint32_t)~(uint32_t)id;
}

static int cpu_token(const float *lg, int V, float T, int top_k, float top_p)
{
	struct bd_sampler_params sp = { .temperature = T, .top_k = top_k, .top_p = top_p, .seed = 1 };
	struct bd_sampler *smp;
	int32_t tok = -1;

	CKR(bd_sampler_new(&sp, V, &smp));
	int r = bd_sampler_sample(smp, lg, &tok);
	bd_sampler_free(smp);
	return r < 0 ? -1 : tok;
}

static void check_greedy(int V)
{
	enum { N = 9 };
	float *lg = xmalloc((size_t)N * V * 4);
	struct bd_gsample p[N];
	int32_t got[N];
	int want[N];
	int bad = 0;

	memset(p, 0, sizeof(p));
	fill_gauss(lg, (size_t)N * V, 2.0f, 3.0f);
	for (int r = 0; r < N; r++)
		p[r].top_p = 1.0f;
	float *row;
	row = lg + 1 * (size_t)V; /* tie for the max: lowest id */
	row[V - 7] = 50.0f;
	row[100] = 50.0f;
	row = lg + 2 * (size_t)V; /* NaN */
	row[V / 2] = NAN;
	p[2].temperature = 0.8f;
	row = lg + 3 * (size_t)V; /* +inf */
	row[5] = INFINITY;
	row = lg + 4 * (size_t)V; /* all -inf */
	for (int i = 0; i < V; i++)
		row[i] = -INFINITY;
	row = lg + 5 * (size_t)V; /* ±0 tie at the max */
	for (int i = 0; i < V; i++)
		row[i] = -1.0f - fabsf(row[i]);
	row[9] = 0.0f;
	row[3] = -0.0f;
	row = lg + 6 * (size_t)V; /* one finite logit */
	for (int i = 0; i < V; i++)
		row[i] = -INFINITY;
	row[V - 1] = -1e30f;
	p[7].temperature = 1.0f; /* top-k 1 is greedy */
	p[7].top_k = 1;
	p[8].temperature = 0.0f; /* temperature 0 wins over top-k/top-p */
	p[8].top_k = 5;
	p[8].top_p = 0.5f;
	for (int r = 0; r < N; r++)
		want[r] = cpu_token(lg + (size_t)r * V, V, p[r].temperature, p[r].top_k, p[r].top_p);

	float *dlg = dup_to_dev(lg, (size_t)N * V * 4);
	struct bd_gsample *dp = dup_to_dev(p, sizeof(p));
	int32_t *dret = dmalloc(sizeof(got));
	void *ws = dmalloc(bd_op_sample_ws_bytes(N, V));
	CKR(bd_op_sample(dlg, N, V, dp, dret, ws, NULL));
	d2h(got, dret, sizeof(got));
	for (int r = 0; r < N; r++)
		bad += got[r] != want[r];
	report(bad == 0,
	       "sample greedy V %d: %d of %d rows differ from bd_sampler_sample (got %d %d %d %d %d "
	       "%d %d %d %d, want %d %d %d %d %d %d %d %d %d)",
	       V, bad, N, got[0], got[1], got[2], got[3], got[4], got[5], got[6], got[7], got[8],
	       want[0], want[1], want[2], want[3], want[4], want[5], want[6], want[7], want[8]);
	free(lg);
	FREE_DEV(dlg, dp, dret, ws);
}

/* Upper 1 − α quantile of χ²(df) by Wilson–Hilferty; z the normal quantile. */
static double chi2_crit(int df, double z)
{
	double a = 2.0 / (9.0 * df), t = 1.0 - a + z * sqrt(a);

	return df * t * t * t;
}

struct scfg {
	float T;
	int top_k;
	float top_p;
};

static void check_sample_dist(int V, const struct scfg *c, int launches)
{
	enum { ROWS = 64, HOT = 40 };
	float *lg = xmalloc((size_t)V * 4), *probs = xmalloc((size_t)V * 4);
	int hot[HOT];

	/* a tail of V − 40 tokens far below 40 hot ones, two of which tie */
	for (int i = 0; i < V; i++)
		lg[i] = -6.0f + gauss();
	for (int h = 0; h < HOT; h++) {
		hot[h] = (int)(bd_rng_u64(&rng) % (uint64_t)V);
		lg[hot[h]] = 4.0f * (float)bd_rng_uniform(&rng);
	}
	lg[hot[1]] = lg[hot[0]];

	struct bd_sampler_params sp = { .temperature = c->T, .top_k = c->top_k, .top_p = c->top_p };
	struct bd_sampler *smp;
	CKR(bd_sampler_new(&sp, V, &smp));
	CKR(bd_sampler_probs(smp, lg, probs));
	bd_sampler_free(smp);

	float *dlg = dmalloc((size_t)ROWS * V * 4);
	for (int r = 0; r < ROWS; r++)
		h2d(dlg + (size_t)r * V, lg, (size_t)V * 4);
	struct bd_gsample p[ROWS];
	memset(p, 0, sizeof(p));
	for (int r = 0; r < ROWS; r++) {
		p[r].temperature = c->T;
		p[r].top_k = c->top_k;
		p[r].top_p = c->top_p;
		p[r].seed = 7919u * (uint64_t)r + 12345u;
	}
	struct bd_gsample *dp = dmalloc(sizeof(p));
	int32_t *dret = dmalloc(sizeof(int32_t) * ROWS);
	struct bd_op_sample_rec *ws = dmalloc(bd_op_sample_ws_bytes(ROWS, V));
	struct bd_op_sample_rec rec[ROWS];
	uint64_t *count = xmalloc((size_t)V * sizeof(uint64_t));
	int32_t first[ROWS], again[ROWS], tok[ROWS];
	size_t outside = 0, neg = 0, draws = 0;
	double t0 = bd_now_s();

	for (int L = 0; L < launches; L++) {
		for (int r = 0; r < ROWS; r++)
			p[r].step = (uint64_t)L;
		h2d(dp, p, sizeof(p));
		CKR(bd_op_sample(dlg, ROWS, V, dp, dret, ws, NULL));
		d2h(tok, dret, sizeof(tok));
		if (L == 0) {
			memcpy(first, tok, sizeof(tok));
			d2h(rec, ws, sizeof(rec));
		}
		for (int r = 0; r < ROWS; r++) {
			if (tok[r] < 0 || tok[r] >= V) {
				neg++;
				continue;
			}
			count[tok[r]]++;
			draws++;
			if (probs[tok[r]] == 0.0f)
				outside++;
		}
	}
	const double secs = bd_now_s() - t0;
	/* determinism: step 0 again */
	for (int r = 0; r < ROWS; r++)
		p[r].step = 0;
	h2d(dp, p, sizeof(p));
	CKR(bd_op_sample(dlg, ROWS, V, dp, dret, ws, NULL));
	d2h(again, dret, sizeof(again));
	const bool same = memcmp(first, again, sizeof(first)) == 0;

	/* the kept set and its mass: every row's record */
	size_t kept_diff = 0, n_kept = 0;
	double lmax = -INFINITY, kmass = 0.0;
	for (int i = 0; i < V; i++)
		lmax = lg[i] > lmax ? lg[i] : lmax;
	for (int i = 0; i < V; i++) {
		bool g = host_key(lg[i], i) >= rec[0].thresh, cpu = probs[i] > 0.0f;

		kept_diff += g != cpu;
		n_kept += g;
		if (g)
			kmass += exp(((double)lg[i] - lmax) / (double)c->T);
	}
	bool recs_same = true;
	for (int r = 1; r < ROWS; r++)
		recs_same &= rec[r].thresh == rec[0].thresh && rec[r].kept_mass == rec[0].kept_mass;
	const double gmass = (double)rec[0].kept_mass / BD_OP_MASS_ONE;
	/* each fixed-point mass is within 2^-41 of the exact one */
	const double mass_tol = (double)n_kept * 0x1p-41 + 1e-12 * kmass;
	const bool mass_ok = fabs(gmass - kmass) <= mass_tol;

	/* χ²: tokens expected ≥ 5 times on their own, the rest of the kept set pooled */
	double chi2 = 0.0, pool_e = 0.0, pool_o = 0.0;
	int df = -1;
	for (int i = 0; i < V; i++) {
		if (probs[i] == 0.0f)
			continue;
		double e = (double)draws * probs[i];

		if (e >= 5.0) {
			chi2 += ((double)count[i] - e) * ((double)count[i] - e) / e;
			df++;
		} else {
			pool_e += e;
			pool_o += (double)count[i];
		}
	}
	if (pool_e >= 5.0) {
		chi2 += (pool_o - pool_e) * (pool_o - pool_e) / pool_e;
		df++;
	}
	const double crit = df > 0 ? chi2_crit(df, 4.265) : 0.0; /* p = 1e-5 */
	const bool ok = kept_diff == 0 && recs_same && mass_ok && outside == 0 && neg == 0 &&
			same && (df <= 0 || chi2 <= crit);
	report(ok,
	       "sample V %d T %.2f top-k %d top-p %.2f: kept set %zu tokens, %zu differ from "
	       "bd_sampler_probs; kept mass %.12g vs %.12g; %zu draws, chi2 %.1f (df %d, crit %.1f), "
	       "%zu outside the kept set, %zu refused, deterministic %s; %.2f ms per launch of %d rows",
	       V, c->T, c->top_k, c->top_p, n_kept, kept_diff, gmass, kmass, draws, chi2, df, crit,
	       outside, neg, same ? "yes" : "NO", 1e3 * secs / launches, ROWS);
	FREE_HOST(lg, probs, count);
	FREE_DEV(dlg, dp, dret, ws);
}

static void check_topk(int V)
{
	enum { N = 4 };
	const int ks[4] = { 1, 7, 40, 64 };
	float *lg = xmalloc((size_t)N * V * 4);
	int32_t *idx = xmalloc((size_t)V * 4);

	fill_gauss(lg, (size_t)N * V, 2.0f, 4.0f);
	for (int i = 0; i < V; i++) {
		float *r1 = lg + (size_t)V, *r2 = lg + 2 * (size_t)V, *r3 = lg + 3 * (size_t)V;

		r1[i] = floorf(r1[i] * 4.0f) / 4.0f; /* many ties */
		if (i % 7 == 0)
			r2[i] = -INFINITY;
		r3[i] = -INFINITY;
	}
	lg[2 * (size_t)V + 11] = 40.0f;
	lg[2 * (size_t)V + 5] = -0.0f;
	lg[2 * (size_t)V + 3] = 0.0f;
	for (int i = 0; i < 10; i++) /* ten finite values: k > 10 takes -inf ids, lowest first */
		lg[3 * (size_t)V + (size_t)(i * 997) % (size_t)V] = gauss();
	float *dlg = dup_to_dev(lg, (size_t)N * V * 4);
	for (int ki = 0; ki < 4; ki++) {
		const int k = ks[ki];
		int32_t *ids = xmalloc((size_t)N * k * 4);
		float *vals = xmalloc((size_t)N * k * 4);
		int32_t *dids = dmalloc((size_t)N * k * 4);
		float *dvals = dmalloc((size_t)N * k * 4);
		size_t bad = 0;

		CKR(bd_op_topk(dlg, N, V, k, dids, dvals, NULL));
		d2h(ids, dids, (size_t)N * k * 4);
		d2h(vals, dvals, (size_t)N * k * 4);
		for (int r = 0; r < N; r++) {
			const float *row = lg + (size_t)r * V;

			for (int i = 0; i < V; i++)
				idx[i] = i;
			bd_sampler_order(row, idx, (size_t)V);
			for (int j = 0; j < k; j++)
				bad += ids[r * k + j] != idx[j] ||
				       fbits(vals[r * k + j]) != fbits(row[idx[j]]);
		}
		report(bad == 0, "topk V %d k %d: %zu of %d entries differ from the (value desc, id asc) "
				 "order (ties, ±0, -inf rows)",
		       V, k, bad, N * k);
		free(ids);
		free(vals);
		CK(cudaFree(dids));
		CK(cudaFree(dvals));
	}
	free(lg);
	free(idx);
	CK(cudaFree(dlg));
}

/* ---- log-probabilities ----------------------------------------------------------------------------- */

/* How far bd_op_logprobs may lie from bd_sampler_logprobs (want) on a row of max m. Both
 * evaluate lse = m + log Σ exp(x − m) and (float)(x − lse) in double with the same operations;
 * they differ in the order of the sum (the CPU's sequential, relative error ≤ (V + 1)·2^-53; the
 * device's per-thread-then-tree, ≤ (V/1024 + 11)·2^-53) and in exp/log (glibc < 1 ulp, CUDA ≤
 * 1 ulp each: ≤ 2·2^-53 more per term, ≤ 2^-53·ln V on the log). So the doubles x − lse differ
 * by δ ≤ (V + 2)·2^-52 + 2^-51·(|m| + ln V + |x − lse|), and their FP32 roundings by at most one
 * FP32 ulp of the value when δ is below it (a double on either side of a rounding boundary),
 * else by δ plus that ulp. */
static double lp_tol(float want, double m, int V)
{
	const float a = fabsf(want);
	/* the spacing above a (below, at FLT_MAX, where the next one up is inf) */
	const double ulp = a < FLT_MAX ? (double)nextafterf(a, INFINITY) - (double)a
				       : (double)a - (double)nextafterf(a, 0.0f);

	return ulp + (V + 2.0) * 0x1p-52 + 0x1p-51 * (fabs(m) + log((double)V) + (double)a);
}

/* got within lp_tol of want, with -inf only equal to -inf and NaN only to NaN; *worst keeps the
 * largest |Δ| / tolerance seen. */
static bool lp_close(float got, float want, double m, int V, double *worst)
{
	if (isnan(want) || isnan(got))
		return isnan(want) && isnan(got);
	if (isinf(want) || isinf(got))
		return got == want;
	const double e = fabs((double)got - (double)want) / lp_tol(want, m, V);

	if (e > *worst)
		*worst = e;
	return e <= 1.0;
}

static void check_logprobs(int V)
{
	enum { N = 11 };
	const int ks[5] = { 0, 1, 5, 20, 64 };
	float *lg = xmalloc((size_t)N * V * 4);
	int32_t tok[N];
	int32_t want_ids[64];
	float want_lp[64];

	fill_gauss(lg, (size_t)N * V, 2.0f, 3.0f);
	for (int i = 0; i < V; i++) {
		float *r = lg;

		r[1 * (size_t)V + i] = floorf(r[1 * (size_t)V + i] * 4.0f) / 4.0f; /* many ties */
		r[2 * (size_t)V + i] *= 1e4f;                 /* large magnitudes, with ±FLT_MAX */
		r[3 * (size_t)V + i] *= 3e3f;                 /* large spread: most exp() underflow */
		r[4 * (size_t)V + i] = i % 7 == 0 ? -INFINITY : -1.0f - fabsf(r[4 * (size_t)V + i]);
		r[5 * (size_t)V + i] = -INFINITY;             /* ten finite values */
		r[9 * (size_t)V + i] = -INFINITY;             /* all -inf: refused */
		r[10 * (size_t)V + i] = -INFINITY;            /* one finite value */
	}
	lg[2 * (size_t)V + 7] = FLT_MAX;
	lg[2 * (size_t)V + 8] = -FLT_MAX;                     /* lp −2·FLT_MAX rounds to −inf */
	lg[4 * (size_t)V + 9] = 0.0f;                         /* a ±0 tie at the max */
	lg[4 * (size_t)V + 3] = -0.0f;
	for (int i = 0; i < 10; i++)
		lg[5 * (size_t)V + (size_t)(i * 997) % (size_t)V] = gauss();
	lg[6 * (size_t)V + 123] = 80.0f;                      /* nearly one-hot: lp ≈ 0 */
	lg[7 * (size_t)V + (size_t)V / 2] = NAN;              /* refused */
	lg[8 * (size_t)V + 5] = INFINITY;                     /* refused */
	lg[10 * (size_t)V + (size_t)V - 1] = -1e30f;
	for (int r = 0; r < N; r++)
		tok[r] = (int32_t)(((int64_t)r * 7919 + 13) % V);
	tok[2] = 7;
	tok[3] = -1; /* a refused draw: lp NaN, the top entries as usual */
	tok[4] = 3;  /* −0, tied with +0 at id 9 */
	tok[6] = 123;
	tok[10] = V; /* outside the vocabulary */

	/* every row, in reverse order, through the row list; then rows 6, 0, 2 */
	int32_t all[N], some[3] = { 6, 0, 2 };
	for (int j = 0; j < N; j++)
		all[j] = N - 1 - j;
	float *dlg = dup_to_dev(lg, (size_t)N * V * 4);
	int32_t *dtok = dup_to_dev(tok, sizeof(tok));
	int32_t *dall = dup_to_dev(all, sizeof(all)), *dsome = dup_to_dev(some, sizeof(some));
	float *dlp = dmalloc(N * 4), *dvals = dmalloc((size_t)N * 64 * 4);
	int32_t *dids = dmalloc((size_t)N * 64 * 4);
	float lp[N], *vals = xmalloc((size_t)N * 64 * 4);
	int32_t *ids = xmalloc((size_t)N * 64 * 4);

	for (int ki = 0; ki < 5; ki++) {
		const int k = ks[ki];
		size_t bad_lp = 0, bad_id = 0, bad_val = 0, exact = 0, values = 0;
		double worst = 0.0;

		for (int pass = 0; pass < 2; pass++) {
			const int m = pass ? 3 : N;
			const int32_t *rows = pass ? some : all;

			CK(cudaMemset(dlp, 0x7f, N * 4));
			CKR(bd_op_logprobs(dlg, V, pass ? dsome : dall, m, dtok, k, dlp,
					   k ? dids : NULL, k ? dvals : NULL, NULL));
			d2h(lp, dlp, (size_t)m * 4);
			if (k) {
				d2h(ids, dids, (size_t)m * k * 4);
				d2h(vals, dvals, (size_t)m * k * 4);
			}
			for (int j = 0; j < m; j++) {
				const int r = rows[j];
				const float *row = lg + (size_t)r * V;
				const bool in = tok[r] >= 0 && tok[r] < V;
				float want = NAN;
				double mx = -INFINITY;
				int n = bd_sampler_logprobs(row, V, tok[r], k, in ? &want : NULL,
							    want_ids, want_lp);

				for (int i = 0; i < V; i++)
					mx = row[i] > mx ? row[i] : mx;
				if (n < 0) {
					/* the CPU's -EDOM: NaN, ids −1 */
					bad_lp += !isnan(lp[j]);
					for (int i = 0; i < k; i++) {
						bad_id += ids[(size_t)j * k + i] != -1;
						bad_val += !isnan(vals[(size_t)j * k + i]);
					}
					continue;
				}
				bad_lp += !lp_close(lp[j], want, mx, V, &worst);
				values++;
				exact += fbits(lp[j]) == fbits(want) || (isnan(lp[j]) && isnan(want));
				for (int i = 0; i < k; i++) {
					const float v = vals[(size_t)j * k + i];

					bad_id += ids[(size_t)j * k + i] != want_ids[i];
					bad_val += !lp_close(v, want_lp[i], mx, V, &worst);
					values++;
					exact += fbits(v) == fbits(want_lp[i]);
				}
			}
		}
		report(bad_lp + bad_id + bad_val == 0,
		       "logprobs V %d k %d vs bd_sampler_logprobs (ties, ±0, ±FLT_MAX, ±inf, NaN, "
		       "tokens outside; all rows reversed, then 3): %zu sampled, %zu ids, %zu values "
		       "differ; worst |Δ|/tol %.3f, %zu of %zu bitwise equal",
		       V, k, bad_lp, bad_id, bad_val, worst, exact, values);
	}

	/* speed of a decode batch asking for 20 each (informative) */
	{
		enum { B = 64, REPS = 20 };
		float *blg = xmalloc((size_t)B * V * 4);
		int32_t btok[B];
		float *dblg, *dblp, *dbv;
		int32_t *dbtok, *dbid;
		cudaEvent_t e0, e1;
		float ms = 0.0f;

		fill_gauss(blg, (size_t)B * V, 2.0f, 3.0f);
		for (int r = 0; r < B; r++)
			btok[r] = r;
		dblg = dup_to_dev(blg, (size_t)B * V * 4);
		dbtok = dup_to_dev(btok, sizeof(btok));
		dblp = dmalloc(B * 4);
		dbv = dmalloc((size_t)B * 20 * 4);
		dbid = dmalloc((size_t)B * 20 * 4);
		CK(cudaEventCreate(&e0));
		CK(cudaEventCreate(&e1));
		CKR(bd_op_logprobs(dblg, V, NULL, B, dbtok, 20, dblp, dbid, dbv, NULL));
		CK(cudaEventRecord(e0, NULL));
		for (int i = 0; i < REPS; i++)
			CKR(bd_op_logprobs(dblg, V, NULL, B, dbtok, 20, dblp, dbid, dbv, NULL));
		CK(cudaEventRecord(e1, NULL));
		CK(cudaEventSynchronize(e1));
		CK(cudaEventElapsedTime(&ms, e0, e1));
		printf("INFO: logprobs V %d: %.1f us per launch of %d rows, top 20\n", V,
		       1e3 * ms / REPS, B);
		CK(cudaEventDestroy(e0));
		CK(cudaEventDestroy(e1));
		free(blg);
		FREE_DEV(dblg, dbtok, dblp, dbv, dbid);
	}
	FREE_HOST(lg, vals, ids);
	FREE_DEV(dlg, dtok, dall, dsome, dlp, dvals, dids);
}

/* ---- fill_normal --------------------------------------------------------------------------------- */

static void check_fill_normal(void)
{
	const size_t N = small ? 4096 : (size_t)1 << 22, M = 1000;
	const float mean = 0.5f, sigma = 2.0f;
	float *x = xmalloc(N * 4), *y = xmalloc(M * 4);
	uint16_t *xb = xmalloc(N * 2);
	float *dx = dmalloc(N * 4), *dy = dmalloc(M * 4);
	uint16_t *dxb = dmalloc(N * 2);
	double s1 = 0.0, s2 = 0.0, in1 = 0.0;
	size_t tail = 0, bfbad = 0, same_other = 0;

	CKR(bd_op_fill_normal(dx, BD_DT_F32, N, 42, mean, sigma, NULL));
	CKR(bd_op_fill_normal(dy, BD_DT_F32, M, 42, mean, sigma, NULL));
	CKR(bd_op_fill_normal(dxb, BD_DT_BF16, N, 42, mean, sigma, NULL));
	d2h(x, dx, N * 4);
	d2h(y, dy, M * 4);
	d2h(xb, dxb, N * 2);
	for (size_t i = 0; i < N; i++) {
		double z = ((double)x[i] - mean) / sigma;

		s1 += z;
		s2 += z * z;
		in1 += fabs(z) <= 1.0;
		bfbad += xb[i] != bd_f32_to_bf16(x[i]);
	}
	for (size_t i = 0; i < M; i++)
		tail += fbits(x[i]) != fbits(y[i]);
	CKR(bd_op_fill_normal(dy, BD_DT_F32, M, 43, mean, sigma, NULL));
	d2h(y, dy, M * 4);
	for (size_t i = 0; i < M; i++)
		same_other += fbits(x[i]) == fbits(y[i]);
	const double m = s1 / (double)N, var = s2 / (double)N - m * m, f1 = in1 / (double)N;
	const double se_m = 1.0 / sqrt((double)N), se_v = sqrt(2.0 / (double)N);
	const double se_f = sqrt(0.6827 * 0.3173 / (double)N);
	const bool ok = fabs(m) <= 5 * se_m && fabs(var - 1.0) <= 5 * se_v &&
			fabs(f1 - 0.6827) <= 5 * se_f && tail == 0 && bfbad == 0 && same_other < 5;
	report(ok,
	       "fill_normal %zu values: standardized mean %.2e (5σ %.1e), variance %.5f (5σ %.1e), "
	       "|z| ≤ 1 fraction %.5f (5σ %.1e); len %zu: %zu of its values differ; bf16 %zu differ; "
	       "seed 43 shares %zu of %zu",
	       N, m, 5 * se_m, var, 5 * se_v, f1, 5 * se_f, M, tail, bfbad, same_other, M);
	FREE_HOST(x, y, xb);
	FREE_DEV(dx, dy, dxb);
}

/* ---- refusals ------------------------------------------------------------------------------------- */

static void check_refusals(void)
{
	const int n = 4, E = 64, V = 100;
	float *dx = dmalloc((size_t)n * E * 4), *dy = dmalloc((size_t)n * E * 4 + 16);
	float *dw = dmalloc((size_t)E * 4);
	int32_t *dpos = dmalloc((size_t)n * 4), *dids = dmalloc(64 * 4);
	struct bd_gsample *dp = dmalloc(sizeof(struct bd_gsample) * (size_t)n);
	void *ws = dmalloc(bd_op_sample_ws_bytes(n, V));
	const enum bd_dtype bad_dt = (enum bd_dtype)7;
	int fails = 0, r;
	uint8_t *h = xmalloc((size_t)n * E * 4 + 16);
	struct bd_layout lay;
	const struct bd_kvcfg *cfg = bd_kvcfg_get(BD_KVCFG_BITDECODING_NVFP4);

	CK(cudaMemset(dx, 0, (size_t)n * E * 4));
	CK(cudaMemset(dy, 0x5a, (size_t)n * E * 4 + 16));
	CK(cudaMemset(dpos, 0, (size_t)n * 4));
	CKR(bd_layout_init(&lay, BD_PAGE_NVFP4, 2, 2, 64, 0, 1));
#define REFUSE(call)                                                                       \
	do {                                                                               \
		if ((r = (call)) != -EINVAL) {                                             \
			fails++;                                                           \
			printf("  %s returned %d, want -EINVAL\n", #call, r);              \
		}                                                                          \
	} while (0)
	REFUSE(bd_op_embed(NULL, BD_DT_F32, V, E, dpos, n, dy, NULL, NULL));
	REFUSE(bd_op_embed(dw, bad_dt, V, E, dpos, n, dy, NULL, NULL));
	REFUSE(bd_op_embed(dw, BD_DT_F32, 0, E, dpos, n, dy, NULL, NULL));
	REFUSE(bd_op_rmsnorm(dx, dw, BD_DT_F32, n, E, 0.0f, dy, BD_DT_F32, NULL));
	REFUSE(bd_op_rmsnorm(dx, dw, BD_DT_F32, -1, E, 1e-6f, dy, BD_DT_F32, NULL));
	REFUSE(bd_op_rmsnorm(dx, NULL, BD_DT_F32, n, E, 1e-6f, dy, BD_DT_F32, NULL));
	REFUSE(bd_op_head_rmsnorm(dy, dw, BD_DT_F32, n, 0, 16, 1e-6f, NULL));
	REFUSE(bd_op_bias_add(dy, dw, bad_dt, n, E, NULL));
	REFUSE(bd_op_rope(dy, n, 1, E, E - 1, dpos, 10000.0f, 1, NULL));
	REFUSE(bd_op_rope(dy, n, 1, E, E + 2, dpos, 10000.0f, 1, NULL));
	REFUSE(bd_op_rope(dy, n, 1, E, E, dpos, 10000.0f, 5, NULL));
	REFUSE(bd_op_rope(dy, n, 1, E, E, dpos, NAN, 0, NULL));
	REFUSE(bd_op_swiglu(dx, n, 0, dy, BD_DT_F32, NULL));
	REFUSE(bd_op_add(dy, NULL, 10, NULL));
	REFUSE(bd_op_cast(dx, dy, bad_dt, 10, NULL));
	REFUSE(bd_op_prefill_attn(dx, dx, dx, 1, 1, 1, 96, 0.1f, dy, NULL));
	REFUSE(bd_op_prefill_attn(dx, dx, dx, 1, 3, 2, 64, 0.1f, dy, NULL));
	REFUSE(bd_op_prefill_attn(dx, dx, dx, 1, 1, 1, 64, 0.1f, (float *)((char *)dy + 4), NULL));
	REFUSE(bd_op_prefill_attn(dx, dx, dx, (1 << 20) + 1, 1, 1, 64, 0.1f, dy, NULL));
	REFUSE(bd_op_kv_write(&lay, cfg, 2, (void *const *)dy, dpos, dx, dx, NULL, 1, 1, NULL));
	REFUSE(bd_op_kv_write(&lay, cfg, 0, (void *const *)dy, dpos, dx, dx, NULL, 1, 3, NULL));
	REFUSE(bd_op_kv_write(&lay, NULL, 0, (void *const *)dy, dpos, dx, dx, NULL, 1, 1, NULL));
	REFUSE(bd_op_prefill_attn_ctx(dx, dx, dx, 1, -128, 1, 1, 64, 0.1f, dy, NULL));
	REFUSE(bd_op_prefill_attn_ctx(dx, dx, dx, 1, 128, 1, 1, 96, 0.1f, dy, NULL));
	REFUSE(bd_op_prefill_attn_ctx(dx, dx, dx, 2, (1 << 20) - 1, 1, 1, 64, 0.1f, dy, NULL));
	REFUSE(bd_op_kv_rows(&lay, cfg, 0, dx, dx, NULL, 1, 3, dy, dy, NULL));
	REFUSE(bd_op_kv_rows(&lay, cfg, 2, dx, dx, NULL, 1, 1, dy, dy, NULL));
	REFUSE(bd_op_fwht_rows(dy, 1, 96, NULL));
	REFUSE(bd_op_kv_context(&lay, cfg, 0, dx, dpos, -1, dx, 1, dy, dy, NULL));
	REFUSE(bd_op_kv_context(&lay, cfg, 0, dx, dpos, 1, dx, 3, dy, dy, NULL));
	REFUSE(bd_op_kv_context(&lay, cfg, 0, NULL, dpos, 1, dx, 1, dy, dy, NULL));
	REFUSE(bd_op_sample(dx, n, V, dp, dpos, NULL, NULL));
	REFUSE(bd_op_sample(dx, n, (1 << 23) + 1, dp, dpos, ws, NULL));
	REFUSE(bd_op_topk(dx, n, V, 65, dids, dy, NULL));
	REFUSE(bd_op_topk(dx, n, 10, 11, dids, dy, NULL));
	REFUSE(bd_op_topk(dx, n, V, 0, dids, dy, NULL));
	REFUSE(bd_op_logprobs(dx, V, NULL, n, dpos, 65, dy, dids, dy, NULL));
	REFUSE(bd_op_logprobs(dx, 10, NULL, n, dpos, 11, dy, dids, dy, NULL));
	REFUSE(bd_op_logprobs(dx, V, NULL, n, dpos, -1, dy, dids, dy, NULL));
	REFUSE(bd_op_logprobs(dx, V, NULL, n, dpos, 5, dy, NULL, dy, NULL));
	REFUSE(bd_op_logprobs(dx, V, NULL, n, dpos, 5, dy, dids, NULL, NULL));
	REFUSE(bd_op_logprobs(dx, V, NULL, n, NULL, 0, dy, NULL, NULL, NULL));
	REFUSE(bd_op_logprobs(dx, V, NULL, n, dpos, 0, NULL, NULL, NULL, NULL));
	REFUSE(bd_op_logprobs(NULL, V, NULL, n, dpos, 0, dy, NULL, NULL, NULL));
	REFUSE(bd_op_logprobs(dx, 0, NULL, n, dpos, 0, dy, NULL, NULL, NULL));
	REFUSE(bd_op_logprobs(dx, V, NULL, -1, dpos, 0, dy, NULL, NULL, NULL));
	REFUSE(bd_op_fill_normal(dy, BD_DT_F32, 10, 1, NAN, 1.0f, NULL));
	REFUSE(bd_op_fill_normal(dy, bad_dt, 10, 1, 0.0f, 1.0f, NULL));
	REFUSE(bd_op_check_finite(dx, 10, NULL, NULL));
#undef REFUSE
	dsync();
	d2h(h, dy, (size_t)n * E * 4 + 16);
	size_t touched = 0;
	for (size_t b = 0; b < (size_t)n * E * 4 + 16; b++)
		touched += h[b] != 0x5a;
	/* n = 0 is a no-op, not an error */
	int zero = bd_op_rmsnorm(dx, dw, BD_DT_F32, 0, E, 1e-6f, dy, BD_DT_F32, NULL) |
		   bd_op_add(dy, dx, 0, NULL) | bd_op_sample(dx, 0, V, dp, dpos, ws, NULL) |
		   bd_op_logprobs(dx, V, NULL, 0, dpos, 5, dy, dids, dy, NULL);
	report(fails == 0 && touched == 0 && zero == 0,
	       "refusals: %d calls did not return -EINVAL, %zu output bytes touched, empty calls %d",
	       fails, touched, zero);
	free(h);
	FREE_DEV(dx, dy, dw, dpos, dids, dp, ws);
}

/* ---- graph capture ---------------------------------------------------------------------------------- */

/* The ops on a stream: rmsnorm, head norm, RoPE, prefill, KV write, sampling, top-k,
 * log-probabilities of the sampled tokens, fill. */
struct gwork {
	const struct shape *s;
	int n, V;
	struct bd_layout lay;
	const struct bd_kvcfg *cfg;
	float *x, *w, *xn, *q, *k, *v, *o, *lg, *tv, *nrm, *lpt, *lpv;
	int32_t *pos, *tok, *tid, *lpid;
	void **slots;
	uint8_t *slot;
	struct bd_gsample *p;
	void *ws;
};

static void gwork_run(struct gwork *g, cudaStream_t st)
{
	const struct shape *s = g->s;
	const int n = g->n;

	CKR(bd_op_rmsnorm(g->x, g->w, BD_DT_F32, n, s->E, 1e-6f, g->xn, BD_DT_F32, st));
	CKR(bd_op_head_rmsnorm(g->q, g->w, BD_DT_F32, n, s->Hq, s->d, 1e-6f, st));
	CKR(bd_op_rope(g->q, n, s->Hq, s->d, s->d, g->pos, 1e6f, 1, st));
	CKR(bd_op_rope(g->k, n, s->Hkv, s->d, s->d, g->pos, 1e6f, 1, st));
	CKR(bd_op_prefill_attn(g->q, g->k, g->v, n, s->Hq, s->Hkv, s->d, 0.125f, g->o, st));
	CKR(bd_op_kv_write(&g->lay, g->cfg, 0, (void *const *)g->slots, g->pos, g->k, g->v, NULL, n,
			   s->Hkv, st));
	CKR(bd_op_sample(g->lg, 4, g->V, g->p, g->tok, g->ws, st));
	CKR(bd_op_topk(g->lg, 4, g->V, 8, g->tid, g->tv, st));
	CKR(bd_op_logprobs(g->lg, g->V, NULL, 4, g->tok, 8, g->lpt, g->lpid, g->lpv, st));
	CKR(bd_op_fill_normal(g->nrm, BD_DT_F32, 1000, 9, 0.0f, 1.0f, st));
}

static void check_graph(void)
{
	struct gwork g;
	const struct shape *s = &shapes[0];
	const int n = 100, V = 5000;
	struct bd_gsample p[4];

	memset(&g, 0, sizeof(g));
	g.s = s;
	g.n = n;
	g.V = V;
	g.cfg = bd_kvcfg_get(BD_KVCFG_BITDECODING_NVFP4);
	CKR(bd_layout_init(&g.lay, BD_PAGE_NVFP4, 1, s->Hkv, s->d, 0, 1));
	const size_t nx = (size_t)n * s->E, nq = (size_t)n * s->Hq * s->d;
	const size_t nk = (size_t)n * s->Hkv * s->d;
	float *hx = xmalloc(nx * 4), *hq = xmalloc(nq * 4), *hk = xmalloc(nk * 4);
	float *hv = xmalloc(nk * 4), *hl = xmalloc((size_t)4 * V * 4), *hw = xmalloc((size_t)s->E * 4);
	int32_t pos[100];
	fill_gauss(hx, nx, 1.0f, 10.0f);
	fill_gauss(hq, nq, 1.0f, 10.0f);
	fill_gauss(hk, nk, 1.0f, 10.0f);
	fill_gauss(hv, nk, 1.0f, 10.0f);
	fill_gauss(hl, (size_t)4 * V, 2.0f, 3.0f);
	for (int c = 0; c < s->E; c++)
		hw[c] = 1.0f + 0.1f * gauss();
	for (int i = 0; i < n; i++)
		pos[i] = i;
	memset(p, 0, sizeof(p));
	for (int r = 0; r < 4; r++) {
		p[r].temperature = r ? 0.9f : 0.0f;
		p[r].top_k = r == 2 ? 20 : 0;
		p[r].top_p = r == 3 ? 0.7f : 1.0f;
		p[r].seed = 77u + (uint64_t)r;
		p[r].step = 3;
	}
	g.x = dup_to_dev(hx, nx * 4);
	g.w = dup_to_dev(hw, (size_t)s->E * 4);
	g.xn = dmalloc(nx * 4);
	g.q = dmalloc(nq * 4);
	g.k = dmalloc(nk * 4);
	g.v = dup_to_dev(hv, nk * 4);
	g.o = dmalloc(nq * 4);
	g.lg = dup_to_dev(hl, (size_t)4 * V * 4);
	g.tv = dmalloc(8 * 4 * 4);
	g.nrm = dmalloc(1000 * 4);
	g.pos = dup_to_dev(pos, sizeof(pos));
	g.tok = dmalloc(4 * 4);
	g.tid = dmalloc(8 * 4 * 4);
	g.lpt = dmalloc(4 * 4);
	g.lpid = dmalloc(8 * 4 * 4);
	g.lpv = dmalloc(8 * 4 * 4);
	g.slot = dmalloc(g.lay.slot_bytes);
	void *sp = g.slot;
	g.slots = dmalloc(sizeof(void *) * (size_t)n);
	void **ptrs = xmalloc(sizeof(void *) * (size_t)n);
	for (int i = 0; i < n; i++)
		ptrs[i] = sp;
	/* positions 0..99 of one slot: all distinct recent rows */
	h2d(g.slots, ptrs, sizeof(void *) * (size_t)n);
	g.p = dup_to_dev(p, sizeof(p));
	g.ws = dmalloc(bd_op_sample_ws_bytes(4, V));

	/* direct run */
	cudaStream_t st;
	CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
	const size_t outs = nx + nq + nq + 4 + 32 + 32 + 1000 + 4 + 32 + 32;
	float *res[2];
	uint8_t *slot_res[2];
	for (int pass = 0; pass < 2; pass++) {
		res[pass] = xmalloc(outs * 4);
		slot_res[pass] = xmalloc(g.lay.slot_bytes);
		h2d(g.q, hq, nq * 4);
		h2d(g.k, hk, nk * 4);
		CK(cudaMemset(g.slot, 0, g.lay.slot_bytes));
		CK(cudaMemset(g.o, 0, nq * 4));
		CK(cudaMemset(g.xn, 0, nx * 4));
		CK(cudaMemset(g.nrm, 0, 1000 * 4));
		dsync(); /* st does not wait for the legacy stream */
		if (pass == 0) {
			gwork_run(&g, st);
		} else {
			cudaGraph_t graph;
			cudaGraphExec_t exec;

			CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
			gwork_run(&g, st);
			CK(cudaStreamEndCapture(st, &graph));
			CK(cudaGraphInstantiate(&exec, graph, 0));
			CK(cudaGraphLaunch(exec, st));
			CK(cudaStreamSynchronize(st));
			CK(cudaGraphExecDestroy(exec));
			CK(cudaGraphDestroy(graph));
		}
		CK(cudaStreamSynchronize(st));
		float *r = res[pass];
		d2h(r, g.xn, nx * 4);
		d2h(r + nx, g.q, nq * 4);
		d2h(r + nx + nq, g.o, nq * 4);
		d2h(r + nx + 2 * nq, g.tok, 4 * 4);
		d2h(r + nx + 2 * nq + 4, g.tid, 32 * 4);
		d2h(r + nx + 2 * nq + 36, g.tv, 32 * 4);
		d2h(r + nx + 2 * nq + 68, g.nrm, 1000 * 4);
		d2h(r + nx + 2 * nq + 1068, g.lpt, 4 * 4);
		d2h(r + nx + 2 * nq + 1072, g.lpid, 32 * 4);
		d2h(r + nx + 2 * nq + 1104, g.lpv, 32 * 4);
		d2h(slot_res[pass], g.slot, g.lay.slot_bytes);
	}
	const bool ok = memcmp(res[0], res[1], outs * 4) == 0 &&
			memcmp(slot_res[0], slot_res[1], g.lay.slot_bytes) == 0;
	report(ok, "graph: every op captured into a CUDA graph replays bitwise like the direct run");
	CK(cudaStreamDestroy(st));
	for (int pass = 0; pass < 2; pass++) {
		free(res[pass]);
		free(slot_res[pass]);
	}
	FREE_HOST(hx, hq, hk, hv, hl, hw, ptrs);
	void *dev[] = { g.x, g.w, g.xn, g.q, g.k, g.v, g.o, g.lg, g.tv, g.nrm, g.pos, g.tok, g.tid,
			g.slot, g.slots, g.p, g.ws, g.lpt, g.lpid, g.lpv };
	for (size_t i = 0; i < sizeof(dev) / sizeof(dev[0]); i++)
		CK(cudaFree(dev[i]));
}

/* ---- main ------------------------------------------------------------------------------------------- */

int main(int argc, char **argv)
{
	int ndev = 0;
	struct cudaDeviceProp prop;
	double t0 = bd_now_s();

	for (int i = 1; i < argc; i++) {
		if (strcmp(argv[i], "--small") == 0) {
			small = true;
		} else {
			fprintf(stderr, "usage: %s [--small]\n", argv[0]);
			return 2;
		}
	}
	if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev < 1) {
		fprintf(stderr, "FATAL: no CUDA device\n");
		return 2;
	}
	CK(cudaGetDeviceProperties(&prop, 0));
	printf("ops_check on %s (sm_%d%d)%s\n", prop.name, prop.major, prop.minor,
	       small ? ", small cases" : "");
	bd_rng_seed(&rng, 20251109, 7);

	for (int si = 0; si < (small ? 1 : 2); si++) {
		const struct shape *s = &shapes[si];

		check_embed(s);
		check_rmsnorm(s);
		check_bias_add_cast(s);
		check_rope(s);
		check_swiglu(s);
	}
	check_kv_write();
	check_chunk_context();
	if (small) {
		check_prefill(&shapes[0], 17);
		check_prefill(&shapes[1], 70);
		check_prefill_ctx(&shapes[0], 128, 40);
	} else {
		for (int si = 0; si < 2; si++) {
			check_prefill_ctx(&shapes[si], 128, 1);
			check_prefill_ctx(&shapes[si], 256, 100);
			check_prefill_ctx(&shapes[si], 384, 300);
		}
		const int ns[4] = { 1, 17, 300, 2048 };

		for (int si = 0; si < 2; si++)
			for (int i = 0; i < 4; i++)
				check_prefill(&shapes[si], ns[i]);
		time_prefill();
	}

	check_greedy(small ? 3000 : shapes[0].V);
	if (!small)
		check_greedy(shapes[1].V);
	static const struct scfg cfgs[] = {
		{ 1.0f, 0, 1.0f }, { 0.7f, 20, 1.0f }, { 1.3f, 0, 0.8f },
		{ 1.0f, 30, 0.9f }, { 0.5f, 50, 0.95f },
	};
	for (size_t c = 0; c < sizeof(cfgs) / sizeof(cfgs[0]); c++)
		check_sample_dist(small ? 3000 : shapes[1].V, &cfgs[c], small ? 2 : 400);
	if (!small)
		check_sample_dist(shapes[0].V, &cfgs[3], 200);
	check_topk(small ? 3000 : shapes[1].V);
	if (!small)
		check_topk(shapes[0].V);
	check_logprobs(small ? 3000 : shapes[1].V);
	if (!small)
		check_logprobs(shapes[0].V);
	check_fill_normal();
	check_refusals();
	check_graph();

	printf("%s: %d passed, %d failed (%.1f s)\n", n_fail ? "FAIL" : "PASS", n_pass, n_fail,
	       bd_now_s() - t0);
	return n_fail ? 1 : 0;
}
