/* sched.h — routerd's scheduler: the request life cycle, admission against the pool, continuous
 * batching into step plans, their results, preemption by recompute, deadlines.
 *
 * It does no I/O. It takes events and queues actions; main.c carries the actions out:
 *
 *   events (calls in)                               actions (bd_sched_next, in order)
 *   bd_sched_submit      a validated new request     CHUNK  r's new output to its client; final
 *   bd_sched_cancel      the client cancels one             (finish != FINISH_NONE) when r ended
 *   bd_sched_client_gone its connection is gone      PLAN   the step plan, to every rank
 *   bd_sched_schedule    the loop may start a step
 *   bd_sched_step_done   every rank answered the step in flight
 *   bd_sched_group_up    a worker group formed (its epoch)
 *   bd_sched_group_down  the group failed (a rank died, timed out, failed a step)
 *   bd_sched_pool_down   kvpoold stopped answering
 *   bd_sched_tick        the clock (deadlines)
 *   bd_sched_stop        the router stops: everything ends
 *
 * The pool is reached through an injected interface (struct bd_sched_pool_ops): synchronous
 * calls, as a KV cache manager is to vLLM's scheduler; routerd's goes to kvpoold (pool.c), a
 * test's to a fake.
 *
 * A request is QUEUED (accepted, holds nothing), then RUNNING (a BF16 slot and FP4 pages in the
 * pool; a prefill row in its first step, then one decode row per step), then ended: finished
 * (stop, length, stop string), cancelled or failed, with everything it held released and its
 * sequence dropped on the workers (the next plan's release list). A request in the step in
 * flight ends only when that step's results are in (or the step is lost), so that no worker
 * still writes into pages the pool has handed to someone else. Preemption (the pool is out of
 * pages) puts the running request admitted last back at the head of the queue, holding
 * nothing; its admission again prefills prompt + generated tokens.
 *
 * Each step plans decode rows first (reserving the page a row's next token completes, one step
 * ahead), then the next chunk of each prefill under way, then admits queued requests in arrival
 * order while rows (max_batch), slots, pages and the step's prefill token budget
 * (max_prefill_tokens) allow. A prompt longer than max_prefill_chunk, or than the budget left,
 * is prefilled in chunks of whole pages over several steps, between the decode steps of the
 * others; only its last chunk samples. A row feeds n_feed tokens from position n_pos, so a
 * prefill row is a span of a sequence like a decode row.
 *
 * Pages (NUMERICS.md §8, quant/bd_layout.h): position p lives in page p / 128; the token at
 * position p with (p + 1) % 128 == 0 completes its page, which the workers then promote from
 * the BF16 slot into an FP4 page. A prefill of n tokens completes n / 128 pages, allocated at
 * admission (page_alloc); a decode that completes a page promotes into the page reserved for
 * the request (page_reserve), committed (page_commit) when every rank has answered the step.
 */
#ifndef BD_ROUTER_SCHED_H
#define BD_ROUTER_SCHED_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model/bd_tokenizer.h"
#include "serve.pb-c.h"

#define BD_ROUTER_MAX_STOPS 8
#define BD_ROUTER_MAX_TOP_LOGPROBS 20   /* OpenAI's limit of top_logprobs */

enum bd_req_state { RQ_QUEUED, RQ_RUNNING };

/* A token and its log-probability, as a request keeps them until they are sent. */
struct bd_req_logprob {
	int32_t token;
	float logprob;
};

struct bd_req {
	/* set by whoever builds the request (frontend.c), before bd_sched_submit */
	uint64_t tag;       /* the client's */
	uint8_t ident[256]; /* the client's ZeroMQ routing id */
	size_t ident_len;
	bool delim;         /* a REQ client: replies carry an empty delimiter frame */
	uint64_t conn;      /* the client's ClientRequest.connection (0: none) */
	int32_t *toks;      /* [cap] the prompt (n_prompt), then the generated tokens */
	int n_prompt, cap, max_tokens;
	int32_t *pages;     /* [max_pages] room for its promoted pages */
	int max_pages;
	char cache_salt[64]; /* prefix caching: requests share pages only with the same salt
			      * ("" : the unsalted cache); at most 63 bytes */
	size_t cache_salt_len;
	const char *kv_config; /* static name (bd_kvcfg) */
	Bdfp4__SamplingParams sampling; /* seed 0: one is derived at submit */
	char *stops[BD_ROUTER_MAX_STOPS];
	int n_stops;
	bool stream, ignore_eos;
	int32_t *forced;    /* [n_forced] tokens that replace the sampled ones */
	int n_forced;
	uint32_t top_k;
	Bdfp4__TopLogit *top; /* [max_tokens][top_k] logits of each generated token */
	bool logprobs;      /* log-probabilities of each generated token (GenerateRequest) */
	uint32_t top_logprobs; /* ≤ BD_ROUTER_MAX_TOP_LOGPROBS alternatives per token */
	/* [max_tokens][1 + top_logprobs] when logprobs: the sampled token, then the most likely
	 * (token −1: not reported); NULL otherwise */
	struct bd_req_logprob *lp;
	struct bd_tok_stream ts;
	int64_t t_arrival, deadline; /* ms, monotonic */

