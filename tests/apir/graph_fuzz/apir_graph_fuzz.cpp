// libFuzzer harness: graphs built by graph_gen.h, sent to the APIR backend library
// (libggml-virtgpu-backend) as a frontend sends them, and computed by the real libggml-cpu it loads.
//
// Each input is one client session of real forwarded calls through apir_backend_dispatcher:
//
//     [EXT_GET_FEATURES asking for wide records, when bit 0 of the input's first byte is set]
//     BUFFER_TYPE_ALLOC_BUFFER   per tensor (not views): a buffer of exactly its bytes
//     BUFFER_SET_TENSOR          per buffer: its contents (the leaves'), from shared resource 1
//     BACKEND_GRAPH_COMPUTE      the serialized graph, from shared resource 2
//     BUFFER_FREE_BUFFER         per buffer
//
// so the library's decoders, its node checks (backend-node-check.cpp) and then ggml's CPU kernels
// run on every graph the checks accept.
//
// When bit 1 of the first byte is set, the client is granted EXT_GRAPH_DELTA: the graph is computed
// and kept by id with EXT_GRAPH_RUN, and the bytes after the graph's program are deltas, each one
// EXT_GRAPH_DELTA that updates the kept graph and computes it:
//
//     deltas := n:u8 delta*                       (1 + n % 4 deltas)
//     delta  := k:u8 (which:u8 how:u8 value:u8)*  (1 + k % 4 steps, then a change per tensor that differs)
//
// A step changes the graph as llama.cpp's steps do, from the shapes the host keeps: a batch dimension
// of tensor `which` shrunk or grown back (in every tensor that had the same size there, strides
// following), a view's offset moved, a tensor's data offset moved; or it writes one hostile field
// into `which`'s change (a shape, a stride, an offset, another buffer, id, op, view source or index).
// The delta checks must refuse what the kernels cannot compute; what they take is computed.
//
// When bit 2 of the first byte is set too, each delta is preceded by a clear:
//
//     delta  := c:u8 [value:u8 when c is even] k:u8 ...
//
// an even c is BUFFER_CLEAR of buffer (c / 2) % n_buffers with `value`, then the kept graph run by id
// (EXT_GRAPH_RUN, graph_size 0). A clear leaves the kept graphs in place (patch 0013): indices it
// sets out of range (0xff: -1) must be refused by the run's index checks, other contents computed;
// a refused run ends the input's deltas as a refused delta does.
//
// Built with clang -fsanitize=fuzzer,address,undefined against libraries compiled with
// -fsanitize=address,undefined,fuzzer-no-link (build.py).
//
// Environment: APIR_FUZZ_GGML_LIBRARY (default libggml-cpu.so next to the backend library),
// GFUZZ_VERBOSE=1 keeps the library's logs, GFUZZ_KEEP_BACKEND=1 keeps one backend for all inputs, GFUZZ_STATS=1 prints the accepted graphs per op at exit, GFUZZ_DESCRIBE=1 prints each graph,
// GFUZZ_COUNTS=DIR keeps the counts in a file there (graph_gen.h's map_counts), GFUZZ_IDS_PER_CLIENT=N moves
// to a new client after N buffer ids (at most the library's bound, the default).

#include "graph_gen.h"
#include "ggml-backend.h"

#include <dlfcn.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

extern "C" {
struct apir_fuzz_callbacks {
    const char * (*get_config)(uint32_t ctx_id, const char * key);
    void * (*get_shmem_ptr)(uint32_t ctx_id, uint32_t res_id);
};

uint32_t apir_backend_initialize(uint32_t ctx_id, apir_fuzz_callbacks * cbs);
uint32_t apir_backend_dispatcher(uint32_t ctx_id, apir_fuzz_callbacks * cbs, uint32_t cmd_type, char * dec_cur,
                                 const char * dec_end, char * enc_cur, const char * enc_end, char ** enc_cur_after);
}

