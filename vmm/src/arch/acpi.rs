//! ACPI tables for a hardware-reduced platform: RSDP, XSDT, FADT, MADT and a DSDT.
//!
//! Why ACPI and not only the MP table: Linux takes its CPUs and IOAPIC from the MADT, powers
//! off through the FADT's sleep control register (`_S5_`), finds the pvpanic port and the VM
//! generation ID (VMGenID, which reseeds the guest's CRNG on a fork) in the DSDT, and learns of
//! a new generation through a Generic Event Device. Distro kernels have ACPI on, and a future
//! PCI root needs an MCFG. The MP table stays for kernels booted with `acpi=off`.

use acpi_tables::aml;
use acpi_tables::fadt::{FADTBuilder, Flags};
use acpi_tables::gas::{AccessSize, AddressSpace, GAS};
use acpi_tables::rsdp::Rsdp;
use acpi_tables::sdt::Sdt;
use acpi_tables::xsdt::XSDT;
use acpi_tables::Aml;
use vm_memory::{Bytes, GuestAddress};

use super::layout::{
    ACPI_END, ACPI_START, APIC_START, GED_IRQ, I8042_IRQ, I8042_PORT, IOAPIC_START, PVPANIC_PORT,
    SERIAL_IRQ, SERIAL_PORT, SLEEP_CONTROL_PORT, SLEEP_STATUS_PORT, VIRTIO_MMIO_SIZE, VMGENID_ADDR,
};
use crate::vstate::memory::GuestMemoryMmap;

/// Errors from writing the ACPI tables.
#[derive(Debug, thiserror::Error)]
pub enum AcpiError {
    /// The tables outgrew the area reserved for them.
    #[error("the ACPI tables need {need} bytes; {have} are reserved at {ACPI_START:#x}")]
    TooBig {
        /// Bytes needed.
        need: u64,
        /// Bytes reserved.
        have: u64,
    },
    /// Guest memory does not reach the ACPI area.
    #[error("cannot write the ACPI {table} at {addr:#x}: {source}")]
    Write {
        /// Which table.
        table: &'static str,
        /// Where.
        addr: u64,
        /// The memory error.
        source: vm_memory::GuestMemoryError,
    },
}

const OEM_ID: [u8; 6] = *b"RLLBOX";
const OEM_TABLE_ID: [u8; 8] = *b"ROLLBOXV";
const OEM_REVISION: u32 = 1;
/// The SLP_TYP value `_S5_` hands Linux; the power-off device acts on it.
pub const S5_SLEEP_TYPE: u8 = 5;
/// The ACPI notification that tells OSPM the VM generation ID changed.
const NOTIFY_GENERATION_CHANGED: u8 = 0x80;

// IA-PC boot architecture flags (FADT): legacy devices, an 8042, no VGA.
const IAPC_LEGACY_DEVICES: u16 = 1 << 0;
const IAPC_8042: u16 = 1 << 1;
const IAPC_VGA_NOT_PRESENT: u16 = 1 << 2;

// MADT structures.
const MADT_LOCAL_APIC: u8 = 0;
const MADT_IOAPIC: u8 = 1;
const MADT_LOCAL_APIC_NMI: u8 = 4;
const MADT_CPU_ENABLED: u32 = 1;
/// Active high, edge triggered.
const MPS_INTI_HIGH_EDGE: u16 = 0b0101;

/// What the tables describe.
#[derive(Debug, Clone)]
pub struct AcpiConfig {
    /// vCPUs (APIC IDs 0..vcpus).
    pub vcpus: u8,
    /// The IOAPIC's ID (the MP table uses the same).
    pub ioapic_id: u8,
    /// virtio-mmio devices: (MMIO base, GSI), in the order the guest should number them.
    pub virtio_mmio: Vec<(u64, u32)>,
}

fn io_register(port: u16) -> GAS {
    GAS::new(
        AddressSpace::SystemIo,
        8,
        0,
        AccessSize::ByteAccess,
        u64::from(port),
    )
}

fn aml_bytes(object: &dyn Aml) -> Vec<u8> {
    let mut bytes = Vec::new();
    object.to_aml_bytes(&mut bytes);
    bytes
}

