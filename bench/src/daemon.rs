//! `rollbox-bench daemon`: a real `rollbox serve` with the test-guest template in a scratch
//! state directory. Create-from-snapshot latency at several concurrencies, creates per second,
//! fork(16), and the daemon's memory per live sandbox. Figures only, never a verdict.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use rollbox::daemon::client::Endpoint;
use serde::Serialize;
use serde_json::{json, Value};

use crate::stats::{percentile, summarize, Summary};
use crate::test_guest::TEST_GUEST_CMDLINE;

const KEY: &str = "rollbox-bench-daemon-key";
const TIMEOUT: Duration = Duration::from_secs(120);

/// A failed daemon benchmark (never a slow one).
#[derive(Debug, thiserror::Error)]
pub enum DaemonBenchError {
    #[error("{path} is missing: {hint}")]
    Missing { path: PathBuf, hint: &'static str },
    #[error("scratch directory {path}: {source}")]
    Scratch {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot start {rollbox} serve: {source}")]
    Spawn {
        rollbox: PathBuf,
        source: std::io::Error,
    },
    #[error("rollbox serve did not listen on {sock} within 20 s; its log: {log}")]
    NotListening { sock: PathBuf, log: String },
    #[error("{what}: {message}")]
    Request { what: String, message: String },
}

/// What to run.
pub struct DaemonBenchConfig {
    pub rollbox: PathBuf,
    pub vmm: PathBuf,
    pub guest: PathBuf,
    pub memory_mib: u64,
    /// Where the scratch directory goes (removed at the end).
    pub dir: PathBuf,
    /// Creates at concurrency 1.
    pub serial: usize,
    /// Concurrencies beside 1 (e.g. 16, 64) and the rounds of each.
    pub concurrency: Vec<usize>,
    pub rounds: usize,
    /// Creates of the sustained figure and the workers that make them.
    pub sustained: usize,
    pub sustained_workers: usize,
    /// Instead of `sustained` cycles: as many as fit this long.
    pub sustained_for: Option<Duration>,
    /// Boot the test guest in its idle mode (`rollbox.test.run=idle`): between commands it
    /// halts until an interrupt, as Linux does, instead of polling the serial port.
    pub idle_guest: bool,
    /// Fork(16) repetitions and the fork's count.
    pub forks: usize,
    pub fork_count: usize,
    /// Sandboxes kept alive at once for the memory figure.
    pub live: usize,
    /// Whether the daemon jails its VMMs (its default) or runs them with `--no-jailer`.
    pub jailer: bool,
    /// `rollbox serve --vmm-start-timeout` (none: the daemon's default).
    pub vmm_start_timeout_s: Option<u64>,
    /// `rollbox serve --warm-pool MEMORY=N` with this N (0: no warm pool).
    pub warm_pool: usize,
}

impl DaemonBenchConfig {
    /// A jailed daemon of 32 MiB test-guest sandboxes that measures none of this bench's own
    /// figures: the daemon other benches (volumes, networks) start and drive themselves.
    pub(crate) fn for_other_bench(
        rollbox: PathBuf,
        vmm: PathBuf,
        guest: PathBuf,
        dir: PathBuf,
        vmm_start_timeout_s: Option<u64>,
    ) -> DaemonBenchConfig {
        DaemonBenchConfig {
            rollbox,
            vmm,
            guest,
            memory_mib: 32,
            dir,
            serial: 0,
            concurrency: Vec::new(),
            rounds: 0,
            sustained: 0,
            sustained_workers: 0,
            sustained_for: None,
            idle_guest: false,
            forks: 0,
            fork_count: 0,
            live: 0,
            jailer: true,
            vmm_start_timeout_s,
            warm_pool: 0,
        }
    }
}

/// Latency of creates (201) made `concurrency` at a time.
#[derive(Debug, Serialize)]
pub struct ConcurrencyFigure {
    pub concurrency: usize,
    pub creates: usize,
    pub create_ms: Summary,
    pub p99_ms: f64,
    /// Creates per second while each round ran (the round's creates / its wall time).
    pub creates_per_s: f64,
}

/// CPU time per sustained create + delete cycle, over all CPUs, from `/proc`.
#[derive(Debug, Clone, Serialize)]
pub struct CycleCpu {
    pub cpus: usize,
    pub total_ms: f64,
    pub daemon_ms: f64,
    /// The daemon's children that ended and were reaped meanwhile: the jailer processes it
    /// waited for (the VMMs are the jailers' children, in the rest).
    pub reaped_ms: f64,
    /// The bench's own HTTP clients.
    pub client_ms: f64,
}

impl CycleCpu {
    /// What neither the daemon, its reaped children nor the client spent: the VMMs, the
    /// kernel's threads (cgroup and namespace teardown), other processes.
    pub fn rest_ms(&self) -> f64 {
        (self.total_ms - self.daemon_ms - self.reaped_ms - self.client_ms).max(0.0)
    }

    /// Cycles per second if every CPU did nothing else.
    pub fn ceiling_per_s(&self) -> f64 {
        self.cpus as f64 * 1000.0 / self.total_ms.max(f64::MIN_POSITIVE)
    }
}

/// Clock ticks at the start of the sustained phase.
struct CpuTicks {
    busy: u64,
    daemon: (u64, u64),
    client: u64,
}

fn self_ticks() -> Option<u64> {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| crate::procfs::process_ticks(&s))
}

fn busy_ticks() -> Option<u64> {
    std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|s| crate::procfs::busy_ticks(&s))
}

