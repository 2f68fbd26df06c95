//! The virtio-vsock device model: RX, TX and event queues over the Unix-socket host side.

use std::os::fd::RawFd;
use std::path::Path;

use crate::vstate::memory::GuestMemoryMmap;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::GuestAddress;

use super::packet::{
    collect_chain, event_target, read_packet, rx_capacity, write_packet, BufferError, EVENT_LEN,
    HEADER_LEN,
};
use super::unix::{UnixError, UnixMuxer};
use crate::devices::virtio::mmio::read_config_bytes;
use crate::devices::virtio::{next_chain, return_chain, QueueContext, VirtioDevice, TYPE_VSOCK};

const RX_QUEUE: usize = 0;
const TX_QUEUE: usize = 1;
const EVENT_QUEUE: usize = 2;
/// Queue names for logs, by index.
const QUEUE_NAMES: [&str; 3] = ["RX", "TX", "event"];
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
    pub(super) guest_cid: u64,
    pub(super) muxer: UnixMuxer,
    queue_sizes: [u16; 3],
    /// Queues whose available index ran away: ignored until the driver resets the device.
    stalled: [bool; 3],
}

fn queue_name(index: usize) -> &'static str {
    QUEUE_NAMES.get(index).copied().unwrap_or("unknown")
}

/// One log line for a refused chain.
fn refused(index: usize, head: u16, e: &BufferError) {
    log::warn!(
        "virtio-vsock: {} queue: refused chain at head {head}: {e}",
        queue_name(index)
    );
}

impl Vsock {
    /// A device for `guest_cid` whose host side listens on `uds_path`.
    pub fn new(guest_cid: u64, uds_path: &Path) -> Result<Self, VsockError> {
        Ok(Self {
            guest_cid,
            muxer: UnixMuxer::new(guest_cid, uds_path)?,
            queue_sizes: [QUEUE_SIZE; 3],
            stalled: [false; 3],
        })
    }

    /// The next chain of queue `index` (its head, and its descriptors if it ends properly),
    /// or `None` when the queue is empty or stalled.
    fn pop_chain(
        &mut self,
        mem: &GuestMemoryMmap,
        queue: &mut Queue,
        index: usize,
    ) -> Option<(u16, Result<Vec<Descriptor>, BufferError>)> {
        let who = format!("virtio-vsock: {} queue", queue_name(index));
        let chain = next_chain(mem, queue, self.stalled.get_mut(index)?, &who)?;
        let head = chain.head_index();
        Some((head, collect_chain(chain, queue.size())))
    }

    /// Returns chain `head` of queue `index` to the guest; false if that failed (logged).
    fn give_back(
        mem: &GuestMemoryMmap,
        queue: &mut Queue,
        index: usize,
        head: u16,
        len: u32,
    ) -> bool {
        let who = format!("virtio-vsock: {} queue", queue_name(index));
        return_chain(mem, queue, head, len, &who)
    }

    fn process_tx(&mut self, mem: &GuestMemoryMmap, queue: &mut Queue) -> bool {
        let mut used_any = false;
        while let Some((head, descriptors)) = self.pop_chain(mem, queue, TX_QUEUE) {
            match descriptors.and_then(|d| read_packet(mem, &d, MAX_PAYLOAD)) {
                Ok((header, payload)) => self.muxer.handle_guest_packet(&header, &payload),
                Err(e) => refused(TX_QUEUE, head, &e),
            }
            if !Self::give_back(mem, queue, TX_QUEUE, head, 0) {
                break;
            }
            used_any = true;
        }
        used_any
    }

