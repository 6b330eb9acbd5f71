/* kvemul.c — eval-time emulated K/V formats (bd_kvemul.h). */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "quant/bd_kvemul.h"
#include "quant/bd_layout.h"

/* Every emulated configuration: BF16 pages, the paper's key transform (smoothing, Hadamard) and
 * the 16 BF16 sink tokens, so that each differs from "emu-nvfp4" (the paper's NVFP4 K and V,
 * dequantized) or "emu-mxfp4" in one stated way. */
#define EMU(nm, ...)                                                                              \
	{ .name = nm, .page_fmt = BD_PAGE_BF16, .smoothing = true, .hadamard = true,             \
	  .key_search = true, .p_quant = BD_P_FP32, .sink = true,                                \
	  .emul = &(const struct bd_emul){ __VA_ARGS__ } }

#define NV(kr, vr) .k = BD_EMUL_NVFP4, .v = BD_EMUL_NVFP4, .k_rule = kr, .v_rule = vr
#define MX(kr, vr) .k = BD_EMUL_MXFP4, .v = BD_EMUL_MXFP4, .k_rule = kr, .v_rule = vr
#define SEARCH BD_EMUL_SEARCH
#define STD BD_EMUL_STANDARD

static const struct bd_kvcfg emus[] = {
	EMU("emu-nvfp4", NV(SEARCH, STD)),
	EMU("emu-k8v4", .k = BD_EMUL_FP8, .v = BD_EMUL_NVFP4),
	EMU("emu-k4v8", .k = BD_EMUL_NVFP4, .k_rule = SEARCH, .v = BD_EMUL_FP8),
	EMU("emu-k8v8", .k = BD_EMUL_FP8, .v = BD_EMUL_FP8),
	EMU("emu-kwide", NV(BD_EMUL_WIDE, STD)),
	EMU("emu-kopt", NV(BD_EMUL_OPTIMAL, STD)),
	EMU("emu-vsearch", NV(SEARCH, SEARCH)),
	EMU("emu-vopt", NV(SEARCH, BD_EMUL_OPTIMAL)),
	EMU("emu-kvopt", NV(BD_EMUL_OPTIMAL, BD_EMUL_OPTIMAL)),
	EMU("emu-krescale", NV(SEARCH, STD), .k_rescale = true),
	EMU("emu-vsmooth", NV(SEARCH, STD), .v_smooth = true),
	EMU("emu-mxfp4", MX(SEARCH, STD)),
	EMU("emu-mx-k8v4", .k = BD_EMUL_FP8, .v = BD_EMUL_MXFP4),
	EMU("emu-mx-k4v8", .k = BD_EMUL_MXFP4, .k_rule = SEARCH, .v = BD_EMUL_FP8),
	EMU("emu-mx-kwide", MX(BD_EMUL_WIDE, STD)),
	EMU("emu-mx-vsearch", MX(SEARCH, SEARCH)),
	EMU("emu-mx-krescale", MX(SEARCH, STD), .k_rescale = true),
	EMU("emu-mx-vsmooth", MX(SEARCH, STD), .v_smooth = true),
};

const struct bd_kvcfg *bd_kvemul_find(const char *name)
{
	if (!name)
		return NULL;
	for (size_t i = 0; i < sizeof(emus) / sizeof(emus[0]); i++)
		if (strcmp(emus[i].name, name) == 0)
			return &emus[i];
	return NULL;
}

/* ---- one block, quantized and dequantized in place ------------------------------------------ */

static float e2m1_round(float x)
{
	return bd_e2m1_decode(bd_e2m1_encode(x));
}

/* NVFP4 with E4M3 code sc and decode scale g: y_i = (g·s)·E2M1(x_i / (s·g)); returns Σ (y − x)². */
static float nvfp4_try(const float *x, int n, float g, uint8_t sc, float *y)
{
	float sv = bd_e4m3_decode(sc), gs = g * sv, inv = sv == 0.0f ? 0.0f : 1.0f / (sv * g);
	float err = 0.0f;

	for (int i = 0; i < n; i++) {
		y[i] = gs * e2m1_round(x[i] * inv);
		err = err + (y[i] - x[i]) * (y[i] - x[i]);
	}
	return err;
}

