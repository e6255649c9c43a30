"""The host servers' sandbox, as they report it: `apir-host` and `ggml-rpc-server` enter it with
`--sandbox-selftest=json` exactly as they do in service, try what a compromised server would (open,
connect, exec, fork, ptrace...) and print what was denied (llama_patches 0016)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from pydantic import BaseModel

from apirctl.build import llamacpp

SELFTEST_TIMEOUT = 60.0


class Attempt(BaseModel):
    action: str
    denied: bool
    errno: int


class Selftest(BaseModel):
    """One server's report; `error` is set when it gave none (an old build, a crash)."""

    server: str
    seccomp: bool = False
    landlock_abi: int = 0
    threads: bool = False
    memfd: bool = False
    self_ok: bool = False  # signals to itself, reads its limits: what abort() and glibc need
    attempts: list[Attempt] = []
    warnings: list[str] = []
    error: str | None = None

    @property
    def allowed(self) -> list[str]:
        return [a.action for a in self.attempts if not a.denied]

    @property
    def ok(self) -> bool:
        """Every attempt denied, what serving needs works, and both kernel layers in force."""
        return (self.error is None and bool(self.attempts) and not self.allowed and self.threads and self.memfd
                and self.self_ok and self.seccomp and self.landlock_abi > 0)


def commands(build: llamacpp.Build) -> dict[str, list[str]]:
    """The selftest of each server, on the CPU backend as apirctl runs them on a CPU host."""
    out: dict[str, list[str]] = {}
    rpc = build.bin_dir / "ggml-rpc-server"
    if rpc.exists():
        out["ggml-rpc-server"] = [str(rpc), "--sandbox-selftest=json"]
    apir = build.bin_dir / "apir-host"
    libraries = [build.bin_dir / f"lib{stem}{llamacpp.LIB_SUFFIX}" for stem in ("ggml-virtgpu-backend", "ggml-cpu")]
    if apir.exists() and all(lib.exists() for lib in libraries):
        out["apir-host"] = [str(apir), "--sandbox-selftest=json", "--backend-library", str(libraries[0]),
                            "--ggml-library", str(libraries[1])]
    return out


def parse(server: str, returncode: int, stdout: str, stderr: str) -> Selftest:
    """The report is the last JSON line of stdout; warnings (a kernel without a layer) are on stderr."""
    warnings = [line.strip() for line in stderr.splitlines() if "warning" in line]
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            try:
                data = json.loads(line)
            except json.JSONDecodeError:
                break
            return Selftest(server=server, seccomp=data.get("seccomp", False),
                            landlock_abi=data.get("landlock_abi", 0), threads=data.get("threads", False),
                            memfd=data.get("memfd", False), self_ok=data.get("self", False),
                            attempts=[Attempt(**a) for a in data.get("actions", [])], warnings=warnings)
    last = (stderr or stdout).strip().splitlines()
    return Selftest(server=server, warnings=warnings,
                    error=f"no report (exit status {returncode}): {last[-1] if last else 'no output'}")


def run(server: str, argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> Selftest:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=SELFTEST_TIMEOUT, env=env, cwd=cwd)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Selftest(server=server, error=f"did not run: {exc}")
    return parse(server, proc.returncode, proc.stdout, proc.stderr)


def selftests(build: llamacpp.Build) -> list[Selftest]:
    return [run(server, argv) for server, argv in commands(build).items()]
