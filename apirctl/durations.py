"""How apirctl says a length of time: the way `podman ps` does (12s, 5m3s, 2h13m, 3d1h), so that `ps`
and `machine status` read alike."""

from __future__ import annotations


def short(seconds: float) -> str:
    """The two largest units of a length of time; a negative one (a clock that went back) is 0s."""
    total = max(0, int(seconds))
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours}h"
    if hours:
        return f"{hours}h{minutes}m"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"
