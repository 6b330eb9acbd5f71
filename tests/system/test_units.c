/* test_units.c — deploy/'s systemd units, each on its own: `systemd-analyze verify` is clean
 * (ExecStart= pointed at this build's binaries, which verify wants to exist) and
 * `systemd-analyze security` rates its exposure at most 2.0; the multi-node drop-ins of
 * deploy/scale-out/ verify clean over their units; the file every unit names in
 * Documentation= is one `make install` installs. Skipped, with the reason, where
 * systemd-analyze is missing (make deps installs it: Debian's systemd).
 */
#include <criterion/criterion.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tmpdir.h"

#define MAX_EXPOSURE 2.0

static const char *const units[] = { "kvpoold.service", "router.service", "workerd@.service" };

static char dir[256], root[PATH_MAX], bin[PATH_MAX];

static void setup(void)
{
	const char *b = getenv("BD_BIN");

	cr_assert_eq(td_make(dir, sizeof(dir), "bd-units"), 0);
	cr_assert_not_null(b, "BD_BIN is not set (make unit-run sets it)");
	cr_assert_not_null(realpath(b, bin), "%s", b);
	/* the repository: the binaries are in ROOT/BUILD/bin, BUILD one or two levels deep */
	snprintf(root, sizeof(root), "%s", bin);
	for (int up = 0; up < 4; up++) {
		char probe[PATH_MAX + 32];
		char *slash = strrchr(root, '/');

		if (!slash)
			break;
		*slash = 0;
		snprintf(probe, sizeof(probe), "%s/deploy/router.service", root);
		if (access(probe, R_OK) == 0)
			return;
	}
	cr_assert_fail("no deploy/ above %s", bin);
}

static void teardown(void)
{
	td_remove(dir);
}

TestSuite(units, .init = setup, .fini = teardown, .timeout = 120);

static void need_analyze(void)
{
	if (system("command -v systemd-analyze >/dev/null 2>&1") != 0)
		cr_skip_test("no systemd-analyze on this machine (make deps installs Debian's "
			     "systemd)");
}

static void run(const char *cmd, char *out, size_t cap)
{
	FILE *p = popen(cmd, "r");
	size_t n;

	cr_assert_not_null(p, "%s", cmd);
	n = fread(out, 1, cap - 1, p);
	out[n] = 0;
	pclose(p);
}

Test(units, each_verifies_clean)
{
	char cmd[4 * PATH_MAX], out[8192];

	need_analyze();
	for (size_t i = 0; i < sizeof(units) / sizeof(units[0]); i++) {
		/* a template is verified as an instance */
		const char *name = strcmp(units[i], "workerd@.service") ? units[i]
									: "workerd@0.service";

		snprintf(cmd, sizeof(cmd),
			 "sed 's#/usr/local/bin/#%s/#' '%s/deploy/%s' > '%s/%s' && cd '%s' && "
			 "systemd-analyze verify --man=no '%s' 2>&1; echo rc=$?",
			 bin, root, units[i], dir, name, dir, name);
		run(cmd, out, sizeof(out));
		cr_expect_str_eq(out, "rc=0\n", "%s: systemd-analyze verify is not clean:\n%s",
				 units[i], out);
	}
}

/* The multi-node drop-ins of deploy/scale-out/ (router on TCP with CURVE and HTTP on the
 * node's address, kvpoold's KV events on TCP), each over its unit: verify reads the drop-in
 * beside the unit and is clean (an unknown key or a bad value would be printed). */
Test(units, scale_out_drop_ins_verify_clean)
{
	static const char *const with[] = { "router.service", "kvpoold.service" };
	char cmd[6 * PATH_MAX], out[8192];

	need_analyze();
	for (size_t i = 0; i < sizeof(with) / sizeof(with[0]); i++) {
		snprintf(cmd, sizeof(cmd),
			 "mkdir -p '%s/%s.d' && sed 's#/usr/local/bin/#%s/#' '%s/deploy/%s' > "
			 "'%s/%s' && sed 's#/usr/local/bin/#%s/#' "
			 "'%s/deploy/scale-out/%s.d/scale-out.conf' > '%s/%s.d/scale-out.conf' && "
			 "cd '%s' && systemd-analyze verify --man=no '%s' 2>&1; echo rc=$?",
			 dir, with[i], bin, root, with[i], dir, with[i], bin, root, with[i], dir,
			 with[i], dir, with[i]);
		run(cmd, out, sizeof(out));
		cr_expect_str_eq(out, "rc=0\n", "%s with its scale-out drop-in:\n%s", with[i], out);
	}
}

Test(units, each_exposure_at_most_2_0)
{
	char cmd[2 * PATH_MAX], out[16384];

	need_analyze();
	for (size_t i = 0; i < sizeof(units) / sizeof(units[0]); i++) {
		const char *at;
		double level = 99;

		snprintf(cmd, sizeof(cmd),
			 "cd '%s/deploy' && systemd-analyze security --offline=true --no-pager "
			 "--threshold=%d '%s' 2>&1; echo rc=$?",
			 root, (int)(MAX_EXPOSURE * 10), units[i]);
		run(cmd, out, sizeof(out));
		at = strstr(out, "Overall exposure level for ");
		cr_assert_not_null(at, "%s: no exposure level in:\n%s", units[i], out);
		at = strchr(at, ':');
		cr_assert(at && sscanf(at + 1, "%lf", &level) == 1, "%s: %s", units[i], out);
		cr_expect_leq(level, MAX_EXPOSURE, "%s: exposure %.1f above %.1f:\n%s", units[i],
			      level, MAX_EXPOSURE, out);
		cr_expect(strstr(out, "rc=0\n"), "%s: over the threshold:\n%s", units[i], out);
	}
}

Test(units, documentation_is_installed)
{
	char cmd[3 * PATH_MAX], out[16384], build[PATH_MAX], *slash;

	/* BUILD is the folder of BD_BIN */
	snprintf(build, sizeof(build), "%s", bin);
	slash = strrchr(build, '/');
	cr_assert_not_null(slash);
	*slash = 0;
	snprintf(cmd, sizeof(cmd), "make -s -n -C '%s' install DESTDIR='%s/dest' BUILD='%s' 2>&1",
		 root, dir, build);
	run(cmd, out, sizeof(out));
	for (size_t i = 0; i < sizeof(units) / sizeof(units[0]); i++) {
		char path[PATH_MAX + 64], line[512], want[PATH_MAX + 600];
		FILE *f;
		bool found = false;

		snprintf(path, sizeof(path), "%s/deploy/%s", root, units[i]);
		f = fopen(path, "r");
		cr_assert_not_null(f, "%s", path);
		while (fgets(line, sizeof(line), f))
			if (!strncmp(line, "Documentation=file://", 21)) {
				line[strcspn(line, "\n")] = 0;
				snprintf(want, sizeof(want), "%s/dest%s", dir, line + 21);
				cr_expect(strstr(out, want), "%s: Documentation=%s is not installed by "
					  "make install:\n%s", units[i], line + 14, out);
				found = true;
			}
		fclose(f);
		cr_expect(found, "%s has no Documentation=file://", units[i]);
	}
}
