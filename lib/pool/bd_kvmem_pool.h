/* bd_kvmem_pool.h — KV memory over a kvpoold attachment: the pages and slots of the arena a
 * worker attached (bd_pool_client.h), as a bd_kvmem (bd_kvmem.h) whose slot and pages the
 * step plans name.
 */
#ifndef BD_KVMEM_POOL_H
#define BD_KVMEM_POOL_H

#include "model/bd_kvmem.h"
#include "pool/bd_pool_client.h"

#ifdef __cplusplus
extern "C" {
#endif

/* An ext kvmem (bd_kvmem_ext_new) over the arena of attachment a, CPU backend: its layout,
 * pages and slots. The attachment must outlive the kvmem; free it with bd_kvmem_ext_free().
 * Returns 0, -EINVAL (NULL, nothing mapped: a CUDA arena), -ENOMEM. */
int bd_kvmem_pool_new(const struct bd_pool_attach *a, struct bd_kvmem **ret);

#ifdef __cplusplus
}
#endif
#endif
