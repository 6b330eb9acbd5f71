/* gpu_capture.c — capture real K/V/q of the CPU model runtime for the GPU kernel check.
 *
 * `make gpu-capture` runs it here (it needs the model file, OpenBLAS and PCRE2, which the GPU
 * machine lacks); gpu_check reads the file there (BD_GPU_CAPTURE). The embedded SmolLM2 model
 * prefills a prompt cut from a Debian text file with the BF16 configuration; the sequence's
 * hook (bd_seq_opts.hook) sees the post-RoPE q, k and v of every (layer, position), and the
 * program keeps k and v of every position and q of a few positions for some layers.
 *
 * File (little endian): "BDKVCAP1", int32 n_cap, Hq, Hkv, d, n_tok, n_q, layers[n_cap],
 * qpos[n_q], then FP32 k [n_cap][n_tok][Hkv][d], v [n_cap][n_tok][Hkv][d],
 * q [n_cap][n_q][Hq][d]. A query at position p sees keys 0..p (context length p + 1).
 *
 * Usage: gpu_capture MODEL.gguf TEXT OUT [n_tok]
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats/bd_gguf.h"
#include "quant/bd_kvcfg.h"
#include "model/bd_forward.h"
#include "model/bd_tokenizer.h"
#include "tmpdir.h"

static const int cap_layers[] = { 0, 1, 15, 29 };
#define N_CAP ((int)(sizeof(cap_layers) / sizeof(cap_layers[0])))
/* context lengths the check decodes: partial pages, page edges, the sink edge, long ones */
static const int cap_lens[] = { 1, 15, 16, 17, 127, 128, 129, 1000, 2047, 2048 };
#define N_Q ((int)(sizeof(cap_lens) / sizeof(cap_lens[0])))

struct cap {
	int Hq, Hkv, d, n_tok;
	float *k, *v, *q; /* as the file */
};

static int cap_index(int layer)
{
	for (int i = 0; i < N_CAP; i++)
		if (cap_layers[i] == layer)
			return i;
	return -1;
}

static void hook(void *ctx, int layer, int pos, const float *q, const float *k, const float *v)
{
	struct cap *c = ctx;
	int li = cap_index(layer);
	size_t kv = (size_t)c->Hkv * c->d, qn = (size_t)c->Hq * c->d;

	if (li < 0 || pos >= c->n_tok)
		return;
	memcpy(c->k + ((size_t)li * c->n_tok + pos) * kv, k, sizeof(float) * kv);
	memcpy(c->v + ((size_t)li * c->n_tok + pos) * kv, v, sizeof(float) * kv);
	for (int j = 0; j < N_Q; j++)
		if (cap_lens[j] - 1 == pos)
			memcpy(c->q + ((size_t)li * N_Q + j) * qn, q, sizeof(float) * qn);
}

int main(int argc, char **argv)
{
	char err[BD_MODEL_ERR_MAX] = "";
	struct bd_gguf *g = NULL;
	struct bd_model *m = NULL;
	struct bd_tokenizer *tok = NULL;
	struct bd_seq *s = NULL;
	struct cap c = { 0 };
	int32_t *ids = NULL;
	size_t n_ids = 0, text_n = 0;
	char *text;
	int n_tok = argc > 4 ? atoi(argv[4]) : 2048, r;
	FILE *out;

	if (argc < 4) {
		fprintf(stderr, "usage: %s MODEL.gguf TEXT OUT [n_tok]\n", argv[0]);
		return 2;
	}
	if (n_tok < cap_lens[N_Q - 1]) {
		fprintf(stderr, "n_tok must be at least %d\n", cap_lens[N_Q - 1]);
		return 2;
	}
	text = td_read_file(argv[2], &text_n);
	if (!text) {
		fprintf(stderr, "cannot read %s\n", argv[2]);
		return 1;
	}
	if ((r = bd_gguf_open(argv[1], &g, err)) < 0 || (r = bd_tokenizer_new_from_gguf(g, &tok, err)) < 0 ||
	    (r = bd_model_from_gguf(g, &m, err)) < 0) {
		fprintf(stderr, "loading %s: %s (%d)\n", argv[1], err, r);
		return 1;
	}
	if ((r = bd_tokenizer_encode(tok, text, text_n, 0, &ids, &n_ids)) < 0) {
		fprintf(stderr, "tokenizing: %d\n", r);
		return 1;
	}
	if ((size_t)n_tok > n_ids || n_tok > m->hp.n_ctx_train || cap_layers[N_CAP - 1] >= m->hp.n_layers) {
		fprintf(stderr, "text of %zu tokens, model of %d layers and context %d: too small\n",
			n_ids, m->hp.n_layers, m->hp.n_ctx_train);
		return 1;
	}
	c.Hq = m->hp.n_heads;
	c.Hkv = m->hp.n_kv_heads;
	c.d = m->hp.head_dim;
	c.n_tok = n_tok;
	c.k = calloc((size_t)N_CAP * n_tok * c.Hkv * c.d, sizeof(float));
	c.v = calloc((size_t)N_CAP * n_tok * c.Hkv * c.d, sizeof(float));
	c.q = calloc((size_t)N_CAP * N_Q * c.Hq * c.d, sizeof(float));
	if (!c.k || !c.v || !c.q) {
		fprintf(stderr, "out of memory\n");
		return 1;
	}
	/* BF16 KV: the activations are the model's own, not those of an FP4 cache */
	struct bd_seq_opts so = { .max_tokens = n_tok, .hook = hook, .hook_ctx = &c };
	if ((r = bd_seq_new(m, bd_kvcfg_find("bf16"), &so, &s, err)) < 0 ||
	    (r = bd_model_prefill(m, s, ids, n_tok, NULL)) < 0) {
		fprintf(stderr, "prefill: %s (%d)\n", err, r);
		return 1;
	}

	out = fopen(argv[3], "wb");
	if (!out) {
		fprintf(stderr, "cannot write %s\n", argv[3]);
		return 1;
	}
	const int32_t hdr[6] = { N_CAP, c.Hq, c.Hkv, c.d, n_tok, N_Q };
	int32_t qpos[N_Q];
	for (int j = 0; j < N_Q; j++)
		qpos[j] = cap_lens[j] - 1;
	const size_t nkv = (size_t)N_CAP * n_tok * c.Hkv * c.d, nq = (size_t)N_CAP * N_Q * c.Hq * c.d;
	int ok = fwrite("BDKVCAP1", 1, 8, out) == 8 && fwrite(hdr, sizeof(hdr), 1, out) == 1 &&
		 fwrite(cap_layers, sizeof(cap_layers), 1, out) == 1 &&
		 fwrite(qpos, sizeof(qpos), 1, out) == 1 && fwrite(c.k, sizeof(float), nkv, out) == nkv &&
		 fwrite(c.v, sizeof(float), nkv, out) == nkv && fwrite(c.q, sizeof(float), nq, out) == nq;
	if (fclose(out) != 0 || !ok) {
		fprintf(stderr, "writing %s failed\n", argv[3]);
		return 1;
	}
	printf("gpu_capture: %d tokens of %s, layers", n_tok, argv[2]);
	for (int i = 0; i < N_CAP; i++)
		printf(" %d", cap_layers[i]);
	printf(", Hq %d Hkv %d d %d, %d query positions -> %s\n", c.Hq, c.Hkv, c.d, N_Q, argv[3]);
	bd_seq_free(s);
	bd_model_free(m);
	bd_tokenizer_free(tok);
	bd_gguf_free(g);
	free(ids);
	free(text);
	free(c.k);
	free(c.v);
	free(c.q);
	return 0;
}
