// A graph generator shared by the graph fuzzers of both hosts (apir_graph_fuzz.cpp: the APIR backend
// library; rpc_graph_fuzz.cpp: ggml-rpc's server). An input is a small program, read a byte at a
// time (0 once it is used up), that builds a graph the way ggml's op constructors do -- the shapes,
// types and op parameters the frontend sends -- and then, for some nodes, changes one field of one
// tensor: a dimension, a stride, a type, an op parameter. The host's checks must refuse what the
// kernels cannot compute; what they accept is computed on the CPU backend.
//
//     input := n_nodes:u8 data_seed:u32 node*
//     node  := op:u8 fields...  mutate:u8 [kind:u8 which:u8 value:u32]   (kind etc. when mutate % 8 == 7)
//
// Fields are read as the op needs them (types, dimensions, parameters); a dimension byte d is
// 1 + d % 48 below 0xef, the next two bytes (little-endian) after 0xef, and 0, 3, 4096, 2^16, 2^20, 2^24, 2^30 and 2^31 - 1 above. seeds.py writes
// programs in this form (the committed corpus: hand-made per op, and the nodes of a real trace).
//
// Every tensor that is not a view gets a buffer of its own of exactly its bytes, so a kernel that
// reads or writes past a tensor leaves its buffer (AddressSanitizer sees it). Leaves are
// filled with bounded values (indices mostly in range) from data_seed: findings are about shapes,
// not about NaN.

#pragma once

#include "ggml.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace gfuzz {

// A harness's counts, in a file when GFUZZ_COUNTS names a folder: DIR/<harness>-<pid>.counts, mapped
// shared, so they outlive the process. A run that ends in a finding exits from libFuzzer's crash
// handler, which runs no atexit handler, and a killed worker runs none either; the campaign scripts
// read every process's file (one per worker, one per fork-mode child) and sum them.
struct counts {
    uint64_t inputs;    // inputs that built a graph
    uint64_t computed;  // graphs the host computed
    uint64_t refused;   // graphs the host refused
    uint64_t deltas_computed;  // graphs the host computed after updating a kept one by a delta (APIR)
    uint64_t deltas_refused;   // deltas the host refused
    uint64_t clears_computed;  // kept graphs the host computed by id after a BUFFER_CLEAR (APIR)
    uint64_t clears_refused;   // runs by id after a BUFFER_CLEAR the host refused (indices out of range)
};

inline counts * map_counts(const char * harness) {
    static counts local;
    const char *  dir = getenv("GFUZZ_COUNTS");
    if (!dir || !*dir) {
        return &local;
    }
    const std::string path = std::string(dir) + "/" + harness + "-" + std::to_string(getpid()) + ".counts";
    const int         fd   = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0 || ftruncate(fd, sizeof(counts)) != 0) {
        fprintf(stderr, "%s: cannot write its counts to %s\n", harness, path.c_str());
        abort();
    }
    void * p = mmap(nullptr, sizeof(counts), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        fprintf(stderr, "%s: cannot map %s\n", harness, path.c_str());
        abort();
    }
    return (counts *) p;
}

struct reader {
    const uint8_t * p;
    size_t          n;
    size_t          at = 0;

    uint8_t u8() { return at < n ? p[at++] : 0; }

    uint32_t u32() {
        uint32_t v = 0;
        for (int i = 0; i < 4; i++) {
            v |= (uint32_t) u8() << (8 * i);
        }
        return v;
    }

    int64_t dim() {
        const uint8_t d = u8();
        if (d == 0xef) {
            return (int64_t) u8() | (int64_t) u8() << 8;  // an exact size, as a trace's tensors have
        }
        if (d < 0xf0) {
            return 1 + d % 48;
        }
        static const int64_t special[16] = { 0,       3,        4096,       1 << 16, 1 << 20, 1 << 24, 1 << 30,
                                             INT32_MAX, 2,      5,          7,       64,      128,     256,
                                             512,     1024 };
        return special[d - 0xf0];
    }

    bool chance(int one_in) { return u8() % one_in == 0; }
};

struct tensor {
    ggml_type type;
    int64_t   ne[4];
    size_t    nb[4];
    ggml_op   op       = GGML_OP_NONE;
    int32_t   params[GGML_MAX_OP_PARAMS / 4] = {};
    int       src[GGML_MAX_SRC];
    int       view_src  = -1;
    size_t    view_offs = 0;
    int       buffer    = -1;  // which of the graph's buffers holds it
    size_t    offset    = 0;   // in that buffer
    bool      node      = false;
    int64_t   index_limit = 0;  // a leaf of indices: the values to put in it are below this
};

// The buffers' contents live in one area per process, reused from input to input (generate() clears
// what a graph uses): a graph of 64 MiB then costs no fresh pages, and a graph is copied (the APIR
// harness's deltas keep two) without its bytes. One graph's contents at a time.
inline std::vector<uint8_t> & contents_area() {
    static std::vector<uint8_t> area;
    return area;
}

struct graph {
    std::vector<tensor>  t;
    std::vector<int>     nodes;
    std::vector<size_t>  sizes;  // of the buffers
    std::vector<size_t>  at;     // where each buffer's contents (after the leaves are set) start in the area
    size_t               total = 0;

    uint8_t * data(size_t b) const { return contents_area().data() + at[b]; }
};

