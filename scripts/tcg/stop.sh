#!/usr/bin/env bash
# Stops a guest started by scripts/tcg/boot.sh: QEMU first (SIGTERM, then
# SIGKILL after 5 s), then vhost-device-vsock, and removes the sockets they
# made. Safe to run twice, and on a guest that already exited.
#
#   scripts/tcg/stop.sh STATE_DIR
set -euo pipefail

die() { echo "stop.sh: error: $*" >&2; exit 1; }
log() { echo "stop.sh: $*" >&2; }

[[ $# -eq 1 ]] || die "usage: $0 STATE_DIR"
state_dir="$1"
[[ -d "$state_dir" ]] || die "no such state directory: $state_dir"

# True while PID exists and is not a zombie (a zombie child of the caller
# still answers kill -0).
alive() {
    local state
    state="$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null || true)"
    [[ -n "$state" && "$state" != Z ]]
}

# Signals PID only if it still runs the program we started (pids get reused).
stop_pid() {
    local pidfile="$1" expected="$2" pid
    [[ -f "$pidfile" ]] || return 0
    pid="$(cat "$pidfile")"
    [[ "$pid" =~ ^[0-9]+$ ]] || die "$pidfile does not hold a pid: '$pid'"
    if [[ -r "/proc/$pid/cmdline" ]] && tr '\0' ' ' < "/proc/$pid/cmdline" | grep -q -- "$expected"; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 50); do
            alive "$pid" || break
            sleep 0.1
        done
        if alive "$pid"; then
            log "$expected (pid $pid) ignored SIGTERM for 5 s; sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
        log "stopped $expected (pid $pid)"
    fi
    rm -f "$pidfile"
}

stop_pid "$state_dir/qemu.pid" qemu-system-x86_64
stop_pid "$state_dir/vhost-vsock.pid" vhost-device-vsock

for sock in "$state_dir/vhost-vsock.sock" "$state_dir/qmp.sock"; do
    [[ -S "$sock" ]] && rm -f "$sock"
done
if [[ -f "$state_dir/vsock_uds" ]]; then
    uds="$(cat "$state_dir/vsock_uds")"
    [[ -S "$uds" ]] && rm -f "$uds"
fi
exit 0
