/* pool_test.c — the real-daemon tests' shared parts (pool_test.h). */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "pool_test.h"
#include "tmpdir.h"

void pt_init(struct pt_env *e, const char *prefix)
{
	const char *bin = getenv("BD_BIN");
	char exe[PATH_MAX - 16];
	ssize_t n;

	memset(e, 0, sizeof(*e));
	if (bin && *bin) {
		snprintf(e->bin, sizeof(e->bin), "%s", bin);
	} else {
		/* $(BUILD)/tests/unit → $(BUILD)/bin */
		n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
		cr_assert_gt(n, 0);
		exe[n] = 0;
		*strrchr(exe, '/') = 0;
		snprintf(e->bin, sizeof(e->bin), "%s/../bin", exe);
	}
	snprintf(e->kvpoold, sizeof(e->kvpoold), "%s/kvpoold", e->bin);
	cr_assert_eq(access(e->kvpoold, X_OK), 0, "no kvpoold at %s (set BD_BIN)", e->kvpoold);
	cr_assert_eq(td_make(e->dir, sizeof(e->dir), prefix), 0);
	snprintf(e->sock, sizeof(e->sock), "%s/kvpool.sock", e->dir);
	snprintf(e->endpoint, sizeof(e->endpoint), "ipc://%s/alloc.sock", e->dir);
	snprintf(e->notify, sizeof(e->notify), "%s/notify.sock", e->dir);
	snprintf(e->log, sizeof(e->log), "%s/kvpoold.log", e->dir);
}

void pt_fini(struct pt_env *e)
{
	if (td_remove(e->dir) < 0)
		fprintf(stderr, "could not remove %s\n", e->dir);
}

size_t pt_argv(const struct pt_env *e, const char **argv, size_t cap, bool own_config,
	       const char *const *geometry, const char *const *extra)
{
	const char *fixed[] = { "--socket", e->sock, "--endpoint", e->endpoint,
				"--status-interval-ms", "100", NULL };
	const char *const *lists[] = { fixed, geometry, extra };
	size_t n = 0;

	argv[n++] = e->kvpoold;
	if (!own_config)
		argv[n++] = "--no-config";
	for (size_t l = 0; l < 3; l++)
		for (size_t i = 0; lists[l] && lists[l][i]; i++) {
			cr_assert_lt(n + 1, cap, "too many kvpoold arguments");
			argv[n++] = lists[l][i];
		}
	argv[n] = NULL;
	return n;
}

bool pt_log_has(const struct pt_env *e, const char *what)
{
	static char buf[65536];
	FILE *f = fopen(e->log, "r");
	size_t n;

	if (!f)
		return false;
	n = fread(buf, 1, sizeof(buf) - 1, f);
	fclose(f);
	buf[n] = 0;
	return strstr(buf, what) != NULL;
}

struct bd_pool_conn *pt_conn(const struct pt_env *e)
{
	struct bd_pool_conn *c;

	cr_assert_eq(bd_pool_conn_new(e->endpoint, 5000, &c), 0);
	return c;
}

struct bd_pool_stats *pt_stats(struct bd_pool_conn *c)
{
	struct bd_pool_stats *s;
	int e = bd_pool_stats(c, 0, &s);

	cr_assert_eq(e, 0, "stats: %s", bd_pool_conn_error(c, NULL));
	return s;
}

int pt_group_register(const char *endpoint, uint64_t epoch, const uint8_t *tokens, int tp)
{
	struct bd_pool_conn *c;
	int e;

	if ((e = bd_pool_conn_new(endpoint, 5000, &c)) < 0)
		return e;
	e = bd_pool_group_register(c, 1, epoch, tokens, (size_t)tp);
	bd_pool_conn_free(c);
	return e;
}

int pt_group(const char *endpoint, int tp, uint8_t *ret_tokens, uint64_t *ret_epoch)
{
	static uint64_t n;
	uint8_t tokens[BD_POOL_MAX_TP * BD_POOL_TOKEN_BYTES];
	uint64_t epoch = (uint64_t)getpid() * 1000 + ++n;
	int e;

	if (tp < 1 || tp > BD_POOL_MAX_TP)
		return -EINVAL;
	if (getrandom(tokens, sizeof(tokens), 0) != (ssize_t)sizeof(tokens))
		return -EIO;
	e = pt_group_register(endpoint, epoch, tokens, tp);
	if (e == 0 && ret_tokens)
		memcpy(ret_tokens, tokens, (size_t)tp * BD_POOL_TOKEN_BYTES);
	if (e == 0 && ret_epoch)
		*ret_epoch = epoch;
	return e;
}

int pt_attach(const char *sock, const char *endpoint, int rank, char *err, size_t errlen,
	      struct bd_pool_attach **ret)
{
	uint8_t tokens[BD_POOL_MAX_TP * BD_POOL_TOKEN_BYTES];
	struct bd_pool_stats *s = NULL;
	struct bd_pool_conn *c;
	int tp, e;

	if ((e = bd_pool_conn_new(endpoint, 5000, &c)) < 0)
		return e;
	e = bd_pool_stats(c, 0, &s);
	bd_pool_conn_free(c);
	if (e < 0)
		return e;
	tp = (int)s->tp;
	bd_pool_stats_free(s);
	if ((e = pt_group(endpoint, tp, tokens, NULL)) < 0)
		return e;
	return bd_pool_attach(sock, rank,
			      rank >= 0 && rank < tp ? tokens + rank * BD_POOL_TOKEN_BYTES : tokens,
			      err, errlen, ret);
}
