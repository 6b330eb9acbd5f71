/* loadgen.c — a load generator for the serving system: it talks to the router like
 * any client (lib/serve/bd_client.h) and measures throughput, time to first token and time per
 * output token at several concurrency levels, and the pool's peak use (kvpoold stats sampled
 * while the load runs).
 *
 *   loadgen --router EP --pool EP [--levels 1,4,16] [--requests N] [--max-tokens 128]
 *           [--prompt-tokens N] [--ignore-eos] [--results bench/RESULTS.md] [--note TEXT]
 *           [--kv FILE] [--steady N]
 *
 * Each level runs `c` closed-loop clients (one thread and one connection each): a client sends
 * a prompt, reads the stream to its end, and sends the next, until the level's requests are
 * done (default 2·c, at least 4). The prompt is a chat prompt from a fixed list (different per
 * request), or with --prompt-tokens N, N token ids drawn uniformly from the vocabulary (seeded
 * by the request's index: a model without a tokenizer, long contexts). Greedy, EOS ignored
 * (--ignore-eos says so explicitly; it is the default), so every request generates exactly T
 * tokens. TTFT is measured at the client, from the send to the first token; TPOT is a
 * request's (last token − first token) / (T − 1). --kv appends one line of key=value pairs per
 * level to FILE (bench/serve_gpu.sh reads them).
 *
 * --steady N measures a level's steady-state decode: the level is one round of n = min(c, fit)
 * requests sent at once (fit: the requests the pool holds at once; --requests is ignored), no
 * closed loop. Once every request has its first token (t_a, the last first token), each is
 * read until it has N more; t_b is when the last one got its N-th, and then all are cancelled
 * (bd_client_cancel). Steady throughput: the tokens that arrived in (t_a, t_b] / (t_b − t_a);
 * steady TPOT: n · (t_b − t_a) / those tokens. Every request must still be generating at t_b:
 * --max-tokens must exceed N by the tokens the first ones get while the last ones wait for
 * theirs (about n with one prefill a step); a request that ends before it makes the window
 * invalid (steady_ok=0 in --kv).
 *
 * --fault kill9:R@S kills worker rank R with SIGKILL S seconds into each level; R's current pid
 * is read from the R-th file of BD_WORKER_PIDFILES (deploy/run-local.sh, which restarts the
 * rank as systemd would). --fault stop:R@S+D stops rank R with SIGSTOP at S seconds and lets it
 * go on with SIGCONT D seconds later (a rank that hangs, then recovers); --fault kill9:pool@S
 * kills kvpoold, whose pid is in BD_POOL_PIDFILE (run-local.sh starts it again on its stored
 * fds, as systemd does). Each level then reports the requests lost (failed: the goal is none),
 * the time to resume (from the fault to the first token any request gets after it) and the
 * longest time without a token from the fault on.
 * --long-prompt N makes the level's first request one of N random token ids (the others as
 * usual) and reports the TTFT of the short requests sent while it was prefilling (from its send
 * to its first token): what a long prompt costs the others.
 * --shared-prefix N (with --prompt-tokens) makes the first N token ids the same in every
 * request (a system prompt: drawn from one fixed seed), the rest drawn per request as above:
 * the load the router's prefix caching serves (prefix_cache in [router]). The table's note
 * then gives the pool's prefix hits over its lookups during the run (kvpoold's stats, pages).
 */
#include <signal.h>
#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#include "base/bd_version.h"
#include "base/bd_clock.h"
#include "serve/bd_client.h"
#include "pool/bd_pool_client.h"
#include "bench_info.h"

#define MAX_LEVELS 8
#define MAX_REQ 4096

static const char *const prompts[] = {
	"What is the capital of France?",
	"Explain photosynthesis in two sentences.",
	"Write a short poem about the sea.",
	"List three uses of a paperclip.",
	"What causes the seasons on Earth?",
	"Give me a tip for learning to cook.",
	"Why do cats purr?",
	"Describe a sunset to someone who cannot see.",
	"What is the difference between weather and climate?",
	"Suggest a name for a friendly robot.",
	"How does a bicycle stay upright?",
	"What is a prime number?",
	"Tell me a fun fact about octopuses.",
	"How do vaccines work, briefly?",
	"What should I pack for a weekend hike?",
	"Summarize the plot of Cinderella.",
};

struct opts {
	const char *router, *pool, *results, *note, *kv;
	int levels[MAX_LEVELS], n_levels, requests, max_tokens, prompt_tokens;
	int steady;       /* --steady N, 0: off */
	int shared_prefix; /* --shared-prefix N: the first N ids of every prompt are the same */
	int fault_rank;   /* --fault kill9:R@S or stop:R@S+D: rank R, S s into each level; -1: none */
	double fault_at;
	double fault_for; /* stop: seconds between SIGSTOP and SIGCONT; 0: kill9 */
	int long_prompt;  /* --long-prompt N: request 0 of each level has N token ids; 0: none */
	uint32_t n_vocab; /* of the server, for --prompt-tokens */
};

