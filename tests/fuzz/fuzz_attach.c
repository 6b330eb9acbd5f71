/* fuzz_attach.c — libFuzzer target for kvpoold's attach request check (kvpoold/attach.c,
 * bd_kvpool_attach_parse): the first frame any process that can connect to the attach socket
 * sends.
 *
 * Build and run: `make fuzz-attach`. The first byte picks the pool's TP size (1..8), the rest
 * is the frame. Checks: the answer is one of the four codes; a refusal carries a reason and a
 * success none; an accepted rank is in 0..tp-1, is the rank protobuf-c reads in the frame, and
 * *ret_rank is untouched on a refusal.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvpool.h"
#include "kvpool.pb-c.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char err[128];
	int32_t rank = -12345;
	int tp, code;

	if (size < 1)
		return 0;
	tp = data[0] % 8 + 1;
	memset(err, 'x', sizeof(err));
	code = bd_kvpool_attach_parse(data + 1, size - 1, tp, &rank, err, sizeof(err));
	if (!memchr(err, 0, sizeof(err)) || (code == BD_POOL_OK) != (err[0] == 0))
		abort();
	switch (code) {
	case BD_POOL_OK: {
		Bdfp4__AttachRequest *r = bdfp4__attach_request__unpack(NULL, size - 1, data + 1);

		if (!r || rank < 0 || rank >= tp || rank != r->rank ||
		    r->version != BD_POOL_PROTO_VERSION)
			abort();
		bdfp4__attach_request__free_unpacked(r, NULL);
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
