/* events.c — the prefix index's changes as vLLM's KV event batches (kvpool.h "KV events"),
 * packed with msgpack-c; the sockets are main.c's.
 *
 * A batch is what one allocation call changed, in order. Its msgpack form is the one vLLM's
 * ZmqEventPublisher sends with msgspec's array-like structs (vllm/distributed/kv_events.py),
 * which Dynamo's ZeroMQ relay and vLLM's example subscriber decode:
 *   batch   [ts: float64, events: array, data_parallel_rank: int]
 *   stored  ["BlockStored", block_hashes: [uint], parent_block_hash: uint | nil,
 *            token_ids: [int], block_size: int, lora_id: nil, medium: str]
 *   removed ["BlockRemoved", block_hashes: [uint], medium: str]
 *   cleared ["AllBlocksCleared"]
 * Consecutive pages of one PrefixStore whose chain is unbroken go in one BlockStored (its
 * parent the hash before the first); consecutive evictions in one BlockRemoved.
 */
#include <errno.h>
#include <msgpack.h>
#include <stdlib.h>
#include <string.h>

#include "kvpool.h"

struct ev {
	enum bd_kvpool_cache_event kind;
	uint64_t parent;        /* stored: 0 none */
	bool has_parent;
	uint64_t *hashes;       /* [n] */
	int32_t *tokens;        /* stored: [n·128] */
	size_t n, cap;
};

struct batch {
	uint64_t seq;
	uint8_t *data;
	size_t len;
};

struct bd_kvpool_events {
	const struct bd_kvpool_handler *h;
	char medium[16];
	struct ev *pend;
	size_t n_pend, cap_pend;
	bool oom;                /* an event was lost: the next batch says AllBlocksCleared */
	struct batch *ring;      /* the last n_ring batches, for replay */
	size_t n_ring, cap_ring, head;
	uint64_t next_seq;
};

int bd_kvpool_events_new(size_t replay_batches, const char *medium,
			 struct bd_kvpool_events **ret)
{
	struct bd_kvpool_events *e;

	if (!ret || !medium || strlen(medium) >= sizeof(e->medium))
		return -EINVAL;
	e = calloc(1, sizeof(*e));
	if (!e)
		return -ENOMEM;
	e->cap_ring = replay_batches ? replay_batches : 1;
	e->ring = calloc(e->cap_ring, sizeof(*e->ring));
	if (!e->ring) {
		free(e);
		return -ENOMEM;
	}
	strcpy(e->medium, medium);
	*ret = e;
	return 0;
}

static void drop_pending(struct bd_kvpool_events *e)
{
	for (size_t i = 0; i < e->n_pend; i++) {
		free(e->pend[i].hashes);
		free(e->pend[i].tokens);
	}
	e->n_pend = 0;
}

void bd_kvpool_events_free(struct bd_kvpool_events *e)
{
	if (!e)
		return;
	drop_pending(e);
	free(e->pend);
	for (size_t i = 0; i < e->cap_ring; i++)
		free(e->ring[i].data);
	free(e->ring);
	free(e);
}

void bd_kvpool_events_set_handler(struct bd_kvpool_events *e, const struct bd_kvpool_handler *h)
{
	if (e)
		e->h = h;
}

/* The event to extend with one more page of kind (the last one, when it continues it), or a
 * new one; NULL when out of memory. */
static struct ev *event_for(struct bd_kvpool_events *e, enum bd_kvpool_cache_event kind,
			    bool has_parent, uint64_t parent)
{
	struct ev *v = e->n_pend ? &e->pend[e->n_pend - 1] : NULL;

	if (v && v->kind == kind && kind == BD_KVPOOL_CACHE_REMOVED)
		return v;
	if (v && v->kind == kind && kind == BD_KVPOOL_CACHE_STORED && v->n && has_parent &&
	    v->hashes[v->n - 1] == parent)
		return v;
	if (e->n_pend == e->cap_pend) {
		size_t cap = e->cap_pend ? 2 * e->cap_pend : 8;
		struct ev *p = realloc(e->pend, cap * sizeof(*p));

		if (!p)
			return NULL;
		e->pend = p;
		e->cap_pend = cap;
	}
	v = &e->pend[e->n_pend++];
	*v = (struct ev){ .kind = kind, .parent = parent, .has_parent = has_parent };
	return v;
}

/* Appends hash (and, stored, its page's 128 tokens) to v. false when out of memory. */
static bool ev_add(struct ev *v, uint64_t hash, const int32_t *tokens)
{
	if (v->n == v->cap) {
		size_t cap = v->cap ? 2 * v->cap : 4;
		uint64_t *h = realloc(v->hashes, cap * sizeof(*h));

		if (!h)
			return false;
		v->hashes = h;
		if (v->kind == BD_KVPOOL_CACHE_STORED) {
			int32_t *t = realloc(v->tokens, cap * BD_PAGE_TOKENS * sizeof(*t));

			if (!t)
				return false;
			v->tokens = t;
		}
		v->cap = cap;
	}
	if (tokens)
		memcpy(v->tokens + v->n * BD_PAGE_TOKENS, tokens, BD_PAGE_TOKENS * sizeof(*tokens));
	v->hashes[v->n++] = hash;
	return true;
}

