/* decode_select.c — the decode family's start-up choice and the native family's self-check
 * (bd_decode_select.h). */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "bd_kernels.h"
#include "cuda/bd_cuda_err.h"
#include "cuda/bd_decode_select.h"

#define SC_B 2
#define SC_HKV 2
#define SC_SPLITS 2
#define SC_SEED 0x5e1fc4ec4ULL

/* 3 and 1 full pages, 37 and 1 recent tokens; the first request's sink is masked */
static const int sc_lens[SC_B] = { 3 * BD_PAGE_TOKENS + 37, BD_PAGE_TOKENS + 1 };

struct sc_problem {
	struct bd_layout lay;
	int d, G, Hq, bt_stride, max_len;
	void *arena, *slots;       /* device */
	void **slot_ptrs;
	int32_t *bt, *lens;
	float *q;
};

/* splitmix64, and a bell-shaped variate from four uniforms (mean 0, variance 1) */
static uint64_t sc_next(uint64_t *s)
{
	uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
	return z ^ (z >> 31);
}

static float sc_bell(uint64_t *s)
{
	float u = 0.0f;
	for (int i = 0; i < 4; i++)
		u += (float)(sc_next(s) >> 40) * (1.0f / 16777216.0f);
	return (u - 2.0f) * 1.7320508f;
}

static void sc_free(struct sc_problem *P)
{
	cudaFree(P->arena);
	cudaFree(P->slots);
	cudaFree(P->slot_ptrs);
	cudaFree(P->bt);
	cudaFree(P->lens);
	cudaFree(P->q);
	memset(P, 0, sizeof(*P));
}

#define SC_CUDA(call)                                       \
	do {                                                \
		if ((r = bd_cuda_errno(call)) < 0)          \
			goto out;                           \
	} while (0)

/* The fixed problem on the host (write path and promotion of lib/quant), then on the device */
static int sc_build(struct sc_problem *P, const struct bd_kvcfg *cfg, int d, int G)
{
	const size_t n_pages = 6;
	uint8_t *arena = NULL, *slots = NULL;
	float *k = NULL, *v = NULL, *q = NULL, *bias = NULL;
	int32_t bt[SC_B * 3];
	void *ptrs[SC_B];
	uint64_t s = SC_SEED;
	int r;

	memset(P, 0, sizeof(*P));
	P->d = d;
	P->G = G;
	P->Hq = G * SC_HKV;
	P->max_len = sc_lens[0];
	P->bt_stride = 3;
	if ((r = bd_layout_init(&P->lay, cfg->page_fmt, 1, SC_HKV, d, 0, n_pages)) < 0)
		return r;
	arena = calloc(1, P->lay.arena_bytes);
	slots = calloc(SC_B, P->lay.slot_bytes);
	k = malloc(sizeof(float) * (size_t)d);
	v = malloc(sizeof(float) * (size_t)d);
	bias = malloc(sizeof(float) * (size_t)d * SC_HKV);
	q = malloc(sizeof(float) * (size_t)SC_B * P->Hq * d);
	if (!arena || !slots || !k || !v || !bias || !q) {
		r = -ENOMEM;
		goto out;
	}
	/* pages in reverse order, unused entries -1 */
	for (int i = 0; i < SC_B * 3; i++)
		bt[i] = -1;
	for (int b = 0, next = (int)n_pages - 1; b < SC_B; b++)
		for (int p = 0; p < (sc_lens[b] - 1) / BD_PAGE_TOKENS; p++)
			bt[b * 3 + p] = next--;
	for (int i = 0; i < d * SC_HKV; i++)
		bias[i] = 1.5f * sc_bell(&s);
	for (int b = 0; b < SC_B; b++) {
		uint8_t *slot = slots + (size_t)b * P->lay.slot_bytes;
		for (int pos = 0; pos < sc_lens[b]; pos++) {
			for (int h = 0; h < SC_HKV; h++) {
				for (int c = 0; c < d; c++) {
					k[c] = bias[h * d + c] + sc_bell(&s);
					v[c] = sc_bell(&s);
				}
				k[(7 * h + 3) % d] *= 12.0f; /* an outlier channel per head */
				if ((r = bd_kv_write_token(&P->lay, cfg, slot, 0, h, pos, k, v,
							   NULL)) < 0)
					goto out;
			}
			if ((pos + 1) % BD_PAGE_TOKENS == 0 && pos + 1 < sc_lens[b] &&
			    (r = bd_page_promote(&P->lay, cfg, NULL, slot, arena,
						 bt[b * 3 + pos / BD_PAGE_TOKENS])) < 0)
				goto out;
		}
	}
	for (int i = 0; i < SC_B * P->Hq * d; i++)
		q[i] = 1.5f * sc_bell(&s) * (i % d == 5 ? 6.0f : 1.0f);

	SC_CUDA(cudaMalloc(&P->arena, P->lay.arena_bytes));
	SC_CUDA(cudaMalloc(&P->slots, P->lay.slot_bytes * SC_B));
	SC_CUDA(cudaMalloc((void **)&P->slot_ptrs, sizeof(ptrs)));
	SC_CUDA(cudaMalloc((void **)&P->bt, sizeof(bt)));
	SC_CUDA(cudaMalloc((void **)&P->lens, sizeof(sc_lens)));
	SC_CUDA(cudaMalloc((void **)&P->q, sizeof(float) * (size_t)SC_B * P->Hq * d));
	for (int b = 0; b < SC_B; b++)
		ptrs[b] = (uint8_t *)P->slots + (size_t)b * P->lay.slot_bytes;
	SC_CUDA(cudaMemcpy(P->arena, arena, P->lay.arena_bytes, cudaMemcpyHostToDevice));
	SC_CUDA(cudaMemcpy(P->slots, slots, P->lay.slot_bytes * SC_B, cudaMemcpyHostToDevice));
	SC_CUDA(cudaMemcpy(P->slot_ptrs, ptrs, sizeof(ptrs), cudaMemcpyHostToDevice));
	SC_CUDA(cudaMemcpy(P->bt, bt, sizeof(bt), cudaMemcpyHostToDevice));
	SC_CUDA(cudaMemcpy(P->lens, sc_lens, sizeof(sc_lens), cudaMemcpyHostToDevice));
	SC_CUDA(cudaMemcpy(P->q, q, sizeof(float) * (size_t)SC_B * P->Hq * d,
			   cudaMemcpyHostToDevice));
out:
	free(arena);
	free(slots);
	free(k);
	free(v);
	free(bias);
	free(q);
	if (r < 0)
		sc_free(P);
	return r;
}

