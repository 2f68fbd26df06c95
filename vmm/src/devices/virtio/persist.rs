//! Snapshot state of virtio devices: transport registers, queues, and what each device needs
//! to be rebuilt (its backing file or socket, which a restore may override).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueState, QueueT};

use super::mmio::TransportRegisters;

/// A split virtqueue's state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueuePersistState {
    /// Largest size the device offers.
    pub max_size: u16,
    /// Size the driver chose.
    pub size: u16,
    /// Whether the driver enabled it.
    pub ready: bool,
    /// Descriptor table address.
    pub desc_table: u64,
    /// Available ring address.
    pub avail_ring: u64,
    /// Used ring address.
    pub used_ring: u64,
    /// Next available index the device will read.
    pub next_avail: u16,
    /// Next used index the device will write.
    pub next_used: u16,
    /// VIRTIO_F_EVENT_IDX negotiated.
    pub event_idx_enabled: bool,
}

impl From<&Queue> for QueuePersistState {
    fn from(q: &Queue) -> Self {
        let s = q.state();
        Self {
            max_size: s.max_size,
            size: s.size,
            ready: s.ready,
            desc_table: s.desc_table,
            avail_ring: s.avail_ring,
            used_ring: s.used_ring,
            next_avail: s.next_avail,
            next_used: s.next_used,
            event_idx_enabled: s.event_idx_enabled,
        }
    }
}

impl QueuePersistState {
    /// Rebuilds the queue; a state whose sizes are invalid is refused.
    pub fn to_queue(&self) -> Result<Queue, String> {
        let state = QueueState {
            max_size: self.max_size,
            next_avail: self.next_avail,
            next_used: self.next_used,
            event_idx_enabled: self.event_idx_enabled,
            size: self.size,
            ready: self.ready,
            desc_table: self.desc_table,
            avail_ring: self.avail_ring,
            used_ring: self.used_ring,
        };
        let queue = Queue::try_from(state).map_err(|e| format!("queue state: {e}"))?;
        debug_assert_eq!(queue.size(), self.size);
        Ok(queue)
    }
}

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
