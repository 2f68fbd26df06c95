#!/usr/bin/env bash
# Builds and installs rollbox's binaries as they are meant to run: the lean rollbox-vmm (static,
# profile dist: fat LTO, size-optimised but for the snapshot crate; vmm/build-static.sh), the
# static guest agent (guest-agent/build-static.sh), a static rollbox-jailer (one runs per
# sandbox start: no loader, no libraries to map) and rollbox (release), side by side in
# PREFIX/bin, where `rollbox serve` looks for its VMM, jailer and agent.
#
#   scripts/install.sh                     # into /usr/local/bin
#   scripts/install.sh --prefix DIR        # into DIR/bin
#
# Prints each binary it installed with its size and whether it is static.
set -euo pipefail
cd "$(dirname "$0")/.."
prefix=/usr/local
while [[ $# -gt 0 ]]; do
    case "$1" in
        --prefix) prefix="${2:?--prefix needs a directory}"; shift 2 ;;
        -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "install.sh: unknown argument $1 (try --help)" >&2; exit 2 ;;
    esac
done
last_line() { tail -n 1; }

vmm="$(vmm/build-static.sh | last_line)"
agent="$(guest-agent/build-static.sh | last_line)"
cargo build --release -p rollbox --bins >&2
# As the two build-static.sh scripts do: --target keeps crt-static away from build scripts and
# proc macros, and a target dir of its own keeps the shared target/ valid.
RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static" cargo build --release -p rollbox-jailer \
    --target x86_64-unknown-linux-gnu --target-dir target/jailer-static >&2
jailer=target/jailer-static/x86_64-unknown-linux-gnu/release/rollbox-jailer
bin="$prefix/bin"
mkdir -p "$bin"
for pair in "target/release/rollbox:rollbox" "$jailer:rollbox-jailer" \
    "$vmm:rollbox-vmm" "$agent:rollbox-agent"; do
    from="${pair%:*}" name="${pair##*:}"
    # Install beside, then rename: a running daemon's binary is replaced, never written into.
    install -m 0755 "$from" "$bin/.$name.new"
    mv -f "$bin/.$name.new" "$bin/$name"
    if readelf -l "$bin/$name" 2>/dev/null | grep -q "Requesting program interpreter"; then
        kind=dynamic
    else
        kind=static
    fi
    printf '%-40s %6d KiB  %s\n' "$bin/$name" "$(( $(stat -c %s "$bin/$name") / 1024 ))" "$kind"
done
