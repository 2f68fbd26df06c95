//! Virtio devices and their transport, driven as a guest would: rings and buffers in guest
//! memory come from the input, then the device is notified.

use std::cell::RefCell;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};
use vmm::devices::bus::BusDevice;
use vmm::devices::virtio::block::{Block, BlockConfig};
use vmm::devices::virtio::chain::{Chain, ChainRules};
use vmm::devices::virtio::mmio::MmioTransport;
use vmm::devices::virtio::net::{Net, NetConfig};
use vmm::devices::virtio::vsock::Vsock;
use vmm::devices::virtio::Interrupt;
use vmm::devices::virtio::VirtioDevice;
use vmm::vstate::memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::signature::bytes_signature;

/// Guest memory of every device target.
const MEM_SIZE: usize = 0x1_0000;
/// Input bytes after the first lie in guest memory from address 0: the rings of up to three
/// queues (queue i at `QUEUE_STRIDE * i`) and buffers from `DATA`.
pub const INPUT_MAX: usize = 0x3001;
const QUEUE_STRIDE: u64 = 0x400;
const AVAIL_OFFSET: u64 = 0x100;
const USED_OFFSET: u64 = 0x200;
const DATA: u64 = 0x1000;
const NORMAL_SIZE: u16 = 16;

// virtio-mmio registers (virtio 1.2, 4.2.2).
const REG_DRIVER_FEATURES: u64 = 0x020;
const REG_DRIVER_FEATURES_SEL: u64 = 0x024;
const REG_QUEUE_SEL: u64 = 0x030;
const REG_QUEUE_NUM: u64 = 0x038;
const REG_QUEUE_READY: u64 = 0x044;
const REG_QUEUE_NOTIFY: u64 = 0x050;
const REG_INTERRUPT_STATUS: u64 = 0x060;
const REG_INTERRUPT_ACK: u64 = 0x064;
const REG_STATUS: u64 = 0x070;
const REG_QUEUE_DESC_LOW: u64 = 0x080;
const REG_QUEUE_DRIVER_LOW: u64 = 0x090;
const REG_QUEUE_DEVICE_LOW: u64 = 0x0a0;
const ACKNOWLEDGE: u32 = 1;
const DRIVER: u32 = 2;
const DRIVER_OK: u32 = 4;
const FEATURES_OK: u32 = 8;

const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;

/// The queue size a driver would program: mostly the normal one, now and then a hostile one.
fn queue_size(code: u8) -> u16 {
    match code {
        0..=0xef => NORMAL_SIZE,
        c => 1u16 << (c & 0xf),
    }
}

fn guest_memory(image: &[u8]) -> GuestMemoryMmap {
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE)])
        .unwrap_or_else(|e| panic!("fuzz rig: guest memory: {e}"));
    let n = image.len().min(MEM_SIZE);
    mem.write_slice(&image[..n], GuestAddress(0))
        .unwrap_or_else(|e| panic!("fuzz rig: guest memory write: {e}"));
    mem
}

fn interrupt() -> Interrupt {
    let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap_or_else(|e| panic!("fuzz rig: eventfd: {e}"));
    Interrupt::new(Arc::new(irq))
}

fn write_reg(t: &mut MmioTransport, offset: u64, value: u32) {
    t.write(offset, &value.to_le_bytes());
}

fn read_reg(t: &mut MmioTransport, offset: u64) -> u32 {
    let mut data = [0u8; 4];
    t.read(offset, &mut data);
    u32::from_le_bytes(data)
}

