"""A vision model served and shown a picture, end to end with real Podman and the real llama-server.

The model is the demo text model with a projector written here (tests/support/vision.py: random
weights, the demo model's embedding size), both as layers of an Ollama store entry, the way a user
has a vision model that `ollama pull` fetched. `serve NAME` mounts the projector and passes
`--mmproj`; `chat --image` and the session's `/image` send a PNG. Random weights make the answer
gibberish, so the test reads the mechanics: llama-server loaded the projector, reports vision, and
the picture took exactly one prompt token per patch of the projector's image.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pexpect
import pytest

from tests.serve.conftest import apirctl, container_exists
from tests.support.chat_helpers import apirctl_command
from tests.support.model_sources import ollama_store, store_files
from tests.support.vision import Projector, text_embedding_length, write_png, write_projector

pytestmark = pytest.mark.integration

ASK = ("--max-tokens", "8", "--temp", "0", "--seed", "3")


def chat_usage(*args: str) -> dict[str, int]:
    """`chat --json` as a script uses it: the server's whole response; its usage."""
    done = apirctl("chat", *args, *ASK, "--json")
    assert done.returncode == 0, done.stderr
    response = json.loads(done.stdout)
    assert response["choices"][0]["message"]["content"] is not None
    return dict(response["usage"])


def test_vision_model_from_an_ollama_store_sees_an_image(podman: str, llama_image: str, demo_model: Path,
                                                         tmp_path: Path, name: str, port: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    geometry = Projector(text_embd=text_embedding_length(demo_model))
    projector = write_projector(tmp_path / "mmproj.gguf", geometry)
    store = tmp_path / "ollama-models"
    layers = ollama_store(store, "registry.ollama.ai", "library", "tiny-vision", "1b",
                          {"model": demo_model, "projector": projector})
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    picture = write_png(tmp_path / "a.png", 48, 32)  # not square: the projector's preprocessing resizes it

    done = apirctl("serve", "tiny-vision:1b", "--transport", "none", "-p", str(port), "-n", name, "--json")
    assert done.returncode == 0, done.stderr
    command = json.loads(subprocess.run(["podman", "inspect", name, "--format", "{{json .Config.Cmd}}"],
                                        capture_output=True, text=True, timeout=60, check=True).stdout)
    mmproj = command[command.index("--mmproj") + 1]
    assert mmproj.startswith("/models/") and mmproj.endswith(".gguf")
    mounts = json.loads(subprocess.run(["podman", "inspect", name, "--format", "{{json .Mounts}}"],
                                       capture_output=True, text=True, timeout=60, check=True).stdout)
    assert {m["Destination"]: Path(m["Source"]) for m in mounts}[mmproj].samefile(layers["projector"])
    log = subprocess.run(["podman", "logs", name], capture_output=True, text=True, timeout=60, check=True)
    assert "loaded multimodal model" in log.stdout + log.stderr

    import httpx

    props = httpx.get(f"http://127.0.0.1:{port}/props", timeout=30).json()
    assert props["modalities"]["vision"] is True

    text_only = chat_usage("--name", name, "describe")
    with_image = chat_usage("--name", name, "--image", str(picture), "describe")
    # the marker in the text becomes the image's embeddings: one token per 16x16 patch of the 64x64 input
    assert geometry.image_tokens() == 16
    assert with_image["prompt_tokens"] == text_only["prompt_tokens"] + geometry.image_tokens()

    streamed = apirctl("chat", "--name", name, "--image", str(picture), "describe", *ASK)
    assert streamed.returncode == 0 and streamed.stdout.strip(), streamed.stderr
    assert "Traceback" not in streamed.stderr

    # the session's /image: the picture goes with the next message, and /stats counts its tokens
    command_line = apirctl_command()
    child = pexpect.spawn(command_line[0], [*command_line[1:], "chat", "--name", name, "--plain", *ASK],
                          env=dict(os.environ, TERM="xterm", NO_COLOR="1", COLUMNS="120"), encoding="utf-8",
                          timeout=120, dimensions=(40, 120))
    try:
        child.expect_exact(">>> ")
        child.sendline(f"/image {picture}")
        child.expect_exact("1 image(s) go with the next message")
        child.expect_exact(">>> ")
        child.sendline("describe")
        child.expect_exact(">>> ")
        child.sendline("/stats")
        child.expect(r"prompt: +(\d+) tokens(?: \(\+(\d+) cached\))?")
        processed, cached = child.match.group(1), child.match.group(2) or "0"
        child.expect_exact(">>> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert int(processed) + int(cached) == with_image["prompt_tokens"], (processed, cached)

    assert apirctl("stop", name).returncode == 0
    assert not container_exists(name)
    assert store_files() == []  # Ollama's files were served in place, not copied into apirctl's store
