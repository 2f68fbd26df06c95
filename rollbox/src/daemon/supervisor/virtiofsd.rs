//! One virtiofsd per (sandbox, volume), started by the daemon outside the sandbox's jail with
//! virtiofsd's own sandboxing (as root: new mount, pid and network namespaces and a
//! `pivot_root` into the volume, `--sandbox namespace`). Its vhost-user socket is made in the
//! sandbox's directory, which is the jail's root, so the VMM reaches it as `/vfs-NAME.sock`.
//! The pids are also written to `STATE/virtiofsd/ID` (outside every jail, where no VMM can
//! forge them), so a restarted daemon can watch the virtiofsd processes of live sandboxes and
//! end those of sandboxes that are gone.

use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vmm_api::virtiofsd::LocateError;

use crate::daemon::api::VolumeMount;

use super::process::{is_ours, kill, start_time};

/// How long virtiofsd may take to offer its socket.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// A volume to serve: how the sandbox mounts it, and its directory on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct VolumeSource {
    pub mount: VolumeMount,
    pub host_path: PathBuf,
}

impl VolumeSource {
    /// The socket's name in the sandbox's directory.
    pub fn socket_name(&self) -> String {
        format!("vfs-{}.sock", self.mount.name)
    }
}

/// A virtiofsd this daemon started.
pub struct Virtiofsd {
    pub volume: String,
    pub child: Child,
    pub pid: u32,
    pub start: u64,
}

/// A virtiofsd a record names (one this daemon, or one before a restart, started).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    pub volume: String,
    pub pid: u32,
    pub start: u64,
}

/// Finds virtiofsd (`rollbox serve --virtiofsd`, then as rollbox-vmm does:
/// [`vmm_api::virtiofsd::locate`]); why not, with how to get one.
pub fn locate(explicit: Option<&Path>) -> Result<PathBuf, String> {
    vmm_api::virtiofsd::locate(explicit).map_err(|e| match e {
        LocateError::NotFound => format!("{e} (scripts/virtiofsd.sh builds one)"),
        _ => e.to_string(),
    })
}

/// Starts one virtiofsd per volume with its socket in `sandbox_dir` (owned by `owner`, the
/// jail's uid and gid, so the jailed VMM may connect), and waits for every socket. On error
/// the ones started are ended.
pub fn start_all(
    binary: &Path,
    sandbox_dir: &Path,
    volumes: &[VolumeSource],
    owner: Option<(u32, u32)>,
) -> Result<Vec<Virtiofsd>, String> {
    let mut started: Vec<Virtiofsd> = Vec::new();
    for volume in volumes {
        match start_one(binary, sandbox_dir, volume, owner) {
            Ok(daemon) => started.push(daemon),
            Err(e) => {
                end_children(started);
                return Err(e);
            }
        }
    }
    Ok(started)
}

