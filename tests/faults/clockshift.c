/* An LD_PRELOAD shim for tests/test_multihost.py: a host whose wall clock is off.
 *
 * CLOCK_REALTIME (and its coarse variant), gettimeofday() and time() read SHIM_CLOCK_SHIFT_NS
 * nanoseconds ahead (negative: behind); the monotonic clocks are untouched, as on a real host
 * whose NTP-disciplined wall clock differs from another host's. Python's time.time_ns() and
 * libstdc++'s system_clock go through clock_gettime(CLOCK_REALTIME). Built by the test with
 * gcc -shared -fPIC. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

static int64_t shift_ns(void)
{
    static int64_t shift = INT64_MIN;
    if (shift == INT64_MIN) {
        const char *s = getenv("SHIM_CLOCK_SHIFT_NS");
        shift = s ? strtoll(s, NULL, 10) : 0;
    }
    return shift;
}

static void add(struct timespec *ts, int64_t ns)
{
    int64_t total = (int64_t)ts->tv_nsec + ns % 1000000000LL;
    ts->tv_sec += ns / 1000000000LL + total / 1000000000LL;
    total %= 1000000000LL;
    if (total < 0) {
        total += 1000000000LL;
        ts->tv_sec -= 1;
    }
    ts->tv_nsec = total;
}

int clock_gettime(clockid_t id, struct timespec *ts)
{
    static int (*real)(clockid_t, struct timespec *);
    if (!real)
        real = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
    int rc = real(id, ts);
    if (rc == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE))
        add(ts, shift_ns());
    return rc;
}

int gettimeofday(struct timeval *tv, void *tz)
{
    struct timespec ts;
    int rc = clock_gettime(CLOCK_REALTIME, &ts);
    (void)tz;
    if (rc == 0 && tv) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return rc;
}

time_t time(time_t *out)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (out)
        *out = ts.tv_sec;
    return ts.tv_sec;
}
