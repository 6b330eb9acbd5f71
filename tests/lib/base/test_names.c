/* test_names.c — the index by name over named records (lib/base/bd_names.h). Suite "names". */
#include <criterion/criterion.h>
#include <errno.h>
#include <stddef.h>

#include "base/bd_names.h"

struct rec {
	int id;
	const char *name; /* not the first field: the index finds it by offset */
};

TestSuite(names);

/* Every record is found by its name, whatever the array's order; a name that sorts before,
 * between or after them is not; strcmp order, so "b" < "ba" < "bb". */
Test(names, finds_each_record_and_only_those)
{
	const struct rec r[5] = { { 0, "bb" }, { 1, "a" }, { 2, "ba" }, { 3, "c" }, { 4, "b" } };
	struct bd_names ix;

	cr_assert_eq(bd_names_build(&ix, r, 5, sizeof(r[0]), offsetof(struct rec, name), NULL), 0);
	for (int i = 0; i < 5; i++)
		cr_expect_eq(bd_names_find(&ix, r[i].name), &r[i], "%s", r[i].name);
	const char *absent[] = { "", "0", "aa", "b0", "bc", "d" };
	for (size_t i = 0; i < sizeof(absent) / sizeof(absent[0]); i++)
		cr_expect_null(bd_names_find(&ix, absent[i]), "'%s'", absent[i]);
	cr_expect_null(bd_names_find(&ix, NULL));
	cr_expect_null(bd_names_find(NULL, "a"));
	bd_names_free(&ix);
	cr_expect_null(ix.sorted);
	bd_names_free(&ix);
}

/* Two records of one name fail the build with -EEXIST naming it, and leave nothing to free;
 * an empty index finds nothing; a NULL array of records is refused. */
Test(names, duplicates_empty_and_bad_arguments)
{
	const struct rec r[4] = { { 0, "x" }, { 1, "dup" }, { 2, "y" }, { 3, "dup" } };
	struct bd_names ix;
	const char *dup = NULL;

	cr_assert_eq(bd_names_build(&ix, r, 4, sizeof(r[0]), offsetof(struct rec, name), &dup),
		     -EEXIST);
	cr_assert_str_eq(dup, "dup");
	cr_expect_null(ix.sorted);
	bd_names_free(&ix);

	cr_assert_eq(bd_names_build(&ix, NULL, 0, sizeof(r[0]), offsetof(struct rec, name), NULL),
		     0);
	cr_expect_null(bd_names_find(&ix, "x"));
	bd_names_free(&ix);
	cr_expect_eq(bd_names_build(&ix, NULL, 2, sizeof(r[0]), 0, NULL), -EINVAL);
	cr_expect_eq(bd_names_build(NULL, r, 4, sizeof(r[0]), 0, NULL), -EINVAL);
}
