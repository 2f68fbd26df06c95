//! The test guest (`tests/test-guest`) as the `daemon`, `snapshot` and `vmm` benchmarks boot it.

/// The test guest's command line: it finds its virtio devices on the command line, so ACPI is
/// off (with ACPI on, rollbox-vmm names them in the DSDT instead).
pub const TEST_GUEST_CMDLINE: &str = "console=ttyS0 reboot=k panic=1 pci=off acpi=off";
