"""Split GGUFs: one model in N files named `PREFIX-00001-of-0000N.gguf` … `PREFIX-0000N-of-0000N.gguf`.

llama.cpp opens the first part and finds the others beside it by these names, so the parts are
always fetched, kept and mounted together under their original names.
"""

from __future__ import annotations

import re

_PART = re.compile(r"^(?P<prefix>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


def is_part(filename: str) -> bool:
    return _PART.match(filename.rsplit("/", 1)[-1]) is not None


def parts(filename: str) -> list[str]:
    """Every part's name, the first first, for any part's name (a path keeps its folder); [filename] if whole."""
    folder, _, base = filename.rpartition("/")
    match = _PART.match(base)
    if not match or int(match.group("count")) < 1:
        return [filename]
    count = int(match.group("count"))
    names = [f"{match.group('prefix')}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    return [f"{folder}/{name}" if folder else name for name in names]
