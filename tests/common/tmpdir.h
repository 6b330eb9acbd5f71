/* tmpdir.h — a test's private directory under /tmp, its removal, and reading back a file
 * written there.
 *
 * /tmp rather than $TMPDIR: the Unix socket paths made inside must stay shorter than
 * sun_path. Plain C (no Criterion), for the unit suite and the GPU checks alike.
 */
#ifndef TEST_TMPDIR_H
#define TEST_TMPDIR_H

#include <stddef.h>

/* Makes a fresh directory /tmp/<prefix>-XXXXXX (mode 0700) and writes its path into dir (cap
 * bytes). Returns 0, -ENAMETOOLONG when the path does not fit, or the -errno of mkdtemp. */
int td_make(char *dir, size_t cap, const char *prefix);

/* Removes dir and everything below it, without following links. An empty dir string or a
 * directory already gone is not an error. Returns 0 or the first -errno met. */
int td_remove(const char *dir);

/* The whole file at path, malloc'ed with a NUL after its *ret_len bytes (ret_len may be NULL);
 * the caller frees it. NULL when it cannot be opened or read, or memory runs out. */
char *td_read_file(const char *path, size_t *ret_len);

#endif
