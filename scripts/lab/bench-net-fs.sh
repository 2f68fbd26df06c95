#!/usr/bin/env bash
# `rollbox-bench linux-net` and `rollbox-bench linux-fs` inside the nested lab. On the host:
# release builds of rollbox-vmm, rollbox and rollbox-bench, the static agent, virtiofsd
# (scripts/virtiofsd.sh) and the tier-4 fixtures (scripts/lab/tier4-fixtures.sh, skipped while
# the existing ones still hold the current kernel and agent). Then L1 boots
# (scripts/lab/run.sh --memory-mib 4096 --modprobe tun --modprobe vhost_vsock) and runs the
# benchmarks there, one after the other. The tables go to stdout; progress to stderr.
# `linux-net` runs its default parts (throughput, daemon-net: the same on the network
# `rollbox::net` leases, and setup); --net-arg --parts --net-arg daemon-net runs one.
#
# Usage:
#   scripts/lab/bench-net-fs.sh [options]
#     --only net|fs         run only one of the two
#     --fixtures DIR        fixtures directory (default /var/tmp/rollbox-lab/fixtures)
#     --rebuild-fixtures    run tier4-fixtures.sh even when the fixtures look current
#     --json-dir DIR        also write net.json and fs.json to DIR (on the host)
#     --memory-mib N        L1 memory (default 4096)
#     --timeout S           stop the lab after S seconds (default 2400)
#     --net-arg ARG         one more `rollbox-bench linux-net` flag (repeatable), e.g.
#                           --net-arg --rounds --net-arg 2
#     --fs-arg ARG          one more `rollbox-bench linux-fs` flag (repeatable)
#
# Needs root (tier4-fixtures.sh builds ext4 images with owners; the lab makes taps) and what
# scripts/setup.sh installs; dockerd is started when the fixtures are (re)built.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$SCRIPT_DIR/../.." && pwd)"
readonly SCRIPT_DIR ROOT

log() { echo "bench-net-fs: $*" >&2; }
die() { echo "bench-net-fs: error: $*" >&2; exit 2; }
need_value() { [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value"; }

fixtures=/var/tmp/rollbox-lab/fixtures rebuild=0 json_dir="" timeout_s=2400 memory=4096 only=""
net_args=() fs_args=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --only) need_value "$@"; only="$2"; shift 2 ;;
        --fixtures) need_value "$@"; fixtures="$2"; shift 2 ;;
        --rebuild-fixtures) rebuild=1; shift ;;
        --json-dir) need_value "$@"; json_dir="$2"; shift 2 ;;
        --memory-mib) need_value "$@"; memory="$2"; shift 2 ;;
        --timeout) need_value "$@"; timeout_s="$2"; shift 2 ;;
        --net-arg) need_value "$@"; net_args+=("$2"); shift 2 ;;
        --fs-arg) need_value "$@"; fs_args+=("$2"); shift 2 ;;
        -h|--help) sed -n '2,24p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument '$1' (try --help)" ;;
    esac
done
[[ -z "$only" || "$only" == net || "$only" == fs ]] || die "--only takes net or fs, got '$only'"
[[ "$timeout_s" =~ ^[0-9]+$ ]] || die "--timeout must be a number of seconds, got '$timeout_s'"
[[ "$(id -u)" -eq 0 ]] || die "must run as root (tier4-fixtures.sh and the lab need it)"

cd "$ROOT"
# shellcheck source=scripts/lab/bench-prepare.sh
source "$SCRIPT_DIR/bench-prepare.sh"
bench_prepare bench-net-fs kernel
virtiofsd="$(scripts/virtiofsd.sh | tail -n 1)"
[[ -x "$virtiofsd" ]] || die "scripts/virtiofsd.sh gave no virtiofsd ($virtiofsd)"
common=(--fixtures "$fixtures/fixtures.env" --agent "$agent")
script='
    set -u
    status=0
    bench=target/release/rollbox-bench
    json() { [[ "$JSON" == 1 ]] && echo --json "$ROLLBOX_LAB_RUN/$1.json"; }
    if [[ "$ONLY" != fs ]]; then
        $bench linux-net "${COMMON[@]}" $(json net) "${NET[@]}" || status=$?
    fi
    if [[ "$ONLY" != net ]]; then
        $bench linux-fs "${COMMON[@]}" --virtiofsd "$VIRTIOFSD" $(json fs) "${FS[@]}" || status=$?
    fi
    exit $status'
# Arrays cross into L1 as words of one variable each, split back there.
wrap="$(declare -p common net_args fs_args | sed 's/declare -a common=/COMMON=/; s/declare -a net_args=/NET=/; s/declare -a fs_args=/FS=/')"
status=0
ROLLBOX_LAB_RUNS="$runs" scripts/lab/run.sh --keep --memory-mib "$memory" --timeout "$timeout_s" \
    --modprobe tun --modprobe vhost_vsock \
    --env "ONLY=$only" --env "JSON=$([[ -n "$json_dir" ]] && echo 1 || echo 0)" \
    --env "VIRTIOFSD=$virtiofsd" -- \
    bash -c "$wrap; $script" || status=$?
run="$(find "$runs" -mindepth 1 -maxdepth 1 -type d -name 'run.*' | head -n 1)"
if [[ -n "$json_dir" ]]; then
    mkdir -p "$json_dir"
    for f in net fs; do
        if [[ -n "$run" && -f "$run/$f.json" ]]; then
            cp "$run/$f.json" "$json_dir/$f.json"
            log "JSON copied to $json_dir/$f.json"
        fi
    done
fi
exit "$status"