namespace {

// the wire's tensor records (shared/apir_cs_rpc.h), declared here so that the harness builds
// against any version of the library
struct apir_rpc_tensor {
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
    char     padding[4];
};

struct apir_rpc_tensor_wide {
    uint64_t id;
    uint32_t type;
    uint32_t reserved;
    uint64_t buffer;
    int64_t  ne[GGML_MAX_DIMS];
    uint64_t nb[GGML_MAX_DIMS];
    uint32_t op;
    int32_t  op_params[GGML_MAX_OP_PARAMS / sizeof(int32_t)];
    int32_t  flags;
    uint64_t src[GGML_MAX_SRC];
    uint64_t view_src;
    uint64_t view_offs;
    uint64_t data;
    char     name[GGML_MAX_NAME];
};

// EXT_GRAPH_DELTA's change (shared/apir_backend_ext.h)
struct apir_graph_change {
    uint32_t index;
    uint32_t op;
    uint64_t id;
    uint64_t view_src;
    uint64_t buffer;
    int64_t  ne[GGML_MAX_DIMS];
    uint64_t nb[GGML_MAX_DIMS];
    uint64_t view_offs;
    uint64_t data;
};

static_assert(sizeof(apir_graph_change) == 112, "apir_graph_change is a wire format");
static_assert(sizeof(apir_rpc_tensor) == 304, "apir_rpc_tensor is a wire format");
static_assert(sizeof(apir_rpc_tensor_wide) == 328, "apir_rpc_tensor_wide is a wire format");

constexpr uint32_t CMD_GET_BUFFER_TYPE = 7;
constexpr uint32_t CMD_ALLOC_BUFFER    = 14;
constexpr uint32_t CMD_SET_TENSOR      = 17;
constexpr uint32_t CMD_BUFFER_CLEAR    = 20;
constexpr uint32_t CMD_FREE_BUFFER     = 21;
constexpr uint32_t CMD_GRAPH_COMPUTE   = 22;
constexpr uint32_t CMD_GET_FEATURES    = 256;
constexpr uint32_t CMD_GRAPH_RUN       = 257;
constexpr uint32_t CMD_GRAPH_DELTA     = 258;
constexpr uint64_t FEATURE_GRAPH_RUN   = 1;
constexpr uint64_t FEATURE_WIDE        = 2;
constexpr uint64_t FEATURE_GRAPH_DELTA = 8;
constexpr uint32_t GRAPH_RUN_DONE      = 0;
constexpr uint64_t GRAPH_ID            = 1;
constexpr uint32_t LOAD_LIBRARY_OK     = 6;
constexpr uint32_t FIRST_CLIENT        = 1;
// a client is given buffer ids from 1 up to the library's APIR_MAX_BUFFER_ID (backend-objects.h),
// never reused, so that a stale id never names a later buffer: a long campaign moves to a new client
// before its ids run out, as a guest would reconnect
constexpr uint64_t IDS_PER_CLIENT      = ((uint64_t) 1 << 22) - 1;
constexpr uint32_t RES_DATA            = 1;
constexpr uint32_t RES_GRAPH           = 2;
constexpr size_t   RES_SIZE            = gfuzz::MAX_BUFFER + 4096;
constexpr size_t   REPLY_SIZE          = 16384 - 4;

struct resource {
    uint32_t  id;
    uint8_t * ptr;
};

resource    resources[] = { { RES_DATA, nullptr }, { RES_GRAPH, nullptr } };
bool        describe_graphs = false;
uint32_t    client_ctx      = FIRST_CLIENT;
uint64_t    ids_given       = 0;  // buffer ids the current client was given
uint64_t    ids_per_client  = IDS_PER_CLIENT;
std::string last_error;           // the library's last error line, kept for the harness's own aborts
bool        keep_backend    = false;
// the library's own backend and device (backend-dispatched.cpp), exported
ggml_backend_t *     library_bck = nullptr;
ggml_backend_dev_t * library_dev = nullptr;
std::string ggml_library;
uint64_t    buft_id = 0;
size_t      accepted[GGML_OP_COUNT], tried[GGML_OP_COUNT];
gfuzz::counts * counts = nullptr;

const char * get_config(uint32_t, const char * key) {
    if (strcmp(key, "ggml.library.path") == 0) {
        return ggml_library.c_str();
    }
    if (strcmp(key, "ggml.library.reg") == 0) {
        return "ggml_backend_cpu_reg";
    }
    return nullptr;
}

void * get_shmem_ptr(uint32_t, uint32_t res_id) {
    for (auto & r : resources) {
        if (r.id == res_id) {
            return r.ptr;
        }
    }
    return nullptr;
}

uint64_t shmem_size(uint32_t, uint32_t res_id) {
    return get_shmem_ptr(0, res_id) ? RES_SIZE : 0;
}

apir_fuzz_callbacks callbacks = { get_config, get_shmem_ptr };

uint8_t * map_resource(size_t size) {
    const size_t page = (size_t) sysconf(_SC_PAGESIZE);
    auto *       base = (uint8_t *) mmap(nullptr, size + 2 * page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED || mprotect(base + page, size, PROT_READ | PROT_WRITE) != 0) {
        perror("apir-graph-fuzz: mmap");
        abort();
    }
    return base + page;
}

// the library's logs are dropped but for its last error, which the harness prints when it aborts
void silent_log(ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) {
        last_error = text;
    }
}

