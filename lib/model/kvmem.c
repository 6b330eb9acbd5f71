/* kvmem.c — KV memory behind struct bd_kvmem_ops: the private in-process arena and memory
 * allocated by someone else (bd_kvmem.h). */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "model/bd_kvmem.h"

/* ---- the private arena --------------------------------------------------------------------- */

/* The kvmem and its page map in one allocation (priv points back at it). */
struct private_mem {
	struct bd_kvmem mem;
	uint8_t used[]; /* [n_pages] */
};

static int priv_page_alloc(struct bd_kvmem *mem, int32_t *ret_page)
{
	struct private_mem *pm = mem->priv;
	for (size_t p = 0; p < mem->lay.n_pages && p <= INT32_MAX; p++) {
		if (!pm->used[p]) {
			pm->used[p] = 1;
			*ret_page = (int32_t)p;
			return 0;
		}
	}
	return -ENOSPC;
}

static void priv_page_free(struct bd_kvmem *mem, int32_t page)
{
	struct private_mem *pm = mem->priv;
	if (page >= 0 && (size_t)page < mem->lay.n_pages)
		pm->used[page] = 0;
}

static int priv_slot_alloc(struct bd_kvmem *mem, void **ret_slot)
{
	void *s = aligned_alloc(BD_PAGE_ALIGN, mem->lay.slot_bytes);
	if (!s)
		return -ENOMEM;
	memset(s, 0, mem->lay.slot_bytes);
	*ret_slot = s;
	return 0;
}

static void priv_slot_free(struct bd_kvmem *mem, void *slot)
{
	(void)mem;
	free(slot);
}

static const struct bd_kvmem_ops private_ops = {
	.page_alloc = priv_page_alloc,
	.page_free = priv_page_free,
	.slot_alloc = priv_slot_alloc,
	.slot_free = priv_slot_free,
};

int bd_kvmem_private_new(const struct bd_layout *lay, struct bd_kvmem **ret)
{
	if (!lay || !ret || lay->n_pages < 1 || lay->arena_bytes == 0 ||
	    lay->arena_bytes % BD_PAGE_ALIGN != 0)
		return -EINVAL;
	struct private_mem *pm = lay->n_pages < SIZE_MAX - sizeof(*pm)
		? calloc(1, sizeof(*pm) + lay->n_pages) : NULL;
	if (!pm)
		return -ENOMEM;
	struct bd_kvmem *mem = &pm->mem;
	if (!(mem->arena = aligned_alloc(BD_PAGE_ALIGN, lay->arena_bytes))) {
		free(pm);
		return -ENOMEM;
	}
	memset(mem->arena, 0, lay->arena_bytes);
	mem->ops = &private_ops;
	mem->lay = *lay;
	mem->priv = pm;
	*ret = mem;
	return 0;
}

void bd_kvmem_private_free(struct bd_kvmem *mem)
{
	if (!mem)
		return;
	free(mem->arena);
	free(mem->priv);
}

/* ---- memory allocated by someone else ------------------------------------------------------ */

/* The router owns allocation; the step plan names the slot and pages, the worker queues them
 * here, and the sequence draws them as it goes. */
struct ext_mem {
	struct bd_kvmem mem; /* priv points back at this */
	uint8_t *slots;
	size_t n_slots;
	int32_t slot;        /* queued slot id, −1 none */
	int n_queued, next;  /* queue[next .. n_queued) not drawn yet */
	int32_t queue[BD_KVMEM_EXT_MAX_QUEUE]; /* queued page ids */
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
	struct ext_mem *e = calloc(1, sizeof(*e));
	if (!e)
		return -ENOMEM;
	e->slots = slots;
	e->n_slots = n_slots;
	e->slot = -1;
	e->mem.ops = &ext_ops;
	e->mem.lay = *lay;
	e->mem.arena = pages;
	e->mem.priv = e;
	*ret = &e->mem;
	return 0;
}

void bd_kvmem_ext_free(struct bd_kvmem *mem)
{
	if (mem)
		free(mem->priv);
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
