/* version.c — the build's version (bd_version.h). */
#include "base/bd_version.h"

#ifndef BD_GIT_VERSION
#define BD_GIT_VERSION "unknown"
#endif

const char *bd_version(void)
{
	return BD_GIT_VERSION;
}
