/* attach.c — kvpoold's check of an attach request (kvpool.h): the frame a worker sends on the
 * attach socket, decoded and checked before anything is handed out, and the group epoch's
 * tokens that open an attachment. */
#include <stdio.h>

#include "kvpool.h"
#include "kvpool.pb-c.h"

int bd_kvpool_attach_parse(const uint8_t *buf, size_t n, int tp, struct bd_kvpool_attach_req *ret,
			   char *err, size_t cap)
{
	Bdfp4__AttachRequest *req = bdfp4__attach_request__unpack(NULL, n, buf);
	int code = BD_POOL_OK;

	if (!req) {
		snprintf(err, cap, "not an AttachRequest");
		return BD_POOL_ERR_MALFORMED;
	}
	if (req->version != BD_POOL_PROTO_VERSION) {
		snprintf(err, cap, "protocol version %u, kvpoold speaks %d", req->version,
			 BD_POOL_PROTO_VERSION);
		code = BD_POOL_ERR_VERSION;
	} else if (req->rank < 0 || req->rank >= tp) {
		snprintf(err, cap, "rank %d: the pool has ranks 0..%d", req->rank, tp - 1);
		code = BD_POOL_ERR_NO_DEVICE;
	} else {
		*ret = (struct bd_kvpool_attach_req){ .rank = req->rank,
						      .geometry_only = req->geometry_only,
						      .token_len = req->token.len };
		if (req->token.len) /* data is NULL without bytes */
			memcpy(ret->token, req->token.data,
			       req->token.len < sizeof(ret->token) ? req->token.len
								    : sizeof(ret->token));
		if (cap)
			err[0] = 0;
	}
	bdfp4__attach_request__free_unpacked(req, NULL);
	return code;
}

/* a and b (n bytes) equal, in a time that does not depend on where they differ */
static bool same_bytes(const uint8_t *a, const uint8_t *b, size_t n)
{
	uint8_t d = 0;

	for (size_t i = 0; i < n; i++)
		d |= a[i] ^ b[i];
	return d == 0;
}

int bd_kvpool_attach_token(struct bd_kvpool_group *g, const struct bd_kvpool_attach_req *req,
			   int32_t pid, char *err, size_t cap)
{
	int32_t r = req->rank;

	if (!g->epoch)
		snprintf(err, cap, "no worker group is registered (the router registers each "
			 "epoch's attach tokens): rank %d refused", r);
	else if (r < 0 || (uint32_t)r >= g->tp)
		snprintf(err, cap, "rank %d is not in the group of epoch %llu (%u ranks)", r,
			 (unsigned long long)g->epoch, g->tp);
	else if (req->token_len == 0)
		snprintf(err, cap, "no attach token: rank %d needs its token of epoch %llu (the "
			 "router's RegisterReply)", r, (unsigned long long)g->epoch);
	else if (req->token_len != BD_POOL_TOKEN_BYTES ||
		 !same_bytes(req->token, g->tokens[r], BD_POOL_TOKEN_BYTES))
		snprintf(err, cap, "the token is not rank %d's of epoch %llu (a wrong token, or "
			 "one of an earlier epoch)", r, (unsigned long long)g->epoch);
	else if (g->spent_by[r])
		snprintf(err, cap, "rank %d's token of epoch %llu was used already (by pid %d)",
			 r, (unsigned long long)g->epoch, (int)g->spent_by[r]);
	else {
		g->spent_by[r] = pid ? pid : -1;
		if (cap)
			err[0] = 0;
		return BD_POOL_OK;
	}
	g->refused++;
	return BD_POOL_ERR_TOKEN;
}

int bd_kvpool_group_register(struct bd_kvpool_handler *h, uint64_t owner, uint64_t epoch,
			     const uint8_t *tokens, size_t n_tokens, char *err, size_t cap)
{
	struct bd_kvpool_group *g = &h->group;
	size_t tp = n_tokens / BD_POOL_TOKEN_BYTES;

	if (h->peer_known && !h->peer_admin) {
		snprintf(err, cap, "uid %u may not register a worker group: root and kvpoold's "
			 "uid may", h->peer_uid);
		return -BD_POOL_ERR_DENIED;
	}
	if (!epoch || !tokens || !tp || n_tokens % BD_POOL_TOKEN_BYTES || tp > BD_POOL_MAX_TP ||
	    (h->tp && tp != h->tp)) {
		snprintf(err, cap, "a group of epoch %llu with %zu token bytes: want a non-zero "
			 "epoch and %u tokens of %d bytes", (unsigned long long)epoch, n_tokens,
			 h->tp, BD_POOL_TOKEN_BYTES);
		return -BD_POOL_ERR_INVALID;
	}
	if (g->epoch == epoch && g->owner == owner && g->tp == tp &&
	    same_bytes(&g->tokens[0][0], tokens, n_tokens))
		return 0; /* a repeat: the tokens used stay used */
	g->epoch = epoch;
	g->owner = owner;
	g->tp = (uint32_t)tp;
	memcpy(g->tokens, tokens, n_tokens);
	memset(g->spent_by, 0, sizeof(g->spent_by));
	if (cap)
		err[0] = 0;
	return 0;
}
