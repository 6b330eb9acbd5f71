/* row.c — a row's result as the backends build it: the ServeError of a -errno and the row
 * errors with their one-line messages, the log-probabilities; and the rule of a prefix hit's
 * row that both backends apply (workerd.h). Calls no other file of workerd/.
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>

#include "base/bd_err.h"
#include "quant/bd_layout.h"
#include "workerd.h"

Bdfp4__ServeError wd_serve_error(int e)
{
	switch (e) {
	case -EINVAL:
	case -ERANGE:
		return BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
	case -ENOSPC:
	case -ENOMEM:
		return BDFP4__SERVE_ERROR__SERVE_ERR_RESOURCE_EXHAUSTED;
	case -EPIPE:
	case -ETIMEDOUT:
		return BDFP4__SERVE_ERROR__SERVE_ERR_WORKER_FAILED;
	default:
		return BDFP4__SERVE_ERROR__SERVE_ERR_INTERNAL;
	}
}

int wd_row_fail(struct wd_row_out *o, Bdfp4__ServeError code, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(o->msg, sizeof(o->msg), fmt, ap);
	va_end(ap);
	o->rr.error = code;
	o->rr.message = o->msg;
	return -1;
}

void wd_rows_fail(const Bdfp4__StepPlan *plan, struct wd_row_out *out, Bdfp4__ServeError code,
		  const char *msg)
{
	for (size_t i = 0; i < plan->n_rows; i++)
		wd_row_fail(&out[i], code, "%s", msg);
}

int wd_row_logprobs(struct wd_row_out *o, float logprob, const int32_t *ids, const float *lp,
		    int n)
{
	if (isnan(logprob)) {
		o->rr.n_top_logprobs = 0;
		o->rr.top_logprobs = NULL;
		return wd_row_fail(o, BDFP4__SERVE_ERROR__SERVE_ERR_INTERNAL,
				   "log-probabilities failed: non-finite logits");
	}
	if (n < 0)
		n = 0;
	if (n > WD_LOGPROBS_MAX)
		n = WD_LOGPROBS_MAX;
	o->rr.logprob = logprob;
	for (int i = 0; i < n; i++) {
		bdfp4__token_logprob__init(&o->lp[i]);
		o->lp[i].token = ids[i];
		o->lp[i].logprob = lp[i];
		o->lpp[i] = &o->lp[i];
	}
	o->rr.n_top_logprobs = (size_t)n;
	o->rr.top_logprobs = n ? o->lpp : NULL;
	return 0;
}

int wd_row_prefix_sink(const Bdfp4__PlanRow *row, char *msg, size_t cap)
{
	if (!row->resume || !row->prefix_pages)
		return 0;
	if (!row->prefill || row->n_context < 1 || row->prefix_pages > row->n_block_table ||
	    row->position != (int64_t)row->n_block_table * BD_PAGE_TOKENS) {
		bd_errf(msg, cap, -EINVAL, "a prefix hit of %u pages needs a prefill chunk with the "
			"context's first tokens, at the end of a block table of them",
			row->prefix_pages);
		return -1;
	}
	return row->n_context < BD_SINK_TOKENS ? (int)row->n_context : BD_SINK_TOKENS;
}
