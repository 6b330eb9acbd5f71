/* gpu_check.c — the CUDA kernels (kernels/bd_kernels.h) against the CPU reference (lib/).
 *
 * `make gpu-test` runs it on a machine with an NVIDIA GPU. Every problem is fresh random data
 * with outlier channels written through the real CPU write path (bd_kv_write_token, then
 * bd_page_promote when a page fills and a later token exists), into a shuffled block table;
 * the CPU reference decoder runs with the kernels' tiling (B_k = 128) and the plan's n_splits.
 *   - E4M3: hardware cvt vs the device software encoder on every finite FP32 pattern, and the
 *     device encoders vs bd_e4m3_encode on 2^24 spread patterns; the page loop's division of
 *     c·p_max by 6 against __fdiv_rn on every FP32 in [0, 8];
 *   - query preparation (FWHT + dual residual) bytes vs bd_fwht + bd_query_quantize;
 *   - promotion bytes (NVFP4 with and without scale search, MXFP4, BF16) vs bd_page_promote,
 *     with special blocks (zeros, ties, tiny, huge), and its refusals (-EDOM, -EINVAL);
 *   - decode: configurations × d ∈ {64, 128} × G ∈ {1, 3, 4, 8} over a batch of lengths 1, 15,
 *     16, 17, 127, 128, 129, 4095 (partial last pages, sink masking, empty splits), auto and
 *     forced splits, a long context; outputs poisoned with NaN first; relative error ≤ 1e-3;
 *     the configurations: the NVFP4 ones, bitdecoding-mxfp4, bf16 and trtllm-nvfp4
 *     (channel-blocked NVFP4 pages, BF16 query, FP32 P);
 *   - MXFP4 (bitdecoding-mxfp4): the device's MXFP4 query bytes vs bd_query_quantize, and
 *     decode like NVFP4;
 *   - real KV: SmolLM2's post-RoPE K/V/q for a prompt cut from a Debian text file, captured
 *     on the CPU by `make gpu-capture` (tests/gpu/gpu_capture.c) into the file named by
 *     BD_GPU_CAPTURE, through the same write path, every configuration and captured layer;
 *   - the launchers' refusals of bad arguments; a bad page id and a bad length flagged in
 *     *status with finite outputs (bitdecoding-nvfp4 and trtllm-nvfp4).
 * The decode checks run once per decode family the device supports (kernels/bd_kernels.h:
 * hopper on Hopper; hopper and the native family on Blackwell), each over the configurations
 * and shapes that family serves; the others are reported as unsupported on this device.
 * Exits non-zero on any failure. `--small` runs one small decode per family and one promotion
 * (for compute-sanitizer).
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>

#include "base/bd_clock.h"
#include "quant/bd_attn_ref.h"
#include "quant/bd_fp4.h"
#include "bd_kernels.h"
#include "quant/bd_kvcfg.h"
#include "quant/bd_layout.h"
#include "gpu_ck.h"
#include "testgen.h"

#define TOL 1e-3

/* the decode family under test (plans by bd_decode_plan_init_family) */
static enum bd_kfamily family = BD_KFAMILY_HOPPER;

/* Whether the family under test serves cfg at head dim d with G heads per KV head here: its
 * table entry, and a plan (the device's shared memory: BF16 pages at d = 128 on sm_120). */
static bool family_serves(const struct bd_kvcfg *cfg, int d, int G, char *why, size_t cap)
{
	struct bd_layout lay;
	struct bd_decode_plan pl;
	int r;

	CKR(bd_layout_init(&lay, cfg->page_fmt, 1, 1, d, 0, 1));
	if (bd_decode_family_supported(family, cfg, &lay, G, why, cap) < 0)
		return false;
	r = bd_decode_plan_init_family(&pl, family, cfg, &lay, NULL, 1, G, 1000, 0);
	if (r == -EOPNOTSUPP) {
		printf("  %s %s d=%d G=%d: not served on this device (shared memory)\n",
		       bd_kfamily_name(family), cfg->name, d, G);
		return false;
	}
	CKR(r);
	return true;
}

/* ---- a batch decode problem -------------------------------------------------------------------- */

struct problem {
	const struct bd_kvcfg *cfg;
	struct bd_layout lay;
	int B, Hkv, G, Hq, d, n_layers, bt_stride, max_len;
	int *lens;
	uint8_t *arena;  /* host arena */
	uint8_t *slots;  /* host slots, B × slot_bytes */
	int32_t *bt;     /* [B][bt_stride] */
	float *q;        /* [B][Hq][d] */
	float *q_all;    /* captured problems: [n_layers][B][Hq][d], q is one layer of it */
	/* device copies */
	void *d_arena, *d_slots, **d_slot_ptrs;
	int32_t *d_bt, *d_lens;
	float *d_q;
};

/* Keys with a per-channel bias and a few outlier channels (what smoothing and the Hadamard
 * rotation exist for), values with outlier channels, a calibrated-looking μ. */
static void gen_kv(struct tg_rng *r, int d, const float *bias, const int *outl, float *k, float *v)
{
	for (int c = 0; c < d; c++) {
		k[c] = bias[c] + tg_gauss(r);
		v[c] = tg_gauss(r);
	}
	for (int j = 0; j < 3; j++) {
		k[outl[j]] *= 12.0f;
		v[outl[j + 3]] *= 8.0f;
	}
}

static void problem_free(struct problem *P)
{
	FREE_HOST(P->lens, P->arena, P->slots, P->bt);
	if (!P->q_all)
		free(P->q);
	free(P->q_all);
	cudaFree(P->d_arena);
	cudaFree(P->d_slots);
	cudaFree(P->d_slot_ptrs);
	cudaFree(P->d_bt);
	cudaFree(P->d_lens);
	cudaFree(P->d_q);
	memset(P, 0, sizeof(*P));
}

/* KV captured from the real model (gpu_capture.c's file format). */
struct capture {
	int n_cap, Hq, Hkv, d, n_tok, n_q;
	int32_t *layers, *qpos;
	float *k, *v, *q; /* [n_cap][n_tok][Hkv][d] ×2, [n_cap][n_q][Hq][d] */
};

static void capture_free(struct capture *c)
{
	FREE_HOST(c->layers, c->qpos, c->k, c->v, c->q);
	memset(c, 0, sizeof(*c));
}

/* Returns 0, or -1 when the file is missing or malformed (message printed). */
static int capture_load(const char *path, struct capture *c)
{
	FILE *f = fopen(path, "rb");
	char magic[8];
	int32_t h[6];

	memset(c, 0, sizeof(*c));
	if (!f) {
		printf("  capture %s: cannot open\n", path);
		return -1;
	}
	if (fread(magic, 1, 8, f) != 8 || memcmp(magic, "BDKVCAP1", 8) != 0 ||
	    fread(h, sizeof(h), 1, f) != 1 || h[0] < 1 || h[0] > 64 || h[1] < 1 || h[2] < 1 ||
	    h[1] % h[2] != 0 || (h[3] != 64 && h[3] != 128) || h[4] < 1 || h[4] > (1 << 20) ||
	    h[5] < 1 || h[5] > 64)
		goto bad;
	c->n_cap = h[0];
	c->Hq = h[1];
	c->Hkv = h[2];
	c->d = h[3];
	c->n_tok = h[4];
	c->n_q = h[5];
	const size_t nkv = (size_t)c->n_cap * c->n_tok * c->Hkv * c->d;
	const size_t nq = (size_t)c->n_cap * c->n_q * c->Hq * c->d;
	c->layers = xmalloc(sizeof(int32_t) * (size_t)c->n_cap);
	c->qpos = xmalloc(sizeof(int32_t) * (size_t)c->n_q);
	c->k = xmalloc(sizeof(float) * nkv);
	c->v = xmalloc(sizeof(float) * nkv);
	c->q = xmalloc(sizeof(float) * nq);
	if (fread(c->layers, sizeof(int32_t), (size_t)c->n_cap, f) != (size_t)c->n_cap ||
	    fread(c->qpos, sizeof(int32_t), (size_t)c->n_q, f) != (size_t)c->n_q ||
	    fread(c->k, sizeof(float), nkv, f) != nkv || fread(c->v, sizeof(float), nkv, f) != nkv ||
	    fread(c->q, sizeof(float), nq, f) != nq)
		goto bad;
	for (int j = 0; j < c->n_q; j++)
		if (c->qpos[j] < 0 || c->qpos[j] >= c->n_tok)
			goto bad;
	fclose(f);
	return 0;
bad:
	printf("  capture %s: malformed\n", path);
	fclose(f);
	capture_free(c);
	return -1;
}

