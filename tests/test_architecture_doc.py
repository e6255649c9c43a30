"""docs/ARCHITECTURE.md against the code: the packages and modules its table names, their public
surfaces, the layers of its import diagram, and every `module.name` it mentions."""

from __future__ import annotations

import ast
import builtins
import functools
import re

import pytest

from tests.test_architecture import MODULES, PACKAGE, _all_imports, _package

DOC = PACKAGE.parent / "docs" / "ARCHITECTURE.md"
TEXT = DOC.read_text()

#: Imports between two packages of one layer, and why they may go both ways.
SAME_LAYER = {
    ("cli", "resident"): "the entry point hands a command to the resident process (cli/__init__.main)",
    ("resident", "cli"): "the resident process runs the typer app in its forks",
}


def _section(title: str) -> str:
    start = TEXT.index(f"## {title}\n")
    end = TEXT.find("\n## ", start + 1)
    return TEXT[start:end if end != -1 else len(TEXT)]


def _rows() -> list[list[str]]:
    lines = [line for line in _section("Packages").splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[1:] if "---" not in line]


def _ticked(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))


def _units() -> dict[str, list[str]]:
    """Each package (`serve/`) and top-level module (`errors.py`) with its modules."""
    units: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.iterdir()):
        if path.is_dir() and (path / "__init__.py").exists():
            units[path.name + "/"] = sorted(p.stem for p in path.glob("*.py") if p.stem != "__init__")
        elif path.suffix == ".py":
            units[path.name] = []
    return units


def _named_units() -> dict[str, list[str]]:
    return {unit: row for row in _rows() for unit in _ticked(row[0])}


def test_the_table_names_every_package_and_module_and_nothing_else() -> None:
    named = _named_units()
    assert sorted(named) == sorted(_units())


@pytest.mark.parametrize("unit", sorted(u for u, modules in _units().items() if modules))
def test_each_package_row_names_its_modules(unit: str) -> None:
    row = _named_units()[unit]
    missing = [m for m in _units()[unit] if f"`{m}`" not in row[1] and f"`{m}.py`" not in row[1]]
    assert missing == []


def _init_names(package: str) -> tuple[set[str], list[str] | None]:
    """The names a package's `__init__` defines or imports, and its `__all__` if it has one."""
    tree = ast.parse((PACKAGE / package / "__init__.py").read_text())
    names: set[str] = set()
    listed = None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":  # names given when asked for
            names |= {c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.ImportFrom):
            names |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names.add(target.id)
                    if target.id == "__all__":
                        listed = ast.literal_eval(node.value)
    return names, listed


@pytest.mark.parametrize("unit", sorted(u for u in _units() if u.endswith("/")))
def test_each_public_surface_is_the_code(unit: str) -> None:
    """'modules': the package's `__all__`, if any, is its modules. Otherwise each name shown is in the
    `__init__`, and every name of its `__all__` is shown."""
    surface = _named_units()[unit][2]
    names, listed = _init_names(unit.rstrip("/"))
    if surface == "modules":
        assert listed is None or sorted(listed) == _units()[unit]
        return
    shown = [name for name in _ticked(surface) if name.isidentifier()]
    assert [name for name in shown if name not in names] == []
    if listed is not None:
        assert sorted(set(listed) - set(shown)) == []


def _layers() -> list[list[str]]:
    block = _section("Import direction").split("```")[1]
    return [[name.strip() for name in line.split(",")] for line in block.strip().splitlines()
            if line.strip() and line.strip() != "▼"]


def test_the_import_diagram_has_every_package_once() -> None:
    placed = [name for layer in _layers() for name in layer]
    units = sorted(u.rstrip("/").removesuffix(".py") for u in _units())
    assert sorted(placed) == units


def test_imports_run_down_the_diagram() -> None:
    """Every import (at the top, in a function, for the type checker) goes to a later layer."""
    layer_of = {name: i for i, layer in enumerate(_layers()) for name in layer}
    wrong = set()
    for module, path in MODULES.items():
        for target in _all_imports(module, ast.parse(path.read_text())):
            here, there = _package(module), _package(target)
            here, there = ("__init__" if h == "apirctl" else h for h in (here, there))  # type: ignore[assignment]
            if here == there or (here, there) in SAME_LAYER:
                continue
            if layer_of[there] <= layer_of[here]:
                wrong.add(f"{module} -> {target}")
    assert sorted(wrong) == []


