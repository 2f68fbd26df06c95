//! virtio-mmio (version 2, "modern") transport and split virtqueues. Drivers poll the used
//! rings; the virtio-fs driver also halts until the device interrupts (fs.rs).

use core::ptr::{read_volatile, write_volatile};
use core::sync::atomic::{compiler_fence, Ordering};

use crate::io::{pause, Deadline};

pub const VIRTIO_MAGIC: u32 = 0x7472_6976; // "virt"
pub const REG_MAGIC: usize = 0x000;
pub const REG_VERSION: usize = 0x004;
pub const REG_DEVICE_ID: usize = 0x008;
const REG_DEVICE_FEATURES: usize = 0x010;
const REG_DEVICE_FEATURES_SEL: usize = 0x014;
const REG_DRIVER_FEATURES: usize = 0x020;
const REG_DRIVER_FEATURES_SEL: usize = 0x024;
const REG_QUEUE_SEL: usize = 0x030;
const REG_QUEUE_NUM_MAX: usize = 0x034;
const REG_QUEUE_NUM: usize = 0x038;
const REG_QUEUE_READY: usize = 0x044;
const REG_QUEUE_NOTIFY: usize = 0x050;
const REG_INTERRUPT_ACK: usize = 0x064;
const REG_STATUS: usize = 0x070;
const REG_QUEUE_DESC_LOW: usize = 0x080;
const REG_QUEUE_DESC_HIGH: usize = 0x084;
const REG_QUEUE_DRIVER_LOW: usize = 0x090;
const REG_QUEUE_DRIVER_HIGH: usize = 0x094;
const REG_QUEUE_DEVICE_LOW: usize = 0x0a0;
const REG_QUEUE_DEVICE_HIGH: usize = 0x0a4;
const REG_CONFIG_GENERATION: usize = 0x0fc;
pub const REG_CONFIG: usize = 0x100;

const STATUS_ACKNOWLEDGE: u32 = 1;
const STATUS_DRIVER: u32 = 2;
const STATUS_DRIVER_OK: u32 = 4;
const STATUS_FEATURES_OK: u32 = 8;
const STATUS_FAILED: u32 = 128;
const STATUS_DEVICE_NEEDS_RESET: u32 = 64;

pub const F_VERSION_1: u64 = 1 << 32;

/// InterruptStatus/InterruptACK bit: the device used buffers.
pub const INTERRUPT_USED_RING: u32 = 1;

pub const DESC_F_NEXT: u16 = 1;
pub const DESC_F_WRITE: u16 = 2;

/// How long a device has to meet a hostile chain (return it, or ask for a reset).
pub const HOSTILE_DEADLINE_MS: u64 = 5000;

/// Malformed chains the `hostile` commands post; their buffers depend on the device.
#[derive(Clone, Copy)]
pub enum Hostile {
    /// A buffer beyond guest memory.
    OutOfBounds,
    /// A chain that loops back to its head.
    Loop,
    /// Every descriptor of the queue chained in a cycle.
    Long,
    /// A buffer with the wrong device-readable/writable direction.
    WrongDirection,
    /// A next index beyond the queue.
    BadNext,
    /// A valid chain published with avail.idx advanced by more than the queue size.
    BadAvail,
}

impl Hostile {
    pub fn parse(word: &[u8]) -> Option<Hostile> {
        Some(match word {
            b"oob" => Hostile::OutOfBounds,
            b"loop" => Hostile::Loop,
            b"long" => Hostile::Long,
            b"dir" => Hostile::WrongDirection,
            b"badnext" => Hostile::BadNext,
            b"badavail" => Hostile::BadAvail,
            _ => return None,
        })
    }
}

/// One buffer of a hand-built descriptor chain.
#[derive(Clone, Copy)]
pub struct Buf {
    pub addr: u64,
    pub len: u32,
    /// Device-writable (VIRTQ_DESC_F_WRITE).
    pub writable: bool,
}

impl Buf {
    fn flags(self) -> u16 {
        if self.writable {
            DESC_F_WRITE
        } else {
            0
        }
    }
}

/// Largest queue the guest sets up; its rings fit in one 4 KiB page.
pub const MAX_QUEUE_SIZE: u16 = 16;
const AVAIL_OFFSET: usize = 0x400;
const USED_OFFSET: usize = 0x800;

pub fn mmio_read32(base: usize, reg: usize) -> u32 {
    // SAFETY: `base` is a virtio-mmio window from the command line, identity-mapped by
    // the VMM; the access traps to the VMM.
    unsafe { read_volatile((base + reg) as *const u32) }
}