static void nvfp4_block(float *x, float g, enum bd_emul_rule rule)
{
	float amax = bd_abs_max(x, BD_NVFP4_BLOCK), y[BD_NVFP4_BLOCK], best[BD_NVFP4_BLOCK];
	static const float kap[4] = { 6.0f, 4.0f, 5.0f, 3.0f };
	uint8_t codes[32];
	int nc = 0;

	switch (rule) {
	case BD_EMUL_STANDARD:
	case BD_EMUL_SEARCH:
	case BD_EMUL_WIDE:
		for (int i = 0; i < (rule == BD_EMUL_STANDARD ? 1 : rule == BD_EMUL_SEARCH ? 2 : 4); i++)
			codes[nc++] = bd_e4m3_encode((amax / kap[i]) / g);
		break;
	case BD_EMUL_OPTIMAL: {
		int lo = (int)bd_e4m3_encode((amax / 6.0f) / g) - 1;
		int hi = (int)bd_e4m3_encode((amax / 3.0f) / g) + 1;
		for (int c = lo < 0 ? 0 : lo; c <= (hi > 126 ? 126 : hi) && nc < 32; c++)
			codes[nc++] = (uint8_t)c;
		break;
	}
	}
	float e_best = INFINITY;
	for (int c = 0; c < nc; c++) {
		float e = nvfp4_try(x, BD_NVFP4_BLOCK, g, codes[c], y);
		if (e < e_best) { /* the first candidate wins ties */
			e_best = e;
			memcpy(best, y, sizeof(best));
		}
	}
	memcpy(x, best, sizeof(best));
}

static void mxfp4_block(float *x, enum bd_emul_rule rule)
{
	float amax = bd_abs_max(x, BD_MXFP4_BLOCK), y[BD_MXFP4_BLOCK], best[BD_MXFP4_BLOCK];

	if (amax == 0.0f)
		return;
	int ex;
	frexpf(amax, &ex);
	int e_ocp = ex - 1 - 2; /* floor(log2 amax) − 2 */
	int cand[3] = { e_ocp, e_ocp + 1, e_ocp - 1 };
	int nc = rule == BD_EMUL_STANDARD ? 1 : rule == BD_EMUL_SEARCH ? 2 : 3;
	float e_best = INFINITY;
	for (int c = 0; c < nc; c++) {
		int e = cand[c] < -127 ? -127 : cand[c] > 127 ? 127 : cand[c];
		float s = ldexpf(1.0f, e), inv = ldexpf(1.0f, -e), err = 0.0f;
		for (int i = 0; i < BD_MXFP4_BLOCK; i++) {
			y[i] = s * e2m1_round(x[i] * inv);
			err = err + (y[i] - x[i]) * (y[i] - x[i]);
		}
		if (err < e_best) {
			e_best = err;
			memcpy(best, y, sizeof(best));
		}
	}
	memcpy(x, best, sizeof(best));
}

/* x [rows][cols] FP32 token-major; blocks along a row (keys) or along a column (values). */
static void fake_quant(float *x, size_t rows, size_t cols, bool along_rows, enum bd_emul_fmt f,
		       enum bd_emul_rule rule)
{
	size_t n = rows * cols;
	float amax = bd_abs_max(x, n);

	if (f == BD_EMUL_BF16 || amax == 0.0f)
		return;
	if (f == BD_EMUL_FP8) {
		float s = amax / 448.0f;
		for (size_t i = 0; i < n; i++)
			x[i] = bd_e4m3_decode(bd_e4m3_encode(x[i] / s)) * s;
		return;
	}
	int B = f == BD_EMUL_NVFP4 ? BD_NVFP4_BLOCK : BD_MXFP4_BLOCK;
	float g = amax / (6.0f * BD_NVFP4_KV_SMAX), buf[BD_MXFP4_BLOCK];
	size_t nrun = along_rows ? rows : cols, len = along_rows ? cols : rows;
	size_t es = along_rows ? 1 : cols, rs = along_rows ? cols : 1;
	for (size_t r = 0; r < nrun; r++) {
		for (size_t b = 0; b < len; b += (size_t)B) {
			float *src = x + r * rs + b * es;
			for (int i = 0; i < B; i++)
				buf[i] = src[(size_t)i * es];
			if (f == BD_EMUL_NVFP4)
				nvfp4_block(buf, g, rule);
			else
				mxfp4_block(buf, rule);
			for (int i = 0; i < B; i++)
				src[(size_t)i * es] = buf[i];
		}
	}
}

