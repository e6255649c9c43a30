// Conformance harness for apirctl's APIR codec: encodes and decodes with the pinned llama.cpp
// headers (apir_cs.h and friends) so the tests can compare bytes with the Python side.
//
// One command per input line, one answer line each:
//   enc <kind> <args...>   -> hex of the encoded bytes
//   dec <kind> <hex>       -> the decoded value(s), then " fatal=<0|1>"
//   graph <hex>            -> JSON of the ggml graph the backend rebuilds from a serialized graph
//   wide <0|1>             -> the graph decoder's client reads apir_rpc_tensor_wide records (as once
//                             granted APIR_FEATURE_WIDE_TENSORS); answers "ok"
//   layout | constants     -> JSON
// Buffers are zeroed before encoding, so padding bytes are deterministic.
#include "ggml-backend-impl.h"
#include "ggml-backend.h"
#include "backend-convert.h"
#include "shared/api_remoting.h"
#include "shared/apir_backend.h"
#include "shared/apir_backend_ext.h"
#include "shared/apir_cs.h"
#include "shared/apir_cs_rpc.h"
#include "shared/apir_cs_ggml.h"
#include "backend-objects.h"

#include "ggml-alloc.h"
#include "ggml-cpu.h"

#include <cinttypes>
#include <cstddef>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

static std::vector<char> unhex(const std::string & s) {
    std::vector<char> out;
    for (size_t i = 0; i + 1 < s.size(); i += 2) {
        out.push_back((char) std::stoi(s.substr(i, 2), nullptr, 16));
    }
    return out;
}

static std::string hex(const char * p, size_t n) {
    static const char * d = "0123456789abcdef";
    std::string out;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char) p[i];
        out += d[c >> 4];
        out += d[c & 15];
    }
    return out;
}

static void json_str(std::ostream & o, const char * s) {
    o << '"' << hex(s, strlen(s)) << '"';
}

static int enc_cmd(std::istringstream & in, const std::string & kind) {
    std::vector<char> buf(1 << 20, 0);
    apir_encoder enc = apir_new_encoder(buf.data(), buf.size());
    if (kind == "u8") { unsigned v; in >> v; uint8_t x = v; apir_encode_uint8_t(&enc, &x); }
    else if (kind == "bool") { int v; in >> v; bool x = v; apir_encode_bool_t(&enc, &x); }
    else if (kind == "u32") { uint32_t v; in >> v; apir_encode_uint32_t(&enc, &v); }
    else if (kind == "i32") { int32_t v; in >> v; apir_encode_int32_t(&enc, &v); }
    else if (kind == "u64") { uint64_t v; in >> v; apir_encode_uint64_t(&enc, &v); }
    else if (kind == "size") { uint64_t v; in >> v; size_t x = v; apir_encode_size_t(&enc, &x); }
    else if (kind == "uintptr") { uint64_t v; in >> v; uintptr_t x = v; apir_encode_uintptr_t(&enc, &x); }
    else if (kind == "buft_handle") { uint64_t v; in >> v; apir_encode_apir_buffer_type_host_handle(&enc, v); }
    else if (kind == "inline_buf_handle") { uint64_t v; in >> v; apir_buffer_host_handle_t x = v; apir_encode_ggml_buffer_handle(&enc, &x); }
    else if (kind == "buf_handle") { uint64_t v; in >> v; apir_buffer_host_handle_t x = v; apir_encode_apir_buffer_host_handle_t(&enc, &x); }
    else if (kind == "array_size") { uint64_t v; in >> v; apir_encode_array_size(&enc, v); }
    else if (kind == "res_id") { uint32_t v; in >> v; apir_encode_virtgpu_shmem_res_id(&enc, v); }
    else if (kind == "status") { int v; in >> v; ggml_status s = (ggml_status) v; apir_encode_ggml_status(&enc, &s); }
    else if (kind == "blob") { std::string h; in >> h; auto d = unhex(h == "-" ? "" : h); apir_encode_blob_array(&enc, d.data(), d.size()); }
    else if (kind == "string") {
        std::string h; in >> h; auto d = unhex(h == "-" ? "" : h); d.push_back(0);
        apir_encode_array_size(&enc, d.size());
        apir_encode_char_array(&enc, d.data(), d.size());
    }
    else if (kind == "u32_array" || kind == "i32_array" || kind == "u64_array") {
        uint32_t n; in >> n;
        std::vector<uint64_t> v(n); for (auto & x : v) in >> x;
        if (kind == "u64_array") { apir_encode_uint64_t_array(&enc, v.data(), n); }
        else if (kind == "u32_array") { std::vector<uint32_t> w(v.begin(), v.end()); apir_encode_uint32_t_array(&enc, w.data(), n); }
        else { std::vector<int32_t> w; for (auto x : v) w.push_back((int32_t) (int64_t) x); apir_encode_int32_t_array(&enc, w.data(), n); }
    }
    else if (kind == "rpc_tensor" || kind == "rpc_tensor_wide") {
        // parsed into the wide form, and written as the frontend writes it for either width
        apir_rpc_tensor_wide t; memset(&t, 0, sizeof t);
        in >> t.id >> t.type >> t.buffer;
        for (auto & x : t.ne) in >> x;
        for (auto & x : t.nb) in >> x;
        in >> t.op;
        for (auto & x : t.op_params) in >> x;
        in >> t.flags;
        for (auto & x : t.src) in >> x;
        in >> t.view_src >> t.view_offs >> t.data;
        std::string h; in >> h; auto name = unhex(h == "-" ? "" : h);
        memcpy(t.name, name.data(), std::min(name.size(), sizeof t.name - 1));
        apir_encode_rcp_tensor(&enc, &t, kind == "rpc_tensor_wide");
    }
    else { return 1; }
    std::cout << hex(enc.start, enc.cur - enc.start) << "\n";
    return 0;
}

