"""Podman: finding or starting the API service, containers, images and pulls.

`engine` is the connection (socket discovery, `podman system service`, the restricted-host fix,
podman-py's client); `containers` is the one seam every container operation goes through
(`PodmanApi`, `connect()`, `ContainerSpec`, error translation); `libpod` is its REST calls without
podman-py (serve's hot path); `images` pulls; `servers` lists inference servers from their labels.
Submodules are imported by name; this package imports nothing itself, so that naming it costs no
start-up time.
"""

__all__ = ["containers", "engine", "images", "libpod", "servers"]
