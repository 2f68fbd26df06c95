//! COM1: a 16550 UART (vm-superio) whose output goes to stdout or a file (capped in size) and
//! whose input comes from the VMM's stdin; its snapshot state (registers, FIFO, idle-poll
//! count).

use std::fs::File;
use std::io::{self, Write};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use snapshot::Persist;
use vm_superio::serial::{SerialEvents, SerialState};
use vm_superio::Serial;

use super::EventTrigger;
use crate::vstate::bus::BusDevice;

/// Where guest console output goes. The vCPU thread only appends to a bounded buffer; a
/// writer thread writes it out, so a host that stops reading stdout stalls neither the guest
/// nor the event loop. Bytes that do not fit are dropped and counted. The buffer is handed
/// to the writer at each newline, when it holds [`FLUSH_THRESHOLD`] bytes, and by the VMM's
/// event loop shortly after the last byte.
///
/// A console file stops growing at its cap: the writer writes up to the cap less
/// [`CAP_NOTE_ROOM`], then one line saying the console is capped; later bytes are dropped
/// and counted ([`ConsoleOut::capped_bytes`]), and the count is the file's last line when
/// the console closes. The file never grows past the cap.
pub struct ConsoleOut {
    shared: Arc<ConsoleShared>,
    writer: Option<std::thread::JoinHandle<()>>,
}

struct ConsoleShared {
    state: Mutex<ConsoleState>,
    changed: Condvar,
}

#[derive(Default)]
struct ConsoleState {
    /// Bytes for the writer.
    buffer: Vec<u8>,
    /// How many leading bytes of `buffer` the writer may take now.
    handed: usize,
    /// Bytes the writer is writing.
    in_flight: usize,
    dropped: u64,
    /// Of `dropped`, how many the log has reported.
    reported: u64,
    broken: bool,
    closing: bool,
    /// The file reached its cap: output is dropped at once.
    capped: bool,
    /// Bytes dropped because the file reached its cap.
    capped_bytes: u64,
}

/// A console file's cap and how much of it is used.
struct FileCap {
    written: u64,
    max: u64,
}

/// Room kept below a file's cap for the lines that say it is capped and what was dropped.
pub const CAP_NOTE_ROOM: u64 = 256;

enum Sink {
    Stdout(io::Stdout),
    File(File),
}

impl Sink {
    fn write_all(&mut self, bytes: &[u8]) -> io::Result<()> {
        match self {
            Sink::Stdout(out) => {
                let mut out = out.lock();
                out.write_all(bytes).and_then(|()| out.flush())
            }
            Sink::File(file) => file.write_all(bytes),
        }
    }
}

const FLUSH_THRESHOLD: usize = 4096;
/// Most console bytes held for a host that does not read them.
pub const CONSOLE_BUFFER_LIMIT: usize = 1 << 20;
/// How long dropping the console waits for the writer to write what is buffered.
const DRAIN_ON_DROP: Duration = Duration::from_secs(2);

fn lock_state(shared: &ConsoleShared) -> std::sync::MutexGuard<'_, ConsoleState> {
    shared.state.lock().unwrap_or_else(|e| e.into_inner())
}

impl ConsoleOut {
    /// Console output to the VMM's stdout.
    pub fn stdout() -> Self {
        Self::with_sink(Sink::Stdout(io::stdout()), None)
    }

    /// Console output appended to `file`, uncapped.
    pub fn file(file: File) -> Self {
        Self::with_sink(Sink::File(file), None)
    }

    /// Console output appended to `file`, which holds `size` bytes already and must not grow
    /// past `max_bytes`.
    pub fn capped_file(file: File, size: u64, max_bytes: u64) -> Self {
        let cap = FileCap {
            written: size,
            max: max_bytes,
        };
        Self::with_sink(Sink::File(file), Some(cap))
    }

    fn with_sink(sink: Sink, cap: Option<FileCap>) -> Self {
        let shared = Arc::new(ConsoleShared {
            state: Mutex::new(ConsoleState::default()),
            changed: Condvar::new(),
        });
        let theirs = Arc::clone(&shared);
        let writer = crate::seccomp::spawn_filtered(
            "console".into(),
            crate::seccomp::ThreadKind::Vmm,
            move || write_out(&theirs, sink, cap),
        );
        let writer = match writer {
            Ok(handle) => Some(handle),
            Err(e) => {
                log::warn!("cannot start the console writer: {e}; console output is dropped");
                lock_state(&shared).broken = true;
                None
            }
        };
        Self { shared, writer }
    }

    /// Whether bytes wait to be handed to the writer.
    pub fn has_pending(&self) -> bool {
        let state = lock_state(&self.shared);
        state.buffer.len() > state.handed
    }

    /// Console bytes dropped because the buffer was full (the host was not reading).
    pub fn dropped_bytes(&self) -> u64 {
        lock_state(&self.shared).dropped
    }

