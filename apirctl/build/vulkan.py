"""What llama.cpp's Vulkan backend needs to build (`apirctl setup --vulkan`), and newer headers for Debian 12.

The build needs the Vulkan headers, `glslc` and the SPIR-V headers from the distribution. The pinned
llama.cpp uses `VK_EXT_layer_settings`' C++ types unconditionally, so its headers must be 1.3.272 or
newer; Debian 12 ships 1.3.239 (its loader, `glslc` and SPIR-V headers are fine). There, the headers of
Debian 13's `libvulkan-dev` are fetched through apt with a source list of apirctl's own (the host's
Debian mirror and keyring, suite `trixie`), unpacked with `dpkg-deb -x` into the build cache and given to
CMake as `Vulkan_INCLUDE_DIR`: nothing on the system changes. The headers only declare: the library
still loads the system's loader at run time (ggml-vulkan resolves every Vulkan call through it).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from apirctl.errors import ApirctlError, tail
from apirctl.paths import dirs, ensure

#: The pinned llama.cpp uses VK_EXT_layer_settings' C++ types unconditionally: headers 1.3.272 or newer.
MIN_HEADER = (1, 3, 272)
PACKAGES = ("`sudo apt-get install libvulkan-dev glslc spirv-headers` (Debian, Ubuntu 24.04; on Debian 12 apirctl "
            "fetches newer headers itself) or `sudo dnf install vulkan-loader-devel glslc spirv-headers-devel` "
            "(Fedora)")
#: Where newer headers come from on Debian 12: Debian 13's package, through the host's own Debian mirror.
HEADERS_SUITE = "trixie"
HEADERS_PACKAGE = "libvulkan-dev"
_DEBIAN_KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
_HEADER_VERSION = re.compile(r"#define VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION\(\s*0,\s*(\d+),\s*(\d+),\s*"
                             r"VK_HEADER_VERSION\s*\)|#define VK_HEADER_VERSION (\d+)")

Version = tuple[int, int, int]


def include_dirs() -> list[Path]:
    """Where the compiler looks for headers: CPLUS_INCLUDE_PATH/CPATH first (as g++ does), then the system."""
    extra = [Path(p) for var in ("CPLUS_INCLUDE_PATH", "CPATH") for p in os.environ.get(var, "").split(":") if p]
    return [*extra, Path("/usr/local/include"), Path("/usr/include")]


def header_version_in(folder: Path) -> Version | None:
    """The version of the Vulkan headers in `folder` (an include directory); None: none there."""
    core = folder / "vulkan" / "vulkan_core.h"
    if not core.exists():
        return None
    major_minor = patch = None
    for m in _HEADER_VERSION.finditer(core.read_text(errors="replace")):
        if m.group(3):
            patch = int(m.group(3))
        else:
            major_minor = (int(m.group(1)), int(m.group(2)))
    return (*major_minor, patch) if major_minor and patch is not None else None


def header_version() -> Version | None:
    """The version of the Vulkan headers the compiler would find by itself (None: none found)."""
    for folder in include_dirs():
        if (folder / "vulkan" / "vulkan_core.h").exists():
            return header_version_in(folder)
    return None


def _dotted(version: Version) -> str:
    return ".".join(map(str, version))


# --- newer headers for Debian 12 ------------------------------------------------------------------


def private_headers_dir() -> Path:
    """Where fetched headers live (in the build cache: they serve every Vulkan build of this user)."""
    return dirs().builds / "vulkan-headers" / HEADERS_SUITE


def private_headers() -> Path | None:
    """The include directory of headers fetched earlier, when complete and new enough."""
    include = private_headers_dir() / "include"
    version = header_version_in(include)
    return include if (private_headers_dir() / ".complete").exists() and version and version >= MIN_HEADER else None


def _apt_entries(text: str) -> list[tuple[list[str], list[str], list[str], str | None]]:
    """(URIs, suites, components, Signed-By) of each binary entry of an apt sources text, either format."""
    entries: list[tuple[list[str], list[str], list[str], str | None]] = []
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if line.startswith("#") or ":" not in line or line[:1].isspace():
                continue
            key, _, value = line.partition(":")
            fields[key.strip().lower()] = value.strip()
        if fields and "deb" in fields.get("types", "").split() and fields.get("enabled", "yes").lower() != "no":
            entries.append((fields.get("uris", "").split(), fields.get("suites", "").split(),
                            fields.get("components", "").split(), fields.get("signed-by") or None))
    for line in text.splitlines():  # one-line format: deb [options] URI SUITE COMPONENT...
        m = re.match(r"^\s*deb\s+(?:\[([^\]]*)\]\s+)?(\S+)\s+(\S+)\s+(.*)$", line)
        if m:
            options = dict(o.split("=", 1) for o in (m.group(1) or "").split() if "=" in o)
            entries.append(([m.group(2)], [m.group(3)], m.group(4).split(), options.get("signed-by")))
    return entries


def debian_mirror(apt_dir: Path = Path("/etc/apt")) -> tuple[str, str] | None:
    """(URI, keyring) of this host's Debian 12 archive, read from its apt sources (None: not Debian 12).

    The host's own mirror (and its apt proxy settings) is used, not a host name apirctl would pick.
    """
    files = [apt_dir / "sources.list", *sorted((apt_dir / "sources.list.d").glob("*.list")),
             *sorted((apt_dir / "sources.list.d").glob("*.sources"))]
    for path in files:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for uris, suites, components, signed_by in _apt_entries(text):
            keyring = signed_by or (str(_DEBIAN_KEYRING) if _DEBIAN_KEYRING.exists() else None)
            if "bookworm" in suites and "main" in components and uris and keyring and keyring.startswith("/"):
                return uris[0], keyring
    return None


def can_fetch_headers() -> bool:
    """Can `fetch_headers` work here: Debian 12 with apt-get, dpkg-deb and a Debian mirror."""
    return bool(shutil.which("apt-get") and shutil.which("dpkg-deb") and debian_mirror())


def apt_source(uri: str, keyring: str) -> str:
    """The one-entry deb822 source list apirctl's private apt uses: Debian 13's main, the host's mirror."""
    return f"Types: deb\nURIs: {uri}\nSuites: {HEADERS_SUITE}\nComponents: main\nSigned-By: {keyring}\n"