	/* the scheduler's */
	uint64_t id;        /* the router's id, also the pool's request id */
	uint64_t order;     /* admission priority: arrival order, kept across preemption */
	enum bd_req_state state;
	int n_gen;
	int n_pos;          /* tokens the workers hold (0: needs a prefill) */
	int n_fill;         /* RUNNING: tokens its prefill covers; n_pos < n_fill: prefilling */
	int32_t slot;       /* -1: none */
	int n_pages;        /* promoted pages in pages[] */
	int32_t reserved;   /* the page reserved for the next promotion, -1: none */
	bool pool_held;     /* the pool has a record for it */
	bool on_workers;    /* workers hold a sequence for it */
	bool in_step;
	bool resume;        /* its next row rebuilds it on workers that lost it (a new group) */
	uint64_t *hashes;   /* [max_pages] prefix caching: the hashes of its full pages */
	int n_hashed;       /* pages of hashes[] computed (those of the admission's fill) */
	int n_cached;       /* leading pages taken from the prefix index at admission */
	int n_stored;       /* leading pages indexed (found there, or stored since) */
	char *text;         /* the output text so far (stop strings are matched on it) */
	size_t len, cap_text, shown; /* shown: the part of text that is final */
	int64_t t_admit, t_first;    /* ms, monotonic; 0: not yet */
	uint32_t preemptions;
	/* how it ended, or how it ends once the step in flight is in (finish_pending) */
	bool finish_pending, fin_notify;
	int fin_reason, fin_error;
	char fin_msg[256];
	struct bd_req *next_ended; /* the list of ended requests, freed once actions are read */

	/* what the client has been sent (frontend.c) */
	int n_sent;         /* tokens */
	size_t shown_sent;  /* bytes of text */
	int64_t last_sent;  /* ms, monotonic: the last chunk or keepalive */
};

/* Frees r and what it owns; NULL is fine. */
void bd_req_free(struct bd_req *r);

/* The pool as the scheduler sees it; pool is the interface's own context. Each call returns 0
 * or a -errno: -ENOSPC when the pool has no page or slot left, -ENOENT for an unknown request,
 * anything else when the call failed (down() then says whether the pool stopped answering). */
struct bd_sched_pool_ops {
	/* A BF16 slot for request id, which gets a pool record: *ret_slot. */
	int (*slot_assign)(void *pool, uint64_t id, int32_t *ret_slot);
	/* n FP4 pages for id: ret_pages[n]. */
	int (*page_alloc)(void *pool, uint64_t id, uint32_t n, int32_t *ret_pages);
	/* One page held back for id's next promotion: *ret_page. */
	int (*page_reserve)(void *pool, uint64_t id, int32_t *ret_page);
	/* The reserved page was written: it becomes one of id's pages. */
	int (*page_commit)(void *pool, uint64_t id, int32_t page);
	/* Everything id holds (pages, reserved page, slot) goes back, with its record. */
	int (*release)(void *pool, uint64_t id);
	/* Prefix caching (NULL both: off). match: id (a record made by slot_assign) takes a
	 * reference to the pages of the longest indexed leading run of hashes[n]:
	 * ret_pages[0..*ret_n). store: indexes id's promoted pages[n] under hashes[n]; tokens
	 * [n·128] and parent (the hash before hashes[0], 0: none) for the KV event stream. */
	int (*prefix_match)(void *pool, uint64_t id, const uint64_t *hashes, size_t n,
			    int32_t *ret_pages, size_t *ret_n);
	int (*prefix_store)(void *pool, uint64_t id, const int32_t *pages, const uint64_t *hashes,
			    size_t n, const int32_t *tokens, uint64_t parent);
	/* True while the pool does not answer, with why ("kvpoold unreachable: ...") into why[cap]
	 * (why may be NULL); false and "" while it does. */
	bool (*down)(void *pool, char *why, size_t cap);
};

