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
}
