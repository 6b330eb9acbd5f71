/* evalio.c — what the evaluation subcommands (eval-kl, eval-passkey) share: the model, its
 * calibration and the texts their prompts are cut from, and the --kv list of configurations. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "quant/bd_calib.h"
#include "quant/bd_kvcfg.h"
#include "quant/bd_kvemul.h"
#include "model/bd_model.h"
#include "model/bd_tokenizer.h"
#include "cli.h"

int cli_read_texts(const char *tool, char *const *paths, int n, char **ret, size_t *ret_len)
{
	char *buf = NULL;
	size_t len = 0;

	for (int i = 0; i < n; i++) {
		FILE *f = fopen(paths[i], "rb");
		if (!f) {
			fprintf(stderr, "bdfp4 %s: cannot read %s: %s\n", tool, paths[i],
				strerror(errno));
			free(buf);
			return -1;
		}
		char chunk[65536];
		size_t got;
		if (i > 0) {
			char *t = realloc(buf, len + 2);
			if (!t) {
				fclose(f);
				goto oom;
			}
			buf = t;
			memcpy(buf + len, "\n\n", 2);
			len += 2;
		}
		while ((got = fread(chunk, 1, sizeof(chunk), f)) > 0) {
			char *t = realloc(buf, len + got + 1);
			if (!t) {
				fclose(f);
				goto oom;
			}
			buf = t;
			memcpy(buf + len, chunk, got);
			len += got;
		}
		bool bad = ferror(f);
		fclose(f);
		if (bad) {
			fprintf(stderr, "bdfp4 %s: error reading %s\n", tool, paths[i]);
			free(buf);
			return -1;
		}
	}
	*ret = buf;
	*ret_len = len;
	return 0;
oom:
	fprintf(stderr, "bdfp4 %s: out of memory\n", tool);
	free(buf);
	return -1;
}

int cli_parse_kv_list(const char *tool, const char *list, const struct bd_kvcfg **cfg, int *ret_n)
{
	char *copy = strdup(list), *save = NULL;
	int n = 0;
	if (!copy)
		return -1;
	for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
		const struct bd_kvcfg *c = bd_kvcfg_find(tok);
		if (!c)
			c = bd_kvemul_find(tok); /* the eval-only emulated K/V formats */
		if (!c) {
			fprintf(stderr, "bdfp4 %s: unknown KV configuration '%s'\n", tool, tok);
			free(copy);
			return -1;
		}
		for (int i = 0; i < n; i++)
			if (cfg[i] == c)
				c = NULL;
		if (c && n < BD_KVCFG_COUNT)
			cfg[n++] = c;
	}
	free(copy);
	if (n == 0)
		return -1;
	*ret_n = n;
	return 0;
}

int cli_eval_load(const char *tool, const char *model_opt, const char *calib, bool no_calib,
		  int ctx, char *const *paths, int n, struct cli_eval_input *in)
{
	char *text = NULL;
	size_t len = 0;
	int r;

	memset(in, 0, sizeof(*in));
	cli_model_path(model_opt, in->model_path, sizeof(in->model_path));
	if (cli_load_model(tool, in->model_path, &in->m, &in->tok) < 0)
		goto fail;
	if (ctx > in->m->hp.n_ctx_train) {
		fprintf(stderr, "bdfp4 %s: --ctx %d exceeds the model's context of %d\n", tool, ctx,
			in->m->hp.n_ctx_train);
		goto fail;
	}
	if (!no_calib &&
	    cli_calib_setup(tool, calib, in->model_path, &in->m->hp, ctx, ctx, true, &in->cal) < 0)
		goto fail;
	if (cli_read_texts(tool, paths, n, &text, &len) < 0)
		goto fail;
	if ((r = bd_tokenizer_encode(in->tok, text, len, 0, &in->stream, &in->n_stream)) < 0) {
		fprintf(stderr, "bdfp4 %s: cannot tokenize the texts: %s\n", tool, strerror(-r));
		goto fail;
	}
	free(text);
	return 0;
fail:
	free(text);
	cli_eval_input_free(in);
	return -1;
}

void cli_eval_input_free(struct cli_eval_input *in)
{
	free(in->stream);
	bd_calib_free(in->cal);
	bd_model_free(in->m);
	bd_tokenizer_free(in->tok);
	in->stream = NULL;
	in->cal = NULL;
	in->m = NULL;
	in->tok = NULL;
	in->n_stream = 0;
}

bool cli_eval_opt(int c, const char *arg, struct cli_eval_common *e)
{
	switch (c) {
	case CLI_O_MODEL:
		e->model = arg;
		return true;
	case CLI_O_CALIB:
		e->calib = arg;
		return true;
	case CLI_O_NOCALIB:
		e->no_calib = true;
		return true;
	case CLI_O_LOG:
		e->log = arg;
		return true;
	case CLI_O_JSON:
		e->json = true;
		return true;
	case CLI_O_SUMMARIZE:
		e->summary = arg;
		return true;
	default:
		return false;
	}
}
