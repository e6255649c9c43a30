"""A backend's reads answered in one call (llama_patches 0028, EXT_TENSORS_GET), against the real backend
library.

A state save reads a layer's K and V each; the frontend keeps the reads until its backend's synchronize
and sends them as one EXT_TENSORS_GET: `Write` records read the other way, at offset 0 of the request's
resource, each `size` bytes of a tensor at `offset` copied to `data_offset` of the resource. The host
checks every read before it makes any: a batch with one bad read is an error and copies nothing.
"""

from __future__ import annotations

import dataclasses

import pytest

from apirctl.apir import extensions
from apirctl.apir.session import BackendProcess
from apirctl.apir.tensor import RpcTensor, Tensor

pytestmark = pytest.mark.integration

Libs = tuple  # (backend library, GGML library, registration symbol)
DATA_AT = 4096  # past the records of a few reads
FILL = b"\xee"


def _session(proc: BackendProcess, libs: Libs, wanted: int) -> int:
    """A session granted `wanted`, with a 4 KiB buffer whose first two tensors hold known bytes."""
    assert proc.initialize(*libs) == 6
    assert proc.negotiate(wanted) == wanted
    buft = int(proc.call("device_get_buffer_type")[0]["buft"])
    buffer = int(proc.call("buffer_type_alloc_buffer", buft=buft, size=4096)[0]["buffer"])
    for t, data in ((_k(buffer), bytes(range(256))), (_v(buffer), bytes(255 - i for i in range(256)))):
        res = proc.shmem(len(data))
        proc.shmem_write(res, data)
        proc.call("buffer_set_tensor", buffer=buffer, tensor=t.to_rpc(), res_id=res, offset=0, size=len(data))
    return buffer


def _k(buffer: int) -> Tensor:
    return Tensor((64,), name="k", buffer=buffer, offset=256)


def _v(buffer: int) -> Tensor:
    return Tensor((64,), name="v", buffer=buffer, offset=1024)


def _get(proc: BackendProcess, buffer: int, reads: list[tuple[RpcTensor, int, int, int]],
         res_size: int = 8192, n_reads: int | None = None) -> tuple[int, bytes]:
    """One EXT_TENSORS_GET of (tensor, offset, size, data_offset) reads into a resource filled with FILL:
    (the dispatcher's return code, the resource's bytes after it)."""
    records = extensions.encode_writes([extensions.Write(buffer, t, off, size, at) for t, off, size, at in reads],
                                       wide=proc.wide_tensors)
    res = proc.shmem(res_size)
    proc.shmem_write(res, FILL * res_size)
    proc.shmem_write(res, records)
    request = extensions.TensorsGet(res, len(reads) if n_reads is None else n_reads).encode()
    ret, _reply, _ = proc.dispatch_raw(extensions.TENSORS_GET, request, name="ext_tensors_get")
    return ret, proc.shmem_read(res, res_size)


@pytest.mark.parametrize("wanted", [extensions.FEATURES, extensions.FEATURE_GRAPH_RUN | extensions.FEATURE_TENSORS_GET])
def test_reads_of_several_tensors_come_back_in_one_call(backend_libs: Libs, wanted: int) -> None:
    """Whole tensors and parts of them, in the wide records and the narrow ones, each where it was asked."""
    with BackendProcess() as proc:
        buffer = _session(proc, backend_libs, wanted)
        k, v = _k(buffer).to_rpc(), _v(buffer).to_rpc()
        ret, data = _get(proc, buffer, [(k, 0, 256, DATA_AT), (v, 64, 100, DATA_AT + 512), (k, 255, 1, 8000)])
        assert ret == 0
        assert data[DATA_AT:DATA_AT + 256] == bytes(range(256))
        assert data[DATA_AT + 512:DATA_AT + 612] == bytes(255 - i for i in range(64, 164))
        assert data[8000:8001] == b"\xff"
        # nothing else of the resource was written
        assert data[DATA_AT + 256:DATA_AT + 512] == FILL * 256 and data[DATA_AT + 612:8000] == FILL * (8000 - 4708)


def test_every_refused_batch_copies_nothing(backend_libs: Libs) -> None:
    """A bad read anywhere in the batch refuses the call before any read is made; the session goes on."""
    with BackendProcess() as proc:
        buffer = _session(proc, backend_libs, extensions.FEATURES)
        k, v = _k(buffer).to_rpc(), _v(buffer).to_rpc()
        good = (k, 0, 256, DATA_AT)
        outside = Tensor((64,), name="outside", buffer=buffer, offset=4096 - 128).to_rpc()
        for name, bad in (("past the tensor", (v, 64, 256, DATA_AT + 512)),
                          ("an offset that wraps the size", (v, (1 << 64) - 8, 16, DATA_AT + 512)),
                          ("past the resource", (v, 0, 256, 8192 - 255)),
                          ("a data offset that wraps", (v, 0, 256, (1 << 64) - 128)),
                          ("a tensor past its buffer", (outside, 0, 16, DATA_AT + 512)),
                          ("an unknown buffer", (dataclasses.replace(v, buffer=buffer + 1), 0, 16, DATA_AT + 512))):
            ret, data = _get(proc, buffer, [good, bad])
            assert ret != 0, name
            assert data[DATA_AT:] == FILL * (8192 - DATA_AT), name
        # counts the host does not take, and records past the resource
        for n_reads, res_size in ((0, 8192), (extensions.MAX_READS + 1, 1 << 20), (40, 8192)):
            ret, data = _get(proc, buffer, [good], res_size=res_size, n_reads=n_reads)
            assert ret != 0, n_reads
            assert data[DATA_AT:DATA_AT + 256] == FILL * 256, n_reads
        ret, data = _get(proc, buffer, [good])
        assert ret == 0 and data[DATA_AT:DATA_AT + 256] == bytes(range(256))
        # a freed buffer is an unknown one
        proc.call("buffer_free_buffer", buffer=buffer)
        ret, data = _get(proc, buffer, [good])
        assert ret != 0 and data[DATA_AT:DATA_AT + 256] == FILL * 256
