//! Polled virtio-vsock driver: stream sockets with credit-based flow control, an echo
//! server on listened ports, and a client that dials the host (CID 2).

use crate::io::{pause, Deadline};
use crate::virtio::{
    Buf, Hostile, Queue, RingPage, Transport, DESC_F_NEXT, DESC_F_WRITE,
};

pub const DEVICE_ID: u32 = 19;
pub const HOST_CID: u64 = 2;
const HDR: usize = 44;
/// Payload bytes per rx/tx buffer, and each connection's receive buffer (its buf_alloc).
pub const BUF: usize = 4096;
const SLOTS: usize = 8;
const MAX_CONNS: usize = 8;
const MAX_LISTEN: usize = 8;
const TX_WAIT_MS: u64 = 1000;
const CLOSE_WAIT_MS: u64 = 1000;

const TYPE_STREAM: u16 = 1;
const OP_REQUEST: u16 = 1;
const OP_RESPONSE: u16 = 2;
const OP_RST: u16 = 3;
const OP_SHUTDOWN: u16 = 4;
const OP_RW: u16 = 5;
const OP_CREDIT_UPDATE: u16 = 6;
const OP_CREDIT_REQUEST: u16 = 7;
const SHUTDOWN_BOTH: u32 = 3;
const EVENT_TRANSPORT_RESET: u32 = 0;

/// Both ports of the packets `vsock-hostile` sends; no connection uses them.
const HOSTILE_PORT: u32 = 2989;
/// Payload bytes the hostile TX chains carry.
const HOSTILE_PAYLOAD: u32 = 16;
/// What a `shortlen` header claims: more than `HOSTILE_PAYLOAD`.
const HOSTILE_CLAIMED: u32 = 100;
/// Size of a too-short header or RX buffer: less than `HDR`.
const HOSTILE_SHORT: u32 = 16;
/// Packets a `flood-*` kind sends, with no RX buffer posted for the answers.
const FLOOD_PACKETS: u32 = 3000;
/// The first guest port of a flood; each packet uses the next.
const FLOOD_FIRST_PORT: u32 = 40000;
/// The host port `flood-connect` connects to.
pub const FLOOD_HOST_PORT: u32 = 5000;
/// An operation no vsock packet has.
const OP_BOGUS: u16 = 99;

const RX_QUEUE: usize = 0;
const TX_QUEUE: usize = 1;
const EVENT_QUEUE: usize = 2;

/// Buffers shared with the device: rings, rx and tx packet buffers, event buffers.
#[repr(C, align(4096))]
pub struct VsockDma {
    rings: [RingPage; 3],
    rx: PacketBuffers,
    tx: PacketBuffers,
    events: [[u8; 8]; SLOTS],
}

struct PacketBuffers {
    data: [[u8; BUF]; SLOTS],
    hdr: [[u8; 64]; SLOTS],
}

impl VsockDma {
    pub const ZERO: VsockDma = VsockDma {
        rings: [RingPage::ZERO, RingPage::ZERO, RingPage::ZERO],
        rx: PacketBuffers {
            data: [[0; BUF]; SLOTS],
            hdr: [[0; 64]; SLOTS],
        },
        tx: PacketBuffers {
            data: [[0; BUF]; SLOTS],
            hdr: [[0; 64]; SLOTS],
        },
        events: [[0; 8]; SLOTS],
    };
}

#[derive(Clone, Copy, Default)]
struct Header {
    src_cid: u64,
    dst_cid: u64,
    src_port: u32,
    dst_port: u32,
    len: u32,
    kind: u16,
    op: u16,
    flags: u32,
    buf_alloc: u32,
    fwd_cnt: u32,
}

fn le16(b: &[u8; 64], at: usize) -> u16 {
    u16::from_le_bytes([b[at & 63], b[(at + 1) & 63]])
}
fn le32(b: &[u8; 64], at: usize) -> u32 {
    u32::from_le_bytes([
        b[at & 63],
        b[(at + 1) & 63],
        b[(at + 2) & 63],
        b[(at + 3) & 63],
    ])
}
fn le64(b: &[u8; 64], at: usize) -> u64 {
    le32(b, at) as u64 | (le32(b, at + 4) as u64) << 32
}

impl Header {
    fn decode(b: &[u8; 64]) -> Header {
        Header {
            src_cid: le64(b, 0),
            dst_cid: le64(b, 8),
            src_port: le32(b, 16),
            dst_port: le32(b, 20),
            len: le32(b, 24),
            kind: le16(b, 28),
            op: le16(b, 30),
            flags: le32(b, 32),
            buf_alloc: le32(b, 36),
            fwd_cnt: le32(b, 40),
        }
    }

