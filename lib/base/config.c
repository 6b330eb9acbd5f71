/* config.c — INI configuration through libinih, with typed, range-checked getters (bd_config.h).
 */
#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <ini.h>

#include "base/bd_config.h"

struct bd_config_entry {
	char *section, *key, *value;
};

struct bd_config {
	struct bd_config_entry *e;
	size_t n, cap;
	int err; /* first error of a load, carried out of the inih callback */
};

struct bd_config *bd_config_new(void)
{
	return calloc(1, sizeof(struct bd_config));
}

void bd_config_free(struct bd_config *c)
{
	if (!c)
		return;
	for (size_t i = 0; i < c->n; i++) {
		free(c->e[i].section);
		free(c->e[i].key);
		free(c->e[i].value);
	}
	free(c->e);
	free(c);
}

static struct bd_config_entry *find(const struct bd_config *c, const char *section,
				    const char *key)
{
	for (size_t i = 0; i < c->n; i++)
		if (!strcmp(c->e[i].section, section) && !strcmp(c->e[i].key, key))
			return &c->e[i];
	return NULL;
}

int bd_config_set(struct bd_config *c, const char *section, const char *key, const char *value)
{
	struct bd_config_entry *e;
	char *v;

	if (!c || !section || !key || !value || !*section || !*key)
		return -EINVAL;
	v = strdup(value);
	if (!v)
		return -ENOMEM;
	e = find(c, section, key);
	if (e) {
		free(e->value);
		e->value = v;
		return 0;
	}
	if (c->n == c->cap) {
		size_t cap = c->cap ? 2 * c->cap : 16;
		struct bd_config_entry *ne = realloc(c->e, cap * sizeof(*ne));

		if (!ne) {
			free(v);
			return -ENOMEM;
		}
		c->e = ne;
		c->cap = cap;
	}
	e = &c->e[c->n];
	e->section = strdup(section);
	e->key = strdup(key);
	if (!e->section || !e->key) {
		free(e->section);
		free(e->key);
		free(v);
		return -ENOMEM;
	}
	e->value = v;
	c->n++;
	return 0;
}

static int on_key(void *user, const char *section, const char *name, const char *value)
{
	struct bd_config *c = user;
	int r;

	/* inih hands keys before any [section] with section "": refuse them */
	if (!*section) {
		if (!c->err)
			c->err = -EINVAL;
		return 0;
	}
	r = bd_config_set(c, section, name, value ? value : "");
	if (r < 0) {
		if (!c->err)
			c->err = r;
		return 0;
	}
	return 1;
}

static int finish_load(struct bd_config *c, int r, int *ret_line)
{
	int err = c->err;

	c->err = 0;
	if (r == -1)
		return -errno ? -errno : -EIO;
	if (r == -2)
		return -ENOMEM;
	if (r > 0) {
		if (ret_line)
			*ret_line = r;
		return err == -ENOMEM ? -ENOMEM : -EINVAL;
	}
	return 0;
}

int bd_config_load(struct bd_config *c, const char *path, int *ret_line)
{
	FILE *f;
	int r;

	if (!c || !path)
		return -EINVAL;
	f = fopen(path, "re");
	if (!f)
		return -errno;
	c->err = 0;
	r = ini_parse_file(f, on_key, c);
	fclose(f);
	return finish_load(c, r, ret_line);
}

int bd_config_load_string(struct bd_config *c, const char *text, int *ret_line)
{
	if (!c || !text)
		return -EINVAL;
	c->err = 0;
	return finish_load(c, ini_parse_string(text, on_key, c), ret_line);
}

const char *bd_config_get(const struct bd_config *c, const char *section, const char *key)
{
	const struct bd_config_entry *e;

	if (!c || !section || !key)
		return NULL;
	e = find(c, section, key);
	return e ? e->value : NULL;
}

const char *bd_config_unknown_key(const struct bd_config *c, const char *section,
				  const char *const *known)
{
	if (!c || !section || !known)
		return NULL;
	for (size_t i = 0; i < c->n; i++) {
		size_t k;

		if (strcmp(c->e[i].section, section))
			continue;
		for (k = 0; known[k]; k++)
			if (!strcmp(known[k], c->e[i].key))
				break;
		if (!known[k])
			return c->e[i].key;
	}
	return NULL;
}

