#!/usr/bin/env bash
# The nested-KVM lab in one command: boots L1 (QEMU TCG, -cpu max with emulated SVM
# and nested paging, Debian's stock kernel with kvm_amd), runs COMMAND inside it with
# the host's root filesystem as its root (read-only over 9p, so the binaries the
# workspace built run unchanged), streams COMMAND's output and exits with its status.
#
# Usage:
#   scripts/lab/run.sh [options] -- COMMAND [ARGS...]
#     --memory-mib N   L1 memory (default 8192; L2 guests live in it)
#     --cpus N         L1 vCPUs (default 1; ROLLBOX_LAB_CPUS): with two, L1 can take an IPI
#                      between #VMEXIT and VMLOAD and crash (docs/testing.md)
#     --tcg-thread T   QEMU's TCG threading: multi (one host thread per L1 vCPU) or single
#                      (one host thread for all of them); default multi (ROLLBOX_LAB_TCG_THREAD)
#     --timeout S      stop L1 after S seconds and exit 124 (default 3600)
#     --cwd DIR        working directory of COMMAND (default: the current one)
#     --env K=V        set K in COMMAND's environment (repeatable); ROLLBOX_*, RUST_*
#                      and PATH are passed through
#     --modprobe M     load kernel module M in L1 before COMMAND (repeatable), e.g.
#                      tun, vhost_net, vfio-pci
#     --qemu-arg ARG   one more QEMU argument (repeatable; one word each), e.g. an emulated
#                      PCI device: --qemu-arg -device --qemu-arg edu
#     --keep           keep the run directory (console log, status) and print its path
#
# ROLLBOX_LAB_QEMU: the qemu-system-x86_64 to run (default: the one on PATH, which
# scripts/setup.sh installs from bookworm-backports; scripts/lab/qemu-7.2.sh prints one for
# bookworm's 7.2, for comparison). The first line printed names its version and the settings.
#
# ROLLBOX_SKIP_LOG (see tests/src/lib.rs): skips that COMMAND records inside L1 are appended
# to this file on the host.
#
# Inside L1: / is the host's root (read-only) with fresh tmpfs on /tmp, /run and
# /dev/shm (a working directory below /tmp or /run stays visible); /dev/kvm is real KVM (AMD SVM, nested paging); the run directory is
# writable at the same path as on the host ($ROLLBOX_LAB_RUN). QEMU is a q35 with an
# emulated Intel IOMMU (interrupt remapping, caching mode), so emulated PCI devices
# can be bound to vfio-pci in L1.
#
# Exit status: COMMAND's, or 124 on timeout, or 125 when the lab itself cannot start,
# with one line saying why (QEMU without svm/npt, a module that won't load, no space).
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly SCRIPT_DIR

cannot_start() { echo "lab: cannot start: $*" >&2; exit 125; }
die() { echo "lab: error: $*" >&2; exit 2; }
need_value() { [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value"; }
is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }

memory=8192 cpus="${ROLLBOX_LAB_CPUS:-1}" tcg_thread="${ROLLBOX_LAB_TCG_THREAD:-multi}"
timeout_s=3600 cwd="$PWD" keep=0
envs=() modules=() qemu_extra=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --memory-mib) need_value "$@"; memory="$2"; shift 2 ;;
        --cpus) need_value "$@"; cpus="$2"; shift 2 ;;
        --tcg-thread) need_value "$@"; tcg_thread="$2"; shift 2 ;;
        --timeout) need_value "$@"; timeout_s="$2"; shift 2 ;;
        --cwd) need_value "$@"; cwd="$2"; shift 2 ;;
        --env) need_value "$@"; [[ "$2" == *=* ]] || die "--env wants K=V, got '$2'"; envs+=("$2"); shift 2 ;;
        --modprobe) need_value "$@"; modules+=("$2"); shift 2 ;;
        --qemu-arg) need_value "$@"; qemu_extra+=("$2"); shift 2 ;;
        --keep) keep=1; shift ;;
        --) shift; break ;;
        -h|--help) sed -n '2,37p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument '$1' (try --help)" ;;
    esac
