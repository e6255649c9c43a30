"""Remote RPC backends: addresses, the refusal of plain network backends, and real SSH tunnels.

The SSH tests run a real OpenSSH server on 127.0.0.1 (from PATH, /usr/sbin/sshd, or the binary
named by TEST_SSHD). OpenSSH needs its privilege-separation user and /run/sshd; so as not to touch
this machine's files, the server runs in a private mount namespace where a copy of /etc/passwd
with that user and a fresh /run are mounted (root only).
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from apirctl.errors import ApirctlError
from apirctl.podman import containers
from apirctl.remoting import hostloopback, rpc_client, transport, tunnel
from tests.support.ports import free_port

SSHD = os.environ.get("TEST_SSHD") or shutil.which("sshd") or "/usr/sbin/sshd"


@pytest.mark.parametrize("text", ["nope", "host:", ":50052", "host:99999", "host:port"])
def test_bad_backend_addresses_are_one_line_errors(text: str) -> None:
    with pytest.raises(ApirctlError, match="expected HOST:PORT"):
        transport.parse_endpoint(text)


def test_ipv6_and_names_parse() -> None:
    assert transport.parse_endpoint("[::1]:50052") == ("::1", 50052)
    assert transport.parse_endpoint("gpu-box.lan:50052") == ("gpu-box.lan", 50052)
    assert all(hostloopback.is_loopback(host) for host in ("::1", "127.0.0.2", "localhost"))
    assert not hostloopback.is_loopback("192.0.2.10") and not hostloopback.is_loopback("gpu-box.lan")


def test_loopback_backends_go_through_the_host_loopback_mapping() -> None:
    plan = transport.remote_rpc_plan(["127.0.0.1:50052", "localhost:50053"], ngl=99)
    assert plan.llama_args == ["--rpc", "10.0.2.2:50052,10.0.2.2:50053", "--n-gpu-layers", "99"]
    assert plan.network_options == {"slirp4netns": ["allow_host_loopback=true"]} and not plan.tunnels


def test_a_network_backend_is_refused_without_ssh_or_the_insecure_flag() -> None:
    with pytest.raises(ApirctlError, match="no authentication") as err:
        transport.remote_rpc_plan(["192.0.2.10:50052"], ngl=99)
    assert err.value.hint and "--via-ssh" in err.value.hint and "--insecure-network" in err.value.hint
    plan = transport.remote_rpc_plan(["192.0.2.10:50052", "127.0.0.1:50052"], ngl=99, insecure_network=True)
    assert plan.llama_args[:2] == ["--rpc", "192.0.2.10:50052,10.0.2.2:50052"]


@pytest.mark.parametrize("via", ["host", "@host", "user@"])
def test_via_ssh_needs_user_at_host(via: str) -> None:
    with pytest.raises(ApirctlError, match="USER@HOST"):
        tunnel.split_via(via)


def test_via_ssh_port() -> None:
    assert tunnel.split_via("me@gpu:2222") == ("me@gpu", ["-p", "2222"])
    assert tunnel.split_via("me@gpu") == ("me@gpu", [])


def _can_run_sshd() -> bool:
    return (os.geteuid() == 0 and Path(SSHD).exists() and shutil.which("ssh") is not None
            and shutil.which("ssh-keygen") is not None and shutil.which("unshare") is not None)


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[tuple[str, list[str]]]:
    """A real sshd on 127.0.0.1 accepting one key; yields (USER@127.0.0.1:PORT, ssh arguments)."""
    if not _can_run_sshd():
        pytest.skip("needs root, OpenSSH's sshd (or TEST_SSHD), ssh, ssh-keygen and unshare")
    for key in ("host", "user"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / key)], check=True)
    (tmp_path / "authorized_keys").write_text((tmp_path / "user.pub").read_text())
    port = free_port()
    (tmp_path / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {tmp_path / 'host'}\n"
        f"AuthorizedKeysFile {tmp_path / 'authorized_keys'}\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nAllowTcpForwarding yes\nPidFile none\n")
    passwd = tmp_path / "passwd"
    text = Path("/etc/passwd").read_text()
    if not any(line.startswith("sshd:") for line in text.splitlines()):
        text += "sshd:x:74:65534::/run/sshd:/usr/sbin/nologin\n"
    passwd.write_text(text)
    script = (f"mount --bind {passwd} /etc/passwd && mount -t tmpfs none /run && mkdir -m 755 /run/sshd && "
              f"exec {SSHD} -D -e -f {tmp_path / 'sshd_config'}")
    log = (tmp_path / "sshd.log").open("wb")
    server = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert server.poll() is None, (tmp_path / "sshd.log").read_text()
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline, "sshd did not listen"
            time.sleep(0.05)
        args = ["-i", str(tmp_path / "user"), "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                "-o", "LogLevel=ERROR"]
        yield f"{getpass.getuser()}@127.0.0.1:{port}", args
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.integration
def test_a_backend_through_an_ssh_tunnel(backend: int, sshd: tuple[str, list[str]]) -> None:
    via, args = sshd
    plan = transport.remote_rpc_plan([f"127.0.0.1:{backend}"], ngl=99, via_ssh=via, ssh_args=args)
    try:
        assert len(plan.tunnels) == 1
        (opened,) = tunnel.tunnels()
        assert opened.pid == plan.tunnels[0] and opened.target == f"127.0.0.1:{backend}"
        assert plan.llama_args[:2] == ["--rpc", f"10.0.2.2:{opened.local_port}"]
        assert rpc_client.probe("127.0.0.1", opened.local_port).devices  # the RPC protocol through SSH
    finally:
        tunnel.close(plan.tunnels)
    assert not tunnel.tunnels()
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", opened.local_port)) != 0, "the tunnel's local end is closed"


@pytest.mark.integration
def test_a_container_uses_a_backend_through_ssh(
    backend: int, sshd: tuple[str, list[str]], podman: str, llama_image: str, demo_model: Path
) -> None:

    via, args = sshd
    plan = transport.remote_rpc_plan([f"127.0.0.1:{backend}"], ngl=99, via_ssh=via, ssh_args=args)
    try:
        spec = plan.apply(containers.ContainerSpec(
            image=llama_image, name=f"apirctl-test-{uuid.uuid4().hex[:8]}", entrypoint=["/app/bin/llama-bench"],
            command=["-m", "/models/demo.gguf", "-p", "8", "-n", "4", "-r", "1", "-o", "json"],
            mounts=[containers.BindMount(source=demo_model, target="/models/demo.gguf")],
        ))
        result = containers.run_once(spec, timeout=300)
        assert result.exit_code == 0, result.output[-2000:]
        assert plan.llama_args[1] in result.output  # llama-bench names the RPC device it used
    finally:
        tunnel.close(plan.tunnels)


@pytest.mark.skipif(shutil.which("ssh") is None, reason="needs OpenSSH's client")
def test_unreachable_ssh_is_a_one_line_error() -> None:
    with pytest.raises(ApirctlError, match=r"ssh to .* failed") as err:
        tunnel.open_tunnel(f"{getpass.getuser()}@127.0.0.1:{free_port()}", "127.0.0.1", 50052,
                           ssh_args=["-o", "ConnectTimeout=5"], timeout=20)
    assert "\n" not in err.value.message and err.value.hint and "ssh" in err.value.hint
    assert not tunnel.tunnels()


@pytest.mark.integration
def test_a_tunnel_to_nothing_fails_with_what_to_start(sshd: tuple[str, list[str]]) -> None:
    via, args = sshd
    with pytest.raises(ApirctlError, match="no RPC backend answered") as err:
        tunnel.open_tunnel(via, "127.0.0.1", free_port(), ssh_args=args, timeout=5)
    assert err.value.hint and "machine restart --remoting" in err.value.hint
    assert not tunnel.tunnels()
