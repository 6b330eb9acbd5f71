/* handler.c — one PoolRequest frame in, one PoolReply frame out (kvpool.h).
 *
 * The frame comes from any process that can reach the allocation socket, so it is treated as
 * hostile: size first, then protobuf-c's own checks, then the allocator's. protobuf-c refuses
 * truncated and malformed wire data and keeps unknown fields aside; a oneof that names no known
 * operation reads as NOT_SET and gets POOL_ERR_UNKNOWN_TYPE.
 *
 * A frame that names its client and call (kvpool.proto) and repeats that client's last call
 * that changed the pool gets the reply that call got, from the replay table, and changes nothing.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpool.h"
#include "kvpool.pb-c.h"

#define MAX_TOP 64 /* largest holders a stats reply lists */

static int pack(const Bdfp4__PoolReply *rep, uint8_t **ret, size_t *ret_len)
{
	size_t n = bdfp4__pool_reply__get_packed_size(rep);
	uint8_t *b = malloc(n ? n : 1);

	if (!b)
		return -ENOMEM;
	*ret_len = bdfp4__pool_reply__pack(rep, b);
	*ret = b;
	return 0;
}

int bd_kvpool_error_reply(struct bd_kvpool_handler *h, int code, const char *text,
			  uint8_t **ret_reply, size_t *ret_len)
{
	Bdfp4__PoolReply rep = BDFP4__POOL_REPLY__INIT;

	if (!h || !ret_reply || !ret_len)
		return -EINVAL;
	h->served++;
	h->errors++;
	rep.error = (Bdfp4__PoolError)code;
	rep.message = (char *)(text ? text : "");
	rep.slot = -1;
	return pack(&rep, ret_reply, ret_len);
}

/* n holder records as Holder messages in hm, hp[i] pointing at hm[i]. */
static void holders_to_msgs(const struct bd_pool_holder *hold, size_t n, Bdfp4__Holder *hm,
			    Bdfp4__Holder **hp)
{
	for (size_t i = 0; i < n; i++) {
		bdfp4__holder__init(&hm[i]);
		hm[i].request_id = hold[i].request_id;
		hm[i].owner = hold[i].owner;
		hm[i].pages = hold[i].pages;
		hm[i].reserved = hold[i].reserved;
		hm[i].slot = hold[i].slot;
		hp[i] = &hm[i];
	}
}

