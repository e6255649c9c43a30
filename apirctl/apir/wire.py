"""The APIR wire format: a little-endian stream of fixed-size fields, no tags, no lengths.

Rules (from upstream's `apir_cs.h`, in our words): every field occupies a multiple of 4 bytes;
8-, 16- and 32-bit integers and bools take 4 (the value in the low bytes, the rest zero in our
encoder); 64-bit integers, `size_t` and handles take 8; arrays are written back to back; a string
is a uint64 length (counting its NUL) followed by its bytes padded to 4; a blob is its bytes padded
to 4. Structs (`apir_rpc_tensor`, `ggml_tensor`) are copied as their C memory image.

Upstream's decoder never fails: reading past the end sets a sticky `fatal` flag and yields zeros.
Ours raises `ApirDecodeError` with the offset by default; `Decoder(strict=False)` reproduces the flag
behaviour, for side-by-side comparison with the C code.
"""

from __future__ import annotations

import builtins
import struct


class ApirDecodeError(ValueError):
    """A message ended early or held an impossible value; `offset` is where decoding stopped."""

    def __init__(self, message: str, offset: int) -> None:
        super().__init__(f"{message} (at byte {offset})")
        self.offset = offset


def padded(size: int) -> int:
    """Bytes a blob of `size` bytes occupies on the wire."""
    return (size + 3) & ~3


_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_U64 = struct.Struct("<Q")

U64_MAX = (1 << 64) - 1
U32_MAX = (1 << 32) - 1


class Encoder:
    """Appends fields to a growing buffer (upstream writes into a fixed one; see `fits`)."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def __len__(self) -> int:
        return len(self.buf)

    def getvalue(self) -> bytes:
        return bytes(self.buf)

    def fits(self, capacity: int) -> bool:
        """Whether the message fits a fixed command buffer of `capacity` bytes, as upstream's does."""
        return len(self.buf) <= capacity

    def raw(self, data: bytes | bytearray | memoryview, size: int | None = None) -> None:
        """Write `data` into a slot of `size` bytes (default: its length), zero-filled after it."""
        n = len(data) if size is None else size
        if len(data) > n:
            raise ValueError(f"{len(data)} bytes do not fit a {n}-byte slot")
        self.buf += data
        self.buf += bytes(n - len(data))

    def u8(self, value: int) -> None:
        self.raw(bytes((_check(value, 0, 0xFF),)), 4)

    def bool(self, value: builtins.bool) -> None:
        self.raw(b"\x01" if value else b"\x00", 4)

    def u32(self, value: int) -> None:
        self.buf += _U32.pack(_check(value, 0, U32_MAX))

    def i32(self, value: int) -> None:
        self.buf += _I32.pack(_check(value, -(1 << 31), (1 << 31) - 1))

    def u64(self, value: int) -> None:
        self.buf += _U64.pack(_check(value, 0, U64_MAX))

    size = u64
    handle = u64
    array_size = u64

    def u64_array(self, values: list[int]) -> None:
        for v in values:
            self.u64(v)

    def blob(self, data: bytes | bytearray | memoryview) -> None:
        self.raw(data, padded(len(data)))

    def string(self, text: str | bytes) -> None:
        """Length (NUL included) then the NUL-terminated bytes, padded to 4."""
        data = text.encode() if isinstance(text, str) else bytes(text)
        if b"\x00" in data:
            raise ValueError("a string on the wire cannot contain NUL")
        self.array_size(len(data) + 1)
        self.blob(data + b"\x00")


def _check(value: int, lo: int, hi: int) -> int:
    if not lo <= value <= hi:
        raise ValueError(f"{value} is outside [{lo}, {hi}]")
    return value


class Decoder:
    """Reads fields from a buffer without copying it; never reads outside `[start, end)`."""

    def __init__(self, data: bytes | bytearray | memoryview, strict: bool = True) -> None:
        self.view = memoryview(data).cast("B")
        self.pos = 0
        self.strict = strict
        self.fatal = False

    @property
    def remaining(self) -> int:
        return len(self.view) - self.pos

    def _take(self, size: int, what: str) -> memoryview | None:
        if size < 0 or size > self.remaining:
            if self.strict:
                raise ApirDecodeError(f"{what}: needs {size} bytes, {self.remaining} left", self.pos)
            self.fatal = True
            return None
        out = self.view[self.pos : self.pos + size]
        self.pos += size
        return out

    def fail(self, message: str) -> None:
        """A value that cannot be right: raise, or set the flag in compatibility mode."""
        if self.strict:
            raise ApirDecodeError(message, self.pos)
        self.fatal = True

    def raw(self, size: int, what: str = "bytes") -> memoryview:
        """A zero-copy view of the next `size` bytes (upstream's `use_inplace`)."""
        got = self._take(size, what)
        return got if got is not None else memoryview(bytes(max(size, 0)))

    def _int(self, fmt: struct.Struct, slot: int, what: str) -> int:
        got = self._take(slot, what)
        if got is None:
            return 0
        return int(fmt.unpack_from(got, 0)[0])

    def u8(self) -> int:
        got = self._take(4, "uint8")
        return 0 if got is None else got[0]

    def bool(self) -> builtins.bool:
        got = self._take(4, "bool")
        return False if got is None else got[0] != 0

    def u32(self) -> int:
        return self._int(_U32, 4, "uint32")

    def i32(self) -> int:
        return self._int(_I32, 4, "int32")

    def u64(self) -> int:
        return self._int(_U64, 8, "uint64")

    size = u64
    handle = u64

    def array_size(self, expected: int | None = None) -> int:
        """A uint64 element count; with `expected`, a mismatch is an error (upstream's check)."""
        n = self.u64()
        if expected is not None and n != expected:
            self.fail(f"array size {n} where {expected} was expected")
            return 0
        return n

    def u64_array(self, count: int) -> list[int]:
        return [self.u64() for _ in range(count)] if self._room(count * 8, "uint64 array") else []

    def _room(self, size: int, what: str) -> builtins.bool:
        if size > self.remaining:
            self._take(size, what)  # raises, or sets the flag
            return False
        return True

    def blob(self, size: int) -> memoryview:
        got = self._take(padded(size), "blob")
        if got is None:
            return memoryview(bytes(size))
        return got[:size]

    def string(self) -> str:
        """A length-prefixed string; like upstream, the text ends at the first NUL."""
        size = self.u64()
        if size == 0:
            self.fail("string of length 0 (the NUL is always counted)")
            return ""
        if not self._room(padded(size), "string"):
            return ""
        data = bytes(self.blob(size)[: size - 1])
        return data.split(b"\x00", 1)[0].decode("utf-8", errors="replace")
