//! MSI-X: the capability, the vector table and the pending-bit array (PBA).
//!
//! Each vector has a message address, data and a mask bit. A signal on a masked vector (or
//! with the function masked) sets its pending bit; unmasking delivers it. The messages go to
//! KVM as MSI routes ([`super::router::MsiRouter`]).

/// The MSI-X capability ID.
pub const MSIX_CAPABILITY_ID: u8 = 0x11;
/// Bytes per table entry.
pub const TABLE_ENTRY_SIZE: u64 = 16;
/// Most vectors a function can have (an 11-bit table size field).
pub const MAX_VECTORS: u16 = 2048;
/// Message control: MSI-X enable.
pub const CONTROL_ENABLE: u16 = 1 << 15;
/// Message control: function mask.
pub const CONTROL_FUNCTION_MASK: u16 = 1 << 14;
/// Vector control: mask bit.
const VECTOR_MASKED: u32 = 1;

use super::config::{ConfigError, ConfigSpace};

/// Errors from MSI-X emulation; each names the offending vector or access.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MsixError {
    /// The capability could not be added to configuration space.
    #[error("MSI-X capability: {0}")]
    Config(#[from] ConfigError),
    /// The table or PBA does not fit in its BAR, or the two overlap.
    #[error("MSI-X table ({table_bytes} bytes at BAR {table_bar} {table_offset:#x}) or PBA does not fit its BAR or they overlap")]
    Layout {
        /// The table's BAR.
        table_bar: u8,
        /// The table's offset.
        table_offset: u32,
        /// The table's size.
        table_bytes: u64,
    },
    /// A table size outside 1..=2048.
    #[error("an MSI-X table of {0} vectors; 1 to {MAX_VECTORS} are allowed")]
    VectorCount(usize),
    /// A vector beyond the table.
    #[error("MSI-X vector {vector} is beyond the table of {count}")]
    NoSuchVector {
        /// The vector.
        vector: u16,
        /// The table size.
        count: u16,
    },
    /// An access that is not an aligned dword or qword inside the structure.
    #[error("MSI-X {structure} access of {len} bytes at {offset:#x} is not an aligned dword or qword inside it")]
    BadAccess {
        /// "table" or "PBA".
        structure: &'static str,
        /// Offset in the structure.
        offset: u64,
        /// Access size.
        len: usize,
    },
    /// Saved vectors that do not fit this table.
    #[error("saved MSI-X state has {saved} vectors and {pending_words} pending words; this table has {vectors} vectors")]
    Shape {
        /// Vectors saved.
        saved: usize,
        /// Pending-bit words saved.
        pending_words: usize,
        /// Vectors in this table.
        vectors: u16,
    },
    /// A table or PBA offset that is not 8-byte aligned, or a BAR index above 5.
    #[error("MSI-X structure at BAR {bar} offset {offset:#x}: needs BAR 0-5 and 8-byte alignment")]
    Placement {
        /// The BAR index.
        bar: u8,
        /// The offset in the BAR.
        offset: u32,
    },
}

/// An MSI message: what the device writes, and where, to interrupt the CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MsiMessage {
    /// The message address (0xfeeX_XXXX on x86: destination APIC ID and mode).
    pub address: u64,
    /// The message data (vector and delivery mode on x86).
    pub data: u32,
}

/// What a signal on a vector did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// Deliver this message now.
    Deliver(MsiMessage),
    /// Masked: the pending bit is set; unmasking delivers it.
    Pending,
    /// MSI-X is off: nothing happens.
    Disabled,
}

/// Where a structure lives: a BAR and an offset in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BarOffset {
    /// BAR index (0-5).
    pub bar: u8,
    /// Offset in the BAR (8-byte aligned).
    pub offset: u32,
}

