//! Snapshot state of the legacy devices.

use serde::{Deserialize, Serialize};
use vm_superio::serial::SerialState;

use super::i8042::I8042;
use super::serial::SerialDevice;

/// The 16550's registers and receive FIFO.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SerialPersistState {
    /// Divisor latch low.
    pub baud_divisor_low: u8,
    /// Divisor latch high.
    pub baud_divisor_high: u8,
    /// IER.
    pub interrupt_enable: u8,
    /// IIR.
    pub interrupt_identification: u8,
    /// LCR.
    pub line_control: u8,
    /// LSR.
    pub line_status: u8,
    /// MCR.
    pub modem_control: u8,
    /// MSR.
    pub modem_status: u8,
    /// Scratch.
    pub scratch: u8,
    /// Bytes the guest has not read yet.
    pub in_buffer: Vec<u8>,
}

impl From<SerialState> for SerialPersistState {
    fn from(s: SerialState) -> Self {
        Self {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        }
    }
}

impl From<&SerialPersistState> for SerialState {
    fn from(s: &SerialPersistState) -> Self {
        SerialState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer.clone(),
        }
    }
}

/// The i8042's registers and output buffer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct I8042PersistState {
    /// Controller command byte.
    pub control: u8,
    /// Status register (without the output-full bit).
    pub status: u8,
    /// Bytes waiting for the guest.
    pub output: Vec<u8>,
    /// A command waiting for its data byte.
    pub expecting: Option<u8>,
}

impl SerialDevice {
    /// Saves the UART.
    pub fn save(&self) -> SerialPersistState {
        self.uart_state().into()
    }
}

impl I8042 {
    /// Saves the controller.
    pub fn save(&self) -> I8042PersistState {
        self.state()
    }
}
