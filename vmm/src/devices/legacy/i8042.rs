//! A minimal i8042 keyboard controller: CPU reset (command 0xfe) ends the VM, and
//! Ctrl-Alt-Del can be injected for Linux's keyboard driver; its snapshot state.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};
use snapshot::Persist;

use super::EventTrigger;
use crate::vstate::bus::BusDevice;
use vm_superio::Trigger;

const DATA_OFFSET: u64 = 0;
const COMMAND_OFFSET: u64 = 4;
const STATUS_OUTPUT_FULL: u8 = 1 << 0;
const STATUS_SYSTEM_FLAG: u8 = 1 << 2;
const STATUS_COMMAND: u8 = 1 << 3;
/// The keyboard is not inhibited by a keylock (Linux warns "Keylock active" without it).
const STATUS_NOT_INHIBITED: u8 = 1 << 4;
const CMD_READ_CONTROL: u8 = 0x20;
const CMD_WRITE_CONTROL: u8 = 0x60;
const CMD_SELF_TEST: u8 = 0xaa;
const CMD_KBD_TEST: u8 = 0xab;
const CMD_WRITE_AUX: u8 = 0xd4;
const CMD_RESET_CPU: u8 = 0xfe;
const SELF_TEST_OK: u8 = 0x55;
const KBD_ACK: u8 = 0xfa;
const CONTROL_KBD_INTERRUPT: u8 = 1 << 0;
const CONTROL_SYSTEM_FLAG: u8 = 1 << 2;
/// Ctrl, Alt, Del make codes in scan-code set 2.
const CTRL_ALT_DEL: [u8; 4] = [0x14, 0x11, 0xe0, 0x71];
const BUFFER_LIMIT: usize = 16;

/// The i8042 controller.
pub struct I8042 {
    reset: EventTrigger,
    kbd_irq: EventTrigger,
    output: VecDeque<u8>,
    control: u8,
    status: u8,
    expecting: Option<u8>,
}

impl I8042 {
    /// A controller that writes `reset` on CPU reset and raises `kbd_irq` for key events.
    pub fn new(reset: EventTrigger, kbd_irq: EventTrigger) -> Self {
        Self {
            reset,
            kbd_irq,
            output: VecDeque::new(),
            control: CONTROL_KBD_INTERRUPT | CONTROL_SYSTEM_FLAG,
            status: STATUS_SYSTEM_FLAG,
            expecting: None,
        }
    }

    fn push(&mut self, byte: u8) {
        if self.output.len() < BUFFER_LIMIT {
            self.output.push_back(byte);
        }
    }

    /// The controller's registers, for snapshots.
    pub fn state(&self) -> I8042PersistState {
        I8042PersistState {
            control: self.control,
            status: self.status,
            output: self.output.iter().copied().collect(),
            expecting: self.expecting,
        }
    }

    /// Restores registers saved by [`I8042::state`].
    pub fn load_state(&mut self, state: &I8042PersistState) {
        self.control = state.control;
        self.status = state.status;
        self.output = state.output.iter().copied().take(BUFFER_LIMIT).collect();
        self.expecting = state.expecting;
    }

    /// Queues Ctrl-Alt-Del and raises the keyboard interrupt.
    pub fn trigger_ctrl_alt_del(&mut self) -> std::io::Result<()> {
        for code in CTRL_ALT_DEL {
            self.push(code);
        }
        if self.control & CONTROL_KBD_INTERRUPT != 0 {
            self.kbd_irq.trigger()?;
        }
        Ok(())
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let value = match offset {
            DATA_OFFSET => self.output.pop_front().unwrap_or(0),
            COMMAND_OFFSET => {
                let full = if self.output.is_empty() {
                    0
                } else {
                    STATUS_OUTPUT_FULL
                };
                self.status | STATUS_NOT_INHIBITED | full
            }
            _ => 0,
        };
        data.fill(0);
        if let Some(first) = data.first_mut() {
            *first = value;
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let Some(&value) = data.first() else { return };
        match offset {
            COMMAND_OFFSET => {
                self.status |= STATUS_COMMAND;
                match value {
                    CMD_RESET_CPU => {
                        if let Err(e) = self.reset.trigger() {
                            log::error!("i8042: reset request lost: {e}");
                        }
                    }
                    CMD_READ_CONTROL => self.push(self.control),
                    CMD_WRITE_CONTROL | CMD_WRITE_AUX => self.expecting = Some(value),
                    CMD_SELF_TEST => self.push(SELF_TEST_OK),
                    CMD_KBD_TEST => self.push(0),
                    _ => {}
                }
            }
            DATA_OFFSET => {
                self.status &= !STATUS_COMMAND;
                match self.expecting.take() {
                    Some(CMD_WRITE_CONTROL) => self.control = value,
                    Some(_) => {}
                    None => self.push(KBD_ACK),
                }
            }
            _ => {}
        }
    }
}

// ---- snapshot state ----

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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

    fn device() -> (I8042, Arc<EventFd>, Arc<EventFd>) {
        let reset = Arc::new(EventFd::new(EFD_NONBLOCK).expect("eventfd"));
        let irq = Arc::new(EventFd::new(EFD_NONBLOCK).expect("eventfd"));
        (
            I8042::new(EventTrigger(reset.clone()), EventTrigger(irq.clone())),
            reset,
            irq,
        )
    }

    #[test]
    fn reset_command_signals() {
        let (mut dev, reset, _) = device();
        dev.write(COMMAND_OFFSET, &[CMD_RESET_CPU]);
        assert_eq!(reset.read().expect("reset signalled"), 1);
    }

    #[test]
    fn ctrl_alt_del_queues_scan_codes() {
        let (mut dev, _, irq) = device();
        dev.trigger_ctrl_alt_del().expect("cad");
        assert_eq!(irq.read().expect("irq"), 1);
        let mut got = Vec::new();
        let mut b = [0u8];
        loop {
            dev.read(COMMAND_OFFSET, &mut b);
            if b[0] & STATUS_OUTPUT_FULL == 0 {
                break;
            }
            dev.read(DATA_OFFSET, &mut b);
            got.push(b[0]);
        }
        assert_eq!(got, CTRL_ALT_DEL);
    }

    #[test]
    fn control_byte_round_trips() {
        let (mut dev, _, _) = device();
        dev.write(COMMAND_OFFSET, &[CMD_WRITE_CONTROL]);
        dev.write(DATA_OFFSET, &[0x45]);
        dev.write(COMMAND_OFFSET, &[CMD_READ_CONTROL]);
        let mut b = [0u8];
        dev.read(DATA_OFFSET, &mut b);
        assert_eq!(b[0], 0x45);
    }
}
