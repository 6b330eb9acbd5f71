/* tmpdir.c — a test's private directory, its removal, reading a file back (tmpdir.h). */
#include <errno.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "tmpdir.h"

int td_make(char *dir, size_t cap, const char *prefix)
{
	int n = snprintf(dir, cap, "/tmp/%s-XXXXXX", prefix);

	if (n < 0 || (size_t)n >= cap)
		return -ENAMETOOLONG;
	return mkdtemp(dir) ? 0 : -errno;
}

static int remove_one(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
	(void)st;
	(void)flag;
	(void)ftw;
	return remove(path) < 0 ? errno : 0; /* non-zero stops the walk */
}

int td_remove(const char *dir)
{
	int e;

	if (!dir || !*dir)
		return 0;
	/* depth first, so each directory is empty when its turn comes */
	e = nftw(dir, remove_one, 16, FTW_DEPTH | FTW_PHYS);
	if (e < 0)
		return errno == ENOENT ? 0 : -errno;
	return -e;
}

char *td_read_file(const char *path, size_t *ret_len)
{
	FILE *f = fopen(path, "rb");
	char *buf;
	long n;

	if (!f)
		return NULL;
	if (fseek(f, 0, SEEK_END) != 0 || (n = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0) {
		fclose(f);
		return NULL;
	}
	buf = malloc((size_t)n + 1);
	if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
		free(buf);
		buf = NULL;
	}
	fclose(f);
	if (buf) {
		buf[n] = 0;
		if (ret_len)
			*ret_len = (size_t)n;
	}
	return buf;
}
