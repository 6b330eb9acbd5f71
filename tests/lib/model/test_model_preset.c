/* test_model_preset.c — bd_model_preset (bd_model_preset.h): the named shapes of --random-weights.
 * Suite "model_preset".
 *
 * Expected values are the published Hugging Face configs, not this implementation's output:
 *   Qwen/Qwen3-4B: hidden_size 2560, intermediate_size 9728, num_hidden_layers 36,
 *     num_attention_heads 32, num_key_value_heads 8, head_dim 128, vocab_size 151936,
 *     rope_theta 1000000, rms_norm_eps 1e-6, max_position_embeddings 40960,
 *     tie_word_embeddings true.
 *   Qwen/Qwen3-30B-A3B: hidden_size 2048, num_hidden_layers 48, num_attention_heads 32,
 *     num_key_value_heads 4, head_dim 128, vocab_size 151936, rope_theta 1000000,
 *     rms_norm_eps 1e-6, moe_intermediate_size 768 with 8 experts active per token (the
 *     preset's dense MLP is 8 · 768 = 6144 wide), tie_word_embeddings false.
 * Both are Qwen3: per-head q/k RMSNorm, NEOX RoPE over the whole head, no q/k/v biases.
 */
#include <errno.h>
#include <stdbool.h>
#include <string.h>

#include <criterion/criterion.h>

#include "model/bd_model.h"
#include "model/bd_model_preset.h"

/* What a preset's published config says: the sizes that differ between the two models. */
struct want {
	const char *name;
	int n_layers, n_embd, n_ff, n_heads, n_kv_heads;
	bool tied_embeddings;
};

/* The preset name gives want's sizes and what every Qwen3 has. */
static void check_qwen3(const struct want *w)
{
	struct bd_model_hparams hp;
	memset(&hp, 0xab, sizeof(hp));
	cr_assert_eq(bd_model_preset(w->name, &hp), 0, "%s", w->name);
	cr_expect_eq(hp.arch, BD_ARCH_QWEN3);
	cr_expect_str_eq(hp.arch_name, "qwen3");
	cr_expect_eq(hp.head_dim, 128);
	cr_expect_eq(hp.head_dim_v, 128);
	cr_expect_eq(hp.n_rot, 128, "Qwen3 rotates the whole head");
	cr_expect_eq(hp.rope_style, BD_ROPE_NEOX);
	cr_expect_float_eq(hp.rope_base, 1e6f, 1.0f);
	cr_expect_float_eq(hp.norm_eps, 1e-6f, 1e-12f);
	cr_expect_eq(hp.n_vocab, 151936);
	cr_expect(hp.qk_norm);
	cr_expect(!hp.attn_bias);
	cr_expect_eq(hp.n_ctx_train, 40960);
	cr_expect_eq(hp.n_layers, w->n_layers, "%s", w->name);
	cr_expect_eq(hp.n_embd, w->n_embd, "%s", w->name);
	cr_expect_eq(hp.n_ff, w->n_ff, "%s", w->name);
	cr_expect_eq(hp.n_heads, w->n_heads, "%s", w->name);
	cr_expect_eq(hp.n_kv_heads, w->n_kv_heads, "%s", w->name);
	cr_expect_eq(hp.tied_embeddings, w->tied_embeddings, "%s", w->name);
}

Test(model_preset, qwen3_4b)
{
	/* Qwen3-4B ties its LM head to the embeddings */
	check_qwen3(&(struct want){ "qwen3-4b", 36, 2560, 9728, 32, 8, true });
	/* E = 2560 is not Hq·d = 4096: the head dim is given, not derived */
	struct bd_model_hparams hp;
	cr_assert_eq(bd_model_preset("qwen3-4b", &hp), 0);
	cr_expect_neq(hp.n_embd, hp.n_heads * hp.head_dim);
}

Test(model_preset, qwen3_30b_a3b_attn)
{
	check_qwen3(&(struct want){ "qwen3-30b-a3b-attn", 48, 2048, 6144, 32, 4, false });
}

/* A preset is a shape the CPU model accepts and can split over TP = 2 (the worker group). */
Test(model_preset, shapes_are_valid_models)
{
	const char *names[] = { "qwen3-4b", "qwen3-30b-a3b-attn" };
	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
		struct bd_model_hparams hp;
		struct bd_model_shard sh;
		cr_assert_eq(bd_model_preset(names[i], &hp), 0);
		cr_expect_eq(bd_model_shard_plan(&hp, 1, 2, &sh), 0, "%s", names[i]);
		cr_expect_eq(sh.n_kv_heads * 2, hp.n_kv_heads, "%s", names[i]);
		cr_expect_eq(sh.n_heads, sh.n_kv_heads * (hp.n_heads / hp.n_kv_heads));
	}
}

Test(model_preset, unknown_name)
{
	struct bd_model_hparams hp, before;
	memset(&hp, 0x5c, sizeof(hp));
	before = hp;
	cr_expect_eq(bd_model_preset("qwen3-8b", &hp), -ENOENT);
	cr_expect_eq(bd_model_preset("Qwen3-4B", &hp), -ENOENT, "names are exact");
	cr_expect_eq(bd_model_preset("", &hp), -ENOENT);
	cr_expect_eq(bd_model_preset(NULL, &hp), -ENOENT);
	cr_expect_eq(memcmp(&hp, &before, sizeof(hp)), 0, "the result is untouched");
}
