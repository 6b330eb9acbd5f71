/* bd_clock.h — the monotonic clock every daemon and tool reads for deadlines and timing
 * (CLOCK_MONOTONIC: unaffected by wall-clock changes; its zero is arbitrary).
 */
#ifndef BD_CLOCK_H
#define BD_CLOCK_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Milliseconds, microseconds and seconds of the monotonic clock. */
int64_t bd_now_ms(void);
int64_t bd_now_us(void);
double bd_now_s(void);

#ifdef __cplusplus
}
#endif
#endif
