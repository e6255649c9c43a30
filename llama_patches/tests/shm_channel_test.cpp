// Tests of the RPC shared-memory channel (transport-shm.cpp of the patch series), built by
// apirctl's test suite with AddressSanitizer and UndefinedBehaviorSanitizer:
//   c++ -std=c++17 -fsanitize=address,undefined -I ggml/include -I ggml/src -I ggml/src/ggml-rpc
//       shm_channel_test.cpp ggml/src/ggml-rpc/transport-shm.cpp -o shm_channel_test
// The channel's peer is untrusted, so besides streaming it checks that a hostile peer scribbling
// over the shared control page, an unsealed or resized memfd, and a peer that dies all end in a
// clean failure, never a crash or a hang; and the same over a region (a VM's shared memory, where a
// waiting side polls instead of sleeping on a futex).

#include "transport-shm.h"

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>
#include <chrono>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ggml-impl.h"

// transport-shm.cpp logs through ggml; the test needs no more of ggml than this
void ggml_log_internal(enum ggml_log_level level, const char * format, ...) {
    (void)level;
    if (std::getenv("SHM_TEST_VERBOSE")) {
        va_list args;
        va_start(args, format);
        vfprintf(stderr, format, args);
        va_end(args);
    }
}

static int failures = 0;
#define CHECK(cond) do { if (!(cond)) { fprintf(stderr, "FAILED %s:%d: %s\n", __FILE__, __LINE__, #cond); failures++; } } while (0)

struct pair_t {
    std::unique_ptr<shm_channel> client, server;
    int sock[2];
    uint8_t * region = nullptr;
};

static constexpr size_t REGION_SIZE = 4 << 20;

static pair_t make_pair(size_t ring, bool in_region = false) {
    pair_t p;
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, p.sock) == 0);
    if (in_region) {
        void * m = mmap(nullptr, REGION_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        CHECK(m != MAP_FAILED);
        p.region = static_cast<uint8_t *>(m);
        memset(p.region, 0xa5, REGION_SIZE);  // what a previous session or the guest left there
        // the server makes the rings before it answers HELLO; the client takes them as they are
        p.server = shm_channel::over_region(p.region, REGION_SIZE, ring, false, true);
        p.client = shm_channel::over_region(p.region, REGION_SIZE, ring, true, false);
        CHECK(p.server != nullptr && p.client != nullptr);
        return p;
    }
    p.client = shm_channel::create(ring);
    CHECK(p.client != nullptr);
    p.server = shm_channel::attach(dup(p.client->fd()), ring);
    CHECK(p.server != nullptr);
    return p;
}

static void close_pair(pair_t & p) {
    close(p.sock[0]);
    close(p.sock[1]);
    if (p.region) {
        p.client.reset();
        p.server.reset();
        munmap(p.region, REGION_SIZE);
        p.region = nullptr;
    }
}

// a stream far larger than the ring, in random chunk sizes on both ends, arrives intact
static void test_stream(size_t ring, size_t total, uint32_t seed, bool in_region = false) {
    pair_t p = make_pair(ring, in_region);
    std::vector<uint8_t> out(total), in(total);
    std::mt19937 rng(seed);
    for (auto & b : out) b = (uint8_t)rng();
    std::thread writer([&] {
        std::mt19937 r(seed + 1);
        size_t done = 0;
        while (done < total) {
            size_t n = std::min(total - done, (size_t)(r() % (3 * ring / 2) + 1));
            CHECK(p.client->send(out.data() + done, n, p.sock[0]));
            done += n;
        }
    });
    std::mt19937 r(seed + 2);
    size_t done = 0;
    while (done < total) {
        size_t n = std::min(total - done, (size_t)(r() % 1000 + 1));
        if (!p.server->recv(in.data() + done, n, p.sock[1])) { CHECK(false); break; }
        done += n;
    }
    writer.join();
    CHECK(in == out);
    // and back the other way, a message at a time (request/response pattern)
    for (int i = 0; i < 2000; i++) {
        uint32_t v = (uint32_t)i * 2654435761u, got = 0;
        CHECK(p.server->send(&v, sizeof(v), p.sock[1]));
        CHECK(p.client->recv(&got, sizeof(got), p.sock[0]));
        CHECK(got == v);
    }
    close_pair(p);
}

