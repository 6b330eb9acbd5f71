/* state.c — kvpoold's allocation state in a sealed memfd, for the fd store (kvpool.h).
 *
 * Why a fixed region written in place rather than a new memfd per change: the state changes
 * with every allocation call, and a new memfd each time would mean a memfd_create, a seal and
 * two notification messages to PID 1 (FDSTOREREMOVE, FDSTORE) per call; here the memfd is
 * stored once at start and a change costs one copy of the record into mapped memory plus a
 * checksum over it (measured per call: kvpoold/README.md).
 *
 * Two record areas make the write atomic against a kill: the next record goes into the area
 * that does not hold the latest one, and its generation (the last field written, after a
 * release fence) makes it the latest. A kill before that store leaves the other area the latest,
 * intact; a reader never takes the older area when the newer one fails its checksum, since the
 * older one is a state the clients may have outgrown.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/bd_err.h"
#include "kvpool.h"

#define ALIGN 4096 /* the areas start on pages of their own */

struct bd_kvpool_state {
	int fd;
	uint8_t *map;
	size_t bytes;
	struct bd_kvpool_state_head *head;
};

/* A 64-bit checksum of n bytes in four independent multiply-xorshift lanes over 8-byte words
 * (several bytes per cycle; a CRC one byte at a time would cost more than the copy). Each step
 * is a bijection of the lane for a fixed word and of the word for a fixed lane, so records that
 * differ in one word always differ in the sum. Corruption detection only, not authentication. */
static uint64_t checksum(const uint8_t *p, size_t n)
{
	static const uint64_t K = 0x9e3779b97f4a7c15ull, M = 0xbf58476d1ce4e5b9ull;
	uint64_t h[4] = { n, n ^ K, n ^ M, n ^ (K + M) }, w, x;
	size_t i = 0;

	for (; i + 32 <= n; i += 32)
		for (int l = 0; l < 4; l++) {
			memcpy(&w, p + i + 8 * l, 8);
			h[l] = (h[l] ^ w) * M;
			h[l] ^= h[l] >> 31;
		}
	for (; i < n; i++) {
		h[0] = (h[0] ^ p[i]) * M;
		h[0] ^= h[0] >> 31;
	}
	x = K;
	for (int l = 0; l < 4; l++) {
		x = (x ^ h[l]) * M;
		x ^= x >> 29;
	}
	return x;
}

static struct bd_kvpool_state_area *area(const struct bd_kvpool_state *s, int k)
{
	return (struct bd_kvpool_state_area *)(s->map + s->head->area_off[k]);
}

/* The area holding the latest record (the higher generation; 0 when both are unwritten). */
static int latest(const struct bd_kvpool_state *s)
{
	uint64_t g0 = __atomic_load_n(&area(s, 0)->generation, __ATOMIC_ACQUIRE);
	uint64_t g1 = __atomic_load_n(&area(s, 1)->generation, __ATOMIC_ACQUIRE);

	return g1 > g0 ? 1 : 0;
}

static size_t round_up(size_t x, size_t a)
{
	return (x + a - 1) / a * a;
}