/// The DSDT's AML: the devices under `\_SB_` and the `_S5_` sleep type.
fn dsdt_body(config: &AcpiConfig) -> Vec<u8> {
    let mut devices = Vec::new();
    for (index, &(base, gsi)) in config.virtio_mmio.iter().enumerate() {
        devices.extend(aml_bytes(&aml::Device::new(
            format!("V{index:03}").as_str().into(),
            vec![
                &aml::Name::new("_HID".into(), &"LNRO0005"),
                &aml::Name::new("_UID".into(), &index),
                &aml::Name::new("_CCA".into(), &aml::ONE),
                &aml::Name::new(
                    "_CRS".into(),
                    &aml::ResourceTemplate::new(vec![
                        &aml::Memory32Fixed::new(true, base as u32, VIRTIO_MMIO_SIZE as u32),
                        &aml::Interrupt::new(true, true, false, false, gsi),
                    ]),
                ),
            ],
        )));
    }
    devices.extend(aml_bytes(&aml::Device::new(
        "COM1".into(),
        vec![
            &aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0501")),
            &aml::Name::new("_UID".into(), &aml::ONE),
            &aml::Name::new(
                "_CRS".into(),
                &aml::ResourceTemplate::new(vec![
                    &aml::IO::new(SERIAL_PORT, SERIAL_PORT, 1, 8),
                    &aml::Interrupt::new(true, true, false, false, SERIAL_IRQ),
                ]),
            ),
        ],
    )));
    devices.extend(aml_bytes(&aml::Device::new(
        "PS2K".into(),
        vec![
            &aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0303")),
            &aml::Name::new(
                "_CRS".into(),
                &aml::ResourceTemplate::new(vec![
                    &aml::IO::new(I8042_PORT, I8042_PORT, 1, 1),
                    &aml::IO::new(I8042_PORT + 4, I8042_PORT + 4, 1, 1),
                    &aml::Interrupt::new(true, true, false, false, I8042_IRQ),
                ]),
            ),
        ],
    )));
    devices.extend(aml_bytes(&aml::Device::new(
        "PEVT".into(),
        vec![
            &aml::Name::new("_HID".into(), &"QEMU0001"),
            &aml::Name::new(
                "_CRS".into(),
                &aml::ResourceTemplate::new(vec![&aml::IO::new(PVPANIC_PORT, PVPANIC_PORT, 1, 1)]),
            ),
        ],
    )));
    // VMGenID: Linux's driver matches the _HID; the _CID and _DDN follow Microsoft's spec.
    let (addr_low, addr_high) = (VMGENID_ADDR & 0xffff_ffff, VMGENID_ADDR >> 32);
    devices.extend(aml_bytes(&aml::Device::new(
        "VGEN".into(),
        vec![
            &aml::Name::new("_HID".into(), &"VMGENCTR"),
            &aml::Name::new("_CID".into(), &"VM_Gen_Counter"),
            &aml::Name::new("_DDN".into(), &"VM_Gen_Counter"),
            &aml::Name::new(
                "ADDR".into(),
                &aml::Package::new(vec![&addr_low, &addr_high]),
            ),
        ],
    )));
    // Generic Event Device: its interrupt runs _EVT, which tells VGEN the generation changed.
    devices.extend(aml_bytes(&aml::Device::new(
        "GED_".into(),
        vec![
            &aml::Name::new("_HID".into(), &"ACPI0013"),
            &aml::Name::new("_UID".into(), &aml::ZERO),
            &aml::Name::new(
                "_CRS".into(),
                &aml::ResourceTemplate::new(vec![&aml::Interrupt::new(
                    true, true, false, false, GED_IRQ,
                )]),
            ),
            &aml::Method::new(
                "_EVT".into(),
                1,
                true,
                vec![&aml::If::new(
                    &aml::Equal::new(&aml::Arg(0), &GED_IRQ),
                    vec![&aml::Notify::new(
                        &aml::Path::new("\\_SB_.VGEN"),
                        &NOTIFY_GENERATION_CHANGED,
                    )],
                )],
            ),
        ],
    )));
    let mut body = aml::Scope::raw("\\_SB_".into(), devices);
    body.extend(aml_bytes(&aml::Name::new(
        "_S5_".into(),
        &aml::Package::new(vec![&S5_SLEEP_TYPE]),
    )));
    body
}

