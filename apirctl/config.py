"""Settings: defaults < config file < `APIRCTL_*` variables < command-line flags.

Each effective value remembers where it came from, so `apirctl config show` can
tell a user why a value is what it is.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from apirctl.errors import ApirctlError
from apirctl.paths import dirs

ENV_PREFIX = "APIRCTL_"
Transport = Literal["auto", "virtgpu", "rpc", "none"]
RpcNetwork = Literal["auto", "slirp4netns", "pasta"]


class Settings(BaseModel):
    """Every knob apirctl reads. Field descriptions are shown by `apirctl config show`."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    default_model: str = Field("smollm2", description="model used when a command names none")
    port: int = Field(1234, gt=1024, lt=65536, description="host port of `apirctl serve`")
    host_ip: str = Field("127.0.0.1", description="host address the inference API is published on")
    transport: Transport = Field("auto", description="remoting transport for serve and bench")
    image: str | None = Field(None, description="container image for serve/bench (default: the local build)")
    ctx_size: int = Field(4096, ge=0, description="llama-server context size")
    ngl: int = Field(999, ge=0, description="layers offloaded to the GPU backend")
    threads: int | None = Field(None, ge=1, description="CPU threads for llama.cpp (default: its own choice)")
    health_timeout: float = Field(300.0, gt=0, description="seconds serve waits for the server to be ready")
    rpc_port: int = Field(50052, gt=1024, lt=65536, description="port of the host RPC remoting backend")
    rpc_cache: bool = Field(True, description="let the RPC backend cache model weights on disk")
    rpc_network: RpcNetwork = Field(
        "auto", description="how rpc containers reach the backend on the host's loopback: slirp4netns or pasta "
        "(auto: slirp4netns when installed, else pasta; containers in a podman machine use its gateway)"
    )
    build_jobs: int | None = Field(None, ge=1, description="parallel jobs for the llama.cpp build")
    cuda_architectures: str | None = Field(
        None, description="CUDA architectures of the host build, e.g. 90 (CMAKE_CUDA_ARCHITECTURES; default: CMake's)"
    )
    machine_name: str | None = Field(None, description="podman machine name (macOS)")
    model_aliases: dict[str, str] = Field(default_factory=dict, description="extra model short names")


FIELDS = tuple(Settings.model_fields)


class Sourced(BaseModel):
    """The effective settings and, for each key, the layer that set it."""

    settings: Settings
    sources: dict[str, str]


def _read_config_file(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ApirctlError(f"config file {path}: {exc}") from exc
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise ApirctlError(f"config file {path}: unknown key {unknown[0]!r} (known: {', '.join(FIELDS)})")
    return data


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


def _validate(merged: dict[str, Any], sources: dict[str, str]) -> Settings:
    try:
        return Settings.model_validate(merged)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = str(err["loc"][0]) if err["loc"] else "?"
        origin = sources.get(key, "default")
        raise ApirctlError(f"invalid setting {key!r} (from {origin}): {err['msg']}") from None


def load(overrides: dict[str, Any] | None = None, environ: dict[str, str] | None = None) -> Sourced:
    """Merge the four layers; `overrides` are command-line flags (None values are ignored)."""
    env = dict(os.environ) if environ is None else environ
    path = dirs().config_file
    layers: list[tuple[str, dict[str, Any]]] = [
        (f"config file {path}", _read_config_file(path)),
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
    return Sourced(settings=_validate(merged, sources), sources=sources)


def settings(**overrides: Any) -> Settings:
    """Shortcut for library code: the effective settings with optional flag overrides."""
    return load(overrides).settings


def _toml_value(value: Any) -> str:
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()) + " }"
    return json.dumps(str(value))  # a TOML basic string is a JSON string for our values


def write_value(key: str, raw: str | None) -> Path:
    """Set (or with `raw=None`, remove) one key in the config file, validated before it is written.

    The file is rewritten from its parsed content (comments are not kept) and replaced atomically.
    """
    import json

    if key not in FIELDS:
        raise ApirctlError(f"unknown setting {key!r} (known: {', '.join(FIELDS)})")
    path = dirs().config_file
    data = _read_config_file(path)
    if raw is None:
        data.pop(key, None)
    elif key == "model_aliases":
        try:
            data[key] = json.loads(raw)
        except ValueError as exc:
            raise ApirctlError(f"model_aliases: not a JSON object ({exc})") from exc
    else:
        data[key] = raw
    checked = _validate(data, {k: f"config file {path}" for k in data}).model_dump()
    lines = [f"{k} = {_toml_value(checked[k])}" for k in FIELDS if k in data and checked[k] is not None]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text("# apirctl settings (apirctl config set/unset rewrites this file)\n" + "\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path
