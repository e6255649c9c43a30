"""Which per-container backends are stale: decided from records alone (no process is started here;
the real processes are in test_unix_transport.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from apirctl.paths import dirs, private_dir
from apirctl.remoting import backends


def record(instance_id: str, container: str = "", owner: int = 0) -> backends.Instance:
    directory = private_dir(dirs().runtime) / f"rpc-{instance_id}"
    directory.mkdir(mode=0o700)
    (directory / "rpc.sock").write_text("")  # stands for the socket
    log = dirs().logs / f"rpc-backend-{instance_id}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("RPC: shared-memory transport, rings of 8 MiB\n")
    # pid: this test process, which is no ggml-rpc-server: stopping the record never signals it
    instance = backends.Instance(id=instance_id, pid=os.getpid(), directory=str(directory), log=str(log),
                                 started_at=time.time(), owner_pid=owner, container=container)
    backends._write(instance)
    return instance


def test_a_backend_whose_container_runs_or_whose_owner_lives_is_kept() -> None:
    running = record("0000aaaa", container="c1")
    starting = record("0000bbbb", owner=os.getpid())  # a serve still setting it up
    assert backends.clean(["c1"]) == []
    assert {i.id for i in backends.instances()} == {running.id, starting.id}
    assert backends.problem(running.id) == "rpc backend down"  # the pid is no backend


def test_a_backend_whose_container_is_gone_is_removed_with_its_directory() -> None:
    dead = record("0000cccc", container="gone")
    orphan = record("0000dddd")  # a serve killed before its container existed
    kept = record("0000eeee", container="c1")
    assert sorted(backends.clean(["c1"])) == ["0000cccc", "0000dddd"]
    for instance in (dead, orphan):
        assert not Path(instance.directory).exists() and not Path(instance.log).exists()
        assert backends.get(instance.id) is None and backends.problem(instance.id) == "rpc backend gone"
    assert backends.get(kept.id) is not None and Path(kept.directory).exists()


def test_the_link_is_read_from_the_backend_log_and_ownership_released() -> None:
    instance = record("0000ffff", owner=os.getpid())
    confirmed = backends.confirm_link(instance)
    assert confirmed.link == "shm" and confirmed.owner_pid == 0
    assert backends.get(instance.id) == confirmed
    assert backends.clean([]) == ["0000ffff"]  # released and without a running container: stale


def test_only_a_directory_of_its_own_is_removed(tmp_path: Path) -> None:
    outside = tmp_path / "keep-me"
    outside.mkdir()
    instance = record("1111aaaa").model_copy(update={"directory": str(outside)})
    backends._write(instance)
    backends.stop(instance.id)
    assert outside.exists() and backends.get(instance.id) is None


def test_one_staleness_rule_for_both_kinds_the_keeping_containers_a_parameter() -> None:
    """A backend is kept by a running container, an apir-host by an existing one (stopped included):
    one `supervised.Registry` rule, the `keep` parameter picks which containers count."""
    from dataclasses import dataclass

    from apirctl.remoting import apir_hosts, supervised

    @dataclass
    class Container:
        id: str
        running: bool

    listed = [Container("up", True), Container("stopped", False)]
    assert backends._registry.keepers(listed) == ["up"]
    assert apir_hosts._registry.keepers(listed) == ["up", "stopped"]
    on_stopped = record("2222aaaa", container="stopped")
    assert backends._registry.stale(on_stopped, backends._registry.keepers(listed))
    assert not apir_hosts._registry.stale(on_stopped, apir_hosts._registry.keepers(listed))  # type: ignore[arg-type]
    owned = record("2222bbbb", container="stopped", owner=os.getpid())  # set up by a live apirctl: never stale
    assert not backends._registry.stale(owned, [])
    assert supervised.owner() == (os.getpid(), supervised.proc_state(os.getpid())[1])  # type: ignore[index]
