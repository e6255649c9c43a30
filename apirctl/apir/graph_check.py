"""The selftest's graph: out = mul_mat(A, B) + C in float32, laid out in one buffer, with numpy's answer.

ggml's mul_mat(A, B) with A of shape [K, M] and B of shape [K, N] (ggml lists the fastest dimension
first) yields [M, N] where element (m, n) is the dot product of row m of A and row n of B: in numpy
terms `B @ A.T` on row-major arrays A (M x K) and B (N x K).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from apirctl.apir.tensor import FLAG_OUTPUT, OP_ADD, OP_MUL_MAT, Graph, Tensor

if TYPE_CHECKING:
    import numpy as np


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass
class MatmulAddCase:
    k: int
    m: int
    n: int
    align: int
    a: Tensor = field(init=False)
    b: Tensor = field(init=False)
    c: Tensor = field(init=False)
    mm: Tensor = field(init=False)
    out: Tensor = field(init=False)
    scratch: Tensor = field(init=False)
    a_data: np.ndarray = field(init=False)
    b_data: np.ndarray = field(init=False)
    c_data: np.ndarray = field(init=False)
    buffer_size: int = field(init=False)

    def __post_init__(self) -> None:
        k, m, n = self.k, self.m, self.n
        self.a = Tensor((k, m), name="A")
        self.b = Tensor((k, n), name="B")
        self.c = Tensor((m, n), name="C")
        self.mm = Tensor((m, n), op=OP_MUL_MAT, src=[self.a, self.b], name="A*B")
        self.out = Tensor((m, n), op=OP_ADD, src=[self.mm, self.c], name="A*B+C", flags=FLAG_OUTPUT)
        self.scratch = Tensor((k, m), name="copy of A")
        offset = 0
        for t in self.all():
            t.offset = offset
            offset = _align(offset + t.nbytes, self.align)
        self.buffer_size = offset
        import numpy as np  # 0.1-0.2 s of import: only when a selftest runs, not for every command

        rng = np.random.default_rng()  # fresh inputs every run
        self.a_data = rng.standard_normal((m, k), dtype=np.float32)
        self.b_data = rng.standard_normal((n, k), dtype=np.float32)
        self.c_data = rng.standard_normal((n, m), dtype=np.float32)

    def all(self) -> list[Tensor]:
        return [self.a, self.b, self.c, self.mm, self.out, self.scratch]

    @property
    def largest(self) -> int:
        return max(t.nbytes for t in self.all())

    @property
    def graph(self) -> Graph:
        return Graph([self.mm, self.out])

    def place(self, buffer: int) -> None:
        for t in self.all():
            t.buffer = buffer

    def inputs(self) -> list[tuple[Tensor, np.ndarray]]:
        return [(self.a, self.a_data), (self.b, self.b_data), (self.c, self.c_data)]

    def expected(self) -> np.ndarray:
        import numpy as np

        return (self.b_data.astype(np.float64) @ self.a_data.astype(np.float64).T) + self.c_data

    def relative_error(self, out: bytes) -> float:
        import numpy as np

        got = np.frombuffer(out, dtype=np.float32).reshape(self.n, self.m).astype(np.float64)
        ref = self.expected()
        return float(np.max(np.abs(got - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


def matmul_add_case(k: int, m: int, n: int, align: int = 32) -> MatmulAddCase:
    return MatmulAddCase(k, m, n, align)
