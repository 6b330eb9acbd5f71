/* bd_kvmem.h — KV memory: where a sequence (bd_seq.h) gets its FP4 pages and its BF16 slot.
 *
 * A bd_kvmem is an arena of pages laid out by a struct bd_layout (bd_layout.h: page p of layer
 * l at arena + l·layer_stride + p·page_bytes) and a source of slots of lay.slot_bytes, behind a
 * table of operations ("give me a page id / slot memory"). Two implementations live here: a
 * private in-process arena (a sequence of its own, tests, the tools), and "ext" memory that
 * someone else allocates (the router allocates through kvpoold and names the slot and pages in
 * each step plan; the worker queues them and the sequence draws them). The kvpoold arena a
 * worker attached is ext memory too (bd_kvmem_pool.h).
 */
#ifndef BD_KVMEM_H
#define BD_KVMEM_H

#include <stddef.h>
#include <stdint.h>

#include "quant/bd_layout.h"

#ifdef __cplusplus
extern "C" {
#endif

struct bd_kvmem;

/* The allocator a sequence draws its pages and slot from. Pages index the arena laid out by
 * the kvmem's lay (bd_layout_page); a slot is lay.slot_bytes. */
struct bd_kvmem_ops {
	int (*page_alloc)(struct bd_kvmem *mem, int32_t *ret_page); /* 0 or -ENOSPC */
	void (*page_free)(struct bd_kvmem *mem, int32_t page);
	int (*slot_alloc)(struct bd_kvmem *mem, void **ret_slot);   /* 0 or -ENOMEM/-ENOSPC */
	void (*slot_free)(struct bd_kvmem *mem, void *slot);
};

struct bd_kvmem {
	const struct bd_kvmem_ops *ops;
	struct bd_layout lay; /* geometry of the arena and of every slot */
	void *arena;          /* lay.arena_bytes */
	void *priv;           /* the implementation's state */
};

/* ---- the private arena --------------------------------------------------------------------- */

/* A private in-process arena of lay->n_pages pages (allocated zeroed, 256-byte aligned) and
 * heap slots (zeroed). Pages are handed out lowest free id first. Returns 0, -EINVAL (NULL, no
 * pages, an arena size that is 0 or not a multiple of BD_PAGE_ALIGN), -ENOMEM. Free with
 * bd_kvmem_private_free() once every sequence using it is freed. */
int bd_kvmem_private_new(const struct bd_layout *lay, struct bd_kvmem **ret);

/* Frees a private kvmem and its arena. NULL is a no-op. */
void bd_kvmem_private_free(struct bd_kvmem *mem);

/* ---- memory allocated by someone else ------------------------------------------------------ */

/* KV memory allocated by someone else, which a worker only reads and writes. pages: an arena
 * laid out by lay (lay->n_pages pages); slots: n_slots slots of lay->slot_bytes back to back.
 * The memory is not owned and must outlive the kvmem. What a sequence draws is what was
 * queued before the call that draws it (bd_kvmem_ext_provide: the slot bd_seq_new takes, the
 * pages its promotions take, in order); freeing gives nothing back (the allocator's owner
 * releases). Not thread-safe: queue and draw from one thread.
 * Returns 0, -EINVAL (NULL, n_slots < 1, a layout without pages), -ENOMEM. */
int bd_kvmem_ext_new(const struct bd_layout *lay, void *pages, void *slots, size_t n_slots,
		     struct bd_kvmem **ret);

/* Frees an ext kvmem (not the memory it points at). NULL is a no-op. */
void bd_kvmem_ext_free(struct bd_kvmem *mem);

#define BD_KVMEM_EXT_MAX_QUEUE 4096 /* pages one provide call may queue */

/* Queue slot id `slot` (−1: none) for the next slot_alloc and pages[0..n) for the next n
 * page_allocs, replacing what was queued and not drawn. Returns 0, -EINVAL (NULL, not an ext
 * kvmem, n outside 0..BD_KVMEM_EXT_MAX_QUEUE, pages NULL with n > 0), -ERANGE (an id outside
 * the arena: nothing is queued). A draw with nothing queued fails with -ENOSPC. */
int bd_kvmem_ext_provide(struct bd_kvmem *mem, int32_t slot, const int32_t *pages, int n);

/* Queued pages not drawn yet (a plan that named more pages than its promotions used), or
 * -EINVAL (NULL, not an ext kvmem). */
int bd_kvmem_ext_pending(const struct bd_kvmem *mem);

/* The id of a slot pointer of this kvmem, or -1 (NULL, not an ext kvmem, not one of its
 * slots). */
int32_t bd_kvmem_ext_slot_id(const struct bd_kvmem *mem, const void *slot);

#ifdef __cplusplus
}
#endif
#endif
