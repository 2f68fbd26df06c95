//! `smp-start`: wakes vCPU 1 with INIT/SIPI through the local APIC. The AP starts in real
//! mode at the trampoline copied to TRAMPOLINE (below 1 MiB), switches straight to long
//! mode with the BSP's GDT and page tables, and runs `ap_main`, which counts in memory.

use core::ptr::{read_volatile, write_volatile};

use crate::io::{pause, Deadline};

/// Where the trampoline runs: SIPI vector 6 → CS:IP = 0x0600:0000. 0x6000..0x7000 is
/// below the zero page and unused by the VMM's boot layout.
const TRAMPOLINE: usize = 0x6000;
const SIPI_VECTOR: u32 = (TRAMPOLINE >> 12) as u32;
const LAPIC: usize = 0xfee0_0000;
const LAPIC_SVR: usize = 0x0f0;
const LAPIC_ICR_LOW: usize = 0x300;
const LAPIC_ICR_HIGH: usize = 0x310;
const ICR_INIT_ASSERT: u32 = 0x0000_4500;
const ICR_STARTUP: u32 = 0x0000_4600;
const ICR_PENDING: u32 = 1 << 12;
const AP_APIC_ID: u32 = 1;
const AP_STACK_SIZE: usize = 16 * 1024;

// Offsets of the trampoline's parameter block; `smp-start` fills it in.
const OFF_GDTR: usize = 8;
const OFF_CR3: usize = 16;
const OFF_FAR_JUMP: usize = 24;
const OFF_STACK: usize = 32;
const OFF_ENTRY: usize = 40;

#[repr(C, align(16))]
struct ApStack([u8; AP_STACK_SIZE]);
static mut AP_STACK: ApStack = ApStack([0; AP_STACK_SIZE]);
/// Incremented by vCPU 1 forever once it runs.
static mut AP_COUNTER: u64 = 0;

#[cfg(not(test))]
core::arch::global_asm!(
    ".section .rodata.ap_trampoline, \"a\"",
    ".global ap_trampoline_start",
    ".global ap_trampoline_end",
    ".global ap_trampoline_64",
    ".code16",
    "ap_trampoline_start:",
    "jmp 3f",
    ".balign 8",
    // +8: GDTR (limit u16, base u32), +16: CR3, +24: far pointer (offset u32, selector u16)
    // to the 64-bit part, +32: stack pointer, +40: entry.
    ".quad 0", ".quad 0", ".quad 0", ".quad 0", ".quad 0",
    "3:",
    "cli",
    "mov ax, cs",
    "mov ds, ax",
    "lgdt [8]",
    "mov eax, cr4",
    "or eax, 0x20", // PAE
    "mov cr4, eax",
    "mov eax, [16]",
    "mov cr3, eax",
    "mov ecx, 0xc0000080", // EFER
    "rdmsr",
    "or eax, 0x100", // LME
    "wrmsr",
    "mov eax, cr0",
    "or eax, 0x80000001", // PG | PE
    "mov cr0, eax",
    "jmp fword ptr [24]",
    ".code64",
    "ap_trampoline_64:",
    "xor eax, eax",
    "mov ds, ax",
    "mov es, ax",
    "mov ss, ax",
    "mov rsp, [{base} + 32]",
    "jmp qword ptr [{base} + 40]",
    "ap_trampoline_end:",
    base = const TRAMPOLINE,
);

#[cfg(not(test))]
extern "C" {
    static ap_trampoline_start: u8;
    static ap_trampoline_end: u8;
    static ap_trampoline_64: u8;
}

/// vCPU 1's program: count forever.
extern "C" fn ap_main() -> ! {
    let counter = &raw mut AP_COUNTER;
    loop {
        // SAFETY: only this vCPU writes AP_COUNTER; the BSP only reads it.
        unsafe { write_volatile(counter, read_volatile(counter).wrapping_add(1)) };
    }
}

pub fn count() -> u64 {
    // SAFETY: a plain aligned read of a counter the AP writes.
    unsafe { read_volatile(&raw const AP_COUNTER) }
}

fn lapic_write(reg: usize, value: u32) {
    // SAFETY: the local APIC's xAPIC window, identity-mapped by the VMM.
    unsafe { write_volatile((LAPIC + reg) as *mut u32, value) }
}

fn lapic_read(reg: usize) -> u32 {
    // SAFETY: as for `lapic_write`.
    unsafe { read_volatile((LAPIC + reg) as *const u32) }
}

