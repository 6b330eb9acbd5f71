/* bench_wmat.c — the decode step's weight products of the embedded model, one thread: OpenBLAS
 * sgemv on the weights expanded to FP32 (the CPU model's path before it kept the file's
 * blocks), bd_ggml_gemv() on the file's blocks with FP32 activations (each path this CPU
 * runs), and, for comparison only, a product with the activations quantized per 32 to int8 as
 * ggml does (AVX2 integer dot products, written here: a variant, not the product's code). Then
 * the logits of the model as loaded (blocks) against the same model with every matrix expanded
 * to FP32 and multiplied by OpenBLAS, over a prefill and greedy decode steps; and the CPU time
 * of a 512-token prefill of each.
 *
 * usage: bench_wmat --model FILE [--steps N] [--out RESULTS.md]
 * Run with OPENBLAS_NUM_THREADS=1 (bench/wmat.sh does). Times are CPU time of the process
 * (CLOCK_PROCESS_CPUTIME_ID) per decode step (every layer's q, k, v, o, gate, up, down and the
 * LM head, each layer's own weights, so a step reads them all from memory), the median of N
 * steps after one warm-up. The relative L2 difference is of the step's outputs from sgemv's
 * on the same activations (random, normal).
 */
#include <errno.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cblas.h>

#include "formats/bd_ggml_gemv.h"
#include "model/bd_forward.h"
#include "bench_info.h"
#include "testgen.h"

struct prod {
	const struct bd_wmat *w;
	float *f32; /* the matrix expanded */
};

static double cpu_ms(void)
{
	struct timespec t;
	clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
	return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static int cmp_d(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

/* ---- the int8-activation variant (AVX2) ------------------------------------------------------ */

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

/* x [n] quantized per 32: qx int8, dx the block's scale (max |x| / 127), sx Σ qx. */
static void quant_x(const float *x, int n, int8_t *qx, float *dx, int *sx)
{
	for (int b = 0; b < n / 32; b++) {
		float mx = 0.0f;
		for (int j = 0; j < 32; j++)
			mx = fmaxf(mx, fabsf(x[b * 32 + j]));
		float d = mx / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
		int s = 0;
		for (int j = 0; j < 32; j++) {
			int q = (int)lrintf(x[b * 32 + j] * id);
			qx[b * 32 + j] = (int8_t)q;
			s += q;
		}
		dx[b] = d;
		sx[b] = s;
	}
}

static uint16_t rd16(const uint8_t *p)
{
	return (uint16_t)(p[0] | (unsigned)p[1] << 8);
}

/* y [out] = W · x for Q4_1 or Q8_0 rows against x quantized by quant_x. */
static void gemv_q8(int type, const uint8_t *W, size_t row_bytes, int out, int in,
		    const int8_t *qx, const float *dx, const int *sx, float *y)
{
	int nb = in / 32;
	const __m256i ones = _mm256_set1_epi16(1), lo4 = _mm256_set1_epi8(0xf);
	for (int o = 0; o < out; o++) {
		const uint8_t *row = W + (size_t)o * row_bytes;
		__m256 acc = _mm256_setzero_ps();
		float macc = 0.0f;
		for (int b = 0; b < nb; b++) {
			__m256i xq = _mm256_loadu_si256((const __m256i *)(const void *)(qx + b * 32));
			__m256i p16;
			float d;
			if (type == BD_GGML_Q4_1) {
				const uint8_t *blk = row + (size_t)b * 20;
				__m128i qs = _mm_loadu_si128((const __m128i *)(const void *)(blk + 4));
				__m256i q = _mm256_set_m128i(_mm_srli_epi16(qs, 4), qs);
				q = _mm256_and_si256(q, lo4);
				p16 = _mm256_maddubs_epi16(q, xq);
				d = _cvtsh_ss(rd16(blk));
				macc += _cvtsh_ss(rd16(blk + 2)) * dx[b] * (float)sx[b];
			} else {
				const uint8_t *blk = row + (size_t)b * 34;
				__m256i q = _mm256_loadu_si256((const __m256i *)(const void *)(blk + 2));
				p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q),
							   _mm256_sign_epi8(xq, q));
				d = _cvtsh_ss(rd16(blk));
			}
			__m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
			acc = _mm256_fmadd_ps(_mm256_set1_ps(d * dx[b]), s, acc);
		}
		float l[8], t = 0.0f;
		_mm256_storeu_ps(l, acc);
		for (int i = 0; i < 8; i++)
			t += l[i];
		y[o] = t + macc;
	}
}