/// Negotiates, sets up `queues` queues of `size` at their fixed places and starts the device.
fn bring_up(t: &mut MmioTransport, queues: u32, size: u16) {
    write_reg(t, REG_STATUS, ACKNOWLEDGE | DRIVER);
    write_reg(t, REG_DRIVER_FEATURES_SEL, 1);
    write_reg(t, REG_DRIVER_FEATURES, 1);
    write_reg(t, REG_STATUS, ACKNOWLEDGE | DRIVER | FEATURES_OK);
    for i in 0..queues {
        let base = QUEUE_STRIDE as u32 * i;
        write_reg(t, REG_QUEUE_SEL, i);
        write_reg(t, REG_QUEUE_NUM, u32::from(size));
        write_reg(t, REG_QUEUE_DESC_LOW, base);
        write_reg(t, REG_QUEUE_DRIVER_LOW, base + AVAIL_OFFSET as u32);
        write_reg(t, REG_QUEUE_DEVICE_LOW, base + USED_OFFSET as u32);
        write_reg(t, REG_QUEUE_READY, 1);
    }
    write_reg(
        t,
        REG_STATUS,
        ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK,
    );
}

/// Notifies every queue twice (the second time finds the rings as the device left them).
fn kick_all(t: &mut MmioTransport, queues: u32) {
    for _ in 0..2 {
        for i in 0..queues {
            write_reg(t, REG_QUEUE_NOTIFY, i);
        }
        t.process_backend();
    }
}

/// How many chains each queue returned, the interrupt status and the device status: what
/// the guest sees, coarsely (used-ring contents would make every input new).
fn outcome(t: &mut MmioTransport, mem: &GuestMemoryMmap, queues: u32, before: &[u16]) -> u64 {
    let mut seen = Vec::new();
    for (i, before) in (0..u64::from(queues)).zip(before) {
        let used_idx: u16 = mem
            .read_obj(GuestAddress(QUEUE_STRIDE * i + USED_OFFSET + 2))
            .unwrap_or(0);
        seen.extend_from_slice(&used_idx.wrapping_sub(*before).to_le_bytes());
    }
    seen.extend_from_slice(&read_reg(t, REG_INTERRUPT_STATUS).to_le_bytes());
    seen.extend_from_slice(&read_reg(t, REG_STATUS).to_le_bytes());
    bytes_signature(&seen)
}

/// The used indexes the driver left in memory, before the device runs.
fn used_before(mem: &GuestMemoryMmap, queues: u32) -> Vec<u16> {
    (0..u64::from(queues))
        .map(|i| {
            mem.read_obj(GuestAddress(QUEUE_STRIDE * i + USED_OFFSET + 2))
                .unwrap_or(0)
        })
        .collect()
}

fn run_device(device: Box<dyn VirtioDevice>, data: &[u8], queues: u32) -> u64 {
    let Some((&code, image)) = data.split_first() else {
        return 0;
    };
    let mem = guest_memory(image);
    let before = used_before(&mem, queues);
    let mut t = MmioTransport::new(device, mem.clone(), interrupt());
    bring_up(&mut t, queues, queue_size(code));
    kick_all(&mut t, queues);
    let signature = outcome(&mut t, &mem, queues, &before);
    write_reg(&mut t, REG_STATUS, 0);
    signature
}

fn scratch_dir() -> PathBuf {
    thread_local! {
        static DIR: tempfile::TempDir = tempfile::tempdir()
            .unwrap_or_else(|e| panic!("fuzz rig: temporary directory: {e}"));
    }
    DIR.with(|d| d.path().to_path_buf())
}

fn block_device() -> Block {
    let path = scratch_dir().join("disk.img");
    if !path.exists() {
        let file = std::fs::File::create(&path)
            .unwrap_or_else(|e| panic!("fuzz rig: {}: {e}", path.display()));
        file.set_len(64 << 10)
            .unwrap_or_else(|e| panic!("fuzz rig: {}: {e}", path.display()));
    }
    Block::new(BlockConfig {
        id: "fuzz".into(),
        path,
        read_only: false,
    })
    .unwrap_or_else(|e| panic!("fuzz rig: {e}"))
}

fn vsock_device() -> (Vsock, PathBuf) {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let path = scratch_dir().join(format!("v{}.sock", NEXT.fetch_add(1, Ordering::Relaxed)));
    let _ = std::fs::remove_file(&path);
    let device = Vsock::new(3, &path).unwrap_or_else(|e| panic!("fuzz rig: {e}"));
    (device, path)
}

