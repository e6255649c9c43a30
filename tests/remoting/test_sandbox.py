"""The host servers' sandbox (llama_patches 0016): what runs for a container cannot act on the host.

Both servers' selftests enter the sandbox as in service and must see every forbidden action denied.
Then code injected into the real servers (tests/remoting/shim/sandbox_probe.c, LD_PRELOADed) plays a
compromised server: once the sandbox is in force it opens files, creates sockets, connects, forks
and execs, and the test finds each denied, nothing left behind, and the server still serving.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from apirctl.build import llamacpp
from apirctl.diagnose import sandbox
from apirctl.remoting import rpc_client
from tests.remoting.test_apir_host_native import good_session
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(sys.platform != "linux", reason="the sandbox is Linux's seccomp-bpf and Landlock")]

PROBE = Path(__file__).parent / "shim" / "sandbox_probe.c"
# what the probe tries, in its order; execve last (had it worked, the process would be a shell)
PROBE_ACTIONS = ["open-read", "open-write", "socket-inet", "connect-inet", "socket-unix", "fork", "execve"]


def kernel_has_landlock() -> bool:
    """Ask the kernel itself for Landlock's ABI version, as the servers do.

    Reading /sys/kernel/security/lsm instead would need securityfs mounted, which some machines lack
    while Landlock is on (seen: no such file, and both servers' selftests at ABI 7).
    """
    landlock_create_ruleset = 444  # the same number on every architecture (the unified syscall table)
    create_ruleset_version = 1
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.syscall(landlock_create_ruleset, None, ctypes.c_size_t(0), create_ruleset_version)) > 0


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler")
    out = tmp_path_factory.mktemp("probe") / "sandbox_probe.so"
    done = subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror", str(PROBE), "-o",
                           str(out), "-ldl"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    d = tmp_path / "sandbox"
    d.mkdir(mode=0o700)
    return d


def test_both_selftests_see_every_forbidden_action_denied(llama_build: llamacpp.Build, tmp_path: Path) -> None:
    commands = sandbox.commands(llama_build)
    assert set(commands) == {"apir-host", "ggml-rpc-server"}
    for server, argv in commands.items():
        # a memory cap, so that allocating past it is among the attempts
        env = dict(os.environ, GGML_SANDBOX_MEMORY=str(512 << 20), TMPDIR=str(tmp_path))
        report = sandbox.run(server, argv, env=env)
        assert report.error is None, report
        actions = {a.action for a in report.attempts}
        for expected in ("open a file for reading", "open a file for writing", "create a file",
                         "write a file past RLIMIT_FSIZE", "create an IPv4 socket",
                         "connect a held socket to 127.0.0.1",
                         "execve", "fork", "ptrace the parent", "unshare a network namespace",
                         "allocate past the memory cap"):
            assert expected in actions, (server, sorted(actions))
        assert report.allowed == [], (server, report.allowed)
        assert report.threads and report.memfd and report.self_ok, report
        assert report.seccomp, report
        assert (report.landlock_abi > 0) == kernel_has_landlock(), report
        assert list(tmp_path.iterdir()) == [], "the selftest left files behind"


def test_a_selftest_without_the_sandbox_reports_what_is_allowed(llama_build: llamacpp.Build) -> None:
    """The selftest can fail: with the sandbox off, every attempt succeeds and it exits 1."""
    argv = sandbox.commands(llama_build)["ggml-rpc-server"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=dict(os.environ, GGML_SANDBOX="0"))
    assert proc.returncode == 1
    report = sandbox.parse("ggml-rpc-server", proc.returncode, proc.stdout, proc.stderr)
    assert "open a file for reading" in report.allowed and "fork" in report.allowed
    assert not report.seccomp and not report.ok
    assert "ALLOWED" in proc.stdout


@pytest.mark.skipif(not kernel_has_landlock(), reason="GGML_SANDBOX=require needs both layers")
def test_require_starts_on_a_kernel_with_both_layers(llama_build: llamacpp.Build) -> None:
    argv = sandbox.commands(llama_build)["apir-host"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, GGML_SANDBOX="require"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "warning" not in proc.stderr


@contextlib.contextmanager
def listener() -> Iterator[socket.socket]:
    """A TCP port on the loopback that the probe tries to reach: nothing may arrive."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(4)
    s.setblocking(False)
    try:
        yield s
    finally:
        s.close()


def probe_lines(log: Path) -> dict[str, str]:
    found = {}
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("sandbox-probe: "):
            action, verdict = line.removeprefix("sandbox-probe: ").split()[:2]
            found[action] = line
            assert verdict in ("denied", "ALLOWED"), line
    return found


def assert_compromise_contained(log: Path, marks: Path, tcp: socket.socket) -> None:
    wait_for("the probe to finish", lambda: "execve" in probe_lines(log), 60)
    lines = probe_lines(log)
    assert list(lines) == PROBE_ACTIONS, log.read_text(errors="replace")
    for line in lines.values():
        assert " denied " in line, line
        assert "(errno 1)" in line, line  # EPERM: the filter, not a missing file or a refused port
    assert sorted(p.name for p in marks.iterdir()) == [], "the probe left a mark: it wrote, forked or executed"
    with pytest.raises(BlockingIOError):
        tcp.accept()


@contextlib.contextmanager
def server(argv: list[str], log: Path, env: dict[str, str], ready: str) -> Iterator[subprocess.Popen[bytes]]:
    """The server with `env` added, until `ready` is in its log (its stderr: stdout to a file is buffered)."""
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
    try:
        wait_for(f"{argv[0]} to be ready", lambda: ready in log.read_text(errors="replace") or proc.poll() is not None,
                 60)
        assert proc.poll() is None, log.read_text(errors="replace")
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_a_compromised_apir_host_child_cannot_act(llama_build: llamacpp.Build, probe: Path, workdir: Path) -> None:
    marks = workdir / "marks"
    marks.mkdir()
    path, log = workdir / "apir.sock", workdir / "apir-host.log"
    argv = [str(llama_build.binary("apir-host")), "--socket", str(path),
            "--backend-library", str(llama_build.library("ggml-virtgpu-backend")),
            "--ggml-library", str(llama_build.library("ggml-cpu"))]
    with listener() as tcp:
        env = {"LD_PRELOAD": str(probe), "SANDBOX_PROBE_DIR": str(marks),
               "SANDBOX_PROBE_PORT": str(tcp.getsockname()[1])}
        with server(argv, log, env, "apir-host: listening on") as proc:
            # the probe fires in the child's first poll() after LOADLIBRARY: the sandbox is in force
            good_session(path)
            assert_compromise_contained(log, marks, tcp)
            # the parent was never sandboxed, and serves the next client in a child of its own
            good_session(path)
            assert proc.poll() is None
    assert "crashed" not in log.read_text(errors="replace")


def test_a_compromised_rpc_server_cannot_act(llama_build: llamacpp.Build, probe: Path, workdir: Path) -> None:
    marks = workdir / "marks"
    marks.mkdir()
    path, log = workdir / "rpc.sock", workdir / "rpc-server.log"
    argv = [str(llama_build.binary("ggml-rpc-server")), "-H", f"{rpc_client.UNIX_PREFIX}{path}", "-t", "2"]
    with listener() as tcp:
        env = {"LD_PRELOAD": str(probe), "SANDBOX_PROBE_DIR": str(marks),
               "SANDBOX_PROBE_PORT": str(tcp.getsockname()[1])}
        # the probe fires in accept(), which the server calls once it has entered the sandbox
        with server(argv, log, env, "sandbox-probe: execve") as proc:
            assert_compromise_contained(log, marks, tcp)
            # still serving: a client's hello and device memory through the sandboxed server
            info = rpc_client.probe(f"{rpc_client.UNIX_PREFIX}{path}")
            assert info.devices and info.devices[0].total > 0
            assert proc.poll() is None