impl CpuTicks {
    fn now(daemon: &Daemon) -> Option<CpuTicks> {
        Some(CpuTicks {
            busy: busy_ticks()?,
            daemon: daemon.cpu_ticks()?,
            client: self_ticks()?,
        })
    }

    /// The ticks since, per cycle of `cycles`.
    fn per_cycle(&self, daemon: &Daemon, cycles: usize) -> Option<CycleCpu> {
        let now = CpuTicks::now(daemon)?;
        let per = crate::procfs::ms_per_tick() / cycles.max(1) as f64;
        Some(CycleCpu {
            cpus: std::thread::available_parallelism().map_or(1, usize::from),
            total_ms: now.busy.saturating_sub(self.busy) as f64 * per,
            daemon_ms: now.daemon.0.saturating_sub(self.daemon.0) as f64 * per,
            reaped_ms: now.daemon.1.saturating_sub(self.daemon.1) as f64 * per,
            client_ms: now.client.saturating_sub(self.client) as f64 * per,
        })
    }
}

/// Everything measured.
#[derive(Debug, Serialize)]
pub struct DaemonReport {
    pub memory_mib: u64,
    /// Whether the VMMs ran inside rollbox-jailer.
    pub jailed: bool,
    /// The test guest booted in its idle mode (`--idle-guest`).
    pub idle_guest: bool,
    pub template_boot_ms: f64,
    pub snapshot_ms: f64,
    pub levels: Vec<ConcurrencyFigure>,
    /// Where a create and a delete at concurrency 1 spend their time (the daemon's
    /// `ROLLBOX_LOG=debug` lines): phase name → p50 ms.
    pub phases: Vec<(String, f64)>,
    pub delete_ms: Summary,
    /// Create from the snapshot then delete, by `sustained_workers` workers.
    pub sustained_creates: usize,
    pub sustained_workers: usize,
    pub sustained_creates_per_s: f64,
    pub sustained_wall_s: f64,
    /// The machine's CPU time per sustained cycle, and whose.
    pub sustained_cpu: Option<CycleCpu>,
    pub fork_count: usize,
    pub fork_ms: Option<Summary>,
    /// How long the fork's parent was paused (the daemon's `fork` debug lines).
    pub fork_paused_ms: Option<Summary>,
    pub live: usize,
    pub daemon_rss_idle_kib: u64,
    pub daemon_rss_live_kib: u64,
    /// (RSS with `live` sandboxes - idle RSS) / live * 1000.
    pub daemon_kib_per_1000_extrapolated: f64,
    pub vmm_rss_p50_kib: Option<f64>,
    /// `--warm-pool`'s N (0: none), and the VMM launches that loaded a warm shell against
    /// all launches (the daemon's debug lines).
    pub warm_pool: usize,
    pub warm_launches: usize,
    pub launches: usize,
    /// Creates and deletes that failed (not in the latencies).
    pub failures: usize,
    pub first_failure: Option<String>,
}

pub(crate) struct Daemon {
    child: Child,
    scratch: PathBuf,
    /// Creates and deletes that failed (the run goes on; the report counts them).
    failures: std::sync::Mutex<Vec<String>>,
}

impl Daemon {
    fn sock(&self) -> PathBuf {
        self.scratch.join("d.sock")
    }

    fn log(&self) -> String {
        let text = std::fs::read_to_string(self.scratch.join("serve.log")).unwrap_or_default();
        let tail = text.len().saturating_sub(2000);
        text.get(tail..).unwrap_or_default().to_string()
    }

