/* bd_mapfile.h — a whole regular file mapped read-only (the weight files: GGUF, safetensors),
 * and the opening of a file or memory image that both formats' parsers share.
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

/* A file format's parser as bd_mapfile_parse calls it: builds the format's handle over the
 * image img->base[img->size] (never NULL), taking *img over (the handle's free closes it; a
 * memory image is not mapped, so closing it frees nothing), and stores the handle at *ret.
 * Returns 0, or -errno with a message in err (the errlen bytes of bd_mapfile_parse, may be
 * NULL) and everything freed, *img included. */
typedef int (*bd_mapfile_parse_fn)(struct bd_mapfile *img, void *ret, char *err);

/* Opens an image and parses it: the regular file at path (bd_mapfile_open), or, with path
 * NULL, the caller's memory buf[size] (kept by the caller; buf NULL only with size 0).
 * Returns parse's result, bd_mapfile_open's -errno (its message in err), or -EINVAL (parse
 * or ret NULL, buf NULL with size > 0). A file's parse failure reads "path: message" in err
 * (cut at errlen bytes), so a message always says which file it is about. */
int bd_mapfile_parse(const char *path, const void *buf, size_t size, bd_mapfile_parse_fn parse,
		     void *ret, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif
