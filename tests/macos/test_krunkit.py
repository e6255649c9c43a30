"""The krunkit patch on real arm64 Mach-O files (from a macOS wheel) arranged as Homebrew's
krunkit -> libkrun -> libvirglrenderer chain. `codesign` is the fake from tests/support/fakes."""

from __future__ import annotations

import hashlib
import json
import plistlib
import shutil
from pathlib import Path

import pytest

from apirctl.errors import ApirctlError
from apirctl.macos import krunkit

from .conftest import CHAIN, FakeMac, Homebrew, references, set_reference

pytestmark = pytest.mark.integration  # the wheel comes from the package index (cached after once)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _raw_commands(path: Path) -> list[bytes]:
    return krunkit.read(path).commands[0]


def test_entitlements_file_has_both_keys_correctly_spelled() -> None:
    ents = plistlib.loads(krunkit.entitlements_file().read_bytes())
    assert ents == {"com.apple.security.hypervisor": True,
                    "com.apple.security.cs.disable-library-validation": True}


def test_patch_rewrites_exactly_the_two_references(fake_mac: FakeMac, homebrew_on_mac: Homebrew,
                                                   installed) -> None:  # type: ignore[no-untyped-def]
    brew = homebrew_on_mac
    src_krunkit, src_libkrun = brew.krunkit.resolve(), brew.libkrun.resolve()
    before_k, before_l = _raw_commands(src_krunkit), _raw_commands(src_libkrun)
    result = krunkit.patch(installed.bin_dir)
    assert result["changed"] is True
    out_k, out_l = installed.bin_dir / "krunkit", installed.bin_dir / "libkrun-efi.1.dylib"
    # re-read with macholib: the references point into the bundle, nothing else moved
    assert references(out_k) == ["@executable_path/libkrun-efi.1.dylib", "/usr/lib/libSystem.B.dylib"]
    assert references(out_l) == ["@executable_path/libvirglrenderer.1.dylib", "/usr/lib/libSystem.B.dylib"]
    after_k, after_l = _raw_commands(out_k), _raw_commands(out_l)
    for before, after in ((before_k, after_k), (before_l, after_l)):
        assert len(before) == len(after)
        changed = [i for i, (b, a) in enumerate(zip(before, after, strict=True)) if b != a]
        assert len(changed) == 1  # only the one dylib command
    # every byte after the load commands is the source's
    assert krunkit.read(out_k).tails == krunkit.read(src_krunkit).tails
    # the sources are untouched; both outputs were signed with our entitlements, after the rewrite
    assert references(src_krunkit)[0] == str(brew.libkrun)
    signs = [c["argv"] for c in fake_mac.calls("codesign") if "-s" in c["argv"]]
    assert [a[-1].rsplit("/", 1)[-1] for a in signs] == ["krunkit", "libkrun-efi.1.dylib"]
    assert all(a[:4] == ["--force", "-s", "-", "--entitlements"] for a in signs)
    assert all(a[4] == str(krunkit.entitlements_file()) for a in signs)
    sigs = fake_mac.state()["signatures"]
    assert _sha(out_k) in sigs and _sha(out_l) in sigs
    assert "com.apple.security.hypervisor" in sigs[_sha(out_k)]["entitlements"]
    assert krunkit.verify(installed.bin_dir) == []


def test_patch_is_idempotent(fake_mac: FakeMac, homebrew_on_mac: Homebrew, installed) -> None:  # type: ignore[no-untyped-def]
    krunkit.patch(installed.bin_dir)
    digest = _sha(installed.bin_dir / "krunkit")
    signs = len(fake_mac.calls("codesign"))
    again = krunkit.patch(installed.bin_dir)
    assert again["changed"] is False
    assert len(fake_mac.calls("codesign")) == signs  # nothing re-signed
    assert _sha(installed.bin_dir / "krunkit") == digest


def test_homebrew_upgrade_is_detected_and_repatched(fake_mac: FakeMac, homebrew_on_mac: Homebrew,
                                                    installed) -> None:  # type: ignore[no-untyped-def]
    krunkit.patch(installed.bin_dir)
    old = _sha(installed.bin_dir / "krunkit")
    homebrew_on_mac.install_krunkit("libwebpmux.3.dylib", "1.1.0")  # `brew upgrade krunkit`
    result = krunkit.patch(installed.bin_dir)
    assert result["changed"] is True and result["reason"] == "krunkit was upgraded"
    assert _sha(installed.bin_dir / "krunkit") != old
    record = json.loads((installed.path / krunkit.RECORD).read_text())
    assert record["krunkit_source"]["path"].endswith("Cellar/krunkit/1.1.0/bin/krunkit")
    assert references(installed.bin_dir / "krunkit")[1] == "@executable_path/libkrun-efi.1.dylib"