/* One family's decode of the problem: out [B][Hq][d], lse [B][Hq] on the host, the status
 * bits into *ret_status. */
static int sc_run(const struct sc_problem *P, enum bd_kfamily f, const struct bd_kvcfg *cfg,
		  float *out, float *lse, int *ret_status, char *detail, size_t cap)
{
	struct bd_decode_plan pl;
	const size_t on = (size_t)SC_B * P->Hq * P->d, ln = (size_t)SC_B * P->Hq;
	float *d_out = NULL, *d_lse = NULL;
	int *d_status = NULL;
	void *ws = NULL;
	const char *step = "plan";
	int r;

	r = bd_decode_plan_init_family(&pl, f, cfg, &P->lay, NULL, SC_B, P->Hq, P->max_len,
				       SC_SPLITS);
	if (r < 0)
		goto out;
	step = "allocation";
	SC_CUDA(cudaMalloc((void **)&d_out, sizeof(float) * on));
	SC_CUDA(cudaMalloc((void **)&d_lse, sizeof(float) * ln));
	SC_CUDA(cudaMalloc((void **)&d_status, sizeof(int)));
	SC_CUDA(cudaMalloc(&ws, pl.ws_bytes));
	/* NaN wherever a kernel leaves something unwritten */
	SC_CUDA(cudaMemset(d_out, 0xff, sizeof(float) * on));
	SC_CUDA(cudaMemset(d_lse, 0xff, sizeof(float) * ln));
	SC_CUDA(cudaMemset(d_status, 0, sizeof(int)));
	if ((r = bd_decode_workspace_init(&pl, ws, NULL)) < 0)
		goto out;
	const struct bd_decode_args a = {
		.q = P->q,
		.arena = P->arena,
		.layer = 0,
		.block_table = P->bt,
		.bt_stride = P->bt_stride,
		.seq_lens = P->lens,
		.slots = P->slot_ptrs,
		.out = d_out,
		.lse = d_lse,
		.workspace = ws,
		.status = d_status,
	};
	step = "run";
	if ((r = bd_decode_run(&pl, &a, NULL)) < 0)
		goto out;
	SC_CUDA(cudaDeviceSynchronize());
	SC_CUDA(cudaMemcpy(out, d_out, sizeof(float) * on, cudaMemcpyDeviceToHost));
	SC_CUDA(cudaMemcpy(lse, d_lse, sizeof(float) * ln, cudaMemcpyDeviceToHost));
	SC_CUDA(cudaMemcpy(ret_status, d_status, sizeof(int), cudaMemcpyDeviceToHost));
out:
	if (r < 0)
		snprintf(detail, cap, "%s: %s failed (%s)", bd_kfamily_name(f), step,
			 strerror(-r));
	cudaFree(d_out);
	cudaFree(d_lse);
	cudaFree(d_status);
	cudaFree(ws);
	return r;
}