struct bd_sched_cfg {
	int max_batch;          /* rows per step, ≥ 1 */
	int max_queue;          /* queued requests before bd_sched_submit refuses */
	int max_prefill_tokens; /* prompt tokens prefilled in one step, over all its rows */
	int max_prefill_chunk;  /* tokens of one prompt in one row, a multiple of 128, at most
				 * max_prefill_tokens; 0: whole prompts (one a step at least) */
	bool batch_invariant;   /* a prompt's chunks are min(rest, max_prefill_chunk) whatever
				 * the other rows take of the step's budget: a chunk that does not
				 * fit waits for the next step (chunk boundaries change what a chunk
				 * reads from the FP4 pages, bd_model_prefill_chunk) */
	int resume_timeout_ms;  /* how long running requests wait for a failed group to form
				 * again, then fail WORKER_FAILED; 0: they fail at once */
	bool prefix_cache;      /* admissions reuse the leading full pages kvpoold has indexed
				 * (the pool's prefix_match/prefix_store); bd_sched_set_prefix */
	uint64_t prefix_seed;   /* router/prefix.h: model, KV configuration, calibration */
	int n_vocab;
	const bool *eog;        /* [n_vocab] end-of-generation tokens (borrowed) */
	const struct bd_tokenizer *tok; /* NULL: no text, chunks carry token ids only (borrowed) */
};

struct bd_sched_row {
	struct bd_req *r;
	bool prefill;
	int n_feed;         /* tokens fed, at positions r->n_pos .. */
	int32_t new_page;   /* decode: the reserved page promoted into, -1: none */
};

/* The step in flight, and the plan sent for it (the PLAN action points at plan). */
struct bd_sched_step {
	bool active;
	uint64_t id;
	struct bd_sched_row *rows;  /* [n_rows] */
	int n_rows;
	Bdfp4__StepPlan plan;
	Bdfp4__PlanRow *prow, **pprow;  /* [n_rows] the plan's rows */
	uint64_t *release;          /* [plan.n_release] the plan's releases */
	size_t cap_rows, cap_prow, cap_pprow, cap_release;
};

enum bd_sched_act_kind { BD_SCHED_CHUNK = 1, BD_SCHED_PLAN };

struct bd_sched_act {
	enum bd_sched_act_kind kind;
	/* CHUNK: what r generated since the last chunk; final when finish != FINISH_NONE (then
	 * error and msg say how it ended). r stays valid until bd_sched_next returns false. */
	struct bd_req *r;
	int finish, error;
	const char *msg;
	/* PLAN: epoch, step, rows and releases; valid until the next bd_sched_schedule */
	const Bdfp4__StepPlan *plan;
};

struct bd_sched {
	struct bd_sched_cfg cfg;
	const struct bd_sched_pool_ops *pool;
	void *pool_ctx;
	char *piece;                /* [piece_cap] one streamed token's text */
	size_t piece_cap;

	/* live requests by arrival, and those ended since the actions were last drained */
	struct bd_req **reqs;
	size_t n_reqs, cap_reqs, n_queued, n_running;
	struct bd_req *ended;
	uint64_t next_id, next_order, next_step;
	uint64_t *release;          /* request ids the workers drop in the next plan */
	size_t n_release, cap_release;

	bool group_ready;
	uint64_t epoch;
	bool whole_prompts;         /* bd_sched_set_workers */
	int max_row;
	int64_t resume_by;          /* ms, monotonic: the held requests fail then (0: none held) */
	char down_msg[320];         /* why the group failed */
	struct bd_sched_step step;

	struct bd_sched_act *acts;  /* queued actions: [next_act, n_acts) */
	size_t n_acts, next_act, cap_acts;

	/* counters */
	uint64_t requests_total, requests_failed, tokens_generated, steps_done, preemptions;
	uint64_t pages_held, pages_peak; /* pages (and reserved pages) of live requests */
	uint64_t prefix_queries, prefix_hits; /* prompt tokens looked up in the prefix index at
					       * admission, and found there (vLLM's counters) */
};

/* Sets up s (zeroed by the caller or not) with cfg and the pool interface; no group yet.
 * Returns 0 or -ENOMEM. */
int bd_sched_init(struct bd_sched *s, const struct bd_sched_cfg *cfg,
		  const struct bd_sched_pool_ops *pool, void *pool_ctx);
/* Turns prefix caching on (with this seed, router/prefix.h) or off for the admissions to
 * come; it is on only when the pool interface has prefix_match and prefix_store. */
void bd_sched_set_prefix(struct bd_sched *s, bool on, uint64_t seed);
/* Frees every request and what s holds, without a pool call or an action. */
void bd_sched_fini(struct bd_sched *s);

