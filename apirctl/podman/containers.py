"""Container operations through one seam: `PodmanApi`.

Everything apirctl does to containers and images goes through `connect()`, which returns the
implementation over the libpod REST API (`apirctl.podman.libpod`, on the standard library: serve's
measured fast path); logs and pulls use podman-py behind the same interface, and so does every call
where the service URL needs it (ssh://). Podman's refusals become `ApirctlError`s in one place,
`translate`. Tests that need no real container install an in-memory double with `use()`.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from pydantic import BaseModel, Field

from apirctl.errors import ApirctlError, tail
from apirctl.podman import engine, images, libpod

if TYPE_CHECKING:
    from podman.domain.containers import Container

_T = TypeVar("_T")

Kind = Literal["containers", "images"]
#: Podman states of a container that has not finished (run_once waits while in one of them).
ACTIVE = ("running", "created", "configured", "initialized", "stopping")


class BindMount(BaseModel):
    source: Path
    target: str
    read_only: bool = True


class HealthCheck(BaseModel):
    """A container's health check, as Podman runs it: `command` directly (no shell) every
    `interval_s`; `retries` failures in a row make it unhealthy, except during `start_period_s`
    (the model is loading)."""

    command: list[str]
    #: the check of a liveness probe (Kubernetes YAML), for which a server still loading is alive
    live_command: list[str] = Field(default_factory=list)
    interval_s: int = 30
    timeout_s: int = 10
    retries: int = 3
    start_period_s: int = 0

    def config(self) -> dict[str, Any]:
        """libpod's `healthconfig` (durations in nanoseconds, as Go's time.Duration)."""
        second = 1_000_000_000
        return {"Test": ["CMD", *self.command], "Interval": self.interval_s * second,
                "Timeout": self.timeout_s * second, "Retries": self.retries,
                "StartPeriod": self.start_period_s * second}


class ContainerSpec(BaseModel):
    """What apirctl asks Podman for; `transport.Plan.apply` and `serve` fill it in."""

    image: str
    command: list[str] = Field(default_factory=list)
    entrypoint: list[str] | None = None
    name: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    environment: dict[str, str] = Field(default_factory=dict)
    mounts: list[BindMount] = Field(default_factory=list)
    devices: list[str] = Field(default_factory=list)
    ports: dict[int, tuple[str, int]] = Field(default_factory=dict)  # container port -> (host ip, port)
    network_mode: str | None = None
    network_options: dict[str, list[str]] = Field(default_factory=dict)
    security_opt: list[str] = Field(default_factory=list)
    restart_policy: str | None = None  # Podman's: no, on-failure[:N], always, unless-stopped
    healthcheck: HealthCheck | None = None
    mem_limit: int | None = None  # bytes (Podman's --memory); None: no limit

    def restart(self) -> tuple[str, int | None] | None:
        """The policy's name and, for on-failure:N, its retry count."""
        if not self.restart_policy:
            return None
        name, _, tries = self.restart_policy.partition(":")
        return name, int(tries) if tries.isdigit() else None

    def create_kwargs(self) -> dict[str, Any]:
        """The podman-py `containers.create` arguments for this spec."""
        kwargs: dict[str, Any] = {
            "image": self.image,
            "command": self.command,
            "labels": self.labels,
            "environment": self.environment,
            "mounts": [
                {"type": "bind", "source": str(m.source), "target": m.target, "read_only": m.read_only}
                for m in self.mounts
            ],
            "devices": self.devices,
            "ports": {f"{port}/tcp": host for port, host in self.ports.items()},
            "detach": True,
        }
        if self.entrypoint is not None:
            kwargs["entrypoint"] = self.entrypoint
        if self.name:
            kwargs["name"] = self.name
        if self.network_mode:
            kwargs["network_mode"] = self.network_mode
        if self.network_options:
            kwargs["network_options"] = self.network_options
        if self.security_opt:
            # the libpod API takes SELinux options without the CLI's "label=" prefix
            kwargs["security_opt"] = [opt.removeprefix("label=") for opt in self.security_opt]
        if self.restart():
            name, tries = self.restart() or ("no", None)
            kwargs["restart_policy"] = {"Name": name, **({"MaximumRetryCount": tries} if tries else {})}
        if self.healthcheck:
            kwargs["healthcheck"] = self.healthcheck.config()
        if self.mem_limit:
            kwargs["mem_limit"] = self.mem_limit
        return kwargs


class PodmanApi(Protocol):
    """The container and image operations apirctl uses. Data comes in libpod's shapes: `list` as
    `GET /containers/json` (Id, Names, State, Labels, Created, Image), `inspect` as
    `GET /containers/{id}/json` (State.Status, State.ExitCode, Config.Labels, Created)."""

    def exists(self, kind: Kind, name: str) -> bool: ...

    def create(self, spec: ContainerSpec) -> str: ...

    def start(self, container_id: str, what: str) -> None: ...

    def inspect(self, container_id: str) -> dict[str, Any]: ...

    def list(self, label: str, all_: bool = False) -> list[dict[str, Any]]: ...

    def logs(self, container_id: str, tail: int | None = None) -> str: ...

    def follow_logs(self, container_id: str, tail: int | None = None,
                    since: int | None = None) -> Iterator[str]: ...

    def remove(self, container_id: str, timeout: int = 10) -> None: ...

    def stop(self, container_id: str, timeout: int = 10) -> None: ...

    def pull(self, ref: str, on_status: Callable[[str], None] | None = None) -> None: ...


