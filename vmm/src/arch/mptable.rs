//! Intel MultiProcessor Specification 1.4 table, so that Linux finds its CPUs and the IOAPIC.

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use super::layout::{APIC_START, EBDA_START, IOAPIC_LAST_PIN, IOAPIC_START};

/// Errors from building the MP table.
#[derive(Debug, thiserror::Error)]
pub enum MptableError {
    /// Too many vCPUs for the table (the IOAPIC takes the next APIC ID).
    #[error("{0} vCPUs do not fit into the MP table (at most 254)")]
    TooManyCpus(u8),
    /// The table did not fit into guest memory.
    #[error("cannot write the MP table at {addr:#x}: {source}")]
    Write {
        /// Guest address of the table.
        addr: u64,
        /// The memory error.
        source: vm_memory::GuestMemoryError,
    },
}

const LAPIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;
const ENTRY_PROCESSOR: u8 = 0;
const ENTRY_BUS: u8 = 1;
const ENTRY_IOAPIC: u8 = 2;
const ENTRY_IO_INTERRUPT: u8 = 3;
const ENTRY_LOCAL_INTERRUPT: u8 = 4;
const INT_TYPE_INT: u8 = 0;
const INT_TYPE_NMI: u8 = 1;
const INT_TYPE_EXTINT: u8 = 3;
const CPU_ENABLED: u8 = 1;
const CPU_BOOTSTRAP: u8 = 2;
/// Family 6 signature, as reported by modern CPUs.
const CPU_SIGNATURE: u32 = (6 << 8) | (1 << 4) | 1;
/// FPU and APIC present.
const CPU_FEATURES: u32 = (1 << 0) | (1 << 9);

fn checksum(bytes: &[u8]) -> u8 {
    0u8.wrapping_sub(bytes.iter().fold(0u8, |acc, b| acc.wrapping_add(*b)))
}

/// Most vCPUs per microVM: the MP table for them must fit in the 1 KiB EBDA.
pub const MAX_VCPUS: u64 = 32;

/// The IOAPIC's ID: the first one after the vCPUs' APIC IDs (the ACPI MADT uses it too).
pub fn ioapic_id(vcpus: u8) -> u8 {
    vcpus
}

/// Builds the floating pointer and the configuration table for `vcpus` CPUs, placed at `base`.
fn build(vcpus: u8, base: u64) -> Result<Vec<u8>, MptableError> {
    if vcpus == 0 || vcpus > 254 {
        return Err(MptableError::TooManyCpus(vcpus));
    }
    let ioapic_id = ioapic_id(vcpus);
    let table_addr = base + 16;
    let mut entries: Vec<u8> = Vec::new();
    let mut count: u16 = 0;
    for cpu in 0..vcpus {
        entries.extend_from_slice(&[ENTRY_PROCESSOR, cpu, LAPIC_VERSION]);
        entries.push(CPU_ENABLED | if cpu == 0 { CPU_BOOTSTRAP } else { 0 });
        entries.extend_from_slice(&CPU_SIGNATURE.to_le_bytes());
        entries.extend_from_slice(&CPU_FEATURES.to_le_bytes());
        entries.extend_from_slice(&[0u8; 8]);
        count += 1;
    }
    entries.extend_from_slice(&[ENTRY_BUS, 0]);
    entries.extend_from_slice(b"ISA   ");
    count += 1;
    entries.extend_from_slice(&[ENTRY_IOAPIC, ioapic_id, IOAPIC_VERSION, 1]);
    entries.extend_from_slice(&(IOAPIC_START as u32).to_le_bytes());
    count += 1;
    // Every ISA line, IRQ 0 included, is an ordinary interrupt on the same IOAPIC pin: that is
    // how KVM's in-kernel IOAPIC is wired. The 8259's ExtINT reaches the CPUs through LINT0.
    for irq in 0..=IOAPIC_LAST_PIN as u8 {
        entries.extend_from_slice(&[
            ENTRY_IO_INTERRUPT,
            INT_TYPE_INT,
            0,
            0,
            0,
            irq,
            ioapic_id,
            irq,
        ]);
        count += 1;
    }
    entries.extend_from_slice(&[ENTRY_LOCAL_INTERRUPT, INT_TYPE_EXTINT, 0, 0, 0, 0, 0xff, 0]);
    entries.extend_from_slice(&[ENTRY_LOCAL_INTERRUPT, INT_TYPE_NMI, 0, 0, 0, 0, 0xff, 1]);
    count += 2;

    let mut header = Vec::with_capacity(44);
    header.extend_from_slice(b"PCMP");
    header.extend_from_slice(&((44 + entries.len()) as u16).to_le_bytes());
    header.push(4); // spec revision 1.4
    header.push(0); // checksum, below
    header.extend_from_slice(b"ROLLBOX ");
    header.extend_from_slice(b"000000000000");
    header.extend_from_slice(&0u32.to_le_bytes()); // OEM table pointer
    header.extend_from_slice(&0u16.to_le_bytes()); // OEM table size
    header.extend_from_slice(&count.to_le_bytes());
    header.extend_from_slice(&(APIC_START as u32).to_le_bytes());
    header.extend_from_slice(&[0u8; 4]); // extended table length, checksum, reserved
    let mut table = header;
    table.extend_from_slice(&entries);
    table[7] = checksum(&table);

    let mut floating = Vec::with_capacity(16);
    floating.extend_from_slice(b"_MP_");
    floating.extend_from_slice(&(table_addr as u32).to_le_bytes());
    floating.extend_from_slice(&[1, 4, 0, 0, 0, 0, 0, 0]);
    floating[10] = checksum(&floating);

    floating.extend_from_slice(&table);
    Ok(floating)
}

/// Writes the MP table for `vcpus` CPUs into the EBDA.
pub fn setup_mptable(mem: &impl GuestMemoryBackend, vcpus: u8) -> Result<(), MptableError> {
    let bytes = build(vcpus, EBDA_START)?;
    mem.write_slice(&bytes, GuestAddress(EBDA_START))
        .map_err(|source| MptableError::Write {
            addr: EBDA_START,
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_are_zero() {
        let bytes = build(4, EBDA_START).expect("table");
        let sum = |b: &[u8]| b.iter().fold(0u8, |a, x| a.wrapping_add(*x));
        assert_eq!(sum(&bytes[..16]), 0);
        assert_eq!(sum(&bytes[16..]), 0);
        assert_eq!(&bytes[16..20], b"PCMP");
        let count = u16::from_le_bytes([bytes[16 + 34], bytes[16 + 35]]);
        assert_eq!(usize::from(count), 4 + 1 + 1 + 24 + 2);
        assert!(bytes.len() < 0x400, "table must fit in the EBDA");
    }

    #[test]
    fn rejects_zero_cpus() {
        assert!(build(0, EBDA_START).is_err());
    }
}
