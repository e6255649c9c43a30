"""The APIR protocol that the ggml-virtgpu frontend (in the guest) and backend (on the host) speak.

Our own description of it, kept byte-compatible with the pinned llama.cpp source: protocol constants
(`protocol`), the forwarded-function table (`table`), the wire encoder/decoder (`wire`), tensors and
graphs (`tensor`), per-function message codecs (`messages`), the C header generator (`headers`), and a
driver for the real host backend library (`host`, `session`, `selftest`).
"""
