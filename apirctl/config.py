"""Settings: defaults < config file < `APIRCTL_*` variables < command-line flags.

Each effective value remembers where it came from, so `apirctl config show` can
tell a user why a value is what it is.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from apirctl.errors import ApirctlError
from apirctl.paths import dirs

ENV_PREFIX = "APIRCTL_"
Transport = Literal["auto", "gpu", "virtgpu", "rpc", "none"]
Isolation = Literal["container", "vm"]
VmAccel = Literal["auto", "kvm", "tcg"]
RpcNetwork = Literal["auto", "slirp4netns", "pasta"]
RpcListen = Literal["unix", "tcp"]


class Settings(BaseModel):
    """Every knob apirctl reads. Field descriptions are shown by `apirctl config show`."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    default_model: str = Field("smollm2", description="model used when a command names none")
    port: int = Field(1234, gt=1024, lt=65536, description="host port of `apirctl serve`")
    host_ip: str = Field("127.0.0.1", description="host address the inference API is published on")
    transport: Transport = Field("auto", description="remoting transport for serve and bench")
    isolation: Isolation = Field("container", description="what serve runs llama-server in: a Podman container, "
                                 "or a QEMU micro-VM of the same image (vm)")
    vm_accel: VmAccel = Field("auto", description="vm isolation's accelerator: kvm, tcg (emulated, slow), or auto "
                              "(kvm where it runs ordinary guests, else tcg, saying why)")
    image: str | None = Field(None, description="container image for serve/bench (default: the local build)")
    ctx_size: int = Field(4096, ge=0, description="llama-server context size")
    ngl: int = Field(999, ge=0, description="layers offloaded to the GPU backend")
    threads: int | None = Field(None, ge=1, description="CPU threads for llama.cpp (default: its own choice)")
    health_timeout: float = Field(300.0, gt=0, description="seconds serve waits for the server to be ready")
    rpc_listen: RpcListen = Field(
        "unix", description="where the host RPC backend listens: unix (a socket in the runtime directory; each local "
        "remoting container gets a backend of its own, over shared memory) or tcp (127.0.0.1:rpc_port, for SSH "
        "tunnels from other hosts)"
    )
    rpc_port: int = Field(50052, gt=1024, lt=65536, description="port of the host RPC remoting backend (tcp)")
    rpc_cache: bool = Field(True, description="let the RPC backend cache model weights on disk")
    rpc_network: RpcNetwork = Field(
        "auto", description="how rpc containers reach the backend on the host's loopback: slirp4netns or pasta "
        "(auto: slirp4netns when installed, else pasta; containers in a podman machine use its gateway)"
    )
    apir_trace: bool = Field(
        False, description="Linux virtgpu: each server's apir-host writes a trace of every command (`apirctl apir "
        "trace` reads it)"
    )
    build_jobs: int | None = Field(None, ge=1, description="parallel jobs for the llama.cpp build")
    cuda_architectures: str | None = Field(
        None, description="CUDA architectures of the host build, e.g. 90 (CMAKE_CUDA_ARCHITECTURES; default: CMake's)"
    )
    native_cpu: bool = Field(
        True, description="build llama.cpp for this host's CPU (GGML_NATIVE); false builds it for any x86-64 CPU with "
        "AVX2, FMA and F16C: an image that runs on other machines, and in VMs on QEMU's emulation (no AVX-512)"
    )
    machine_name: str | None = Field(None, description="podman machine name (macOS)")
    model_aliases: dict[str, str] = Field(default_factory=dict, description="extra model short names")
    resident: bool = Field(
        False, description="run commands in forks of a warm resident process (faster start-up; docs/resident.md)"
    )


FIELDS = tuple(Settings.model_fields)


class Sourced(BaseModel):
    """The effective settings and, for each key, the layer that set it."""

    settings: Settings
    sources: dict[str, str]


REPAIR_HINT = "fix it with `apirctl config edit`, or remove a setting with `apirctl config unset KEY`"


def _file_error(path: Path, where: str, what: str) -> ApirctlError:
    return ApirctlError(f"config file {path}, {where}: {what}", hint=REPAIR_HINT)


