/* metrics.c — routerd's Prometheus metrics and access log (metrics.h). */
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/bd_log.h"
#include "metrics.h"
#include "sched.h"

/* Bucket bounds in seconds, vLLM's for the same quantities. */
static const double b_ttft[] = { 0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
				 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
				 2560.0 };
static const double b_itl[] = { 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
				0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0 };
static const double b_req[] = { 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
				30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
				7680.0 };
static const double b_step[] = { 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
				 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0 };

#define NB(a) (sizeof(a) / sizeof((a)[0]))
#define MAX_BUCKETS 24
#define ITL_SLOTS 4096 /* live requests tracked for the inter-token latency */
#define HTTP_ROWS 64

struct hist {
	const double *le;
	int n;
	uint64_t bucket[MAX_BUCKETS]; /* per bound, not cumulative */
	uint64_t count;
	double sum;
};

/* the last token time of a streamed request, by id */
struct itl_slot {
	uint64_t id;
	int64_t t_last; /* ms */
};

enum { FIN_STOP, FIN_LENGTH, FIN_ABORT, FIN_ERROR, N_FIN };
static const char *const fin_names[N_FIN] = { "stop", "length", "abort", "error" };

struct http_row {
	const char *endpoint;
	int status;
	uint64_t n;
};

struct bd_router_metrics {
	pthread_mutex_t mu;
	char model[256]; /* escaped for a label value */
	int tp;
	struct bd_metrics_gauges g;
	uint64_t prompt_tokens, gen_tokens, fin[N_FIN];
	struct hist ttft, itl, e2e, queue, step[BD_METRICS_MAX_RANKS];
	struct itl_slot itl_slots[ITL_SLOTS];
	struct http_row http[HTTP_ROWS];
	int n_http;
};

static void hist_init(struct hist *h, const double *le, int n)
{
	memset(h, 0, sizeof(*h));
	h->le = le;
	h->n = n;
}

static void hist_add(struct hist *h, double v)
{
	int i = 0;

	while (i < h->n && v > h->le[i])
		i++;
	if (i < h->n)
		h->bucket[i]++;
	h->count++;
	h->sum += v;
}

struct bd_router_metrics *bd_router_metrics_new(const char *model_name, int tp)
{
	struct bd_router_metrics *m;
	size_t o = 0;

	if (tp < 1 || tp > BD_METRICS_MAX_RANKS)
		return NULL;
	m = calloc(1, sizeof(*m));
	if (!m)
		return NULL;
	pthread_mutex_init(&m->mu, NULL);
	for (const char *p = model_name ? model_name : ""; *p && o + 3 < sizeof(m->model); p++) {
		if (*p == '"' || *p == '\\')
			m->model[o++] = '\\';
		m->model[o++] = *p == '\n' ? ' ' : *p;
	}
	m->tp = tp;
	hist_init(&m->ttft, b_ttft, NB(b_ttft));
	hist_init(&m->itl, b_itl, NB(b_itl));
	hist_init(&m->e2e, b_req, NB(b_req));
	hist_init(&m->queue, b_req, NB(b_req));
	for (int i = 0; i < tp; i++)
		hist_init(&m->step[i], b_step, NB(b_step));
	return m;
}

void bd_router_metrics_free(struct bd_router_metrics *m)
{
	if (!m)
		return;
	pthread_mutex_destroy(&m->mu);
	free(m);
}

static int fin_index(int finish)
{
	switch (finish) {
	case BDFP4__FINISH_REASON__FINISH_STOP:
	case BDFP4__FINISH_REASON__FINISH_STOP_STRING:
		return FIN_STOP;
	case BDFP4__FINISH_REASON__FINISH_LENGTH:
		return FIN_LENGTH;
	case BDFP4__FINISH_REASON__FINISH_CANCELLED:
		return FIN_ABORT;
	default:
		return FIN_ERROR;
	}
}

static const char *finish_word(int finish)
{
	switch (finish) {
	case BDFP4__FINISH_REASON__FINISH_STOP:
		return "stop";
	case BDFP4__FINISH_REASON__FINISH_STOP_STRING:
		return "stop-string";
	case BDFP4__FINISH_REASON__FINISH_LENGTH:
		return "length";
	case BDFP4__FINISH_REASON__FINISH_CANCELLED:
		return "cancelled";
	default:
		return "error";
	}
}

