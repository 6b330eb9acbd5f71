/* growmap.h — workerd's CUDA backend, the pure part: serve.proto PlanRows mapped to the calls of
 * the stateless GPU model (bd_gmodel.h: struct bd_grow), and the small record every rank keeps
 * per request.
 *
 * bd_gmodel keeps no per-request state, so the plan is checked here, on the host, against what
 * the worker saw of the request before: the row's slot, position, block table and new pages
 * must be the ones its earlier steps made, and every id must lie inside the pool. The checks
 * depend only on the plan and on records built by the same plans, so every rank refuses the
 * same rows and makes the same collective calls. No CUDA here: it builds (and is unit-tested)
 * without a GPU.
 *
 * A row maps to one of three forms:
 *   WD_G_PREFILL      bd_gmodel_prefill of a prompt's first chunk (position 0: a new record) or
 *                     of a later chunk at a position p > 0, a multiple of 128, that continues
 *                     the record (its p tokens, slot and p/128 pages; row->new_pages promoted
 *                     in order as the chunk fills them);
 *   WD_G_FILL_DECODE  --synthetic-prefill: bd_gmodel_fill_synthetic of positions 0..n−2 (the
 *                     n_fill = n − 1 tokens complete the first (n−1)/128 new pages), then the
 *                     last prompt token decoded at position n − 1 with the step's decode rows
 *                     (promoting into the last new page when it completes one);
 *   WD_G_DECODE       one token at row->position in the step's decode batch.
 * A row marked resume (a group formed after a failure) first rebuilds the request's record from
 * the row over the KV the pool kept — slot, position tokens, the position/128 pages of its
 * block table, draws (the sampler's counter, so the draws continue where they stopped) —, then
 * maps as a chunk or a decode continuing it. A resume row with prefix_pages = k is a prefix
 * hit's first chunk: a new slot, the k leading pages of its block table shared from kvpoold's
 * prefix index, the chunk at 128·k (the rule is wd_row_prefix_sink's, workerd.h, the cpu
 * backend's too); its BF16 sink is rebuilt first (n_sink tokens of the row's context
 * prefilled at position 0 into the slot, no pages). Pointers in a mapped item point
 * into the plan row (valid while the plan lives).
 */
#ifndef BD_WORKERD_GROWMAP_H
#define BD_WORKERD_GROWMAP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cuda/bd_gmodel.h"
#include "serve.pb-c.h"

/* What a rank keeps of a request it serves. */
struct wd_greq {
	uint64_t id;
	int32_t slot;
	int n_tokens;       /* tokens the cache holds */
	int capacity;       /* prompt + max_tokens, as the prefill row said */
	int n_pages;        /* promoted pages, in token order */
	int32_t *pages;     /* [capacity / 128] */
	struct bd_sampler_params sp;
	uint64_t draws;     /* tokens sampled so far: the next draw's rng_step */
	bool busy;          /* named by a row of the step being mapped or run */
};

struct wd_gtab {
	struct wd_greq *r;
	size_t n, cap;
};

/* The limits a row is checked against: the pool's and the model's. */
struct wd_glimits {
	size_t n_pages, n_slots;  /* the pool's page and slot ids are 0..n−1 */
	int max_tokens;           /* longest sequence the model was built for (capacity bound) */
	int max_prefill;          /* longest prompt of one real prefill call */
	int n_vocab;
	bool synthetic;           /* --synthetic-prefill */
	const char *kv_config;    /* the pool's configuration: the only one a row may name */
};

enum wd_gkind { WD_G_PREFILL = 0, WD_G_FILL_DECODE = 1, WD_G_DECODE = 2 };

/* One plan row, mapped. */
struct wd_gitem {
	enum wd_gkind kind;
	uint64_t id;
	struct bd_grow g;        /* prefill: the row; decode and fill-decode: the decode row */
	const int32_t *tokens;   /* prefill: [n_tokens] the prompt */
	int n_tokens;
	int32_t token;           /* decode and fill-decode: the token fed at g.position */
	struct bd_grow fill;     /* fill-decode: the synthetic fill of n_fill tokens */
	int n_fill;              /* 0: nothing to fill (a one-token prompt) */
	bool sample;             /* rank 0 samples (row->sample) */
	const int32_t *sink_tokens; /* a prefix hit's first chunk: [n_sink] its first tokens */
	int n_sink;              /* 0, or min(16, the hit's context): prefilled at position 0 into
				  * the slot before the chunk, to rebuild the BF16 sink */
	uint32_t top_k;          /* logits_top_k, capped at WD_TOP_MAX */
	bool logprobs;           /* rank 0 reports log-probabilities (row->logprobs, sampling) */
	uint32_t top_logprobs;   /* with logprobs: row->top_logprobs capped at WD_LOGPROBS_MAX */
};

/* Empty table / every record dropped (Reset, a new epoch, exit). */
void wd_gtab_clear(struct wd_gtab *t);
struct wd_greq *wd_gtab_find(struct wd_gtab *t, uint64_t id);
/* Drops the record of request id (StepPlan.release); unknown ids are ignored. */
void wd_gtab_drop(struct wd_gtab *t, uint64_t id);

/* Checks row against lim and the records of t and fills *it. A prefill row at position 0
 * (re)creates the request's record (a preempted request starts over), a resume row rebuilds it
 * from the row, a later chunk or a decode row names an existing one; each marks it busy until
 * wd_gdone. A chunk is refused with --synthetic-prefill (the worker registers whole_prompts, so
 * the router sends none). Returns 0, or a ServeError code (> 0) with a one-line
 * reason in msg[cap]: SERVE_ERR_UNKNOWN_KV_CONFIG (a configuration other than the pool's),
 * SERVE_ERR_INVALID_ARGUMENT (anything else that does not fit), SERVE_ERR_RESOURCE_EXHAUSTED
 * (no memory for the record). A decode or chunk row that fails drops its request's record (its
 * cache is no longer trusted), as the CPU backend drops the sequence; so does a resume row. */
int wd_gmap(struct wd_gtab *t, const Bdfp4__PlanRow *row, const struct wd_glimits *lim,
	    struct wd_gitem *it, char *msg, size_t cap);

/* What a mapped row takes over from an earlier owner, to be zeroed before the step writes it
 * (the cuda backend's scrub: kvpoold does not map device memory, so pages and slots are cleared
 * where they are next owned): the row's new pages in every form (a prefill's, a fill's, the
 * decode page reserved for it) into *ret_pages[*ret_n] (pointing into the row), and the slot of
 * a new sequence (a prompt's first chunk at position 0, a fill-decode, a prefix hit's first
 * chunk) into *ret_slot; -1 for a decode row, a later chunk and a resume row, whose slot holds
 * the sequence's sink and recent rows. Pages it shares (the block table, a hit's cached pages)
 * are never among them. */
void wd_gscrub(const Bdfp4__PlanRow *row, const struct wd_gitem *it, const int32_t **ret_pages,
	       size_t *ret_n, int32_t *ret_slot);

/* After the item ran: ok advances the record (tokens held, pages promoted, one draw when
 * sampled); !ok drops it. */
void wd_gdone(struct wd_gtab *t, const struct wd_gitem *it, bool ok);

#endif