/* With unit_v every value is 1 and every query 0 (the normalization property's inputs). */
static void problem_build(struct problem *P, const struct bd_kvcfg *cfg, int d, int G, int Hkv,
			  int n_layers, const int *lens, int B, uint64_t seed, const struct capture *cap,
			  bool unit_v)
{
	struct tg_rng r = { seed };
	size_t total_pages = 0;
	int32_t *perm;

	memset(P, 0, sizeof(*P));
	P->cfg = cfg;
	P->B = B;
	P->Hkv = Hkv;
	P->G = G;
	P->Hq = G * Hkv;
	P->d = d;
	P->n_layers = n_layers;
	P->lens = xmalloc(sizeof(int) * (size_t)B);
	P->max_len = 1;
	for (int b = 0; b < B; b++) {
		P->lens[b] = lens[b];
		if (lens[b] > P->max_len)
			P->max_len = lens[b];
		total_pages += (size_t)((lens[b] - 1) / BD_PAGE_TOKENS);
	}
	P->bt_stride = (P->max_len - 1) / BD_PAGE_TOKENS;
	if (P->bt_stride < 1)
		P->bt_stride = 1;
	/* spare pages so that ids are scattered */
	CKR(bd_layout_init(&P->lay, cfg->page_fmt, n_layers, Hkv, d, 0, total_pages + 3));
	P->arena = xmalloc(P->lay.arena_bytes);
	P->slots = xmalloc(P->lay.slot_bytes * (size_t)B);
	P->bt = xmalloc(sizeof(int32_t) * (size_t)B * (size_t)P->bt_stride);
	perm = xmalloc(sizeof(int32_t) * P->lay.n_pages);
	for (size_t i = 0; i < P->lay.n_pages; i++)
		perm[i] = (int32_t)i;
	tg_shuffle_i32(&r, perm, P->lay.n_pages);
	size_t next = 0;
	for (int b = 0; b < B; b++)
		for (int p = 0; p < P->bt_stride; p++)
			P->bt[(size_t)b * P->bt_stride + p] =
				p < (P->lens[b] - 1) / BD_PAGE_TOKENS ? perm[next++] : -1;
	free(perm);

	float *bias = xmalloc(sizeof(float) * (size_t)d * n_layers * Hkv);
	float *mu = xmalloc(sizeof(float) * (size_t)d * n_layers * Hkv);
	int *outl = xmalloc(sizeof(int) * 6 * (size_t)n_layers * Hkv);
	for (int lh = 0; lh < n_layers * Hkv; lh++) {
		if (cap) {
			/* μ_k as calibration makes it: the mean of the layer's captured keys */
			const int l = lh / Hkv, h = lh % Hkv;
			for (int c = 0; c < d; c++) {
				double acc = 0.0;
				for (int t = 0; t < cap->n_tok; t++)
					acc += cap->k[(((size_t)l * cap->n_tok + t) * Hkv + h) * d + c];
				mu[lh * d + c] = (float)(acc / cap->n_tok);
			}
			continue;
		}
		for (int c = 0; c < d; c++) {
			bias[lh * d + c] = 2.0f * tg_gauss(&r);
			/* μ_k as calibrated: close to the bias, not equal */
			mu[lh * d + c] = bias[lh * d + c] + 0.1f * tg_gauss(&r);
		}
		for (int j = 0; j < 6; j++)
			outl[lh * 6 + j] = (int)(tg_next(&r) % (uint64_t)d);
	}
	float *k = xmalloc(sizeof(float) * (size_t)d), *v = xmalloc(sizeof(float) * (size_t)d);
	for (int b = 0; b < B; b++) {
		uint8_t *slot = P->slots + (size_t)b * P->lay.slot_bytes;
		for (int pos = 0; pos < P->lens[b]; pos++) {
			for (int l = 0; l < n_layers; l++)
				for (int h = 0; h < Hkv; h++) {
					int lh = l * Hkv + h;
					if (cap) {
						const size_t o = (((size_t)l * cap->n_tok + pos) * Hkv + h) * d;
						memcpy(k, cap->k + o, sizeof(float) * (size_t)d);
						memcpy(v, cap->v + o, sizeof(float) * (size_t)d);
					} else {
						gen_kv(&r, d, bias + lh * d, outl + lh * 6, k, v);
					}
					for (int c = 0; c < d && unit_v; c++)
						v[c] = 1.0f;
					CKR(bd_kv_write_token(&P->lay, cfg, slot, l, h, pos, k, v,
							      mu + lh * d));
				}
			if ((pos + 1) % BD_PAGE_TOKENS == 0 && pos + 1 < P->lens[b])
				CKR(bd_page_promote(&P->lay, cfg, NULL, slot, P->arena,
						    P->bt[(size_t)b * P->bt_stride + pos / BD_PAGE_TOKENS]));
		}
	}
	FREE_HOST(k, v, bias, mu, outl);

	if (cap) {
		/* request b decodes at the capture's query position b (lens[b] = qpos[b] + 1) */
		const size_t qn = (size_t)P->Hq * d;
		P->q_all = xmalloc(sizeof(float) * (size_t)n_layers * B * qn);
		for (int l = 0; l < n_layers; l++)
			for (int b = 0; b < B; b++)
				memcpy(P->q_all + ((size_t)l * B + b) * qn,
				       cap->q + ((size_t)l * cap->n_q + b) * qn, sizeof(float) * qn);
		P->q = P->q_all;
		return;
	}
	/* queries: gaussian with a few large channels; scaled so that attention is peaked */
	P->q = xmalloc(sizeof(float) * (size_t)B * P->Hq * d);
	tg_fill_queries(&r, P->q, (size_t)B * P->Hq, d);
	for (size_t i = 0; i < (size_t)B * P->Hq * d && unit_v; i++)
		P->q[i] = 0.0f;
}

static void problem_upload(struct problem *P)
{
	void **ptrs = xmalloc(sizeof(void *) * (size_t)P->B);

	CK(cudaMalloc(&P->d_arena, P->lay.arena_bytes));
	CK(cudaMemcpy(P->d_arena, P->arena, P->lay.arena_bytes, cudaMemcpyHostToDevice));
	CK(cudaMalloc(&P->d_slots, P->lay.slot_bytes * (size_t)P->B));
	CK(cudaMemcpy(P->d_slots, P->slots, P->lay.slot_bytes * (size_t)P->B,
		      cudaMemcpyHostToDevice));
	for (int b = 0; b < P->B; b++)
		ptrs[b] = (uint8_t *)P->d_slots + (size_t)b * P->lay.slot_bytes;
	CK(cudaMalloc((void **)&P->d_slot_ptrs, sizeof(void *) * (size_t)P->B));
	CK(cudaMemcpy(P->d_slot_ptrs, ptrs, sizeof(void *) * (size_t)P->B, cudaMemcpyHostToDevice));
	CK(cudaMalloc((void **)&P->d_bt, sizeof(int32_t) * (size_t)P->B * P->bt_stride));
	CK(cudaMemcpy(P->d_bt, P->bt, sizeof(int32_t) * (size_t)P->B * P->bt_stride,
		      cudaMemcpyHostToDevice));
	CK(cudaMalloc((void **)&P->d_lens, sizeof(int32_t) * (size_t)P->B));
	CK(cudaMemcpy(P->d_lens, P->lens, sizeof(int32_t) * (size_t)P->B, cudaMemcpyHostToDevice));
	CK(cudaMalloc((void **)&P->d_q, sizeof(float) * (size_t)P->B * P->Hq * P->d));
	CK(cudaMemcpy(P->d_q, P->q, sizeof(float) * (size_t)P->B * P->Hq * P->d,
		      cudaMemcpyHostToDevice));
	free(ptrs);
}