constexpr size_t ALIGN          = 32;
constexpr size_t MAX_BUFFER     = 64u << 20;
constexpr size_t MAX_NODES      = 6;

static const ggml_type FLOAT_TYPES[] = { GGML_TYPE_F32, GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16 };
static const ggml_type ANY_TYPES[]   = {
    GGML_TYPE_F32,  GGML_TYPE_F16,  GGML_TYPE_BF16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0, GGML_TYPE_Q4_1,
    GGML_TYPE_Q5_0, GGML_TYPE_Q5_1, GGML_TYPE_Q4_K, GGML_TYPE_Q6_K, GGML_TYPE_Q2_K, GGML_TYPE_IQ4_NL,
    GGML_TYPE_I32,  GGML_TYPE_I16,  GGML_TYPE_I8,   GGML_TYPE_F64,  GGML_TYPE_I64,  GGML_TYPE_Q8_0,
};

// One I8 tensor over the whole of a buffer of `size` bytes: how a harness writes a buffer's bytes
// with a single set-tensor call.
inline graph whole_buffer(size_t size) {
    tensor whole;
    whole.type  = GGML_TYPE_I8;
    whole.ne[0] = (int64_t) size;
    whole.ne[1] = whole.ne[2] = whole.ne[3] = 1;
    whole.nb[0] = 1;
    whole.nb[1] = whole.nb[2] = whole.nb[3] = size;
    whole.buffer = 0;
    for (int & src : whole.src) {
        src = -1;
    }
    graph one;
    one.t.push_back(whole);
    return one;
}

inline ggml_type float_type(reader & r) { return FLOAT_TYPES[r.u8() % 4]; }
inline ggml_type any_type(reader & r) { return ANY_TYPES[r.u8() % (sizeof(ANY_TYPES) / sizeof(ANY_TYPES[0]))]; }
inline ggml_type weight_type(reader & r) {
    // mostly the types of a model's weights, now and then any type at all
    return r.chance(4) ? any_type(r) : ANY_TYPES[r.u8() % 12];
}

struct builder {
    reader & r;
    graph &  g;
    bool     too_big = false;

    // a dimension rounded up to a whole number of blocks of `type`
    static int64_t blocks(ggml_type type, int64_t n) {
        const int64_t b = ggml_blck_size(type);
        return n == 0 ? 0 : (n + b - 1) / b * b;
    }

    size_t nbytes(const tensor & x) const { return nbytes_of(x); }

    static size_t nbytes_of(const tensor & x) {
        for (int i = 0; i < 4; i++) {
            if (x.ne[i] == 0) {
                return 0;
            }
        }
        size_t total = (size_t) x.ne[0] * x.nb[0] / ggml_blck_size(x.type);
        if (ggml_blck_size(x.type) == 1) {
            total = ggml_type_size(x.type);
            for (int i = 0; i < 4; i++) {
                total += (size_t) (x.ne[i] - 1) * x.nb[i];
            }
            return total;
        }
        for (int i = 1; i < 4; i++) {
            total += (size_t) (x.ne[i] - 1) * x.nb[i];
        }
        return total;
    }

    static void contiguous(tensor & x) {
        x.nb[0] = ggml_type_size(x.type);
        x.nb[1] = x.nb[0] * (x.ne[0] / ggml_blck_size(x.type));
        x.nb[2] = x.nb[1] * x.ne[1];
        x.nb[3] = x.nb[2] * x.ne[2];
    }

    static bool fits(const int64_t ne[4], ggml_type type) {
        double n = (double) ggml_type_size(type) / ggml_blck_size(type);
        for (int i = 0; i < 4; i++) {
            n *= (double) ne[i];
        }
        return n <= (double) MAX_BUFFER / 8;
    }

    int add(tensor x, bool allocate) {
        if (allocate) {
            const size_t n = nbytes(x);
            if (g.total + n > MAX_BUFFER) {
                too_big = true;
            } else {
                x.buffer = (int) g.sizes.size();
                x.offset = 0;
                g.sizes.push_back(n > 0 ? n : 1);  // a buffer of no bytes has no memory to name
                g.total += n;
            }
        }
        g.t.push_back(x);
        return (int) g.t.size() - 1;
    }

    tensor blank(ggml_type type, int64_t ne0, int64_t ne1 = 1, int64_t ne2 = 1, int64_t ne3 = 1) const {
        tensor x;
        x.type  = type;
        x.ne[0] = blocks(type, ne0);
        x.ne[1] = ne1;
        x.ne[2] = ne2;
        x.ne[3] = ne3;
        for (int & s : x.src) {
            s = -1;
        }
        contiguous(x);
        return x;
    }

    // a leaf (an input the client set), shrunk when its elements would not fit the buffer
    int leaf(ggml_type type, int64_t ne0, int64_t ne1 = 1, int64_t ne2 = 1, int64_t ne3 = 1, int64_t limit = 0) {
        int64_t ne[4] = { blocks(type, ne0), ne1, ne2, ne3 };
        for (int i = 3; i >= 0 && !fits(ne, type); i--) {
            ne[i] = i == 0 ? ggml_blck_size(type) : 1;
        }
        tensor x      = blank(type, ne[0], ne[1], ne[2], ne[3]);
        x.index_limit = limit;
        return add(x, true);
    }

