//! The virtio-net device model: one RX and one TX queue over a tap.

use std::io::ErrorKind;
use std::os::fd::{AsRawFd, RawFd};

use virtio_queue::{Queue, QueueT};
use vm_memory::Bytes;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use super::tap::{offload, AttachedTaps, Tap, TapError};
use super::VNET_HDR_LEN;
use crate::devices::virtio::chain::{Chain, ChainError, ChainRules};
use crate::devices::virtio::mmio::read_config_bytes;
use crate::devices::virtio::{
    next_chain, return_chain, QueueContext, VirtioDevice, TYPE_NET, VIRTIO_F_VERSION_1,
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
    pub(super) config: NetConfig,
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
    /// Opens the tap (or takes the descriptor handed down for it in `taps`) and builds the
    /// device.
    pub fn new(config: NetConfig, taps: &AttachedTaps) -> Result<Self, NetError> {
        let tap =
            Tap::open_or_attached(&config.host_dev_name, taps).map_err(|source| NetError::Tap {
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
        log::warn!("{}: refused chain at head {head}: {e}", self.who(index));
    }

    /// "virtio-net ID: X queue", for log lines.
    fn who(&self, index: usize) -> String {
        format!(
            "virtio-net {}: {} queue",
            self.config.iface_id,
            queue_name(index)
        )
    }

    /// The next validated chain of queue `index`, or `None` when it is empty or stalled.
    fn pop_chain(
        &mut self,
        mem: &GuestMemoryMmap,
        queue: &mut Queue,
        index: usize,
        rules: &ChainRules,
    ) -> Option<(u16, Result<Chain, ChainError>)> {
        let who = self.who(index);
        let chain = next_chain(mem, queue, self.stalled.get_mut(index)?, &who)?;
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
        return_chain(mem, queue, head, len, &self.who(index))
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
        if self.stalled.contains(&true) {
            ctx.interrupt.signal_needs_reset();
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

#[cfg(test)]
mod chain_tests {
    use std::sync::Arc;

    use virtio_queue::desc::split::Descriptor;
    use vm_memory::{Bytes, GuestAddress};
    use vmm_sys_util::eventfd::EventFd;

    use super::*;
    use crate::devices::virtio::Interrupt;

    const SIZE: u16 = 16;
    const F_NEXT: u16 = 1;
    const F_WRITE: u16 = 2;
    const BUFFERS: u64 = 0x8_0000;

    /// A descriptor: address, length, flags, next.
    type Desc = (u64, u32, u16, u16);

    fn ring(queue: usize) -> u64 {
        0x1_0000 * (queue as u64 + 1)
    }

    /// A net device on a fresh tap (this needs root and /dev/net/tun, as CI has) with both
    /// queues ready on 1 MiB of guest memory.
    struct Rig {
        mem: GuestMemoryMmap,
        queues: Vec<Queue>,
        interrupt: Interrupt,
        net: Net,
        tap: String,
    }

    impl Rig {
        fn new(tap: &str) -> Rig {
            let net = Net::new(
                NetConfig {
                    iface_id: "eth0".into(),
                    host_dev_name: tap.into(),
                    guest_mac: Some([6, 0, 10, 0, 0, 2]),
                },
                &AttachedTaps::default(),
            )
            .expect("a tap (run as root with /dev/net/tun)");
            let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).expect("mem");
            let queues = (0..2)
                .map(|i| {
                    let mut q = Queue::new(QUEUE_SIZE).expect("queue");
                    q.set_size(SIZE);
                    q.set_desc_table_address(Some(ring(i) as u32), Some(0));
                    q.set_avail_ring_address(Some(ring(i) as u32 + 0x1000), Some(0));
                    q.set_used_ring_address(Some(ring(i) as u32 + 0x2000), Some(0));
                    q.set_ready(true);
                    q
                })
                .collect();
            let irq = EventFd::new(libc::EFD_NONBLOCK).expect("eventfd");
            Rig {
                mem,
                queues,
                interrupt: Interrupt::new(Arc::new(irq)),
                net,
                tap: tap.into(),
            }
        }

        fn chain(&self, queue: usize, descs: &[Desc]) {
            for (i, &(addr, len, flags, next)) in descs.iter().enumerate() {
                self.mem
                    .write_obj(
                        Descriptor::new(addr, len, flags, next),
                        GuestAddress(ring(queue) + 16 * i as u64),
                    )
                    .expect("descriptor");
            }
        }

        /// Publishes head 0 as the next available entry and notifies the queue.
        fn publish_and_notify(&mut self, queue: usize, count: u16) {
            let avail = ring(queue) + 0x1000;
            self.mem
                .write_obj(
                    0u16,
                    GuestAddress(avail + 4 + 2 * u64::from((count - 1) % SIZE)),
                )
                .expect("avail entry");
            self.mem
                .write_obj(count, GuestAddress(avail + 2))
                .expect("avail idx");
            let mut ctx = QueueContext {
                mem: &self.mem,
                queues: &mut self.queues,
                interrupt: &self.interrupt,
            };
            self.net.process_queue(queue, &mut ctx);
        }

        fn used(&self, queue: usize) -> Vec<(u32, u32)> {
            let used = ring(queue) + 0x2000;
            let idx: u16 = self.mem.read_obj(GuestAddress(used + 2)).expect("used idx");
            (0..u64::from(idx))
                .map(|i| {
                    let at = used + 4 + 8 * (i % u64::from(SIZE));
                    (
                        self.mem.read_obj(GuestAddress(at)).expect("id"),
                        self.mem.read_obj(GuestAddress(at + 4)).expect("len"),
                    )
                })
                .collect()
        }

        /// Sends an Ethernet frame into the tap from the host side (an AF_PACKET socket).
        fn host_sends(&self, frame: &[u8]) {
            // No IPv6 on the tap, so the only frame the device sees is this one.
            let _ = std::fs::write(
                format!("/proc/sys/net/ipv6/conf/{}/disable_ipv6", self.tap),
                "1",
            );
            let ok = std::process::Command::new("ip")
                .args(["link", "set", &self.tap, "up"])
                .status()
                .expect("ip")
                .success();
            assert!(ok, "ip link set {} up", self.tap);
            let name = std::ffi::CString::new(self.tap.clone()).expect("name");
            // SAFETY: if_nametoindex reads a NUL-terminated string that outlives the call.
            let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
            assert_ne!(index, 0);
            // SAFETY: socket(2) with constant arguments.
            let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0) };
            assert!(fd >= 0, "AF_PACKET socket");
            // SAFETY: sockaddr_ll is plain data; all-zero is valid.
            let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            addr.sll_family = libc::AF_PACKET as u16;
            addr.sll_ifindex = index as i32;
            addr.sll_halen = 6;
            // SAFETY: the buffer and address live for the call; lengths are theirs.
            let sent = unsafe {
                libc::sendto(
                    fd,
                    frame.as_ptr().cast(),
                    frame.len(),
                    0,
                    (&addr as *const libc::sockaddr_ll).cast(),
                    std::mem::size_of::<libc::sockaddr_ll>() as u32,
                )
            };
            // SAFETY: fd is ours.
            unsafe { libc::close(fd) };
            assert_eq!(
                sent,
                frame.len() as isize,
                "{}",
                std::io::Error::last_os_error()
            );
        }
    }

    #[test]
    fn hostile_tx_chains_go_back_unsent_and_the_queue_keeps_working() {
        let mut rig = Rig::new(&format!("rbxu{}", std::process::id() % 100_000));
        let cases: [&[Desc]; 5] = [
            &[(BUFFERS, 64, F_WRITE, 0)],
            &[(BUFFERS, 12, F_NEXT, SIZE + 3)],
            &[(BUFFERS, 12, F_NEXT, 0)],
            &[(1 << 40, 64, 0, 0)],
            &[(BUFFERS, 4, 0, 0)],
        ];
        for (n, descs) in cases.iter().enumerate() {
            rig.chain(TX_QUEUE, descs);
            rig.publish_and_notify(TX_QUEUE, n as u16 + 1);
        }
        assert_eq!(rig.used(TX_QUEUE), vec![(0, 0); cases.len()]);
        // A well-formed frame is still taken (and dropped by the down tap, like a NIC).
        rig.chain(TX_QUEUE, &[(BUFFERS, 12 + 60, 0, 0)]);
        rig.publish_and_notify(TX_QUEUE, cases.len() as u16 + 1);
        assert_eq!(rig.used(TX_QUEUE).len(), cases.len() + 1);
        assert_ne!(rig.interrupt.status(), 0);
    }

    #[test]
    fn a_frame_waits_for_a_usable_rx_buffer() {
        let mut rig = Rig::new(&format!("rbxv{}", std::process::id() % 100_000));
        let mut frame = vec![0xffu8; 6];
        frame.extend_from_slice(&[2, 0, 0, 0, 0, 1, 0x88, 0xb5]);
        frame.extend_from_slice(b"rollbox rx test payload");
        // The device-readable buffer is refused; the frame waits and lands in the next one.
        rig.chain(RX_QUEUE, &[(BUFFERS, 2048, 0, 0)]);
        rig.publish_and_notify(RX_QUEUE, 1);
        rig.host_sends(&frame);
        let mut ctx = QueueContext {
            mem: &rig.mem,
            queues: &mut rig.queues,
            interrupt: &rig.interrupt,
        };
        rig.net.process_backend(&mut ctx);
        assert_eq!(rig.used(RX_QUEUE), vec![(0, 0)]);
        rig.chain(RX_QUEUE, &[(BUFFERS + 0x1000, 2048, F_WRITE, 0)]);
        rig.publish_and_notify(RX_QUEUE, 2);
        let want = (VNET_HDR_LEN + frame.len()) as u32;
        assert_eq!(rig.used(RX_QUEUE), vec![(0, 0), (0, want)]);
        let mut got = vec![0u8; want as usize];
        rig.mem
            .read_slice(&mut got, GuestAddress(BUFFERS + 0x1000))
            .expect("read");
        assert_eq!(&got[10..12], &1u16.to_le_bytes(), "num_buffers");
        assert_eq!(&got[VNET_HDR_LEN..], &frame[..]);
    }
}
