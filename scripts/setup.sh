#!/usr/bin/env bash
# Installs what rollbox needs on a fresh Debian (bookworm) machine, skipping what is there:
# apt packages for the build, the test guest, the QEMU TCG tier, Docker and the local OCI
# registry. Idempotent. Needs root (apt-get).
set -euo pipefail

packages=(
    build-essential gcc binutils pkg-config libclang-dev   # rust-vmm builds, userfaultfd-sys
    e2fsprogs cpio busybox-static file curl jq socat python3 debootstrap  # rootfs images, test initramfs
    qemu-system-x86                                         # the TCG tier
    docker.io docker-registry                               # Docker tests, local OCI registry
    nftables iproute2                                       # rollbox net (taps, NAT, egress rules)
    linux-source-6.1 flex bison bc libelf-dev libssl-dev    # the guest kernel build
)
missing=()
for p in "${packages[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if (( ${#missing[@]} )); then
    echo "setup: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q "${missing[@]}" >/dev/null
fi
if ! command -v cargo >/dev/null; then
    echo "setup: cargo is missing; install the Rust toolchain pinned in rust-toolchain.toml" >&2
    exit 1
fi
echo "setup: system packages ready" >&2
