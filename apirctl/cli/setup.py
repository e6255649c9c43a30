"""`apirctl setup`: build llama.cpp from the pinned source, build the image, fetch the demo model."""

from __future__ import annotations

import typer


def setup(
    jobs: int = typer.Option(None, "--jobs", "-j", help="Parallel build jobs (default: all cores)."),
    image: bool = typer.Option(True, "--image/--no-image",
                               help="Build the local inference image (--no-image also skips the CPU build the "
                                    "image holds, on a GPU host)."),
    model: bool = typer.Option(True, "--model/--no-model", help="Fetch the default (demo) model."),
    vulkan: bool = typer.Option(False, "--vulkan",
                                help="Also build llama.cpp's Vulkan backend and its image, for GPU passthrough "
                                     "of /dev/dri render nodes (needs libvulkan-dev, glslc, spirv-headers)."),
    json_out: bool = typer.Option(False, "--json", help="Print what was set up as JSON."),
) -> None:
    """Build llama.cpp from its pinned source, build the inference image, fetch the demo model.

    The host build carries the best GPU backend found (CUDA when nvcc and a GPU exist, Metal on macOS,
    else CPU) with the RPC backend and the ggml-virtgpu host library; the image carries only the CPU
    and RPC backends, since remoting brings the GPU. CUDA builds for the architectures of the setting
    cuda_architectures (e.g. `APIRCTL_CUDA_ARCHITECTURES=90`: one is much faster). Every step is
    cached: a rerun with nothing to do returns at once. The full build log is kept; its tail is shown
    if the build fails.
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from apirctl import config
    from apirctl.build import provision
    from apirctl.cli.output import console, download_bars, print_json

    jobs_wanted: int | None = jobs or config.settings().build_jobs
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
               TimeElapsedColumn())
    with Progress(*columns, console=console(), transient=False, disable=json_out) as bar:
        task = None

        def on_step(text: str) -> None:
            nonlocal task
            if task is not None:
                bar.update(task, completed=bar.tasks[task].total)
            task = bar.add_task(text, total=1)

        def on_progress(done: int, total: int, line: str) -> None:
            if task is not None:
                bar.update(task, completed=done, total=total)

        with download_bars(enabled=not json_out) as on_download:
            result = provision.run(jobs=jobs_wanted, with_image=image, with_model=model, on_step=on_step,
                                   progress=on_progress, on_download=on_download, vulkan=vulkan)
        if task is not None:
            bar.update(task, completed=bar.tasks[task].total)
    if json_out:
        print_json(result.model_dump(mode="json"))
        return
    console().print(f"[green]ready[/]: llama.cpp {result.host_build.source_version} "
                    f"({result.host_build.backend}) in {result.host_build.bin_dir}", soft_wrap=True)
    if result.image:
        console().print(f"  image: {result.image}", soft_wrap=True)
    for gpu_image in result.gpu_images:
        console().print(f"  GPU passthrough image: {gpu_image}", soft_wrap=True)
    if result.model:
        console().print(f"  model: {result.model}", soft_wrap=True)
    console().print("[dim]next: apirctl doctor, apirctl machine restart --remoting, apirctl serve[/]")


def register(app: typer.Typer) -> None:
    app.command()(setup)