    fn fill_rx(&mut self, mem: &GuestMemoryMmap, queue: &mut Queue) -> bool {
        let mut used_any = false;
        while self.muxer.has_rx() {
            let Some((head, descriptors)) = self.pop_chain(mem, queue, RX_QUEUE) else {
                break;
            };
            let checked =
                descriptors.and_then(|d| rx_capacity(mem, &d).map(|capacity| (d, capacity)));
            let written = match checked {
                Err(e) => {
                    refused(RX_QUEUE, head, &e);
                    0
                }
                Ok((descriptors, capacity)) => {
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
                                        "virtio-vsock: RX queue: cannot write chain at head {head}: {e}"
                                    );
                                    0
                                }
                            }
                        }
                    }
                }
            };
            if !Self::give_back(mem, queue, RX_QUEUE, head, written) {
                break;
            }
            used_any = true;
        }
        used_any
    }

    /// Pops event buffers until one can take an event and returns its head and address; the
    /// others go back to the guest unused, with one log line each. The flag says whether any
    /// went back.
    fn pop_event_buffer(
        &mut self,
        mem: &GuestMemoryMmap,
        queue: &mut Queue,
    ) -> (Option<(u16, GuestAddress)>, bool) {
        let mut returned = false;
        while let Some((head, descriptors)) = self.pop_chain(mem, queue, EVENT_QUEUE) {
            match descriptors.and_then(|d| event_target(mem, &d)) {
                Ok(addr) => return (Some((head, addr)), returned),
                Err(e) => {
                    refused(EVENT_QUEUE, head, &e);
                    if !Self::give_back(mem, queue, EVENT_QUEUE, head, 0) {
                        break;
                    }
                    returned = true;
                }
            }
        }
        (None, returned)
    }

    /// The driver posted event buffers: unusable ones are refused now rather than at the
    /// next event; the first usable one stays posted.
    fn check_event_buffers(&mut self, ctx: &mut QueueContext<'_>) {
        let mem = ctx.mem;
        let Some(queue) = ctx.queues.get_mut(EVENT_QUEUE) else {
            return;
        };
        let (usable, returned) = self.pop_event_buffer(mem, queue);
        if usable.is_some() {
            queue.go_to_previous_position();
        }
        if returned {
            ctx.interrupt.signal_used_ring();
        }
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
        if self.stalled.contains(&true) {
            ctx.interrupt.signal_needs_reset();
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
        let (dropped, refused) = (self.muxer.dropped_control(), self.muxer.refused_conns());
        if dropped > 0 || refused > 0 {
            log::info!(
                "virtio-vsock: reset; so far {dropped} control packets dropped (no RX buffers), {refused} connections refused (limit)"
            );
        }
        self.muxer.reset();
        self.stalled = [false; 3];
    }

    fn process_queue(&mut self, queue: usize, ctx: &mut QueueContext<'_>) {
        if queue == EVENT_QUEUE {
            self.check_event_buffers(ctx);
        }
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

    /// Connections did not survive the snapshot: tell the guest with a TRANSPORT_RESET event,
    /// after which its listening sockets keep working.
    fn after_restore(&mut self, ctx: &mut QueueContext<'_>) {
        self.muxer.reset();
        let mem = ctx.mem;
        let Some(queue) = ctx.queues.get_mut(EVENT_QUEUE) else {
            return;
        };
        let (usable, mut used_any) = self.pop_event_buffer(mem, queue);
        match usable {
            None => log::warn!("virtio-vsock: event queue: no usable buffer for TRANSPORT_RESET"),
            Some((head, addr)) => {
                let written = match vm_memory::Bytes::write_obj(mem, EVENT_TRANSPORT_RESET, addr) {
                    Ok(()) => EVENT_LEN,
                    Err(e) => {
                        log::warn!("virtio-vsock: event queue: cannot write TRANSPORT_RESET: {e}");
                        0
                    }
                };
                used_any |= Self::give_back(mem, queue, EVENT_QUEUE, head, written);
            }
        }
        if used_any {
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

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::sync::Arc;

    use virtio_queue::desc::split::Descriptor;
    use vm_memory::Bytes;
    use vmm_sys_util::eventfd::EventFd;

    use super::*;
    use crate::devices::virtio::vsock::packet::{op, PacketHeader, TYPE_STREAM};
    use crate::devices::virtio::Interrupt;

    const GUEST_CID: u64 = 3;
    const SIZE: u16 = 16;
    const F_NEXT: u16 = 1;
    const F_WRITE: u16 = 2;
    /// Packet and event buffers start here.
    const BUFFERS: u64 = 0x8_0000;

    thread_local! {
        static LOG: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
    }

    /// Records this thread's warnings and errors, so a test sees its own log lines.
    struct Capture;

    impl log::Log for Capture {
        fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
            metadata.level() <= log::Level::Warn
        }
        fn log(&self, record: &log::Record<'_>) {
            if self.enabled(record.metadata()) {
                let line = format!("[{}] {}", record.level(), record.args());
                LOG.with(|log| log.borrow_mut().push(line));
            }
        }
        fn flush(&self) {}
    }

    static CAPTURE: Capture = Capture;

    /// The log lines recorded on this thread since the last call.
    fn take_log() -> Vec<String> {
        if log::set_logger(&CAPTURE).is_ok() {
            log::set_max_level(log::LevelFilter::Warn);
        }
        LOG.with(|log| std::mem::take(&mut *log.borrow_mut()))
    }

    /// A descriptor: address, length, flags, next.
    type Desc = (u64, u32, u16, u16);

    /// A vsock device on 1 MiB of guest memory with its three queues ready.
    struct Rig {
        _dir: tempfile::TempDir,
        mem: GuestMemoryMmap,
        queues: Vec<Queue>,
        interrupt: Interrupt,
        device: Vsock,
    }

    fn ring_base(queue: usize) -> u64 {
        0x1_0000 * (queue as u64 + 1)
    }

    impl Rig {
        fn new() -> Rig {
            take_log();
            let dir = tempfile::tempdir().expect("tempdir");
            let device = Vsock::new(GUEST_CID, &dir.path().join("v.sock")).expect("vsock");
            let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).expect("mem");
            let queues = (0..3)
                .map(|i| {
                    let mut q = Queue::new(QUEUE_SIZE).expect("queue");
                    let base = ring_base(i);
                    q.set_size(SIZE);
                    q.set_desc_table_address(Some(base as u32), Some(0));
                    q.set_avail_ring_address(Some(base as u32 + 0x1000), Some(0));
                    q.set_used_ring_address(Some(base as u32 + 0x2000), Some(0));
                    q.set_ready(true);
                    assert!(q.is_valid(&mem));
                    q
                })
                .collect();
            let irq = EventFd::new(libc::EFD_NONBLOCK).expect("eventfd");
            Rig {
                _dir: dir,
                mem,
                queues,
                interrupt: Interrupt::new(Arc::new(irq)),
                device,
            }
        }

        fn desc(&self, queue: usize, index: u16, addr: u64, len: u32, flags: u16, next: u16) {
            let at = GuestAddress(ring_base(queue) + 16 * u64::from(index));
            self.mem
                .write_obj(Descriptor::new(addr, len, flags, next), at)
                .expect("descriptor");
        }

        /// Publishes `head` at avail ring slot `slot` and sets avail.idx to `idx`.
        fn publish(&self, queue: usize, slot: u16, head: u16, idx: u16) {
            let avail = ring_base(queue) + 0x1000;
            let entry = GuestAddress(avail + 4 + 2 * u64::from(slot % SIZE));
            self.mem.write_obj(head, entry).expect("avail entry");
            self.mem
                .write_obj(idx, GuestAddress(avail + 2))
                .expect("avail idx");
        }

        /// The used ring's elements: (head, bytes written).
        fn used(&self, queue: usize) -> Vec<(u32, u32)> {
            let used = ring_base(queue) + 0x2000;
            let idx: u16 = self.mem.read_obj(GuestAddress(used + 2)).expect("used idx");
            (0..u64::from(idx))
                .map(|i| {
                    let at = used + 4 + 8 * (i % u64::from(SIZE));
                    let id: u32 = self.mem.read_obj(GuestAddress(at)).expect("id");
                    let len: u32 = self.mem.read_obj(GuestAddress(at + 4)).expect("len");
                    (id, len)
                })
                .collect()
        }

        fn notify(&mut self, queue: usize) {
            let mut ctx = QueueContext {
                mem: &self.mem,
                queues: &mut self.queues,
                interrupt: &self.interrupt,
            };
            self.device.process_queue(queue, &mut ctx);
        }

        fn after_restore(&mut self) {
            let mut ctx = QueueContext {
                mem: &self.mem,
                queues: &mut self.queues,
                interrupt: &self.interrupt,
            };
            self.device.after_restore(&mut ctx);
        }

        /// A packet header from the guest to the host at `addr`.
        fn header(&self, addr: u64, op: u16, len: u32) {
            let h = PacketHeader {
                src_cid: GUEST_CID,
                dst_cid: 2,
                src_port: 1000,
                dst_port: 2000,
                len,
                type_: TYPE_STREAM,
                op,
                ..PacketHeader::default()
            };
            self.mem
                .write_slice(&h.to_bytes(), GuestAddress(addr))
                .expect("header");
        }
    }

    /// One log line, from the device, naming `queue` and containing `problem`.
    fn assert_one_refusal(queue: &str, problem: &str) {
        let log = take_log();
        assert!(
            log.len() == 1
                && log[0].starts_with(&format!("[WARN] virtio-vsock: {queue} queue: "))
                && log[0].contains(problem),
            "want one {queue}-queue line saying {problem:?}, got {log:#?}"
        );
    }

    #[test]
    fn runaway_available_index_stalls_the_queue_with_one_log_line() {
        let mut rig = Rig::new();
        rig.header(BUFFERS, op::RW, 0);
        rig.desc(TX_QUEUE, 0, BUFFERS, HEADER_LEN as u32, 0, 0);
        rig.publish(TX_QUEUE, 0, 0, SIZE + 3);
        rig.notify(TX_QUEUE);
        rig.notify(TX_QUEUE);
        rig.notify(RX_QUEUE);
        assert_one_refusal("TX", "more than the queue size 16 ahead of 0");
        assert!(rig.used(TX_QUEUE).is_empty());
        // A reset lifts the stall.
        rig.device.reset();
        rig.notify(TX_QUEUE);
        assert_one_refusal("TX", "more than the queue size");
    }

    #[test]
    fn read_only_event_buffer_is_refused_when_posted() {
        let mut rig = Rig::new();
        rig.desc(EVENT_QUEUE, 0, BUFFERS, EVENT_LEN, 0, 0);
        rig.desc(EVENT_QUEUE, 1, BUFFERS + 0x100, EVENT_LEN, F_WRITE, 0);
        rig.publish(EVENT_QUEUE, 0, 0, 1);
        rig.publish(EVENT_QUEUE, 1, 1, 2);
        rig.notify(EVENT_QUEUE);
        assert_one_refusal("event", "is device-readable");
        // The refused buffer went back unused; the good one stays for the next event.
        assert_eq!(rig.used(EVENT_QUEUE), vec![(0, 0)]);
        assert_eq!(rig.queues[EVENT_QUEUE].next_avail(), 1);
        assert_ne!(rig.interrupt.status(), 0);
    }

    #[test]
    fn transport_reset_skips_unusable_event_buffers() {
        let mut rig = Rig::new();
        let target = BUFFERS + 0x100;
        rig.mem
            .write_obj(0xffff_ffffu32, GuestAddress(target))
            .expect("fill");
        rig.desc(EVENT_QUEUE, 0, BUFFERS, 2, F_WRITE, 0);
        rig.desc(EVENT_QUEUE, 1, target, EVENT_LEN, F_WRITE, 0);
        rig.publish(EVENT_QUEUE, 0, 0, 1);
        rig.publish(EVENT_QUEUE, 1, 1, 2);
        rig.after_restore();
        assert_one_refusal(
            "event",
            "event buffer of 2 bytes cannot take a 4-byte event",
        );
        assert_eq!(rig.used(EVENT_QUEUE), vec![(0, 0), (1, EVENT_LEN)]);
        let event: u32 = rig.mem.read_obj(GuestAddress(target)).expect("event");
        assert_eq!(event, EVENT_TRANSPORT_RESET);
    }

    #[test]
    fn bad_tx_chains_are_refused_by_name_and_later_packets_still_served() {
        let mut rig = Rig::new();
        let hdr = BUFFERS;
        let data = BUFFERS + 0x1000;
        rig.header(hdr, op::RW, 16);
        // Each case: descriptors (address, length, flags, next) from 0, and the problem.
        let cases: [(&[Desc], &str); 5] = [
            (
                &[(hdr, 44, F_WRITE | F_NEXT, 1), (data, 16, 0, 0)],
                "is device-writable; this queue takes device-readable buffers",
            ),
            (
                &[(hdr, 44, F_NEXT, 1), (data, 16, F_NEXT, SIZE + 5)],
                "next index 21, beyond the queue of 16",
            ),
            (
                &[(hdr, 44, F_NEXT, 1), (data, 16, F_NEXT, 0)],
                "it loops after 2 descriptor(s), descriptor 1 linking back to descriptor 0",
            ),
            (
                &[(hdr, 44, F_NEXT, 1), (1 << 40, 16, 0, 0)],
                "lies outside guest memory",
            ),
            (
                &[(hdr, 16, 0, 0)],
                "16 bytes are too few for the 44-byte packet header",
            ),
        ];
        for (n, (chain, problem)) in cases.iter().enumerate() {
            for (i, &(addr, len, flags, next)) in chain.iter().enumerate() {
                rig.desc(TX_QUEUE, i as u16, addr, len, flags, next);
            }
            rig.publish(TX_QUEUE, n as u16, 0, n as u16 + 1);
            rig.notify(TX_QUEUE);
            assert_one_refusal("TX", problem);
        }
        assert_eq!(rig.used(TX_QUEUE).len(), cases.len());

        // A good packet still gets its answer: CREDIT_REQUEST for no connection → RST.
        rig.desc(RX_QUEUE, 0, BUFFERS + 0x2000, 4096, F_WRITE, 0);
        rig.publish(RX_QUEUE, 0, 0, 1);
        rig.header(hdr, op::CREDIT_REQUEST, 0);
        rig.desc(TX_QUEUE, 0, hdr, 44, 0, 0);
        rig.publish(TX_QUEUE, 5, 0, 6);
        rig.notify(TX_QUEUE);
        assert_eq!(take_log(), Vec::<String>::new());
        assert_eq!(rig.used(RX_QUEUE), vec![(0, HEADER_LEN as u32)]);
        let mut reply = [0u8; HEADER_LEN];
        rig.mem
            .read_slice(&mut reply, GuestAddress(BUFFERS + 0x2000))
            .expect("reply");
        assert_eq!(PacketHeader::from_bytes(&reply).op, op::RST);
    }

    #[test]
    fn bad_rx_buffers_are_refused_and_the_packet_waits_for_a_good_one() {
        let mut rig = Rig::new();
        rig.desc(RX_QUEUE, 0, BUFFERS + 0x2000, 44, F_WRITE | F_NEXT, 1);
        rig.desc(RX_QUEUE, 1, BUFFERS + 0x3000, 4096, 0, 0);
        rig.desc(RX_QUEUE, 2, BUFFERS + 0x4000, 16, F_WRITE, 0);
        rig.desc(RX_QUEUE, 3, BUFFERS + 0x5000, 4096, F_WRITE, 0);
        rig.publish(RX_QUEUE, 0, 0, 1);
        rig.publish(RX_QUEUE, 1, 2, 2);
        rig.publish(RX_QUEUE, 2, 3, 3);
        rig.header(BUFFERS, op::CREDIT_REQUEST, 0);
        rig.desc(TX_QUEUE, 0, BUFFERS, 44, 0, 0);
        rig.publish(TX_QUEUE, 0, 0, 1);
        rig.notify(TX_QUEUE);
        let log = take_log();
        assert_eq!(log.len(), 2, "{log:#?}");
        assert!(log[0].contains("RX queue: refused chain at head 0: descriptor"));
        assert!(log[0].contains("is device-readable; this queue takes device-writable buffers"));
        assert!(log[1].contains("RX queue: refused chain at head 2: 16 bytes are too few"));
        assert_eq!(
            rig.used(RX_QUEUE),
            vec![(0, 0), (2, 0), (3, HEADER_LEN as u32)]
        );
    }
}
