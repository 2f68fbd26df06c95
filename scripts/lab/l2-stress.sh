#!/usr/bin/env bash
# Runs the same busy Linux guest under rollbox-vmm and under QEMU with KVM side by side, in L1
# of the nested lab, and counts the guests that did not finish (a triple fault, a hang). It
# tells a fault of the lab's emulated SVM, which both VMMs see, from one of rollbox-vmm's.
#
# Usage (on the host): scripts/lab/run.sh -- scripts/lab/l2-stress.sh [--guests N] [--rounds R]
#                      [--loops L] [--guest-timeout S]
#   N guests of each VMM at once (default 3), R rounds (default 2), L workload loops (default 300);
#   a guest still running after S seconds (default 900) is stopped and counted as unfinished
# The guest: our kernel (ROLLBOX_KERNEL_DIR, kernel-config/build.sh) and a small ext4 of static
# busybox whose /init forks processes, touches memory and writes files L times, then prints
# "l2-stress: done" and powers off. rollbox-vmm: target/debug (ROLLBOX_VMM to override).
# Prints one line per guest and a summary per VMM; exits 0 whatever the counts say.
set -uo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$SCRIPT_DIR/../.." && pwd)"
guests=3 rounds=2 loops=300 guest_timeout=900
while [[ $# -gt 0 ]]; do
    case "$1" in
        --guests) guests="$2"; shift 2 ;;
        --rounds) rounds="$2"; shift 2 ;;
        --loops) loops="$2"; shift 2 ;;
        --guest-timeout) guest_timeout="$2"; shift 2 ;;
        *) echo "l2-stress: unknown argument $1" >&2; exit 2 ;;
    esac
done
kernel="${ROLLBOX_KERNEL_DIR:?set ROLLBOX_KERNEL_DIR (kernel-config/build.sh)}/vmlinux"
vmm="${ROLLBOX_VMM:-$ROOT/target/debug/rollbox-vmm}"
[[ -e /dev/kvm ]] || { echo "l2-stress: no /dev/kvm here (run it in the lab)" >&2; exit 2; }

work="$(mktemp -d /tmp/l2-stress.XXXXXX)"
tree="$work/tree"
mkdir -p "$tree"/{bin,dev,proc,sys,tmp,data}
cp /bin/busybox "$tree/bin/busybox"
cat > "$tree/init" <<EOF
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t tmpfs tmp /tmp
echo "l2-stress: start"
i=0
while [ \$i -lt $loops ]; do
    sh -c "echo \$i > /tmp/f.\$((i % 8)); cat /tmp/f.\$((i % 8)) > /dev/null"
    dd if=/dev/zero of=/tmp/m bs=64k count=16 2>/dev/null
    dd if=/dev/urandom of=/data/w.\$((i % 4)) bs=16k count=4 conv=fsync 2>/dev/null
    i=\$((i + 1))
done
echo "l2-stress: done"
reboot -f
EOF
chmod 0755 "$tree/init"
image="$work/image.ext4"
mkfs.ext4 -q -d "$tree" "$image" 64M || { echo "l2-stress: mkfs.ext4 failed" >&2; exit 1; }
cmdline="console=ttyS0 reboot=k panic=-1 root=/dev/vda rw init=/init"

run_guest() { # VMM INDEX ROUND
    local which="$1" i="$2" r="$3" disk log start
    disk="$work/$which-$i-$r.ext4"
    log="$work/$which-$i-$r.log"
    cp "$image" "$disk"
    start=$SECONDS
    case "$which" in
        rollbox)
            timeout "$guest_timeout" "$vmm" --no-seccomp --kernel "$kernel" --cmdline "$cmdline" \
                --memory-mib 128 --drive "$disk,root" > "$log" 2>&1 ;;
        qemu)
            timeout "$guest_timeout" qemu-system-x86_64 -enable-kvm -cpu host -m 128 -smp 1 \
                -M microvm,acpi=off -nodefaults -no-user-config -nographic -no-reboot \
                -serial stdio -kernel "$kernel" -append "$cmdline" \
                -drive "file=$disk,format=raw,if=none,id=d0" -device virtio-blk-device,drive=d0 \
                > "$log" 2>&1 ;;
    esac
    local rc=$? verdict=done oops
    oops=$(grep -c -E "Oops|BUG:|general protection fault|Kernel panic" "$log")
    grep -q "l2-stress: done" "$log" || verdict=UNFINISHED
    grep -q "KVM_EXIT_SHUTDOWN" "$log" && verdict="UNFINISHED (KVM_EXIT_SHUTDOWN)"
    [[ $rc -eq 124 ]] && verdict="UNFINISHED (still running after $guest_timeout s: hung or slow)"
    # QEMU with -no-reboot exits 0 when the guest resets (a triple fault is a reset).
    [[ "$which" == qemu && "$verdict" == UNFINISHED && $rc -eq 0 ]] &&
        verdict="UNFINISHED (the guest reset)"
    echo "l2-stress: $which guest $i round $r: $verdict, exit $rc, $((SECONDS - start)) s, $oops oops lines"
    [[ "$verdict" == done && "$oops" -eq 0 ]] || tail -n 5 "$log" | sed "s/^/    $which-$i-$r: /"
    [[ "$oops" -eq 0 ]] || grep -m 3 -E "Oops|BUG:|general protection fault|Kernel panic|RIP:|EFLAGS:" "$log" | sed "s/^/    $which-$i-$r: /"
    rm -f "$disk"
}

for r in $(seq "$rounds"); do
    for i in $(seq "$guests"); do
        run_guest rollbox "$i" "$r" &
        run_guest qemu "$i" "$r" &
    done
    wait
done 2>&1 | tee "$work/summary"
for which in rollbox qemu; do
    total=$(grep -c "l2-stress: $which guest" "$work/summary")
    bad=$(grep "l2-stress: $which guest" "$work/summary" | grep -c UNFINISHED)
    faults=$(grep "l2-stress: $which guest" "$work/summary" | grep -c -e KVM_EXIT_SHUTDOWN -e "the guest reset")
    oopsed=$(grep "l2-stress: $which guest" "$work/summary" | grep -vc ", 0 oops lines")
    echo "l2-stress: $which: $bad of $total guests did not finish ($faults triple faults or resets), $oopsed oopsed"
done
rm -rf "$work"
