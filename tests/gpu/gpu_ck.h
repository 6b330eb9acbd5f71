/* gpu_ck.h — fatal-error checks shared by the GPU check and benchmark programs (gpu_check,
 * decode_select_check, ops_check, bench_kernels): a failed CUDA call, a negative return or a
 * failed allocation ends the program with exit status 2 ("cannot run") and where it happened, so
 * that 1 keeps meaning "a check failed"; and the pass/fail counter check() of the checks. */
#ifndef BD_GPU_CK_H
#define BD_GPU_CK_H

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include "cuda/bd_cuda_err.h"

#define CK(call)                                                                           \
	BD_CUDA_TRY(call, fprintf(stderr, "FATAL %s:%d: %s: %s\n", __FILE__, __LINE__, #call,  \
				  cudaGetErrorString(bd_cuda_e));                          \
		    exit(2))

#define CKR(call)                                                                        \
	do {                                                                             \
		int r_ = (call);                                                         \
		if (r_ < 0) {                                                            \
			fprintf(stderr, "FATAL %s:%d: %s returned %d\n", __FILE__, __LINE__, \
				#call, r_);                                              \
			exit(2);                                                         \
		}                                                                        \
	} while (0)

/* free() of every host pointer, cudaFree() of every device pointer of the list (NULL entries
 * too): the cleanup of a check or a benchmark case; a failed cudaFree ends the program (CK). */
#define FREE_HOST(...)                                                                 \
	do {                                                                           \
		const void *fh_[] = { __VA_ARGS__ };                                   \
		for (size_t i_ = 0; i_ < sizeof(fh_) / sizeof(fh_[0]); i_++)           \
			free((void *)fh_[i_]);                                         \
	} while (0)
#define FREE_DEV(...)                                                                  \
	do {                                                                           \
		const void *fd_[] = { __VA_ARGS__ };                                   \
		for (size_t i_ = 0; i_ < sizeof(fd_) / sizeof(fd_[0]); i_++)           \
			CK(cudaFree((void *)fd_[i_]));                                 \
	} while (0)

/* n zeroed bytes (at least one) from calloc, never NULL: out of memory ends the program. */
static inline void *xmalloc(size_t n)
{
	void *p = calloc(1, n ? n : 1);

	if (!p) {
		fprintf(stderr, "FATAL: out of memory (%zu bytes)\n", n);
		exit(2);
	}
	return p;
}

/* The passed and failed checks of a check program (check()), and where a failure is printed
 * (NULL: stdout). */
static int n_fail __attribute__((unused)), n_pass __attribute__((unused));
static FILE *check_out __attribute__((unused));

/* Counts one check; a failed one is printed "FAIL: <fmt...>" on a line of check_out. */
static inline void check(bool ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static inline void check(bool ok, const char *fmt, ...)
{
	FILE *f = check_out ? check_out : stdout;
	va_list ap;

	if (ok) {
		n_pass++;
		return;
	}
	n_fail++;
	fprintf(f, "FAIL: ");
	va_start(ap, fmt);
	vfprintf(f, fmt, ap);
	va_end(ap);
	fputc('\n', f);
}

#endif
