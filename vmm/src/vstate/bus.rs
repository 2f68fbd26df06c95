//! Port-I/O and MMIO buses: address ranges mapped to devices that vCPU threads call into.

use std::sync::{Arc, Mutex, MutexGuard};

/// A device on a bus. `offset` is relative to the start of the device's range.
pub trait BusDevice: Send {
    /// Guest read of `data.len()` bytes.
    fn read(&mut self, offset: u64, data: &mut [u8]);
    /// Guest write of `data`.
    fn write(&mut self, offset: u64, data: &[u8]);
}

/// Errors from building a bus.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    /// Two devices claim overlapping ranges.
    #[error("bus range {start:#x}+{len:#x} overlaps an existing device")]
    Overlap {
        /// Start of the new range.
        start: u64,
        /// Its length.
        len: u64,
    },
    /// A zero-length range.
    #[error("bus range at {0:#x} has zero length")]
    Empty(u64),
}

/// A shared device handle.
pub type SharedDevice = Arc<Mutex<dyn BusDevice>>;

struct Entry {
    start: u64,
    len: u64,
    device: SharedDevice,
}

/// Sorted, non-overlapping device ranges.
#[derive(Default)]
pub struct Bus {
    entries: Vec<Entry>,
}

/// Locks a mutex, recovering the data if another thread panicked while holding it.
pub fn lock<T: ?Sized>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Bus {
    /// Adds `device` at `[start, start + len)`.
    pub fn insert(&mut self, device: SharedDevice, start: u64, len: u64) -> Result<(), BusError> {
        if len == 0 {
            return Err(BusError::Empty(start));
        }
        let end = start
            .checked_add(len)
            .ok_or(BusError::Overlap { start, len })?;
        if self
            .entries
            .iter()
            .any(|e| start < e.start + e.len && e.start < end)
        {
            return Err(BusError::Overlap { start, len });
        }
        let pos = self.entries.partition_point(|e| e.start < start);
        self.entries.insert(pos, Entry { start, len, device });
        Ok(())
    }

    fn find(&self, addr: u64) -> Option<(&Entry, u64)> {
        let pos = self.entries.partition_point(|e| e.start <= addr);
        let entry = self.entries.get(pos.checked_sub(1)?)?;
        let offset = addr - entry.start;
        (offset < entry.len).then_some((entry, offset))
    }

    /// Dispatches a read; returns false when no device claims `addr`.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.find(addr) {
            Some((entry, offset)) => {
                lock(&entry.device).read(offset, data);
                true
            }
            None => false,
        }
    }

    /// Dispatches a write; returns false when no device claims `addr`.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.find(addr) {
            Some((entry, offset)) => {
                lock(&entry.device).write(offset, data);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Echo(u8);
    impl BusDevice for Echo {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(self.0 + offset as u8);
        }
        fn write(&mut self, _offset: u64, data: &[u8]) {
            self.0 = data[0];
        }
    }

    #[test]
    fn dispatches_by_range() {
        let mut bus = Bus::default();
        bus.insert(Arc::new(Mutex::new(Echo(1))), 0x10, 8)
            .expect("insert");
        bus.insert(Arc::new(Mutex::new(Echo(100))), 0x20, 8)
            .expect("insert");
        let mut b = [0u8; 1];
        assert!(bus.read(0x12, &mut b));
        assert_eq!(b[0], 3);
        assert!(bus.write(0x20, &[50]));
        assert!(bus.read(0x21, &mut b));
        assert_eq!(b[0], 51);
        assert!(!bus.read(0x18, &mut b));
        assert!(!bus.read(0x0, &mut b));
    }

    #[test]
    fn rejects_overlap() {
        let mut bus = Bus::default();
        bus.insert(Arc::new(Mutex::new(Echo(1))), 0x10, 8)
            .expect("insert");
        assert!(bus.insert(Arc::new(Mutex::new(Echo(1))), 0x17, 8).is_err());
        assert!(bus.insert(Arc::new(Mutex::new(Echo(1))), 0x30, 0).is_err());
    }
}