struct run_stats {
	double max_rel;      /* worst per-(request, KV head) relative error */
	double call_rel;     /* over the whole call */
	double max_lse;      /* worst |lse − lse_ref| */
	int n_splits;
	int persist;         /* the plan's persist_ctas */
	int worst_b, worst_h;
	float out_lo, out_hi; /* the smallest and largest output value */
};

/* The persistent kernel (builds with BD_PERSIST, the default; FP4 pages) must give the bits of the
 * first run (out and lse) at any CTA count: at 1 and 3 CTAs (many items per CTA; twice at 3, so
 * the claim counters must have reset themselves), at the plan's count, and on the one-CTA-per-item
 * grid when the plan chose the persistent kernel. Silent where the build has no persistent kernel
 * or the pages are not FP4 (the run says -EOPNOTSUPP). */
static void persist_runs(const struct problem *P, const struct bd_decode_plan *pl,
			 const struct bd_decode_args *a, const float *out, const float *lse)
{
	const size_t on = (size_t)P->B * P->Hq * P->d, ln = (size_t)P->B * P->Hq;
	const int counts[5] = { 1, 3, 3, pl->persist_ctas > 0 ? 0 : 7, pl->persist_ctas };
	float *o2 = xmalloc(sizeof(float) * on), *l2 = xmalloc(sizeof(float) * ln);
	int status = 0;

	for (int i = 0; i < 5; i++) {
		struct bd_decode_plan pp = *pl;
		pp.persist_ctas = counts[i];
		CK(cudaMemset(a->out, 0xff, sizeof(float) * on));
		CK(cudaMemset(a->lse, 0xff, sizeof(float) * ln));
		int r = bd_decode_run(&pp, a, NULL);
		if (r == -EOPNOTSUPP && counts[i] > 0 && pl->persist_ctas == 0)
			break;
		check(r == 0, "%s d=%d G=%d: persistent run at %d CTAs: %d", P->cfg->name, P->d,
		      P->G, counts[i], r);
		if (r != 0)
			break;
		CK(cudaDeviceSynchronize());
		CK(cudaMemcpy(o2, a->out, sizeof(float) * on, cudaMemcpyDeviceToHost));
		CK(cudaMemcpy(l2, a->lse, sizeof(float) * ln, cudaMemcpyDeviceToHost));
		const bool same = memcmp(out, o2, sizeof(float) * on) == 0 &&
				  memcmp(lse, l2, sizeof(float) * ln) == 0;
		check(same, "%s d=%d G=%d B=%d splits=%d: %d CTAs (plan %d) give other bits",
		      P->cfg->name, P->d, P->G, P->B, pl->n_splits, counts[i], pl->persist_ctas);
	}
	CK(cudaMemcpy(&status, a->status, sizeof(int), cudaMemcpyDeviceToHost));
	check(status == 0, "%s d=%d G=%d: persistent runs: status %#x", P->cfg->name, P->d, P->G,
	      status);
	FREE_HOST(o2, l2);
}

/* Run the kernels on layer `layer` and compare every (request, KV head) with the reference. */
static void problem_run(struct problem *P, int n_splits, int layer, struct run_stats *st)
{
	struct bd_decode_plan pl;
	struct bd_decode_args a;
	const size_t on = (size_t)P->B * P->Hq * P->d;
	float *out = xmalloc(sizeof(float) * on), *lse = xmalloc(sizeof(float) * (size_t)P->B * P->Hq);
	float *ref = xmalloc(sizeof(float) * (size_t)P->G * P->d), *rlse = xmalloc(sizeof(float) * (size_t)P->G);
	float *d_out, *d_lse;
	void *ws;
	int *d_status, status = 0;
	double num = 0, den = 0;

	memset(st, 0, sizeof(*st));
	st->out_lo = INFINITY;
	st->out_hi = -INFINITY;
	CKR(bd_decode_plan_init_family(&pl, family, P->cfg, &P->lay, NULL, P->B, P->Hq, P->max_len,
				       n_splits));
	st->n_splits = pl.n_splits;
	st->persist = pl.persist_ctas;
	CK(cudaMalloc((void **)&d_out, sizeof(float) * on));
	CK(cudaMalloc((void **)&d_lse, sizeof(float) * (size_t)P->B * P->Hq));
	CK(cudaMalloc(&ws, pl.ws_bytes));
	CK(cudaMalloc((void **)&d_status, sizeof(int)));
	/* poison: NaN everywhere the kernels write */
	CK(cudaMemset(d_out, 0xff, sizeof(float) * on));
	CK(cudaMemset(d_lse, 0xff, sizeof(float) * (size_t)P->B * P->Hq));
	CK(cudaMemset(ws, 0xff, pl.ws_bytes));
	CK(cudaMemset(d_status, 0, sizeof(int)));
	CKR(bd_decode_workspace_init(&pl, ws, NULL));
	a = (struct bd_decode_args){
		.q = P->d_q,
		.arena = P->d_arena,
		.layer = layer,
		.block_table = P->d_bt,
		.bt_stride = P->bt_stride,
		.seq_lens = P->d_lens,
		.slots = P->d_slot_ptrs,
		.out = d_out,
		.lse = d_lse,
		.workspace = ws,
		.status = d_status,
	};
	CKR(bd_decode_run(&pl, &a, NULL));
	CK(cudaDeviceSynchronize());
	CK(cudaMemcpy(out, d_out, sizeof(float) * on, cudaMemcpyDeviceToHost));
	CK(cudaMemcpy(lse, d_lse, sizeof(float) * (size_t)P->B * P->Hq, cudaMemcpyDeviceToHost));
	CK(cudaMemcpy(&status, d_status, sizeof(int), cudaMemcpyDeviceToHost));
	check(status == 0, "%s d=%d G=%d: status %#x", P->cfg->name, P->d, P->G, status);
	/* a second run on the same workspace (its counters reset themselves) gives the same bits */
	{
		float *out2 = xmalloc(sizeof(float) * on);
		CK(cudaMemset(d_out, 0xff, sizeof(float) * on));
		CKR(bd_decode_run(&pl, &a, NULL));
		CK(cudaDeviceSynchronize());
		CK(cudaMemcpy(out2, d_out, sizeof(float) * on, cudaMemcpyDeviceToHost));
		check(memcmp(out, out2, sizeof(float) * on) == 0,
		      "%s d=%d G=%d: a second run differs from the first", P->cfg->name, P->d, P->G);
		free(out2);
	}
	persist_runs(P, &pl, &a, out, lse);

	struct bd_decode_params dp = bd_decode_params_default();
	dp.tile_keys = pl.tile_keys;
	dp.n_splits = pl.n_splits;
	for (int b = 0; b < P->B; b++) {
		for (int h = 0; h < P->Hkv; h++) {
			struct bd_kv_view kv = {
				.lay = &P->lay,
				.arena = P->arena,
				.block_table = P->bt + (size_t)b * P->bt_stride,
				.slot = P->slots + (size_t)b * P->lay.slot_bytes,
				.layer = layer,
				.kv_head = h,
				.n_tokens = P->lens[b],
			};
			const float *qg = P->q + ((size_t)b * P->Hq + (size_t)h * P->G) * P->d;
			CKR(bd_ref_decode_gqa(P->cfg, &dp, &kv, qg, P->G, ref, rlse, NULL));
			double n2 = 0, d2 = 0;
			for (int i = 0; i < P->G * P->d; i++) {
				float o = out[((size_t)b * P->Hq + (size_t)h * P->G) * P->d + (size_t)i];
				st->out_lo = fminf(st->out_lo, o);
				st->out_hi = fmaxf(st->out_hi, o);
				if (!isfinite(o)) {
					n2 = INFINITY;
					break;
				}
				n2 += ((double)o - ref[i]) * ((double)o - ref[i]);
				d2 += (double)ref[i] * ref[i];
			}
			num += n2;
			den += d2;
			double rel = d2 > 0 ? sqrt(n2 / d2) : sqrt(n2);
			if (!(rel <= st->max_rel)) {
				st->max_rel = rel;
				st->worst_b = b;
				st->worst_h = h;
			}
			for (int g = 0; g < P->G; g++) {
				float l = lse[(size_t)b * P->Hq + (size_t)h * P->G + g];
				double e = isfinite(l) ? fabs((double)l - rlse[g]) : INFINITY;
				if (!(e <= st->max_lse))
					st->max_lse = e;
			}
		}
	}
	st->call_rel = den > 0 ? sqrt(num / den) : sqrt(num);
	FREE_DEV(d_out, d_lse, ws, d_status);
	FREE_HOST(out, lse, ref, rlse);
}

