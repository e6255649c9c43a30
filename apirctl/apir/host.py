"""The host side of APIR in-process: load the backend library with ctypes and call its C ABI.

This stands in for virglrenderer's APIR component: it answers the library's two callbacks
(`get_config` for the GGML library path and registration symbol, `get_shmem_ptr` for shared
resources, which we allocate with mmap in place of virtio-gpu blobs) and calls
`apir_backend_dispatcher` with a command buffer and a reply buffer. A crash here kills the process,
so apirctl only uses this class inside a child process (see `session`).
"""

from __future__ import annotations

import ctypes
import mmap
import time
from pathlib import Path

from apirctl.apir import protocol

GET_CONFIG = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_uint32, ctypes.c_char_p)
GET_SHMEM_PTR = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32)
#: `apir_shmem_size_fn`: what apirctl's library asks to bound every transfer by its resource.
GET_SHMEM_SIZE = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint32)


class Callbacks(ctypes.Structure):
    """`struct virgl_apir_callbacks`."""

    _fields_ = [("get_config", GET_CONFIG), ("get_shmem_ptr", GET_SHMEM_PTR)]


class Host:
    """One loaded backend library and its shared resources."""

    def __init__(self, library: Path, ggml_library: Path | None, reg: str | None, ctx_id: int = 1,
                 reply_size: int = 1 << 16) -> None:
        self.lib = ctypes.CDLL(str(library), mode=ctypes.RTLD_LOCAL)
        self.ctx_id = ctx_id
        self._config: dict[bytes, ctypes.Array[ctypes.c_char]] = {}
        if ggml_library is not None:
            self._config[protocol.CONFIG_LIBRARY_PATH.encode()] = ctypes.create_string_buffer(
                str(ggml_library).encode())
        if reg is not None:
            self._config[protocol.CONFIG_LIBRARY_REG.encode()] = ctypes.create_string_buffer(reg.encode())
        self.shmem: dict[int, mmap.mmap] = {}
        self._addr: dict[int, int] = {}
        self._cb_config = GET_CONFIG(self._get_config)
        self._cb_shmem = GET_SHMEM_PTR(self._get_shmem_ptr)
        self.callbacks = Callbacks(self._cb_config, self._cb_shmem)
        self._cb_size = GET_SHMEM_SIZE(self._get_shmem_size)
        # apirctl's library (llama_patches) takes the resources' sizes; upstream's has no such entry
        register = getattr(self.lib, "apir_backend_set_shmem_size_callback", None)
        if register is not None:
            register.restype = None
            register.argtypes = [GET_SHMEM_SIZE]
            register(self._cb_size)

        self.lib.apir_backend_initialize.restype = ctypes.c_uint32
        self.lib.apir_backend_initialize.argtypes = [ctypes.c_uint32, ctypes.POINTER(Callbacks)]
        self.lib.apir_backend_deinit.restype = None
        self.lib.apir_backend_deinit.argtypes = [ctypes.c_uint32]
        self.lib.apir_backend_dispatcher.restype = ctypes.c_uint32
        self.lib.apir_backend_dispatcher.argtypes = [
            ctypes.c_uint32, ctypes.POINTER(Callbacks), ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
        self.reply = ctypes.create_string_buffer(reply_size)

    def _get_config(self, ctx_id: int, key: bytes | None) -> int | None:
        buf = self._config.get(key or b"")
        return ctypes.addressof(buf) if buf is not None else None

    def _get_shmem_ptr(self, ctx_id: int, res_id: int) -> int | None:
        return self._addr.get(res_id)

    def _get_shmem_size(self, ctx_id: int, res_id: int) -> int:
        mem = self.shmem.get(res_id)
        return len(mem) if mem is not None else 0

    # ---- shared resources (virtio-gpu blobs in the real system) ----

    def shmem_alloc(self, res_id: int, size: int) -> None:
        if res_id in self.shmem:
            raise ValueError(f"resource {res_id} exists")
        mem = mmap.mmap(-1, max(size, 1))
        self.shmem[res_id] = mem
        self._addr[res_id] = ctypes.addressof(ctypes.c_char.from_buffer(mem))

    def shmem_write(self, res_id: int, offset: int, data: bytes) -> None:
        self.shmem[res_id][offset : offset + len(data)] = data

    def shmem_read(self, res_id: int, offset: int, size: int) -> bytes:
        return self.shmem[res_id][offset : offset + size]

    # ---- the library's ABI ----

    def initialize(self) -> int:
        return int(self.lib.apir_backend_initialize(self.ctx_id, ctypes.byref(self.callbacks)))

    def deinit(self) -> None:
        self.lib.apir_backend_deinit(self.ctx_id)

    def dispatch(self, cmd_type: int, request: bytes, repeat: int = 1, reply_limit: int | None = None,
                 ) -> tuple[int, bytes, list[int], int]:
        """Call the dispatcher `repeat` times with `request`.

        Returns (return code, reply bytes, ns per call, overrun). The request is copied into a command
        buffer exactly its size, so the library sees the end pointer the real system would give it.
        `reply_limit` shrinks the reply area the library is told about; the bytes after it are filled
        with a canary, and `overrun` counts those the library wrote over anyway.
        """
        cmd = ctypes.create_string_buffer(request, max(len(request), 1))
        start = ctypes.addressof(cmd)
        end = start + len(request)
        rstart = ctypes.addressof(self.reply)
        limit = len(self.reply) if reply_limit is None else min(reply_limit, len(self.reply) // 2)
        rend = rstart + limit
        if reply_limit is not None:
            ctypes.memset(rstart, _CANARY, len(self.reply))
        after = ctypes.c_void_p(0)
        times: list[int] = []
        ret = 0
        for _ in range(repeat):
            after.value = rstart
            t0 = time.perf_counter_ns()
            ret = self.lib.apir_backend_dispatcher(self.ctx_id, ctypes.byref(self.callbacks), cmd_type,
                                                   start, end, rstart, rend, ctypes.byref(after))
            times.append(time.perf_counter_ns() - t0)
        used = (after.value or rstart) - rstart
        overrun = 0
        if reply_limit is not None:
            changed = [i for i, b in enumerate(self.reply.raw[limit:]) if b != _CANARY]
            overrun = max(changed[-1] + 1 if changed else 0, used - limit)
        used = max(0, min(used, limit))
        return int(ret), self.reply.raw[:used], times, overrun


_CANARY = 0xCC
