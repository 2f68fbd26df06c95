//! The virtio-net device model: one RX and one TX queue over a tap.

use std::io::ErrorKind;
use std::os::fd::{AsRawFd, RawFd};

use virtio_queue::{Queue, QueueT};
use vm_memory::Bytes;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use super::tap::{offload, Tap, TapError};
use super::VNET_HDR_LEN;
use crate::devices::virtio::chain::{Chain, ChainError, ChainRules};
use crate::devices::virtio::mmio::read_config_bytes;
use crate::devices::virtio::persist::DevicePersistKind;
use crate::devices::virtio::{
    check_avail, QueueContext, VirtioDevice, TYPE_NET, VIRTIO_F_VERSION_1,
};
use crate::vstate::memory::GuestMemoryMmap;

const RX_QUEUE: usize = 0;
const TX_QUEUE: usize = 1;
const QUEUE_NAMES: [&str; 2] = ["RX", "TX"];
const QUEUE_SIZE: u16 = 256;
/// Largest frame with its header: a 64 KiB TSO segment plus Ethernet and VLAN headers.
pub const MAX_FRAME: usize = VNET_HDR_LEN + 65550;

/// Feature bits (virtio 1.2, 5.1.3).
mod feature {
    pub const CSUM: u64 = 1 << 0;
    pub const GUEST_CSUM: u64 = 1 << 1;
    pub const MAC: u64 = 1 << 5;
    pub const GUEST_TSO4: u64 = 1 << 7;
    pub const GUEST_TSO6: u64 = 1 << 8;
    pub const GUEST_ECN: u64 = 1 << 9;
    pub const HOST_TSO4: u64 = 1 << 11;
    pub const HOST_TSO6: u64 = 1 << 12;
    pub const HOST_ECN: u64 = 1 << 13;
}

/// Errors creating the device.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// The tap could not be opened.
    #[error("network interface {iface_id}: {source}")]
    Tap {
        /// Interface ID.
        iface_id: String,
        /// Why.
        source: TapError,
    },
    /// The backend's epoll could not be set up.
    #[error("network interface {iface_id}: event set-up: {source}")]
    Epoll {
        /// Interface ID.
        iface_id: String,
        /// Why.
        source: std::io::Error,
    },
}

/// What a virtio-net device is built from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetConfig {
    /// Interface ID (the API's `iface_id`).
    pub iface_id: String,
    /// Host tap name.
    pub host_dev_name: String,
    /// The MAC the guest is told, if any (otherwise it picks a random one).
    pub guest_mac: Option<[u8; 6]>,
}

/// The virtio-net device.
pub struct Net {
    config: NetConfig,
    tap: Tap,
    /// Edge-triggered readiness of the tap, so a full RX queue does not spin the event loop.
    epoll: Epoll,
    queue_sizes: [u16; 2],
    /// A frame read from the tap that waits for an RX buffer.
    pending: Option<usize>,
    frame: Vec<u8>,
    tx_buf: Vec<u8>,
    /// Queues whose available index ran away: ignored until the driver resets the device.
    stalled: [bool; 2],
    dropped_rx: u64,
    dropped_tx: u64,
}

fn queue_name(index: usize) -> &'static str {
    QUEUE_NAMES.get(index).copied().unwrap_or("unknown")
}

impl Net {
    /// Opens the tap and builds the device.
    pub fn new(config: NetConfig) -> Result<Self, NetError> {
        let tap = Tap::open(&config.host_dev_name).map_err(|source| NetError::Tap {
            iface_id: config.iface_id.clone(),
            source,
        })?;
        let epoll_err = |source| NetError::Epoll {
            iface_id: config.iface_id.clone(),
            source,
        };
        let epoll = Epoll::new().map_err(epoll_err)?;
        epoll
            .ctl(
                ControlOperation::Add,
                tap.as_raw_fd(),
                EpollEvent::new(EventSet::IN | EventSet::EDGE_TRIGGERED, 0),
            )
            .map_err(epoll_err)?;
        Ok(Self {
            config,
            tap,
            epoll,
            queue_sizes: [QUEUE_SIZE; 2],
            pending: None,
            frame: vec![0; MAX_FRAME],
            tx_buf: Vec::with_capacity(MAX_FRAME),
            stalled: [false; 2],
            dropped_rx: 0,
            dropped_tx: 0,
        })
    }

    /// The device's configuration.
    pub fn config(&self) -> &NetConfig {
        &self.config
    }

    fn refused(&self, index: usize, head: u16, e: &ChainError) {
        log::warn!(
            "virtio-net {}: {} queue: refused chain at head {head}: {e}",
            self.config.iface_id,
            queue_name(index)
        );
    }

