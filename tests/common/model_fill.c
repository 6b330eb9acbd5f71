/* model_fill.c — the weights of a small random test model (model_fill.h). */
#include <math.h>

#include "model_fill.h"

float mf_normal(uint64_t *state)
{
	double u[2];

	for (int i = 0; i < 2; i++) {
		*state ^= *state >> 12;
		*state ^= *state << 25;
		*state ^= *state >> 27;
		u[i] = ((double)((*state * 0x2545f4914f6cdd1dull) >> 11) + 0.5) /
		       9007199254740992.0;
	}
	return (float)(sqrt(-2.0 * log(u[0])) * cos(6.283185307179586 * u[1]));
}

void mf_fill_model(struct bd_model *m, mf_fill_fn fill)
{
	const struct bd_model_hparams *hp = &m->hp;
	size_t E = (size_t)hp->n_embd, F = (size_t)hp->n_ff, V = (size_t)hp->n_vocab;
	size_t d = (size_t)hp->head_dim, qd = (size_t)hp->n_heads * d;
	size_t kd = (size_t)hp->n_kv_heads * d;

	fill(m->tok_embd.f32, V * E, 0.0f, 1.0f);
	fill(m->output_norm, E, 1.0f, 0.2f);
	if (!hp->tied_embeddings)
		fill(m->output.f32, V * E, 0.0f, 0.3f);
	for (int l = 0; l < hp->n_layers; l++) {
		struct bd_model_layer *ly = &m->layers[l];

		fill(ly->attn_norm, E, 1.0f, 0.2f);
		fill(ly->wq.f32, qd * E, 0.0f, 0.3f);
		fill(ly->wk.f32, kd * E, 0.0f, 0.3f);
		fill(ly->wv.f32, kd * E, 0.0f, 0.3f);
		fill(ly->wo.f32, E * qd, 0.0f, 0.15f);
		if (hp->attn_bias) {
			fill(ly->bq, qd, 0.0f, 0.5f);
			fill(ly->bk, kd, 0.0f, 0.5f);
			fill(ly->bv, kd, 0.0f, 0.5f);
		}
		if (hp->qk_norm) {
			fill(ly->q_norm, d, 1.0f, 0.3f);
			fill(ly->k_norm, d, 1.0f, 0.3f);
		}
		fill(ly->ffn_norm, E, 1.0f, 0.2f);
		fill(ly->w_gate.f32, F * E, 0.0f, 0.3f);
		fill(ly->w_up.f32, F * E, 0.0f, 0.3f);
		fill(ly->w_down.f32, E * F, 0.0f, 0.3f);
	}
}
