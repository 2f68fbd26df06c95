#!/usr/bin/env bash
# The test command (README and CI): installs what is missing, starts the services the tests
# use (dockerd, a local OCI registry), builds the guest kernel (cached outside the repo), the
# test guest and the workspace, then runs every tier:
#   tier 1  unit and component tests (cargo test, all crates)
#   tier 2  rollbox-vmm with the test guest on real /dev/kvm (tests/tests/tier2_*.rs)
#   tier 3  the guest image under QEMU TCG (guest-agent/tests/tcg_guest.rs, rollbox images)
#   fuzz    every fuzz target of fuzz/ for 20 s (scripts/fuzz.sh)
#   tier 4  Linux under rollbox-vmm (tests/tests/tier4_{linux,volumes,network}.rs): directly
#           where KVM has hardware virtualization, else inside the nested lab (scripts/lab/run.sh)
# ROLLBOX_REQUIRE_ALL=1 (the default here) turns every "missing prerequisite" skip into a
# failure. The closing line counts passed, failed and skipped tests and names every skip.
set -euo pipefail
cd "$(dirname "$0")/.."
export ROLLBOX_REQUIRE_ALL="${ROLLBOX_REQUIRE_ALL:-1}"
export CARGO_TERM_COLOR=never
# The swapped-out snapshot test may add a 256 MiB swap file while it runs (root only).
export ROLLBOX_TEST_SWAPFILE="${ROLLBOX_TEST_SWAPFILE:-1}"
start=$SECONDS
# Each phase's name and start, for the time table at the end.
phase_names=() phase_starts=()
step() {
    echo; echo "== $* ($((SECONDS - start)) s)"
    phase_names+=("$*"); phase_starts+=("$SECONDS")
}
# Where the time went: each phase, and within the cargo test phase each test binary (libtest's
# "finished in"), slowest first. Printed last, so a log's tail has it.
time_table() {
    local i end
    echo "disk: target/ holds $(du -sh target 2>/dev/null | cut -f1), $(disk_free) GiB left"
    echo "time per phase (total $((SECONDS - start)) s):"
    for i in "${!phase_names[@]}"; do
        end="${phase_starts[$((i + 1))]:-$SECONDS}"
        printf '  %6d s  %s\n' "$((end - phase_starts[i]))" "${phase_names[$i]}"
    done
    echo "slowest test binaries of tiers 1-3 (libtest's own time):"
    awk '/^     Running / { bin = $NF; gsub(/[()]/, "", bin); sub(/^.*\//, "", bin); sub(/-[0-9a-f]+$/, "", bin)
                            name = ($2 == "unittests") ? bin " (unit tests)" : bin }
         /^   Doc-tests / { name = "doc-tests " $2 }
         /^test result:/ && name != "" { t = $NF; sub(/s$/, "", t); printf "%8.1f s  %s\n", t, name; name = "" }' "$tests_log" |
        sort -rn | head -n 15 | sed 's/^/  /'
}

# Free disk where target/ grows: target/ reaches about 4.4 GiB and the kernel build, images and
# lab fixtures take more beside it; a disk that fills mid-build fails with a linker's bus error
# rather than a clear line, hence the warning under 20 GiB.
disk_free() { df -BG --output=avail "${CARGO_TARGET_DIR:-.}" 2>/dev/null | tail -n 1 | tr -dc 0-9; }
echo "disk: $(disk_free) GiB free where target/ is built"
if [[ "$(disk_free)" -lt 20 ]]; then
    echo "warning: under 20 GiB free; the build may fail with 'No space left on device'" >&2
