//! Microvm snapshots: saving every vCPU, the VM and the devices into a state file next to a
//! sparse memory file, and restoring them in a new process with a chosen memory backend.
//!
//! - `state.rs`: the state file ([`MicroVmState`]).
//! - `memory.rs`: host regions, dirty pages and the restore backends ([`RestoreBackend`]).
//! - `create.rs`: taking snapshots ([`create_snapshot`], [`create_background_snapshot`]).
//! - `restore.rs`: restoring ([`restore_microvm`], [`RestoreOptions`], [`VmShell`]).

mod create;
mod memory;
mod restore;
mod state;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use snapshot::format::FormatError;
use snapshot::memory::MemoryFileError;
use snapshot::uffd::UffdError;

use crate::builder::BuildError;
use crate::device_manager::DeviceManagerError;
use crate::devices::legacy::generation::GenerationError;
use crate::devices::pci::persist::PciPersistError;
use crate::vstate::vcpu::VcpuError;
use crate::vstate::vm::VmStateError;

pub use create::{create_background_snapshot, create_snapshot, SnapshotMemory};
pub use memory::RestoreBackend;
pub use restore::{restore_microvm, RestoreOptions, VmShell};
pub use state::{state_path_of, MicroVmState};

/// Errors from creating or restoring snapshots.
#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    /// The state file.
    #[error(transparent)]
    Format(#[from] FormatError),
    /// A memory file.
    #[error(transparent)]
    MemoryFile(#[from] MemoryFileError),
    /// The page server.
    #[error(transparent)]
    Uffd(#[from] UffdError),
    /// VM-wide KVM state.
    #[error(transparent)]
    VmState(#[from] VmStateError),
    /// vCPU state.
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    /// Building the restored VM.
    #[error(transparent)]
    Build(#[from] BuildError),
    /// Announcing a new VM generation.
    #[error(transparent)]
    Generation(#[from] GenerationError),
    /// Saving or rebuilding the devices.
    #[error(transparent)]
    Devices(#[from] DeviceManagerError),
    /// A Diff snapshot with a shared volume: virtiofsd's writes to guest memory are not in
    /// any dirty log.
    #[error("a Diff snapshot of a microVM with a virtio-fs volume ({0}) is not supported: virtiofsd writes guest memory outside KVM's dirty log; take a Full snapshot")]
    FsDiff(String),
    /// A lazy restore with a shared volume.
    #[error("the uffd restore backend cannot serve a microVM with a virtio-fs volume ({0}): virtiofsd maps guest memory itself and would see pages not yet loaded; use copy (or cow, which means copy here)")]
    FsLazy(String),
    /// A microVM whose PCI state cannot be saved.
    #[error("{0}")]
    Pci(String),
    /// PCI state that cannot be saved or restored.
    #[error(transparent)]
    PciState(#[from] PciPersistError),
    /// The operation needs the VM paused.
    #[error("the microVM must be paused (PATCH /vm {{\"state\": \"Paused\"}}) before a snapshot")]
    NotPaused,
    /// A diff snapshot needs dirty tracking and a parent.
    #[error("a Diff snapshot needs {0}")]
    Diff(&'static str),
    /// The snapshot does not fit the request.
    #[error("{0}")]
    Mismatch(String),
    /// A snapshot directory or file is missing.
    #[error("snapshot {path}: {detail}")]
    Missing {
        /// The path.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// Guest memory could not be mapped.
    #[error("cannot map guest memory from {path}: {detail}")]
    Map {
        /// The memory file.
        path: PathBuf,
        /// What failed.
        detail: String,
    },
    /// A device could not be rebuilt.
    #[error("device {device}: {detail}")]
    Device {
        /// The device.
        device: String,
        /// What failed.
        detail: String,
    },
}

/// Full or diff.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SnapshotType {
    /// All guest memory.
    Full,
    /// Pages written since the last snapshot (needs `track_dirty_pages`).
    Diff,
}

/// What a snapshot took.
#[derive(Debug, Clone)]
pub struct SnapshotReport {
    /// Bytes of guest memory data written.
    pub memory_bytes: u64,
    /// Wall time.
    pub elapsed_ms: f64,
}
