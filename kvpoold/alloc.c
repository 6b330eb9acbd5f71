/* alloc.c — kvpoold's page, slot and request bookkeeping (kvpool.h).
 *
 * Pages: a state and a refcount each, a LIFO free stack (fresh pools hand out 0, 1, 2, ...).
 * Requests: an open-addressing table (linear probing, backward-shift deletion) of records, each
 * with its page references as a sorted array. Every operation validates first, then applies,
 * so an error leaves the pool untouched; the only allocation an operation makes (a record or
 * a larger page array) happens before the first change.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpool.h"

/* PAGE_IDLE: a page of the prefix index that no request holds; it counts as free capacity and
 * goes back to the free stack (least recently used first) only when an allocation needs it */
enum { PAGE_FREE = 0, PAGE_RESERVED = 1, PAGE_USED = 2, PAGE_IDLE = 3 };

struct req {
	uint64_t id, owner;
	int32_t *pages; /* sorted page references */
	uint32_t n_pages, cap;
	int32_t reserved; /* -1: none */
	int32_t slot;     /* -1: none */
};

struct bd_kvpool_alloc {
	size_t n_pages, n_slots, max_requests;
	uint32_t max_ppr;

	uint8_t *state;
	uint32_t *ref;
	uint8_t *mark; /* scratch, all zero between operations */
	int32_t *free_pages;
	size_t n_free;

	uint64_t *slot_holder; /* request id, 0: free */
	int32_t *free_slots;
	size_t n_free_slots;

	struct req **tab; /* power-of-two size ≥ 2·max_requests */
	size_t tab_mask, n_reqs;

	uint64_t changes; /* operations that changed the pool */

	/* the prefix index (bd_kvpool_prefix_*): hash[p] ≠ 0 for an indexed page; idx an
	 * open-addressing table of page ids (-1: empty) keyed by hash[p]; the idle pages in a
	 * list from least (lru_head) to most recently released */
	uint64_t *hash;
	int32_t *idx;
	size_t idx_mask, n_cached;
	int32_t *lru_prev, *lru_next, lru_head, lru_tail;
	size_t n_idle;
	struct bd_kvpool_prefix_counts pc;
	bd_kvpool_cache_fn cache_fn;
	void *cache_ctx;

	struct bd_kvpool_quota quota;  /* per owner; 0: no limit */
	bd_kvpool_scrub_fn scrub;      /* told of each page and slot that becomes free */
	void *scrub_ctx;

	char err[200];
};

