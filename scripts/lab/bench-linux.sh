#!/usr/bin/env bash
# `rollbox-bench linux` inside the nested lab. On the host: release builds of rollbox-vmm, rollbox
# and rollbox-bench, the static agent, and the tier-4 fixtures (scripts/lab/tier4-fixtures.sh,
# skipped while the existing ones still hold the current kernel and agent). Then L1 boots
# (scripts/lab/run.sh --modprobe vhost_vsock, for QEMU's vsock) and runs the benchmark there.
# The tables go to stdout; progress to stderr.
#
# Usage:
#   scripts/lab/bench-linux.sh [options] [-- BENCH-ARGS...]
#     --fixtures DIR        fixtures directory (default /var/tmp/rollbox-lab/fixtures)
#     --rebuild-fixtures    run tier4-fixtures.sh even when the fixtures look current
#     --json FILE           also write the figures as JSON to FILE (on the host)
#     --keep-consoles DIR   copy every boot's console transcript (host ms, line) to DIR
#     --timeout S           stop the lab after S seconds (default 1800)
#     BENCH-ARGS            more `rollbox-bench linux` flags, e.g. --rounds 3 or --parts boot
#
# Needs root (tier4-fixtures.sh builds ext4 images with owners) and what scripts/setup.sh
# installs; dockerd is started when the fixtures are (re)built.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$SCRIPT_DIR/../.." && pwd)"
readonly SCRIPT_DIR ROOT

log() { echo "bench-linux: $*" >&2; }
die() { echo "bench-linux: error: $*" >&2; exit 2; }
need_value() { [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value"; }

fixtures=/var/tmp/rollbox-lab/fixtures rebuild=0 json="" consoles="" timeout_s=1800
while [[ $# -gt 0 ]]; do
    case "$1" in
        --fixtures) need_value "$@"; fixtures="$2"; shift 2 ;;
        --rebuild-fixtures) rebuild=1; shift ;;
        --json) need_value "$@"; json="$2"; shift 2 ;;
        --keep-consoles) need_value "$@"; consoles="$2"; shift 2 ;;
        --timeout) need_value "$@"; timeout_s="$2"; shift 2 ;;
        --) shift; break ;;
        -h|--help) sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument '$1' (try --help)" ;;
    esac
done
[[ "$timeout_s" =~ ^[0-9]+$ ]] || die "--timeout must be a number of seconds, got '$timeout_s'"
[[ "$(id -u)" -eq 0 ]] || die "must run as root (tier4-fixtures.sh and the lab need it)"

cd "$ROOT"
log "building rollbox-vmm, rollbox and rollbox-bench (release) and the static agent"
cargo build --release -p vmm -p rollbox -p rollbox-bench >&2
agent="$(guest-agent/build-static.sh | tail -n 1)"
[[ -x "$agent" ]] || die "guest-agent/build-static.sh gave no agent ($agent)"

# Current when the fixtures name today's kernel and their busybox rootfs holds today's agent.
fixtures_current() {
    local env="$fixtures/fixtures.env" kernel_dir vmlinux rootfs
    [[ -f "$env" ]] || return 1
    kernel_dir="$(kernel-config/build.sh | tail -n 1)" || return 1
    vmlinux="$(sed -n 's/^OUR_VMLINUX=//p' "$env")"
    rootfs="$(sed -n 's/^BUSYBOX_ROOTFS=//p' "$env")"
    [[ "$vmlinux" == "$kernel_dir/vmlinux" && -f "$vmlinux" && -f "$rootfs" ]] || return 1
    command -v debugfs >/dev/null || return 1
    debugfs -R "cat /.rollbox/rollbox-agent" "$rootfs" 2>/dev/null | cmp -s - "$agent"
}
if [[ "$rebuild" -eq 0 ]] && fixtures_current; then
    log "fixtures in $fixtures are current (kernel and agent match)"
else
    log "building the tier-4 fixtures in $fixtures"
    scripts/start-dockerd.sh >&2
    ROLLBOX_BIN="$ROOT/target/release/rollbox" ROLLBOX_AGENT_STATIC="$agent" \
        scripts/lab/tier4-fixtures.sh "$fixtures" >/dev/null
fi

# The lab's run directory is the only place L1 can write that the host sees: keep it (in a
# private runs root) long enough to copy the JSON and transcripts out, then remove it all.
runs_parent="${ROLLBOX_LAB_RUNS:-/var/tmp/rollbox-lab}"
mkdir -p "$runs_parent"
runs="$(mktemp -d "$runs_parent/bench-linux.XXXXXX")"
trap 'rm -rf "$runs"' EXIT
bench=(target/release/rollbox-bench linux --fixtures "$fixtures/fixtures.env" --agent "$agent")
[[ -n "$json" ]] && bench+=(--json-in-run)
[[ -n "$consoles" ]] && bench+=(--consoles-in-run)
status=0
ROLLBOX_LAB_RUNS="$runs" scripts/lab/run.sh --keep --timeout "$timeout_s" --modprobe vhost_vsock -- \
    bash -c '
        args=()
        for a in "$@"; do
            case "$a" in
                --json-in-run) args+=(--json "$ROLLBOX_LAB_RUN/linux.json") ;;
                --consoles-in-run) args+=(--keep-consoles "$ROLLBOX_LAB_RUN/consoles") ;;
                *) args+=("$a") ;;
            esac
        done
        exec "${args[@]}"' bench-linux "${bench[@]}" "$@" || status=$?
run="$(find "$runs" -mindepth 1 -maxdepth 1 -type d -name 'run.*' | head -n 1)"
if [[ -n "$json" && -f "$run/linux.json" ]]; then
    cp "$run/linux.json" "$json"
    log "JSON copied to $json"
fi
if [[ -n "$consoles" && -d "$run/consoles" ]]; then
    mkdir -p "$consoles"
    cp "$run/consoles/"* "$consoles/"
    log "console transcripts copied to $consoles"
fi
exit "$status"
