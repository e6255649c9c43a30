"""A cache of compiled Vulkan shaders: ccache caches the C++ of a Vulkan build, not its shaders.

The Vulkan backend's build runs `vulkan-shaders-gen`, which runs `glslc` once per shader variant
(about 1,100 of them): most of a Vulkan build's time once ccache serves the C++. Every build tree
(another patch digest, a build root made again) compiles them all again, though the shaders rarely
change. So a Vulkan build names a wrapper, written into its build root, as CMake's
`Vulkan_GLSLC_EXECUTABLE`: it keeps each SPIR-V output and its dependency file in apirctl's cache
directory (`glslc/<set>/`), where the set is the digest of the shader folder's files and of
glslc's version, and an entry is the digest of the command line with its paths made relative. A
second build of the same shaders copies 1,100 small files instead of compiling them. Anything the
wrapper does not recognise as one shader compiled into one file (CMake's feature tests) runs glslc
itself. Like ccache it is not part of a build's key, and `APIRCTL_CCACHE=0` turns both off.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
from pathlib import Path

#: The wrapper's name in a build root.
WRAPPER = "glslc-cached"
#: The wrapper, a POSIX shell script (a few milliseconds a call: a Python one cost more than a hit
#: saves), with the real glslc and the cache folder of its shader set filled in.
_TEMPLATE = r"""#!/bin/sh
# Written by apirctl (apirctl/build/shader_cache.py): glslc through a cache of its outputs.
REAL={real}; CACHE={cache}
out=-; dep=; src=; n=0; prev=
for a in "$@"; do
  case $prev in -o) out=$a ;; -MF) dep=$a ;; esac
  case $a in -*) ;; *.comp) src=$a; n=$((n + 1)) ;; esac
  prev=$a
done
# one shader into one file, its folder named (the dependency file's paths are made relative to it)
if [ "$out" = - ] || [ "$n" != 1 ]; then exec "$REAL" "$@"; fi
case $src in ?*/*) here=${{src%/*}} ;; *) exec "$REAL" "$@" ;; esac
case "$out$dep$here" in *[\|\&\\]*) exec "$REAL" "$@" ;; esac
key=$(for a in "$@"; do
  if [ "$a" = "$out" ]; then echo @OUT@
  elif [ -n "$dep" ] && [ "$a" = "$dep" ]; then echo @DEP@
  elif [ "$a" = "$src" ]; then echo "${{src##*/}}"
  else printf '%s\n' "$a"; fi
done | sha256sum)
entry=$CACHE/${{key%% *}}
if [ -f "$entry.spv" ] && {{ [ -z "$dep" ] || [ -f "$entry.d" ]; }}; then
  cp "$entry.spv" "$out.$$" && mv -f "$out.$$" "$out" || exit 1
  if [ -n "$dep" ]; then
    sed -e "s|@SRC@|$here|g" -e "s|@OUT@|$out|g" "$entry.d" > "$dep.$$" && mv -f "$dep.$$" "$dep" || exit 1
  fi
  [ -z "$APIRCTL_GLSLC_CACHE_LOG" ] || echo "hit ${{out##*/}}" >> "$APIRCTL_GLSLC_CACHE_LOG"
  exit 0
fi
err=$(mktemp) || exit 1
"$REAL" "$@" 2> "$err"; rc=$?
cat "$err" >&2
if [ $rc = 0 ] && [ ! -s "$err" ] && mkdir -p "$CACHE"; then  # a warning shows again next time: not kept
  if [ -n "$dep" ]; then
    sed -e "s|$out|@OUT@|g" -e "s|$here|@SRC@|g" "$dep" > "$entry.d.$$" && mv -f "$entry.d.$$" "$entry.d"
  fi
  cp "$out" "$entry.spv.$$" && mv -f "$entry.spv.$$" "$entry.spv"
fi
rm -f "$err"
[ -z "$APIRCTL_GLSLC_CACHE_LOG" ] || echo "miss ${{out##*/}}" >> "$APIRCTL_GLSLC_CACHE_LOG"
exit $rc
"""


def shader_set(shaders: Path, glslc: str) -> str:
    """The digest of a shader folder's files (names and bytes, includes too) and of glslc's version."""
    h = hashlib.sha256(subprocess.run([glslc, "--version"], capture_output=True, text=True).stdout.encode())
    for path in sorted(p for p in shaders.iterdir() if p.is_file()):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def cmake_args(shaders: Path, build_root: Path, cache_root: Path) -> list[str]:
    """`-DVulkan_GLSLC_EXECUTABLE=` the wrapper, written into `build_root` for the shaders of `shaders`
    and a cache under `cache_root` (empty: glslc is missing, or the compiler caches are off)."""
    glslc = shutil.which("glslc")
    if glslc is None or os.environ.get("APIRCTL_CCACHE", "1") == "0" or not shaders.is_dir():
        return []
    cache = cache_root / "glslc" / shader_set(shaders, glslc)
    wrapper = build_root / WRAPPER
    text = _TEMPLATE.format(real=shlex.quote(glslc), cache=shlex.quote(str(cache)))
    if not wrapper.exists() or wrapper.read_text() != text:
        partial = wrapper.with_name(wrapper.name + ".partial")
        partial.write_text(text)
        partial.chmod(0o755)
        partial.replace(wrapper)
    return [f"-DVulkan_GLSLC_EXECUTABLE={wrapper}"]
