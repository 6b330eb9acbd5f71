/* fuzz_model_tok.h — the embedded model's tokenizer for the text fuzzers (fuzz_tokenizer.c,
 * fuzz_chat.c), loaded once: BD_FUZZ_MODEL, else the embedded model under models/ (run from
 * the repository root, as `make fuzz-*` does). */
#ifndef FUZZ_MODEL_TOK_H
#define FUZZ_MODEL_TOK_H

#include <stdio.h>
#include <stdlib.h>

#include "formats/bd_gguf.h"
#include "model/bd_tokenizer.h"

static struct bd_tokenizer *fz_tok;

static inline void fz_tok_load(void)
{
	const char *path = getenv("BD_FUZZ_MODEL");
	char err[BD_TOKENIZER_ERR_MAX > 256 ? BD_TOKENIZER_ERR_MAX : 256] = "";
	struct bd_gguf *g = NULL;

	if (!path)
		path = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
	if (bd_gguf_open(path, &g, err) < 0 || bd_tokenizer_new_from_gguf(g, &fz_tok, err) < 0) {
		fprintf(stderr, "%s: %s (make model, or set BD_FUZZ_MODEL)\n", path, err);
		exit(2);
	}
	bd_gguf_free(g);
}

/* FZ_TOK_INITIALIZE: the target loads it in LLVMFuzzerInitialize, before any input */
#ifdef FZ_TOK_INITIALIZE
int LLVMFuzzerInitialize(int *argc, char ***argv);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	(void)argc;
	(void)argv;
	fz_tok_load();
	return 0;
}
#endif

#endif
