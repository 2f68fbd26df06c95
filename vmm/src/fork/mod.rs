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
//!
//! Here: the fork itself ([`start_fork`], [`PendingFork::finish`], [`fork`]). Beside it: the
//! launcher thread (`launcher.rs`), shells and their control socket (`shell.rs`), the warm
//! pool (`pool.rs`), each clone's drives and load (`clone.rs`), the cleanup of what clones
//! leave (`cleanup.rs`) and the fork's errors (`error.rs`).

mod cleanup;
mod clone;
mod error;
mod launcher;
mod pool;
mod shell;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::api::{CloneInfo, ForkParams, ForkResult};
use crate::background_snapshot::PendingMemory;
use crate::builder::MicroVm;
use crate::device_manager::DevicePersistKind;
use crate::persist::{create_fork_snapshot, ForkMemory, RestoreBackend};
use cleanup::{flock, remove_dir_all_quietly, remove_unused_snapshot, shm_dir, sweep_orphans, SHM};
use clone::{
    check_network_overrides, copy_drive_bases, load_clone, prepare_devices, wait_ready, Clone,
    CloneDrive,
};
use shell::spawn_shell;

pub use cleanup::{CloneCleanup, CloneGuard};
pub use clone::copy_sparse;
pub use error::ForkError;
pub use launcher::Launcher;
pub use pool::{ForkPool, ForkPoolStatus, MAX_POOL};
pub use shell::{ParentWord, ShellControl, ShellLoad};

/// How long a loaded clone may take to resume once detached (on a loaded nested lab, a
/// process can wait seconds for a CPU).
const CLONE_RESUME_TIMEOUT: Duration = Duration::from_secs(60);

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
    let kept = params.dir.is_some();
    if !kept {
        sweep_orphans(Path::new(SHM));
    }
    let dir = params.dir.clone().unwrap_or_else(|| shm_dir("fork"));
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
