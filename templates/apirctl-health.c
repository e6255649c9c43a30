/*
 * apirctl-health: the health check of apirctl's inference containers.
 *
 * The image holds llama.cpp and the libraries it loads, and no HTTP client, so Podman's health
 * check runs this: GET /health on 127.0.0.1:PORT, exit 0 when llama-server answers 200 (ready),
 * 1 otherwise, with the status line on stdout for `podman inspect`'s health log.
 * --live also counts 503 as alive: llama-server answers it while the model loads, which a liveness
 * probe must not punish with a restart. Built static by `apirctl setup` with the host's compiler.
 *
 *   apirctl-health [--live] [PORT]      (PORT: 8000, where llama-server listens in the container)
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

int main(int argc, char ** argv) {
    int live = 0;
    long port = 8000;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--live") == 0) {
            live = 1;
        } else {
            char * end = NULL;
            port = strtol(argv[i], &end, 10);
            if (*end != '\0' || port <= 0 || port > 65535) {
                fprintf(stderr, "usage: apirctl-health [--live] [PORT]\n");
                return 2;
            }
        }
    }

    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) {
        perror("apirctl-health: socket");
        return 1;
    }
    /* a hung server is unhealthy, never a hung check: on Linux the send limit bounds connect too */
    struct timeval limit = { .tv_sec = 5, .tv_usec = 0 };
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof(limit));

    struct sockaddr_in addr;
    memset(&addr, 0, sizeof(addr));
    addr.sin_family      = AF_INET;
    addr.sin_port        = htons((unsigned short) port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *) &addr, sizeof(addr)) != 0) {
        printf("cannot connect to 127.0.0.1:%ld\n", port);
        return 1;
    }

    static const char request[] = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    if (write(fd, request, sizeof(request) - 1) != (ssize_t) (sizeof(request) - 1)) {
        printf("cannot send the request\n");
        return 1;
    }

    char   reply[512];
    size_t got = 0;
    while (got < sizeof(reply) - 1) {
        ssize_t n = read(fd, reply + got, sizeof(reply) - 1 - got);
        if (n <= 0) {
            break;
        }
        got += (size_t) n;
    }
    reply[got] = '\0';
    close(fd);

    int status = 0;
    if (sscanf(reply, "HTTP/%*d.%*d %d", &status) != 1) {
        printf("no HTTP answer on 127.0.0.1:%ld\n", port);
        return 1;
    }
    const char * body = strstr(reply, "\r\n\r\n");
    printf("HTTP %d %s\n", status, body ? body + 4 : "");
    return status == 200 || (live && status == 503) ? 0 : 1;
}