struct sample {
	double t_send;    /* bd_now_s() at the send */
	double ttft, total, last;
	uint32_t tokens;
	bool ok;
	/* --steady: arrival time of every token (bd_now_s()), [max_tokens] */
	double *times;
	bool reached; /* has N tokens after t_a */
};

struct level {
	const struct opts *o;
	int conc, n_req;
	atomic_int next;
	struct sample s[MAX_REQ];
	atomic_int failed;
	char first_error[256];
	pthread_mutex_t mu;
	/* --steady: requests with a first token, with N after t_a; t_a valid once all_first */
	atomic_int n_first, n_reached;
	atomic_bool all_first, window_done;
	double t_a;
	/* --fault: when the rank was killed (0: not yet), the first token after it; the last token
	 * of any request, and the longest time without one from the fault on */
	_Atomic double t_kill, t_resumed;
	_Atomic double t_last_token, max_stall;
};

static void note_error(struct level *L, const char *msg)
{
	pthread_mutex_lock(&L->mu);
	if (!L->first_error[0])
		snprintf(L->first_error, sizeof(L->first_error), "%s", msg);
	pthread_mutex_unlock(&L->mu);
	L->failed++;
}

/* Tokens of s that arrived after t, its first n_tok of them. */
static uint32_t tokens_after(const struct sample *s, uint32_t n_tok, double t)
{
	uint32_t k = 0;

	while (k < n_tok && s->times[k] <= t)
		k++;
	return n_tok - k;
}

/* --steady bookkeeping after a chunk of request s (its times[] updated): the first token of
 * the last request fixes t_a; N tokens after t_a on every request close the window, and then
 * each client cancels its request. */
static void steady_note(struct level *L, struct sample *s, bool first, struct bd_client *c,
			uint64_t tag, bool *cancelled)
{
	uint32_t n_tok = s->tokens < (uint32_t)L->o->max_tokens ? s->tokens
								: (uint32_t)L->o->max_tokens;

	/* each request's times[0] is written before its increment: the last one sees them all */
	if (first && atomic_fetch_add(&L->n_first, 1) + 1 == L->n_req) {
		double ta = 0;
		for (int i = 0; i < L->n_req; i++)
			ta = L->s[i].times[0] > ta ? L->s[i].times[0] : ta;
		L->t_a = ta;
		atomic_store(&L->all_first, true);
	}
	if (atomic_load(&L->all_first) && !s->reached &&
	    tokens_after(s, n_tok, L->t_a) >= (uint32_t)L->o->steady) {
		s->reached = true;
		if (atomic_fetch_add(&L->n_reached, 1) + 1 == L->n_req)
			atomic_store(&L->window_done, true);
	}
	if (!*cancelled && atomic_load(&L->window_done)) {
		/* the request then ends with a final chunk (cancelled) */
		if (bd_client_cancel(c, tag) == 0)
			*cancelled = true;
	}
}

static void *client_main(void *arg)
{
	struct level *L = arg;
	struct bd_client *c;

	if (bd_client_new(L->o->router, &c) < 0) {
		note_error(L, "cannot create a client");
		return NULL;
	}
	int32_t *ids = NULL;
	int max_ids = L->o->prompt_tokens > L->o->long_prompt ? L->o->prompt_tokens
							       : L->o->long_prompt;
	if (max_ids > 0 && !(ids = malloc(sizeof(int32_t) * (size_t)max_ids))) {
		note_error(L, "out of memory");
		bd_client_free(c);
		return NULL;
	}
	for (;;) {
		int i = L->next++;
		struct bd_client_gen g = { .chat = true, .stream = true, .ignore_eos = true,
					   .max_tokens = (uint32_t)L->o->max_tokens };
		struct bd_client_event ev;
		struct sample *s;
		uint64_t tag;
		double t0;
		bool cancelled = false;

		if (i >= L->n_req)
			break;
		s = &L->s[i];
		int n_ids = L->o->long_prompt && i == 0 ? L->o->long_prompt : L->o->prompt_tokens;
		if (n_ids > 0 && ids) {
			/* xorshift64 seeded by the level and the request: ids differ per request */
			uint64_t x = 0x9e3779b97f4a7c15ull * (uint64_t)(i + 1) + (uint64_t)L->conc;
			uint64_t y = 0x2545f4914f6cdd1dull; /* the shared prefix's seed */
			for (int k = 0; k < n_ids; k++) {
				uint64_t *z = k < L->o->shared_prefix ? &y : &x;

				*z ^= *z << 13;
				*z ^= *z >> 7;
				*z ^= *z << 17;
				ids[k] = (int32_t)(*z % L->o->n_vocab);
			}
			g.chat = false;
			g.token_ids = ids;
			g.n_token_ids = (size_t)n_ids;
		} else {
			g.prompt = prompts[i % (int)(sizeof(prompts) / sizeof(prompts[0]))];
		}
		t0 = bd_now_s();
		s->t_send = t0;
		if (bd_client_generate_start(c, &g, &tag) < 0) {
			note_error(L, "send failed");
			continue;
		}
		for (;;) {
			int e = bd_client_next(c, 120000, &ev);

			if (e < 0) {
				note_error(L, e == -ETIMEDOUT ? "no answer in 120 s" : strerror(-e));
				break;
			}
			if (ev.tag != tag)
				continue;
			if (ev.kind == BD_CLIENT_ERROR) {
				note_error(L, ev.message);
				break;
			}
			if (ev.kind != BD_CLIENT_CHUNK)
				continue;
			double t = bd_now_s();
			bool first = ev.n_tokens && s->tokens == 0;
			if (ev.n_tokens && atomic_load(&L->t_kill) > 0 &&
			    atomic_load(&L->t_resumed) == 0) {
				double zero = 0;

				atomic_compare_exchange_strong(&L->t_resumed, &zero, t);
			}
			if (ev.n_tokens) {
				const double prev = atomic_exchange(&L->t_last_token, t);
				const double tk = atomic_load(&L->t_kill);
				if (tk > 0) {
					const double gap = t - (prev > tk ? prev : tk);
					double m = atomic_load(&L->max_stall);
					while (gap > m &&
					       !atomic_compare_exchange_weak(&L->max_stall, &m, gap))
						;
				}
			}
			if (first)
				s->ttft = t - t0;
			if (ev.n_tokens)
				s->last = t - t0;
			for (size_t k = 0; s->times && k < ev.n_tokens; k++)
				if (s->tokens + k < (uint32_t)L->o->max_tokens)
					s->times[s->tokens + k] = t;
			s->tokens += (uint32_t)ev.n_tokens;
			if (s->times)
				steady_note(L, s, first, c, tag, &cancelled);
			if (ev.finish != BD_FINISH_NONE) {
				s->total = t - t0;
				s->ok = ev.finish == BD_FINISH_LENGTH || ev.finish == BD_FINISH_STOP ||
					(ev.finish == BD_FINISH_CANCELLED && cancelled);
				if (!s->ok)
					note_error(L, ev.message);
				break;
			}
		}
	}
	free(ids);
	bd_client_free(c);
	return NULL;
}

