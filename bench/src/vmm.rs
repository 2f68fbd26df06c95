//! `rollbox-bench vmm`: start-up, memory overhead and exit latency of `rollbox-vmm`,
//! measured with the test guest.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::procfs;
use crate::stats::{summarize, Summary};
use crate::test_guest::TEST_GUEST_CMDLINE;

/// What the guest prints once it is ready for commands.
const READY_LINE: &str = "rollbox-test-guest: ready";
const BOOT_TIMEOUT: Duration = Duration::from_secs(60);
/// Per command; a 100k-iteration exit loop takes a few seconds under the CPL0 emulator.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(300);
const EXIT_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum VmmBenchError {
    #[error("{what} not found at {path} ({hint})")]
    Missing {
        what: &'static str,
        path: PathBuf,
        hint: &'static str,
    },
    #[error("cannot run {program}: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    #[error("{program} failed: {status}")]
    Failed {
        program: String,
        status: std::process::ExitStatus,
    },
    #[error("rep {rep}: {what} did not come within {timeout:?}; guest output so far: {output:?}")]
    Timeout {
        rep: usize,
        what: String,
        timeout: Duration,
        output: String,
    },
    #[error("rep {rep}: rollbox-vmm closed its output while waiting for {what}; stderr: {stderr}")]
    Closed {
        rep: usize,
        what: String,
        stderr: String,
    },
    #[error("rep {rep}: command {command:?} answered {answer:?}")]
    BadAnswer {
        rep: usize,
        command: String,
        answer: String,
    },
    #[error("rep {rep}: writing to rollbox-vmm's stdin: {source}")]
    Write { rep: usize, source: std::io::Error },
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("writing {path}: {source}")]
    WriteJson {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("encoding the JSON report: {0}")]
    Json(#[from] serde_json::Error),
    #[error("{what}: no samples")]
    NoSamples { what: &'static str },
}

/// What to run and how often.
#[derive(Debug, Clone)]
pub struct VmmBenchConfig {
    pub workspace: PathBuf,
    pub vmm: PathBuf,
    pub guest: PathBuf,
    pub reps: usize,
    pub memory_mib: u64,
    pub exit_iterations: u64,
    /// Runs of each exit loop per rep; the fastest counts.
    pub rounds: usize,
    pub build: bool,
}

#[derive(Debug, Serialize)]
pub struct VmmReport {
    pub vmm: String,
    pub guest: String,
    pub reps: usize,
    pub memory_mib: u64,
    pub exit_iterations: u64,
    pub rounds_per_rep: usize,
    /// Process spawn to the first byte of guest serial output on the stdout pipe.
    pub spawn_to_first_byte_ms: Summary,
    /// Spawn to the whole `ready` line.
    pub spawn_to_ready_ms: Summary,
    /// VmRSS minus the Rss of the guest-memory mapping, after `ready`.
    pub vmm_rss_beyond_guest_kib: Option<Summary>,
    /// VmRSS itself, after `ready`.
    pub vm_rss_kib: Summary,
    /// (time of `bench-pio N` - time of `bench-loop N`) / N, each time the fastest of
    /// the rep's rounds.
    pub pio_exit_us: Summary,
    /// (time of `bench-mmio N` - time of `bench-loop N`) / N.
    pub mmio_exit_us: Summary,
    /// time of `bench-loop N` / N: one iteration of the empty loop, emulated.
    pub empty_loop_iteration_us: Summary,
}

/// One rep's raw figures.
struct RepFigures {
    first_byte: Duration,
    ready: Duration,
    vm_rss_kib: u64,
    guest_rss_kib: Option<u64>,
    pio: Duration,
    mmio: Duration,
    empty: Duration,
}

pub fn run(config: &VmmBenchConfig) -> Result<VmmReport, VmmBenchError> {
    prepare(config)?;
    let mut reps = Vec::with_capacity(config.reps);
    for rep in 0..config.reps {
        let figures = run_rep(config, rep)?;
        eprintln!(
            "rep {}/{}: first byte {:.2} ms, pio {:.2} µs, mmio {:.2} µs",
            rep + 1,
            config.reps,
            ms(figures.first_byte),
            per_exit_us(figures.pio, figures.empty, config.exit_iterations),
            per_exit_us(figures.mmio, figures.empty, config.exit_iterations),
        );
        reps.push(figures);
    }
    let n = config.exit_iterations;
    let summary = |what: &'static str, values: Vec<f64>| {
        summarize(&values).ok_or(VmmBenchError::NoSamples { what })
    };
    let beyond: Vec<f64> = reps
        .iter()
        .filter_map(|r| {
            r.guest_rss_kib
                .map(|g| r.vm_rss_kib.saturating_sub(g) as f64)
        })
        .collect();
    Ok(VmmReport {
        vmm: config.vmm.display().to_string(),
        guest: config.guest.display().to_string(),
        reps: config.reps,
        memory_mib: config.memory_mib,
        exit_iterations: n,
        rounds_per_rep: config.rounds,
        spawn_to_first_byte_ms: summary(
            "spawn to first byte",
            reps.iter().map(|r| ms(r.first_byte)).collect(),
        )?,
        spawn_to_ready_ms: summary("spawn to ready", reps.iter().map(|r| ms(r.ready)).collect())?,
        vmm_rss_beyond_guest_kib: summarize(&beyond),
        vm_rss_kib: summary("VmRSS", reps.iter().map(|r| r.vm_rss_kib as f64).collect())?,
        pio_exit_us: summary(
            "pio exit",
            reps.iter()
                .map(|r| per_exit_us(r.pio, r.empty, n))
                .collect(),
        )?,
        mmio_exit_us: summary(
            "mmio exit",
            reps.iter()
                .map(|r| per_exit_us(r.mmio, r.empty, n))
                .collect(),
        )?,
        empty_loop_iteration_us: summary(
            "empty loop",
            reps.iter()
                .map(|r| r.empty.as_secs_f64() * 1e6 / n.max(1) as f64)
                .collect(),
        )?,
    })
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Microseconds per exit: the loop with exits minus the empty loop, over `n`.
pub fn per_exit_us(with_exit: Duration, empty: Duration, n: u64) -> f64 {
    (with_exit.as_secs_f64() - empty.as_secs_f64()) * 1e6 / n.max(1) as f64
}

/// Builds what `--build` asks for, and the test guest when it is missing.
fn prepare(config: &VmmBenchConfig) -> Result<(), VmmBenchError> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    if config.build {
        run_tool(
            &config.workspace,
            &cargo,
            &["build", "--release", "-p", "vmm"],
        )?;
    }
    if config.build || !config.guest.exists() {
        run_tool(&config.workspace, &cargo, &["xtask", "test-guest"])?;
    }
    if !config.vmm.exists() {
        return Err(VmmBenchError::Missing {
            what: "rollbox-vmm",
            path: config.vmm.clone(),
            hint: "run `cargo build --release -p vmm`, or pass --build or --vmm PATH",
        });
    }
    if !config.guest.exists() {
        return Err(VmmBenchError::Missing {
            what: "test guest",
            path: config.guest.clone(),
            hint: "run `cargo xtask test-guest`",
        });
    }
    Ok(())
}

