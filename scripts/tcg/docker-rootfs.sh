#!/usr/bin/env bash
# Builds a Docker-capable base image tarball for the TCG tier: a root filesystem tar
# of a minimal Debian bookworm (debootstrap --variant=minbase) with docker.io
# (dockerd, containerd, runc, the CLI), iptables (nft), iproute2 and
# ca-certificates, with apt caches, docs, man pages and locales dropped.
# The tar imports with `docker import` (or serves as a one-layer image).
#
# Usage:
#   scripts/tcg/docker-rootfs.sh                 # build or reuse; prints the tarball path last
#   scripts/tcg/docker-rootfs.sh --print-hash    # the cache key, nothing built
#
# Cache: $ROLLBOX_ROOTFS_CACHE (default /var/cache/rollbox/rootfs)/<hash>/rootfs.tar, where
# <hash> is taken from this script's text (and the mirror). A build happens in a temporary
# directory beside it and appears by rename, so a killed build leaves no half tarball;
# concurrent runs wait on a lock. Cold: about 1.5-3 minutes; warm: instant.
# Environment: ROLLBOX_DEBIAN_MIRROR (default http://deb.debian.org/debian).
# Needs root, debootstrap (installed with apt-get when missing) and network access to the mirror.
set -euo pipefail

die() { echo "docker-rootfs.sh: error: $*" >&2; exit 1; }
log() { echo "docker-rootfs.sh: $*" >&2; }

readonly SUITE=bookworm
readonly PACKAGES=docker.io,containerd,runc,iptables,iproute2,ca-certificates
mirror="${ROLLBOX_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
cache="${ROLLBOX_ROOTFS_CACHE:-/var/cache/rollbox/rootfs}"

script="$(realpath "${BASH_SOURCE[0]}")"
hash="$( { cat "$script"; echo "$mirror"; } | sha256sum | cut -c1-16)"

case "${1:-}" in
    --print-hash) echo "$hash"; exit 0 ;;
    "") ;;
    -h|--help) sed -n '2,18p' "$script" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (try --help)" ;;
esac

out_dir="$cache/$hash"
tarball="$out_dir/rootfs.tar"
if [[ -f "$tarball" ]]; then
    echo "$tarball"
    exit 0
fi

[[ "$(id -u)" -eq 0 ]] || die "must run as root (debootstrap chroots and sets ownership)"
mkdir -p "$cache" || die "cannot create cache directory $cache"

# One builder per hash; a second caller waits, then finds the tarball.
exec 9>"$cache/$hash.lock"
flock 9
if [[ -f "$tarball" ]]; then
    echo "$tarball"
    exit 0
fi

if ! command -v debootstrap >/dev/null; then
    log "installing debootstrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y debootstrap >/dev/null \
        || die "apt-get install debootstrap failed"
fi

# Leftovers of killed builds.
for old in "$cache"/.partial.*; do
    [[ -e "$old" ]] || continue
    umount -R "$old/root/proc" "$old/root/sys" "$old/root/dev" 2>/dev/null || true
    rm -rf --one-file-system "$old"
done

work="$(mktemp -d "$cache/.partial.$hash.XXXXXX")"
root="$work/root"
cleanup() {
    # debootstrap mounts proc and sys into the target; a failure can leave them mounted.
    for mnt in proc sys dev/pts dev; do
        mountpoint -q "$root/$mnt" 2>/dev/null && umount -l "$root/$mnt" 2>/dev/null
    done
    rm -rf --one-file-system "$work"
}
trap cleanup EXIT

started=$SECONDS
log "debootstrap $SUITE (minbase + $PACKAGES) from $mirror into $root"
if ! debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$root" "$mirror" \
        >"$work/debootstrap.log" 2>&1; then
    tail -n 30 "$work/debootstrap.log" >&2 || true
    [[ -f "$root/debootstrap/debootstrap.log" ]] && tail -n 30 "$root/debootstrap/debootstrap.log" >&2
    die "debootstrap failed (log above)"
fi
log "debootstrap done in $((SECONDS - started)) s"

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

# Sanity: what the TCG tier needs is there.
for tool in usr/sbin/dockerd usr/bin/docker usr/bin/containerd usr/sbin/runc \
        usr/sbin/iptables sbin/ip bin/sh; do
    [[ -e "$root/$tool" ]] || die "the rootfs lacks /$tool after debootstrap"
done
iptables_mode="$(chroot "$root" iptables --version 2>&1 || true)"
log "iptables in the rootfs: $iptables_mode"

tar --numeric-owner --xattrs --xattrs-include='*' -C "$root" -cf "$work/rootfs.tar" . \
    || die "tar of $root failed"
{
    echo "suite=$SUITE"
    echo "mirror=$mirror"
    echo "packages=$PACKAGES"
    echo "dockerd=$(chroot "$root" dockerd --version 2>&1 || echo unknown)"
    echo "iptables=$iptables_mode"
    echo "tar_bytes=$(stat -c %s "$work/rootfs.tar")"
    echo "build_seconds=$((SECONDS - started))"
    echo "built_at=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
} > "$work/build-info"

mkdir "$work/out"
mv "$work/rootfs.tar" "$work/build-info" "$work/out/"
mv "$work/out" "$out_dir" || die "cannot move the result into $out_dir"
log "built $tarball ($(du -h "$tarball" | cut -f1)) in $((SECONDS - started)) s"
echo "$tarball"
