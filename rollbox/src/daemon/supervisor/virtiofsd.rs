//! One virtiofsd per (sandbox, volume), started by the daemon outside the sandbox's jail with
//! virtiofsd's own sandboxing (new mount, pid and network namespaces and a `pivot_root` into
//! the volume, `--sandbox namespace`). It runs as the owner of the volume's directory when
//! neither that uid nor its gid is root ([`run_as`]; the daemon's volumes are
//! `rollbox serve --volume-uid`'s), in a user namespace of its own; else as root. It starts
//! in the volume's directory (`--shared-dir .`) and serves a socket the daemon bound in the
//! sandbox's directory (`--fd`), the jail's root, where the VMM reaches it as `/vfs-NAME.sock`:
//! it needs no way into the state directory. The pids are also written to
//! `STATE/virtiofsd/ID` (outside every jail, where no VMM can forge them), so a restarted
//! daemon can watch the virtiofsd processes of live sandboxes and end those of sandboxes that
//! are gone.

use std::os::fd::AsRawFd as _;
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::os::unix::net::UnixListener;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vmm_api::virtiofsd::LocateError;

use crate::daemon::api::VolumeMount;

use super::process::{is_ours, kill, start_time};

/// How long virtiofsd may take to enter its sandbox (over 10 s on a host running 56 guests).
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
/// jail's uid and gid, so the jailed VMM may connect), and waits until each has entered its
/// sandbox. On error the ones started are ended.
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

/// Who a volume's virtiofsd runs as, given its directory's owner (uid, gid): that owner when
/// neither is root and the daemon, as root, may switch to it; else (None) as the daemon.
pub fn run_as(owner: (u32, u32), daemon_is_root: bool) -> Option<(u32, u32)> {
    (daemon_is_root && owner.0 != 0 && owner.1 != 0).then_some(owner)
}

/// Whether an unprivileged user may make a user namespace here, as virtiofsd not run by root
/// must (some kernels forbid it: `kernel.unprivileged_userns_clone=0`,
/// `user.max_user_namespaces=0`, an LSM). Probed once, as `owner`, with `/bin/true` in a new
/// user namespace; where it fails, volumes' virtiofsd run as root, as before, and the daemon
/// says so once.
fn user_namespaces_allowed(owner: (u32, u32)) -> bool {
    static ALLOWED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ALLOWED.get_or_init(|| {
        let mut probe = Command::new("/bin/true");
        probe
            .uid(owner.0)
            .gid(owner.1)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: the closure runs between fork and exec (after the uid change) and makes one
        // async-signal-safe call, unshare.
        unsafe {
            probe.pre_exec(|| match libc::unshare(libc::CLONE_NEWUSER) {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            });
        }
        let allowed = probe.status().is_ok_and(|status| status.success());
        if !allowed {
            log::warn!(
                "volumes: this host does not let an unprivileged user make a user namespace (kernel.unprivileged_userns_clone, user.max_user_namespaces or an LSM), so volumes' virtiofsd run as root"
            );
        }
        allowed
    })
}

/// virtiofsd's arguments after `--fd N`: every guest uid and gid writes as the volume's
/// owner (`user`), whom the guest sees as root; as root, virtiofsd keeps the guest's ids.
fn id_args(user: Option<(u32, u32)>) -> Vec<String> {
    let Some((uid, gid)) = user else {
        return Vec::new();
    };
    [("uid", uid), ("gid", gid)]
        .into_iter()
        .flat_map(|(kind, id)| {
            [
                format!("--translate-{kind}"),
                format!("squash-guest:0:{id}:4294967295"),
                format!("--translate-{kind}"),
                format!("host:{id}:0:1"),
            ]
        })
        .collect()
}

