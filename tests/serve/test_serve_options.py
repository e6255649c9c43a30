"""One declaration per option: a misspelt serve option fails here, in code as on the command line.

`serve.options()` and `ServeOptions` refuse a key that is no option (an unknown keyword used to be
dropped silently, its flag with it); every call of `options()` in the package passes only known keys
(read from the source, so a call on a path no test runs is checked too); `serve` and `run` take their
shared options from one declaration each.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from pydantic import ValidationError

from apirctl.cli import serve as cli
from apirctl.serve import ServeOptions, options

PACKAGE = Path(__file__).resolve().parents[2] / "apirctl"


@pytest.mark.parametrize("value", [1234, None])  # None: a flag left out; still a misspelling
def test_options_refuses_a_misspelt_key(value: int | None) -> None:
    with pytest.raises(TypeError, match="unknown options: prot"):
        options("smollm2", prot=value)


def test_serve_options_refuses_an_unknown_field() -> None:
    with pytest.raises(ValidationError, match="prot"):
        ServeOptions(model="smollm2", prot=1)  # type: ignore[call-arg]


def _options_calls() -> list[tuple[str, int, list[str]]]:
    """(file, line, keywords) of every call of a function named `options` in the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if called == "options" and node.keywords:
                    found.append((str(path.relative_to(PACKAGE.parent)), node.lineno,
                                  [k.arg for k in node.keywords if k.arg is not None]))
    return found


def test_every_call_of_options_passes_known_options() -> None:
    calls = _options_calls()
    assert {path for path, _, _ in calls} >= {"apirctl/cli/serve.py"}  # serve and run
    fields = set(ServeOptions.model_fields)
    for path, line, keywords in calls:
        assert set(keywords) <= fields, f"{path}:{line}: {sorted(set(keywords) - fields)} are no ServeOptions"


def test_serve_and_run_share_their_option_declarations() -> None:
    serve_params = inspect.signature(cli.serve).parameters
    run_params = inspect.signature(cli.run).parameters
    shared = ("model", "port", "name", "transport", "ctx_size", "threads", "temperature", "seed", "max_tokens",
              "timeout")
    for param in shared:
        assert serve_params[param].default is run_params[param].default, param
    # every option that is declared twice is a different option (run's --keep, run's --image)
    for param in set(serve_params) & set(run_params) - set(shared):
        assert serve_params[param].default is not run_params[param].default
        assert param in ("image", "keep"), f"{param}: declare it once for serve and run"
