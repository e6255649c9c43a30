"""Startup time of `apirctl --help` / `--version` against a bare Typer app with the same commands.

The bare app is generated from apirctl's own command tree (the same groups, commands, arguments and
options with their types; empty bodies), so the difference is what apirctl itself does at start-up.
Both run interleaved in one process loop; the script prints the medians and the ratio.
Target: ratio <= 1.10. `--resident on|off|both` times apirctl with the resident process turned on
(APIRCTL_RESIDENT=1, a private socket folder, started and waited for before timing) or off (the
default; every command in its own interpreter).

    python benchmarks/cli_startup.py [--runs 30] [--resident both]
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


def timed(cmd: list[str], env: dict[str, str] | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=env)
    return time.perf_counter() - start


def resident_env(tmp: str, on: bool) -> dict[str, str]:
    """The environment of apirctl's side; with `on`, a resident process is started and waited for."""
    import os

    env = {**os.environ, "APIRCTL_RESIDENT": "1" if on else "0", "APIRCTL_RESIDENT_DIR": str(Path(tmp) / "run")}
    if on:
        Path(env["APIRCTL_RESIDENT_DIR"]).mkdir(mode=0o700, exist_ok=True)
        entry = [sys.executable, "-c", "from apirctl.cli import main; main()"]
        subprocess.run([*entry, "--version"], capture_output=True, env=env, check=True)
        deadline = time.monotonic() + 60
        while subprocess.run([*entry, "resident", "status"], capture_output=True, env=env).returncode != 0:
            if time.monotonic() > deadline:
                raise SystemExit("the resident process did not start")
            time.sleep(0.2)
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--resident", choices=("off", "on", "both"), default="off",
                        help="time apirctl without (default) or with the resident process, or both")
    args = parser.parse_args()
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.resident]
    with tempfile.TemporaryDirectory() as tmp:
        bare = Path(tmp) / "bare_app.py"
        bare.write_text(bare_source(command_tree()))
        for on, flag in [(on, flag) for on in modes for flag in ("--help", "--version")]:
            env = resident_env(tmp, on)
            # The console script's own code path (`python -m` would add runpy's import cost).
            ours_cmd = [sys.executable, "-c", "import sys; sys.argv[0] = 'apirctl'; "
                        "from apirctl.cli import main; main()", flag]
            bare_cmd = [sys.executable, str(bare), flag]
            timed(ours_cmd, env), timed(bare_cmd)  # warm the file cache
            ours, base = [], []
            for _ in range(args.runs):
                ours.append(timed(ours_cmd, env))
                base.append(timed(bare_cmd))
            m_ours, m_base = statistics.median(ours), statistics.median(base)
            print(f"{flag:10} resident {'on ' if on else 'off'}  apirctl {m_ours * 1000:7.1f} ms   "
                  f"bare typer {m_base * 1000:7.1f} ms   ratio {m_ours / m_base:.3f}   "
                  f"({args.runs} runs each, medians)")
        if True in modes:
            subprocess.run([sys.executable, "-c", "from apirctl.cli import main; main()", "resident", "stop"],
                           capture_output=True, env=resident_env(tmp, False) | {"APIRCTL_RESIDENT": "1"})


if __name__ == "__main__":
    main()
