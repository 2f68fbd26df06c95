//! rollbox extension: a VM generation counter at I/O ports 0x3c8-0x3cf. It changes when a
//! restore asks for a new generation (a clone), so a guest can tell it was cloned and reseed
//! itself; a deterministic restore keeps it. Reads return the 64-bit value little-endian.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::devices::bus::BusDevice;

/// First port of the counter.
pub const GENERATION_PORT: u16 = 0x3c8;
/// Number of ports.
pub const GENERATION_PORT_LEN: u64 = 8;

/// The read-only generation register.
pub struct Generation(pub Arc<AtomicU64>);

impl BusDevice for Generation {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let bytes = self.0.load(Ordering::SeqCst).to_le_bytes();
        for (i, b) in data.iter_mut().enumerate() {
            *b = bytes.get(offset as usize + i).copied().unwrap_or(0);
        }
    }

    fn write(&mut self, _offset: u64, _data: &[u8]) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_halves() {
        let mut g = Generation(Arc::new(AtomicU64::new(0x1122_3344_5566_7788)));
        let mut lo = [0u8; 4];
        let mut hi = [0u8; 4];
        g.read(0, &mut lo);
        g.read(4, &mut hi);
        assert_eq!(u32::from_le_bytes(lo), 0x5566_7788);
        assert_eq!(u32::from_le_bytes(hi), 0x1122_3344);
    }
}