#pragma GCC pop_options

/* ---- the step ------------------------------------------------------------------------------ */

enum path { P_SGEMV, P_GEMV, P_Q8 };

/* One decode step's products on x (per product, its input columns) into y (concatenated). */
static void step(enum path p, const struct prod *ps, int n, const float *x, int8_t *qx,
		 float *dx, int *sx, float *y)
{
	size_t off = 0;
	for (int i = 0; i < n; i++) {
		const struct bd_wmat *w = ps[i].w;
		if (p == P_SGEMV) {
			cblas_sgemv(CblasRowMajor, CblasNoTrans, w->rows, w->cols, 1.0f, ps[i].f32,
				    w->cols, x, 1, 0.0f, y + off, 1);
		} else if (p == P_GEMV) {
			bd_ggml_gemv(w->type, w->blocks, w->row_bytes, w->rows, w->cols, x,
				     (size_t)w->cols, 1, y + off, (size_t)w->rows);
		} else {
			quant_x(x, w->cols, qx, dx, sx);
			gemv_q8(w->type, w->blocks, w->row_bytes, w->rows, w->cols, qx, dx, sx,
				y + off);
		}
		off += (size_t)w->rows;
	}
}

/* The model with every matrix expanded to FP32 (the CPU model's path before). */
static struct bd_model *expand(const struct bd_model *m)
{
	struct bd_model *f;
	if (bd_model_alloc(&m->hp, &f) < 0)
		return NULL;
	size_t E = (size_t)m->hp.n_embd;
	bd_wmat_rows_f32(&m->tok_embd, 0, m->hp.n_vocab, f->tok_embd.f32);
	memcpy(f->output_norm, m->output_norm, sizeof(float) * E);
	if (!m->hp.tied_embeddings)
		bd_wmat_rows_f32(&m->output, 0, m->hp.n_vocab, f->output.f32);
	for (int l = 0; l < m->hp.n_layers; l++) {
		const struct bd_model_layer *a = &m->layers[l];
		struct bd_model_layer *b = &f->layers[l];
		const struct bd_wmat *src[7] = { &a->wq, &a->wk, &a->wv, &a->wo,
						 &a->w_gate, &a->w_up, &a->w_down };
		struct bd_wmat *dst[7] = { &b->wq, &b->wk, &b->wv, &b->wo,
					   &b->w_gate, &b->w_up, &b->w_down };
		for (int i = 0; i < 7; i++)
			bd_wmat_rows_f32(src[i], 0, src[i]->rows, dst[i]->f32);
		memcpy(b->attn_norm, a->attn_norm, sizeof(float) * E);
		memcpy(b->ffn_norm, a->ffn_norm, sizeof(float) * E);
		/* biases and q/k norms: SmolLM2 (Llama) has none */
	}
	return f;
}

/* Max |Δlogit| and top-1 agreement of a against b over a prefill of the n prompt tokens and
 * steps greedy decode steps, teacher-forced with a's tokens. */
static void logit_diff(const struct bd_model *a, const struct bd_model *b, const int32_t *prompt,
		       int n, int steps, double *ret_max, double *ret_scale, int *ret_agree)
{
	int V = a->hp.n_vocab;
	float *la = malloc(sizeof(float) * (size_t)V), *lb = malloc(sizeof(float) * (size_t)V);
	struct bd_seq *sa, *sb;
	struct bd_seq_opts o = { .max_tokens = n + steps };
	const struct bd_kvcfg *cfg = bd_kvcfg_find("bf16");
	bd_seq_new(a, cfg, &o, &sa, NULL);
	bd_seq_new(b, cfg, &o, &sb, NULL);
	bd_model_prefill(a, sa, prompt, n, la);
	bd_model_prefill(b, sb, prompt, n, lb);
	*ret_max = *ret_scale = 0.0;
	*ret_agree = 0;
	for (int s = 0; s <= steps; s++) {
		int ia = 0, ib = 0;
		for (int i = 0; i < V; i++) {
			*ret_max = fmax(*ret_max, fabs((double)la[i] - lb[i]));
			*ret_scale = fmax(*ret_scale, fabs((double)lb[i]));
			ia = la[i] > la[ia] ? i : ia;
			ib = lb[i] > lb[ib] ? i : ib;
		}
		*ret_agree += ia == ib;
		if (s == steps)
			break;
		bd_model_decode(a, sa, ia, la);
		bd_model_decode(b, sb, ia, lb);
	}
	bd_seq_free(sa);
	bd_seq_free(sb);
	free(la);
	free(lb);
}

