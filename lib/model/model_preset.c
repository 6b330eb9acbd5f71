/* model_preset.c — named model shapes for random-weight speed work (bd_model_preset.h). */
#include <errno.h>
#include <string.h>

#include <stdbool.h>

#include "model/bd_model_preset.h"

/* A Qwen3 decoder: per-head q/k norm, NEOX RoPE over the whole head, no biases. */
static struct bd_model_hparams qwen3(int L, int E, int Hq, int Hkv, int F, int ctx, bool tied)
{
	struct bd_model_hparams hp;
	memset(&hp, 0, sizeof(hp));
	hp.arch = BD_ARCH_QWEN3;
	strcpy(hp.arch_name, "qwen3");
	hp.n_layers = L;
	hp.n_embd = E;
	hp.n_ff = F;
	hp.n_heads = Hq;
	hp.n_kv_heads = Hkv;
	hp.head_dim = 128;
	hp.head_dim_v = 128;
	hp.n_rot = 128;
	hp.rope_style = BD_ROPE_NEOX;
	hp.rope_base = 1000000.0f;
	hp.norm_eps = 1e-6f;
	hp.n_ctx_train = ctx;
	hp.n_vocab = 151936;
	hp.qk_norm = true;
	hp.attn_bias = false;
	hp.tied_embeddings = tied;
	return hp;
}

int bd_model_preset(const char *name, struct bd_model_hparams *ret)
{
	if (!name || !ret)
		return -ENOENT;
	if (strcmp(name, "qwen3-4b") == 0) {
		/* Qwen/Qwen3-4B config.json: hidden_size 2560, intermediate_size 9728,
		 * num_hidden_layers 36, num_attention_heads 32, num_key_value_heads 8,
		 * head_dim 128, vocab_size 151936, rope_theta 1e6, rms_norm_eps 1e-6,
		 * max_position_embeddings 40960, tie_word_embeddings true */
		*ret = qwen3(36, 2560, 32, 8, 9728, 40960, true);
		return 0;
	}
	if (strcmp(name, "qwen3-30b-a3b-attn") == 0) {
		/* Qwen/Qwen3-30B-A3B config.json: hidden_size 2048, num_hidden_layers 48,
		 * num_attention_heads 32, num_key_value_heads 4, head_dim 128, vocab 151936,
		 * rope_theta 1e6, rms_norm_eps 1e-6, max_position_embeddings 40960,
		 * tie_word_embeddings false; the MoE (moe_intermediate_size 768, 8 of 128
		 * experts active) stands in as one dense MLP of 8·768 = 6144 columns */
		*ret = qwen3(48, 2048, 32, 4, 6144, 40960, false);
		return 0;
	}
	return -ENOENT;
}
