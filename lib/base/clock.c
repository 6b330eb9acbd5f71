/* clock.c — the monotonic clock (bd_clock.h). */
#include <time.h>

#include "base/bd_clock.h"

int64_t bd_now_us(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

int64_t bd_now_ms(void)
{
	return bd_now_us() / 1000;
}

double bd_now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}
