/* mapfile.c — a whole file mapped read-only, and a file or memory image parsed (bd_mapfile.h). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/bd_err.h"
#include "base/bd_mapfile.h"

int bd_mapfile_open(const char *path, struct bd_mapfile *ret, char *err, size_t errlen)
{
	static const unsigned char empty[1];
	struct stat st;
	void *base;
	int fd, e;

	if (!path || !ret)
		return bd_errf(err, errlen, -EINVAL, "invalid argument");
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) {
		e = errno;
		return bd_errf(err, errlen, -e, "%s: %s", path, strerror(e));
	}
	if (fstat(fd, &st) < 0) {
		e = errno;
		close(fd);
		return bd_errf(err, errlen, -e, "%s: %s", path, strerror(e));
	}
	if (!S_ISREG(st.st_mode)) {
		close(fd);
		return bd_errf(err, errlen, S_ISDIR(st.st_mode) ? -EISDIR : -EINVAL,
			       "%s: not a regular file", path);
	}
	if (st.st_size == 0) {
		close(fd);
		*ret = (struct bd_mapfile){ .base = empty, .size = 0, .mapped = false };
		return 0;
	}
	base = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
	e = errno;
	close(fd);
	if (base == MAP_FAILED)
		return bd_errf(err, errlen, -e, "%s: mmap: %s", path, strerror(e));
	*ret = (struct bd_mapfile){ .base = base, .size = (size_t)st.st_size, .mapped = true };
	return 0;
}

void bd_mapfile_close(struct bd_mapfile *m)
{
	if (!m)
		return;
	if (m->mapped)
		munmap((void *)m->base, m->size);
	*m = (struct bd_mapfile){ 0 };
}

int bd_mapfile_parse(const char *path, const void *buf, size_t size, bd_mapfile_parse_fn parse,
		     void *ret, char *err, size_t errlen)
{
	static const unsigned char empty[1];
	struct bd_mapfile img;
	int r;

	if (err && errlen)
		err[0] = 0;
	if (!parse || !ret || (!path && !buf && size))
		return bd_errf(err, errlen, -EINVAL, "invalid argument");
	if (!path) {
		img = (struct bd_mapfile){ .base = buf ? buf : empty, .size = size };
		return parse(&img, ret, err);
	}
	if ((r = bd_mapfile_open(path, &img, err, errlen)) < 0)
		return r;
	if ((r = parse(&img, ret, err)) < 0 && err && errlen) {
		char msg[512];

		snprintf(msg, sizeof(msg), "%s", err);
		bd_errf(err, errlen, r, "%s: %s", path, msg);
	}
	return r;
}
