//! A type-0 PCI configuration space: 256 bytes of PCI header and capabilities, plus the
//! 4 KiB PCI Express extended space that ECAM reaches (empty here).
//!
//! Every byte has a writable mask and a write-1-to-clear mask, so BAR sizing falls out of
//! the masks: a BAR of size S has its address bits below S read-only zero, and writing all
//! ones reads back the size mask with the type bits.

/// Size of the configuration space ECAM exposes.
pub const CONFIG_SPACE_SIZE: usize = 4096;
/// Size of the conventional space that CF8/CFC reaches.
pub const LEGACY_CONFIG_SIZE: usize = 256;
/// Number of BARs in a type-0 header.
pub const BAR_COUNT: usize = 6;

/// Register offsets in the type-0 header.
pub mod reg {
    /// Vendor ID (16 bits).
    pub const VENDOR_ID: usize = 0x00;
    /// Device ID (16 bits).
    pub const DEVICE_ID: usize = 0x02;
    /// Command (16 bits).
    pub const COMMAND: usize = 0x04;
    /// Status (16 bits).
    pub const STATUS: usize = 0x06;
    /// Revision ID (8 bits), then the 24-bit class code.
    pub const REVISION_ID: usize = 0x08;
    /// Cache line size (8 bits).
    pub const CACHE_LINE_SIZE: usize = 0x0c;
    /// Latency timer (8 bits).
    pub const LATENCY_TIMER: usize = 0x0d;
    /// Header type (8 bits).
    pub const HEADER_TYPE: usize = 0x0e;
    /// BAR 0; BAR n is at `BAR0 + 4 * n`.
    pub const BAR0: usize = 0x10;
    /// Subsystem vendor ID (16 bits).
    pub const SUBSYSTEM_VENDOR_ID: usize = 0x2c;
    /// Subsystem ID (16 bits).
    pub const SUBSYSTEM_ID: usize = 0x2e;
    /// Capabilities pointer (8 bits).
    pub const CAPABILITIES: usize = 0x34;
    /// Interrupt line (8 bits).
    pub const INTERRUPT_LINE: usize = 0x3c;
    /// Interrupt pin (8 bits).
    pub const INTERRUPT_PIN: usize = 0x3d;
    /// Where capabilities start.
    pub const FIRST_CAPABILITY: usize = 0x40;
}

/// Command register bits.
pub mod command {
    /// I/O space decoding.
    pub const IO_SPACE: u16 = 1 << 0;
    /// Memory space decoding.
    pub const MEMORY_SPACE: u16 = 1 << 1;
    /// Bus mastering (DMA and MSI).
    pub const BUS_MASTER: u16 = 1 << 2;
    /// Parity error response.
    pub const PARITY_ERROR_RESPONSE: u16 = 1 << 6;
    /// SERR# enable.
    pub const SERR: u16 = 1 << 8;
    /// INTx emulation disabled.
    pub const INTX_DISABLE: u16 = 1 << 10;
}

/// Status register: the device has a capability list.
pub const STATUS_CAPABILITIES: u16 = 1 << 4;
/// Status register bits that are write-1-to-clear (error bits 15..11 and 8).
const STATUS_W1C: u16 = 0xf900;

/// Errors from building a configuration space.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// BAR index out of range or already taken (a 64-bit BAR takes two).
    #[error("BAR {0} is out of range or already in use")]
    BarTaken(usize),
    /// A BAR size that is not a power of two or is below the minimum for its kind.
    #[error("BAR {index} size {size:#x} is not a power of two of at least {min:#x}")]
    BarSize {
        /// The BAR.
        index: usize,
        /// The size asked for.
        size: u64,
        /// The minimum for its kind.
        min: u64,
    },
    /// The capability does not fit in the 256-byte space.
    #[error("capability {id:#x} of {len} bytes does not fit in configuration space")]
    CapabilityTooBig {
        /// Capability ID.
        id: u8,
        /// Its length including the ID and next pointer.
        len: usize,
    },
    /// A capability's body and its mask differ in length.
    #[error("capability {id:#x}: body of {body} bytes, mask of {mask} bytes")]
    CapabilityMask {
        /// Capability ID.
        id: u8,
        /// Body length.
        body: usize,
        /// Mask length.
        mask: usize,
    },
    /// A BAR address that its size does not align, or that does not fit its kind.
    #[error("BAR {index} cannot sit at {addr:#x}")]
    BarAddress {
        /// The BAR.
        index: usize,
        /// The address.
        addr: u64,
    },
}