fn start_one(
    binary: &Path,
    sandbox_dir: &Path,
    volume: &VolumeSource,
    owner: Option<(u32, u32)>,
) -> Result<Virtiofsd, String> {
    let name = &volume.mount.name;
    let failed = |what: String| format!("volume {name}: virtiofsd {}: {what}", binary.display());
    // Held open: virtiofsd starts in it (`--shared-dir .`), so it needs no way through the
    // state directory, which only root may enter.
    let shared = std::fs::File::open(&volume.host_path)
        .and_then(|dir| Ok((dir.metadata()?, dir)))
        .map_err(|e| failed(format!("{}: {e}", volume.host_path.display())))?;
    let (meta, shared) = shared;
    if !meta.is_dir() {
        return Err(failed(format!(
            "{} is not a directory",
            volume.host_path.display()
        )));
    }
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let user =
        run_as((meta.uid(), meta.gid()), root).filter(|&owner| user_namespaces_allowed(owner));
    // The daemon binds the socket in the sandbox's directory (just made, root's), so
    // virtiofsd needs no way there either; only the VMM's uid may connect.
    let socket = sandbox_dir.join(volume.socket_name());
    let listener = UnixListener::bind(&socket)
        .and_then(|listener| {
            std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o600))?;
            if let Some((uid, gid)) = owner {
                std::os::unix::fs::lchown(&socket, Some(uid), Some(gid))?;
            }
            Ok(listener)
        })
        .map_err(|e| failed(format!("{}: {e}", socket.display())))?;
    // As another user, virtiofsd runs from a descriptor the daemon opened: the binary's
    // directory may be closed to that user (scripts/virtiofsd.sh's cache is root's).
    let exe = match user {
        Some(_) => Some(std::fs::File::open(binary).map_err(|e| failed(e.to_string()))?),
        None => None,
    };
    let program = exe.as_ref().map_or_else(
        || binary.to_path_buf(),
        |exe| PathBuf::from(format!("/proc/self/fd/{}", exe.as_raw_fd())),
    );
    let mut command = Command::new(program);
    command
        .arg0(binary)
        .args(["--shared-dir", "."])
        .arg("--fd")
        .arg(listener.as_raw_fd().to_string())
        .args(id_args(user))
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
    let (dir_fd, listen_fd) = (shared.as_raw_fd(), listener.as_raw_fd());
    // SAFETY: between fork and exec the closure makes only async-signal-safe calls (fchdir,
    // setgroups, setresgid, setresuid, fcntl) on descriptors this function holds open until
    // the spawn has returned.
    unsafe {
        command.pre_exec(move || {
            let check = |ret: libc::c_int| match ret {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            };
            check(libc::fchdir(dir_fd))?;
            if let Some((uid, gid)) = user {
                check(libc::setgroups(0, std::ptr::null()))?;
                check(libc::setresgid(gid, gid, gid))?;
                check(libc::setresuid(uid, uid, uid))?;
            }
            // The listening socket stays open across exec (std opens all close-on-exec).
            check(libc::fcntl(listen_fd, libc::F_SETFD, 0))
        });
    }
    let mut child = command.spawn().map_err(|e| failed(e.to_string()))?;
    // virtiofsd holds the socket now: with it gone, a connect is refused, not left waiting.
    drop(listener);
    let pid = child.id();
    let ready = wait_sandboxed(&mut child, root)
        .and_then(|()| start_time(pid).ok_or_else(|| "ended at once".to_string()));
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

/// Waits until virtiofsd has entered its sandbox (its mount namespace is no longer the
/// daemon's); without one (`--sandbox none`), until it has not exited at once.
fn wait_sandboxed(child: &mut Child, namespaced: bool) -> Result<(), String> {
    let ns = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/mnt")).ok();
    let pid = child.id().to_string();
    let started = Instant::now();
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("exited before it served ({status})"));
        }
        if !namespaced || ns(&pid).is_some_and(|theirs| Some(theirs) != ns("self")) {
            return Ok(());
        }
        if started.elapsed() > READY_TIMEOUT {
            return Err(format!(
                "did not enter its sandbox within {} s",
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
    fn virtiofsd_runs_as_a_volume_owner_that_is_not_root() {
        assert_eq!(run_as((64001, 64001), true), Some((64001, 64001)));
        assert_eq!(run_as((1000, 100), true), Some((1000, 100)));
        // Root's volumes (an admin's, or made by an older daemon), or half root's: root.
        assert_eq!(run_as((0, 0), true), None);
        assert_eq!(run_as((1000, 0), true), None);
        assert_eq!(run_as((0, 1000), true), None);
        // A daemon that is not root runs it as itself.
        assert_eq!(run_as((64001, 64001), false), None);
        assert!(id_args(None).is_empty());
        assert_eq!(
            id_args(Some((64001, 64002))),
            [
                "--translate-uid",
                "squash-guest:0:64001:4294967295",
                "--translate-uid",
                "host:64001:0:1",
                "--translate-gid",
                "squash-guest:0:64002:4294967295",
                "--translate-gid",
                "host:64002:0:1",
            ]
        );
    }

    #[test]
    fn an_explicit_binary_must_exist() {
        let e = locate(Some(Path::new("/nonexistent/virtiofsd"))).expect_err("missing");
        assert!(e.contains("--virtiofsd /nonexistent/virtiofsd"), "{e}");
    }
}