# --- Podman's refusals, once -------------------------------------------------------------------

_IMAGE_MISSING = re.compile(r"image not known|no such image", re.IGNORECASE)
_CDI = re.compile(r"\bCDI\b")
#: How to get the CDI spec of an NVIDIA GPU (Podman hands devices over by CDI name; the vendor's tool writes the spec).
NVIDIA_CDI_FIX = ("write a CDI spec for the NVIDIA driver: `sudo apirctl gpu cdi` (or, with the NVIDIA container "
                  "toolkit, `sudo nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml`)")


def _message(exc: Exception) -> str:
    return exc.message if isinstance(exc, libpod.LibpodError) else engine.api_error_message(exc)


def translate(exc: Exception, what: str, image: str | None = None) -> ApirctlError:
    """A refusal of the Podman service (libpod's or podman-py's) as one line with what to do."""
    if isinstance(exc, ApirctlError):  # already one line (the service did not answer, ...)
        return exc
    message = _message(exc)
    status = getattr(exc, "status", None) if isinstance(exc, libpod.LibpodError) else None
    missing = type(exc).__name__ == "ImageNotFound" or _IMAGE_MISSING.search(message)
    if image is not None and (missing or status == 404):
        local = image.startswith("localhost/")
        hint = "run `apirctl setup` to build it" if local else f"pull it with `podman pull {image}`"
        return ApirctlError(f"image {image} not found", hint=hint)
    if _CDI.search(message):  # a device named by CDI that the engine has no spec for
        return ApirctlError(f"{what}: the engine cannot give the container the device ({message})",
                            hint=f"for an NVIDIA GPU, {NVIDIA_CDI_FIX}; `apirctl doctor` lists the CDI devices "
                                 "apirctl finds")
    if engine.is_restricted_failure(message):
        return ApirctlError(
            f"{what}: the host refused the container's ulimits or cgroups ({message})",
            hint="this host needs runtime runc and default_ulimits = []: unset CONTAINER_HOST so apirctl "
            "runs its own podman service with that containers.conf, or see `apirctl doctor`",
        )
    return ApirctlError(f"{what}: {message}")


# --- the implementation --------------------------------------------------------------------------


def _remove_without_service(url: str, container_id: str) -> bool:
    """Remove a container with the podman command when the service at `url` is gone: a container
    runs on without it, and would outlive the command that made it. Only for a service on this
    host (a Unix socket), whose storage the command shares; by full id, which names no other
    container anywhere. True when it is gone."""
    import subprocess

    if not url.startswith("unix://") or len(container_id) < 64:
        return False
    env = {k: v for k, v in engine.podman_env().items() if k not in ("CONTAINER_HOST", "CONTAINER_CONNECTION")}
    try:  # (either variable makes the command a client of the service that is gone)
        done = subprocess.run(engine.podman_cli("rm", "--force", "--time", "2", container_id), env=env,
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired, ApirctlError):
        return False
    return done.returncode == 0


