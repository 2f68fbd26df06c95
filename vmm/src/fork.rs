//! rollbox extension: fork a running microVM into N clones. Clone processes start first, each
//! pre-building an empty VM of the parent's shape while the parent pauses for a snapshot; then
//! each clone loads the snapshot over its API socket. Every clone has its own vsock socket,
//! drive copies, API socket and console, and succeeds or fails on its own.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::api::http::unix_request;
use crate::api::{ActionError, CloneInfo, ForkParams, ForkResult, NetworkOverride};
use crate::builder::MicroVm;
use crate::devices::bus::lock;
use crate::devices::virtio::persist::DevicePersistKind;
use crate::persist::{create_snapshot, RestoreBackend, SnapshotType};

/// How long a clone may take to come up.
const CLONE_READY_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a clone may take to load the snapshot: a VM with a virtio-fs volume copies its
/// memory and starts virtiofsd, which on a loaded host takes far longer than a cow restore.
const CLONE_LOAD_TIMEOUT: Duration = Duration::from_secs(120);
static FORKS: AtomicU32 = AtomicU32::new(0);

fn io_fail(what: &str, path: &Path, e: std::io::Error) -> ActionError {
    ActionError::bad_request(format!("{what} {}: {e}", path.display()))
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

/// Clone processes started ahead of a fork, each with an empty VM of the parent's shape, so
/// a fork only pauses, snapshots and sends load requests.
pub struct ForkPool {
    dir: PathBuf,
    shells: Vec<Clone>,
    next: u32,
    target: usize,
}

impl ForkPool {
    /// An empty pool keeping `target` shells ready once filled.
    pub fn new(target: usize) -> Self {
        Self {
            dir: PathBuf::from(format!("/dev/shm/rollbox-pool-{}", std::process::id())),
            shells: Vec::new(),
            next: 0,
            target,
        }
    }

    /// Starts shells until `target` are waiting (or at least `at_least`, if larger).
    pub fn refill(&mut self, vm: &MicroVm, at_least: usize) {
        self.target = self.target.max(at_least);
        let Ok(exe) = std::env::current_exe() else {
            return;
        };
        while self.shells.len() < self.target {
            let index = self.next;
            self.next += 1;
            let mut clone = Clone::new(index, self.dir.join(format!("shell-{index}")));
            match spawn_shell(&exe, &clone, vm) {
                Ok(child) => {
                    clone.info.pid = Some(child.id());
                    clone.child = Some(child);
                    self.shells.push(clone);
                }
                Err(e) => {
                    log::warn!("fork pool: {e}");
                    return;
                }
            }
        }
    }

    fn take(&mut self) -> Option<Clone> {
        while let Some(mut clone) = self.shells.pop() {
            let alive = clone
                .child
                .as_mut()
                .is_some_and(|c| matches!(c.try_wait(), Ok(None)));
            if alive {
                return Some(clone);
            }
        }
        None
    }
}

impl Drop for ForkPool {
    /// Stops the unused shells; clones already handed out keep running with their files.
    fn drop(&mut self) {
        for clone in &mut self.shells {
            clone.fail("pool shut down".into());
            let _ = std::fs::remove_dir_all(&clone.dir);
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

struct Clone {
    info: CloneInfo,
    dir: PathBuf,
    child: Option<Child>,
    drive_overrides: Vec<(String, PathBuf)>,
    net_overrides: Vec<NetworkOverride>,
}

impl Clone {
    fn new(index: u32, dir: PathBuf) -> Self {
        Clone {
            info: CloneInfo {
                index,
                pid: None,
                api_sock: dir.join("api.sock"),
                vsock_uds: None,
                console: dir.join("console.log"),
                error: None,
            },
            dir,
            child: None,
            drive_overrides: Vec::new(),
            net_overrides: Vec::new(),
        }
    }

    fn fail(&mut self, error: String) {
        if self.info.error.is_none() {
            self.info.error = Some(error);
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Pauses `vm`, snapshots it, resumes it, and starts `params.count` clones.
pub fn fork(
    vm: &mut MicroVm,
    params: &ForkParams,
    pool: &mut ForkPool,
) -> Result<ForkResult, ActionError> {
    let started = Instant::now();
    let seq = FORKS.fetch_add(1, Ordering::SeqCst);
    let dir = params.dir.clone().unwrap_or_else(|| {
        PathBuf::from(format!(
            "/dev/shm/rollbox-fork-{}-{seq}",
            std::process::id()
        ))
    });
    std::fs::create_dir_all(&dir).map_err(|e| io_fail("cannot create", &dir, e))?;
    let backend = params
        .restore_backend
        .clone()
        .unwrap_or_else(|| "cow".into());
    backend
        .parse::<RestoreBackend>()
        .map_err(ActionError::bad_request)?;
    let exe = std::env::current_exe()
        .map_err(|e| ActionError::bad_request(format!("cannot find rollbox-vmm: {e}")))?;

    // Clones come from the pool of ready shells; missing ones start now and build their empty
    // VMs while the parent snapshots.
    let mut clones: Vec<Clone> = (0..params.count)
        .map(|index| {
            let mut clone = match pool.take() {
                Some(shell) => shell,
                None => {
                    let mut clone = Clone::new(index, dir.join(format!("clone-{index}")));
                    match spawn_shell(&exe, &clone, vm) {
                        Ok(child) => {
                            clone.info.pid = Some(child.id());
                            clone.child = Some(child);
                        }
                        Err(e) => clone.fail(e),
                    }
                    clone
                }
            };
            clone.info.index = index;
            clone
        })
        .collect();

    let kinds: Vec<DevicePersistKind> = vm
        .virtio
        .iter()
        .map(|s| lock(&s.transport).device().persist_kind())
        .collect();
    check_network_overrides(&kinds, params)?;
    for clone in &mut clones {
        clone.net_overrides = params
            .network_overrides
            .get(clone.info.index as usize)
            .cloned()
            .unwrap_or_default();
    }
    let was_paused = vm.paused;
    // A vCPU that cannot be paused fails the fork like a failed snapshot.
    let snapshot = match vm.pause() {
        Ok(()) => create_snapshot(
            vm,
            SnapshotType::Full,
            &dir.join("vmstate"),
            &dir.join("memory"),
        )
        .map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    // Drives are copied while the VM is paused, so they match the memory snapshot.
    if snapshot.is_ok() {
        for clone in clones.iter_mut().filter(|c| c.info.error.is_none()) {
            if let Err(e) = prepare_devices(clone, &kinds) {
                clone.fail(e);
            }
        }
    }
    if !was_paused {
        vm.resume();
    }
    let paused_ms = started.elapsed().as_secs_f64() * 1e3;
    if let Err(e) = snapshot {
        for clone in &mut clones {
            clone.fail("fork snapshot failed".into());
        }
        return Err(ActionError::bad_request(format!("fork snapshot: {e}")));
    }

    let state_path = dir.join("vmstate");
    let memory_path = dir.join("memory");
    let track_dirty_pages = vm.machine.track_dirty_pages;
    std::thread::scope(|scope| {
        for clone in clones.iter_mut().filter(|c| c.info.error.is_none()) {
            let (state_path, memory_path, backend) = (&state_path, &memory_path, &backend);
            scope.spawn(move || {
                if let Err(e) = load_clone(
                    clone,
                    track_dirty_pages,
                    state_path,
                    memory_path,
                    backend,
                    params.new_generation,
                ) {
                    clone.fail(e);
                }
            });
        }
    });
    let elapsed_ms = started.elapsed().as_secs_f64() * 1e3;
    // Replace the shells this fork used; they build their VMs in the background.
    pool.refill(vm, params.count as usize);
    let clones = clones
        .into_iter()
        .map(|mut c| {
            if let Some(mut child) = c.child.take() {
                // Reap the clone whenever it ends; it outlives this request.
                std::thread::spawn(move || child.wait());
            }
            c.info
        })
        .collect();
    Ok(ForkResult {
        snapshot_dir: dir,
        paused_ms,
        elapsed_ms,
        clones,
    })
}

/// Starts a clone process that pre-builds an empty VM of the parent's shape.
fn spawn_shell(exe: &Path, clone: &Clone, vm: &MicroVm) -> Result<Child, String> {
    std::fs::create_dir_all(&clone.dir)
        .map_err(|e| format!("cannot create {}: {e}", clone.dir.display()))?;
    let mut cmd = Command::new(exe);
    cmd.arg("--api-sock").arg(&clone.info.api_sock);
    cmd.arg("--console").arg(&clone.info.console);
    cmd.arg("--log-path").arg(clone.dir.join("vmm.log"));
    cmd.arg("--shell-memory-mib")
        .arg(vm.machine.mem_size_mib.to_string());
    cmd.arg("--shell-vcpus")
        .arg(vm.machine.vcpu_count.to_string());
    if vm.machine.track_dirty_pages {
        cmd.arg("--track-dirty-pages");
    }
    let stderr =
        File::create(clone.dir.join("stderr.log")).map_err(|e| format!("stderr log: {e}"))?;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr);
    cmd.spawn()
        .map_err(|e| format!("cannot start {}: {e}", exe.display()))
}

/// Every clone needs its own tap for every network interface of the VM.
fn check_network_overrides(
    kinds: &[DevicePersistKind],
    params: &ForkParams,
) -> Result<(), ActionError> {
    let ifaces: Vec<&str> = kinds
        .iter()
        .filter_map(|k| match k {
            DevicePersistKind::Net { iface_id, .. } => Some(iface_id.as_str()),
            _ => None,
        })
        .collect();
    if ifaces.is_empty() {
        if params.network_overrides.is_empty() {
            return Ok(());
        }
        return Err(ActionError::bad_request(
            "network_overrides: the VM has no network interfaces",
        ));
    }
    if params.network_overrides.len() != params.count as usize {
        return Err(ActionError::bad_request(format!(
            "network_overrides: the VM has network interface(s) {ifaces:?}, so each of the {} clones needs its own taps: give one list of {{iface_id, host_dev_name}} per clone (got {} lists)",
            params.count,
            params.network_overrides.len()
        )));
    }
    let mut taps = std::collections::HashSet::new();
    for (index, list) in params.network_overrides.iter().enumerate() {
        for iface in &ifaces {
            if !list.iter().any(|o| o.iface_id == *iface) {
                return Err(ActionError::bad_request(format!(
                    "network_overrides: clone {index} has no tap for interface {iface}"
                )));
            }
        }
        for o in list {
            crate::persist::NetOverride::new(&o.host_dev_name, o.guest_mac.as_deref()).map_err(
                |e| ActionError::bad_request(format!("network_overrides: clone {index}: {e}")),
            )?;
            if !taps.insert(o.host_dev_name.clone()) {
                return Err(ActionError::bad_request(format!(
                    "network_overrides: tap {} is given to two clones",
                    o.host_dev_name
                )));
            }
        }
    }
    Ok(())
}

/// Copies writable drives and picks the clone's vsock socket.
fn prepare_devices(clone: &mut Clone, kinds: &[DevicePersistKind]) -> Result<(), String> {
    for kind in kinds {
        match kind {
            DevicePersistKind::Block {
                id,
                path,
                read_only,
            } => {
                let target = if *read_only {
                    path.clone()
                } else {
                    let copy = clone.dir.join(format!("{id}.img"));
                    copy_sparse(path, &copy)
                        .map_err(|e| format!("copying drive {id} ({}): {e}", path.display()))?;
                    copy
                };
                clone.drive_overrides.push((id.clone(), target));
            }
            DevicePersistKind::Vsock { .. } => {
                clone.info.vsock_uds = Some(clone.dir.join("vsock.sock"))
            }
            // Checked up front by check_network_overrides.
            DevicePersistKind::Net { .. } => {}
            // Each clone restores with a virtiofsd of its own on the same shared directory.
            DevicePersistKind::Fs(_) => {}
        }
    }
    Ok(())
}

/// Waits for the clone's API socket and asks it to load the snapshot.
fn load_clone(
    clone: &mut Clone,
    track_dirty_pages: bool,
    state: &Path,
    memory: &Path,
    backend: &str,
    new_generation: bool,
) -> Result<(), String> {
    let deadline = Instant::now() + CLONE_READY_TIMEOUT;
    while UnixStream::connect(&clone.info.api_sock).is_err() {
        if let Some(Ok(Some(status))) = clone.child.as_mut().map(|c| c.try_wait()) {
            let stderr = std::fs::read_to_string(clone.dir.join("stderr.log")).unwrap_or_default();
            return Err(format!("clone exited with {status}: {}", stderr.trim()));
        }
        if Instant::now() > deadline {
            return Err("clone API socket never came up".into());
        }
        std::thread::sleep(Duration::from_micros(500));
    }
    let overrides: serde_json::Map<String, serde_json::Value> = clone
        .drive_overrides
        .iter()
        .map(|(id, path)| {
            (
                id.clone(),
                serde_json::Value::String(path.display().to_string()),
            )
        })
        .collect();
    let mut body = serde_json::json!({
        "snapshot_path": state,
        "mem_backend": {"backend_type": "File", "backend_path": memory},
        "resume_vm": true,
        "track_dirty_pages": track_dirty_pages,
        "rollbox": {
            "restore_backend": backend,
            "new_generation": new_generation,
            "drive_overrides": overrides,
        },
    });
    if let Some(uds) = &clone.info.vsock_uds {
        body["vsock_override"] = serde_json::json!({ "uds_path": uds });
    }
    if !clone.net_overrides.is_empty() {
        body["network_overrides"] = serde_json::json!(clone.net_overrides);
    }
    let (status, answer) = unix_request(
        &clone.info.api_sock,
        "PUT",
        "/snapshot/load",
        Some(&body.to_string()),
        Some(CLONE_LOAD_TIMEOUT),
    )
    .map_err(|e| {
        format!(
            "loading the snapshot (answer awaited up to {} s): {e}",
            CLONE_LOAD_TIMEOUT.as_secs()
        )
    })?;
    match status {
        200 | 204 => Ok(()),
        _ => Err(format!(
            "clone refused the snapshot ({status}): {}",
            answer.trim()
        )),
    }
}
