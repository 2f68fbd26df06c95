//! `rollbox-bench linux`: Linux guests on real KVM (the nested lab, `scripts/lab/bench-linux.sh`).
//!
//! 1. Boot of one vmlinux and one initramfs (busybox + the static agent) under rollbox-vmm and
//!    under QEMU's `-M microvm`, alternating round by round: from VMM process start to the first
//!    kernel console line, to `/init` running, and to the agent answering `hello`.
//! 2. Restore of a booted Linux guest (busybox rootfs, agent as init) until the agent answers,
//!    beside rollbox-vmm's own cold boot of the same VM.
//!
//! Console bytes are stamped as they arrive on the VMM's stdout pipe.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::time::{Duration, Instant};

use rollbox_agent_protocol::frame;
use rollbox_agent_protocol::{ClientFrame, ClientMessage, ServerFrame, ServerMessage};
use serde::Serialize;

use crate::stats::{summarize, Summary};

/// What the initramfs's `/init` prints first.
pub const INIT_MARKER: &str = "rollbox-bench: /init running";
/// The agent's log line once its vsock listener is bound (on the console: its stderr).
pub(crate) const AGENT_LISTENING: &str = "listening on vsock port";
pub(crate) const AGENT_PORT: u32 = rollbox_agent_protocol::DEFAULT_PORT;
/// rollbox-vmm's guest CID (its host side is a Unix socket, so any CID >= 3 does).
pub(crate) const ROLLBOX_CID: u32 = 3;
/// Pause between failed `hello` attempts.
const RETRY: Duration = Duration::from_millis(2);
/// One connection attempt (connect, handshake, hello) at most.
pub(crate) const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);
/// SIGTERM, then SIGKILL after this.
const STOP_GRACE: Duration = Duration::from_secs(5);
/// `SO_VM_SOCKETS_CONNECT_TIMEOUT` (linux/vm_sockets.h; level AF_VSOCK, a `struct timeval`).
const SO_VM_SOCKETS_CONNECT_TIMEOUT: libc::c_int = 6;
/// A long wait says so this often (on stderr), so a stuck run shows where it stands.
const NOTE_EVERY: Duration = Duration::from_secs(30);
/// Lines of the largest console gaps shown per VMM.
const GAPS_SHOWN: usize = 6;

/// Errors that stop the benchmark (never a slow figure).
#[derive(Debug, thiserror::Error)]
pub enum LinuxBenchError {
    #[error("{what} not found at {path} ({hint})")]
    Missing {
        what: &'static str,
        path: PathBuf,
        hint: &'static str,
    },
    #[error("reading fixtures file {path}: {source}")]
    Fixtures {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("fixtures file {path} has no {key}= line (scripts/lab/tier4-fixtures.sh writes it)")]
    FixtureKey { path: PathBuf, key: &'static str },
    #[error("no {what}: pass {flag} or --fixtures FILE")]
    NoPath {
        what: &'static str,
        flag: &'static str,
    },
    #[error("{0}")]
    Host(String),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot start {program}: {source}")]
    Spawn {
        program: PathBuf,
        source: std::io::Error,
    },
    #[error("{vm}: {what} did not come within {timeout:?}; last console lines:\n{console}\nstderr: {stderr}")]
    Timeout {
        vm: String,
        what: String,
        timeout: Duration,
        console: String,
        stderr: String,
    },
    #[error("{vm} exited ({status}) while waiting for {what}; last console lines:\n{console}\nstderr: {stderr}")]
    Exited {
        vm: String,
        what: String,
        status: String,
        console: String,
        stderr: String,
    },
    #[error("{vm}: the console never showed {what} before the agent answered")]
    NoMilestone { vm: String, what: &'static str },
    #[error("API {method} {path} on {sock}: {detail}")]
    Api {
        sock: PathBuf,
        method: &'static str,
        path: &'static str,
        detail: String,
    },
    #[error("{what}: no samples")]
    NoSamples { what: &'static str },
    #[error("{vm}: guest command `{script}`: {detail}")]
    Guest {
        vm: String,
        script: String,
        detail: String,
    },
    #[error("host command `{command}`: {detail}")]
    HostCommand { command: String, detail: String },
    #[error("interrupted by a signal; every VMM stopped")]
    Interrupted,
}

/// Set by SIGINT, SIGTERM or SIGHUP; the waits then end through the error path.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn note_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// A signal ends the run through the normal error path, so the guards stop every VMM and
/// remove the work directory.
pub(crate) fn catch_signals() {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { libc::signal(sig, note_signal as *const () as libc::sighandler_t) };
    }
}

/// The two parts of the benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Part {
    /// Linux boot under rollbox-vmm and QEMU microvm.
    Boot,
    /// Restore until the agent answers, beside a cold boot.
    Restore,
}

/// Settings; paths are checked by [`run`].
#[derive(Debug, Clone)]
pub struct LinuxBenchConfig {
    pub vmm: PathBuf,
    pub qemu: PathBuf,
    /// The QEMU machine, with its options (`-M`).
    pub qemu_machine: String,
    pub fixtures: Option<PathBuf>,
    pub kernel: Option<PathBuf>,
    pub rootfs: Option<PathBuf>,
    pub agent: PathBuf,
    pub busybox: PathBuf,
    pub rounds: usize,
    pub warmup: usize,
    pub memory_mib: u64,
    pub vcpus: u32,
    /// The command line both VMMs get (each appends its own device arguments).
    pub cmdline: String,
    /// Appended to QEMU's command line only: what rollbox-vmm appends by itself.
    pub qemu_append: String,
    pub qemu_cid: u32,
    pub parts: Vec<Part>,
    /// Parent of the work directory (removed at the end).
    pub dir: PathBuf,
    pub boot_timeout: Duration,
    /// Write every console transcript (host ms, line) here.
    pub keep_consoles: Option<PathBuf>,
}

/// Figures of one VMM booting the initramfs.
#[derive(Debug, Clone, Serialize)]
pub struct BootFigures {
    pub vmm: String,
    /// VMM process start to the first kernel console line (one with a printk timestamp).
    pub first_kernel_line_ms: Option<Summary>,
    /// To the initramfs's `/init` marker line.
    pub init_ms: Summary,
    /// To the agent's "listening on vsock port" line.
    pub agent_listening_ms: Summary,
    /// To the agent's answer to `hello` on a new vsock connection (first tried once the
    /// listening line is on the console).
    pub agent_ready_ms: Summary,
    /// The kernel's "Command line:" as the guest printed it.
    pub kernel_cmdline: Option<String>,
    /// The largest gaps between console lines in the median round.
    pub largest_gaps: Vec<Gap>,
    /// The VMM's CPU ms by thread name when the agent answered, in the median round.
    pub cpu_ms_by_thread: Vec<(String, f64)>,
}

/// Host time between one console line and the one before it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Gap {
    pub ms: f64,
    /// ms from process start to the line.
    pub at_ms: f64,
    /// The line after the gap.
    pub line: String,
}

/// Part 1.
#[derive(Debug, Clone, Serialize)]
pub struct BootReport {
    pub rollbox: BootFigures,
    pub qemu: BootFigures,
    pub qemu_machine: String,
    pub initramfs_bytes: u64,
}

/// ms from process start until the agent answers, with the steps on the way.
#[derive(Debug, Clone, Serialize)]
pub struct ReadyFigures {
    /// The vsock Unix socket accepted a connection (for a cold boot: the first attempt,
    /// made once the agent's listening line is on the console).
    pub socket_ms: Summary,
    /// The guest answered the vsock connection request (`OK` of `CONNECT 1024`).
    pub vsock_connected_ms: Summary,
    /// The agent answered `hello`.
    pub agent_ready_ms: Summary,
}