pub fn run_block(data: &[u8]) -> u64 {
    run_device(Box::new(block_device()), data, 1)
}

pub fn run_vsock(data: &[u8]) -> u64 {
    let (device, path) = vsock_device();
    let signature = run_device(Box::new(device), data, 3);
    let _ = std::fs::remove_file(path);
    signature
}

const TAP: &str = "rbxfuzz0";

thread_local! {
    /// One net device for the whole run (a tap per input would churn the host's network
    /// stack); it is reset through the transport between inputs, on fresh guest memory
    /// contents.
    static NET: RefCell<Option<(MmioTransport, GuestMemoryMmap)>> = const { RefCell::new(None) };
}

fn net_device() -> Result<Net, String> {
    Net::new(
        NetConfig {
            iface_id: "fuzz0".into(),
            host_dev_name: TAP.into(),
            guest_mac: Some([6, 0, 10, 0, 0, 2]),
        },
        &Default::default(),
    )
    .map_err(|e| e.to_string())
}

pub fn net_available() -> Option<String> {
    match NET.with(|n| n.borrow().is_some()) {
        true => None,
        false => match net_device() {
            Ok(net) => {
                let mem = guest_memory(&[]);
                let t = MmioTransport::new(Box::new(net), mem.clone(), interrupt());
                NET.with(|n| *n.borrow_mut() = Some((t, mem)));
                None
            }
            Err(e) => Some(format!(
                "no tap {TAP} here (needs root and /dev/net/tun): {e}"
            )),
        },
    }
}

pub fn run_net(data: &[u8]) -> u64 {
    if net_available().is_some() {
        return 0;
    }
    let Some((&code, image)) = data.split_first() else {
        return 0;
    };
    NET.with(|n| {
        let mut n = n.borrow_mut();
        let Some((t, mem)) = n.as_mut() else {
            return 0;
        };
        write_reg(t, REG_STATUS, 0);
        let zero = vec![0u8; MEM_SIZE];
        let _ = mem.write_slice(&zero, GuestAddress(0));
        let len = image.len().min(MEM_SIZE);
        let _ = mem.write_slice(&image[..len], GuestAddress(0));
        let before = used_before(mem, 2);
        bring_up(t, 2, queue_size(code));
        kick_all(t, 2);
        outcome(t, mem, 2, &before)
    })
}

/// The shared validator alone, with rules from the input: byte 0 the queue size code,
/// byte 1 the rules, the rest guest memory (one queue at 0).
pub fn run_chain(data: &[u8]) -> u64 {
    let [code, rules_code, image @ ..] = data else {
        return 0;
    };
    let mem = guest_memory(image);
    let Ok(mut queue) = Queue::new(256) else {
        return 0;
    };
    queue.set_size(queue_size(*code));
    queue.set_desc_table_address(Some(0), Some(0));
    queue.set_avail_ring_address(Some(AVAIL_OFFSET as u32), Some(0));
    queue.set_used_ring_address(Some(USED_OFFSET as u32), Some(0));
    queue.set_ready(true);
    if !queue.is_valid(&mem) {
        return 1;
    }
    const LIMITS: [u64; 4] = [0, 1, 4096, u32::MAX as u64];
    let rules = ChainRules {
        queue_size: queue.size(),
        max_readable: LIMITS[usize::from(rules_code & 3)],
        max_writable: LIMITS[usize::from((rules_code >> 2) & 3)],
    };
    let mut seen = String::new();
    let mut stalled = false;
    for _ in 0..64 {
        let Some(chain) = vmm::devices::virtio::next_chain(&mem, &mut queue, &mut stalled, &"fuzz")
        else {
            break;
        };
        let head = chain.head_index();
        match Chain::validate(&mem, chain, &rules) {
            Ok(chain) => {
                assert!(chain.readable_len() <= rules.max_readable);
                assert!(chain.writable_len() <= rules.max_writable);
                seen.push_str(&format!(
                    "ok {} {};",
                    chain.readable.len(),
                    chain.writable.len()
                ));
            }
            Err(e) => seen.push_str(&format!("{e:?};")),
        }
        if !vmm::devices::virtio::return_chain(&mem, &mut queue, head, 0, &"fuzz") {
            break;
        }
    }
    super::signature::shape(&seen)
}

