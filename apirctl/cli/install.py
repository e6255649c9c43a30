"""`apirctl install` / `uninstall`: API-remoting bundles (macOS)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from apirctl.macos.bundle import Bundle

INSTALL_HELP = (
    "Import, build, list or activate API-remoting bundles (macOS).\n\n"
    "A bundle holds the host side of API remoting: the ggml-virtgpu backend library, ggml-metal and the "
    "API-remoting virglrenderer, with the container image that serves it. Bundles are kept side by side "
    "under apirctl's data directory with the sha256 of every file; one is active, and "
    "`apirctl machine restart --remoting` makes krunkit load it.\n\n"
    "Examples:\n\n"
    "  apirctl install --from llama_cpp-api_remoting-b6298-remoting-0.1.6_b5.tar.gz\n\n"
    "  apirctl install --from https://example.org/release.tar.gz --sha256 DIGEST\n\n"
    "  apirctl install --list --json\n\n"
    "  apirctl install --activate b6298-remoting-0.1.6_b5\n\n"
    "  apirctl install --build --virglrenderer PATH/libvirglrenderer.1.dylib"
)


def _row(b: Bundle) -> dict[str, Any]:
    return {"version": b.version, "active": b.active, "path": str(b.path), "image": b.image,
            "source": b.source, "installed_at": b.installed_at, "backend_library": b.backend_library,
            "ggml_library": b.ggml_library, "ggml_reg": b.ggml_reg, "virglrenderer": b.virglrenderer,
            "files": b.files}


def install(
    source: str = typer.Option(None, "--from", help="Release tarball (.tar.gz), directory, or http(s) URL."),
    sha256: str = typer.Option(None, "--sha256", help="Expected sha256 of the tarball or download."),
    version: str = typer.Option(None, "--version", help="Bundle version, when the release does not state one."),
    image: str = typer.Option(None, "--image", help="Container image that serves this bundle (overrides the "
                                                    "release's src_info/ramalama.image-info.txt)."),
    build: bool = typer.Option(False, "--build", help="Build the backend and ggml-metal from the pinned "
                                                      "llama.cpp source instead (macOS)."),
    virglrenderer: str = typer.Option(None, "--virglrenderer", help="With --build: the API-remoting "
                                                                    "libvirglrenderer.1.dylib to ship."),
    list_: bool = typer.Option(False, "--list", help="List installed bundles (version, path, digests, active)."),
    activate: str = typer.Option(None, "--activate", metavar="VERSION", help="Make VERSION the active bundle."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    from apirctl.cli.output import console, print_json
    from apirctl.errors import ApirctlError

    actions = [a for a in (source is not None, build, list_, activate is not None) if a]
    if len(actions) != 1:
        raise ApirctlError("choose one of --from, --build, --list and --activate",
                           hint="see `apirctl install --help`")
    from apirctl.macos import bundle

    if list_:
        rows = bundle.list_bundles()
        if json_out:
            print_json([_row(b) | {"modified": b.modified()} for b in rows])
            return
        if not rows:
            console().print("no bundles installed; next: apirctl install --from RELEASE.tar.gz")
            return
        from rich.markup import escape

        for b in rows:
            mark = "[green]*[/]" if b.active else " "
            changed = b.modified()
            note = f" [red]modified: {escape(', '.join(changed))}[/]" if changed else ""
            console().print(f"{mark} {escape(b.version)}  {escape(b.image or '-')}  {escape(str(b.path))}{note}")
        return
    if activate is not None:
        b = bundle.activate(activate)
        if json_out:
            print_json(_row(b))
        else:
            console().print(f"active bundle: {b.version}; next: apirctl machine restart --remoting")
        return
    if build:
        from pathlib import Path

        if not virglrenderer:
            raise ApirctlError("--build needs --virglrenderer PATH (the API-remoting virglrenderer is not "
                               "released upstream yet)")
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        from apirctl.cli.output import err_console

        with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=err_console(), transient=True,
                      disable=json_out) as progress:
            task = progress.add_task("building llama.cpp (Metal + ggml-virtgpu backend)", total=None)

            def on_build(done: int, total: int, _line: str) -> None:
                progress.update(task, completed=done, total=total or None)

            b, changed = bundle.build(Path(virglrenderer).expanduser(), image=image, version=version,
                                      progress=on_build)
    else:
        b, changed = _import(source, sha256, version, image, quiet=json_out)
    if json_out:
        print_json(_row(b) | {"installed": changed})
        return
    verb = "installed" if changed else "already installed"
    console().print(f"bundle {b.version} {verb} in {b.path}")
    if b.active:
        console().print("[dim]next: apirctl machine restart --remoting[/]")
    else:
        console().print(f"[dim]next: apirctl install --activate {b.version}[/]")


def _import(source: str, sha256: str | None, version: str | None, image: str | None,
            quiet: bool) -> tuple[Bundle, bool]:
    from apirctl.macos import bundle

    if quiet or not source.startswith(("http://", "https://")):
        return bundle.import_from(source, sha256_digest=sha256, version=version, image=image)
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    from apirctl.cli.output import err_console

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), console=err_console(), transient=True) as progress:
        task = progress.add_task("downloading", total=None)

        def on_progress(done: int, total: int | None) -> None:
            progress.update(task, completed=done, total=total)

        return bundle.import_from(source, sha256_digest=sha256, version=version, image=image,
                                  progress=on_progress)


def uninstall(
    version: str = typer.Argument(None, help="Bundle version (default: the active one)."),
    json_out: bool = typer.Option(False, "--json", help="Print the removed bundle as JSON."),
) -> None:
    """Remove an installed bundle; refuses the one the running machine uses."""
    from apirctl.cli.output import console, print_json
    from apirctl.macos import bundle

    removed = bundle.uninstall(version)
    if json_out:
        print_json(_row(removed) | {"removed": True})
    else:
        console().print(f"removed bundle {removed.version}")


def register(app: typer.Typer) -> None:
    app.command(help=INSTALL_HELP)(install)
    app.command()(uninstall)
