//! Guest physical memory layout (x86-64).
//!
//! ```text
//! 0x0000_0500  GDT            0x0000_0520  IDT (empty)
//! 0x0000_7000  boot_params    0x0000_8ff0  boot stack top
//! 0x0000_9000  PML4           0x0000_a000  PDPT   0x0000_b000..0x0000_f000  4 page directories
//! 0x0002_0000  command line   0x0009_fc00  MP table (EBDA)
//! 0x000e_0000  ACPI tables (RSDP first)    0x000f_f000  VM generation ID (16 bytes)
//! 0x0010_0000  kernel         ...          initrd (top of low RAM)
//! 0xc000_0000  MMIO gap: virtio-mmio windows from 0xd000_0000, IOAPIC, LAPIC
//! 0x1_0000_0000  RAM above the gap
//! ```
//!
//! PCI (only with the opt-in PCI root): 32-bit BARs in 0xc000_0000..0xd000_0000, ECAM for
//! bus 0 at 0xe000_0000 (1 MiB), I/O BARs in ports 0xc000..0x10000, 64-bit BARs in a window
//! from the first 1 GiB boundary above RAM to the guest's physical-address limit
//! ([`pci_mmio64_window`]).

/// Start of the GDT.
pub const GDT_START: u64 = 0x500;
/// Start of the (empty) IDT.
pub const IDT_START: u64 = 0x520;
/// The Linux zero page (`boot_params`).
pub const ZERO_PAGE_START: u64 = 0x7000;
/// Initial stack pointer of the boot vCPU.
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
/// Top-level page table.
pub const PML4_START: u64 = 0x9000;
/// Page-directory-pointer table.
pub const PDPTE_START: u64 = 0xa000;
/// First of the four page directories that identity-map 0..4 GiB with 2 MiB pages.
pub const PDE_START: u64 = 0xb000;
/// Kernel command line.
pub const CMDLINE_START: u64 = 0x20000;
/// Largest command line we accept (Linux's COMMAND_LINE_SIZE on x86).
pub const CMDLINE_MAX_SIZE: usize = 2048;
/// Start of the extended BIOS data area; the MP table lives here.
pub const EBDA_START: u64 = 0x9fc00;
/// Where the kernel is loaded (1 MiB).
pub const HIMEM_START: u64 = 0x10_0000;
/// Start of the MMIO gap below 4 GiB.
pub const MMIO_GAP_START: u64 = 0xc000_0000;
/// End of the MMIO gap (4 GiB).
pub const MMIO_GAP_END: u64 = 0x1_0000_0000;
/// First virtio-mmio window.
pub const VIRTIO_MMIO_START: u64 = 0xd000_0000;
/// Size of one virtio-mmio window.
pub const VIRTIO_MMIO_SIZE: u64 = 0x1000;
/// IOAPIC base address.
pub const IOAPIC_START: u64 = 0xfec0_0000;
/// Local APIC base address.
pub const APIC_START: u64 = 0xfee0_0000;
/// First GSI handed to virtio devices (0-4 are taken by the PIT, keyboard, COM ports).
pub const IRQ_BASE: u32 = 5;
/// Last GSI usable for virtio devices.
pub const IRQ_MAX: u32 = 22;
/// The IOAPIC's last pin.
pub const IOAPIC_LAST_PIN: u32 = 23;
/// The ACPI Generic Event Device's interrupt (VM generation changes).
pub const GED_IRQ: u32 = 23;
/// Start of the ACPI tables (the RSDP, where Linux's BIOS-area scan finds it).
pub const ACPI_START: u64 = 0xe_0000;
/// End of the ACPI tables.
pub const ACPI_END: u64 = VMGENID_ADDR;
/// The 16-byte VM generation ID (Microsoft's VMGenID), in a page of its own.
pub const VMGENID_ADDR: u64 = 0xf_f000;
/// End of the firmware area below 1 MiB that the e820 map reserves.
pub const FIRMWARE_END: u64 = 0x10_0000;
/// COM1 serial port.
pub const SERIAL_PORT: u16 = 0x3f8;
/// COM1 interrupt line.
pub const SERIAL_IRQ: u32 = 4;
/// i8042 data port; the command port is `I8042_PORT + 4`.
pub const I8042_PORT: u16 = 0x60;
/// i8042 keyboard interrupt line.
pub const I8042_IRQ: u32 = 1;
/// ACPI sleep control register (FADT): writing SLP_TYP=5 | SLP_EN powers off.
pub const SLEEP_CONTROL_PORT: u16 = 0x3c0;
/// ACPI sleep status register (FADT); always reads 0.
pub const SLEEP_STATUS_PORT: u16 = 0x3c1;
/// pvpanic: the guest writes 1 here when its kernel panics.
pub const PVPANIC_PORT: u16 = 0x505;

