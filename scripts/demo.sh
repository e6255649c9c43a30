#!/usr/bin/env bash
# The whole default path on a fresh Linux machine: system packages, apirctl, `apirctl setup`
# (llama.cpp from the pinned source, the image, the demo model), then the main job on the demo
# model: serve it, ask it one question, stop the server, and print a bench table (native, remoting,
# container).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/system-deps.sh
[ -x .venv/bin/apirctl ] || python3 -m venv .venv
.venv/bin/pip install -q -e '.[plot]'
export PATH="$PWD/.venv/bin:$PATH"
apirctl setup
apirctl doctor || true
apirctl machine restart --remoting || echo "(remoting backend not started: serving without remoting)"
apirctl serve smollm2 --port "${PORT:-1234}"
trap 'apirctl stop --all >/dev/null 2>&1 || true' EXIT
apirctl chat "In one sentence, what is a GPU?" --max-tokens 64
apirctl ps
apirctl stop --all  # free the CPU for the bench (remoting would run beside it: a backend of its own)
apirctl bench smollm2 --modes native,remoting,container --reps 2
