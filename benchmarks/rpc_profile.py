#!/usr/bin/env python3
"""The per-token timeline of both ends of ggml-rpc, from a `GGML_RPC_PROFILE=1` run.

With `GGML_RPC_PROFILE=1` (llama_patches/ 0004) the server prints, when a client leaves, and
the client prints, when its connection closes, where the time went. Besides the whole connection they
count generated tokens apart (the cycles of SET_TENSOR, GRAPH_RECOMPUTE and GET_TENSOR, without the
model's loading): waiting for the next command, each kind of command, and the phases inside them
(client: send, reply wait, reply data; server: backend wait, reply send), per token. Usage:

    rpc_profile.py LOG [LOG ...] [--json]

The logs hold the stderr of the client (llama-bench, llama-server) and of the server of one run.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # apirctl, also where it is not installed

from apirctl.remoting.rpc_client import Command  # noqa: E402 - after the path it needs

_LINE = re.compile(r"RPC profile \((client|server)\): (\d+) tokens: (.*)$")
_WAITING = re.compile(r"waiting ([\d.]+) us per token")
_CMD = re.compile(r"cmd\s+(\d+): ([\d.]+) calls, ([\d.]+) us per token")
_PHASE = re.compile(r"phase ([a-z ]+): ([\d.]+) times, ([\d.]+) us per token")

#: side -> {"tokens": n, "entries": {name: {"per_token": count, "us_per_token": time}}}
Timeline = dict[str, dict]


def command_name(number: str) -> str:
    """A command's name as the protocol gives it, or `cmd N` for one newer than this reader."""
    try:
        return Command(int(number)).name
    except ValueError:
        return f"cmd {number}"


def parse(text: str) -> Timeline:
    """The per-token lines in `text`, per side; where several connections generated tokens, the one
    that generated the most (the others are probes and warm-ups)."""
    found: dict[tuple[str, int], dict[str, dict[str, float]]] = {}
    for line in text.splitlines():
        m = _LINE.search(line)
        if not m:
            continue
        side, tokens, rest = m.group(1), int(m.group(2)), m.group(3)
        if w := _WAITING.match(rest):
            name, count, us = "waiting", 0.0, float(w.group(1))
        elif c := _CMD.match(rest):
            name, count, us = command_name(c.group(1)), float(c.group(2)), float(c.group(3))
        elif p := _PHASE.match(rest):
            name, count, us = p.group(1).strip(), float(p.group(2)), float(p.group(3))
        else:
            continue
        found.setdefault((side, tokens), {})[name] = {"per_token": count, "us_per_token": us}
    timeline: Timeline = {}
    for (side, tokens), entries in found.items():
        if tokens > timeline.get(side, {}).get("tokens", 0):
            timeline[side] = {"tokens": tokens, "entries": entries}
    return timeline


_ALL_WAITING = re.compile(r"RPC profile \((client|server)\): waiting ([\d.]+) ms in all$")
_ALL_CMD = re.compile(r"RPC profile \((client|server)\): cmd\s+(\d+):\s+(\d+) calls,\s+([\d.]+) ms,")
_ALL_PHASE = re.compile(r"RPC profile \((client|server)\): phase ([a-z ]+):\s+(\d+) times,\s+([\d.]+) ms,")


def parse_connections(text: str) -> dict[str, dict]:
    """Each side's busiest whole connection (the one with the most graph computes and recomputes: others
    are probes): the time waiting for the next command, and per command and phase the calls and the
    milliseconds. Under serving load most steps change the graph, so they are GRAPH_COMPUTE cycles,
    which the per-token lines (`parse`) leave out; these lines count them."""
    blocks: list[tuple[str, dict]] = []
    for line in text.splitlines():
        if m := _ALL_WAITING.search(line):
            blocks.append((m.group(1), {"waiting_ms": float(m.group(2)), "entries": {}}))
            continue
        found = _ALL_CMD.search(line) or _ALL_PHASE.search(line)
        if not found or not blocks or blocks[-1][0] != found.group(1):
            continue
        name = found.group(2).strip()
        if name.isdigit():
            name = command_name(name)
        blocks[-1][1]["entries"][name] = {"calls": int(found.group(3)), "ms": float(found.group(4))}

    def computes(block: dict) -> int:
        entries = block["entries"]
        return sum(entries.get(c, {}).get("calls", 0) for c in ("GRAPH_COMPUTE", "GRAPH_RECOMPUTE"))

    busiest: dict[str, dict] = {}
    for side, block in blocks:
        if side not in busiest or computes(block) > computes(busiest[side]):
            busiest[side] = block
    return busiest


def table(timeline: Timeline) -> str:
    lines = ["side    entry                 per token   us per token"]
    for side in ("client", "server"):
        if side not in timeline:
            continue
        lines.append(f"{side:7} ({timeline[side]['tokens']} tokens)")
        entries = timeline[side]["entries"]
        for name, v in sorted(entries.items(), key=lambda kv: -kv[1]["us_per_token"]):
            lines.append(f"{side:7} {name:20} {v['per_token']:10.2f} {v['us_per_token']:14.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", type=Path, nargs="+", help="the client's and the server's stderr of one run")
    ap.add_argument("--json", action="store_true", help="print the timeline as JSON")
    args = ap.parse_args(argv)
    try:
        timeline = parse("\n".join(p.read_text(errors="replace") for p in args.logs))
    except OSError as exc:
        print(f"error: cannot read a log: {exc}", file=sys.stderr)
        print("hint: give the stderr logs of a client and a server run with GGML_RPC_PROFILE=1", file=sys.stderr)
        return 2
    if not timeline:
        print("error: no per-token 'RPC profile' lines in the logs", file=sys.stderr)
        print("hint: run the client and the server with GGML_RPC_PROFILE=1, and generate tokens", file=sys.stderr)
        return 2
    print(json.dumps(timeline, indent=1) if args.json else table(timeline))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
