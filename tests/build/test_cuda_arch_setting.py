"""The `cuda_architectures` setting reaches the host build's CMake line and its cache key.

Why a setting, not only a setup flag: the key of the cached build includes the options, so
every later lookup (`current_build()`) must see the same value that `apirctl setup` built with.
"""

from __future__ import annotations

import pytest

from apirctl.build import llamacpp


def test_setting_reaches_cuda_options_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APIRCTL_CUDA_ARCHITECTURES", "90")
    cuda = llamacpp.host_options("cuda")
    assert cuda.cuda_architectures == "90"
    assert "-DCMAKE_CUDA_ARCHITECTURES=90" in cuda.cmake_args()
    cpu = llamacpp.host_options("cpu")
    assert cpu.cuda_architectures is None  # a CPU build's cache key does not change
    monkeypatch.delenv("APIRCTL_CUDA_ARCHITECTURES")
    assert llamacpp.host_options("cuda").key() != cuda.key()