    /// Console bytes dropped because the console file reached its cap.
    pub fn capped_bytes(&self) -> u64 {
        lock_state(&self.shared).capped_bytes
    }

    /// Hands the buffered bytes to the writer thread; never blocks on the sink. After the
    /// first write failure (say, a closed pipe) console output is dropped, once logged.
    pub fn write_pending(&mut self) -> io::Result<()> {
        let mut state = lock_state(&self.shared);
        state.handed = state.buffer.len();
        drop(state);
        self.shared.changed.notify_all();
        Ok(())
    }

    /// Waits up to `timeout` until the writer wrote everything handed to it; false if it
    /// did not.
    pub fn drain(&mut self, timeout: Duration) -> bool {
        let _ = self.write_pending();
        let state = lock_state(&self.shared);
        let (state, _) = self
            .shared
            .changed
            .wait_timeout_while(state, timeout, |s| {
                !s.broken && (s.handed > 0 || s.in_flight > 0)
            })
            .unwrap_or_else(|e| e.into_inner());
        state.broken || (state.handed == 0 && state.in_flight == 0)
    }
}

/// The writer thread: writes what is handed to it until the console closes.
fn write_out(shared: &ConsoleShared, mut sink: Sink, mut cap: Option<FileCap>) {
    loop {
        let mut state = lock_state(shared);
        while state.handed == 0 && !state.closing {
            state = shared
                .changed
                .wait(state)
                .unwrap_or_else(|e| e.into_inner());
        }
        if state.handed == 0 {
            let dropped = state.capped_bytes;
            drop(state);
            if let Some(cap) = cap.as_mut().filter(|_| dropped > 0) {
                let note = format!("[rollbox-vmm: {dropped} console bytes dropped past the cap]\n");
                let _ = write_within(&mut sink, cap, note.as_bytes());
            }
            return;
        }
        let handed = state.handed;
        let bytes: Vec<u8> = state.buffer.drain(..handed).collect();
        state.handed = 0;
        state.in_flight = bytes.len();
        let newly_dropped = state.dropped - state.reported;
        state.reported = state.dropped;
        let total = state.dropped;
        drop(state);
        if newly_dropped > 0 {
            log::warn!(
                "console: the host did not read console output; dropped {newly_dropped} bytes ({total} in all)"
            );
        }
        let (result, over) = match cap.as_mut() {
            None => (sink.write_all(&bytes), 0),
            Some(cap) => write_capped(&mut sink, cap, &bytes),
        };
        let mut state = lock_state(shared);
        state.in_flight = 0;
        if over > 0 {
            state.capped_bytes += over;
            if !state.capped {
                state.capped = true;
                log::warn!(
                    "console: the console file reached its cap of {} bytes; later output is dropped",
                    cap.as_ref().map_or(0, |c| c.max)
                );
            }
        }
        if let Err(e) = result {
            state.broken = true;
            state.buffer.clear();
            drop(state);
            shared.changed.notify_all();
            log::warn!("console output stopped: {e}");
            return;
        }
        drop(state);
        shared.changed.notify_all();
    }
}

/// Writes what fits of `bytes` below the cap's note room; at the first cut, the line that
/// says the console is capped. Returns the write's result and the bytes dropped.
fn write_capped(sink: &mut Sink, cap: &mut FileCap, bytes: &[u8]) -> (io::Result<()>, u64) {
    let room = cap
        .max
        .saturating_sub(CAP_NOTE_ROOM)
        .saturating_sub(cap.written);
    let fits = usize::try_from(room).unwrap_or(usize::MAX).min(bytes.len());
    let (now, over) = bytes.split_at(fits);
    if let Err(e) = write_within(sink, cap, now) {
        return (Err(e), 0);
    }
    if over.is_empty() {
        return (Ok(()), 0);
    }
    // Only the first cut finds the content full but the note room whole.
    if cap.written + CAP_NOTE_ROOM <= cap.max {
        let note = format!(
            "\n[rollbox-vmm: console capped at {} bytes; later output is dropped]\n",
            cap.max
        );
        if let Err(e) = write_within(sink, cap, note.as_bytes()) {
            return (Err(e), over.len() as u64);
        }
    }
    (Ok(()), over.len() as u64)
}

/// Writes `bytes` if they fit under the cap (else nothing), counting them.
fn write_within(sink: &mut Sink, cap: &mut FileCap, bytes: &[u8]) -> io::Result<()> {
    let len = bytes.len() as u64;
    if cap.written.saturating_add(len) > cap.max {
        return Ok(());
    }
    sink.write_all(bytes)?;
    cap.written += len;
    Ok(())
}

