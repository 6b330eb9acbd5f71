/* decode_select_check.c — the decode family table and the start-up self-check and fallback
 * (kernels/bd_kernels.h, cuda/bd_decode_select.h) on whatever GPU runs it.
 *
 *   - the device as the table sees it (compute capability, Blackwell objects linked) and each
 *     family's support on it: on a Hopper GPU hopper only, the native families refused with
 *     -ENODEV and their sentence; on a Blackwell GPU hopper and the native family;
 *   - the self-check with the hopper family standing in for the native one (the test hook of
 *     bd_decode_select.h): identical kernels agree exactly (worst difference 0) for NVFP4 and
 *     MXFP4 configurations, d 64 and 128, G 1, 4, 8; a perturbed output or a NaN is a
 *     mismatch that names the request and head;
 *   - bd_decode_select taken through a Blackwell capability with that stand-in: auto serves
 *     the native family when the self-check passes and falls back to hopper on a mismatch,
 *     with the reason; native serves despite a mismatch and says so; portable never checks;
 *   - bd_decode_select on the real device: on Hopper auto is hopper without a self-check and
 *     native is refused with -ENODEV, and taken for a B300 (no stand-in) the native kernel's
 *     failure to run is a fallback (auto) or a refusal (native); on a Blackwell GPU the real
 *     native family's self-check against hopper over the FP4 configurations, which must
 *     pass; FP8 pages are refused at selection with -EOPNOTSUPP; plans take the device's
 *     family.
 * Exits 1 when a check fails, 2 when the program cannot run.
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "bd_kernels.h"
#include "cuda/bd_decode_select.h"
#include "gpu_ck.h"

static const struct bd_kvcfg *cfg(const char *name)
{
	const struct bd_kvcfg *c = bd_kvcfg_find(name);
	if (!c) {
		fprintf(stderr, "FATAL: no configuration %s\n", name);
		exit(2);
	}
	return c;
}

static struct bd_layout lay_of(const struct bd_kvcfg *c, int d)
{
	struct bd_layout lay;
	CKR(bd_layout_init(&lay, c->page_fmt, 1, 2, d, 0, 4));
	return lay;
}

static const char *const fp4_cfgs[] = { "bitdecoding-nvfp4", "nvfp4-base", "+dual",
					"bitdecoding-mxfp4" };
#define N_FP4 (sizeof(fp4_cfgs) / sizeof(fp4_cfgs[0]))

static void check_table(const struct bd_kfamily_device *dev)
{
	const struct bd_kvcfg *c = cfg("bitdecoding-nvfp4");
	const struct bd_layout lay = lay_of(c, 128);
	const int nat = bd_kfamily_native(dev->cc_major, dev->cc_minor);

	for (int f = 0; f < BD_KFAMILY_COUNT; f++) {
		char why[BD_KFAMILY_WHY_MAX] = "";
		const int r = bd_decode_family_supported(f, c, &lay, 4, why, sizeof(why));
		const bool want = f == BD_KFAMILY_HOPPER ? dev->cc_major == 9 || dev->have_bw :
							   f == nat && dev->have_bw;
		printf("  family %-14s %s%s\n", bd_kfamily_name(f),
		       r == 0 ? "supported on this device" : "unsupported on this device: ",
		       r == 0 ? "" : why);
		check(want ? r == 0 : r == -ENODEV, "%s: supported() %d on %d.%d",
		      bd_kfamily_name(f), r, dev->cc_major, dev->cc_minor);
		if (r == 0)
			continue;
		/* a family the device has no code for cannot be set or planned */
		struct bd_decode_plan pl;
		check(bd_decode_family_set(f) == -ENODEV, "%s: set must be -ENODEV",
		      bd_kfamily_name(f));
		check(bd_decode_plan_init_family(&pl, f, c, &lay, NULL, 1, 8, 1000, 0) == -ENODEV,
		      "%s: plan must be -ENODEV", bd_kfamily_name(f));
	}
	check(bd_decode_family_set(BD_KFAMILY_HOPPER) == 0, "set(hopper)");
	check(bd_decode_family_get() == BD_KFAMILY_HOPPER, "get after set(hopper)");
}