/* The next action to carry out into *ret; false when none is left, and then the requests that
 * ended are freed (the r of every earlier action is gone). */
bool bd_sched_next(struct bd_sched *s, struct bd_sched_act *ret);

/* A new request, QUEUED (r->t_arrival and r->deadline set, n_prompt ≥ 1). Returns 0 (s owns r;
 * its id is set), -ENOSPC when max_queue requests are queued already, -ENOMEM (r stays the
 * caller's either way). */
int bd_sched_submit(struct bd_sched *s, struct bd_req *r);
/* The live request of this client connection and tag, NULL when none (or it is ending). */
struct bd_req *bd_sched_find(struct bd_sched *s, const uint8_t *ident, size_t len, uint64_t tag);
/* The client cancelled r: it ends CANCELLED with a final chunk. */
void bd_sched_cancel(struct bd_sched *s, struct bd_req *r);
/* Every request of the client with this routing id ends CANCELLED, without a reply. */
void bd_sched_client_gone(struct bd_sched *s, const uint8_t *ident, size_t len);
/* A request came under this routing id from connection conn (≠ 0): the requests of the id
 * made under another connection (≠ 0) are a departed predecessor's and end CANCELLED, without
 * a reply. Returns how many. */
int bd_sched_client_replaced(struct bd_sched *s, const uint8_t *ident, size_t len,
			     uint64_t conn);
/* Plans the next step when a group is formed and no step is in flight: admissions and
 * preemptions through the pool, then a PLAN action (the step is in flight from now on).
 * now: ms, monotonic. */
void bd_sched_schedule(struct bd_sched *s, int64_t now);
/* The results of the step in flight, res[n_ranks] (rank 0 samples), each of the plan's epoch and
 * step: tokens appended, pages committed, chunks and finishes queued. Results of no step in
 * flight are ignored. The caller keeps res. */
void bd_sched_step_done(struct bd_sched *s, Bdfp4__StepResult *const *res, int n_ranks,
			int64_t now);
/* A worker group of this epoch formed: plans may go out. */
void bd_sched_group_up(struct bd_sched *s, uint64_t epoch);

/* What the group about to form runs (its ranks' RegisterRequests), before bd_sched_group_up:
 * whole_prompts true: every prompt is prefilled in one row whatever max_prefill_chunk says
 * (a backend that cannot continue a prompt at a position > 0); a request held in the middle of
 * its prefill (resume) starts its prefill over at position 0 on the pages it was admitted with,
 * so the workers are never sent a row they cannot run. max_row > 0: the longest prefill row
 * every rank takes; chunks are cut to whole pages within it, and with max_prefill_chunk 0 a
 * longer prompt goes in such chunks (a bound below one page leaves chunks as configured). Kept
 * until the next call; a new scheduler runs chunks as configured. */
void bd_sched_set_workers(struct bd_sched *s, bool whole_prompts, int max_row);

/* The group failed (msg says why; now: ms, monotonic). With resume_timeout_ms > 0 nothing
 * fails: the step in flight is dropped, to run again; the running requests keep their slot,
 * pages, reserved page and tokens, and continue from their last committed token once a group
 * forms again (bd_sched_group_up), their first row marked resume; requests ending anyway
 * (cancelled in the step) end. If no group forms by now + resume_timeout_ms, bd_sched_tick
 * fails every live request WORKER_FAILED ("did not form again within resume_timeout_ms ...:
 * msg"), everything released. With 0 the step in flight and the running requests fail
 * WORKER_FAILED with msg at once; the queued ones wait for the next group. */
void bd_sched_group_down(struct bd_sched *s, const char *msg, int64_t now);
/* True while running requests wait for a failed group to form again. */
bool bd_sched_resuming(const struct bd_sched *s);
/* kvpoold stopped answering: every request fails UNAVAILABLE with msg (a restarted pool lost
 * their pages, a hung one allocates none); those in the step in flight when it ends. */
void bd_sched_pool_down(struct bd_sched *s, const char *msg);
/* True while a step is in flight or a request holds a pool record: a reclaim of the router's
 * records would take a live one's. */
bool bd_sched_pool_busy(const struct bd_sched *s);
/* The clock: requests past their deadline fail DEADLINE_EXCEEDED, and held requests past
 * resume_timeout_ms fail WORKER_FAILED (bd_sched_group_down). now: ms, monotonic. */
void bd_sched_tick(struct bd_sched *s, int64_t now);
/* The router stops: every request ends FINISH_ERROR with error and msg, the step in flight is
 * given up. */
void bd_sched_stop(struct bd_sched *s, int error, const char *msg);

#endif
