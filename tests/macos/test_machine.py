"""`machine status/restart/stop` on the macOS path, against the fakes of `podman machine`,
`codesign` and `lsof` (tests/support/fakes) and a real Mach-O krunkit chain: every state, the exact
variables of a remoting start, and the rollbacks."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from apirctl.cli import root
from apirctl.errors import ApirctlError
from apirctl.machine import MachineState, RestartOptions
from apirctl.macos import bundle, machine

from .conftest import FakeMac, Homebrew, make_release

pytestmark = pytest.mark.integration  # the Mach-O files come from the package index (cached after once)

NAME = "podman-machine-default"
REMOTING = RestartOptions(remoting=True, selftest=False)


def _mapped_virgl(fake: FakeMac) -> str | None:
    proc = fake.krunkit()
    if proc is None:
        return None
    return next((f[1] for f in proc["files"] if "libvirglrenderer" in f[1]), None)


def _expected_env(b: Any) -> dict[str, str]:
    from apirctl.paths import dirs

    return {
        "CONTAINERS_MACHINE_PROVIDER": "libkrun",
        "CONTAINERS_HELPER_BINARY_DIR": str(b.bin_dir),
        "DYLD_LIBRARY_PATH": str(b.bin_dir),
        "VIRGL_APIR_BACKEND_LIBRARY": str(b.bin_dir / "libggml-virtgpu-backend.dylib"),
        "APIR_LLAMA_CPP_GGML_LIBRARY_PATH": str(b.bin_dir / "libggml-metal.dylib"),
        "APIR_LLAMA_CPP_GGML_LIBRARY_REG": "ggml_backend_metal_reg",
        "VIRGL_ROUTE_VENUS_TO_APIR": "1",
        "VIRGL_APIR_LOG_TO_FILE": str(dirs().logs / "virglrenderer-apir.log"),
        "APIR_LLAMA_CPP_LOG_TO_FILE": str(dirs().logs / "apir-llama-cpp.log"),
    }


# --- the states -----------------------------------------------------------------------------------


def test_not_installed_without_podman(fake_mac: FakeMac, monkeypatch: pytest.MonkeyPatch) -> None:
    (fake_mac.bin / "podman").unlink()
    monkeypatch.setenv("PATH", str(fake_mac.bin))  # this Linux host has a real podman elsewhere
    st = machine.status()
    assert st.state == MachineState.NOT_INSTALLED and "podman" in st.summary


def test_not_installed_without_bundle(fake_mac: FakeMac) -> None:
    st = machine.status()
    assert st.state == MachineState.NOT_INSTALLED and st.next_step and "apirctl install" in st.next_step


def test_unknown_bundle_version(fake_mac: FakeMac, installed: Any) -> None:
    (installed.path / "src_info" / "version.txt").unlink()
    assert machine.status().state == MachineState.UNKNOWN_VERSION
    with pytest.raises(ApirctlError, match="cannot be read") as err:
        machine.restart(REMOTING)
    assert err.value.exit_code == 20


def test_vfkit_machine(fake_mac: FakeMac, installed: Any, tmp_path: Path) -> None:
    vfkit = tmp_path / "vfkit"
    vfkit.write_bytes(b"vfkit")
    fake_mac.update(lambda s: s.update(helpers={"vfkit": str(vfkit)}))
    fake_mac.add_machine(provider="applehv", running=True)
    st = machine.status()
    assert st.state == MachineState.VFKIT and "vfkit" in st.summary
    with pytest.raises(ApirctlError, match="runs with vfkit"):
        machine.restart(REMOTING)


def test_no_machine_and_stopped_machine(fake_mac: FakeMac, homebrew_on_mac: Homebrew, installed: Any) -> None:
    st = machine.status()
    assert st.state == MachineState.NOT_RUNNING and "podman machine init" in (st.next_step or "")
    with pytest.raises(ApirctlError, match="no libkrun Podman machine") as err:
        machine.restart(REMOTING)
    assert "CONTAINERS_MACHINE_PROVIDER=libkrun podman machine init" in (err.value.hint or "")
    assert fake_mac.machine_calls("stop") == []
    fake_mac.add_machine(running=False)
    assert machine.status().state == MachineState.NOT_RUNNING


def test_running_without_remoting(fake_mac: FakeMac, homebrew_on_mac: Homebrew, installed: Any) -> None:
    fake_mac.add_machine(running=True)
    st = machine.status()
    assert st.state == MachineState.NO_REMOTING
    assert st.details["virglrenderer"] == str(homebrew_on_mac.virgl.resolve())


def test_restart_with_remoting_passes_exactly_the_variables(fake_mac: FakeMac, homebrew_on_mac: Homebrew,
                                                            installed: Any) -> None:
    fake_mac.add_machine(running=True)
    st = machine.restart(REMOTING)
    assert st.state == MachineState.READY, st
    assert _mapped_virgl(fake_mac) == str(installed.bin_dir / "libvirglrenderer.1.dylib")
    starts = fake_mac.machine_calls("start")
    assert starts[-1]["argv"] == ["machine", "start", "--no-info", NAME]
    assert starts[-1]["env"] == _expected_env(installed)
    # stopped first, with the libkrun provider and without remoting variables
    calls = [c["argv"][:2] for c in fake_mac.calls("podman")]
    assert calls.index(["machine", "stop"]) < len(calls) - 1 - calls[::-1].index(["machine", "start"])
    assert fake_mac.machine_calls("stop")[-1]["env"] == {"CONTAINERS_MACHINE_PROVIDER": "libkrun"}
    ready = machine.status()
    assert ready.state == MachineState.READY
    assert ready.details["image"] == installed.image  # what `serve --transport virtgpu` runs
    # a second restart keeps the patch (nothing re-signed) and is READY again
    signs = len(fake_mac.calls("codesign"))
    assert machine.restart(REMOTING).details["krunkit_patch"] == "up to date"
    assert len(fake_mac.calls("codesign")) == signs


def test_serving_state_and_stop(fake_mac: FakeMac, homebrew_on_mac: Homebrew, installed: Any) -> None:
    fake_mac.add_machine(running=True)
    machine.restart(REMOTING)
    server = fake_mac.podman.add("apirctl-smollm2", {"llama-cpp.apir": "true", "api": "http://127.0.0.1:1234/v1"})
    fake_mac.podman.add("unrelated", {"app": "web"})
    fake_mac.podman.add("other-server", {"apirctl.version": "0", "apirctl.transport": "none"})
    st = machine.status()
    assert st.state == MachineState.SERVING and st.details["servers"] == "apirctl-smollm2"
    with pytest.raises(ApirctlError, match="apirctl-smollm2"):
        machine.stop()
    assert machine.status().state == MachineState.SERVING
    # --force is the command's: it stops the remoting servers (through `serve`), then the machine
    result = CliRunner().invoke(root.app, ["machine", "stop", "--force", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["state_name"] == "not_running"
    assert ("remove", server) in fake_mac.podman.calls
    assert sorted(c["Names"][0] for c in fake_mac.podman.containers.values()) == ["other-server", "unrelated"]


def test_rollback_after_failed_start(fake_mac: FakeMac, homebrew_on_mac: Homebrew, installed: Any) -> None:
    fake_mac.add_machine(running=True)
    fake_mac.fail("machine start", stderr="Error: krunkit exited unexpectedly with exit code 1", times=1)
    with pytest.raises(ApirctlError, match="restart with remoting failed: podman machine start failed: "
                                           "krunkit exited unexpectedly") as err:
        machine.restart(REMOTING)
    assert "restarted without remoting" in err.value.message
    starts = fake_mac.machine_calls("start")
    assert starts[-1]["env"] == {"CONTAINERS_MACHINE_PROVIDER": "libkrun"}  # the plain restart
    assert machine.status().state == MachineState.NO_REMOTING
    assert _mapped_virgl(fake_mac) == str(homebrew_on_mac.virgl.resolve())


def test_rollback_after_wrong_library(fake_mac: FakeMac, homebrew_on_mac: Homebrew, installed: Any) -> None:
    """podman ignores the helper directory and SIP strips DYLD_*: Homebrew's krunkit starts, with
    Homebrew's virglrenderer. The check by path catches it; the machine comes back without remoting."""
    fake_mac.add_machine(running=True)
    fake_mac.update(lambda s: s.update(ignore_helper_dir=True, strip_dyld=True))
    with pytest.raises(ApirctlError, match="did not load the bundle's virglrenderer") as err:
        machine.restart(REMOTING)
    assert str(homebrew_on_mac.virgl.resolve()) in err.value.message
    assert machine.status().state == MachineState.NO_REMOTING
    assert fake_mac.machine_calls("start")[-1]["env"] == {"CONTAINERS_MACHINE_PROVIDER": "libkrun"}


