/* bench_kernels.c — decode kernel benchmark on the GPU: Qwen3-4B attention shape by
 * default (32 query / 8 KV heads, d = 128), one layer, contexts N and batches B from the command
 * line, three kernels by default: the full recipe (bitdecoding-nvfp4), vanilla FP4 (nvfp4-base)
 * and the BF16 paged baseline (bf16); --cfg takes any configuration the kernels plan (also
 * bitdecoding-mxfp4 and trtllm-nvfp4).
 *
 * Pages hold valid quantized data: 64 distinct random page-layers made by the promotion kernel
 * (trtllm-nvfp4: by the CPU's bd_page_promote, the promotion kernel has no channel-blocked
 * path), replicated over the arena; BF16 slots hold random values. Before timing, request 0's output
 * for two KV heads is checked against the CPU reference (same tiling and splits). Timing: CUDA
 * events around each run, median of the repeats after warm-up, rotating over several copies of
 * the block tables (disjoint pages) so that small problems are not served from L2.
 * (A CUDA graph of several runs over the rotating copies is replayed, time per run.)
 * Effective bandwidth counts every byte a run must read: codes, scales and decode scales of the
 * FP4 pages (or the BF16 pages), the BF16 sink and recent rows, the queries.
 *
 * Every decode family the device supports (kernels/bd_kernels.h) is timed over the
 * configurations it serves, hopper first; a native family's rows name it after the
 * configuration ("bitdecoding-nvfp4 blackwell-tc"), the families this device does not support
 * are listed with why.
 *
 * Usage: bench_kernels [--hq 32] [--hkv 8] [--d 128] [--reps 20] [--B 1,64] [--N 8192,131072]
 *                      [--cfg bitdecoding-nvfp4,nvfp4-base,bf16] [--splits n] [--novalidate]
 * Prints one markdown row per point and a copy-bandwidth line.
 */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "quant/bd_attn_ref.h"
#include "quant/bd_fp4.h"
#include "bd_kernels.h"
#include "quant/bd_kvcfg.h"
#include "quant/bd_layout.h"
#include "gpu_ck.h"
#include "testgen.h"

static int cmp_f(const void *a, const void *b)
{
	float x = *(const float *)a, y = *(const float *)b;
	return x < y ? -1 : x > y;
}

static int parse_list(const char *s, int *out, int max)
{
	int n = 0;
	while (*s && n < max) {
		out[n++] = atoi(s);
		const char *c = strchr(s, ',');
		if (!c)
			break;
		s = c + 1;
	}
	return n;
}

/* Device-to-device copy bandwidth (bytes read + written per second), the ceiling. */
static double copy_bandwidth(void)
{
	const size_t n = (size_t)4 << 30;
	void *a, *b;
	cudaEvent_t e0, e1;
	float t[10];

	CK(cudaMalloc(&a, n));
	CK(cudaMalloc(&b, n));
	CK(cudaMemset(a, 1, n));
	CK(cudaEventCreate(&e0));
	CK(cudaEventCreate(&e1));
	CK(cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice));
	for (int i = 0; i < 10; i++) {
		CK(cudaEventRecord(e0, 0));
		CK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, 0));
		CK(cudaEventRecord(e1, 0));
		CK(cudaEventSynchronize(e1));
		CK(cudaEventElapsedTime(&t[i], e0, e1));
	}
	qsort(t, 10, sizeof(float), cmp_f);
	CK(cudaFree(a));
	CK(cudaFree(b));
	CK(cudaEventDestroy(e0));
	CK(cudaEventDestroy(e1));
	return 2.0 * (double)n / (t[5] * 1e-3);
}

struct point {
	double us, gbs, bytes;
	double rel; /* validation error, -1 when skipped */
	int n_splits;
};