/* ---- decode checks ---------------------------------------------------------------------------- */

static void decode_case(const char *cfgname, int d, int G, int Hkv, const int *lens, int B,
			int n_layers, const int *splits, int nsp, uint64_t seed, bool verbose)
{
	const struct bd_kvcfg *cfg = bd_kvcfg_find(cfgname);
	struct problem P;
	double t0 = bd_now_s();

	if (!cfg) {
		check(false, "unknown configuration %s", cfgname);
		return;
	}
	if (!family_serves(cfg, d, G, NULL, 0))
		return;
	problem_build(&P, cfg, d, G, Hkv, n_layers, lens, B, seed, NULL, false);
	double t1 = bd_now_s();
	problem_upload(&P);
	for (int i = 0; i < nsp; i++) {
		struct run_stats st;
		problem_run(&P, splits[i], n_layers - 1, &st);
		bool ok = st.max_rel <= TOL && st.max_lse <= 1e-3;
		check(ok, "%s decode %-18s d=%3d G=%d Hkv=%d maxlen=%6d splits=%3d: rel %.3g (req %d head %d) call %.3g lse %.3g",
		      bd_kfamily_name(family), cfgname, d, G, Hkv, P.max_len, st.n_splits, st.max_rel, st.worst_b, st.worst_h,
		      st.call_rel, st.max_lse);
		if (verbose || !ok)
			printf("  decode %-18s d=%3d G=%d Hkv=%d B=%d maxlen=%6d splits=%3d  rel %.3e  call %.3e  lse %.3e  %s (build %.1fs)\n",
			       cfgname, d, G, Hkv, B, P.max_len, st.n_splits, st.max_rel, st.call_rel,
			       st.max_lse, ok ? "ok" : "FAIL", t1 - t0);
		if (st.persist > 0)
			printf("    (the plan chose the persistent kernel: %d CTAs)\n", st.persist);
	}
	problem_free(&P);
}

/* The page-partial normalization property (NUMERICS.md §6 and the quantized-mass section):
 * q = 0 and V ≡ 1 through every configuration the family serves, under both normalizations.
 * Under norm=qmass, and under ℓ where P is not NVFP4, every output is 1 within FP32 rounding;
 * under ℓ with NVFP4 P a request with full pages gives more than 1 (s_P·P̂ = 8.25 for c·p = 8:
 * the bias the quantized mass removes). The kernel is also held to the reference as usual. */
static void unit_case(const char *cfgname, int d, int G, uint64_t seed)
{
	static const int lens[4] = { 129, 1024, 17, 300 };
	const struct bd_kvcfg *base = bd_kvcfg_find(cfgname);

	for (int nv = 0; base && nv < 2; nv++) {
		const struct bd_kvcfg *cfg = bd_kvcfg_variant(base, (enum bd_pnorm)nv);
		const bool biased = cfg->p_norm == BD_NORM_L && (cfg->p_quant == BD_P_NVFP4_MAX6 ||
								 cfg->p_quant == BD_P_NVFP4_UNDERFLOW);
		struct problem P;
		if (!family_serves(cfg, d, G, NULL, 0))
			continue;
		/* requests with one page and the sink, eight pages, BF16 rows only, two pages */
		problem_build(&P, cfg, d, G, 2, 1, lens, 4, seed, NULL, true);
		problem_upload(&P);
		for (int sp = 0; sp < 2; sp++) {
			struct run_stats st;
			problem_run(&P, sp == 0 ? 0 : 3, 0, &st);
			bool ok = st.max_rel <= TOL && st.max_lse <= 1e-3;
			if (biased)
				ok = ok && st.out_hi > 1.01f && st.out_hi < 1.0313f &&
				     fabsf(st.out_lo - 1.0f) <= 8e-6f;
			else
				ok = ok && fabsf(st.out_lo - 1.0f) <= 8e-6f &&
				     fabsf(st.out_hi - 1.0f) <= 8e-6f;
			check(ok, "%s unit V %-30s d=%3d G=%d splits=%3d: output [%.9f, %.9f] rel %.3g lse %.3g",
			      bd_kfamily_name(family), cfg->name, d, G, st.n_splits, st.out_lo,
			      st.out_hi, st.max_rel, st.max_lse);
			printf("  unit V %-30s d=%3d G=%d splits=%3d  output [%.9f, %.9f]  %s\n",
			       cfg->name, d, G, st.n_splits, st.out_lo, st.out_hi, ok ? "ok" : "FAIL");
		}
		problem_free(&P);
	}
}

/* Every captured layer of the real model's KV under configuration cfgname: one request per
 * captured query position, auto and forced splits. */
static void capture_case(const char *cfgname, const struct capture *cap)
{
	const struct bd_kvcfg *cfg = bd_kvcfg_find(cfgname);
	const int sp[2] = { 0, 3 };
	struct problem P;
	int *lens = xmalloc(sizeof(int) * (size_t)cap->n_q);

	if (!cfg) {
		check(false, "unknown configuration %s", cfgname);
		free(lens);
		return;
	}
	if (!family_serves(cfg, cap->d, cap->Hq / cap->Hkv, NULL, 0)) {
		free(lens);
		return;
	}
	for (int j = 0; j < cap->n_q; j++)
		lens[j] = cap->qpos[j] + 1;
	problem_build(&P, cfg, cap->d, cap->Hq / cap->Hkv, cap->Hkv, cap->n_cap, lens, cap->n_q, 0,
		      cap, false);
	problem_upload(&P);
	for (int l = 0; l < cap->n_cap; l++) {
		const size_t qn = (size_t)P.B * P.Hq * P.d;
		P.q = P.q_all + (size_t)l * qn;
		CK(cudaMemcpy(P.d_q, P.q, sizeof(float) * qn, cudaMemcpyHostToDevice));
		for (int i = 0; i < 2; i++) {
			struct run_stats st;
			problem_run(&P, sp[i], l, &st);
			bool ok = st.max_rel <= TOL && st.max_lse <= 1e-3;
			check(ok, "%s real KV %-18s layer %2d splits=%3d: rel %.3g (req %d head %d) lse %.3g",
			      bd_kfamily_name(family), cfgname, cap->layers[l], st.n_splits, st.max_rel, st.worst_b, st.worst_h,
			      st.max_lse);
			printf("  real KV %-18s d=%3d G=%d Hkv=%d B=%d layer %2d maxlen=%5d splits=%3d  rel %.3e  call %.3e  lse %.3e  %s\n",
			       cfgname, P.d, P.G, P.Hkv, P.B, cap->layers[l], P.max_len, st.n_splits,
			       st.max_rel, st.call_rel, st.max_lse, ok ? "ok" : "FAIL");
		}
	}
	problem_free(&P);
	free(lens);
}

