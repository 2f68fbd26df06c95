//! One clone of a fork: its drives (copied once while the parent is paused, then once more
//! for each clone), its sockets and taps, and its load.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::cleanup::{remove_dir_all_quietly, CloneCleanup};
use super::error::ForkError;
use super::shell::{Shell, ShellLoad};
use crate::api::{
    CloneInfo, ForkParams, LoadSnapshotParams, MemBackend, NetworkOverride, RestoreExtension,
    VsockOverride,
};
use crate::device_manager::DevicePersistKind;
use crate::devices::virtio::net::NetOverride;

/// How long a clone may take to build its empty VM and say `ready`.
const CLONE_READY_TIMEOUT: Duration = Duration::from_secs(20);

/// How long a clone may take to load the snapshot: a VM with a virtio-fs volume copies its
/// memory and starts virtiofsd, which on a loaded host takes far longer than a cow restore.
const CLONE_LOAD_TIMEOUT: Duration = Duration::from_secs(120);

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

pub(super) struct Clone {
    pub(super) info: CloneInfo,
    pub(super) shell: Option<Shell>,
    pub(super) drive_overrides: Vec<(String, PathBuf)>,
    pub(super) net_overrides: Vec<NetworkOverride>,
    pub(super) cleanup: CloneCleanup,
}

impl Clone {
    pub(super) fn fail(&mut self, error: String) {
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

/// Every clone needs its own tap for every network interface of the VM.
pub(super) fn check_network_overrides(
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
pub(super) struct CloneDrive {
    pub(super) id: String,
    pub(super) source: PathBuf,
    pub(super) copy: bool,
}

/// Copies the writable drives of `kinds` into `dir` once.
pub(super) fn copy_drive_bases(
    kinds: &[DevicePersistKind],
    dir: &Path,
) -> Result<Vec<CloneDrive>, String> {
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
pub(super) fn prepare_devices(
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
pub(super) fn wait_ready(clone: &mut Clone) -> Result<(), String> {
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
pub(super) fn load_clone(
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