fi
step "system packages"
scripts/setup.sh
step "services: dockerd and the local registry"
scripts/start-dockerd.sh
scripts/start-registry.sh
step "vhost-device-vsock for the TCG tier"
vhost_bin="$(scripts/tcg/install-vhost-device-vsock.sh | tail -n 1)"
export PATH="$(dirname "$vhost_bin"):$PATH"
step "virtiofsd for shared volumes (cached by version)"
ROLLBOX_VIRTIOFSD="$(scripts/virtiofsd.sh | tail -n 1)"
export ROLLBOX_VIRTIOFSD
step "guest kernel (cached by content hash)"
kernel_dir="$(kernel-config/build.sh | tail -n 1)"
export ROLLBOX_KERNEL_DIR="$kernel_dir"
echo "kernel: $kernel_dir"
step "build: workspace, test guest, static agent"
cargo build --workspace --bins --tests
cargo xtask test-guest
guest-agent/build-static.sh >/dev/null
# The tests use the binaries just built; without this, a test's own `cargo build -p PACKAGE`
# resolves features per package and rebuilds (and replaces) them mid-run.
export ROLLBOX_PREBUILT=1
step "tier 4 fixtures: kernels, initramfs and rootfs images for Linux guests"
fixtures="${ROLLBOX_TIER4_FIXTURES:-/var/tmp/rollbox-lab/fixtures}"
scripts/lab/tier4-fixtures.sh "$fixtures" >/dev/null
export ROLLBOX_TIER4_FIXTURES="$fixtures"
log="$(mktemp)"
export ROLLBOX_SKIP_LOG="$(mktemp)"
tests_log=/dev/null
trap 'rm -f "$log" "$ROLLBOX_SKIP_LOG" "${fuzz_log:-}"; [[ "$tests_log" == /dev/null ]] || rm -f "$tests_log"' EXIT
status=0 failed_phases=()
# A phase that fails is named again at the end, where a log's tail shows it; its status is kept.
fail() { failed_phases+=("$1 (status $2)"); status="$2"; }
fuzz_log="$(mktemp)"
step "shape: the generated sync SDK is current; no module cycles, no file over 1,200 lines"
scripts/check-sdk-sync.sh || fail "shape: the sync SDK is not generated from aio.py" 1
python3 scripts/check-shape.py || fail "shape: module cycles or long files" 1
step "tests: tiers 1-3 (tier 4 runs next, in the lab)"
cargo test --workspace --no-fail-fast -- --test-threads=2 --skip tier4:: 2>&1 | tee "$log" || fail "tests: tiers 1-3" $?
tests_log="$(mktemp)"
cp "$log" "$tests_log"
step "tier 3 smoke: our kernel under QEMU TCG (pc and microvm, vsock both ways)"
scripts/tcg/smoke.sh || fail "tier 3 smoke" $?
step "fuzz: every target for ${ROLLBOX_FUZZ_SECONDS:-20} s (scripts/fuzz.sh, docs/fuzzing.md)"
# The workspace's debug build (overflow checks and debug assertions on): no optimised build
# of the dependency tree first. A crash fails the run; its input is in fuzz/artifacts/.
scripts/fuzz.sh --debug-build --jobs "$(nproc)" --seconds "${ROLLBOX_FUZZ_SECONDS:-20}" 2>&1 | tee "$fuzz_log" || fail "fuzz" 1
step "tier 4: Linux under rollbox-vmm (tier4_linux, tier4_volumes, tier4_network, tier4_vfio, tier4_daemon)"
# scripts/tier4.sh: directly where this host's KVM has hardware virtualization, else in the
# nested lab, which it starts again when L1 is lost (each restart named).
scripts/tier4.sh --log "$log" || fail "tier 4" $?
step "done"
# One closing line over every test binary; a skipped test returned early and counts as passed
# in libtest's own summary, so it moves from passed to skipped here.
skipped="$(grep -c . "$ROLLBOX_SKIP_LOG" || true)"
# The last lines of each failed test's own output (its backtrace left out), here at the end,
# where a log's tail shows them.
if grep -q '^test .* \.\.\. FAILED$' "$log"; then
    echo "failed, with the last lines of each one's output:"
    awk 'match($0, /^test .* \.\.\. FAILED$/) { failed[substr($0, 6, length($0) - 16)] = 1 }
         /^---- .* stdout ----$/ { name = substr($0, 6, length($0) - 17); n[name] = 0; next }
         /^(failures:|successes:|test result:|stack backtrace:)/ { name = "" }
         name != "" { text[name, n[name] % 30] = $0; n[name]++ }
         END {
             for (t in failed) {
                 printf "  %s\n", t
                 start = n[t] > 30 ? n[t] - 30 : 0
                 for (i = start; i < n[t]; i++) printf "    | %s\n", text[t, i % 30]
             }
         }' "$log"
fi
# Ignored tests (too long for CI's lab, run by hand) did not run either; they are named too.
awk -v skipped="$skipped" '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i; if ($(i+1) ~ /^ignored/) g += $i } }
     END { printf "tests: %d passed, %d failed, %d skipped, %d ignored\n", p - skipped, f, skipped, g }' "$log"
if [[ "$skipped" -gt 0 ]]; then
    echo "skipped:"
    sed 's/^/  /' "$ROLLBOX_SKIP_LOG"
fi
# Every lab start and loss of tier 4, named (scripts/tier4.sh).
grep -E '^tier 4: ([0-9]+ lab start|lab lost: )' "$log" || true
if grep -q '^tier 4: .* retried after a lab triple fault$' "$log"; then
    echo "retried once after a Linux guest triple-faulted in the nested lab (docs/testing.md):"
    sed -n 's/^tier 4: \(.*\) retried after a lab triple fault$/  \1/p' "$log"
fi
if grep -q '^test .* \.\.\. ignored' "$log"; then
    echo "ignored (not run here):"
    grep '^test .* \.\.\. ignored' "$log" | sed 's/^test /  /'
fi
time_table
if [[ ${#failed_phases[@]} -gt 0 ]]; then
    echo "FAILED phases: ${failed_phases[*]}"
    # A fuzz crash names its target and input above; its lines again, here at the end.
    grep -E '^fuzz .*(CRASH|ABORTED|crashes [1-9])' "$fuzz_log" | sed 's/^/  /' || true
fi
exit "$status"
