//! `rollbox-bench snapshot-move`: a snapshot moved between two `rollbox serve`s on this host
//! (`GET /snapshots/{id}/export` to a file, `POST /snapshots/import` of it), against a plain
//! `cp --sparse=always` of the snapshot's files as the baseline. The test guest writes
//! `--touch-mib` MiB of its `--memory-mib` before the snapshot (data that must cross; the
//! rest of the memory file is holes), and each round's restore on the second daemon checks
//! those pages (`clone-check`). Figures only.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Value};

use crate::daemon::{ms, start, summary, Daemon, DaemonBenchConfig, DaemonBenchError};
use crate::stats::Summary;
use crate::test_guest::TEST_GUEST_CMDLINE;

/// What to run.
pub struct MoveBenchConfig {
    pub rollbox: PathBuf,
    pub vmm: PathBuf,
    pub guest: PathBuf,
    pub dir: PathBuf,
    pub memory_mib: u64,
    pub touch_mib: u64,
    pub rounds: usize,
}

#[derive(Debug, Serialize)]
pub struct MoveReport {
    pub memory_mib: u64,
    pub touch_mib: u64,
    /// The snapshot's files: their sizes with holes, and the data the archive carries.
    pub snapshot_bytes: u64,
    pub archive_bytes: u64,
    pub export_ms: Summary,
    pub import_ms: Summary,
    /// `cp --sparse=always` of the snapshot's files, the baseline.
    pub copy_ms: Summary,
    /// Export then import, MiB of archive per second (p50 of each).
    pub export_mib_s: f64,
    pub import_mib_s: f64,
    pub copy_mib_s: f64,
    /// A create from the imported snapshot on the second daemon (a restore).
    pub restore_ms: Summary,
}

fn failed(what: &str, message: impl std::fmt::Display) -> DaemonBenchError {
    DaemonBenchError::Request {
        what: what.to_string(),
        message: message.to_string(),
    }
}

fn console(sandbox: &Value) -> String {
    let dir = sandbox["dir"].as_str().unwrap_or_default();
    std::fs::read_to_string(Path::new(dir).join("console.log")).unwrap_or_default()
}

