//! A shell: a clone process started ahead of its load with an empty VM of the parent's shape,
//! and both ends of its control socket (`ready`, `cleanup`, `load`, `loaded` or `error`,
//! `detach`, `running`).

use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::cleanup::CloneCleanup;
use super::launcher::Launcher;
use crate::api::LoadSnapshotParams;
use crate::vmm_config::MachineConfig;

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

/// The signal a shell gets when the thread that started it ends (it then removes its files).
const PARENT_DEATH_SIGNAL: libc::c_int = libc::SIGTERM;

/// A clone process started ahead of its load, with an empty VM of the parent's shape.
pub(super) struct Shell {
    pub(super) dir: PathBuf,
    pub(super) child: Child,
    pub(super) control: BufReader<UnixStream>,
    pub(super) ready: bool,
}

impl Shell {
    pub(super) fn pid(&self) -> u32 {
        self.child.id()
    }

    pub(super) fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    pub(super) fn send(&mut self, line: &str) -> std::io::Result<()> {
        let mut out = self.control.get_ref();
        out.write_all(format!("{line}\n").as_bytes())
    }

    /// The next line from the clone within `timeout`; an error names what happened.
    pub(super) fn receive(
        &mut self,
        timeout: Duration,
        waiting_for: &str,
    ) -> Result<String, String> {
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
    pub(super) fn kill(&mut self) {
        // SAFETY: signals the process group this shell leads (process_group(0) at spawn).
        unsafe { libc::kill(-(self.child.id() as libc::pid_t), libc::SIGKILL) };
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a shell in `dir` with an empty VM of `machine`'s shape. The shell creates `dir`
/// itself (with its stderr.log), so that whatever exists there has a process to remove it.
pub(super) fn spawn_shell(
    launcher: &Launcher,
    dir: &Path,
    machine: &MachineConfig,
) -> Result<Shell, String> {
    let (ours, theirs) = UnixStream::pair().map_err(|e| format!("control socket: {e}"))?;
    let fd = theirs.as_raw_fd();
    let mut cmd = Command::new(launcher.binary());
    cmd.arg("--fork-shell-fd").arg(fd.to_string());
    cmd.arg("--fork-shell-dir").arg(dir);
    cmd.arg("--api-sock").arg(dir.join("api.sock"));
    cmd.arg("--console").arg(dir.join("console.log"));
    if let Some(max) = launcher.console_max_bytes() {
        cmd.arg("--console-max-bytes").arg(max.to_string());
    }
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
