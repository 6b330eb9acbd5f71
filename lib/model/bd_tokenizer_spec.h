/* bd_tokenizer_spec.h — what a tokenizer's front end (tokenizer_load.c: GGUF metadata,
 * tokenizer.json) gathers, and the call that builds the tokenizer from it (tokenizer.c). Only
 * those two files include it; the public face is bd_tokenizer.h.
 */
#ifndef BD_TOKENIZER_SPEC_H
#define BD_TOKENIZER_SPEC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "formats/bd_gguf.h"
#include "model/bd_tokenizer.h"

#define BD_TOK_MAX_RE 4 /* regexes applied in sequence by one pre-tokenizer */

/* Strings point into the front end's data and need to live only during bd_tokenizer_build. */
struct bd_tokenizer_spec {
	size_t n_vocab;
	const struct bd_gguf_str *tok;  /* [n_vocab] */
	struct bd_gguf_str *tok_owned;  /* tok when the front end made it */
	uint8_t *type;                  /* [n_vocab] enum bd_token_type */
	size_t n_merges;
	struct bd_gguf_str (*merge)[2]; /* [n_merges] pairs, by rank */
	const char *merges_key;         /* names the merges in messages */
	struct bd_gguf_str re[BD_TOK_MAX_RE]; /* pre-tokenizer regexes, in order */
	int n_re;
	bool ignore_merges;             /* a pre-token that is a whole token is not merged */
	int64_t bos, eos, pad, unk;     /* −1: none */
	bool fuse_unk;                  /* one unk for a run of bytes without a token */
	bool add_bos, add_eos;
	bool has_tpl;
	struct bd_gguf_str tpl;         /* the chat template's Jinja text */
	const char *no_tpl;             /* why there is no template, for the chat functions */
};

/* Builds a tokenizer from sp: the vocabulary, its hash table and byte tokens, the merges (each
 * pair and its concatenation must be tokens), the special tokens, the regexes compiled by
 * PCRE2, and the chat template checked once (a template that is not recognized is no error
 * until a chat function is called). err: NULL or BD_TOKENIZER_ERR_MAX bytes. Returns 0 and
 * *ret, or -EBADMSG (an empty or huge vocabulary, too many merges, a merge or special id not
 * in the vocabulary, add_bos/add_eos without the id), -EIO (PCRE2 rejects a regex), -ENOMEM;
 * *ret is then not written. */
int bd_tokenizer_build(const struct bd_tokenizer_spec *sp, struct bd_tokenizer **ret,
		       char *err);

#endif
