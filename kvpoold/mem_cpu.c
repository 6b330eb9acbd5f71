/* mem_cpu.c — the CPU memory backend: memfd arenas (kvpool.h).
 *
 * Each chunk is a memfd sized with ftruncate and then sealed against shrinking (a worker that
 * mapped it would otherwise fault on a truncated page), growing and further sealing. The pages
 * are touched by whoever writes first; the daemon never maps them.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvpool.h"

static int cpu_supported(int n_devices, char *err, size_t errlen)
{
	int fd;

	if (n_devices < 1) {
		snprintf(err, errlen, "no devices asked for");
		return -EINVAL;
	}
	fd = memfd_create("bdfp4-kvpool-probe", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0) {
		int e = -errno;

		snprintf(err, errlen, "memfd_create: %s", strerror(errno));
		return e;
	}
	close(fd);
	return 0;
}

static int cpu_device_memory(int device, uint64_t *ret, char *err, size_t errlen)
{
	long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGESIZE);

	(void)device;
	if (pages <= 0 || size <= 0) {
		snprintf(err, errlen, "cannot read the physical memory size");
		return -EIO;
	}
	*ret = (uint64_t)pages * (uint64_t)size;
	return 0;
}

static int cpu_granularity(int device, size_t *ret, char *err, size_t errlen)
{
	long size = sysconf(_SC_PAGESIZE);

	(void)device;
	if (size <= 0 || (size & (size - 1))) {
		snprintf(err, errlen, "odd page size %ld", size);
		return -EIO;
	}
	*ret = (size_t)size;
	return 0;
}

static void cpu_arena_destroy(struct bd_kvpool_arena *a)
{
	if (!a)
		return;
	for (size_t i = 0; i < a->n_chunks; i++)
		if (a->chunks[i].fd >= 0)
			close(a->chunks[i].fd);
	a->n_chunks = 0;
	a->bytes = 0;
}

static int cpu_arena_create(int device, const struct bd_kvpool_plan *plan,
			    struct bd_kvpool_arena *ret, char *err, size_t errlen)
{
	char name[48];
	int e;

	if (!plan || !ret || plan->n_chunks < 1 || plan->n_chunks > BD_POOL_MAX_CHUNKS)
		return -EINVAL;
	memset(ret, 0, sizeof(*ret));
	ret->device = -1;
	for (size_t i = 0; i < plan->n_chunks; i++) {
		size_t bytes = bd_kvpool_plan_chunk(plan, i);
		int fd;

		snprintf(name, sizeof(name), "bdfp4-kvpool-r%d-c%zu", device, i);
		fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
		if (fd < 0) {
			e = -errno;
			snprintf(err, errlen, "memfd_create: %s", strerror(errno));
			goto fail;
		}
		ret->chunks[i] = (struct bd_kvpool_chunk){ .fd = fd, .bytes = bytes };
		ret->n_chunks = i + 1;
		if (ftruncate(fd, (off_t)bytes) < 0 ||
		    fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) {
			e = -errno;
			snprintf(err, errlen, "sizing and sealing a memfd of %zu bytes: %s", bytes,
				 strerror(errno));
			goto fail;
		}
		ret->bytes += bytes;
	}
	return 0;
fail:
	cpu_arena_destroy(ret);
	return e;
}

/* The chunks of an earlier run: each must still be the sealed memfd of its size that
 * cpu_arena_create made (a worker's mapping of it must not shrink under it). */
static int cpu_arena_adopt(int device, const struct bd_kvpool_plan *plan, const int *fds,
			   struct bd_kvpool_arena *ret, char *err, size_t errlen)
{
	const int need = F_SEAL_SHRINK | F_SEAL_GROW;

	(void)device;
	if (!plan || !fds || !ret || plan->n_chunks < 1 || plan->n_chunks > BD_POOL_MAX_CHUNKS)
		return -EINVAL;
	for (size_t i = 0; i < plan->n_chunks; i++) {
		size_t bytes = bd_kvpool_plan_chunk(plan, i);
		int seals = fcntl(fds[i], F_GET_SEALS);
		struct stat st;

		if (fstat(fds[i], &st) < 0 || !S_ISREG(st.st_mode) || seals < 0 ||
		    (seals & need) != need || (uint64_t)st.st_size != bytes) {
			snprintf(err, errlen, "chunk %zu is not a sealed memfd of %zu bytes", i,
				 bytes);
			return -EBADMSG;
		}
	}
	memset(ret, 0, sizeof(*ret));
	ret->device = -1;
	for (size_t i = 0; i < plan->n_chunks; i++) {
		ret->chunks[i] = (struct bd_kvpool_chunk){ .fd = fds[i],
							   .bytes = bd_kvpool_plan_chunk(plan, i) };
		ret->bytes += ret->chunks[i].bytes;
	}
	ret->n_chunks = plan->n_chunks;
	return 0;
}

const struct bd_kvpool_mem_ops bd_kvpool_mem_cpu = BD_KVPOOL_MEM_OPS(cpu, "cpu");

const struct bd_kvpool_mem_ops *bd_kvpool_mem_find(const char *name)
{
	if (!name)
		return NULL;
	if (!strcmp(name, bd_kvpool_mem_cpu.name))
		return &bd_kvpool_mem_cpu;
	if (!strcmp(name, bd_kvpool_mem_cuda.name))
		return &bd_kvpool_mem_cuda;
	return NULL;
}
