"""How a container reaches the host GPU, and the Linux host side of it.

`transport` plans a container's route (`none`, `rpc`, `virtgpu`: devices, network, env, llama.cpp
flags); `hostloopback` picks the door to the host's 127.0.0.1; `tunnel` opens SSH tunnels to remote
RPC backends; `rpc_server` is the Linux machine (llama.cpp's RPC server on the host GPU) and
`rpc_client` speaks its protocol. Submodules are imported by name.
"""

__all__ = ["hostloopback", "rpc_client", "rpc_server", "transport", "tunnel"]
