/* bd_version.h — which build a program is: the `git describe --always --dirty` of the tree it
 * was built from (the Makefile passes it in BD_GIT_VERSION), for every program's --version.
 */
#ifndef BD_VERSION_H
#define BD_VERSION_H

#ifdef __cplusplus
extern "C" {
#endif

/* The build's version string (static; "unknown" when built outside a git tree). */
const char *bd_version(void);

#ifdef __cplusplus
}
#endif
#endif