def test_tampered_output_is_repatched(fake_mac: FakeMac, homebrew_on_mac: Homebrew, installed) -> None:  # type: ignore[no-untyped-def]
    krunkit.patch(installed.bin_dir)
    out = installed.bin_dir / "libkrun-efi.1.dylib"
    with out.open("ab") as fh:
        fh.write(b"\0")
    assert krunkit.verify(installed.bin_dir) == ["libkrun-efi.1.dylib changed since it was patched"]
    assert krunkit.patch(installed.bin_dir)["changed"] is True
    assert krunkit.verify(installed.bin_dir) == []


def test_failed_signing_leaves_the_previous_patch(fake_mac: FakeMac, homebrew_on_mac: Homebrew,
                                                  installed) -> None:  # type: ignore[no-untyped-def]
    krunkit.patch(installed.bin_dir)
    before = {p.name: _sha(p) for p in installed.bin_dir.iterdir()}
    record = (installed.path / krunkit.RECORD).read_text()
    homebrew_on_mac.install_krunkit("libwebpmux.3.dylib", "1.1.0")
    fake_mac.fail("codesign --sign", exit_code=1, stderr="krunkit: errSecInternalComponent")
    with pytest.raises(ApirctlError, match="codesign could not sign krunkit: krunkit: errSecInternalComponent"):
        krunkit.patch(installed.bin_dir)
    assert {p.name: _sha(p) for p in installed.bin_dir.iterdir()} == before
    assert (installed.path / krunkit.RECORD).read_text() == record
    assert not list(installed.path.glob(".krunkit-patch-*"))  # the work directory is gone


def test_failed_verification_leaves_nothing(fake_mac: FakeMac, homebrew_on_mac: Homebrew, installed) -> None:  # type: ignore[no-untyped-def]
    fake_mac.fail("codesign --verify", exit_code=1, stderr="krunkit: invalid signature")
    with pytest.raises(ApirctlError, match="codesign --verify rejected krunkit"):
        krunkit.patch(installed.bin_dir)
    assert not (installed.bin_dir / "krunkit").exists()
    assert not (installed.path / krunkit.RECORD).exists()


def test_header_without_room_is_a_clear_error(fake_mac: FakeMac, homebrew_on_mac: Homebrew, installed,
                                              tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from macholib import mach_o
    from macholib.MachO import MachO
    from macholib.ptypes import sizeof

    # A krunkit whose header is full: a short libkrun reference, then an rpath filling the free space.
    tight = tmp_path / "tight" / "krunkit"
    tight.parent.mkdir()
    shutil.copy2(homebrew_on_mac.krunkit.resolve(), tight)
    # @loader_path/ is 4 bytes shorter than @executable_path/; with this name the command grows by 8
    name = "libkrun-efi-test.1.dylib"
    shutil.copy2(homebrew_on_mac.libkrun.resolve(), tight.parent / name)
    set_reference(tight, str(homebrew_on_mac.libkrun), f"@loader_path/{name}")
    macho = MachO(str(tight))
    header = macho.headers[0]
    room = header.low_offset - header.total_size
    fixed = sizeof(mach_o.load_command) + sizeof(mach_o.rpath_command)
    size = (room // 8) * 8
    lc = mach_o.load_command(_endian_=header.endian)
    lc.cmd, lc.cmdsize = mach_o.LC_RPATH, size
    cmd = mach_o.rpath_command(_endian_=header.endian)
    cmd.path = fixed
    header.commands.append((lc, cmd, b"/pad".ljust(size - fixed, b"\0")))
    header.header.ncmds += 1
    header.changedHeaderSizeBy(size)
    with tight.open("r+b") as fh:
        macho.write(fh)
    assert header.low_offset - (header.total_size) < 8
    with pytest.raises(ApirctlError, match="not enough Mach-O header space in krunkit"):
        krunkit.patch(installed.bin_dir, krunkit=str(tight))
    assert not (installed.bin_dir / "krunkit").exists()


def test_find_skips_the_patched_copy_in_the_bundle(fake_mac: FakeMac, homebrew_on_mac: Homebrew, installed,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    krunkit.patch(installed.bin_dir)
    monkeypatch.setenv("CONTAINERS_HELPER_BINARY_DIR", str(installed.bin_dir))
    assert krunkit.find() == homebrew_on_mac.krunkit.resolve()


def test_not_krunkit_is_refused(fake_mac: FakeMac, homebrew_on_mac: Homebrew, installed) -> None:  # type: ignore[no-untyped-def]
    other = homebrew_on_mac.files / CHAIN[2]  # links nothing called libkrun
    with pytest.raises(ApirctlError, match="does not link a libkrun library"):
        krunkit.patch(installed.bin_dir, krunkit=str(other))
    with pytest.raises(ApirctlError, match="not a readable Mach-O"):
        krunkit.patch(installed.bin_dir, krunkit=str(installed.path / "src_info" / "version.txt"))