/* One (configuration, B, N) point. */
static void bench_point(enum bd_kfamily fam, const struct bd_kvcfg *cfg, int B, int N, int Hq,
			int Hkv, int d, int reps, bool validate, int splits, struct point *ret)
{
	struct bd_layout lay;
	struct tg_rng r = { 7 + (uint64_t)B * 131 + (uint64_t)N };
	const int n_full = (N - 1) / BD_PAGE_TOKENS;
	const int G = Hq / Hkv;
	const size_t need = (size_t)B * (size_t)(n_full > 0 ? n_full : 1);

	/* rotating copies of the page set: at least 512 MiB of pages in total */
	CKR(bd_layout_init(&lay, cfg->page_fmt, 1, Hkv, d, 0, 1));
	size_t set_bytes = need * lay.page_bytes;
	int R = (int)((((size_t)512 << 20) + set_bytes - 1) / set_bytes);
	if (R > 64)
		R = 64;
	if (R < 1)
		R = 1;
	const size_t n_pages = need * (size_t)R;
	CKR(bd_layout_init(&lay, cfg->page_fmt, 1, Hkv, d, 0, n_pages));

	uint8_t *arena;
	CK(cudaMalloc((void **)&arena, lay.arena_bytes));

	/* 64 distinct source page-layers from random BF16 slots through the promotion kernel */
	const int S = n_pages < 64 ? (int)n_pages : 64;
	{
		uint8_t *hs = xmalloc(lay.slot_bytes * (size_t)S);
		for (int s = 0; s < S; s++) {
			uint8_t *slot = hs + (size_t)s * lay.slot_bytes;
			for (int h = 0; h < Hkv; h++) {
				bd_bf16 *k = bd_slot_recent_k(&lay, slot, 0, h), *v = bd_slot_recent_v(&lay, slot, 0, h);
				for (int i = 0; i < BD_RECENT_TOKENS * d; i++) {
					k[i] = bd_f32_to_bf16(tg_norm4(&r) * ((i % d) == 3 ? 8.0f : 1.0f));
					v[i] = bd_f32_to_bf16(tg_norm4(&r));
				}
			}
		}
		void *ds, **dptr;
		int32_t *dpg;
		int *dst;
		void **hp = xmalloc(sizeof(void *) * (size_t)S);
		int32_t *hpg = xmalloc(sizeof(int32_t) * (size_t)S);
		CK(cudaMalloc(&ds, lay.slot_bytes * (size_t)S));
		CK(cudaMemcpy(ds, hs, lay.slot_bytes * (size_t)S, cudaMemcpyHostToDevice));
		for (int s = 0; s < S; s++) {
			hp[s] = (uint8_t *)ds + (size_t)s * lay.slot_bytes;
			hpg[s] = s;
		}
		CK(cudaMalloc((void **)&dptr, sizeof(void *) * (size_t)S));
		CK(cudaMalloc((void **)&dpg, sizeof(int32_t) * (size_t)S));
		CK(cudaMalloc((void **)&dst, sizeof(int) * (size_t)S));
		CK(cudaMemcpy(dptr, hp, sizeof(void *) * (size_t)S, cudaMemcpyHostToDevice));
		CK(cudaMemcpy(dpg, hpg, sizeof(int32_t) * (size_t)S, cudaMemcpyHostToDevice));
		if (cfg->page_fmt == BD_PAGE_NVFP4_CH) {
			/* one layer: page s of the arena is its first s·page_bytes */
			uint8_t *hpages = xmalloc(lay.page_bytes * (size_t)S);
			for (int s = 0; s < S; s++)
				CKR(bd_page_promote(&lay, cfg, NULL, hs + (size_t)s * lay.slot_bytes, hpages, s));
			CK(cudaMemcpy(arena, hpages, lay.page_bytes * (size_t)S, cudaMemcpyHostToDevice));
			free(hpages);
		} else {
			CKR(bd_promote_run(&lay, cfg, arena, (void *const *)dptr, dpg, S, dst, NULL));
		}
		CK(cudaDeviceSynchronize());
		for (size_t done = (size_t)S; done < n_pages;) {
			size_t c = done < n_pages - done ? done : n_pages - done;
			CK(cudaMemcpy(arena + done * lay.page_bytes, arena, c * lay.page_bytes,
				      cudaMemcpyDeviceToDevice));
			done += c;
		}
		FREE_DEV(ds, dptr, dpg, dst);
		FREE_HOST(hs, hp, hpg);
	}

	/* requests: slots with random sink and recent rows, block tables, lengths, queries */
	const int bt_stride = n_full > 0 ? n_full : 1;
	uint8_t *hslots = xmalloc(lay.slot_bytes * (size_t)B);
	for (size_t i = 0; i < lay.slot_bytes * (size_t)B / 2; i++)
		((bd_bf16 *)hslots)[i] = bd_f32_to_bf16(tg_norm4(&r));
	int32_t *hbt = xmalloc(sizeof(int32_t) * (size_t)B * bt_stride * R);
	for (int s = 0; s < R; s++)
		for (int b = 0; b < B; b++)
			for (int p = 0; p < bt_stride; p++)
				hbt[((size_t)s * B + b) * bt_stride + p] =
					(int32_t)(((size_t)s * B + b) * (size_t)bt_stride + (size_t)p) %
					(int32_t)n_pages;
	int32_t *hlen = xmalloc(sizeof(int32_t) * (size_t)B);
	for (int b = 0; b < B; b++)
		hlen[b] = N;
	float *hq = xmalloc(sizeof(float) * (size_t)B * Hq * d);
	for (size_t i = 0; i < (size_t)B * Hq * d; i++)
		hq[i] = 1.5f * tg_norm4(&r);

	uint8_t *dslots;
	void **dptrs;
	int32_t *dbt, *dlen;
	float *dq, *dout;
	void *ws;
	void **hptrs = xmalloc(sizeof(void *) * (size_t)B);
	CK(cudaMalloc((void **)&dslots, lay.slot_bytes * (size_t)B));
	CK(cudaMemcpy(dslots, hslots, lay.slot_bytes * (size_t)B, cudaMemcpyHostToDevice));
	for (int b = 0; b < B; b++)
		hptrs[b] = dslots + (size_t)b * lay.slot_bytes;
	CK(cudaMalloc((void **)&dptrs, sizeof(void *) * (size_t)B));
	CK(cudaMemcpy(dptrs, hptrs, sizeof(void *) * (size_t)B, cudaMemcpyHostToDevice));
	CK(cudaMalloc((void **)&dbt, sizeof(int32_t) * (size_t)B * bt_stride * R));
	CK(cudaMemcpy(dbt, hbt, sizeof(int32_t) * (size_t)B * bt_stride * R, cudaMemcpyHostToDevice));
	CK(cudaMalloc((void **)&dlen, sizeof(int32_t) * (size_t)B));
	CK(cudaMemcpy(dlen, hlen, sizeof(int32_t) * (size_t)B, cudaMemcpyHostToDevice));
	CK(cudaMalloc((void **)&dq, sizeof(float) * (size_t)B * Hq * d));
	CK(cudaMemcpy(dq, hq, sizeof(float) * (size_t)B * Hq * d, cudaMemcpyHostToDevice));
	CK(cudaMalloc((void **)&dout, sizeof(float) * (size_t)B * Hq * d));

	struct bd_decode_plan pl;
	CKR(bd_decode_plan_init_family(&pl, fam, cfg, &lay, NULL, B, Hq, N, splits));
	CK(cudaMalloc(&ws, pl.ws_bytes));
	CKR(bd_decode_workspace_init(&pl, ws, NULL));
	struct bd_decode_args a = {
		.q = dq, .arena = arena, .layer = 0, .block_table = dbt, .bt_stride = bt_stride,
		.seq_lens = dlen, .slots = (void *const *)dptrs, .out = dout, .workspace = ws,
	};

	/* validate request 0, KV heads 0 and Hkv-1, against the CPU reference */
	ret->rel = -1.0;
	if (validate) {
		CK(cudaMemset(dout, 0xff, sizeof(float) * (size_t)B * Hq * d));
		CKR(bd_decode_run(&pl, &a, NULL));
		CK(cudaDeviceSynchronize());
		float *out = xmalloc(sizeof(float) * (size_t)Hq * d);
		CK(cudaMemcpy(out, dout, sizeof(float) * (size_t)Hq * d, cudaMemcpyDeviceToHost));
		struct bd_layout hl;
		CKR(bd_layout_init(&hl, cfg->page_fmt, 1, Hkv, d, 0, (size_t)bt_stride));
		uint8_t *harena = xmalloc(hl.arena_bytes);
		int32_t *hbt0 = xmalloc(sizeof(int32_t) * (size_t)bt_stride);
		for (int p = 0; p < n_full; p++) {
			CK(cudaMemcpy(harena + (size_t)p * hl.page_bytes, arena + (size_t)hbt[p] * lay.page_bytes,
				      lay.page_bytes, cudaMemcpyDeviceToHost));
			hbt0[p] = p;
		}
		struct bd_decode_params dp = bd_decode_params_default();
		dp.tile_keys = pl.tile_keys;
		dp.n_splits = pl.n_splits;
		float *ref = xmalloc(sizeof(float) * (size_t)G * d);
		double worst = 0;
		for (int hh = 0; hh < 2; hh++) {
			int h = hh ? Hkv - 1 : 0;
			struct bd_kv_view kv = { .lay = &hl, .arena = harena, .block_table = hbt0,
						 .slot = hslots, .layer = 0, .kv_head = h, .n_tokens = N };
			CKR(bd_ref_decode_gqa(cfg, &dp, &kv, hq + (size_t)h * G * d, G, ref, NULL, NULL));
			double n2 = 0, d2 = 0;
			for (int i = 0; i < G * d; i++) {
				double o = out[(size_t)h * G * d + (size_t)i];
				n2 += isfinite(o) ? (o - ref[i]) * (o - ref[i]) : INFINITY;
				d2 += (double)ref[i] * ref[i];
			}
			double rel = sqrt(n2 / d2);
			if (!(rel <= worst))
				worst = rel;
		}
		ret->rel = worst;
		FREE_HOST(out, harena, hbt0, ref);
	}

	/* a CUDA graph of R runs (one per block-table copy), replayed: no launch gaps; the time of
	 * one replay over R is one decode step */
	cudaEvent_t e0, e1;
	cudaStream_t cs;
	cudaGraph_t graph;
	cudaGraphExec_t gexec;
	float *t = xmalloc(sizeof(float) * (size_t)reps);
	CK(cudaEventCreate(&e0));
	CK(cudaEventCreate(&e1));
	CK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
	const int runs = R < 4 ? 4 : R;
	CK(cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal));
	for (int k = 0; k < runs; k++) {
		a.block_table = dbt + (size_t)(k % R) * B * bt_stride;
		CKR(bd_decode_run(&pl, &a, cs));
	}
	CK(cudaStreamEndCapture(cs, &graph));
	CK(cudaGraphInstantiate(&gexec, graph, 0));
	for (int i = 0; i < 2 + reps; i++) {
		CK(cudaEventRecord(e0, cs));
		CK(cudaGraphLaunch(gexec, cs));
		CK(cudaEventRecord(e1, cs));
		CK(cudaEventSynchronize(e1));
		if (i >= 2) {
			CK(cudaEventElapsedTime(&t[i - 2], e0, e1));
			t[i - 2] /= (float)runs;
		}
	}
	CK(cudaGraphExecDestroy(gexec));
	CK(cudaGraphDestroy(graph));
	CK(cudaStreamDestroy(cs));
	qsort(t, (size_t)reps, sizeof(float), cmp_f);
	double ms = t[reps / 2];
	/* bytes a run must read: page-heads (codes, scales), decode scales, BF16 rows, queries */
	int cnt = (cfg->sink && n_full > 0 ? BD_SINK_TOKENS : 0) + (N - n_full * BD_PAGE_TOKENS);
	double bytes = (double)B * Hkv *
			       ((double)n_full * (double)lay.head_bytes +
				(cfg->page_fmt == BD_PAGE_NVFP4 || cfg->page_fmt == BD_PAGE_NVFP4_CH ? 8.0 * n_full : 0) +
				(double)cnt * 2 * d * 2) +
		       (double)B * Hq * d * 4 * 2;
	ret->us = ms * 1e3;
	ret->bytes = bytes;
	ret->gbs = bytes / (ms * 1e-3) / 1e9;
	ret->n_splits = pl.n_splits;

	CK(cudaEventDestroy(e0));
	CK(cudaEventDestroy(e1));
	FREE_DEV(arena, dslots, dptrs, dbt, dlen, dq, dout, ws);
	FREE_HOST(t, hslots, hbt, hlen, hq, hptrs);
}

