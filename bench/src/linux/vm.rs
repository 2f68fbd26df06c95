//! A VMM process (rollbox-vmm or QEMU) with its console read and stamped as it arrives, its
//! stderr kept, waits for console lines and for the agent's `hello`, and a stop that always
//! ends it.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::time::{Duration, Instant};

use super::agent::{clean_line, hello_once, AgentAddr, Attempt, HelloTimes, ATTEMPT_TIMEOUT};
use super::error::LinuxBenchError;
use super::figures::ms;
use super::signals::INTERRUPTED;

/// SIGTERM, then SIGKILL after this.
const STOP_GRACE: Duration = Duration::from_secs(5);
/// A long wait says so this often (on stderr), so a stuck run shows where it stands.
const NOTE_EVERY: Duration = Duration::from_secs(30);
/// Pause between failed `hello` attempts.
const RETRY: Duration = Duration::from_millis(2);

enum ConsoleMsg {
    FirstByte(Instant),
    Line(Instant, String),
}

/// A VMM process with its console (stdout) read as it arrives. Stopped when dropped.
pub(crate) struct VmProcess {
    label: String,
    pub(crate) child: Child,
    pub(crate) started: Instant,
    console: Receiver<ConsoleMsg>,
    console_open: bool,
    first_byte: Option<Instant>,
    pub(super) lines: Vec<(Instant, String)>,
    stderr: Receiver<Vec<u8>>,
    stderr_text: Vec<u8>,
}

/// Reads the console pipe; each line is stamped with the arrival of its last chunk.
fn read_console(mut out: ChildStdout, tx: Sender<ConsoleMsg>) {
    let mut buf = [0u8; 4096];
    let mut partial = Vec::new();
    let mut first = true;
    loop {
        let n = match out.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let at = Instant::now();
        if first {
            first = false;
            if tx.send(ConsoleMsg::FirstByte(at)).is_err() {
                return;
            }
        }
        for &b in &buf[..n] {
            if b == b'\n' {
                let line = clean_line(&partial);
                partial.clear();
                if tx.send(ConsoleMsg::Line(at, line)).is_err() {
                    return;
                }
            } else {
                partial.push(b);
            }
        }
    }
    if !partial.is_empty() {
        let _ = tx.send(ConsoleMsg::Line(Instant::now(), clean_line(&partial)));
    }
}

fn tail_chars(text: &str, n: usize) -> String {
    let chars: Vec<char> = text.chars().collect();
    chars[chars.len().saturating_sub(n)..].iter().collect()
}

