// The parts of ggml_node_check (ggml/src/ggml-node-check.cpp, patches 0015 and 0018) that no client
// of a CPU host can reach through either host's wire, tested on the function itself:
//
// - the room rule: a result of an op that ggml_op_alloc_size_may_expand names must have the room its
//   buffer's get_alloc_size asks for. The CPU's buffer types answer ggml_nbytes, and both hosts refuse
//   a tensor whose ggml_nbytes runs past its buffer while they decode it, before any rule runs; so
//   here a buffer type that asks for PAD bytes more (as CUDA's does for FLASH_ATTN_EXT) places the
//   result at the boundary: exactly the room passes, one byte less fails, and so does a result placed
//   before its buffer or past its end. Nodes not yet placed (data == NULL, what supports_op asks), views
//   and quantized results are not asked.
// - ggml_node_op_desc: a node whose op, unary op or GLU op is out of range (what a hostile RPC client
//   sends; apir-host's decoder refuses such enums before) fails the check and is named "unknown op";
//   ggml_op_desc indexes its name tables with them unchecked.
//
// Built with -fsanitize=address,undefined against ggml's libraries of the same sanitized build, so a
// read past a name table is a report, not a passing test. Prints "all node check tests passed".

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-backend-impl.h"
#include "ggml-node-check.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

static int failures = 0;

#define EXPECT(cond, what)                                          \
    do {                                                            \
        if (!(cond)) {                                              \
            fprintf(stderr, "FAILED: %s (%s)\n", what, #cond);      \
            failures++;                                             \
        }                                                           \
    } while (0)

static const size_t PAD = 96;  // the bytes a padded buffer type asks for after a result

struct buffer_ctx {
    std::vector<uint8_t> bytes;
};

static void   buffer_free(ggml_backend_buffer_t buffer) { delete (buffer_ctx *) buffer->context; }
static void * buffer_base(ggml_backend_buffer_t buffer) { return ((buffer_ctx *) buffer->context)->bytes.data(); }

static ggml_backend_buffer_t buft_alloc(ggml_backend_buffer_type_t buft, size_t size) {
    ggml_backend_buffer_i iface = {};
    iface.free_buffer = buffer_free;
    iface.get_base    = buffer_base;
    auto * ctx        = new buffer_ctx;
    ctx->bytes.resize(size);
    return ggml_backend_buffer_init(buft, iface, ctx, size);
}

static size_t buft_alignment(ggml_backend_buffer_type_t) { return 32; }

static size_t padded_alloc_size(ggml_backend_buffer_type_t, const ggml_tensor * t) {
    return ggml_nbytes(t) + (ggml_op_alloc_size_may_expand(t->op) ? PAD : 0);
}

static ggml_backend_buffer_type make_buft(bool padded) {
    ggml_backend_buffer_type buft = {};
    buft.iface.alloc_buffer       = buft_alloc;
    buft.iface.get_alignment      = buft_alignment;
    buft.iface.get_alloc_size     = padded ? padded_alloc_size : nullptr;  // nullptr: ggml_nbytes, as the CPU's
    return buft;
}

// out = a x b, F32: a [16,4] and b [16,4] in `src_buf`, out [4,4] (64 bytes) at `offset` of `out_buf`
struct mul_mat {
    ggml_context * ctx;
    ggml_tensor *  out;

    mul_mat(ggml_backend_buffer_t src_buf, ggml_backend_buffer_t out_buf, size_t offset) {
        ggml_init_params params = { 16 * ggml_tensor_overhead(), nullptr, true };
        ctx                     = ggml_init(params);
        ggml_tensor * a         = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 16, 4);
        ggml_tensor * b         = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 16, 4);
        a->buffer               = src_buf;
        b->buffer               = src_buf;
        a->data                 = (uint8_t *) ggml_backend_buffer_get_base(src_buf);
        b->data                 = (uint8_t *) ggml_backend_buffer_get_base(src_buf) + 256;
        out                     = ggml_mul_mat(ctx, a, b);
        out->buffer             = out_buf;
        out->data               = (uint8_t *) ggml_backend_buffer_get_base(out_buf) + offset;
    }

    ~mul_mat() { ggml_free(ctx); }
};

