"""Where apirctl keeps its files.

Everything lives under the platform's user directories (platformdirs), or under
one folder when `APIRCTL_HOME` is set: tests set it so they never touch a user's
real directories, and users set it to keep apirctl on another disk.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from apirctl.errors import ApirctlError

APP_NAME = "apirctl"
#: The longest path a Unix socket may have (sun_path is 108 bytes with the terminating zero).
MAX_SOCKET_PATH = 107


@dataclass(frozen=True)
class Dirs:
    """The four directories apirctl writes to."""

    config: Path
    data: Path
    cache: Path
    state: Path
    runtime: Path  # sockets only their owner may open (`private_dir` checks it at each use)

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
    fresh home each can share one build. The runtime directory is `$XDG_RUNTIME_DIR/apirctl`
    (a per-user tmpfs) where there is one, else `run/` in the state directory;
    `APIRCTL_RUNTIME_DIR` moves it, for a home whose path is too long for socket paths.
    """
    home = os.environ.get("APIRCTL_HOME")
    if home:
        root = Path(home).expanduser().resolve()
        found = Dirs(config=root / "config", data=root / "data", cache=root / "cache", state=root / "state",
                     runtime=root / "run")
    else:
        import platformdirs

        state = Path(platformdirs.user_state_dir(APP_NAME))
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        found = Dirs(
            config=Path(platformdirs.user_config_dir(APP_NAME)),
            data=Path(platformdirs.user_data_dir(APP_NAME)),
            cache=Path(platformdirs.user_cache_dir(APP_NAME)),
            state=state,
            runtime=Path(xdg) / APP_NAME if xdg and Path(xdg).is_absolute() else state / "run",
        )
    cache = os.environ.get("APIRCTL_CACHE_DIR")
    if cache:
        found = replace(found, cache=Path(cache).expanduser().resolve())
    runtime = os.environ.get("APIRCTL_RUNTIME_DIR")
    if runtime:
        found = replace(found, runtime=Path(runtime).expanduser().absolute())
    return found


def ensure(path: Path) -> Path:
    """Create a directory (and parents) if needed and return it."""
    path.mkdir(parents=True, exist_ok=True)
    return path


def private_dir(path: Path) -> Path:
    """`path` as a directory only this user can enter: created with mode 0700 when missing, and
    refused (never repaired behind the user's back) when it is a link, another user's, or open to
    group or others. Sockets in it are then private whatever their own mode."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise ApirctlError(f"{path} is not a directory (apirctl keeps its sockets there)",
                           hint="remove it, or set APIRCTL_RUNTIME_DIR to a private directory")
    if info.st_uid != os.geteuid():
        raise ApirctlError(f"{path} belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()})",
                           hint="remove it, or set APIRCTL_RUNTIME_DIR to a directory of your own")
    if info.st_mode & 0o077:
        raise ApirctlError(f"{path} is open to other users (mode {stat.S_IMODE(info.st_mode):04o}); apirctl keeps "
                           "sockets there that give access to this user's GPU and memory",
                           hint=f"make it private with `chmod 700 {path}`")
    return path


def socket_path(directory: Path, name: str) -> Path:
    """`directory/name` for a Unix socket, or a clear error when the path is too long to bind."""
    path = directory / name
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ApirctlError(f"the socket path {path} is {len(os.fsencode(path))} bytes, longer than the "
                           f"{MAX_SOCKET_PATH} a Unix socket allows",
                           hint="set APIRCTL_RUNTIME_DIR to a shorter directory (e.g. under /run/user or /tmp)")
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


@contextlib.contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `lock_path` (made if missing) for the block: one holder at a time
    across processes (two `apirctl` commands, the test suite's workers), released if the holder dies."""
    import fcntl

    with lock_path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
