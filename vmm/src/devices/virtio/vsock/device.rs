//! The virtio-vsock device model: RX, TX and event queues over the Unix-socket host side.

use std::os::fd::RawFd;
use std::path::Path;

use crate::vstate::memory::GuestMemoryMmap;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{Queue, QueueOwnedT, QueueT};

use super::packet::{read_packet, rx_capacity, write_packet, HEADER_LEN};
use super::unix::{UnixError, UnixMuxer};
use crate::devices::virtio::mmio::read_config_bytes;
use crate::devices::virtio::{QueueContext, VirtioDevice, TYPE_VSOCK};

const RX_QUEUE: usize = 0;
const TX_QUEUE: usize = 1;
const EVENT_QUEUE: usize = 2;
const EVENT_TRANSPORT_RESET: u32 = 0;
const QUEUE_SIZE: u16 = 256;
/// Largest payload accepted from or sent to the guest in one packet.
const MAX_PAYLOAD: usize = 64 * 1024;

/// Errors from creating the vsock device.
#[derive(Debug, thiserror::Error)]
pub enum VsockError {
    /// The host side could not be set up.
    #[error(transparent)]
    Unix(#[from] UnixError),
}

/// The virtio-vsock device.
pub struct Vsock {
    guest_cid: u64,
    muxer: UnixMuxer,
    queue_sizes: [u16; 3],
}

impl Vsock {
    /// A device for `guest_cid` whose host side listens on `uds_path`.
    pub fn new(guest_cid: u64, uds_path: &Path) -> Result<Self, VsockError> {
        Ok(Self {
            guest_cid,
            muxer: UnixMuxer::new(guest_cid, uds_path)?,
            queue_sizes: [QUEUE_SIZE; 3],
        })
    }

    fn process_tx(&mut self, mem: &GuestMemoryMmap, queue: &mut Queue) -> bool {
        let mut used_any = false;
        while let Some(chain) = queue.pop_descriptor_chain(mem) {
            let head = chain.head_index();
            let descriptors: Vec<Descriptor> = chain.collect();
            match read_packet(mem, &descriptors, MAX_PAYLOAD) {
                Ok((header, payload)) => self.muxer.handle_guest_packet(&header, &payload),
                Err(e) => log::warn!("virtio-vsock: refused TX chain at head {head}: {e}"),
            }
            if let Err(e) = queue.add_used(mem, head, 0) {
                log::warn!("virtio-vsock: cannot return TX head {head}: {e}");
                break;
            }
            used_any = true;
        }
        used_any
    }

    fn fill_rx(&mut self, mem: &GuestMemoryMmap, queue: &mut Queue) -> bool {
        let mut used_any = false;
        while self.muxer.has_rx() {
            let Some(chain) = queue.pop_descriptor_chain(mem) else {
                break;
            };
            let head = chain.head_index();
            let descriptors: Vec<Descriptor> = chain.collect();
            let written = match rx_capacity(mem, &descriptors) {
                Err(e) => {
                    log::warn!("virtio-vsock: refused RX chain at head {head}: {e}");
                    0
                }
                Ok(capacity) => {
                    match self.muxer.next_rx((capacity - HEADER_LEN).min(MAX_PAYLOAD)) {
                        None => {
                            queue.go_to_previous_position();
                            break;
                        }
                        Some((header, payload)) => {
                            match write_packet(mem, &descriptors, &header, &payload) {
                                Ok(n) => n as u32,
                                Err(e) => {
                                    log::warn!(
                                        "virtio-vsock: cannot write RX chain at head {head}: {e}"
                                    );
                                    0
                                }
                            }
                        }
                    }
                }
            };
            if let Err(e) = queue.add_used(mem, head, written) {
                log::warn!("virtio-vsock: cannot return RX head {head}: {e}");
                break;
            }
            used_any = true;
        }
        used_any
    }

    fn run(&mut self, ctx: &mut QueueContext<'_>, tx_first: bool) {
        let mem = ctx.mem;
        let mut used_any = false;
        if tx_first {
            if let Some(tx) = ctx.queues.get_mut(TX_QUEUE) {
                used_any |= self.process_tx(mem, tx);
            }
        }
        if let Some(rx) = ctx.queues.get_mut(RX_QUEUE) {
            used_any |= self.fill_rx(mem, rx);
        }
        if used_any {
            ctx.interrupt.signal_used_ring();
        }
    }
}

impl VirtioDevice for Vsock {
    fn device_type(&self) -> u32 {
        TYPE_VSOCK
    }

    fn avail_features(&self) -> u64 {
        0
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.guest_cid.to_le_bytes(), offset, data);
    }

    fn reset(&mut self) {
        self.muxer.reset();
    }

    fn process_queue(&mut self, queue: usize, ctx: &mut QueueContext<'_>) {
        self.run(ctx, queue == TX_QUEUE || queue == RX_QUEUE);
    }

    fn backend_fd(&self) -> Option<RawFd> {
        Some(self.muxer.epoll_fd())
    }

    fn process_backend(&mut self, ctx: &mut QueueContext<'_>) {
        self.muxer.process_events();
        // TX first: a CONNECT may be answered by a RESPONSE already queued.
        self.run(ctx, true);
    }

    fn persist_kind(&self) -> crate::devices::virtio::persist::DevicePersistKind {
        crate::devices::virtio::persist::DevicePersistKind::Vsock {
            guest_cid: self.guest_cid,
            uds_path: self.muxer.uds_path().to_path_buf(),
        }
    }

    /// Connections did not survive the snapshot: tell the guest with a TRANSPORT_RESET event,
    /// after which its listening sockets keep working.
    fn after_restore(&mut self, ctx: &mut QueueContext<'_>) {
        self.muxer.reset();
        let mem = ctx.mem;
        let Some(queue) = ctx.queues.get_mut(EVENT_QUEUE) else {
            return;
        };
        let Some(chain) = queue.pop_descriptor_chain(mem) else {
            log::warn!("virtio-vsock: no event buffer for TRANSPORT_RESET");
            return;
        };
        let head = chain.head_index();
        let descriptors: Vec<Descriptor> = chain.collect();
        let written = match descriptors.first() {
            Some(d) if d.is_write_only() && d.len() >= 4 => {
                match vm_memory::Bytes::write_obj(mem, EVENT_TRANSPORT_RESET, d.addr()) {
                    Ok(()) => 4,
                    Err(e) => {
                        log::warn!("virtio-vsock: cannot write TRANSPORT_RESET: {e}");
                        0
                    }
                }
            }
            _ => {
                log::warn!("virtio-vsock: event buffer at head {head} cannot take an event");
                0
            }
        };
        if queue.add_used(mem, head, written).is_ok() {
            ctx.interrupt.signal_used_ring();
        }
    }

    fn drain_backend(&mut self) {
        self.muxer.process_events();
    }

    fn name(&self) -> String {
        format!("virtio-vsock cid {}", self.guest_cid)
    }
}