/* 0 when nat agrees with ref on every (request, head) (bd_decode_select.h), else 1 and where */
static int sc_compare(const struct sc_problem *P, const float *nat, const float *nlse,
		      int nstatus, const float *ref, const float *rlse, int rstatus,
		      char *detail, size_t cap)
{
	double worst = 0.0, worst_lse = 0.0;
	int wb = 0, wh = 0, nonfinite = 0;

	if (nstatus || rstatus) {
		snprintf(detail, cap, "status bits: native %#x, hopper %#x", (unsigned)nstatus,
			 (unsigned)rstatus);
		return 1;
	}
	for (int bh = 0; bh < SC_B * P->Hq; bh++) {
		double num = 0.0, den = 0.0, dl;
		for (int c = 0; c < P->d; c++) {
			const double x = nat[(size_t)bh * P->d + c], y = ref[(size_t)bh * P->d + c];
			if (!isfinite(x) || !isfinite(y))
				nonfinite++;
			num += (x - y) * (x - y);
			den += y * y;
		}
		const double rel = sqrt(num) / (sqrt(den) > 1e-30 ? sqrt(den) : 1e-30);
		if (!isfinite(nlse[bh]) || !isfinite(rlse[bh]))
			nonfinite++;
		dl = fabs((double)nlse[bh] - (double)rlse[bh]);
		if (!(rel <= worst)) { /* NaN counts as worse */
			worst = rel;
			wb = bh / P->Hq;
			wh = bh % P->Hq;
		}
		if (!(dl <= worst_lse))
			worst_lse = dl;
	}
	const bool ok = !nonfinite && worst <= BD_DECODE_SELFCHECK_TOL &&
			worst_lse <= BD_DECODE_SELFCHECK_TOL;
	snprintf(detail, cap, "%sworst relative L2 %.3g (request %d, head %d), worst |dLSE| %.3g "
		 "(tolerance %.0e)%s", ok ? "" : "outputs differ: ", worst, wb, wh, worst_lse,
		 BD_DECODE_SELFCHECK_TOL, nonfinite ? ", non-finite values" : "");
	return ok ? 0 : 1;
}

int bd_decode_selfcheck(enum bd_kfamily native, const struct bd_kvcfg *cfg, int d, int G,
			const struct bd_decode_select_test *test, char *detail, size_t cap)
{
	struct sc_problem P;
	float *out[2] = { NULL, NULL }, *lse[2] = { NULL, NULL };
	int status[2] = { 0, 0 }, r;
	char dummy[8];

	if (!detail || !cap) {
		detail = dummy;
		cap = sizeof(dummy);
	}
	*detail = 0;
	if ((unsigned)native >= BD_KFAMILY_COUNT || !cfg || (d != 64 && d != 128) || G < 1 ||
	    G > BD_KERNEL_MAX_G)
		return -EINVAL;
	if (test && test->portable_as_native)
		native = BD_KFAMILY_HOPPER;
	if ((r = sc_build(&P, cfg, d, G)) < 0) {
		snprintf(detail, cap, "the self-check problem could not be set up (%s)",
			 strerror(-r));
		return r;
	}
	const size_t on = (size_t)SC_B * P.Hq * d, ln = (size_t)SC_B * P.Hq;
	for (int i = 0; i < 2; i++) {
		out[i] = malloc(sizeof(float) * on);
		lse[i] = malloc(sizeof(float) * ln);
		if (!out[i] || !lse[i]) {
			r = -ENOMEM;
			goto out;
		}
	}
	if ((r = sc_run(&P, native, cfg, out[0], lse[0], &status[0], detail, cap)) < 0 ||
	    (r = sc_run(&P, BD_KFAMILY_HOPPER, cfg, out[1], lse[1], &status[1], detail, cap)) < 0)
		goto out;
	if (test)
		out[0][0] += test->perturb;
	r = sc_compare(&P, out[0], lse[0], status[0], out[1], lse[1], status[1], detail, cap);
out:
	for (int i = 0; i < 2; i++) {
		free(out[i]);
		free(lse[i]);
	}
	sc_free(&P);
	return r;
}

int bd_decode_select(enum bd_kfamily_mode mode, const struct bd_kvcfg *cfg,
		     const struct bd_layout *lay, int G, const struct bd_decode_select_test *test,
		     struct bd_kfamily_choice *ret)
{
	struct bd_kfamily_device dev;
	char detail[BD_KFAMILY_WHY_MAX];
	int r;

	if (!cfg || !lay || !ret)
		return -EINVAL;
	memset(ret, 0, sizeof(*ret));
	if ((r = bd_decode_device(&dev)) < 0) {
		snprintf(ret->why, sizeof(ret->why), "no CUDA device (%s)", strerror(-r));
		return r;
	}
	if (test && (test->cc_major || test->cc_minor)) {
		dev.cc_major = test->cc_major;
		dev.cc_minor = test->cc_minor;
		dev.have_bw = true;
	}
	const struct bd_kfamily_shape shape = { lay->d, lay->d_rope, G };
	if ((r = bd_kfamily_choose(mode, &dev, cfg, &shape, ret)) < 0)
		return r;
	if (ret->selfcheck) {
		int res = bd_decode_selfcheck(ret->native, cfg, lay->d, G, test, detail,
					      sizeof(detail));
		if (res == -EINVAL)
			return -EINVAL;
		if ((r = bd_kfamily_finish(ret, res, detail)) < 0)
			return r;
	}
	enum bd_kfamily f = ret->family;
	if (test && test->portable_as_native)
		f = BD_KFAMILY_HOPPER;
	if ((r = bd_decode_family_set(f)) < 0)
		snprintf(ret->why, sizeof(ret->why), "%s cannot run on this device (%s)",
			 bd_kfamily_name(f), strerror(-r));
	return r;
}
