/* pool_op.c — allocation requests packed as PoolRequest frames (bd_pool_op.h). */
#include <errno.h>
#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <string.h>

#include "pool/bd_pool_op.h"
#include "kvpool.pb-c.h"

/* the op kinds are the oneof's field numbers: keep them in step */
#define SAME(x) _Static_assert((int)BD_POOL_OP_##x == (int)BDFP4__POOL_REQUEST__OP_##x, #x)
SAME(PAGE_ALLOC);
SAME(PAGE_RESERVE);
SAME(PAGE_COMMIT);
SAME(PAGE_FREE);
SAME(PAGE_REF);
SAME(SLOT_ASSIGN);
SAME(SLOT_RELEASE);
SAME(REQUEST_RELEASE);
SAME(OWNER_RECLAIM);
SAME(STATS);
SAME(REQUESTS);
SAME(GROUP_REGISTER);
SAME(PREFIX_STORE);
SAME(PREFIX_MATCH);
SAME(PREFIX_CLEAR);
#undef SAME
_Static_assert(BD_POOL_OP_NONE == (int)BDFP4__POOL_REQUEST__OP__NOT_SET, "NONE");

/* Copies op's values into message m by field name: kvpool.proto gives a value the same name
 * and type in every message that carries it (request_id, owner, epoch, parent: uint64; n, top:
 * uint32; page, slot: int32; pages: repeated int32; hashes: repeated uint64), except tokens, by
 * type: the attach tokens of GroupRegister (bytes) and the token ids of PrefixStore (repeated
 * int32). Returns -EINVAL for any other field. */
static int put_fields(ProtobufCMessage *m, const struct bd_pool_op *op)
{
	const ProtobufCMessageDescriptor *d = m->descriptor;

	for (unsigned i = 0; i < d->n_fields; i++) {
		const ProtobufCFieldDescriptor *f = &d->fields[i];
		bool one = f->label != PROTOBUF_C_LABEL_REPEATED;
		uint8_t *p = (uint8_t *)m + f->offset;

		if (f->type == PROTOBUF_C_TYPE_UINT64 && one && !strcmp(f->name, "request_id"))
			*(uint64_t *)p = op->request_id;
		else if (f->type == PROTOBUF_C_TYPE_UINT64 && one && !strcmp(f->name, "owner"))
			*(uint64_t *)p = op->owner;
		else if (f->type == PROTOBUF_C_TYPE_UINT64 && one && !strcmp(f->name, "epoch"))
			*(uint64_t *)p = op->epoch;
		else if (f->type == PROTOBUF_C_TYPE_BYTES && one && !strcmp(f->name, "tokens"))
			*(ProtobufCBinaryData *)p = (ProtobufCBinaryData){ op->n_bytes,
									   (uint8_t *)op->bytes };
		else if (f->type == PROTOBUF_C_TYPE_UINT32 && one &&
			 (!strcmp(f->name, "n") || !strcmp(f->name, "top")))
			*(uint32_t *)p = op->n;
		else if (f->type == PROTOBUF_C_TYPE_INT32 && one &&
			 (!strcmp(f->name, "page") || !strcmp(f->name, "slot")))
			*(int32_t *)p = op->index;
		else if (f->type == PROTOBUF_C_TYPE_UINT64 && one && !strcmp(f->name, "parent"))
			*(uint64_t *)p = op->parent;
		else if (f->type == PROTOBUF_C_TYPE_INT32 && !one && !strcmp(f->name, "pages")) {
			*(size_t *)((uint8_t *)m + f->quantifier_offset) = op->n_pages;
			*(const int32_t **)p = op->pages;
		} else if (f->type == PROTOBUF_C_TYPE_INT32 && !one && !strcmp(f->name, "tokens")) {
			*(size_t *)((uint8_t *)m + f->quantifier_offset) = op->n_tokens;
			*(const int32_t **)p = op->tokens;
		} else if (f->type == PROTOBUF_C_TYPE_UINT64 && !one && !strcmp(f->name, "hashes")) {
			*(size_t *)((uint8_t *)m + f->quantifier_offset) = op->n_hashes;
			*(const uint64_t **)p = op->hashes;
		} else {
			return -EINVAL;
		}
	}
	return 0;
}

ssize_t bd_pool_op_pack(const struct bd_pool_op *op, void *buf, size_t cap)
{
	Bdfp4__PoolRequest req = BDFP4__POOL_REQUEST__INIT;
	_Alignas(max_align_t) uint8_t mem[128]; /* the member message, whichever it is */
	const ProtobufCFieldDescriptor *f;
	const ProtobufCMessageDescriptor *md;
	ProtobufCMessage *m = (ProtobufCMessage *)mem;
	size_t len;
	int e;

	if (!op || (!buf && cap) || (op->n_pages && !op->pages) || (op->n_bytes && !op->bytes) ||
	    (op->n_hashes && !op->hashes) || (op->n_tokens && !op->tokens) ||
	    (unsigned)op->kind >= BD_POOL_OP_COUNT)
		return -EINVAL;
	if (op->kind != BD_POOL_OP_NONE) {
		/* the oneof member numbered kind: its message, and where PoolRequest points at it */
		f = protobuf_c_message_descriptor_get_field(&bdfp4__pool_request__descriptor,
							    (unsigned)op->kind);
		md = f && f->type == PROTOBUF_C_TYPE_MESSAGE ? f->descriptor : NULL;
		if (!md || md->sizeof_message > sizeof(mem))
			return -EINVAL;
		protobuf_c_message_init(md, m);
		e = put_fields(m, op);
		if (e < 0)
			return e;
		*(ProtobufCMessage **)((uint8_t *)&req + f->offset) = m;
		req.op_case = (Bdfp4__PoolRequest__OpCase)op->kind;
	}
	req.client = op->client;
	req.call = op->call;
	len = bdfp4__pool_request__get_packed_size(&req);
	if (len > SSIZE_MAX)
		return -EMSGSIZE;
	if (len <= cap)
		bdfp4__pool_request__pack(&req, buf);
	return (ssize_t)len;
}

