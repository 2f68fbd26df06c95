//! rollbox extension: fork a running microVM into N clones, as a library call ([`fork`], or
//! [`start_fork`] then [`PendingFork::finish`] to keep the VM's thread free while clones load).
//!
//! Each clone is a `rollbox-vmm` process (the binary given to [`Launcher::new`]) started as a
//! shell with a control socket: it builds an empty VM of the parent's shape, says `ready`, and
//! waits for one [`ShellLoad`]. The parent pauses, snapshots, copies drives, resumes, and sends
//! every clone its load; each answers `loaded` or `error ...` and runs. Once all have
//! answered, the parent sends `detach` and each clone says it runs. Until then a clone dies with its
//! parent (PR_SET_PDEATHSIG and end of file on the control socket); after it, a clone is a VM
//! of its own and outlives the parent.
//! What a clone leaves behind is removed when it ends ([`CloneCleanup`]).

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::api::{
    ActionError, CloneInfo, ForkParams, ForkResult, LoadSnapshotParams, MemBackend,
    NetworkOverride, RestoreExtension, VsockOverride,
};
use crate::background_snapshot::{BackgroundSnapshotError, DumpJob, PendingMemory, StartedDump};
use crate::builder::MicroVm;
use crate::config::MachineConfig;
use crate::device_manager::DevicePersistKind;
use crate::devices::virtio::net::NetOverride;
use crate::persist::{create_fork_snapshot, ForkMemory, RestoreBackend};

/// How long a clone may take to build its empty VM and say `ready`.
const CLONE_READY_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a clone may take to load the snapshot: a VM with a virtio-fs volume copies its
/// memory and starts virtiofsd, which on a loaded host takes far longer than a cow restore.
const CLONE_LOAD_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a loaded clone may take to resume once detached (on a loaded nested lab, a
/// process can wait seconds for a CPU).
const CLONE_RESUME_TIMEOUT: Duration = Duration::from_secs(60);
/// The most shells a warm pool may keep: each is a process with an empty VM.
pub const MAX_POOL: usize = 64;
/// The signal a shell gets when the thread that started it ends (it then removes its files).
const PARENT_DEATH_SIGNAL: libc::c_int = libc::SIGTERM;
static FORKS: AtomicU32 = AtomicU32::new(0);

/// Errors of a fork as a whole (a failing clone is reported in its [`CloneInfo`] instead).
#[derive(Debug, thiserror::Error)]
pub enum ForkError {
    /// The fork directory could not be created.
    #[error("fork directory {path}: {source}")]
    Dir {
        /// The directory.
        path: PathBuf,
        /// The failure.
        source: std::io::Error,
    },
    /// An unknown memory backend for the clones.
    #[error("restore_backend {name:?}: {reason}")]
    Backend {
        /// The name given.
        name: String,
        /// Why it is refused.
        reason: String,
    },
    /// Network overrides that do not give every clone its own taps.
    #[error("network_overrides: {0}")]
    NetworkOverrides(String),
    /// The parent's snapshot failed.
    #[error("fork snapshot into {path}: {reason}")]
    Snapshot {
        /// The snapshot directory.
        path: PathBuf,
        /// The failure.
        reason: String,
    },
    /// A microVM that cannot be forked (a PCI bus whose state is not saved).
    #[error("fork: {0}")]
    Refused(String),
    /// A pool larger than [`MAX_POOL`].
    #[error("a fork pool of {0} shells is too large: at most {MAX_POOL}")]
    PoolTooLarge(usize),
    /// The launcher thread could not start.
    #[error("cannot start the fork launcher thread: {0}")]
    Launcher(std::io::Error),
}

impl From<ForkError> for ActionError {
    fn from(e: ForkError) -> Self {
        ActionError::bad_request(e.to_string())
    }
}

/// Copies `src` to `dst`, writing only the data ranges so sparse images stay sparse.
pub fn copy_sparse(src: &Path, dst: &Path) -> std::io::Result<()> {
    let input = File::open(src)?;
    let len = input.metadata()?.len();
    let output = File::create(dst)?;
    output.set_len(len)?;
    let ranges = snapshot::memory::data_ranges(&input, src, len)
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    let mut buf = vec![0u8; 1 << 20];
    for (offset, range_len) in ranges {
        let mut done = 0;
        while done < range_len {
            let n = (range_len - done).min(buf.len() as u64) as usize;
            input.read_exact_at(&mut buf[..n], offset + done)?;
            output.write_all_at(&buf[..n], offset + done)?;
            done += n as u64;
        }
    }
    Ok(())
}

/// Work for the launcher thread: the processes it creates.
enum LauncherRequest {
    /// A clone shell.
    Spawn(Command, Sender<std::io::Result<Child>>),
    /// A background memory snapshot's writer (fork(2) of this process).
    Dump(
        DumpJob,
        Sender<Result<StartedDump, BackgroundSnapshotError>>,
    ),
}

/// Starts clone processes from one long-lived thread. PR_SET_PDEATHSIG fires when the *thread*
/// that started a child ends, so shells started from a caller's short-lived thread would die
/// early; these die when the last handle to the launcher is dropped (or the process ends).
pub struct Launcher {
    binary: PathBuf,
    requests: Sender<LauncherRequest>,
}

impl Launcher {
    /// A launcher that runs `binary` (a `rollbox-vmm`) for each clone.
    pub fn new(binary: PathBuf) -> Result<Arc<Self>, ForkError> {
        let (requests, incoming) = channel::<LauncherRequest>();
        std::thread::Builder::new()
            .name("fork-launcher".into())
            .spawn(move || {
                for request in incoming {
                    match request {
                        LauncherRequest::Spawn(mut command, reply) => {
                            let _ = reply.send(command.spawn());
                        }
                        LauncherRequest::Dump(job, reply) => {
                            let _ = reply.send(job.start());
                        }
                    }
                }
            })
            .map_err(ForkError::Launcher)?;
        Ok(Arc::new(Self { binary, requests }))
    }

    /// The `rollbox-vmm` binary clones run.
    pub fn binary(&self) -> &Path {
        &self.binary
    }

    fn spawn(&self, command: Command) -> std::io::Result<Child> {
        let ended = || std::io::Error::other("the fork launcher thread has ended");
        let (reply, answer) = channel();
        self.requests
            .send(LauncherRequest::Spawn(command, reply))
            .map_err(|_| ended())?;
        answer.recv().map_err(|_| ended())?
    }

    /// Forks the writer of a background memory snapshot from the launcher thread, which no
    /// seccomp filter keeps from creating processes.
    fn start_dump(&self, job: DumpJob) -> Result<StartedDump, BackgroundSnapshotError> {
        let path = job.path().to_path_buf();
        let ended = || BackgroundSnapshotError::Fork {
            path: path.clone(),
            source: std::io::Error::other("the fork launcher thread has ended"),
        };
        let (reply, answer) = channel();
        self.requests
            .send(LauncherRequest::Dump(job, reply))
            .map_err(|_| ended())?;
        answer.recv().map_err(|_| ended())?
    }
}

/// What a clone removes when it ends (and its parent, if alive, when it sees it end).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CloneCleanup {
    /// Directories of this clone alone (sockets, logs, drive copies): removed.
    pub own_dirs: Vec<PathBuf>,
    /// Removed if empty once `own_dirs` are gone (a pool's directory).
    pub empty_dirs: Vec<PathBuf>,
    /// The fork's snapshot directory: removed by whichever of its clones ends last. Each
    /// clone holds a shared lock on its `vmstate` while it runs.
    pub snapshot_dir: Option<PathBuf>,
}

