/* bd_err.h — the one-line messages of the library's error buffers.
 *
 * Library functions return -errno and, where they take a ret_err buffer (NULL, or the size its
 * header names, e.g. BD_MODEL_ERR_MAX), say why there in one line. One helper writes them.
 */
#ifndef BD_ERR_H
#define BD_ERR_H

#include <stddef.h>

/* Formats one line into buf (cap bytes; nothing when buf is NULL or cap is 0) and returns
 * code, so that `return bd_errf(err, cap, -EINVAL, "...", ...);` fails and explains at once. */
int bd_errf(char *buf, size_t cap, int code, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));

#endif
