"""Fuzz the decoders an attacker can reach: generated inputs, each must decode or be refused cleanly.

Targets:
- `apir`: the APIR decoder (`apirctl/apir/wire.py` + `messages.py`): a command header, then every
  forwarded function's request and reply (strict and compatibility mode), the handshake reply, the
  serialized graph (`tensor.deserialize_graph`, with `check`) and `messages.describe`. A clean refusal
  is `ApirDecodeError`.
- `rpc`: the ggml-rpc client's reply parser (`apirctl/remoting/rpc_client.py`): what `probe` reads
  after connecting (HELLO, device count, each device's memory) from a peer that sends the generated
  bytes. A clean refusal is `RpcError`.

Inputs are valid encodings, mutated (bit flips, cut or grown, size fields set to edge values, bytes
inserted or spliced), and plain random bytes; one seed reproduces a run. Any other exception, or one
input taking more than `--slow` seconds, is a finding: printed with its seed, target and input (hex).

    python benchmarks/fuzz_decoders.py --count 1000000 [--targets apir,rpc] [--seed 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from apirctl.apir import messages, protocol, table, tensor  # noqa: E402
from apirctl.apir.table import Kind  # noqa: E402
from apirctl.apir.wire import ApirDecodeError, Encoder  # noqa: E402
from apirctl.remoting import rpc_client  # noqa: E402

EDGES = (0, 1, 2, 3, 4, 7, 8, 0xFF, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 1 << 32, 1 << 40, (1 << 63) - 1,
         1 << 63, (1 << 64) - 1)


# --- generation ---------------------------------------------------------------------------------


def _field_bytes(rng: random.Random, kind: Kind) -> bytes:
    enc = Encoder()
    if kind in (Kind.I32, Kind.STATUS):
        enc.i32(rng.randint(-(1 << 31), (1 << 31) - 1))
    elif kind in (Kind.U32, Kind.RES_ID):
        enc.u32(rng.choice([rng.getrandbits(32), *[e for e in EDGES if e < 1 << 32]]))
    elif kind in (Kind.U8, Kind.BOOL):
        enc.u8(rng.getrandbits(1) if kind is Kind.BOOL else rng.getrandbits(8))
    elif kind in (Kind.SIZE, Kind.HANDLE):
        enc.u64(rng.choice([rng.getrandbits(64), *EDGES]))
    elif kind is Kind.STRING:
        enc.string(bytes(rng.choice(b"abcdefghij_.0123456789") for _ in range(rng.randint(0, 40))))
    elif kind is Kind.RPC_TENSOR:
        return rng.randbytes(tensor.RPC_TENSOR_SIZE)
    else:  # an inline tensor: the raw struct, a handle, a view source and its sources
        return rng.randbytes(tensor.GGML_TENSOR_SIZE + rng.choice([8, 16, 24, 64, 200]))
    return enc.getvalue()


def _graph(rng: random.Random) -> bytes:
    enc = Encoder()
    n_nodes = rng.randint(0, 6)
    enc.u32(n_nodes)
    ids = [rng.getrandbits(64) for _ in range(rng.randint(0, 6))]
    enc.u64_array([rng.choice(ids) if ids and rng.random() < 0.8 else rng.getrandbits(64) for _ in range(n_nodes)])
    enc.u32(len(ids))
    body = b"".join(rng.randbytes(tensor.RPC_TENSOR_SIZE) for _ in ids)
    return enc.getvalue() + body


def mutate(rng: random.Random, data: bytes) -> bytes:
    """One to four mutations of `data`."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.randrange(7)
        if choice == 0 and out:  # flip bits
            i = rng.randrange(len(out))
            out[i] ^= 1 << rng.randrange(8)
        elif choice == 1 and out:  # cut
            del out[rng.randrange(len(out)):]
        elif choice == 2:  # grow
            out += rng.randbytes(rng.randint(1, 64))
        elif choice == 3 and len(out) >= 8:  # a size field at an aligned offset set to an edge value
            i = rng.randrange(0, len(out) - 7, 4)
            value = rng.choice(EDGES)
            small = struct.pack("<I", value & 0xFFFFFFFF) + out[i + 4:i + 8]
            out[i:i + 8] = struct.pack("<Q", value) if rng.random() < 0.5 else small
        elif choice == 4:  # insert
            i = rng.randrange(len(out) + 1)
            out[i:i] = rng.randbytes(rng.randint(1, 16))
        elif choice == 5 and len(out) > 4:  # splice a piece of itself elsewhere
            a = rng.randrange(len(out))
            piece = out[a:a + rng.randint(1, 32)]
            b = rng.randrange(len(out))
            out[b:b + len(piece)] = piece
        else:  # random bytes instead
            out = bytearray(rng.randbytes(rng.randint(0, 96)))
    return bytes(out)


# --- targets ------------------------------------------------------------------------------------

FUNCTIONS = table.functions()


