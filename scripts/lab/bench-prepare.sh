# Sourced by scripts/lab/bench-linux.sh and bench-net-fs.sh (from the repository root, with
# `log`, `die`, `fixtures` and `rebuild` set): release builds of rollbox-vmm, rollbox and
# rollbox-bench, the static agent (its path in $agent), the tier-4 fixtures when they are not
# current, and a private runs root for the lab ($runs, removed on exit).
#
#   bench_prepare NAME CHECK
#     NAME   the runs root's prefix (bench-linux, bench-net-fs)
#     CHECK  kernel: the fixtures must name today's kernel;
#            kernel+agent: and their busybox rootfs must hold today's agent

# Current when the fixtures name today's kernel (and, for kernel+agent, their busybox rootfs
# holds today's agent).
fixtures_current() {
    local check="$1" env="$fixtures/fixtures.env" kernel_dir vmlinux rootfs
    [[ -f "$env" ]] || return 1
    kernel_dir="$(kernel-config/build.sh | tail -n 1)" || return 1
    vmlinux="$(sed -n 's/^OUR_VMLINUX=//p' "$env")"
    [[ "$vmlinux" == "$kernel_dir/vmlinux" && -f "$vmlinux" ]] || return 1
    [[ "$check" == kernel ]] && return 0
    rootfs="$(sed -n 's/^BUSYBOX_ROOTFS=//p' "$env")"
    [[ -f "$rootfs" ]] || return 1
    command -v debugfs >/dev/null || return 1
    debugfs -R "cat /.rollbox/rollbox-agent" "$rootfs" 2>/dev/null | cmp -s - "$agent"
}

bench_prepare() {
    local name="$1" check="$2" runs_parent
    log "building rollbox-vmm, rollbox and rollbox-bench (release) and the static agent"
    cargo build --release -p vmm -p rollbox -p rollbox-bench >&2
    agent="$(guest-agent/build-static.sh | tail -n 1)"
    [[ -x "$agent" ]] || die "guest-agent/build-static.sh gave no agent ($agent)"
    if [[ "$rebuild" -eq 0 ]] && fixtures_current "$check"; then
        log "fixtures in $fixtures are current ($check)"
    else
        log "building the tier-4 fixtures in $fixtures"
        scripts/start-dockerd.sh >&2
        ROLLBOX_BIN="$ROOT/target/release/rollbox" ROLLBOX_AGENT_STATIC="$agent" \
            scripts/lab/tier4-fixtures.sh "$fixtures" >/dev/null
    fi
    # The lab's run directory is the only place L1 can write that the host sees: keep it (in a
    # private runs root) long enough to copy files out, then remove it all.
    runs_parent="${ROLLBOX_LAB_RUNS:-/var/tmp/rollbox-lab}"
    mkdir -p "$runs_parent"
    runs="$(mktemp -d "$runs_parent/$name.XXXXXX")"
    trap 'rm -rf "$runs"' EXIT
}
