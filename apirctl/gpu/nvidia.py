"""A CDI spec for the NVIDIA driver of this host, for hosts without the NVIDIA container toolkit.

`nvidia-ctk cdi generate` is the vendor's way; where the toolkit is not installed (many hosts, and the
GPU machines these tests borrow), `apirctl gpu cdi` writes a spec of the same shape from what the
driver installed: its device nodes, the user-space libraries a CUDA program loads, and `nvidia-smi`.
Podman then hands `nvidia.com/gpu=all` (or `=0`, `=1`, ...) to a container as it would the
toolkit's devices. The spec is written under apirctl's name (`apirctl-nvidia.yaml`, CDI 0.5.0, which
Podman 4 reads), so that `doctor` can tell whose spec a device comes from.

What a CUDA container needs, and what the toolkit's spec holds for it:
- device nodes: `/dev/nvidiaN` per GPU, and `nvidiactl`, `nvidia-uvm`, `nvidia-uvm-tools` for all;
- the driver's libraries, bind-mounted read-only where the host has them: `libcuda.so.1` (the CUDA
  driver API that llama.cpp's CUDA backend calls), `libnvidia-ml.so.1` (NVML, for nvidia-smi and
  memory queries), `libnvidia-ptxjitcompiler.so.1` and `libnvidia-nvvm.so.4` (the JIT for kernels
  not built for this GPU);
- `nvidia-smi`, for a look from inside.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import yaml
from pydantic import BaseModel, Field

from apirctl import host

KIND = "nvidia.com/gpu"
SPEC_NAME = "apirctl-nvidia.yaml"
#: The driver libraries a CUDA program loads, by soname.
LIBRARIES = ("libcuda.so.1", "libnvidia-ml.so.1", "libnvidia-ptxjitcompiler.so.1", "libnvidia-nvvm.so.4")
CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
_GPU_NODE = re.compile(r"^nvidia(\d+)$")
#: Where CUDA programs look for MPS's control daemon unless CUDA_MPS_PIPE_DIRECTORY says otherwise.
MPS_PIPE_DEFAULT = "/tmp/nvidia-mps"
MPS_CONTROL = "nvidia-cuda-mps-control"
_LDCONFIG_LINE = re.compile(r"^\s*(?P<soname>\S+) \((?P<flags>[^)]*)\) => (?P<path>\S+)\s*$")


class NvidiaDriver(BaseModel):
    """What the driver installed on this host, as a container needs it."""

    gpus: dict[str, str] = Field(default_factory=dict)  # "0" -> /dev/nvidia0
    control_nodes: list[str] = Field(default_factory=list)  # /dev/nvidiactl, /dev/nvidia-uvm, ...
    libraries: dict[str, str] = Field(default_factory=dict)  # soname -> the path the loader finds it at
    smi: str | None = None

    @property
    def missing_libraries(self) -> list[str]:
        return [name for name in LIBRARIES if name not in self.libraries]


def libraries_from_ldconfig(text: str, machine: str = "x86-64") -> dict[str, str]:
    """The driver libraries of `ldconfig -p`'s listing, for this machine's ABI (the 64-bit ones on
    x86-64: a 32-bit copy is listed too and would not load)."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        m = _LDCONFIG_LINE.match(line)
        if not m or m.group("soname") not in LIBRARIES or m.group("soname") in found:
            continue
        flags = m.group("flags")
        if machine == "x86-64" and "x86-64" not in flags:
            continue
        found[m.group("soname")] = m.group("path")
    return found


def find_driver(dev: Path = Path("/dev"), ldconfig_text: str | None = None, smi: str | None = None,
                machine: str | None = None) -> NvidiaDriver:
    """The NVIDIA driver's pieces on this host (`dev`, the loader's cache and PATH, unless given)."""
    gpus: dict[str, str] = {}
    control: list[str] = []
    try:
        names = sorted(p.name for p in dev.iterdir())
    except OSError:
        names = []
    for name in names:
        m = _GPU_NODE.match(name)
        if m:
            gpus[m.group(1)] = str(dev / name)
    control = [str(dev / name) for name in CONTROL_NODES if name in names]
    if ldconfig_text is None:
        ldconfig_text = _ldconfig()
    arch = machine or ("x86-64" if os.uname().machine == "x86_64" else os.uname().machine)
    return NvidiaDriver(gpus=dict(sorted(gpus.items(), key=lambda kv: int(kv[0]))), control_nodes=control,
                        libraries=libraries_from_ldconfig(ldconfig_text, arch),
                        smi=smi if smi is not None else shutil.which("nvidia-smi"))