/// mmio: byte 0 picks the device (even: block, odd: vsock), byte 1 the number of 9-byte
/// records that follow (kind, offset u32, value u32); the rest is guest memory.
pub fn run_mmio(data: &[u8]) -> u64 {
    let [which, count, rest @ ..] = data else {
        return 0;
    };
    let records_len = (usize::from(*count) * 9).min(rest.len());
    let (records, image) = rest.split_at(records_len);
    let mem = guest_memory(image);
    let mut vsock_path = None;
    let device: Box<dyn VirtioDevice> = if which % 2 == 0 {
        Box::new(block_device())
    } else {
        let (device, path) = vsock_device();
        vsock_path = Some(path);
        Box::new(device)
    };
    let mut t = MmioTransport::new(device, mem.clone(), interrupt());
    let mut seen = Vec::new();
    for record in records.chunks_exact(9) {
        let kind = record[0];
        let offset = u64::from(u32::from_le_bytes([
            record[1], record[2], record[3], record[4],
        ]));
        let value = u32::from_le_bytes([record[5], record[6], record[7], record[8]]);
        let width = usize::from(kind >> 3) % 8 + 1;
        match kind % 8 {
            0..=3 => write_reg(&mut t, offset & 0x1fc, value),
            4 => {
                let bytes = u64::from(value).to_le_bytes();
                t.write(offset & 0xfff, &bytes[..width]);
            }
            5 => {
                let mut out = [0u8; 8];
                t.read(offset & 0x1ff, &mut out[..width]);
                seen.extend_from_slice(&out[..width]);
            }
            6 => {
                let bytes = u64::from(value).to_le_bytes();
                t.write(0x100 + (offset & 0xff), &bytes[..width]);
            }
            _ => {
                write_reg(&mut t, REG_QUEUE_NOTIFY, value % 4);
                write_reg(&mut t, REG_INTERRUPT_ACK, value);
                t.process_backend();
            }
        }
    }
    seen.extend_from_slice(&read_reg(&mut t, REG_STATUS).to_le_bytes());
    drop(t);
    if let Some(path) = vsock_path {
        let _ = std::fs::remove_file(path);
    }
    bytes_signature(&seen)
}

// --- Seeds ---------------------------------------------------------------------------

/// Guest memory being laid out for a seed.
struct Image(Vec<u8>);

impl Image {
    fn new() -> Self {
        Self(vec![0; INPUT_MAX - 1])
    }

    fn put(&mut self, at: u64, bytes: &[u8]) {
        let at = at as usize;
        self.0[at..at + bytes.len()].copy_from_slice(bytes);
    }

    /// Descriptor `index` of queue `queue`.
    fn desc(&mut self, queue: u64, index: u64, addr: u64, len: u32, flags: u16, next: u16) {
        let mut d = Vec::with_capacity(16);
        d.extend_from_slice(&addr.to_le_bytes());
        d.extend_from_slice(&len.to_le_bytes());
        d.extend_from_slice(&flags.to_le_bytes());
        d.extend_from_slice(&next.to_le_bytes());
        self.put(QUEUE_STRIDE * queue + 16 * index, &d);
    }

    /// Publishes `heads` on queue `queue`'s available ring.
    fn avail(&mut self, queue: u64, heads: &[u16]) {
        let base = QUEUE_STRIDE * queue + AVAIL_OFFSET;
        self.put(base + 2, &(heads.len() as u16).to_le_bytes());
        for (i, head) in heads.iter().enumerate() {
            self.put(base + 4 + 2 * i as u64, &head.to_le_bytes());
        }
    }

    /// The input: a normal queue size, then memory without its trailing zeros.
    fn input(self) -> Vec<u8> {
        let mut out = vec![0u8];
        let end = self.0.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
        out.extend_from_slice(&self.0[..end]);
        out
    }
}

