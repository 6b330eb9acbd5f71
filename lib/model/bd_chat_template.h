/* bd_chat_template.h — a model's chat template (the Jinja text of tokenizer.chat_template or
 * tokenizer_config.json), recognized once and then applied to messages without a Jinja engine.
 *
 * Recognized: the ChatML family — <|im_start|>role\ncontent<|im_end|>\n per message, an
 * optional default system message before a first message that is not a system one (SmolLM2's
 * template), and <|im_start|>assistant\n as the generation prompt. The text is matched block by
 * block, not executed: a template is cut into raw text, {{ }} outputs and {% %} statements with
 * transformers' whitespace rules (trim_blocks, lstrip_blocks, the '-' markers), and its
 * statements must be those of the shape bd_chat_template_new() names.
 *
 * Applying a template emits its pieces in order to two callbacks: template text (which may
 * hold special-token text such as "<|im_start|>") and message text (role and content, to be
 * taken literally). The tokenizer (bd_tokenizer.h) encodes through them; rendering joins them.
 */
#ifndef BD_CHAT_TEMPLATE_H
#define BD_CHAT_TEMPLATE_H

#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define BD_CHAT_ERR_MAX 256 /* bytes of an error message buffer, NUL included */

/* One chat message; role and content are NUL-terminated UTF-8 (any text: both are encoded
 * literally, so "<|im_start|>" in them never becomes a special token). */
struct bd_chat_msg {
	const char *role;    /* "system", "user", "assistant", … */
	const char *content;
};

struct bd_chat_template;

/* The text a template's bos_token and eos_token stand for (NULL: the tokenizer has none; a
 * template that uses it is then not recognized). */
struct bd_chat_specials {
	const char *bos;
	size_t bos_len;
	const char *eos;
	size_t eos_len;
};

/* Recognize the template text[len]. The accepted shape:
 *   [if not add_generation_prompt is defined; set add_generation_prompt = false; endif]
 *   literals
 *   for message in messages
 *     [if loop.first and messages[0]['role'] != 'system'; literals; endif]
 *     literals, message['role'], message['content'] in any order
 *   endfor
 *   literals
 *   [if add_generation_prompt; literals; endif]
 *   literals
 * where the literals are raw text and {{ }} outputs of string literals (Python escapes),
 * bos_token and eos_token joined by + or ~; ".name" and "['name']" are the same.
 * Returns 0 and *ret (free with bd_chat_template_free()), -EINVAL (NULL), -ENOTSUP (another
 * shape, an expression or escape not understood, an unterminated tag: ret_err, NULL or
 * BD_CHAT_ERR_MAX bytes, says which), -ENOMEM. */
int bd_chat_template_new(const char *text, size_t len, const struct bd_chat_specials *sp,
			 struct bd_chat_template **ret, char *ret_err);

/* Releases a template. NULL is a no-op. */
void bd_chat_template_free(struct bd_chat_template *c);

/* Where the pieces of an applied template go, in order: tpl gets template text, user a
 * message's role or content (the bytes of the NUL-terminated string). A negative return stops
 * the run and is returned. */
struct bd_chat_emit {
	int (*tpl)(void *ctx, const char *s, size_t n);
	int (*user)(void *ctx, const char *s, size_t n);
	void *ctx;
};

/* Applies c to msgs[n] (n ≥ 0; msgs may be NULL when n is 0), with the generation prompt when
 * add_generation_prompt, emitting the pieces to out. Returns 0, -EINVAL (NULL, a message
 * with a NULL field: nothing is emitted), or the first negative callback return. */
int bd_chat_template_run(const struct bd_chat_template *c, const struct bd_chat_msg *msgs,
			 size_t n, bool add_generation_prompt, const struct bd_chat_emit *out);

#ifdef __cplusplus
}
#endif
#endif
