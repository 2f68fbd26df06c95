#!/usr/bin/env bash
# Boots a Linux guest under QEMU's software emulation (TCG): the kernel, a raw
# ext4 root filesystem on virtio-blk (/dev/vda), the serial console into a log
# file, and vsock through vhost-device-vsock, whose host side speaks the same
# "CONNECT <port>\n" Unix-socket protocol as rollbox-vmm:
#   host -> guest: connect to VSOCK_UDS, send "CONNECT <port>\n", read "OK <n>\n"
#   guest -> host: a guest connection to CID 2 port P arrives on VSOCK_UDS_P
#
# Usage:
#   scripts/tcg/boot.sh --kernel K --rootfs R --vsock-uds PATH [options]
#     --kernel K        bzImage, or a vmlinux with the PVH entry point
#     --rootfs R        raw ext4 image for /dev/vda
#     --vsock-uds PATH  host-side vsock Unix socket
#     --mem MIB         guest memory (default 1024)
#     --cpus N          vCPUs (default 2)
#     --cid N           guest CID (default 3)
#     --machine M       microvm (default: virtio-mmio devices named on the kernel
#                       command line, as under rollbox-vmm) or pc (PCI devices,
#                       SeaBIOS; its MP table lists only the boot CPU, so with our
#                       ACPI-less kernel a pc guest runs on 1 vCPU whatever --cpus says)
#     --append ARGS     appended to the kernel command line (repeatable)
#     --state-dir DIR   pid files, logs, QEMU and vhost sockets (default: PATH.d)
#     --serial-log F    guest console log (default: DIR/serial.log)
#     --rw              write to the rootfs image (default: -snapshot, the image is untouched)
#     --net-user        add a virtio-net NIC on QEMU user networking
#     --wait [SECS]     stay in the foreground until the guest exits (or SECS pass,
#                       then stop it and exit 124), then stop vhost-device-vsock
#   scripts/tcg/boot.sh --stop DIR      stop a guest started with --state-dir DIR
#
# Without --wait it returns once both processes run; DIR/qemu.pid and
# DIR/vhost-vsock.pid hold their pids. Stop with scripts/tcg/stop.sh DIR.
# The guest's normal end is a reboot (the kernel has no ACPI; `reboot=k`
# resets through the i8042), which QEMU turns into an exit (-no-reboot).
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly SCRIPT_DIR

die() { echo "boot.sh: error: $*" >&2; exit 1; }
log() { echo "boot.sh: $*" >&2; }

kernel="" rootfs="" vsock_uds="" mem=1024 cpus=2 cid=3 state_dir="" serial_log=""
machine=microvm snapshot=1 net_user=0 wait_mode=0 wait_secs=0
extra_append=()

need_value() { [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value"; }
is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --kernel) need_value "$@"; kernel="$2"; shift 2 ;;
        --rootfs) need_value "$@"; rootfs="$2"; shift 2 ;;
        --vsock-uds) need_value "$@"; vsock_uds="$2"; shift 2 ;;
        --mem) need_value "$@"; mem="$2"; shift 2 ;;
        --cpus) need_value "$@"; cpus="$2"; shift 2 ;;
        --cid) need_value "$@"; cid="$2"; shift 2 ;;
        --machine) need_value "$@"; machine="$2"; shift 2 ;;
        --append) need_value "$@"; extra_append+=("$2"); shift 2 ;;
        --state-dir) need_value "$@"; state_dir="$2"; shift 2 ;;
        --serial-log) need_value "$@"; serial_log="$2"; shift 2 ;;
        --rw) snapshot=0; shift ;;
        --net-user) net_user=1; shift ;;
        --wait)
            wait_mode=1
            if [[ $# -ge 2 ]] && is_uint "$2"; then wait_secs="$2"; shift; fi
            shift ;;
        --stop) need_value "$@"; exec "$SCRIPT_DIR/stop.sh" "$2" ;;
        -h|--help) sed -n '2,33p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument '$1' (try --help)" ;;
    esac
done

[[ -n "$kernel" ]] || die "--kernel is required"
[[ -n "$rootfs" ]] || die "--rootfs is required"
[[ -n "$vsock_uds" ]] || die "--vsock-uds is required"
[[ -f "$kernel" ]] || die "kernel not found: $kernel"
[[ -f "$rootfs" ]] || die "rootfs image not found: $rootfs"
{ is_uint "$mem" && [[ "$mem" -ge 64 ]]; } || die "--mem must be an integer >= 64 (MiB), got '$mem'"
{ is_uint "$cpus" && [[ "$cpus" -ge 1 ]]; } || die "--cpus must be an integer >= 1, got '$cpus'"
{ is_uint "$cid" && [[ "$cid" -ge 3 ]]; } || die "--cid must be an integer >= 3, got '$cid'"
case "$machine" in
    pc) machine_arg=pc; bus_suffix=pci ;;
    # QEMU adds a virtio_mmio.device=... to the command line for each device.
    microvm) machine_arg=microvm,acpi=off; bus_suffix=device ;;
    *) die "--machine must be pc or microvm, got '$machine'" ;;
esac

qemu="$(command -v qemu-system-x86_64 || true)"
[[ -n "$qemu" ]] || die "qemu-system-x86_64 not found; run: apt-get install -y qemu-system-x86"
vhost="$(command -v vhost-device-vsock || true)"
if [[ -z "$vhost" && -x "${CARGO_HOME:-$HOME/.cargo}/bin/vhost-device-vsock" ]]; then
    vhost="${CARGO_HOME:-$HOME/.cargo}/bin/vhost-device-vsock"
fi
[[ -n "$vhost" ]] || die "vhost-device-vsock not found; run: scripts/tcg/install-vhost-device-vsock.sh"

