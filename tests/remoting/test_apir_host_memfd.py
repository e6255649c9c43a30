"""apir-host and the memfds a client sends it, with real processes: the seals are checked before the
size, so a client that truncates and seals its memfd between two checks (found by the shim of
tests/remoting/shim/memfd_race.c, which widens the window) is refused instead of mapped, and the host
goes on serving. The same check as the RPC server's (llama_patches 0001, `ggml_shm_memfd_check`)."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

from apirctl.build import llamacpp
from tests.remoting.test_apir_host_native import (
    REPLY_SIZE,
    SHMEM_CREATE,
    Client,
    apir_host,
    good_session,
    header,
)
from tests.remoting.test_shm_memfd import RACE_NAME, shim, shrink_in_the_window  # noqa: F401 (shim: a fixture)
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.skipif(sys.platform != "linux", reason="Linux transport")]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    d = tmp_path / "apir"
    d.mkdir(mode=0o700)
    return d


def test_a_resource_shrunk_between_the_checks_is_refused(llama_build: llamacpp.Build, workdir: Path,
                                                         shim: Path) -> None:  # noqa: F811
    """SHMEM_CREATE of a 1 MiB resource whose memfd is truncated to nothing and sealed while the host is
    between its checks: a host that read the size before the seals would map an empty file and die of
    SIGBUS at its first touch of the resource."""
    race_dir = workdir / "race"
    race_dir.mkdir()
    env = {"LD_PRELOAD": str(shim), "MEMFD_RACE_NAME": RACE_NAME, "MEMFD_RACE_DIR": str(race_dir)}
    with apir_host(llama_build.binary("apir-host"), llama_build, workdir, env=env) as (host, path, log):
        c = Client(path)
        c.shmem(1, REPLY_SIZE)  # an ordinary reply resource first: its memfd is not the shim's
        size = 1 << 20
        fd = os.memfd_create(RACE_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)
        socket.send_fds(c.sock, [header(SHMEM_CREATE, 2, size)], [fd])
        refused = "the memfd of resource 2 is"
        raced = shrink_in_the_window(fd, race_dir, lambda: refused.encode() in log.read_bytes())
        os.close(fd)
        assert raced, "the shim never saw apir-host check the memfd"
        assert c.closed_by_host(), "apir-host kept a client that sent a memfd it refused"
        c.close()
        wait_for("apir-host to say why", lambda: refused.encode() in log.read_bytes() or host.poll() is not None, 30)
        assert host.poll() is None, log.read_text(errors="replace")[-2000:]
        assert "the memfd of resource 2 is not a file of the announced size" in log.read_text(errors="replace")
        good_session(path)  # and it serves the next client
        assert host.poll() is None
