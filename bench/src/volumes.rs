//! `rollbox-bench volumes`: shared volumes through a real `rollbox serve` with test-guest
//! sandboxes, whose own FUSE client appends the records (`fs-append`). Create latency with one
//! volume against none, and records per second of N writers on one shared volume (forks of
//! sandboxes that mount it, each with its own virtiofsd) against N writers each on a volume of
//! its own. Figures only, never a verdict.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Value};

use crate::daemon::{
    delete, ms, p99, parallel, start, summary, Daemon, DaemonBenchConfig, DaemonBenchError,
};
use crate::stats::Summary;
use crate::test_guest::TEST_GUEST_CMDLINE;

/// Records each writer appends (24 bytes each, to its own file and to the volume's `common`).
const RECORDS: usize = 1000;
/// The most sandboxes one fork makes.
const MAX_FORK: usize = 64;
/// How long the writers may take.
const WRITE_TIMEOUT: Duration = Duration::from_secs(1200);

/// What to run.
pub struct VolumesBenchConfig {
    pub rollbox: PathBuf,
    pub vmm: PathBuf,
    pub guest: PathBuf,
    pub dir: PathBuf,
    /// Creates of the latency figure, with and without a volume each.
    pub creates: usize,
    /// Writer counts (e.g. 64, 256).
    pub writers: Vec<usize>,
    /// `rollbox serve --vmm-start-timeout`.
    pub vmm_start_timeout_s: u64,
}

/// Create latency, booted (a create with a volume boots: a boot snapshot has no volume).
#[derive(Debug, Serialize)]
pub struct CreateFigure {
    pub volume: bool,
    pub create_ms: Summary,
    pub p99_ms: f64,
}

/// N writers appending RECORDS records each.
#[derive(Debug, Serialize)]
pub struct WriteFigure {
    pub writers: usize,
    /// One volume for all (forks), or one each (creates).
    pub shared: bool,
    /// From the first fork or create to the last writer's answer.
    pub seconds: f64,
    pub records_per_s: f64,
}

/// Everything measured.
#[derive(Debug, Serialize)]
pub struct VolumesReport {
    pub creates: Vec<CreateFigure>,
    pub writes: Vec<WriteFigure>,
}

fn daemon_config(config: &VolumesBenchConfig) -> DaemonBenchConfig {
    DaemonBenchConfig::for_other_bench(
        config.rollbox.clone(),
        config.vmm.clone(),
        config.guest.clone(),
        config.dir.clone(),
        Some(config.vmm_start_timeout_s),
    )
}

fn template(daemon: &Daemon, name: &str, guest: &Path, run: &str) -> Result<(), DaemonBenchError> {
    let cmdline = if run.is_empty() {
        TEST_GUEST_CMDLINE.to_string()
    } else {
        format!("{TEST_GUEST_CMDLINE} rollbox.test.run={run}")
    };
    daemon.expect(
        "POST",
        "/templates",
        Some(json!({"name": name, "kernel": guest, "cmdline": cmdline, "memory_mib": 32})),
        201,
    )?;
    Ok(())
}

fn volume(daemon: &Daemon, name: &str) -> Result<(), DaemonBenchError> {
    daemon.expect("POST", "/volumes", Some(json!({"name": name})), 201)?;
    Ok(())
}

fn mount(name: &str) -> Value {
    json!([{"name": name, "mount_path": "/data"}])
}

fn create(daemon: &Daemon, body: Value) -> Result<(String, PathBuf, f64), DaemonBenchError> {
    let started = Instant::now();
    let sandbox = daemon.expect("POST", "/sandboxes", Some(body), 201)?;
    let took = ms(started);
    let id = sandbox["id"].as_str().unwrap_or_default().to_string();
    let dir = PathBuf::from(sandbox["dir"].as_str().unwrap_or_default());
    Ok((id, dir, took))
}

/// Waits until every sandbox directory's console has the writer's answer.
fn wait_appended(dirs: &[PathBuf]) -> Result<(), DaemonBenchError> {
    wait_console(dirs, "OK appended")
}

