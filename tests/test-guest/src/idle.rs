//! Idle mode (`idle` command): between serial commands the guest halts the way Linux does,
//! instead of busy-polling, and the UART's receive interrupt (COM1, line 4 of the PIC; irq.rs
//! says how interrupts are taken) wakes it.
//! Vsock is not polled while idle: wake-ups come from serial input (or, once, from the timer a
//! virtio-fs wait left running).

use crate::io::outb;
use crate::irq::{self, Line};

const COM1_IER: u16 = 0x3f9;
const COM1_MCR: u16 = 0x3fc;
const IER_RECEIVED_DATA: u8 = 0x01;
/// DTR, RTS and OUT2 (OUT2 gates the IRQ line on a real 16550).
const MCR_DTR_RTS_OUT2: u8 = 0x0b;

/// Sets up interrupts (once), unmasks COM1's line and enables the UART's receive interrupt.
pub fn enable() {
    irq::init();
    irq::unmask(Line::COM1);
    outb(COM1_MCR, MCR_DTR_RTS_OUT2);
    outb(COM1_IER, IER_RECEIVED_DATA);
}

/// Halts until serial input (or another unmasked line) interrupts.
pub fn wait() {
    irq::halt();
}