/* hopper in the native's place: the same kernel twice agrees exactly; perturbations do not */
static void check_selfcheck_standin(void)
{
	const struct bd_decode_select_test same = { 0, 0, true, 0.0f };
	const struct bd_decode_select_test off = { 0, 0, true, 0.5f };
	const struct bd_decode_select_test nan = { 0, 0, true, NAN };
	const int Gs[] = { 1, 4, 8 };
	char det[BD_KFAMILY_WHY_MAX];
	int r;

	for (size_t i = 0; i < N_FP4; i++)
		for (int d = 64; d <= 128; d += 64)
			for (size_t g = 0; g < 3; g++) {
				const struct bd_kvcfg *c = cfg(fp4_cfgs[i]);
				r = bd_decode_selfcheck(BD_KFAMILY_BLACKWELL_TC, c, d, Gs[g], &same,
							det, sizeof(det));
				check(r == 0 && strstr(det, "worst relative L2 0 ") &&
				      strstr(det, "|dLSE| 0 "), "stand-in self-check %s d=%d G=%d: "
				      "%d (%s)", c->name, d, Gs[g], r, det);
			}
	r = bd_decode_selfcheck(BD_KFAMILY_BLACKWELL_TC, cfg("bitdecoding-nvfp4"), 128, 4, &off,
				det, sizeof(det));
	printf("  perturbed native output: %d, %s\n", r, det);
	check(r == 1 && strstr(det, "outputs differ") && strstr(det, "request 0, head 0"),
	      "perturbed: %d (%s)", r, det);
	r = bd_decode_selfcheck(BD_KFAMILY_BLACKWELL_MMA, cfg("bitdecoding-mxfp4"), 64, 8, &nan,
				det, sizeof(det));
	check(r == 1 && strstr(det, "non-finite"), "NaN: %d (%s)", r, det);
	check(bd_decode_selfcheck(BD_KFAMILY_HOPPER, cfg("bitdecoding-nvfp4"), 96, 4, NULL, det,
				  sizeof(det)) == -EINVAL, "d = 96 must be -EINVAL");
}

/* the choice through a Blackwell capability with the stand-in */
static void check_select_standin(void)
{
	const struct bd_kvcfg *c = cfg("bitdecoding-nvfp4");
	const struct bd_layout lay = lay_of(c, 128);
	struct bd_decode_select_test t = { 10, 3, true, 0.0f };
	struct bd_kfamily_choice ch;
	int r;

	r = bd_decode_select(BD_KFAMILY_AUTO, c, &lay, 4, &t, &ch);
	printf("  auto, 10.3 stand-in, agreeing: %d, %s (%s)\n", r, bd_kfamily_name(ch.family),
	       ch.why);
	check(r == 0 && ch.family == BD_KFAMILY_BLACKWELL_TC && ch.selfcheck_result == 0 &&
	      strstr(ch.why, "passed"), "auto, passing self-check: %d %d %d (%s)", r, ch.family,
	      ch.selfcheck_result, ch.why);
	check(bd_decode_family_get() == BD_KFAMILY_HOPPER, "the stand-in is what the device runs");

	t.perturb = 0.5f;
	r = bd_decode_select(BD_KFAMILY_AUTO, c, &lay, 4, &t, &ch);
	printf("  auto, 10.3 stand-in, perturbed: %d, %s (%s)\n", r, bd_kfamily_name(ch.family),
	       ch.why);
	check(r == 0 && ch.family == BD_KFAMILY_HOPPER && ch.selfcheck_result == 1 &&
	      strstr(ch.why, "mismatch") && strstr(ch.why, "serving hopper"),
	      "auto, mismatch: %d %d %d (%s)", r, ch.family, ch.selfcheck_result, ch.why);
	check(bd_decode_family_get() == BD_KFAMILY_HOPPER, "fallback sets hopper");

	t.cc_major = 12;
	t.cc_minor = 0;
	r = bd_decode_select(BD_KFAMILY_NATIVE, c, &lay, 4, &t, &ch);
	printf("  native, 12.0 stand-in, perturbed: %d, %s (%s)\n", r, bd_kfamily_name(ch.family),
	       ch.why);
	check(r == 0 && ch.family == BD_KFAMILY_BLACKWELL_MMA && ch.selfcheck_result == 1 &&
	      strstr(ch.why, "MISMATCH"), "native, mismatch: %d %d (%s)", r, ch.family, ch.why);

	r = bd_decode_select(BD_KFAMILY_PORTABLE, c, &lay, 4, &t, &ch);
	check(r == 0 && ch.family == BD_KFAMILY_HOPPER && !ch.selfcheck &&
	      ch.selfcheck_result == 2, "portable: %d %d (%s)", r, ch.family, ch.why);

	/* BF16 pages: no native family for them, hopper without a self-check */
	const struct bd_kvcfg *bf = cfg("bf16");
	const struct bd_layout lbf = lay_of(bf, 128);
	t.perturb = 0.0f;
	r = bd_decode_select(BD_KFAMILY_AUTO, bf, &lbf, 4, &t, &ch);
	check(r == 0 && ch.family == BD_KFAMILY_HOPPER && !ch.selfcheck, "bf16: %d %d (%s)", r,
	      ch.family, ch.why);
}

