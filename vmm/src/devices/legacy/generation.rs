//! rollbox extension: the VM generation counter and the host's wall clock, at I/O ports
//! 0x3c8-0x3d7, and the ACPI VM generation ID (VMGenID).
//!
//! - 0x3c8-0x3cf: the generation counter (64-bit little-endian). It changes when a restore asks
//!   for a new generation (a clone); a deterministic restore keeps it. The guest agent reads it
//!   to re-identify a clone.
//! - 0x3d0-0x3d7: the host's CLOCK_REALTIME in nanoseconds (64-bit little-endian, latched when
//!   the low half is read), so the agent can step the guest's wall clock after a restore. It
//!   reads 0 when not offered (a deterministic restore keeps guest time as the snapshot had it).
//!
//! The VMGenID is 16 bytes in reserved guest memory ([`VMGENID_ADDR`], named by the DSDT). A new
//! generation writes a new ID there and raises the ACPI Generic Event Device's interrupt; the
//! guest kernel's vmgenid driver then reseeds its CRNG at once.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use crate::arch::layout::VMGENID_ADDR;
use crate::vstate::bus::BusDevice;
use crate::vstate::memory::GuestMemoryMmap;

/// First port of the counter.
pub const GENERATION_PORT: u16 = 0x3c8;
/// Number of ports: the counter, then the host's wall clock.
pub const GENERATION_PORT_LEN: u64 = 16;
const WALL_CLOCK_OFFSET: u64 = 8;

/// The read-only generation and wall-clock registers.
pub struct Generation {
    counter: Arc<AtomicU64>,
    offer_wall_clock: bool,
    latched_clock: [u8; 8],
}

impl Generation {
    /// Registers over `counter`; the wall clock reads 0 unless `offer_wall_clock`.
    pub fn new(counter: Arc<AtomicU64>, offer_wall_clock: bool) -> Self {
        Self {
            counter,
            offer_wall_clock,
            latched_clock: [0; 8],
        }
    }
}

fn host_realtime_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

impl BusDevice for Generation {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let (bytes, base) = if offset < WALL_CLOCK_OFFSET {
            (self.counter.load(Ordering::SeqCst).to_le_bytes(), 0)
        } else {
            if offset == WALL_CLOCK_OFFSET && self.offer_wall_clock {
                self.latched_clock = host_realtime_ns().to_le_bytes();
            }
            (self.latched_clock, WALL_CLOCK_OFFSET)
        };
        for (i, b) in data.iter_mut().enumerate() {
            *b = bytes
                .get((offset - base) as usize + i)
                .copied()
                .unwrap_or(0);
        }
    }

    fn write(&mut self, _offset: u64, _data: &[u8]) {}
}

/// Errors from announcing a VM generation.
#[derive(Debug, thiserror::Error)]
pub enum GenerationError {
    /// The ID could not be written into guest memory.
    #[error("cannot write the VM generation ID at {VMGENID_ADDR:#x}: {0}")]
    Write(vm_memory::GuestMemoryError),
    /// The guest could not be told.
    #[error("cannot raise the ACPI generation-change interrupt: {0}")]
    Notify(std::io::Error),
}

/// A fresh random 16-byte VM generation ID.
pub fn random_generation_id() -> [u8; 16] {
    let mut id = [0u8; 16];
    id[..8].copy_from_slice(&snapshot::memory::random_id().to_le_bytes());
    id[8..].copy_from_slice(&snapshot::memory::random_id().to_le_bytes());
    id
}

/// Writes the VM generation ID the guest's VMGenID driver reads (at boot: no notification).
pub fn write_generation_id(mem: &GuestMemoryMmap, id: [u8; 16]) -> Result<(), GenerationError> {
    mem.write_slice(&id, GuestAddress(VMGENID_ADDR))
        .map_err(GenerationError::Write)
}

/// Writes a new VM generation ID and raises the Generic Event Device's interrupt, whose `_EVT`
/// notifies the VMGenID device. Call with the vCPUs' state restored, before they run.
pub fn announce_new_generation(
    mem: &GuestMemoryMmap,
    ged_interrupt: &EventFd,
) -> Result<(), GenerationError> {
    write_generation_id(mem, random_generation_id())?;
    ged_interrupt.write(1).map_err(GenerationError::Notify)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_halves() {
        let mut g = Generation::new(Arc::new(AtomicU64::new(0x1122_3344_5566_7788)), false);
        let mut lo = [0u8; 4];
        let mut hi = [0u8; 4];
        g.read(0, &mut lo);
        g.read(4, &mut hi);
        assert_eq!(u32::from_le_bytes(lo), 0x5566_7788);
        assert_eq!(u32::from_le_bytes(hi), 0x1122_3344);
    }

    #[test]
    fn wall_clock_is_latched_by_the_low_half_and_zero_when_not_offered() {
        let mut off = Generation::new(Arc::new(AtomicU64::new(1)), false);
        let mut clock = [0u8; 8];
        off.read(8, &mut clock);
        assert_eq!(u64::from_le_bytes(clock), 0);

        let mut on = Generation::new(Arc::new(AtomicU64::new(1)), true);
        let mut lo = [0u8; 4];
        let mut hi = [0u8; 4];
        let before = host_realtime_ns();
        on.read(8, &mut lo);
        std::thread::sleep(std::time::Duration::from_millis(2));
        on.read(12, &mut hi);
        let after = host_realtime_ns();
        let ns = u64::from(u32::from_le_bytes(lo)) | (u64::from(u32::from_le_bytes(hi)) << 32);
        assert!(ns >= before && ns <= after, "{before} <= {ns} <= {after}");
        let mut whole = [0u8; 8];
        on.read(8, &mut whole);
        assert!(u64::from_le_bytes(whole) >= ns);
    }
}
