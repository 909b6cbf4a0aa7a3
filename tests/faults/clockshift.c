/* An LD_PRELOAD shim for tests/test_multihost.py: a host whose wall clock is off.
 *
 * CLOCK_REALTIME (and its coarse variant), gettimeofday() and time() read SHIM_CLOCK_SHIFT_NS
 * nanoseconds ahead (negative: behind); the monotonic clocks are untouched, as on a real host
 * whose NTP-disciplined wall clock differs from another host's. Python's time.time_ns() and
 * libstdc++'s system_clock go through clock_gettime(CLOCK_REALTIME). Built by the test with
 * gcc -shared -fPIC.
 *
 * SHIM_BOOT_ID, when set, is the machine's boot id read from /proc/sys/kernel/random/boot_id
 * (open / open64 / openat / openat64 of that path give a file holding it): another host has
 * another boot id, and commpatch takes ranks that share one to share a wall clock. */
#undef _FORTIFY_SOURCE
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

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

/* A file descriptor holding SHIM_BOOT_ID for the boot id's path; -2 for any other open. */
static int boot_id_fd(const char *path)
{
    const char *id = getenv("SHIM_BOOT_ID");
    if (!id || !path || strcmp(path, "/proc/sys/kernel/random/boot_id") != 0)
        return -2;
    int fd = memfd_create("boot_id", 0);
    if (fd < 0)
        return -2;
    dprintf(fd, "%s\n", id);
    lseek(fd, 0, SEEK_SET);
    return fd;
}

#define SHIM_OPEN(name)                                                          \
    int name(const char *path, int flags, ...)                                  \
    {                                                                            \
        static int (*real)(const char *, int, ...);                             \
        va_list ap;                                                              \
        va_start(ap, flags);                                                     \
        mode_t mode = (flags & (O_CREAT | O_TMPFILE)) ? va_arg(ap, mode_t) : 0;  \
        va_end(ap);                                                              \
        int fd = boot_id_fd(path);                                               \
        if (fd != -2)                                                            \
            return fd;                                                           \
        if (!real)                                                               \
            real = (int (*)(const char *, int, ...))dlsym(RTLD_NEXT, #name);     \
        return real(path, flags, mode);                                          \
    }

#define SHIM_OPENAT(name)                                                           \
    int name(int dirfd, const char *path, int flags, ...)                          \
    {                                                                               \
        static int (*real)(int, const char *, int, ...);                           \
        va_list ap;                                                                 \
        va_start(ap, flags);                                                        \
        mode_t mode = (flags & (O_CREAT | O_TMPFILE)) ? va_arg(ap, mode_t) : 0;     \
        va_end(ap);                                                                 \
        int fd = boot_id_fd(path);                                                  \
        if (fd != -2)                                                               \
            return fd;                                                              \
        if (!real)                                                                  \
            real = (int (*)(int, const char *, int, ...))dlsym(RTLD_NEXT, #name);   \
        return real(dirfd, path, flags, mode);                                      \
    }

SHIM_OPEN(open)
SHIM_OPEN(open64)
SHIM_OPENAT(openat)
SHIM_OPENAT(openat64)
