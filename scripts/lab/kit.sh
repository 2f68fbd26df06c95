#!/usr/bin/env bash
# Builds (or reuses) the nested lab's L1 kit: Debian's stock kernel, its modules (with a
# modules.dep), and a small initramfs that mounts the host's root over 9p and runs a
# command there (scripts/lab/l1-init.sh). The kit is cached by content hash in
#   ${ROLLBOX_LAB_CACHE:-/var/cache/rollbox/lab}/<key>/
# where <key> covers the kernel package and version, this script and l1-init.sh.
# The last line on stdout is the kit directory; everything else goes to stderr.
#
# Usage:
#   scripts/lab/kit.sh                build (or reuse) and print the directory
#   scripts/lab/kit.sh --print-key    print the cache key and exit
#
# The kernel package is Debian's linux-image-<abi>-amd64-unsigned that the
# linux-image-amd64 metapackage depends on; ROLLBOX_LAB_KERNEL_PACKAGE overrides it.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly SCRIPT_DIR
readonly CACHE_ROOT="${ROLLBOX_LAB_CACHE:-/var/cache/rollbox/lab}"
# Loaded by L1's init, in this order, before the host's root can be mounted.
readonly INITRAMFS_MODULES=(
    drivers/virtio/virtio_ring.ko drivers/virtio/virtio.ko
    drivers/virtio/virtio_pci_modern_dev.ko drivers/virtio/virtio_pci_legacy_dev.ko
    drivers/virtio/virtio_pci.ko
    net/9p/9pnet.ko net/9p/9pnet_virtio.ko fs/netfs/netfs.ko fs/fscache/fscache.ko fs/9p/9p.ko
)

log() { echo "kit.sh: $*" >&2; }
die() { echo "kit.sh: error: $*" >&2; exit 1; }

kernel_package() {
    if [[ -n "${ROLLBOX_LAB_KERNEL_PACKAGE:-}" ]]; then
        echo "$ROLLBOX_LAB_KERNEL_PACKAGE"
        return
    fi
    local signed
    signed="$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ { print $2; exit }')"
    [[ -n "$signed" ]] || die "apt-cache knows no linux-image-amd64 dependency; run apt-get update"
    echo "${signed}-unsigned"
}

package_version() {
    local v
    v="$(apt-cache show "$1" 2>/dev/null | awk '/^Version:/ { print $2; exit }')"
    [[ -n "$v" ]] || die "apt-cache does not know $1; run apt-get update"
    echo "$v"
}

cache_key() {
    {
        echo "package $1 $2"
        cat "$SCRIPT_DIR/kit.sh" "$SCRIPT_DIR/l1-init.sh"
    } | sha256sum | cut -c1-16
}

build() {
    local package version key out
    package="$(kernel_package)"
    version="$(package_version "$package")"
    key="$(cache_key "$package" "$version")"
    out="$CACHE_ROOT/$key"
    if [[ -f "$out/kit-info" ]]; then
        log "cached: $out"
        echo "$out"
        return 0
    fi
    for tool in apt-get dpkg-deb depmod cpio gzip; do
        command -v "$tool" >/dev/null || die "$tool not found (scripts/setup.sh installs what the lab needs)"
    done
    [[ -x /bin/busybox ]] && /bin/busybox --list | grep -qx modprobe ||
        die "/bin/busybox (busybox-static) is missing; run scripts/setup.sh"
    mkdir -p "$CACHE_ROOT" || die "cannot create $CACHE_ROOT (set ROLLBOX_LAB_CACHE)"
    exec 9>"$CACHE_ROOT/$key.lock"
    if ! flock -n 9; then
        log "another build of $key is running; waiting for it"
        flock 9
    fi
    if [[ -f "$out/kit-info" ]]; then
        echo "$out"
        return 0
    fi
    local start=$SECONDS staging
    staging="$(mktemp -d "$CACHE_ROOT/.$key.partial.XXXXXX")"
    # shellcheck disable=SC2064 # expand now: the path is fixed
    trap "rm -rf '$staging'" EXIT
    log "fetching $package $version"
    (cd "$staging" && apt-get download -q "$package=$version" >/dev/null 2>&1) ||
        die "apt-get download $package=$version failed (is the Debian mirror reachable?)"
    dpkg-deb -x "$staging"/*.deb "$staging/root" || die "cannot unpack the $package package"
    rm -f "$staging"/*.deb
    local release
    release="$(ls "$staging/root/lib/modules")"
    [[ -n "$release" && -f "$staging/root/boot/vmlinuz-$release" ]] || die "$package holds no kernel"
    depmod -b "$staging/root" "$release" || die "depmod failed for $release"

    local initramfs="$staging/initramfs" m
    mkdir -p "$initramfs"/{bin,dev,proc,sys,host,modules}
    cp /bin/busybox "$initramfs/bin/busybox"
    cp "$SCRIPT_DIR/l1-init.sh" "$initramfs/init"
    chmod 0755 "$initramfs/init"
    : > "$initramfs/modules/order"
    for m in "${INITRAMFS_MODULES[@]}"; do
        [[ -f "$staging/root/lib/modules/$release/kernel/$m" ]] || die "$package lacks $m"
        cp "$staging/root/lib/modules/$release/kernel/$m" "$initramfs/modules/"
        basename "$m" >> "$initramfs/modules/order"
    done
    (cd "$initramfs" && find . | cpio -o -H newc --quiet | gzip -1) > "$staging/initrd.gz" ||
        die "cannot pack the L1 initramfs"
    rm -rf "$initramfs"
    ln -s "root/boot/vmlinuz-$release" "$staging/vmlinuz"
    {
        echo "key=$key"
        echo "package=$package $version"
        echo "release=$release"
        echo "built_seconds=$((SECONDS - start))"
    } > "$staging/kit-info"
    chmod 0755 "$staging"
    rm -rf "$out"
    mv -T "$staging" "$out" || die "cannot move $staging to $out"
    trap - EXIT
    log "built in $((SECONDS - start)) s: $out"
    echo "$out"
}

case "${1:-}" in
    "") build ;;
    --print-key)
        package="$(kernel_package)"
        cache_key "$package" "$(package_version "$package")"
        ;;
    -h|--help) sed -n '2,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' ;;
    *) die "unknown argument '$1' (try --help)" ;;
esac