done
[[ $# -gt 0 ]] || die "no COMMAND given (usage: scripts/lab/run.sh [options] -- COMMAND [ARGS...])"
{ is_uint "$memory" && [[ "$memory" -ge 1024 ]]; } || die "--memory-mib must be an integer >= 1024, got '$memory'"
{ is_uint "$cpus" && [[ "$cpus" -ge 1 ]]; } || die "--cpus must be an integer >= 1, got '$cpus'"
[[ "$tcg_thread" == multi || "$tcg_thread" == single ]] || die "--tcg-thread must be multi or single, got '$tcg_thread'"
{ is_uint "$timeout_s" && [[ "$timeout_s" -ge 1 ]]; } || die "--timeout must be a positive integer, got '$timeout_s'"
[[ -d "$cwd" ]] || die "--cwd $cwd is not a directory"

qemu="${ROLLBOX_LAB_QEMU:-qemu-system-x86_64}"
command -v "$qemu" >/dev/null || cannot_start "$qemu is not installed (scripts/setup.sh installs qemu-system-x86)"
qemu_version="$("$qemu" --version 2>/dev/null | sed -n '1s/^QEMU emulator version //p')"
[[ -n "$qemu_version" ]] || cannot_start "$qemu --version printed no QEMU version"
echo "lab: QEMU $qemu_version ($qemu), TCG thread=$tcg_thread, L1 with $cpus vCPUs and $memory MiB" >&2
cpu_flags="$("$qemu" -accel tcg -cpu help 2>/dev/null | tr ' ' '\n')"
for flag in svm npt; do
    grep -qx "$flag" <<<"$cpu_flags" || cannot_start "$qemu's TCG does not emulate the '$flag' CPU flag, so L1 gets no kvm_amd"
done

silent_s="${ROLLBOX_LAB_SILENT_S:-100}" kick_s="${ROLLBOX_LAB_KICK_S:-40}"
[[ "$silent_s" =~ ^[1-9][0-9]*$ ]] ||
    { echo "lab: ROLLBOX_LAB_SILENT_S must be a whole number of seconds, not '$silent_s'" >&2; exit 2; }
[[ "$kick_s" =~ ^[1-9][0-9]*$ ]] ||
    { echo "lab: ROLLBOX_LAB_KICK_S must be a whole number of seconds, not '$kick_s'" >&2; exit 2; }
kit="$("$SCRIPT_DIR/kit.sh" | tail -n 1)" || cannot_start "the L1 kit could not be built (see above)"
[[ -f "$kit/kit-info" ]] || cannot_start "the L1 kit in $kit is incomplete"

runs_root="${ROLLBOX_LAB_RUNS:-/var/tmp/rollbox-lab}"
mkdir -p "$runs_root" || cannot_start "cannot create $runs_root"
free_kib="$(df -Pk "$runs_root" | awk 'NR == 2 { print $4 }')"
[[ "$free_kib" -ge 1048576 ]] || cannot_start "only $((free_kib / 1024)) MiB free in $runs_root; the lab needs 1 GiB"
run="$(mktemp -d "$runs_root/run.XXXXXX")"
chmod 0755 "$run"
cleanup() { [[ "$keep" -eq 1 ]] || rm -rf "$run"; }
trap cleanup EXIT

# COMMAND as a script for the host's bash inside L1.
{
    echo "# written by scripts/lab/run.sh"
    while IFS='=' read -r name _; do
        case "$name" in
            ROLLBOX_*|RUST_*|PATH) printf 'export %s=%q\n' "$name" "${!name}" ;;
        esac
    done < <(env)
    for kv in "${envs[@]}"; do printf 'export %q\n' "$kv"; done
    printf 'export HOME=/tmp ROLLBOX_LAB_RUN=%q ROLLBOX_LAB_KIT=%q ROLLBOX_IN_LAB=1\n' "$run" "$kit"
    # Skips recorded inside L1 land in the run directory; they are appended to the host's log.
    [[ -z "${ROLLBOX_SKIP_LOG:-}" ]] || printf 'export ROLLBOX_SKIP_LOG=%q\n' "$run/skips"
    printf 'cd %q || exit 126\n' "$cwd"
    printf 'exec'
    printf ' %q' "$@"
    printf '\n'
} > "$run/cmd"
printf '%s\n' "${modules[@]}" > "$run/modules"
# L1 covers /tmp and /run with fresh tmpfs; a working directory below them stays visible.
case "$cwd" in
    *' '*) ;;
    /tmp/*|/run/*) realpath "$cwd" > "$run/keep" ;;
esac

# no_timer_check: on a loaded host L1's kernel once panicked at boot with "timer doesn't work
# through Interrupt-remapped IO-APIC" (TCG too slow for its check), not a real fault.
args=(
    -accel "tcg,thread=$tcg_thread" -cpu max -smp "$cpus" -m "$memory"
    -M q35,kernel-irqchip=split -device intel-iommu,intremap=on,caching-mode=on
    -nodefaults -display none -no-reboot
    -kernel "$kit/vmlinuz" -initrd "$kit/initrd.gz"
    -append "console=ttyS0 loglevel=4 intel_iommu=on tsc=reliable no_timer_check panic=-1 rollbox.run=$run rollbox.kit=$kit"
    -serial "file:$run/console.log"
    -chardev stdio,id=out,signal=off -serial chardev:out
    -monitor "unix:$run/monitor.sock,server=on,wait=off"
    -virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap"
    -virtfs "local,path=$run,mount_tag=labrun,security_model=none,multidevs=remap"
    "${qemu_extra[@]}"
)
# A stuck L1: its one CPU sometimes stops for good inside KVM_RUN while an L2 guest runs (seen
# within seconds to minutes of a Linux L2 booting, L1 printing nothing more; under QEMU 7.2 with
# two L1 CPUs the other CPU's soft-lockup watchdog reported it, 425 s and never back). Once L1's
# heartbeat (l1-init.sh, every 10 s) has not moved for ROLLBOX_LAB_KICK_S (40 s), the watch saves
# QEMU's view of L1's CPU to the run directory's `stuck.txt` and sends L1 an NMI (should that
# free it, the lab goes on and says so). None of the five stuck L1s caught so far (one in an L2
# spinning on a spinlock, four halted in L1's own idle loop) took the NMI (docs/testing.md).
# After a soft lockup of 60 s or more, or a heartbeat silent for ROLLBOX_LAB_SILENT_S (100 s),
# the lab stops.
monitor() {
    { printf '%s\n' "$1"; sleep 2; } |
        socat -t 5 - "UNIX-CONNECT:$run/monitor.sock" 2>/dev/null |
        sed -e 's/\x1b\[[0-9;]*[A-Za-z]//g' -e 's/\r//g' | grep -v -e '^QEMU .* monitor' -e '^(qemu)' || true
}
watch_for_wedged_l1() {
    local qemu_parent="$1" beat="" last_beat="" last_change kicked_beat="" silent
    last_change=$(date +%s)
    while sleep 5; do
        if grep -q -E 'soft lockup - CPU#[0-9]+ stuck for ([6-9][0-9]|[0-9]{3,})s' "$run/console.log" 2>/dev/null; then
            echo "a CPU stuck for 60 s or more" > "$run/wedged"
        fi
        beat="$(cat "$run/heartbeat" 2>/dev/null || true)"
        silent=$(( $(date +%s) - last_change ))
        if [[ "$beat" != "$last_beat" ]]; then
            if [[ -n "$kicked_beat" && "$last_beat" == "$kicked_beat" ]]; then
                echo "lab: L1 went on after the NMI (heartbeat $beat, silent $silent s in all)" >&2
                echo "went on after the NMI at heartbeat $kicked_beat" >> "$run/stuck.txt"
            fi
            last_beat="$beat"
            last_change=$(date +%s)
        elif [[ -n "$beat" ]] && (( silent > silent_s )); then
            echo "its heartbeat stopped $silent s ago" > "$run/wedged"
        elif [[ -n "$beat" && "$kicked_beat" != "$beat" ]] && (( silent > kick_s )); then
            kicked_beat="$beat"
            {
                echo "== heartbeat $beat silent for $silent s; QEMU's view of L1, twice 3 s apart, then an NMI"
                monitor "info cpus"; monitor "info registers"; sleep 1; monitor "info registers"
            } >> "$run/stuck.txt"
            monitor nmi > /dev/null
            echo "lab: L1's heartbeat stopped $silent s ago; its CPU state is saved in $run/stuck.txt; sent L1 an NMI" >&2
        fi
        if [[ -f "$run/wedged" ]]; then
            pkill -TERM -P "$qemu_parent" 2>/dev/null || true
            return
        fi
    done
}
status=0
timeout -k 10 "$timeout_s" "$qemu" "${args[@]}" < /dev/null &
qemu_parent=$!
watch_for_wedged_l1 "$qemu_parent" &
watcher=$!
wait "$qemu_parent" || status=$?
kill "$watcher" 2>/dev/null || true
wait "$watcher" 2>/dev/null || true
if [[ -f "$run/wedged" ]]; then
    echo "lab: L1 wedged ($(cat "$run/wedged")); last L1 console lines:" >&2
    tail -n 20 "$run/console.log" >&2 || true
    keep=1
    cannot_start "L1 wedged under TCG, stopped early (console log kept in $run/console.log)"
fi
if [[ "$status" -eq 124 || "$status" -eq 137 ]]; then
    echo "lab: timed out after $timeout_s s; last L1 console lines:" >&2
    tail -n 20 "$run/console.log" >&2 || true
    exit 124
fi
[[ "$status" -eq 0 ]] || cannot_start "QEMU exited with status $status; last L1 console lines: $(tail -n 5 "$run/console.log" 2>/dev/null)"
if [[ -f "$run/lab-error" ]]; then
    cannot_start "$(cat "$run/lab-error")"
fi
early_error="$(sed -n 's/^rollbox-lab: error: //p' "$run/console.log" 2>/dev/null | head -n 1)"
[[ -z "$early_error" ]] || cannot_start "$early_error"
if [[ ! -f "$run/status" ]]; then
    echo "lab: L1 ended without the command's status; last L1 console lines:" >&2
    tail -n 30 "$run/console.log" >&2 || true
    keep=1
    cannot_start "L1 crashed or powered off early (console log kept in $run/console.log)"
fi
if [[ -n "${ROLLBOX_SKIP_LOG:-}" && -s "$run/skips" ]]; then
    cat "$run/skips" >> "$ROLLBOX_SKIP_LOG"
fi
# A run whose L1 was caught silent keeps its directory, for the CPU state in stuck.txt.
[[ -f "$run/stuck.txt" ]] && keep=1
[[ "$keep" -eq 1 ]] && echo "lab: run directory kept: $run" >&2
exit "$(cat "$run/status")"
