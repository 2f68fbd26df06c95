#!/usr/bin/env bash
# Runs tier-4 test binaries one test per process, each under a time limit, so that one
# stuck Linux guest is named instead of eating the whole run.
#
# Usage: scripts/tier4-tests.sh [--limit S] [--done NAME]... BINARY...
#   --limit S    seconds one test may run (default 900)
#   --done NAME  a test that already has a result (an earlier lab run); not run again
#
# Every test prints libtest's own lines ("test NAME ... ok", "test result: ..."), what it printed
# itself (figures; --show-output), plus
# "tier 4: NAME took N s". A failing test does not stop the others; the status is the
# first failure's. A test that runs past its limit stops the run at once with status 124
# and the line "tier 4: NAME ran past S s": the caller decides whether to try again.
#
# In the nested lab (ROLLBOX_IN_LAB=1, which scripts/lab/run.sh sets), a test that failed
# because a Linux guest triple-faulted (rollbox-vmm's "KVM_EXIT_SHUTDOWN (triple fault" line in
# its output) runs once more: guests under QEMU itself die the same way there
# (docs/testing.md). The first run's output stays, with its result lines marked "lab triple
# fault, retried:" so that they count for nothing, and the line "tier 4: NAME retried after a
# lab triple fault" names it. The second run's result is the test's result.
set -uo pipefail

limit=900
declare -A done_tests=()
binaries=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --limit)
            [[ "${2:-}" =~ ^[1-9][0-9]*$ ]] || { echo "tier4-tests.sh: --limit needs a whole number of seconds, got '${2:-}'" >&2; exit 2; }
            limit="$2"; shift 2 ;;
        --done)
            [[ -n "${2:-}" ]] || { echo "tier4-tests.sh: --done needs a test name" >&2; exit 2; }
            done_tests["$2"]=1; shift 2 ;;
        -*) echo "tier4-tests.sh: unknown option '$1'" >&2; exit 2 ;;
        *) binaries+=("$1"); shift ;;
    esac
done
[[ ${#binaries[@]} -gt 0 ]] || { echo "tier4-tests.sh: no test binary given" >&2; exit 2; }

status=0
output="$(mktemp)"
trap 'rm -f "$output"' EXIT
for binary in "${binaries[@]}"; do
    [[ -x "$binary" ]] || { echo "tier4-tests.sh: '$binary' is not an executable test binary" >&2; exit 2; }
    # Listing never runs a test; a binary that cannot list is broken, which is a failure.
    if ! names="$("$binary" --list --format terse 2>&1)"; then
        echo "tier4-tests.sh: '$binary --list' failed: $names" >&2
        [[ "$status" -ne 0 ]] || status=1
        continue
    fi
    listed="$(sed -n 's/: test$//p' <<<"$names")"
    if [[ -z "$listed" ]]; then
        echo "tier4-tests.sh: '$binary --list' names no test" >&2
        [[ "$status" -ne 0 ]] || status=1
        continue
    fi
    # A here-string, not process substitution: L1 in the lab has no /dev/fd.
    while IFS= read -r name; do
        [[ -z "${done_tests[$name]:-}" ]] || continue
        # Named before it runs, so a lab lost meanwhile knows which test it took with it.
        echo "tier 4: starting $name"
        started=$SECONDS
        rc=0
        timeout -k 10 "$limit" "$binary" --exact "$name" --test-threads=1 --show-output --color never > "$output" 2>&1 || rc=$?
        if [[ "$rc" -ne 0 && "$rc" -ne 124 && "$rc" -ne 137 && "${ROLLBOX_IN_LAB:-}" == 1 ]] &&
            grep -q -F "KVM_EXIT_SHUTDOWN (triple fault" "$output"; then
            sed -e 's/^test /lab triple fault, retried: test /' \
                -e 's/^\(failures:\|successes:\)/lab triple fault, retried: \1/' "$output"
            echo "tier 4: $name retried after a lab triple fault"
            started=$SECONDS
            rc=0
            timeout -k 10 "$limit" "$binary" --exact "$name" --test-threads=1 --show-output --color never > "$output" 2>&1 || rc=$?
        fi
        cat "$output"
        if [[ "$rc" -eq 124 || "$rc" -eq 137 ]]; then
            echo "tier 4: $name ran past $limit s"
            exit 124
        fi
        echo "tier 4: $name took $((SECONDS - started)) s"
        # A test that ran prints its result line; without one it did not run.
        # (An ignored test may give its reason: `test NAME ... ignored, benchmark: ...`.)
        if ! awk -v want="test $name ... " 'index($0, want) == 1 {
                 rest = substr($0, length(want) + 1)
                 if (rest == "ok" || rest == "FAILED" || rest == "ignored" || index(rest, "ignored, ") == 1) found = 1
             } END { exit !found }' "$output"; then
            echo "tier4-tests.sh: $name printed no result (status $rc)" >&2
            [[ "$rc" -ne 0 ]] || rc=1
        fi
        [[ "$rc" -eq 0 || "$status" -ne 0 ]] || status="$rc"
    done <<<"$listed"
done
exit "$status"
