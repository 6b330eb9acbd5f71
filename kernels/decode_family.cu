/* decode_family.cu — the decode family table of bd_kernels.h: which family each device serves
 * with, and bd_decode_plan_init / bd_decode_run dispatching to the family of a plan.
 *
 * Host code only. BD_HAVE_BW (set by the Makefile when the Blackwell objects are built):
 * the native families' launchers (bd_kernels_bw.h) are linked in; without it they are
 * reported as not built for any device (bd_kfamily_device.have_bw false).
 */
#include <atomic>
#include <errno.h>

#include <cuda_runtime.h>

#include "bd_kernels.h"
#include "bd_kernels_bw.h"

#ifndef BD_HAVE_BW
#define BD_HAVE_BW 0
#endif

namespace {

constexpr int MAX_DEVICES = 64;

/* the family of each device ordinal, hopper (0) until set */
std::atomic<int> dev_family[MAX_DEVICES];

int cuda_rc(cudaError_t e)
{
	if (e == cudaSuccess)
		return 0;
	cudaGetLastError(); /* not sticky: clear it */
	return e == cudaErrorNoDevice || e == cudaErrorInvalidDevice ||
			       e == cudaErrorInsufficientDriver ? -ENODEV : -EIO;
}

int current(int *ret_dev)
{
	int r = cuda_rc(cudaGetDevice(ret_dev));
	if (r == 0 && (*ret_dev < 0 || *ret_dev >= MAX_DEVICES))
		return -ENODEV;
	return r;
}

int prepare(enum bd_kfamily f, const struct bd_decode_plan *pl)
{
	(void)pl; /* unused without the native families */
	switch (f) {
	case BD_KFAMILY_HOPPER:
		return 0; /* bd_decode_plan_init_hopper prepared it */
#if BD_HAVE_BW
	case BD_KFAMILY_BLACKWELL_TC:
		return bd_decode_prepare_sm100(pl);
	case BD_KFAMILY_BLACKWELL_MMA:
		return bd_decode_prepare_sm120(pl);
#endif
	default:
		return -ENODEV;
	}
}

} // namespace

extern "C" int bd_decode_device(struct bd_kfamily_device *ret)
{
	int dev, r;

	if (!ret)
		return -EINVAL;
	if ((r = current(&dev)) < 0)
		return r;
	if ((r = cuda_rc(cudaDeviceGetAttribute(&ret->cc_major,
						cudaDevAttrComputeCapabilityMajor, dev))) < 0 ||
	    (r = cuda_rc(cudaDeviceGetAttribute(&ret->cc_minor,
						cudaDevAttrComputeCapabilityMinor, dev))) < 0)
		return r;
	ret->have_bw = BD_HAVE_BW;
	return 0;
}

extern "C" int bd_decode_family_supported(enum bd_kfamily f, const struct bd_kvcfg *cfg,
					  const struct bd_layout *lay, int G, char *why,
					  size_t cap)
{
	struct bd_kfamily_device dev;
	int r;

	if (!cfg || !lay)
		return -EINVAL;
	if ((r = bd_decode_device(&dev)) < 0)
		return r;
	const struct bd_kfamily_shape shape = { lay->d, lay->d_rope, G };
	return bd_kfamily_supported(f, &dev, cfg, &shape, why, cap);
}

extern "C" enum bd_kfamily bd_decode_family_get(void)
{
	int dev;

	if (current(&dev) < 0)
		return BD_KFAMILY_HOPPER;
	return (enum bd_kfamily)dev_family[dev].load();
}

extern "C" int bd_decode_family_set(enum bd_kfamily f)
{
	struct bd_kfamily_device d;
	int dev, r;

	if ((unsigned)f >= BD_KFAMILY_COUNT)
		return -EINVAL;
	if ((r = current(&dev)) < 0 || (r = bd_decode_device(&d)) < 0)
		return r;
	/* the device check alone: a configuration every family serves */
	const struct bd_kfamily_shape shape = { 128, 0, 1 };
	if ((r = bd_kfamily_supported(f, &d, bd_kvcfg_get(BD_KVCFG_BITDECODING_NVFP4), &shape,
				      NULL, 0)) < 0)
		return r;
	dev_family[dev].store((int)f);
	return 0;
}

extern "C" int bd_decode_plan_init_family(struct bd_decode_plan *ret, enum bd_kfamily f,
					  const struct bd_kvcfg *cfg, const struct bd_layout *lay,
					  const struct bd_decode_params *dp, int B, int Hq,
					  int max_tokens, int n_splits)
{
	struct bd_decode_plan pl;
	int r;

	if (!ret || !cfg || !lay || (unsigned)f >= BD_KFAMILY_COUNT || lay->n_kv_heads < 1 ||
	    Hq < 1 || Hq % lay->n_kv_heads)
		return -EINVAL;
	if ((r = bd_decode_family_supported(f, cfg, lay, Hq / lay->n_kv_heads, NULL, 0)) < 0)
		return r;
	if ((r = bd_decode_plan_init_hopper(&pl, cfg, lay, dp, B, Hq, max_tokens, n_splits)) < 0)
		return r;
	pl.family = f;
	if ((r = prepare(f, &pl)) < 0)
		return r;
	*ret = pl;
	return 0;
}

extern "C" int bd_decode_plan_init(struct bd_decode_plan *ret, const struct bd_kvcfg *cfg,
				   const struct bd_layout *lay, const struct bd_decode_params *dp,
				   int B, int Hq, int max_tokens, int n_splits)
{
	return bd_decode_plan_init_family(ret, bd_decode_family_get(), cfg, lay, dp, B, Hq,
					  max_tokens, n_splits);
}

extern "C" int bd_decode_run(const struct bd_decode_plan *plan, const struct bd_decode_args *args,
			     void *stream)
{
	if (!plan)
		return -EINVAL;
	switch (plan->family) {
	case BD_KFAMILY_HOPPER:
		return bd_decode_run_hopper(plan, args, stream);
#if BD_HAVE_BW
	case BD_KFAMILY_BLACKWELL_TC:
		return bd_decode_run_sm100(plan, args, stream);
	case BD_KFAMILY_BLACKWELL_MMA:
		return bd_decode_run_sm120(plan, args, stream);
#endif
	default:
		return -EINVAL;
	}
}
