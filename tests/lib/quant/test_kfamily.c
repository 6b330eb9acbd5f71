/* test_kfamily.c — the decode kernel families and the start-up choice (bd_kfamily.h): which
 * family each device gets in each mode, with and without the Blackwell objects, for every
 * configuration of NUMERICS.md §9 and the shapes at the edges; the self-check's outcome
 * turned into the family that serves; the refusals and their sentences.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <string.h>

#include "quant/bd_kfamily.h"

static const struct bd_kfamily_device H200 = { 9, 0, true }, B300 = { 10, 3, true },
				      B200 = { 10, 0, true }, RTX = { 12, 0, true },
				      SPARK = { 12, 1, true }, A100 = { 8, 0, true },
				      B300_HOPPER_ONLY = { 10, 3, false };
static const struct bd_kfamily_shape D128G4 = { 128, 0, 4 };

static const struct bd_kvcfg *cfg(const char *name)
{
	const struct bd_kvcfg *c = bd_kvcfg_find(name);
	cr_assert_not_null(c, "%s", name);
	return c;
}

Test(kfamily, names_and_modes)
{
	enum bd_kfamily_mode m = BD_KFAMILY_AUTO;

	cr_expect_str_eq(bd_kfamily_name(BD_KFAMILY_HOPPER), "hopper");
	cr_expect_str_eq(bd_kfamily_name(BD_KFAMILY_BLACKWELL_TC), "blackwell-tc");
	cr_expect_str_eq(bd_kfamily_name(BD_KFAMILY_BLACKWELL_MMA), "blackwell-mma");
	cr_expect_null(bd_kfamily_name(BD_KFAMILY_COUNT));
	cr_expect_eq(bd_kfamily_mode_parse("native", &m), 0);
	cr_expect_eq(m, BD_KFAMILY_NATIVE);
	cr_expect_eq(bd_kfamily_mode_parse("portable", &m), 0);
	cr_expect_eq(m, BD_KFAMILY_PORTABLE);
	cr_expect_eq(bd_kfamily_mode_parse("auto", &m), 0);
	cr_expect_eq(m, BD_KFAMILY_AUTO);
	cr_expect_eq(bd_kfamily_mode_parse("hopper", &m), -EINVAL);
	cr_expect_eq(bd_kfamily_mode_parse("Auto", &m), -EINVAL);
	cr_expect_eq(bd_kfamily_mode_parse(NULL, &m), -EINVAL);
}

Test(kfamily, native_by_capability)
{
	cr_expect_eq(bd_kfamily_native(10, 0), BD_KFAMILY_BLACKWELL_TC);
	cr_expect_eq(bd_kfamily_native(10, 3), BD_KFAMILY_BLACKWELL_TC);
	cr_expect_eq(bd_kfamily_native(12, 0), BD_KFAMILY_BLACKWELL_MMA);
	/* sm_100a/sm_120a code does not run on 10.1, 11.0, 12.1 */
	cr_expect_eq(bd_kfamily_native(10, 1), -1);
	cr_expect_eq(bd_kfamily_native(11, 0), -1);
	cr_expect_eq(bd_kfamily_native(12, 1), -1);
	cr_expect_eq(bd_kfamily_native(9, 0), -1);
}

