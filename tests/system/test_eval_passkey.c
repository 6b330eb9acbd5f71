/* test_eval_passkey.c — `bdfp4 eval-passkey --summarize`: the accuracy table of a run's log.
 * Suite "eval_passkey".
 *
 * A log of 5 trials written here (3 depths; bf16 right 4 times, fp8 3 times, one fp8 answer
 * equal to the reference's wrong one) must give those counts, the accuracy and its Wilson
 * interval; a record of another context is left out; a line that is no record fails with its
 * line number.
 */
#include <criterion/criterion.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "model/bd_eval.h"
#include "serve_common.h"

SV_TEST_SUITE(eval_passkey, 60);

static void write_log(const char *path, const char *extra)
{
	static const char *const rec[] = {
		"{\"trial\":0,\"ctx\":2048,\"depth\":0,\"depths\":3,\"key\":\"12345\",\"answers\":"
		"{\"bf16 (reference)\":\"12345\",\"bf16\":\"12345\",\"fp8\":\"12345\"}}",
		"{\"trial\":1,\"ctx\":2048,\"depth\":1,\"depths\":3,\"key\":\"22222\",\"answers\":"
		"{\"bf16 (reference)\":\"22222\",\"bf16\":\"22222\",\"fp8\":\"2222\"}}",
		"{\"trial\":2,\"ctx\":2048,\"depth\":2,\"depths\":3,\"key\":\"33333\",\"answers\":"
		"{\"bf16 (reference)\":\"3333\",\"bf16\":\"3333\",\"fp8\":\"3333\"}}",
		"{\"trial\":3,\"ctx\":2048,\"depth\":0,\"depths\":3,\"key\":\"44444\",\"answers\":"
		"{\"bf16 (reference)\":\"44444\",\"bf16\":\"44444\",\"fp8\":\"44444\"}}",
		"{\"trial\":4,\"ctx\":2048,\"depth\":1,\"depths\":3,\"key\":\"55555\",\"answers\":"
		"{\"bf16 (reference)\":\"55555\",\"bf16\":\"55555\",\"fp8\":\"55555\"}}",
		"{\"trial\":0,\"ctx\":4096,\"depth\":0,\"depths\":3,\"key\":\"1\",\"answers\":"
		"{\"bf16 (reference)\":\"9\",\"bf16\":\"9\",\"fp8\":\"9\"}}",
	};
	FILE *f = fopen(path, "w");
	cr_assert_not_null(f);
	for (size_t i = 0; i < sizeof(rec) / sizeof(rec[0]); i++)
		fprintf(f, "%s\n", rec[i]);
	if (extra)
		fprintf(f, "%s\n", extra);
	cr_assert_eq(fclose(f), 0);
}

/* Runs the summary of log (stderr into err), returns the exit status; out: stdout. */
static int summarize(const char *log, char *out, size_t cap, const char *err)
{
	char cmd[PATH_MAX + 1024];
	snprintf(cmd, sizeof(cmd), "'%s/bdfp4' eval-passkey --kv bf16,fp8 --json --summarize '%s' 2>'%s'",
		 E.bin, log, err);
	FILE *p = popen(cmd, "r");
	cr_assert_not_null(p);
	size_t n = fread(out, 1, cap - 1, p);
	out[n] = '\0';
	int st = pclose(p);
	return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

Test(eval_passkey, summary_counts_accuracy_and_wilson)
{
	char log[256], err[256], out[8192];
	snprintf(log, sizeof(log), "%s/pk.log", E.dir);
	snprintf(err, sizeof(err), "%s/pk.err", E.dir);
	write_log(log, NULL);
	cr_assert_eq(summarize(log, out, sizeof(out), err), 0);
	json_error_t je;
	json_t *j = json_loads(out, 0, &je);
	cr_assert(json_is_array(j), "not JSON: %s", out);
	cr_assert_eq(json_array_size(j), 3, "the reference, bf16 and fp8");
	static const struct { const char *name; int ok, same; } want[] = {
		{ "bf16 (reference)", 4, 5 }, { "bf16", 4, 5 }, { "fp8", 3, 4 },
	};
	for (size_t i = 0; i < 3; i++) {
		json_t *r = json_array_get(j, i);
		double lo, hi;
		cr_expect_str_eq(json_string_value(json_object_get(r, "config")), want[i].name);
		cr_expect_eq(json_integer_value(json_object_get(r, "trials")), 5,
			     "the 4096 record is another context");
		cr_expect_eq(json_integer_value(json_object_get(r, "correct")), want[i].ok);
		cr_expect_eq(json_integer_value(json_object_get(r, "same_as_ref")), want[i].same);
		cr_assert_eq(bd_eval_wilson(want[i].ok, 5, 1.959963984540054, &lo, &hi), 0);
		cr_expect_float_eq(json_real_value(json_object_get(r, "wilson_lo")), lo, 1e-5);
		cr_expect_float_eq(json_real_value(json_object_get(r, "wilson_hi")), hi, 1e-5);
	}
	json_decref(j);
}

Test(eval_passkey, a_line_that_is_no_record_fails_with_its_number)
{
	char log[256], err[256], out[8192];
	snprintf(log, sizeof(log), "%s/bad.log", E.dir);
	snprintf(err, sizeof(err), "%s/bad.err", E.dir);
	write_log(log, "{\"trial\": 9}");
	cr_assert_eq(summarize(log, out, sizeof(out), err), 1);
	FILE *f = fopen(err, "r");
	char msg[512] = "";
	cr_assert_not_null(f);
	size_t n = fread(msg, 1, sizeof(msg) - 1, f);
	msg[n] = '\0';
	fclose(f);
	cr_expect(strstr(msg, "bad.log:7: not a trial record"), "stderr: %s", msg);
}
