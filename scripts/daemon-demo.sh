#!/usr/bin/env bash
# A sandbox end to end through `rollbox serve` and the `rollbox` CLI, with a real Linux image
# template: build the template from an image (with a boot snapshot), create a sandbox, exec,
# write and read a file, snapshot, fork into N, share a volume, reset, delete. Every step is
# checked; the script exits non-zero at the first one that goes wrong and leaves no VMM behind.
#
# Needs hardware virtualization (/dev/kvm that runs Linux): run it directly on such a host,
# or inside the nested lab (scripts/demo.sh does that on PVM hosts like the build machines).
#
# Usage: scripts/daemon-demo.sh --kernel VMLINUX (--docker-archive TAR [--reference REF] |
#            --rootfs EXT4) [--name NAME] [--forks N] [--memory-mib N] [--bin-dir DIR]
set -euo pipefail

kernel="" archive="" reference="" rootfs="" name="demo" forks=4 memory=256
bin_dir="$(cd "$(dirname "$0")/.." && pwd)/target/debug"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --kernel) kernel="$2"; shift 2 ;;
        --docker-archive) archive="$2"; shift 2 ;;
        --reference) reference="$2"; shift 2 ;;
        --rootfs) rootfs="$2"; shift 2 ;;
        --name) name="$2"; shift 2 ;;
        --forks) forks="$2"; shift 2 ;;
        --memory-mib) memory="$2"; shift 2 ;;
        --bin-dir) bin_dir="$2"; shift 2 ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "daemon-demo: unknown argument $1" >&2; exit 2 ;;
    esac
done
[[ -n "$kernel" ]] || { echo "daemon-demo: --kernel is required" >&2; exit 2; }
[[ -n "$archive" || -n "$rootfs" ]] || { echo "daemon-demo: give --docker-archive or --rootfs" >&2; exit 2; }

