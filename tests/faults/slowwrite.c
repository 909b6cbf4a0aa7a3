/* An LD_PRELOAD shim for tests/test_faults.py: a slow or failing disk, for commpatch's logs only.
 *
 * Every write() to a file whose name ends in ".cplog" is
 *   - delayed by SHIM_DELAY_MS milliseconds (a hung NFS mount: the call blocks, then succeeds);
 *   - when SHIM_LOG names a file, noted there as "<thread id> <bytes>\n" (who wrote, and how much).
 * Other files, pipes and sockets are untouched. Built by the test with gcc -shared -fPIC. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static ssize_t (*real_write)(int, const void *, size_t);

static int is_log(int fd)
{
    char link[64], target[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, sizeof target - 1);
    if (n <= 0)
        return 0;
    target[n] = 0;
    char *deleted = strstr(target, " (deleted)");
    if (deleted)
        *deleted = 0;
    size_t len = strlen(target);
    return len > 6 && strcmp(target + len - 6, ".cplog") == 0;
}

static void note(size_t count)
{
    const char *path = getenv("SHIM_LOG");
    if (!path || !*path)
        return;
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
        return;
    char line[64];
    int n = snprintf(line, sizeof line, "%ld %zu\n", (long)syscall(SYS_gettid), count);
    real_write(fd, line, (size_t)n);
    close(fd);
}

ssize_t write(int fd, const void *buf, size_t count)
{
    if (!real_write)
        real_write = (ssize_t (*)(int, const void *, size_t))dlsym(RTLD_NEXT, "write");
    if (fd > 2 && is_log(fd)) {
        note(count);
        const char *delay = getenv("SHIM_DELAY_MS");
        long ms = delay ? atol(delay) : 0;
        if (ms > 0) {
            struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
            while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
                ;
        }
    }
    return real_write(fd, buf, count);
}