    // a node: the result of `op` on `srcs`, a new contiguous tensor of `type` and shape `ne`
    int node(ggml_op op, ggml_type type, const int64_t ne[4], std::initializer_list<int> srcs) {
        int64_t n[4] = { ne[0], ne[1], ne[2], ne[3] };
        if (!fits(n, type)) {
            too_big = true;
        }
        tensor x = blank(type, n[0], n[1], n[2], n[3]);
        x.ne[0]  = n[0];  // as computed, even when not whole blocks: the check decides
        contiguous(x);
        x.op   = op;
        x.node = true;
        int i  = 0;
        for (int s : srcs) {
            x.src[i++] = s;
        }
        return add(x, !too_big);
    }

    // a view of `of` (VIEW, PERMUTE, TRANSPOSE, RESHAPE, or the result of CPY / SET_ROWS): no memory of its own
    int view(int of, ggml_op op, const int64_t ne[4], const size_t nb[4], size_t offs) {
        tensor x = g.t[of];
        x.op     = op;
        x.node   = true;
        for (int & s : x.src) {
            s = -1;
        }
        memset(x.params, 0, sizeof(x.params));
        memcpy(x.ne, ne, sizeof(x.ne));
        memcpy(x.nb, nb, sizeof(x.nb));
        x.index_limit = 0;
        const int root = g.t[of].view_src >= 0 ? g.t[of].view_src : of;
        x.view_src     = root;
        x.view_offs    = g.t[of].offset - g.t[root].offset + offs;
        x.offset       = g.t[of].offset + offs;
        if (op != GGML_OP_VIEW && op != GGML_OP_RESHAPE && op != GGML_OP_PERMUTE && op != GGML_OP_TRANSPOSE) {
            x.view_src = of;  // ggml_view_tensor of a destination
            x.view_offs = 0;
        }
        g.t.push_back(x);
        return (int) g.t.size() - 1;
    }

    int permute(int a, int p0, int p1, int p2, int p3) {
        const tensor & x     = g.t[a];
        int            ax[4] = { p0, p1, p2, p3 };
        int64_t        ne[4];
        size_t         nb[4];
        for (int i = 0; i < 4; i++) {
            ne[ax[i]] = x.ne[i];
            nb[ax[i]] = x.nb[i];
        }
        int v = view(a, GGML_OP_PERMUTE, ne, nb, 0);
        g.t[v].params[0] = p0;
        g.t[v].params[1] = p1;
        g.t[v].params[2] = p2;
        g.t[v].params[3] = p3;
        g.t[v].src[0]    = a;
        return v;
    }

    // a source of `type` and shape `ne`: a new leaf, or now and then a permuted or strided view of one
    int source(ggml_type type, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3, int64_t limit = 0) {
        const uint8_t how = r.u8();
        if (how % 8 == 1 && ggml_blck_size(type) == 1) {
            // transposed dims 0 and 1 of a leaf of the transposed shape
            int a = leaf(type, ne1, ne0, ne2, ne3, limit);
            int v = permute(a, 1, 0, 2, 3);
            g.t[v].op = GGML_OP_TRANSPOSE;
            return v;
        }
        if (how % 8 == 2) {
            // dims 1 and 2 swapped, as attention's q, k and v are
            int a = leaf(type, ne0, ne2, ne1, ne3, limit);
            return permute(a, 0, 2, 1, 3);
        }
        if (how % 8 == 3) {
            // a view with a row stride of its own: every other row, or one row read again (stride 0)
            int     a     = leaf(type, ne0, ne1 * 2, ne2, ne3, limit);
            int64_t ne[4] = { g.t[a].ne[0], ne1, g.t[a].ne[2], g.t[a].ne[3] };
            size_t  nb[4] = { g.t[a].nb[0], g.t[a].nb[1] * 2, g.t[a].nb[2], g.t[a].nb[3] };
            if (how & 0x80) {
                // a broadcast: rows (and with bit 6, matrices) read again, as many times as the guest says
                nb[1] = 0;
                ne[1] = r.dim();
                if (how & 0x40) {
                    nb[2] = 0;
                    ne[2] = r.dim();
                }
            }
            int v           = view(a, GGML_OP_VIEW, ne, nb, 0);
            g.t[v].src[0]   = a;
            return v;
        }
        return leaf(type, ne0, ne1, ne2, ne3, limit);
    }

    void set_f32(int x, int i, float v) { memcpy(&g.t[x].params[i], &v, 4); }

    // ---- the ops ---------------------------------------------------------------------------

    int mul_mat() {
        ggml_type at = weight_type(r);
        int64_t   k = r.dim(), m = r.dim(), n = r.dim(), a2 = 1 + r.u8() % 3, a3 = 1 + r.u8() % 2;
        int64_t   r2 = 1 + r.u8() % 3, r3 = 1 + r.u8() % 2;
        k            = blocks(at, k);
        // now and then what llama.cpp's rotated KV cache sends: a square F32 src0 of rows a power of two
        // long, hinted as a Hadamard matrix (ggml-cpu then transforms src1's rows instead of multiplying)
        const bool hadamard = at == GGML_TYPE_F32 && a3 == 2 && r3 == 2;
        if (hadamard) {
            while (k & (k - 1)) {
                k &= k - 1;
            }
            m = k;
        }
        int       a  = source(at, k, m, a2, a3);
        int       b  = source(r.chance(4) ? GGML_TYPE_F16 : GGML_TYPE_F32, k, n, a2 * r2, a3 * r3);
        int64_t   ne[4] = { g.t[a].ne[1], g.t[b].ne[1], g.t[b].ne[2], g.t[b].ne[3] };
        int       x  = node(GGML_OP_MUL_MAT, GGML_TYPE_F32, ne, { a, b });
        if (hadamard) {
            g.t[x].params[1] = GGML_HINT_SRC0_IS_HADAMARD;
        }
        return x;
    }

