/* kvmem_pool.c — KV memory over the kvpoold arena a worker attached (bd_kvmem_pool.h). */
#include <errno.h>

#include "pool/bd_kvmem_pool.h"

int bd_kvmem_pool_new(const struct bd_pool_attach *a, struct bd_kvmem **ret)
{
	if (!a || !ret)
		return -EINVAL;
	const struct bd_pool_geometry *g = bd_pool_attach_geometry(a);
	void *pages = bd_pool_attach_pages(a), *slots = bd_pool_attach_slot(a, 0);
	if (!g || !pages || !slots)
		return -EINVAL;
	return bd_kvmem_ext_new(&g->layout, pages, slots, g->n_slots, ret);
}