impl BarOffset {
    fn register(self) -> Result<u32, MsixError> {
        if self.bar > 5 || !self.offset.is_multiple_of(8) {
            return Err(MsixError::Placement {
                bar: self.bar,
                offset: self.offset,
            });
        }
        Ok(self.offset | u32::from(self.bar))
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    address_low: u32,
    address_high: u32,
    data: u32,
    control: u32,
}

impl Default for Entry {
    fn default() -> Self {
        // Every vector starts masked.
        Self {
            address_low: 0,
            address_high: 0,
            data: 0,
            control: VECTOR_MASKED,
        }
    }
}

impl Entry {
    fn message(&self) -> MsiMessage {
        MsiMessage {
            address: (u64::from(self.address_high) << 32) | u64::from(self.address_low),
            data: self.data,
        }
    }

    fn masked(&self) -> bool {
        self.control & VECTOR_MASKED != 0
    }
}

/// A function's MSI-X state.
pub struct Msix {
    entries: Vec<Entry>,
    pending: Vec<u64>,
    enabled: bool,
    function_masked: bool,
}

impl Msix {
    /// A table of `vectors` entries, all masked, MSI-X off.
    pub fn new(vectors: usize) -> Result<Self, MsixError> {
        if vectors == 0 || vectors > usize::from(MAX_VECTORS) {
            return Err(MsixError::VectorCount(vectors));
        }
        Ok(Self {
            entries: vec![Entry::default(); vectors],
            pending: vec![0; vectors.div_ceil(64)],
            enabled: false,
            function_masked: false,
        })
    }

    /// Number of vectors.
    pub fn vectors(&self) -> u16 {
        self.entries.len() as u16
    }

    /// Bytes the table takes in its BAR.
    pub fn table_bytes(&self) -> u64 {
        self.entries.len() as u64 * TABLE_ENTRY_SIZE
    }

    /// Bytes the PBA takes in its BAR (whole qwords).
    pub fn pba_bytes(&self) -> u64 {
        self.pending.len() as u64 * 8
    }

    /// The capability body after the ID and next pointer (message control, table and PBA
    /// locations) and its writable mask (enable and function mask only).
    pub fn capability(
        &self,
        table: BarOffset,
        pba: BarOffset,
    ) -> Result<([u8; 10], [u8; 10]), MsixError> {
        let mut body = [0u8; 10];
        let control = self.vectors() - 1;
        body[0..2].copy_from_slice(&control.to_le_bytes());
        body[2..6].copy_from_slice(&table.register()?.to_le_bytes());
        body[6..10].copy_from_slice(&pba.register()?.to_le_bytes());
        let mut writable = [0u8; 10];
        writable[0..2].copy_from_slice(&(CONTROL_ENABLE | CONTROL_FUNCTION_MASK).to_le_bytes());
        Ok((body, writable))
    }

    /// Whether MSI-X is on.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Whether the whole function is masked.
    pub fn function_masked(&self) -> bool {
        self.function_masked
    }

    /// The guest wrote message control (the value now in config space). Returns the
    /// pending vectors this unmasked, to deliver now.
    pub fn control_written(&mut self, control: u16) -> Vec<(u16, MsiMessage)> {
        self.enabled = control & CONTROL_ENABLE != 0;
        self.function_masked = control & CONTROL_FUNCTION_MASK != 0;
        self.deliver_unmasked_pending()
    }

    /// The message of `vector` if it would be delivered now (for a KVM route), else `None`.
    pub fn message(&self, vector: u16) -> Option<MsiMessage> {
        let entry = self.entries.get(usize::from(vector))?;
        (self.enabled && !self.function_masked && !entry.masked()).then(|| entry.message())
    }

    /// Whether `vector`'s pending bit is set.
    pub fn is_pending(&self, vector: u16) -> bool {
        let v = usize::from(vector);
        self.pending
            .get(v / 64)
            .is_some_and(|word| word & (1 << (v % 64)) != 0)
    }

    fn set_pending(&mut self, vector: usize, pending: bool) {
        let bit = 1u64 << (vector % 64);
        if let Some(word) = self.pending.get_mut(vector / 64) {
            if pending {
                *word |= bit;
            } else {
                *word &= !bit;
            }
        }
    }

