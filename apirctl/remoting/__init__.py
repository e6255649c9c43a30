"""How a container reaches the host GPU, and the Linux host side of it.

`transport` plans a container's route (`none`, `gpu`, `rpc`, `virtgpu`: devices, network, env,
llama.cpp flags); `hostloopback` picks the door to the host's 127.0.0.1; `tunnel` opens SSH tunnels
to remote RPC backends; `rpc_server` is the Linux machine (llama.cpp's RPC server on the host GPU),
`backends` the per-container RPC servers and their processes, `apir_hosts` the per-container
`apir-host`s of Linux APIR (both supervised one way by `supervised`, and keep their
`records`), and `rpc_client` speaks the RPC protocol;
`machines.current()` picks this platform's machine. Submodules are imported by name.
"""

__all__ = ["apir_hosts", "backends", "hostloopback", "machines", "records", "rpc_client", "rpc_server", "supervised",
           "transport", "tunnel"]
