"""The `passthrough` part of gpu_remoting.py (issue 24): `--transport gpu` on a real GPU, against native.

What a Linux user with an NVIDIA card and no NVIDIA container toolkit gets, built from apirctl's own
pieces on a host where Podman is not installed and nothing can be fetched:

1. Podman: Debian 12's podman, conmon, runc and the libraries they need (`--podman-debs`, .deb files),
   unpacked under the work folder (never into /), run rootful through a wrapper that sets their library
   path; conmon through a wrapper of its own (Podman starts it without LD_LIBRARY_PATH); the vfs
   storage driver, cgroupfs, a log and event file, storage and state under the work folder. Only
   /etc/containers/policy.json (where missing) and the CDI spec in /etc/cdi go to the system: Podman 4
   reads them nowhere else. Without `--podman-debs`, the podman on PATH with the same settings.
2. The CDI spec: `apirctl gpu cdi`'s own generator (`apirctl.gpu.nvidia`: the device nodes, the driver's
   libraries from the loader's cache, nvidia-smi), written to /etc/cdi/apirctl-nvidia.yaml. In a dry
   run without a GPU (`--device CPU`), the same generator over a driver made of harmless files (device
   nodes with /dev/null's numbers, small files as libraries), under a test kind.
3. The image: `apirctl.build.image.build_image` over this build (CUDA here, the CPU build in a dry
   run): `FROM scratch`, llama-server, llama-bench (and what else apirctl's image carries), the build's
   libraries and exactly the system libraries they load (ldd), the CUDA runtime (cudart, cuBLAS)
   included, the driver's excluded (the CDI spec mounts the host's).
4. A probe: `nvidia-smi -L` and `llama-bench --list-devices` in the container, run as `serve --transport
   gpu` runs it (`--device nvidia.com/gpu=all`, `label=disable`). Where the container cannot load the
   driver's libcuda (the spec mounts it where the host's loader finds it, which an image without a
   loader cache searches only in the default folders), the probe says so, and the rows run again with
   LD_LIBRARY_PATH naming the spec's library folders (recorded: it is then a fix apirctl needs).
5. Rows, per shape: native, container, native, container, native (llama-bench pp512/tg128, `--reps`);
   the container's mean over the mean of the native rows, and each container row over the native rows
   on either side of it.
6. One llama-server in the container (host network, loopback), a few completions; then the native
   llama-server, the same requests.

Results go to results.json's `passthrough` section (rewritten after each step) and to
passthrough-table.txt; the logs of every command to the harness's logs (podman.log, bench.log, ...).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpu_harness import Runner

#: llama-server's port on loopback (the container on the host's network), in the container and natively.
SERVER_PORT = 18431
SERVER_NAME = "apirctl-passthrough-server"
#: The CDI kind of a dry run's harmless driver (never nvidia.com/gpu: a real host's spec may be there).
DRYRUN_KIND = "dryrun.apirctl.dev/gpu"
DRYRUN_SPEC = "apirctl-dryrun-passthrough.yaml"
PROMPT = "The three primary colors are"
#: apirctl's image programs, where apirctl cannot be imported (the image step then fails with its reason).
FALLBACK_EXECUTABLES = ("llama-server", "llama-bench", "llama-perplexity")


def image_executables() -> tuple[str, ...]:
    """The programs apirctl's image carries: the build must make them."""
    try:
        from apirctl.build import image
    except ImportError:
        return FALLBACK_EXECUTABLES
    return tuple(image.IMAGE_EXECUTABLES)


def containers_conf(conmon: str, runc: str, tmp_dir: Path) -> str:
    """Podman's settings: runc, cgroupfs, a file for events and logs, no default ulimits (the GPU
    machine's sandbox refuses them), the engine's state under the work folder."""
    return (
        "[containers]\n"
        "default_ulimits = []\n"
        'log_driver = "k8s-file"\n'
        "[engine]\n"
        f'conmon_path = ["{conmon}"]\n'
        'runtime = "runc"\n'
        'cgroup_manager = "cgroupfs"\n'
        'events_logger = "file"\n'
        f'tmp_dir = "{tmp_dir}"\n'
        "[engine.runtimes]\n"
        f'runc = ["{runc}"]\n'
    )


