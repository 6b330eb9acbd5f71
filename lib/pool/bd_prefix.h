/* bd_prefix.h — the hashes that name a prompt's full pages in kvpoold's prefix index
 * (kvpoold/kvpool.h "prefix caching", router/README.md "Prefix caching"): the router hashes
 * the prompts it admits, `bdfp4 kv-where` the prompt it looks for in KV event streams.
 *
 * Page j of a sequence holds positions 128·j … 128·j + 127 (NUMERICS.md §8). Its hash is
 *   h_j = the first 8 bytes (little-endian) of BLAKE2b-128(h_{j−1} as 8 bytes LE ‖ the
 *         tokens of page j as 128 little-endian int32),  h_{−1} = seed,
 * so a page's hash names its tokens and every token before it (the KV of a page depends on
 * the whole prefix). The seed names what else the bytes depend on: the model, the KV
 * configuration and page format of the pool, the workers' μ_k calibration (bd_prefix_seed),
 * then the request's own KV configuration and, when it has one, its cache salt
 * (bd_prefix_request_seed: bd_prefix_salted with each, in that order): requests of different
 * configurations or salts never share a page. A hash of 0 is made 1 (kvpoold reserves 0).
 */
#ifndef BD_PREFIX_H
#define BD_PREFIX_H

#include <stddef.h>
#include <stdint.h>

/* The seed of a serving configuration: the same hash of the strings model, kv_config and
 * page_format (each with its NUL) and calib_id (the workers' calibration identity, 0: none),
 * little-endian. */
uint64_t bd_prefix_seed(const char *model, const char *kv_config, const char *page_format,
			uint64_t calib_id);

/* The seed of a request with cache salt salt[len] (len 0: seed itself). */
uint64_t bd_prefix_salted(uint64_t seed, const char *salt, size_t len);

/* The seed of one request: seed (bd_prefix_seed) salted with the request's KV configuration
 * kv_config (its name as the request gives it, non-empty) and then with salt[salt_len] (the
 * cache salt; salt_len 0: none). */
uint64_t bd_prefix_request_seed(uint64_t seed, const char *kv_config, const char *salt,
				size_t salt_len);

/* ret[n_pages] = h_j for the n_pages full pages of toks[n_pages·128] (formula above). */
void bd_prefix_hashes(uint64_t seed, const int32_t *toks, int n_pages, uint64_t *ret);

#endif
