//! PCI: a root bus with configuration space over CF8/CFC and ECAM, BAR allocation in 32-bit
//! and 64-bit windows, MSI-X emulation and MSI routing through KVM GSI routes and irqfds.
//!
//! Nothing here is in the default VM: the builder calls [`attach`] only for a machine with
//! `--pci` (or `--vfio`, which implies it).

pub mod bus;
pub mod config;
pub mod msi;
pub mod msix;
pub mod persist;
pub mod router;
pub mod vfio;

use std::sync::{Arc, Mutex};

use crate::arch::acpi::PciAcpi;
use crate::arch::layout::{
    pci_mmio64_window, PCI_CONFIG_IO_PORT, PCI_ECAM_SIZE, PCI_ECAM_START, PCI_IO_SIZE,
    PCI_IO_START, PCI_MMIO32_SIZE, PCI_MMIO32_START,
};
use crate::vstate::bus::{Bus, BusError};
use bus::{BarWindows, PciConfigIo, PciEcam, PciMmioWindow, PciRoot};

/// Errors from putting the PCI root on the buses.
#[derive(Debug, thiserror::Error)]
pub enum PciError {
    /// No room for a 64-bit window above RAM.
    #[error("no 64-bit PCI window fits above {mem_bytes:#x} bytes of RAM with {phys_bits} physical address bits")]
    NoWindow {
        /// Guest RAM.
        mem_bytes: u64,
        /// The guest's physical address width.
        phys_bits: u8,
    },
    /// A BAR did not fit.
    #[error(transparent)]
    Bus(#[from] bus::PciBusError),
    /// A range on the I/O or MMIO bus was taken.
    #[error("cannot place the PCI {what}: {source}")]
    Range {
        /// Which range.
        what: &'static str,
        /// The bus error.
        source: BusError,
    },
}

/// The PCI root as attached: what the ACPI tables and later device set-up need.
pub struct AttachedPci {
    /// The bus.
    pub root: Arc<PciRoot>,
    /// Where its BARs went.
    pub placements: Vec<bus::Placement>,
    /// The windows for the DSDT's `_CRS`.
    pub acpi: PciAcpi,
    /// Ports CF8-CFF (their address latch is saved in a snapshot).
    pub config_io: Arc<Mutex<PciConfigIo>>,
}

/// The PCI bus of a running microVM, kept for its lifetime.
pub struct PciMachine {
    /// The root bus.
    pub root: Arc<PciRoot>,
    /// Where the BARs went at boot.
    pub placements: Vec<bus::Placement>,
    /// Devices passed through with VFIO.
    pub vfio: vfio::VfioSet,
    /// The MSI GSIs and routing table.
    pub router: Arc<Mutex<router::MsiRouter>>,
    /// Ports CF8-CFF.
    pub config_io: Arc<Mutex<PciConfigIo>>,
}

impl PciMachine {
    /// Why a snapshot or fork of this machine is refused, if it is: VFIO devices' state
    /// cannot be saved. A bus of emulated functions is saved ([`persist`]).
    pub fn snapshot_refusal(&self) -> Option<String> {
        if self.vfio.paths.is_empty() {
            return None;
        }
        let names: Vec<String> = self
            .vfio
            .paths
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        Some(format!(
            "a microVM with VFIO device(s) {} cannot be snapshotted or forked: a passed-through \
             device's state cannot be saved without the device's help",
            names.join(", ")
        ))
    }
}

/// The guest's physical address width: the host CPU's (CPUID 0x8000_0008), which KVM passes
/// through, at most 52.
pub fn host_phys_bits() -> u8 {
    let leaf = std::arch::x86_64::__cpuid(0x8000_0000);
    if leaf.eax < 0x8000_0008 {
        return 36;
    }
    let bits = std::arch::x86_64::__cpuid(0x8000_0008).eax & 0xff;
    (bits as u8).clamp(36, 52)
}

/// Places `root`'s BARs and puts CF8/CFC on `pio` and ECAM and the memory and I/O windows on
/// `mmio` and `pio`, for a guest with `mem_bytes` of RAM and `phys_bits` of physical address.
pub fn attach(
    root: PciRoot,
    pio: &mut Bus,
    mmio: &mut Bus,
    mem_bytes: u64,
    phys_bits: u8,
) -> Result<AttachedPci, PciError> {
    let mmio64 = pci_mmio64_window(mem_bytes, phys_bits).ok_or(PciError::NoWindow {
        mem_bytes,
        phys_bits,
    })?;
    let mut windows = BarWindows::new(mmio64);
    let placements = root.place_bars(&mut windows)?;
    let root = Arc::new(root);
    let range = |what| move |source| PciError::Range { what, source };
    let config_io = Arc::new(Mutex::new(PciConfigIo::new(Arc::clone(&root))));
    pio.insert(
        Arc::clone(&config_io) as Arc<Mutex<dyn crate::vstate::bus::BusDevice>>,
        u64::from(PCI_CONFIG_IO_PORT),
        8,
    )
    .map_err(range("CF8/CFC ports"))?;
    mmio.insert(
        Arc::new(Mutex::new(PciEcam::new(Arc::clone(&root)))),
        PCI_ECAM_START,
        PCI_ECAM_SIZE,
    )
    .map_err(range("ECAM window"))?;
    let window = |base| Arc::new(Mutex::new(PciMmioWindow::new(Arc::clone(&root), base)));
    mmio.insert(window(PCI_MMIO32_START), PCI_MMIO32_START, PCI_MMIO32_SIZE)
        .map_err(range("32-bit window"))?;
    mmio.insert(window(mmio64.0), mmio64.0, mmio64.1)
        .map_err(range("64-bit window"))?;
    pio.insert(
        Arc::new(Mutex::new(PciIoWindow(Arc::clone(&root)))),
        PCI_IO_START,
        PCI_IO_SIZE,
    )
    .map_err(range("I/O window"))?;
    Ok(AttachedPci {
        root,
        placements,
        acpi: PciAcpi { mmio64 },
        config_io,
    })
}

/// The I/O window on the port bus: accesses go to the I/O BAR that decodes them.
struct PciIoWindow(Arc<PciRoot>);

impl crate::vstate::bus::BusDevice for PciIoWindow {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if !self.0.io_read(PCI_IO_START + offset, data) {
            data.fill(0xff);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        self.0.io_write(PCI_IO_START + offset, data);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_attached_root_answers_on_cf8_and_ecam() {
        let (mut pio, mut mmio) = (Bus::default(), Bus::default());
        let attached = attach(PciRoot::new(), &mut pio, &mut mmio, 1 << 30, 46).expect("attach");
        assert!(
            attached.placements.is_empty(),
            "the host bridge has no BARs"
        );
        assert_eq!(attached.acpi.mmio64, (1 << 32, (1 << 46) - (1 << 32)));
        assert!(pio.write(0xcf8, &0x8000_0000u32.to_le_bytes()));
        let mut data = [0u8; 4];
        assert!(pio.read(0xcfc, &mut data));
        assert_eq!(u32::from_le_bytes(data), 0x0008_1b36);
        assert!(mmio.read(PCI_ECAM_START, &mut data));
        assert_eq!(u32::from_le_bytes(data), 0x0008_1b36);
        assert!(mmio.read(PCI_ECAM_START + (1 << 15), &mut data));
        assert_eq!(data, [0xff; 4], "slot 1 is empty");
        // Nothing decodes in the windows yet: all ones, but the access is claimed.
        assert!(mmio.read(PCI_MMIO32_START, &mut data));
        assert_eq!(data, [0xff; 4]);
        assert!(pio.read(PCI_IO_START, &mut data));
        assert_eq!(data, [0xff; 4]);
        // Attaching twice collides on the ports.
        assert!(matches!(
            attach(PciRoot::new(), &mut pio, &mut Bus::default(), 1 << 30, 46),
            Err(PciError::Range {
                what: "CF8/CFC ports",
                ..
            })
        ));
        assert!(matches!(
            attach(
                PciRoot::new(),
                &mut Bus::default(),
                &mut Bus::default(),
                1 << 40,
                40
            ),
            Err(PciError::NoWindow { .. })
        ));
    }
}
