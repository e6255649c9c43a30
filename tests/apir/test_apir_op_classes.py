"""APIR_FEATURE_OP_CLASSES (llama_patches 0020), against the real backend library on the CPU.

The host vouches for the rules its backend's supports_op and get_alloc_size answers follow, so that
the frontend can keep them by op class instead of asking again for every batch size. The bit changes
nothing the host reads: it is granted only when asked for, alongside the others, and the answers it
vouches for are the library's own (checked here on the ops a class stands for: one answer for every
batch size, get_alloc_size ggml_nbytes on the CPU).
"""

from __future__ import annotations

import pytest

from apirctl.apir import extensions
from apirctl.apir.session import BackendProcess
from apirctl.apir.tensor import OP_ADD, Tensor

pytestmark = pytest.mark.integration

Libs = tuple  # (backend library, GGML library, registration symbol)
OP_GET_ROWS, TYPE_I32 = 40, 26  # ggml.h


@pytest.mark.parametrize("wanted, expected", [
    (None, extensions.FEATURE_GRAPH_RUN),  # a frontend from before the request carried them
    (extensions.FEATURE_GRAPH_RUN | extensions.FEATURE_WIDE_TENSORS,
     extensions.FEATURE_GRAPH_RUN | extensions.FEATURE_WIDE_TENSORS),  # this series' 0014-0018 frontend
    (extensions.FEATURE_OP_CLASSES, extensions.FEATURE_OP_CLASSES),
    (extensions.FEATURES, extensions.FEATURES),
])
def test_op_classes_are_granted_only_when_asked(backend_libs: Libs, wanted: int | None, expected: int) -> None:
    with BackendProcess() as proc:
        assert proc.initialize(*backend_libs) == 6
        assert proc.negotiate(wanted) == expected


@pytest.mark.parametrize("batch", [1, 2, 3, 7, 13, 64, 512])
def test_the_answers_a_class_stands_for_do_not_change_with_the_batch(backend_libs: Libs, batch: int) -> None:
    """The CPU host's answers for a served model's ops at any batch size: what the frontend keeps per
    class (supported, and sized as ggml_nbytes) is what the library answers for each size."""
    with BackendProcess() as proc:
        assert proc.initialize(*backend_libs) == 6
        assert proc.negotiate(extensions.FEATURES) == extensions.FEATURES
        buft = proc.call("device_get_buffer_type")[0]["buft"]
        rows = Tensor((576, batch), name="rows")
        add = Tensor((576, batch), op=OP_ADD, src=[rows, Tensor((576, batch), name="residual")], name="add")
        ids = Tensor((batch,), type=TYPE_I32, name="ids")
        get_rows = Tensor((576, batch), op=OP_GET_ROWS, src=[Tensor((576, 49152), name="table"), ids], name="emb")
        for op in (add, get_rows):
            assert proc.call("device_supports_op", op=op)[0]["supported"] is True, op.name
            size = proc.call("buffer_type_get_alloc_size", buft=buft, op=op)[0]["size"]
            assert size == 4 * 576 * batch, op.name
