"""macOS API remoting: bundles (`bundle`), the krunkit patch (`krunkit`) and the libkrun Podman
machine (`machine`). Tested on Linux against faithful fakes of the macOS tools. Submodules are
imported by name."""

__all__ = ["bundle", "krunkit", "machine"]
