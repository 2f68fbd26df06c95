//! Machine resources: what a microVM is built from, set by flags, a JSON file or the API.
//! The JSON shapes are Firecracker's (`boot-source`, `machine-config`, `drives`, `vsock`),
//! so Firecracker config files and API bodies work unchanged; they are defined in
//! [`vmm_api::machine`] and re-exported here. This module owns what rollbox-vmm makes of
//! them: their checks ([`Validate`], [`ValidateMachine`], one [`ConfigError`]) and
//! [`VmResources`]. The command-line flags are the `rollbox-vmm` binary's.
//!
//! One file per resource: `machine.rs`, `boot_source.rs`, `drive.rs`, `net.rs` (tap and MAC
//! rules from the net device), `vsock.rs`, `fs.rs` (volume checks from the fs device),
//! `vfio.rs`, `console.rs` and `file.rs` (the `--config` file); `validate.rs` holds the traits
//! and the error, `resources.rs` the struct the others add their methods to.

mod boot_source;
mod console;
mod drive;
mod file;
mod fs;
mod machine;
mod net;
mod resources;
mod validate;
mod vfio;
mod vsock;

pub use vmm_api::machine::{
    BootSourceConfig, ConfigFile, DriveConfig, FsCache, FsConfig, MachineConfig, MachineExtension,
    NetworkInterfaceConfig, VsockConfig,
};

pub use crate::arch::mptable::MAX_VCPUS;
pub use boot_source::{DEFAULT_BOOT_ARGS, DEFAULT_BOOT_ARGS_PCI};
pub use console::{ConsoleConfig, DEFAULT_CONSOLE_MAX_BYTES, MIN_CONSOLE_MAX_BYTES};
pub use file::load_config_file;
pub use machine::host_memory_mib;
pub use net::parse_mac;
pub use resources::VmResources;
pub use validate::{ConfigError, Validate, ValidateMachine};
