// An asynchronous ggml backend made of ggml-cpu, for apir-host to run a GPU's way on a CPU.
//
// ggml-cpu is synchronous (caps.async false): apir-host waits for nothing, and what it does for an
// asynchronous backend (copies on the backend's stream, a graph run answered while its compute still
// runs: llama_patches 0030) never runs on it. This library registers one device, "AsyncCPU", that
// computes with ggml-cpu's device 0 on one worker thread of its own, in order, as a GPU's stream does:
//
//   - graph_compute queues a copy of the graph (a GPU reads the graph when it is launched; the caller
//     may change or free it after the call) and returns; the worker sleeps ASYNC_CPU_DELAY_MS (default
//     2) milliseconds, then computes it, so that a compute is reliably still running when the host's
//     next command arrives;
//   - set_tensor_async and get_tensor_async queue their copies, event_record queues a marker;
//   - synchronize waits until the worker has run everything queued, event_synchronize until the marker.
//
// Its buffers wrap ggml-cpu's, and count every call the host makes on them (get_base aside) while the
// worker still has work, queued or running: the host read, wrote or freed memory under a compute. With
// ASYNC_CPU_FROM_PTR=1 the device also wraps memory it is given (buffer_from_host_ptr, in a buffer type
// of its own, as ggml-metal's mapped buffers): the frontend's shared buffers, which the client reads
// and writes in place.
//
// At the backend's free, or when the library is unloaded (apir-host unloads it when its client ends,
// and never frees the backend), it writes one line to stderr, which apir-host's sandbox leaves open:
//
//   async-cpu: computes=N overlapped=M ahead=A unsafe=K failed=F
//
// computes: graphs computed; overlapped: computes queued while an earlier one was still queued or
// running; ahead: event waits that returned with a compute still queued or running (apir-host waits
// for a run's writes so, and answers the run); unsafe: the calls above; failed: computes that did not
// succeed.
//
// tests/remoting/test_apir_run_ahead.py builds it against the build's ggml and runs apir-host over it
// (--ggml-library, --ggml-reg ggml_backend_async_cpu_reg).

#include "ggml-backend-impl.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>

namespace {

// --- what is counted -----------------------------------------------------------------------------

std::atomic<unsigned long> n_computes{ 0 };
std::atomic<unsigned long> n_overlapped{ 0 };
std::atomic<unsigned long> n_ahead{ 0 };
std::atomic<unsigned long> n_unsafe{ 0 };
std::atomic<unsigned long> n_failed{ 0 };
// on every worker: the computes queued or running, and all the work (computes, copies, markers)
std::atomic<int>           computes_in_flight{ 0 };
std::atomic<int>           work_in_flight{ 0 };
std::atomic<bool>          reported{ false };

void report() {
    if (!reported.exchange(true)) {
        fprintf(stderr, "async-cpu: computes=%lu overlapped=%lu ahead=%lu unsafe=%lu failed=%lu\n",
                n_computes.load(), n_overlapped.load(), n_ahead.load(), n_unsafe.load(), n_failed.load());
        fflush(stderr);
    }
}

// a call on a buffer while the worker has work: the first few are named
void check_access(const char * what) {
    if (work_in_flight.load() > 0 && n_unsafe.fetch_add(1) < 5) {
        fprintf(stderr, "async-cpu: %s while the worker has work queued or running\n", what);
        fflush(stderr);
    }
}

// --- a copy of a graph, which the worker computes later ------------------------------------------

struct graph_copy {
    ggml_context *                                              ctx   = nullptr;
    ggml_cgraph *                                               graph = nullptr;
    std::deque<ggml_tensor>                                     tensors;  // stable addresses
    std::unordered_map<const ggml_tensor *, ggml_tensor *>      copies;

    explicit graph_copy(ggml_cgraph * from) {
        const int         n      = ggml_graph_n_nodes(from);
        const size_t      size   = n > 0 ? (size_t) n : 1;
        ggml_init_params  params = { ggml_graph_overhead_custom(size, false), nullptr, true };
        ctx                      = ggml_init(params);
        graph                    = ggml_new_graph_custom(ctx, size, false);
        for (int i = 0; i < n; i++) {
            ggml_graph_add_node(graph, copy_of(ggml_graph_node(from, i)));
        }
    }