pub fn mmio_write32(base: usize, reg: usize, value: u32) {
    // SAFETY: as for `mmio_read32`.
    unsafe { write_volatile((base + reg) as *mut u32, value) }
}

/// One 4 KiB page holding a split virtqueue: descriptors, avail ring, used ring.
#[repr(C, align(4096))]
pub struct RingPage(pub [u8; 4096]);

impl RingPage {
    pub const ZERO: RingPage = RingPage([0; 4096]);
}

pub struct Queue {
    ring: *mut u8,
    pub size: u16,
    index: u16,
    /// Next avail index the driver publishes.
    avail_idx: u16,
    /// Next used index the driver consumes.
    last_used: u16,
}

impl Queue {
    pub const fn empty() -> Queue {
        Queue {
            ring: core::ptr::null_mut(),
            size: 0,
            index: 0,
            avail_idx: 0,
            last_used: 0,
        }
    }

    pub fn set_desc(&mut self, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let d = self.ring.wrapping_add(16 * (i % self.size.max(1)) as usize);
        // SAFETY: `d` is descriptor i (< size ≤ 16) inside this queue's ring page.
        unsafe {
            write_volatile(d as *mut u64, addr);
            write_volatile(d.wrapping_add(8) as *mut u32, len);
            write_volatile(d.wrapping_add(12) as *mut u16, flags);
            write_volatile(d.wrapping_add(14) as *mut u16, next);
        }
    }

    /// Raw descriptor write that may point `next` anywhere (for hostile chains).
    pub fn set_desc_raw_next(&mut self, i: u16, next: u16) {
        let d = self.ring.wrapping_add(16 * (i % self.size.max(1)) as usize);
        // SAFETY: as for `set_desc`.
        unsafe { write_volatile(d.wrapping_add(14) as *mut u16, next) };
    }

    /// Writes `bufs` as one chain from descriptor 0 (not published).
    pub fn set_chain(&mut self, bufs: &[Buf]) {
        let last = bufs.len().saturating_sub(1);
        for (i, b) in bufs.iter().enumerate() {
            let (next_flag, next) = if i < last {
                (DESC_F_NEXT, i as u16 + 1)
            } else {
                (0, 0)
            };
            self.set_desc(i as u16, b.addr, b.len, b.flags() | next_flag, next);
        }
    }

    /// Writes a chain from descriptor 0 that never ends properly (not published):
    /// `Loop`: `first` → `rest` → back to `first`; `Long`: `first`, then `rest` in every
    /// other descriptor of the queue, in one cycle; `BadNext`: `first` → `rest`, whose
    /// next index is the queue size + 5. Other kinds are device-specific: nothing is written.
    pub fn set_unterminated_chain(&mut self, kind: Hostile, first: Buf, rest: Buf) {
        let size = self.size.max(1);
        match kind {
            Hostile::Loop => {
                self.set_desc(0, first.addr, first.len, first.flags() | DESC_F_NEXT, 1);
                self.set_desc(1, rest.addr, rest.len, rest.flags() | DESC_F_NEXT, 0);
            }
            Hostile::Long => {
                for i in 0..size {
                    let b = if i == 0 { first } else { rest };
                    self.set_desc(i, b.addr, b.len, b.flags() | DESC_F_NEXT, (i + 1) % size);
                }
            }
            Hostile::BadNext => {
                self.set_desc(0, first.addr, first.len, first.flags() | DESC_F_NEXT, 1);
                self.set_desc(1, rest.addr, rest.len, rest.flags() | DESC_F_NEXT, 0);
                self.set_desc_raw_next(1, size.wrapping_add(5));
            }
            Hostile::OutOfBounds | Hostile::WrongDirection | Hostile::BadAvail => {}
        }
    }

    /// Publishes `head` with avail.idx advanced by the queue size + 3 instead of 1.
    pub fn push_jumped(&mut self, head: u16) {
        let slot = (self.avail_idx % self.size.max(1)) as usize;
        // SAFETY: avail ring entry `slot` (< 16) lies in this queue's ring page.
        unsafe {
            write_volatile(
                self.ring.wrapping_add(AVAIL_OFFSET + 4 + 2 * slot) as *mut u16,
                head,
            )
        };
        let jumped = self
            .avail_idx
            .wrapping_add(self.size.max(1))
            .wrapping_add(3);
        self.publish_avail_idx(jumped);
    }

