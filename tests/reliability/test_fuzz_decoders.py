"""A few thousand generated inputs per decoder an attacker can reach (the full million per decoder is
`benchmarks/fuzz_decoders.py`, reported in docs/reliability.md): each decodes or is refused with the
decoder's own error, never another exception, never slowly. A fixed seed keeps CI reproducible; a
finding prints the input to replay."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fuzz_decoders.py"


def _fuzzer():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("fuzz_decoders", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("fuzz_decoders", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("target", ["apir", "rpc"])
def test_decoder_refuses_every_bad_input_cleanly(target: str) -> None:
    result = _fuzzer().run(target, count=4000, seed=20261123, slow=2.0)
    assert result["inputs"] == 4000
    assert result["findings"] == 0, result["examples"]


def test_the_fuzzer_notices_a_decoder_that_breaks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness itself: an exception other than the clean refusal is counted as a finding."""
    fuzz = _fuzzer()
    from apirctl.remoting import rpc_client

    def broken(sock):  # type: ignore[no-untyped-def]
        raise IndexError("out of range")

    monkeypatch.setattr(rpc_client, "hello", broken)
    result = fuzz.run("rpc", count=50, seed=1)
    assert result["findings"] == 50 and "IndexError probe" in result["kinds"]