[[noreturn]] void harness_abort(const char * what) {
    fprintf(stderr, "apir-graph-fuzz: %s (client %u, %llu buffer ids given); the library's last error: %s", what,
            client_ctx, (unsigned long long) ids_given, last_error.empty() ? "none\n" : last_error.c_str());
    abort();
}

struct writer {
    std::vector<uint8_t> bytes;

    template <typename T> void put(const T & v) {
        const auto * p = (const uint8_t *) &v;
        bytes.insert(bytes.end(), p, p + sizeof(v));
    }
};

// one forwarded call; its reply, or false when the library refused it
bool call(uint32_t cmd, const std::vector<uint8_t> & request, std::vector<uint8_t> * reply = nullptr) {
    char * req = new char[request.size() + 1];
    char * out = new char[REPLY_SIZE];
    if (!request.empty()) {
        memcpy(req, request.data(), request.size());
    }
    char *   after = nullptr;
    uint32_t ret   = apir_backend_dispatcher(client_ctx, &callbacks, cmd, req, req + request.size(), out, out + REPLY_SIZE, &after);
    if (ret == 0 && reply) {
        reply->assign(out, after);
    }
    delete[] req;
    delete[] out;
    return ret == 0;
}

uint64_t reply_u64(const std::vector<uint8_t> & reply) {
    uint64_t v = 0;
    if (reply.size() >= 8) {
        memcpy(&v, reply.data(), 8);
    }
    return v;
}

apir_rpc_tensor_wide record(const gfuzz::graph & g, int i, const std::vector<uint64_t> & buffers) {
    const gfuzz::tensor & t = g.t[i];
    apir_rpc_tensor_wide  w;
    memset(&w, 0, sizeof(w));
    w.id     = (uint64_t) i + 1;
    w.type   = t.type;
    w.buffer = t.buffer >= 0 ? buffers[t.buffer] : 0;
    for (int d = 0; d < GGML_MAX_DIMS; d++) {
        w.ne[d] = t.ne[d];
        w.nb[d] = t.nb[d];
    }
    w.op = t.op;
    memcpy(w.op_params, t.params, sizeof(w.op_params));
    w.flags = t.node ? GGML_TENSOR_FLAG_COMPUTE : GGML_TENSOR_FLAG_INPUT;
    for (int s = 0; s < GGML_MAX_SRC; s++) {
        w.src[s] = t.src[s] >= 0 ? (uint64_t) t.src[s] + 1 : 0;
    }
    w.view_src  = t.view_src >= 0 ? (uint64_t) t.view_src + 1 : 0;
    w.view_offs = t.view_offs;
    w.data      = t.offset;
    snprintf(w.name, sizeof(w.name), "t%d", i);
    return w;
}

