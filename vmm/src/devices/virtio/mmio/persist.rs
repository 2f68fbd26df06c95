//! Snapshot state of the virtio-mmio transport: its registers and its split virtqueues. The
//! device behind it saves its own state (see `crate::device_manager`).

use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueState, QueueT};

use super::MmioTransport;
use crate::devices::virtio::{Interrupt, VirtioDevice};
use crate::vstate::memory::GuestMemoryMmap;

/// The transport's registers, for snapshots.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransportRegisters {
    /// QueueSel.
    pub queue_select: u32,
    /// DeviceFeaturesSel.
    pub device_features_select: u32,
    /// DriverFeaturesSel.
    pub driver_features_select: u32,
    /// Features the driver acknowledged.
    pub acked_features: u64,
    /// Device status.
    pub status: u32,
    /// ConfigGeneration.
    pub config_generation: u32,
    /// InterruptStatus.
    pub interrupt_status: u32,
}

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

/// What the transport saves: registers and queues.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransportState {
    /// Registers.
    pub registers: TransportRegisters,
    /// Queues, in index order.
    pub queues: Vec<QueuePersistState>,
}

impl MmioTransport {
    /// The registers, for snapshots.
    pub fn registers(&self) -> TransportRegisters {
        TransportRegisters {
            queue_select: self.queue_select,
            device_features_select: self.device_features_select,
            driver_features_select: self.driver_features_select,
            acked_features: self.acked_features,
            status: self.status,
            config_generation: self.config_generation,
            interrupt_status: self.interrupt.status(),
        }
    }

    /// Restores registers and queues saved by a snapshot, re-activating the device if the
    /// driver had it running.
    pub fn load_state(&mut self, regs: &TransportRegisters, queues: Vec<Queue>) {
        self.queue_select = regs.queue_select;
        self.device_features_select = regs.device_features_select;
        self.driver_features_select = regs.driver_features_select;
        self.acked_features = regs.acked_features;
        self.status = regs.status;
        self.config_generation = regs.config_generation;
        self.interrupt.set_status(regs.interrupt_status);
        self.queues = queues;
        if self.is_activated() {
            self.activate_device();
        }
    }
}

impl snapshot::Persist for MmioTransport {
    type State = TransportState;
    /// The rebuilt device, guest memory and the device's interrupt.
    type ConstructorArgs = (Box<dyn VirtioDevice>, GuestMemoryMmap, Interrupt);
    type Error = String;

    fn save(&self) -> Result<Self::State, String> {
        Ok(TransportState {
            registers: self.registers(),
            queues: self.queues.iter().map(Into::into).collect(),
        })
    }

    fn restore(args: Self::ConstructorArgs, state: &Self::State) -> Result<Self, String> {
        let (device, mem, interrupt) = args;
        let queues = state
            .queues
            .iter()
            .map(|q| q.to_queue())
            .collect::<Result<Vec<_>, _>>()?;
        if queues.len() != device.queue_max_sizes().len() {
            return Err(format!(
                "{}: the snapshot has {} queues, the device {}",
                device.name(),
                queues.len(),
                device.queue_max_sizes().len()
            ));
        }
        let mut transport = MmioTransport::new(device, mem, interrupt);
        transport.load_state(&state.registers, queues);
        Ok(transport)
    }
}