impl CloneCleanup {
    /// Removes what this clone leaves behind; the snapshot only if no other clone holds it.
    pub fn run(&self) {
        for dir in &self.own_dirs {
            remove_dir_all_quietly(dir);
        }
        for dir in &self.empty_dirs {
            let _ = std::fs::remove_dir(dir);
        }
        if let Some(dir) = &self.snapshot_dir {
            remove_unused_snapshot(dir);
        }
    }
}

fn remove_dir_all_quietly(dir: &Path) {
    if let Err(e) = std::fs::remove_dir_all(dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            log::warn!("cannot remove {}: {e}", dir.display());
        }
    }
}

fn flock(file: &File, operation: libc::c_int) -> bool {
    // SAFETY: flock on a descriptor this function borrows; no memory is passed.
    unsafe { libc::flock(file.as_raw_fd(), operation) == 0 }
}

/// Removes a fork's snapshot directory if no clone holds a lock on its `vmstate`.
fn remove_unused_snapshot(dir: &Path) {
    match File::open(dir.join("vmstate")) {
        Ok(state) => {
            if flock(&state, libc::LOCK_EX | libc::LOCK_NB) {
                remove_dir_all_quietly(dir);
            }
        }
        // Gone already, or the snapshot was never written: remove what is left.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => remove_dir_all_quietly(dir),
        Err(e) => log::warn!("cannot check {}: {e}", dir.display()),
    }
}

/// Where forks and pools keep their files unless told otherwise.
const SHM: &str = "/dev/shm";

/// The pid in a `rollbox-fork-PID-SEQ` or `rollbox-pool-PID-SEQ` name.
fn owner_of(name: &str) -> Option<u32> {
    let rest = name
        .strip_prefix("rollbox-fork-")
        .or_else(|| name.strip_prefix("rollbox-pool-"))?;
    let (pid, seq) = rest.split_once('-')?;
    seq.parse::<u64>().ok()?;
    pid.parse().ok()
}

/// Removes what forks of processes that are gone left in `base`. A parent killed while writing
/// a fork's snapshot leaves its directory: its shells never learned of it. A fork directory is
/// removed only when no running clone holds its snapshot; a pool directory only when empty.
fn sweep_orphans(base: &Path) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(owner) = name.to_str().and_then(owner_of) else {
            continue;
        };
        if Path::new(&format!("/proc/{owner}")).exists() {
            continue;
        }
        let path = entry.path();
        if name.to_string_lossy().starts_with("rollbox-fork-") {
            remove_unused_snapshot(&path);
        } else {
            let _ = std::fs::remove_dir(&path);
        }
    }
}

/// Held by a running clone: its shared lock on the fork's snapshot; cleans up when dropped.
pub struct CloneGuard {
    cleanup: CloneCleanup,
    _snapshot_lock: Option<File>,
}

impl CloneGuard {
    /// Takes the shared lock on the snapshot named in `cleanup`.
    pub fn new(cleanup: CloneCleanup) -> Self {
        let lock = cleanup.snapshot_dir.as_ref().and_then(|dir| {
            let file = File::open(dir.join("vmstate")).ok()?;
            flock(&file, libc::LOCK_SH).then_some(file)
        });
        Self {
            cleanup,
            _snapshot_lock: lock,
        }
    }
}

impl Drop for CloneGuard {
    fn drop(&mut self) {
        self._snapshot_lock.take();
        self.cleanup.run();
    }
}

/// The load a shell gets over its control socket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShellLoad {
    /// The snapshot load, as `PUT /snapshot/load` takes it.
    pub load: LoadSnapshotParams,
    /// What the clone removes when it ends.
    pub cleanup: CloneCleanup,
}

