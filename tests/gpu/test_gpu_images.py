"""The GPU images' build side: the Vulkan build's cache key and targets, its prerequisites (header
version included), which backend libraries an image keeps, and the Vulkan drivers it carries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apirctl.build import image, llamacpp, vulkan


def test_the_vulkan_build_is_its_own_cache_entry_with_image_only_targets() -> None:
    vulkan, cpu = llamacpp.vulkan_options(), llamacpp.container_options()
    assert vulkan.key() != cpu.key()
    assert "-DGGML_VULKAN=ON" in vulkan.cmake_args() and "-DGGML_VULKAN=ON" not in cpu.cmake_args()
    assert vulkan.targets() == list(llamacpp.IMAGE_ONLY_EXECUTABLES)  # what the image holds, nothing more
    assert "llama-perplexity" in vulkan.targets()  # `perplexity` runs it in every image
    assert "ggml-rpc-server" in cpu.targets()


def test_existing_cache_keys_do_not_move() -> None:
    """Adding the vulkan backend must not rebuild anyone's CPU build (the key is its options' JSON)."""
    assert set(llamacpp.BuildOptions().model_dump()) == {
        "backend", "rpc", "virtgpu_backend", "virtgpu_frontend", "native", "cuda_architectures", "build_type"}


def _headers(root: Path, minor: int, patch: int) -> Path:
    (root / "vulkan").mkdir(parents=True)
    (root / "vulkan" / "vulkan_core.h").write_text(
        f"#define VK_HEADER_VERSION {patch}\n"
        f"#define VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION(0, 1, {minor}, VK_HEADER_VERSION)\n")
    return root


def test_vulkan_headers_too_old_are_named_with_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APIRCTL_CACHE_DIR", str(tmp_path / "cache"))  # no headers fetched earlier
    monkeypatch.setattr(vulkan, "can_fetch_headers", lambda: False)  # not Debian 12
    monkeypatch.setenv("CPLUS_INCLUDE_PATH", str(_headers(tmp_path / "old", 3, 239)))
    assert vulkan.header_version() == (1, 3, 239)
    missing = " ".join(vulkan.missing())
    assert "1.3.272 or newer (found 1.3.239" in missing and "CPLUS_INCLUDE_PATH" in missing
    monkeypatch.setattr(vulkan, "can_fetch_headers", lambda: True)  # Debian 12: the build fetches newer ones
    assert not any("headers 1.3.272" in m for m in vulkan.missing())
    monkeypatch.setattr(vulkan, "can_fetch_headers", lambda: False)
    monkeypatch.setenv("CPLUS_INCLUDE_PATH", str(_headers(tmp_path / "new", 4, 309)))
    assert vulkan.header_version() == (1, 4, 309)
    assert not any("headers 1.3.272" in m for m in vulkan.missing())
    assert vulkan.build_headers() is None  # the compiler's own are new enough: nothing to point CMake at


def test_debian_12s_mirror_is_read_from_either_apt_format(tmp_path: Path) -> None:
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    assert vulkan.debian_mirror(apt) is None
    (apt / "sources.list.d" / "other.sources").write_text(
        "Types: deb\nURIs: http://mirror.invalid/other\nSuites: nodistro\nComponents: main\n"
        "Signed-By: /usr/share/keyrings/other.gpg\n")
    (apt / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\n# a comment\nURIs: http://mirror.invalid/debian\nSuites: bookworm bookworm-updates\n"
        "Components: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n"
        "Types: deb\nURIs: http://mirror.invalid/debian-security\nSuites: bookworm-security\nComponents: main\n")
    assert vulkan.debian_mirror(apt) == ("http://mirror.invalid/debian",
                                         "/usr/share/keyrings/debian-archive-keyring.gpg")
    (apt / "sources.list").write_text("# old style\ndeb [arch=amd64 signed-by=/k.gpg] http://one.invalid/d bookworm "
                                      "main contrib\ndeb http://two.invalid/d trixie main\n")
    assert vulkan.debian_mirror(apt) == ("http://one.invalid/d", "/k.gpg")  # sources.list is read first
    source = vulkan.apt_source("http://one.invalid/d", "/k.gpg")
    assert "Suites: trixie\n" in source and "URIs: http://one.invalid/d\n" in source and "Signed-By: /k.gpg" in source


@pytest.mark.integration
def test_debian_13s_vulkan_headers_are_fetched_into_the_build_cache_on_debian_12() -> None:
    """For real, as `apirctl setup --vulkan` does on Debian 12: apt with a source list of its own."""
    from tests.conftest import shared_env

    if not vulkan.can_fetch_headers():
        pytest.skip("not Debian 12 with apt (the fetch is for Debian 12 only)")
    with shared_env():
        include = vulkan.fetch_headers()
        assert include.is_relative_to(vulkan.private_headers_dir())
        version = vulkan.header_version_in(include)
        assert version is not None and version >= vulkan.MIN_HEADER
        assert (include / "vulkan" / "vulkan.hpp").exists()
        assert vulkan.fetch_headers() == include  # once: the second call only looks


@pytest.mark.parametrize(("backend", "kept"), [("cpu", None), ("cuda", "libggml-cuda"), ("vulkan", "libggml-vulkan")])
def test_an_image_keeps_only_its_own_backend(backend: str, kept: str | None) -> None:
    excluded = image.excluded_libraries(backend)
    assert "libggml-virtgpu-backend" in excluded and "libggml-metal" in excluded
    others = {"libggml-cuda", "libggml-vulkan"} - {kept}
    assert others <= set(excluded) and (kept is None or kept not in excluded)


def test_vulkan_drivers_are_read_from_their_manifests(tmp_path: Path) -> None:
    lib = tmp_path / "libvulkan_fake.so"
    lib.write_bytes(b"")
    icd = tmp_path / "icd.d"
    icd.mkdir()
    (icd / "fake.json").write_text(json.dumps({"file_format_version": "1.0.0",
                                               "ICD": {"library_path": str(lib), "api_version": "1.3.0"}}))
    (icd / "gone.json").write_text(json.dumps({"ICD": {"library_path": str(tmp_path / "absent.so")}}))
    (icd / "relative.json").write_text(json.dumps({"ICD": {"library_path": "libvulkan_rel.so"}}))
    (icd / "broken.json").write_text("{")
    (icd / "nvidia.json").write_text(json.dumps({"ICD": {"library_path": str(tmp_path / "libGLX_nvidia.so.0")}}))
    (tmp_path / "libGLX_nvidia.so.0").write_bytes(b"")
    assert image.vulkan_drivers((icd, tmp_path / "none")) == [(icd / "fake.json", lib)]


def test_this_hosts_vulkan_drivers_exist() -> None:
    for manifest, library in image.vulkan_drivers():
        assert manifest.exists() and library.is_absolute() and library.exists()


def test_a_vulkan_build_made_elsewhere_is_named_by_a_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from apirctl.errors import ApirctlError

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "llama-server").write_text("")
    monkeypatch.setenv("APIRCTL_VULKAN_BUILD", str(tmp_path))
    with pytest.raises(ApirctlError, match="not a Vulkan build"):
        llamacpp.vulkan_build()
    (bin_dir / f"libggml-vulkan{llamacpp.LIB_SUFFIX}").write_text("")
    found = llamacpp.vulkan_build()
    assert found is not None and found.backend == "vulkan" and found.external and found.bin_dir == bin_dir
