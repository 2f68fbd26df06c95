#!/usr/bin/env bash
# Smoke test of the TCG harness and the guest kernel: builds (or reuses) the
# kernel from kernel-config/build.sh, makes a tiny ext4 rootfs (busybox-static,
# an /init script and vsock-echo), boots it with scripts/tcg/boot.sh, and checks:
#   - the kernel reaches /init (and how long it took);
#   - cgroup v2 controllers, overlayfs and devtmpfs are there;
#   - guest -> host vsock: the guest connects to CID 2 port 5000, which arrives
#     on <uds>_5000, and gets its line echoed;
#   - host -> guest vsock: "CONNECT 1024\n" on <uds>, "OK", then an echo;
#   - the guest ends with `reboot -f` and QEMU exits.
#
# Usage: scripts/tcg/smoke.sh [--kernel K] [--timeout SECS] [--keep]
#   --kernel K   boot this image instead of building kernel-config's bzImage
#                (a vmlinux with the PVH entry point works too)
#   --keep       keep the work directory (rootfs, logs) even on success
# A missing tool is one SKIP line and exit 0, unless ROLLBOX_REQUIRE_ALL=1.
set -euo pipefail

readonly SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly REPO_DIR="$(cd "$SCRIPT_DIR/../.." && pwd)"
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
        -h|--help) sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
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

if [[ -z "$kernel" ]]; then
    if ! dpkg-query -W linux-source-6.1 >/dev/null 2>&1; then
        skip "linux-source-6.1 not installed, so no kernel to boot (see kernel-config/README.md)"
    fi
    log "building or reusing the guest kernel (kernel-config/build.sh)"
    kernel_dir="$("$REPO_DIR/kernel-config/build.sh" | tail -n 1)"
    kernel="$kernel_dir/bzImage"
fi
[[ -f "$kernel" ]] || die "kernel not found: $kernel"

work="$(mktemp -d "${TMPDIR:-/tmp}/rollbox-tcg-smoke.XXXXXX")"
state="$work/vm"
uds="$work/vm.vsock"
host_listener_pid=""
cleanup() {
    local rc=$?
    [[ -d "$state" ]] && "$SCRIPT_DIR/stop.sh" "$state" >/dev/null 2>&1 || true
    [[ -n "$host_listener_pid" ]] && kill "$host_listener_pid" 2>/dev/null || true
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

# Guest -> host connections to port 5000 arrive on <uds>_5000.
"$work/vsock-echo" unix-listen "${uds}_$HOST_PORT" 1 > "$work/host-listener.log" 2>&1 &
host_listener_pid=$!

start=$(date +%s.%N)
"$SCRIPT_DIR/boot.sh" --kernel "$kernel" --rootfs "$work/rootfs.ext4" --vsock-uds "$uds" \
    --state-dir "$state" --mem 256 --cpus 1 >/dev/null
serial="$state/serial.log"

elapsed_since() { awk -v now="$(date +%s.%N)" -v then="$1" 'BEGIN { printf "%.2f\n", now - then }'; }

# Waits for a line matching $1 in the console log; prints seconds since start.
wait_for() {
    local pattern="$1" deadline=$((SECONDS + timeout))
    while ! grep -q -- "$pattern" "$serial" 2>/dev/null; do
        if [[ $SECONDS -ge $deadline ]]; then
            log "console so far:"; tail -n 30 "$serial" >&2
            die "no '$pattern' on the console after $timeout s"
        fi
        if ! kill -0 "$(cat "$state/qemu.pid" 2>/dev/null || echo 0)" 2>/dev/null \
            && ! grep -q -- "$pattern" "$serial"; then
            log "console:"; tail -n 30 "$serial" >&2
            die "QEMU exited before '$pattern' appeared"
        fi
        sleep 0.05
    done
    elapsed_since "$start"
}

init_wall="$(wait_for "SMOKE init-reached")"
log "guest /init reached after $init_wall s (wall clock from QEMU start)"
wait_for "vsock-echo: listening on vsock" >/dev/null

host_ok=0
for _ in $(seq 20); do
    if "$work/vsock-echo" unix-connect "$uds" "$GUEST_PORT" "hello from host" >&2; then
        host_ok=1
        break
    fi
    sleep 0.2
done

wait_for "SMOKE done" >/dev/null
qemu_pid="$(cat "$state/qemu.pid")"
for _ in $(seq 100); do kill -0 "$qemu_pid" 2>/dev/null || break; sleep 0.1; done
kill -0 "$qemu_pid" 2>/dev/null && die "QEMU still runs 10 s after the guest rebooted"
total_wall="$(elapsed_since "$start")"

kernel_init="$(grep -o '\[ *[0-9.]*\] Run /init as init process' "$serial" | grep -o '[0-9][0-9.]*' | head -n 1 || true)"
guest_uptime="$(grep -o 'SMOKE init-reached uptime=[0-9.]*' "$serial" | cut -d= -f2)"

failed=0
check() {
    if grep -q -- "$1" "$serial"; then
        echo "smoke.sh: ok   $2"
    else
        echo "smoke.sh: FAIL $2 (no '$1' on the console)"
        failed=1
    fi
}
check "SMOKE devtmpfs ok" "devtmpfs mounted on /dev by the kernel"
check "SMOKE cgroup2 .*memory" "cgroup v2 with the memory controller"
check "SMOKE cgroup2 .*pids" "cgroup v2 with the pids controller"
check "SMOKE overlay ok" "overlayfs mount"
check "SMOKE guest-to-host ok" "guest -> host vsock (CID 2 port $HOST_PORT -> ${uds##*/}_$HOST_PORT)"
check "SMOKE host-to-guest served" "host -> guest vsock (CONNECT $GUEST_PORT)"
if [[ "$host_ok" -ne 1 ]]; then
    echo "smoke.sh: FAIL host-side CONNECT $GUEST_PORT exchange"
    failed=1
fi
log "console log: $serial"
echo "smoke.sh: kernel $kernel"
echo "smoke.sh: kernel timestamp at 'Run /init': ${kernel_init:-?} s; guest uptime at /init: ${guest_uptime:-?} s"
echo "smoke.sh: QEMU start to /init: $init_wall s wall; whole run to QEMU exit: $total_wall s wall"
if [[ "$failed" -ne 0 ]]; then
    keep=1
    tail -n 40 "$serial" >&2
    die "smoke test failed"
fi
echo "smoke.sh: PASS"
