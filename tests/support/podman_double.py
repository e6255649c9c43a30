"""An in-memory double of the Podman seam (`apirctl.podman.containers.PodmanApi`).

For tests that need Podman's answers but no real container: the macOS paths (there is no podman
machine on a Linux test host) and logic that only lists, starts or removes. Containers are kept as
libpod's list entries and answer `inspect` in libpod's inspect shape; nothing runs. Install it with
`containers.use(MemoryPodman())`. tests/podman/test_libpod.py checks the real implementation answers
in the same shapes.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

from apirctl.errors import ApirctlError
from apirctl.podman.containers import ContainerSpec, Kind

_ids = itertools.count(1)


class MemoryPodman:
    def __init__(self, images: tuple[str, ...] = ()) -> None:
        self.containers: dict[str, dict[str, Any]] = {}
        self.images: set[str] = set(images)
        self.logs_of: dict[str, str] = {}
        self.calls: list[tuple[str, str]] = []  # (operation, container id or reference)

    def add(self, name: str, labels: dict[str, str], state: str = "running", image: str = "img",
            logs: str = "") -> str:
        """A container as if created (and started, for state "running") by someone else."""
        container_id = f"{next(_ids):064x}"
        self.containers[container_id] = {"Id": container_id, "Names": [name], "Labels": dict(labels),
                                         "State": state, "Image": image, "Created": int(time.time()),
                                         "ExitCode": 0}
        self.logs_of[container_id] = logs
        return container_id

    def _find(self, ref: str) -> dict[str, Any]:
        for item in self.containers.values():
            if ref == item["Id"] or ref in item["Names"] or (len(ref) >= 6 and item["Id"].startswith(ref)):
                return item
        raise ApirctlError(f"no container with name or ID {ref!r} found")

    def exists(self, kind: Kind, name: str) -> bool:
        if kind == "images":
            return name in self.images
        try:
            self._find(name)
        except ApirctlError:
            return False
        return True

    def create(self, spec: ContainerSpec) -> str:
        self.calls.append(("create", spec.name or spec.image))
        if spec.image not in self.images:
            raise ApirctlError(f"image {spec.image} not found")
        container_id = self.add(spec.name or f"double-{len(self.containers)}", spec.labels, state="created",
                                image=spec.image)
        return container_id

    def start(self, container_id: str, what: str) -> None:
        self.calls.append(("start", container_id))
        self._find(container_id)["State"] = "running"

    def inspect(self, container_id: str) -> dict[str, Any]:
        item = self._find(container_id)
        return {"Id": item["Id"], "Name": item["Names"][0], "Created": item["Created"], "Image": item["Image"],
                "State": {"Status": item["State"], "ExitCode": item["ExitCode"]},
                "Config": {"Labels": dict(item["Labels"])}}

    def list(self, label: str, all_: bool = False) -> list[dict[str, Any]]:
        key, _, value = label.partition("=")
        return [dict(item) for item in self.containers.values()
                if (all_ or item["State"] == "running") and key in item["Labels"]
                and (not value or item["Labels"][key] == value)]

    def logs(self, container_id: str, tail: int | None = None) -> str:
        lines = self.logs_of.get(self._find(container_id)["Id"], "").splitlines(keepends=True)
        return "".join(lines[-tail:] if tail else lines)

    def follow_logs(self, container_id: str, tail: int | None = None, since: int | None = None) -> Iterator[str]:
        yield from self.logs(container_id, tail).splitlines()

    def remove(self, container_id: str, timeout: int = 10) -> None:
        self.calls.append(("remove", container_id))
        for key, item in list(self.containers.items()):
            if container_id in (key, *item["Names"]):
                del self.containers[key]

    def stop(self, container_id: str, timeout: int = 10) -> None:
        self.calls.append(("stop", container_id))
        self._find(container_id)["State"] = "exited"

    def pull(self, ref: str, on_status: Callable[[str], None] | None = None) -> None:
        self.calls.append(("pull", ref))
        self.images.add(ref)