/* Samples the pool's used pages and slots until *stop. */
struct sampler {
	const char *ep;
	atomic_bool stop;
	uint64_t pages_peak, slots_peak, pages_total, slots_total;
	/* kvpoold's prefix counters (pages) at the first and the last sample */
	uint64_t hits0, queries0, hits, queries;
	bool ok;
};

static void *sampler_main(void *arg)
{
	struct sampler *sp = arg;
	struct bd_pool_conn *pc;

	if (!sp->ep || bd_pool_conn_new(sp->ep, 2000, &pc) < 0)
		return NULL;
	while (!sp->stop) {
		struct bd_pool_stats *st;

		if (bd_pool_stats(pc, 1, &st) == 0) {
			uint64_t pu = st->pages_total - st->pages_free;
			uint64_t su = st->slots_total - st->slots_free;

			sp->pages_total = st->pages_total;
			sp->slots_total = st->slots_total;
			sp->pages_peak = pu > sp->pages_peak ? pu : sp->pages_peak;
			sp->slots_peak = su > sp->slots_peak ? su : sp->slots_peak;
			if (!sp->ok) {
				sp->hits0 = st->prefix_hits;
				sp->queries0 = st->prefix_queries;
			}
			sp->hits = st->prefix_hits;
			sp->queries = st->prefix_queries;
			sp->ok = true;
			bd_pool_stats_free(st);
		}
		usleep(20000);
	}
	bd_pool_conn_free(pc);
	return NULL;
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return x < y ? -1 : x > y;
}

static double pct(double *v, int n, double p)
{
	int i = (int)(p * (n - 1) + 0.5);

	return n ? v[i < n ? i : n - 1] : 0;
}

struct row {
	int conc, n_req, ok;
	double wall, tok_s, req_s, ttft_mean, ttft_p50, ttft_p90, lat_mean, tpot_mean, tpot_p50;
	uint64_t tokens, pages_peak, pages_total, slots_peak, slots_total;
	uint64_t prefix_hits, prefix_queries; /* pages, during the level (kvpoold's stats) */
	/* --steady */
	int steady_n;
	bool steady_ok;
	uint64_t steady_tokens;
	double steady_s;
	/* --fault, --long-prompt */
	bool fault, killed;
	double resume_s, stall_s, long_ttft, beside_ttft_mean, beside_ttft_max;
	int beside_n;
	char error[256];
};

