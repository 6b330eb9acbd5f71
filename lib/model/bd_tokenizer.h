/* bd_tokenizer.h — byte-level BPE tokenizer (GPT-2 style) built from a GGUF file's
 * tokenizer.ggml.* metadata or a Hugging Face tokenizer.json, and the model's chat template.
 * The public face of tokenizer.c (the BPE core), tokenizer_load.c (the two front ends), utf8.c
 * (the stream decoder) and, for the chat functions, chat_template.c (bd_chat_template.h).
 *
 * Encoding: the text is cut at special-token text (only when the caller asks, see
 * BD_TOK_PARSE_SPECIAL), each remaining span is split into pre-tokens by the regexes that
 * tokenizer.ggml.pre names (PCRE2, UTF-8 with Unicode properties, JIT-compiled where the
 * library can), each pre-token's bytes are mapped to the 256 byte tokens and merged pair by pair, lowest merge rank first (leftmost on
 * ties), as Hugging Face tokenizers and llama.cpp do. Any byte string encodes, invalid UTF-8
 * included (invalid bytes become pre-tokens of their own), and decodes back to the same bytes,
 * except bytes the vocabulary has no token for: those are left out, as Hugging Face's BPE
 * without an unknown token does (SmolLM2 lacks 21 of the 256: 0x04 0x06 0x13 0x14 0x16 0x1d
 * 0xc0 0xc1 0xf1 0xf2 0xf5–0xff, which never occur in UTF-8 text, or only for control
 * characters and unassigned planes), or become the unknown token where a tokenizer.json
 * names one.
 *
 * Decoding: each token maps back to bytes (byte-level tokens through the inverse byte↔unicode
 * map, control and user-defined tokens as their text). The stream decoder emits only complete,
 * valid UTF-8, for sending tokens to a client as they are generated.
 *
 * A tokenizer is immutable once built: every function taking a const tokenizer may be called
 * from several threads at once. It copies what it needs; the GGUF handle may be freed after
 * bd_tokenizer_new_from_gguf() returns.
 *
 * Token ids are int32_t in [0, n_vocab). Lengths are bytes. Errors are negative errno values.
 */
#ifndef BD_TOKENIZER_H
#define BD_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model/bd_chat_template.h"

