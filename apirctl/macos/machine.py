"""macOS: the libkrun Podman machine, restarted so that krunkit loads the API-remoting stack.

`restart --remoting` replaces the upstream shell scripts with one checked sequence: podman and
the libkrun machine exist, the bundle's backend passes its selftest, krunkit is patched into the
bundle, the machine is stopped and started with the variables that make krunkit load the
bundle's virglrenderer (which loads the ggml-virtgpu backend, which loads ggml-metal), and
`lsof` proves the running krunkit mapped the bundle's own file (compared by path, not by a
substring of the version). Any failure after the stop restarts the machine without remoting.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apirctl.apir import selftest
from apirctl.errors import ApirctlError, tail
from apirctl.machine import MachineState, MachineStatus, RestartOptions
from apirctl.macos import bundle, krunkit
from apirctl.paths import dirs, ensure
from apirctl.podman import servers as podman_servers
from apirctl.podman.servers import Server

if TYPE_CHECKING:
    from apirctl.macos.bundle import Bundle

PLATFORM = "macos"
PROVIDER = "libkrun"
DEFAULT_MACHINE = "podman-machine-default"
VFKIT_TYPES = ("applehv", "vfkit")
#: Variables only a remoting start sets; a plain start removes them.
REMOTING_VARIABLES = (
    "CONTAINERS_HELPER_BINARY_DIR", "DYLD_LIBRARY_PATH", "VIRGL_APIR_BACKEND_LIBRARY",
    "APIR_LLAMA_CPP_GGML_LIBRARY_PATH", "APIR_LLAMA_CPP_GGML_LIBRARY_REG", "VIRGL_ROUTE_VENUS_TO_APIR",
    "VIRGL_APIR_LOG_TO_FILE", "APIR_LLAMA_CPP_LOG_TO_FILE",
)
LOG_FILES = {"VIRGL_APIR_LOG_TO_FILE": "virglrenderer-apir.log", "APIR_LLAMA_CPP_LOG_TO_FILE": "apir-llama-cpp.log"}
#: How long to wait for krunkit to show up after `podman machine start` returned.
KRUNKIT_WAIT_S = 20.0
PODMAN_TIMEOUT_S = 300.0


# --- podman and lsof ------------------------------------------------------------------------------


def _podman() -> str:
    exe = shutil.which("podman")
    if exe is None:
        raise ApirctlError("podman is not installed", exit_code=127,
                           hint="install Podman (https://podman.io) or `brew install podman`")
    return exe


def _machine_env(extra: dict[str, str] | None = None, plain: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    env["CONTAINERS_MACHINE_PROVIDER"] = PROVIDER
    if plain:
        for name in REMOTING_VARIABLES:
            env.pop(name, None)
    if extra:
        env.update(extra)
    return env


def _run(args: list[str], env: dict[str, str] | None = None,
         timeout: float = PODMAN_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(args, env=env or _machine_env(), capture_output=True, text=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ApirctlError(f"`{' '.join(args[:3])}` did not finish in {timeout:.0f} s") from exc


def _why(proc: subprocess.CompletedProcess[str]) -> str:
    return tail(proc.stderr or proc.stdout, default=f"exit code {proc.returncode}").removeprefix("Error: ")


def inspect(name: str | None = None) -> dict[str, Any] | None:
    """`podman machine inspect` of the libkrun machine; None when it does not exist."""
    proc = _run([_podman(), "machine", "inspect", *([name] if name else [])])  # none: the default machine
    if proc.returncode != 0:
        if "does not exist" in (proc.stderr or ""):
            return None
        raise ApirctlError(f"podman machine inspect failed: {_why(proc)}")
    try:
        found = json.loads(proc.stdout or "[]")
    except ValueError as exc:
        raise ApirctlError("podman machine inspect printed something that is not JSON") from exc
    return found[0] if found else None


def machines() -> list[dict[str, Any]]:
    """All machines of all providers (`podman machine list --all-providers --format json`)."""
    exe = _podman()
    proc = _run([exe, "machine", "list", "--all-providers", "--format", "json"], env=dict(os.environ))
    if proc.returncode != 0:  # podman before 5.2 has no --all-providers
        proc = _run([exe, "machine", "list", "--format", "json"], env=dict(os.environ))
    if proc.returncode != 0:
        return []
    try:
        rows = json.loads(proc.stdout or "[]")
    except ValueError:
        return []
    return rows if isinstance(rows, list) else []


def servers(name: str | None = None) -> list[Server]:
    """Running API-remoting inference servers (empty when the machine's Podman cannot be asked)."""
    try:
        found = podman_servers.list_servers()
    except ApirctlError:
        return []
    return [s for s in found if s.transport == "virtgpu" and s.running]


def stale_servers() -> list[Server]:
    """None: a virtgpu server keeps no connection that a machine restart leaves dead."""
    return []


def remoting_env(b: Bundle) -> dict[str, str]:
    """The variables of a remoting start, pointing into bundle `b` (see docs/macos.md)."""
    logs = ensure(dirs().logs)
    env = {
        "CONTAINERS_MACHINE_PROVIDER": PROVIDER,
        "CONTAINERS_HELPER_BINARY_DIR": str(b.bin_dir),
        "DYLD_LIBRARY_PATH": str(b.bin_dir),
        "VIRGL_APIR_BACKEND_LIBRARY": str(b.backend_path),
        "APIR_LLAMA_CPP_GGML_LIBRARY_PATH": str(b.ggml_path),
        "APIR_LLAMA_CPP_GGML_LIBRARY_REG": b.ggml_reg,
        "VIRGL_ROUTE_VENUS_TO_APIR": "1",
    }
    for var, file in LOG_FILES.items():
        env[var] = str(logs / file)
    return env


# --- status ---------------------------------------------------------------------------------------


def _st(state: MachineState, summary: str, next_step: str | None = None, **details: Any) -> MachineStatus:
    return MachineStatus(platform=PLATFORM, state=state, summary=summary, next_step=next_step,
                         details={k: v for k, v in details.items() if v is not None})


INIT_HINT = "CONTAINERS_MACHINE_PROVIDER=libkrun podman machine init"


def status(name: str | None = None, *, gpu_memory: bool = False) -> MachineStatus:
    """The remoting state, precisely, with the next step to take (`gpu_memory` adds nothing here: the
    VM's one device is krunkit's, not a backend per container)."""
    machine_name = name or DEFAULT_MACHINE
    if shutil.which("podman") is None:
        return _st(MachineState.NOT_INSTALLED, "podman is not installed",
                   "install Podman (https://podman.io) or `brew install podman`")
    b = bundle.active()
    if b is None:
        return _st(MachineState.NOT_INSTALLED, "no API-remoting bundle is installed",
                   "apirctl install --from RELEASE.tar.gz (a tarball, directory or URL)")
    common: dict[str, Any] = {"machine": machine_name, "bundle": b.version, "bundle_path": str(b.path),
                              "image": b.image}
    stated = b.version_on_disk()
    if stated is None:
        return _st(MachineState.UNKNOWN_VERSION, f"the version of bundle {b.version} cannot be read "
                   f"({b.path / 'src_info/version.txt'})",
                   f"reinstall it: apirctl uninstall {b.version} && apirctl install --from ...", **common)
    for row in machines():
        if row.get("Running") and str(row.get("VMType", "")).lower() in VFKIT_TYPES:
            return _st(MachineState.VFKIT, f"machine {row.get('Name')} runs with vfkit, which cannot do API remoting",
                       f"podman machine stop {row.get('Name')}; {INIT_HINT}; apirctl machine restart --remoting",
                       **common)
    info = inspect(name)
    if info is None:
        return _st(MachineState.NOT_RUNNING, f"there is no libkrun machine {machine_name}",
                   f"{INIT_HINT}, then apirctl machine restart --remoting", **common)
    machine_name = str(info.get("Name") or machine_name)
    common["machine"] = machine_name
    if str(info.get("State", "")).lower() != "running":
        return _st(MachineState.NOT_RUNNING, f"machine {machine_name} is not running",
                   "apirctl machine restart --remoting", **common)
    pid, virgl = krunkit.mapped_virglrenderers()
    expected = bundle.virglrenderer_path(b)
    common.update(krunkit_pid=pid, virglrenderer=", ".join(virgl) or None)
    if expected is None or not any(krunkit.same_file(v, expected) for v in virgl):
        return _st(MachineState.NO_REMOTING, f"machine {machine_name} runs without API remoting",
                   "apirctl machine restart --remoting", **common)
    users = servers(name)
    if users:
        names = ", ".join(s.name for s in users)
        return _st(MachineState.SERVING, f"krunkit runs with API remoting ({b.version}); serving: {names}",
                   "apirctl chat", servers=names, **common)
    return _st(MachineState.READY, f"krunkit runs with API remoting support ({b.version})",
               "apirctl serve MODEL --transport virtgpu", **common)


# --- restart and stop -----------------------------------------------------------------------------


def _stop_machine(name: str | None) -> None:
    proc = _run([_podman(), "machine", "stop", name or DEFAULT_MACHINE], env=_machine_env(plain=True))
    if proc.returncode != 0:
        raise ApirctlError(f"podman machine stop failed: {_why(proc)}")


def _start_machine(name: str | None, env: dict[str, str]) -> None:
    proc = _run([_podman(), "machine", "start", "--no-info", name or DEFAULT_MACHINE], env=env)
    if proc.returncode != 0:
        raise ApirctlError(f"podman machine start failed: {_why(proc)}")


def _require_machine(name: str | None) -> dict[str, Any]:
    for row in machines():
        other = row.get("Name")
        if row.get("Running") and str(row.get("VMType", "")).lower() in VFKIT_TYPES:
            raise ApirctlError(f"machine {other} runs with vfkit; only one machine can run at a time",
                               hint=f"stop it first: podman machine stop {other}")
    info = inspect(name)
    if info is None:
        raise ApirctlError(f"there is no libkrun Podman machine {name or DEFAULT_MACHINE}",
                           hint=f"create one: {INIT_HINT}" + (f" {name}" if name else ""))
    return info


def _verify_mapped(b: Bundle) -> str:
    """Wait for krunkit, then require that it mapped the bundle's virglrenderer; return that path."""
    expected = bundle.virglrenderer_path(b)
    deadline = time.monotonic() + KRUNKIT_WAIT_S
    pid, virgl = krunkit.mapped_virglrenderers()
    while pid is None and time.monotonic() < deadline:
        time.sleep(0.2)
        pid, virgl = krunkit.mapped_virglrenderers()
    if pid is None:
        raise ApirctlError("krunkit is not running after the machine started (lsof -c krunkit found nothing)")
    for v in virgl:
        if expected is not None and krunkit.same_file(v, expected):
            return v
    seen = ", ".join(virgl) or "no libvirglrenderer at all"
    raise ApirctlError(f"krunkit (pid {pid}) did not load the bundle's virglrenderer {expected}; it mapped {seen}")


def run_selftest(b: Bundle) -> dict[str, Any]:
    """The APIR backend selftest against the bundle's libraries (in a child process): a backend
    that cannot even initialise must not be loaded into krunkit, where a crash takes the VM down."""
    try:
        report = selftest.run(library=b.backend_path, ggml_library=b.ggml_path, reg=b.ggml_reg,
                              cheap_calls=50, graph_calls=5)
    except ApirctlError:
        raise
    except Exception as exc:  # the selftest driver reports a library that cannot even load this way
        raise ApirctlError(f"the backend selftest of bundle {b.version} failed ({exc})",
                           hint="run `apirctl backend selftest` for details, or skip with --no-selftest") from exc
    if not report.ok:
        failed = [c for c in report.checks if not c.ok]
        why = f"{failed[0].name}: {failed[0].detail}" if failed else (report.init_status or "no detail")
        raise ApirctlError(f"the backend selftest of bundle {b.version} failed ({why})",
                           hint="run `apirctl backend selftest` for details, or skip with --no-selftest")
    return {"selftest": "passed"}


def restart(options: RestartOptions, progress: Callable[[str], None] | None = None) -> MachineStatus:
    """Restart the libkrun machine, with remoting when `options.remoting`.

    `progress(step)` is told each step as it starts (`apirctl machine restart` shows it: stopping
    and starting a machine takes a while).
    """
    say = progress or (lambda _step: None)
    if not options.remoting:
        return _restart_plain(options.name, say)

    _podman()
    b = bundle.require_active()
    if b.version_on_disk() is None:
        raise ApirctlError(f"the version of bundle {b.version} cannot be read", exit_code=20,
                           hint=f"reinstall it: apirctl uninstall {b.version} && apirctl install --from ...")
    if b.virglrenderer is None:
        raise ApirctlError(f"bundle {b.version} has no libvirglrenderer.1.dylib",
                           hint="install a bundle that ships the API-remoting virglrenderer")
    say("checking the libkrun machine")
    info = _require_machine(options.name)
    was_running = str(info.get("State", "")).lower() == "running"
    extra: dict[str, Any] = {}
    if options.selftest:
        say(f"testing the backend library of bundle {b.version}")
        extra.update(run_selftest(b))
    say("patching krunkit into the bundle")
    patched = krunkit.patch(b.bin_dir, options.krunkit)
    extra["krunkit_patch"] = "updated" if patched.get("changed") else "up to date"
    machine_name = str(info.get("Name") or options.name or DEFAULT_MACHINE)
    if was_running:
        say(f"stopping machine {machine_name}")
        _stop_machine(machine_name)
    try:
        say(f"starting machine {machine_name} with API remoting")
        _start_machine(machine_name, _machine_env(remoting_env(b)))
        say("checking that krunkit loaded the bundle's virglrenderer")
        mapped = _verify_mapped(b)
    except ApirctlError as exc:
        say("restoring the machine without remoting" if was_running else "stopping the machine")
        failed = _rollback(machine_name, was_running)
        back = "restarted without remoting" if was_running else "left stopped, as it was"
        if failed:
            back = f"left stopped: restarting it without remoting failed too ({failed})"
        raise ApirctlError(f"restart with remoting failed: {exc.message}; the machine was {back}",
                           hint="see `apirctl machine logs` and `apirctl machine status`") from exc
    result = status(options.name)
    result.details.update(extra, virglrenderer=mapped)
    return result


def _rollback(name: str | None, start: bool) -> str | None:
    """Stop the machine, and start it without remoting when it ran before; why that failed, if it did."""
    with contextlib.suppress(ApirctlError):
        _stop_machine(name)
    if start:
        try:
            _start_machine(name, _machine_env(plain=True))
        except ApirctlError as exc:
            return exc.message
    return None


def _restart_plain(name: str | None, say: Callable[[str], None]) -> MachineStatus:
    say("checking the libkrun machine")
    info = _require_machine(name)
    machine_name = str(info.get("Name") or name or DEFAULT_MACHINE)
    if str(info.get("State", "")).lower() == "running":
        say(f"stopping machine {machine_name}")
        _stop_machine(machine_name)
    say(f"starting machine {machine_name} without remoting")
    _start_machine(machine_name, _machine_env(plain=True))
    return status(name)


def stop(name: str | None = None) -> MachineStatus:
    """Stop the machine; refuses while an API-remoting server runs on it."""
    info = inspect(name)
    if info is None:
        raise ApirctlError(f"there is no libkrun Podman machine {name or DEFAULT_MACHINE}",
                           hint=f"create one: {INIT_HINT}")
    if str(info.get("State", "")).lower() == "running":
        users = servers(name)
        if users:
            names = ", ".join(s.name for s in users)
            raise ApirctlError(f"API-remoting servers are running on this machine: {names}",
                               hint="stop them with `apirctl stop`, or pass --force")
        _stop_machine(str(info.get("Name") or name or DEFAULT_MACHINE))
    return status(name)


def log_files() -> list[Path]:
    return [dirs().logs / f for f in LOG_FILES.values()]


def logs(follow: bool = False, tail: int = 50) -> Iterator[str]:
    """The ends of the virglrenderer and APIR backend logs of the last remoting start, each under a
    `==> FILE <==` line; with `follow`, then what they append, as it comes."""
    files = [f for f in log_files() if f.exists()]
    if not files:
        raise ApirctlError("no remoting logs yet", hint="they appear after `apirctl machine restart --remoting`")
    offsets: dict[Path, int] = {}
    for f in files:
        lines = f.read_text(errors="replace").splitlines()
        yield f"==> {f} <=="
        yield from lines[-tail:] if tail > 0 else []
        offsets[f] = f.stat().st_size
    pending = {f: "" for f in files}
    while follow:
        time.sleep(0.5)
        for f in files:
            size = f.stat().st_size if f.exists() else 0
            if size > offsets[f]:
                with f.open(errors="replace") as fh:
                    fh.seek(offsets[f])
                    *lines, pending[f] = (pending[f] + fh.read()).split("\n")
                yield from lines
                offsets[f] = size