impl Write for ConsoleOut {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut state = lock_state(&self.shared);
        if state.broken {
            return Ok(buf.len());
        }
        if state.capped {
            state.capped_bytes += buf.len() as u64;
            return Ok(buf.len());
        }
        let room = CONSOLE_BUFFER_LIMIT.saturating_sub(state.buffer.len() + state.in_flight);
        let taken = buf.len().min(room);
        state.buffer.extend_from_slice(&buf[..taken]);
        state.dropped += (buf.len() - taken) as u64;
        if buf[..taken].contains(&b'\n') || state.buffer.len() - state.handed >= FLUSH_THRESHOLD {
            state.handed = state.buffer.len();
            drop(state);
            self.shared.changed.notify_all();
        }
        Ok(buf.len())
    }

    /// A no-op: the UART flushes after every byte, and batching is the point of the buffer.
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for ConsoleOut {
    /// Lets the writer finish what is buffered, for at most [`DRAIN_ON_DROP`].
    fn drop(&mut self) {
        let drained = self.drain(DRAIN_ON_DROP);
        lock_state(&self.shared).closing = true;
        self.shared.changed.notify_all();
        if let Some(writer) = self.writer.take() {
            if drained {
                let _ = writer.join();
            }
        }
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
        state: &SerialPersistState,
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
    pub fn uart_state(&self) -> SerialState {
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

// ---- snapshot state ----

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

#[cfg(test)]
mod tests {
    use super::*;
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

    #[test]
    fn a_host_that_does_not_read_stalls_nothing_and_drops_with_a_count() {
        let (reader, writer) = std::os::unix::net::UnixStream::pair().expect("pair");
        let mut out = ConsoleOut::file(File::from(std::os::fd::OwnedFd::from(writer)));
        let line = [b'x'; 1023];
        let started = std::time::Instant::now();
        // Far more than the socket buffer and the console buffer together.
        for _ in 0..(4 * CONSOLE_BUFFER_LIMIT / 1024) {
            out.write_all(&line).expect("write");
            out.write_all(b"\n").expect("write");
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the writer of console bytes blocked"
        );
        assert!(out.dropped_bytes() > 0, "nothing was dropped");
        assert!(
            !out.drain(Duration::from_millis(50)),
            "nobody reads: cannot drain"
        );
        // Once the host reads again, what was buffered arrives.
        let mut reader = reader;
        reader
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let mut got = vec![0u8; 4096];
        assert!(io::Read::read(&mut reader, &mut got).expect("read") > 0);
        drop(reader);
        drop(out);
    }

    #[test]
    fn a_flooded_console_file_stops_at_its_cap_and_reports_the_drop() {
        let file = tempfile::NamedTempFile::new().expect("file");
        std::fs::write(file.path(), b"from before a restore\n").expect("write");
        let max = 4096u64;
        let append = || {
            std::fs::OpenOptions::new()
                .append(true)
                .open(file.path())
                .expect("open")
        };
        let mut out = ConsoleOut::capped_file(append(), 22, max);
        let line = [b'x'; 99];
        // 1 MiB of flood, far past the cap.
        for _ in 0..(1 << 20) / 100 {
            out.write_all(&line).expect("write");
            out.write_all(b"\n").expect("write");
        }
        assert!(out.drain(Duration::from_secs(5)), "the writer keeps up");
        let size = std::fs::metadata(file.path()).expect("stat").len();
        assert!(size <= max, "the file grew past its cap: {size}");
        assert!(
            size >= max - CAP_NOTE_ROOM,
            "the file holds output up to the cap: {size}"
        );
        let dropped = out.capped_bytes();
        assert!(dropped >= (1 << 20) - max, "{dropped}");
        drop(out);
        let text = std::fs::read_to_string(file.path()).expect("read");
        assert!(text.len() as u64 <= max, "{}", text.len());
        assert!(text.starts_with("from before a restore\nxxx"), "{text}");
        assert!(
            text.contains(
                "\n[rollbox-vmm: console capped at 4096 bytes; later output is dropped]\n"
            ),
            "{text}"
        );
        assert!(
            text.ends_with(&format!(
                "[rollbox-vmm: {dropped} console bytes dropped past the cap]\n"
            )),
            "{text}"
        );
        // A file already at its cap gets nothing more.
        let full = std::fs::metadata(file.path()).expect("stat").len();
        let mut out = ConsoleOut::capped_file(append(), full, full);
        out.write_all(b"more\n").expect("write");
        drop(out);
        assert_eq!(std::fs::metadata(file.path()).expect("stat").len(), full);
    }

    #[test]
    fn buffered_output_is_written_when_the_console_closes() {
        let file = tempfile::NamedTempFile::new().expect("file");
        let mut out = ConsoleOut::file(file.reopen().expect("reopen"));
        out.write_all(b"no newline yet").expect("write");
        assert!(out.has_pending());
        drop(out);
        let text = std::fs::read_to_string(file.path()).expect("read");
        assert_eq!(text, "no newline yet");
    }
}
