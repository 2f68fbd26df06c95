#!/usr/bin/env bash
# Builds rollbox's container image offline, from this workspace's binaries and this host's
# own copies of the tools the daemon runs (nft, ip, mkfs.ext4, mount, ldd, chmod), each with the
# shared libraries it loads: no base image is pulled and nothing is downloaded. The image is
# named rollbox:HASH, HASH being the content hash of its files, so building it again from the
# same files is free. Its entrypoint is `rollbox`; `serve` by default.
#
# Usage: scripts/k8s/image.sh [--profile release|debug | --bins DIR] [--push REGISTRY]
#   --profile  which cargo profile's binaries (default release: `cargo build --release`)
#   --bins     the binaries in DIR instead: scripts/install.sh's PREFIX/bin, the lean static VMM
#              and jailer (what a node should run)
#   --push     also push it as REGISTRY/rollbox:HASH (e.g. 127.0.0.1:5000, scripts/start-registry.sh)
# Needs the static guest agent (guest-agent/build-static.sh) and virtiofsd (scripts/virtiofsd.sh,
# run here). Prints the image's reference last (the pushed one with --push).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

die() { echo "image: $*" >&2; exit 1; }
profile=release push="" bins=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --profile) profile="${2:-}"; shift 2 ;;
        --push) push="${2:-}"; shift 2 ;;
        --bins) bins="${2:-}"; shift 2 ;;
        -h|--help) sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument '$1' (try --help)" ;;
    esac
done
[[ "$profile" == release || "$profile" == debug ]] || die "--profile is release or debug, not '$profile'"
command -v docker >/dev/null || die "docker is not installed (scripts/setup.sh, scripts/start-dockerd.sh)"

if [[ -n "$bins" ]]; then
    for bin in rollbox rollbox-vmm rollbox-jailer; do
        [[ -x "$bins/$bin" ]] || die "$bins/$bin is missing: scripts/install.sh --prefix ${bins%/bin}"
    done
else
    bins="$ROOT/target/$profile"
    for bin in rollbox rollbox-vmm rollbox-jailer; do
        [[ -x "$bins/$bin" ]] ||
            die "$bins/$bin is missing: cargo build $([[ $profile == release ]] && echo --release) -p rollbox -p rollbox-vmm -p rollbox-jailer"
    done
fi
agent="$ROOT/target/agent-static/x86_64-unknown-linux-gnu/release/rollbox-agent"
[[ -x "$bins/rollbox-agent" && "$bins" != "$ROOT/target/$profile" ]] && agent="$bins/rollbox-agent"
agent="${ROLLBOX_AGENT:-$agent}"
[[ -x "$agent" ]] || die "the static guest agent $agent is missing: guest-agent/build-static.sh"
virtiofsd="$("$ROOT/scripts/virtiofsd.sh" | tail -n 1)"

rootfs="$(mktemp -d)"
trap 'rm -rf "$rootfs"' EXIT
# This host's /usr merge (/bin -> usr/bin, ...), so that every path below holds in the image.
for dir in bin sbin lib lib64; do
    if [[ -L "/$dir" ]]; then
        mkdir -p "$rootfs/$(readlink "/$dir")"
        ln -s "$(readlink "/$dir")" "$rootfs/$dir"
    fi
done
# FILE at PATH in the image, and every shared library it loads at its own path.
put() {
    local file="$1" at="$2" lib
    install -D -m 0755 "$file" "$rootfs$at"
    while read -r lib; do
        [[ -e "$rootfs$lib" ]] || install -D -m 0755 "$(readlink -f "$lib")" "$rootfs$lib"
    done < <(ldd "$file" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }')
}
put "$bins/rollbox" /usr/local/bin/rollbox
put "$bins/rollbox-vmm" /usr/local/bin/rollbox-vmm
put "$bins/rollbox-jailer" /usr/local/bin/rollbox-jailer
install -D -m 0755 "$agent" "$rootfs/usr/local/lib/rollbox/rollbox-agent"
put "$virtiofsd" /usr/local/libexec/virtiofsd
# The tools the daemon and the jailer run, at this host's paths; ldd is a bash script.
for tool in nft ip mkfs.ext4 mount umount sh bash ldd chmod; do
    path="$(command -v "$tool")" || die "$tool is not installed here (scripts/setup.sh)"
    put "$(readlink -f "$path")" "$path"
done
[[ -e /etc/mke2fs.conf ]] && install -D -m 0644 /etc/mke2fs.conf "$rootfs/etc/mke2fs.conf"
mkdir -p "$rootfs"/{tmp,var/lib/rollbox,run/rollbox,proc,sys,dev,etc}
chmod 1777 "$rootfs/tmp"
printf 'root:x:0:0:root:/root:/bin/sh\n' > "$rootfs/etc/passwd"
printf 'root:x:0:\n' > "$rootfs/etc/group"

hash="$(cd "$rootfs" && find . -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)"
image="rollbox:$hash"
if docker image inspect "$image" >/dev/null 2>&1; then
    echo "image: $image is already built" >&2
else
    tar -C "$rootfs" --numeric-owner --owner=0 --group=0 -c . |
        docker import \
            --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
            --change 'ENV ROLLBOX_AGENT=/usr/local/lib/rollbox/rollbox-agent' \
            --change 'ENV ROLLBOX_VIRTIOFSD=/usr/local/libexec/virtiofsd' \
            --change 'ENTRYPOINT ["/usr/local/bin/rollbox"]' \
            --change 'CMD ["serve"]' \
            - "$image" >/dev/null
    echo "image: built $image ($(du -sh "$rootfs" | cut -f1) of files)" >&2
fi
if [[ -n "$push" ]]; then
    docker tag "$image" "$push/$image"
    docker push -q "$push/$image" >/dev/null
    image="$push/$image"
    echo "image: pushed $image" >&2
fi
echo "$image"
