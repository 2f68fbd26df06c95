//! `rollbox-bench layers`: disk and time of templates built from images that share their
//! first layers, through a real `rollbox serve`, with layer sharing off (`full`:
//! `--no-layer-sharing`) and on (`shared`: the daemon's default). N crafted OCI layouts share a
//! base of incompressible files; each adds a small task layer or two (new files, one modified
//! base file, one whiteout). Per mode: template builds and one booted sandbox per template,
//! timed, then the allocated bytes of the state directory and the image cache. Figures only.

use std::collections::{BTreeMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rollbox::daemon::client::Endpoint;
use rollbox_tests::images::{noise, Image, Layer};
use serde::Serialize;
use serde_json::{json, Value};

use crate::daemon::{ms, p99};
use crate::stats::{summarize, Summary};
use crate::test_guest::TEST_GUEST_CMDLINE;

const KEY: &str = "rollbox-bench-layers-key";
/// One template build or create may take this long.
const TIMEOUT: Duration = Duration::from_secs(600);
/// The tag every layout names its image by.
const TAG: &str = "latest";
const STATIC_AGENT: &str = "target/agent-static/x86_64-unknown-linux-gnu/release/rollbox-agent";
const MIB: usize = 1 << 20;
const PASSWD: &[u8] = b"root:x:0:0::/root:/bin/sh\n";
/// Base file sizes, repeated until the base is full: many files of mixed sizes.
const SIZES: [usize; 8] = [300, 4096, 20_000, 65_536, 300_000, MIB, 3 * MIB, 200];

/// The flag that turns layer sharing off, which `full` passes.
pub const NO_SHARING_FLAG: &str = "--no-layer-sharing";

/// A failed layers benchmark (never a slow one).
#[derive(Debug, thiserror::Error)]
pub enum LayersBenchError {
    #[error("{path} is missing: {hint}")]
    Missing { path: PathBuf, hint: &'static str },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot start {program}: {source}")]
    Spawn {
        program: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "rollbox serve (mode {mode}) {what}; started as `{flags}`{hint}; its stderr ends:\n{tail}"
    )]
    Daemon {
        mode: Mode,
        what: String,
        flags: String,
        hint: String,
        tail: String,
    },
    #[error("{what}: {message}")]
    Request { what: String, message: String },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> LayersBenchError + '_ {
    move |source| LayersBenchError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Layer sharing off (`rollbox serve --no-layer-sharing`) or on (the daemon's default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Full,
    Shared,
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Mode::Full => "full",
            Mode::Shared => "shared",
        })
    }
}

/// The flags of `rollbox-bench layers`.
#[derive(clap::Args, Debug)]
pub struct LayersArgs {
    /// Images (and so templates and sandboxes) per mode.
    #[arg(long, default_value_t = 20)]
    images: usize,
    /// MiB of incompressible files in the shared base.
    #[arg(long, default_value_t = 256)]
    base_mib: usize,
    /// Layers the base is split into.
    #[arg(long, default_value_t = 3)]
    base_layers: usize,
    /// MiB each image adds in its own layer(s).
    #[arg(long, default_value_t = 8)]
    task_mib: usize,
    /// Modes, in order: full (`rollbox serve --no-layer-sharing`), shared (the default).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "full,shared")]
    modes: Vec<Mode>,
    /// The rollbox CLI [default: target/release/rollbox].
    #[arg(long)]
    rollbox: Option<PathBuf>,
    /// The VMM binary [default: target/release/rollbox-vmm].
    #[arg(long)]
    vmm: Option<PathBuf>,
    /// The test guest ELF, every template's kernel [default: target/test-guest/test-guest].
    #[arg(long)]
    guest: Option<PathBuf>,
    /// The static guest agent installed into the images (`rollbox serve --agent`)
    /// [default: target/agent-static/x86_64-unknown-linux-gnu/release/rollbox-agent].
    #[arg(long)]
    agent: Option<PathBuf>,
    /// Where the work directory (layouts, state directories, caches) goes; removed at the end.
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
    /// Run the VMMs without rollbox-jailer (`rollbox serve --no-jailer`).
    #[arg(long)]
    no_jailer: bool,
    /// Also write the figures as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Allocated bytes (st_blocks * 512), each inode counted once, in the first part it is met
/// in: templates, the rest of the state directory, the image cache, then sandboxes.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Disk {
    /// `STATE/templates`.
    pub templates: u64,
    /// The rest of the state directory but `sandboxes` (database, snapshots, any layer store).
    pub other_state: u64,
    /// The image cache (`--image-cache`).
    pub cache: u64,
    /// `STATE/sandboxes`.
    pub sandboxes: u64,
    /// Entries on another file system (mounts) that were not counted.
    pub skipped_mounts: u64,
}

