#!/usr/bin/env bash
# Measures how often the nested lab is lost: starts it again and again (scripts/lab/run.sh, with
# the given options) running COMMAND, until MINUTES have passed, and counts per start whether
# L1 crashed, wedged or timed out, and in COMMAND's output the L2 guests' triple faults
# (KVM_EXIT_SHUTDOWN, or a reset of a QEMU guest) and oopses. The last line sums it up per hour
# of lab time; docs/testing.md keeps the figures.
#
# Usage: scripts/lab/soak.sh --minutes M [--label TEXT] [--log FILE] [run.sh options] -- COMMAND...
#   e.g. scripts/lab/soak.sh --minutes 20 --tcg-thread single -- scripts/lab/l2-stress.sh --rounds 3
# ROLLBOX_LAB_QEMU picks the QEMU (scripts/lab/qemu-7.2.sh prints one for 7.2).
set -uo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
minutes="" label="" log=""
run_args=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --minutes) minutes="${2:-}"; shift 2 ;;
        --label) label="${2:-}"; shift 2 ;;
        --log) log="${2:-}"; shift 2 ;;
        --) shift; break ;;
        *) run_args+=("$1"); shift ;;
    esac
done
[[ "$minutes" =~ ^[1-9][0-9]*$ ]] || { echo "soak: --minutes needs a whole number, got '$minutes'" >&2; exit 2; }
[[ $# -gt 0 ]] || { echo "soak: no COMMAND given" >&2; exit 2; }
log="${log:-$(mktemp /tmp/lab-soak.XXXXXX.log)}"
: > "$log"

deadline=$((SECONDS + minutes * 60))
starts=0 crashes=0 wedges=0 timeouts=0 finished=0 failed=0 lab_seconds=0 faults=0 oopses=0
while [[ "$SECONDS" -lt "$deadline" ]]; do
    starts=$((starts + 1))
    out="$(mktemp)"
    began=$SECONDS
    "$SCRIPT_DIR/run.sh" "${run_args[@]}" --timeout $(( deadline - SECONDS + 60 )) -- "$@" > "$out" 2>&1
    rc=$?
    took=$((SECONDS - began))
    lab_seconds=$((lab_seconds + took))
    f=$(grep -c -e "KVM_EXIT_SHUTDOWN" -e "UNFINISHED (the guest reset)" "$out")
    o=$(sed -n 's/.*, \([1-9][0-9]*\) oops lines$/\1/p' "$out" | wc -l)
    faults=$((faults + f)) oopses=$((oopses + o))
    if grep -q "L1 wedged" "$out"; then
        verdict="L1 wedged"; wedges=$((wedges + 1))
    elif grep -q "L1 crashed" "$out"; then
        console="$(sed -n 's/.*console log kept in \([^)]*\)).*/\1/p' "$out" | head -n 1)"
        signature="$(grep -m 1 -o -E "stack guard page was hit|Kernel panic[^\\r]*|BUG: [^\\r]*" "$console" 2>/dev/null)"
        verdict="L1 crashed (${signature:-no signature on its console})"; crashes=$((crashes + 1))
    elif [[ "$rc" -eq 124 ]]; then
        verdict="timed out"; timeouts=$((timeouts + 1))
    elif [[ "$rc" -eq 125 ]]; then
        verdict="lab failed: $(grep -m 1 '^lab: cannot start' "$out")"; failed=$((failed + 1))
    else
        verdict="finished (status $rc)"; finished=$((finished + 1))
    fi
    line="soak: start $starts: $verdict after $took s; $f L2 triple faults, $o L2 oopses"
    echo "$line"
    { echo "$line"; sed 's/^/    /' "$out"; } >> "$log"
    rm -f "$out"
done
per_hour() { awk -v n="$1" -v s="$lab_seconds" 'BEGIN { if (s > 0) printf "%.1f", n * 3600 / s; else print "-" }'; }
echo "soak: ${label:+$label: }$starts starts in $lab_seconds s of lab time: $finished finished, $crashes L1 crashes ($(per_hour "$crashes")/h), $wedges wedges ($(per_hour "$wedges")/h), $timeouts timeouts, $failed other lab failures; L2: $faults triple faults ($(per_hour "$faults")/h), $oopses oopses; log: $log"