fn start_one(
    binary: &Path,
    sandbox_dir: &Path,
    volume: &VolumeSource,
    owner: Option<(u32, u32)>,
) -> Result<Virtiofsd, String> {
    let name = &volume.mount.name;
    let socket = sandbox_dir.join(volume.socket_name());
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let mut command = Command::new(binary);
    command
        .arg("--shared-dir")
        .arg(&volume.host_path)
        .arg("--socket-path")
        .arg(&socket)
        // Several sandboxes write one volume: no guest caches what another changed.
        .args(["--cache", "never"])
        .args(["--sandbox", if root { "namespace" } else { "none" }])
        .args(["--log-level", "error"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        // Its own group: a signal to the daemon's does not reach it; ending it ends it alone.
        .process_group(0);
    if volume.mount.readonly {
        command.arg("--readonly");
    }
    let failed = |what: String| format!("volume {name}: virtiofsd {}: {what}", binary.display());
    let mut child = command.spawn().map_err(|e| failed(e.to_string()))?;
    let pid = child.id();
    let ready = wait_socket(&mut child, &socket)
        .and_then(|()| start_time(pid).ok_or_else(|| "ended at once".to_string()))
        .and_then(|start| {
            if let Some((uid, gid)) = owner {
                std::os::unix::fs::lchown(&socket, Some(uid), Some(gid))
                    .map_err(|e| format!("chown {}: {e}", socket.display()))?;
            }
            Ok(start)
        });
    match ready {
        Ok(start) => Ok(Virtiofsd {
            volume: name.clone(),
            child,
            pid,
            start,
        }),
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            Err(failed(e))
        }
    }
}

fn wait_socket(child: &mut Child, socket: &Path) -> Result<(), String> {
    let started = Instant::now();
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("exited before offering its socket ({status})"));
        }
        if socket.exists() {
            return Ok(());
        }
        if started.elapsed() > READY_TIMEOUT {
            return Err(format!(
                "did not create {} within {} s",
                socket.display(),
                READY_TIMEOUT.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Kills and reaps virtiofsd processes this daemon started.
pub fn end_children(children: Vec<Virtiofsd>) {
    for mut daemon in children {
        let _ = daemon.child.kill();
        let _ = daemon.child.wait();
    }
}

/// Ends recorded virtiofsd processes (by pid and start time: a reused pid is left alone).
pub fn end_recorded(recorded: &[Recorded]) {
    for daemon in recorded {
        kill(daemon.pid, daemon.start, Duration::from_secs(5));
    }
}

/// The first recorded virtiofsd that is gone, by volume.
pub fn first_gone(recorded: &[Recorded]) -> Option<&Recorded> {
    recorded.iter().find(|d| !is_ours(d.pid, d.start))
}

/// The records of sandboxes' virtiofsd processes: one file per sandbox in a daemon-owned
/// directory, a line `VOLUME PID START` per process.
pub struct Records {
    dir: PathBuf,
}

impl Records {
    pub fn new(dir: PathBuf) -> Records {
        Records { dir }
    }

    fn file(&self, id: &str) -> PathBuf {
        self.dir.join(id)
    }

    /// Records a sandbox's virtiofsd processes (none: removes its record).
    pub fn write(&self, id: &str, daemons: &[Recorded]) -> std::io::Result<()> {
        if daemons.is_empty() {
            return self.remove(id);
        }
        std::fs::create_dir_all(&self.dir)?;
        let text: String = daemons
            .iter()
            .map(|d| format!("{} {} {}\n", d.volume, d.pid, d.start))
            .collect();
        std::fs::write(self.file(id), text)
    }

    /// A sandbox's recorded virtiofsd processes (none when it has no record).
    pub fn read(&self, id: &str) -> Vec<Recorded> {
        let Ok(text) = std::fs::read_to_string(self.file(id)) else {
            return Vec::new();
        };
        text.lines()
            .filter_map(|line| {
                let mut fields = line.split(' ');
                let volume = fields.next()?.to_string();
                let pid = fields.next()?.parse().ok()?;
                let start = fields.next()?.parse().ok()?;
                Some(Recorded { volume, pid, start })
            })
            .collect()
    }

    pub fn remove(&self, id: &str) -> std::io::Result<()> {
        match std::fs::remove_file(self.file(id)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// The ids of every sandbox with a record.
    pub fn ids(&self) -> Vec<String> {
        std::fs::read_dir(&self.dir)
            .map(|entries| {
                entries
                    .flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_go() {
        let dir = tempfile::tempdir().expect("tempdir");
        let records = Records::new(dir.path().join("virtiofsd"));
        assert!(records.read("sb-1").is_empty());
        let daemons = vec![
            Recorded {
                volume: "data".into(),
                pid: 10,
                start: 20,
            },
            Recorded {
                volume: "ckpt".into(),
                pid: 11,
                start: 21,
            },
        ];
        records.write("sb-1", &daemons).expect("write");
        assert_eq!(records.read("sb-1"), daemons);
        assert_eq!(records.ids(), ["sb-1"]);
        assert_eq!(
            first_gone(&daemons).map(|d| d.volume.as_str()),
            Some("data")
        );
        records.write("sb-1", &[]).expect("none");
        assert!(records.ids().is_empty());
    }

    #[test]
    fn an_explicit_binary_must_exist() {
        let e = locate(Some(Path::new("/nonexistent/virtiofsd"))).expect_err("missing");
        assert!(e.contains("--virtiofsd /nonexistent/virtiofsd"), "{e}");
    }
}
