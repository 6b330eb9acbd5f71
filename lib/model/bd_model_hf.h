/* bd_model_hf.h — Hugging Face checkpoints: config.json + safetensors weights, for
 * LlamaForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM.
 *
 * config.json → struct bd_model_hparams (bd_gguf.h):
 *   architectures[0] (or model_type)  arch: LlamaForCausalLM/llama, Qwen2ForCausalLM/qwen2,
 *                                     Qwen3ForCausalLM/qwen3 (both present: they must agree)
 *   hidden_size               n_embd            required
 *   intermediate_size         n_ff              required
 *   num_attention_heads       n_heads           required
 *   num_key_value_heads       n_kv_heads        default n_heads
 *   head_dim                  head_dim = head_dim_v; default hidden_size / num_attention_heads
 *                                               (Qwen3: 128, as transformers' Qwen3Config)
 *   partial_rotary_factor     n_rot = head_dim · factor (default 1)
 *   num_hidden_layers         n_layers          required
 *   rms_norm_eps              norm_eps          default 1e-6
 *   rope_theta                rope_base         default 10000 (or rope_parameters.rope_theta)
 *   vocab_size                n_vocab           required
 *   max_position_embeddings   n_ctx_train       default 2048 (Llama), 32768 (Qwen2, Qwen3)
 *   tie_word_embeddings       tied_embeddings   default false
 *   attention_bias            Llama, Qwen3: must be false (true adds an o_proj bias the
 *                             forward pass lacks: -ENOTSUP); Qwen2 always has q/k/v biases
 *   rope_scaling / rope_parameters: null, absent or rope_type (legacy "type") "default";
 *                             any other kind (linear, dynamic, yarn, llama3, longrope) -ENOTSUP
 *   hidden_act "silu" if present; mlp_bias, use_sliding_window true, or a layer_types entry
 *   other than "full_attention": -ENOTSUP. JSON null counts as absent. Integers must be JSON
 *   integers in 1..2^24, floats finite and > 0.
 * rope_style is BD_ROPE_NEOX for all three: transformers' rotate_half pairs channel i with
 * i + n_rot/2, and HF checkpoints keep q_proj/k_proj rows in that order. (llama.cpp's GGUF
 * converter permutes Llama's q/k rows so that GGUF Llama uses pairs (2i, 2i+1), BD_ROPE_NORM;
 * the same weights unpermuted are NEOX. A test checks the two agree.) qk_norm is Qwen3's.
 *
 * Tensors (PyTorch [out, in] = our row-major [out][in]; N = layer index):
 *   model.embed_tokens.weight [V, E]          tok_embd
 *   model.norm.weight [E]                     output_norm
 *   lm_head.weight [V, E]                     output (ignored when tied)
 *   model.layers.N.input_layernorm.weight [E]                  attn_norm
 *   model.layers.N.self_attn.{q,k,v}_proj.weight [Hq·d|Hkv·d, E] wq, wk, wv
 *   model.layers.N.self_attn.{q,k,v}_proj.bias (Qwen2)          bq, bk, bv
 *   model.layers.N.self_attn.o_proj.weight [E, Hq·d]            wo
 *   model.layers.N.self_attn.{q,k}_norm.weight [d] (Qwen3)      q_norm, k_norm
 *   model.layers.N.post_attention_layernorm.weight [E]          ffn_norm
 *   model.layers.N.mlp.{gate,up}_proj.weight [F, E], down_proj [E, F]
 * in F32, F16 or BF16 (converted to FP32), each shape exact. Other tensors are ignored.
 *
 * Errors (negative errno), with a one-line message in ret_err (NULL or BD_MODEL_ERR_MAX
 * bytes) on failure:
 *   -EINVAL    NULL arguments; hyperparameters bd_model_alloc refuses; a bad rank/tp
 *   -ENOENT    config.json or a weights file missing (and other open(2) errors)
 *   -EBADMSG   config.json or the index not JSON, a key missing, of the wrong type or out of
 *              range; a tensor missing, of the wrong shape, or in two files; an index entry
 *              not found in the file it names
 *   -ENOTSUP   another architecture, an unsupported option (above), a tensor dtype other
 *              than F32/F16/BF16
 *   -ENOMEM, and the safetensors parser's codes (bd_safetensors.h: -EBADMSG, -EOVERFLOW)
 * On error *ret is not written.
 */
#ifndef BD_MODEL_HF_H
#define BD_MODEL_HF_H

#include <stddef.h>

#include "formats/bd_gguf.h"
#include "model/bd_model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Hyperparameters from the text of a config.json (json[len], not NUL-terminated necessarily),
 * per the table above. Returns 0, -EINVAL, -EBADMSG, -ENOTSUP. */
int bd_hf_config_parse(const char *json, size_t len, struct bd_model_hparams *ret,
		       char *ret_err);

/* The same from a file. Returns also the errno of reading it (e.g. -ENOENT). */
int bd_hf_config_load(const char *path, struct bd_model_hparams *ret, char *ret_err);

/* Load a whole model from a checkpoint directory: dir/config.json, and the weights from
 * dir/model.safetensors.index.json (its weight_map names shard files inside dir; every
 * entry is checked against the shard) when that exists, else dir/model.safetensors.
 * Files are mapped while loading and closed before returning. */
int bd_model_from_hf(const char *dir, struct bd_model **ret, char *ret_err);

/* The same from explicit files: a config.json and paths[n_paths] (n_paths ≥ 1), each a
 * .safetensors file or a model.safetensors.index.json (whose shards, named relative to the
 * index's directory, are added in its place). A tensor may appear in one file only. */
int bd_model_from_hf_files(const char *config_path, const char *const *paths, int n_paths,
			   struct bd_model **ret, char *ret_err);

/* Rank `rank` of tp of a checkpoint directory (struct bd_model_shard): the whole model is
 * loaded, then cut with bd_model_shard_of (so it needs the whole model's memory for a
 * moment). tp 1 is the whole model. Returns also -EINVAL for a split the plan refuses. */
int bd_model_from_hf_shard(const char *dir, int rank, int tp, struct bd_model **ret,
			   char *ret_err);

#ifdef __cplusplus
}
#endif
#endif
