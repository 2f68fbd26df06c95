//! The supervisor: the `rollbox-vmm` processes, one per sandbox, each inside `rollbox-jailer`
//! unless `--no-jailer` ([`vm`] spawns them and speaks to their API, [`snapshot`] takes their
//! snapshots). It launches and stops VMMs, knows which ones it started (so it reaps them)
//! and which one a sandbox is being snapshotted or reset on, finds VMMs again after a
//! restart, and owns the sandboxes' host cgroups: a jail's groups, or the daemon's own cpu
//! group of an unjailed VMM with a `cpu_limit` (the cgroup files themselves are
//! `rollbox_jailer::cgroup`'s).

mod cpu;
mod disk;
pub mod jaildir;
mod process;
mod shell;
pub mod snapshot;
pub mod virtiofsd;
pub mod vm;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use rollbox_jailer::cgroup::{self, Cgroups};

use vmm_api::VmState;

use super::api::{Sandbox, Snapshot, Template};
use virtiofsd::{Recorded, Records, Virtiofsd, VolumeSource};

use super::util::{ms_since, remove_dir};
use jaildir::JailDir;

pub use cpu::cpu_ms;
pub use shell::{Shell, ShellShape};

/// A supervisor that cannot start.
#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    #[error("jailer {path}: {why} (or run `rollbox serve --no-jailer`)")]
    Jailer { path: PathBuf, why: String },
    #[error("state directory {path}: {source}")]
    StateDir {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// `rollbox serve`'s jailer settings.
#[derive(Debug, Clone)]
pub struct JailerOptions {
    /// The `rollbox-jailer` binary.
    pub binary: PathBuf,
    /// The unprivileged uid and gid every VMM runs as.
    pub uid: u32,
    pub gid: u32,
}

/// What the supervisor is given.
pub struct SupervisorOptions<'a> {
    /// The `rollbox-vmm` binary.
    pub vmm: PathBuf,
    /// How long a new VMM may take to open its API socket.
    pub ready_timeout: Duration,
    /// The daemon's state directory (its cgroup root's name is derived from it).
    pub state_dir: &'a Path,
    /// One directory per sandbox, the jails' chroot base.
    pub sandboxes_dir: PathBuf,
    /// Where the cgroup hierarchies are mounted.
    pub cgroup_fs: &'a Path,
    /// `rollbox-jailer` around every VMM; None with `--no-jailer`.
    pub jailer: Option<&'a JailerOptions>,
    /// Each VMM's console file stops growing at this many bytes.
    pub console_max_bytes: u64,
    /// The virtiofsd binary for volumes (`--virtiofsd`); else it is looked for.
    pub virtiofsd: Option<PathBuf>,
}

/// VMMs this daemon started (so it reaps them); re-attached ones are only watched.
type Children = HashMap<String, Child>;

/// The VMMs of the sandboxes.
pub struct Supervisor {
    vmm: PathBuf,
    ready_timeout: Duration,
    sandboxes_dir: PathBuf,
    children: Mutex<Children>,
    /// Sandboxes whose VMM is being swapped (reset) or snapshotted: the reaper leaves them be.
    busy: Mutex<HashSet<String>>,
    /// The cpu controller for `cpu_limit`, or why there is none.
    cgroups: Result<Cgroups, String>,
    /// How VMMs are jailed; None with `--no-jailer`.
    jail: Option<vm::Jail>,
    /// Each VMM's console file cap.
    console_max_bytes: u64,
    /// The virtiofsd binary, or why there is none.
    virtiofsd: Result<PathBuf, String>,
    /// The virtiofsd processes of sandboxes' volumes this daemon started, by sandbox.
    volume_daemons: Mutex<HashMap<String, Vec<Virtiofsd>>>,
    /// Every sandbox's virtiofsd processes, as recorded (they outlive a daemon restart).
    records: Records,
}

/// When a stopped VMM's cgroups go ([`Supervisor::stop`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// Before `stop` returns: the same id's groups are made again next (a reset).
    Now,
    /// In the background: the sandbox ended, and its caller need not wait for the kernel.
    Later,
}

