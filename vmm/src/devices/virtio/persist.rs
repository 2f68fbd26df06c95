//! Snapshot state of virtio devices: what each device needs to be rebuilt (its backing file or
//! socket, which a restore may override), next to its transport's state.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::mmio::persist::{QueuePersistState, TransportRegisters, TransportState};

/// Which device a slot holds, with its rebuild parameters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DevicePersistKind {
    /// virtio-blk.
    Block {
        /// Drive ID.
        id: String,
        /// Image path at snapshot time.
        path: PathBuf,
        /// Read-only for the guest.
        read_only: bool,
    },
    /// virtio-vsock.
    Vsock {
        /// Guest CID.
        guest_cid: u64,
        /// Host-side socket at snapshot time.
        uds_path: PathBuf,
    },
    /// virtio-net.
    Net {
        /// Interface ID.
        iface_id: String,
        /// Host tap at snapshot time.
        host_dev_name: String,
        /// The MAC the guest was told.
        guest_mac: Option<[u8; 6]>,
    },
    /// virtio-fs: the volume and virtiofsd's saved state.
    Fs(Box<super::fs::persist::FsPersistState>),
}

/// One virtio-mmio slot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VirtioPersistState {
    /// The device.
    pub kind: DevicePersistKind,
    /// Transport registers.
    pub transport: TransportRegisters,
    /// Queues.
    pub queues: Vec<QueuePersistState>,
}

impl VirtioPersistState {
    /// The transport's part.
    pub fn transport_state(&self) -> TransportState {
        TransportState {
            registers: self.transport.clone(),
            queues: self.queues.clone(),
        }
    }
}