/// One mode's figures.
#[derive(Debug, Serialize)]
pub struct ModeReport {
    pub mode: Mode,
    pub disk: Disk,
    /// templates + other_state + cache: what the N templates take.
    pub templates_total_bytes: u64,
    pub per_template_bytes: f64,
    pub per_sandbox_bytes: f64,
    pub build_ms: Summary,
    pub build_p99_ms: f64,
    pub create_ms: Summary,
    pub create_p99_ms: f64,
}

/// Everything measured.
#[derive(Debug, Serialize)]
pub struct LayersReport {
    pub images: usize,
    pub base_mib: usize,
    pub base_layers: usize,
    pub task_mib: usize,
    pub jailed: bool,
    pub modes: Vec<ModeReport>,
}

/// What to run: the arguments with the paths resolved.
struct Config {
    args: LayersArgs,
    rollbox: PathBuf,
    vmm: PathBuf,
    guest: PathBuf,
    agent: PathBuf,
}

/// The image layouts: one directory each, the base blobs hard-linked to the first one's.
fn write_images(config: &Config, dir: &Path) -> Result<Vec<PathBuf>, LayersBenchError> {
    let a = &config.args;
    let task_bytes = a.task_mib * MIB;
    let pool = noise(a.base_mib * MIB + a.images * task_bytes);
    let base_bytes = a.base_mib * MIB;
    // The base: files cut from the noise, round-robin over the base layers.
    let layers_n = a.base_layers.max(1);
    let mut layers: Vec<Layer> = (0..layers_n)
        .map(|l| {
            let usr = ["etc", "usr", "usr/lib", &format!("usr/lib/base{l}")];
            usr.iter()
                .fold(Layer::new(), |layer, d| layer.dir(d, 0o755, 0, 0))
        })
        .collect();
    layers[0] = std::mem::take(&mut layers[0]).file("etc/passwd", PASSWD, 0o644, 0, 0);
    let mut files: Vec<String> = Vec::new();
    let mut at = 0;
    let mut n = 0;
    while at < base_bytes {
        let len = SIZES[n % SIZES.len()].min(base_bytes - at);
        let l = n % layers_n;
        let sub = format!("usr/lib/base{l}/d{}", n / (16 * layers_n));
        let path = format!("{sub}/f{n}.bin");
        let mut layer = std::mem::take(&mut layers[l]);
        if n % (16 * layers_n) < layers_n {
            layer = layer.dir(&sub, 0o755, 0, 0);
        }
        layer = layer.file(&path, &pool[at..at + len], 0o644, 0, 0);
        if n % 10 == 0 {
            layer = layer.symlink(&format!("{sub}/link{n}"), &format!("f{n}.bin"));
        }
        layers[l] = layer;
        files.push(path);
        at += len;
        n += 1;
    }
    let base: Vec<Vec<u8>> = layers.into_iter().map(Layer::tar).collect();
    eprintln!(
        "layers: base of {} files, {} MiB in {} layers",
        files.len(),
        a.base_mib,
        base.len()
    );
    let mut dirs: Vec<PathBuf> = Vec::new();
    for i in 0..a.images {
        let task = &pool[base_bytes + i * task_bytes..base_bytes + (i + 1) * task_bytes];
        // Odd images split their task into two layers.
        let parts = if i % 2 == 1 { 2 } else { 1 };
        let mut all = base.clone();
        for p in 0..parts {
            let chunk = &task[p * task.len() / parts..(p + 1) * task.len() / parts];
            let mut layer =
                Layer::new()
                    .dir("opt", 0o755, 0, 0)
                    .dir(&format!("opt/task{i}"), 0o755, 0, 0);
            for (k, bytes) in chunk.chunks(MIB / 2).enumerate() {
                layer = layer.file(&format!("opt/task{i}/p{p}-{k}.bin"), bytes, 0o644, 0, 0);
            }
            if p == 0 && !files.is_empty() {
                // One base file modified, one deleted (a whiteout).
                let modified = &files[i % files.len()];
                let gone = &files[(i + files.len() / 2) % files.len()];
                let (parent, name) = gone.rsplit_once('/').unwrap_or(("", gone));
                let changed = format!("changed by image {i}\n");
                layer = layer.file(modified, changed.as_bytes(), 0o644, 0, 0).file(
                    &format!("{parent}/.wh.{name}"),
                    b"",
                    0o644,
                    0,
                    0,
                );
            }
            all.push(layer.tar());
        }
        let image = Image::new(all);
        let layout = dir.join(format!("img{i}"));
        if let Some(first) = dirs.first() {
            // Each layout is a whole image; the base blobs are one file on disk.
            std::fs::create_dir_all(layout.join("blobs/sha256")).map_err(io(&layout))?;
            for l in 0..base.len() {
                let to = image.oci_blob_path(&layout, l);
                let from = image.oci_blob_path(first, l);
                std::fs::hard_link(&from, &to).map_err(io(&to))?;
            }
        }
        image.write_oci_layout(&layout, TAG);
        eprintln!("layers: image {}/{} written", i + 1, a.images);
        dirs.push(layout);
    }
    Ok(dirs)
}

