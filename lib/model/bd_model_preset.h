/* bd_model_preset.h — named model shapes for random-weight speed work (workerd and routerd
 * --random-weights), where a checkpoint cannot be had. Values are the published Hugging Face
 * configs of those models.
 */
#ifndef BD_MODEL_PRESET_H
#define BD_MODEL_PRESET_H

#include "formats/bd_gguf.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Named shapes for --random-weights: "qwen3-4b" (36 layers, E 2560, 32/8 heads, d 128,
 * F 9728, V 151936, Qwen3 q/k norm, NEOX RoPE base 1e6) and "qwen3-30b-a3b-attn" (48 layers,
 * E 2048, 32/4 heads, d 128, a dense MLP of F 6144 = the 8 active experts' width, V 151936).
 * Returns 0 or -ENOENT (unknown name). */
int bd_model_preset(const char *name, struct bd_model_hparams *ret);

#ifdef __cplusplus
}
#endif
#endif
