//! Snapshot state of the legacy devices.

use serde::{Deserialize, Serialize};
use vm_superio::serial::SerialState;

use snapshot::Persist;

use super::i8042::I8042;
use super::serial::{ConsoleOut, SerialDevice};
use super::EventTrigger;

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
    /// Empty line-status polls in a row: a guest that was idle-polling stays paced after a
    /// restore instead of spinning at full speed.
    #[serde(default)]
    pub empty_polls: u32,
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
            empty_polls: 0,
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

/// What a UART needs besides its saved state.
pub struct SerialArgs {
    /// Its interrupt line.
    pub irq: EventTrigger,
    /// Signalled when its receive FIFO empties.
    pub room: EventTrigger,
    /// Console output.
    pub out: ConsoleOut,
}

impl Persist for SerialDevice {
    type State = SerialPersistState;
    type ConstructorArgs = SerialArgs;
    type Error = String;

    fn save(&self) -> Result<SerialPersistState, String> {
        let mut state: SerialPersistState = self.uart_state().into();
        state.empty_polls = self.empty_polls();
        Ok(state)
    }

    fn restore(args: SerialArgs, state: &SerialPersistState) -> Result<Self, String> {
        SerialDevice::from_state(state, args.irq, args.room, args.out)
    }
}

impl Persist for I8042 {
    type State = I8042PersistState;
    /// The reset event and the keyboard interrupt.
    type ConstructorArgs = (EventTrigger, EventTrigger);
    type Error = std::convert::Infallible;

    fn save(&self) -> Result<I8042PersistState, Self::Error> {
        Ok(self.state())
    }

    fn restore(
        args: (EventTrigger, EventTrigger),
        state: &I8042PersistState,
    ) -> Result<Self, Self::Error> {
        let mut device = I8042::new(args.0, args.1);
        device.load_state(state);
        Ok(device)
    }
}