    fn encode(&self, b: &mut [u8; 64]) {
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.kind.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    Free,
    Connecting,
    Established,
    /// We sent SHUTDOWN and wait for the peer's RST until the deadline.
    Closing,
    /// The peer reset or shut down a client connection; the slot keeps what was
    /// received until `connect_line` has collected it.
    PeerClosed,
}

struct Conn {
    state: State,
    client: bool,
    local_port: u32,
    peer_port: u32,
    peer_cid: u64,
    peer_buf_alloc: u32,
    peer_fwd_cnt: u32,
    /// Bytes sent to the peer.
    tx_cnt: u32,
    /// Bytes taken out of `buf` (echoed, or consumed by the client).
    fwd_cnt: u32,
    credit_requested: bool,
    close_deadline: u64,
    /// Received, not yet consumed bytes.
    buf: [u8; BUF],
    len: usize,
}

impl Conn {
    const FREE: Conn = Conn {
        state: State::Free,
        client: false,
        local_port: 0,
        peer_port: 0,
        peer_cid: 0,
        peer_buf_alloc: 0,
        peer_fwd_cnt: 0,
        tx_cnt: 0,
        fwd_cnt: 0,
        credit_requested: false,
        close_deadline: 0,
        buf: [0; BUF],
        len: 0,
    };

    /// Bytes the peer can still take.
    fn peer_credit(&self) -> u32 {
        self.peer_buf_alloc
            .saturating_sub(self.tx_cnt.wrapping_sub(self.peer_fwd_cnt))
    }

    /// Drops the first `n` buffered bytes; `received` says they came from the peer,
    /// so freeing them gives the peer credit (fwd_cnt).
    fn consume(&mut self, n: usize, received: bool) {
        let end = self.len.min(BUF);
        let n = n.min(end);
        self.buf.copy_within(n..end, 0);
        self.len = end - n;
        if received {
            self.fwd_cnt = self.fwd_cnt.wrapping_add(n as u32);
        }
    }
}

pub struct Vsock {
    transport: Transport,
    ready: bool,
    pub cid: u64,
    queues: [Queue; 3],
    rx_slots: u16,
    tx_slots: u16,
    event_slots: u16,
    tx_busy: [bool; SLOTS],
    conns: [Conn; MAX_CONNS],
    listening: [u32; MAX_LISTEN],
    listen_count: usize,
    next_port: u32,
    tpm: u64,
}

/// The malformed chains of `vsock-hostile`.
#[derive(Clone, Copy)]
pub enum VsockHostile {
    /// The shared kinds (oob, loop, long, dir, badnext, badavail) on the TX queue.
    Tx(Hostile),
    /// A TX header whose len claims more payload than the chain carries.
    ShortLen,
    /// A TX chain shorter than a packet header.
    ShortHdr,
    /// An RX buffer whose payload part is device-readable.
    RxDir,
    /// An RX buffer shorter than a packet header.
    RxSmall,
    /// A device-readable event buffer.
    EvDir,
    /// Data and unknown operations for connections that do not exist, every answer left
    /// waiting: no RX buffer is posted (the next vsock command sets the device up afresh).
    FloodBogus,
    /// Connection requests to host port `FLOOD_HOST_PORT` from as many guest ports, with no
    /// RX buffer posted for the answers.
    FloodConnect,
}

impl VsockHostile {
    pub fn parse(word: &[u8]) -> Option<VsockHostile> {
        if let Some(kind) = Hostile::parse(word) {
            return Some(VsockHostile::Tx(kind));
        }
        Some(match word {
            b"shortlen" => VsockHostile::ShortLen,
            b"shorthdr" => VsockHostile::ShortHdr,
            b"rxdir" => VsockHostile::RxDir,
            b"rxsmall" => VsockHostile::RxSmall,
            b"evdir" => VsockHostile::EvDir,
            b"flood-bogus" => VsockHostile::FloodBogus,
            b"flood-connect" => VsockHostile::FloodConnect,
            _ => return None,
        })
    }
}

pub enum ConnectError {
    NoFreeConnection,
    Refused,
    Timeout,
    Send(&'static str),
}

impl Vsock {
    pub const fn new(base: usize) -> Vsock {
        Vsock {
            transport: Transport { base },
            ready: false,
            cid: 0,
            queues: [Queue::empty(), Queue::empty(), Queue::empty()],
            rx_slots: 0,
            tx_slots: 0,
            event_slots: 0,
            tx_busy: [false; SLOTS],
            conns: [Conn::FREE; MAX_CONNS],
            listening: [0; MAX_LISTEN],
            listen_count: 0,
            next_port: 49152,
            tpm: 0,
        }
    }

    /// The guest CID from config space (u64 at offset 0).
    pub fn read_cid(&self) -> u64 {
        self.transport.config_u64(0)
    }

    pub fn ensure_ready(&mut self, dma: &mut VsockDma, tpm: u64) -> Result<(), &'static str> {
        if self.ready {
            return Ok(());
        }
        self.start(dma, tpm, true, true)?;
        self.ready = true;
        Ok(())
    }

