//! Boot-time register, segment and page-table set-up for Linux's 64-bit entry point.

use kvm_bindings::{kvm_fpu, kvm_regs, kvm_segment, kvm_sregs};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use super::layout::{
    BOOT_STACK_POINTER, GDT_START, IDT_START, PDE_START, PDPTE_START, PML4_START, ZERO_PAGE_START,
};

/// Errors from writing boot structures into guest memory.
#[derive(Debug, thiserror::Error)]
pub enum RegsError {
    /// A boot structure did not fit into guest memory.
    #[error("cannot write the {what} at guest address {addr:#x}: {source}")]
    WriteBootStructure {
        /// Which structure.
        what: &'static str,
        /// Where it was written.
        addr: u64,
        /// The memory error.
        source: vm_memory::GuestMemoryError,
    },
}

const X86_CR0_PE: u64 = 1 << 0;
const X86_CR0_MP: u64 = 1 << 1;
const X86_CR0_ET: u64 = 1 << 4;
const X86_CR0_NE: u64 = 1 << 5;
const X86_CR0_WP: u64 = 1 << 16;
const X86_CR0_AM: u64 = 1 << 18;
const X86_CR0_PG: u64 = 1 << 31;
const X86_CR4_PAE: u64 = 1 << 5;
const X86_CR4_OSFXSR: u64 = 1 << 9;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;

/// GDT entries: null, 64-bit code, data, TSS.
const GDT_TABLE: [u64; 4] = [
    gdt_entry(0, 0, 0),
    gdt_entry(0xa09b, 0, 0xfffff),
    gdt_entry(0xc093, 0, 0xfffff),
    gdt_entry(0x808b, 0, 0xfffff),
];

const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    ((base as u64 & 0xff00_0000) << 32)
        | ((base as u64 & 0x00ff_ffff) << 16)
        | (limit as u64 & 0x0000_ffff)
        | (((limit as u64 & 0x000f_0000) >> 16) << 48)
        | ((flags as u64 & 0x0000_f0ff) << 40)
}

fn segment_from_gdt(entry: u64, table_index: u8) -> kvm_segment {
    let base = ((entry >> 16) & 0x00ff_ffff) | (((entry >> 56) & 0xff) << 24);
    let limit = ((entry & 0xffff) | (((entry >> 48) & 0xf) << 16)) as u32;
    let granularity = ((entry >> 55) & 1) as u8;
    kvm_segment {
        base,
        // With 4 KiB granularity the limit counts pages.
        limit: if granularity == 1 {
            (limit << 12) | 0xfff
        } else {
            limit
        },
        selector: u16::from(table_index) * 8,
        type_: ((entry >> 40) & 0xf) as u8,
        present: ((entry >> 47) & 1) as u8,
        dpl: ((entry >> 45) & 3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g: granularity,
        avl: ((entry >> 52) & 1) as u8,
        unusable: u8::from(((entry >> 47) & 1) == 0),
        padding: 0,
    }
}

fn write<T: vm_memory::ByteValued>(
    mem: &impl GuestMemoryBackend,
    what: &'static str,
    addr: u64,
    value: T,
) -> Result<(), RegsError> {
    mem.write_obj(value, GuestAddress(addr))
        .map_err(|source| RegsError::WriteBootStructure { what, addr, source })
}

/// Writes the GDT, an empty IDT and identity page tables for 0..4 GiB with 2 MiB pages.
/// 2 MiB pages (not 1 GiB ones) because a 1 GiB page over MMIO stops the guest on PVM hosts.
pub fn write_boot_tables(mem: &impl GuestMemoryBackend) -> Result<(), RegsError> {
    for (i, entry) in GDT_TABLE.iter().enumerate() {
        write(mem, "GDT", GDT_START + (i as u64) * 8, *entry)?;
    }
    write(mem, "IDT", IDT_START, 0u64)?;
    write(mem, "PML4", PML4_START, PDPTE_START | 0x03)?;
    for pdpt_index in 0..4u64 {
        let pd = PDE_START + pdpt_index * 0x1000;
        write(mem, "PDPT", PDPTE_START + pdpt_index * 8, pd | 0x03)?;
        for pd_index in 0..512u64 {
            let phys = (pdpt_index << 30) | (pd_index << 21);
            // present | writable | page size (2 MiB)
            write(mem, "page directory", pd + pd_index * 8, phys | 0x83)?;
        }
    }
    Ok(())
}

/// Special registers for 64-bit mode with paging through the tables above.
pub fn boot_sregs(mut sregs: kvm_sregs) -> kvm_sregs {
    let code = segment_from_gdt(GDT_TABLE[1], 1);
    let data = segment_from_gdt(GDT_TABLE[2], 2);
    let tss = segment_from_gdt(GDT_TABLE[3], 3);
    sregs.gdt.base = GDT_START;
    sregs.gdt.limit = (std::mem::size_of_val(&GDT_TABLE) - 1) as u16;
    sregs.idt.base = IDT_START;
    sregs.idt.limit = (std::mem::size_of::<u64>() - 1) as u16;
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = tss;
    sregs.cr0 =
        X86_CR0_PE | X86_CR0_MP | X86_CR0_ET | X86_CR0_NE | X86_CR0_WP | X86_CR0_AM | X86_CR0_PG;
    sregs.cr3 = PML4_START;
    sregs.cr4 = X86_CR4_PAE | X86_CR4_OSFXSR;
    sregs.efer = EFER_LME | EFER_LMA;
    sregs
}

/// General registers at the 64-bit entry: RSI points at boot_params.
pub fn boot_regs(entry: u64) -> kvm_regs {
    kvm_regs {
        rflags: 0x2,
        rip: entry,
        rsp: BOOT_STACK_POINTER,
        rbp: BOOT_STACK_POINTER,
        rsi: ZERO_PAGE_START,
        ..Default::default()
    }
}

/// The FPU state Linux expects at boot.
pub fn boot_fpu() -> kvm_fpu {
    kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vstate::memory::GuestMemoryMmap;

    #[test]
    fn code_segment_is_64_bit() {
        let code = segment_from_gdt(GDT_TABLE[1], 1);
        assert_eq!(code.l, 1);
        assert_eq!(code.db, 0);
        assert_eq!(code.selector, 8);
        assert_eq!(code.limit, 0xffff_ffff);
    }

    #[test]
    fn page_tables_identity_map_4_gib() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).expect("mem");
        write_boot_tables(&mem).expect("tables");
        let pml4: u64 = mem.read_obj(GuestAddress(PML4_START)).expect("read");
        assert_eq!(pml4, PDPTE_START | 3);
        let last_pd = PDE_START + 3 * 0x1000;
        let last: u64 = mem.read_obj(GuestAddress(last_pd + 511 * 8)).expect("read");
        assert_eq!(last, 0xffe0_0000 | 0x83);
        assert!(mem.address_in_range(GuestAddress(last_pd)));
    }
}