fn dsdt(config: &AcpiConfig) -> Sdt {
    let mut dsdt = Sdt::new(*b"DSDT", 36, 6, OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    dsdt.append_slice(&dsdt_body(config));
    dsdt.update_checksum();
    dsdt
}

fn madt(config: &AcpiConfig) -> Sdt {
    let mut madt = Sdt::new(*b"APIC", 44, 5, OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    madt.write_u32(36, APIC_START as u32);
    madt.write_u32(40, 0); // flags: no dual 8259 (hardware-reduced)
    for cpu in 0..config.vcpus {
        madt.append_slice(&[MADT_LOCAL_APIC, 8, cpu, cpu]);
        madt.append_slice(&MADT_CPU_ENABLED.to_le_bytes());
    }
    madt.append_slice(&[MADT_IOAPIC, 12, config.ioapic_id, 0]);
    madt.append_slice(&(IOAPIC_START as u32).to_le_bytes());
    madt.append_slice(&0u32.to_le_bytes()); // GSI base
    madt.append_slice(&[MADT_LOCAL_APIC_NMI, 6, 0xff]); // every processor
    madt.append_slice(&MPS_INTI_HIGH_EDGE.to_le_bytes());
    madt.append_slice(&[1]); // LINT1
    madt.update_checksum();
    madt
}

fn fadt(dsdt_addr: u64) -> Vec<u8> {
    let mut builder = FADTBuilder::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION)
        .dsdt_64(dsdt_addr)
        .flag(Flags::HwReducedAcpi)
        .flag(Flags::PwrButton)
        .flag(Flags::SlpButton);
    builder.iapc_boot_arch = (IAPC_LEGACY_DEVICES | IAPC_8042 | IAPC_VGA_NOT_PRESENT).into();
    builder.sleep_control_reg = io_register(SLEEP_CONTROL_PORT);
    builder.sleep_status_reg = io_register(SLEEP_STATUS_PORT);
    let mut bytes = Vec::new();
    builder.finalize().to_aml_bytes(&mut bytes);
    bytes
}

fn align8(addr: u64) -> u64 {
    (addr + 7) & !7
}

/// Lays the tables out from [`ACPI_START`]: RSDP, XSDT, FADT, MADT, DSDT. Returns
/// (address, bytes) pairs in that order.
fn build(config: &AcpiConfig) -> Result<Vec<(u64, Vec<u8>)>, AcpiError> {
    let rsdp_addr = ACPI_START;
    let xsdt_addr = align8(rsdp_addr + Rsdp::len() as u64);
    // The XSDT holds two entries.
    let xsdt_len = 36 + 2 * 8;
    let fadt_addr = align8(xsdt_addr + xsdt_len);
    let dsdt = dsdt(config);
    let madt = madt(config);
    let fadt_bytes = fadt(0);
    let madt_addr = align8(fadt_addr + fadt_bytes.len() as u64);
    let dsdt_addr = align8(madt_addr + madt.len() as u64);
    let end = dsdt_addr + dsdt.len() as u64;
    if end > ACPI_END {
        return Err(AcpiError::TooBig {
            need: end - ACPI_START,
            have: ACPI_END - ACPI_START,
        });
    }
    let mut xsdt = XSDT::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    xsdt.add_entry(fadt_addr);
    xsdt.add_entry(madt_addr);
    let mut xsdt_bytes = Vec::new();
    xsdt.to_aml_bytes(&mut xsdt_bytes);
    debug_assert_eq!(xsdt_bytes.len() as u64, xsdt_len);
    let mut rsdp_bytes = Vec::new();
    Rsdp::new(OEM_ID, xsdt_addr).to_aml_bytes(&mut rsdp_bytes);
    Ok(vec![
        (rsdp_addr, rsdp_bytes),
        (xsdt_addr, xsdt_bytes),
        (fadt_addr, fadt(dsdt_addr)),
        (madt_addr, madt.as_slice().to_vec()),
        (dsdt_addr, dsdt.as_slice().to_vec()),
    ])
}

/// Writes the tables into guest memory; returns the RSDP's address.
pub fn setup_acpi(mem: &GuestMemoryMmap, config: &AcpiConfig) -> Result<u64, AcpiError> {
    const NAMES: [&str; 5] = ["RSDP", "XSDT", "FADT", "MADT", "DSDT"];
    for ((addr, bytes), table) in build(config)?.into_iter().zip(NAMES) {
        mem.write_slice(&bytes, GuestAddress(addr))
            .map_err(|source| AcpiError::Write {
                table,
                addr,
                source,
            })?;
    }
    Ok(ACPI_START)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(bytes: &[u8]) -> u8 {
        bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b))
    }

    #[test]
    fn every_table_checksums_to_zero_and_fits() {
        let tables = build(&AcpiConfig {
            vcpus: 32,
            ioapic_id: 32,
            virtio_mmio: (0..18)
                .map(|i| (0xd000_0000 + i * 0x1000, 5 + i as u32))
                .collect(),
        })
        .expect("tables");
        let (rsdp_addr, rsdp) = &tables[0];
        assert_eq!(*rsdp_addr, ACPI_START);
        assert_eq!(&rsdp[..8], b"RSD PTR ");
        assert_eq!(sum(&rsdp[..20]), 0, "RSDP v1 checksum");
        assert_eq!(sum(rsdp), 0, "RSDP extended checksum");
        for (addr, table) in &tables[1..] {
            assert_eq!(addr % 8, 0);
            let len = u32::from_le_bytes([table[4], table[5], table[6], table[7]]);
            assert_eq!(len as usize, table.len(), "{:?}", &table[..4]);
            assert_eq!(sum(table), 0, "{:?} checksum", &table[..4]);
        }
        let (_, last) = tables.last().expect("dsdt");
        assert!(
            tables.last().map(|(a, _)| a).copied().unwrap_or(0) + last.len() as u64 <= ACPI_END
        );
    }

    #[test]
    fn xsdt_points_at_fadt_and_madt_and_fadt_at_dsdt() {
        let tables = build(&AcpiConfig {
            vcpus: 2,
            ioapic_id: 2,
            virtio_mmio: vec![],
        })
        .expect("tables");
        let xsdt = &tables[1].1;
        let entry = |i: usize| {
            let at = 36 + 8 * i;
            u64::from_le_bytes(xsdt[at..at + 8].try_into().expect("8 bytes"))
        };
        assert_eq!(entry(0), tables[2].0);
        assert_eq!(entry(1), tables[3].0);
        assert_eq!(&tables[2].1[..4], b"FACP");
        assert_eq!(&tables[3].1[..4], b"APIC");
        let fadt = &tables[2].1;
        // X_DSDT sits at offset 140 of the FADT.
        let x_dsdt = u64::from_le_bytes(fadt[140..148].try_into().expect("8 bytes"));
        assert_eq!(x_dsdt, tables[4].0);
        assert_eq!(&tables[4].1[..4], b"DSDT");
        // Flags (offset 112) carry HW_REDUCED_ACPI.
        let flags = u32::from_le_bytes(fadt[112..116].try_into().expect("4 bytes"));
        assert_ne!(flags & (1 << 20), 0);
    }

    #[test]
    fn madt_lists_each_cpu_and_the_ioapic() {
        let madt = madt(&AcpiConfig {
            vcpus: 4,
            ioapic_id: 4,
            virtio_mmio: vec![],
        });
        let bytes = madt.as_slice();
        let mut at = 44;
        let mut cpus = Vec::new();
        let mut ioapics = 0;
        while at < bytes.len() {
            let (kind, len) = (bytes[at], bytes[at + 1] as usize);
            match kind {
                MADT_LOCAL_APIC => cpus.push(bytes[at + 3]),
                MADT_IOAPIC => {
                    ioapics += 1;
                    assert_eq!(bytes[at + 2], 4);
                }
                _ => {}
            }
            at += len;
        }
        assert_eq!(at, bytes.len());
        assert_eq!(cpus, vec![0, 1, 2, 3]);
        assert_eq!(ioapics, 1);
    }

    #[test]
    fn dsdt_names_the_devices_linux_binds() {
        let body = dsdt_body(&AcpiConfig {
            vcpus: 1,
            ioapic_id: 1,
            virtio_mmio: vec![(0xd000_0000, 5)],
        });
        let has = |needle: &[u8]| body.windows(needle.len()).any(|w| w == needle);
        for needle in [
            &b"QEMU0001"[..],
            b"VMGENCTR",
            b"ACPI0013",
            b"_EVT",
            b"_S5_",
            b"ADDR",
            b"LNRO0005",
        ] {
            assert!(has(needle), "{}", String::from_utf8_lossy(needle));
        }
    }
}
