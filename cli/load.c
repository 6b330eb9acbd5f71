/* load.c — the model and its tokenizer as generate, eval-kl and calibrate load them (cli.h). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats/bd_gguf.h"
#include "model/bd_model.h"
#include "model/bd_tokenizer.h"
#include "cli.h"

int cli_load_model(const char *tool, const char *path, struct bd_model **ret_m,
		   struct bd_tokenizer **ret_tok)
{
	char gerr[BD_GGUF_ERR_MAX], err[BD_MODEL_ERR_MAX], terr[BD_TOKENIZER_ERR_MAX];
	struct bd_gguf *g = NULL;
	struct bd_model *m = NULL;
	struct bd_tokenizer *tok = NULL;
	int r;

	if ((r = bd_gguf_open(path, &g, gerr)) < 0) {
		fprintf(stderr, "bdfp4 %s: %s: %s\n", tool, path, gerr[0] ? gerr : strerror(-r));
		return -1;
	}
	if ((r = bd_model_from_gguf(g, &m, err)) < 0)
		fprintf(stderr, "bdfp4 %s: %s: %s\n", tool, path, err);
	else if ((r = bd_tokenizer_new_from_gguf(g, &tok, terr)) < 0)
		fprintf(stderr, "bdfp4 %s: %s: tokenizer: %s\n", tool, path, terr);
	bd_gguf_free(g);
	if (r < 0) {
		bd_model_free(m);
		return -1;
	}
	*ret_m = m;
	*ret_tok = tok;
	return 0;
}

int cli_eog_ids(const struct bd_tokenizer *tok, int32_t **ret_ids, int *ret_n)
{
	int32_t nv = bd_tokenizer_n_vocab(tok);
	int32_t *ids = malloc(sizeof(*ids) * (size_t)(nv > 0 ? nv : 1));
	int n = 0;
	if (!ids)
		return -ENOMEM;
	for (int32_t i = 0; i < nv; i++)
		if (bd_tokenizer_is_eog(tok, i))
			ids[n++] = i;
	*ret_ids = ids;
	*ret_n = n;
	return 0;
}
