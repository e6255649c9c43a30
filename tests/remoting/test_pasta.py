"""The pasta door for real: the installed `pasta` binary, a real ggml-rpc-server on 127.0.0.1.

pasta is run with the arguments podman gives it (read from containers/common's
`libnetwork/pasta`: `--config-net`, then the container's pasta options, then `-t none -u none -T
none -U none` for each kind it was not given, `--no-map-gw` unless asked for the gateway mapping,
`--dns-forward 169.254.1.1`, `--quiet`, and on podman 5.3+ with a pasta that has it `--map-guest-addr
169.254.1.2`), plus apirctl's options, around a command that speaks the RPC HELLO.

A pasta namespace reaches other addresses through the host's own sockets, so every test here runs
pasta inside a network namespace it makes itself ("outer", the host stand-in, which also runs the
backend on its 127.0.0.1), linked by a veth pair to a second one ("gateway", its default route).
Nothing can leave for a real network whatever pasta does.

podman here (4.3) has no `--network pasta`; the container test runs where podman is 4.4 or newer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from apirctl.remoting import hostloopback, transport
from apirctl.remoting.hostloopback import HostLoopback

PASTA = shutil.which("pasta")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(PASTA is None, reason="pasta (the passt package) is not installed"),
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                       reason="needs root and iproute2 to make the network namespaces pasta runs in"),
]

OUTER_IP, GATEWAY_IP = "10.213.78.2", "10.213.78.1"
CONTROL_PORT = 40123
# Run inside a namespace: for each (kind, host, port) say whether it answered.
PROBE = """
import json, socket, sys
from apirctl.remoting import rpc_client
out = []
for kind, host, port in json.loads(sys.argv[1]):
    try:
        if kind == "hello":
            out.append(rpc_client.probe(host, port, timeout=3).version)
        else:
            socket.create_connection((host, port), timeout=3).close()
            out.append("connected")
    except Exception as exc:
        out.append("failed: " + type(exc).__name__)