fn block_request(
    image: &mut Image,
    head: u16,
    request_type: u32,
    sector: u64,
    data_len: u32,
    slot: u64,
) {
    let base = DATA + slot * 0x800;
    let mut header = Vec::new();
    header.extend_from_slice(&request_type.to_le_bytes());
    header.extend_from_slice(&0u32.to_le_bytes());
    header.extend_from_slice(&sector.to_le_bytes());
    image.put(base, &header);
    let h = u64::from(head);
    let data_flags = if request_type == 1 {
        F_NEXT
    } else {
        F_NEXT | F_WRITE
    };
    if data_len > 0 {
        image.desc(0, h, base, 16, F_NEXT, head + 1);
        image.desc(0, h + 1, base + 0x10, data_len, data_flags, head + 2);
        image.desc(0, h + 2, base + 0x10 + u64::from(data_len), 1, F_WRITE, 0);
    } else {
        image.desc(0, h, base, 16, F_NEXT, head + 1);
        image.desc(0, h + 1, base + 0x10, 1, F_WRITE, 0);
    }
}

pub fn seeds_block() -> Vec<(String, Vec<u8>)> {
    let mut seeds = Vec::new();
    for (name, request_type, data_len) in [
        ("read", 0u32, 512u32),
        ("write", 1, 512),
        ("flush", 4, 0),
        ("get-id", 8, 20),
        ("unsupported", 99, 0),
    ] {
        let mut image = Image::new();
        block_request(&mut image, 0, request_type, 1, data_len, 0);
        image.avail(0, &[0]);
        seeds.push((name.to_string(), image.input()));
    }
    let mut image = Image::new();
    block_request(&mut image, 0, 1, 2, 1024, 0);
    block_request(&mut image, 3, 0, 2, 1024, 1);
    image.avail(0, &[0, 3]);
    seeds.push(("write-then-read".into(), image.input()));
    seeds
}

