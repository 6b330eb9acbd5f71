/* gemv_eval.c — the decode step's weight products (one token: a matrix–vector product per
 * weight matrix) in the shape of SmolLM2-135M, by the libraries Debian ships for them: OpenBLAS
 * sgemv on FP32 weights (what lib/model/forward.c calls), oneDNN's matmul on BF16 weights, and
 * oneDNN's matmul on INT8 weights (u8 activations; timing only: no scales, so its outputs are
 * not the model's). Every layer has its own weights, so a step reads them all from memory, as
 * the model does.
 *
 * usage: gemv_eval [--repeats N] [--layers L]    (OPENBLAS_NUM_THREADS, OMP_NUM_THREADS: threads)
 * Prints a markdown table: path, weight MiB, median ms per token over N steps (after one warm-up
 * step), and the relative L2 difference of the step's outputs from the FP32 ones.
 * Built by bench/cpu/run.sh when oneDNN's header is present (libdnnl-dev); not part of `make`.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cblas.h>
#include <oneapi/dnnl/dnnl.h>

/* out × in of the products of one layer (q, k, v, o, gate, up, down), then the output head */
static const int shape[][2] = { { 576, 576 },  { 192, 576 },  { 192, 576 }, { 576, 576 },
				{ 1536, 576 }, { 1536, 576 }, { 576, 1536 } };
#define N_SHAPES (int)(sizeof(shape) / sizeof(shape[0]))
#define VOCAB 49152
#define HIDDEN 576

