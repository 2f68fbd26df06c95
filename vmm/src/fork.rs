//! rollbox extension: fork a running microVM into N clones. The parent pauses briefly for a
//! snapshot and resumes; each clone is a new `rollbox-vmm --restore` process with its own
//! vsock socket, drive copies, API socket and console, and succeeds or fails on its own.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::api::{ActionError, CloneInfo, ForkParams, ForkResult};
use crate::builder::MicroVm;
use crate::devices::bus::lock;
use crate::devices::virtio::persist::DevicePersistKind;
use crate::persist::{create_snapshot, SnapshotType};

/// How long a clone may take to come up.
const CLONE_READY_TIMEOUT: Duration = Duration::from_secs(20);
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

struct Pending {
    info: CloneInfo,
    child: Option<Child>,
}

/// Pauses `vm`, snapshots it, resumes it, and starts `params.count` clones.
pub fn fork(vm: &mut MicroVm, params: &ForkParams) -> Result<ForkResult, ActionError> {
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
        .parse::<crate::persist::RestoreBackend>()
        .map_err(ActionError::bad_request)?;

    let was_paused = vm.paused;
    vm.pause();
    let snapshot = create_snapshot(
        vm,
        SnapshotType::Full,
        &dir.join("vmstate"),
        &dir.join("memory"),
    );
    if !was_paused {
        vm.resume();
    }
    let paused_ms = started.elapsed().as_secs_f64() * 1e3;
    snapshot.map_err(|e| ActionError::bad_request(format!("fork snapshot: {e}")))?;

    let kinds: Vec<DevicePersistKind> = vm
        .virtio
        .iter()
        .map(|s| lock(&s.transport).device().persist_kind())
        .collect();
    let exe = std::env::current_exe()
        .map_err(|e| ActionError::bad_request(format!("cannot find rollbox-vmm: {e}")))?;
    let mut pending = Vec::new();
    for index in 0..params.count {
        let clone_dir = dir.join(format!("clone-{index}"));
        let mut info = CloneInfo {
            index,
            pid: None,
            api_sock: clone_dir.join("api.sock"),
            vsock_uds: None,
            console: clone_dir.join("console.log"),
            error: None,
        };
        match spawn_clone(&exe, &dir, &clone_dir, &kinds, params, &backend, &mut info) {
            Ok(child) => {
                info.pid = Some(child.id());
                pending.push(Pending {
                    info,
                    child: Some(child),
                });
            }
            Err(e) => {
                info.error = Some(e);
                pending.push(Pending { info, child: None });
            }
        }
    }
    wait_for_clones(&mut pending);
    let clones = pending
        .into_iter()
        .map(|mut p| {
            if let Some(mut child) = p.child.take() {
                // Reap the clone whenever it ends; it outlives this request.
                std::thread::spawn(move || child.wait());
            }
            p.info
        })
        .collect();
    Ok(ForkResult {
        snapshot_dir: dir,
        paused_ms,
        elapsed_ms: started.elapsed().as_secs_f64() * 1e3,
        clones,
    })
}

fn spawn_clone(
    exe: &Path,
    snapshot_dir: &Path,
    clone_dir: &Path,
    kinds: &[DevicePersistKind],
    params: &ForkParams,
    backend: &str,
    info: &mut CloneInfo,
) -> Result<Child, String> {
    std::fs::create_dir_all(clone_dir)
        .map_err(|e| format!("cannot create {}: {e}", clone_dir.display()))?;
    let mut cmd = Command::new(exe);
    cmd.arg("--restore").arg(snapshot_dir);
    cmd.arg("--restore-backend").arg(backend);
    cmd.arg("--api-sock").arg(&info.api_sock);
    cmd.arg("--console").arg(&info.console);
    cmd.arg("--log-path").arg(clone_dir.join("vmm.log"));
    if params.new_generation {
        cmd.arg("--new-generation");
    }
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
                    let copy = clone_dir.join(format!("{id}.img"));
                    copy_sparse(path, &copy)
                        .map_err(|e| format!("copying drive {id} ({}): {e}", path.display()))?;
                    copy
                };
                cmd.arg("--drive-override")
                    .arg(format!("{id}={}", target.display()));
            }
            DevicePersistKind::Vsock { .. } => {
                let uds = clone_dir.join("vsock.sock");
                cmd.arg("--vsock-uds").arg(&uds);
                info.vsock_uds = Some(uds);
            }
        }
    }
    let stderr =
        File::create(clone_dir.join("stderr.log")).map_err(|e| format!("stderr log: {e}"))?;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr);
    cmd.spawn()
        .map_err(|e| format!("cannot start {}: {e}", exe.display()))
}

fn wait_for_clones(pending: &mut [Pending]) {
    let deadline = Instant::now() + CLONE_READY_TIMEOUT;
    loop {
        let mut waiting = false;
        for p in pending.iter_mut() {
            let Some(child) = p.child.as_mut() else {
                continue;
            };
            if p.info.error.is_some() || ready(&p.info.api_sock) {
                continue;
            }
            match child.try_wait() {
                Ok(Some(status)) => {
                    let stderr =
                        std::fs::read_to_string(p.info.console.with_file_name("stderr.log"))
                            .unwrap_or_default();
                    p.info.error = Some(format!("clone exited with {status}: {}", stderr.trim()));
                    p.child = None;
                }
                Ok(None) if Instant::now() > deadline => {
                    p.info.error = Some("clone did not come up in time".into());
                }
                Ok(None) => waiting = true,
                Err(e) => p.info.error = Some(format!("cannot watch the clone: {e}")),
            }
        }
        if !waiting {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Whether a clone's API socket answers (its restore finished before the socket was bound).
fn ready(sock: &Path) -> bool {
    UnixStream::connect(sock).is_ok()
}
