/* A stand-in for code a hostile client got to run in a host server: LD_PRELOADed, it interposes
 * poll() and accept(), which apir-host's child and ggml-rpc-server call once they serve, and the
 * first time one is called inside a seccomp filter (the sandbox has been entered) it tries what an
 * attacker would. One line per attempt goes to stderr ("sandbox-probe: ACTION denied|ALLOWED");
 * whatever got through leaves a file in $SANDBOX_PROBE_DIR for the test to find. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

static int probed;

static void report(const char * action, int ok, int err) {
    char line[256];
    int  n = snprintf(line, sizeof(line), "sandbox-probe: %s %s (errno %d)\n", action, ok ? "ALLOWED" : "denied", ok ? 0 : err);
    if (write(2, line, (size_t) n) < 0) {
        /* nothing else to tell */
    }
}

static void attack(void) {
    const char * dir = getenv("SANDBOX_PROBE_DIR");
    char         path[4096];
    if (dir == NULL || __atomic_exchange_n(&probed, 1, __ATOMIC_SEQ_CST)) {
        return;
    }
    if (prctl(PR_GET_SECCOMP, 0, 0, 0, 0) != 2) {
        __atomic_store_n(&probed, 0, __ATOMIC_SEQ_CST); /* not sandboxed yet: the parent, or before the lockdown */
        return;
    }
    int fd = open("/etc/passwd", O_RDONLY | O_CLOEXEC);
    report("open-read", fd >= 0, errno);
    snprintf(path, sizeof(path), "%s/written", dir);
    fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    report("open-write", fd >= 0, errno);

    int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    report("socket-inet", s >= 0, errno);
    const char * port = getenv("SANDBOX_PROBE_PORT");
    struct sockaddr_in to;
    memset(&to, 0, sizeof(to));
    to.sin_family      = AF_INET;
    to.sin_port        = htons((unsigned short) (port ? atoi(port) : 9));
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int r = connect(s >= 0 ? s : 0, (struct sockaddr *) &to, sizeof(to));
    report("connect-inet", r == 0, errno);
    int u = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    report("socket-unix", u >= 0, errno);

    pid_t child = fork();
    if (child == 0) {
        snprintf(path, sizeof(path), "%s/forked", dir);
        close(open(path, O_WRONLY | O_CREAT, 0600));
        _exit(0);
    }
    if (child > 0) {
        waitpid(child, NULL, 0);
    }
    report("fork", child >= 0, errno);

    /* last: if it works, this process becomes the shell and leaves its mark */
    snprintf(path, sizeof(path), "touch '%s/executed'", dir);
    char * argv[] = { (char *) "sh", (char *) "-c", path, NULL };
    execv("/bin/sh", argv);
    report("execve", 0, errno); /* still here: it failed */
}

int poll(struct pollfd * fds, nfds_t n, int timeout) {
    static int (*real)(struct pollfd *, nfds_t, int);
    if (real == NULL) {
        real = (int (*)(struct pollfd *, nfds_t, int)) dlsym(RTLD_NEXT, "poll");
    }
    attack();
    return real(fds, n, timeout);
}

int accept(int fd, struct sockaddr * addr, socklen_t * len) {
    static int (*real)(int, struct sockaddr *, socklen_t *);
    if (real == NULL) {
        real = (int (*)(int, struct sockaddr *, socklen_t *)) dlsym(RTLD_NEXT, "accept");
    }
    attack();
    return real(fd, addr, len);
}
