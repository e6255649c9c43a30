"""What apirctl builds: llama.cpp from the pinned source (`llamacpp`), the local inference image
(`image`), `apirctl setup`'s steps (`provision`), what the Vulkan build needs from the
distribution (`vulkan`), the compiler cache every native build goes through (`ccache`) and the
Vulkan build's shader cache (`shader_cache`). Submodules are imported by name."""

__all__ = ["ccache", "image", "llamacpp", "provision", "shader_cache", "vulkan"]
