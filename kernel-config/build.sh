#!/usr/bin/env bash
# Builds the rollbox guest kernel (vmlinux and bzImage) from Debian's
# linux-source-6.1 package: `make tinyconfig`, then the fragments in
# fragments/*.config merged on top, then `make olddefconfig`.
#
# Results are cached outside the repository, in
#   ${ROLLBOX_KERNEL_CACHE:-/var/cache/rollbox/kernel}/<hash>/
# where <hash> covers the fragments, the source package version and this
# script. A second run with the same inputs is instant. The last line on
# stdout is always the output directory; everything else goes to stderr.
#
# Usage:
#   kernel-config/build.sh                 build (or reuse) and print the directory
#   kernel-config/build.sh --print-hash    print the cache key and exit
#   kernel-config/build.sh --check CONFIG  run the option checker on a .config
#
# Needs: apt-get install -y linux-source-6.1=<pinned version below> flex bison bc libelf-dev libssl-dev
set -euo pipefail

# The pinned kernel source. Debian replaces it on security updates; when apt
# no longer offers this version, bump it here (the cache key changes with it).
readonly SOURCE_PACKAGE="linux-source-6.1"
readonly SOURCE_VERSION="6.1.192-3"
readonly SOURCE_TARBALL="/usr/src/linux-source-6.1.tar.xz"

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly SCRIPT_DIR
SCRIPT_PATH="$SCRIPT_DIR/$(basename "${BASH_SOURCE[0]}")"
readonly SCRIPT_PATH
readonly FRAGMENT_DIR="$SCRIPT_DIR/fragments"
# Applied in this order; later fragments win on conflicts.
readonly FRAGMENTS=(base console virtio fs docker platform)
readonly CACHE_ROOT="${ROLLBOX_KERNEL_CACHE:-/var/cache/rollbox/kernel}"

# Options that must be built in, whatever the fragments say. The first group
# is what Docker's contrib/check-config.sh calls "generally necessary" (plus
# the cgroup v2 device controller); the rest is what rollbox itself relies on.
readonly REQUIRED_BUILTIN=(
    NAMESPACES NET_NS PID_NS IPC_NS UTS_NS USER_NS
    CGROUPS CGROUP_CPUACCT CGROUP_DEVICE CGROUP_FREEZER CGROUP_SCHED CPUSETS MEMCG
    CGROUP_PIDS BLK_CGROUP CGROUP_BPF BPF_SYSCALL FAIR_GROUP_SCHED CFS_BANDWIDTH
    KEYS SECCOMP SECCOMP_FILTER POSIX_MQUEUE
    VETH BRIDGE BRIDGE_NETFILTER
    IP_NF_FILTER IP_NF_MANGLE IP_NF_TARGET_MASQUERADE IP_NF_NAT NF_NAT
    NETFILTER_XT_MATCH_ADDRTYPE NETFILTER_XT_MATCH_CONNTRACK NETFILTER_XT_MATCH_IPVS
    NETFILTER_XT_MARK NETFILTER_XT_TARGET_MASQUERADE NETFILTER_XT_NAT
    NF_TABLES NFT_COMPAT NFT_NAT NFT_MASQ NFT_CT
    OVERLAY_FS EXT4_FS EXT4_FS_POSIX_ACL EXT4_FS_SECURITY
    VIRTIO_MMIO VIRTIO_MMIO_CMDLINE_DEVICES VIRTIO_PCI
    VIRTIO_BLK VIRTIO_NET VSOCKETS VIRTIO_VSOCKETS FUSE_FS VIRTIO_FS
    DEVTMPFS DEVTMPFS_MOUNT TMPFS PROC_FS SYSFS UNIX98_PTYS
    SERIAL_8250 SERIAL_8250_CONSOLE SERIO_I8042 KEYBOARD_ATKBD
    KVM_GUEST PVH 64BIT SMP PRINTK
)
readonly REQUIRED_UNSET=(MODULES)

log() { echo "build.sh: $*" >&2; }
die() { echo "build.sh: error: $*" >&2; exit 1; }