def test_a_same_version_elsewhere_is_not_remoting(fake_mac: FakeMac, homebrew_on_mac: Homebrew,
                                                  installed: Any, tmp_path: Path) -> None:
    """The mapped path must be the bundle's file, not any path containing the version string."""
    fake_mac.add_machine(running=True)
    elsewhere = tmp_path / f"copy-of-{installed.version}" / "libvirglrenderer.1.dylib"
    elsewhere.parent.mkdir()
    shutil.copy2(installed.bin_dir / "libvirglrenderer.1.dylib", elsewhere)

    def remap(s: dict[str, Any]) -> None:
        for proc in s["processes"].values():
            proc["files"] = [[fd, str(elsewhere) if "libvirglrenderer" in n else n] for fd, n in proc["files"]]
    fake_mac.update(remap)
    assert machine.status().state == MachineState.NO_REMOTING


def test_machine_stopped_before_stays_stopped_on_failure(fake_mac: FakeMac, homebrew_on_mac: Homebrew,
                                                         installed: Any) -> None:
    fake_mac.add_machine(running=False)
    fake_mac.fail("machine start", times=1)
    with pytest.raises(ApirctlError, match="left stopped"):
        machine.restart(REMOTING)
    assert machine.status().state == MachineState.NOT_RUNNING


