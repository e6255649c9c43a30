// libFuzzer harness: graphs built by graph_gen.h, sent to ggml-rpc's server as a client sends them,
// and computed by the real CPU backend behind it.
//
// The server runs in this process (ggml_backend_rpc_start_server on a Unix socket of its own, in a
// thread, over the CPU device), so its command loop, rpc_server::graph_compute with its
// deserialization, and then ggml's CPU kernels run on every graph, under the sanitizers. Each input
// is a client session of real messages:
//
//     HELLO (on a new connection)
//     ALLOC_BUFFER, BUFFER_GET_BASE  per tensor (not views): a buffer of exactly its bytes
//     SET_TENSOR                     per buffer: its contents (the leaves')
//     GRAPH_COMPUTE                  the serialized graph
//     GET_ALIGNMENT                  a synchronous call: the graph has run when it answers
//     FREE_BUFFER                    per buffer
//
// A server that refuses a message closes the connection; the harness connects again for the next
// input. libFuzzer's timer signal interrupts the harness's socket calls, which it retries (EINTR),
// and never reaches the server's thread, which blocks it: before, an interrupted call on a fresh
// connection stopped the campaign on an input that then replayed cleanly alone. Built as
// apir_graph_fuzz.cpp is (build.py), against libggml-rpc and libggml-cpu.
//
// Environment: GFUZZ_VERBOSE=1 keeps the libraries' logs, GFUZZ_STATS=1 prints counts at exit, GFUZZ_DESCRIBE=1 prints each graph,
// GFUZZ_COUNTS=DIR keeps the counts in a file there (graph_gen.h's map_counts).

#include "graph_gen.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml-rpc.h"

#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

