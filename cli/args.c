/* args.c — number arguments of the bdfp4 subcommands (cli.h). */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>

#include "cli.h"

bool cli_parse_long(const char *s, long lo, long hi, long *ret)
{
	char *end;
	errno = 0;
	long v = strtol(s, &end, 10);
	if (errno || end == s || *end || v < lo || v > hi)
		return false;
	*ret = v;
	return true;
}

bool cli_parse_int(const char *s, long lo, long hi, int *ret)
{
	long v;
	if (hi > INT_MAX || lo < INT_MIN || !cli_parse_long(s, lo, hi, &v))
		return false;
	*ret = (int)v;
	return true;
}

bool cli_parse_float(const char *s, float *ret)
{
	char *end;
	errno = 0;
	float v = strtof(s, &end);
	if (errno || end == s || *end || !isfinite(v))
		return false;
	*ret = v;
	return true;
}
