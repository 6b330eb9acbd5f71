/* attach.c — kvpoold's check of an attach request (kvpool.h): the frame a worker sends on the
 * attach socket, decoded and checked before anything is handed out. */
#include <stdio.h>

#include "kvpool.h"
#include "kvpool.pb-c.h"

int bd_kvpool_attach_parse(const uint8_t *buf, size_t n, int tp, int32_t *ret_rank, char *err,
			   size_t cap)
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
		*ret_rank = req->rank;
		if (cap)
			err[0] = 0;
	}
	bdfp4__attach_request__free_unpacked(req, NULL);
	return code;
}
