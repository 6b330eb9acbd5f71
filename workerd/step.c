/* step.c — executing a StepPlan (proto/serve.proto): the epoch and the group's health
 * checked, releases, then the backend runs the rows (cpu.c, gpu.c); one StepResult back.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "workerd.h"

void wd_run_plan(struct wd *w, const Bdfp4__StepPlan *plan)
{
	Bdfp4__WorkerMessage m = BDFP4__WORKER_MESSAGE__INIT;
	Bdfp4__StepResult res = BDFP4__STEP_RESULT__INIT;
	struct wd_row_out *out = NULL;
	Bdfp4__RowResult **rows = NULL;
	char msg[WD_MSG_MAX + 32] = "";
	int64_t t0 = bd_now_us();

	res.epoch = plan->epoch;
	res.step = plan->step;
	res.rank = w->o.rank;
	m.msg_case = BDFP4__WORKER_MESSAGE__MSG_RESULT;
	m.result = &res;

	if (!w->epoch || plan->epoch != w->epoch) {
		res.error = BDFP4__SERVE_ERROR__SERVE_ERR_INVALID_ARGUMENT;
		snprintf(msg, sizeof(msg), "plan of epoch %llu; this worker is in epoch %llu",
			 (unsigned long long)plan->epoch, (unsigned long long)w->epoch);
		goto send;
	}
	if (w->be->health(w) != WD_HEALTHY) {
		res.error = BDFP4__SERVE_ERROR__SERVE_ERR_WORKER_FAILED;
		snprintf(msg, sizeof(msg), "rank %d: the %s of epoch %llu is broken (a rank "
					   "died or left); waiting for a reset", w->o.rank,
			 w->be->collective, (unsigned long long)w->epoch);
		goto send;
	}
	for (size_t i = 0; i < plan->n_release; i++)
		w->be->release(w, plan->release[i]);

	out = calloc(plan->n_rows ? plan->n_rows : 1, sizeof(*out));
	rows = calloc(plan->n_rows ? plan->n_rows : 1, sizeof(*rows));
	if (!out || !rows) {
		res.error = BDFP4__SERVE_ERROR__SERVE_ERR_INTERNAL;
		snprintf(msg, sizeof(msg), "out of memory for %zu rows", plan->n_rows);
		goto send;
	}
	for (size_t i = 0; i < plan->n_rows; i++) {
		struct wd_row_out *o = &out[i];
		bdfp4__row_result__init(&o->rr);
		o->rr.request_id = plan->rows[i]->request_id;
		o->rr.token = -1;
		rows[i] = &o->rr;
	}
	w->be->run_rows(w, plan, out, &res.error, msg, sizeof(msg));
	res.n_rows = plan->n_rows;
	res.rows = rows;
send:
	if (msg[0])
		res.message = msg;
	atomic_fetch_add(&w->pub_steps, 1);
	res.compute_us = (uint64_t)(bd_now_us() - t0);
	if (res.error)
		bd_log_warn("step %llu: %s", (unsigned long long)plan->step, msg);
	if (w->o.verbose)
		bd_log_debug("step %llu: %zu rows, %zu released, %llu us",
			 (unsigned long long)plan->step, plan->n_rows, plan->n_release,
			 (unsigned long long)res.compute_us);
	int r = wd_send(w, &m);
	if (r < 0)
		bd_log_err("step %llu: result not sent: %s", (unsigned long long)plan->step,
		       strerror(-r));
	/* the plan's wall time on this worker, the send included (serve_gpu.sh) */
	w->be->note_plan(w, plan->n_rows, (double)(bd_now_us() - t0));
	free(out);
	free(rows);
}