fn vsock_header(op: u16, len: u32) -> Vec<u8> {
    let mut h = Vec::with_capacity(44);
    h.extend_from_slice(&3u64.to_le_bytes()); // src_cid: the guest
    h.extend_from_slice(&2u64.to_le_bytes()); // dst_cid: the host
    h.extend_from_slice(&1024u32.to_le_bytes());
    h.extend_from_slice(&52u32.to_le_bytes());
    h.extend_from_slice(&len.to_le_bytes());
    h.extend_from_slice(&1u16.to_le_bytes()); // stream
    h.extend_from_slice(&op.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h.extend_from_slice(&65536u32.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h
}

pub fn seeds_vsock() -> Vec<(String, Vec<u8>)> {
    let mut seeds = Vec::new();
    for (name, op, payload) in [
        ("request", 1u16, &b""[..]),
        ("rw", 5, &b"hello host"[..]),
        ("rst", 3, &b""[..]),
        ("shutdown", 4, &b""[..]),
        ("credit-request", 7, &b""[..]),
    ] {
        let mut image = Image::new();
        // RX buffers (queue 0) and an event buffer (queue 2).
        image.desc(0, 0, DATA + 0x1000, 0x400, F_WRITE, 0);
        image.desc(0, 1, DATA + 0x1400, 0x400, F_WRITE, 0);
        image.avail(0, &[0, 1]);
        image.desc(2, 0, DATA + 0x1800, 4, F_WRITE, 0);
        image.avail(2, &[0]);
        // One TX packet (queue 1): header and payload in one buffer or two.
        let header = vsock_header(op, payload.len() as u32);
        image.put(DATA, &header);
        image.put(DATA + 0x100, payload);
        if payload.is_empty() {
            image.desc(1, 0, DATA, 44, 0, 0);
        } else {
            image.desc(1, 0, DATA, 44, F_NEXT, 1);
            image.desc(1, 1, DATA + 0x100, payload.len() as u32, 0, 0);
        }
        image.avail(1, &[0]);
        seeds.push((name.to_string(), image.input()));
    }
    seeds
}

pub fn seeds_net() -> Vec<(String, Vec<u8>)> {
    let mut image = Image::new();
    // RX buffers (queue 0).
    image.desc(0, 0, DATA + 0x1000, 0x800, F_WRITE, 0);
    image.avail(0, &[0]);
    // TX (queue 1): a 12-byte virtio-net header and a broadcast ARP-sized frame.
    let mut frame = vec![0u8; 12];
    frame.extend_from_slice(&[0xff; 6]);
    frame.extend_from_slice(&[6, 0, 10, 0, 0, 2]);
    frame.extend_from_slice(&[0x08, 0x06]);
    frame.resize(12 + 60, 0);
    image.put(DATA, &frame);
    image.desc(1, 0, DATA, 12, F_NEXT, 1);
    image.desc(1, 1, DATA + 12, 60, 0, 0);
    image.avail(1, &[0]);
    vec![("tx-and-rx".into(), image.input())]
}

pub fn seeds_chain() -> Vec<(String, Vec<u8>)> {
    seeds_block()
        .into_iter()
        .map(|(name, input)| {
            let mut out = vec![0u8, 0b1110];
            out.extend_from_slice(&input[1..]);
            (name, out)
        })
        .collect()
}

pub fn seeds_mmio() -> Vec<(String, Vec<u8>)> {
    let record = |kind: u8, offset: u64, value: u32| {
        let mut r = vec![kind];
        r.extend_from_slice(&(offset as u32).to_le_bytes());
        r.extend_from_slice(&value.to_le_bytes());
        r
    };
    let mut seeds = Vec::new();
    for (which, name, memory) in [
        (0u8, "block", seeds_block().remove(0).1),
        (1u8, "vsock", seeds_vsock().remove(1).1),
    ] {
        let queues = if which == 0 { 1 } else { 3 };
        let mut records = vec![
            record(0, REG_STATUS, ACKNOWLEDGE | DRIVER),
            record(0, REG_DRIVER_FEATURES_SEL, 1),
            record(0, REG_DRIVER_FEATURES, 1),
            record(0, REG_STATUS, ACKNOWLEDGE | DRIVER | FEATURES_OK),
        ];
        for i in 0..queues {
            let base = QUEUE_STRIDE as u32 * i;
            records.push(record(0, REG_QUEUE_SEL, i));
            records.push(record(0, REG_QUEUE_NUM, 16));
            records.push(record(0, REG_QUEUE_DESC_LOW, base));
            records.push(record(0, REG_QUEUE_DRIVER_LOW, base + AVAIL_OFFSET as u32));
            records.push(record(0, REG_QUEUE_DEVICE_LOW, base + USED_OFFSET as u32));
            records.push(record(0, REG_QUEUE_READY, 1));
        }
        records.push(record(
            0,
            REG_STATUS,
            ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK,
        ));
        for i in 0..queues {
            records.push(record(7, 0, i));
        }
        records.push(record(5 | (3 << 3), 0x100, 0));
        records.push(record(0, REG_STATUS, 0));
        let mut input = vec![which, records.len() as u8];
        input.extend(records.into_iter().flatten());
        input.extend_from_slice(&memory[1..]);
        seeds.push((name.to_string(), input));
    }
    seeds
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rig really drives the device: a read request's chain comes back with the data
    /// and an OK status byte, and a hostile avail index stalls the queue without a panic.
    #[test]
    fn block_seed_is_served() {
        let seeds = seeds_block();
        let (_, read) = seeds.iter().find(|(n, _)| n == "read").expect("read seed");
        let mem = guest_memory(&read[1..]);
        let mut t = MmioTransport::new(Box::new(block_device()), mem.clone(), interrupt());
        bring_up(&mut t, 1, NORMAL_SIZE);
        kick_all(&mut t, 1);
        let used: u16 = mem
            .read_obj(GuestAddress(USED_OFFSET + 2))
            .expect("used idx");
        assert_eq!(used, 1);
        let status: u8 = mem
            .read_obj(GuestAddress(DATA + 0x10 + 512))
            .expect("status byte");
        assert_eq!(status, 0, "VIRTIO_BLK_S_OK");
    }
}
