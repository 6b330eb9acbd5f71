/* bd_model.h — a Llama, Qwen2 or Qwen3 decoder's weights on the CPU, whole or one
 * tensor-parallel rank's shard.
 *
 * A GGUF model keeps the file mapped: its weight matrices stay the file's ggml blocks where
 * bd_ggml_gemv() multiplies their type (bd_wmat.h), and only the others, and the vectors
 * (norms, biases), are dequantized to FP32 at load (bd_gguf.h reads GGUF files). Hugging Face
 * checkpoints (bd_model_hf.h) and models built in memory are FP32. The rest of the CPU model is beside this header: bd_kvmem.h the KV memory
 * a sequence draws from, bd_seq.h one request's state and bdfp4 KV cache, bd_forward.h the
 * forward pass (prefill, decode, generation) over a sequence.
 *
 * Shapes: E = n_embd, F = n_ff, Hq query heads, Hkv KV heads, G = Hq / Hkv, d head dim,
 * V = n_vocab, L = n_layers. Query head j reads KV head j / G. Matrices are row-major
 * [out][in] (a GGUF tensor with ne = {in, out}), so y = W x.
 *
 * Errors are -errno: -EINVAL a bad argument (NULL, a token id outside the vocabulary, an
 * unknown configuration, a sequence in the wrong state), -ENOTSUP a model shape the cache
 * cannot hold, -ENOSPC the sequence or its arena is full, -EDOM a non-finite value met on the
 * way, -ENOMEM, and the loader's codes (bd_gguf.h). Functions taking ret_err (NULL or
 * BD_MODEL_ERR_MAX bytes) put a one-line message there on failure.
 */
#ifndef BD_MODEL_H
#define BD_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "formats/bd_gguf.h"
#include "model/bd_wmat.h"