/* ---- bad input checks ----------------------------------------------------------------------- */

static void refusal_checks(void)
{
	struct bd_layout lay, lmx, l8;
	struct bd_decode_plan pl;
	const struct bd_kvcfg *bd = bd_kvcfg_find("bitdecoding-nvfp4");
	const struct bd_kvcfg *f8 = bd_kvcfg_find("fp8");
	struct bd_decode_params dp = bd_decode_params_default();

	CKR(bd_layout_init(&lay, BD_PAGE_NVFP4, 1, 2, 128, 0, 4));
	CKR(bd_layout_init(&lmx, BD_PAGE_MXFP4, 1, 2, 128, 0, 4));
	CKR(bd_layout_init(&l8, f8->page_fmt, 1, 2, 128, 0, 4));
	memset(&pl, 0x5a, sizeof(pl));
	check(bd_decode_plan_init(&pl, f8, &l8, NULL, 1, 8, 1000, 0) == -EOPNOTSUPP,
	      "plan: FP8 pages must be -EOPNOTSUPP");
	check(bd_decode_plan_init(&pl, bd, &lay, NULL, 1, 18, 1000, 0) == -EOPNOTSUPP,
	      "plan: G = 9 must be -EOPNOTSUPP");
	check(bd_decode_plan_init(&pl, bd, &lay, NULL, 1, 7, 1000, 0) == -EINVAL,
	      "plan: Hq not a multiple of Hkv must be -EINVAL");
	check(bd_decode_plan_init(&pl, bd, &lmx, NULL, 1, 8, 1000, 0) == -EINVAL,
	      "plan: layout format != cfg format must be -EINVAL");
	dp.tile_keys = 64;
	check(bd_decode_plan_init(&pl, bd, &lay, &dp, 1, 8, 1000, 0) == -EINVAL,
	      "plan: tile_keys 64 must be -EINVAL");
	{
		unsigned char z[sizeof(pl)];
		memset(z, 0x5a, sizeof(z));
		check(memcmp(z, &pl, sizeof(pl)) == 0, "plan: a refused plan must not be written");
	}
	/* channel-blocked NVFP4: trtllm-nvfp4 plans; with a sink or a quantized P it is refused */
	{
		const struct bd_kvcfg *tr = bd_kvcfg_find("trtllm-nvfp4");
		struct bd_kvcfg bad = *tr;
		struct bd_layout lch;
		CKR(bd_layout_init(&lch, tr->page_fmt, 1, 2, 128, 0, 4));
		check(bd_decode_plan_init(&pl, tr, &lch, NULL, 1, 8, 1000, 0) == 0 &&
			      pl.n_splits >= 1 && pl.nterms == 0,
		      "plan: trtllm-nvfp4 must plan (BF16 query)");
		memset(&pl, 0x5a, sizeof(pl));
		bad.sink = true;
		check(bd_decode_plan_init(&pl, &bad, &lch, NULL, 1, 8, 1000, 0) == -EOPNOTSUPP,
		      "plan: channel-blocked pages with a sink must be -EOPNOTSUPP");
		bad = *tr;
		bad.p_quant = BD_P_NVFP4_MAX6;
		check(bd_decode_plan_init(&pl, &bad, &lch, NULL, 1, 8, 1000, 0) == -EOPNOTSUPP,
		      "plan: channel-blocked pages with NVFP4 P must be -EOPNOTSUPP");
		check(bd_decode_plan_init(&pl, tr, &lay, NULL, 1, 8, 1000, 0) == -EINVAL,
		      "plan: trtllm-nvfp4 on a token-blocked NVFP4 layout must be -EINVAL");
		unsigned char z[sizeof(pl)];
		memset(z, 0x5a, sizeof(z));
		check(memcmp(z, &pl, sizeof(pl)) == 0,
		      "plan: a refused channel-blocked plan must not be written");
	}
	CKR(bd_decode_plan_init(&pl, bd, &lay, NULL, 2, 8, 1000, 0));
	check(pl.n_splits >= 1 && pl.ws_bytes > 0 && pl.tile_keys == 128, "plan: sane plan");

	/* run refusals: misaligned q, narrow block table, bad layer; nothing is launched */
	void *buf;
	CK(cudaMalloc(&buf, 1 << 20));
	struct bd_decode_args a = {
		.q = (const float *)buf,
		.arena = buf,
		.layer = 0,
		.block_table = (const int32_t *)buf,
		.bt_stride = pl.bt_stride,
		.seq_lens = (const int32_t *)buf,
		.slots = (void *const *)buf,
		.out = (float *)buf,
		.workspace = buf,
	};
	struct bd_decode_args b = a;
	b.q = (const float *)((uint8_t *)buf + 4);
	check(bd_decode_run(&pl, &b, NULL) == -EINVAL, "run: misaligned q must be -EINVAL");
	b = a;
	b.bt_stride = pl.bt_stride - 1;
	check(bd_decode_run(&pl, &b, NULL) == -EINVAL, "run: narrow block table must be -EINVAL");
	b = a;
	b.layer = 1;
	check(bd_decode_run(&pl, &b, NULL) == -EINVAL, "run: bad layer must be -EINVAL");
	b = a;
	b.workspace = (uint8_t *)buf + 128;
	check(bd_decode_run(&pl, &b, NULL) == -EINVAL, "run: misaligned workspace must be -EINVAL");
	b = a;
	b.out = NULL;
	check(bd_decode_run(&pl, &b, NULL) == -EINVAL, "run: NULL out must be -EINVAL");
	CK(cudaDeviceSynchronize());
	CK(cudaFree(buf));
}

