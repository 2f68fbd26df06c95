//! Interrupts for a guest that cannot `iretq`: the 8259 PIC pair, an IDT for its 16 vectors,
//! the PIT as a one-shot bound on one halt, and `halt`, the `sti; hlt` that idle mode
//! (idle.rs) and the virtio-fs driver (fs.rs) wait in.
//!
//! KVM's emulator has no protected-mode IRET, so a handler never returns to the interrupted
//! code: interrupts are only ever enabled around the one `hlt` in `irq_halt`, and each handler
//! restores the stack pointer saved there, sends the PIC its EOI and returns to `irq_halt`'s
//! caller with interrupts off (interrupt gates clear IF). Callers look again for what they
//! wait for after every return; they do not learn which line fired.
//!
//! The lines are edge-triggered: KVM's irqfds and the PIT pulse them, and the PIC latches a
//! pulse in its IRR while interrupts are off. A pulse between a caller's last look and
//! `sti; hlt` therefore ends the halt at once (`sti`'s one-instruction shadow covers `hlt`).

#[cfg(not(test))]
use core::arch::{asm, global_asm};
#[cfg(not(test))]
use core::sync::atomic::{AtomicBool, Ordering};

#[cfg(not(test))]
use crate::io::{inb, outb, pause, Deadline};

const PIC1_CMD: u16 = 0x20;
const PIC1_DATA: u16 = 0x21;
const PIC2_CMD: u16 = 0xa0;
const PIC2_DATA: u16 = 0xa1;
/// The PICs' edge/level control registers (ELCR): 0 is edge for every line.
const PIC1_ELCR: u16 = 0x4d0;
const PIC2_ELCR: u16 = 0x4d1;
const PIC_EOI: u8 = 0x20;
/// OCW3: reads of the command port return the IRR (requests latched, not yet taken).
const PIC_READ_IRR: u8 = 0x0a;
/// Vector of PIC1's line 0; PIC2's lines follow at `PIC2_VECTOR_BASE`.
const PIC1_VECTOR_BASE: u8 = 0x20;
const PIC2_VECTOR_BASE: u8 = 0x28;
/// PIC1's input from PIC2.
const CASCADE: u8 = 2;
const PIT_CHANNEL0: u16 = 0x40;
const PIT_COMMAND: u16 = 0x43;
/// Channel 0, high count byte only, mode 0 (one pulse at terminal count), binary: each write
/// of the high byte to channel 0 (re)starts one count.
const PIT_ONE_SHOT_HIGH_BYTE: u8 = 0x20;
/// The PIT's input clock.
#[cfg(test)]
const PIT_HZ: u64 = 1_193_182;
/// High count byte of the bound on one halt: 0xff00 ticks, about 55 ms.
const HALT_BOUND: u8 = 0xff;
/// High count byte of the timer probe: 0x100 ticks, about 0.2 ms.
const PROBE_COUNT: u8 = 0x01;
/// How long a probe waits for a line's pulse.
#[cfg(not(test))]
const PROBE_MS: u64 = 50;
/// Present, DPL 0, 64-bit interrupt gate.
const GATE_INTERRUPT: u8 = 0x8e;
const IDT_ENTRIES: usize = PIC2_VECTOR_BASE as usize + 8;

/// One input of the PIC pair: 0..15, not the cascade.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Line(u8);

impl Line {
    /// The PIT's channel 0.
    pub const TIMER: Line = Line(0);
    pub const COM1: Line = Line(4);

    /// The PIC input of GSI `irq`. KVM's in-kernel irqchip routes GSIs 0..15 to the PIC pair
    /// (and to the IOAPIC); `None` for GSI 2 (the cascade) and from 16 on (IOAPIC only).
    pub fn of(irq: u64) -> Option<Line> {
        match u8::try_from(irq) {
            Ok(n) if n < 16 && n != CASCADE => Some(Line(n)),
            _ => None,
        }
    }

    /// The masks (PIC1, PIC2) with this line unmasked, and the cascade for a line of PIC2.
    fn unmasked(self, [pic1, pic2]: [u8; 2]) -> [u8; 2] {
        if self.0 < 8 {
            [pic1 & !(1 << self.0), pic2]
        } else {
            [pic1 & !(1 << CASCADE), pic2 & !(1 << (self.0 - 8))]
        }
    }