def storage_conf(graphroot: Path, runroot: Path) -> str:
    return f'[storage]\ndriver = "vfs"\ngraphroot = "{graphroot}"\nrunroot = "{runroot}"\n'


def wrapper(program: str, library_path: str, lock: Path | None = None) -> str:
    """A shell script running `program` with its private libraries (and a lock held, if given)."""
    lines = ["#!/bin/sh"]
    if library_path:
        lines.append(f"export LD_LIBRARY_PATH={library_path}")
    lines.append(f'exec {f"flock {lock} " if lock else ""}{program} "$@"')
    return "\n".join(lines) + "\n"


def mean_ts(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Mean t/s per test ("pp512", "tg128") over llama-bench runs (each a list of rows)."""
    sums: dict[str, list[float]] = {}
    for row in rows:
        test = f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}"
        sums.setdefault(test, []).append(float(row["avg_ts"]))
    return {test: sum(values) / len(values) for test, values in sums.items()}


def summarize(rows: dict[str, dict[str, Any]], passes: int) -> dict[str, Any]:
    """The container's t/s against native's: means over all rows, and each container row against the
    native rows before and after it."""
    native = [r for key, entry in rows.items() if key.startswith("pt_native_") for r in entry["rows"]]
    container = [r for key, entry in rows.items() if key.startswith("pt_container_") for r in entry["rows"]]
    n, c = mean_ts(native), mean_ts(container)
    out: dict[str, Any] = {}
    for test in sorted(set(n) & set(c)):
        per_pass = []
        for i in range(passes):
            around = [rows[k]["rows"] for k in (f"pt_native_{i}", f"pt_native_{i + 1}") if k in rows]
            mine = rows.get(f"pt_container_{i}")
            if mine and around:
                base = mean_ts([r for group in around for r in group]).get(test)
                value = mean_ts(mine["rows"]).get(test)
                if base and value:
                    per_pass.append(round(value / base, 3))
        out[test] = {"native_ts": round(n[test], 1), "container_ts": round(c[test], 1),
                     "ratio": round(c[test] / n[test], 3), "per_pass": per_pass}
    return out


class Passthrough:
    """The part's steps, on the harness's Runner (its steps, logs, deadline and llama-bench rows)."""

    def __init__(self, runner: Runner) -> None:
        self.r = runner
        self.work = runner.work / "passthrough"
        self.root = self.work / "podman-root"
        self.podman: str | None = None
        self.device: str | None = None  # the CDI name handed to the container
        self.driver: Any = None  # apirctl.gpu.nvidia.NvidiaDriver
        self.spec_path: Path | None = None
        self.tag: str | None = None
        self.extra: list[str] = []  # podman run options the probe found necessary (-e LD_LIBRARY_PATH=...)
        self.results: dict[str, Any] = runner.results.setdefault("passthrough", {})
        self.passes = 2
        #: llama-bench's tests (-p, -n) and the completions' length: a dry run on a CPU only checks the steps.
        self.tests = ("64", "16") if self.dry_run else ("512", "128")
        self.tokens = 16 if self.dry_run else 128

    @property
    def dry_run(self) -> bool:
        return self.r.args.device == "CPU"

    # -- 1 and 2, before the build ------------------------------------------------------
    def prepare(self) -> None:
        self.r.step("passthrough/podman", self.setup_podman, need=0)
        self.r.step("passthrough/cdi", self.write_cdi, need=0)

    def setup_podman(self) -> None:
        debs: Path | None = self.r.args.podman_debs
        self.work.mkdir(parents=True, exist_ok=True)
        if debs is not None:
            packages = sorted(debs.glob("*.deb"))
            if not packages:
                raise RuntimeError(f"no .deb files in {debs}")
            if not (self.root / "usr" / "bin" / "podman").exists():
                t0 = time.monotonic()
                for deb in packages:
                    self.r.run(["dpkg-deb", "-x", str(deb), str(self.root)], "podman.log")
                self.results["unpack_s"] = round(time.monotonic() - t0, 1)
            real = str(self.root / "usr" / "bin" / "podman")
            conmon = str(self.root / "usr" / "bin" / "conmon")
            runc = str(self.root / "usr" / "sbin" / "runc")
            libdirs = [str(p) for pattern in ("usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu")
                       for p in self.root.glob(pattern)]
            self.results["debs"] = [deb.name for deb in packages]
        else:
            found = shutil.which("podman")
            runc_found = shutil.which("runc")
            conmon = next((c for c in (shutil.which("conmon"), "/usr/libexec/podman/conmon", "/usr/bin/conmon")
                           if c and Path(c).exists()), "")
            if not found or not runc_found or not conmon:
                raise RuntimeError("no podman, runc or conmon here, and no --podman-debs")
            real, runc, libdirs = found, runc_found, []
        library_path = ":".join(libdirs)
        bin_dir = self.work / "bin"
        bin_dir.mkdir(exist_ok=True)
        for name, program, lock in (("conmon", conmon, None), ("podman", real, self.r.args.podman_lock)):
            script = bin_dir / name
            script.write_text(wrapper(program, library_path, lock))
            script.chmod(0o755)
        conf = self.work / "conf"
        conf.mkdir(exist_ok=True)
        (conf / "containers.conf").write_text(containers_conf(str(bin_dir / "conmon"), runc, self.work / "tmp"))
        (conf / "storage.conf").write_text(storage_conf(self.work / "storage", self.work / "run"))
        policy = Path("/etc/containers/policy.json")
        if not policy.exists():  # containers/image reads it there only (rootful)
            policy.parent.mkdir(parents=True, exist_ok=True)
            shipped = self.root / "etc" / "containers" / "policy.json"
            policy.write_text(shipped.read_text() if shipped.exists()
                              else '{"default": [{"type": "insecureAcceptAnything"}]}\n')
            self.results["wrote_policy"] = str(policy)
        os.environ["PATH"] = f"{bin_dir}:{os.environ['PATH']}"  # apirctl's image build finds podman on PATH
        os.environ["CONTAINERS_CONF"] = str(conf / "containers.conf")
        os.environ["CONTAINERS_STORAGE_CONF"] = str(conf / "storage.conf")
        self.podman = str(bin_dir / "podman")
        version = self.r.run([self.podman, "version", "--format", "{{.Client.Version}}"], "podman.log", timeout=180)
        info = self.r.run([self.podman, "info", "--format", "json"], "podman.log", timeout=180)
        host = json.loads(info.stdout)
        self.results["podman"] = {
            "version": version.stdout.strip(),
            "storage_driver": host.get("store", {}).get("graphDriverName"),
            "cgroup_manager": host.get("host", {}).get("cgroupManager"),
            "runtime": host.get("host", {}).get("ociRuntime", {}).get("version", "").splitlines()[:1],
        }
        self.r.log(f"passthrough: podman {self.results['podman']}")

    def write_cdi(self) -> None:
        """`apirctl gpu cdi`'s spec, by its own functions; in a dry run over a driver of harmless files."""
        from apirctl.gpu import nvidia

        if self.dry_run:
            self.driver = self.fake_driver(nvidia)
            kind, path = DRYRUN_KIND, Path("/etc/cdi") / DRYRUN_SPEC
        else:
            self.driver = nvidia.find_driver()
            kind, path = nvidia.KIND, Path("/etc/cdi") / nvidia.SPEC_NAME
        problem = nvidia.problem(self.driver)
        if problem:
            raise RuntimeError(f"no CDI spec: {problem}")
        text = nvidia.render(nvidia.spec(self.driver, kind=kind))
        nvidia.write(text, path)
        self.spec_path = path
        self.device = f"{kind}=all"
        (self.r.logs / "cdi-spec.yaml").write_text(text)
        self.results["cdi"] = {"path": str(path), "device": self.device, "driver": self.driver.model_dump(),
                               "missing_libraries": self.driver.missing_libraries}
        self.r.log(f"passthrough: CDI spec {path} ({len(self.driver.gpus)} GPU, "
                   f"libraries {sorted(self.driver.libraries)}, smi {self.driver.smi})")

    def fake_driver(self, nvidia: Any) -> Any:
        """A driver made of harmless files, as tests/serve/test_serve_gpu.py makes it."""
        fake = self.work / "fake-driver"
        shutil.rmtree(fake, ignore_errors=True)
        (fake / "dev").mkdir(parents=True)
        (fake / "lib").mkdir()
        for node in ("nvidia0", "nvidiactl", "nvidia-uvm"):  # /dev/null's numbers under the driver's names
            os.mknod(fake / "dev" / node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        for name in nvidia.LIBRARIES:
            (fake / "lib" / name).write_text(f"the driver's {name}\n")
        smi = fake / "nvidia-smi"
        smi.write_text("#!/bin/sh\necho 'GPU 0: a dry run (no GPU)'\n")
        smi.chmod(0o755)
        cache = "".join(f"\t{name} (libc6,x86-64) => {fake / 'lib' / name}\n" for name in nvidia.LIBRARIES)
        return nvidia.find_driver(fake / "dev", cache, smi=str(smi), machine="x86-64")

    # -- 3 to 6, after the build ----------------------------------------------------------
    def measure(self) -> None:
        if self.podman is None or self.device is None:
            self.r.log("passthrough: no podman or no CDI device (see above): no container rows")
            return
        self.r.step("passthrough/image", self.build_image, need=60)
        if self.tag is None:
            return
        self.r.step("passthrough/probe", self.probe, need=30)
        if "probe" not in self.results or not self.results["probe"].get("ok"):
            return
        for shape in self.r.args.shapes:
            if shape in self.r.models:
                self.rows(shape)
        self.r.step("passthrough/server", self.server, need=45)
        table = self.table()
        (self.r.out / "passthrough-table.txt").write_text(table + "\n")
        print(table, flush=True)

    def build_image(self) -> None:
        """apirctl's image of this build, by apirctl's own code (`apirctl setup` builds it so)."""
        from apirctl.build import image, llamacpp

        build = llamacpp.Build(root=self.r.build, bin_dir=self.r.bin, backend="cpu" if self.dry_run else "cuda",
                               source_version=llamacpp.SOURCE_VERSION, external=True)
        tag = image.tag_for(build)
        t0 = time.monotonic()
        if image.is_current(build, tag):
            self.results["image_reused"] = True
        else:
            try:
                image.build_image(build, tag)
            except Exception as exc:  # noqa: BLE001 - the same rootfs imported still answers the question
                self.results["image_build_failed"] = f"{type(exc).__name__}: {exc}"[:800]
                self.r.log(f"passthrough: apirctl's image build failed ({exc}); importing the same rootfs instead")
                self.import_image(image, build, tag)
        built = time.monotonic() - t0
        size = self.r.run([self.podman or "podman", "image", "inspect", "--format", "{{.Size}}", tag],
                          "podman.log", timeout=60).stdout.strip()
        self.tag = tag
        self.results["image"] = {"tag": tag, "build_s": round(built, 1),
                                 "size_mb": round(int(size) / 1e6, 1) if size.isdigit() else size}
        self.r.log(f"passthrough: image {tag} ({self.results['image']['size_mb']} MB, {built:.1f}s)")

    def import_image(self, image: Any, build: Any, tag: str) -> None:
        """The fallback: apirctl's rootfs (`stage_rootfs`), imported with the Containerfile's settings."""
        rootfs = self.work / "rootfs"
        shutil.rmtree(rootfs, ignore_errors=True)
        image.stage_rootfs(build, rootfs)
        changes = ["ENV PATH=/app/bin", "ENV LD_LIBRARY_PATH=/app/bin", "ENV HOME=/tmp", "WORKDIR /tmp",
                   'ENTRYPOINT ["/app/bin/llama-server"]', f"LABEL {image.BUILD_LABEL}={build.identity}"]
        tarball = self.work / "rootfs.tar"
        self.r.run(["tar", "-C", str(rootfs), "-cf", str(tarball), "."], "podman.log")
        shutil.rmtree(rootfs, ignore_errors=True)
        self.r.run([self.podman or "podman", "import", *[o for c in changes for o in ("--change", c)], str(tarball),
                    tag], "podman.log", timeout=300)
        tarball.unlink()
        self.results["image_imported"] = True

    def run_options(self, network: str = "none") -> list[str]:
        """`podman run` as `serve --transport gpu` runs the container: the CDI device, SELinux labels off."""
        assert self.podman and self.device
        models = {str(model.resolve().parent) for model in self.r.models.values()}
        mounts = [opt for i, folder in enumerate(sorted(models)) for opt in ("-v", f"{folder}:/models{i}:ro")]
        return [self.podman, "run", "--rm", "--network", network, "--device", self.device,
                "--security-opt", "label=disable", *mounts, *self.extra]

    def in_container(self, shape: str) -> str:
        folders = sorted({str(model.resolve().parent) for model in self.r.models.values()})
        model = self.r.models[shape].resolve()
        return f"/models{folders.index(str(model.parent))}/{model.name}"

    def probe(self) -> None:
        """nvidia-smi -L and llama-bench's devices, in one container; if the container does not see the
        GPU, again with LD_LIBRARY_PATH naming the spec's library folders."""
        assert self.tag
        entry: dict[str, Any] = {"ok": False}
        self.results["probe"] = entry
        want = "CPU" if self.dry_run else "CUDA0"
        smi = f"{self.driver.smi} -L; echo ---; " if self.driver is not None and self.driver.smi else ""
        for attempt in ("as apirctl runs it", "with the driver's folders on LD_LIBRARY_PATH"):
            t0 = time.monotonic()
            proc = self.r.run([*self.run_options(), "--entrypoint", "/bin/sh", self.tag, "-c",
                               f"{smi}exec /app/bin/llama-bench --list-devices"], "probe.log", check=False, timeout=180)
            seen = proc.stdout.strip()
            entry.setdefault("attempts", []).append({"how": attempt, "rc": proc.returncode, "out": seen[-800:],
                                                     "wall_s": round(time.monotonic() - t0, 1)})
            self.r.log(f"passthrough: in the container, {attempt}: rc {proc.returncode} "
                       f"({time.monotonic() - t0:.1f}s): {seen!r}")
            if proc.returncode == 0 and (want in seen or self.dry_run):
                entry["ok"] = True
                entry["extra_options"] = list(self.extra)
                return
            if self.extra or self.driver is None:
                break
            folders = sorted({str(Path(p).parent) for p in self.driver.libraries.values()})
            self.extra = ["-e", "LD_LIBRARY_PATH=" + ":".join(["/app/bin", *folders])]
        raise RuntimeError(f"the container does not see {want} (see probe.log)")

    def rows(self, shape: str) -> None:
        """native, container, native, container, native: each container row between two native ones."""
        assert self.tag
        for i in range(self.passes):
            self.r.step(f"{shape}/pt_native_{i}", self.r.bench, f"pt_native_{i}", shape, [], None, None, None,
                        self.tests, need=25)
            self.r.step(f"{shape}/pt_container_{i}", self.r.bench, f"pt_container_{i}", shape, [], None,
                        [*self.run_options(), "--entrypoint", "", self.tag], None, self.tests, "bench.log",
                        "/app/bin/llama-bench", self.in_container(shape), need=30)
        self.r.step(f"{shape}/pt_native_{self.passes}", self.r.bench, f"pt_native_{self.passes}", shape, [], None,
                    None, None, self.tests, need=20)
        rows = {k: v for k, v in self.r.results["bench"].get(shape, {}).items() if k.startswith("pt_")}
        summary = summarize(rows, self.passes)
        self.results.setdefault("rows", {})[shape] = summary
        self.r.save()
        self.r.log(f"{shape} passthrough: {json.dumps(summary)}")

    # -- 6. llama-server --------------------------------------------------------------------
    def server(self) -> None:
        shape = next(s for s in self.r.args.shapes if s in self.r.models)
        served: dict[str, Any] = {"shape": shape}
        self.results["server"] = served
        assert self.podman and self.tag
        subprocess.run([self.podman, "rm", "-f", SERVER_NAME], capture_output=True)
        args = ["--host", "127.0.0.1", "--port", str(SERVER_PORT), "--n-gpu-layers", "99", "--parallel", "1"]
        options = [o for o in self.run_options("host") if o != "--rm"]
        t0 = time.monotonic()
        self.r.run([*options, "-d", "--name", SERVER_NAME, self.tag, "-m", self.in_container(shape), *args],
                   "server.log", timeout=120)
        try:
            served["ready_s"] = self.wait_ready(90)
            served["container"] = self.completions()
        finally:
            logs = subprocess.run([self.podman, "logs", SERVER_NAME], capture_output=True, text=True)
            (self.r.logs / "server-container.log").write_text(logs.stdout + logs.stderr)
            subprocess.run([self.podman, "rm", "-f", SERVER_NAME], capture_output=True)
        served["container_wall_s"] = round(time.monotonic() - t0, 1)
        self.r.save()
        self.r.log(f"passthrough: llama-server in the container: {json.dumps(served['container'])}")
        if self.r.left() < 25:
            return
        fh = (self.r.logs / "server-native.log").open("a")
        native = subprocess.Popen([str(self.r.bin / "llama-server"), "-m", str(self.r.models[shape]), *args],
                                  stdout=fh, stderr=subprocess.STDOUT)
        try:
            self.wait_ready(60)
            served["native"] = self.completions()
        finally:
            native.terminate()
            native.wait(10)
        c, n = served["container"]["predicted_per_second"], served["native"]["predicted_per_second"]
        served["ratio_predicted_per_second"] = round(c / n, 3) if n else None
        self.r.log(f"passthrough: llama-server native: {json.dumps(served['native'])}")

    def wait_ready(self, timeout: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            with contextlib.suppress(OSError, urllib.error.URLError), \
                    urllib.request.urlopen(f"http://127.0.0.1:{SERVER_PORT}/health", timeout=2) as resp:
                if resp.status == 200:
                    return round(time.monotonic() - t0, 1)
            time.sleep(0.5)
        raise RuntimeError(f"llama-server did not answer /health on port {SERVER_PORT} in {timeout:.0f}s")

    def completions(self, n: int = 3) -> dict[str, Any]:
        """`n` completions of `self.tokens` tokens each (EOS ignored: the models have random weights); the
        last one's timings and every one's generation speed."""
        speeds: list[float] = []
        last: dict[str, Any] = {}
        for _ in range(n):
            body = json.dumps({"prompt": PROMPT, "n_predict": self.tokens, "ignore_eos": True, "temperature": 0,
                               "cache_prompt": False}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{SERVER_PORT}/completion", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                last = json.loads(resp.read())
            speeds.append(round(float(last["timings"]["predicted_per_second"]), 1))
        timings = last["timings"]
        return {"tokens_predicted": last.get("tokens_predicted"), "content_chars": len(last.get("content", "")),
                "predicted_per_second": round(sum(speeds[1:] or speeds) / len(speeds[1:] or speeds), 1),
                "each_predicted_per_second": speeds, "prompt_per_second": round(timings["prompt_per_second"], 1)}

    # -- the table, and what the part leaves behind -------------------------------------------
    def table(self) -> str:
        lines = ["| shape | test | native t/s | container t/s | ratio | per pass |",
                 "| --- | --- | ---: | ---: | ---: | --- |"]
        for shape, summary in self.results.get("rows", {}).items():
            for test, v in summary.items():
                lines.append(f"| {shape} | {test} | {v['native_ts']} | {v['container_ts']} | {v['ratio']} | "
                             f"{', '.join(map(str, v['per_pass']))} |")
        served = self.results.get("server", {})
        if "native" in served:
            lines.append(f"\nllama-server ({served['shape']}, {self.tokens} tokens): container "
                         f"{served['container']['predicted_per_second']:.1f} t/s, native "
                         f"{served['native']['predicted_per_second']:.1f} t/s, ratio "
                         f"{served['ratio_predicted_per_second']}")
        probe = self.results.get("probe", {})
        if probe.get("extra_options"):
            lines.append(f"\nthe container needed {' '.join(probe['extra_options'])} to load the driver")
        return "\n".join(lines)

    def cleanup(self) -> None:
        """Stop a server left running; remove a dry run's spec (a real host's spec stays: it is the
        one `apirctl gpu cdi` would leave)."""
        if self.podman:
            subprocess.run([self.podman, "rm", "-f", SERVER_NAME], capture_output=True, timeout=60)
        if self.dry_run and self.spec_path is not None:
            self.spec_path.unlink(missing_ok=True)