#ifdef __cplusplus
extern "C" {
#endif

#define BD_MODEL_ERR_MAX 256

/* ---- weights ------------------------------------------------------------------------------ */

/* One decoder block. The vectors are FP32; optional ones are NULL when the architecture has
 * none (biases: Qwen2 only; q/k norms: Qwen3 only). The matrices are struct bd_wmat, FP32 or
 * the file's blocks. */
struct bd_model_layer {
	float *attn_norm;       /* [E] RMSNorm weight before attention */
	struct bd_wmat wq;      /* [Hq·d][E] */
	struct bd_wmat wk;      /* [Hkv·d][E] */
	struct bd_wmat wv;      /* [Hkv·d][E] */
	struct bd_wmat wo;      /* [E][Hq·d] */
	float *bq, *bk, *bv;    /* [Hq·d], [Hkv·d], [Hkv·d] or NULL */
	float *q_norm, *k_norm; /* [d] per-head RMSNorm weights before RoPE, or NULL */
	float *ffn_norm;        /* [E] RMSNorm weight before the MLP */
	struct bd_wmat w_gate;  /* [F][E] */
	struct bd_wmat w_up;    /* [F][E] */
	struct bd_wmat w_down;  /* [E][F] */
};

/* The part of a model one tensor-parallel rank holds (Megatron-style split). KV
 * heads are dealt out as evenly as they go, the first ranks taking one more (SmolLM2's 3 over
 * TP = 2: rank 0 heads {0, 1}, rank 1 head {2}); each rank has the G query heads of its KV
 * heads and a contiguous block of MLP columns, again the first ranks taking one more. Rank 0
 * holds the final norm and the LM head; every rank holds the token embeddings. A whole model
 * is the shard rank 0 of tp 1. */
struct bd_model_shard {
	int rank, tp;
	int kv_head0, n_kv_heads; /* global KV heads kv_head0 .. kv_head0 + n_kv_heads − 1 */
	int head0, n_heads;       /* global query heads: kv_head0·G, n_kv_heads·G of them */
	int ff0, n_ff;            /* global MLP columns ff0 .. ff0 + n_ff − 1 */
	bool lm_head;             /* output_norm and output are held (rank 0) */
};

/* A loaded model, or one rank's shard of it. Immutable after load, so any number of sequences
 * (and threads, one per sequence) may use it at once. hp is always the whole model's; a
 * shard's tensors have its local sizes Hq' = shard.n_heads, Hkv' = shard.n_kv_heads and
 * F' = shard.n_ff in place of Hq, Hkv and F in the shapes of struct bd_model_layer (wq holds
 * the rows of its query heads, wo the columns, w_gate and w_up the rows of its MLP columns,
 * w_down the columns). The pool is the one mutable part: bd_model_set_threads() replaces it
 * while no forward pass runs; forward passes on several threads share it (a call that finds it
 * busy runs on its own thread, bd_tpool.h). */
struct bd_model {
	struct bd_model_hparams hp;
	struct bd_model_shard shard;
	struct bd_wmat tok_embd;      /* [V][E] token embeddings (a row dequantized per token) */
	float *output_norm;           /* [E] final RMSNorm weight, NULL without the LM head */
	struct bd_wmat output;        /* [V][E] LM head; the same matrix as tok_embd when
				       * hp.tied_embeddings; not held (rows 0) without the LM head */
	struct bd_model_layer *layers; /* [L] */
	void *mem;                    /* one allocation holding every FP32 tensor above */
	size_t mem_bytes;
	struct bd_gguf *gguf;         /* a reference to the file the blocks lie in, or NULL */
	size_t block_bytes;           /* bytes of file blocks the matrices read (tied: once) */
	struct bd_tpool *pool;        /* the threads of the block products and the decode
				       * attention (bd_model_set_threads), NULL: the caller's */
};

/* Allocate a model of shape hp with every weight zero (norm weights included) and the
 * optional tensors hp asks for (biases when hp->attn_bias, q/k norms when hp->qk_norm, a
 * separate LM head unless hp->tied_embeddings). Loaders and tests fill the weights in.
 * Requires positive sizes (n_ctx_train included), Hq a multiple of Hkv, head_dim_v ==
 * head_dim, n_rot even in 2..head_dim, finite rope_base > 0 and norm_eps > 0, a known
 * rope_style. Returns 0, -EINVAL, -ENOMEM; *ret only on success. */
int bd_model_alloc(const struct bd_model_hparams *hp, struct bd_model **ret);

/* Build a model from a parsed GGUF file: hyperparameters by bd_gguf_model_hparams(), every
 * tensor (token_embd, output_norm, output unless tied, blk.N.{attn_norm, attn_q, attn_k,
 * attn_v, attn_output, ffn_norm, ffn_gate, ffn_up, ffn_down}, blk.N.attn_{q,k,v}.bias for
 * Qwen2, blk.N.attn_{q,k}_norm for Qwen3) checked for its shape; a matrix of a type
 * bd_ggml_gemv() multiplies points into g's blocks, every other tensor is dequantized to FP32.
 * The model takes a reference to g when it points into it (bd_gguf_ref), so the caller may
 * free its handle at once (a bd_gguf_open_mem() buffer must outlive the model).
 * Returns 0, the hparams errors, -EBADMSG (a tensor missing or of
 * the wrong shape), -ENOTSUP (a tensor type the dequantizer lacks, or a value head dim unlike
 * the key head dim), -ENOMEM; *ret only on success. */
int bd_model_from_gguf(const struct bd_gguf *g, struct bd_model **ret, char *ret_err);

/* Open, parse and load a GGUF file (bd_gguf_open + bd_model_from_gguf; the file stays mapped
 * while the model points into it). Returns 0 or the errors of both. */
int bd_model_load(const char *path, struct bd_model **ret, char *ret_err);

/* Run m's forward passes on n_threads threads in all, the caller's included: the block
 * products split their weight rows and the decode attention its KV heads over a pool of
 * n_threads − 1 threads the model owns (bd_tpool.h; 1: no pool). The results are the same
 * bits for every n_threads. A model starts with 1; FP32 matrices and the prefill's sgemm are
 * OpenBLAS's, whose threads openblas_set_num_threads() sets. Not while a forward pass of m
 * runs. Returns 0, -EINVAL (m NULL, n_threads outside 1..BD_TPOOL_MAX_THREADS), the pool's
 * -ENOMEM / -EAGAIN (m keeps its previous threads). */
int bd_model_set_threads(struct bd_model *m, int n_threads);

/* Release a model (and its reference to the file). NULL is a no-op. */
void bd_model_free(struct bd_model *m);

/* ---- tensor parallelism ---------------------------------------------------------- */

/* The shard of rank `rank` (0..tp−1) of tp ranks for a model of shape hp (struct
 * bd_model_shard says how heads and columns are dealt). Returns 0, -EINVAL (NULL, hp out of
 * range as bd_model_alloc checks, rank outside 0..tp−1, tp < 1, or tp larger than Hkv or F:
 * every rank needs a KV head and MLP columns). */
int bd_model_shard_plan(const struct bd_model_hparams *hp, int rank, int tp,
			struct bd_model_shard *ret);

/* Rank `rank` of tp of a parsed GGUF file, or of a file (bd_model_from_gguf and
 * bd_model_load for the shard only: the rows and columns of its heads and MLP columns are
 * cut out of each tensor). A matrix of blocks stays in the file when its cut columns start
 * and end on block boundaries (a row cut always does: the shard's rows are a run of the
 * file's); a column cut inside a block is dequantized to FP32 instead. Returns 0, the errors of those two and of
 * bd_model_shard_plan. */
int bd_model_from_gguf_shard(const struct bd_gguf *g, int rank, int tp, struct bd_model **ret,
			     char *ret_err);
int bd_model_load_shard(const char *path, int rank, int tp, struct bd_model **ret,
			char *ret_err);

/* Cut rank `rank` of tp out of a whole model in memory (tests build random models this way):
 * FP32 tensors are copied; matrices of file blocks are cut as bd_model_from_gguf_shard cuts
 * them (the shard then takes its own reference to the file). Returns 0, -EINVAL (NULL, full is itself a shard, the plan's errors), -ENOMEM. */
int bd_model_shard_of(const struct bd_model *full, int rank, int tp, struct bd_model **ret);

/* The all-reduce a shard's forward pass calls after its attention-output and MLP-down
 * products: buf [n] FP32 partial sums, replaced in place by their sum over the ranks, the
 * same bytes on every rank (bd_allreduce.h's bd_allreduce_model_cb over shared memory on the
 * CPU; NCCL on the GPU). Returns 0 or -errno. Every rank of a step makes the same calls with
 * the same n, in the same order: a rank that meets an error in a layer keeps calling with NaN
 * partial sums, so that its peers fail the same step instead of waiting. */
typedef int (*bd_model_allreduce_fn)(void *ctx, float *buf, size_t n);

#ifdef __cplusplus
}
#endif
#endif
