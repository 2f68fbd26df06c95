#!/usr/bin/env bash
# Fetches Debian bookworm's own QEMU 7.2 beside the QEMU 10 that scripts/setup.sh installs,
# for comparison runs of the lab, and prints (last line on stdout) a qemu-system-x86_64
# wrapper that runs it:
#
#   ROLLBOX_LAB_QEMU="$(scripts/lab/qemu-7.2.sh | tail -n 1)" scripts/lab/run.sh -- ...
#
# The packages are unpacked (not installed) into ${ROLLBOX_LAB_CACHE:-/var/cache/rollbox/lab}/
# qemu-<version>/, cached by version. The wrapper points QEMU at that tree's modules
# (QEMU_MODULE_DIR, searched before the system's QEMU 10 modules) and firmware data (-L).
set -euo pipefail

log() { echo "qemu-7.2.sh: $*" >&2; }
die() { echo "qemu-7.2.sh: error: $*" >&2; exit 1; }

cache_root="${ROLLBOX_LAB_CACHE:-/var/cache/rollbox/lab}"
# bookworm's candidate of the 7.2 series (not the backports pin's 10).
seven_two() { apt-cache madison "$1" 2>/dev/null | awk '$3 ~ /^1:7\.2/ { print $3; exit }'; }
version="$(seven_two qemu-system-x86)"
[[ -n "$version" ]] || die "apt-cache knows no qemu-system-x86 7.2 (bookworm); run apt-get update"
out="$cache_root/qemu-${version//[:~+]/_}"
wrapper="$out/qemu-system-x86_64"
if [[ ! -x "$wrapper" ]]; then
    command -v dpkg-deb >/dev/null || die "dpkg-deb not found"
    mkdir -p "$cache_root" || die "cannot create $cache_root"
    staging="$(mktemp -d "$cache_root/.qemu-7.2.partial.XXXXXX")"
    trap 'rm -rf "$staging"' EXIT
    log "fetching qemu-system-x86, qemu-system-common and qemu-system-data $version"
    for package in qemu-system-x86 qemu-system-common qemu-system-data; do
        # An arch-all package may lack the binary rebuild's suffix (+bN): each takes its own.
        package_version="$(seven_two "$package")"
        [[ -n "$package_version" ]] || die "apt-cache knows no $package 7.2"
        (cd "$staging" && apt-get download -q "$package=$package_version" >/dev/null 2>&1) ||
            die "apt-get download $package=$package_version failed (is the Debian mirror reachable?)"
    done
    for deb in "$staging"/*.deb; do
        dpkg-deb -x "$deb" "$staging/root" || die "cannot unpack $deb"
    done
    rm -f "$staging"/*.deb
    [[ -x "$staging/root/usr/bin/qemu-system-x86_64" ]] || die "the packages hold no qemu-system-x86_64"
    cat > "$staging/qemu-system-x86_64" <<EOF
#!/bin/sh
# QEMU $version from bookworm, unpacked by scripts/lab/qemu-7.2.sh.
export QEMU_MODULE_DIR="$out/root/usr/lib/x86_64-linux-gnu/qemu"
exec "$out/root/usr/bin/qemu-system-x86_64" -L "$out/root/usr/share/qemu" -L /usr/share/seabios "\$@"
EOF
    chmod 0755 "$staging/qemu-system-x86_64"
    rm -rf "$out"
    mv -T "$staging" "$out" || die "cannot move $staging to $out"
    trap - EXIT
fi
"$wrapper" --version | head -n 1 >&2
echo "$wrapper"
