// libFuzzer harness for the APIR host backend library (libggml-virtgpu-backend): FORWARD commands
// and the shared memory they name (serialized graphs, tensor data), fed through the library's C ABI
// the way virglrenderer and apir-host call it.
//
// Built with clang -fsanitize=fuzzer,address,undefined against a library (and its GGML libraries)
// compiled with -fsanitize=address,undefined,fuzzer-no-link: see build.py next to this file.
//
// An input is a short sequence of forwarded calls:
//
//     call := fn:u8 sel:u8 req_len:u16 res_off:u32 res_len:u32   (12 bytes, little-endian)
//             req_len bytes of request fields (without the 12-byte command header)
//             res_len bytes written into a shared resource before the call (when sel names one)
//
//   fn      the function index, modulo 27 (23 is one past the table: the index check; 24, 25 and 26
//           are the extension commands 256, 257 and 258 of backend/shared/apir_backend_ext.h)
//   sel     bits 0-2: resource 1-4 to write the res bytes into (0, 5-7: none), at res_off modulo its
//           size, cut at its end; bit 6: the call comes from a second guest context (ctx 2, not 1);
//           bit 7: the reply area is 16 bytes instead of apir-host's 16 KiB - 4
//
// Handles: the library's answers that name objects (device_get_buffer_type's buffer type,
// device_buffer_from_ptr's buffer and buffer type, buffer_type_alloc_buffer's buffer,
// buffer_get_base's base) are kept in order in a table for the rest of the input. Any 8 bytes at
// a 4-byte aligned offset of a request or of resource bytes that read 0x41504952480000NN
// (little-endian) are replaced by entry NN (modulo the table's size) before the call, so an input
// can allocate a buffer and then use it, in its requests and in its graphs. seeds_from_trace.py
// writes real traces in this form.
//
// Shared resources are the harness's own mmap'd regions with an inaccessible page on either side,
// so a read or write past one faults: 1, 2 and 3 of 1 MiB (data, graphs, buffer memory), 4 of 4 KiB.
// Other ids are unknown (get_shmem_ptr answers NULL). Their sizes are offered to the library by
// shmem_size() where the library exports a way to ask (see register_shmem_size below).
//
// Tensor records are apir_rpc_tensor until an EXT_GET_FEATURES call of the input (fn 24) asks for
// APIR_FEATURE_WIDE_TENSORS (an 8-byte request with bit 1 set) and the library grants it: from then
// on that context's records are apir_rpc_tensor_wide, as a negotiated frontend sends them.
//
// At the end of an input every buffer it was given is freed with buffer_free_buffer, so the process
// does not grow, and both contexts are put back to narrow records (an EXT_GET_FEATURES without a
// request, a frontend from before the negotiation), so that an input means the same in any order;
// the library is initialized once per process. Allocation sizes asked of
// buffer_type_alloc_buffer are cut to 1 MiB: the host's memory is not what this measures.
//
// Environment: APIR_FUZZ_GGML_LIBRARY (default: libggml-cpu.so next to the backend library),
// APIR_FUZZ_GGML_REG (default ggml_backend_cpu_reg), APIR_FUZZ_VERBOSE=1 keeps the library's logs.

#include <dlfcn.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

extern "C" {
// backend/backend-virgl-apir.h, declared here so that the harness builds against any version of it
struct apir_fuzz_callbacks {
    const char * (*get_config)(uint32_t ctx_id, const char * key);
    void * (*get_shmem_ptr)(uint32_t ctx_id, uint32_t res_id);
};

uint32_t apir_backend_initialize(uint32_t ctx_id, apir_fuzz_callbacks * cbs);
uint32_t apir_backend_dispatcher(uint32_t ctx_id, apir_fuzz_callbacks * cbs, uint32_t cmd_type, char * dec_cur,
                                 const char * dec_end, char * enc_cur, const char * enc_end, char ** enc_cur_after);
}

