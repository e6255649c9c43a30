"""Fixtures for the model store tests: real GGUF bytes, the local registry, empty foreign stores."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.support.model_sources import Handler, Registry, write_gguf


@pytest.fixture(scope="session")
def gguf_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., bytes]:
    """Bytes of a real GGUF; different `name`s give different files (and digests)."""
    folder = tmp_path_factory.mktemp("gguf")
    made: dict[tuple[str, int], bytes] = {}

    def make(name: str = "tiny", payload_kb: int = 256) -> bytes:
        key = (name, payload_kb)
        if key not in made:
            made[key] = write_gguf(folder / f"{name}-{payload_kb}.gguf", name=name,
                                   payload_kb=payload_kb).read_bytes()
        return made[key]

    return make


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[Registry]:
    """The local registry, with apirctl pointed at it (and at no real AI Lab or RamaLama store)."""
    reg = Registry()
    handler = type("BoundHandler", (Handler,), {"registry": reg})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    reg.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("APIRCTL_HF_ENDPOINT", reg.url)
    monkeypatch.setenv("APIRCTL_OLLAMA_REGISTRY", reg.url)
    try:
        yield reg
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(autouse=True)
def no_foreign_stores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Discovery looks at empty AI Lab / RamaLama / Ollama folders unless a test fills them."""
    monkeypatch.setenv("APIRCTL_AILAB_DIR", str(tmp_path / "ailab-models"))
    monkeypatch.setenv("APIRCTL_RAMALAMA_STORE", str(tmp_path / "ramalama"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama-models"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no login, no cache of the developer's
    for name in ("HF_TOKEN", "HF_ENDPOINT", "HF_HUB_CACHE", "HF_TOKEN_PATH", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
