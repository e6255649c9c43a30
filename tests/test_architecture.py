"""The package's shape, read from its source with `ast`: imports run one way, with no cycle.

Only module-level imports count as edges (those under `if TYPE_CHECKING:` are for the type checker
and never run). Late imports of apirctl's own modules are allowed only where they protect start-up:
the CLI's command bodies, the resident process, and the one place that picks the platform's machine.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "apirctl"

#: The CLI's command bodies import the library late, to keep `apirctl --help` and every command's start fast.
LATE_IMPORTS_ALLOWED = ("apirctl.cli",)

#: Every other late import of apirctl's own modules, (module, imported module) -> why it is late.
LATE_IMPORTS_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("apirctl.remoting.machines", "apirctl.macos.machine"):
        "this platform's machine only: a Linux serve never pays for the APIR driver and bundle code",
    ("apirctl.remoting.machines", "apirctl.remoting.rpc_server"):
        "this platform's machine only: a macOS serve never loads the Linux host backend",
    ("apirctl.resident.server", "apirctl.cli.root"):
        "after the lock (a resident that lost the race exits without importing) and the code fingerprint",
    ("apirctl.resident.server", "apirctl.chat"):
        "in the forked spare, from what the warm-up imported: at the top it would come before the lock",
    ("apirctl.resident.server", "importlib.import_module"):
        "the warm-up itself: everything a command needs, imported once after the lock",
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The apirctl modules an import statement loads (a name from a package may be a submodule)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join([*package, base] if base else package)
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
    return {name for name in names if name in MODULES and name != module}


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and not _is_type_checking(node):
            pending += node.body + node.orelse
        elif isinstance(node, ast.Try):
            pending += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
    return found


def _late_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    late: list[ast.Import | ast.ImportFrom] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            late += [sub for sub in ast.walk(node) if isinstance(sub, (ast.Import, ast.ImportFrom))]
    return late


def _graph() -> dict[str, set[str]]:
    graph = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        graph[module] = set().union(*(_targets(module, node) for node in _module_level_imports(tree)))
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return [*path[path.index(target):], target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


def test_the_walk_sees_the_package() -> None:
    graph = _graph()
    assert {"apirctl.cli.root", "apirctl.serve", "apirctl.podman.engine", "apirctl.apir.wire"} <= set(graph)
    assert "apirctl.podman.containers" in graph["apirctl.serve.starting"]  # a known edge, so edges are read


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycles() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _package(module: str) -> str:
    """apirctl.serve.servers -> serve; a top-level module (apirctl.errors) is its own unit."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_packages_import_one_way() -> None:
    packages: dict[str, set[str]] = {}
    for module, targets in _graph().items():
        packages.setdefault(_package(module), set()).update(
            _package(t) for t in targets if _package(t) != _package(module))
    cycle = _cycle(packages)
    assert cycle is None, "packages import each other: " + " -> ".join(cycle or [])