fn run_tool(dir: &Path, program: &str, args: &[&str]) -> Result<(), VmmBenchError> {
    let label = format!("{program} {}", args.join(" "));
    eprintln!("running {label}");
    let status = Command::new(program)
        .args(args)
        .current_dir(dir)
        .status()
        .map_err(|source| VmmBenchError::Spawn {
            program: label.clone(),
            source,
        })?;
    if status.success() {
        Ok(())
    } else {
        Err(VmmBenchError::Failed {
            program: label,
            status,
        })
    }
}

/// A running rollbox-vmm with the test guest, its serial console on a pipe.
struct Guest {
    child: Child,
    stdin: Option<ChildStdin>,
    chunks: Receiver<(Instant, Vec<u8>)>,
    stderr: Receiver<String>,
    pending: Vec<u8>,
    rep: usize,
    seen: String,
}

impl Guest {
    /// Waits for the next full line; returns it with the time its last byte arrived.
    fn line(&mut self, what: &str, timeout: Duration) -> Result<(String, Instant), VmmBenchError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(at) = self.pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.pending.drain(..=at).collect();
                let text = String::from_utf8_lossy(&line).trim_end().to_string();
                return Ok((text, Instant::now()));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.chunks.recv_timeout(left) {
                Ok((when, bytes)) => {
                    self.seen.push_str(&String::from_utf8_lossy(&bytes));
                    self.pending.extend_from_slice(&bytes);
                    if let Some(at) = self.pending.iter().position(|&b| b == b'\n') {
                        let line: Vec<u8> = self.pending.drain(..=at).collect();
                        let text = String::from_utf8_lossy(&line).trim_end().to_string();
                        return Ok((text, when));
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    return Err(VmmBenchError::Timeout {
                        rep: self.rep,
                        what: what.to_string(),
                        timeout,
                        output: tail(&self.seen),
                    })
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(VmmBenchError::Closed {
                        rep: self.rep,
                        what: what.to_string(),
                        stderr: self.stderr_text(),
                    })
                }
            }
        }
    }

    fn stderr_text(&mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.stderr
            .recv_timeout(Duration::from_secs(2))
            .unwrap_or_default()
    }

    /// Sends `command` and waits for its `OK`; returns the time from the write to the
    /// arrival of the answer.
    fn timed(&mut self, command: &str) -> Result<Duration, VmmBenchError> {
        let start = Instant::now();
        self.send(command)?;
        let (answer, at) = self.line(command, COMMAND_TIMEOUT)?;
        if answer != "OK" {
            return Err(VmmBenchError::BadAnswer {
                rep: self.rep,
                command: command.to_string(),
                answer,
            });
        }
        Ok(at.saturating_duration_since(start))
    }

    fn send(&mut self, command: &str) -> Result<(), VmmBenchError> {
        let rep = self.rep;
        let stdin = self.stdin.as_mut().ok_or_else(|| VmmBenchError::Write {
            rep,
            source: std::io::Error::new(std::io::ErrorKind::BrokenPipe, "stdin closed"),
        })?;
        stdin
            .write_all(format!("{command}\n").as_bytes())
            .and_then(|()| stdin.flush())
            .map_err(|source| VmmBenchError::Write { rep, source })
    }

    /// Powers the guest off and waits for the VMM to exit (kills it after a while).
    fn finish(mut self) {
        let _ = self.send("poweroff");
        self.stdin = None;
        let deadline = Instant::now() + EXIT_TIMEOUT;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        eprintln!(
            "rep {}: rollbox-vmm did not exit after poweroff; killing it",
            self.rep
        );
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn tail(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    chars[chars.len().saturating_sub(400)..].iter().collect()
}

fn run_rep(config: &VmmBenchConfig, rep: usize) -> Result<RepFigures, VmmBenchError> {
    let start = Instant::now();
    let mut child = Command::new(&config.vmm)
        .arg("--kernel")
        .arg(&config.guest)
        .args(["--cmdline", TEST_GUEST_CMDLINE])
        .arg("--memory-mib")
        .arg(config.memory_mib.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| VmmBenchError::Spawn {
            program: config.vmm.display().to_string(),
            source,
        })?;
    let pid = child.id();
    let (chunk_tx, chunks) = channel();
    if let Some(mut stdout) = child.stdout.take() {
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = stdout.read(&mut buf) {
                let when = Instant::now();
                if n == 0 || chunk_tx.send((when, buf[..n].to_vec())).is_err() {
                    break;
                }
            }
        });
    }
    let (err_tx, stderr) = channel();
    if let Some(mut pipe) = child.stderr.take() {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            let _ = err_tx.send(text);
        });
    }
    let mut guest = Guest {
        stdin: child.stdin.take(),
        child,
        chunks,
        stderr,
        pending: Vec::new(),
        rep,
        seen: String::new(),
    };

    let (first_when, first_bytes) = match guest.chunks.recv_timeout(BOOT_TIMEOUT) {
        Ok(chunk) => chunk,
        Err(RecvTimeoutError::Timeout) => {
            return Err(VmmBenchError::Timeout {
                rep,
                what: "the first serial byte".into(),
                timeout: BOOT_TIMEOUT,
                output: String::new(),
            })
        }
        Err(RecvTimeoutError::Disconnected) => {
            return Err(VmmBenchError::Closed {
                rep,
                what: "the first serial byte".into(),
                stderr: guest.stderr_text(),
            })
        }
    };
    guest.seen.push_str(&String::from_utf8_lossy(&first_bytes));
    guest.pending.extend_from_slice(&first_bytes);
    let first_byte = first_when.saturating_duration_since(start);
    let ready_at = loop {
        let (line, at) = guest.line("the ready line", BOOT_TIMEOUT)?;
        if line == READY_LINE {
            break at;
        }
    };
    let ready = ready_at.saturating_duration_since(start);

    let smaps_path = PathBuf::from(format!("/proc/{pid}/smaps"));
    let status_path = PathBuf::from(format!("/proc/{pid}/status"));
    let smaps = std::fs::read_to_string(&smaps_path).map_err(|source| VmmBenchError::Read {
        path: smaps_path,
        source,
    })?;
    let status = std::fs::read_to_string(&status_path).map_err(|source| VmmBenchError::Read {
        path: status_path.clone(),
        source,
    })?;
    let vm_rss_kib = procfs::vm_rss_kib(&status).ok_or_else(|| VmmBenchError::Read {
        path: status_path,
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, "no VmRSS line"),
    })?;
    let guest_rss_kib =
        procfs::guest_memory_rss_kib(&procfs::parse_smaps(&smaps), config.memory_mib << 20);
    if guest_rss_kib.is_none() && rep == 0 {
        eprintln!(
            "no anonymous mapping of exactly {} MiB in smaps: the overhead figure is left out",
            config.memory_mib
        );
    }

    // Each loop runs `rounds` times, interleaved, and the fastest run counts: other load
    // on the host only ever adds time.
    let n = config.exit_iterations;
    let (mut empty, mut pio, mut mmio) = (Duration::MAX, Duration::MAX, Duration::MAX);
    for _ in 0..config.rounds.max(1) {
        empty = empty.min(guest.timed(&format!("bench-loop {n}"))?);
        pio = pio.min(guest.timed(&format!("bench-pio {n}"))?);
        mmio = mmio.min(guest.timed(&format!("bench-mmio {n}"))?);
    }
    guest.finish();
    Ok(RepFigures {
        first_byte,
        ready,
        vm_rss_kib,
        guest_rss_kib,
        pio,
        mmio,
        empty,
    })
}