/// What a BAR decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BarKind {
    /// I/O ports.
    Io,
    /// Memory below 4 GiB.
    Memory32 {
        /// Reads have no side effects.
        prefetchable: bool,
    },
    /// Memory anywhere in the 64-bit space; takes two BAR registers.
    Memory64 {
        /// Reads have no side effects.
        prefetchable: bool,
    },
}

impl BarKind {
    /// The read-only low bits of the BAR register.
    fn type_bits(self) -> u32 {
        match self {
            BarKind::Io => 0b01,
            BarKind::Memory32 { prefetchable } => u32::from(prefetchable) << 3,
            BarKind::Memory64 { prefetchable } => 0b100 | (u32::from(prefetchable) << 3),
        }
    }

    fn min_size(self) -> u64 {
        match self {
            BarKind::Io => 4,
            _ => 16,
        }
    }

    fn max_size(self) -> u64 {
        match self {
            BarKind::Io => 1 << 16,
            BarKind::Memory32 { .. } => 1 << 31,
            BarKind::Memory64 { .. } => 1 << 63,
        }
    }
}

/// A BAR as the device declared it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bar {
    /// What it decodes.
    pub kind: BarKind,
    /// Its size in bytes (a power of two).
    pub size: u64,
}

/// A BAR the guest has placed: where it decodes now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BarRegion {
    /// BAR index (the low register of a 64-bit BAR).
    pub index: usize,
    /// The declared BAR.
    pub bar: Bar,
    /// Its current address.
    pub addr: u64,
}

/// A type-0 configuration space.
pub struct ConfigSpace {
    bytes: Box<[u8; CONFIG_SPACE_SIZE]>,
    writable: Box<[u8; CONFIG_SPACE_SIZE]>,
    write_one_clears: Box<[u8; CONFIG_SPACE_SIZE]>,
    bars: [Option<Bar>; BAR_COUNT],
    /// BAR registers that are the upper half of a 64-bit BAR.
    upper_halves: [bool; BAR_COUNT],
    next_capability: usize,
    last_capability: Option<usize>,
}

/// The identity a device shows in its header.
#[derive(Debug, Clone, Copy, Default)]
pub struct DeviceIdentity {
    /// Vendor ID.
    pub vendor: u16,
    /// Device ID.
    pub device: u16,
    /// Revision.
    pub revision: u8,
    /// Class code: base class, subclass, programming interface.
    pub class: [u8; 3],
    /// Subsystem vendor ID.
    pub subsystem_vendor: u16,
    /// Subsystem ID.
    pub subsystem: u16,
}

impl ConfigSpace {
    /// A header with `identity`, no BARs, no capabilities, INTx pin none.
    pub fn new(identity: DeviceIdentity) -> Self {
        let mut space = Self {
            bytes: Box::new([0; CONFIG_SPACE_SIZE]),
            writable: Box::new([0; CONFIG_SPACE_SIZE]),
            write_one_clears: Box::new([0; CONFIG_SPACE_SIZE]),
            bars: [None; BAR_COUNT],
            upper_halves: [false; BAR_COUNT],
            next_capability: reg::FIRST_CAPABILITY,
            last_capability: None,
        };
        space.put_u16(reg::VENDOR_ID, identity.vendor);
        space.put_u16(reg::DEVICE_ID, identity.device);
        space.bytes[reg::REVISION_ID] = identity.revision;
        // Class code bytes: 0x09 programming interface, 0x0a subclass, 0x0b base class.
        space.bytes[0x09] = identity.class[2];
        space.bytes[0x0a] = identity.class[1];
        space.bytes[0x0b] = identity.class[0];
        space.put_u16(reg::SUBSYSTEM_VENDOR_ID, identity.subsystem_vendor);
        space.put_u16(reg::SUBSYSTEM_ID, identity.subsystem);
        let command_mask = command::IO_SPACE
            | command::MEMORY_SPACE
            | command::BUS_MASTER
            | command::PARITY_ERROR_RESPONSE
            | command::SERR
            | command::INTX_DISABLE;
        space.writable[reg::COMMAND..reg::COMMAND + 2].copy_from_slice(&command_mask.to_le_bytes());
        space.write_one_clears[reg::STATUS..reg::STATUS + 2]
            .copy_from_slice(&STATUS_W1C.to_le_bytes());
        space.writable[reg::CACHE_LINE_SIZE] = 0xff;
        space.writable[reg::LATENCY_TIMER] = 0xff;
        space.writable[reg::INTERRUPT_LINE] = 0xff;
        space
    }

