//! MSI: the capability with a 64-bit address, 1-32 vectors and per-vector masking.
//!
//! The guest-visible registers live in configuration space (their writable masks give the
//! register semantics); this type knows where they are, computes each vector's message,
//! and keeps the pending bits for masked vectors.

use super::config::{ConfigError, ConfigSpace};
use super::msix::{MsiMessage, Signal};

/// The MSI capability ID.
pub const MSI_CAPABILITY_ID: u8 = 0x05;
/// Message control: MSI enable.
const CONTROL_ENABLE: u16 = 1;
/// Message control: 64-bit address capable.
const CONTROL_64_BIT: u16 = 1 << 7;
/// Message control: per-vector masking capable.
const CONTROL_PER_VECTOR_MASK: u16 = 1 << 8;
/// Message control: the multiple message enable field (bits 6:4).
const CONTROL_MME_SHIFT: u16 = 4;
// Register offsets from the capability's start.
const CONTROL: usize = 2;
const ADDRESS_LOW: usize = 4;
const ADDRESS_HIGH: usize = 8;
const DATA: usize = 12;
const MASK: usize = 16;
const PENDING: usize = 20;
const BODY_LEN: usize = 22;

/// Errors from MSI emulation; each names the vector count or vector.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MsiError {
    /// Not a power of two from 1 to 32.
    #[error("MSI supports 1, 2, 4, 8, 16 or 32 vectors, not {0}")]
    VectorCount(u32),
    /// A vector the function does not have.
    #[error("MSI vector {vector} is beyond the {count} the function has")]
    NoSuchVector {
        /// The vector.
        vector: u32,
        /// The vectors the function is capable of.
        count: u32,
    },
    /// The capability did not fit in configuration space.
    #[error("MSI capability: {0}")]
    Config(#[from] ConfigError),
}

/// An MSI capability in a function's configuration space.
pub struct MsiCapability {
    offset: usize,
    vectors: u32,
}

impl MsiCapability {
    /// Adds a 64-bit, per-vector-maskable MSI capability of `vectors` (a power of two, 1-32)
    /// to `config`.
    pub fn add_to(config: &mut ConfigSpace, vectors: u32) -> Result<Self, MsiError> {
        if !vectors.is_power_of_two() || vectors > 32 {
            return Err(MsiError::VectorCount(vectors));
        }
        let capable = vectors.trailing_zeros() as u16;
        let control = CONTROL_64_BIT | CONTROL_PER_VECTOR_MASK | (capable << 1);
        let mut body = [0u8; BODY_LEN];
        body[0..2].copy_from_slice(&control.to_le_bytes());
        let mut writable = [0u8; BODY_LEN];
        let control_mask = CONTROL_ENABLE | (0b111 << CONTROL_MME_SHIFT);
        let mask_bits = if vectors == 32 {
            u32::MAX
        } else {
            (1 << vectors) - 1
        };
        let at = |register: usize| register - 2;
        writable[at(CONTROL)..at(CONTROL) + 2].copy_from_slice(&control_mask.to_le_bytes());
        writable[at(ADDRESS_LOW)..at(ADDRESS_LOW) + 4].copy_from_slice(&(!0b11u32).to_le_bytes());
        writable[at(ADDRESS_HIGH)..at(ADDRESS_HIGH) + 4].copy_from_slice(&[0xff; 4]);
        writable[at(DATA)..at(DATA) + 2].copy_from_slice(&[0xff; 2]);
        writable[at(MASK)..at(MASK) + 4].copy_from_slice(&mask_bits.to_le_bytes());
        let offset = config.add_capability(MSI_CAPABILITY_ID, &body, &writable)?;
        Ok(Self { offset, vectors })
    }

    /// The capability's offset in configuration space.
    pub fn offset(&self) -> usize {
        self.offset
    }

    fn control(&self, config: &ConfigSpace) -> u16 {
        config.u16_at(self.offset + CONTROL)
    }

    /// Whether the guest enabled MSI.
    pub fn enabled(&self, config: &ConfigSpace) -> bool {
        self.control(config) & CONTROL_ENABLE != 0
    }

    /// How many vectors the guest enabled (at most what the function is capable of).
    pub fn enabled_vectors(&self, config: &ConfigSpace) -> u32 {
        let mme = (self.control(config) >> CONTROL_MME_SHIFT) & 0b111;
        (1u32 << mme.min(5)).min(self.vectors)
    }

    fn masked(&self, config: &ConfigSpace, vector: u32) -> bool {
        config.register_u32(self.offset + MASK) & (1 << vector) != 0
    }

    /// Whether `vector`'s pending bit is set.
    pub fn is_pending(&self, config: &ConfigSpace, vector: u32) -> bool {
        vector < 32 && config.register_u32(self.offset + PENDING) & (1 << vector) != 0
    }

    fn set_pending(&self, config: &mut ConfigSpace, vector: u32, pending: bool) {
        let at = self.offset + PENDING;
        let bits = config.register_u32(at);
        let bits = if pending {
            bits | (1 << vector)
        } else {
            bits & !(1 << vector)
        };
        config.set_register_u32(at, bits);
    }

    /// The message `vector` sends: the programmed address, and the data with its low bits
    /// replaced by the vector number (multiple message). `None` if it would not be sent now.
    pub fn message(&self, config: &ConfigSpace, vector: u32) -> Option<MsiMessage> {
        let count = self.enabled_vectors(config);
        if !self.enabled(config) || vector >= count || self.masked(config, vector) {
            return None;
        }
        Some(self.raw_message(config, vector, count))
    }

