/* test_wd_row.c — workerd's row results (workerd/row.c): the log-probabilities both backends
 * put into a RowResult (wd_row_logprobs), and the rule of a prefix hit's row that both apply
 * (wd_row_prefix_sink). Suite "wd_row".
 */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "workerd.h"

TestSuite(wd_row);

static void fresh(struct wd_row_out *o)
{
	memset(o, 0, sizeof(*o));
	bdfp4__row_result__init(&o->rr);
	o->rr.request_id = 41;
	o->rr.token = 1234;
}

/* The sampled token's value and the alternatives land in the result, in order, in the row's
 * own storage: the caller's arrays may change afterwards. */
Test(wd_row, logprobs_are_copied_into_the_result)
{
	struct wd_row_out o;
	int32_t ids[3] = { 1234, 9, 77 };
	float lp[3] = { -0.25f, -1.5f, -INFINITY };

	fresh(&o);
	cr_assert_eq(wd_row_logprobs(&o, -0.25f, ids, lp, 3), 0);
	ids[1] = 5;
	lp[1] = -3.0f;
	cr_assert_eq(o.rr.error, BDFP4__SERVE_ERROR__SERVE_OK);
	cr_assert_eq(o.rr.logprob, -0.25f);
	cr_assert_eq(o.rr.token, 1234, "the token is the caller's");
	cr_assert_eq(o.rr.n_top_logprobs, 3);
	cr_assert_eq(o.rr.top_logprobs[0]->token, 1234);
	cr_assert_eq(o.rr.top_logprobs[1]->token, 9);
	cr_assert_eq(o.rr.top_logprobs[2]->token, 77);
	cr_assert_eq(o.rr.top_logprobs[0]->logprob, -0.25f);
	cr_assert_eq(o.rr.top_logprobs[1]->logprob, -1.5f);
	cr_assert(isinf(o.rr.top_logprobs[2]->logprob) && o.rr.top_logprobs[2]->logprob < 0,
		  "a ruled-out token keeps -inf (the router clamps it)");
	for (int i = 0; i < 3; i++)
		cr_assert_eq(o.rr.top_logprobs[i], &o.lp[i]);
	/* packs as a TokenLogprob list */
	size_t len = bdfp4__row_result__get_packed_size(&o.rr);
	uint8_t buf[512];
	cr_assert_leq(len, sizeof(buf));
	bdfp4__row_result__pack(&o.rr, buf);
	Bdfp4__RowResult *u = bdfp4__row_result__unpack(NULL, len, buf);
	cr_assert_not_null(u);
	cr_assert_eq(u->n_top_logprobs, 3);
	cr_assert_eq(u->top_logprobs[1]->token, 9);
	cr_assert_eq(u->logprob, -0.25f);
	bdfp4__row_result__free_unpacked(u, NULL);
}

/* More alternatives than a row result holds are cut at WD_LOGPROBS_MAX; none leaves an
 * empty list with the sampled token's value. */
Test(wd_row, logprobs_are_cut_at_the_row_maximum)
{
	struct wd_row_out o;
	int32_t ids[WD_LOGPROBS_MAX + 5];
	float lp[WD_LOGPROBS_MAX + 5];

	for (int i = 0; i < WD_LOGPROBS_MAX + 5; i++) {
		ids[i] = 100 + i;
		lp[i] = -0.5f * (float)i;
	}
	fresh(&o);
	cr_assert_eq(wd_row_logprobs(&o, -2.0f, ids, lp, WD_LOGPROBS_MAX + 5), 0);
	cr_assert_eq(o.rr.n_top_logprobs, WD_LOGPROBS_MAX);
	cr_assert_eq(o.rr.top_logprobs[WD_LOGPROBS_MAX - 1]->token, 100 + WD_LOGPROBS_MAX - 1);
	cr_assert_eq(o.rr.top_logprobs[WD_LOGPROBS_MAX - 1]->logprob,
		     -0.5f * (float)(WD_LOGPROBS_MAX - 1));

	fresh(&o);
	cr_assert_eq(wd_row_logprobs(&o, -2.0f, NULL, NULL, 0), 0);
	cr_assert_eq(o.rr.logprob, -2.0f);
	cr_assert_eq(o.rr.n_top_logprobs, 0);
	cr_assert_null(o.rr.top_logprobs);
	fresh(&o);
	cr_assert_eq(wd_row_logprobs(&o, -2.0f, NULL, NULL, -4), 0, "n < 0 counts as 0");
	cr_assert_eq(o.rr.n_top_logprobs, 0);
}