    fn put_u16(&mut self, offset: usize, value: u16) {
        self.bytes[offset..offset + 2].copy_from_slice(&value.to_le_bytes());
    }

    fn put_u32(&mut self, offset: usize, value: u32) {
        self.bytes[offset..offset + 4].copy_from_slice(&value.to_le_bytes());
    }

    fn u32_at(&self, offset: usize) -> u32 {
        let mut word = [0u8; 4];
        word.copy_from_slice(&self.bytes[offset..offset + 4]);
        u32::from_le_bytes(word)
    }

    /// The 16-bit register at `offset`.
    pub fn u16_at(&self, offset: usize) -> u16 {
        u16::from_le_bytes([self.bytes[offset], self.bytes[offset + 1]])
    }

    /// The command register.
    pub fn command(&self) -> u16 {
        self.u16_at(reg::COMMAND)
    }

    /// Sets bits in the status register as the device (not the guest) does.
    pub fn set_status_bits(&mut self, bits: u16) {
        let status = self.u16_at(reg::STATUS) | bits;
        self.put_u16(reg::STATUS, status);
    }

    /// Sets the 32-bit register at `offset` as the device (not the guest) does, for
    /// read-only state such as MSI pending bits.
    pub fn set_register_u32(&mut self, offset: usize, value: u32) {
        if offset + 4 <= CONFIG_SPACE_SIZE {
            self.put_u32(offset, value);
        }
    }

    /// The 32-bit register at `offset`.
    pub fn register_u32(&self, offset: usize) -> u32 {
        if offset + 4 <= CONFIG_SPACE_SIZE {
            self.u32_at(offset)
        } else {
            u32::MAX
        }
    }

    /// Sets the INTx pin (1 = INTA#..4 = INTD#; 0 = none).
    pub fn set_interrupt_pin(&mut self, pin: u8) {
        self.bytes[reg::INTERRUPT_PIN] = pin;
    }

    /// Sets the header-type byte (bit 7: multi-function).
    pub fn set_header_type(&mut self, header_type: u8) {
        self.bytes[reg::HEADER_TYPE] = header_type;
    }

    /// Declares BAR `index` (a 64-bit BAR also takes `index + 1`).
    pub fn add_bar(&mut self, index: usize, bar: Bar) -> Result<(), ConfigError> {
        let wide = matches!(bar.kind, BarKind::Memory64 { .. });
        let last = index + usize::from(wide);
        if last >= BAR_COUNT
            || (index..=last).any(|i| self.bars[i].is_some() || self.upper_halves[i])
        {
            return Err(ConfigError::BarTaken(index));
        }
        let min = bar.kind.min_size();
        if !bar.size.is_power_of_two() || bar.size < min || bar.size > bar.kind.max_size() {
            return Err(ConfigError::BarSize {
                index,
                size: bar.size,
                min,
            });
        }
        let low_type_mask: u64 = if bar.kind == BarKind::Io {
            0b11
        } else {
            0b1111
        };
        let address_mask = !(bar.size - 1) & !low_type_mask;
        let low_mask = match bar.kind {
            // I/O BARs decode 16 bits of port; the upper bits stay zero.
            BarKind::Io => address_mask as u32 & 0xffff,
            _ => address_mask as u32,
        };
        let offset = reg::BAR0 + 4 * index;
        self.writable[offset..offset + 4].copy_from_slice(&low_mask.to_le_bytes());
        self.put_u32(offset, bar.kind.type_bits());
        if wide {
            let high_mask = (address_mask >> 32) as u32;
            self.writable[offset + 4..offset + 8].copy_from_slice(&high_mask.to_le_bytes());
            self.put_u32(offset + 4, 0);
            self.upper_halves[index + 1] = true;
        }
        self.bars[index] = Some(bar);
        Ok(())
    }

