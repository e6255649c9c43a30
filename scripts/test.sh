#!/usr/bin/env bash
# Run the test suite: unit and integration tests (real podman, the real llama.cpp build, the real
# image and demo model). Installs what it needs first. The suite's builds are cached in
# $APIRCTL_TEST_CACHE (default: .test-cache/), compiled through ccache kept there too; a build that
# `apirctl setup` (scripts/demo.sh) already made is copied from apirctl's own cache, never rebuilt.
# Each step's wall time is printed, and each build's at the end of pytest's report (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
step() { local start=$SECONDS; "$@"; echo "[time] $(basename "$1") ${*:2}: $((SECONDS - start)) s"; }
step bash scripts/system-deps.sh --vulkan  # with what the Vulkan image test builds and runs on
[ -x .venv/bin/python ] || python3 -m venv .venv
# dev: tests/test_quality.py runs ruff and mypy. The install is editable: done again only when
# pyproject.toml changed since the last one (a second run of the same checkout skips pip's minutes).
stamp=.venv/.installed-pyproject
if [ "$(cat "$stamp" 2>/dev/null)" != "$(sha256sum pyproject.toml)" ]; then
  step .venv/bin/pip install -q -e '.[test,plot,dev]'
  sha256sum pyproject.toml > "$stamp"
else
  echo "[time] pip install: skipped (pyproject.toml unchanged since this venv's install)"
fi
# Three pytest processes by default (pytest-xdist, test by test; what workers share is made once,
# under a lock); APIRCTL_TEST_WORKERS=0 runs one. The workers share the
# machine's Podman storage: each has its own apirctl home, and a home counts only its own backends'
# containers (docs/testing.md).
workers="${APIRCTL_TEST_WORKERS:-3}"
parallel=(); [ "$workers" != 0 ] && parallel=(-n "$workers" --dist load)
start=$SECONDS
rc=0
.venv/bin/pytest -q "${parallel[@]}" "$@" || rc=$?
echo "[time] pytest: $((SECONDS - start)) s"
exit $rc
