//! [`VmResources`]: everything a microVM is built from. Each resource's file adds its own
//! methods (`upsert_drive` in `drive.rs`, `upsert_net` in `net.rs`, ...).

use std::path::PathBuf;

use vmm_api::{
    BootSourceConfig, DriveConfig, FsConfig, MachineConfig, NetworkInterfaceConfig, VsockConfig,
};

use super::console::ConsoleConfig;
use crate::devices::virtio::net::tap::AttachedTaps;

/// Everything needed to build a microVM.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VmResources {
    /// Kernel and command line.
    pub boot_source: Option<BootSourceConfig>,
    /// vCPUs and memory.
    pub machine: MachineConfig,
    /// Drives, in insertion order (the root device first).
    pub drives: Vec<DriveConfig>,
    /// The vsock device.
    pub vsock: Option<VsockConfig>,
    /// Network interfaces, in insertion order.
    pub net: Vec<NetworkInterfaceConfig>,
    /// Console output.
    pub console: ConsoleConfig,
    /// rollbox extension: shared volumes, in insertion order.
    pub fs: Vec<FsConfig>,
    /// The virtiofsd binary (`--virtiofsd`); else it is looked up (see
    /// [`crate::devices::virtio::fs::locate_virtiofsd`]).
    pub virtiofsd: Option<PathBuf>,
    /// Taps the caller attached already, by name (`--tap-fd`): the interfaces on them take
    /// these descriptors instead of opening the tap.
    pub taps: AttachedTaps,
}