    ~graph_copy() { ggml_free(ctx); }

    graph_copy(const graph_copy &)             = delete;
    graph_copy & operator=(const graph_copy &) = delete;

    // the tensor and every tensor it names (sources, the tensor it views), each copied once
    ggml_tensor * copy_of(const ggml_tensor * t) {
        if (t == nullptr) {
            return nullptr;
        }
        auto found = copies.find(t);
        if (found != copies.end()) {
            return found->second;
        }
        tensors.push_back(*t);
        ggml_tensor * copy = &tensors.back();
        copies[t]          = copy;
        copy->view_src     = copy_of(t->view_src);
        for (int s = 0; s < GGML_MAX_SRC; s++) {
            copy->src[s] = copy_of(t->src[s]);
        }
        return copy;
    }
};

// --- the worker: one stream, in order ------------------------------------------------------------

struct worker_event {
    struct worker * recorded_on = nullptr;  // the worker it was last recorded on
    bool            done   = true;
};

struct work_item {
    enum { COMPUTE, COPY, MARK } kind;
    std::unique_ptr<graph_copy> graph;
    void *                      dst   = nullptr;
    const void *                src   = nullptr;
    size_t                      size  = 0;
    worker_event *              event = nullptr;
};

struct worker {
    ggml_backend_t          cpu;
    int                     delay_ms;  // before each compute
    std::mutex              mutex;
    std::condition_variable queued;  // work, or the end
    std::condition_variable ran;     // an item was run
    std::deque<work_item>   queue;
    bool                    running = false;
    bool                    stop    = false;
    std::thread             thread;

    worker(ggml_backend_t cpu, int delay_ms) : cpu(cpu), delay_ms(delay_ms), thread([this] { loop(); }) {}

    ~worker() {
        {
            std::lock_guard<std::mutex> lock(mutex);
            stop = true;
        }
        queued.notify_all();
        thread.join();
        ggml_backend_free(cpu);
    }

    void push(work_item item) {
        {
            std::lock_guard<std::mutex> lock(mutex);
            if (item.kind == work_item::COMPUTE) {
                n_computes++;
                if (computes_in_flight.fetch_add(1) > 0) {
                    n_overlapped++;
                }
            }
            if (item.kind == work_item::MARK) {
                item.event->recorded_on = this;
                item.event->done   = false;
            }
            work_in_flight++;
            queue.push_back(std::move(item));
        }
        queued.notify_one();
    }

    void synchronize() {
        std::unique_lock<std::mutex> lock(mutex);
        ran.wait(lock, [&] { return queue.empty() && !running; });
    }

    void wait_for(worker_event * event) {
        std::unique_lock<std::mutex> lock(mutex);
        ran.wait(lock, [&] { return event->done; });
        if (computes_in_flight.load() > 0) {
            n_ahead++;
        }
    }

    void loop() {
        std::unique_lock<std::mutex> lock(mutex);
        while (true) {
            queued.wait(lock, [&] { return stop || !queue.empty(); });
            if (queue.empty()) {
                return;  // stopped, and everything queued was run
            }
            work_item item = std::move(queue.front());
            queue.pop_front();
            running = true;
            lock.unlock();
            run(item);
            lock.lock();
            running = false;
            if (item.kind == work_item::COMPUTE) {
                computes_in_flight--;
            }
            if (item.kind == work_item::MARK) {
                item.event->done = true;
            }
            work_in_flight--;
            ran.notify_all();
        }
    }