/* The stats reply; its arrays live in `mem` (freed by the caller after packing). */
static int fill_stats(struct bd_kvpool_handler *h, uint32_t top, Bdfp4__PoolStats *st,
		      void **mem)
{
	const struct bd_kvpool_info *in = h->info;
	struct bd_kvpool_counts c;
	size_t n_dev = in ? in->n_devices : 0, n_att = in ? in->n_attachments : 0, n_top;
	struct bd_pool_holder *hold;
	Bdfp4__Holder *hm, **hp;
	Bdfp4__DeviceStats *dm, **dp;
	Bdfp4__Attachment *am, **ap;
	uint8_t *m;

	if (top == 0)
		top = h->default_top;
	if (top > MAX_TOP)
		top = MAX_TOP;
	m = calloc(1, top * (sizeof(*hold) + sizeof(*hm) + sizeof(*hp)) +
			      n_dev * (sizeof(*dm) + sizeof(*dp)) +
			      n_att * (sizeof(*am) + sizeof(*ap)) + 1);
	if (!m)
		return -ENOMEM;
	*mem = m;
	hold = (struct bd_pool_holder *)m;
	hm = (Bdfp4__Holder *)(hold + top);
	dm = (Bdfp4__DeviceStats *)(hm + top);
	am = (Bdfp4__Attachment *)(dm + n_dev);
	hp = (Bdfp4__Holder **)(am + n_att);
	dp = (Bdfp4__DeviceStats **)(hp + top);
	ap = (Bdfp4__Attachment **)(dp + n_dev);

	bd_kvpool_alloc_counts(h->alloc, &c);
	st->pages_total = c.pages_total;
	st->pages_free = c.pages_free;
	st->pages_used = c.pages_used;
	st->pages_reserved = c.pages_reserved;
	st->pages_shared = c.pages_shared;
	st->slots_total = c.slots_total;
	st->slots_free = c.slots_free;
	st->requests = c.requests;
	st->requests_holding = c.requests_holding;
	{
		struct bd_kvpool_prefix_counts pc;

		bd_kvpool_prefix_counts(h->alloc, &pc);
		st->pages_cached = pc.cached;
		st->pages_cached_idle = pc.idle;
		st->prefix_queries = pc.queries;
		st->prefix_hits = pc.hits;
		st->prefix_stored = pc.stored;
		st->prefix_evictions = pc.evictions;
	}
	st->served = h->served;
	st->errors = h->errors;
	st->group_epoch = h->group.epoch;
	st->group_owner = h->group.owner;
	st->attach_refused = h->group.refused;
	if (in) {
		st->backend = (char *)in->backend;
		st->kv_config = (char *)in->kv_config;
		st->page_format = (char *)in->page_format;
		st->tp = in->tp;
		st->max_seq_len = in->max_seq_len;
		st->page_bytes = in->page_bytes;
		st->slot_bytes = in->slot_bytes;
		if (in->arena_id)
			st->arena_id = (ProtobufCBinaryData){ 16, (uint8_t *)in->arena_id };
	}
	n_top = bd_kvpool_alloc_holders(h->alloc, true, hold, top);
	holders_to_msgs(hold, n_top, hm, hp);
	st->n_largest = n_top;
	st->largest = hp;
	for (size_t i = 0; i < n_dev; i++) {
		const struct bd_pool_device *d = &in->devices[i];

		bdfp4__device_stats__init(&dm[i]);
		dm[i].rank = d->rank;
		dm[i].device = d->device;
		dm[i].attached = d->attached;
		dm[i].arena_bytes = d->arena_bytes;
		dm[i].page_region_bytes = d->page_region_bytes;
		dm[i].slot_region_bytes = d->slot_region_bytes;
		dp[i] = &dm[i];
	}
	st->n_devices = n_dev;
	st->devices = dp;
	for (size_t i = 0; i < n_att; i++) {
		const struct bd_pool_attachment *t = &in->attachments[i];

		bdfp4__attachment__init(&am[i]);
		am[i].rank = t->rank;
		am[i].pid = t->pid;
		am[i].uid = t->uid;
		am[i].gid = t->gid;
		ap[i] = &am[i];
	}
	st->n_attachments = n_att;
	st->attachments = ap;
	return 0;
}

/* Every request record, by id; arrays in *mem. */
static int fill_requests(struct bd_kvpool_handler *h, Bdfp4__PoolReply *rep, void **mem)
{
	struct bd_kvpool_counts c;
	struct bd_pool_holder *hold;
	Bdfp4__Holder *hm, **hp;
	size_t n;

	bd_kvpool_alloc_counts(h->alloc, &c);
	*mem = calloc(c.requests + 1, sizeof(*hold) + sizeof(*hm) + sizeof(*hp));
	if (!*mem)
		return -ENOMEM;
	hold = *mem;
	hm = (Bdfp4__Holder *)(hold + c.requests + 1);
	hp = (Bdfp4__Holder **)(hm + c.requests + 1);
	n = bd_kvpool_alloc_holders(h->alloc, false, hold, c.requests);
	holders_to_msgs(hold, n, hm, hp);
	rep->n_requests = n;
	rep->requests = hp;
	return 0;
}

/* Operations that may change the pool: their repeats must not be applied again. */
static bool changes_pool(Bdfp4__PoolRequest__OpCase op)
{
	/* a group registration changes no allocation, and is not kept for repeats: a kvpoold
	 * restarted on its stored state has no group until the router registers it again */
	return op != BDFP4__POOL_REQUEST__OP_STATS && op != BDFP4__POOL_REQUEST__OP_REQUESTS &&
	       op != BDFP4__POOL_REQUEST__OP_GROUP_REGISTER && op != BDFP4__POOL_REQUEST__OP__NOT_SET;
}

/* The answer to a frame that repeats a call of its client (1: *ret_reply, a copy of the first
 * reply, or an error reply for a call older than the last one), 0 when the frame is new. */
