/* bd_config.h — the INI configuration of the daemons (/etc/bdfp4/bdfp4.conf).
 *
 * One file, one section per daemon ([pool], [router], [worker]). The file is read with libinih
 * into a list of (section, key, value) strings; a daemon then overrides keys from its command-
 * line flags with bd_config_set() and reads typed values with the getters, which check ranges.
 * Later assignments of a key replace earlier ones. Not thread-safe; one owner.
 */
#ifndef BD_CONFIG_H
#define BD_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define BD_CONFIG_DEFAULT_PATH "/etc/bdfp4/bdfp4.conf"

struct bd_config;

/* An empty configuration, or NULL when out of memory. */
struct bd_config *bd_config_new(void);

/* Frees c and every string it holds; NULL is accepted. */
void bd_config_free(struct bd_config *c);

/* Adds every key of the INI file at path (sections and keys are case-sensitive; values are
 * trimmed). Returns 0; -ENOENT (or another -errno) when the file cannot be opened; -EINVAL on a
 * syntax error, with *ret_line (if not NULL) set to the first bad line; -ENOMEM. On error, c
 * keeps the keys read before the bad line. */
int bd_config_load(struct bd_config *c, const char *path, int *ret_line);

/* The same, from an INI text in memory. */
int bd_config_load_string(struct bd_config *c, const char *text, int *ret_line);

/* Sets section.key to a copy of value, replacing an earlier value. Returns 0, -EINVAL (NULL or
 * empty section or key, NULL value), -ENOMEM (c unchanged). */
int bd_config_set(struct bd_config *c, const char *section, const char *key, const char *value);

/* The value of section.key, or NULL when it was never set. The string lives until the key is
 * set again or c is freed. */
const char *bd_config_get(const struct bd_config *c, const char *section, const char *key);

/* The first key of section that is not in the NULL-terminated list known, or NULL when every
 * key is known (daemons refuse unknown keys so that a typo is not silently ignored). */
const char *bd_config_unknown_key(const struct bd_config *c, const char *section,
				  const char *const *known);

/* Typed getters: *ret is def when the key is not set. Errors: -EINVAL when the value does not
 * parse (trailing garbage included), -ERANGE when it is outside [min, max]; *ret is unchanged
 * on error. */
int bd_config_get_i64(const struct bd_config *c, const char *section, const char *key,
		      int64_t def, int64_t min, int64_t max, int64_t *ret);

/* A byte size: a non-negative integer with an optional suffix K, M, G or T (powers of 1024,
 * optionally followed by "iB" or "B", case-insensitive), e.g. "512M", "2GiB", "4096". */
int bd_config_get_bytes(const struct bd_config *c, const char *section, const char *key,
			uint64_t def, uint64_t min, uint64_t max, uint64_t *ret);

/* A finite double in [min, max]. */
int bd_config_get_double(const struct bd_config *c, const char *section, const char *key,
			 double def, double min, double max, double *ret);

/* A boolean: 1/0, true/false, yes/no, on/off (case-insensitive). */
int bd_config_get_bool(const struct bd_config *c, const char *section, const char *key, bool def,
		       bool *ret);

/* Parses a byte size as bd_config_get_bytes does. Returns 0, -EINVAL, -ERANGE (overflow). */
int bd_config_parse_bytes(const char *s, uint64_t *ret);

#ifdef __cplusplus
}
#endif
#endif
