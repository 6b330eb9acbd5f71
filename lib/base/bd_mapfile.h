/* bd_mapfile.h — a whole regular file mapped read-only (the weight files: GGUF, safetensors).
 */
#ifndef BD_MAPFILE_H
#define BD_MAPFILE_H

#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

struct bd_mapfile {
	const void *base; /* the file's bytes; never NULL after a successful open */
	size_t size;      /* bytes */
	bool mapped;      /* base is a mapping (false for an empty file: base is a static byte) */
};

/* Maps the regular file at path (open, fstat, mmap PROT_READ/MAP_PRIVATE; the fd is closed
 * again). Returns 0, or -errno of open/fstat/mmap, -EISDIR (a directory), -EINVAL (NULL, not
 * a regular file); err (errlen bytes, may be NULL) then reads "path: reason". *ret is set
 * only on success. */
int bd_mapfile_open(const char *path, struct bd_mapfile *ret, char *err, size_t errlen);

/* Unmaps what bd_mapfile_open mapped and zeroes *m. NULL or a zeroed m is a no-op. */
void bd_mapfile_close(struct bd_mapfile *m);

#ifdef __cplusplus
}
#endif
#endif