static int repeated(struct bd_kvpool_handler *h, const Bdfp4__PoolRequest *req,
		    uint8_t **ret_reply, size_t *ret_len)
{
	const uint8_t *prev;
	size_t len;
	char text[160];
	int r;

	if (!h->replay || !req->client || !changes_pool(req->op_case))
		return 0;
	r = bd_kvpool_replay_find(h->replay, req->client, req->call, &prev, &len);
	if (r == 0)
		return 0;
	if (r < 0) {
		snprintf(text, sizeof(text), "call %llu of client %llx is older than its last one: "
			 "not applied", (unsigned long long)req->call,
			 (unsigned long long)req->client);
		r = bd_kvpool_error_reply(h, BD_POOL_ERR_INVALID, text, ret_reply, ret_len);
		return r < 0 ? r : 1;
	}
	*ret_reply = malloc(len ? len : 1);
	if (!*ret_reply)
		return -ENOMEM;
	memcpy(*ret_reply, prev, len);
	*ret_len = len;
	h->served++;
	return 1;
}

/* The owner a pool-changing call acts for (0: none, or a request not known, which the
 * allocator then refuses) and whether the call may bind a new owner (it names one). */
static uint64_t call_owner(const struct bd_kvpool_handler *h, const Bdfp4__PoolRequest *req,
			   bool *ret_names)
{
	uint64_t id = 0, owner = 0;

	*ret_names = true;
	switch (req->op_case) {
	case BDFP4__POOL_REQUEST__OP_PAGE_ALLOC: owner = req->page_alloc->owner; break;
	case BDFP4__POOL_REQUEST__OP_PAGE_RESERVE: owner = req->page_reserve->owner; break;
	case BDFP4__POOL_REQUEST__OP_PAGE_REF: owner = req->page_ref->owner; break;
	case BDFP4__POOL_REQUEST__OP_SLOT_ASSIGN: owner = req->slot_assign->owner; break;
	case BDFP4__POOL_REQUEST__OP_OWNER_RECLAIM: owner = req->owner_reclaim->owner; break;
	case BDFP4__POOL_REQUEST__OP_PAGE_COMMIT: id = req->page_commit->request_id; break;
	case BDFP4__POOL_REQUEST__OP_PAGE_FREE: id = req->page_free->request_id; break;
	case BDFP4__POOL_REQUEST__OP_SLOT_RELEASE: id = req->slot_release->request_id; break;
	case BDFP4__POOL_REQUEST__OP_REQUEST_RELEASE: id = req->request_release->request_id; break;
	case BDFP4__POOL_REQUEST__OP_PREFIX_MATCH: owner = req->prefix_match->owner; break;
	case BDFP4__POOL_REQUEST__OP_PREFIX_STORE: id = req->prefix_store->request_id; break;
	default: break;
	}
	if (id) {
		*ret_names = false;
		if (bd_kvpool_alloc_owner_of(h->alloc, id, &owner) < 0)
			owner = 0;
	}
	return owner;
}

/* 0 when the peer may act for the call's owner (binding a new owner to the peer's uid), else
 * -BD_POOL_ERR_OWNER or -BD_POOL_ERR_QUOTA with the reason in text. */
static int owner_check(struct bd_kvpool_handler *h, const Bdfp4__PoolRequest *req, char *text,
		       size_t len)
{
	bool names;
	uint64_t owner;

	if (!h->peer_known || !changes_pool(req->op_case))
		return 0;
	owner = call_owner(h, req, &names);
	if (!owner)
		return 0;
	for (size_t i = 0; i < h->n_owners; i++) {
		if (h->owners[i].owner != owner)
			continue;
		if (h->owners[i].uid == h->peer_uid || h->peer_admin)
			return 0;
		snprintf(text, len, "owner %llu belongs to uid %u; this call comes from uid %u",
			 (unsigned long long)owner, h->owners[i].uid, h->peer_uid);
		return -BD_POOL_ERR_OWNER;
	}
	if (!names)
		return 0; /* a record of an earlier run, before any call of this one named it */
	if (h->n_owners == BD_KVPOOL_MAX_OWNERS) {
		if (h->peer_admin)
			return 0;
		snprintf(text, len, "%d owners are in use: owner %llu cannot be added",
			 BD_KVPOOL_MAX_OWNERS, (unsigned long long)owner);
		return -BD_POOL_ERR_QUOTA;
	}
	h->owners[h->n_owners].owner = owner;
	h->owners[h->n_owners++].uid = h->peer_uid;
	return 0;
}

