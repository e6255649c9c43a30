#!/usr/bin/env bash
# Install what apirctl needs from the system package manager, only what is missing.
# Debian/Ubuntu (apt) and Fedora (dnf). Needs root or sudo when something is missing.
# --vulkan: also what `apirctl setup --vulkan` builds with (the Vulkan loader and headers, glslc, the
# SPIR-V headers) and Mesa's Vulkan drivers (lavapipe, the software device its test runs on). On
# Debian 12 the headers are too old for the pinned llama.cpp: apirctl fetches Debian 13's itself.
set -euo pipefail

vulkan=0
[ "${1:-}" = "--vulkan" ] && vulkan=1

# ccache: every native build goes through it (apirctl.build.ccache), so a rebuild compiles only what changed
need_cmds=(podman runc slirp4netns pasta cmake c++ ninja ccache patch pkg-config ip tmux ldd ssh sshd)
missing=()
for c in "${need_cmds[@]}"; do command -v "$c" >/dev/null 2>&1 || missing+=("$c"); done
[ -e /usr/include/libdrm/drm.h ] || missing+=("libdrm headers")
# serve --isolation vm: QEMU (with SeaBIOS for its q35 machine) and mke2fs for the root filesystem image;
# the VM's kernel and busybox are fetched by apirctl itself with `apt-get download`, never installed
command -v qemu-system-x86_64 >/dev/null 2>&1 || missing+=(qemu-system-x86)
[ -e /usr/share/seabios/bios-256k.bin ] || [ -e /usr/share/qemu/bios-256k.bin ] || missing+=(seabios)
command -v mke2fs >/dev/null 2>&1 || missing+=(e2fsprogs)
# clang with libFuzzer's runtime: the APIR host library's fuzzer (tests/apir/fuzz)
command -v clang++ >/dev/null 2>&1 && [ -e "$(clang++ -print-file-name=libclang_rt.fuzzer-$(uname -m).a 2>/dev/null)" ] \
  || missing+=("clang with libFuzzer")
if [ $vulkan -eq 1 ]; then
  command -v glslc >/dev/null 2>&1 || missing+=(glslc)
  [ -e /usr/include/vulkan/vulkan_core.h ] || missing+=("Vulkan headers")
  [ -d /usr/include/spirv ] || missing+=("SPIR-V headers")
  ls /usr/share/vulkan/icd.d/lvp_icd.*.json >/dev/null 2>&1 || missing+=(lavapipe)
fi
[ ${#missing[@]} -eq 0 ] && { echo "system packages: all present"; exit 0; }

SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "system packages: installing (missing: ${missing[*]})"
if command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  vk=(); [ $vulkan -eq 1 ] && vk=(libvulkan-dev glslc spirv-headers mesa-vulkan-drivers)
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq podman runc slirp4netns passt uidmap fuse-overlayfs cmake g++ ninja-build ccache \
    pkg-config patch libdrm-dev iproute2 tmux openssh-client openssh-server clang libclang-rt-dev \
    qemu-system-x86 seabios e2fsprogs "${vk[@]}" >/dev/null
elif command -v dnf >/dev/null 2>&1; then
  vk=(); [ $vulkan -eq 1 ] && vk=(vulkan-loader-devel glslc spirv-headers-devel mesa-vulkan-drivers)
  $SUDO dnf install -y -q podman runc slirp4netns passt cmake gcc-c++ ninja-build ccache patch pkgconf-pkg-config \
    libdrm-devel iproute tmux openssh-clients openssh-server clang compiler-rt qemu-system-x86-core seabios-bin \
    e2fsprogs "${vk[@]}"
else
  echo "no apt-get or dnf: install podman, runc, slirp4netns, passt (pasta), cmake, a C++ compiler, ninja, ccache, libdrm headers" >&2
  exit 1
fi
