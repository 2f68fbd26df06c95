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
use acpi_tables::mcfg::MCFG;
use acpi_tables::rsdp::Rsdp;
use acpi_tables::sdt::Sdt;
use acpi_tables::xsdt::XSDT;
use acpi_tables::Aml;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use super::layout::{
    ACPI_END, ACPI_START, APIC_START, GED_IRQ, I8042_IRQ, I8042_PORT, IOAPIC_START,
    PCI_CONFIG_IO_PORT, PCI_ECAM_SIZE, PCI_ECAM_START, PCI_IO_SIZE, PCI_IO_START, PCI_MMIO32_SIZE,
    PCI_MMIO32_START, PVPANIC_PORT, SERIAL_IRQ, SERIAL_PORT, SLEEP_CONTROL_PORT, SLEEP_STATUS_PORT,
    VIRTIO_MMIO_SIZE, VMGENID_ADDR,
};

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
    /// The opt-in PCI root: an MCFG for ECAM and a PNP0A08 host bridge in the DSDT.
    pub pci: Option<PciAcpi>,
}

/// The PCI root bus the tables describe: bus 0, ECAM at [`PCI_ECAM_START`], the I/O and
/// 32-bit windows of the layout and this 64-bit window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PciAcpi {
    /// The 64-bit memory window: (start, size).
    pub mmio64: (u64, u64),
}

/// The DSDT's PCI root (`PCI0`) and the motherboard resource that reserves ECAM, which
/// Linux wants before it trusts the MCFG.
fn pci_devices(pci: &PciAcpi) -> Vec<u8> {
    let (mmio64_start, mmio64_size) = pci.mmio64;
    let mut bytes = aml_bytes(&aml::Device::new(
        "PCI0".into(),
        vec![
            &aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0A08")),
            &aml::Name::new("_CID".into(), &aml::EISAName::new("PNP0A03")),
            &aml::Name::new("_ADR".into(), &aml::ZERO),
            &aml::Name::new("_SEG".into(), &aml::ZERO),
            &aml::Name::new("_UID".into(), &aml::ZERO),
            &aml::Name::new("_BBN".into(), &aml::ZERO),
            &aml::Name::new(
                "_CRS".into(),
                &aml::ResourceTemplate::new(vec![
                    &aml::AddressSpace::new_bus_number(0u16, 0u16),
                    &aml::IO::new(PCI_CONFIG_IO_PORT, PCI_CONFIG_IO_PORT, 1, 8),
                    &aml::AddressSpace::new_io(
                        PCI_IO_START as u16,
                        (PCI_IO_START + PCI_IO_SIZE - 1) as u16,
                        None,
                    ),
                    &aml::AddressSpace::new_memory(
                        aml::AddressSpaceCacheable::NotCacheable,
                        true,
                        PCI_MMIO32_START as u32,
                        (PCI_MMIO32_START + PCI_MMIO32_SIZE - 1) as u32,
                        None,
                    ),
                    &aml::AddressSpace::new_memory(
                        aml::AddressSpaceCacheable::PreFetchable,
                        true,
                        mmio64_start,
                        mmio64_start + mmio64_size - 1,
                        None,
                    ),
                ]),
            ),
        ],
    ));
    bytes.extend(aml_bytes(&aml::Device::new(
        "MRES".into(),
        vec![
            &aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0C02")),
            &aml::Name::new("_UID".into(), &aml::ZERO),
            &aml::Name::new(
                "_CRS".into(),
                &aml::ResourceTemplate::new(vec![&aml::Memory32Fixed::new(
                    false,
                    PCI_ECAM_START as u32,
                    PCI_ECAM_SIZE as u32,
                )]),
            ),
        ],
    )));
    bytes
}

