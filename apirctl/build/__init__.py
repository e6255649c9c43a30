"""What apirctl builds: llama.cpp from the pinned source (`llamacpp`), the local inference image
(`image`), `apirctl setup`'s steps (`provision`), and what the Vulkan build needs from the
distribution (`vulkan`). Submodules are imported by name."""

__all__ = ["image", "llamacpp", "provision", "vulkan"]