static void test_room(void) {
    ggml_backend_buffer_type plain_type  = make_buft(false);
    ggml_backend_buffer_type padded_type = make_buft(true);
    ggml_backend_buffer_t    src         = ggml_backend_buft_alloc_buffer(&plain_type, 1024);
    ggml_backend_buffer_t    padded      = ggml_backend_buft_alloc_buffer(&padded_type, 1024);
    ggml_backend_buffer_t    plain       = ggml_backend_buft_alloc_buffer(&plain_type, 1024);
    const size_t             nbytes      = 4 * 4 * sizeof(float);
    {
        mul_mat m(src, padded, 0);
        EXPECT(ggml_nbytes(m.out) == nbytes, "the result's bytes");
        EXPECT(ggml_backend_buffer_get_alloc_size(padded, m.out) == nbytes + PAD, "the padded type asks for more");
        EXPECT(ggml_node_check(m.out) == GGML_NODE_CHECK_OK, "a result at the buffer's start");
    }
    {
        mul_mat m(src, padded, 1024 - nbytes - PAD);
        EXPECT(ggml_node_check(m.out) == GGML_NODE_CHECK_OK, "exactly the room get_alloc_size asks for");
    }
    {
        // its own bytes fit (what the hosts' decoders check), the padding does not
        mul_mat m(src, padded, 1024 - nbytes - PAD + 1);
        EXPECT(ggml_node_check(m.out) == GGML_NODE_CHECK_FAILED, "one byte less than the room");
    }
    {
        mul_mat m(src, padded, 1024 - nbytes);
        EXPECT(ggml_node_check(m.out) == GGML_NODE_CHECK_FAILED, "the result's bytes and no padding");
    }
    {
        mul_mat m(src, padded, 1024);
        EXPECT(ggml_node_check(m.out) == GGML_NODE_CHECK_FAILED, "a result at the buffer's end");
    }
    {
        mul_mat m(src, padded, 0);
        m.out->data = (uint8_t *) ggml_backend_buffer_get_base(padded) + 1025;
        EXPECT(ggml_node_check(m.out) == GGML_NODE_CHECK_FAILED, "a result past the buffer's end");
        m.out->data = (uint8_t *) ggml_backend_buffer_get_base(padded) - 64;
        EXPECT(ggml_node_check(m.out) == GGML_NODE_CHECK_FAILED, "a result before the buffer's base");
    }
    {
        // a buffer type of ggml_nbytes (the CPU's): the same arithmetic at its boundary
        mul_mat m(src, plain, 1024 - nbytes);
        EXPECT(ggml_node_check(m.out) == GGML_NODE_CHECK_OK, "exactly ggml_nbytes of room in a CPU-like buffer");
        m.out->data = (uint8_t *) ggml_backend_buffer_get_base(plain) + 1024 - nbytes + 1;
        EXPECT(ggml_node_check(m.out) == GGML_NODE_CHECK_FAILED, "one byte less in a CPU-like buffer");
    }
    {
        // not placed yet: what supports_op asks, and what the rule skips
        mul_mat m(src, padded, 0);
        m.out->buffer = nullptr;
        m.out->data   = nullptr;
        EXPECT(ggml_node_check(m.out) == GGML_NODE_CHECK_OK, "a result not placed yet");
    }
    {
        // an op whose results are never larger than their bytes is not asked
        ggml_init_params params = { 8 * ggml_tensor_overhead(), nullptr, true };
        ggml_context *   ctx    = ggml_init(params);
        ggml_tensor *    a      = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 16);
        ggml_tensor *    b      = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 16);
        a->buffer = b->buffer = src;
        a->data               = ggml_backend_buffer_get_base(src);
        b->data               = (uint8_t *) ggml_backend_buffer_get_base(src) + 64;
        ggml_tensor * sum     = ggml_add(ctx, a, b);
        sum->buffer           = padded;
        sum->data             = (uint8_t *) ggml_backend_buffer_get_base(padded) + 1024 - 64;
        EXPECT(ggml_node_check(sum) == GGML_NODE_CHECK_OK, "ADD's result needs its bytes only");
        ggml_free(ctx);
    }
    ggml_backend_buffer_free(src);
    ggml_backend_buffer_free(padded);
    ggml_backend_buffer_free(plain);
}

