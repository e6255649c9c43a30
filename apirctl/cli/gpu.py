"""`apirctl gpu`: the host's GPU as containers are given it (passthrough)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="GPU passthrough: what a container can be given, and a CDI spec for the NVIDIA driver.",
                  no_args_is_help=True)

DEFAULT_OUTPUT = Path("/etc/cdi")


@app.command()
def cdi(
    output: Annotated[Path | None, typer.Option(
        "--output",
        help="The spec file to write (default: /etc/cdi/apirctl-nvidia.yaml, where Podman reads specs).",
    )] = None,
    print_only: bool = typer.Option(False, "--print", help="Print the spec instead of writing it."),
    force: bool = typer.Option(
        False, "--force",
        help="Write it even where another spec (the NVIDIA container toolkit's) names nvidia.com/gpu.",
    ),
    json_out: bool = typer.Option(False, "--json", help="Say what was written as JSON."),
) -> None:
    """Write a CDI spec for this host's NVIDIA driver, for hosts without the NVIDIA container toolkit.

    It lists the GPU device nodes (nvidia.com/gpu=0, =1, ... and =all), the control nodes, the
    driver's libraries a CUDA program loads (libcuda, NVML, the PTX JIT) and nvidia-smi, the way
    `nvidia-ctk cdi generate` does; Podman then hands the GPU to `apirctl serve --transport gpu`.
    Writing to /etc/cdi needs root: `sudo apirctl gpu cdi`. Run it again after a driver update.
    """
    from apirctl.cli.output import console, print_json
    from apirctl.errors import ApirctlError
    from apirctl.gpu import cdi as cdi_specs
    from apirctl.gpu import nvidia

    driver = nvidia.find_driver()
    problem = nvidia.problem(driver)
    if problem:
        raise ApirctlError(f"no CDI spec written: {problem}",
                           hint="it is for hosts with an NVIDIA GPU and driver; `apirctl doctor` shows the GPU paths")
    text = nvidia.render(nvidia.spec(driver))
    if print_only:
        typer.echo(text, nl=False)
        return
    target = output or DEFAULT_OUTPUT / nvidia.SPEC_NAME
    others = sorted({d.spec for d in cdi_specs.inventory().devices
                     if d.kind == nvidia.KIND and Path(d.spec) != target and not nvidia.generated_by_apirctl(d.spec)})
    if others and not force:
        raise ApirctlError(f"{', '.join(others)} already names {nvidia.KIND} devices: Podman would see them twice",
                           hint="keep that spec (the NVIDIA container toolkit's), or remove it, or pass --force")
    try:
        nvidia.write(text, target)
    except OSError as exc:
        raise ApirctlError(f"cannot write {target}: {exc.strerror or exc}",
                           hint="/etc/cdi is root's: `sudo apirctl gpu cdi`, or `--print` to see the spec") from None
    devices = [f"{nvidia.KIND}={name}" for name in [*driver.gpus, "all"]]
    if json_out:
        print_json({"spec": str(target), "devices": devices, "libraries": driver.libraries, "nvidia_smi": driver.smi,
                    "missing_libraries": driver.missing_libraries})
        return
    console().print(f"wrote {target}: {', '.join(devices)}", markup=False, highlight=False, soft_wrap=True)
    if driver.missing_libraries:
        console().print(f"not found (left out): {', '.join(driver.missing_libraries)}", markup=False,
                        highlight=False, soft_wrap=True)
