/* test_config.c — the INI configuration (lib/config.c, bd_config.h). */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bd_config.h"

static struct bd_config *C;

static void init(void)
{
	C = bd_config_new();
	cr_assert_not_null(C);
}

static void fini(void)
{
	bd_config_free(C);
}

TestSuite(config, .init = init, .fini = fini);

Test(config, sections_keys_and_overrides)
{
	int line = -1;

	cr_assert_eq(bd_config_load_string(C,
					   "; comment\n"
					   "[pool]\n"
					   "socket = /run/x.sock  \n"
					   "slots=4\n"
					   "[router]\n"
					   "slots = 9\n"
					   "[pool]\n"
					   "slots = 5\n",
					   &line),
		     0);
	cr_expect_str_eq(bd_config_get(C, "pool", "socket"), "/run/x.sock"); /* trimmed */
	cr_expect_str_eq(bd_config_get(C, "pool", "slots"), "5");           /* later wins */
	cr_expect_str_eq(bd_config_get(C, "router", "slots"), "9");
	cr_expect_null(bd_config_get(C, "pool", "missing"));
	cr_expect_null(bd_config_get(C, "worker", "slots"));
	/* a flag overrides the file */
	cr_assert_eq(bd_config_set(C, "pool", "slots", "7"), 0);
	cr_expect_str_eq(bd_config_get(C, "pool", "slots"), "7");
	cr_expect_eq(line, -1, "line written on success");
}

Test(config, syntax_errors_name_the_line)
{
	int line = 0;

	cr_expect_eq(bd_config_load_string(C, "[pool]\nslots = 4\nthis is not a key\n", &line),
		     -EINVAL);
	cr_expect_eq(line, 3);
	/* a key before any section has nowhere to go */
	line = 0;
	cr_expect_eq(bd_config_load_string(C, "slots = 4\n[pool]\n", &line), -EINVAL);
	cr_expect_eq(line, 1);
}

Test(config, load_file_and_missing_file)
{
	char path[] = "/tmp/bdfp4-config-XXXXXX";
	int fd = mkstemp(path), line = 0;
	FILE *f;

	cr_assert_geq(fd, 0);
	f = fdopen(fd, "w");
	fputs("[pool]\nmemory_bytes = 2G\n", f);
	fclose(f);
	cr_expect_eq(bd_config_load(C, path, &line), 0);
	cr_expect_str_eq(bd_config_get(C, "pool", "memory_bytes"), "2G");
	unlink(path);
	cr_expect_eq(bd_config_load(C, path, &line), -ENOENT);
	cr_expect_eq(bd_config_load(C, NULL, &line), -EINVAL);
}

Test(config, typed_getters)
{
	int64_t i = 42;
	uint64_t b = 42;
	double d = 0.5;
	bool t = false;

	bd_config_load_string(C,
			      "[s]\nint = 12\nhex = 0x10\nneg = -3\nbad = 12x\nbig = 99\n"
			      "b1 = 512M\nb2 = 2GiB\nb3 = 4096\nb4 = 1kb\nb5 = -1\nb6 = 5Q\n"
			      "b7 = 99999999999T\nf = 0.9\nnan = nan\nyes = Yes\noff = off\n"
			      "maybe = maybe\n",
			      NULL);
	cr_expect_eq(bd_config_get_i64(C, "s", "int", 0, 0, 100, &i), 0);
	cr_expect_eq(i, 12);
	cr_expect_eq(bd_config_get_i64(C, "s", "hex", 0, 0, 100, &i), 0);
	cr_expect_eq(i, 16);
	cr_expect_eq(bd_config_get_i64(C, "s", "neg", 0, -5, 100, &i), 0);
	cr_expect_eq(i, -3);
	cr_expect_eq(bd_config_get_i64(C, "s", "absent", 77, 0, 100, &i), 0);
	cr_expect_eq(i, 77);
	i = 5;
	cr_expect_eq(bd_config_get_i64(C, "s", "bad", 0, 0, 100, &i), -EINVAL);
	cr_expect_eq(bd_config_get_i64(C, "s", "big", 0, 0, 50, &i), -ERANGE);
	cr_expect_eq(i, 5, "output written on error");

	cr_expect_eq(bd_config_get_bytes(C, "s", "b1", 0, 0, UINT64_MAX, &b), 0);
	cr_expect_eq(b, 512ull << 20);
	cr_expect_eq(bd_config_get_bytes(C, "s", "b2", 0, 0, UINT64_MAX, &b), 0);
	cr_expect_eq(b, 2ull << 30);
	cr_expect_eq(bd_config_get_bytes(C, "s", "b3", 0, 0, UINT64_MAX, &b), 0);
	cr_expect_eq(b, 4096);
	cr_expect_eq(bd_config_get_bytes(C, "s", "b4", 0, 0, UINT64_MAX, &b), 0);
	cr_expect_eq(b, 1024);
	b = 1;
	cr_expect_eq(bd_config_get_bytes(C, "s", "b5", 0, 0, UINT64_MAX, &b), -EINVAL);
	cr_expect_eq(bd_config_get_bytes(C, "s", "b6", 0, 0, UINT64_MAX, &b), -EINVAL);
	cr_expect_eq(bd_config_get_bytes(C, "s", "b7", 0, 0, UINT64_MAX, &b), -ERANGE);
	cr_expect_eq(bd_config_get_bytes(C, "s", "b1", 0, 0, 1 << 20, &b), -ERANGE);
	cr_expect_eq(b, 1);

	cr_expect_eq(bd_config_get_double(C, "s", "f", 0, 0, 1, &d), 0);
	cr_expect_float_eq(d, 0.9, 1e-12);
	cr_expect_eq(bd_config_get_double(C, "s", "nan", 0, 0, 1, &d), -EINVAL);
	cr_expect_eq(bd_config_get_double(C, "s", "int", 0, 0, 1, &d), -ERANGE);

	cr_expect_eq(bd_config_get_bool(C, "s", "yes", false, &t), 0);
	cr_expect(t);
	cr_expect_eq(bd_config_get_bool(C, "s", "off", true, &t), 0);
	cr_expect_not(t);
	cr_expect_eq(bd_config_get_bool(C, "s", "maybe", true, &t), -EINVAL);
}

Test(config, unknown_keys)
{
	static const char *const known[] = { "socket", "slots", NULL };

	bd_config_load_string(C, "[pool]\nsocket = a\nslots = 2\n[router]\nx = 1\n", NULL);
	cr_expect_null(bd_config_unknown_key(C, "pool", known));
	bd_config_set(C, "pool", "slost", "3");
	cr_expect_str_eq(bd_config_unknown_key(C, "pool", known), "slost");
}

Test(config, bad_arguments)
{
	cr_expect_eq(bd_config_set(C, "", "k", "v"), -EINVAL);
	cr_expect_eq(bd_config_set(C, "s", NULL, "v"), -EINVAL);
	cr_expect_eq(bd_config_set(C, "s", "k", NULL), -EINVAL);
	cr_expect_null(bd_config_get(C, "s", "k"));
	bd_config_free(NULL);
}
