//! `rollbox-bench snapshot`: snapshot and restore figures of rollbox-vmm with the test guest.
//! Only rollbox-vmm's own figures from this run: no other VMM runs here, so nothing is
//! compared and no ratio is printed.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use serde::Serialize;
use vmm_api::{CreateSnapshotParams, LoadSnapshotParams, MemBackend};

use crate::stats::{summarize, Summary};
use crate::test_guest::TEST_GUEST_CMDLINE;

/// Errors that stop the benchmark (never a slow figure).
#[derive(Debug, thiserror::Error)]
pub enum SnapshotBenchError {
    /// A process could not start.
    #[error("cannot start {what}: {source}")]
    Spawn {
        /// What.
        what: String,
        /// Why.
        source: std::io::Error,
    },
    /// The guest or VMM did not answer.
    #[error("{0}")]
    Guest(String),
    /// An API call failed (the error names the socket and the call).
    #[error(transparent)]
    Api(#[from] vmm_api::ClientError),
    /// A file could not be written.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// Settings.
#[derive(Debug, Clone)]
pub struct SnapshotBenchConfig {
    /// rollbox-vmm.
    pub vmm: PathBuf,
    /// The test guest.
    pub guest: PathBuf,
    /// Guest sizes in MiB.
    pub sizes: Vec<u64>,
    /// Repetitions per figure.
    pub reps: usize,
    /// Where snapshots go (a tmpfs such as /dev/shm keeps the disk out of the figures).
    pub dir: PathBuf,
    /// Clones in the fan-out figure.
    pub fanout: usize,
    /// Working set the guest touches, in MiB.
    pub working_set_mib: u64,
    /// The guest halts between commands (test guest `idle`) instead of busy-polling its
    /// serial port, as Linux does; every clone inherits it.
    pub idle_guest: bool,
}

/// Figures for one guest size.
#[derive(Debug, Clone, Serialize)]
pub struct SizeReport {
    /// Guest memory.
    pub mem_mib: u64,
    /// Full snapshot of a running VM (API call), ms.
    pub snapshot_full_ms: Option<Summary>,
    /// Diff snapshot after the guest dirtied 4 MiB, ms.
    pub snapshot_diff_ms: Option<Summary>,
    /// Process start → first serial byte after restore, per backend, ms.
    pub restore_cow_ms: Option<Summary>,
    /// Same, uffd.
    pub restore_uffd_ms: Option<Summary>,
    /// Into a pre-built VM shell: the `PUT /snapshot/load` call, ms.
    pub shell_load_call_ms: Option<Summary>,
    /// Into a pre-built VM shell: load call sent -> first serial byte, ms.
    pub shell_load_to_first_byte_ms: Option<Summary>,
    /// Same, copy.
    pub restore_copy_ms: Option<Summary>,
    /// Process start → guest has read its whole working set, uffd without prefetch, ms.
    pub working_set_uffd_ms: Option<Summary>,
    /// Same with working-set prefetch.
    pub working_set_uffd_prefetch_ms: Option<Summary>,
    /// Same with cow, for reference.
    pub working_set_cow_ms: Option<Summary>,
    /// Fan-out: wall time until every clone answered, ms.
    pub fanout_wall_ms: Option<f64>,
    /// Fan-out: total PSS of all clone processes, MiB.
    pub fanout_total_pss_mib: Option<f64>,
    /// A fork's snapshot (`"rollbox": {"resume_vm": true}`): the call, until the memory
    /// file is written, ms.
    pub resuming_snapshot_ms: Option<Summary>,
    /// Same: how long the VM was paused (the pause call, then the VMM's answer's figure from
    /// the snapshot request until the VM ran again), ms.
    pub resuming_snapshot_paused_ms: Option<Summary>,
}

fn spawn_err(what: &str) -> impl FnOnce(std::io::Error) -> SnapshotBenchError + '_ {
    move |source| SnapshotBenchError::Spawn {
        what: what.to_string(),
        source,
    }
}

/// A VMM whose console lines arrive with timestamps.
struct Vm {
    child: Child,
    lines: Receiver<(Instant, String)>,
    first_byte: Receiver<Instant>,
}

impl Vm {
    fn spawn(
        vmm: &Path,
        args: &[String],
        input: &str,
    ) -> Result<(Vm, Instant), SnapshotBenchError> {
        let started = Instant::now();
        let mut child = Command::new(vmm)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(spawn_err("rollbox-vmm"))?;
        if let Some(stdin) = child.stdin.as_mut() {
            let _ = stdin.write_all(input.as_bytes());
        }
        let mut stdout = child
            .stdout
            .take()
            .ok_or_else(|| SnapshotBenchError::Guest("no stdout".into()))?;
        let (tx, rx) = channel();
        let (first_tx, first_rx) = channel();
        std::thread::spawn(move || {
            let mut first = [0u8; 1];
            if stdout.read(&mut first).unwrap_or(0) == 0 {
                return;
            }
            let _ = first_tx.send(Instant::now());
            let mut reader = BufReader::new(stdout);
            let mut line = String::from_utf8_lossy(&first).to_string();
            loop {
                let mut rest = String::new();
                if reader.read_line(&mut rest).unwrap_or(0) == 0 {
                    return;
                }
                line.push_str(&rest);
                if tx
                    .send((Instant::now(), line.trim_end().to_string()))
                    .is_err()
                {
                    return;
                }
                line.clear();
            }
        });
        Ok((
            Vm {
                child,
                lines: rx,
                first_byte: first_rx,
            },
            started,
        ))
    }