rollbox="$bin_dir/rollbox"
work="$(mktemp -d /tmp/rollbox-demo.XXXXXX)"
export ROLLBOX_SOCKET="$work/rollbox.sock"
export ROLLBOX_API_KEY="demo-$(head -c 8 /dev/urandom | od -An -tx1 | tr -d ' \n')"
daemon_pid=""
cleanup() {
    local status=$?
    # On failure, the logs first: deleting a sandbox deletes its directory.
    if [[ "$status" -ne 0 && -f "$work/serve.log" ]]; then
        echo "--- rollbox serve log (last 40 lines)" >&2
        tail -n 40 "$work/serve.log" >&2
        for log in "$work"/state/sandboxes/*/{console,vmm}.log; do
            [[ -f "$log" ]] || continue
            echo "--- $log (last 20 lines)" >&2
            tail -n 20 "$log" >&2
        done
    fi
    if [[ -n "$daemon_pid" ]]; then
        # Ends every sandbox first, so that no VMM outlives the demo.
        for id in $("$rollbox" sandbox ls --json 2>/dev/null | jq -r '.sandboxes[].id' 2>/dev/null); do
            "$rollbox" sandbox rm "$id" >/dev/null 2>&1 || true
        done
        kill "$daemon_pid" 2>/dev/null || true
        wait "$daemon_pid" 2>/dev/null || true
    fi
    rm -rf "$work"
    exit "$status"
}
trap cleanup EXIT

step() { printf '\n== %s\n' "$*"; }
fail() { echo "daemon-demo: $*" >&2; exit 1; }
# Runs `rollbox ARGS...`, prints it, and prints how long it took. (Its stderr goes through a
# pipe, so progress spinners stay off in logs.)
timed() {
    local start end
    echo "\$ rollbox $*"
    start=$(date +%s.%N)
    "$rollbox" "$@" 2>&1 | cat
    end=$(date +%s.%N)
    printf '   (%.2f s)\n' "$(echo "$end - $start" | bc)"
}

step "rollbox serve (state in $work/state)"
# The template's image file must lie under a --template-dir (symlinks resolved).
source_dir="$(dirname "$(realpath "${archive:-$rootfs}")")"
# Generous VMM start and agent timeouts: under nested emulation four restores at once take
# seconds, and a fork clone's agent has been seen to need more than the default 10 s while
# the other lab's L1 took the cores.
"$rollbox" serve --state-dir "$work/state" --default-ttl 1800 --image-cache "$work/cache" \
    --template-dir "$source_dir" --vmm-start-timeout 60 --agent-timeout 60 > "$work/serve.log" 2>&1 &
daemon_pid=$!
for _ in $(seq 100); do [[ -S "$ROLLBOX_SOCKET" ]] && break; sleep 0.1; done
[[ -S "$ROLLBOX_SOCKET" ]] || fail "rollbox serve did not listen on $ROLLBOX_SOCKET"

step "template $name from an image, booted once and snapshotted"
if [[ -n "$archive" ]]; then
    timed template build ${reference:+"$reference"} --from-docker-archive "$archive" \
        --name "$name" --kernel "$kernel" --memory-mib "$memory" --boot-snapshot
else
    timed template add "$name" --kernel "$kernel" --rootfs "$rootfs" \
        --memory-mib "$memory" --boot-snapshot \
        --cmdline "console=ttyS0 reboot=k panic=1 loglevel=4 init=/.rollbox/rollbox-agent"
fi

step "create a sandbox (a restore of the boot snapshot)"
id="$("$rollbox" sandbox create "$name" --ttl 1800 --label demo=1 --json | jq -r .id)"
[[ "$id" == sb-* ]] || fail "create printed no sandbox id"
echo "sandbox $id"

step "exec"
out="$(timed sandbox exec "$id" -- sh -c 'echo "hello from $(uname -sr)"')"
echo "$out"
grep -q "hello from Linux" <<<"$out" || fail "exec did not print the greeting"
set +e
"$rollbox" sandbox exec "$id" -- sh -c 'exit 3'
code=$?
set -e
[[ "$code" -eq 3 ]] || fail "exec exited $code, not the command's status 3"
echo "exit status passed through: $code"

step "write and read a file"
printf 'episode 1\n' > "$work/in.txt"
timed sandbox cp "$work/in.txt" "$id:/root/in.txt"
"$rollbox" sandbox exec "$id" -- sh -c 'cat /root/in.txt; echo "step 2" >> /root/in.txt'
timed sandbox cp "$id:/root/in.txt" "$work/out.txt"
[[ "$(cat "$work/out.txt")" == $'episode 1\nstep 2' ]] || fail "the file read back is: $(cat "$work/out.txt")"
echo "read back: $(tr '\n' ' ' < "$work/out.txt")"

step "snapshot (the sandbox keeps running)"
snap="$("$rollbox" sandbox snapshot "$id" --json | jq -r .id)"
[[ "$snap" == snap-* ]] || fail "snapshot printed no id"
echo "snapshot $snap"

step "fork into $forks"
"$rollbox" sandbox fork "$id" --count "$forks" --json > "$work/fork.json"
# (No process substitution: the lab's L1 has no /dev/fd.)
mapfile -t clones <<<"$(jq -r '.results[] | .sandbox.id // empty' "$work/fork.json")"
[[ "${#clones[@]}" -eq "$forks" ]] || fail "fork made ${#clones[@]} of $forks: $(cat "$work/fork.json")"
for clone in "${clones[@]}"; do
    got="$("$rollbox" sandbox exec "$clone" -- cat /root/in.txt | tr '\n' ' ')"
    [[ "$got" == "episode 1 step 2 " ]] || fail "fork $clone sees: $got"
    "$rollbox" sandbox exec "$clone" -- sh -c "echo $clone > /root/who"
    echo "$clone: has the parent's file; writes its own"
done
for clone in "${clones[@]}"; do
    who="$("$rollbox" sandbox exec "$clone" -- cat /root/who)" || fail "fork $clone: exec failed"
    [[ "$who" == "$clone" ]] || fail "fork $clone sees another fork's write: $who"
done

step "a shared volume: a sandbox and its fork write to it, each sees the other's file, the host reads both"
timed volume create traj
# A create with a volume boots (a boot snapshot has no volume); the agent mounts it at /data.
vol_id="$("$rollbox" sandbox create "$name" --ttl 1800 --volume traj:/data --json | jq -r .id)"
[[ "$vol_id" == sb-* ]] || fail "create with --volume printed no sandbox id"
"$rollbox" sandbox exec "$vol_id" -- sh -c "echo $vol_id > /data/$vol_id.txt"
vol_fork="$("$rollbox" sandbox fork "$vol_id" --count 1 --json | jq -r '.results[0].sandbox.id // empty')"
[[ "$vol_fork" == sb-* ]] || fail "the fork of $vol_id made no sandbox"
"$rollbox" sandbox exec "$vol_fork" -- sh -c "echo $vol_fork > /data/$vol_fork.txt"
got="$("$rollbox" sandbox exec "$vol_id" -- cat "/data/$vol_fork.txt")" || fail "$vol_id cannot read its fork's file"
[[ "$got" == "$vol_fork" ]] || fail "$vol_id reads $got in its fork's file"
for sandbox in "$vol_id" "$vol_fork"; do
    got="$("$rollbox" volume get traj "$sandbox.txt")" || fail "the host cannot read $sandbox.txt"
    [[ "$got" == "$sandbox" ]] || fail "the host reads $got in $sandbox.txt"
done
if "$rollbox" volume rm traj 2>/dev/null; then
    fail "volume rm traj succeeded while two sandboxes mount it"
fi
"$rollbox" sandbox rm "$vol_id"
"$rollbox" sandbox rm "$vol_fork"
timed volume rm traj
echo "traj: written by $vol_id and its fork $vol_fork, read by each other and by the host"

step "reset (same id, back to the boot snapshot: the file is gone)"
timed sandbox reset "$id"
if "$rollbox" sandbox exec "$id" -- test -e /root/in.txt; then
    fail "after reset /root/in.txt still exists"
fi
echo "$id: /root/in.txt is gone"

step "delete"
for sandbox in "$id" "${clones[@]}"; do
    "$rollbox" sandbox rm "$sandbox"
done
"$rollbox" sandbox rm "$id"   # deleting one that is gone is success
left="$("$rollbox" sandbox ls --json | jq '.sandboxes | length')"
[[ "$left" -eq 0 ]] || fail "$left sandboxes left after delete"
# The warm pool (on by default) keeps VMM shells for a template with a boot snapshot; they
# end with the template.
shells="$("$rollbox" node info --json | jq '[.warm_pool[]? | .ready] | add // 0')"
echo "warm pool: $shells shell(s) ready for the next creates of $name"
timed template rm "$name"
for _ in $(seq 100); do
    pgrep -f "rollbox-vmm .*$work/state" >/dev/null || break
    sleep 0.1
done
if pgrep -f "rollbox-vmm .*$work/state" >/dev/null; then
    fail "a rollbox-vmm of this demo is still running"
fi
echo "no sandbox, no template and no VMM left"
echo
echo "daemon demo: ok ($name)"