int bd_config_get_i64(const struct bd_config *c, const char *section, const char *key,
		      int64_t def, int64_t min, int64_t max, int64_t *ret)
{
	const char *s = bd_config_get(c, section, key);
	char *end;
	long long v;

	if (!ret)
		return -EINVAL;
	if (!s) {
		*ret = def;
		return 0;
	}
	errno = 0;
	v = strtoll(s, &end, 0);
	if (end == s || *end || isspace((unsigned char)*s))
		return -EINVAL;
	if (errno == ERANGE || v < min || v > max)
		return -ERANGE;
	*ret = v;
	return 0;
}

int bd_config_parse_bytes(const char *s, uint64_t *ret)
{
	unsigned long long v;
	unsigned shift = 0;
	char *end;

	if (!s || !ret || !isdigit((unsigned char)*s))
		return -EINVAL; /* also refuses "-1", which strtoull would wrap */
	errno = 0;
	v = strtoull(s, &end, 10);
	if (errno == ERANGE)
		return -ERANGE;
	switch (toupper((unsigned char)*end)) {
	case 'K': shift = 10; break;
	case 'M': shift = 20; break;
	case 'G': shift = 30; break;
	case 'T': shift = 40; break;
	default: break;
	}
	if (shift) {
		end++;
		if (!strcasecmp(end, "iB") || !strcasecmp(end, "B"))
			end += strlen(end);
	} else if (!strcasecmp(end, "B")) {
		end++;
	}
	if (*end)
		return -EINVAL;
	if (shift && v > (UINT64_MAX >> shift))
		return -ERANGE;
	*ret = (uint64_t)v << shift;
	return 0;
}

int bd_config_get_bytes(const struct bd_config *c, const char *section, const char *key,
			uint64_t def, uint64_t min, uint64_t max, uint64_t *ret)
{
	const char *s = bd_config_get(c, section, key);
	uint64_t v;
	int r;

	if (!ret)
		return -EINVAL;
	if (!s) {
		*ret = def;
		return 0;
	}
	r = bd_config_parse_bytes(s, &v);
	if (r < 0)
		return r;
	if (v < min || v > max)
		return -ERANGE;
	*ret = v;
	return 0;
}

int bd_config_get_double(const struct bd_config *c, const char *section, const char *key,
			 double def, double min, double max, double *ret)
{
	const char *s = bd_config_get(c, section, key);
	char *end;
	double v;

	if (!ret)
		return -EINVAL;
	if (!s) {
		*ret = def;
		return 0;
	}
	errno = 0;
	v = strtod(s, &end);
	if (end == s || *end || isspace((unsigned char)*s) || !isfinite(v))
		return -EINVAL;
	if (v < min || v > max)
		return -ERANGE;
	*ret = v;
	return 0;
}

int bd_config_parse_bool(const char *s, bool *ret)
{
	static const char *const yes[] = { "1", "true", "yes", "on" };
	static const char *const no[] = { "0", "false", "no", "off" };

	if (!s || !ret)
		return -EINVAL;
	for (size_t i = 0; i < 4; i++) {
		if (!strcasecmp(s, yes[i])) {
			*ret = true;
			return 0;
		}
		if (!strcasecmp(s, no[i])) {
			*ret = false;
			return 0;
		}
	}
	return -EINVAL;
}

int bd_config_get_bool(const struct bd_config *c, const char *section, const char *key, bool def,
		       bool *ret)
{
	const char *s = bd_config_get(c, section, key);

	if (!ret)
		return -EINVAL;
	if (!s) {
		*ret = def;
		return 0;
	}
	return bd_config_parse_bool(s, ret);
}

/* ---- a daemon's command line ----------------------------------------------------------------- */

static void say(char *err, size_t errlen, const char *fmt, const char *a, int b)
{
	if (err && errlen)
		snprintf(err, errlen, fmt, a, b);
}