static int dec_cmd(std::istringstream & in, const std::string & kind) {
    std::string h; in >> h;
    auto data = unhex(h == "-" ? "" : h);
    apir_decoder dec = apir_new_decoder(data.data(), data.size());
    std::ostringstream o;
    if (kind == "u8") { uint8_t v; apir_decode_uint8_t(&dec, &v); o << (unsigned) v; }
    else if (kind == "bool") { bool v; apir_decode_bool_t(&dec, &v); o << (int) v; }
    else if (kind == "u32") { uint32_t v; apir_decode_uint32_t(&dec, &v); o << v; }
    else if (kind == "i32") { int32_t v; apir_decode_int32_t(&dec, &v); o << v; }
    else if (kind == "u64") { uint64_t v; apir_decode_uint64_t(&dec, &v); o << v; }
    else if (kind == "size") { size_t v; apir_decode_size_t(&dec, &v); o << (uint64_t) v; }
    else if (kind == "string") {
        uint64_t n = apir_decode_array_size_unchecked(&dec);
        if (n > data.size()) { o << "-"; apir_decoder_set_fatal(&dec); }
        else {
            std::vector<char> s(n ? n : 1, 0);
            apir_decode_char_array(&dec, s.data(), n);
            o << (s[0] ? hex(s.data(), strlen(s.data())) : "-");
        }
    }
    else if (kind == "u64_array") {
        uint32_t n; apir_decode_uint32_t(&dec, &n);
        const uint64_t * v = apir_decode_uint64_t_array_inplace(&dec, n);
        o << n;
        if (v) for (uint32_t i = 0; i < n; i++) o << " " << v[i];
    }
    else if (kind == "rpc_tensor" || kind == "rpc_tensor_wide") {
        // as the host reads it: widened
        apir_rpc_tensor_wide wide;
        apir_decode_rcp_tensor(&dec, &wide, kind == "rpc_tensor_wide");
        const apir_rpc_tensor_wide * t = apir_decoder_get_fatal(&dec) ? nullptr : &wide;
        if (!t) { o << "null"; }
        else {
            o << t->id << " " << t->type << " " << t->buffer;
            for (auto x : t->ne) o << " " << x;
            for (auto x : t->nb) o << " " << x;
            o << " " << t->op;
            for (auto x : t->op_params) o << " " << x;
            o << " " << t->flags;
            for (auto x : t->src) o << " " << x;
            o << " " << t->view_src << " " << t->view_offs << " " << t->data << " ";
            std::string name(t->name, strnlen(t->name, sizeof t->name));
            o << (name.empty() ? "-" : hex(name.data(), name.size()));
        }
    }
    else { return 1; }
    std::cout << o.str() << " fatal=" << (int) apir_decoder_get_fatal(&dec) << "\n";
    return 0;
}

// The backend library's graph decoder, with one 1 MiB CPU buffer in its client table: `buffer` answers
// that buffer's id, for the tensors of the graphs sent.
static apir_client_objects & harness_client(uint64_t * buffer_id = nullptr) {
    static apir_client_objects client;
    static uint64_t            id = 0;
    if (id == 0) {
        id = apir_buffer_track(client, ggml_backend_buft_alloc_buffer(ggml_backend_cpu_buffer_type(), 1 << 20));
    }
    if (buffer_id) {
        *buffer_id = id;
    }
    return client;
}

