#!/usr/bin/env bash
# Installs what rollbox needs on a fresh Debian (bookworm) machine, skipping what is there:
# apt packages for the build, the test guest, the QEMU TCG tier, Docker and the local OCI
# registry. Idempotent. Needs root (apt-get).
#
# QEMU comes from bookworm-backports (10.x): bookworm's own 7.2 corrupts nested (L2) guest
# state under its TCG emulation of SVM (docs/testing.md). The backports suite is added as an
# apt source, and a pin lets only QEMU's system packages (and the firmware they need at a newer
# version) come from it; everything else stays on bookworm. scripts/lab/qemu-7.2.sh fetches
# bookworm's 7.2 aside, for comparison runs of the lab.
set -euo pipefail

readonly BACKPORTS_SOURCE=/etc/apt/sources.list.d/rollbox-bookworm-backports.sources
readonly BACKPORTS_PIN=/etc/apt/preferences.d/rollbox-qemu-backports
# The packages that may come from backports; every other package keeps bookworm's priority 500
# over backports' 100.
readonly BACKPORTS_PACKAGES="qemu-system-x86 qemu-system-common qemu-system-data qemu-system-gui qemu-system-modules-spice qemu-system-modules-opengl qemu-block-extra qemu-utils seabios"
readonly QEMU_MIN_MAJOR=10

packages=(
    build-essential gcc binutils pkg-config libclang-dev   # rust-vmm builds, userfaultfd-sys
    e2fsprogs cpio busybox-static file curl jq socat python3 debootstrap  # rootfs images, test initramfs
    docker.io docker-registry                               # Docker tests, local OCI registry
    apache2-utils                                           # htpasswd: the registry-auth tests' bcrypt users
    nftables iproute2 conntrack                             # rollbox net (taps, NAT, egress rules, forgetting flows)
    pci.ids                                                 # GPU names (rollbox serve, GET /gpus)
    linux-source-6.1 flex bison bc libelf-dev libssl-dev    # the guest kernel build
)

apt_updated=0
apt_update() {
    [[ "$apt_updated" -eq 1 ]] && return 0
    apt-get update -q >/dev/null || { echo "setup: apt-get update failed" >&2; exit 1; }
    apt_updated=1
}

# The backports source and its pin, written only when they differ (so a second run does not
# force an apt-get update).
write_if_changed() {
    local path="$1" text="$2"
    if [[ ! -f "$path" ]] || [[ "$(cat "$path")" != "$text" ]]; then
        printf '%s\n' "$text" > "$path"
        apt_updated=0
        return 0
    fi
    return 1
}
codename="$(. /etc/os-release && echo "${VERSION_CODENAME:-}")"
if [[ "$codename" == bookworm ]]; then
    mirror="$(sed -n 's/^URIs: *\(http[^ ]*debian\)$/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n 1)"
    mirror="${mirror:-http://deb.debian.org/debian}"
    changed=0
    write_if_changed "$BACKPORTS_SOURCE" "Types: deb
URIs: $mirror
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg" && changed=1
    write_if_changed "$BACKPORTS_PIN" "# Written by rollbox's scripts/setup.sh: QEMU 10 from bookworm-backports, nothing else.
Package: $BACKPORTS_PACKAGES
Pin: release n=bookworm-backports
Pin-Priority: 990" && changed=1
    [[ "$changed" -eq 0 ]] || echo "setup: added bookworm-backports for QEMU ($BACKPORTS_SOURCE, $BACKPORTS_PIN)" >&2
fi

qemu_major() {
    command -v qemu-system-x86_64 >/dev/null || { echo 0; return; }
    qemu-system-x86_64 --version | sed -n '1s/^QEMU emulator version \([0-9]*\)\..*/\1/p'
}

missing=()
for p in "${packages[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
export DEBIAN_FRONTEND=noninteractive
if (( ${#missing[@]} )); then
    echo "setup: installing ${missing[*]}" >&2
    apt_update
    apt-get install -y -q "${missing[@]}" >/dev/null ||
        { echo "setup: apt-get install ${missing[*]} failed" >&2; exit 1; }
fi
if [[ "$(qemu_major)" -lt "$QEMU_MIN_MAJOR" ]]; then
    echo "setup: installing qemu-system-x86 $QEMU_MIN_MAJOR from bookworm-backports" >&2
    apt_update
    # Its recommends (GUI, SPICE and OpenGL modules, OVMF) serve no tier.
    apt-get install -y -q --no-install-recommends qemu-system-x86 >/dev/null ||
        { echo "setup: apt-get install qemu-system-x86 (bookworm-backports) failed" >&2; exit 1; }
fi
major="$(qemu_major)"
if [[ "$major" -lt "$QEMU_MIN_MAJOR" ]]; then
    echo "setup: qemu-system-x86_64 is version ${major:-unknown} after the install; the lab needs $QEMU_MIN_MAJOR or later (bookworm-backports)" >&2
    exit 1
fi
if ! command -v cargo >/dev/null; then
    echo "setup: cargo is missing; install the Rust toolchain pinned in rust-toolchain.toml" >&2
    exit 1
fi
echo "setup: system packages ready ($(qemu-system-x86_64 --version | head -n 1))" >&2
