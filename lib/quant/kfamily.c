/* kfamily.c — the decode kernel families and the start-up choice among them (bd_kfamily.h). */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "base/bd_err.h"
#include "quant/bd_kfamily.h"

static const char *const names[BD_KFAMILY_COUNT] = {
	[BD_KFAMILY_HOPPER] = "hopper",
	[BD_KFAMILY_BLACKWELL_TC] = "blackwell-tc",
	[BD_KFAMILY_BLACKWELL_MMA] = "blackwell-mma",
};

static const char *const modes[] = {
	[BD_KFAMILY_AUTO] = "auto",
	[BD_KFAMILY_NATIVE] = "native",
	[BD_KFAMILY_PORTABLE] = "portable",
};

const char *bd_kfamily_name(enum bd_kfamily f)
{
	return (unsigned)f < BD_KFAMILY_COUNT ? names[f] : NULL;
}

int bd_kfamily_mode_parse(const char *s, enum bd_kfamily_mode *ret)
{
	if (!s || !ret)
		return -EINVAL;
	for (size_t i = 0; i < sizeof(modes) / sizeof(modes[0]); i++) {
		if (!strcmp(s, modes[i])) {
			*ret = (enum bd_kfamily_mode)i;
			return 0;
		}
	}
	return -EINVAL;
}

int bd_kfamily_native(int cc_major, int cc_minor)
{
	if (cc_major == 10 && (cc_minor == 0 || cc_minor == 3))
		return BD_KFAMILY_BLACKWELL_TC;
	if (cc_major == 12 && cc_minor == 0)
		return BD_KFAMILY_BLACKWELL_MMA;
	return -1;
}

/* The code of family f exists for the device: an "a" target runs on its own capability only */
static int device_ok(enum bd_kfamily f, const struct bd_kfamily_device *dev, char *why,
		     size_t cap)
{
	const int M = dev->cc_major, m = dev->cc_minor;
	const bool bw_cc = bd_kfamily_native(M, m) >= 0;

	if (f == BD_KFAMILY_HOPPER) {
		if (M == 9 && m == 0)
			return 0;
		if (bw_cc && dev->have_bw)
			return 0;
		if (bw_cc)
			return bd_errf(why, cap, -ENODEV, "compute capability %d.%d: this build has "
				   "no Blackwell code (built with GENCODE_BW empty: sm_90a only)",
				   M, m);
		return bd_errf(why, cap, -ENODEV, "compute capability %d.%d: no decode kernel of this "
			   "build runs on it (sm_90a, sm_100a, sm_103a, sm_120a only)", M, m);
	}
	if (bd_kfamily_native(M, m) != (int)f)
		return bd_errf(why, cap, -ENODEV, "%s runs on compute capability %s only, this device "
			   "is %d.%d", names[f], f == BD_KFAMILY_BLACKWELL_TC ? "10.0 and 10.3" :
			   "12.0", M, m);
	if (!dev->have_bw)
		return bd_errf(why, cap, -ENODEV, "%s: this build has no Blackwell code (built with "
			   "GENCODE_BW empty)", names[f]);
	return 0;
}

static int shape_ok(enum bd_kfamily f, const struct bd_kvcfg *cfg,
		    const struct bd_kfamily_shape *s, char *why, size_t cap)
{
	const char *fn = names[f], *cn = cfg->name ? cfg->name : "?";
	const bool fp4q = cfg->query_terms == 1 || cfg->query_terms == 2;

	if (s->d_rope != 0)
		return bd_errf(why, cap, -EOPNOTSUPP, "%s: no MLA layouts (d_rope %d)", fn, s->d_rope);
	if (s->d != 64 && s->d != 128)
		return bd_errf(why, cap, -EOPNOTSUPP, "%s: head dimension %d (64 or 128 only)", fn,
			   s->d);
	if (s->G < 1 || s->G > 8)
		return bd_errf(why, cap, -EOPNOTSUPP, "%s: %d query heads per KV head (1 to 8 only)",
			   fn, s->G);
	switch (cfg->page_fmt) {
	case BD_PAGE_NVFP4:
		if (fp4q &&
		    (cfg->p_quant == BD_P_NVFP4_MAX6 || cfg->p_quant == BD_P_NVFP4_UNDERFLOW))
			return 0;
		break;
	case BD_PAGE_MXFP4:
		if (fp4q && cfg->p_quant == BD_P_MXFP4)
			return 0;
		break;
	case BD_PAGE_BF16:
		if (f == BD_KFAMILY_HOPPER && cfg->p_quant == BD_P_FP32)
			return 0;
		break;
	case BD_PAGE_NVFP4_CH:
		if (f == BD_KFAMILY_HOPPER && cfg->p_quant == BD_P_FP32 && !cfg->sink)
			return 0;
		break;
	default:
		break;
	}
	return bd_errf(why, cap, -EOPNOTSUPP, "%s does not implement the KV configuration '%s'", fn,
		   cn);
}

