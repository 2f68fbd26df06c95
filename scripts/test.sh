#!/usr/bin/env bash
# The test command (README and CI): installs what is missing, starts the services the tests
# use (dockerd, a local OCI registry), builds the guest kernel (cached outside the repo), the
# test guest and the workspace, then runs every tier:
#   tier 1  unit and component tests (cargo test, all crates)
#   tier 2  rollbox-vmm with the test guest on real /dev/kvm (tests/tests/tier2_*.rs)
#   tier 3  the guest image under QEMU TCG (guest-agent/tests/tcg_guest.rs, rollbox images)
#   tier 4  Linux under rollbox-vmm, only where KVM has hardware virtualization (skips here)
# ROLLBOX_REQUIRE_ALL=1 turns every "missing prerequisite" skip into a failure, except tier 4.
set -euo pipefail
cd "$(dirname "$0")/.."
export ROLLBOX_REQUIRE_ALL="${ROLLBOX_REQUIRE_ALL:-1}"
export CARGO_TERM_COLOR=never
start=$SECONDS
step() { echo; echo "== $* ($((SECONDS - start)) s)"; }

step "system packages"
scripts/setup.sh
step "services: dockerd and the local registry"
scripts/start-dockerd.sh
scripts/start-registry.sh
step "vhost-device-vsock for the TCG tier"
vhost_bin="$(scripts/tcg/install-vhost-device-vsock.sh | tail -n 1)"
export PATH="$(dirname "$vhost_bin"):$PATH"
step "guest kernel (cached by content hash)"
kernel_dir="$(kernel-config/build.sh | tail -n 1)"
export ROLLBOX_KERNEL_DIR="$kernel_dir"
echo "kernel: $kernel_dir"
step "build: workspace, test guest, static agent"
cargo build --workspace --bins --tests
cargo xtask test-guest
guest-agent/build-static.sh >/dev/null
step "tests: all tiers"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
status=0
cargo test --workspace --no-fail-fast -- --test-threads=2 2>&1 | tee "$log" || status=$?
step "tier 3 smoke: our kernel under QEMU TCG (pc and microvm, vsock both ways)"
scripts/tcg/smoke.sh || status=$?
step "done"
# One closing line over every cargo test binary.
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
exit "$status"