namespace {

constexpr uint32_t N_FUNCTIONS         = 23;
constexpr uint32_t N_EXTENSIONS        = 4;  // after the index check: commands 256 to 259
constexpr uint32_t EXT_BASE            = 256;
constexpr uint32_t FN_GET_BUFFER_TYPE  = 7;
constexpr uint32_t FN_BUFFER_FROM_PTR  = 9;
constexpr uint32_t FN_ALLOC_BUFFER     = 14;
constexpr uint32_t FN_BUFFER_GET_BASE  = 16;
constexpr uint32_t FN_FREE_BUFFER      = 21;
constexpr uint32_t FN_EXT_GET_FEATURES = N_FUNCTIONS + 1;
constexpr uint32_t LOAD_LIBRARY_OK     = 6;  // APIR_LOAD_LIBRARY_INIT_BASE_INDEX + SUCCESS
constexpr size_t   CALL_HEADER         = 12;
constexpr size_t   MAX_CALLS           = 64;
constexpr size_t   REPLY_SIZE          = 16384 - 4;  // apir-host's reply resource after its notification word
constexpr size_t   SMALL_REPLY_SIZE    = 16;
constexpr size_t   MAX_ALLOC           = 1 << 20;
constexpr uint64_t PLACEHOLDER         = 0x4150495248000000ull;
constexpr uint64_t PLACEHOLDER_MASK    = ~0xffull;
constexpr uint32_t CTX_MAIN            = 1;
constexpr uint32_t CTX_OTHER           = 2;

struct resource {
    uint32_t  id;
    size_t    size;
    uint8_t * ptr;
    bool      dirty;
};

resource resources[] = {
    { 1, 1 << 20, nullptr, false },
    { 2, 1 << 20, nullptr, false },
    { 3, 1 << 20, nullptr, false },
    { 4, 4 << 10, nullptr, false },
};

struct handle {
    uint64_t value;
    uint32_t ctx_id;
    bool     is_buffer;  // to be freed at the end of the input
};

std::vector<handle> handles;
std::string         ggml_library;
std::string         ggml_reg = "ggml_backend_cpu_reg";
bool                verbose  = false;

resource * find_resource(uint32_t res_id) {
    for (auto & r : resources) {
        if (r.id == res_id) {
            return &r;
        }
    }
    return nullptr;
}

const char * get_config(uint32_t ctx_id, const char * key) {
    (void) ctx_id;
    if (strcmp(key, "ggml.library.path") == 0) {
        return ggml_library.c_str();
    }
    if (strcmp(key, "ggml.library.reg") == 0) {
        return ggml_reg.c_str();
    }
    return nullptr;
}

void * get_shmem_ptr(uint32_t ctx_id, uint32_t res_id) {
    (void) ctx_id;
    resource * r = find_resource(res_id);
    if (!r) {
        return nullptr;
    }
    r->dirty = true;  // the library may write into it, now or through a buffer that wraps it
    return r->ptr;
}

// The size of a resource, 0 for an unknown one.
uint64_t shmem_size(uint32_t ctx_id, uint32_t res_id) {
    (void) ctx_id;
    resource * r = find_resource(res_id);
    return r ? r->size : 0;
}

apir_fuzz_callbacks callbacks = { get_config, get_shmem_ptr };

// The optional way for the host to tell the library a resource's size (llama_patches 0009:
// apir_backend_set_shmem_size_callback, registered before apir_backend_initialize); a library
// without it is fuzzed without sizes.
void register_shmem_size() {
    typedef void (*set_size_fn)(uint64_t (*)(uint32_t, uint32_t));
    auto set = (set_size_fn) dlsym(RTLD_DEFAULT, "apir_backend_set_shmem_size_callback");
    if (set) {
        set(shmem_size);
    }
    fprintf(stderr, "apir-fuzz: resource sizes %s\n", set ? "registered" : "not offered (the library has no way to take them)");
}

uint8_t * map_resource(size_t size) {
    const size_t page = (size_t) sysconf(_SC_PAGESIZE);
    auto *       base = (uint8_t *) mmap(nullptr, size + 2 * page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED || mprotect(base + page, size, PROT_READ | PROT_WRITE) != 0) {
        perror("apir-fuzz: mmap");
        abort();
    }
    return base + page;
}

void silent_log(int level, const char * text, void * user_data) {
    (void) level;
    (void) text;
    (void) user_data;
}

uint64_t load_u64(const uint8_t * p) {
    uint64_t v;
    memcpy(&v, p, sizeof(v));
    return v;
}

void store_u64(uint8_t * p, uint64_t v) {
    memcpy(p, &v, sizeof(v));
}

// Replace the placeholders at 4-byte aligned offsets of [p, p + n) (aligned relative to `origin`).
void substitute(uint8_t * p, size_t n, size_t origin) {
    if (handles.empty() || n < 8) {
        return;
    }
    for (size_t i = (4 - origin % 4) % 4; i + 8 <= n; i += 4) {
        uint64_t v = load_u64(p + i);
        if ((v & PLACEHOLDER_MASK) == PLACEHOLDER) {
            store_u64(p + i, handles[(v & 0xff) % handles.size()].value);
        }
    }
}

uint32_t dispatch(uint32_t ctx_id, uint32_t fn, std::vector<uint8_t> & request, size_t reply_size,
                  std::vector<uint8_t> & reply_out) {
    // exactly sized heap copies: AddressSanitizer sees any access past the request or the reply area
    char * req   = new char[request.size() + 1];  // + 1: a valid pointer for an empty request
    char * reply = new char[reply_size];
    if (!request.empty()) {
        memcpy(req, request.data(), request.size());
    }
    memset(reply, 0, reply_size);
    char *   after = nullptr;
    uint32_t cmd   = fn <= N_FUNCTIONS ? fn : EXT_BASE + (fn - N_FUNCTIONS - 1);
    uint32_t ret   = apir_backend_dispatcher(ctx_id, &callbacks, cmd, req, req + request.size(), reply,
                                             reply + reply_size, &after);
    if (ret == 0 && fn != N_FUNCTIONS) {
        if (after < reply || after > reply + reply_size) {
            fprintf(stderr, "apir-fuzz: function %u answered a reply cursor outside its reply area (%td of %zu)\n",
                    fn, after - reply, reply_size);
            abort();
        }
        reply_out.assign(reply, after);
    } else {
        reply_out.clear();
    }
    delete[] req;
    delete[] reply;
    return ret;
}

void keep_handle(const std::vector<uint8_t> & reply, size_t at, uint32_t ctx_id, bool is_buffer) {
    if (reply.size() >= at + 8) {
        handles.push_back({ load_u64(reply.data() + at), ctx_id, is_buffer });
    }
}

void free_buffers() {
    std::vector<uint8_t> request(8), reply;
    for (const auto & h : handles) {
        if (h.is_buffer && h.value != 0) {
            store_u64(request.data(), h.value);
            dispatch(h.ctx_id, FN_FREE_BUFFER, request, REPLY_SIZE, reply);
        }
    }
    handles.clear();
}

// narrow records again for the next input
void reset_features() {
    std::vector<uint8_t> request, reply;
    for (uint32_t ctx_id : { CTX_MAIN, CTX_OTHER }) {
        dispatch(ctx_id, FN_EXT_GET_FEATURES, request, REPLY_SIZE, reply);
    }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int * argc, char *** argv) {
    (void) argc;
    (void) argv;
    verbose = getenv("APIR_FUZZ_VERBOSE") != nullptr;
    if (!verbose) {
        typedef void (*log_set_fn)(void (*)(int, const char *, void *), void *);
        auto log_set = (log_set_fn) dlsym(RTLD_DEFAULT, "ggml_log_set");
        if (log_set) {
            log_set(silent_log, nullptr);
        }
    }
    if (const char * lib = getenv("APIR_FUZZ_GGML_LIBRARY")) {
        ggml_library = lib;
    } else {
        Dl_info info;
        if (dladdr((void *) apir_backend_initialize, &info) == 0 || !info.dli_fname) {
            fprintf(stderr, "apir-fuzz: cannot locate the backend library; set APIR_FUZZ_GGML_LIBRARY\n");
            abort();
        }
        std::string dir = info.dli_fname;
        dir             = dir.substr(0, dir.rfind('/') + 1);
        ggml_library    = dir + "libggml-cpu.so";
    }
    if (const char * reg = getenv("APIR_FUZZ_GGML_REG")) {
        ggml_reg = reg;
    }
    for (auto & r : resources) {
        r.ptr = map_resource(r.size);
    }
    register_shmem_size();
    uint32_t ret = apir_backend_initialize(CTX_MAIN, &callbacks);
    if (ret != LOAD_LIBRARY_OK) {
        fprintf(stderr, "apir-fuzz: apir_backend_initialize(%s, %s) answered %u\n", ggml_library.c_str(),
                ggml_reg.c_str(), ret);
        abort();
    }
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    for (auto & r : resources) {
        if (r.dirty) {
            memset(r.ptr, 0, r.size);
            r.dirty = false;
        }
    }
    std::vector<uint8_t> request, reply;
    size_t               at = 0;
    for (size_t n = 0; n < MAX_CALLS && size - at >= CALL_HEADER; n++) {
        const uint8_t * h       = data + at;
        uint32_t        fn      = h[0] % (N_FUNCTIONS + 1 + N_EXTENSIONS);
        uint8_t         sel     = h[1];
        size_t          req_len = (size_t) h[2] | (size_t) h[3] << 8;
        uint32_t        res_off, res_len;
        memcpy(&res_off, h + 4, 4);
        memcpy(&res_len, h + 8, 4);
        at += CALL_HEADER;

        req_len = req_len < size - at ? req_len : size - at;
        request.assign(data + at, data + at + req_len);
        at += req_len;
        substitute(request.data(), request.size(), 0);

        size_t     res_n = res_len < size - at ? res_len : size - at;
        resource * r     = (sel & 7) >= 1 && (sel & 7) <= 4 ? &resources[(sel & 7) - 1] : nullptr;
        if (r) {
            size_t off = res_off % r->size;
            size_t n_in = res_n < r->size - off ? res_n : r->size - off;
            memcpy(r->ptr + off, data + at, n_in);
            substitute(r->ptr + off, n_in, off);
            r->dirty = true;
        }
        at += res_n;

        if (fn == FN_ALLOC_BUFFER && request.size() >= 16) {
            uint64_t asked = load_u64(request.data() + 8);
            store_u64(request.data() + 8, asked % (MAX_ALLOC + 1));
        }

        uint32_t ctx_id = (sel & 0x40) ? CTX_OTHER : CTX_MAIN;
        uint32_t ret    = dispatch(ctx_id, fn, request, (sel & 0x80) ? SMALL_REPLY_SIZE : REPLY_SIZE, reply);
        if (ret != 0) {
            continue;
        }
        switch (fn) {
            case FN_GET_BUFFER_TYPE:
                keep_handle(reply, 0, ctx_id, false);
                break;
            case FN_BUFFER_FROM_PTR:
                keep_handle(reply, 0, ctx_id, true);
                keep_handle(reply, 8, ctx_id, false);
                break;
            case FN_ALLOC_BUFFER:
                keep_handle(reply, 0, ctx_id, true);
                break;
            case FN_BUFFER_GET_BASE:
                keep_handle(reply, 0, ctx_id, false);
                break;
            default:
                break;
        }
    }
    free_buffers();
    reset_features();
    return 0;
}
