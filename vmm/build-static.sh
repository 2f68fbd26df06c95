#!/usr/bin/env bash
# Builds rollbox-vmm as a static executable (glibc's libc.a via crt-static): no dynamic loader,
# no libc.so/libgcc_s mappings, so it starts sooner and keeps less resident beside the guest
# (docs/benchmarks.md, "rollbox-vmm start-up and resident memory"). Uses its own target dir so
# the RUSTFLAGS do not invalidate the shared target/. Prints the binary's path on stdout (build
# output goes to stderr).
#
#   vmm/build-static.sh            # profile dist: release with fat LTO, one codegen unit
#   PROFILE=release vmm/build-static.sh
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
target=x86_64-unknown-linux-gnu
profile="${PROFILE:-dist}"
target_dir="$root/target/vmm-static"
case "$profile" in
    release) out_dir=release ;;
    dev) out_dir=debug ;;
    *) out_dir="$profile" ;;
esac

# --target keeps RUSTFLAGS away from build scripts and proc macros, which must stay dynamic.
RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static" \
    cargo build --manifest-path "$root/Cargo.toml" -p vmm --bin rollbox-vmm --profile "$profile" \
    --target "$target" --target-dir "$target_dir" >&2

bin="$target_dir/$target/$out_dir/rollbox-vmm"
# A static executable has no program interpreter (PT_INTERP); refuse anything else.
if readelf -l "$bin" 2>/dev/null | grep -q "Requesting program interpreter"; then
    echo "build-static: $bin is dynamically linked" >&2
    exit 1
fi
echo "$bin"