/// A VMM that runs, not yet handed back ([`Supervisor::adopt`]) or ended ([`Launched::reap`]).
pub struct Launched {
    child: Child,
    pub pid: u32,
    /// Its start time (/proc/PID/stat field 22).
    pub start: u64,
    /// Its volumes' virtiofsd processes.
    volume_daemons: Vec<Virtiofsd>,
}

impl Launched {
    /// Kills the VMM and its virtiofsd processes and waits for them, off the async threads.
    pub async fn reap(self) {
        reap_child(self.child).await;
        end_daemons(self.volume_daemons).await;
    }
}

/// Kills virtiofsd processes and waits for them, off the async threads.
async fn end_daemons(daemons: Vec<Virtiofsd>) {
    if !daemons.is_empty() {
        let _ = tokio::task::spawn_blocking(move || virtiofsd::end_children(daemons)).await;
    }
}

/// Marks a sandbox busy (the reaper skips it) until dropped.
pub struct Busy<'a> {
    supervisor: &'a Supervisor,
    id: String,
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.supervisor.busy_set().remove(&self.id);
    }
}

/// The jail every VMM gets: the jailer must exist and the daemon must be root.
fn jail_of(
    jailer: &JailerOptions,
    cgroup_fs: &Path,
    state_dir: &Path,
) -> Result<vm::Jail, SupervisorError> {
    let refuse = |why: String| SupervisorError::Jailer {
        path: jailer.binary.clone(),
        why,
    };
    if !jailer.binary.is_file() {
        return Err(refuse("no such file".into()));
    }
    // SAFETY: geteuid has no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Err(refuse("it needs root (namespaces, mounts, cgroups)".into()));
    }
    if jailer.uid == 0 || jailer.gid == 0 {
        return Err(refuse("--jail-uid and --jail-gid must not be 0".into()));
    }
    let has = |controller| cgroup::hierarchy(cgroup_fs, controller).is_ok();
    let (memory_limits, pids_limits) = (has("memory"), has("pids"));
    if !memory_limits || !pids_limits {
        log::warn!(
            "jailer: no {} cgroup controller under {}: jails get no such limit",
            if memory_limits { "pids" } else { "memory" },
            cgroup_fs.display()
        );
    }
    Ok(vm::Jail {
        jailer: jailer.binary.clone(),
        uid: jailer.uid,
        gid: jailer.gid,
        cgroup_fs: cgroup_fs.to_path_buf(),
        cgroup_parent: cgroup::root_name(state_dir),
        memory_limits,
        pids_limits,
    })
}

/// Kills a VMM this daemon started and waits for it, off the async threads.
async fn reap_child(mut child: Child) {
    let _ = child.kill();
    let _ = tokio::task::spawn_blocking(move || child.wait()).await;
}

impl Supervisor {
    /// Checks the jail (when there is one) and finds the host's cpu controller.
    pub fn new(options: SupervisorOptions<'_>) -> Result<Supervisor, SupervisorError> {
        let jail = options
            .jailer
            .map(|jailer| jail_of(jailer, options.cgroup_fs, options.state_dir))
            .transpose()?;
        Ok(Supervisor {
            vmm: options.vmm,
            ready_timeout: options.ready_timeout,
            sandboxes_dir: options.sandboxes_dir,
            children: Mutex::new(HashMap::new()),
            busy: Mutex::new(HashSet::new()),
            cgroups: Cgroups::find(options.cgroup_fs, &cgroup::root_name(options.state_dir))
                .map_err(|e| e.to_string()),
            jail,
            console_max_bytes: options.console_max_bytes,
            virtiofsd: virtiofsd::locate(options.virtiofsd.as_deref()),
            volume_daemons: Mutex::new(HashMap::new()),
            records: Records::new(options.state_dir.join("virtiofsd")),
        })
    }

    /// Whether sandboxes can have volumes here (a virtiofsd was found), or why not.
    pub fn volumes_available(&self) -> Result<(), String> {
        self.virtiofsd
            .as_ref()
            .map(|_| ())
            .map_err(|why| format!("this server cannot serve volumes: {why}"))
    }

