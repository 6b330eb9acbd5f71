/* names.c — an index by name over an array of named records (bd_names.h). */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/bd_names.h"

static const char *name_of(const void *rec, size_t off)
{
	const char *p;

	memcpy(&p, (const char *)rec + off, sizeof(p));
	return p;
}

static int by_name(const void *a, const void *b, void *off)
{
	size_t o = *(const size_t *)off;

	return strcmp(name_of(*(const void *const *)a, o), name_of(*(const void *const *)b, o));
}

int bd_names_build(struct bd_names *ix, const void *items, size_t n, size_t stride,
		   size_t name_off, const char **ret_dup)
{
	if (!ix || (!items && n))
		return -EINVAL;
	*ix = (struct bd_names){ .name_off = name_off };
	if (n > SIZE_MAX / sizeof(*ix->sorted))
		return -ENOMEM;
	const void **s = malloc((n ? n : 1) * sizeof(*s));
	if (!s)
		return -ENOMEM;
	for (size_t i = 0; i < n; i++)
		s[i] = (const char *)items + i * stride;
	qsort_r(s, n, sizeof(*s), by_name, &name_off);
	for (size_t i = 1; i < n; i++)
		if (strcmp(name_of(s[i - 1], name_off), name_of(s[i], name_off)) == 0) {
			if (ret_dup)
				*ret_dup = name_of(s[i], name_off);
			free(s);
			return -EEXIST;
		}
	ix->sorted = s;
	ix->n = n;
	return 0;
}

const void *bd_names_find(const struct bd_names *ix, const char *name)
{
	if (!ix || !name)
		return NULL;
	size_t lo = 0, hi = ix->n; /* the name, if there, is in sorted[lo, hi) */
	while (lo < hi) {
		size_t mid = lo + (hi - lo) / 2;
		int c = strcmp(name, name_of(ix->sorted[mid], ix->name_off));
		if (c == 0)
			return ix->sorted[mid];
		if (c < 0)
			hi = mid;
		else
			lo = mid + 1;
	}
	return NULL;
}

void bd_names_free(struct bd_names *ix)
{
	if (!ix)
		return;
	free(ix->sorted);
	*ix = (struct bd_names){ 0 };
}
