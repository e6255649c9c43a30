/*
 * apirctl-front: the door of a router server's container, for requests that name no model.
 *
 * llama-server's router mode answers a POST whose JSON body has no "model" with HTTP 400 ("model name
 * is missing from the request"), while a one-model server answers it: a client written for one model
 * fails against a server of several. This program runs the router as its child, listens on the
 * container's port in its place, and passes each request on to it unchanged, except that a POST whose
 * JSON object has no top-level "model" key gets the server's default model (the one `apirctl ps` names).
 * Management requests (/models...) and every other request pass as they are.
 *
 * One request per connection: the request goes upstream with "Connection: close" and the answer is
 * relayed until the router closes it (a streamed answer included), so no HTTP framing of the answer
 * is parsed. A body sent in chunks is passed on as it comes, without a default. Signals that stop the
 * container (SIGTERM, SIGINT) go to the router; the program exits with the router's status.
 * Built static by `apirctl setup` with the host's compiler, as apirctl-health is.
 *
 *   apirctl-front --listen PORT --upstream PORT --model NAME -- PROGRAM [ARGS...]
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#define HEAD_MAX  (64 * 1024)
#define BODY_MAX  (512L * 1024 * 1024) /* a chat with images in base64 is large; more is refused */
#define NAME_MAX_LEN 200

static volatile sig_atomic_t stop_signal = 0;

static void on_stop(int sig) {
    stop_signal = sig;
}

static void on_child(int sig) {
    (void) sig; /* only wakes poll() */
}

static int write_all(int fd, const char * data, size_t len) {
    while (len > 0) {
        ssize_t n = write(fd, data, len);
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            return -1;
        }
        data += n;
        len  -= (size_t) n;
    }
    return 0;
}

static void answer_error(int fd, const char * status) {
    char text[256];
    int  n = snprintf(text, sizeof(text),
                      "HTTP/1.1 %s\r\nContent-Type: text/plain\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n%s\n",
                      status, strlen(status) + 1, status);
    if (n > 0) {
        write_all(fd, text, (size_t) n);
    }
}

/* the first "\r\n\r\n" in buf[0..len), or NULL */
static const char * head_end(const char * buf, size_t len) {
    for (size_t i = 0; i + 3 < len; i++) {
        if (memcmp(buf + i, "\r\n\r\n", 4) == 0) {
            return buf + i;
        }
    }
    return NULL;
}

/* the value of header `name` within the head lines [lines, end), trimmed, or NULL; *vlen its length */
static const char * header_value(const char * lines, const char * end, const char * name, size_t * vlen) {
    size_t nlen = strlen(name);
    const char * line = lines;
    while (line < end) {
        const char * eol = memchr(line, '\r', (size_t) (end - line));
        if (eol == NULL) {
            eol = end;
        }
        if ((size_t) (eol - line) > nlen && line[nlen] == ':' && strncasecmp(line, name, nlen) == 0) {
            const char * v = line + nlen + 1;
            while (v < eol && (*v == ' ' || *v == '\t')) {
                v++;
            }
            const char * e = eol;
            while (e > v && (e[-1] == ' ' || e[-1] == '\t')) {
                e--;
            }
            *vlen = (size_t) (e - v);
            return v;
        }
        line = eol + 2;
    }
    return NULL;
}

/*
 * Whether the JSON text is an object, and whether it has a top-level key "model". *open is the offset
 * of its '{' and *empty whether nothing but white space follows it before '}'. Returns 0 for an object,
 * -1 for anything else (the body then passes unchanged and the router judges it).
 */
static int scan_object(const char * s, size_t len, size_t * open, int * empty, int * has_model) {
    size_t i = 0;
    while (i < len && (s[i] == ' ' || s[i] == '\t' || s[i] == '\r' || s[i] == '\n')) {
        i++;
    }
    if (i >= len || s[i] != '{') {
        return -1;
    }
    *open = i;
    size_t j = i + 1;
    while (j < len && (s[j] == ' ' || s[j] == '\t' || s[j] == '\r' || s[j] == '\n')) {
        j++;
    }
    *empty      = j < len && s[j] == '}';
    *has_model  = 0;
    int depth   = 0;
    for (; i < len; i++) {
        char c = s[i];
        if (c == '"') {
            size_t start = i + 1;
            for (i = start; i < len && s[i] != '"'; i++) {
                if (s[i] == '\\') {
                    i++;
                }
            }
            if (i >= len) {
                return -1;
            }
            if (depth == 1) {
                size_t k = i + 1;
                while (k < len && (s[k] == ' ' || s[k] == '\t' || s[k] == '\r' || s[k] == '\n')) {
                    k++;
                }
                if (k < len && s[k] == ':' && i - start == 5 && memcmp(s + start, "model", 5) == 0) {
                    *has_model = 1;
                }
            }
        } else if (c == '{' || c == '[') {
            depth++;
        } else if (c == '}' || c == ']') {
            depth--;
            if (depth == 0) {
                return 0;
            }
        }
    }
    return -1;
}