#define CHECK(x)                                                                      \
	do {                                                                          \
		dnnl_status_t st_ = (x);                                              \
		if (st_ != dnnl_success) {                                            \
			fprintf(stderr, "gemv_eval: %s: status %d\n", #x, (int)st_); \
			exit(1);                                                      \
		}                                                                     \
	} while (0)

struct mat {
	int out, in;
	float *w; /* [out][in] FP32 */
	dnnl_primitive_t mm[2];
	dnnl_memory_t src[2], wei[2], dst[2];
};

static double now_ms(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static uint16_t to_bf16(float x)
{
	uint32_t u;
	memcpy(&u, &x, 4);
	u += 0x7fffu + ((u >> 16) & 1u);
	return (uint16_t)(u >> 16);
}

static dnnl_engine_t eng;
static dnnl_stream_t strm;

/* oneDNN matmul y[1][out] = x[1][in] · W for W in type wt (bf16 or s8), laid out as oneDNN
 * prefers (a reorder from the plain [out][in] copy, once). */
static void dnnl_build(struct mat *m, int which)
{
	dnnl_data_type_t wt = which == 0 ? dnnl_bf16 : dnnl_s8;
	dnnl_data_type_t st = which == 0 ? dnnl_bf16 : dnnl_u8;
	dnnl_memory_desc_t smd, wmd, wany, dmd, wplain;
	dnnl_dims_t sd = { 1, m->in }, wd = { m->in, m->out }, dd = { 1, m->out };
	dnnl_matmul_desc_t desc;
	dnnl_primitive_desc_t pd, rpd;
	dnnl_primitive_t reorder;
	dnnl_memory_t wsrc;
	size_t n = (size_t)m->out * (size_t)m->in;

	CHECK(dnnl_memory_desc_init_by_tag(&smd, 2, sd, st, dnnl_ab));
	CHECK(dnnl_memory_desc_init_by_tag(&wany, 2, wd, wt, dnnl_format_tag_any));
	CHECK(dnnl_memory_desc_init_by_tag(&wplain, 2, wd, wt, dnnl_ba));
	CHECK(dnnl_memory_desc_init_by_tag(&dmd, 2, dd, dnnl_f32, dnnl_ab));
	CHECK(dnnl_matmul_desc_init(&desc, &smd, &wany, NULL, &dmd));
	CHECK(dnnl_primitive_desc_create(&pd, &desc, NULL, eng, NULL));
	wmd = *dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0);
	CHECK(dnnl_primitive_create(&m->mm[which], pd));
	CHECK(dnnl_memory_create(&m->src[which], &smd, eng, DNNL_MEMORY_ALLOCATE));
	CHECK(dnnl_memory_create(&m->dst[which], &dmd, eng, DNNL_MEMORY_ALLOCATE));
	CHECK(dnnl_memory_create(&m->wei[which], &wmd, eng, DNNL_MEMORY_ALLOCATE));
	CHECK(dnnl_memory_create(&wsrc, &wplain, eng, DNNL_MEMORY_ALLOCATE));
	void *p;
	CHECK(dnnl_memory_get_data_handle(wsrc, &p));
	if (which == 0) {
		uint16_t *b = p;
		for (size_t i = 0; i < n; i++)
			b[i] = to_bf16(m->w[i]);
	} else {
		int8_t *b = p;
		for (size_t i = 0; i < n; i++)
			b[i] = (int8_t)lrintf(m->w[i] * 127.0f);
	}
	CHECK(dnnl_reorder_primitive_desc_create(&rpd, &wplain, eng, &wmd, eng, NULL));
	CHECK(dnnl_primitive_create(&reorder, rpd));
	dnnl_exec_arg_t ra[2] = { { DNNL_ARG_FROM, wsrc }, { DNNL_ARG_TO, m->wei[which] } };
	CHECK(dnnl_primitive_execute(reorder, strm, 2, ra));
	CHECK(dnnl_stream_wait(strm));
	dnnl_primitive_destroy(reorder);
	dnnl_primitive_desc_destroy(rpd);
	dnnl_primitive_desc_destroy(pd);
	dnnl_memory_destroy(wsrc);
}

static void run_dnnl(struct mat *m, int which, const float *x, float *y)
{
	void *p;
	CHECK(dnnl_memory_get_data_handle(m->src[which], &p));
	if (which == 0)
		for (int i = 0; i < m->in; i++)
			((uint16_t *)p)[i] = to_bf16(x[i]);
	else
		for (int i = 0; i < m->in; i++)
			((uint8_t *)p)[i] = (uint8_t)(lrintf(x[i] * 60.0f) + 128);
	dnnl_exec_arg_t a[3] = { { DNNL_ARG_SRC, m->src[which] },
				 { DNNL_ARG_WEIGHTS, m->wei[which] },
				 { DNNL_ARG_DST, m->dst[which] } };
	CHECK(dnnl_primitive_execute(m->mm[which], strm, 3, a));
	CHECK(dnnl_stream_wait(strm));
	CHECK(dnnl_memory_get_data_handle(m->dst[which], &p));
	memcpy(y, p, sizeof(float) * (size_t)m->out);
}

static int cmp(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
	int reps = 9, layers = 30;
	for (int i = 1; i + 1 < argc; i += 2) {
		if (strcmp(argv[i], "--repeats") == 0)
			reps = atoi(argv[i + 1]);
		else if (strcmp(argv[i], "--layers") == 0)
			layers = atoi(argv[i + 1]);
	}
	if (reps < 1 || reps > 1000 || layers < 1 || layers > 64) {
		fprintf(stderr, "usage: gemv_eval [--repeats 1..1000] [--layers 1..64]\n");
		return 2;
	}
	int nm = layers * N_SHAPES + 1;
	struct mat *M = calloc((size_t)nm, sizeof(*M));
	float x[1536], *ref = NULL, *got = NULL;
	size_t ny = 0, params = 0;
	srand(7);
	for (int i = 0; i < 1536; i++)
		x[i] = (float)rand() / RAND_MAX - 0.5f;
	CHECK(dnnl_engine_create(&eng, dnnl_cpu, 0));
	CHECK(dnnl_stream_create(&strm, eng, dnnl_stream_default_flags));
	for (int i = 0; i < nm; i++) {
		M[i].out = i == nm - 1 ? VOCAB : shape[i % N_SHAPES][0];
		M[i].in = i == nm - 1 ? HIDDEN : shape[i % N_SHAPES][1];
		size_t n = (size_t)M[i].out * (size_t)M[i].in;
		M[i].w = malloc(n * sizeof(float));
		for (size_t j = 0; j < n; j++)
			M[i].w[j] = ((float)rand() / RAND_MAX - 0.5f) * 0.1f;
		dnnl_build(&M[i], 0);
		dnnl_build(&M[i], 1);
		ny += (size_t)M[i].out;
		params += n;
	}
	ref = malloc(ny * sizeof(float));
	got = malloc(ny * sizeof(float));
	static const char *const name[] = { "OpenBLAS sgemv, FP32 weights",
					    "oneDNN matmul, BF16 weights",
					    "oneDNN matmul, INT8 weights (timing only)" };
	static const double bytes[] = { 4, 2, 1 };
	printf("| path | weights MiB | ms per token (median of %d) | rel. L2 vs FP32 |\n", reps);
	printf("| --- | --- | --- | --- |\n");
	for (int path = 0; path < 3; path++) {
		double *t = malloc(sizeof(double) * (size_t)(reps + 1));
		for (int r = 0; r <= reps; r++) {
			float *y = path == 0 ? ref : got;
			double t0 = now_ms();
			for (int i = 0, off = 0; i < nm; off += M[i].out, i++) {
				if (path == 0)
					cblas_sgemv(CblasRowMajor, CblasNoTrans, M[i].out, M[i].in,
						    1.0f, M[i].w, M[i].in, x, 1, 0.0f, y + off, 1);
				else
					run_dnnl(&M[i], path - 1, x, y + off);
			}
			t[r] = now_ms() - t0;
		}
		qsort(t + 1, (size_t)reps, sizeof(double), cmp);
		double num = 0, den = 0;
		for (size_t i = 0; i < ny && path == 1; i++) {
			num += ((double)got[i] - ref[i]) * ((double)got[i] - ref[i]);
			den += (double)ref[i] * ref[i];
		}
		char err[32] = "–";
		if (path == 1)
			snprintf(err, sizeof(err), "%.2g", sqrt(num / den));
		printf("| %s | %.0f | %.2f | %s |\n", name[path],
		       (double)params * bytes[path] / 1048576.0, t[1 + reps / 2], err);
		free(t);
	}
	return 0;
}
