/* test_daemon.c — the daemon skeleton's typed configuration values (lib/base/daemon.c,
 * bd_daemon.h): defaults from the key table, values from the file, and the one log line a
 * refused value gets. Suite "daemon".
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/bd_config.h"
#include "base/bd_daemon.h"

static const struct bd_config_key keys[] = {
	{ "slots", "16", "an int with a default" },
	{ "hex", "0x20", "an int whose default is hexadecimal" },
	{ "no_default", "", "an int without a default" },
	{ "memory", "512M", "a byte size" },
	{ "fraction", "0.25", "a number" },
	{ "verbose", "yes", "a boolean" },
	{ "quiet", "", "a boolean without a default" },
	{ NULL, NULL, NULL, false },
};

static struct bd_daemon D = { .name = "test", .section = "pool", .keys = keys };

static void init(void)
{
	D.cfg = bd_config_new();
	cr_assert_not_null(D.cfg);
}

static void fini(void)
{
	bd_config_free(D.cfg);
	D.cfg = NULL;
}

TestSuite(daemon, .init = init, .fini = fini);

static void load(const char *text)
{
	int line = 0;

	cr_assert_eq(bd_config_load_string(D.cfg, text, &line), 0, "line %d", line);
}

/* Runs `call` with stderr sent to a temporary file, then expects it to return want and to
 * have logged one line that contains why. */