/* A bad page id and a bad length are flagged in *status, and the output stays finite. */
static void status_checks(const char *cfgname)
{
	const struct bd_kvcfg *cfg = bd_kvcfg_find(cfgname);
	struct problem P;
	int lens[2] = { 300, 200 };
	struct bd_decode_plan pl;
	float *d_out;
	void *ws;
	int *d_status, status = 0;

	if (!family_serves(cfg, 128, 4, NULL, 0))
		return;
	problem_build(&P, cfg, 128, 4, 2, 1, lens, 2, 77, NULL, false);
	P.bt[0] = 1 << 20; /* request 0, page 0 */
	P.lens[1] = 0;
	problem_upload(&P);
	CKR(bd_decode_plan_init_family(&pl, family, cfg, &P.lay, NULL, 2, 8, 300, 0));
	CK(cudaMalloc((void **)&d_out, sizeof(float) * 2 * 8 * 128));
	CK(cudaMalloc(&ws, pl.ws_bytes));
	CK(cudaMalloc((void **)&d_status, sizeof(int)));
	CKR(bd_decode_workspace_init(&pl, ws, NULL));
	struct bd_decode_args a = {
		.q = P.d_q, .arena = P.d_arena, .layer = 0, .block_table = P.d_bt,
		.bt_stride = P.bt_stride, .seq_lens = P.d_lens, .slots = P.d_slot_ptrs,
		.out = d_out, .workspace = ws, .status = d_status,
	};
	/* the plan's kernel, then the persistent one at 2 CTAs where the build has it */
	for (int pass = 0; pass < 2; pass++) {
		struct bd_decode_plan pp = pl;
		if (pass == 1)
			pp.persist_ctas = 2;
		CK(cudaMemset(d_out, 0xff, sizeof(float) * 2 * 8 * 128));
		CK(cudaMemset(d_status, 0, sizeof(int)));
		int r = bd_decode_run(&pp, &a, NULL);
		if (pass == 1 && r == -EOPNOTSUPP)
			break;
		CKR(r);
		CK(cudaDeviceSynchronize());
		float out[2 * 8 * 128];
		CK(cudaMemcpy(out, d_out, sizeof(out), cudaMemcpyDeviceToHost));
		CK(cudaMemcpy(&status, d_status, sizeof(int), cudaMemcpyDeviceToHost));
		bool finite = true, zero1 = true;
		for (int i = 0; i < 2 * 8 * 128; i++) {
			finite = finite && isfinite(out[i]);
			if (i >= 8 * 128)
				zero1 = zero1 && out[i] == 0.0f;
		}
		check((status & BD_KSTATUS_BAD_PAGE) && (status & BD_KSTATUS_BAD_LEN),
		      "status %s (%d CTAs): bad page and bad length must be flagged (got %#x)",
		      cfgname, pp.persist_ctas, status);
		check(finite, "status %s: outputs of a flagged run must be finite", cfgname);
		check(zero1, "status %s: a request with length 0 must give a zero output", cfgname);
	}
	FREE_DEV(d_out, ws, d_status);
	problem_free(&P);
}

/* ---- E4M3 and query quantization -------------------------------------------------------------- */

static void e4m3_checks(void)
{
	uint64_t mism = 0;
	uint32_t first = 0;
	double t0 = bd_now_s();

	CKR(bd_kernels_e4m3_exhaustive(&mism, &first));
	check(mism == 0, "e4m3: hardware cvt and software encoder differ on %llu patterns (first %#x)",
	      (unsigned long long)mism, first);
	printf("  e4m3 hw vs soft on all finite FP32: %llu mismatches (%.2fs)\n",
	       (unsigned long long)mism, bd_now_s() - t0);

	/* the page loop's c·p_max / 6 without the division's slow path (BD_V9_SOFT) */
	CKR(bd_kernels_div6_exhaustive(&mism, &first));
	check(mism == 0, "div6: fast division differs from __fdiv_rn on %llu of [0, 8] (first %#x)",
	      (unsigned long long)mism, first);
	printf("  div6 fast vs __fdiv_rn on every FP32 in [0, 8]: %llu mismatches\n",
	       (unsigned long long)mism);

	const size_t n = (size_t)1 << 24;
	float *x = xmalloc(sizeof(float) * n);
	uint8_t *c_hw = xmalloc(n), *c_sw = xmalloc(n);
	struct tg_rng r = { 99 };
	for (size_t i = 0; i < n; i++) {
		uint32_t u = (uint32_t)(i << 8) | (uint32_t)(tg_next(&r) & 0xff);
		float f;
		memcpy(&f, &u, 4);
		if (!isfinite(f))
			f = 0.0f;
		x[i] = f;
	}
	float *dx;
	uint8_t *dc;
	CK(cudaMalloc((void **)&dx, sizeof(float) * n));
	CK(cudaMalloc((void **)&dc, n));
	CK(cudaMemcpy(dx, x, sizeof(float) * n, cudaMemcpyHostToDevice));
	CKR(bd_kernels_e4m3_encode(dx, n, 1, dc));
	CK(cudaMemcpy(c_hw, dc, n, cudaMemcpyDeviceToHost));
	CKR(bd_kernels_e4m3_encode(dx, n, 0, dc));
	CK(cudaMemcpy(c_sw, dc, n, cudaMemcpyDeviceToHost));
	size_t bad_hw = 0, bad_sw = 0;
	for (size_t i = 0; i < n; i++) {
		uint8_t c = bd_e4m3_encode(x[i]);
		bad_hw += c != c_hw[i];
		bad_sw += c != c_sw[i];
	}
	check(bad_hw == 0 && bad_sw == 0, "e4m3: device vs bd_e4m3_encode: hw %zu, soft %zu mismatches",
	      bad_hw, bad_sw);
	printf("  e4m3 device vs CPU on 2^24 spread patterns: hw %zu, soft %zu mismatches\n", bad_hw,
	       bad_sw);
	CK(cudaFree(dx));
	CK(cudaFree(dc));
	FREE_HOST(x, c_hw, c_sw);
}

/* The device's query bytes of the n heads q [n][d] (codes [n][2][d/2], block scale codes
 * [n][2][d/block], NVFP4 decode scales g [n][2]; g NULL for MXFP4) against bd_query_quantize of
 * each head (after bd_fwht when had): one check, and a line, of how many heads differ. */
static void query_compare(const char *what, const float *q, int n, int d, int had, int nt,
			  enum bd_fp4_format fmt, const uint8_t *codes, const uint8_t *scales,
			  const float *g)
{
	const size_t nsb = (size_t)d / (fmt == BD_FP4_MXFP4 ? 32 : 16);
	int bad = 0;

	for (int i = 0; i < n; i++) {
		float x[1024];
		struct bd_qquant qq;
		memcpy(x, q + (size_t)i * d, sizeof(float) * (size_t)d);
		if (had)
			CKR(bd_fwht(x, d));
		CKR(bd_query_quantize(x, d, fmt, nt, &qq));
		for (int t = 0; t < nt; t++) {
			const uint8_t *gc = codes + ((size_t)i * 2 + t) * (d / 2);
			const uint8_t *gs = scales + ((size_t)i * 2 + t) * nsb;
			if (memcmp(gc, qq.codes[t], (size_t)d / 2) || memcmp(gs, qq.scales[t], nsb) ||
			    (g && memcmp(&g[i * 2 + t], &qq.g[t], sizeof(float))))
				bad++;
		}
	}
	check(bad == 0, "%squery quantization d=%d hadamard=%d terms=%d: %d of %d heads differ",
	      what, d, had, nt, bad, n);
	printf("  %squery quantization d=%3d hadamard=%d terms=%d: %d/%d heads differ\n", what, d,
	       had, nt, bad, n);
}

