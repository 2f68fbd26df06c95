# Sourced by the scripts that build a Debian root filesystem tarball (scripts/tcg/docker-rootfs.sh,
# scripts/code-interpreter-rootfs.sh): debootstrap --variant=minbase with packages, the caller's
# own steps, a trim, and a tar cached by content hash with a build-info file beside it.
#
# The caller sets, then calls debian_rootfs_main "$@":
#   ROOTFS_NAME      log prefix (the script's name)
#   ROOTFS_KEY       cache entry name prefix ("" or "ci-"); the entry is $cache/<key><hash>
#   ROOTFS_SUITE     e.g. bookworm
#   ROOTFS_PACKAGES  comma-separated packages for debootstrap --include
#   ROOTFS_INPUTS    files whose text makes the cache key (with this library and the mirror)
#   ROOTFS_HELP      the script's usage text
#   customize ROOT WORK   run after debootstrap (ROOT is the tree, WORK a scratch directory)
#   describe ROOT         prints extra build-info lines
# Environment: ROLLBOX_DEBIAN_MIRROR (default http://deb.debian.org/debian), ROLLBOX_ROOTFS_CACHE
# (default /var/cache/rollbox/rootfs).

die() { echo "$ROOTFS_NAME: error: $*" >&2; exit 1; }
log() { echo "$ROOTFS_NAME: $*" >&2; }

debian_rootfs_main() {
    local mirror cache hash out_dir tarball started old
    mirror="${ROLLBOX_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
    cache="${ROLLBOX_ROOTFS_CACHE:-/var/cache/rollbox/rootfs}"
    hash="$( { cat "${ROOTFS_INPUTS[@]}" "${BASH_SOURCE[0]}"; echo "$mirror"; } | sha256sum | cut -c1-16)"
    case "${1:-}" in
        --print-hash) echo "$hash"; return 0 ;;
        "") ;;
        -h|--help) echo "$ROOTFS_HELP"; return 0 ;;
        *) die "unknown argument '$1' (try --help)" ;;
    esac
    out_dir="$cache/$ROOTFS_KEY$hash"
    tarball="$out_dir/rootfs.tar"
    if [[ -f "$tarball" ]]; then
        echo "$tarball"
        return 0
    fi
    [[ "$(id -u)" -eq 0 ]] || die "must run as root (debootstrap chroots and sets ownership)"
    mkdir -p "$cache" || die "cannot create cache directory $cache"
    # One builder per entry; a second caller waits, then finds the tarball.
    exec 9>"$cache/$ROOTFS_KEY$hash.lock"
    flock 9
    if [[ -f "$tarball" ]]; then
        echo "$tarball"
        return 0
    fi
    if ! command -v debootstrap >/dev/null; then
        log "installing debootstrap"
        DEBIAN_FRONTEND=noninteractive apt-get install -y debootstrap >/dev/null \
            || die "apt-get install debootstrap failed"
    fi
    # Leftovers of killed builds of this entry.
    for old in "$cache/.partial.$ROOTFS_KEY$hash".*; do
        [[ -e "$old" ]] || continue
        unmount_build_mounts "$old/root"
        rm -rf --one-file-system "$old"
    done
    work="$(mktemp -d "$cache/.partial.$ROOTFS_KEY$hash.XXXXXX")"
    root="$work/root"
    trap 'unmount_build_mounts "$root"; rm -rf --one-file-system "$work"' EXIT

    started=$SECONDS
    log "debootstrap $ROOTFS_SUITE (minbase + $ROOTFS_PACKAGES) from $mirror into $root"
    if ! debootstrap --variant=minbase --include="$ROOTFS_PACKAGES" "$ROOTFS_SUITE" "$root" \
            "$mirror" >"$work/debootstrap.log" 2>&1; then
        tail -n 30 "$work/debootstrap.log" >&2 || true
        [[ -f "$root/debootstrap/debootstrap.log" ]] && tail -n 30 "$root/debootstrap/debootstrap.log" >&2
        die "debootstrap failed (log above)"
    fi
    log "debootstrap done in $((SECONDS - started)) s"
    customize "$root" "$work"

    # Trim: package caches and lists, docs, man pages, locales other than C.
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/*.bin \
        "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* "$root"/usr/share/man/* \
        "$root"/usr/share/info/* "$root"/usr/share/locale/* "$root"/usr/share/lintian \
        "$root"/var/log/*.log "$root"/var/cache/debconf/*-old "$root"/var/lib/dpkg/*-old
    # The guest's PID 1 (rollbox-agent) mounts /dev, /proc, /sys itself; ship them empty.
    find "$root/dev" "$root/proc" "$root/sys" -mindepth 1 -delete 2>/dev/null || true
    # A resolv.conf copied from the build host means nothing in the guest.
    : > "$root/etc/resolv.conf"
    echo rollbox > "$root/etc/hostname"

    tar --numeric-owner --xattrs --xattrs-include='*' -C "$root" -cf "$work/rootfs.tar" . \
        || die "tar of $root failed"
    {
        echo "suite=$ROOTFS_SUITE"
        echo "mirror=$mirror"
        echo "packages=$ROOTFS_PACKAGES"
        describe "$root"
        echo "tar_bytes=$(stat -c %s "$work/rootfs.tar")"
        echo "build_seconds=$((SECONDS - started))"
        echo "built_at=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    } > "$work/build-info"
    mkdir "$work/out"
    mv "$work/rootfs.tar" "$work/build-info" "$work/out/"
    mv "$work/out" "$out_dir" || die "cannot move the result into $out_dir"
    log "built $tarball ($(du -h "$tarball" | cut -f1)) in $((SECONDS - started)) s"
    echo "$tarball"
}

# debootstrap and the caller's steps mount into the tree; a failure can leave them mounted.
unmount_build_mounts() {
    local mnt
    for mnt in proc sys dev/pts dev; do
        mountpoint -q "$1/$mnt" 2>/dev/null && umount -l "$1/$mnt" 2>/dev/null
    done
    return 0
}