void bd_router_metrics_chunk(struct bd_router_metrics *m, const struct bd_req *r, int finish,
			     int error, int64_t now)
{
	bool final = finish != BDFP4__FINISH_REASON__FINISH_NONE;
	int n_new = r->n_gen - r->n_sent;
	struct itl_slot *sl;

	if (!m)
		return;
	sl = &m->itl_slots[r->id % ITL_SLOTS];
	pthread_mutex_lock(&m->mu);
	/* a streamed chunk carries the tokens of the steps since the last one */
	if (r->stream && n_new > 0) {
		int k = n_new; /* intervals this chunk closes */
		int64_t t0 = sl->t_last;

		if (sl->id != r->id) {
			/* the first chunk: its first token is the TTFT's; a slot taken over by
			 * another request: no start time */
			k = r->n_sent == 0 ? n_new - 1 : 0;
			t0 = r->t_first ? r->t_first : now;
			sl->id = r->id;
		}
		for (int i = 0; i < k; i++)
			hist_add(&m->itl, (double)(now - t0) / 1000.0 / k);
		sl->t_last = now;
	}
	if (final) {
		if (sl->id == r->id)
			sl->id = 0;
		if (r->t_first)
			hist_add(&m->ttft, (double)(r->t_first - r->t_arrival) / 1000.0);
		hist_add(&m->e2e, (double)(now - r->t_arrival) / 1000.0);
		if (r->t_admit)
			hist_add(&m->queue, (double)(r->t_admit - r->t_arrival) / 1000.0);
		m->prompt_tokens += (uint64_t)r->n_prompt;
		m->gen_tokens += (uint64_t)r->n_gen;
		m->fin[fin_index(finish)]++;
	}
	pthread_mutex_unlock(&m->mu);
	if (final) {
		const ProtobufCEnumValue *ev = error ? protobuf_c_enum_descriptor_get_value(
			&bdfp4__serve_error__descriptor, error) : NULL;

		bd_log_info("request %llu: prompt %d tokens, generated %d, ttft %lld ms, %lld ms, "
			    "%s%s%s", (unsigned long long)r->id, r->n_prompt, r->n_gen,
			    (long long)(r->t_first ? r->t_first - r->t_arrival : -1),
			    (long long)(now - r->t_arrival), finish_word(finish),
			    ev ? ": " : "", ev ? ev->name : "");
	}
}

void bd_router_metrics_step(struct bd_router_metrics *m, int rank, uint64_t us)
{
	if (!m || rank < 0 || rank >= m->tp)
		return;
	pthread_mutex_lock(&m->mu);
	hist_add(&m->step[rank], (double)us / 1e6);
	pthread_mutex_unlock(&m->mu);
}

void bd_router_metrics_gauges(struct bd_router_metrics *m, const struct bd_metrics_gauges *g)
{
	if (!m)
		return;
	pthread_mutex_lock(&m->mu);
	m->g = *g;
	pthread_mutex_unlock(&m->mu);
}

void bd_router_metrics_http(struct bd_router_metrics *m, const char *endpoint, int status)
{
	if (!m)
		return;
	pthread_mutex_lock(&m->mu);
	for (int i = 0; i < m->n_http; i++)
		if (m->http[i].endpoint == endpoint && m->http[i].status == status) {
			m->http[i].n++;
			goto out;
		}
	if (m->n_http < HTTP_ROWS)
		m->http[m->n_http++] = (struct http_row){ endpoint, status, 1 };
out:
	pthread_mutex_unlock(&m->mu);
}

/* ---- rendering ------------------------------------------------------------------------------ */

static void head(FILE *f, const char *name, const char *type, const char *help)
{
	fprintf(f, "# HELP bdfp4:%s %s\n# TYPE bdfp4:%s %s\n", name, help, name, type);
}

static void gauge(FILE *f, const struct bd_router_metrics *m, const char *name, double v,
		  const char *help)
{
	head(f, name, "gauge", help);
	fprintf(f, "bdfp4:%s{model_name=\"%s\"} %.17g\n", name, m->model, v);
}

static void counter(FILE *f, const struct bd_router_metrics *m, const char *name, uint64_t v,
		    const char *help)
{
	head(f, name, "counter", help);
	fprintf(f, "bdfp4:%s{model_name=\"%s\"} %llu\n", name, m->model, (unsigned long long)v);
}

/* One histogram's samples; labels: extra labels before le ("" or `rank="0",`). */
static void hist_samples(FILE *f, const struct bd_router_metrics *m, const char *name,
			 const char *labels, const struct hist *h)
{
	uint64_t cum = 0;

	for (int i = 0; i < h->n; i++) {
		cum += h->bucket[i];
		fprintf(f, "bdfp4:%s_bucket{model_name=\"%s\",%sle=\"%g\"} %llu\n", name, m->model,
			labels, h->le[i], (unsigned long long)cum);
	}
	fprintf(f, "bdfp4:%s_bucket{model_name=\"%s\",%sle=\"+Inf\"} %llu\n", name, m->model,
		labels, (unsigned long long)h->count);
	fprintf(f, "bdfp4:%s_sum{model_name=\"%s\"%s%.*s} %.17g\n", name, m->model,
		*labels ? "," : "", *labels ? (int)strlen(labels) - 1 : 0, labels, h->sum);
	fprintf(f, "bdfp4:%s_count{model_name=\"%s\"%s%.*s} %llu\n", name, m->model,
		*labels ? "," : "", *labels ? (int)strlen(labels) - 1 : 0, labels,
		(unsigned long long)h->count);
}