#define EXPECT_REFUSED(call, want, why)                                                    \
	do {                                                                               \
		FILE *tmp_ = tmpfile();                                                    \
		int saved_ = dup(STDERR_FILENO), e_;                                       \
		char text_[1024];                                                          \
		size_t n_;                                                                 \
		int lines_ = 0;                                                            \
                                                                                           \
		cr_assert(tmp_ && saved_ >= 0);                                            \
		fflush(stderr);                                                            \
		cr_assert_geq(dup2(fileno(tmp_), STDERR_FILENO), 0);                       \
		e_ = (call);                                                               \
		cr_assert_geq(dup2(saved_, STDERR_FILENO), 0);                             \
		close(saved_);                                                             \
		rewind(tmp_);                                                              \
		n_ = fread(text_, 1, sizeof(text_) - 1, tmp_);                             \
		text_[n_] = 0;                                                             \
		fclose(tmp_);                                                              \
		for (size_t i_ = 0; i_ < n_; i_++)                                         \
			lines_ += text_[i_] == '\n';                                       \
		cr_expect_eq(e_, (want), "%s", #call);                                     \
		cr_expect_eq(lines_, 1, "%s: one line, not %d: %s", #call, lines_, text_); \
		cr_expect_not_null(strstr(text_, (why)), "'%s' not in: %s", (why), text_); \
	} while (0)

/* Keys the file sets take its value (of the daemon's section only), the others their default
 * from the key table ("" reads as 0 or false). */
Test(daemon, values_come_from_the_file_else_the_key_table)
{
	int64_t slots = 0;
	int hex = -1, none = -1;
	uint64_t bytes = 0;
	double x = 0.0;
	bool verbose = true, quiet = true;

	load("[pool]\nslots = 0x10\nmemory = 3KiB\nverbose = off\n[router]\nslots = 99\n"
	     "hex = 1\n");
	cr_expect_eq(bd_daemon_get_i64(&D, "slots", 1, 64, &slots), 0);
	cr_expect_eq(slots, 16, "the [pool] section's value, not [router]'s");
	cr_expect_eq(bd_daemon_get_int(&D, "hex", 0, 64, &hex), 0);
	cr_expect_eq(hex, 32, "the default, hexadecimal");
	cr_expect_eq(bd_daemon_get_int(&D, "no_default", -5, 5, &none), 0);
	cr_expect_eq(none, 0);
	cr_expect_eq(bd_daemon_get_bytes(&D, "memory", 1, UINT64_MAX, &bytes), 0);
	cr_expect_eq(bytes, 3072);
	cr_expect_eq(bd_daemon_get_double(&D, "fraction", 0.0, 1.0, &x), 0);
	cr_expect_eq(x, 0.25);
	cr_expect_eq(bd_daemon_get_bool(&D, "verbose", &verbose), 0);
	cr_expect_not(verbose);
	cr_expect_eq(bd_daemon_get_bool(&D, "quiet", &quiet), 0);
	cr_expect_not(quiet);
}

Test(daemon, defaults_of_every_type)
{
	uint64_t bytes = 0;
	bool verbose = false;

	cr_expect_eq(bd_daemon_get_bytes(&D, "memory", 1, UINT64_MAX, &bytes), 0);
	cr_expect_eq(bytes, 512ull << 20, "512M");
	cr_expect_eq(bd_daemon_get_bool(&D, "verbose", &verbose), 0);
	cr_expect(verbose, "yes");
}

Test(daemon, a_key_not_in_the_table_is_enoent)
{
	int v = 7;
	uint64_t b = 7;
	double x = 7.0;
	bool on = true;

	cr_expect_eq(bd_daemon_get_int(&D, "nope", 0, 9, &v), -ENOENT);
	cr_expect_eq(bd_daemon_get_bytes(&D, "nope", 0, 9, &b), -ENOENT);
	cr_expect_eq(bd_daemon_get_double(&D, "nope", 0, 9, &x), -ENOENT);
	cr_expect_eq(bd_daemon_get_bool(&D, "nope", &on), -ENOENT);
	cr_expect(v == 7 && b == 7 && x == 7.0 && on, "the outputs stay");
}

Test(daemon, refused_values_are_logged_once_and_leave_the_output)
{
	int v = 7;
	uint64_t b = 7;
	double x = 7.0;
	bool on = true;

	load("[pool]\nslots = x\nhex = 65\nmemory = 12Q\nfraction = nan\nverbose = maybe\n");
	EXPECT_REFUSED(bd_daemon_get_int(&D, "slots", 1, 4096, &v), -EINVAL,
		       "slots = 'x': not an integer (allowed 1..4096)");
	EXPECT_REFUSED(bd_daemon_get_int(&D, "hex", -3, 64, &v), -ERANGE,
		       "hex = '65': out of range (allowed -3..64)");
	EXPECT_REFUSED(bd_daemon_get_bytes(&D, "memory", 1, 1 << 30, &b), -EINVAL,
		       "memory = '12Q': not a byte size");
	EXPECT_REFUSED(bd_daemon_get_double(&D, "fraction", 0.0, 1.0, &x), -EINVAL,
		       "fraction = 'nan': not a number");
	EXPECT_REFUSED(bd_daemon_get_bool(&D, "verbose", &on), -EINVAL,
		       "verbose = 'maybe': not a boolean (1/0, true/false, yes/no, on/off)");
	cr_expect(v == 7 && b == 7 && x == 7.0 && on, "the outputs stay");
}

Test(daemon, out_of_range_names_the_allowed_range)
{
	uint64_t b = 7;
	double x = 7.0;

	load("[pool]\nmemory = 2G\nfraction = 2.5\n");
	EXPECT_REFUSED(bd_daemon_get_bytes(&D, "memory", 4096, 1 << 30, &b), -ERANGE,
		       "memory = '2G': out of range (allowed 4096..1073741824 bytes)");
	EXPECT_REFUSED(bd_daemon_get_double(&D, "fraction", 0.0, 1.5, &x), -ERANGE,
		       "fraction = '2.5': out of range (allowed 0..1.5)");
	cr_expect(b == 7 && x == 7.0, "the outputs stay");
}

/* ---- bd_daemon_read_opts: a typed key table into an options struct ------------------------- */

struct topts {
	const char *name;
	int slots;       /* 4-byte integer */
	size_t pages;    /* 8-byte integer */
	uint32_t frame;  /* 4-byte byte count */
	uint64_t memory; /* 8-byte byte count */
	double fraction;
	bool verbose;
	int untouched;   /* behind a BD_CONFIG_CODE key */
};

#define OPT(t, field, lo, hi) BD_CONFIG_FIELD(t, struct topts, field, lo, hi)
static const struct bd_config_key typed_keys[] = {
	{ "name", "pool-a", "a text", BD_CONFIG_TEXT(struct topts, name) },
	{ "slots", "16", "an int", OPT(INT, slots, 1, 64) },
	{ "pages", "0", "a size_t", OPT(INT, pages, 0, INT64_MAX) },
	{ "frame", "64K", "a 4-byte byte count", OPT(BYTES, frame, 256, 1 << 24) },
	{ "memory", "512M", "a byte count", OPT(BYTES, memory, 0, INT64_MAX) },
	{ "fraction", "0.25", "a number", OPT(DOUBLE, fraction, 0, 1) },
	{ "verbose", "no", "a boolean", true, OPT(BOOL, verbose, 0, 1) },
	{ "group", "staff", "read by the daemon's code" },
	{ NULL, NULL, NULL },
};
#undef OPT

static struct bd_daemon TD = { .name = "test", .section = "pool", .keys = typed_keys };

static void load_typed(const char *text)
{
	int line = 0;

	TD.cfg = bd_config_new();
	cr_assert_not_null(TD.cfg);
	cr_assert_eq(bd_config_load_string(TD.cfg, text, &line), 0, "line %d", line);
}

Test(daemon, read_opts_fills_every_typed_field_from_the_file_else_the_default)
{
	struct topts o = { .untouched = 7 };

	load_typed("[pool]\nname = pool-b\npages = 5000000000\nmemory = 2G\nverbose = on\n");
	cr_assert_eq(bd_daemon_read_opts(&TD, &o), 0);
	cr_expect_str_eq(o.name, "pool-b");
	cr_expect_eq(o.slots, 16, "the default");
	cr_expect_eq(o.pages, (size_t)5000000000, "all 8 bytes of a size_t");
	cr_expect_eq(o.frame, 65536u, "64K into a uint32_t");
	cr_expect_eq(o.memory, 2ull << 30);
	cr_expect_eq(o.fraction, 0.25);
	cr_expect(o.verbose);
	cr_expect_eq(o.untouched, 7, "a BD_CONFIG_CODE key stores nothing");
	bd_config_free(TD.cfg);
}

/* The first bad value is logged and returned; the fields before it hold their values, those
 * after it are not written. */
Test(daemon, read_opts_stops_at_the_first_bad_value)
{
	struct topts o = { .memory = 1, .verbose = true };

	load_typed("[pool]\nslots = 65\nfraction = 2\n");
	EXPECT_REFUSED(bd_daemon_read_opts(&TD, &o), -ERANGE, "slots = '65'");
	cr_expect_str_eq(o.name, "pool-a", "read before the bad key");
	cr_expect_eq(o.slots, 0, "the refused field is unchanged");
	cr_expect_eq(o.memory, 1, "a later field is not written");
	cr_expect(o.verbose);
	bd_config_free(TD.cfg);

	memset(&o, 0, sizeof(o));
	load_typed("[pool]\nframe = 12x\n");
	EXPECT_REFUSED(bd_daemon_read_opts(&TD, &o), -EINVAL, "not a byte size");
	cr_expect_eq(o.slots, 16);
	cr_expect_eq(o.frame, 0u);
	bd_config_free(TD.cfg);
}
