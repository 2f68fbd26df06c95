#!/usr/bin/env bash
# Installs virtiofsd (the vhost-user virtio-fs backend rollbox-vmm starts for `--fs` volumes)
# into a cache outside the repository, keyed by version, and prints its path on the last line:
#   /var/cache/rollbox/virtiofsd/<version>/bin/virtiofsd
# Installs the apt packages its build needs (libseccomp-dev, libcap-ng-dev) when missing.
# A cached binary is reused. Takes about 3 minutes on 2 cores the first time. 1.14.0 is the
# newest on crates.io that builds with Rust 1.95; it has --readonly and --migration-* options.
#
#   scripts/virtiofsd.sh
#   VIRTIOFSD_VERSION=1.14.0 ROLLBOX_VIRTIOFSD_CACHE=/tmp/vfs scripts/virtiofsd.sh
set -euo pipefail

version="${VIRTIOFSD_VERSION:-1.14.0}"
cache="${ROLLBOX_VIRTIOFSD_CACHE:-/var/cache/rollbox/virtiofsd}/$version"
bin="$cache/bin/virtiofsd"

if [[ -x "$bin" ]]; then
    echo "virtiofsd $version cached at $bin" >&2
    echo "$bin"
    exit 0
fi

missing=()
for p in libseccomp-dev libcap-ng-dev pkg-config; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if (( ${#missing[@]} )); then
    echo "virtiofsd: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q "${missing[@]}" >/dev/null
fi
if ! command -v cargo >/dev/null; then
    echo "error: cargo not found on PATH; install Rust first" >&2
    exit 1
fi

# Build into a temporary root and move it into place whole, so an interrupted build never
# leaves a half-written cache entry. Run outside the repository so its rust-toolchain.toml
# does not apply.
mkdir -p "${cache%/*}"
tmp="$(mktemp -d "${cache%/*}/.tmp.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
(cd / && cargo install virtiofsd --locked --version "$version" --root "$tmp") >&2
rm -rf "$cache"
mv "$tmp" "$cache"
trap - EXIT
echo "virtiofsd $version installed at $bin" >&2
echo "$bin"