    /// The command port whose IRR holds this line, and the line's bit there.
    fn irr_bit(self) -> (u16, u8) {
        if self.0 < 8 {
            (PIC1_CMD, 1 << self.0)
        } else {
            (PIC2_CMD, 1 << (self.0 - 8))
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
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
/// The stack pointer `irq_halt` saved before `hlt`; the handlers restore it.
#[cfg_attr(not(test), no_mangle)]
static mut IRQ_SAVED_RSP: u64 = 0;
/// Set once `init` programmed the PICs, the PIT's mode and the IDT (kept across snapshots,
/// like the PIC's and PIT's own state, which the VMM restores).
#[cfg(not(test))]
static READY: AtomicBool = AtomicBool::new(false);

#[cfg(not(test))]
global_asm!(
    ".section .text.irq, \"ax\"",
    ".global irq_halt",
    "irq_halt:",
    "mov [rip + {saved}], rsp",
    "sti",
    "hlt",
    // Woken without an interrupt being taken: back to the caller as it is.
    "cli",
    "ret",
    ".global irq_pic1",
    "irq_pic1:",
    "mov rsp, [rip + {saved}]",
    "mov al, {eoi}",
    "out {pic1}, al",
    "ret",
    ".global irq_pic2",
    "irq_pic2:",
    "mov rsp, [rip + {saved}]",
    "mov al, {eoi}",
    "out {pic2}, al",
    "out {pic1}, al",
    "ret",
    saved = sym IRQ_SAVED_RSP,
    eoi = const PIC_EOI,
    pic1 = const PIC1_CMD,
    pic2 = const PIC2_CMD,
);

#[cfg(not(test))]
unsafe extern "C" {
    /// Halts with interrupts enabled until an interrupt arrives; returns with them disabled.
    /// Clobbers only caller-saved registers (rax).
    fn irq_halt();
    /// The handler of PIC1's vectors: EOI to PIC1.
    fn irq_pic1();
    /// The handler of PIC2's vectors: EOI to PIC2, then to PIC1 (the cascade).
    fn irq_pic2();
}

/// Programs the PICs (every line masked, edge-triggered, vectors 0x20..0x2f), the PIT's
/// channel 0 as a one-shot and the IDT, once; later calls do nothing.
#[cfg(not(test))]
pub fn init() {
    if READY.load(Ordering::Relaxed) {
        return;
    }
    // ICW1 (edge, cascade, ICW4), ICW2 (vector base), ICW3 (slave on line 2), ICW4 (8086).
    outb(PIC1_CMD, 0x11);
    outb(PIC2_CMD, 0x11);
    outb(PIC1_DATA, PIC1_VECTOR_BASE);
    outb(PIC2_DATA, PIC2_VECTOR_BASE);
    outb(PIC1_DATA, 1 << CASCADE);
    outb(PIC2_DATA, CASCADE);
    outb(PIC1_DATA, 0x01);
    outb(PIC2_DATA, 0x01);
    outb(PIC1_DATA, 0xff);
    outb(PIC2_DATA, 0xff);
    outb(PIC1_ELCR, 0);
    outb(PIC2_ELCR, 0);
    outb(PIC1_CMD, PIC_READ_IRR);
    outb(PIC2_CMD, PIC_READ_IRR);
    outb(PIT_COMMAND, PIT_ONE_SHOT_HIGH_BYTE);

    let selector: u16;
    // SAFETY: reads the code segment selector; no memory or flags touched.
    unsafe { asm!("mov {0:x}, cs", out(reg) selector, options(nomem, nostack, preserves_flags)) };
    let idt = &raw mut IDT;
    // SAFETY: only the BSP runs this, once, with interrupts disabled, so nothing reads the
    // IDT while it is written.
    unsafe {
        for (vector, gate) in (*idt).0.iter_mut().enumerate() {
            let handler = if vector >= PIC2_VECTOR_BASE as usize {
                irq_pic2 as *const ()
            } else if vector >= PIC1_VECTOR_BASE as usize {
                irq_pic1 as *const ()
            } else {
                continue;
            };
            *gate = Gate::interrupt(handler as u64, selector);
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
    // except inside `irq_halt`, and every vector the PICs can send has a gate above.
    unsafe { asm!("lidt [{0}]", in(reg) &pointer, options(readonly, nostack, preserves_flags)) };
    READY.store(true, Ordering::Relaxed);
}

/// Lets `line` interrupt a halt (after `init`).
#[cfg(not(test))]
pub fn unmask(line: Line) {
    let [pic1, pic2] = line.unmasked([inb(PIC1_DATA), inb(PIC2_DATA)]);
    outb(PIC1_DATA, pic1);
    outb(PIC2_DATA, pic2);
}

/// Whether `line` pulsed since its last interrupt was taken (after `init`; masked or not).
#[cfg(not(test))]
fn latched(line: Line) -> bool {
    let (port, bit) = line.irr_bit();
    inb(port) & bit != 0
}

/// Whether `line` is latched within `PROBE_MS` (an irqfd's pulse reaches the PIC a little
/// after the device's memory writes).
#[cfg(not(test))]
pub fn latches(line: Line, ticks_per_ms: u64) -> bool {
    let deadline = Deadline::after_ms(ticks_per_ms, PROBE_MS);
    while !latched(line) {
        if deadline.passed() {
            return false;
        }
        pause();
    }
    true
}

/// Whether the PIT pulses its line: starts a short count and watches the IRR.
#[cfg(not(test))]
pub fn timer_works(ticks_per_ms: u64) -> bool {
    outb(PIT_CHANNEL0, PROBE_COUNT);
    latches(Line::TIMER, ticks_per_ms)
}

/// Halts until an unmasked line interrupts.
#[cfg(not(test))]
pub fn halt() {
    // SAFETY: `init` installed gates for every PIC vector; irq_halt keeps the ABI of an
    // extern "C" function (it returns to its caller with the caller's stack).
    unsafe { irq_halt() };
}

/// Halts until an unmasked line interrupts, for at most about 55 ms: the PIT's one-shot
/// (its line unmasked by the caller) ends the halt if nothing else does.
#[cfg(not(test))]
pub fn halt_bounded() {
    outb(PIT_CHANNEL0, HALT_BOUND);
    halt();
}

/// Host unit-test builds have no PIC, PIT, IDT or `hlt`.
#[cfg(test)]
pub fn init() {}

#[cfg(test)]
pub fn unmask(_line: Line) {}

#[cfg(test)]
pub fn latches(_line: Line, _ticks_per_ms: u64) -> bool {
    false
}

#[cfg(test)]
pub fn timer_works(_ticks_per_ms: u64) -> bool {
    false
}

#[cfg(test)]
pub fn halt() {}

#[cfg(test)]
pub fn halt_bounded() {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_pic_lines_other_than_the_cascade_are_lines() {
        assert_eq!(Line::of(0), Some(Line::TIMER));
        assert_eq!(Line::of(5), Some(Line(5)));
        assert_eq!(Line::of(15), Some(Line(15)));
        assert_eq!(Line::of(2), None);
        assert_eq!(Line::of(16), None);
        assert_eq!(Line::of(22), None);
        assert_eq!(Line::of(u64::MAX), None);
    }

    #[test]
    fn unmasking_a_pic2_line_opens_the_cascade_too() {
        assert_eq!(Line::COM1.unmasked([0xff, 0xff]), [0xef, 0xff]);
        assert_eq!(
            Line(5).unmasked(Line::TIMER.unmasked([0xff, 0xff])),
            [0xde, 0xff]
        );
        assert_eq!(Line(9).unmasked([0xff, 0xff]), [0xfb, 0xfd]);
        assert_eq!(Line(15).unmasked([0x00, 0xff]), [0x00, 0x7f]);
    }

    #[test]
    fn irr_bits_follow_the_pic_of_the_line() {
        assert_eq!(Line::TIMER.irr_bit(), (PIC1_CMD, 0x01));
        assert_eq!(Line(7).irr_bit(), (PIC1_CMD, 0x80));
        assert_eq!(Line(8).irr_bit(), (PIC2_CMD, 0x01));
        assert_eq!(Line(12).irr_bit(), (PIC2_CMD, 0x10));
    }

    #[test]
    fn gates_split_the_handler_address() {
        let gate = Gate::interrupt(0x1234_5678_9abc_def0, 0x10);
        assert_eq!(gate.offset_low, 0xdef0);
        assert_eq!(gate.offset_mid, 0x9abc);
        assert_eq!(gate.offset_high, 0x1234_5678);
        assert_eq!(
            (gate.selector, gate.kind, gate.ist),
            (0x10, GATE_INTERRUPT, 0)
        );
        assert_eq!(core::mem::size_of::<Gate>(), 16);
        assert_eq!(core::mem::size_of::<Idt>(), 16 * 0x30);
    }

    #[test]
    fn a_bounded_halt_lasts_at_most_about_55_ms_and_the_probe_far_less() {
        let ms = |high: u8| (u64::from(high) << 8) * 1000 / PIT_HZ;
        assert_eq!(ms(HALT_BOUND), 54);
        assert_eq!(ms(PROBE_COUNT), 0);
    }
}