    /// Publishes the chain starting at `head` in the avail ring.
    pub fn push(&mut self, head: u16) {
        let slot = (self.avail_idx % self.size.max(1)) as usize;
        // SAFETY: avail ring entry `slot` (< 16) lies in this queue's ring page.
        unsafe {
            write_volatile(
                self.ring.wrapping_add(AVAIL_OFFSET + 4 + 2 * slot) as *mut u16,
                head,
            )
        };
        self.avail_idx = self.avail_idx.wrapping_add(1);
        compiler_fence(Ordering::SeqCst);
        self.publish_avail_idx(self.avail_idx);
    }

    /// Writes avail.idx directly (hostile tests make it jump).
    pub fn publish_avail_idx(&mut self, idx: u16) {
        // SAFETY: avail.idx lies in this queue's ring page.
        unsafe { write_volatile(self.ring.wrapping_add(AVAIL_OFFSET + 2) as *mut u16, idx) };
        compiler_fence(Ordering::SeqCst);
    }

    /// The next used element (descriptor head, bytes written), if the device returned one.
    pub fn pop_used(&mut self) -> Option<(u32, u32)> {
        // SAFETY: used.idx lies in this queue's ring page.
        let used_idx =
            unsafe { read_volatile(self.ring.wrapping_add(USED_OFFSET + 2) as *const u16) };
        if used_idx == self.last_used {
            return None;
        }
        compiler_fence(Ordering::SeqCst);
        let slot = (self.last_used % self.size.max(1)) as usize;
        let elem = self.ring.wrapping_add(USED_OFFSET + 4 + 8 * slot);
        // SAFETY: used ring element `slot` (< 16) lies in this queue's ring page.
        let (id, len) = unsafe {
            (
                read_volatile(elem as *const u32),
                read_volatile(elem.wrapping_add(4) as *const u32),
            )
        };
        self.last_used = self.last_used.wrapping_add(1);
        Some((id, len))
    }
}

/// A device's MMIO window.
#[derive(Clone, Copy)]
pub struct Transport {
    pub base: usize,
}

impl Transport {
    pub fn read(&self, reg: usize) -> u32 {
        mmio_read32(self.base, reg)
    }
    pub fn write(&self, reg: usize, value: u32) {
        mmio_write32(self.base, reg, value)
    }

    /// Reads a u64 from config space with the generation check of the virtio spec.
    pub fn config_u64(&self, offset: usize) -> u64 {
        loop {
            let before = self.read(REG_CONFIG_GENERATION);
            let lo = self.read(REG_CONFIG + offset) as u64;
            let hi = self.read(REG_CONFIG + offset + 4) as u64;
            if self.read(REG_CONFIG_GENERATION) == before {
                return (hi << 32) | lo;
            }
        }
    }

    /// Whether the device set DEVICE_NEEDS_RESET: it stopped serving a queue.
    pub fn needs_reset(&self) -> bool {
        self.read(REG_STATUS) & STATUS_DEVICE_NEEDS_RESET != 0
    }

