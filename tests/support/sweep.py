"""The fault and bad-input suite's checks: every case runs the real `apirctl` in a process of its own
and asserts its exit code, a stderr of at most two lines (the error and its hint), no traceback, and
that nothing was left behind.

`sweep` is the one way a case runs apirctl; `Outcome.fails_cleanly` is the promise each failure keeps.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROGRESS = re.compile(r"^(model|ssh tunnels|image|container|loading model)\.\.\.$|^  \S")


@dataclass
class Outcome:
    """One apirctl run: its exit code and output."""

    args: tuple[str, ...]
    code: int
    stdout: str
    stderr: str

    @property
    def error_lines(self) -> list[str]:
        """stderr without serve's progress lines ("model...", "  pulling ...": not part of an error)."""
        return [line for line in self.stderr.splitlines()
                if line.strip() and not PROGRESS.match(line)]

    def fails_cleanly(self, code: int | None = None, lines: int = 2, says: str | None = None) -> Outcome:
        """A failure as the project promises: non-zero (or `code`), at most `lines` lines on stderr,
        the first one starting with `apirctl: error:`, no traceback anywhere, `says` in the error."""
        shown = f"apirctl {' '.join(self.args)} -> {self.code}\nstdout: {self.stdout}\nstderr: {self.stderr}"
        assert "Traceback" not in self.stderr + self.stdout, shown
        assert self.code != 0 if code is None else self.code == code, shown
        assert 1 <= len(self.error_lines) <= lines, shown
        errors = [line for line in self.error_lines if line.startswith("apirctl:")]
        assert errors and (lines > 2 or self.error_lines[0] == errors[0]), shown  # a log tail may come first
        if says is not None:
            assert says in self.stderr, shown
        return self

    def succeeds(self) -> Outcome:
        assert self.code == 0 and "Traceback" not in self.stderr, f"{self.args}: {self.stderr}"
        return self


def apirctl_argv() -> list[str]:
    return [sys.executable, "-m", "apirctl"]


def sweep(*args: str, env: dict[str, str] | None = None, timeout: float = 120, stdin: str | None = None,
          cwd: Path | None = None, user: int | None = None) -> Outcome:
    """Run `apirctl ARGS` in a process of its own with the test's environment (plus `env`); with
    `user`, as that uid (and gid), by `setpriv` (root only: `as_user` gives the user a home)."""
    full = {**os.environ, **(env or {})}
    become = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"] if user is not None else []
    done = subprocess.run([*become, *apirctl_argv(), *args], capture_output=True, text=True, env=full,
                          timeout=timeout, input=stdin if stdin is not None else "", cwd=cwd or REPO)
    return Outcome(args, done.returncode, done.stdout, done.stderr)


#: The throw-away user for cases that need someone other than the file's or socket's owner (root
#: reads any file): nobody, whose uid no test's files belong to.
NOBODY = 65534


def can_switch_user() -> bool:
    import shutil

    return os.getuid() == 0 and shutil.which("setpriv") is not None


def as_user(root: Path, uid: int = NOBODY) -> dict[str, str]:
    """An apirctl home, runtime and cache folder under `root` (a new folder others may enter) owned
    by `uid`: the environment `sweep(..., user=uid)` runs apirctl in."""
    root.mkdir(mode=0o755, exist_ok=True)
    root.chmod(0o755)
    env = {}
    for variable, name in (("APIRCTL_HOME", "home"), ("APIRCTL_RUNTIME_DIR", "run"), ("APIRCTL_CACHE_DIR", "cache"),
                           ("HOME", "user"), ("APIRCTL_RESIDENT_DIR", "resident")):
        folder = root / name
        folder.mkdir(mode=0o700, exist_ok=True)
        os.chown(folder, uid, uid)
        env[variable] = str(folder)
    return env


def files_under(root: Path) -> set[str]:
    if not root.exists():
        return set()
    return {str(p.relative_to(root)) for p in root.rglob("*")}
