/* metrics.h — routerd's Prometheus metrics: what the event loop observes, what GET /metrics
 * renders (router/http.c), and the access log line of every finished request.
 *
 * The event loop (main.c, workers.c) is the only writer; the HTTP threads read a copy through
 * bd_router_metrics_render. One mutex guards the numbers; each hold is a few additions or one
 * copy of the struct, so the loop never waits on a client.
 *
 * Names follow vLLM's where the meaning is the same, with the prefix "bdfp4:" for "vllm:"; every
 * sample carries the label model_name. Times are seconds.
 */
#ifndef BD_ROUTER_METRICS_H
#define BD_ROUTER_METRICS_H

#include <stddef.h>
#include <stdint.h>

struct bd_req;
struct bd_router_metrics;

#define BD_METRICS_MAX_RANKS 8

/* What the loop knows of the whole router at one moment (bd_router_metrics_gauges). */
struct bd_metrics_gauges {
	uint64_t running, waiting;
	uint64_t pages_total, pages_free, slots_total, slots_free;
	uint64_t pages_held;   /* pages of this router's live requests */
	uint64_t preemptions;  /* since start (a counter the scheduler keeps) */
	/* prefix caching: prompt tokens looked up and found (the scheduler's counters), the
	 * pool's indexed pages and its evictions (kvpoold's stats, all owners) */
	uint64_t prefix_queries, prefix_hits, pages_cached, prefix_evictions;
	int healthy;           /* 1 serving, 0 not */
};

/* A metrics set for the model model_name (copied; quotes and backslashes are escaped when
 * rendered) and tp ranks (≤ BD_METRICS_MAX_RANKS). NULL on -ENOMEM or a bad tp. The
 * observing calls below take a NULL m and do nothing. */
struct bd_router_metrics *bd_router_metrics_new(const char *model_name, int tp);
/* NULL is fine. */
void bd_router_metrics_free(struct bd_router_metrics *m);

/* A chunk of r is about to go out at now (ms, monotonic); finish is its FinishReason
 * (FINISH_NONE: not final), error its ServeError. Observes TTFT at the first token, the
 * inter-token latency of every token a streamed chunk carries, and at the final chunk the
 * token counters, the finish reason, end-to-end and queue times; a final chunk also writes
 * the access log line (info): id, prompt and generated tokens, TTFT, duration, finish. */
void bd_router_metrics_chunk(struct bd_router_metrics *m, const struct bd_req *r, int finish,
			     int error, int64_t now);
/* Rank rank's compute time of one step, us microseconds. Ranks outside [0, tp) are ignored. */
void bd_router_metrics_step(struct bd_router_metrics *m, int rank, uint64_t us);
/* The gauges (the loop's tick). */
void bd_router_metrics_gauges(struct bd_router_metrics *m, const struct bd_metrics_gauges *g);

/* Counts one HTTP request of endpoint (a static name: "/v1/completions", ...) answered with
 * status (200, 400, ...). Any thread. */
void bd_router_metrics_http(struct bd_router_metrics *m, const char *endpoint, int status);

/* The exposition text (Prometheus text format 0.0.4) into a malloc'ed string, its length into
 * *ret_len. NULL on -ENOMEM. Any thread. */
char *bd_router_metrics_render(struct bd_router_metrics *m, size_t *ret_len);

#endif