/* the choice on the device as it is */
static void check_select_real(const struct bd_kfamily_device *dev)
{
	const int nat = bd_kfamily_native(dev->cc_major, dev->cc_minor);
	const bool native_here = nat >= 0 && dev->have_bw;
	struct bd_kfamily_choice ch;
	int r;

	for (size_t i = 0; i < N_FP4; i++)
		for (int d = 64; d <= 128; d += 64) {
			const struct bd_kvcfg *c = cfg(fp4_cfgs[i]);
			const struct bd_layout lay = lay_of(c, d);
			r = bd_decode_select(BD_KFAMILY_AUTO, c, &lay, 4, NULL, &ch);
			printf("  auto %-18s d=%3d: %s, self-check %s: %s\n", c->name, d,
			       bd_kfamily_name(ch.family), ch.selfcheck ? "ran" : "none", ch.why);
			if (native_here)
				check(r == 0 && ch.selfcheck && ch.selfcheck_result == 0 &&
				      (int)ch.family == nat, "%s d=%d: the native self-check "
				      "must pass (%d, %s)", c->name, d, r, ch.why);
			else
				check(r == 0 && !ch.selfcheck && ch.family == BD_KFAMILY_HOPPER,
				      "%s d=%d: hopper without self-check (%d, %s)", c->name, d, r,
				      ch.why);
			/* plans take the device's family */
			struct bd_decode_plan pl;
			check(bd_decode_plan_init(&pl, c, &lay, NULL, 1, 8, 1000, 0) == 0 &&
			      pl.family == (int)bd_decode_family_get() &&
			      pl.family == (int)ch.family,
			      "%s d=%d: plan family %d, device %d", c->name, d, pl.family,
			      bd_decode_family_get());
		}
	const struct bd_kvcfg *c = cfg("bitdecoding-nvfp4");
	const struct bd_layout lay = lay_of(c, 128);
	r = bd_decode_select(BD_KFAMILY_NATIVE, c, &lay, 4, NULL, &ch);
	printf("  native: %d (%s)\n", r, ch.why);
	if (native_here)
		check(r == 0 && (int)ch.family == nat && ch.selfcheck_result == 0,
		      "native: %d (%s)", r, ch.why);
	else
		check(r == -ENODEV && strstr(ch.why, "native"), "native must be -ENODEV: %d (%s)",
		      r, ch.why);
	if (!native_here) {
		/* taken for a B300 without the stand-in: the self-check's native kernel cannot run
		 * here, so auto falls back with the reason and native is refused */
		const struct bd_decode_select_test t = { 10, 3, false, 0.0f };
		r = bd_decode_select(BD_KFAMILY_AUTO, c, &lay, 4, &t, &ch);
		printf("  auto, 10.3 without its code: %d, %s (%s)\n", r,
		       bd_kfamily_name(ch.family), ch.why);
		check(r == 0 && ch.family == BD_KFAMILY_HOPPER && ch.selfcheck_result == -ENODEV &&
		      strstr(ch.why, "failed"), "auto, native cannot run: %d %d (%s)", r,
		      ch.selfcheck_result, ch.why);
		r = bd_decode_select(BD_KFAMILY_NATIVE, c, &lay, 4, &t, &ch);
		check(r == -ENODEV && strstr(ch.why, "cannot run"),
		      "native that cannot run must be -ENODEV: %d (%s)", r, ch.why);
	}
	const struct bd_kvcfg *f8 = cfg("fp8");
	const struct bd_layout l8 = lay_of(f8, 128);
	r = bd_decode_select(BD_KFAMILY_AUTO, f8, &l8, 4, NULL, &ch);
	printf("  fp8 pages: %d (%s)\n", r, ch.why);
	check(r == -EOPNOTSUPP && strstr(ch.why, "fp8"), "fp8: %d (%s)", r, ch.why);
	CKR(bd_decode_family_set(BD_KFAMILY_HOPPER));
}

int main(void)
{
	struct bd_kfamily_device dev;
	struct cudaDeviceProp prop;
	int n = 0;

	check_out = stderr;
	if (cudaGetDeviceCount(&n) != cudaSuccess || n < 1) {
		fprintf(stderr, "decode_select_check: no CUDA device\n");
		return 2;
	}
	CK(cudaGetDeviceProperties(&prop, 0));
	CKR(bd_decode_device(&dev));
	printf("decode_select_check on %s (compute capability %d.%d), Blackwell objects %s\n",
	       prop.name, dev.cc_major, dev.cc_minor, dev.have_bw ? "linked" : "not built");
	check(dev.cc_major == prop.major && dev.cc_minor == prop.minor, "capability %d.%d vs %d.%d",
	      dev.cc_major, dev.cc_minor, prop.major, prop.minor);
	check_table(&dev);
	check_selfcheck_standin();
	check_select_standin();
	check_select_real(&dev);
	printf("decode_select_check: %d passed, %d failed\n", n_pass, n_fail);
	return n_fail ? 1 : 0;
}
