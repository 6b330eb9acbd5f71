/* fuzz_attach.c — libFuzzer target for kvpoold's attach request check (kvpoold/attach.c,
 * bd_kvpool_attach_parse, then bd_kvpool_attach_token): the first frame any process that can
 * connect to the attach socket sends.
 *
 * Build and run: `make fuzz-attach`. The first byte picks the pool's TP size (1..8) and whether
 * a group is registered, the rest is the frame. Checks: the answer is one of the four codes; a
 * refusal carries a reason and a success none; an accepted rank is in 0..tp-1, is the rank
 * protobuf-c reads in the frame, and *ret is untouched on a refusal; the token check opens an
 * attachment only for the registered group's token of the rank (rank r's token is bytes
 * 32·r + i, i < 32, in the seeds' group), once, and counts every refusal.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvpool.h"
#include "kvpool.pb-c.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* The token check of an accepted request against a group of tp ranks (registered or not). */
static void check_token(const struct bd_kvpool_attach_req *req, int tp, bool registered)
{
	static struct bd_kvpool_handler h;
	uint8_t tokens[8 * BD_POOL_TOKEN_BYTES];
	char err[200];
	bool want;
	int code;

	memset(&h, 0, sizeof(h));
	h.tp = (uint32_t)tp;
	for (size_t i = 0; i < sizeof(tokens); i++)
		tokens[i] = (uint8_t)i;
	if (registered &&
	    bd_kvpool_group_register(&h, 1, 7, tokens, (size_t)tp * BD_POOL_TOKEN_BYTES, err,
				     sizeof(err)) != 0)
		abort();
	want = registered && req->token_len == BD_POOL_TOKEN_BYTES &&
	       !memcmp(req->token, tokens + req->rank * BD_POOL_TOKEN_BYTES, BD_POOL_TOKEN_BYTES);
	memset(err, 'x', sizeof(err));
	code = bd_kvpool_attach_token(&h.group, req, 42, err, sizeof(err));
	if ((code == BD_POOL_OK) != want || (code != BD_POOL_OK && code != BD_POOL_ERR_TOKEN) ||
	    !memchr(err, 0, sizeof(err)) || (code == BD_POOL_OK) != (err[0] == 0) ||
	    h.group.refused != (want ? 0u : 1u))
		abort();
	/* a token opens one attachment */
	if (want && (bd_kvpool_attach_token(&h.group, req, 43, err, sizeof(err)) !=
			     BD_POOL_ERR_TOKEN ||
		     h.group.refused != 1))
		abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char err[200];
	struct bd_kvpool_attach_req req = { .rank = -12345 };
	int32_t rank;
	int tp, code;

	if (size < 1)
		return 0;
	tp = data[0] % 8 + 1;
	memset(err, 'x', sizeof(err));
	code = bd_kvpool_attach_parse(data + 1, size - 1, tp, &req, err, sizeof(err));
	rank = req.rank;
	if (!memchr(err, 0, sizeof(err)) || (code == BD_POOL_OK) != (err[0] == 0))
		abort();
	switch (code) {
	case BD_POOL_OK: {
		Bdfp4__AttachRequest *r = bdfp4__attach_request__unpack(NULL, size - 1, data + 1);

		if (!r || rank < 0 || rank >= tp || rank != r->rank ||
		    r->version != BD_POOL_PROTO_VERSION || req.token_len != r->token.len ||
		    req.geometry_only != r->geometry_only)
			abort();
		bdfp4__attach_request__free_unpacked(r, NULL);
		check_token(&req, tp, data[0] & 0x80);
		break;
	}
	case BD_POOL_ERR_MALFORMED:
	case BD_POOL_ERR_VERSION:
	case BD_POOL_ERR_NO_DEVICE:
		if (rank != -12345)
			abort();
		break;
	default:
		abort();
	}
	return 0;
}