    fn send(&mut self, text: &str) {
        if let Some(stdin) = self.child.stdin.as_mut() {
            let _ = stdin.write_all(text.as_bytes());
            let _ = stdin.flush();
        }
    }

    fn wait_line(
        &self,
        prefix: &str,
        timeout: Duration,
    ) -> Result<(Instant, String), SnapshotBenchError> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let (at, line) = self.lines.recv_timeout(left).map_err(|_| {
                SnapshotBenchError::Guest(format!("no line starting {prefix:?} within {timeout:?}"))
            })?;
            if line.starts_with(prefix) {
                return Ok((at, line));
            }
        }
    }

    fn stop(mut self) {
        // SAFETY: sends SIGTERM to our own child; a clean exit saves uffd working sets.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

/// The client of the VMM API socket at `sock`; a call may take up to 10 minutes (a snapshot
/// of a large guest on a slow host).
fn api(sock: &Path) -> vmm_api::Client {
    vmm_api::Client::new(sock).with_timeout(Duration::from_secs(600))
}

fn wait_socket(path: &Path) -> Result<(), SnapshotBenchError> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while UnixStream::connect(path).is_err() {
        if Instant::now() > deadline {
            return Err(SnapshotBenchError::Guest(format!(
                "{} never came up",
                path.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn snapshot_call(sock: &Path, kind: &str, dir: &Path) -> Result<f64, SnapshotBenchError> {
    std::fs::create_dir_all(dir).map_err(|source| SnapshotBenchError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let api = api(sock);
    api.pause()?;
    let params = CreateSnapshotParams {
        snapshot_type: kind.into(),
        snapshot_path: dir.join("vmstate"),
        mem_file_path: dir.join("memory"),
        version: None,
        rollbox: None,
    };
    let started = Instant::now();
    api.create_snapshot(&params)?;
    let elapsed = ms(started.elapsed());
    api.resume()?;
    Ok(elapsed)
}

/// A fork's snapshot into `dir`: paused, then `PUT /snapshot/create` with `resume_vm`, which
/// answers once the memory file is written. Returns (the create call, the pause), ms: the
/// pause is the pause call plus the answer's `paused_ms`.
fn resuming_snapshot_call(sock: &Path, dir: &Path) -> Result<(f64, f64), SnapshotBenchError> {
    std::fs::create_dir_all(dir).map_err(|source| SnapshotBenchError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let api = api(sock);
    let pausing = Instant::now();
    api.pause()?;
    let pause_call = ms(pausing.elapsed());
    let params = CreateSnapshotParams {
        snapshot_type: "Full".into(),
        snapshot_path: dir.join("vmstate"),
        mem_file_path: dir.join("memory"),
        version: None,
        rollbox: None,
    };
    let started = Instant::now();
    let resumed = api.create_snapshot_resuming(&params)?;
    Ok((ms(started.elapsed()), pause_call + resumed.paused_ms))
}

fn pss_kib(pid: u32) -> Option<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    text.lines()
        .find(|l| l.starts_with("Pss:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<f64>().ok())
}

fn restore_args(dir: &Path, backend: &str, extra: &[&str]) -> Vec<String> {
    let mut args = vec![
        "--restore".to_string(),
        dir.display().to_string(),
        "--restore-backend".into(),
        backend.into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// Runs every figure for one guest size.
fn run_size(config: &SnapshotBenchConfig, mem_mib: u64) -> Result<SizeReport, SnapshotBenchError> {
    let base = config.dir.join(format!("m{mem_mib}"));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).map_err(|source| SnapshotBenchError::Io {
        path: base.clone(),
        source,
    })?;
    let sock = base.join("api.sock");
    let ws = config
        .working_set_mib
        .min(mem_mib.saturating_sub(40))
        .max(1);
    let args: Vec<String> = [
        "--kernel",
        &config.guest.display().to_string(),
        "--cmdline",
        TEST_GUEST_CMDLINE,
        "--memory-mib",
        &mem_mib.to_string(),
        "--api-sock",
        &sock.display().to_string(),
        "--track-dirty-pages",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let (parent, _) = Vm::spawn(&config.vmm, &args, "")?;
    parent.wait_line("rollbox-test-guest: ready", Duration::from_secs(30))?;
    wait_socket(&sock)?;
    let mut parent = parent;
    if config.idle_guest {
        parent.send("idle\n");
        parent.wait_line("OK", Duration::from_secs(30))?;
    }
    parent.send(&format!("touch {ws} 11\n"));
    parent.wait_line("OK", Duration::from_secs(300))?;

    let mut full = Vec::new();
    let mut diff = Vec::new();
    for rep in 0..config.reps {
        full.push(snapshot_call(
            &sock,
            "Full",
            &base.join(format!("full{rep}")),
        )?);
        parent.send("touch 4 12\n");
        parent.wait_line("OK", Duration::from_secs(300))?;
        diff.push(snapshot_call(
            &sock,
            "Diff",
            &base.join(format!("diff{rep}")),
        )?);
        let _ = std::fs::remove_dir_all(base.join(format!("diff{rep}")));
        if rep + 1 < config.reps {
            let _ = std::fs::remove_dir_all(base.join(format!("full{rep}")));
        }
    }
    // The snapshot every restore uses: the last full one, whose working set is seed 11
    // except the first 4 MiB (seed 12, written before the Full).
    let snap = base.join("restore-me");
    parent.send("touch 4 11\n");
    parent.wait_line("OK", Duration::from_secs(300))?;
    snapshot_call(&sock, "Full", &snap)?;

    let mut resuming = Vec::new();
    let mut resuming_paused = Vec::new();
    for rep in 0..config.reps.min(5) {
        let dir = base.join(format!("resuming{rep}"));
        let (call, paused) = resuming_snapshot_call(&sock, &dir)?;
        resuming.push(call);
        resuming_paused.push(paused);
        let _ = std::fs::remove_dir_all(&dir);
    }
    parent.stop();

    let restore = |backend: &str| -> Result<Vec<f64>, SnapshotBenchError> {
        let mut out = Vec::new();
        for _ in 0..config.reps {
            let (vm, started) =
                Vm::spawn(&config.vmm, &restore_args(&snap, backend, &[]), "echo r\n")?;
            let first = vm
                .first_byte
                .recv_timeout(Duration::from_secs(30))
                .map_err(|_| {
                    SnapshotBenchError::Guest(format!("{backend} restore printed nothing"))
                })?;
            vm.wait_line("OK r", Duration::from_secs(30))?;
            out.push(ms(first.saturating_duration_since(started)));
            vm.stop();
        }
        Ok(out)
    };
    let restore_cow = restore("cow")?;
    // A pre-built VM shell (what the daemon's warm pool uses): load call -> first serial byte.
    let mut shell_load = Vec::new();
    let mut shell_first = Vec::new();
    for rep in 0..config.reps {
        let shell_sock = base.join(format!("shell{rep}.sock"));
        let args: Vec<String> = [
            "--api-sock",
            &shell_sock.display().to_string(),
            "--shell-memory-mib",
            &mem_mib.to_string(),
            "--track-dirty-pages",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let (vm, _) = Vm::spawn(&config.vmm, &args, "echo r\n")?;
        wait_socket(&shell_sock)?;
        let shell = api(&shell_sock);
        shell.vm_info()?;
        let load = LoadSnapshotParams {
            snapshot_path: snap.join("vmstate"),
            mem_backend: Some(MemBackend {
                backend_type: "File".into(),
                backend_path: snap.join("memory"),
            }),
            mem_file_path: None,
            enable_diff_snapshots: false,
            track_dirty_pages: true,
            resume_vm: true,
            vsock_override: None,
            network_overrides: Vec::new(),
            rollbox: None,
        };
        let started = Instant::now();
        shell.load_snapshot(&load)?;
        shell_load.push(ms(started.elapsed()));
        let first = vm
            .first_byte
            .recv_timeout(Duration::from_secs(30))
            .map_err(|_| SnapshotBenchError::Guest("shell restore printed nothing".into()))?;
        shell_first.push(ms(first.saturating_duration_since(started)));
        vm.stop();
    }
    let restore_uffd = restore("uffd")?;
    let restore_copy = restore("copy")?;

    let check = format!("check {ws} 11\n");
    let working_set = |backend: &str, extra: &[&str]| -> Result<f64, SnapshotBenchError> {
        let (vm, started) = Vm::spawn(&config.vmm, &restore_args(&snap, backend, extra), &check)?;
        let (at, line) = vm.wait_line("OK", Duration::from_secs(600))?;
        if line != "OK 0" {
            return Err(SnapshotBenchError::Guest(format!(
                "restored guest's memory check answered {line:?}"
            )));
        }
        vm.stop();
        Ok(ms(at.saturating_duration_since(started)))
    };
    let mut ws_uffd = Vec::new();
    let mut ws_prefetch = Vec::new();
    let mut ws_cow = Vec::new();
    for _ in 0..config.reps.min(5) {
        ws_uffd.push(working_set("uffd", &["--record-working-set"])?);
        ws_prefetch.push(working_set("uffd", &["--prefetch"])?);
        ws_cow.push(working_set("cow", &[])?);
    }

    // Fan-out: all clones at once from one snapshot, each checks its working set.
    let started = Instant::now();
    let mut clones = Vec::new();
    for _ in 0..config.fanout {
        clones.push(Vm::spawn(&config.vmm, &restore_args(&snap, "cow", &[]), &check)?.0);
    }
    for clone in &clones {
        let (_, line) = clone.wait_line("OK", Duration::from_secs(900))?;
        if line != "OK 0" {
            return Err(SnapshotBenchError::Guest(format!(
                "a clone's memory check answered {line:?}"
            )));
        }
    }
    let fanout_wall = ms(started.elapsed());
    let pss: f64 = clones
        .iter()
        .filter_map(|c| pss_kib(c.child.id()))
        .sum::<f64>()
        / 1024.0;
    for clone in clones {
        clone.stop();
    }
    let _ = std::fs::remove_dir_all(&base);
    Ok(SizeReport {
        mem_mib,
        snapshot_full_ms: summarize(&full),
        snapshot_diff_ms: summarize(&diff),
        restore_cow_ms: summarize(&restore_cow),
        shell_load_call_ms: summarize(&shell_load),
        shell_load_to_first_byte_ms: summarize(&shell_first),
        restore_uffd_ms: summarize(&restore_uffd),
        restore_copy_ms: summarize(&restore_copy),
        working_set_uffd_ms: summarize(&ws_uffd),
        working_set_uffd_prefetch_ms: summarize(&ws_prefetch),
        working_set_cow_ms: summarize(&ws_cow),
        fanout_wall_ms: Some(fanout_wall),
        fanout_total_pss_mib: Some(pss),
        resuming_snapshot_ms: summarize(&resuming),
        resuming_snapshot_paused_ms: summarize(&resuming_paused),
    })
}

/// Runs the benchmark for every size.
pub fn run(config: &SnapshotBenchConfig) -> Result<Vec<SizeReport>, SnapshotBenchError> {
    config
        .sizes
        .iter()
        .map(|&mib| run_size(config, mib))
        .collect()
}

fn cell(s: &Option<Summary>) -> String {
    s.as_ref().map_or("n/a".into(), |s| {
        format!("{:.2} / {:.2} / {:.2}", s.p50, s.p90, s.min)
    })
}

/// The figures as a markdown table, p50 / p90 / min: rollbox-vmm's own, measured in this run.
/// No other VMM is run here, so there is no comparison column and no ratio.
pub fn markdown(reports: &[SizeReport], config: &SnapshotBenchConfig) -> String {
    let mut out = format!(
        "rollbox-vmm snapshot figures (this run only): {} reps, snapshots on {}, working set {} MiB, fan-out {} clones, guest {}\n\n",
        config.reps,
        config.dir.display(),
        config.working_set_mib,
        config.fanout,
        if config.idle_guest {
            "idle (halts between commands)"
        } else {
            "busy-polling its serial port"
        }
    );
    for r in reports {
        let rows: Vec<(String, String)> = vec![
            ("snapshot, Full, running VM".into(), cell(&r.snapshot_full_ms)),
            (
                "snapshot, Diff (4 MiB dirtied)".into(),
                cell(&r.snapshot_diff_ms),
            ),
            (
                "restore cow: process start -> first serial byte".into(),
                cell(&r.restore_cow_ms),
            ),
            (
                "restore into a pre-built VM (cow): load call".into(),
                cell(&r.shell_load_call_ms),
            ),
            (
                "restore into a pre-built VM (cow): load sent -> first serial byte".into(),
                cell(&r.shell_load_to_first_byte_ms),
            ),
            (
                "restore uffd: process start -> first serial byte".into(),
                cell(&r.restore_uffd_ms),
            ),
            (
                "restore copy: process start -> first serial byte".into(),
                cell(&r.restore_copy_ms),
            ),
            (
                "working set read after restore, uffd".into(),
                cell(&r.working_set_uffd_ms),
            ),
            (
                "working set read after restore, uffd + prefetch".into(),
                cell(&r.working_set_uffd_prefetch_ms),
            ),
            (
                "working set read after restore, cow".into(),
                cell(&r.working_set_cow_ms),
            ),
            (
                "fork's snapshot (resume_vm; until the memory is written)".into(),
                cell(&r.resuming_snapshot_ms),
            ),
            (
                "fork's snapshot: VM paused".into(),
                cell(&r.resuming_snapshot_paused_ms),
            ),
            (
                format!(
                    "fan-out {} clones, cow: wall until all answered",
                    config.fanout
                ),
                format!("{:.1}", r.fanout_wall_ms.unwrap_or(f64::NAN)),
            ),
            (
                format!("fan-out {} clones: total PSS (MiB)", config.fanout),
                format!("{:.1}", r.fanout_total_pss_mib.unwrap_or(f64::NAN)),
            ),
            (
                format!(
                    "private copies for comparison: {} x guest memory (MiB; computed, not measured)",
                    config.fanout
                ),
                format!("{}", config.fanout as u64 * r.mem_mib),
            ),
        ];
        out.push_str(&format!(
            "### {} MiB guest\n\n| figure (ms unless named, p50 / p90 / min) | rollbox-vmm |\n|---|---|\n",
            r.mem_mib
        ));
        for (figure, ours) in rows {
            out.push_str(&format!("| {figure} | {ours} |\n"));
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_has_every_figure_and_only_this_runs_figures() {
        let one = summarize(&[2.0, 3.0, 4.0]);
        let report = SizeReport {
            mem_mib: 256,
            snapshot_full_ms: one.clone(),
            snapshot_diff_ms: None,
            restore_cow_ms: one.clone(),
            restore_uffd_ms: None,
            shell_load_call_ms: None,
            shell_load_to_first_byte_ms: None,
            restore_copy_ms: None,
            working_set_uffd_ms: None,
            working_set_uffd_prefetch_ms: None,
            working_set_cow_ms: None,
            fanout_wall_ms: Some(1.0),
            fanout_total_pss_mib: Some(2.0),
            resuming_snapshot_ms: None,
            resuming_snapshot_paused_ms: None,
        };
        let config = SnapshotBenchConfig {
            vmm: PathBuf::new(),
            guest: PathBuf::new(),
            sizes: vec![256],
            reps: 3,
            dir: PathBuf::from("/dev/shm/x"),
            fanout: 10,
            working_set_mib: 32,
            idle_guest: true,
        };
        let table = markdown(&[report], &config);
        assert_eq!(
            table
                .lines()
                .filter(|l| l.starts_with("| ") && !l.starts_with("| figure"))
                .count(),
            15
        );
        assert!(
            table.contains(
                "| restore cow: process start -> first serial byte | 3.00 / 4.00 / 2.00 |"
            ),
            "{table}"
        );
        // Nothing from another harness or run: no other VMM, no ratio.
        for word in ["Firecracker", "faster", "x (", "vs "] {
            assert!(!table.contains(word), "{word:?} in {table}");
        }
        // The private-copies figure is arithmetic and says so.
        assert!(
            table.contains(
                "| private copies for comparison: 10 x guest memory (MiB; computed, not measured) | 2560 |"
            ),
            "{table}"
        );
    }
}