static int oom(char *text, size_t len, bool *own)
{
	snprintf(text, len, "kvpoold is out of memory");
	*own = true;
	return -BD_POOL_ERR_EXHAUSTED;
}

int bd_kvpool_handle(struct bd_kvpool_handler *h, const uint8_t *frame, size_t len,
		     uint8_t **ret_reply, size_t *ret_len)
{
	Bdfp4__PoolReply rep = BDFP4__POOL_REPLY__INIT;
	Bdfp4__PoolStats st = BDFP4__POOL_STATS__INIT;
	Bdfp4__PoolRequest *req;
	struct bd_kvpool_alloc *a;
	int32_t *pages = NULL, one;
	void *mem = NULL;
	char text[200];
	bool own_text = false; /* text says why, not the allocator */
	int e = 0, r;

	if (!h || !h->alloc || (!frame && len) || !ret_reply || !ret_len)
		return -EINVAL;
	a = h->alloc;
	if (len > h->max_frame) {
		snprintf(text, sizeof(text), "frame of %zu bytes exceeds the limit of %zu", len,
			 h->max_frame);
		return bd_kvpool_error_reply(h, BD_POOL_ERR_OVERSIZE, text, ret_reply, ret_len);
	}
	req = bdfp4__pool_request__unpack(NULL, len, frame);
	if (!req)
		return bd_kvpool_error_reply(h, BD_POOL_ERR_MALFORMED,
					     "the frame is not a PoolRequest", ret_reply, ret_len);
	r = repeated(h, req, ret_reply, ret_len);
	if (r != 0) {
		bdfp4__pool_request__free_unpacked(req, NULL);
		return r < 0 ? r : 0;
	}
	rep.slot = -1;
	e = owner_check(h, req, text, sizeof(text));
	if (e < 0) {
		bdfp4__pool_request__free_unpacked(req, NULL);
		return bd_kvpool_error_reply(h, -e, text, ret_reply, ret_len);
	}
	switch (req->op_case) {
	case BDFP4__POOL_REQUEST__OP_PAGE_ALLOC: {
		const Bdfp4__PageAlloc *m = req->page_alloc;
		struct bd_kvpool_counts c;

		/* the count is checked before sizing the reply's array by it */
		bd_kvpool_alloc_counts(a, &c);
		if (m->n == 0 || m->n > c.max_pages_per_request) {
			e = -BD_POOL_ERR_RANGE;
			snprintf(text, sizeof(text), "page count %u is outside 1..%u", m->n,
				 c.max_pages_per_request);
			own_text = true;
			break;
		}
		pages = malloc(m->n * sizeof(*pages));
		if (!pages) {
			e = oom(text, sizeof(text), &own_text);
			break;
		}
		e = bd_kvpool_page_alloc(a, m->request_id, m->owner, m->n, pages);
		if (!e) {
			rep.n_pages = m->n;
			rep.pages = pages;
		}
		break;
	}
	case BDFP4__POOL_REQUEST__OP_PAGE_RESERVE:
		e = bd_kvpool_page_reserve(a, req->page_reserve->request_id,
					   req->page_reserve->owner, &one);
		if (!e) {
			rep.n_pages = 1;
			rep.pages = &one;
		}
		break;
	case BDFP4__POOL_REQUEST__OP_PAGE_COMMIT:
		e = bd_kvpool_page_commit(a, req->page_commit->request_id, req->page_commit->page);
		break;
	case BDFP4__POOL_REQUEST__OP_PAGE_FREE:
		e = bd_kvpool_page_free(a, req->page_free->request_id, req->page_free->pages,
					req->page_free->n_pages, &rep.pages_freed);
		break;
	case BDFP4__POOL_REQUEST__OP_PAGE_REF:
		e = bd_kvpool_page_ref(a, req->page_ref->request_id, req->page_ref->owner,
				       req->page_ref->pages, req->page_ref->n_pages);
		break;
	case BDFP4__POOL_REQUEST__OP_SLOT_ASSIGN:
		e = bd_kvpool_slot_assign(a, req->slot_assign->request_id, req->slot_assign->owner,
					  &rep.slot);
		break;
	case BDFP4__POOL_REQUEST__OP_SLOT_RELEASE:
		e = bd_kvpool_slot_release(a, req->slot_release->request_id,
					   req->slot_release->slot);
		break;
	case BDFP4__POOL_REQUEST__OP_REQUEST_RELEASE:
		e = bd_kvpool_request_release(a, req->request_release->request_id,
					      &rep.pages_freed);
		if (!e)
			rep.requests_released = 1;
		break;
	case BDFP4__POOL_REQUEST__OP_OWNER_RECLAIM:
		e = bd_kvpool_owner_reclaim(a, req->owner_reclaim->owner, &rep.requests_released,
					    &rep.pages_freed);
		break;
	case BDFP4__POOL_REQUEST__OP_PREFIX_STORE: {
		const Bdfp4__PrefixStore *m = req->prefix_store;

		if (m->n_hashes != m->n_pages) {
			e = -BD_POOL_ERR_INVALID;
			snprintf(text, sizeof(text), "%zu pages and %zu hashes", m->n_pages,
				 m->n_hashes);
			own_text = true;
			break;
		}
		h->store_tokens = m->tokens;
		h->store_n_tokens = m->n_tokens;
		h->store_parent = m->parent;
		h->store_pages = m->pages;
		h->store_hashes = m->hashes;
		h->store_n = m->n_pages;
		e = bd_kvpool_prefix_store(a, m->request_id, m->pages, m->hashes, m->n_pages,
					   &rep.pages_stored);
		h->store_n = 0;
		break;
	}
	case BDFP4__POOL_REQUEST__OP_PREFIX_MATCH: {
		const Bdfp4__PrefixMatch *m = req->prefix_match;
		size_t k = 0;

		pages = malloc((m->n_hashes ? m->n_hashes : 1) * sizeof(*pages));
		if (!pages) {
			e = oom(text, sizeof(text), &own_text);
			break;
		}
		e = bd_kvpool_prefix_match(a, m->request_id, m->owner, m->hashes, m->n_hashes,
					   pages, &k);
		if (!e) {
			rep.n_pages = k;
			rep.pages = pages;
		}
		break;
	}
	case BDFP4__POOL_REQUEST__OP_PREFIX_CLEAR:
		if (h->peer_known && !h->peer_admin) {
			e = -BD_POOL_ERR_DENIED;
			snprintf(text, sizeof(text), "clearing the prefix cache is the operator's "
				 "(root or kvpoold's uid)");
			own_text = true;
			break;
		}
		e = bd_kvpool_prefix_clear(a, &rep.pages_freed);
		break;
	case BDFP4__POOL_REQUEST__OP_STATS:
		/* counted before filling, so the reply includes itself */
		h->served++;
		r = fill_stats(h, req->stats->top, &st, &mem);
		h->served--;
		if (!r)
			rep.stats = &st;
		else
			e = oom(text, sizeof(text), &own_text);
		break;
	case BDFP4__POOL_REQUEST__OP_REQUESTS:
		if (fill_requests(h, &rep, &mem) < 0)
			e = oom(text, sizeof(text), &own_text);
		break;
	case BDFP4__POOL_REQUEST__OP_GROUP_REGISTER: {
		const Bdfp4__GroupRegister *m = req->group_register;

		e = bd_kvpool_group_register(h, m->owner, m->epoch, m->tokens.data, m->tokens.len,
					     text, sizeof(text));
		own_text = true;
		break;
	}
	default:
		e = -BD_POOL_ERR_UNKNOWN_TYPE;
		snprintf(text, sizeof(text), "unknown or missing operation (case %d)",
			 (int)req->op_case);
		own_text = true;
		break;
	}
	if (e < 0 && !own_text)
		snprintf(text, sizeof(text), "%s", bd_kvpool_alloc_error(a));
	if (e < 0) {
		bdfp4__pool_request__free_unpacked(req, NULL);
		free(pages);
		free(mem);
		return bd_kvpool_error_reply(h, -e, text, ret_reply, ret_len);
	}
	h->served++;
	r = pack(&rep, ret_reply, ret_len);
	/* a reply too large for the table is not kept: a repeat of it would be applied again */
	if (r == 0 && h->replay && req->client && changes_pool(req->op_case))
		bd_kvpool_replay_put(h->replay, req->client, req->call, *ret_reply, *ret_len);
	bdfp4__pool_request__free_unpacked(req, NULL);
	free(pages);
	free(mem);
	return r;
}