static void graph_cmd(std::istringstream & in) {
    std::string h; in >> h;
    auto data = unhex(h);
    apir_graph decoded;
    const bool ok = apir_graph_from_wire(harness_client(), (const uint8_t *) data.data(), data.size(), &decoded);
    ggml_cgraph * g = ok ? decoded.graph : nullptr;
    std::ostringstream o;
    o << "{\"fatal\":" << (int) !ok << ",\"nodes\":[";
    for (int i = 0; g && i < ggml_graph_n_nodes(g); i++) {
        ggml_tensor * t = ggml_graph_node(g, i);
        if (i) o << ",";
        o << "{\"op\":" << (int) t->op << ",\"type\":" << (int) t->type << ",\"flags\":" << t->flags << ",\"ne\":[";
        for (int d = 0; d < GGML_MAX_DIMS; d++) o << (d ? "," : "") << t->ne[d];
        o << "],\"nb\":[";
        for (int d = 0; d < GGML_MAX_DIMS; d++) o << (d ? "," : "") << t->nb[d];
        o << "],\"data\":" << (uint64_t) (uintptr_t) t->data << ",\"op_params\":[";
        for (int d = 0; d < (int) (GGML_MAX_OP_PARAMS / sizeof(int32_t)); d++) o << (d ? "," : "") << t->op_params[d];
        o << "],\"name\":";
        json_str(o, t->name);
        o << ",\"src\":[";
        for (int s = 0; s < GGML_MAX_SRC && t->src[s]; s++) {
            if (s) o << ",";
            o << "{\"name\":";
            json_str(o, t->src[s]->name);
            o << ",\"op\":" << (int) t->src[s]->op << "}";
        }
        o << "],\"view_src\":";
        if (t->view_src) json_str(o, t->view_src->name); else o << "null";
        o << ",\"view_offs\":" << (uint64_t) t->view_offs << "}";
    }
    o << "]}";
    std::cout << o.str() << "\n";
}

// The frontend serializer (compiled from upstream's apir_cs_ggml-rpc-front.cpp with shim/ggml-remoting.h)
// asks this for a buffer's host handle and base.
struct harness_buffer_context {
    void *   base;
    uint64_t host_handle;
};

harness_buffer_context * harness_context_of(ggml_backend_buffer_t buffer) {
    static harness_buffer_context ctx;
    ctx.base        = ggml_backend_buffer_get_base(buffer);
    ctx.host_handle = 0xABCDEF000ULL;
    return &ctx;
}

// frontgraph K M N [wide]: out = mul_mat(A[K,M], B[K,N]) + C[M,N], allocated in a CPU buffer in
// creation order, serialized by the frontend's code (wide: apir_rpc_tensor_wide records).
static void frontgraph_cmd(std::istringstream & in) {
    int64_t k, m, n;
    int     wide = 0;
    in >> k >> m >> n;
    if (!(in >> wide)) {
        wide = 0;
    }
    ggml_init_params params = { ggml_tensor_overhead() * 16 + ggml_graph_overhead(), NULL, true };
    ggml_context * ctx = ggml_init(params);
    ggml_tensor * a = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, m);
    ggml_tensor * b = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, n);
    ggml_tensor * c = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, m, n);
    ggml_tensor * mm = ggml_mul_mat(ctx, a, b);
    ggml_tensor * out = ggml_add(ctx, mm, c);
    ggml_set_name(a, "A");
    ggml_set_name(b, "B");
    ggml_set_name(c, "C");
    ggml_set_name(mm, "A*B");
    ggml_set_name(out, "A*B+C");
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, ggml_backend_cpu_buffer_type());
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    std::vector<uint8_t> bytes;
    apir_serialize_graph(gf, wide != 0, bytes);
    std::cout << hex((const char *) bytes.data(), bytes.size()) << "\n";
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
}

#define OFF(T, f) "\"" #f "\":[" << offsetof(T, f) << "," << sizeof(((T *) 0)->f) << "]"

