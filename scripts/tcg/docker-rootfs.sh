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
# <hash> is taken from this script's text, scripts/lib/debian-rootfs.sh and the mirror. A
# build happens in a temporary directory beside it and appears by rename, so a killed build
# leaves no half tarball; concurrent runs wait on a lock. Cold: about 1.5-3 minutes; warm:
# instant.
# Environment: ROLLBOX_DEBIAN_MIRROR (default http://deb.debian.org/debian).
# Needs root, debootstrap (installed with apt-get when missing) and network access to the mirror.
set -euo pipefail

script="$(realpath "${BASH_SOURCE[0]}")"
# shellcheck source=../lib/debian-rootfs.sh
source "$(dirname "$script")/../lib/debian-rootfs.sh"
ROOTFS_NAME=docker-rootfs.sh
ROOTFS_KEY=""
ROOTFS_SUITE=bookworm
ROOTFS_PACKAGES=docker.io,containerd,runc,iptables,iproute2,ca-certificates
ROOTFS_INPUTS=("$script")
ROOTFS_HELP="$(sed -n '2,18p' "$script" | sed 's/^# \{0,1\}//')"

# Sanity: what the TCG tier needs is there.
customize() {
    local root="$1" tool
    for tool in usr/sbin/dockerd usr/bin/docker usr/bin/containerd usr/sbin/runc \
            usr/sbin/iptables sbin/ip bin/sh; do
        [[ -e "$root/$tool" ]] || die "the rootfs lacks /$tool after debootstrap"
    done
    log "iptables in the rootfs: $(chroot "$root" iptables --version 2>&1 || true)"
}

describe() {
    echo "dockerd=$(chroot "$1" dockerd --version 2>&1 || echo unknown)"
    echo "iptables=$(chroot "$1" iptables --version 2>&1 || echo unknown)"
}

debian_rootfs_main "$@"
