#!/usr/bin/env bash
# Smoke test of the TCG harness and the guest kernel: builds (or reuses) the
# kernel from kernel-config/build.sh, makes a tiny ext4 rootfs (busybox-static,
# an /init script and vsock-echo), and boots it with scripts/tcg/boot.sh three
# ways: the PVH vmlinux on QEMU's pc machine (virtio-pci), the bzImage on pc,
# and the vmlinux on microvm (virtio-mmio devices from the kernel command line,
# like rollbox-vmm, with 2 vCPUs). Each boot checks:
#   - the kernel reaches /init (and how long it took);
#   - cgroup v2 controllers, overlayfs and devtmpfs are there;
#   - guest -> host vsock: the guest connects to CID 2 port 5000, which arrives
#     on <uds>_5000, and gets its line echoed;
#   - host -> guest vsock: "CONNECT 1024\n" on <uds>, "OK", then an echo;
#   - the guest ends with `reboot -f` and QEMU exits.
#
# Usage: scripts/tcg/smoke.sh [--kernel K] [--timeout SECS] [--keep]
#   --kernel K   boot this image (bzImage, or vmlinux with PVH) on pc and on
#                microvm, instead of the images from kernel-config/build.sh
#   --keep       keep the work directory (rootfs, logs) even on success
# A missing tool is one SKIP line and exit 0, unless ROLLBOX_REQUIRE_ALL=1.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly SCRIPT_DIR
REPO_DIR="$(cd "$SCRIPT_DIR/../.." && pwd)"
readonly REPO_DIR
readonly HOST_PORT=5000
readonly GUEST_PORT=1024

log() { echo "smoke.sh: $*" >&2; }
die() { echo "smoke.sh: FAIL: $*" >&2; exit 1; }
skip() {
    if [[ "${ROLLBOX_REQUIRE_ALL:-}" == 1 ]]; then
        die "$* (ROLLBOX_REQUIRE_ALL=1, so this is a failure)"
    fi
    echo "smoke.sh: SKIP: $*"
    exit 0
}

