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
# shellcheck source=scripts/lab/bench-prepare.sh
source "$SCRIPT_DIR/bench-prepare.sh"
bench_prepare bench-linux kernel+agent
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