    pub(crate) fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> Result<(u16, Value), String> {
        let response = Endpoint::Unix(self.sock())
            .request_json(method, path, KEY, body.as_ref(), TIMEOUT)
            .map_err(|e| e.to_string())?;
        let value = serde_json::from_slice(&response.body).unwrap_or(Value::Null);
        Ok((response.status, value))
    }

    /// A request whose body or answer streams (a snapshot's export or import): the answer,
    /// to read as it comes.
    pub(crate) fn open(
        &self,
        method: &str,
        path: &str,
        body: Option<(&mut dyn std::io::Read, u64)>,
    ) -> Result<rollbox::daemon::client::Streaming, DaemonBenchError> {
        let auth = format!("Bearer {KEY}");
        Endpoint::Unix(self.sock())
            .open(
                method,
                path,
                &[("Authorization", auth.as_str())],
                body,
                TIMEOUT,
            )
            .map_err(|e| DaemonBenchError::Request {
                what: format!("{method} {path}"),
                message: format!("{e}; daemon log: {}", self.log()),
            })
    }

    /// `call`, expecting `status`.
    pub(crate) fn expect(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
        status: u16,
    ) -> Result<Value, DaemonBenchError> {
        let what = format!("{method} {path}");
        match self.call(method, path, body) {
            Ok((got, value)) if got == status => Ok(value),
            Ok((got, value)) => Err(DaemonBenchError::Request {
                what,
                message: format!(
                    "{got} (wanted {status}): {value}; daemon log: {}",
                    self.log()
                ),
            }),
            Err(message) => Err(DaemonBenchError::Request {
                what,
                message: format!("{message}; daemon log: {}", self.log()),
            }),
        }
    }

    /// A create from `snapshot`: its id and latency, or `None` with the failure recorded.
    fn try_create(&self, snapshot: &str) -> Option<(String, f64)> {
        self.record(create(self, snapshot))
    }

    /// A delete's latency, or `None` with the failure recorded.
    fn try_delete(&self, id: &str) -> Option<f64> {
        self.record(delete(self, id))
    }

    fn record<T>(&self, result: Result<T, DaemonBenchError>) -> Option<T> {
        result
            .map_err(|e| {
                eprintln!("daemon: {e}");
                self.failures
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(e.to_string());
            })
            .ok()
    }

    fn full_log(&self) -> String {
        std::fs::read_to_string(self.scratch.join("serve.log")).unwrap_or_default()
    }

    /// The daemon's user + system clock ticks so far, and those of its children it reaped.
    fn cpu_ticks(&self) -> Option<(u64, u64)> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).ok()?;
        Some((
            crate::procfs::process_ticks(&stat)?,
            crate::procfs::children_ticks(&stat)?,
        ))
    }

    fn rss_kib(&self) -> u64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .ok()
            .and_then(|s| crate::procfs::vm_rss_kib(&s))
            .unwrap_or(0)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // Delete what is left through the API (it ends the VMMs), then stop the daemon.
        if let Ok((200, list)) = self.call("GET", "/sandboxes?state=running&limit=1000", None) {
            for id in ids(&list) {
                let _ = self.call("DELETE", &format!("/sandboxes/{id}"), None);
            }
        }
        // SIGTERM first: a daemon that stops ends its warm pool's shells (SIGKILL would leave
        // them running, their directories removed below).
        let pid = self.child.id() as libc::pid_t;
        // SAFETY: kill(2) of the daemon this bench started and has not reaped.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline && matches!(self.child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.scratch);
    }
}