/// Part 2.
#[derive(Debug, Clone, Serialize)]
pub struct RestoreReport {
    /// rollbox-vmm boot of the same VM.
    pub cold_boot: ReadyFigures,
    /// `--restore --restore-backend cow`.
    pub restore_cow: ReadyFigures,
    /// `--restore-backend uffd --prefetch` (working set recorded once before).
    pub restore_uffd_prefetch: ReadyFigures,
    /// The `PUT /snapshot/create` call.
    pub snapshot_create_ms: f64,
    /// Blocks allocated by the memory file.
    pub memory_file_allocated_mib: f64,
    pub working_set_file_bytes: u64,
    /// rollbox-vmm's own restore phases (`--level Debug`) from one extra cow restore.
    pub cow_restore_phases: Vec<String>,
}

/// Everything, as `--json` writes it.
#[derive(Debug, Clone, Serialize)]
pub struct LinuxReport {
    pub kernel: String,
    pub rootfs: Option<String>,
    pub memory_mib: u64,
    pub vcpus: u32,
    pub rounds: usize,
    pub warmup: usize,
    pub cmdline: String,
    pub boot: Option<BootReport>,
    pub restore: Option<RestoreReport>,
}

pub(crate) fn io_err(
    what: &'static str,
    path: &Path,
) -> impl FnOnce(std::io::Error) -> LinuxBenchError {
    let path = path.to_path_buf();
    move |source| LinuxBenchError::Io { what, path, source }
}

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

// ---------------------------------------------------------------------------------------------
// Fixtures and the initramfs

/// `KEY=value` lines of a fixtures.env (blank lines and `#` comments skipped).
pub fn parse_env(text: &str) -> Vec<(String, String)> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect()
}

pub(crate) fn fixture(
    config: &LinuxBenchConfig,
    given: &Option<PathBuf>,
    key: &'static str,
    what: &'static str,
    flag: &'static str,
) -> Result<PathBuf, LinuxBenchError> {
    if let Some(path) = given {
        return Ok(path.clone());
    }
    let Some(file) = &config.fixtures else {
        return Err(LinuxBenchError::NoPath { what, flag });
    };
    let text = std::fs::read_to_string(file).map_err(|source| LinuxBenchError::Fixtures {
        path: file.clone(),
        source,
    })?;
    parse_env(&text)
        .into_iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| PathBuf::from(v))
        .ok_or(LinuxBenchError::FixtureKey {
            path: file.clone(),
            key,
        })
}

pub(crate) fn must_exist(
    what: &'static str,
    path: &Path,
    hint: &'static str,
) -> Result<(), LinuxBenchError> {
    if path.is_file() {
        Ok(())
    } else {
        Err(LinuxBenchError::Missing {
            what,
            path: path.to_path_buf(),
            hint,
        })
    }
}

/// One entry of a newc cpio archive.
pub enum CpioEntry<'a> {
    Dir(&'a str),
    File {
        name: &'a str,
        mode: u32,
        data: &'a [u8],
    },
    Symlink {
        name: &'a str,
        target: &'a str,
    },
    CharDev {
        name: &'a str,
        major: u32,
        minor: u32,
    },
}

