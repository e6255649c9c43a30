/*
 * rpc_wire: the wire floor of one generated token over llama.cpp's RPC framing.
 *
 * Why: the protocol trace (rpc_trace.py) shows what one token costs on the wire: a few
 * fire-and-forget messages up (inputs and a graph recompute, ~30-40 KB) and one round
 * trip whose answer is the logits (~513 KB for a 128k vocabulary). This program replays
 * exactly that pattern with the same framing (command byte, u64 size, payload; answers
 * as u64 size, payload), blocking sockets and TCP_NODELAY, with no GPU and no ggml, so
 * the time it measures is what the network path alone costs per token (loopback, veth,
 * slirp4netns...). Time lost beyond it is serialization, synchronization and copies.
 *
 *   rpc_wire server HOST PORT
 *   rpc_wire client HOST PORT ITERATIONS UP_BYTES UP_MESSAGES DOWN_BYTES
 *
 * The client prints one JSON line: median and mean microseconds per token.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static int io_all(int fd, void *buf, size_t n, int writing) {
    char *p = buf;
    while (n) {
        ssize_t k = writing ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
        if (k <= 0) return -1;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

static int nodelay(int fd) {
    int one = 1;
    return setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static int serve(const char *host, int port) {
    int ls = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, host, &a.sin_addr);
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(ls, (struct sockaddr *)&a, sizeof a) || listen(ls, 4)) { perror("bind/listen"); return 1; }
    printf("listening\n");
    fflush(stdout);
    char *buf = malloc(64 << 20);
    for (;;) {
        int fd = accept(ls, NULL, NULL);
        if (fd < 0) return 1;
        nodelay(fd);
        for (;;) {
            uint8_t cmd;
            uint64_t size;
            if (io_all(fd, &cmd, 1, 0) || io_all(fd, &size, 8, 0) || size > (64u << 20)) break;
            if (io_all(fd, buf, size, 0)) break;
            if (cmd == 8) { /* GET_TENSOR: answer with the asked number of bytes */
                uint64_t want;
                memcpy(&want, buf, 8);
                if (want > (64u << 20) || io_all(fd, &want, 8, 1) || io_all(fd, buf, want, 1)) break;
            }
        }
        close(fd);
    }
}

static int client(const char *host, int port, int iters, size_t up, int msgs, uint64_t down) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, host, &a.sin_addr);
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) { perror("connect"); return 1; }
    nodelay(fd);
    size_t each = up / (size_t)msgs;
    char *buf = calloc(1, each + (size_t)down + 16);
    double *t = malloc(sizeof(double) * (size_t)iters), sum = 0;
    for (int i = -10; i < iters; i++) { /* 10 warm-up tokens */
        double t0 = now_us();
        for (int m = 0; m < msgs; m++) {
            uint8_t cmd = 6; /* SET_TENSOR, no answer */
            uint64_t size = each;
            if (io_all(fd, &cmd, 1, 1) || io_all(fd, &size, 8, 1) || io_all(fd, buf, each, 1)) return 1;
        }
        uint8_t cmd = 8;
        uint64_t size = 8, got;
        if (io_all(fd, &cmd, 1, 1) || io_all(fd, &size, 8, 1) || io_all(fd, &down, 8, 1)) return 1;
        if (io_all(fd, &got, 8, 0) || got != down || io_all(fd, buf, down, 0)) return 1;
        if (i >= 0) { t[i] = now_us() - t0; sum += t[i]; }
    }
    qsort(t, (size_t)iters, sizeof(double), cmp_double);
    printf("{\"iterations\": %d, \"up_bytes\": %zu, \"up_messages\": %d, \"down_bytes\": %llu, "
           "\"median_us\": %.2f, \"mean_us\": %.2f}\n", iters, up, msgs, (unsigned long long)down,
           t[iters / 2], sum / iters);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 4 && !strcmp(argv[1], "server")) return serve(argv[2], atoi(argv[3]));
    if (argc == 8 && !strcmp(argv[1], "client"))
        return client(argv[2], atoi(argv[3]), atoi(argv[4]), (size_t)atoll(argv[5]), atoi(argv[6]),
                      (uint64_t)atoll(argv[7]));
    fprintf(stderr, "usage: rpc_wire server HOST PORT | client HOST PORT ITERS UP_BYTES UP_MSGS DOWN_BYTES\n");
    return 2;
}
