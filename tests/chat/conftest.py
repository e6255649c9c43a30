"""A real llama-server on the loopback, started from the llama.cpp build with the demo model.

The chat tests talk to it exactly as users do (`apirctl chat --url`), so there is no fake
server anywhere: streaming, timings, errors and Ctrl-C are llama-server's own behaviour.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from chat_helpers import LlamaServer, start_llama_server, stop, wait_ready


@pytest.fixture(scope="session")
def llama_server(llama_build: Any, demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """One llama-server for the chat tests of this session."""
    server = start_llama_server(llama_build, demo_model, tmp_path_factory.mktemp("llama-server") / "server.log")
    try:
        wait_ready(server)
        yield server
    finally:
        stop(server)