def _ldconfig() -> str:
    tool = shutil.which("ldconfig") or "/sbin/ldconfig"
    try:
        return subprocess.run([tool, "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def problem(driver: NvidiaDriver) -> str | None:
    """Why no spec can be written for this driver, or None."""
    if not driver.gpus:
        return "no NVIDIA GPU device node (/dev/nvidia0, ...): is the NVIDIA driver loaded?"
    if "nvidiactl" not in {Path(n).name for n in driver.control_nodes}:
        return "no /dev/nvidiactl: the NVIDIA driver is not fully loaded"
    if "libcuda.so.1" not in driver.libraries:
        return "the NVIDIA driver's libcuda.so.1 is not in the loader's cache (`ldconfig -p`)"
    return None


def library_in_container(soname: str, path: str) -> str:
    """Where the container sees a driver library. Where the host has it when the loader searches that
    folder by itself (an image's loader has no cache to find it elsewhere, and apirctl's carries this
    host's loader); else (a driver under /usr/local/nvidia, as on many GPU servers) in the first folder
    the loader searches."""
    searched = host.loader_search_dirs()
    return path if str(Path(path).parent) in searched else f"{searched[0]}/{soname}"


def spec(driver: NvidiaDriver, kind: str = KIND) -> dict[str, object]:
    """The CDI spec of this driver: a device per GPU and `all`, the control nodes and the libraries for
    every one of them, each where `library_in_container` puts it."""
    mounts: list[dict[str, object]] = [
        {"hostPath": str(Path(path).resolve()), "containerPath": library_in_container(name, path),
         "options": ["ro", "nosuid", "nodev", "bind"]}
        for name, path in sorted(driver.libraries.items())
    ]
    if driver.smi:
        mounts.append({"hostPath": str(Path(driver.smi).resolve()), "containerPath": driver.smi,
                       "options": ["ro", "nosuid", "nodev", "bind"]})
    per_gpu = [{"name": index, "containerEdits": {"deviceNodes": [{"path": node}]}}
               for index, node in driver.gpus.items()]
    every = {"name": "all", "containerEdits": {"deviceNodes": [{"path": node} for node in driver.gpus.values()]}}
    return {
        "cdiVersion": "0.5.0",
        "kind": kind,
        "devices": [*per_gpu, every],
        "containerEdits": {
            "deviceNodes": [{"path": node} for node in driver.control_nodes],
            "mounts": mounts,
        },
    }


def render(document: dict[str, object]) -> str:
    return "# Written by `apirctl gpu cdi` for the NVIDIA driver of this host (no NVIDIA container toolkit).\n" + \
        yaml.safe_dump(document, sort_keys=False)


def write(text: str, path: Path) -> None:
    """Write the spec whole or not at all: a temporary file in the same folder, renamed over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def generated_by_apirctl(spec_file: str) -> bool:
    """Whether a spec file (as `CdiDevice.spec` names it) is the one `apirctl gpu cdi` writes."""
    return Path(spec_file).name == SPEC_NAME


def memory_by_process(text: str | None = None) -> dict[int, int]:
    """The GPU memory each process holds, in bytes by pid, as the NVIDIA driver reports it (`text`: the
    output of nvidia-smi's compute-apps query, else asked for); empty without the driver's tool. Each
    remoting backend is a CUDA context of its own, so this is what each container costs the GPU."""
    if text is None:
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return {}
        try:
            done = subprocess.run([smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return {}
        if done.returncode != 0:
            return {}
        text = done.stdout
    found: dict[int, int] = {}
    for line in text.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit():
            pid = int(fields[0])
            found[pid] = found.get(pid, 0) + int(fields[1]) * 2**20  # a process on several GPUs: summed
    return found


def memory_of(pid: int, by_process: dict[int, int]) -> int | None:
    """The GPU memory of `pid` and its children (apir-host computes in a child per client), or None
    when none of them holds any."""
    total, seen = 0, False
    for holder, used in by_process.items():
        if holder == pid or _parent(holder) == pid:
            total, seen = total + used, True
    return total if seen else None


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name may hold spaces and parentheses: the fields after its last ')' are fixed
    fields = stat[stat.rfind(")") + 2:].split()
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None


class MpsState(BaseModel):
    """CUDA MPS on this host: with its control daemon running, the kernels of several CUDA processes
    (one remoting backend per container) run on the GPU at once instead of taking turns."""

    running: bool
    pids: list[int] = Field(default_factory=list)
    pipe_directory: str  # where this user's CUDA processes look for the daemon


def mps_state(proc: Path = Path("/proc"), environ: dict[str, str] | None = None) -> MpsState:
    """Whether MPS's control daemon runs (a process whose program is nvidia-cuda-mps-control; /proc's
    `comm` cuts the name, so its command line is read), and where clients started from `environ` look
    for it. A daemon on another pipe directory than the clients' is not found by them: say which."""
    env = os.environ if environ is None else environ
    pids = []
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            argv0 = (entry / "cmdline").read_bytes().split(b"\0", 1)[0]
        except OSError:
            continue
        if Path(argv0.decode(errors="replace")).name == MPS_CONTROL:
            pids.append(int(entry.name))
    return MpsState(running=bool(pids), pids=sorted(pids),
                    pipe_directory=env.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_PIPE_DEFAULT)
