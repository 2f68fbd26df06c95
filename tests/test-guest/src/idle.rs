//! Idle mode (`idle` command): between serial commands the guest halts the way Linux does,
//! instead of busy-polling, and the UART's receive interrupt wakes it.
//!
//! The 8259 PIC delivers IRQ 4 (COM1) as vector 0x24 through LINT0 (ExtINT on the BSP).
//! The handler cannot `iretq` (KVM's emulator has no protected-mode IRET), so it never
//! returns to the interrupted code: interrupts are only ever enabled around one `hlt` in
//! `idle_halt`, and the handler restores the stack pointer saved there and returns to
//! `idle_halt`'s caller, with IF clear (interrupt gates clear it).
//! Vsock is not polled while idle: wake-ups come from serial input only.

#[cfg(not(test))]
use core::arch::{asm, global_asm};

#[cfg(not(test))]
use crate::io::outb;

const PIC1_CMD: u16 = 0x20;
const PIC1_DATA: u16 = 0x21;
const PIC2_CMD: u16 = 0xa0;
const PIC2_DATA: u16 = 0xa1;
const PIC_EOI: u8 = 0x20;
/// Vector of PIC1's IRQ 0; COM1 (IRQ 4) arrives as `PIC1_VECTOR_BASE + 4`.
const PIC1_VECTOR_BASE: u8 = 0x20;
const PIC2_VECTOR_BASE: u8 = 0x28;
const COM1_IRQ: u8 = 4;
const COM1_VECTOR: usize = (PIC1_VECTOR_BASE + COM1_IRQ) as usize;
const COM1_IER: u16 = 0x3f9;
const COM1_MCR: u16 = 0x3fc;
const IER_RECEIVED_DATA: u8 = 0x01;
/// DTR, RTS and OUT2 (OUT2 gates the IRQ line on a real 16550).
const MCR_DTR_RTS_OUT2: u8 = 0x0b;
/// Present, DPL 0, 64-bit interrupt gate.
const GATE_INTERRUPT: u8 = 0x8e;
const IDT_ENTRIES: usize = COM1_VECTOR + 1;

#[derive(Clone, Copy)]
#[repr(C)]
struct Gate {
    offset_low: u16,
    selector: u16,
    ist: u8,
    kind: u8,
    offset_mid: u16,
    offset_high: u32,
    reserved: u32,
}

impl Gate {
    const ABSENT: Gate = Gate {
        offset_low: 0,
        selector: 0,
        ist: 0,
        kind: 0,
        offset_mid: 0,
        offset_high: 0,
        reserved: 0,
    };

    fn interrupt(handler: u64, selector: u16) -> Gate {
        Gate {
            offset_low: handler as u16,
            selector,
            ist: 0,
            kind: GATE_INTERRUPT,
            offset_mid: (handler >> 16) as u16,
            offset_high: (handler >> 32) as u32,
            reserved: 0,
        }
    }
}

#[repr(C, align(16))]
struct Idt([Gate; IDT_ENTRIES]);

static mut IDT: Idt = Idt([Gate::ABSENT; IDT_ENTRIES]);
/// The stack pointer `idle_halt` saved before `hlt`; the interrupt handler restores it.
#[cfg_attr(not(test), no_mangle)]
static mut IDLE_SAVED_RSP: u64 = 0;

#[cfg(not(test))]
global_asm!(
    ".section .text.idle, \"ax\"",
    ".global idle_halt",
    "idle_halt:",
    "mov [rip + {saved}], rsp",
    "sti",
    "hlt",
    // Woken without the interrupt being taken: back to the caller as it is.
    "cli",
    "ret",
    ".global idle_com1_irq",
    "idle_com1_irq:",
    "mov rsp, [rip + {saved}]",
    "mov al, {eoi}",
    "out {pic1}, al",
    "ret",
    saved = sym IDLE_SAVED_RSP,
    eoi = const PIC_EOI,
    pic1 = const PIC1_CMD,
);

#[cfg(not(test))]
unsafe extern "C" {
    /// Halts with interrupts enabled until an interrupt arrives; returns with them disabled.
    /// Clobbers only caller-saved registers (rax).
    fn idle_halt();
    fn idle_com1_irq();
}

/// Programs the PIC (only IRQ 4 unmasked), the IDT and the UART's receive interrupt.
#[cfg(not(test))]
pub fn enable() {
    // ICW1 (edge, cascade, ICW4), ICW2 (vector base), ICW3 (slave on IRQ 2), ICW4 (8086).
    outb(PIC1_CMD, 0x11);
    outb(PIC2_CMD, 0x11);
    outb(PIC1_DATA, PIC1_VECTOR_BASE);
    outb(PIC2_DATA, PIC2_VECTOR_BASE);
    outb(PIC1_DATA, 0x04);
    outb(PIC2_DATA, 0x02);
    outb(PIC1_DATA, 0x01);
    outb(PIC2_DATA, 0x01);
    outb(PIC1_DATA, !(1u8 << COM1_IRQ));
    outb(PIC2_DATA, 0xff);

    let selector: u16;
    // SAFETY: reads the code segment selector; no memory or flags touched.
    unsafe { asm!("mov {0:x}, cs", out(reg) selector, options(nomem, nostack, preserves_flags)) };
    let idt = &raw mut IDT;
    // SAFETY: only the BSP runs this, once per `idle` command, with interrupts disabled, so
    // nothing reads the IDT while it is written.
    unsafe {
        if let Some(gate) = (*idt).0.get_mut(COM1_VECTOR) {
            *gate = Gate::interrupt(idle_com1_irq as *const () as u64, selector);
        }
    }
    #[repr(C, packed)]
    struct Pointer {
        limit: u16,
        base: u64,
    }
    let pointer = Pointer {
        limit: (core::mem::size_of::<Idt>() - 1) as u16,
        base: idt as u64,
    };
    // SAFETY: the IDT lives in a static for the guest's lifetime; interrupts stay disabled
    // except inside `idle_halt`, whose only unmasked source has a gate above.
    unsafe { asm!("lidt [{0}]", in(reg) &pointer, options(readonly, nostack, preserves_flags)) };

    outb(COM1_MCR, MCR_DTR_RTS_OUT2);
    outb(COM1_IER, IER_RECEIVED_DATA);
}

/// Halts until serial input (or any unmasked interrupt) arrives.
#[cfg(not(test))]
pub fn wait() {
    // SAFETY: `enable` installed the gate for the only unmasked IRQ; idle_halt keeps the
    // ABI of an extern "C" function (it returns to its caller with the caller's stack).
    unsafe { idle_halt() };
}

/// Host unit-test builds have no PIC, IDT or `hlt`.
#[cfg(test)]
pub fn enable() {}

#[cfg(test)]
pub fn wait() {}
