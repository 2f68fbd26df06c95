//! Supervision of one virtiofsd per volume: where the binary comes from, how it is started,
//! waiting for its socket, and killing it when the VM ends.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vmm_api::{FsCache, FsConfig};

use super::FsError;

/// How long virtiofsd may take to offer its socket (it took over 10 s on a lab host running
/// 56 guests).
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// Finds virtiofsd (the search is vmm-api's, shared with the daemon).
pub fn locate_virtiofsd(explicit: Option<&Path>) -> Result<PathBuf, FsError> {
    Ok(vmm_api::virtiofsd::locate(explicit)?)
}

/// A virtiofsd that rollbox-vmm started for one volume; killed and reaped when dropped.
pub struct Daemon {
    tag: String,
    binary: PathBuf,
    child: Child,
    /// A directory of its own, for its socket and the pid file virtiofsd writes beside it.
    dir: PathBuf,
    socket: PathBuf,
}

impl Daemon {
    /// Starts `binary` serving `config.shared_dir` on a socket in `dir` (created here, removed
    /// with the daemon) and waits until the socket exists. Running as root, virtiofsd gets new
    /// mount, pid and network namespaces and `pivot_root`s into the shared directory
    /// (`--sandbox namespace`): it sees no host path, no host process and no network, where a
    /// chroot alone would leave it the host's mounts, processes and network. Not as root (in
    /// the jailer), the jail is its sandbox: it runs with `--sandbox none` as the jail's uid,
    /// inside the jail's namespaces and root.
    pub fn start(binary: &Path, config: &FsConfig, dir: &Path) -> Result<Self, FsError> {
        let spawn_err = |source| FsError::Spawn {
            tag: config.tag.clone(),
            binary: binary.to_path_buf(),
            source,
        };
        std::fs::create_dir(dir).map_err(spawn_err)?;
        let socket = dir.join("virtiofsd.sock");
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        let cache = match config.cache {
            FsCache::Auto => "auto",
            FsCache::Always => "always",
            FsCache::Never => "never",
        };
        let mut command = Command::new(binary);
        command
            .arg("--shared-dir")
            .arg(&config.shared_dir)
            .arg("--socket-path")
            .arg(&socket)
            .args(["--cache", cache])
            .args(["--sandbox", if root { "namespace" } else { "none" }])
            .args(["--log-level", "error"])
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        if config.readonly {
            command.arg("--readonly");
        }
        // SAFETY: the closure only calls prctl, which is async-signal-safe, between fork and
        // exec. With PR_SET_PDEATHSIG the daemon also ends if rollbox-vmm is killed outright.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        // The spawner runs the binary in the virtiofsd slot (it must be this one).
        if crate::seccomp::enabled() {
            if let Err(e) = crate::seccomp::fill_slot(crate::seccomp::VIRTIOFSD_SLOT, binary) {
                let _ = std::fs::remove_dir_all(dir);
                return Err(spawn_err(std::io::Error::other(e.to_string())));
            }
        }
        // From the spawner thread: children inherit their parent thread's filter.
        let child = match crate::seccomp::spawner().spawn(command) {
            Ok(child) => child,
            Err(e) => {
                let _ = std::fs::remove_dir_all(dir);
                return Err(spawn_err(e));
            }
        };
        let mut daemon = Daemon {
            tag: config.tag.clone(),
            binary: binary.to_path_buf(),
            child,
            dir: dir.to_path_buf(),
            socket,
        };
        daemon.wait_ready()?;
        Ok(daemon)
    }

    fn wait_ready(&mut self) -> Result<(), FsError> {
        let started = Instant::now();
        loop {
            if let Some(status) = self.exited() {
                return Err(FsError::Daemon {
                    tag: self.tag.clone(),
                    detail: format!(
                        "exited before offering its socket ({status}); its stderr says why"
                    ),
                });
            }
            if self.socket.exists() {
                return Ok(());
            }
            if started.elapsed() > READY_TIMEOUT {
                return Err(FsError::Daemon {
                    tag: self.tag.clone(),
                    detail: format!(
                        "did not create {} within {} s",
                        self.socket.display(),
                        READY_TIMEOUT.as_secs()
                    ),
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The virtiofsd binary it runs.
    pub fn binary(&self) -> &Path {
        &self.binary
    }

    /// The socket it listens on.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// How it ended, if it has.
    pub fn exited(&mut self) -> Option<String> {
        match self.child.try_wait() {
            Ok(Some(status)) => Some(status.to_string()),
            Ok(None) => None,
            Err(e) => Some(format!("state unknown: {e}")),
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.exited().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn explicit_path_must_exist() {
        let err = locate_virtiofsd(Some(Path::new("/nonexistent/virtiofsd"))).expect_err("missing");
        let text = err.to_string();
        assert!(text.contains("/nonexistent/virtiofsd"), "{text}");
        assert!(text.contains("scripts/virtiofsd.sh"), "{text}");
    }

    /// As root, virtiofsd runs in namespaces of its own, not only chrooted into the volume.
    #[test]
    fn a_root_virtiofsd_runs_in_its_own_namespaces() {
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        let binary = locate_virtiofsd(None).ok().filter(|_| root);
        let Some(binary) = binary else {
            let reason = "needs root and virtiofsd (scripts/virtiofsd.sh)";
            assert!(
                std::env::var_os("ROLLBOX_REQUIRE_ALL").is_none_or(|v| v != "1"),
                "a_root_virtiofsd_runs_in_its_own_namespaces could not run: {reason}"
            );
            eprintln!("SKIP a_root_virtiofsd_runs_in_its_own_namespaces: {reason}");
            return;
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let share = dir.path().join("share");
        std::fs::create_dir(&share).expect("share");
        let config = FsConfig {
            tag: "ns".into(),
            shared_dir: share,
            readonly: false,
            cache: FsCache::Auto,
            socket: None,
        };
        let daemon = Daemon::start(&binary, &config, &dir.path().join("run")).expect("start");
        let ns = |pid: &str, kind: &str| {
            std::fs::read_link(format!("/proc/{pid}/ns/{kind}")).expect("read a namespace link")
        };
        let pid = daemon.child.id().to_string();
        // virtiofsd makes its socket before it enters its sandbox (and serves nothing before).
        let deadline = Instant::now() + Duration::from_secs(10);
        for kind in ["mnt", "net"] {
            while ns(&pid, kind) == ns("self", kind) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            assert_ne!(
                ns(&pid, kind),
                ns("self", kind),
                "virtiofsd shares the host's {kind} namespace"
            );
        }
    }

    #[test]
    fn a_daemon_that_exits_at_once_is_reported() {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = FsConfig {
            tag: "t".into(),
            shared_dir: dir.path().to_path_buf(),
            readonly: false,
            cache: FsCache::Auto,
            socket: None,
        };
        let run = dir.path().join("run");
        let err = Daemon::start(Path::new("/bin/false"), &config, &run)
            .err()
            .expect("must fail");
        assert!(
            err.to_string().contains("volume t: virtiofsd exited"),
            "{err}"
        );
        assert!(!run.exists(), "the daemon's directory is removed");
    }
}