/* every family on every device: the code must exist for the device */
Test(kfamily, supported_devices)
{
	const struct bd_kvcfg *c = cfg("bitdecoding-nvfp4");
	char why[BD_KFAMILY_WHY_MAX];

	cr_expect_eq(bd_kfamily_supported(BD_KFAMILY_HOPPER, &H200, c, &D128G4, why, sizeof(why)),
		     0);
	cr_expect_eq(bd_kfamily_supported(BD_KFAMILY_HOPPER, &B300, c, &D128G4, why, sizeof(why)),
		     0);
	cr_expect_eq(bd_kfamily_supported(BD_KFAMILY_HOPPER, &RTX, c, &D128G4, why, sizeof(why)),
		     0);
	cr_expect_eq(bd_kfamily_supported(BD_KFAMILY_BLACKWELL_TC, &B200, c, &D128G4, NULL, 0), 0);
	cr_expect_eq(bd_kfamily_supported(BD_KFAMILY_BLACKWELL_TC, &B300, c, &D128G4, NULL, 0), 0);
	cr_expect_eq(bd_kfamily_supported(BD_KFAMILY_BLACKWELL_MMA, &RTX, c, &D128G4, NULL, 0), 0);

	cr_expect_eq(bd_kfamily_supported(BD_KFAMILY_BLACKWELL_TC, &H200, c, &D128G4, why,
					  sizeof(why)), -ENODEV);
	cr_expect(strstr(why, "10.0 and 10.3") && strstr(why, "9.0"), "%s", why);
	cr_expect_eq(bd_kfamily_supported(BD_KFAMILY_BLACKWELL_MMA, &B300, c, &D128G4, why,
					  sizeof(why)), -ENODEV);
	cr_expect_eq(bd_kfamily_supported(BD_KFAMILY_BLACKWELL_TC, &RTX, c, &D128G4, NULL, 0),
		     -ENODEV);
	/* no family at all for 8.0 and 12.1 */
	for (int f = 0; f < BD_KFAMILY_COUNT; f++) {
		cr_expect_eq(bd_kfamily_supported(f, &A100, c, &D128G4, NULL, 0), -ENODEV);
		cr_expect_eq(bd_kfamily_supported(f, &SPARK, c, &D128G4, NULL, 0), -ENODEV);
	}
	cr_expect_eq(bd_kfamily_supported(BD_KFAMILY_HOPPER, &SPARK, c, &D128G4, why,
					  sizeof(why)), -ENODEV);
	cr_expect(strstr(why, "12.1") != NULL, "%s", why);
	/* a Hopper-only build on a B300: nothing, and the sentence says which build */
	for (int f = BD_KFAMILY_COUNT - 1; f >= 0; f--)
		cr_expect_eq(bd_kfamily_supported(f, &B300_HOPPER_ONLY, c, &D128G4, why,
						  sizeof(why)), -ENODEV);
	cr_expect(strstr(why, "GENCODE_BW") != NULL, "hopper's sentence: %s", why);
	cr_expect_eq(bd_kfamily_supported(BD_KFAMILY_BLACKWELL_TC, &B300_HOPPER_ONLY, c, &D128G4,
					  why, sizeof(why)), -ENODEV);
	cr_expect(strstr(why, "GENCODE_BW") != NULL, "blackwell-tc's sentence: %s", why);
	cr_expect_eq(bd_kfamily_supported(BD_KFAMILY_COUNT, &H200, c, &D128G4, NULL, 0), -EINVAL);
	cr_expect_eq(bd_kfamily_supported(BD_KFAMILY_HOPPER, NULL, c, &D128G4, NULL, 0), -EINVAL);
}

/* every §9 configuration: hopper serves all but FP8; the native families the FP4 pages of
 * token-major NVFP4 and MXFP4 only */
Test(kfamily, supported_configs)
{
	for (int i = 0; i < BD_KVCFG_COUNT; i++) {
		const struct bd_kvcfg *c = bd_kvcfg_get(i);
		const bool fp8 = c->page_fmt == BD_PAGE_FP8;
		const bool native = c->page_fmt == BD_PAGE_NVFP4 || c->page_fmt == BD_PAGE_MXFP4;
		char why[BD_KFAMILY_WHY_MAX] = "";

		cr_expect_eq(bd_kfamily_supported(BD_KFAMILY_HOPPER, &B300, c, &D128G4, NULL, 0),
			     fp8 ? -EOPNOTSUPP : 0, "%s", c->name);
		cr_expect_eq(bd_kfamily_supported(BD_KFAMILY_BLACKWELL_TC, &B300, c, &D128G4, why,
						  sizeof(why)), native ? 0 : -EOPNOTSUPP, "%s",
			     c->name);
		if (!native)
			cr_expect(strstr(why, c->name) != NULL, "%s", why);
		cr_expect_eq(bd_kfamily_supported(BD_KFAMILY_BLACKWELL_MMA, &RTX, c, &D128G4, NULL,
						  0), native ? 0 : -EOPNOTSUPP, "%s", c->name);
	}
	/* trtllm-nvfp4 with a sink, NVFP4 pages with a BF16 query or FP32 P: not implemented */
	struct bd_kvcfg ch = *cfg("trtllm-nvfp4"), nv = *cfg("bitdecoding-nvfp4");
	ch.sink = true;
	cr_expect_eq(bd_kfamily_supported(BD_KFAMILY_HOPPER, &H200, &ch, &D128G4, NULL, 0),
		     -EOPNOTSUPP);
	nv.query_terms = 0;
	cr_expect_eq(bd_kfamily_supported(BD_KFAMILY_HOPPER, &H200, &nv, &D128G4, NULL, 0),
		     -EOPNOTSUPP);
	nv = *cfg("bitdecoding-nvfp4");
	nv.p_quant = BD_P_FP32;
	cr_expect_eq(bd_kfamily_supported(BD_KFAMILY_BLACKWELL_TC, &B300, &nv, &D128G4, NULL, 0),
		     -EOPNOTSUPP);
	nv.p_quant = BD_P_MXFP4;
	cr_expect_eq(bd_kfamily_supported(BD_KFAMILY_HOPPER, &H200, &nv, &D128G4, NULL, 0),
		     -EOPNOTSUPP);
}

