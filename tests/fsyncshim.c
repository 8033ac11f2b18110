/* An fsync recorder for the tests' Redis and Valkey servers (LD_PRELOAD): after each successful fsync or
   fdatasync it appends "<path> <size> <unix time>" to the file named by FSYNC_LOG, the size being the
   file's size before the call -- what that call is sure to have made durable. An OS crash keeps exactly
   what was fsynced; tests/redisproc.py's os_crash() cuts each append-only file back to it. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <time.h>

/* The size before the call: what fsync is sure to have made durable when it returns (bytes written
   by another thread while it runs may or may not be). */
static long long size_of(int fd) {
    struct stat st;
    return fstat(fd, &st) == 0 ? (long long)st.st_size : -1;
}

static void record(int fd, long long size) {
    const char *log = getenv("FSYNC_LOG");
    if (!log || size < 0) return;
    char link[64], path[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n <= 0) return;
    path[n] = 0;
    char line[4200];
    struct timespec ts; clock_gettime(CLOCK_REALTIME, &ts);
    int len = snprintf(line, sizeof line, "%s %lld %lld.%06ld\n", path, size, (long long)ts.tv_sec, ts.tv_nsec / 1000);
    int out = open(log, O_WRONLY | O_APPEND | O_CREAT, 0644);
    if (out < 0) return;
    if (write(out, line, len) < 0) { /* nothing to do: the test then sees less fsynced, not more */ }
    close(out);
}

int fsync(int fd) {
    static int (*real)(int);
    if (!real) real = dlsym(RTLD_NEXT, "fsync");
    long long size = size_of(fd);
    int r = real(fd);
    if (r == 0) record(fd, size);
    return r;
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (!real) real = dlsym(RTLD_NEXT, "fdatasync");
    long long size = size_of(fd);
    int r = real(fd);
    if (r == 0) record(fd, size);
    return r;
}