static void query_checks(void)
{
	const int n = 2048;
	struct tg_rng r = { 1234 };

	for (int d = 64; d <= 128; d *= 2) {
		float *q = xmalloc(sizeof(float) * (size_t)n * d);
		for (int i = 0; i < n * d; i++)
			q[i] = tg_gauss(&r) * (i % 37 == 0 ? 30.0f : 1.0f);
		/* special heads: all zero, one huge, tiny values */
		memset(q, 0, sizeof(float) * (size_t)d);
		q[d + 5] = 3e4f;
		for (int c = 0; c < d; c++)
			q[2 * d + c] = 1e-30f * (float)(c - d / 2);
		float *dq, *dg;
		uint8_t *dc, *ds;
		CK(cudaMalloc((void **)&dq, sizeof(float) * (size_t)n * d));
		CK(cudaMalloc((void **)&dc, (size_t)n * d));
		CK(cudaMalloc((void **)&ds, (size_t)n * 2 * (d / 16)));
		CK(cudaMalloc((void **)&dg, sizeof(float) * 2 * (size_t)n));
		CK(cudaMemcpy(dq, q, sizeof(float) * (size_t)n * d, cudaMemcpyHostToDevice));
		uint8_t *codes = xmalloc((size_t)n * d), *scales = xmalloc((size_t)n * 2 * (d / 16));
		float *g = xmalloc(sizeof(float) * 2 * (size_t)n);
		for (int had = 0; had < 2; had++) {
			for (int nt = 1; nt <= 2; nt++) {
				CKR(bd_kernels_query_quantize(dq, n, d, had, nt, dc, ds, dg));
				CK(cudaMemcpy(codes, dc, (size_t)n * d, cudaMemcpyDeviceToHost));
				CK(cudaMemcpy(scales, ds, (size_t)n * 2 * (d / 16), cudaMemcpyDeviceToHost));
				CK(cudaMemcpy(g, dg, sizeof(float) * 2 * (size_t)n, cudaMemcpyDeviceToHost));
				query_compare("", q, n, d, had, nt, BD_FP4_NVFP4, codes, scales, g);

				/* MXFP4 (UE8M0 scales, blocks of 32, g = 1) */
				CKR(bd_kernels_query_quantize_mx(dq, n, d, had, nt, dc, ds));
				CK(cudaMemcpy(codes, dc, (size_t)n * d, cudaMemcpyDeviceToHost));
				CK(cudaMemcpy(scales, ds, (size_t)n * 2 * (d / 32), cudaMemcpyDeviceToHost));
				query_compare("MXFP4 ", q, n, d, had, nt, BD_FP4_MXFP4, codes, scales,
					      NULL);
			}
		}
		FREE_DEV(dq, dc, ds, dg);
		FREE_HOST(q, codes, scales, g);
	}
}

/* ---- promotion ------------------------------------------------------------------------------- */

static void fill_slot_recent(const struct bd_layout *lay, uint8_t *slot, struct tg_rng *r, int kind)
{
	for (int l = 0; l < lay->n_layers; l++)
		for (int h = 0; h < lay->n_kv_heads; h++) {
			bd_bf16 *k = bd_slot_recent_k(lay, slot, l, h), *v = bd_slot_recent_v(lay, slot, l, h);
			const int sel = (l * lay->n_kv_heads + h + kind) % 5;
			for (int i = 0; i < BD_RECENT_TOKENS * lay->d; i++) {
				float a, b;
				switch (sel) {
				case 0: /* all zero, with negative zeros */
					a = (i & 1) ? -0.0f : 0.0f;
					b = (i & 2) ? -0.0f : 0.0f;
					break;
				case 1: /* small integers: exact E2M1 ties after scaling */
					a = (float)((int)(tg_next(r) % 25) - 12);
					b = (float)((int)(tg_next(r) % 13) - 6) * 0.5f;
					break;
				case 2: /* tiny values (E4M3 scales near the subnormals) */
					a = 1e-3f * tg_gauss(r) * (i % 97 == 0 ? 1000.0f : 1.0f);
					b = 1e-20f * tg_gauss(r);
					break;
				case 3: /* huge outliers */
					a = tg_gauss(r) * (i % 61 == 0 ? 3e4f : 1.0f);
					b = tg_gauss(r) * (i % 50 == 0 ? 1e6f : 1.0f);
					break;
				default:
					a = tg_gauss(r) * (i % 128 == 7 ? 20.0f : 1.0f);
					b = tg_gauss(r);
					break;
				}
				k[i] = bd_f32_to_bf16(a);
				v[i] = bd_f32_to_bf16(b);
			}
		}
}

static void promote_checks(bool small)
{
	static const char *cfgs[] = { "bitdecoding-nvfp4", "nvfp4-base", "bitdecoding-mxfp4", "bf16" };
	struct tg_rng r = { 4242 };

	for (int ci = 0; ci < 4; ci++) {
		for (int d = 64; d <= 128; d *= 2) {
			const struct bd_kvcfg *cfg = bd_kvcfg_find(cfgs[ci]);
			struct bd_layout lay;
			const int n = small ? 1 : 3, L = 2, H = 3, pages = 6;
			CKR(bd_layout_init(&lay, cfg->page_fmt, L, H, d, 0, pages));
			uint8_t *arena = xmalloc(lay.arena_bytes), *ga = xmalloc(lay.arena_bytes);
			uint8_t *slots = xmalloc(lay.slot_bytes * (size_t)n);
			int32_t pg[3] = { 4, 1, 5 };
			for (size_t i = 0; i < lay.arena_bytes; i++)
				arena[i] = (uint8_t)(tg_next(&r) & 0xff);
			for (int i = 0; i < n; i++)
				fill_slot_recent(&lay, slots + (size_t)i * lay.slot_bytes, &r, i);
			/* device: the same arena bytes and slots */
			void *d_arena, *d_slots, **d_ptrs;
			int32_t *d_pages;
			int *d_status, status[3];
			void *ptrs[3];
			CK(cudaMalloc(&d_arena, lay.arena_bytes));
			CK(cudaMemcpy(d_arena, arena, lay.arena_bytes, cudaMemcpyHostToDevice));
			CK(cudaMalloc(&d_slots, lay.slot_bytes * (size_t)n));
			CK(cudaMemcpy(d_slots, slots, lay.slot_bytes * (size_t)n, cudaMemcpyHostToDevice));
			for (int i = 0; i < n; i++)
				ptrs[i] = (uint8_t *)d_slots + (size_t)i * lay.slot_bytes;
			CK(cudaMalloc((void **)&d_ptrs, sizeof(ptrs)));
			CK(cudaMemcpy(d_ptrs, ptrs, sizeof(ptrs), cudaMemcpyHostToDevice));
			CK(cudaMalloc((void **)&d_pages, sizeof(pg)));
			CK(cudaMemcpy(d_pages, pg, sizeof(pg), cudaMemcpyHostToDevice));
			CK(cudaMalloc((void **)&d_status, sizeof(status)));
			CK(cudaMemset(d_status, 0x55, sizeof(status)));
			for (int i = 0; i < n; i++)
				CKR(bd_page_promote(&lay, cfg, NULL, slots + (size_t)i * lay.slot_bytes, arena, pg[i]));
			CKR(bd_promote_run(&lay, cfg, d_arena, (void *const *)d_ptrs, d_pages, n, d_status, NULL));
			CK(cudaDeviceSynchronize());
			CK(cudaMemcpy(ga, d_arena, lay.arena_bytes, cudaMemcpyDeviceToHost));
			CK(cudaMemcpy(status, d_status, sizeof(int) * (size_t)n, cudaMemcpyDeviceToHost));
			size_t diff = 0, first = 0;
			for (size_t i = 0; i < lay.arena_bytes; i++)
				if (arena[i] != ga[i] && diff++ == 0)
					first = i;
			bool st_ok = true;
			for (int i = 0; i < n; i++)
				st_ok = st_ok && status[i] == 0;
			check(diff == 0 && st_ok, "promote %s d=%d: %zu bytes differ (first at %zu), status ok %d",
			      cfgs[ci], d, diff, first, st_ok);
			printf("  promote %-18s d=%3d: %zu of %zu arena bytes differ\n", cfgs[ci], d, diff,
			       lay.arena_bytes);

			if (!small && ci == 0) {
				/* refusals: a NaN in the slot → -EDOM, bad page → -EINVAL; arena untouched */
				uint8_t *s0 = slots;
				bd_bf16 nan = 0x7fc0;
				memcpy(bd_slot_recent_v(&lay, s0, 1, 2) + 77, &nan, sizeof(nan));
				CK(cudaMemcpy(d_slots, slots, lay.slot_bytes, cudaMemcpyHostToDevice));
				int32_t pg2[2] = { 0, 99 };
				CK(cudaMemcpy(d_pages, pg2, sizeof(pg2), cudaMemcpyHostToDevice));
				void *p2[2] = { ptrs[0], ptrs[1] };
				CK(cudaMemcpy(d_ptrs, p2, sizeof(p2), cudaMemcpyHostToDevice));
				CKR(bd_promote_run(&lay, cfg, d_arena, (void *const *)d_ptrs, d_pages, 2, d_status, NULL));
				CK(cudaDeviceSynchronize());
				uint8_t *ga2 = xmalloc(lay.arena_bytes);
				CK(cudaMemcpy(ga2, d_arena, lay.arena_bytes, cudaMemcpyDeviceToHost));
				CK(cudaMemcpy(status, d_status, sizeof(int) * 2, cudaMemcpyDeviceToHost));
				check(status[0] == -EDOM && status[1] == -EINVAL && memcmp(ga2, ga, lay.arena_bytes) == 0,
				      "promote refusals: status %d %d (want %d %d), arena untouched %d", status[0],
				      status[1], -EDOM, -EINVAL, memcmp(ga2, ga, lay.arena_bytes) == 0);
				check(bd_promote_run(&lay, cfg, d_arena, (void *const *)d_ptrs, d_pages, 2, NULL, NULL) == -EINVAL,
				      "promote: NULL status must be -EINVAL");
				free(ga2);
			}
			FREE_DEV(d_arena, d_slots, d_ptrs, d_pages, d_status);
			FREE_HOST(arena, ga, slots);
			if (small)
				return;
		}
	}
}