def apir_input(rng: random.Random) -> tuple[str, bytes]:
    kind = rng.randrange(5)
    fn = rng.choice(FUNCTIONS)
    if kind == 0:
        fields, what = fn.request, "request"
    elif kind == 1:
        fields, what = fn.reply, "reply"
    elif kind == 2:
        return "graph", mutate(rng, _graph(rng)) if rng.random() < 0.9 else _graph(rng)
    elif kind == 3:
        header = messages.encode_forward(fn, rng.getrandbits(32), venus_shift=rng.random() < 0.5,
                                         **{f.name: 0 for f in fn.request if f.kind not in
                                            (Kind.STRING, Kind.RPC_TENSOR, Kind.INLINE_TENSOR)}) \
            if all(f.kind not in (Kind.STRING, Kind.RPC_TENSOR, Kind.INLINE_TENSOR) for f in fn.request) else \
            messages.encode_command(protocol.CommandType(rng.choice(list(protocol.CommandType))), 0,
                                    rng.getrandbits(32))
        return "command", mutate(rng, header)
    else:
        return "handshake", mutate(rng, struct.pack("<II", rng.getrandbits(32), rng.getrandbits(32)))
    valid = b"".join(_field_bytes(rng, f.kind) for f in fields)
    return f"{what}:{fn.qualname}", mutate(rng, valid) if rng.random() < 0.9 else valid


def apir_decode(label: str, data: bytes) -> None:
    try:
        if label == "graph":
            graph = tensor.deserialize_graph(data)
            graph.check()
            tensor.deserialize_graph(data, strict=False)
        elif label == "command":
            messages.decode_command(data)
            messages.describe(data)
        elif label == "handshake":
            messages.decode_handshake_reply(protocol.HANDSHAKE_MAGIC if data[:1] != b"\0" else 0, data)
        else:
            what, name = label.split(":", 1)
            decode = messages.decode_request if what == "request" else messages.decode_reply
            for strict in (True, False):
                try:
                    decode(name, data, strict=strict, exact=strict)
                except ApirDecodeError:
                    if not strict:
                        raise
    except ApirDecodeError:
        pass


class _Peer:
    """A socket stand-in: `recv` hands out the generated bytes, `sendall` swallows requests."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def sendall(self, _data: bytes) -> None:
        pass

    def recv(self, n: int) -> bytes:
        chunk = self.data[self.pos:self.pos + n]
        self.pos += len(chunk)
        return chunk


def _rpc_reply(rng: random.Random) -> bytes:
    caps = rpc_client.CAPS_SIZE
    count = rng.choice([0, 1, 2, 3, 255, 256, 1 << 20, 0xFFFFFFFF])
    parts = [struct.pack("<Q", 4 + caps) + bytes([rpc_client.PROTOCOL_MAJOR, rng.randrange(10), rng.randrange(10), 0])
             + rng.randbytes(caps),
             struct.pack("<QI", 4, count)]
    parts += [struct.pack("<QQQ", 16, rng.getrandbits(64), rng.getrandbits(64)) for _ in range(min(count, 4))]
    return b"".join(parts)


def rpc_input(rng: random.Random) -> tuple[str, bytes]:
    valid = _rpc_reply(rng)
    return "probe", mutate(rng, valid) if rng.random() < 0.9 else valid


def rpc_decode(_label: str, data: bytes) -> None:
    """What `rpc_client.probe` does once connected, against a peer that sends `data`."""
    peer: object = _Peer(data)
    try:
        version = rpc_client.hello(peer)  # type: ignore[arg-type]
        if int(version.split(".")[0]) != rpc_client.PROTOCOL_MAJOR:
            return
        count = rpc_client.device_count(peer)  # type: ignore[arg-type]
        for index in range(count):
            rpc_client.device_memory(peer, index)  # type: ignore[arg-type]
    except rpc_client.RpcError:
        pass


TARGETS: dict[str, tuple[Callable[[random.Random], tuple[str, bytes]], Callable[[str, bytes], None]]] = {
    "apir": (apir_input, apir_decode),
    "rpc": (rpc_input, rpc_decode),
}


def run(target: str, count: int, seed: int, slow: float = 1.0) -> dict[str, object]:
    """Fuzz one target with `count` inputs; returns counts and findings (at most 20 kept)."""
    generate, decode = TARGETS[target]
    rng = random.Random(f"{target}:{seed}")
    findings: list[dict[str, str]] = []
    kinds: dict[str, int] = {}
    started = time.monotonic()
    for number in range(count):
        label, data = generate(rng)
        t0 = time.monotonic()
        problem = None
        try:
            decode(label, data)
        except Exception as exc:  # noqa: BLE001 - anything but the clean refusal is a finding
            problem = f"{type(exc).__name__}: {exc}"
        if problem is None and time.monotonic() - t0 > slow:
            problem = f"slow: {time.monotonic() - t0:.2f} s"
        if problem is not None:
            key = problem.split(":")[0] + " " + label.split(":")[0]
            kinds[key] = kinds.get(key, 0) + 1
            if len(findings) < 20:
                findings.append({"input": number, "label": label, "problem": problem[:300], "hex": data[:256].hex()})
    return {"target": target, "inputs": count, "seed": seed, "seconds": round(time.monotonic() - started, 1),
            "findings": sum(kinds.values()), "kinds": kinds, "examples": findings}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1_000_000, help="inputs per target")
    parser.add_argument("--targets", default="apir,rpc")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--slow", type=float, default=1.0, help="seconds one input may take")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    results = [run(target, args.count, args.seed, args.slow) for target in args.targets.split(",")]
    for result in results:
        print(f"{result['target']:5} {result['inputs']:>9} inputs  {result['seconds']:>7} s  "
              f"findings {result['findings']}  {result['kinds'] or ''}")
        for example in result["examples"][:5]:  # type: ignore[index]
            print(f"      #{example['input']} {example['label']}: {example['problem']}\n        {example['hex']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    sys.exit(1 if any(r["findings"] for r in results) else 0)


if __name__ == "__main__":
    main()