    /// Resets and sets up the device, posting rx and event buffers when asked. The reset
    /// drops every connection; listening ports stay.
    fn start(
        &mut self,
        dma: &mut VsockDma,
        tpm: u64,
        rx_buffers: bool,
        event_buffers: bool,
    ) -> Result<(), &'static str> {
        self.tpm = tpm;
        let [rx, tx, ev] = &mut self.queues;
        let [r0, r1, r2] = &mut dma.rings;
        self.transport
            .begin_init(tpm, DEVICE_ID, 0, &mut [rx, tx, ev], &mut [r0, r1, r2])?;
        self.cid = self.read_cid();
        self.rx_slots = (self.queues[RX_QUEUE].size / 2).min(SLOTS as u16);
        self.tx_slots = (self.queues[TX_QUEUE].size / 2).min(SLOTS as u16);
        self.event_slots = self.queues[EVENT_QUEUE].size.min(SLOTS as u16);
        if self.rx_slots == 0 || self.tx_slots == 0 {
            return Err("queue-too-small");
        }
        self.tx_busy = [false; SLOTS];
        self.drop_connections();
        if rx_buffers {
            for slot in 0..self.rx_slots {
                self.post_rx(&dma.rx, slot);
            }
        }
        if event_buffers {
            for slot in 0..self.event_slots {
                self.post_event(&dma.events, slot);
            }
        }
        self.transport.finish_init()?;
        self.transport.notify(&self.queues[RX_QUEUE]);
        self.transport.notify(&self.queues[EVENT_QUEUE]);
        Ok(())
    }

    fn drop_connections(&mut self) {
        for conn in self.conns.iter_mut() {
            conn.state = State::Free;
            conn.len = 0;
        }
    }