/* Family f becomes the one under test when the device supports it (else reported). */
static bool next_family(int f)
{
	char why[BD_KFAMILY_WHY_MAX] = "";

	family = (enum bd_kfamily)f;
	if (!family_serves(bd_kvcfg_find("bitdecoding-nvfp4"), 128, 4, why, sizeof(why))) {
		printf("family %s: unsupported on this device: %s\n", bd_kfamily_name(family), why);
		return false;
	}
	printf("family %s:\n", bd_kfamily_name(family));
	return true;
}

/* The decode checks of the family under test: status bits, real KV, every configuration and
 * shape it serves over short and long contexts. *seed_io: the next problem's seed. */
static void decode_checks(bool quick, uint64_t *seed_io)
{
	static const char *cfgs[] = { "bitdecoding-nvfp4", "nvfp4-base", "+dual", "+pscale",
				      "+keyquant", "bitdecoding-mxfp4", "bf16", "trtllm-nvfp4",
				      "bitdecoding-nvfp4:norm=qmass", "nvfp4-base:norm=qmass",
				      "bitdecoding-mxfp4:norm=qmass" };
	const int ncfg = (int)(sizeof(cfgs) / sizeof(cfgs[0]));
	static const int lens[8] = { 1, 15, 16, 17, 127, 128, 129, 4095 };
	static const int Gs[4] = { 1, 3, 4, 8 };
	uint64_t seed = *seed_io;

	status_checks("bitdecoding-nvfp4");
	status_checks("trtllm-nvfp4");
	/* q = 0, V ≡ 1: every configuration under both normalizations */
	for (int ci = 0; ci < BD_KVCFG_COUNT; ci++)
		for (int d = 64; d <= 128; d *= 2)
			if (!quick || d == 128)
				unit_case(bd_kvcfg_get(ci)->name, d, d == 64 ? 8 : 4, seed++);
	/* real KV first: the model's captured K/V/q through every configuration */
	{
		const char *path = getenv("BD_GPU_CAPTURE");
		struct capture cap;
		if (!path || !*path) {
			printf("  real KV: BD_GPU_CAPTURE not set (make gpu-capture writes it): skipped\n");
		} else if (capture_load(path, &cap) < 0) {
			check(false, "real KV: cannot load %s", path);
		} else {
			for (int ci = 0; ci < ncfg; ci++)
				capture_case(cfgs[ci], &cap);
			capture_free(&cap);
		}
	}

	for (int ci = 0; ci < ncfg; ci++)
		for (int d = 64; d <= 128; d *= 2)
			for (int gi = 0; gi < 4; gi++) {
				/* auto splits, a few splits, and more splits than pages (empty ones) */
				const int sp[3] = { 0, 5, 40 };
				if (quick && (gi != 2 || d != 128))
					continue;
				decode_case(cfgs[ci], d, Gs[gi], 2, lens, 8, 2, sp, 3, seed++, true);
			}
	if (!quick) {
		/* long contexts: one request of 131072 tokens and one of 40000 beside a short one */
		const int ll[3] = { 131072, 40000, 300 };
		const int sp[2] = { 0, 3 };
		decode_case("bitdecoding-nvfp4", 128, 4, 2, ll, 3, 1, sp, 2, seed++, true);
		decode_case("nvfp4-base", 128, 8, 1, ll, 3, 1, sp, 1, seed++, true);
		decode_case("bitdecoding-mxfp4", 128, 4, 2, ll, 3, 1, sp, 2, seed++, true);
		decode_case("bf16", 128, 4, 1, ll, 3, 1, sp, 1, seed++, true);
		decode_case("trtllm-nvfp4", 128, 4, 1, ll, 3, 1, sp, 1, seed++, true);
		/* four or eight requests, one or two of 16K tokens, on 32 KV-head slots: on an H200
		 * (132 SMs) a build with the persistent kernel takes it here (the plan sizes the
		 * splits by the longest request; its BF16 partials would need a wave of their own),
		 * at 4 and at 3 CTAs per SM */
		const int l16[8] = { 16384, 129, 300, 17, 16383, 1, 4095, 200 };
		const int s0[1] = { 0 };
		decode_case("bitdecoding-nvfp4", 128, 4, 8, l16, 4, 1, s0, 1, seed++, true);
		decode_case("bitdecoding-mxfp4", 128, 8, 4, l16, 8, 1, s0, 1, seed++, true);
		decode_case("bitdecoding-nvfp4", 64, 8, 4, l16, 8, 1, s0, 1, seed++, true);
	}
	*seed_io = seed;
}

int main(int argc, char **argv)
{
	bool small = argc > 1 && strcmp(argv[1], "--small") == 0;
	bool quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
	int dev = 0;
	struct cudaDeviceProp prop;
	double t0 = bd_now_s();

	CK(cudaGetDevice(&dev));
	CK(cudaGetDeviceProperties(&prop, dev));
	printf("gpu_check on %s (%d SMs)\n", prop.name, prop.multiProcessorCount);

	if (small) {
		const int lens[3] = { 300, 17, 129 };
		const int sp[1] = { 2 };
		for (int f = 0; f < BD_KFAMILY_COUNT; f++) {
			if (!next_family(f))
				continue;
			decode_case("bitdecoding-nvfp4", 128, 4, 2, lens, 3, 1, sp, 1, 11, true);
			decode_case("bitdecoding-mxfp4", 64, 8, 1, lens, 3, 1, sp, 1, 13, true);
			decode_case("bf16", 64, 2, 2, lens, 3, 1, sp, 1, 12, true);
			decode_case("trtllm-nvfp4", 128, 3, 2, lens, 3, 1, sp, 1, 14, true);
		}
		promote_checks(true);
		printf("%s: %d checks passed, %d failed\n", n_fail ? "FAIL" : "PASS", n_pass, n_fail);
		return n_fail ? 1 : 0;
	}

	refusal_checks();
	e4m3_checks();
	query_checks();
	promote_checks(false);

	uint64_t seed = 1000;

	for (int f = 0; f < BD_KFAMILY_COUNT; f++)
		if (next_family(f))
			decode_checks(quick, &seed);
	printf("%s: %d checks passed, %d failed (%.1fs)\n", n_fail ? "FAIL" : "PASS", n_pass, n_fail,
	       bd_now_s() - t0);
	return n_fail ? 1 : 0;
}