kernel="$(realpath "$kernel")"
rootfs="$(realpath "$rootfs")"
vsock_uds="$(realpath -m "$vsock_uds")"
[[ -d "$(dirname "$vsock_uds")" ]] || die "directory for --vsock-uds does not exist: $(dirname "$vsock_uds")"
state_dir="$(realpath -m "${state_dir:-$vsock_uds.d}")"
mkdir -p "$state_dir" || die "cannot create state directory $state_dir"
serial_log="$(realpath -m "${serial_log:-$state_dir/serial.log}")"
vhost_sock="$state_dir/vhost-vsock.sock"

# Refuse to start over a running guest; clear sockets left by a dead one.
for pidfile in "$state_dir/qemu.pid" "$state_dir/vhost-vsock.pid"; do
    if [[ -f "$pidfile" ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
        die "$state_dir already has a running process ($(basename "$pidfile") = $(cat "$pidfile")); stop it with scripts/tcg/stop.sh $state_dir"
    fi
    rm -f "$pidfile"
done
for sock in "$vsock_uds" "$vhost_sock"; do
    if [[ -e "$sock" && ! -S "$sock" ]]; then
        die "$sock exists and is not a socket; refusing to replace it"
    fi
    rm -f "$sock"
done

# no_timer_check: on a loaded host the guest's IO-APIC timer check can miss its ticks under TCG
# and panic the boot ("IO-APIC + timer doesn't work"), as the lab's L1 once did.
cmdline="console=ttyS0 root=/dev/vda rw reboot=k panic=-1 mitigations=off no_timer_check i8042.noaux i8042.nomux i8042.nopnp"
for arg in "${extra_append[@]}"; do cmdline+=" $arg"; done

echo "$vsock_uds" > "$state_dir/vsock_uds"
log "starting vhost-device-vsock (cid $cid) on $vsock_uds"
"$vhost" --guest-cid "$cid" --socket "$vhost_sock" --uds-path "$vsock_uds" \
    >"$state_dir/vhost-vsock.log" 2>&1 &
vhost_pid=$!
echo "$vhost_pid" > "$state_dir/vhost-vsock.pid"

for _ in $(seq 100); do
    [[ -S "$vhost_sock" ]] && break
    kill -0 "$vhost_pid" 2>/dev/null || break
    sleep 0.05
done
if [[ ! -S "$vhost_sock" ]]; then
    "$SCRIPT_DIR/stop.sh" "$state_dir" >/dev/null 2>&1 || true
    die "vhost-device-vsock did not create $vhost_sock; its log: $(tail -n 5 "$state_dir/vhost-vsock.log")"
fi

# shellcheck disable=SC2054 # the commas are inside QEMU option values
qemu_args=(
    -name rollbox-tcg
    -accel tcg -cpu max -M "$machine_arg" -smp "$cpus" -m "${mem}M"
    -nodefaults -no-user-config -display none -no-reboot
    -serial "file:$serial_log"
    -qmp "unix:$state_dir/qmp.sock,server=on,wait=off"
    -kernel "$kernel" -append "$cmdline"
    -drive "file=$rootfs,format=raw,if=none,id=rootfs"
    -device "virtio-blk-$bus_suffix,drive=rootfs"
    -object "memory-backend-memfd,id=mem,size=${mem}M,share=on" -numa node,memdev=mem
    -chardev "socket,id=vsock0,path=$vhost_sock"
    -device "vhost-user-vsock-$bus_suffix,chardev=vsock0"
)
[[ "$snapshot" -eq 1 ]] && qemu_args+=(-snapshot)
# shellcheck disable=SC2054
[[ "$net_user" -eq 1 ]] && qemu_args+=(-netdev user,id=net0 -device "virtio-net-$bus_suffix,netdev=net0")

log "starting QEMU TCG ($machine): kernel $kernel, rootfs $rootfs, ${mem} MiB, $cpus vCPUs, console $serial_log"
printf '%q ' "$qemu" "${qemu_args[@]}" > "$state_dir/qemu.cmdline"
: > "$serial_log"
"$qemu" "${qemu_args[@]}" >"$state_dir/qemu.log" 2>&1 &
qemu_pid=$!
echo "$qemu_pid" > "$state_dir/qemu.pid"
date +%s.%N > "$state_dir/started_at"

# QEMU fails fast on bad arguments or an unreadable kernel; report that here.
sleep 0.3
if ! kill -0 "$qemu_pid" 2>/dev/null; then
    wait "$qemu_pid" || true
    "$SCRIPT_DIR/stop.sh" "$state_dir" >/dev/null 2>&1 || true
    die "QEMU exited at once; its log: $(tail -n 5 "$state_dir/qemu.log")"
fi

if [[ "$wait_mode" -eq 0 ]]; then
    log "running: qemu pid $qemu_pid, vhost-device-vsock pid $vhost_pid, state $state_dir"
    echo "$state_dir"
    exit 0
fi

rc=0
if [[ "$wait_secs" -gt 0 ]]; then
    deadline=$((SECONDS + wait_secs))
    while kill -0 "$qemu_pid" 2>/dev/null && [[ $SECONDS -lt $deadline ]]; do sleep 0.2; done
    if kill -0 "$qemu_pid" 2>/dev/null; then
        log "guest still running after $wait_secs s; stopping it"
        rc=124
    fi
fi
if [[ "$rc" -eq 0 ]]; then
    wait "$qemu_pid" || rc=$?
fi
"$SCRIPT_DIR/stop.sh" "$state_dir" >&2 || true
log "guest exited (status $rc); console in $serial_log"
echo "$state_dir"
exit "$rc"
