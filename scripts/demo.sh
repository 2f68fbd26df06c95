#!/usr/bin/env bash
# The main demo: boots the test guest in rollbox-vmm on /dev/kvm, talks to it over its serial
# console, virtio-blk and vsock, then pauses it, snapshots it, restores the snapshot in a new
# process (copy-on-write), and forks the running VM into 4 clones. Prints what happens.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build --release -p vmm -p snapshot
cargo xtask test-guest >/dev/null
exec python3 scripts/demo.py
