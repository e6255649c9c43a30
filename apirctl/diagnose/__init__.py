"""`apirctl doctor` and `apirctl info`: checks with fixes (`doctor`), versions and the host
(`sysinfo`). Submodules are imported by name."""

__all__ = ["doctor", "sysinfo"]