/// What the parent said after the load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParentWord {
    /// The fork answered: the clone is on its own now.
    Detach,
    /// The control socket closed before `detach`: the parent ended or gave the clone up.
    Gone,
}

/// The clone's side of the control socket (`rollbox-vmm --fork-shell-fd`).
pub struct ShellControl {
    reader: BufReader<UnixStream>,
    cleanup: CloneCleanup,
}

impl ShellControl {
    /// Wraps the control socket inherited from the parent; `own_dir` is the shell's directory,
    /// removed if the shell ends before its load.
    pub fn new(stream: UnixStream, own_dir: &Path) -> Self {
        Self {
            reader: BufReader::new(stream),
            cleanup: CloneCleanup {
                own_dirs: vec![own_dir.to_path_buf()],
                empty_dirs: own_dir
                    .parent()
                    .map(Path::to_path_buf)
                    .into_iter()
                    .collect(),
                snapshot_dir: None,
            },
        }
    }

    /// Removes what the shell would leave behind if it ended now, before its load.
    pub fn abandon(&self) {
        self.cleanup.run();
    }

    /// The socket, for an event loop to watch.
    pub fn as_raw_fd(&self) -> RawFd {
        self.reader.get_ref().as_raw_fd()
    }

    fn say(&mut self, line: &str) -> std::io::Result<()> {
        let mut out = self.reader.get_ref();
        out.write_all(format!("{line}\n").as_bytes())
    }

    /// Tells the parent the empty VM is built.
    pub fn ready(&mut self) -> std::io::Result<()> {
        self.say("ready")
    }

    /// Waits for the load; `None` (after removing what the shell leaves) when the parent
    /// closed the socket first: pool shut down or parent gone.
    pub fn receive_load(&mut self) -> std::io::Result<Option<ShellLoad>> {
        loop {
            let mut line = String::new();
            if self.reader.read_line(&mut line)? == 0 {
                self.abandon();
                return Ok(None);
            }
            let bad = |e: serde_json::Error| {
                std::io::Error::other(format!("control socket: bad message {line:?}: {e}"))
            };
            let line = line.trim();
            if let Some(json) = line.strip_prefix("cleanup ") {
                self.cleanup = serde_json::from_str(json).map_err(bad)?;
            } else if let Some(json) = line.strip_prefix("load ") {
                return serde_json::from_str(json).map(Some).map_err(bad);
            } else {
                return Err(std::io::Error::other(format!(
                    "control socket: expected a load, got {line:?}"
                )));
            }
        }
    }

    /// Answers the load.
    pub fn answer(&mut self, result: &Result<(), String>) -> std::io::Result<()> {
        match result {
            Ok(()) => self.say("loaded"),
            Err(e) => self.say(&format!("error {}", e.replace('\n', " "))),
        }
    }

    /// Tells the parent the clone runs on its own now.
    pub fn running(&mut self) -> std::io::Result<()> {
        self.say("running")
    }

    /// Reads the parent's word after the load (call when the socket is readable).
    pub fn parent_word(&mut self) -> ParentWord {
        let mut line = String::new();
        match self.reader.read_line(&mut line) {
            Ok(n) if n > 0 && line.trim() == "detach" => ParentWord::Detach,
            _ => ParentWord::Gone,
        }
    }
}

/// A clone process started ahead of its load, with an empty VM of the parent's shape.
struct Shell {
    dir: PathBuf,
    child: Child,
    control: BufReader<UnixStream>,
    ready: bool,
}

impl Shell {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    fn send(&mut self, line: &str) -> std::io::Result<()> {
        let mut out = self.control.get_ref();
        out.write_all(format!("{line}\n").as_bytes())
    }