    /// The next validated chain of queue `index`, or `None` when it is empty or stalled.
    fn pop_chain(
        &mut self,
        mem: &GuestMemoryMmap,
        queue: &mut Queue,
        index: usize,
        rules: &ChainRules,
    ) -> Option<(u16, Result<Chain, ChainError>)> {
        if *self.stalled.get(index)? {
            return None;
        }
        if let Err(e) = check_avail(queue, mem) {
            log::warn!(
                "virtio-net {}: {} queue: {e}; ignoring the queue until reset",
                self.config.iface_id,
                queue_name(index)
            );
            self.stalled[index] = true;
            return None;
        }
        let chain = queue.pop_descriptor_chain(mem)?;
        let head = chain.head_index();
        Some((head, Chain::validate(mem, chain, rules)))
    }

    fn give_back(
        &self,
        mem: &GuestMemoryMmap,
        queue: &mut Queue,
        index: usize,
        head: u16,
        len: u32,
    ) -> bool {
        match queue.add_used(mem, head, len) {
            Ok(()) => true,
            Err(e) => {
                log::warn!(
                    "virtio-net {}: {} queue: cannot return head {head}: {e}",
                    self.config.iface_id,
                    queue_name(index)
                );
                false
            }
        }
    }

    /// Sends every frame the guest queued; true if any chain went back.
    fn process_tx(&mut self, mem: &GuestMemoryMmap, queue: &mut Queue) -> bool {
        let rules = ChainRules {
            queue_size: queue.size(),
            max_readable: MAX_FRAME as u64,
            max_writable: 0,
        };
        let mut used_any = false;
        while let Some((head, chain)) = self.pop_chain(mem, queue, TX_QUEUE, &rules) {
            match chain {
                Ok(chain) => self.send(mem, &chain),
                Err(e) => self.refused(TX_QUEUE, head, &e),
            }
            if !self.give_back(mem, queue, TX_QUEUE, head, 0) {
                break;
            }
            used_any = true;
        }
        used_any
    }

    fn send(&mut self, mem: &GuestMemoryMmap, chain: &Chain) {
        let len = chain.readable_len() as usize;
        if len < VNET_HDR_LEN {
            log::warn!(
                "virtio-net {}: TX queue: refused chain at head {}: {len} bytes are too few for the {VNET_HDR_LEN}-byte header",
                self.config.iface_id,
                chain.head
            );
            return;
        }
        self.tx_buf.clear();
        self.tx_buf.resize(len, 0);
        let mut at = 0;
        for &(addr, n) in &chain.readable {
            let n = n as usize;
            if let Err(e) = mem.read_slice(&mut self.tx_buf[at..at + n], addr) {
                log::warn!("virtio-net {}: TX queue: {e}", self.config.iface_id);
                return;
            }
            at += n;
        }
        if let Err(e) = self.tap.write_frame(&self.tx_buf) {
            // The host side is down or its queue is full: like a NIC, drop the frame.
            self.dropped_tx += 1;
            if self.dropped_tx.is_power_of_two() {
                log::warn!(
                    "virtio-net {}: tap {}: dropped {} outgoing frame(s): {e}",
                    self.config.iface_id,
                    self.tap.name(),
                    self.dropped_tx
                );
            }
        }
    }

