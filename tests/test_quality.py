"""The code standards as tests: ruff-clean package and tests, mypy-clean package."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent


def tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]')")
    return found


def test_ruff_clean() -> None:
    proc = subprocess.run([tool("ruff"), "check", "apirctl", "tests", "benchmarks"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_no_stray_blank_lines() -> None:
    """The blank-line rules ruff still calls preview (E301-E306 between definitions, W391 at the end of a
    file), which the configuration cannot turn on alone: asked for here by name."""
    proc = subprocess.run([tool("ruff"), "check", "--preview", "--config", "lint.explicit-preview-rules=true",
                           "--select", "E301,E302,E303,E304,E305,E306,W391", "apirctl", "tests", "benchmarks"],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_mypy_clean() -> None:
    proc = subprocess.run([tool("mypy"), "apirctl"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:]


def _imported_top_names(root: Path) -> set[str]:
    names = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    return names


#: A distribution whose import name differs from its name.
IMPORT_NAMES = {"pyyaml": "yaml"}


def test_every_dependency_is_imported() -> None:
    """A dependency nothing imports (pydantic-settings was one) is weight every install pays."""
    with (REPO / "pyproject.toml").open("rb") as fh:
        declared = tomllib.load(fh)["project"]["dependencies"]
    names = {re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0].lower().replace("-", "_") for spec in declared}
    imported = _imported_top_names(REPO / "apirctl")
    assert sorted(name for name in names if IMPORT_NAMES.get(name, name) not in imported) == []


def test_no_function_is_left_unused() -> None:
    """Every function and method apirctl defines is named somewhere else: in the package, the tests, the
    benchmarks or the scripts (a typer command is reached through its decorator, a dunder by Python)."""
    defined: dict[str, list[str]] = {}
    for path in sorted((REPO / "apirctl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("__"):
                continue
            if any("command" in ast.unparse(d) or "callback" in ast.unparse(d) or "validator" in ast.unparse(d)
                   for d in node.decorator_list):
                continue
            defined.setdefault(node.name, []).append(f"{path.relative_to(REPO)}:{node.lineno}")
    counts: dict[str, int] = {}
    for folder in ("apirctl", "tests", "benchmarks", "scripts"):
        for path in (REPO / folder).rglob("*.py"):
            for word in re.findall(r"[A-Za-z_]\w*", path.read_text()):
                counts[word] = counts.get(word, 0) + 1
    unused = {name: where for name, where in defined.items() if counts.get(name, 0) <= len(where)}
    assert unused == {}
