"""API-remoting bundles: import from a directory, a tarball and real HTTP; digests; side-by-side
versions; activate; uninstall (refused while the running machine uses the bundle)."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from apirctl.errors import ApirctlError
from apirctl.macos import bundle

from .conftest import IMAGE, VERSION, FakeMac, make_release, make_tarball

NAMES = ("liblzma.5.dylib", "libjpeg.62.4.0.dylib", "libz.1.3.1.zlib-ng.dylib")


@pytest.fixture
def files(tmp_path: Path) -> Path:
    """Stand-ins for the libraries (bundle handling never loads them)."""
    d = tmp_path / "libs"
    d.mkdir()
    for i, name in enumerate(NAMES):
        (d / name).write_bytes(os.urandom(4096) + bytes([i]))
    return d


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_import_directory_records_every_digest(tmp_path: Path, files: Path) -> None:
    rel = make_release(tmp_path / "r", files)
    b, changed = bundle.import_from(str(rel))
    assert changed and b.active and b.version == VERSION and b.image == IMAGE
    assert b.path == bundle.root() / VERSION
    assert b.backend_library == "libggml-virtgpu-backend.dylib"
    assert (b.ggml_library, b.ggml_reg) == ("libggml-metal.dylib", "ggml_backend_metal_reg")
    assert b.virglrenderer == "libvirglrenderer.1.dylib"
    expected = {str(p.relative_to(rel)): _sha(p) for p in rel.rglob("*") if p.is_file()}
    assert b.files == expected
    assert bundle.active() == b
    assert b.modified() == []
    (b.bin_dir / "libggml-metal.dylib").write_bytes(b"changed")
    assert b.modified() == ["bin/libggml-metal.dylib"]


def test_import_tarball_is_idempotent_and_conflicts_are_refused(tmp_path: Path, files: Path) -> None:
    tarball = make_tarball(make_release(tmp_path / "r", files))
    first, changed = bundle.import_from(str(tarball), sha256_digest=_sha(tarball))
    assert changed
    again, changed = bundle.import_from(str(tarball))
    assert not changed and again.files == first.files
    other = make_release(tmp_path / "other", files, extra={"bin/libextra.dylib": b"x"})
    with pytest.raises(ApirctlError, match="already installed with different files"):
        bundle.import_from(str(other))
    with pytest.raises(ApirctlError, match="does not match the expected sha256"):
        bundle.import_from(str(tarball), sha256_digest="0" * 64)


def test_release_krunkit_is_not_imported(tmp_path: Path, files: Path) -> None:
    rel = make_release(tmp_path / "r", files, extra={"bin/krunkit": b"theirs", "bin/libkrun-efi.dylib": b"theirs"})
    b, _ = bundle.import_from(str(rel))
    assert not (b.bin_dir / "krunkit").exists() and not (b.bin_dir / "libkrun-efi.dylib").exists()


@pytest.fixture
def http_dir(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A real HTTP server on loopback serving a directory."""
    root = tmp_path / "www"
    root.mkdir()

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw) -> None:  # type: ignore[no-untyped-def]
            super().__init__(*a, directory=str(root), **kw)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_import_url_with_digest_and_progress(tmp_path: Path, files: Path, http_dir: tuple[Path, str]) -> None:
    root, url = http_dir
    tarball = make_tarball(make_release(tmp_path / "r", files))
    (root / tarball.name).write_bytes(tarball.read_bytes())
    with pytest.raises(ApirctlError, match="does not match the expected sha256"):
        bundle.import_from(f"{url}/{tarball.name}", sha256_digest="f" * 64)
    assert bundle.list_bundles() == [] and not bundle.root().exists()  # a failed first import leaves no folder
    seen: list[int] = []
    b, changed = bundle.import_from(f"{url}/{tarball.name}", sha256_digest=_sha(tarball),
                                    progress=lambda done, total: seen.append(done))
    assert changed and b.version == VERSION and seen[-1] == tarball.stat().st_size
    with pytest.raises(ApirctlError, match="HTTP 404"):
        bundle.import_from(f"{url}/missing.tar.gz")


def test_version_is_required(tmp_path: Path, files: Path) -> None:
    rel = make_release(tmp_path / "r", files, version=None)
    with pytest.raises(ApirctlError, match="version is unknown") as err:
        bundle.import_from(str(rel))
    assert err.value.exit_code == 20
    b, _ = bundle.import_from(str(rel), version="local-1")
    assert b.version == "local-1" and b.version_on_disk() == "local-1"
    with pytest.raises(ApirctlError, match="invalid bundle version"):
        bundle.import_from(str(rel), version="../x")


