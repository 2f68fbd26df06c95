#!/usr/bin/env bash
# Prepares, on the host, what the tier-4 tests boot inside the lab: our kernel, Debian's distro
# kernel with a small initramfs, and root filesystems that `rollbox image build` makes from a
# busybox image, from a Debian bookworm image with Docker and from the code-interpreter image
# (scripts/code-interpreter-rootfs.sh), each with the static agent as init. Writes
# DIR/fixtures.env (KEY=path lines) and prints DIR last.
#
# Usage: scripts/lab/tier4-fixtures.sh DIR
#
# Needs: root, a running dockerd with rollbox-test/busybox:latest (scripts/start-dockerd.sh),
# the workspace built (target/debug/rollbox), the static agent (guest-agent/build-static.sh),
# the guest kernel (kernel-config/build.sh) and the lab kit (scripts/lab/kit.sh).
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$SCRIPT_DIR/../.." && pwd)"
readonly SCRIPT_DIR ROOT
readonly BUSYBOX_IMAGE="rollbox-test/busybox:latest"
readonly DEBIAN_REPO="rollbox-test/debian-docker"
# Modules the distro kernel needs to reach its root filesystem and the agent's vsock, in the
# order modprobe --show-depends gives.
readonly DISTRO_MODULES=(virtio_mmio virtio_blk ext4 vmw_vsock_virtio_transport)

log() { echo "tier4-fixtures: $*" >&2; }
die() { echo "tier4-fixtures: error: $*" >&2; exit 1; }
last_line() { tail -n 1; }

[[ $# -eq 1 ]] || die "usage: $0 DIR"
out="$1"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
[[ "$(id -u)" -eq 0 ]] || die "must run as root (rollbox image build writes ext4 images with owners)"
rollbox="${ROLLBOX_BIN:-$ROOT/target/debug/rollbox}"
[[ -x "$rollbox" ]] || die "no rollbox binary at $rollbox (cargo build -p rollbox)"
docker info >/dev/null 2>&1 || die "dockerd does not answer (scripts/start-dockerd.sh)"

kernel_dir="${ROLLBOX_KERNEL_DIR:-$("$ROOT/kernel-config/build.sh" | last_line)}"
[[ -f "$kernel_dir/vmlinux" && -f "$kernel_dir/bzImage" ]] || die "no guest kernel in $kernel_dir"
kit="$("$SCRIPT_DIR/kit.sh" | last_line)"
release="$(sed -n 's/^release=//p' "$kit/kit-info")"
agent="${ROLLBOX_AGENT_STATIC:-$("$ROOT/guest-agent/build-static.sh" | last_line)}"
[[ -f "$agent" ]] || die "no static agent at $agent"

# Debian's kernel: an initramfs that loads the virtio, ext4 and vsock modules, mounts the
# rootfs and hands over to the agent as PID 1.
initramfs="$(mktemp -d)"
trap 'rm -rf "$initramfs"' EXIT
mkdir -p "$initramfs"/{bin,dev,proc,sys,newroot,modules}
cp /bin/busybox "$initramfs/bin/busybox"
for m in "${DISTRO_MODULES[@]}"; do
    modprobe --show-depends -d "$kit/root" -S "$release" "$m" || die "modprobe --show-depends $m failed"
done | awk '$1 == "insmod" && !seen[$2]++ { print $2 }' > "$initramfs/modules/paths"
: > "$initramfs/modules/order"
while read -r path; do
    cp "$path" "$initramfs/modules/"
    basename "$path" >> "$initramfs/modules/order"
done < "$initramfs/modules/paths"
rm "$initramfs/modules/paths"
cat > "$initramfs/init" <<'EOF'
#!/bin/busybox sh
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t devtmpfs dev /dev
for m in $(/bin/busybox cat /modules/order); do
    /bin/busybox insmod "/modules/$m" || echo "initramfs: insmod $m failed"
done
echo "initramfs: modules loaded on $(/bin/busybox uname -r)"
for i in $(/bin/busybox seq 100); do [ -b /dev/vda ] && break; /bin/busybox sleep 0.1; done
/bin/busybox mount -t ext4 /dev/vda /newroot || { echo "initramfs: cannot mount /dev/vda"; exit 1; }
/bin/busybox umount /proc /dev
exec /bin/busybox switch_root /newroot /.rollbox/rollbox-agent
EOF
chmod 0755 "$initramfs/init"
(cd "$initramfs" && find . | cpio -o -H newc --quiet | gzip -1) > "$out/distro-initrd.gz"
log "distro initramfs: $(wc -c < "$out/distro-initrd.gz") bytes, modules: $(tr '\n' ' ' < "$initramfs/modules/order")"

image_build() { # NAME REF ARCHIVE SIZE_MIB
    local name="$1" ref="$2" archive="$3" size="$4" built
    built="$("$rollbox" image build "$ref" --from-docker-archive "$archive" --size "$size" \
        --agent "$agent" --cache-dir "$out/image-cache" -o "$out/$name.ext4")" ||
        die "rollbox image build $ref failed"
    grep -q "^rootfs:" <<<"$built" || die "rollbox image build printed no rootfs line"
}

docker save -o "$out/busybox-image.tar" "$BUSYBOX_IMAGE" || die "docker save $BUSYBOX_IMAGE failed"
image_build busybox "$BUSYBOX_IMAGE" "$out/busybox-image.tar" 64
log "busybox rootfs: $out/busybox.ext4"

# A rootfs tarball that a script builds (and caches by content hash, the last path component
# of its directory): imported into Docker once per hash, then built into NAME.ext4.
tarball_build() { # NAME SCRIPT REPO SIZE_MIB
    local name="$1" script="$2" repo="$3" size="$4" tarball hash tag
    tarball="$("$ROOT/$script" | last_line)" || die "$script failed"
    hash="$(basename "$(dirname "$tarball")")"
    tag="$repo:${hash#ci-}"
    if ! docker image inspect "$tag" >/dev/null 2>&1; then
        docker import --message "rollbox $name ($script)" "$tarball" "$tag" >/dev/null
    fi
    docker save -o "$out/$name-image.tar" "$tag"
    image_build "$name" "$tag" "$out/$name-image.tar" "$size"
    rm -f "$out/$name-image.tar"
    log "$name rootfs: $out/$name.ext4"
}

# The Debian + Docker base from the TCG tier.
tarball_build debian scripts/tcg/docker-rootfs.sh "$DEBIAN_REPO" 1024
# The code-interpreter template's image: Python, ipykernel and our server.
tarball_build code-interpreter scripts/code-interpreter-rootfs.sh rollbox-test/code-interpreter 1024

cat > "$out/fixtures.env" <<EOF
OUR_VMLINUX=$kernel_dir/vmlinux
OUR_BZIMAGE=$kernel_dir/bzImage
DISTRO_KERNEL=$kit/vmlinuz
DISTRO_INITRD=$out/distro-initrd.gz
DISTRO_RELEASE=$release
BUSYBOX_ROOTFS=$out/busybox.ext4
DEBIAN_ROOTFS=$out/debian.ext4
CODE_INTERPRETER_ROOTFS=$out/code-interpreter.ext4
BUSYBOX_IMAGE_TAR=$out/busybox-image.tar
ROLLBOX_BIN=$rollbox
EOF
echo "$out"