def fetch_headers() -> Path:
    """Debian 13's Vulkan headers, fetched once into the build cache; returns their include directory.

    apt runs with lists, cache and sources of its own in a temporary folder (the system's package
    state is neither read nor changed; apt checks the signed index and the package's digest as usual).
    """
    done = private_headers()
    if done is not None:
        return done
    mirror = debian_mirror()
    if mirror is None or not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
        raise ApirctlError("cannot fetch newer Vulkan headers: this is not Debian 12 with apt",
                           hint=f"install Vulkan headers {_dotted(MIN_HEADER)} or newer and put their include/ on "
                                "CPLUS_INCLUDE_PATH")
    target = ensure(private_headers_dir().parent)
    with tempfile.TemporaryDirectory(dir=target, prefix=".fetch-") as tmp:
        work = Path(tmp)
        work.chmod(0o755)  # apt downloads as its sandbox user where it can
        for sub in ("sources", "lists/partial", "cache/archives/partial", "deb", "unpacked"):
            (work / sub).mkdir(parents=True)
        (work / "sources" / "apirctl.sources").write_text(apt_source(*mirror))
        options = ["-o", "Dir::Etc::sourcelist=-", "-o", f"Dir::Etc::sourceparts={work / 'sources'}",
                   "-o", f"Dir::State::Lists={work / 'lists'}", "-o", f"Dir::Cache={work / 'cache'}",
                   "-o", "Dir::State::status=/dev/null", "-o", "Debug::NoLocking=1", "-qq"]
        for step in (["update"], ["download", HEADERS_PACKAGE]):
            proc = subprocess.run(["apt-get", *options, *step], cwd=work / "deb", capture_output=True, text=True)
            if proc.returncode != 0:
                raise ApirctlError(f"apt-get {step[0]} for Debian {HEADERS_SUITE}'s {HEADERS_PACKAGE} failed: "
                                   f"{tail(proc.stderr or proc.stdout, default='no output')}",
                                   hint=f"install Vulkan headers {_dotted(MIN_HEADER)} or newer and put their "
                                        "include/ on CPLUS_INCLUDE_PATH")
        debs = sorted((work / "deb").glob("*.deb"))
        if not debs:
            raise ApirctlError(f"apt-get download {HEADERS_PACKAGE} left no package")
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(work / "unpacked")], check=True, capture_output=True)
        include = work / "unpacked" / "usr" / "include"
        version = header_version_in(include)
        if version is None or version < MIN_HEADER:
            raise ApirctlError(f"Debian {HEADERS_SUITE}'s {HEADERS_PACKAGE} has Vulkan headers "
                               f"{_dotted(version) if version else 'of no known version'}, not "
                               f"{_dotted(MIN_HEADER)} or newer")
        staged = work / "staged"
        staged.mkdir()
        include.rename(staged / "include")
        (staged / ".complete").write_text(f"{debs[0].name}\n")
        final = private_headers_dir()
        if final.exists():
            shutil.rmtree(final)
        staged.rename(final)
    found = private_headers()
    assert found is not None
    return found


# --- what the build needs -------------------------------------------------------------------------


def build_headers() -> Path | None:
    """The include directory CMake must be pointed at, fetched on first use on Debian 12 (None: the
    headers the compiler finds are new enough)."""
    version = header_version()
    if version is not None and version >= MIN_HEADER:
        return None
    return fetch_headers()


def missing() -> list[str]:
    """What the Vulkan build needs and this host lacks (empty: ready; old headers that apirctl can
    replace on Debian 12 are not missing: `fetch_headers` gets them at build time)."""
    lacking = []
    version = header_version()
    if version is None:
        lacking.append("the Vulkan headers and loader (libvulkan-dev)")
    elif version < MIN_HEADER and private_headers() is None and not can_fetch_headers():
        lacking.append(f"Vulkan headers {_dotted(MIN_HEADER)} or newer (found {_dotted(version)}; point "
                       "CPLUS_INCLUDE_PATH at newer ones: on Debian 12 apirctl fetches Debian 13's itself)")
    if shutil.which("glslc") is None:
        lacking.append("the shader compiler glslc")
    if not any((d / "spirv").is_dir() for d in include_dirs()):
        lacking.append("the SPIR-V headers (spirv-headers)")
    return lacking