static void test_op_desc(void) {
    ggml_init_params params = { 8 * ggml_tensor_overhead(), nullptr, true };
    ggml_context *   ctx    = ggml_init(params);
    ggml_tensor *    a      = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 16);
    ggml_tensor *    t      = ggml_abs(ctx, a);
    EXPECT(strcmp(ggml_node_op_desc(t), "ABS") == 0, "a unary op is named by its unary op");
    EXPECT(ggml_node_check(t) != GGML_NODE_CHECK_FAILED, "ABS of F32 rows");

    const int32_t unary_ops[] = { GGML_UNARY_OP_COUNT, GGML_UNARY_OP_COUNT + 1000, -1, INT32_MIN };
    for (int32_t op : unary_ops) {
        t->op_params[0] = op;
        EXPECT(strcmp(ggml_node_op_desc(t), "unknown op") == 0, "a unary op out of range");
        EXPECT(ggml_node_check(t) == GGML_NODE_CHECK_FAILED, "a unary op out of range fails");
    }

    ggml_tensor * g = ggml_swiglu(ctx, ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 32));
    EXPECT(strcmp(ggml_node_op_desc(g), "SWIGLU") == 0, "a GLU op is named by its GLU op");
    const int32_t glu_ops[] = { GGML_GLU_OP_COUNT, GGML_GLU_OP_COUNT + 7, -1, INT32_MAX };
    for (int32_t op : glu_ops) {
        g->op_params[0] = op;
        EXPECT(strcmp(ggml_node_op_desc(g), "unknown op") == 0, "a GLU op out of range");
        EXPECT(ggml_node_check(g) == GGML_NODE_CHECK_FAILED, "a GLU op out of range fails");
    }

    ggml_tensor * n = ggml_add(ctx, a, a);
    EXPECT(strcmp(ggml_node_op_desc(n), "ADD") == 0, "an op is named");
    const uint32_t ops[] = { GGML_OP_COUNT, GGML_OP_COUNT + 1, 0x7fffffff, 0xffffffff };
    for (uint32_t op : ops) {
        memcpy(&n->op, &op, sizeof(op));  // as a host's decoder would store the client's bytes
        EXPECT(strcmp(ggml_node_op_desc(n), "unknown op") == 0, "an op out of range");
        EXPECT(ggml_node_check(n) == GGML_NODE_CHECK_FAILED, "an op out of range fails");
    }
    ggml_free(ctx);
}

// SWIGLU_OAI and SWIGLU_CLAMP clamp to [-limit, limit]: a negative or NaN limit made ggml-cpu's
// std::clamp assert where the C++ library checks its preconditions (found by the graph fuzzer)
static void set_limit(ggml_tensor * t, float limit) {
    memcpy(&t->op_params[3], &limit, sizeof(limit));  // where ggml_swiglu_clamp and ggml_swiglu_oai keep it
}

static void test_glu_limit(void) {
    ggml_init_params params = { 16 * ggml_tensor_overhead(), nullptr, true };
    ggml_context *   ctx    = ggml_init(params);
    ggml_tensor *    a      = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 32, 4);
    ggml_tensor *    b      = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 32, 4);
    ggml_tensor *    clamp  = ggml_swiglu_clamp(ctx, a, b, 7.0f);
    ggml_tensor *    oai    = ggml_swiglu_oai(ctx, a, b, 1.702f, 7.0f);
    EXPECT(ggml_node_check(clamp) == GGML_NODE_CHECK_OK, "SWIGLU_CLAMP with a limit of 7");
    EXPECT(ggml_node_check(oai) == GGML_NODE_CHECK_OK, "SWIGLU_OAI with a limit of 7");
    set_limit(clamp, 0.0f);
    EXPECT(ggml_node_check(clamp) == GGML_NODE_CHECK_OK, "SWIGLU_CLAMP with a limit of 0");
    const float bad[] = { -1.0f, -0.0001f, -INFINITY, NAN };
    for (float limit : bad) {
        set_limit(clamp, limit);
        set_limit(oai, limit);
        EXPECT(ggml_node_check(clamp) == GGML_NODE_CHECK_FAILED, "SWIGLU_CLAMP with a negative or NaN limit fails");
        EXPECT(ggml_node_check(oai) == GGML_NODE_CHECK_FAILED, "SWIGLU_OAI with a negative or NaN limit fails");
    }
    ggml_free(ctx);
}

