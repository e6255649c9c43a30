"""Where apirctl keeps its files.

Everything lives under the platform's user directories (platformdirs), or under
one folder when `APIRCTL_HOME` is set: tests set it so they never touch a user's
real directories, and users set it to keep apirctl on another disk.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

APP_NAME = "apirctl"


@dataclass(frozen=True)
class Dirs:
    """The four directories apirctl writes to."""

    config: Path
    data: Path
    cache: Path
    state: Path

    @property
    def config_file(self) -> Path:
        return self.config / "config.toml"

    @property
    def models(self) -> Path:
        return self.data / "models"

    @property
    def bundles(self) -> Path:
        return self.data / "bundles"

    @property
    def builds(self) -> Path:
        return self.cache / "llama.cpp"

    @property
    def logs(self) -> Path:
        return self.state / "logs"

    @property
    def bench_results(self) -> Path:
        return self.data / "bench" / "results.jsonl"


def dirs() -> Dirs:
    """Resolve the directories now (the environment may change between calls in tests).

    `APIRCTL_CACHE_DIR` moves only the cache (the llama.cpp build), so that tests with a
    fresh home each can share one build.
    """
    home = os.environ.get("APIRCTL_HOME")
    if home:
        root = Path(home).expanduser().resolve()
        found = Dirs(config=root / "config", data=root / "data", cache=root / "cache", state=root / "state")
    else:
        import platformdirs

        found = Dirs(
            config=Path(platformdirs.user_config_dir(APP_NAME)),
            data=Path(platformdirs.user_data_dir(APP_NAME)),
            cache=Path(platformdirs.user_cache_dir(APP_NAME)),
            state=Path(platformdirs.user_state_dir(APP_NAME)),
        )
    cache = os.environ.get("APIRCTL_CACHE_DIR")
    if cache:
        found = replace(found, cache=Path(cache).expanduser().resolve())
    return found


def ensure(path: Path) -> Path:
    """Create a directory (and parents) if needed and return it."""
    path.mkdir(parents=True, exist_ok=True)
    return path


def package_data(*parts: str) -> Path:
    """A file shipped with apirctl: `templates/` and `krunkit_patches/`.

    In a source checkout they sit at the repository root; in a wheel they are
    installed under `apirctl/_data/`.
    """
    here = Path(__file__).resolve().parent
    installed = here / "_data" / Path(*parts)
    if installed.exists():
        return installed
    return here.parent / Path(*parts)