Test(kfamily, supported_shapes)
{
	const struct bd_kvcfg *c = cfg("bitdecoding-mxfp4");
	const struct { struct bd_kfamily_shape s; int want; } t[] = {
		{ { 64, 0, 1 }, 0 },            { { 128, 0, 8 }, 0 },
		{ { 128, 0, 9 }, -EOPNOTSUPP }, { { 128, 0, 0 }, -EOPNOTSUPP },
		{ { 96, 0, 4 }, -EOPNOTSUPP },  { { 256, 0, 4 }, -EOPNOTSUPP },
		{ { 128, 64, 4 }, -EOPNOTSUPP },
	};
	for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++)
		for (int f = 0; f < BD_KFAMILY_COUNT; f++) {
			const struct bd_kfamily_device *dev =
				f == BD_KFAMILY_BLACKWELL_MMA ? &RTX : &B300;
			cr_expect_eq(bd_kfamily_supported(f, dev, c, &t[i].s, NULL, 0), t[i].want,
				     "family %d, d %d, d_rope %d, G %d", f, t[i].s.d, t[i].s.d_rope,
				     t[i].s.G);
		}
}

/* choose + finish in one call: the family that serves and what the worker reports */
static int pick(enum bd_kfamily_mode m, const struct bd_kfamily_device *dev, const char *cn,
		int selfcheck, struct bd_kfamily_choice *c)
{
	const char *detail = selfcheck == 1 ? "max |err| 0.5 at head 3" : selfcheck < 0 ?
		"launch failed" : NULL;
	int r = bd_kfamily_choose(m, dev, cfg(cn), &D128G4, c);
	if (r < 0)
		return r;
	return bd_kfamily_finish(c, selfcheck, detail);
}

Test(kfamily, choose_auto)
{
	struct bd_kfamily_choice c;

	/* H200: hopper, no self-check, says why */
	cr_assert_eq(pick(BD_KFAMILY_AUTO, &H200, "bitdecoding-nvfp4", 0, &c), 0);
	cr_expect_eq(c.family, BD_KFAMILY_HOPPER);
	cr_expect_eq(c.native, -1);
	cr_expect(!c.selfcheck);
	cr_expect_eq(c.selfcheck_result, 2);
	cr_expect(strstr(c.why, "9.0 has no native") != NULL, "%s", c.why);

	/* B300: native when the self-check passes, hopper on a mismatch or a failure */
	cr_assert_eq(bd_kfamily_choose(BD_KFAMILY_AUTO, &B300, cfg("bitdecoding-nvfp4"), &D128G4,
				       &c), 0);
	cr_expect(c.selfcheck);
	cr_expect_eq(c.native, BD_KFAMILY_BLACKWELL_TC);
	cr_expect_eq(c.family, BD_KFAMILY_HOPPER, "hopper until the self-check passed");
	cr_assert_eq(bd_kfamily_finish(&c, 0, NULL), 0);
	cr_expect_eq(c.family, BD_KFAMILY_BLACKWELL_TC);
	cr_expect_eq(c.selfcheck_result, 0);
	cr_expect(strstr(c.why, "passed") != NULL, "%s", c.why);

	cr_assert_eq(pick(BD_KFAMILY_AUTO, &B300, "bitdecoding-nvfp4", 1, &c), 0);
	cr_expect_eq(c.family, BD_KFAMILY_HOPPER);
	cr_expect_eq(c.selfcheck_result, 1);
	cr_expect(strstr(c.why, "mismatch") && strstr(c.why, "head 3"), "%s", c.why);

	cr_assert_eq(pick(BD_KFAMILY_AUTO, &RTX, "bitdecoding-mxfp4", -EIO, &c), 0);
	cr_expect_eq(c.family, BD_KFAMILY_HOPPER);
	cr_expect_eq(c.native, BD_KFAMILY_BLACKWELL_MMA);
	cr_expect_eq(c.selfcheck_result, -EIO);
	cr_expect(strstr(c.why, "launch failed") != NULL, "%s", c.why);

	/* B300, BF16 pages: no native family for them, hopper without a self-check */
	cr_assert_eq(pick(BD_KFAMILY_AUTO, &B300, "bf16", 0, &c), 0);
	cr_expect_eq(c.family, BD_KFAMILY_HOPPER);
	cr_expect(!c.selfcheck);
	cr_expect(strstr(c.why, "bf16") != NULL, "%s", c.why);

	/* refusals at start: FP8 pages, a device with no code */
	cr_expect_eq(pick(BD_KFAMILY_AUTO, &H200, "fp8", 0, &c), -EOPNOTSUPP);
	cr_expect(strstr(c.why, "fp8") != NULL, "%s", c.why);
	cr_expect_eq(pick(BD_KFAMILY_AUTO, &A100, "bitdecoding-nvfp4", 0, &c), -ENODEV);
	cr_expect(strstr(c.why, "8.0") != NULL, "%s", c.why);
	cr_expect_eq(pick(BD_KFAMILY_AUTO, &B300_HOPPER_ONLY, "bitdecoding-nvfp4", 0, &c),
		     -ENODEV);
}