static int read_some(int fd, char * buf, size_t cap) {
    for (;;) {
        ssize_t n = read(fd, buf, cap);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        return (int) n;
    }
}

/* copy bytes both ways until the upstream closes its side (the answer is complete) */
static void relay(int client, int upstream) {
    static char buf[64 * 1024];
    struct pollfd fds[2] = { { client, POLLIN, 0 }, { upstream, POLLIN, 0 } };
    for (;;) {
        if (poll(fds, 2, -1) < 0) {
            if (errno == EINTR) {
                continue;
            }
            return;
        }
        if (fds[1].revents) {
            int n = read_some(upstream, buf, sizeof(buf));
            if (n <= 0 || write_all(client, buf, (size_t) n) != 0) {
                return;
            }
        }
        if (fds[0].revents) {
            int n = read_some(client, buf, sizeof(buf));
            if (n <= 0) {
                shutdown(upstream, SHUT_WR);
                fds[0].fd = -1; /* the client is done sending; its answer may still come */
            } else if (write_all(upstream, buf, (size_t) n) != 0) {
                return;
            }
        }
    }
}

static int connect_upstream(long port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) {
        return -1;
    }
    struct sockaddr_in addr;
    memset(&addr, 0, sizeof(addr));
    addr.sin_family      = AF_INET;
    addr.sin_port        = htons((unsigned short) port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *) &addr, sizeof(addr)) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static int dropped_header(const char * line, size_t len) {
    static const char * const names[] = { "connection", "keep-alive", "proxy-connection", "content-length", "expect" };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        size_t n = strlen(names[i]);
        if (len > n && line[n] == ':' && strncasecmp(line, names[i], n) == 0) {
            return 1;
        }
    }
    return 0;
}