/// PCI window for 32-bit memory BARs: the bottom of the MMIO gap, below the virtio-mmio windows.
pub const PCI_MMIO32_START: u64 = MMIO_GAP_START;
/// Size of the 32-bit PCI window (256 MiB).
pub const PCI_MMIO32_SIZE: u64 = VIRTIO_MMIO_START - MMIO_GAP_START;
/// PCI Express enhanced configuration (ECAM) for bus 0.
pub const PCI_ECAM_START: u64 = 0xe000_0000;
/// ECAM size: 1 MiB per bus; only bus 0 exists.
pub const PCI_ECAM_SIZE: u64 = 1 << 20;
/// The CF8 address port; CFC..CFF is the data window.
pub const PCI_CONFIG_IO_PORT: u16 = 0xcf8;
/// PCI window for I/O BARs.
pub const PCI_IO_START: u64 = 0xc000;
/// Size of the I/O window.
pub const PCI_IO_SIZE: u64 = 0x4000;
/// First GSI for MSI and MSI-X routes (above the IOAPIC's pins).
pub const MSI_GSI_BASE: u32 = IOAPIC_LAST_PIN + 1;
/// Alignment of the 64-bit PCI window's start.
pub const PCI_MMIO64_ALIGN: u64 = 1 << 30;

/// The 64-bit PCI window (start, size) for `mem_bytes` of RAM and a guest with
/// `phys_bits` of physical address: from the first 1 GiB boundary at or above the end of RAM
/// (and 4 GiB) to `1 << phys_bits`. `None` when nothing is left.
pub fn pci_mmio64_window(mem_bytes: u64, phys_bits: u8) -> Option<(u64, u64)> {
    let limit = 1u64.checked_shl(u32::from(phys_bits))?;
    let start = ram_end(mem_bytes)
        .max(MMIO_GAP_END)
        .checked_next_multiple_of(PCI_MMIO64_ALIGN)?;
    (limit > start).then(|| (start, limit - start))
}

/// The RAM regions (guest address, size) for `mem_bytes` of guest memory, split around
/// the MMIO gap.
pub fn ram_regions(mem_bytes: u64) -> Vec<(u64, u64)> {
    if mem_bytes <= MMIO_GAP_START {
        vec![(0, mem_bytes)]
    } else {
        vec![
            (0, MMIO_GAP_START),
            (MMIO_GAP_END, mem_bytes - MMIO_GAP_START),
        ]
    }
}

/// One past the last guest-physical RAM address.
pub fn ram_end(mem_bytes: u64) -> u64 {
    ram_regions(mem_bytes)
        .last()
        .map(|(start, size)| start + size)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_memory_is_one_region() {
        assert_eq!(ram_regions(128 << 20), vec![(0, 128 << 20)]);
    }

    #[test]
    fn large_memory_skips_the_mmio_gap() {
        let regions = ram_regions(4 << 30);
        assert_eq!(
            regions,
            vec![
                (0, MMIO_GAP_START),
                (MMIO_GAP_END, (4 << 30) - MMIO_GAP_START)
            ]
        );
        assert_eq!(ram_end(4 << 30), MMIO_GAP_END + (1 << 30));
    }

    #[test]
    fn pci_windows_stay_clear_of_ram_and_devices() {
        assert_eq!(PCI_MMIO32_START + PCI_MMIO32_SIZE, VIRTIO_MMIO_START);
        const {
            assert!(PCI_ECAM_START >= VIRTIO_MMIO_START + 0x100 * VIRTIO_MMIO_SIZE);
            assert!(PCI_ECAM_START + PCI_ECAM_SIZE <= IOAPIC_START);
        }
        // 128 MiB of RAM, 46 address bits: from 4 GiB to 64 TiB.
        assert_eq!(
            pci_mmio64_window(128 << 20, 46),
            Some((1 << 32, (1 << 46) - (1 << 32)))
        );
        // 6.5 GiB of RAM ends at 7.5 GiB: the window starts at 8 GiB.
        let (start, _) = pci_mmio64_window(13 << 29, 46).expect("window");
        assert_eq!(start, 8 << 30);
        assert!(start >= ram_end(13 << 29));
        assert_eq!(pci_mmio64_window(1 << 40, 40), None);
    }
}
