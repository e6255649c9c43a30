"""What the GPU harness (gpu_remoting.py) and its parts (gpu_passthrough.py, gpu_serving.py, gpu_batched.py) share:
the network namespace's names and addresses, the environment that hides the GPU, how a server the run
started is stopped, and the shape of the harness's runner as a part sees it.

The harness imports its parts and the parts import this module only, so no import runs in a circle
(tests/test_architecture.py checks benchmarks/ too).
"""

from __future__ import annotations

import signal
import subprocess
from typing import Any, Protocol

#: The veth namespace the harness makes: a container's network, with the host at VETH_HOST.
NS = "apirc-bench"
VETH_HOST, VETH_NS = "10.77.0.1", "10.77.0.2"
#: The environment of a process that must not see the GPU (a client, a container's stand-in).
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}
#: A network namespace with no route: only a socket file reaches out (the container boundary).
ISOLATED = ["unshare", "--net"]


def stop(proc: subprocess.Popen[Any]) -> None:
    """End a server the run started: SIGTERM (it prints its profile and closes), then SIGKILL after 10 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Runner(Protocol):
    """The harness's runner as a part uses it: `args`, `results`, `work`, `out`, `bin`, `build`, `models`,
    `logs`, and its steps (`step`, `run`, `log`, `bench`, `save`, `left`, `server`, `setup_veth`)."""

    args: Any
    results: dict[str, Any]

    def __getattr__(self, name: str) -> Any: ...