    int mul_mat_id() {
        ggml_type at = weight_type(r);
        int64_t   k = blocks(at, r.dim()), m = r.dim(), n_exp = 1 + r.u8() % 8, n_used = 1 + r.u8() % 4;
        int64_t   n_tok = 1 + r.u8() % 8;
        int64_t   b1    = r.chance(2) ? 1 : n_used;
        int       as    = leaf(at, k, m, n_exp);
        int       b     = source(GGML_TYPE_F32, k, b1, n_tok, 1);
        int       ids   = leaf(GGML_TYPE_I32, n_used, n_tok, 1, 1, g.t[as].ne[2]);
        int64_t   ne[4] = { g.t[as].ne[1], g.t[ids].ne[0], g.t[b].ne[2], 1 };
        return node(GGML_OP_MUL_MAT_ID, GGML_TYPE_F32, ne, { as, b, ids });
    }

    int binary() {
        static const ggml_op ops[] = { GGML_OP_ADD, GGML_OP_MUL, GGML_OP_SUB, GGML_OP_DIV };
        ggml_op   op = ops[r.u8() % 4];
        ggml_type t  = float_type(r);
        int64_t   ne[4] = { r.dim(), r.dim(), 1 + r.u8() % 4, 1 + r.u8() % 2 };
        int       a  = source(t, ne[0], ne[1], ne[2], ne[3]);
        const uint8_t bc = r.u8();  // which dimensions of b broadcast
        int64_t   bn[4];
        for (int i = 0; i < 4; i++) {
            bn[i] = (bc >> i) & 1 ? 1 : g.t[a].ne[i];
        }
        int b = source(r.chance(2) ? GGML_TYPE_F32 : t, bn[0], bn[1], bn[2], bn[3]);
        return node(op, t, g.t[a].ne, { a, b });
    }

    int scale() {
        ggml_type t = float_type(r);
        int       a = source(t, r.dim(), r.dim(), 1 + r.u8() % 3, 1);
        int       x = node(GGML_OP_SCALE, t, g.t[a].ne, { a });
        set_f32(x, 0, 0.5f + (r.u8() % 8));
        set_f32(x, 1, (float) (r.u8() % 3));
        return x;
    }

    int norm() {
        ggml_op   op = r.chance(2) ? GGML_OP_RMS_NORM : GGML_OP_NORM;
        ggml_type t  = r.chance(4) ? float_type(r) : GGML_TYPE_F32;
        int       a  = source(t, r.dim(), r.dim(), 1 + r.u8() % 3, 1);
        int       x  = node(op, t, g.t[a].ne, { a });
        set_f32(x, 0, 1e-5f);
        return x;
    }

    int soft_max() {
        ggml_type t  = r.chance(4) ? float_type(r) : GGML_TYPE_F32;
        int64_t   n0 = r.dim(), n1 = r.dim(), n2 = 1 + r.u8() % 4, n3 = 1 + r.u8() % 2;
        int       a  = leaf(t, n0, n1, n2, n3);
        int       mask = -1, sinks = -1;
        const uint8_t what = r.u8();
        if (what & 1) {
            mask = leaf((what & 2) ? GGML_TYPE_F16 : GGML_TYPE_F32, g.t[a].ne[0], g.t[a].ne[1] + r.u8() % 3,
                        (what & 4) ? g.t[a].ne[2] : 1, 1);
        }
        if (what & 8) {
            sinks = leaf(GGML_TYPE_F32, g.t[a].ne[2]);
        }
        int x = node(GGML_OP_SOFT_MAX, t, g.t[a].ne, { a, mask, sinks });
        set_f32(x, 0, 0.125f);
        set_f32(x, 1, (what & 16) ? 8.0f : 0.0f);  // max_bias: ALiBi slopes per head
        return x;
    }