def _defined(module: str) -> set[str]:
    """Names a module defines at its top level or in its classes (methods, fields), or imports."""
    tree = ast.parse(MODULES[module].read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    names.add(target.id)
    if MODULES[module].name == "__init__.py":
        depth = module.count(".") + 1
        names |= {m.rsplit(".", 1)[1] for m in MODULES if m.startswith(module + ".") and m.count(".") == depth}
    return names


def _references() -> list[tuple[str, str]]:
    """(module, name) for each `a.b` or `a.b.c(...)` in the document whose prefix is an apirctl module."""
    found = []
    for token in _ticked(TEXT):
        words = re.match(r"([A-Za-z_][\w.]*)", token)
        if not words or "." not in words.group(1) or words.group(1).endswith((".py", ".md", ".toml")):
            continue
        parts = words.group(1).removeprefix("apirctl.").split(".")
        for cut in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:cut])
            matches = [m for m in MODULES if m == f"apirctl.{prefix}" or m.endswith(f".{prefix}")]
            if len(matches) == 1:
                found.append((matches[0], parts[cut]))
                break
    return found


def test_the_reference_walk_finds_references() -> None:
    assert ("apirctl.podman.containers", "connect") in _references()
    assert len(_references()) > 10


@pytest.mark.parametrize(("module", "name"), sorted(set(_references())))
def test_every_module_name_the_document_mentions_exists(module: str, name: str) -> None:
    assert name in _defined(module)


# --- bare code names ---------------------------------------------------------------------------------

SUPPORT = PACKAGE.parent / "tests" / "support"
#: The modules `apirctl serve` runs through, from the command line to the container (the serve steps).
SERVE_PATH = ("apirctl.cli.serve", "apirctl.serve.starting", "apirctl.serve.provision", "apirctl.serve.spec")


def _code_name(token: str) -> str | None:
    """The code name a ticked token is, if it is one: `claim_port`, `is_macos()`, `ModelSet`. Words
    without an underscore (`auto`, `none`), flags, paths and ALL-CAPS names (environment variables,
    protocol words) are not."""
    found = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(\(.*\))?", token)
    if not found or found.group(1).isupper():
        return None
    name = found.group(1)
    camel = name[0].isupper() and any(c.isupper() for c in name[1:]) and "_" not in name
    return name if "_" in name.strip("_") or found.group(2) is not None or camel else None


def _names_in(path: ast.AST) -> set[str]:
    """Every name a module's code uses or defines (attributes included)."""
    found: set[str] = set()
    for node in ast.walk(path):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.alias):
            found.add((node.asname or node.name).split(".")[-1])
    return found


@functools.cache
def _known_names() -> set[str]:
    """Names the project defines: in apirctl's modules, and its test support (which the doc describes)."""
    known = {name for module in MODULES for name in _defined(module)} | set(dir(builtins))
    known |= {m.rsplit(".", 1)[-1] for m in MODULES} | {"__init__", "__main__"}
    for path in SUPPORT.rglob("*.py"):
        known.add(path.stem)
        known |= _names_in(ast.parse(path.read_text()))
    return known


def _bare_names(text: str) -> list[str]:
    return sorted({name for token in _ticked(text) if (name := _code_name(token))})


def test_the_bare_name_walk_finds_names() -> None:
    assert {"claim_port", "private_dir", "ModelSet", "is_macos"} <= set(_bare_names(TEXT))
    assert _code_name("auto") is None and _code_name("APIRCTL_HOME") is None and _code_name("--port") is None


@pytest.mark.parametrize("name", _bare_names(TEXT))
def test_every_code_name_the_document_mentions_exists(name: str) -> None:
    assert name in _known_names()


def test_the_serve_steps_name_what_the_serve_path_uses() -> None:
    """A name in the serve steps is one that the path from the command line to the container uses
    (a helper it no longer calls, though it still exists, is a stale step)."""
    steps = TEXT[TEXT.index("### `apirctl serve MODEL`"):TEXT.index("Per platform, step")]
    used: set[str] = set()
    for module in SERVE_PATH:
        used |= _names_in(ast.parse(MODULES[module].read_text()))
    assert [name for name in _bare_names(steps) if name not in used] == []