/// The MCFG: one ECAM region, segment 0, bus 0 only.
fn mcfg() -> Vec<u8> {
    let mut mcfg = MCFG::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    mcfg.add_ecam(PCI_ECAM_START, 0, 0, 0);
    aml_bytes(&mcfg)
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
    if let Some(pci) = &config.pci {
        devices.extend(pci_devices(pci));
    }
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

/// Lays the tables out from [`ACPI_START`]: RSDP, XSDT, FADT, MADT, DSDT, and with PCI an
/// MCFG. Returns (address, bytes) pairs in that order.
fn build(config: &AcpiConfig) -> Result<Vec<(u64, Vec<u8>)>, AcpiError> {
    let rsdp_addr = ACPI_START;
    let xsdt_addr = align8(rsdp_addr + Rsdp::len() as u64);
    let mcfg = config.pci.as_ref().map(|_| mcfg());
    // The XSDT holds the FADT, the MADT and the MCFG if there is one.
    let xsdt_len = 36 + (2 + mcfg.iter().len() as u64) * 8;
    let fadt_addr = align8(xsdt_addr + xsdt_len);
    let dsdt = dsdt(config);
    let madt = madt(config);
    let fadt_bytes = fadt(0);
    let madt_addr = align8(fadt_addr + fadt_bytes.len() as u64);
    let dsdt_addr = align8(madt_addr + madt.len() as u64);
    let mcfg_addr = align8(dsdt_addr + dsdt.len() as u64);
    let end = match &mcfg {
        Some(bytes) => mcfg_addr + bytes.len() as u64,
        None => dsdt_addr + dsdt.len() as u64,
    };
    if end > ACPI_END {
        return Err(AcpiError::TooBig {
            need: end - ACPI_START,
            have: ACPI_END - ACPI_START,
        });
    }
    let mut xsdt = XSDT::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    xsdt.add_entry(fadt_addr);
    xsdt.add_entry(madt_addr);
    if mcfg.is_some() {
        xsdt.add_entry(mcfg_addr);
    }
    let mut xsdt_bytes = Vec::new();
    xsdt.to_aml_bytes(&mut xsdt_bytes);
    debug_assert_eq!(xsdt_bytes.len() as u64, xsdt_len);
    let mut rsdp_bytes = Vec::new();
    Rsdp::new(OEM_ID, xsdt_addr).to_aml_bytes(&mut rsdp_bytes);
    let mut tables = vec![
        (rsdp_addr, rsdp_bytes),
        (xsdt_addr, xsdt_bytes),
        (fadt_addr, fadt(dsdt_addr)),
        (madt_addr, madt.as_slice().to_vec()),
        (dsdt_addr, dsdt.as_slice().to_vec()),
    ];
    tables.extend(mcfg.map(|bytes| (mcfg_addr, bytes)));
    Ok(tables)
}

/// Writes the tables into guest memory; returns the RSDP's address.
pub fn setup_acpi(mem: &impl GuestMemoryBackend, config: &AcpiConfig) -> Result<u64, AcpiError> {
    const NAMES: [&str; 6] = ["RSDP", "XSDT", "FADT", "MADT", "DSDT", "MCFG"];
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
            pci: None,
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
            pci: None,
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
            pci: None,
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
            pci: None,
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

    fn pci_config() -> AcpiConfig {
        AcpiConfig {
            vcpus: 2,
            ioapic_id: 2,
            virtio_mmio: vec![(0xd000_0000, 5)],
            pci: Some(PciAcpi {
                mmio64: (1 << 32, (1 << 46) - (1 << 32)),
            }),
        }
    }

    #[test]
    fn without_pci_there_is_no_mcfg_and_no_pci_root() {
        let config = AcpiConfig {
            pci: None,
            ..pci_config()
        };
        let tables = build(&config).expect("tables");
        assert_eq!(tables.len(), 5);
        assert_eq!(tables[1].1.len(), 36 + 2 * 8, "XSDT: FADT and MADT");
        let body = dsdt_body(&config);
        let pnp0a08 = aml_bytes(&aml::EISAName::new("PNP0A08"));
        assert!(!body.windows(pnp0a08.len()).any(|w| w == pnp0a08));
        assert!(!body.windows(4).any(|w| w == b"PCI0"));
    }

    #[test]
    fn with_pci_the_xsdt_lists_an_mcfg_for_bus_0() {
        let tables = build(&pci_config()).expect("tables");
        assert_eq!(tables.len(), 6);
        let (mcfg_addr, mcfg) = &tables[5];
        assert_eq!(&mcfg[..4], b"MCFG");
        assert_eq!(sum(mcfg), 0, "MCFG checksum");
        assert_eq!(mcfg.len(), 44 + 16, "header, reserved, one allocation");
        let base = u64::from_le_bytes(mcfg[44..52].try_into().expect("8 bytes"));
        assert_eq!(base, PCI_ECAM_START);
        assert_eq!(&mcfg[52..56], &[0, 0, 0, 0], "segment 0, buses 0..=0");
        let xsdt = &tables[1].1;
        assert_eq!(xsdt.len(), 36 + 3 * 8);
        assert_eq!(sum(xsdt), 0);
        let third = u64::from_le_bytes(xsdt[52..60].try_into().expect("8 bytes"));
        assert_eq!(third, *mcfg_addr);
        assert!(*mcfg_addr >= tables[4].0 + tables[4].1.len() as u64);
        assert!(mcfg_addr + mcfg.len() as u64 <= ACPI_END);
    }

    #[test]
    fn with_pci_the_dsdt_has_a_pci_root_with_its_windows() {
        let config = pci_config();
        let body = dsdt_body(&config);
        let has = |needle: &[u8]| body.windows(needle.len()).any(|w| w == needle);
        for name in ["PNP0A08", "PNP0A03", "PNP0C02"] {
            assert!(has(&aml_bytes(&aml::EISAName::new(name))), "{name}");
        }
        for needle in [&b"PCI0"[..], b"_BBN", b"_SEG", b"MRES", b"LNRO0005"] {
            assert!(has(needle), "{}", String::from_utf8_lossy(needle));
        }
        let (start, size) = config.pci.expect("pci").mmio64;
        let window = aml_bytes(&aml::AddressSpace::new_memory(
            aml::AddressSpaceCacheable::PreFetchable,
            true,
            start,
            start + size - 1,
            None,
        ));
        assert!(has(&window), "64-bit window in _CRS");
        let ecam = aml_bytes(&aml::Memory32Fixed::new(
            false,
            PCI_ECAM_START as u32,
            PCI_ECAM_SIZE as u32,
        ));
        assert!(has(&ecam), "ECAM reserved as a motherboard resource");
        let tables = build(&config).expect("tables");
        let (_, dsdt) = &tables[4];
        assert_eq!(sum(dsdt), 0);
    }
}
