/* model_data.h — what the tests of the model and formats layers (tests/lib/model,
 * tests/lib/formats, tests/lib/pool, tests/lib/serve) read from the tree and build alike: the
 * repository root, the golden JSON files under tests/data, the embedded model file, and the
 * shape of the tiny random models. Each helper asserts (Criterion) instead of returning an error, naming the
 * file and how to get it.
 */
#ifndef TEST_MODEL_DATA_H
#define TEST_MODEL_DATA_H

#include <stddef.h>

#include <jansson.h>

#include "formats/bd_gguf.h"

#define TD_PATH_MAX 512

/* The repository root the tests read from: $BD_SRCDIR, else "." (the suite runs there). */
const char *td_srcdir(void);

/* The JSON file at rel (a path below the repository root), parsed; the caller decrefs it. */
json_t *td_load_json(const char *rel);

/* The embedded model's path into buf (TD_PATH_MAX bytes): $BD_MODEL, else
 * models/SmolLM2-135M-Instruct.Q4_1.gguf below the root; asserts it is readable (`make model`
 * fetches it). Returns buf. */
const char *td_model_path(char *buf);

/* The embedded model's GGUF file, opened; the caller frees it with bd_gguf_free(). */
struct bd_gguf *td_open_model(void);

/* The tiny decoder the runtime and checkpoint tests build on: 2 layers, E 48, F 40, 4 query
 * and 2 KV heads of d 32 (n_rot 32, NEOX), V 37, context 512, RMSNorm eps 1e-5, RoPE base
 * 10000, with arch's extras: Qwen2 q/k/v biases, Qwen3 q/k norms, Llama tied embeddings.
 * arch_name is left empty. */
struct bd_model_hparams td_tiny_hparams(enum bd_arch arch);

/* Expects (Criterion, the test goes on) every field of got to equal want's, floats exactly;
 * a failure names what, the field and both values. */
void td_expect_hparams(const struct bd_model_hparams *got, const struct bd_model_hparams *want,
		       const char *what);

#endif