fn wait_console(sandbox: &Value, want: &str, what: &str) -> Result<String, DaemonBenchError> {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let text = console(sandbox);
        // The whole line: the guest writes its answer a few bytes at a time.
        if text.find(want).is_some_and(|at| text[at..].contains('\n')) {
            return Ok(text);
        }
        if Instant::now() > deadline {
            return Err(failed(what, format!("no {want:?} on the console: {text}")));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The sizes of a directory's files (holes included).
fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

fn mib_per_s(bytes: u64, ms: f64) -> f64 {
    (bytes as f64 / (1 << 20) as f64) / (ms / 1000.0).max(1e-9)
}

pub fn run(config: &MoveBenchConfig) -> Result<MoveReport, DaemonBenchError> {
    let daemon_at = |name: &str| {
        let mut daemon = DaemonBenchConfig::for_other_bench(
            config.rollbox.clone(),
            config.vmm.clone(),
            config.guest.clone(),
            config.dir.join(name),
            None,
        );
        daemon.memory_mib = config.memory_mib;
        daemon
    };
    let (a, b): (Daemon, Daemon) = (start(&daemon_at("a"))?, start(&daemon_at("b"))?);
    let run = format!(
        "{TEST_GUEST_CMDLINE} rollbox.test.run=touch:{0}:7;clone-check:{0}:7",
        config.touch_mib
    );
    let template = json!({"name": "guest", "kernel": config.guest, "cmdline": run, "memory_mib": config.memory_mib});
    a.expect("POST", "/templates", Some(template.clone()), 201)?;
    b.expect("POST", "/templates", Some(template), 201)?;
    let parent = a.expect(
        "POST",
        "/sandboxes",
        Some(json!({"template": "guest", "ttl_s": 3600})),
        201,
    )?;
    let pages = config.touch_mib * 256;
    wait_console(&parent, &format!("OK {pages}\n"), "the pages written")?;
    let parent_id = parent["id"].as_str().unwrap_or_default();
    let snap = a.expect(
        "POST",
        &format!("/sandboxes/{parent_id}/snapshots"),
        None,
        201,
    )?;
    let snap_id = snap["id"].as_str().unwrap_or_default().to_string();
    let snap_dir = PathBuf::from(snap["dir"].as_str().unwrap_or_default());
    let scratch = config
        .dir
        .join(format!("rollbox-bench-move-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).map_err(|e| failed("scratch", e))?;
    let archive = scratch.join("snapshot.tar");
    let (mut exports, mut imports, mut copies, mut restores) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut archive_bytes = 0;
    for round in 0..config.rounds.max(1) {
        eprintln!("snapshot-move: round {}", round + 1);
        // Baseline: the snapshot's files copied as they are, holes kept.
        let copy_to = scratch.join("copy");
        let _ = std::fs::remove_dir_all(&copy_to);
        let started = Instant::now();
        let copied = Command::new("cp")
            .args(["-r", "--sparse=always"])
            .arg(&snap_dir)
            .arg(&copy_to)
            .status()
            .map_err(|e| failed("cp", e))?;
        if !copied.success() {
            return Err(failed("cp", copied));
        }
        copies.push(ms(started));

        let started = Instant::now();
        let mut response = a.open("GET", &format!("/snapshots/{snap_id}/export"), None)?;
        let mut file = std::fs::File::create(&archive).map_err(|e| failed("archive", e))?;
        archive_bytes = std::io::copy(&mut response, &mut file).map_err(|e| failed("export", e))?;
        file.flush().map_err(|e| failed("archive", e))?;
        exports.push(ms(started));

        let started = Instant::now();
        let mut body = std::fs::File::open(&archive).map_err(|e| failed("archive", e))?;
        let answer = b
            .open(
                "POST",
                "/snapshots/import",
                Some((&mut body, archive_bytes)),
            )?
            .into_response()
            .map_err(|e| failed("import", e))?;
        if answer.status != 201 {
            return Err(failed(
                "import",
                format!(
                    "{}: {}",
                    answer.status,
                    String::from_utf8_lossy(&answer.body)
                ),
            ));
        }
        imports.push(ms(started));

        let started = Instant::now();
        let restored = b.expect(
            "POST",
            "/sandboxes",
            Some(json!({"snapshot": snap_id, "ttl_s": 600})),
            201,
        )?;
        restores.push(ms(started));
        let text = wait_console(&restored, "clone OK", "the restored guest's check")?;
        if !text.contains("clone OK 0\n") {
            return Err(failed("the restored guest's check", format!("{text:?}")));
        }
        let id = restored["id"].as_str().unwrap_or_default();
        b.expect("DELETE", &format!("/sandboxes/{id}"), None, 204)?;
        b.expect("DELETE", &format!("/snapshots/{snap_id}"), None, 204)?;
    }
    let _ = std::fs::remove_dir_all(&scratch);
    let (export_ms, import_ms, copy_ms) = (
        summary(&exports, "exports")?,
        summary(&imports, "imports")?,
        summary(&copies, "copies")?,
    );
    let snapshot_bytes = dir_bytes(&snap_dir);
    Ok(MoveReport {
        memory_mib: config.memory_mib,
        touch_mib: config.touch_mib,
        snapshot_bytes,
        archive_bytes,
        export_mib_s: mib_per_s(archive_bytes, export_ms.p50),
        import_mib_s: mib_per_s(archive_bytes, import_ms.p50),
        copy_mib_s: mib_per_s(archive_bytes, copy_ms.p50),
        export_ms,
        import_ms,
        copy_ms,
        restore_ms: summary(&restores, "restores")?,
    })
}

pub fn markdown(report: &MoveReport) -> String {
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    format!(
        "snapshot move: {} MiB guest, {} MiB written; files {:.0} MiB with holes, archive {:.1} MiB\n\n\
         | step | p50 ms | min ms | max ms | MiB/s (p50) |\n| --- | --- | --- | --- | --- |\n\
         | export (GET .../export to a file) | {:.0} | {:.0} | {:.0} | {:.0} |\n\
         | import (POST /snapshots/import) | {:.0} | {:.0} | {:.0} | {:.0} |\n\
         | baseline: cp --sparse=always | {:.0} | {:.0} | {:.0} | {:.0} |\n\
         | restore on the other daemon | {:.1} | {:.1} | {:.1} | |\n",
        report.memory_mib,
        report.touch_mib,
        mib(report.snapshot_bytes),
        mib(report.archive_bytes),
        report.export_ms.p50,
        report.export_ms.min,
        report.export_ms.max,
        report.export_mib_s,
        report.import_ms.p50,
        report.import_ms.min,
        report.import_ms.max,
        report.import_mib_s,
        report.copy_ms.p50,
        report.copy_ms.min,
        report.copy_ms.max,
        report.copy_mib_s,
        report.restore_ms.p50,
        report.restore_ms.min,
        report.restore_ms.max,
    )
}
