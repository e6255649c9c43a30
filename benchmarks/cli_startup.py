"""Startup time of `apirctl --help` / `--version` against a bare Typer app with the same commands.

The bare app is generated from apirctl's own command tree (the same groups, commands, arguments and
options with their types; empty bodies), so the difference is what apirctl itself does at start-up.
Both run interleaved in one process loop; the script prints the medians and the ratio.
Target: ratio <= 1.10.

    python benchmarks/cli_startup.py [--runs 30]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def command_tree() -> dict:
    import typer.main

    from apirctl.cli import app

    group = typer.main.get_command(app)

    def params(cmd) -> list[dict]:  # type: ignore[no-untyped-def]
        out = []
        for p in cmd.params:
            if p.name in ("help", "install_completion", "show_completion", "version"):
                continue
            annotation = p.type_descriptor.annotation
            multiple = getattr(annotation, "__origin__", None) is list
            if multiple:
                annotation = annotation.__args__[0]
            kind = {int: "int", float: "float", bool: "bool"}.get(annotation, "str")
            secondary = list(getattr(p, "secondary_opts", []) or [])
            out.append({"name": p.name, "kind": kind, "argument": p.param_type_name == "argument",
                        "opts": list(p.opts) + secondary, "secondary": secondary, "multiple": multiple})
        return out

    def walk(cmd) -> dict:  # type: ignore[no-untyped-def]
        subs = getattr(cmd, "commands", None) or {}
        return {"params": params(cmd), "commands": {name: walk(sub) for name, sub in subs.items()}}

    return walk(group)


def signature(params: list[dict]) -> str:
    parts = []
    for p in params:
        kind = f"list[{p['kind']}]" if p["multiple"] else p["kind"]
        if p["argument"]:
            parts.append(f"{p['name']}: {kind} = typer.Argument(None)")
            continue
        if p["kind"] == "bool" and p["secondary"]:
            primary = [o for o in p["opts"] if o not in p["secondary"]]
            decls = [repr("/".join(primary) + "/" + "/".join(p["secondary"]))]
        else:
            decls = [repr(o) for o in p["opts"]]
        default = "False" if p["kind"] == "bool" else "None"
        parts.append(f"{p['name']}: {kind} = typer.Option({default}, {', '.join(decls)}, help={p['name']!r})")
    return ", ".join(parts)


def bare_source(tree: dict) -> str:
    lines = ["import typer", "", "app = typer.Typer(no_args_is_help=True)", ""]
    counter = 0

    def emit(parent: str, node: dict) -> None:
        nonlocal counter
        for name, child in node["commands"].items():
            counter += 1
            if child["commands"]:
                var = f"g{counter}"
                lines.append(f"{var} = typer.Typer(help={name!r})")
                lines.append(f"{parent}.add_typer({var}, name={name!r})")
                if child["params"]:
                    lines.append(f"@{var}.callback(invoke_without_command=True)")
                    lines.append(f"def cb{counter}({signature(child['params'])}) -> None:")
                    lines.append(f"    {name + ' group.'!r}")
                emit(var, child)
            else:
                lines.append(f"@{parent}.command({name!r})")
                lines.append(f"def c{counter}({signature(child['params'])}) -> None:")
                lines.append(f"    {name + ' command.'!r}")
            lines.append("")

    emit("app", tree)
    lines += [
        "def _version(value: bool) -> None:",
        "    if value:",
        "        print('bare 0')",
        "        raise typer.Exit()",
        "",
        "@app.callback()",
        "def root(version: bool = typer.Option(False, '--version', callback=_version, is_eager=True)) -> None:",
        "    '''root'''",
        "",
        "if __name__ == '__main__':",
        "    app()",
    ]
    return "\n".join(lines)


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bare = Path(tmp) / "bare_app.py"
        bare.write_text(bare_source(command_tree()))
        for flag in ("--help", "--version"):
            # The console script's own code path (`python -m` would add runpy's import cost).
            ours_cmd = [sys.executable, "-c", "import sys; sys.argv[0] = 'apirctl'; "
                        "from apirctl.cli import main; main()", flag]
            bare_cmd = [sys.executable, str(bare), flag]
            timed(ours_cmd), timed(bare_cmd)  # warm the file cache
            ours, base = [], []
            for _ in range(args.runs):
                ours.append(timed(ours_cmd))
                base.append(timed(bare_cmd))
            m_ours, m_base = statistics.median(ours), statistics.median(base)
            print(f"{flag:10} apirctl {m_ours * 1000:7.1f} ms   bare typer {m_base * 1000:7.1f} ms   "
                  f"ratio {m_ours / m_base:.3f}   ({args.runs} runs each, medians)")


if __name__ == "__main__":
    main()