int bd_config_parse_args(struct bd_config *c, const char *section,
			 const struct bd_config_key *keys, const char *default_path, int argc,
			 char **argv, char *err, size_t errlen)
{
	struct option lo[BD_CONFIG_MAX_KEYS + 4];
	char names[BD_CONFIG_MAX_KEYS][40];
	const char *config = default_path;
	bool explicit_config = false, no_config = false;
	size_t n = 0, nf = 0;
	int opt, e = 0, line = 0;

	if (err && errlen)
		err[0] = '\0';
	if (!c || !section || !keys || argc < 1 || !argv)
		return -EINVAL;
	for (const struct bd_config_key *k = keys; k->name; k++, n++) {
		if (n == BD_CONFIG_MAX_KEYS || strlen(k->name) >= sizeof(names[0]))
			return -EINVAL;
		snprintf(names[n], sizeof(names[n]), "%s", k->name);
		for (char *p = names[n]; *p; p++)
			if (*p == '_')
				*p = '-';
		lo[n] = (struct option){ names[n], k->flag ? optional_argument : required_argument,
					 NULL, 256 + (int)n };
	}
	lo[n++] = (struct option){ "config", required_argument, NULL, 'c' };
	lo[n++] = (struct option){ "no-config", no_argument, NULL, 'n' };
	lo[n++] = (struct option){ "help", no_argument, NULL, 'h' };
	lo[n] = (struct option){ 0 };

	const char **fkey = calloc((size_t)argc + 1, sizeof(char *));
	const char **fval = calloc((size_t)argc + 1, sizeof(char *));
	if (!fkey || !fval) {
		free(fkey);
		free(fval);
		return -ENOMEM;
	}
	optind = 0; /* a full rescan, also when called twice in one process (tests) */
	opterr = 0;
	while ((opt = getopt_long(argc, argv, ":c:h", lo, NULL)) != -1) {
		if (opt >= 256) {
			fkey[nf] = keys[opt - 256].name;
			fval[nf++] = optarg ? optarg : "1";
		} else if (opt == 'c') {
			config = optarg;
			explicit_config = true;
		} else if (opt == 'n') {
			no_config = true;
		} else if (opt == 'h') {
			e = 1;
			goto out;
		} else {
			const char *what = argv[optind - 1 < argc ? optind - 1 : argc - 1];
			say(err, errlen,
			    opt == ':' ? "flag %s needs a value" : "unknown flag '%s' (--help lists them)",
			    what, 0);
			e = -EINVAL;
			goto out;
		}
	}
	if (optind < argc) {
		say(err, errlen, "unexpected argument '%s'", argv[optind], 0);
		e = -EINVAL;
		goto out;
	}
	if (!no_config && config) {
		e = bd_config_load(c, config, &line);
		if (e == -ENOENT && !explicit_config) {
			e = 0; /* no file: defaults and flags */
		} else if (e == -EINVAL) {
			say(err, errlen, "%s:%d: syntax error", config, line);
			e = -EBADMSG;
			goto out;
		} else if (e < 0) {
			if (err && errlen)
				snprintf(err, errlen, "%s: %s", config, strerror(-e));
			goto out;
		}
	}
	for (size_t i = 0; i < nf && !e; i++)
		e = bd_config_set(c, section, fkey[i], fval[i]);
out:
	free(fkey);
	free(fval);
	return e;
}

void bd_config_usage(FILE *f, const char *prog, const char *about, const char *section,
		     const struct bd_config_key *keys)
{
	fprintf(f, "usage: %s [--config PATH | --no-config] [--KEY=VALUE ...]\n", prog);
	if (about)
		fprintf(f, "%s\n", about);
	fprintf(f, "Keys of [%s], each also a flag (the key's _ spelled -):\n", section);
	for (const struct bd_config_key *k = keys; k->name; k++) {
		char flag[64];
		snprintf(flag, sizeof(flag), "%s", k->name);
		for (char *p = flag; *p; p++)
			if (*p == '_')
				*p = '-';
		fprintf(f, "  --%-22s %s (default %s)\n", flag, k->help, *k->def ? k->def : "\"\"");
	}
}

const char *bd_config_str(const struct bd_config *c, const char *section,
			  const struct bd_config_key *keys, const char *name)
{
	const char *v = bd_config_get(c, section, name);

	if (v)
		return v;
	for (const struct bd_config_key *k = keys; k && k->name; k++)
		if (!strcmp(k->name, name))
			return k->def;
	return "";
}

const char *bd_config_unknown(const struct bd_config *c, const char *section,
			      const struct bd_config_key *keys)
{
	const char *known[BD_CONFIG_MAX_KEYS + 1];
	size_t n = 0;

	for (const struct bd_config_key *k = keys; k->name && n < BD_CONFIG_MAX_KEYS; k++)
		known[n++] = k->name;
	known[n] = NULL;
	return bd_config_unknown_key(c, section, known);
}
