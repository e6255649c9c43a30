"""What apirctl builds: llama.cpp from the pinned source (`llamacpp`), the local inference image
(`image`), and `apirctl setup`'s steps (`provision`). Submodules are imported by name."""

__all__ = ["image", "llamacpp", "provision"]