// a reader waiting for data whose peer dies returns false promptly instead of hanging
static void test_peer_death(bool in_region = false) {
    pair_t p = make_pair(shm_channel::MIN_RING_SIZE, in_region);
    auto t0 = std::chrono::steady_clock::now();
    std::thread killer([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        shutdown(p.sock[0], SHUT_RDWR);
    });
    uint8_t buf[16];
    CHECK(!p.server->recv(buf, sizeof(buf), p.sock[1]));
    killer.join();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(s < 5.0);
    // a writer blocked on a full ring, too
    pair_t q = make_pair(shm_channel::MIN_RING_SIZE, in_region);
    std::vector<uint8_t> big(4 * shm_channel::MIN_RING_SIZE);
    std::thread killer2([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        shutdown(q.sock[1], SHUT_RDWR);
    });
    CHECK(!q.client->send(big.data(), big.size(), q.sock[0]));
    killer2.join();
    close_pair(p);
    close_pair(q);
}

// the server refuses memfds it could fault on or misread
static void test_attach_checks() {
    size_t ring = shm_channel::MIN_RING_SIZE;
    // not sealed
    int fd = memfd_create("t", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    CHECK(ftruncate(fd, (off_t)shm_channel_file_size(ring)) == 0);
    CHECK(shm_channel::attach(fd, ring) == nullptr);
    // sealed but of another size
    fd = memfd_create("t", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    CHECK(ftruncate(fd, (off_t)shm_channel_file_size(ring) - 4096) == 0);
    CHECK(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) == 0);
    CHECK(shm_channel::attach(fd, ring) == nullptr);
    // ring sizes out of range or not a power of two
    auto c = shm_channel::create(ring);
    CHECK(shm_channel::attach(dup(c->fd()), ring + 1) == nullptr);
    CHECK(shm_channel::attach(dup(c->fd()), 1024) == nullptr);
    CHECK(shm_channel::attach(dup(c->fd()), (size_t)1 << 40) == nullptr);
    CHECK(shm_channel::create(12345) == nullptr);
    // a garbage header
    void * m = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, c->fd(), 0);
    memset(m, 0xff, 16);
    CHECK(shm_channel::attach(dup(c->fd()), ring) == nullptr);
    munmap(m, 4096);
    // the created memfd cannot be shrunk by its creator either
    auto d = shm_channel::create(ring);
    CHECK(ftruncate(d->fd(), 4096) != 0);
}

// a hostile client scribbles over the control page while the server reads and writes:
// every call ends, with data or with false, and nothing reads or writes outside the mapping
static void test_hostile_peer(uint32_t seed, int rounds, bool in_region = false) {
    std::mt19937 rng(seed);
    int failed = 0, ok = 0;
    for (int round = 0; round < rounds; round++) {
        pair_t p = make_pair(shm_channel::MIN_RING_SIZE, in_region);
        uint8_t * page = in_region ? p.region :
            (uint8_t *)mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, p.client->fd(), 0);
        // some honest traffic first, so positions are not all zero
        std::vector<uint8_t> buf(rng() % 200000 + 1);
        size_t pre = rng() % 70000;
        std::vector<uint8_t> tmp(pre + 1);
        if (pre) {
            std::thread w([&] { p.client->send(tmp.data(), pre, p.sock[0]); });
            p.server->recv(tmp.data(), pre, p.sock[1]);
            w.join();
        }
        int n = rng() % 8 + 1;
        for (int i = 0; i < n; i++) {
            size_t off = rng() % 4096;
            if (rng() % 2) {
                uint64_t v = ((uint64_t)rng() << 32) | rng();
                if (rng() % 2) v = rng() % (3 * shm_channel::MIN_RING_SIZE);
                memcpy(page + (off & ~(size_t)7), &v, sizeof(v));
            } else {
                page[off] = (uint8_t)rng();
            }
        }
        // the hostile side never answers: close its end so waits end
        shutdown(p.sock[0], SHUT_RDWR);
        bool r1 = p.server->recv(buf.data(), buf.size(), p.sock[1]);
        bool r2 = p.server->send(buf.data(), buf.size(), p.sock[1]);
        (r1 && r2) ? ok++ : failed++;
        if (!in_region) {
            munmap(page, 4096);
        }
        close_pair(p);
    }
    printf("hostile peer%s: %d rounds, %d ended in a clean failure, %d completed\n", in_region ? " in a region" : "",
           rounds, failed, ok);
}

// rings are placed in a region only where they fit, at a size the memfd channel accepts too
static void test_region_checks() {
    std::vector<uint8_t> small(shm_channel_file_size(shm_channel::MIN_RING_SIZE) - 1);
    CHECK(shm_channel::over_region(small.data(), small.size(), shm_channel::MIN_RING_SIZE, false, true) == nullptr);
    std::vector<uint8_t> region(shm_channel_file_size(shm_channel::MIN_RING_SIZE));
    CHECK(shm_channel::over_region(region.data(), region.size(), shm_channel::MIN_RING_SIZE + 1, false, true) == nullptr);
    CHECK(shm_channel::over_region(region.data(), region.size(), 1024, false, true) == nullptr);
    CHECK(shm_channel::over_region(region.data(), region.size(), (size_t)1 << 40, false, true) == nullptr);
    CHECK(shm_channel::over_region(region.data(), region.size(), shm_channel::MIN_RING_SIZE, false, true) != nullptr);
}

