//! Virtio devices over the virtio-mmio transport. Each device's folder holds its model and its
//! snapshot state (`persist.rs`); `crate::device_manager` attaches, saves and restores them.

pub mod block;
pub mod chain;
pub mod fs;
pub mod mmio;
pub mod net;
pub mod vsock;

use std::any::Any;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use crate::vstate::memory::GuestMemoryMmap;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vmm_sys_util::eventfd::EventFd;

/// VIRTIO_F_VERSION_1: the device speaks virtio 1.x.
pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;
/// Device type of virtio-net.
pub const TYPE_NET: u32 = 1;
/// Device type of virtio-blk.
pub const TYPE_BLOCK: u32 = 2;
/// Device type of virtio-vsock.
pub const TYPE_VSOCK: u32 = 19;
/// Device type of virtio-fs.
pub const TYPE_FS: u32 = 26;

const INTERRUPT_USED_RING: u32 = 1;
const INTERRUPT_CONFIG: u32 = 2;

/// Why a queue's available ring cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    /// The driver published more chains than the queue holds.
    #[error("available index {avail} is more than the queue size {size} ahead of {next}")]
    AvailTooFarAhead {
        /// The driver's available index.
        avail: u16,
        /// The next index the device would serve.
        next: u16,
        /// Queue size.
        size: u16,
    },
    /// The available ring could not be read.
    #[error("cannot read the available ring: {0}")]
    AvailUnreadable(virtio_queue::Error),
}

/// Pops the next chain of `queue`, reading the driver's available index once.
/// `pop_descriptor_chain` would answer a runaway index only with `None` and a log line of
/// virtio-queue's own that names no device; a check of the index before it would read it a
/// second time, and a guest that changes it in between gets both lines. A queue that is not
/// ready has no chain.
pub fn pop_checked<'m>(
    queue: &mut Queue,
    mem: &'m GuestMemoryMmap,
) -> Result<Option<virtio_queue::DescriptorChain<&'m GuestMemoryMmap>>, QueueError> {
    if !queue.ready() {
        return Ok(None);
    }
    let next = queue.next_avail();
    let size = queue.size();
    match queue.iter(mem) {
        Ok(mut chains) => Ok(chains.next()),
        Err(virtio_queue::Error::InvalidAvailRingIndex) => {
            // The index that was refused is gone; this read names one the driver published.
            let avail = queue
                .avail_idx(mem, Ordering::Acquire)
                .map_err(QueueError::AvailUnreadable)?;
            Err(QueueError::AvailTooFarAhead {
                avail: avail.0,
                next,
                size,
            })
        }
        Err(e) => Err(QueueError::AvailUnreadable(e)),
    }
}

/// Takes the next chain of `queue` unless `stalled`. An available index that ran more than a
/// queue ahead stalls the queue until the driver resets the device, with one log line naming
/// `who` (device and queue).
pub fn next_chain<'m>(
    mem: &'m GuestMemoryMmap,
    queue: &mut Queue,
    stalled: &mut bool,
    who: &dyn std::fmt::Display,
) -> Option<virtio_queue::DescriptorChain<&'m GuestMemoryMmap>> {
    if *stalled {
        return None;
    }
    match pop_checked(queue, mem) {
        Ok(chain) => chain,
        Err(e) => {
            log::warn!("{who}: {e}; ignoring the queue until reset");
            *stalled = true;
            None
        }
    }
}

/// Puts chain `head` on the used ring with `len` bytes written; false (logged, naming `who`)
/// when the used ring cannot take it.
pub fn return_chain(
    mem: &GuestMemoryMmap,
    queue: &mut Queue,
    head: u16,
    len: u32,
    who: &dyn std::fmt::Display,
) -> bool {
    match queue.add_used(mem, head, len) {
        Ok(()) => true,
        Err(e) => {
            log::warn!("{who}: cannot return head {head}: {e}");
            false
        }
    }
}

/// A device's interrupt: the MMIO interrupt-status register plus its irqfd.
#[derive(Clone)]
pub struct Interrupt {
    status: Arc<AtomicU32>,
    irqfd: Arc<EventFd>,
    /// A queue the device stopped serving: DEVICE_NEEDS_RESET until the driver resets it.
    needs_reset: Arc<AtomicBool>,
    /// Bits that always read as set (see [`Interrupt::with_sticky_used_ring`]).
    sticky: u32,
}

impl Interrupt {
    /// An interrupt raised through `irqfd`.
    pub fn new(irqfd: Arc<EventFd>) -> Self {
        Self {
            status: Arc::new(AtomicU32::new(0)),
            irqfd,
            needs_reset: Arc::new(AtomicBool::new(false)),
            sticky: 0,
        }
    }

    /// The same interrupt with USED_RING always set in the status register: for a device
    /// whose vhost-user backend writes the irqfd itself, where the VMM cannot set the bit.
    pub fn with_sticky_used_ring(mut self) -> Self {
        self.sticky = INTERRUPT_USED_RING;
        self
    }

    /// The irqfd, for a backend that raises the interrupt itself.
    pub fn irqfd(&self) -> &EventFd {
        &self.irqfd
    }

