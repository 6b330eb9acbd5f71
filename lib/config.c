/* config.c — INI configuration through libinih, with typed, range-checked getters (bd_config.h).
 */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <ini.h>

#include "bd_config.h"

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

int bd_config_get_bool(const struct bd_config *c, const char *section, const char *key, bool def,
		       bool *ret)
{
	static const char *const yes[] = { "1", "true", "yes", "on" };
	static const char *const no[] = { "0", "false", "no", "off" };
	const char *s = bd_config_get(c, section, key);

	if (!ret)
		return -EINVAL;
	if (!s) {
		*ret = def;
		return 0;
	}
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