void bd_kvpool_events_hook(void *ctx, enum bd_kvpool_cache_event kind, uint64_t hash,
			   int32_t page)
{
	struct bd_kvpool_events *e = ctx;
	const struct bd_kvpool_handler *h = e->h;
	static const int32_t none[BD_PAGE_TOKENS];
	const int32_t *tokens = none;
	bool has_parent = false;
	uint64_t parent = 0;
	struct ev *v;

	if (kind == BD_KVPOOL_CACHE_CLEARED) {
		drop_pending(e);
		v = event_for(e, kind, false, 0);
		e->oom = !v;
		return;
	}
	if (kind == BD_KVPOOL_CACHE_STORED && h) {
		/* the page's place in the PrefixStore being applied: its tokens and parent */
		for (size_t i = 0; i < h->store_n; i++) {
			if (h->store_pages[i] != page || h->store_hashes[i] != hash)
				continue;
			parent = i ? h->store_hashes[i - 1] : h->store_parent;
			has_parent = parent != 0;
			if ((i + 1) * BD_PAGE_TOKENS <= h->store_n_tokens)
				tokens = h->store_tokens + i * BD_PAGE_TOKENS;
			break;
		}
	}
	v = event_for(e, kind, has_parent, parent);
	if (!v || !ev_add(v, hash, kind == BD_KVPOOL_CACHE_STORED ? tokens : NULL))
		e->oom = true;
}

static void pack_str(msgpack_packer *pk, const char *s)
{
	size_t n = strlen(s);

	msgpack_pack_str(pk, n);
	msgpack_pack_str_body(pk, s, n);
}

static void pack_hashes(msgpack_packer *pk, const struct ev *v)
{
	msgpack_pack_array(pk, v->n);
	for (size_t i = 0; i < v->n; i++)
		msgpack_pack_uint64(pk, v->hashes[i]);
}

static void pack_event(msgpack_packer *pk, const struct ev *v, const char *medium)
{
	switch (v->kind) {
	case BD_KVPOOL_CACHE_STORED:
		msgpack_pack_array(pk, 7);
		pack_str(pk, "BlockStored");
		pack_hashes(pk, v);
		if (v->has_parent)
			msgpack_pack_uint64(pk, v->parent);
		else
			msgpack_pack_nil(pk);
		msgpack_pack_array(pk, v->n * BD_PAGE_TOKENS);
		for (size_t i = 0; i < v->n * BD_PAGE_TOKENS; i++)
			msgpack_pack_int32(pk, v->tokens[i]);
		msgpack_pack_int32(pk, BD_PAGE_TOKENS);
		msgpack_pack_nil(pk); /* lora_id */
		pack_str(pk, medium);
		break;
	case BD_KVPOOL_CACHE_REMOVED:
		msgpack_pack_array(pk, 3);
		pack_str(pk, "BlockRemoved");
		pack_hashes(pk, v);
		pack_str(pk, medium);
		break;
	default:
		msgpack_pack_array(pk, 1);
		pack_str(pk, "AllBlocksCleared");
		break;
	}
}

int bd_kvpool_events_batch(struct bd_kvpool_events *e, double ts, uint64_t *ret_seq,
			   const uint8_t **ret_payload, size_t *ret_len)
{
	msgpack_sbuffer sb;
	msgpack_packer pk;
	struct batch *b;

	if (!e || !ret_seq || !ret_payload || !ret_len)
		return -EINVAL;
	if (!e->n_pend && !e->oom)
		return 0;
	msgpack_sbuffer_init(&sb);
	msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
	msgpack_pack_array(&pk, 3);
	msgpack_pack_double(&pk, ts);
	if (e->oom) {
		/* what was lost cannot be told: consumers start over from an empty cache */
		struct ev clr = { .kind = BD_KVPOOL_CACHE_CLEARED };

		msgpack_pack_array(&pk, 1);
		pack_event(&pk, &clr, e->medium);
	} else {
		msgpack_pack_array(&pk, e->n_pend);
		for (size_t i = 0; i < e->n_pend; i++)
			pack_event(&pk, &e->pend[i], e->medium);
	}
	msgpack_pack_int32(&pk, 0); /* data_parallel_rank: one pool is one replica */
	drop_pending(e);
	e->oom = false;
	if (!sb.data) {
		msgpack_sbuffer_destroy(&sb);
		e->oom = true;
		return -ENOMEM;
	}
	/* the ring keeps the newest cap_ring batches */
	b = &e->ring[e->head];
	free(b->data);
	b->seq = e->next_seq++;
	b->data = (uint8_t *)sb.data;
	b->len = sb.size;
	e->head = (e->head + 1) % e->cap_ring;
	if (e->n_ring < e->cap_ring)
		e->n_ring++;
	*ret_seq = b->seq;
	*ret_payload = b->data;
	*ret_len = b->len;
	return 1;
}

size_t bd_kvpool_events_replay(const struct bd_kvpool_events *e, uint64_t start,
			       void (*fn)(void *ctx, uint64_t seq, const uint8_t *p, size_t len),
			       void *ctx)
{
	size_t n = 0;

	if (!e || !fn)
		return 0;
	for (size_t k = 0; k < e->n_ring; k++) {
		const struct batch *b =
			&e->ring[(e->head + e->cap_ring - e->n_ring + k) % e->cap_ring];

		if (b->seq >= start) {
			fn(ctx, b->seq, b->data, b->len);
			n++;
		}
	}
	return n;
}
