"""Podman: finding or starting the API service, containers, images and pulls.

`engine` is the connection (socket discovery, `podman system service`, the podman-py client and
container helpers); `libpod` is serve's hot path (exists, create, start, inspect) on the libpod REST
API without podman-py. Submodules are imported by name; this package imports nothing itself, so that
naming it costs no start-up time.
"""

__all__ = ["engine", "libpod"]
