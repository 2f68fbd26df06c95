//! The boot source (`boot-source`): kernel, initrd and command line; the command lines used
//! when none is given.

/// The command line used when none is given.
pub const DEFAULT_BOOT_ARGS: &str = "console=ttyS0 reboot=k panic=1 pci=off";
/// The command line used when none is given and the machine has a PCI bus.
pub const DEFAULT_BOOT_ARGS_PCI: &str = "console=ttyS0 reboot=k panic=1";