    /// The device signals `vector`.
    pub fn signal(&mut self, vector: u16) -> Result<Signal, MsixError> {
        let count = self.vectors();
        let entry = self
            .entries
            .get(usize::from(vector))
            .ok_or(MsixError::NoSuchVector { vector, count })?;
        if !self.enabled {
            return Ok(Signal::Disabled);
        }
        if self.function_masked || entry.masked() {
            self.set_pending(usize::from(vector), true);
            return Ok(Signal::Pending);
        }
        Ok(Signal::Deliver(entry.message()))
    }

    fn deliver_unmasked_pending(&mut self) -> Vec<(u16, MsiMessage)> {
        let mut delivered = Vec::new();
        if !self.enabled || self.function_masked {
            return delivered;
        }
        for vector in 0..self.entries.len() {
            let entry = self.entries[vector];
            if !entry.masked() && self.is_pending(vector as u16) {
                self.set_pending(vector, false);
                delivered.push((vector as u16, entry.message()));
            }
        }
        delivered
    }

    /// Each vector's table entry: address low, address high, data, vector control.
    pub fn table(&self) -> Vec<[u32; 4]> {
        self.entries
            .iter()
            .map(|e| [e.address_low, e.address_high, e.data, e.control])
            .collect()
    }

    /// The pending bits, 64 vectors a word.
    pub fn pending_words(&self) -> &[u64] {
        &self.pending
    }

    /// Puts back a table, pending bits and control saved from a function of this size.
    pub fn restore(
        &mut self,
        table: &[[u32; 4]],
        pending: &[u64],
        enabled: bool,
        function_masked: bool,
    ) -> Result<(), MsixError> {
        if table.len() != self.entries.len() || pending.len() != self.pending.len() {
            return Err(MsixError::Shape {
                saved: table.len(),
                pending_words: pending.len(),
                vectors: self.vectors(),
            });
        }
        for (entry, saved) in self.entries.iter_mut().zip(table) {
            *entry = Entry {
                address_low: saved[0] & !0b11,
                address_high: saved[1],
                data: saved[2],
                control: saved[3] & VECTOR_MASKED,
            };
        }
        self.pending.copy_from_slice(pending);
        self.enabled = enabled;
        self.function_masked = function_masked;
        Ok(())
    }

    fn check_access(
        structure: &'static str,
        offset: u64,
        len: usize,
        size: u64,
    ) -> Result<(), MsixError> {
        let ok = matches!(len, 4 | 8)
            && offset.is_multiple_of(len as u64)
            && offset
                .checked_add(len as u64)
                .is_some_and(|end| end <= size);
        if ok {
            Ok(())
        } else {
            Err(MsixError::BadAccess {
                structure,
                offset,
                len,
            })
        }
    }

    fn table_dword(&self, offset: u64) -> u32 {
        let entry = &self.entries[(offset / TABLE_ENTRY_SIZE) as usize];
        match offset % TABLE_ENTRY_SIZE {
            0 => entry.address_low,
            4 => entry.address_high,
            8 => entry.data,
            _ => entry.control,
        }
    }

    /// Guest read of the table at `offset` (dword or qword, aligned).
    pub fn read_table(&self, offset: u64, data: &mut [u8]) -> Result<(), MsixError> {
        Self::check_access("table", offset, data.len(), self.table_bytes())?;
        for (i, chunk) in data.chunks_mut(4).enumerate() {
            chunk.copy_from_slice(&self.table_dword(offset + 4 * i as u64).to_le_bytes());
        }
        Ok(())
    }