    /// The next line from the clone within `timeout`; an error names what happened.
    fn receive(&mut self, timeout: Duration, waiting_for: &str) -> Result<String, String> {
        let mut line = String::new();
        self.control
            .get_ref()
            .set_read_timeout(Some(timeout))
            .map_err(|e| format!("control socket: {e}"))?;
        match self.control.read_line(&mut line) {
            Ok(0) => Err(self.exit_report()),
            Ok(_) => Ok(line.trim().to_string()),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                Err(format!(
                    "no {waiting_for} within {} s",
                    timeout.as_secs_f64()
                ))
            }
            Err(e) => Err(format!("control socket: {e}")),
        }
    }

    fn exit_report(&mut self) -> String {
        let status = self
            .child
            .wait()
            .map(|s| s.to_string())
            .unwrap_or_else(|e| format!("unknown status ({e})"));
        let stderr = std::fs::read_to_string(self.dir.join("stderr.log")).unwrap_or_default();
        format!("clone exited with {status}: {}", stderr.trim())
    }

    /// Ends the process (and its process group: its virtiofsd) and reaps it.
    fn kill(&mut self) {
        // SAFETY: signals the process group this shell leads (process_group(0) at spawn).
        unsafe { libc::kill(-(self.child.id() as libc::pid_t), libc::SIGKILL) };
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a shell in `dir` with an empty VM of `machine`'s shape. The shell creates `dir`
/// itself (with its stderr.log), so that whatever exists there has a process to remove it.
fn spawn_shell(launcher: &Launcher, dir: &Path, machine: &MachineConfig) -> Result<Shell, String> {
    let (ours, theirs) = UnixStream::pair().map_err(|e| format!("control socket: {e}"))?;
    let fd = theirs.as_raw_fd();
    let mut cmd = Command::new(launcher.binary());
    cmd.arg("--fork-shell-fd").arg(fd.to_string());
    cmd.arg("--fork-shell-dir").arg(dir);
    cmd.arg("--api-sock").arg(dir.join("api.sock"));
    cmd.arg("--console").arg(dir.join("console.log"));
    cmd.arg("--log-path").arg(dir.join("vmm.log"));
    cmd.arg("--shell-memory-mib")
        .arg(machine.mem_size_mib.to_string());
    cmd.arg("--shell-vcpus").arg(machine.vcpu_count.to_string());
    if machine.track_dirty_pages {
        cmd.arg("--track-dirty-pages");
    }
    // The parent's seccomp mode (off, or a custom filter file) holds for its clones too.
    cmd.args(crate::seccomp::child_args());
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // Its own process group: a terminal's Ctrl-C to the parent does not reach clones, and
    // killing the group takes the clone's virtiofsd with it.
    cmd.process_group(0);
    let parent = std::process::id();
    // SAFETY: between fork and exec the closure calls only sigemptyset, sigaddset,
    // pthread_sigmask, prctl, getppid and fcntl, which are async-signal-safe, on a signal set on
    // its own stack and the inherited control socket it names.
    unsafe {
        cmd.pre_exec(move || {
            // The death signal stays pending until the shell can handle it (and clean up).
            let mut blocked = std::mem::zeroed::<libc::sigset_t>();
            libc::sigemptyset(&mut blocked);
            libc::sigaddset(&mut blocked, PARENT_DEATH_SIGNAL);
            // (Errors here must not allocate: another thread may have held the heap's lock.)
            let failed = libc::pthread_sigmask(libc::SIG_BLOCK, &blocked, std::ptr::null_mut());
            if failed != 0 {
                return Err(std::io::Error::from_raw_os_error(failed));
            }
            if libc::prctl(libc::PR_SET_PDEATHSIG, PARENT_DEATH_SIGNAL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent ended before the death signal was armed.
            if libc::getppid() as u32 != parent {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            let flags = libc::fcntl(fd, libc::F_GETFD);
            if flags < 0 || libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = launcher
        .spawn(cmd)
        .map_err(|e| format!("cannot start {}: {e}", launcher.binary().display()))?;
    drop(theirs);
    Ok(Shell {
        dir: dir.to_path_buf(),
        child,
        control: BufReader::new(ours),
        ready: false,
    })
}

/// How far a pool's shells are (`GET /fork-pool`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForkPoolStatus {
    /// Shells the pool keeps.
    pub target: usize,
    /// Shells that have built their empty VM.
    pub ready: usize,
}

/// Clone processes started ahead of a fork (opt-in: `--fork-pool N`, at most [`MAX_POOL`]).
/// Unused shells die with the pool, with the launcher's thread, or with the process.
pub struct ForkPool {
    launcher: Arc<Launcher>,
    dir: PathBuf,
    shells: Vec<Shell>,
    next: u32,
    target: usize,
}

impl ForkPool {
    /// A pool keeping `target` shells (0: none, every fork starts its clones) once filled.
    pub fn new(launcher: Arc<Launcher>, target: usize) -> Result<Self, ForkError> {
        if target > MAX_POOL {
            return Err(ForkError::PoolTooLarge(target));
        }
        let seq = FORKS.fetch_add(1, Ordering::SeqCst);
        Ok(Self {
            launcher,
            dir: PathBuf::from(format!("{SHM}/rollbox-pool-{}-{seq}", std::process::id())),
            shells: Vec::new(),
            next: 0,
            target,
        })
    }

    /// The launcher that starts this pool's shells and every fork's clones.
    pub fn launcher(&self) -> &Arc<Launcher> {
        &self.launcher
    }

    /// Starts shells of `vm`'s shape until the target is reached.
    pub fn refill(&mut self, vm: &MicroVm) {
        self.shells.retain_mut(|shell| {
            let alive = shell.alive();
            if !alive {
                remove_dir_all_quietly(&shell.dir);
            }
            alive
        });
        while self.shells.len() < self.target {
            let dir = self.dir.join(format!("shell-{}", self.next));
            self.next += 1;
            match spawn_shell(&self.launcher, &dir, &vm.machine) {
                Ok(shell) => self.shells.push(shell),
                Err(e) => {
                    log::warn!("fork pool: {e}");
                    return;
                }
            }
        }
    }

    fn take(&mut self) -> Option<Shell> {
        while let Some(mut shell) = self.shells.pop() {
            if shell.alive() {
                return Some(shell);
            }
            remove_dir_all_quietly(&shell.dir);
        }
        None
    }

    /// A wait, for any thread, until every shell now in the pool has built its VM (or ended),
    /// up to `timeout`.
    pub fn ready_waiter(
        &self,
        timeout: Duration,
    ) -> impl FnOnce() -> ForkPoolStatus + Send + 'static {
        let target = self.target;
        let already = self.shells.iter().filter(|s| s.ready).count();
        let pending: Vec<UnixStream> = self
            .shells
            .iter()
            .filter(|s| !s.ready)
            .filter_map(|s| s.control.get_ref().try_clone().ok())
            .collect();
        move || ForkPoolStatus {
            target,
            ready: already + wait_readable(&pending, timeout),
        }
    }
}

/// Waits until every stream has something to read (or closed), up to `timeout`; returns how
/// many have data.
fn wait_readable(streams: &[UnixStream], timeout: Duration) -> usize {
    let deadline = Instant::now() + timeout;
    let mut fds: Vec<libc::pollfd> = streams
        .iter()
        .map(|s| libc::pollfd {
            fd: s.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let mut done = 0;
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        fds.retain(|fd| fd.revents == 0);
        if fds.is_empty() {
            break;
        }
        let millis = left.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
        // SAFETY: polls `fds.len()` pollfd entries that live in `fds` for the whole call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, millis) };
        if n < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            break;
        }
        // A shell that wrote `ready` and ended since is readable and hung up: not ready.
        done += fds
            .iter()
            .filter(|fd| fd.revents & libc::POLLIN != 0 && fd.revents & libc::POLLHUP == 0)
            .count();
    }
    done
}

impl Drop for ForkPool {
    /// Closes the unused shells' control sockets (they exit and remove their files), then
    /// makes sure they ended.
    fn drop(&mut self) {
        for shell in &mut self.shells {
            let _ = shell.control.get_ref().shutdown(std::net::Shutdown::Both);
        }
        for shell in &mut self.shells {
            shell.kill();
            remove_dir_all_quietly(&shell.dir);
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

struct Clone {
    info: CloneInfo,
    shell: Option<Shell>,
    drive_overrides: Vec<(String, PathBuf)>,
    net_overrides: Vec<NetworkOverride>,
    cleanup: CloneCleanup,
}

impl Clone {
    fn fail(&mut self, error: String) {
        if self.info.error.is_none() {
            self.info.error = Some(error);
        }
        if let Some(mut shell) = self.shell.take() {
            shell.kill();
        }
        for dir in &self.cleanup.own_dirs {
            remove_dir_all_quietly(dir);
        }
        for dir in &self.cleanup.empty_dirs {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// A fork whose parent has resumed and whose clones still have to load: finish it on any
/// thread with [`PendingFork::finish`].
pub struct PendingFork {
    // Keeps the launcher thread, and with it the not yet detached clones, alive.
    _launcher: Arc<Launcher>,
    clones: Vec<Clone>,
    drives: Vec<CloneDrive>,
    has_vsock: bool,
    dir: PathBuf,
    kept: bool,
    snapshot_lock: Option<File>,
    backend: String,
    new_generation: bool,
    track_dirty_pages: bool,
    started: Instant,
    paused_ms: f64,
    /// The memory file, while a child process writes it.
    memory: Option<PendingMemory>,
}

/// Pauses `vm`, snapshots it, resumes it, and starts `params.count` clones (from `pool` where
/// it has shells): everything that needs the VM. The clones load in [`PendingFork::finish`];
/// refill the pool ([`ForkPool::refill`]) after that.
pub fn start_fork(
    vm: &mut MicroVm,
    params: &ForkParams,
    pool: &mut ForkPool,
) -> Result<PendingFork, ForkError> {
    if let Some(reason) = vm.pci.as_ref().and_then(|p| p.snapshot_refusal()) {
        return Err(ForkError::Refused(reason));
    }
    let started = Instant::now();
    let backend = params
        .restore_backend
        .clone()
        .unwrap_or_else(|| "cow".into());
    backend
        .parse::<RestoreBackend>()
        .map_err(|reason| ForkError::Backend {
            name: backend.clone(),
            reason,
        })?;
    let kinds = vm
        .devices
        .virtio_kinds()
        .map_err(|e| ForkError::Refused(e.to_string()))?;
    check_network_overrides(&kinds, params)?;
    let seq = FORKS.fetch_add(1, Ordering::SeqCst);
    let kept = params.dir.is_some();
    if !kept {
        sweep_orphans(Path::new(SHM));
    }
    let dir = params.dir.clone().unwrap_or_else(|| {
        PathBuf::from(format!("{SHM}/rollbox-fork-{}-{seq}", std::process::id()))
    });
    // Clones come from the pool of ready shells; missing ones start now and build their empty
    // VMs while the parent snapshots.
    let launcher = Arc::clone(pool.launcher());
    let mut clones: Vec<Clone> = (0..params.count)
        .map(|index| {
            let (shell, cleanup) = match pool.take() {
                Some(shell) => {
                    let cleanup = CloneCleanup {
                        own_dirs: vec![shell.dir.clone()],
                        empty_dirs: shell
                            .dir
                            .parent()
                            .map(Path::to_path_buf)
                            .into_iter()
                            .collect(),
                        snapshot_dir: None,
                    };
                    (Ok(shell), cleanup)
                }
                None => {
                    let shell_dir = dir.join(format!("clone-{index}"));
                    let cleanup = CloneCleanup {
                        own_dirs: if kept {
                            Vec::new()
                        } else {
                            vec![shell_dir.clone()]
                        },
                        empty_dirs: Vec::new(),
                        snapshot_dir: None,
                    };
                    (spawn_shell(&launcher, &shell_dir, &vm.machine), cleanup)
                }
            };
            let mut clone = Clone {
                info: CloneInfo {
                    index,
                    pid: None,
                    api_sock: PathBuf::new(),
                    vsock_uds: None,
                    console: PathBuf::new(),
                    error: None,
                },
                shell: None,
                drive_overrides: Vec::new(),
                net_overrides: params
                    .network_overrides
                    .get(index as usize)
                    .cloned()
                    .unwrap_or_default(),
                cleanup: CloneCleanup {
                    snapshot_dir: (!kept).then(|| dir.clone()),
                    ..cleanup
                },
            };
            match shell {
                Ok(shell) => {
                    clone.info.pid = Some(shell.pid());
                    clone.info.api_sock = shell.dir.join("api.sock");
                    clone.info.console = shell.dir.join("console.log");
                    clone.shell = Some(shell);
                }
                Err(e) => clone.fail(e),
            }
            clone
        })
        .collect();

    // Created once the clones run (a fresh clone creates its directory in it), so that should
    // the parent end now, they remove it.
    if let Err(source) = std::fs::create_dir_all(&dir) {
        for clone in &mut clones {
            clone.fail("the fork directory could not be created".into());
        }
        return Err(ForkError::Dir { path: dir, source });
    }
    // Should the parent end before the clones load, they remove the fork's files themselves.
    for clone in &mut clones {
        let line = serde_json::to_string(&clone.cleanup)
            .map_err(|e| e.to_string())
            .and_then(|json| {
                let shell = clone.shell.as_mut().ok_or("the clone did not start")?;
                shell
                    .send(&format!("cleanup {json}"))
                    .map_err(|e| e.to_string())
            });
        if let Err(e) = line {
            clone.fail(format!("control socket: {e}"));
        }
    }
    let was_paused = vm.paused;
    let pausing = Instant::now();
    // A vCPU that cannot be paused fails the fork like a failed snapshot. The clones'
    // snapshot must not become the parent's next diff base.
    let paused = vm.pause();
    let snapshotting = Instant::now();
    let snapshot = match paused {
        Ok(()) => create_fork_snapshot(vm, &dir.join("vmstate"), &dir.join("memory"), |job| {
            launcher.start_dump(job)
        })
        .map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    let copying = Instant::now();
    // Writable drives are copied once while the VM is paused, so they match the memory
    // snapshot; each clone copies that copy for itself while it loads.
    let live = clones.iter().any(|c| c.info.error.is_none());
    let drives = match &snapshot {
        Ok(_) if live => copy_drive_bases(&kinds, &dir),
        _ => Ok(Vec::new()),
    };
    let resuming = Instant::now();
    if !was_paused {
        vm.resume();
    }
    // The parent's pause: from asking the vCPUs to stop until they run again.
    let paused_ms = pausing.elapsed().as_secs_f64() * 1e3;
    let ms = |from: Instant, to: Instant| to.duration_since(from).as_secs_f64() * 1e3;
    log::debug!(
        "fork: parent paused {paused_ms:.2} ms, {:.2} ms after the request (shells, cleanup \
         lines): pause {:.2}, snapshot {:.2} (memory {}), drive bases {:.2}, resume {:.2}",
        ms(started, pausing),
        ms(pausing, snapshotting),
        ms(snapshotting, copying),
        match &snapshot {
            Ok(ForkMemory::Background(_)) => "written in the background",
            _ => "written while paused",
        },
        ms(copying, resuming),
        resuming.elapsed().as_secs_f64() * 1e3
    );
    let memory = match snapshot {
        Ok(ForkMemory::Written) => None,
        Ok(ForkMemory::Background(memory)) => Some(memory),
        Err(e) => {
            for clone in &mut clones {
                clone.fail("fork snapshot failed".into());
            }
            if !kept {
                remove_dir_all_quietly(&dir);
            }
            return Err(ForkError::Snapshot {
                path: dir,
                reason: e.to_string(),
            });
        }
    };
    let drives = drives.unwrap_or_else(|e| {
        for clone in &mut clones {
            clone.fail(e.clone());
        }
        Vec::new()
    });
    let has_vsock = kinds.iter().any(DevicePersistKind::is_vsock);
    // The parent holds the snapshot until every clone answered (each then holds it itself).
    let snapshot_lock = File::open(dir.join("vmstate"))
        .ok()
        .filter(|f| flock(f, libc::LOCK_SH));
    Ok(PendingFork {
        _launcher: launcher,
        clones,
        drives,
        has_vsock,
        dir,
        kept,
        snapshot_lock,
        backend,
        new_generation: params.new_generation,
        track_dirty_pages: vm.machine.track_dirty_pages,
        started,
        paused_ms,
        memory,
    })
}

impl PendingFork {
    /// Loads the snapshot into every clone in parallel, detaches the ones that loaded and
    /// returns each clone's result. Needs no access to the parent VM.
    pub fn finish(mut self) -> ForkResult {
        let state = self.dir.join("vmstate");
        let memory = self.dir.join("memory");
        if let Some(pending) = self.memory.take() {
            let waiting = Instant::now();
            match pending.wait() {
                Ok(_) => log::debug!(
                    "fork: waited {:.2} ms for the memory file",
                    waiting.elapsed().as_secs_f64() * 1e3
                ),
                Err(e) => {
                    for clone in &mut self.clones {
                        clone.fail(format!("fork snapshot failed: {e}"));
                    }
                }
            }
        }
        std::thread::scope(|scope| {
            for clone in self.clones.iter_mut().filter(|c| c.info.error.is_none()) {
                let (state, memory, backend) = (&state, &memory, &self.backend);
                let (new_generation, track) = (self.new_generation, self.track_dirty_pages);
                let (drives, has_vsock) = (&self.drives, self.has_vsock);
                scope.spawn(move || {
                    let loaded = wait_ready(clone)
                        .and_then(|()| prepare_devices(clone, drives, has_vsock))
                        .and_then(|()| {
                            load_clone(clone, track, state, memory, backend, new_generation)
                        });
                    if let Err(e) = loaded {
                        clone.fail(e);
                    }
                });
            }
        });
        for drive in self.drives.iter().filter(|d| d.copy) {
            if let Err(e) = std::fs::remove_file(&drive.source) {
                log::warn!("fork: cannot remove {}: {e}", drive.source.display());
            }
        }
        // Every clone answered: from now on each is a VM of its own, and runs.
        for clone in self.clones.iter_mut().filter(|c| c.shell.is_some()) {
            if let Some(Err(e)) = clone.shell.as_mut().map(|s| s.send("detach")) {
                clone.fail(format!("cannot detach the clone: {e}"));
            }
        }
        for clone in self.clones.iter_mut().filter(|c| c.shell.is_some()) {
            let answer = clone
                .shell
                .as_mut()
                .map(|s| s.receive(CLONE_RESUME_TIMEOUT, "answer to detach"));
            match answer {
                Some(Ok(line)) if line == "running" => {}
                Some(Ok(line)) => clone.fail(format!("clone answered {line:?} to detach")),
                Some(Err(e)) => clone.fail(e),
                None => {}
            }
        }
        let elapsed_ms = self.started.elapsed().as_secs_f64() * 1e3;
        for clone in &mut self.clones {
            let Some(shell) = clone.shell.take() else {
                continue;
            };
            let cleanup = clone.cleanup.clone();
            let mut child = shell.child;
            // Reaps the clone whenever it ends and removes what it left (if it could not).
            let reaper = std::thread::Builder::new()
                .name("fork-reaper".into())
                .spawn(move || {
                    let _ = child.wait();
                    cleanup.run();
                });
            if let Err(e) = reaper {
                log::warn!("fork: no reaper thread for clone {}: {e}", clone.info.index);
            }
        }
        self.snapshot_lock.take();
        if !self.kept {
            remove_unused_snapshot(&self.dir);
        }
        ForkResult {
            snapshot_dir: self.dir.clone(),
            paused_ms: self.paused_ms,
            elapsed_ms,
            clones: self.clones.iter().map(|c| c.info.clone()).collect(),
        }
    }
}

/// Forks `vm` into `params.count` clones and waits until each has loaded or failed.
pub fn fork(
    vm: &mut MicroVm,
    params: &ForkParams,
    pool: &mut ForkPool,
) -> Result<ForkResult, ForkError> {
    let result = start_fork(vm, params, pool)?.finish();
    // Replace the shells this fork used (after the loads, which they would slow down); they
    // build their VMs in the background.
    pool.refill(vm);
    Ok(result)
}

/// Every clone needs its own tap for every network interface of the VM.
fn check_network_overrides(
    kinds: &[DevicePersistKind],
    params: &ForkParams,
) -> Result<(), ForkError> {
    let ifaces: Vec<&str> = kinds
        .iter()
        .filter_map(DevicePersistKind::as_net)
        .map(|net| net.iface_id.as_str())
        .collect();
    if ifaces.is_empty() {
        if params.network_overrides.is_empty() {
            return Ok(());
        }
        return Err(ForkError::NetworkOverrides(
            "the VM has no network interfaces".into(),
        ));
    }
    if params.network_overrides.len() != params.count as usize {
        return Err(ForkError::NetworkOverrides(format!(
            "the VM has network interface(s) {ifaces:?}, so each of the {} clones needs its own taps: give one list of {{iface_id, host_dev_name}} per clone (got {} lists)",
            params.count,
            params.network_overrides.len()
        )));
    }
    let mut taps = std::collections::HashSet::new();
    for (index, list) in params.network_overrides.iter().enumerate() {
        for iface in &ifaces {
            if !list.iter().any(|o| o.iface_id == *iface) {
                return Err(ForkError::NetworkOverrides(format!(
                    "clone {index} has no tap for interface {iface}"
                )));
            }
        }
        for o in list {
            NetOverride::new(&o.host_dev_name, o.guest_mac.as_deref())
                .map_err(|e| ForkError::NetworkOverrides(format!("clone {index}: {e}")))?;
            if !taps.insert(o.host_dev_name.clone()) {
                return Err(ForkError::NetworkOverrides(format!(
                    "tap {} is given to two clones",
                    o.host_dev_name
                )));
            }
        }
    }
    Ok(())
}

/// A drive as the clones get it: a copy made while the parent was paused, which each clone
/// copies for itself, or a read-only image they share.
struct CloneDrive {
    id: String,
    source: PathBuf,
    copy: bool,
}

/// Copies the writable drives of `kinds` into `dir` once.
fn copy_drive_bases(kinds: &[DevicePersistKind], dir: &Path) -> Result<Vec<CloneDrive>, String> {
    let mut drives = Vec::new();
    for state in kinds.iter().filter_map(DevicePersistKind::as_drive) {
        let (id, path) = (&state.id, &state.path);
        let drive = if state.read_only {
            CloneDrive {
                id: id.clone(),
                source: path.clone(),
                copy: false,
            }
        } else {
            let base = dir.join(format!("{id}.base.img"));
            copy_sparse(path, &base)
                .map_err(|e| format!("copying drive {id} ({}): {e}", path.display()))?;
            CloneDrive {
                id: id.clone(),
                source: base,
                copy: true,
            }
        };
        drives.push(drive);
    }
    Ok(drives)
}

/// Gives the clone its own copy of each writable drive and picks its vsock socket.
fn prepare_devices(
    clone: &mut Clone,
    drives: &[CloneDrive],
    has_vsock: bool,
) -> Result<(), String> {
    let Some(dir) = clone.shell.as_ref().map(|s| s.dir.clone()) else {
        return Err("the clone did not start".into());
    };
    for drive in drives {
        let target = if drive.copy {
            let copy = dir.join(format!("{}.img", drive.id));
            copy_sparse(&drive.source, &copy)
                .map_err(|e| format!("copying drive {} for the clone: {e}", drive.id))?;
            copy
        } else {
            drive.source.clone()
        };
        clone.drive_overrides.push((drive.id.clone(), target));
    }
    if has_vsock {
        clone.info.vsock_uds = Some(dir.join("vsock.sock"));
    }
    Ok(())
}

/// Waits until the clone has built its empty VM (and created its directory).
fn wait_ready(clone: &mut Clone) -> Result<(), String> {
    let shell = clone.shell.as_mut().ok_or("the clone did not start")?;
    if !shell.ready {
        let line = shell.receive(CLONE_READY_TIMEOUT, "ready (empty VM built)")?;
        if line != "ready" {
            return Err(format!("clone failed before its load: {line}"));
        }
        shell.ready = true;
    }
    Ok(())
}

/// Sends the clone its load and waits for the answer.
fn load_clone(
    clone: &mut Clone,
    track_dirty_pages: bool,
    state: &Path,
    memory: &Path,
    backend: &str,
    new_generation: bool,
) -> Result<(), String> {
    let load = ShellLoad {
        load: LoadSnapshotParams {
            snapshot_path: state.to_path_buf(),
            mem_backend: Some(MemBackend {
                backend_type: "File".into(),
                backend_path: memory.to_path_buf(),
            }),
            mem_file_path: None,
            enable_diff_snapshots: false,
            track_dirty_pages,
            // A clone runs as soon as it has loaded; it still dies with the parent until detached.
            resume_vm: true,
            vsock_override: clone
                .info
                .vsock_uds
                .clone()
                .map(|uds_path| VsockOverride { uds_path }),
            network_overrides: clone.net_overrides.clone(),
            rollbox: Some(RestoreExtension {
                restore_backend: Some(backend.to_string()),
                new_generation,
                drive_overrides: clone.drive_overrides.iter().cloned().collect(),
                ..Default::default()
            }),
        },
        cleanup: clone.cleanup.clone(),
    };
    let json = serde_json::to_string(&load).map_err(|e| format!("encoding the load: {e}"))?;
    let shell = clone.shell.as_mut().ok_or("the clone did not start")?;
    shell
        .send(&format!("load {json}"))
        .map_err(|e| format!("sending the load: {e}"))?;
    let answer = shell.receive(CLONE_LOAD_TIMEOUT, "answer to the snapshot load")?;
    match answer.strip_prefix("error ") {
        None if answer == "loaded" => Ok(()),
        Some(why) => Err(format!("clone refused the snapshot: {why}")),
        None => Err(format!("clone answered {answer:?} to its load")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_snapshot_goes_with_the_last_clone_that_holds_it() {
        let scratch = tempfile::tempdir().expect("tempdir");
        let fork_dir = scratch.path().join("fork");
        let own = |n: u32| fork_dir.join(format!("clone-{n}"));
        for n in 0..2 {
            std::fs::create_dir_all(own(n)).expect("clone dir");
        }
        std::fs::write(fork_dir.join("vmstate"), b"state").expect("vmstate");
        let guard = |n: u32| {
            CloneGuard::new(CloneCleanup {
                own_dirs: vec![own(n)],
                empty_dirs: Vec::new(),
                snapshot_dir: Some(fork_dir.clone()),
            })
        };
        let (first, second) = (guard(0), guard(1));
        drop(first);
        assert!(!own(0).exists(), "a clone's own directory goes with it");
        assert!(
            fork_dir.join("vmstate").exists(),
            "the snapshot went while a clone still held it"
        );
        drop(second);
        assert!(
            !fork_dir.exists(),
            "the last clone leaves the snapshot behind"
        );
    }

    #[test]
    fn orphaned_fork_directories_go_unless_a_clone_holds_them_or_their_owner_lives() {
        assert_eq!(owner_of("rollbox-fork-12-3"), Some(12));
        assert_eq!(owner_of("rollbox-pool-12-3"), Some(12));
        assert_eq!(owner_of("rollbox-fork-12"), None);
        assert_eq!(owner_of("rollbox-fork-x-3"), None);
        assert_eq!(owner_of("other-12-3"), None);

        let base = tempfile::tempdir().expect("tempdir");
        // A pid that is gone: a child that has been reaped.
        let mut child = Command::new("true").spawn().expect("spawn true");
        child.wait().expect("wait");
        let dead = child.id();
        let live = std::process::id();
        let dir = |owner: u32, seq: u32, kind: &str| {
            let dir = base.path().join(format!("rollbox-{kind}-{owner}-{seq}"));
            std::fs::create_dir_all(dir.join("clone-0")).expect("mkdir");
            dir
        };
        // A parent killed mid-snapshot: only its temporary memory file.
        let half_written = dir(dead, 1, "fork");
        std::fs::write(half_written.join(".memory.tmp-1"), b"x").expect("write");
        // A finished fork whose clone still runs (holds the shared lock).
        let held = dir(dead, 2, "fork");
        std::fs::write(held.join("vmstate"), b"x").expect("write");
        let lock = File::open(held.join("vmstate")).expect("open");
        assert!(flock(&lock, libc::LOCK_SH | libc::LOCK_NB));
        // A live parent's fork, and an empty pool directory of a dead one.
        let own = dir(live, 3, "fork");
        let pool = base.path().join(format!("rollbox-pool-{dead}-4"));
        std::fs::create_dir(&pool).expect("mkdir");

        sweep_orphans(base.path());
        assert!(
            !half_written.exists(),
            "a dead parent's half-written fork stayed"
        );
        assert!(held.exists(), "a fork a running clone holds was removed");
        assert!(own.exists(), "a live parent's fork was removed");
        assert!(
            !pool.exists(),
            "a dead parent's empty pool directory stayed"
        );
        drop(lock);
        sweep_orphans(base.path());
        assert!(!held.exists(), "the fork stayed after its last clone ended");
    }

    #[test]
    fn a_pool_larger_than_the_limit_is_refused() {
        let launcher = Launcher::new(PathBuf::from("/nonexistent/rollbox-vmm")).expect("launcher");
        let error = ForkPool::new(Arc::clone(&launcher), MAX_POOL + 1)
            .err()
            .expect("refused");
        assert_eq!(
            error.to_string(),
            "a fork pool of 65 shells is too large: at most 64"
        );
        assert!(ForkPool::new(launcher, MAX_POOL).is_ok());
    }
}