int main(int argc, char **argv)
{
	const char *model = NULL, *outp = NULL;
	int steps = 9;
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--model") && i + 1 < argc)
			model = argv[++i];
		else if (!strcmp(argv[i], "--steps") && i + 1 < argc)
			steps = atoi(argv[++i]);
		else if (!strcmp(argv[i], "--out") && i + 1 < argc)
			outp = argv[++i];
		else
			model = NULL, i = argc;
	}
	if (!model || steps < 1) {
		fprintf(stderr, "usage: bench_wmat --model FILE [--steps N] [--out RESULTS.md]\n");
		return 2;
	}
	char err[BD_MODEL_ERR_MAX];
	struct bd_model *m;
	if (bd_model_load(model, &m, err) < 0) {
		fprintf(stderr, "bench_wmat: %s: %s\n", model, err);
		return 1;
	}
	int L = m->hp.n_layers, n = 7 * L + 1;
	struct prod *ps = calloc((size_t)n, sizeof(*ps));
	size_t out_total = 0, max_in = 0, blocks = 0, f32b = 0;
	for (int l = 0, k = 0; l < L; l++) {
		const struct bd_model_layer *a = &m->layers[l];
		const struct bd_wmat *w[7] = { &a->wq, &a->wk, &a->wv, &a->wo,
					       &a->w_gate, &a->w_up, &a->w_down };
		for (int i = 0; i < 7; i++)
			ps[k++].w = w[i];
	}
	ps[n - 1].w = &m->output;
	for (int i = 0; i < n; i++) {
		const struct bd_wmat *w = ps[i].w;
		if (!w->blocks) {
			fprintf(stderr, "bench_wmat: a matrix of %s is not held as blocks\n", model);
			return 1;
		}
		size_t ts, bl;
		bd_ggml_type_info(w->type, &bl, &ts);
		blocks += (size_t)w->rows * ((size_t)w->cols / bl * ts);
		ps[i].f32 = malloc(sizeof(float) * (size_t)w->rows * (size_t)w->cols);
		bd_wmat_rows_f32(w, 0, w->rows, ps[i].f32);
		f32b += sizeof(float) * (size_t)w->rows * (size_t)w->cols;
		out_total += (size_t)w->rows;
		max_in = (size_t)w->cols > max_in ? (size_t)w->cols : max_in;
	}
	/* one activation vector per input width, normal (Box–Muller, fixed seed) */
	float *x = malloc(sizeof(float) * max_in), *dx = malloc(sizeof(float) * max_in / 32);
	int8_t *qx = malloc(max_in);
	int *sx = malloc(sizeof(int) * max_in / 32);
	srand(7);
	for (size_t i = 0; i < max_in; i++) {
		double u = (rand() + 1.0) / (RAND_MAX + 2.0), v = (rand() + 1.0) / (RAND_MAX + 2.0);
		x[i] = (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
	}
	float *yref = malloc(sizeof(float) * out_total), *y = malloc(sizeof(float) * out_total);
	double *t = malloc(sizeof(double) * (size_t)steps);

	struct row {
		char name[48];
		double mib, ms, rel;
	} rows[5];
	int nr = 0;
	const char *isas[3] = { "avx512", "avx2", "c" };
	step(P_SGEMV, ps, n, x, qx, dx, sx, yref);
	for (int p = -1; p < 4; p++) {
		enum path pa = p < 0 ? P_SGEMV : p < 3 ? P_GEMV : P_Q8;
		if (pa == P_GEMV && bd_ggml_gemv_set_isa(isas[p]) < 0)
			continue;
		if (pa == P_Q8 && !__builtin_cpu_supports("avx2"))
			continue;
		step(pa, ps, n, x, qx, dx, sx, y); /* warm-up */
		for (int s = 0; s < steps; s++) {
			double t0 = cpu_ms();
			step(pa, ps, n, x, qx, dx, sx, y);
			t[s] = cpu_ms() - t0;
		}
		qsort(t, (size_t)steps, sizeof(double), cmp_d);
		struct row *r = &rows[nr++];
		if (pa == P_SGEMV)
			snprintf(r->name, sizeof(r->name), "OpenBLAS sgemv, FP32 weights");
		else if (pa == P_GEMV)
			snprintf(r->name, sizeof(r->name), "bd_ggml_gemv %s, FP32 x", isas[p]);
		else
			snprintf(r->name, sizeof(r->name), "int8 x per 32 (AVX2 variant)");
		r->mib = (pa == P_SGEMV ? (double)f32b : (double)blocks) / 1048576.0;
		r->ms = t[steps / 2];
		r->rel = tg_rel_l2(y, yref, out_total);
	}
	bd_ggml_gemv_set_isa("avx512");
	for (int i = 0; i < n; i++) {
		free(ps[i].f32);
		ps[i].f32 = NULL;
	}

	/* the logits: blocks as loaded against the FP32 expansion, a 39-token prompt + 16 steps */
	struct bd_model *f = expand(m);
	int32_t prompt[39];
	for (int i = 0; i < 39; i++)
		prompt[i] = (int32_t)((i * 7919 + 11) % m->hp.n_vocab);
	double dmax, scale;
	int agree;
	logit_diff(m, f, prompt, 39, 16, &dmax, &scale, &agree);
	/* prefill of 512 tokens: blocks (panels dequantized for sgemm) against FP32 weights */
	double tpre[2];
	const struct bd_model *pm[2] = { f, m };
	int32_t *ptoks = malloc(sizeof(int32_t) * 512);
	for (int i = 0; i < 512; i++)
		ptoks[i] = (int32_t)((i * 7919 + 11) % m->hp.n_vocab);
	for (int k = 0; k < 2; k++) {
		struct bd_seq *s;
		struct bd_seq_opts so = { .max_tokens = 512 };
		bd_seq_new(pm[k], bd_kvcfg_find("bf16"), &so, &s, NULL);
		double t0 = cpu_ms();
		bd_model_prefill(pm[k], s, ptoks, 512, NULL);
		tpre[k] = cpu_ms() - t0;
		bd_seq_free(s);
	}
	free(ptoks);
	bd_model_free(f);

	FILE *outs[2] = { stdout, NULL };
	struct bench_info bi;
	if (outp && !(outs[1] = bench_results_open("bench_wmat", outp, &bi)))
		return 1;
	for (int k = 0; k < 2 && outs[k]; k++) {
		FILE *o = outs[k];
		if (k == 1)
			fprintf(o, "\n### Weight products of a decode step (bench_wmat), %s\n\n"
				   "%s, commit %s, `OPENBLAS_NUM_THREADS=1 bench_wmat --model %s "
				   "--steps %d`; CPU time of one thread, median of %d steps.\n\n",
				bi.date, bi.cpu, bi.commit, model, steps, steps);
		fprintf(o, "| path | weights read MiB | ms per token (CPU) | rel. L2 vs sgemv |\n"
			   "| --- | --- | --- | --- |\n");
		for (int i = 0; i < nr; i++)
			fprintf(o, "| %s | %.1f | %.2f | %.1e |\n", rows[i].name, rows[i].mib,
				rows[i].ms, rows[i].rel);
		fprintf(o, "\nLogits of the model as loaded (blocks, bd_ggml_gemv %s) vs the same "
			   "weights expanded to FP32 (OpenBLAS), bf16 KV, 39-token prompt + 16 greedy "
			   "steps: max |Δlogit| %.2e (logit scale %.1f), top-1 equal at %d/17.\n",
			bd_ggml_gemv_isa(), dmax, scale, agree);
		fprintf(o, "\nPrefill of 512 tokens (bf16 KV, CPU time, one thread): FP32 weights "
			   "%.0f ms, the file's blocks (1 MiB panels dequantized for sgemm) %.0f ms.\n",
			tpre[0], tpre[1]);
	}
	if (outs[1])
		fclose(outs[1]);
	free(ps);
	free(x);
	free(dx);
	free(qx);
	free(sx);
	free(yref);
	free(y);
	free(t);
	bd_model_free(m);
	return 0;
}
