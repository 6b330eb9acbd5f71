/* test_metrics.c — routerd's Prometheus metrics (router/metrics.c) without a socket: what a
 * request's chunks add to each histogram and counter, the cumulative buckets with their
 * inclusive bounds, the label escaping, and the ranks' step times. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "metrics.h"
#include "sched.h"

/* The value of the sample line that starts with prefix; -1 when there is none. */
static double sample(const char *text, const char *prefix)
{
	for (const char *p = text; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL)
		if (!strncmp(p, prefix, strlen(prefix)) && p[strlen(prefix)] == ' ')
			return strtod(p + strlen(prefix) + 1, NULL);
	return -1;
}

#define M "model_name=\"a\\\"b\""

Test(metrics, a_streamed_request_end_to_end)
{
	struct bd_router_metrics *m = bd_router_metrics_new("a\"b", 2);
	struct bd_req r = { .id = 5, .stream = true, .n_prompt = 3, .t_arrival = 1000,
			    .t_admit = 1100, .t_first = 1500 };
	size_t len;
	char *t;

	cr_assert(m);
	/* the first token: TTFT's, no interval */
	r.n_gen = 1;
	bd_router_metrics_chunk(m, &r, BDFP4__FINISH_REASON__FINISH_NONE, 0, 1500);
	r.n_sent = 1;
	/* two more tokens 200 ms later: two intervals of 100 ms */
	r.n_gen = 3;
	bd_router_metrics_chunk(m, &r, BDFP4__FINISH_REASON__FINISH_NONE, 0, 1700);
	r.n_sent = 3;
	bd_router_metrics_chunk(m, &r, BDFP4__FINISH_REASON__FINISH_LENGTH, 0, 1800);
	bd_router_metrics_step(m, 1, 2500);
	bd_router_metrics_step(m, 2, 2500); /* no rank 2 of tp 2: ignored */
	bd_router_metrics_http(m, "/x", 200);
	bd_router_metrics_http(m, "/x", 200);
	bd_router_metrics_http(m, "/x", 400);

	t = bd_router_metrics_render(m, &len);
	cr_assert(t);
	cr_expect_eq(strlen(t), len);
	cr_expect_eq(sample(t, "bdfp4:prompt_tokens_total{" M "}"), 3);
	cr_expect_eq(sample(t, "bdfp4:generation_tokens_total{" M "}"), 3);
	cr_expect_eq(sample(t, "bdfp4:request_success_total{" M ",finished_reason=\"length\"}"), 1);
	cr_expect_eq(sample(t, "bdfp4:request_success_total{" M ",finished_reason=\"stop\"}"), 0);
	cr_expect_eq(sample(t, "bdfp4:time_to_first_token_seconds_bucket{" M ",le=\"0.25\"}"), 0);
	cr_expect_eq(sample(t, "bdfp4:time_to_first_token_seconds_bucket{" M ",le=\"0.5\"}"), 1,
		     "a bound holds the values equal to it");
	cr_expect_eq(sample(t, "bdfp4:time_to_first_token_seconds_bucket{" M ",le=\"+Inf\"}"), 1);
	cr_expect_eq(sample(t, "bdfp4:inter_token_latency_seconds_bucket{" M ",le=\"0.075\"}"), 0);
	cr_expect_eq(sample(t, "bdfp4:inter_token_latency_seconds_bucket{" M ",le=\"0.1\"}"), 2);
	cr_expect_eq(sample(t, "bdfp4:inter_token_latency_seconds_bucket{" M ",le=\"80\"}"), 2,
		     "buckets are cumulative");
	cr_expect_eq(sample(t, "bdfp4:inter_token_latency_seconds_count{" M "}"), 2);
	cr_expect_float_eq(sample(t, "bdfp4:inter_token_latency_seconds_sum{" M "}"), 0.2, 1e-12);
	cr_expect_float_eq(sample(t, "bdfp4:e2e_request_latency_seconds_sum{" M "}"), 0.8, 1e-12);
	cr_expect_eq(sample(t, "bdfp4:request_queue_time_seconds_bucket{" M ",le=\"0.3\"}"), 1);
	cr_expect_eq(sample(t, "bdfp4:step_compute_seconds_count{" M ",rank=\"1\"}"), 1);
	cr_expect_eq(sample(t, "bdfp4:step_compute_seconds_count{" M ",rank=\"0\"}"), 0);
	cr_expect_eq(sample(t, "bdfp4:step_compute_seconds_bucket{" M ",rank=\"1\",le=\"0.0025\"}"),
		     1);
#define HTTP_X "bdfp4:http_requests_total{" M ",endpoint=\"/x\","
	cr_expect_eq(sample(t, HTTP_X "status=\"200\"}"), 2);
	cr_expect_eq(sample(t, HTTP_X "status=\"400\"}"), 1);
	cr_expect(strstr(t, "# TYPE bdfp4:time_to_first_token_seconds histogram\n"));
	cr_expect(strstr(t, "# TYPE bdfp4:prompt_tokens_total counter\n"));
	free(t);
	bd_router_metrics_free(m);
}

/* Gauges as the loop gave them; the cache usage is the used fraction of the pool's pages. */
Test(metrics, gauges_and_usage)
{
	struct bd_router_metrics *m = bd_router_metrics_new("x", 1);
	const struct bd_metrics_gauges g = { .running = 2, .waiting = 7, .pages_total = 40,
					     .pages_free = 30, .slots_total = 8, .slots_free = 6,
					     .preemptions = 4, .prefix_queries = 1280,
					     .prefix_hits = 1024, .pages_cached = 9,
					     .prefix_evictions = 3, .healthy = 1 };
	char *t;
	size_t len;

	cr_assert(m);
	bd_router_metrics_gauges(m, &g);
	t = bd_router_metrics_render(m, &len);
	cr_assert(t);
	cr_expect_eq(sample(t, "bdfp4:num_requests_running{model_name=\"x\"}"), 2);
	cr_expect_eq(sample(t, "bdfp4:num_requests_waiting{model_name=\"x\"}"), 7);
	cr_expect_float_eq(sample(t, "bdfp4:kv_cache_usage_perc{model_name=\"x\"}"), 0.25, 1e-12);
	cr_expect_eq(sample(t, "bdfp4:pool_pages_used{model_name=\"x\"}"), 10);
	cr_expect_eq(sample(t, "bdfp4:pool_slots_used{model_name=\"x\"}"), 2);
	cr_expect_eq(sample(t, "bdfp4:num_preemptions_total{model_name=\"x\"}"), 4);
	cr_expect_eq(sample(t, "bdfp4:prefix_cache_queries_total{model_name=\"x\"}"), 1280);
	cr_expect_eq(sample(t, "bdfp4:prefix_cache_hits_total{model_name=\"x\"}"), 1024);
	cr_expect_eq(sample(t, "bdfp4:pool_pages_cached{model_name=\"x\"}"), 9);
	cr_expect_eq(sample(t, "bdfp4:prefix_cache_evictions_total{model_name=\"x\"}"), 3);
	free(t);
	bd_router_metrics_free(m);
	cr_expect_null(bd_router_metrics_new("x", 0), "tp 0 is refused");
	bd_router_metrics_chunk(NULL, &(struct bd_req){ 0 }, 0, 0, 0); /* NULL: nothing */
}
