/* pool_test.h — what the real-daemon tests of kvpoold share (test_pool_daemon.c,
 * test_pool_restart.c): the binary from $BD_BIN, a private directory with the attach socket,
 * the ipc:// allocation endpoint and the log, kvpoold's command line, a client, its stats.
 */
#ifndef TEST_POOL_TEST_H
#define TEST_POOL_TEST_H

#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pool/bd_pool_client.h"

struct pt_env {
	char dir[40], sock[96], endpoint[128], notify[96], log[96];
	char bin[PATH_MAX];     /* the directory of kvpoold and kvpoolctl */
	char kvpoold[PATH_MAX + 16];
};

/* Finds the binaries ($BD_BIN, else ../bin beside this test binary), makes the directory
 * /tmp/<prefix>-XXXXXX and the paths in it (asserted). */
void pt_init(struct pt_env *e, const char *prefix);
/* Removes the directory. */
void pt_fini(struct pt_env *e);

/* kvpoold's command line into argv (cap entries, NULL-terminated): the binary, --no-config
 * unless own_config, the env's socket and endpoint, a 100 ms STATUS period, then the flags of
 * geometry and of extra (either may be NULL). Returns the arguments written. */
size_t pt_argv(const struct pt_env *e, const char **argv, size_t cap, bool own_config,
	       const char *const *geometry, const char *const *extra);

/* True when the daemon's log (its first 64 KiB) holds what. */
bool pt_log_has(const struct pt_env *e, const char *what);

/* A connection to the env's endpoint (asserted), 5 s per call. */
struct bd_pool_conn *pt_conn(const struct pt_env *e);
/* The pool's stats (asserted), the daemon's default number of holders. */
struct bd_pool_stats *pt_stats(struct bd_pool_conn *c);

/* Registers the worker group of epoch with tokens (tp of BD_POOL_TOKEN_BYTES) under owner 1
 * through endpoint, as the router does (kvpool.proto GroupRegister). Not asserted (children
 * call it): returns 0 or -errno. */
int pt_group_register(const char *endpoint, uint64_t epoch, const uint8_t *tokens, int tp);
/* pt_group_register of a new epoch (unique to this process) with fresh random tokens, rank r's
 * into ret_tokens + r · BD_POOL_TOKEN_BYTES, the epoch into *ret_epoch (either may be NULL). */
int pt_group(const char *endpoint, int tp, uint8_t *ret_tokens, uint64_t *ret_epoch);
/* pt_group over every rank of the pool (its tp read from the stats), then bd_pool_attach of rank
 * with its token: what a worker does once the router answered its registration. Not asserted:
 * returns bd_pool_attach's result (err as it writes it). */
int pt_attach(const char *sock, const char *endpoint, int rank, char *err, size_t errlen,
	      struct bd_pool_attach **ret);

#endif
