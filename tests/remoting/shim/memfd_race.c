/* An LD_PRELOAD shim that widens the window between a server's checks of a received memfd.
 *
 * After the first check (fstat, fstatfs or fcntl F_GET_SEALS) that the server makes of a memfd named
 * $MEMFD_RACE_NAME, the shim creates $MEMFD_RACE_DIR/window and waits until the test creates
 * $MEMFD_RACE_DIR/go: the test's client resizes and seals the file in between, as a hostile peer
 * could at any time. A server that trusts a size it read before the seals maps a file that no longer
 * has those bytes. Once per memfd (by inode); every other descriptor passes through untouched.
 * tests/remoting/test_shm_memfd.py builds and loads it.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <time.h>
#include <unistd.h>

static int real_fstat_of(int fd, struct stat * st) {
    static int (*real)(int, struct stat *);
    if (!real) {
        real = (int (*)(int, struct stat *)) dlsym(RTLD_NEXT, "fstat");
    }
    return real(fd, st);
}

static int is_race_memfd(int fd) {
    const char * name = getenv("MEMFD_RACE_NAME");
    if (!name || !getenv("MEMFD_RACE_DIR")) {
        return 0;
    }
    char link[64];
    char target[512];
    char want[256];
    snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, sizeof(target) - 1);
    if (n < 0) {
        return 0;
    }
    target[n] = '\0';
    snprintf(want, sizeof(want), "/memfd:%s ", name);
    return strncmp(target, want, strlen(want)) == 0;
}

static void widen_window(int fd) {
    static ino_t seen_ino;
    static int   seen;
    struct stat  st;
    if (!is_race_memfd(fd) || real_fstat_of(fd, &st) != 0 || (seen && st.st_ino == seen_ino)) {
        return;
    }
    seen     = 1;
    seen_ino = st.st_ino;
    const char * dir = getenv("MEMFD_RACE_DIR");
    char window[4096];
    char go[4096];
    snprintf(window, sizeof(window), "%s/window", dir);
    snprintf(go, sizeof(go), "%s/go", dir);
    int w = open(window, O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
    if (w >= 0) {
        close(w);
    }
    /* the test answers within milliseconds; give up after 30 s rather than hang a broken test */
    struct timespec ms = { 0, 1000 * 1000 };
    for (int i = 0; i < 30000 && access(go, F_OK) != 0; i++) {
        nanosleep(&ms, NULL);
    }
    unlink(go);
}

int fstat(int fd, struct stat * st) {
    int r = real_fstat_of(fd, st);
    widen_window(fd);
    return r;
}

int fstat64(int fd, struct stat64 * st) {
    static int (*real)(int, struct stat64 *);
    if (!real) {
        real = (int (*)(int, struct stat64 *)) dlsym(RTLD_NEXT, "fstat64");
    }
    int r = real(fd, st);
    widen_window(fd);
    return r;
}

int fstatfs(int fd, struct statfs * buf) {
    static int (*real)(int, struct statfs *);
    if (!real) {
        real = (int (*)(int, struct statfs *)) dlsym(RTLD_NEXT, "fstatfs");
    }
    int r = real(fd, buf);
    widen_window(fd);
    return r;
}

int fstatfs64(int fd, struct statfs64 * buf) {
    static int (*real)(int, struct statfs64 *);
    if (!real) {
        real = (int (*)(int, struct statfs64 *)) dlsym(RTLD_NEXT, "fstatfs64");
    }
    int r = real(fd, buf);
    widen_window(fd);
    return r;
}

/* fcntl's third argument, when there is one, is an int or a pointer: passed on as a pointer-sized word */
static int fcntl_through(const char * symbol, int fd, int cmd, void * arg) {
    int (*real)(int, int, ...) = (int (*)(int, int, ...)) dlsym(RTLD_NEXT, symbol);
    int r = real(fd, cmd, arg);
    if (cmd == F_GET_SEALS) {
        widen_window(fd);
    }
    return r;
}

int fcntl(int fd, int cmd, ...) {
    va_list ap;
    va_start(ap, cmd);
    void * arg = va_arg(ap, void *);
    va_end(ap);
    return fcntl_through("fcntl", fd, cmd, arg);
}

int fcntl64(int fd, int cmd, ...) {
    va_list ap;
    va_start(ap, cmd);
    void * arg = va_arg(ap, void *);
    va_end(ap);
    return fcntl_through("fcntl64", fd, cmd, arg);
}
