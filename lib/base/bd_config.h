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
#include <stdio.h>

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

/* Parses a boolean as bd_config_get_bool does. Returns 0 or -EINVAL (*ret unchanged). */
int bd_config_parse_bool(const char *s, bool *ret);

/* ---- a daemon's command line ----------------------------------------------------------------- */

/* Where bd_daemon_read_opts (bd_daemon.h) stores a key's value in a daemon's options struct. */
enum bd_config_type {
	BD_CONFIG_CODE = 0, /* not stored: the daemon's code reads it (a list, a name to resolve) */
	BD_CONFIG_STR,      /* const char *: the text, living as long as the configuration */
	BD_CONFIG_INT,      /* a 4- or 8-byte integer in [min, max] */
	BD_CONFIG_BYTES,    /* a 4- or 8-byte byte count in [min, max], K/M/G/T suffixes allowed */
	BD_CONFIG_DOUBLE,   /* a double in [min, max] */
	BD_CONFIG_BOOL,     /* a bool */
};

/* One key of a daemon's section: also the flag --NAME (an underscore spelled as a dash). def is
 * the value when neither the file nor a flag sets it; flag: a boolean whose flag may come
 * without a value (--synthetic-prefill means true). type, offset, size, min and max say where
 * and how bd_daemon_read_opts stores the value (BD_CONFIG_FIELD and BD_CONFIG_TEXT fill them);
 * a key without them is BD_CONFIG_CODE. A key table ends with a { NULL } entry. */
struct bd_config_key {
	const char *name, *def, *help;
	bool flag;
	enum bd_config_type type;
	size_t offset, size; /* of the field in the options struct */
	int64_t min, max;    /* the allowed range of INT, BYTES and DOUBLE */
};

/* The storage part of a key: field of struct type st, of type t (INT, BYTES, DOUBLE or BOOL),
 * allowed in [lo, hi] (ignored for BOOL). The field's C type is checked: an integer type for
 * INT and BYTES, double for DOUBLE, bool for BOOL. */
#define BD_CONFIG_FIELD(t, st, field, lo, hi)                                                  \
	.type = BD_CONFIG_##t, .offset = BD_CONFIG_CHECK_##t(st, field),                        \
	.size = sizeof(((st *)0)->field), .min = (lo), .max = (hi)
/* The storage part of a text key: field of struct type st is a const char *. */
#define BD_CONFIG_TEXT(st, field)                                                              \
	.type = BD_CONFIG_STR,                                                                  \
	.offset = _Generic(((st *)0)->field, const char *: offsetof(st, field)),                \
	.size = sizeof(const char *)

#define BD_CONFIG_CHECK_INT(st, field)                                                         \
	_Generic(((st *)0)->field, int: offsetof(st, field), unsigned: offsetof(st, field),     \
		 long: offsetof(st, field), unsigned long: offsetof(st, field))
#define BD_CONFIG_CHECK_BYTES BD_CONFIG_CHECK_INT
#define BD_CONFIG_CHECK_DOUBLE(st, field) _Generic(((st *)0)->field, double: offsetof(st, field))
#define BD_CONFIG_CHECK_BOOL(st, field) _Generic(((st *)0)->field, bool: offsetof(st, field))

#define BD_CONFIG_MAX_KEYS 64

/* The command line of a daemon: --config PATH (default default_path: a missing default file is
 * no error, a missing named one is), --no-config, --help, and --NAME VALUE or --NAME=VALUE for
 * every key of keys, which override the file's [section]. The file is read first, then the flags
 * are set in order (the last of a repeated flag wins). Uses getopt_long (optind reset, opterr
 * off). Returns 0; 1 when --help was given (nothing loaded); -EINVAL for an unknown flag, a
 * missing value or a stray argument, -EBADMSG for a syntax error in the file, -errno of opening a
 * named file, -ENOMEM; err (errlen bytes, may be NULL) then says what, with the file name and
 * line where there is one. */
int bd_config_parse_args(struct bd_config *c, const char *section,
			 const struct bd_config_key *keys, const char *default_path, int argc,
			 char **argv, char *err, size_t errlen);

/* Writes "usage: PROG [--config PATH | --no-config] [--KEY=VALUE ...]", the line about, and one
 * line per key with its help and default to f. about may be NULL. */
void bd_config_usage(FILE *f, const char *prog, const char *about, const char *section,
		     const struct bd_config_key *keys);

/* The value of section.name, else the key's default in keys, else "". */
const char *bd_config_str(const struct bd_config *c, const char *section,
			  const struct bd_config_key *keys, const char *name);

/* The first key set in section that keys does not list, or NULL (a typo is refused, not
 * silently ignored). */
const char *bd_config_unknown(const struct bd_config *c, const char *section,
			      const struct bd_config_key *keys);

#ifdef __cplusplus
}
#endif
#endif