    /// Guest write of the table at `offset` (dword or qword, aligned). Returns the pending
    /// vectors this unmasked, to deliver now.
    pub fn write_table(
        &mut self,
        offset: u64,
        data: &[u8],
    ) -> Result<Vec<(u16, MsiMessage)>, MsixError> {
        Self::check_access("table", offset, data.len(), self.table_bytes())?;
        for (i, chunk) in data.chunks(4).enumerate() {
            let at = offset + 4 * i as u64;
            let mut word = [0u8; 4];
            word.copy_from_slice(chunk);
            let value = u32::from_le_bytes(word);
            let entry = &mut self.entries[(at / TABLE_ENTRY_SIZE) as usize];
            match at % TABLE_ENTRY_SIZE {
                // The address is dword aligned: its two low bits read zero.
                0 => entry.address_low = value & !0b11,
                4 => entry.address_high = value,
                8 => entry.data = value,
                // Only the mask bit is defined in vector control.
                _ => entry.control = value & VECTOR_MASKED,
            }
        }
        Ok(self.deliver_unmasked_pending())
    }

    /// Guest read of the PBA at `offset` (dword or qword, aligned). The PBA is read-only.
    pub fn read_pba(&self, offset: u64, data: &mut [u8]) -> Result<(), MsixError> {
        Self::check_access("PBA", offset, data.len(), self.pba_bytes())?;
        let bytes: Vec<u8> = self.pending.iter().flat_map(|w| w.to_le_bytes()).collect();
        let start = offset as usize;
        data.copy_from_slice(&bytes[start..start + data.len()]);
        Ok(())
    }
}

/// MSI-X as a function has it: the capability in its configuration space, and the table and
/// PBA in its BARs.
pub struct MsixCapability {
    offset: usize,
    table: BarOffset,
    pba: BarOffset,
    /// The vectors.
    pub state: Msix,
}

impl MsixCapability {
    /// Adds an MSI-X capability of `vectors` to `config`, with the table and PBA at the given
    /// places; the BARs must be declared and big enough.
    pub fn add_to(
        config: &mut ConfigSpace,
        vectors: usize,
        table: BarOffset,
        pba: BarOffset,
    ) -> Result<Self, MsixError> {
        let state = Msix::new(vectors)?;
        let fits = |place: BarOffset, len: u64| {
            config
                .bar(usize::from(place.bar))
                .is_some_and(|bar| u64::from(place.offset) + len <= bar.size)
        };
        let range = |place: BarOffset, len: u64| {
            let start = u64::from(place.offset);
            (place.bar, start, start + len)
        };
        let (tb, ts, te) = range(table, state.table_bytes());
        let (pb, ps, pe) = range(pba, state.pba_bytes());
        let overlap = tb == pb && ts < pe && ps < te;
        if !fits(table, state.table_bytes()) || !fits(pba, state.pba_bytes()) || overlap {
            return Err(MsixError::Layout {
                table_bar: table.bar,
                table_offset: table.offset,
                table_bytes: state.table_bytes(),
            });
        }
        let (body, writable) = state.capability(table, pba)?;
        let offset = config.add_capability(MSIX_CAPABILITY_ID, &body, &writable)?;
        Ok(Self {
            offset,
            table,
            pba,
            state,
        })
    }

    /// The capability's offset in configuration space.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// After a guest configuration write of `len` bytes at `offset` (already applied to
    /// `config`): picks up message control when the write touched it. Returns the pending
    /// vectors to deliver now.
    pub fn config_written(
        &mut self,
        config: &ConfigSpace,
        offset: usize,
        len: usize,
    ) -> Vec<(u16, MsiMessage)> {
        let control = self.offset + 2;
        if offset < control + 2 && control < offset + len {
            self.state.control_written(config.u16_at(control))
        } else {
            Vec::new()
        }
    }

    fn place(&self, bar: usize, offset: u64) -> Option<(bool, u64)> {
        let inside = |place: BarOffset, len: u64| {
            let start = u64::from(place.offset);
            (usize::from(place.bar) == bar && offset >= start && offset < start + len)
                .then(|| offset - start)
        };
        inside(self.table, self.state.table_bytes())
            .map(|at| (true, at))
            .or_else(|| inside(self.pba, self.state.pba_bytes()).map(|at| (false, at)))
    }

    /// A BAR read: `None` when it is not in the table or PBA (the device handles it).
    pub fn read_bar(
        &self,
        bar: usize,
        offset: u64,
        data: &mut [u8],
    ) -> Option<Result<(), MsixError>> {
        let (table, at) = self.place(bar, offset)?;
        Some(if table {
            self.state.read_table(at, data)
        } else {
            self.state.read_pba(at, data)
        })
    }