/// Waits until every sandbox directory's console has `line` (an `ERR` is a failure).
fn wait_console(dirs: &[PathBuf], line: &str) -> Result<(), DaemonBenchError> {
    let deadline = Instant::now() + WRITE_TIMEOUT;
    let mut left: Vec<&PathBuf> = dirs.iter().collect();
    while !left.is_empty() {
        let mut still = Vec::new();
        for dir in left {
            let console = std::fs::read_to_string(dir.join("console.log")).unwrap_or_default();
            if console.contains("ERR") {
                return Err(DaemonBenchError::Request {
                    what: format!("the writer in {}", dir.display()),
                    message: console,
                });
            }
            if !console.contains(line) {
                still.push(dir);
            }
        }
        left = still;
        if Instant::now() > deadline {
            return Err(DaemonBenchError::Request {
                what: "writers".into(),
                message: format!("{} did not finish within {WRITE_TIMEOUT:?}", left.len()),
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

fn delete_all(daemon: &Daemon, ids: &[String]) -> Result<(), DaemonBenchError> {
    parallel(ids.len(), 8, |i| delete(daemon, &ids[i]))?;
    Ok(())
}

/// `writers` forks (of sandboxes that mount one volume) append at once.
fn shared(daemon: &Daemon, writers: usize) -> Result<WriteFigure, DaemonBenchError> {
    let name = format!("shared-{writers}");
    volume(daemon, &name)?;
    let parents = writers.div_ceil(MAX_FORK);
    let mut ids = Vec::new();
    let mut parent_ids = Vec::new();
    let mut parent_dirs = Vec::new();
    for _ in 0..parents {
        let (id, dir, _) = create(
            daemon,
            json!({"template": "fork-writer", "ttl_s": 3600, "volumes": mount(&name)}),
        )?;
        parent_ids.push(id);
        parent_dirs.push(dir);
    }
    // The parents' FUSE sessions are up before their snapshot.
    wait_console(&parent_dirs, "OK 7.")?;
    let started = Instant::now();
    let counts: Vec<usize> = (0..parents)
        .map(|p| (writers - p * MAX_FORK).min(MAX_FORK))
        .collect();
    // One fork at a time: all parents' forks at once put 256 restores on 2 cores, and VMMs
    // missed the start timeout.
    let mut forked = Vec::new();
    for (parent, count) in parent_ids.iter().zip(&counts) {
        forked.push(daemon.expect(
            "POST",
            &format!("/sandboxes/{parent}/fork"),
            Some(json!({"count": count})),
            200,
        )?);
    }
    let mut dirs = Vec::new();
    for answer in forked {
        for result in answer["results"].as_array().cloned().unwrap_or_default() {
            let sandbox = &result["sandbox"];
            let Some(id) = sandbox["id"].as_str() else {
                return Err(DaemonBenchError::Request {
                    what: "fork".into(),
                    message: result.to_string(),
                });
            };
            ids.push(id.to_string());
            dirs.push(PathBuf::from(sandbox["dir"].as_str().unwrap_or_default()));
        }
    }
    wait_appended(&dirs)?;
    let seconds = started.elapsed().as_secs_f64();
    ids.extend(parent_ids);
    delete_all(daemon, &ids)?;
    daemon.expect("DELETE", &format!("/volumes/{name}"), None, 204)?;
    Ok(WriteFigure {
        writers,
        shared: true,
        seconds,
        records_per_s: (writers * RECORDS) as f64 / seconds,
    })
}

/// `writers` sandboxes, each with a volume of its own, append at once.
fn own(daemon: &Daemon, writers: usize) -> Result<WriteFigure, DaemonBenchError> {
    let names: Vec<String> = (0..writers).map(|i| format!("own-{writers}-{i}")).collect();
    for name in &names {
        volume(daemon, name)?;
    }
    let started = Instant::now();
    let (made, _) = parallel(writers, 16, |i| {
        create(
            daemon,
            json!({"template": "boot-writer", "ttl_s": 3600, "volumes": mount(&names[i])}),
        )
    })?;
    let dirs: Vec<PathBuf> = made.iter().map(|(_, dir, _)| dir.clone()).collect();
    wait_appended(&dirs)?;
    let seconds = started.elapsed().as_secs_f64();
    let ids: Vec<String> = made.into_iter().map(|(id, _, _)| id).collect();
    delete_all(daemon, &ids)?;
    for name in &names {
        daemon.expect("DELETE", &format!("/volumes/{name}"), None, 204)?;
    }
    Ok(WriteFigure {
        writers,
        shared: false,
        seconds,
        records_per_s: (writers * RECORDS) as f64 / seconds,
    })
}

pub fn run(config: &VolumesBenchConfig) -> Result<VolumesReport, DaemonBenchError> {
    let daemon = start(&daemon_config(config))?;
    template(&daemon, "plain", &config.guest, "")?;
    template(
        &daemon,
        "fork-writer",
        &config.guest,
        &format!("fs-init;fs-append-clone:{RECORDS}"),
    )?;
    template(
        &daemon,
        "boot-writer",
        &config.guest,
        &format!("fs-init;fs-append:{RECORDS}"),
    )?;
    volume(&daemon, "latency")?;
    let mut creates = Vec::new();
    for with_volume in [false, true] {
        eprintln!(
            "volumes: {} creates {} a volume",
            config.creates,
            if with_volume { "with" } else { "without" }
        );
        let mut samples = Vec::new();
        for _ in 0..config.creates.max(1) {
            let mut body = json!({"template": "plain", "ttl_s": 600});
            if with_volume {
                body["volumes"] = mount("latency");
            }
            let (id, _, took) = create(&daemon, body)?;
            samples.push(took);
            delete(&daemon, &id)?;
        }
        creates.push(CreateFigure {
            volume: with_volume,
            p99_ms: p99(&samples),
            create_ms: summary(&samples, "creates")?,
        });
    }
    let mut writes = Vec::new();
    for &writers in &config.writers {
        eprintln!("volumes: {writers} writers on one volume (forks)");
        writes.push(shared(&daemon, writers)?);
        eprintln!("volumes: {writers} writers on a volume each");
        writes.push(own(&daemon, writers)?);
    }
    Ok(VolumesReport { creates, writes })
}

pub fn markdown(report: &VolumesReport) -> String {
    let mut out = String::from(
        "## rollbox-bench volumes (test guest, 32 MiB, jailed; one virtiofsd per sandbox and volume)\n\n",
    );
    out.push_str("| create (boot) | p50 ms | p99 ms |\n| --- | ---: | ---: |\n");
    for c in &report.creates {
        out.push_str(&format!(
            "| {} | {:.1} | {:.1} |\n",
            if c.volume {
                "with one volume"
            } else {
                "without a volume"
            },
            c.create_ms.p50,
            c.p99_ms
        ));
    }
    out.push_str(&format!(
        "\n| writers | volume | s (first create or fork to last answer) | records/s ({RECORDS} each) |\n| ---: | --- | ---: | ---: |\n"
    ));
    for w in &report.writes {
        out.push_str(&format!(
            "| {} | {} | {:.1} | {:.0} |\n",
            w.writers,
            if w.shared {
                "one, shared (forks)"
            } else {
                "one each (creates)"
            },
            w.seconds,
            w.records_per_s
        ));
    }
    out
}