kernel="" timeout=180 keep=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --kernel) [[ $# -ge 2 ]] || die "--kernel needs a value"; kernel="$2"; shift 2 ;;
        --timeout) [[ $# -ge 2 && "$2" =~ ^[0-9]+$ ]] || die "--timeout needs seconds"; timeout="$2"; shift 2 ;;
        --keep) keep=1; shift ;;
        -h|--help) sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument '$1' (try --help)" ;;
    esac
done

command -v qemu-system-x86_64 >/dev/null || skip "qemu-system-x86_64 not installed (apt-get install -y qemu-system-x86)"
command -v vhost-device-vsock >/dev/null || [[ -x "${CARGO_HOME:-$HOME/.cargo}/bin/vhost-device-vsock" ]] \
    || skip "vhost-device-vsock not installed (scripts/tcg/install-vhost-device-vsock.sh)"
busybox="$(command -v busybox || true)"
# ldd fails on a static executable.
if [[ -z "$busybox" ]] || ldd "$busybox" >/dev/null 2>&1; then
    skip "no static busybox (apt-get install -y busybox-static)"
fi
command -v mkfs.ext4 >/dev/null || skip "mkfs.ext4 not installed (apt-get install -y e2fsprogs)"
command -v gcc >/dev/null || skip "gcc not installed"

kernel_dir=""
if [[ -z "$kernel" ]]; then
    if ! dpkg-query -W linux-source-6.1 >/dev/null 2>&1; then
        skip "linux-source-6.1 not installed, so no kernel to boot (see kernel-config/README.md)"
    fi
    log "building or reusing the guest kernel (kernel-config/build.sh)"
    kernel_dir="$("$REPO_DIR/kernel-config/build.sh" | tail -n 1)"
    [[ -f "$kernel_dir/vmlinux" && -f "$kernel_dir/bzImage" ]] || die "kernel-config/build.sh gave no images in '$kernel_dir'"
else
    [[ -f "$kernel" ]] || die "kernel not found: $kernel"
fi

work="$(mktemp -d "${TMPDIR:-/tmp}/rollbox-tcg-smoke.XXXXXX")"
state_dirs=()
listener_pids=()
cleanup() {
    local rc=$? dir pid
    for dir in "${state_dirs[@]}"; do
        "$SCRIPT_DIR/stop.sh" "$dir" >/dev/null 2>&1 || true
    done
    for pid in "${listener_pids[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    if [[ "$rc" -eq 0 && "$keep" -eq 0 ]]; then
        rm -rf "$work"
    else
        log "work directory kept: $work"
    fi
}
trap cleanup EXIT

# Guest userspace: busybox applets, vsock-echo and the /init script.
root="$work/root"
mkdir -p "$root"/{bin,dev,proc,sys,tmp,mnt}
cp "$busybox" "$root/bin/busybox"
for applet in $("$busybox" --list); do
    [[ "$applet" == busybox ]] || ln -s busybox "$root/bin/$applet"
done
gcc -O2 -Wall -Wextra -static -o "$work/vsock-echo" "$SCRIPT_DIR/vsock-echo.c" \
    || die "cannot build $SCRIPT_DIR/vsock-echo.c"
cp "$work/vsock-echo" "$root/bin/vsock-echo"
cat > "$root/init" <<EOF
#!/bin/sh
# PID 1 of the smoke-test guest; every line it prints goes to the serial log.
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
echo "SMOKE init-reached uptime=\$(cut -d' ' -f1 /proc/uptime)"
echo "SMOKE kernel \$(uname -r)"
[ -c /dev/null ] && echo "SMOKE devtmpfs ok"
# /dev/random blocks until the kernel's RNG is seeded, as getrandom() does for dockerd.
head -c 1 /dev/random > /dev/null && echo "SMOKE rng-ready uptime=\$(cut -d' ' -f1 /proc/uptime)"
mkdir -p /sys/fs/cgroup
mount -t cgroup2 cgroup2 /sys/fs/cgroup && echo "SMOKE cgroup2 \$(cat /sys/fs/cgroup/cgroup.controllers)"
mount -t tmpfs tmpfs /tmp
mkdir -p /tmp/lower /tmp/upper /tmp/work /tmp/merged
echo lower > /tmp/lower/file
if mount -t overlay overlay -o lowerdir=/tmp/lower,upperdir=/tmp/upper,workdir=/tmp/work /tmp/merged \
    && [ "\$(cat /tmp/merged/file)" = lower ]; then echo "SMOKE overlay ok"; fi
vsock-echo listen $GUEST_PORT 1 &
listener=\$!
if vsock-echo connect 2 $HOST_PORT "hello from guest"; then
    echo "SMOKE guest-to-host ok"
else
    echo "SMOKE guest-to-host failed"
fi
# The host connects in once it sees the listener; give up after 60 s.
(sleep 60; kill \$listener 2>/dev/null) &
wait \$listener && echo "SMOKE host-to-guest served"
echo "SMOKE done uptime=\$(cut -d' ' -f1 /proc/uptime)"
reboot -f
EOF
chmod +x "$root/init"
truncate -s 32M "$work/rootfs.ext4"
mkfs.ext4 -q -F -d "$root" -b 4096 -m 0 "$work/rootfs.ext4" || die "mkfs.ext4 failed for $work/rootfs.ext4"

elapsed_since() { awk -v now="$(date +%s.%N)" -v then="$1" 'BEGIN { printf "%.2f\n", now - then }'; }

# Boots one configuration and checks it. Sets `failed=1` on a failed check.
run_case() {
    local name="$1" machine="$2" kernel="$3" cpus="$4"
    local state="$work/$name" uds="$work/$name.vsock" start serial qemu_pid host_ok=0
    echo "smoke.sh: --- $name: $machine machine, $cpus vCPU, kernel $kernel"

    # Guest -> host connections to port 5000 arrive on <uds>_5000.
    "$work/vsock-echo" unix-listen "${uds}_$HOST_PORT" 1 > "$work/$name-host-listener.log" 2>&1 &
    listener_pids+=($!)
    state_dirs+=("$state")

    start=$(date +%s.%N)
    "$SCRIPT_DIR/boot.sh" --kernel "$kernel" --rootfs "$work/rootfs.ext4" --vsock-uds "$uds" \
        --state-dir "$state" --machine "$machine" --mem 256 --cpus "$cpus" --append init=/init >/dev/null
    serial="$state/serial.log"
    qemu_pid="$(cat "$state/qemu.pid")"

    # Waits for a line matching $1 on the console; prints seconds since start.
    wait_for() {
        local pattern="$1" deadline=$((SECONDS + timeout))
        while ! grep -q -- "$pattern" "$serial" 2>/dev/null; do
            if [[ $SECONDS -ge $deadline ]]; then
                log "console so far:"; tail -n 30 "$serial" >&2
                die "$name: no '$pattern' on the console after $timeout s"
            fi
            if ! kill -0 "$qemu_pid" 2>/dev/null && ! grep -q -- "$pattern" "$serial"; then
                log "console:"; tail -n 30 "$serial" >&2
                die "$name: QEMU exited before '$pattern' appeared"
            fi
            sleep 0.05
        done
        elapsed_since "$start"
    }

    local init_wall total_wall kernel_init guest_uptime
    init_wall="$(wait_for "SMOKE init-reached")"
    wait_for "vsock-echo: listening on vsock" >/dev/null
    for _ in $(seq 20); do
        if "$work/vsock-echo" unix-connect "$uds" "$GUEST_PORT" "hello from host" >&2; then
            host_ok=1
            break
        fi
        sleep 0.2
    done
    wait_for "SMOKE done" >/dev/null
    for _ in $(seq 100); do kill -0 "$qemu_pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$qemu_pid" 2>/dev/null && die "$name: QEMU still runs 10 s after the guest rebooted"
    total_wall="$(elapsed_since "$start")"
    "$SCRIPT_DIR/stop.sh" "$state"

    kernel_init="$(grep -o '\[ *[0-9.]*\] Run /init as init process' "$serial" | grep -o '[0-9][0-9.]*' | head -n 1 || true)"
    guest_uptime="$(grep -o 'SMOKE init-reached uptime=[0-9.]*' "$serial" | cut -d= -f2 || true)"

    local case_failed=0
    check() {
        if grep -q -- "$1" "$serial"; then
            echo "smoke.sh: ok   $2"
        else
            echo "smoke.sh: FAIL $2 (no '$1' on the console)"
            case_failed=1
        fi
    }
    if [[ "$cpus" -gt 1 ]]; then
        check "smp: Brought up 1 node, $cpus CPUs" "all $cpus vCPUs up (MP table, no ACPI)"
    fi
    check "SMOKE devtmpfs ok" "devtmpfs mounted on /dev by the kernel"
    check "SMOKE rng-ready" "/dev/random seeded"
    check "SMOKE cgroup2 .*memory" "cgroup v2 with the memory controller"
    check "SMOKE cgroup2 .*pids" "cgroup v2 with the pids controller"
    check "SMOKE overlay ok" "overlayfs mount"
    check "SMOKE guest-to-host ok" "guest -> host vsock (CID 2 port $HOST_PORT -> ${uds##*/}_$HOST_PORT)"
    check "SMOKE host-to-guest served" "host -> guest vsock (CONNECT $GUEST_PORT)"
    if [[ "$host_ok" -ne 1 ]]; then
        echo "smoke.sh: FAIL host-side CONNECT $GUEST_PORT exchange"
        case_failed=1
    fi
    echo "smoke.sh: $name: kernel clock at 'Run /init' ${kernel_init:-?} s, guest uptime at /init ${guest_uptime:-?} s;" \
        "QEMU start to /init $init_wall s wall, whole run to QEMU exit $total_wall s wall"
    if [[ "$case_failed" -ne 0 ]]; then
        tail -n 40 "$serial" >&2
        log "$name: console log $serial"
        failed=1
    fi
}

failed=0
if [[ -n "$kernel_dir" ]]; then
    # PVH vmlinux on both machines (rollbox-vmm boots vmlinux), and the bzImage on pc.
    # On pc, SeaBIOS's MP table lists only the boot CPU, so only microvm gets 2.
    run_case pc-vmlinux pc "$kernel_dir/vmlinux" 1
    run_case pc-bzimage pc "$kernel_dir/bzImage" 1
    run_case microvm-vmlinux microvm "$kernel_dir/vmlinux" 2
else
    run_case pc pc "$kernel" 1
    run_case microvm microvm "$kernel" 2
fi
if [[ "$failed" -ne 0 ]]; then
    keep=1
    die "smoke test failed"
fi
echo "smoke.sh: PASS"
