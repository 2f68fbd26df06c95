//! Warm shells: `rollbox-vmm` processes started ahead, jailed as any sandbox's, each with an
//! empty VM of its shape (no guest state) until a create loads its snapshot into one (issue
//! 29's warm pool keeps them). Each shell
//! is started under the id of the sandbox it will become: its directory, its jail and its jail
//! cgroups already carry that name, so taking one renames nothing, and a shell the daemon
//! never handed out is swept at its next start like any sandbox it does not know.

use std::process::Child;

use super::super::api::{Sandbox, Snapshot, Template};
use super::super::util::remove_dir;
use super::{reap_child, vm, Launched, Supervisor};

pub use super::vm::ShellShape;

/// A VMM with an empty VM, waiting to become sandbox `id`.
pub struct Shell {
    pub id: String,
    /// What its jail was made for.
    pub shape: ShellShape,
    child: Child,
}

impl Shell {
    /// Whether its VMM still runs.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Supervisor {
    /// Starts a shell of `shape` for a future sandbox `id`, and waits until its API answers.
    pub async fn start_shell(&self, id: String, shape: ShellShape) -> Result<Shell, String> {
        let paths = vm::Paths::new(&self.sandboxes_dir.join(&id));
        let vmm = self.vmm.clone();
        let jail = self.jail.clone();
        let console_max_bytes = self.console_max_bytes;
        let spawn_paths = vm::Paths::new(&paths.dir);
        let spawn_shape = shape.clone();
        let spawned = tokio::task::spawn_blocking(move || {
            let spec = jail.as_ref().map(|jail| vm::JailSpec {
                jail,
                cgroups: Vec::new(),
                memory_mib: spawn_shape.memory_mib,
                vfio: Vec::new(),
            });
            vm::spawn_shell(
                &vmm,
                &spawn_paths,
                &spawn_shape,
                spec.as_ref(),
                console_max_bytes,
            )
        })
        .await
        .map_err(|e| e.to_string())?;
        let mut child = match spawned {
            Ok(child) => child,
            Err(e) => {
                self.forget_shell(&id).await;
                return Err(e.to_string());
            }
        };
        if let Err(e) = vm::wait_ready(&mut child, &paths, self.ready_timeout).await {
            reap_child(child).await;
            self.forget_shell(&id).await;
            return Err(e.to_string());
        }
        Ok(Shell { id, shape, child })
    }

    /// Ends a shell nobody took: its VMM, its directory and its jail groups.
    pub async fn discard_shell(&self, shell: Shell) {
        reap_child(shell.child).await;
        self.forget_shell(&shell.id).await;
    }

    /// Removes a shell's directory and jail groups (its VMM ended), on a blocking thread:
    /// each group's rmdir waits for an RCU grace period.
    async fn forget_shell(&self, id: &str) {
        let dir = self.sandboxes_dir.join(id);
        let remove_groups = self.jail_groups_remover(id, "warm shell");
        let _ = tokio::task::spawn_blocking(move || {
            let _ = remove_dir(&dir);
            remove_groups();
        })
        .await;
    }

    /// What a restore of `snapshot` (of `template`) needs of a shell: its memory, its disk's
    /// size, and its template's shared base; None when its disk cannot be read.
    pub fn restore_needs(template: &Template, snapshot: &Snapshot) -> Option<(u32, u64)> {
        let disk_bytes = if template.rootfs.is_some() {
            std::fs::metadata(snapshot.dir.join("rootfs.img"))
                .ok()?
                .len()
        } else {
            0
        };
        Some((snapshot.memory_mib, disk_bytes))
    }

    /// Runs `sandbox` (whose id is the shell's) from `snapshot` in `shell`: the snapshot
    /// loaded through the shell's API, the VM resumed. On failure the shell is ended.
    pub async fn launch_in_shell(
        &self,
        mut shell: Shell,
        sandbox: &Sandbox,
        template: &Template,
        snapshot: &Snapshot,
    ) -> Result<Launched, String> {
        debug_assert_eq!(shell.id, sandbox.id);
        let started = std::time::Instant::now();
        let identity = if sandbox.deterministic {
            vm::Identity::Exact
        } else {
            vm::Identity::Clone
        };
        let paths = vm::Paths::new(&sandbox.dir);
        let snapshot_dir = snapshot.dir.clone();
        let rootfs = template.rootfs.is_some();
        let base = shell.shape.base.clone();
        let console_max_bytes = self.console_max_bytes;
        let jailed = self.jail.is_some();
        let loaded = tokio::task::spawn_blocking(move || {
            let restore = vm::Restore {
                snapshot_dir: &snapshot_dir,
                rootfs,
                base: base.as_deref(),
                identity,
                console_max_bytes,
                nic: None,
            };
            vm::load_in_shell(&paths, &restore, jailed)
        })
        .await
        .map_err(|e| e.to_string())
        .and_then(|loaded| loaded.map_err(|e| e.to_string()));
        let pid = shell.pid();
        let start = match (loaded, shell.alive(), vm::start_time(pid)) {
            (Ok(()), true, Some(start)) => Ok(start),
            (Err(e), _, _) => Err(format!("the warm shell's load: {e}")),
            _ => Err(vm::VmError::Vanished(pid).to_string()),
        };
        let start = match start {
            Ok(start) => start,
            Err(e) => {
                reap_child(shell.child).await;
                self.release(sandbox);
                return Err(e);
            }
        };
        if log::log_enabled!(log::Level::Debug) {
            log::debug!(
                "launch {} in a warm shell: load {:.2} ms",
                sandbox.id,
                super::ms_since(started)
            );
        }
        Ok(Launched {
            child: shell.child,
            pid,
            start,
            volume_daemons: Vec::new(),
        })
    }
}
