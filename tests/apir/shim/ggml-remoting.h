// Stand-in for the frontend's ggml-remoting.h when the harness compiles upstream's frontend graph
// serializer (apir_cs_ggml-rpc-front.cpp) without the virtio-gpu device code around it. The real
// header maps a guest buffer to its host handle and base through the remoting buffer context; here
// every buffer maps to one fixed handle (HARNESS_HOST_HANDLE) and its own base address.
#pragma once

#include "ggml-backend-impl.h"

#include <cstdint>

#define HARNESS_HOST_HANDLE 0xABCDEF000ULL

struct harness_buffer_context {
    void *   base;
    uint64_t host_handle;
};

harness_buffer_context * harness_context_of(ggml_backend_buffer_t buffer);

#define BUFFER_TO_GGML_CONTEXT(name) (harness_context_of(name))
#define BUFFER_TO_HOST_HANDLE(name)  (harness_context_of(name)->host_handle)