/// A child process killed and reaped when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One `rollbox serve` of one mode, in `dir` (state, cache, socket, log).
struct Served {
    child: Child,
    /// The host `rollbox-agent --listen-unix` that answers for every sandbox's agent (the test
    /// guest runs none, and a create from an image's template waits for its agent).
    _agent: Killed,
    dir: PathBuf,
    /// Reaped: its pid may belong to another process now.
    stopped: bool,
}

impl Served {
    fn sock(&self) -> PathBuf {
        self.dir.join("d.sock")
    }

    fn tail(&self) -> String {
        log_tail(&self.dir.join("serve.log"))
    }

    /// A request, which must answer `status`: its JSON body.
    fn expect(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        status: u16,
    ) -> Result<Value, LayersBenchError> {
        let body = body.map(Value::to_string).map(String::into_bytes);
        let auth = format!("Bearer {KEY}");
        let headers = [("Authorization", auth.as_str())];
        let message = match Endpoint::Unix(self.sock()).request(
            method,
            path,
            &headers,
            body.as_deref(),
            TIMEOUT,
        ) {
            Ok(r) if r.status == status => {
                return Ok(serde_json::from_slice(&r.body).unwrap_or(Value::Null))
            }
            Ok(r) => format!(
                "{} (wanted {status}): {}",
                r.status,
                String::from_utf8_lossy(&r.body)
            ),
            Err(e) => e.to_string(),
        };
        let what = format!("{method} {path}");
        let message = format!("{message}; the end of the daemon's log:\n{}", self.tail());
        Err(LayersBenchError::Request { what, message })
    }

    /// SIGTERM, then SIGKILL after 10 s.
    fn stop(&mut self) {
        if std::mem::replace(&mut self.stopped, true) {
            return;
        }

        // Reaped already (it ended by itself): its pid may be another process's now.
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        if let Ok(pid) = libc::pid_t::try_from(self.child.id()) {
            // SAFETY: kill(2) on our own child's pid, which `wait` has not reaped yet.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if self.stopped {
            return;
        }
        let list = self.expect("GET", "/sandboxes?limit=1000", None, 200);
        for s in list
            .iter()
            .flat_map(|l| l["sandboxes"].as_array())
            .flatten()
        {
            if let Some(id) = s["id"].as_str() {
                let _ = self.expect("DELETE", &format!("/sandboxes/{id}"), None, 204);
            }
        }
        self.stop();
    }
}

fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// Spawns `program args` with its stdout and stderr to `log`.
fn spawn(program: &Path, args: &[String], log: &Path) -> Result<Child, LayersBenchError> {
    let out = std::fs::File::create(log).map_err(io(log))?;
    let err = out.try_clone().map_err(io(log))?;
    let mut command = Command::new(program);
    command
        .args(args)
        .env("ROLLBOX_LOG", "info")
        .stdin(Stdio::null());
    command.stdout(out).stderr(err).spawn().map_err(|source| {
        let program = program.to_path_buf();
        LayersBenchError::Spawn { program, source }
    })
}

