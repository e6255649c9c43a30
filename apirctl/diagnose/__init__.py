"""`apirctl doctor` and `apirctl info`: checks with fixes (`doctor`), versions and the host
(`sysinfo`), the host servers' sandbox (`sandbox`). Submodules are imported by name."""

__all__ = ["doctor", "sandbox", "sysinfo"]
