"""Benchmarks: llama-bench in each mode (native, remoting, container, apir, vm-cpu, vm-remoting, vm-apir) and
serving load.

`apirctl.bench.modes` runs llama-bench and builds the comparison rows, `llamabench`
knows llama-bench's command line and JSON output, `results` saves and reads the
history, `load` drives an OpenAI-compatible endpoint, `serving` loads one model natively and
through `apirctl serve` in turn, `report` renders tables, bars and plots. The CLI (`apirctl bench`)
only parses flags and prints.
"""

from __future__ import annotations

MODES = ("native", "remoting", "container", "apir", "vm-cpu", "vm-remoting", "vm-apir")