def _all_imports(module: str, tree: ast.Module) -> set[str]:
    """Every apirctl module a module's source names in an import: at the top, in a function, for the
    type checker only, or as a string to importlib."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            targets = _targets(module, node)
            if not targets and isinstance(node, ast.ImportFrom) and (node.module or "").startswith("apirctl"):
                targets = {node.module or ""}  # a name from a module this walk does not know
            found |= targets
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in MODULES:
            found.add(node.value)
    return found


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("apirctl.apir")))
def test_apir_imports_nothing_outside_itself(module: str) -> None:
    """The protocol and its driver stand alone: no import of apirctl outside `apir/`, of any kind."""
    outside = sorted(t for t in _all_imports(module, ast.parse(MODULES[module].read_text()))
                     if t != "apirctl.apir" and not t.startswith("apirctl.apir."))
    assert outside == []


def test_the_apir_check_sees_every_kind_of_import() -> None:
    sample = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from apirctl import errors\n"
              "def f():\n    from apirctl.paths import dirs\n    importlib.import_module('apirctl.host')\n")
    assert _all_imports("apirctl.apir.wire", ast.parse(sample)) == {"apirctl.errors", "apirctl.paths", "apirctl.host"}


def _late_own_imports(module: str, tree: ast.Module) -> list[tuple[str, str]]:
    """(imported module, source) for each import of apirctl's own modules inside a function, and each
    importlib.import_module call there."""
    late: list[tuple[str, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for sub in ast.walk(node):
            if isinstance(sub, (ast.Import, ast.ImportFrom)):
                relative = isinstance(sub, ast.ImportFrom) and bool(sub.level)
                late += [(target, ast.unparse(sub)) for target in sorted(_targets(module, sub))]
                if relative and not _targets(module, sub):
                    late.append(("(relative)", ast.unparse(sub)))
            elif isinstance(sub, ast.Call) and ast.unparse(sub.func).endswith("import_module"):
                late.append(("importlib.import_module", ast.unparse(sub)))
    return late


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.startswith(LATE_IMPORTS_ALLOWED)))
def test_library_imports_its_own_modules_at_the_top(module: str) -> None:
    """Outside `cli/`, apirctl's own modules are imported at the top of a module, where a cycle shows;
    each exception is listed in LATE_IMPORTS_EXCEPTIONS with its reason."""
    late = [source for target, source in _late_own_imports(module, ast.parse(MODULES[module].read_text()))
            if (module, target) not in LATE_IMPORTS_EXCEPTIONS]
    assert late == []


def test_the_late_import_check_sees_a_late_import() -> None:
    sample = "def f():\n    from apirctl.serve import servers\n    import json\n"
    assert _late_own_imports("apirctl.chat.client", ast.parse(sample)) == [
        ("apirctl.serve.servers", "from apirctl.serve import servers")]


def test_every_late_import_exception_is_still_needed() -> None:
    """An exception whose import moved to the top (or went away) leaves the list too."""
    present = {(module, target) for module in MODULES
               for target, _source in _late_own_imports(module, ast.parse(MODULES[module].read_text()))}
    assert sorted(set(LATE_IMPORTS_EXCEPTIONS) - present) == []


def test_library_does_not_import_the_cli() -> None:
    users = {module for module, targets in _graph().items()
             if not module.startswith(("apirctl.cli", "apirctl.resident", "apirctl.__main__"))
             and any(t.startswith("apirctl.cli") for t in targets)}
    assert users == set()


#: Where code outside `cli/` may write to the terminal itself, and why.
PRINTS_ALLOWED: dict[str, str] = {}


def _terminal_writes(tree: ast.Module) -> list[str]:
    """print(), typer.echo(), sys.stdout/stderr.write(), making a rich Console, or printing on one (a
    spinner too): the ways code writes to the user's terminal."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            call = ast.unparse(node.func)
            if (call in ("print", "typer.echo", "typer.secho", "sys.stdout.write", "sys.stderr.write", "Console")
                    or call.endswith(("console.print", "console().print", "console.log", "console.status"))):
                found.append(f"line {node.lineno}: {call}(...)")
    return found


def test_the_terminal_check_sees_a_write() -> None:
    sample = "import sys\nprint('x')\nsys.stderr.write('y')\nself.console.print(1)\nConsole(stderr=True)\n"
    assert len(_terminal_writes(ast.parse(sample))) == 4


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.startswith("apirctl.cli")))
def test_library_returns_data_and_lets_the_cli_print(module: str) -> None:
    """Library code returns data or raises, and reports progress through callbacks: only `cli/` prints."""
    if module in PRINTS_ALLOWED:
        return
    assert _terminal_writes(ast.parse(MODULES[module].read_text())) == []


def _guards_import_error(node: ast.AST) -> bool:
    if isinstance(node, ast.Try):
        return any(h.type is not None and "ImportError" in ast.unparse(h.type) for h in node.handlers)
    return isinstance(node, ast.With) and any("ImportError" in ast.unparse(item.context_expr) for item in node.items)