/* The steady window of a --steady level (every request reached N tokens after t_a). */
static void steady_window(const struct level *L, struct row *r)
{
	double ta = L->t_a, tb = ta;
	int N = L->o->steady;

	r->steady_ok = atomic_load(&L->window_done);
	if (!r->steady_ok)
		return;
	for (int i = 0; i < L->n_req; i++) {
		const struct sample *s = &L->s[i];
		uint32_t n_tok = s->tokens < (uint32_t)L->o->max_tokens ? s->tokens
									: (uint32_t)L->o->max_tokens;
		uint32_t k = n_tok - tokens_after(s, n_tok, ta);
		/* the N-th token after t_a */
		if (k + (uint32_t)N - 1 < n_tok && s->times[k + N - 1] > tb)
			tb = s->times[k + N - 1];
	}
	for (int i = 0; i < L->n_req; i++) {
		const struct sample *s = &L->s[i];
		uint32_t n_tok = s->tokens < (uint32_t)L->o->max_tokens ? s->tokens
									: (uint32_t)L->o->max_tokens;
		r->steady_tokens += tokens_after(s, n_tok, ta) - tokens_after(s, n_tok, tb);
	}
	r->steady_s = tb - ta;
	r->steady_ok = r->steady_s > 0 && r->steady_tokens > 0;
}

#define FAULT_POOL 8 /* --fault kill9:pool@S: kvpoold instead of a rank */

/* What the fault hits, for messages: "worker rank R" or "kvpoold" (static buffer). */
static const char *fault_name(int rank)
{
	static char name[32];

	if (rank == FAULT_POOL)
		return "kvpoold";
	snprintf(name, sizeof(name), "worker rank %d", rank);
	return name;
}

/* The current pid of worker rank (the rank-th file of BD_WORKER_PIDFILES, space-separated) or,
 * for FAULT_POOL, of kvpoold (BD_POOL_PIDFILE); -1 when unknown. */
static pid_t worker_pid(int rank)
{
	const char *files = getenv(rank == FAULT_POOL ? "BD_POOL_PIDFILE" : "BD_WORKER_PIDFILES");

	if (rank == FAULT_POOL)
		rank = 0;
	char path[512];
	long pid = -1;
	int i = 0;

	for (const char *p = files; p && *p; i++) {
		size_t n = strcspn(p, " ");

		if (i == rank && n < sizeof(path)) {
			FILE *f;

			memcpy(path, p, n);
			path[n] = 0;
			if ((f = fopen(path, "r"))) {
				if (fscanf(f, "%ld", &pid) != 1)
					pid = -1;
				fclose(f);
			}
			break;
		}
		p += n;
		p += *p == ' ';
	}
	return (pid_t)pid;
}

struct fault {
	struct level *L;
	double t0;
	atomic_bool stop;
	char error[128];
};

static void *fault_main(void *arg)
{
	struct fault *ft = arg;
	const struct opts *o = ft->L->o;
	pid_t pid;

	while (!ft->stop && bd_now_s() - ft->t0 < o->fault_at)
		usleep(10000);
	if (ft->stop)
		return NULL;
	pid = worker_pid(o->fault_rank);
	if (pid <= 0 || kill(pid, o->fault_for > 0 ? SIGSTOP : SIGKILL) < 0) {
		snprintf(ft->error, sizeof(ft->error), "cannot signal %s (pid %d): set %s",
			 fault_name(o->fault_rank), (int)pid,
			 o->fault_rank == FAULT_POOL ? "BD_POOL_PIDFILE" : "BD_WORKER_PIDFILES");
		return NULL;
	}
	const double t = bd_now_s();
	atomic_store(&ft->L->t_kill, t);
	fprintf(stderr, "loadgen: %s %s (pid %d) at %.1f s\n",
		o->fault_for > 0 ? "stopped" : "killed", fault_name(o->fault_rank), (int)pid,
		t - ft->t0);
	if (o->fault_for > 0) {
		/* the SIGCONT is sent even when the level ends first: no rank stays stopped */
		while (!ft->stop && bd_now_s() - t < o->fault_for)
			usleep(10000);
		if (kill(pid, SIGCONT) < 0)
			snprintf(ft->error, sizeof(ft->error), "cannot continue %s (pid %d): %s",
				 fault_name(o->fault_rank), (int)pid, strerror(errno));
		else
			fprintf(stderr, "loadgen: continued %s at %.1f s\n",
				fault_name(o->fault_rank), bd_now_s() - ft->t0);
	}
	return NULL;
}

