/* model_fill.h — the weights of a small random test model, tensor by tensor, drawn by the
 * caller's own generator.
 *
 * Every test that checks the model runtime on tiny random models (tests/lib/model,
 * tests/lib/serve) gives the same tensors the same centers and spreads (norm weights near 1,
 * projections near 0, the output projection half as wide); the numbers drawn, and so the
 * measured tolerances, stay each test's own.
 */
#ifndef TEST_MODEL_FILL_H
#define TEST_MODEL_FILL_H

#include <stddef.h>
#include <stdint.h>

#include "model/bd_model.h"

/* A standard normal draw of the tests' own generator: xorshift64* pairs into Box–Muller,
 * advancing *state (any non-zero seed). */
float mf_normal(uint64_t *state);

/* Fills p[0..n) around center with a spread of `spread` (what spread means — a standard
 * deviation, a half-width — is the generator's). */
typedef void (*mf_fill_fn)(float *p, size_t n, float center, float spread);

/* Fills every tensor of the whole model m (bd_model_alloc of its hp, not a shard) with fill:
 * token embeddings (0, 1); final norm (1, 0.2) and an untied LM head (0, 0.3); per layer the
 * attention and MLP norms (1, 0.2), wq, wk, wv (0, 0.3), wo (0, 0.15), the biases (0, 0.5)
 * and q/k norms (1, 0.3) where hp asks for them, w_gate, w_up, w_down (0, 0.3); in that
 * order, so a seeded generator gives the same model every time. */
void mf_fill_model(struct bd_model *m, mf_fill_fn fill);

#endif