    /// A BAR write: `None` when it is not in the table or PBA. PBA writes are ignored (it is
    /// read-only). Returns the pending vectors to deliver now.
    pub fn write_bar(
        &mut self,
        bar: usize,
        offset: u64,
        data: &[u8],
    ) -> Option<Result<Vec<(u16, MsiMessage)>, MsixError>> {
        let (table, at) = self.place(bar, offset)?;
        Some(if table {
            self.state.write_table(at, data)
        } else {
            Ok(Vec::new())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::pci::config::{Bar, BarKind, DeviceIdentity};

    fn write32(msix: &mut Msix, offset: u64, value: u32) -> Vec<(u16, MsiMessage)> {
        msix.write_table(offset, &value.to_le_bytes())
            .expect("table write")
    }

    fn read32(msix: &Msix, offset: u64) -> u32 {
        let mut data = [0u8; 4];
        msix.read_table(offset, &mut data).expect("table read");
        u32::from_le_bytes(data)
    }

    fn program(msix: &mut Msix, vector: u16, address: u64, data: u32) {
        let base = u64::from(vector) * TABLE_ENTRY_SIZE;
        let mut qword = [0u8; 8];
        qword.copy_from_slice(&address.to_le_bytes());
        assert!(msix.write_table(base, &qword).expect("address").is_empty());
        write32(msix, base + 8, data);
    }

    #[test]
    fn table_sizes_and_capability_bytes() {
        assert_eq!(Msix::new(0).err(), Some(MsixError::VectorCount(0)));
        assert_eq!(Msix::new(2049).err(), Some(MsixError::VectorCount(2049)));
        let msix = Msix::new(65).expect("msix");
        assert_eq!(msix.table_bytes(), 65 * 16);
        assert_eq!(msix.pba_bytes(), 16);
        let (body, writable) = msix
            .capability(
                BarOffset { bar: 4, offset: 0 },
                BarOffset {
                    bar: 4,
                    offset: 0x2000,
                },
            )
            .expect("capability");
        assert_eq!(u16::from_le_bytes([body[0], body[1]]), 64, "N - 1");
        assert_eq!(u32::from_le_bytes(body[2..6].try_into().expect("4")), 4);
        assert_eq!(
            u32::from_le_bytes(body[6..10].try_into().expect("4")),
            0x2004
        );
        assert_eq!(u16::from_le_bytes([writable[0], writable[1]]), 0xc000);
        assert_eq!(&writable[2..], &[0; 8]);
        assert!(matches!(
            msix.capability(
                BarOffset { bar: 6, offset: 0 },
                BarOffset { bar: 0, offset: 0 }
            ),
            Err(MsixError::Placement { bar: 6, .. })
        ));
        assert!(msix
            .capability(
                BarOffset { bar: 0, offset: 4 },
                BarOffset { bar: 0, offset: 0 }
            )
            .is_err());
    }

    #[test]
    fn vectors_start_masked_and_the_table_reads_back() {
        let mut msix = Msix::new(4).expect("msix");
        for v in 0..4 {
            assert_eq!(read32(&msix, v * 16 + 12), 1, "vector {v} masked");
        }
        program(&mut msix, 2, 0xfee0_1003, 0x4041);
        assert_eq!(read32(&msix, 32), 0xfee0_1000, "low address bits read zero");
        assert_eq!(read32(&msix, 36), 0);
        assert_eq!(read32(&msix, 40), 0x4041);
        let mut qword = [0u8; 8];
        msix.read_table(40, &mut qword).expect("qword");
        assert_eq!(u64::from_le_bytes(qword), 0x0000_0001_0000_4041);
        // Reserved vector-control bits stay zero.
        write32(&mut msix, 44, 0xffff_fffe);
        assert_eq!(read32(&msix, 44), 0);
    }

    #[test]
    fn bad_table_and_pba_accesses_are_refused() {
        let mut msix = Msix::new(2).expect("msix");
        let mut two = [0u8; 2];
        assert!(matches!(
            msix.read_table(0, &mut two),
            Err(MsixError::BadAccess { len: 2, .. })
        ));
        assert!(msix.write_table(2, &[0; 4]).is_err());
        assert!(
            msix.write_table(4, &[0; 8]).is_err(),
            "qword at dword offset"
        );
        assert!(msix.write_table(32, &[0; 4]).is_err(), "past the table");
        let mut four = [0u8; 4];
        assert!(msix.read_pba(8, &mut four).is_err());
        assert!(msix.read_pba(4, &mut four).is_ok());
        assert_eq!(
            msix.signal(2),
            Err(MsixError::NoSuchVector {
                vector: 2,
                count: 2
            })
        );
    }

    #[test]
    fn signal_delivers_only_when_enabled_and_unmasked() {
        let mut msix = Msix::new(3).expect("msix");
        program(&mut msix, 1, 0xfee0_0000, 0x31);
        assert_eq!(msix.signal(1), Ok(Signal::Disabled));
        assert!(!msix.is_pending(1));
        assert!(msix.control_written(CONTROL_ENABLE).is_empty());
        assert!(msix.enabled());
        // Still masked per vector: pending.
        assert_eq!(msix.signal(1), Ok(Signal::Pending));
        assert!(msix.is_pending(1));
        assert_eq!(msix.message(1), None);
        let mut pba = [0u8; 8];
        msix.read_pba(0, &mut pba).expect("pba");
        assert_eq!(u64::from_le_bytes(pba), 0b010);
        // Unmasking delivers the pending message once and clears the bit.
        let delivered = write32(&mut msix, 16 + 12, 0);
        let message = MsiMessage {
            address: 0xfee0_0000,
            data: 0x31,
        };
        assert_eq!(delivered, vec![(1, message)]);
        assert!(!msix.is_pending(1));
        assert_eq!(msix.message(1), Some(message));
        assert_eq!(msix.signal(1), Ok(Signal::Deliver(message)));
        assert!(write32(&mut msix, 16 + 12, 0).is_empty(), "nothing pending");
    }

    #[test]
    fn function_mask_holds_every_vector_pending() {
        let mut msix = Msix::new(70).expect("msix");
        for v in [0u16, 69] {
            program(&mut msix, v, 0xfee0_0000, 0x40 + u32::from(v));
            write32(&mut msix, u64::from(v) * 16 + 12, 0);
        }
        msix.control_written(CONTROL_ENABLE | CONTROL_FUNCTION_MASK);
        assert!(msix.function_masked());
        assert_eq!(msix.signal(0), Ok(Signal::Pending));
        assert_eq!(msix.signal(69), Ok(Signal::Pending));
        assert_eq!(msix.message(0), None);
        let mut pba = [0u8; 4];
        msix.read_pba(8, &mut pba)
            .expect("pba high qword, low dword");
        assert_eq!(
            u32::from_le_bytes(pba),
            1 << 5,
            "vector 69 is bit 5 of qword 1"
        );
        // Masking the vector itself keeps it pending through the function unmask.
        write32(&mut msix, 69 * 16 + 12, 1);
        let delivered = msix.control_written(CONTROL_ENABLE);
        assert_eq!(
            delivered,
            vec![(
                0,
                MsiMessage {
                    address: 0xfee0_0000,
                    data: 0x40
                }
            )]
        );
        assert!(msix.is_pending(69));
        assert_eq!(write32(&mut msix, 69 * 16 + 12, 0).len(), 1);
        assert!(!msix.is_pending(69));
        // Disabling drops nothing that is pending but delivers nothing either.
        msix.control_written(0);
        assert_eq!(msix.signal(0), Ok(Signal::Disabled));
    }

    #[test]
    fn the_guest_drives_msix_through_config_space_and_the_bar() {
        let mut config = ConfigSpace::new(DeviceIdentity::default());
        config
            .add_bar(
                0,
                Bar {
                    kind: BarKind::Memory32 {
                        prefetchable: false,
                    },
                    size: 0x4000,
                },
            )
            .expect("bar");
        let table = BarOffset { bar: 0, offset: 0 };
        let pba = BarOffset {
            bar: 0,
            offset: 0x2000,
        };
        let mut cap = MsixCapability::add_to(&mut config, 8, table, pba).expect("msix");
        assert_eq!(cap.offset(), 0x40);
        let mut dword = [0u8; 4];
        config.read(0x40, &mut dword);
        assert_eq!(
            u32::from_le_bytes(dword),
            0x0007_0011,
            "ID, no next, N-1 = 7"
        );
        // The guest programs vector 3 and enables MSI-X with the function masked.
        let entry = 3 * TABLE_ENTRY_SIZE;
        assert_eq!(
            cap.write_bar(0, entry, &0xfee0_0000u32.to_le_bytes()),
            Some(Ok(vec![]))
        );
        assert!(cap
            .write_bar(0, entry + 8, &0x61u32.to_le_bytes())
            .is_some());
        assert!(cap.write_bar(0, entry + 12, &0u32.to_le_bytes()).is_some());
        let control = CONTROL_ENABLE | CONTROL_FUNCTION_MASK | 0x7ff;
        assert!(config.write(0x42, &control.to_le_bytes()));
        assert!(cap.config_written(&config, 0x42, 2).is_empty());
        assert_eq!(
            config.u16_at(0x42),
            CONTROL_ENABLE | CONTROL_FUNCTION_MASK | 7
        );
        assert_eq!(cap.state.signal(3), Ok(Signal::Pending));
        let mut qword = [0u8; 8];
        assert_eq!(cap.read_bar(0, 0x2000, &mut qword), Some(Ok(())));
        assert_eq!(u64::from_le_bytes(qword), 1 << 3);
        // PBA writes do nothing; accesses outside the table and PBA are the device's.
        assert_eq!(cap.write_bar(0, 0x2000, &[0; 8]), Some(Ok(vec![])));
        assert!(cap.state.is_pending(3));
        assert_eq!(cap.read_bar(0, 0x3000, &mut qword), None);
        assert_eq!(cap.read_bar(1, 0, &mut qword), None);
        // A write elsewhere in config space leaves MSI-X alone.
        assert!(config.write(0x04, &[0x02]));
        assert!(cap.config_written(&config, 0x04, 1).is_empty());
        assert!(cap.state.function_masked());
        // A dword write over the capability header clears the function mask: delivery.
        let header = 0x11 | (u32::from(CONTROL_ENABLE) << 16);
        assert!(config.write(0x40, &header.to_le_bytes()));
        assert_eq!(
            cap.config_written(&config, 0x40, 4),
            vec![(
                3,
                MsiMessage {
                    address: 0xfee0_0000,
                    data: 0x61
                }
            )]
        );
        assert!(!cap.state.is_pending(3));
    }

    #[test]
    fn a_table_that_does_not_fit_its_bar_is_refused() {
        let mut config = ConfigSpace::new(DeviceIdentity::default());
        config
            .add_bar(
                0,
                Bar {
                    kind: BarKind::Memory32 {
                        prefetchable: false,
                    },
                    size: 0x1000,
                },
            )
            .expect("bar");
        let at = |offset| BarOffset { bar: 0, offset };
        assert!(matches!(
            MsixCapability::add_to(&mut config, 512, at(0), at(0x800)),
            Err(MsixError::Layout { .. })
        ));
        assert!(matches!(
            MsixCapability::add_to(&mut config, 8, at(0), at(0x40)),
            Err(MsixError::Layout { .. })
        ));
        assert!(matches!(
            MsixCapability::add_to(&mut config, 8, at(0), BarOffset { bar: 1, offset: 0 }),
            Err(MsixError::Layout { .. })
        ));
        assert!(MsixCapability::add_to(&mut config, 8, at(0), at(0x80)).is_ok());
    }
}