fn send_ipi(tpm: u64, low: u32) -> Result<(), &'static str> {
    lapic_write(LAPIC_ICR_HIGH, AP_APIC_ID << 24);
    lapic_write(LAPIC_ICR_LOW, low);
    let deadline = Deadline::after_ms(tpm, 100);
    while lapic_read(LAPIC_ICR_LOW) & ICR_PENDING != 0 {
        if deadline.passed() {
            return Err("ipi-not-delivered");
        }
        pause();
    }
    Ok(())
}

fn wait_ms(tpm: u64, ms: u64) {
    let deadline = Deadline::after_ms(tpm, ms);
    while !deadline.passed() {
        pause();
    }
}

/// Copies the trampoline, sends INIT, SIPI, SIPI, and waits for the counter to move.
#[cfg(not(test))]
pub fn start(tpm: u64) -> Result<(), &'static str> {
    if count() != 0 {
        return Ok(());
    }
    let (src, len) = {
        let start = &raw const ap_trampoline_start;
        let end = &raw const ap_trampoline_end;
        (start, (end as usize).wrapping_sub(start as usize))
    };
    if len == 0 || len > 4096 {
        return Err("bad-trampoline-size");
    }
    // SAFETY: TRAMPOLINE..+4 KiB is guest RAM the VMM's layout leaves unused, and the
    // trampoline (len ≤ 4096 bytes of .rodata) does not overlap it.
    unsafe { core::ptr::copy_nonoverlapping(src, TRAMPOLINE as *mut u8, len) };

    let (gdt_limit, gdt_base, cr3, cs): (u16, u64, u64, u16);
    let mut gdtr = [0u8; 10];
    // SAFETY: sgdt writes 10 bytes into `gdtr`; the others only read registers.
    unsafe {
        core::arch::asm!("sgdt [{0}]", in(reg) gdtr.as_mut_ptr(), options(nostack));
        core::arch::asm!("mov {0}, cr3", out(reg) cr3, options(nomem, nostack));
        core::arch::asm!("mov {0:x}, cs", out(reg) cs, options(nomem, nostack));
    }
    gdt_limit = u16::from_le_bytes([gdtr[0], gdtr[1]]);
    gdt_base = u64::from_le_bytes([
        gdtr[2], gdtr[3], gdtr[4], gdtr[5], gdtr[6], gdtr[7], gdtr[8], gdtr[9],
    ]);
    if gdt_base > u32::MAX as u64 || cr3 > u32::MAX as u64 {
        return Err("gdt-or-cr3-above-4g");
    }
    let long_entry = TRAMPOLINE + ap_long_offset();
    let stack_top = (&raw mut AP_STACK) as usize + AP_STACK_SIZE;
    let put = |off: usize, bytes: &[u8]| {
        // SAFETY: writes inside the trampoline page just copied.
        unsafe {
            core::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                (TRAMPOLINE + off) as *mut u8,
                bytes.len(),
            )
        }
    };
    put(OFF_GDTR, &gdt_limit.to_le_bytes());
    put(OFF_GDTR + 2, &(gdt_base as u32).to_le_bytes());
    put(OFF_CR3, &(cr3 as u32).to_le_bytes());
    put(OFF_FAR_JUMP, &(long_entry as u32).to_le_bytes());
    put(OFF_FAR_JUMP + 4, &cs.to_le_bytes());
    put(OFF_STACK, &(stack_top as u64).to_le_bytes());
    put(
        OFF_ENTRY,
        &(ap_main as *const () as usize as u64).to_le_bytes(),
    );

    // Software-enable the local APIC (spurious vector 0xff), then INIT, SIPI, SIPI.
    lapic_write(LAPIC_SVR, lapic_read(LAPIC_SVR) | 0x1ff);
    send_ipi(tpm, ICR_INIT_ASSERT)?;
    wait_ms(tpm, 10);
    for _ in 0..2 {
        send_ipi(tpm, ICR_STARTUP | SIPI_VECTOR)?;
        wait_ms(tpm, 1);
    }
    let deadline = Deadline::after_ms(tpm, 2000);
    while count() == 0 {
        if deadline.passed() {
            return Err("ap-did-not-start");
        }
        pause();
    }
    Ok(())
}

#[cfg(not(test))]
fn ap_long_offset() -> usize {
    ((&raw const ap_trampoline_64) as usize).wrapping_sub((&raw const ap_trampoline_start) as usize)
}

/// Host unit tests have no APIC to talk to.
#[cfg(test)]
pub fn start(_tpm: u64) -> Result<(), &'static str> {
    Err("no-smp-in-host-tests")
}
