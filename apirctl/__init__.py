"""apirctl: API remoting for llama.cpp in Podman containers and VMs."""

__version__ = "0.1.0"
