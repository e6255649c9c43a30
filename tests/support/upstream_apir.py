"""Upstream's APIR libraries, built from the pinned source with only the series' transport patches.

The pairings with upstream that users meet: RamaLama's remoting image carries upstream's frontend and
meets the library apirctl built; apirctl's image meets the library of the macOS bundle, which is
upstream's. On Linux both sides need the socket transport (patch 0008), so "upstream" here
is the series up to the one before apirctl's hardening of the host library (0009): upstream's frontend
and backend library, reached through a socket. Only the two libraries are built (about a minute on
2 cores, cached by the patches' digest); a program of the host build runs upstream's frontend when its
directory comes first on LD_LIBRARY_PATH.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest

from apirctl.build import llamacpp
from tests.conftest import SHARED_CACHE, shared_env
from tests.support import native_builds

#: The name of the first patch that changes upstream's APIR code rather than add the socket transport.
FIRST_APIRCTL_PATCH = "0009-"


def transport_patches() -> list[Path]:
    series = llamacpp.patch_series()
    firsts = [i for i, path in enumerate(series) if path.name.startswith(FIRST_APIRCTL_PATCH)]
    assert firsts, f"no patch {FIRST_APIRCTL_PATCH}* in the series: update FIRST_APIRCTL_PATCH"
    return series[:firsts[0]]


def libraries() -> Path:
    """A folder with upstream's `libggml-virtgpu.so*` (the frontend) and `libggml-virtgpu-backend.so*`."""
    if shutil.which("cmake") is None or shutil.which("patch") is None:
        pytest.skip("cmake and patch are needed to build upstream's APIR libraries")
    patches = transport_patches()
    args = llamacpp.host_options().cmake_args()
    h = hashlib.sha256(llamacpp.SOURCE_SHA256.encode() + "\0".join(args).encode())
    for path in patches:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    out = SHARED_CACHE / "apir-upstream" / h.hexdigest()[:12]
    if (out / ".complete").exists():
        return out
    with shared_env():
        sdist = llamacpp.fetch_sdist()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".build-") as tmp:
        work = Path(tmp)
        with tarfile.open(sdist) as tar:
            tar.extractall(work, members=[m for m in tar.getmembers() if "/llama.cpp/" in m.name + "/"])  # noqa: S202
        tree = next(work.glob("*/llama.cpp"))
        for path in patches:
            subprocess.run(["patch", "-p1", "--batch", "--forward", "--quiet", "-d", str(tree), "-i", str(path)],
                           check=True, capture_output=True)
        # the host build's layout and flags: ccache serves every file the transport patches leave alone
        build = native_builds.cmake_build(tree, work, args, ("ggml-virtgpu", "ggml-virtgpu-backend"),
                                          "upstream's APIR libraries", jobs=2, timeout=1200)
        staged = work / "libs"
        staged.mkdir()
        for lib in (build / "bin").glob("libggml-virtgpu*.so*"):
            shutil.copy2(lib, staged / lib.name, follow_symlinks=False)
        (staged / ".complete").write_text("\n".join(p.name for p in patches) + "\n")
        if out.exists():
            shutil.rmtree(out)
        staged.rename(out)
    return out