def test_bad_sources_are_refused(tmp_path: Path, files: Path) -> None:
    with pytest.raises(ApirctlError, match="does not exist"):
        bundle.import_from(str(tmp_path / "nope.tar.gz"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ApirctlError, match="no bin/ directory"):
        bundle.import_from(str(empty))
    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as tar:
        info = tarfile.TarInfo("../escape.txt")
        info.size = 0
        tar.addfile(info)
    with pytest.raises(ApirctlError, match="unsafe path"):
        bundle.import_from(str(evil))
    not_tar = tmp_path / "x.tar.gz"
    not_tar.write_bytes(b"not a tarball")
    with pytest.raises(ApirctlError, match="cannot unpack"):
        bundle.import_from(str(not_tar))
    assert not (tmp_path.parent / "escape.txt").exists()
    assert bundle.list_bundles() == []


def test_versions_side_by_side_activate_and_uninstall(tmp_path: Path, files: Path) -> None:
    a, _ = bundle.import_from(str(make_release(tmp_path / "a", files, version="v1")))
    b, _ = bundle.import_from(str(make_release(tmp_path / "b", files, version="v2")))
    assert a.active and not b.active  # the first install becomes active; later ones wait
    assert [x.version for x in bundle.list_bundles()] == ["v1", "v2"]
    bundle.activate("v2")
    assert bundle.active() is not None and bundle.active().version == "v2"  # type: ignore[union-attr]
    with pytest.raises(ApirctlError, match="no bundle v3 is installed"):
        bundle.activate("v3")
    bundle.uninstall("v1")
    assert [x.version for x in bundle.list_bundles()] == ["v2"] and not a.path.exists()
    bundle.uninstall()  # the active one
    assert bundle.list_bundles() == [] and bundle.active() is None


def test_uninstall_refuses_the_bundle_the_running_machine_uses(fake_mac: FakeMac, tmp_path: Path,
                                                               files: Path) -> None:
    b, _ = bundle.import_from(str(make_release(tmp_path / "r", files)))
    fake_mac.add_machine(running=False)

    def krunkit_running(s: dict) -> None:  # type: ignore[type-arg]
        s["machines"]["podman-machine-default"]["state"] = "running"
        s["processes"] = {"4100": {"pid": 4100, "command": "krunkit", "machine": "podman-machine-default",
                                   "env": {}, "files": [["txt", str(b.bin_dir / "krunkit")],
                                                        ["txt", str(b.bin_dir / "libvirglrenderer.1.dylib")]]}}
    fake_mac.update(krunkit_running)
    with pytest.raises(ApirctlError, match="in use by the running machine"):
        bundle.uninstall(b.version)
    assert b.path.exists() and bundle.active() is not None
    fake_mac.update(lambda s: s.update(processes={}))
    bundle.uninstall(b.version)
    assert not b.path.exists()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "apirctl", *args], capture_output=True, text=True, timeout=120,
                          check=False)


def test_cli_install_list_activate_uninstall(tmp_path: Path, files: Path) -> None:
    tarball = make_tarball(make_release(tmp_path / "r", files))
    out = _cli("install", "--from", str(tarball), "--json")
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)
    assert row["version"] == VERSION and row["installed"] and row["active"] and row["image"] == IMAGE
    assert row["files"]["bin/libvirglrenderer.1.dylib"] == _sha(files / "libz.1.3.1.zlib-ng.dylib")
    listed = json.loads(_cli("install", "--list", "--json").stdout)
    assert [(x["version"], x["active"], x["modified"]) for x in listed] == [(VERSION, True, [])]
    assert _cli("install", "--activate", VERSION).returncode == 0
    bad = _cli("install", "--activate", "nope")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("apirctl: error: no bundle nope is installed")
    both = _cli("install", "--list", "--from", str(tarball))
    assert both.returncode == 1 and "choose one of" in both.stderr
    removed = _cli("uninstall", VERSION, "--json")
    assert removed.returncode == 0 and json.loads(removed.stdout)["removed"] is True
    assert json.loads(_cli("install", "--list", "--json").stdout) == []


def test_build_is_macos_only(tmp_path: Path) -> None:
    if sys.platform == "darwin":
        pytest.skip("this checks the refusal on other hosts")
    with pytest.raises(ApirctlError, match="run it on a Mac"):
        bundle.build(tmp_path / "libvirglrenderer.1.dylib")