/// Waits until `ready`, or says why not: `child` ended, or `secs` passed.
fn wait_ready(child: &mut Child, secs: u64, ready: impl Fn() -> bool) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !ready() {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("ended ({status}) before listening"));
        }
        if Instant::now() > deadline {
            return Err(format!("did not listen within {secs} s"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// A host agent and `rollbox serve` in `dir` for `mode`, once it listens.
fn serve(
    config: &Config,
    mode: Mode,
    dir: &Path,
    images: &Path,
) -> Result<Served, LayersBenchError> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    std::fs::write(dir.join("key"), format!("{KEY}\n")).map_err(io(dir))?;
    let show = |p: &Path| p.display().to_string();
    let (agent_sock, agent_log) = (dir.join("agent.sock"), dir.join("agent.log"));
    let listen = [
        &show(&agent_sock),
        "--no-init",
        "--no-set-clock",
        "--no-generation-watch",
    ];
    let listen: Vec<String> = ["--listen-unix"]
        .iter()
        .chain(&listen)
        .map(|a| a.to_string())
        .collect();
    let mut agent = Killed(spawn(&config.agent, &listen, &agent_log)?);
    if let Err(why) = wait_ready(&mut agent.0, 20, || agent_sock.exists()) {
        return Err(LayersBenchError::Request {
            what: format!("the host agent {}", config.agent.display()),
            message: format!("{why}; its stderr ends:\n{}", log_tail(&agent_log)),
        });
    }
    let sock = dir.join("d.sock");
    let mut flags: Vec<String> = [
        ("--vmm", show(&config.vmm)),
        ("--socket", show(&sock)),
        ("--api-key-file", show(&dir.join("key"))),
        ("--state-dir", show(&dir.join("state"))),
        ("--image-cache", show(&dir.join("cache"))),
        ("--agent", show(&config.agent)),
        ("--template-dir", show(images)),
        ("--net-state-dir", show(&dir.join("net"))),
        ("--test-agent-socket", show(&agent_sock)),
    ]
    .into_iter()
    .flat_map(|(flag, value)| [flag.to_string(), value])
    .collect();
    flags.insert(0, "serve".into());
    if config.args.no_jailer {
        flags.push("--no-jailer".into());
    }
    if mode == Mode::Full {
        flags.push(NO_SHARING_FLAG.into());
    }
    let child = spawn(&config.rollbox, &flags, &dir.join("serve.log"))?;
    let mut served = Served {
        child,
        _agent: agent,
        dir: dir.to_path_buf(),
        stopped: false,
    };
    let Err(what) = wait_ready(&mut served.child, 30, || UnixStream::connect(&sock).is_ok()) else {
        return Ok(served);
    };
    let tail = served.tail();
    let hint = if mode == Mode::Full && tail.contains(NO_SHARING_FLAG) {
        format!(" (mode full needs `rollbox serve {NO_SHARING_FLAG}`, which this rollbox does not know: build one with layer sharing, or run --modes shared)")
    } else {
        String::new()
    };
    let flags = format!("{} {}", config.rollbox.display(), flags.join(" "));
    Err(LayersBenchError::Daemon {
        mode,
        what,
        flags,
        hint,
        tail,
    })
}

/// Allocated bytes under `root` of inodes not yet in `seen`; entries on other file systems
/// are skipped and counted in `skipped`.
fn allocated(root: &Path, seen: &mut HashSet<(u64, u64)>, skipped: &mut u64) -> u64 {
    let Ok(top) = std::fs::symlink_metadata(root) else {
        return 0;
    };
    let mut total = 0;
    let mut stack = vec![root.to_path_buf()];
    while let Some(path) = stack.pop() {
        // Gone meanwhile (a sandbox's scratch file): not counted.
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if meta.dev() != top.dev() {
            *skipped += 1;
            continue;
        }
        if seen.insert((meta.dev(), meta.ino())) {
            total += meta.blocks() * 512;
        }
        if meta.is_dir() {
            if let Ok(entries) = std::fs::read_dir(&path) {
                stack.extend(entries.flatten().map(|e| e.path()));
            }
        }
    }
    total
}

fn measure(dir: &Path) -> Disk {
    let state = dir.join("state");
    let mut seen = HashSet::new();
    let mut disk = Disk::default();
    let skipped = &mut disk.skipped_mounts;
    disk.templates = allocated(&state.join("templates"), &mut seen, skipped);
    // The state directory itself and everything in it but templates and sandboxes.
    let mut other = std::fs::symlink_metadata(&state).map_or(0, |m| {
        seen.insert((m.dev(), m.ino()));
        m.blocks() * 512
    });
    for entry in std::fs::read_dir(&state).into_iter().flatten().flatten() {
        let name = entry.file_name();
        if name != "templates" && name != "sandboxes" {
            other += allocated(&entry.path(), &mut seen, skipped);
        }
    }
    disk.other_state = other;
    disk.cache = allocated(&dir.join("cache"), &mut seen, skipped);
    disk.sandboxes = allocated(&state.join("sandboxes"), &mut seen, skipped);
    disk
}

fn figures(samples: &[f64], what: &str) -> Result<(Summary, f64), LayersBenchError> {
    let summary = summarize(samples).ok_or_else(|| LayersBenchError::Request {
        what: what.into(),
        message: "no samples".into(),
    })?;
    Ok((summary, p99(samples)))
}

fn run_mode(
    config: &Config,
    mode: Mode,
    work: &Path,
    layouts: &[PathBuf],
) -> Result<ModeReport, LayersBenchError> {
    let dir = work.join(mode.to_string());
    let mut served = serve(config, mode, &dir, &work.join("images"))?;
    let n = layouts.len();
    let mut builds = Vec::new();
    for (i, layout) in layouts.iter().enumerate() {
        let body = json!({
            "name": format!("img{i}"),
            "kernel": config.guest,
            "cmdline": TEST_GUEST_CMDLINE,
            "memory_mib": 32,
            "image": {"oci_layout": layout, "reference": TAG},
        });
        let started = Instant::now();
        served.expect("POST", "/templates", Some(&body), 201)?;
        builds.push(ms(started));
        eprintln!(
            "layers {mode}: template {}/{n} built in {:.0} ms",
            i + 1,
            ms(started)
        );
    }
    let mut creates = Vec::new();
    let mut ids = Vec::new();
    for i in 0..n {
        let body = json!({"template": format!("img{i}"), "ttl_s": 3600});
        let started = Instant::now();
        let sandbox = served.expect("POST", "/sandboxes", Some(&body), 201)?;
        creates.push(ms(started));
        let id = sandbox["id"].as_str().unwrap_or_default().to_string();
        // Paused: idle test guests poll, and N of them load a 2-core machine.
        served.expect("POST", &format!("/sandboxes/{id}/pause"), None, 200)?;
        ids.push(id);
    }
    eprintln!("layers {mode}: {n} sandboxes created; measuring disk");
    let disk = measure(&dir);
    for id in &ids {
        served.expect("DELETE", &format!("/sandboxes/{id}"), None, 204)?;
    }
    for i in 0..n {
        served.expect("DELETE", &format!("/templates/img{i}"), None, 204)?;
    }
    served.stop();
    let templates_total_bytes = disk.templates + disk.other_state + disk.cache;
    let (build_ms, build_p99_ms) = figures(&builds, "template builds")?;
    let (create_ms, create_p99_ms) = figures(&creates, "creates")?;
    let count = n.max(1) as f64;
    let report = ModeReport {
        mode,
        templates_total_bytes,
        per_template_bytes: templates_total_bytes as f64 / count,
        per_sandbox_bytes: disk.sandboxes as f64 / count,
        disk,
        build_ms,
        build_p99_ms,
        create_ms,
        create_p99_ms,
    };
    std::fs::remove_dir_all(&dir).map_err(io(&dir))?;
    Ok(report)
}

/// `rollbox-bench layers`: resolves the paths, writes the images, measures each mode.
pub fn run(args: LayersArgs, root: &Path) -> Result<LayersReport, LayersBenchError> {
    let release = root.join("target/release");
    let or = |path: &Option<PathBuf>, default: PathBuf| path.clone().unwrap_or(default);
    let config = Config {
        rollbox: or(&args.rollbox, release.join("rollbox")),
        vmm: or(&args.vmm, release.join("rollbox-vmm")),
        guest: or(&args.guest, root.join("target/test-guest/test-guest")),
        agent: or(&args.agent, root.join(STATIC_AGENT)),
        args,
    };
    let config = &config;
    for (path, hint) in [
        (&config.rollbox, "cargo build --release -p rollbox"),
        (&config.vmm, "cargo build --release -p vmm"),
        (&config.guest, "cargo xtask test-guest"),
        (
            &config.agent,
            "guest-agent/build-static.sh, or give --agent",
        ),
    ] {
        if !path.is_file() {
            let path = path.clone();
            return Err(LayersBenchError::Missing { path, hint });
        }
    }
    let a = &config.args;
    let work = a
        .dir
        .join(format!("rollbox-bench-layers-{}", std::process::id()));
    let images = work.join("images");
    std::fs::create_dir_all(&images).map_err(io(&images))?;
    let result = write_images(config, &images).and_then(|layouts| {
        let mut modes = Vec::new();
        for &mode in &a.modes {
            eprintln!("layers: mode {mode}");
            modes.push(run_mode(config, mode, &work, &layouts)?);
        }
        Ok(modes)
    });
    let _ = std::fs::remove_dir_all(&work);
    Ok(LayersReport {
        images: a.images,
        base_mib: a.base_mib,
        base_layers: a.base_layers,
        task_mib: a.task_mib,
        jailed: !a.no_jailer,
        modes: result?,
    })
}

pub fn markdown(report: &LayersReport) -> String {
    let mut out = format!(
        "## rollbox-bench layers ({} images: a {} MiB base in {} layers + {} MiB each; test guest, {})\n\n",
        report.images,
        report.base_mib,
        report.base_layers,
        report.task_mib,
        if report.jailed { "jailed" } else { "no jailer" }
    );
    let by: BTreeMap<String, &ModeReport> = report
        .modes
        .iter()
        .map(|m| (m.mode.to_string(), m))
        .collect();
    let (full, shared) = (by.get("full"), by.get("shared"));
    out.push_str("| figure | full | shared | shared / full |\n| --- | ---: | ---: | ---: |\n");
    type Pick = fn(&ModeReport) -> f64;
    let bytes: [(&str, Pick); 6] = [
        ("disk of N templates (state + cache)", |m| {
            m.templates_total_bytes as f64
        }),
        ("… of it STATE/templates", |m| m.disk.templates as f64),
        ("… of it the rest of STATE", |m| m.disk.other_state as f64),
        ("… of it the image cache", |m| m.disk.cache as f64),
        ("per template", |m| m.per_template_bytes),
        ("per sandbox (STATE/sandboxes / N)", |m| m.per_sandbox_bytes),
    ];
    let times: [(&str, Pick); 4] = [
        ("template build p50 ms", |m| m.build_ms.p50),
        ("template build p99 ms", |m| m.build_p99_ms),
        ("create p50 ms", |m| m.create_ms.p50),
        ("create p99 ms", |m| m.create_p99_ms),
    ];
    let rows = bytes.iter().map(|r| (r, true));
    for ((name, pick), in_mib) in rows.chain(times.iter().map(|r| (r, false))) {
        let cell = |m: Option<&&ModeReport>| match m {
            Some(m) if in_mib => format!("{:.1} MiB", pick(m) / MIB as f64),
            Some(m) => format!("{:.0}", pick(m)),
            None => "—".into(),
        };
        let ratio = match (full, shared) {
            (Some(f), Some(s)) if pick(f) > 0.0 => format!("{:.2}", pick(s) / pick(f)),
            _ => "—".into(),
        };
        let (f, s) = (cell(full), cell(shared));
        out.push_str(&format!("| {name} | {f} | {s} | {ratio} |\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disk_counts_a_hard_linked_file_once_in_the_first_part() {
        let dir = std::env::temp_dir().join(format!("layers-disk-{}", std::process::id()));
        let (templates, sandboxes) = (dir.join("state/templates"), dir.join("state/sandboxes"));
        for d in [&templates, &sandboxes, &dir.join("cache")] {
            std::fs::create_dir_all(d).expect("test directories");
        }
        std::fs::write(templates.join("rootfs.ext4"), vec![1u8; 1 << 20]).expect("a file");
        std::fs::hard_link(templates.join("rootfs.ext4"), dir.join("cache/rootfs.ext4"))
            .expect("a hard link");
        std::fs::write(sandboxes.join("copy.ext4"), vec![2u8; 1 << 20]).expect("a copy");
        let disk = measure(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        assert!(disk.templates >= 1 << 20, "{disk:?}");
        assert!(disk.cache < 1 << 20, "the link counted twice: {disk:?}");
        assert!(disk.sandboxes >= 1 << 20, "{disk:?}");
    }
}