int main() {
    std::string line;
    while (std::getline(std::cin, line)) {
        std::istringstream in(line);
        std::string cmd, kind;
        in >> cmd;
        if (cmd == "enc") { in >> kind; if (enc_cmd(in, kind)) std::cout << "unknown\n"; }
        else if (cmd == "dec") { in >> kind; if (dec_cmd(in, kind)) std::cout << "unknown\n"; }
        else if (cmd == "graph") { graph_cmd(in); }
        else if (cmd == "buffer") { uint64_t id; harness_client(&id); std::cout << id << "\n"; }
        else if (cmd == "wide") { int w = 0; in >> w; harness_client().wide_tensors = w != 0; std::cout << "ok\n"; }
        else if (cmd == "frontgraph") { frontgraph_cmd(in); }
        else if (cmd == "layout") {
            std::cout << "{\"apir_rpc_tensor\":{\"size\":" << sizeof(apir_rpc_tensor) << ","
                      << OFF(apir_rpc_tensor, id) << "," << OFF(apir_rpc_tensor, type) << ","
                      << OFF(apir_rpc_tensor, buffer) << "," << OFF(apir_rpc_tensor, ne) << ","
                      << OFF(apir_rpc_tensor, nb) << "," << OFF(apir_rpc_tensor, op) << ","
                      << OFF(apir_rpc_tensor, op_params) << "," << OFF(apir_rpc_tensor, flags) << ","
                      << OFF(apir_rpc_tensor, src) << "," << OFF(apir_rpc_tensor, view_src) << ","
                      << OFF(apir_rpc_tensor, view_offs) << "," << OFF(apir_rpc_tensor, data) << ","
                      << OFF(apir_rpc_tensor, name) << "," << OFF(apir_rpc_tensor, padding) << "},"
                      << "\"apir_rpc_tensor_wide\":{\"size\":" << sizeof(apir_rpc_tensor_wide) << ","
                      << OFF(apir_rpc_tensor_wide, id) << "," << OFF(apir_rpc_tensor_wide, type) << ","
                      << OFF(apir_rpc_tensor_wide, reserved) << ","
                      << OFF(apir_rpc_tensor_wide, buffer) << "," << OFF(apir_rpc_tensor_wide, ne) << ","
                      << OFF(apir_rpc_tensor_wide, nb) << "," << OFF(apir_rpc_tensor_wide, op) << ","
                      << OFF(apir_rpc_tensor_wide, op_params) << "," << OFF(apir_rpc_tensor_wide, flags) << ","
                      << OFF(apir_rpc_tensor_wide, src) << "," << OFF(apir_rpc_tensor_wide, view_src) << ","
                      << OFF(apir_rpc_tensor_wide, view_offs) << "," << OFF(apir_rpc_tensor_wide, data) << ","
                      << OFF(apir_rpc_tensor_wide, name) << "},"
                      << "\"apir_graph_run_write\":{\"size\":" << sizeof(apir_graph_run_write) << "},"
                      << "\"apir_graph_run_write_wide\":{\"size\":" << sizeof(apir_graph_run_write_wide) << "},"
                      << "\"ggml_tensor\":{\"size\":" << sizeof(ggml_tensor) << ","
                      << OFF(ggml_tensor, type) << "," << OFF(ggml_tensor, buffer) << ","
                      << OFF(ggml_tensor, ne) << "," << OFF(ggml_tensor, nb) << "," << OFF(ggml_tensor, op) << ","
                      << OFF(ggml_tensor, op_params) << "," << OFF(ggml_tensor, flags) << ","
                      << OFF(ggml_tensor, src) << "," << OFF(ggml_tensor, view_src) << ","
                      << OFF(ggml_tensor, view_offs) << "," << OFF(ggml_tensor, data) << ","
                      << OFF(ggml_tensor, name) << "," << OFF(ggml_tensor, extra) << ","
                      << OFF(ggml_tensor, padding) << "}}\n";
        }
        else if (cmd == "constants") {
            std::cout << "{\"PROTOCOL_MAJOR\":" << APIR_PROTOCOL_MAJOR << ",\"PROTOCOL_MINOR\":" << APIR_PROTOCOL_MINOR
                      << ",\"HANDSHAKE_MAGIC\":" << APIR_HANDSHAKE_MAGIC
                      << ",\"HANDSHAKE\":" << APIR_COMMAND_TYPE_HANDSHAKE << ",\"LOADLIBRARY\":" << APIR_COMMAND_TYPE_LOADLIBRARY
                      << ",\"FORWARD\":" << APIR_COMMAND_TYPE_FORWARD
                      << ",\"LOAD_SUCCESS\":" << APIR_LOAD_LIBRARY_SUCCESS
                      << ",\"LOAD_HYPERCALL_INITIALIZATION_ERROR\":" << APIR_LOAD_LIBRARY_HYPERCALL_INITIALIZATION_ERROR
                      << ",\"LOAD_ALREADY_LOADED\":" << APIR_LOAD_LIBRARY_ALREADY_LOADED
                      << ",\"LOAD_ENV_VAR_MISSING\":" << APIR_LOAD_LIBRARY_ENV_VAR_MISSING
                      << ",\"LOAD_CANNOT_OPEN\":" << APIR_LOAD_LIBRARY_CANNOT_OPEN
                      << ",\"LOAD_SYMBOL_MISSING\":" << APIR_LOAD_LIBRARY_SYMBOL_MISSING
                      << ",\"LOAD_INIT_BASE_INDEX\":" << APIR_LOAD_LIBRARY_INIT_BASE_INDEX
                      << ",\"FORWARD_SUCCESS\":" << APIR_FORWARD_SUCCESS
                      << ",\"FORWARD_NO_DISPATCH_FCT\":" << APIR_FORWARD_NO_DISPATCH_FCT
                      << ",\"FORWARD_TIMEOUT\":" << APIR_FORWARD_TIMEOUT
                      << ",\"FORWARD_FAILED_TO_SYNC_STREAMS\":" << APIR_FORWARD_FAILED_TO_SYNC_STREAMS
                      << ",\"FORWARD_BASE_INDEX\":" << APIR_FORWARD_BASE_INDEX
                      << ",\"INIT_SUCCESS\":" << APIR_BACKEND_INITIALIZE_SUCCESS
                      << ",\"INIT_CANNOT_OPEN_BACKEND_LIBRARY\":" << APIR_BACKEND_INITIALIZE_CANNOT_OPEN_BACKEND_LIBRARY
                      << ",\"INIT_CANNOT_OPEN_GGML_LIBRARY\":" << APIR_BACKEND_INITIALIZE_CANNOT_OPEN_GGML_LIBRARY
                      << ",\"INIT_MISSING_BACKEND_SYMBOLS\":" << APIR_BACKEND_INITIALIZE_MISSING_BACKEND_SYMBOLS
                      << ",\"INIT_MISSING_GGML_SYMBOLS\":" << APIR_BACKEND_INITIALIZE_MISSING_GGML_SYMBOLS
                      << ",\"INIT_BACKEND_FAILED\":" << APIR_BACKEND_INITIALIZE_BACKEND_FAILED
                      << ",\"INIT_BACKEND_REG_FAILED\":" << APIR_BACKEND_INITIALIZE_BACKEND_REG_FAILED
                      << ",\"INIT_ALREADY_INITED\":" << APIR_BACKEND_INITIALIZE_ALREADY_INITED
                      << ",\"INIT_NO_DEVICE\":" << APIR_BACKEND_INITIALIZE_NO_DEVICE
                      << ",\"INIT_BACKEND_INIT_FAILED\":" << APIR_BACKEND_INITIALIZE_BACKEND_INIT_FAILED
                      << ",\"FORWARD_INDEX_INVALID\":" << APIR_BACKEND_FORWARD_INDEX_INVALID
                      << ",\"DISPATCH_TABLE_COUNT\":" << APIR_BACKEND_DISPATCH_TABLE_COUNT
                      << ",\"TYPE_F32\":" << GGML_TYPE_F32 << ",\"OP_NONE\":" << GGML_OP_NONE
                      << ",\"OP_ADD\":" << GGML_OP_ADD << ",\"OP_MUL\":" << GGML_OP_MUL << ",\"OP_MUL_MAT\":" << GGML_OP_MUL_MAT
                      << ",\"FLAG_INPUT\":" << GGML_TENSOR_FLAG_INPUT << ",\"FLAG_OUTPUT\":" << GGML_TENSOR_FLAG_OUTPUT
                      << ",\"FLAG_COMPUTE\":" << GGML_TENSOR_FLAG_COMPUTE
                      << ",\"MAX_DIMS\":" << GGML_MAX_DIMS << ",\"MAX_SRC\":" << GGML_MAX_SRC
                      << ",\"MAX_OP_PARAMS\":" << GGML_MAX_OP_PARAMS << ",\"MAX_NAME\":" << GGML_MAX_NAME
                      << ",\"STATUS_SUCCESS\":" << GGML_STATUS_SUCCESS << ",\"STATUS_ABORTED\":" << GGML_STATUS_ABORTED
                      << ",\"STATUS_FAILED\":" << GGML_STATUS_FAILED << ",\"STATUS_ALLOC_FAILED\":" << GGML_STATUS_ALLOC_FAILED
                      << "}\n";
        }
        else { std::cout << "unknown\n"; }
        std::cout.flush();
    }
    return 0;
}