static int run_level(const struct opts *o, int conc, int fit, struct row *r)
{
	static struct level L;
	pthread_t th[256], sth;
	struct sampler sp = { .ep = o->pool };
	static double ttft[MAX_REQ], tpot[MAX_REQ];
	double t0, sum_ttft = 0, sum_lat = 0, sum_tpot = 0;
	int n_ok = 0, n_tpot = 0;

	memset(&L, 0, sizeof(L));
	memset(r, 0, sizeof(*r));
	pthread_mutex_init(&L.mu, NULL);
	L.o = o;
	L.conc = conc;
	L.n_req = o->requests ? o->requests : (2 * conc > 4 ? 2 * conc : 4);
	if (o->steady) {
		/* one round, all in the pool at once */
		L.n_req = conc < fit ? conc : fit;
		conc = L.n_req;
		for (int i = 0; i < L.n_req; i++)
			if (!(L.s[i].times = calloc((size_t)o->max_tokens, sizeof(double)))) {
				for (int j = 0; j < i; j++)
					free(L.s[j].times);
				snprintf(r->error, sizeof(r->error), "out of memory");
				return -ENOMEM;
			}
	}
	if (L.n_req > MAX_REQ)
		L.n_req = MAX_REQ;
	pthread_create(&sth, NULL, sampler_main, &sp);
	t0 = bd_now_s();
	struct fault ft = { .L = &L, .t0 = t0 };
	pthread_t fth;
	if (o->fault_rank >= 0)
		pthread_create(&fth, NULL, fault_main, &ft);
	for (int i = 0; i < conc; i++)
		pthread_create(&th[i], NULL, client_main, &L);
	for (int i = 0; i < conc; i++)
		pthread_join(th[i], NULL);
	r->wall = bd_now_s() - t0;
	if (o->fault_rank >= 0) {
		ft.stop = true;
		pthread_join(fth, NULL);
		r->fault = true;
		r->killed = atomic_load(&L.t_kill) > 0;
		r->resume_s = r->killed && atomic_load(&L.t_resumed) > 0
				      ? atomic_load(&L.t_resumed) - atomic_load(&L.t_kill)
				      : -1;
		r->stall_s = atomic_load(&L.max_stall);
		if (*ft.error)
			fprintf(stderr, "loadgen: %s\n", ft.error);
	}
	if (o->long_prompt && L.s[0].ok) {
		/* the short requests sent while the long one prefilled */
		double a = L.s[0].t_send, b = a + L.s[0].ttft, sum = 0, mx = 0;
		int n = 0;

		for (int i = 1; i < L.n_req; i++)
			if (L.s[i].ok && L.s[i].t_send >= a && L.s[i].t_send < b) {
				sum += L.s[i].ttft;
				mx = L.s[i].ttft > mx ? L.s[i].ttft : mx;
				n++;
			}
		r->long_ttft = L.s[0].ttft;
		r->beside_n = n;
		r->beside_ttft_mean = n ? sum / n : 0;
		r->beside_ttft_max = mx;
	}
	sp.stop = true;
	pthread_join(sth, NULL);
	if (o->steady) {
		r->steady_n = L.n_req;
		steady_window(&L, r);
		for (int i = 0; i < L.n_req; i++)
			free(L.s[i].times);
	}
	for (int i = 0; i < L.n_req; i++) {
		if (!L.s[i].ok)
			continue;
		ttft[n_ok++] = L.s[i].ttft;
		if (L.s[i].tokens > 1) {
			tpot[n_tpot] = (L.s[i].last - L.s[i].ttft) / (L.s[i].tokens - 1);
			sum_tpot += tpot[n_tpot++];
		}
		sum_ttft += L.s[i].ttft;
		sum_lat += L.s[i].total;
		r->tokens += L.s[i].tokens;
	}
	qsort(ttft, (size_t)n_ok, sizeof(double), cmp_double);
	qsort(tpot, (size_t)n_tpot, sizeof(double), cmp_double);
	r->tpot_mean = n_tpot ? sum_tpot / n_tpot : 0;
	r->tpot_p50 = pct(tpot, n_tpot, 0.5);
	r->conc = L.conc;
	r->n_req = L.n_req;
	r->ok = n_ok;
	r->tok_s = (double)r->tokens / r->wall;
	r->req_s = n_ok / r->wall;
	r->ttft_mean = n_ok ? sum_ttft / n_ok : 0;
	r->ttft_p50 = pct(ttft, n_ok, 0.5);
	r->ttft_p90 = pct(ttft, n_ok, 0.9);
	r->lat_mean = n_ok ? sum_lat / n_ok : 0;
	r->pages_peak = sp.pages_peak;
	r->pages_total = sp.pages_total;
	r->slots_peak = sp.slots_peak;
	r->slots_total = sp.slots_total;
	r->prefix_hits = sp.hits - sp.hits0;
	r->prefix_queries = sp.queries - sp.queries0;
	snprintf(r->error, sizeof(r->error), "%s", L.first_error);
	return L.failed ? -EIO : 0;
}

static void machine(char *buf, size_t cap)
{
	FILE *f;
	char line[512], model[256];
	struct utsname u;

	bench_machine(model, sizeof(model));
	uname(&u);
	/* other work on the machine skews CPU numbers: say how busy it was */
	f = fopen("/proc/loadavg", "r");
	line[0] = 0;
	if (f) {
		if (!fgets(line, sizeof(line), f))
			line[0] = 0;
		fclose(f);
	}
	line[strcspn(line, " ")] = 0;
	snprintf(buf, cap, "%.200s, %ld CPUs, %.32s %.64s, load average %.32s at the end", model,
		 sysconf(_SC_NPROCESSORS_ONLN), u.sysname, u.release, *line ? line : "?");
}

static void commit(char *buf, size_t cap)
{
	FILE *p = popen("git rev-parse --short HEAD 2>/dev/null; git status --porcelain "
			"2>/dev/null | head -1", "r");
	char line[128];

	snprintf(buf, cap, "unknown");
	if (!p)
		return;
	if (fgets(line, sizeof(line), p)) {
		line[strcspn(line, "\n")] = 0;
		snprintf(buf, cap, "%s", line);
		if (fgets(line, sizeof(line), p))
			strncat(buf, " (with uncommitted changes)", cap - strlen(buf) - 1);
	}
	pclose(p);
}