/// Writes `entries` as an uncompressed newc ("070701") cpio archive, the format the kernel
/// unpacks as an initramfs.
pub fn write_cpio<W: Write>(out: &mut W, entries: &[CpioEntry<'_>]) -> std::io::Result<()> {
    let mut ino = 1u32;
    let mut record = |out: &mut W,
                      name: &str,
                      mode: u32,
                      data: &[u8],
                      rdev: (u32, u32)|
     -> std::io::Result<()> {
        let namesize = name.len() + 1;
        let header = format!(
            "070701{ino:08x}{mode:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{namesize:08x}{:08x}",
            0,
            0,
            if mode & 0o170000 == 0o040000 { 2 } else { 1 },
            0,
            data.len(),
            0,
            0,
            rdev.0,
            rdev.1,
            0
        );
        ino += 1;
        out.write_all(header.as_bytes())?;
        out.write_all(name.as_bytes())?;
        out.write_all(&[0])?;
        out.write_all(&[0; 3][..(4 - (header.len() + namesize) % 4) % 4])?;
        out.write_all(data)?;
        out.write_all(&[0; 3][..(4 - data.len() % 4) % 4])?;
        Ok(())
    };
    for entry in entries {
        match entry {
            CpioEntry::Dir(name) => record(out, name, 0o040755, &[], (0, 0))?,
            CpioEntry::File { name, mode, data } => {
                record(out, name, 0o100000 | (mode & 0o7777), data, (0, 0))?
            }
            CpioEntry::Symlink { name, target } => {
                record(out, name, 0o120777, target.as_bytes(), (0, 0))?
            }
            CpioEntry::CharDev { name, major, minor } => {
                record(out, name, 0o020600, &[], (*major, *minor))?
            }
        }
    }
    record(out, "TRAILER!!!", 0, &[], (0, 0))
}

/// The initramfs's `/init`: prints the marker, then hands PID 1 to the agent.
fn init_script() -> String {
    format!("#!/bin/busybox sh\necho \"{INIT_MARKER}\"\nexec /.rollbox/rollbox-agent\n")
}

/// Builds the initramfs (busybox, the static agent, a tiny `/init`) at `path`.
pub(crate) fn build_initramfs(
    config: &LinuxBenchConfig,
    path: &Path,
) -> Result<u64, LinuxBenchError> {
    let busybox = std::fs::read(&config.busybox).map_err(io_err("reading", &config.busybox))?;
    let agent = std::fs::read(&config.agent).map_err(io_err("reading", &config.agent))?;
    let init = init_script();
    let mut entries = vec![];
    for dir in [
        "bin", "dev", "proc", "sys", "run", "tmp", "etc", "root", ".rollbox",
    ] {
        entries.push(CpioEntry::Dir(dir));
    }
    entries.extend([
        CpioEntry::CharDev {
            name: "dev/console",
            major: 5,
            minor: 1,
        },
        CpioEntry::File {
            name: "bin/busybox",
            mode: 0o755,
            data: &busybox,
        },
        CpioEntry::Symlink {
            name: "bin/sh",
            target: "busybox",
        },
        CpioEntry::File {
            name: ".rollbox/rollbox-agent",
            mode: 0o755,
            data: &agent,
        },
        CpioEntry::File {
            name: "init",
            mode: 0o755,
            data: init.as_bytes(),
        },
    ]);
    let file = File::create(path).map_err(io_err("creating", path))?;
    let mut out = BufWriter::new(file);
    write_cpio(&mut out, &entries)
        .and_then(|()| out.flush())
        .map_err(io_err("writing", path))?;
    let len = std::fs::metadata(path)
        .map_err(io_err("reading", path))?
        .len();
    Ok(len)
}

/// The work directory; removed with everything in it when dropped.
pub(crate) struct WorkDir(pub(crate) PathBuf);

impl WorkDir {
    pub(crate) fn create(parent: &Path) -> Result<Self, LinuxBenchError> {
        let path = parent.join(format!("rollbox-bench-linux.{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).map_err(io_err("creating work directory", &path))?;
        Ok(Self(path))
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

// ---------------------------------------------------------------------------------------------
// VMM processes and their consoles

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
    lines: Vec<(Instant, String)>,
    stderr: Receiver<Vec<u8>>,
    stderr_text: Vec<u8>,
}

fn clean_line(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes)
        .trim_end_matches(['\r', '\n'])
        .to_string()
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
    fn drain(&mut self) {
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
    fn transcript(&self) -> Vec<(f64, String)> {
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

// ---------------------------------------------------------------------------------------------
// The agent's hello

/// Where the agent is reached.
#[derive(Debug, Clone)]
pub(crate) enum AgentAddr {
    /// rollbox-vmm's vsock Unix socket (hybrid `CONNECT <port>` preamble).
    Unix(PathBuf),
    /// AF_VSOCK to a guest CID (QEMU's vhost-vsock).
    Vsock(u32),
}

/// When the steps of one `hello` attempt succeeded.
#[derive(Debug, Default)]
struct Attempt {
    /// The host side accepted the connection (rollbox-vmm's Unix socket, or AF_VSOCK connect).
    connected: Option<Instant>,
    /// The guest's vsock answered the connection request.
    guest_connected: Option<Instant>,
}

/// The successful `wait_hello`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HelloTimes {
    /// The first attempt whose host-side connect succeeded.
    pub(crate) first_connect: Instant,
    /// The guest answered the successful attempt's vsock connection request.
    pub(crate) guest_connected: Instant,
    /// The agent's hello answer arrived.
    pub(crate) answered: Instant,
}

/// One attempt: connect, send `hello`, read the agent's `hello`.
fn hello_once(addr: &AgentAddr, timeout: Duration, attempt: &mut Attempt) -> Result<(), String> {
    let timeout = timeout.max(Duration::from_millis(10));
    match addr {
        AgentAddr::Unix(path) => {
            let mut stream = unix_connect(path, timeout)?;
            attempt.connected = Some(Instant::now());
            connect_agent_port(&mut stream)?;
            attempt.guest_connected = Some(Instant::now());
            hello_frames(&mut stream)
        }
        AgentAddr::Vsock(cid) => {
            let mut stream = vsock_connect(*cid, AGENT_PORT, timeout)?;
            attempt.connected = Some(Instant::now());
            attempt.guest_connected = attempt.connected;
            hello_frames(&mut stream)
        }
    }
}

/// rollbox-vmm's hybrid vsock preamble: `CONNECT <agent port>`, answered `OK <port>`.
pub(crate) fn connect_agent_port(stream: &mut UnixStream) -> Result<(), String> {
    stream
        .write_all(format!("CONNECT {AGENT_PORT}\n").as_bytes())
        .map_err(|e| format!("CONNECT: {e}"))?;
    let line = read_line(stream)?;
    if line.starts_with("OK ") {
        Ok(())
    } else {
        Err(format!("CONNECT {AGENT_PORT} answered {line:?}"))
    }
}

/// The preamble's answer, byte by byte (nothing after the newline is consumed).
pub(crate) fn read_line<R: Read>(reader: &mut R) -> Result<String, String> {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.len() < 64 {
        match reader.read(&mut byte) {
            Ok(0) => return Err(format!("closed after {:?}", clean_line(&line))),
            Ok(_) if byte[0] == b'\n' => return Ok(clean_line(&line)),
            Ok(_) => line.push(byte[0]),
            Err(e) => return Err(format!("reading the CONNECT answer: {e}")),
        }
    }
    Err(format!("CONNECT answer too long: {:?}", clean_line(&line)))
}

fn hello_frames<S: Read + Write>(stream: &mut S) -> Result<(), String> {
    let request = ClientFrame {
        id: 1,
        body: ClientMessage::Hello,
    };
    let bytes = frame::encode(&request).map_err(|e| e.to_string())?;
    stream
        .write_all(&bytes)
        .map_err(|e| format!("sending hello: {e}"))?;
    let reply = read_frame(stream).map_err(|e| format!("the hello answer: {e}"))?;
    match reply.body {
        ServerMessage::Hello { .. } => Ok(()),
        other => Err(format!("the agent answered hello with {other:?}")),
    }
}

/// One length-prefixed frame from the agent.
pub(crate) fn read_frame<R: Read>(stream: &mut R) -> Result<ServerFrame, String> {
    let mut header = [0u8; 4];
    stream
        .read_exact(&mut header)
        .map_err(|e| format!("reading: {e}"))?;
    let len = u32::from_be_bytes(header) as usize;
    if len > rollbox_agent_protocol::MAX_FRAME_BYTES {
        return Err(format!("answer frame of {len} bytes"));
    }
    let mut body = vec![0u8; len];
    stream
        .read_exact(&mut body)
        .map_err(|e| format!("reading: {e}"))?;
    frame::decode(&body).map_err(|e| e.to_string())
}

pub(crate) fn set_timeval(
    fd: &impl AsRawFd,
    level: libc::c_int,
    name: libc::c_int,
    t: Duration,
) -> Result<(), String> {
    let tv = libc::timeval {
        tv_sec: t.as_secs().try_into().unwrap_or(libc::time_t::MAX),
        tv_usec: t.subsec_micros().into(),
    };
    // SAFETY: `tv` lives across the call and the length given is its size.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(format!(
            "setsockopt({level}, {name}): {}",
            std::io::Error::last_os_error()
        ))
    }
}

/// A Unix stream socket connected to `path`, every step bounded by `timeout` (SO_SNDTIMEO also
/// bounds connect(2) on a listener whose backlog is full).
pub(crate) fn unix_connect(path: &Path, timeout: Duration) -> Result<UnixStream, String> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: sockaddr_un is plain data; all zeroes is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.len() >= addr.sun_path.len() {
        return Err(format!("socket path {} is too long", path.display()));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (dst, &src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = src as libc::c_char;
    }
    // SAFETY: socket(2) with constant arguments; the descriptor is owned just below.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(format!("unix socket: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    set_timeval(&fd, libc::SOL_SOCKET, libc::SO_SNDTIMEO, timeout)?;
    set_timeval(&fd, libc::SOL_SOCKET, libc::SO_RCVTIMEO, timeout)?;
    // SAFETY: `addr` is a valid sockaddr_un and the length given is its size.
    let rc = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_un).cast(),
            std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(format!(
            "connect {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        ));
    }
    Ok(UnixStream::from(fd))
}

/// A connected AF_VSOCK stream to `cid:port`.
pub(crate) fn vsock_connect(cid: u32, port: u32, timeout: Duration) -> Result<File, String> {
    // SAFETY: socket(2) with constant arguments; the descriptor is owned just below.
    let fd = unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(format!(
            "AF_VSOCK socket: {} (is vhost_vsock loaded?)",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    set_timeval(&fd, libc::AF_VSOCK, SO_VM_SOCKETS_CONNECT_TIMEOUT, timeout)?;
    set_timeval(&fd, libc::SOL_SOCKET, libc::SO_RCVTIMEO, timeout)?;
    set_timeval(&fd, libc::SOL_SOCKET, libc::SO_SNDTIMEO, timeout)?;
    // SAFETY: sockaddr_vm is plain data; all zeroes is a valid value.
    let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
    addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
    addr.svm_cid = cid;
    addr.svm_port = port;
    // SAFETY: `addr` is a valid sockaddr_vm and the length given is its size.
    let rc = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_vm).cast(),
            std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(format!(
            "connect vsock {cid}:{port}: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(File::from(fd))
}

// ---------------------------------------------------------------------------------------------
// Part 1: boot

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Which {
    Rollbox,
    Qemu,
}

impl Which {
    fn label(self) -> &'static str {
        match self {
            Which::Rollbox => "rollbox-vmm",
            Which::Qemu => "QEMU microvm",
        }
    }
}

/// One boot's milestones, ms from process start.
#[derive(Debug, Clone)]
struct BootSample {
    first_kernel_line: Option<f64>,
    init: f64,
    listening: f64,
    ready: f64,
    lines: Vec<(f64, String)>,
    /// CPU time by thread name when the agent answered.
    threads: Vec<(String, f64)>,
}

/// Thread name and user + system CPU ms from one `/proc/PID/task/TID/stat`.
pub fn parse_task_stat(text: &str, ticks_per_s: f64) -> Option<(String, f64)> {
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let name = text.get(open + 1..close)?.to_string();
    // After "pid (comm) " come state (field 3), ..., utime (14), stime (15).
    let fields: Vec<&str> = text.get(close + 1..)?.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((name, (utime + stime) * 1e3 / ticks_per_s))
}

/// CPU ms per thread name of process `pid` (threads of one name added up), largest first.
fn thread_cpu_ms(pid: u32) -> Vec<(String, f64)> {
    // SAFETY: sysconf only reads a configuration value.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let ticks = if ticks > 0 { ticks as f64 } else { 100.0 };
    let mut by_name: Vec<(String, f64)> = Vec::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return by_name;
    };
    for task in tasks.flatten() {
        let Ok(text) = std::fs::read_to_string(task.path().join("stat")) else {
            continue;
        };
        if let Some((name, cpu)) = parse_task_stat(&text, ticks) {
            match by_name.iter_mut().find(|(n, _)| *n == name) {
                Some((_, total)) => *total += cpu,
                None => by_name.push((name, cpu)),
            }
        }
    }
    by_name.sort_by(|a, b| b.1.total_cmp(&a.1));
    by_name
}

/// A kernel console line: starts with a printk timestamp such as `[    0.000000]`.
pub fn is_printk_line(line: &str) -> bool {
    let Some(rest) = line.trim_start().strip_prefix('[') else {
        return false;
    };
    let Some((stamp, _)) = rest.split_once(']') else {
        return false;
    };
    let stamp = stamp.trim();
    !stamp.is_empty()
        && stamp.contains('.')
        && stamp.chars().all(|c| c.is_ascii_digit() || c == '.')
}

/// The `largest` biggest gaps between consecutive lines, biggest first.
pub fn largest_gaps(lines: &[(f64, String)], start_ms: f64, largest: usize) -> Vec<Gap> {
    let mut gaps: Vec<Gap> = Vec::new();
    let mut before = start_ms;
    for (at, line) in lines {
        gaps.push(Gap {
            ms: at - before,
            at_ms: *at,
            line: line.chars().take(100).collect(),
        });
        before = *at;
    }
    gaps.sort_by(|a, b| b.ms.total_cmp(&a.ms));
    gaps.truncate(largest);
    gaps
}

pub(crate) fn rollbox_boot_args(
    config: &LinuxBenchConfig,
    kernel: &Path,
    initramfs: &Path,
    sock: &Path,
) -> Vec<String> {
    vec![
        "--kernel".into(),
        kernel.display().to_string(),
        "--initrd".into(),
        initramfs.display().to_string(),
        "--memory-mib".into(),
        config.memory_mib.to_string(),
        "--vcpus".into(),
        config.vcpus.to_string(),
        "--cmdline".into(),
        config.cmdline.clone(),
        "--vsock-uds".into(),
        sock.display().to_string(),
        "--vsock-cid".into(),
        ROLLBOX_CID.to_string(),
    ]
}

/// QEMU's microvm with the same kernel, initramfs, memory and vCPUs; its serial console on
/// stdout, vsock through vhost-vsock.
pub fn qemu_args(config: &LinuxBenchConfig, kernel: &Path, initramfs: &Path) -> Vec<String> {
    let append = if config.qemu_append.trim().is_empty() {
        config.cmdline.clone()
    } else {
        format!("{} {}", config.cmdline, config.qemu_append.trim())
    };
    [
        "-accel",
        "kvm",
        "-M",
        &config.qemu_machine,
        "-cpu",
        "host",
        "-m",
        &format!("{}M", config.memory_mib),
        "-smp",
        &config.vcpus.to_string(),
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        // Thread names ("CPU 0/KVM") for the CPU-by-thread figures.
        "-name",
        "rollbox-bench,debug-threads=on",
        "-no-reboot",
        "-serial",
        "stdio",
        "-kernel",
        &kernel.display().to_string(),
        "-initrd",
        &initramfs.display().to_string(),
        "-append",
        &append,
        "-device",
        &format!("vhost-vsock-device,guest-cid={}", config.qemu_cid),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn boot_once(
    config: &LinuxBenchConfig,
    which: Which,
    kernel: &Path,
    initramfs: &Path,
    work: &Path,
    round: usize,
) -> Result<BootSample, LinuxBenchError> {
    let sock = work.join(format!("boot-{round}.sock"));
    let (program, args, addr) = match which {
        Which::Rollbox => (
            &config.vmm,
            rollbox_boot_args(config, kernel, initramfs, &sock),
            AgentAddr::Unix(sock.clone()),
        ),
        Which::Qemu => (
            &config.qemu,
            qemu_args(config, kernel, initramfs),
            AgentAddr::Vsock(config.qemu_cid),
        ),
    };
    let mut vm = VmProcess::spawn(which.label(), program, &args)?;
    let deadline = vm.started + config.boot_timeout;
    let listening = vm.wait_line("the agent's listening line", AGENT_LISTENING, deadline)?;
    let ready = vm.wait_hello(&addr, deadline)?.answered;
    let threads = thread_cpu_ms(vm.child.id());
    vm.drain();
    vm.stop();
    let _ = std::fs::remove_file(&sock);
    let since = |at: Instant| ms(at.saturating_duration_since(vm.started));
    let find = |needle: &str| {
        vm.lines
            .iter()
            .find(|(_, l)| l.contains(needle))
            .map(|(at, _)| *at)
    };
    let init = find(INIT_MARKER).ok_or_else(|| LinuxBenchError::NoMilestone {
        vm: which.label().into(),
        what: "the /init marker line",
    })?;
    let first_kernel_line = vm
        .lines
        .iter()
        .find(|(_, l)| is_printk_line(l))
        .map(|(at, _)| since(*at));
    Ok(BootSample {
        first_kernel_line,
        init: since(init),
        listening: since(listening),
        ready: since(ready),
        lines: vm.transcript(),
        threads,
    })
}

fn keep_console(
    config: &LinuxBenchConfig,
    name: &str,
    lines: &[(f64, String)],
) -> Result<(), LinuxBenchError> {
    let Some(dir) = &config.keep_consoles else {
        return Ok(());
    };
    std::fs::create_dir_all(dir).map_err(io_err("creating", dir))?;
    let path = dir.join(name);
    let text: String = lines
        .iter()
        .map(|(at, l)| format!("{at:10.1} ms  {l}\n"))
        .collect();
    std::fs::write(&path, text).map_err(io_err("writing", &path))
}

pub(crate) fn summary(what: &'static str, values: &[f64]) -> Result<Summary, LinuxBenchError> {
    summarize(values).ok_or(LinuxBenchError::NoSamples { what })
}

fn boot_figures(which: Which, samples: &[BootSample]) -> Result<BootFigures, LinuxBenchError> {
    let get = |f: fn(&BootSample) -> f64| samples.iter().map(f).collect::<Vec<_>>();
    let first: Vec<f64> = samples.iter().filter_map(|s| s.first_kernel_line).collect();
    let ready = summary("agent ready", &get(|s| s.ready))?;
    // The round whose agent-ready time is the median one.
    let median_round = samples
        .iter()
        .find(|s| s.ready == ready.p50)
        .or(samples.first());
    let kernel_cmdline = median_round.and_then(|s| {
        s.lines
            .iter()
            .find_map(|(_, l)| l.split_once("Command line: ").map(|(_, c)| c.to_string()))
    });
    Ok(BootFigures {
        vmm: which.label().into(),
        first_kernel_line_ms: (first.len() == samples.len())
            .then(|| summarize(&first))
            .flatten(),
        init_ms: summary("/init", &get(|s| s.init))?,
        agent_listening_ms: summary("agent listening", &get(|s| s.listening))?,
        agent_ready_ms: ready,
        kernel_cmdline,
        largest_gaps: median_round
            .map(|s| largest_gaps(&s.lines, 0.0, GAPS_SHOWN))
            .unwrap_or_default(),
        cpu_ms_by_thread: median_round.map(|s| s.threads.clone()).unwrap_or_default(),
    })
}

fn run_boot(
    config: &LinuxBenchConfig,
    kernel: &Path,
    work: &Path,
) -> Result<BootReport, LinuxBenchError> {
    must_exist(
        "QEMU",
        &config.qemu,
        "apt-get install qemu-system-x86, or pass --qemu PATH",
    )?;
    if !Path::new("/dev/vhost-vsock").exists() {
        return Err(LinuxBenchError::Host(
            "/dev/vhost-vsock is missing: QEMU's vsock needs the vhost_vsock module \
             (modprobe vhost_vsock; in the lab: scripts/lab/run.sh --modprobe vhost_vsock)"
                .into(),
        ));
    }
    let initramfs = work.join("initramfs.cpio");
    let initramfs_bytes = build_initramfs(config, &initramfs)?;
    eprintln!(
        "linux boot: initramfs {} KiB (busybox {}, agent {})",
        initramfs_bytes >> 10,
        config.busybox.display(),
        config.agent.display()
    );
    let mut rollbox = Vec::new();
    let mut qemu = Vec::new();
    let total = config.warmup + config.rounds;
    for round in 0..total {
        let warm = round < config.warmup;
        // Alternate which VMM goes first, round by round.
        let order = if round % 2 == 0 {
            [Which::Rollbox, Which::Qemu]
        } else {
            [Which::Qemu, Which::Rollbox]
        };
        for which in order {
            let sample = boot_once(config, which, kernel, &initramfs, work, round)?;
            eprintln!(
                "linux boot {} {}/{}{}: first kernel line {}, /init {:.0} ms, agent listening {:.0} ms, agent ready {:.0} ms",
                which.label(),
                round + 1,
                total,
                if warm { " (warm-up)" } else { "" },
                sample
                    .first_kernel_line
                    .map_or("n/a".into(), |v| format!("{v:.0} ms")),
                sample.init,
                sample.listening,
                sample.ready
            );
            let name = match which {
                Which::Rollbox => format!("boot-rollbox-{round}.log"),
                Which::Qemu => format!("boot-qemu-{round}.log"),
            };
            keep_console(config, &name, &sample.lines)?;
            if !warm {
                match which {
                    Which::Rollbox => rollbox.push(sample),
                    Which::Qemu => qemu.push(sample),
                }
            }
        }
    }
    Ok(BootReport {
        rollbox: boot_figures(Which::Rollbox, &rollbox)?,
        qemu: boot_figures(Which::Qemu, &qemu)?,
        qemu_machine: config.qemu_machine.clone(),
        initramfs_bytes,
    })
}

// ---------------------------------------------------------------------------------------------
// Part 2: restore

fn api(
    sock: &Path,
    method: &'static str,
    path: &'static str,
    body: &str,
) -> Result<(), LinuxBenchError> {
    let err = |detail: String| LinuxBenchError::Api {
        sock: sock.to_path_buf(),
        method,
        path,
        detail,
    };
    let (status, answer) = vmm::api::http::unix_request(
        sock,
        method,
        path,
        Some(body),
        Some(Duration::from_secs(600)),
    )
    .map_err(|e| err(e.to_string()))?;
    if (200..300).contains(&status) {
        Ok(())
    } else {
        Err(err(format!("status {status}: {answer}")))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RestoreKind {
    Cold,
    Cow,
    UffdPrefetch,
}

impl RestoreKind {
    fn label(self) -> &'static str {
        match self {
            RestoreKind::Cold => "cold boot",
            RestoreKind::Cow => "restore cow",
            RestoreKind::UffdPrefetch => "restore uffd + prefetch",
        }
    }
}

fn restore_args(snap: &Path, backend: &str, extra: &[&str], sock: &Path) -> Vec<String> {
    let mut args = vec![
        "--restore".to_string(),
        snap.display().to_string(),
        "--restore-backend".into(),
        backend.into(),
        "--vsock-uds".into(),
        sock.display().to_string(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn run_restore(
    config: &LinuxBenchConfig,
    kernel: &Path,
    rootfs: &Path,
    work: &Path,
) -> Result<RestoreReport, LinuxBenchError> {
    // The root drive is read-only, so every VM (and every restore) sees the same disk.
    let cold_args = |sock: &Path| -> Vec<String> {
        vec![
            "--kernel".into(),
            kernel.display().to_string(),
            "--memory-mib".into(),
            config.memory_mib.to_string(),
            "--vcpus".into(),
            config.vcpus.to_string(),
            "--drive".into(),
            format!("{},root,readonly", rootfs.display()),
            "--cmdline".into(),
            format!("{} init=/.rollbox/rollbox-agent", config.cmdline),
            "--vsock-uds".into(),
            sock.display().to_string(),
            "--vsock-cid".into(),
            ROLLBOX_CID.to_string(),
        ]
    };

    // Boot the VM to snapshot, wait for its agent, pause, snapshot.
    let api_sock = work.join("api.sock");
    let source_sock = work.join("source.sock");
    let mut args = cold_args(&source_sock);
    args.extend(["--api-sock".into(), api_sock.display().to_string()]);
    let mut source = VmProcess::spawn("rollbox-vmm (snapshot source)", &config.vmm, &args)?;
    let deadline = source.started + config.boot_timeout;
    source.wait_line("the agent's listening line", AGENT_LISTENING, deadline)?;
    let ready = source
        .wait_hello(&AgentAddr::Unix(source_sock), deadline)?
        .answered;
    eprintln!(
        "linux restore: snapshot source booted, agent answered after {:.0} ms",
        ms(ready.saturating_duration_since(source.started))
    );
    let snap = work.join("snapshot");
    std::fs::create_dir_all(&snap).map_err(io_err("creating", &snap))?;
    api(&api_sock, "PATCH", "/vm", r#"{"state":"Paused"}"#)?;
    let body = format!(
        r#"{{"snapshot_type":"Full","snapshot_path":"{0}/vmstate","mem_file_path":"{0}/memory"}}"#,
        snap.display()
    );
    let started = Instant::now();
    api(&api_sock, "PUT", "/snapshot/create", &body)?;
    let snapshot_create_ms = ms(started.elapsed());
    source.stop();
    drop(source);
    let memory = snap.join("memory");
    let memory_file_allocated_mib = {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(&memory).map_err(io_err("reading", &memory))?;
        (meta.blocks() * 512) as f64 / f64::from(1 << 20)
    };
    eprintln!(
        "linux restore: snapshot created in {snapshot_create_ms:.0} ms, memory file {memory_file_allocated_mib:.1} MiB allocated"
    );

    // Record the working set once: a uffd restore until the agent answers, then a clean exit.
    let record_sock = work.join("record.sock");
    let mut record = VmProcess::spawn(
        "rollbox-vmm (record working set)",
        &config.vmm,
        &restore_args(&snap, "uffd", &["--record-working-set"], &record_sock),
    )?;
    let deadline = record.started + config.boot_timeout;
    record.wait_hello(&AgentAddr::Unix(record_sock), deadline)?;
    record.stop();
    drop(record);
    let ws = snap.join("memory.ws");
    let working_set_file_bytes = std::fs::metadata(&ws)
        .map_err(|_| LinuxBenchError::Missing {
            what: "recorded working set",
            path: ws.clone(),
            hint: "rollbox-vmm --record-working-set saves it when it exits on SIGTERM",
        })?
        .len();
    eprintln!("linux restore: working set recorded ({working_set_file_bytes} bytes)");

    let kinds = [
        RestoreKind::Cold,
        RestoreKind::Cow,
        RestoreKind::UffdPrefetch,
    ];
    // Per kind: (socket accepts, guest answers the vsock connection, agent answers), ms.
    let mut samples: [Vec<[f64; 3]>; 3] = [Vec::new(), Vec::new(), Vec::new()];
    for round in 0..config.rounds {
        for i in 0..kinds.len() {
            // Rotate the order round by round.
            let k = (round + i) % kinds.len();
            let kind = kinds[k];
            let sock = work.join(format!("r{round}-{k}.sock"));
            let args = match kind {
                RestoreKind::Cold => cold_args(&sock),
                RestoreKind::Cow => restore_args(&snap, "cow", &[], &sock),
                RestoreKind::UffdPrefetch => restore_args(&snap, "uffd", &["--prefetch"], &sock),
            };
            let mut vm = VmProcess::spawn(
                &format!("rollbox-vmm ({})", kind.label()),
                &config.vmm,
                &args,
            )?;
            let deadline = vm.started + config.boot_timeout;
            if kind == RestoreKind::Cold {
                vm.wait_line("the agent's listening line", AGENT_LISTENING, deadline)?;
            }
            let times = vm.wait_hello(&AgentAddr::Unix(sock.clone()), deadline)?;
            let since = |at: Instant| ms(at.saturating_duration_since(vm.started));
            let sample = [
                since(times.first_connect),
                since(times.guest_connected),
                since(times.answered),
            ];
            drop(vm);
            let _ = std::fs::remove_file(&sock);
            eprintln!(
                "linux restore {}/{}: {}: socket {:.0} ms, guest vsock {:.0} ms, agent answered {:.0} ms",
                round + 1,
                config.rounds,
                kind.label(),
                sample[0],
                sample[1],
                sample[2]
            );
            samples[k].push(sample);
        }
    }

    // One more cow restore, unmeasured, with rollbox-vmm's restore phases logged.
    let phase_sock = work.join("phases.sock");
    let mut args = restore_args(&snap, "cow", &[], &phase_sock);
    args.extend(["--level".into(), "Debug".into()]);
    let mut vm = VmProcess::spawn("rollbox-vmm (cow, --level Debug)", &config.vmm, &args)?;
    let deadline = vm.started + config.boot_timeout;
    vm.wait_hello(&AgentAddr::Unix(phase_sock), deadline)?;
    vm.stop();
    let stderr = vm.stderr_tail_all();
    drop(vm);
    let cow_restore_phases = stderr
        .lines()
        .filter_map(|l| l.find("restore: ").map(|i| l[i..].to_string()))
        .collect();

    let [cold, cow, uffd] = samples;
    let figures =
        |what: &'static str, samples: &[[f64; 3]]| -> Result<ReadyFigures, LinuxBenchError> {
            let column = |i: usize| samples.iter().map(|s| s[i]).collect::<Vec<_>>();
            Ok(ReadyFigures {
                socket_ms: summary(what, &column(0))?,
                vsock_connected_ms: summary(what, &column(1))?,
                agent_ready_ms: summary(what, &column(2))?,
            })
        };
    Ok(RestoreReport {
        cold_boot: figures("cold boot", &cold)?,
        restore_cow: figures("restore cow", &cow)?,
        restore_uffd_prefetch: figures("restore uffd + prefetch", &uffd)?,
        snapshot_create_ms,
        memory_file_allocated_mib,
        working_set_file_bytes,
        cow_restore_phases,
    })
}

impl VmProcess {
    /// Everything the VMM wrote on stderr, once it has exited.
    fn stderr_tail_all(&mut self) -> String {
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

// ---------------------------------------------------------------------------------------------
// Running and reporting

/// Refuses hosts whose /dev/kvm cannot run Linux, with one line saying why.
pub(crate) fn check_kvm() -> Result<(), LinuxBenchError> {
    if !Path::new("/dev/kvm").exists() {
        return Err(LinuxBenchError::Host(
            "/dev/kvm is missing; run this inside the nested lab (scripts/lab/bench-linux.sh)"
                .into(),
        ));
    }
    if Path::new("/sys/module/kvm_pvm").exists() {
        return Err(LinuxBenchError::Host(
            "this /dev/kvm is PVM, which cannot run Linux guests (see ../shared/docs/kvm-here.md); \
             run this inside the nested lab (scripts/lab/bench-linux.sh)"
                .into(),
        ));
    }
    Ok(())
}

/// The guest kernel (from `--kernel` or the fixtures), checked like rollbox-vmm.
pub(crate) fn kernel_and_vmm(config: &LinuxBenchConfig) -> Result<PathBuf, LinuxBenchError> {
    let kernel = fixture(
        config,
        &config.kernel,
        "OUR_VMLINUX",
        "guest kernel",
        "--kernel",
    )?;
    must_exist(
        "guest kernel (vmlinux)",
        &kernel,
        "kernel-config/build.sh builds it; rebuild the fixtures with scripts/lab/tier4-fixtures.sh",
    )?;
    must_exist(
        "rollbox-vmm",
        &config.vmm,
        "cargo build --release -p vmm, or pass --vmm PATH",
    )?;
    Ok(kernel)
}

/// The static agent and busybox that [`build_initramfs`] packs.
pub(crate) fn initramfs_inputs_exist(config: &LinuxBenchConfig) -> Result<(), LinuxBenchError> {
    must_exist(
        "static rollbox-agent",
        &config.agent,
        "guest-agent/build-static.sh builds it, or pass --agent PATH",
    )?;
    must_exist(
        "static busybox",
        &config.busybox,
        "apt-get install busybox-static, or pass --busybox PATH",
    )
}

/// Runs the parts `config.parts` asks for.
pub fn run(config: &LinuxBenchConfig) -> Result<LinuxReport, LinuxBenchError> {
    let kernel = kernel_and_vmm(config)?;
    let boot = config.parts.contains(&Part::Boot);
    let restore = config.parts.contains(&Part::Restore);
    if boot {
        initramfs_inputs_exist(config)?;
    }
    let rootfs = if restore {
        let path = fixture(
            config,
            &config.rootfs,
            "BUSYBOX_ROOTFS",
            "busybox rootfs",
            "--rootfs",
        )?;
        must_exist(
            "busybox rootfs",
            &path,
            "scripts/lab/tier4-fixtures.sh builds it, or pass --rootfs PATH",
        )?;
        Some(path)
    } else {
        None
    };
    check_kvm()?;
    catch_signals();
    let work = WorkDir::create(&config.dir)?;
    let boot_report = if boot {
        Some(run_boot(config, &kernel, &work.0)?)
    } else {
        None
    };
    let restore_report = match &rootfs {
        Some(rootfs) => Some(run_restore(config, &kernel, rootfs, &work.0)?),
        None => None,
    };
    Ok(LinuxReport {
        kernel: kernel.display().to_string(),
        rootfs: rootfs.map(|p| p.display().to_string()),
        memory_mib: config.memory_mib,
        vcpus: config.vcpus,
        rounds: config.rounds,
        warmup: config.warmup,
        cmdline: config.cmdline.clone(),
        boot: boot_report,
        restore: restore_report,
    })
}

pub(crate) fn cell(s: &Summary) -> String {
    format!("{:.0} ({:.0}–{:.0})", s.p50, s.min, s.max)
}

pub(crate) fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 {
        format!("{:.2}×", a / b)
    } else {
        "n/a".into()
    }
}

/// "met" or "missed by N×" for `value / base` against `target`.
pub fn verdict(value: f64, base: f64, target: f64) -> String {
    if base <= 0.0 {
        return "n/a".into();
    }
    let r = value / base;
    if r <= target {
        format!("met ({r:.2}×)")
    } else {
        format!("missed: {r:.2}×, {:.1}× over the target", r / target)
    }
}

/// The report as markdown tables.
pub fn markdown(report: &LinuxReport) -> String {
    let mut out = String::new();
    if let Some(boot) = &report.boot {
        let (r, q) = (&boot.rollbox, &boot.qemu);
        out.push_str(&format!(
            "### Linux boot: rollbox-vmm beside QEMU -M {} (same vmlinux and initramfs, {} MiB, {} vCPUs; median (min–max) of {} rounds, alternating)\n\n",
            boot.qemu_machine, report.memory_mib, report.vcpus, report.rounds
        ));
        out.push_str(
            "| ms from VMM process start to | rollbox-vmm | QEMU microvm | rollbox/QEMU |\n\
             | --- | ---: | ---: | ---: |\n",
        );
        let first = match (&r.first_kernel_line_ms, &q.first_kernel_line_ms) {
            (Some(a), Some(b)) => (cell(a), cell(b), ratio(a.p50, b.p50)),
            (a, b) => (
                a.as_ref().map_or("n/a".into(), cell),
                b.as_ref().map_or("n/a".into(), cell),
                "n/a".into(),
            ),
        };
        out.push_str(&format!(
            "| first kernel console line | {} | {} | {} |\n",
            first.0, first.1, first.2
        ));
        for (name, a, b) in [
            ("`/init` running (marker line)", &r.init_ms, &q.init_ms),
            (
                "agent listening (its console line)",
                &r.agent_listening_ms,
                &q.agent_listening_ms,
            ),
            (
                "**agent ready** (hello answered on a new vsock connection)",
                &r.agent_ready_ms,
                &q.agent_ready_ms,
            ),
        ] {
            out.push_str(&format!(
                "| {name} | {} | {} | {} |\n",
                cell(a),
                cell(b),
                ratio(a.p50, b.p50)
            ));
        }
        out.push_str(&format!(
            "\nTarget agent ready ≤ 0.5× QEMU microvm: {}.\n",
            verdict(r.agent_ready_ms.p50, q.agent_ready_ms.p50, 0.5)
        ));
        out.push_str(&format!(
            "Initramfs: {} KiB, uncompressed cpio.\n",
            boot.initramfs_bytes >> 10
        ));
        for figures in [r, q] {
            if let Some(cmdline) = &figures.kernel_cmdline {
                out.push_str(&format!(
                    "Kernel command line under {}: `{cmdline}`\n",
                    figures.vmm
                ));
            }
        }
        for figures in [r, q] {
            out.push_str(&format!(
                "\nLargest gaps between console lines, {} (median round; ms before the line, at ms):\n",
                figures.vmm
            ));
            for gap in &figures.largest_gaps {
                out.push_str(&format!(
                    "- {:.0} ms, at {:.0}: `{}`\n",
                    gap.ms, gap.at_ms, gap.line
                ));
            }
            let threads: Vec<String> = figures
                .cpu_ms_by_thread
                .iter()
                .map(|(name, cpu)| format!("{name} {cpu:.0}"))
                .collect();
            out.push_str(&format!(
                "\nCPU ms by thread of {} until the agent answered (median round): {}\n",
                figures.vmm,
                threads.join(", ")
            ));
        }
        out.push('\n');
    }
    if let Some(restore) = &report.restore {
        out.push_str(&format!(
            "### Restore of a Linux guest until the agent answers (rollbox-vmm, busybox rootfs with the agent as init, {} MiB, {} vCPUs; median (min–max) of {} rounds, rotating)\n\n",
            report.memory_mib, report.vcpus, report.rounds
        ));
        out.push_str(
            "| ms from process start to | cold boot of the same VM | restore, cow | restore, uffd + prefetch |\n\
             | --- | ---: | ---: | ---: |\n",
        );
        let kinds = [
            &restore.cold_boot,
            &restore.restore_cow,
            &restore.restore_uffd_prefetch,
        ];
        type Pick = fn(&ReadyFigures) -> &Summary;
        let rows: [(&str, Pick); 3] = [
            ("vsock socket accepts a connection", |f| &f.socket_ms),
            ("guest answers the vsock connection", |f| {
                &f.vsock_connected_ms
            }),
            ("**agent answers hello**", |f| &f.agent_ready_ms),
        ];
        for (name, pick) in rows {
            let cells: Vec<String> = kinds.iter().map(|f| cell(pick(f))).collect();
            out.push_str(&format!("| {name} | {} |\n", cells.join(" | ")));
        }
        let cold = restore.cold_boot.agent_ready_ms.p50;
        let cells: Vec<String> = kinds
            .iter()
            .map(|f| ratio(f.agent_ready_ms.p50, cold))
            .collect();
        out.push_str(&format!(
            "| agent answers, ÷ cold boot | {} |\n",
            cells.join(" | ")
        ));
        out.push_str(&format!(
            "\nTarget restore ≤ 0.1× cold boot: cow {}; uffd + prefetch {}. \
             (A cold boot's first attempt waits for the agent's listening line; a restore's \
             attempts start at process start.)\n",
            verdict(restore.restore_cow.agent_ready_ms.p50, cold, 0.1),
            verdict(restore.restore_uffd_prefetch.agent_ready_ms.p50, cold, 0.1)
        ));
        out.push_str(&format!(
            "Snapshot: create call {:.0} ms, memory file {:.1} MiB allocated, working set file {} bytes.\n",
            restore.snapshot_create_ms,
            restore.memory_file_allocated_mib,
            restore.working_set_file_bytes
        ));
        if !restore.cow_restore_phases.is_empty() {
            out.push_str("rollbox-vmm's restore phases (one more cow restore, --level Debug):\n");
            for phase in &restore.cow_restore_phases {
                out.push_str(&format!("- {phase}\n"));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// name, mode, data, (rdev major, minor)
    type Entry = (String, u32, Vec<u8>, (u32, u32));

    /// Parses a newc archive back into its entries.
    fn parse_cpio(bytes: &[u8]) -> Vec<Entry> {
        let mut out = Vec::new();
        let mut at = 0;
        let field = |b: &[u8], i: usize| {
            let hex = std::str::from_utf8(&b[6 + i * 8..14 + i * 8]).expect("ASCII header");
            u32::from_str_radix(hex, 16).expect("hex field")
        };
        loop {
            let header = &bytes[at..at + 110];
            assert_eq!(&header[..6], b"070701");
            let mode = field(header, 1);
            let size = field(header, 6) as usize;
            let rdev = (field(header, 9), field(header, 10));
            let namesize = field(header, 11) as usize;
            let name = std::str::from_utf8(&bytes[at + 110..at + 110 + namesize - 1])
                .expect("UTF-8 name")
                .to_string();
            at = (at + 110 + namesize).div_ceil(4) * 4;
            let data = bytes[at..at + size].to_vec();
            at = (at + size).div_ceil(4) * 4;
            if name == "TRAILER!!!" {
                assert_eq!(at, bytes.len());
                return out;
            }
            out.push((name, mode, data, rdev));
        }
    }

    #[test]
    fn cpio_round_trips() {
        let mut bytes = Vec::new();
        write_cpio(
            &mut bytes,
            &[
                CpioEntry::Dir("dev"),
                CpioEntry::CharDev {
                    name: "dev/console",
                    major: 5,
                    minor: 1,
                },
                CpioEntry::File {
                    name: "init",
                    mode: 0o755,
                    data: b"#!/bin/sh\n",
                },
                CpioEntry::Symlink {
                    name: "bin/sh",
                    target: "busybox",
                },
                CpioEntry::File {
                    name: "odd",
                    mode: 0o644,
                    data: b"12345",
                },
            ],
        )
        .expect("writes to a Vec");
        let entries = parse_cpio(&bytes);
        let names: Vec<&str> = entries.iter().map(|e| e.0.as_str()).collect();
        assert_eq!(names, ["dev", "dev/console", "init", "bin/sh", "odd"]);
        assert_eq!(entries[0].1, 0o040755);
        assert_eq!((entries[1].1, entries[1].3), (0o020600, (5, 1)));
        assert_eq!(
            (entries[2].1, entries[2].2.as_slice()),
            (0o100755, &b"#!/bin/sh\n"[..])
        );
        assert_eq!(
            (entries[3].1, entries[3].2.as_slice()),
            (0o120777, &b"busybox"[..])
        );
        assert_eq!(entries[4].2, b"12345");
    }

    #[test]
    fn init_prints_the_marker_then_execs_the_agent() {
        let script = init_script();
        assert!(script.starts_with("#!/bin/busybox sh\n"));
        assert!(script.contains(INIT_MARKER));
        assert!(script.trim_end().ends_with("exec /.rollbox/rollbox-agent"));
    }

    #[test]
    fn fixtures_env_lines() {
        let env = parse_env("# c\nOUR_VMLINUX=/k/vmlinux\n\nBUSYBOX_ROOTFS = /f/b.ext4\nnoise\n");
        assert_eq!(
            env,
            vec![
                ("OUR_VMLINUX".to_string(), "/k/vmlinux".to_string()),
                ("BUSYBOX_ROOTFS".to_string(), "/f/b.ext4".to_string()),
            ]
        );
    }

    #[test]
    fn printk_lines() {
        assert!(is_printk_line("[    0.000000] Linux version 6.1"));
        assert!(is_printk_line("[   12.345678] Run /init as init process"));
        assert!(!is_printk_line(INIT_MARKER));
        assert!(!is_printk_line("[INFO] listening"));
        assert!(!is_printk_line("[] x"));
    }

    #[test]
    fn gaps_biggest_first() {
        let lines = vec![
            (10.0, "a".to_string()),
            (15.0, "b".to_string()),
            (115.0, "c".to_string()),
            (120.0, "d".to_string()),
        ];
        let gaps = largest_gaps(&lines, 0.0, 2);
        assert_eq!(gaps.len(), 2);
        assert_eq!((gaps[0].ms, gaps[0].line.as_str()), (100.0, "c"));
        assert_eq!((gaps[1].ms, gaps[1].line.as_str()), (10.0, "a"));
    }

    #[test]
    fn task_stat_fields() {
        let text = "4242 (CPU 0/KVM) S 1 2 3 4 5 6 7 8 9 10 150 25 0 0 20 0 1 0 99 0 0";
        assert_eq!(
            parse_task_stat(text, 100.0),
            Some(("CPU 0/KVM".to_string(), 1750.0))
        );
        assert_eq!(parse_task_stat("garbage", 100.0), None);
    }

    #[test]
    fn verdicts() {
        assert_eq!(verdict(40.0, 100.0, 0.5), "met (0.40×)");
        assert_eq!(
            verdict(80.0, 100.0, 0.5),
            "missed: 0.80×, 1.6× over the target"
        );
        assert_eq!(verdict(1.0, 0.0, 0.5), "n/a");
    }

    fn config() -> LinuxBenchConfig {
        LinuxBenchConfig {
            vmm: "/nonexistent/rollbox-vmm".into(),
            qemu: "/usr/bin/qemu-system-x86_64".into(),
            qemu_machine: "microvm".into(),
            fixtures: None,
            kernel: None,
            rootfs: None,
            agent: "/a".into(),
            busybox: "/b".into(),
            rounds: 1,
            warmup: 0,
            memory_mib: 256,
            vcpus: 2,
            cmdline: "console=ttyS0".into(),
            qemu_append: "tsc=reliable".into(),
            qemu_cid: 42,
            parts: vec![Part::Boot, Part::Restore],
            dir: std::env::temp_dir(),
            boot_timeout: Duration::from_secs(1),
            keep_consoles: None,
        }
    }

    #[test]
    fn qemu_gets_the_same_machine() {
        let args = qemu_args(&config(), Path::new("/k"), Path::new("/i"));
        let joined = args.join(" ");
        assert!(joined.contains("-accel kvm -M microvm -cpu host -m 256M -smp 2"));
        assert!(joined.contains("-kernel /k -initrd /i"));
        assert!(joined.contains("-device vhost-vsock-device,guest-cid=42"));
        let append = args
            .iter()
            .position(|a| a == "-append")
            .map(|i| args[i + 1].clone());
        assert_eq!(append.as_deref(), Some("console=ttyS0 tsc=reliable"));
    }

    #[test]
    fn bad_input_names_the_file() {
        let mut c = config();
        let err = run(&c).expect_err("bad input").to_string();
        assert!(err.contains("--kernel or --fixtures"), "{err}");
        c.fixtures = Some("/nonexistent/fixtures.env".into());
        let err = run(&c).expect_err("bad input").to_string();
        assert!(err.contains("/nonexistent/fixtures.env"), "{err}");
        let dir = tempdir();
        let env = dir.join("fixtures.env");
        std::fs::write(&env, "OUR_VMLINUX=/nonexistent/vmlinux\n").expect("temp dir");
        c.fixtures = Some(env.clone());
        let err = run(&c).expect_err("bad input").to_string();
        assert!(err.contains("/nonexistent/vmlinux"), "{err}");
        c.kernel = Some(env.clone());
        let err = run(&c).expect_err("bad input").to_string();
        assert!(err.contains("/nonexistent/rollbox-vmm"), "{err}");
        c.vmm = env.clone();
        c.parts = vec![Part::Restore];
        let err = run(&c).expect_err("bad input").to_string();
        assert!(err.contains("BUSYBOX_ROOTFS"), "{err}");
        std::fs::remove_dir_all(&dir).expect("temp dir");
    }

    fn tempdir() -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("rollbox-bench-linux-test.{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        dir
    }
}