/// The report as a small markdown table.
pub fn markdown(report: &VmmReport) -> String {
    let mut out = format!(
        "rollbox-vmm: {} reps, {} MiB guest, {} exits per loop, fastest of {} rounds\n\n\
         | figure | p50 | p90 | min | unit |\n| --- | ---: | ---: | ---: | --- |\n",
        report.reps, report.memory_mib, report.exit_iterations, report.rounds_per_rep
    );
    let mut row = |name: &str, s: Option<&Summary>, unit: &str, digits: usize| match s {
        Some(s) => out.push_str(&format!(
            "| {name} | {:.digits$} | {:.digits$} | {:.digits$} | {unit} |\n",
            s.p50, s.p90, s.min
        )),
        None => out.push_str(&format!("| {name} | n/a | n/a | n/a | {unit} |\n")),
    };
    row(
        "spawn → first serial byte",
        Some(&report.spawn_to_first_byte_ms),
        "ms",
        2,
    );
    row(
        "spawn → ready line",
        Some(&report.spawn_to_ready_ms),
        "ms",
        2,
    );
    row(
        "VMM RSS beyond guest memory",
        report.vmm_rss_beyond_guest_kib.as_ref(),
        "KiB",
        0,
    );
    row("VmRSS after ready", Some(&report.vm_rss_kib), "KiB", 0);
    row(
        "port I/O exit round trip",
        Some(&report.pio_exit_us),
        "µs",
        2,
    );
    row("MMIO exit round trip", Some(&report.mmio_exit_us), "µs", 2);
    row(
        "empty loop iteration (emulated)",
        Some(&report.empty_loop_iteration_us),
        "µs",
        3,
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_exit_subtracts_the_loop() {
        let us = per_exit_us(Duration::from_millis(300), Duration::from_millis(100), 1000);
        assert!((us - 200.0).abs() < 1e-9);
        // n = 0 does not divide by zero.
        assert!(per_exit_us(Duration::from_millis(1), Duration::ZERO, 0).is_finite());
    }
}