def test_plain_restart_removes_remoting(fake_mac: FakeMac, homebrew_on_mac: Homebrew, installed: Any,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    fake_mac.add_machine(running=True)
    machine.restart(REMOTING)
    monkeypatch.setenv("VIRGL_ROUTE_VENUS_TO_APIR", "1")  # left over in the user's shell
    st = machine.restart(RestartOptions(remoting=False))
    assert st.state == MachineState.NO_REMOTING
    assert fake_mac.machine_calls("start")[-1]["env"] == {"CONTAINERS_MACHINE_PROVIDER": "libkrun"}


def test_selftest_failure_leaves_the_machine_alone(fake_mac: FakeMac, homebrew_on_mac: Homebrew,
                                                   installed: Any) -> None:
    """On Linux the bundle's Mach-O backend cannot load: the selftest must stop the restart early."""
    fake_mac.add_machine(running=True)
    with pytest.raises(ApirctlError, match="backend selftest of bundle"):
        machine.restart(RestartOptions(remoting=True, selftest=True))
    assert fake_mac.machine_calls("stop") == []
    assert machine.status().state == MachineState.NO_REMOTING


def test_selftest_passes_on_a_real_backend(fake_mac: FakeMac, homebrew_on_mac: Homebrew, llama_build: Any,
                                           tmp_path: Path) -> None:
    """A bundle holding the real host backend library of this machine's llama.cpp build (CPU)."""
    rel = make_release(tmp_path / "r", homebrew_on_mac.files)
    for lib in rel.glob("bin/libggml-*"):
        lib.unlink()
    for lib in llama_build.bin_dir.glob("lib*.so*"):
        shutil.copy2(lib, rel / "bin" / lib.name)
    b, _ = bundle.import_from(str(rel))
    assert (b.backend_library, b.ggml_library, b.ggml_reg) == (
        "libggml-virtgpu-backend.so", "libggml-cpu.so", "ggml_backend_cpu_reg")
    fake_mac.add_machine(running=True)
    st = machine.restart(RestartOptions(remoting=True, selftest=True))
    assert st.state == MachineState.READY and st.details["selftest"] == "passed"


def test_logs(fake_mac: FakeMac, installed: Any, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ApirctlError, match="no remoting logs yet"):
        list(machine.logs())
    env = machine.remoting_env(installed)
    log = Path(env["VIRGL_APIR_LOG_TO_FILE"])
    log.write_text("".join(f"line {i}\n" for i in range(10)))
    assert list(machine.logs(tail=2)) == [f"==> {log} <==", "line 8", "line 9"]
    assert capsys.readouterr().out == ""  # the library returns the lines; `apirctl machine logs` prints them
    result = CliRunner().invoke(root.app, ["machine", "logs", "--tail", "2"])
    assert result.exit_code == 0 and result.stdout.endswith("line 8\nline 9\n")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "apirctl", *args], capture_output=True, text=True, timeout=120,
                          check=False)


def test_cli_status_exit_code_is_the_state(fake_mac: FakeMac, homebrew_on_mac: Homebrew, installed: Any) -> None:
    fake_mac.add_machine(running=True)
    out = _cli("machine", "status", "--json")
    assert out.returncode == 12, out.stderr
    data = json.loads(out.stdout)
    assert data["state"] == 12 and data["state_name"] == "no_remoting" and data["platform"] == "macos"
    out = _cli("machine", "restart", "--remoting", "--no-selftest", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["state"] == 0
    assert _cli("machine", "status").returncode == 0
    fake_mac.fail("machine start", times=1)
    out = _cli("machine", "restart", "--remoting", "--no-selftest")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("apirctl: error: restart with remoting failed")


def test_restart_reports_each_step(fake_mac: FakeMac, homebrew_on_mac: Homebrew, installed: Any) -> None:
    fake_mac.add_machine(running=True)
    steps: list[str] = []
    machine.restart(REMOTING, progress=steps.append)
    assert steps == ["checking the libkrun machine", "patching krunkit into the bundle",
                     f"stopping machine {NAME}", f"starting machine {NAME} with API remoting",
                     "checking that krunkit loaded the bundle's virglrenderer"]


def test_named_stopped_machine_starts_with_remoting(fake_mac: FakeMac, homebrew_on_mac: Homebrew,
                                                   installed: Any) -> None:
    fake_mac.add_machine(name="gpu", running=False)
    st = machine.restart(RestartOptions(name="gpu", remoting=True, selftest=False))
    assert st.state == MachineState.READY and st.details["machine"] == "gpu"
    assert fake_mac.machine_calls("stop") == []  # nothing to stop
    assert fake_mac.machine_calls("start")[-1]["argv"] == ["machine", "start", "--no-info", "gpu"]
    assert machine.status().state == MachineState.NOT_RUNNING  # the default machine is another one
    assert machine.stop("gpu").state == MachineState.NOT_RUNNING
    assert fake_mac.machine_calls("stop")[-1]["argv"] == ["machine", "stop", "gpu"]