    fn raw_message(&self, config: &ConfigSpace, vector: u32, count: u32) -> MsiMessage {
        let low = u64::from(config.register_u32(self.offset + ADDRESS_LOW));
        let high = u64::from(config.register_u32(self.offset + ADDRESS_HIGH));
        let data = u32::from(config.u16_at(self.offset + DATA));
        MsiMessage {
            address: (high << 32) | low,
            data: (data & !(count - 1)) | vector,
        }
    }

    /// The device signals `vector`.
    pub fn signal(&self, config: &mut ConfigSpace, vector: u32) -> Result<Signal, MsiError> {
        if vector >= self.vectors {
            return Err(MsiError::NoSuchVector {
                vector,
                count: self.vectors,
            });
        }
        let count = self.enabled_vectors(config);
        if !self.enabled(config) || vector >= count {
            return Ok(Signal::Disabled);
        }
        if self.masked(config, vector) {
            self.set_pending(config, vector, true);
            return Ok(Signal::Pending);
        }
        Ok(Signal::Deliver(self.raw_message(config, vector, count)))
    }

    /// After a guest configuration write (already applied): delivers the pending vectors it
    /// unmasked.
    pub fn config_written(&self, config: &mut ConfigSpace) -> Vec<(u32, MsiMessage)> {
        let mut delivered = Vec::new();
        for vector in 0..self.vectors {
            if self.is_pending(config, vector) {
                if let Some(message) = self.message(config, vector) {
                    self.set_pending(config, vector, false);
                    delivered.push((vector, message));
                }
            }
        }
        delivered
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::pci::config::DeviceIdentity;

    fn write(config: &mut ConfigSpace, offset: usize, data: &[u8]) {
        assert!(config.write(offset, data), "write at {offset:#x}");
    }

    #[test]
    fn capability_layout_and_writable_bits() {
        let mut config = ConfigSpace::new(DeviceIdentity::default());
        assert_eq!(
            MsiCapability::add_to(&mut config, 3).err(),
            Some(MsiError::VectorCount(3))
        );
        assert!(MsiCapability::add_to(&mut config, 64).is_err());
        let msi = MsiCapability::add_to(&mut config, 4).expect("msi");
        let at = msi.offset();
        assert_eq!(
            config.register_u32(at),
            0x0184_0005,
            "ID 5, 64-bit, PVM, 4 vectors"
        );
        // The guest can set enable and MME but not the capability bits.
        write(&mut config, at + 2, &0xffffu16.to_le_bytes());
        assert_eq!(config.u16_at(at + 2), 0x01f5);
        write(&mut config, at + 4, &0xffff_ffffu32.to_le_bytes());
        assert_eq!(config.register_u32(at + 4), 0xffff_fffc);
        write(&mut config, at + 12, &0xffff_ffffu32.to_le_bytes());
        assert_eq!(config.register_u32(at + 12), 0xffff, "no extended data");
        write(&mut config, at + 16, &0xffff_ffffu32.to_le_bytes());
        assert_eq!(
            config.register_u32(at + 16),
            0b1111,
            "one mask bit per vector"
        );
        write(&mut config, at + 20, &0xffff_ffffu32.to_le_bytes());
        assert_eq!(config.register_u32(at + 20), 0, "pending is read-only");
        // MME beyond what the function has gives what it has.
        assert_eq!(msi.enabled_vectors(&config), 4);
    }

    #[test]
    fn multiple_messages_mask_and_pending() {
        let mut config = ConfigSpace::new(DeviceIdentity::default());
        let msi = MsiCapability::add_to(&mut config, 8).expect("msi");
        let at = msi.offset();
        write(&mut config, at + 4, &0xfee0_1000u32.to_le_bytes());
        write(&mut config, at + 8, &0u32.to_le_bytes());
        write(&mut config, at + 12, &0x4043u32.to_le_bytes());
        assert_eq!(msi.signal(&mut config, 0), Ok(Signal::Disabled));
        assert_eq!(
            msi.signal(&mut config, 8),
            Err(MsiError::NoSuchVector {
                vector: 8,
                count: 8
            })
        );
        // Enable with MME = 2: four vectors; data's low two bits carry the vector.
        write(&mut config, at + 2, &(1u16 | (2 << 4)).to_le_bytes());
        assert!(msi.enabled(&config));
        assert_eq!(msi.enabled_vectors(&config), 4);
        let message = |data| {
            Signal::Deliver(MsiMessage {
                address: 0xfee0_1000,
                data,
            })
        };
        assert_eq!(msi.signal(&mut config, 0), Ok(message(0x4040)));
        assert_eq!(msi.signal(&mut config, 3), Ok(message(0x4043)));
        assert_eq!(
            msi.signal(&mut config, 4),
            Ok(Signal::Disabled),
            "not enabled"
        );
        // Mask vector 2: its signal waits in the pending bits, which the guest can read.
        write(&mut config, at + 16, &0b100u32.to_le_bytes());
        assert_eq!(msi.signal(&mut config, 2), Ok(Signal::Pending));
        assert!(msi.is_pending(&config, 2));
        let mut pending = [0u8; 4];
        config.read(at + 20, &mut pending);
        assert_eq!(u32::from_le_bytes(pending), 0b100);
        assert!(msi.config_written(&mut config).is_empty(), "still masked");
        write(&mut config, at + 16, &0u32.to_le_bytes());
        assert_eq!(
            msi.config_written(&mut config),
            vec![(
                2,
                MsiMessage {
                    address: 0xfee0_1000,
                    data: 0x4042
                }
            )]
        );
        assert!(!msi.is_pending(&config, 2));
    }
}