Test(kfamily, choose_forced)
{
	struct bd_kfamily_choice c;

	/* portable: hopper, no self-check, on every device that has its code */
	cr_assert_eq(pick(BD_KFAMILY_PORTABLE, &B300, "bitdecoding-nvfp4", 1, &c), 0);
	cr_expect_eq(c.family, BD_KFAMILY_HOPPER);
	cr_expect(!c.selfcheck);
	cr_expect_eq(c.selfcheck_result, 2);
	cr_expect_eq(c.native, BD_KFAMILY_BLACKWELL_TC);

	/* native: refused where there is none, served despite a mismatch, refused when it
	 * cannot run */
	cr_expect_eq(pick(BD_KFAMILY_NATIVE, &H200, "bitdecoding-nvfp4", 0, &c), -ENODEV);
	cr_expect(strstr(c.why, "native") && strstr(c.why, "9.0"), "%s", c.why);
	cr_expect_eq(pick(BD_KFAMILY_NATIVE, &B300, "bf16", 0, &c), -EOPNOTSUPP);
	cr_expect(strstr(c.why, "blackwell-tc") != NULL, "%s", c.why);
	cr_assert_eq(pick(BD_KFAMILY_NATIVE, &B200, "bitdecoding-mxfp4", 1, &c), 0);
	cr_expect_eq(c.family, BD_KFAMILY_BLACKWELL_TC);
	cr_expect_eq(c.selfcheck_result, 1);
	cr_expect(strstr(c.why, "MISMATCH") != NULL, "%s", c.why);
	cr_expect_eq(pick(BD_KFAMILY_NATIVE, &RTX, "bitdecoding-nvfp4", -EIO, &c), -EIO);
	cr_expect(strstr(c.why, "cannot run") != NULL, "%s", c.why);
	cr_assert_eq(pick(BD_KFAMILY_NATIVE, &RTX, "nvfp4-base", 0, &c), 0);
	cr_expect_eq(c.family, BD_KFAMILY_BLACKWELL_MMA);

	/* finish without a self-check asked for changes nothing; bad results are refused */
	cr_assert_eq(bd_kfamily_choose(BD_KFAMILY_PORTABLE, &H200, cfg("bf16"), &D128G4, &c), 0);
	cr_expect_eq(bd_kfamily_finish(&c, 1, "x"), 0);
	cr_expect_eq(c.family, BD_KFAMILY_HOPPER);
	cr_expect_eq(c.selfcheck_result, 2);
	cr_expect_eq(bd_kfamily_finish(&c, 2, NULL), -EINVAL);
	cr_expect_eq(bd_kfamily_finish(NULL, 0, NULL), -EINVAL);
	cr_expect_eq(bd_kfamily_choose(BD_KFAMILY_AUTO, NULL, cfg("bf16"), &D128G4, &c), -EINVAL);
}