static void print_rows(FILE *f, const struct row *rows, int n, const struct opts *o)
{
	fprintf(f, "| concurrency | requests ok | tokens/s | requests/s | TTFT mean | TTFT p50 | "
		   "TTFT p90 | TPOT mean | latency mean | pool pages peak | slots peak |\n");
	fprintf(f, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
	for (int i = 0; i < n; i++) {
		const struct row *r = &rows[i];

		fprintf(f, "| %d | %d/%d | %.1f | %.2f | %.3f s | %.3f s | %.3f s | %.1f ms | %.2f s "
			   "| %llu/%llu | %llu/%llu |\n",
			r->conc, r->ok, r->n_req, r->tok_s, r->req_s, r->ttft_mean, r->ttft_p50,
			r->ttft_p90, r->tpot_mean * 1e3, r->lat_mean, (unsigned long long)r->pages_peak,
			(unsigned long long)r->pages_total, (unsigned long long)r->slots_peak,
			(unsigned long long)r->slots_total);
	}
	if (o->prompt_tokens && o->shared_prefix)
		fprintf(f, "\n%d generated tokens per request (greedy, EOS ignored); prompts of %d "
			   "random token ids, the first %d the same in every request.\n",
			o->max_tokens, o->prompt_tokens, o->shared_prefix);
	else if (o->prompt_tokens)
		fprintf(f, "\n%d generated tokens per request (greedy, EOS ignored); prompts of %d "
			   "random token ids.\n", o->max_tokens, o->prompt_tokens);
	else
		fprintf(f, "\n%d generated tokens per request (greedy, EOS ignored); chat prompts "
			   "from a fixed list of %zu.\n",
			o->max_tokens, sizeof(prompts) / sizeof(prompts[0]));
	if (o->steady)
		fprintf(f, "\nSteady state (--steady %d): min(concurrency, fit) requests at once; "
			   "from the last first token until every request has %d more.\n\n"
			   "| concurrency | requests | window | tokens/s | TPOT |\n|---:|---:|---:|---:|---:|\n",
			o->steady, o->steady);
	for (int i = 0; o->steady && i < n; i++) {
		const struct row *r = &rows[i];

		if (r->steady_ok)
			fprintf(f, "| %d | %d | %.3f s | %.1f | %.2f ms |\n", r->conc, r->steady_n,
				r->steady_s, (double)r->steady_tokens / r->steady_s,
				r->steady_n * r->steady_s / (double)r->steady_tokens * 1e3);
		else
			fprintf(f, "| %d | %d | no window (a request ended first: raise --max-tokens) "
				   "| | |\n", r->conc, r->steady_n);
	}
	for (int i = 0; i < n; i++) {
		const struct row *r = &rows[i];

		if (r->fault && r->killed && o->fault_for > 0)
			fprintf(f, "\nConcurrency %d, SIGSTOP of %s at %.1f s, SIGCONT %.1f "
				   "s later: %d request(s) lost of %d; the stop to the next token %.2f s; "
				   "longest time without a token from the stop on %.2f s.\n", r->conc,
				fault_name(o->fault_rank), o->fault_at, o->fault_for, r->n_req - r->ok,
				r->n_req, r->resume_s, r->stall_s);
		else if (r->fault && r->killed)
			fprintf(f, "\nConcurrency %d, kill -9 of %s at %.1f s: %d "
				   "request(s) lost of %d; time to resume (the kill to the next token) "
				   "%.2f s; longest time without a token from the kill on %.2f s.\n",
				r->conc, fault_name(o->fault_rank), o->fault_at, r->n_req - r->ok,
				r->n_req, r->resume_s, r->stall_s);
		else if (r->fault)
			fprintf(f, "\nConcurrency %d: the fault was not injected (the level ended "
				   "first, or no BD_WORKER_PIDFILES).\n", r->conc);
		if (o->long_prompt)
			fprintf(f, "\nConcurrency %d, one prompt of %d token ids first: its TTFT %.2f "
				   "s; the %d short request(s) sent while it prefilled: TTFT mean %.2f "
				   "s, max %.2f s.\n", r->conc, o->long_prompt, r->long_ttft,
				r->beside_n, r->beside_ttft_mean, r->beside_ttft_max);
	}
	for (int i = 0; o->shared_prefix && i < n; i++)
		fprintf(f, "\nConcurrency %d: prefix cache hit rate %.1f %% (%llu of %llu pages "
			   "looked up, kvpoold's stats).\n", rows[i].conc,
			rows[i].prefix_queries ? 100.0 * (double)rows[i].prefix_hits /
							 (double)rows[i].prefix_queries
					       : 0.0,
			(unsigned long long)rows[i].prefix_hits,
			(unsigned long long)rows[i].prefix_queries);
	for (int i = 0; i < n; i++)
		if (rows[i].error[0])
			fprintf(f, "Concurrency %d: first error: %s\n", rows[i].conc, rows[i].error);
}

/* The requests the pool holds at once, by pages (each needs (prompt + T) / 128 of them, the
 * router's admission count) and by slots. */
static uint64_t pool_fit(const struct opts *o, const struct bd_client_info *info)
{
	uint64_t per = (uint64_t)(o->prompt_tokens + o->max_tokens) / 128;
	uint64_t fit = per ? info->pages_total / per : info->slots_total;

	return fit > info->slots_total ? info->slots_total : fit;
}

/* One level as key=value pairs (fit: pool_fit). --steady adds steady_n (requests),
 * steady_ok (0: no valid window), steady_tokens, steady_s, steady_tok_s_gpu, steady_tpot_ms. */
static int write_kv(const char *path, const struct opts *o, const struct bd_client_info *info,
		    const struct row *r)
{
	FILE *f = fopen(path, "a");
	uint64_t fit = pool_fit(o, info);
	unsigned tp = info->tp ? info->tp : 1;

	if (!f)
		return -1;
	fprintf(f, "conc=%d requests=%d ok=%d wall_s=%.3f tokens=%llu tok_s=%.2f tok_s_gpu=%.2f "
		   "ttft_mean_ms=%.2f ttft_p50_ms=%.2f tpot_mean_ms=%.3f tpot_p50_ms=%.3f "
		   "pages_total=%llu slots_total=%llu fit=%llu pages_peak=%llu slots_peak=%llu "
		   "prompt_tokens=%d max_tokens=%d tp=%u kv=%s backend=%s",
		r->conc, r->n_req, r->ok, r->wall, (unsigned long long)r->tokens, r->tok_s,
		r->tok_s / (info->tp ? info->tp : 1), r->ttft_mean * 1e3, r->ttft_p50 * 1e3,
		r->tpot_mean * 1e3, r->tpot_p50 * 1e3, (unsigned long long)info->pages_total,
		(unsigned long long)info->slots_total, (unsigned long long)fit,
		(unsigned long long)r->pages_peak, (unsigned long long)r->slots_peak,
		o->prompt_tokens, o->max_tokens, info->tp, info->kv_config, info->backend);
	if (o->steady)
		fprintf(f, " steady=%d steady_n=%d steady_ok=%d steady_tokens=%llu steady_s=%.4f "
			   "steady_tok_s_gpu=%.2f steady_tpot_ms=%.3f", o->steady, r->steady_n,
			r->steady_ok, (unsigned long long)r->steady_tokens, r->steady_s,
			r->steady_ok ? (double)r->steady_tokens / r->steady_s / tp : 0,
			r->steady_ok ? r->steady_n * r->steady_s / (double)r->steady_tokens * 1e3 : 0);
	fputc('\n', f);
	return fclose(f);
}

static void usage(FILE *f)
{
	fprintf(f, "usage: loadgen --router EP [--pool EP] [--levels 1,4,16] [--requests N]\n"
		   "               [--max-tokens T] [--prompt-tokens N] [--ignore-eos]\n"
		   "               [--results FILE] [--note TEXT] [--kv FILE] [--steady N]\n"
		   "               [--fault kill9:RANK@SECONDS | kill9:pool@SECONDS |\n"
		   "                        stop:RANK@SECONDS+SECONDS]\n"
		   "               [--long-prompt N] [--shared-prefix N]\n");
}

int main(int argc, char **argv)
{
	static const struct option lo[] = {
		{ "router", required_argument, NULL, 'r' }, { "pool", required_argument, NULL, 'p' },
		{ "levels", required_argument, NULL, 'l' },
		{ "requests", required_argument, NULL, 'n' },
		{ "max-tokens", required_argument, NULL, 't' },
		{ "results", required_argument, NULL, 'o' }, { "note", required_argument, NULL, 'N' },
		{ "prompt-tokens", required_argument, NULL, 'P' },
		{ "ignore-eos", no_argument, NULL, 'E' }, { "kv", required_argument, NULL, 'K' },
		{ "steady", required_argument, NULL, 'S' },
		{ "fault", required_argument, NULL, 'F' },
		{ "long-prompt", required_argument, NULL, 'L' },
		{ "shared-prefix", required_argument, NULL, 'X' },
		{ "help", no_argument, NULL, 'h' }, { "version", no_argument, NULL, 'V' },
		{ NULL, 0, NULL, 0 },
	};
	struct opts o = { .router = getenv("BD_ROUTER"), .max_tokens = 128, .fault_rank = -1 };
	/* where each option's argument goes, by its getopt value */
	const char **text[128] = { ['r'] = &o.router, ['p'] = &o.pool, ['o'] = &o.results,
				   ['N'] = &o.note, ['K'] = &o.kv };
	int *number[128] = { ['n'] = &o.requests, ['t'] = &o.max_tokens,
			     ['P'] = &o.prompt_tokens, ['S'] = &o.steady,
			     ['L'] = &o.long_prompt, ['X'] = &o.shared_prefix };
	struct row rows[MAX_LEVELS];
	char mach[512], rev[128], date[64];
	time_t now = time(NULL);
	int opt, rc = 0;

	o.levels[0] = 1;
	o.levels[1] = 4;
	o.levels[2] = 16;
	o.n_levels = 3;
	while ((opt = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
		if (opt > 0 && opt < 128 && text[opt]) {
			*text[opt] = optarg;
			continue;
		}
		if (opt > 0 && opt < 128 && number[opt]) {
			*number[opt] = atoi(optarg);
			continue;
		}
		switch (opt) {
		case 'V':
			printf("loadgen %s\n", bd_version());
			return 0;
		case 'l': {
			char *s = optarg, *end;

			o.n_levels = 0;
			while (*s && o.n_levels < MAX_LEVELS) {
				long v = strtol(s, &end, 10);

				if (end == s || v < 1 || v > 256) {
					fprintf(stderr, "loadgen: bad --levels '%s'\n", optarg);
					return 2;
				}
				o.levels[o.n_levels++] = (int)v;
				s = *end == ',' ? end + 1 : end;
			}
			break;
		}
		case 'E':
			break; /* the default: every request generates exactly max_tokens */
		case 'F':
		{
			int used = 0;
			o.fault_for = 0;
			if (sscanf(optarg, "kill9:pool@%lf%n", &o.fault_at, &used) == 1)
				o.fault_rank = FAULT_POOL;
			else if ((sscanf(optarg, "kill9:%d@%lf%n", &o.fault_rank, &o.fault_at,
					 &used) != 2 &&
				  (sscanf(optarg, "stop:%d@%lf+%lf%n", &o.fault_rank, &o.fault_at,
					  &o.fault_for, &used) != 3 || !(o.fault_for > 0))) ||
				 o.fault_rank < 0 || o.fault_rank >= FAULT_POOL) /* ranks 0..7 */
				used = 0;
			if (!used || optarg[used] || o.fault_at < 0) {
				fprintf(stderr, "loadgen: bad --fault '%s' (kill9:RANK@SECONDS, "
						"kill9:pool@SECONDS or stop:RANK@SECONDS+SECONDS)\n",
					optarg);
				return 2;
			}
		}
			break;
		case 'h':
			usage(stdout);
			return 0;
		default:
			usage(stderr);
			return 2;
		}
	}
	if (!o.router || o.max_tokens < 1 || o.requests < 0 || o.prompt_tokens < 0 ||
	    o.long_prompt < 0 || o.shared_prefix < 0 ||
	    (o.shared_prefix && o.shared_prefix > o.prompt_tokens) ||
	    o.steady < 0 || (o.steady && o.steady >= o.max_tokens)) {
		usage(stderr);
		return 2;
	}
	/* the server's vocabulary (random token ids), pool and tensor-parallel width */
	struct bd_client_info info = { 0 };
	{
		struct bd_client *c;

		if (bd_client_new(o.router, &c) < 0 || bd_client_info(c, 10000, &info) < 0) {
			fprintf(stderr, "loadgen: no server info from %s\n", o.router);
			return 1;
		}
		bd_client_free(c);
		o.n_vocab = info.n_vocab;
		if ((o.prompt_tokens || o.long_prompt) &&
		    (o.n_vocab < 1 || (uint32_t)o.prompt_tokens >= info.n_ctx ||
		     (uint32_t)o.long_prompt >= info.n_ctx)) {
			fprintf(stderr, "loadgen: --prompt-tokens %d: the server's context is %u\n",
				o.prompt_tokens, info.n_ctx);
			return 2;
		}
	}
	for (int i = 0; i < o.n_levels; i++) {
		fprintf(stderr, "loadgen: concurrency %d ...\n", o.levels[i]);
		if (run_level(&o, o.levels[i], (int)pool_fit(&o, &info), &rows[i]) < 0)
			rc = 1;
		if (o.kv && write_kv(o.kv, &o, &info, &rows[i]) < 0) {
			fprintf(stderr, "loadgen: %s: %s\n", o.kv, strerror(errno));
			rc = 1;
		}
	}
	machine(mach, sizeof(mach));
	commit(rev, sizeof(rev));
	strftime(date, sizeof(date), "%Y-%m-%d %H:%M UTC", gmtime(&now));
	print_rows(stdout, rows, o.n_levels, &o);
	if (o.results) {
		FILE *f = fopen(o.results, "a");

		if (!f) {
			fprintf(stderr, "loadgen: %s: %s\n", o.results, strerror(errno));
			return 1;
		}
		fprintf(f, "\n## Serving: %s backend, TP=%u, %s, load generator (%s)\n\n",
			info.backend, info.tp, info.kv_config, date);
		fprintf(f, "Machine: %s. Commit: %s.%s%s\n\n", mach, rev, o.note ? " " : "",
			o.note ? o.note : "");
		print_rows(f, rows, o.n_levels, &o);
		fclose(f);
	}
	return rc;
}