def _decode(path: Path, data: bytes) -> str:
    """The file's text; a byte that is not UTF-8 is named by its line (TOML files are UTF-8)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise _file_error(path, f"line {line}", f"not UTF-8 text (byte 0x{data[exc.start]:02x} at column {column})") \
            from None


def _parse(path: Path, text: str) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        found = re.search(r"^(.*?) \(at line (\d+), column (\d+)\)", str(exc))
        if found:
            what = found.group(1)
            raise _file_error(path, f"line {found.group(2)}", f"invalid TOML: {what[:1].lower()}{what[1:]}") from None
        raise _file_error(path, "line ?", f"invalid TOML: {exc}") from None


def key_line(text: str, key: str) -> int | None:
    """The line (1-based) that sets top-level `key`, for messages that point at the file."""
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("["):
            return None  # tables follow: top-level keys all come before the first one
        if re.match(rf"""\s*["']?{re.escape(key)}["']?\s*=""", line):
            return number
    return None


def _read_config_file(path: Path) -> tuple[dict[str, Any], str]:
    """The file's settings and its text ({} and "" when there is none); any unreadable, non-UTF-8 or
    invalid file is one error that names the file and the line."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}, ""
    except OSError as exc:
        raise ApirctlError(f"config file {path}: cannot read it ({exc.strerror})",
                           hint="check its permissions, or set APIRCTL_HOME to use another folder") from None
    text = _decode(path, data)
    values = _parse(path, text)
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        line = key_line(text, unknown[0])
        raise _file_error(path, f"line {line}" if line else "a table", f"unknown key {unknown[0]!r}")
    return values, text


def _read_env(environ: dict[str, str]) -> dict[str, Any]:
    import json

    values: dict[str, Any] = {}
    for name in FIELDS:
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is None:
            continue
        if name == "model_aliases":
            try:
                values[name] = json.loads(raw)
            except ValueError as exc:
                raise ApirctlError(f"{ENV_PREFIX}{name.upper()}: not a JSON object ({exc})") from exc
        elif raw == "" and Settings.model_fields[name].default is None:
            values[name] = None
        else:
            values[name] = raw
    return values


def _validate(merged: dict[str, Any], sources: dict[str, str], file_text: str = "") -> Settings:
    try:
        return Settings.model_validate(merged)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = str(err["loc"][0]) if err["loc"] else "?"
        origin = sources.get(key, "default")
        hint = None
        if origin.startswith("config file"):
            line = key_line(file_text, key)
            origin += f", line {line}" if line else ""
            hint = REPAIR_HINT
        raise ApirctlError(f"invalid setting {key!r} (from {origin}): {err['msg']}", hint=hint) from None


def load(overrides: dict[str, Any] | None = None, environ: dict[str, str] | None = None) -> Sourced:
    """Merge the four layers; `overrides` are command-line flags (None values are ignored)."""
    env = dict(os.environ) if environ is None else environ
    path = dirs().config_file
    from_file, text = _read_config_file(path)
    layers: list[tuple[str, dict[str, Any]]] = [
        (f"config file {path}", from_file),
        ("environment", _read_env(env)),
        ("command line", {k: v for k, v in (overrides or {}).items() if v is not None}),
    ]
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {name: "default" for name in FIELDS}
    for origin, values in layers:
        for key, value in values.items():
            if key not in FIELDS:
                raise ApirctlError(f"unknown setting {key!r} (from {origin})")
            merged[key] = value
            sources[key] = origin
    return Sourced(settings=_validate(merged, sources, text), sources=sources)


def settings(**overrides: Any) -> Settings:
    """Shortcut for library code: the effective settings with optional flag overrides."""
    return load(overrides).settings


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Serialise read-modify-write of the config file (two `config set` at once lose nothing). The
    lock is on the config folder itself, so no lock file is ever left behind."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _replace(path: Path, text: str) -> None:
    """Write `text` as the new file atomically (a temporary file in the same folder, then rename),
    keeping the old file's permissions; nothing is left behind when it fails."""
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".config.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        with contextlib.suppress(FileNotFoundError):
            os.chmod(tmp, path.stat().st_mode & 0o777)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _coerce(key: str, raw: str, path: Path) -> Any:
    """The typed value of `config set KEY RAW`, validated alone (nothing is written when it fails)."""
    import json

    value: Any = raw
    if key == "model_aliases":
        try:
            value = json.loads(raw)
        except ValueError as exc:
            raise ApirctlError(f"model_aliases: not a JSON object ({exc})",
                               hint='e.g. apirctl config set model_aliases \'{"tiny": "/models/tiny.gguf"}\'') from None
    elif raw == "" and Settings.model_fields[key].default is None:
        return None
    try:
        checked = Settings.model_validate({key: value})
    except ValidationError as exc:
        raise ApirctlError(f"invalid value {raw!r} for {key}: {exc.errors()[0]['msg']}",
                           hint=f"{path} is unchanged; `apirctl config show` lists each setting's value") from None
    return getattr(checked, key)


def write_value(key: str, raw: str | None) -> Path:
    """Set (or with `raw=None`, remove) one key in the config file.

    The file is edited with tomlkit, so the user's comments, order and layout stay; it is validated
    before it replaces the old one atomically. `unset` also repairs a file that does not parse: it
    drops the lines that set `key`, and writes the result if the rest is valid.
    """
    import tomlkit

    path = dirs().config_file
    if raw is not None and key not in FIELDS:
        raise ApirctlError(f"unknown setting {key!r}", hint=f"known settings: {', '.join(FIELDS)}")
    value = None if raw is None else _coerce(key, raw, path)
    with _file_lock(path):
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            data = b""
        except OSError as exc:
            raise ApirctlError(f"config file {path}: cannot read it ({exc.strerror})",
                               hint="check its permissions, or set APIRCTL_HOME to use another folder") from None
        if raw is None:
            text = _without_key(path, data, key)
        else:
            text = _decode(path, data)
            _parse(path, text)
        doc = tomlkit.parse(text) if text.strip() else _new_document()
        if raw is None and key not in FIELDS and key not in doc and text == data.decode("utf-8", "replace"):
            raise ApirctlError(f"unknown setting {key!r}", hint=f"known settings: {', '.join(FIELDS)}")
        if raw is None or value is None:
            doc.pop(key, None)
        elif isinstance(value, dict):
            table = tomlkit.inline_table()
            table.update(value)
            doc[key] = table
        else:
            doc[key] = value
        new_text = tomlkit.dumps(doc)
        if raw is not None:  # removing a key never makes a file worse: unset may leave other faults
            values, _ = _checked_text(path, new_text)
            _validate(values, {k: f"config file {path}" for k in values}, new_text)
        _replace(path, new_text)
    return path


def _new_document() -> Any:
    import tomlkit

    doc = tomlkit.document()
    doc.add(tomlkit.comment("apirctl settings: `apirctl config set/unset/edit` keep comments and layout"))
    return doc


def _checked_text(path: Path, text: str) -> tuple[dict[str, Any], str]:
    values = _parse(path, text)
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        line = key_line(text, unknown[0])
        raise _file_error(path, f"line {line}" if line else "a table", f"unknown key {unknown[0]!r}")
    return values, text


def _without_key(path: Path, data: bytes, key: str) -> str:
    """The file's text without `key`. A file that does not decode or parse is repaired when the
    lines that set `key` are what is wrong with it; otherwise its error (with its line) stands."""
    try:
        text = _decode(path, data)
        _parse(path, text)
        return text
    except ApirctlError as first:
        lines = data.decode("utf-8", errors="surrogateescape").splitlines(keepends=True)
        pattern = re.compile(rf"""\s*["']?{re.escape(key)}["']?\s*=""")
        kept = [line for line in lines if not pattern.match(line)]
        if len(kept) == len(lines):
            raise first from None
        repaired = "".join(kept)
        try:
            candidate = _decode(path, repaired.encode("utf-8", errors="surrogateescape"))
            _parse(path, candidate)
        except ApirctlError:
            raise first from None
        return candidate


def edit(run_editor: Callable[[Path], None], retry: Callable[[ApirctlError], bool]) -> Path:
    """`config edit`: the user edits a copy of the file; it replaces the file only once it is valid.

    `run_editor` opens the copy; `retry` is asked (with the error) whether to open it again when the
    copy is not valid. The original stays as it was until then, and the copy never outlives the call.
    """
    import tempfile

    path = dirs().config_file
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        original = path.read_bytes()
    except FileNotFoundError:
        original = (b"# apirctl settings, e.g.\n# port = 1234\n# default_model = \"smollm2\"\n")
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=".config.edit.", suffix=".toml")
    copy = Path(name)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(original)
        while True:
            run_editor(copy)
            data = copy.read_bytes()
            try:
                text = _decode(path, data)
                values, _ = _checked_text(path, text)
                _validate(values, {k: f"config file {path}" for k in values}, text)
            except ApirctlError as exc:
                if retry(exc):
                    continue
                raise ApirctlError(f"{exc.message} (not saved; {path} is unchanged)",
                                   hint="run `apirctl config edit` again to fix it") from None
            break
        with _file_lock(path):
            if data != original or not path.exists():
                _replace(path, text)
    finally:
        with contextlib.suppress(OSError):
            copy.unlink()
    return path
