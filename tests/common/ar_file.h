/* ar_file.h — where the tensor-parallel tests of tests/lib/serve (the all-reduce, TP over the
 * model) put their shared-memory all-reduce file: a fresh directory under /tmp for each test,
 * made by ar_file_setup() and removed with everything in it by ar_file_teardown(), the suite's
 * .init and .fini. Setup failures fail the test (Criterion).
 */
#ifndef TEST_AR_FILE_H
#define TEST_AR_FILE_H

/* "<the test's directory>/ar", not created: bd_allreduce_open() makes it. */
extern char ar_path[96];

void ar_file_setup(void);
void ar_file_teardown(void);

#endif