# Checks a final .config: every line of every fragment survived olddefconfig
# (a dropped option means an unmet dependency), and the required lists hold.
check_config() {
    local config="$1" failed=0 name line frag
    [[ -f "$config" ]] || die "no such config file: $config"
    for frag in "${FRAGMENTS[@]}"; do
        while IFS= read -r line; do
            if [[ "$line" =~ ^CONFIG_[A-Za-z0-9_]+= ]]; then
                if ! grep -qxF -- "$line" "$config"; then
                    name="${line%%=*}"
                    log "check: $frag.config wants '$line', final config has '$(grep -E "^(# )?${name}[= ]" "$config" || echo "nothing")'"
                    failed=1
                fi
            elif [[ "$line" =~ ^#\ (CONFIG_[A-Za-z0-9_]+)\ is\ not\ set$ ]]; then
                name="${BASH_REMATCH[1]}"
                if grep -qE "^$name=" "$config"; then
                    log "check: $frag.config wants $name unset, final config has '$(grep -E "^$name=" "$config")'"
                    failed=1
                fi
            fi
        done < "$FRAGMENT_DIR/$frag.config"
    done
    for name in "${REQUIRED_BUILTIN[@]}"; do
        if ! grep -qx "CONFIG_$name=y" "$config"; then
            log "check: required option CONFIG_$name=y is missing from $config"
            failed=1
        fi
    done
    for name in "${REQUIRED_UNSET[@]}"; do
        if grep -qE "^CONFIG_$name=" "$config"; then
            log "check: CONFIG_$name must be unset in $config"
            failed=1
        fi
    done
    if [[ "$failed" -ne 0 ]]; then
        log "check: FAILED for $config"
        return 1
    fi
    log "check: all required options present in $config"
}

verify_source() {
    local have
    have="$(dpkg-query -W -f='${Version}' "$SOURCE_PACKAGE" 2>/dev/null || true)"
    if [[ -z "$have" ]]; then
        die "$SOURCE_PACKAGE is not installed; run: apt-get install -y $SOURCE_PACKAGE=$SOURCE_VERSION flex bison bc libelf-dev libssl-dev"
    fi
    if [[ "$have" != "$SOURCE_VERSION" ]]; then
        die "$SOURCE_PACKAGE $have is installed but this script is pinned to $SOURCE_VERSION; install that version or bump SOURCE_VERSION in $SCRIPT_PATH"
    fi
    [[ -f "$SOURCE_TARBALL" ]] || die "$SOURCE_PACKAGE $have is installed but $SOURCE_TARBALL is missing"
    # Checks the installed files against the package's md5sums.
    if ! dpkg --verify "$SOURCE_PACKAGE" >&2; then
        die "$SOURCE_PACKAGE files differ from the package (dpkg --verify); reinstall it"
    fi
    local tool
    for tool in make gcc flex bison bc; do
        command -v "$tool" >/dev/null || die "$tool not found; run: apt-get install -y build-essential flex bison bc libelf-dev libssl-dev"
    done
    [[ -f /usr/include/libelf.h ]] || die "libelf.h not found; run: apt-get install -y libelf-dev"
    [[ -f /usr/include/openssl/ssl.h ]] || die "openssl/ssl.h not found; run: apt-get install -y libssl-dev"
}

cache_key() {
    {
        echo "source $SOURCE_PACKAGE $SOURCE_VERSION"
        echo "script"
        cat "$SCRIPT_PATH"
        local frag
        for frag in "${FRAGMENTS[@]}"; do
            [[ -f "$FRAGMENT_DIR/$frag.config" ]] || die "missing fragment $FRAGMENT_DIR/$frag.config"
            echo "fragment $frag"
            cat "$FRAGMENT_DIR/$frag.config"
        done
    } | sha256sum | cut -c1-16
}

build() {
    local key out
    key="$(cache_key)"
    out="$CACHE_ROOT/$key"
    if [[ -f "$out/vmlinux" && -f "$out/bzImage" && -f "$out/config" ]]; then
        log "cached: $out"
        echo "$out"
        return 0
    fi

    verify_source
    mkdir -p "$CACHE_ROOT" || die "cannot create cache directory $CACHE_ROOT (set ROLLBOX_KERNEL_CACHE)"

    # One builder per key; a second caller waits, then finds the result.
    exec 9>"$CACHE_ROOT/$key.lock"
    if ! flock -n 9; then
        log "another build of $key is running; waiting for it"
        flock 9
    fi
    if [[ -f "$out/vmlinux" && -f "$out/bzImage" && -f "$out/config" ]]; then
        log "cached (built by another process): $out"
        echo "$out"
        return 0
    fi

    # The source tree lives in a temp dir; the results are staged next to the
    # final directory and renamed into place only once complete.
    local work staging
    work="$(mktemp -d "${TMPDIR:-/tmp}/rollbox-kernel-$key.XXXXXX")"
    staging="$(mktemp -d "$CACHE_ROOT/.$key.partial.XXXXXX")"
    # shellcheck disable=SC2064 # expand now: the paths are fixed
    trap "rm -rf '$work' '$staging'" EXIT

    local start=$SECONDS
    log "building kernel $key from $SOURCE_PACKAGE $SOURCE_VERSION in $work"
    tar -xf "$SOURCE_TARBALL" -C "$work" || die "cannot extract $SOURCE_TARBALL into $work"
    local src="$work/linux-source-6.1"
    [[ -f "$src/Makefile" ]] || die "$SOURCE_TARBALL did not contain linux-source-6.1/Makefile"
    log "extracted source in $((SECONDS - start)) s"

    local -a make_args=(
        -C "$src" ARCH=x86_64
        KBUILD_BUILD_USER=rollbox KBUILD_BUILD_HOST=rollbox
        "KBUILD_BUILD_TIMESTAMP=$SOURCE_PACKAGE $SOURCE_VERSION"
    )
    local -a fragment_paths=()
    local frag
    for frag in "${FRAGMENTS[@]}"; do
        fragment_paths+=("$FRAGMENT_DIR/$frag.config")
    done
    make "${make_args[@]}" tinyconfig >&2
    (cd "$src" && ./scripts/kconfig/merge_config.sh -m .config "${fragment_paths[@]}") >&2
    make "${make_args[@]}" olddefconfig >&2
    check_config "$src/.config" || die "the final .config lacks required options (see above); fix the fragments"

    local jobs
    jobs="$(nproc)"
    log "make -j$jobs vmlinux bzImage (log: $staging/build.log)"
    if ! make "${make_args[@]}" -j"$jobs" vmlinux bzImage >"$staging/build.log" 2>&1; then
        tail -n 40 "$staging/build.log" >&2
        die "kernel build failed (last lines above)"
    fi

    cp "$src/vmlinux" "$staging/vmlinux"
    cp "$src/arch/x86/boot/bzImage" "$staging/bzImage"
    cp "$src/.config" "$staging/config"
    {
        echo "key=$key"
        echo "source=$SOURCE_PACKAGE $SOURCE_VERSION"
        echo "kernelrelease=$(make -s "${make_args[@]}" kernelrelease)"
        echo "fragments=${FRAGMENTS[*]}"
        echo "builtin_options=$(grep -c '=y$' "$src/.config")"
        echo "build_seconds=$((SECONDS - start))"
        echo "jobs=$jobs"
        echo "built_at=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo "gcc=$(gcc --version | head -n1)"
    } > "$staging/build-info"
    chmod 0755 "$staging"

    # Only a rename ever creates $out, but clear anything odd left there by hand.
    if [[ -e "$out" ]]; then
        rm -rf "$out" || die "cannot remove incomplete $out"
    fi
    mv -T "$staging" "$out" || die "cannot move $staging to $out"
    log "built in $((SECONDS - start)) s: $out"
    echo "$out"
}

case "${1:-}" in
    "") build ;;
    --print-hash) cache_key ;;
    --check)
        [[ $# -eq 2 ]] || die "usage: $0 --check CONFIG"
        check_config "$2"
        ;;
    -h|--help) sed -n '2,17p' "$SCRIPT_PATH" | sed 's/^# \{0,1\}//' ;;
    *) die "unknown argument '$1' (try --help)" ;;
esac