    /// Waits until the device met a hostile chain posted on `queue`: it returned a chain on
    /// the used ring, or it set DEVICE_NEEDS_RESET (a queue it will not serve until reset).
    pub fn wait_hostile_met(
        &self,
        queue: &mut Queue,
        ticks_per_ms: u64,
    ) -> Result<(), &'static str> {
        let deadline = Deadline::after_ms(ticks_per_ms, HOSTILE_DEADLINE_MS);
        while queue.pop_used().is_none() && !self.needs_reset() {
            if deadline.passed() {
                return Err("hostile-chain-not-met");
            }
            pause();
        }
        Ok(())
    }

    /// Acknowledges interrupt bits (InterruptACK), so a level-triggered line drops and the
    /// next interrupt is a new edge.
    pub fn ack_interrupt(&self, bits: u32) {
        self.write(REG_INTERRUPT_ACK, bits);
    }

    pub fn notify(&self, queue: &Queue) {
        compiler_fence(Ordering::SeqCst);
        self.write(REG_QUEUE_NOTIFY, queue.index as u32);
    }

    /// Writes 0 to Status and waits for the device to read back 0.
    pub fn reset(&self, ticks_per_ms: u64) -> Result<(), &'static str> {
        self.write(REG_STATUS, 0);
        let deadline = Deadline::after_ms(ticks_per_ms, 1000);
        while self.read(REG_STATUS) != 0 {
            if deadline.passed() {
                return Err("device-reset-timeout");
            }
            pause();
        }
        Ok(())
    }

    /// Device initialisation up to (not including) DRIVER_OK: reset, ACKNOWLEDGE, DRIVER,
    /// feature negotiation (VERSION_1 is always required), FEATURES_OK, then the queues.
    /// Returns the negotiated features.
    pub fn begin_init(
        &self,
        ticks_per_ms: u64,
        expected_device_id: u32,
        wanted: u64,
        queues: &mut [&mut Queue],
        pages: &mut [&mut RingPage],
    ) -> Result<u64, &'static str> {
        if self.read(REG_MAGIC) != VIRTIO_MAGIC {
            return Err("bad-magic");
        }
        if self.read(REG_VERSION) != 2 {
            return Err("not-virtio-mmio-version-2");
        }
        if self.read(REG_DEVICE_ID) != expected_device_id {
            return Err("wrong-device-id");
        }
        self.reset(ticks_per_ms)?;
        self.write(REG_STATUS, STATUS_ACKNOWLEDGE);
        self.write(REG_STATUS, STATUS_ACKNOWLEDGE | STATUS_DRIVER);

        self.write(REG_DEVICE_FEATURES_SEL, 0);
        let low = self.read(REG_DEVICE_FEATURES) as u64;
        self.write(REG_DEVICE_FEATURES_SEL, 1);
        let high = self.read(REG_DEVICE_FEATURES) as u64;
        let offered = (high << 32) | low;
        if offered & F_VERSION_1 == 0 {
            self.write(REG_STATUS, STATUS_FAILED);
            return Err("device-lacks-VERSION_1");
        }
        let features = offered & (wanted | F_VERSION_1);
        self.write(REG_DRIVER_FEATURES_SEL, 0);
        self.write(REG_DRIVER_FEATURES, features as u32);
        self.write(REG_DRIVER_FEATURES_SEL, 1);
        self.write(REG_DRIVER_FEATURES, (features >> 32) as u32);
        let status = STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK;
        self.write(REG_STATUS, status);
        if self.read(REG_STATUS) & STATUS_FEATURES_OK == 0 {
            self.write(REG_STATUS, STATUS_FAILED);
            return Err("FEATURES_OK-refused");
        }

        for (index, (queue, page)) in queues.iter_mut().zip(pages.iter_mut()).enumerate() {
            self.write(REG_QUEUE_SEL, index as u32);
            if self.read(REG_QUEUE_READY) != 0 {
                self.write(REG_STATUS, STATUS_FAILED);
                return Err("queue-already-ready");
            }
            let max = self.read(REG_QUEUE_NUM_MAX);
            if max == 0 {
                self.write(REG_STATUS, STATUS_FAILED);
                return Err("queue-unavailable");
            }
            // Largest power of two not above min(max, MAX_QUEUE_SIZE).
            let mut size = MAX_QUEUE_SIZE;
            while size as u32 > max {
                size /= 2;
            }
            page.0.fill(0);
            let ring = page.0.as_mut_ptr();
            **queue = Queue {
                ring,
                size,
                index: index as u16,
                avail_idx: 0,
                last_used: 0,
            };
            let desc = ring as u64;
            let avail = desc + AVAIL_OFFSET as u64;
            let used = desc + USED_OFFSET as u64;
            self.write(REG_QUEUE_NUM, size as u32);
            self.write(REG_QUEUE_DESC_LOW, desc as u32);
            self.write(REG_QUEUE_DESC_HIGH, (desc >> 32) as u32);
            self.write(REG_QUEUE_DRIVER_LOW, avail as u32);
            self.write(REG_QUEUE_DRIVER_HIGH, (avail >> 32) as u32);
            self.write(REG_QUEUE_DEVICE_LOW, used as u32);
            self.write(REG_QUEUE_DEVICE_HIGH, (used >> 32) as u32);
            self.write(REG_QUEUE_READY, 1);
        }
        Ok(features)
    }

    pub fn finish_init(&self) -> Result<(), &'static str> {
        let status = STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK | STATUS_DRIVER_OK;
        self.write(REG_STATUS, status);
        if self.read(REG_STATUS) & STATUS_DRIVER_OK == 0 {
            return Err("DRIVER_OK-refused");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            assert!(Hostile::parse(word).is_some());
        }
        assert!(Hostile::parse(b"LOOP").is_none());
    }
}