    /// Sets the device up afresh, posts a malformed chain and notifies, gives the device a
    /// moment, then resets it and sets it up again. The queue under test holds only the
    /// hostile chain. RX buffers are only used when the device has a packet to deliver, so
    /// for the RX kinds the guest sends one that the host answers (CREDIT_REQUEST for a
    /// connection that does not exist: RST).
    pub fn hostile(
        &mut self,
        dma: &mut VsockDma,
        tpm: u64,
        kind: VsockHostile,
        beyond_memory: u64,
    ) -> Result<(), &'static str> {
        self.ready = false;
        if let VsockHostile::FloodBogus | VsockHostile::FloodConnect = kind {
            return self.flood(dma, tpm, kind);
        }
        let rx_buffers = !matches!(kind, VsockHostile::RxDir | VsockHostile::RxSmall);
        let event_buffers = !matches!(kind, VsockHostile::EvDir);
        self.start(dma, tpm, rx_buffers, event_buffers)?;
        let mut hdr = Header {
            src_cid: self.cid,
            dst_cid: HOST_CID,
            src_port: HOSTILE_PORT,
            dst_port: HOSTILE_PORT,
            len: HOSTILE_PAYLOAD,
            kind: TYPE_STREAM,
            op: OP_RW,
            buf_alloc: BUF as u32,
            ..Header::default()
        };
        if let VsockHostile::ShortLen = kind {
            hdr.len = HOSTILE_CLAIMED;
        }
        hdr.encode(&mut dma.tx.hdr[0]);
        let buf = |addr: *const u8, len: u32, writable| Buf {
            addr: addr as u64,
            len,
            writable,
        };
        let tx_hdr = buf(dma.tx.hdr[0].as_ptr(), HDR as u32, false);
        let tx_data = buf(dma.tx.data[0].as_ptr(), HOSTILE_PAYLOAD, false);
        let queue = match kind {
            VsockHostile::Tx(_)
            | VsockHostile::ShortLen
            | VsockHostile::ShortHdr
            | VsockHostile::FloodBogus
            | VsockHostile::FloodConnect => TX_QUEUE,
            VsockHostile::RxDir | VsockHostile::RxSmall => RX_QUEUE,
            VsockHostile::EvDir => EVENT_QUEUE,
        };
        let q = &mut self.queues[queue];
        match kind {
            VsockHostile::Tx(Hostile::OutOfBounds) => {
                let beyond = Buf {
                    addr: beyond_memory,
                    len: HOSTILE_PAYLOAD,
                    writable: false,
                };
                q.set_chain(&[tx_hdr, beyond]);
                q.push(0);
            }
            VsockHostile::Tx(k @ (Hostile::Loop | Hostile::Long | Hostile::BadNext)) => {
                q.set_unterminated_chain(k, tx_hdr, tx_data);
                q.push(0);
            }
            VsockHostile::Tx(Hostile::WrongDirection) => {
                q.set_chain(&[buf(dma.tx.hdr[0].as_ptr(), HDR as u32, true), tx_data]);
                q.push(0);
            }
            VsockHostile::Tx(Hostile::BadAvail) => {
                q.set_chain(&[tx_hdr, tx_data]);
                q.push_jumped(0);
            }
            VsockHostile::ShortLen => {
                q.set_chain(&[tx_hdr, tx_data]);
                q.push(0);
            }
            VsockHostile::ShortHdr => {
                q.set_chain(&[buf(dma.tx.hdr[0].as_ptr(), HOSTILE_SHORT, false)]);
                q.push(0);
            }
            VsockHostile::RxDir => {
                q.set_chain(&[
                    buf(dma.rx.hdr[0].as_ptr(), HDR as u32, true),
                    buf(dma.rx.data[0].as_ptr(), BUF as u32, false),
                ]);
                q.push(0);
            }
            VsockHostile::RxSmall => {
                q.set_chain(&[buf(dma.rx.hdr[0].as_ptr(), HOSTILE_SHORT, true)]);
                q.push(0);
            }
            VsockHostile::EvDir => {
                q.set_chain(&[buf(dma.events[0].as_ptr(), 4, false)]);
                q.push(0);
            }
            // Served by `flood` above.
            VsockHostile::FloodBogus | VsockHostile::FloodConnect => {}
        }
        self.transport.notify(&self.queues[queue]);
        if queue == RX_QUEUE {
            let answered = Header {
                dst_cid: HOST_CID,
                src_port: HOSTILE_PORT,
                dst_port: HOSTILE_PORT,
                op: OP_CREDIT_REQUEST,
                buf_alloc: BUF as u32,
                ..Header::default()
            };
            self.send(&mut dma.tx, answered)?;
        }
        if let VsockHostile::Tx(Hostile::BadAvail) = kind {
            // A stalled queue returns nothing: the device asks for a reset instead.
            self.transport.wait_hostile_met(&mut self.queues[queue], tpm)?;
        } else {
            // The device returns a refused chain: wait for that instead of a fixed time.
            let deadline = Deadline::after_ms(tpm, TX_WAIT_MS);
            while self.queues[queue].pop_used().is_none() {
                if deadline.passed() {
                    return Err("hostile-chain-not-returned");
                }
                pause();
            }
        }
        self.ensure_ready(dma, tpm)
    }

    /// Sends `FLOOD_PACKETS` packets whose answers have no RX buffer to go to, and leaves the
    /// device so: the next vsock command sets it up afresh.
    fn flood(
        &mut self,
        dma: &mut VsockDma,
        tpm: u64,
        kind: VsockHostile,
    ) -> Result<(), &'static str> {
        self.start(dma, tpm, false, true)?;
        let connect = matches!(kind, VsockHostile::FloodConnect);
        for i in 0..FLOOD_PACKETS {
            let (dst_port, op) = match (connect, i % 2) {
                (true, _) => (FLOOD_HOST_PORT, OP_REQUEST),
                (false, 0) => (HOSTILE_PORT, OP_RW),
                (false, _) => (HOSTILE_PORT, OP_BOGUS),
            };
            let hdr = Header {
                dst_cid: HOST_CID,
                src_port: FLOOD_FIRST_PORT + i,
                dst_port,
                op,
                buf_alloc: BUF as u32,
                ..Header::default()
            };
            self.send(&mut dma.tx, hdr)?;
        }
        Ok(())
    }

    fn post_rx(&mut self, rx: &PacketBuffers, slot: u16) {
        let i = slot as usize % SLOTS;
        let q = &mut self.queues[RX_QUEUE];
        q.set_desc(
            2 * slot,
            rx.hdr[i].as_ptr() as u64,
            HDR as u32,
            DESC_F_NEXT | DESC_F_WRITE,
            2 * slot + 1,
        );
        q.set_desc(
            2 * slot + 1,
            rx.data[i].as_ptr() as u64,
            BUF as u32,
            DESC_F_WRITE,
            0,
        );
        q.push(2 * slot);
    }

    fn post_event(&mut self, events: &[[u8; 8]; SLOTS], slot: u16) {
        let i = slot as usize % SLOTS;
        let q = &mut self.queues[EVENT_QUEUE];
        q.set_desc(slot, events[i].as_ptr() as u64, 4, DESC_F_WRITE, 0);
        q.push(slot);
    }

    pub fn listen(&mut self, port: u32) -> Result<(), &'static str> {
        if self
            .listening
            .iter()
            .take(self.listen_count)
            .any(|&p| p == port)
        {
            return Ok(());
        }
        match self.listening.get_mut(self.listen_count) {
            Some(slot) => {
                *slot = port;
                self.listen_count += 1;
                Ok(())
            }
            None => Err("too-many-listening-ports"),
        }
    }

    fn is_listening(&self, port: u32) -> bool {
        self.listening
            .iter()
            .take(self.listen_count)
            .any(|&p| p == port)
    }

    /// Takes back the tx buffers the device has finished with.
    fn reclaim_tx(&mut self) {
        while let Some((id, _)) = self.queues[TX_QUEUE].pop_used() {
            if let Some(busy) = self.tx_busy.get_mut(id as usize / 2) {
                *busy = false;
            }
        }
    }

    /// A free tx buffer; waits up to TX_WAIT_MS for the device to return one.
    fn acquire_tx(&mut self) -> Result<usize, &'static str> {
        let deadline = Deadline::after_ms(self.tpm, TX_WAIT_MS);
        loop {
            self.reclaim_tx();
            if let Some(free) = self
                .tx_busy
                .iter()
                .take(self.tx_slots as usize)
                .position(|&b| !b)
            {
                return Ok(free % SLOTS);
            }
            if deadline.passed() {
                return Err("tx-queue-full");
            }
            pause();
        }
    }

    /// Sends tx buffer `slot` with `len` payload bytes already in place.
    fn submit_tx(&mut self, tx: &mut PacketBuffers, slot: usize, mut hdr: Header, len: usize) {
        let len = len.min(BUF);
        hdr.len = len as u32;
        hdr.kind = TYPE_STREAM;
        hdr.src_cid = self.cid;
        let i = slot % SLOTS;
        hdr.encode(&mut tx.hdr[i]);
        let head = 2 * i as u16;
        let q = &mut self.queues[TX_QUEUE];
        if len == 0 {
            q.set_desc(head, tx.hdr[i].as_ptr() as u64, HDR as u32, 0, 0);
        } else {
            q.set_desc(
                head,
                tx.hdr[i].as_ptr() as u64,
                HDR as u32,
                DESC_F_NEXT,
                head + 1,
            );
            q.set_desc(head + 1, tx.data[i].as_ptr() as u64, len as u32, 0, 0);
        }
        q.push(head);
        self.tx_busy[i] = true;
        self.transport.notify(&self.queues[TX_QUEUE]);
    }

    /// Sends one packet without payload.
    fn send(&mut self, tx: &mut PacketBuffers, hdr: Header) -> Result<(), &'static str> {
        let slot = self.acquire_tx()?;
        self.submit_tx(tx, slot, hdr, 0);
        Ok(())
    }

    /// A header from connection `c`, carrying its credit information.
    fn conn_header(&self, c: usize, op: u16, flags: u32) -> Header {
        let mut h = Header {
            op,
            flags,
            buf_alloc: BUF as u32,
            ..Header::default()
        };
        if let Some(conn) = self.conns.get(c) {
            h.dst_cid = conn.peer_cid;
            h.src_port = conn.local_port;
            h.dst_port = conn.peer_port;
            h.fwd_cnt = conn.fwd_cnt;
        }
        h
    }

    fn send_conn(
        &mut self,
        tx: &mut PacketBuffers,
        c: usize,
        op: u16,
        flags: u32,
    ) -> Result<(), &'static str> {
        let h = self.conn_header(c, op, flags);
        self.send(tx, h)
    }

    /// Answers a packet that matches no connection with RST.
    fn send_rst_reply(&mut self, tx: &mut PacketBuffers, to: &Header) {
        if to.op == OP_RST {
            return;
        }
        let h = Header {
            dst_cid: to.src_cid,
            src_port: to.dst_port,
            dst_port: to.src_port,
            op: OP_RST,
            ..Header::default()
        };
        let _ = self.send(tx, h);
    }

    fn find(&self, h: &Header) -> Option<usize> {
        self.conns.iter().position(|c| {
            c.state != State::Free
                && c.state != State::PeerClosed
                && c.local_port == h.dst_port
                && c.peer_port == h.src_port
                && c.peer_cid == h.src_cid
        })
    }

    fn free(&mut self, c: usize) {
        if let Some(conn) = self.conns.get_mut(c) {
            conn.state = State::Free;
            conn.len = 0;
        }
    }

    /// Serves the device: events, received packets, finished tx buffers, pending echoes
    /// and connections whose close timed out.
    pub fn poll(&mut self, dma: &mut VsockDma) {
        if !self.ready {
            return;
        }
        // Events first: a TRANSPORT_RESET must drop the connections that predate a restore,
        // not the ones the host opens right after it.
        let mut events = false;
        while let Some((id, _)) = self.queues[EVENT_QUEUE].pop_used() {
            let slot = id as u16 % self.event_slots.max(1);
            let e = &dma.events[slot as usize % SLOTS];
            if u32::from_le_bytes([e[0], e[1], e[2], e[3]]) == EVENT_TRANSPORT_RESET {
                // After a snapshot restore: connections are gone, listeners stay.
                self.drop_connections();
                self.cid = self.read_cid();
            }
            self.post_event(&dma.events, slot);
            events = true;
        }
        if events {
            self.transport.notify(&self.queues[EVENT_QUEUE]);
        }
        let mut reposted = false;
        while let Some((id, written)) = self.queues[RX_QUEUE].pop_used() {
            let slot = (id / 2) as u16 % self.rx_slots.max(1);
            let i = slot as usize % SLOTS;
            let hdr = Header::decode(&dma.rx.hdr[i]);
            let payload = (hdr.len as usize)
                .min(BUF)
                .min((written as usize).saturating_sub(HDR));
            let data = dma.rx.data[i].get(..payload).unwrap_or(&[]);
            self.handle(&mut dma.tx, &hdr, data);
            self.post_rx(&dma.rx, slot);
            reposted = true;
        }
        if reposted {
            self.transport.notify(&self.queues[RX_QUEUE]);
        }
        self.reclaim_tx();
        for c in 0..MAX_CONNS {
            let Some(conn) = self.conns.get(c) else {
                continue;
            };
            match conn.state {
                State::Established if !conn.client => self.flush_echo(&mut dma.tx, c),
                State::Closing if Deadline::at(conn.close_deadline).passed() => {
                    let _ = self.send_conn(&mut dma.tx, c, OP_RST, 0);
                    self.free(c);
                }
                _ => {}
            }
        }
    }

    fn handle(&mut self, tx: &mut PacketBuffers, h: &Header, data: &[u8]) {
        if h.kind != TYPE_STREAM {
            self.send_rst_reply(tx, h);
            return;
        }
        let Some(c) = self.find(h) else {
            if h.op == OP_REQUEST && self.is_listening(h.dst_port) {
                self.accept(tx, h);
            } else {
                self.send_rst_reply(tx, h);
            }
            return;
        };
        let Some(conn) = self.conns.get_mut(c) else {
            return;
        };
        conn.peer_buf_alloc = h.buf_alloc;
        conn.peer_fwd_cnt = h.fwd_cnt;
        conn.credit_requested = false;
        let client = conn.client;
        match h.op {
            OP_RESPONSE if conn.state == State::Connecting => conn.state = State::Established,
            OP_RST => self.closed_by_peer(c, client),
            OP_SHUTDOWN => {
                // The guest keeps no half-closed streams: it answers with RST.
                let _ = self.send_conn(tx, c, OP_RST, 0);
                self.closed_by_peer(c, client);
            }
            OP_RW if conn.state == State::Established => {
                let room = BUF - conn.len.min(BUF);
                let n = data.len().min(room);
                if let (Some(dst), Some(src)) =
                    (conn.buf.get_mut(conn.len..conn.len + n), data.get(..n))
                {
                    dst.copy_from_slice(src);
                    conn.len += n;
                }
                if !client {
                    self.flush_echo(tx, c);
                }
            }
            OP_RW | OP_CREDIT_UPDATE if !client => self.flush_echo(tx, c),
            OP_CREDIT_REQUEST => {
                let _ = self.send_conn(tx, c, OP_CREDIT_UPDATE, 0);
            }
            OP_REQUEST | OP_RESPONSE => {
                let _ = self.send_conn(tx, c, OP_RST, 0);
                self.closed_by_peer(c, client);
            }
            _ => {}
        }
    }

    fn accept(&mut self, tx: &mut PacketBuffers, h: &Header) {
        let Some(c) = self.conns.iter().position(|c| c.state == State::Free) else {
            self.send_rst_reply(tx, h);
            return;
        };
        if let Some(conn) = self.conns.get_mut(c) {
            conn.state = State::Established;
            conn.client = false;
            conn.local_port = h.dst_port;
            conn.peer_port = h.src_port;
            conn.peer_cid = h.src_cid;
            conn.peer_buf_alloc = h.buf_alloc;
            conn.peer_fwd_cnt = h.fwd_cnt;
            conn.tx_cnt = 0;
            conn.fwd_cnt = 0;
            conn.len = 0;
            conn.credit_requested = false;
        }
        if self.send_conn(tx, c, OP_RESPONSE, 0).is_err() {
            self.free(c);
        }
    }

    /// Sends up to `want` bytes from the front of connection `c`'s buffer as one RW
    /// packet, within the peer's credit. Returns the bytes sent. `echo` says the bytes
    /// came from the peer (echo server) rather than from the guest (client).
    fn send_buffered(
        &mut self,
        tx: &mut PacketBuffers,
        c: usize,
        want: usize,
        echo: bool,
    ) -> Result<usize, &'static str> {
        let Some(conn) = self.conns.get(c) else {
            return Ok(0);
        };
        let n = want.min(conn.len).min(conn.peer_credit() as usize).min(BUF);
        if n == 0 {
            return Ok(0);
        }
        let slot = self.acquire_tx()?;
        let Some(conn) = self.conns.get_mut(c) else {
            return Ok(0);
        };
        if let (Some(dst), Some(src)) = (tx.data[slot % SLOTS].get_mut(..n), conn.buf.get(..n)) {
            dst.copy_from_slice(src);
        }
        conn.consume(n, echo);
        conn.tx_cnt = conn.tx_cnt.wrapping_add(n as u32);
        let h = self.conn_header(c, OP_RW, 0);
        self.submit_tx(tx, slot, h, n);
        Ok(n)
    }

    /// Echoes as much buffered data as the peer has credit for; asks for credit once
    /// when there is none.
    fn flush_echo(&mut self, tx: &mut PacketBuffers, c: usize) {
        loop {
            let Some(conn) = self.conns.get(c) else {
                return;
            };
            if conn.len == 0 {
                return;
            }
            if conn.peer_credit() == 0 {
                if !conn.credit_requested {
                    if let Some(conn) = self.conns.get_mut(c) {
                        conn.credit_requested = true;
                    }
                    let _ = self.send_conn(tx, c, OP_CREDIT_REQUEST, 0);
                }
                return;
            }
            match self.send_buffered(tx, c, BUF, true) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    }

    /// A server connection is dropped at once; a client connection keeps its received
    /// bytes for `connect_line`, which may not have seen its reply line yet.
    fn closed_by_peer(&mut self, c: usize, client: bool) {
        if client {
            if let Some(conn) = self.conns.get_mut(c) {
                conn.state = State::PeerClosed;
            }
        } else {
            self.free(c);
        }
    }

    /// The state of client connection `c` if it is still the one on `local_port`.
    fn client_state(&self, c: usize, local_port: u32) -> Option<State> {
        self.conns
            .get(c)
            .filter(|conn| {
                conn.state != State::Free && conn.client && conn.local_port == local_port
            })
            .map(|conn| conn.state)
    }

    /// Frees client connection `c` if it is still the one on `local_port`.
    fn release(&mut self, c: usize, local_port: u32) {
        if self.client_state(c, local_port).is_some() {
            self.free(c);
        }
    }

    fn abort(&mut self, tx: &mut PacketBuffers, c: usize) {
        let _ = self.send_conn(tx, c, OP_RST, 0);
        self.free(c);
    }

    /// Connects to the host on `port`, sends `text` + `\n`, and copies the first line
    /// of the reply (without `\n`) into `reply`. Returns the reply length.
    pub fn connect_line(
        &mut self,
        dma: &mut VsockDma,
        port: u32,
        text: &[u8],
        reply: &mut [u8],
        timeout_ms: u64,
    ) -> Result<usize, ConnectError> {
        let deadline = Deadline::after_ms(self.tpm, timeout_ms);
        let Some(c) = self.conns.iter().position(|c| c.state == State::Free) else {
            return Err(ConnectError::NoFreeConnection);
        };
        let local_port = self.next_port;
        self.next_port = if self.next_port >= 65535 {
            49152
        } else {
            self.next_port + 1
        };
        let n = text.len().min(BUF - 1);
        if let Some(conn) = self.conns.get_mut(c) {
            conn.state = State::Connecting;
            conn.client = true;
            conn.local_port = local_port;
            conn.peer_port = port;
            conn.peer_cid = HOST_CID;
            conn.peer_buf_alloc = 0;
            conn.peer_fwd_cnt = 0;
            conn.tx_cnt = 0;
            conn.fwd_cnt = 0;
            conn.credit_requested = false;
            conn.len = 0;
        }
        self.send_conn(&mut dma.tx, c, OP_REQUEST, 0)
            .map_err(ConnectError::Send)?;
        // Wait for RESPONSE.
        loop {
            self.poll(dma);
            match self.client_state(c, local_port) {
                Some(State::Established) => break,
                Some(State::Connecting) => {}
                _ => {
                    self.release(c, local_port);
                    return Err(ConnectError::Refused);
                }
            }
            if deadline.passed() {
                self.abort(&mut dma.tx, c);
                return Err(ConnectError::Timeout);
            }
            pause();
        }
        // The outgoing line goes through the connection's buffer, which is empty now.
        if let Some(conn) = self.conns.get_mut(c) {
            if let (Some(dst), Some(src)) = (conn.buf.get_mut(..n), text.get(..n)) {
                dst.copy_from_slice(src);
            }
            if let Some(nl) = conn.buf.get_mut(n) {
                *nl = b'\n';
            }
            conn.len = n + 1;
        }
        let mut left = n + 1;
        while left > 0 {
            let sent = self
                .send_buffered(&mut dma.tx, c, left, false)
                .map_err(ConnectError::Send)?;
            left -= sent.min(left);
            if left == 0 {
                break;
            }
            self.poll(dma);
            if self.client_state(c, local_port) != Some(State::Established) {
                self.release(c, local_port);
                return Err(ConnectError::Refused);
            }
            if deadline.passed() {
                self.abort(&mut dma.tx, c);
                return Err(ConnectError::Timeout);
            }
            pause();
        }
        // Wait for one line back. The peer may close right after sending it.
        let reply_len = loop {
            self.poll(dma);
            let Some(state) = self.client_state(c, local_port) else {
                return Err(ConnectError::Refused);
            };
            if let Some(conn) = self.conns.get(c) {
                if let Some(end) = conn
                    .buf
                    .get(..conn.len)
                    .and_then(|b| b.iter().position(|&x| x == b'\n'))
                {
                    let k = end.min(reply.len());
                    if let (Some(dst), Some(src)) = (reply.get_mut(..k), conn.buf.get(..k)) {
                        dst.copy_from_slice(src);
                    }
                    break k;
                }
            }
            if state == State::PeerClosed {
                self.free(c);
                return Err(ConnectError::Refused);
            }
            if deadline.passed() {
                self.abort(&mut dma.tx, c);
                return Err(ConnectError::Timeout);
            }
            pause();
        };
        if self.client_state(c, local_port) == Some(State::PeerClosed) {
            self.free(c);
            return Ok(reply_len);
        }
        // Close: SHUTDOWN, then the peer's RST (or ours once CLOSE_WAIT_MS have passed).
        if let Some(conn) = self.conns.get_mut(c) {
            let all = conn.len;
            conn.consume(all, true);
        }
        let _ = self.send_conn(&mut dma.tx, c, OP_SHUTDOWN, SHUTDOWN_BOTH);
        let close_deadline = Deadline::after_ms(self.tpm, CLOSE_WAIT_MS).raw();
        if let Some(conn) = self.conns.get_mut(c) {
            conn.state = State::Closing;
            conn.close_deadline = close_deadline;
        }
        Ok(reply_len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_layout_is_the_virtio_one() {
        let h = Header {
            src_cid: 3,
            dst_cid: 2,
            src_port: 0x1234,
            dst_port: 5000,
            len: 7,
            kind: TYPE_STREAM,
            op: OP_RW,
            flags: 0,
            buf_alloc: 4096,
            fwd_cnt: 9,
        };
        let mut b = [0u8; 64];
        h.encode(&mut b);
        assert_eq!(&b[0..8], &3u64.to_le_bytes());
        assert_eq!(&b[8..16], &2u64.to_le_bytes());
        assert_eq!(&b[16..20], &0x1234u32.to_le_bytes());
        assert_eq!(&b[20..24], &5000u32.to_le_bytes());
        assert_eq!(&b[24..28], &7u32.to_le_bytes());
        assert_eq!(&b[28..30], &1u16.to_le_bytes());
        assert_eq!(&b[30..32], &5u16.to_le_bytes());
        assert_eq!(&b[36..40], &4096u32.to_le_bytes());
        assert_eq!(&b[40..44], &9u32.to_le_bytes());
        assert_eq!(&b[44..], &[0u8; 20]);
        let d = Header::decode(&b);
        assert_eq!(
            (d.src_cid, d.dst_cid, d.src_port, d.dst_port),
            (3, 2, 0x1234, 5000)
        );
        assert_eq!(
            (d.len, d.kind, d.op, d.buf_alloc, d.fwd_cnt),
            (7, TYPE_STREAM, OP_RW, 4096, 9)
        );
    }

    #[test]
    fn hostile_kinds_parse() {
        for word in [
            &b"oob"[..],
            b"loop",
            b"long",
            b"dir",
            b"badnext",
            b"badavail",
        ] {
            assert!(matches!(
                VsockHostile::parse(word),
                Some(VsockHostile::Tx(_))
            ));
        }
        for word in [
            &b"shortlen"[..],
            b"shorthdr",
            b"rxdir",
            b"rxsmall",
            b"evdir",
            b"flood-bogus",
            b"flood-connect",
        ] {
            assert!(VsockHostile::parse(word).is_some());
        }
        assert!(VsockHostile::parse(b"rx").is_none());
    }

    #[test]
    fn peer_credit_follows_counters() {
        let mut c = Conn::FREE;
        c.peer_buf_alloc = 100;
        assert_eq!(c.peer_credit(), 100);
        c.tx_cnt = 60;
        c.peer_fwd_cnt = 20;
        assert_eq!(c.peer_credit(), 60);
        // Counters wrap around u32.
        c.tx_cnt = 10;
        c.peer_fwd_cnt = u32::MAX - 9;
        assert_eq!(c.peer_credit(), 80);
        // A peer that shrank its buffer below what is in flight gives no credit.
        c.peer_buf_alloc = 5;
        assert_eq!(c.peer_credit(), 0);
    }

    #[test]
    fn consume_shifts_and_counts_only_received_bytes() {
        let mut c = Conn::FREE;
        c.buf[..5].copy_from_slice(b"hello");
        c.len = 5;
        c.consume(2, true);
        assert_eq!(&c.buf[..c.len], b"llo");
        assert_eq!(c.fwd_cnt, 2);
        c.consume(10, false);
        assert_eq!(c.len, 0);
        assert_eq!(c.fwd_cnt, 2);
    }
}