impl VmProcess {
    pub(crate) fn spawn(
        label: &str,
        program: &Path,
        args: &[String],
    ) -> Result<Self, LinuxBenchError> {
        let mut command = Command::new(program);
        command
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // SAFETY: runs in the child between fork and exec and calls only prctl, which is
        // async-signal-safe. The kernel then kills the VMM if this benchmark dies.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let started = Instant::now();
        let mut child = command.spawn().map_err(|source| LinuxBenchError::Spawn {
            program: program.to_path_buf(),
            source,
        })?;
        let (tx, console) = channel();
        if let Some(out) = child.stdout.take() {
            std::thread::spawn(move || read_console(out, tx));
        }
        let (err_tx, stderr) = channel();
        if let Some(mut pipe) = child.stderr.take() {
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = pipe.read(&mut buf) {
                    if n == 0 || err_tx.send(buf[..n].to_vec()).is_err() {
                        break;
                    }
                }
            });
        }
        Ok(Self {
            label: label.to_string(),
            child,
            started,
            console,
            console_open: true,
            first_byte: None,
            lines: Vec::new(),
            stderr,
            stderr_text: Vec::new(),
        })
    }

    fn take(&mut self, msg: ConsoleMsg) {
        match msg {
            ConsoleMsg::FirstByte(at) => self.first_byte = Some(at),
            ConsoleMsg::Line(at, line) => self.lines.push((at, line)),
        }
    }

    /// Takes what the console has sent so far, without waiting.
    pub(super) fn drain(&mut self) {
        loop {
            match self.console.try_recv() {
                Ok(msg) => self.take(msg),
                Err(TryRecvError::Empty) => return,
                Err(TryRecvError::Disconnected) => {
                    self.console_open = false;
                    return;
                }
            }
        }
    }

    fn stderr_tail(&mut self) -> String {
        while let Ok(chunk) = self.stderr.try_recv() {
            self.stderr_text.extend_from_slice(&chunk);
        }
        tail_chars(&String::from_utf8_lossy(&self.stderr_text), 800)
            .trim()
            .to_string()
    }

    fn console_tail(&self) -> String {
        let from = self.lines.len().saturating_sub(15);
        self.lines[from..]
            .iter()
            .map(|(_, l)| format!("  | {l}"))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// An error if the VMM has exited.
    pub(crate) fn check_running(&mut self, what: &str) -> Result<(), LinuxBenchError> {
        if INTERRUPTED.load(Ordering::SeqCst) {
            return Err(LinuxBenchError::Interrupted);
        }
        if let Ok(Some(status)) = self.child.try_wait() {
            // Give the pipe readers a moment to hand over the last output.
            std::thread::sleep(Duration::from_millis(100));
            self.drain();
            return Err(LinuxBenchError::Exited {
                vm: self.label.clone(),
                what: what.to_string(),
                status: status.to_string(),
                console: self.console_tail(),
                stderr: self.stderr_tail(),
            });
        }
        Ok(())
    }

    fn timeout(&mut self, what: &str, deadline: Instant) -> LinuxBenchError {
        self.drain();
        LinuxBenchError::Timeout {
            vm: self.label.clone(),
            what: what.to_string(),
            timeout: deadline.saturating_duration_since(self.started),
            console: self.console_tail(),
            stderr: self.stderr_tail(),
        }
    }

    /// Waits for the first console line containing `needle`; returns its arrival.
    pub(crate) fn wait_line(
        &mut self,
        what: &str,
        needle: &str,
        deadline: Instant,
    ) -> Result<Instant, LinuxBenchError> {
        let mut checked = 0;
        let mut next_note = Instant::now() + NOTE_EVERY;
        loop {
            if INTERRUPTED.load(Ordering::SeqCst) {
                return Err(LinuxBenchError::Interrupted);
            }
            self.note_waiting(what, &mut next_note);
            if let Some((at, _)) = self.lines[checked..]
                .iter()
                .find(|(_, l)| l.contains(needle))
            {
                return Ok(*at);
            }
            checked = self.lines.len();
            let now = Instant::now();
            if now >= deadline {
                return Err(self.timeout(what, deadline));
            }
            if !self.console_open {
                self.check_running(what)?;
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            let slice = deadline
                .saturating_duration_since(now)
                .min(Duration::from_millis(50));
            match self.console.recv_timeout(slice) {
                Ok(msg) => {
                    self.take(msg);
                    self.drain();
                }
                Err(RecvTimeoutError::Timeout) => self.check_running(what)?,
                Err(RecvTimeoutError::Disconnected) => self.console_open = false,
            }
        }
    }

    /// Retries `hello` until the agent answers; returns when the answer arrived.
    pub(crate) fn wait_hello(
        &mut self,
        addr: &AgentAddr,
        deadline: Instant,
    ) -> Result<HelloTimes, LinuxBenchError> {
        let mut first_connect = None;
        let mut next_note = Instant::now() + NOTE_EVERY;
        loop {
            self.note_waiting("the agent's hello answer", &mut next_note);
            self.check_running("the agent's hello answer")?;
            let left = deadline.saturating_duration_since(Instant::now());
            let mut attempt = Attempt::default();
            match hello_once(addr, ATTEMPT_TIMEOUT.min(left), &mut attempt) {
                Ok(()) => {
                    let answered = Instant::now();
                    let guest_connected = attempt.guest_connected.unwrap_or(answered);
                    return Ok(HelloTimes {
                        first_connect: first_connect
                            .or(attempt.connected)
                            .unwrap_or(guest_connected),
                        guest_connected,
                        answered,
                    });
                }
                Err(last) if Instant::now() >= deadline => {
                    return Err(self.timeout(
                        &format!("the agent's hello answer (last attempt: {last})"),
                        deadline,
                    ));
                }
                Err(_) => {
                    first_connect = first_connect.or(attempt.connected);
                    std::thread::sleep(RETRY);
                }
            }
        }
    }

    /// Says on stderr, every NOTE_EVERY, what this VMM is still waiting for.
    fn note_waiting(&self, what: &str, next: &mut Instant) {
        if Instant::now() >= *next {
            *next += NOTE_EVERY;
            eprintln!(
                "{}: still waiting for {what}, {:.0} s after its start",
                self.label,
                self.started.elapsed().as_secs_f64()
            );
        }
    }

    /// Console lines as (ms since process start, text).
    pub(super) fn transcript(&self) -> Vec<(f64, String)> {
        self.lines
            .iter()
            .map(|(at, l)| (ms(at.saturating_duration_since(self.started)), l.clone()))
            .collect()
    }

    /// SIGTERM (a clean exit: sockets removed, a recorded working set saved), then SIGKILL.
    pub(crate) fn stop(&mut self) {
        if !matches!(self.child.try_wait(), Ok(None)) {
            return;
        }
        if let Ok(pid) = i32::try_from(self.child.id()) {
            // SAFETY: signals our own child, which has not been reaped (try_wait said so).
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        if self.exited_within(STOP_GRACE) {
            return;
        }
        eprintln!(
            "{}: no exit {STOP_GRACE:?} after SIGTERM; killing it",
            self.label
        );
        let _ = self.child.kill();
        // Bounded: a thread stuck in the kernel (seen once with QEMU in the lab) never exits.
        if !self.exited_within(STOP_GRACE) {
            eprintln!(
                "{}: pid {} still there {STOP_GRACE:?} after SIGKILL; giving up on it",
                self.label,
                self.child.id()
            );
        }
    }

    /// Polls for the process's exit (reaping it) for at most `limit`.
    fn exited_within(&mut self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for VmProcess {
    fn drop(&mut self) {
        self.stop();
    }
}

impl VmProcess {
    /// Everything the VMM wrote on stderr, once it has exited.
    pub(super) fn stderr_tail_all(&mut self) -> String {
        // The reader thread ends when the pipe closes.
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            match self.stderr.recv_timeout(Duration::from_millis(50)) {
                Ok(chunk) => self.stderr_text.extend_from_slice(&chunk),
                Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) if Instant::now() > deadline => break,
                Err(RecvTimeoutError::Timeout) => {}
            }
        }
        String::from_utf8_lossy(&self.stderr_text).into_owned()
    }
}
