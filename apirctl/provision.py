"""What `apirctl setup` does, step by step: builds, image, demo model.

Each step is cached, so a second run with nothing to do only checks (seconds). The
caller passes callbacks to show progress; nothing here prints.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from apirctl import llamacpp
from apirctl.llamacpp import Build, ProgressFn

StepFn = Callable[[str], None]


class SetupResult(BaseModel):
    host_build: Build
    container_build: Build | None  # None: a GPU host set up without the image needs no CPU container build
    image: str | None
    model: Path | None


def builds(jobs: int | None = None, on_step: StepFn | None = None,
           progress: ProgressFn | None = None, backend: llamacpp.Backend | None = None,
           container: bool = True) -> tuple[Build, Build]:
    """The host build (GPU backend + RPC + virtgpu host library) and the container build.

    `container=False` skips the second (CPU) build of a GPU host and returns the host build twice.
    """
    host_opts = llamacpp.host_options(backend)
    if on_step:
        on_step(f"llama.cpp {llamacpp.SOURCE_VERSION} for the host ({host_opts.backend})")
    host = llamacpp.build(host_opts, jobs=jobs, progress=progress)
    if host_opts.backend == "cpu" or not container:
        return host, host
    if on_step:
        on_step("llama.cpp for the container (CPU + RPC)")
    return host, llamacpp.build(llamacpp.container_options(), jobs=jobs, progress=progress)


def run(jobs: int | None = None, with_image: bool = True, with_model: bool = True,
        on_step: StepFn | None = None, progress: ProgressFn | None = None,
        model_ref: str | None = None) -> SetupResult:
    # Only the image needs the CPU container build: without it, a GPU host builds once.
    host, container = builds(jobs, on_step, progress, container=with_image)
    tag = None
    if with_image:
        from apirctl import image

        if on_step:
            on_step(f"image {image.tag_for(container)}")
        tag = image.ensure(container)
    model_path = None
    if with_model:
        from apirctl import config, models

        ref = model_ref or config.settings().default_model
        if on_step:
            on_step(f"model {ref}")
        model_path = models.resolve(ref, pull=True, quiet=on_step is None).path
    skipped = not with_image and host.backend != "cpu"
    return SetupResult(host_build=host, container_build=None if skipped else container, image=tag, model=model_path)