/* one client connection: one request, its answer, then close */
static void serve_one(int client, long upstream_port, const char * model) {
    static char head[HEAD_MAX];
    size_t got = 0;
    const char * end = NULL;
    struct timeval limit = { .tv_sec = 60, .tv_usec = 0 }; /* a client that sends no request is dropped */
    setsockopt(client, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
    while ((end = head_end(head, got)) == NULL) {
        if (got == sizeof(head)) {
            answer_error(client, "431 Request Header Fields Too Large");
            return;
        }
        int n = read_some(client, head + got, sizeof(head) - got);
        if (n <= 0) {
            return;
        }
        got += (size_t) n;
    }
    struct timeval none = { .tv_sec = 0, .tv_usec = 0 }; /* a long generation is not a stalled client */
    setsockopt(client, SOL_SOCKET, SO_RCVTIMEO, &none, sizeof(none));

    const char * first_eol = memchr(head, '\r', (size_t) (end - head));
    const char * lines = first_eol + 2;
    size_t vlen = 0;
    const char * length_text = header_value(lines, end + 2, "content-length", &vlen);
    const char * chunked = header_value(lines, end + 2, "transfer-encoding", &vlen);
    int is_post = (size_t) (first_eol - head) > 5 && memcmp(head, "POST ", 5) == 0;
    int management = is_post && strncmp(head + 5, "/models", 7) == 0;
    size_t have = got - (size_t) (end + 4 - head); /* body bytes read with the head */

    long body_len = -1;
    if (length_text != NULL) {
        char * stop = NULL;
        body_len = strtol(length_text, &stop, 10);
        if (stop == length_text || body_len < 0 || body_len > BODY_MAX) {
            answer_error(client, "413 Content Too Large");
            return;
        }
    }
    if (header_value(lines, end + 2, "expect", &vlen) != NULL && body_len > 0) {
        write_all(client, "HTTP/1.1 100 Continue\r\n\r\n", 25); /* the body is read here, not upstream */
    }

    char * body = NULL;
    size_t body_size = 0;
    if (body_len >= 0 && chunked == NULL) {
        body_size = (size_t) body_len;
        body = malloc(body_size + NAME_MAX_LEN + 16);
        if (body == NULL) {
            answer_error(client, "503 Service Unavailable");
            return;
        }
        size_t taken = have < body_size ? have : body_size;
        memcpy(body, end + 4, taken);
        while (taken < body_size) {
            int n = read_some(client, body + taken, body_size - taken);
            if (n <= 0) {
                free(body);
                return;
            }
            taken += (size_t) n;
        }
        have = 0;
        size_t open = 0;
        int empty = 0, has_model = 0;
        if (is_post && !management && scan_object(body, body_size, &open, &empty, &has_model) == 0 && !has_model) {
            char field[NAME_MAX_LEN + 16];
            int  n = snprintf(field, sizeof(field), "\"model\":\"%s\"%s", model, empty ? "" : ",");
            memmove(body + open + 1 + n, body + open + 1, body_size - open - 1);
            memcpy(body + open + 1, field, (size_t) n);
            body_size += (size_t) n;
        }
    }

    int up = connect_upstream(upstream_port);
    if (up < 0) {
        answer_error(client, "503 Service Unavailable");
        free(body);
        return;
    }
    /* the request line and headers, less those that frame the connection or the body, then ours */
    int failed = write_all(up, head, (size_t) (first_eol + 2 - head));
    const char * line = lines;
    while (!failed && line < end + 2) {
        const char * eol = memchr(line, '\r', (size_t) (end + 2 - line));
        size_t len = (size_t) (eol - line);
        if (!dropped_header(line, len)) {
            failed = write_all(up, line, len + 2);
        }
        line = eol + 2;
    }
    char tail[64];
    int n = body != NULL ? snprintf(tail, sizeof(tail), "Content-Length: %zu\r\nConnection: close\r\n\r\n", body_size)
                         : snprintf(tail, sizeof(tail), "Connection: close\r\n\r\n");
    failed = failed || write_all(up, tail, (size_t) n);
    if (!failed && body != NULL) {
        failed = write_all(up, body, body_size);
    } else if (!failed && have > 0) { /* a chunked body: what came with the head, the rest in relay */
        failed = write_all(up, end + 4, have);
    }
    free(body);
    if (!failed) {
        relay(client, up);
    }
    close(up);
}

static int listen_on(long port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) {
        return -1;
    }
    int on = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
    struct sockaddr_in addr;
    memset(&addr, 0, sizeof(addr));
    addr.sin_family      = AF_INET;
    addr.sin_port        = htons((unsigned short) port);
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    if (bind(fd, (struct sockaddr *) &addr, sizeof(addr)) != 0 || listen(fd, 128) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static long parse_port(const char * text) {
    char * end = NULL;
    long port = strtol(text, &end, 10);
    return (*end != '\0' || port <= 0 || port > 65535) ? -1 : port;
}

static int usage(void) {
    fprintf(stderr, "usage: apirctl-front --listen PORT --upstream PORT --model NAME -- PROGRAM [ARGS...]\n");
    return 2;
}

int main(int argc, char ** argv) {
    long listen_port = -1, upstream_port = -1;
    const char * model = NULL;
    int i = 1;
    for (; i + 1 < argc && strcmp(argv[i], "--") != 0; i += 2) {
        if (strcmp(argv[i], "--listen") == 0) {
            listen_port = parse_port(argv[i + 1]);
        } else if (strcmp(argv[i], "--upstream") == 0) {
            upstream_port = parse_port(argv[i + 1]);
        } else if (strcmp(argv[i], "--model") == 0) {
            model = argv[i + 1];
        } else {
            return usage();
        }
    }
    if (i >= argc || strcmp(argv[i], "--") != 0 || i + 1 >= argc || listen_port < 0 || upstream_port < 0 ||
        model == NULL || *model == '\0' || strlen(model) > NAME_MAX_LEN) {
        return usage();
    }
    for (const char * c = model; *c; c++) { /* written into JSON as it is: no quote, escape or control */
        if (*c == '"' || *c == '\\' || (unsigned char) *c < 0x20) {
            fprintf(stderr, "apirctl-front: the model name must not hold quotes, backslashes or control bytes\n");
            return 2;
        }
    }

    int server = listen_on(listen_port);
    if (server < 0) {
        perror("apirctl-front: listen");
        return 1;
    }
    struct sigaction stop = { 0 }, child = { 0 }, ignore = { 0 };
    stop.sa_handler = on_stop;
    child.sa_handler = on_child;
    ignore.sa_handler = SIG_IGN;
    sigaction(SIGTERM, &stop, NULL);
    sigaction(SIGINT, &stop, NULL);
    sigaction(SIGCHLD, &child, NULL);
    sigaction(SIGPIPE, &ignore, NULL);

    pid_t upstream = fork();
    if (upstream < 0) {
        perror("apirctl-front: fork");
        return 1;
    }
    if (upstream == 0) {
        close(server);
        signal(SIGTERM, SIG_DFL);
        signal(SIGINT, SIG_DFL);
        signal(SIGCHLD, SIG_DFL);
        signal(SIGPIPE, SIG_DFL);
        execvp(argv[i + 1], argv + i + 1);
        perror("apirctl-front: exec");
        _exit(127);
    }

    int forwarded = 0;
    for (;;) {
        if (stop_signal && !forwarded) {
            kill(upstream, stop_signal);
            forwarded = 1;
        }
        int status = 0;
        pid_t done;
        while ((done = waitpid(-1, &status, WNOHANG)) > 0) {
            if (done == upstream) {
                return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
            }
        }
        struct pollfd fds = { server, POLLIN, 0 };
        if (poll(&fds, 1, 1000) <= 0) {
            continue;
        }
        int client = accept(server, NULL, NULL);
        if (client < 0) {
            continue;
        }
        pid_t handler = fork();
        if (handler == 0) {
            close(server);
            signal(SIGTERM, SIG_DFL);
            signal(SIGINT, SIG_DFL);
            serve_one(client, upstream_port, model);
            close(client);
            _exit(0);
        }
        close(client);
    }
}