/* Keys with the per-channel rescaling of bd_emul.k_rescale (in the unrotated space). */
static int fake_quant_keys_rescaled(const struct bd_kvcfg *cfg, float *k, size_t d)
{
	const size_t T = BD_PAGE_TOKENS;
	float *r = calloc(d, sizeof(float));
	int rc = 0;

	if (!r)
		return -ENOMEM;
	for (size_t t = 0; t < T && cfg->hadamard && rc == 0; t++)
		rc = bd_fwht(k + t * d, (int)d); /* H·H = I: back to k − μ_k */
	for (size_t t = 0; t < T; t++)
		for (size_t c = 0; c < d; c++)
			r[c] = r[c] + k[t * d + c] * k[t * d + c];
	float mean = 0.0f;
	for (size_t c = 0; c < d; c++) {
		r[c] = sqrtf(r[c] / (float)T);
		mean = mean + r[c];
	}
	mean = mean / (float)d;
	for (size_t c = 0; c < d; c++)
		r[c] = r[c] > 0.0f && mean > 0.0f ? r[c] / mean : 1.0f;
	for (size_t t = 0; t < T && rc == 0; t++) {
		for (size_t c = 0; c < d; c++)
			k[t * d + c] = k[t * d + c] / r[c];
		if (cfg->hadamard)
			rc = bd_fwht(k + t * d, (int)d);
	}
	if (rc == 0)
		fake_quant(k, T, d, true, cfg->emul->k, cfg->emul->k_rule);
	for (size_t t = 0; t < T && rc == 0; t++) {
		if (cfg->hadamard)
			rc = bd_fwht(k + t * d, (int)d);
		for (size_t c = 0; c < d; c++)
			k[t * d + c] = k[t * d + c] * r[c];
		if (cfg->hadamard && rc == 0)
			rc = bd_fwht(k + t * d, (int)d);
	}
	free(r);
	return rc;
}

int bd_kvemul_head(const struct bd_kvcfg *cfg, bd_bf16 *k, bd_bf16 *v, size_t d, size_t dv)
{
	const size_t T = BD_PAGE_TOKENS;
	int rc = 0;

	if (!cfg || !cfg->emul || !k || !v || d == 0 || d % 32 != 0 || dv == 0 || dv % 32 != 0)
		return -EINVAL;
	float *fk = malloc(sizeof(float) * T * d), *fv = malloc(sizeof(float) * T * dv);
	float *mu = calloc(dv, sizeof(float));
	if (!fk || !fv || !mu) {
		rc = -ENOMEM;
		goto out;
	}
	for (size_t i = 0; i < T * d; i++)
		fk[i] = bd_bf16_to_f32(k[i]);
	for (size_t i = 0; i < T * dv; i++)
		fv[i] = bd_bf16_to_f32(v[i]);
	if (!bd_all_finite(fk, T * d) || !bd_all_finite(fv, T * dv)) {
		rc = -EDOM;
		goto out;
	}
	const struct bd_emul *e = cfg->emul;
	if (e->k_rescale)
		rc = fake_quant_keys_rescaled(cfg, fk, d);
	else
		fake_quant(fk, T, d, true, e->k, e->k_rule);
	if (rc < 0)
		goto out;
	if (e->v_smooth) {
		for (size_t t = 0; t < T; t++)
			for (size_t c = 0; c < dv; c++)
				mu[c] = mu[c] + fv[t * dv + c];
		for (size_t c = 0; c < dv; c++)
			mu[c] = mu[c] / (float)T;
		for (size_t t = 0; t < T; t++)
			for (size_t c = 0; c < dv; c++)
				fv[t * dv + c] = fv[t * dv + c] - mu[c];
	}
	fake_quant(fv, T, dv, false, e->v, e->v_rule);
	for (size_t t = 0; t < T; t++)
		for (size_t c = 0; c < dv; c++)
			fv[t * dv + c] = fv[t * dv + c] + mu[c];
	for (size_t i = 0; i < T * d; i++)
		k[i] = bd_f32_to_bf16(fk[i]);
	for (size_t i = 0; i < T * dv; i++)
		v[i] = bd_f32_to_bf16(fv[i]);
out:
	free(fk);
	free(fv);
	free(mu);
	return rc;
}
