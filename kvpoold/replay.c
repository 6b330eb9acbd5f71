/* replay.c — the last pool-changing call of each client and its reply (kvpool.h).
 *
 * A client that got no answer sends its call again (kvpool.proto's client and call); if the
 * first copy was applied, the daemon must answer the repeat with the reply the first one got,
 * not apply it twice. One entry per client holds that call and its reply; a table of a few
 * dozen clients (the router, kvpoolctl runs) is scanned linearly. The daemon saves the table in
 * its state record with the change it answers, so that the protection holds across a restart:
 * a reply lost with a killed kvpoold is found again by the restarted one.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "kvpool.h"

struct entry {
	uint64_t client, call;
	uint64_t used; /* the table's clock at the last put: the least recent one makes room */
	uint32_t len;
};

/* One allocation: the table, its entries, then their replies. */
struct bd_kvpool_replay {
	size_t n_clients, reply_max, n;
	uint64_t clock, changes;
	struct entry *e;   /* [n_clients], the first n in use */
	uint8_t *replies;  /* [n_clients][reply_max] */
};

int bd_kvpool_replay_new(size_t n_clients, size_t reply_max, struct bd_kvpool_replay **ret)
{
	struct bd_kvpool_replay *r;

	if (!ret || n_clients < 1 || n_clients > 4096 || reply_max < 1 ||
	    reply_max > (64u << 20) / n_clients)
		return -EINVAL;
	/* at most 64 MiB of replies and 4096 entries: no overflow */
	r = calloc(1, sizeof(*r) + n_clients * sizeof(*r->e) + n_clients * reply_max);
	if (!r)
		return -ENOMEM;
	r->n_clients = n_clients;
	r->reply_max = reply_max;
	r->e = (struct entry *)(r + 1);
	r->replies = (uint8_t *)(r->e + n_clients);
	*ret = r;
	return 0;
}

void bd_kvpool_replay_free(struct bd_kvpool_replay *r)
{
	free(r);
}

size_t bd_kvpool_replay_reply_max(uint32_t max_pages_per_request)
{
	/* the packed page ids (5 bytes each at most), the other fields and their tags; refusals
	 * are not kept (they changed nothing, so a repeat of one may be applied) */
	return 5 * (size_t)max_pages_per_request + 64;
}

static struct entry *find(const struct bd_kvpool_replay *r, uint64_t client)
{
	for (size_t i = 0; i < r->n; i++)
		if (r->e[i].client == client)
			return &r->e[i];
	return NULL;
}

int bd_kvpool_replay_find(const struct bd_kvpool_replay *r, uint64_t client, uint64_t call,
			  const uint8_t **ret_reply, size_t *ret_len)
{
	const struct entry *e = r && client ? find(r, client) : NULL;

	if (!e || call > e->call)
		return 0;
	if (call < e->call)
		return -ESTALE;
	*ret_reply = r->replies + (size_t)(e - r->e) * r->reply_max;
	*ret_len = e->len;
	return 1;
}

int bd_kvpool_replay_put(struct bd_kvpool_replay *r, uint64_t client, uint64_t call,
			 const uint8_t *reply, size_t len)
{
	struct entry *e;

	if (!r || !client || (len && !reply))
		return -EINVAL;
	if (len > r->reply_max)
		return -EMSGSIZE;
	e = find(r, client);
	if (!e && r->n < r->n_clients)
		e = &r->e[r->n++];
	if (!e) {
		e = &r->e[0];
		for (size_t i = 1; i < r->n; i++)
			if (r->e[i].used < e->used)
				e = &r->e[i];
	}
	*e = (struct entry){ .client = client, .call = call, .used = ++r->clock,
			     .len = (uint32_t)len };
	if (len)
		memcpy(r->replies + (size_t)(e - r->e) * r->reply_max, reply, len);
	r->changes++;
	return 0;
}

uint64_t bd_kvpool_replay_changes(const struct bd_kvpool_replay *r)
{
	return r ? r->changes : 0;
}

/* an entry's fixed part: client, call, used, reply length */
#define ENTRY_BYTES (3 * sizeof(uint64_t) + sizeof(uint32_t))

size_t bd_kvpool_replay_save_max(size_t n_clients, size_t reply_max)
{
	size_t each, total;

	if (__builtin_add_overflow(reply_max, ENTRY_BYTES, &each) ||
	    __builtin_mul_overflow(each, n_clients, &total) ||
	    __builtin_add_overflow(total, sizeof(uint64_t) + sizeof(uint32_t), &total))
		return 0;
	return total;
}

ssize_t bd_kvpool_replay_save(const struct bd_kvpool_replay *r, void *buf, size_t cap)
{
	struct bd_kvpool_cur c = { .w = buf, .len = cap, .ok = buf != NULL };
	uint32_t n;

	if (!r)
		return -EINVAL;
	n = (uint32_t)r->n;
	bd_kvpool_put(&c, &r->clock, sizeof(r->clock));
	bd_kvpool_put(&c, &n, sizeof(n));
	for (size_t i = 0; i < r->n; i++) {
		const struct entry *e = &r->e[i];

		bd_kvpool_put(&c, &e->client, sizeof(e->client));
		bd_kvpool_put(&c, &e->call, sizeof(e->call));
		bd_kvpool_put(&c, &e->used, sizeof(e->used));
		bd_kvpool_put(&c, &e->len, sizeof(e->len));
		bd_kvpool_put(&c, r->replies + i * r->reply_max, e->len);
	}
	return c.ok ? (ssize_t)c.off : -ENOSPC;
}

ssize_t bd_kvpool_replay_load(struct bd_kvpool_replay *r, const void *buf, size_t len)
{
	struct bd_kvpool_cur c = { .r = buf, .len = len, .ok = buf != NULL };
	uint32_t n;

	if (!r)
		return -EINVAL;
	r->n = 0;
	bd_kvpool_get(&c, &r->clock, sizeof(r->clock));
	if (!bd_kvpool_get(&c, &n, sizeof(n)) || n > r->n_clients)
		goto bad;
	for (uint32_t i = 0; i < n; i++) {
		struct entry e;

		bd_kvpool_get(&c, &e.client, sizeof(e.client));
		bd_kvpool_get(&c, &e.call, sizeof(e.call));
		bd_kvpool_get(&c, &e.used, sizeof(e.used));
		if (!bd_kvpool_get(&c, &e.len, sizeof(e.len)) || e.len > r->reply_max ||
		    !e.client || find(r, e.client) ||
		    !bd_kvpool_get(&c, r->replies + i * r->reply_max, e.len))
			goto bad;
		r->e[r->n++] = e;
	}
	r->changes = 0;
	return (ssize_t)c.off;
bad:
	r->n = 0;
	return -EBADMSG;
}