    /// Tells the driver that used rings changed.
    pub fn signal_used_ring(&self) {
        self.raise(INTERRUPT_USED_RING);
    }

    /// Tells the driver that configuration space changed.
    pub fn signal_config_change(&self) {
        self.raise(INTERRUPT_CONFIG);
    }

    /// Tells the driver that the device stopped serving a queue and needs a reset: the
    /// status register shows DEVICE_NEEDS_RESET, with one configuration-change interrupt.
    pub fn signal_needs_reset(&self) {
        if !self.needs_reset.swap(true, Ordering::SeqCst) {
            self.raise(INTERRUPT_CONFIG);
        }
    }

    /// Whether [`Interrupt::signal_needs_reset`] was called since the last device reset.
    pub fn needs_reset(&self) -> bool {
        self.needs_reset.load(Ordering::SeqCst)
    }

    /// A device reset by the driver: the device serves its queues again.
    pub fn clear_needs_reset(&self) {
        self.needs_reset.store(false, Ordering::SeqCst);
    }

    fn raise(&self, bit: u32) {
        self.status.fetch_or(bit, Ordering::SeqCst);
        if let Err(e) = self.irqfd.write(1) {
            log::error!("cannot raise virtio interrupt: {e}");
        }
    }

    /// The interrupt-status register.
    pub fn status(&self) -> u32 {
        self.status.load(Ordering::SeqCst) | self.sticky
    }

    /// Overwrites the interrupt-status register (snapshot restore).
    pub fn set_status(&self, value: u32) {
        self.status.store(value, Ordering::SeqCst);
    }

    /// The driver's InterruptACK write.
    pub fn ack(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::SeqCst);
    }
}

/// What a device needs to serve its queues.
pub struct QueueContext<'a> {
    /// Guest memory.
    pub mem: &'a GuestMemoryMmap,
    /// The device's queues, in index order.
    pub queues: &'a mut [Queue],
    /// The device's interrupt.
    pub interrupt: &'a Interrupt,
}

/// A virtio device model behind the MMIO transport. `Any` lets the device manager reach the
/// concrete device, whose `snapshot::Persist` saves it.
pub trait VirtioDevice: Send + Any {
    /// Virtio device type.
    fn device_type(&self) -> u32;
    /// Feature bits the device offers.
    fn avail_features(&self) -> u64;
    /// Maximum size of each queue; its length is the number of queues.
    fn queue_max_sizes(&self) -> &[u16];
    /// Reads device configuration space.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// Writes device configuration space (ignored unless the device has writable fields).
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        log::debug!(
            "ignored write of {} bytes to config offset {offset:#x}",
            data.len()
        );
    }
    /// The driver set DRIVER_OK: the queues are valid and the device may run.
    fn activate(&mut self, _acked_features: u64) {}
    /// Activation with the queues and guest memory at hand (a vhost-user device hands them to
    /// its backend). An error marks the device DEVICE_NEEDS_RESET.
    fn activate_with(
        &mut self,
        acked_features: u64,
        _ctx: &mut QueueContext<'_>,
    ) -> Result<(), String> {
        self.activate(acked_features);
        Ok(())
    }
    /// Whether an external (vhost-user) backend serves the queues: the VMM then hands it the
    /// queue-notify eventfds ([`VirtioDevice::set_notify_fds`]) instead of polling them, and
    /// the backend writes the irqfd itself.
    fn backend_serves_queues(&self) -> bool {
        false
    }
    /// The queue-notify eventfds, in queue order, for a device whose backend serves them.
    fn set_notify_fds(&mut self, _fds: Vec<EventFd>) {}
    /// Set once the device's backend failed for good: the VMM stops the VM with this message.
    fn failure(&self) -> Option<String> {
        None
    }
    /// The driver reset the device.
    fn reset(&mut self) {}
    /// The driver notified queue `queue`.
    fn process_queue(&mut self, queue: usize, ctx: &mut QueueContext<'_>);
    /// A file descriptor the VMM's event loop should watch for this device's backend.
    fn backend_fd(&self) -> Option<RawFd> {
        None
    }
    /// The backend file descriptor is ready.
    fn process_backend(&mut self, _ctx: &mut QueueContext<'_>) {}
    /// The backend file descriptor is ready before the driver activated the device: consume
    /// the readiness without touching queues.
    fn drain_backend(&mut self) {}
    /// A short name for logs.
    fn name(&self) -> String;
    /// Whether something outside the VMM maps guest memory for this device (a vhost-user
    /// backend): its writes are in no dirty log, and it needs memory it can map (shared).
    fn maps_guest_memory(&self) -> bool {
        false
    }
    /// A snapshot of the paused VM is about to be taken: a device whose backend serves the
    /// queues stops them and brings its backend's state into the device's saved state.
    fn save_backend(&mut self, _ctx: &mut QueueContext<'_>) -> Result<(), String> {
        Ok(())
    }
    /// The snapshot is taken (or failed): start what [`VirtioDevice::save_backend`] stopped.
    fn resume_backend(&mut self, _ctx: &mut QueueContext<'_>) {}
    /// Called once after a snapshot restore re-activated the device.
    fn after_restore(&mut self, _ctx: &mut QueueContext<'_>) {}
}