// Generated inputs against the position checks, fast enough for millions: the hostile side writes
// a random write position (ring 0, which the server reads) or read position (ring 1, which the
// server writes) and random payload bytes, and the server's call must succeed exactly when the
// position is consistent. Cases that would only wait (no data, a full ring) are not generated.
static constexpr size_t RING0_CTL = 256, RING1_CTL = 768, HEAD = 0, TAIL = 64;

static uint64_t fuzz_positions(uint64_t cases, uint32_t seed) {
    std::mt19937_64 rng(seed);
    const size_t ring = shm_channel::MIN_RING_SIZE;
    std::vector<uint8_t> buf(2 * ring);
    uint64_t refused = 0;
    pair_t p = make_pair(ring);
    uint8_t * map = nullptr;
    auto remap = [&] {
        if (map) munmap(map, shm_channel_file_size(ring));
        map = (uint8_t *)mmap(nullptr, shm_channel_file_size(ring), PROT_READ | PROT_WRITE, MAP_SHARED, p.client->fd(), 0);
    };
    remap();
    for (uint64_t i = 0; i < cases; i++) {
        auto u64 = [&](size_t off) { return (std::atomic<uint64_t> *)(map + off); };
        uint64_t pick = rng() % 4;
        uint64_t delta = pick == 0 ? rng() : pick == 1 ? rng() % (ring + 1) : pick == 2 ? ring + 1 + rng() % ring : (uint64_t)-(int64_t)(rng() % ring + 1);
        for (int k = 0; k < 4; k++) {
            map[4096 + rng() % (2 * ring)] = (uint8_t)rng();
        }
        bool ok, expect;
        if (rng() % 2) {  // the server reads ring 0: the peer claims `delta` bytes are waiting
            uint64_t tail = u64(RING0_CTL + TAIL)->load();
            if (delta == 0) continue;
            u64(RING0_CTL + HEAD)->store(tail + delta);
            expect = delta <= ring;
            size_t n = expect ? (size_t)(rng() % delta + 1) : (size_t)(rng() % ring + 1);
            ok = p.server->recv(buf.data(), n, p.sock[1]);
        } else {  // the server writes ring 1: the peer claims it has read up to head - used
            uint64_t head = u64(RING1_CTL + HEAD)->load();
            uint64_t used = delta;
            if (used == ring) continue;
            u64(RING1_CTL + TAIL)->store(head - used);
            expect = used < ring;
            size_t n = expect ? (size_t)(rng() % (ring - used) + 1) : (size_t)(rng() % ring + 1);
            ok = p.server->send(buf.data(), n, p.sock[1]);
        }
        CHECK(ok == expect);
        if (!ok) {
            refused++;
            close_pair(p);
            p = make_pair(ring);  // a connection the server gave up on is closed, as the transport does
            remap();
        }
        if (failures > 10) break;
    }
    munmap(map, shm_channel_file_size(ring));
    close_pair(p);
    return refused;
}

int main(int argc, char ** argv) {
    if (argc > 2 && strcmp(argv[1], "fuzz") == 0) {
        uint64_t cases = strtoull(argv[2], nullptr, 10);
        uint64_t refused = fuzz_positions(cases, argc > 3 ? (uint32_t)atoi(argv[3]) : 1);
        printf("fuzz: %llu generated cases, %llu refused as corrupt, %d unexpected results\n",
               (unsigned long long)cases, (unsigned long long)refused, failures);
        return failures ? 1 : 0;
    }
    int rounds = argc > 1 ? atoi(argv[1]) : 300;
    test_stream(shm_channel::MIN_RING_SIZE, 5 * 1024 * 1024 + 7, 1);
    test_stream(1 << 20, 3 * 1024 * 1024 + 13, 2);
    test_peer_death();
    test_attach_checks();
    test_hostile_peer(3, rounds);
    test_stream(shm_channel::MIN_RING_SIZE, 3 * 1024 * 1024 + 5, 4, true);
    test_stream(1 << 20, 3 * 1024 * 1024 + 13, 5, true);
    test_peer_death(true);
    test_hostile_peer(6, rounds / 3 + 1, true);
    test_region_checks();
    if (failures) {
        printf("%d checks failed\n", failures);
        return 1;
    }
    printf("all shm channel checks passed\n");
    return 0;
}
