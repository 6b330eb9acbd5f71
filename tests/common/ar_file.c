/* ar_file.c — the all-reduce file's directory of the TP tests (ar_file.h). */
#include <stdio.h>

#include <criterion/criterion.h>

#include "ar_file.h"
#include "tmpdir.h"

char ar_path[96];
static char dir[64];

void ar_file_setup(void)
{
	cr_assert_eq(td_make(dir, sizeof(dir), "bdfp4-ar"), 0);
	cr_assert_lt((size_t)snprintf(ar_path, sizeof(ar_path), "%s/ar", dir), sizeof(ar_path));
}

void ar_file_teardown(void)
{
	td_remove(dir);
}
