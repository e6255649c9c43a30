"""A real llama-server on the loopback, started from the llama.cpp build with the demo model.

The chat tests talk to it exactly as users do (`apirctl chat --url`): streaming, timings, errors,
Ctrl-C and what a request's messages become are llama-server's own behaviour. Only the tests of
how an answer is displayed (Markdown) use a scripted server (tests/support/openai_fake.py), because
they need an answer known in advance.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.chat_helpers import LlamaServer, start_llama_server, stop, wait_ready


@pytest.fixture(scope="session")
def llama_server(llama_build: Any, demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """One llama-server for the chat tests of this session; `/slots` shows the last prompt it got."""
    log = tmp_path_factory.mktemp("llama-server") / "server.log"
    server = start_llama_server(llama_build, demo_model, log, show_prompts=True)
    try:
        wait_ready(server)
        yield server
    finally:
        stop(server)