print(json.dumps(out))
"""


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@dataclass
class Sandbox:
    outer: str
    gateway: str


@pytest.fixture
def sandbox() -> Iterator[Sandbox]:
    """outer <-veth-> gateway: outer's default route leads to the gateway namespace, nowhere else."""
    tag = uuid.uuid4().hex[:6]
    box = Sandbox(outer=f"apirctl-po{tag}", gateway=f"apirctl-pg{tag}")
    ip("netns", "add", box.outer)
    ip("netns", "add", box.gateway)
    try:
        ip("link", "add", f"apo{tag}", "netns", box.outer, "type", "veth", "peer", "name", f"apg{tag}",
           "netns", box.gateway)
        ip("-n", box.outer, "addr", "add", f"{OUTER_IP}/24", "dev", f"apo{tag}")
        ip("-n", box.gateway, "addr", "add", f"{GATEWAY_IP}/24", "dev", f"apg{tag}")
        for ns, dev in ((box.outer, f"apo{tag}"), (box.gateway, f"apg{tag}")):
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", box.outer, "route", "add", "default", "via", GATEWAY_IP)
        yield box
    finally:
        subprocess.run(["ip", "netns", "del", box.outer], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", box.gateway], capture_output=True, timeout=30)


def probe_in(prefix: list[str], checks: list[tuple[str, str, int]]) -> list[str]:
    done = subprocess.run([*prefix, sys.executable, "-c", PROBE, json.dumps(checks)], capture_output=True,
                          text=True, timeout=120)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, f"the probe did not run: {done.stderr[-1500:]}"
    return list(json.loads(lines[-1]))


@pytest.fixture
def backend(sandbox: Sandbox, llama_build) -> Iterator[int]:  # type: ignore[no-untyped-def]
    """ggml-rpc-server from the session's build, on 127.0.0.1 of the outer namespace."""
    port = 50052
    server = subprocess.Popen(["ip", "netns", "exec", sandbox.outer, str(llama_build.binary("ggml-rpc-server")),
                               "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while probe_in(["ip", "netns", "exec", sandbox.outer], [("hello", "127.0.0.1", port)])[0].startswith("fail"):
            assert server.poll() is None and time.monotonic() < deadline, "ggml-rpc-server did not start"
            time.sleep(0.2)
        yield port
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture
def control(sandbox: Sandbox) -> Iterator[None]:
    """A listener on the gateway namespace's address: proves the path out of pasta works."""
    code = (f"import socket\ns = socket.create_server(('0.0.0.0', {CONTROL_PORT}))\n"
            "while True:\n    s.accept()[0].close()\n")
    listener = subprocess.Popen(["ip", "netns", "exec", sandbox.gateway, sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while probe_in(["ip", "netns", "exec", sandbox.gateway],
                       [("connect", GATEWAY_IP, CONTROL_PORT)]) != ["connected"]:
            assert time.monotonic() < deadline, "the control listener did not start"
            time.sleep(0.1)
        yield
    finally:
        listener.kill()
        listener.wait(timeout=30)


def _pasta_has(option: str) -> bool:
    done = subprocess.run([str(PASTA), "--help"], capture_output=True, text=True, timeout=30)
    return option in done.stdout + done.stderr


def podman_pasta(options: list[str]) -> list[str]:
    """pasta's command line as podman builds it around a container's pasta options."""
    args = [str(PASTA), "--config-net", *options]
    for short, long in (("-t", "--tcp-ports"), ("-u", "--udp-ports"), ("-T", "--tcp-ns"), ("-U", "--udp-ns")):
        if short not in options and long not in options:
            args += [short, "none"]
    if "--map-gw" in options:
        args.remove("--map-gw")  # podman's own switch, not pasta's: it only leaves out --no-map-gw
    else:
        args.append("--no-map-gw")
    args += ["--dns-forward", "169.254.1.1", "--quiet"]
    if _pasta_has("--map-guest-addr"):
        args += ["--map-guest-addr", "169.254.1.2"]
    if os.geteuid() == 0:
        args += ["--runas", "0:0"]  # as root pasta would switch to nobody, who cannot set up the namespace
    return args


def test_the_pasta_door_reaches_the_backend_and_nothing_else(sandbox: Sandbox, backend: int, control: None) -> None:
    door = HostLoopback(mode="pasta")
    plan = transport.rpc_plan(backend, ngl=99, loopback=door)
    assert plan.network_mode == "pasta"
    outer = ["ip", "netns", "exec", sandbox.outer]
    inside = [*outer, *podman_pasta(plan.network_options["pasta"]), "--"]
    host, port = plan.llama_args[1].rsplit(":", 1)
    assert (host, int(port)) == (hostloopback.PASTA_HOST_LOOPBACK, backend)
    through, own, gateway, out = probe_in(inside, [
        ("hello", host, backend),               # the forward apirctl asks for
        ("hello", OUTER_IP, backend),           # the namespace's own address (pasta copies the host's)
        ("hello", GATEWAY_IP, backend),         # the gateway: not mapped to the host (--no-map-gw)
        ("connect", GATEWAY_IP, CONTROL_PORT),  # while the way out itself works
    ])
    assert through.startswith("7."), f"the RPC HELLO did not answer through pasta: {through}"
    assert own.startswith("failed") and gateway.startswith("failed"), (own, gateway)
    assert out == "connected"


def test_without_the_forward_the_container_loopback_is_empty(sandbox: Sandbox, backend: int) -> None:
    inside = ["ip", "netns", "exec", sandbox.outer, *podman_pasta([]), "--"]
    assert probe_in(inside, [("hello", "127.0.0.1", backend)])[0].startswith("failed")


def test_a_neighbour_cannot_reach_the_backend(sandbox: Sandbox, backend: int) -> None:
    """From the other end of the link, the host stand-in's routable address refuses the port."""
    answer = probe_in(["ip", "netns", "exec", sandbox.gateway], [("hello", OUTER_IP, backend)])
    assert answer[0].startswith("failed")


# The pasta container test (a real container, when podman has pasta) is
# tests/remoting/test_transport.py::test_rpc_plan_runs_llama_bench_on_a_host_rpc_server[pasta].