int main(int argc, char **argv)
{
	int Hq = 32, Hkv = 8, d = 128, reps = 20, splits = 0;
	int Bs[16] = { 1, 64 }, nB = 2, Ns[16] = { 8192, 32768, 131072 }, nN = 3;
	const char *cfgs[8] = { "bitdecoding-nvfp4", "nvfp4-base", "bf16" };
	int ncfg = 3;
	bool validate = true;

	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--hq") && i + 1 < argc)
			Hq = atoi(argv[++i]);
		else if (!strcmp(argv[i], "--hkv") && i + 1 < argc)
			Hkv = atoi(argv[++i]);
		else if (!strcmp(argv[i], "--d") && i + 1 < argc)
			d = atoi(argv[++i]);
		else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
			reps = atoi(argv[++i]);
		else if (!strcmp(argv[i], "--B") && i + 1 < argc)
			nB = parse_list(argv[++i], Bs, 16);
		else if (!strcmp(argv[i], "--N") && i + 1 < argc)
			nN = parse_list(argv[++i], Ns, 16);
		else if (!strcmp(argv[i], "--splits") && i + 1 < argc)
			splits = atoi(argv[++i]);
		else if (!strcmp(argv[i], "--novalidate"))
			validate = false;
		else if (!strcmp(argv[i], "--cfg") && i + 1 < argc) {
			static char buf[256];
			snprintf(buf, sizeof(buf), "%s", argv[++i]);
			ncfg = 0;
			for (char *tok = strtok(buf, ","); tok && ncfg < 8; tok = strtok(NULL, ","))
				cfgs[ncfg++] = tok;
		} else {
			fprintf(stderr, "usage: %s [--hq N] [--hkv N] [--d N] [--reps N] [--B l] [--N l] [--cfg l] [--novalidate]\n",
				argv[0]);
			return 2;
		}
	}
	if (reps < 1 || Hq < 1 || Hkv < 1 || Hq % Hkv) {
		fprintf(stderr, "bad shape\n");
		return 2;
	}
	struct cudaDeviceProp prop;
	CK(cudaGetDeviceProperties(&prop, 0));
	double cbw = copy_bandwidth();
	printf("# %s, %d SMs; device-to-device copy %.0f GB/s (read + write)\n", prop.name,
	       prop.multiProcessorCount, cbw / 1e9);
	bool fam_ok[BD_KFAMILY_COUNT];
	for (int f = 0; f < BD_KFAMILY_COUNT; f++) {
		const struct bd_kvcfg *c = bd_kvcfg_find("bitdecoding-nvfp4");
		struct bd_layout l;
		char why[BD_KFAMILY_WHY_MAX] = "";
		CKR(bd_layout_init(&l, c->page_fmt, 1, Hkv, d, 0, 1));
		fam_ok[f] = bd_decode_family_supported(f, c, &l, Hq / Hkv, why, sizeof(why)) == 0;
		printf("# family %s: %s%s\n", bd_kfamily_name(f),
		       fam_ok[f] ? "supported on this device" : "unsupported on this device: ", why);
	}
	printf("| kernel | B | N | splits | time (us) | GB read | GB/s | %% of copy BW | check rel err |\n");
	printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
	fflush(stdout);
	int bad = 0;
	for (int f = 0; f < BD_KFAMILY_COUNT; f++)
		for (int ni = 0; ni < nN && fam_ok[f]; ni++)
			for (int bi = 0; bi < nB; bi++)
				for (int ci = 0; ci < ncfg; ci++) {
					const struct bd_kvcfg *cfg = bd_kvcfg_find(cfgs[ci]);
					struct bd_layout l;
					struct point pt;
					if (!cfg) {
						fprintf(stderr, "unknown configuration %s\n",
							cfgs[ci]);
						return 2;
					}
					CKR(bd_layout_init(&l, cfg->page_fmt, 1, Hkv, d, 0, 1));
					/* only the configurations this family serves */
					if (bd_decode_family_supported(f, cfg, &l, Hq / Hkv, NULL,
								       0) < 0)
						continue;
					bench_point(f, cfg, Bs[bi], Ns[ni], Hq, Hkv, d, reps,
						    validate, splits, &pt);
					if (pt.rel > 1e-3 || pt.rel != pt.rel)
						bad++;
					printf("| %s%s%s | %d | %d | %d | %.1f | %.3f | %.0f | "
					       "%.1f | %s%.2e |\n", cfgs[ci], f ? " " : "",
					       f ? bd_kfamily_name(f) : "", Bs[bi], Ns[ni],
					       pt.n_splits, pt.us, pt.bytes / 1e9, pt.gbs,
					       100.0 * pt.gbs * 1e9 / cbw,
					       pt.rel > 1e-3 ? "FAIL " : "", pt.rel);
					fflush(stdout);
				}
	return bad ? 1 : 0;
}
