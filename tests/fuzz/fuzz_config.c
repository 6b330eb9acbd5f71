/* fuzz_config.c — libFuzzer target for the configuration parser (base/bd_config.h): the INI
 * text through libinih into the key list, a daemon's command line over it with a key table,
 * and every typed getter on every key.
 *
 * Build and run: `make fuzz-config`. One input is INI text, then (after the first NUL byte)
 * command-line words separated by NUL bytes. Checks: a load either succeeds or names a line
 * inside the text; a refused command line says why; after a successful parse every key of the
 * table reads back as the flag set it or the file gave it, and the getters never accept a value
 * outside their range.
 */
#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/bd_config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* A key table of the shape the daemons use: sizes, counts, flags, reals, paths. */
static const struct bd_config_key keys[] = {
	{ "socket", "/run/bdfp4/kvpool.sock", "attach socket" },
	{ "memory_bytes", "512M", "budget" },
	{ "tp", "2", "ranks" },
	{ "gpu_memory_fraction", "0", "fraction" },
	{ "insecure_tcp", "false", "plain TCP off loopback", true },
	{ "synthetic_prefill", "0", "benchmarks", true },
	{ "frontend", "tcp://127.0.0.1:5555", "endpoints" },
	{ NULL },
};

#define MAX_WORDS 24

static void getters(const struct bd_config *c, const char *sec, const char *key)
{
	int64_t i = 7;
	uint64_t u = 7;
	double d = 0.5;
	bool b = false;

	if (bd_config_get_i64(c, sec, key, 1, -4, 1000, &i) == 0 && (i < -4 || i > 1000))
		abort();
	if (bd_config_get_bytes(c, sec, key, 1, 2, 1ull << 40, &u) == 0 && (u < 2 || u > 1ull << 40) &&
	    bd_config_get(c, sec, key))
		abort();
	if (bd_config_get_double(c, sec, key, 0.5, 0, 1, &d) == 0 && !(d >= 0 && d <= 1))
		abort();
	bd_config_get_bool(c, sec, key, false, &b);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	const char *sections[] = { "pool", "router", "worker", "" };
	char *buf = malloc(size + 1), *argv[MAX_WORDS + 2], err[256];
	struct bd_config *c = bd_config_new();
	size_t text_len = 0;
	int argc = 1, line = 0, e;

	if (!buf || !c)
		abort();
	memcpy(buf, data, size);
	buf[size] = 0;
	text_len = strlen(buf);
	argv[0] = (char *)"fuzz";
	/* the words after the text: NUL-separated */
	for (size_t p = text_len + 1; p < size && argc < MAX_WORDS + 1; p += strlen(buf + p) + 1)
		argv[argc++] = buf + p;
	argv[argc] = NULL;

	e = bd_config_load_string(c, buf, &line);
	if (e < 0 && e != -EINVAL && e != -ENOMEM)
		abort();
	if (e == -EINVAL && line <= 0)
		abort(); /* a syntax error names its line */
	for (int s = 0; s < 4; s++) {
		bd_config_unknown(c, sections[s], keys);
		for (const struct bd_config_key *k = keys; k->name; k++) {
			const char *v = bd_config_get(c, sections[s], k->name);

			if (v && strlen(v) > size)
				abort(); /* a value is a piece of the text */
			getters(c, sections[s], k->name);
		}
	}
	bd_config_free(c);

	/* the daemon's command line: over an empty configuration (the file is not read) */
	c = bd_config_new();
	if (!c)
		abort();
	{
		char *av[MAX_WORDS + 3];
		int ac = 0;

		av[ac++] = argv[0];
		av[ac++] = (char *)"--no-config";
		for (int i = 1; i < argc; i++)
			av[ac++] = argv[i];
		av[ac] = NULL;
		err[0] = 0;
		e = bd_config_parse_args(c, "router", keys, "/nonexistent/bdfp4.conf", ac, av, err,
					 sizeof(err));
		if (e < 0 && (!memchr(err, 0, sizeof(err)) || !err[0]))
			abort(); /* a refusal says why */
		if (e == 0) {
			if (bd_config_unknown(c, "router", keys))
				abort(); /* flags set only keys of the table */
			for (const struct bd_config_key *k = keys; k->name; k++) {
				const char *v = bd_config_str(c, "router", keys, k->name);

				if (!v)
					abort();
				getters(c, "router", k->name);
			}
		}
	}
	bd_config_free(c);
	free(buf);
	return 0;
}