    int rope() {
        ggml_type t      = r.chance(3) ? GGML_TYPE_F16 : GGML_TYPE_F32;
        const uint8_t e  = r.u8();  // the head's size: even, but odd at the top of the byte's range
        int64_t   ne0    = 2 * (1 + e % 32) + (e >= 0xf8 ? 1 : 0), heads = 1 + r.u8() % 4, tokens = 1 + r.u8() % 6;
        int       a      = source(t, ne0, heads, tokens, 1);
        int       pos    = leaf(GGML_TYPE_I32, g.t[a].ne[2], 1, 1, 1, 4096);
        int       ff     = -1;
        const uint8_t what = r.u8();
        int n_dims = (int) (what & 1 ? g.t[a].ne[0] : 2 * (1 + r.u8() % (g.t[a].ne[0] / 2 > 0 ? g.t[a].ne[0] / 2 : 1)));
        if (what & 2) {
            ff = leaf(GGML_TYPE_F32, n_dims / 2);
        }
        // a quarter of the time a multimodal rotation: four positions a token, the row's pairs split into
        // sections (vision: over half the row, split by the first two)
        static const int multimodal[4] = { GGML_ROPE_TYPE_MROPE, GGML_ROPE_TYPE_IMROPE, GGML_ROPE_TYPE_VISION,
                                           GGML_ROPE_TYPE_MROPE };
        const int mode = (what & 0x30) == 0x30 ? multimodal[what >> 6] :
                                                 (what & 4) ? GGML_ROPE_TYPE_NEOX : GGML_ROPE_TYPE_NORMAL;
        if (mode == GGML_ROPE_TYPE_VISION) {
            n_dims = (int) (g.t[a].ne[0] / 2);
        }
        if ((what & 0x30) == 0x30) {
            pos = leaf(GGML_TYPE_I32, 4 * g.t[a].ne[2], 1, 1, 1, 4096);
        }
        int x = node(GGML_OP_ROPE, t, g.t[a].ne, { a, pos, ff });
        g.t[x].params[1] = n_dims;
        g.t[x].params[2] = mode;
        if ((what & 0x30) == 0x30) {
            const int pairs = (mode == GGML_ROPE_TYPE_VISION ? n_dims : n_dims / 2);
            g.t[x].params[11] = pairs / 2;
            g.t[x].params[12] = mode == GGML_ROPE_TYPE_VISION ? pairs - pairs / 2 : pairs / 4;
            g.t[x].params[13] = mode == GGML_ROPE_TYPE_VISION ? 0 : pairs - pairs / 2 - pairs / 4;
        }
        g.t[x].params[4] = 4096;
        set_f32(x, 5, 10000.0f);
        set_f32(x, 6, 1.0f);
        set_f32(x, 7, (what & 8) ? 1.0f : 0.0f);
        set_f32(x, 8, 1.0f);
        set_f32(x, 9, 32.0f);
        set_f32(x, 10, 1.0f);
        return x;
    }

    int flash_attn() {
        int64_t d = 16 * (1 + r.u8() % 8), dv = r.chance(4) ? 16 * (1 + r.u8() % 8) : d;
        int64_t n_q = 1 + r.u8() % 8, n_kv = 1 + r.u8() % 64, h_kv = 1 + r.u8() % 4, gqa = 1 + r.u8() % 3;
        int64_t h = h_kv * gqa;
        ggml_type kt = r.chance(3) ? GGML_TYPE_F16 : (r.chance(2) ? GGML_TYPE_Q8_0 : GGML_TYPE_F32);
        int q = source(GGML_TYPE_F32, d, n_q, h, 1);
        int k = source(kt, d, n_kv, h_kv, 1);
        // V's heads are K's, or now and then a count of their own (0 to 4)
        const uint8_t vh = r.u8();
        int v = source(kt, dv, n_kv, vh % 8 == 7 ? vh / 8 % 5 : h_kv, 1);
        int mask = -1, sinks = -1;
        const uint8_t what = r.u8();
        if (what & 1) {
            mask = leaf(GGML_TYPE_F16, n_kv, n_q + (what & 2 ? 0 : GGML_PAD(n_q, 64) - n_q), 1, 1);
        }
        if (what & 4) {
            sinks = leaf(GGML_TYPE_F32, h);
        }
        int64_t ne[4] = { g.t[v].ne[0], g.t[q].ne[2], g.t[q].ne[1], g.t[q].ne[3] };
        int x = node(GGML_OP_FLASH_ATTN_EXT, GGML_TYPE_F32, ne, { q, k, v, mask, sinks });
        set_f32(x, 0, 0.125f);
        set_f32(x, 1, (what & 8) ? 8.0f : 0.0f);
        set_f32(x, 2, (what & 16) ? 30.0f : 0.0f);
        g.t[x].params[3] = (what & 32) ? GGML_PREC_F32 : GGML_PREC_DEFAULT;
        return x;
    }

    int cpy() {
        ggml_type st = any_type(r), dt = any_type(r);
        if (r.chance(2)) {
            st = GGML_TYPE_F32;
        }
        int64_t ne0 = r.dim(), ne1 = r.dim(), ne2 = 1 + r.u8() % 3;
        int     a   = source(st, blocks(dt, blocks(st, ne0)), ne1, ne2, 1);
        int     b;
        if (r.chance(3)) {
            // the same elements in another shape (ggml_cpy only asks for the same count)
            // (a source of zero strides may count more elements than int64_t holds: then the same shape)
            int64_t    n = 1;
            const bool wraps = __builtin_mul_overflow(g.t[a].ne[0], g.t[a].ne[1], &n) ||
                               __builtin_mul_overflow(n, g.t[a].ne[2], &n) || __builtin_mul_overflow(n, g.t[a].ne[3], &n);
            int64_t d0 = blocks(dt, 1 + r.u8() % 64);
            b          = !wraps && n % d0 == 0 ? leaf(dt, d0, n / d0) : leaf(dt, g.t[a].ne[0], g.t[a].ne[1], g.t[a].ne[2]);
        } else {
            b = source(dt, g.t[a].ne[0], g.t[a].ne[1], g.t[a].ne[2], 1);
        }
        int x        = view(b, GGML_OP_CPY, g.t[b].ne, g.t[b].nb, 0);
        g.t[x].src[0] = a;
        g.t[x].src[1] = b;
        return x;
    }