int bd_kvpool_state_create(size_t record_max, struct bd_kvpool_state **ret, char *err,
			   size_t errlen)
{
	struct bd_kvpool_state *s;
	size_t area_bytes;
	int e;

	if (!ret || record_max == 0 || record_max > ((size_t)1 << 40))
		return bd_errf(err, errlen, -EINVAL, "a state record of %zu bytes", record_max);
	s = calloc(1, sizeof(*s));
	if (!s)
		return -ENOMEM;
	area_bytes = round_up(sizeof(struct bd_kvpool_state_area) + record_max, ALIGN);
	s->bytes = ALIGN + 2 * area_bytes;
	s->fd = memfd_create("bdfp4-kvpool-state", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (s->fd < 0) {
		e = bd_errf(err, errlen, -errno, "memfd_create: %s", strerror(errno));
		free(s);
		return e;
	}
	/* a fixed size: the areas are written in place, never resized */
	if (ftruncate(s->fd, (off_t)s->bytes) < 0 ||
	    fcntl(s->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) {
		e = bd_errf(err, errlen, -errno, "sizing and sealing the state memfd (%zu bytes): %s",
			 s->bytes, strerror(errno));
		goto fail;
	}
	s->map = mmap(NULL, s->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd, 0);
	if (s->map == MAP_FAILED) {
		s->map = NULL;
		e = bd_errf(err, errlen, -errno, "mapping the state memfd: %s", strerror(errno));
		goto fail;
	}
	s->head = (struct bd_kvpool_state_head *)s->map;
	memcpy(s->head->magic, BD_KVPOOL_STATE_MAGIC, 8);
	s->head->version = BD_KVPOOL_STATE_VERSION;
	s->head->bom = BD_KVPOOL_STATE_BOM;
	s->head->area_cap = area_bytes - sizeof(struct bd_kvpool_state_area);
	s->head->area_off[0] = ALIGN;
	s->head->area_off[1] = ALIGN + area_bytes;
	*ret = s;
	return 0;
fail:
	bd_kvpool_state_free(s);
	return e;
}

int bd_kvpool_state_open(int fd, struct bd_kvpool_state **ret, char *err, size_t errlen)
{
	struct bd_kvpool_state *s;
	struct bd_kvpool_state_head h;
	struct stat st;
	int seals, e;

	if (!ret || fd < 0)
		return -EINVAL;
	if (fstat(fd, &st) < 0)
		return bd_errf(err, errlen, -EBADMSG, "the state fd: %s", strerror(errno));
	seals = fcntl(fd, F_GET_SEALS);
	if (!S_ISREG(st.st_mode) || seals < 0 || (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) !=
						 (F_SEAL_SHRINK | F_SEAL_GROW))
		return bd_errf(err, errlen, -EBADMSG, "the state fd is not a memfd sealed against "
			    "shrinking and growing");
	if ((uint64_t)st.st_size < sizeof(h) || pread(fd, &h, sizeof(h), 0) != sizeof(h))
		return bd_errf(err, errlen, -EBADMSG, "the state memfd is truncated (%lld bytes)",
			    (long long)st.st_size);
	if (memcmp(h.magic, BD_KVPOOL_STATE_MAGIC, 8) || h.bom != BD_KVPOOL_STATE_BOM)
		return bd_errf(err, errlen, -EBADMSG, "the state memfd has no state header");
	if (h.version != BD_KVPOOL_STATE_VERSION)
		return bd_errf(err, errlen, -EPROTONOSUPPORT,
			    "state record version %u, this kvpoold reads version %d", h.version,
			    BD_KVPOOL_STATE_VERSION);
	for (int k = 0; k < 2; k++) {
		uint64_t end;

		if (h.area_off[k] < sizeof(h) || h.area_off[k] % 8 ||
		    __builtin_add_overflow(h.area_off[k], sizeof(struct bd_kvpool_state_area), &end) ||
		    __builtin_add_overflow(end, h.area_cap, &end) || end > (uint64_t)st.st_size)
			return bd_errf(err, errlen, -EBADMSG,
				    "the state memfd is truncated: area %d ends past its %lld bytes",
				    k, (long long)st.st_size);
	}
	if (h.area_off[0] < h.area_off[1] ? h.area_off[0] + sizeof(struct bd_kvpool_state_area) +
						     h.area_cap > h.area_off[1]
					  : h.area_off[1] + sizeof(struct bd_kvpool_state_area) +
						     h.area_cap > h.area_off[0])
		return bd_errf(err, errlen, -EBADMSG, "the state memfd's areas overlap");
	s = calloc(1, sizeof(*s));
	if (!s)
		return -ENOMEM;
	s->bytes = (size_t)st.st_size;
	s->map = mmap(NULL, s->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (s->map == MAP_FAILED) {
		e = bd_errf(err, errlen, -EBADMSG, "mapping the state memfd: %s", strerror(errno));
		free(s);
		return e;
	}
	s->fd = fd;
	s->head = (struct bd_kvpool_state_head *)s->map;
	*ret = s;
	return 0;
}

void bd_kvpool_state_free(struct bd_kvpool_state *s)
{
	if (!s)
		return;
	if (s->map)
		munmap(s->map, s->bytes);
	if (s->fd >= 0)
		close(s->fd);
	free(s);
}

int bd_kvpool_state_fd(const struct bd_kvpool_state *s)
{
	return s ? s->fd : -EINVAL;
}

size_t bd_kvpool_state_record_max(const struct bd_kvpool_state_geo *geo)
{
	size_t a = bd_kvpool_alloc_save_max(geo->n_pages, geo->n_slots, geo->max_pages_per_request,
					    geo->max_requests);
	size_t r = bd_kvpool_replay_save_max(geo->replay_clients, geo->replay_reply_max);
	size_t total;

	if (!a || !r || __builtin_add_overflow(a, r, &total) ||
	    __builtin_add_overflow(total, sizeof(*geo), &total))
		return 0;
	return total;
}

int bd_kvpool_state_save(struct bd_kvpool_state *s, const struct bd_kvpool_state_geo *geo,
			 const struct bd_kvpool_replay *replay, const struct bd_kvpool_alloc *a)
{
	int k = 1 - latest(s);
	struct bd_kvpool_state_area *h = area(s, k);
	uint8_t *rec = (uint8_t *)(h + 1);
	size_t cap = s->head->area_cap, len = sizeof(*geo);
	uint64_t gen = area(s, 1 - k)->generation + 1;
	ssize_t n;

	if (cap < len)
		return -ENOSPC;
	memcpy(rec, geo, sizeof(*geo));
	n = bd_kvpool_replay_save(replay, rec + len, cap - len);
	if (n < 0)
		return (int)n;
	len += (size_t)n;
	n = bd_kvpool_alloc_save(a, rec + len, cap - len);
	if (n < 0)
		return (int)n;
	len += (size_t)n;
	/* until the generation below is stored, this area is the older one: a kill up to here
	 * leaves the other area the latest record */
	h->len = len;
	h->sum = checksum(rec, len);
	__atomic_store_n(&h->generation, gen, __ATOMIC_RELEASE);
	return 0;
}

/* The name and both values of the first geometry field that differs, into err. */
static int geo_differs(const struct bd_kvpool_state_geo *got, const struct bd_kvpool_state_geo *want,
		       char *err, size_t errlen)
{
#define U(f) { #f, offsetof(struct bd_kvpool_state_geo, f), sizeof(want->f) }
	static const struct {
		const char *name;
		size_t off, size;
	} num[] = {
		U(tp), U(page_format), U(n_layers), U(n_kv_heads), U(head_dim), U(d_rope),
		U(max_seq_len), U(max_pages_per_request), U(n_pages), U(n_slots), U(max_requests),
		U(page_bytes), U(slot_bytes), U(pages_offset), U(slots_offset), U(arena_bytes),
		U(n_chunks), U(chunk_bytes), U(last_chunk_bytes), U(replay_clients),
		U(replay_reply_max),
	};
#undef U

	if (strncmp(got->backend, want->backend, sizeof(want->backend)))
		return bd_errf(err, errlen, -ESTALE, "it was made for backend %.8s, this one is %.8s",
			    got->backend, want->backend);
	if (strncmp(got->kv_config, want->kv_config, sizeof(want->kv_config)))
		return bd_errf(err, errlen, -ESTALE, "it was made for kv_config %.32s, this one is "
			    "%.32s", got->kv_config, want->kv_config);
	for (size_t i = 0; i < sizeof(num) / sizeof(num[0]); i++) {
		uint64_t g = 0, w = 0;

		/* the field's value, of 4 or 8 bytes */
		if (num[i].size == 4) {
			uint32_t a, b;

			memcpy(&a, (const uint8_t *)got + num[i].off, 4);
			memcpy(&b, (const uint8_t *)want + num[i].off, 4);
			g = a;
			w = b;
		} else {
			memcpy(&g, (const uint8_t *)got + num[i].off, 8);
			memcpy(&w, (const uint8_t *)want + num[i].off, 8);
		}
		if (g != w)
			return bd_errf(err, errlen, -ESTALE, "its geometry differs: %s %llu stored, "
				    "%llu configured", num[i].name, (unsigned long long)g,
				    (unsigned long long)w);
	}
	return 0;
}

int bd_kvpool_state_load(struct bd_kvpool_state *s, const struct bd_kvpool_state_geo *want,
			 struct bd_kvpool_replay *replay, struct bd_kvpool_alloc *a,
			 uint8_t ret_arena_id[16], char *err, size_t errlen)
{
	int k = latest(s), e;
	const struct bd_kvpool_state_area *h = area(s, k);
	const uint8_t *rec = (const uint8_t *)(h + 1);
	struct bd_kvpool_state_geo got;
	size_t need = bd_kvpool_state_record_max(want), off;
	ssize_t n;

	if (!need || s->head->area_cap < need)
		return bd_errf(err, errlen, -ENOSPC, "its record areas hold %llu bytes, this "
			    "configuration's records take up to %zu",
			    (unsigned long long)s->head->area_cap, need);
	if (h->generation == 0)
		return bd_errf(err, errlen, -ENODATA, "no state record was written");
	if (h->len < sizeof(got) || h->len > s->head->area_cap)
		return bd_errf(err, errlen, -EBADMSG, "the record length %llu is out of range",
			    (unsigned long long)h->len);
	if (checksum(rec, h->len) != h->sum)
		return bd_errf(err, errlen, -EBADMSG, "the latest record (generation %llu, %llu "
			    "bytes) fails its checksum", (unsigned long long)h->generation,
			    (unsigned long long)h->len);
	memcpy(&got, rec, sizeof(got));
	e = geo_differs(&got, want, err, errlen);
	if (e < 0)
		return e;
	off = sizeof(got);
	n = bd_kvpool_replay_load(replay, rec + off, h->len - off);
	if (n < 0)
		return bd_errf(err, errlen, -EBADMSG, "the record's replay table does not read");
	off += (size_t)n;
	n = bd_kvpool_alloc_load(a, rec + off, h->len - off);
	if (n < 0 || off + (size_t)n != h->len) {
		e = bd_errf(err, errlen, n == -ENOMEM ? -ENOMEM : -EBADMSG, "the record's pool %s%s",
			 n < 0 ? "is refused: " : "is followed by stray bytes",
			 n < 0 ? bd_kvpool_alloc_error(a) : "");
		bd_kvpool_replay_load(replay, NULL, 0);
		bd_kvpool_alloc_load(a, NULL, 0);
		return e;
	}
	memcpy(ret_arena_id, got.arena_id, 16);
	return 0;
}