    /// Moves frames from the tap into RX buffers until either runs out; true if any chain
    /// went back.
    fn process_rx(&mut self, mem: &GuestMemoryMmap, queue: &mut Queue) -> bool {
        let rules = ChainRules {
            queue_size: queue.size(),
            max_readable: 0,
            max_writable: u64::from(u32::MAX),
        };
        let mut used_any = false;
        loop {
            let len = match self.pending.take() {
                Some(len) => len,
                None => match self.tap.read_frame(&mut self.frame) {
                    Ok(len) => len,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) => {
                        log::warn!(
                            "virtio-net {}: tap {}: read: {e}",
                            self.config.iface_id,
                            self.tap.name()
                        );
                        break;
                    }
                },
            };
            if len < VNET_HDR_LEN {
                continue;
            }
            let Some((head, chain)) = self.pop_chain(mem, queue, RX_QUEUE, &rules) else {
                self.pending = Some(len);
                break;
            };
            let written = match chain {
                Ok(chain) => self.receive(mem, &chain, len),
                Err(e) => {
                    self.refused(RX_QUEUE, head, &e);
                    // The frame waits for a usable buffer.
                    self.pending = Some(len);
                    0
                }
            };
            if !self.give_back(mem, queue, RX_QUEUE, head, written) {
                break;
            }
            used_any = true;
        }
        used_any
    }

    /// Copies the frame of `len` bytes into `chain`; the bytes written, or 0 when it does
    /// not fit (the frame is dropped).
    fn receive(&mut self, mem: &GuestMemoryMmap, chain: &Chain, len: usize) -> u32 {
        if chain.writable_len() < len as u64 {
            self.dropped_rx += 1;
            if self.dropped_rx.is_power_of_two() {
                log::warn!(
                    "virtio-net {}: RX queue: dropped {} frame(s) larger than their buffer (this one {len} bytes, buffer {})",
                    self.config.iface_id,
                    self.dropped_rx,
                    chain.writable_len()
                );
            }
            return 0;
        }
        // num_buffers: one buffer per frame (no mergeable RX buffers).
        self.frame[10..12].copy_from_slice(&1u16.to_le_bytes());
        let mut at = 0;
        for &(addr, n) in &chain.writable {
            if at == len {
                break;
            }
            let n = (n as usize).min(len - at);
            if let Err(e) = mem.write_slice(&self.frame[at..at + n], addr) {
                log::warn!("virtio-net {}: RX queue: {e}", self.config.iface_id);
                return 0;
            }
            at += n;
        }
        len as u32
    }

    fn drain_epoll(&self) {
        let mut events = [EpollEvent::default(); 4];
        if let Err(e) = self.epoll.wait(0, &mut events) {
            log::warn!("virtio-net {}: epoll: {e}", self.config.iface_id);
        }
    }

    fn run(&mut self, ctx: &mut QueueContext<'_>, tx: bool) {
        let mem = ctx.mem;
        let mut used_any = false;
        if tx {
            if let Some(queue) = ctx.queues.get_mut(TX_QUEUE) {
                used_any |= self.process_tx(mem, queue);
            }
        }
        if let Some(queue) = ctx.queues.get_mut(RX_QUEUE) {
            used_any |= self.process_rx(mem, queue);
        }
        if used_any {
            ctx.interrupt.signal_used_ring();
        }
    }
}

impl VirtioDevice for Net {
    fn device_type(&self) -> u32 {
        TYPE_NET
    }

    fn avail_features(&self) -> u64 {
        let mac = if self.config.guest_mac.is_some() {
            feature::MAC
        } else {
            0
        };
        VIRTIO_F_VERSION_1
            | mac
            | feature::CSUM
            | feature::GUEST_CSUM
            | feature::GUEST_TSO4
            | feature::GUEST_TSO6
            | feature::GUEST_ECN
            | feature::HOST_TSO4
            | feature::HOST_TSO6
            | feature::HOST_ECN
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // mac[6], then status (not offered).
        let mut space = [0u8; 8];
        if let Some(mac) = self.config.guest_mac {
            space[..6].copy_from_slice(&mac);
        }
        read_config_bytes(&space, offset, data);
    }

    fn activate(&mut self, acked: u64) {
        let mut flags = 0;
        if acked & feature::GUEST_CSUM != 0 {
            flags |= offload::CSUM;
            if acked & feature::GUEST_TSO4 != 0 {
                flags |= offload::TSO4;
            }
            if acked & feature::GUEST_TSO6 != 0 {
                flags |= offload::TSO6;
            }
            if acked & feature::GUEST_ECN != 0 && flags & (offload::TSO4 | offload::TSO6) != 0 {
                flags |= offload::TSO_ECN;
            }
        }
        if let Err(e) = self.tap.set_offload(flags) {
            log::warn!("virtio-net {}: {e}", self.config.iface_id);
        }
    }

    fn reset(&mut self) {
        self.pending = None;
        self.stalled = [false; 2];
    }

    fn process_queue(&mut self, queue: usize, ctx: &mut QueueContext<'_>) {
        self.run(ctx, queue == TX_QUEUE);
    }

    fn backend_fd(&self) -> Option<RawFd> {
        Some(self.epoll.as_raw_fd())
    }

    fn process_backend(&mut self, ctx: &mut QueueContext<'_>) {
        self.drain_epoll();
        self.run(ctx, false);
    }

    fn drain_backend(&mut self) {
        self.drain_epoll();
    }

    fn name(&self) -> String {
        format!("virtio-net {}", self.config.iface_id)
    }

    fn persist_kind(&self) -> DevicePersistKind {
        DevicePersistKind::Net {
            iface_id: self.config.iface_id.clone(),
            host_dev_name: self.config.host_dev_name.clone(),
            guest_mac: self.config.guest_mac,
        }
    }

    /// A frame read before the snapshot is gone; serve what the tap has now.
    fn after_restore(&mut self, ctx: &mut QueueContext<'_>) {
        self.run(ctx, true);
    }
}

/// Formats a MAC as `aa:bb:cc:dd:ee:ff`.
pub fn format_mac(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mac_formats() {
        assert_eq!(format_mac(&[6, 0, 0xac, 0x10, 0, 2]), "06:00:ac:10:00:02");
    }
}