    int dup() {
        ggml_type t  = any_type(r);
        int       a  = source(t, r.dim(), r.dim(), 1 + r.u8() % 3, 1);
        return node(r.chance(2) ? GGML_OP_CONT : GGML_OP_DUP, t, g.t[a].ne, { a });
    }

    int get_rows() {
        ggml_type t     = any_type(r);
        int64_t   n_rows = r.dim(), n_idx = r.dim(), ne2 = 1 + r.u8() % 3;
        int       a      = source(t, r.dim(), n_rows, ne2, 1);
        int       b      = leaf(GGML_TYPE_I32, n_idx, g.t[a].ne[2], 1, 1, g.t[a].ne[1]);
        int64_t   ne[4]  = { g.t[a].ne[0], g.t[b].ne[0], g.t[b].ne[1], g.t[b].ne[2] };
        return node(GGML_OP_GET_ROWS, GGML_TYPE_F32, ne, { a, b });
    }

    int set_rows() {
        ggml_type dt = any_type(r);
        int64_t   ne0 = r.dim(), n_rows = r.dim(), n_set = 1 + r.u8() % 8, ne2 = 1 + r.u8() % 3;
        int       a   = leaf(dt, ne0, n_rows, ne2, 1);
        int       b   = source(r.chance(3) ? GGML_TYPE_F16 : GGML_TYPE_F32, g.t[a].ne[0], n_set, g.t[a].ne[2], 1);
        int       c   = leaf(r.chance(2) ? GGML_TYPE_I64 : GGML_TYPE_I32, g.t[b].ne[1], g.t[b].ne[2], 1, 1,
                             g.t[a].ne[1]);
        int x        = view(a, GGML_OP_SET_ROWS, g.t[a].ne, g.t[a].nb, 0);
        g.t[x].src[0] = b;
        g.t[x].src[1] = c;
        g.t[x].src[2] = a;
        return x;
    }

    int glu() {
        ggml_type t  = float_type(r);
        int64_t   n  = r.dim();
        int       op = r.u8() % GGML_GLU_OP_COUNT;
        int       x;
        if (r.chance(2)) {
            int     a     = leaf(t, 2 * n, r.dim(), 1 + r.u8() % 3, 1);
            int64_t ne[4] = { g.t[a].ne[0] / 2, g.t[a].ne[1], g.t[a].ne[2], g.t[a].ne[3] };
            x             = node(GGML_OP_GLU, t, ne, { a });
            g.t[x].params[1] = r.u8() & 1;
        } else {
            int a = leaf(t, n, r.dim(), 1 + r.u8() % 3, 1);
            int b = leaf(t, g.t[a].ne[0], g.t[a].ne[1], g.t[a].ne[2], 1);
            x     = node(GGML_OP_GLU, t, g.t[a].ne, { a, b });
        }
        g.t[x].params[0] = op;
        set_f32(x, 2, 1.702f);
        set_f32(x, 3, 7.0f);
        return x;
    }

    int unary() {
        ggml_type t = float_type(r);
        int       a = source(t, r.dim(), r.dim(), 1 + r.u8() % 3, 1);
        int       x = node(GGML_OP_UNARY, t, g.t[a].ne, { a });
        g.t[x].params[0] = r.u8() % GGML_UNARY_OP_COUNT;
        return x;
    }

    int reshape() {
        ggml_type t = float_type(r);
        int       a = leaf(t, r.dim(), r.dim(), 2, 1);
        int64_t   ne[4] = { g.t[a].ne[0], g.t[a].ne[1] * 2, 1, 1 };
        size_t    nb[4];
        tensor    tmp = blank(t, ne[0], ne[1], 1, 1);
        memcpy(nb, tmp.nb, sizeof(nb));
        int v         = view(a, GGML_OP_RESHAPE, ne, nb, 0);
        g.t[v].src[0] = a;
        // and something computed from it
        int x = node(GGML_OP_SCALE, t, ne, { v });
        set_f32(x, 0, 2.0f);
        return x;
    }

    // one field of one tensor of the node, changed
    void mutate(int x) {
        const uint8_t  kind  = r.u8();
        const uint8_t  which = r.u8();
        const uint32_t value = r.u32();
        int            s     = x;
        if (which & 0x80) {
            int n = 0;
            while (n < GGML_MAX_SRC && g.t[x].src[n] >= 0) {
                n++;
            }
            if (n > 0) {
                s = g.t[x].src[(which >> 4 & 7) % n];
            }
        }
        tensor & t = g.t[s];
        const int i = which & 3;
        switch (kind % 8) {
            case 0: t.ne[i] = value % 8 == 0 ? 0 : (int64_t) (value % 97); break;
            case 1: t.nb[i] = value % 4 == 0 ? 0 : t.nb[i] + ggml_type_size(t.type) * (value % 5); break;
            case 2: t.type  = any_type(r); break;
            case 3: t.params[(which >> 2) % 16] = (int32_t) value % 67 - 3; break;
            case 4: t.params[(which >> 2) % 16] ^= (int32_t) value; break;
            case 5: t.ne[i] = (int64_t) value; break;                  // large
            case 6: std::swap(t.ne[i], t.ne[(i + 1) % 4]); break;
            case 7: t.view_offs += ALIGN * (value % 4); t.offset += ALIGN * (value % 4); break;  // past its end
        }
        if (s != x && (kind % 8 == 0 || kind % 8 == 2 || kind % 8 == 5 || kind % 8 == 6) && !t.node && t.view_src < 0) {
            // a leaf keeps its strides contiguous when its shape or type changes
            contiguous(t);
        }
    }