// multimodal ROPE: four positions a token, sections that are there, not negative and inside the row,
// and no mode ggml-cpu does not know (found by the graph fuzzer: the RPC server computed such nodes)
static void test_rope_multi(void) {
    ggml_init_params params = { 16 * ggml_tensor_overhead(), nullptr, true };
    ggml_context *   ctx    = ggml_init(params);
    ggml_tensor *    a      = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 16, 2, 3);
    ggml_tensor *    pos    = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, 12);
    int              sections[4] = { 4, 2, 2, 0 };
    ggml_tensor *    t = ggml_rope_multi(ctx, a, pos, nullptr, 16, sections, GGML_ROPE_TYPE_MROPE, 4096, 10000.0f, 1.0f,
                                         0.0f, 1.0f, 32.0f, 1.0f);
    EXPECT(ggml_node_check(t) == GGML_NODE_CHECK_OK, "MROPE as ggml_rope_multi builds it");
    const int32_t bad_sections[][4] = { { 0, 0, 0, 0 }, { 0, 0, 0, 8 }, { 8, -4, 4, 0 }, { 8, 8, 8, 0 } };
    for (const auto & bad : bad_sections) {
        memcpy(t->op_params + 11, bad, sizeof(bad));
        EXPECT(ggml_node_check(t) == GGML_NODE_CHECK_FAILED, "MROPE of sections absent, negative or past the row fails");
    }
    memcpy(t->op_params + 11, sections, sizeof(sections));
    t->src[1] = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, 3);
    EXPECT(ggml_node_check(t) == GGML_NODE_CHECK_FAILED, "MROPE of one position a token fails");
    t->src[1] = pos;
    t->op_params[2] = 4;
    EXPECT(ggml_node_check(t) == GGML_NODE_CHECK_FAILED, "ROPE of a mode ggml does not have fails");
    // no elements (a dimension of 0) and a third dimension of 2^62: the positions are counted without a
    // product that could overflow (this test runs under UBSan)
    a->ne[1]   = 0;
    a->ne[2]   = INT64_C(1) << 62;
    t->ne[1]   = 0;
    t->ne[2]   = a->ne[2];
    EXPECT(ggml_node_check(t) == GGML_NODE_CHECK_FAILED, "MROPE of 2^62 tokens and 12 positions fails");
    a->ne[1] = t->ne[1] = 2;
    a->ne[2] = t->ne[2] = 3;
    t->op_params[2] = GGML_ROPE_TYPE_VISION;
    t->op_params[1] = 8;
    EXPECT(ggml_node_check(t) == GGML_NODE_CHECK_OK, "VISION rotating half the row");
    t->op_params[1] = 4;
    EXPECT(ggml_node_check(t) == GGML_NODE_CHECK_FAILED, "VISION rotating less than half the row fails");
    // CUDA's vision kernel splits the pairs by the first two sections only, and divides by their sum
    t->op_params[1] = 8;
    const int32_t third_only[4] = { 0, 0, 4, 0 };
    memcpy(t->op_params + 11, third_only, sizeof(third_only));
    EXPECT(ggml_node_check(t) == GGML_NODE_CHECK_FAILED, "VISION of the third section alone fails");
    ggml_free(ctx);
}

// MUL_MAT of rows of no elements: ggml-cpu plans no work buffer and steps through its NULL base to
// convert src1 (found by the graph fuzzer, UBSan)
static void test_mul_mat_of_empty_rows(void) {
    ggml_init_params params = { 8 * ggml_tensor_overhead(), nullptr, true };
    ggml_context *   ctx    = ggml_init(params);
    ggml_tensor *    a      = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 32, 4);
    ggml_tensor *    b      = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 32, 2);
    ggml_tensor *    t      = ggml_mul_mat(ctx, a, b);
    EXPECT(ggml_node_check(t) != GGML_NODE_CHECK_FAILED, "MUL_MAT of rows of 32");
    a->ne[0] = 0;  // as a client's bytes may have it (ggml_mul_mat would take such rows for transposed)
    b->ne[0] = 0;
    EXPECT(ggml_node_check(t) == GGML_NODE_CHECK_FAILED, "MUL_MAT of rows of no elements fails");
    ggml_free(ctx);
}