namespace {

#pragma pack(push, 1)
struct rpc_tensor {
    uint64_t id;
    uint32_t type;
    uint64_t buffer;
    uint32_t ne[GGML_MAX_DIMS];
    uint32_t nb[GGML_MAX_DIMS];
    uint32_t op;
    int32_t  op_params[GGML_MAX_OP_PARAMS / sizeof(int32_t)];
    int32_t  flags;
    uint64_t src[GGML_MAX_SRC];
    uint64_t view_src;
    uint64_t view_offs;
    uint64_t data;
    char     name[GGML_MAX_NAME];
    int32_t  use_count;
};
#pragma pack(pop)

static_assert(sizeof(rpc_tensor) == 296, "rpc_tensor is a wire format");

constexpr uint8_t CMD_ALLOC_BUFFER    = 0;
constexpr uint8_t CMD_GET_ALIGNMENT   = 1;
constexpr uint8_t CMD_BUFFER_GET_BASE = 3;
constexpr uint8_t CMD_FREE_BUFFER     = 4;
constexpr uint8_t CMD_SET_TENSOR      = 6;
constexpr uint8_t CMD_GRAPH_COMPUTE   = 10;
constexpr uint8_t CMD_HELLO           = 14;
constexpr size_t  CONN_CAPS_SIZE      = 24;

bool        describe_graphs = false;
std::string socket_path;
int         fd       = -1;
gfuzz::counts * counts = nullptr;

void silent_log(ggml_log_level, const char *, void *) {}

bool send_all(const void * p, size_t n) {
    const auto * b = (const uint8_t *) p;
    while (n > 0) {
        ssize_t k = send(fd, b, n, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR) {
            continue;
        }
        if (k <= 0) {
            return false;
        }
        b += k;
        n -= (size_t) k;
    }
    return true;
}

bool recv_all(void * p, size_t n) {
    auto * b = (uint8_t *) p;
    while (n > 0) {
        ssize_t k = recv(fd, b, n, 0);
        if (k < 0 && errno == EINTR) {
            continue;
        }
        if (k <= 0) {
            return false;
        }
        b += k;
        n -= (size_t) k;
    }
    return true;
}

// a message: the command, its payload's size, the payload (and `more` bytes after it, sent from where they are)
bool command(uint8_t cmd, const std::vector<uint8_t> & payload, const uint8_t * more = nullptr, size_t n_more = 0) {
    const uint64_t size = payload.size() + n_more;
    return send_all(&cmd, 1) && send_all(&size, 8) && (payload.empty() || send_all(payload.data(), payload.size())) &&
           (n_more == 0 || send_all(more, n_more));
}

bool response(void * out, size_t n) {
    uint64_t size = 0;
    return recv_all(&size, 8) && size == n && recv_all(out, n);
}

template <typename T> void put(std::vector<uint8_t> & out, const T & v) {
    const auto * p = (const uint8_t *) &v;
    out.insert(out.end(), p, p + sizeof(v));
}

void disconnect() {
    if (fd >= 0) {
        close(fd);
        fd = -1;
    }
}

bool connect_server() {
    fd = socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", socket_path.c_str());
    if (connect(fd, (sockaddr *) &addr, sizeof(addr)) != 0) {
        disconnect();
        return false;
    }
    std::vector<uint8_t> hello(CONN_CAPS_SIZE, 0);
    uint8_t              rsp[4 + CONN_CAPS_SIZE];  // version, padding, the server's capabilities
    if (!command(CMD_HELLO, hello) || !response(rsp, sizeof(rsp))) {
        disconnect();
        return false;
    }
    return true;
}

rpc_tensor record(const gfuzz::graph & g, int i, const std::vector<uint64_t> & buffers,
                  const std::vector<uint64_t> & bases) {
    const gfuzz::tensor & t = g.t[i];
    rpc_tensor            w;
    memset(&w, 0, sizeof(w));
    w.id     = (uint64_t) i + 1;
    w.type   = t.type;
    w.buffer = t.buffer >= 0 ? buffers[t.buffer] : 0;
    for (int d = 0; d < GGML_MAX_DIMS; d++) {
        w.ne[d] = (uint32_t) t.ne[d];
        w.nb[d] = (uint32_t) t.nb[d];
    }
    w.op = t.op;
    memcpy(w.op_params, t.params, sizeof(w.op_params));
    w.flags = t.node ? GGML_TENSOR_FLAG_COMPUTE : GGML_TENSOR_FLAG_INPUT;
    for (int s = 0; s < GGML_MAX_SRC; s++) {
        w.src[s] = t.src[s] >= 0 ? (uint64_t) t.src[s] + 1 : 0;
    }
    w.view_src  = t.view_src >= 0 ? (uint64_t) t.view_src + 1 : 0;
    w.view_offs = t.view_offs;
    w.data      = t.buffer >= 0 ? bases[t.buffer] + t.offset : 0;
    w.use_count = 1;
    snprintf(w.name, sizeof(w.name), "t%d", i);
    return w;
}

// A buffer per tensor of `g` (views share their source's), each filled with one SET_TENSOR of its
// bytes. False when the connection failed on the way: the server drops a client whose graph it
// refused, and the drop can show only at a later command.
bool upload(const gfuzz::graph & g, std::vector<uint64_t> & buffers, std::vector<uint64_t> & bases) {
    buffers.clear();
    bases.clear();
    std::vector<uint8_t> req;
    for (size_t b = 0; b < g.sizes.size(); b++) {
        req.clear();
        put(req, (uint32_t) 0);
        put(req, (uint64_t) g.sizes[b]);
        uint64_t alloc_rsp[2] = {};
        uint64_t base         = 0;
        if (!command(CMD_ALLOC_BUFFER, req) || !response(alloc_rsp, sizeof(alloc_rsp)) || !alloc_rsp[0]) {
            return false;
        }
        req.clear();
        put(req, alloc_rsp[0]);
        if (!command(CMD_BUFFER_GET_BASE, req) || !response(&base, sizeof(base))) {
            return false;
        }
        buffers.push_back(alloc_rsp[0]);
        bases.push_back(base);

        const gfuzz::graph one = gfuzz::whole_buffer(g.sizes[b]);
        req.clear();
        put(req, record(one, 0, { buffers.back() }, { base }));
        put(req, (uint8_t) 0);
        put(req, (uint64_t) 0);
        if (!command(CMD_SET_TENSOR, req, g.data(b), g.sizes[b])) {
            return false;
        }
    }
    return true;
}

void print_stats() {
    if (getenv("GFUZZ_STATS")) {
        fprintf(stderr, "rpc-graph-fuzz: %zu inputs, %zu graphs computed, %zu refused\n", (size_t) counts->inputs,
                (size_t) counts->computed, (size_t) counts->refused);
    }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    counts          = gfuzz::map_counts("rpc_graph_fuzz");
    describe_graphs = getenv("GFUZZ_DESCRIBE") != nullptr;
    if (!getenv("GFUZZ_VERBOSE")) {
        ggml_log_set(silent_log, nullptr);
    }
    socket_path = "/tmp/rpc-graph-fuzz-" + std::to_string(getpid()) + ".sock";
    unlink(socket_path.c_str());
    ggml_backend_dev_t cpu = ggml_backend_reg_dev_get(ggml_backend_cpu_reg(), 0);
    static std::string endpoint = "unix:" + socket_path;
    std::thread([cpu]() mutable {
        // libFuzzer's timer (SIGALRM, every -timeout/2 s) and its other signals go to the fuzzing
        // thread: a server's socket call they interrupt fails as a dropped client would (EINTR), and a
        // real ggml-rpc-server gets no such signals
        sigset_t async;
        sigemptyset(&async);
        for (int sig : { SIGALRM, SIGINT, SIGTERM, SIGUSR1, SIGUSR2, SIGXFSZ }) {
            sigaddset(&async, sig);
        }
        pthread_sigmask(SIG_BLOCK, &async, nullptr);
        // the server's banner goes to stdout, which libFuzzer leaves alone
        ggml_backend_rpc_start_server(endpoint.c_str(), nullptr, 1, 1, &cpu);
    }).detach();
    for (int i = 0; i < 500 && !connect_server(); i++) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (fd < 0) {
        fprintf(stderr, "rpc-graph-fuzz: the server does not answer on %s\n", socket_path.c_str());
        abort();
    }
    atexit(print_stats);
    atexit([] { unlink(socket_path.c_str()); });
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    gfuzz::graph g;
    if (!gfuzz::generate(data, size, g)) {
        return -1;
    }
    counts->inputs++;
    if (describe_graphs) {
        gfuzz::describe(g);
    }
    const bool fresh = fd < 0;
    if (fresh && !connect_server()) {
        fprintf(stderr, "rpc-graph-fuzz: the server stopped accepting connections\n");
        abort();
    }
    std::vector<uint64_t> buffers, bases;
    if (!upload(g, buffers, bases)) {
        // a connection the server dropped after the last input, unnoticed until now: once more on a
        // new one (a server that drops a fresh client setting up its buffers is a finding)
        disconnect();
        if (fresh || !connect_server() || !upload(g, buffers, bases)) {
            fprintf(stderr, "rpc-graph-fuzz: a fresh connection failed while its %zu buffers were set up\n",
                    g.sizes.size());
            abort();
        }
    }
    std::vector<uint8_t> req;
    req.clear();
    put(req, (uint32_t) 0);
    put(req, (uint32_t) g.nodes.size());
    for (int n : g.nodes) {
        put(req, (uint64_t) n + 1);
    }
    put(req, (uint32_t) g.t.size());
    for (size_t i = 0; i < g.t.size(); i++) {
        put(req, record(g, (int) i, buffers, bases));
    }
    uint64_t alignment = 0;
    std::vector<uint8_t> dev(4, 0);
    if (command(CMD_GRAPH_COMPUTE, req) && command(CMD_GET_ALIGNMENT, dev) && response(&alignment, sizeof(alignment))) {
        counts->computed++;
        for (uint64_t buffer : buffers) {
            req.clear();
            put(req, buffer);
            command(CMD_FREE_BUFFER, req);
        }
    } else {
        // refused: the server closed the connection, and freed the client's buffers with it
        counts->refused++;
        disconnect();
    }
    return 0;
}