/* A NaN value (non-finite logits on either backend) fails the row with an internal error and
 * a message; no log-probabilities are reported, the rest of the result is as it was. */
Test(wd_row, nan_logprob_fails_the_row)
{
	struct wd_row_out o;
	int32_t ids[2] = { 3, 4 };
	float lp[2] = { -1.0f, -2.0f };

	fresh(&o);
	cr_assert_eq(wd_row_logprobs(&o, NAN, ids, lp, 2), -1);
	cr_assert_eq(o.rr.error, BDFP4__SERVE_ERROR__SERVE_ERR_INTERNAL);
	cr_assert_not_null(o.rr.message);
	cr_assert_not_null(strstr(o.rr.message, "non-finite logits"), "%s", o.rr.message);
	cr_assert_eq(o.rr.n_top_logprobs, 0);
	cr_assert_null(o.rr.top_logprobs);
	cr_assert_eq(o.rr.logprob, 0.0f);
	cr_assert_eq(o.rr.request_id, 41);
	cr_assert_eq(o.rr.token, 1234);
}

/* A prefix hit's first chunk over 4 shared pages at 512: its sink is the context's first 16
 * tokens, or all of a shorter context; a row that is no hit has none; a hit that is not a
 * prefill chunk at the end of its block table, or has no context, is refused and says why. */
Test(wd_row, prefix_hit_rule)
{
	int32_t bt[5] = { 7, 3, 9, 1, 4 }, ctx[600] = { 0 };
	Bdfp4__PlanRow r;
	char msg[WD_MSG_MAX];

	bdfp4__plan_row__init(&r);
	r.resume = true;
	r.prefill = true;
	r.position = 512;
	r.prefix_pages = 4;
	r.block_table = bt;
	r.n_block_table = 4;
	r.context = ctx;
	r.n_context = 512;
	cr_expect_eq(wd_row_prefix_sink(&r, msg, sizeof(msg)), 16);
	r.n_context = 10;
	cr_expect_eq(wd_row_prefix_sink(&r, msg, sizeof(msg)), 10);
	r.prefix_pages = 0;
	cr_expect_eq(wd_row_prefix_sink(&r, msg, sizeof(msg)), 0, "no shared pages: no hit");
	r.prefix_pages = 4;
	r.resume = false;
	cr_expect_eq(wd_row_prefix_sink(&r, msg, sizeof(msg)), 0, "not a resume: no hit");
	r.resume = true;

	struct {
		bool prefill;
		int32_t position;
		uint32_t prefix_pages;
		size_t n_block_table, n_context;
		const char *why;
	} bad[] = { { false, 512, 4, 4, 512, "a decode row" },
		    { true, 512, 5, 4, 512, "more shared pages than the block table" },
		    { true, 512, 4, 4, 0, "no context to rebuild the sink from" },
		    { true, 640, 4, 4, 512, "a position past the block table's end" },
		    { true, 512, 4, 5, 512, "a position before the block table's end" } };
	for (size_t b = 0; b < sizeof(bad) / sizeof(bad[0]); b++) {
		r.prefill = bad[b].prefill;
		r.position = bad[b].position;
		r.prefix_pages = bad[b].prefix_pages;
		r.n_block_table = bad[b].n_block_table;
		r.n_context = bad[b].n_context;
		msg[0] = 0;
		cr_expect_eq(wd_row_prefix_sink(&r, msg, sizeof(msg)), -1, "%s", bad[b].why);
		cr_expect(strstr(msg, "prefix hit of"), "%s: %s", bad[b].why, msg);
	}
}