fn ids(list: &Value) -> Vec<String> {
    list["sandboxes"]
        .as_array()
        .map(|all| {
            all.iter()
                .filter_map(|s| s["id"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

pub(crate) fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1000.0
}

pub(crate) fn start(config: &DaemonBenchConfig) -> Result<Daemon, DaemonBenchError> {
    for (path, hint) in [
        (&config.rollbox, "cargo build --release -p rollbox"),
        (&config.vmm, "cargo build --release -p vmm"),
        (&config.guest, "cargo xtask test-guest"),
    ] {
        if !path.is_file() {
            return Err(DaemonBenchError::Missing {
                path: path.clone(),
                hint,
            });
        }
    }
    let scratch = config
        .dir
        .join(format!("rollbox-bench-daemon-{}", std::process::id()));
    let scratch_error = |source| DaemonBenchError::Scratch {
        path: scratch.clone(),
        source,
    };
    std::fs::create_dir_all(&scratch).map_err(scratch_error)?;
    std::fs::write(scratch.join("key"), format!("{KEY}\n")).map_err(scratch_error)?;
    let log = std::fs::File::create(scratch.join("serve.log")).map_err(scratch_error)?;
    let log2 = log.try_clone().map_err(scratch_error)?;
    let child = Command::new(&config.rollbox)
        .arg("serve")
        .arg("--vmm")
        .arg(&config.vmm)
        .arg("--socket")
        .arg(scratch.join("d.sock"))
        .arg("--api-key-file")
        .arg(scratch.join("key"))
        .arg("--state-dir")
        .arg(scratch.join("state"))
        .args(["--max-pending-creates", "100000"])
        .args((!config.jailer).then_some("--no-jailer"))
        .args(
            (config.warm_pool > 0)
                .then(|| format!("--warm-pool={}={}", config.memory_mib, config.warm_pool)),
        )
        .args(
            config
                .vmm_start_timeout_s
                .map(|s| ["--vmm-start-timeout".to_string(), s.to_string()])
                .into_iter()
                .flatten(),
        )
        .env("ROLLBOX_LOG", "debug")
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2)
        .spawn()
        .map_err(|source| DaemonBenchError::Spawn {
            rollbox: config.rollbox.clone(),
            source,
        })?;
    let daemon = Daemon {
        child,
        scratch,
        failures: std::sync::Mutex::new(Vec::new()),
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::os::unix::net::UnixStream::connect(daemon.sock()).is_err() {
        if Instant::now() > deadline {
            return Err(DaemonBenchError::NotListening {
                sock: daemon.sock(),
                log: daemon.log(),
            });
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(daemon)
}

/// One create from `snapshot`: its id and latency.
fn create(daemon: &Daemon, snapshot: &str) -> Result<(String, f64), DaemonBenchError> {
    let body = json!({"snapshot": snapshot, "ttl_s": 3600});
    let started = Instant::now();
    let sandbox = daemon.expect("POST", "/sandboxes", Some(body), 201)?;
    let took = ms(started);
    let id = sandbox["id"].as_str().unwrap_or_default().to_string();
    Ok((id, took))
}

pub(crate) fn delete(daemon: &Daemon, id: &str) -> Result<f64, DaemonBenchError> {
    let started = Instant::now();
    daemon.expect("DELETE", &format!("/sandboxes/{id}"), None, 204)?;
    Ok(ms(started))
}

/// Starts `threads` workers together and joins them: each runs `worker` from the shared start
/// instant; their results, flattened, and the wall time from the start until the last ended.
fn run_workers<T: Send>(
    threads: usize,
    worker: impl Fn(Instant) -> Result<Vec<T>, DaemonBenchError> + Sync,
) -> Result<(Vec<T>, f64), DaemonBenchError> {
    let barrier = Barrier::new(threads);
    let started = std::sync::OnceLock::new();
    let results: Vec<Result<Vec<T>, DaemonBenchError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let (barrier, worker, started) = (&barrier, &worker, &started);
                scope.spawn(move || {
                    barrier.wait();
                    worker(*started.get_or_init(Instant::now))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(DaemonBenchError::Request {
                        what: "a worker thread".into(),
                        message: "panicked".into(),
                    })
                })
            })
            .collect()
    });
    let wall = started.get().map_or(0.0, |s| s.elapsed().as_secs_f64());
    let mut all = Vec::new();
    for result in results {
        all.extend(result?);
    }
    Ok((all, wall))
}

/// Runs `work` on `threads` threads, again and again, until `duration` has passed since they
/// all started; the results and the wall time until the last one ended.
fn for_duration<T: Send>(
    threads: usize,
    duration: Duration,
    work: impl Fn() -> Result<T, DaemonBenchError> + Sync,
) -> Result<(Vec<T>, f64), DaemonBenchError> {
    run_workers(threads.max(1), |start| {
        let mut mine = Vec::new();
        while start.elapsed() < duration {
            mine.push(work()?);
        }
        Ok(mine)
    })
}

/// `count` creates from `threads` threads at once (each takes the next index); the results in
/// index order and the wall time in seconds.
pub(crate) fn parallel<T: Send>(
    count: usize,
    threads: usize,
    work: impl Fn(usize) -> Result<T, DaemonBenchError> + Sync,
) -> Result<(Vec<T>, f64), DaemonBenchError> {
    let next = AtomicUsize::new(0);
    let (mut all, wall) = run_workers(threads.clamp(1, count.max(1)), |_| {
        let mut mine = Vec::new();
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= count {
                return Ok(mine);
            }
            mine.push((i, work(i)?));
        }
    })?;
    all.sort_by_key(|(i, _)| *i);
    Ok((all.into_iter().map(|(_, t)| t).collect(), wall))
}

pub(crate) fn summary(samples: &[f64], what: &str) -> Result<Summary, DaemonBenchError> {
    summarize(samples).ok_or_else(|| DaemonBenchError::Request {
        what: what.into(),
        message: "no samples".into(),
    })
}

pub(crate) fn p99(samples: &[f64]) -> f64 {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    percentile(&sorted, 99.0).unwrap_or(f64::NAN)
}

fn vmm_rss_kib(daemon: &Daemon, id: &str) -> Option<f64> {
    let (_, sandbox) = daemon.call("GET", &format!("/sandboxes/{id}"), None).ok()?;
    let pid = sandbox["pid"].as_u64()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    crate::procfs::vm_rss_kib(&status).map(|k| k as f64)
}

pub fn run(config: &DaemonBenchConfig) -> Result<DaemonReport, DaemonBenchError> {
    let daemon = start(config)?;
    daemon.expect(
        "POST",
        "/templates",
        Some(json!({
            "name": "guest",
            "kernel": config.guest,
            "cmdline": if config.idle_guest {
                format!("{TEST_GUEST_CMDLINE} rollbox.test.run=idle")
            } else {
                TEST_GUEST_CMDLINE.to_string()
            },
            "memory_mib": config.memory_mib,
        })),
        201,
    )?;
    eprintln!("daemon: booting the template sandbox and taking its snapshot");
    let started = Instant::now();
    let base = daemon.expect(
        "POST",
        "/sandboxes",
        Some(json!({"template": "guest", "ttl_s": 3600})),
        201,
    )?;
    let template_boot_ms = ms(started);
    let base_id = base["id"].as_str().unwrap_or_default().to_string();
    let started = Instant::now();
    let snap = daemon.expect(
        "POST",
        &format!("/sandboxes/{base_id}/snapshots"),
        None,
        201,
    )?;
    let snapshot_ms = ms(started);
    let snapshot = snap["id"].as_str().unwrap_or_default().to_string();

    // Warm-up: the snapshot's files into the page cache, the first VMM's code.
    for _ in 0..3 {
        let (id, _) = create(&daemon, &snapshot)?;
        delete(&daemon, &id)?;
    }

    let mut levels = Vec::new();
    let mut deletes = Vec::new();
    wait_for_pool(&daemon, config);
    eprintln!("daemon: {} creates at concurrency 1", config.serial);
    let mut serial = Vec::new();
    let log_from = daemon.full_log().len();
    for _ in 0..config.serial.max(1) {
        if let Some((id, took)) = daemon.try_create(&snapshot) {
            serial.push(took);
            deletes.extend(daemon.try_delete(&id));
        }
    }
    let phases = phases(daemon.full_log().get(log_from..).unwrap_or_default());
    levels.push(ConcurrencyFigure {
        concurrency: 1,
        creates: serial.len(),
        create_ms: summary(&serial, "creates at concurrency 1")?,
        p99_ms: p99(&serial),
        creates_per_s: serial.len() as f64 / (serial.iter().sum::<f64>() / 1000.0),
    });
    for &concurrency in &config.concurrency {
        eprintln!(
            "daemon: {} rounds of {concurrency} creates at once",
            config.rounds
        );
        let mut samples = Vec::new();
        let mut wall_total = 0.0;
        for _ in 0..config.rounds.max(1) {
            wait_for_pool(&daemon, config);
            let (made, wall) = parallel(concurrency, concurrency, |_| {
                Ok(daemon.try_create(&snapshot))
            })?;
            let made: Vec<(String, f64)> = made.into_iter().flatten().collect();
            wall_total += wall;
            samples.extend(made.iter().map(|(_, t)| *t));
            let (took, _) = parallel(made.len(), 8, |i| Ok(daemon.try_delete(&made[i].0)))?;
            deletes.extend(took.into_iter().flatten());
        }
        levels.push(ConcurrencyFigure {
            concurrency,
            creates: samples.len(),
            p99_ms: p99(&samples),
            create_ms: summary(&samples, "concurrent creates")?,
            creates_per_s: samples.len() as f64 / wall_total.max(f64::MIN_POSITIVE),
        });
    }

    match config.sustained_for {
        Some(duration) => eprintln!(
            "daemon: create+delete cycles by {} workers for {} s",
            config.sustained_workers,
            duration.as_secs()
        ),
        None => eprintln!(
            "daemon: {} create+delete cycles by {} workers",
            config.sustained, config.sustained_workers
        ),
    }
    wait_for_pool(&daemon, config);
    let cpu_before = CpuTicks::now(&daemon);
    let cycle = || {
        Ok(daemon
            .try_create(&snapshot)
            .map(|(id, _)| daemon.try_delete(&id)))
    };
    let (made, sustained_wall) = match config.sustained_for {
        Some(duration) => for_duration(config.sustained_workers, duration, cycle)?,
        None => parallel(config.sustained, config.sustained_workers, |_| cycle())?,
    };
    let sustained_made = made.iter().flatten().count();
    let sustained_creates_per_s = sustained_made as f64 / sustained_wall.max(f64::MIN_POSITIVE);
    let sustained_cpu = cpu_before.and_then(|before| before.per_cycle(&daemon, sustained_made));

    let mut forks = Vec::new();
    let forks_log_from = daemon.full_log().len();
    for _ in 0..config.forks {
        eprintln!("daemon: fork({})", config.fork_count);
        wait_for_pool(&daemon, config);
        let started = Instant::now();
        let made = daemon.expect(
            "POST",
            &format!("/sandboxes/{base_id}/fork"),
            Some(json!({"count": config.fork_count, "ttl_s": 3600})),
            200,
        )?;
        forks.push(ms(started));
        let results = made["results"].as_array().cloned().unwrap_or_default();
        for result in &results {
            let Some(id) = result["sandbox"]["id"].as_str() else {
                return Err(DaemonBenchError::Request {
                    what: "fork".into(),
                    message: format!("a fork failed: {result}"),
                });
            };
            delete(&daemon, id)?;
        }
    }
    let fork_paused = figures(
        daemon.full_log().get(forks_log_from..).unwrap_or_default(),
        "fork",
        "paused",
    );
    // The forks' snapshots (each fork takes one).
    if let Ok((200, list)) = daemon.call("GET", "/snapshots", None) {
        for snap in list["snapshots"].as_array().cloned().unwrap_or_default() {
            if let Some(id) = snap["id"].as_str().filter(|id| *id != snapshot) {
                let _ = daemon.call("DELETE", &format!("/snapshots/{id}"), None);
            }
        }
    }

    eprintln!(
        "daemon: {} live sandboxes for the memory figure",
        config.live
    );
    std::thread::sleep(Duration::from_millis(500));
    let daemon_rss_idle_kib = daemon.rss_kib();
    // Each is paused once made: idle test guests still take a few % of a core each (timer
    // exits), and hundreds of them would starve the machine, the daemon included.
    let (live, _) = parallel(config.live, 16, |_| {
        let made = daemon.try_create(&snapshot);
        if let Some((id, _)) = &made {
            daemon.record(daemon.expect("POST", &format!("/sandboxes/{id}/pause"), None, 200));
        }
        Ok(made)
    })?;
    let live: Vec<(String, f64)> = live.into_iter().flatten().collect();
    // A few reaper passes over all of them.
    std::thread::sleep(Duration::from_secs(1));
    let daemon_rss_live_kib = daemon.rss_kib();
    let vmm_rss: Vec<f64> = live
        .iter()
        .take(20)
        .filter_map(|(id, _)| vmm_rss_kib(&daemon, id))
        .collect();
    let (took, _) = parallel(live.len(), 8, |i| Ok(daemon.try_delete(&live[i].0)))?;
    deletes.extend(took.into_iter().flatten());
    let per_1000 = (daemon_rss_live_kib.saturating_sub(daemon_rss_idle_kib)) as f64
        / live.len().max(1) as f64
        * 1000.0;
    let failures = daemon
        .failures
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let vmm_rss_p50_kib = summarize(&vmm_rss).map(|s| s.p50);
    let log = daemon.full_log();
    let launch_lines = log.lines().filter(|line| line.contains("debug: launch "));
    let (warm_launches, launches) = launch_lines.fold((0, 0), |(warm, all), line| {
        (
            warm + usize::from(line.contains("in a warm shell")),
            all + 1,
        )
    });

    Ok(DaemonReport {
        jailed: config.jailer,
        idle_guest: config.idle_guest,
        memory_mib: config.memory_mib,
        template_boot_ms,
        snapshot_ms,
        levels,
        phases,
        delete_ms: summary(&deletes, "deletes")?,
        sustained_creates: sustained_made,
        sustained_workers: config.sustained_workers,
        sustained_creates_per_s,
        sustained_wall_s: sustained_wall,
        sustained_cpu,
        fork_count: config.fork_count,
        fork_ms: summarize(&forks),
        fork_paused_ms: summarize(&fork_paused),
        live: live.len(),
        failures: failures.len(),
        first_failure: failures.first().cloned(),
        daemon_rss_idle_kib,
        daemon_rss_live_kib,
        daemon_kib_per_1000_extrapolated: per_1000,
        vmm_rss_p50_kib,
        warm_pool: config.warm_pool,
        warm_launches,
        launches,
    })
}

/// With a warm pool, waits (up to 60 s, untimed) until it is full again: a burst takes the
/// pool's shells, and the figures are of creates that find it as a steady trickle would.
fn wait_for_pool(daemon: &Daemon, config: &DaemonBenchConfig) {
    if config.warm_pool == 0 {
        return;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if let Ok((200, node)) = daemon.call("GET", "/node", None) {
            let full = node["warm_pool"]
                .as_array()
                .is_some_and(|shapes| shapes.iter().all(|shape| shape["ready"] == shape["target"]));
            if full {
                return;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("daemon: the warm pool did not fill within 60 s; measuring anyway");
}

/// Every (kind, phase, value) in the daemon's `debug:` lines: `KIND ID: NAME X ms, ...`.
fn debug_figures(log: &str) -> impl Iterator<Item = (&str, &str, f64)> {
    log.lines()
        .filter_map(|line| line.split_once("debug: ").map(|(_, rest)| rest))
        .filter_map(|rest| rest.split_once(": "))
        .flat_map(|(head, figures)| {
            let kind = head.split_whitespace().next().unwrap_or_default();
            figures.split(", ").filter_map(move |figure| {
                let mut words = figure.split_whitespace();
                let (name, value) = (words.next()?, words.next()?.parse::<f64>().ok()?);
                Some((kind, name, value))
            })
        })
}

/// Every value of phase `name` in the daemon's `debug:` lines of `kind`.
fn figures(log: &str, kind: &str, name: &str) -> Vec<f64> {
    debug_figures(log)
        .filter(|(k, n, _)| *k == kind && *n == name)
        .map(|(_, _, value)| value)
        .collect()
}

/// p50 of each phase in the daemon's `debug:` lines (`NAME X ms`, comma separated, after the
/// sandbox id), keyed by the line's kind and the phase name.
fn phases(log: &str) -> Vec<(String, f64)> {
    let mut samples: Vec<(String, Vec<f64>)> = Vec::new();
    for (kind, name, value) in debug_figures(log) {
        let key = format!("{kind}: {name}");
        match samples.iter_mut().find(|(k, _)| *k == key) {
            Some((_, all)) => all.push(value),
            None => samples.push((key, vec![value])),
        }
    }
    samples
        .into_iter()
        .filter_map(|(key, all)| summarize(&all).map(|s| (key, s.p50)))
        .collect()
}

fn mib(kib: f64) -> String {
    format!("{:.1} MiB", kib / 1024.0)
}

/// The figures beside the targets and the published anchors (quoted, not measured).
pub fn markdown(report: &DaemonReport) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "## rollbox-bench daemon (test guest{}, {} MiB, VMMs {}; create = POST /sandboxes from a snapshot → 201)\n\n",
        if report.idle_guest { " halting when idle" } else { " polling its serial port" },
        report.memory_mib,
        if report.jailed { "jailed (rollbox-jailer)" } else { "not jailed (--no-jailer)" }
    ));
    out.push_str(
        "| figure | measured | target (issue 11) | anchor (published, not measured here) |\n",
    );
    out.push_str("| --- | --- | --- | --- |\n");
    for level in &report.levels {
        let s = &level.create_ms;
        let (target, anchor) = match level.concurrency {
            1 => ("p50 < 10 ms", "E2B ~150 ms per create"),
            _ => ("", "E2B ~1.6 s for 20 at once"),
        };
        out.push_str(&format!(
            "| create, concurrency {} ({} creates): p50 / p99 / max | {:.1} / {:.1} / {:.1} ms ({:.0} creates/s) | {target} | {anchor} |\n",
            level.concurrency, level.creates, s.p50, level.p99_ms, s.max, level.creates_per_s
        ));
    }
    out.push_str(&format!(
        "| sustained: create + delete cycles, {} by {} workers in {:.1} s | {:.0} creates/s | ≥ 300 creates/s | Firecracker 150 microVMs/s/host |\n",
        report.sustained_creates, report.sustained_workers, report.sustained_wall_s, report.sustained_creates_per_s
    ));
    if let Some(cpu) = &report.sustained_cpu {
        out.push_str(&format!(
            "| sustained: CPU time per create + delete, all CPUs | {:.1} ms: daemon {:.1}, its reaped children (jailers) {:.1}, this bench's client {:.1}, the rest (VMMs, kernel threads) {:.1} | | at most {:.0} creates/s on these {} CPUs |\n",
            cpu.total_ms, cpu.daemon_ms, cpu.reaped_ms, cpu.client_ms, cpu.rest_ms(), cpu.ceiling_per_s(), cpu.cpus
        ));
    }
    out.push_str(&format!(
        "| delete: p50 / p90 / max | {:.1} / {:.1} / {:.1} ms | | |\n",
        report.delete_ms.p50, report.delete_ms.p90, report.delete_ms.max
    ));
    match &report.fork_ms {
        Some(f) => out.push_str(&format!(
            "| fork({}) of a running sandbox ({} reps): p50 / p90 / max | {:.1} / {:.1} / {:.1} ms | p90 ≤ 50 ms (issue 29) | |\n",
            report.fork_count,
            f.samples.len(),
            f.p50,
            f.p90,
            f.max
        )),
        None => out.push_str(&format!("| fork({}) | not run | | |\n", report.fork_count)),
    }
    if let Some(p) = &report.fork_paused_ms {
        out.push_str(&format!(
            "| fork: the parent paused (pause call, disk copy, snapshot until the VMM resumed it): p50 / p90 / max | {:.2} / {:.2} / {:.2} ms | ≤ 5 ms (issue 29) | |\n",
            p.p50, p.p90, p.max
        ));
    }
    out.push_str(&format!(
        "| daemon VmRSS: idle → with {} live (paused) sandboxes | {} → {} | | |\n",
        report.live,
        mib(report.daemon_rss_idle_kib as f64),
        mib(report.daemon_rss_live_kib as f64)
    ));
    out.push_str(&format!(
        "| daemon memory per 1,000 sandboxes (extrapolated from {}) | {} | < 50 MiB | |\n",
        report.live,
        mib(report.daemon_kib_per_1000_extrapolated)
    ));
    if let Some(vmm) = report.vmm_rss_p50_kib {
        out.push_str(&format!(
            "| one restored VMM's VmRSS (p50 of up to 20) | {} | | |\n",
            mib(vmm)
        ));
    }
    if !report.phases.is_empty() {
        out.push_str("\nWhere the time goes at concurrency 1 (the daemon's `ROLLBOX_LOG=debug` lines, p50 ms): ");
        let parts: Vec<String> = report
            .phases
            .iter()
            .map(|(name, ms)| format!("{name} {ms:.2}"))
            .collect();
        out.push_str(&parts.join("; "));
        out.push('\n');
    }
    if let Some(first) = &report.first_failure {
        out.push_str(&format!(
            "\n**{} creates or deletes failed** (not in the figures); the first: {first}\n",
            report.failures
        ));
    }
    if report.warm_pool > 0 {
        out.push_str(&format!(
            "\nWarm pool of {} shells: {} of {} VMM launches loaded a warm shell (the rest started cold: the pool was empty, or a fork's parent).\n",
            report.warm_pool, report.warm_launches, report.launches
        ));
    }
    out.push_str(&format!(
        "\nTemplate sandbox boot {:.0} ms, its snapshot {:.0} ms.\n",
        report.template_boot_ms, report.snapshot_ms
    ));
    out
}

/// The default binaries of a workspace build.
pub fn default_paths(root: &Path) -> (PathBuf, PathBuf, PathBuf) {
    (
        root.join("target/release/rollbox"),
        root.join("target/release/rollbox-vmm"),
        root.join("target/test-guest/test-guest"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_from_debug_lines() {
        let log = "rollbox serve: listening\n\
            rollbox serve: debug: launch sb-1: spawn 1.00 ms, ready 4.00 ms\n\
            rollbox serve: debug: launch sb-2: spawn 3.00 ms, ready 6.00 ms\n\
            rollbox serve: debug: create sb-1: inserted 0.50 ms, total 6.00 ms\n";
        assert_eq!(
            phases(log),
            vec![
                ("launch: spawn".to_string(), 1.0),
                ("launch: ready".to_string(), 4.0),
                ("create: inserted".to_string(), 0.5),
                ("create: total".to_string(), 6.0),
            ]
        );
    }

    #[test]
    fn a_phase_of_one_kind_from_debug_lines() {
        let log =
            "rollbox serve: debug: fork sb-1: paused 2.50 ms, snapshot 9.00 ms, clones 20.00 ms\n\
            rollbox serve: debug: launch sb-2: paused 7.00 ms\n\
            rollbox serve: debug: fork sb-1: paused 3.25 ms, snapshot 8.00 ms, clones 21.00 ms\n";
        assert_eq!(figures(log, "fork", "paused"), [2.5, 3.25]);
        assert_eq!(figures(log, "fork", "clones"), [20.0, 21.0]);
        assert!(figures(log, "reset", "paused").is_empty());
    }
}