    void build() {
        const int n = 1 + r.u8() % MAX_NODES;
        for (int i = 0; i < n && !too_big && g.t.size() < 48; i++) {
            const uint8_t op = r.u8();
            int           x;
            switch (op % 16) {
                case 0: x = mul_mat(); break;
                case 1: x = mul_mat_id(); break;
                case 2: x = binary(); break;
                case 3: x = scale(); break;
                case 4: x = norm(); break;
                case 5: x = soft_max(); break;
                case 6: x = rope(); break;
                case 7: x = flash_attn(); break;
                case 8: x = cpy(); break;
                case 9: x = dup(); break;
                case 10: x = get_rows(); break;
                case 11: x = set_rows(); break;
                case 12: x = glu(); break;
                case 13: x = unary(); break;
                case 14: x = reshape(); break;
                default: x = r.chance(2) ? rope() : flash_attn(); break;
            }
            if (r.u8() % 8 == 7) {
                mutate(x);
            }
        }
        // the nodes, in the order they were made (sources before their users)
        for (size_t i = 0; i < g.t.size(); i++) {
            if (g.t[i].node) {
                g.nodes.push_back((int) i);
            }
        }
    }
};

inline uint32_t next(uint32_t & s) {
    s ^= s << 13;
    s ^= s >> 17;
    s ^= s << 5;
    return s;
}

// The values the leaves are filled from: POOL bounded floats (a whole number of blocks of every type),
// made once, and each type's bytes of them (converted, or quantized once by the type's reference
// quantizer). A leaf is filled with runs of whole blocks copied from its type's pool at places the
// data seed picks: the values a quantizer makes from bounded floats, without quantizing megabytes
// per input (which took most of a worker's time, in the harness rather than in the host).
constexpr int64_t POOL = 1 << 15;

inline const float * float_pool() {
    static std::vector<float> pool = [] {
        std::vector<float> f((size_t) POOL);
        uint32_t           s = 0x2545f491;
        for (auto & v : f) {
            v = ((int32_t) (next(s) % 2001) - 1000) / 250.0f;
        }
        return f;
    }();
    return pool.data();
}

// `type`'s bytes of the float pool: empty where the harness leaves such a leaf zero
inline const std::vector<uint8_t> & type_pool(ggml_type type) {
    static std::vector<uint8_t> pools[GGML_TYPE_COUNT];
    static bool                 made[GGML_TYPE_COUNT];
    std::vector<uint8_t> &      pool = pools[type];
    if (made[type]) {
        return pool;
    }
    made[type]    = true;
    const float * f = float_pool();
    switch (type) {
        case GGML_TYPE_F32:
            pool.assign((const uint8_t *) f, (const uint8_t *) (f + POOL));
            break;
        case GGML_TYPE_F16:
            pool.resize((size_t) POOL * 2);
            ggml_fp32_to_fp16_row(f, (ggml_fp16_t *) pool.data(), POOL);
            break;
        case GGML_TYPE_BF16:
            pool.resize((size_t) POOL * 2);
            ggml_fp32_to_bf16_row(f, (ggml_bf16_t *) pool.data(), POOL);
            break;
        case GGML_TYPE_F64:
            pool.resize((size_t) POOL * 8);
            for (int64_t i = 0; i < POOL; i++) {
                const double d = f[i];
                memcpy(pool.data() + 8 * i, &d, 8);
            }
            break;
        default:
            if (ggml_blck_size(type) > 1 && POOL % ggml_blck_size(type) == 0 && !ggml_quantize_requires_imatrix(type)) {
                pool.resize(ggml_row_size(type, POOL));
                ggml_quantize_chunk(type, f, pool.data(), 0, 1, POOL, nullptr);
            }
            break;
    }
    return pool;
}

// `s` advanced by `n` steps of next() at once (xorshift is linear over GF(2): a step is a 32x32 bit
// matrix, and the matrices of 2^k steps are made once). A float leaf takes as many steps as it has
// elements, as when each element was drawn: the indices drawn after it, and so every input's index
// data (an expert id out of range is one), are what they were.
inline void skip(uint32_t & s, uint64_t n) {
    static uint32_t jump[64][32];  // jump[k][j]: bit j's image after 2^k steps
    static bool     made = false;
    if (!made) {
        for (int j = 0; j < 32; j++) {
            uint32_t v = 1u << j;
            v ^= v << 13;
            v ^= v >> 17;
            v ^= v << 5;
            jump[0][j] = v;
        }
        for (int k = 1; k < 64; k++) {
            for (int j = 0; j < 32; j++) {
                uint32_t v = 0;
                for (int b = 0; b < 32; b++) {
                    if (jump[k - 1][j] >> b & 1) {
                        v ^= jump[k - 1][b];
                    }
                }
                jump[k][j] = v;
            }
        }
        made = true;
    }
    for (int k = 0; n != 0; k++, n >>= 1) {
        if (n & 1) {
            uint32_t v = 0;
            for (int b = 0; b < 32; b++) {
                if (s >> b & 1) {
                    v ^= jump[k][b];
                }
            }
            s = v;
        }
    }
}