    void run(work_item & item) {
        switch (item.kind) {
            case work_item::COMPUTE:
                {
                    // the host's next command arrives while this compute runs
                    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
                    const ggml_status status = ggml_backend_graph_compute(cpu, item.graph->graph);
                    if (status != GGML_STATUS_SUCCESS) {
                        n_failed++;
                        fprintf(stderr, "async-cpu: a compute failed: %s\n", ggml_status_to_string(status));
                        fflush(stderr);
                    }
                    item.graph.reset();
                    break;
                }
            case work_item::COPY:
                memcpy(item.dst, item.src, item.size);
                break;
            case work_item::MARK:
                break;
        }
    }
};

// the backends alive, which the library's unloading stops (apir-host never frees its backend)
std::mutex live_mutex;
worker *   live[8];

// --- the buffer type: ggml-cpu's buffers, each call checked --------------------------------------

ggml_backend_buffer_type_t cpu_buft() {
    return ggml_backend_dev_buffer_type(ggml_backend_reg_dev_get(ggml_backend_cpu_reg(), 0));
}

ggml_backend_buffer_t inner(ggml_backend_buffer_t buffer) {
    return (ggml_backend_buffer_t) buffer->context;
}

void buffer_free(ggml_backend_buffer_t buffer) {
    check_access("free_buffer");
    ggml_backend_buffer_free(inner(buffer));
}

void * buffer_get_base(ggml_backend_buffer_t buffer) {
    return ggml_backend_buffer_get_base(inner(buffer));
}

ggml_status buffer_init_tensor(ggml_backend_buffer_t buffer, ggml_tensor * tensor) {
    ggml_backend_buffer_t in = inner(buffer);
    return in->iface.init_tensor ? in->iface.init_tensor(in, tensor) : GGML_STATUS_SUCCESS;
}

void buffer_memset_tensor(ggml_backend_buffer_t buffer, ggml_tensor * tensor, uint8_t value, size_t offset,
                          size_t size) {
    check_access("memset_tensor");
    inner(buffer)->iface.memset_tensor(inner(buffer), tensor, value, offset, size);
}

void buffer_set_tensor(ggml_backend_buffer_t buffer, ggml_tensor * tensor, const void * data, size_t offset,
                       size_t size) {
    check_access("set_tensor");
    inner(buffer)->iface.set_tensor(inner(buffer), tensor, data, offset, size);
}

void buffer_get_tensor(ggml_backend_buffer_t buffer, const ggml_tensor * tensor, void * data, size_t offset,
                       size_t size) {
    check_access("get_tensor");
    inner(buffer)->iface.get_tensor(inner(buffer), tensor, data, offset, size);
}

bool buffer_is_ours(ggml_backend_buffer_t buffer);

bool buffer_cpy_tensor(ggml_backend_buffer_t buffer, const ggml_tensor * src, ggml_tensor * dst) {
    GGML_UNUSED(buffer);
    check_access("cpy_tensor");
    if (buffer_is_ours(src->buffer) || ggml_backend_buffer_is_host(src->buffer)) {
        memcpy(dst->data, src->data, ggml_nbytes(src));
        return true;
    }
    return false;
}

void buffer_clear(ggml_backend_buffer_t buffer, uint8_t value) {
    check_access("clear");
    ggml_backend_buffer_clear(inner(buffer), value);
}

const ggml_backend_buffer_i buffer_iface = {
    /* .free_buffer   = */ buffer_free,
    /* .get_base      = */ buffer_get_base,
    /* .init_tensor   = */ buffer_init_tensor,
    /* .memset_tensor = */ buffer_memset_tensor,
    /* .set_tensor    = */ buffer_set_tensor,
    /* .get_tensor    = */ buffer_get_tensor,
    /* .set_tensor_2d = */ nullptr,  // ggml copies row by row through set_tensor
    /* .get_tensor_2d = */ nullptr,
    /* .cpy_tensor    = */ buffer_cpy_tensor,
    /* .clear         = */ buffer_clear,
    /* .reset         = */ nullptr,
};

const char * buft_get_name(ggml_backend_buffer_type_t buft) {
    GGML_UNUSED(buft);
    return "AsyncCPU";
}

ggml_backend_buffer_type buft_async_cpu;

ggml_backend_buffer_t buft_alloc_buffer(ggml_backend_buffer_type_t buft, size_t size) {
    ggml_backend_buffer_t in = ggml_backend_buft_alloc_buffer(cpu_buft(), size);
    if (in == nullptr) {
        return nullptr;
    }
    return ggml_backend_buffer_init(buft, buffer_iface, in, ggml_backend_buffer_get_size(in));
}

size_t buft_get_alignment(ggml_backend_buffer_type_t buft) {
    GGML_UNUSED(buft);
    return ggml_backend_buft_get_alignment(cpu_buft());
}

size_t buft_get_max_size(ggml_backend_buffer_type_t buft) {
    GGML_UNUSED(buft);
    return ggml_backend_buft_get_max_size(cpu_buft());
}

size_t buft_get_alloc_size(ggml_backend_buffer_type_t buft, const ggml_tensor * tensor) {
    GGML_UNUSED(buft);
    return ggml_backend_buft_get_alloc_size(cpu_buft(), tensor);
}

// the buffers of buffer_from_host_ptr, which allocates none
ggml_backend_buffer_type buft_mapped;

const char * buft_mapped_get_name(ggml_backend_buffer_type_t buft) {
    GGML_UNUSED(buft);
    return "AsyncCPU_Mapped";
}

ggml_backend_buffer_t buft_mapped_alloc_buffer(ggml_backend_buffer_type_t buft, size_t size) {
    GGML_UNUSED(buft);
    GGML_UNUSED(size);
    return nullptr;
}

bool buffer_is_ours(ggml_backend_buffer_t buffer) {
    return buffer != nullptr && (buffer->buft == &buft_async_cpu || buffer->buft == &buft_mapped);
}

// --- the backend ---------------------------------------------------------------------------------

worker * worker_of(ggml_backend_t backend) {
    return (worker *) backend->context;
}

const char * backend_get_name(ggml_backend_t backend) {
    GGML_UNUSED(backend);
    return "AsyncCPU";
}

void backend_free(ggml_backend_t backend) {
    worker * w = worker_of(backend);
    w->synchronize();
    {
        std::lock_guard<std::mutex> lock(live_mutex);
        for (worker *& slot : live) {
            if (slot == w) {
                slot = nullptr;
            }
        }
    }
    delete w;
    delete backend;
    report();
}

void backend_set_tensor_async(ggml_backend_t backend, ggml_tensor * tensor, const void * data, size_t offset,
                              size_t size) {
    work_item item{ work_item::COPY, nullptr };
    item.dst  = (char *) tensor->data + offset;
    item.src  = data;
    item.size = size;
    worker_of(backend)->push(std::move(item));
}

void backend_get_tensor_async(ggml_backend_t backend, const ggml_tensor * tensor, void * data, size_t offset,
                              size_t size) {
    work_item item{ work_item::COPY, nullptr };
    item.dst  = data;
    item.src  = (const char *) tensor->data + offset;
    item.size = size;
    worker_of(backend)->push(std::move(item));
}

void backend_synchronize(ggml_backend_t backend) {
    worker_of(backend)->synchronize();
}

ggml_status backend_graph_compute(ggml_backend_t backend, ggml_cgraph * cgraph) {
    worker_of(backend)->push({ work_item::COMPUTE, std::make_unique<graph_copy>(cgraph) });
    return GGML_STATUS_SUCCESS;
}

void backend_event_record(ggml_backend_t backend, ggml_backend_event_t event) {
    work_item item{ work_item::MARK, nullptr };
    item.event = (worker_event *) event->context;
    worker_of(backend)->push(std::move(item));
}

void backend_event_wait(ggml_backend_t backend, ggml_backend_event_t event) {
    // one stream: what it waits for was queued before whatever it queues next
    GGML_UNUSED(backend);
    GGML_UNUSED(event);
}

const ggml_backend_i backend_iface = {
    /* .get_name            = */ backend_get_name,
    /* .free                = */ backend_free,
    /* .set_tensor_async    = */ backend_set_tensor_async,
    /* .get_tensor_async    = */ backend_get_tensor_async,
    /* .set_tensor_2d_async = */ nullptr,
    /* .get_tensor_2d_async = */ nullptr,
    /* .cpy_tensor_async    = */ nullptr,
    /* .synchronize         = */ backend_synchronize,
    /* .graph_plan_create   = */ nullptr,
    /* .graph_plan_free     = */ nullptr,
    /* .graph_plan_update   = */ nullptr,
    /* .graph_plan_compute  = */ nullptr,
    /* .graph_compute       = */ backend_graph_compute,
    /* .event_record        = */ backend_event_record,
    /* .event_wait          = */ backend_event_wait,
    /* .graph_optimize      = */ nullptr,
};

ggml_guid_t backend_guid() {
    static ggml_guid guid = { 0x61, 0x73, 0x79, 0x6e, 0x63, 0x2d, 0x63, 0x70,
                              0x75, 0x2d, 0x74, 0x65, 0x73, 0x74, 0x00, 0x01 };
    return &guid;
}

// "ggml_backend_set_n_threads": apir-host's --threads, for the ggml-cpu backend that computes
void backend_set_n_threads(ggml_backend_t backend, int n_threads) {
    ggml_backend_cpu_set_n_threads(worker_of(backend)->cpu, n_threads);
}

// --- the device and its registration -------------------------------------------------------------

ggml_backend_dev_t cpu_dev() {
    return ggml_backend_reg_dev_get(ggml_backend_cpu_reg(), 0);
}

const char * dev_get_name(ggml_backend_dev_t dev) {
    GGML_UNUSED(dev);
    return "AsyncCPU";
}

const char * dev_get_description(ggml_backend_dev_t dev) {
    GGML_UNUSED(dev);
    return "ggml-cpu on a worker thread (a test's asynchronous backend)";
}

void dev_get_memory(ggml_backend_dev_t dev, size_t * free, size_t * total) {
    GGML_UNUSED(dev);
    ggml_backend_dev_memory(cpu_dev(), free, total);
}

enum ggml_backend_dev_type dev_get_type(ggml_backend_dev_t dev) {
    GGML_UNUSED(dev);
    return GGML_BACKEND_DEVICE_TYPE_GPU;
}

void dev_get_props(ggml_backend_dev_t dev, ggml_backend_dev_props * props) {
    memset(props, 0, sizeof(*props));
    props->name        = dev_get_name(dev);
    props->description = dev_get_description(dev);
    props->type        = dev_get_type(dev);
    dev_get_memory(dev, &props->memory_free, &props->memory_total);
    props->caps.async                = true;
    props->caps.host_buffer          = false;
    const char * from_ptr            = getenv("ASYNC_CPU_FROM_PTR");
    props->caps.buffer_from_host_ptr = from_ptr && strcmp(from_ptr, "1") == 0;
    props->caps.events               = true;
}

ggml_backend_t dev_init_backend(ggml_backend_dev_t dev, const char * params) {
    ggml_backend_t cpu = ggml_backend_dev_init(cpu_dev(), params);
    if (cpu == nullptr) {
        return nullptr;
    }
    const char * delay = getenv("ASYNC_CPU_DELAY_MS");
    worker *     w     = new worker(cpu, delay ? atoi(delay) : 2);
    {
        std::lock_guard<std::mutex> lock(live_mutex);
        for (worker *& slot : live) {
            if (slot == nullptr) {
                slot = w;
                break;
            }
        }
    }
    return new ggml_backend{ backend_guid(), backend_iface, dev, w };
}

ggml_backend_buffer_type_t dev_get_buffer_type(ggml_backend_dev_t dev) {
    GGML_UNUSED(dev);
    return &buft_async_cpu;
}

ggml_backend_buffer_t dev_buffer_from_host_ptr(ggml_backend_dev_t dev, void * ptr, size_t size,
                                               size_t max_tensor_size) {
    GGML_UNUSED(dev);
    GGML_UNUSED(max_tensor_size);
    ggml_backend_buffer_t in = ggml_backend_cpu_buffer_from_ptr(ptr, size);
    return in ? ggml_backend_buffer_init(&buft_mapped, buffer_iface, in, size) : nullptr;
}

bool dev_supports_op(ggml_backend_dev_t dev, const ggml_tensor * op) {
    GGML_UNUSED(dev);
    return ggml_backend_dev_supports_op(cpu_dev(), op);
}

bool dev_supports_buft(ggml_backend_dev_t dev, ggml_backend_buffer_type_t buft) {
    GGML_UNUSED(dev);
    return buft == &buft_async_cpu || buft == &buft_mapped || ggml_backend_dev_supports_buft(cpu_dev(), buft);
}

bool dev_offload_op(ggml_backend_dev_t dev, const ggml_tensor * op) {
    GGML_UNUSED(dev);
    return ggml_backend_dev_offload_op(cpu_dev(), op);
}

ggml_backend_event_t dev_event_new(ggml_backend_dev_t dev) {
    return new ggml_backend_event{ dev, new worker_event };
}

void dev_event_free(ggml_backend_dev_t dev, ggml_backend_event_t event) {
    GGML_UNUSED(dev);
    delete (worker_event *) event->context;
    delete event;
}

void dev_event_synchronize(ggml_backend_dev_t dev, ggml_backend_event_t event) {
    GGML_UNUSED(dev);
    worker_event * e = (worker_event *) event->context;
    if (e->recorded_on != nullptr) {
        e->recorded_on->wait_for(e);
    }
}

const ggml_backend_device_i dev_iface = {
    /* .get_name             = */ dev_get_name,
    /* .get_description      = */ dev_get_description,
    /* .get_memory           = */ dev_get_memory,
    /* .get_type             = */ dev_get_type,
    /* .get_props            = */ dev_get_props,
    /* .init_backend         = */ dev_init_backend,
    /* .get_buffer_type      = */ dev_get_buffer_type,
    /* .get_host_buffer_type = */ nullptr,
    /* .buffer_from_host_ptr = */ dev_buffer_from_host_ptr,
    /* .supports_op          = */ dev_supports_op,
    /* .supports_buft        = */ dev_supports_buft,
    /* .offload_op           = */ dev_offload_op,
    /* .event_new            = */ dev_event_new,
    /* .event_free           = */ dev_event_free,
    /* .event_synchronize    = */ dev_event_synchronize,
};

// The host grants APIR_FEATURE_OP_CLASSES by the registration's name: this device's supports_op and
// get_alloc_size are ggml-cpu's, and so are its rules. (Without the feature the frontend asks the host
// for the size of every new shape, an empty GET_ROWS of a micro-batch without outputs among them, which
// the host refuses.)
const char * reg_get_name(ggml_backend_reg_t reg) {
    GGML_UNUSED(reg);
    return "CPU";
}

size_t reg_get_device_count(ggml_backend_reg_t reg) {
    GGML_UNUSED(reg);
    return 1;
}

ggml_backend_device dev_async_cpu;

ggml_backend_dev_t reg_get_device(ggml_backend_reg_t reg, size_t index) {
    GGML_UNUSED(reg);
    return index == 0 ? &dev_async_cpu : nullptr;
}

void * reg_get_proc_address(ggml_backend_reg_t reg, const char * name) {
    GGML_UNUSED(reg);
    if (strcmp(name, "ggml_backend_set_n_threads") == 0) {
        return (void *) backend_set_n_threads;
    }
    return nullptr;
}

const ggml_backend_reg_i reg_iface = {
    /* .get_name         = */ reg_get_name,
    /* .get_device_count = */ reg_get_device_count,
    /* .get_device       = */ reg_get_device,
    /* .get_proc_address = */ reg_get_proc_address,
};

ggml_backend_reg reg_async_cpu;

// apir-host unloads the library when its client ends, and frees no backend: the workers are stopped
// here (nothing of the library may run once it is gone), and the counts reported
__attribute__((destructor)) void on_unload() {
    for (worker *& slot : live) {
        delete slot;
        slot = nullptr;
    }
    report();
}

}  // namespace

extern "C" ggml_backend_reg_t ggml_backend_async_cpu_reg(void) {
    static bool initialized = false;
    if (!initialized) {
        buft_async_cpu = { { buft_get_name, buft_alloc_buffer, nullptr, buft_get_alignment, buft_get_max_size,
                             buft_get_alloc_size, nullptr, nullptr },
                           &dev_async_cpu, nullptr };
        buft_mapped    = { { buft_mapped_get_name, buft_mapped_alloc_buffer, nullptr, buft_get_alignment,
                             buft_get_max_size, buft_get_alloc_size, nullptr, nullptr },
                           &dev_async_cpu, nullptr };
        dev_async_cpu  = { dev_iface, &reg_async_cpu, nullptr };
        reg_async_cpu  = { GGML_BACKEND_API_VERSION, reg_iface, nullptr };
        initialized    = true;
    }
    return &reg_async_cpu;
}
