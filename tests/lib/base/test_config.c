/* test_config.c — the INI configuration (lib/base/config.c, bd_config.h). */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/bd_config.h"

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

/* ---- the daemons' command line (bd_config_parse_args) ------------------------------------ */

static const struct bd_config_key KEYS[] = {
	{ "socket", "/run/default.sock", "attach socket" },
	{ "max_batch", "64", "rows per step" },
	{ "synthetic_prefill", "false", "fill prompts with synthetic KV", true },
	{ NULL },
};

/* A config file in a fresh temporary directory; *dir is removed by rm_file. */
static char *write_file(const char *text)
{
	char tmpl[] = "/tmp/bd-cfg-XXXXXX";
	char *dir = mkdtemp(tmpl), *path = NULL;

	cr_assert_not_null(dir);
	cr_assert(asprintf(&path, "%s/bdfp4.conf", dir) > 0);
	FILE *f = fopen(path, "w");
	cr_assert_not_null(f);
	fputs(text, f);
	fclose(f);
	return path;
}

static void rm_file(char *path)
{
	unlink(path);
	*strrchr(path, '/') = '\0';
	rmdir(path);
	free(path);
}

static int parse(int argc, const char **argv, char *err)
{
	return bd_config_parse_args(C, "worker", KEYS, "/nonexistent/bdfp4.conf", argc,
				    (char **)argv, err, 256);
}

Test(config, flags_override_the_file_in_order)
{
	char *path = write_file("[worker]\nsocket = /run/file.sock\nmax_batch = 8\n");
	char err[256];
	const char *argv[] = { "workerd", "--config", path, "--max-batch", "16", "--max-batch=32",
			       "--synthetic-prefill" };

	cr_assert_eq(parse(7, argv, err), 0, "%s", err);
	/* the file's value stays where no flag names it; the last of two flags wins; a boolean
	 * flag without a value means true; underscores are spelled as dashes */
	cr_assert_str_eq(bd_config_get(C, "worker", "socket"), "/run/file.sock");
	cr_assert_str_eq(bd_config_get(C, "worker", "max_batch"), "32");
	cr_assert_str_eq(bd_config_get(C, "worker", "synthetic_prefill"), "1");
	bool b = false;
	cr_assert_eq(bd_config_get_bool(C, "worker", "synthetic_prefill", false, &b), 0);
	cr_assert(b);
	rm_file(path);
}

Test(config, no_config_and_a_missing_default_file)
{
	char *path = write_file("[worker]\nsocket = /run/file.sock\n");
	char err[256];
	const char *a1[] = { "workerd", "--config", path, "--no-config" };
	const char *a2[] = { "workerd", "--socket", "/run/flag.sock" };

	cr_assert_eq(parse(4, a1, err), 0, "%s", err);
	cr_assert_null(bd_config_get(C, "worker", "socket"), "--no-config read the file");
	/* the default path does not exist: not an error, flags and defaults apply */
	cr_assert_eq(parse(3, a2, err), 0, "%s", err);
	cr_assert_str_eq(bd_config_get(C, "worker", "socket"), "/run/flag.sock");
	cr_assert_str_eq(bd_config_str(C, "worker", KEYS, "max_batch"), "64");
	cr_assert_str_eq(bd_config_str(C, "worker", KEYS, "no_such_key"), "");
	rm_file(path);
}

Test(config, bad_command_lines_are_refused_and_set_nothing)
{
	char err[256];
	const char *unknown[] = { "workerd", "--max-batch", "8", "--bogus", "1" };
	const char *novalue[] = { "workerd", "--max-batch" };
	const char *stray[] = { "workerd", "--max-batch", "8", "extra" };
	const char *missing[] = { "workerd", "--config", "/nonexistent/named.conf" };
	const char *help[] = { "workerd", "--max-batch", "8", "--help" };

	cr_assert_eq(parse(5, unknown, err), -EINVAL);
	cr_assert(strstr(err, "--bogus") != NULL, "%s", err);
	cr_assert_eq(parse(2, novalue, err), -EINVAL);
	cr_assert(strstr(err, "needs a value") != NULL, "%s", err);
	cr_assert_eq(parse(4, stray, err), -EINVAL);
	cr_assert(strstr(err, "'extra'") != NULL, "%s", err);
	/* a file named on the command line must exist */
	cr_assert_eq(parse(3, missing, err), -ENOENT);
	cr_assert(strstr(err, "/nonexistent/named.conf") != NULL, "%s", err);
	cr_assert_eq(parse(4, help, err), 1);
	/* no refused or --help command line set a key */
	cr_assert_null(bd_config_get(C, "worker", "max_batch"));
}

Test(config, a_syntax_error_names_file_and_line)
{
	char *path = write_file("[worker]\nsocket = /run/a.sock\nthis line is not ini\n");
	char err[256];
	const char *argv[] = { "workerd", "--config", path };

	cr_assert_eq(parse(3, argv, err), -EBADMSG);
	char want[300];
	snprintf(want, sizeof(want), "%s:3:", path);
	cr_assert(strstr(err, want) != NULL, "%s", err);
	rm_file(path);
}

Test(config, unknown_keys_of_a_table)
{
	cr_assert_eq(bd_config_load_string(C, "[worker]\nsocket = x\nmax_bach = 3\n", NULL), 0);
	cr_assert_str_eq(bd_config_unknown(C, "worker", KEYS), "max_bach");
	cr_assert_eq(bd_config_set(C, "worker2", "anything", "1"), 0);
	cr_assert_null(bd_config_unknown(C, "worker3", KEYS));
}
