#!/usr/bin/env bash
# The main demo, in two parts:
# 1. rollbox-vmm with the test guest on /dev/kvm: serial console, virtio-blk and vsock, pause,
#    snapshot, a restore in a new process (copy-on-write), and a fork into 4 clones.
# 2. The daemon and CLI with a real Linux image template (scripts/daemon-demo.sh): the busybox
#    image becomes a template with a boot snapshot; a sandbox is created, runs commands, gets
#    and gives a file, is snapshotted, forked into 4, reset and deleted. Linux needs a KVM with
#    hardware virtualization: this runs directly where there is one, and in the nested lab
#    (scripts/lab/run.sh) on PVM hosts like the build machines.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { echo; echo "== $*"; }

step "setup: packages"
scripts/setup.sh
step "part 1: rollbox-vmm with the test guest"
cargo build --release -p vmm -p snapshot
cargo xtask test-guest >/dev/null
python3 scripts/demo.py

step "part 2 setup: dockerd, registry, guest kernel (cached), binaries, the busybox image"
scripts/start-dockerd.sh
scripts/start-registry.sh
kernel-config/build.sh | tail -n 1
cargo build -p rollbox -p vmm -p rollbox-jailer --bins
guest-agent/build-static.sh >/dev/null
fixtures="${ROLLBOX_TIER4_FIXTURES:-/var/tmp/rollbox-lab/fixtures}"
scripts/lab/tier4-fixtures.sh "$fixtures" >/dev/null
# shellcheck disable=SC1091
source "$fixtures/fixtures.env"
demo=("$PWD/scripts/daemon-demo.sh" --kernel "$OUR_VMLINUX" --docker-archive "$BUSYBOX_IMAGE_TAR"
    --reference rollbox-test/busybox:latest --name busybox --forks 4)
if [[ -e /sys/module/kvm_intel || -e /sys/module/kvm_amd ]] && [[ ! -e /sys/module/kvm_pvm ]]; then
    step "part 2: rollbox serve and the CLI with a Linux image template (this host's KVM runs Linux)"
    "${demo[@]}"
else
    step "part 2: rollbox serve and the CLI with a Linux image template, in the nested lab (this host's KVM is PVM: Linux cannot run on it directly)"
    scripts/lab/run.sh --memory-mib 6144 --timeout 1800 -- "${demo[@]}"
fi