int bd_kfamily_supported(enum bd_kfamily f, const struct bd_kfamily_device *dev,
			 const struct bd_kvcfg *cfg, const struct bd_kfamily_shape *shape,
			 char *why, size_t cap)
{
	int r;

	if ((unsigned)f >= BD_KFAMILY_COUNT || !dev || !cfg || !shape)
		return bd_errf(why, cap, -EINVAL, "bad argument");
	if ((r = device_ok(f, dev, why, cap)) < 0)
		return r;
	return shape_ok(f, cfg, shape, why, cap);
}

int bd_kfamily_choose(enum bd_kfamily_mode mode, const struct bd_kfamily_device *dev,
		      const struct bd_kvcfg *cfg, const struct bd_kfamily_shape *shape,
		      struct bd_kfamily_choice *ret)
{
	char nwhy[BD_KFAMILY_WHY_MAX] = "";
	int r, nat;

	if (!ret || !dev || !cfg || !shape || (unsigned)mode > BD_KFAMILY_PORTABLE)
		return -EINVAL;
	memset(ret, 0, sizeof(*ret));
	ret->mode = mode;
	ret->family = BD_KFAMILY_HOPPER;
	ret->selfcheck_result = 2;
	nat = bd_kfamily_native(dev->cc_major, dev->cc_minor);
	/* the native family of this device, when it can serve this build and shape */
	if (nat >= 0 && bd_kfamily_supported(nat, dev, cfg, shape, nwhy, sizeof(nwhy)) < 0)
		nat = -1;
	else if (nat < 0)
		snprintf(nwhy, sizeof(nwhy), "compute capability %d.%d has no native FP4 family",
			 dev->cc_major, dev->cc_minor);
	ret->native = nat;
	if (mode == BD_KFAMILY_NATIVE) {
		if (nat < 0) {
			r = bd_kfamily_native(dev->cc_major, dev->cc_minor) >= 0 ? -EOPNOTSUPP :
										  -ENODEV;
			return bd_errf(ret->why, sizeof(ret->why), r, "decode kernel 'native': %s",
				   nwhy);
		}
		ret->family = nat;
		ret->selfcheck = true;
		bd_errf(ret->why, sizeof(ret->why), 0, "native forced");
		return 0;
	}
	/* portable, and auto's fallback: the hopper family must serve */
	r = bd_kfamily_supported(BD_KFAMILY_HOPPER, dev, cfg, shape, ret->why, sizeof(ret->why));
	if (r < 0)
		return r; /* a native family supports a subset of what hopper does */
	if (mode == BD_KFAMILY_PORTABLE)
		return bd_errf(ret->why, sizeof(ret->why), 0, "portable forced");
	if (nat < 0)
		return bd_errf(ret->why, sizeof(ret->why), 0, "%s", nwhy);
	ret->selfcheck = true;
	return bd_errf(ret->why, sizeof(ret->why), 0, "%s pending its self-check", names[nat]);
}

int bd_kfamily_finish(struct bd_kfamily_choice *c, int result, const char *detail)
{
	if (!c || result > 1)
		return -EINVAL;
	if (!c->selfcheck)
		return 0;
	if (c->native < 0)
		return -EINVAL;
	c->selfcheck_result = result;
	if (!detail || !*detail)
		detail = result == 0 ? "outputs agree" : "no detail";
	if (c->mode == BD_KFAMILY_NATIVE) {
		c->family = c->native;
		if (result < 0)
			return bd_errf(c->why, sizeof(c->why), result, "decode kernel 'native': %s "
				   "cannot run: %s", names[c->native], detail);
		return bd_errf(c->why, sizeof(c->why), 0, "native forced; self-check %s: %s",
			   result == 0 ? "passed" : "MISMATCH", detail);
	}
	if (result == 0) {
		c->family = c->native;
		return bd_errf(c->why, sizeof(c->why), 0, "self-check against hopper passed: %s",
			   detail);
	}
	c->family = BD_KFAMILY_HOPPER;
	return bd_errf(c->why, sizeof(c->why), 0, "%s self-check %s, serving hopper: %s",
		   names[c->native], result == 1 ? "mismatch" : "failed", detail);
}