#ifdef __cplusplus
extern "C" {
#endif

#define BD_TOKENIZER_ERR_MAX 256 /* bytes of an error message buffer, NUL included */

struct bd_gguf;
struct bd_tokenizer;

/* Token types of tokenizer.ggml.token_type (llama.cpp's values). */
enum bd_token_type {
	BD_TOKEN_UNDEFINED = 0,
	BD_TOKEN_NORMAL = 1,
	BD_TOKEN_UNKNOWN = 2,
	BD_TOKEN_CONTROL = 3,      /* <|im_start|>, <|im_end|>, <|endoftext|>, … */
	BD_TOKEN_USER_DEFINED = 4,
	BD_TOKEN_UNUSED = 5,
	BD_TOKEN_BYTE = 6,
};

/* Flags of bd_tokenizer_encode(). */
enum {
	/* Text equal to a control or user-defined token becomes that token (leftmost, longest
	 * match first). Only for text the program wrote (templates); never for user content,
	 * where such text is encoded as ordinary bytes. */
	BD_TOK_PARSE_SPECIAL = 1u << 0,
	/* Prepend BOS / append EOS where the model's metadata asks for it
	 * (tokenizer.ggml.add_bos_token / add_eos_token; both false for SmolLM2). */
	BD_TOK_ADD_SPECIAL = 1u << 1,
};

/* Flags of decoding. */
enum {
	/* Control tokens decode to nothing instead of their text. */
	BD_TOK_SKIP_SPECIAL = 1u << 0,
};

/* Build a tokenizer from GGUF metadata: tokenizer.ggml.model (must be "gpt2"),
 * tokenizer.ggml.pre (pre-tokenizer regexes; absent or "default": the GPT-2 regex),
 * tokenizer.ggml.tokens, tokenizer.ggml.token_type (optional: all NORMAL),
 * tokenizer.ggml.merges, tokenizer.ggml.{bos,eos,padding}_token_id (optional),
 * tokenizer.ggml.add_bos_token / add_eos_token (optional, default false) and
 * tokenizer.chat_template (optional; checked only by the chat functions).
 * ret_err: NULL or BD_TOKENIZER_ERR_MAX bytes; a one-line message on failure, "" on success.
 * Returns 0 and *ret (free with bd_tokenizer_free()), or
 *   -EINVAL   g or ret NULL
 *   -ENOTSUP  another tokenizer model (e.g. "llama" SentencePiece) or an unknown pre-tokenizer
 *   -EBADMSG  a key missing or of the wrong type, an empty vocabulary, a token type array of
 *             another length, a merge that is not "A B" with A, B and AB in the vocabulary, a
 *             special id out of range
 *   -EIO      PCRE2 rejects a pre-tokenizer regex
 *   -ENOMEM
 * On error *ret is not written. */
int bd_tokenizer_new_from_gguf(const struct bd_gguf *g, struct bd_tokenizer **ret, char *ret_err);

/* Build a tokenizer from a Hugging Face tokenizer.json (path) and, optionally (NULL: none), its
 * tokenizer_config.json (bos_token, eos_token, pad_token, add_bos_token, add_eos_token,
 * chat_template). Implemented: model BPE (vocab, merges as "A B" or [A, B], ignore_merges,
 * unk_token, fuse_unk), added_tokens (special → CONTROL, else USER_DEFINED; their lstrip/rstrip
 * flags are not applied), normalizer null or NFC (NFC is not applied, as in llama.cpp: text in
 * NFC, nearly all text, tokenizes the same), pre_tokenizer ByteLevel last, after any Split
 * (Regex, Isolated), Digits steps (at most 4 splitting steps). The regexes run in PCRE2, the
 * files' in Oniguruma; they agree on the patterns of GPT-2, Llama 3, Qwen2 and SmolLM.
 * ret_err as bd_tokenizer_new_from_gguf(). Returns 0 and *ret, or -EINVAL (NULL),
 * -errno of fopen(3) (e.g. -ENOENT), -EBADMSG (not JSON, a field of the wrong type, a merge
 * or special token not in the vocabulary), -ENOTSUP (another model, normalizer or
 * pre-tokenizer), -EIO (PCRE2 rejects a Split regex), -ENOMEM; on error *ret is
 * not written. */
int bd_tokenizer_new_from_json(const char *tokenizer_json, const char *config_json,
			       struct bd_tokenizer **ret, char *ret_err);

/* Release a tokenizer. NULL is a no-op. */
void bd_tokenizer_free(struct bd_tokenizer *tok);

/* ---- vocabulary -------------------------------------------------------------------------- */

/* Number of tokens, n_vocab (-EINVAL for NULL). */
int32_t bd_tokenizer_n_vocab(const struct bd_tokenizer *tok);

/* Special ids from the metadata, or -1 when the file names none. */
int32_t bd_tokenizer_bos(const struct bd_tokenizer *tok);
int32_t bd_tokenizer_eos(const struct bd_tokenizer *tok);
int32_t bd_tokenizer_pad(const struct bd_tokenizer *tok);

/* Whether generation stops at this id: the EOS id, or a control token whose text ends a turn
 * or a document (<|im_end|>, <|endoftext|>, <|eot_id|>, <|end_of_text|>, <|eom_id|>, <|end|>,
 * <end_of_turn>). False for ids out of range. */
bool bd_tokenizer_is_eog(const struct bd_tokenizer *tok, int32_t id);

/* Type of a token, or -ERANGE for an id out of range, -EINVAL for NULL. */
int bd_tokenizer_token_type(const struct bd_tokenizer *tok, int32_t id);

/* The vocabulary string of a token (as stored: byte-level tokens in the mapped alphabet, e.g.
 * "Ġthe"), and the bytes it decodes to. Both stay valid until bd_tokenizer_free(); neither is
 * NUL-terminated. Return 0, -EINVAL (NULL), -ERANGE (id out of range). */
int bd_tokenizer_token_text(const struct bd_tokenizer *tok, int32_t id, const char **ret_s,
			    size_t *ret_len);
int bd_tokenizer_token_bytes(const struct bd_tokenizer *tok, int32_t id, const char **ret_s,
			     size_t *ret_len);

/* The id of the token whose vocabulary string is exactly s[len], or -ENOENT; -EINVAL for NULL. */
int32_t bd_tokenizer_find(const struct bd_tokenizer *tok, const char *s, size_t len);

/* The token of the single byte b, -ENOENT when the vocabulary has none (such bytes are left
 * out when encoding), -EINVAL for NULL. */
int32_t bd_tokenizer_byte_token(const struct bd_tokenizer *tok, uint8_t b);

/* Largest number of bytes any one token decodes to. */
size_t bd_tokenizer_max_token_bytes(const struct bd_tokenizer *tok);

/* ---- encoding ---------------------------------------------------------------------------- */

/* Encode text[len] (any bytes; text may be NULL when len is 0) with BD_TOK_* flags.
 * Returns 0 with *ret_ids a malloc'ed array of *ret_n ids (the caller frees it; for zero ids
 * it is still a valid pointer to free), or -EINVAL (NULL tok/ret_ids/ret_n, text NULL with
 * len > 0, unknown flags), -ENOMEM, -EIO (a PCRE2 match error). On error nothing is written. */
int bd_tokenizer_encode(const struct bd_tokenizer *tok, const char *text, size_t len,
			unsigned flags, int32_t **ret_ids, size_t *ret_n);

/* Same, into the caller's ids[cap]: returns 0 and *ret_n ids, or -ENOBUFS with *ret_n set to
 * the count needed (ids[] contents then unspecified), or the errors above. */
int bd_tokenizer_encode_buf(const struct bd_tokenizer *tok, const char *text, size_t len,
			    unsigned flags, int32_t *ids, size_t cap, size_t *ret_n);

/* ---- decoding ---------------------------------------------------------------------------- */

/* Decode ids[n] to bytes (BD_TOK_SKIP_SPECIAL optional). The result is what the tokens stand
 * for, byte for byte: it may be invalid UTF-8 (a cut multi-byte character) and may hold NUL.
 * Returns 0 with *ret_text malloc'ed (the caller frees it), *ret_len bytes plus a NUL after
 * them; -EINVAL (NULL, unknown flags), -ERANGE (an id outside [0, n_vocab)), -ENOMEM.
 * On error nothing is written. */
int bd_tokenizer_decode(const struct bd_tokenizer *tok, const int32_t *ids, size_t n,
			unsigned flags, char **ret_text, size_t *ret_len);

/* Incremental decoder of one generated stream. Plain data: embed it, copy it, no cleanup. */
struct bd_tok_stream {
	unsigned flags;  /* BD_TOK_SKIP_SPECIAL or 0 */
	uint8_t n_pend;  /* bytes held back: the start of a UTF-8 sequence not yet complete */
	uint8_t pend[3];
};

/* Start a stream (flags as bd_tokenizer_decode()). */
void bd_tokenizer_stream_init(struct bd_tok_stream *s, unsigned flags);

/* Bytes of output buffer that always suffice for one push or flush:
 * 3 · (bd_tokenizer_max_token_bytes() + 3). */
size_t bd_tokenizer_stream_cap(const struct bd_tokenizer *tok);

/* Feed one token. Writes to buf[cap] the complete UTF-8 characters that are now known and holds
 * back the start of an unfinished one. Bytes that can never form a valid sequence (a stray
 * continuation byte, an overlong or surrogate form, a sequence cut by another) come out as
 * U+FFFD, one per maximal invalid subpart, so every chunk is valid UTF-8; for tokens whose
 * bytes together are valid UTF-8, the chunks concatenate to bd_tokenizer_decode()'s output.
 * Returns 0 and *ret_n bytes (not NUL-terminated; may be 0), or -EINVAL (NULL),
 * -ERANGE (id out of range), -ENOBUFS (cap too small); on error the stream is unchanged. */
int bd_tokenizer_stream_push(const struct bd_tokenizer *tok, struct bd_tok_stream *s, int32_t id,
			     char *buf, size_t cap, size_t *ret_n);

/* End of stream: a held-back unfinished sequence comes out as U+FFFD. Returns 0 and *ret_n
 * (0 or 3), -EINVAL, -ENOBUFS (cap < 3 with something held); the stream is then empty. */
int bd_tokenizer_stream_flush(struct bd_tok_stream *s, char *buf, size_t cap, size_t *ret_n);

/* ---- chat template ----------------------------------------------------------------------- */

/* Whether the model's chat template is one bd_chat_template_new() recognizes (the ChatML
 * family; bd_chat_template.h): 0, or -ENOTSUP (no template, or one not recognized; ret_err
 * says which), -EINVAL (NULL). */
int bd_tokenizer_chat_check(const struct bd_tokenizer *tok, char *ret_err);

/* Apply the chat template to msgs[n] (n ≥ 0) and encode the result: the template's markers are
 * special tokens, role and content literal text; text between two markers is encoded as one
 * span, exactly as encoding the rendered template text would (HF apply_chat_template with
 * tokenize=True, on content without special-token text). BOS is not added (the template
 * decides). Returns 0 and *ret_ids (malloc'ed, caller frees) of *ret_n ids, or -EINVAL (NULL,
 * or a message with a NULL field), -ENOTSUP (see bd_tokenizer_chat_check()), -ENOMEM, -EIO.
 * ret_err: NULL or BD_TOKENIZER_ERR_MAX bytes. On error nothing is written. */
int bd_tokenizer_chat_apply(const struct bd_tokenizer *tok, const struct bd_chat_msg *msgs,
			    size_t n, bool add_generation_prompt, int32_t **ret_ids,
			    size_t *ret_n, char *ret_err);

/* The text the template renders for the same arguments (what Jinja would output), for display
 * and logs: *ret_text malloc'ed and NUL-terminated, *ret_len bytes. Same errors. Encoding this
 * text is not the same as bd_tokenizer_chat_apply() when content holds special-token text. */
int bd_tokenizer_chat_render(const struct bd_tokenizer *tok, const struct bd_chat_msg *msgs,
			     size_t n, bool add_generation_prompt, char **ret_text,
			     size_t *ret_len, char *ret_err);

#ifdef __cplusplus
}
#endif
#endif
