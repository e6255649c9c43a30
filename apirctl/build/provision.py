"""What `apirctl setup` does, step by step: builds, image, demo model.

Each step is cached, so a second run with nothing to do only checks (seconds). The
caller passes callbacks to show progress; nothing here prints.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from apirctl import config, models
from apirctl.build import image, llamacpp
from apirctl.build import vulkan as vulkan_prerequisites
from apirctl.build.llamacpp import Build, ProgressFn
from apirctl.errors import ApirctlError

StepFn = Callable[[str], None]


class SetupResult(BaseModel):
    host_build: Build
    container_build: Build | None  # None: a GPU host set up without the image needs no CPU container build
    image: str | None
    model: Path | None
    gpu_images: list[str] = []  # passthrough images (apirctl.gpu): CUDA from a CUDA host build, Vulkan


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
        model_ref: str | None = None, on_download: models.DownloadProgress | None = None,
        vulkan: bool = False) -> SetupResult:
    """Every step of `apirctl setup`; `vulkan` adds the Vulkan build and its passthrough image."""
    if vulkan and vulkan_prerequisites.missing():  # before the other builds: say it now, not after minutes
        raise ApirctlError(f"the Vulkan build needs {', '.join(vulkan_prerequisites.missing())}", exit_code=127,
                           hint=f"install them: {vulkan_prerequisites.PACKAGES}")
    # Only the image needs the CPU container build: without it, a GPU host builds once.
    host, container = builds(jobs, on_step, progress, container=with_image)
    tag = None
    gpu_images: list[str] = []
    vulkan_build = None
    if vulkan:
        if on_step:
            on_step("llama.cpp with the Vulkan backend (the passthrough image)")
        vulkan_build = llamacpp.build(llamacpp.vulkan_options(), jobs=jobs, progress=progress)
    if with_image:
        if on_step:
            on_step(f"image {image.tag_for(container)}")
        tag = image.ensure(container)
        for gpu_build in (host if host.backend == "cuda" else None, vulkan_build):
            if gpu_build is not None:
                if on_step:
                    on_step(f"image {image.tag_for(gpu_build)} (GPU passthrough)")
                gpu_images.append(image.ensure(gpu_build))
    model_path = None
    if with_model:
        ref = model_ref or config.settings().default_model
        if on_step:
            on_step(f"model {ref}")
        model_path = models.resolve(ref, pull=True, progress=on_download).path
    skipped = not with_image and host.backend != "cpu"
    return SetupResult(host_build=host, container_build=None if skipped else container, image=tag, model=model_path,
                       gpu_images=gpu_images)
