#!/usr/bin/env bash
# Does this machine's KVM boot the kit's kernel, and how far? (issue 32: the GPU machine's VM rows)
#
#   benchmarks/vm_kvm_probe.sh KIT [SECONDS]
#
# KIT is what `benchmarks/gpu_vm.py pack` wrote. All VARIANTS at once, each for SECONDS (default 20),
# their consoles and SeaBIOS's debug port kept: the kit's bzImage on q35 as apirctl boots it (the
# real-mode setup and the decompressor first); the same kernel entered at its PVH note (the ELF inside
# the bzImage, decompressed here; QEMU enters it in 32-bit mode, past both) on q35 and microvm, alone
# and without each early step it was seen to stop after; and the PVH kernel under TCG as the control,
# which boots to init everywhere. Prints, per VM, how far the kernel got.
set -uo pipefail
KIT="${1:?usage: vm_kvm_probe.sh KIT [SECONDS]}"
T="${2:-20}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
tar -xJf "$KIT/qemu.tar.xz" -C "$WORK" || exit 1
Q="$WORK/qemu"
export LD_LIBRARY_PATH="$Q/lib" QEMU_MODULE_DIR="$Q/modules"
# the bzImage's payload is xz: the ELF with the PVH note begins at its magic
python3 - "$KIT/vmlinuz" "$WORK/vmlinux" <<'PY' || exit 1
import lzma, sys
data = open(sys.argv[1], "rb").read()
start = data.find(b"\xfd7zXZ\x00")
if start < 0:
    sys.exit("no xz payload in the bzImage")
open(sys.argv[2], "wb").write(lzma.LZMADecompressor(lzma.FORMAT_XZ).decompress(data[start:]))
PY
ARGS="console=ttyS0 earlyprintk=serial,ttyS0,115200 ignore_loglevel panic=-1"
boot() {  # boot NAME KERNEL EXTRA-KERNEL-ARGS QEMU-ARGS...
    local name="$1" kernel="$2" extra="$3"
    shift 3
    timeout "$T" "$Q/bin/qemu-system-x86_64" -L "$Q/share" "$@" -m 1024 -nodefaults -no-user-config \
        -display none -no-reboot -kernel "$kernel" -initrd "$KIT/initrd" -append "$ARGS$extra" \
        -serial "file:$WORK/$name.console" -chardev "file,id=dbg,path=$WORK/$name.bios" \
        -device isa-debugcon,iobase=0x402,chardev=dbg >"$WORK/$name.err" 2>&1
    echo "exit $?" >>"$WORK/$name.err"
}
B="$KIT/vmlinuz" V="$WORK/vmlinux"
# NAME KERNEL EXTRA-KERNEL-ARGS QEMU-ARGS: apirctl's boot, then the PVH entry, then the PVH entry with
# each early step the first runs stopped at left out in turn (the paravirtual clock, the APIC, SMP, the
# hypervisor's CPUID leaves), then the control
VARIANTS=(
    "q35-kvm-bzimage|$B||-M q35 -accel kvm -cpu host,-arch-capabilities -smp 2"
    "q35-kvm-pvh|$V||-M q35 -accel kvm -cpu host,-arch-capabilities -smp 2"
    "microvm-kvm-pvh|$V||-M microvm -accel kvm -cpu host,-arch-capabilities -smp 2"
    "q35-kvm-pvh-no-kvmclock|$V| no-kvmclock clocksource=tsc tsc=reliable|-M q35 -accel kvm -cpu host,-arch-capabilities,-kvmclock -smp 2"
    "q35-kvm-pvh-noapic|$V| noapic nolapic|-M q35,kernel-irqchip=split -accel kvm -cpu host,-arch-capabilities -smp 1"
    "q35-kvm-pvh-one-cpu|$V| nosmp|-M q35 -accel kvm -cpu host,-arch-capabilities -smp 1"
    "q35-kvm-pvh-no-hypervisor|$V||-M q35 -accel kvm -cpu host,-arch-capabilities,kvm=off,-hypervisor -smp 2"
    "microvm-kvm-pvh-no-kvmclock|$V| no-kvmclock tsc_early_khz=2100000|-M microvm -accel kvm -cpu host,-arch-capabilities,-kvmclock -smp 2"
    "q35-tcg-pvh|$V||-M q35 -accel tcg -cpu max -smp 2"
)
for variant in "${VARIANTS[@]}"; do
    IFS='|' read -r name kernel extra qemu <<<"$variant"
    # shellcheck disable=SC2086 # QEMU's arguments, split on purpose
    boot "$name" "$kernel" "$extra" $qemu &
done
wait
# what a results file needs: when, the machine, and which kit (its series and kernel)
echo "probe: $(date -u +%FT%TZ); CPU:$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-) x $(nproc);" \
    "GPU: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1 || true)"
echo "kit: series $(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["patch_digest"])' \
    "$KIT/kit.json"); vmlinuz sha256 $(sha256sum "$KIT/vmlinuz" | cut -c1-16); probe seconds: $T"
echo "kernel: $(uname -r); /dev/kvm: $(ls -l /dev/kvm 2>&1); $("$Q/bin/qemu-system-x86_64" --version | head -1)"
# which KVM: kvm_intel or kvm_amd boot ordinary guests; kvm_pvm (apirctl.vm.accel's PVM) only PVM guests
echo "KVM modules: $(cd /sys/module && ls -d kvm* 2>/dev/null | tr '\n' ' '); CPU virtualization flags:" \
    "$(grep -m1 -o -w -E 'vmx|svm|hypervisor' /proc/cpuinfo | sort -u | tr '\n' ' ')"
for variant in "${VARIANTS[@]}"; do
    name="${variant%%|*}"
    console="$WORK/$name.console"
    echo "===== $name: $(tr '\n' ' ' <"$WORK/$name.err")"
    echo "firmware: $(head -c 300 "$WORK/$name.bios" 2>/dev/null | tr '\n' '|')"
    echo "console: $(wc -l <"$console") lines; kernel started: $(grep -c 'Linux version' "$console");" \
        "init ran: $(grep -c 'Run /init' "$console"); last line:"
    grep -a . "$console" | tail -n 1
done
