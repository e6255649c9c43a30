"""Servers that outlive the terminal: the container `serve` makes, as a Podman quadlet unit or Kubernetes YAML.

Both are rendered from the same `ContainerSpec` `serve` would create (image, command, model mounts,
published port, devices, network, labels, health check, memory limit), so `systemctl --user start` of the quadlet
or `podman kube play` of the YAML runs the server `apirctl serve` would have run. Podman's restart
policies map to systemd's `Restart=` and to the Pod's `restartPolicy`.

The health check becomes quadlet's `HealthCmd=` (in the `CMD ...` form, which Podman runs without a
shell) and, in the YAML, a liveness probe and a readiness probe. `podman kube play` runs only the
liveness probe, as `sh -c 'COMMAND || exit 1'` (`kill 1` under a restart policy: the container
restarts), so the liveness probe uses the check's `--live` form, for which a model still loading
(llama-server's 503) is alive; the readiness probe (200 only) is for Kubernetes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from apirctl.errors import ApirctlError
from apirctl.podman.containers import ContainerSpec

RESTART_POLICIES = ("no", "on-failure", "always", "unless-stopped")
_RESTART = re.compile(r"^(no|always|unless-stopped|on-failure(:\d+)?)$")
FORMATS = ("quadlet", "kube")
ANNOTATION_LIMIT = 63


def check_restart(policy: str) -> str:
    """A Podman restart policy (`on-failure:N` counts attempts), or a one-line error listing them."""
    if not _RESTART.match(policy):
        raise ApirctlError(f"--restart {policy!r} is not a Podman restart policy",
                           hint="one of: no, on-failure[:N], always, unless-stopped")
    return policy


def _systemd_quote(word: str) -> str:
    if word and not re.search(r'[\s"\'\\$%;]', word):
        return word
    escaped = word.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$")
    return f'"{escaped}"'


def quadlet(spec: ContainerSpec, restart: str | None = None, description: str = "") -> str:
    """A `.container` unit for Podman's quadlet generator (`~/.config/containers/systemd/NAME.container`)."""
    lines = ["[Unit]", f"Description={description or 'apirctl llama-server ' + (spec.name or '')}".rstrip(), "",
             "[Container]", f"Image={spec.image}"]
    if spec.name:
        lines.append(f"ContainerName={spec.name}")
    for mount in spec.mounts:
        lines.append(f"Volume={mount.source}:{mount.target}" + (":ro" if mount.read_only else ""))
    for port, (host_ip, host_port) in spec.ports.items():
        lines.append(f"PublishPort={host_ip + ':' if host_ip else ''}{host_port}:{port}")
    lines += [f"AddDevice={device}" for device in spec.devices]
    lines += [f"Environment={_systemd_quote(f'{k}={v}')}" for k, v in sorted(spec.environment.items())]
    lines += [f"Label={_systemd_quote(f'{k}={v}')}" for k, v in sorted(spec.labels.items())]
    if spec.network_mode:
        options = ",".join(o for values in spec.network_options.values() for o in values)
        lines.append(f"Network={spec.network_mode}" + (f":{options}" if options else ""))
    if any(opt in ("label=disable", "disable") for opt in spec.security_opt):
        lines.append("SecurityLabelDisable=true")
    if spec.entrypoint is not None:
        lines.append("PodmanArgs=--entrypoint " + _systemd_quote(json.dumps(spec.entrypoint)))
    if spec.mem_limit:  # PodmanArgs: every quadlet passes it on (its own Memory= key is not in older ones)
        lines.append(f"PodmanArgs=--memory {spec.mem_limit}")
    if spec.command:
        lines.append("Exec=" + " ".join(_systemd_quote(word) for word in spec.command))
    if spec.healthcheck:
        check = spec.healthcheck
        lines += ["HealthCmd=" + " ".join(["CMD", *check.command]), f"HealthInterval={check.interval_s}s",
                  f"HealthTimeout={check.timeout_s}s", f"HealthRetries={check.retries}",
                  f"HealthStartPeriod={check.start_period_s}s"]
    systemd_restart = {"no": "no", "always": "always", "unless-stopped": "always"}.get(
        (restart or "no").split(":")[0], "on-failure")
    lines += ["", "[Service]", f"Restart={systemd_restart}", "TimeoutStartSec=900", "",
              "[Install]", "WantedBy=default.target", ""]
    return "\n".join(lines)


