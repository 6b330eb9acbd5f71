/* bd_names.h — an index by name over an array of records that each hold a NUL-terminated name
 * (the metadata keys and tensor names of GGUF and safetensors files): the records' addresses
 * sorted once by strcmp, then looked up by binary search. The index borrows the records: it
 * holds pointers into the array and into the names, which must outlive it.
 */
#ifndef BD_NAMES_H
#define BD_NAMES_H

#include <stddef.h>

struct bd_names {
	const void **sorted; /* [n] the records, by name (strcmp order) */
	size_t n;
	size_t name_off; /* where in a record its `const char *` name sits (offsetof) */
};

/* Indexes the n records of stride bytes at items, each named by the `const char *` at byte
 * name_off (no name NULL). Returns 0; -EINVAL (NULL ix, or items NULL with n > 0); -ENOMEM;
 * or -EEXIST when two records share a name, *ret_dup (may be NULL) then pointing at that name.
 * On failure *ix holds nothing (bd_names_free is a no-op on it). n = 0 gives an empty index. */
int bd_names_build(struct bd_names *ix, const void *items, size_t n, size_t stride,
		   size_t name_off, const char **ret_dup);

/* The record named name, or NULL (no such record, or ix or name NULL). O(log n) strcmp. */
const void *bd_names_find(const struct bd_names *ix, const char *name);

/* Frees the index (not the records) and zeroes *ix. NULL or a zeroed ix is a no-op. */
void bd_names_free(struct bd_names *ix);

#endif