    fn volume_daemons(&self) -> MutexGuard<'_, HashMap<String, Vec<Virtiofsd>>> {
        self.volume_daemons
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// The directory that holds one directory per sandbox.
    pub fn sandboxes_dir(&self) -> &Path {
        &self.sandboxes_dir
    }

    /// The uid jailed VMMs run as; None without a jail.
    pub fn jail_uid(&self) -> Option<u32> {
        self.jail.as_ref().map(|j| j.uid)
    }

    /// The uid and gid jailed VMMs run as; None without a jail.
    pub fn jail_owner(&self) -> Option<(u32, u32)> {
        self.jail.as_ref().map(|j| (j.uid, j.gid))
    }

    fn children(&self) -> MutexGuard<'_, Children> {
        self.children.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn busy_set(&self) -> MutexGuard<'_, HashSet<String>> {
        self.busy.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a snapshot or reset holds the sandbox's VMM.
    pub fn is_busy(&self, id: &str) -> bool {
        self.busy_set().contains(id)
    }

    /// Holds the sandbox's VMM for a snapshot or reset; None while another one does.
    pub fn claim(&self, id: &str) -> Option<Busy<'_>> {
        if !self.busy_set().insert(id.to_string()) {
            return None;
        }
        Some(Busy {
            supervisor: self,
            id: id.to_string(),
        })
    }

    /// The cgroups a sandbox with `cpu_limit` needs, or why the host has none.
    pub fn cgroups_for(&self, cpu_limit: Option<f64>) -> Result<Option<&Cgroups>, String> {
        match (cpu_limit, &self.cgroups) {
            (None, _) => Ok(None),
            (Some(_), Ok(groups)) => Ok(Some(groups)),
            (Some(_), Err(why)) => Err(why.clone()),
        }
    }

    /// Starts a VMM in the sandbox's directory (a boot of `template`, or a restore of
    /// `snapshot`) and waits until its VM runs; on error the VMM is gone. A restore into a new
    /// sandbox (`new_sandbox`) is a clone of the snapshot's VM: it gets a new VM generation,
    /// unless the sandbox is deterministic. `nic`: the sandbox's tap, for a boot's interface or a restored one's.
    #[allow(clippy::too_many_arguments)]
    pub async fn launch(
        &self,
        sandbox: &Sandbox,
        template: &Template,
        snapshot: Option<&Snapshot>,
        new_sandbox: bool,
        volumes: Vec<VolumeSource>,
        vfio: Vec<PathBuf>,
        nic: Option<vm::Nic>,
    ) -> Result<Launched, String> {
        let paths = vm::Paths::new(&sandbox.dir);
        let groups = self.cgroups_for(sandbox.cpu_limit)?;
        // A jailed VMM's cpu group is made by its jailer (same path, with its memory and pids
        // groups); an unjailed one's by the daemon.
        let mut cpu_settings = Vec::new();
        if let (Some(groups), Some(cores)) = (groups, sandbox.cpu_limit) {
            if self.jail.is_some() {
                cpu_settings = cgroup::quota_settings(groups.version, cores);
            } else {
                groups
                    .create(&sandbox.id, cores)
                    .map_err(|e| e.to_string())?;
            }
        }
        let groups = groups.filter(|_| self.jail.is_none());
        let vmm = self.vmm.clone();
        let template = template.clone();
        let (vcpus, memory_mib) = (sandbox.vcpus, sandbox.memory_mib);
        let deterministic = sandbox.deterministic;
        let identity = match (deterministic, new_sandbox) {
            (true, _) => vm::Identity::Exact,
            (false, true) => vm::Identity::Clone,
            (false, false) => vm::Identity::Same,
        };
        let spawn_paths = vm::Paths::new(&sandbox.dir);
        let restore = snapshot.map(|s| s.dir.clone());
        let started = std::time::Instant::now();
        let jail = self.jail.clone();
        let console_max_bytes = self.console_max_bytes;
        let virtiofsd = self.virtiofsd.clone();
        // Copying a rootfs may take a while: off the async threads.
        let spawned = tokio::task::spawn_blocking(move || {
            let spec = jail.as_ref().map(|jail| vm::JailSpec {
                jail,
                cgroups: cpu_settings,
                memory_mib,
                vfio: vfio.clone(),
            });
            let volumes = vm::Volumes {
                list: &volumes,
                virtiofsd: virtiofsd.as_deref().map_err(String::as_str),
            };
            match restore {
                Some(dir) => {
                    let restore = vm::Restore {
                        snapshot_dir: &dir,
                        rootfs: template.rootfs.is_some(),
                        base: template.base_rootfs.as_deref(),
                        identity,
                        console_max_bytes,
                        nic: nic.as_ref(),
                    };
                    vm::spawn_restore(&vmm, &spawn_paths, &restore, spec.as_ref(), &volumes)
                }
                None => {
                    let shape = vm::Shape {
                        template: &template,
                        vcpus,
                        memory_mib,
                        deterministic,
                        console_max_bytes,
                        vfio: &vfio,
                        nic: nic.as_ref(),
                    };
                    vm::spawn(&vmm, &spawn_paths, &shape, spec.as_ref(), &volumes)
                }
            }
        })
        .await
        .map_err(|e| e.to_string())?;
        let (mut child, volume_daemons) = match spawned {
            Ok(spawned) => spawned,
            Err(e) => {
                self.release(sandbox);
                return Err(e.to_string());
            }
        };
        let spawn_ms = ms_since(started);
        let pid = child.id();
        if let Some(groups) = groups {
            // At once: the VMM has not created its vCPU threads yet, and those it has move too.
            if let Err(e) = groups.enter(&sandbox.id, pid) {
                reap_child(child).await;
                end_daemons(volume_daemons).await;
                self.release(sandbox);
                return Err(e.to_string());
            }
        }
        let ready = vm::wait_ready(&mut child, &paths, self.ready_timeout).await;
        if log::log_enabled!(log::Level::Debug) {
            log::debug!(
                "launch {}: spawn {spawn_ms:.2} ms, ready {:.2} ms",
                sandbox.id,
                ms_since(started) - spawn_ms
            );
        }
        let error = match (ready, vm::start_time(pid)) {
            (Ok(()), Some(start)) => {
                return Ok(Launched {
                    child,
                    pid,
                    start,
                    volume_daemons,
                })
            }
            (Err(e), _) => e.to_string(),
            (Ok(()), None) => vm::VmError::Vanished(pid).to_string(),
        };
        reap_child(child).await;
        end_daemons(volume_daemons).await;
        self.release(sandbox);
        Err(error)
    }

    /// Takes a launched VMM as sandbox `id`'s: the supervisor reaps it when it ends, and
    /// its virtiofsd processes are recorded for a restarted daemon.
    pub fn adopt(&self, id: &str, launched: Launched) {
        let Launched {
            child,
            volume_daemons,
            ..
        } = launched;
        self.children().insert(id.to_string(), child);
        if !volume_daemons.is_empty() {
            let recorded: Vec<Recorded> = volume_daemons
                .iter()
                .map(|d| Recorded {
                    volume: d.volume.clone(),
                    pid: d.pid,
                    start: d.start,
                })
                .collect();
            if let Err(e) = self.records.write(id, &recorded) {
                log::warn!("sandbox {id}: recording its virtiofsd processes: {e}");
            }
            self.volume_daemons().insert(id.to_string(), volume_daemons);
        }
    }

    /// Ends sandbox `id`'s VMM (by pid and start time, and the child handle if this daemon
    /// started it), removes its directory and releases its cgroups, now or in the background.
    pub async fn stop(&self, id: &str, sandbox: &Sandbox, release: Release) -> Result<(), String> {
        let child = self.children().remove(id);
        let daemons = self.volume_daemons().remove(id).unwrap_or_default();
        let recorded = self.records.read(id);
        let _ = self.records.remove(id);
        let dir = sandbox.dir.clone();
        let (pid, start) = (sandbox.pid, sandbox.pid_start_time);
        let id = id.to_string();
        let removed = tokio::task::spawn_blocking(move || {
            let started = std::time::Instant::now();
            if let (Some(pid), Some(start)) = (pid, start) {
                vm::kill(pid, start, Duration::from_secs(5));
            }
            if let Some(mut child) = child {
                let _ = child.kill();
                let _ = child.wait();
            }
            virtiofsd::end_children(daemons);
            virtiofsd::end_recorded(&recorded);
            let killed_ms = ms_since(started);
            let removed = remove_dir(&dir);
            if log::log_enabled!(log::Level::Debug) {
                log::debug!(
                    "stop {id}: kill {killed_ms:.2} ms, remove {:.2} ms",
                    ms_since(started) - killed_ms
                );
            }
            removed
        })
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string());
        match release {
            Release::Now => {
                let started = std::time::Instant::now();
                self.release(sandbox);
                if log::log_enabled!(log::Level::Debug) {
                    log::debug!("stop {}: release {:.2} ms", sandbox.id, ms_since(started));
                }
            }
            Release::Later => self.release_later(sandbox),
        }
        removed
    }

    /// [`Supervisor::release`] with the jail's groups removed on a blocking thread that
    /// nobody waits for: each rmdir waits for an RCU grace period (about 20 ms on these
    /// hosts). One that fails is logged; a daemon stopped meanwhile sweeps them at its start.
    fn release_later(&self, sandbox: &Sandbox) {
        let remove = self.jail_groups_remover(&sandbox.id, "sandbox");
        tokio::task::spawn_blocking(remove);
        self.release_cpu_group(sandbox);
    }

    /// What removes the jail groups of `id` (none without a jail), logging each failure as
    /// `what` `id`'s: blocking, for a thread of its own or the caller's.
    fn jail_groups_remover(&self, id: &str, what: &'static str) -> impl FnOnce() + Send + 'static {
        let jail = self
            .jail
            .as_ref()
            .map(|jail| (jail.cgroup_fs.clone(), jail.cgroup_parent.clone()));
        let id = id.to_string();
        move || {
            if let Some((fs, parent)) = jail {
                for e in cgroup::remove_jail_groups(&fs, &parent, &id) {
                    log::warn!("{what} {id}: {e}");
                }
            }
        }
    }

    /// Why the sandbox's VMM is gone, if it ended on its own (with the end of its log: the
    /// directory goes with the sandbox).
    pub fn exited(&self, sandbox: &Sandbox) -> Option<String> {
        let exited = {
            let mut children = self.children();
            match children.get_mut(&sandbox.id) {
                Some(child) => match child.try_wait() {
                    Ok(Some(status)) => {
                        children.remove(&sandbox.id);
                        Some(format!("the VMM ended: {status}"))
                    }
                    _ => None,
                },
                None => match (sandbox.pid, sandbox.pid_start_time) {
                    (Some(pid), Some(start)) if vm::is_ours(pid, start) => None,
                    _ => Some("the VMM ended".to_string()),
                },
            }
        };
        let exited = exited.or_else(|| self.volume_gone(&sandbox.id));
        exited.map(|mut reason| {
            let tail = vm::log_tail(&sandbox.dir);
            if !tail.is_empty() {
                reason = format!("{reason}; the end of its log: {tail}");
            }
            reason
        })
    }

    /// Why a volume of the sandbox is gone: its virtiofsd ended (the guest's mount would
    /// answer nothing more, so the sandbox ends, saying which).
    fn volume_gone(&self, id: &str) -> Option<String> {
        let mut all = self.volume_daemons();
        if let Some(daemons) = all.get_mut(id) {
            for daemon in daemons.iter_mut() {
                if let Ok(Some(status)) = daemon.child.try_wait() {
                    return Some(format!(
                        "volume {}: its virtiofsd (pid {}) ended: {status}",
                        daemon.volume, daemon.pid
                    ));
                }
            }
            return None;
        }
        drop(all);
        // Started before a restart: watched by pid and start time.
        let recorded = self.records.read(id);
        virtiofsd::first_gone(&recorded).map(|daemon| {
            format!(
                "volume {}: its virtiofsd (pid {}) ended",
                daemon.volume, daemon.pid
            )
        })
    }

    /// Removes a sandbox's cgroups after its VMM ended (logged on failure).
    pub fn release(&self, sandbox: &Sandbox) {
        // A jailer that was killed left its groups (cpu, memory, pids): they go here.
        self.jail_groups_remover(&sandbox.id, "sandbox")();
        self.release_cpu_group(sandbox);
    }

    /// Removes the daemon's own cpu group of an unjailed VMM with a `cpu_limit`.
    fn release_cpu_group(&self, sandbox: &Sandbox) {
        if sandbox.cpu_limit.is_none() {
            return;
        }
        if let Ok(groups) = &self.cgroups {
            if let Err(e) = groups.remove(&sandbox.id) {
                log::warn!("sandbox {}: {e}", sandbox.id);
            }
        }
    }

    /// After a restart: kills VMMs and removes directories and cgroups of sandboxes not in
    /// `keep` (the live ones, with their VMM's pid and start time).
    pub fn sweep(&self, keep: &HashMap<String, (u32, u64)>) -> Result<(), SupervisorError> {
        for found in vm::find_vmms(&self.sandboxes_dir) {
            if keep.get(&found.id) != Some(&(found.pid, found.start_time)) {
                log::info!(
                    "killing rollbox-vmm pid {} of no live sandbox ({})",
                    found.pid,
                    found.id
                );
                vm::kill(found.pid, found.start_time, Duration::from_secs(5));
            }
        }
        for id in self.records.ids() {
            if !keep.contains_key(&id) {
                let recorded = self.records.read(&id);
                for daemon in &recorded {
                    log::info!(
                        "ending virtiofsd pid {} (volume {}) of no live sandbox ({id})",
                        daemon.pid,
                        daemon.volume
                    );
                }
                virtiofsd::end_recorded(&recorded);
                let _ = self.records.remove(&id);
            }
        }
        let entries =
            std::fs::read_dir(&self.sandboxes_dir).map_err(|source| SupervisorError::StateDir {
                path: self.sandboxes_dir.clone(),
                source,
            })?;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().to_string();
            if !keep.contains_key(&name) {
                let _ = remove_dir(&entry.path());
            }
        }
        if let Ok(groups) = &self.cgroups {
            for name in groups.reap(|name| keep.contains_key(name)) {
                log::info!("removed cgroup {name} of no live sandbox");
            }
        }
        if let Some(jail) = &self.jail {
            for (id, dir) in cgroup::all_jail_groups(&jail.cgroup_fs, &jail.cgroup_parent) {
                if !keep.contains_key(&id) && cgroup::remove_group(&dir).is_ok() {
                    log::info!("removed jail cgroup {} of no live sandbox", dir.display());
                }
            }
        }
        Ok(())
    }
}

/// `PATCH /vm` Paused or Resumed on the sandbox's VMM, off the async threads.
pub async fn set_paused(sandbox_dir: &Path, pause: bool) -> Result<(), String> {
    let paths = vm::Paths::new(sandbox_dir);
    let state = if pause {
        VmState::Paused
    } else {
        VmState::Resumed
    };
    tokio::task::spawn_blocking(move || vm::set_vm_state(&paths, state))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())
}

/// Whether the sandbox's VMM says its VM is paused (`GET /`), off the async threads.
pub async fn vm_paused(sandbox_dir: &Path) -> Result<bool, String> {
    let paths = vm::Paths::new(sandbox_dir);
    let state = tokio::task::spawn_blocking(move || vm::vm_state(&paths))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    Ok(state == "Paused")
}

/// The sandbox disk's bytes in use and its size, read below the jail's directory descriptor
/// (a `rootfs.img` symlink planted by the VMM is refused, never followed); None if unreadable.
pub fn rootfs_usage(sandbox_dir: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt as _;
    let meta = JailDir::open(sandbox_dir)
        .and_then(|dir| dir.open_file("rootfs.img"))
        .ok()?
        .metadata()
        .ok()?;
    Some((meta.blocks().saturating_mul(512), meta.len()))
}