def _yaml(value: Any, indent: int = 0) -> list[str]:
    """A small YAML emitter for dicts, lists and scalars (strings as JSON strings: valid YAML)."""
    pad = " " * indent
    lines: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, (dict, list)) and item:
                lines.append(f"{pad}{key}:")
                lines += _yaml(item, indent + 2)
            else:
                lines.append(f"{pad}{key}: {_scalar(item)}")
    elif isinstance(value, list):
        for item in value:
            inner = _yaml(item, indent + 2)
            if isinstance(item, (dict, list)) and item:
                lines.append(f"{pad}- {inner[0].lstrip()}")
                lines += inner[1:]
            else:
                lines.append(f"{pad}- {_scalar(item)}")
    return lines


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if value in ({}, []):
        return json.dumps(value)
    return json.dumps(str(value))


def _host_path_type(source: str | Path) -> str:
    """A mount's hostPath type: a directory (a router's --models-dir, a socket's directory) or a file."""
    return "Directory" if Path(source).is_dir() else "File"


def kube(spec: ContainerSpec, restart: str | None = None) -> str:
    """A Kubernetes Pod for `podman kube play` (apirctl's labels become annotations: label values are
    restricted in Kubernetes)."""
    name = spec.name or "apirctl-server"
    container: dict[str, Any] = {"name": "llama-server", "image": spec.image}
    if spec.entrypoint is not None:
        container["command"] = list(spec.entrypoint)
    if spec.command:
        container["args"] = list(spec.command)
    if spec.environment:
        container["env"] = [{"name": k, "value": v} for k, v in sorted(spec.environment.items())]
    container["ports"] = [{"containerPort": port, "hostPort": host_port, **({"hostIP": ip} if ip else {})}
                          for port, (ip, host_port) in spec.ports.items()]
    container["volumeMounts"] = [{"name": f"model-{i}", "mountPath": m.target, "readOnly": m.read_only}
                                 for i, m in enumerate(spec.mounts)]
    if spec.healthcheck:
        check = spec.healthcheck
        timing = {"periodSeconds": check.interval_s, "timeoutSeconds": check.timeout_s,
                  "failureThreshold": check.retries}
        live = check.live_command or check.command
        container["livenessProbe"] = {"exec": {"command": live}, "initialDelaySeconds": 5, **timing}
        container["readinessProbe"] = {"exec": {"command": list(check.command)}, "initialDelaySeconds": 1, **timing}
    if spec.mem_limit:  # bytes: a Kubernetes quantity without a unit (`podman kube play` sets --memory from it)
        container["resources"] = {"limits": {"memory": str(spec.mem_limit)}}
    if spec.devices or any("disable" in opt for opt in spec.security_opt):
        container["securityContext"] = {"seLinuxOptions": {"type": "spc_t"}}
    # Podman 4's kube play refuses annotation values over 63 characters (the Kubernetes label limit).
    annotations = {k: v for k, v in sorted(spec.labels.items()) if len(v) <= ANNOTATION_LIMIT}
    dropped = sorted(set(spec.labels) - set(annotations))
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations},
        "spec": {
            "restartPolicy": {"no": "Never", "always": "Always", "unless-stopped": "Always"}.get(
                (restart or "no").split(":")[0], "OnFailure"),
            "containers": [container],
            "volumes": [{"name": f"model-{i}", "hostPath": {"path": str(m.source), "type": _host_path_type(m.source)}}
                        for i, m in enumerate(spec.mounts)],
        },
    }
    notes = [f"# left out (longer than Podman 4 accepts in an annotation): {', '.join(dropped)}"] if dropped else []
    if spec.devices:
        notes.append(f"# devices {', '.join(spec.devices)}: pass them with `podman kube play --device` (not in a Pod)")
    if spec.network_mode:
        notes.append(f"# network {spec.network_mode}: `podman kube play --network {spec.network_mode}`")
    return "\n".join(["# apirctl serve --generate kube: `podman kube play THIS.yaml`", *notes, *_yaml(pod), ""])