// `units` whole blocks (elements of an unquantized type) of `type` at `p`, in runs from its pool at
// places drawn from `s` (a stream of the leaf's own)
inline void fill_from_pool(ggml_type type, uint8_t * p, size_t units, uint32_t s) {
    const std::vector<uint8_t> & pool = type_pool(type);
    const size_t                 unit = ggml_type_size(type);
    if (pool.empty() || unit == 0) {
        return;
    }
    const size_t have = pool.size() / unit;
    for (size_t done = 0; done < units;) {
        const size_t from = next(s) % have;
        const size_t n    = units - done < have - from ? units - done : have - from;
        memcpy(p + done * unit, pool.data() + from * unit, n * unit);
        done += n;
    }
}

// the leaves' contents: bounded floats, indices below their limit (one in 64 tensors: one index is not)
inline void fill(graph & g, uint32_t seed) {
    std::vector<uint8_t> & area = contents_area();
    g.at.resize(g.sizes.size());
    size_t end = 0;
    for (size_t i = 0; i < g.sizes.size(); i++) {
        g.at[i] = end;
        end += (g.sizes[i] + 63) / 64 * 64;
    }
    if (area.size() < end) {
        area.resize(end);
    }
    memset(area.data(), 0, end);
    uint32_t s = seed | 1;
    for (auto & t : g.t) {
        if (t.node || t.view_src >= 0) {
            continue;
        }
        const size_t n = builder::nbytes_of(t);
        if (t.buffer < 0 || t.offset + n > g.sizes[t.buffer] || n == 0) {
            continue;
        }
        uint8_t *     p  = g.data(t.buffer) + t.offset;
        const int64_t ne = n / ggml_type_size(t.type) * ggml_blck_size(t.type);
        if (t.type == GGML_TYPE_I32 || t.type == GGML_TYPE_I64 || t.type == GGML_TYPE_I16 || t.type == GGML_TYPE_I8) {
            const int64_t limit = t.index_limit > 0 ? t.index_limit : 64;
            const bool    wrong = next(s) % 64 == 0;
            const size_t  ts    = ggml_type_size(t.type);
            for (int64_t i = 0; i < ne; i++) {
                const int64_t v = (int64_t) (next(s) % (uint64_t) limit);
                memcpy(p + i * ts, &v, ts);
            }
            if (wrong && ne > 0) {
                memcpy(p, &limit, ts);
            }
            continue;
        }
        const uint32_t own = s ^ 0x9e3779b9u;
        skip(s, (uint64_t) ne);
        if (ggml_blck_size(t.type) == 1) {
            fill_from_pool(t.type, p, (size_t) ne, own | 1);
        } else if (t.ne[0] > 0 && t.ne[0] % ggml_blck_size(t.type) == 0) {
            // whole rows, as a row-wise quantization of the values writes them
            fill_from_pool(t.type, p, (size_t) (ne / t.ne[0] * (t.ne[0] / ggml_blck_size(t.type))), own | 1);
        }
    }
}

// the graph on stderr, one line per tensor: to read a finding (GFUZZ_DESCRIBE=1)
inline void describe(const graph & g) {
    fprintf(stderr, "graph: %zu tensors, %zu nodes, %zu buffers of %zu bytes\n", g.t.size(), g.nodes.size(),
            g.sizes.size(), g.total);
    for (size_t i = 0; i < g.t.size(); i++) {
        const tensor & t = g.t[i];
        fprintf(stderr, "  t%zu %s%-14s %-6s ne [%lld %lld %lld %lld] nb [%zu %zu %zu %zu] in b%d+%zu", i, t.node ? "*" : " ",
                ggml_op_name(t.op), ggml_type_name(t.type), (long long) t.ne[0], (long long) t.ne[1],
                (long long) t.ne[2], (long long) t.ne[3], t.nb[0], t.nb[1], t.nb[2], t.nb[3], t.buffer, t.offset);
        for (int s = 0; s < GGML_MAX_SRC; s++) {
            if (t.src[s] >= 0) {
                fprintf(stderr, " src%d=t%d", s, t.src[s]);
            }
        }
        if (t.view_src >= 0) {
            fprintf(stderr, " view_of=t%d+%zu", t.view_src, t.view_offs);
        }
        if (t.op != GGML_OP_NONE) {
            fprintf(stderr, " params");
            int last = 15;
            while (last > 0 && t.params[last] == 0) {
                last--;
            }
            for (int p = 0; p <= last; p++) {
                fprintf(stderr, " %d", t.params[p]);
            }
        }
        fprintf(stderr, "\n");
    }
}

// `used`, when given, receives how many bytes of the input the graph's program read: a harness reads
// what follows as its own (apir_graph_fuzz.cpp's deltas)
inline bool generate(const uint8_t * data, size_t size, graph & g, size_t * used = nullptr) {
    reader  r{ data, size };
    builder b{ r, g };
    (void) r.u8();  // reserved: the harness's own flags
    const uint32_t seed = r.u32();
    b.build();
    if (b.too_big || g.nodes.empty() || g.sizes.empty()) {
        return false;
    }
    fill(g, seed);
    if (used) {
        *used = r.at;
    }
    return true;
}

}  // namespace gfuzz
