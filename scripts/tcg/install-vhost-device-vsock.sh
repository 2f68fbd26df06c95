#!/usr/bin/env bash
# Installs vhost-device-vsock (the vhost-user vsock backend QEMU talks to in the
# TCG tier) with `cargo install`, only when the wanted version is not already
# on PATH or in $CARGO_HOME/bin. Takes about 2 minutes on 2 cores, no -dev packages.
#
#   scripts/tcg/install-vhost-device-vsock.sh
#   VHOST_DEVICE_VSOCK_VERSION=0.3.0 scripts/tcg/install-vhost-device-vsock.sh
set -euo pipefail

version="${VHOST_DEVICE_VSOCK_VERSION:-0.3.0}"
cargo_bin="${CARGO_HOME:-$HOME/.cargo}/bin"

installed_version() {
    local bin="$1"
    "$bin" --version 2>/dev/null | awk '{print $NF}'
}

for candidate in "$(command -v vhost-device-vsock || true)" "$cargo_bin/vhost-device-vsock"; do
    if [[ -n "$candidate" && -x "$candidate" ]]; then
        have="$(installed_version "$candidate")"
        if [[ "$have" == "$version" ]]; then
            echo "vhost-device-vsock $version already installed at $candidate" >&2
            echo "$candidate"
            exit 0
        fi
        echo "found vhost-device-vsock '$have' at $candidate, want $version; installing" >&2
    fi
done

if ! command -v cargo >/dev/null; then
    echo "error: cargo not found on PATH; install Rust first" >&2
    exit 1
fi

# Run outside the repository so its rust-toolchain.toml does not apply.
(cd / && cargo install vhost-device-vsock --locked --version "$version") >&2
echo "$cargo_bin/vhost-device-vsock"