static int fail(struct bd_kvpool_alloc *a, int code, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

static int fail(struct bd_kvpool_alloc *a, int code, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(a->err, sizeof(a->err), fmt, ap);
	va_end(ap);
	return -code;
}

static int ok(struct bd_kvpool_alloc *a)
{
	a->err[0] = 0;
	return 0;
}

/* ok() of an operation that changed the pool */
static int changed(struct bd_kvpool_alloc *a)
{
	a->changes++;
	return ok(a);
}

/* Every page and slot free, no record: the stacks as a fresh pool has them. */
static void reset(struct bd_kvpool_alloc *a)
{
	for (size_t i = 0; i <= a->tab_mask; i++)
		if (a->tab[i]) {
			free(a->tab[i]->pages);
			free(a->tab[i]);
			a->tab[i] = NULL;
		}
	a->n_reqs = 0;
	memset(a->state, PAGE_FREE, a->n_pages);
	memset(a->ref, 0, a->n_pages * sizeof(*a->ref));
	memset(a->mark, 0, a->n_pages);
	/* the top of the stack is the lowest id */
	for (size_t i = 0; i < a->n_pages; i++)
		a->free_pages[i] = (int32_t)(a->n_pages - 1 - i);
	a->n_free = a->n_pages;
	memset(a->hash, 0, a->n_pages * sizeof(*a->hash));
	for (size_t i = 0; i <= a->idx_mask; i++)
		a->idx[i] = -1;
	a->n_cached = a->n_idle = 0;
	a->lru_head = a->lru_tail = -1;
	memset(a->slot_holder, 0, (a->n_slots ? a->n_slots : 1) * sizeof(uint64_t));
	for (size_t i = 0; i < a->n_slots; i++)
		a->free_slots[i] = (int32_t)(a->n_slots - 1 - i);
	a->n_free_slots = a->n_slots;
}

int bd_kvpool_alloc_new(size_t n_pages, size_t n_slots, uint32_t max_pages_per_request,
			size_t max_requests, struct bd_kvpool_alloc **ret)
{
	struct bd_kvpool_alloc *a;
	size_t tab = 16;

	if (!ret || n_pages < 1 || n_pages > INT32_MAX || n_slots > INT32_MAX ||
	    max_pages_per_request < 1 || max_requests < 1 || max_requests > (1u << 24))
		return -EINVAL;
	while (tab < 2 * max_requests)
		tab *= 2;
	a = calloc(1, sizeof(*a));
	if (!a)
		return -ENOMEM;
	a->n_pages = n_pages;
	a->n_slots = n_slots;
	a->max_requests = max_requests;
	a->max_ppr = max_pages_per_request;
	a->state = calloc(n_pages, 1);
	a->ref = calloc(n_pages, sizeof(*a->ref));
	a->mark = calloc(n_pages, 1);
	a->free_pages = malloc(n_pages * sizeof(int32_t));
	a->slot_holder = calloc(n_slots ? n_slots : 1, sizeof(uint64_t));
	a->free_slots = malloc((n_slots ? n_slots : 1) * sizeof(int32_t));
	a->tab = calloc(tab, sizeof(*a->tab));
	a->tab_mask = tab - 1;
	for (tab = 16; tab < 2 * n_pages; tab *= 2)
		;
	a->hash = calloc(n_pages, sizeof(*a->hash));
	a->idx = malloc(tab * sizeof(*a->idx));
	a->idx_mask = tab - 1;
	a->lru_prev = malloc(n_pages * sizeof(int32_t));
	a->lru_next = malloc(n_pages * sizeof(int32_t));
	if (!a->state || !a->ref || !a->mark || !a->free_pages || !a->slot_holder ||
	    !a->free_slots || !a->tab || !a->hash || !a->idx || !a->lru_prev || !a->lru_next) {
		bd_kvpool_alloc_free(a);
		return -ENOMEM;
	}
	reset(a);
	*ret = a;
	return 0;
}

void bd_kvpool_alloc_free(struct bd_kvpool_alloc *a)
{
	if (!a)
		return;
	if (a->tab)
		for (size_t i = 0; i <= a->tab_mask; i++)
			if (a->tab[i]) {
				free(a->tab[i]->pages);
				free(a->tab[i]);
			}
	free(a->tab);
	free(a->state);
	free(a->ref);
	free(a->mark);
	free(a->free_pages);
	free(a->slot_holder);
	free(a->free_slots);
	free(a->hash);
	free(a->idx);
	free(a->lru_prev);
	free(a->lru_next);
	free(a);
}

const char *bd_kvpool_alloc_error(const struct bd_kvpool_alloc *a)
{
	return a ? a->err : "";
}

void bd_kvpool_alloc_set_quota(struct bd_kvpool_alloc *a, const struct bd_kvpool_quota *q)
{
	if (a)
		a->quota = q ? *q : (struct bd_kvpool_quota){ 0 };
}

void bd_kvpool_alloc_set_scrub(struct bd_kvpool_alloc *a, bd_kvpool_scrub_fn fn, void *ctx)
{
	if (!a)
		return;
	a->scrub = fn;
	a->scrub_ctx = ctx;
}

void bd_kvpool_alloc_set_cache_hook(struct bd_kvpool_alloc *a, bd_kvpool_cache_fn fn, void *ctx)
{
	if (!a)
		return;
	a->cache_fn = fn;
	a->cache_ctx = ctx;
}

/* ---- request table ---------------------------------------------------------------------- */

static size_t hash64(uint64_t x)
{
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdull;
	x ^= x >> 33;
	return (size_t)x;
}

static struct req *lookup(const struct bd_kvpool_alloc *a, uint64_t id)
{
	for (size_t i = hash64(id) & a->tab_mask;; i = (i + 1) & a->tab_mask) {
		if (!a->tab[i])
			return NULL;
		if (a->tab[i]->id == id)
			return a->tab[i];
	}
}

/* What owner holds now: page references (reserved ones included), slots, records. */
struct owner_use {
	size_t pages, slots, requests;
};

static struct owner_use owner_use(const struct bd_kvpool_alloc *a, uint64_t owner)
{
	struct owner_use u = { 0 };

	for (size_t i = 0; i <= a->tab_mask; i++) {
		const struct req *r = a->tab[i];

		if (r && r->owner == owner) {
			u.pages += r->n_pages;
			u.slots += r->slot >= 0;
			u.requests++;
		}
	}
	return u;
}

static void insert(struct bd_kvpool_alloc *a, struct req *r)
{
	size_t i = hash64(r->id) & a->tab_mask;

	while (a->tab[i])
		i = (i + 1) & a->tab_mask;
	a->tab[i] = r;
	a->n_reqs++;
}

static void remove_req(struct bd_kvpool_alloc *a, struct req *r)
{
	size_t i = hash64(r->id) & a->tab_mask;

	while (a->tab[i] != r)
		i = (i + 1) & a->tab_mask;
	a->tab[i] = NULL;
	/* backward shift: move later entries of the cluster into the hole when their home
	 * slot is not between the hole and them */
	for (size_t j = (i + 1) & a->tab_mask; a->tab[j]; j = (j + 1) & a->tab_mask) {
		size_t home = hash64(a->tab[j]->id) & a->tab_mask;

		if (((j - home) & a->tab_mask) >= ((j - i) & a->tab_mask)) {
			a->tab[i] = a->tab[j];
			a->tab[j] = NULL;
			i = j;
		}
	}
	a->n_reqs--;
	free(r->pages);
	free(r);
}

/* The record of id, created under owner when absent (not inserted yet: *fresh says so, the
 * caller inserts it once nothing can fail any more). */
static int get_req(struct bd_kvpool_alloc *a, uint64_t id, uint64_t owner, struct req **ret,
		   bool *fresh)
{
	struct req *r;

	*fresh = false;
	if (id == 0)
		return fail(a, BD_POOL_ERR_INVALID, "request id 0 is reserved");
	r = lookup(a, id);
	if (r) {
		if (r->owner != owner)
			return fail(a, BD_POOL_ERR_OWNER,
				    "request %llu belongs to owner %llu, not %llu",
				    (unsigned long long)id, (unsigned long long)r->owner,
				    (unsigned long long)owner);
		*ret = r;
		return 0;
	}
	if (a->quota.requests && owner_use(a, owner).requests >= a->quota.requests)
		return fail(a, BD_POOL_ERR_QUOTA,
			    "owner %llu holds %zu request records, its quota (owner_max_requests)",
			    (unsigned long long)owner, a->quota.requests);
	if (a->n_reqs >= a->max_requests)
		return fail(a, BD_POOL_ERR_EXHAUSTED, "all %zu request records are in use",
			    a->max_requests);
	r = calloc(1, sizeof(*r));
	if (!r)
		return fail(a, BD_POOL_ERR_EXHAUSTED, "out of memory for a request record");
	r->id = id;
	r->owner = owner;
	r->reserved = -1;
	r->slot = -1;
	*fresh = true;
	*ret = r;
	return 0;
}

static void drop_fresh(struct req *r, bool fresh)
{
	if (fresh) {
		free(r->pages);
		free(r);
	}
}

/* The record of id, which must exist. */
static int find_known(struct bd_kvpool_alloc *a, uint64_t id, struct req **ret)
{
	if (!a)
		return -BD_POOL_ERR_INVALID;
	if (id == 0)
		return fail(a, BD_POOL_ERR_INVALID, "request id 0 is reserved");
	*ret = lookup(a, id);
	if (!*ret)
		return fail(a, BD_POOL_ERR_UNKNOWN_REQUEST, "unknown request %llu",
			    (unsigned long long)id);
	return 0;
}

/* id (a page or a slot) in 0..n-1, else POOL_ERR_RANGE */
static int in_range(struct bd_kvpool_alloc *a, const char *what, int32_t id, size_t n)
{
	if (id >= 0 && (size_t)id < n)
		return 0;
	return fail(a, BD_POOL_ERR_RANGE, "%s %d is outside 0..%zu", what, id, n ? n - 1 : 0);
}

/* find_known, then in_range for the page or slot the call names (what, id, n as in_range) */
static int find_known_with(struct bd_kvpool_alloc *a, uint64_t req, const char *what,
			   int32_t id, size_t n, struct req **ret)
{
	int e = find_known(a, req, ret);

	return e < 0 ? e : in_range(a, what, id, n);
}

/* n pages in one operation: 1..max pages per request, else POOL_ERR_RANGE */
static int count_in_range(struct bd_kvpool_alloc *a, size_t n)
{
	if (n >= 1 && n <= a->max_ppr)
		return 0;
	return fail(a, BD_POOL_ERR_RANGE, "page count %zu is outside 1..%u", n, a->max_ppr);
}

/* r may take n more page references, else POOL_ERR_RANGE */
static int under_limit(struct bd_kvpool_alloc *a, const struct req *r, size_t n)
{
	if (r->n_pages + (uint64_t)n <= a->max_ppr)
		return 0;
	return fail(a, BD_POOL_ERR_RANGE,
		    "request %llu holds %u pages; %zu more exceed the %u of the longest",
		    (unsigned long long)r->id, r->n_pages, n, a->max_ppr);
}

/* room for `more` page references; the only allocation of a page operation */
static int reserve_room(struct bd_kvpool_alloc *a, struct req *r, uint32_t more)
{
	uint32_t need = r->n_pages + more, cap = r->cap ? r->cap : 8;
	int32_t *p;

	if (need <= r->cap)
		return 0;
	while (cap < need)
		cap *= 2;
	p = realloc(r->pages, cap * sizeof(int32_t));
	if (!p)
		return fail(a, BD_POOL_ERR_EXHAUSTED, "out of memory for page references");
	r->pages = p;
	r->cap = cap;
	return 0;
}

static long find_page(const struct req *r, int32_t page)
{
	long lo = 0, hi = (long)r->n_pages - 1;

	while (lo <= hi) {
		long mid = (lo + hi) / 2;

		if (r->pages[mid] == page)
			return mid;
		if (r->pages[mid] < page)
			lo = mid + 1;
		else
			hi = mid - 1;
	}
	return -1;
}

static void add_page(struct req *r, int32_t page)
{
	uint32_t i = r->n_pages;

	while (i > 0 && r->pages[i - 1] > page) {
		r->pages[i] = r->pages[i - 1];
		i--;
	}
	r->pages[i] = page;
	r->n_pages++;
}

/* ---- the prefix index -------------------------------------------------------------------- */

static size_t idx_home(const struct bd_kvpool_alloc *a, uint64_t h)
{
	return hash64(h) & a->idx_mask;
}

/* The indexed page of hash h, or -1. */
static int32_t idx_find(const struct bd_kvpool_alloc *a, uint64_t h)
{
	for (size_t i = idx_home(a, h);; i = (i + 1) & a->idx_mask) {
		if (a->idx[i] < 0)
			return -1;
		if (a->hash[a->idx[i]] == h)
			return a->idx[i];
	}
}

static void idx_put(struct bd_kvpool_alloc *a, int32_t page, uint64_t h)
{
	size_t i = idx_home(a, h);

	while (a->idx[i] >= 0)
		i = (i + 1) & a->idx_mask;
	a->idx[i] = page;
	a->hash[page] = h;
	a->n_cached++;
}

/* Takes page out of the index (backward-shift deletion, as remove_req). */
static void idx_del(struct bd_kvpool_alloc *a, int32_t page)
{
	size_t i = idx_home(a, a->hash[page]);

	while (a->idx[i] != page)
		i = (i + 1) & a->idx_mask;
	a->idx[i] = -1;
	for (size_t j = (i + 1) & a->idx_mask; a->idx[j] >= 0; j = (j + 1) & a->idx_mask) {
		size_t home = idx_home(a, a->hash[a->idx[j]]);

		if (((j - home) & a->idx_mask) >= ((j - i) & a->idx_mask)) {
			a->idx[i] = a->idx[j];
			a->idx[j] = -1;
			i = j;
		}
	}
	a->hash[page] = 0;
	a->n_cached--;
}

/* page at the most recent end of the idle list */
static void lru_push(struct bd_kvpool_alloc *a, int32_t page)
{
	a->lru_prev[page] = a->lru_tail;
	a->lru_next[page] = -1;
	if (a->lru_tail >= 0)
		a->lru_next[a->lru_tail] = page;
	else
		a->lru_head = page;
	a->lru_tail = page;
	a->n_idle++;
}

static void lru_unlink(struct bd_kvpool_alloc *a, int32_t page)
{
	int32_t p = a->lru_prev[page], n = a->lru_next[page];

	if (p >= 0)
		a->lru_next[p] = n;
	else
		a->lru_head = n;
	if (n >= 0)
		a->lru_prev[n] = p;
	else
		a->lru_tail = p;
	a->n_idle--;
}

/* The least recently used idle page leaves the index for the free stack (scrubbed, told). */
static void evict_one(struct bd_kvpool_alloc *a)
{
	int32_t page = a->lru_head;
	uint64_t h = a->hash[page];

	lru_unlink(a, page);
	idx_del(a, page);
	a->state[page] = PAGE_FREE;
	a->free_pages[a->n_free++] = page;
	a->pc.evictions++;
	if (a->scrub)
		a->scrub(a->scrub_ctx, false, page);
	if (a->cache_fn)
		a->cache_fn(a->cache_ctx, BD_KVPOOL_CACHE_REMOVED, h, page);
}

/* Drops one reference of r to page; returns 1 when the page became free. */
static int drop_page(struct bd_kvpool_alloc *a, struct req *r, int32_t page)
{
	long i = find_page(r, page);

	memmove(&r->pages[i], &r->pages[i + 1], (r->n_pages - (size_t)i - 1) * sizeof(int32_t));
	r->n_pages--;
	if (r->reserved == page)
		r->reserved = -1;
	if (--a->ref[page])
		return 0;
	if (a->hash[page]) {
		/* indexed: kept for the next request with this prefix */
		a->state[page] = PAGE_IDLE;
		lru_push(a, page);
		return 0;
	}
	a->state[page] = PAGE_FREE;
	a->free_pages[a->n_free++] = page;
	if (a->scrub)
		a->scrub(a->scrub_ctx, false, page);
	return 1;
}

/* ---- pages -------------------------------------------------------------------------------- */

/* r's owner may hold n more page references, else POOL_ERR_QUOTA */
static int pages_quota(struct bd_kvpool_alloc *a, const struct req *r, size_t n)
{
	size_t held;

	if (!a->quota.pages)
		return 0;
	held = owner_use(a, r->owner).pages;
	if (held + n <= a->quota.pages)
		return 0;
	return fail(a, BD_POOL_ERR_QUOTA,
		    "owner %llu holds %zu pages; %zu more exceed its quota of %zu (owner_max_pages)",
		    (unsigned long long)r->owner, held, n, a->quota.pages);
}

/* The record of id (created under owner when unknown, as get_req) for an operation on n
 * pages: n in range first. */
static int req_for_pages(struct bd_kvpool_alloc *a, uint64_t id, uint64_t owner, size_t n,
			 struct req **ret, bool *fresh)
{
	int e = count_in_range(a, n);

	*fresh = false;
	return e < 0 ? e : get_req(a, id, owner, ret, fresh);
}

/* r may take n more page references: the request's limit, then its owner's quota. */
static int room_for(struct bd_kvpool_alloc *a, const struct req *r, size_t n)
{
	int e = under_limit(a, r, n);

	return e < 0 ? e : pages_quota(a, r, n);
}

static int take_pages(struct bd_kvpool_alloc *a, uint64_t id, uint64_t owner, uint32_t n,
		      int state, int32_t *ret)
{
	struct req *r;
	bool fresh;
	int e;

	e = req_for_pages(a, id, owner, n, &r, &fresh);
	if (e < 0)
		return e;
	if (state == PAGE_RESERVED && r->reserved >= 0) {
		e = fail(a, BD_POOL_ERR_STATE, "request %llu already has page %d reserved",
			 (unsigned long long)id, r->reserved);
		goto out;
	}
	e = room_for(a, r, n);
	if (e < 0)
		goto out;
	if (n > a->n_free + a->n_idle) {
		e = fail(a, BD_POOL_ERR_EXHAUSTED, "%u pages wanted, %zu free", n,
			 a->n_free + a->n_idle);
		goto out;
	}
	e = reserve_room(a, r, n);
	if (e < 0)
		goto out;
	if (fresh)
		insert(a, r);
	while (a->n_free < n)
		evict_one(a);
	for (uint32_t i = 0; i < n; i++) {
		int32_t p = a->free_pages[--a->n_free];

		a->state[p] = (uint8_t)state;
		a->ref[p] = 1;
		add_page(r, p);
		ret[i] = p;
	}
	if (state == PAGE_RESERVED)
		r->reserved = ret[0];
	return changed(a);
out:
	drop_fresh(r, fresh);
	return e;
}

int bd_kvpool_page_alloc(struct bd_kvpool_alloc *a, uint64_t req, uint64_t owner, uint32_t n,
			 int32_t *ret_pages)
{
	if (!a || !ret_pages)
		return -BD_POOL_ERR_INVALID;
	return take_pages(a, req, owner, n, PAGE_USED, ret_pages);
}

int bd_kvpool_page_reserve(struct bd_kvpool_alloc *a, uint64_t req, uint64_t owner,
			   int32_t *ret_page)
{
	if (!a || !ret_page)
		return -BD_POOL_ERR_INVALID;
	return take_pages(a, req, owner, 1, PAGE_RESERVED, ret_page);
}

int bd_kvpool_page_commit(struct bd_kvpool_alloc *a, uint64_t req, int32_t page)
{
	struct req *r;
	int e = find_known_with(a, req, "page", page, a->n_pages, &r);

	if (e < 0)
		return e;
	if (r->reserved != page)
		return fail(a, find_page(r, page) < 0 ? BD_POOL_ERR_NOT_HELD : BD_POOL_ERR_STATE,
			    "page %d is not the reserved page of request %llu", page,
			    (unsigned long long)req);
	a->state[page] = PAGE_USED;
	r->reserved = -1;
	return changed(a);
}

/* Checks a page list against r: ids in range, no repeats; `held` says whether every page must
 * be held by r (free) or not held and USED (ref). Leaves a->mark clear. */
static int check_list(struct bd_kvpool_alloc *a, const struct req *r, uint64_t id,
		      const int32_t *pages, size_t n, bool held)
{
	size_t i;
	int e = 0;

	for (i = 0; i < n && !e; i++) {
		int32_t p = pages[i];

		e = in_range(a, "page", p, a->n_pages);
		if (e < 0)
			break;
		if (a->mark[p]) {
			e = fail(a, BD_POOL_ERR_INVALID, "page %d is listed twice", p);
			break;
		}
		a->mark[p] = 1;
		if (held) {
			if (a->state[p] == PAGE_FREE)
				e = fail(a, BD_POOL_ERR_DOUBLE_FREE, "page %d is already free", p);
			else if (!r || find_page(r, p) < 0)
				e = fail(a, BD_POOL_ERR_NOT_HELD,
					 "page %d is not held by request %llu", p,
					 (unsigned long long)id);
		} else {
			if (a->state[p] != PAGE_USED)
				e = fail(a, BD_POOL_ERR_STATE, "page %d is %s, not in use", p,
					 a->state[p] == PAGE_FREE ? "free" : "reserved");
			else if (r && find_page(r, p) >= 0)
				e = fail(a, BD_POOL_ERR_INVALID,
					 "request %llu already holds page %d",
					 (unsigned long long)id, p);
			else if (a->ref[p] == UINT32_MAX)
				e = fail(a, BD_POOL_ERR_RANGE, "page %d has too many holders", p);
		}
	}
	/* every mark ends clear; clearing one never set is harmless */
	for (size_t k = 0; k < n; k++)
		if (pages[k] >= 0 && (size_t)pages[k] < a->n_pages)
			a->mark[pages[k]] = 0;
	return e;
}

int bd_kvpool_page_free(struct bd_kvpool_alloc *a, uint64_t req, const int32_t *pages, size_t n,
			uint64_t *ret_freed)
{
	uint64_t freed = 0;
	struct req *r;
	int e;

	if (n && !pages)
		return -BD_POOL_ERR_INVALID;
	e = find_known(a, req, &r);
	if (e == 0)
		e = count_in_range(a, n);
	if (e == 0)
		e = check_list(a, r, req, pages, n, true);
	if (e < 0)
		return e;
	for (size_t i = 0; i < n; i++)
		freed += (uint64_t)drop_page(a, r, pages[i]);
	if (ret_freed)
		*ret_freed = freed;
	return changed(a);
}

int bd_kvpool_page_ref(struct bd_kvpool_alloc *a, uint64_t req, uint64_t owner,
		       const int32_t *pages, size_t n)
{
	struct req *r;
	bool fresh;
	int e;

	if (!a || (n && !pages))
		return -BD_POOL_ERR_INVALID;
	e = req_for_pages(a, req, owner, n, &r, &fresh);
	if (e < 0)
		return e;
	e = room_for(a, r, n);
	if (e == 0)
		e = check_list(a, fresh ? NULL : r, req, pages, n, false);
	if (e < 0)
		goto out;
	e = reserve_room(a, r, (uint32_t)n);
	if (e < 0)
		goto out;
	if (fresh)
		insert(a, r);
	for (size_t i = 0; i < n; i++) {
		a->ref[pages[i]]++;
		add_page(r, pages[i]);
	}
	return changed(a);
out:
	drop_fresh(r, fresh);
	return e;
}

/* ---- prefix caching ----------------------------------------------------------------------- */

int bd_kvpool_prefix_store(struct bd_kvpool_alloc *a, uint64_t req, const int32_t *pages,
			   const uint64_t *hashes, size_t n, uint64_t *ret_stored)
{
	uint64_t stored = 0;
	struct req *r;
	int e;

	if (!a || (n && (!pages || !hashes)))
		return -BD_POOL_ERR_INVALID;
	e = find_known(a, req, &r);
	if (e == 0)
		e = count_in_range(a, n);
	for (size_t i = 0; e == 0 && i < n; i++) {
		int32_t p = pages[i];

		e = in_range(a, "page", p, a->n_pages);
		if (e < 0)
			break;
		if (hashes[i] == 0)
			e = fail(a, BD_POOL_ERR_INVALID, "page %d: hash 0 is reserved", p);
		else if (find_page(r, p) < 0)
			e = fail(a, BD_POOL_ERR_NOT_HELD, "page %d is not held by request %llu", p,
				 (unsigned long long)req);
		else if (a->state[p] != PAGE_USED)
			e = fail(a, BD_POOL_ERR_STATE, "page %d is reserved, not promoted yet", p);
		for (size_t k = 0; e == 0 && k < i; k++)
			if (pages[k] == p || hashes[k] == hashes[i])
				e = fail(a, BD_POOL_ERR_INVALID, "page %d or its hash is listed twice",
					 p);
	}
	if (e < 0)
		return e;
	for (size_t i = 0; i < n; i++) {
		/* a page indexed already, or a hash another page holds: that page stays as it is */
		if (a->hash[pages[i]] || idx_find(a, hashes[i]) >= 0)
			continue;
		idx_put(a, pages[i], hashes[i]);
		stored++;
		if (a->cache_fn)
			a->cache_fn(a->cache_ctx, BD_KVPOOL_CACHE_STORED, hashes[i], pages[i]);
	}
	a->pc.stored += stored;
	if (ret_stored)
		*ret_stored = stored;
	return stored ? changed(a) : ok(a);
}

int bd_kvpool_prefix_match(struct bd_kvpool_alloc *a, uint64_t req, uint64_t owner,
			   const uint64_t *hashes, size_t n, int32_t *ret_pages, size_t *ret_n)
{
	struct req *r;
	bool fresh;
	size_t k = 0;
	int e;

	if (!a || !ret_n || (n && (!hashes || !ret_pages)))
		return -BD_POOL_ERR_INVALID;
	*ret_n = 0;
	e = req_for_pages(a, req, owner, n, &r, &fresh);
	if (e < 0)
		return e;
	/* the leading run of indexed hashes whose pages the request does not hold yet */
	while (k < n) {
		int32_t p = hashes[k] ? idx_find(a, hashes[k]) : -1;

		if (p < 0 || find_page(r, p) >= 0 || a->ref[p] == UINT32_MAX)
			break;
		ret_pages[k++] = p;
	}
	e = k ? room_for(a, r, k) : 0;
	if (e == 0 && k)
		e = reserve_room(a, r, (uint32_t)k);
	a->pc.queries += n;
	if (e < 0 || !k) {
		drop_fresh(r, fresh);
		return e < 0 ? e : ok(a);
	}
	a->pc.hits += k;
	if (fresh)
		insert(a, r);
	for (size_t i = 0; i < k; i++) {
		int32_t p = ret_pages[i];

		if (a->state[p] == PAGE_IDLE) {
			lru_unlink(a, p);
			a->state[p] = PAGE_USED;
		}
		a->ref[p]++;
		add_page(r, p);
	}
	*ret_n = k;
	return changed(a);
}

int bd_kvpool_prefix_clear(struct bd_kvpool_alloc *a, uint64_t *ret_dropped)
{
	uint64_t n = 0;

	bd_kvpool_cache_fn fn;

	if (!a)
		return -BD_POOL_ERR_INVALID;
	/* one CLEARED event says it all: no REMOVED for each page */
	fn = a->cache_fn;
	a->cache_fn = NULL;
	while (a->n_idle) {
		evict_one(a);
		n++;
	}
	a->cache_fn = fn;
	/* pages still held leave the index and are freed by their last holder */
	for (size_t p = 0; p < a->n_pages; p++)
		if (a->hash[p]) {
			idx_del(a, (int32_t)p);
			n++;
		}
	if (a->cache_fn)
		a->cache_fn(a->cache_ctx, BD_KVPOOL_CACHE_CLEARED, 0, -1);
	if (ret_dropped)
		*ret_dropped = n;
	return n ? changed(a) : ok(a);
}

void bd_kvpool_prefix_counts(const struct bd_kvpool_alloc *a,
			     struct bd_kvpool_prefix_counts *ret)
{
	*ret = a->pc;
	ret->cached = a->n_cached;
	ret->idle = a->n_idle;
}

/* ---- slots -------------------------------------------------------------------------------- */

int bd_kvpool_slot_assign(struct bd_kvpool_alloc *a, uint64_t req, uint64_t owner,
			  int32_t *ret_slot)
{
	struct req *r;
	bool fresh;
	int e;

	if (!a || !ret_slot)
		return -BD_POOL_ERR_INVALID;
	e = get_req(a, req, owner, &r, &fresh);
	if (e < 0)
		return e;
	if (r->slot >= 0) {
		e = fail(a, BD_POOL_ERR_STATE, "request %llu already has slot %d",
			 (unsigned long long)req, r->slot);
		goto out;
	}
	if (a->quota.slots && owner_use(a, owner).slots >= a->quota.slots) {
		e = fail(a, BD_POOL_ERR_QUOTA,
			 "owner %llu holds %zu slots, its quota (owner_max_slots)",
			 (unsigned long long)owner, a->quota.slots);
		goto out;
	}
	if (!a->n_free_slots) {
		e = fail(a, BD_POOL_ERR_EXHAUSTED, "all %zu slots are in use", a->n_slots);
		goto out;
	}
	if (fresh)
		insert(a, r);
	r->slot = a->free_slots[--a->n_free_slots];
	a->slot_holder[r->slot] = req;
	*ret_slot = r->slot;
	return changed(a);
out:
	drop_fresh(r, fresh);
	return e;
}

static void put_slot(struct bd_kvpool_alloc *a, struct req *r)
{
	int32_t slot = r->slot;

	a->slot_holder[slot] = 0;
	a->free_slots[a->n_free_slots++] = slot;
	r->slot = -1;
	if (a->scrub)
		a->scrub(a->scrub_ctx, true, slot);
}

int bd_kvpool_slot_release(struct bd_kvpool_alloc *a, uint64_t req, int32_t slot)
{
	struct req *r;
	int e = find_known_with(a, req, "slot", slot, a->n_slots, &r);

	if (e < 0)
		return e;
	if (!a->slot_holder[slot])
		return fail(a, BD_POOL_ERR_DOUBLE_FREE, "slot %d is already free", slot);
	if (r->slot != slot)
		return fail(a, BD_POOL_ERR_NOT_HELD, "slot %d is not held by request %llu", slot,
			    (unsigned long long)req);
	put_slot(a, r);
	return changed(a);
}

/* ---- requests ----------------------------------------------------------------------------- */

static uint64_t release(struct bd_kvpool_alloc *a, struct req *r)
{
	uint64_t freed = 0;

	while (r->n_pages)
		freed += (uint64_t)drop_page(a, r, r->pages[r->n_pages - 1]);
	if (r->slot >= 0)
		put_slot(a, r);
	remove_req(a, r);
	return freed;
}

int bd_kvpool_request_release(struct bd_kvpool_alloc *a, uint64_t req, uint64_t *ret_freed)
{
	struct req *r;
	uint64_t freed;
	int e = find_known(a, req, &r);

	if (e < 0)
		return e;
	freed = release(a, r);
	if (ret_freed)
		*ret_freed = freed;
	return changed(a);
}

int bd_kvpool_owner_reclaim(struct bd_kvpool_alloc *a, uint64_t owner, uint64_t *ret_requests,
			    uint64_t *ret_freed)
{
	uint64_t n = 0, freed = 0, *ids;
	size_t k = 0;

	if (!a)
		return -BD_POOL_ERR_INVALID;
	/* ids first: a removal shifts entries of the table around */
	ids = malloc((a->n_reqs ? a->n_reqs : 1) * sizeof(*ids));
	if (ids) {
		for (size_t i = 0; i <= a->tab_mask; i++)
			if (a->tab[i] && a->tab[i]->owner == owner)
				ids[k++] = a->tab[i]->id;
		for (size_t i = 0; i < k; i++) {
			freed += release(a, lookup(a, ids[i]));
			n++;
		}
		free(ids);
	} else {
		/* no memory for the list: restart the scan after each removal */
		for (size_t i = 0; i <= a->tab_mask; i++)
			if (a->tab[i] && a->tab[i]->owner == owner) {
				freed += release(a, a->tab[i]);
				n++;
				i = (size_t)-1;
			}
	}
	if (ret_requests)
		*ret_requests = n;
	if (ret_freed)
		*ret_freed = freed;
	return n ? changed(a) : ok(a);
}

/* ---- queries ------------------------------------------------------------------------------ */

void bd_kvpool_alloc_counts(const struct bd_kvpool_alloc *a, struct bd_kvpool_counts *ret)
{
	memset(ret, 0, sizeof(*ret));
	ret->pages_total = a->n_pages;
	/* free capacity: the free stack and the idle pages an allocation evicts */
	ret->pages_free = a->n_free + a->n_idle;
	for (size_t p = 0; p < a->n_pages; p++) {
		ret->pages_used += a->state[p] == PAGE_USED;
		ret->pages_reserved += a->state[p] == PAGE_RESERVED;
		ret->pages_shared += a->ref[p] > 1;
	}
	ret->slots_total = a->n_slots;
	ret->slots_free = a->n_free_slots;
	ret->requests = a->n_reqs;
	for (size_t i = 0; i <= a->tab_mask; i++)
		if (a->tab[i] && (a->tab[i]->n_pages || a->tab[i]->slot >= 0))
			ret->requests_holding++;
	ret->max_pages_per_request = a->max_ppr;
}

static int by_pages(const void *x, const void *y)
{
	const struct bd_pool_holder *a = x, *b = y;

	if (a->pages != b->pages)
		return a->pages > b->pages ? -1 : 1;
	return (a->request_id > b->request_id) - (a->request_id < b->request_id);
}

static int by_id(const void *x, const void *y)
{
	const struct bd_pool_holder *a = x, *b = y;

	return (a->request_id > b->request_id) - (a->request_id < b->request_id);
}

size_t bd_kvpool_alloc_holders(const struct bd_kvpool_alloc *a, bool largest_first,
			       struct bd_pool_holder *ret, size_t cap)
{
	struct bd_pool_holder *all;
	size_t n = 0;

	if (!a || !ret || !cap || !a->n_reqs)
		return 0;
	all = malloc(a->n_reqs * sizeof(*all));
	if (!all)
		return 0;
	for (size_t i = 0; i <= a->tab_mask; i++) {
		const struct req *r = a->tab[i];

		if (!r)
			continue;
		all[n++] = (struct bd_pool_holder){
			.request_id = r->id,
			.owner = r->owner,
			.pages = r->n_pages,
			.reserved = r->reserved >= 0,
			.slot = r->slot,
		};
	}
	qsort(all, n, sizeof(*all), largest_first ? by_pages : by_id);
	if (n > cap)
		n = cap;
	memcpy(ret, all, n * sizeof(*all));
	free(all);
	return n;
}

int bd_kvpool_alloc_owner_of(const struct bd_kvpool_alloc *a, uint64_t req, uint64_t *ret_owner)
{
	const struct req *r = a && req ? lookup(a, req) : NULL;

	if (!r)
		return -BD_POOL_ERR_UNKNOWN_REQUEST;
	*ret_owner = r->owner;
	return 0;
}

long bd_kvpool_alloc_pages_of(const struct bd_kvpool_alloc *a, uint64_t req, int32_t *ret,
			      size_t cap)
{
	const struct req *r = a ? lookup(a, req) : NULL;

	if (!r || req == 0)
		return -BD_POOL_ERR_UNKNOWN_REQUEST;
	for (size_t i = 0; i < r->n_pages && i < cap; i++)
		ret[i] = r->pages[i];
	return r->n_pages;
}

int bd_kvpool_alloc_check(struct bd_kvpool_alloc *a)
{
	uint32_t *count;
	size_t n_reqs = 0, n_free = 0, n_idle = 0, n_cached = 0, n_slot_held = 0;
	int e = 0;

	if (!a)
		return -EINVAL;
	count = calloc(a->n_pages, sizeof(*count));
	if (!count)
		return -ENOMEM;
	for (size_t i = 0; i <= a->tab_mask && !e; i++) {
		const struct req *r = a->tab[i];

		if (!r)
			continue;
		n_reqs++;
		if (r->id == 0 || lookup(a, r->id) != r)
			e = fail(a, EFAULT, "request %llu is not reachable from its hash",
				 (unsigned long long)r->id);
		for (uint32_t k = 0; k < r->n_pages && !e; k++) {
			int32_t p = r->pages[k];

			if (p < 0 || (size_t)p >= a->n_pages || (k && r->pages[k - 1] >= p))
				e = fail(a, EFAULT, "request %llu: page list unsorted or bad",
					 (unsigned long long)r->id);
			else
				count[p]++;
		}
		if (!e && r->reserved >= 0 &&
		    (find_page(r, r->reserved) < 0 || a->state[r->reserved] != PAGE_RESERVED))
			e = fail(a, EFAULT, "request %llu: reserved page %d not reserved",
				 (unsigned long long)r->id, r->reserved);
		if (!e && r->slot >= 0) {
			n_slot_held++;
			if ((size_t)r->slot >= a->n_slots || a->slot_holder[r->slot] != r->id)
				e = fail(a, EFAULT, "request %llu: slot %d not recorded",
					 (unsigned long long)r->id, r->slot);
		}
	}
	if (!e && n_reqs != a->n_reqs)
		e = fail(a, EFAULT, "%zu records counted, %zu found", a->n_reqs, n_reqs);
	for (size_t p = 0; p < a->n_pages && !e; p++) {
		if (count[p] != a->ref[p])
			e = fail(a, EFAULT, "page %zu: refcount %u, %u holders", p, a->ref[p],
				 count[p]);
		else if ((a->ref[p] == 0) !=
			 (a->state[p] == PAGE_FREE || a->state[p] == PAGE_IDLE))
			e = fail(a, EFAULT, "page %zu: state %d with refcount %u", p,
				 a->state[p], a->ref[p]);
		else if (a->hash[p] && a->state[p] != PAGE_USED && a->state[p] != PAGE_IDLE)
			e = fail(a, EFAULT, "page %zu: indexed in state %d", p, a->state[p]);
		else if (a->state[p] == PAGE_IDLE && !a->hash[p])
			e = fail(a, EFAULT, "page %zu: idle and not indexed", p);
		else if (a->hash[p] && idx_find(a, a->hash[p]) != (int32_t)p)
			e = fail(a, EFAULT, "page %zu: its hash does not find it", p);
		else if (a->state[p] == PAGE_RESERVED && a->ref[p] != 1)
			e = fail(a, EFAULT, "page %zu: reserved and shared", p);
		else if (a->mark[p])
			e = fail(a, EFAULT, "page %zu: scratch mark left set", p);
		n_free += a->state[p] == PAGE_FREE;
		n_idle += a->state[p] == PAGE_IDLE;
		n_cached += a->hash[p] != 0;
	}
	if (!e && (n_idle != a->n_idle || n_cached != a->n_cached))
		e = fail(a, EFAULT, "%zu idle and %zu indexed pages, counted %zu and %zu", n_idle,
			 n_cached, a->n_idle, a->n_cached);
	/* the idle list holds each idle page once, linked both ways */
	for (int32_t p = a->lru_head, prev = -1, k = 0; !e && p >= 0;
	     prev = p, p = a->lru_next[p], k++) {
		if ((size_t)k >= a->n_idle || a->state[p] != PAGE_IDLE || a->lru_prev[p] != prev)
			e = fail(a, EFAULT, "idle list entry %d (page %d) is wrong", k, p);
		else if (a->lru_next[p] < 0 && a->lru_tail != p)
			e = fail(a, EFAULT, "idle list ends at %d, its tail is %d", p, a->lru_tail);
	}
	/* the free stack holds each free page once */
	for (size_t i = 0; i < a->n_free && !e; i++) {
		int32_t p = a->free_pages[i];

		if (p < 0 || (size_t)p >= a->n_pages || a->state[p] != PAGE_FREE ||
		    count[p] == UINT32_MAX)
			e = fail(a, EFAULT, "free stack entry %zu (page %d) is wrong", i, p);
		else
			count[p] = UINT32_MAX;
	}
	if (!e && n_free != a->n_free)
		e = fail(a, EFAULT, "%zu free pages, free stack of %zu", n_free, a->n_free);
	if (!e) {
		size_t held = 0;

		for (size_t s = 0; s < a->n_slots; s++)
			held += a->slot_holder[s] != 0;
		if (held != n_slot_held || held + a->n_free_slots != a->n_slots)
			e = fail(a, EFAULT, "slots: %zu held by records, %zu marked, %zu free",
				 n_slot_held, held, a->n_free_slots);
	}
	free(count);
	return e;
}

/* ---- the pool as bytes -------------------------------------------------------------------- */

uint64_t bd_kvpool_alloc_changes(const struct bd_kvpool_alloc *a)
{
	return a ? a->changes : 0;
}

/* a record's fixed part: id, owner, reserved page, slot, page count */
#define REC_BYTES (2 * sizeof(uint64_t) + 3 * sizeof(int32_t))

size_t bd_kvpool_alloc_save_max(size_t n_pages, size_t n_slots, uint32_t max_pages_per_request,
				size_t max_requests)
{
	size_t rec, recs, total;

	if (__builtin_mul_overflow((size_t)max_pages_per_request, sizeof(int32_t), &rec) ||
	    __builtin_add_overflow(rec, REC_BYTES, &rec) ||
	    __builtin_mul_overflow(rec, max_requests, &recs) ||
	    __builtin_add_overflow(n_pages, n_slots, &total) ||
	    __builtin_mul_overflow(total, sizeof(int32_t), &total) ||
	    __builtin_add_overflow(total, recs, &total) ||
	    __builtin_add_overflow(total, 4 * sizeof(uint32_t), &total) ||
	    __builtin_add_overflow(total, n_pages * (sizeof(int32_t) + sizeof(uint64_t)), &total))
		return 0;
	return total;
}

ssize_t bd_kvpool_alloc_save(const struct bd_kvpool_alloc *a, void *buf, size_t cap)
{
	struct bd_kvpool_cur c = { .w = buf, .len = cap, .ok = buf != NULL };
	uint32_t n;

	if (!a)
		return -EINVAL;
	n = (uint32_t)a->n_free;
	bd_kvpool_put(&c, &n, sizeof(n));
	bd_kvpool_put(&c, a->free_pages, a->n_free * sizeof(int32_t));
	n = (uint32_t)a->n_free_slots;
	bd_kvpool_put(&c, &n, sizeof(n));
	bd_kvpool_put(&c, a->free_slots, a->n_free_slots * sizeof(int32_t));
	n = (uint32_t)a->n_reqs;
	bd_kvpool_put(&c, &n, sizeof(n));
	for (size_t i = 0; i <= a->tab_mask && c.ok; i++) {
		const struct req *r = a->tab[i];

		if (!r)
			continue;
		bd_kvpool_put(&c, &r->id, sizeof(r->id));
		bd_kvpool_put(&c, &r->owner, sizeof(r->owner));
		bd_kvpool_put(&c, &r->reserved, sizeof(r->reserved));
		bd_kvpool_put(&c, &r->slot, sizeof(r->slot));
		bd_kvpool_put(&c, &r->n_pages, sizeof(r->n_pages));
		bd_kvpool_put(&c, r->pages, r->n_pages * sizeof(int32_t));
	}
	/* the prefix index: the idle pages from the least recently used, then the held ones */
	n = (uint32_t)a->n_cached;
	bd_kvpool_put(&c, &n, sizeof(n));
	for (int32_t p = a->lru_head; p >= 0 && c.ok; p = a->lru_next[p]) {
		bd_kvpool_put(&c, &p, sizeof(p));
		bd_kvpool_put(&c, &a->hash[p], sizeof(a->hash[p]));
	}
	for (size_t p = 0; p < a->n_pages && c.ok; p++)
		if (a->hash[p] && a->state[p] != PAGE_IDLE) {
			int32_t q = (int32_t)p;

			bd_kvpool_put(&c, &q, sizeof(q));
			bd_kvpool_put(&c, &a->hash[p], sizeof(a->hash[p]));
		}
	return c.ok ? (ssize_t)c.off : -ENOSPC;
}

/* A stack of n ids (pages or slots, 0..max-1) from c into dst: each id once (mark[] is the
 * scratch of max flags, left clear). 0 or -EBADMSG with the reason. */
static int load_stack(struct bd_kvpool_alloc *a, struct bd_kvpool_cur *c, const char *what,
		      int32_t *dst, size_t max, size_t *ret_n, uint8_t *mark)
{
	uint32_t n;
	int e = 0;

	if (!bd_kvpool_get(c, &n, sizeof(n)) || n > max ||
	    !bd_kvpool_get(c, dst, (size_t)n * sizeof(int32_t)))
		return fail(a, EBADMSG, "the free %s stack is truncated or too long", what);
	for (uint32_t i = 0; i < n && !e; i++) {
		if (dst[i] < 0 || (size_t)dst[i] >= max || mark[dst[i]])
			e = fail(a, EBADMSG, "free %s stack entry %u (%d) is out of range or repeated",
				 what, i, dst[i]);
		else
			mark[dst[i]] = 1;
	}
	for (uint32_t i = 0; i < n; i++)
		if (dst[i] >= 0 && (size_t)dst[i] < max)
			mark[dst[i]] = 0;
	*ret_n = n;
	return e;
}

/* One record from c, checked against what a holds so far, then inserted with its references.
 * 0 or -EBADMSG / -ENOMEM with the reason. */
static int load_req(struct bd_kvpool_alloc *a, struct bd_kvpool_cur *c, const uint8_t *slot_free)
{
	struct req q = { 0 }, *r;
	bool has_reserved = false;

	bd_kvpool_get(c, &q.id, sizeof(q.id));
	bd_kvpool_get(c, &q.owner, sizeof(q.owner));
	bd_kvpool_get(c, &q.reserved, sizeof(q.reserved));
	bd_kvpool_get(c, &q.slot, sizeof(q.slot));
	if (!bd_kvpool_get(c, &q.n_pages, sizeof(q.n_pages)))
		return fail(a, EBADMSG, "a request record is truncated");
	if (q.id == 0 || lookup(a, q.id))
		return fail(a, EBADMSG, "request id %llu is 0 or repeated",
			    (unsigned long long)q.id);
	if (q.n_pages > a->max_ppr || (size_t)q.n_pages * sizeof(int32_t) > c->len - c->off)
		return fail(a, EBADMSG, "request %llu: %u pages (at most %u) or truncated",
			    (unsigned long long)q.id, q.n_pages, a->max_ppr);
	if (q.slot < -1 || (q.slot >= 0 && ((size_t)q.slot >= a->n_slots ||
					    slot_free[q.slot] || a->slot_holder[q.slot])))
		return fail(a, EBADMSG, "request %llu: slot %d is out of range, free or taken",
			    (unsigned long long)q.id, q.slot);
	if (q.reserved < -1)
		return fail(a, EBADMSG, "request %llu: reserved page %d",
			    (unsigned long long)q.id, q.reserved);
	r = calloc(1, sizeof(*r));
	if (!r)
		return fail(a, ENOMEM, "out of memory for a request record");
	*r = q;
	r->cap = q.n_pages;
	r->pages = malloc((q.n_pages ? q.n_pages : 1) * sizeof(int32_t));
	if (!r->pages) {
		free(r);
		return fail(a, ENOMEM, "out of memory for a request record");
	}
	bd_kvpool_get(c, r->pages, q.n_pages * sizeof(int32_t));
	/* inserted now, so that a reset frees it whatever follows */
	insert(a, r);
	for (uint32_t k = 0; k < r->n_pages; k++) {
		int32_t p = r->pages[k];

		if (p < 0 || (size_t)p >= a->n_pages || (k && r->pages[k - 1] >= p) ||
		    a->ref[p] == UINT32_MAX)
			return fail(a, EBADMSG, "request %llu: page list unsorted or out of range",
				    (unsigned long long)r->id);
		a->ref[p]++;
		a->state[p] = PAGE_USED;
		has_reserved |= p == r->reserved;
	}
	if (r->reserved >= 0 && !has_reserved)
		return fail(a, EBADMSG, "request %llu: reserved page %d is not among its pages",
			    (unsigned long long)r->id, r->reserved);
	if (r->reserved >= 0)
		a->state[r->reserved] = PAGE_RESERVED;
	if (r->slot >= 0)
		a->slot_holder[r->slot] = r->id;
	return 0;
}

/* The prefix index from c, after the requests: an indexed page no request holds is idle (in
 * the order saved, least recently used first), one held stays USED. 0 or -EBADMSG. */
static int load_index(struct bd_kvpool_alloc *a, struct bd_kvpool_cur *c)
{
	uint32_t n;

	if (!bd_kvpool_get(c, &n, sizeof(n)) || n > a->n_pages)
		return fail(a, EBADMSG, "the prefix index count is missing or above %zu",
			    a->n_pages);
	for (uint32_t i = 0; i < n; i++) {
		int32_t p = -1;
		uint64_t h = 0;

		bd_kvpool_get(c, &p, sizeof(p));
		if (!bd_kvpool_get(c, &h, sizeof(h)))
			return fail(a, EBADMSG, "the prefix index is truncated");
		if (p < 0 || (size_t)p >= a->n_pages || !h || a->hash[p] || idx_find(a, h) >= 0 ||
		    a->state[p] == PAGE_RESERVED)
			return fail(a, EBADMSG, "prefix index entry %u (page %d) is out of range, "
				    "repeated or reserved", i, p);
		idx_put(a, p, h);
		if (a->ref[p] == 0) {
			/* idle: it must not be on the free stack (the check below counts that) */
			a->state[p] = PAGE_IDLE;
			lru_push(a, p);
		}
	}
	return 0;
}

ssize_t bd_kvpool_alloc_load(struct bd_kvpool_alloc *a, const void *buf, size_t len)
{
	struct bd_kvpool_cur c = { .r = buf, .len = len, .ok = buf != NULL };
	uint8_t *slot_free = NULL;
	uint32_t n_reqs = 0;
	int e;

	if (!a)
		return -EINVAL;
	reset(a);
	slot_free = calloc(a->n_slots ? a->n_slots : 1, 1);
	if (!slot_free)
		return fail(a, ENOMEM, "out of memory");
	/* the page stack is checked against the references below (bd_kvpool_alloc_check) */
	e = load_stack(a, &c, "page", a->free_pages, a->n_pages, &a->n_free, a->mark);
	if (e == 0)
		e = load_stack(a, &c, "slot", a->free_slots, a->n_slots, &a->n_free_slots, slot_free);
	for (size_t i = 0; e == 0 && i < a->n_free_slots; i++)
		slot_free[a->free_slots[i]] = 1;
	if (e == 0 && (!bd_kvpool_get(&c, &n_reqs, sizeof(n_reqs)) || n_reqs > a->max_requests))
		e = fail(a, EBADMSG, "the request count is missing or above %zu", a->max_requests);
	for (uint32_t i = 0; e == 0 && i < n_reqs; i++)
		e = load_req(a, &c, slot_free);
	free(slot_free);
	if (e == 0)
		e = load_index(a, &c);
	/* the rest of the invariants; the violation stays in a->err */
	if (e == 0 && bd_kvpool_alloc_check(a) < 0)
		e = -EBADMSG;
	if (e < 0) {
		char why[sizeof(a->err)];

		/* the reason outlives the reset */
		memcpy(why, a->err, sizeof(why));
		reset(a);
		memcpy(a->err, why, sizeof(why));
		return e;
	}
	a->changes = 0;
	ok(a);
	return (ssize_t)c.off;
}