def _guarded_imports(module: str, tree: ast.Module) -> list[str]:
    """apirctl's own modules imported under `except ImportError` or `suppress(ImportError)`: ours are
    always there, so such a guard only hides a broken import."""
    found = []
    for node in ast.walk(tree):
        if not _guards_import_error(node):
            continue
        for sub in (sub for stmt in node.body for sub in ast.walk(stmt)):
            own = isinstance(sub, (ast.Import, ast.ImportFrom)) and (
                bool(_targets(module, sub)) or "apirctl" in ast.unparse(sub))
            if own or (isinstance(sub, ast.Call) and "import_module" in ast.unparse(sub.func)):
                found.append(f"line {sub.lineno}: {ast.unparse(sub)}")
    return found


def test_the_guard_check_sees_a_guard() -> None:
    sample = "try:\n    from apirctl import serve\nexcept ImportError:\n    serve = None\n"
    assert _guarded_imports("apirctl.x", ast.parse(sample)) == ["line 2: from apirctl import serve"]


def test_no_import_error_guard_around_apirctl_modules() -> None:
    guarded = {module: found for module, path in MODULES.items()
               if (found := _guarded_imports(module, ast.parse(path.read_text())))}
    assert guarded == {}


#: Where the platform may be read outside `host.py`, and why.
PLATFORM_READ_ALLOWED = {
    # The entry point's standard-library-only path (before anything of apirctl is imported) finds the
    # config file as platformdirs does; importing `host` would cost `typing` there.
    "apirctl.resident.shared": "start-up",
    # The OS's name as `apirctl info` shows it when /etc/os-release cannot be read: text, not a decision.
    "apirctl.diagnose.sysinfo": "display",
}


def test_the_platform_is_decided_in_host() -> None:
    """`sys.platform`, `platform.system()` and `APIRCTL_PLATFORM` are read in `apirctl.host` only."""
    readers = {}
    for module, path in MODULES.items():
        if module in ("apirctl.host", *PLATFORM_READ_ALLOWED):
            continue
        text = path.read_text()
        found = [word for word in ("sys.platform", "platform.system()", '"APIRCTL_PLATFORM"') if word in text]
        if found:
            readers[module] = found
    assert readers == {}


def test_podman_is_reached_through_one_package() -> None:
    """podman-py and the podman command line for containers are used in `podman/` only: everything else
    goes through its seam (`podman.containers.connect()`), where Podman's errors are translated once."""
    users = {}
    for module, path in MODULES.items():
        if module.startswith("apirctl.podman"):
            continue
        tree = ast.parse(path.read_text())
        found = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                 and any(name == "podman" or name.startswith("podman.") for name in (
                     [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]))
                 and not (isinstance(node, ast.ImportFrom) and node.level)]
        found += [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Call)
                  and ast.unparse(node.func).endswith(("podman_cli", "engine.client"))]
        if found:
            users[module] = found
    assert users == {}


#: Test folders that are not packages, and why.
NOT_PACKAGES = {"support/fakes": "executables put on PATH in place of macOS tools, never imported as a package"}


def test_every_test_folder_is_a_package() -> None:
    tests = Path(__file__).resolve().parent
    folders = {path.parent for path in tests.rglob("*.py") if "__pycache__" not in path.parts}
    missing = sorted(str(folder.relative_to(tests)) for folder in folders
                     if not (folder / "__init__.py").exists() and str(folder.relative_to(tests)) not in NOT_PACKAGES)
    assert missing == []
    assert not (tests / "foundation").exists()  # dissolved into the domains (issue 14)


BENCHMARKS = PACKAGE.parent / "benchmarks"


def _benchmark_graph() -> dict[str, set[str]]:
    """The benchmarks' imports of each other (they import by file name, beside each other) and of
    apirctl, every import counted: at the top, in a function, for the type checker."""
    scripts = {path.stem: path for path in BENCHMARKS.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in scripts.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets.add(node.module.split(".")[0])
        graph[f"benchmarks.{name}"] = {f"benchmarks.{t}" for t in targets if t in scripts}
    return graph


def test_the_benchmarks_import_in_no_circle() -> None:
    """The GPU harness imports its parts, which import only the shared module (gpu_harness.py)."""
    graph = _benchmark_graph()
    assert "benchmarks.gpu_harness" in graph["benchmarks.gpu_serving"]  # edges are read
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
