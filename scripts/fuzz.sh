#!/usr/bin/env bash
# Runs the fuzz targets of fuzz/ (docs/fuzzing.md), one after the other, each for a bounded
# time, niced, and prints per target: execs/s, total execs, crashes. Exits 1 if any crashed.
#
#   scripts/fuzz.sh [--seconds N] [--nightly] [--debug-build] [--jobs N] [TARGET...]
#
# Default 60 s per target; FUZZ_SECONDS sets it too. --nightly: 1800 s per target.
# --jobs N runs N targets at a time (default 1); each still gets its full time.
# --debug-build runs the workspace's debug build (target/debug; slower per input, but no
# optimised build of the whole dependency tree first; it builds the workspace's binaries and
# tests as scripts/test.sh does): what scripts/test.sh does in CI.
# Crashing inputs go to fuzz/artifacts/<target>/; replay one with
#   target/fuzz/rollbox-fuzz replay TARGET FILE
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${FUZZ_SECONDS:-60}"
debug_build=0
jobs=1
targets=()
while [ $# -gt 0 ]; do
    case "$1" in
        --seconds) seconds="$2"; shift 2 ;;
        --nightly) seconds=1800; shift ;;
        --debug-build) debug_build=1; shift ;;
        --jobs) jobs="$2"; shift 2 ;;
        -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
        -*) echo "fuzz.sh: unknown flag $1" >&2; exit 2 ;;
        *) targets+=("$1"); shift ;;
    esac
done

if [ "$debug_build" -eq 1 ]; then
    # The build command of scripts/test.sh, so that after it nothing is built again: cargo
    # unifies features over the packages and targets it is given, and `-p rollbox-fuzz` alone
    # resolved them otherwise and rebuilt much of the dependency tree.
    nice -n 15 cargo build --workspace --bins --tests
    bin=target/debug/rollbox-fuzz
else
    CARGO_INCREMENTAL=0 nice -n 15 cargo build --profile fuzz -p rollbox-fuzz
    bin=target/fuzz/rollbox-fuzz
fi
if [ ${#targets[@]} -eq 0 ]; then
    mapfile -t targets <<<"$("$bin" list | awk '{print $1}')"
fi

case "$jobs" in ''|*[!0-9]*|0) echo "fuzz.sh: --jobs wants a positive count, not '$jobs'" >&2; exit 2 ;; esac
outdir="$(mktemp -d)"
trap 'rm -rf "$outdir"' EXIT
# Each target writes its output and status to its own files; at most $jobs run at once.
for t in "${targets[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
    (
        set +e
        nice -n 15 "$bin" run "$t" --seconds "$seconds" >"$outdir/$t.out" 2>&1
        echo $? >"$outdir/$t.rc"
    ) &
done
wait

failed=0
summary=()
for t in "${targets[@]}"; do
    out=$(cat "$outdir/$t.out" 2>/dev/null || true)
    rc=$(cat "$outdir/$t.rc" 2>/dev/null || echo 99)
    printf '%s\n' "$out" | grep -v '^fuzz .*: [0-9]* s,' || true
    line=$(printf '%s\n' "$out" | grep "^fuzz $t: " | tail -1)
    if [ "$rc" -gt 1 ]; then
        line="fuzz $t: ABORTED (status $rc; input in fuzz/artifacts/$t/crash-abort)"
    fi
    [ "$rc" -ne 0 ] && failed=1
    echo "$line"
    summary+=("$line")
done
echo "--- fuzz summary ($seconds s per target, $jobs at a time)"
printf '%s\n' "${summary[@]}"
exit $failed
