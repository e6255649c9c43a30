"""benchmarks/rpc_profile.py reading the whole-connection lines of `GGML_RPC_PROFILE=1` (patch 0004), which
count the GRAPH_COMPUTE steps of a served load that the per-token lines leave out."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import rpc_profile  # noqa: E402

# a probe's connection, then the busy one, as a server prints them when each client leaves
SERVER_LOG = """\
RPC profile (server): waiting 0.054 ms in all
RPC profile (server): cmd 11:        1 calls,      0.014 ms,     14.0 us each
RPC profile (server): waiting 3728.615 ms in all
RPC profile (server): cmd  6:     1409 calls,    187.452 ms,    133.0 us each
RPC profile (server): cmd 10:        5 calls,   2029.079 ms, 405815.8 us each
RPC profile (server): cmd 16:      122 calls,   2545.680 ms,  20866.2 us each
RPC profile (server): cmd 99:        2 calls,      1.000 ms,    500.0 us each
RPC profile (server): phase backend wait:      137 times,      0.032 ms,      0.2 us each
RPC profile (server): 121 tokens: waiting 22706.5 us per token
RPC profile (client): waiting 0.516 ms in all
RPC profile (client): cmd 16:        3 calls,      0.040 ms,     13.3 us each
"""


def test_the_busiest_connection_of_each_side_is_kept_with_its_commands_and_phases() -> None:
    found = rpc_profile.parse_connections(SERVER_LOG)
    server = found["server"]
    assert server["waiting_ms"] == 3728.615
    assert server["entries"]["GRAPH_COMPUTE"] == {"calls": 5, "ms": 2029.079}
    assert server["entries"]["GRAPH_RECOMPUTE"]["calls"] == 122 and server["entries"]["SET_TENSOR"]["calls"] == 1409
    assert server["entries"]["backend wait"] == {"calls": 137, "ms": 0.032}
    assert server["entries"]["cmd 99"]["calls"] == 2  # a command newer than the reader keeps its number
    assert "GET_DEVICE_MEMORY" not in server["entries"]  # the probe's connection is not the one kept
    assert found["client"]["entries"]["GRAPH_RECOMPUTE"]["calls"] == 3


def test_no_whole_connection_lines_give_no_connections() -> None:
    assert rpc_profile.parse_connections("RPC profile (server): 3 tokens: waiting 1.0 us per token\n") == {}