void put_record(writer & out, const apir_rpc_tensor_wide & w, bool wide) {
    if (wide) {
        out.put(w);
        return;
    }
    apir_rpc_tensor n;
    memset(&n, 0, sizeof(n));
    n.id     = w.id;
    n.type   = w.type;
    n.buffer = w.buffer;
    for (int d = 0; d < GGML_MAX_DIMS; d++) {
        n.ne[d] = (uint32_t) w.ne[d];
        n.nb[d] = (uint32_t) w.nb[d];
    }
    n.op = w.op;
    memcpy(n.op_params, w.op_params, sizeof(n.op_params));
    n.flags = w.flags;
    memcpy(n.src, w.src, sizeof(n.src));
    n.view_src  = w.view_src;
    n.view_offs = w.view_offs;
    n.data      = w.data;
    memcpy(n.name, w.name, sizeof(n.name));
    out.put(n);
}

// The library's backend, replaced by a new one before each graph: apir-host forks a child per client,
// so each client starts with a backend of its own, and the CPU backend's work buffer (which only
// grows) is then sized by this graph alone -- a kernel that writes past what the plan gave it leaves
// the buffer. One thread: the plan's work buffer has no other thread's part after this one's.
void fresh_backend() {
    if (keep_backend || !library_bck || !library_dev || !*library_dev) {
        return;
    }
    if (*library_bck) {
        ggml_backend_free(*library_bck);
    }
    *library_bck = ggml_backend_dev_init(*library_dev, nullptr);
    if (!*library_bck) {
        fprintf(stderr, "apir-graph-fuzz: the device gives no new backend\n");
        abort();
    }
    auto set_threads = (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(
        ggml_backend_dev_backend_reg(*library_dev), "ggml_backend_set_n_threads");
    if (set_threads) {
        set_threads(*library_bck, 1);
    }
}

void set_features(uint64_t wanted) {
    writer req;
    req.put(wanted);
    call(CMD_GET_FEATURES, req.bytes);
}

// EXT_GRAPH_RUN (`changes` empty: the serialization in resource 2, kept under GRAPH_ID; `graph` empty
// too: graph_size 0, the graph kept under GRAPH_ID) or EXT_GRAPH_DELTA (`changes` in resource 2), with
// no writes or outputs: whether the graph was computed
bool graph_run(const std::vector<uint8_t> & graph, const std::vector<apir_graph_change> & changes) {
    writer run;
    run.put(GRAPH_ID);
    run.put(RES_GRAPH);
    if (changes.empty()) {
        if (!graph.empty()) {
            memcpy(resources[1].ptr, graph.data(), graph.size());
        }
        run.put((uint64_t) graph.size());
    } else {
        memcpy(resources[1].ptr, changes.data(), changes.size() * sizeof(apir_graph_change));
        run.put((uint64_t) 0);
        run.put((uint32_t) changes.size());
    }
    run.put((uint64_t) 0);  // writes_offset
    run.put((uint32_t) 0);  // n_writes
    run.put(RES_GRAPH);     // out_res_id
    run.put((uint32_t) 0);  // n_outputs
    std::vector<uint8_t> reply;
    if (!call(changes.empty() ? CMD_GRAPH_RUN : CMD_GRAPH_DELTA, run.bytes, &reply) || reply.size() < 8) {
        return false;
    }
    uint32_t result = 0;
    int32_t  status = 0;
    memcpy(&result, reply.data(), 4);
    memcpy(&status, reply.data() + 4, 4);
    return result == GRAPH_RUN_DONE && status == GGML_STATUS_SUCCESS;
}

// Strides that follow a tensor's new shape, where its first ones followed its first shape: a
// permutation permutes its source's strides, a view of a whole tensor (a copy's destination) has its
// strides, a contiguous tensor stays contiguous.
void restride(const gfuzz::graph & first, gfuzz::graph & now, int i) {
    gfuzz::tensor &       t    = now.t[i];
    const gfuzz::tensor & was  = first.t[i];
    gfuzz::tensor         flat = was;
    gfuzz::builder::contiguous(flat);
    if ((t.op == GGML_OP_PERMUTE || t.op == GGML_OP_TRANSPOSE) && t.src[0] >= 0) {
        const gfuzz::tensor & a = now.t[t.src[0]];
        for (int k = 0; k < 4; k++) {
            if (was.params[k] >= 0 && was.params[k] < 4 && was.nb[was.params[k]] == first.t[t.src[0]].nb[k]) {
                t.nb[was.params[k]] = a.nb[k];
            }
        }
    } else if (t.view_src >= 0 && memcmp(was.nb, first.t[t.view_src].nb, sizeof(was.nb)) == 0) {
        memcpy(t.nb, now.t[t.view_src].nb, sizeof(t.nb));
    } else if (memcmp(flat.nb, was.nb, sizeof(flat.nb)) == 0) {
        gfuzz::builder::contiguous(t);
    }
}

// One step of a delta on `now`, the graph as the host keeps it (`first`: as it was sent). A hostile
// field is left in `*hostile` (its kind + 1) for the change of `*which` once the changes are made.
void delta_step(gfuzz::reader & r, const gfuzz::graph & first, gfuzz::graph & now, int * which, int * hostile) {
    const int       n     = (int) now.t.size();
    const int       x     = r.u8() % n;
    const uint8_t   how   = r.u8();
    const uint8_t   value = r.u8();
    gfuzz::tensor & t     = now.t[x];
    switch (how % 8) {
        case 1: {
            // a view's offset moved by whole rows (or elements) within its source, the data with it
            if (t.view_src < 0) {
                break;
            }
            const size_t step = t.nb[(value & 1) ? 1 : 0] * (1 + (value >> 1) % 4);
            if (value & 0x80) {
                if (t.view_offs >= step && t.offset >= step) {
                    t.view_offs -= step;
                    t.offset -= step;
                }
            } else {
                t.view_offs += step;
                t.offset += step;
            }
            break;
        }
        case 2:
            // a tensor's data offset moved within its buffer, or back to its start
            if (t.view_src < 0 && t.buffer >= 0) {
                t.offset = t.offset ? 0 : gfuzz::ALIGN * (1 + value % 4);
            }
            break;
        case 3:
            *which   = x;
            *hostile = 1 + value;
            break;
        default: {
            // a batch dimension shrunk, or grown back (past its first size now and then): in every
            // tensor whose same dimension had the same size at first and has now
            const int     d    = (how >> 3) % 4;
            const int64_t from = t.ne[d];
            const int64_t orig = first.t[x].ne[d];
            const int64_t to   = value < 0xf8 ? 1 + value % (orig > 0 ? orig : 1) : orig + (value - 0xf7);
            if (to == from) {
                break;
            }
            for (int i = 0; i < n; i++) {
                for (int e = 0; e < 4; e++) {
                    if (now.t[i].ne[e] == from && first.t[i].ne[e] == orig) {
                        now.t[i].ne[e] = to;
                    }
                }
            }
            for (int i = 0; i < n; i++) {  // sources before their views and users
                restride(first, now, i);
            }
            break;
        }
    }
}

// A hostile field in a change: the checks refuse all but another buffer that holds the tensor
void make_hostile(apir_graph_change & c, int kind, const std::vector<uint64_t> & buffers, size_t n_tensors) {
    const int d = (kind >> 4) % 4;
    switch (kind % 12) {
        case 0: c.ne[d] = -1; break;
        case 1: c.ne[d] = (int64_t) 1 << 40; break;
        case 2: c.nb[d] = 0; break;
        case 3: c.nb[d] = (uint64_t) 1 << 63; break;
        case 4: c.view_offs = UINT64_MAX - 7; break;
        case 5: c.data = UINT64_MAX - 7; break;
        case 6: c.buffer = buffers[(size_t) kind % buffers.size()]; break;  // another buffer, same offset
        case 7: c.buffer = 0x5eed; break;
        case 8: c.id += 1; break;
        case 9: c.op ^= 1; break;
        case 10: c.view_src = c.view_src ? 0 : 1; break;
        default: c.index = (uint32_t) n_tensors; break;
    }
}

// BUFFER_CLEAR of a buffer with `value` (as a frontend sends it: the byte in a u32), then the kept
// graph computed by id: whether the host computed it
bool clear_and_run(uint64_t buffer, uint8_t value) {
    writer clear;
    clear.put(buffer);
    clear.put((uint32_t) value);
    if (!call(CMD_BUFFER_CLEAR, clear.bytes)) {
        harness_abort("a clear of a buffer of the input was refused");
    }
    fresh_backend();
    return graph_run({}, {});  // graph_size 0: the graph kept under GRAPH_ID
}

// The input's deltas, after the graph was computed and kept: each made from the graph as the host
// keeps it, sent, and computed, until one is refused (the host then keeps the graph no more). With
// `clears`, each is preceded by a byte that may clear a buffer and run the kept graph (header).
void run_deltas(gfuzz::reader & r, const gfuzz::graph & first, const std::vector<uint64_t> & buffers, bool wide,
                bool clears) {
    gfuzz::graph kept = first;
    const int    n    = 1 + r.u8() % 4;
    for (int k = 0; k < n; k++) {
        if (clears) {
            const uint8_t c = r.u8();
            if (c % 2 == 0) {
                const size_t  which = (size_t) (c / 2) % buffers.size();
                const uint8_t value = r.u8();
                if (describe_graphs) {
                    fprintf(stderr, "delta %d: buffer b%zu cleared with 0x%02x, the kept graph run\n", k, which, value);
                }
                if (!clear_and_run(buffers[which], value)) {
                    counts->clears_refused++;
                    return;
                }
                counts->clears_computed++;
            }
        }
        gfuzz::graph now     = kept;
        int          which   = 0;
        int          hostile = 0;
        const int    steps   = 1 + r.u8() % 4;
        for (int s = 0; s < steps; s++) {
            delta_step(r, first, now, &which, &hostile);
        }
        std::vector<apir_graph_change> changes;
        for (size_t i = 0; i < now.t.size(); i++) {
            const apir_rpc_tensor_wide was = record(kept, (int) i, buffers);
            const apir_rpc_tensor_wide is  = record(now, (int) i, buffers);
            if (!hostile || (int) i != which) {
                if (memcmp(was.ne, is.ne, sizeof(is.ne)) == 0 && memcmp(was.nb, is.nb, sizeof(is.nb)) == 0 &&
                    was.view_offs == is.view_offs && was.data == is.data && was.buffer == is.buffer) {
                    continue;
                }
            }
            apir_graph_change c;
            memset(&c, 0, sizeof(c));
            c.index    = (uint32_t) i;
            c.op       = is.op;
            c.id       = is.id;
            c.view_src = is.view_src;
            c.buffer   = is.buffer;
            memcpy(c.ne, is.ne, sizeof(c.ne));
            memcpy(c.nb, is.nb, sizeof(c.nb));
            c.view_offs = is.view_offs;
            c.data      = is.data;
            if (!wide) {
                // what a narrow record carries: a shape past 32 bits is the hostile steps' to send
                for (int d = 0; d < GGML_MAX_DIMS; d++) {
                    c.ne[d] = (uint32_t) c.ne[d];
                    c.nb[d] = (uint32_t) c.nb[d];
                }
            }
            if (hostile && (int) i == which) {
                make_hostile(c, hostile - 1, buffers, now.t.size());
            }
            changes.push_back(c);
        }
        if (changes.empty()) {
            continue;
        }
        if (describe_graphs) {
            fprintf(stderr, "delta %d: %zu changes%s\n", k, changes.size(), hostile ? " (one hostile)" : "");
            gfuzz::describe(now);
        }
        fresh_backend();
        if (!graph_run({}, changes)) {
            counts->deltas_refused++;
            return;
        }
        counts->deltas_computed++;
        kept = now;
    }
}

void print_stats() {
    if (!getenv("GFUZZ_STATS")) {
        return;
    }
    fprintf(stderr,
            "apir-graph-fuzz: %zu inputs, %zu graphs computed, %zu computed after a delta, %zu deltas refused, "
            "%zu computed after a clear, %zu refused after a clear\n",
            (size_t) counts->inputs, (size_t) counts->computed, (size_t) counts->deltas_computed,
            (size_t) counts->deltas_refused, (size_t) counts->clears_computed, (size_t) counts->clears_refused);
    for (int op = 0; op < GGML_OP_COUNT; op++) {
        if (tried[op]) {
            fprintf(stderr, "  %-16s tried %8zu computed %8zu\n", ggml_op_name((ggml_op) op), tried[op], accepted[op]);
        }
    }
}
// the buffer type's id in the current client's table
void fetch_buffer_type() {
    std::vector<uint8_t> reply;
    if (!call(CMD_GET_BUFFER_TYPE, {}, &reply) || (buft_id = reply_u64(reply)) == 0) {
        harness_abort("no buffer type");
    }
}

// Moves to a new client (a context id of its own) when the current one could not be given `wanted`
// more buffer ids. The old client holds no buffer between inputs; it is left to the library.
void client_for(size_t wanted) {
    if (ids_given + wanted <= ids_per_client) {
        return;
    }
    client_ctx++;
    ids_given = 0;
    fetch_buffer_type();
    fprintf(stderr, "apir-graph-fuzz: client %u, the last one's buffer ids given\n", client_ctx);
}


}  // namespace

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    counts          = gfuzz::map_counts("apir_graph_fuzz");
    describe_graphs = getenv("GFUZZ_DESCRIBE") != nullptr;
    if (!getenv("GFUZZ_VERBOSE")) {
        ggml_log_set(silent_log, nullptr);
    }
    if (const char * lib = getenv("APIR_FUZZ_GGML_LIBRARY")) {
        ggml_library = lib;
    } else {
        Dl_info info;
        if (dladdr((void *) apir_backend_initialize, &info) == 0 || !info.dli_fname) {
            fprintf(stderr, "apir-graph-fuzz: cannot locate the backend library; set APIR_FUZZ_GGML_LIBRARY\n");
            abort();
        }
        std::string dir = info.dli_fname;
        ggml_library    = dir.substr(0, dir.rfind('/') + 1) + "libggml-cpu.so";
    }
    for (auto & r : resources) {
        r.ptr = map_resource(RES_SIZE);
    }
    typedef void (*set_size_fn)(uint64_t (*)(uint32_t, uint32_t));
    if (auto set = (set_size_fn) dlsym(RTLD_DEFAULT, "apir_backend_set_shmem_size_callback")) {
        set(shmem_size);
    }
    if (apir_backend_initialize(client_ctx, &callbacks) != LOAD_LIBRARY_OK) {
        fprintf(stderr, "apir-graph-fuzz: apir_backend_initialize(%s) failed\n", ggml_library.c_str());
        abort();
    }
    fetch_buffer_type();
    keep_backend = getenv("GFUZZ_KEEP_BACKEND") != nullptr;
    if (const char * ids = getenv("GFUZZ_IDS_PER_CLIENT")) {
        ids_per_client = std::min<uint64_t>(strtoull(ids, nullptr, 10), IDS_PER_CLIENT);
    }
    library_bck  = (ggml_backend_t *) dlsym(RTLD_DEFAULT, "bck");
    library_dev  = (ggml_backend_dev_t *) dlsym(RTLD_DEFAULT, "dev");
    if (!keep_backend && (!library_bck || !library_dev)) {
        fprintf(stderr, "apir-graph-fuzz: the library does not export its backend: one backend for all inputs\n");
    }
    atexit(print_stats);
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    gfuzz::graph g;
    size_t       used = 0;
    if (!gfuzz::generate(data, size, g, &used)) {
        return -1;
    }
    counts->inputs++;
    if (describe_graphs) {
        gfuzz::describe(g);
    }
    const bool wide  = size > 0 && (data[0] & 1);
    const bool delta = size > 0 && (data[0] & 2);
    client_for(g.sizes.size());  // before the features, which are the client's
    if (wide || delta) {
        set_features(FEATURE_GRAPH_RUN | (wide ? FEATURE_WIDE : 0) | (delta ? FEATURE_GRAPH_DELTA : 0));
    }

    // a buffer per tensor (views share their source's), each filled with one transfer of its bytes
    std::vector<uint64_t> buffers;
    for (size_t b = 0; b < g.sizes.size(); b++) {
        writer alloc;
        alloc.put(buft_id);
        alloc.put((uint64_t) g.sizes[b]);
        std::vector<uint8_t> reply;
        uint64_t             buffer = 0;
        const bool given = call(CMD_ALLOC_BUFFER, alloc.bytes, &reply) && (buffer = reply_u64(reply)) != 0;
        ids_given++;
        if (!given) {
            harness_abort(("a buffer of " + std::to_string(g.sizes[b]) + " bytes was refused").c_str());
        }
        buffers.push_back(buffer);

        memcpy(resources[0].ptr, g.data(b), g.sizes[b]);
        const gfuzz::graph one = gfuzz::whole_buffer(g.sizes[b]);
        writer set;
        set.put(buffer);
        put_record(set, record(one, 0, { buffer }), wide);
        set.put(RES_DATA);
        set.put((uint64_t) 0);
        set.put((uint64_t) g.sizes[b]);
        if (!call(CMD_SET_TENSOR, set.bytes)) {
            harness_abort("set_tensor of a whole buffer was refused");
        }
    }
    fresh_backend();

    writer graph;
    graph.put((uint32_t) g.nodes.size());
    for (int n : g.nodes) {
        graph.put((uint64_t) n + 1);
    }
    graph.put((uint32_t) g.t.size());
    for (size_t i = 0; i < g.t.size(); i++) {
        put_record(graph, record(g, (int) i, buffers), wide);
    }
    bool ok = false;
    if (delta) {
        ok = graph_run(graph.bytes, {});
    } else {
        memcpy(resources[1].ptr, graph.bytes.data(), graph.bytes.size());
        writer compute;
        compute.put(RES_GRAPH);
        compute.put((uint64_t) graph.bytes.size());
        ok = call(CMD_GRAPH_COMPUTE, compute.bytes);
    }
    for (int n : g.nodes) {
        tried[g.t[n].op]++;
        if (ok) {
            accepted[g.t[n].op]++;
        }
    }
    counts->computed += ok;
    counts->refused += !ok;
    if (delta && ok) {
        gfuzz::reader r{ data + used, size - used };
        run_deltas(r, g, buffers, wide, (data[0] & 4) != 0);
    }

    for (uint64_t buffer : buffers) {
        writer free_req;
        free_req.put(buffer);
        call(CMD_FREE_BUFFER, free_req.bytes);
    }
    if (wide || delta) {
        set_features(FEATURE_GRAPH_RUN);
    }
    return 0;
}