    /// The BAR declared at `index`.
    pub fn bar(&self, index: usize) -> Option<Bar> {
        self.bars.get(index).copied().flatten()
    }

    /// Every declared BAR with its index.
    pub fn bars(&self) -> impl Iterator<Item = (usize, Bar)> + '_ {
        self.bars
            .iter()
            .enumerate()
            .filter_map(|(index, bar)| bar.map(|bar| (index, bar)))
    }

    /// The address BAR `index` holds now (without the type bits).
    pub fn bar_address(&self, index: usize) -> Option<u64> {
        let bar = self.bar(index)?;
        let offset = reg::BAR0 + 4 * index;
        let low = u64::from(self.u32_at(offset));
        let addr = match bar.kind {
            BarKind::Io => low & !0b11,
            BarKind::Memory32 { .. } => low & !0b1111,
            BarKind::Memory64 { .. } => {
                (low & !0b1111) | (u64::from(self.u32_at(offset + 4)) << 32)
            }
        };
        Some(addr)
    }

    /// Places BAR `index` at `addr`, as firmware would before the guest boots.
    pub fn set_bar_address(&mut self, index: usize, addr: u64) -> Result<(), ConfigError> {
        let bar = self.bar(index).ok_or(ConfigError::BarTaken(index))?;
        let limit = match bar.kind {
            BarKind::Io => 1 << 16,
            BarKind::Memory32 { .. } => 1 << 32,
            BarKind::Memory64 { .. } => u64::MAX,
        };
        let fits = addr.checked_add(bar.size).is_some_and(|end| end <= limit);
        if !addr.is_multiple_of(bar.size) || !fits {
            return Err(ConfigError::BarAddress { index, addr });
        }
        let offset = reg::BAR0 + 4 * index;
        self.put_u32(offset, addr as u32 | bar.kind.type_bits());
        if matches!(bar.kind, BarKind::Memory64 { .. }) {
            self.put_u32(offset + 4, (addr >> 32) as u32);
        }
        Ok(())
    }

    /// The BARs that decode now: memory BARs with memory space on, I/O BARs with I/O space on.
    pub fn decoded_bars(&self) -> impl Iterator<Item = BarRegion> + '_ {
        let command = self.command();
        self.bars().filter_map(move |(index, bar)| {
            let enabled = match bar.kind {
                BarKind::Io => command & command::IO_SPACE != 0,
                _ => command & command::MEMORY_SPACE != 0,
            };
            let addr = self.bar_address(index)?;
            (enabled && addr != 0).then_some(BarRegion { index, bar, addr })
        })
    }

    /// Appends a capability: `body` follows the ID and next-pointer bytes; `body_writable`
    /// marks its guest-writable bits. Returns the capability's offset.
    pub fn add_capability(
        &mut self,
        id: u8,
        body: &[u8],
        body_writable: &[u8],
    ) -> Result<usize, ConfigError> {
        if body.len() != body_writable.len() {
            return Err(ConfigError::CapabilityMask {
                id,
                body: body.len(),
                mask: body_writable.len(),
            });
        }
        let len = 2 + body.len();
        let offset = self.next_capability;
        if offset + len > LEGACY_CONFIG_SIZE {
            return Err(ConfigError::CapabilityTooBig { id, len });
        }
        self.bytes[offset] = id;
        self.bytes[offset + 1] = 0;
        self.bytes[offset + 2..offset + len].copy_from_slice(body);
        self.writable[offset + 2..offset + len].copy_from_slice(body_writable);
        match self.last_capability {
            Some(previous) => self.bytes[previous + 1] = offset as u8,
            None => self.bytes[reg::CAPABILITIES] = offset as u8,
        }
        self.last_capability = Some(offset);
        self.next_capability = (offset + len).next_multiple_of(4);
        self.set_status_bits(STATUS_CAPABILITIES);
        Ok(offset)
    }

    /// The whole space as the guest reads it (a snapshot saves this).
    pub fn bytes(&self) -> &[u8; CONFIG_SPACE_SIZE] {
        &self.bytes
    }

    /// Puts back bytes saved by [`ConfigSpace::bytes`] from a function built the same way:
    /// BAR addresses, command, MSI registers. The writable masks stay as built.
    pub fn restore_bytes(&mut self, bytes: &[u8; CONFIG_SPACE_SIZE]) {
        self.bytes.copy_from_slice(bytes);
    }

    /// Whether an access of `len` bytes at `offset` is one the space answers: 1, 2 or 4
    /// bytes, naturally aligned, inside the 4 KiB.
    pub fn access_ok(offset: usize, len: usize) -> bool {
        matches!(len, 1 | 2 | 4) && offset.is_multiple_of(len) && offset + len <= CONFIG_SPACE_SIZE
    }

    /// Guest read. A malformed access reads all ones.
    pub fn read(&self, offset: usize, data: &mut [u8]) {
        if Self::access_ok(offset, data.len()) {
            data.copy_from_slice(&self.bytes[offset..offset + data.len()]);
        } else {
            data.fill(0xff);
        }
    }

    /// Guest write through the writable and write-1-to-clear masks. A malformed access is
    /// dropped; returns whether the write was applied.
    pub fn write(&mut self, offset: usize, data: &[u8]) -> bool {
        if !Self::access_ok(offset, data.len()) {
            return false;
        }
        for (i, &value) in data.iter().enumerate() {
            let at = offset + i;
            let writable = self.writable[at];
            let mut byte = (self.bytes[at] & !writable) | (value & writable);
            byte &= !(value & self.write_one_clears[at]);
            self.bytes[at] = byte;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn space() -> ConfigSpace {
        ConfigSpace::new(DeviceIdentity {
            vendor: 0x1234,
            device: 0x5678,
            revision: 2,
            class: [0x03, 0x02, 0x00],
            subsystem_vendor: 0x1af4,
            subsystem: 0x1100,
        })
    }

    fn read32(space: &ConfigSpace, offset: usize) -> u32 {
        let mut data = [0u8; 4];
        space.read(offset, &mut data);
        u32::from_le_bytes(data)
    }

    fn write32(space: &mut ConfigSpace, offset: usize, value: u32) {
        assert!(space.write(offset, &value.to_le_bytes()));
    }

    #[test]
    fn header_reads_identity_at_every_width() {
        let space = space();
        assert_eq!(read32(&space, 0), 0x5678_1234);
        let mut word = [0u8; 2];
        space.read(2, &mut word);
        assert_eq!(u16::from_le_bytes(word), 0x5678);
        let mut byte = [0u8; 1];
        space.read(0x0b, &mut byte);
        assert_eq!(byte[0], 0x03, "base class");
        assert_eq!(read32(&space, 0x08), 0x0302_0002);
        assert_eq!(read32(&space, 0x2c), 0x1100_1af4);
        // The extended space reads zero: no extended capabilities.
        assert_eq!(read32(&space, 0x100), 0);
    }

    #[test]
    fn read_only_registers_ignore_writes() {
        let mut space = space();
        write32(&mut space, 0, 0xffff_ffff);
        write32(&mut space, 0x08, 0xffff_ffff);
        assert_eq!(read32(&space, 0), 0x5678_1234);
        assert_eq!(read32(&space, 0x08), 0x0302_0002);
        // An unused BAR stays zero even when sized.
        write32(&mut space, reg::BAR0 + 8, 0xffff_ffff);
        assert_eq!(read32(&space, reg::BAR0 + 8), 0);
    }

    #[test]
    fn command_keeps_only_defined_bits_and_status_clears_on_one() {
        let mut space = space();
        assert!(space.write(reg::COMMAND, &0xffffu16.to_le_bytes()));
        assert_eq!(space.command(), 0x0547);
        space.set_status_bits(0x8000 | 0x0100 | STATUS_CAPABILITIES);
        // Writing 1 to the error bit clears it; the capabilities bit is read-only.
        assert!(space.write(reg::STATUS, &0x8010u16.to_le_bytes()));
        assert_eq!(space.u16_at(reg::STATUS), 0x0100 | STATUS_CAPABILITIES);
        // A dword write at the command register leaves status as it was when the upper
        // half is zero.
        write32(&mut space, reg::COMMAND, 0x0000_0002);
        assert_eq!(space.u16_at(reg::STATUS), 0x0100 | STATUS_CAPABILITIES);
        assert_eq!(space.command(), command::MEMORY_SPACE);
    }

    #[test]
    fn misaligned_or_odd_accesses_read_ones_and_write_nothing() {
        let mut space = space();
        let mut data = [0u8; 4];
        space.read(2, &mut data);
        assert_eq!(data, [0xff; 4]);
        let mut three = [0u8; 3];
        space.read(4, &mut three);
        assert_eq!(three, [0xff; 3]);
        assert!(!space.write(reg::COMMAND + 1, &[0xff, 0xff]));
        assert!(!space.write(CONFIG_SPACE_SIZE - 2, &[0; 4]));
        assert_eq!(space.command(), 0);
        space.read(CONFIG_SPACE_SIZE, &mut data);
        assert_eq!(data, [0xff; 4]);
    }

    #[test]
    fn bar_sizing_32_bit_memory_and_io() {
        let mut space = space();
        space
            .add_bar(
                0,
                Bar {
                    kind: BarKind::Memory32 {
                        prefetchable: false,
                    },
                    size: 0x1000,
                },
            )
            .expect("bar 0");
        space
            .add_bar(
                1,
                Bar {
                    kind: BarKind::Memory32 { prefetchable: true },
                    size: 1 << 20,
                },
            )
            .expect("bar 1");
        space
            .add_bar(
                2,
                Bar {
                    kind: BarKind::Io,
                    size: 0x20,
                },
            )
            .expect("bar 2");
        assert_eq!(read32(&space, reg::BAR0), 0);
        assert_eq!(read32(&space, reg::BAR0 + 4), 0b1000);
        assert_eq!(read32(&space, reg::BAR0 + 8), 0b01);
        for i in 0..3 {
            write32(&mut space, reg::BAR0 + 4 * i, 0xffff_ffff);
        }
        assert_eq!(read32(&space, reg::BAR0), 0xffff_f000);
        assert_eq!(read32(&space, reg::BAR0 + 4), 0xfff0_0008);
        assert_eq!(read32(&space, reg::BAR0 + 8), 0x0000_ffe1);
        // The size is !(mask & !type) + 1, as the guest computes it.
        let size = |v: u32, low: u32| (!(v & !low)).wrapping_add(1);
        assert_eq!(size(read32(&space, reg::BAR0), 0xf), 0x1000);
        assert_eq!(size(read32(&space, reg::BAR0 + 4), 0xf), 1 << 20);
        assert_eq!(size(read32(&space, reg::BAR0 + 8) | 0xffff_0000, 0x3), 0x20);
        // The guest then programs an address; low bits it cannot set are dropped.
        write32(&mut space, reg::BAR0, 0xc000_1fff);
        assert_eq!(read32(&space, reg::BAR0), 0xc000_1000);
        assert_eq!(space.bar_address(0), Some(0xc000_1000));
        write32(&mut space, reg::BAR0 + 8, 0xc043);
        assert_eq!(space.bar_address(2), Some(0xc040));
    }

    #[test]
    fn bar_sizing_64_bit_prefetchable_of_256_gib() {
        let mut space = space();
        let size = 256u64 << 30;
        space
            .add_bar(
                2,
                Bar {
                    kind: BarKind::Memory64 { prefetchable: true },
                    size,
                },
            )
            .expect("bar 2");
        assert_eq!(read32(&space, reg::BAR0 + 8), 0b1100);
        write32(&mut space, reg::BAR0 + 8, 0xffff_ffff);
        write32(&mut space, reg::BAR0 + 12, 0xffff_ffff);
        let low = read32(&space, reg::BAR0 + 8);
        let high = read32(&space, reg::BAR0 + 12);
        assert_eq!(low, 0x0000_000c, "no address bits below 4 GiB");
        assert_eq!(high, 0xffff_ffc0);
        let mask = (u64::from(high) << 32) | u64::from(low & !0xf);
        assert_eq!((!mask).wrapping_add(1), size);
        // Program it at 256 GiB.
        write32(&mut space, reg::BAR0 + 8, 0);
        write32(&mut space, reg::BAR0 + 12, 0x40);
        assert_eq!(space.bar_address(2), Some(size));
        // A 64-bit BAR takes the next register too.
        let small = Bar {
            kind: BarKind::Memory32 {
                prefetchable: false,
            },
            size: 16,
        };
        assert_eq!(space.add_bar(3, small), Err(ConfigError::BarTaken(3)));
        assert_eq!(space.add_bar(2, small), Err(ConfigError::BarTaken(2)));
        let wide = Bar {
            kind: BarKind::Memory64 {
                prefetchable: false,
            },
            size: 16,
        };
        assert_eq!(space.add_bar(5, wide), Err(ConfigError::BarTaken(5)));
        assert!(space.add_bar(4, wide).is_ok());
    }

    #[test]
    fn bad_bar_sizes_and_addresses_are_refused() {
        let mut space = space();
        let bar = |kind, size| Bar { kind, size };
        let mem32 = BarKind::Memory32 {
            prefetchable: false,
        };
        assert!(matches!(
            space.add_bar(0, bar(mem32, 0x1800)),
            Err(ConfigError::BarSize { index: 0, .. })
        ));
        assert!(space.add_bar(0, bar(mem32, 8)).is_err());
        assert!(space.add_bar(0, bar(BarKind::Io, 1 << 17)).is_err());
        assert!(space.add_bar(0, bar(mem32, 1 << 32)).is_err());
        space.add_bar(0, bar(mem32, 0x1000)).expect("bar");
        assert_eq!(
            space.set_bar_address(0, 0xc000_0800),
            Err(ConfigError::BarAddress {
                index: 0,
                addr: 0xc000_0800
            })
        );
        assert!(space.set_bar_address(0, 1 << 32).is_err());
        assert!(space.set_bar_address(1, 0).is_err());
        space.set_bar_address(0, 0xc000_0000).expect("place");
        assert_eq!(read32(&space, reg::BAR0), 0xc000_0000);
    }

    #[test]
    fn decoded_bars_follow_the_command_register() {
        let mut space = space();
        space
            .add_bar(
                0,
                Bar {
                    kind: BarKind::Memory64 { prefetchable: true },
                    size: 1 << 30,
                },
            )
            .expect("bar");
        space
            .add_bar(
                2,
                Bar {
                    kind: BarKind::Io,
                    size: 16,
                },
            )
            .expect("bar");
        space.set_bar_address(0, 5 << 30).expect("place");
        space.set_bar_address(2, 0xc000).expect("place");
        assert_eq!(space.decoded_bars().count(), 0);
        assert!(space.write(reg::COMMAND, &command::MEMORY_SPACE.to_le_bytes()));
        let regions: Vec<_> = space.decoded_bars().collect();
        assert_eq!(regions.len(), 1);
        assert_eq!(regions[0].addr, 5 << 30);
        assert!(space.write(
            reg::COMMAND,
            &(command::MEMORY_SPACE | command::IO_SPACE).to_le_bytes()
        ));
        assert_eq!(space.decoded_bars().count(), 2);
    }

    #[test]
    fn capabilities_chain_with_writable_bodies() {
        let mut space = space();
        let first = space
            .add_capability(0x09, &[1, 2, 3], &[0xff, 0, 0])
            .expect("first");
        let second = space
            .add_capability(0x11, &[0; 10], &[0; 10])
            .expect("second");
        assert_eq!(first, 0x40);
        assert_eq!(second, 0x48, "dword aligned after 5 bytes");
        assert_eq!(
            space.u16_at(reg::STATUS) & STATUS_CAPABILITIES,
            STATUS_CAPABILITIES
        );
        let mut byte = [0u8];
        space.read(reg::CAPABILITIES, &mut byte);
        assert_eq!(byte[0], 0x40);
        assert_eq!(read32(&space, 0x40), 0x0201_4809);
        assert_eq!(read32(&space, 0x48) & 0xffff, 0x0011, "last has no next");
        assert!(space.write(0x40, &[0xaa, 0xbb, 0xcc, 0xdd]));
        assert_eq!(
            read32(&space, 0x40),
            0x0201_4809 & 0xff00_ffff | 0x00cc_0000
        );
        assert_eq!(
            space.add_capability(0x10, &[0; 200], &[0; 200]),
            Err(ConfigError::CapabilityTooBig { id: 0x10, len: 202 })
        );
        assert!(matches!(
            space.add_capability(0x10, &[0; 2], &[0; 3]),
            Err(ConfigError::CapabilityMask { .. })
        ));
    }
}