class Libpod:
    """`PodmanApi` over the libpod REST API of the service at `url` (podman-py for logs, pulls, and
    for everything on a URL `libpod` does not speak)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.direct = libpod.supported(url)

    def _call(self, call: Callable[..., _T], *args: Any) -> _T:
        """A libpod call; when apirctl's own service died under it (killed, idled out), once more
        after starting it again."""
        try:
            return call(self.url, *args)
        except libpod.ServiceGone:
            if not engine.revive(self.url):
                raise
        return call(self.url, *args)

    def _container(self, container_id: str) -> Container:
        return engine.client().containers.get(container_id)

    def exists(self, kind: Kind, name: str) -> bool:
        if self.direct:
            return self._call(libpod.exists, kind, name)
        client = engine.client()
        return bool((client.images if kind == "images" else client.containers).exists(name))

    def create(self, spec: ContainerSpec) -> str:
        try:
            if self.direct:
                return self._call(libpod.create, spec)
            return str(engine.client().containers.create(**spec.create_kwargs()).id)
        except Exception as exc:  # libpod's or podman-py's refusal: one line, no trace
            raise translate(exc, "podman refused to create the container", image=spec.image) from exc

    def start(self, container_id: str, what: str) -> None:
        try:
            if self.direct:
                self._call(libpod.start, container_id)
            else:
                self._container(container_id).start()
        except Exception as exc:
            raise translate(exc, f"cannot start {what}") from exc

    def inspect(self, container_id: str) -> dict[str, Any]:
        try:
            if self.direct:
                return self._call(libpod.inspect, container_id)
            return dict(self._container(container_id).attrs)  # podman-py's get() is the same inspect call
        except Exception as exc:
            raise translate(exc, f"cannot inspect container {container_id[:12]}") from exc

    def list(self, label: str, all_: bool = False) -> list[dict[str, Any]]:
        if self.direct:
            return self._call(libpod.list_containers, label, all_)
        return [dict(c.attrs) for c in engine.client().containers.list(all=all_, filters={"label": label})]

    def logs(self, container_id: str, tail: int | None = None) -> str:
        kwargs: dict[str, Any] = {"stdout": True, "stderr": True}
        if tail is not None:
            kwargs["tail"] = tail
        data = self._container(container_id).logs(**kwargs)
        if isinstance(data, bytes):
            return data.decode(errors="replace")
        return b"".join(data).decode(errors="replace")

    def follow_logs(self, container_id: str, tail: int | None = None, since: int | None = None) -> Iterator[str]:
        kwargs: dict[str, Any] = {"stdout": True, "stderr": True, "stream": True, "follow": True}
        if tail is not None:
            kwargs["tail"] = tail
        if since is not None:
            kwargs["since"] = since
        pending = b""
        for chunk in self._container(container_id).logs(**kwargs):
            pending += chunk if isinstance(chunk, bytes) else str(chunk).encode()
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line.decode(errors="replace")
        if pending:
            yield pending.decode(errors="replace")

    def remove(self, container_id: str, timeout: int = 10) -> None:
        try:
            if self.direct:
                try:
                    self._call(libpod.stop, container_id, timeout)
                    self._call(libpod.delete, container_id)
                except libpod.ServiceGone:
                    if not _remove_without_service(self.url, container_id):
                        raise
                return
            from podman.errors import NotFound

            with contextlib.suppress(NotFound):
                container = self._container(container_id)
                if container.status in ("running", "paused", "stopping"):
                    container.stop(timeout=timeout)
                container.remove(force=True)
        except Exception as exc:
            raise translate(exc, f"cannot remove container {container_id[:12]}") from exc

    def stop(self, container_id: str, timeout: int = 10) -> None:
        """Stop, keeping the container (its command, ports and mounts) to start again."""
        try:
            if self.direct:
                self._call(libpod.stop, container_id, timeout)
                return
            container = self._container(container_id)
            if container.status in ("running", "paused", "stopping"):
                container.stop(timeout=timeout)
        except Exception as exc:
            raise translate(exc, f"cannot stop container {container_id[:12]}") from exc

    def pull(self, ref: str, on_status: Callable[[str], None] | None = None) -> None:
        images.pull(ref, on_status)


_override: list[PodmanApi] = []


def connect() -> PodmanApi:
    """The Podman API of this host (found, or started, by `engine.discover`), or the double in use."""
    if _override:
        return _override[-1]
    return Libpod(engine.discover().url)


@contextlib.contextmanager
def use(api: PodmanApi) -> Iterator[PodmanApi]:
    """Make `connect()` return `api` inside the block (tests use an in-memory double)."""
    _override.append(api)
    try:
        yield api
    finally:
        _override.remove(api)


# --- a container run to completion ------------------------------------------------------------------


class RunResult(BaseModel):
    exit_code: int
    output: str


def run_once(
    spec: ContainerSpec, timeout: float | None = None, on_line: Callable[[str], None] | None = None
) -> RunResult:
    """Run a container to completion and return its exit code and output; it is always removed.

    `on_line` receives output lines as they appear (bench shows llama-bench's progress with it).
    """
    api = connect()
    container_id = api.create(spec)
    try:
        api.start(container_id, spec.image)
        deadline = None if timeout is None else time.monotonic() + timeout
        shown: list[str] = []
        pump = None
        if on_line is not None:
            # Follow in a thread while this one watches the state: a follow on a container that
            # exits at once can block in some podman versions, and the deadline must hold anyway.
            def follow() -> None:
                for line in api.follow_logs(container_id):
                    shown.append(line)
                    on_line(line)

            pump = threading.Thread(target=follow, daemon=True)
            pump.start()
        while True:
            state = api.inspect(container_id).get("State") or {}
            if state.get("Status") not in ACTIVE:
                break
            if deadline is not None and time.monotonic() > deadline:
                why = tail(api.logs(container_id, tail=20), default="(no output)")
                raise ApirctlError(f"{spec.image} did not finish in {timeout:g} s: {why}")
            time.sleep(0.05)
        output = api.logs(container_id)
        if pump is not None and on_line is not None:
            pump.join(timeout=5)
            if pump.is_alive():  # the follow hung: hand over the lines it did not deliver
                for line in output.splitlines()[len(shown):]:
                    on_line(line)
        return RunResult(exit_code=int(state.get("ExitCode") or 0), output=output)
    finally:
        api.remove(container_id, timeout=2)
