/* err.c — one-line error messages (bd_err.h). */
#include <stdarg.h>
#include <stdio.h>

#include "base/bd_err.h"

int bd_errf(char *buf, size_t cap, int code, const char *fmt, ...)
{
	if (buf && cap) {
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(buf, cap, fmt, ap);
		va_end(ap);
	}
	return code;
}