static void histogram(FILE *f, const struct bd_router_metrics *m, const char *name,
		      const struct hist *h, const char *help)
{
	head(f, name, "histogram", help);
	hist_samples(f, m, name, "", h);
}

char *bd_router_metrics_render(struct bd_router_metrics *m, size_t *ret_len)
{
	struct bd_router_metrics *c = malloc(sizeof(*c));
	const struct bd_metrics_gauges *g;
	char *buf = NULL, lab[32];
	size_t len = 0;
	FILE *f;

	if (!c)
		return NULL;
	pthread_mutex_lock(&m->mu);
	memcpy(c, m, sizeof(*c));
	pthread_mutex_unlock(&m->mu);
	g = &c->g;
	f = open_memstream(&buf, &len);
	if (!f) {
		free(c);
		return NULL;
	}
	gauge(f, c, "num_requests_running", (double)g->running,
	      "Requests in the running batch (holding a slot and pages).");
	gauge(f, c, "num_requests_waiting", (double)g->waiting, "Requests queued for admission.");
	gauge(f, c, "kv_cache_usage_perc",
	      g->pages_total ? (double)(g->pages_total - g->pages_free) / (double)g->pages_total
			     : 0.0,
	      "Fraction of the pool's FP4 KV pages in use (1 = full).");
	gauge(f, c, "healthy", (double)g->healthy, "1 while serving (health ok), else 0.");
	gauge(f, c, "pool_pages_free", (double)g->pages_free, "FP4 KV pages free in kvpoold.");
	gauge(f, c, "pool_pages_used", (double)(g->pages_total - g->pages_free),
	      "FP4 KV pages in use in kvpoold.");
	gauge(f, c, "pool_pages_capacity", (double)g->pages_total, "FP4 KV pages kvpoold holds.");
	gauge(f, c, "pool_slots_free", (double)g->slots_free, "BF16 sink+recent slots free.");
	gauge(f, c, "pool_slots_used", (double)(g->slots_total - g->slots_free),
	      "BF16 sink+recent slots in use.");
	gauge(f, c, "pool_slots_capacity", (double)g->slots_total, "BF16 slots kvpoold holds.");
	gauge(f, c, "router_pages_held", (double)g->pages_held,
	      "FP4 pages (and reserved pages) held by this router's live requests.");
	counter(f, c, "prompt_tokens_total", c->prompt_tokens,
		"Prompt tokens of finished requests.");
	counter(f, c, "generation_tokens_total", c->gen_tokens,
		"Generated tokens of finished requests.");
	counter(f, c, "num_preemptions_total", g->preemptions,
		"Preemptions (a running request's KV released, recomputed later).");
	counter(f, c, "prefix_cache_queries_total", g->prefix_queries,
		"Prompt tokens looked up in the prefix cache at admission (whole pages).");
	counter(f, c, "prefix_cache_hits_total", g->prefix_hits,
		"Prompt tokens found in the prefix cache (read from cached FP4 pages, not "
		"prefilled).");
	gauge(f, c, "pool_pages_cached", (double)g->pages_cached,
	      "FP4 pages in kvpoold's prefix index (held or idle; idle ones count as free).");
	counter(f, c, "prefix_cache_evictions_total", g->prefix_evictions,
		"Idle cached pages kvpoold evicted for an allocation.");
	head(f, "request_success_total", "counter", "Finished requests by finish reason.");
	for (int i = 0; i < N_FIN; i++)
		fprintf(f, "bdfp4:request_success_total{model_name=\"%s\",finished_reason=\"%s\"} "
			   "%llu\n", c->model, fin_names[i], (unsigned long long)c->fin[i]);
	histogram(f, c, "time_to_first_token_seconds", &c->ttft,
		  "Arrival to the first generated token.");
	histogram(f, c, "inter_token_latency_seconds", &c->itl,
		  "Time between two tokens of a streamed request.");
	histogram(f, c, "e2e_request_latency_seconds", &c->e2e, "Arrival to the final chunk.");
	histogram(f, c, "request_queue_time_seconds", &c->queue, "Arrival to admission.");
	head(f, "step_compute_seconds", "histogram", "Compute time of one step on each rank.");
	for (int r = 0; r < c->tp; r++) {
		snprintf(lab, sizeof(lab), "rank=\"%d\",", r);
		hist_samples(f, c, "step_compute_seconds", lab, &c->step[r]);
	}
	head(f, "http_requests_total", "counter", "HTTP requests by endpoint and status.");
	for (int i = 0; i < c->n_http; i++)
		fprintf(f, "bdfp4:http_requests_total{model_name=\"%s\",endpoint=\"%s\","
			   "status=\"%d\"} %llu\n", c->model, c->http[i].endpoint,
			c->http[i].status, (unsigned long long)c->http[i].n);
	free(c);
	if (fclose(f) != 0) {
		free(buf);
		return NULL;
	}
	*ret_len = len;
	return buf;
}
