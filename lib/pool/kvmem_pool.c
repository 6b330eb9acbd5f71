/* kvmem_pool.c — a bd_kvmem over memory someone else allocates: the kvpoold arena a worker
 * attached (bd_model.h). The router owns allocation; the step plan names the slot and
 * pages, the worker queues them here, and the sequence draws them as it goes. */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "model/bd_model.h"
#include "pool/bd_pool_client.h"

struct ext_mem {
	uint8_t *slots;
	size_t n_slots;
	int32_t slot;      /* queued slot id, −1 none */
	int32_t *queue;    /* [BD_KVMEM_EXT_MAX_QUEUE] queued page ids */
	int n_queued, next; /* queue[next .. n_queued) not drawn yet */
};

static int ext_page_alloc(struct bd_kvmem *mem, int32_t *ret_page)
{
	struct ext_mem *e = mem->priv;
	if (e->next >= e->n_queued)
		return -ENOSPC;
	*ret_page = e->queue[e->next++];
	return 0;
}

static void ext_page_free(struct bd_kvmem *mem, int32_t page)
{
	(void)mem;
	(void)page; /* the router gives pages back to kvpoold */
}

static int ext_slot_alloc(struct bd_kvmem *mem, void **ret_slot)
{
	struct ext_mem *e = mem->priv;
	if (e->slot < 0)
		return -ENOSPC;
	*ret_slot = e->slots + (size_t)e->slot * mem->lay.slot_bytes;
	e->slot = -1;
	return 0;
}

static void ext_slot_free(struct bd_kvmem *mem, void *slot)
{
	(void)mem;
	(void)slot;
}

static const struct bd_kvmem_ops ext_ops = {
	.page_alloc = ext_page_alloc,
	.page_free = ext_page_free,
	.slot_alloc = ext_slot_alloc,
	.slot_free = ext_slot_free,
};

int bd_kvmem_ext_new(const struct bd_layout *lay, void *pages, void *slots, size_t n_slots,
		     struct bd_kvmem **ret)
{
	if (!lay || !pages || !slots || !ret || n_slots < 1 || n_slots > INT32_MAX ||
	    lay->n_pages < 1 || lay->slot_bytes == 0)
		return -EINVAL;
	struct bd_kvmem *mem = calloc(1, sizeof(*mem));
	struct ext_mem *e = calloc(1, sizeof(*e));
	int32_t *q = calloc(BD_KVMEM_EXT_MAX_QUEUE, sizeof(*q));
	if (!mem || !e || !q) {
		free(mem);
		free(e);
		free(q);
		return -ENOMEM;
	}
	e->slots = slots;
	e->n_slots = n_slots;
	e->slot = -1;
	e->queue = q;
	mem->ops = &ext_ops;
	mem->lay = *lay;
	mem->arena = pages;
	mem->priv = e;
	*ret = mem;
	return 0;
}

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

void bd_kvmem_ext_free(struct bd_kvmem *mem)
{
	if (!mem)
		return;
	struct ext_mem *e = mem->priv;
	if (e)
		free(e->queue);
	free(e);
	free(mem);
}

int bd_kvmem_ext_provide(struct bd_kvmem *mem, int32_t slot, const int32_t *pages, int n)
{
	if (!mem || mem->ops != &ext_ops || n < 0 || n > BD_KVMEM_EXT_MAX_QUEUE ||
	    (n > 0 && !pages))
		return -EINVAL;
	struct ext_mem *e = mem->priv;
	if (slot < -1 || (slot >= 0 && (size_t)slot >= e->n_slots))
		return -ERANGE;
	for (int i = 0; i < n; i++)
		if (pages[i] < 0 || (size_t)pages[i] >= mem->lay.n_pages)
			return -ERANGE;
	if (n > 0)
		memcpy(e->queue, pages, sizeof(*pages) * (size_t)n);
	e->n_queued = n;
	e->next = 0;
	e->slot = slot;
	return 0;
}

int bd_kvmem_ext_pending(const struct bd_kvmem *mem)
{
	if (!mem || mem->ops != &ext_ops)
		return -EINVAL;
	const struct ext_mem *e = mem->priv;
	return e->n_queued - e->next;
}

int32_t bd_kvmem_ext_slot_id(const struct bd_kvmem *mem, const void *slot)
{
	if (!mem || mem->ops != &ext_ops || !slot)
		return -1;
	const struct ext_mem *e = mem->priv;
	const uint8_t *p = slot;
	if (p < e->slots)
		return -1;
	size_t off = (size_t)(p - e->slots);
	if (off % mem->lay.slot_bytes != 0 || off / mem->lay.slot_bytes >= e->n_slots)
		return -1;
	return (int32_t)(off / mem->lay.slot_bytes);
}