// MUL_MAT with a Hadamard hint: ggml-cpu transforms src1's rows of ne10 floats into the result's rows,
// which have src0's ne1 elements, so src0 must be square (found by the graph fuzzer, ASan: 4 floats
// written into a result row of 2)
static int check_hinted_mul_mat(int64_t n, int64_t rows, int32_t hint, ggml_type b_type = GGML_TYPE_F32) {
    ggml_init_params params = { 8 * ggml_tensor_overhead(), nullptr, true };
    ggml_context *   ctx    = ggml_init(params);
    ggml_tensor *    a      = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n, rows);
    ggml_tensor *    b      = ggml_new_tensor_2d(ctx, b_type, n, 3);
    ggml_tensor *    t      = ggml_mul_mat(ctx, a, b);
    t->op_params[1]         = hint;
    const int result        = ggml_node_check(t);
    ggml_free(ctx);
    return result;
}

static void test_mul_mat_hadamard_hint(void) {
    EXPECT(check_hinted_mul_mat(4, 4, GGML_HINT_SRC0_IS_HADAMARD) != GGML_NODE_CHECK_FAILED,
           "MUL_MAT of a square Hadamard src0 of rows of 4");
    EXPECT(check_hinted_mul_mat(4, 2, GGML_HINT_SRC0_IS_HADAMARD) == GGML_NODE_CHECK_FAILED,
           "a Hadamard hint on a src0 of 2 rows of 4 fails");
    EXPECT(check_hinted_mul_mat(4, 2, GGML_HINT_NONE) != GGML_NODE_CHECK_FAILED, "the same MUL_MAT without the hint");
    EXPECT(check_hinted_mul_mat(3, 3, GGML_HINT_SRC0_IS_HADAMARD) == GGML_NODE_CHECK_FAILED,
           "a Hadamard hint on rows of 3 fails");
    EXPECT(check_hinted_mul_mat(4, 4, 7) == GGML_NODE_CHECK_FAILED, "a hint ggml does not have fails");
    // the transform reads src1 as F32 or F16 (ggml-cpu and ggml-cuda alike), and aborts on any other type
    EXPECT(check_hinted_mul_mat(4, 4, GGML_HINT_SRC0_IS_HADAMARD, GGML_TYPE_F16) != GGML_NODE_CHECK_FAILED,
           "a Hadamard transform of F16 rows");
    EXPECT(check_hinted_mul_mat(4, 4, GGML_HINT_NONE, GGML_TYPE_F16) == GGML_NODE_CHECK_FAILED,
           "F16 rows times an F32 src0 without the hint fail");
    EXPECT(check_hinted_mul_mat(4, 4, GGML_HINT_SRC0_IS_HADAMARD, GGML_TYPE_BF16) == GGML_NODE_CHECK_FAILED,
           "a Hadamard transform of BF16 rows fails");
}

// ggml_cpy's result is a view of its destination, strides included: ggml-cpu's dequantizing copy writes
// the result from its own address at the destination's strides (found by the graph fuzzer: a result of
// other strides than its destination's asserted in ggml-cpu, or wrote past the result's extent)
static int check_dequantizing_cpy(size_t result_nb1) {
    ggml_init_params params = { 8 * ggml_tensor_overhead(), nullptr, true };
    ggml_context *   ctx    = ggml_init(params);
    ggml_tensor *    a      = ggml_new_tensor_2d(ctx, GGML_TYPE_Q8_0, 32, 2);
    ggml_tensor *    b      = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 32, 2);
    ggml_tensor *    t      = ggml_cpy(ctx, a, b);
    t->nb[1]                = result_nb1;
    t->nb[2] = t->nb[3] = 2 * result_nb1;
    const int result        = ggml_node_check(t);
    ggml_free(ctx);
    return result;
}

static void test_cpy_result_strides(void) {
    EXPECT(check_dequantizing_cpy(32 * sizeof(float)) != GGML_NODE_CHECK_FAILED,
           "a dequantizing CPY into its destination's strides");
    EXPECT(check_dequantizing_cpy(64 * sizeof(float)) == GGML_NODE_CHECK_FAILED,
           "a CPY whose result has other strides than its destination fails");
}

int main(void) {
    test_mul_mat_of_empty_rows();
    test_mul_mat_hadamard_hint();
    test_cpy_result_strides();
    test_room();
    test_op_desc();
    test_glu_limit();
    test_rope_multi();
    if (failures) {
        fprintf(stderr, "%d node check tests failed\n", failures);
        return 1;
    }
    printf("all node check tests passed\n");
    return 0;
}
