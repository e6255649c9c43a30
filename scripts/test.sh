#!/usr/bin/env bash
# Run the test suite: unit and integration tests (real podman, the real llama.cpp build, the real
# image and demo model). Installs what it needs first; the llama.cpp build is cached in
# $APIRCTL_TEST_CACHE (default: .test-cache/), so only the first run builds (minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/system-deps.sh --vulkan  # with what the Vulkan image test builds and runs on
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q -e '.[test,plot,dev]'  # dev: tests/test_quality.py runs ruff and mypy
exec .venv/bin/pytest -q "$@"
