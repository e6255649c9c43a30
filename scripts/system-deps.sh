#!/usr/bin/env bash
# Install what apirctl needs from the system package manager, only what is missing.
# Debian/Ubuntu (apt) and Fedora (dnf). Needs root or sudo when something is missing.
set -euo pipefail

need_cmds=(podman runc slirp4netns pasta cmake c++ ninja patch pkg-config ip tmux ldd ssh sshd)
missing=()
for c in "${need_cmds[@]}"; do command -v "$c" >/dev/null 2>&1 || missing+=("$c"); done
have_drm=1; [ -e /usr/include/libdrm/drm.h ] || have_drm=0
[ ${#missing[@]} -eq 0 ] && [ $have_drm -eq 1 ] && { echo "system packages: all present"; exit 0; }

SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "system packages: installing (missing: ${missing[*]:-} $([ $have_drm -eq 0 ] && echo libdrm headers))"
if command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq podman runc slirp4netns passt uidmap fuse-overlayfs cmake g++ ninja-build \
    pkg-config patch libdrm-dev iproute2 tmux openssh-client openssh-server >/dev/null
elif command -v dnf >/dev/null 2>&1; then
  $SUDO dnf install -y -q podman runc slirp4netns passt cmake gcc-c++ ninja-build patch pkgconf-pkg-config \
    libdrm-devel iproute tmux openssh-clients openssh-server
else
  echo "no apt-get or dnf: install podman, runc, slirp4netns, passt (pasta), cmake, a C++ compiler, ninja, libdrm headers" >&2
  exit 1
fi
