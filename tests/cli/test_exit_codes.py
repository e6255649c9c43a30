"""docs/exit-codes.md's table, typed as a user types it on a host with nothing built yet: 3 for a
missing prerequisite (never the shell's 127), 1 for a command that failed, 2 for usage only, and 127
only where the upstream status script defines it (`machine status`: remoting not installed)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest


def apirctl(*args: str, home: Path, podman: str) -> subprocess.CompletedProcess[str]:
    builds = ("APIRCTL_LLAMA_BUILD", "APIRCTL_VULKAN_BUILD")  # a developer's builds elsewhere
    env = {name: value for name, value in os.environ.items() if name not in builds}
    env |= {"APIRCTL_HOME": str(home), "APIRCTL_CACHE_DIR": str(home / "cache"), "CONTAINER_HOST": podman,
            "APIRCTL_RESIDENT": "0"}
    return subprocess.run([sys.executable, "-m", "apirctl", *args], capture_output=True, text=True, timeout=300,
                          env=env)


@pytest.mark.integration
def test_each_code_means_one_thing(podman: str, demo_model: Path, tmp_path: Path) -> None:
    home = tmp_path / "fresh-home"  # no llama.cpp build, so no image and no host backend

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        done = apirctl(*args, home=home, podman=podman)
        assert "Traceback" not in done.stderr, done.stderr
        return done

    name = f"apirctl-test-{uuid.uuid4().hex[:8]}"
    try:
        unbuilt = run("serve", str(demo_model), "--transport", "none", "--name", name)
    finally:  # should this host's build be found after all, the server it started goes
        subprocess.run(["podman", "--remote", "--url", podman, "rm", "-f", name], capture_output=True, timeout=120)
    assert unbuilt.returncode == 3, unbuilt.stderr
    assert "the inference image is not built yet" in unbuilt.stderr and "hint: run `apirctl setup`" in unbuilt.stderr

    logs = run("machine", "logs")  # a listed command that has nothing to show: it failed, it was not misused
    assert logs.returncode == 1 and "has no log yet" in logs.stderr

    for usage in (["serve", "--no-such-flag"], ["chat", "-p", "hello"], ["no-such-command"], ["logs", "--tail", "x"]):
        assert run(*usage).returncode == 2, usage

    status = run("machine", "status")
    assert status.returncode == 127 and "not installed" in status.stdout
