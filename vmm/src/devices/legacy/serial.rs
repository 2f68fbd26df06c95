//! COM1: a 16550 UART (vm-superio) whose output goes to stdout or a file and whose input
//! comes from the VMM's stdin.

use std::fs::File;
use std::io::{self, Write};

use vm_superio::serial::SerialEvents;
use vm_superio::Serial;

use super::EventTrigger;
use crate::devices::bus::BusDevice;

/// Where guest console output goes. Output is buffered and flushed at each newline, when the
/// buffer fills, and by the VMM's event loop shortly after the last byte.
pub struct ConsoleOut {
    sink: Sink,
    buffer: Vec<u8>,
    broken: bool,
}

enum Sink {
    Stdout(io::Stdout),
    File(File),
}

const FLUSH_THRESHOLD: usize = 4096;

impl ConsoleOut {
    /// Console output to the VMM's stdout.
    pub fn stdout() -> Self {
        Self {
            sink: Sink::Stdout(io::stdout()),
            buffer: Vec::with_capacity(FLUSH_THRESHOLD),
            broken: false,
        }
    }

    /// Console output appended to `file`.
    pub fn file(file: File) -> Self {
        Self {
            sink: Sink::File(file),
            buffer: Vec::with_capacity(FLUSH_THRESHOLD),
            broken: false,
        }
    }

    /// Whether bytes wait to be written.
    pub fn has_pending(&self) -> bool {
        !self.buffer.is_empty()
    }

    /// Writes the buffered bytes out. After the first failure (say, a closed pipe) console
    /// output is dropped, once logged, so the guest keeps running.
    pub fn write_pending(&mut self) -> io::Result<()> {
        if self.broken {
            self.buffer.clear();
        }
        if self.buffer.is_empty() {
            return Ok(());
        }
        let result = match &mut self.sink {
            Sink::Stdout(out) => {
                let mut out = out.lock();
                out.write_all(&self.buffer).and_then(|()| out.flush())
            }
            Sink::File(file) => file.write_all(&self.buffer),
        };
        self.buffer.clear();
        if let Err(e) = result {
            self.broken = true;
            log::warn!("console output stopped: {e}");
        }
        Ok(())
    }
}

impl Write for ConsoleOut {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.buffer.extend_from_slice(buf);
        if buf.contains(&b'\n') || self.buffer.len() >= FLUSH_THRESHOLD {
            self.write_pending()?;
        }
        Ok(buf.len())
    }

    /// A no-op: the UART flushes after every byte, and batching is the point of the buffer.
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Raised when the guest has drained the receive FIFO, so the VMM can feed more input.
pub struct InputRoom(pub EventTrigger);

impl SerialEvents for InputRoom {
    fn buffer_read(&self) {}
    fn out_byte(&self) {}
    fn tx_lost_byte(&self) {}
    fn in_buffer_empty(&self) {
        use vm_superio::Trigger;
        if let Err(e) = self.0.trigger() {
            log::warn!("serial: cannot signal input room: {e}");
        }
    }
}

/// The 16550 UART on the port-I/O bus.
pub struct SerialDevice {
    uart: Serial<EventTrigger, InputRoom, ConsoleOut>,
    empty_polls: u32,
}

const LSR_OFFSET: u64 = 5;
const LSR_DATA_READY: u8 = 1;
/// Empty line-status reads in a row before a polling guest is paced (about 20 ms of spinning).
const POLLS_BEFORE_PACING: u32 = 1000;
/// How long a paced empty read takes: a guest that busy-polls an idle console then uses a few
/// percent of a core instead of all of it, which matters with many VMs per host.
const PACED_POLL: std::time::Duration = std::time::Duration::from_micros(500);

impl SerialDevice {
    /// A UART raising `irq`, signalling `room` when its input FIFO empties, writing to `out`.
    pub fn new(irq: EventTrigger, room: EventTrigger, out: ConsoleOut) -> Self {
        Self {
            uart: Serial::with_events(irq, InputRoom(room), out),
            empty_polls: 0,
        }
    }

    /// A UART restored from a snapshot.
    pub fn from_state(
        state: &super::persist::SerialPersistState,
        irq: EventTrigger,
        room: EventTrigger,
        out: ConsoleOut,
    ) -> Result<Self, String> {
        Serial::from_state(&state.into(), irq, InputRoom(room), out)
            .map(|uart| Self {
                uart,
                empty_polls: state.empty_polls,
            })
            .map_err(|e| format!("serial state: {e:?}"))
    }

    /// Empty line-status polls in a row.
    pub fn empty_polls(&self) -> u32 {
        self.empty_polls
    }

    /// The UART's registers and FIFO.
    pub fn uart_state(&self) -> vm_superio::serial::SerialState {
        self.uart.state()
    }

    /// Queues as much of `input` as fits into the receive FIFO; returns how much was taken.
    pub fn enqueue_input(&mut self, input: &[u8]) -> usize {
        self.empty_polls = 0;
        let room = self.uart.fifo_capacity().min(input.len());
        if room == 0 {
            return 0;
        }
        match self.uart.enqueue_raw_bytes(&input[..room]) {
            Ok(n) => n,
            Err(e) => {
                log::warn!("serial: cannot queue console input: {e:?}");
                0
            }
        }
    }

    /// Writes buffered console output.
    pub fn flush_output(&mut self) {
        if let Err(e) = self.uart.writer_mut().write_pending() {
            log::warn!("serial: cannot write console output: {e}");
        }
    }

    /// Whether console output waits in the buffer.
    pub fn has_pending_output(&self) -> bool {
        self.uart.writer().has_pending()
    }
}

impl BusDevice for SerialDevice {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        let value = self.uart.read(offset as u8);
        if let Some(first) = data.first_mut() {
            *first = value;
        }
        if offset == LSR_OFFSET {
            if value & LSR_DATA_READY == 0 {
                self.empty_polls = self.empty_polls.saturating_add(1);
                if self.empty_polls > POLLS_BEFORE_PACING {
                    std::thread::sleep(PACED_POLL);
                }
            } else {
                self.empty_polls = 0;
            }
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        // A guest that writes is not idle: Linux's console reads the line status before every
        // byte it sends, and those reads must not be paced.
        self.empty_polls = 0;
        if let Some(&value) = data.first() {
            if let Err(e) = self.uart.write(offset as u8, value) {
                log::warn!("serial: write to register {offset}: {e:?}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

    fn serial() -> SerialDevice {
        let event = || EventTrigger(Arc::new(EventFd::new(EFD_NONBLOCK).expect("eventfd")));
        let out = tempfile::tempfile().expect("console file");
        SerialDevice::new(event(), event(), ConsoleOut::file(out))
    }

    #[test]
    fn a_guest_that_writes_between_status_reads_is_never_paced() {
        let mut dev = serial();
        let mut lsr = [0u8; 1];
        for _ in 0..(2 * POLLS_BEFORE_PACING) {
            dev.read(LSR_OFFSET, &mut lsr);
            dev.write(0, b"x");
        }
        assert!(dev.empty_polls() <= 1, "{}", dev.empty_polls());
    }

    #[test]
    fn a_guest_that_only_polls_an_idle_port_is_counted_for_pacing() {
        let mut dev = serial();
        let mut lsr = [0u8; 1];
        for _ in 0..POLLS_BEFORE_PACING {
            dev.read(LSR_OFFSET, &mut lsr);
        }
        assert_eq!(dev.empty_polls(), POLLS_BEFORE_PACING);
        assert_eq!(dev.enqueue_input(b"k"), 1);
        assert_eq!(dev.empty_polls(), 0, "input resets the count");
    }
}
